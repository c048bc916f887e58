//! A request's way out: taken into a slot (or a FIFO when every slot is busy), routed to
//! the connection least busy (or parked while none is up, or failed once they have been
//! down too long), split into NBD requests no larger than the server takes, each framed
//! into the connection's output queue; then its completion, once every part is answered.

use std::sync::atomic::Ordering;

use cairn_core::{Io, IoFlags, IoStatus, Op};

use crate::proto::{self, cmd, tflags};

use super::{range_of, IoSlot, Link, NbdQueue, Out, Req, State, NO_CONN};

impl NbdQueue {
    /// Takes a slot for `io` and routes it to a connection (or parks it, or fails it).
    pub(super) fn start(&self, st: &mut State, io: Io, start_ns: u64) {
        let Some(slot) = st.free_ios.pop() else {
            st.overflow.push_back((io, start_ns));
            return;
        };
        let shared = &*self.shared;
        st.ios[slot as usize] = IoSlot {
            io,
            start_ns,
            conn: NO_CONN,
            next: 0,
            tail_flush: self.ends_with_flush(&io),
            outstanding: 0,
            error: 0,
            poisoned: false,
            internal: false,
            in_use: true,
        };
        if io.op == Op::Flush && !shared.geometry.caps.flush {
            // Nothing to make durable that the server would not already have.
            self.finish(st, slot, 0);
            return;
        }
        if io.op.is_write() && shared.neg.flags & tflags::READ_ONLY != 0 {
            self.finish(st, slot, libc::EROFS);
            return;
        }
        self.route(st, slot);
    }

    pub(super) fn route(&self, st: &mut State, slot: u32) {
        let best = st
            .conns
            .iter()
            .enumerate()
            .filter(|(_, c)| c.link == Link::Up)
            .min_by_key(|(_, c)| c.outstanding as usize + c.ready.len())
            .map(|(i, _)| i);
        match best {
            Some(ci) => {
                st.ios[slot as usize].conn = ci as u16;
                st.conns[ci].ready.push_back(slot);
                self.issue(st, ci);
                // Its reply is now due: the timeout is watched.
                self.arm_tick(st);
            }
            None => {
                let now = self.core.now_ns();
                // Down too long, unless the server answered another connection since
                // (this queue's connector is woken by that and tries at once).
                let gone = st
                    .down_since
                    .is_some_and(|t| now.saturating_sub(t) > self.shared.timeout_ns)
                    && self.shared.ledger.connects.load(Ordering::SeqCst) == st.down_connects;
                if gone {
                    self.finish(st, slot, libc::EIO);
                } else {
                    st.ios[slot as usize].conn = NO_CONN;
                    st.parked.push_back(slot);
                    self.arm_tick(st);
                }
            }
        }
    }

    /// Sends the parts of requests waiting on connection `ci`, as far as request slots go.
    pub(super) fn issue(&self, st: &mut State, ci: usize) {
        if st.conns[ci].link != Link::Up {
            return;
        }
        let extended = st.conns[ci].extended;
        let now = self.core.now_ns();
        while let Some(&slot) = st.conns[ci].ready.front() {
            let s = &st.ios[slot as usize];
            if s.next >= range_of(&s.io) && s.outstanding > 0 {
                // A flush after writes (FUA emulated) goes only once they are
                // acknowledged: `part_done` puts the request back then.
                st.conns[ci].ready.pop_front();
                continue;
            }
            let Some(r) = st.free_reqs.pop() else { break };
            let s = &mut st.ios[slot as usize];
            let part = self.next_part(s, extended);
            let done_issuing = s.issued_all();
            self.frame(st, ci, slot, r, part, now);
            if done_issuing {
                st.conns[ci].ready.pop_front();
            }
        }
        self.mark_dirty(st, ci);
    }

    /// Takes the next part of request `s`, to go on a connection with (or without)
    /// extended headers: a piece of its range (see [`range_part`]), or the flush that
    /// ends it; FUA asked of the server when it takes it.
    fn next_part(&self, s: &mut IoSlot, extended: bool) -> Part {
        let shared = &*self.shared;
        let io = s.io;
        let max_range = if extended {
            u64::MAX
        } else {
            shared.max_compact_range
        };
        let mut part = if s.next < range_of(&io) {
            range_part(&io, s.next, shared.max_part, max_range)
        } else {
            s.tail_flush = false;
            Part {
                command: cmd::FLUSH,
                flags: 0,
                offset: 0,
                len: 0,
                data: None,
            }
        };
        if io.flags.contains(IoFlags::FUA)
            && io.op.is_write()
            && part.command != cmd::FLUSH
            && shared.neg.flags & tflags::SEND_FUA != 0
        {
            part.flags |= proto::cflags::FUA;
        }
        if part.command != cmd::FLUSH {
            s.next += part.len;
        }
        s.outstanding += 1;
        part
    }

