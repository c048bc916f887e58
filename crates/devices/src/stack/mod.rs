//! Stacked devices: linear, stripe (RAID0), mirror (RAID1) and raid10, over one engine.
//!
//! A [`Layout`] says where each byte of the stacked device lives: on which member, at
//! which offset, in how many copies. [`StackQueue`] does the rest for every layout: it
//! splits a request at chunk and member boundaries, submits the pieces to its members'
//! queues on the same reactor (technique 4: no hand-off to another thread), and completes
//! the request when every piece has. Per-request state lives in two per-queue slabs.
//!
//! Redundant layouts (copies > 1) keep going when members fail: a failed read is retried
//! on another copy, and once another copy answered, the range is rewritten on the copy
//! that failed ([`repair`]: read repair); a failed write, discard or flush (or a failed
//! repair) marks the member failed and the array runs degraded (logged once, and listed
//! by `Device::failed_members`). A request fails only when some of its data has no
//! healthy copy left.

mod layouts;
mod options;
mod rebuild;
mod repair;

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;

use cairn_core::slab::Slab;
use cairn_core::{
    Caps, Core, Device, Error, FlushBatcher, Geometry, Io, IoFlags, IoStatus, Op, Queue,
    QueueStats, Sink, SinkId,
};

pub use layouts::{AnyLayout, Linear, Mirror, Raid10, Stripe, COPIES_MAX};
pub use options::{ArrayOptions, DEFAULT_BITMAP_REGION, MISSING};

/// Where the bytes of a stacked device live.
pub trait Layout: Send + Sync {
    /// `linear`, `stripe`, `mirror` or `raid10`.
    fn kind(&self) -> &'static str;
    /// Size of the stacked device in bytes.
    fn size_bytes(&self) -> u64;
    /// Copies of every byte (1 for linear and stripe).
    fn copies(&self) -> usize;
    /// Length of the piece that starts at logical `offset`, at most `len`: pieces never
    /// cross a chunk or member boundary.
    fn piece_len(&self, offset: u64, len: u64) -> u64;
    /// Member index and member offset of copy `copy` of logical `offset`.
    fn locate(&self, offset: u64, copy: usize) -> (usize, u64);
    /// Where copy `copy` of the whole range lives, if it lies on one member in one piece
    /// (the common case, answered with one look-up).
    #[inline(always)]
    fn place(&self, offset: u64, len: u64, copy: usize) -> Option<(usize, u64)> {
        (self.piece_len(offset, len) == len).then(|| self.locate(offset, copy))
    }
    /// Layout parameters for reports, e.g. `chunk=65536 copies=2`.
    fn describe(&self) -> String;
}

/// Which members have failed, and which may be read; shared by every queue of the device.
///
/// Members are indexed `0..n` as the layout places them; index `n + m` is the replacement
/// being built for member `m` (`replace`), written with every write to `m` and never read.
/// Per-member vectors have `2 * n` entries.
struct Health {
    device: String,
    /// The layout's members.
    n: usize,
    names: std::sync::Mutex<Vec<String>>,
    failed: Vec<AtomicBool>,
    /// Holds current data (a member being rebuilt, stale or new is written, not read).
    readable: Vec<AtomicBool>,
    /// The copies may differ (the array was not stopped cleanly and is not resynced):
    /// every read goes to the first readable copy, so a block never reads two ways.
    one_copy: AtomicBool,
    /// Writes are counted per region while a rebuild runs (see [`rebuild`]).
    sync: rebuild::WriteCounts,
    /// Per member not readable: member offsets below this are current (rebuilt so far).
    below: Vec<AtomicU64>,
    /// Per member: recovered from the bitmap, so current outside its regions to recover.
    partial: Vec<AtomicBool>,
    /// The write-intent bitmap, if the array keeps one.
    bitmap: Option<Arc<crate::array::bitmap::Bitmap>>,
    /// The member devices (`None`: missing, removed, or no replacement), changed only by
    /// [`Health::switch`]; queues follow at their next request.
    devices: std::sync::Mutex<Vec<Option<Arc<dyn Device>>>>,
    /// Bumped by every change of `devices`.
    epoch: AtomicU64,
    /// Members failed so far, and a wake-up for the spares' thread at each.
    failures: std::sync::Mutex<u64>,
    failed_now: std::sync::Condvar,
    /// Every queue's count of requests in flight, by epoch parity.
    gates: std::sync::Mutex<Vec<std::sync::Weak<Gate>>>,
    /// Held by [`Health::switch`]: one at a time (control threads only).
    switching: std::sync::Mutex<()>,
    /// Read repairs (redundant layouts).
    repairs: repair::Repairs,
    /// Bumped when a change of members begins and when it ends (see
    /// [`Device::change_seq`]).
    changes: AtomicU64,
}

/// A change of members in progress ([`Health::changing`]); ends when dropped.
struct Changing<'a>(&'a AtomicU64);

impl Drop for Changing<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, SeqCst);
    }
}

/// A queue's requests in flight, counted by the parity of the epoch they were sent under:
/// once a switch sees the old parity's count at zero, every request any queue sends goes
/// to the new set of members, and no reply from an old one can come any more. An array
/// whose members can change counts every request; any other redundant one counts its
/// changes of data, so that read repair can wait for those sent before it started
/// counting them per region (see [`repair`]).
#[derive(Default)]
struct Gate {
    writes: [AtomicU64; 2],
}

impl Health {
    /// Takes writes and flushes.
    #[inline]
    fn ok(&self, member: usize) -> bool {
        !self.failed[member].load(Relaxed)
    }

    /// May be read.
    #[inline]
    fn readable(&self, member: usize) -> bool {
        self.readable[member].load(Relaxed)
    }

    /// May be read for `len` bytes at member offset `at` (data area), which hold array
    /// offset `logical` on (one piece): a member being rebuilt is current below its
    /// progress, and one recovered from the bitmap outside the regions that were dirty.
    #[inline]
    fn readable_at(&self, member: usize, logical: u64, at: u64, len: u64) -> bool {
        self.readable(member) || (self.ok(member) && self.current_at(member, logical, at, len))
    }

    #[cold]
    fn current_at(&self, member: usize, logical: u64, at: u64, len: u64) -> bool {
        at + len <= self.below[member].load(Relaxed)
            || (self.partial[member].load(Relaxed)
                && self
                    .bitmap
                    .as_ref()
                    .is_some_and(|b| b.regions_of(logical, len).all(|r| !b.to_recover(r))))
    }

    /// Whether a read of `len` bytes at `logical` must go to the first readable copy: the
    /// array was not stopped cleanly, the resync has not passed the read's end yet, and
    /// (with a bitmap) a region it touches was dirty.
    #[inline]
    fn one_copy_at(&self, logical: u64, len: u64) -> bool {
        self.one_copy.load(Relaxed)
            && logical + len > self.sync.synced_below.load(Relaxed)
            && self
                .bitmap
                .as_ref()
                .is_none_or(|b| b.regions_of(logical, len).any(|r| b.to_recover(r)))
    }

