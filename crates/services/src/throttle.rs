//! Rate limits: the arithmetic of a throttle, apart from any
//! device, so that it is exact on a virtual clock. The `throttle` device and export limits
//! build on it: the device is a wrap device (`cairn_stacks::wrap`) with a
//! [`ThrottlePolicy`].
//!
//! A limit is a leaky bucket, as qemu's throttling and cgroups' io.max think of it: each
//! request pours its units in (1 for an IOPS limit, its bytes for a bandwidth limit), the
//! bucket leaks at the average rate, and a request may start while the bucket is not over
//! its size. The size allows a burst: with `max` set, `max * max_length` units (a higher
//! rate for a bounded time), and a second bucket, leaking at `max`, keeps that burst
//! itself from going faster than `max` (it may hold a tenth of a second of it); without
//! `max`, a tenth of a second at the average rate. So over any long stretch the average
//! holds, a quiet device earns a burst, and no burst exceeds `max`.
//!
//! Each bucket is kept as the time it will be empty (the generic cell rate algorithm's
//! theoretical arrival time, in 1/1024 ns): a request of `c` units may start once that
//! time is at most the bucket's size (in time) away, and pushes it `c` units' time later.
//! A request that may not start yet **reserves** its start: one compare-and-swap per
//! bucket, no lock, from any reactor; the requests of every queue sharing a throttle (a
//! group) then start in the order they arrived, each at its time, which gives busy
//! members equal shares, and the queue waits on its reactor's timer. Over any stretch
//! `d`, a limit admits at most `(d + size) * avg` units.
//!
//! A live change of the limits applies to the requests already waiting too: the throttle
//! counts what waits (requests and bytes, each way), and [`Throttle::set`] turns what each
//! bucket holds into units at the old rate, keeps only what requests already started
//! poured in (at the new rate), bumps the throttle's epoch and wakes every queue that
//! holds requests, which reserves each of them again, in the order they were to start.
//! So raising a limit releases the backlog at the new rate, and lowering it slows the
//! backlog down, instead of either waiting out the times reserved at the old rate.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};

use cairn_core::{Io, Offer, Op, Want};
use cairn_stacks::wrap::{Decision, Policy};

/// Why a set of limits is refused (a stack file's `throttle` table, an export's limits,
/// a live change): the key named is the one to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ThrottleError {
    /// A rate above [`LIMIT_MAX`].
    #[error("{key}: at most {LIMIT_MAX} a second")]
    TooHigh {
        /// The limit's key (`iops`, `bps_read`...).
        key: String,
    },
    /// A byte rate below [`BPS_MIN`]: the largest request a client may send would wait
    /// for minutes.
    #[error("{key}: at least 1M a second (1048576 bytes; 0 for none): a 32 MiB request, the largest an NBD client may send, then waits 32 s at most; below it one could hold its client for minutes")]
    TooLow {
        /// The limit's key (`bps`, `bps_read`, `bps_write`).
        key: String,
    },
    /// A burst longer than [`LENGTH_MAX`] seconds.
    #[error("{key}_max_length: at most {LENGTH_MAX} seconds")]
    BurstTooLong {
        /// The limit's key.
        key: String,
    },
    /// `KEY_max` or `KEY_max_length` without the average `KEY`.
    #[error("{key}_max and {key}_max_length need {key}")]
    BurstWithoutAverage {
        /// The limit's key.
        key: String,
    },
    /// A burst rate below the average.
    #[error("{key}_max ({max}) is below {key} ({avg})")]
    BurstBelowAverage {
        /// The limit's key.
        key: String,
        /// The burst rate.
        max: u64,
        /// The average rate.
        avg: u64,
    },
    /// `KEY_max_length` without `KEY_max`.
    #[error("{key}_max_length needs {key}_max")]
    LengthWithoutBurst {
        /// The limit's key.
        key: String,
    },
    /// A total limit together with a read or write limit of the same kind.
    #[error("a total limit (iops, bps) goes with no read or write limit of the same kind")]
    TotalWithPart,
}

/// Time is kept in 1/1024 ns.
const SCALE: u128 = 1024;
/// Nanoseconds in a second.
const SECOND: u128 = 1_000_000_000;

/// Largest limit a key may have (per second): IOPS or bytes.
pub const LIMIT_MAX: u64 = 1 << 50;
/// Lowest byte rate a limit may set (bytes a second, 1 MiB): a request of the largest
/// size an NBD client may send (32 MiB) waits half a minute at most.
pub const BPS_MIN: u64 = 1 << 20;

