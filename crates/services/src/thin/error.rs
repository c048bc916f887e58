//! What can go wrong in a thin pool: [`ThinError`] for its admin's operations (create,
//! snapshot, clone, delete, grow, checkpoint), its commits and checkpoints, and the
//! records its metadata holds ([`ThinError::Damaged`]). Opening a pool answers with
//! `cairn_core::Error`, as every device's open does.

use cairn_core::blocking::BlockingError;
use cairn_core::size::format_bytes;

use super::pool::NAME_MAX;

/// Why a thin pool refused or failed an operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ThinError {
    /// A value given by the user is not acceptable (a size, say); the message says which
    /// and why.
    #[error("{0}")]
    Invalid(String),
    /// Not a name a volume may have.
    #[error("'{}' is not a volume name (1 to {NAME_MAX} bytes, no spaces, '/' or control characters)", name.escape_default())]
    BadName {
        /// The name given.
        name: String,
    },
    /// The pool has no volume `name`.
    #[error("thin pool '{pool}' has no volume '{name}'")]
    NoVolume {
        /// The pool.
        pool: String,
        /// The volume asked for.
        name: String,
    },
    /// The pool has a volume `name` already.
    #[error("thin pool '{pool}' has a volume '{name}' already")]
    VolumeExists {
        /// The pool.
        pool: String,
        /// The name asked for.
        name: String,
    },
    /// Devices are open on the volume (it is served): it is not deleted under them.
    #[error("volume '{name}' is open ({users} device{} on it): stop serving it first", if *users == 1 { "" } else { "s" })]
    Busy {
        /// The volume.
        name: String,
        /// Devices open on it.
        users: u32,
    },
    /// A clone asked of a writable volume: clones are made of snapshots.
    #[error("'{src}' is writable: clone a snapshot (take one with 'thin snapshot' first)")]
    CloneOfWritable {
        /// The volume asked to be cloned.
        src: String,
    },
    /// A checkpoint asked of a snapshot: checkpoints are of writable volumes.
    #[error("'{src}' is a snapshot: checkpoints are of writable volumes")]
    CheckpointOfSnapshot {
        /// The snapshot.
        src: String,
    },
    /// A volume never shrinks.
    #[error("volume '{name}' is {} and cannot shrink to {}", format_bytes(*size), format_bytes(*asked))]
    Shrink {
        /// The volume.
        name: String,
        /// Its size in bytes.
        size: u64,
        /// The size asked for.
        asked: u64,
    },
    /// The pool's metadata could not hold the next checkpoint with this volume in it.
    #[error("thin pool '{pool}': the metadata has room for {} and would need up to {} with this volume", format_bytes(*capacity), format_bytes(*need))]
    NoMetadataRoom {
        /// The pool.
        pool: String,
        /// Bytes of the checkpoint area.
        capacity: u64,
        /// Bytes the next checkpoint could need.
        need: u64,
    },
    /// A checkpoint of the pool's state needs more than its area holds: the pool fails.
    #[error("the metadata is full: a checkpoint needs {} and has room for {}", format_bytes(*need), format_bytes(*capacity))]
    MetadataFull {
        /// Bytes the checkpoint needs.
        need: u64,
        /// Bytes of the checkpoint area.
        capacity: u64,
    },
    /// The pool takes no operation now: see [`Down`].
    #[error("thin pool '{pool}' {why}")]
    Down {
        /// The pool.
        pool: String,
        /// Why.
        why: Down,
    },
    /// A read, write, flush or zeroing of the pool's data or metadata device failed.
    #[error("{doing}: {source}")]
    Io {
        /// What the pool was doing ("log write failed", "zeroing at 65536"...).
        doing: String,
        /// The device's error.
        source: BlockingError,
    },
    /// A record, in the log or a checkpoint, or made by the pool itself, that the pool's
    /// state cannot take: damaged metadata (or a bug), never applied.
    #[error("{why}")]
    Damaged {
        /// Which structure: "log record", "checkpoint".
        what: &'static str,
        /// Which precondition the record breaks.
        why: String,
    },
    /// A record of the pool's own (a commit's) that its state refused: the pool fails.
    #[error("a record the pool cannot take ({why}): {record}")]
    Refused {
        /// The record.
        record: String,
        /// Why the state refused it.
        why: Box<ThinError>,
    },
    /// Volume `volume` has no checkpoint `name`.
    #[error("volume '{volume}' of thin pool '{pool}' has no checkpoint '{name}'{}", if known.is_empty() { " (it has none)".to_string() } else { format!(" (it has {})", known.join(", ")) })]
    NoCheckpoint {
        /// The pool.
        pool: String,
        /// The volume.
        volume: String,
        /// The checkpoint asked for.
        name: String,
        /// The volume's checkpoints.
        known: Vec<String>,
    },
    /// The snapshot of a volume's newest checkpoint: the changes since it are counted
    /// against it.
    #[error("'{name}' is the snapshot of volume '{volume}''s newest checkpoint: the changes since it are counted against it. Take the next checkpoint first, or end incremental backups from it with 'checkpoint remove {pool} {volume} {name}'")]
    NewestCheckpoint {
        /// The pool.
        pool: String,
        /// The volume checkpointed.
        volume: String,
        /// The snapshot (and checkpoint).
        name: String,
    },
    /// A checkpoint's granularity the pool cannot report in.
    #[error("a checkpoint's granularity is a power of two from the pool's block ({}) to 1 GiB, not {}", format_bytes(*block), format_bytes(*asked))]
    Granularity {
        /// The pool's block.
        block: u64,
        /// The granularity asked for.
        asked: u64,
    },
    /// Tests: the pool stops as if the process died.
    #[error("crashed")]
    Crashed,
}

/// Why a pool takes no operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Down {
    /// It was opened to examine only (`cairn check`).
    NotRunning,
    /// It is closing.
    Stopping,
    /// It closed before the operation ran.
    Stopped,
    /// A metadata write failed: it takes no more changes.
    Failed,
}

impl std::fmt::Display for Down {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Down::NotRunning => "is not running",
            Down::Stopping => "is stopping",
            Down::Stopped => "stopped",
            Down::Failed => "has failed",
        })
    }
}

impl ThinError {
    /// Damage to `what` ("log record", "checkpoint"): a record breaks `why`.
    pub(crate) fn damaged(what: &'static str, why: impl Into<String>) -> ThinError {
        ThinError::Damaged {
            what,
            why: why.into(),
        }
    }

    /// This error of a record of volume `vol` in `what` (a size or name it carries),
    /// as damage: "volume 3: ...".
    pub(crate) fn of_volume(self, what: &'static str, vol: u32) -> ThinError {
        ThinError::damaged(what, format!("volume {vol}: {self}"))
    }

    /// An I/O error of the pool's devices while `doing`.
    pub(crate) fn io(doing: impl Into<String>, source: BlockingError) -> ThinError {
        ThinError::Io {
            doing: doing.into(),
            source,
        }
    }
}
