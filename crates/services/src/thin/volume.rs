//! A thin volume as a block device: [`ThinDevice`], and its queue on each reactor.
//!
//! A request is cut at block boundaries into pieces. Per piece, by its entry:
//! - **read**: a hole reads as zeros (no I/O); a mapped block is read where it is.
//! - **write** to a block the volume owns alone: in place. To a hole: a block from the
//!   queue's stash is mapped (one compare-and-swap), then written; the rest of it is
//!   zeros already. To a shared block (a snapshot holds it too): copy on write into a
//!   new block (the old one read into a buffer and the piece merged, unless the piece is
//!   the whole block), then the entry is swapped to it. A swap that loses to another
//!   request gives its block back and the piece runs again.
//! - **discard, write-zeroes** of a whole block: unmapped (its space comes back at the
//!   next commit). Of part of one: passed down if owned, copied with zeros if shared.
//!
//! Consecutive pieces that land on consecutive data blocks go down as one request; a read
//! or write inside one mapped (owned, for a write) block goes down whole with no pieces
//! at all ([`ThinQueue::start_lone`]). Flushes wait for the pool's next commit, and so do
//! FUA writes unless every block they write is owned and its mapping durable: those go
//! down with FUA. Every request except a flush is counted in the pool's gate while it
//! runs (see [`Inner::grace`]): a write as changing what a snapshot copies, except while
//! only its copies on write are left (see [`Gate::slot`]). While a snapshot holds the
//! volume's writes, a copy on write goes on, and waits only to swap its entry.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;

use cairn_core::buf::AlignedBuf;
use cairn_core::reactor::{Core, Poller, Sink};
use cairn_core::slab::Slab;
use cairn_core::stats::QueueStats;
use cairn_core::{
    Caps, ChangeLog, ChangeMarker, Device, DirtyBitmaps, DirtyMap, Error, Extent, Geometry, Io,
    IoFlags, IoStatus, Offer, Op, Queue, SinkId, Want,
};

use super::capability::{ThinPoolAdmin, ThinVolume};
use super::pool::{Gate, Inner, Take, ThinPool, Volume, Waiter};
use super::state::OWNED;
use super::table::LEAF_ENTRIES;

/// Copy-on-write buffers per queue (each one block).
const COW_BUFFERS: usize = 4;
/// A parked request is looked at again after this long.
const RETRY_NS: u64 = 50_000;
/// Timer token.
const RETRY: u64 = u64::MAX;

/// A thin volume (or snapshot, or clone) of a pool.
pub struct ThinDevice {
    name: String,
    /// The pool's device (kept open while any of its volumes is).
    pool: Arc<ThinPool>,
    inner: Arc<Inner>,
    vol: Arc<Volume>,
    geometry: Geometry,
}

impl ThinDevice {
    /// Volume `volume` of `pool`, created when absent if `size` is given and `create`
    /// (else a stand-in for `cairn check`); refused if `pool` is not a thin pool.
    pub fn open(
        name: &str,
        pool: Arc<dyn Device>,
        volume: &str,
        size: Option<u64>,
        create: bool,
    ) -> Result<ThinDevice, Error> {
        pool.capability::<dyn ThinPoolAdmin>()
            .ok_or_else(|| Error::Invalid(format!("'{}' is not a thin pool", pool.name())))?
            .open_volume(name, volume, size, create)
    }

    /// Volume `volume` of `pool`, whose run-time state is `inner` (see
    /// [`ThinPoolAdmin::open_volume`]).
    pub(super) fn new(
        name: &str,
        pool: Arc<ThinPool>,
        inner: Arc<Inner>,
        volume: &str,
        size: Option<u64>,
        create: bool,
    ) -> Result<ThinDevice, Error> {
        let vol = inner.attach(volume, size, create)?;
        let block = inner.data.geometry().block_bytes.max(512);
        let caps = if vol.read_only {
            Caps {
                flush: true,
                fua: false,
                discard: false,
                write_zeroes: false,
            }
        } else {
            Caps::ALL
        };
        let size_bytes = vol.size.load(SeqCst) / u64::from(block) * u64::from(block);
        Ok(ThinDevice {
            name: name.to_string(),
            geometry: Geometry {
                size_bytes,
                block_bytes: block,
                caps,
            },
            pool,
            inner,
            vol,
        })
    }
}

impl Drop for ThinDevice {
    fn drop(&mut self) {
        self.vol.users.fetch_sub(1, SeqCst);
    }
}

