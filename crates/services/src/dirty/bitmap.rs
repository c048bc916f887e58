//! One dirty bitmap in memory: its bits (those on disk), its flags and owner, and its
//! readers' hold ([`Reader`], what an NBD connection's `qemu:dirty-bitmap` context
//! reads). The store ([`super::store`]) changes them, under its lock.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cairn_core::DirtyMap;

use super::format::{self, Entry, CHECKPOINT, DISABLED, INCONSISTENT, PAGE, PAGE_WORDS};

/// Bits to set, as (word index, bits of that word).
pub(super) type Words = Vec<(usize, u64)>;

/// One bitmap in memory.
pub struct Bitmap {
    pub(super) name: String,
    /// Empty, or the snapshot it is attached to; changed under the store's lock.
    pub(super) owner: Mutex<String>,
    pub(super) shift: u32,
    pub(super) bits: u64,
    pub(super) area: u64,
    /// The bits on disk.
    pub(super) words: Box<[AtomicU64]>,
    /// [`DISABLED`], [`INCONSISTENT`]; changed under the store's lock.
    pub(super) flags: AtomicU32,
    /// NBD connections reading it.
    pub(super) readers: AtomicUsize,
}

impl Bitmap {
    /// Bitmap `e`, every bit clear (its bits are loaded by the store).
    pub(super) fn new(e: &Entry) -> Bitmap {
        let words = (0..e.bits.div_ceil(64))
            .map(|_| AtomicU64::new(0))
            .collect();
        Bitmap {
            name: e.name.clone(),
            owner: Mutex::new(e.owner.clone()),
            shift: e.shift,
            bits: e.bits,
            area: e.area,
            words,
            flags: AtomicU32::new(e.flags),
            readers: AtomicUsize::new(0),
        }
    }

    /// Sets its words from `first` on to `bytes` (little-endian words, the last one
    /// possibly partial: a bitmap whose bits are not a whole number of words keeps its
    /// last ones). Bits past its end are dropped.
    pub(super) fn load(&mut self, first: usize, bytes: &[u8]) {
        for (i, chunk) in bytes.chunks(8).enumerate() {
            let Some(word) = self.words.get_mut(first + i) else {
                break;
            };
            let mut v = [0u8; 8];
            v[..chunk.len()].copy_from_slice(chunk);
            *word.get_mut() = u64::from_le_bytes(v);
        }
        self.trim();
    }

    /// Sets every bit of `n` words from `first` on: what bits that could not be read,
    /// or failed their check, read as, since nothing says their granules did not change.
    pub(super) fn fill(&mut self, first: usize, n: usize) {
        for w in self.words.iter_mut().skip(first).take(n) {
            *w.get_mut() = u64::MAX;
        }
        self.trim();
    }

    /// Clears the bits of its last word past its end.
    fn trim(&mut self) {
        let tail = self.bits % 64;
        if let (Some(last), true) = (self.words.last_mut(), tail != 0) {
            *last.get_mut() &= (1u64 << tail) - 1;
        }
    }

    /// Pages of its area (version 2).
    pub(super) fn pages(&self) -> usize {
        (format::area_bytes(format::VERSION, self.bits) / PAGE) as usize
    }

