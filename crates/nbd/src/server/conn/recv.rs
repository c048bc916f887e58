//! Receiving and framing bytes: a connection's input buffer, the receive SQE that fills
//! it (or a write's buffer directly, or the TLS ciphertext buffer), what a completed
//! receive means, a write's payload as it arrives, a refused write's payload skipped,
//! and the request header found at the head of the input.

use std::os::fd::RawFd;

use io_uring::{opcode, types};

use cairn_core::{AlignedBuf, Io};

use crate::proto;
use crate::proto::cmd;

use super::{Conn, ConnState, Next, RecvTarget, Rx, ServerLoop, INBUF, PAYLOAD_STEP, RAW_IN, RECV};

/// A connection's input buffer: mapped memory (an [`AlignedBuf`] of `MAP_MIN` bytes or
/// more), resident only where a receive wrote. From the heap, the allocator would zero a
/// reused block by writing it: after connections came and went, every new connection's
/// 256 KiB would be resident before it received a byte (measured: a server with 1,000
/// idle connections, after two rounds of 1,000 opened and closed, held 272 MiB; 20 MiB
/// with the mapping).
pub(super) struct Input(pub(super) AlignedBuf);

impl Input {
    /// Gives the first `touched` bytes' pages back to the kernel; they read as zeroes
    /// when next touched. The caller makes sure that no receive in flight writes here
    /// and that nothing in the buffer is still needed.
    pub(super) fn release(&mut self, touched: usize) {
        let len = touched.next_multiple_of(4096).min(self.0.len());
        // SAFETY: the buffer is a private anonymous mapping of at least `len` bytes (an
        // AlignedBuf of MAP_MIN or more), owned here; MADV_DONTNEED only replaces its
        // pages with zero pages, and `&mut self` means nobody reads them meanwhile.
        unsafe { libc::madvise(self.0.as_mut_ptr().cast(), len, libc::MADV_DONTNEED) };
    }
}

impl std::ops::Deref for Input {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.0.as_slice()
    }
}

impl std::ops::DerefMut for Input {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.0.as_mut_slice()
    }
}

impl ServerLoop {
    pub(super) fn push_recv(&self, conn: &Conn, st: &mut ConnState, fd: RawFd) {
        if st.tls.is_some() {
            // Only once rustls has every byte received so far, and decrypted input has
            // somewhere to go.
            st.pump_tls(&conn.peer);
            if st.re == st.inbuf.len() || st.dead {
                return;
            }
            let Some(t) = st.tls.as_mut() else { return };
            if t.raw_pos < t.raw_len {
                return;
            }
            let entry =
                opcode::Recv::new(types::Fd(fd), t.raw_in.as_mut_ptr(), RAW_IN as u32).build();
            st.recv_armed = true;
            st.recv_target = RecvTarget::Raw;
            // SAFETY: the ciphertext buffer belongs to the connection and is not touched
            // until this SQE completes.
            unsafe {
                self.core
                    .push_sqe(self.user.get(), (u64::from(conn.index) << 8) | RECV, entry)
            };
            return;
        }
        let direct = matches!(st.rx, Rx::Payload { .. }) && st.rs == st.re;
        let (ptr, len) = match st.rx {
            Rx::Payload { req, got } if direct => {
                let ConnState { reqs, pool, .. } = &mut *st;
                let r = &mut reqs[req as usize];
                let Some(b) = r.buf.as_mut() else { return };
                let (at, end) = (
                    r.data_off as usize + got as usize,
                    (r.data_off as u64 + r.len) as usize,
                );
                // Memory for the next megabyte of the payload, taken before it arrives.
                if !pool.ensure(b, end.min(at + PAYLOAD_STEP)) {
                    self.wait_memory(conn, st);
                    return;
                }
                let room = b.charged().min(end) - at;
                // SAFETY: at < data_off + r.len <= the buffer's length, and `room` bytes
                // from there are inside it.
                (unsafe { b.as_mut_ptr().add(at) }, room)
            }
            _ => {
                if st.rs == st.re {
                    st.rs = 0;
                    st.re = 0;
                } else if st.re == st.inbuf.len() || st.rs > INBUF / 2 {
                    let (rs, re) = (st.rs, st.re);
                    st.inbuf.copy_within(rs..re, 0);
                    st.re -= st.rs;
                    st.rs = 0;
                }
                if st.re == st.inbuf.len() {
                    // Full of unparsed requests: wait until replies drain.
                    return;
                }
                let re = st.re;
                (st.inbuf[re..].as_mut_ptr(), st.inbuf.len() - re)
            }
        };
        let entry = opcode::Recv::new(types::Fd(fd), ptr, len as u32).build();
        st.recv_armed = true;
        st.recv_target = if direct {
            RecvTarget::Payload
        } else {
            RecvTarget::Inbuf
        };
        // SAFETY: the target (input buffer or request buffer) belongs to the connection
        // and is not touched or freed until this SQE completes.
        unsafe {
            self.core
                .push_sqe(self.user.get(), (u64::from(conn.index) << 8) | RECV, entry)
        };
    }

