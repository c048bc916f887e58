//! A thin pool at run time: the volumes' tables the reactors use, the free blocks they
//! allocate from, and the commit thread that makes their changes durable.
//!
//! - **Reactors** ([`super::queue`]) look mappings up and change them in the volumes'
//!   lock-free [`Table`]s, taking blocks from a small per-queue stash refilled from
//!   [`ThinPool::take_blocks`] (one lock per [`STASH`] allocations), and mark the leaf
//!   they changed. Nothing else: no log record is made on the reactor.
//! - **The commit thread** (one per pool) finds the changed leaves, compares them with the
//!   committed [`PoolState`] and logs the differences as records: many flushes and FUA
//!   writes, one commit (technique 1). Order of a commit: capture the tables, flush the
//!   data device (so every block a captured mapping names holds its data), write the log
//!   blocks and flush the metadata, answer the waiters. Blocks the commit freed are zeroed
//!   only after a grace period (no request that looked up the old mapping is in flight)
//!   and go back to the free list: a free block always reads as zeros, so a first write of
//!   4 KiB into a 64 KiB block writes 4 KiB.
//! - **Opening** picks the superblock, loads the checkpoint, replays the log, zeroes
//!   every block that may hold data no mapping names (after an unclean stop: every free
//!   block, since reactors write into blocks before their mapping is committed), writes a
//!   fresh checkpoint and starts the thread. Closing commits, writes a checkpoint and
//!   marks the pool clean.
//! - **Admin operations** (create, snapshot, clone, delete, grow) run on the commit
//!   thread, each with its own commit, and reply once it is durable.

use std::collections::{BTreeMap, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use cairn_core::blocking::BlockingQueue;
use cairn_core::size::format_bytes;
use cairn_core::{Device, Error, IoFlags, IoStatus, Op, Switches};

use super::format::{self, Record, BLOCK_BYTES as LOG_PAGE};
use super::state::{block_of, BlockState, PoolState, OWNED};
use super::superblock::{self as sbk, PoolSuperblock};
use super::table::{Table, LEAF_ENTRIES};
use super::{checkpoint, state};

/// The allocation unit when the stack file names none (see README "Thin pools").
pub const BLOCK_DEFAULT: u64 = 64 << 10;
/// Blocks a queue takes from the pool at once.
pub const STASH: usize = 16;
/// A commit runs at least this often while anything changed (as dm-thin's).
const COMMIT_PERIOD: Duration = Duration::from_secs(1);
/// Longest volume name.
pub const NAME_MAX: usize = format::NAME_MAX;
/// Largest virtual size of a volume, in blocks (entries hold block + 1 in 31 bits).
pub const VOLUME_BLOCKS_MAX: u64 = 1 << 30;
/// Checkpoint bytes reserved per data block (a random mapping costs a run record of 21
/// bytes per volume that maps it, a block state record 22).
const CHECKPOINT_BYTES_PER_BLOCK: u64 = 128;

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One volume (a thin volume, a snapshot or a clone) as the reactors see it.
pub struct Volume {
    /// Its id in the log.
    pub id: u32,
    /// Its name.
    pub name: String,
    /// A snapshot (writes refused).
    pub read_only: bool,
    /// Virtual size in bytes.
    pub size: AtomicU64,
    /// Virtual block -> entry.
    pub table: Table,
    /// A snapshot of it is being taken: writes wait (see [`ThinPool::grace`]).
    pub frozen: AtomicBool,
    /// Thin devices open on it (a delete is refused while any is).
    pub users: AtomicU32,
    /// Blocks it maps, as of the last commit.
    pub mapped: AtomicU64,
}

/// A queue's requests in flight, by the parity of the pool's epoch they started under.
#[derive(Default)]
pub struct Gate {
    pub(super) n: [AtomicU64; 2],
}

/// A flush (or FUA write) waiting for the next commit.
pub struct Waiter {
    /// Handed back with the status.
    pub token: u64,
    /// Where the reply goes.
    pub reply: Sender<(u64, IoStatus)>,
    /// Woken after the reply is sent.
    pub wake: Arc<OwnedFd>,
}

/// An admin operation, run on the commit thread.
#[derive(Debug, Clone)]
pub enum Admin {
    /// A new empty volume `name` of `size` bytes.
    #[allow(missing_docs)]
    Create { name: String, size: u64 },
    /// A copy of `src` named `name`: read-only (a snapshot) or writable (a clone).
    #[allow(missing_docs)]
    Snapshot {
        src: String,
        name: String,
        read_only: bool,
    },
    /// Away with volume `name`.
    #[allow(missing_docs)]
    Delete { name: String },
    /// Volume `name` grows to `size` bytes.
    #[allow(missing_docs)]
    Grow { name: String, size: u64 },
}

#[derive(Default)]
struct Work {
    waiters: Vec<Waiter>,
    admin: VecDeque<(Admin, Sender<Result<String, String>>)>,
    kicked: bool,
    stop: bool,
}

/// Free blocks, handed to queues.
#[derive(Default)]
pub(super) struct Free {
    /// Free and zeroed, highest first (popped from the end: low blocks go first).
    zeroed: Vec<u32>,
    /// Written but never mapped (a queue lost a race for an entry): zeroed by the commit
    /// thread before reuse.
    dirty: Vec<u32>,
    /// Owned blocks a queue unmapped (a discard): those no commit recorded as mapped
    /// are zeroed and freed by the commit thread (the others are freed by the commit
    /// that records the unmapping).
    unmapped: Vec<u32>,
    /// Freed by a commit and being zeroed: space that is coming (a write waits for it
    /// rather than failing).
    coming: u64,
}

/// What [`ThinPool::take_blocks`] found.
pub(super) enum Take {
    /// Some blocks (at least one).
    Got,
    /// None now, but freed blocks are being zeroed: try again soon.
    Wait,
    /// The pool is full.
    Full,
}

/// Facts for `status` and the metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PoolReport {
    /// The pool's device name.
    pub name: String,
    /// Allocation unit.
    pub block_bytes: u64,
    /// Data blocks, and those in use (mapped, or held by a queue for its next writes).
    pub data_blocks: u64,
    /// See [`PoolReport::data_blocks`].
    pub used_blocks: u64,
    /// Metadata bytes: the checkpoint area's size, the last checkpoint's, the log's size
    /// and what the log holds since that checkpoint.
    pub checkpoint_capacity: u64,
    /// See [`PoolReport::checkpoint_capacity`].
    pub checkpoint_bytes: u64,
    /// See [`PoolReport::checkpoint_capacity`].
    pub log_bytes: u64,
    /// See [`PoolReport::checkpoint_capacity`].
    pub log_used: u64,
    /// Below this many free blocks the pool says so.
    pub low_water_blocks: u64,
    /// Commits written so far (since open).
    pub commits: u64,
    /// Each volume: name, size, mapped bytes, read-only, devices open on it.
    pub volumes: Vec<(String, u64, u64, bool, u32)>,
    /// A metadata write failed: the pool takes no more changes.
    pub failed: bool,
}

