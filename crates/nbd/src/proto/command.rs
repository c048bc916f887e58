//! What a transmission request means: [`check`] turns a request header into a
//! [`Command`] the server can issue, or the [`Refusal`] to answer it with. It is a pure
//! function of the header, the [`Terms`] the session was negotiated on and whether the
//! server is shutting down: no buffers, no I/O, no state. So it is unit-tested and fuzzed
//! here on its own, and the connection only moves bytes.
//!
//! The checks run in a fixed order, which decides the errno a client sees for a request
//! that is wrong in more than one way: shutting down (ESHUTDOWN), the command and its
//! flags (EINVAL), a write to a read-only export (EPERM), a read or write over the
//! maximum payload (EINVAL), a flush's reserved fields or a length of 0 (EINVAL), then the
//! range and alignment (EINVAL, or ENOSPC for a write past the end), and last what the
//! export cannot do (block status without `base:allocation`: EINVAL; a fast zero it
//! cannot do fast: ENOTSUP).

use cairn_core::{Geometry, IoError, IoFlags, Op};

use super::{cflags, cmd, errno, tflags, Request};

/// What a session's requests are checked against; fixed when its handshake ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Terms {
    /// Transmission flags sent to the client (read-only, fast zero offered, ...).
    pub flags: u16,
    /// Structured replies are in use (a read may carry `NBD_CMD_FLAG_DF`).
    pub structured: bool,
    /// Extended headers are in use (a write may carry `NBD_CMD_FLAG_PAYLOAD_LEN`).
    pub extended: bool,
    /// A metadata context was selected (`base:allocation`, a dirty bitmap): block status
    /// is allowed.
    pub block_status: bool,
    /// Requests of any alignment are served, on the whole blocks around them: the client
    /// did not ask for block sizes and the export does not insist on them.
    pub relaxed: bool,
    /// The export zeroes fast, so a write-zeroes with `FAST_ZERO` is not refused.
    pub fast_zero: bool,
    /// Largest read or write accepted.
    pub max_payload: u32,
    /// The export's size, block size and capabilities.
    pub geometry: Geometry,
}

/// A request that passed every check: what to issue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// `NBD_CMD_DISC`: the client is leaving.
    Disconnect,
    /// `NBD_CMD_CACHE`: a hint, answered at once.
    Cache,
    /// `NBD_CMD_BLOCK_STATUS` over a range inside the export.
    BlockStatus,
    /// A read, write, flush, trim or write-zeroes on whole blocks inside the export (a
    /// flush at offset 0, length 0).
    Io {
        /// The device operation.
        op: Op,
        /// FUA for a write, NO_HOLE for a write-zeroes.
        flags: IoFlags,
        /// A trim or write-zeroes with FUA: flush after it, before the reply.
        then_flush: bool,
    },
    /// A read, write, trim or write-zeroes not aligned to the export's blocks (only on
    /// relaxed terms), served on the whole blocks around it.
    Unaligned {
        /// The device operation.
        op: Op,
        /// The request's range and the blocks around it (checked to be inside the export).
        wide: Wide,
    },
}

/// Why a request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Answer with this NBD errno.
    Errno(u32),
    /// A read or write longer than the maximum payload: EINVAL, worth a warning (a client
    /// that ignores the maximum).
    OverMaxPayload,
}

impl Refusal {
    /// The NBD errno to answer with.
    pub fn errno(self) -> u32 {
        match self {
            Refusal::Errno(e) => e,
            Refusal::OverMaxPayload => errno::EINVAL,
        }
    }
}

/// Bytes that follow request `r`'s header in the stream: a write's payload, or with
/// extended headers any command's that sets `PAYLOAD_LEN` (refused after it is skipped).
/// A write is taken with or without the flag: the extension's drafts differ, and qemu's
/// client leaves it out.
#[inline]
pub fn payload_len(r: &Request, extended: bool) -> u64 {
    if r.command == cmd::WRITE || (extended && r.flags & cflags::PAYLOAD_LEN != 0) {
        r.len
    } else {
        0
    }
}

