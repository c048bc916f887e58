//! The client side: the `nbd` device, a block device backed by any NBD server.
//!
//! - [`handshake`]: connect and negotiate (blocking, once per connection);
//! - [`remote`]: the device and its queues on cairn's reactors.

pub mod handshake;
pub mod remote;
