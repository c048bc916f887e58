//! `mem`: a sparse RAM disk. Unwritten blocks read as zeros; memory grows with data.
//!
//! Data lives in 2 MiB anonymous memory regions, mapped the first time one of their bytes
//! is written and found through a two-level table of atomic pointers, so every queue (one
//! per reactor thread) reads and writes without a lock. The kernel backs a region page by
//! page as it is first written (4 KiB at a time; untouched pages read as the shared zero
//! page), so memory grows with the data written, and no allocator runs per request.
//! Discard and write-zeroes give whole pages back to the kernel (`MADV_DONTNEED`) and zero
//! partial ones. Regions stay mapped until the device is dropped. A bit per page records
//! whether it holds written data, for the allocation map: a page zeroed whole is a hole
//! again (unless the write-zeroes asked for `NO_HOLE`).
//!
//! With `volatile = true` ([`Volatile`]) the device models a disk's volatile write cache
//! for crash tests: writes are lost by a power cut until a flush makes them durable, and a
//! FUA request makes its own range durable and nothing else, as on a real disk.
//!
//! Concurrent requests that overlap the same bytes race the way they do on a real disk:
//! the result is some interleaving of their bytes. That is the block-device contract, and
//! every byte pattern is a valid `u8`, so no other harm can follow.

use std::ptr;
use std::rc::Rc;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::Arc;

use cairn_core::{
    Caps, Core, Device, Error, Geometry, Io, IoFlags, IoStatus, Op, Queue, QueueStats,
};

/// Bytes per kernel page (the granularity at which memory is given back).
pub const PAGE_BYTES: u64 = 4096;
/// Bytes per mapped region.
pub const REGION_BYTES: u64 = 2 << 20;
/// Regions per second-level table (1 GiB).
const L2_REGIONS: u64 = 512;
/// Largest mem device (64 TiB): bounds the first-level table at 64 Ki entries.
pub const MEM_SIZE_MAX: u64 = 64 << 40;

/// 64-bit words of one region's page map (a bit per 4 KiB page).
const MAP_WORDS: u64 = REGION_BYTES / PAGE_BYTES / 64;

struct L2 {
    regions: [AtomicPtr<u8>; L2_REGIONS as usize],
    /// Per region, a bit per page: set by a write that puts data there, cleared (before
    /// the page is given back) by a discard or write-zeroes of the whole page. A set bit
    /// over zeros is allowed (a concurrent zeroing may win), a clear bit over data never
    /// happens: the allocation map may say "data" for zeros, never "hole" for data.
    written: Box<[AtomicU64]>,
    /// Per region, a bit per page: set by a write-zeroes with `NO_HOLE` of the whole page
    /// (allocated zeroes), cleared by a discard or plain write-zeroes of it. Writes leave it
    /// alone (no cost on the write path): a set bit only says "check this page", and
    /// [`MemStore::extents`] reports allocated zeroes for a unit only after reading that
    /// its pages hold nothing but zeroes.
    zeroed: Box<[AtomicU64]>,
}

/// Sets (or clears) the bits of pages `p0..p1` in a region's page map.
fn mark_pages(words: &[AtomicU64], p0: u64, p1: u64, set: bool) {
    let mut p = p0;
    while p < p1 {
        let (w, lo) = ((p / 64) as usize, p % 64);
        let hi = (p1 - (p - lo)).min(64);
        let mask = (u64::MAX >> (64 - (hi - lo))) << lo;
        let now = words[w].load(Ordering::Relaxed);
        if set && now & mask != mask {
            words[w].fetch_or(mask, Ordering::Relaxed);
        } else if !set && now & mask != 0 {
            words[w].fetch_and(!mask, Ordering::Relaxed);
        }
        p += hi - lo;
    }
}

/// The shared store behind every queue of a mem device.
pub struct MemStore {
    size_bytes: u64,
    l1: Box<[AtomicPtr<L2>]>,
    regions: AtomicU64,
}

impl MemStore {
    /// An empty store of `size_bytes`.
    pub fn new(size_bytes: u64) -> MemStore {
        let l1_len = size_bytes.div_ceil(REGION_BYTES * L2_REGIONS) as usize;
        let l1 = (0..l1_len)
            .map(|_| AtomicPtr::new(ptr::null_mut()))
            .collect();
        MemStore {
            size_bytes,
            l1,
            regions: AtomicU64::new(0),
        }
    }

    /// Bytes of address space mapped so far (memory in use is at most this).
    pub fn allocated_bytes(&self) -> u64 {
        self.regions.load(Ordering::Relaxed) * REGION_BYTES
    }

    #[inline]
    fn region(&self, index: u64) -> *mut u8 {
        let l2 = self.l1[(index / L2_REGIONS) as usize].load(Ordering::Acquire);
        if l2.is_null() {
            return ptr::null_mut();
        }
        // SAFETY: L2 tables are never freed before the store is dropped.
        unsafe { (*l2).regions[(index % L2_REGIONS) as usize].load(Ordering::Acquire) }
    }

    /// Region `index`'s words of one of its second-level table's page maps (`pick`
    /// chooses which), once that table exists.
    #[inline]
    fn map_of(&self, index: u64, pick: fn(&L2) -> &[AtomicU64]) -> Option<&[AtomicU64]> {
        let l2 = self.l1[(index / L2_REGIONS) as usize].load(Ordering::Acquire);
        if l2.is_null() {
            return None;
        }
        let at = (index % L2_REGIONS * MAP_WORDS) as usize;
        // SAFETY: L2 tables are never freed before the store is dropped.
        let l2: &L2 = unsafe { &*l2 };
        Some(&pick(l2)[at..at + MAP_WORDS as usize])
    }

