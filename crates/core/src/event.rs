//! Eventfds for waking a reactor from another thread (one write per batch, not per
//! request); the reactor polls them through its ring as [`Poller`](crate::Poller)s.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use rustix::event::EventfdFlags;

use crate::error::Error;

/// A fresh non-blocking eventfd, shareable between the waker and the woken.
pub fn eventfd(context: &str) -> Result<Arc<OwnedFd>, Error> {
    let fd = rustix::event::eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)
        .map_err(|e| Error::os(format!("{context}: eventfd"), e.into()))?;
    Ok(Arc::new(fd))
}

/// Makes the eventfd `fd` readable.
pub fn wake(fd: impl AsFd) {
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

/// Resets the non-blocking eventfd `fd` after it fired.
pub fn reset(fd: impl AsFd) {
    let mut value = [0u8; 8];
    let _ = rustix::io::read(fd, &mut value);
}
