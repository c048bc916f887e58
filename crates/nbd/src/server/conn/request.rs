//! Issuing a request: the next request taken from the input and checked
//! ([`command::check`](crate::proto::command::check)), refused (its payload skipped) or
//! started: a buffer from the connection's pool, the device request, the export's gate
//! for writes; then its completion and reply. Unaligned requests go to [`super::rmw`],
//! block status to [`super::block_status`].

use cairn_core::{Io, IoFlags, IoStatus, Op};

use crate::proto;
use crate::proto::command::{Command, Refusal};
use crate::proto::{cflags, cmd, command, errno};
use crate::server::gate::Pass;
use crate::server::pool::Buf;

use super::{Conn, ConnState, Next, Req, Rx, ServerLoop, Stage, MAX_PENDING, SKIP_MAX};

impl ServerLoop {
    /// The next step of input processing; never calls out of the connection.
    pub(super) fn next_request(&self, conn: &Conn, st: &mut ConnState) -> Next {
        if st.dead {
            return Next::Stop;
        }
        match st.rx {
            Rx::Payload { req, got } => return self.take_payload(conn, st, req, got),
            Rx::Skip { .. } => return self.skip_payload(conn, st),
            Rx::Header => {}
        }
        if st.eof && !self.shutting.get() {
            return Next::Stop;
        }
        if st.reqs.len() - st.free_reqs.len() + st.out.len() >= MAX_PENDING {
            st.blocked = true;
            return Next::Stop;
        }
        let Some(r) = self.frame(conn, st) else {
            return Next::Stop;
        };
        // A request parsed again after waiting for a buffer was counted the first time.
        if !std::mem::take(&mut st.recounted) {
            conn.info.request(r.command, r.len);
            st.progress_ns = self.core.now_ns();
        }
        match command::check(&r, &conn.terms, self.shutting.get()) {
            Ok(Command::Io {
                op,
                flags,
                then_flush,
            }) => self.start_io(conn, st, &r, (op, flags), then_flush),
            Ok(Command::Unaligned { op, wide }) => self.unaligned(conn, st, &r, op, wide),
            Ok(Command::BlockStatus) => self.block_status(conn, st, &r),
            Ok(Command::Cache) => {
                // A hint; every device here reads at memory or page-cache speed.
                st.rs += conn.header_len();
                self.reply_simple(conn, st, r.cookie, r.offset, 0);
                Next::Again
            }
            Ok(Command::Disconnect) => {
                st.rs += conn.header_len();
                st.end("the client disconnected");
                st.eof = true;
                Next::Stop
            }
            Err(why) => self.refuse(conn, st, &r, why),
        }
    }

    /// Refuses request `r`: skips its payload if it has one (never parsed as requests),
    /// then the error reply.
    #[cold]
    pub(super) fn refuse(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        r: &proto::Request,
        why: Refusal,
    ) -> Next {
        if why == Refusal::OverMaxPayload && !st.warned {
            // Once per connection: a client that ignores the maximum keeps sending.
            st.warned = true;
            log::warn!(
                "cairn: serve: {}: a {} of {} bytes is over --max-payload ({} bytes): refused with EINVAL",
                conn.peer,
                if r.command == cmd::READ { "read" } else { "write" },
                r.len,
                self.limits.max_payload
            );
        }
        st.rs += conn.header_len();
        let payload = command::payload_len(r, conn.session.extended);
        if payload == 0 {
            self.reply_error(conn, st, r.command, (r.cookie, r.offset), why.errno());
            return Next::Again;
        }
        if payload > SKIP_MAX {
            log::warn!(
                "cairn: serve: {}: write payload of {payload} bytes is over any limit; disconnecting",
                conn.peer
            );
            st.end("a protocol error (write payload over any limit)");
            st.dead = true;
            return Next::Stop;
        }
        st.rx = Rx::Skip {
            left: payload,
            cookie: r.cookie,
            offset: r.offset,
            error: why.errno(),
        };
        Next::Again
    }