    /// Region `index`'s page map, once its second-level table exists.
    #[inline]
    fn page_map(&self, index: u64) -> Option<&[AtomicU64]> {
        self.map_of(index, |l2| &l2.written)
    }

    /// Region `index`'s map of pages zeroed with `NO_HOLE` (see [`L2::zeroed`]).
    #[inline]
    fn zeroed_map(&self, index: u64) -> Option<&[AtomicU64]> {
        self.map_of(index, |l2| &l2.zeroed)
    }

    fn region_or_map(&self, index: u64) -> *mut u8 {
        let slot = &self.l1[(index / L2_REGIONS) as usize];
        let mut l2 = slot.load(Ordering::Acquire);
        if l2.is_null() {
            let fresh = Box::into_raw(Box::new(L2 {
                regions: std::array::from_fn(|_| AtomicPtr::new(ptr::null_mut())),
                written: (0..L2_REGIONS * MAP_WORDS)
                    .map(|_| AtomicU64::new(0))
                    .collect(),
                zeroed: (0..L2_REGIONS * MAP_WORDS)
                    .map(|_| AtomicU64::new(0))
                    .collect(),
            }));
            match slot.compare_exchange(ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => l2 = fresh,
                Err(winner) => {
                    // SAFETY: `fresh` was never published.
                    drop(unsafe { Box::from_raw(fresh) });
                    l2 = winner;
                }
            }
        }
        // SAFETY: L2 tables live as long as the store.
        let region_slot = unsafe { &(*l2).regions[(index % L2_REGIONS) as usize] };
        let region = region_slot.load(Ordering::Acquire);
        if !region.is_null() {
            return region;
        }
        let fresh = map_region();
        match region_slot.compare_exchange(
            ptr::null_mut(),
            fresh,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => {
                self.regions.fetch_add(1, Ordering::Relaxed);
                fresh
            }
            Err(winner) => {
                unmap_region(fresh);
                winner
            }
        }
    }