    /// Marks a change of members as running until the guard drops, for readers of
    /// [`Device::change_seq`].
    fn changing(&self) -> Changing<'_> {
        self.changes.fetch_add(1, SeqCst);
        Changing(&self.changes)
    }

    /// Takes `member` out of reads and writes; whether it was in use until now.
    fn mark_failed(&self, member: usize) -> bool {
        self.readable[member].store(false, Relaxed);
        let newly = !self.failed[member].swap(true, Relaxed);
        if newly {
            self.failed_event();
        }
        newly
    }

    fn fail(&self, member: usize, status: IoStatus) {
        if self.mark_failed(member) {
            if member >= self.n {
                log::warn!(
                    "cairn: {}: replacement '{}' for '{}' failed ({status}); the replace is abandoned",
                    self.device,
                    self.name(member),
                    self.name(member - self.n)
                );
            } else {
                log::warn!(
                    "cairn: {}: member '{}' failed ({status}); running degraded",
                    self.device,
                    self.name(member)
                );
            }
        }
    }

    /// Wakes the spares' thread: a member failed.
    #[cold]
    fn failed_event(&self) {
        *self.failures.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.failed_now.notify_all();
    }

    /// Member `m`'s name.
    fn name(&self, m: usize) -> String {
        let names = self.names.lock().unwrap_or_else(|p| p.into_inner());
        names.get(m).cloned().unwrap_or_default()
    }

    /// The member devices now (`0..n`, then the replacements).
    fn devices(&self) -> Vec<Option<Arc<dyn Device>>> {
        self.devices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether a replacement is being built for member `m`.
    fn replacing(&self, m: usize) -> bool {
        self.devices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(self.n + m)
            .is_some_and(Option::is_some)
    }

    /// Whether a working replacement is being built for member `m`.
    fn being_replaced(&self, m: usize) -> bool {
        self.replacing(m) && self.ok(self.n + m)
    }

    /// Changes the member devices: `change` edits them and their names; queues follow at
    /// their next request. Returns once no change of data sent to the old set is in
    /// flight, so that from then on every write reaches the new set (a write never
    /// misses a member being rebuilt). With no change, it waits for every change of data
    /// sent before it was called. Switches run one at a time (two at once would wait for
    /// each other's parity); callers never hold the metadata's lock (a write waiting for
    /// its bitmap bit would wait for it).
    fn switch(&self, change: impl FnOnce(&mut Vec<Option<Arc<dyn Device>>>, &mut Vec<String>)) {
        let _one = self.switching.lock().unwrap_or_else(|p| p.into_inner());
        let old = {
            let mut devices = self.devices.lock().unwrap_or_else(|p| p.into_inner());
            let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
            change(&mut devices, &mut names);
            self.epoch.fetch_add(1, SeqCst)
        };
        let parity = (old & 1) as usize;
        let began = std::time::Instant::now();
        let mut told = false;
        loop {
            let busy = {
                let mut gates = self.gates.lock().unwrap_or_else(|p| p.into_inner());
                gates.retain(|g| g.strong_count() > 0);
                gates
                    .iter()
                    .filter_map(std::sync::Weak::upgrade)
                    .any(|g| g.writes[parity].load(SeqCst) != 0)
            };
            if !busy {
                return;
            }
            if !told && began.elapsed() > std::time::Duration::from_secs(5) {
                log::warn!(
                    "cairn: {}: waiting for writes sent earlier to end (before a change of members or the first read repair)",
                    self.device
                );
                told = true;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// A device made of other devices.
pub struct StackDevice {
    shared: Arc<Shared>,
}

impl std::ops::Deref for StackDevice {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.shared
    }
}

/// A stacked device's state, shared with its control threads (rebuild, bitmap, spares).
pub struct Shared {
    name: String,
    layout: Arc<AnyLayout>,
    health: Arc<Health>,
    geometry: Geometry,
    /// Where data starts on every member (after the metadata area, if any).
    data_offset: u64,
    /// The superblocks, for an array that keeps them (its queues record failures in
    /// them).
    metadata: Option<Arc<crate::array::Metadata>>,
    /// The array's rebuild rate and bitmap settings.
    options: ArrayOptions,
    /// The rebuild thread and the thread that clears idle bitmap bits, while they run.
    threads: std::sync::Mutex<Threads>,
    /// Held by every change of members (admin actions, the end of a replace).
    changing: std::sync::Mutex<()>,
    /// Devices waiting to take the place of a member that fails, and their names.
    spares: std::sync::Mutex<Vec<(Arc<dyn Device>, String)>>,
    /// The thread that puts them there, while there are spares, and re-adds members
    /// that answer again (`readd`).
    watcher: std::sync::Mutex<Option<Thread>>,
    /// Per member: failed by the admin (never re-added but by the admin).
    by_admin: Vec<AtomicBool>,
    /// The specs of the devices opened while it runs (`add`, `replace`), by name.
    added: std::sync::Mutex<Vec<(String, String)>>,
    /// Per member: failed again soon after each of [`READD_FLAPS_MAX`] re-adds, so no
    /// longer re-added but by the admin.
    given_up: Vec<AtomicBool>,
}

/// A member re-added by `readd` that fails again within this long is flapping: the next
/// try waits twice as long as the one before.
const READD_FLAP_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);
/// Re-adds in a row that a flapping member gets before it is left failed (and the log
/// and `status` say so).
const READD_FLAPS_MAX: u32 = 5;
/// The longest wait between two tries of a flapping member.
const READD_BACKOFF_MAX: std::time::Duration = std::time::Duration::from_secs(600);

/// The members' thread's bookkeeping of one member's automatic re-adds.
#[derive(Clone, Copy, Default)]
struct Readd {
    /// When to try it next, while it is failed.
    next_try: Option<std::time::Instant>,
    /// When it was last re-added.
    last: Option<std::time::Instant>,
    /// Re-adds in a row after which it failed again within [`READD_FLAP_WINDOW`].
    flaps: u32,
}

/// A control thread's stop flag and handle.
type Thread = (Arc<AtomicBool>, std::thread::JoinHandle<()>);

#[derive(Default)]
struct Threads {
    rebuild: Option<Thread>,
    bitmap: Option<Thread>,
}

impl Threads {
    /// Stops and joins both.
    fn stop(&mut self) {
        for (stop, handle) in [self.rebuild.take(), self.bitmap.take()]
            .into_iter()
            .flatten()
        {
            stop.store(true, SeqCst);
            let _ = handle.join();
        }
    }
}

impl StackDevice {
    /// Stacks `members` with `layout` (the layout was built from the members' sizes).
    pub fn new(
        name: &str,
        layout: Arc<AnyLayout>,
        members: Vec<Arc<dyn Device>>,
    ) -> Result<StackDevice, Error> {
        if members.is_empty() {
            return Err(Error::Invalid(format!(
                "{name}: a {} needs members",
                layout.kind()
            )));
        }
        let block_bytes = members
            .iter()
            .map(|m| m.geometry().block_bytes)
            .max()
            .unwrap_or(512);
        let mut caps = Caps::ALL;
        for m in &members {
            let c = m.geometry().caps;
            caps.flush &= c.flush;
            caps.fua &= c.fua;
            caps.discard &= c.discard;
            caps.write_zeroes &= c.write_zeroes;
        }
        let size_bytes = layout.size_bytes() / u64::from(block_bytes) * u64::from(block_bytes);
        if size_bytes == 0 {
            return Err(Error::Invalid(format!(
                "{name}: members too small for a {}",
                layout.kind()
            )));
        }
        let n = members.len();
        let slots = 2 * n;
        let mut names: Vec<String> = members.iter().map(|m| m.name().to_string()).collect();
        names.resize(slots, String::new());
        let mut devices: Vec<Option<Arc<dyn Device>>> = members.into_iter().map(Some).collect();
        devices.resize(slots, None);
        let health = Arc::new(Health {
            device: name.into(),
            n,
            names: std::sync::Mutex::new(names),
            // No replacement is being built: those indices are failed.
            failed: (0..slots).map(|i| AtomicBool::new(i >= n)).collect(),
            readable: (0..slots).map(|i| AtomicBool::new(i < n)).collect(),
            one_copy: AtomicBool::new(false),
            sync: rebuild::WriteCounts::new(),
            below: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            partial: (0..slots).map(|_| AtomicBool::new(false)).collect(),
            bitmap: None,
            devices: std::sync::Mutex::new(devices),
            epoch: AtomicU64::new(0),
            failures: std::sync::Mutex::new(0),
            failed_now: std::sync::Condvar::new(),
            gates: std::sync::Mutex::new(Vec::new()),
            switching: std::sync::Mutex::new(()),
            repairs: repair::Repairs::new(n),
            changes: AtomicU64::new(0),
        });
        if layout.copies() > 1 {
            cairn_core::stats::registry().add_repairs(name, &health.repairs.counters);
        }
        Ok(StackDevice {
            shared: Arc::new(Shared {
                name: name.into(),
                geometry: Geometry {
                    size_bytes,
                    block_bytes,
                    caps,
                },
                layout,
                health,
                data_offset: 0,
                metadata: None,
                options: ArrayOptions::default(),
                threads: std::sync::Mutex::new(Threads::default()),
                changing: std::sync::Mutex::new(()),
                spares: std::sync::Mutex::new(Vec::new()),
                watcher: std::sync::Mutex::new(None),
                by_admin: (0..n).map(|_| AtomicBool::new(false)).collect(),
                added: std::sync::Mutex::new(Vec::new()),
                given_up: (0..n).map(|_| AtomicBool::new(false)).collect(),
            }),
        })
    }

    /// Gives the array (running on its superblocks) the spares its stack file lists:
    /// each must fit as a member would and be blank or this array's spare (not a member
    /// in use, nor another array's or someone's data); it gets a spare's superblock, and
    /// takes the place of the next member that fails.
    pub fn with_spares(self, spares: Vec<(Arc<dyn Device>, String)>) -> Result<StackDevice, Error> {
        if spares.is_empty() {
            return Ok(self);
        }
        let Some(meta) = self.shared.metadata.clone() else {
            return Err(Error::Invalid(format!(
                "device '{}': spares need metadata (their superblocks say whose spares they are)",
                self.shared.name
            )));
        };
        for (device, name) in &spares {
            self.shared
                .fits(device, name, meta.member_data(0))
                .and_then(|()| meta.make_spare(device, name))
                .map_err(|e| {
                    let what = if e.starts_with('\'') {
                        format!("spare {e}")
                    } else {
                        format!("spare '{name}': {e}")
                    };
                    Error::Invalid(format!("device '{}': {what}", self.shared.name))
                })?;
        }
        if !meta.dry() {
            let names: Vec<&str> = spares.iter().map(|(_, n)| n.as_str()).collect();
            log::info!(
                "cairn: {}: spares {}: each takes the place of the next member that fails",
                self.shared.name,
                names.join(", ")
            );
        }
        self.shared
            .spares
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(spares);
        if !meta.dry() {
            self.shared.watch_members();
        }
        Ok(self)
    }

    /// Runs the array on its superblocks: data starts after the metadata area; members
    /// that are missing are neither written nor read, and members that are not current
    /// (rebuilding, stale, new) are written but not read.
    pub fn with_metadata(
        mut self,
        metadata: crate::array::Metadata,
        options: ArrayOptions,
    ) -> StackDevice {
        use crate::array::superblock::MemberState;
        let Some(shared) = Arc::get_mut(&mut self.shared) else {
            unreachable!("a stacked device is shared only once it runs");
        };
        if let Some(health) = Arc::get_mut(&mut shared.health) {
            // No queue exists yet: the health is this device's alone.
            health.bitmap = metadata.bitmap().cloned();
        }
        for (m, state) in metadata.states().into_iter().enumerate() {
            let (ok, readable) = match state {
                MemberState::Active => (true, true),
                MemberState::Rebuilding => (true, false),
                MemberState::Failed | MemberState::Missing => (false, false),
            };
            shared.health.failed[m].store(!ok, Relaxed);
            shared.health.readable[m].store(readable, Relaxed);
            if state == MemberState::Rebuilding {
                let partial = metadata.partial(m) && shared.health.bitmap.is_some();
                shared.health.partial[m].store(partial, Relaxed);
                // Current below its checkpoint (for a partial recovery, below it every
                // dirty region was copied).
                if !partial {
                    shared.health.below[m].store(metadata.recovery_offset(m), Relaxed);
                }
            }
        }
        shared
            .health
            .one_copy
            .store(metadata.resync_pending(), Relaxed);
        shared.data_offset = metadata.data_offset();
        shared.options = options;
        // A member failed by a superblock write (the metadata logs it) is out of reads and
        // writes at once, as one failed by a data write is.
        let health = Arc::downgrade(&shared.health);
        metadata.set_on_fail(Box::new(move |m| {
            if let Some(h) = health.upgrade() {
                h.mark_failed(m);
            }
        }));
        let metadata = Arc::new(metadata);
        shared.metadata = Some(metadata.clone());
        if !metadata.dry() {
            let threads = self.shared.start_threads();
            *self.threads.lock().unwrap_or_else(|p| p.into_inner()) = threads;
            if options.readd.is_some() && self.layout.copies() > 1 {
                self.shared.watch_members();
            }
        }
        self
    }
}

impl Shared {
    /// The layout's member devices now.
    fn members(&self) -> Vec<Arc<dyn Device>> {
        self.health
            .devices()
            .into_iter()
            .take(self.health.n)
            .flatten()
            .collect()
    }

    /// Starts the rebuild thread if there is anything to rebuild, resync or replace, and
    /// the thread that clears idle bitmap bits if the array keeps a bitmap.
    fn start_threads(self: &Arc<Self>) -> Threads {
        let mut threads = Threads::default();
        let Some(metadata) = &self.metadata else {
            return threads;
        };
        if rebuild::needed(&self.health, &metadata.states()) {
            // Counting starts before the rebuild copies anything, and every write sent
            // before it started has ended (a switch that changes nothing), so the rebuild
            // sees every write that could overlap a copy.
            self.health.sync.on_now();
            self.health.switch(|_, _| {});
            let stop = Arc::new(AtomicBool::new(false));
            let job = rebuild::Job {
                name: self.name.clone(),
                layout: self.layout.clone(),
                health: self.health.clone(),
                metadata: metadata.clone(),
                data_offset: self.data_offset,
                stop: stop.clone(),
                rate: self.options,
            };
            match std::thread::Builder::new()
                .name(format!("cairn-sync-{}", self.name))
                .spawn(move || rebuild::run(job))
            {
                Ok(handle) => threads.rebuild = Some((stop, handle)),
                Err(e) => {
                    self.health.sync.off();
                    log::error!("cairn: {}: cannot start the rebuild: {e}", self.name)
                }
            }
        }
        if self.health.bitmap.is_some() {
            let stop = Arc::new(AtomicBool::new(false));
            let job = rebuild::Clearing {
                health: self.health.clone(),
                metadata: metadata.clone(),
                stop: stop.clone(),
                delay: self.options.bitmap_delay,
            };
            match std::thread::Builder::new()
                .name(format!("cairn-bitmap-{}", self.name))
                .spawn(move || rebuild::clear_bits(job))
            {
                Ok(handle) => threads.bitmap = Some((stop, handle)),
                Err(e) => log::error!(
                    "cairn: {}: cannot start the bitmap's thread (its bits stay set): {e}",
                    self.name
                ),
            }
        }
        threads
    }

    /// Stops the control threads, runs `change`, and starts them again on the members
    /// as they are then (a rebuild resumes from its checkpoint).
    fn with_threads_stopped<T>(self: &Arc<Self>, change: impl FnOnce() -> T) -> T {
        let mut threads = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        threads.stop();
        let out = change();
        *threads = self.start_threads();
        out
    }
}

impl Drop for StackDevice {
    fn drop(&mut self) {
        // Every queue is gone (they hold the device's members, not the device), so no
        // write is in flight: the array stops clean, with the members that failed
        // recorded as failed (a repair that fails one records it first).
        self.health.repairs.stop();
        if let Some((stop, handle)) = self
            .watcher
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            stop.store(true, SeqCst);
            self.health.failed_event();
            let _ = handle.join();
        }
        self.threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stop();
        if let Some(meta) = &self.metadata {
            let failed: Vec<bool> = (0..self.health.n).map(|m| !self.health.ok(m)).collect();
            // How far the copies agree: where this run's resync got (its threads are
            // stopped), or where the last one had got if none ran.
            let sync = &self.health.sync;
            let resynced = if sync.resync.load(Relaxed) {
                sync.synced_below.load(Relaxed)
            } else {
                0
            };
            meta.stop(&failed, resynced.max(meta.resync_from()));
        }
    }
}

impl Device for StackDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn describe(&self) -> String {
        let mut out = format!(
            "{} of {} members, {} ({} bytes)",
            self.layout.kind(),
            self.health.n,
            self.layout.describe(),
            self.geometry.size_bytes
        );
        if let Some(meta) = &self.metadata {
            use crate::array::superblock::MemberState;
            out += &format!(", metadata 1, data at {}", self.data_offset);
            let not_read: Vec<String> = meta
                .states()
                .iter()
                .enumerate()
                .filter(|(m, _)| !self.health.readable(*m))
                .map(|(m, s)| {
                    let state = match s {
                        MemberState::Active if !self.health.ok(m) => "failed",
                        s => s.name(),
                    };
                    format!("{} {state}", self.health.name(m))
                })
                .collect();
            if !not_read.is_empty() {
                out += &format!(", degraded: {}", not_read.join(", "));
            }
        }
        let r = self.health.repairs.counters.snapshot();
        if r.repaired + r.failed > 0 {
            out += &format!(
                ", read repairs: {} rewritten, {} failed",
                r.repaired, r.failed
            );
        }
        out
    }

    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
        let slots = 2 * self.health.n;
        let queue = Rc::new(StackQueue {
            core: core.clone(),
            targets: std::cell::UnsafeCell::new(Vec::new()),
            stats: QueueStats::named(core.switches().stats, self.name()),
            layout: self.layout.clone(),
            n: self.health.n,
            opened: RefCell::new((0..slots).map(|_| None).collect()),
            retired: RefCell::new(Vec::new()),
            fallback: RefCell::new(None),
            shadows: RefCell::new(vec![false; self.health.n]),
            replacing: Cell::new(false),
            gated: self.layout.copies() > 1 && self.metadata.as_ref().is_some_and(|m| !m.dry()),
            gate_writes: self.layout.copies() > 1,
            epoch: Cell::new(u64::MAX),
            gate: Arc::new(Gate::default()),
            health: self.health.clone(),
            sink: Cell::new(SinkId(u32::MAX)),
            state: RefCell::new(State {
                parents: Slab::with_capacity(PARENTS),
                children: Slab::with_capacity(PARENTS * 2),
                lone: Slab::with_capacity(PARENTS),
            }),
            next_copy: Cell::new(0),
            flushes: FlushBatcher::new(core.switches().flush),
            copies: self.layout.copies(),
            remap: Cell::new(None),
            data_offset: self.data_offset,
            metadata: self.metadata.clone(),
            bitmap: self.health.bitmap.clone(),
        });
        queue.refresh(self.health.epoch.load(SeqCst), true)?;
        self.health
            .gates
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::downgrade(&queue.gate));
        queue.sink.set(core.register_sink(queue.clone()));
        Ok(queue)
    }

    fn children(&self) -> Vec<Arc<dyn Device>> {
        self.members()
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        out: &mut Vec<cairn_core::Extent>,
    ) -> Result<(), Error> {
        // Piece by piece from the first healthy copy; stop early on a long map (callers
        // ask again from where it ends).
        const MAX_EXTENTS: usize = 4096;
        let end = offset + len;
        let mut at = offset;
        let mut piece = Vec::new();
        let members = self.members();
        while at < end && out.len() < MAX_EXTENTS {
            let n = self.layout.piece_len(at, end - at);
            let copy = (0..self.layout.copies())
                .find(|&k| self.health.readable(self.layout.locate(at, k).0))
                .unwrap_or(0);
            let (member, member_offset) = self.layout.locate(at, copy);
            piece.clear();
            members[member].extents(member_offset + self.data_offset, n, &mut piece)?;
            let mut got = 0;
            for e in &piece {
                let l = e.len.min(n - got);
                cairn_core::Extent::push(out, cairn_core::Extent { len: l, ..*e });
                got += l;
                if got == n {
                    break;
                }
            }
            if got < n {
                // The member stopped early: so do we.
                break;
            }
            at += n;
        }
        Ok(())
    }

    fn redundant(&self) -> bool {
        self.layout.copies() > 1
    }

    fn sync_progress(&self) -> Option<(u64, u64)> {
        self.metadata.as_ref()?;
        let sync = &self.health.sync;
        sync.running().then(|| {
            (
                sync.done_bytes.load(Relaxed),
                sync.total_bytes.load(Relaxed),
            )
        })
    }

    fn array_status(&self) -> Option<String> {
        use crate::array::superblock::MemberState;
        use cairn_core::size::format_bytes;
        let meta = self.metadata.as_ref()?;
        let states = meta.states();
        let mut flags = String::new();
        let mut members = Vec::new();
        for (m, s) in states.iter().enumerate() {
            let state = match s {
                _ if self.given_up.get(m).is_some_and(|g| g.load(Relaxed))
                    && !self.health.ok(m) =>
                {
                    "failed (re-adds given up)"
                }
                _ if !self.health.ok(m) && *s != MemberState::Missing => "failed",
                MemberState::Rebuilding if self.health.readable(m) => "active",
                s => s.name(),
            };
            flags.push(if self.health.readable(m) { 'U' } else { '_' });
            members.push(format!("{} {state}", self.health.name(m)));
            if self.health.being_replaced(m) {
                members.push(format!(
                    "{} replacing {}",
                    self.health.name(self.health.n + m),
                    self.health.name(m)
                ));
            }
        }
        let sync = &self.health.sync;
        let degraded = flags.contains('_');
        let mut out = format!(
            "{}: {} of {} members, {}, metadata 1 {}{}\n    [{flags}] {}\n",
            self.name,
            self.layout.kind(),
            self.health.n,
            format_bytes(self.geometry.size_bytes),
            meta.uuid_text(),
            if degraded { ", degraded" } else { "" },
            members.join(", ")
        );
        if sync.running() {
            let (done, total) = (
                sync.done_bytes.load(Relaxed),
                sync.total_bytes.load(Relaxed).max(1),
            );
            let rate = sync.rate.load(Relaxed);
            out += &format!(
                "    {} {:.1}% ({} of {}, {}/s, {} s left)\n",
                if sync.resync.load(Relaxed) {
                    "resync"
                } else {
                    "rebuild"
                },
                done as f64 * 100.0 / total as f64,
                format_bytes(done),
                format_bytes(total),
                format_bytes(rate),
                (total - done)
                    .checked_div(rate)
                    .map_or_else(|| "?".to_string(), |s| s.to_string())
            );
        } else if self.health.one_copy.load(Relaxed) {
            out += "    not stopped cleanly: reads from one copy until resynced\n";
        } else if sync.read_bytes.load(Relaxed) > 0 {
            out += &format!(
                "    last {}: read {} bytes, wrote {} bytes\n",
                if sync.resync.load(Relaxed) {
                    "resync"
                } else {
                    "rebuild"
                },
                sync.read_bytes.load(Relaxed),
                sync.written_bytes.load(Relaxed)
            );
        }
        let spares: Vec<String> = self
            .spares
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(_, n)| n.clone())
            .collect();
        if !spares.is_empty() {
            out += &format!("    spares: {}\n", spares.join(", "));
        }
        if let Some(bm) = &self.health.bitmap {
            out += &format!(
                "    bitmap: {} of {} regions of {} dirty\n",
                bm.dirty_count(),
                bm.regions(),
                format_bytes(bm.region_bytes())
            );
        }
        out += &self.repairs_line();
        Some(out)
    }

    fn array_action(&self, action: &str, args: &[&str]) -> Result<String, String> {
        let name = &self.name;
        let Some(meta) = self.metadata.as_ref().filter(|m| !m.dry()) else {
            return Err(format!(
                "'{name}' keeps no metadata (metadata = \"none\" in its stack file): it has no '{action}'"
            ));
        };
        if self.layout.copies() < 2 {
            return Err(format!(
                "'{name}' is a {}: it has no redundancy to run without a member",
                self.layout.kind()
            ));
        }
        // One change of members at a time.
        let _changing = self.changing.lock().unwrap_or_else(|p| p.into_inner());
        let _seq = self.health.changing();
        match (action, args) {
            ("fail", [member]) => self.fail(meta, member),
            ("remove", [member]) => self.shared.remove(meta, member),
            ("add", [spec]) => self.shared.add(meta, spec),
            ("re-add", [member]) => self.shared.readd(meta, member),
            ("replace", [old, spec]) => self.shared.replace(meta, old, spec),
            ("fail" | "remove" | "re-add", _) => Err(format!("usage: {action} ARRAY MEMBER")),
            ("add", _) => Err("usage: add ARRAY SPEC (e.g. file:/path/to/new.img)".into()),
            ("replace", _) => Err("usage: replace ARRAY OLD SPEC".into()),
            (other, _) => Err(format!(
                "no array action '{other}' (known: fail, remove, re-add, add, replace)"
            )),
        }
    }

    fn change_seq(&self) -> u64 {
        self.health.changes.load(SeqCst)
    }

    fn members_now(&self) -> Option<Vec<(String, Option<String>)>> {
        use crate::array::superblock::MemberState;
        // Only arrays with metadata change members.
        let states = self.metadata.as_ref().filter(|m| !m.dry())?.states();
        let added = self.added.lock().unwrap_or_else(|p| p.into_inner());
        Some(
            (0..self.health.n)
                .map(|m| {
                    if states[m] == MemberState::Missing {
                        return (MISSING.to_string(), None);
                    }
                    let name = self.health.name(m);
                    let spec = added
                        .iter()
                        .find(|(n, _)| *n == name)
                        .map(|(_, s)| s.clone());
                    (name, spec)
                })
                .collect(),
        )
    }

    fn spares_now(&self) -> Option<Vec<(String, Option<String>)>> {
        self.metadata.as_ref().filter(|m| !m.dry())?;
        let added = self.added.lock().unwrap_or_else(|p| p.into_inner());
        let spares = self.spares.lock().unwrap_or_else(|p| p.into_inner());
        Some(
            spares
                .iter()
                .map(|(_, name)| {
                    let spec = added
                        .iter()
                        .find(|(n, _)| n == name)
                        .map(|(_, s)| s.clone());
                    (name.clone(), spec)
                })
                .collect(),
        )
    }

    fn failed_members(&self) -> Vec<String> {
        (0..self.health.n)
            .filter(|&m| !self.health.ok(m))
            .map(|m| self.health.name(m))
            .collect()
    }
}

