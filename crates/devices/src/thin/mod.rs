//! Thin pools (issue 37, work in progress on the thin-37 branch): volumes that allocate
//! on write, snapshots and clones. [`format`] is the metadata log's on-disk format.

pub mod format;