    /// Splits `[offset, offset+len)` into (region index, offset in region, length, position).
    fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, usize, usize, usize)> {
        let mut pos = 0u64;
        std::iter::from_fn(move || {
            if pos >= len {
                return None;
            }
            let at = offset + pos;
            let in_region = at % REGION_BYTES;
            let n = (REGION_BYTES - in_region).min(len - pos);
            let item = (
                at / REGION_BYTES,
                in_region as usize,
                n as usize,
                pos as usize,
            );
            pos += n;
            Some(item)
        })
    }

    /// Copies `[offset, offset+len)` into `dst`.
    ///
    /// # Safety
    /// `dst` is valid for `len` writable bytes; the range is inside the store.
    pub unsafe fn read(&self, offset: u64, len: u64, dst: *mut u8) {
        debug_assert!(offset + len <= self.size_bytes);
        for (index, at, n, pos) in Self::pieces(offset, len) {
            let region = self.region(index);
            // SAFETY: dst has len bytes; a region has REGION_BYTES bytes and at + n fits.
            unsafe {
                if region.is_null() {
                    ptr::write_bytes(dst.add(pos), 0, n);
                } else {
                    ptr::copy_nonoverlapping(region.add(at), dst.add(pos), n);
                }
            }
        }
    }

    /// Copies `src` into the store at `offset`; the range must be inside the store.
    pub fn write_slice(&self, offset: u64, src: &[u8]) {
        assert!(
            offset
                .checked_add(src.len() as u64)
                .is_some_and(|end| end <= self.size_bytes),
            "a write inside the store"
        );
        // SAFETY: `src` is valid for its length, and the range was checked above.
        unsafe { self.write(offset, src.len() as u64, src.as_ptr()) };
    }

    /// Copies `src` into `[offset, offset+len)`.
    ///
    /// # Safety
    /// `src` is valid for `len` readable bytes; the range is inside the store.
    pub unsafe fn write(&self, offset: u64, len: u64, src: *const u8) {
        debug_assert!(offset + len <= self.size_bytes);
        for (index, at, n, pos) in Self::pieces(offset, len) {
            let region = self.region_or_map(index);
            // SAFETY: as in read.
            unsafe { ptr::copy_nonoverlapping(src.add(pos), region.add(at), n) };
            // After the data: a zeroing that clears the bit meanwhile leaves it set.
            if let Some(map) = self.page_map(index) {
                let (a, b) = (at as u64, (at + n) as u64);
                mark_pages(map, a / PAGE_BYTES, b.div_ceil(PAGE_BYTES), true);
            }
        }
    }

    /// How `[offset, offset+len)` is allocated, in units of `unit` bytes (a power of two
    /// from 4 KiB to a region): a unit is data if a write put data in one of its pages
    /// since they were last discarded or zeroed whole, else a hole (it reads as zeros).
    /// A data unit whose every written page was zeroed whole with `NO_HOLE` and reads as
    /// zeroes now is allocated zeroes (NBD's `STATE_ZERO` without `STATE_HOLE`).
    pub fn extents(&self, offset: u64, len: u64, unit: u64, out: &mut Vec<cairn_core::Extent>) {
        use cairn_core::Extent;
        let unit = unit.clamp(PAGE_BYTES, REGION_BYTES);
        let unit_pages = unit / PAGE_BYTES;
        for (index, at, n, _) in Self::pieces(offset, len) {
            let map = match self.page_map(index) {
                Some(m) if !self.region(index).is_null() => m,
                _ => {
                    Extent::push(out, Extent::hole(n as u64));
                    continue;
                }
            };
            let (mut pos, end) = (at as u64, (at + n) as u64);
            while pos < end {
                let first = pos / unit * unit_pages;
                let next = (pos / unit + 1) * unit;
                let step = next.min(end) - pos;
                let (w, lo) = ((first / 64) as usize, first % 64);
                let mask = (u64::MAX >> (64 - unit_pages.min(64))) << lo;
                let data = if unit_pages <= 64 {
                    map[w].load(Ordering::Relaxed) & mask != 0
                } else {
                    let words = (unit_pages / 64) as usize;
                    map[w..w + words]
                        .iter()
                        .any(|x| x.load(Ordering::Relaxed) != 0)
                };
                let zeroed = data && {
                    let region = self.region(index);
                    let zmap = self.zeroed_map(index);
                    let unit_start = pos / unit * unit;
                    (0..unit_pages).all(|k| {
                        let p = unit_start / PAGE_BYTES + k;
                        let bit = 1u64 << (p % 64);
                        let written = map[(p / 64) as usize].load(Ordering::Relaxed) & bit != 0;
                        let zeroed = zmap.is_some_and(|z| {
                            z[(p / 64) as usize].load(Ordering::Relaxed) & bit != 0
                        });
                        // SAFETY: the page lies inside the mapped region (data implies it
                        // is mapped); concurrent writes may change it, and a racing
                        // write's bytes are data either way.
                        !written
                            || (zeroed
                                && unsafe { page_is_zero(region.add((p * PAGE_BYTES) as usize)) })
                    })
                };
                Extent::push(
                    out,
                    if zeroed {
                        Extent::allocated_zero(step)
                    } else if data {
                        Extent::data(step)
                    } else {
                        Extent::hole(step)
                    },
                );
                pos += step;
            }
        }
    }

    /// Copies page `page` (its first `len` bytes: the last page of a store may be short)
    /// to the same place in `dst`: its bytes if a write put data there, else (a hole) zeros,
    /// giving `dst`'s memory for it back.
    fn copy_page(&self, dst: &MemStore, page: u64, len: u64) {
        let offset = page * PAGE_BYTES;
        let (index, at) = (offset / REGION_BYTES, offset % REGION_BYTES);
        let region = self.region(index);
        let p = at / PAGE_BYTES;
        let data = !region.is_null()
            && self.page_map(index).is_some_and(|m| {
                m[(p / 64) as usize].load(Ordering::Relaxed) & (1 << (p % 64)) != 0
            });
        if data {
            // SAFETY: the page lies inside both stores (same size) and inside the mapped
            // region; `dst` is another store, so the ranges do not overlap.
            unsafe { dst.write(offset, len, region.add(at as usize)) };
        } else {
            dst.zero(offset, len);
        }
    }

    /// Makes `[offset, offset+len)` read as zeros, giving whole pages back to the kernel.
    pub fn zero(&self, offset: u64, len: u64) {
        self.zero_keeping(offset, len, false);
    }

    /// [`MemStore::zero`]; with `allocated` (a write-zeroes with `NO_HOLE`) the range stays
    /// data in the allocation map, though its memory is given back all the same.
    pub fn zero_keeping(&self, offset: u64, len: u64, allocated: bool) {
        debug_assert!(offset + len <= self.size_bytes);
        for (index, at, n, _) in Self::pieces(offset, len) {
            let region = if allocated {
                // Provisioned, as NO_HOLE asks: even a region never written is mapped.
                self.region_or_map(index)
            } else {
                self.region(index)
            };
            if region.is_null() {
                continue;
            }
            let (start, end) = (at as u64, (at + n) as u64);
            let first_page = start.next_multiple_of(PAGE_BYTES);
            let last_page = end / PAGE_BYTES * PAGE_BYTES;
            // Before the pages go: a write that lands meanwhile sets its bits again.
            if let Some(map) = self.page_map(index) {
                if allocated {
                    mark_pages(map, start / PAGE_BYTES, end.div_ceil(PAGE_BYTES), true);
                } else if first_page < last_page {
                    mark_pages(map, first_page / PAGE_BYTES, last_page / PAGE_BYTES, false);
                }
            }
            if let Some(zmap) = self.zeroed_map(index) {
                if first_page < last_page {
                    mark_pages(
                        zmap,
                        first_page / PAGE_BYTES,
                        last_page / PAGE_BYTES,
                        allocated,
                    );
                }
            }
            // SAFETY: every range below lies inside the mapped region.
            unsafe {
                if first_page < last_page {
                    ptr::write_bytes(region.add(start as usize), 0, (first_page - start) as usize);
                    ptr::write_bytes(
                        region.add(last_page as usize),
                        0,
                        (end - last_page) as usize,
                    );
                    // The pages read as zeros afterwards and their memory is freed.
                    libc::madvise(
                        region.add(first_page as usize).cast(),
                        (last_page - first_page) as usize,
                        libc::MADV_DONTNEED,
                    );
                } else {
                    ptr::write_bytes(region.add(start as usize), 0, n);
                }
            }
        }
    }
}

/// Whether the 4 KiB page at `page` reads as zeroes.
///
/// # Safety
/// `page` is valid for `PAGE_BYTES` reads.
unsafe fn page_is_zero(page: *const u8) -> bool {
    let words = page.cast::<u64>();
    // SAFETY: the caller's promise; u64 reads of a page-aligned address are aligned.
    // Raw reads, no reference: a concurrent write may change the page meanwhile, as
    // reads of the store race writes everywhere (see the module's comment).
    (0..(PAGE_BYTES / 8) as usize).all(|i| unsafe { words.add(i).read() } == 0)
}

