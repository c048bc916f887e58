//! Named dirty bitmaps: which granules of a device changed since each bitmap
//! started, kept across restarts in a store file of the device's own (`bitmaps = PATH`),
//! exact after any stop. [`format`] is the store's directory on disk, [`bitmap`] one bitmap in
//! memory, [`store`] the bitmaps and the rule that keeps them exact (checkpoints in
//! `checkpoint`; opening a store, and the damage found there, in `open`), [`device`] the
//! layer that sets them. [`error`] says what can go wrong ([`DirtyError`]).

pub mod bitmap;
mod checkpoint;
pub mod device;
pub mod error;
pub mod format;
mod open;
pub mod store;

pub use error::{DirtyError, PageDamage};
