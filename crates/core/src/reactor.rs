//! The reactor: one per thread, carrying every I/O from its frontend to its leaf and back.
//!
//! A reactor owns an io_uring, a plug (SQEs and aio requests queued but not yet handed to
//! the kernel), a cached clock, a FIFO of completions to deliver, and the table of sinks
//! they are delivered to. One pass of [`Reactor::run`]:
//!
//! 1. refresh the cached clock (one read per batch, technique 2) and fire due timers;
//! 2. deliver the completions that were in the FIFO when the pass began (their callbacks
//!    submit new requests, which only queue up in the plug);
//! 3. unplug: one `io_submit` per aio context, one `io_uring_enter` for the ring's batch;
//! 4. eager reaping (technique 5): read the aio completion rings right after `io_submit`,
//!    without a system call; if work is ready, submit the ring's batch and collect what
//!    has completed in the same `io_uring_enter`, and loop without sleeping;
//! 5. only when there is nothing to do, submit and wait in one `io_uring_enter` (which
//!    returns at once if anything has already completed) until a completion or a timer.
//!
//! With `--reap lazy` completions are collected only by the wait of step 5, as QEMU's
//! linux-aio did before it reaped from its submit path. For a reactor with only ring work
//! the two modes coincide, because step 5 already reaps before it sleeps.
//!
//! Completions never run inside `submit`: a queue that finishes a request at once (null,
//! mem) pushes it on the FIFO, so stacks never recurse without bound. The FIFO is bounded
//! by the number of requests in flight on the reactor, each of which completes once.
//!
//! Nothing in here is `Send`: a reactor and everything opened on it stay on one thread.

use std::cell::{Cell, RefCell, UnsafeCell};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::rc::Rc;

use hdrhistogram::Histogram;
use io_uring::{opcode, squeue, types, IoUring};

use crate::clock::{Clock, ClockMode};
use crate::error::Error;
use crate::flush::FlushMode;
use crate::io::{IoStatus, SinkId};
use crate::stats::StatsMode;

/// When completion rings are looked at (`--reap eager|lazy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReapMode {
    /// Right after every submission, without a system call (the default).
    #[default]
    Eager,
    /// Only when the reactor has run out of other work and waits for the kernel.
    Lazy,
}

/// Whether a waiting reactor wakes for each storage completion (`--coalesce on|off`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CoalesceMode {
    /// With many storage requests in flight, wait for a quarter of them or
    /// [`COALESCE_WINDOW_US`] (the default).
    #[default]
    On,
    /// Wake for every completion (the "before").
    Off,
}

/// The global switches that restore each technique's "before".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Switches {
    /// Technique 2: `--clock cached|precise`.
    pub clock: ClockMode,
    /// Technique 5: `--reap eager|lazy`.
    pub reap: ReapMode,
    /// `--stats on|off`.
    pub stats: StatsMode,
    /// Technique 1: `--flush batched|serial`.
    pub flush: FlushMode,
    /// Technique 4: `--dispatch inline|handoff`.
    pub dispatch: DispatchMode,
    /// Technique 3: `--writeback per-device|shared`.
    pub writeback: WritebackMode,
    /// `--coalesce on|off`: completion coalescing (see [`COALESCE_WINDOW_US`]).
    pub coalesce: CoalesceMode,
}

/// Who writes cache devices back (`--writeback per-device|shared`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WritebackMode {
    /// Each cache has its own flusher thread, writing back in offset order (the default).
    #[default]
    PerDevice,
    /// One pool of as many threads as caches takes pages from every cache in the order
    /// they were dirtied (the "before").
    Shared,
}

/// How a stacked device reaches its members (`--dispatch inline|handoff`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DispatchMode {
    /// On the submitting reactor's own thread (the default).
    #[default]
    Inline,
    /// Through a worker thread per stacked hop, as dm-mq's kblockd did.
    Handoff,
}

/// Receives completions. Implemented by whoever submits: a bench job, an NBD connection,
/// a stacked device waiting for its members.
pub trait Sink {
    /// The request submitted with `token` has completed with `status`.
    fn io_done(&self, token: u64, status: IoStatus);
}

/// Receives the io_uring completions of the SQEs it pushed (see [`Core::push_sqe`]).
pub trait RingUser {
    /// The SQE pushed with `cookie` completed with the kernel result `res`.
    fn ring_complete(&self, cookie: u64, res: i32);
}

/// A source of completions with its own ring, such as a linux-aio context.
pub trait Poller {
    /// Hands everything queued to the kernel (one system call per batch).
    fn unplug(&self);
    /// Collects whatever has completed, without blocking; returns how many.
    fn reap(&self) -> usize;
    /// Whether requests are in flight (the reactor then waits on [`Poller::event_fd`]).
    fn busy(&self) -> bool;
    /// An eventfd that becomes readable when completions arrive.
    fn event_fd(&self) -> RawFd;
    /// Resets the eventfd after it fired.
    fn clear_event(&self);
}