/// Maps one region of zero-filled anonymous memory (backed lazily, page by page).
fn map_region() -> *mut u8 {
    // SAFETY: an anonymous private mapping with no address hint.
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            REGION_BYTES as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        // Address space exhausted: like any allocation failure, this is fatal.
        std::alloc::handle_alloc_error(
            std::alloc::Layout::from_size_align(REGION_BYTES as usize, 4096).expect("layout"),
        );
    }
    p.cast()
}

fn unmap_region(p: *mut u8) {
    // SAFETY: `p` came from map_region and is no longer referenced.
    unsafe { libc::munmap(p.cast(), REGION_BYTES as usize) };
}

impl Drop for MemStore {
    fn drop(&mut self) {
        for slot in self.l1.iter() {
            let l2 = slot.load(Ordering::Acquire);
            if l2.is_null() {
                continue;
            }
            // SAFETY: we own the table exclusively now (&mut self).
            let l2 = unsafe { Box::from_raw(l2) };
            for region in l2.regions.iter() {
                let p = region.load(Ordering::Acquire);
                if !p.is_null() {
                    unmap_region(p);
                }
            }
        }
    }
}

/// Pages per chunk of a [`PageBits`] (1 GiB of pages).
const CHUNK_PAGES: u64 = (1 << 30) / PAGE_BYTES;
/// 64-bit words per chunk of a [`PageBits`] (32 KiB).
const CHUNK_WORDS: usize = (CHUNK_PAGES / 64) as usize;

/// A bit per 4 KiB page, in chunks of 1 GiB of pages allocated the first time one of their
/// bits is set, read and changed without a lock.
struct PageBits {
    chunks: Box<[AtomicPtr<AtomicU64>]>,
}

impl PageBits {
    fn new(size_bytes: u64) -> PageBits {
        let chunks = size_bytes.div_ceil(PAGE_BYTES).div_ceil(CHUNK_PAGES) as usize;
        PageBits {
            chunks: (0..chunks)
                .map(|_| AtomicPtr::new(ptr::null_mut()))
                .collect(),
        }
    }

    #[inline]
    fn chunk(&self, c: usize) -> Option<&[AtomicU64]> {
        let p = self.chunks[c].load(Ordering::Acquire);
        if p.is_null() {
            return None;
        }
        // SAFETY: a published chunk holds CHUNK_WORDS words and is freed only on drop.
        Some(unsafe { std::slice::from_raw_parts(p, CHUNK_WORDS) })
    }

    fn chunk_or_new(&self, c: usize) -> &[AtomicU64] {
        if let Some(words) = self.chunk(c) {
            return words;
        }
        let fresh: Box<[AtomicU64]> = (0..CHUNK_WORDS).map(|_| AtomicU64::new(0)).collect();
        let fresh = Box::into_raw(fresh).cast::<AtomicU64>();
        if self.chunks[c]
            .compare_exchange(ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            // SAFETY: `fresh` was never published; it is the box made above.
            drop(unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(fresh, CHUNK_WORDS)) });
        }
        self.chunk(c).expect("a chunk was published")
    }

    /// Sets the bits of pages `p0..p1`, each word by a read-modify-write even when its
    /// bits are set already: after the data they describe, so that a [`PageBits::take`]
    /// that clears a bit either finds that data or leaves the bit set. (A load that saw the
    /// bit set and skipped the write could be ordered before the data's stores, and the
    /// clearing, made before they were visible, would lose them.)
    #[inline]
    fn set(&self, p0: u64, p1: u64) {
        let mut p = p0;
        while p < p1 {
            let in_chunk = p % CHUNK_PAGES;
            let (w, lo) = ((in_chunk / 64) as usize, in_chunk % 64);
            let hi = (p1 - (p - lo)).min(64);
            let mask = (u64::MAX >> (64 - (hi - lo))) << lo;
            self.chunk_or_new((p / CHUNK_PAGES) as usize)[w].fetch_or(mask, Ordering::Release);
            p += hi - lo;
        }
    }

    /// Clears every bit, calling `f` with each page whose bit was set, in page order.
    fn take(&self, mut f: impl FnMut(u64)) {
        for c in 0..self.chunks.len() {
            let Some(words) = self.chunk(c) else { continue };
            for (w, word) in words.iter().enumerate() {
                if word.load(Ordering::Relaxed) == 0 {
                    continue;
                }
                let mut bits = word.swap(0, Ordering::Acquire);
                while bits != 0 {
                    let b = u64::from(bits.trailing_zeros());
                    bits &= bits - 1;
                    f(c as u64 * CHUNK_PAGES + w as u64 * 64 + b);
                }
            }
        }
    }
}

impl Drop for PageBits {
    fn drop(&mut self) {
        for slot in self.chunks.iter() {
            let p = slot.load(Ordering::Acquire);
            if !p.is_null() {
                // SAFETY: made by `chunk_or_new` as a box of CHUNK_WORDS words; we own it
                // exclusively now (&mut self).
                drop(unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(p, CHUNK_WORDS)) });
            }
        }
    }
}

/// Stripes of the lock that orders changes to one page of the durable copy.
const PERSIST_STRIPES: usize = 64;