/// Checks request `r` against the session's `terms` (see the module's documentation for
/// the order of the checks). While `shutting_down`, every request but a disconnect is
/// refused with ESHUTDOWN.
#[inline]
pub fn check(r: &Request, terms: &Terms, shutting_down: bool) -> Result<Command, Refusal> {
    let refuse = |e| Err(Refusal::Errno(e));
    if shutting_down {
        return match r.command {
            cmd::DISC => Ok(Command::Disconnect),
            _ => refuse(errno::ESHUTDOWN),
        };
    }
    let Some(allowed) = allowed_flags(r.command, terms) else {
        return refuse(errno::EINVAL);
    };
    if r.flags & !allowed != 0 {
        return refuse(errno::EINVAL);
    }
    let op = match r.command {
        cmd::DISC => return Ok(Command::Disconnect),
        cmd::READ => Op::Read,
        cmd::WRITE => Op::Write,
        cmd::FLUSH => Op::Flush,
        cmd::TRIM => Op::Discard,
        cmd::WRITE_ZEROES => Op::WriteZeroes,
        _ => Op::Read, // CACHE and BLOCK_STATUS: checked as reads
    };
    if terms.flags & tflags::READ_ONLY != 0 && op.is_write() {
        return refuse(errno::EPERM);
    }
    // Reads are bounded like writes: the advertised maximum is for both directions.
    if matches!(r.command, cmd::WRITE | cmd::READ) && r.len > u64::from(terms.max_payload) {
        return Err(Refusal::OverMaxPayload);
    }
    if op == Op::Flush {
        // A flush's offset and length are reserved: both must be 0.
        if r.offset != 0 || r.len != 0 {
            return refuse(errno::EINVAL);
        }
        return Ok(Command::Io {
            op,
            flags: IoFlags::NONE,
            then_flush: false,
        });
    }
    if r.len == 0 {
        // The spec leaves requests of length 0 open; like nbdkit, cairn refuses them.
        return refuse(errno::EINVAL);
    }
    match r.command {
        cmd::CACHE => check_range(r, terms).map(|()| Command::Cache),
        cmd::BLOCK_STATUS => {
            check_range(r, terms)?;
            if !terms.block_status {
                return refuse(errno::EINVAL);
            }
            Ok(Command::BlockStatus)
        }
        _ => check_io(r, terms, op),
    }
}

/// The flags command `command` may carry on these terms; `None` for an unknown command.
#[inline]
fn allowed_flags(command: u16, terms: &Terms) -> Option<u16> {
    Some(match command {
        cmd::READ if terms.structured => cflags::FUA | cflags::DF,
        cmd::READ => cflags::FUA,
        cmd::WRITE if terms.extended => cflags::FUA | cflags::PAYLOAD_LEN,
        cmd::WRITE | cmd::FLUSH | cmd::TRIM | cmd::CACHE => cflags::FUA,
        cmd::WRITE_ZEROES => {
            // On a read-only export FAST_ZERO is not offered, but the request is refused
            // for being a write (EPERM), as every write is there.
            let fast = terms.flags & (tflags::SEND_FAST_ZERO | tflags::READ_ONLY) != 0;
            cflags::FUA | cflags::NO_HOLE | if fast { cflags::FAST_ZERO } else { 0 }
        }
        cmd::BLOCK_STATUS => cflags::FUA | cflags::REQ_ONE,
        cmd::DISC => 0,
        _ => return None,
    })
}

/// A cache or block status request: like a read of any length, only the range and (on
/// strict terms) the alignment matter.
#[inline]
fn check_range(r: &Request, terms: &Terms) -> Result<(), Refusal> {
    let g = &terms.geometry;
    let block = u64::from(g.block_bytes);
    let inside = r
        .offset
        .checked_add(r.len)
        .is_some_and(|e| e <= g.size_bytes);
    if !inside
        || (!terms.relaxed && (!r.offset.is_multiple_of(block) || !r.len.is_multiple_of(block)))
    {
        return Err(Refusal::Errno(errno::EINVAL));
    }
    Ok(())
}

