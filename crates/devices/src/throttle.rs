//! Rate limits (issue 39, in progress): the arithmetic of a throttle, apart from any
//! device, so that it is exact on a virtual clock. The `throttle` device and export limits
//! build on it.
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
//! Units are kept in nano-units (units times 10^9), so that a leak over `ns` nanoseconds
//! at `rate` units a second is exactly `rate * ns`: no rounding drifts a long run.
//!
//! A [`Scheduler`] holds the requests that must wait, in order per member, and serves
//! the members of a group in turn (round robin), as qemu's throttle groups do: each
//! member of a busy group gets an equal share of the group's limits.

use std::collections::VecDeque;

/// Nano-units in a unit.
const NANO: u128 = 1_000_000_000;

/// Largest limit a key may have (per second): IOPS or bytes.
pub const LIMIT_MAX: u64 = 1 << 50;
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
    pub fn check(&self, key: &str) -> Result<(), String> {
        if self.avg > LIMIT_MAX || self.max > LIMIT_MAX {
            return Err(format!("{key}: at most {LIMIT_MAX} a second"));
        }
        if self.max_length > LENGTH_MAX {
            return Err(format!("{key}_max_length: at most {LENGTH_MAX} seconds"));
        }
        if self.avg == 0 && (self.max != 0 || self.max_length != 0) {
            return Err(format!("{key}_max and {key}_max_length need {key}"));
        }
        if self.max != 0 && self.max < self.avg {
            return Err(format!(
                "{key}_max ({}) is below {key} ({})",
                self.max, self.avg
            ));
        }
        if self.max_length != 0 && self.max == 0 {
            return Err(format!("{key}_max_length needs {key}_max"));
        }
        Ok(())
    }
}

/// A leaky bucket for one [`Rate`].
#[derive(Debug, Clone, Default)]
struct Bucket {
    rate: Rate,
    /// Nano-units poured and not leaked yet.
    level: u128,
    /// The same, leaking at `max` (for the burst's own rate).
    burst: u128,
}

impl Bucket {
    fn size(&self) -> u128 {
        let r = &self.rate;
        if r.max == 0 {
            u128::from(r.avg) * NANO / 10
        } else {
            u128::from(r.max) * u128::from(r.max_length.max(1)) * NANO
        }
    }

    fn leak(&mut self, ns: u64) {
        let r = &self.rate;
        self.level = self
            .level
            .saturating_sub(u128::from(r.avg) * u128::from(ns));
        self.burst = self
            .burst
            .saturating_sub(u128::from(r.max) * u128::from(ns));
    }

    /// Nanoseconds until a request may start (0: now).
    fn wait(&self) -> u64 {
        let r = &self.rate;
        if r.avg == 0 {
            return 0;
        }
        let mut wait = 0;
        let size = self.size();
        if self.level > size {
            wait = ((self.level - size).div_ceil(u128::from(r.avg))) as u64;
        }
        if r.max != 0 {
            let burst_size = u128::from(r.max) * NANO / 10;
            if self.burst > burst_size {
                wait = wait.max(((self.burst - burst_size).div_ceil(u128::from(r.max))) as u64);
            }
        }
        wait
    }

    fn pour(&mut self, units: u64) {
        if self.rate.avg == 0 {
            return;
        }
        self.level += u128::from(units) * NANO;
        if self.rate.max != 0 {
            self.burst += u128::from(units) * NANO;
        }
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

    /// Checks every limit; refuses a throttle with none, and a total together with
    /// its read or write part (as qemu does: say one or the other).
    pub fn check(&self) -> Result<(), String> {
        for (key, r) in self.rates() {
            r.check(key)?;
        }
        if self.rates().iter().all(|(_, r)| r.avg == 0) {
            return Err(
                "no limit is set (iops, iops_read, iops_write, bps, bps_read or bps_write)".into(),
            );
        }
        for (total, read, write) in [
            (self.iops, self.iops_read, self.iops_write),
            (self.bps, self.bps_read, self.bps_write),
        ] {
            if total.avg != 0 && (read.avg != 0 || write.avg != 0) {
                return Err(
                    "a total limit (iops, bps) goes with no read or write limit of the same kind"
                        .into(),
                );
            }
        }
        Ok(())
    }
}

/// A throttle's state: its buckets and the time they were last leaked.
#[derive(Debug, Clone, Default)]
pub struct Throttle {
    limits: Limits,
    /// iops, iops_read, iops_write, bps, bps_read, bps_write.
    buckets: [Bucket; 6],
    now_ns: u64,
}

impl Throttle {
    /// A throttle with `limits` (checked by the caller), its buckets empty at `now_ns`.
    pub fn new(limits: Limits, now_ns: u64) -> Throttle {
        let mut t = Throttle {
            now_ns,
            ..Throttle::default()
        };
        t.set(limits);
        t
    }

    /// Its limits.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// New limits, live: the buckets keep what they hold (a burst earned stays earned,
    /// up to the new sizes).
    pub fn set(&mut self, limits: Limits) {
        self.limits = limits;
        for (b, (_, r)) in self.buckets.iter_mut().zip(limits.rates()) {
            b.rate = r;
            if r.avg == 0 {
                b.level = 0;
                b.burst = 0;
            }
        }
    }

