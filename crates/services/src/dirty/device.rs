//! A device with dirty bitmaps: its own device, plus a store whose enabled bitmaps every
//! change of data sets before it is sent.
//!
//! The queue adds no per-request state and no completion of its own: a change whose
//! granules are all set already (every one after the first to a granule) costs one
//! generation load and one bit test per bitmap, then goes to the device's queue as it
//! came; reads and flushes go straight through.
//!
//! Over a thin volume the layer marks nothing itself: the store is the volume's
//! [`ChangeLog`], which the volume's own queues mark inside the pool's gate (so that a
//! snapshot and the bitmaps agree on which writes came before it). A thin volume's
//! backup checkpoints are kept by its pool, not here (see `thin::backup`): the layer
//! offers them beside the store's own bitmaps (those added by hand, and those of
//! checkpoints taken by cairn before the pool kept them).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use cairn_core::{
    ChangeLog, ChangeMarker, Core, Device, DirtyBitmaps, DirtyMap, Error, Extent, Geometry, Io,
    IoStatus, Offer, Queue, QueueStats, Want,
};

use super::store::{Enabled, Store};
use crate::thin::ThinVolume;

/// A device and its bitmap store. Named as its device, and shown as it is with its store.
pub struct TrackedDevice {
    base: Arc<dyn Device>,
    store: Arc<Store>,
    /// Whose bitmaps it offers readers: empty for the device's own, else a snapshot's.
    owner: String,
    /// Its queues set the bitmaps (a thin volume's own queues do instead).
    marks: bool,
}

impl TrackedDevice {
    /// Tracks the changes of `base` in `store`. A thin volume's queues mark the store
    /// themselves, inside the pool's gate (its [`ThinVolume`] capability takes it); its
    /// checkpoints a stop interrupted are settled now, from the snapshots its pool holds.
    pub fn new(base: Arc<dyn Device>, store: Store) -> Result<TrackedDevice, Error> {
        let store = Arc::new(store);
        let volume = base.capability::<dyn ThinVolume>();
        if let Some(v) = &volume {
            v.track(store.clone())?;
            let pool = v.pool();
            store.reconcile(&|name| pool.has_volume(name))?;
        }
        Ok(TrackedDevice {
            marks: volume.is_none(),
            base,
            store,
            owner: String::new(),
        })
    }

    /// Snapshot `base` (read-only) offering the bitmaps `store` keeps attached to it.
    pub fn view(base: Arc<dyn Device>, store: Arc<Store>, owner: &str) -> TrackedDevice {
        TrackedDevice {
            base,
            store,
            owner: owner.to_string(),
            marks: false,
        }
    }

    /// Its store.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }
}

impl Device for TrackedDevice {
    fn name(&self) -> &str {
        self.base.name()
    }
    fn describe(&self) -> String {
        let n = self.store.names(&self.owner).len();
        format!(
            "{}; {} in {}",
            self.base.describe(),
            cairn_core::size::plural(n as u64, "dirty bitmap", "dirty bitmaps"),
            self.store.path().display()
        )
    }
    fn geometry(&self) -> Geometry {
        self.base.geometry()
    }
    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
        let base = cairn_core::handoff::open_member(core, &self.base)?;
        if !self.marks {
            return Ok(base);
        }
        Ok(Rc::new(TrackedQueue {
            core: core.clone(),
            base,
            marker: Marker::new(self.store.clone()),
        }))
    }
    fn base(&self) -> Option<&Arc<dyn Device>> {
        Some(&self.base)
    }
    /// It stands in for its base in the tree (under the same name): its base's children.
    fn children(&self) -> Vec<Arc<dyn Device>> {
        self.base.children()
    }
    fn extents(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        self.base.extents(offset, len, out)
    }
    /// Its bitmaps, and (unless it is a view of a snapshot) their store for the admin;
    /// and it stands in for its base: what its base is (an array, a cache, a thin
    /// volume), it is.
    fn offer(self: Arc<Self>, want: Want) -> Option<Offer> {
        let base = Arc::clone(&self.base);
        let own_store = self.owner.is_empty().then(|| self.store.clone());
        want.offer::<dyn DirtyBitmaps>(|| self)
            .or_else(|| own_store.and_then(|s| want.offer::<Store>(|| s)))
            .or_else(|| base.offer(want))
    }
}

/// The store's bitmaps, then those of its base (a thin volume's checkpoints) that the
/// store has no bitmap of the same name for.
impl DirtyBitmaps for TrackedDevice {
    fn names(&self) -> Vec<String> {
        let mut names = self.store.names(&self.owner);
        if let Some(below) = self.base.capability::<dyn DirtyBitmaps>() {
            for n in below.names() {
                if !names.contains(&n) {
                    names.push(n);
                }
            }
        }
        names
    }
    fn reader(&self, name: &str) -> Option<Arc<dyn DirtyMap>> {
        match self.store.reader(&self.owner, name) {
            Some(r) => Some(Arc::new(r) as Arc<dyn DirtyMap>),
            None => self.base.capability::<dyn DirtyBitmaps>()?.reader(name),
        }
    }
}

struct TrackedQueue {
    core: Rc<Core>,
    base: Rc<dyn Queue>,
    marker: Marker,
}

impl Queue for TrackedQueue {
    #[inline]
    fn submit(&self, io: Io) {
        if io.op.is_write() {
            if let Err(e) = self.marker.mark(io.offset, io.len) {
                log::error!("cairn: {e}: the write fails");
                // Never complete inside submit: through the FIFO.
                self.core
                    .complete(io.sink, io.token, IoStatus::errno(libc::EIO));
                return;
            }
        }
        self.base.submit(io);
    }

    fn stats(&self) -> &QueueStats {
        self.base.stats()
    }

    fn children(&self) -> Vec<Rc<dyn Queue>> {
        self.base.children()
    }
}

/// The store is the log of its device's changes: a thin volume marks it through this,
/// from its own queues.
impl ChangeLog for Store {
    fn describe(&self) -> String {
        self.path().display().to_string()
    }

    fn marker(self: Arc<Self>) -> Box<dyn ChangeMarker> {
        Box::new(Marker::new(self))
    }
}

/// One queue's marker of a store: the store, and the queue's copy of its enabled
/// bitmaps.
struct Marker {
    store: Arc<Store>,
    enabled: RefCell<Enabled>,
}

impl Marker {
    fn new(store: Arc<Store>) -> Marker {
        Marker {
            enabled: RefCell::new(store.enabled()),
            store,
        }
    }
}

impl ChangeMarker for Marker {
    /// Sets the bits of the range in every enabled bitmap that lacks them: nothing but a
    /// generation load and a bit test per bitmap once they are set.
    #[inline]
    fn mark(&self, offset: u64, len: u64) -> Result<(), Error> {
        if len == 0 {
            return Ok(());
        }
        if self.enabled.borrow().generation != self.store.generation() {
            // Rarely: a bitmap was added, removed or disabled.
            *self.enabled.borrow_mut() = self.store.enabled();
        }
        if self
            .enabled
            .borrow()
            .bitmaps
            .iter()
            .all(|b| b.covers(offset, len))
        {
            return Ok(());
        }
        self.store.mark(offset, len)
    }
}
