//! `fault` and `delay`: devices that wrap one `base` device and change what it does.
//!
//! One queue type serves both: for each request a [`Policy`] decides to forward it, to
//! forward it after a delay (a reactor timer, never a sleeping thread), or to fail it
//! without touching the base. They play the role of TigerBeetle's simulator faults: tests
//! put them under mirrors and raid10s to check that nothing acknowledged is lost.

use std::cell::{Cell, RefCell};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cairn_core::slab::Slab;
use cairn_core::{
    Core, Device, Error, Geometry, Io, IoStatus, Offer, Op, Poller, Queue, QueueStats, Sink,
    SinkId, Want,
};

/// What happens to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Pass it to the base now.
    Forward,
    /// Pass it to the base after this many nanoseconds.
    Delay(u64),
    /// Fail it with this errno; the base never sees it.
    Fail(i32),
    /// Cut the power of the base (it loses what was not flushed; with a seed, the cut
    /// tears: [`Device::power_cut_torn`]), then fail it.
    PowerCut(i32, Option<u64>),
}

/// Decides the fate of each request.
pub trait Policy: Send + Sync {
    /// `fault` or `delay`.
    fn kind(&self) -> &'static str;
    /// Parameters for reports.
    fn describe(&self) -> String;
    /// The decision for `io`, at `now_ns`, with a per-queue random number `random`.
    fn decide(&self, io: &Io, now_ns: u64, random: u64) -> Decision;

    /// A request it delayed goes to the base now.
    fn released(&self, _io: &Io) {}

    /// The count of changes that may alter its decisions (a throttle's limits set live):
    /// a request delayed under an older one is decided again ([`Policy::redecide`]).
    fn epoch(&self) -> u64 {
        0
    }

    /// Whether [`Policy::epoch`] ever changes: each queue then gives [`Policy::watch`] an
    /// eventfd, and watches it while it holds requests.
    fn changes_live(&self) -> bool {
        false
    }

    /// Makes `wake` readable whenever [`Policy::epoch`] changes.
    fn watch(&self, _wake: &Arc<OwnedFd>) {}

    /// A request [`Policy::decide`] delayed, decided again at `now_ns` because the epoch
    /// changed: [`Decision::Delay`] from now, or anything else to send it at once. It
    /// is still the same request (counted once).
    fn redecide(&self, _io: &Io, _now_ns: u64) -> Decision {
        Decision::Forward
    }

    /// The capabilities it offers (a throttle's view and live changes for the admin),
    /// which its device offers as its own: see [`Device::offer`].
    fn offer(self: Arc<Self>, want: Want) -> Option<Offer> {
        let _ = want;
        None
    }
}

/// Latency added per operation (discard and write-zeroes count as writes), and
/// optionally a model of one disk head.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Delays {
    /// Added to every read.
    pub read: Duration,
    /// Added to every write, discard and write-zeroes.
    pub write: Duration,
    /// Added to every flush.
    pub flush: Duration,
    /// Bytes per second the device transfers (reads and writes), if capped.
    pub bandwidth: Option<u64>,
    /// Added to a read or write that does not start where the previous one ended.
    pub seek: Duration,
}

impl Delays {
    /// Whether requests queue on one modelled disk (a bandwidth cap or a seek penalty).
    pub fn models_a_disk(&self) -> bool {
        self.bandwidth.is_some() || !self.seek.is_zero()
    }

    fn fixed(&self, op: Op) -> Duration {
        match op {
            Op::Read => self.read,
            Op::Flush => self.flush,
            _ => self.write,
        }
    }
}

/// The modelled disk: one request at a time, in arrival order.
#[derive(Debug, Default)]
struct Head {
    /// When the disk finishes what it has accepted so far.
    busy_until_ns: u64,
    /// Where the last read or write ended (the head's position).
    position: Option<u64>,
}

/// The `delay` device's policy: fixed latencies, or a disk model when a bandwidth cap or
/// a seek penalty is set. The model serves requests one after another on one timeline,
/// shared by every queue of the device (a mutex: this is a test device, and the model
/// must be exact rather than fast): a request starts when the disk is free, pays the
/// seek penalty unless it starts where the previous transfer ended, then transfers at
/// the capped bandwidth. Locality thus decides throughput, as on a rotational disk.
pub struct Delay {
    delays: Delays,
    head: std::sync::Mutex<Head>,
}