    /// Starts checked request `r` on whole blocks: its buffer, then the device request
    /// (a write's once its payload is in).
    #[inline]
    pub(super) fn start_io(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        r: &proto::Request,
        (op, flags): (Op, IoFlags),
        then_flush: bool,
    ) -> Next {
        let hl = conn.header_len();
        let mut buf = None;
        if op.has_data() {
            // A read's buffer is filled at once; a write's as its payload arrives: for
            // now, what came with the header.
            let touched = if op == Op::Read {
                r.len as usize
            } else {
                (st.re - st.rs - hl).min(r.len as usize)
            };
            match self.take_buffer(conn, st, r.len as usize, touched) {
                Ok(b) => buf = Some(b),
                Err(next) => return next,
            }
        }
        st.rs += hl;
        let index = Self::alloc_req(
            st,
            Req {
                then_flush,
                ..Req::of(r, buf)
            },
        );
        if op == Op::Write {
            return self.take_write_payload(conn, st, index, 0);
        }
        let token = (u64::from(conn.index) << 32) | u64::from(index);
        let (ptr, len) = if op == Op::Flush {
            (std::ptr::null_mut(), 0)
        } else {
            let req = &mut st.reqs[index as usize];
            let p = req
                .buf
                .as_mut()
                .map_or(std::ptr::null_mut(), |b| b.as_mut_ptr());
            (p, r.len)
        };
        let io = Io {
            op,
            flags,
            offset: if op == Op::Flush { 0 } else { r.offset },
            len,
            buf: ptr,
            sink: self.sink.get(),
            token,
        };
        st.in_flight += 1;
        if op.is_write() {
            return match self.pass_gate(conn, st, index, io) {
                Some(io) => Next::Submit(io),
                None => Next::Again,
            };
        }
        Next::Submit(io)
    }

    /// A data buffer of `len` bytes for the request at the head of the input, `touched`
    /// of them charged to the memory budget now. `Err` is what to do while there is none
    /// (the request is parsed again then, not counted twice).
    #[inline]
    pub(super) fn take_buffer(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        len: usize,
        touched: usize,
    ) -> Result<Buf, Next> {
        let Some(mut b) = st.pool.get(len) else {
            st.blocked = true;
            st.recounted = true;
            return Err(Next::Stop);
        };
        if !st.pool.ensure(&mut b, touched) {
            st.pool.put(b);
            st.recounted = true;
            return Err(self.wait_memory(conn, st));
        }
        Ok(b)
    }

    /// Write `index`'s payload follows its header: takes what has arrived (into its
    /// buffer at `at`), and receives the rest; once all is in, the device request.
    #[inline]
    pub(super) fn take_write_payload(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        index: u32,
        at: usize,
    ) -> Next {
        let len = st.reqs[index as usize].len as usize;
        let avail = (st.re - st.rs).min(len);
        let (rs, re) = (st.rs, st.rs + avail);
        let ConnState { inbuf, reqs, .. } = &mut *st;
        if let Some(b) = reqs[index as usize].buf.as_mut() {
            b.as_mut_slice()[at..at + avail].copy_from_slice(&inbuf[rs..re]);
        }
        st.rs += avail;
        if avail < len {
            st.rx = Rx::Payload {
                req: index,
                got: avail as u32,
            };
            return Next::Stop;
        }
        match self.payload_done(conn, st, index) {
            Some(io) => Next::Submit(io),
            None => Next::Again,
        }
    }

    /// Write `req`'s payload has fully arrived: the device request to submit now, if any.
    /// An unaligned write starts its read-modify-write instead, and a write may wait at
    /// the gate.
    #[inline]
    pub(super) fn payload_done(&self, conn: &Conn, st: &mut ConnState, req: u32) -> Option<Io> {
        st.in_flight += 1;
        if st.reqs[req as usize].wide().is_some() {
            self.rmw_start(conn, st, req);
            return None;
        }
        let io = self.write_io(conn, st, req);
        self.pass_gate(conn, st, req, io)
    }

    /// The device write for request `req`, whose payload has fully arrived.
    #[inline]
    pub(super) fn write_io(&self, conn: &Conn, st: &mut ConnState, req: u32) -> Io {
        let r = &mut st.reqs[req as usize];
        let mut flags = IoFlags::NONE;
        if r.flags & cflags::FUA != 0 {
            flags = flags.with(IoFlags::FUA);
        }
        Io {
            op: Op::Write,
            flags,
            offset: r.offset,
            len: r.len,
            buf: r
                .buf
                .as_mut()
                .map_or(std::ptr::null_mut(), |b| b.as_mut_ptr()),
            sink: self.sink.get(),
            token: (u64::from(conn.index) << 32) | u64::from(req),
        }
    }