impl Shared {
    /// The read repairs line of `array_status` (empty before the first).
    fn repairs_line(&self) -> String {
        use cairn_core::size::format_bytes;
        let repairs = &self.health.repairs;
        let r = repairs.counters.snapshot();
        let pending = repairs.pending_count();
        if r.repaired + r.failed == 0 && pending == 0 {
            return String::new();
        }
        let by_member: Vec<String> = (0..self.health.n)
            .filter_map(|m| {
                let (done, failed) = (
                    repairs.repaired[m].load(Relaxed),
                    repairs.failed[m].load(Relaxed),
                );
                let name = self.health.name(m);
                match (done, failed) {
                    (0, 0) => None,
                    (d, 0) => Some(format!("{name} {d}")),
                    (d, f) => Some(format!("{name} {d} ({f} failed)")),
                }
            })
            .collect();
        format!(
            "    read repairs: {} rewritten ({}), {} failed{}{}\n",
            r.repaired,
            format_bytes(r.repaired_bytes),
            r.failed,
            if pending > 0 {
                format!(", {pending} pending")
            } else {
                String::new()
            },
            if by_member.is_empty() {
                String::new()
            } else {
                format!(": {}", by_member.join(", "))
            }
        )
    }

    /// Member `member`'s index, or an error naming the members.
    fn member_index(&self, member: &str) -> Result<usize, String> {
        let names: Vec<String> = (0..self.health.n).map(|m| self.health.name(m)).collect();
        names.iter().position(|n| n == member).ok_or_else(|| {
            format!(
                "'{}' has no member '{member}' (its members: {})",
                self.name,
                names.join(", ")
            )
        })
    }

