//! What an array (a stack of members that keeps state on them) reports of itself: its
//! state as fields, for `status --json`, as `mdadm --detail` shows an md array's.

/// An array's state as fields ([`crate::Device::array_report`]): what `/proc/mdstat` and
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
