//! [`StackQueue`], a stacked device's queue on one reactor: its per-request state
//! (parents, their pieces on members, lone requests, reads sent whole to one copy), the
//! token bits that tell completions apart, the `Queue` impl with the common cases of
//! `submit` (a request only remapped to one member; a read of a redundant layout sent
//! whole to one copy), and how the queue follows a change of members (its members'
//! queues, and the gate a switch waits on).
//!
//! The rest of the submit side is in `submit`, the completion side in `complete`.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::Arc;

use cairn_core::slab::Slab;
use cairn_core::{
    Core, Device, Error, FlushBatcher, Io, IoFlags, IoStatus, Op, Queue, QueueStats, SinkId,
};

use super::health::{Gate, Health};
use super::{AnyLayout, Layout};

/// Parent requests a queue keeps state for before its slab grows.
pub(super) const PARENTS: usize = 256;

/// One cache line each: the line written at submit is usually evicted by the time the
/// request completes (every read's data passes through the cache meanwhile), so a parent
/// straddling two lines would cost two misses instead of one.
#[derive(Clone, Copy)]
#[repr(align(64))]
pub(super) struct Parent {
    pub(super) io: Io,
    pub(super) pending: u32,
    pub(super) status: IoStatus,
    pub(super) start_ns: u64,
    pub(super) degraded: bool,
    /// Copies tried so far by a request sent whole to one member (bit per copy).
    pub(super) tried: u32,
    /// Counted as a write in flight for a rebuild (its completion is counted too).
    pub(super) counted: bool,
    /// Counted as a write in flight by the bitmap (its completion is counted too).
    pub(super) marked: bool,
    /// Counted in the gate: 0 not, else 1 + the epoch's parity.
    pub(super) gate: u8,
}

#[derive(Clone, Copy)]
pub(super) struct Child {
    pub(super) parent: u32,
    pub(super) op: Op,
    pub(super) flags: IoFlags,
    /// Logical offset of the piece (reads retry another copy of it).
    pub(super) logical: u64,
    pub(super) len: u64,
    pub(super) buf: *mut u8,
    pub(super) member: u16,
    /// Copies tried so far (bit per copy), for read retries.
    pub(super) tried: u32,
}

pub(super) struct State {
    pub(super) parents: Slab<Parent>,
    pub(super) children: Slab<Child>,
    /// Requests of a layout without copies sent whole to one member: only what their
    /// completion needs (a third of a `Parent`).
    pub(super) lone: Slab<Lone>,
    /// Reads of a redundant layout sent whole to a copy that could be read as it is.
    pub(super) reads: Slab<Read>,
}

/// A read of a redundant layout sent whole to one copy by the common case of `submit`:
/// the request (to try another copy with, should this one fail) and what its completion
/// needs. One that fails becomes a [`Parent`] (see `complete`), so retries and read
/// repair take the same path as for any read.
#[derive(Clone, Copy)]
pub(super) struct Read {
    pub(super) io: Io,
    pub(super) start_ns: u64,
    /// The copy it was sent to.
    pub(super) copy: u8,
    /// Covered by the queue's count of reads in the gate (see
    /// [`StackQueue::enter_gate_read`]): 0 not, else 1 + the epoch's parity.
    pub(super) gate: u8,
}

/// A request of a layout without copies, sent whole to one member.
#[derive(Clone, Copy)]
pub(super) struct Lone {
    pub(super) sink: SinkId,
    pub(super) op: Op,
    pub(super) len: u64,
    pub(super) token: u64,
    pub(super) start_ns: u64,
}

/// A member device and its queue on one reactor.
type Opened = (Arc<dyn Device>, Rc<dyn Queue>);

