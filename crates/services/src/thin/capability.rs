//! What the admin and the layers above ask of a thin pool and of a thin volume: the
//! capabilities their devices offer ([`ThinPoolAdmin`], [`ThinVolume`]). Nothing outside
//! this module tree reaches the pool's run-time state.

use std::sync::Arc;

use cairn_core::{ChangeLog, Error};

use super::backup::CheckpointInfo;
use super::error::ThinError;
use super::pool::{Admin, PoolReport};
use super::volume::ThinDevice;

/// A thin pool, as the admin and its volumes' devices see it.
pub trait ThinPoolAdmin: Send + Sync {
    /// The pool's name (its device's in the stack file).
    fn name(&self) -> &str;

    /// Facts for `status` and the metrics.
    fn report(&self) -> PoolReport;

    /// Whether the pool has a volume `name` (a snapshot, say).
    fn has_volume(&self, name: &str) -> bool;

    /// Its volumes' backup checkpoints, by volume, oldest first.
    fn checkpoints(&self) -> Vec<CheckpointInfo>;

    /// The exports added while serving that it keeps for the next start: (export name,
    /// volume, writable).
    fn exports(&self) -> Vec<(String, String, bool)>;

    /// Runs an admin operation (create, snapshot, clone, delete, grow, a checkpoint's
    /// snapshot) and waits until it is durable: what was done, or why not.
    fn admin(&self, op: Admin) -> Result<String, ThinError>;

    /// Volume `volume` of the pool as device `name`, created when absent if `size` is
    /// given and `create` (else a stand-in for `cairn check`). The device keeps the pool
    /// open. ([`ThinDevice::open`] finds the pool of a device and calls this.)
    fn open_volume(
        self: Arc<Self>,
        name: &str,
        volume: &str,
        size: Option<u64>,
        create: bool,
    ) -> Result<ThinDevice, Error>;
}

/// A thin volume (or snapshot, or clone), as the layers over it see it: the dirty layer
/// keeps its bitmaps and takes checkpoints through it.
pub trait ThinVolume: Send + Sync {
    /// Its pool.
    fn pool(&self) -> Arc<dyn ThinPoolAdmin>;

    /// Its volume's name in the pool.
    fn volume(&self) -> &str;

    /// Every queue of every device on the volume marks `log` before each change, inside
    /// the pool's gate: a snapshot taken while writes are held (a checkpoint) and the
    /// marks then agree on which writes came before it. A volume has one log.
    fn track(&self, log: Arc<dyn ChangeLog>) -> Result<(), Error>;
}
