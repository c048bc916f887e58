//! What a stack file can set on a mirror or raid10, and the name of an absent member:
//! the arrays' own types (the stack file's parser fills them in).

/// A mirror's or raid10's options with metadata: how fast a rebuild or resync goes (md's
/// `sync_speed_min` and `sync_speed_max`: at most `max_bytes` a second, and `min_bytes`
/// a second while clients use the array), and its write-intent bitmap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArrayOptions {
    /// Bytes a second while clients use the array (`rebuild_min`, default 16M).
    pub min_bytes: u64,
    /// Bytes a second at most (`rebuild_max`; 0, the default: as fast as it goes).
    pub max_bytes: u64,
    /// Bytes of array one bitmap bit covers (`bitmap`, default 64M; 0: no bitmap).
    pub bitmap_region: u64,
    /// How long a region stays idle before its bit is cleared, and how often that is
    /// looked at (`bitmap_delay`, default 5 s, md's `--delay`).
    pub bitmap_delay: std::time::Duration,
    /// How often a member that failed by an I/O error is tried again, and re-added once
    /// its device answers with its superblock (`readd`; `None`, the default: only by the
    /// admin's `re-add`).
    pub readd: Option<std::time::Duration>,
}

impl Default for ArrayOptions {
    fn default() -> ArrayOptions {
        ArrayOptions {
            min_bytes: 16 << 20,
            max_bytes: 0,
            bitmap_region: DEFAULT_BITMAP_REGION,
            bitmap_delay: std::time::Duration::from_secs(5),
            readd: None,
        }
    }
}

/// The write-intent bitmap's default region.
pub const DEFAULT_BITMAP_REGION: u64 = 64 << 20;

/// The member name of an absent member of an array with metadata (as mdadm's `missing`).
pub const MISSING: &str = "missing";
