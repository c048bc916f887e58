//! Replies and sending them: simple replies and structured or extended chunks, queued per
//! connection and sent with one `sendmsg` per pass (or encrypted and sent, over TLS).

use std::os::fd::RawFd;

use io_uring::{opcode, types};

use crate::gather;
use crate::proto;
use crate::proto::{chunk, cmd};
use crate::server::pool::Buf;

use super::{Conn, ConnState, Req, ServerLoop, IOV_BATCH, SEND, TLS_BATCH};

/// A reply waiting to be sent: a header and, for a read or a block status, a buffer.
pub(super) struct Seg {
    /// Room for an extended chunk header and a read's 8-byte offset.
    pub(super) head: [u8; 40],
    pub(super) head_len: u8,
    pub(super) buf: Option<Buf>,
    /// Where the data starts in `buf` (not 0 for a read widened to whole blocks).
    pub(super) data_off: u32,
    pub(super) data_len: u32,
}

impl gather::Segment for Seg {
    fn head(&self) -> &[u8] {
        &self.head[..usize::from(self.head_len)]
    }

    fn data(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], |b| {
            &b.as_slice()[self.data_off as usize..][..self.data_len as usize]
        })
    }
}

impl ServerLoop {
    /// A reply without data: a simple reply, or with extended headers (which forbid
    /// simple replies) a NONE chunk or an ERROR chunk.
    pub(super) fn reply_simple(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        cookie: u64,
        offset: u64,
        error: u32,
    ) {
        let mut head = [0u8; 40];
        let head_len = if conn.session.extended {
            if error == 0 {
                head[..32].copy_from_slice(&proto::extended_chunk_header(
                    chunk::FLAG_DONE,
                    chunk::NONE,
                    cookie,
                    offset,
                    0,
                ));
                32
            } else {
                head[..32].copy_from_slice(&proto::extended_chunk_header(
                    chunk::FLAG_DONE,
                    chunk::ERROR,
                    cookie,
                    offset,
                    6,
                ));
                head[32..36].copy_from_slice(&error.to_be_bytes());
                // Message length 0.
                38
            }
        } else {
            head[..proto::SIMPLE_REPLY].copy_from_slice(&proto::simple_reply(error, cookie));
            proto::SIMPLE_REPLY as u8
        };
        st.out.push_back(Seg {
            head,
            head_len,
            buf: None,
            data_off: 0,
            data_len: 0,
        });
    }

    /// An error reply in the form the command needs (structured for reads when
    /// structured replies are on; always a chunk with extended headers).
    pub(super) fn reply_error(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        command: u16,
        (cookie, offset): (u64, u64),
        e: u32,
    ) {
        conn.info.error();
        self.observer.error(e);
        if !conn.session.extended
            && conn.session.structured
            && (command == cmd::READ || command == cmd::BLOCK_STATUS)
        {
            let mut head = [0u8; 40];
            head[..20].copy_from_slice(&proto::chunk_header(
                chunk::FLAG_DONE,
                chunk::ERROR,
                cookie,
                6,
            ));
            head[20..24].copy_from_slice(&e.to_be_bytes());
            // Message length 0.
            st.out.push_back(Seg {
                head,
                head_len: 26,
                buf: None,
                data_off: 0,
                data_len: 0,
            });
        } else {
            self.reply_simple(conn, st, cookie, offset, e);
        }
    }

    /// Successful reply without data.
    pub(super) fn reply_ok(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        command: u16,
        (cookie, offset): (u64, u64),
    ) {
        if !conn.session.extended && conn.session.structured && command == cmd::READ {
            let mut head = [0u8; 40];
            head[..20].copy_from_slice(&proto::chunk_header(
                chunk::FLAG_DONE,
                chunk::NONE,
                cookie,
                0,
            ));
            st.out.push_back(Seg {
                head,
                head_len: 20,
                buf: None,
                data_off: 0,
                data_len: 0,
            });
        } else {
            self.reply_simple(conn, st, cookie, offset, 0);
        }
    }