    /// Records `part` of request `slot` as NBD request `r` on connection `ci`, and queues
    /// its header (and a write's payload) to be sent. The cookie is the NBD request's
    /// index with its generation above bit 32, so that a late reply to an earlier use of
    /// the same index is told apart.
    fn frame(&self, st: &mut State, ci: usize, slot: u32, r: u32, part: Part, now: u64) {
        let c = &mut st.conns[ci];
        let req = &mut st.reqs[r as usize];
        let gen = req.gen;
        *req = Req {
            slot,
            conn: ci as u16,
            command: part.command,
            offset: part.offset,
            len: part.len,
            covered: 0,
            covers: c.acked_writes,
            turnover: st.turnover,
            gen,
            in_use: true,
        };
        let cookie = u64::from(r) | (u64::from(gen) << 32);
        let mut head = [0u8; proto::EXTENDED_HEADER];
        let head_len = encode_request(
            &mut head,
            c.extended,
            part.flags,
            part.command,
            cookie,
            part.offset,
            part.len,
        );
        c.out.push_back(Out {
            head,
            head_len: head_len as u8,
            data: part.data.unwrap_or(std::ptr::null()),
            data_len: if part.data.is_some() {
                part.len as u32
            } else {
                0
            },
            req: r,
        });
        if c.outstanding == 0 {
            c.progress_ns = now;
        }
        c.outstanding += 1;
    }

    /// Whether `io` ends with a flush: it is one, or a write with FUA on a server that
    /// has no FUA (emulated by a flush after it).
    pub(super) fn ends_with_flush(&self, io: &Io) -> bool {
        io.op == Op::Flush
            || (self.shared.emulate_fua && io.op.is_write() && io.flags.contains(IoFlags::FUA))
    }

    /// Finishes a request: statistics, the completion, and its slot to a waiting one.
    pub(super) fn finish(&self, st: &mut State, slot: u32, mut errno: i32) {
        let s = st.ios[slot as usize];
        if s.internal {
            // The queue's own flush: what it found is in the connection's counters now.
            if let Some(c) = st.conns.get_mut(usize::from(s.conn)) {
                c.verifying = false;
            }
            self.free_slot(st, slot);
            return;
        }
        if s.io.op == Op::Flush {
            let ledger = &self.shared.ledger;
            let lost = ledger.losses.load(Ordering::Acquire);
            if lost > st.reported {
                if errno == 0 && lost > ledger.made_up.load(Ordering::Acquire) {
                    log::warn!(
                        "cairn: {}: flush fails: writes acknowledged but not flushed were on a connection to {} that was lost",
                        self.shared.name,
                        self.shared.uri_text
                    );
                    errno = libc::EIO;
                }
                if errno != 0 {
                    // Whoever sent it knows now.
                    st.reported = lost;
                }
            }
        }
        let status = IoStatus::from_result(-errno);
        self.stats.done(
            s.io.flags,
            s.io.op,
            s.io.len,
            s.start_ns,
            self.core.now_ns(),
            status.is_ok(),
        );
        self.core.complete(s.io.sink, s.io.token, status);
        self.free_slot(st, slot);
    }

    pub(super) fn free_slot(&self, st: &mut State, slot: u32) {
        st.ios[slot as usize].in_use = false;
        st.free_ios.push(slot);
        if let Some((io, start)) = st.overflow.pop_front() {
            self.start(st, io, start);
        }
    }
}

/// One NBD request of a cairn request: what `frame` puts on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Part {
    command: u16,
    flags: u16,
    offset: u64,
    len: u64,
    /// A write's payload (`len` bytes of the submitter's buffer).
    data: Option<*const u8>,
}

