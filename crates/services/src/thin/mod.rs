//! Thin pools: volumes that allocate on write, snapshots and clones.
//! [`superblock`] says where everything is; [`format`] is the metadata log;
//! [`capability`] is what the admin and the layers above ask of a pool and a volume;
//! [`volume`] is a thin volume as a block device ([`ThinDevice`]) and its queues;
//! [`backup`] keeps the volumes' backup checkpoints in the pool's metadata;
//! [`error`] is what can go wrong ([`ThinError`]).

pub mod backup;
pub mod capability;
pub mod checkpoint;
mod commit;
pub mod error;
pub mod format;
mod open;
pub mod pool;
pub mod state;
pub mod superblock;
pub mod table;
pub mod volume;
mod zeroing;

pub use capability::{ThinPoolAdmin, ThinVolume};
pub use error::{Down, ThinError};
pub use volume::ThinDevice;
