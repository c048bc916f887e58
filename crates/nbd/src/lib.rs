//! NBD serving for cairn: the wire protocol, the handshake, and the transmission phase on
//! cairn's reactors.

#![warn(missing_docs)]

mod admit;
pub mod client;
pub mod conn;
mod gather;
pub mod handshake;
pub mod observe;
pub mod pool;
pub mod proto;
pub mod remote;
mod rmw;
pub mod server;
pub mod tls;
pub mod uri;

pub use conn::{Export, Limits};
pub use handshake::{Catalog, ExportInfo, TlsMode};
pub use observe::Observer;
pub use server::{serve, Config, Listen, Listeners};
