//! Requests not aligned to the export's blocks, from clients that did not ask for block
//! sizes: a read reads the whole blocks around it; a write or write-zeroes reads its edge
//! blocks, lays its bytes (or zeros) over them and writes the blocks back, in order with
//! other writes through the export's [gate](crate::server::gate); a trim trims the whole
//! blocks inside it.

use cairn_core::{Io, IoFlags, IoStatus, Op};

use crate::proto;
use crate::proto::command::Wide;
use crate::proto::{cflags, cmd, errno};
use crate::server::gate::Pass;
use crate::server::pool::Buf;

use super::{Conn, ConnState, Next, Req, ServerLoop, Slow, Stage};

impl ServerLoop {
    /// A request not aligned to the device's blocks, from a client that did not ask for
    /// block sizes (checked: `wide`, its blocks, are inside the export). A read reads the
    /// whole blocks around it; a write or write-zeroes is a read-modify-write of its edge
    /// blocks; a trim trims the whole blocks inside it (the spec lets a server ignore the
    /// rest).
    #[cold]
    #[inline(never)]
    pub(super) fn unaligned(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        r: &proto::Request,
        op: Op,
        w: Wide,
    ) -> Next {
        let block = w.block;
        let buf_len = match op {
            Op::Read => w.len,
            // The blocks, then room to read the edge blocks into.
            Op::Write => w.len + 2 * block,
            Op::WriteZeroes => 2 * block,
            _ => 0,
        } as usize;
        let mut buf = None;
        if buf_len > 0 {
            // Rare (clients that did not ask for block sizes): charged whole at once.
            match self.take_buffer(conn, st, buf_len, buf_len) {
                Ok(b) => buf = Some(b),
                Err(next) => return next,
            }
        }
        st.rs += conn.header_len();
        if st.counts.unaligned == 0 {
            log::info!(
                "cairn: serve: {}: the client sends requests not aligned to the export's {block}-byte blocks; serving them by read-modify-write",
                conn.peer
            );
        }
        st.counts.unaligned += 1;
        let (whole_off, whole_len) = w.whole();
        if op == Op::Discard && whole_len == 0 {
            // No whole block to trim: nothing to do.
            self.reply_ok(conn, st, r.command, (r.cookie, r.offset));
            return Next::Again;
        }
        let index = Self::alloc_req(st, unaligned_req(r, op, w, buf));
        let token = (u64::from(conn.index) << 32) | u64::from(index);
        match op {
            Op::Read => {
                let buf = st.reqs[index as usize]
                    .buf
                    .as_mut()
                    .map_or(std::ptr::null_mut(), |b| b.as_mut_ptr());
                st.in_flight += 1;
                Next::Submit(Io {
                    op,
                    flags: IoFlags::NONE,
                    offset: w.offset,
                    len: w.len,
                    buf,
                    sink: self.sink.get(),
                    token,
                })
            }
            Op::Discard => {
                st.in_flight += 1;
                let io = Io::nodata(Op::Discard, whole_off, whole_len, self.sink.get(), token);
                match self.pass_gate(conn, st, index, io) {
                    Some(io) => Next::Submit(io),
                    None => Next::Again,
                }
            }
            // Like an aligned write's payload, but into the middle of the blocks.
            Op::Write => self.take_write_payload(conn, st, index, w.head as usize),
            _ => {
                st.in_flight += 1;
                self.rmw_start(conn, st, index);
                Next::Again
            }
        }
    }

    /// Starts read-modify-write `req` (counted in flight once): takes a ticket for its
    /// blocks, and reads its edge blocks once the ticket is good.
    pub(super) fn rmw_start(&self, conn: &Conn, st: &mut ConnState, req: u32) {
        let r = &mut st.reqs[req as usize];
        if let (Some(gate), Some(w)) = (conn.gate.as_ref(), r.wide()) {
            r.pass = Pass::Ticket(gate.rmw(w.offset, w.offset + w.len));
        }
        self.rmw_try(conn, st, req);
    }

    /// Read-modify-write `req` (counted in flight once) starts if its ticket is good, or
    /// waits.
    pub(super) fn rmw_try(&self, conn: &Conn, st: &mut ConnState, req: u32) {
        let seen = self.gates.wake.generation();
        if let (Some(gate), Pass::Ticket(id)) = (conn.gate.as_ref(), st.reqs[req as usize].pass) {
            if !gate.ready(id) {
                st.reqs[req as usize].stage = Stage::Waiting;
                self.wait(conn.index, req, seen);
                return;
            }
        }
        st.in_flight -= 1;
        let r = &mut st.reqs[req as usize];
        let Some(w) = r.wide() else { return };
        let (edges, n) = w.edges();
        // A write's buffer holds its blocks, then the edge blocks read; a write-zeroes'
        // holds just the edge blocks.
        let scratch = if r.command == cmd::WRITE { w.len } else { 0 } as usize;
        let base = r
            .buf
            .as_mut()
            .map_or(std::ptr::null_mut(), |b| b.as_mut_ptr());
        r.stage = Stage::Edges;
        r.pending = n as u8;
        let token = (u64::from(conn.index) << 32) | u64::from(req);
        for (i, at) in edges[..n].iter().enumerate() {
            // SAFETY: the buffer holds `scratch` bytes and then two blocks.
            let buf = unsafe { base.add(scratch + i * w.block as usize) };
            let io = Io {
                op: Op::Read,
                flags: IoFlags::NONE,
                offset: w.offset + at,
                len: w.block,
                buf,
                sink: self.sink.get(),
                token,
            };
            self.submits.borrow_mut().push((conn.index, io));
        }
        st.in_flight += n as u32;
        if n == 0 {
            self.rmw_write(conn, st, req);
        }
    }