impl Device for ThinDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn describe(&self) -> String {
        format!(
            "thin volume={}{}",
            self.vol.name,
            if self.vol.read_only {
                " read-only (a snapshot)"
            } else {
                ""
            }
        )
    }

    /// The volume's size now: a volume grown while served is seen at its new size by
    /// whoever asks next (the next NBD connection).
    fn geometry(&self) -> Geometry {
        let block = u64::from(self.geometry.block_bytes);
        Geometry {
            size_bytes: self.vol.size.load(SeqCst) / block * block,
            ..self.geometry
        }
    }

    fn read_only(&self) -> bool {
        self.vol.read_only
    }

    fn children(&self) -> Vec<Arc<dyn Device>> {
        vec![self.pool.clone()]
    }

    fn offer(self: Arc<Self>, want: Want) -> Option<Offer> {
        want.offer::<dyn ThinVolume>(|| self.clone())
            .or_else(|| want.offer::<dyn DirtyBitmaps>(|| self))
    }

    fn extents(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        let shift = self.inner.block_shift;
        let bs = 1u64 << shift;
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let vb = at >> shift;
            if !self.vol.table.has_leaf(vb) {
                // No leaf was ever made there: its blocks are holes, answered at once
                // rather than block by block (a 1 TiB volume has 16M blocks of 64 KiB).
                let leaf = LEAF_ENTRIES as u64;
                let n = (((vb / leaf + 1) * leaf) << shift).min(end) - at;
                Extent::push(out, Extent::hole(n));
                at += n;
                if out.len() >= 1024 {
                    break;
                }
                continue;
            }
            let n = ((vb + 1) << shift).min(end) - at;
            let e = self.vol.table.get(vb);
            Extent::push(
                out,
                if e == 0 {
                    Extent::hole(n)
                } else {
                    Extent::data(n)
                },
            );
            at += n;
            if out.len() >= 1024 && at.is_multiple_of(bs) {
                break;
            }
        }
        Ok(())
    }

    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
        let inner = self.inner.clone();
        if !inner.running {
            return Err(Error::Invalid(format!(
                "thin pool '{}' is only examined, not running",
                inner.name
            )));
        }
        let data = cairn_core::handoff::open_member(core, &inner.data)?;
        let wake = cairn_core::event::eventfd("thin")?;
        let (tx, rx) = mpsc::channel();
        let gate = Arc::new(Gate::new(self.vol.id));
        inner.add_gate(&gate);
        let data_caps = inner.data.geometry().caps;
        let q = Rc::new(ThinQueue {
            core: core.clone(),
            stats: QueueStats::named(core.switches().stats, &self.name),
            data,
            data_caps,
            vol: self.vol.clone(),
            changes: self.vol.changes.get().cloned().map(|log| log.marker()),
            inner,
            gate,
            sink: Cell::new(SinkId(u32::MAX)),
            parents: RefCell::new(Slab::with_capacity(256)),
            children: RefCell::new(Slab::with_capacity(256)),
            lone: RefCell::new(Slab::with_capacity(256)),
            stash: RefCell::new(Vec::with_capacity(4 * super::pool::STASH)),
            reserved: Cell::new(0),
            bufs: RefCell::new(Vec::with_capacity(COW_BUFFERS)),
            free_bufs: RefCell::new(Vec::with_capacity(COW_BUFFERS)),
            waiting_buf: RefCell::new(VecDeque::new()),
            parked: RefCell::new(VecDeque::new()),
            held: RefCell::new(Vec::new()),
            timer: Cell::new(false),
            waits: Cell::new(0),
            reply_tx: tx,
            reply_rx: rx,
            wake,
        });
        q.sink.set(core.register_sink(q.clone()));
        core.register_poller(q.clone());
        Ok(q)
    }
}

/// The changes since the volume's backup checkpoints, from the pool's mappings (see
/// [`super::backup`]): on a volume its own checkpoints, on a checkpoint's snapshot those
/// before it.
impl DirtyBitmaps for ThinDevice {
    fn names(&self) -> Vec<String> {
        let marks = self.inner.marks();
        super::backup::offered(&marks, self.vol.id)
            .into_iter()
            .map(|(_, m)| m.name.clone())
            .collect()
    }

    fn reader(&self, name: &str) -> Option<Arc<dyn DirtyMap>> {
        let marks = self.inner.marks();
        let (id, m) = super::backup::offered(&marks, self.vol.id)
            .into_iter()
            .find(|(_, m)| m.name == name)?;
        Some(Arc::new(super::backup::Changes::new(
            self.inner.clone(),
            self.vol.clone(),
            id,
            m.shift,
        )))
    }
}

impl ThinVolume for ThinDevice {
    fn pool(&self) -> Arc<dyn ThinPoolAdmin> {
        self.pool.clone()
    }

    fn volume(&self) -> &str {
        &self.vol.name
    }

    fn track(&self, log: Arc<dyn ChangeLog>) -> Result<(), Error> {
        self.vol.changes.set(log).map_err(|l| {
            Error::Invalid(format!(
                "volume '{}' keeps its bitmaps in {} already: one store per volume",
                self.vol.name,
                l.describe()
            ))
        })
    }
}

/// A request in progress. One cache line each: the line written at submit is usually
/// evicted by the time the request completes, so a parent straddling two lines would cost
/// two misses instead of one.
#[derive(Clone, Copy)]
#[repr(align(64))]
struct Parent {
    io: Io,
    start: u64,
    /// Pieces in flight.
    pending: u32,
    /// Of those, copies on write (each from its decision to its swap, waiting for a
    /// buffer or for held writes included); at `u16::MAX` no longer counted (then the
    /// parent stays in its changing slot to the end: a snapshot waits for it).
    copies: u16,
    status: IoStatus,
    /// How it is counted in the gate: [`PARITY`], [`CHANGING`], [`READING`] (neither:
    /// not counted).
    gate: u8,
    /// Blocks of the stash promised to its pieces and not taken yet.
    blocks: u32,
    /// A FUA write that waits for the next commit before it completes: one of its
    /// pieces made a mapping (or found one not yet durable), or the data device has no
    /// FUA. Else each piece carries FUA down.
    commit: bool,
}

/// [`Parent::gate`]: the parity of the epoch it entered the gate under.
const PARITY: u8 = 1;
/// [`Parent::gate`]: counted in the changing slot of its parity (see [`Gate::slot`]):
/// from its start while it writes, or while something it does in place is in flight.
const CHANGING: u8 = 2;
/// [`Parent::gate`]: counted in the other slot of its parity: a read, or a write with
/// only copies on write left.
const READING: u8 = 4;

/// [`Parent::gate`] of a request that entered the gate in `slot`.
fn counted(slot: usize) -> u8 {
    let changing = slot & 2 != 0;
    (slot & 1) as u8 | if changing { CHANGING } else { READING }
}