    /// The level, for the coverage rules.
    fn level(&self) -> crate::array::superblock::Level {
        use crate::array::superblock::Level;
        match self.layout.kind() {
            "mirror" => Level::Mirror,
            _ => Level::Raid10,
        }
    }

    /// `fail MEMBER`: never below what the array can run on.
    fn fail(&self, meta: &crate::array::Metadata, member: &str) -> Result<String, String> {
        let name = &self.name;
        let m = self.member_index(member)?;
        if !self.health.ok(m) {
            return Err(format!(
                "member '{member}' of '{name}' has failed already or is missing"
            ));
        }
        // Every piece keeps a current copy.
        let current: Vec<bool> = (0..self.health.n)
            .map(|i| i != m && self.health.readable(i))
            .collect();
        if let Some(set) =
            crate::array::assemble::uncovered(self.level(), self.layout.copies(), &current)
        {
            let names: Vec<String> = set
                .iter()
                .map(|&i| format!("'{}'", self.health.name(i)))
                .collect();
            return Err(format!(
                "failing '{member}' would leave data of '{name}' with no current copy (it lives on {}); let a rebuild finish first",
                names.join(", ")
            ));
        }
        self.by_admin[m].store(true, Relaxed);
        self.health.readable[m].store(false, Relaxed);
        self.health.failed[m].store(true, Relaxed);
        log::warn!("cairn: {name}: member {member} failed by the admin; running degraded");
        meta.fail_member(m);
        self.health.failed_event();
        Ok(format!(
            "{name}: member '{member}' failed; running degraded"
        ))
    }

    /// `remove MEMBER`: a failed member recorded as missing, and its file closed.
    fn remove(
        self: &Arc<Self>,
        meta: &crate::array::Metadata,
        member: &str,
    ) -> Result<String, String> {
        use crate::array::superblock::MemberState;
        let name = &self.name;
        let m = self.member_index(member)?;
        if meta.states()[m] == MemberState::Active && self.health.ok(m) {
            return Err(format!(
                "member '{member}' of '{name}' is in use: fail it first"
            ));
        }
        if self.health.being_replaced(m) {
            return Err(format!(
                "member '{member}' of '{name}' is being replaced: wait for the replace to end"
            ));
        }
        meta.remove_member(m)
            .map_err(|e| format!("cannot remove member '{member}' of '{name}': {e}"))?;
        // A stand-in that is never used takes its place, so its file closes.
        let stand_in = self.stand_in()?;
        let n = self.health.n;
        self.with_threads_stopped(|| {
            self.health.switch(|devices, _| {
                devices[m] = Some(stand_in);
                // A replacement of it that failed goes too.
                devices[n + m] = None;
            })
        });
        log::info!("cairn: {name}: member {member} removed by the admin");
        Ok(format!(
            "{name}: member '{member}' removed: recorded as missing, and closed"
        ))
    }

    /// A device that stands in for a missing member (never written nor read).
    fn stand_in(&self) -> Result<Arc<dyn Device>, String> {
        let size = self.data_offset + self.metadata.as_ref().map_or(0, |m| m.member_data(0));
        crate::null::NullDevice::new(
            MISSING,
            size.max(u64::from(self.geometry.block_bytes)),
            self.geometry.block_bytes,
        )
        .map(|d| Arc::new(d) as Arc<dyn Device>)
        .map_err(|e| e.to_string())
    }

    /// Opens the device `spec` names as a new member of this array, checking it fits.
    fn open_new(
        &self,
        meta: &crate::array::Metadata,
        spec: &str,
        slot: usize,
    ) -> Result<(Arc<dyn Device>, String), String> {
        let leaf = crate::LeafSpec::parse(spec).map_err(|e| format!("'{spec}': {e}"))?;
        let new_name = leaf.default_name();
        let taken = (0..2 * self.health.n)
            .any(|i| self.health.name(i) == new_name && self.health.devices()[i].is_some());
        if taken || new_name == MISSING {
            return Err(format!(
                "'{name}' already has a member named '{new_name}': give the new one another file name",
                name = self.name
            ));
        }
        let device = crate::open(&leaf, &new_name).map_err(|e| e.to_string())?;
        self.fits(&device, &new_name, meta.member_data(slot))?;
        meta.may_join(&device, &new_name)?;
        let mut added = self.added.lock().unwrap_or_else(|p| p.into_inner());
        added.retain(|(n, _)| *n != new_name);
        added.push((new_name.clone(), leaf.stack_table()));
        Ok((device, new_name))
    }

    /// Whether `device` can be a member holding `member_data` bytes of data: its size,
    /// block size and what it can do.
    fn fits(
        &self,
        device: &Arc<dyn Device>,
        new_name: &str,
        member_data: u64,
    ) -> Result<(), String> {
        let g = device.geometry();
        let need = self.data_offset + member_data;
        if g.size_bytes < need {
            return Err(format!(
                "'{new_name}' has {} bytes; a member of '{}' needs at least {need} (add size= to create or grow a file)",
                g.size_bytes, self.name
            ));
        }
        if g.block_bytes > self.geometry.block_bytes {
            return Err(format!(
                "'{new_name}' has {}-byte blocks; '{}' uses {}-byte blocks",
                g.block_bytes, self.name, self.geometry.block_bytes
            ));
        }
        let caps = self.geometry.caps;
        let lacks: Vec<&str> = [
            ("flush", caps.flush && !g.caps.flush),
            ("fua", caps.fua && !g.caps.fua),
            ("discard", caps.discard && !g.caps.discard),
            ("write-zeroes", caps.write_zeroes && !g.caps.write_zeroes),
        ]
        .iter()
        .filter(|(_, l)| *l)
        .map(|(n, _)| *n)
        .collect();
        if !lacks.is_empty() {
            return Err(format!(
                "'{new_name}' cannot {}, which '{}' offers its clients",
                lacks.join(" or "),
                self.name
            ));
        }
        Ok(())
    }

    /// `add SPEC`: the device takes the place of a missing (removed) or failed member and
    /// is rebuilt online; reads use it once it is current.
    fn add(self: &Arc<Self>, meta: &crate::array::Metadata, spec: &str) -> Result<String, String> {
        let name = &self.name;
        let Some(m) = self.free_slot(meta) else {
            // A spare: it takes the place of the next member that fails.
            let (device, new_name) = self.open_new(meta, spec, 0)?;
            if let Err(e) = meta.make_spare(&device, &new_name) {
                let mut added = self.added.lock().unwrap_or_else(|p| p.into_inner());
                added.retain(|(n, _)| *n != new_name);
                return Err(e);
            }
            self.spares
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((device, new_name.clone()));
            self.watch_members();
            log::info!("cairn: {name}: '{new_name}' added as a spare");
            return Ok(format!(
                "{name}: '{new_name}' added as a spare: it takes the place of the next member that fails (to swap a working member for a new device: replace {name} OLD SPEC)"
            ));
        };
        let (device, new_name) = self.open_new(meta, spec, m)?;
        let old = self.add_device(meta, m, device, &new_name)?;
        Ok(format!(
            "{name}: '{new_name}' added in place of '{old}', rebuilding (see status)\n{}",
            self.members_line()
        ))
    }

    /// A member a new device may take the place of: missing (removed), or failed and
    /// recorded so (never one being replaced by a working replacement).
    fn free_slot(&self, meta: &crate::array::Metadata) -> Option<usize> {
        use crate::array::superblock::MemberState;
        let states = meta.states();
        let n = self.health.n;
        let free = |m: usize| !self.health.being_replaced(m);
        (0..n)
            .find(|&m| states[m] == MemberState::Missing && free(m))
            .or_else(|| {
                (0..n).find(|&m| !self.health.ok(m) && states[m] == MemberState::Failed && free(m))
            })
    }

