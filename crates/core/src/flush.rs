//! Flush batching (technique 1): one flush satisfies every flush request that arrived
//! before it started.
//!
//! Linux md once serialised flushes behind one lock and later learned to batch them: a
//! request that arrives while a flush is running cannot be satisfied by it (its writes may
//! have completed after that flush began), but every request that arrived meanwhile can
//! share the next one. [`FlushBatcher`] keeps that state for one queue: no lock, no atomic,
//! no allocation in the steady state. With `--flush serial` each request gets a flush of
//! its own, one at a time, as before the technique.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;

use crate::io::Io;

/// How flush requests are combined (`--flush batched|serial`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FlushMode {
    /// One device flush covers every request that arrived before it started (default).
    #[default]
    Batched,
    /// One device flush per request, one at a time.
    Serial,
}

/// Flush requests waiting for, or covered by, a device flush.
pub struct FlushBatcher {
    mode: FlushMode,
    running: Cell<bool>,
    covered: RefCell<Vec<(Io, u64)>>,
    waiting: RefCell<VecDeque<(Io, u64)>>,
    device_flushes: Cell<u64>,
}

impl FlushBatcher {
    /// A batcher in `mode`.
    pub fn new(mode: FlushMode) -> FlushBatcher {
        FlushBatcher {
            mode,
            running: Cell::new(false),
            covered: RefCell::new(Vec::with_capacity(64)),
            waiting: RefCell::new(VecDeque::with_capacity(64)),
            device_flushes: Cell::new(0),
        }
    }

    /// A flush request arrived at `now_ns`. Returns true when the caller must start a
    /// device flush now; otherwise the request waits for the next one.
    #[inline]
    pub fn arrive(&self, io: Io, now_ns: u64) -> bool {
        if self.running.get() {
            self.waiting.borrow_mut().push_back((io, now_ns));
            return false;
        }
        self.running.set(true);
        self.covered.borrow_mut().push((io, now_ns));
        self.device_flushes.set(self.device_flushes.get() + 1);
        true
    }

    /// The running device flush has finished: `satisfied` is called for every request it
    /// covers (it may submit new requests). Returns true when the caller must start the
    /// next device flush, for the requests that arrived while this one ran.
    pub fn finish(&self, mut satisfied: impl FnMut(Io, u64)) -> bool {
        let mut list = self.covered.take();
        for &(io, start) in &list {
            satisfied(io, start);
        }
        list.clear();
        let mut waiting = self.waiting.borrow_mut();
        if waiting.is_empty() {
            *self.covered.borrow_mut() = list;
            self.running.set(false);
            return false;
        }
        match self.mode {
            FlushMode::Batched => list.extend(waiting.drain(..)),
            FlushMode::Serial => list.extend(waiting.pop_front()),
        }
        *self.covered.borrow_mut() = list;
        self.device_flushes.set(self.device_flushes.get() + 1);
        true
    }

    /// Device flushes started so far.
    pub fn device_flushes(&self) -> u64 {
        self.device_flushes.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::{Op, SinkId};

    fn flush(token: u64) -> Io {
        Io::nodata(Op::Flush, 0, 0, SinkId(0), token)
    }

    #[test]
    fn batched_covers_everything_that_waited() {
        let b = FlushBatcher::new(FlushMode::Batched);
        assert!(b.arrive(flush(1), 0));
        assert!(!b.arrive(flush(2), 1));
        assert!(!b.arrive(flush(3), 2));
        let mut done = Vec::new();
        // The first device flush satisfies only request 1: 2 and 3 arrived after it began.
        assert!(b.finish(|io, _| done.push(io.token)));
        assert_eq!(done, [1]);
        assert!(!b.finish(|io, _| done.push(io.token)));
        assert_eq!(done, [1, 2, 3]);
        assert_eq!(b.device_flushes(), 2);
        assert!(b.arrive(flush(4), 5));
    }

    #[test]
    fn serial_flushes_one_by_one() {
        let b = FlushBatcher::new(FlushMode::Serial);
        assert!(b.arrive(flush(1), 0));
        assert!(!b.arrive(flush(2), 0));
        assert!(!b.arrive(flush(3), 0));
        let mut done = Vec::new();
        assert!(b.finish(|io, _| done.push(io.token)));
        assert!(b.finish(|io, _| done.push(io.token)));
        assert!(!b.finish(|io, _| done.push(io.token)));
        assert_eq!(done, [1, 2, 3]);
        assert_eq!(b.device_flushes(), 3);
    }

    #[test]
    fn requests_arriving_during_completion_wait_for_the_next_flush() {
        let b = FlushBatcher::new(FlushMode::Batched);
        assert!(b.arrive(flush(1), 0));
        let mut again = false;
        let more = b.finish(|_, _| {
            // A client resubmits from its completion: it must not share the flush that
            // has just finished.
            again = !b.arrive(flush(2), 1);
        });
        assert!(again && more);
    }
}
