//! Stacked devices: linear, stripe (RAID0), mirror (RAID1) and raid10, over one engine.
//!
//! A [`Layout`] says where each byte of the stacked device lives: on which member, at
//! which offset, in how many copies. [`StackQueue`] does the rest for every layout: it
//! splits a request at chunk and member boundaries, submits the pieces to its members'
//! queues on the same reactor (technique 4: no hand-off to another thread), and completes
//! the request when every piece has. Per-request state lives in two per-queue slabs.
//!
//! Redundant layouts (copies > 1) keep going when members fail: a failed read is retried
//! on another copy; a failed write, discard or flush marks the member failed and the array
//! runs degraded (logged once, and listed by `Device::failed_members`). A request fails
//! only when some of its data has no healthy copy left.

mod layouts;
mod rebuild;

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use cairn_core::slab::Slab;
use cairn_core::{
    Caps, Core, Device, Error, FlushBatcher, Geometry, Io, IoFlags, IoStatus, Op, Queue,
    QueueStats, Sink, SinkId,
};

pub use layouts::{AnyLayout, Linear, Mirror, Raid10, Stripe, COPIES_MAX};

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
struct Health {
    device: String,
    names: Vec<String>,
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
    /// Per member: recovered from the bitmap, so current outside the regions dirty at
    /// start.
    partial: Vec<AtomicBool>,
    /// The write-intent bitmap, if the array keeps one.
    bitmap: Option<Arc<crate::array::bitmap::Bitmap>>,
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
                    .is_some_and(|b| b.regions_of(logical, len).all(|r| !b.dirty_at_start(r))))
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
                .is_none_or(|b| b.regions_of(logical, len).any(|r| b.dirty_at_start(r)))
    }

    fn fail(&self, member: usize, status: IoStatus) {
        self.readable[member].store(false, Relaxed);
        if !self.failed[member].swap(true, Relaxed) {
            eprintln!(
                "cairn: {}: member {} failed ({status}); running degraded",
                self.device, self.names[member]
            );
        }
    }
}