/// Size of each reactor's io_uring submission queue.
pub const RING_ENTRIES: u32 = 1024;
/// Sparse registered-file slots per ring.
const FIXED_FILES: u32 = 64;
/// Ring-user id reserved for the reactor's own SQEs (poller wake-ups).
const INTERNAL_USER: u64 = 0x7fff;
/// An SQE's user data: bit 63 marks a storage request ([`Core::push_storage_sqe`]), bits
/// 48..63 name the ring user, the rest is the user's cookie.
const USER_SHIFT: u32 = 48;
const USER_MASK: u64 = 0x7fff;
const STORAGE_BIT: u64 = 1 << 63;
const COOKIE_MASK: u64 = (1 << USER_SHIFT) - 1;
/// Completion coalescing waits for at most this many storage completions at once.
const COALESCE_MAX_WANT: u64 = 16;
/// Completion coalescing's window: how long a reactor waits for a quarter of its storage
/// requests before it takes whatever has completed. Measured on 4 KiB reads and writes at
/// iodepth 8 and 32 through a loop device: 3-10 us gained most, 15 us and more lost at
/// iodepth 8 (BENCHMARKS.md, "Completion coalescing").
pub const COALESCE_WINDOW_US: u32 = 10;
/// CQEs copied out of the ring per step while reaping.
const REAP_CHUNK: usize = 64;
/// `IORING_ENTER_GETEVENTS`.
const ENTER_GETEVENTS: u32 = 1;

/// A completion waiting in the FIFO.
#[derive(Clone, Copy)]
struct Done {
    sink: SinkId,
    status: IoStatus,
    token: u64,
}

struct PollerSlot {
    poller: Rc<dyn Poller>,
    armed: Cell<bool>,
    woken: Cell<bool>,
}

/// A timer in the reactor's min-heap: ordered by deadline, then by insertion.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Timer {
    deadline_ns: u64,
    seq: u64,
    sink: u32,
    token: u64,
}

/// Reactor-loop counters, for reports and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoopStats {
    /// Passes through the loop.
    pub passes: u64,
    /// `io_uring_enter` calls that submitted or waited.
    pub enters: u64,
    /// Blocking waits.
    pub waits: u64,
    /// Reap calls that found nothing.
    pub empty_reaps: u64,
}

/// The state a reactor shares with the queues and sinks opened on it.
pub struct Core {
    // Field order matters on drop: sinks and users (which may own fds and buffers used by
    // in-flight SQEs) go before the ring only after the reactor has drained; see Reactor.
    clock: Clock,
    switches: Switches,
    fifo: RefCell<VecDeque<Done>>,
    sinks: RefCell<Vec<Option<Rc<dyn Sink>>>>,
    /// Where each registered sink sits (null when free): a completion calls it with no
    /// look-up of the value's place inside its `Rc`.
    /// Only `register_sink` and `unregister_sink` change it, and neither runs while a
    /// completion reads it (the read copies one pointer and ends before the call).
    targets: UnsafeCell<Vec<Option<NonNull<dyn Sink>>>>,
    free_sinks: RefCell<Vec<u32>>,
    /// Unregistered sinks, kept alive until the reactor's next pass: a sink may be
    /// unregistered from inside a completion that is still running on it.
    retired: RefCell<Vec<Rc<dyn Sink>>>,
    ring_users: RefCell<Vec<Rc<dyn RingUser>>>,
    pollers: RefCell<Vec<Rc<PollerSlot>>>,
    timers: RefCell<BinaryHeap<Reverse<Timer>>>,
    timer_seq: Cell<u64>,
    fixed_files: RefCell<Vec<Option<RawFd>>>,
    ring_queued: Cell<u32>,
    ring_in_flight: Cell<u64>,
    /// Storage requests among `ring_in_flight` (reads and writes of files and devices,
    /// which complete on their own soon, unlike a receive on an idle socket).
    storage_in_flight: Cell<u64>,
    /// Completion coalescing window in microseconds (0: off); see `Core::coalesced_want`.
    coalesce_us: u32,
    /// Whether the kernel honours a minimum wait (`IORING_FEAT_MIN_TIMEOUT`, 6.12).
    min_timeout: bool,
    stop: Cell<bool>,
    loop_stats: Cell<LoopStats>,
    reap_hist: RefCell<Histogram<u64>>,
    ring: RefCell<IoUring>,
}