/// Longest burst, in seconds.
pub const LENGTH_MAX: u64 = 86_400;

/// One limit: an average rate, and optionally a burst rate held for up to `max_length`
/// seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rate {
    /// Units a second on average (0: no limit).
    pub avg: u64,
    /// Units a second during a burst (0: no burst beyond a tenth of a second of `avg`).
    pub max: u64,
    /// Seconds a burst at `max` may last (1 unless set).
    pub max_length: u64,
}

impl Rate {
    /// Checks the limit named `key` (for messages): `avg` set whenever `max` is, `max`
    /// at least `avg`, every value in range.
    pub fn check(&self, key: &str) -> Result<(), ThrottleError> {
        let key = key.to_string();
        if self.avg > LIMIT_MAX || self.max > LIMIT_MAX {
            return Err(ThrottleError::TooHigh { key });
        }
        if self.max_length > LENGTH_MAX {
            return Err(ThrottleError::BurstTooLong { key });
        }
        if self.avg == 0 && (self.max != 0 || self.max_length != 0) {
            return Err(ThrottleError::BurstWithoutAverage { key });
        }
        if self.max != 0 && self.max < self.avg {
            return Err(ThrottleError::BurstBelowAverage {
                key,
                max: self.max,
                avg: self.avg,
            });
        }
        if self.max_length != 0 && self.max == 0 {
            return Err(ThrottleError::LengthWithoutBurst { key });
        }
        if key.starts_with("bps") && self.avg != 0 && self.avg < BPS_MIN {
            return Err(ThrottleError::TooLow { key });
        }
        Ok(())
    }

    /// The two buckets' (time per unit, size in time), scaled; (0, 0) for none.
    fn buckets(&self) -> [(u64, u64); 2] {
        if self.avg == 0 {
            return [(0, 0); 2];
        }
        let per = |rate: u64| (SECOND * SCALE).div_ceil(u128::from(rate)) as u64;
        let avg = if self.max == 0 {
            (per(self.avg), (SECOND * SCALE / 10) as u64)
        } else {
            // max * max_length units, in time at the average rate.
            let units = u128::from(self.max) * u128::from(self.max_length.max(1));
            (
                per(self.avg),
                (units * SECOND * SCALE / u128::from(self.avg)).min(u128::from(u64::MAX / 4))
                    as u64,
            )
        };
        let burst = if self.max == 0 {
            (0, 0)
        } else {
            (per(self.max), (SECOND * SCALE / 10) as u64)
        };
        [avg, burst]
    }
}

/// One bucket: its time per unit and size (both scaled; 0: no limit), and the time it
/// will be empty.
#[derive(Debug, Default)]
struct Bucket {
    per_unit: AtomicU64,
    size: AtomicU64,
    empty_at: AtomicU64,
}

impl Bucket {
    /// Reserves a start at or after `at` (scaled) for `units`; returns the start.
    fn reserve(&self, at: u64, units: u64) -> u64 {
        let per = self.per_unit.load(Relaxed);
        if per == 0 {
            return at;
        }
        let cost = (u128::from(units) * u128::from(per)).min(u128::from(u64::MAX / 4)) as u64;
        let size = self.size.load(Relaxed);
        let mut tat = self.empty_at.load(Relaxed);
        loop {
            let start = at.max(tat.saturating_sub(size));
            let next = tat.max(start).saturating_add(cost);
            match self
                .empty_at
                .compare_exchange_weak(tat, next, Relaxed, Relaxed)
            {
                Ok(_) => return start,
                Err(now) => tat = now,
            }
        }
    }

    /// Takes new parameters (`per`, `size`, scaled) at `now` (scaled). Of what the bucket
    /// holds, `held` units belong to requests that have not started and will be reserved
    /// again; the rest, poured in by requests that started, stays, counted at the new
    /// rate.
    fn rebase(&self, now: u64, held: u64, per: u64, size: u64) {
        let old = self.per_unit.swap(per, Relaxed);
        self.size.store(size, Relaxed);
        let _ = self.empty_at.fetch_update(Relaxed, Relaxed, |tat| {
            if old == 0 || per == 0 {
                return Some(now);
            }
            let started = (tat.saturating_sub(now) / old).saturating_sub(held);
            let debt = (u128::from(started) * u128::from(per)).min(u128::from(u64::MAX / 4));
            Some(now.saturating_add(debt as u64))
        });
    }
}

