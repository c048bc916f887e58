//! One bench job: a reactor thread keeping `iodepth` requests in flight on one queue.
//!
//! The job is the queue's [`Sink`]: each completion is accounted, verified if asked, and
//! immediately replaced by the slot's next request, so the steady state allocates
//! nothing and reads the clock only through the reactor's cached value.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use cairn_core::reactor::LoopStats;
use cairn_core::{
    AlignedBuf, Core, Device, DeviceStatsSnapshot, Io, IoFlags, IoStatus, Op, Queue, Reactor, Sink,
    SinkId, Switches,
};
use hdrhistogram::Histogram;

use crate::{verify, Failure, JobSpec, Progress};

/// Directions a job reports on, as fio does: read, write, and sync (flush).
pub const DIRS: usize = 3;
const DIR_SYNC: usize = 2;

/// Latency statistics of one direction.
#[derive(Clone)]
pub struct DirStats {
    /// Completed requests.
    pub ios: u64,
    /// Bytes transferred.
    pub bytes: u64,
    /// Completion latency in nanoseconds (three significant digits).
    pub clat: Histogram<u64>,
    /// Exact sum of latencies, for the mean.
    pub sum_ns: u128,
    /// Exact sum of squared latencies, for the standard deviation.
    pub sum_sq: f64,
}

impl DirStats {
    fn new() -> DirStats {
        DirStats {
            ios: 0,
            bytes: 0,
            clat: Histogram::new_with_max(cairn_core::stats::LATENCY_NS_MAX, 3)
                .expect("valid histogram bounds"),
            sum_ns: 0,
            sum_sq: 0.0,
        }
    }

    #[inline]
    fn record(&mut self, bytes: u64, latency_ns: u64) {
        self.ios += 1;
        self.bytes += bytes;
        self.clat.saturating_record(latency_ns);
        self.sum_ns += u128::from(latency_ns);
        self.sum_sq += (latency_ns as f64) * (latency_ns as f64);
    }

    /// Adds another job's statistics.
    pub fn merge(&mut self, other: &DirStats) {
        self.ios += other.ios;
        self.bytes += other.bytes;
        let _ = self.clat.add(&other.clat);
        self.sum_ns += other.sum_ns;
        self.sum_sq += other.sum_sq;
    }

    /// Mean latency in nanoseconds.
    pub fn mean_ns(&self) -> f64 {
        if self.ios == 0 {
            0.0
        } else {
            self.sum_ns as f64 / self.ios as f64
        }
    }

    /// Standard deviation of latency in nanoseconds.
    pub fn stddev_ns(&self) -> f64 {
        if self.ios < 2 {
            return 0.0;
        }
        let n = self.ios as f64;
        let mean = self.sum_ns as f64 / n;
        ((self.sum_sq / n - mean * mean).max(0.0) * n / (n - 1.0)).sqrt()
    }
}

/// What one job measured.
pub struct JobResult {
    /// Read, write and sync statistics.
    pub dirs: [DirStats; DIRS],
    /// The writes that carried FUA (`--fua-every`), also counted in `dirs[1]`.
    pub fua: DirStats,
    /// Measured time (after the ramp) in nanoseconds.
    pub runtime_ns: u64,
    /// Why the job stopped early, if it did.
    pub failure: Option<Failure>,
    /// Completions found per non-empty reap of the completion rings.
    pub reaps: Histogram<u64>,
    /// Reactor loop counters.
    pub loop_stats: LoopStats,
    /// System clock reads by the reactor's clock.
    pub clock_reads: u64,
    /// Device statistics over the measured period, for the device and each one below it.
    pub devices: Vec<(String, DeviceStatsSnapshot)>,
    /// Blocks read back and checked by `--verify`.
    pub verified_blocks: u64,
}