impl std::fmt::Display for Switches {
    /// As the command line writes them: `clock=cached reap=eager stats=on flush=batched
    /// dispatch=inline writeback=per-device coalesce=on`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::{ClockMode, FlushMode, StatsMode};
        write!(
            f,
            "clock={} reap={} stats={} flush={} dispatch={} writeback={} coalesce={}",
            match self.clock {
                ClockMode::Cached => "cached",
                ClockMode::Precise => "precise",
            },
            match self.reap {
                ReapMode::Eager => "eager",
                ReapMode::Lazy => "lazy",
            },
            match self.stats {
                StatsMode::On => "on",
                StatsMode::Off => "off",
            },
            match self.flush {
                FlushMode::Batched => "batched",
                FlushMode::Serial => "serial",
            },
            match self.dispatch {
                DispatchMode::Inline => "inline",
                DispatchMode::Handoff => "handoff",
            },
            match self.writeback {
                WritebackMode::PerDevice => "per-device",
                WritebackMode::Shared => "shared",
            },
            match self.coalesce {
                CoalesceMode::On => "on",
                CoalesceMode::Off => "off",
            },
        )
    }
}

impl Core {
    /// The reactor's clock.
    #[inline]
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Current time per the clock mode.
    #[inline]
    pub fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// The switches this reactor runs with.
    #[inline]
    pub fn switches(&self) -> Switches {
        self.switches
    }

    /// Registers a sink; completions for `SinkId` go to it until it is unregistered.
    pub fn register_sink(&self, sink: Rc<dyn Sink>) -> SinkId {
        let mut sinks = self.sinks.borrow_mut();
        // SAFETY: see `targets`; nothing else borrows it during this call.
        let targets = unsafe { &mut *self.targets.get() };
        let target = NonNull::new(Rc::as_ptr(&sink).cast_mut());
        if let Some(i) = self.free_sinks.borrow_mut().pop() {
            sinks[i as usize] = Some(sink);
            targets[i as usize] = target;
            SinkId(i)
        } else {
            sinks.push(Some(sink));
            targets.push(target);
            SinkId(sinks.len() as u32 - 1)
        }
    }

    /// Unregisters a sink (it must have nothing in flight).
    pub fn unregister_sink(&self, id: SinkId) {
        let mut sinks = self.sinks.borrow_mut();
        if let Some(slot) = sinks.get_mut(id.0 as usize) {
            if let Some(sink) = slot.take() {
                // SAFETY: see `targets`.
                unsafe { (&mut *self.targets.get())[id.0 as usize] = None };
                self.free_sinks.borrow_mut().push(id.0);
                self.retired.borrow_mut().push(sink);
            }
        }
    }

    /// Queues a completion for delivery on this reactor's next pass.
    #[inline]
    pub fn complete(&self, sink: SinkId, token: u64, status: IoStatus) {
        self.fifo.borrow_mut().push_back(Done {
            sink,
            status,
            token,
        });
    }

    /// Delivers a completion now, by calling the sink directly.
    ///
    /// Only for code that is itself running as a completion (a stacked device finishing
    /// its parent request from a member's completion): it saves a FIFO hop per stack
    /// level. Never call it from `submit`; the recursion it allows is bounded by the depth
    /// of the device stack.
    #[inline]
    pub fn deliver(&self, sink: SinkId, token: u64, status: IoStatus) {
        match self.sink_ptr(sink) {
            // SAFETY: the table owns the sink, and one taken out of it is retired, not
            // dropped, until the reactor's next pass, which runs no completion; so the
            // sink outlives this call even if it unregisters itself meanwhile.
            Some(target) => unsafe { (*target).io_done(token, status) },
            None => debug_assert!(false, "completion for unregistered sink {sink:?}"),
        }
    }

    /// The registered sink `id`, without taking a reference count per completion.
    #[inline]
    fn sink_ptr(&self, id: SinkId) -> Option<*const dyn Sink> {
        // SAFETY: see `targets`; the reference ends before any sink runs.
        unsafe { &*self.targets.get() }
            .get(id.0 as usize)
            .copied()
            .flatten()
            .map(|p| p.as_ptr().cast_const())
    }

    /// Registers a user of the io_uring; returns the id its SQEs carry.
    pub fn register_ring_user(&self, user: Rc<dyn RingUser>) -> Result<u16, Error> {
        let mut users = self.ring_users.borrow_mut();
        if users.len() as u64 >= INTERNAL_USER {
            return Err(Error::Invalid("too many devices on one reactor".into()));
        }
        users.push(user);
        Ok(users.len() as u16 - 1)
    }

    /// Registers `fd` in the ring's fixed-file table, if a slot is free.
    pub fn register_file(&self, fd: RawFd) -> Option<u32> {
        let mut files = self.fixed_files.borrow_mut();
        let slot = files.iter().position(Option::is_none)?;
        let ring = self.ring.borrow();
        match ring.submitter().register_files_update(slot as u32, &[fd]) {
            Ok(_) => {
                files[slot] = Some(fd);
                Some(slot as u32)
            }
            Err(_) => None,
        }
    }