/// A request sent down whole, as it is, to where its one block is (see
/// [`ThinQueue::start_lone`]): only what its completion needs.
#[derive(Clone, Copy)]
#[repr(align(64))]
struct Lone {
    io: Io,
    start: u64,
    /// The slot it is counted in in the gate (see [`Gate::slot`]).
    parity: u8,
}

/// Token bit of a lone request's completion: the rest is its index in `lone` (a child's
/// token is its index, below 2^32; the retry timer's is all ones).
const LONE: u64 = 1 << 62;

/// One piece of a parent: `len` bytes at `off` in virtual block `vb`, at `at` in the
/// parent's buffer.
#[derive(Clone, Copy)]
struct Piece {
    parent: u32,
    vb: u64,
    off: u64,
    len: u64,
    at: u64,
}

/// What deciding a piece came to.
enum Placed {
    /// It goes to the data device as it is, at this offset.
    At(u64),
    /// Handled here: a hole filled or left, an unmap, a copy on write started, a failure.
    Done,
    /// Its entry changed under it (another request won the swap): decide it again.
    Again,
}

/// Something a parent counted for copies only does once writes to the volume go on (a
/// snapshot of it is being taken): see [`ThinQueue::changing`].
#[derive(Clone, Copy)]
enum Held {
    /// A copy on write's swap of `old` for `new` (written) in the piece's entry.
    Swap { piece: Piece, old: u32, new: u32 },
    /// A piece that waited for a copy-on-write buffer runs again.
    Rerun(Piece),
}

/// What a request sent to the data device is for.
#[derive(Clone, Copy)]
enum Child {
    /// Counts for its parent only.
    Plain { parent: u32 },
    /// A whole-block write into `new` replacing shared `old`: swap when done.
    CowWhole { piece: Piece, old: u32, new: u32 },
    /// The read of shared `old` into buffer `buf` for a partial copy on write.
    CowRead {
        piece: Piece,
        old: u32,
        new: u32,
        buf: u32,
    },
    /// The merged block written to `new`.
    CowWrite {
        piece: Piece,
        old: u32,
        new: u32,
        buf: u32,
    },
}

struct ThinQueue {
    core: Rc<Core>,
    stats: QueueStats,
    data: Rc<dyn Queue>,
    data_caps: Caps,
    vol: Arc<Volume>,
    /// The log of the volume's changes (its dirty bitmaps), if it keeps one.
    changes: Option<Box<dyn ChangeMarker>>,
    inner: Arc<Inner>,
    gate: Arc<Gate>,
    sink: Cell<SinkId>,
    parents: RefCell<Slab<Parent>>,
    children: RefCell<Slab<Child>>,
    lone: RefCell<Slab<Lone>>,
    /// Free zeroed blocks taken from the pool.
    stash: RefCell<Vec<u32>>,
    /// Blocks of the stash promised to requests in progress.
    reserved: Cell<usize>,
    /// Copy-on-write buffers (made when first needed, at most [`COW_BUFFERS`]), and the
    /// indices of those not in use.
    bufs: RefCell<Vec<AlignedBuf>>,
    free_bufs: RefCell<Vec<u32>>,
    /// Pieces waiting for a copy-on-write buffer.
    waiting_buf: RefCell<VecDeque<Piece>>,
    /// Requests waiting (a snapshot holds writes, or freed space is on its way).
    parked: RefCell<VecDeque<(Io, u64)>>,
    /// What copies on write wait to do while a snapshot holds writes (at most one per
    /// piece in flight).
    held: RefCell<Vec<Held>>,
    timer: Cell<bool>,
    /// Flushes and FUA writes waiting for a commit.
    waits: Cell<u64>,
    reply_tx: Sender<(u64, IoStatus)>,
    reply_rx: Receiver<(u64, IoStatus)>,
    wake: Arc<OwnedFd>,
}

impl Drop for ThinQueue {
    fn drop(&mut self) {
        self.inner.give_back(&self.stash.borrow());
    }
}

impl ThinQueue {
    fn shift(&self) -> u32 {
        self.inner.block_shift
    }

    /// Where data block `entry` names starts on the data device.
    fn phys(&self, entry: u32) -> u64 {
        let b = u64::from((entry & !OWNED) - 1);
        self.inner.data_offset + (b << self.shift())
    }

    fn finish(&self, io: &Io, start: u64, status: IoStatus) {
        self.stats
            .finish(io, start, || self.core.now_ns(), status.is_ok());
    }

    fn park(&self, io: Io, start: u64) {
        self.parked.borrow_mut().push_back((io, start));
        self.arm_timer();
    }

    /// The retry timer fires in [`RETRY_NS`] (if it is not armed already).
    fn arm_timer(&self) {
        if !self.timer.replace(true) {
            self.core
                .add_timer(self.core.now_ns() + RETRY_NS, self.sink.get(), RETRY);
        }
    }

    /// Blocks for `need` more allocations in the stash: whether there are (else the
    /// request waits or fails, per `Take`).
    fn stock(&self, need: usize) -> Take {
        let mut stash = self.stash.borrow_mut();
        let want = self.reserved.get() + need;
        while stash.len() < want {
            match self.inner.take_blocks(&mut stash) {
                Take::Got => {}
                other => return other,
            }
        }
        self.reserved.set(want);
        Take::Got
    }

    /// A block for a piece of parent `p` (one promised to it, or, when its promises are
    /// used up by pieces that ran again, any the pool still has).
    fn pop_block(&self, p: u32) -> Option<u32> {
        {
            let mut parents = self.parents.borrow_mut();
            let par = parents.get_mut(p);
            if par.blocks > 0 {
                par.blocks -= 1;
                self.reserved.set(self.reserved.get() - 1);
            }
        }
        let mut stash = self.stash.borrow_mut();
        if stash.len() <= self.reserved.get() {
            // Everything left is promised to other requests: ask the pool.
            let _ = self.inner.take_blocks(&mut stash);
        }
        if stash.len() <= self.reserved.get() {
            return None;
        }
        stash.pop()
    }

