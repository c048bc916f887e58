//! The write-intent bitmap in memory: one bit per region of the array.
//!
//! A bit set on disk says the region's copies may differ. The rules (after md's):
//!
//! - A write (or discard, or write-zeroes) to a region whose bit is not yet on disk waits
//!   until a superblock with the bit set has reached every member in use
//!   ([`super::Metadata::mark`]); then it is submitted. So after any crash, every region
//!   a write was in flight to has its bit set.
//! - Bits are cleared lazily ([`super::Metadata::clear_idle`]): only while every member
//!   is current, for regions with no write in flight and none started for a whole
//!   interval, after a flush of every member has made their writes durable.
//! - While a member is absent or failed, no bit is cleared: the bitmap then holds every
//!   region the member missed, and it is brought back by copying only those.
//!
//! The hot path costs one atomic addition and one load per region a write touches when it
//! starts, and one addition when it ends. The bits in [`Bitmap::durable`] are the ones on
//! disk; a bit is set there only after the superblock that carries it is written, and
//! cleared there before the superblock that clears it is.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

use cairn_core::Io;

/// One array's bitmap.
pub struct Bitmap {
    shift: u32,
    regions: usize,
    /// Bits on disk.
    durable: Box<[AtomicU64]>,
    /// Writes started per region.
    started: Box<[AtomicU64]>,
    /// Writes finished per region.
    finished: Box<[AtomicU64]>,
    /// Regions to recover: those whose bit was set when the array started, and at each
    /// re-add of a member ([`Bitmap::recover_dirty`]). What a resync or a partial
    /// recovery copies, and where a member recovered from the bitmap is not read.
    recover: Box<[AtomicU64]>,
}

impl Bitmap {
    /// A bitmap of `region_bytes` regions over `array_bytes`, starting with `bits` (as
    /// the superblock stores them) set on disk and to recover.
    pub fn new(region_bytes: u64, array_bytes: u64, bits: &[u8]) -> Bitmap {
        assert!(region_bytes.is_power_of_two(), "a power-of-two region");
        let regions = array_bytes.div_ceil(region_bytes) as usize;
        let words = regions.div_ceil(64);
        let mut at_start = vec![0u64; words];
        for r in 0..regions {
            if bits.get(r / 8).is_some_and(|b| b & (1 << (r % 8)) != 0) {
                at_start[r / 64] |= 1 << (r % 64);
            }
        }
        Bitmap {
            shift: region_bytes.trailing_zeros(),
            regions,
            durable: at_start.iter().map(|&w| AtomicU64::new(w)).collect(),
            started: (0..regions).map(|_| AtomicU64::new(0)).collect(),
            finished: (0..regions).map(|_| AtomicU64::new(0)).collect(),
            recover: at_start.iter().map(|&w| AtomicU64::new(w)).collect(),
        }
    }

    /// Bytes one bit covers.
    pub fn region_bytes(&self) -> u64 {
        1 << self.shift
    }

    /// How many regions.
    pub fn regions(&self) -> usize {
        self.regions
    }

    /// The region of array offset `offset`.
    #[inline]
    pub fn region(&self, offset: u64) -> usize {
        ((offset >> self.shift) as usize).min(self.regions - 1)
    }

    /// The regions `[offset, offset + len)` touches.
    #[inline]
    pub fn regions_of(&self, offset: u64, len: u64) -> Range<usize> {
        self.region(offset)..self.region(offset + len.max(1) - 1) + 1
    }

    /// Counts a write that starts; whether every region it touches has its bit on disk
    /// (if not, [`super::Metadata::mark`] must run before it is submitted). Its end
    /// must be counted with [`Bitmap::end_write`] either way.
    #[inline]
    pub fn start_write(&self, io: &Io) -> bool {
        let mut on_disk = true;
        for r in self.regions_of(io.offset, io.len) {
            // Counted before the bit is looked at: a clearing pass that misses this
            // count has cleared the bit first, so the look-up below sees it clear.
            self.started[r].fetch_add(1, SeqCst);
            on_disk &= self.durable(r);
        }
        on_disk
    }

    /// Counts the end of a write [`Bitmap::start_write`] counted.
    #[inline]
    pub fn end_write(&self, io: &Io) {
        for r in self.regions_of(io.offset, io.len) {
            self.finished[r].fetch_add(1, SeqCst);
        }
    }

    /// Whether region `r`'s bit is on disk.
    #[inline]
    pub fn durable(&self, r: usize) -> bool {
        self.durable[r / 64].load(SeqCst) & (1 << (r % 64)) != 0
    }

    pub(super) fn set_durable(&self, r: usize) {
        self.durable[r / 64].fetch_or(1 << (r % 64), SeqCst);
    }

    pub(super) fn clear_durable(&self, r: usize) {
        self.durable[r / 64].fetch_and(!(1 << (r % 64)), SeqCst);
    }

