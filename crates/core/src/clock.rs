//! The reactor's clock: one read per submission batch (technique 2), or one per call.
//!
//! Linux's block layer caches the current time in the task's plug because reading the
//! clock was the costliest thing it did per I/O. cairn does the same per reactor batch: the
//! loop refreshes the cached value once per pass, and everything stamped during that pass
//! (submissions, completions, statistics) shares it. `--clock precise` restores the
//! "before": every timestamp reads the clock.

use std::cell::Cell;

/// How timestamps are taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClockMode {
    /// One clock read per reactor batch (the default).
    #[default]
    Cached,
    /// One clock read per timestamp.
    Precise,
}

/// A per-reactor monotonic clock in nanoseconds.
#[derive(Debug)]
pub struct Clock {
    mode: ClockMode,
    cached_ns: Cell<u64>,
    reads: Cell<u64>,
}

impl Clock {
    /// A clock in the given mode, already read once.
    pub fn new(mode: ClockMode) -> Clock {
        let clock = Clock {
            mode,
            cached_ns: Cell::new(0),
            reads: Cell::new(0),
        };
        clock.cached_ns.set(clock.read());
        clock
    }

    /// The mode this clock runs in.
    pub fn mode(&self) -> ClockMode {
        self.mode
    }

    /// Current time: the batch's cached value, or a fresh read in precise mode.
    #[inline]
    pub fn now_ns(&self) -> u64 {
        match self.mode {
            ClockMode::Cached => self.cached_ns.get(),
            ClockMode::Precise => self.read(),
        }
    }

    /// Starts a new batch: in cached mode, reads the clock once.
    #[inline]
    pub fn refresh(&self) {
        if self.mode == ClockMode::Cached {
            self.cached_ns.set(self.read());
        }
    }

    /// How many times this clock has read the system clock (for tests and reports).
    pub fn reads(&self) -> u64 {
        self.reads.get()
    }

    #[inline]
    fn read(&self) -> u64 {
        self.reads.set(self.reads.get() + 1);
        monotonic_ns()
    }
}

/// Reads CLOCK_MONOTONIC in nanoseconds.
#[inline]
pub fn monotonic_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_reads_once_per_refresh() {
        let clock = Clock::new(ClockMode::Cached);
        let base = clock.reads();
        let a = clock.now_ns();
        let b = clock.now_ns();
        assert_eq!(a, b);
        assert_eq!(clock.reads(), base);
        clock.refresh();
        assert_eq!(clock.reads(), base + 1);
        assert!(clock.now_ns() >= a);
    }

    #[test]
    fn precise_reads_every_call() {
        let clock = Clock::new(ClockMode::Precise);
        let base = clock.reads();
        let a = clock.now_ns();
        let b = clock.now_ns();
        assert!(b >= a);
        assert_eq!(clock.reads(), base + 2);
        clock.refresh();
        assert_eq!(clock.reads(), base + 2);
    }
}
