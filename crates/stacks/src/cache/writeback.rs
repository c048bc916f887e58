//! Write-back settings and dirty throttling (technique 3's groundwork).
//!
//! The `[writeback]` table of a stack file sets one dirty budget shared by every cache
//! device, after the kernel's knobs: `background` (dirty_background_ratio/bytes: flushers
//! start writing back), `limit` (dirty_ratio/bytes: writers are held back hardest),
//! `expire` (dirty_expire_centisecs: data older than this is written back even below the
//! background level) and `interval` (dirty_writeback_centisecs: how often flushers wake).
//!
//! [`Throttle`] is the writer-side model, after Linux's `balance_dirty_pages`: below the
//! "freerun" level halfway between background and limit, writers run free; above it each
//! write is paced at the measured write-back rate scaled by a position ratio that falls
//! smoothly (a cubic) from 1 at the setpoint to 0 at the limit, so dirty data settles
//! near the setpoint instead of hitting the limit and stopping writers dead.
//!
//! Pacing is per writer (a device queue, with however many requests in flight), not per
//! request, and at a rate [`Ratelimit`] estimates the way Linux estimates its
//! `dirty_ratelimit`: the rate at which each of the writers there are now may dirty data
//! so that together they dirty it as fast as it is written back. Without it, a writer
//! with 32 requests in flight would dirty 32 times faster than planned, the dirty level
//! would ride the limit, and writers would stop and go.

use std::time::Duration;

use cairn_core::Error;

/// A level of dirty data: bytes, or a percentage of the cache memory of all caches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Amount {
    /// Bytes.
    Bytes(u64),
    /// Percent of the total cache memory (0 to 100).
    Percent(f64),
}

impl Amount {
    /// The level in bytes, for caches holding `cache_bytes` in all.
    pub fn bytes(self, cache_bytes: u64) -> u64 {
        match self {
            Amount::Bytes(b) => b,
            Amount::Percent(p) => (cache_bytes as f64 * p / 100.0) as u64,
        }
    }
}

/// The `[writeback]` table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Writeback {
    /// Flushers start writing back above this.
    pub background: Amount,
    /// Writers are held back hardest at this level.
    pub limit: Amount,
    /// Dirty data older than this is written back regardless of the level.
    pub expire: Duration,
    /// How often flushers wake up to look.
    pub interval: Duration,
}

impl Default for Writeback {
    /// The kernel's defaults: 10% and 20%, 30 s, 5 s.
    fn default() -> Writeback {
        Writeback {
            background: Amount::Percent(10.0),
            limit: Amount::Percent(20.0),
            expire: Duration::from_secs(30),
            interval: Duration::from_secs(5),
        }
    }
}

impl Writeback {
    /// Levels given in bytes fit in the caches' memory (`cache_bytes` in all), and the
    /// background level is below the limit.
    pub fn check_for(&self, cache_bytes: u64) -> Result<(), Error> {
        use cairn_core::size::format_bytes;
        for (key, amount) in [("background", self.background), ("limit", self.limit)] {
            if let Amount::Bytes(b) = amount {
                if b > cache_bytes {
                    return Err(Error::Invalid(format!(
                        "writeback: key '{key}' is {}, more than the caches' memory together ({}); give at most that, or a share such as \"20%\"",
                        format_bytes(b),
                        format_bytes(cache_bytes)
                    )));
                }
            }
        }
        self.throttle(cache_bytes).map(|_| ())
    }

    /// The throttle for caches holding `cache_bytes` in all; an error when the
    /// background level is not below the limit.
    pub fn throttle(&self, cache_bytes: u64) -> Result<Throttle, Error> {
        let (bg, limit) = (
            self.background.bytes(cache_bytes),
            self.limit.bytes(cache_bytes),
        );
        if bg >= limit {
            return Err(Error::Invalid(format!(
                "writeback: key 'background' ({}) must be below key 'limit' ({}) for caches of {} together",
                cairn_core::size::format_bytes(bg),
                cairn_core::size::format_bytes(limit),
                cairn_core::size::format_bytes(cache_bytes)
            )));
        }
        Ok(Throttle {
            background: bg,
            limit,
        })
    }
}

