//! Per-queue statistics in the shape of `/proc/diskstats`, plus latency histograms.
//!
//! Each queue has one writer: its reactor thread. Counters and histogram buckets are
//! atomics written with plain relaxed load-and-store (no read-modify-write, so no locked
//! instruction on the hot path: on x86 they compile to the same moves as plain integers),
//! and any thread can read them without stopping I/O: the admin socket, the metrics
//! endpoint and progress displays do. A reader may see one request counted in one field
//! and not yet in another; every field only grows.

use std::cell::OnceCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use crate::io::{Io, IoFlags, Op};

/// Whether devices keep statistics (`--stats on|off`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StatsMode {
    /// Count everything (the default).
    #[default]
    On,
    /// Count nothing; for measuring what statistics cost.
    Off,
}

/// Largest latency a histogram records exactly (one hour); longer ones saturate.
pub const LATENCY_NS_MAX: u64 = 3_600_000_000_000;

/// Sub-buckets per power of two (5 bits: at most 1/32 = 3.1% relative error).
const SUB_BITS: u32 = 5;
const SUB: u64 = 1 << SUB_BITS;
/// Values below this are counted exactly.
const EXACT: u64 = 2 * SUB;
/// Buckets: exact values, then SUB per power of two up to 2^64.
const BUCKETS: usize = (EXACT + (64 - SUB_BITS as u64 - 1) * SUB) as usize;

/// A log-linear latency histogram for the hot path: exact below 64 ns, then 32 buckets
/// per power of two, so recording is a leading-zero count, a shift and an increment.
/// (hdrhistogram, used for the bench's own report, does more work per value.)
#[derive(Clone)]
pub struct LatencyHistogram {
    counts: Box<[u64; BUCKETS]>,
    count: u64,
    sum: u64,
    max: u64,
}

impl Default for LatencyHistogram {
    fn default() -> LatencyHistogram {
        LatencyHistogram {
            counts: Box::new([0; BUCKETS]),
            count: 0,
            sum: 0,
            max: 0,
        }
    }
}

impl LatencyHistogram {
    #[inline]
    fn index(v: u64) -> usize {
        if v < EXACT {
            v as usize
        } else {
            let msb = 63 - v.leading_zeros();
            let shift = msb - SUB_BITS;
            (EXACT + u64::from(shift - 1) * SUB + ((v >> shift) - SUB)) as usize
        }
    }

    /// Highest value counted in bucket `i`.
    fn upper(i: usize) -> u64 {
        let i = i as u64;
        if i < EXACT {
            return i;
        }
        let k = i - EXACT;
        let shift = k / SUB + 1;
        let low = (k % SUB + SUB) << shift;
        low.saturating_add((1 << shift) - 1)
    }

    /// Counts one value.
    #[inline]
    pub fn record(&mut self, v: u64) {
        self.counts[Self::index(v)] += 1;
        self.count += 1;
        self.sum = self.sum.wrapping_add(v);
        self.max = self.max.max(v);
    }

    /// Values counted.
    pub fn len(&self) -> u64 {
        self.count
    }

    /// Whether nothing was counted.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Exact mean.
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum as f64 / self.count as f64
        }
    }

    /// Exact maximum.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The value at quantile `q` (0..=1): the top of the bucket holding it, capped by the
    /// maximum.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::upper(i).min(self.max);
            }
        }
        self.max
    }

    /// For each bound (ascending), how many values were at most it; a value in the bucket
    /// that holds the bound counts as under it (so within the bucket's 3%).
    pub fn cumulative(&self, bounds: &[u64]) -> Vec<u64> {
        let mut out = Vec::with_capacity(bounds.len());
        let (mut i, mut seen) = (0, 0);
        for &b in bounds {
            let last = Self::index(b);
            while i <= last && i < BUCKETS {
                seen += self.counts[i];
                i += 1;
            }
            out.push(seen);
        }
        out
    }

    /// Adds another histogram.
    pub fn merge(&mut self, other: &LatencyHistogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
        self.count += other.count;
        self.sum = self.sum.wrapping_add(other.sum);
        self.max = self.max.max(other.max);
    }

    /// What was counted since `earlier` (the maximum stays the overall one).
    pub fn since(&self, earlier: &LatencyHistogram) -> LatencyHistogram {
        let mut out = self.clone();
        for (a, b) in out.counts.iter_mut().zip(earlier.counts.iter()) {
            *a -= (*b).min(*a);
        }
        out.count -= earlier.count.min(out.count);
        out.sum = out.sum.wrapping_sub(earlier.sum);
        out
    }
}

