//! Errors: [`Error`] for setting things up, [`IoError`] for a request refused at the edge.

use crate::io::Op;

/// Everything that can go wrong while configuring or opening devices and reactors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A value given by the user is not acceptable; the message says which and why.
    #[error("{0}")]
    Invalid(String),
    /// An operating-system call failed; `context` says what cairn was doing.
    #[error("{context}: {source}")]
    Os {
        /// What cairn was doing, e.g. "open /dev/shm/x".
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
}

impl Error {
    /// Wraps the current `errno` with a context string.
    pub fn last_os(context: impl Into<String>) -> Self {
        Error::Os {
            context: context.into(),
            source: std::io::Error::last_os_error(),
        }
    }

    /// Wraps an `std::io::Error` with a context string.
    pub fn os(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Os {
            context: context.into(),
            source,
        }
    }
}

/// Why a request was refused when it was checked against a device's [`Geometry`].
///
/// [`Geometry`]: crate::Geometry
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IoError {
    /// The request reaches past the end of the device.
    #[error("{op} of {len} bytes at offset {offset} reaches past the device end ({size} bytes)")]
    OutOfRange {
        /// The operation.
        op: Op,
        /// Its byte offset.
        offset: u64,
        /// Its length in bytes.
        len: u64,
        /// The device size in bytes.
        size: u64,
    },
    /// Offset or length is not a multiple of the logical block size.
    #[error(
        "{op} of {len} bytes at offset {offset} is not aligned to the {block}-byte block size"
    )]
    Misaligned {
        /// The operation.
        op: Op,
        /// Its byte offset.
        offset: u64,
        /// Its length in bytes.
        len: u64,
        /// The logical block size.
        block: u32,
    },
    /// A read or write of zero bytes, or one larger than a single request may be.
    #[error("{op} of {len} bytes is not a valid request length")]
    BadLength {
        /// The operation.
        op: Op,
        /// Its length in bytes.
        len: u64,
    },
    /// The device does not support this operation.
    #[error("the device does not support {0}")]
    Unsupported(Op),
    /// The device is read-only.
    #[error("the device is read-only")]
    ReadOnly,
}

impl IoError {
    /// The errno a protocol should answer with, as the NBD spec maps them: a write past the
    /// end is ENOSPC, other range and alignment errors are EINVAL.
    pub fn errno(&self) -> i32 {
        match *self {
            IoError::OutOfRange {
                op: Op::Write | Op::WriteZeroes,
                ..
            } => libc::ENOSPC,
            IoError::ReadOnly => libc::EPERM,
            IoError::Unsupported(_) => libc::EOPNOTSUPP,
            _ => libc::EINVAL,
        }
    }
}
