//! Requests to the socket: a connection's output queue sent with one `sendmsg` per pass
//! (write payloads straight from the submitter's buffer), or encrypted and sent over TLS
//! (see `tls_send`, which the server's replies go through too); what a completed send
//! means.

use std::os::fd::RawFd;

use io_uring::{opcode, types};

use crate::gather;

use super::{Conn, Link, NbdQueue, State, IOV_BATCH, SEND, TLS_BATCH};

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

    /// Encrypts waiting requests (a batch of at most `TLS_BATCH` bytes) and sends the
    /// ciphertext.
    pub(super) fn push_send_tls(
        &self,
        c: &mut Conn,
        ci: usize,
        fd: RawFd,
    ) -> Result<(), &'static str> {
        let Conn {
            out, out_sent, tls, ..
        } = c;
        let Some(t) = tls.as_mut() else { return Ok(()) };
        t.out
            .fill(&mut *t.conn, out, out_sent, TLS_BATCH, drop)
            .map_err(|_| "a TLS error")?;
        let Some(entry) = t.out.send_entry(fd) else {
            return Ok(());
        };
        c.send_armed = true;
        // SAFETY: nothing is encrypted into the ciphertext buffer until this SQE
        // completes, and the connection is not freed while it is in flight.
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
            t.out.sent(res as usize);
            self.mark_dirty(st, ci);
            return;
        }
        gather::consume(&mut c.out, &mut c.out_sent, res as usize, drop);
        self.mark_dirty(st, ci);
    }
}