    /// Whether region `r` is to be recovered (dirty when the array started or when a
    /// member was re-added).
    #[inline]
    pub fn to_recover(&self, r: usize) -> bool {
        self.recover[r / 64].load(SeqCst) & (1 << (r % 64)) != 0
    }

    /// The first region at or after `r` to be recovered.
    pub fn next_to_recover(&self, r: usize) -> Option<usize> {
        (r..self.regions).find(|&x| self.to_recover(x))
    }

    /// Regions to be recovered.
    pub fn to_recover_count(&self) -> usize {
        self.recover
            .iter()
            .map(|w| w.load(SeqCst).count_ones() as usize)
            .sum()
    }

    /// A member is re-added: every region whose bit is on disk now is to be recovered
    /// (no bit is cleared while a member is away, so these are all it missed). With
    /// `keep`, the regions to recover already stay so (a resync or another recovery
    /// still needs them); without, only these are.
    pub(crate) fn recover_dirty(&self, keep: bool) {
        for (r, d) in self.recover.iter().zip(self.durable.iter()) {
            let bits = d.load(SeqCst);
            if keep {
                r.fetch_or(bits, SeqCst);
            } else {
                r.store(bits, SeqCst);
            }
        }
    }

    /// Regions whose bit is on disk now.
    pub fn dirty_count(&self) -> usize {
        self.durable
            .iter()
            .map(|w| w.load(SeqCst).count_ones() as usize)
            .sum()
    }

    /// The bits as the superblock stores them: those on disk, and `extra`.
    pub fn image(&self, extra: &[usize]) -> Vec<u8> {
        let mut b = vec![0u8; self.regions.div_ceil(8)];
        for r in 0..self.regions {
            if self.durable(r) {
                b[r / 8] |= 1 << (r % 8);
            }
        }
        for &r in extra {
            b[r / 8] |= 1 << (r % 8);
        }
        b
    }

    /// Writes started per region, for an idle check: see [`Bitmap::idle`].
    pub fn started_now(&self) -> Vec<u64> {
        self.started.iter().map(|s| s.load(SeqCst)).collect()
    }

    /// Region `r` has its bit on disk, no write in flight, and none started since
    /// `before` (a [`Bitmap::started_now`]) was taken.
    pub fn idle(&self, r: usize, before: &[u64]) -> bool {
        let s = self.started[r].load(SeqCst);
        self.durable(r) && s == before[r] && self.finished[r].load(SeqCst) == s
    }

    /// Whether a write to region `r` started since `before`.
    pub(super) fn written_since(&self, r: usize, before: &[u64]) -> bool {
        self.started[r].load(SeqCst) != before[r]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_core::{Op, SinkId};

    fn write(offset: u64, len: u64) -> Io {
        Io::nodata(Op::Write, offset, len, SinkId(0), 0)
    }

    #[test]
    fn regions_and_bits() {
        // 10 regions of 1 MiB; regions 1 and 9 dirty.
        let bm = Bitmap::new(1 << 20, 10 << 20, &[0b10, 0b10]);
        assert_eq!(bm.regions(), 10);
        assert_eq!(bm.regions_of(0, 1), 0..1);
        assert_eq!(bm.regions_of((1 << 20) - 512, 1024), 0..2);
        assert_eq!(bm.regions_of(10 << 20, 4096), 9..10);
        assert!(bm.to_recover(1) && bm.to_recover(9) && !bm.to_recover(2));
        assert_eq!(bm.next_to_recover(2), Some(9));
        assert_eq!(bm.to_recover_count(), 2);
        assert_eq!(bm.image(&[3]), vec![0b1010, 0b10]);
        assert!(!bm.start_write(&write(3 << 20, 4096)));
        assert!(bm.start_write(&write(1 << 20, 4096)));
        bm.set_durable(3);
        assert_eq!(bm.dirty_count(), 3);
        // A re-add recovers what is dirty now: with the old set kept, or alone.
        bm.clear_durable(9);
        bm.recover_dirty(true);
        assert_eq!(bm.to_recover_count(), 3);
        assert!(bm.to_recover(3) && bm.to_recover(9));
        bm.recover_dirty(false);
        assert_eq!(bm.to_recover_count(), 2);
        assert!(bm.to_recover(1) && bm.to_recover(3) && !bm.to_recover(9));
    }

    #[test]
    fn idle_means_no_write_in_flight_and_none_started_since() {
        let bm = Bitmap::new(1 << 20, 4 << 20, &[0b1111]);
        let before = bm.started_now();
        assert!(bm.idle(0, &before));
        let w = write(0, 4096);
        bm.start_write(&w);
        assert!(!bm.idle(0, &before));
        bm.end_write(&w);
        // Finished, but started after the snapshot: not idle for a whole interval.
        assert!(!bm.idle(0, &before));
        let before = bm.started_now();
        assert!(bm.idle(0, &before));
        bm.clear_durable(0);
        assert!(!bm.idle(0, &before));
    }
}