/// The dirty budget several cache devices share: their dirty bytes together, the throttle
/// computed on their memory together, and the timing knobs.
#[derive(Debug)]
pub struct Budget {
    /// Dirty bytes of every cache sharing the budget.
    pub dirty: std::sync::atomic::AtomicU64,
    /// Levels for all of them together.
    pub throttle: Throttle,
    /// Write back data older than this.
    pub expire: Duration,
    /// Flushers wake at least this often.
    pub interval: Duration,
    /// The shared write-back pool, with `--writeback shared`.
    pub(crate) pool: std::sync::OnceLock<std::sync::Arc<super::Pool>>,
    /// The caches sharing the budget, to wake all their flushers.
    pub(crate) members: std::sync::Mutex<Vec<std::sync::Weak<super::Shared>>>,
    /// Bytes that became dirty, and bytes written back, since the start.
    dirtied: std::sync::atomic::AtomicU64,
    cleaned: std::sync::atomic::AtomicU64,
    /// Each writer's base pacing rate (f64 bits, bytes per second), from `estimator`.
    ratelimit: std::sync::atomic::AtomicU64,
    estimator: std::sync::Mutex<(std::time::Instant, Ratelimit)>,
    /// Set by a writer that woke the flushers for being over the background level;
    /// cleared by a flusher going back to sleep (so writers do not wake them per write).
    pub(crate) woken: std::sync::atomic::AtomicBool,
    /// The caches are going away: flushers write everything back, in parallel.
    pub(crate) closing: std::sync::atomic::AtomicBool,
}