    /// Releases a fixed-file slot taken by [`Core::register_file`].
    pub fn unregister_file(&self, slot: u32) {
        let mut files = self.fixed_files.borrow_mut();
        if let Some(entry) = files.get_mut(slot as usize) {
            let ring = self.ring.borrow();
            let _ = ring.submitter().register_files_update(slot, &[-1]);
            *entry = None;
        }
    }

    /// Registers a poller (an aio context) with this reactor.
    pub fn register_poller(&self, poller: Rc<dyn Poller>) {
        self.pollers.borrow_mut().push(Rc::new(PollerSlot {
            poller,
            armed: Cell::new(false),
            woken: Cell::new(false),
        }));
    }

    /// Queues an SQE in the plug. `user` and `cookie` route its completion back.
    ///
    /// # Safety
    /// Whatever the SQE points at (buffers, the fd) must stay valid until its completion
    /// has been delivered to `user`.
    #[inline]
    pub unsafe fn push_sqe(&self, user: u16, cookie: u64, entry: squeue::Entry) {
        debug_assert!(cookie <= COOKIE_MASK);
        let entry = entry.user_data((u64::from(user) << USER_SHIFT) | cookie);
        // SAFETY: the caller's promise, passed on.
        unsafe { self.push_raw(entry) };
    }

    /// [`Core::push_sqe`] for a storage request: a read, write, sync or the like on a file
    /// or device, which completes on its own within a device's latency. The reactor counts
    /// these to size its waits (completion coalescing). Such an SQE cannot be cancelled
    /// with [`Core::cancel_sqe`].
    ///
    /// # Safety
    /// As for [`Core::push_sqe`].
    #[inline]
    pub unsafe fn push_storage_sqe(&self, user: u16, cookie: u64, entry: squeue::Entry) {
        debug_assert!(cookie <= COOKIE_MASK);
        let entry = entry.user_data(STORAGE_BIT | (u64::from(user) << USER_SHIFT) | cookie);
        self.storage_in_flight.set(self.storage_in_flight.get() + 1);
        // SAFETY: the caller's promise, passed on.
        unsafe { self.push_raw(entry) };
    }

    /// Asks the kernel to cancel the SQE that `user` pushed with `cookie`: if it has not
    /// completed yet, it completes with `-ECANCELED`. The cancellation's own completion
    /// goes to `user` with `cancel_cookie`.
    pub fn cancel_sqe(&self, user: u16, cookie: u64, cancel_cookie: u64) {
        debug_assert!(cookie <= COOKIE_MASK && cancel_cookie <= COOKIE_MASK);
        let target = (u64::from(user) << USER_SHIFT) | cookie;
        let entry = opcode::AsyncCancel::new(target)
            .build()
            .user_data((u64::from(user) << USER_SHIFT) | cancel_cookie);
        // SAFETY: a cancellation refers to no memory and no descriptor.
        unsafe { self.push_raw(entry) };
    }

