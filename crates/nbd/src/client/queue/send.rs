//! Requests to the socket: a connection's output queue sent with one `sendmsg` per pass
//! (write payloads straight from the submitter's buffer), or encrypted and sent over TLS;
//! what a completed send means.

use std::os::fd::RawFd;

use io_uring::{opcode, types};

use crate::gather::{self, Segment};

use super::{Conn, Link, NbdQueue, State, IOV_BATCH, RAW_OUT_MAX, SEND};

impl NbdQueue {
    pub(super) fn push_send(&self, c: &mut Conn, ci: usize, fd: RawFd) {
        gather::gather(&mut c.iov, &c.out, c.out_sent, IOV_BATCH);
        c.msg.msg_iov = c.iov.as_mut_ptr();
        c.msg.msg_iovlen = c.iov.len() as _;
        let entry = opcode::SendMsg::new(types::Fd(fd), &c.msg as *const libc::msghdr)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build();
        c.send_armed = true;
        // SAFETY: the msghdr, the iovecs and the headers live in the connection, which
        // sits in a vector that never grows, and the output queue never reallocates (it
        // holds at most MAX_REQS entries, its reserved capacity); write payloads belong to
        // submitters until their completion, which comes after the reply. Nothing is
        // touched or freed until this SQE completes.
        unsafe {
            self.core
                .push_sqe(self.user.get(), ((ci as u64) << 8) | SEND, entry)
        };
    }

    /// Encrypts every waiting request and sends the ciphertext.
    pub(super) fn push_send_tls(
        &self,
        c: &mut Conn,
        ci: usize,
        fd: RawFd,
    ) -> Result<(), &'static str> {
        use std::io::Write;
        let Conn { out, tls, .. } = c;
        let Some(t) = tls.as_mut() else { return Ok(()) };
        if t.raw_sent == t.raw_out.len() {
            t.raw_out.clear();
            t.raw_sent = 0;
            while t.raw_out.len() < RAW_OUT_MAX {
                let Some(o) = out.pop_front() else { break };
                let mut w = t.conn.writer();
                w.write_all(o.head()).map_err(|_| "a TLS error")?;
                w.write_all(o.data()).map_err(|_| "a TLS error")?;
                while t.conn.wants_write() {
                    if t.conn.write_tls(&mut t.raw_out).is_err() {
                        return Err("a TLS error");
                    }
                }
            }
            while t.conn.wants_write() {
                if t.conn.write_tls(&mut t.raw_out).is_err() {
                    return Err("a TLS error");
                }
            }
        }
        if t.raw_sent == t.raw_out.len() {
            return Ok(());
        }
        let entry = opcode::Send::new(
            types::Fd(fd),
            t.raw_out[t.raw_sent..].as_ptr(),
            (t.raw_out.len() - t.raw_sent) as u32,
        )
        .flags(libc::MSG_NOSIGNAL)
        .build();
        c.send_armed = true;
        // SAFETY: nothing is appended to the ciphertext buffer until this SQE completes,
        // and the connection is not freed while it is in flight.
        unsafe {
            self.core
                .push_sqe(self.user.get(), ((ci as u64) << 8) | SEND, entry)
        };
        Ok(())
    }

    pub(super) fn sent(&self, st: &mut State, ci: usize, res: i32) {
        let c = &mut st.conns[ci];
        c.send_armed = false;
        if c.link != Link::Up {
            self.mark_dirty(st, ci);
            return;
        }
        if res < 0 {
            if res == -libc::EINTR || res == -libc::EAGAIN {
                self.mark_dirty(st, ci);
                return;
            }
            self.kill(st, ci, "a send failed");
            return;
        }
        if let Some(t) = c.tls.as_mut() {
            t.raw_sent += res as usize;
            if t.raw_sent >= t.raw_out.len() {
                t.raw_out.clear();
                t.raw_sent = 0;
            }
            self.mark_dirty(st, ci);
            return;
        }
        gather::consume(&mut c.out, &mut c.out_sent, res as usize, drop);
        self.mark_dirty(st, ci);
    }
}