    /// Makes `device` member `m` (missing or failed), rebuilt online. The old name.
    fn add_device(
        self: &Arc<Self>,
        meta: &crate::array::Metadata,
        m: usize,
        device: Arc<dyn Device>,
        new_name: &str,
    ) -> Result<String, String> {
        let name = &self.name;
        let old = self.health.name(m);
        // Recorded first: the new member is known as rebuilding before it gets a write.
        let partial = meta
            .join(m, device.clone(), new_name)
            .map_err(|e| format!("cannot add '{new_name}' to '{name}': {e}"))?;
        self.with_threads_stopped(|| {
            // Nothing sent to the old device is in flight once the switch returns; from
            // then on writes go to the new one, which is read only below its rebuild's
            // progress.
            let n = self.health.n;
            self.health.switch(|devices, names| {
                devices[m] = Some(device);
                names[m] = new_name.to_string();
                // A replacement of the old member that failed goes too.
                devices[n + m] = None;
            });
            self.health.readable[m].store(false, Relaxed);
            self.health.partial[m].store(partial, Relaxed);
            self.health.below[m].store(0, Relaxed);
            self.health.failed[m].store(false, Relaxed);
            if partial {
                self.recover_for(m);
            }
        });
        self.by_admin[m].store(false, Relaxed);
        self.given_up[m].store(false, Relaxed);
        log::info!(
            "cairn: {name}: '{new_name}' added in place of '{old}'; {}",
            self.how(partial)
        );
        Ok(old)
    }

    /// `re-add MEMBER`: a failed member whose device answers again (a remote one back on
    /// the network, a disk reconnected) is taken back. It was current when it left, so
    /// with a bitmap only the regions written since are copied to it; it is read
    /// elsewhere until then. Without a bitmap, or if bits were cleared since it left, it
    /// is rebuilt whole.
    fn readd(
        self: &Arc<Self>,
        meta: &crate::array::Metadata,
        member: &str,
    ) -> Result<String, String> {
        let name = &self.name;
        let m = self.member_index(member)?;
        if self.health.ok(m) {
            return Err(format!("member '{member}' of '{name}' has not failed"));
        }
        if self.health.being_replaced(m) {
            return Err(format!(
                "member '{member}' of '{name}' is being replaced: wait for the replace to end"
            ));
        }
        let how = self
            .take_back(meta, m)
            .map_err(|e| format!("cannot re-add '{member}' to '{name}': {e}"))?;
        log::info!("cairn: {name}: member {member} re-added by the admin; {how}");
        Ok(format!("{name}: '{member}' re-added: {how} (see status)"))
    }

    /// Takes failed member `m` back (see [`Shared::readd`]): how it is brought up to
    /// date.
    fn take_back(
        self: &Arc<Self>,
        meta: &crate::array::Metadata,
        m: usize,
    ) -> Result<String, String> {
        // Whatever its device acknowledged and may have lost until now (a remote server
        // that restarted), found now or later, is copied to it again by this re-add (it
        // gets no write while failed, and no bit is cleared meanwhile): its flushes no
        // longer report it, or the member would fail again for what the re-add covers.
        // First: the superblocks the re-add writes are flushed too.
        if let Some(Some(device)) = self.health.devices().get(m) {
            device.lost_writes_made_up();
        }
        let partial = meta.readd_member(m)?;
        self.by_admin[m].store(false, Relaxed);
        self.given_up[m].store(false, Relaxed);
        self.with_threads_stopped(|| {
            let h = &self.health;
            h.readable[m].store(false, Relaxed);
            h.below[m].store(0, Relaxed);
            h.partial[m].store(partial, Relaxed);
            h.failed[m].store(false, Relaxed);
            if partial {
                self.recover_for(m);
            }
        });
        Ok(self.how(partial))
    }

    /// Member `m`, back and taking writes, is to get the regions the bitmap marks now.
    fn recover_for(&self, m: usize) {
        let h = &self.health;
        if let Some(bm) = &h.bitmap {
            // Every write that could have missed it has ended once this returns, with
            // its bit on disk: the bits then are all it needs.
            h.switch(|_, _| {});
            let others = h.one_copy.load(Relaxed)
                || (0..h.n).any(|i| i != m && h.ok(i) && h.partial[i].load(Relaxed));
            bm.recover_dirty(others);
        }
    }

    /// How a member taken back is brought up to date, for the log and the reply.
    fn how(&self, partial: bool) -> String {
        match &self.health.bitmap {
            Some(bm) if partial => format!(
                "copying the {} of {} regions of {} the bitmap marks",
                bm.to_recover_count(),
                bm.regions(),
                cairn_core::size::format_bytes(bm.region_bytes())
            ),
            _ => "rebuilding it whole".to_string(),
        }
    }

    /// Starts the thread that puts spares in the place of failed members and re-adds
    /// members that answer again, unless it runs.
    fn watch_members(self: &Arc<Self>) {
        let mut watcher = self.watcher.lock().unwrap_or_else(|p| p.into_inner());
        if watcher.is_some() {
            return;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (me, halt) = (self.clone(), stop.clone());
        match std::thread::Builder::new()
            .name(format!("cairn-members-{}", self.name))
            .spawn(move || me.watch_until(&halt))
        {
            Ok(handle) => *watcher = Some((stop, handle)),
            Err(e) => log::error!(
                "cairn: {}: cannot start the members' thread (spares stay unused, no member is re-added but by the admin): {e}",
                self.name
            ),
        }
    }

    /// Puts a spare in the place of each member that fails (and of each missing one),
    /// and, with `readd`, tries members that failed by an I/O error again, until `stop`.
    fn watch_until(self: Arc<Self>, stop: &AtomicBool) {
        cairn_core::reactor::block_signals_in_this_thread();
        let mut seen = u64::MAX;
        let mut readds = vec![Readd::default(); self.health.n];
        while !stop.load(SeqCst) {
            {
                let count = self
                    .health
                    .failures
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                let (count, _) = self
                    .health
                    .failed_now
                    .wait_timeout_while(count, std::time::Duration::from_millis(200), |c| {
                        *c == seen && !stop.load(SeqCst)
                    })
                    .unwrap_or_else(|p| p.into_inner());
                seen = *count;
            }
            let Some(meta) = self.metadata.as_ref().filter(|m| !m.dry()) else {
                return;
            };
            let changing = self.changing.lock().unwrap_or_else(|p| p.into_inner());
            while !stop.load(SeqCst) {
                let Some(m) = self.free_slot(meta) else { break };
                let spare = {
                    let mut spares = self.spares.lock().unwrap_or_else(|p| p.into_inner());
                    if spares.is_empty() {
                        break;
                    }
                    spares.remove(0)
                };
                let _seq = self.health.changing();
                if let Err(e) = self.add_device(meta, m, spare.0, &spare.1) {
                    log::warn!("cairn: {}: spare '{}' not used: {e}", self.name, spare.1);
                } else {
                    log::info!("cairn: {}: {}", self.name, self.members_line());
                }
            }
            drop(changing);
            if let Some(every) = self.options.readd {
                self.readd_due(meta, every, &mut readds);
            }
        }
    }

    /// Tries again each member that failed by an I/O error (not by the admin) once its
    /// time has come; re-adds it if its device answers with its superblock. A member that
    /// fails again soon after a re-add is tried after twice the wait each time, and left
    /// failed after [`READD_FLAPS_MAX`] such re-adds in a row.
    fn readd_due(
        self: &Arc<Self>,
        meta: &crate::array::Metadata,
        every: std::time::Duration,
        readds: &mut [Readd],
    ) {
        use crate::array::superblock::MemberState;
        let states = meta.states();
        let n = self.health.n;
        let now = std::time::Instant::now();
        for (m, r) in readds.iter_mut().enumerate().take(n) {
            let being_replaced = self.health.being_replaced(m);
            if self.health.ok(m)
                || states[m] != MemberState::Failed
                || self.by_admin[m].load(Relaxed)
                || self.given_up[m].load(Relaxed)
                || being_replaced
            {
                r.next_try = None;
                if self.health.ok(m) && r.last.is_some_and(|t| t.elapsed() >= READD_FLAP_WINDOW) {
                    // In use for a while since its re-add: not flapping.
                    r.flaps = 0;
                    r.last = None;
                }
                continue;
            }
            let member = self.health.name(m);
            match r.next_try {
                None => {
                    let soon = r.last.is_some_and(|t| t.elapsed() < READD_FLAP_WINDOW);
                    r.flaps = if soon { r.flaps + 1 } else { 0 };
                    if r.flaps >= READD_FLAPS_MAX {
                        self.given_up[m].store(true, Relaxed);
                        log::warn!(
                            "cairn: {}: member {member} failed again within {READD_FLAP_WINDOW:?} of each of {} re-adds in a row: \
                             it is no longer re-added on its own (re-add it by hand once it is fixed: re-add {} {member})",
                            self.name, r.flaps, self.name
                        );
                        r.last = None;
                        continue;
                    }
                    let wait = every
                        .saturating_mul(1 << r.flaps.min(16))
                        .min(READD_BACKOFF_MAX.max(every));
                    if r.flaps == 0 {
                        log::info!(
                            "cairn: {}: member {member} will be tried again every {every:?}, and re-added once it answers",
                            self.name
                        );
                    } else {
                        log::warn!(
                            "cairn: {}: member {member} failed again {:?} after it was re-added: next try in {wait:?} ({} of {READD_FLAPS_MAX} re-adds in a row)",
                            self.name,
                            r.last.map(|t| t.elapsed()).unwrap_or_default(),
                            r.flaps
                        );
                    }
                    r.next_try = Some(now + wait);
                }
                // Its device is read first without holding up admin actions (a remote
                // one may take its timeout to answer).
                Some(t) if t <= now => match meta.probe_member(m).and_then(|()| {
                    let _changing = self.changing.lock().unwrap_or_else(|p| p.into_inner());
                    if self.health.ok(m) {
                        return Err("taken back meanwhile".into());
                    }
                    let _seq = self.health.changing();
                    self.take_back(meta, m)
                }) {
                    Ok(how) => {
                        log::info!(
                            "cairn: {}: member {member} answers again: re-added; {how}",
                            self.name
                        );
                        r.next_try = None;
                        r.last = Some(std::time::Instant::now());
                    }
                    Err(e) => {
                        log::debug!("cairn: {}: member {member} not re-added: {e}", self.name);
                        let wait = every
                            .saturating_mul(1 << r.flaps.min(16))
                            .min(READD_BACKOFF_MAX.max(every));
                        r.next_try = Some(now + wait);
                    }
                },
                Some(_) => {}
            }
        }
    }

    /// `replace OLD SPEC`: the device is written with every write to OLD and filled by a
    /// rebuild; once it is current it takes OLD's place and OLD is closed. The array
    /// never has fewer current copies than before.
    fn replace(
        self: &Arc<Self>,
        meta: &crate::array::Metadata,
        old: &str,
        spec: &str,
    ) -> Result<String, String> {
        let name = &self.name;
        let m = self.member_index(old)?;
        // A replacement that failed is given up: a new one may take its place.
        if self.health.being_replaced(m) {
            return Err(format!(
                "member '{old}' of '{name}' is being replaced already"
            ));
        }
        if !self.health.ok(m) {
            return Err(format!(
                "member '{old}' of '{name}' has failed or is missing: add a new device in its place instead (add {name} SPEC)"
            ));
        }
        let (device, new_name) = self.open_new(meta, spec, m)?;
        let r = self.health.n + m;
        self.with_threads_stopped(|| {
            self.health.readable[r].store(false, Relaxed);
            self.health.below[r].store(0, Relaxed);
            self.health.partial[r].store(false, Relaxed);
            self.health.failed[r].store(false, Relaxed);
            self.health.switch(|devices, names| {
                devices[r] = Some(device);
                names[r] = new_name.clone();
            });
        });
        log::info!("cairn: {name}: replacing '{old}' by '{new_name}'");
        Ok(format!(
            "{name}: replacing '{old}' by '{new_name}': it is written with every write to '{old}' and filled by a rebuild, then takes its place (see status)"
        ))
    }

    /// The stack file line for the members as they are now.
    fn members_line(&self) -> String {
        let names: Vec<String> = (0..self.health.n)
            .map(|m| format!("\"{}\"", self.health.name(m)))
            .collect();
        format!("members now: [{}]", names.join(", "))
    }
}

/// Parent requests a queue keeps state for before its slab grows.
const PARENTS: usize = 256;

/// One cache line each: the line written at submit is usually evicted by the time the
/// request completes (every read's data passes through the cache meanwhile), so a parent
/// straddling two lines would cost two misses instead of one.
#[derive(Clone, Copy)]
#[repr(align(64))]
struct Parent {
    io: Io,
    pending: u32,
    status: IoStatus,
    start_ns: u64,
    degraded: bool,
    /// Copies tried so far by a request sent whole to one member (bit per copy).
    tried: u32,
    /// Counted as a write in flight for a rebuild (its completion is counted too).
    counted: bool,
    /// Counted as a write in flight by the bitmap (its completion is counted too).
    marked: bool,
    /// Counted in the gate: 0 not, else 1 + the epoch's parity.
    gate: u8,
}

#[derive(Clone, Copy)]
struct Child {
    parent: u32,
    op: Op,
    flags: IoFlags,
    /// Logical offset of the piece (reads retry another copy of it).
    logical: u64,
    len: u64,
    buf: *mut u8,
    member: u16,
    /// Copies tried so far (bit per copy), for read retries.
    tried: u32,
}

struct State {
    parents: Slab<Parent>,
    children: Slab<Child>,
    /// Requests of a layout without copies sent whole to one member: only what their
    /// completion needs (a third of a `Parent`).
    lone: Slab<Lone>,
}

/// A request of a layout without copies, sent whole to one member.
#[derive(Clone, Copy)]
struct Lone {
    sink: SinkId,
    op: Op,
    len: u64,
    token: u64,
    start_ns: u64,
}

/// A member device and its queue on one reactor.
type Opened = (Arc<dyn Device>, Rc<dyn Queue>);

/// A stacked device's queue on one reactor.
pub struct StackQueue {
    core: Rc<Core>,
    /// The members' queues as plain pointers (`0..n` the layout's members, `n + m` the
    /// replacement of `m`), so that a submit needs no look-up of where the value sits
    /// inside its `Rc`. `opened` keeps them alive; changed only by
    /// [`StackQueue::refresh`], never while a pointer from it is in use.
    targets: std::cell::UnsafeCell<Vec<*const dyn Queue>>,
    stats: QueueStats,
    layout: Arc<AnyLayout>,
    /// The layout's members.
    n: usize,
    /// Each member device and its queue here, as of `epoch`.
    opened: RefCell<Vec<Option<Opened>>>,
    /// Queues of members no longer in use, kept until no request of this queue is in
    /// flight (one may still be in flight on them).
    retired: RefCell<Vec<Rc<dyn Queue>>>,
    /// What `targets` without a queue point at (never sent anything), kept alive here.
    fallback: RefCell<Option<Rc<dyn Queue>>>,
    /// Per member: a replacement is being built (every write to it goes there too).
    shadows: RefCell<Vec<bool>>,
    /// Some member has a replacement.
    replacing: Cell<bool>,
    /// Requests are counted in `gate` (the array's members can change).
    gated: bool,
    /// Changes of data are counted in `gate` (a redundant layout: read repair waits for
    /// those sent before it counts them per region).
    gate_writes: bool,
    /// The health's epoch `opened` follows.
    epoch: Cell<u64>,
    /// Changes of data in flight, for a change of members to wait for.
    gate: Arc<Gate>,
    health: Arc<Health>,
    sink: Cell<SinkId>,
    state: RefCell<State>,
    next_copy: Cell<usize>,
    flushes: FlushBatcher,
    /// The layout's copies, kept here to spare the hot path a pointer chase.
    copies: usize,
    /// Of a layout without copies: a request that fits one member is only remapped, with
    /// these flags added (none without statistics; DELEGATED when every member counts
    /// for this device); `None`: this device takes each completion itself.
    remap: Cell<Option<IoFlags>>,
    /// Where data starts on every member.
    data_offset: u64,
    /// The array's superblocks, if it keeps them.
    metadata: Option<Arc<crate::array::Metadata>>,
    /// The write-intent bitmap, if the array keeps one.
    bitmap: Option<Arc<crate::array::bitmap::Bitmap>>,
}

/// Token of the batched flush fanning out to the members (never a child index).
const FLUSH_BATCH: u64 = u64::MAX;
/// Token bit of a request sent whole to one member: the rest is the parent's index.
const DIRECT: u64 = 1 << 62;
/// Token bit of a request of a layout without copies sent whole to one member: the rest
/// is its index in `lone` (`FLUSH_BATCH` has both bits).
const LONE: u64 = 1 << 61;
/// Token bit of the timer of a write waiting for a read repair's range (see
/// [`StackQueue::park`]): the rest is the parent's index.
const PARKED: u64 = 1 << 60;
/// Where a request sent whole to one copy carries the copy in its token (below: the
/// parent's index), so that its completion knows which copy answered.
const COPY_SHIFT: u32 = 32;
/// How long a write waits before it looks again whether a repair still holds its range
/// (a repair holds it for one read and one write of the range).
const PARK_NS: u64 = 100_000;

impl StackQueue {
    /// The queue of member `m`.
    #[inline]
    fn member(&self, m: usize) -> &dyn Queue {
        // SAFETY: `targets` points into `opened`, which this queue owns; `refresh`, the
        // only change to either, never runs while a reference from here is held (it runs
        // at the start of a submit, and no submit runs inside another).
        unsafe { &*(&*self.targets.get())[m] }
    }