    /// Block `b`, unused, goes back to the stash, promised to parent `p` again.
    fn push_block(&self, p: u32, b: u32) {
        self.stash.borrow_mut().push(b);
        self.parents.borrow_mut().get_mut(p).blocks += 1;
        self.reserved.set(self.reserved.get() + 1);
    }

    /// Starts `io` (submit, or again after it waited).
    fn start(&self, io: Io, start: u64) {
        if io.op == Op::Flush {
            self.wait_commit(io, start);
            return;
        }
        if io.op.is_write() && self.vol.read_only {
            self.finish(&io, start, IoStatus::errno(libc::EROFS));
            self.core
                .complete(io.sink, io.token, IoStatus::errno(libc::EROFS));
            return;
        }
        let slot = self.inner.enter(&self.gate, io.op.is_write());
        if self.start_lone(&io, start, slot) {
            return;
        }
        let mut need = 0;
        if io.op.is_write() {
            if self.vol.frozen.load(SeqCst) {
                self.inner.leave(&self.gate, slot);
                self.park(io, start);
                return;
            }
            if !self.mark_changes(&io, start, slot) {
                return;
            }
            // Blocks for every piece that may need one, before anything is changed: a
            // request that cannot have them all changes nothing.
            need = self.needs_blocks(&io);
            if need > 0 {
                let failed = self.inner.failed.load(Relaxed);
                let take = if failed { Take::Full } else { self.stock(need) };
                match take {
                    Take::Got => {}
                    Take::Wait => {
                        self.inner.leave(&self.gate, slot);
                        self.park(io, start);
                        return;
                    }
                    Take::Full => {
                        self.inner.leave(&self.gate, slot);
                        let errno = if failed { libc::EIO } else { libc::ENOSPC };
                        self.finish(&io, start, IoStatus::errno(errno));
                        self.core
                            .complete(io.sink, io.token, IoStatus::errno(errno));
                        return;
                    }
                }
            }
        }
        let p = self.parents.borrow_mut().insert(Parent {
            io,
            start,
            pending: 1, // held until every piece is started
            status: IoStatus::OK,
            gate: counted(slot),
            copies: 0,
            blocks: need as u32,
            commit: io.flags.contains(IoFlags::FUA) && !self.data_caps.fua,
        });
        self.pieces(p, &io);
        self.piece_done(p, IoStatus::OK, false);
    }

    /// The common case, kept short: a read or a write inside one block that is mapped
    /// (a read) or owned by this volume alone (a write: no copy, no new mapping) goes
    /// down as it is, with no parent and no pieces; its completion only leaves the gate
    /// (which it stays in until then, as every request does: a freed block is not reused
    /// while a request that looked it up is in flight). Whether it was taken; `slot`
    /// is what `io` entered the gate under, left here if it failed.
    #[inline]
    fn start_lone(&self, io: &Io, start: u64, slot: usize) -> bool {
        let shift = self.shift();
        let vb = io.offset >> shift;
        if io.len == 0 || (io.end() - 1) >> shift != vb {
            return false;
        }
        let e = self.vol.table.get(vb);
        let fua = io.flags.contains(IoFlags::FUA);
        let write = match io.op {
            Op::Read if e != 0 => false,
            Op::Write if e & OWNED != 0 && (!fua || self.fua_down(vb)) => true,
            _ => return false,
        };
        if write {
            if self.vol.frozen.load(SeqCst) {
                // A snapshot is being taken: the slow path parks it.
                return false;
            }
            if !self.mark_changes(io, start, slot) {
                // Failed, and answered.
                return true;
            }
        }
        let index = self.lone.borrow_mut().insert(Lone {
            io: *io,
            start,
            parity: slot as u8,
        });
        let off = io.offset & ((1u64 << shift) - 1);
        self.data.submit(Io {
            flags: if write && fua {
                IoFlags::FUA
            } else {
                IoFlags::NONE
            },
            offset: self.phys(e) + off,
            sink: self.sink.get(),
            token: LONE | u64::from(index),
            ..*io
        });
        true
    }

    /// A lone request (see [`ThinQueue::start_lone`]) completed with `status`.
    #[inline]
    fn lone_done(&self, index: u32, status: IoStatus) {
        let l = self.lone.borrow_mut().remove(index);
        self.inner.leave(&self.gate, usize::from(l.parity));
        self.finish(&l.io, l.start, status);
        self.core.deliver(l.io.sink, l.io.token, status);
    }

    /// Marks write `io` in the volume's change log, if it keeps one; on failure the
    /// write fails (it leaves the gate, entered under `slot`) and this says false.
    #[inline]
    fn mark_changes(&self, io: &Io, start: u64, slot: usize) -> bool {
        // Inside the gate, before anything is written: the log holds a write before any
        // of its data can land.
        let Some(changes) = &self.changes else {
            return true;
        };
        let Err(e) = changes.mark(io.offset, io.len) else {
            return true;
        };
        self.inner.leave(&self.gate, slot);
        log::error!("cairn: {}: {e}: the write fails", self.vol.name);
        self.finish(io, start, IoStatus::errno(libc::EIO));
        self.core
            .complete(io.sink, io.token, IoStatus::errno(libc::EIO));
        false
    }

