//! cairn's FUSE export: a device appears as a regular file (a FUSE file system whose root
//! is that file), served on cairn's reactors, through FUSE over io_uring where the kernel
//! offers it and `/dev/fuse` reads otherwise.
//!
//! The framing is cairn's own (the structs come from `fuse-abi`): the Rust FUSE libraries
//! own their read loop and threads, or need an async runtime, and none speaks FUSE over
//! io_uring; an export serving one file needs a dozen operations.

#![warn(missing_docs)]

pub mod abi;
pub mod export;
pub mod mount;
mod part;
mod uring;

pub use export::{uring_enabled, FuseConfig, FuseExport, FuseFigures, Transport, MAX_WRITE};
