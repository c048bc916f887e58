//! A thin pool at run time: the volumes' tables the reactors use, the free blocks they
//! allocate from, and the commit thread that makes their changes durable.
//!
//! - **Reactors** ([`super::volume`]) look mappings up and change them in the volumes'
//!   lock-free [`Table`]s, taking blocks from a small per-queue stash refilled from
//!   [`ThinPool::take_blocks`] (one lock per [`STASH`] allocations), and mark the leaf
//!   they changed. Nothing else: no log record is made on the reactor.
//! - **The commit thread** (one per pool) finds the changed leaves, compares them with the
//!   committed [`PoolState`] and logs the differences as records: many flushes and FUA
//!   writes, one commit (technique 1). Order of a commit: capture the tables, flush the
//!   data device (so every block a captured mapping names holds its data), write the log
//!   blocks and flush the metadata, answer the waiters. Blocks the commit freed are zeroed
//!   only after a grace period (no request that looked up the old mapping is in flight),
//!   on a thread of their own ([`super::zeroing`]), and then go back to the free list: a free block always reads as zeros, so a first write of
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

use cairn_core::size::format_bytes;
use cairn_core::{ChangeLog, Device, Error, IoStatus, Offer, Switches, Want};

use super::capability::ThinPoolAdmin;
use super::error::{Down, ThinError};
use super::format;
use super::open::{prepare, recover};
use super::state::BlockState;
use super::table::Table;
use super::volume::ThinDevice;

/// The allocation unit when the stack file names none (see README "Thin pools").
pub const BLOCK_DEFAULT: u64 = 64 << 10;
/// Blocks a queue takes from the pool at once.
pub const STASH: usize = 16;
/// A commit runs at least this often while anything changed (as dm-thin's).
pub(super) const COMMIT_PERIOD: Duration = Duration::from_secs(1);
/// Longest volume name.
pub const NAME_MAX: usize = format::NAME_MAX;
/// Largest virtual size of a volume, in blocks (entries hold block + 1 in 31 bits).
pub const VOLUME_BLOCKS_MAX: u64 = 1 << 30;
/// Checkpoint bytes reserved per data block (a random mapping costs a run record of 21
/// bytes per volume that maps it, a block state record 22).
pub(super) const CHECKPOINT_BYTES_PER_BLOCK: u64 = 128;

pub(super) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One volume (a thin volume, a snapshot or a clone) as the reactors see it.
pub(crate) struct Volume {
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
    /// A snapshot of it is being taken: writes wait (see [`Inner::hold_writes`]).
    pub frozen: AtomicBool,
    /// Thin devices open on it (a delete is refused while any is).
    pub users: AtomicU32,
    /// Blocks it maps, as of the last commit.
    pub mapped: AtomicU64,
    /// The log of its changes (dirty bitmaps), marked by every queue of every device on
    /// it inside the pool's gate, before any of a write's data can land.
    pub changes: std::sync::OnceLock<Arc<dyn ChangeLog>>,
}

/// A queue's requests in flight, in four slots: by the parity of the pool's epoch they
/// started under, and by whether they may change what a snapshot of the volume copies
/// ([`Gate::slot`]). A freed block waits for every slot of its parity ([`Inner::grace`]);
/// a snapshot waits only for the changing slots of its volume's queues
/// ([`Inner::hold_writes`]).
pub(crate) struct Gate {
    /// The volume its queue serves.
    pub(super) vol: u32,
    pub(super) n: [AtomicU64; 4],
}

impl Gate {
    /// The gate of a queue on volume `vol`, counting nothing yet.
    pub(super) fn new(vol: u32) -> Gate {
        Gate {
            vol,
            n: Default::default(),
        }
    }

    /// The slot of a request under epoch `parity`: a changing one (a write in place, an
    /// entry changed, data written into a block the entry maps) or not (a read, or a
    /// copy on write between its decision and its swap: it reads a block that stays
    /// shared and writes one no one else maps).
    #[inline]
    pub(super) fn slot(changing: bool, parity: usize) -> usize {
        debug_assert!(parity < 2, "parity {parity}");
        (usize::from(changing) << 1) | parity
    }
}