    fn advance(&mut self, now_ns: u64) {
        let ns = now_ns.saturating_sub(self.now_ns);
        if ns > 0 {
            for b in &mut self.buckets {
                b.leak(ns);
            }
            self.now_ns = now_ns;
        }
    }

    fn of(dir: Dir) -> [usize; 4] {
        match dir {
            Dir::Read => [0, 1, 3, 4],
            Dir::Write => [0, 2, 3, 5],
        }
    }

    /// Nanoseconds from `now_ns` until a request going `dir` may start (0: now).
    pub fn wait(&mut self, now_ns: u64, dir: Dir) -> u64 {
        self.advance(now_ns);
        Self::of(dir)
            .iter()
            .map(|&i| self.buckets[i].wait())
            .max()
            .unwrap_or(0)
    }

    /// Counts a request of `bytes` going `dir` that starts at `now_ns`.
    pub fn account(&mut self, now_ns: u64, dir: Dir, bytes: u64) {
        self.advance(now_ns);
        let [iops, iops_dir, bps, bps_dir] = Self::of(dir);
        self.buckets[iops].pour(1);
        self.buckets[iops_dir].pour(1);
        self.buckets[bps].pour(bytes);
        self.buckets[bps_dir].pour(bytes);
    }
}

/// Requests waiting for a group's throttle: a FIFO per member, served in turn.
#[derive(Debug, Default)]
pub struct Scheduler<T> {
    members: Vec<VecDeque<(Dir, u64, T)>>,
    /// The member served next when several wait.
    next: usize,
}

impl<T> Scheduler<T> {
    /// A scheduler for `members` members.
    pub fn new(members: usize) -> Scheduler<T> {
        Scheduler {
            members: (0..members).map(|_| VecDeque::new()).collect(),
            next: 0,
        }
    }

    /// Whether member `m` has requests waiting (a new one must then wait behind them).
    pub fn busy(&self, m: usize) -> bool {
        !self.members[m].is_empty()
    }

    /// Requests waiting.
    pub fn waiting(&self) -> usize {
        self.members.iter().map(VecDeque::len).sum()
    }

    /// Queues request `item` of member `m`: `bytes` going `dir`.
    pub fn push(&mut self, m: usize, dir: Dir, bytes: u64, item: T) {
        self.members[m].push_back((dir, bytes, item));
    }