    /// Bytes arrived from the socket (`res` > 0), or the stream ended or failed.
    pub(super) fn received(&self, conn: &Conn, res: i32) {
        if res == -libc::ECANCELED {
            return self.recv_cancelled(conn);
        }
        let submit = {
            let mut st = conn.st.borrow_mut();
            st.recv_armed = false;
            st.trimming = false;
            st.counts.recvs += 1;
            st.counts.recv_bytes += res.max(0) as u64;
            if res <= 0 {
                self.recv_ended(conn, &mut st, res);
                None
            } else {
                self.recv_landed(conn, &mut st, res as usize)
            }
        };
        if let Some(io) = submit {
            conn.queue.submit(io);
        }
        self.process(conn);
    }

    /// The receive in flight was cancelled to give the input buffer back (`trim_idle`),
    /// or, the slot reused, a late cancellation meant for a connection before: nothing
    /// was received.
    #[cold]
    pub(super) fn recv_cancelled(&self, conn: &Conn) {
        let mut st = conn.st.borrow_mut();
        st.recv_armed = false;
        if std::mem::take(&mut st.trimming) && st.rs == st.re {
            let touched = st.touched;
            st.inbuf.release(touched);
            let mut raw = 0;
            if let Some(t) = st.tls.as_mut().filter(|t| t.raw_pos == t.raw_len) {
                raw = std::mem::take(&mut t.raw_touched);
                t.raw_in.release(raw);
            }
            log::debug!(
                "cairn: serve: {}: idle: {} KiB of input buffer given back ({} KiB of ciphertext buffer)",
                conn.peer,
                touched >> 10,
                raw >> 10
            );
            (st.rs, st.re, st.touched) = (0, 0, 0);
            if st.wide {
                st.wide = false;
                self.wide
                    .borrow_mut()
                    .retain(|&(i, id)| (i, id) != (conn.index, conn.info.id));
            }
        }
        self.mark_dirty(conn, &mut st);
    }

    /// The stream ended (`res` 0) or receiving failed (`res` < 0): no more requests; a
    /// write whose payload was still arriving is dropped.
    pub(super) fn recv_ended(&self, conn: &Conn, st: &mut ConnState, res: i32) {
        if res < 0 && res != -libc::ECONNRESET && !st.eof {
            log::warn!(
                "cairn: serve: {}: receive failed: {}",
                conn.peer,
                std::io::Error::from_raw_os_error(-res)
            );
        }
        st.end(if res == 0 {
            "the client closed the connection"
        } else {
            "receive failed"
        });
        st.eof = true;
        if let Rx::Payload { req, .. } = st.rx {
            let b = st.reqs[req as usize].buf.take();
            if let Some(b) = b {
                st.pool.put(b);
            }
            st.free_reqs.push(req);
            st.rx = Rx::Header;
        }
        self.mark_dirty(conn, st);
    }

    /// `n` bytes landed where the receive pointed: the input buffer, a write's payload
    /// (then the device write, once all of it is in) or the TLS ciphertext buffer.
    #[inline]
    pub(super) fn recv_landed(&self, conn: &Conn, st: &mut ConnState, n: usize) -> Option<Io> {
        match st.recv_target {
            RecvTarget::Payload => match st.rx {
                Rx::Payload { req, got } => {
                    let got = got + n as u32;
                    if u64::from(got) < st.reqs[req as usize].len {
                        st.rx = Rx::Payload { req, got };
                        None
                    } else {
                        st.rx = Rx::Header;
                        self.payload_done(conn, st, req)
                    }
                }
                _ => None,
            },
            RecvTarget::Inbuf => {
                st.re += n;
                None
            }
            RecvTarget::Raw => {
                if let Some(t) = st.tls.as_mut() {
                    t.raw_pos = 0;
                    t.raw_len = n;
                }
                None
            }
        }
    }

