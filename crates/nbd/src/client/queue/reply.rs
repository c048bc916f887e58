//! Replies: reply headers parsed from the input buffer (simple replies, structured and
//! extended chunks), matched to their request by cookie, read data landed in the read's
//! buffer, errors and protocol violations; then a part's completion, which accounts for
//! writes acknowledged and flushes that cover them.

use cairn_core::IoFlags;

use crate::proto::{self, chunk, cmd};

use super::{Link, NbdQueue, Req, Rx, State, MAX_SMALL};

impl NbdQueue {
    /// Parses every complete reply in connection `ci`'s input.
    pub(super) fn parse(&self, st: &mut State, ci: usize) {
        loop {
            let c = &mut st.conns[ci];
            if c.link != Link::Up {
                return;
            }
            match c.rx {
                Rx::Data { dst, left, .. } => {
                    let n = left.min(c.re - c.rs);
                    if n > 0 {
                        // SAFETY: dst has `left` bytes of the read's buffer left, which
                        // the submitter keeps until the completion.
                        unsafe { std::ptr::copy_nonoverlapping(c.inbuf[c.rs..].as_ptr(), dst, n) };
                        c.rs += n;
                    }
                    if !self.data_landed(st, ci, n) {
                        return;
                    }
                }
                Rx::Header => {
                    if !self.parse_header(st, ci) {
                        return;
                    }
                }
            }
        }
    }

    /// `n` more bytes of the read data being received are in its buffer: move on, and
    /// finish the part once its reply is complete. Whether all of the data is there.
    pub(super) fn data_landed(&self, st: &mut State, ci: usize, n: usize) -> bool {
        let c = &mut st.conns[ci];
        let Rx::Data {
            req,
            dst,
            left,
            done,
        } = c.rx
        else {
            return true;
        };
        if n < left {
            // SAFETY: n < left, inside the same buffer.
            let dst = unsafe { dst.add(n) };
            c.rx = Rx::Data {
                req,
                dst,
                left: left - n,
                done,
            };
            return false;
        }
        c.rx = Rx::Header;
        if done {
            self.part_done(st, req, 0);
        }
        true
    }

    /// Handles the reply header at the start of the input, if it is all there; whether
    /// it was (and parsing can go on).
    pub(super) fn parse_header(&self, st: &mut State, ci: usize) -> bool {
        let c = &st.conns[ci];
        let input = &c.inbuf[c.rs..c.re];
        let (h, size) = match proto::parse_reply(input, c.extended) {
            proto::DecodedReply::Incomplete => return false,
            proto::DecodedReply::Bad(m) => {
                self.violation(st, ci, None, "a reply with a bad magic number", m.into());
                return false;
            }
            proto::DecodedReply::Header(h, size) => (h, size),
        };
        match h {
            proto::ReplyHeader::Simple { error, cookie } => {
                let Some(r) = self.request_of(st, ci, cookie) else {
                    return false;
                };
                self.simple_reply(st, ci, r, size, error);
                true
            }
            proto::ReplyHeader::Chunk {
                flags,
                kind,
                cookie,
                len,
                ..
            } => {
                let Some(r) = self.request_of(st, ci, cookie) else {
                    return false;
                };
                let ch = Chunk {
                    r,
                    size,
                    kind,
                    len,
                    done: flags & chunk::FLAG_DONE != 0,
                };
                if kind == chunk::OFFSET_DATA {
                    self.data_chunk(st, ci, ch)
                } else {
                    self.small_chunk(st, ci, ch)
                }
            }
        }
    }

    /// The NBD request a reply on connection `ci` answers, from its cookie (see
    /// `frame`); a cookie that no request in flight on this connection has is a protocol
    /// violation.
    fn request_of(&self, st: &mut State, ci: usize, cookie: u64) -> Option<u32> {
        let r = (cookie & 0xffff_ffff) as usize;
        let gen = (cookie >> 32) as u16;
        let known = cookie >> 48 == 0
            && st
                .reqs
                .get(r)
                .is_some_and(|q| q.in_use && q.gen == gen && q.conn == ci as u16);
        if !known {
            self.violation(st, ci, None, "a reply with a cookie no request has", cookie);
            return None;
        }
        Some(r as u32)
    }