/// The volatile layer of a `volatile = true` mem device, as a disk's write cache. The
/// device's store is what reads see; this keeps a second store, the durable copy (what a
/// power cut goes back to), and a bit per page whose store contents may differ from it.
///
/// - A write changes the store and sets its pages' bits: no allocation but the store's
///   own and a 32 KiB chunk of bits the first time a GiB is written, and no lock but the
///   shared hold on `cut` below (the hot path is a plain mem's plus two atomic
///   read-modify-writes for the hold and one atomic OR per 64 pages).
/// - A FUA request also writes its own bytes (or zeros) to the durable copy, and nothing
///   else: other writes in the same pages stay volatile. Its pages' bits stay set (the
///   store may hold other unflushed bytes in them).
/// - A flush copies every page whose bit it clears from the store to the durable copy
///   (a write landing in the page meanwhile sets the bit again: the next flush copies it
///   again, whatever mix of bytes this one took).
/// - A power cut copies every such page back from the durable copy to the store.
///
/// Each page's copy, and a FUA request's change to a page, hold that page's stripe of
/// `persisting`, so a flush copying a page cannot put bytes it read before a FUA write
/// over what that write made durable. A power cut is one instant: every write, FUA
/// request and flush holds `cut` shared, the cut holds it alone, so a write racing the
/// cut (a cache's write-back on another thread) lands wholly before it or wholly after,
/// never half on each side of the copy back. Memory: up to twice the data, the store and
/// the durable copy.
pub struct Volatile {
    size_bytes: u64,
    durable: MemStore,
    dirty: PageBits,
    persisting: [std::sync::Mutex<()>; PERSIST_STRIPES],
    cut: std::sync::RwLock<()>,
}

impl Volatile {
    fn new(size_bytes: u64) -> Volatile {
        Volatile {
            size_bytes,
            durable: MemStore::new(size_bytes),
            dirty: PageBits::new(size_bytes),
            persisting: std::array::from_fn(|_| std::sync::Mutex::new(())),
            cut: std::sync::RwLock::new(()),
        }
    }

    /// Held while a request changes the store or the durable copy: a cut waits for it.
    fn not_cut(&self) -> std::sync::RwLockReadGuard<'_, ()> {
        self.cut.read().unwrap_or_else(|p| p.into_inner())
    }

    /// A plain write: the store, and its pages' bits.
    ///
    /// # Safety
    /// As [`MemStore::write`].
    unsafe fn write(&self, store: &MemStore, offset: u64, len: u64, src: *const u8) {
        let _live = self.not_cut();
        // SAFETY: as the caller's.
        unsafe { store.write(offset, len, src) };
        self.wrote(offset, len);
    }

    /// A plain discard or write-zeroes.
    fn zero(&self, store: &MemStore, offset: u64, len: u64, allocated: bool) {
        let _live = self.not_cut();
        store.zero_keeping(offset, len, allocated);
        self.wrote(offset, len);
    }

    fn stripe(&self, page: u64) -> std::sync::MutexGuard<'_, ()> {
        self.persisting[(page % PERSIST_STRIPES as u64) as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes of page `p` inside the device (the last page may be short).
    fn page_len(&self, p: u64) -> u64 {
        (self.size_bytes - p * PAGE_BYTES).min(PAGE_BYTES)
    }

    /// `[offset, offset+len)` in the store may now differ from the durable copy.
    #[inline]
    fn wrote(&self, offset: u64, len: u64) {
        self.dirty
            .set(offset / PAGE_BYTES, (offset + len).div_ceil(PAGE_BYTES));
    }

    /// Runs `change` on `[offset, offset+len)` in pieces, each under the stripes of the
    /// pages it covers: a page at a time, or the whole range under every stripe (taken in
    /// order) once it covers that many pages.
    fn persisting(&self, offset: u64, len: u64, mut change: impl FnMut(u64, u64)) {
        let (p0, p1) = (offset / PAGE_BYTES, (offset + len).div_ceil(PAGE_BYTES));
        if p1 - p0 >= PERSIST_STRIPES as u64 {
            // Every stripe, in order (as one page's at a time never deadlocks with it).
            let _all: [_; PERSIST_STRIPES] = std::array::from_fn(|s| self.stripe(s as u64));
            change(offset, len);
            return;
        }
        for p in p0..p1 {
            let start = (p * PAGE_BYTES).max(offset);
            let end = ((p + 1) * PAGE_BYTES).min(offset + len);
            let _page = self.stripe(p);
            change(start, end - start);
        }
    }

    /// A FUA write: `src` goes to the store and to the durable copy, page by page under
    /// each page's stripe.
    ///
    /// # Safety
    /// As [`MemStore::write`].
    unsafe fn write_fua(&self, store: &MemStore, offset: u64, len: u64, src: *const u8) {
        let _live = self.not_cut();
        self.persisting(offset, len, |at, n| {
            let from = src.wrapping_add((at - offset) as usize);
            // SAFETY: `from` lies inside `src`, which holds `len` bytes; the piece is
            // inside the range, so inside both stores.
            unsafe {
                store.write(at, n, from);
                self.wrote(at, n);
                self.durable.write(at, n, from);
            }
        });
    }

    /// A FUA discard or write-zeroes: zeros in the store and in the durable copy.
    fn zero_fua(&self, store: &MemStore, offset: u64, len: u64, allocated: bool) {
        let _live = self.not_cut();
        self.persisting(offset, len, |at, n| {
            store.zero_keeping(at, n, allocated);
            self.wrote(at, n);
            self.durable.zero_keeping(at, n, allocated);
        });
    }

    /// Makes every page written so far durable.
    fn flush(&self, store: &MemStore) {
        let _live = self.not_cut();
        self.dirty.take(|p| {
            let _page = self.stripe(p);
            store.copy_page(&self.durable, p, self.page_len(p));
        });
    }

    /// Puts every page written since the last flush back as the durable copy has it;
    /// returns how many.
    fn power_cut(&self, store: &MemStore) -> u64 {
        let _alone = self.cut.write().unwrap_or_else(|p| p.into_inner());
        let mut n = 0;
        self.dirty.take(|p| {
            let _page = self.stripe(p);
            self.durable.copy_page(store, p, self.page_len(p));
            n += 1;
        });
        n
    }

    /// A power cut that tears: each page written since the last flush is kept (the disk
    /// wrote it before the power went) or lost, as `seed` picks, page by page, so a
    /// write of several pages may land in part. Returns the pages kept and lost.
    fn power_cut_torn(&self, store: &MemStore, seed: u64) -> (u64, u64) {
        let _alone = self.cut.write().unwrap_or_else(|p| p.into_inner());
        let (mut kept, mut lost) = (0, 0);
        let mut x = seed;
        self.dirty.take(|p| {
            let _page = self.stripe(p);
            // splitmix64: a fair coin per page.
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            if (z ^ (z >> 31)) & 1 == 1 {
                store.copy_page(&self.durable, p, self.page_len(p));
                kept += 1;
            } else {
                self.durable.copy_page(store, p, self.page_len(p));
                lost += 1;
            }
        });
        (kept, lost)
    }
}