/// How far the commit thread got: captures of the tables begun, and how many of them a
/// durable commit holds. A reactor tells from these whether a mapping it read is durable
/// (a FUA write to it then needs no commit): see [`CommitSeq::durable`].
#[derive(Default)]
pub(crate) struct CommitSeq {
    /// Captures begun (counted before each clears any leaf's flag).
    captures: AtomicU64,
    /// Captures a durable commit holds.
    durable: AtomicU64,
}

impl CommitSeq {
    /// A capture begins (commit thread, before it takes any leaf's flag).
    pub(super) fn capturing(&self) -> u64 {
        self.captures.fetch_add(1, SeqCst) + 1
    }

    /// Every capture up to `n` is durable (commit thread).
    pub(super) fn made_durable(&self, n: u64) {
        debug_assert!(n <= self.captures.load(SeqCst), "capture {n} never began");
        self.durable.fetch_max(n, SeqCst);
    }

    /// The last capture begun (commit thread: it is the only one that begins them).
    pub(super) fn last(&self) -> u64 {
        self.captures.load(SeqCst)
    }

    /// Whether every capture begun so far is durable: read after a leaf was found
    /// captured ([`super::table::Table::captured`]), whatever capture took its changes
    /// is one of these.
    #[inline]
    pub(super) fn durable(&self) -> bool {
        let begun = self.captures.load(SeqCst);
        self.durable.load(SeqCst) >= begun
    }
}

/// A flush (or FUA write) waiting for the next commit.
pub(crate) struct Waiter {
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
    /// A backup checkpoint `name` of `src`: a snapshot `name` taken while writes to `src`
    /// are held, marked as its checkpoint, whose changes are reported in units of
    /// `granularity` bytes (default: the previous checkpoint's, else the pool's block).
    #[allow(missing_docs)]
    Checkpoint {
        src: String,
        name: String,
        granularity: Option<u64>,
    },
    /// Away with checkpoint `name` of `volume`, and its snapshot: the checkpoints before it
    /// keep their changes (see [`super::backup`]).
    #[allow(missing_docs)]
    Uncheckpoint { volume: String, name: String },
    /// Export `name` of `volume` (added while serving) is kept for the next start.
    #[allow(missing_docs)]
    Export {
        name: String,
        volume: String,
        writable: bool,
    },
    /// Export `name` is no longer kept.
    #[allow(missing_docs)]
    Unexport { name: String },
}

#[derive(Default)]
pub(super) struct Work {
    pub(super) waiters: Vec<Waiter>,
    pub(super) admin: VecDeque<(Admin, Sender<Result<String, ThinError>>)>,
    pub(super) kicked: bool,
    pub(super) stop: bool,
}