/// A [`LatencyHistogram`] with one writer and readers on any thread.
struct SharedHistogram {
    counts: Box<[AtomicU64; BUCKETS]>,
    count: AtomicU64,
    sum: AtomicU64,
    max: AtomicU64,
}

impl Default for SharedHistogram {
    fn default() -> SharedHistogram {
        SharedHistogram {
            counts: Box::new(std::array::from_fn(|_| AtomicU64::new(0))),
            count: AtomicU64::new(0),
            sum: AtomicU64::new(0),
            max: AtomicU64::new(0),
        }
    }
}

impl SharedHistogram {
    /// Counts one value; only the owning thread calls it.
    #[inline(always)]
    fn record(&self, v: u64) {
        bump(&self.counts[LatencyHistogram::index(v)], 1);
        bump(&self.count, 1);
        bump(&self.sum, v);
        if v > self.max.load(Relaxed) {
            self.max.store(v, Relaxed);
        }
    }

    /// A copy; its count is the sum of the buckets read, so the two agree.
    fn load(&self) -> LatencyHistogram {
        let mut counts = Box::new([0u64; BUCKETS]);
        let mut count = 0;
        for (c, a) in counts.iter_mut().zip(self.counts.iter()) {
            *c = a.load(Relaxed);
            count += *c;
        }
        LatencyHistogram {
            counts,
            count,
            sum: self.sum.load(Relaxed),
            max: self.max.load(Relaxed),
        }
    }
}

/// Everything one queue counts, readable from any thread.
#[derive(Default)]
pub struct Counters {
    ios: [AtomicU64; Op::COUNT],
    sectors: [AtomicU64; Op::COUNT],
    errors: AtomicU64,
    in_flight: AtomicU64,
    busy_ns: AtomicU64,
    busy_since_ns: AtomicU64,
    latency: [SharedHistogram; Op::COUNT],
    /// The queue that writes these closed: the registry folds them into its total.
    closed: AtomicBool,
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counters")
            .field("ios", &self.ios)
            .field("errors", &self.errors)
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

impl Counters {
    /// A copy of everything counted so far, at `now_ns` (on the queue's clock: the
    /// monotonic clock), from any thread.
    pub fn snapshot(&self, now_ns: u64, enabled: bool) -> DeviceStatsSnapshot {
        let latency: [LatencyHistogram; Op::COUNT] =
            std::array::from_fn(|i| self.latency[i].load());
        let load = |a: &[AtomicU64; Op::COUNT]| std::array::from_fn(|i| a[i].load(Relaxed));
        let in_flight = self.in_flight.load(Relaxed);
        let mut busy_ns = self.busy_ns.load(Relaxed);
        if in_flight > 0 {
            busy_ns += now_ns.saturating_sub(self.busy_since_ns.load(Relaxed));
        }
        DeviceStatsSnapshot {
            enabled,
            ios: load(&self.ios),
            sectors: load(&self.sectors),
            ticks_ns: std::array::from_fn(|i| latency[i].sum),
            errors: self.errors.load(Relaxed),
            in_flight,
            busy_ns,
            latency,
        }
    }

    /// Completed requests of `op` so far.
    pub fn ios(&self, op: Op) -> u64 {
        self.ios[op.index()].load(Relaxed)
    }