    /// The reply to read `r`, which carries its buffer: a simple reply, or one
    /// `OFFSET_DATA` chunk.
    #[inline]
    pub(super) fn reply_read(&self, conn: &Conn, st: &mut ConnState, r: Req) {
        let mut head = [0u8; 40];
        let head_len = if conn.session.extended {
            head[..32].copy_from_slice(&proto::extended_chunk_header(
                chunk::FLAG_DONE,
                chunk::OFFSET_DATA,
                r.cookie,
                r.offset,
                8 + r.len,
            ));
            head[32..40].copy_from_slice(&r.offset.to_be_bytes());
            40
        } else if conn.session.structured {
            head[..20].copy_from_slice(&proto::chunk_header(
                chunk::FLAG_DONE,
                chunk::OFFSET_DATA,
                r.cookie,
                8 + r.len as u32,
            ));
            head[20..28].copy_from_slice(&r.offset.to_be_bytes());
            28
        } else {
            head[..16].copy_from_slice(&proto::simple_reply(0, r.cookie));
            16
        };
        st.out.push_back(Seg {
            head,
            head_len,
            buf: r.buf,
            data_off: r.data_off,
            data_len: r.len as u32,
        });
    }

    pub(super) fn push_send(&self, conn: &Conn, st: &mut ConnState, fd: RawFd) {
        let ConnState {
            out,
            out_sent,
            iov,
            msg,
            ..
        } = st;
        gather::gather(iov, out, *out_sent, IOV_BATCH);
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len() as _;
        let entry = opcode::SendMsg::new(types::Fd(fd), msg as *const libc::msghdr)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build();
        st.send_armed = true;
        // SAFETY: the msghdr, the iovecs and every buffer they point at live in the
        // connection's state (the output queue never reallocates: it was reserved for
        // MAX_PENDING segments) and stay untouched until this SQE completes; the
        // connection is not freed while an SQE is in flight.
        unsafe {
            self.core
                .push_sqe(self.user.get(), (u64::from(conn.index) << 8) | SEND, entry)
        };
    }

    /// Encrypts waiting replies (a batch of at most `TLS_BATCH` bytes, so that the
    /// ciphertext of a client that does not read stays small) and sends the ciphertext.
    pub(super) fn push_send_tls(&self, conn: &Conn, st: &mut ConnState, fd: RawFd) {
        let ConnState {
            out,
            out_sent,
            pool,
            tls,
            ..
        } = st;
        let Some(t) = tls.as_mut() else { return };
        let filled = t.out.fill(&mut t.conn, out, out_sent, TLS_BATCH, |seg| {
            if let Some(b) = seg.buf {
                pool.put(b);
            }
        });
        if filled.is_err() {
            st.end("a TLS error");
            st.dead = true;
            return;
        }
        let Some(entry) = t.out.send_entry(fd) else {
            return;
        };
        st.send_armed = true;
        // SAFETY: the ciphertext buffer is not touched (no more is encrypted into it)
        // until this SQE completes, and the connection is not freed while an SQE is in
        // flight.
        unsafe {
            self.core
                .push_sqe(self.user.get(), (u64::from(conn.index) << 8) | SEND, entry)
        };
    }

    /// `res` bytes of the output went out (or sending failed).
    pub(super) fn sent(&self, conn: &Conn, res: i32) {
        let mut st = conn.st.borrow_mut();
        st.send_armed = false;
        st.counts.sends += 1;
        st.counts.send_bytes += res.max(0) as u64;
        if res < 0 {
            if res != -libc::EPIPE && res != -libc::ECONNRESET {
                log::warn!(
                    "cairn: serve: {}: send failed: {}",
                    conn.peer,
                    std::io::Error::from_raw_os_error(-res)
                );
            }
            st.end("send failed");
            st.dead = true;
        } else if let Some(t) = st.tls.as_mut() {
            t.out.sent(res as usize);
        } else {
            let ConnState {
                out,
                out_sent,
                pool,
                ..
            } = &mut *st;
            gather::consume(out, out_sent, res as usize, |seg| {
                if let Some(b) = seg.buf {
                    pool.put(b);
                }
            });
        }
        let was_blocked = std::mem::replace(&mut st.blocked, false);
        self.mark_dirty(conn, &mut st);
        drop(st);
        if was_blocked {
            self.process(conn);
        }
    }
}