/// A device made of other devices.
pub struct StackDevice {
    name: String,
    layout: Arc<AnyLayout>,
    members: Vec<Arc<dyn Device>>,
    health: Arc<Health>,
    geometry: Geometry,
    /// Where data starts on every member (after the metadata area, if any).
    data_offset: u64,
    /// The superblocks, for an array that keeps them (its queues record failures in
    /// them).
    metadata: Option<Arc<crate::array::Metadata>>,
    /// The rebuild thread, while one runs: its stop flag and handle.
    rebuild: Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>,
    /// The thread that clears idle bitmap bits: its stop flag and handle.
    bitmap_daemon: Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>,
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
        let health = Arc::new(Health {
            device: name.into(),
            names: members.iter().map(|m| m.name().to_string()).collect(),
            failed: members.iter().map(|_| AtomicBool::new(false)).collect(),
            readable: members.iter().map(|_| AtomicBool::new(true)).collect(),
            one_copy: AtomicBool::new(false),
            sync: rebuild::WriteCounts::new(),
            below: members.iter().map(|_| AtomicU64::new(0)).collect(),
            partial: members.iter().map(|_| AtomicBool::new(false)).collect(),
            bitmap: None,
        });
        Ok(StackDevice {
            name: name.into(),
            geometry: Geometry {
                size_bytes,
                block_bytes,
                caps,
            },
            layout,
            members,
            health,
            data_offset: 0,
            metadata: None,
            rebuild: None,
            bitmap_daemon: None,
        })
    }

    /// Runs the array on its superblocks: data starts after the metadata area; members
    /// that are missing are neither written nor read, and members that are not current
    /// (rebuilding, stale, new) are written but not read.
    pub fn with_metadata(
        mut self,
        metadata: crate::array::Metadata,
        rate: crate::config::ArrayOptions,
    ) -> StackDevice {
        use crate::array::superblock::MemberState;
        if let Some(health) = Arc::get_mut(&mut self.health) {
            // No queue exists yet: the health is this device's alone.
            health.bitmap = metadata.bitmap().cloned();
        }
        for (m, state) in metadata.states().into_iter().enumerate() {
            let (ok, readable) = match state {
                MemberState::Active => (true, true),
                MemberState::Rebuilding => (true, false),
                MemberState::Failed | MemberState::Missing => (false, false),
            };
            self.health.failed[m].store(!ok, Relaxed);
            self.health.readable[m].store(readable, Relaxed);
            if state == MemberState::Rebuilding {
                let partial = metadata.partial(m) && self.health.bitmap.is_some();
                self.health.partial[m].store(partial, Relaxed);
                // Current below its checkpoint (for a partial recovery, below it every
                // dirty region was copied).
                if !partial {
                    self.health.below[m].store(metadata.recovery_offset(m), Relaxed);
                }
            }
        }
        self.health
            .one_copy
            .store(metadata.resync_pending(), Relaxed);
        self.data_offset = metadata.data_offset();
        let metadata = Arc::new(metadata);
        if !metadata.dry() && rebuild::needed(&self.health, &metadata.states()) {
            // Counting starts before any queue exists, so every client write is counted.
            self.health.sync.on_now();
            let stop = Arc::new(AtomicBool::new(false));
            let job = rebuild::Job {
                name: self.name.clone(),
                layout: self.layout.clone(),
                members: self.members.clone(),
                health: self.health.clone(),
                metadata: metadata.clone(),
                data_offset: self.data_offset,
                stop: stop.clone(),
                rate,
            };
            match std::thread::Builder::new()
                .name(format!("cairn-sync-{}", self.name))
                .spawn(move || rebuild::run(job))
            {
                Ok(handle) => self.rebuild = Some((stop, handle)),
                Err(e) => eprintln!("cairn: {}: cannot start the rebuild: {e}", self.name),
            }
        }
        if !metadata.dry() && self.health.bitmap.is_some() {
            let stop = Arc::new(AtomicBool::new(false));
            let job = rebuild::Clearing {
                members: self.members.clone(),
                health: self.health.clone(),
                metadata: metadata.clone(),
                stop: stop.clone(),
                delay: rate.bitmap_delay,
            };
            match std::thread::Builder::new()
                .name(format!("cairn-bitmap-{}", self.name))
                .spawn(move || rebuild::clear_bits(job))
            {
                Ok(handle) => self.bitmap_daemon = Some((stop, handle)),
                Err(e) => eprintln!(
                    "cairn: {}: cannot start the bitmap's thread (its bits stay set): {e}",
                    self.name
                ),
            }
        }
        self.metadata = Some(metadata);
        self
    }
}

