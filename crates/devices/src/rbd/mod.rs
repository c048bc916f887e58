//! Ceph RBD images (librbd, loaded when first needed).
//!
//! [`ffi`] loads librados and librbd and resolves the calls cairn makes; [`session`]
//! connects to a cluster and opens pools and images, each closed when dropped. The device
//! that serves an image's requests from a reactor is built on these.

pub mod ffi;
pub mod session;

#[cfg(test)]
mod tests;