/// Free blocks, handed to queues.
#[derive(Default)]
pub(super) struct Free {
    /// Free and zeroed, highest first (popped from the end: low blocks go first).
    pub(super) zeroed: Vec<u32>,
    /// Written but never mapped (a queue lost a race for an entry): zeroed by the commit
    /// thread before reuse.
    pub(super) dirty: Vec<u32>,
    /// Owned blocks a queue unmapped (a discard): those no commit recorded as mapped
    /// are zeroed and freed by the commit thread (the others are freed by the commit
    /// that records the unmapping).
    pub(super) unmapped: Vec<u32>,
    /// Freed by a commit and being zeroed: space that is coming (a write waits for it
    /// rather than failing).
    pub(super) coming: u64,
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
    /// Flushes and FUA writes answered by a commit so far (since open): a FUA write in
    /// place into a block whose mapping is durable needs none.
    pub commit_waits: u64,
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
    /// Open a pool whose log is damaged with what replays up to the damage, dropping the
    /// commits after it (`cairn check --repair-thin POOL`; never from a stack file).
    pub repair: bool,
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

/// The run-time pool, shared by the commit thread, every queue and the admin (which
/// reaches it through the pool device's [`ThinPoolAdmin`] capability only).
pub(crate) struct Inner {
    pub(super) name: String,
    pub(super) data: Arc<dyn Device>,
    pub(super) block_shift: u32,
    pub(super) data_offset: u64,
    pub(super) data_blocks: u64,
    pub(super) volumes: Mutex<BTreeMap<u32, Arc<Volume>>>,
    pub(super) free: Mutex<Free>,
    pub(super) epoch: AtomicU64,
    pub(super) gates: Mutex<Vec<Weak<Gate>>>,
    pub(super) work: Mutex<Work>,
    pub(super) work_cv: Condvar,
    /// A metadata write or a record failed: no more commits; flushes fail with EIO.
    pub(super) failed: AtomicBool,
    pub(super) used_blocks: AtomicU64,
    pub(super) low_water_blocks: u64,
    pub(super) low_said: AtomicBool,
    pub(super) report: Mutex<PoolReport>,
    /// The pool runs (a dry open for `cairn check` has no thread and takes no writes).
    pub(super) running: bool,
    /// Tests: stop as a crash would, with no last commit or checkpoint.
    pub(super) crashed: AtomicBool,
    /// The backup checkpoints as of the last commit, and the state's change count they
    /// were copied at (see [`PoolState::marks_changed`](super::state::PoolState)).
    pub(super) marks: Mutex<(u64, Arc<Marks>, Arc<Exports>)>,
    /// Which captures of the tables are durable.
    pub(super) commit_seq: CommitSeq,
}

/// Exports added while serving, kept for the next start: name -> (volume id, flags).
pub(crate) type Exports = BTreeMap<String, (u32, u32)>;

/// The backup checkpoints by id.
pub(crate) type Marks = BTreeMap<u32, super::backup::Mark>;

/// A thin pool: a [`Device`] only so that the stack can hold and print it (it serves no
/// I/O itself; its volumes do, through `thin` devices).
pub struct ThinPool {
    inner: Arc<Inner>,
    meta: Option<Arc<dyn Device>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    describe: String,
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
        // Highest first, as the free list keeps them: the queue pops the lowest first, so
        // a sequential write lands on consecutive blocks in order.
        stash.extend(free.zeroed.drain(at..));
        debug_assert!(
            stash.iter().all(|&b| u64::from(b) < self.data_blocks),
            "a free block past the pool's {} blocks",
            self.data_blocks
        );
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
        debug_assert!(u64::from(block) < self.data_blocks, "block {block}");
        lock(&self.free).dirty.push(block);
        self.kick();
    }

    /// A queue unmapped owned block `block` (see [`Free::unmapped`]).
    pub(super) fn unmapped(&self, block: u32) {
        debug_assert!(u64::from(block) < self.data_blocks, "block {block}");
        lock(&self.free).unmapped.push(block);
    }

