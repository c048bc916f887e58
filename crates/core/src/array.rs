//! The array capability: what an array of member devices (linear, stripe, mirror,
//! raid10) reports of itself. Its state as fields ([`ArrayReport`]) is what
//! `status --json` shows, as `mdadm --detail` shows an md array's. What the admin does
//! to an array (`fail`, `add`...) is `cairn_stacks::array::ArrayAdmin`, whose errors are
//! that crate's.

use std::sync::Arc;

use crate::device::Device;

/// An array of member devices. Arrays that keep state on their members (superblocks,
/// the default) report it; the others report their failed members only.
pub trait Array: Send + Sync {
    /// Whether it keeps more than one copy of its data (a mirror or raid10).
    fn redundant(&self) -> bool;

    /// Names of members that have failed (a redundant array running degraded).
    fn failed_members(&self) -> Vec<String>;

    /// For an array that keeps state on its members: its status as the admin `status`
    /// command prints it (like `/proc/mdstat`), several lines. `None` for the others.
    fn status(&self) -> Option<String>;

    /// For an array that keeps state on its members: the same facts as
    /// [`Array::status`], as fields (for `status --json`). `None` for the others.
    fn report(&self) -> Option<ArrayReport>;

    /// For an array that keeps state on its members, while a rebuild or resync runs: the
    /// bytes it visited and the bytes it has to visit. `None` otherwise.
    fn sync_progress(&self) -> Option<(u64, u64)>;

    /// A count bumped when a change of its members begins and again when it ends (odd
    /// while one runs), so that a reader can tell it read a state between the two and
    /// read again.
    fn change_seq(&self) -> u64;

    /// The members it runs on now, by name, in order (`missing` for an absent one), with,
    /// for each member added while it runs (`add`, `replace`, a spare), the spec it was
    /// opened from: what a stack file should say to start it again as it is. `None` for
    /// an array that keeps no state on its members (its members never change).
    fn members_now(&self) -> Option<Vec<(String, Option<String>)>>;

    /// Its spares now, by name, with the spec of each added while it runs (as
    /// [`Array::members_now`]). `None` for an array that keeps no state on its members.
    fn spares_now(&self) -> Option<Vec<(String, Option<String>)>>;
}

/// The failed members of `device` if it is an array; none otherwise.
pub fn failed_members(device: &Arc<dyn Device>) -> Vec<String> {
    device
        .capability::<dyn Array>()
        .map(|a| a.failed_members())
        .unwrap_or_default()
}

/// An array's state as fields ([`Array::report`]): what `/proc/mdstat` and
/// `mdadm --detail` show of an md array.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ArrayReport {
    /// `linear`, `stripe`, `mirror` or `raid10`.
    pub level: &'static str,
    /// Its size in bytes.
    pub size_bytes: u64,
    /// The array's UUID (the same on every member's superblock).
    pub uuid: String,
    /// Superblock format version.
    pub metadata: u32,
    /// Bumped by every change of state recorded in the superblocks.
    pub events: u64,
    /// Copies of each byte (1 for linear and stripe).
    pub copies: usize,
    /// Some data is read from fewer copies than it has members for.
    pub degraded: bool,
    /// Not stopped cleanly and not resynced yet: reads come from one copy.
    pub unclean: bool,
    /// Each member position, in `members` order (and replacements being built).
    pub members: Vec<ArrayMember>,
    /// A rebuild or resync running now.
    pub sync: Option<ArraySync>,
    /// Spares, by name.
    pub spares: Vec<String>,
    /// The write-intent bitmap: region bytes, regions, dirty regions.
    pub bitmap: Option<(u64, u64, u64)>,
    /// Read repairs: ranges rewritten, bytes rewritten, rewrites that failed, pending.
    pub read_repairs: (u64, u64, u64, u64),
}

/// One member of an [`ArrayReport`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ArrayMember {
    /// Its device's name.
    pub name: String,
    /// Its position in `members` (a replacement: the position it is built for).
    pub role: usize,
    /// `active`, `rebuilding`, `failed`, `missing`, `replacing`.
    pub state: &'static str,
    /// Reads go to it.
    pub readable: bool,
    /// Re-added too often: the automatic re-add gave up on it.
    pub readd_given_up: bool,
}

/// A rebuild or resync in an [`ArrayReport`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ArraySync {
    /// `rebuild` or `resync`.
    pub kind: &'static str,
    /// Bytes done and to do in all.
    pub done_bytes: u64,
    /// Bytes in all.
    pub total_bytes: u64,
    /// Bytes a second, over the run so far.
    pub rate_bytes_per_s: u64,
}