/// What a request is, to a throttle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// A read.
    Read,
    /// A write, write-zeroes or discard (they change data).
    Write,
}

/// The six limits of a throttle (per second): requests and bytes, in all, of reads and
/// of writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Limits {
    /// `iops`.
    pub iops: Rate,
    /// `iops_read`.
    pub iops_read: Rate,
    /// `iops_write`.
    pub iops_write: Rate,
    /// `bps`.
    pub bps: Rate,
    /// `bps_read`.
    pub bps_read: Rate,
    /// `bps_write`.
    pub bps_write: Rate,
}

impl Limits {
    fn rates(&self) -> [(&'static str, Rate); 6] {
        [
            ("iops", self.iops),
            ("iops_read", self.iops_read),
            ("iops_write", self.iops_write),
            ("bps", self.bps),
            ("bps_read", self.bps_read),
            ("bps_write", self.bps_write),
        ]
    }

    /// Whether no limit is set (a throttle without limits passes everything at once).
    pub fn is_none(&self) -> bool {
        self.rates().iter().all(|(_, r)| r.avg == 0)
    }

    /// Checks every limit, and refuses a total together with its read or write part (as
    /// qemu does: say one or the other). No limit at all is valid here: a live change
    /// may take the last one away; a stack file's throttle needs one (its parser says).
    pub fn check(&self) -> Result<(), ThrottleError> {
        for (key, r) in self.rates() {
            r.check(key)?;
        }
        for (total, read, write) in [
            (self.iops, self.iops_read, self.iops_write),
            (self.bps, self.bps_read, self.bps_write),
        ] {
            if total.avg != 0 && (read.avg != 0 || write.avg != 0) {
                return Err(ThrottleError::TotalWithPart);
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for Limits {
    /// `iops 10000, bps_write 50MiB (max 100MiB for 5 s)`: the limits set.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_none() {
            return write!(f, "no limits");
        }
        let mut first = true;
        for (key, r) in self.rates() {
            if r.avg == 0 {
                continue;
            }
            let show = |v: u64| {
                if key.starts_with("bps") {
                    format!("{}/s", cairn_core::size::format_bytes(v))
                } else {
                    format!("{v}/s")
                }
            };
            write!(f, "{}{key} {}", if first { "" } else { ", " }, show(r.avg))?;
            if r.max != 0 {
                write!(f, " (max {} for {} s)", show(r.max), r.max_length.max(1))?;
            }
            first = false;
        }
        Ok(())
    }
}

/// A throttle: its limits' buckets, shared by every queue that passes it, and what waits
/// for them.
#[derive(Debug, Default)]
pub struct Throttle {
    /// Per limit (iops, iops_read, iops_write, bps, bps_read, bps_write): the average's
    /// bucket and the burst's.
    buckets: [[Bucket; 2]; 6],
    limits: Mutex<Limits>,
    /// Requests reserved but not started: reads and writes, then their bytes.
    held: [AtomicU64; 4],
    /// Bumped by every change of the limits: a request reserved under an older epoch is
    /// reserved again.
    epoch: AtomicU64,
    /// The eventfds of the queues that hold requests of this throttle, made readable
    /// when the limits change.
    watchers: Mutex<Vec<Weak<OwnedFd>>>,
}

impl Throttle {
    /// A throttle with `limits` (checked by the caller), its buckets empty.
    pub fn new(limits: Limits) -> Throttle {
        let t = Throttle::default();
        t.set_at(0, limits);
        t
    }

    /// Its limits.
    pub fn limits(&self) -> Limits {
        *self.limits.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The count of changes to its limits so far.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Relaxed)
    }

    /// New limits, live, now (the monotonic clock the reactors read).
    pub fn set(&self, limits: Limits) {
        self.set_at(cairn_core::clock::monotonic_ns(), limits);
    }

    /// New limits, live, at `now_ns`: each bucket keeps what requests already started
    /// poured in (converted to the new rate); what waits is to be reserved again, and
    /// every queue watching is woken to do it.
    pub fn set_at(&self, now_ns: u64, limits: Limits) {
        let mut current = self.limits.lock().unwrap_or_else(|p| p.into_inner());
        let [reads, writes, read_bytes, write_bytes] =
            self.held.each_ref().map(|h| h.load(Relaxed));
        // What waits, in each limit's units.
        let held = [
            reads + writes,
            reads,
            writes,
            read_bytes + write_bytes,
            read_bytes,
            write_bytes,
        ];
        let now = now_ns.saturating_mul(SCALE as u64);
        for ((pair, (_, r)), held) in self.buckets.iter().zip(limits.rates()).zip(held) {
            for (b, (per, size)) in pair.iter().zip(r.buckets()) {
                b.rebase(now, held, per, size);
            }
        }
        *current = limits;
        drop(current);
        self.epoch.fetch_add(1, Relaxed);
        let mut watchers = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
        watchers.retain(|w| w.strong_count() > 0);
        for fd in watchers.iter().filter_map(Weak::upgrade) {
            cairn_core::event::wake(&*fd);
        }
    }

    /// Makes `fd` readable whenever the limits change (for as long as it lives).
    pub fn watch(&self, fd: &Arc<OwnedFd>) {
        let mut watchers = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
        watchers.retain(|w| w.strong_count() > 0);
        watchers.push(Arc::downgrade(fd));
    }

    /// Reserves the start of a request of `bytes` going `dir` that arrives at `now_ns`:
    /// returns when it may start (`now_ns` when it may at once).
    pub fn reserve(&self, now_ns: u64, dir: Dir, bytes: u64) -> u64 {
        let [iops, iops_dir, bps, bps_dir] = match dir {
            Dir::Read => [0, 1, 3, 4],
            Dir::Write => [0, 2, 3, 5],
        };
        let mut at = now_ns.saturating_mul(SCALE as u64);
        for (i, units) in [(iops, 1), (iops_dir, 1), (bps, bytes), (bps_dir, bytes)] {
            for b in &self.buckets[i] {
                at = b.reserve(at, units);
            }
        }
        at.div_ceil(SCALE as u64)
    }

    /// A request of `bytes` going `dir` waits for the start it reserved.
    pub fn hold(&self, dir: Dir, bytes: u64) {
        let (n, b) = Self::held_of(dir);
        self.held[n].fetch_add(1, Relaxed);
        self.held[b].fetch_add(bytes, Relaxed);
    }

    /// A request [`Throttle::hold`] counted has started.
    pub fn release(&self, dir: Dir, bytes: u64) {
        let (n, b) = Self::held_of(dir);
        let sub = |a: &AtomicU64, v: u64| {
            let _ = a.fetch_update(Relaxed, Relaxed, |x| Some(x.saturating_sub(v)));
        };
        sub(&self.held[n], 1);
        sub(&self.held[b], bytes);
    }

    fn held_of(dir: Dir) -> (usize, usize) {
        match dir {
            Dir::Read => (0, 2),
            Dir::Write => (1, 3),
        }
    }
}

/// The `throttle` device's policy: a request starts when its throttle (its own, or its
/// group's) reserves it a start; until then it waits on its reactor's timer. Flushes are
/// not limited.
pub struct ThrottlePolicy {
    throttle: Arc<Throttle>,
    group: Option<String>,
    /// Requests and bytes let through, requests delayed, requests waiting now.
    counts: [AtomicU64; 4],
}

/// What a throttle device let through (see [`ThrottleAdmin::counts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ThrottleCounts {
    /// Requests let through (flushes not counted).
    pub requests: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Of the requests, those that waited.
    pub delayed: u64,
    /// Requests waiting now.
    pub waiting: u64,
}

impl ThrottlePolicy {
    /// Requests pass `throttle`, shared with the group `group` names.
    pub fn new(throttle: Arc<Throttle>, group: Option<String>) -> ThrottlePolicy {
        ThrottlePolicy {
            throttle,
            group,
            counts: Default::default(),
        }
    }