    /// Bytes completed by `op` so far.
    pub fn bytes(&self, op: Op) -> u64 {
        self.sectors[op.index()].load(Relaxed) * 512
    }
}

/// Adds to a counter that only the calling thread writes.
#[inline]
fn bump(counter: &AtomicU64, by: u64) {
    counter.store(counter.load(Relaxed).wrapping_add(by), Relaxed);
}

/// Statistics of one queue (one device on one reactor).
///
/// A queue that answers requests itself (a leaf: null, mem, a file, a remote export) can
/// also count, in a second set of counters, the requests a stacked device above it only
/// remapped and marked [`IoFlags::DELEGATED`]: the stacked device then takes no
/// completion of its own, and each such request is still counted once for the member and
/// once for the stacked device (the member's snapshot adds both sets; the stacked
/// device's adds the sets it lent out, see [`QueueStats::delegate`]).
pub struct QueueStats {
    enabled: bool,
    counters: Arc<Counters>,
    /// Whether this queue answers requests itself (may take delegated ones).
    leaf: bool,
    /// Requests a stacked device delegated to this leaf.
    delegated: OnceCell<Arc<Counters>>,
    /// Of a stacked device: what its members counted for it.
    lent: Mutex<Vec<Arc<Counters>>>,
}

impl QueueStats {
    /// Statistics that count when `mode` is on and do nothing when it is off.
    pub fn new(mode: StatsMode) -> QueueStats {
        QueueStats::with_leaf(mode, false)
    }

    /// [`QueueStats::new`] of a queue that answers every request itself and never passes
    /// one on: it may count requests for the stacked device above it.
    pub fn leaf(mode: StatsMode) -> QueueStats {
        QueueStats::with_leaf(mode, true)
    }

    fn with_leaf(mode: StatsMode, leaf: bool) -> QueueStats {
        QueueStats {
            enabled: mode == StatsMode::On,
            counters: Arc::new(Counters::default()),
            leaf,
            delegated: OnceCell::new(),
            lent: Mutex::new(Vec::new()),
        }
    }

    /// [`QueueStats::new`], added to the [`registry`] under the device's `name` (every
    /// queue a device opens is, so that operators see all of its I/O).
    pub fn named(mode: StatsMode, name: &str) -> QueueStats {
        let stats = QueueStats::new(mode);
        registry().add(name, &stats);
        stats
    }

    /// [`QueueStats::leaf`], added to the [`registry`] under the device's `name`.
    pub fn named_leaf(mode: StatsMode, name: &str) -> QueueStats {
        let stats = QueueStats::leaf(mode);
        registry().add(name, &stats);
        stats
    }

    /// Whether this queue counts at all; callers skip clock reads when it does not.
    #[inline]
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The counters, shareable with other threads (not those of delegated requests).
    pub fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    /// Lets a stacked device delegate its accounting to this queue: returns, the first
    /// time only, the counters in which this queue will count the requests marked
    /// [`IoFlags::DELEGATED`]. `None` if this queue is not a leaf, does not count, or
    /// already delegates (to the one stacked device that opened it). The caller adds
    /// them to its own statistics ([`QueueStats::lend`]) and to the registry under its
    /// name and the member's ([`Registry::add_counters`]).
    pub fn delegate(&self) -> Option<Arc<Counters>> {
        if !self.leaf || !self.enabled || self.delegated.get().is_some() {
            return None;
        }
        let c = Arc::new(Counters::default());
        self.delegated.set(c.clone()).ok()?;
        Some(c)
    }

    /// Whether requests marked [`IoFlags::DELEGATED`] may be sent to this queue.
    pub fn delegates(&self) -> bool {
        self.delegated.get().is_some()
    }

    /// Adds a member's delegated counters to this (stacked) queue's statistics.
    pub fn lend(&self, counters: Arc<Counters>) {
        self.lent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(counters);
    }