    /// How many pieces of write `io` may take a new block.
    fn needs_blocks(&self, io: &Io) -> usize {
        let shift = self.shift();
        let bs = 1u64 << shift;
        let mut n = 0;
        let mut at = io.offset;
        while at < io.end() {
            let vb = at >> shift;
            let next = ((vb + 1) << shift).min(io.end());
            let e = self.vol.table.get(vb);
            let whole = at & (bs - 1) == 0 && next - at == bs;
            let takes = match io.op {
                Op::Write => e & OWNED == 0,
                // Zeroing: a whole block is unmapped; part of a shared one is copied; a
                // hole is left alone unless NO_HOLE asks for storage.
                _ => {
                    let keep = io.op == Op::WriteZeroes && io.flags.contains(IoFlags::NO_HOLE);
                    (e != 0 && e & OWNED == 0 && (!whole || keep)) || (e == 0 && keep)
                }
            };
            n += usize::from(takes);
            at = next;
        }
        n
    }

    /// Cuts `io` (parent `p`) into pieces and starts them; consecutive pieces that go to
    /// consecutive places on the data device go as one request.
    fn pieces(&self, p: u32, io: &Io) {
        let shift = self.shift();
        let mut run: Option<(u64, u64, u64)> = None; // (phys, len, at)
        let mut at = io.offset;
        while at < io.end() {
            let vb = at >> shift;
            let next = ((vb + 1) << shift).min(io.end());
            let piece = Piece {
                parent: p,
                vb,
                off: at - (vb << shift),
                len: next - at,
                at: at - io.offset,
            };
            match self.place(piece, io) {
                Some(phys) => match &mut run {
                    Some((s, l, _)) if *s + *l == phys => *l += piece.len,
                    _ => {
                        if let Some(r) = run.take() {
                            self.send(p, io, r);
                        }
                        run = Some((phys, piece.len, piece.at));
                    }
                },
                None => {
                    if let Some(r) = run.take() {
                        self.send(p, io, r);
                    }
                }
            }
            at = next;
        }
        if let Some(r) = run {
            self.send(p, io, r);
        }
    }

    /// Sends `io`'s op for `(phys, len, at)` to the data device for parent `p`.
    fn send(&self, p: u32, io: &Io, (phys, len, at): (u64, u64, u64)) {
        let op = match io.op {
            Op::Discard if !self.data_caps.discard => Op::WriteZeroes,
            Op::WriteZeroes if !self.data_caps.write_zeroes => Op::Discard,
            op => op,
        };
        let buf = if op.has_data() {
            // SAFETY: `at + len` lies inside the parent's buffer of `io.len` bytes.
            unsafe { io.buf.add(at as usize) }
        } else {
            std::ptr::null_mut()
        };
        let mut flags = if io.flags.contains(IoFlags::NO_HOLE) {
            IoFlags::NO_HOLE
        } else {
            IoFlags::NONE
        };
        if io.flags.contains(IoFlags::FUA) && !self.parents.borrow().get(p).commit {
            // Durable in place, its mapping durable already: no commit to wait for.
            flags = flags.with(IoFlags::FUA);
        }
        self.child(
            Child::Plain { parent: p },
            Io {
                op,
                flags,
                offset: phys,
                len,
                buf,
                sink: self.sink.get(),
                token: 0,
            },
        );
    }

    /// Sends `io` down for `child`, counted in its parent.
    fn child(&self, child: Child, io: Io) {
        let parent = match child {
            Child::Plain { parent } => parent,
            Child::CowWhole { piece, .. }
            | Child::CowRead { piece, .. }
            | Child::CowWrite { piece, .. } => piece.parent,
        };
        self.parents.borrow_mut().get_mut(parent).pending += 1;
        let token = self.children.borrow_mut().insert(child);
        self.data.submit(Io {
            token: u64::from(token),
            ..io
        });
    }

    /// Decides one piece: returns where on the data device it goes as it is (to be
    /// merged with its neighbours), or `None` when it was handled here (a hole read, an
    /// unmap, a copy on write started, a failure).
    fn place(&self, piece: Piece, io: &Io) -> Option<u64> {
        let bs = 1u64 << self.shift();
        let whole = piece.off == 0 && piece.len == bs;
        loop {
            let e = self.vol.table.get(piece.vb);
            let placed = match io.op {
                Op::Read => return self.place_read(piece, io, e),
                Op::Write => self.place_write(piece, io, e, whole),
                _ => self.place_zeroes(piece, io, e, whole),
            };
            let fua = io.flags.contains(IoFlags::FUA);
            match placed {
                Placed::At(phys) => {
                    if fua && !(e & OWNED != 0 && self.fua_down(piece.vb)) {
                        self.needs_commit(piece.parent);
                    }
                    return Some(phys);
                }
                Placed::Done => {
                    if fua {
                        self.needs_commit(piece.parent);
                    }
                    return None;
                }
                Placed::Again => continue,
            }
        }
    }

    /// Whether a FUA write in place into owned block `vb`, whose entry was just read,
    /// is durable with FUA passed down: the data device has FUA, and the entry read is
    /// durable (no change to its leaf since a capture that a durable commit holds).
    #[inline]
    fn fua_down(&self, vb: u64) -> bool {
        self.data_caps.fua && self.vol.table.captured(vb) && self.inner.commit_seq.durable()
    }

    /// FUA write parent `p` completes only after the next commit.
    fn needs_commit(&self, p: u32) {
        self.parents.borrow_mut().get_mut(p).commit = true;
    }

    /// A read piece of entry `e`: a hole is zeros, filled here; a mapped block is read
    /// where it is.
    #[inline]
    fn place_read(&self, piece: Piece, io: &Io, e: u32) -> Option<u64> {
        if e == 0 {
            // SAFETY: the piece lies inside the parent's buffer.
            unsafe { std::ptr::write_bytes(io.buf.add(piece.at as usize), 0, piece.len as usize) };
            return None;
        }
        Some(self.phys(e) + piece.off)
    }