/// A read, write, trim or write-zeroes (of length > 0).
#[inline]
fn check_io(r: &Request, terms: &Terms, op: Op) -> Result<Command, Refusal> {
    let fua = r.flags & cflags::FUA != 0;
    if let Err(e) = terms.geometry.check(op, r.offset, r.len) {
        return match e {
            IoError::Misaligned { .. } if terms.relaxed => check_unaligned(r, terms, op),
            IoError::Unsupported(_) => Err(Refusal::Errno(errno::EINVAL)),
            e => Err(Refusal::Errno(errno::from_local(e.errno()))),
        };
    }
    if r.command == cmd::WRITE_ZEROES && r.flags & cflags::FAST_ZERO != 0 && !terms.fast_zero {
        return Err(Refusal::Errno(errno::ENOTSUP));
    }
    let mut flags = IoFlags::NONE;
    if fua && op == Op::Write {
        flags = flags.with(IoFlags::FUA);
    }
    if r.command == cmd::WRITE_ZEROES && r.flags & cflags::NO_HOLE != 0 {
        flags = flags.with(IoFlags::NO_HOLE);
    }
    Ok(Command::Io {
        op,
        flags,
        then_flush: fua && matches!(op, Op::Discard | Op::WriteZeroes),
    })
}

/// A request not aligned to the blocks, on relaxed terms: its range and the whole blocks
/// around it must be inside the export. Zeroing part of a block means writing it, so a
/// fast zero is refused.
#[cold]
fn check_unaligned(r: &Request, terms: &Terms, op: Op) -> Result<Command, Refusal> {
    let g = &terms.geometry;
    if r.offset.checked_add(r.len).is_none_or(|e| e > g.size_bytes) {
        let e = IoError::OutOfRange {
            op,
            offset: r.offset,
            len: r.len,
            size: g.size_bytes,
        };
        return Err(Refusal::Errno(errno::from_local(e.errno())));
    }
    let wide = Wide::new(r.offset, r.len, u64::from(g.block_bytes));
    if let Err(e) = g.check(op, wide.offset, wide.len) {
        return Err(Refusal::Errno(errno::from_local(e.errno())));
    }
    if r.command == cmd::WRITE_ZEROES && r.flags & cflags::FAST_ZERO != 0 {
        return Err(Refusal::Errno(errno::ENOTSUP));
    }
    Ok(Command::Unaligned { op, wide })
}

/// A request's byte range and the whole blocks around it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wide {
    /// First byte of the first block touched.
    pub offset: u64,
    /// Bytes of whole blocks from there to the end of the last block touched.
    pub len: u64,
    /// Where the request's bytes start in the widened range.
    pub head: u64,
    /// The request's length.
    pub inner: u64,
    /// The block size.
    pub block: u64,
}

impl Wide {
    /// `offset..offset + len` widened to multiples of `block` (a power of two). The caller
    /// has checked that the end does not overflow.
    pub fn new(offset: u64, len: u64, block: u64) -> Wide {
        let start = offset & !(block - 1);
        let end = (offset + len).next_multiple_of(block);
        Wide {
            offset: start,
            len: end - start,
            head: offset - start,
            inner: len,
            block,
        }
    }

    /// The edge blocks only partly covered by the request, as offsets into the widened
    /// range: none, one (the first or the last, or both when they are the same block) or
    /// two.
    pub fn edges(&self) -> ([u64; 2], usize) {
        let mut e = [0u64; 2];
        let mut n = 0;
        if self.head != 0 {
            e[n] = 0;
            n += 1;
        }
        let tail = self.len - self.block;
        if !(self.head + self.inner).is_multiple_of(self.block) && (n == 0 || tail != 0) {
            e[n] = tail;
            n += 1;
        }
        (e, n)
    }

    /// The whole blocks inside the request: (offset on the device, length), the length 0
    /// when there are none.
    pub fn whole(&self) -> (u64, u64) {
        let start = (self.offset + self.head).next_multiple_of(self.block);
        let end = (self.offset + self.head + self.inner) & !(self.block - 1);
        if end > start {
            (start, end - start)
        } else {
            (start, 0)
        }
    }

