//! cairn's data services: devices that keep data of their own over a base device.
//!
//! - [`thin`]: thin pools: volumes that allocate on write, snapshots and clones, their
//!   metadata log and checkpoints.
//! - [`dirty`]: named dirty bitmaps and checkpoints for incremental backup, kept in a
//!   store file.
//! - [`crypt`]: encryption at rest: LUKS1 and LUKS2 headers, AES-XTS.
//! - [`throttle`]: rate limits (IOPS and bandwidth, alone or in groups), and the
//!   `throttle` device's policy.
//!
//! Each builds on `cairn_leaves` and `cairn_stacks`; `cairn_config` opens them from a
//! stack file.
//!
//! Errors: each service fails in its own terms, with an error type of its own, re-exported
//! here: [`ThinError`] ([`thin::error`]), [`DirtyError`] ([`dirty::error`]),
//! [`CryptError`] ([`crypt::error`]) and [`ThrottleError`] ([`throttle`]). Opening a
//! device answers with `cairn_core::Error`, as every device's open does.
#![warn(missing_docs)]

pub mod crypt;
pub mod dirty;
pub mod thin;
pub mod throttle;

pub use crypt::CryptError;
pub use dirty::DirtyError;
pub use thin::ThinError;
pub use throttle::ThrottleError;

#[doc(hidden)]
pub mod fuzz;
