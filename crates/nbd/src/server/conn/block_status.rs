//! `NBD_CMD_BLOCK_STATUS`: one chunk per context the connection selected: the device's
//! allocation map as `base:allocation`, each dirty bitmap as `qemu:dirty-bitmap:NAME`.

use crate::proto;
use crate::proto::command::Wide;
use crate::proto::{cflags, chunk, errno};

use super::reply::Seg;
use super::{Conn, ConnState, Next, ServerLoop, MAX_EXTENTS};

impl ServerLoop {
    /// Answers a block status request from the device's allocation map and the
    /// connection's bitmaps. The request's header is consumed here, once its reply has
    /// memory.
    pub(super) fn block_status(&self, conn: &Conn, st: &mut ConnState, r: &proto::Request) -> Next {
        let most = if r.flags & cflags::REQ_ONE != 0 {
            1
        } else {
            MAX_EXTENTS
        };
        let mut bodies = Vec::with_capacity(1 + conn.bitmaps.len());
        if conn.session.base_allocation {
            match self.allocation_body(conn, r, most) {
                Ok(body) => bodies.push(body),
                Err(e) => {
                    if !st.warned {
                        // Once per connection: a client asking again does not flood the log.
                        st.warned = true;
                        log::warn!("cairn: serve: {}: block status: {e}", conn.peer);
                    }
                    st.rs += conn.header_len();
                    self.reply_error(conn, st, r.command, (r.cookie, r.offset), errno::EIO);
                    return Next::Again;
                }
            }
        }
        let mut runs = Vec::new();
        for (id, b) in &conn.bitmaps {
            runs.clear();
            b.runs(r.offset, r.len, most, &mut runs);
            let runs = runs
                .iter()
                .map(|&(n, dirty)| (n, if dirty { proto::state::DIRTY } else { 0 }));
            bodies.push(status_descriptors(
                *id,
                runs,
                r.len,
                most,
                conn.session.extended,
            ));
        }
        if bodies.is_empty() {
            // The decoder refuses BLOCK_STATUS without a context; never reached.
            st.rs += conn.header_len();
            self.reply_error(conn, st, r.command, (r.cookie, r.offset), errno::EINVAL);
            return Next::Again;
        }
        self.queue_chunks(conn, st, r, &bodies)
    }

    /// The `base:allocation` chunk's body: the device's extents as descriptors.
    fn allocation_body(
        &self,
        conn: &Conn,
        r: &proto::Request,
        most: usize,
    ) -> Result<Vec<u8>, cairn_core::Error> {
        let extents = self.allocation(conn, r)?;
        let runs = extents.iter().map(|e| {
            let mut flags = 0;
            if e.hole {
                flags |= proto::state::HOLE;
            }
            if e.zero {
                flags |= proto::state::ZERO;
            }
            (e.len, flags)
        });
        Ok(status_descriptors(
            proto::BASE_ALLOCATION_ID,
            runs,
            r.len,
            most,
            conn.session.extended,
        ))
    }

    /// Queues one chunk per body, the last flagged done: the first chunk's header in the
    /// segment's head, the rest (headers and bodies) in one buffer after it. Waits for
    /// buffer memory when the pool has none (the header is consumed only once it has).
    fn queue_chunks(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        r: &proto::Request,
        bodies: &[Vec<u8>],
    ) -> Next {
        let extended = conn.session.extended;
        let flags_of = |i: usize| {
            if i + 1 == bodies.len() {
                chunk::FLAG_DONE
            } else {
                0
            }
        };
        let head_bytes = if extended { 32 } else { 20 };
        let total: usize = bodies.iter().map(Vec::len).sum::<usize>()
            + head_bytes * bodies.len().saturating_sub(1);
        // Bounded by MAX_EXTENTS per context, so it may go over the pool's limit once.
        let mut buf = st.pool.get_always(total);
        if !st.pool.ensure(&mut buf, total) {
            st.pool.put(buf);
            st.recounted = true;
            return self.wait_memory(conn, st);
        }
        st.rs += conn.header_len();
        let mut head = [0u8; 40];
        let head_len = chunk_header(extended, flags_of(0), r, &bodies[0], &mut head);
        let data = buf.as_mut_slice();
        let mut at = 0;
        for (i, body) in bodies.iter().enumerate() {
            if i > 0 {
                at += usize::from(chunk_header(
                    extended,
                    flags_of(i),
                    r,
                    body,
                    &mut data[at..],
                ));
            }
            data[at..at + body.len()].copy_from_slice(body);
            at += body.len();
        }
        st.out.push_back(Seg {
            head,
            head_len,
            buf: Some(buf),
            data_off: 0,
            data_len: total as u32,
        });
        Next::Again
    }

    /// The device's allocation map for the request, from its first byte.
    fn allocation(
        &self,
        conn: &Conn,
        r: &proto::Request,
    ) -> Result<Vec<cairn_core::Extent>, cairn_core::Error> {
        let device = &conn.export.export.device;
        let mut extents = Vec::new();
        // Unaligned (only from a relaxed client): ask about the whole blocks, then drop
        // the bytes before the request's start.
        let w = Wide::new(r.offset, r.len, u64::from(conn.terms.geometry.block_bytes));
        device.extents(w.offset, w.len, &mut extents)?;
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
        Ok(extents)
    }
}

