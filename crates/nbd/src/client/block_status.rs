//! Block status for `Device::extents`, over a control connection of its own, blocking: it
//! is rare (qemu-img map and convert), and keeping it off the data connections keeps
//! their replies to reads and writes alone. The server's extents become cairn's, never
//! claiming a hole or zeroes for part of a block.

use std::fs::File;
use std::io::{Read, Write};
use std::sync::atomic::Ordering;
use std::time::Duration;

use cairn_core::Extent;

use crate::client::handshake::{self as client, Negotiated, Want};
use crate::proto;

use super::{NbdDevice, Shared};

impl NbdDevice {
    pub(super) fn control_status(&self, offset: u64, len: u64) -> std::io::Result<Vec<(u64, u32)>> {
        let s = &self.shared;
        let mut control = s.control.lock().unwrap_or_else(|e| e.into_inner());
        if control.is_none() {
            let want = Want {
                allocation: true,
                ..Shared::want()
            };
            let c = client::connect_any(&s.uri, want, s.handshake_timeout())
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            let file = File::from(c.fd);
            set_socket_timeout(&file, Duration::from_nanos(s.timeout_ns))?;
            let stream: Box<dyn Stream> = match c.tls {
                Some(tls) => Box::new(rustls::StreamOwned::new(*tls, file)),
                None => Box::new(file),
            };
            *control = Some((stream, c.neg));
        }
        let Some((file, n)) = control.as_mut() else {
            return Err(std::io::Error::other("no control connection"));
        };
        let cookie = s.control_cookie.fetch_add(1, Ordering::Relaxed);
        let r = block_status(file, n, cookie, offset, len);
        if r.as_ref().is_err_and(|e| e.raw_os_error().is_none()) {
            // The stream is in an unknown state: start again next time.
            *control = None;
        }
        r
    }
}

/// The control connection: a socket, or TLS over one.
pub(super) trait Stream: std::io::Read + std::io::Write + Send {}

impl<T: std::io::Read + std::io::Write + Send> Stream for T {}

/// Read and write timeouts on a blocking socket.
pub(super) fn set_socket_timeout(file: &File, d: Duration) -> std::io::Result<()> {
    use rustix::net::sockopt::{set_socket_timeout, Timeout};
    // Zero is no timeout, as for setsockopt itself.
    let d = (!d.is_zero()).then_some(d);
    for which in [Timeout::Recv, Timeout::Send] {
        set_socket_timeout(file, which, d)?;
    }
    Ok(())
}

/// Turns a server's extents (length, state flags) into cairn's for `[offset, offset +
/// len)`: clipped to the range, and never claiming a hole or zeroes for a partial block
/// (such an edge is reported as data).
pub(super) fn map_extents(
    got: &[(u64, u32)],
    offset: u64,
    len: u64,
    block: u32,
    out: &mut Vec<Extent>,
) {
    let block = u64::from(block);
    let end = offset + len;
    let mut pos = offset;
    for &(elen, flags) in got {
        if pos >= end || elen == 0 {
            break;
        }
        // A length from the server: it may reach beyond 2^64.
        let e = pos.saturating_add(elen).min(end);
        let hole = flags & proto::state::HOLE != 0;
        let zero = flags & proto::state::ZERO != 0;
        if !hole && !zero {
            Extent::push(out, Extent::data(e - pos));
        } else {
            let a = pos.next_multiple_of(block).min(e);
            let b = if e == end { e } else { e / block * block };
            if b > a {
                Extent::push(out, Extent::data(a - pos));
                Extent::push(
                    out,
                    Extent {
                        len: b - a,
                        hole,
                        zero,
                    },
                );
                Extent::push(out, Extent::data(e - b));
            } else {
                Extent::push(out, Extent::data(e - pos));
            }
        }
        pos = e;
    }
    if pos == offset {
        // A server that said nothing useful: all data is never wrong.
        Extent::push(out, Extent::data(len));
    }
}

/// Largest block status reply a client reads (a longer one is a broken server).
const MAX_STATUS_REPLY: u64 = 1 << 20;

/// Asks `base:allocation` (negotiated as `n.allocation_id`) about `[offset, offset + len)`
/// on a connection in transmission, blocking: the extents as (length, `proto::state`
/// flags), from `offset`, possibly fewer than asked for. `cookie` tags the request.
pub(super) fn block_status<S: Read + Write>(
    s: &mut S,
    n: &Negotiated,
    cookie: u64,
    offset: u64,
    len: u64,
) -> std::io::Result<Vec<(u64, u32)>> {
    let Some(id) = n.allocation_id else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "the server has no base:allocation",
        ));
    };
    s.write_all(&status_request(n, cookie, offset, len))?;
    let mut extents = Vec::new();
    loop {
        let (flags, kind, p) = read_chunk(s, n.extended, cookie)?;
        status_chunk(kind, &p, id, &mut extents)?;
        if flags & proto::chunk::FLAG_DONE != 0 {
            return Ok(extents);
        }
    }
}

/// The block status request: without extended headers, its length is cut to what 32
/// bits hold in whole blocks.
fn status_request(n: &Negotiated, cookie: u64, offset: u64, len: u64) -> Vec<u8> {
    let mut req = Vec::with_capacity(proto::EXTENDED_HEADER);
    if n.extended {
        proto::put_extended_request(&mut req, 0, proto::cmd::BLOCK_STATUS, cookie, offset, len);
    } else {
        let most = u64::from(u32::MAX) & !(u64::from(n.min_block.max(1)) - 1);
        proto::put_request(
            &mut req,
            &proto::Request {
                flags: 0,
                command: proto::cmd::BLOCK_STATUS,
                cookie,
                offset,
                len: len.min(most),
            },
        );
    }
    req
}