/// A stacked device's queue on one reactor.
pub struct StackQueue {
    pub(super) core: Rc<Core>,
    /// The members' queues as plain pointers (`0..n` the layout's members, `n + m` the
    /// replacement of `m`), so that a submit needs no look-up of where the value sits
    /// inside its `Rc`. `opened` keeps them alive; changed only by
    /// [`StackQueue::refresh`], never while a pointer from it is in use.
    pub(super) targets: std::cell::UnsafeCell<Vec<*const dyn Queue>>,
    pub(super) stats: QueueStats,
    pub(super) layout: Arc<AnyLayout>,
    /// The layout's members.
    pub(super) n: usize,
    /// Each member device and its queue here, as of `epoch`.
    pub(super) opened: RefCell<Vec<Option<Opened>>>,
    /// Queues of members no longer in use, kept until no request of this queue is in
    /// flight (one may still be in flight on them).
    pub(super) retired: RefCell<Vec<Rc<dyn Queue>>>,
    /// What `targets` without a queue point at (never sent anything), kept alive here.
    pub(super) fallback: RefCell<Option<Rc<dyn Queue>>>,
    /// Per member: a replacement is being built (every write to it goes there too).
    pub(super) shadows: RefCell<Vec<bool>>,
    /// Some member has a replacement.
    pub(super) replacing: Cell<bool>,
    /// Requests are counted in `gate` (the array's members can change).
    pub(super) gated: bool,
    /// Changes of data are counted in `gate` (a redundant layout: read repair waits for
    /// those sent before it counts them per region).
    pub(super) gate_writes: bool,
    /// The health's epoch `opened` follows.
    pub(super) epoch: Cell<u64>,
    /// Of a gated array: the count in the gate that covers the reads sent by
    /// `submit_read` under the epoch now (0 none, else 1 + the epoch's parity), see
    /// [`StackQueue::enter_gate_read`].
    pub(super) read_gate: Cell<u8>,
    /// The epoch `read_gate` was entered under.
    pub(super) read_epoch: Cell<u64>,
    /// Reads sent by `submit_read` in flight, by the parity of the epoch whose count in
    /// the gate covers them.
    pub(super) reads_held: [Cell<u32>; 2],
    /// Changes of data in flight, for a change of members to wait for.
    pub(super) gate: Arc<Gate>,
    pub(super) health: Arc<Health>,
    pub(super) sink: Cell<SinkId>,
    pub(super) state: RefCell<State>,
    /// The copy the next read starts from (below `copies`), see
    /// [`StackQueue::next_copy`].
    pub(super) next_copy: Cell<usize>,
    pub(super) flushes: FlushBatcher,
    /// The layout's copies, kept here to spare the hot path a pointer chase.
    pub(super) copies: usize,
    /// Of a layout without copies: a request that fits one member is only remapped, with
    /// these flags added (none without statistics; DELEGATED when every member counts
    /// for this device); `None`: this device takes each completion itself.
    pub(super) remap: Cell<Option<IoFlags>>,
    /// Where data starts on every member.
    pub(super) data_offset: u64,
    /// The array's superblocks, if it keeps them.
    pub(super) metadata: Option<Arc<crate::array::Metadata>>,
    /// The write-intent bitmap, if the array keeps one.
    pub(super) bitmap: Option<Arc<crate::array::bitmap::Bitmap>>,
}

/// Token of the batched flush fanning out to the members (never a child index).
pub(super) const FLUSH_BATCH: u64 = u64::MAX;
/// Token bit of a request sent whole to one member: the rest is the parent's index.
pub(super) const DIRECT: u64 = 1 << 62;
/// Token bit of a request of a layout without copies sent whole to one member: the rest
/// is its index in `lone` (`FLUSH_BATCH` has both bits).
pub(super) const LONE: u64 = 1 << 61;
/// Token bit of a read sent whole to one copy by the common case of `submit`: the rest
/// is its index in `reads` (`FLUSH_BATCH` has `LONE` too, which no such read has).
pub(super) const READ: u64 = 1 << 59;
/// Token bit of the timer of a write waiting for a read repair's range (see
/// [`StackQueue::park`]): the rest is the parent's index.
pub(super) const PARKED: u64 = 1 << 60;
/// Where a request sent whole to one copy carries the copy in its token (below: the
/// parent's index), so that its completion knows which copy answered.
pub(super) const COPY_SHIFT: u32 = 32;
/// How long a write waits before it looks again whether a repair still holds its range
/// (a repair holds it for one read and one write of the range).
pub(super) const PARK_NS: u64 = 100_000;

impl StackQueue {
    /// The queue of member `m`.
    #[inline]
    pub(super) fn member(&self, m: usize) -> &dyn Queue {
        // SAFETY: `targets` points into `opened`, which this queue owns; `refresh`, the
        // only change to either, never runs while a reference from here is held (it runs
        // at the start of a submit, and no submit runs inside another).
        unsafe { &*(&*self.targets.get())[m] }
    }