    pub(super) fn entry(&self) -> Entry {
        Entry {
            name: self.name.clone(),
            owner: self.owner(),
            shift: self.shift,
            bits: self.bits,
            flags: self.flags.load(Ordering::Relaxed),
            area: self.area,
        }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether writes set it.
    pub fn enabled(&self) -> bool {
        self.flags.load(Ordering::Relaxed) & DISABLED == 0
    }

    /// Empty, or the snapshot it is attached to.
    pub fn owner(&self) -> String {
        self.owner.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(super) fn set_owner(&self, owner: &str) {
        *self.owner.lock().unwrap_or_else(|p| p.into_inner()) = owner.to_string();
    }

    pub(super) fn has(&self, flag: u32) -> bool {
        self.flags.load(Ordering::Relaxed) & flag != 0
    }

    fn bit(&self, i: u64) -> bool {
        self.words[(i / 64) as usize].load(Ordering::Acquire) & (1 << (i % 64)) != 0
    }

    /// Whether every bit `[offset, offset + len)` touches is set (on disk). Bytes past
    /// its end are covered only once it is marked inconsistent (nothing more to say).
    #[inline]
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        let (first, mut last) = (offset >> self.shift, (offset + len - 1) >> self.shift);
        if last >= self.bits {
            if !self.has(INCONSISTENT) {
                return false;
            }
            if first >= self.bits {
                return true;
            }
            last = self.bits - 1;
        }
        let (fw, lw) = ((first / 64) as usize, (last / 64) as usize);
        for w in fw..=lw {
            let lo = if w == fw { first % 64 } else { 0 };
            let hi = if w == lw { last % 64 } else { 63 };
            let mask = (u64::MAX >> (63 - hi)) & (u64::MAX << lo);
            if self.words[w].load(Ordering::Acquire) & mask != mask {
                return false;
            }
        }
        true
    }

    /// Bits set.
    pub fn count(&self) -> u64 {
        self.words
            .iter()
            .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
            .sum()
    }

    /// What it lists.
    pub fn info(&self, device_bytes: u64) -> BitmapInfo {
        let flags = self.flags.load(Ordering::Relaxed);
        let owner = self.owner();
        BitmapInfo {
            name: self.name.clone(),
            snapshot: (!owner.is_empty()).then_some(owner),
            checkpoint: flags & CHECKPOINT != 0,
            granularity: 1 << self.shift,
            dirty_bytes: (self.count() << self.shift).min(device_bytes),
            enabled: flags & DISABLED == 0,
            inconsistent: flags & INCONSISTENT != 0,
            readers: self.readers.load(Ordering::Relaxed),
        }
    }

    /// The words `[offset, offset + len)` needs that are not set yet, as (word, bits),
    /// clipped to its end; and whether the range runs past its end.
    pub(super) fn missing(&self, offset: u64, len: u64) -> (Words, bool) {
        let first = offset >> self.shift;
        let last = (offset + len - 1) >> self.shift;
        let past = last >= self.bits;
        let mut out = Vec::new();
        if first >= self.bits {
            return (out, past);
        }
        let last = last.min(self.bits - 1);
        let (fw, lw) = ((first / 64) as usize, (last / 64) as usize);
        for w in fw..=lw {
            let lo = if w == fw { first % 64 } else { 0 };
            let hi = if w == lw { last % 64 } else { 63 };
            let mask = (u64::MAX >> (63 - hi)) & (u64::MAX << lo);
            let need = mask & !self.words[w].load(Ordering::Relaxed);
            if need != 0 {
                out.push((w, need));
            }
        }
        (out, past)
    }

    /// Page `p` of its area with `extra` (word, bits) set too, sealed with the store's
    /// `identity`: the whole page as written.
    pub(super) fn page_image(&self, identity: u64, p: usize, extra: &[(usize, u64)]) -> Vec<u8> {
        let mut b = vec![0u8; PAGE as usize];
        let base = p * PAGE_WORDS;
        for (i, chunk) in b.chunks_mut(8).take(PAGE_WORDS).enumerate() {
            let w = base + i;
            let Some(word) = self.words.get(w) else { break };
            let mut v = word.load(Ordering::Relaxed);
            for &(ew, bits) in extra {
                if ew == w {
                    v |= bits;
                }
            }
            chunk.copy_from_slice(&v.to_le_bytes());
        }
        format::seal_page(&mut b, identity, self.area, p as u64);
        b
    }
}

/// A bitmap as `bitmap list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapInfo {
    /// Its name.
    pub name: String,
    /// The snapshot it is attached to (`None`: the device's own).
    pub snapshot: Option<String>,
    /// Made by a checkpoint.
    pub checkpoint: bool,
    /// Bytes per bit.
    pub granularity: u64,
    /// Bytes its set bits cover.
    pub dirty_bytes: u64,
    /// Writes set it.
    pub enabled: bool,
    /// It may miss changes.
    pub inconsistent: bool,
    /// NBD connections reading it.
    pub readers: usize,
}