impl JobResult {
    fn failed(f: Failure) -> JobResult {
        JobResult {
            dirs: std::array::from_fn(|_| DirStats::new()),
            fua: DirStats::new(),
            runtime_ns: 0,
            failure: Some(f),
            reaps: Histogram::new(3).expect("valid histogram"),
            loop_stats: LoopStats::default(),
            clock_reads: 0,
            devices: Vec::new(),
            verified_blocks: 0,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Main,
    Verify,
    Done,
}

struct Slot {
    buf: AlignedBuf,
    op: Op,
    /// Whether the request in flight is a write with FUA.
    fua: bool,
    offset: u64,
    submit_ns: u64,
    writes: u32,
}

struct State {
    slots: Vec<Slot>,
    rng: u64,
    cursor: [u64; 2],
    region_start: u64,
    region_blocks: u64,
    read_percent: u32,
    issued_bytes: u64,
    measuring: bool,
    ramp_end_ns: u64,
    measure_start_ns: u64,
    deadline_ns: u64,
    last_ns: u64,
    in_flight: u32,
    phase: Phase,
    stopping: bool,
    dirs: [DirStats; DIRS],
    fua: DirStats,
    /// Writes issued in the main phase (`--fua-every` counts them).
    writes_issued: u64,
    failure: Option<Failure>,
    generations: Vec<u64>,
    busy: Vec<u64>,
    next_generation: u64,
    verify_cursor: u64,
    verified_blocks: u64,
    device_base: Vec<DeviceStatsSnapshot>,
}

struct Job {
    spec: JobSpec,
    core: Rc<Core>,
    queue: Rc<dyn Queue>,
    names: Vec<String>,
    sink: Cell<SinkId>,
    io_size: u64,
    progress: Arc<Progress>,
    state: RefCell<State>,
}

/// Runs one job to completion on the calling thread.
pub(crate) fn run_job(
    spec: &JobSpec,
    index: u32,
    device: Arc<dyn Device>,
    switches: Switches,
    region: (u64, u64),
    io_size: u64,
    progress: &Arc<Progress>,
) -> JobResult {
    let reactor = match Reactor::new(switches) {
        Ok(r) => r,
        Err(e) => return JobResult::failed(Failure::Setup(format!("job {index}: {e}"))),
    };
    reactor.set_idle_poll(spec.idle_poll.as_nanos() as u64);
    let core = reactor.core().clone();
    let queue = match device.open_queue(&core) {
        Ok(q) => q,
        Err(e) => return JobResult::failed(Failure::Setup(format!("job {index}: {e}"))),
    };
    let names = device_names(&*device, &queue);
    let now = core.now_ns();
    let blocks = region.1 / spec.bs;
    let slots = (0..spec.iodepth)
        .map(|_| Slot {
            buf: AlignedBuf::new(spec.bs as usize),
            op: Op::Read,
            fua: false,
            offset: 0,
            submit_ns: 0,
            writes: 0,
        })
        .collect();
    let measuring = spec.ramp_time.is_zero();
    let runtime_ns = spec.runtime.map_or(u64::MAX, |d| d.as_nanos() as u64);
    let state = State {
        slots,
        rng: spec.randseed ^ (u64::from(index) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        cursor: [0, 0],
        region_start: region.0,
        region_blocks: blocks,
        read_percent: spec.rw.read_percent(spec.rwmixread),
        issued_bytes: 0,
        measuring,
        ramp_end_ns: now + spec.ramp_time.as_nanos() as u64,
        measure_start_ns: now,
        deadline_ns: if measuring {
            now.saturating_add(runtime_ns)
        } else {
            u64::MAX
        },
        last_ns: now,
        in_flight: 0,
        phase: Phase::Main,
        stopping: false,
        dirs: std::array::from_fn(|_| DirStats::new()),
        fua: DirStats::new(),
        writes_issued: 0,
        failure: None,
        generations: if spec.verify {
            vec![0; blocks as usize]
        } else {
            Vec::new()
        },
        busy: if spec.verify {
            vec![0; blocks.div_ceil(64) as usize]
        } else {
            Vec::new()
        },
        next_generation: 1,
        verify_cursor: 0,
        verified_blocks: 0,
        device_base: snapshot_tree(&queue, now),
    };
    let job = Rc::new(Job {
        spec: spec.clone(),
        core: core.clone(),
        queue,
        names,
        sink: Cell::new(SinkId(0)),
        io_size,
        progress: progress.clone(),
        state: RefCell::new(state),
    });
    let sink = core.register_sink(job.clone());
    job.sink.set(sink);
    job.start();
    reactor.run();
    core.unregister_sink(sink);
    job.result()
}

/// Names of the devices whose queues this reactor holds, in the order of
/// [`snapshot_tree`]: a queue that hides its members (a hand-off to another thread) hides
/// their names too.
fn device_names(device: &dyn Device, queue: &Rc<dyn Queue>) -> Vec<String> {
    let mut out = vec![device.name().to_string()];
    for (d, q) in device.children().iter().zip(queue.children()) {
        out.extend(device_names(&**d, &q));
    }
    out
}

fn snapshot_tree(queue: &Rc<dyn Queue>, now: u64) -> Vec<DeviceStatsSnapshot> {
    let mut out = vec![queue.stats().snapshot(now)];
    for child in queue.children() {
        out.extend(snapshot_tree(&child, now));
    }
    out
}

#[inline]
fn next_rand(state: &mut u64) -> u64 {
    // xorshift64*: fast, and good enough to spread offsets.
    let mut x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    x.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

impl Job {
    fn start(&self) {
        let mut st = self.state.borrow_mut();
        let now = self.core.now_ns();
        for slot in 0..self.spec.iodepth as usize {
            match self.next_main(&mut st, slot, now) {
                Some(io) => {
                    st.in_flight += 1;
                    self.queue.submit(io);
                }
                None => break,
            }
        }
        if st.in_flight == 0 {
            drop(st);
            self.phase_done();
        }
    }

    /// The slot's next request in the main phase, or None when the phase is over.
    #[inline]
    fn next_main(&self, st: &mut State, slot: usize, now: u64) -> Option<Io> {
        if st.stopping || st.failure.is_some() {
            return None;
        }
        if now >= st.deadline_ns
            || (!self.spec.time_based && st.issued_bytes >= self.io_size)
            || crate::INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed)
        {
            st.stopping = true;
            return None;
        }
        let bs = self.spec.bs;
        let is_read = st.read_percent == 100
            || (st.read_percent > 0 && (next_rand(&mut st.rng) % 100) < u64::from(st.read_percent));
        let block = if self.spec.rw.random() {
            let mut block = pick(&mut st.rng, st.region_blocks);
            if self.spec.verify {
                let mut tries = 0;
                while is_busy(&st.busy, block) && tries < 1000 {
                    block = pick(&mut st.rng, st.region_blocks);
                    tries += 1;
                }
            }
            block
        } else {
            let dir = usize::from(!is_read);
            let mut block = st.cursor[dir];
            if self.spec.verify {
                // With `rw`, the read and write cursors meet blocks the other has in
                // flight: step past them. At most iodepth - 1 blocks are busy and the
                // plan guarantees at least 2 x iodepth, so this finds one.
                let mut tries = 0;
                while is_busy(&st.busy, block) && tries < st.region_blocks {
                    block = (block + 1) % st.region_blocks;
                    tries += 1;
                }
            }
            st.cursor[dir] = (block + 1) % st.region_blocks;
            block
        };
        if self.spec.verify && is_busy(&st.busy, block) {
            // Only reachable when every random try collided; skip this turn rather than
            // overlap.
            return None;
        }
        st.issued_bytes += bs;
        let op = if is_read { Op::Read } else { Op::Write };
        let mut flags = IoFlags::NONE;
        if !is_read && self.spec.fua_every > 0 {
            st.writes_issued += 1;
            if st
                .writes_issued
                .is_multiple_of(u64::from(self.spec.fua_every))
            {
                flags = IoFlags::FUA;
            }
        }
        Some(self.prepare(st, slot, op, flags, block, now))
    }

    #[inline]
    fn prepare(
        &self,
        st: &mut State,
        slot: usize,
        op: Op,
        flags: IoFlags,
        block: u64,
        now: u64,
    ) -> Io {
        let bs = self.spec.bs;
        let offset = st.region_start + block * bs;
        if self.spec.verify {
            set_busy(&mut st.busy, block, true);
            if op == Op::Write {
                let generation = st.next_generation;
                st.next_generation += 1;
                verify::fill(st.slots[slot].buf.as_mut_slice(), offset, generation);
            }
        }
        let s = &mut st.slots[slot];
        s.op = op;
        s.fua = flags.contains(IoFlags::FUA);
        s.offset = offset;
        s.submit_ns = now;
        Io {
            op,
            flags,
            offset,
            len: bs,
            buf: s.buf.as_mut_ptr(),
            sink: self.sink.get(),
            token: slot as u64,
        }
    }

    fn next_verify(&self, st: &mut State, slot: usize, now: u64) -> Option<Io> {
        if st.failure.is_some() {
            return None;
        }
        while st.verify_cursor < st.region_blocks {
            let block = st.verify_cursor;
            st.verify_cursor += 1;
            if st.generations[block as usize] != 0 {
                return Some(self.prepare(st, slot, Op::Read, IoFlags::NONE, block, now));
            }
        }
        None
    }

    fn phase_done(&self) {
        let mut st = self.state.borrow_mut();
        let writes_only = st.read_percent == 0;
        if st.phase == Phase::Main
            && self.spec.verify
            && writes_only
            && st.failure.is_none()
            && !st.generations.is_empty()
        {
            // fio's do_verify: read back everything the write phase wrote.
            st.phase = Phase::Verify;
            let now = self.core.now_ns();
            for slot in 0..self.spec.iodepth as usize {
                match self.next_verify(&mut st, slot, now) {
                    Some(io) => {
                        st.in_flight += 1;
                        self.queue.submit(io);
                    }
                    None => break,
                }
            }
            if st.in_flight > 0 {
                return;
            }
        }
        st.phase = Phase::Done;
        self.core.stop();
    }

    fn result(&self) -> JobResult {
        let st = self.state.borrow();
        let now = self.core.now_ns();
        let after = snapshot_tree(&self.queue, now);
        let devices = after
            .iter()
            .zip(&st.device_base)
            .zip(&self.names)
            .map(|((a, b), name)| (name.clone(), a.since(b)))
            .collect();
        JobResult {
            dirs: st.dirs.clone(),
            fua: st.fua.clone(),
            runtime_ns: st.last_ns.saturating_sub(st.measure_start_ns),
            failure: st.failure.clone(),
            reaps: self.core.reap_histogram(),
            loop_stats: self.core.loop_stats(),
            clock_reads: self.core.clock().reads(),
            devices,
            verified_blocks: st.verified_blocks,
        }
    }
}

#[inline]
fn pick(rng: &mut u64, n: u64) -> u64 {
    // Lemire's multiply-shift: uniform enough, and no division.
    ((u128::from(next_rand(rng)) * u128::from(n)) >> 64) as u64
}

#[inline]
fn is_busy(busy: &[u64], block: u64) -> bool {
    busy[(block / 64) as usize] & (1 << (block % 64)) != 0
}

#[inline]
fn set_busy(busy: &mut [u64], block: u64, on: bool) {
    let word = &mut busy[(block / 64) as usize];
    if on {
        *word |= 1 << (block % 64);
    } else {
        *word &= !(1 << (block % 64));
    }
}

/// The steps of a completion, in the order [`Job::io_done`] takes them.
impl Job {
    /// The ramp is over: statistics count from `now` on.
    #[cold]
    fn start_measuring(&self, st: &mut State, now: u64) {
        st.measuring = true;
        st.measure_start_ns = now;
        st.deadline_ns =
            now.saturating_add(self.spec.runtime.map_or(u64::MAX, |d| d.as_nanos() as u64));
        st.dirs = std::array::from_fn(|_| DirStats::new());
        st.fua = DirStats::new();
        st.device_base = snapshot_tree(&self.queue, now);
    }

    /// Counts a request of the measured main phase that completed `latency_ns` after it
    /// was sent.
    #[inline]
    fn record(&self, st: &mut State, op: Op, fua: bool, latency_ns: u64) {
        let dir = match op {
            Op::Read => 0,
            Op::Flush => DIR_SYNC,
            _ => 1,
        };
        let bytes = if op.has_data() { self.spec.bs } else { 0 };
        st.dirs[dir].record(bytes, latency_ns);
        if fua {
            st.fua.record(bytes, latency_ns);
        }
        match dir {
            0 => self.progress.reads.store(st.dirs[0].ios, Relaxed),
            1 => self.progress.writes.store(st.dirs[1].ios, Relaxed),
            _ => {}
        }
    }

    /// With --verify, after a read or write of the slot: its block may be sent again;
    /// a write's generation is remembered, a read's data checked against the last one.
    #[inline]
    fn verify_done(&self, st: &mut State, slot: usize, status: IoStatus) {
        let (op, offset) = (st.slots[slot].op, st.slots[slot].offset);
        let block = (offset - st.region_start) / self.spec.bs;
        set_busy(&mut st.busy, block, false);
        if !status.is_ok() {
            return;
        }
        if op == Op::Write {
            // Generation numbers are written in increasing order per block
            // because a block is never in flight twice.
            let s = &st.slots[slot];
            let generation =
                u64::from_le_bytes(s.buf.as_slice()[16..24].try_into().expect("8 bytes"));
            st.generations[block as usize] = generation;
            return;
        }
        let expected = st.generations[block as usize];
        if expected != 0 {
            if let Err(mismatch) = verify::check(st.slots[slot].buf.as_slice(), offset, expected) {
                if st.failure.is_none() {
                    st.failure = Some(Failure::Verify { offset, mismatch });
                }
            } else {
                st.verified_blocks += 1;
            }
        }
    }

    /// A flush as the slot's next request, when this write of the main phase is its
    /// --fsync'th since the last.
    #[inline]
    fn flush_due(
        &self,
        st: &mut State,
        slot: usize,
        op: Op,
        status: IoStatus,
        now: u64,
    ) -> Option<Io> {
        if op != Op::Write || self.spec.fsync == 0 || st.phase != Phase::Main || !status.is_ok() {
            return None;
        }
        let healthy = st.failure.is_none();
        let s = &mut st.slots[slot];
        s.writes += 1;
        if s.writes < self.spec.fsync || !healthy {
            return None;
        }
        s.writes = 0;
        s.op = Op::Flush;
        s.fua = false;
        s.submit_ns = now;
        Some(Io::nodata(Op::Flush, 0, 0, self.sink.get(), slot as u64))
    }
}

impl Sink for Job {
    fn io_done(&self, token: u64, status: IoStatus) {
        let slot = token as usize;
        let now = self.core.now_ns();
        let mut guard = self.state.borrow_mut();
        let st = &mut *guard;
        st.last_ns = now;
        if !st.measuring && now >= st.ramp_end_ns {
            self.start_measuring(st, now);
        }
        let (op, fua, offset, submit_ns) = {
            let s = &st.slots[slot];
            (s.op, s.fua, s.offset, s.submit_ns)
        };
        if !status.is_ok() {
            if st.failure.is_none() {
                st.failure = Some(Failure::Io {
                    op,
                    offset,
                    errno: status.raw(),
                });
            }
        } else if st.phase == Phase::Main && st.measuring {
            self.record(st, op, fua, now.saturating_sub(submit_ns));
        }
        if self.spec.verify && op.has_data() {
            self.verify_done(st, slot, status);
        }
        // The slot's next request: a flush if --fsync says so, else more I/O.
        let mut next = self.flush_due(st, slot, op, status, now);
        if next.is_none() {
            next = match st.phase {
                Phase::Main => self.next_main(st, slot, now),
                Phase::Verify => self.next_verify(st, slot, now),
                Phase::Done => None,
            };
        }
        match next {
            Some(io) => self.queue.submit(io),
            None => {
                st.in_flight -= 1;
                if st.in_flight == 0 {
                    drop(guard);
                    self.phase_done();
                }
            }
        }
    }
}