/// A sparse RAM disk.
pub struct MemDevice {
    name: String,
    geometry: Geometry,
    store: Arc<MemStore>,
    volatile: Option<Arc<Volatile>>,
}

impl MemDevice {
    /// An empty RAM disk of `size_bytes` with `block_bytes` logical blocks.
    pub fn new(name: &str, size_bytes: u64, block_bytes: u32) -> Result<MemDevice, Error> {
        crate::check_size("mem", size_bytes, block_bytes)?;
        if size_bytes > MEM_SIZE_MAX {
            return Err(Error::Invalid(format!(
                "mem: size {size_bytes} is larger than the 64 TiB a mem device can have"
            )));
        }
        Ok(MemDevice {
            name: name.into(),
            geometry: Geometry {
                size_bytes,
                block_bytes,
                caps: Caps::ALL,
            },
            store: Arc::new(MemStore::new(size_bytes)),
            volatile: None,
        })
    }

    /// The same disk with a volatile write cache: writes are lost by a power cut
    /// ([`Device::power_cut`]) unless a flush made them durable first.
    pub fn volatile(mut self) -> MemDevice {
        self.volatile = Some(Arc::new(Volatile::new(self.geometry.size_bytes)));
        self
    }

    /// The store, for tests and reports.
    pub fn store(&self) -> &Arc<MemStore> {
        &self.store
    }
}

impl Device for MemDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn describe(&self) -> String {
        format!(
            "mem {} bytes, {}-byte blocks, {} bytes allocated{}",
            self.geometry.size_bytes,
            self.geometry.block_bytes,
            self.store.allocated_bytes(),
            match &self.volatile {
                Some(v) => format!(
                    ", volatile until flushed ({} bytes allocated for the durable copy)",
                    v.durable.allocated_bytes()
                ),
                None => String::new(),
            }
        )
    }

    fn power_cut(&self) {
        if let Some(v) = &self.volatile {
            let lost = v.power_cut(&self.store);
            log::warn!(
                "cairn: {}: power cut: {lost} pages written since the last flush are back to what flushes and FUA writes made durable",
                self.name
            );
        }
    }

    fn power_cut_torn(&self, seed: u64) {
        if let Some(v) = &self.volatile {
            let (kept, lost) = v.power_cut_torn(&self.store, seed);
            log::warn!(
                "cairn: {}: torn power cut: of the pages written since the last flush, {kept} reached the disk and {lost} did not",
                self.name
            );
        }
    }

    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        out: &mut Vec<cairn_core::Extent>,
    ) -> Result<(), Error> {
        self.store
            .extents(offset, len, u64::from(self.geometry.block_bytes), out);
        Ok(())
    }

    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
        Ok(Rc::new(MemQueue {
            core: core.clone(),
            stats: QueueStats::named_leaf(core.switches().stats, self.name()),
            store: self.store.clone(),
            volatile: self.volatile.clone(),
        }))
    }
}

struct MemQueue {
    core: Rc<Core>,
    stats: QueueStats,
    store: Arc<MemStore>,
    volatile: Option<Arc<Volatile>>,
}

impl Queue for MemQueue {
    fn submit(&self, io: Io) {
        let start = self.stats.begin(io.flags, || self.core.now_ns());
        let fua = io.flags.contains(IoFlags::FUA);
        let allocated = io.op == Op::WriteZeroes && io.flags.contains(IoFlags::NO_HOLE);
        // SAFETY: the request passed Geometry::check at the edge (so it is in range), and
        // its submitter keeps `buf` valid for `len` bytes until completion.
        unsafe {
            match (&self.volatile, io.op) {
                (_, Op::Read) => self.store.read(io.offset, io.len, io.buf),
                (None, Op::Write) => self.store.write(io.offset, io.len, io.buf),
                (None, Op::Discard | Op::WriteZeroes) => {
                    self.store.zero_keeping(io.offset, io.len, allocated)
                }
                (None, Op::Flush) => {}
                // FUA: this request's own range is durable when it completes; other
                // writes in the volatile layer stay volatile, as on a disk.
                (Some(v), Op::Write) if fua => v.write_fua(&self.store, io.offset, io.len, io.buf),
                (Some(v), Op::Write) => v.write(&self.store, io.offset, io.len, io.buf),
                (Some(v), Op::Discard | Op::WriteZeroes) if fua => {
                    v.zero_fua(&self.store, io.offset, io.len, allocated)
                }
                (Some(v), Op::Discard | Op::WriteZeroes) => {
                    v.zero(&self.store, io.offset, io.len, allocated)
                }
                (Some(v), Op::Flush) => v.flush(&self.store),
            }
        }
        if self.stats.enabled() {
            self.stats
                .done(io.flags, io.op, io.len, start, self.core.now_ns(), true);
        }
        self.core.complete(io.sink, io.token, IoStatus::OK);
    }