    /// Its throttle.
    pub fn throttle(&self) -> &Arc<Throttle> {
        &self.throttle
    }
}

/// A throttle device, as the admin sees it (`cairn admin throttle`, the metrics): the
/// capability a throttle device offers (through its policy).
pub trait ThrottleAdmin: Send + Sync {
    /// Its limits now (its group's, for a device in a group).
    fn limits(&self) -> Limits;

    /// A live change of its limits (its group's: every device of the group); the
    /// requests waiting now follow them too.
    fn set_limits(&self, limits: Limits);

    /// Its group, if it is in one.
    fn group(&self) -> Option<&str>;

    /// What it let through so far.
    fn counts(&self) -> ThrottleCounts;
}

impl ThrottleAdmin for ThrottlePolicy {
    fn limits(&self) -> Limits {
        self.throttle.limits()
    }

    fn set_limits(&self, limits: Limits) {
        self.throttle.set(limits);
    }

    fn group(&self) -> Option<&str> {
        self.group.as_deref()
    }

    fn counts(&self) -> ThrottleCounts {
        let [requests, bytes, delayed, waiting] = &self.counts;
        ThrottleCounts {
            requests: requests.load(Relaxed),
            bytes: bytes.load(Relaxed),
            delayed: delayed.load(Relaxed),
            waiting: waiting.load(Relaxed),
        }
    }
}

impl Policy for ThrottlePolicy {
    fn kind(&self) -> &'static str {
        "throttle"
    }
    fn describe(&self) -> String {
        let mut out = self.throttle.limits().to_string();
        if let Some(g) = &self.group {
            out += &format!(", group {g}");
        }
        out
    }
    #[inline]
    fn decide(&self, io: &Io, now_ns: u64, _random: u64) -> Decision {
        let Some(dir) = direction(io.op) else {
            return Decision::Forward;
        };
        let start = self.throttle.reserve(now_ns, dir, io.len);
        // The throttle's buckets are shared by every reactor anyway: counting here too
        // costs a shared line's update per request, the price of a shared limit.
        self.counts[0].fetch_add(1, Relaxed);
        self.counts[1].fetch_add(io.len, Relaxed);
        if start <= now_ns {
            Decision::Forward
        } else {
            self.counts[2].fetch_add(1, Relaxed);
            self.counts[3].fetch_add(1, Relaxed);
            self.throttle.hold(dir, io.len);
            Decision::Delay(start - now_ns)
        }
    }