    unsafe fn push_raw(&self, entry: squeue::Entry) {
        let mut ring = self.ring.borrow_mut();
        // SAFETY: the caller keeps the SQE's resources alive until completion.
        if unsafe { ring.submission().push(&entry) }.is_err() {
            // The plug is full: hand the batch to the kernel now, as a block plug
            // flushes when it reaches its request limit.
            self.enter(&ring, 0, false, None);
            // SAFETY: as above; the queue has room after the submit.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                // The kernel did not take any SQE (out of memory): try once more after
                // letting completions drain; this cannot loop forever because the ring
                // only holds our own requests.
                self.enter(&ring, 1, true, None);
                // SAFETY: as above.
                let _ = unsafe { ring.submission().push(&entry) };
            }
        }
        self.ring_queued.set(self.ring_queued.get() + 1);
        self.ring_in_flight.set(self.ring_in_flight.get() + 1);
    }

    /// Adds a timer: `sink` gets `io_done(token, OK)` once the clock passes `deadline_ns`.
    pub fn add_timer(&self, deadline_ns: u64, sink: SinkId, token: u64) {
        let seq = self.timer_seq.get();
        self.timer_seq.set(seq + 1);
        self.timers.borrow_mut().push(Reverse(Timer {
            deadline_ns,
            seq,
            sink: sink.0,
            token,
        }));
    }

    /// Asks the reactor to return from [`Reactor::run`] after the current pass.
    pub fn stop(&self) {
        self.stop.set(true);
    }

    /// Loop counters so far.
    pub fn loop_stats(&self) -> LoopStats {
        self.loop_stats.get()
    }

    /// Histogram of how many completions each non-empty reap found.
    pub fn reap_histogram(&self) -> Histogram<u64> {
        self.reap_hist.borrow().clone()
    }

    fn bump(&self, f: impl FnOnce(&mut LoopStats)) {
        let mut s = self.loop_stats.get();
        f(&mut s);
        self.loop_stats.set(s);
    }

    /// One `io_uring_enter`: submits what is queued and waits for `want` completions (or
    /// until `timeout_ns`). With `collect`, completions that are ready are posted to the
    /// CQ even when `want` is 0 (on a DEFER_TASKRUN ring they are otherwise held back
    /// until the next wait).
    fn enter(&self, ring: &IoUring, want: usize, collect: bool, timeout_ns: Option<u64>) {
        self.bump(|s| {
            s.enters += 1;
            if want > 0 {
                s.waits += 1;
            }
        });
        let res = match timeout_ns {
            Some(ns) if want > 0 => {
                let ts = types::Timespec::new()
                    .sec(ns / 1_000_000_000)
                    .nsec((ns % 1_000_000_000) as u32);
                let (want, min_wait_us) = self.coalesced_want(want);
                let args = types::SubmitArgs::new()
                    .timespec(&ts)
                    .min_wait_usec(min_wait_us);
                ring.submitter().submit_with_args(want, &args)
            }
            _ if want == 0 && collect => {
                // SAFETY: plain io_uring_enter on our own ring with no argument pointer;
                // the count is what we queued since the last enter.
                unsafe {
                    ring.submitter().enter::<libc::sigset_t>(
                        self.ring_queued.get(),
                        0,
                        ENTER_GETEVENTS,
                        None,
                    )
                }
            }
            _ => ring.submitter().submit_and_wait(want),
        };
        match res {
            Ok(_) => self.ring_queued.set(0),
            // Timed out, interrupted or busy: what was queued may or may not be taken;
            // the SQ head tells, and the next enter submits the rest.
            Err(_) => {
                // SAFETY: only this thread touches the ring (it is not Send).
                let mut sq = unsafe { ring.submission_shared() };
                sq.sync();
                self.ring_queued.set(sq.len() as u32);
            }
        }
    }

    /// Completion coalescing (`--coalesce on`): a wait for one completion while eight or
    /// more storage requests are in flight waits for a quarter of them instead (at most
    /// 16), or for [`COALESCE_WINDOW_US`] and then for any one. Every completion that
    /// wakes a sleeping reactor costs the CPU completing it a cross-CPU wake-up (an IPI;
    /// on a guest, an exit to the host), and that CPU is the busy one: with 32 reads in
    /// flight on a loop device, the wake-ups took a sixth of the machine. Coalesced, the
    /// completions only queue their task work and the reactor wakes on its own timer or
    /// on the quarter's last. Returns the count to wait for and the minimum wait in
    /// microseconds (the kernel's `min_wait_usec`, Linux 6.12; older kernels get the
    /// plain wait).
    #[inline]
    fn coalesced_want(&self, want: usize) -> (usize, u32) {
        let window = self.coalesce_us;
        let quarter = self.storage_in_flight.get() / 4;
        if want != 1 || window == 0 || !self.min_timeout || quarter < 2 {
            return (want, 0);
        }
        (quarter.min(COALESCE_MAX_WANT) as usize, window)
    }

    /// Delivers the completions that were queued when the pass began.
    fn run_fifo(&self) -> usize {
        let n = self.fifo.borrow().len();
        for _ in 0..n {
            let Some(done) = self.fifo.borrow_mut().pop_front() else {
                break;
            };
            match self.sink_ptr(done.sink) {
                // SAFETY: as in `deliver`.
                Some(sink) => unsafe { (*sink).io_done(done.token, done.status) },
                None => debug_assert!(false, "completion for unregistered sink {:?}", done.sink),
            }
        }
        n
    }

    /// Moves due timers to the FIFO (they run with this pass's completions).
    fn fire_timers(&self) {
        let now = self.clock.now_ns();
        let mut timers = self.timers.borrow_mut();
        while timers.peek().is_some_and(|t| t.0.deadline_ns <= now) {
            let Some(Reverse(t)) = timers.pop() else {
                break;
            };
            self.fifo.borrow_mut().push_back(Done {
                sink: SinkId(t.sink),
                status: IoStatus::OK,
                token: t.token,
            });
        }
    }

    fn next_timer_ns(&self) -> Option<u64> {
        self.timers.borrow().peek().map(|t| t.0.deadline_ns)
    }

    /// Hands queued requests to the kernel: aio contexts first, then the ring. With
    /// `collect` (eager reaping) the same system call also posts whatever has completed.
    fn unplug(&self, want: usize, collect: bool, timeout_ns: Option<u64>) {
        for slot in self.pollers.borrow().iter() {
            slot.poller.unplug();
        }
        if self.ring_queued.get() > 0 || want > 0 {
            let ring = self.ring.borrow();
            self.enter(&ring, want, collect, timeout_ns);
        }
    }

    fn unplug_pollers(&self) {
        for slot in self.pollers.borrow().iter() {
            slot.poller.unplug();
        }
    }

    /// Collects completions from aio contexts: every one if `all`, else the woken ones.
    fn reap_pollers(&self, all: bool) -> usize {
        let mut total = 0;
        // Index, don't clone the list: this runs once per pass and must not allocate.
        let count = self.pollers.borrow().len();
        for i in 0..count {
            let slot = self.pollers.borrow()[i].clone();
            if all || slot.woken.get() {
                if slot.woken.replace(false) {
                    slot.poller.clear_event();
                }
                total += slot.poller.reap();
            }
        }
        total
    }

    /// Collects completions from the ring (and, if `pollers`, from every aio context).
    fn reap(&self, pollers: bool) -> usize {
        let mut total = 0;
        let mut batch = [(0u64, 0i32); REAP_CHUNK];
        loop {
            let n = {
                let mut ring = self.ring.borrow_mut();
                let mut n = 0;
                for cqe in ring.completion().take(REAP_CHUNK) {
                    batch[n] = (cqe.user_data(), cqe.result());
                    n += 1;
                }
                n
            };
            for &(data, res) in &batch[..n] {
                self.ring_in_flight
                    .set(self.ring_in_flight.get().saturating_sub(1));
                if data & STORAGE_BIT != 0 {
                    debug_assert!(self.storage_in_flight.get() > 0, "storage count underflow");
                    self.storage_in_flight
                        .set(self.storage_in_flight.get().saturating_sub(1));
                }
                let user = (data >> USER_SHIFT) & USER_MASK;
                let cookie = data & COOKIE_MASK;
                if user == INTERNAL_USER {
                    self.poller_woken(cookie as usize);
                } else {
                    let target = self.ring_users.borrow().get(user as usize).cloned();
                    if let Some(target) = target {
                        target.ring_complete(cookie, res);
                        total += 1;
                    }
                }
            }
            if n < REAP_CHUNK {
                break;
            }
        }
        total += self.reap_pollers(pollers);
        self.record_reap(total);
        total
    }

    /// Counts one reap call that found `n` completions.
    fn record_reap(&self, n: usize) {
        if n > 0 {
            self.reap_hist.borrow_mut().saturating_record(n as u64);
        } else {
            self.bump(|s| s.empty_reaps += 1);
        }
    }

    fn poller_woken(&self, index: usize) {
        if let Some(slot) = self.pollers.borrow().get(index) {
            slot.armed.set(false);
            slot.woken.set(true);
        }
    }

    /// Arms a one-shot poll on the eventfd of every busy poller, so that the blocking wait
    /// in the ring also wakes for aio completions.
    fn arm_pollers(&self) -> bool {
        let mut any = false;
        let count = self.pollers.borrow().len();
        for i in 0..count {
            let slot = self.pollers.borrow()[i].clone();
            if !slot.poller.busy() {
                continue;
            }
            any = true;
            if !slot.armed.replace(true) {
                let entry =
                    opcode::PollAdd::new(types::Fd(slot.poller.event_fd()), libc::POLLIN as u32)
                        .build()
                        .user_data((INTERNAL_USER << USER_SHIFT) | i as u64);
                // SAFETY: the eventfd belongs to the poller, which the reactor keeps
                // registered (and so alive) until the ring is dropped.
                unsafe { self.push_raw(entry) };
            }
        }
        any
    }

    /// Whether anything could still complete or fire.
    fn has_work(&self) -> bool {
        self.ring_in_flight.get() > 0
            || !self.timers.borrow().is_empty()
            || self.pollers.borrow().iter().any(|s| s.poller.busy())
    }
}