    /// A simple reply to `r`, whose header (`size` bytes) is consumed: an error, or a
    /// read's data to receive next, or the part done.
    fn simple_reply(&self, st: &mut State, ci: usize, r: u32, size: usize, error: u32) {
        let q = st.reqs[r as usize];
        st.conns[ci].rs += size;
        if error != 0 {
            self.part_error(st, r, error);
        } else if q.command == cmd::READ {
            let s = &st.ios[q.slot as usize];
            // SAFETY: the part lies inside the request's range and buffer.
            let dst = unsafe { s.io.buf.add((q.offset - s.io.offset) as usize) };
            st.reqs[r as usize].covered = q.len;
            st.conns[ci].rx = Rx::Data {
                req: r,
                dst,
                left: q.len as usize,
                done: true,
            };
        } else {
            self.part_done(st, r, 0);
        }
    }

    /// An `OFFSET_DATA` chunk: once its offset is in, the data that follows is received
    /// into the read's buffer (see `Rx::Data`). Whether parsing can go on.
    fn data_chunk(&self, st: &mut State, ci: usize, ch: Chunk) -> bool {
        let (r, size, len) = (ch.r, ch.size, ch.len);
        let q = st.reqs[r as usize];
        if q.command != cmd::READ || len < 8 || len - 8 > q.len {
            self.violation(
                st,
                ci,
                Some(r),
                "a data chunk that does not fit its read",
                len,
            );
            return false;
        }
        let c = &mut st.conns[ci];
        if c.re - c.rs < size + 8 {
            return false;
        }
        let offset = proto::be64(&c.inbuf[c.rs + size..c.rs + size + 8]);
        let n = len - 8;
        if !inside(&q, offset, n) {
            self.violation(st, ci, Some(r), "a data chunk outside its read", offset);
            return false;
        }
        c.rs += size + 8;
        let s = &st.ios[q.slot as usize];
        // SAFETY: [offset, offset + n) lies inside the part, so inside the buffer.
        let dst = unsafe { s.io.buf.add((offset - s.io.offset) as usize) };
        st.reqs[r as usize].covered += n;
        st.conns[ci].rx = Rx::Data {
            req: r,
            dst,
            left: n as usize,
            done: ch.done,
        };
        true
    }

    /// Any chunk but `OFFSET_DATA`: small, and handled whole from the input buffer once
    /// it is all there (a `NONE` that ends the reply, a hole, an error). Whether parsing
    /// can go on.
    fn small_chunk(&self, st: &mut State, ci: usize, ch: Chunk) -> bool {
        let (r, size, len) = (ch.r, ch.size, ch.len);
        if len > MAX_SMALL {
            self.violation(st, ci, Some(r), "an oversized reply chunk", len);
            return false;
        }
        let q = st.reqs[r as usize];
        let c = &st.conns[ci];
        if c.re - c.rs < size + len as usize {
            return false;
        }
        let p = &c.inbuf[c.rs + size..c.rs + size + len as usize];
        let mut error = 0u32;
        match ch.kind {
            chunk::NONE if len == 0 && ch.done => {}
            chunk::OFFSET_HOLE if q.command == cmd::READ && len == 12 => {
                let offset = proto::be64(&p[0..8]);
                let n = u64::from(proto::be32(&p[8..12]));
                if !self.hole(st, ci, r, offset, n) {
                    return false;
                }
            }
            k if k & (1 << 15) != 0 && len >= 6 => {
                error = proto::be32(&p[0..4]);
                if error == 0 {
                    error = proto::errno::EIO;
                }
            }
            k => {
                self.violation(st, ci, Some(r), "an unexpected reply chunk", k.into());
                return false;
            }
        }
        st.conns[ci].rs += size + len as usize;
        if error != 0 && !self.chunk_error(st, ci, r, error) {
            return false;
        }
        if ch.done {
            self.part_done(st, r, 0);
        }
        true
    }

    /// An `OFFSET_HOLE` chunk of read `r`: zeroes over `[offset, offset + n)`, which must
    /// lie inside the read. Whether it did.
    fn hole(&self, st: &mut State, ci: usize, r: u32, offset: u64, n: u64) -> bool {
        let q = st.reqs[r as usize];
        if !inside(&q, offset, n) {
            self.violation(st, ci, Some(r), "a hole chunk outside its read", offset);
            return false;
        }
        let s = &st.ios[q.slot as usize];
        // SAFETY: inside the part, so inside the buffer.
        unsafe {
            std::ptr::write_bytes(s.io.buf.add((offset - s.io.offset) as usize), 0, n as usize)
        };
        st.reqs[r as usize].covered += n;
        true
    }