impl Delay {
    /// The policy for `delays`.
    pub fn new(delays: Delays) -> Delay {
        Delay {
            delays,
            head: std::sync::Mutex::new(Head::default()),
        }
    }
}

impl Policy for Delay {
    fn kind(&self) -> &'static str {
        "delay"
    }
    fn describe(&self) -> String {
        let d = &self.delays;
        let mut out = format!(
            "read +{:?}, write +{:?}, flush +{:?}",
            d.read, d.write, d.flush
        );
        if let Some(bw) = d.bandwidth {
            out += &format!(", {bw} bytes/s");
        }
        if !d.seek.is_zero() {
            out += &format!(", seek +{:?}", d.seek);
        }
        out
    }
    #[inline]
    fn decide(&self, io: &Io, now_ns: u64, _random: u64) -> Decision {
        let d = &self.delays;
        let fixed = d.fixed(io.op).as_nanos() as u64;
        if !d.models_a_disk() {
            return if fixed == 0 {
                Decision::Forward
            } else {
                Decision::Delay(fixed)
            };
        }
        let mut service = fixed;
        let mut head = self.head.lock().unwrap_or_else(|p| p.into_inner());
        if io.op.has_data() {
            if head.position != Some(io.offset) {
                service += d.seek.as_nanos() as u64;
            }
            if let Some(bw) = d.bandwidth {
                service += (u128::from(io.len) * 1_000_000_000 / u128::from(bw.max(1))) as u64;
            }
            head.position = Some(io.end());
        }
        let start = head.busy_until_ns.max(now_ns);
        head.busy_until_ns = start + service;
        let wait = head.busy_until_ns - now_ns;
        if wait == 0 {
            Decision::Forward
        } else {
            Decision::Delay(wait)
        }
    }
}

/// When a fault device fails requests. Conditions that are set must all hold; with none
/// set, every request of the chosen operations fails.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultRule {
    /// Operations that may fail (index by `Op::index`).
    pub ops: [bool; Op::COUNT],
    /// Fail only once this many requests have passed through (across all queues).
    pub after_ios: Option<u64>,
    /// Fail only once the device has been open this long.
    pub after: Option<Duration>,
    /// Fail each matching request with this probability.
    pub probability: Option<f64>,
    /// Fail only requests touching these 512-byte sectors `[start, end)`.
    pub sectors: Option<(u64, u64)>,
    /// Fail at most this many requests (across all queues): the first that meet every
    /// other condition; later ones pass. `times = 1` with `sectors` and `fail = ["read"]`
    /// is a bad block that a rewrite heals (what a mirror's read repair does).
    pub times: Option<u64>,
    /// The errno failed requests get.
    pub errno: i32,
    /// Instead of failing requests: cut the power of everything below, once, the first
    /// time the conditions hold (that request fails; later ones pass).
    pub power_cut: bool,
    /// With `power_cut`: the cut tears ([`Device::power_cut_torn`]): of the writes not
    /// yet flushed below, some pages land and some do not (tests; no stack-file key).
    pub torn: bool,
}

/// A [`FaultRule`] with the device-wide state it counts with.
pub struct Faults {
    rule: FaultRule,
    seen: AtomicU64,
    /// Requests failed so far (for `times`).
    failed: AtomicU64,
    opened_ns: OnceLock<u64>,
    cut: std::sync::atomic::AtomicBool,
}

