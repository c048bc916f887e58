//! Aligned, zeroed heap buffers for I/O (O_DIRECT needs block-aligned memory).
//!
//! Buffers of [`MAP_MIN`] bytes and more are mapped anonymous memory: zero pages that
//! become resident only where they are written, and go back to the kernel when the
//! buffer is dropped. (The allocator would zero an aligned block by writing every byte.)

use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// Alignment of every [`AlignedBuf`]: enough for O_DIRECT on any block device.
pub const BUF_ALIGN: usize = 4096;

/// Buffers at least this large are mapped rather than allocated.
pub const MAP_MIN: usize = 128 << 10;

/// A zero-initialised heap buffer aligned to [`BUF_ALIGN`], allocated once up front.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes (at least one byte is allocated).
    pub fn new(len: usize) -> AlignedBuf {
        if len >= MAP_MIN {
            // SAFETY: a new private anonymous mapping; nothing else refers to it.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                alloc::handle_alloc_error(Self::layout(len))
            }
            let Some(ptr) = NonNull::new(p.cast::<u8>()) else {
                alloc::handle_alloc_error(Self::layout(len))
            };
            return AlignedBuf { ptr, len };
        }
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            alloc::handle_alloc_error(layout)
        };
        AlignedBuf { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        // The alignment is a power of two and the size is rounded up to it, so this holds.
        Layout::from_size_align(len.max(1).next_multiple_of(BUF_ALIGN), BUF_ALIGN)
            .expect("buffer layout")
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Raw pointer for building an [`Io`](crate::Io).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len initialised bytes, and &mut self is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len >= MAP_MIN {
            // SAFETY: mapped in `new`, `len` bytes long, and no longer referred to.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
            return;
        }
        // SAFETY: allocated in `new` with the same layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        let mut b = AlignedBuf::new(8192);
        assert_eq!(b.as_mut_ptr() as usize % BUF_ALIGN, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[8191] = 7;
        assert_eq!(b.as_slice()[8191], 7);
        let mut m = AlignedBuf::new(MAP_MIN + 12345);
        assert_eq!(m.as_mut_ptr() as usize % BUF_ALIGN, 0);
        assert_eq!(m.len(), MAP_MIN + 12345);
        assert!(m.as_slice().iter().all(|&x| x == 0));
        let end = m.len() - 1;
        m.as_mut_slice()[end] = 9;
        assert_eq!(m.as_slice()[end], 9);
    }
}
