//! Rebuild and resync of a mirror or raid10 with metadata, online, on a thread of its own.
//!
//! A member that is not current (rebuilding, stale, new) is written to by every client
//! write and read by none; the rebuild copies the rest of its data from a current copy,
//! in logical order, in batches of large requests, and then the member is read like the
//! others. After an unclean stop, the resync copies every block from the copy reads come
//! from (the first readable one) to the others, so that the copies agree again.
//!
//! Client writes go on meanwhile. A copy must never put older data over a client's newer
//! write, so writes are counted per region while a rebuild runs ([`WriteCounts`]): the
//! rebuild copies a batch only when no write to its regions is in flight, and copies it
//! again if one started before it finished. Counting costs two atomic additions per
//! write, and only while a rebuild runs (or a read repair is pending, see [`super::repair`],
//! which uses the same counts to hold a range against writes).
//!
//! Progress (bytes done, rate, time left) is logged; each member's checkpoint goes to the
//! superblocks every [`CHECKPOINT_BYTES`], so a rebuild interrupted by a stop resumes
//! from there.

use std::sync::atomic::{
    AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed, Ordering::SeqCst,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_core::blocking::{BlockingQueue, Request};
use cairn_core::{Device, Io, IoFlags, LostWrites, Op, Switches};

use super::{AnyLayout, Health, Layout};
use crate::array::bitmap::Bitmap;
use crate::array::superblock::MemberState;
use crate::array::Metadata;

/// Bytes of the array one write counter covers.
const REGION_BYTES: u64 = 64 << 10;
/// Counters (regions share them modulo this: a shared counter only costs a retry).
const SLOTS: usize = 16384;
/// Most bytes copied in one batch (all in flight together).
const BATCH_BYTES: u64 = 8 << 20;
/// How often the checkpoint goes to the superblocks.
const CHECKPOINT_BYTES: u64 = 256 << 20;

/// Why writes are counted: a rebuild or resync runs.
const BY_REBUILD: u8 = 1;
/// Why writes are counted: read repairs are pending.
const BY_REPAIR: u8 = 2;

/// Writes started and finished per region, while a rebuild runs or read repairs are
/// pending; the ranges repairs hold; and the rebuild's progress.
pub(super) struct WriteCounts {
    /// Who wants writes counted ([`BY_REBUILD`], [`BY_REPAIR`]); none: no counting.
    on: AtomicU8,
    /// Logical bytes done, of `total`, at `rate` bytes a second (for `status`).
    pub(super) done_bytes: AtomicU64,
    pub(super) total_bytes: AtomicU64,
    pub(super) rate: AtomicU64,
    /// Whether it is a resync (else a rebuild).
    pub(super) resync: AtomicBool,
    /// Array offset below which the resync is done (reads there may use any copy).
    pub(super) synced_below: AtomicU64,
    /// Bytes it read and wrote so far.
    pub(super) read_bytes: AtomicU64,
    pub(super) written_bytes: AtomicU64,
    /// Client requests seen while it runs (it slows down to its minimum rate for them).
    clients: AtomicU64,
    started: Box<[AtomicU64]>,
    finished: Box<[AtomicU64]>,
    /// Per slot: read repairs writing there now; a counted write that finds its slot held
    /// waits (see [`WriteCounts::hold`]).
    held: Box<[AtomicU32]>,
}

impl WriteCounts {
    pub(super) fn new() -> WriteCounts {
        WriteCounts {
            on: AtomicU8::new(0),
            done_bytes: AtomicU64::new(0),
            total_bytes: AtomicU64::new(0),
            rate: AtomicU64::new(0),
            resync: AtomicBool::new(false),
            synced_below: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
            written_bytes: AtomicU64::new(0),
            clients: AtomicU64::new(0),
            started: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            finished: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            held: (0..SLOTS).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// Counts a client request, if a rebuild runs.
    #[inline]
    pub(super) fn client(&self, _io: &Io) {
        if self.on.load(Relaxed) & BY_REBUILD != 0 {
            self.clients.fetch_add(1, Relaxed);
        }
    }

    /// Starts counting for a rebuild (before the rebuild starts; writes already in
    /// flight must be waited for, see [`Health::switch`]).
    pub(super) fn on_now(&self) {
        self.on.fetch_or(BY_REBUILD, SeqCst);
    }

    /// Stops counting for a rebuild (no rebuild runs).
    pub(super) fn off(&self) {
        self.on.fetch_and(!BY_REBUILD, SeqCst);
    }

    /// Starts counting for read repairs (writes already in flight must be waited for
    /// before a range is held, even if a rebuild counts: it may have just started).
    pub(super) fn repairs_on(&self) {
        self.on.fetch_or(BY_REPAIR, SeqCst);
    }

    /// Stops counting for read repairs (none is pending).
    pub(super) fn repairs_off(&self) {
        self.on.fetch_and(!BY_REPAIR, SeqCst);
    }

    /// Counts a write that starts, if a rebuild runs or repairs are pending; whether it
    /// was counted (its end must then be counted with [`WriteCounts::done`], and it must
    /// not be sent while [`WriteCounts::held`]).
    #[inline]
    pub(super) fn start(&self, io: &Io) -> bool {
        if self.on.load(Relaxed) == 0 {
            return false;
        }
        for s in slots(io.offset, io.len) {
            self.started[s].fetch_add(1, SeqCst);
        }
        true
    }

    /// Counts the end of a write [`WriteCounts::start`] counted.
    pub(super) fn done(&self, io: &Io) {
        for s in slots(io.offset, io.len) {
            self.finished[s].fetch_add(1, SeqCst);
        }
    }

    /// The finished counts of the slots of `[offset, offset + len)` if no write to them is
    /// in flight.
    fn quiet(&self, offset: u64, len: u64) -> Option<Vec<(usize, u64)>> {
        let mut snap = Vec::new();
        for s in slots(offset, len) {
            let f = self.finished[s].load(SeqCst);
            if self.started[s].load(SeqCst) != f {
                return None;
            }
            snap.push((s, f));
        }
        Some(snap)
    }

    /// Whether a rebuild or resync runs.
    pub(super) fn running(&self) -> bool {
        self.on.load(Relaxed) & BY_REBUILD != 0
    }

    /// Whether a read repair holds a slot of the counted write `io`: it must wait (and
    /// look again) before it is sent. Looked at after [`WriteCounts::start`] counted it:
    /// a repair that holds the slot after this look sees the write in flight and lets go.
    #[inline]
    pub(super) fn held(&self, io: &Io) -> bool {
        slots(io.offset, io.len).any(|s| self.held[s].load(SeqCst) != 0)
    }

    /// Holds the slots of `[offset, offset + len)` for a read repair, if no counted write
    /// to them is in flight; false (nothing held) if one is.
    ///
    /// Both sides count first and look second, in one total order (SeqCst): a write
    /// counted before the hold is seen here (and the hold let go), and one counted after
    /// sees the hold and waits until [`WriteCounts::release`]. So while the range is
    /// held, no counted write to it is in flight on any queue, and none is sent.
    pub(super) fn hold(&self, offset: u64, len: u64) -> bool {
        for s in slots(offset, len) {
            self.held[s].fetch_add(1, SeqCst);
        }
        let quiet = slots(offset, len)
            .all(|s| self.started[s].load(SeqCst) == self.finished[s].load(SeqCst));
        if !quiet {
            self.release(offset, len);
        }
        quiet
    }

    /// Lets go of what [`WriteCounts::hold`] held.
    pub(super) fn release(&self, offset: u64, len: u64) {
        for s in slots(offset, len) {
            self.held[s].fetch_sub(1, SeqCst);
        }
    }

    /// Whether no write started on the slots since `snap` was taken.
    fn unchanged(&self, snap: &[(usize, u64)]) -> bool {
        snap.iter().all(|&(s, f)| self.started[s].load(SeqCst) == f)
    }
}

/// The counter slots of `[offset, offset + len)`: every slot when the range spans more
/// regions than there are slots.
fn slots(offset: u64, len: u64) -> impl Iterator<Item = usize> {
    let first = offset / REGION_BYTES;
    let last = (offset + len.max(1) - 1) / REGION_BYTES;
    let n = (last - first + 1).min(SLOTS as u64);
    (0..n).map(move |i| ((first + i) % SLOTS as u64) as usize)
}

/// What a rebuild thread needs of its array.
pub(super) struct Job {
    pub name: String,
    pub layout: Arc<AnyLayout>,
    pub health: Arc<Health>,
    pub metadata: Arc<Metadata>,
    pub data_offset: u64,
    pub stop: Arc<AtomicBool>,
    pub rate: super::ArrayOptions,
}

/// Whether the array has anything to rebuild, resync or replace.
pub(super) fn needed(health: &Health, states: &[MemberState]) -> bool {
    health.one_copy.load(Relaxed)
        || states
            .iter()
            .enumerate()
            .any(|(m, s)| *s == MemberState::Rebuilding && health.ok(m))
        || (0..health.n).any(|m| health.being_replaced(m))
}

/// Runs the rebuild to its end (or until `stop`, or an error that ends it).
pub(super) fn run(job: Job) {
    let health = job.health.clone();
    run_to_end(job);
    health.sync.off();
}

fn run_to_end(job: Job) {
    cairn_core::reactor::block_signals_in_this_thread();
    // The layout's members, then the replacements being built (`n + m` for member `m`).
    let devices = job.health.devices();
    let queues: Vec<Option<BlockingQueue>> = devices
        .iter()
        .map(|d| {
            d.as_ref()
                .and_then(|d| BlockingQueue::open(d, Switches::default()).ok())
        })
        .collect();
    let plan = Plan::new(&job, &devices);
    announce(&job, &plan);
    let Some(began) = copy_all(&job, &queues, &plan) else {
        return;
    };
    finish(&job, &queues, &plan, &devices, began);
}

/// What a rebuild or resync is to do, worked out from the array's health at its start.
struct Plan {
    /// Bytes of the array.
    size: u64,
    /// Members of the layout (the replacement of member `m` is `n + m`).
    n: usize,
    /// Whether it is a resync (else a rebuild), and the word for it in log lines.
    resync: bool,
    what: &'static str,
    bitmap: Option<Arc<Bitmap>>,
    /// Per member, then per replacement: whether it needs everything (a full rebuild),
    /// or only the bitmap's regions to recover (dirty at start or at a re-add).
    full: Vec<bool>,
    partial: Vec<bool>,
    /// The members rebuilt, whole or in part, and those of them whose checkpoint is
    /// recorded (the layout's members: a replace starts over).
    rebuilding: Vec<usize>,
    recorded: Vec<usize>,
    /// Every member written to.
    targets: Vec<usize>,
    /// Where it starts, and from where every block is visited (below, only the bitmap's
    /// regions to recover).
    start: u64,
    full_from: u64,
    /// Bytes to visit: what progress counts.
    total: u64,
}

impl Plan {
    fn new(job: &Job, devices: &[Option<Arc<dyn Device>>]) -> Plan {
        let health = &job.health;
        let size = job.layout.size_bytes();
        let n = health.n;
        let resync = health.one_copy.load(Relaxed);
        let (full, partial) = members_to_rebuild(health, devices);
        let rebuilding: Vec<usize> = (0..2 * n).filter(|&m| full[m] || partial[m]).collect();
        let recorded = rebuilding.iter().copied().filter(|&m| m < n).collect();
        let targets = (0..2 * n)
            .filter(|&m| health.ok(m) && (resync && m < n || full[m] || partial[m]))
            .collect();
        let start = start_at(job, &rebuilding, resync, size);
        // Members rebuilt whole need every block from their checkpoint on (a replacement
        // from the start); below that, only the bitmap's regions to recover need a visit
        // (a resync's dirty regions after an unclean stop, partial recoveries). After
        // `kill -9` during a rebuild both resume: the resync from the bitmap, the rebuild
        // from its checkpoint.
        let full_from = (0..2 * n)
            .filter(|&m| full[m])
            .map(|m| resume_from(job, m))
            .min()
            .unwrap_or(size)
            .max(start)
            .min(size);
        let bitmap = health.bitmap.clone();
        let total = bytes_to_visit(bitmap.as_deref(), start, full_from, size);
        Plan {
            size,
            n,
            resync,
            what: if resync { "resync" } else { "rebuild" },
            bitmap,
            full,
            partial,
            rebuilding,
            recorded,
            targets,
            start,
            full_from,
            total,
        }
    }

    /// Whether the region of `logical` is to recover (every region without a bitmap).
    fn dirty(&self, logical: u64) -> bool {
        self.bitmap
            .as_ref()
            .is_none_or(|b| b.to_recover(b.region(logical)))
    }

    /// Whether member `m` (or replacement) needs `logical` copied to it. In a resync,
    /// every member in use gets the dirty regions from the copy reads come from.
    fn needs(&self, health: &Health, m: usize, logical: u64) -> bool {
        let n = self.n;
        health.ok(m)
            && (self.full[m] || ((self.partial[m] || self.resync) && m < n && self.dirty(logical)))
    }
}

/// Per member, then per replacement: whether it is rebuilt whole, and whether it only
/// needs the bitmap's regions to recover.
fn members_to_rebuild(
    health: &Health,
    devices: &[Option<Arc<dyn Device>>],
) -> (Vec<bool>, Vec<bool>) {
    let n = health.n;
    let replacing = |m: usize| devices[n + m].is_some() && health.ok(n + m);
    let full = (0..2 * n)
        .map(|m| {
            if m >= n {
                replacing(m - n)
            } else {
                health.ok(m) && !health.readable(m) && !health.partial[m].load(Relaxed)
            }
        })
        .collect();
    let partial = (0..2 * n)
        .map(|m| m < n && health.ok(m) && !health.readable(m) && health.partial[m].load(Relaxed))
        .collect();
    (full, partial)
}

/// Array offset member (or replacement) `m`'s rebuild resumes from: its checkpoint (a
/// replacement starts over).
fn resume_from(job: &Job, m: usize) -> u64 {
    if m < job.health.n {
        logical_from_member(&job.layout, job.metadata.recovery_offset(m))
    } else {
        0
    }
}

/// Where the rebuild or resync starts: the smallest checkpoint of the members being
/// rebuilt, and for a resync where a stop during the last one recorded it got (the
/// copies agree below; a crash records nothing here: the bitmap, cleared behind a
/// resync, is its checkpoint).
fn start_at(job: &Job, rebuilding: &[usize], resync: bool, size: u64) -> u64 {
    let rebuilt_from = rebuilding.iter().map(|&m| resume_from(job, m)).min();
    if resync {
        let from = job.metadata.resync_from().min(size);
        rebuilt_from.map_or(from, |r| r.min(from))
    } else {
        rebuilt_from.unwrap_or(0)
    }
}

/// The bytes to visit from `from`: all of them, or below `full_from` only the bitmap's
/// regions to recover.
fn bytes_to_visit(bitmap: Option<&Bitmap>, from: u64, full_from: u64, size: u64) -> u64 {
    let Some(b) = bitmap else {
        return size - from;
    };
    let below = full_from.max(from);
    let dirty: u64 = (b.region(from)..b.regions())
        .filter(|&r| b.to_recover(r))
        .map(|r| {
            let (lo, hi) = (
                (r as u64 * b.region_bytes()).max(from),
                ((r as u64 + 1) * b.region_bytes()).min(below),
            );
            hi.saturating_sub(lo)
        })
        .sum();
    dirty + (size - below)
}

/// Publishes the plan in the array's status, and logs the start.
fn announce(job: &Job, plan: &Plan) {
    let sync = &job.health.sync;
    let (what, start, size, total) = (plan.what, plan.start, plan.size, plan.total);
    sync.resync.store(plan.resync, Relaxed);
    sync.synced_below.store(start, Relaxed);
    sync.total_bytes.store(total, Relaxed);
    sync.done_bytes.store(0, Relaxed);
    sync.read_bytes.store(0, Relaxed);
    sync.written_bytes.store(0, Relaxed);
    let any_full = plan.full.iter().any(|&f| f);
    log::info!(
        "cairn: {}: {what} of {} started at {start} of {size} bytes{}",
        job.name,
        names(job, &plan.targets),
        match &plan.bitmap {
            Some(b) if !any_full => format!(
                " ({} of {} regions dirty in the bitmap: {total} bytes)",
                b.to_recover_count(),
                b.regions()
            ),
            _ => String::new(),
        }
    );
}

/// How far a rebuild got: for its rate limit, status, checkpoints and log lines.
struct Progress {
    began: Instant,
    /// Array offset reached, and bytes visited to get there.
    at: u64,
    done: u64,
    /// Client requests counted at the end of the last batch.
    clients_seen: u64,
    last_log: Instant,
    last_checkpoint: u64,
}

/// Copies every batch from the plan's start to the end of the array. Returns when it
/// began, or `None` if it stopped or failed (logged).
fn copy_all(job: &Job, queues: &[Option<BlockingQueue>], plan: &Plan) -> Option<Instant> {
    let (what, size) = (plan.what, plan.size);
    let mut pr = Progress {
        began: Instant::now(),
        at: plan.start,
        done: 0,
        clients_seen: job.health.sync.clients.load(Relaxed),
        last_log: Instant::now(),
        last_checkpoint: plan.start,
    };
    while pr.at < size {
        if job.stop.load(SeqCst) {
            checkpoint(job, queues, plan, pr.at);
            let at = pr.at;
            log::warn!(
                "cairn: {}: {what} stopped at {at} of {size} bytes",
                job.name
            );
            return None;
        }
        let Some(batch_end) = next_batch(plan, &mut pr.at) else {
            break;
        };
        let pieces = batch_pieces(job, plan, pr.at, batch_end)?;
        let batch_began = Instant::now();
        if !pieces.is_empty() {
            match copy_batch(job, queues, &pieces) {
                Copy::Done => {}
                // Not copied: the checkpoint stays at this batch's start.
                Copy::Stopped => continue,
                Copy::Failed => return None,
            }
        }
        let bytes = batch_end - pr.at;
        pace(job, &mut pr, bytes, batch_began);
        advance(job, queues, plan, &mut pr, batch_end);
    }
    Some(pr.began)
}

/// Flushes the copies, and records how far the members are current at `at`.
fn checkpoint(job: &Job, queues: &[Option<BlockingQueue>], plan: &Plan, at: u64) {
    flush_copies(job, queues, &plan.targets);
    job.metadata
        .checkpoint(&plan.recorded, member_from_logical(&job.layout, at));
}

/// Where the next batch from `at` ends. Below `full_from`, only the bitmap's regions to
/// recover are visited: `at` skips to the next dirty one (or to `full_from`, from where
/// everything is). `None` when that skip reaches the end.
fn next_batch(plan: &Plan, at: &mut u64) -> Option<u64> {
    let (size, full_from) = (plan.size, plan.full_from);
    let mut batch_end = (*at + BATCH_BYTES).min(size);
    if let Some(b) = &plan.bitmap {
        if *at < full_from {
            match b.next_to_recover(b.region(*at)) {
                Some(r) if r as u64 * b.region_bytes() < full_from => {
                    *at = (*at).max(r as u64 * b.region_bytes());
                    let region_end = (r as u64 + 1) * b.region_bytes();
                    batch_end = (*at + BATCH_BYTES).min(region_end).min(full_from).min(size);
                }
                _ => {
                    *at = full_from;
                    if *at >= size {
                        return None;
                    }
                    batch_end = (*at + BATCH_BYTES).min(size);
                }
            }
        }
    }
    Some(batch_end)
}

/// The pieces of the batch `[at, batch_end)` with somewhere to go; `None` (logged) if a
/// piece has no current copy to read.
fn batch_pieces(job: &Job, plan: &Plan, at: u64, batch_end: u64) -> Option<Vec<Piece>> {
    let (health, what) = (&job.health, plan.what);
    let mut pieces: Vec<Piece> = Vec::new();
    let mut p = at;
    while p < batch_end {
        let len = job.layout.piece_len(p, batch_end - p);
        let source = (0..job.layout.copies()).find(|&k| health.readable(job.layout.locate(p, k).0));
        let Some(source) = source else {
            log::warn!(
                "cairn: {}: {what} stopped at {p}: no current copy to read",
                job.name
            );
            return None;
        };
        let targets = piece_targets(job, plan, p, len, source);
        if !targets.is_empty() {
            pieces.push((p, len, source, targets));
        }
        p += len;
    }
    Some(pieces)
}

/// Where the piece `[p, p + len)`, read from copy `source`, is written: as (member,
/// member offset).
fn piece_targets(job: &Job, plan: &Plan, p: u64, len: u64, source: usize) -> Vec<(usize, u64)> {
    let (health, n) = (&job.health, plan.n);
    let mut targets: Vec<(usize, u64)> = Vec::new();
    for k in 0..job.layout.copies() {
        let (m, member_offset) = job.layout.locate(p, k);
        // Never over what is current already (a rebuild restarted below its
        // progress): reads may use it, and a copy racing a client write would
        // put older data there until copied again. After an unclean stop,
        // though, a region a write was in flight to (dirty) may differ below
        // the checkpoint too: the resync copies it (reads of it go to the
        // source until then).
        let current =
            member_offset + len <= health.below[m].load(Relaxed) && !(plan.resync && plan.dirty(p));
        if k != source && plan.needs(health, m, p) && !current {
            targets.push((m, member_offset));
        }
        if plan.needs(health, n + m, p) {
            // The replacement of `m` (of the source too).
            targets.push((n + m, member_offset));
        }
    }
    targets
}

/// The rate limit, as md's sync_speed_min/max: at most `max`, and `min` while clients
/// use the array (their requests since the last batch). Waits out the rest of the time
/// `bytes` copied since `batch_began` are worth.
fn pace(job: &Job, pr: &mut Progress, bytes: u64, batch_began: Instant) {
    let clients = job.health.sync.clients.load(Relaxed);
    let busy = clients != pr.clients_seen;
    pr.clients_seen = clients;
    let limit = if busy {
        job.rate.min_bytes
    } else {
        job.rate.max_bytes
    };
    if limit > 0 {
        let want = Duration::from_secs_f64(bytes as f64 / limit as f64);
        let took = batch_began.elapsed();
        if want > took {
            pause(&job.stop, want - took);
        }
    }
}

/// The batch up to `batch_end` is copied: status, the members' current range, the
/// checkpoint when due and the progress line every 5 s.
fn advance(
    job: &Job,
    queues: &[Option<BlockingQueue>],
    plan: &Plan,
    pr: &mut Progress,
    batch_end: u64,
) {
    let (health, sync) = (&job.health, &job.health.sync);
    pr.done += batch_end - pr.at;
    pr.at = batch_end;
    sync.done_bytes.store(pr.done.min(plan.total), Relaxed);
    sync.synced_below.store(pr.at, Relaxed);
    // The members being rebuilt are current below here: reads may use them.
    let below = member_from_logical(&job.layout, pr.at);
    for &m in &plan.rebuilding {
        health.below[m].fetch_max(below, Relaxed);
    }
    let secs = pr.began.elapsed().as_secs_f64();
    sync.rate
        .store((pr.done as f64 / secs.max(1e-9)) as u64, Relaxed);
    if pr.at - pr.last_checkpoint >= CHECKPOINT_BYTES {
        checkpoint(job, queues, plan, pr.at);
        pr.last_checkpoint = pr.at;
    }
    if pr.last_log.elapsed() >= Duration::from_secs(5) {
        let (what, done, total) = (plan.what, pr.done, plan.total);
        let rate = done as f64 / secs.max(1e-9);
        log::info!(
            "cairn: {}: {what} {:.1}% ({} of {}, {}, {:.0} s left)",
            job.name,
            done as f64 * 100.0 / total.max(1) as f64,
            cairn_core::size::format_bytes(done),
            cairn_core::size::format_bytes(total),
            cairn_core::size::format_rate(rate),
            (total - done.min(total)) as f64 / rate.max(1.0)
        );
        pr.last_log = Instant::now();
    }
}

/// Everything is copied: flushes, records the members current, and promotes the
/// replacements built.
fn finish(
    job: &Job,
    queues: &[Option<BlockingQueue>],
    plan: &Plan,
    devices: &[Option<Arc<dyn Device>>],
    began: Instant,
) {
    let (health, sync, n) = (&job.health, &job.health.sync, plan.n);
    let (what, total) = (plan.what, plan.total);
    sync.synced_below.store(plan.size, Relaxed);
    flush_copies(job, queues, &plan.targets);
    let finished: Vec<usize> = (0..n)
        .filter(|&m| health.ok(m) && (plan.resync || plan.full[m] || plan.partial[m]))
        .collect();
    job.metadata.rebuilt(&finished, plan.resync);
    for &m in &finished {
        health.readable[m].store(true, Relaxed);
    }
    health.one_copy.store(false, Relaxed);
    let replaced: Vec<usize> = (0..n)
        .filter(|&m| plan.full[n + m] && health.ok(n + m))
        .collect();
    let copied: Vec<usize> = finished
        .iter()
        .copied()
        .chain(replaced.iter().map(|&m| n + m))
        .collect();
    let secs = began.elapsed().as_secs_f64();
    log::info!(
        "cairn: {}: {what} of {} done: {total} bytes in {secs:.3} s ({}); read {} bytes, wrote {} bytes",
        job.name,
        names(job, &copied),
        cairn_core::size::format_rate(total as f64 / secs.max(1e-9)),
        sync.read_bytes.load(Relaxed),
        sync.written_bytes.load(Relaxed),
    );
    for m in replaced {
        promote(job, m, devices);
    }
}

/// Flushes what was copied to `targets` through the queues that carried it, before the
/// superblocks record how far they are current (their flush goes through other queues:
/// for a remote member, other connections, which vouch for nothing if its server
/// restarted meanwhile). A member whose flush fails is failed.
fn flush_copies(job: &Job, queues: &[Option<BlockingQueue>], targets: &[usize]) {
    for &m in targets {
        let Some(q) = queues.get(m).and_then(Option::as_ref) else {
            continue;
        };
        if job.health.ok(m) && q.flush().is_err() {
            job.health.fail(m, cairn_core::IoStatus::errno(libc::EIO));
            if m < job.health.n {
                job.metadata.fail_member(m);
            }
        }
    }
}

/// The replacement of member `m` is current: it takes `m`'s place (recorded first), and
/// the old member is closed. Writes reach the replacement throughout.
fn promote(job: &Job, m: usize, devices: &[Option<Arc<dyn Device>>]) {
    let health = &job.health;
    let _seq = health.changing();
    let r = health.n + m;
    let Some(device) = devices[r].clone() else {
        return;
    };
    let (old, new) = (health.name(m), health.name(r));
    if let Err(e) = job
        .metadata
        .set_member(m, device.clone(), &new, MemberState::Active)
    {
        log::warn!(
            "cairn: {}: replace of '{old}' by '{new}': recording it failed ({e}); '{old}' stays",
            job.name
        );
        return;
    }
    // First the new device is both member `m` and its replacement: requests sent before
    // this reach it as the replacement, those sent after as `m`; once the switch returns
    // nothing sent to the old device is in flight, and `m` may be marked current.
    health.switch(|devices, names| {
        devices[m] = Some(device);
        names[m] = new.clone();
    });
    health.below[m].store(0, Relaxed);
    health.partial[m].store(false, Relaxed);
    health.failed[m].store(false, Relaxed);
    health.readable[m].store(true, Relaxed);
    health.switch(|devices, _| devices[r] = None);
    health.failed[r].store(true, Relaxed);
    log::info!(
        "cairn: {}: replace done: '{new}' took the place of '{old}', which is closed",
        job.name
    );
}

/// A piece to copy: logical offset, length, source copy, targets as (member, offset).
type Piece = (u64, u64, usize, Vec<(usize, u64)>);

/// How a batch's copy ended.
enum Copy {
    Done,
    /// Told to stop before it was copied.
    Stopped,
    /// A read failed: the rebuild must end.
    Failed,
}

/// Copies one batch; copies again what client writes touch meanwhile.
///
/// A piece is copied only while no write to its regions is in flight, and again if one
/// started before its copy ended. Pieces start at most [`PIECE_BYTES`] long; one a write
/// touches is split into regions of [`REGION_BYTES`], so that under a busy random write
/// load the copy converges instead of starting the whole batch over.
fn copy_batch(job: &Job, queues: &[Option<BlockingQueue>], pieces: &[Piece]) -> Copy {
    let sync = &job.health.sync;
    let mut pending: Vec<Piece> = pieces
        .iter()
        .flat_map(|p| split(p, PIECE_BYTES, |_| true))
        .collect();
    while !pending.is_empty() {
        if job.stop.load(SeqCst) {
            return Copy::Stopped;
        }
        let mut ready = Vec::new();
        let mut snaps = Vec::new();
        let mut later = Vec::new();
        for p in pending.drain(..) {
            match sync.quiet(p.0, p.1) {
                Some(snap) => {
                    ready.push(p);
                    snaps.push(snap);
                }
                // A write to it is in flight: its regions wait, the rest go on.
                None if p.1 > REGION_BYTES => later.extend(split(&p, REGION_BYTES, |_| true)),
                None => later.push(p),
            }
        }
        if ready.is_empty() {
            std::thread::sleep(Duration::from_micros(200));
            pending = later;
            continue;
        }
        if let Copy::Failed = copy_pieces(job, queues, &ready) {
            return Copy::Failed;
        }
        for (p, snap) in ready.iter().zip(&snaps) {
            if !sync.unchanged(snap) {
                // Written meanwhile: copy again the regions that were.
                later.extend(split(p, REGION_BYTES, |r| {
                    !sync.unchanged(&snap_of(snap, r))
                }));
            }
        }
        pending = later;
    }
    Copy::Done
}

/// Longest piece copied in one request.
const PIECE_BYTES: u64 = 1 << 20;

/// `p` cut at multiples of `size` (logical), keeping the parts `keep` says (by their
/// region's counter slot).
fn split(p: &Piece, size: u64, keep: impl Fn(usize) -> bool) -> Vec<Piece> {
    let mut out = Vec::new();
    let (start, end) = (p.0, p.0 + p.1);
    let mut at = start;
    while at < end {
        let next = ((at / size + 1) * size).min(end);
        let slot = slots(at, 1).next().unwrap_or(0);
        if keep(slot) {
            let shift = at - start;
            let targets = p.3.iter().map(|&(m, o)| (m, o + shift)).collect();
            out.push((at, next - at, p.2, targets));
        }
        at = next;
    }
    out
}

/// The part of `snap` for counter slot `slot`.
fn snap_of(snap: &[(usize, u64)], slot: usize) -> Vec<(usize, u64)> {
    snap.iter().copied().filter(|&(s, _)| s == slot).collect()
}

/// Reads `pieces` from their sources and writes them to their targets, each member's
/// requests in flight together. A target that fails a write is failed.
fn copy_pieces(job: &Job, queues: &[Option<BlockingQueue>], pieces: &[Piece]) -> Copy {
    let mut bufs: Vec<Vec<u8>> = pieces.iter().map(|p| vec![0u8; p.1 as usize]).collect();
    let sync = &job.health.sync;
    for (m, q) in queues.iter().enumerate() {
        let Some(q) = q else { continue };
        let source_on_m = |p: &Piece| {
            let (member, at) = job.layout.locate(p.0, p.2);
            (member == m).then_some(at)
        };
        let mut reqs = requests(Op::Read, pieces, &mut bufs, job.data_offset, source_on_m);
        if reqs.is_empty() {
            continue;
        }
        sync.read_bytes.fetch_add(data_bytes(&reqs), Relaxed);
        if q.run(&mut reqs).iter().any(|r| r.is_err()) {
            log::warn!(
                "cairn: {}: rebuild: reading member '{}' failed; stopped",
                job.name,
                job.health.name(m)
            );
            return Copy::Failed;
        }
    }
    for (m, q) in queues.iter().enumerate() {
        let Some(q) = q else { continue };
        if !job.health.ok(m) {
            continue;
        }
        // The copies of a piece are on distinct members: one target here at most.
        let target_on_m = |p: &Piece| p.3.iter().find(|t| t.0 == m).map(|t| t.1);
        let mut reqs = requests(Op::Write, pieces, &mut bufs, job.data_offset, target_on_m);
        if reqs.is_empty() {
            continue;
        }
        sync.written_bytes.fetch_add(data_bytes(&reqs), Relaxed);
        if q.run(&mut reqs).iter().any(|r| r.is_err()) {
            job.health.fail(m, cairn_core::IoStatus::errno(libc::EIO));
            if m < job.health.n {
                job.metadata.fail_member(m);
            }
        }
    }
    Copy::Done
}

/// One member's requests of `op` for `pieces`: for each piece `on_member` places there
/// (at a data-area offset), its buffer at that offset.
fn requests<'a>(
    op: Op,
    pieces: &[Piece],
    bufs: &'a mut [Vec<u8>],
    data_offset: u64,
    on_member: impl Fn(&Piece) -> Option<u64>,
) -> Vec<Request<'a>> {
    pieces
        .iter()
        .zip(bufs.iter_mut())
        .filter_map(|(piece, buf)| {
            on_member(piece).map(|at| Request {
                op,
                flags: IoFlags::NONE,
                offset: at + data_offset,
                len: 0,
                buf: Some(buf.as_mut_slice()),
            })
        })
        .collect()
}

/// Bytes the requests carry.
fn data_bytes(reqs: &[Request<'_>]) -> u64 {
    reqs.iter()
        .map(|r| r.buf.as_ref().map_or(0, |b| b.len() as u64))
        .sum()
}

/// Sleeps `d`, waking early when `stop` is set.
fn pause(stop: &AtomicBool, d: Duration) {
    let end = Instant::now() + d;
    while !stop.load(SeqCst) {
        let now = Instant::now();
        if now >= end {
            return;
        }
        std::thread::sleep((end - now).min(Duration::from_millis(20)));
    }
}

/// The rebuild checkpoint in a member's data area for logical progress `at`: every
/// member byte below it holds data of logical bytes below `at` (conservative for raid10).
fn member_from_logical(layout: &AnyLayout, at: u64) -> u64 {
    match layout {
        AnyLayout::Raid10(r) => r.member_rows_below(at),
        _ => at,
    }
}

/// The logical offset to resume from for a member checkpoint (never past it).
fn logical_from_member(layout: &AnyLayout, member_offset: u64) -> u64 {
    match layout {
        AnyLayout::Raid10(r) => r.logical_below_rows(member_offset),
        _ => member_offset,
    }
}

fn names(job: &Job, members: &[usize]) -> String {
    let n: Vec<String> = members
        .iter()
        .map(|&m| format!("'{}'", job.health.name(m)))
        .collect();
    if n.is_empty() {
        "no member".into()
    } else {
        n.join(", ")
    }
}

/// What the bitmap's clearing thread needs of its array.
pub(super) struct Clearing {
    pub health: Arc<Health>,
    pub metadata: Arc<Metadata>,
    pub stop: Arc<AtomicBool>,
    /// How often it looks, and how long a region must stay idle.
    pub delay: Duration,
}

/// The array offset below which idle regions' bits may be cleared now: everywhere while
/// every member is current and nothing is being copied, below a resync's progress while
/// one runs alone; `None` while a member is away, failed, rebuilt or replaced.
fn clearable_below(health: &Health) -> Option<u64> {
    let n = health.n;
    let all_current = (0..n).all(|m| health.ok(m) && health.readable(m));
    if !all_current || (0..n).any(|m| health.being_replaced(m)) {
        return None;
    }
    let sync = &health.sync;
    let one_copy = health.one_copy.load(Relaxed);
    match (one_copy, sync.running()) {
        (false, false) => Some(u64::MAX),
        // Read before the members are flushed: what the resync copied below it is
        // durable once they are.
        (true, true) if sync.resync.load(Relaxed) => Some(sync.synced_below.load(Relaxed)),
        _ => None,
    }
}

/// Fails each member in use whose device lost writes it had acknowledged (a remote one
/// whose server restarted before a flush covered them): the bitmap's bits keep the
/// regions they went to, and the re-add copies them again. Returns the worst that the
/// members' devices say ([`LostWrites::Unverified`]: one may have lost some, and is
/// checking).
fn fail_lost(health: &Health, metadata: &crate::array::Metadata) -> LostWrites {
    let mut worst = LostWrites::None;
    for (m, d) in health.devices().iter().enumerate() {
        let Some(d) = d else { continue };
        if !health.ok(m) {
            continue;
        }
        let lost = d.lost_writes();
        if lost == LostWrites::Lost {
            log::warn!(
                "cairn: {}: member '{}' lost writes it had acknowledged (its server went away before they were flushed): they are copied to it again when it is re-added",
                health.device,
                health.name(m)
            );
            health.fail(m, cairn_core::IoStatus::errno(libc::EIO));
            if m < health.n {
                metadata.fail_member(m);
            }
        }
        worst = worst.max(lost);
    }
    worst
}

/// Clears the bits of regions idle for a whole `delay`, every `delay`, while every member
/// is current (below its progress during a resync); until `stop`. Their writes are made
/// durable first (every member flushed), and no bit is cleared while a member's device
/// may have lost writes it acknowledged (a flush through another connection than theirs
/// says nothing of them): such a member fails once its device knows.
pub(super) fn clear_bits(job: Clearing) {
    cairn_core::reactor::block_signals_in_this_thread();
    let Some(bm) = job.health.bitmap.clone() else {
        return;
    };
    let health = &job.health;
    let n = health.n;
    // The members' queues, opened again when the members change.
    let mut queues: Vec<Option<BlockingQueue>> = Vec::new();
    let mut epoch = u64::MAX;
    let mut before: Option<Vec<u64>> = None;
    loop {
        pause(&job.stop, job.delay);
        if job.stop.load(SeqCst) {
            return;
        }
        if fail_lost(health, &job.metadata) != LostWrites::None {
            continue;
        }
        // No bit is cleared while a member is away, failed or not yet current: the bits
        // are then what it will need. During a resync (every member in use and current
        // but for the copies that may differ), the regions it has passed agree: their
        // bits are cleared as any others, so the bitmap is the resync's checkpoint (a
        // crash then resyncs only what it had not passed, and what was written since).
        let Some(below) = clearable_below(health) else {
            before = None;
            continue;
        };
        let Some(prev) = before.replace(bm.started_now()) else {
            continue;
        };
        let region = bm.region_bytes();
        let idle: Vec<usize> = (0..bm.regions())
            .take_while(|&r| (r as u64 + 1).saturating_mul(region) <= below)
            .filter(|&r| bm.idle(r, &prev))
            .collect();
        if idle.is_empty() {
            continue;
        }
        let now = health.epoch.load(SeqCst);
        if now != epoch {
            queues = health
                .devices()
                .iter()
                .take(n)
                .map(|d| {
                    d.as_ref()
                        .and_then(|d| BlockingQueue::open(d, Switches::default()).ok())
                })
                .collect();
            epoch = now;
        }
        let flushed = queues
            .iter()
            .all(|q| q.as_ref().is_some_and(|q| q.flush().is_ok()));
        if !flushed {
            // A member that cannot flush fails through a client's flush; the bits stay.
            continue;
        }
        // A member whose device found (or may have) lost writes during the flush.
        if fail_lost(health, &job.metadata) != LostWrites::None {
            continue;
        }
        job.metadata.clear_idle(&idle, &prev);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_core::SinkId;

    fn write(offset: u64, len: u64) -> Io {
        Io {
            op: Op::Write,
            flags: IoFlags::NONE,
            offset,
            len,
            buf: std::ptr::null_mut(),
            sink: SinkId(0),
            token: 0,
        }
    }

    /// A repair's hold and a counted write exclude each other, whichever comes first;
    /// writes elsewhere are neither seen nor held.
    #[test]
    fn a_hold_and_a_counted_write_exclude_each_other() {
        let w = WriteCounts::new();
        let near = write(REGION_BYTES + 4096, 4096);
        // Not counting: writes are not counted, and nothing is held.
        assert!(!w.start(&near));
        w.repairs_on();
        assert!(!w.running(), "repairs are not a rebuild");
        // A write in flight: the range cannot be held.
        assert!(w.start(&near));
        assert!(!w.hold(REGION_BYTES, 8192));
        assert!(!w.held(&near), "a hold that failed holds nothing");
        w.done(&near);
        // Held first: a write counted after sees it and must wait.
        assert!(w.hold(REGION_BYTES, 8192));
        assert!(w.start(&near));
        assert!(w.held(&near));
        let far = write(8 * REGION_BYTES, 4096);
        assert!(w.start(&far));
        assert!(!w.held(&far));
        w.done(&far);
        w.release(REGION_BYTES, 8192);
        assert!(!w.held(&near));
        // The waiting write is in flight now: no new hold until it ends.
        assert!(!w.hold(REGION_BYTES, 8192));
        w.done(&near);
        assert!(w.hold(REGION_BYTES, 8192));
        w.release(REGION_BYTES, 8192);
        w.repairs_off();
        assert!(!w.start(&near));
    }
}
