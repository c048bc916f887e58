//! NBD for cairn: the server that exports cairn's devices, and the `nbd` device, a client
//! of any NBD server.
//!
//! - [`proto`] (the wire format), `gather` (output queues sent with `sendmsg`),
//!   `tls_send` (output queues sent over TLS), [`uri`] (NBD URIs) and [`tls`] (rustls
//!   set-up): shared by both sides;
//! - [`server`]: listeners, the handshake and the transmission phase on cairn's reactors;
//! - [`client`]: the client handshake and the `nbd` device;
//! - [`error`]: [`Error`], why an export change, a `--listen` address or an NBD URI is
//!   refused.

#![warn(missing_docs)]

pub mod client;
pub mod error;
mod gather;
pub mod proto;
pub mod server;
pub mod tls;
mod tls_send;
pub mod uri;

pub use error::Error;
pub use server::conn::{Export, Limits};
pub use server::handshake::{Catalog, ExportInfo, TlsMode};
pub use server::observe::Observer;
pub use server::table::ExportTable;
pub use server::{serve, signal_name, Config, Listen, Listeners};