/// How a pool opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolOptions {
    /// The allocation unit (`None`: as recorded, or [`BLOCK_DEFAULT`] for a new pool).
    pub block_bytes: Option<u64>,
    /// Low-water mark in bytes or a percentage of the data.
    pub low_water: LowWater,
}

/// The `low_water` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LowWater {
    /// Bytes free.
    Bytes(u64),
    /// Percent of the data free.
    Percent(u8),
}

impl Default for LowWater {
    fn default() -> LowWater {
        LowWater::Percent(10)
    }
}

/// Where the metadata areas are, for a pool of `data_blocks` (pure).
struct Layout {
    log_offset: u64,
    log_bytes: u64,
    checkpoints: [u64; 2],
    capacity: u64,
    end: u64,
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

fn layout(data_blocks: u64) -> Layout {
    let capacity = round_up(
        data_blocks * CHECKPOINT_BYTES_PER_BLOCK + (1 << 20),
        sbk::PAGE,
    );
    let log_bytes = round_up((capacity / 2).clamp(1 << 20, 256 << 20), sbk::PAGE);
    let log_offset = (sbk::SLOTS * sbk::SLOT_BYTES) as u64;
    let a = log_offset + log_bytes;
    Layout {
        log_offset,
        log_bytes,
        checkpoints: [a, a + capacity],
        capacity,
        end: a + 2 * capacity,
    }
}

/// The run-time pool, shared by the commit thread, every queue and the admin.
pub struct Inner {
    pub(super) name: String,
    pub(super) data: Arc<dyn Device>,
    pub(super) block_shift: u32,
    pub(super) data_offset: u64,
    pub(super) data_blocks: u64,
    pub(super) volumes: Mutex<BTreeMap<u32, Arc<Volume>>>,
    pub(super) free: Mutex<Free>,
    epoch: AtomicU64,
    gates: Mutex<Vec<Weak<Gate>>>,
    work: Mutex<Work>,
    work_cv: Condvar,
    /// A metadata write or a record failed: no more commits; flushes fail with EIO.
    pub(super) failed: AtomicBool,
    used_blocks: AtomicU64,
    low_water_blocks: u64,
    low_said: AtomicBool,
    report: Mutex<PoolReport>,
    /// The pool runs (a dry open for `cairn check` has no thread and takes no writes).
    pub(super) running: bool,
    /// Tests: stop as a crash would, with no last commit or checkpoint.
    crashed: AtomicBool,
}

/// A thin pool: a [`Device`] only so that the stack can hold and print it (it serves no
/// I/O itself; its volumes do, through `thin` devices).
pub struct ThinPool {
    inner: Arc<Inner>,
    meta: Option<Arc<dyn Device>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    describe: String,
    /// What a dry open found (for `cairn check`).
    pub examined: Vec<String>,
}

impl Inner {
    /// Blocks are `1 << block_shift` bytes.
    pub(super) fn block_bytes(&self) -> u64 {
        1 << self.block_shift
    }

    /// Moves up to [`STASH`] free blocks into `stash` (a queue's), lowest first.
    pub(super) fn take_blocks(&self, stash: &mut Vec<u32>) -> Take {
        let mut free = lock(&self.free);
        let n = free.zeroed.len().min(STASH);
        if n == 0 {
            let coming = free.coming > 0 || !free.dirty.is_empty();
            drop(free);
            if coming {
                self.kick();
                return Take::Wait;
            }
            return Take::Full;
        }
        let at = free.zeroed.len() - n;
        stash.extend(free.zeroed.drain(at..).rev());
        let left = free.zeroed.len() as u64;
        drop(free);
        self.used_blocks.fetch_add(n as u64, Relaxed);
        if left < self.low_water_blocks && !self.low_said.swap(true, Relaxed) {
            log::warn!(
                "cairn: {}: thin pool below its low-water mark: {} of {} free",
                self.name,
                format_bytes(left << self.block_shift),
                format_bytes(self.data_blocks << self.block_shift)
            );
        }
        Take::Got
    }

    /// Gives back blocks a queue took and never wrote (it closes).
    pub(super) fn give_back(&self, blocks: &[u32]) {
        if blocks.is_empty() {
            return;
        }
        let mut free = lock(&self.free);
        free.zeroed.extend_from_slice(blocks);
        free.zeroed.sort_unstable_by(|a, b| b.cmp(a));
        drop(free);
        self.used_blocks.fetch_sub(blocks.len() as u64, Relaxed);
    }

    /// A block a queue wrote into and could not map (another request mapped the entry
    /// first): zeroed by the commit thread before reuse.
    pub(super) fn give_back_dirty(&self, block: u32) {
        lock(&self.free).dirty.push(block);
        self.kick();
    }

    /// A queue unmapped owned block `block` (see [`Free::unmapped`]).
    pub(super) fn unmapped(&self, block: u32) {
        lock(&self.free).unmapped.push(block);
    }

    /// Counts a request of a queue in flight: returns the parity to leave with.
    #[inline]
    pub(super) fn enter(&self, gate: &Gate) -> usize {
        loop {
            let e = self.epoch.load(SeqCst);
            let p = (e & 1) as usize;
            gate.n[p].fetch_add(1, SeqCst);
            if self.epoch.load(SeqCst) == e {
                return p;
            }
            gate.n[p].fetch_sub(1, SeqCst);
        }
    }

    /// The end of a request counted by [`Inner::enter`].
    #[inline]
    pub(super) fn leave(&self, gate: &Gate, parity: usize) {
        gate.n[parity].fetch_sub(1, SeqCst);
    }

    pub(super) fn add_gate(&self, g: &Arc<Gate>) {
        let mut gates = lock(&self.gates);
        gates.retain(|g| g.strong_count() > 0);
        gates.push(Arc::downgrade(g));
    }