    /// Where a request with `flags` is counted.
    #[inline(always)]
    fn target(&self, flags: IoFlags) -> &Counters {
        if flags.contains(IoFlags::DELEGATED) {
            if let Some(c) = self.delegated.get() {
                return c;
            }
        }
        &self.counters
    }

    /// A request with `flags` starts now: reads the clock (`now`) only when counting,
    /// records the start and returns its time (0 when not counting), for
    /// [`QueueStats::done`] or [`QueueStats::finish`].
    #[inline]
    pub fn begin(&self, flags: IoFlags, now: impl FnOnce() -> u64) -> u64 {
        let start = if self.enabled { now() } else { 0 };
        self.start(flags, start);
        start
    }

    /// A request with `flags` was started at `now_ns`.
    #[inline]
    pub fn start(&self, flags: IoFlags, now_ns: u64) {
        if !self.enabled {
            return;
        }
        let c = self.target(flags);
        let in_flight = c.in_flight.load(Relaxed);
        if in_flight == 0 {
            c.busy_since_ns.store(now_ns, Relaxed);
        }
        c.in_flight.store(in_flight + 1, Relaxed);
    }

    /// A request with `flags` started at `start_ns` completed at `now_ns`.
    #[inline(always)]
    pub fn done(&self, flags: IoFlags, op: Op, bytes: u64, start_ns: u64, now_ns: u64, ok: bool) {
        if !self.enabled {
            return;
        }
        let c = self.target(flags);
        let i = op.index();
        let latency_ns = now_ns.saturating_sub(start_ns);
        if ok {
            bump(&c.ios[i], 1);
            bump(&c.sectors[i], bytes >> 9);
        } else {
            bump(&c.errors, 1);
        }
        let in_flight = c.in_flight.load(Relaxed).saturating_sub(1);
        c.in_flight.store(in_flight, Relaxed);
        if in_flight == 0 {
            let since = c.busy_since_ns.load(Relaxed);
            bump(&c.busy_ns, now_ns.saturating_sub(since));
        }
        c.latency[i].record(latency_ns);
    }

    /// [`QueueStats::done`] for `io`, started at `start_ns`; reads the clock (`now`)
    /// only when counting.
    #[inline(always)]
    pub fn finish(&self, io: &Io, start_ns: u64, now: impl FnOnce() -> u64, ok: bool) {
        if self.enabled {
            self.done(io.flags, io.op, io.len, start_ns, now(), ok);
        }
    }

    /// A copy of everything counted so far, at `now_ns`: this queue's own requests, those
    /// it counted for a stacked device above it, and those its members counted for it.
    pub fn snapshot(&self, now_ns: u64) -> DeviceStatsSnapshot {
        let mut out = self.counters.snapshot(now_ns, self.enabled);
        if let Some(d) = self.delegated.get() {
            out.merge(&d.snapshot(now_ns, self.enabled));
        }
        for l in self.lent.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            out.merge(&l.snapshot(now_ns, self.enabled));
        }
        out
    }
}

impl Drop for QueueStats {
    fn drop(&mut self) {
        self.counters.closed.store(true, Relaxed);
        if let Some(d) = self.delegated.get() {
            d.closed.store(true, Relaxed);
        }
    }
}

/// Statistics of a device (the sum over its queues) at one moment.
#[derive(Clone)]
pub struct DeviceStatsSnapshot {
    /// Whether statistics were being kept.
    pub enabled: bool,
    /// Completed requests per operation.
    pub ios: [u64; Op::COUNT],
    /// 512-byte sectors transferred per operation.
    pub sectors: [u64; Op::COUNT],
    /// Sum of request latencies per operation, in nanoseconds.
    pub ticks_ns: [u64; Op::COUNT],
    /// Requests that completed with an error.
    pub errors: u64,
    /// Requests in flight when the snapshot was taken.
    pub in_flight: u64,
    /// Time during which at least one request was in flight, in nanoseconds.
    pub busy_ns: u64,
    /// Completion latency per operation.
    pub latency: [LatencyHistogram; Op::COUNT],
}