/// The next reply chunk to the request `cookie`: its flags, type and payload. A simple
/// reply (an error, or a success, which block status cannot have), a chunk for another
/// cookie or one too long is an error.
fn read_chunk(
    s: &mut impl Read,
    extended: bool,
    cookie: u64,
) -> std::io::Result<(u16, u16, Vec<u8>)> {
    let (flags, kind, got, plen) = match read_reply_header(s, extended)? {
        proto::ReplyHeader::Simple { error, cookie: c } => {
            if c != cookie {
                return Err(bad(format!(
                    "a reply for cookie {c} while {cookie} was asked"
                )));
            }
            if error == 0 {
                return Err(bad("a simple reply to block status".into()));
            }
            return Err(std::io::Error::from_raw_os_error(proto::errno::to_local(
                error,
            )));
        }
        proto::ReplyHeader::Chunk {
            flags,
            kind,
            cookie,
            len,
            ..
        } => (flags, kind, cookie, len),
    };
    if got != cookie {
        return Err(bad(format!(
            "a reply for cookie {got} while {cookie} was asked"
        )));
    }
    if plen > MAX_STATUS_REPLY {
        return Err(bad(format!("a block status chunk of {plen} bytes")));
    }
    let mut p = vec![0u8; plen as usize];
    s.read_exact(&mut p)?;
    Ok((flags, kind, p))
}

/// A reply header: a simple reply's length read first (an extended header's with
/// extended headers), then the rest of a chunk header if that is what it is.
pub(super) fn read_reply_header(
    s: &mut impl Read,
    extended: bool,
) -> std::io::Result<proto::ReplyHeader> {
    let mut head = [0u8; proto::EXTENDED_HEADER];
    let first = if extended {
        proto::EXTENDED_HEADER
    } else {
        proto::SIMPLE_REPLY
    };
    s.read_exact(&mut head[..first])?;
    let mut have = first;
    loop {
        match proto::parse_reply(&head[..have], extended) {
            proto::DecodedReply::Header(h, _) => return Ok(h),
            proto::DecodedReply::Bad(m) => return Err(bad(format!("bad reply magic {m:#x}"))),
            proto::DecodedReply::Incomplete if have < proto::CHUNK_HEADER => {
                s.read_exact(&mut head[have..proto::CHUNK_HEADER])?;
                have = proto::CHUNK_HEADER;
            }
            proto::DecodedReply::Incomplete => return Err(bad("a short reply header".into())),
        }
    }
}

/// A block status reply chunk of type `kind` and payload `p`: extents for context `id`
/// go to `extents` (those of other contexts are ignored); an error chunk is an error.
fn status_chunk(
    kind: u16,
    p: &[u8],
    id: u32,
    extents: &mut Vec<(u64, u32)>,
) -> std::io::Result<()> {
    match kind {
        proto::chunk::NONE => {}
        proto::chunk::BLOCK_STATUS if p.len() >= 4 && (p.len() - 4).is_multiple_of(8) => {
            if proto::be32(&p[0..4]) == id {
                for e in p[4..].chunks_exact(8) {
                    extents.push((u64::from(proto::be32(&e[0..4])), proto::be32(&e[4..8])));
                }
            }
        }
        proto::chunk::BLOCK_STATUS_EXT if p.len() >= 8 && (p.len() - 8).is_multiple_of(16) => {
            if proto::be32(&p[0..4]) == id {
                for e in p[8..].chunks_exact(16) {
                    extents.push((proto::be64(&e[0..8]), proto::be64(&e[8..16]) as u32));
                }
            }
        }
        k if k & (1 << 15) != 0 && p.len() >= 4 => {
            return Err(std::io::Error::from_raw_os_error(proto::errno::to_local(
                proto::be32(&p[0..4]),
            )))
        }
        k => {
            return Err(bad(format!(
                "an unexpected chunk of type {k} to block status"
            )))
        }
    }
    Ok(())
}

/// A reply that breaks the protocol.
fn bad(why: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, why)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_never_claim_partial_blocks() {
        let mut out = Vec::new();
        // data 1000, hole 5000, data to the end: the hole shrinks to whole blocks.
        map_extents(
            &[
                (1000, 0),
                (5000, proto::state::HOLE | proto::state::ZERO),
                (10_000, 0),
            ],
            0,
            8192,
            512,
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                Extent::data(1024),
                Extent::hole(5632 - 1024),
                Extent::data(8192 - 5632)
            ]
        );
        let total: u64 = out.iter().map(|e| e.len).sum();
        assert_eq!(total, 8192);
    }

    #[test]
    fn extents_clip_and_fall_back() {
        let mut out = Vec::new();
        map_extents(&[], 4096, 4096, 512, &mut out);
        assert_eq!(out, vec![Extent::data(4096)]);
        out.clear();
        map_extents(&[(1 << 40, proto::state::ZERO)], 0, 4096, 512, &mut out);
        assert_eq!(
            out,
            vec![Extent {
                len: 4096,
                hole: false,
                zero: true
            }]
        );
    }

    #[test]
    fn an_extent_longer_than_the_address_space_is_clipped() {
        // Extended headers carry 64-bit lengths: a server may claim anything.
        let mut out = Vec::new();
        let hole = proto::state::HOLE | proto::state::ZERO;
        map_extents(&[(100, 0), (u64::MAX, hole)], 0, 4096, 512, &mut out);
        assert_eq!(out, vec![Extent::data(512), Extent::hole(4096 - 512)]);
    }
}