impl Faults {
    /// Faults per `rule`.
    pub fn new(rule: FaultRule) -> Faults {
        Faults {
            rule,
            seen: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            opened_ns: OnceLock::new(),
            cut: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

impl Policy for Faults {
    fn kind(&self) -> &'static str {
        "fault"
    }
    fn describe(&self) -> String {
        let ops: Vec<&str> = Op::ALL
            .iter()
            .filter(|op| self.rule.ops[op.index()])
            .map(|op| op.name())
            .collect();
        let mut out = format!("fails {} with errno {}", ops.join("/"), self.rule.errno);
        if let Some(n) = self.rule.after_ios {
            out += &format!(", after {n} requests");
        }
        if let Some(d) = self.rule.after {
            out += &format!(", after {d:?}");
        }
        if let Some(p) = self.rule.probability {
            out += &format!(", with probability {p}");
        }
        if let Some((a, b)) = self.rule.sectors {
            out += &format!(", in sectors {a}..{b}");
        }
        if let Some(n) = self.rule.times {
            out += &format!(", at most {n} time{}", if n == 1 { "" } else { "s" });
        }
        if self.rule.power_cut {
            out += ", by cutting the power (once)";
        }
        out
    }
    fn decide(&self, io: &Io, now_ns: u64, random: u64) -> Decision {
        let r = &self.rule;
        // A test device: counting every request across queues is worth an atomic here.
        let seen = self.seen.fetch_add(1, Relaxed);
        let opened = *self.opened_ns.get_or_init(|| now_ns);
        if !r.ops[io.op.index()] {
            return Decision::Forward;
        }
        if r.after_ios.is_some_and(|n| seen < n) {
            return Decision::Forward;
        }
        if r.after
            .is_some_and(|d| now_ns.saturating_sub(opened) < d.as_nanos() as u64)
        {
            return Decision::Forward;
        }
        if let Some((start, end)) = r.sectors {
            let (first, last) = (io.offset / 512, io.end().div_ceil(512));
            let touches = if io.op == Op::Flush {
                true
            } else {
                first < end && last > start
            };
            if !touches {
                return Decision::Forward;
            }
        }
        if let Some(p) = r.probability {
            // 53 random bits as a fraction in [0, 1).
            if (random >> 11) as f64 / (1u64 << 53) as f64 >= p {
                return Decision::Forward;
            }
        }
        if r.times
            .is_some_and(|n| self.failed.fetch_add(1, Relaxed) >= n)
        {
            return Decision::Forward;
        }
        if r.power_cut {
            if self.cut.swap(true, Relaxed) {
                return Decision::Forward;
            }
            return Decision::PowerCut(r.errno, r.torn.then_some(random));
        }
        Decision::Fail(r.errno)
    }
}

/// A device that wraps `base` under a policy.
pub struct WrapDevice {
    name: String,
    base: Arc<dyn Device>,
    policy: Arc<dyn Policy>,
}

impl WrapDevice {
    /// Wraps `base`.
    pub fn new(name: &str, base: Arc<dyn Device>, policy: Arc<dyn Policy>) -> WrapDevice {
        WrapDevice {
            name: name.into(),
            base,
            policy,
        }
    }
}

impl Device for WrapDevice {
    fn name(&self) -> &str {
        &self.name
    }
    fn describe(&self) -> String {
        format!(
            "{} over {}: {}",
            self.policy.kind(),
            self.base.name(),
            self.policy.describe()
        )
    }
    fn geometry(&self) -> Geometry {
        self.base.geometry()
    }
    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
        let base = cairn_core::handoff::open_member(core, &self.base)?;
        let wake = if self.policy.changes_live() {
            let fd = cairn_core::event::eventfd(self.policy.kind())?;
            self.policy.watch(&fd);
            Some(fd)
        } else {
            None
        };
        let queue = Rc::new(WrapQueue {
            core: core.clone(),
            stats: QueueStats::named(core.switches().stats, self.name()),
            base,
            base_device: self.base.clone(),
            policy: self.policy.clone(),
            sink: Cell::new(SinkId(u32::MAX)),
            requests: RefCell::new(Slab::with_capacity(256)),
            rng: Cell::new(0x9e37_79b9_7f4a_7c15 ^ (Rc::as_ptr(core) as u64)),
            held: Cell::new(0),
            epoch: Cell::new(self.policy.epoch()),
            wake,
        });
        queue.sink.set(core.register_sink(queue.clone()));
        if queue.wake.is_some() {
            core.register_poller(queue.clone());
        }
        Ok(queue)
    }
    fn extents(
        &self,
        offset: u64,
        len: u64,
        out: &mut Vec<cairn_core::Extent>,
    ) -> Result<(), Error> {
        self.base.extents(offset, len, out)
    }

    fn base(&self) -> Option<&Arc<dyn Device>> {
        Some(&self.base)
    }

    /// What its policy offers (a throttle's admin) is its own.
    fn offer(self: Arc<Self>, want: Want) -> Option<Offer> {
        Arc::clone(&self.policy).offer(want)
    }
}

/// Token bit marking a timer (the request is due to go to the base) rather than a base
/// completion.
const TIMER: u64 = 1 << 63;

/// A request of a wrap queue: the request, when it arrived, and while its policy holds
/// it, when it is due.
#[derive(Clone, Copy)]
struct Entry {
    io: Io,
    start: u64,
    wait: Option<Wait>,
}

/// When a held request is due, and under which epoch of its policy that was decided.
#[derive(Clone, Copy)]
struct Wait {
    due_ns: u64,
    epoch: u64,
}

struct WrapQueue {
    core: Rc<Core>,
    stats: QueueStats,
    base: Rc<dyn Queue>,
    base_device: Arc<dyn Device>,
    policy: Arc<dyn Policy>,
    sink: Cell<SinkId>,
    requests: RefCell<Slab<Entry>>,
    rng: Cell<u64>,
    /// Requests held (their `wait` set).
    held: Cell<usize>,
    /// The policy's epoch when the held requests were last timed.
    epoch: Cell<u64>,
    /// Readable when the policy's epoch changes (watched while requests are held), for
    /// a policy whose decisions change live.
    wake: Option<Arc<OwnedFd>>,
}

impl WrapQueue {
    fn forward(&self, index: u32, io: Io) {
        self.base.submit(Io {
            sink: self.sink.get(),
            token: u64::from(index),
            ..io
        });
    }

