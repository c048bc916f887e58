//! Bytes from the socket: the receive SQE (into the input buffer, straight into a read's
//! buffer when much of it is missing, or into the TLS ciphertext buffer), what a
//! completed receive means, and TLS input decrypted into the input buffer.

use std::os::fd::RawFd;

use io_uring::{opcode, types};

use super::{Conn, Link, NbdQueue, Rx, State, DIRECT_MIN, INBUF, RAW_IN, RECV};

impl NbdQueue {
    pub(super) fn push_recv(&self, c: &mut Conn, ci: usize, fd: RawFd) {
        // Straight into a read's buffer only when much of it is missing: small replies
        // come many to a receive through the input buffer (a 4 KiB copy costs less than a
        // receive of its own).
        let direct = matches!(c.rx, Rx::Data { left, .. } if left >= DIRECT_MIN) && c.rs == c.re;
        let (ptr, len) = match c.rx {
            Rx::Data { dst, left, .. } if direct => (dst, left),
            _ => {
                if c.rs == c.re {
                    c.rs = 0;
                    c.re = 0;
                } else if c.re == c.inbuf.len() || c.rs > INBUF / 2 {
                    c.inbuf.copy_within(c.rs..c.re, 0);
                    c.re -= c.rs;
                    c.rs = 0;
                }
                let re = c.re;
                (c.inbuf[re..].as_mut_ptr(), c.inbuf.len() - re)
            }
        };
        let entry =
            opcode::Recv::new(types::Fd(fd), ptr, len.min(u32::MAX as usize) as u32).build();
        c.recv_armed = true;
        c.recv_direct = direct;
        // SAFETY: the target (the input buffer, or the read's buffer, which its submitter
        // keeps until the completion) is not touched until this SQE completes.
        unsafe {
            self.core
                .push_sqe(self.user.get(), ((ci as u64) << 8) | RECV, entry)
        };
    }

    pub(super) fn push_recv_tls(&self, c: &mut Conn, ci: usize, fd: RawFd) {
        let Some(t) = c.tls.as_mut() else { return };
        let entry = opcode::Recv::new(types::Fd(fd), t.raw_in.as_mut_ptr(), RAW_IN as u32).build();
        c.recv_armed = true;
        c.recv_direct = false;
        // SAFETY: the ciphertext buffer belongs to the connection and is not touched until
        // this SQE completes.
        unsafe {
            self.core
                .push_sqe(self.user.get(), ((ci as u64) << 8) | RECV, entry)
        };
    }

    pub(super) fn received(&self, st: &mut State, ci: usize, res: i32) {
        let c = &mut st.conns[ci];
        c.recv_armed = false;
        if c.link != Link::Up {
            self.mark_dirty(st, ci);
            return;
        }
        if res == -libc::EINTR || res == -libc::EAGAIN {
            self.mark_dirty(st, ci);
            return;
        }
        if res <= 0 {
            let why = if res == 0 {
                "the server closed the connection"
            } else {
                "a receive failed"
            };
            self.kill(st, ci, why);
            return;
        }
        c.progress_ns = self.core.now_ns();
        let n = res as usize;
        if let Some(t) = c.tls.as_mut() {
            t.raw_pos = 0;
            t.raw_len = n;
            self.tls_input(st, ci);
            self.mark_dirty(st, ci);
            return;
        }
        if c.recv_direct {
            self.data_landed(st, ci, n);
        } else {
            c.re += n;
        }
        self.parse(st, ci);
        self.mark_dirty(st, ci);
    }

    /// Gives received ciphertext to rustls and parses the plaintext, as much as the input
    /// buffer takes at a time.
    pub(super) fn tls_input(&self, st: &mut State, ci: usize) {
        use std::io::Read;
        loop {
            let Conn {
                tls, inbuf, rs, re, ..
            } = &mut st.conns[ci];
            let Some(t) = tls.as_mut() else { return };
            while t.raw_pos < t.raw_len {
                let mut rd = &t.raw_in[t.raw_pos..t.raw_len];
                match t.conn.read_tls(&mut rd) {
                    Ok(k) if k > 0 => t.raw_pos += k,
                    _ => break,
                }
                if let Err(e) = t.conn.process_new_packets() {
                    log::warn!(
                        "cairn: {}: TLS with {}: {e}",
                        self.shared.name,
                        self.shared.uri_text
                    );
                    self.kill(st, ci, "a TLS error");
                    return;
                }
            }
            if *rs == *re {
                (*rs, *re) = (0, 0);
            } else if *re == inbuf.len() && *rs > 0 {
                inbuf.copy_within(*rs..*re, 0);
                *re -= *rs;
                *rs = 0;
            }
            let mut got = false;
            if *re < inbuf.len() {
                match t.conn.reader().read(&mut inbuf[*re..]) {
                    Ok(0) => {
                        self.kill(st, ci, "the server closed the TLS session");
                        return;
                    }
                    Ok(k) => {
                        *re += k;
                        got = true;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(_) => {
                        self.kill(st, ci, "a TLS error");
                        return;
                    }
                }
            }
            let wants_write = t.conn.wants_write();
            if wants_write {
                self.mark_dirty(st, ci);
            }
            self.parse(st, ci);
            if !got || st.conns[ci].link != Link::Up {
                return;
            }
        }
    }
}