    /// A write piece of entry `e`: in place if the volume owns the block, into a new
    /// block mapped here if it is a hole, else copied on write.
    #[inline]
    fn place_write(&self, piece: Piece, io: &Io, e: u32, whole: bool) -> Placed {
        if e & OWNED != 0 {
            return Placed::At(self.phys(e) + piece.off);
        }
        let Some(new) = self.take_block(piece.parent) else {
            return Placed::Done;
        };
        if e == 0 {
            let t = &self.vol.table;
            if !t.has_leaf(piece.vb) {
                // Once per 1024 blocks of virtual space, on its first write.
                t.ensure_leaf(piece.vb);
            }
            let entry = (new + 1) | OWNED;
            return match t.change(piece.vb, 0, entry) {
                Ok(()) => Placed::At(self.phys(entry) + piece.off),
                Err(_) => {
                    // Mapped by another request meanwhile: look again.
                    self.push_block(piece.parent, new);
                    Placed::Again
                }
            };
        }
        self.cow(piece, io, e, new, whole);
        Placed::Done
    }

    /// A discard or write-zeroes piece of entry `e`: a hole stays one (unless NO_HOLE
    /// asks for storage), a whole block is unmapped, part of an owned block is passed
    /// down, part of a shared one is copied with zeros.
    #[inline]
    fn place_zeroes(&self, piece: Piece, io: &Io, e: u32, whole: bool) -> Placed {
        let keep = io.op == Op::WriteZeroes && io.flags.contains(IoFlags::NO_HOLE);
        if e == 0 {
            if !keep {
                return Placed::Done;
            }
            // Storage asked for: a new block is zeros already.
            let Some(new) = self.take_block(piece.parent) else {
                return Placed::Done;
            };
            self.vol.table.ensure_leaf(piece.vb);
            return self.swap_in(piece, 0, new);
        }
        if whole && !keep {
            return self.unmap(piece, e);
        }
        if e & OWNED != 0 {
            return Placed::At(self.phys(e) + piece.off);
        }
        let Some(new) = self.take_block(piece.parent) else {
            return Placed::Done;
        };
        if whole {
            // NO_HOLE over a shared block: a new block is zeros already.
            return self.swap_in(piece, e, new);
        }
        self.cow(piece, io, e, new, false);
        Placed::Done
    }

    /// Unmaps the piece's whole block, entry `e`: the block (or this volume's share of
    /// it) is freed at the next commit.
    fn unmap(&self, piece: Piece, e: u32) -> Placed {
        let t = &self.vol.table;
        if t.change(piece.vb, e, 0).is_err() {
            return Placed::Again;
        }
        if e & OWNED != 0 {
            self.inner.unmapped((e & !OWNED) - 1);
        }
        Placed::Done
    }

    /// Maps zeroed block `new` in place of entry `old` for the whole piece; if another
    /// request changed the entry meanwhile, `new` goes back and the piece runs again.
    fn swap_in(&self, piece: Piece, old: u32, new: u32) -> Placed {
        let t = &self.vol.table;
        if t.change(piece.vb, old, (new + 1) | OWNED).is_err() {
            self.push_block(piece.parent, new);
            return Placed::Again;
        }
        Placed::Done
    }

    /// A block for a piece of parent `p`, or `None` with the parent failed with ENOSPC.
    #[inline]
    fn take_block(&self, p: u32) -> Option<u32> {
        let new = self.pop_block(p);
        if new.is_none() {
            self.fail_piece(p, libc::ENOSPC);
        }
        new
    }

    fn fail_piece(&self, parent: u32, errno: i32) {
        let mut parents = self.parents.borrow_mut();
        let p = parents.get_mut(parent);
        if p.status.is_ok() {
            p.status = IoStatus::errno(errno);
        }
    }

    /// Copies shared entry `old` into block `new` with the piece's data (or zeros) over
    /// it, then swaps the entry.
    fn cow(&self, piece: Piece, io: &Io, old: u32, new: u32, whole: bool) {
        let to = self.phys((new + 1) | OWNED);
        self.copy_begins(piece.parent);
        if whole {
            // SAFETY: the piece lies inside the parent's buffer.
            let buf = unsafe { io.buf.add(piece.at as usize) };
            self.child(
                Child::CowWhole { piece, old, new },
                Io {
                    op: Op::Write,
                    flags: IoFlags::NONE,
                    offset: to,
                    len: piece.len,
                    buf,
                    sink: self.sink.get(),
                    token: 0,
                },
            );
            return;
        }
        let Some((index, ptr)) = self.take_buf() else {
            // Held by the parent until a buffer comes back (the copy counted above).
            self.parents.borrow_mut().get_mut(piece.parent).pending += 1;
            self.push_block(piece.parent, new);
            self.waiting_buf.borrow_mut().push_back(piece);
            return;
        };
        self.child(
            Child::CowRead {
                piece,
                old,
                new,
                buf: index,
            },
            Io {
                op: Op::Read,
                flags: IoFlags::NONE,
                offset: self.phys(old),
                len: 1 << self.shift(),
                buf: ptr,
                sink: self.sink.get(),
                token: 0,
            },
        );
    }

    /// A copy-on-write buffer: its index and where it is.
    fn take_buf(&self) -> Option<(u32, *mut u8)> {
        let mut bufs = self.bufs.borrow_mut();
        if let Some(i) = self.free_bufs.borrow_mut().pop() {
            return Some((i, bufs[i as usize].as_mut_ptr()));
        }
        if bufs.len() >= COW_BUFFERS {
            return None;
        }
        // Made once, on the queue's first partial copy on write.
        bufs.push(AlignedBuf::new(1 << self.shift()));
        let i = bufs.len() - 1;
        Some((i as u32, bufs[i].as_mut_ptr()))
    }