    /// An error chunk for `r`: recorded now, the part ends with its last chunk; a server
    /// shutting down gives the connection up (the part is sent again on the next one).
    /// Whether parsing can go on.
    fn chunk_error(&self, st: &mut State, ci: usize, r: u32, error: u32) -> bool {
        let slot = st.reqs[r as usize].slot as usize;
        if st.ios[slot].error == 0 {
            st.ios[slot].error = proto::errno::to_local(error);
        }
        if error == proto::errno::ESHUTDOWN {
            self.kill(st, ci, "the server is shutting down");
            return false;
        }
        true
    }

    pub(super) fn part_error(&self, st: &mut State, r: u32, error: u32) {
        let ci = st.reqs[r as usize].conn as usize;
        if error == proto::errno::ESHUTDOWN {
            // Not done by a server that is going away: sent again on the next connection.
            self.kill(st, ci, "the server is shutting down");
            return;
        }
        self.part_done(st, r, proto::errno::to_local(error));
    }

    /// The server broke the protocol: the request it concerns (if known) fails with
    /// EIO and is not retried; the connection is given up. The failure is delivered when
    /// the connection is reset, once no send still reads the request's buffer.
    pub(super) fn violation(
        &self,
        st: &mut State,
        ci: usize,
        r: Option<u32>,
        what: &str,
        value: u64,
    ) {
        log::warn!(
            "cairn: {}: {} sent {what} ({value:#x})",
            self.shared.name,
            self.shared.uri_text
        );
        if let Some(r) = r {
            let slot = st.reqs[r as usize].slot;
            st.ios[slot as usize].poisoned = true;
        }
        self.kill(st, ci, "a protocol error");
    }

    /// A reply part for `r` is complete with `errno` (0: success).
    pub(super) fn part_done(&self, st: &mut State, r: u32, errno: i32) {
        let q = st.reqs[r as usize];
        let ci = q.conn as usize;
        st.reqs[r as usize].in_use = false;
        st.reqs[r as usize].gen = q.gen.wrapping_add(1);
        st.free_reqs.push(r);
        let era = st.era;
        let c = &mut st.conns[ci];
        c.outstanding -= 1;
        // Any reply: the connection was alive at the turnover its request was sent at.
        c.heard = c.heard.max(q.turnover);
        let slot = q.slot;
        let s = &mut st.ios[slot as usize];
        let mut errno = errno;
        if errno == 0 && q.command == cmd::READ && q.covered != q.len {
            errno = libc::EIO;
            log::warn!(
                "cairn: {}: a read reply from {} covered {} of {} bytes",
                self.shared.name,
                self.shared.uri_text,
                q.covered,
                q.len
            );
        }
        if errno == 0 {
            match q.command {
                cmd::WRITE | cmd::WRITE_ZEROES if !s.io.flags.contains(IoFlags::FUA) => {
                    c.acked_writes += 1;
                    c.unflushed_era = era;
                }
                cmd::FLUSH => c.flushed_writes = c.flushed_writes.max(q.covers),
                _ => {}
            }
        }
        // Published before the request completes: whoever learns of the write can see
        // that it is not flushed yet.
        self.publish(st);
        let s = &mut st.ios[slot as usize];
        if s.error == 0 {
            s.error = errno;
        }
        s.outstanding -= 1;
        if s.outstanding == 0 && s.issued_all() {
            let e = s.error;
            self.finish(st, slot, e);
        } else if s.outstanding == 0 && s.tail_flush && s.conn == ci as u16 {
            if s.error != 0 {
                let e = s.error;
                self.finish(st, slot, e);
            } else {
                // The writes are acknowledged: now their flush.
                st.conns[ci].ready.push_back(slot);
            }
        }
        // A request slot came free: more parts may go.
        if !st.conns[ci].ready.is_empty() {
            self.issue(st, ci);
        }
        for other in 0..st.conns.len() {
            if other != ci && !st.conns[other].ready.is_empty() {
                self.issue(st, other);
            }
        }
    }
}

/// A structured or extended reply chunk's header, as the parser needs it.
#[derive(Clone, Copy)]
struct Chunk {
    /// The NBD request it answers.
    r: u32,
    /// Bytes of the header.
    size: usize,
    /// Its type (`proto::chunk`).
    kind: u16,
    /// Bytes of its payload.
    len: u64,
    /// The reply's last chunk.
    done: bool,
}

/// Whether `[offset, offset + n)`, from a server's reply, lies inside part `q`'s range
/// (an end beyond 2^64 does not).
fn inside(q: &Req, offset: u64, n: u64) -> bool {
    offset >= q.offset
        && offset
            .checked_add(n)
            .is_some_and(|end| end <= q.offset + q.len)
}