    /// Lets write `req` (a write, trim or write-zeroes, counted in flight) through the
    /// export's gate: the device request to submit now, or `None` while it waits.
    #[inline]
    pub(super) fn pass_gate(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        req: u32,
        io: Io,
    ) -> Option<Io> {
        let Some(gate) = conn.gate.as_ref() else {
            return Some(io);
        };
        let pass = gate.write(self.reactor, io.offset, io.offset + io.len);
        st.reqs[req as usize].pass = pass;
        match pass {
            Pass::Ticket(id) => self.wait_for_ticket(conn, st, req, id, io),
            _ => Some(io),
        }
    }

    /// A write got a ticket (a read-modify-write is active): the device request if the
    /// ticket is good already, else it waits.
    #[cold]
    pub(super) fn wait_for_ticket(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        req: u32,
        id: u64,
        io: Io,
    ) -> Option<Io> {
        let seen = self.gates.wake.generation();
        if conn.gate.as_ref().is_none_or(|g| g.ready(id)) {
            return Some(io);
        }
        let r = &mut st.reqs[req as usize];
        r.stage = Stage::Waiting;
        r.slow.get_or_insert_with(Box::default).waiting_io = Some(io);
        self.wait(conn.index, req, seen);
        None
    }

    /// Request `req` of connection `conn` waits at a gate, checked at generation `seen`.
    pub(super) fn wait(&self, conn: u32, req: u32, seen: u64) {
        self.waiting.borrow_mut().push((conn, req));
        self.gates.wake.waiting(self.reactor, seen);
    }

    /// Retries the requests waiting at a gate if anything was released since the last
    /// try; returns how many started.
    #[cold]
    pub(super) fn retry_waiting(&self) -> usize {
        let wake = &self.gates.wake;
        let now = wake.generation();
        if now == self.retried_at.get() {
            return 0;
        }
        self.retried_at.set(now);
        wake.retrying(self.reactor);
        let list = std::mem::take(&mut *self.waiting.borrow_mut());
        let before = list.len();
        for (ci, ri) in list {
            let Some(conn) = self.conn(ci) else { continue };
            let mut st = conn.st.borrow_mut();
            let r = &st.reqs[ri as usize];
            if r.wide().is_some() {
                self.rmw_try(&conn, &mut st, ri);
            } else if let Pass::Ticket(id) = r.pass {
                let io = r.slow.as_ref().and_then(|s| s.waiting_io);
                if let Some(io) = io.and_then(|io| self.wait_for_ticket(&conn, &mut st, ri, id, io))
                {
                    let r = &mut st.reqs[ri as usize];
                    r.stage = Stage::Plain;
                    r.slow = None;
                    self.submits.borrow_mut().push((ci, io));
                }
            }
            self.mark_dirty(&conn, &mut st);
        }
        // Those that wait again were pushed back by `wait`.
        let still = self.waiting.borrow().len();
        self.drain_submits();
        before.saturating_sub(still)
    }

    /// Submits the device requests that read-modify-writes and gates queued.
    pub(super) fn drain_submits(&self) {
        loop {
            let next = self.submits.borrow_mut().pop();
            let Some((ci, io)) = next else { break };
            if let Some(c) = self.conn(ci) {
                c.queue.submit(io);
            }
        }
    }

    pub(super) fn alloc_req(st: &mut ConnState, req: Req) -> u32 {
        match st.free_reqs.pop() {
            Some(i) => {
                st.reqs[i as usize] = req;
                i
            }
            None => {
                st.reqs.push(req);
                st.reqs.len() as u32 - 1
            }
        }
    }

    /// Plain request `index` ended at the device with `status`: frees it, passes the gate
    /// back and queues its reply.
    #[inline]
    pub(super) fn finish_plain(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        index: u32,
        status: IoStatus,
    ) {
        let r = std::mem::take(&mut st.reqs[index as usize]);
        st.free_reqs.push(index);
        if r.pass != Pass::None {
            if let Some(g) = conn.gate.as_ref() {
                g.done(self.reactor, r.pass);
            }
        }
        if !status.is_ok() {
            if let Some(b) = r.buf {
                st.pool.put(b);
            }
            let e = errno::from_local(status.raw());
            self.reply_error(conn, st, r.command, (r.cookie, r.offset), e);
        } else if r.command == cmd::READ {
            self.reply_read(conn, st, r);
        } else {
            if let Some(b) = r.buf {
                st.pool.put(b);
            }
            self.reply_simple(conn, st, r.cookie, r.offset, 0);
        }
        self.mark_dirty(conn, st);
    }
}