    fn stats(&self) -> &QueueStats {
        &self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write-zeroes with NO_HOLE of whole pages is allocated zeroes (STATE_ZERO, not a
    /// hole, not data) until a write puts a non-zero byte in a page; a plain zeroing
    /// makes holes; pages zeroed only in part stay data.
    #[test]
    fn no_hole_zeroes_are_reported_as_allocated_zeroes() {
        use cairn_core::Extent;
        let store = MemStore::new(4 << 20);
        let map = |store: &MemStore| {
            let mut out = Vec::new();
            store.extents(0, 8 * PAGE_BYTES, PAGE_BYTES, &mut out);
            out
        };
        let data = vec![0x5au8; 8 * PAGE_BYTES as usize];
        // SAFETY: `data` holds the bytes written; the range is inside the store.
        unsafe { store.write(0, 8 * PAGE_BYTES, data.as_ptr()) };
        assert_eq!(map(&store), [Extent::data(8 * PAGE_BYTES)]);
        store.zero_keeping(0, 4 * PAGE_BYTES, true);
        store.zero_keeping(4 * PAGE_BYTES, PAGE_BYTES, false);
        // Pages 5 and 6 only in part: they keep data.
        store.zero_keeping(5 * PAGE_BYTES + 100, PAGE_BYTES, true);
        assert_eq!(
            map(&store),
            [
                Extent::allocated_zero(4 * PAGE_BYTES),
                Extent::hole(PAGE_BYTES),
                Extent::data(3 * PAGE_BYTES),
            ]
        );
        // A non-zero byte in page 1 makes it data; zeros written to page 3 keep it zero.
        // SAFETY: as above.
        unsafe {
            store.write(PAGE_BYTES + 7, 1, data.as_ptr());
            store.write(3 * PAGE_BYTES, PAGE_BYTES, [0u8; 4096].as_ptr());
        }
        assert_eq!(
            map(&store),
            [
                Extent::allocated_zero(PAGE_BYTES),
                Extent::data(PAGE_BYTES),
                Extent::allocated_zero(2 * PAGE_BYTES),
                Extent::hole(PAGE_BYTES),
                Extent::data(3 * PAGE_BYTES),
            ]
        );
        // Units larger than a page: zero only if every written page is.
        let mut out = Vec::new();
        store.extents(0, 8 * PAGE_BYTES, 2 * PAGE_BYTES, &mut out);
        assert_eq!(
            out,
            [
                Extent::data(2 * PAGE_BYTES),
                Extent::allocated_zero(2 * PAGE_BYTES),
                Extent::data(4 * PAGE_BYTES),
            ]
        );
        // A plain zeroing of the zeroed pages makes them holes.
        store.zero_keeping(0, PAGE_BYTES, false);
        assert_eq!(map(&store)[0], Extent::hole(PAGE_BYTES));
    }

    /// Random writes and zeroings: the allocation map calls a page a hole only where it
    /// reads as zeros, data wherever it holds a byte that is not, and a hole wherever the
    /// last thing to touch the whole page was a zeroing without NO_HOLE.
    #[test]
    fn the_page_map_follows_writes_and_zeroings() {
        let size = 5 << 20; // three regions, the last one partial
        let store = MemStore::new(size);
        let pages = (size / PAGE_BYTES) as usize;
        // Per page: true when the last whole-page event was a zeroing (a hole is due).
        let mut hole_due = vec![true; pages];
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |bound: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % bound
        };
        let mut buf = vec![0u8; size as usize];
        for step in 0..400 {
            let offset = next(size);
            let len = 1 + next((size - offset).min(300_000));
            let (first, end) = (offset / PAGE_BYTES, (offset + len).div_ceil(PAGE_BYTES));
            match next(3) {
                0 => {
                    let data = vec![(step % 250 + 1) as u8; len as usize];
                    // SAFETY: the buffer holds the bytes named, and the range lies inside the store.
                    unsafe { store.write(offset, len, data.as_ptr()) };
                    hole_due[first as usize..end as usize].fill(false);
                }
                k => {
                    store.zero_keeping(offset, len, k == 2);
                    let (a, b) = (offset.div_ceil(PAGE_BYTES), (offset + len) / PAGE_BYTES);
                    if k == 2 {
                        hole_due[first as usize..end as usize].fill(false);
                    } else if a < b {
                        hole_due[a as usize..b as usize].fill(true);
                    }
                }
            }
            // SAFETY: the buffer holds the bytes named, and the range lies inside the store.
            unsafe { store.read(0, size, buf.as_mut_ptr()) };
            let mut map = Vec::new();
            store.extents(0, size, PAGE_BYTES, &mut map);
            let mut at = 0usize;
            for e in &map {
                for p in at / PAGE_BYTES as usize..(at + e.len as usize) / PAGE_BYTES as usize {
                    let bytes = &buf[p * PAGE_BYTES as usize..(p + 1) * PAGE_BYTES as usize];
                    if e.hole {
                        assert!(
                            bytes.iter().all(|&b| b == 0),
                            "step {step}: hole over data at page {p}"
                        );
                    } else {
                        assert!(
                            !hole_due[p],
                            "step {step}: page {p} zeroed whole, still data"
                        );
                    }
                    if bytes.iter().any(|&b| b != 0) {
                        assert!(!e.hole, "step {step}: page {p}");
                    }
                }
                at += e.len as usize;
            }
            assert_eq!(at as u64, size);
        }
    }

    #[test]
    fn sparse_read_write_zero() {
        let store = MemStore::new(1 << 20);
        let mut buf = vec![0xffu8; 10000];
        // SAFETY: the buffer holds the bytes named, and the range lies inside the store.
        unsafe { store.read(1000, 10000, buf.as_mut_ptr()) };
        assert!(buf.iter().all(|&b| b == 0));
        assert_eq!(store.allocated_bytes(), 0);
        let data: Vec<u8> = (0..10000).map(|i| (i % 251) as u8).collect();
        // SAFETY: the buffer holds the bytes named, and the range lies inside the store.
        unsafe { store.write(1000, 10000, data.as_ptr()) };
        // 1000..11000 lies in the first region.
        assert_eq!(store.allocated_bytes(), REGION_BYTES);
        // SAFETY: the buffer holds the bytes named, and the range lies inside the store.
        unsafe { store.read(1000, 10000, buf.as_mut_ptr()) };
        assert_eq!(buf, data);
        store.zero(2000, 512);
        // SAFETY: the buffer holds the bytes named, and the range lies inside the store.
        unsafe { store.read(1000, 10000, buf.as_mut_ptr()) };
        assert!(buf[1000..1512].iter().all(|&b| b == 0));
        assert_eq!(buf[..1000], data[..1000]);
        assert_eq!(buf[1512..], data[1512..]);
    }

    #[test]
    fn zero_frees_whole_pages_and_keeps_neighbours() {
        let store = MemStore::new(8 << 20);
        let data = vec![0xabu8; 3 * REGION_BYTES as usize];
        let base = REGION_BYTES - 8192;
        // SAFETY: the buffer holds the bytes named, and the range lies inside the store.
        unsafe { store.write(base, 16384 + 1024, data.as_ptr()) };
        // Crosses a region boundary; whole pages inside it go back to the kernel.
        store.zero(base + 512, 16384 - 512);
        let mut out = vec![0xffu8; 16384 + 1024];
        // SAFETY: the buffer holds the bytes named, and the range lies inside the store.
        unsafe { store.read(base, 16384 + 1024, out.as_mut_ptr()) };
        assert!(out[..512].iter().all(|&b| b == 0xab));
        assert!(out[512..16384].iter().all(|&b| b == 0));
        assert!(out[16384..].iter().all(|&b| b == 0xab));
    }

    #[test]
    fn page_bits_across_words_and_chunks() {
        let bits = PageBits::new(3 << 30);
        bits.set(100, 300);
        bits.set(CHUNK_PAGES - 2, CHUNK_PAGES + 3);
        bits.set(100, 101);
        let mut got = Vec::new();
        bits.take(|p| got.push(p));
        let want: Vec<u64> = (100..300).chain(CHUNK_PAGES - 2..CHUNK_PAGES + 3).collect();
        assert_eq!(got, want);
        // Taken: nothing is left, and the third chunk was never allocated.
        bits.take(|p| panic!("page {p} still set"));
        assert!(bits.chunk(2).is_none());
    }

    /// A volatile layer over regions and a short last page: a FUA write across a region
    /// boundary is durable, the plain writes around it are not until the flush, and the
    /// short last page is copied both ways.
    #[test]
    fn volatile_layer_across_regions_and_a_short_last_page() {
        let size = 2 * REGION_BYTES + 512;
        let store = MemStore::new(size);
        let v = Volatile::new(size);
        let plain = vec![1u8; 3 * PAGE_BYTES as usize];
        let fua = vec![2u8; 2 * PAGE_BYTES as usize];
        let (at, fua_at) = (REGION_BYTES - PAGE_BYTES, REGION_BYTES - 512);
        let read = |offset: u64, len: u64| {
            let mut b = vec![0xeeu8; len as usize];
            // SAFETY: the buffer holds the bytes named, and the range lies inside the store.
            unsafe { store.read(offset, len, b.as_mut_ptr()) };
            b
        };
        // SAFETY: the buffer holds the bytes named, and the range lies inside the store.
        unsafe {
            store.write(at, plain.len() as u64, plain.as_ptr());
            v.wrote(at, plain.len() as u64);
            v.write_fua(&store, fua_at, fua.len() as u64, fua.as_ptr());
            store.write(size - 512, 512, plain.as_ptr());
            v.wrote(size - 512, 512);
        }
        assert_eq!(v.power_cut(&store), 4, "four pages were written");
        let got = read(at, 3 * PAGE_BYTES);
        let fua_in = (fua_at - at) as usize;
        assert!(got[..fua_in].iter().all(|&b| b == 0), "plain write lost");
        assert!(
            got[fua_in..fua_in + fua.len()].iter().all(|&b| b == 2),
            "FUA kept"
        );
        assert!(
            got[fua_in + fua.len()..].iter().all(|&b| b == 0),
            "plain write lost"
        );
        assert!(read(size - 512, 512).iter().all(|&b| b == 0));
        // SAFETY: the buffer holds the bytes named, and the range lies inside the store.
        unsafe {
            store.write(size - 512, 512, plain.as_ptr());
            v.wrote(size - 512, 512);
        }
        v.flush(&store);
        assert_eq!(v.power_cut(&store), 0, "nothing unflushed");
        assert!(read(size - 512, 512).iter().all(|&b| b == 1), "flushed");
    }

    #[test]
    fn last_page_of_odd_size() {
        let size = 3 * PAGE_BYTES + 512;
        let store = MemStore::new(size);
        let data = [7u8; 512];
        // SAFETY: the buffer holds the bytes named, and the range lies inside the store.
        unsafe { store.write(size - 512, 512, data.as_ptr()) };
        let mut out = [0u8; 512];
        // SAFETY: the buffer holds the bytes named, and the range lies inside the store.
        unsafe { store.read(size - 512, 512, out.as_mut_ptr()) };
        assert_eq!(out, data);
    }
}