    /// Starts what `t` allows at `now_ns`, member after member in turn, each member's
    /// requests in order; returns them with their member, and the nanoseconds until the
    /// next one may start (`None`: nothing waits).
    pub fn release(&mut self, t: &mut Throttle, now_ns: u64) -> (Vec<(usize, T)>, Option<u64>) {
        let mut out = Vec::new();
        let n = self.members.len();
        loop {
            let Some(m) = (0..n)
                .map(|k| (self.next + k) % n)
                .find(|&m| !self.members[m].is_empty())
            else {
                return (out, None);
            };
            let (dir, bytes, _) = self.members[m][0];
            let wait = t.wait(now_ns, dir);
            if wait > 0 {
                return (out, Some(wait));
            }
            let (_, _, item) = self.members[m].pop_front().expect("not empty");
            t.account(now_ns, dir, bytes);
            out.push((m, item));
            self.next = (m + 1) % n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn rate(avg: u64, max: u64, max_length: u64) -> Rate {
        Rate {
            avg,
            max,
            max_length,
        }
    }

    /// Starts requests of `bytes` going `dir` as soon as `t` allows, on a virtual clock,
    /// for `secs` seconds; returns the start times.
    fn saturate(t: &mut Throttle, dir: Dir, bytes: u64, secs: u64) -> Vec<u64> {
        let mut now = 0;
        let mut starts = Vec::new();
        while now < secs * S {
            let w = t.wait(now, dir);
            if w > 0 {
                now += w;
                continue;
            }
            t.account(now, dir, bytes);
            starts.push(now);
        }
        starts.retain(|&s| s < secs * S);
        starts
    }

    fn within(got: f64, want: f64, share: f64) -> bool {
        (got - want).abs() <= want * share
    }

    #[test]
    fn an_average_holds_over_a_long_run() {
        let limits = Limits {
            iops: rate(10_000, 0, 0),
            ..Limits::default()
        };
        let mut t = Throttle::new(limits, 0);
        let n = saturate(&mut t, Dir::Write, 4096, 10).len() as f64;
        // 10 s at 10k/s, plus the bucket's tenth of a second at the start.
        assert!(within(n, 101_000.0, 0.005), "{n}");
        let limits = Limits {
            bps_write: rate(50_000_000, 0, 0),
            ..Limits::default()
        };
        let mut t = Throttle::new(limits, 0);
        let bytes = saturate(&mut t, Dir::Write, 65536, 10).len() as f64 * 65536.0;
        assert!(within(bytes, 505_000_000.0, 0.005), "{bytes}");
        // Reads are not limited by a write limit.
        assert_eq!(t.wait(u64::MAX / 2, Dir::Read), 0);
    }

    #[test]
    fn a_burst_lasts_max_length_at_max_then_the_average() {
        let limits = Limits {
            iops: rate(100, 1000, 2),
            ..Limits::default()
        };
        let mut t = Throttle::new(limits, 0);
        let starts = saturate(&mut t, Dir::Read, 512, 12);
        let per_second = |k: u64| starts.iter().filter(|&&s| s / S == k).count();
        // Never above the burst rate (and its tenth of a second) in any second.
        assert!(
            (0..12).all(|k| per_second(k) <= 1100),
            "{:?}",
            (0..12).map(per_second).collect::<Vec<_>>()
        );
        // The bucket (1000 * 2) fills at 1000 - 100 a second: about 2.2 s of burst.
        assert!(
            per_second(0) >= 1000 && per_second(1) >= 1000,
            "{}",
            per_second(1)
        );
        assert!(per_second(3) <= 300, "{}", per_second(3));
        // Then the average.
        for k in 5..12 {
            assert!(
                within(per_second(k) as f64, 100.0, 0.02),
                "{k}: {}",
                per_second(k)
            );
        }
        // A quiet spell earns the burst again.
        let mut now = 30 * S;
        let mut n = 0;
        while t.wait(now, Dir::Read) == 0 {
            t.account(now, Dir::Read, 512);
            n += 1;
            now += S / 1000;
        }
        assert!(n > 1500, "{n}");
    }

    #[test]
    fn a_live_change_applies_at_once() {
        let mut t = Throttle::new(
            Limits {
                iops: rate(1000, 0, 0),
                ..Limits::default()
            },
            0,
        );
        let mut now = 0;
        let mut count = [0u64; 2];
        while now < 4 * S {
            if now >= 2 * S && t.limits().iops.avg == 1000 {
                t.set(Limits {
                    iops: rate(5000, 0, 0),
                    ..Limits::default()
                });
            }
            let w = t.wait(now, Dir::Write);
            if w > 0 {
                now += w;
                continue;
            }
            t.account(now, Dir::Write, 4096);
            count[(now / (2 * S)) as usize] += 1;
        }
        assert!(within(count[0] as f64, 2100.0, 0.01), "{count:?}");
        // 2 s at 5k/s, and the larger bucket's extra 400 at the change.
        assert!(within(count[1] as f64, 10_400.0, 0.01), "{count:?}");
    }

    #[test]
    fn a_group_shares_its_limit_evenly_and_keeps_each_members_order() {
        let mut t = Throttle::new(
            Limits {
                iops: rate(2000, 0, 0),
                ..Limits::default()
            },
            0,
        );
        let mut s: Scheduler<(usize, u64)> = Scheduler::new(2);
        let mut served = [Vec::new(), Vec::new()];
        let mut seq = [0u64; 2];
        let mut now = 0;
        while now < 10 * S {
            // Both members keep 8 requests waiting; member 0 sends 4 KiB, member 1 1 MiB
            // (an IOPS limit counts requests, not bytes).
            for (m, next) in seq.iter_mut().enumerate() {
                while s.members[m].len() < 8 {
                    s.push(
                        m,
                        Dir::Write,
                        if m == 0 { 4096 } else { 1 << 20 },
                        (m, *next),
                    );
                    *next += 1;
                }
            }
            let (out, wait) = s.release(&mut t, now);
            for (m, (who, k)) in out {
                assert_eq!(m, who);
                served[m].push(k);
            }
            now += wait.unwrap_or(S / 1000).max(1);
        }
        let (a, b) = (served[0].len() as f64, served[1].len() as f64);
        assert!(within(a + b, 20_200.0, 0.01), "{a} {b}");
        assert!(
            within(a, (a + b) / 2.0, 0.01) && within(b, (a + b) / 2.0, 0.01),
            "{a} {b}"
        );
        for v in &served {
            assert!(v.windows(2).all(|w| w[1] == w[0] + 1), "out of order");
        }
    }

    #[test]
    fn bad_limits_are_refused() {
        let bad = [
            (Limits::default(), "no limit"),
            (
                Limits {
                    iops: rate(100, 50, 0),
                    ..Limits::default()
                },
                "below",
            ),
            (
                Limits {
                    iops: rate(0, 50, 0),
                    ..Limits::default()
                },
                "need iops",
            ),
            (
                Limits {
                    bps: rate(100, 0, 3),
                    ..Limits::default()
                },
                "needs bps_max",
            ),
            (
                Limits {
                    bps: rate(LIMIT_MAX + 1, 0, 0),
                    ..Limits::default()
                },
                "at most",
            ),
            (
                Limits {
                    iops: rate(100, 0, 0),
                    iops_read: rate(50, 0, 0),
                    ..Limits::default()
                },
                "total",
            ),
        ];
        for (l, why) in bad {
            let e = l.check().unwrap_err();
            assert!(e.contains(why), "{l:?}: {e}");
        }
        assert!(Limits {
            iops_read: rate(100, 200, 5),
            bps_write: rate(1 << 20, 0, 0),
            ..Limits::default()
        }
        .check()
        .is_ok());
    }
}
