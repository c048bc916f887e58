//! Arrays that keep their state on their members (work in progress, issue "Arrays that
//! remember").
//!
//! - [`superblock`]: the on-disk superblock, format version 1: identity, role, layout,
//!   event counter, every member's state and rebuild checkpoint, in two checksummed slots
//!   so a torn write leaves the last good copy. Pure encode and decode.
//!
//! Still to come, on top of it: creating and assembling arrays from their members'
//! superblocks, the write-intent bitmap, online rebuild, and the admin actions.

pub mod assemble;
pub mod superblock;