    /// The parts of the edge block at `at` (an offset into the widened range) that the
    /// request does not cover, as ranges of the widened range: what a read-modify-write
    /// keeps from the old block.
    pub fn kept(&self, at: u64) -> [(u64, u64); 2] {
        let (b0, b1) = (at, at + self.block);
        let (r0, r1) = (self.head, self.head + self.inner);
        [(b0, r0.clamp(b0, b1)), (r1.clamp(b0, b1), b1)]
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use cairn_core::Caps;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    fn terms() -> Terms {
        Terms {
            flags: tflags::HAS_FLAGS | tflags::SEND_FLUSH | tflags::SEND_FAST_ZERO,
            structured: true,
            extended: false,
            block_status: true,
            relaxed: false,
            fast_zero: true,
            max_payload: 32 << 20,
            geometry: Geometry {
                size_bytes: 64 * MIB,
                block_bytes: 4096,
                caps: Caps::ALL,
            },
        }
    }

    fn req(command: u16, flags: u16, offset: u64, len: u64) -> Request {
        Request {
            flags,
            command,
            cookie: 7,
            offset,
            len,
        }
    }

    fn errno_of(r: Result<Command, Refusal>) -> u32 {
        match r {
            Err(e) => e.errno(),
            Ok(c) => panic!("accepted: {c:?}"),
        }
    }

    #[test]
    fn plain_requests_become_device_operations() {
        let t = terms();
        let io = |op, flags, then_flush| {
            Ok(Command::Io {
                op,
                flags,
                then_flush,
            })
        };
        let fua = IoFlags::NONE.with(IoFlags::FUA);
        let c = |command, flags| check(&req(command, flags, 8192, 4096), &t, false);
        assert_eq!(c(cmd::READ, 0), io(Op::Read, IoFlags::NONE, false));
        // FUA on a read is allowed and means nothing.
        assert_eq!(
            c(cmd::READ, cflags::FUA),
            io(Op::Read, IoFlags::NONE, false)
        );
        assert_eq!(c(cmd::READ, cflags::DF), io(Op::Read, IoFlags::NONE, false));
        assert_eq!(c(cmd::WRITE, cflags::FUA), io(Op::Write, fua, false));
        // A trim or write-zeroes with FUA is followed by a flush.
        assert_eq!(
            c(cmd::TRIM, cflags::FUA),
            io(Op::Discard, IoFlags::NONE, true)
        );
        let no_hole = IoFlags::NONE.with(IoFlags::NO_HOLE);
        assert_eq!(
            c(cmd::WRITE_ZEROES, cflags::NO_HOLE | cflags::FAST_ZERO),
            io(Op::WriteZeroes, no_hole, false)
        );
        assert_eq!(
            check(&req(cmd::FLUSH, 0, 0, 0), &t, false),
            io(Op::Flush, IoFlags::NONE, false)
        );
        assert_eq!(c(cmd::CACHE, 0), Ok(Command::Cache));
        assert_eq!(
            c(cmd::BLOCK_STATUS, cflags::REQ_ONE),
            Ok(Command::BlockStatus)
        );
        // Block status and cache take any length inside the export.
        let big = req(cmd::BLOCK_STATUS, 0, 0, 64 * MIB);
        assert_eq!(check(&big, &t, false), Ok(Command::BlockStatus));
        assert_eq!(
            check(&req(cmd::DISC, 0, 0, 0), &t, false),
            Ok(Command::Disconnect)
        );
    }

    #[test]
    fn refusals_carry_the_spec_errno() {
        let t = terms();
        let e = |r: Request| errno_of(check(&r, &t, false));
        assert_eq!(e(req(99, 0, 0, 4096)), errno::EINVAL, "unknown command");
        assert_eq!(e(req(cmd::READ, cflags::NO_HOLE, 0, 4096)), errno::EINVAL);
        assert_eq!(e(req(cmd::DISC, cflags::FUA, 0, 0)), errno::EINVAL);
        // PAYLOAD_LEN only with extended headers.
        assert_eq!(
            e(req(cmd::WRITE, cflags::PAYLOAD_LEN, 0, 4096)),
            errno::EINVAL
        );
        assert_eq!(e(req(cmd::FLUSH, 0, 4096, 0)), errno::EINVAL);
        assert_eq!(e(req(cmd::FLUSH, 0, 0, 4096)), errno::EINVAL);
        assert_eq!(e(req(cmd::READ, 0, 0, 0)), errno::EINVAL, "length 0");
        assert_eq!(e(req(cmd::READ, 0, 512, 4096)), errno::EINVAL, "misaligned");
        assert_eq!(
            e(req(cmd::READ, 0, 64 * MIB, 4096)),
            errno::EINVAL,
            "past the end"
        );
        // A write past the end is ENOSPC, as the spec asks.
        assert_eq!(e(req(cmd::WRITE, 0, 64 * MIB, 4096)), errno::ENOSPC);
        assert_eq!(e(req(cmd::WRITE_ZEROES, 0, 64 * MIB, 4096)), errno::ENOSPC);
        assert_eq!(e(req(cmd::TRIM, 0, u64::MAX - 4095, 4096)), errno::EINVAL);
        assert_eq!(e(req(cmd::CACHE, 0, 0, 64 * MIB + 4096)), errno::EINVAL);
        assert_eq!(
            check(&req(cmd::READ, 0, 0, (32 << 20) + 4096), &t, false),
            Err(Refusal::OverMaxPayload)
        );
        // Block status without base:allocation, after its range was found good.
        let t2 = Terms {
            block_status: false,
            ..t
        };
        assert_eq!(
            errno_of(check(&req(cmd::BLOCK_STATUS, 0, 0, 4096), &t2, false)),
            errno::EINVAL
        );
        // A fast zero the export cannot do fast.
        let slow = Terms {
            fast_zero: false,
            ..t
        };
        let fz = req(cmd::WRITE_ZEROES, cflags::FAST_ZERO, 0, 4096);
        assert_eq!(errno_of(check(&fz, &slow, false)), errno::ENOTSUP);
        // What the device cannot do is EINVAL (the export did not offer it).
        let no_trim = Terms {
            geometry: Geometry {
                caps: Caps {
                    discard: false,
                    ..Caps::ALL
                },
                ..t.geometry
            },
            ..t
        };
        assert_eq!(
            errno_of(check(&req(cmd::TRIM, 0, 0, 4096), &no_trim, false)),
            errno::EINVAL
        );
    }

    #[test]
    fn read_only_exports_refuse_every_write_with_eperm() {
        let t = Terms {
            flags: tflags::HAS_FLAGS | tflags::READ_ONLY,
            ..terms()
        };
        for command in [cmd::WRITE, cmd::TRIM, cmd::WRITE_ZEROES] {
            assert_eq!(
                errno_of(check(&req(command, 0, 0, 4096), &t, false)),
                errno::EPERM
            );
        }
        // FAST_ZERO is not offered there, yet such a write is refused as a write.
        let fz = req(cmd::WRITE_ZEROES, cflags::FAST_ZERO, 0, 4096);
        assert_eq!(errno_of(check(&fz, &t, false)), errno::EPERM);
        assert!(check(&req(cmd::READ, 0, 0, 4096), &t, false).is_ok());
        assert!(check(&req(cmd::FLUSH, 0, 0, 0), &t, false).is_ok());
    }

    #[test]
    fn shutting_down_refuses_all_but_a_disconnect() {
        let t = terms();
        assert_eq!(
            errno_of(check(&req(cmd::READ, 0, 0, 4096), &t, true)),
            errno::ESHUTDOWN
        );
        assert_eq!(
            errno_of(check(&req(99, 0, 0, 0), &t, true)),
            errno::ESHUTDOWN
        );
        assert_eq!(
            check(&req(cmd::DISC, 0, 0, 0), &t, true),
            Ok(Command::Disconnect)
        );
        assert_eq!(
            check(&req(cmd::DISC, 1, 0, 0), &t, true),
            Ok(Command::Disconnect)
        );
    }

    #[test]
    fn unaligned_requests_on_relaxed_terms_are_widened() {
        let t = Terms {
            relaxed: true,
            ..terms()
        };
        let got = check(&req(cmd::WRITE, 0, 4100, 10), &t, false);
        assert_eq!(
            got,
            Ok(Command::Unaligned {
                op: Op::Write,
                wide: Wide::new(4100, 10, 4096)
            })
        );
        // The blocks around it must be inside the export.
        let end = 64 * MIB;
        assert_eq!(
            errno_of(check(&req(cmd::WRITE, 0, end - 10, 20), &t, false)),
            errno::ENOSPC
        );
        assert_eq!(
            errno_of(check(&req(cmd::READ, 0, end - 10, 20), &t, false)),
            errno::EINVAL
        );
        // Zeroing part of a block is a write: never fast.
        let fz = req(cmd::WRITE_ZEROES, cflags::FAST_ZERO, 100, 4096);
        assert_eq!(errno_of(check(&fz, &t, false)), errno::ENOTSUP);
        // Cache and block status of any alignment are answered as they are.
        assert_eq!(
            check(&req(cmd::CACHE, 0, 1, 1), &t, false),
            Ok(Command::Cache)
        );
    }

    #[test]
    fn payload_lengths() {
        let w = req(cmd::WRITE, 0, 0, 4096);
        assert_eq!(payload_len(&w, false), 4096);
        let r = req(cmd::READ, cflags::PAYLOAD_LEN, 0, 4096);
        assert_eq!(payload_len(&r, false), 0);
        assert_eq!(payload_len(&r, true), 4096);
    }

    fn any_terms() -> impl Strategy<Value = Terms> {
        (
            any::<u16>(),
            any::<[bool; 5]>(),
            prop_oneof![Just(4096u32), Just(32 << 20), 1u32..=(64 << 20)],
            prop_oneof![Just(512u32), Just(4096)],
            1u64..=(1 << 20),
            any::<[bool; 4]>(),
        )
            .prop_map(|(flags, b, max_payload, block, blocks, caps)| Terms {
                flags,
                structured: b[0] || b[1],
                extended: b[1],
                block_status: b[2],
                relaxed: b[3],
                fast_zero: b[4],
                max_payload,
                geometry: Geometry {
                    size_bytes: blocks * u64::from(block),
                    block_bytes: block,
                    caps: Caps {
                        flush: caps[0],
                        fua: caps[1],
                        discard: caps[2],
                        write_zeroes: caps[3],
                    },
                },
            })
    }

    /// Offsets and lengths near the edges that matter for a device of `size` bytes in
    /// `block`-byte blocks: 0, whole blocks, a byte or two off, the end, overflow.
    fn edgy(size: u64, block: u64) -> impl Strategy<Value = u64> {
        prop_oneof![
            3 => Just(0u64),
            6 => (0..=size / block + 1).prop_map(move |b| b * block),
            3 => (0..=size / block + 1, -2i64..=2)
                .prop_map(move |(b, d)| (b * block).saturating_add_signed(d)),
            3 => (0u64..4, -2i64..=2)
                .prop_map(move |(k, d)| size.saturating_sub(k * block).saturating_add_signed(d)),
            1 => 0u64..(1 << 16),
            1 => (u64::MAX - (1 << 16))..=u64::MAX,
            1 => any::<u64>(),
        ]
    }

    /// Terms, and a request made to meet them about half of the time: a known command,
    /// flags among those defined, a range around the device.
    fn terms_and_request() -> impl Strategy<Value = (Terms, Request)> {
        any_terms().prop_flat_map(|t| {
            let (size, block) = (t.geometry.size_bytes, u64::from(t.geometry.block_bytes));
            let command = prop_oneof![8 => 0u16..8, 1 => any::<u16>()];
            let flags = prop_oneof![
                4 => Just(0u16),
                4 => (0u32..6).prop_map(|b| 1u16 << b),
                2 => 0u16..64,
                1 => any::<u16>(),
            ];
            (
                Just(t),
                command,
                flags,
                edgy(size, block),
                edgy(size, block),
            )
                .prop_map(|(t, c, f, o, l)| (t, req(c, f, o, l)))
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(20_000))]

        /// Whatever the header and terms: no panic, and what is accepted is safe to
        /// issue: the right operation, inside the export, aligned or widened, under the
        /// maximum, never a write on a read-only export, only flags the terms allow.
        #[test]
        fn accepted_requests_are_safe_to_issue(
            (t, r) in terms_and_request(),
            shutting in prop::bool::weighted(0.1),
        ) {
            let got = check(&r, &t, shutting);
            let g = t.geometry;
            let block = u64::from(g.block_bytes);
            let read_only = t.flags & tflags::READ_ONLY != 0;
            let Ok(c) = got else {
                let e = got.unwrap_err().errno();
                prop_assert!(matches!(e, errno::EINVAL | errno::EPERM | errno::ENOSPC
                    | errno::ENOTSUP | errno::ESHUTDOWN), "errno {e}");
                prop_assert!(!shutting || e == errno::ESHUTDOWN);
                return Ok(());
            };
            prop_assert!(!shutting || c == Command::Disconnect);
            if !shutting {
                // (A disconnect while shutting down is taken whatever its flags.)
                let allowed = allowed_flags(r.command, &t);
                prop_assert!(allowed.is_some_and(|a| r.flags & !a == 0));
            }
            match c {
                Command::Disconnect => prop_assert_eq!(r.command, cmd::DISC),
                Command::Cache | Command::BlockStatus => {
                    prop_assert!(r.len > 0 && r.offset + r.len <= g.size_bytes);
                    prop_assert!(t.relaxed || (r.offset % block == 0 && r.len % block == 0));
                    prop_assert!(c == Command::Cache || t.block_status);
                }
                Command::Io { op, flags, then_flush } => {
                    let want = match r.command {
                        cmd::READ => Op::Read,
                        cmd::WRITE => Op::Write,
                        cmd::FLUSH => Op::Flush,
                        cmd::TRIM => Op::Discard,
                        cmd::WRITE_ZEROES => Op::WriteZeroes,
                        other => return Err(TestCaseError::fail(format!("command {other} as I/O"))),
                    };
                    prop_assert_eq!(op, want);
                    prop_assert!(!(read_only && op.is_write()));
                    if op == Op::Flush {
                        prop_assert_eq!((r.offset, r.len), (0, 0));
                    } else {
                        prop_assert!(g.check(op, r.offset, r.len).is_ok());
                    }
                    if op.has_data() {
                        prop_assert!(r.len <= u64::from(t.max_payload));
                    }
                    prop_assert_eq!(flags.contains(IoFlags::FUA), op == Op::Write && r.flags & cflags::FUA != 0);
                    prop_assert!(!then_flush || matches!(op, Op::Discard | Op::WriteZeroes));
                    prop_assert!(op != Op::WriteZeroes || r.flags & cflags::FAST_ZERO == 0 || t.fast_zero);
                }
                Command::Unaligned { op, wide } => {
                    prop_assert!(t.relaxed);
                    prop_assert!(op != Op::Flush && !(read_only && op.is_write()));
                    prop_assert!(g.check(op, wide.offset, wide.len).is_ok());
                    prop_assert_eq!(wide, Wide::new(r.offset, r.len, block));
                    prop_assert!(wide.offset <= r.offset && r.offset + r.len <= wide.offset + wide.len);
                    prop_assert!(r.offset % block != 0 || r.len % block != 0);
                }
            }
        }

        /// Any bytes that decode as a header are checked without a panic.
        #[test]
        fn decoded_bytes_are_checked_without_panic(
            bytes in proptest::collection::vec(any::<u8>(), 28..=32),
            t in any_terms(),
            magic in any::<bool>(),
        ) {
            let mut b = bytes;
            let extended = b.len() == 32;
            if magic {
                let m = if extended { super::super::EXTENDED_REQUEST_MAGIC } else { super::super::REQUEST_MAGIC };
                b[..4].copy_from_slice(&m.to_be_bytes());
            }
            let decoded = if extended {
                super::super::parse_extended_request(&b)
            } else {
                super::super::parse_request(&b)
            };
            if let super::super::Decoded::Request(r) = decoded {
                let t = Terms { extended, ..t };
                let _ = check(&r, &t, false);
                let _ = payload_len(&r, extended);
            }
        }
    }

    #[test]
    fn widening() {
        let w = Wide::new(1, 1_048_590, 512);
        assert_eq!((w.offset, w.len, w.head), (0, 1_049_088, 1));
        assert_eq!(w.edges(), ([0, 1_048_576], 2));
        assert_eq!(w.whole(), (512, 1_048_576 - 512));
        // Inside one block: one edge, both ends partial.
        let w = Wide::new(4100, 10, 4096);
        assert_eq!((w.offset, w.len, w.head), (4096, 4096, 4));
        assert_eq!(w.edges(), ([0, 0], 1));
        assert_eq!(w.whole(), (8192, 0));
        assert_eq!(w.kept(0), [(0, 4), (14, 4096)]);
        // Aligned start, partial end.
        let w = Wide::new(4096, 5000, 4096);
        assert_eq!(w.edges(), ([4096, 0], 1));
        assert_eq!(w.whole(), (4096, 4096));
        assert_eq!(w.kept(4096), [(4096, 4096), (5000, 8192)]);
        // Partial start, aligned end, two blocks.
        let w = Wide::new(100, 8092, 4096);
        assert_eq!(w.edges(), ([0, 0], 1));
        assert_eq!(w.whole(), (4096, 4096));
        assert_eq!(w.kept(0), [(0, 100), (4096, 4096)]);
        // Two adjacent partial blocks.
        let w = Wide::new(4000, 200, 4096);
        assert_eq!(w.edges(), ([0, 4096], 2));
        assert_eq!(w.whole(), (4096, 0));
        assert_eq!(w.kept(4096), [(4096, 4096), (4200, 8192)]);
        // Aligned: no edges.
        let w = Wide::new(8192, 4096, 512);
        assert_eq!(w.edges().1, 0);
        assert_eq!(w.whole(), (8192, 4096));
    }

    #[test]
    fn kept_and_covered_bytes_add_up() {
        for block in [512u64, 4096] {
            for offset in [0u64, 1, 511, 512, 4095, 4097, 9000] {
                for len in [1u64, 2, 511, 512, 513, 4096, 5000, 12_345] {
                    let w = Wide::new(offset, len, block);
                    let (e, n) = w.edges();
                    let mut covered = vec![false; w.len as usize];
                    for at in &e[..n] {
                        for (a, b) in w.kept(*at) {
                            for c in &mut covered[a as usize..b as usize] {
                                assert!(!*c, "{w:?}: kept twice");
                                *c = true;
                            }
                        }
                    }
                    for c in &mut covered[w.head as usize..(w.head + len) as usize] {
                        assert!(!*c, "{w:?}: kept a written byte");
                        *c = true;
                    }
                    let (ws, wl) = w.whole();
                    for i in 0..w.len {
                        let dev = w.offset + i;
                        let in_whole = dev >= ws && dev < ws + wl;
                        let in_edge = e[..n].iter().any(|at| i >= *at && i < at + block);
                        // Every byte is either kept from an edge or written, and the
                        // blocks are either edges or whole blocks of the request.
                        assert!(in_whole != in_edge, "{w:?}: byte {i}");
                        if in_whole {
                            assert!(covered[i as usize], "{w:?}: byte {i}");
                        }
                    }
                    assert!(
                        covered.iter().enumerate().all(|(i, c)| *c
                            || e[..n]
                                .iter()
                                .all(|at| (i as u64) < *at || (i as u64) >= at + block)),
                        "{w:?}"
                    );
                }
            }
        }
    }
}
