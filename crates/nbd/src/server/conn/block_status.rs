//! `NBD_CMD_BLOCK_STATUS`: the device's allocation map as `base:allocation` descriptors.

use crate::proto;
use crate::proto::command::Wide;
use crate::proto::{cflags, chunk, errno};

use super::reply::Seg;
use super::{Conn, ConnState, Next, ServerLoop, MAX_EXTENTS};

impl ServerLoop {
    /// Answers a block status request from the device's allocation map.
    /// The request's header is consumed here, once its reply has memory.
    pub(super) fn block_status(&self, conn: &Conn, st: &mut ConnState, r: &proto::Request) -> Next {
        let device = &self.exports[conn.export].device;
        let mut extents = Vec::new();
        // Unaligned (only from a relaxed client): ask about the whole blocks, then drop
        // the bytes before the request's start.
        let w = Wide::new(r.offset, r.len, u64::from(conn.terms.geometry.block_bytes));
        if let Err(e) = device.extents(w.offset, w.len, &mut extents) {
            if !st.warned {
                // Once per connection: a client asking again does not flood the log.
                st.warned = true;
                log::warn!("cairn: serve: {}: block status: {e}", conn.peer);
            }
            st.rs += conn.header_len();
            self.reply_error(conn, st, r.command, (r.cookie, r.offset), errno::EIO);
            return Next::Again;
        }
        if extents.is_empty() {
            extents.push(cairn_core::Extent::data(w.len));
        }
        let mut skip = w.head;
        extents.retain_mut(|e| {
            let cut = e.len.min(skip);
            skip -= cut;
            e.len -= cut;
            e.len > 0
        });
        let most = if r.flags & cflags::REQ_ONE != 0 {
            1
        } else {
            MAX_EXTENTS
        };
        let extended = conn.session.extended;
        let body = status_descriptors(&extents, r.len, most, extended);
        // Bounded by MAX_EXTENTS, so it may go over the pool's limit once.
        let mut buf = st.pool.get_always(body.len());
        if !st.pool.ensure(&mut buf, body.len()) {
            st.pool.put(buf);
            st.recounted = true;
            return self.wait_memory(conn, st);
        }
        st.rs += conn.header_len();
        buf.as_mut_slice()[..body.len()].copy_from_slice(&body);
        let mut head = [0u8; 40];
        let head_len = if extended {
            head[..32].copy_from_slice(&proto::extended_chunk_header(
                chunk::FLAG_DONE,
                chunk::BLOCK_STATUS_EXT,
                r.cookie,
                r.offset,
                body.len() as u64,
            ));
            32
        } else {
            head[..20].copy_from_slice(&proto::chunk_header(
                chunk::FLAG_DONE,
                chunk::BLOCK_STATUS,
                r.cookie,
                body.len() as u32,
            ));
            20
        };
        st.out.push_back(Seg {
            head,
            head_len,
            buf: Some(buf),
            data_off: 0,
            data_len: body.len() as u32,
        });
        Next::Again
    }
}

/// The body of a `base:allocation` block status reply for a request of `len` bytes:
/// the context id, then one descriptor per extent (at most `most`), none running past
/// the request. Compact descriptors are (u32 length, u32 flags), each at most 4 GiB less
/// 4 KiB; extended ones follow a count and are (u64 length, u64 flags). An extent cut
/// short ends the list: the rest is for the client to ask again.
fn status_descriptors(
    extents: &[cairn_core::Extent],
    len: u64,
    most: usize,
    extended: bool,
) -> Vec<u8> {
    let per = if extended { 16 } else { 8 };
    let mut body = Vec::with_capacity(8 + per * extents.len().min(most));
    body.extend_from_slice(&proto::BASE_ALLOCATION_ID.to_be_bytes());
    if extended {
        body.extend_from_slice(&0u32.to_be_bytes()); // the count, filled in below
    }
    let longest = if extended {
        u64::MAX
    } else {
        u64::from(u32::MAX) & !4095
    };
    let (mut covered, mut count) = (0u64, 0u32);
    for (n, e) in extents.iter().enumerate() {
        if covered >= len || n == most || e.len == 0 {
            break;
        }
        let l = e.len.min(len - covered).min(longest);
        let mut flags = 0;
        if e.hole {
            flags |= proto::state::HOLE;
        }
        if e.zero {
            flags |= proto::state::ZERO;
        }
        if extended {
            body.extend_from_slice(&l.to_be_bytes());
            body.extend_from_slice(&u64::from(flags).to_be_bytes());
        } else {
            body.extend_from_slice(&(l as u32).to_be_bytes());
            body.extend_from_slice(&flags.to_be_bytes());
        }
        covered += l;
        count += 1;
        if l < e.len {
            break;
        }
    }
    if extended {
        body[4..8].copy_from_slice(&count.to_be_bytes());
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_core::Extent;

    /// (length, flags) pairs of a body, compact or extended.
    fn parse(body: &[u8], extended: bool) -> Vec<(u64, u32)> {
        let be32 = |b: &[u8]| u32::from_be_bytes(b.try_into().unwrap());
        let be64 = |b: &[u8]| u64::from_be_bytes(b.try_into().unwrap());
        assert_eq!(be32(&body[..4]), proto::BASE_ALLOCATION_ID);
        if extended {
            let count = be32(&body[4..8]) as usize;
            let d: Vec<_> = body[8..]
                .chunks(16)
                .map(|c| (be64(&c[..8]), be64(&c[8..]) as u32))
                .collect();
            assert_eq!(d.len(), count);
            d
        } else {
            body[4..]
                .chunks(8)
                .map(|c| (u64::from(be32(&c[..4])), be32(&c[4..])))
                .collect()
        }
    }

    #[test]
    fn descriptors_stop_at_the_request_and_at_the_limit() {
        let (hole, zero) = (proto::state::HOLE, proto::state::ZERO);
        let map = [
            Extent::data(8192),
            Extent::hole(4096),
            Extent::data(1 << 20),
        ];
        for extended in [false, true] {
            let all = parse(
                &status_descriptors(&map, 1 << 30, 1 << 16, extended),
                extended,
            );
            assert_eq!(all, [(8192, 0), (4096, hole | zero), (1 << 20, 0)]);
            // The last descriptor ends with the request.
            let cut = parse(
                &status_descriptors(&map, 12288 + 100, 1 << 16, extended),
                extended,
            );
            assert_eq!(cut, [(8192, 0), (4096, hole | zero), (100, 0)]);
            // REQ_ONE: one descriptor.
            let one = parse(&status_descriptors(&map, 1 << 30, 1, extended), extended);
            assert_eq!(one, [(8192, 0)]);
        }
    }

    #[test]
    fn compact_descriptors_fit_32_bits_and_end_the_list_when_cut() {
        let map = [Extent::data(8 << 30), Extent::hole(4096)];
        let compact = parse(&status_descriptors(&map, 16 << 30, 1 << 16, false), false);
        assert_eq!(compact, [(u64::from(u32::MAX) & !4095, 0)]);
        let extended = parse(&status_descriptors(&map, 16 << 30, 1 << 16, true), true);
        assert_eq!(extended.len(), 2);
        assert_eq!(extended[0], (8 << 30, 0));
    }
}
