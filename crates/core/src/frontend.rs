//! Frontends: what brings requests to a server's devices besides NBD connections (a FUSE
//! mount, say). A frontend runs a part of itself on every reactor of the server, beside
//! the NBD connections, and takes part in the orderly shutdown.

use std::rc::Rc;

use crate::error::Error;
use crate::reactor::Core;

/// Something served on every reactor of `cairn serve`.
pub trait Frontend: Send + Sync {
    /// What it is, for logs (e.g. `fuse /mnt/disk0 (export 'disk0')`).
    fn describe(&self) -> String;

    /// Starts this frontend's part on the reactor `core`, the `index`-th of `count`; called
    /// on the reactor's own thread, before it runs.
    fn start(
        &self,
        core: &Rc<Core>,
        index: usize,
        count: usize,
    ) -> Result<Rc<dyn FrontendPart>, Error>;

    /// Shutdown has begun (SIGTERM): called on the main thread, which may be held until
    /// the frontend has flushed and let go of what the kernel holds (an unmount). The
    /// parts then end by themselves, each calling [`Core::stop`] on its reactor.
    fn stop(&self);
}

/// A frontend's part on one reactor.
pub trait FrontendPart {
    /// Whether this part has ended (the reactor runs until every part has).
    fn ended(&self) -> bool;
}
