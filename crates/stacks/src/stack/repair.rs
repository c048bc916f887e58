//! Read repair of a mirror or raid10: a range that failed to read on one copy, and was
//! then read from another, is rewritten on the copy that failed, once, with good data (as
//! md does). A disk remaps a bad sector when it is written, so the rewrite usually heals
//! it; if the rewrite fails too, the member is failed as a failed client write fails it.
//!
//! The client never waits for a repair: its read is answered from the copy that worked,
//! and the queue only notes the range ([`Repairs::request`], on the cold path of a read
//! that was retried). The array's repair thread does the rest off the reactors, with
//! blocking queues of its own, as the rebuild does. It does not write the client's
//! buffer (the client owns it again once answered): it reads the range again from a
//! good copy into a buffer of its own, and writes that.
//!
//! Ordering against client writes: a repair writes data it read, so a client write to
//! the same range must never land on the member between that read and the repair's write
//! (the repair would put the older data back over it, on that copy only: the copies
//! would differ, and a later read could return either). The repair therefore holds its
//! range against writes ([`WriteCounts::hold`]) for the whole read-and-write:
//!
//! - While repairs are pending, every write to the array is counted per region, as while
//!   a rebuild runs ([`WriteCounts::start`]). When counting starts, writes already in
//!   flight were not counted: the thread waits for all of them to end first
//!   ([`Health::switch`], which every queue of a redundant array counts its writes for).
//! - A hold is taken only when no counted write to the range is in flight, and a counted
//!   write that finds its range held is not sent: it waits, on its own reactor (a timer,
//!   never a sleeping thread), until the hold is let go. Writes count themselves before
//!   they look for a hold and the repair holds before it looks at the counts, both in
//!   one total order, so one of the two always sees the other.
//!
//! So the data a repair writes is the current data when it lands, and no copy is ever
//! older than another because of a repair. Reads are not held: the member being repaired
//! holds current data throughout, apart from the blocks that fail to read.
//!
//! [`WriteCounts::hold`]: super::rebuild::WriteCounts::hold
//! [`WriteCounts::start`]: super::rebuild::WriteCounts::start

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cairn_core::blocking::{BlockingError, BlockingQueue};
use cairn_core::stats::RepairCounters;
use cairn_core::{Device, IoFlags, IoStatus, Switches};

use super::{AnyLayout, Health, Layout};
use crate::array::Metadata;

/// Most repairs waiting at once; a failed read past that is only retried elsewhere.
const PENDING_MAX: usize = 1024;
/// How long a repair waits for writes to its range to pause before it gives up (the
/// next failed read there asks again).
const QUIET_WAIT: Duration = Duration::from_secs(10);
/// How often it looks for that pause.
const QUIET_POLL: Duration = Duration::from_micros(200);
/// After a member's first repair (logged), at most one line per member this often.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// A range to rewrite on one member.
#[derive(Clone)]
pub(super) struct Pending {
    /// The member (`0..n`).
    pub member: usize,
    /// The member's device the read failed on: if another took its place since, the
    /// repair is dropped.
    pub device: Arc<dyn Device>,
    /// Array offset of the range.
    pub logical: u64,
    /// Its length.
    pub len: u64,
    /// Its offset in the member's data area.
    pub at: u64,
}

impl Pending {
    /// Whether `self` covers `other`'s range on the same member.
    fn covers(&self, other: &Pending) -> bool {
        self.member == other.member
            && self.at <= other.at
            && other.at + other.len <= self.at + self.len
    }
}

/// What the repair thread needs of its array.
pub(super) struct Job {
    pub name: String,
    pub layout: Arc<AnyLayout>,
    pub health: Arc<Health>,
    pub metadata: Option<Arc<Metadata>>,
    pub data_offset: u64,
}

