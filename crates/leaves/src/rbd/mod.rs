//! Ceph RBD images (librbd, loaded when first needed).
//!
//! [`ffi`] loads librados and librbd and resolves the calls cairn makes; [`session`]
//! connects to a cluster and opens pools and images, each closed when dropped;
//! [`RbdDevice`] serves an image's requests from every reactor on one image handle.

mod device;
pub mod ffi;
mod queue;
pub mod session;

pub use device::{Connection, RbdDevice, RbdTarget, DEFAULT_TIMEOUT};