/// Blocks every asynchronous signal in the calling thread. Worker threads call it first,
/// so that SIGTERM and its kind reach the thread that waits for them (`cairn serve`'s main
/// thread), never a worker that would die of the default action.
pub fn block_signals_in_this_thread() {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::all();
    // Faults stay deliverable: blocked, they would kill the process without a trace.
    for s in [
        Signal::SIGSEGV,
        Signal::SIGBUS,
        Signal::SIGFPE,
        Signal::SIGILL,
        Signal::SIGABRT,
    ] {
        set.remove(s);
    }
    // Blocking signals in one's own thread fails only for a bad `how`, which this is not.
    let _ = set.thread_block();
}

/// Runs `f` with every asynchronous signal blocked in this thread, then puts the mask
/// back: threads that `f` starts (a C library's own, such as librados' messengers)
/// inherit the blocked mask and never take a SIGTERM meant for `cairn serve`'s main thread.
pub fn with_signals_blocked<T>(f: impl FnOnce() -> T) -> T {
    let old = nix::sys::signal::SigSet::thread_get_mask().ok();
    block_signals_in_this_thread();
    let out = f();
    if let Some(old) = old {
        let _ = old.thread_set_mask();
    }
    out
}

/// Longest a reactor blocks without a timer (it then looks at its stop flag again).
const IDLE_WAIT_NS: u64 = 100_000_000;

