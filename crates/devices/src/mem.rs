//! `mem`: a sparse RAM disk. Unwritten blocks read as zeros; memory grows with data.
//!
//! Data lives in 4 KiB pages found through a two-level table of atomic pointers, so every
//! queue (one per reactor thread) reads and writes without a lock. A page is allocated the
//! first time it is written, with a compare-and-swap that settles races between threads.
//! Discard and write-zeroes zero the pages in place; pages are not given back while the
//! device is open, because another thread may be copying from them at that moment.
//!
//! Concurrent requests that overlap the same bytes race the way they do on a real disk:
//! the result is some interleaving of their bytes. That is the block-device contract, and
//! every byte pattern is a valid `u8`, so no other harm can follow.

use std::alloc::{self, Layout};
use std::ptr;
use std::rc::Rc;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::Arc;

use cairn_core::{Caps, Core, Device, Error, Geometry, Io, IoStatus, Op, Queue, QueueStats};

/// Bytes per page.
pub const PAGE_BYTES: u64 = 4096;
/// Pages per second-level table.
const L2_PAGES: u64 = 512;
/// Largest mem device (64 TiB): bounds the first-level table at 256 Ki entries.
pub const MEM_SIZE_MAX: u64 = 64 << 40;

type Page = u8;

struct L2 {
    pages: [AtomicPtr<Page>; L2_PAGES as usize],
}

/// The shared store behind every queue of a mem device.
pub struct MemStore {
    size_bytes: u64,
    l1: Box<[AtomicPtr<L2>]>,
    pages: AtomicU64,
}

fn page_layout() -> Layout {
    Layout::from_size_align(PAGE_BYTES as usize, PAGE_BYTES as usize).expect("page layout")
}

impl MemStore {
    /// An empty store of `size_bytes`.
    pub fn new(size_bytes: u64) -> MemStore {
        let l1_len = size_bytes.div_ceil(PAGE_BYTES * L2_PAGES) as usize;
        let l1 = (0..l1_len)
            .map(|_| AtomicPtr::new(ptr::null_mut()))
            .collect();
        MemStore {
            size_bytes,
            l1,
            pages: AtomicU64::new(0),
        }
    }

    /// Bytes of data memory allocated so far.
    pub fn allocated_bytes(&self) -> u64 {
        self.pages.load(Ordering::Relaxed) * PAGE_BYTES
    }

    #[inline]
    fn page(&self, index: u64) -> *mut Page {
        let l2 = self.l1[(index / L2_PAGES) as usize].load(Ordering::Acquire);
        if l2.is_null() {
            return ptr::null_mut();
        }
        // SAFETY: L2 tables are never freed before the store is dropped.
        unsafe { (*l2).pages[(index % L2_PAGES) as usize].load(Ordering::Acquire) }
    }