    /// Follows the health's member devices as of `epoch`: opens queues for new member
    /// devices, retires those no longer used. A member whose queue cannot be opened is
    /// failed (at open time: an error).
    #[cold]
    pub(super) fn refresh(&self, epoch: u64, first: bool) -> Result<(), Error> {
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
            self.open_new_member(i, d, first, &mut next)?;
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

    /// Opens a queue here for member device `d` (index `i`), new to this queue, and
    /// appends it to `next`; a member whose queue cannot be opened is failed (at open
    /// time, `first`: an error).
    #[cold]
    fn open_new_member(
        &self,
        i: usize,
        d: &Arc<dyn Device>,
        first: bool,
        next: &mut Vec<Option<Opened>>,
    ) -> Result<(), Error> {
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
        Ok(())
    }

    /// Counts a change of data in the gate under the epoch now (following it first if it
    /// moved): 1 + the epoch's parity.
    #[inline]
    pub(super) fn enter_gate(&self) -> u8 {
        self.enter_gate_at().0
    }

    /// [`StackQueue::enter_gate`], and the epoch counted under.
    #[inline]
    fn enter_gate_at(&self) -> (u8, u64) {
        if !self.retired.borrow().is_empty() {
            self.drop_retired();
        }
        loop {
            let epoch = self.health.epoch.load(SeqCst);
            if epoch != self.epoch.get() {
                let _ = self.refresh(epoch, false);
            }
            let parity = (epoch & 1) as usize;
            self.gate.writes[parity].fetch_add(1, SeqCst);
            if self.health.epoch.load(SeqCst) == epoch {
                return (1 + parity as u8, epoch);
            }
            // Changed meanwhile: count under the new one.
            self.gate.writes[parity].fetch_sub(1, SeqCst);
        }
    }

    /// Counts a read sent by `submit_read` in the gate (of a gated array): 1 + the
    /// parity of the epoch it is counted under.
    ///
    /// One count in the gate covers every such read this queue has in flight under one
    /// epoch: it is entered as [`StackQueue::enter_gate`] does for the first, and left
    /// when the last ends (see [`StackQueue::leave_gate_read`]). A read joins it only
    /// while the epoch is still the one it was entered under; the epoch looked at
    /// without ordering may be out of date, but then a switch that moved it on waits
    /// for this count (entered before, in the one total order), so the read is covered
    /// either way. A switch returns once every count of the old epoch's parity is
    /// left: no read sent to the old members is in flight then, as with one count per
    /// request, but the common case costs no atomic read-modify-write.
    #[inline(always)]
    pub(super) fn enter_gate_read(&self) -> u8 {
        let gate = self.read_gate.get();
        if gate != 0 && self.health.epoch.load(Relaxed) == self.read_epoch.get() {
            let held = &self.reads_held[usize::from(gate - 1)];
            held.set(held.get() + 1);
            return gate;
        }
        self.enter_gate_read_new()
    }

    /// A read under an epoch no count of `read_gate` covers: counted under the epoch
    /// now (following it first if it moved).
    #[cold]
    #[inline(never)]
    fn enter_gate_read_new(&self) -> u8 {
        let (gate, epoch) = self.enter_gate_at();
        let i = usize::from(gate - 1);
        let held = self.reads_held[i].get();
        if held != 0 {
            // Not expected: reads under this parity still in flight are of an epoch two
            // switches back, and a switch waits for them. Should it happen, they are
            // covered already and one count is enough.
            debug_assert!(false, "reads held under epoch parity {i} at epoch {epoch}");
            self.gate.writes[i].fetch_sub(1, SeqCst);
        }
        self.reads_held[i].set(held + 1);
        self.read_gate.set(gate);
        self.read_epoch.set(epoch);
        gate
    }

    /// Counts the end of a read [`StackQueue::enter_gate_read`] counted as `gate`: the
    /// last one of its epoch leaves the gate.
    #[inline(always)]
    pub(super) fn leave_gate_read(&self, gate: u8) {
        if gate == 0 {
            return;
        }
        let i = usize::from(gate - 1);
        let held = self.reads_held[i].get();
        debug_assert!(held > 0, "a read left a gate it was not counted in");
        self.reads_held[i].set(held - 1);
        if held == 1 {
            self.gate.writes[i].fetch_sub(1, SeqCst);
            if self.read_gate.get() == gate {
                self.read_gate.set(0);
            }
        }
    }

    /// Lets go of the queues of members no longer used once nothing is in flight on
    /// them (no request of this queue is: the one about to be counted is not sent yet).
    #[cold]
    fn drop_retired(&self) {
        let idle = {
            let st = self.state.borrow();
            st.parents.is_empty() && st.reads.is_empty()
        };
        if idle {
            self.retired.borrow_mut().clear();
        }
    }

    /// Counts the end of a request in the gate, if it was counted there (`gate`, as
    /// [`StackQueue::enter_gate`] returned it).
    #[inline]
    pub(super) fn leave_gate(&self, gate: u8) {
        if gate != 0 {
            self.gate.writes[usize::from(gate - 1)].fetch_sub(1, SeqCst);
        }
    }

    /// The copy the next read starts from: the copies in turn.
    #[inline(always)]
    pub(super) fn next_copy(&self) -> usize {
        let copy = self.next_copy.get();
        self.advance_copy(copy);
        copy
    }

    /// The next read starts from the copy after `copy`.
    #[inline(always)]
    pub(super) fn advance_copy(&self, copy: usize) {
        debug_assert!(copy < self.copies);
        self.next_copy
            .set(if copy + 1 == self.copies { 0 } else { copy + 1 });
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
        // The other common case: a read of a redundant layout goes to one copy, with a
        // small record of its own while that copy may be read as it is.
        if self.copies > 1 && io.op == Op::Read {
            self.submit_read(io);
            return;
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