    /// A device request of read-modify-write `req` ended; when the step's last has, the
    /// next step starts.
    pub(super) fn rmw_done(&self, conn: &Conn, st: &mut ConnState, req: u32, status: IoStatus) {
        let r = &mut st.reqs[req as usize];
        if !status.is_ok() && r.error == 0 {
            r.error = status.raw();
        }
        r.pending = r.pending.saturating_sub(1);
        if r.pending > 0 {
            return;
        }
        if r.error != 0 {
            return self.rmw_finish(conn, st, req);
        }
        match r.stage {
            Stage::Edges => self.rmw_write(conn, st, req),
            Stage::Writing if r.then_flush => {
                r.then_flush = false;
                r.stage = Stage::Flushing;
                r.pending = 1;
                let token = (u64::from(conn.index) << 32) | u64::from(req);
                let io = Io::nodata(Op::Flush, 0, 0, self.sink.get(), token);
                self.submits.borrow_mut().push((conn.index, io));
                st.in_flight += 1;
            }
            _ => self.rmw_finish(conn, st, req),
        }
    }

    /// Read-modify-write `req` read its edge blocks: lays the new bytes (or zeroes) over
    /// them and writes.
    pub(super) fn rmw_write(&self, conn: &Conn, st: &mut ConnState, req: u32) {
        let r = &mut st.reqs[req as usize];
        let (Some(w), Some(b)) = (r.wide(), r.buf.as_mut()) else {
            return self.rmw_finish(conn, st, req);
        };
        let (edges, n) = w.edges();
        let block = w.block as usize;
        let token = (u64::from(conn.index) << 32) | u64::from(req);
        let sink = self.sink.get();
        let mut submits = self.submits.borrow_mut();
        r.stage = Stage::Writing;
        if r.command == cmd::WRITE {
            let scratch = w.len as usize;
            let data = b.as_mut_slice();
            for (i, &at) in edges[..n].iter().enumerate() {
                for (from, to) in w.kept(at) {
                    let src = scratch + i * block + (from - at) as usize;
                    data.copy_within(src..src + (to - from) as usize, from as usize);
                }
            }
            let mut flags = IoFlags::NONE;
            if r.flags & cflags::FUA != 0 {
                flags = flags.with(IoFlags::FUA);
            }
            submits.push((
                conn.index,
                Io {
                    op: Op::Write,
                    flags,
                    offset: w.offset,
                    len: w.len,
                    buf: b.as_mut_ptr(),
                    sink,
                    token,
                },
            ));
            r.pending = 1;
        } else {
            // Write-zeroes: zero the covered bytes of each edge block and write it back;
            // zero the whole blocks between them.
            let data = b.as_mut_slice();
            let (head, end) = (w.head, w.head + w.inner);
            for (i, &at) in edges[..n].iter().enumerate() {
                let (lo, hi) = (head.clamp(at, at + w.block), end.clamp(at, at + w.block));
                data[i * block + (lo - at) as usize..i * block + (hi - at) as usize].fill(0);
            }
            let base = b.as_mut_ptr();
            for (i, &at) in edges[..n].iter().enumerate() {
                submits.push((
                    conn.index,
                    Io {
                        op: Op::Write,
                        flags: IoFlags::NONE,
                        offset: w.offset + at,
                        len: w.block,
                        // SAFETY: the buffer holds two blocks.
                        buf: unsafe { base.add(i * block) },
                        sink,
                        token,
                    },
                ));
            }
            let (whole_off, whole_len) = w.whole();
            let mut pending = n;
            if whole_len > 0 {
                let mut io = Io::nodata(Op::WriteZeroes, whole_off, whole_len, sink, token);
                if r.flags & cflags::NO_HOLE != 0 {
                    io.flags = io.flags.with(IoFlags::NO_HOLE);
                }
                submits.push((conn.index, io));
                pending += 1;
            }
            r.pending = pending as u8;
        }
        st.in_flight += u32::from(r.pending);
    }

    /// Read-modify-write `req` has ended (or failed): releases its ticket and replies.
    pub(super) fn rmw_finish(&self, conn: &Conn, st: &mut ConnState, req: u32) {
        let r = std::mem::take(&mut st.reqs[req as usize]);
        st.free_reqs.push(req);
        if let Some(g) = conn.gate.as_ref() {
            g.done(self.reactor, r.pass);
        }
        if let Some(b) = r.buf {
            st.pool.put(b);
        }
        if r.error != 0 {
            let e = errno::from_local(r.error);
            self.reply_error(conn, st, r.command, (r.cookie, r.offset), e);
        } else {
            self.reply_simple(conn, st, r.cookie, r.offset, 0);
        }
        self.mark_dirty(conn, st);
    }
}

/// Unaligned request `r` as kept while it runs: its buffer holds the whole blocks around
/// it, and a write or write-zeroes keeps its widened range for the read-modify-write.
fn unaligned_req(r: &proto::Request, op: Op, w: Wide, buf: Option<Buf>) -> Req {
    Req {
        data_off: if matches!(op, Op::Read | Op::Write) {
            w.head as u32
        } else {
            0
        },
        then_flush: r.flags & cflags::FUA != 0 && matches!(op, Op::Discard | Op::WriteZeroes),
        slow: matches!(op, Op::Write | Op::WriteZeroes).then(|| {
            Box::new(Slow {
                wide: Some(w),
                waiting_io: None,
            })
        }),
        ..Req::of(r, buf)
    }
}
