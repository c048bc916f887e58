//! cairn's engine: the vocabulary every device, stack and frontend shares.
//!
//! - [`io`]: one I/O request ([`Io`]), its operations, flags and completion status.
//! - [`device`]: the [`Device`] (shared, configured) and [`Queue`] (one per reactor) traits,
//!   and the [`Geometry`] every request is checked against at the edge.
//! - [`capability`]: what only some devices do, each a small trait a device offers and a
//!   caller asks for: [`array`] (an array's state and the admin's actions), a write-back
//!   cache's counters, [`bitmap`] (dirty bitmaps).
//! - [`reactor`]: the per-thread event loop: its io_uring, the plug (batched submission),
//!   the cached clock, the completion FIFO and the sinks completions are delivered to.
//! - [`stats`]: per-queue statistics in the shape of `/proc/diskstats`, plus latency
//!   histograms.
//! - [`ondisk`]: what cairn's own on-disk formats share: little-endian fields, UUIDs,
//!   the exclusive lock on a file, and the framing of a record kept in two checksummed
//!   slots.
//! - [`size`]: parsing and printing of sizes such as `4k` and `1GiB`.
//! - [`socket`]: binding listeners at Unix socket paths by one rule: a stale socket is
//!   replaced, a live one or anything else is refused and left as it is.
//!
//! Nothing here allocates, locks or hands work to another thread per I/O.
#![warn(missing_docs)]

pub mod array;
pub mod bitmap;
pub mod blocking;
pub mod buf;
pub mod capability;
pub mod clock;
pub mod device;
pub mod error;
pub mod event;
pub mod flush;
pub mod frontend;
#[doc(hidden)]
pub mod fuzzing;
pub mod handoff;
pub mod io;
pub mod ondisk;
pub mod reactor;
pub mod size;
pub mod slab;
pub mod socket;
pub mod stats;
#[doc(hidden)]
pub mod testing;

pub use array::{Array, ArrayMember, ArrayReport, ArraySync};
pub use bitmap::{ChangeLog, ChangeMarker, DirtyBitmaps, DirtyMap};
pub use buf::AlignedBuf;
pub use capability::{Offer, Want, WriteBackCache, Writeback};
pub use clock::{Clock, ClockMode};
pub use device::{Caps, Device, Extent, Geometry, LostWrites, Queue};
pub use error::{Error, IoError};
pub use flush::{FlushBatcher, FlushMode};
pub use frontend::{Frontend, FrontendPart};
pub use io::{Io, IoFlags, IoStatus, Op, SinkId};
pub use reactor::{
    CoalesceMode, Core, DispatchMode, Poller, Reactor, ReapMode, RingUser, Sink, Switches,
    WritebackMode,
};
pub use stats::{DeviceStatsSnapshot, QueueStats, StatsMode};