    /// Buffer `i` is free again: pieces waiting for one run now, as long as one is free
    /// (a piece that finds its block copied meanwhile writes in place and leaves the
    /// buffer for the next).
    fn put_buf(&self, i: u32) {
        self.free_bufs.borrow_mut().push(i);
        while !self.free_bufs.borrow().is_empty() {
            let Some(piece) = self.waiting_buf.borrow_mut().pop_front() else {
                break;
            };
            self.rerun_waiting(piece);
        }
    }

    /// A piece that waited for a buffer runs again (it may write in place now), unless
    /// a snapshot holds writes: then it runs once they go on.
    fn rerun_waiting(&self, piece: Piece) {
        if !self.changing(piece.parent) {
            self.hold(Held::Rerun(piece));
            return;
        }
        self.rerun(piece);
        // The hold (and copy) counted when it began to wait.
        self.copy_done(piece.parent, IoStatus::OK);
    }

    /// A copy on write's block `new` is written: its entry swaps from `old` to it,
    /// unless a snapshot holds writes: then it swaps once they go on.
    fn swap_when_free(&self, piece: Piece, old: u32, new: u32) {
        if !self.changing(piece.parent) {
            self.hold(Held::Swap { piece, old, new });
            return;
        }
        self.cow_swap(piece, old, new);
        self.copy_done(piece.parent, IoStatus::OK);
    }

    /// Whether parent `p` may change the volume's table or write in place now: it is
    /// counted in its changing slot already (a snapshot waits for it), or enters it and
    /// finds no snapshot holding writes (then it stays until only copies are left: see
    /// [`ThinQueue::piece_done`]). Else it may not until writes go on.
    fn changing(&self, p: u32) -> bool {
        let mut parents = self.parents.borrow_mut();
        let par = parents.get_mut(p);
        if par.gate & CHANGING != 0 {
            return true;
        }
        debug_assert!(par.gate & READING != 0, "a parent outside the gate changes");
        // Its own parity: the parent is counted in the other slot of it, so no grace
        // period can end and begin the next epoch while it is in flight.
        let slot = Gate::slot(true, usize::from(par.gate & PARITY));
        self.gate.n[slot].fetch_add(1, SeqCst);
        // Entered, then looked: a snapshot that set frozen after this saw the count.
        if self.vol.frozen.load(SeqCst) {
            self.inner.leave(&self.gate, slot);
            return false;
        }
        par.gate |= CHANGING;
        true
    }

    /// Waits with `h` until writes go on (the retry timer looks again).
    fn hold(&self, h: Held) {
        self.held.borrow_mut().push(h);
        self.arm_timer();
    }

    /// A copy on write of parent `p` begins (it ends with [`ThinQueue::copy_done`]).
    fn copy_begins(&self, p: u32) {
        let mut parents = self.parents.borrow_mut();
        let par = parents.get_mut(p);
        // Saturated: no longer counted, and never taken for copies only.
        par.copies = par.copies.saturating_add(1);
    }

    /// A copy on write of parent `p` ended with `status` (its piece is done).
    fn copy_done(&self, p: u32, status: IoStatus) {
        {
            let mut parents = self.parents.borrow_mut();
            let par = parents.get_mut(p);
            debug_assert!(par.copies > 0, "a copy ended that never began");
            if par.copies != u16::MAX {
                par.copies -= 1;
            }
        }
        self.piece_done(p, status, true);
    }

    /// Runs a piece again (its entry changed under it, or it waited for a buffer).
    fn rerun(&self, piece: Piece) {
        let io = self.parents.borrow().get(piece.parent).io;
        if let Some(phys) = self.place(piece, &io) {
            self.send(piece.parent, &io, (phys, piece.len, piece.at));
        }
    }

    /// A piece of parent `p` ended with `status`; the parent completes after its last:
    /// at once when `completing` (in a completion's callback), else through the
    /// reactor's FIFO (never inside `submit`).
    fn piece_done(&self, p: u32, status: IoStatus, completing: bool) {
        let mut parents = self.parents.borrow_mut();
        let par = parents.get_mut(p);
        if !status.is_ok() && par.status.is_ok() {
            par.status = status;
        }
        par.pending -= 1;
        if par.pending > 0 {
            if par.copies != 0 && par.pending == u32::from(par.copies) && par.gate & CHANGING != 0 {
                self.copies_only(par);
            }
            return;
        }
        let par = parents.remove(p);
        drop(parents);
        // Promises its pieces did not need (they found the block owned when they ran).
        self.reserved.set(self.reserved.get() - par.blocks as usize);
        self.leave_gate(par.gate);
        if par.status.is_ok() && par.commit {
            // Durable with its mapping at the next commit.
            self.wait_commit(par.io, par.start);
            return;
        }
        self.finish(&par.io, par.start, par.status);
        if completing {
            self.core.deliver(par.io.sink, par.io.token, par.status);
        } else {
            self.core.complete(par.io.sink, par.io.token, par.status);
        }
    }

    /// Parent `par` has only copies on write in flight: it leaves its changing slot (a
    /// snapshot need not wait for it), counted in the other slot of its parity before.
    fn copies_only(&self, par: &mut Parent) {
        if par.copies == u16::MAX {
            // Too many to count: it stays until its end.
            return;
        }
        let parity = usize::from(par.gate & PARITY);
        if par.gate & READING == 0 {
            // Same parity, counted before it leaves the other: a grace period looks at
            // the changing slot first (see `Inner::grace`).
            self.gate.n[Gate::slot(false, parity)].fetch_add(1, SeqCst);
            par.gate |= READING;
        }
        self.inner.leave(&self.gate, Gate::slot(true, parity));
        par.gate &= !CHANGING;
    }