    /// Waits until no request that started before this call is in flight (control
    /// threads only): after it, no request can still use a mapping changed before it.
    fn grace(&self) {
        let old = self.epoch.fetch_add(1, SeqCst);
        let parity = (old & 1) as usize;
        let began = Instant::now();
        let mut told = false;
        loop {
            let busy = lock(&self.gates)
                .iter()
                .filter_map(Weak::upgrade)
                .any(|g| g.n[parity].load(SeqCst) != 0);
            if !busy {
                return;
            }
            if !told && began.elapsed() > Duration::from_secs(5) {
                log::warn!(
                    "cairn: {}: waiting for requests sent earlier to end",
                    self.name
                );
                told = true;
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// Asks for a commit (a flush or FUA write): `waiter` is answered once it is durable.
    pub(super) fn wait_commit(&self, waiter: Waiter) {
        lock(&self.work).waiters.push(waiter);
        self.work_cv.notify_one();
    }

    /// Wakes the commit thread (freed or dirty blocks to zero).
    pub(super) fn kick(&self) {
        lock(&self.work).kicked = true;
        self.work_cv.notify_one();
    }

    /// A volume by name.
    pub(super) fn volume(&self, name: &str) -> Option<Arc<Volume>> {
        lock(&self.volumes)
            .values()
            .find(|v| v.name == name)
            .cloned()
    }

    /// Runs an admin operation on the commit thread and waits for its answer.
    pub fn admin(&self, op: Admin) -> Result<String, String> {
        if !self.running {
            return Err(format!("thin pool '{}' is not running", self.name));
        }
        let (tx, rx) = mpsc::channel();
        {
            let mut w = lock(&self.work);
            if w.stop {
                return Err(format!("thin pool '{}' is stopping", self.name));
            }
            w.admin.push_back((op, tx));
        }
        self.work_cv.notify_one();
        rx.recv()
            .unwrap_or_else(|_| Err(format!("thin pool '{}' stopped", self.name)))
    }

    /// Opens (or, with `create`, creates when absent) volume `name` of `size` bytes
    /// (`None`: as it is; larger: grown). Returns it with its user count raised.
    pub fn attach(
        &self,
        name: &str,
        size: Option<u64>,
        create: bool,
    ) -> Result<Arc<Volume>, Error> {
        let bad = |m: String| Error::Invalid(m);
        if self.volume(name).is_none() {
            let Some(size) = size else {
                return Err(bad(format!(
                    "thin pool '{}' has no volume '{name}', and no 'size' to create it with",
                    self.name
                )));
            };
            if !create {
                check_name(name).map_err(bad)?;
                check_size(size, self.block_bytes(), VOLUME_BLOCKS_MAX).map_err(bad)?;
                // Examined only: a stand-in that `cairn check` prints.
                let v = Arc::new(Volume {
                    id: 0,
                    name: name.into(),
                    read_only: false,
                    size: AtomicU64::new(size),
                    table: Table::new(1),
                    frozen: AtomicBool::new(false),
                    users: AtomicU32::new(1),
                    mapped: AtomicU64::new(0),
                });
                return Ok(v);
            }
            self.admin(Admin::Create {
                name: name.into(),
                size,
            })
            .map_err(bad)?;
        }
        let v = self
            .volume(name)
            .ok_or_else(|| bad(format!("volume '{name}' went away")))?;
        if let Some(size) = size {
            let now = v.size.load(SeqCst);
            if size < now {
                return Err(bad(format!(
                    "volume '{name}' is {}; 'size' says {} (a volume never shrinks)",
                    format_bytes(now),
                    format_bytes(size)
                )));
            }
            if size > now && create {
                self.admin(Admin::Grow {
                    name: name.into(),
                    size,
                })
                .map_err(bad)?;
            }
        }
        v.users.fetch_add(1, SeqCst);
        Ok(v)
    }

    /// For crash tests: the commit thread stops at once when the pool closes, as if the
    /// process died (no last commit, no checkpoint; nothing is written after this call
    /// returns except a commit already under way).
    pub fn crash_on_close(&self) {
        self.crashed.store(true, SeqCst);
    }

    /// Status facts.
    pub fn report(&self) -> PoolReport {
        let mut r = lock(&self.report).clone();
        r.used_blocks = self.used_blocks.load(Relaxed);
        r.failed = self.failed.load(Relaxed);
        r.volumes = lock(&self.volumes)
            .values()
            .map(|v| {
                (
                    v.name.clone(),
                    v.size.load(Relaxed),
                    v.mapped.load(Relaxed) << self.block_shift,
                    v.read_only,
                    v.users.load(Relaxed),
                )
            })
            .collect();
        r
    }
}

/// The commit thread's own state: the committed pool state and where the metadata is.
struct Committer {
    inner: Arc<Inner>,
    state: PoolState,
    sb: PoolSuperblock,
    /// The slot the newest superblock is in.
    sb_slot: usize,
    next_seq: u64,
    commit_id: u64,
    /// Log pages written since the checkpoint.
    log_used: u64,
    /// Records for the next commit (blocks zeroed).
    pending: Vec<Record>,
    checkpoint_bytes: u64,
    data: BlockingQueue,
    /// The metadata device's queue (`None`: the metadata is on the data device).
    meta: Option<BlockingQueue>,
    leaf: Box<[u32; LEAF_ENTRIES]>,
    commits: u64,
    /// The pool was created by this open.
    new: bool,
}

impl Committer {
    fn meta(&self) -> &BlockingQueue {
        self.meta.as_ref().unwrap_or(&self.data)
    }

    fn log_pages(&self) -> u64 {
        self.sb.log_bytes / LOG_PAGE as u64
    }

    /// Compares every changed leaf with the committed state: a record per entry that
    /// differs (with the reservation of a block mapped for the first time).
    fn capture(&mut self, out: &mut Vec<Record>) {
        let volumes: Vec<Arc<Volume>> = lock(&self.inner.volumes).values().cloned().collect();
        for v in volumes {
            let Some(st) = self.state.volumes.get(&v.id) else {
                continue;
            };
            for i in 0..v.table.leaves() {
                if !v.table.take_dirty(i) {
                    continue;
                }
                v.table.leaf_entries(i, &mut self.leaf);
                let base = (i * LEAF_ENTRIES) as u64;
                let mut old = [0u32; LEAF_ENTRIES];
                for (&vb, &e) in st.map.range(base..base + LEAF_ENTRIES as u64) {
                    old[(vb - base) as usize] = e;
                }
                for (j, (&now, &was)) in self.leaf.iter().zip(old.iter()).enumerate() {
                    if now == was {
                        continue;
                    }
                    if let Some(b) = block_of(now) {
                        if block_of(was) != Some(b)
                            && self.state.blocks.get(b as usize) == Some(&BlockState::Free)
                        {
                            out.push(Record::Reserve { start: b, len: 1 });
                        }
                    }
                    out.push(Record::Set {
                        vol: v.id,
                        vblock: base + j as u64,
                        entry: now,
                    });
                }
            }
        }
    }

    /// One commit of `records` (and the pending ones, and whatever the tables changed):
    /// see the module's documentation for the order.
    fn commit(&mut self, mut records: Vec<Record>) -> Result<(), String> {
        if self.inner.failed.load(Relaxed) || self.inner.crashed.load(SeqCst) {
            return Err(format!("thin pool '{}' has failed", self.inner.name));
        }
        // Pending records are in the state already; then the operation's own (a
        // snapshot's come before any change made to its source after it), then what the
        // tables changed since the last capture.
        let mut all = std::mem::take(&mut self.pending);
        let mut captured = Vec::new();
        for pass in 0..2 {
            if pass == 1 {
                self.capture(&mut captured);
                records = std::mem::take(&mut captured);
            }
            for r in &records {
                if let Err(e) = self.state.apply(r) {
                    return Err(self.fail(format!("a record the pool cannot take ({e}): {r:?}")));
                }
            }
            all.append(&mut records);
        }
        self.data
            .flush()
            .map_err(|e| self.fail(format!("data flush failed: {e}")))?;
        if all.is_empty() {
            return Ok(());
        }
        let blocks = format::pack(self.sb.pool_uuid, self.next_seq, self.commit_id, &all);
        let room = self.log_pages() / 2;
        if self.log_used + blocks.len() as u64 > room {
            // Too much for the log: the whole state goes into a checkpoint instead.
            return self.checkpoint(false);
        }
        let pages = self.log_pages();
        for b in &blocks {
            let at = self.sb.log_offset + (b.seq % pages) * LOG_PAGE as u64;
            self.meta()
                .write(at, &b.encode(), IoFlags::NONE)
                .map_err(|e| self.fail(format!("log write failed: {e}")))?;
        }
        self.meta()
            .flush()
            .map_err(|e| self.fail(format!("metadata flush failed: {e}")))?;
        self.next_seq += blocks.len() as u64;
        self.commit_id += 1;
        self.log_used += blocks.len() as u64;
        self.commits += 1;
        self.publish();
        Ok(())
    }

    /// Marks the pool failed (logged once); returns `why`.
    fn fail(&self, why: String) -> String {
        if !self.inner.failed.swap(true, SeqCst) {
            log::error!(
                "cairn: {}: thin pool failed, it takes no more changes: {why}",
                self.inner.name
            );
        }
        why
    }

    /// Writes the whole state to the checkpoint area not in use, then a superblock that
    /// points at it (the log starts afresh after it). `clean`: the pool stops.
    fn checkpoint(&mut self, clean: bool) -> Result<(), String> {
        if self.inner.crashed.load(SeqCst) {
            return Err("crashed".into());
        }
        let generation = self.sb.checkpoint_generation + 1;
        let pages = checkpoint::pages(self.sb.pool_uuid, generation, &self.state);
        let bytes = pages.len() as u64 * sbk::PAGE;
        if bytes > self.sb.checkpoint_capacity {
            return Err(self.fail(format!(
                "the metadata is full: a checkpoint needs {} and has room for {}",
                format_bytes(bytes),
                format_bytes(self.sb.checkpoint_capacity)
            )));
        }
        let slot = if self.sb.checkpoint_in_use == 1 { 1 } else { 0 };
        let mut area = Vec::with_capacity(bytes as usize);
        let mut crcs = Vec::with_capacity(pages.len() * 4);
        for p in &pages {
            area.extend_from_slice(p);
            crcs.extend_from_slice(&p[p.len() - 4..]);
        }
        self.meta()
            .write(self.sb.checkpoints[slot], &area, IoFlags::NONE)
            .and_then(|()| self.meta().flush())
            .map_err(|e| self.fail(format!("checkpoint write failed: {e}")))?;
        let mut sb = self.sb.clone();
        sb.generation += 1;
        sb.checkpoint_in_use = slot as u32 + 1;
        sb.checkpoint_generation = generation;
        sb.checkpoint_pages = pages.len() as u64;
        sb.checkpoint_crc = crc32c::crc32c(&crcs);
        sb.log_start_seq = self.next_seq;
        sb.log_start_offset = (self.next_seq % self.log_pages()) * LOG_PAGE as u64;
        sb.updated_secs = now_secs();
        if clean {
            sb.flags |= sbk::FLAG_CLEAN;
        } else {
            sb.flags &= !sbk::FLAG_CLEAN;
        }
        let to = 1 - self.sb_slot;
        self.meta()
            .write((to * sbk::SLOT_BYTES) as u64, &sb.encode(), IoFlags::NONE)
            .and_then(|()| self.meta().flush())
            .map_err(|e| self.fail(format!("superblock write failed: {e}")))?;
        self.sb = sb;
        self.sb_slot = to;
        self.log_used = 0;
        self.checkpoint_bytes = bytes;
        self.commits += 1;
        self.publish();
        Ok(())
    }

    /// Updates what `status` shows and each volume's mapped count.
    fn publish(&self) {
        let mut r = lock(&self.inner.report);
        r.checkpoint_bytes = self.checkpoint_bytes;
        r.log_used = self.log_used * LOG_PAGE as u64;
        r.commits = self.commits;
        drop(r);
        for v in lock(&self.inner.volumes).values() {
            if let Some(st) = self.state.volumes.get(&v.id) {
                v.mapped.store(st.map.len() as u64, Relaxed);
            }
        }
    }

    /// Zeroes the blocks the last commits freed (after a grace period) and those queues
    /// wrote and could not map, and frees them.
    fn release(&mut self) {
        let freed = std::mem::take(&mut self.state.freed);
        let some_unmapped = !lock(&self.inner.free).unmapped.is_empty();
        if !freed.is_empty() || some_unmapped {
            lock(&self.inner.free).coming += freed.len() as u64;
            self.inner.grace();
        }
        // Taken after the grace period: a queue notes a block after it unmapped it, in
        // the same request, so every block whose unmapping a commit recorded is noted by
        // now, and is told apart by its state (freed, not free).
        let (dirty, unmapped) = {
            let mut free = lock(&self.inner.free);
            (
                std::mem::take(&mut free.dirty),
                std::mem::take(&mut free.unmapped),
            )
        };
        // Unmapped before any commit recorded them mapped: no record frees them.
        let leaked: Vec<u32> = unmapped
            .into_iter()
            .filter(|&b| self.state.blocks.get(b as usize) == Some(&BlockState::Free))
            .collect();
        if freed.is_empty() && dirty.is_empty() && leaked.is_empty() {
            return;
        }
        let mut all: Vec<u64> = freed.to_vec();
        all.extend(dirty.iter().chain(&leaked).map(|&b| u64::from(b)));
        if let Err(e) = self.zero(&all) {
            self.fail(format!("zeroing freed blocks failed: {e}"));
            return;
        }
        for (start, len) in runs(&freed) {
            let r = Record::Zeroed { start, len };
            if let Err(e) = self.state.apply(&r) {
                self.fail(format!("a record the pool cannot take ({e}): {r:?}"));
                return;
            }
            self.pending.push(r);
        }
        let mut free = lock(&self.inner.free);
        free.coming -= freed.len() as u64;
        free.zeroed.extend(all.iter().map(|&b| b as u32));
        free.zeroed.sort_unstable_by(|a, b| b.cmp(a));
        let left = free.zeroed.len() as u64;
        drop(free);
        self.inner.used_blocks.fetch_sub(all.len() as u64, Relaxed);
        if left >= self.inner.low_water_blocks {
            self.inner.low_said.store(false, Relaxed);
        }
    }

    /// Makes `blocks` read as zeros (discard where the data device has it).
    fn zero(&self, blocks: &[u64]) -> Result<(), String> {
        if self.inner.crashed.load(SeqCst) {
            return Err("crashed".into());
        }
        let mut sorted = blocks.to_vec();
        sorted.sort_unstable();
        zero_runs(&self.data, &self.inner, &runs(&sorted))
    }

    /// Runs one admin operation: checks, then its record in a commit of its own.
    fn admin(&mut self, op: Admin) -> Result<String, String> {
        if self.inner.failed.load(Relaxed) {
            return Err(format!("thin pool '{}' has failed", self.inner.name));
        }
        let pool = self.inner.name.clone();
        let find = |name: &str| {
            self.inner
                .volume(name)
                .ok_or_else(|| format!("thin pool '{pool}' has no volume '{name}'"))
        };
        match op {
            Admin::Create { name, size } => {
                self.check_new(&name, size, 0)?;
                let id = self.next_volume();
                self.add_volume(id, &name, size, false);
                self.commit(vec![Record::Create {
                    vol: id,
                    size,
                    flags: 0,
                    name: name.clone(),
                }])?;
                Ok(format!(
                    "created volume '{name}' ({}) in thin pool '{pool}'",
                    format_bytes(size)
                ))
            }
            Admin::Snapshot {
                src,
                name,
                read_only,
            } => {
                let source = find(&src)?;
                if !read_only && !source.read_only {
                    return Err(format!(
                        "'{src}' is writable: clone a snapshot (take one with 'thin snapshot' first)"
                    ));
                }
                let mapped = self
                    .state
                    .volumes
                    .get(&source.id)
                    .map_or(0, |v| v.map.len());
                self.check_new(&name, source.size.load(Relaxed), mapped as u64)?;
                let began = Instant::now();
                let frozen = self.snapshot(&source, &name, read_only)?;
                let kind = if read_only { "snapshot" } else { "clone" };
                Ok(format!(
                    "{kind} '{name}' of '{src}' taken (writes held for {} us, {} us in all)",
                    frozen.as_micros(),
                    began.elapsed().as_micros()
                ))
            }
            Admin::Delete { name } => {
                let v = find(&name)?;
                let users = v.users.load(SeqCst);
                if users > 0 {
                    return Err(format!(
                        "volume '{name}' is open ({users} device{} on it): stop serving it first",
                        if users == 1 { "" } else { "s" }
                    ));
                }
                // Its last changes are captured before it leaves the tables.
                let mut records = Vec::new();
                self.capture(&mut records);
                lock(&self.inner.volumes).remove(&v.id);
                records.push(Record::Delete { vol: v.id });
                self.commit(records)?;
                Ok(format!("deleted volume '{name}' from thin pool '{pool}'"))
            }
            Admin::Grow { name, size } => {
                let v = find(&name)?;
                let now = v.size.load(Relaxed);
                if size < now {
                    return Err(format!(
                        "volume '{name}' is {} and cannot shrink to {}",
                        format_bytes(now),
                        format_bytes(size)
                    ));
                }
                check_size(size, self.inner.block_bytes(), v.table.blocks())?;
                self.commit(vec![Record::Grow { vol: v.id, size }])?;
                v.size.store(size, SeqCst);
                Ok(format!(
                    "volume '{name}' grown to {} (clients see it when they connect again)",
                    format_bytes(size)
                ))
            }
        }
    }

    /// Refuses a new volume named `name` of `size` bytes that would bring `entries`
    /// mappings with it, when the name is taken or bad, or the next checkpoint could not
    /// hold it.
    fn check_new(&self, name: &str, size: u64, entries: u64) -> Result<(), String> {
        check_name(name)?;
        if self.inner.volume(name).is_some() {
            return Err(format!(
                "thin pool '{}' has a volume '{name}' already",
                self.inner.name
            ));
        }
        check_size(size, self.inner.block_bytes(), VOLUME_BLOCKS_MAX)?;
        // The next checkpoint: every mapping a run, every block a state, and room for a
        // mapping of every free block (writes to come).
        let mapped: u64 = self
            .state
            .volumes
            .values()
            .map(|v| v.map.len() as u64)
            .sum();
        let volumes = self.state.volumes.len() as u64 + 1;
        let need = (mapped + entries + self.inner.data_blocks) * 21
            + self.inner.data_blocks * 22
            + volumes * 300;
        if need > self.sb.checkpoint_capacity {
            return Err(format!(
                "thin pool '{}': the metadata has room for {} and would need up to {} with this volume",
                self.inner.name,
                format_bytes(self.sb.checkpoint_capacity),
                format_bytes(need)
            ));
        }
        Ok(())
    }

    fn next_volume(&mut self) -> u32 {
        let id = self.sb.next_volume.max(1);
        self.sb.next_volume = id + 1;
        id
    }

    fn add_volume(&self, id: u32, name: &str, size: u64, read_only: bool) -> Arc<Volume> {
        let blocks = size.div_ceil(self.inner.block_bytes()).max(1);
        let v = Arc::new(Volume {
            id,
            name: name.to_string(),
            read_only,
            size: AtomicU64::new(size),
            table: Table::new(table_blocks(blocks)),
            frozen: AtomicBool::new(false),
            users: AtomicU32::new(0),
            mapped: AtomicU64::new(0),
        });
        lock(&self.inner.volumes).insert(id, v.clone());
        v
    }

    /// A snapshot or clone of `source` named `name`: writes to the source wait while
    /// its table is copied (see [`Inner::grace`]); returns how long they waited.
    fn snapshot(
        &mut self,
        source: &Arc<Volume>,
        name: &str,
        read_only: bool,
    ) -> Result<Duration, String> {
        let id = self.next_volume();
        let size = source.size.load(SeqCst);
        let began = Instant::now();
        source.frozen.store(true, SeqCst);
        self.inner.grace();
        // Every write to the source acknowledged so far is in its table, and none is in
        // flight: capture it, copy it, and let writes go on (they copy on write now).
        let mut records = Vec::new();
        self.capture(&mut records);
        let copy = self.add_volume(id, name, size, read_only);
        for (vb, e) in source.table.mapped() {
            copy.table.set(vb, e & !OWNED);
            if e & OWNED != 0 {
                let _ = source.table.swap_if(vb, e, e & !OWNED);
            }
        }
        source.frozen.store(false, SeqCst);
        let frozen = began.elapsed();
        records.push(Record::Snapshot {
            src: source.id,
            new: id,
            flags: u32::from(read_only),
            name: name.to_string(),
        });
        if let Err(e) = self.commit(records) {
            lock(&self.inner.volumes).remove(&id);
            return Err(e);
        }
        Ok(frozen)
    }

    /// The commit thread's loop: see the module's documentation.
    fn run(mut self) {
        loop {
            let (waiters, admin, stop) = {
                let mut w = lock(&self.inner.work);
                if w.waiters.is_empty() && w.admin.is_empty() && !w.kicked && !w.stop {
                    w = self
                        .inner
                        .work_cv
                        .wait_timeout(w, COMMIT_PERIOD)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                w.kicked = false;
                (
                    std::mem::take(&mut w.waiters),
                    std::mem::take(&mut w.admin),
                    w.stop,
                )
            };
            let result = self.commit(Vec::new());
            let status = match &result {
                Ok(()) => IoStatus::OK,
                Err(_) => IoStatus::errno(libc::EIO),
            };
            for w in waiters {
                let _ = w.reply.send((w.token, status));
                cairn_core::event::wake(&*w.wake);
            }
            for (op, reply) in admin {
                let _ = reply.send(self.admin(op));
            }
            self.release();
            if !self.inner.failed.load(Relaxed) && self.log_used * 4 > self.log_pages() {
                let _ = self.checkpoint(false);
            }
            if stop {
                break;
            }
        }
        // Stopping: the last changes, then a checkpoint marked clean.
        if self.commit(Vec::new()).is_ok() {
            self.release();
            let _ = self.commit(Vec::new());
            let _ = self.checkpoint(true);
        }
        let left = std::mem::take(&mut lock(&self.inner.work).admin);
        for (_, reply) in left {
            let _ = reply.send(Err(format!("thin pool '{}' stopped", self.inner.name)));
        }
    }
}

/// Table capacity for a volume of `blocks`: room to grow to 4 times its size.
fn table_blocks(blocks: u64) -> u64 {
    blocks
        .saturating_mul(4)
        .clamp(blocks, VOLUME_BLOCKS_MAX.max(blocks))
}

/// A volume size: a positive multiple of 4 KiB, at most [`VOLUME_BLOCKS_MAX`] blocks and
/// at most `table` blocks.
fn check_size(size: u64, block: u64, table: u64) -> Result<(), String> {
    if size == 0 || !size.is_multiple_of(4096) {
        return Err(format!(
            "a volume's size must be a positive multiple of 4KiB, not {size}"
        ));
    }
    let most = VOLUME_BLOCKS_MAX.min(table).saturating_mul(block);
    if size > most {
        return Err(format!(
            "{} is larger than the most this volume can have, {}",
            format_bytes(size),
            format_bytes(most)
        ));
    }
    Ok(())
}

/// A volume name: 1 to [`NAME_MAX`] bytes, no control characters, no '/' or whitespace.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty()
        || name.len() > NAME_MAX
        || name
            .chars()
            .any(|c| c.is_control() || c.is_whitespace() || c == '/')
    {
        return Err(format!(
            "'{}' is not a volume name (1 to {NAME_MAX} bytes, no spaces, '/' or control characters)",
            name.escape_default()
        ));
    }
    Ok(())
}

/// Consecutive runs of sorted `blocks`.
fn runs(blocks: &[u64]) -> Vec<(u64, u64)> {
    let mut sorted = blocks.to_vec();
    sorted.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for b in sorted {
        match out.last_mut() {
            Some((s, l)) if *s + *l == b => *l += 1,
            _ => out.push((b, 1)),
        }
    }
    out
}

/// Makes every block of `runs` read as zeros through `q` (the data device).
fn zero_runs(q: &BlockingQueue, inner: &Inner, runs: &[(u64, u64)]) -> Result<(), String> {
    let caps = q.geometry().caps;
    let op = if caps.discard {
        Op::Discard
    } else if caps.write_zeroes {
        Op::WriteZeroes
    } else {
        Op::Write
    };
    for &(start, len) in runs {
        let mut at = inner.data_offset + (start << inner.block_shift);
        let end = at + (len << inner.block_shift);
        while at < end {
            let n = (end - at).min(1 << 30);
            let r = if op == Op::Write {
                q.write(at, &vec![0u8; n.min(8 << 20) as usize], IoFlags::NONE)
                    .map(|()| n.min(8 << 20))
            } else {
                q.zero(op, at, n, IoFlags::NONE).map(|()| n)
            };
            at += r.map_err(|e| format!("zeroing at {at}: {e}"))?;
        }
    }
    Ok(())
}

/// Reads the whole superblock area and picks; `Ok(None)` when both slots are blank.
fn read_superblock(
    q: &BlockingQueue,
    what: &str,
) -> Result<Option<(PoolSuperblock, usize)>, Error> {
    let mut area = vec![0u8; sbk::SLOTS * sbk::SLOT_BYTES];
    q.read(0, &mut area)
        .map_err(|e| Error::Invalid(format!("reading the thin pool superblock on {what}: {e}")))?;
    match sbk::pick(&area) {
        Ok((sb, slot, damaged)) => {
            if let Some(d) = damaged {
                log::warn!("cairn: thin pool on {what}: superblock slot {} is damaged ({d:?}); using the other", 1 - slot);
            }
            Ok(Some((sb, slot)))
        }
        Err((sbk::Invalid::Blank, sbk::Invalid::Blank)) => Ok(None),
        Err((a, b)) => Err(Error::Invalid(format!(
            "{what} holds no thin pool superblock ({a:?}, {b:?}): a pool is created on blank devices only"
        ))),
    }
}

impl ThinPool {
    /// Opens the pool on `data` (and `meta`, else an area at the start of `data`):
    /// creates it when the metadata is blank, else loads and recovers it. `dry`: examine
    /// only, writing nothing (`cairn check`); `examined` says what was found.
    pub fn open(
        name: &str,
        data: Arc<dyn Device>,
        meta: Option<Arc<dyn Device>>,
        opts: PoolOptions,
        switches: Switches,
        dry: bool,
    ) -> Result<ThinPool, Error> {
        if dry {
            let (c, mut examined, mut describe) =
                prepare(name, data, meta.clone(), opts, switches, true)?;
            // What thin_check does: every count against the mappings that name it.
            let problems = c.state.check();
            if !problems.is_empty() {
                return Err(Error::Invalid(format!(
                    "thin pool '{name}': the metadata check found {} problem{}: {}",
                    problems.len(),
                    if problems.len() == 1 { "" } else { "s" },
                    problems
                        .iter()
                        .take(10)
                        .cloned()
                        .collect::<Vec<_>>()
                        .join("; ")
                )));
            }
            let used = c
                .state
                .blocks
                .iter()
                .filter(|b| **b != BlockState::Free)
                .count() as u64;
            examined.push(format!(
                "check: clean; {} of {} data in use",
                format_bytes(used << c.inner.block_shift),
                format_bytes(c.inner.data_blocks << c.inner.block_shift)
            ));
            for (id, v) in &c.state.volumes {
                let vol = c.add_volume(*id, &v.name, v.size, v.flags & 1 != 0);
                vol.mapped.store(v.map.len() as u64, Relaxed);
                examined.push(format!(
                    "volume '{}' {}{}: {} mapped",
                    v.name,
                    format_bytes(v.size),
                    if v.flags & 1 != 0 { " (snapshot)" } else { "" },
                    format_bytes((v.map.len() as u64) << c.inner.block_shift)
                ));
            }
            describe = format!("{describe}; {}", examined.join("; "));
            return Ok(ThinPool {
                inner: c.inner.clone(),
                meta,
                thread: Mutex::new(None),
                describe,
                examined,
            });
        }
        // The commit thread opens its own queues (they stay on one thread), loads and
        // recovers the pool, says how it went, and runs.
        let (tx, rx) = mpsc::channel();
        let (n, d, m) = (name.to_string(), data.clone(), meta.clone());
        let thread = std::thread::Builder::new()
            .name(format!("thin-{name}"))
            .spawn(move || {
                let started = prepare(&n, d, m, opts, switches, false).and_then(
                    |(mut c, words, describe)| {
                        recover(&mut c)
                            .map_err(|e| Error::Invalid(format!("thin pool '{n}': {e}")))?;
                        Ok((c, words, describe))
                    },
                );
                match started {
                    Ok((c, words, describe)) => {
                        let _ = tx.send(Ok((c.inner.clone(), words, describe)));
                        c.run();
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| Error::Os {
                context: "starting the thin pool's commit thread".into(),
                source: e,
            })?;
        let started = rx.recv().unwrap_or_else(|_| {
            Err(Error::Invalid(format!(
                "thin pool '{name}': its thread ended at start"
            )))
        });
        match started {
            Ok((inner, examined, describe)) => Ok(ThinPool {
                inner,
                meta,
                thread: Mutex::new(Some(thread)),
                describe,
                examined,
            }),
            Err(e) => {
                let _ = thread.join();
                Err(e)
            }
        }
    }

    /// The shared run-time pool.
    pub fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }
}

impl Drop for ThinPool {
    fn drop(&mut self) {
        lock(&self.inner.work).stop = true;
        self.inner.work_cv.notify_one();
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

impl Device for ThinPool {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn geometry(&self) -> cairn_core::Geometry {
        cairn_core::Geometry {
            size_bytes: self.inner.data_blocks << self.inner.block_shift,
            block_bytes: 4096,
            caps: cairn_core::Caps {
                flush: false,
                fua: false,
                discard: false,
                write_zeroes: false,
            },
        }
    }

    fn open_queue(
        &self,
        _core: &std::rc::Rc<cairn_core::Core>,
    ) -> Result<std::rc::Rc<dyn cairn_core::Queue>, Error> {
        Err(Error::Invalid(format!(
            "'{}' is a thin pool, not a block device: use a 'thin' device on it",
            self.inner.name
        )))
    }

    fn children(&self) -> Vec<Arc<dyn Device>> {
        let mut c = vec![self.inner.data.clone()];
        c.extend(self.meta.clone());
        c
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

/// A new pool's superblock for `data` (and `meta`).
fn new_superblock(
    data: &Arc<dyn Device>,
    meta: Option<&dyn Device>,
    opts: PoolOptions,
    meta_name: &str,
) -> Result<PoolSuperblock, Error> {
    let bad = |m: String| Error::Invalid(m);
    let block = opts.block_bytes.unwrap_or(BLOCK_DEFAULT);
    let size = data.geometry().size_bytes;
    let (data_offset, data_blocks, lay) = match meta {
        Some(m) => {
            let data_offset = sbk::DATA_OFFSET_MIN.max(block);
            let blocks = size.saturating_sub(data_offset) / block;
            let lay = layout(blocks);
            let have = m.geometry().size_bytes;
            if have < lay.end {
                return Err(bad(format!(
                    "metadata device '{meta_name}' is {}: a pool of {} blocks of {} needs at least {}",
                    format_bytes(have),
                    blocks,
                    format_bytes(block),
                    format_bytes(lay.end)
                )));
            }
            (data_offset, blocks, lay)
        }
        None => {
            let first = layout(size / block);
            let data_offset = round_up(first.end.max(sbk::DATA_OFFSET_MIN), block);
            let blocks = size.saturating_sub(data_offset) / block;
            (data_offset, blocks, layout(blocks))
        }
    };
    if data_blocks < 2 {
        return Err(bad(format!(
            "data device '{}' is {}: too small for a thin pool of {} blocks (it needs {} of metadata and 2 blocks at least)",
            data.name(),
            format_bytes(size),
            format_bytes(block),
            format_bytes(data_offset)
        )));
    }
    if data_blocks >= u64::from(u32::MAX >> 1) {
        return Err(bad(format!(
            "data device '{}' has {} blocks of {}; a pool has at most {} (use a larger block)",
            data.name(),
            data_blocks,
            format_bytes(block),
            (u32::MAX >> 1) - 1
        )));
    }
    let low_water_blocks = match opts.low_water {
        LowWater::Bytes(b) => (b / block).min(data_blocks),
        LowWater::Percent(p) => data_blocks * u64::from(p) / 100,
    };
    let sb = PoolSuperblock {
        generation: 1,
        pool_uuid: crate::array::new_uuid(),
        flags: if meta.is_none() {
            sbk::FLAG_META_ON_DATA
        } else {
            0
        },
        block_bytes: block,
        data_offset,
        data_blocks,
        log_offset: lay.log_offset,
        log_bytes: lay.log_bytes,
        checkpoints: lay.checkpoints,
        checkpoint_capacity: lay.capacity,
        checkpoint_in_use: 0,
        checkpoint_generation: 0,
        checkpoint_pages: 0,
        checkpoint_crc: 0,
        log_start_seq: 1,
        log_start_offset: (1 % (lay.log_bytes / LOG_PAGE as u64)) * LOG_PAGE as u64,
        low_water_blocks,
        created_secs: now_secs(),
        updated_secs: now_secs(),
        next_volume: 1,
    };
    Ok(sb)
}

/// The state the metadata on `q` holds: the checkpoint, then every whole commit of the
/// log; with the sequence number the next commit gets and what was found, in words.
fn load(q: &BlockingQueue, sb: &PoolSuperblock) -> Result<(PoolState, u64, Vec<String>), Error> {
    let bad = |m: String| Error::Invalid(m);
    let mut words = Vec::new();
    let mut state = if sb.checkpoint_in_use == 0 {
        PoolState::new(sb.block_bytes, sb.data_blocks as usize)
    } else {
        let at = sb.checkpoints[sb.checkpoint_in_use as usize - 1];
        let mut area = vec![0u8; (sb.checkpoint_pages * sbk::PAGE) as usize];
        q.read(at, &mut area)
            .map_err(|e| bad(format!("reading the thin pool checkpoint: {e}")))?;
        let pages: Vec<&[u8]> = area.chunks(sbk::PAGE as usize).collect();
        let crcs: Vec<u8> = pages
            .iter()
            .flat_map(|p| p[p.len() - 4..].to_vec())
            .collect();
        if crc32c::crc32c(&crcs) != sb.checkpoint_crc {
            return Err(bad(
                "the thin pool's checkpoint does not match its superblock (damaged metadata)"
                    .into(),
            ));
        }
        let s = checkpoint::load(
            &pages,
            &sb.pool_uuid,
            sb.checkpoint_generation,
            sb.block_bytes,
            sb.data_blocks as usize,
        )
        .map_err(|e| bad(format!("the thin pool's checkpoint is damaged: {e}")))?;
        words.push(format!(
            "checkpoint {} ({} pages) valid",
            sb.checkpoint_generation, sb.checkpoint_pages
        ));
        s
    };
    let pages = sb.log_bytes / LOG_PAGE as u64;
    let mut ring = vec![0u8; sb.log_bytes as usize];
    q.read(sb.log_offset, &mut ring)
        .map_err(|e| bad(format!("reading the thin pool log: {e}")))?;
    let start = sb.log_start_offset / LOG_PAGE as u64;
    let blocks: Vec<&[u8]> = (0..pages)
        .map(|i| {
            let p = ((start + i) % pages) as usize * LOG_PAGE;
            &ring[p..p + LOG_PAGE]
        })
        .collect();
    let (records, end) = format::replay(&blocks, &sb.pool_uuid, sb.log_start_seq);
    for r in &records {
        state.apply(r).map_err(|e| {
            bad(format!(
                "the thin pool's log holds a record that breaks the pool's rules ({e}); the metadata needs checking"
            ))
        })?;
    }
    words.push(format!(
        "log: {} records in {} blocks replayed",
        records.len(),
        end - sb.log_start_seq
    ));
    state.freed.clear();
    Ok((state, end, words))
}

/// After opening: zeroes what may hold data no mapping names, writes a checkpoint of the
/// recovered state (the log starts afresh), and fills the volumes and the free list.
fn recover(c: &mut Committer) -> Result<(), String> {
    let new = c.new;
    let clean = c.sb.flags & sbk::FLAG_CLEAN != 0 && !new;
    let mut dirty = Vec::new();
    for (b, s) in c.state.blocks.iter().enumerate() {
        let zero = match s {
            BlockState::Free => !clean,
            BlockState::Reserved | BlockState::FreeDirty => true,
            BlockState::Used(_) => false,
        };
        if zero {
            dirty.push(b as u64);
        }
    }
    let r = runs(&dirty);
    zero_runs(&c.data, &c.inner, &r)?;
    for b in &dirty {
        c.state.blocks[*b as usize] = BlockState::Free;
    }
    if !clean && !new {
        log::info!(
            "cairn: {}: thin pool was not stopped cleanly: {} free blocks zeroed",
            c.inner.name,
            dirty.len()
        );
    }
    c.checkpoint(false)?;
    let mut used = 0;
    let mut zeroed = Vec::new();
    for (b, s) in c.state.blocks.iter().enumerate().rev() {
        match s {
            BlockState::Free => zeroed.push(b as u32),
            _ => used += 1,
        }
    }
    lock(&c.inner.free).zeroed = zeroed;
    c.inner.used_blocks.store(used, Relaxed);
    let volumes: Vec<(u32, state::Volume)> = c
        .state
        .volumes
        .iter()
        .map(|(id, v)| (*id, v.clone()))
        .collect();
    for (id, v) in volumes {
        let live = c.add_volume(id, &v.name, v.size, v.flags & 1 != 0);
        for (&vb, &e) in &v.map {
            live.table.set(vb, e);
        }
        live.mapped.store(v.map.len() as u64, Relaxed);
        if id >= c.sb.next_volume {
            c.sb.next_volume = id + 1;
        }
    }
    c.publish();
    Ok(())
}

/// Opens the metadata on this thread: the committed state, the run-time pool (not
/// running yet), what was found in words, and the pool's one-line description. A new
/// pool's superblock is written unless `dry`.
fn prepare(
    name: &str,
    data: Arc<dyn Device>,
    meta: Option<Arc<dyn Device>>,
    opts: PoolOptions,
    switches: Switches,
    dry: bool,
) -> Result<(Committer, Vec<String>, String), Error> {
    let bad = |m: String| Error::Invalid(m);
    let data_q = BlockingQueue::open(&data, switches)?;
    let meta_q = meta
        .as_ref()
        .map(|m| BlockingQueue::open(m, switches))
        .transpose()?;
    let meta_name = meta.as_ref().map_or(data.name(), |m| m.name()).to_string();
    let mq = meta_q.as_ref().unwrap_or(&data_q);
    let data_size = data.geometry().size_bytes;
    let mut examined = Vec::new();
    let (sb, slot, state, fresh) = match read_superblock(mq, &format!("'{meta_name}'"))? {
        Some((sb, slot)) => {
            if let Some(b) = opts.block_bytes {
                if b != sb.block_bytes {
                    return Err(bad(format!(
                        "the pool was made with block = {}; the stack file says {} (a pool's block size never changes)",
                        format_bytes(sb.block_bytes),
                        format_bytes(b)
                    )));
                }
            }
            let need = sb.data_offset + (sb.data_blocks << sb.block_bytes.trailing_zeros());
            if data_size < need {
                return Err(bad(format!(
                    "data device '{}' is {}, smaller than the pool's {} (wrong device?)",
                    data.name(),
                    format_bytes(data_size),
                    format_bytes(need)
                )));
            }
            if (sb.flags & sbk::FLAG_META_ON_DATA != 0) != meta.is_none() {
                return Err(bad(
                    "the pool's metadata is recorded as being elsewhere: check the 'metadata' key"
                        .into(),
                ));
            }
            let (state, seq, words) = load(mq, &sb)?;
            examined.extend(words);
            (sb, slot, state, Some(seq))
        }
        None => {
            let sb = new_superblock(&data, meta.as_deref(), opts, &meta_name)?;
            examined.push(format!(
                "new thin pool: {} blocks of {}, metadata {} (to be created)",
                sb.data_blocks,
                format_bytes(sb.block_bytes),
                format_bytes(layout(sb.data_blocks).end)
            ));
            let state = PoolState::new(sb.block_bytes, sb.data_blocks as usize);
            (sb, 1, state, None)
        }
    };
    let block_shift = sb.block_bytes.trailing_zeros();
    let low_water_blocks = sb.low_water_blocks;
    let mut report = PoolReport {
        name: name.to_string(),
        block_bytes: sb.block_bytes,
        data_blocks: sb.data_blocks,
        checkpoint_capacity: sb.checkpoint_capacity,
        log_bytes: sb.log_bytes,
        low_water_blocks,
        ..PoolReport::default()
    };
    report.checkpoint_bytes = sb.checkpoint_pages * sbk::PAGE;
    let inner = Arc::new(Inner {
        name: name.to_string(),
        data: data.clone(),
        block_shift,
        data_offset: sb.data_offset,
        data_blocks: sb.data_blocks,
        volumes: Mutex::new(BTreeMap::new()),
        free: Mutex::new(Free::default()),
        epoch: AtomicU64::new(0),
        gates: Mutex::new(Vec::new()),
        work: Mutex::new(Work::default()),
        work_cv: Condvar::new(),
        failed: AtomicBool::new(false),
        used_blocks: AtomicU64::new(0),
        low_water_blocks,
        low_said: AtomicBool::new(false),
        report: Mutex::new(report),
        running: !dry,
        crashed: AtomicBool::new(false),
    });
    let describe = format!(
        "thin-pool block={} data={} blocks metadata={}",
        format_bytes(sb.block_bytes),
        sb.data_blocks,
        if meta.is_some() {
            meta_name.clone()
        } else {
            "on data".into()
        }
    );
    let mut c = Committer {
        inner: inner.clone(),
        state,
        sb,
        sb_slot: slot,
        next_seq: 0,
        commit_id: 0,
        log_used: 0,
        pending: Vec::new(),
        checkpoint_bytes: 0,
        data: data_q,
        meta: meta_q,
        leaf: Box::new([0; LEAF_ENTRIES]),
        commits: 0,
        new: false,
    };
    c.next_seq = fresh.unwrap_or(1);
    c.commit_id = c.next_seq;
    c.checkpoint_bytes = c.sb.checkpoint_pages * sbk::PAGE;
    c.new = fresh.is_none();
    if dry {
        return Ok((c, examined, describe));
    }
    if fresh.is_none() {
        // A new pool: the superblock first, so that a crash leaves a pool to open.
        let mut sb = c.sb.clone();
        sb.created_secs = now_secs();
        c.meta()
            .write(0, &sb.encode(), IoFlags::NONE)
            .and_then(|()| c.meta().flush())
            .map_err(|e| {
                bad(format!(
                    "writing the thin pool superblock on '{meta_name}': {e}"
                ))
            })?;
        c.sb = sb;
        c.sb_slot = 0;
        log::info!(
            "cairn: {name}: new thin pool of {} ({} blocks of {})",
            format_bytes(c.sb.data_blocks << block_shift),
            c.sb.data_blocks,
            format_bytes(c.sb.block_bytes)
        );
    }
    Ok((c, examined, describe))
}