    /// Follows the health's member devices as of `epoch`: opens queues for new member
    /// devices, retires those no longer used. A member whose queue cannot be opened is
    /// failed (at open time: an error).
    #[cold]
    fn refresh(&self, epoch: u64, first: bool) -> Result<(), Error> {
        let devices = self.health.devices();
        let same = |a: &Arc<dyn Device>, b: &Arc<dyn Device>| {
            std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
        };
        let mut opened = self.opened.borrow_mut();
        let mut next: Vec<Option<Opened>> = Vec::with_capacity(devices.len());
        for (i, d) in devices.iter().enumerate() {
            let Some(d) = d else {
                next.push(None);
                continue;
            };
            if let Some(found) = opened.iter().flatten().find(|(o, _)| same(o, d)) {
                next.push(Some(found.clone()));
                continue;
            }
            match cairn_core::handoff::open_member(&self.core, d) {
                Ok(q) => {
                    if self.copies == 1 {
                        if let Some(c) = q.stats().delegate() {
                            // This member counts for this device the requests only
                            // remapped to it: under both names, as two queues would.
                            let registry = cairn_core::stats::registry();
                            registry.add_counters(d.name(), c.clone(), true);
                            registry.add_counters(&self.health.device, c.clone(), true);
                            self.stats.lend(c);
                        }
                    }
                    next.push(Some((d.clone(), q)));
                }
                Err(e) if first => return Err(e),
                Err(e) => {
                    self.health.fail(i, IoStatus::errno(libc::EIO));
                    log::warn!(
                        "cairn: {}: cannot open member '{}' here: {e}",
                        self.health.device,
                        d.name()
                    );
                    if let (Some(meta), true) = (&self.metadata, i < self.n) {
                        meta.fail_member(i);
                    }
                    next.push(None);
                }
            }
        }
        let mut retired = self.retired.borrow_mut();
        for (o, q) in opened.iter().flatten() {
            if !next.iter().flatten().any(|(d, _)| same(d, o)) {
                retired.push(q.clone());
            }
        }
        // Every index points at a live queue; one without a device here (no replacement,
        // or a member that could not be opened) is never sent anything: it is failed.
        let Some(fallback) = next
            .iter()
            .flatten()
            .map(|(_, q)| q.clone())
            .chain(retired.iter().cloned())
            .next()
        else {
            return Err(Error::Invalid(format!(
                "{}: no member could be opened",
                self.health.device
            )));
        };
        let targets: Vec<*const dyn Queue> = next
            .iter()
            .map(|o| {
                o.as_ref()
                    .map_or(Rc::as_ptr(&fallback), |(_, q)| Rc::as_ptr(q))
            })
            .collect();
        let shadows: Vec<bool> = (0..self.n)
            .map(|m| next.get(self.n + m).is_some_and(Option::is_some))
            .collect();
        self.replacing.set(shadows.iter().any(|&s| s));
        let members = next.iter().take(self.n);
        self.remap.set(if self.copies != 1 {
            None
        } else if !self.stats.enabled() {
            Some(IoFlags::NONE)
        } else if members.len() == self.n
            && members
                .clone()
                .all(|o| o.as_ref().is_some_and(|(_, q)| q.stats().delegates()))
        {
            Some(IoFlags::DELEGATED)
        } else {
            None
        });
        *self.shadows.borrow_mut() = shadows;
        *opened = next;
        drop(opened);
        *self.fallback.borrow_mut() = Some(fallback);
        // SAFETY: see `member`: no reference from `targets` is held here.
        unsafe { *self.targets.get() = targets };
        self.epoch.set(epoch);
        Ok(())
    }

    /// Starts `io` as a parent sent whole to copy `copy`, which lives at `at`.
    #[inline(always)]
    fn direct(&self, io: Io, start_ns: u64, copy: usize, at: (usize, u64), gate: u8) {
        let parent = self.state.borrow_mut().parents.insert(Parent {
            io,
            pending: 1,
            status: IoStatus::OK,
            start_ns,
            degraded: false,
            tried: 1 << copy,
            counted: false,
            marked: false,
            gate,
        });
        self.send_direct(parent, &io, copy, at);
    }

    /// Sends the whole request `io` of `parent` to copy `copy`, at `at` (member, member
    /// offset).
    #[inline(always)]
    fn send_direct(&self, parent: u32, io: &Io, copy: usize, at: (usize, u64)) {
        let (member, member_offset) = at;
        self.member(member).submit(Io {
            offset: member_offset + self.data_offset,
            sink: self.sink.get(),
            token: DIRECT | ((copy as u64) << COPY_SHIFT) | u64::from(parent),
            ..*io
        });
    }