    /// A parent counted as `gate` ended: it leaves every slot it is counted in.
    fn leave_gate(&self, gate: u8) {
        let parity = usize::from(gate & PARITY);
        if gate & CHANGING != 0 {
            self.inner.leave(&self.gate, Gate::slot(true, parity));
        }
        if gate & READING != 0 {
            self.inner.leave(&self.gate, Gate::slot(false, parity));
        }
    }

    /// `io` completes once the pool's next commit is durable.
    fn wait_commit(&self, io: Io, start: u64) {
        let index = self.parents.borrow_mut().insert(Parent {
            io,
            start,
            pending: 0,
            status: IoStatus::OK,
            gate: 0,
            copies: 0,
            blocks: 0,
            commit: false,
        });
        self.waits.set(self.waits.get() + 1);
        self.inner.wait_commit(Waiter {
            token: u64::from(index),
            reply: self.reply_tx.clone(),
            wake: self.wake.clone(),
        });
    }

    /// The retry timer: what copies on write held runs, parked requests start again
    /// (both may wait again).
    fn retry(&self) {
        self.timer.set(false);
        let held = std::mem::take(&mut *self.held.borrow_mut());
        for h in held {
            match h {
                Held::Swap { piece, old, new } => self.swap_when_free(piece, old, new),
                Held::Rerun(piece) => self.rerun_waiting(piece),
            }
        }
        let parked = std::mem::take(&mut *self.parked.borrow_mut());
        for (io, start) in parked {
            if io.op.is_write() && self.vol.frozen.load(SeqCst) {
                // Still held: not even counted in the gate for a moment, which a
                // snapshot waiting for the gate would have to see go.
                self.park(io, start);
                continue;
            }
            self.start(io, start);
        }
    }

    /// A copy on write's swap of `old` for `new` (written) in the piece's entry.
    fn cow_swap(&self, piece: Piece, old: u32, new: u32) {
        let t = &self.vol.table;
        if t.change(piece.vb, old, (new + 1) | OWNED).is_ok() {
            return;
        }
        // Changed meanwhile (another copy won, or an unmap): the written block is not
        // used, and the piece runs again on what is there now.
        self.inner.give_back_dirty(new);
        self.rerun(piece);
    }
}

impl Queue for ThinQueue {
    fn submit(&self, io: Io) {
        let start = self.stats.begin(io.flags, || self.core.now_ns());
        self.start(io, start);
    }

    fn stats(&self) -> &QueueStats {
        &self.stats
    }

    fn children(&self) -> Vec<Rc<dyn Queue>> {
        vec![self.data.clone()]
    }
}

impl Sink for ThinQueue {
    fn io_done(&self, token: u64, status: IoStatus) {
        if token == RETRY {
            self.retry();
            return;
        }
        if token & LONE != 0 {
            self.lone_done(token as u32, status);
            return;
        }
        let child = self.children.borrow_mut().remove(token as u32);
        match child {
            Child::Plain { parent } => self.piece_done(parent, status, true),
            Child::CowWhole { piece, old, new } => {
                if status.is_ok() {
                    self.swap_when_free(piece, old, new);
                } else {
                    self.inner.give_back_dirty(new);
                    self.copy_done(piece.parent, status);
                }
            }
            Child::CowRead {
                piece,
                old,
                new,
                buf,
            } => {
                if !status.is_ok() {
                    self.stash.borrow_mut().push(new);
                    self.put_buf(buf);
                    self.copy_done(piece.parent, status);
                    return;
                }
                let io = self.parents.borrow().get(piece.parent).io;
                let dst = self.bufs.borrow_mut()[buf as usize].as_mut_ptr();
                // SAFETY: the buffer holds a block; the piece lies inside it at `off`,
                // and inside the parent's buffer at `at`.
                unsafe {
                    let to = dst.add(piece.off as usize);
                    if io.op == Op::Write {
                        std::ptr::copy_nonoverlapping(
                            io.buf.add(piece.at as usize),
                            to,
                            piece.len as usize,
                        );
                    } else {
                        std::ptr::write_bytes(to, 0, piece.len as usize);
                    }
                }
                // The same copy goes on: counted once, from the read to the swap.
                self.child(
                    Child::CowWrite {
                        piece,
                        old,
                        new,
                        buf,
                    },
                    Io {
                        op: Op::Write,
                        flags: IoFlags::NONE,
                        offset: self.phys((new + 1) | OWNED),
                        len: 1 << self.shift(),
                        buf: dst,
                        sink: self.sink.get(),
                        token: 0,
                    },
                );
                self.piece_done(piece.parent, IoStatus::OK, true);
            }
            Child::CowWrite {
                piece,
                old,
                new,
                buf,
            } => {
                // Swapped before the buffer goes to a piece waiting for one: a piece of
                // the same block then finds it owned and writes in place.
                if status.is_ok() {
                    self.swap_when_free(piece, old, new);
                    self.put_buf(buf);
                } else {
                    self.inner.give_back_dirty(new);
                    self.put_buf(buf);
                    self.copy_done(piece.parent, status);
                }
            }
        }
    }
}

impl Poller for ThinQueue {
    fn unplug(&self) {}

    fn reap(&self) -> usize {
        let mut n = 0;
        while let Ok((token, status)) = self.reply_rx.try_recv() {
            let par = self.parents.borrow_mut().remove(token as u32);
            self.waits.set(self.waits.get() - 1);
            self.finish(&par.io, par.start, status);
            self.core.complete(par.io.sink, par.io.token, status);
            n += 1;
        }
        n
    }

    fn busy(&self) -> bool {
        self.waits.get() > 0
    }

    fn event_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }

    fn clear_event(&self) {
        cairn_core::event::reset(&self.wake);
    }
}
