//! The kernel's FUSE ABI: the structs of `linux/fuse.h` come from the `fuse-abi` crate
//! (ABI 7.40); what came after it (FUSE over io_uring, 7.42) is declared here, from the
//! kernel's `include/uapi/linux/fuse.h` and `Documentation/filesystems/fuse-io-uring.rst`.

pub use fuse_abi::linux::*;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// The protocol minor version cairn speaks (it answers with the lower of this and the
/// kernel's).
pub const MINOR: u32 = 45;
/// The oldest kernel minor cairn serves (7.28: `FUSE_MAX_PAGES`, `FUSE_LSEEK`).
pub const MIN_MINOR: u32 = 28;

/// `FUSE_OVER_IO_URING` (in `flags2`, bit 41 of the 64-bit flags).
pub const OVER_IO_URING: u64 = 1 << 41;

/// `FUSE_IO_URING_CMD_REGISTER`: an entry joins a queue and waits for a request.
pub const URING_CMD_REGISTER: u32 = 1;
/// `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`: answers the entry's request and waits for the next.
pub const URING_CMD_COMMIT_AND_FETCH: u32 = 2;

/// `struct fuse_uring_ent_in_out`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct UringEntInOut {
    /// Unused (0).
    pub flags: u64,
    /// The request's id, given back with the commit.
    pub commit_id: u64,
    /// Bytes in the payload buffer (the request's, then the reply's).
    pub payload_sz: u32,
    /// Padding.
    pub padding: u32,
    /// Reserved.
    pub reserved: u64,
}

/// `FUSE_URING_IN_OUT_HEADER_SZ`.
pub const URING_IN_OUT_SZ: usize = 128;
/// `FUSE_URING_OP_IN_OUT_SZ`.
pub const URING_OP_SZ: usize = 128;

/// `struct fuse_uring_req_header`: the entry's header buffer.
#[repr(C)]
#[derive(Clone, Copy, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct UringReqHeader {
    /// `fuse_in_header` of the request, then `fuse_out_header` of the reply.
    pub in_out: [u8; URING_IN_OUT_SZ],
    /// The operation's own header (`fuse_read_in`, ...).
    pub op_in: [u8; URING_OP_SZ],
    /// Sizes and the commit id.
    pub ent: UringEntInOut,
}

/// `struct fuse_uring_cmd_req`: the command area of the SQE.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct UringCmdReq {
    /// Unused (0).
    pub flags: u64,
    /// For COMMIT_AND_FETCH: the entry's `commit_id`.
    pub commit_id: u64,
    /// The queue (a CPU number).
    pub qid: u16,
    /// Padding.
    pub padding: [u8; 6],
}

/// `FALLOC_FL_KEEP_SIZE`.
pub const FALLOC_KEEP_SIZE: u32 = 0x01;
/// `FALLOC_FL_PUNCH_HOLE`.
pub const FALLOC_PUNCH_HOLE: u32 = 0x02;
/// `FALLOC_FL_ZERO_RANGE`.
pub const FALLOC_ZERO_RANGE: u32 = 0x10;

/// Reads a `T` from the front of `bytes`, or `None` when they are too short.
pub fn read<T: FromBytes>(bytes: &[u8]) -> Option<T> {
    T::read_from_prefix(bytes).ok().map(|(t, _)| t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_kernel() {
        assert_eq!(std::mem::size_of::<UringEntInOut>(), 32);
        assert_eq!(std::mem::size_of::<UringReqHeader>(), 288);
        assert_eq!(std::mem::offset_of!(UringReqHeader, ent), 256);
        assert_eq!(std::mem::size_of::<UringCmdReq>(), 24);
        assert_eq!(std::mem::offset_of!(UringCmdReq, qid), 16);
        assert_eq!(std::mem::size_of::<fuse_in_header>(), 40);
        assert_eq!(std::mem::size_of::<fuse_out_header>(), 16);
        assert_eq!(std::mem::size_of::<fuse_write_in>(), 40);
        assert_eq!(std::mem::size_of::<fuse_init_out>(), 64);
        assert_eq!(std::mem::size_of::<fuse_attr_out>(), 104);
    }
}