    fn released(&self, io: &Io) {
        self.counts[3].fetch_sub(1, Relaxed);
        if let Some(dir) = direction(io.op) {
            self.throttle.release(dir, io.len);
        }
    }

    fn epoch(&self) -> u64 {
        self.throttle.epoch()
    }

    fn changes_live(&self) -> bool {
        true
    }

    fn watch(&self, wake: &Arc<OwnedFd>) {
        self.throttle.watch(wake);
    }

    fn redecide(&self, io: &Io, now_ns: u64) -> Decision {
        let Some(dir) = direction(io.op) else {
            return Decision::Forward;
        };
        let start = self.throttle.reserve(now_ns, dir, io.len);
        if start <= now_ns {
            Decision::Forward
        } else {
            Decision::Delay(start - now_ns)
        }
    }

    fn offer(self: Arc<Self>, want: Want) -> Option<Offer> {
        want.offer::<dyn ThrottleAdmin>(|| self)
    }
}

/// How a throttle counts `op`: flushes are not limited.
fn direction(op: Op) -> Option<Dir> {
    match op {
        Op::Flush => None,
        Op::Read => Some(Dir::Read),
        _ => Some(Dir::Write),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A changed limit reaches the requests a throttle device already holds: 32 reads
    /// held by a throttle of 1 byte a second (each 4 KiB read waits over an hour for the
    /// one before it) all complete once the limit is raised, or once the last limit is
    /// taken away (a throttle without limits passes everything). No time is measured:
    /// the old limit would hold them for a day and a half.
    #[test]
    fn a_changed_limit_reaches_the_requests_already_held() {
        use cairn_core::blocking::{BlockingQueue, Request};
        use cairn_core::Device;
        use cairn_stacks::wrap::WrapDevice;
        use std::time::Duration;
        let slow = Limits {
            bps: Rate {
                avg: 1,
                ..Rate::default()
            },
            ..Limits::default()
        };
        let fast = Limits {
            bps: Rate {
                avg: 1 << 40,
                ..Rate::default()
            },
            ..Limits::default()
        };
        for after in [fast, Limits::default()] {
            let spec = cairn_leaves::LeafSpec::parse("mem:1M").expect("a spec");
            let base = cairn_leaves::open(&spec, "m").expect("a mem device");
            let throttle = Arc::new(Throttle::new(slow));
            let policy = Arc::new(ThrottlePolicy::new(throttle.clone(), None));
            let device: Arc<dyn Device> = Arc::new(WrapDevice::new("t", base, policy.clone()));
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let q =
                    BlockingQueue::open(&device, cairn_core::Switches::default()).expect("a queue");
                let mut bufs = vec![vec![0u8; 4096]; 32];
                let mut requests: Vec<Request<'_>> = bufs
                    .iter_mut()
                    .enumerate()
                    .map(|(i, b)| Request {
                        op: Op::Read,
                        flags: cairn_core::IoFlags::NONE,
                        offset: i as u64 * 4096,
                        len: 0,
                        buf: Some(b),
                    })
                    .collect();
                let done = q.run(&mut requests).iter().all(|r| r.is_ok());
                let _ = tx.send(done);
            });
            // The first read goes at once (the bucket is empty); the rest wait.
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while policy.counts().waiting < 31 {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{:?}",
                    policy.counts()
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            throttle.set(after);
            let done = rx.recv_timeout(Duration::from_secs(60));
            assert_eq!(done, Ok(true), "{after}: {:?}", policy.counts());
            assert_eq!(policy.counts().waiting, 0);
        }
    }

    const S: u64 = 1_000_000_000;

    fn rate(avg: u64, max: u64, max_length: u64) -> Rate {
        Rate {
            avg,
            max,
            max_length,
        }
    }

    fn limits(f: impl FnOnce(&mut Limits)) -> Limits {
        let mut l = Limits::default();
        f(&mut l);
        l
    }

    /// One request after another (the next arrives when the last starts), for `secs`
    /// seconds of a virtual clock; returns the start times.
    fn saturate(t: &Throttle, dir: Dir, bytes: u64, secs: u64) -> Vec<u64> {
        let (mut now, mut starts) = (0, Vec::new());
        loop {
            now = t.reserve(now, dir, bytes);
            if now >= secs * S {
                return starts;
            }
            starts.push(now);
        }
    }

    fn within(got: f64, want: f64, share: f64) -> bool {
        (got - want).abs() <= want * share
    }

    #[test]
    fn an_average_holds_over_a_long_run() {
        let t = Throttle::new(limits(|l| l.iops = rate(10_000, 0, 0)));
        let n = saturate(&t, Dir::Write, 4096, 10).len() as f64;
        // 10 s at 10k/s, plus the bucket's tenth of a second at the start.
        assert!(within(n, 101_000.0, 0.001), "{n}");
        let t = Throttle::new(limits(|l| l.bps_write = rate(50_000_000, 0, 0)));
        let bytes = saturate(&t, Dir::Write, 65536, 10).len() as f64 * 65536.0;
        assert!(within(bytes, 505_000_000.0, 0.001), "{bytes}");
        // A write limit leaves reads alone.
        assert_eq!(t.reserve(5, Dir::Read, 1 << 30), 5);
    }

    #[test]
    fn a_burst_lasts_max_length_at_max_then_the_average() {
        let t = Throttle::new(limits(|l| l.iops = rate(100, 1000, 2)));
        let starts = saturate(&t, Dir::Read, 512, 12);
        let per_second = |k: u64| starts.iter().filter(|&&s| s / S == k).count();
        let seconds: Vec<usize> = (0..12).map(per_second).collect();
        // Never above the burst rate (and its tenth of a second).
        assert!(seconds.iter().all(|&n| n <= 1100), "{seconds:?}");
        // The bucket (1000 * 2) fills at 1000 - 100 a second: about 2.2 s of burst.
        assert!(seconds[0] >= 1000 && seconds[1] >= 1000, "{seconds:?}");
        assert!(seconds[3] <= 300, "{seconds:?}");
        for &n in &seconds[5..] {
            assert!(within(n as f64, 100.0, 0.02), "{seconds:?}");
        }
        // A quiet spell earns the burst again.
        let mut now = 60 * S;
        let mut n = 0;
        while t.reserve(now, Dir::Read, 512) == now {
            n += 1;
            now += S / 1000;
        }
        assert!(n > 1500, "{n}");
    }

    #[test]
    fn a_live_change_applies_at_once() {
        let t = Throttle::new(limits(|l| l.iops = rate(1000, 0, 0)));
        let mut now = 0;
        let mut count = [0u64; 2];
        while now < 4 * S {
            if now >= 2 * S && t.limits().iops.avg == 1000 {
                t.set_at(now, limits(|l| l.iops = rate(5000, 0, 0)));
            }
            now = t.reserve(now, Dir::Write, 4096);
            if now < 4 * S {
                count[(now / (2 * S)) as usize] += 1;
            }
        }
        assert!(within(count[0] as f64, 2100.0, 0.01), "{count:?}");
        // The bucket keeps what it holds in requests (a full tenth of a second at 1000/s:
        // 100), so at 5000/s (a tenth of a second is 500) 400 more go at once.
        assert!(within(count[1] as f64, 10_400.0, 0.01), "{count:?}");
    }

    #[test]
    fn members_of_a_group_share_it_evenly_and_start_in_order() {
        // Two members, each keeping 8 requests reserved (a new one as soon as one of
        // its own starts); member 0 sends 4 KiB, member 1 1 MiB (an IOPS limit counts
        // requests, not bytes).
        let t = Throttle::new(limits(|l| l.iops = rate(2000, 0, 0)));
        let mut pending: Vec<(u64, usize)> = Vec::new();
        let mut served = [Vec::new(), Vec::new()];
        for m in 0..2 {
            for _ in 0..8 {
                pending.push((
                    t.reserve(0, Dir::Write, if m == 0 { 4096 } else { 1 << 20 }),
                    m,
                ));
            }
        }
        loop {
            pending.sort();
            let (start, m) = pending.remove(0);
            if start >= 10 * S {
                break;
            }
            served[m].push(start);
            let bytes = if m == 0 { 4096 } else { 1 << 20 };
            pending.push((t.reserve(start, Dir::Write, bytes), m));
        }
        let (a, b) = (served[0].len() as f64, served[1].len() as f64);
        assert!(within(a + b, 20_200.0, 0.01), "{a} {b}");
        // Equal shares, but for the first tenth of a second's burst, which goes to whoever
        // asks first.
        assert!((a - b).abs() <= 210.0, "{a} {b}");
        for v in &served {
            assert!(v.windows(2).all(|w| w[0] <= w[1]), "out of order");
        }
    }

    #[test]
    fn bad_limits_are_refused() {
        let bad = [
            (limits(|l| l.iops = rate(100, 50, 0)), "below"),
            (limits(|l| l.iops = rate(0, 50, 0)), "need iops"),
            (limits(|l| l.bps = rate(100, 0, 3)), "needs bps_max"),
            (limits(|l| l.bps = rate(LIMIT_MAX + 1, 0, 0)), "at most"),
            (
                limits(|l| {
                    l.iops = rate(100, 0, 0);
                    l.iops_read = rate(50, 0, 0);
                }),
                "total",
            ),
        ];
        for (l, why) in bad {
            let e = l.check().unwrap_err().to_string();
            assert!(e.contains(why), "{l:?}: {e}");
        }
        let e = limits(|l| l.bps = rate(100, 50, 0)).check().unwrap_err();
        assert_eq!(
            e,
            ThrottleError::BurstBelowAverage {
                key: "bps".into(),
                max: 50,
                avg: 100
            }
        );
        assert_eq!(e.to_string(), "bps_max (50) is below bps (100)");
        // A byte rate that would hold a large request for minutes.
        for key in ["bps", "bps_read", "bps_write"] {
            let e = limits(|l| match key {
                "bps" => l.bps = rate(BPS_MIN - 1, 0, 0),
                "bps_read" => l.bps_read = rate(1, 0, 0),
                _ => l.bps_write = rate(4096, 0, 0),
            })
            .check()
            .unwrap_err();
            assert_eq!(e, ThrottleError::TooLow { key: key.into() });
        }
        limits(|l| l.bps = rate(BPS_MIN, 0, 0)).check().unwrap();
        limits(|l| l.iops = rate(1, 0, 0)).check().unwrap();
        let fine = limits(|l| {
            l.iops_read = rate(100, 200, 5);
            l.bps_write = rate(1 << 20, 0, 0);
        });
        assert!(fine.check().is_ok());
        // No limit at all (the last one taken away live): valid, and it passes all.
        assert!(Limits::default().check().is_ok());
        let t = Throttle::new(Limits::default());
        assert_eq!(t.reserve(7, Dir::Write, 1 << 30), 7);
        assert_eq!(t.limits().to_string(), "no limits");
    }

    /// A queue's view of a throttle on a virtual clock: requests held with the start
    /// each reserved, released when the clock reaches it, and reserved again (in the
    /// order they were to start) when the limits change, as the wrap queue does.
    struct Held {
        t: Throttle,
        starts: Vec<u64>,
        waiting: Vec<u64>,
    }

    impl Held {
        /// `n` reads of `bytes` arriving at 0 on a throttle of `l`.
        fn new(l: Limits, n: usize, bytes: u64) -> Held {
            let t = Throttle::new(l);
            let mut waiting = Vec::new();
            let mut starts = Vec::new();
            for _ in 0..n {
                match t.reserve(0, Dir::Read, bytes) {
                    0 => starts.push(0),
                    at => {
                        t.hold(Dir::Read, bytes);
                        waiting.push(at);
                    }
                }
            }
            Held { t, starts, waiting }
        }

        /// Releases what is due by `now`.
        fn run_to(&mut self, now: u64, bytes: u64) {
            let (due, later): (Vec<u64>, Vec<u64>) =
                self.waiting.iter().partition(|&&at| at <= now);
            for at in due {
                self.t.release(Dir::Read, bytes);
                self.starts.push(at);
            }
            self.waiting = later;
        }

        /// New limits at `now`, and every waiting request reserved again.
        fn set(&mut self, now: u64, l: Limits, bytes: u64) {
            self.t.set_at(now, l);
            self.waiting.sort_unstable();
            self.waiting = self
                .waiting
                .iter()
                .map(|_| self.t.reserve(now, Dir::Read, bytes))
                .collect();
        }

        fn started_by(&self, at: u64) -> usize {
            self.starts.iter().filter(|&&s| s <= at).count()
        }
    }

    #[test]
    fn a_raised_limit_releases_what_waits_at_the_new_rate() {
        // 256 reads at 10 IOPS: the last would start at 25.5 s.
        let mut h = Held::new(limits(|l| l.iops = rate(10, 0, 0)), 256, 4096);
        h.run_to(S, 4096);
        // Two at once (the tenth of a second's burst and the first), then one every 100 ms.
        assert_eq!(h.started_by(S), 12, "{:?}", h.starts);
        h.set(S, limits(|l| l.iops = rate(100_000, 0, 0)), 4096);
        h.run_to(S + S / 100, 4096);
        // All of them by 10 ms later: a tenth of a second at 100,000/s is 10,000.
        assert_eq!(h.started_by(S + S / 100), 256);
        assert!(h.waiting.is_empty());
        // The same with bytes: 32 writes of 1 MiB at 1 MB/s, then 100 GB/s.
        let mut h = Held::new(limits(|l| l.bps = rate(1_000_000, 0, 0)), 32, 1 << 20);
        h.run_to(S, 1 << 20);
        assert!(h.started_by(S) <= 2, "{:?}", h.starts);
        h.set(S, limits(|l| l.bps = rate(100_000_000_000, 0, 0)), 1 << 20);
        h.run_to(S + S / 100, 1 << 20);
        assert_eq!(h.started_by(S + S / 100), 32);
    }

    #[test]
    fn the_last_limit_taken_away_releases_everything_at_once() {
        let mut h = Held::new(limits(|l| l.iops = rate(10, 0, 0)), 256, 4096);
        h.set(S / 2, Limits::default(), 4096);
        h.run_to(S / 2, 4096);
        assert_eq!(h.started_by(S / 2), 256);
    }

    #[test]
    fn a_lowered_limit_slows_what_waits_and_counts_what_started() {
        // 256 reads at 1000 IOPS: 100 at once (the tenth of a second), then one a ms.
        let mut h = Held::new(limits(|l| l.iops = rate(1000, 0, 0)), 256, 4096);
        h.run_to(S / 100, 4096);
        let before = h.started_by(S / 100);
        assert!((100..=112).contains(&before), "{before}");
        h.set(S / 100, limits(|l| l.iops = rate(10, 0, 0)), 4096);
        // What started poured about 100 requests into the bucket: 10 s of debt at 10/s,
        // less the bucket's tenth of a second; nothing more starts for a while.
        h.run_to(9 * S, 4096);
        assert_eq!(h.started_by(9 * S), before);
        // Then the rest, one every 100 ms.
        h.run_to(1000 * S, 4096);
        assert_eq!(h.starts.len(), 256);
        let rest: Vec<u64> = h.starts[before..].to_vec();
        assert!(rest[0] >= 9 * S, "{}", rest[0]);
        for w in rest.windows(2) {
            assert!(w[1] - w[0] >= S / 10 - 1, "{w:?}");
        }
    }
}
