//! One I/O request and its completion status.
//!
//! An [`Io`] is a small `Copy` value: the submitter keeps the data buffer alive until the
//! completion arrives at its [`Sink`](crate::Sink), the way a kernel driver keeps a bio's
//! pages. Nothing here allocates.

use std::fmt;

/// The operation an [`Io`] performs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Op {
    /// Read `len` bytes at `offset` into the buffer.
    Read = 0,
    /// Write `len` bytes from the buffer at `offset`.
    Write = 1,
    /// Make every completed write durable.
    Flush = 2,
    /// Drop the data in a range; it then reads as zeros on every cairn device.
    Discard = 3,
    /// Make a range read as zeros without sending a buffer.
    WriteZeroes = 4,
}

impl Op {
    /// Number of operations, for per-operation arrays.
    pub const COUNT: usize = 5;
    /// All operations, in index order.
    pub const ALL: [Op; Op::COUNT] = [Op::Read, Op::Write, Op::Flush, Op::Discard, Op::WriteZeroes];

    /// Index for per-operation arrays.
    #[inline]
    pub fn index(self) -> usize {
        self as usize
    }

    /// Whether the operation carries a data buffer.
    #[inline]
    pub fn has_data(self) -> bool {
        matches!(self, Op::Read | Op::Write)
    }

    /// Whether the operation addresses a byte range (everything except flush).
    #[inline]
    pub fn has_range(self) -> bool {
        !matches!(self, Op::Flush)
    }

    /// Whether the operation changes data.
    #[inline]
    pub fn is_write(self) -> bool {
        matches!(self, Op::Write | Op::Discard | Op::WriteZeroes)
    }

    /// Lower-case name, as printed in reports.
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Discard => "discard",
            Op::WriteZeroes => "write-zeroes",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Request flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IoFlags(u8);

impl IoFlags {
    /// No flags.
    pub const NONE: IoFlags = IoFlags(0);
    /// Force unit access: the write is durable when it completes.
    pub const FUA: IoFlags = IoFlags(1);
    /// Write-zeroes must leave the range allocated (NBD's NO_HOLE).
    pub const NO_HOLE: IoFlags = IoFlags(2);
    /// Set by a stacked device that only remapped the request to a member which answers
    /// it itself: the member counts it for the stacked device as well as for itself (see
    /// [`QueueStats::delegate`](crate::stats::QueueStats::delegate)). Only ever sent to a
    /// queue that agreed to it; never passed on.
    pub const DELEGATED: IoFlags = IoFlags(4);

    /// Whether every flag in `other` is set.
    #[inline]
    pub fn contains(self, other: IoFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// The union of both sets.
    #[inline]
    pub fn with(self, other: IoFlags) -> IoFlags {
        IoFlags(self.0 | other.0)
    }
}

/// Index of a [`Sink`](crate::Sink) registered with a reactor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SinkId(pub u32);

/// One I/O request.
///
/// `buf` points at `len` bytes for reads and writes; it is unused (and may be null) for the
/// other operations. The submitter guarantees the buffer stays valid, and is not touched by
/// anyone else, until the completion for `(sink, token)` has been delivered.
#[derive(Debug, Clone, Copy)]
pub struct Io {
    /// What to do.
    pub op: Op,
    /// FUA and friends.
    pub flags: IoFlags,
    /// Byte offset on the device (0 for flush).
    pub offset: u64,
    /// Length in bytes (0 for flush).
    pub len: u64,
    /// Data buffer for reads and writes.
    pub buf: *mut u8,
    /// Who is told when the request completes.
    pub sink: SinkId,
    /// The submitter's own tag for this request, handed back on completion.
    pub token: u64,
}

// SAFETY: an Io is a description of a request; the buffer it points to is owned by the
// submitter, which keeps it alive until completion (see the type's documentation). Moving
// the description to another thread (the `--dispatch handoff` worker) does not change who
// owns the buffer.
unsafe impl Send for Io {}

impl Io {
    /// A request without a data buffer (flush, discard, write-zeroes).
    pub fn nodata(op: Op, offset: u64, len: u64, sink: SinkId, token: u64) -> Io {
        Io {
            op,
            flags: IoFlags::NONE,
            offset,
            len,
            buf: std::ptr::null_mut(),
            sink,
            token,
        }
    }

    /// End of the byte range (exclusive).
    #[inline]
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// A completion status: 0 for success or a positive errno.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IoStatus(i32);

impl IoStatus {
    /// Success.
    pub const OK: IoStatus = IoStatus(0);

    /// A failure with the given (positive) errno.
    #[inline]
    pub fn errno(errno: i32) -> IoStatus {
        debug_assert!(errno > 0);
        IoStatus(errno.max(1))
    }

    /// From a kernel result: negative is `-errno`, anything else is success.
    #[inline]
    pub fn from_result(res: i32) -> IoStatus {
        if res < 0 {
            IoStatus(-res)
        } else {
            IoStatus::OK
        }
    }

    /// Whether the request succeeded.
    #[inline]
    pub fn is_ok(self) -> bool {
        self.0 == 0
    }

    /// The errno, or 0 on success.
    #[inline]
    pub fn raw(self) -> i32 {
        self.0
    }
}

impl fmt::Debug for IoStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for IoStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == 0 {
            f.write_str("ok")
        } else {
            write!(f, "{}", std::io::Error::from_raw_os_error(self.0))
        }
    }
}