    /// The request header at the head of the input, if a whole one is there (not yet
    /// consumed). A bad magic ends the connection: nothing after it can be trusted.
    #[inline]
    pub(super) fn frame(&self, conn: &Conn, st: &mut ConnState) -> Option<proto::Request> {
        let input = &st.inbuf[st.rs..st.re];
        let decoded = if conn.session.extended {
            proto::parse_extended_request(input)
        } else {
            proto::parse_request(input)
        };
        match decoded {
            proto::Decoded::Incomplete => None,
            proto::Decoded::BadMagic(m) => {
                log::warn!(
                    "cairn: serve: {}: bad request magic {m:#010x}; disconnecting",
                    conn.peer
                );
                st.end("a protocol error (bad request magic)");
                st.dead = true;
                None
            }
            proto::Decoded::Request(r) => Some(r),
        }
    }

    /// Payload bytes of write `req` (`got` of them in so far) that came with the header
    /// (or through TLS) are in the input buffer; the rest is received straight into the
    /// request's buffer.
    #[inline]
    pub(super) fn take_payload(&self, conn: &Conn, st: &mut ConnState, req: u32, got: u32) -> Next {
        let want = st.reqs[req as usize].len as usize - got as usize;
        let n = (st.re - st.rs).min(want);
        if n == 0 {
            return Next::Stop;
        }
        let (rs, got_us) = (st.rs, got as usize);
        let ConnState {
            inbuf, reqs, pool, ..
        } = &mut *st;
        let r = &mut reqs[req as usize];
        let at = r.data_off as usize + got_us;
        if let Some(b) = r.buf.as_mut() {
            if !pool.ensure(b, at + n) {
                return self.wait_memory(conn, st);
            }
            b.as_mut_slice()[at..at + n].copy_from_slice(&inbuf[rs..rs + n]);
        }
        st.rs += n;
        if n < want {
            st.rx = Rx::Payload {
                req,
                got: got + n as u32,
            };
            return Next::Stop;
        }
        st.rx = Rx::Header;
        match self.payload_done(conn, st, req) {
            Some(io) => Next::Submit(io),
            None => Next::Again,
        }
    }

    /// Skips what is in the input of a refused request's payload; once all of it has
    /// gone by, the error reply.
    pub(super) fn skip_payload(&self, conn: &Conn, st: &mut ConnState) -> Next {
        let Rx::Skip {
            left,
            cookie,
            offset,
            error,
        } = st.rx
        else {
            return Next::Again;
        };
        let n = ((st.re - st.rs) as u64).min(left);
        st.rs += n as usize;
        if n < left {
            st.rx = Rx::Skip {
                left: left - n,
                cookie,
                offset,
                error,
            };
            return Next::Stop;
        }
        st.rx = Rx::Header;
        self.reply_error(conn, st, cmd::WRITE, (cookie, offset), error);
        Next::Again
    }
}

impl ConnState {
    /// Moves decrypted bytes from the TLS session into the input buffer, feeding rustls
    /// the received ciphertext a record at a time (its plaintext buffer is small). Marks
    /// the connection dead on a TLS error.
    pub(super) fn pump_tls(&mut self, peer: &str) {
        let ConnState {
            tls,
            inbuf,
            rs,
            re,
            dead,
            ..
        } = self;
        let Some(t) = tls.as_mut() else { return };
        loop {
            if *rs > 0 && (*rs == *re || *re == inbuf.len()) {
                inbuf.copy_within(*rs..*re, 0);
                *re -= *rs;
                *rs = 0;
            }
            while *re < inbuf.len() {
                match std::io::Read::read(&mut t.conn.reader(), &mut inbuf[*re..]) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => *re += n,
                }
            }
            if *re == inbuf.len() || t.raw_pos == t.raw_len {
                return;
            }
            let mut rd = &t.raw_in[t.raw_pos..t.raw_len];
            let before = rd.len();
            let fed = t.conn.read_tls(&mut rd);
            t.raw_pos += before - rd.len();
            let processed = fed.map_err(|e| e.to_string()).and_then(|_| {
                t.conn
                    .process_new_packets()
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            });
            if let Err(e) = processed {
                log::warn!("cairn: serve: {peer}: TLS: {e}");
                *dead = true;
                return;
            }
        }
    }
}
