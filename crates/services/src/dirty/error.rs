//! What can go wrong with dirty bitmaps: [`DirtyError`] for the admin's operations on a
//! store (add, remove, clear, merge, a checkpoint), and [`PageDamage`] for a page of a
//! bitmap's bits that fails its check. Opening a store answers with `cairn_core::Error`,
//! as every device's open does.

use cairn_core::size::{format_bytes, plural};

use super::format::{BITMAPS_MAX, GRANULARITY_MAX, GRANULARITY_MIN, NAME_MAX};
use crate::thin::ThinError;

/// Why an operation on a bitmap store was refused or failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DirtyError {
    /// The store has no bitmap `name`; `known` lists those it has.
    #[error("no bitmap '{name}' (bitmaps: {})", list(known))]
    NotFound {
        /// The name asked for.
        name: String,
        /// The bitmaps the store holds.
        known: Vec<String>,
    },
    /// A bitmap of that name exists already (`checkpoint`: the name was asked for a
    /// checkpoint's new bitmap).
    #[error("a bitmap '{name}' exists{}", if *checkpoint { ": a checkpoint needs a new name" } else { "" })]
    Exists {
        /// The name.
        name: String,
        /// Whether a checkpoint asked for it.
        checkpoint: bool,
    },
    /// Not a name a bitmap may have.
    #[error("'{}' is not a bitmap name (1 to {NAME_MAX} letters, digits or . _ - + @)", name.escape_default())]
    BadName {
        /// The name given.
        name: String,
    },
    /// A granularity that is not a power of two in range.
    #[error(
        "granularity {granularity}: a power of two from {} to {}",
        format_bytes(GRANULARITY_MIN),
        format_bytes(GRANULARITY_MAX)
    )]
    BadGranularity {
        /// Bytes per bit, as given.
        granularity: u64,
    },
    /// A granularity so fine that the bits of the device would take more than a bitmap
    /// may hold.
    #[error("granularity {} needs {} of bits for this device; at most {} (pick a coarser one)", format_bytes(*granularity), format_bytes(bits.div_ceil(8)), format_bytes(most_bits / 8))]
    TooManyBits {
        /// Bytes per bit.
        granularity: u64,
        /// Bits the device would need.
        bits: u64,
        /// The most bits a bitmap holds.
        most_bits: u64,
    },
    /// The store holds as many bitmaps as it may.
    #[error("the store holds {BITMAPS_MAX} bitmaps already")]
    Full,
    /// An NBD client reads the bitmap: it is not removed or cleared meanwhile.
    #[error("bitmap '{name}' is being read by {} (an NBD client's qemu:dirty-bitmap context): not {action} while it is", plural(*readers, "connection", "connections"))]
    BeingRead {
        /// The bitmap.
        name: String,
        /// Connections reading it.
        readers: u64,
        /// What was refused ("removed", "cleared").
        action: &'static str,
    },
    /// The store was opened by `cairn check`, to examine only.
    #[error("the store was opened to examine only")]
    ReadOnly,
    /// Writing the store's file failed (its directory: the error says which store).
    #[error("{0}")]
    Store(#[from] cairn_core::Error),
    /// Writing or syncing a bitmap's bits in the store's file failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The thin pool refused or failed a checkpoint's snapshot.
    #[error("{0}")]
    Thin(ThinError),
}

/// Why a page of a bitmap's bits fails its check: the page then reads as all dirty.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PageDamage {
    /// Not a whole page (the caller's slice).
    #[error("{0} bytes, not a page")]
    Length(usize),
    /// Every byte zero: never written, or zeroed.
    #[error("zeroed")]
    Zeroed,
    /// Not zero, but without a page trailer.
    #[error("no page trailer (bad magic)")]
    Magic,
    /// The trailer's checksum does not match the page.
    #[error("checksum mismatch")]
    Checksum,
    /// The file ends before the page.
    #[error("past the end of the file")]
    PastEnd,
}

impl From<ThinError> for DirtyError {
    fn from(e: ThinError) -> DirtyError {
        DirtyError::Thin(e)
    }
}

fn list(names: &[String]) -> String {
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}