    /// Holds request `index` until `due_ns`, as decided under `epoch`.
    fn hold(&self, index: u32, due_ns: u64, epoch: u64) {
        let mut requests = self.requests.borrow_mut();
        let e = requests.get_mut(index);
        if e.wait.is_none() {
            self.held.set(self.held.get() + 1);
        }
        e.wait = Some(Wait { due_ns, epoch });
        drop(requests);
        self.core
            .add_timer(due_ns, self.sink.get(), TIMER | u64::from(index));
    }

    /// Sends held request `index` to the base.
    fn release(&self, index: u32) {
        let io = {
            let mut requests = self.requests.borrow_mut();
            let e = requests.get_mut(index);
            debug_assert!(e.wait.is_some(), "a request released twice");
            e.wait = None;
            e.io
        };
        debug_assert!(self.held.get() > 0, "held count underflow");
        self.held.set(self.held.get() - 1);
        self.policy.released(&io);
        self.forward(index, io);
    }

    /// A timer of request `index` fired. Timers cannot be cancelled, so this one may be
    /// for a request timed again since, or long gone (its index free or reused): the
    /// entry decides, not the timer. A held request goes once it is due under the
    /// policy's current epoch; one decided under an older epoch is timed again.
    fn timer_fired(&self, index: u32) {
        let wait = self.requests.borrow().peek(index).and_then(|e| e.wait);
        let Some(wait) = wait else {
            return;
        };
        if wait.epoch != self.policy.epoch() {
            self.retime();
        } else if wait.due_ns <= self.core.now_ns() {
            self.release(index);
        }
    }

    /// Decides again every held request decided under an older epoch of the policy (its
    /// limits changed), in the order they were due. Returns how many went to the base.
    fn retime(&self) -> usize {
        let epoch = self.policy.epoch();
        self.epoch.set(epoch);
        let stale: Vec<(u64, u32)> = {
            let requests = self.requests.borrow();
            (0..requests.slots())
                .filter_map(|i| {
                    let w = requests.peek(i)?.wait?;
                    (w.epoch != epoch).then_some((w.due_ns, i))
                })
                .collect()
        };
        let mut stale = stale;
        stale.sort_unstable();
        let now = self.core.now_ns();
        let mut sent = 0;
        for (_, index) in stale {
            let io = self.requests.borrow().get(index).io;
            match self.policy.redecide(&io, now) {
                Decision::Delay(ns) => self.hold(index, now + ns, epoch),
                _ => {
                    self.release(index);
                    sent += 1;
                }
            }
        }
        sent
    }