    /// Fans one flush out to every healthy member, on behalf of the batch.
    fn start_flush(&self) {
        let io = Io::nodata(Op::Flush, 0, 0, self.sink.get(), FLUSH_BATCH);
        let gate = if self.gated { self.enter_gate() } else { 0 };
        let parent = self.state.borrow_mut().parents.insert(Parent {
            io,
            pending: 1,
            status: IoStatus::OK,
            start_ns: 0,
            degraded: false,
            tried: 0,
            counted: false,
            marked: false,
            gate,
        });
        let present: Vec<bool> = self.opened.borrow().iter().map(Option::is_some).collect();
        for (m, here) in present.into_iter().enumerate() {
            if here && self.health.ok(m) {
                self.child(parent, Op::Flush, &io, (0, 0, std::ptr::null_mut()), m);
            }
        }
        let mut st = self.state.borrow_mut();
        let p = st.parents.get_mut(parent);
        p.pending -= 1;
        if p.pending == 0 {
            // No healthy member left: the batch fails through the FIFO.
            let p = st.parents.remove(parent);
            drop(st);
            self.leave_gate(&p);
            self.core
                .complete(self.sink.get(), FLUSH_BATCH, IoStatus::errno(libc::EIO));
        }
    }

    /// The batch's flush finished: every request it covered completes with `status`.
    fn flush_done(&self, status: IoStatus) {
        let again = self.flushes.finish(|io, start| {
            if self.stats.enabled() {
                self.stats.done(
                    IoFlags::NONE,
                    Op::Flush,
                    0,
                    start,
                    self.core.now_ns(),
                    status.is_ok(),
                );
            }
            self.core.deliver(io.sink, io.token, status);
        });
        if again {
            self.start_flush();
        }
    }

    /// Records a child of `parent` and submits it to the member copy `copy` lives on
    /// (for a flush: to member `copy`).
    #[inline]
    fn child(&self, parent: u32, op: Op, io: &Io, piece: (u64, u64, *mut u8), copy: usize) {
        let to = if op == Op::Flush {
            (copy, 0)
        } else {
            let (m, at) = self.layout.locate(piece.0, copy);
            (m, at + self.data_offset)
        };
        self.child_to(parent, op, io, piece, copy, to);
    }

    /// Records a child of `parent` for copy `copy` and submits it to `to` (member, offset
    /// on the member).
    #[inline]
    fn child_to(
        &self,
        parent: u32,
        op: Op,
        io: &Io,
        piece: (u64, u64, *mut u8),
        copy: usize,
        to: (usize, u64),
    ) {
        let (logical, len, buf) = piece;
        let (member, member_offset) = to;
        let token = {
            let mut st = self.state.borrow_mut();
            st.parents.get_mut(parent).pending += 1;
            st.children.insert(Child {
                parent,
                op,
                flags: io.flags,
                logical,
                len,
                buf,
                member: member as u16,
                tried: 1 << copy,
            })
        };
        self.member(member).submit(Io {
            op,
            flags: io.flags,
            offset: member_offset,
            len,
            buf,
            sink: self.sink.get(),
            token: u64::from(token),
        });
    }

    /// The first healthy copy of `logical` at or after `start`, skipping `tried`.
    fn healthy_copy(&self, logical: u64, len: u64, start: usize, tried: u32) -> Option<usize> {
        let copies = self.copies;
        if self.health.one_copy_at(logical, len) {
            // The copies may differ here: the one the resync copies from, or another
            // only if that one fails.
            return (0..copies).find(|&k| {
                tried & (1 << k) == 0 && self.health.readable(self.layout.locate(logical, k).0)
            });
        }
        (0..copies).map(|i| (start + i) % copies).find(|&k| {
            tried & (1 << k) == 0 && {
                let (m, at) = self.layout.locate(logical, k);
                self.health.readable_at(m, logical, at, len)
            }
        })
    }

    /// Whether some data has lost every copy (checked over one stripe of pieces).
    fn healthy_copy_sets_missing(&self) -> bool {
        let size = self.layout.size_bytes();
        let span = (self.n as u64 * (64 << 10)).min(size);
        let probe = Io::nodata(Op::Write, 0, span, self.sink.get(), 0);
        !self.all_pieces_covered(&probe)
    }

    /// Whether every piece of the request still has a healthy copy.
    fn all_pieces_covered(&self, io: &Io) -> bool {
        let mut at = io.offset;
        while at < io.end() {
            if self
                .healthy_copy(at, self.layout.piece_len(at, io.end() - at), 0, 0)
                .is_none()
            {
                return false;
            }
            at += self.layout.piece_len(at, io.end() - at);
        }
        true
    }

    fn finish_parent(&self, parent: u32) {
        let p = self.state.borrow_mut().parents.remove(parent);
        self.leave_gate(&p);
        let mut status = p.status;
        if p.io.token == FLUSH_BATCH && p.io.sink == self.sink.get() {
            // A flush is good if at least one member of every copy set took it.
            if status.is_ok() && p.degraded && self.healthy_copy_sets_missing() {
                status = IoStatus::errno(libc::EIO);
            }
            self.flush_done(status);
            return;
        }
        if status.is_ok() && p.degraded && !self.all_pieces_covered(&p.io) {
            status = IoStatus::errno(libc::EIO);
        }
        if p.counted {
            self.health.sync.done(&p.io);
        }
        if p.marked {
            if let Some(bm) = &self.bitmap {
                bm.end_write(&p.io);
            }
        }
        self.answer(&p, status);
    }

    /// Counts the end of a request in the gate, if it was counted there.
    #[inline]
    fn leave_gate(&self, p: &Parent) {
        if p.gate != 0 {
            self.gate.writes[usize::from(p.gate - 1)].fetch_sub(1, SeqCst);
        }
    }

    /// Accounts the start of a request; returns its start time (0 without statistics).
    #[inline(always)]
    fn start(&self) -> u64 {
        if !self.stats.enabled() {
            return 0;
        }
        let now = self.core.now_ns();
        self.stats.start(IoFlags::NONE, now);
        now
    }

    /// Accounts a finished parent request and hands its completion to its submitter.
    #[inline(always)]
    fn answer(&self, p: &Parent, status: IoStatus) {
        self.stats
            .finish(&p.io, p.start_ns, || self.core.now_ns(), status.is_ok());
        self.core.deliver(p.io.sink, p.io.token, status);
    }
}

impl Queue for StackQueue {
    #[inline]
    fn submit(&self, io: Io) {
        // The common case, kept small so that it stays cheap: a layout without copies,
        // and the whole request fits one member. It is only remapped, and the member
        // answers the caller itself (as md's raid0 remaps a bio and resubmits it), so the
        // completion costs this layer nothing. With statistics on, the member counts it
        // for this device too (`mark` is DELEGATED).
        if let Some(mark) = self.remap.get() {
            if io.op != Op::Flush {
                if let Some((member, member_offset)) = self.layout.place(io.offset, io.len, 0) {
                    self.member(member).submit(Io {
                        offset: member_offset + self.data_offset,
                        flags: io.flags.with(mark),
                        ..io
                    });
                    return;
                }
            }
        }
        self.submit_rest(io);
    }

    fn stats(&self) -> &QueueStats {
        &self.stats
    }

    fn children(&self) -> Vec<Rc<dyn Queue>> {
        self.opened
            .borrow()
            .iter()
            .take(self.n)
            .flatten()
            .map(|(_, q)| q.clone())
            .collect()
    }
}

impl StackQueue {
    /// Everything `submit` does not remap.
    #[inline(never)]
    fn submit_rest(&self, io: Io) {
        if self.copies == 1 && io.op != Op::Flush {
            if let Some((member, member_offset)) = self.layout.place(io.offset, io.len, 0) {
                // A member that cannot count for this device: no child state; the
                // request's slab index travels as the token.
                let start_ns = self.start();
                let index = self.state.borrow_mut().lone.insert(Lone {
                    sink: io.sink,
                    op: io.op,
                    len: io.len,
                    token: io.token,
                    start_ns,
                });
                self.member(member).submit(Io {
                    offset: member_offset + self.data_offset,
                    sink: self.sink.get(),
                    token: LONE | u64::from(index),
                    ..io
                });
                return;
            }
        }
        let start_ns = self.start();
        self.submit_other(io, start_ns);
    }

    /// Everything but the common case of `submit`: flushes, reads of redundant layouts,
    /// and requests split into pieces.
    #[inline(never)]
    fn submit_other(&self, io: Io, start_ns: u64) {
        // Only an array whose members can change (gated) follows a change of members: in
        // `enter_gate`, below. Queues of members it no longer uses go once nothing is in
        // flight.
        if self.gated && !self.retired.borrow().is_empty() && self.state.borrow().parents.is_empty()
        {
            // Nothing is in flight on the old members' queues any more.
            self.retired.borrow_mut().clear();
        }
        // While a rebuild runs it yields to clients: it counts their requests.
        self.health.sync.client(&io);
        if io.op == Op::Flush {
            if self.flushes.arrive(io, start_ns) {
                self.start_flush();
            }
            return;
        }
        let copies = self.copies;
        // A request to an array whose members can change is counted in the gate, under
        // the epoch whose members it is sent to: a change of members waits until none
        // sent under the old epoch is in flight. Other redundant arrays count changes of
        // data there (for read repair).
        let gate = if self.gated || (self.gate_writes && io.op != Op::Read) {
            self.enter_gate()
        } else {
            0
        };
        // A read of a redundant layout that lands whole on one member goes to one copy.
        if copies > 1 && io.op == Op::Read && self.layout.piece_len(io.offset, io.len) == io.len {
            let n = self.next_copy.get();
            self.next_copy.set(n.wrapping_add(1));
            if let Some(copy) = self.healthy_copy(io.offset, io.len, n % copies, 0) {
                self.direct(
                    io,
                    start_ns,
                    copy,
                    self.layout.locate(io.offset, copy),
                    gate,
                );
                return;
            }
        }
        // A change of data is counted by the bitmap, and waits for its regions' bits to
        // be on disk first (rarely: once per region going from clean to dirty).
        let mut marked = false;
        let mut unmarked = false;
        if let Some(bm) = &self.bitmap {
            if io.op != Op::Read {
                marked = true;
                if !bm.start_write(&io) {
                    unmarked = self.mark(&io);
                }
            }
        }
        // A change of data while a rebuild runs (or read repairs are pending) is counted,
        // so the rebuild can tell whether a region it copied was written meanwhile (and a
        // repair can hold a range against writes).
        let counted = io.op != Op::Read && self.health.sync.start(&io);
        let parent = self.state.borrow_mut().parents.insert(Parent {
            io,
            // One extra reference while children are being submitted, so that no child
            // can finish the parent early (none completes inside submit, but a failed
            // child is resubmitted from completion context only).
            pending: 1,
            status: IoStatus::OK,
            start_ns,
            degraded: false,
            tried: 0,
            counted,
            marked,
            gate,
        });
        if counted && !unmarked && self.health.sync.held(&io) {
            self.park(parent);
            return;
        }
        self.send(parent, &io, unmarked);
    }