impl DeviceStatsSnapshot {
    /// Adds another queue's statistics to this one.
    pub fn merge(&mut self, other: &DeviceStatsSnapshot) {
        for i in 0..Op::COUNT {
            self.ios[i] += other.ios[i];
            self.sectors[i] += other.sectors[i];
            self.ticks_ns[i] += other.ticks_ns[i];
            self.latency[i].merge(&other.latency[i]);
        }
        self.errors += other.errors;
        self.in_flight += other.in_flight;
        // Queues run in parallel: the device was busy while any queue was; the largest
        // queue figure is the closest lower bound without per-request timestamps.
        self.busy_ns = self.busy_ns.max(other.busy_ns);
        self.enabled |= other.enabled;
    }

    /// What happened between `earlier` and this snapshot.
    pub fn since(&self, earlier: &DeviceStatsSnapshot) -> DeviceStatsSnapshot {
        let mut out = self.clone();
        for i in 0..Op::COUNT {
            out.ios[i] -= earlier.ios[i].min(out.ios[i]);
            out.sectors[i] -= earlier.sectors[i].min(out.sectors[i]);
            out.ticks_ns[i] -= earlier.ticks_ns[i].min(out.ticks_ns[i]);
            out.latency[i] = out.latency[i].since(&earlier.latency[i]);
        }
        out.errors -= earlier.errors.min(out.errors);
        out.busy_ns -= earlier.busy_ns.min(out.busy_ns);
        out
    }
}

/// Every queue's statistics in this process, by device, for readers on other threads (the
/// admin socket, the metrics endpoint). Queues are added when they open, not per request;
/// a queue that closed is folded into its device's total at the next read, so totals never
/// go back.
pub struct Registry {
    devices: std::sync::Mutex<Vec<Entry>>,
    /// Redundant arrays' read repairs, by device (held weakly: an array that closed
    /// drops out).
    repairs: std::sync::Mutex<Vec<(String, std::sync::Weak<RepairCounters>)>>,
}

/// A redundant array's read repairs: a read that failed on one copy and was answered
/// from another had its range rewritten on the copy that failed. Rare events, counted
/// off the hot path (by the array's repair thread) and read by the admin socket and the
/// metrics endpoint.
#[derive(Debug, Default)]
pub struct RepairCounters {
    /// Ranges rewritten.
    pub repaired: AtomicU64,
    /// Bytes rewritten.
    pub repaired_bytes: AtomicU64,
    /// Rewrites that failed (each failed its member).
    pub failed: AtomicU64,
}

/// What [`RepairCounters`] held at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RepairSnapshot {
    /// Ranges rewritten.
    pub repaired: u64,
    /// Bytes rewritten.
    pub repaired_bytes: u64,
    /// Rewrites that failed.
    pub failed: u64,
}

impl RepairCounters {
    /// The counts now.
    pub fn snapshot(&self) -> RepairSnapshot {
        RepairSnapshot {
            repaired: self.repaired.load(Relaxed),
            repaired_bytes: self.repaired_bytes.load(Relaxed),
            failed: self.failed.load(Relaxed),
        }
    }
}

struct Entry {
    name: String,
    live: Vec<(Arc<Counters>, bool)>,
    retired: Option<DeviceStatsSnapshot>,
}

static REGISTRY: Registry = Registry {
    devices: std::sync::Mutex::new(Vec::new()),
    repairs: std::sync::Mutex::new(Vec::new()),
};

/// This process's [`Registry`].
pub fn registry() -> &'static Registry {
    &REGISTRY
}

