//! `fault` and `delay`: devices that wrap one `base` device and change what it does.
//!
//! One queue type serves both: for each request a [`Policy`] decides to forward it, to
//! forward it after a delay (a reactor timer, never a sleeping thread), or to fail it
//! without touching the base. They play the role of TigerBeetle's simulator faults: tests
//! put them under mirrors and raid10s to check that nothing acknowledged is lost.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cairn_core::slab::Slab;
use cairn_core::{
    Core, Device, Error, Geometry, Io, IoStatus, Op, Queue, QueueStats, Sink, SinkId,
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
}

/// Decides the fate of each request.
pub trait Policy: Send + Sync {
    /// `fault` or `delay`.
    fn kind(&self) -> &'static str;
    /// Parameters for reports.
    fn describe(&self) -> String;
    /// The decision for `io`, at `now_ns`, with a per-queue random number `random`.
    fn decide(&self, io: &Io, now_ns: u64, random: u64) -> Decision;
}

/// Latency added per operation (discard and write-zeroes count as writes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Delays {
    /// Added to every read.
    pub read: Duration,
    /// Added to every write, discard and write-zeroes.
    pub write: Duration,
    /// Added to every flush.
    pub flush: Duration,
}

impl Policy for Delays {
    fn kind(&self) -> &'static str {
        "delay"
    }
    fn describe(&self) -> String {
        format!(
            "read +{:?}, write +{:?}, flush +{:?}",
            self.read, self.write, self.flush
        )
    }
    #[inline]
    fn decide(&self, io: &Io, _now_ns: u64, _random: u64) -> Decision {
        let d = match io.op {
            Op::Read => self.read,
            Op::Flush => self.flush,
            _ => self.write,
        };
        if d.is_zero() {
            Decision::Forward
        } else {
            Decision::Delay(d.as_nanos() as u64)
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
    /// The errno failed requests get.
    pub errno: i32,
}

/// A [`FaultRule`] with the device-wide state it counts with.
pub struct Faults {
    rule: FaultRule,
    seen: AtomicU64,
    opened_ns: OnceLock<u64>,
}

impl Faults {
    /// Faults per `rule`.
    pub fn new(rule: FaultRule) -> Faults {
        Faults {
            rule,
            seen: AtomicU64::new(0),
            opened_ns: OnceLock::new(),
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
        let queue = Rc::new(WrapQueue {
            core: core.clone(),
            stats: QueueStats::new(core.switches().stats),
            base,
            policy: self.policy.clone(),
            sink: Cell::new(SinkId(u32::MAX)),
            requests: RefCell::new(Slab::with_capacity(256)),
            rng: Cell::new(0x9e37_79b9_7f4a_7c15 ^ (Rc::as_ptr(core) as u64)),
        });
        queue.sink.set(core.register_sink(queue.clone()));
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

    fn children(&self) -> Vec<Arc<dyn Device>> {
        vec![self.base.clone()]
    }
}

/// Token bit marking a timer (the request is due to go to the base) rather than a base
/// completion.
const TIMER: u64 = 1 << 63;

struct WrapQueue {
    core: Rc<Core>,
    stats: QueueStats,
    base: Rc<dyn Queue>,
    policy: Arc<dyn Policy>,
    sink: Cell<SinkId>,
    requests: RefCell<Slab<(Io, u64)>>,
    rng: Cell<u64>,
}

impl WrapQueue {
    fn forward(&self, index: u32, io: Io) {
        self.base.submit(Io {
            sink: self.sink.get(),
            token: u64::from(index),
            ..io
        });
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
        self.stats.start(now);
        match self.policy.decide(&io, now, self.random()) {
            Decision::Fail(errno) => {
                self.stats.done(io.op, io.len, now, now, false);
                // Never complete inside submit: through the FIFO.
                self.core
                    .complete(io.sink, io.token, IoStatus::errno(errno));
            }
            Decision::Forward => {
                let index = self.requests.borrow_mut().insert((io, now));
                self.forward(index, io);
            }
            Decision::Delay(ns) => {
                let index = self.requests.borrow_mut().insert((io, now));
                self.core
                    .add_timer(now + ns, self.sink.get(), TIMER | u64::from(index));
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
            let io = self.requests.borrow().get(index).0;
            self.forward(index, io);
            return;
        }
        let (io, start) = self.requests.borrow_mut().remove(index);
        if self.stats.enabled() {
            self.stats
                .done(io.op, io.len, start, self.core.now_ns(), status.is_ok());
        }
        self.core.deliver(io.sink, io.token, status);
    }
}