    fn page_or_alloc(&self, index: u64) -> *mut Page {
        let slot = &self.l1[(index / L2_PAGES) as usize];
        let mut l2 = slot.load(Ordering::Acquire);
        if l2.is_null() {
            let fresh = Box::into_raw(Box::new(L2 {
                pages: std::array::from_fn(|_| AtomicPtr::new(ptr::null_mut())),
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
        let page_slot = unsafe { &(*l2).pages[(index % L2_PAGES) as usize] };
        let page = page_slot.load(Ordering::Acquire);
        if !page.is_null() {
            return page;
        }
        // SAFETY: the layout has a non-zero size.
        let fresh = unsafe { alloc::alloc_zeroed(page_layout()) };
        if fresh.is_null() {
            alloc::handle_alloc_error(page_layout());
        }
        match page_slot.compare_exchange(
            ptr::null_mut(),
            fresh,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => {
                self.pages.fetch_add(1, Ordering::Relaxed);
                fresh
            }
            Err(winner) => {
                // SAFETY: `fresh` was never published.
                unsafe { alloc::dealloc(fresh, page_layout()) };
                winner
            }
        }
    }

    /// Splits `[offset, offset+len)` into (page index, offset in page, length, position).
    fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, usize, usize, usize)> {
        let mut pos = 0u64;
        std::iter::from_fn(move || {
            if pos >= len {
                return None;
            }
            let at = offset + pos;
            let in_page = at % PAGE_BYTES;
            let n = (PAGE_BYTES - in_page).min(len - pos);
            let item = (at / PAGE_BYTES, in_page as usize, n as usize, pos as usize);
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
            let page = self.page(index);
            // SAFETY: dst has len bytes; a page has PAGE_BYTES bytes and at + n fits.
            unsafe {
                if page.is_null() {
                    ptr::write_bytes(dst.add(pos), 0, n);
                } else {
                    ptr::copy_nonoverlapping(page.add(at), dst.add(pos), n);
                }
            }
        }
    }

    /// Copies `src` into `[offset, offset+len)`.
    ///
    /// # Safety
    /// `src` is valid for `len` readable bytes; the range is inside the store.
    pub unsafe fn write(&self, offset: u64, len: u64, src: *const u8) {
        debug_assert!(offset + len <= self.size_bytes);
        for (index, at, n, pos) in Self::pieces(offset, len) {
            let page = self.page_or_alloc(index);
            // SAFETY: as in read.
            unsafe { ptr::copy_nonoverlapping(src.add(pos), page.add(at), n) };
        }
    }

    /// Makes `[offset, offset+len)` read as zeros.
    pub fn zero(&self, offset: u64, len: u64) {
        debug_assert!(offset + len <= self.size_bytes);
        for (index, at, n, _) in Self::pieces(offset, len) {
            let page = self.page(index);
            if !page.is_null() {
                // SAFETY: the page has PAGE_BYTES bytes and at + n fits.
                unsafe { ptr::write_bytes(page.add(at), 0, n) };
            }
        }
    }
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
            for page in l2.pages.iter() {
                let p = page.load(Ordering::Acquire);
                if !p.is_null() {
                    // SAFETY: allocated with page_layout in page_or_alloc.
                    unsafe { alloc::dealloc(p, page_layout()) };
                }
            }
        }
    }
}

/// A sparse RAM disk.
pub struct MemDevice {
    name: String,
    geometry: Geometry,
    store: Arc<MemStore>,
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
        })
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
            "mem {} bytes, {}-byte blocks, {} bytes allocated",
            self.geometry.size_bytes,
            self.geometry.block_bytes,
            self.store.allocated_bytes()
        )
    }

    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
        Ok(Rc::new(MemQueue {
            core: core.clone(),
            stats: QueueStats::new(core.switches().stats),
            store: self.store.clone(),
        }))
    }
}

struct MemQueue {
    core: Rc<Core>,
    stats: QueueStats,
    store: Arc<MemStore>,
}

impl Queue for MemQueue {
    fn submit(&self, io: Io) {
        let start = if self.stats.enabled() {
            self.core.now_ns()
        } else {
            0
        };
        self.stats.start(start);
        // SAFETY: the request passed Geometry::check at the edge (so it is in range), and
        // its submitter keeps `buf` valid for `len` bytes until completion.
        unsafe {
            match io.op {
                Op::Read => self.store.read(io.offset, io.len, io.buf),
                Op::Write => self.store.write(io.offset, io.len, io.buf),
                Op::Discard | Op::WriteZeroes => self.store.zero(io.offset, io.len),
                Op::Flush => {}
            }
        }
        if self.stats.enabled() {
            self.stats
                .done(io.op, io.len, start, self.core.now_ns(), true);
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

    #[test]
    fn sparse_read_write_zero() {
        let store = MemStore::new(1 << 20);
        let mut buf = vec![0xffu8; 10000];
        unsafe { store.read(1000, 10000, buf.as_mut_ptr()) };
        assert!(buf.iter().all(|&b| b == 0));
        assert_eq!(store.allocated_bytes(), 0);
        let data: Vec<u8> = (0..10000).map(|i| (i % 251) as u8).collect();
        unsafe { store.write(1000, 10000, data.as_ptr()) };
        // 1000..11000 touches pages 0, 1 and 2.
        assert_eq!(store.allocated_bytes(), 3 * PAGE_BYTES);
        unsafe { store.read(1000, 10000, buf.as_mut_ptr()) };
        assert_eq!(buf, data);
        store.zero(2000, 512);
        unsafe { store.read(1000, 10000, buf.as_mut_ptr()) };
        assert!(buf[1000..1512].iter().all(|&b| b == 0));
        assert_eq!(buf[..1000], data[..1000]);
        assert_eq!(buf[1512..], data[1512..]);
    }

    #[test]
    fn last_page_of_odd_size() {
        let size = 3 * PAGE_BYTES + 512;
        let store = MemStore::new(size);
        let data = [7u8; 512];
        unsafe { store.write(size - 512, 512, data.as_ptr()) };
        let mut out = [0u8; 512];
        unsafe { store.read(size - 512, 512, out.as_mut_ptr()) };
        assert_eq!(out, data);
    }
}
