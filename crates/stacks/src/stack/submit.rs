//! The submit side of [`StackQueue`] past its common case of a remap: a read of a
//! redundant layout goes whole to the next copy in turn while that copy may be read as
//! it is; otherwise a request is split into pieces at chunk and member boundaries, a
//! read goes to one healthy copy, a change of data to every copy (and to a replacement
//! being built); flushes are batched and fanned out to every member. A change of data
//! waits for its bitmap bits to be on disk, and for a read repair that holds its range.

use std::sync::atomic::Ordering::SeqCst;

use cairn_core::{Io, IoFlags, IoStatus, Op};

use super::queue::{
    Child, Lone, Parent, Read, COPY_SHIFT, DIRECT, FLUSH_BATCH, LONE, PARKED, PARK_NS, READ,
};
use super::{Layout, StackQueue};

impl StackQueue {
    /// Everything `submit` does not remap.
    #[inline(never)]
    pub(super) fn submit_rest(&self, io: Io) {
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

    /// A read of a redundant layout (the common case of `submit` for one): sent whole to
    /// the next copy in turn with a small record of its own, if it lands on one member
    /// and that copy may be read as it is (the array not resyncing after an unclean
    /// stop, the member current: neither failed, nor being rebuilt or re-added). Else
    /// it takes the general path, which picks a copy that may be read there.
    #[inline(always)]
    pub(super) fn submit_read(&self, io: Io) {
        debug_assert!(self.copies > 1 && io.op == Op::Read);
        let start_ns = self.start();
        // While a rebuild runs it yields to clients: it counts their requests.
        self.health.sync.client(&io);
        // Counted first, so that the member looked at below is the one of the epoch
        // the read is counted under (see `submit_other`).
        let gate = if self.gated {
            self.enter_gate_read()
        } else {
            0
        };
        let copy = self.next_copy.get();
        if let Some((member, member_offset)) = self.layout.place(io.offset, io.len, copy) {
            if self.health.may_read(member) {
                self.advance_copy(copy);
                let index = self.state.borrow_mut().reads.insert(Read {
                    io,
                    start_ns,
                    copy: copy as u8,
                    gate,
                });
                self.member(member).submit(Io {
                    offset: member_offset + self.data_offset,
                    sink: self.sink.get(),
                    token: READ | u64::from(index),
                    ..io
                });
                return;
            }
        }
        self.submit_read_rest(io, start_ns, gate);
    }

    /// A read `submit_read` could not send as it is (counted as `gate`): counted as a
    /// request of its own instead, as the general path counts, and sent by it.
    #[cold]
    #[inline(never)]
    fn submit_read_rest(&self, io: Io, start_ns: u64, gate: u8) {
        self.submit_counted(io, start_ns, self.regate(gate));
    }

    /// A read counted by [`StackQueue::enter_gate_read`] as `gate`, counted as one
    /// request instead (as `leave_gate` expects): 1 more in the gate, under the same
    /// epoch (the read's count keeps it above 0 meanwhile, so no switch has ended).
    #[cold]
    #[inline(never)]
    pub(super) fn regate(&self, gate: u8) -> u8 {
        if gate != 0 {
            self.gate.writes[usize::from(gate - 1)].fetch_add(1, SeqCst);
            self.leave_gate_read(gate);
        }
        gate
    }

    /// Everything but the common cases of `submit`: flushes, changes of data, requests
    /// split into pieces.
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
        // A request to an array whose members can change is counted in the gate, under
        // the epoch whose members it is sent to: a change of members waits until none
        // sent under the old epoch is in flight. Other redundant arrays count changes of
        // data there (for read repair). Only a gated array follows a change of members
        // (in `enter_gate`, which also lets go of the queues of members it no longer
        // uses once nothing is in flight).
        let gate = if self.gated || (self.gate_writes && io.op != Op::Read) {
            self.enter_gate()
        } else {
            0
        };
        self.submit_counted(io, start_ns, gate);
    }

    /// A request (not a flush) counted in the gate as `gate` says, sent to its members:
    /// a read of a redundant layout that lands whole on one member goes to one copy
    /// that may be read there; the rest is split into pieces. (Inlined into both
    /// callers: a change of data pays no call more than before there was a common case
    /// of reads.)
    #[inline(always)]
    fn submit_counted(&self, io: Io, start_ns: u64, gate: u8) {
        let copies = self.copies;
        if copies > 1 && io.op == Op::Read && self.layout.piece_len(io.offset, io.len) == io.len {
            let start = self.next_copy();
            if let Some(copy) = self.healthy_copy(io.offset, io.len, start, 0) {
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
    pub(super) fn send_direct(&self, parent: u32, io: &Io, copy: usize, at: (usize, u64)) {
        let (member, member_offset) = at;
        self.member(member).submit(Io {
            offset: member_offset + self.data_offset,
            sink: self.sink.get(),
            token: DIRECT | ((copy as u64) << COPY_SHIFT) | u64::from(parent),
            ..*io
        });
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
                        let start = if copies > 1 { self.next_copy() } else { 0 };
                        match self.healthy_copy(at, len, start, 0) {
                            Some(k) => self.child(parent, op, &io, (at, len, buf), k),
                            None => missing = true,
                        }
                    } else {
                        missing |= !self.send_to_copies(parent, op, io, (at, len, buf));
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
            self.leave_gate(p.gate);
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

    /// Sends a piece of a change of data of `parent` to every healthy copy, and to the
    /// replacement being built of each copy's member; whether a copy took it.
    #[inline(always)]
    fn send_to_copies(&self, parent: u32, op: Op, io: Io, piece: (u64, u64, *mut u8)) -> bool {
        let (at, len, buf) = piece;
        let copies = self.copies;
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
        any
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
    pub(super) fn healthy_copy(
        &self,
        logical: u64,
        len: u64,
        start: usize,
        tried: u32,
    ) -> Option<usize> {
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
    pub(super) fn unpark(&self, parent: u32) {
        let io = self.state.borrow().parents.get(parent).io;
        if self.health.sync.held(&io) {
            self.park(parent);
        } else {
            self.send(parent, &io, false);
        }
    }

    /// Fans one flush out to every healthy member, on behalf of the batch.
    pub(super) fn start_flush(&self) {
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
            self.leave_gate(p.gate);
            self.core
                .complete(self.sink.get(), FLUSH_BATCH, IoStatus::errno(libc::EIO));
        }
    }
}
