//! The completion side of [`StackQueue`]: a member's reply to a piece. A failed read is
//! retried on another copy (and the copy that failed is queued for read repair); a failed
//! change of data fails its member, and the array runs degraded; a request completes once
//! every piece has, and fails only if some of its data has no healthy copy left.

use cairn_core::{Io, IoFlags, IoStatus, Op, Sink};

use super::queue::{Parent, COPY_SHIFT, DIRECT, FLUSH_BATCH, LONE, PARKED, READ};
use super::{repair, Layout, StackQueue, COPIES_MAX};

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
        // A read of a redundant layout sent whole to one copy by `submit_read`.
        if token & (LONE | READ) == READ {
            self.read_done((token & !READ) as u32, status);
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
            self.leave_gate(p.gate);
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

impl StackQueue {
    /// The reply to a read sent by `submit_read` (`index` in `reads`).
    #[inline(always)]
    fn read_done(&self, index: u32, status: IoStatus) {
        if !status.is_ok() {
            self.read_failed(index, status);
            return;
        }
        let r = self.state.borrow_mut().reads.remove(index);
        self.leave_gate_read(r.gate);
        self.stats
            .finish(&r.io, r.start_ns, || self.core.now_ns(), true);
        self.core.deliver(r.io.sink, r.io.token, status);
    }

    /// A read sent by `submit_read` failed: it goes on as a parent request sent whole to
    /// that copy, so that another copy is tried and the one that failed is rewritten
    /// once one answers, exactly as for a read sent by the general path.
    #[cold]
    #[inline(never)]
    fn read_failed(&self, index: u32, status: IoStatus) {
        let r = self.state.borrow_mut().reads.remove(index);
        let gate = self.regate(r.gate);
        let parent = {
            let mut st = self.state.borrow_mut();
            st.parents.insert(Parent {
                io: r.io,
                pending: 1,
                status: IoStatus::OK,
                start_ns: r.start_ns,
                degraded: false,
                tried: 1 << r.copy,
                counted: false,
                marked: false,
                gate,
            })
        };
        self.direct_done(parent, status);
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
            self.direct_done((token & !DIRECT) as u32, status);
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

    /// The reply to a request sent whole to one copy that `io_done` did not finish (it
    /// failed, on a layout with copies): tries another copy, else completes it.
    fn direct_done(&self, index: u32, status: IoStatus) {
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
        self.leave_gate(p.gate);
        self.answer(&p, status);
    }

    fn finish_parent(&self, parent: u32) {
        let p = self.state.borrow_mut().parents.remove(parent);
        self.leave_gate(p.gate);
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

    /// Accounts a finished parent request and hands its completion to its submitter.
    #[inline(always)]
    fn answer(&self, p: &Parent, status: IoStatus) {
        self.stats
            .finish(&p.io, p.start_ns, || self.core.now_ns(), status.is_ok());
        self.core.deliver(p.io.sink, p.io.token, status);
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

    /// Whether some data has lost every copy (checked over one stripe of pieces).
    fn healthy_copy_sets_missing(&self) -> bool {
        let size = self.layout.size_bytes();
        let span = (self.n as u64 * (64 << 10)).min(size);
        let probe = Io::nodata(Op::Write, 0, span, self.sink.get(), 0);
        !self.all_pieces_covered(&probe)
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
}
