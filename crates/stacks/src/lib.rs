//! cairn's stacks: devices made of other devices.
//!
//! - [`stack`]: linear, stripe (RAID0), mirror (RAID1) and raid10 over one engine:
//!   layouts, the request path, read repair, members replaced online, the rebuild.
//! - [`array`]: what a mirror or raid10 keeps on its members: the superblock, the
//!   write-intent bitmap, assembly from what the members say.
//! - [`cache`]: a write-back cache in memory over a base device, with its flusher.
//! - [`wrap`]: devices that wrap one base and change what it does: `fault` and `delay`
//!   (and, with a policy from `cairn_services::throttle`, `throttle`).
//! - [`error`]: [`Error`], why an array refuses an admin's action, a new member or a
//!   start, with the facts of each case ([`MemberIs`]: what a member is).
//!
//! Leaves (files, memory, NBD, RBD) are `cairn_leaves`'s; what a stack file builds from
//! them is `cairn_config`'s.
#![warn(missing_docs)]

pub mod array;
pub mod cache;
pub mod error;
pub mod stack;
pub mod wrap;

pub use error::{Error, MemberIs};

#[doc(hidden)]
pub mod fuzz;
