//! Eventfds for waking a reactor from another thread (one write per batch, not per
//! request); the reactor polls them through its ring as [`Poller`](crate::Poller)s.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use crate::error::Error;

/// A fresh non-blocking eventfd, shareable between the waker and the woken.
pub fn eventfd(context: &str) -> Result<Arc<OwnedFd>, Error> {
    // SAFETY: plain syscall; the fd is owned by the OwnedFd from here on.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::last_os(format!("{context}: eventfd")));
    }
    // SAFETY: fd is a fresh descriptor nobody else owns.
    Ok(Arc::new(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Makes the eventfd `fd` readable.
pub fn signal(fd: RawFd) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from `one` to an eventfd the caller owns.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// Resets the non-blocking eventfd `fd` after it fired.
pub fn clear(fd: RawFd) {
    let mut value = 0u64;
    // SAFETY: reads 8 bytes into `value` from a non-blocking eventfd the caller owns.
    unsafe { libc::read(fd, (&mut value as *mut u64).cast(), 8) };
}
