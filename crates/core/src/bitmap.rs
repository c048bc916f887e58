//! Dirty bitmaps as their readers see them: the capability of a device that keeps them
//! ([`DirtyBitmaps`]), and one bitmap ([`DirtyMap`]); and as a device that changes data
//! sees them: a [`ChangeLog`] to mark before each change.

use std::sync::Arc;

use crate::error::Error;

/// A device that keeps dirty bitmaps, set by every change of its data (an NBD client
/// reads them as `qemu:dirty-bitmap:NAME` contexts).
pub trait DirtyBitmaps: Send + Sync {
    /// Names of its bitmaps, in the order they were added.
    fn names(&self) -> Vec<String>;

    /// The bitmap `name`, for a reader. A reader holding it keeps it from being removed.
    fn reader(&self, name: &str) -> Option<Arc<dyn DirtyMap>>;
}

/// A dirty bitmap as its readers see it: which ranges have changed since it started.
pub trait DirtyMap: Send + Sync {
    /// Bytes per bit.
    fn granularity(&self) -> u64;

    /// Appends the runs of `[offset, offset + len)` as (length, dirty), neighbours of the
    /// same state merged, at most `most` of them; the first starts at `offset`, and
    /// unless cut short by `most` they cover `len` bytes (a range past the bitmap's end
    /// reads as dirty: nothing says it did not change).
    fn runs(&self, offset: u64, len: u64, most: usize, out: &mut Vec<(u64, bool)>);

    /// Whether the bitmap may miss changes (a mark that could not be written, a page of
    /// its bits found damaged, or a device grown past it): such a bitmap must not be
    /// trusted for an incremental backup.
    fn inconsistent(&self) -> bool;
}

/// A record of the changes made to a device (the dirty layer's bitmap store), marked
/// before each change is sent. The dirty layer marks it itself, in its queues, unless the
/// device below orders its writes itself and must mark inside that order: a thin volume
/// marks inside its pool's gate, so that a snapshot and the marks agree on which writes
/// came before it. Such a device takes the log from its capability and knows nothing
/// else of it.
pub trait ChangeLog: Send + Sync {
    /// Where the log is kept, for messages (a store's path).
    fn describe(&self) -> String;

    /// A marker for one queue, used on that queue's reactor only.
    fn marker(self: Arc<Self>) -> Box<dyn ChangeMarker>;
}

/// One queue's way to mark a [`ChangeLog`]: once a range's marks are in place, marking it
/// again costs a check, with no lock and no allocation.
pub trait ChangeMarker {
    /// Records that `[offset, offset + len)` is about to change. An error: the mark could
    /// not be recorded, and the change must fail unsent.
    fn mark(&self, offset: u64, len: u64) -> Result<(), Error>;
}