impl Drop for StackDevice {
    fn drop(&mut self) {
        // Every queue is gone (they hold the device's members, not the device), so no
        // write is in flight: the array stops clean, with the members that failed
        // recorded as failed.
        for (stop, handle) in [self.rebuild.take(), self.bitmap_daemon.take()]
            .into_iter()
            .flatten()
        {
            stop.store(true, Relaxed);
            let _ = handle.join();
        }
        if let Some(meta) = &self.metadata {
            let failed: Vec<bool> = (0..self.members.len())
                .map(|m| !self.health.ok(m))
                .collect();
            meta.stop(&failed);
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
            self.members.len(),
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
                    format!("{} {state}", self.health.names[m])
                })
                .collect();
            if !not_read.is_empty() {
                out += &format!(", degraded: {}", not_read.join(", "));
            }
        }
        out
    }

    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
        let members = self
            .members
            .iter()
            .map(|m| cairn_core::handoff::open_member(core, m))
            .collect::<Result<Vec<_>, _>>()?;
        let targets = members.iter().map(Rc::as_ptr).collect();
        let queue = Rc::new(StackQueue {
            core: core.clone(),
            targets,
            stats: QueueStats::new(core.switches().stats),
            layout: self.layout.clone(),
            members,
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
            data_offset: self.data_offset,
            metadata: self.metadata.clone(),
            bitmap: self.health.bitmap.clone(),
        });
        queue.sink.set(core.register_sink(queue.clone()));
        Ok(queue)
    }

    fn children(&self) -> Vec<Arc<dyn Device>> {
        self.members.clone()
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
        while at < end && out.len() < MAX_EXTENTS {
            let n = self.layout.piece_len(at, end - at);
            let copy = (0..self.layout.copies())
                .find(|&k| self.health.readable(self.layout.locate(at, k).0))
                .unwrap_or(0);
            let (member, member_offset) = self.layout.locate(at, copy);
            piece.clear();
            self.members[member].extents(member_offset + self.data_offset, n, &mut piece)?;
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

    fn array_status(&self) -> Option<String> {
        use crate::array::superblock::MemberState;
        use cairn_core::size::format_bytes;
        let meta = self.metadata.as_ref()?;
        let states = meta.states();
        let mut flags = String::new();
        let mut members = Vec::new();
        for (m, s) in states.iter().enumerate() {
            let state = match s {
                _ if !self.health.ok(m) && *s != MemberState::Missing => "failed",
                MemberState::Rebuilding if self.health.readable(m) => "active",
                s => s.name(),
            };
            flags.push(if self.health.readable(m) { 'U' } else { '_' });
            members.push(format!("{} {state}", self.health.names[m]));
        }
        let sync = &self.health.sync;
        let degraded = flags.contains('_');
        let mut out = format!(
            "{}: {} of {} members, {}, metadata 1 {}{}\n    [{flags}] {}\n",
            self.name,
            self.layout.kind(),
            self.members.len(),
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
        if let Some(bm) = &self.health.bitmap {
            out += &format!(
                "    bitmap: {} of {} regions of {} dirty\n",
                bm.dirty_count(),
                bm.regions(),
                format_bytes(bm.region_bytes())
            );
        }
        Some(out)
    }

    fn array_action(&self, action: &str, member: &str) -> Result<String, String> {
        use crate::array::assemble::uncovered;
        use crate::array::superblock::{Level, MemberState};
        let name = &self.name;
        let Some(meta) = self.metadata.as_ref().filter(|m| !m.dry()) else {
            return Err(format!(
                "'{name}' keeps no metadata (metadata = \"1\"): it has no '{action}'"
            ));
        };
        let Some(m) = self.health.names.iter().position(|n| n == member) else {
            return Err(format!(
                "'{name}' has no member '{member}' (its members: {})",
                self.health.names.join(", ")
            ));
        };
        let level = match self.layout.kind() {
            "mirror" => Level::Mirror,
            "raid10" => Level::Raid10,
            kind => {
                return Err(format!(
                    "'{name}' is a {kind}: it has no redundancy to run without a member"
                ))
            }
        };
        match action {
            "fail" => {
                if !self.health.ok(m) {
                    return Err(format!(
                        "member '{member}' of '{name}' has failed already or is missing"
                    ));
                }
                // Never below what the array can run on: every piece keeps a current copy.
                let current: Vec<bool> = (0..self.members.len())
                    .map(|i| i != m && self.health.readable(i))
                    .collect();
                if let Some(set) = uncovered(level, self.layout.copies(), &current) {
                    let names: Vec<String> = set
                        .iter()
                        .map(|&i| format!("'{}'", self.health.names[i]))
                        .collect();
                    return Err(format!(
                        "failing '{member}' would leave data of '{name}' with no current copy                          (it lives on {}); let a rebuild finish first",
                        names.join(", ")
                    ));
                }
                self.health.readable[m].store(false, Relaxed);
                self.health.failed[m].store(true, Relaxed);
                eprintln!("cairn: {name}: member {member} failed by the admin; running degraded");
                meta.fail_member(m);
                Ok(format!(
                    "{name}: member '{member}' failed; running degraded"
                ))
            }
            "remove" => {
                if meta.states()[m] == MemberState::Active && self.health.ok(m) {
                    return Err(format!(
                        "member '{member}' of '{name}' is in use: fail it first"
                    ));
                }
                meta.remove_member(m)
                    .map_err(|e| format!("cannot remove member '{member}' of '{name}': {e}"))?;
                eprintln!("cairn: {name}: member {member} removed by the admin");
                Ok(format!(
                    "{name}: member '{member}' removed: recorded as missing; its file stays open until the server stops"
                ))
            }
            other => Err(format!("no array action '{other}' (known: fail, remove)")),
        }
    }

    fn failed_members(&self) -> Vec<String> {
        (0..self.members.len())
            .filter(|&m| !self.health.ok(m))
            .map(|m| self.health.names[m].clone())
            .collect()
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

/// A stacked device's queue on one reactor.
pub struct StackQueue {
    core: Rc<Core>,
    /// The members' queues as plain pointers, so that a submit needs no look-up of where
    /// the value sits inside its `Rc` (`members` keeps them alive and never changes).
    targets: Vec<*const dyn Queue>,
    stats: QueueStats,
    layout: Arc<AnyLayout>,
    members: Vec<Rc<dyn Queue>>,
    health: Arc<Health>,
    sink: Cell<SinkId>,
    state: RefCell<State>,
    next_copy: Cell<usize>,
    flushes: FlushBatcher,
    /// The layout's copies, kept here to spare the hot path a pointer chase.
    copies: usize,
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

impl StackQueue {
    /// The queue of member `m`.
    #[inline]
    fn member(&self, m: usize) -> &dyn Queue {
        // SAFETY: `targets` points into `members`, which this queue owns and never changes.
        unsafe { &*self.targets[m] }
    }

    /// Starts `io` as a parent sent whole to copy `copy`, which lives at `at`.
    #[inline(always)]
    fn direct(&self, io: Io, start_ns: u64, copy: usize, at: (usize, u64)) {
        let parent = self.state.borrow_mut().parents.insert(Parent {
            io,
            pending: 1,
            status: IoStatus::OK,
            start_ns,
            degraded: false,
            tried: 1 << copy,
            counted: false,
            marked: false,
        });
        self.send_direct(parent, &io, at);
    }

    /// Sends the whole request `io` of `parent` to `at` (member, member offset).
    #[inline(always)]
    fn send_direct(&self, parent: u32, io: &Io, at: (usize, u64)) {
        let (member, member_offset) = at;
        self.member(member).submit(Io {
            offset: member_offset + self.data_offset,
            sink: self.sink.get(),
            token: DIRECT | u64::from(parent),
            ..*io
        });
    }

    /// Fans one flush out to every healthy member, on behalf of the batch.
    fn start_flush(&self) {
        let io = Io::nodata(Op::Flush, 0, 0, self.sink.get(), FLUSH_BATCH);
        let parent = self.state.borrow_mut().parents.insert(Parent {
            io,
            pending: 1,
            status: IoStatus::OK,
            start_ns: 0,
            degraded: false,
            tried: 0,
            counted: false,
            marked: false,
        });
        for m in 0..self.members.len() {
            if self.health.ok(m) {
                self.child(parent, Op::Flush, &io, (0, 0, std::ptr::null_mut()), m);
            }
        }
        let mut st = self.state.borrow_mut();
        let p = st.parents.get_mut(parent);
        p.pending -= 1;
        if p.pending == 0 {
            // No healthy member left: the batch fails through the FIFO.
            st.parents.remove(parent);
            drop(st);
            self.core
                .complete(self.sink.get(), FLUSH_BATCH, IoStatus::errno(libc::EIO));
        }
    }

    /// The batch's flush finished: every request it covered completes with `status`.
    fn flush_done(&self, status: IoStatus) {
        let again = self.flushes.finish(|io, start| {
            if self.stats.enabled() {
                self.stats
                    .done(Op::Flush, 0, start, self.core.now_ns(), status.is_ok());
            }
            self.core.deliver(io.sink, io.token, status);
        });
        if again {
            self.start_flush();
        }
    }

    /// Records a child of `parent` and submits it to `member`.
    #[inline]
    fn child(&self, parent: u32, op: Op, io: &Io, piece: (u64, u64, *mut u8), copy: usize) {
        let (logical, len, buf) = piece;
        let (member, member_offset) = if op == Op::Flush {
            (copy, 0)
        } else {
            let (m, at) = self.layout.locate(logical, copy);
            (m, at + self.data_offset)
        };
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
        let span = (self.members.len() as u64 * (64 << 10)).min(size);
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

    /// Accounts a finished parent request and hands its completion to its submitter.
    #[inline(always)]
    fn answer(&self, p: &Parent, status: IoStatus) {
        if self.stats.enabled() {
            self.stats.done(
                p.io.op,
                p.io.len,
                p.start_ns,
                self.core.now_ns(),
                status.is_ok(),
            );
        }
        self.core.deliver(p.io.sink, p.io.token, status);
    }
}

impl Queue for StackQueue {
    fn submit(&self, io: Io) {
        let start_ns = if self.stats.enabled() {
            self.core.now_ns()
        } else {
            0
        };
        self.stats.start(start_ns);
        // The common case, kept small so that it stays cheap: the whole request goes to
        // one member of a layout without copies. No child state; the parent's slab index
        // travels as the token.
        if self.copies == 1 && io.op != Op::Flush {
            if let Some((member, member_offset)) = self.layout.place(io.offset, io.len, 0) {
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
        self.submit_other(io, start_ns);
    }

    fn stats(&self) -> &QueueStats {
        &self.stats
    }

    fn children(&self) -> Vec<Rc<dyn Queue>> {
        self.members.clone()
    }
}

impl StackQueue {
    /// Everything but the common case of `submit`: flushes, reads of redundant layouts,
    /// and requests split into pieces.
    #[inline(never)]
    fn submit_other(&self, io: Io, start_ns: u64) {
        // While a rebuild runs it yields to clients: it counts their requests.
        self.health.sync.client(&io);
        if io.op == Op::Flush {
            if self.flushes.arrive(io, start_ns) {
                self.start_flush();
            }
            return;
        }
        let copies = self.copies;
        // A read of a redundant layout that lands whole on one member goes to one copy.
        if copies > 1 && io.op == Op::Read && self.layout.piece_len(io.offset, io.len) == io.len {
            let n = self.next_copy.get();
            self.next_copy.set(n.wrapping_add(1));
            if let Some(copy) = self.healthy_copy(io.offset, io.len, n % copies, 0) {
                self.direct(io, start_ns, copy, self.layout.locate(io.offset, copy));
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
            // A change of data while a rebuild runs is counted, so the rebuild can tell
            // whether a region it copied was written meanwhile.
            counted: io.op != Op::Read && self.health.sync.start(&io),
            marked,
        });
        let copies = self.copies;
        let mut missing = unmarked;
        match io.op {
            Op::Flush => unreachable!("flushes go through the batcher"),
            _ if unmarked => {}
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
                            if self.health.ok(self.layout.locate(at, k).0) {
                                self.child(parent, op, &io, (at, len, buf), k);
                                any = true;
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
            if self.stats.enabled() {
                self.stats
                    .done(p.io.op, p.io.len, p.start_ns, self.core.now_ns(), false);
            }
            let status = if p.status.is_ok() {
                IoStatus::errno(libc::EIO)
            } else {
                p.status
            };
            self.core.complete(p.io.sink, p.io.token, status);
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
                eprintln!("cairn: {}: {e}", self.health.device);
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
        if token & DIRECT != 0 {
            let index = (token & !DIRECT) as u32;
            if !status.is_ok() && self.copies > 1 {
                // A read sent whole to one copy failed: try another; the client never
                // sees the failure while a healthy copy remains.
                let (io, tried) = {
                    let st = self.state.borrow();
                    let p = st.parents.get(index);
                    (p.io, p.tried)
                };
                if let Some(k) = self.healthy_copy(io.offset, io.len, 0, tried) {
                    self.state.borrow_mut().parents.get_mut(index).tried |= 1 << k;
                    self.send_direct(index, &io, self.layout.locate(io.offset, k));
                    return;
                }
            }
            let p = self.state.borrow_mut().parents.remove(index);
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
                if let Some(meta) = &self.metadata {
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
                self.stats
                    .done(l.op, l.len, l.start_ns, self.core.now_ns(), status.is_ok());
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
            self.answer(&p, status);
            return;
        }
        self.io_done_other(token, status);
    }
}