/// An array's read repairs: those pending, the thread that does them, and their counts.
pub(super) struct Repairs {
    /// Waiting or being done (removed once done); at most [`PENDING_MAX`].
    pending: Mutex<Vec<Pending>>,
    wake: Condvar,
    stop: AtomicBool,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Totals, also in the statistics registry (for the metrics endpoint).
    pub(super) counters: Arc<RepairCounters>,
    /// Per member: ranges rewritten, and rewrites that failed.
    pub(super) repaired: Box<[AtomicU64]>,
    pub(super) failed: Box<[AtomicU64]>,
    /// Whether dropping a repair for want of room was logged.
    full_told: AtomicBool,
}

impl Repairs {
    /// No repair yet, for an array of `n` members.
    pub(super) fn new(n: usize) -> Repairs {
        Repairs {
            pending: Mutex::new(Vec::new()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
            counters: Arc::new(RepairCounters::default()),
            repaired: (0..n).map(|_| AtomicU64::new(0)).collect(),
            failed: (0..n).map(|_| AtomicU64::new(0)).collect(),
            full_told: AtomicBool::new(false),
        }
    }

    /// Notes a range to rewrite (from a queue, after the read was answered from another
    /// copy); starts the repair thread with `job` if it does not run. A range already
    /// pending on the member is not noted twice.
    #[cold]
    pub(super) fn request(&self, p: Pending, job: impl FnOnce() -> Job) {
        if self.stop.load(SeqCst) {
            return;
        }
        {
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            if pending.iter().any(|e| e.covers(&p)) {
                return;
            }
            if pending.len() >= PENDING_MAX {
                if !self.full_told.swap(true, Relaxed) {
                    log::warn!(
                        "cairn: read repair: {PENDING_MAX} ranges wait already; more failed reads are only retried on other copies until they are done"
                    );
                }
                return;
            }
            log::debug!(
                "cairn: read repair: {} bytes at {} of member {} to rewrite",
                p.len,
                p.at,
                p.member
            );
            pending.push(p);
            self.wake.notify_all();
        }
        let mut thread = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        if thread.is_none() && !self.stop.load(SeqCst) {
            let job = job();
            let name = job.name.clone();
            match std::thread::Builder::new()
                .name(format!("cairn-repair-{name}"))
                .spawn(move || run(job))
            {
                Ok(handle) => *thread = Some(handle),
                Err(e) => {
                    log::error!("cairn: {name}: cannot start the read repair thread (failed reads are only retried): {e}");
                    self.pending
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .clear();
                }
            }
        }
    }

    /// Stops the repair thread (between two repairs) and waits for it; no repair starts
    /// after this.
    pub(super) fn stop(&self) {
        self.stop.store(true, SeqCst);
        {
            let _pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }

    /// Ranges waiting or being rewritten now.
    pub(super) fn pending_count(&self) -> usize {
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Removes `p` (done or dropped).
    fn done(&self, p: &Pending) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = pending
            .iter()
            .position(|e| e.member == p.member && e.at == p.at && e.len == p.len)
        {
            pending.swap_remove(i);
        }
    }
}

/// The repair thread: rewrites pending ranges until told to stop.
fn run(job: Job) {
    cairn_core::reactor::block_signals_in_this_thread();
    let health = &job.health;
    let repairs = &health.repairs;
    // Whether writes are counted for repairs, and every write sent before was waited for.
    let mut counting = false;
    let mut logs: Vec<Log> = (0..health.n).map(|_| Log::default()).collect();
    loop {
        let batch = {
            let mut pending = repairs.pending.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if repairs.stop.load(SeqCst) {
                    if counting {
                        health.sync.repairs_off();
                    }
                    return;
                }
                if !pending.is_empty() {
                    break pending.clone();
                }
                if counting {
                    // Nothing to do: writes go uncounted again.
                    health.sync.repairs_off();
                    counting = false;
                }
                pending = repairs
                    .wake
                    .wait(pending)
                    .unwrap_or_else(|e| e.into_inner());
            }
        };
        if !counting {
            // Writes are counted from now on; those already in flight were not: once
            // this returns, none of them is (see `Health::switch`).
            health.sync.repairs_on();
            health.switch(|_, _| {});
            counting = true;
        }
        let mut queues = Queues::default();
        for p in &batch {
            if repairs.stop.load(SeqCst) {
                break;
            }
            repair(&job, &mut queues, p, &mut logs[p.member]);
            repairs.done(p);
        }
    }
}

/// The members' queues on the repair thread, opened when first needed (for one batch).
#[derive(Default)]
struct Queues {
    open: Vec<(usize, Arc<dyn Device>, BlockingQueue)>,
}

impl Queues {
    /// A queue of `device`, member `m`; `None` if it cannot be opened here.
    fn get(&mut self, name: &str, m: usize, device: &Arc<dyn Device>) -> Option<&BlockingQueue> {
        let i = match self
            .open
            .iter()
            .position(|(i, d, _)| *i == m && same(d, device))
        {
            Some(i) => i,
            None => match BlockingQueue::open(device, Switches::default()) {
                Ok(q) => {
                    self.open.push((m, device.clone(), q));
                    self.open.len() - 1
                }
                Err(e) => {
                    log::warn!(
                        "cairn: {name}: read repair: cannot open member '{}' here: {e}",
                        device.name()
                    );
                    return None;
                }
            },
        };
        Some(&self.open[i].2)
    }
}

fn same(a: &Arc<dyn Device>, b: &Arc<dyn Device>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

/// How one rewrite went.
enum Outcome {
    /// Written, with data read from this member.
    Repaired(usize),
    /// No other copy could be read (or the member's queue not opened): not written.
    NotWritten,
    /// The write failed.
    Failed(IoStatus),
}

/// A member's repair log lines: the first at info, then a count at most every
/// [`LOG_EVERY`].
#[derive(Default)]
struct Log {
    last: Option<Instant>,
    unlogged: u64,
}

/// Rewrites one pending range, if its member still takes writes.
fn repair(job: &Job, queues: &mut Queues, p: &Pending, log: &mut Log) {
    let (h, name) = (&job.health, &job.name);
    let member = h.name(p.member);
    if !still_wanted(job, p, &member) || !hold_quiet(job, p, &member) {
        return;
    }
    // Held: no client write to the range is in flight, and none is sent until released.
    let outcome = rewrite(job, queues, p);
    if let Outcome::Failed(status) = outcome {
        // As a failed client write: the member no longer holds good data there. Recorded
        // before the range is let go, so writes that waited for it skip the member.
        h.fail(p.member, status);
        if let (Some(meta), true) = (&job.metadata, p.member < h.n) {
            meta.fail_member(p.member);
        }
    }
    h.sync.release(p.logical, p.len);
    match outcome {
        Outcome::Repaired(source) => repaired(job, p, &member, source, log),
        Outcome::Failed(status) => {
            let repairs = &h.repairs;
            repairs.counters.failed.fetch_add(1, Relaxed);
            repairs.failed[p.member].fetch_add(1, Relaxed);
            log::warn!(
                "cairn: {name}: read repair: rewriting {} bytes at {} on member {member} failed ({status}); the member is failed",
                p.len,
                p.at
            );
        }
        Outcome::NotWritten => log::warn!(
            "cairn: {name}: read repair: {} bytes at {} on member {member} not rewritten: no other copy could be read",
            p.len,
            p.at
        ),
    }
}

/// Whether `p` is still to be rewritten: its member neither failed nor replaced since,
/// and the range not one the resync rewrites anyway.
fn still_wanted(job: &Job, p: &Pending, member: &str) -> bool {
    let (h, name) = (&job.health, &job.name);
    let current = h.devices().get(p.member).cloned().flatten();
    if !h.ok(p.member) || !current.is_some_and(|d| same(&d, &p.device)) {
        // Failed since (it is read no more), or another device took its place.
        log::debug!("cairn: {name}: read repair on {member} dropped: the member changed");
        return false;
    }
    // The copies may differ here until the resync, which rewrites the range from the copy
    // reads come from.
    !h.one_copy_at(p.logical, p.len)
}

/// Holds `p`'s range against writes once none is in flight there; `false` if the
/// thread is told to stop first, or writes never pause for [`QUIET_WAIT`].
fn hold_quiet(job: &Job, p: &Pending, member: &str) -> bool {
    let (h, name) = (&job.health, &job.name);
    let began = Instant::now();
    while !h.sync.hold(p.logical, p.len) {
        if h.repairs.stop.load(SeqCst) {
            return false;
        }
        if began.elapsed() > QUIET_WAIT {
            log::info!(
                "cairn: {name}: read repair of {} bytes at {} on member {member} given up: writes to it never paused for {QUIET_WAIT:?}",
                p.len,
                p.at
            );
            return false;
        }
        std::thread::sleep(QUIET_POLL);
    }
    true
}

/// Counts a range rewritten from member `source`, and logs it: the member's first at
/// info, then a count at most every [`LOG_EVERY`] (the rest at debug).
fn repaired(job: &Job, p: &Pending, member: &str, source: usize, log: &mut Log) {
    let (h, name) = (&job.health, &job.name);
    let repairs = &h.repairs;
    repairs.counters.repaired.fetch_add(1, Relaxed);
    repairs.counters.repaired_bytes.fetch_add(p.len, Relaxed);
    let total = repairs.repaired[p.member].fetch_add(1, Relaxed) + 1;
    match log.last {
        None => log::info!(
            "cairn: {name}: read repair: a read failed on member {member}; {} bytes at {} rewritten there from {} (later repairs are counted in the array's status)",
            p.len,
            p.at,
            h.name(source)
        ),
        Some(t) if t.elapsed() >= LOG_EVERY => log::info!(
            "cairn: {name}: read repair: {} more ranges rewritten on member {member} ({total} in all)",
            log.unlogged + 1
        ),
        Some(_) => {
            log::debug!(
                "cairn: {name}: read repair: {} bytes at {} rewritten on member {member} from {}",
                p.len,
                p.at,
                h.name(source)
            );
            log.unlogged += 1;
            return;
        }
    }
    log.last = Some(Instant::now());
    log.unlogged = 0;
}

/// Reads the range from a current copy other than the member's and writes it to the
/// member. The caller holds the range.
fn rewrite(job: &Job, queues: &mut Queues, p: &Pending) -> Outcome {
    let h = &job.health;
    let devices = h.devices();
    let mut buf = vec![0u8; p.len as usize];
    let mut source = None;
    for k in 0..job.layout.copies() {
        let (g, at) = job.layout.locate(p.logical, k);
        if g == p.member || !h.readable_at(g, p.logical, at, p.len) {
            continue;
        }
        let Some(device) = devices.get(g).cloned().flatten() else {
            continue;
        };
        let Some(q) = queues.get(&job.name, g, &device) else {
            continue;
        };
        if q.read(at + job.data_offset, &mut buf).is_ok() {
            source = Some(g);
            break;
        }
    }
    let Some(source) = source else {
        return Outcome::NotWritten;
    };
    let Some(q) = queues.get(&job.name, p.member, &p.device) else {
        return Outcome::NotWritten;
    };
    match q.write(p.at + job.data_offset, &buf, IoFlags::NONE) {
        Ok(()) => Outcome::Repaired(source),
        Err(BlockingError::Failed(status)) => Outcome::Failed(status),
        Err(BlockingError::Refused(e)) => {
            // Never expected: the range is one the array read from the member.
            log::warn!("cairn: {}: read repair refused: {e}", job.name);
            Outcome::NotWritten
        }
    }
}