/// A per-thread event loop. Create it on the thread that runs it.
pub struct Reactor {
    core: Rc<Core>,
    /// Before sleeping, keep collecting completions this long (0: sleep at once).
    idle_poll_ns: Cell<u64>,
    /// Sleeps left to take without polling first, after polls that found nothing.
    poll_skip: Cell<u32>,
    /// What a poll that finds nothing costs in skipped polls (doubles each time).
    poll_penalty: Cell<u32>,
}

impl Reactor {
    /// A reactor with its own io_uring.
    pub fn new(switches: Switches) -> Result<Reactor, Error> {
        // As fio does: completions run as deferred task work in our own io_uring_enter
        // (no interrupts of the reactor, no cross-CPU wake-ups), and only this thread
        // submits. Kernels before 6.1 refuse the flags; they get a plain ring.
        let ring = IoUring::builder()
            .setup_cqsize(RING_ENTRIES * 4)
            .setup_coop_taskrun()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(RING_ENTRIES)
            .or_else(|_| {
                IoUring::builder()
                    .setup_cqsize(RING_ENTRIES * 4)
                    .build(RING_ENTRIES)
            })
            .map_err(|e| Error::os("create io_uring", e))?;
        ring.submitter()
            .register_files_sparse(FIXED_FILES)
            .map_err(|e| Error::os("register io_uring file table", e))?;
        let core = Core {
            clock: Clock::new(switches.clock),
            switches,
            fifo: RefCell::new(VecDeque::with_capacity(RING_ENTRIES as usize)),
            sinks: RefCell::new(Vec::new()),
            targets: UnsafeCell::new(Vec::new()),
            free_sinks: RefCell::new(Vec::new()),
            retired: RefCell::new(Vec::new()),
            ring_users: RefCell::new(Vec::new()),
            pollers: RefCell::new(Vec::new()),
            timers: RefCell::new(BinaryHeap::with_capacity(RING_ENTRIES as usize)),
            timer_seq: Cell::new(0),
            fixed_files: RefCell::new(vec![None; FIXED_FILES as usize]),
            ring_queued: Cell::new(0),
            ring_in_flight: Cell::new(0),
            storage_in_flight: Cell::new(0),
            coalesce_us: match switches.coalesce {
                CoalesceMode::On => COALESCE_WINDOW_US,
                CoalesceMode::Off => 0,
            },
            min_timeout: ring.params().is_feature_min_timeout(),
            stop: Cell::new(false),
            loop_stats: Cell::new(LoopStats::default()),
            reap_hist: RefCell::new(
                Histogram::new_with_max(1 << 20, 3).expect("valid histogram bounds"),
            ),
            ring: RefCell::new(ring),
        };
        Ok(Reactor {
            core: Rc::new(core),
            idle_poll_ns: Cell::new(0),
            poll_skip: Cell::new(0),
            poll_penalty: Cell::new(0),
        })
    }

    /// The shared core, for opening queues and registering sinks.
    pub fn core(&self) -> &Rc<Core> {
        &self.core
    }

    /// Idle polling: before the reactor sleeps, it keeps collecting completions for up to
    /// `ns` (one non-blocking `io_uring_enter` after another). A request that arrives
    /// meanwhile is served without a sleep and a wake-up, which on a socket is most of a
    /// round trip's latency; the price is up to `ns` of CPU after each burst of work.
    ///
    /// A poll that finds nothing makes the reactor skip polling before its next sleeps
    /// (1, 2, 4, ... up to 256): when completions take longer than the window (or need
    /// the CPU the poll would burn, like io_uring's workers on a small machine), polling
    /// stops paying and stops.
    pub fn set_idle_poll(&self, ns: u64) {
        self.idle_poll_ns.set(ns);
    }