    /// Sends the pieces of `parent`'s request `io` to their members (none if `failed`:
    /// it fails), and completes it through the FIFO if nothing was sent.
    #[inline(always)]
    fn send(&self, parent: u32, io: &Io, failed: bool) {
        let io = *io;
        let copies = self.copies;
        let mut missing = failed;
        match io.op {
            Op::Flush => unreachable!("flushes go through the batcher"),
            _ if failed => {}
            op => {
                let mut at = io.offset;
                while at < io.end() {
                    let len = self.layout.piece_len(at, io.end() - at);
                    let buf = if op.has_data() {
                        // SAFETY: at - offset < len of the parent's buffer.
                        unsafe { io.buf.add((at - io.offset) as usize) }
                    } else {
                        std::ptr::null_mut()
                    };
                    if op == Op::Read {
                        let start = if copies > 1 {
                            let n = self.next_copy.get();
                            self.next_copy.set(n.wrapping_add(1));
                            n % copies
                        } else {
                            0
                        };
                        match self.healthy_copy(at, len, start, 0) {
                            Some(k) => self.child(parent, op, &io, (at, len, buf), k),
                            None => missing = true,
                        }
                    } else {
                        let mut any = false;
                        for k in 0..copies {
                            let (m, member_offset) = self.layout.locate(at, k);
                            let to = (m, member_offset + self.data_offset);
                            if self.health.ok(m) {
                                self.child_to(parent, op, &io, (at, len, buf), k, to);
                                any = true;
                            }
                            if self.replacing.get() && self.shadows.borrow()[m] {
                                // Its replacement gets every write too.
                                let r = self.n + m;
                                if self.health.ok(r) {
                                    self.child_to(parent, op, &io, (at, len, buf), k, (r, to.1));
                                }
                            }
                        }
                        missing |= !any;
                    }
                    at += len;
                }
            }
        }
        let mut st = self.state.borrow_mut();
        let p = st.parents.get_mut(parent);
        if missing {
            p.status = IoStatus::errno(libc::EIO);
        }
        p.pending -= 1;
        if p.pending == 0 {
            // Nothing was submitted (no healthy member): complete through the FIFO, never
            // from inside submit.
            let p = st.parents.remove(parent);
            drop(st);
            if p.counted {
                self.health.sync.done(&p.io);
            }
            if p.marked {
                if let Some(bm) = &self.bitmap {
                    bm.end_write(&p.io);
                }
            }
            self.leave_gate(&p);
            self.stats
                .finish(&p.io, p.start_ns, || self.core.now_ns(), false);
            let status = if p.status.is_ok() {
                IoStatus::errno(libc::EIO)
            } else {
                p.status
            };
            self.core.complete(p.io.sink, p.io.token, status);
        }
    }

    /// A counted write to a range a read repair holds is not sent yet: it looks again on
    /// a timer (the reactor goes on meanwhile), and is sent once the range is let go.
    #[cold]
    #[inline(never)]
    fn park(&self, parent: u32) {
        self.core.add_timer(
            self.core.now_ns() + PARK_NS,
            self.sink.get(),
            PARKED | u64::from(parent),
        );
    }

    /// The timer of a parked write: sends it if its range is let go.
    #[cold]
    #[inline(never)]
    fn unpark(&self, parent: u32) {
        let io = self.state.borrow().parents.get(parent).io;
        if self.health.sync.held(&io) {
            self.park(parent);
        } else {
            self.send(parent, &io, false);
        }
    }

    /// A read of `len` bytes at `logical` failed on each copy in `tried` but the one on
    /// member `good`, which answered: each is to be rewritten with good data, by the
    /// array's repair thread (see [`repair`]). The client is answered meanwhile: the
    /// repair reads the data again under a hold of the range, never from the client's
    /// buffer, which the client owns again once answered.
    #[cold]
    #[inline(never)]
    fn repair_later(&self, logical: u64, len: u64, tried: u32, good: usize) {
        // An array examined only writes nothing; where the copies may differ (not
        // resynced yet) the resync rewrites them from the copy reads come from.
        if self.metadata.as_ref().is_some_and(|m| m.dry()) || self.health.one_copy_at(logical, len)
        {
            return;
        }
        for k in 0..self.copies {
            if tried & (1 << k) == 0 {
                continue;
            }
            let (m, at) = self.layout.locate(logical, k);
            // A member failed meanwhile is not written (and never read) any more.
            if m == good || !self.health.ok(m) {
                continue;
            }
            let device = self.opened.borrow()[m].as_ref().map(|(d, _)| d.clone());
            let Some(device) = device else {
                continue;
            };
            let p = repair::Pending {
                member: m,
                device,
                logical,
                len,
                at,
            };
            self.health.repairs.request(p, || repair::Job {
                name: self.health.device.clone(),
                layout: self.layout.clone(),
                health: self.health.clone(),
                metadata: self.metadata.clone(),
                data_offset: self.data_offset,
            });
        }
    }

    /// Counts a change of data in the gate under the epoch now (following it first if it
    /// moved): 1 + the epoch's parity.
    #[inline]
    fn enter_gate(&self) -> u8 {
        loop {
            let epoch = self.health.epoch.load(SeqCst);
            if epoch != self.epoch.get() {
                let _ = self.refresh(epoch, false);
            }
            let parity = (epoch & 1) as usize;
            self.gate.writes[parity].fetch_add(1, SeqCst);
            if self.health.epoch.load(SeqCst) == epoch {
                return 1 + parity as u8;
            }
            // Changed meanwhile: count under the new one.
            self.gate.writes[parity].fetch_sub(1, SeqCst);
        }
    }

    /// Sets the bitmap bits of `io`'s regions on disk before it is submitted; true if
    /// that failed (no member took the superblock: the request fails, unsubmitted).
    #[cold]
    fn mark(&self, io: &Io) -> bool {
        let Some(meta) = &self.metadata else {
            return false;
        };
        match meta.mark(io.offset, io.len) {
            Ok(()) => false,
            Err(e) => {
                log::error!("cairn: {}: {e}", self.health.device);
                true
            }
        }
    }

    /// Everything but the common case of `io_done`: flushes, retries, failures, pieces.
    #[inline(never)]
    fn io_done_other(&self, token: u64, status: IoStatus) {
        if token == FLUSH_BATCH {
            self.flush_done(status);
            return;
        }
        if token & PARKED != 0 {
            self.unpark((token & !PARKED) as u32);
            return;
        }
        if token & DIRECT != 0 {
            let index = (token & !DIRECT) as u32;
            if !status.is_ok() && self.copies > 1 {
                // A read sent whole to one copy failed: try another; the client never
                // sees the failure while a healthy copy remains (and the copy that failed
                // is rewritten once one answers: see `io_done`).
                let (io, tried) = {
                    let st = self.state.borrow();
                    let p = st.parents.get(index);
                    (p.io, p.tried)
                };
                if let Some(k) = self.healthy_copy(io.offset, io.len, 0, tried) {
                    self.state.borrow_mut().parents.get_mut(index).tried |= 1 << k;
                    self.send_direct(index, &io, k, self.layout.locate(io.offset, k));
                    return;
                }
            }
            let p = self.state.borrow_mut().parents.remove(index);
            self.leave_gate(&p);
            self.answer(&p, status);
            return;
        }
        let token = token as u32;
        let child = *self.state.borrow().children.get(token);
        if !status.is_ok() {
            let redundant = self.copies > 1;
            if child.op == Op::Read && redundant {
                // Retry another copy; the client never sees the failed read.
                let start = self.layout.copies();
                if let Some(k) = self.healthy_copy(child.logical, child.len, start, child.tried) {
                    let (member, member_offset) = self.layout.locate(child.logical, k);
                    {
                        let mut st = self.state.borrow_mut();
                        let c = st.children.get_mut(token);
                        c.member = member as u16;
                        c.tried |= 1 << k;
                    }
                    self.member(member).submit(Io {
                        op: Op::Read,
                        flags: child.flags,
                        offset: member_offset + self.data_offset,
                        len: child.len,
                        buf: child.buf,
                        sink: self.sink.get(),
                        token: u64::from(token),
                    });
                    return;
                }
            }
            let mut st = self.state.borrow_mut();
            let p = st.parents.get_mut(child.parent);
            if redundant && child.op != Op::Read {
                // The member lost a write (or a flush): it no longer holds good data.
                drop(st);
                self.health.fail(child.member as usize, status);
                if let (Some(meta), true) = (&self.metadata, (child.member as usize) < self.n) {
                    // Recorded in the other members' superblocks before this request is
                    // answered: acknowledged data is never only on members that a restart
                    // would take for current alongside this one. Synchronous, on this
                    // thread: once per member failure, a control-plane event.
                    meta.fail_member(child.member as usize);
                }
                self.state
                    .borrow_mut()
                    .parents
                    .get_mut(child.parent)
                    .degraded = true;
            } else if p.status.is_ok() {
                p.status = status;
            }
        } else if child.tried & child.tried.wrapping_sub(1) != 0 {
            // A piece read from another copy after one failed (only reads are retried):
            // the copies that failed are rewritten.
            self.repair_later(child.logical, child.len, child.tried, child.member as usize);
        }
        let done = {
            let mut st = self.state.borrow_mut();
            st.children.remove(token);
            let p = st.parents.get_mut(child.parent);
            p.pending -= 1;
            p.pending == 0
        };
        if done {
            self.finish_parent(child.parent);
        }
    }
}

impl Sink for StackQueue {
    fn io_done(&self, token: u64, status: IoStatus) {
        // The common case: a request of a layout without copies, sent whole to one member.
        if token & (DIRECT | LONE) == LONE {
            let l = self.state.borrow_mut().lone.remove((token & !LONE) as u32);
            if self.stats.enabled() {
                self.stats.done(
                    IoFlags::NONE,
                    l.op,
                    l.len,
                    l.start_ns,
                    self.core.now_ns(),
                    status.is_ok(),
                );
            }
            self.core.deliver(l.sink, l.token, status);
            return;
        }
        // A request sent whole to one copy succeeded (or failed where there is no other
        // copy to try).
        if token & DIRECT != 0 && token != FLUSH_BATCH && (status.is_ok() || self.copies == 1) {
            let p = self
                .state
                .borrow_mut()
                .parents
                .remove((token & !DIRECT) as u32);
            self.leave_gate(&p);
            self.answer(&p, status);
            if p.tried & p.tried.wrapping_sub(1) != 0 {
                // Answered by a copy tried after others failed (only reads are retried):
                // those are rewritten, after the client has its data.
                let copy = ((token >> COPY_SHIFT) & (COPIES_MAX as u64 - 1)) as usize;
                let good = self.layout.locate(p.io.offset, copy).0;
                self.repair_later(p.io.offset, p.io.len, p.tried, good);
            }
            return;
        }
        self.io_done_other(token, status);
    }
}
