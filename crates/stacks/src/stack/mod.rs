//! Stacked devices: linear, stripe (RAID0), mirror (RAID1) and raid10, over one engine.
//!
//! A [`Layout`] says where each byte of the stacked device lives: on which member, at
//! which offset, in how many copies. [`StackQueue`] does the rest for every layout: it
//! splits a request at chunk and member boundaries, submits the pieces to its members'
//! queues on the same reactor (technique 4: no hand-off to another thread), and completes
//! the request when every piece has. Per-request state lives in two per-queue slabs.
//!
//! Redundant layouts (copies > 1) keep going when members fail: a failed read is retried
//! on another copy, and once another copy answered, the range is rewritten on the copy
//! that failed ([`repair`]: read repair); a failed write, discard or flush (or a failed
//! repair) marks the member failed and the array runs degraded (logged once, and listed
//! by `Device::failed_members`). A request fails only when some of its data has no
//! healthy copy left.
//!
//! One file per job:
//!
//! - `device`: [`StackDevice`] and [`Shared`], building one, its `Device` impl, its stop.
//! - `health`: which members have failed or may be read; switching member devices.
//! - `queue`: [`StackQueue`], its per-request state, the common case of `submit`, and
//!   how it follows a change of members.
//! - `submit`: splitting a request into pieces and sending them to members; flushes.
//! - `complete`: members' replies: retries on another copy, failed members, completion.
//! - `metadata`: running on superblocks; the rebuild and bitmap threads.
//! - `members`: the admin's changes of members (fail, remove, add, re-add, replace).
//! - `watch`: the members' thread: spares, and re-adding members that answer again.
//! - `status`: the text of `status` for an array.
//! - `layouts`, `options`, `rebuild`, `repair`: the layouts, the arrays' options, the
//!   rebuild and resync, read repair.

mod complete;
mod device;
mod health;
mod layouts;
mod members;
mod metadata;
mod options;
mod queue;
mod rebuild;
mod repair;
mod status;
mod submit;
mod watch;

pub use device::{Shared, StackDevice};
pub use layouts::{AnyLayout, Linear, Mirror, Raid10, Stripe, COPIES_MAX};
pub use options::{ArrayOptions, DEFAULT_BITMAP_REGION, MISSING};
pub use queue::StackQueue;

use health::Health;

/// Where the bytes of a stacked device live.
pub trait Layout: Send + Sync {
    /// `linear`, `stripe`, `mirror` or `raid10`.
    fn kind(&self) -> &'static str;
    /// Size of the stacked device in bytes.
    fn size_bytes(&self) -> u64;
    /// Copies of every byte (1 for linear and stripe).
    fn copies(&self) -> usize;
    /// Length of the piece that starts at logical `offset`, at most `len`: pieces never
    /// cross a chunk or member boundary.
    fn piece_len(&self, offset: u64, len: u64) -> u64;
    /// Member index and member offset of copy `copy` of logical `offset`.
    fn locate(&self, offset: u64, copy: usize) -> (usize, u64);
    /// Where copy `copy` of the whole range lives, if it lies on one member in one piece
    /// (the common case, answered with one look-up).
    #[inline(always)]
    fn place(&self, offset: u64, len: u64, copy: usize) -> Option<(usize, u64)> {
        (self.piece_len(offset, len) == len).then(|| self.locate(offset, copy))
    }
    /// Layout parameters for reports, e.g. `chunk=65536 copies=2`.
    fn describe(&self) -> String;
}
