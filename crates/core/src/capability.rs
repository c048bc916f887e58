//! Capabilities: what only some devices do, asked for by the trait that says it.
//!
//! [`Device`] holds what every device has. What only some devices do is a small trait
//! of its own: an array's state ([`crate::array::Array`]), a
//! write-back cache's counters ([`WriteBackCache`]), dirty bitmaps
//! ([`crate::bitmap::DirtyBitmaps`]), and in higher crates the admin's actions on an
//! array, a thin pool's volumes, a throttle's limits, a crypt device's key slots. A device offers the traits it
//! implements from [`Device::offer`]; a caller asks with
//! `device.capability::<dyn Trait>()` and gets the device as that trait, or `None`.
//!
//! A trait whose vocabulary belongs to a higher crate lives in that crate, where both
//! the device and the admin reach it: this module only carries the request (the trait's
//! type) and the answer. A lookup clones an `Arc` and boxes it: admin-time work, which
//! nothing on the I/O path does.

use std::any::{Any, TypeId};
use std::sync::Arc;

use crate::device::Device;

/// The capability a caller asks a device for: a trait object type, such as
/// `dyn Array`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Want(TypeId);

impl Want {
    /// Asks for capability `C`.
    pub fn of<C: ?Sized + 'static>() -> Want {
        Want(TypeId::of::<C>())
    }

    /// Offers `make()` as capability `C` if `C` is what is wanted (else `None`, and
    /// `make` is not called). A device offers several by chaining them with `or_else`.
    pub fn offer<C: ?Sized + Send + Sync + 'static>(
        self,
        make: impl FnOnce() -> Arc<C>,
    ) -> Option<Offer> {
        (self == Want::of::<C>()).then(|| Offer(Box::new(make())))
    }
}

/// A device's answer to a [`Want`]: the capability, as the `Arc<C>` it was asked for.
pub struct Offer(Box<dyn Any + Send + Sync>);

impl Offer {
    /// The capability, if it is a `C` (a device that answered for another is `None`).
    fn take<C: ?Sized + Send + Sync + 'static>(self) -> Option<Arc<C>> {
        self.0.downcast::<Arc<C>>().ok().map(|c| *c)
    }
}

impl dyn Device {
    /// This device as capability `C` (a trait object type, e.g.
    /// `d.capability::<dyn Array>()`), if it offers it.
    pub fn capability<C: ?Sized + Send + Sync + 'static>(self: &Arc<Self>) -> Option<Arc<C>> {
        Arc::clone(self).offer(Want::of::<C>())?.take()
    }
}

/// A write-back cache: writes it acknowledged and holds in memory until they reach the
/// device below.
pub trait WriteBackCache: Send + Sync {
    /// Its own counters (not those of caches below it): bytes dirty now, and bytes
    /// written back so far.
    fn counters(&self) -> Writeback;

    /// Bytes it wrote back a second, over the last second or two.
    fn rate_bytes_per_s(&self) -> u64;
}

/// A write-back cache's counters ([`WriteBackCache::counters`]), or those of every cache
/// of a tree ([`writeback_totals`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Writeback {
    /// Bytes acknowledged and not yet written back.
    pub dirty_bytes: u64,
    /// Bytes written back so far.
    pub written_bytes: u64,
}

/// The write-back counters of every cache in the tree of `device`, summed.
pub fn writeback_totals(device: &Arc<dyn Device>) -> Writeback {
    let own = device
        .capability::<dyn WriteBackCache>()
        .map(|c| c.counters())
        .unwrap_or_default();
    device
        .children()
        .iter()
        .map(writeback_totals)
        .fold(own, |a, b| Writeback {
            dirty_bytes: a.dirty_bytes + b.dirty_bytes,
            written_bytes: a.written_bytes + b.written_bytes,
        })
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use super::*;
    use crate::{Caps, Core, Error, Geometry, Queue};

    trait Answer: Send + Sync {
        fn answer(&self) -> u32;
    }

    trait Other: Send + Sync {}

    struct Plain;
    struct Offering;

    fn geometry() -> Geometry {
        Geometry {
            size_bytes: 1 << 20,
            block_bytes: 512,
            caps: Caps::ALL,
        }
    }

    impl Device for Plain {
        fn name(&self) -> &str {
            "plain"
        }
        fn describe(&self) -> String {
            String::new()
        }
        fn geometry(&self) -> Geometry {
            geometry()
        }
        fn open_queue(&self, _core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
            Err(Error::Invalid("no queues".into()))
        }
    }

    impl Device for Offering {
        fn name(&self) -> &str {
            "offering"
        }
        fn describe(&self) -> String {
            String::new()
        }
        fn geometry(&self) -> Geometry {
            geometry()
        }
        fn open_queue(&self, _core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
            Err(Error::Invalid("no queues".into()))
        }
        fn offer(self: Arc<Self>, want: Want) -> Option<Offer> {
            want.offer::<dyn Answer>(|| self)
        }
    }

    impl Answer for Offering {
        fn answer(&self) -> u32 {
            42
        }
    }

    /// A device is found as the capability it offers, and as no other; a device that
    /// offers none is found as none.
    #[test]
    fn a_device_is_found_as_what_it_offers_only() {
        let offering: Arc<dyn Device> = Arc::new(Offering);
        let plain: Arc<dyn Device> = Arc::new(Plain);
        assert_eq!(
            offering.capability::<dyn Answer>().map(|a| a.answer()),
            Some(42)
        );
        assert!(offering.capability::<dyn Other>().is_none());
        assert!(plain.capability::<dyn Answer>().is_none());
    }
}