    fn random(&self) -> u64 {
        let mut x = self.rng.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

impl Queue for WrapQueue {
    fn submit(&self, io: Io) {
        let now = self.core.now_ns();
        self.stats.start(io.flags, now);
        // Read before deciding: a change of the policy during the decision then times
        // this request again rather than leaving it timed by the old one.
        let epoch = self.policy.epoch();
        match self.policy.decide(&io, now, self.random()) {
            Decision::PowerCut(errno, torn) => {
                log::info!("cairn: fault: cutting the power below this device");
                match torn {
                    Some(seed) => self.base_device.power_cut_torn(seed),
                    None => self.base_device.power_cut(),
                }
                self.stats.done(io.flags, io.op, io.len, now, now, false);
                self.core
                    .complete(io.sink, io.token, IoStatus::errno(errno));
            }
            Decision::Fail(errno) => {
                self.stats.done(io.flags, io.op, io.len, now, now, false);
                // Never complete inside submit: through the FIFO.
                self.core
                    .complete(io.sink, io.token, IoStatus::errno(errno));
            }
            Decision::Forward => {
                let index = self.requests.borrow_mut().insert(Entry {
                    io,
                    start: now,
                    wait: None,
                });
                self.forward(index, io);
            }
            Decision::Delay(ns) => {
                let index = self.requests.borrow_mut().insert(Entry {
                    io,
                    start: now,
                    wait: None,
                });
                self.hold(index, now + ns, epoch);
            }
        }
    }

    fn stats(&self) -> &QueueStats {
        &self.stats
    }

    fn children(&self) -> Vec<Rc<dyn Queue>> {
        vec![self.base.clone()]
    }
}

impl Sink for WrapQueue {
    fn io_done(&self, token: u64, status: IoStatus) {
        let index = (token & !TIMER) as u32;
        if token & TIMER != 0 {
            self.timer_fired(index);
            return;
        }
        let Entry { io, start, wait } = self.requests.borrow_mut().remove(index);
        debug_assert!(wait.is_none(), "a held request completed");
        self.stats
            .finish(&io, start, || self.core.now_ns(), status.is_ok());
        self.core.deliver(io.sink, io.token, status);
    }
}

/// A queue whose policy can change (a throttle's limits) watches for the change while it
/// holds requests, and times them again when it comes.
impl Poller for WrapQueue {
    fn unplug(&self) {}

    fn reap(&self) -> usize {
        if self.held.get() > 0 && self.policy.epoch() != self.epoch.get() {
            self.retime()
        } else {
            0
        }
    }

    fn busy(&self) -> bool {
        self.held.get() > 0
    }

    fn event_fd(&self) -> RawFd {
        // Registered as a poller only with an eventfd.
        self.wake.as_ref().map_or(-1, |w| w.as_raw_fd())
    }

    fn clear_event(&self) {
        if let Some(w) = &self.wake {
            cairn_core::event::reset(&**w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_core::SinkId;

    fn io(op: Op, offset: u64, len: u64) -> Io {
        Io {
            op,
            flags: cairn_core::IoFlags::NONE,
            offset,
            len,
            buf: std::ptr::null_mut(),
            sink: SinkId(0),
            token: 0,
        }
    }

    const MS: u64 = 1_000_000;

    fn disk(bandwidth: Option<u64>, seek_ms: u64) -> Delay {
        Delay::new(Delays {
            bandwidth,
            seek: Duration::from_millis(seek_ms),
            ..Delays::default()
        })
    }

    #[test]
    fn times_fails_only_the_first_matching_requests() {
        let mut ops = [false; Op::COUNT];
        ops[Op::Read.index()] = true;
        let f = Faults::new(FaultRule {
            ops,
            after_ios: None,
            after: None,
            probability: None,
            sectors: Some((8, 16)),
            times: Some(2),
            errno: libc::EIO,
            power_cut: false,
            torn: false,
        });
        // Requests that do not match are not counted against `times`.
        assert_eq!(f.decide(&io(Op::Read, 0, 4096), 0, 0), Decision::Forward);
        assert_eq!(
            f.decide(&io(Op::Write, 4096, 4096), 0, 0),
            Decision::Forward
        );
        let bad = io(Op::Read, 4096, 4096);
        assert_eq!(f.decide(&bad, 0, 0), Decision::Fail(libc::EIO));
        assert_eq!(f.decide(&bad, 0, 0), Decision::Fail(libc::EIO));
        assert_eq!(f.decide(&bad, 0, 0), Decision::Forward);
        assert_eq!(f.decide(&bad, 0, 0), Decision::Forward);
    }

    #[test]
    fn fixed_latencies_without_a_disk_model_do_not_queue() {
        let d = Delay::new(Delays {
            write: Duration::from_millis(2),
            ..Delays::default()
        });
        // Two writes at the same moment both wait 2 ms: no shared timeline.
        assert_eq!(
            d.decide(&io(Op::Write, 0, 4096), 0, 0),
            Decision::Delay(2 * MS)
        );
        assert_eq!(
            d.decide(&io(Op::Write, 4096, 4096), 0, 0),
            Decision::Delay(2 * MS)
        );
        assert_eq!(d.decide(&io(Op::Read, 0, 4096), 0, 0), Decision::Forward);
    }

    #[test]
    fn bandwidth_serializes_transfers() {
        // 1 MB/s: 1000 bytes take 1 ms.
        let d = disk(Some(1_000_000), 0);
        assert_eq!(d.decide(&io(Op::Write, 0, 1000), 0, 0), Decision::Delay(MS));
        // Queued behind the first: done at 2 ms.
        assert_eq!(
            d.decide(&io(Op::Write, 1000, 1000), 0, 0),
            Decision::Delay(2 * MS)
        );
        // Arriving after the disk went idle: only its own transfer.
        assert_eq!(
            d.decide(&io(Op::Read, 2000, 1000), 10 * MS, 0),
            Decision::Delay(MS)
        );
    }

    #[test]
    fn a_seek_costs_only_when_the_head_moves() {
        let d = disk(None, 8);
        // The first request seeks (the head's position is unknown).
        assert_eq!(
            d.decide(&io(Op::Read, 0, 4096), 0, 0),
            Decision::Delay(8 * MS)
        );
        // Sequential: starts where the last ended; waits only for the disk.
        assert_eq!(
            d.decide(&io(Op::Read, 4096, 4096), 0, 0),
            Decision::Delay(8 * MS)
        );
        // Random: another seek, queued behind the first.
        assert_eq!(
            d.decide(&io(Op::Write, 1 << 20, 4096), 0, 0),
            Decision::Delay(16 * MS)
        );
        // Flushes and discards neither move the head nor transfer.
        assert_eq!(
            d.decide(&io(Op::Flush, 0, 0), 100 * MS, 0),
            Decision::Forward
        );
        assert_eq!(
            d.decide(&io(Op::Write, (1 << 20) + 4096, 4096), 100 * MS, 0),
            Decision::Forward
        );
    }

    #[test]
    fn locality_decides_throughput() {
        // 100 MB/s and 5 ms seeks: 256 sequential 4 KiB writes against 256 random ones.
        let total = |offsets: &[u64]| {
            let d = disk(Some(100_000_000), 5);
            let mut last = 0;
            for &o in offsets {
                if let Decision::Delay(ns) = d.decide(&io(Op::Write, o, 4096), 0, 0) {
                    last = ns;
                }
            }
            last
        };
        let seq: Vec<u64> = (0..256).map(|i| i * 4096).collect();
        let rnd: Vec<u64> = (0..256).map(|i| (i * 7919 % 256) * (1 << 20)).collect();
        let (s, r) = (total(&seq), total(&rnd));
        // One seek and 1 MiB of transfer, against 256 seeks.
        assert_eq!(s, 5 * MS + 256 * 4096 * 10);
        assert_eq!(r, 256 * (5 * MS + 4096 * 10));
    }
}