std::thread_local! {
    /// Set while [`unregistered`] runs on this thread.
    static UNREGISTERED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the queues it opens on this thread left out of the [`registry`]: for
/// devices opened only to be looked at before the same devices are opened for real (the
/// preflight of `cairn serve` and `cairn bench`), whose reads operators would otherwise
/// see counted twice under the served devices' names.
pub fn unregistered<T>(f: impl FnOnce() -> T) -> T {
    let before = UNREGISTERED.with(|u| u.replace(true));
    let out = f();
    UNREGISTERED.with(|u| u.set(before));
    out
}

/// Whether this thread is inside [`unregistered`]: devices opened there are only looked
/// at, and say at open only what they will say again when opened for real.
pub fn unregistered_here() -> bool {
    UNREGISTERED.with(std::cell::Cell::get)
}

impl Registry {
    /// Adds the statistics of one queue of the device `name`.
    pub fn add(&self, name: &str, stats: &QueueStats) {
        self.add_counters(name, stats.counters(), stats.enabled());
    }

    /// Adds counters of the device `name`: a queue's own, or those a member counts for
    /// the stacked device that delegated to it ([`QueueStats::delegate`]), added under
    /// both names.
    pub fn add_counters(&self, name: &str, counters: Arc<Counters>, enabled: bool) {
        if UNREGISTERED.with(std::cell::Cell::get) {
            return;
        }
        let mut devices = self.devices.lock().unwrap_or_else(|p| p.into_inner());
        let entry = match devices.iter().position(|e| e.name == name) {
            Some(i) => &mut devices[i],
            None => {
                devices.push(Entry {
                    name: name.to_string(),
                    live: Vec::new(),
                    retired: None,
                });
                devices.last_mut().expect("just pushed")
            }
        };
        // Queues that closed since the last read are folded in now, so that opening and
        // closing queues (superblock writes open one each) never piles them up.
        Self::fold_closed(entry, crate::clock::monotonic_ns());
        entry.live.push((counters, enabled));
    }

    /// Moves the queues of `entry` that closed into its retired total.
    fn fold_closed(entry: &mut Entry, now_ns: u64) {
        let mut i = 0;
        while i < entry.live.len() {
            if entry.live[i].0.closed.load(Relaxed) {
                let (c, enabled) = entry.live.swap_remove(i);
                let snap = c.snapshot(now_ns, enabled);
                match &mut entry.retired {
                    Some(r) => r.merge(&snap),
                    None => entry.retired = Some(snap),
                }
            } else {
                i += 1;
            }
        }
    }

    /// Adds the read repair counters of the redundant array `name` (when it opens).
    pub fn add_repairs(&self, name: &str, counters: &Arc<RepairCounters>) {
        let mut repairs = self.repairs.lock().unwrap_or_else(|p| p.into_inner());
        repairs.retain(|(_, c)| c.strong_count() > 0);
        repairs.push((name.to_string(), Arc::downgrade(counters)));
    }

    /// The read repairs of the redundant array `name`, if it is open (the one opened
    /// last, if several of that name are).
    pub fn repairs(&self, name: &str) -> Option<RepairSnapshot> {
        let repairs = self.repairs.lock().unwrap_or_else(|p| p.into_inner());
        repairs
            .iter()
            .rev()
            .filter(|(n, _)| n == name)
            .find_map(|(_, c)| c.upgrade())
            .map(|c| c.snapshot())
    }

    /// The statistics of the device `name`, summed over its queues, open and closed, at
    /// `now_ns` on the monotonic clock; `None` if no queue of it ever opened.
    pub fn device(&self, name: &str, now_ns: u64) -> Option<DeviceStatsSnapshot> {
        let mut devices = self.devices.lock().unwrap_or_else(|p| p.into_inner());
        let entry = devices.iter_mut().find(|e| e.name == name)?;
        Self::fold_closed(entry, now_ns);
        let mut total = entry.retired.clone();
        for (c, enabled) in &entry.live {
            let snap = c.snapshot(now_ns, *enabled);
            match &mut total {
                Some(t) => t.merge(&snap),
                None => total = Some(snap),
            }
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_like_diskstats() {
        let s = QueueStats::new(StatsMode::On);
        s.start(IoFlags::NONE, 100);
        s.start(IoFlags::NONE, 150);
        s.done(IoFlags::NONE, Op::Read, 4096, 100, 300, true);
        s.done(IoFlags::NONE, Op::Write, 8192, 150, 400, true);
        s.start(IoFlags::NONE, 1000);
        s.done(IoFlags::NONE, Op::Read, 512, 1000, 1010, false);
        let snap = s.snapshot(2000);
        assert_eq!(snap.ios[Op::Read.index()], 1);
        assert_eq!(snap.ios[Op::Write.index()], 1);
        assert_eq!(snap.sectors[Op::Write.index()], 16);
        assert_eq!(snap.errors, 1);
        assert_eq!(snap.ticks_ns[Op::Read.index()], 200 + 10);
        assert_eq!(snap.busy_ns, 300 + 10);
        assert_eq!(snap.in_flight, 0);
        assert_eq!(snap.latency[Op::Write.index()].len(), 1);
    }

    #[test]
    fn a_leaf_counts_delegated_requests_apart_and_reports_both() {
        let leaf = QueueStats::leaf(StatsMode::On);
        let stack = QueueStats::new(StatsMode::On);
        // Before it agrees, a delegated request counts as the leaf's own.
        leaf.start(IoFlags::DELEGATED, 0);
        leaf.done(IoFlags::DELEGATED, Op::Read, 4096, 0, 10, true);
        let lent = leaf.delegate().expect("a leaf that counts agrees once");
        assert!(leaf.delegate().is_none(), "and only once");
        assert!(stack.delegate().is_none(), "a stacked device never agrees");
        assert!(QueueStats::leaf(StatsMode::Off).delegate().is_none());
        stack.lend(lent.clone());
        leaf.start(IoFlags::DELEGATED.with(IoFlags::FUA), 20);
        leaf.done(
            IoFlags::DELEGATED.with(IoFlags::FUA),
            Op::Write,
            8192,
            20,
            50,
            true,
        );
        leaf.start(IoFlags::FUA, 60);
        leaf.done(IoFlags::FUA, Op::Write, 512, 60, 70, false);
        assert_eq!(leaf.counters().ios(Op::Read), 1);
        assert_eq!(leaf.counters().ios(Op::Write), 0);
        assert_eq!(lent.ios(Op::Write), 1);
        let l = leaf.snapshot(100);
        assert_eq!((l.ios[0], l.ios[1], l.errors), (1, 1, 1));
        assert_eq!(l.sectors[1], 16);
        let s = stack.snapshot(100);
        assert_eq!((s.ios[0], s.ios[1], s.errors), (0, 1, 0));
        assert_eq!(s.ticks_ns[1], 30);
        assert_eq!(s.busy_ns, 30);
    }

    #[test]
    fn queues_opened_unregistered_are_not_in_the_registry() {
        let name = "stats-test-unregistered";
        let quiet = unregistered(|| QueueStats::named_leaf(StatsMode::On, name));
        quiet.start(IoFlags::NONE, 0);
        quiet.done(IoFlags::NONE, Op::Read, 4096, 0, 10, true);
        assert!(registry().device(name, 100).is_none());
        let counted = QueueStats::named_leaf(StatsMode::On, name);
        counted.start(IoFlags::NONE, 0);
        counted.done(IoFlags::NONE, Op::Read, 4096, 0, 10, true);
        assert_eq!(registry().device(name, 100).map(|s| s.ios[0]), Some(1));
    }

    #[test]
    fn the_registry_keeps_what_closed_queues_counted() {
        let name = "stats-test-registry";
        let leaf = QueueStats::named_leaf(StatsMode::On, name);
        let lent = leaf.delegate().expect("delegates");
        registry().add_counters("stats-test-registry-upper", lent.clone(), true);
        leaf.start(IoFlags::NONE, 0);
        leaf.done(IoFlags::NONE, Op::Read, 4096, 0, 10, true);
        leaf.start(IoFlags::DELEGATED, 10);
        leaf.done(IoFlags::DELEGATED, Op::Read, 4096, 10, 20, true);
        let read = |n: &str| registry().device(n, 100).map(|s| s.ios[0]);
        assert_eq!(
            read(name),
            Some(1),
            "the leaf's own (its delegated set is added by whoever delegates)"
        );
        assert_eq!(read("stats-test-registry-upper"), Some(1));
        drop(leaf);
        // Closed: folded into the totals at the next read, still counted; and a reader
        // still holding the counters (a stacked queue) does not keep them open.
        assert_eq!(read(name), Some(1));
        assert_eq!(read("stats-test-registry-upper"), Some(1));
        let again = QueueStats::named(StatsMode::On, name);
        again.start(IoFlags::NONE, 0);
        again.done(IoFlags::NONE, Op::Read, 4096, 0, 10, true);
        assert_eq!(read(name), Some(2));
        drop(lent);
    }

    #[test]
    fn busy_includes_open_interval() {
        let s = QueueStats::new(StatsMode::On);
        s.start(IoFlags::NONE, 100);
        let snap = s.snapshot(600);
        assert_eq!(snap.in_flight, 1);
        assert_eq!(snap.busy_ns, 500);
    }

    #[test]
    fn off_counts_nothing() {
        let s = QueueStats::new(StatsMode::Off);
        s.start(IoFlags::NONE, 1);
        s.done(IoFlags::NONE, Op::Read, 4096, 1, 2, true);
        let snap = s.snapshot(3);
        assert_eq!(snap.ios, [0; Op::COUNT]);
        assert!(!snap.enabled);
    }

    #[test]
    fn histogram_buckets_are_tight_and_ordered() {
        let mut previous = 0;
        for v in (0..200_000u64).chain([1 << 40, u64::MAX / 2, u64::MAX]) {
            let i = LatencyHistogram::index(v);
            assert!(i < BUCKETS, "{v}");
            assert!(i >= previous, "{v}");
            previous = i;
            let top = LatencyHistogram::upper(i);
            assert!(
                top >= v && (top - v) as f64 <= v as f64 / 31.0 + 1.0,
                "{v} -> {top}"
            );
        }
        let mut h = LatencyHistogram::default();
        for v in 1..=1000 {
            h.record(v * 1000);
        }
        assert_eq!(h.len(), 1000);
        assert_eq!(h.max(), 1_000_000);
        assert!((h.mean() - 500_500.0).abs() < 1e-6);
        let p50 = h.quantile(0.5) as f64;
        assert!((p50 - 500_000.0).abs() / 500_000.0 < 0.035, "{p50}");
        assert_eq!(h.quantile(1.0), 1_000_000);
    }

    #[test]
    fn cumulative_counts_by_bound() {
        let mut h = LatencyHistogram::default();
        for v in [5, 10, 1_000, 1_000, 50_000, 2_000_000] {
            h.record(v);
        }
        assert_eq!(
            h.cumulative(&[1, 10, 900, 1_000, 100_000, 1_000_000, u64::MAX]),
            [0, 2, 2, 4, 5, 5, 6]
        );
    }

    #[test]
    fn since_subtracts() {
        let s = QueueStats::new(StatsMode::On);
        s.start(IoFlags::NONE, 0);
        s.done(IoFlags::NONE, Op::Read, 4096, 0, 10, true);
        let a = s.snapshot(10);
        s.start(IoFlags::NONE, 20);
        s.done(IoFlags::NONE, Op::Read, 4096, 20, 50, true);
        let b = s.snapshot(50);
        let d = b.since(&a);
        assert_eq!(d.ios[0], 1);
        assert_eq!(d.latency[0].len(), 1);
        assert_eq!(d.busy_ns, 30);
    }
}