    /// Counts a request of a queue in flight, in a changing slot or not (see
    /// [`Gate::slot`]): returns the slot to leave.
    #[inline]
    pub(super) fn enter(&self, gate: &Gate, changing: bool) -> usize {
        loop {
            let e = self.epoch.load(SeqCst);
            let slot = Gate::slot(changing, (e & 1) as usize);
            gate.n[slot].fetch_add(1, SeqCst);
            if self.epoch.load(SeqCst) == e {
                return slot;
            }
            gate.n[slot].fetch_sub(1, SeqCst);
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

    /// Waits until no request that started before this call is in flight (the commit
    /// thread only, never while a volume's writes are held: a copy on write waits for
    /// them to swap its entry): after it, no request can still use a mapping changed
    /// before it.
    pub(super) fn grace(&self) {
        let old = self.epoch.fetch_add(1, SeqCst);
        let parity = (old & 1) as usize;
        let (changing, reading) = (Gate::slot(true, parity), Gate::slot(false, parity));
        // The changing slot first: a copy on write moves from it to the other slot of
        // the same parity (counted there before it leaves), never back alone.
        self.wait_for(|g| g.n[changing].load(SeqCst) != 0 || g.n[reading].load(SeqCst) != 0);
    }

    /// Holds new writes to `v` and waits until none that changes what a snapshot of it
    /// copies is in flight (the commit thread only): its table is then still until
    /// `v.frozen` is cleared. Copies on write in flight go on, and only their swaps
    /// wait for that (see [`Gate::slot`]).
    pub(super) fn hold_writes(&self, v: &Volume) {
        v.frozen.store(true, SeqCst);
        // No flip of the epoch: frozen keeps new writes out of the changing slots (a
        // write enters its slot, then looks at it), so they only drain. Reads go on.
        let changing = [Gate::slot(true, 0), Gate::slot(true, 1)];
        self.wait_for(|g| g.vol == v.id && changing.iter().any(|&s| g.n[s].load(SeqCst) != 0));
    }

    /// Waits until no queue's gate is `busy`.
    fn wait_for(&self, busy: impl Fn(&Gate) -> bool) {
        let began = Instant::now();
        let mut told = false;
        loop {
            let any = lock(&self.gates)
                .iter()
                .filter_map(Weak::upgrade)
                .any(|g| busy(&g));
            if !any {
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

    /// The backup checkpoints as of the last commit.
    pub(super) fn marks(&self) -> Arc<Marks> {
        lock(&self.marks).1.clone()
    }

    /// A volume by id.
    pub(super) fn volume_by_id(&self, id: u32) -> Option<Arc<Volume>> {
        lock(&self.volumes).get(&id).cloned()
    }

    /// A volume by name.
    pub(super) fn volume(&self, name: &str) -> Option<Arc<Volume>> {
        lock(&self.volumes)
            .values()
            .find(|v| v.name == name)
            .cloned()
    }

    /// Runs an admin operation on the commit thread and waits for its answer.
    pub(crate) fn admin(&self, op: Admin) -> Result<String, ThinError> {
        if !self.running {
            return Err(self.down(Down::NotRunning));
        }
        let (tx, rx) = mpsc::channel();
        {
            let mut w = lock(&self.work);
            if w.stop {
                return Err(self.down(Down::Stopping));
            }
            w.admin.push_back((op, tx));
        }
        self.work_cv.notify_one();
        rx.recv().unwrap_or_else(|_| Err(self.down(Down::Stopped)))
    }

    /// The refusal of an operation while the pool is `why`.
    pub(super) fn down(&self, why: Down) -> ThinError {
        ThinError::Down {
            pool: self.name.clone(),
            why,
        }
    }

    /// The pool's name (its device's in the stack file).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Whether the pool has a volume `name` (a snapshot, say).
    pub(crate) fn has_volume(&self, name: &str) -> bool {
        lock(&self.volumes).values().any(|v| v.name == name)
    }

    /// Opens (or, with `create`, creates when absent) volume `name` of `size` bytes
    /// (`None`: as it is; larger: grown). Returns it with its user count raised.
    pub(crate) fn attach(
        &self,
        name: &str,
        size: Option<u64>,
        create: bool,
    ) -> Result<Arc<Volume>, Error> {
        let bad = |m: String| Error::Invalid(m);
        let refused = |e: ThinError| Error::Invalid(e.to_string());
        if self.volume(name).is_none() {
            let Some(size) = size else {
                return Err(bad(format!(
                    "thin pool '{}' has no volume '{name}', and no 'size' to create it with",
                    self.name
                )));
            };
            if !create {
                check_name(name).map_err(refused)?;
                check_size(size, self.block_bytes(), VOLUME_BLOCKS_MAX).map_err(refused)?;
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
                    changes: std::sync::OnceLock::new(),
                });
                return Ok(v);
            }
            self.admin(Admin::Create {
                name: name.into(),
                size,
            })
            .map_err(refused)?;
        }
        let v = self
            .volume(name)
            .ok_or_else(|| bad(format!("volume '{name}' went away")))?;
        if let Some(size) = size {
            let now = v.size.load(SeqCst);
            if size < now {
                return Err(bad(format!(
                    "volume '{name}' is {}; 'size' says {} (a volume never shrinks: it was grown \
                     while served, say; set size = \"{}\" in its table, or leave the key out)",
                    format_bytes(now),
                    format_bytes(size),
                    cairn_core::size::exact_size(now)
                )));
            }
            if size > now && create {
                self.admin(Admin::Grow {
                    name: name.into(),
                    size,
                })
                .map_err(refused)?;
            }
        }
        v.users.fetch_add(1, SeqCst);
        Ok(v)
    }

    /// For crash tests: the commit thread stops at once when the pool closes, as if the
    /// process died (no last commit, no checkpoint; nothing is written after this call
    /// returns except a commit already under way).
    pub(crate) fn crash_on_close(&self) {
        self.crashed.store(true, SeqCst);
    }

    /// Status facts.
    pub(crate) fn report(&self) -> PoolReport {
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

/// Table capacity for a volume of `blocks`: room to grow to 4 times its size.
pub(super) fn table_blocks(blocks: u64) -> u64 {
    blocks
        .saturating_mul(4)
        .clamp(blocks, VOLUME_BLOCKS_MAX.max(blocks))
}

/// A volume size: a positive multiple of 4 KiB, at most [`VOLUME_BLOCKS_MAX`] blocks and
/// at most `table` blocks.
pub(super) fn check_size(size: u64, block: u64, table: u64) -> Result<(), ThinError> {
    if size == 0 || !size.is_multiple_of(4096) {
        return Err(ThinError::Invalid(format!(
            "a volume's size must be a positive multiple of 4KiB, not {size}"
        )));
    }
    let most = VOLUME_BLOCKS_MAX.min(table).saturating_mul(block);
    if size > most {
        return Err(ThinError::Invalid(format!(
            "{} is larger than the most this volume can have, {}",
            format_bytes(size),
            format_bytes(most)
        )));
    }
    Ok(())
}

/// A volume name: 1 to [`NAME_MAX`] bytes, no control characters, no '/' or whitespace.
pub fn check_name(name: &str) -> Result<(), ThinError> {
    if name.is_empty()
        || name.len() > NAME_MAX
        || name
            .chars()
            .any(|c| c.is_control() || c.is_whitespace() || c == '/')
    {
        return Err(ThinError::BadName {
            name: name.to_string(),
        });
    }
    Ok(())
}

impl ThinPool {
    /// Opens the pool on `data` (and `meta`, else an area at the start of `data`):
    /// creates it when the metadata is blank, else loads and recovers it. `dry`: examine
    /// only, writing nothing (`cairn check`; what it found is in `describe`).
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
            });
        }
        // The commit thread opens its own queues (they stay on one thread), loads and
        // recovers the pool, says how it went, and runs.
        let (tx, rx) = mpsc::channel();
        let (n, d, m) = (name.to_string(), data.clone(), meta.clone());
        let thread = std::thread::Builder::new()
            .name(format!("thin-{name}"))
            .spawn(move || {
                // SIGTERM and SIGINT are for `cairn serve`'s main thread.
                cairn_core::reactor::block_signals_in_this_thread();
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
            Ok((inner, _, describe)) => Ok(ThinPool {
                inner,
                meta,
                thread: Mutex::new(Some(thread)),
                describe,
            }),
            Err(e) => {
                let _ = thread.join();
                Err(e)
            }
        }
    }

    /// For crash tests: the commit thread stops at once when the pool closes, as if the
    /// process died (no last commit, no checkpoint; nothing is written after this call
    /// returns except a commit already under way).
    pub fn crash_on_close(&self) {
        self.inner.crash_on_close();
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

    fn offer(self: Arc<Self>, want: Want) -> Option<Offer> {
        want.offer::<dyn ThinPoolAdmin>(|| self)
    }
}

impl ThinPoolAdmin for ThinPool {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn report(&self) -> PoolReport {
        self.inner.report()
    }

    fn has_volume(&self, name: &str) -> bool {
        self.inner.has_volume(name)
    }

    fn checkpoints(&self) -> Vec<super::backup::CheckpointInfo> {
        super::backup::list(&self.inner)
    }

    fn exports(&self) -> Vec<(String, String, bool)> {
        let exports = lock(&self.inner.marks).2.clone();
        let volumes = lock(&self.inner.volumes);
        exports
            .iter()
            .filter_map(|(name, &(vol, flags))| {
                Some((
                    name.clone(),
                    volumes.get(&vol)?.name.clone(),
                    flags & 1 != 0,
                ))
            })
            .collect()
    }

    fn admin(&self, op: Admin) -> Result<String, ThinError> {
        self.inner.admin(op)
    }

    fn open_volume(
        self: Arc<Self>,
        name: &str,
        volume: &str,
        size: Option<u64>,
        create: bool,
    ) -> Result<ThinDevice, Error> {
        let inner = self.inner.clone();
        ThinDevice::new(name, self, inner, volume, size, create)
    }
}