/// A reader's hold on a bitmap: while one lives, the bitmap cannot be removed or cleared.
pub struct Reader(Arc<Bitmap>);

impl Reader {
    pub(super) fn new(b: Arc<Bitmap>) -> Reader {
        b.readers.fetch_add(1, Ordering::Relaxed);
        Reader(b)
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.0.readers.fetch_sub(1, Ordering::Relaxed);
    }
}

impl DirtyMap for Reader {
    fn granularity(&self) -> u64 {
        1 << self.0.shift
    }

    fn runs(&self, offset: u64, len: u64, most: usize, out: &mut Vec<(u64, bool)>) {
        let b = &self.0;
        let end = offset.saturating_add(len);
        let mut at = offset;
        let push = |out: &mut Vec<(u64, bool)>, n: u64, dirty: bool| match out.last_mut() {
            Some(last) if last.1 == dirty => last.0 += n,
            _ => out.push((n, dirty)),
        };
        while at < end && out.len() <= most {
            let bit = at >> b.shift;
            if bit >= b.bits {
                // Past its end: nothing says those bytes did not change.
                push(out, end - at, true);
                break;
            }
            // A whole word of one state is skipped at once.
            let w = b.words[(bit / 64) as usize].load(Ordering::Acquire);
            let (next, dirty) = if bit.is_multiple_of(64) && (w == 0 || w == u64::MAX) {
                ((bit + 64).min(b.bits), w != 0)
            } else {
                (bit + 1, b.bit(bit))
            };
            let stop = (next << b.shift).min(end);
            push(out, stop - at, dirty);
            at = stop;
        }
        if out.len() > most {
            out.truncate(most);
        }
    }

    fn inconsistent(&self) -> bool {
        self.0.flags.load(Ordering::Relaxed) & INCONSISTENT != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(bits: u64) -> Entry {
        Entry {
            name: "b".into(),
            owner: String::new(),
            shift: 12,
            bits,
            flags: 0,
            area: format::AREAS,
        }
    }

    #[test]
    fn a_partial_last_word_is_loaded_and_bits_past_the_end_are_not() {
        // 80 bits: one whole word and 16 bits of a second, in 10 bytes.
        let mut b = Bitmap::new(&entry(80));
        let mut bytes = vec![0u8; 10];
        bytes[0] = 1;
        bytes[9] = 0x80;
        b.load(0, &bytes);
        assert_eq!(b.count(), 2);
        assert!(b.bit(0) && b.bit(79));
        // Bits past the end in the bytes read are dropped.
        let mut b = Bitmap::new(&entry(80));
        b.load(0, &[0xff; 16]);
        assert_eq!(b.count(), 80);
    }

    #[test]
    fn a_failed_page_reads_dirty_and_pages_carry_their_words() {
        let bits = format::PAGE_BITS + 100;
        let mut b = Bitmap::new(&entry(bits));
        assert_eq!(b.pages(), 2);
        b.fill(PAGE_WORDS, PAGE_WORDS);
        assert_eq!(b.count(), 100);
        b.fill(0, PAGE_WORDS);
        assert_eq!(b.count(), bits);
        let b = Bitmap::new(&entry(bits));
        let image = b.page_image(5, 1, &[(PAGE_WORDS, 0b101)]);
        assert_eq!(format::check_page(&image, 5, format::AREAS, 1), Ok(()));
        assert_eq!(&image[..8], &5u64.to_le_bytes());
        assert!(image[8..4088].iter().all(|&x| x == 0));
    }
}