impl Budget {
    /// The budget of caches holding `cache_bytes` of memory in all.
    pub fn new(w: &Writeback, cache_bytes: u64) -> Result<Budget, Error> {
        Ok(Budget {
            dirty: std::sync::atomic::AtomicU64::new(0),
            throttle: w.throttle(cache_bytes)?,
            expire: w.expire,
            interval: w.interval,
            pool: std::sync::OnceLock::new(),
            members: std::sync::Mutex::new(Vec::new()),
            dirtied: std::sync::atomic::AtomicU64::new(0),
            cleaned: std::sync::atomic::AtomicU64::new(0),
            ratelimit: std::sync::atomic::AtomicU64::new(0f64.to_bits()),
            estimator: std::sync::Mutex::new((std::time::Instant::now(), Ratelimit::default())),
            woken: std::sync::atomic::AtomicBool::new(false),
            closing: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// How long a writer that just dirtied `bytes`, with `dirty` bytes dirty, waits.
    pub fn pause(&self, dirty: u64, bytes: u64) -> Duration {
        let r = f64::from_bits(self.ratelimit.load(std::sync::atomic::Ordering::Relaxed));
        // Before the first estimate: as if one writer went at 100 MB/s.
        let r = if r > 0.0 { r } else { 100e6 };
        self.throttle.pause(dirty, bytes, r)
    }

    /// Brings the rate estimate up to date, at most every [`Ratelimit::PERIOD`]; flushers
    /// call it as they work (writers never wait for it).
    pub(crate) fn tick(&self) {
        let Ok(mut e) = self.estimator.try_lock() else {
            return;
        };
        let dt = e.0.elapsed().as_secs_f64();
        if dt < Ratelimit::PERIOD {
            return;
        }
        e.0 = std::time::Instant::now();
        let r = e.1.update(
            dt,
            self.dirtied.load(std::sync::atomic::Ordering::Relaxed),
            self.cleaned.load(std::sync::atomic::Ordering::Relaxed),
            self.dirty_bytes(),
            &self.throttle,
        );
        self.ratelimit
            .store(r.to_bits(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Wakes every flusher once when a writer takes the dirty level over the background
    /// level (not on every write after that).
    pub(crate) fn over_background(&self) {
        if !self.woken.swap(true, std::sync::atomic::Ordering::Relaxed) {
            self.kick_all();
        }
    }

    /// Counts `bytes` written back and no longer dirty.
    pub(crate) fn written_back(&self, bytes: u64) {
        self.cleaned
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        self.sub(bytes);
    }

    /// Dirty bytes now, across the caches.
    pub fn dirty_bytes(&self) -> u64 {
        self.dirty.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Wakes the flusher of every cache sharing the budget.
    pub(crate) fn kick_all(&self) {
        let members = self.members.lock().unwrap_or_else(|p| p.into_inner());
        for m in members.iter().filter_map(std::sync::Weak::upgrade) {
            m.kick();
        }
    }

    pub(crate) fn add(&self, bytes: u64) {
        self.dirtied
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        self.dirty
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn sub(&self, bytes: u64) {
        let _ = self.dirty.fetch_update(
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
            |d| Some(d.saturating_sub(bytes)),
        );
    }
}

/// Writer pacing from the dirty level (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Throttle {
    /// Flushers write back above this many dirty bytes.
    pub background: u64,
    /// Writers are held back hardest at this many dirty bytes.
    pub limit: u64,
}

/// Longest a single write is paused.
pub const MAX_PAUSE: Duration = Duration::from_millis(200);

impl Throttle {
    /// Below this, writers are not paced at all.
    pub fn freerun(&self) -> u64 {
        self.background + (self.limit - self.background) / 2
    }

    /// Where pacing aims to hold the dirty level.
    pub fn setpoint(&self) -> u64 {
        self.freerun() + (self.limit - self.freerun()) / 2
    }

    /// The position ratio at `dirty` bytes: 0 at or above the limit, 2 at the freerun
    /// level, 1 at the setpoint. In between, `1 + (x^3 + x) / 2` of the distance `x` from
    /// the setpoint (1 at either end): Linux's global cubic `pos_ratio`, averaged with the
    /// linear term Linux applies per device, so that the level is pulled back to the
    /// setpoint from close by as well (the cubic alone is flat there, and the level
    /// drifts for tens of seconds).
    pub fn position_ratio(&self, dirty: u64) -> f64 {
        if dirty >= self.limit {
            return 0.0;
        }
        let (setpoint, limit) = (self.setpoint() as f64, self.limit as f64);
        let x = (setpoint - dirty as f64) / (limit - setpoint).max(1.0);
        (1.0 + (x * x * x + x) / 2.0).clamp(0.0, 2.0)
    }

    /// How long a writer that just dirtied `bytes` waits, with `dirty` bytes dirty and
    /// write-back running at `writeback_bps` bytes per second.
    pub fn pause(&self, dirty: u64, bytes: u64, writeback_bps: f64) -> Duration {
        if dirty < self.freerun() {
            return Duration::ZERO;
        }
        let rate = writeback_bps.max(1.0) * self.position_ratio(dirty);
        if rate <= 0.0 {
            return MAX_PAUSE;
        }
        Duration::from_secs_f64(bytes as f64 / rate).min(MAX_PAUSE)
    }
}

/// What became of a write handed to a [`Pacer`].
#[derive(Debug, PartialEq, Eq)]
pub enum Paced<T> {
    /// It completes now.
    Done(T),
    /// It waits; arm the pacing timer for this time (ns) when given (`None`: the timer
    /// is already armed).
    Wait(Option<u64>),
}

/// One writer's pacing (a cache queue's): its throttled writes complete one after
/// another, each a pause after the one before, the pause taken from the dirty level when
/// the write reaches the head of the line. So however many writes a writer has in
/// flight, it dirties data at the pacing rate, and a change in the dirty level is felt
/// at the next completion (not after a backlog computed in advance).
#[derive(Debug)]
pub struct Pacer<T> {
    waiting: std::collections::VecDeque<(T, u64)>,
}

impl<T> Default for Pacer<T> {
    fn default() -> Pacer<T> {
        Pacer {
            waiting: std::collections::VecDeque::with_capacity(64),
        }
    }
}

impl<T> Pacer<T> {
    /// A write of `len` bytes has just dirtied the cache at `now_ns`.
    pub fn write(&mut self, b: &Budget, item: T, len: u64, now_ns: u64) -> Paced<T> {
        if !self.waiting.is_empty() {
            self.waiting.push_back((item, len));
            return Paced::Wait(None);
        }
        let pause = b.pause(b.dirty_bytes(), len);
        if pause.is_zero() {
            return Paced::Done(item);
        }
        self.waiting.push_back((item, len));
        Paced::Wait(Some(now_ns + pause.as_nanos() as u64))
    }

    /// The pacing timer fired at `now_ns`: completes the head of the line, and those
    /// behind it whose pause is now zero, through `done`; returns when to fire next.
    pub fn timer(&mut self, b: &Budget, now_ns: u64, mut done: impl FnMut(T)) -> Option<u64> {
        if let Some((item, _)) = self.waiting.pop_front() {
            done(item);
        }
        while let Some(&(_, len)) = self.waiting.front() {
            let pause = b.pause(b.dirty_bytes(), len);
            if !pause.is_zero() {
                return Some(now_ns + pause.as_nanos() as u64);
            }
            let (item, _) = self.waiting.pop_front().expect("a head");
            done(item);
        }
        None
    }

    /// Writes waiting.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether no write waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

/// The estimate of each writer's pacing rate (Linux's `dirty_ratelimit`), updated every
/// [`Ratelimit::PERIOD`] from how fast data was dirtied and written back.
///
/// While writers are paced, `n` of them at `rate * pos` dirty `n * rate * pos` bytes per
/// second; the rate that would make them dirty exactly what is written back is
/// `rate * pos * written / dirtied` (the "balanced" rate). The estimate moves toward it
/// each period (an eighth of the way when close, up to half when far), which settles on `written / n` without knowing `n`;
/// the write-back bandwidth is averaged over about 3 s. Both are smoothed as Linux
/// smooths them, so that the noise of one period's measurements does not reach the
/// writers.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ratelimit {
    /// Each writer's rate at the setpoint, bytes per second (0: not yet known).
    pub rate: f64,
    /// Write-back bandwidth, a moving average, bytes per second.
    pub write_bw: f64,
    dirtied: u64,
    cleaned: u64,
    /// The dirty level at the last update.
    dirty: u64,
    started: bool,
}

impl Ratelimit {
    /// Seconds between updates.
    pub const PERIOD: f64 = 0.2;
    /// Seconds the write-back bandwidth is averaged over.
    pub const BANDWIDTH_WINDOW: f64 = 3.0;

    /// One update, `dt` seconds after the last, with the totals dirtied and written back
    /// so far and the dirty level now; returns the new rate.
    pub fn update(&mut self, dt: f64, dirtied: u64, cleaned: u64, dirty: u64, t: &Throttle) -> f64 {
        let (dd, dc) = (
            dirtied.saturating_sub(self.dirtied) as f64,
            cleaned.saturating_sub(self.cleaned) as f64,
        );
        let busy = self.dirty > t.background && dirty > t.background;
        (self.dirtied, self.cleaned, self.dirty) = (dirtied, cleaned, dirty);
        if !self.started || dt <= 0.0 {
            self.started = true;
            return self.rate;
        }
        let (dirty_rate, written) = (dd / dt, dc / dt);
        // The disks' bandwidth shows only while flushers had work all the period long
        // (below the background level they write what writers leave them).
        // Until the first such period, any write-back over the background level will do.
        let seed = self.write_bw <= 0.0 && dirty > t.background;
        if (busy || seed) && written > 0.0 {
            self.write_bw = if self.write_bw > 0.0 {
                let w = (dt / Self::BANDWIDTH_WINDOW).min(1.0);
                (1.0 - w) * self.write_bw + w * written
            } else {
                written
            };
        }
        if self.write_bw <= 0.0 {
            return self.rate;
        }
        if self.rate <= 0.0 {
            self.rate = self.write_bw;
        }
        if dirty >= t.freerun() && dirty_rate > 0.0 {
            // Writers were paced during the period: move toward the balanced rate.
            let pos = t.position_ratio(dirty).max(1.0 / 64.0);
            let balanced = self.rate * pos * self.write_bw / dirty_rate;
            // In log space: an eighth of the way when close (a period's measurement noise
            // is a few percent), up to half of it when far (a change in the number of
            // writers).
            let e = (balanced / self.rate).ln();
            self.rate *= (e * e.abs().clamp(1.0 / 8.0, 0.5)).exp();
        }
        // At most 1024 writers' worth of slowdown, and no faster than twice the disks.
        self.rate = self.rate.clamp(self.write_bw / 1024.0, 2.0 * self.write_bw);
        self.rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn throttle() -> Throttle {
        Throttle {
            background: 100 << 20,
            limit: 200 << 20,
        }
    }

    #[test]
    fn writers_run_free_below_the_freerun_level() {
        let t = throttle();
        assert_eq!(t.freerun(), 150 << 20);
        for dirty in [0, 100 << 20, (150 << 20) - 1] {
            assert_eq!(t.pause(dirty, 4096, 1e8), Duration::ZERO);
        }
    }

    #[test]
    fn pacing_is_smooth_and_grows_toward_the_limit() {
        let t = throttle();
        assert!((t.position_ratio(t.setpoint()) - 1.0).abs() < 1e-9);
        assert_eq!(t.position_ratio(t.limit), 0.0);
        // Monotonic, and no jump larger than 1% of the ratio's range between levels
        // 1/1000 of the window apart: writers slow down gradually, never stop-and-go.
        let (lo, hi) = (t.freerun(), t.limit);
        let step = (hi - lo) / 1000;
        let mut last = t.position_ratio(lo);
        for i in 1..1000 {
            let r = t.position_ratio(lo + i * step);
            assert!(r <= last + 1e-12, "ratio rises at step {i}");
            assert!(last - r < 0.02, "jump of {} at step {i}", last - r);
            last = r;
        }
        // At the setpoint a writer goes at the write-back rate: 4 KiB at 100 MB/s.
        let p = t.pause(t.setpoint(), 4096, 1e8);
        assert!((p.as_secs_f64() - 4096.0 / 1e8).abs() < 1e-9, "{p:?}");
        // Above the setpoint, slower than write-back; at the limit, the longest pause.
        assert!(t.pause(t.setpoint() + (10 << 20), 4096, 1e8) > p);
        assert_eq!(t.pause(t.limit, 4096, 1e8), MAX_PAUSE);
    }

    #[test]
    fn a_pacer_releases_one_write_per_pause_in_order_and_all_below_freerun() {
        let b = Budget::new(
            &Writeback {
                background: Amount::Bytes(100 << 20),
                limit: Amount::Bytes(200 << 20),
                ..Writeback::default()
            },
            0,
        )
        .unwrap();
        let mut p: Pacer<u32> = Pacer::default();
        // Below freerun: no wait.
        b.add(10 << 20);
        assert_eq!(p.write(&b, 1, 4096, 0), Paced::Done(1));
        // At the setpoint: the first write arms the timer a pause away (4 KiB at the
        // default 100 MB/s), the others queue behind it.
        b.add(b.throttle.setpoint() - (10 << 20));
        let Paced::Wait(Some(at)) = p.write(&b, 2, 4096, 1000) else {
            panic!("the first paced write arms the timer")
        };
        assert_eq!(at, 1000 + b.pause(b.dirty_bytes(), 4096).as_nanos() as u64);
        assert!(at > 1000);
        for i in 3..6 {
            assert_eq!(p.write(&b, i, 4096, 1000), Paced::Wait(None));
        }
        assert_eq!(p.len(), 4);
        // Each firing releases the head only, and re-arms.
        let mut out = Vec::new();
        let next = p.timer(&b, at, |w| out.push(w));
        assert_eq!(out, [2]);
        assert!(next.is_some_and(|n| n > at));
        // The level drops below freerun: everything waiting goes at once.
        b.written_back(b.dirty_bytes());
        assert_eq!(p.timer(&b, next.unwrap(), |w| out.push(w)), None);
        assert_eq!(out, [2, 3, 4, 5]);
        assert!(p.is_empty());
        // And a write with nothing waiting completes at once again.
        assert_eq!(p.write(&b, 6, 4096, 2000), Paced::Done(6));
    }

    /// Simulates `writers` writers keeping `depth` 4 KiB writes in flight each, paced as
    /// a cache queue paces them (see [`Pacer`]), against a flusher writing back `bw` bytes
    /// a second over the background level. Returns the bytes dirtied in each second and
    /// the lowest and highest dirty level after `warm` seconds.
    fn simulate(
        writers: usize,
        depth: usize,
        bw: f64,
        secs: u64,
        warm: u64,
    ) -> (Vec<f64>, u64, u64) {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        const NS: u64 = 1_000_000_000;
        let b = Budget::new(
            &Writeback {
                background: Amount::Bytes(12 << 20),
                limit: Amount::Bytes(24 << 20),
                ..Writeback::default()
            },
            0,
        )
        .unwrap();
        let t = b.throttle;
        let mut est = Ratelimit::default();
        let mut pacers: Vec<Pacer<()>> = (0..writers).map(|_| Pacer::default()).collect();
        // Pacing timers: (deadline, writer).
        let mut heap = BinaryHeap::new();
        let (mut now, mut next_tick) = (0u64, 0u64);
        let mut per_sec = vec![0.0; secs as usize];
        let (mut lo, mut hi) = (u64::MAX, 0);
        // A writer's slot writes again as soon as its last write completes.
        let mut pending: Vec<usize> = (0..writers)
            .flat_map(|w| std::iter::repeat_n(w, depth))
            .collect();
        loop {
            while let Some(w) = pending.pop() {
                b.add(4096);
                per_sec[(now / NS) as usize] += 4096.0;
                if now >= warm * NS {
                    (lo, hi) = (lo.min(b.dirty_bytes()), hi.max(b.dirty_bytes()));
                }
                match pacers[w].write(&b, (), 4096, now) {
                    Paced::Done(()) => pending.push(w),
                    Paced::Wait(Some(at)) => heap.push(Reverse((at, w))),
                    Paced::Wait(None) => {}
                }
            }
            let Some(Reverse((at, w))) = heap.pop() else {
                break;
            };
            if at >= secs * NS {
                break;
            }
            // The flusher and the estimator catch up to `at`.
            while now < at {
                let step = at.min(next_tick.max(now + 1)) - now;
                let clean = ((bw * step as f64 / NS as f64) as u64)
                    .min(b.dirty_bytes().saturating_sub(t.background));
                b.written_back(clean);
                now += step;
                if now >= next_tick {
                    let r = est.update(
                        Ratelimit::PERIOD,
                        b.dirtied.load(std::sync::atomic::Ordering::Relaxed),
                        b.cleaned.load(std::sync::atomic::Ordering::Relaxed),
                        b.dirty_bytes(),
                        &t,
                    );
                    b.ratelimit
                        .store(r.to_bits(), std::sync::atomic::Ordering::Relaxed);
                    next_tick += (Ratelimit::PERIOD * NS as f64) as u64;
                }
            }
            if let Some(at) = pacers[w].timer(&b, now, |()| pending.push(w)) {
                heap.push(Reverse((at, w)));
            }
        }
        (per_sec, lo, hi)
    }

    #[test]
    fn pacing_settles_writers_at_the_write_back_rate_whatever_their_number_and_depth() {
        let bw = 4e6;
        let t = Throttle {
            background: 12 << 20,
            limit: 24 << 20,
        };
        for (writers, depth) in [(1, 1), (1, 32), (4, 32), (16, 8), (64, 4)] {
            let (per_sec, lo, hi) = simulate(writers, depth, bw, 40, 8);
            let steady = &per_sec[8..];
            let mean = steady.iter().sum::<f64>() / steady.len() as f64;
            let var = steady.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / steady.len() as f64;
            let cov = var.sqrt() / mean;
            let case = format!(
                "{writers} writers x {depth}: mean {mean:.0} B/s, CoV {cov:.3}, dirty {lo}..{hi}"
            );
            assert!((mean / bw - 1.0).abs() < 0.1, "{case}");
            assert!(cov < 0.1, "{case}");
            // The level holds near the setpoint (the writers' rate is estimated right:
            // were each paced at the full write-back rate, more writers would push it
            // toward the limit), far from both ends: never stop-and-go.
            let band = (t.limit - t.setpoint()) / 2;
            assert!(
                lo > t.setpoint() - band && hi < t.setpoint() + band,
                "{case}"
            );
        }
    }
}