    /// Runs until [`Core::stop`] is called.
    pub fn run(&self) {
        let core = &*self.core;
        core.stop.set(false);
        while !core.stop.get() {
            core.release_retired();
            core.clock.refresh();
            core.bump(|s| s.passes += 1);
            core.fire_timers();
            core.run_fifo();
            if core.stop.get() {
                break;
            }
            let idle = core.fifo.borrow().is_empty();
            match core.switches.reap {
                ReapMode::Eager => {
                    // aio contexts first: io_submit, then their user-space rings (free).
                    core.unplug_pollers();
                    let found = core.reap_pollers(true);
                    core.record_reap(found);
                    if idle && found == 0 && core.fifo.borrow().is_empty() {
                        // Nothing else to do: submit and wait in one io_uring_enter, which
                        // returns at once if anything has already completed.
                        self.block();
                        core.reap(true);
                    } else {
                        // Work is waiting: submit and collect what is ready, never sleep.
                        core.unplug(0, true, None);
                        core.reap(true);
                    }
                }
                ReapMode::Lazy => {
                    // Completions are collected only by the wait, once nothing else is left.
                    if idle {
                        self.block();
                        core.reap(false);
                    } else {
                        core.unplug(0, false, None);
                    }
                }
            }
        }
        // Whatever was queued in the plug still goes to the kernel.
        core.unplug(0, false, None);
    }

    /// Unplugs and waits for one completion, a poller wake-up or the next timer.
    fn block(&self) {
        let core = &*self.core;
        core.arm_pollers();
        if !core.has_work() && core.fifo.borrow().is_empty() {
            // Nothing can complete: do not sleep forever, let the caller look again.
            core.unplug(0, false, None);
            std::thread::sleep(std::time::Duration::from_millis(1));
            return;
        }
        let spin = self.idle_poll_ns.get();
        if spin > 0 {
            if self.poll_skip.get() > 0 {
                self.poll_skip.set(self.poll_skip.get() - 1);
            } else if core.poll_for_completions(spin) {
                self.poll_penalty.set(0);
                core.clock.refresh();
                return;
            } else {
                let p = (self.poll_penalty.get() * 2).clamp(1, 256);
                self.poll_penalty.set(p);
                self.poll_skip.set(p);
            }
        }
        let now = crate::clock::monotonic_ns();
        let timeout = match core.next_timer_ns() {
            Some(deadline) => deadline.saturating_sub(now).min(IDLE_WAIT_NS),
            None => IDLE_WAIT_NS,
        };
        if timeout == 0 {
            core.unplug(0, true, None);
        } else {
            core.unplug(1, true, Some(timeout));
        }
        core.clock.refresh();
    }

    /// Runs until every completion already queued or in flight has been delivered, or
    /// `deadline_ns` passes; for tests and orderly shutdown.
    pub fn drain(&self, deadline_ns: u64) -> bool {
        let core = &*self.core;
        loop {
            core.release_retired();
            core.clock.refresh();
            core.fire_timers();
            core.run_fifo();
            core.unplug(0, true, None);
            core.reap(true);
            let quiet = core.fifo.borrow().is_empty()
                && core.ring_in_flight.get() == core.armed_polls()
                && !core.pollers.borrow().iter().any(|s| s.poller.busy());
            if quiet {
                // Nothing of ours is in flight, so no storage request either: the count
                // that sizes coalesced waits has come back to zero.
                debug_assert_eq!(core.storage_in_flight.get(), 0, "storage count leaked");
                return true;
            }
            if crate::clock::monotonic_ns() > deadline_ns {
                return false;
            }
            if core.fifo.borrow().is_empty() {
                self.block();
                core.reap(true);
            }
        }
    }
}

impl Core {
    /// Submits what is queued and collects completions without sleeping, again and again
    /// for up to `ns` or until one is ready; whether one is.
    fn poll_for_completions(&self, ns: u64) -> bool {
        let end = crate::clock::monotonic_ns() + ns;
        loop {
            {
                let ring = self.ring.borrow();
                self.enter(&ring, 0, true, None);
            }
            if !self.ring.borrow_mut().completion().is_empty() {
                return true;
            }
            if crate::clock::monotonic_ns() >= end {
                return false;
            }
            std::hint::spin_loop();
        }
    }

    /// Drops unregistered sinks; only between passes, when no completion is running.
    #[inline]
    fn release_retired(&self) {
        if !self.retired.borrow().is_empty() {
            self.retired.borrow_mut().clear();
        }
    }

    fn armed_polls(&self) -> u64 {
        self.pollers
            .borrow()
            .iter()
            .filter(|s| s.armed.get())
            .count() as u64
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        // Break the reference cycles sinks and ring users hold through `Rc<Core>`.
        // SAFETY: see `targets`; no completion is running while the reactor drops.
        unsafe { (*self.core.targets.get()).clear() };
        self.core.sinks.borrow_mut().clear();
        self.core.retired.borrow_mut().clear();
        self.core.pollers.borrow_mut().clear();
        self.core.ring_users.borrow_mut().clear();
    }
}