/// The piece of `io`'s range from `next` on that one NBD request carries: at most
/// `max_part` bytes of a read or write, at most `max_range` of a trim or write-zeroes.
/// A discard is a write-zeroes (cairn's discard promises zeroes, NBD's trim does not)
/// that may punch a hole.
fn range_part(io: &Io, next: u64, max_part: u64, max_range: u64) -> Part {
    debug_assert!(next < io.len, "a part of an unfinished range");
    let left = io.len - next;
    let offset = io.offset + next;
    let (command, flags, len, data) = match io.op {
        Op::Read => (cmd::READ, 0, left.min(max_part), None),
        Op::Write => {
            let len = left.min(max_part);
            // SAFETY: next < len, so the pointer stays inside the buffer.
            let p = unsafe { io.buf.add(next as usize) };
            (cmd::WRITE, 0, len, Some(p.cast_const()))
        }
        Op::Discard => (cmd::WRITE_ZEROES, 0, left.min(max_range), None),
        Op::WriteZeroes => {
            let f = if io.flags.contains(IoFlags::NO_HOLE) {
                proto::cflags::NO_HOLE
            } else {
                0
            };
            (cmd::WRITE_ZEROES, f, left.min(max_range), None)
        }
        Op::Flush => unreachable!("a flush has no range"),
    };
    Part {
        command,
        flags,
        offset,
        len,
        data,
    }
}

/// Encodes a request header into `head`; its length.
fn encode_request(
    head: &mut [u8; proto::EXTENDED_HEADER],
    extended: bool,
    flags: u16,
    command: u16,
    cookie: u64,
    offset: u64,
    len: u64,
) -> usize {
    let magic = if extended {
        proto::EXTENDED_REQUEST_MAGIC
    } else {
        proto::REQUEST_MAGIC
    };
    head[0..4].copy_from_slice(&magic.to_be_bytes());
    head[4..6].copy_from_slice(&flags.to_be_bytes());
    head[6..8].copy_from_slice(&command.to_be_bytes());
    head[8..16].copy_from_slice(&cookie.to_be_bytes());
    head[16..24].copy_from_slice(&offset.to_be_bytes());
    if extended {
        head[24..32].copy_from_slice(&len.to_be_bytes());
        proto::EXTENDED_HEADER
    } else {
        head[24..28].copy_from_slice(&(len as u32).to_be_bytes());
        proto::REQUEST_HEADER
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_core::SinkId;

    #[test]
    fn request_headers() {
        let mut h = [0u8; proto::EXTENDED_HEADER];
        let n = encode_request(&mut h, false, 1, cmd::WRITE, 7, 4096, 512);
        assert_eq!(n, proto::REQUEST_HEADER);
        assert_eq!(
            proto::parse_request(&h[..n]),
            proto::Decoded::Request(proto::Request {
                flags: 1,
                command: cmd::WRITE,
                cookie: 7,
                offset: 4096,
                len: 512
            })
        );
        let n = encode_request(&mut h, true, 0, cmd::TRIM, 9, 0, 5 << 30);
        assert_eq!(n, proto::EXTENDED_HEADER);
        let mut v = Vec::new();
        proto::put_extended_request(&mut v, 0, cmd::TRIM, 9, 0, 5 << 30);
        assert_eq!(&h[..], &v[..]);
    }

    #[test]
    fn parts_split_at_the_server_payload_and_the_compact_range() {
        let mut buf = vec![0u8; 40 << 20];
        let mut io = Io::nodata(Op::Write, 1 << 20, 40 << 20, SinkId(0), 0);
        io.buf = buf.as_mut_ptr();
        let first = range_part(&io, 0, 32 << 20, u64::MAX);
        assert_eq!(
            (first.command, first.offset, first.len),
            (cmd::WRITE, 1 << 20, 32 << 20)
        );
        assert_eq!(first.data, Some(buf.as_ptr()));
        let second = range_part(&io, 32 << 20, 32 << 20, u64::MAX);
        assert_eq!((second.offset, second.len), (33 << 20, 8 << 20));
        assert_eq!(second.data, Some(buf[32 << 20..].as_ptr()));
        // A discard beyond 32 bits without extended headers: a write-zeroes that may
        // punch a hole, at most the compact range.
        let compact = u64::from(u32::MAX) / 512 * 512;
        let io = Io::nodata(Op::Discard, 0, 5 << 30, SinkId(0), 0);
        let p = range_part(&io, 0, 32 << 20, compact);
        assert_eq!(
            (p.command, p.flags, p.len, p.data),
            (cmd::WRITE_ZEROES, 0, compact, None)
        );
        let mut io = Io::nodata(Op::WriteZeroes, 0, 4096, SinkId(0), 0);
        io.flags = IoFlags::NO_HOLE;
        let p = range_part(&io, 0, 32 << 20, compact);
        assert_eq!(
            (p.command, p.flags, p.len),
            (cmd::WRITE_ZEROES, proto::cflags::NO_HOLE, 4096)
        );
    }
}