/// The body of a block status chunk for context `id` and a request of `len` bytes: the
/// id, then one descriptor per run (length, flags), at most `most`, none running past
/// the request. Compact descriptors are (u32 length, u32 flags), each at most 4 GiB less
/// 4 KiB; extended ones follow a count and are (u64 length, u64 flags). A run cut short
/// ends the list: the rest is for the client to ask again.
fn status_descriptors(
    id: u32,
    runs: impl Iterator<Item = (u64, u32)>,
    len: u64,
    most: usize,
    extended: bool,
) -> Vec<u8> {
    let per = if extended { 16 } else { 8 };
    let mut body = Vec::with_capacity(8 + per * most.min(64));
    body.extend_from_slice(&id.to_be_bytes());
    if extended {
        body.extend_from_slice(&0u32.to_be_bytes()); // the count, filled in below
    }
    let longest = if extended {
        u64::MAX
    } else {
        u64::from(u32::MAX) & !4095
    };
    let (mut covered, mut count) = (0u64, 0u32);
    for (n, (run, flags)) in runs.enumerate() {
        if covered >= len || n == most || run == 0 {
            break;
        }
        let l = run.min(len - covered).min(longest);
        if extended {
            body.extend_from_slice(&l.to_be_bytes());
            body.extend_from_slice(&u64::from(flags).to_be_bytes());
        } else {
            body.extend_from_slice(&(l as u32).to_be_bytes());
            body.extend_from_slice(&flags.to_be_bytes());
        }
        covered += l;
        count += 1;
        if l < run {
            break;
        }
    }
    if extended {
        body[4..8].copy_from_slice(&count.to_be_bytes());
    }
    body
}

/// Writes a block status chunk's header for `body` (extended or structured) at the start
/// of `out`: its length.
fn chunk_header(extended: bool, flags: u16, r: &proto::Request, body: &[u8], out: &mut [u8]) -> u8 {
    if extended {
        out[..32].copy_from_slice(&proto::extended_chunk_header(
            flags,
            chunk::BLOCK_STATUS_EXT,
            r.cookie,
            r.offset,
            body.len() as u64,
        ));
        32
    } else {
        out[..20].copy_from_slice(&proto::chunk_header(
            flags,
            chunk::BLOCK_STATUS,
            r.cookie,
            body.len() as u32,
        ));
        20
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_core::Extent;

    /// An allocation map as (length, flags) runs.
    fn runs(map: &[Extent]) -> impl Iterator<Item = (u64, u32)> + '_ {
        map.iter().map(|e| {
            let hole = if e.hole { proto::state::HOLE } else { 0 };
            let zero = if e.zero { proto::state::ZERO } else { 0 };
            (e.len, hole | zero)
        })
    }

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
                &status_descriptors(
                    proto::BASE_ALLOCATION_ID,
                    runs(&map),
                    1 << 30,
                    1 << 16,
                    extended,
                ),
                extended,
            );
            assert_eq!(all, [(8192, 0), (4096, hole | zero), (1 << 20, 0)]);
            // The last descriptor ends with the request.
            let cut = parse(
                &status_descriptors(
                    proto::BASE_ALLOCATION_ID,
                    runs(&map),
                    12288 + 100,
                    1 << 16,
                    extended,
                ),
                extended,
            );
            assert_eq!(cut, [(8192, 0), (4096, hole | zero), (100, 0)]);
            // REQ_ONE: one descriptor.
            let one = parse(
                &status_descriptors(proto::BASE_ALLOCATION_ID, runs(&map), 1 << 30, 1, extended),
                extended,
            );
            assert_eq!(one, [(8192, 0)]);
        }
    }

    #[test]
    fn dirty_runs_carry_their_context_id() {
        let runs = [(65536u64, 0u32), (131072, proto::state::DIRTY)];
        for extended in [false, true] {
            let body = status_descriptors(7, runs.iter().copied(), 100_000, 16, extended);
            assert_eq!(&body[..4], &7u32.to_be_bytes());
            let n = if extended { 8 + 2 * 16 } else { 4 + 2 * 8 };
            assert_eq!(body.len(), n);
        }
    }

    #[test]
    fn compact_descriptors_fit_32_bits_and_end_the_list_when_cut() {
        let map = [Extent::data(8 << 30), Extent::hole(4096)];
        let compact = parse(
            &status_descriptors(
                proto::BASE_ALLOCATION_ID,
                runs(&map),
                16 << 30,
                1 << 16,
                false,
            ),
            false,
        );
        assert_eq!(compact, [(u64::from(u32::MAX) & !4095, 0)]);
        let extended = parse(
            &status_descriptors(
                proto::BASE_ALLOCATION_ID,
                runs(&map),
                16 << 30,
                1 << 16,
                true,
            ),
            true,
        );
        assert_eq!(extended.len(), 2);
        assert_eq!(extended[0], (8 << 30, 0));
    }
}
