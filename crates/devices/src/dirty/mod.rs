//! Named dirty bitmaps (issue 38): which granules of a device changed since each bitmap
//! started, kept across restarts in a store file of the device's own (`bitmaps = PATH`),
//! exact after any stop. [`format`] is the store's directory on disk, [`bitmap`] one bitmap in
//! memory, [`store`] the bitmaps and the rule that keeps them exact (checkpoints in
//! `checkpoint`), [`device`] the layer that sets them.

pub mod bitmap;
mod checkpoint;
pub mod device;
pub mod format;
pub mod store;
