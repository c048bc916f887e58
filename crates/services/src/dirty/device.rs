//! A device with dirty bitmaps: its own device, plus a store whose enabled bitmaps every
//! change of data sets before it is sent.
//!
//! The queue adds no per-request state and no completion of its own: a change whose
//! granules are all set already (every one after the first to a granule) costs one
//! generation load and one bit test per bitmap, then goes to the device's queue as it
//! came; reads and flushes go straight through.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use cairn_core::{
    Core, Device, DirtyBitmaps, DirtyMap, Error, Extent, Geometry, Io, IoStatus, Offer, Queue,
    QueueStats, Want,
};

use super::bitmap::Bitmap;
use super::store::Store;

/// A queue's copy of the enabled bitmaps, as of a store generation.
pub type Enabled = RefCell<(u64, Vec<Arc<Bitmap>>)>;

/// Sets the bits of `io` in every enabled bitmap of `store` that lacks them: nothing but
/// a generation load and a bit test per bitmap once they are set.
#[inline]
pub fn mark(store: &Store, enabled: &Enabled, io: &Io) -> Result<(), Error> {
    if io.len == 0 {
        return Ok(());
    }
    if enabled.borrow().0 != store.generation() {
        // Rarely: a bitmap was added, removed or disabled.
        *enabled.borrow_mut() = store.enabled();
    }
    if enabled
        .borrow()
        .1
        .iter()
        .all(|b| b.covers(io.offset, io.len))
    {
        return Ok(());
    }
    store.mark(io.offset, io.len)
}

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
    /// Tracks the changes of `base` in `store`. A thin volume's queues set the bitmaps
    /// themselves, inside the pool's gate; its checkpoints a stop interrupted are
    /// settled now, from the snapshots its pool holds.
    pub fn new(base: Arc<dyn Device>, store: Store) -> Result<TrackedDevice, Error> {
        let store = Arc::new(store);
        let thin = base
            .as_any()
            .and_then(|a| a.downcast_ref::<crate::thin::queue::ThinDevice>());
        if let Some(t) = thin {
            t.track(store.clone())?;
            store.reconcile(&|name| t.pool().has_volume(name))?;
        }
        Ok(TrackedDevice {
            marks: thin.is_none(),
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

    /// The device it tracks.
    pub fn base(&self) -> &Arc<dyn Device> {
        &self.base
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
            store: self.store.clone(),
            enabled: RefCell::new(self.store.enabled()),
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
    /// Its bitmaps; and it stands in for its base: what its base is (an array, a cache),
    /// it is.
    fn offer(self: Arc<Self>, want: Want) -> Option<Offer> {
        let base = Arc::clone(&self.base);
        want.offer::<dyn DirtyBitmaps>(|| self)
            .or_else(|| base.offer(want))
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

impl DirtyBitmaps for TrackedDevice {
    fn names(&self) -> Vec<String> {
        self.store.names(&self.owner)
    }
    fn reader(&self, name: &str) -> Option<Arc<dyn DirtyMap>> {
        self.store
            .reader(&self.owner, name)
            .map(|r| Arc::new(r) as Arc<dyn DirtyMap>)
    }
}

struct TrackedQueue {
    core: Rc<Core>,
    base: Rc<dyn Queue>,
    store: Arc<Store>,
    enabled: Enabled,
}

impl Queue for TrackedQueue {
    #[inline]
    fn submit(&self, io: Io) {
        if io.op.is_write() {
            if let Err(e) = mark(&self.store, &self.enabled, &io) {
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

/// Checkpoint `name` of the thin volume `tracked` serves: its snapshot `name`, taken
/// while writes to it are held, with the bitmaps turned over at that instant (see
/// [`Store::checkpoint_begin`]; `granularity` for its new bitmap). Returns what was done.
pub fn checkpoint(
    tracked: &TrackedDevice,
    name: &str,
    granularity: Option<u64>,
) -> Result<String, String> {
    let thin = tracked
        .base
        .as_any()
        .and_then(|a| a.downcast_ref::<crate::thin::queue::ThinDevice>())
        .ok_or_else(|| format!("device '{}' is not a thin volume", tracked.name()))?;
    super::format::check_name(name)?;
    let hook = Arc::new(CheckpointHook {
        store: tracked.store.clone(),
        name: name.to_string(),
        granularity,
        previous: std::sync::Mutex::new(None),
    });
    let done = thin.pool().admin(crate::thin::pool::Admin::Checkpoint {
        src: thin.volume().to_string(),
        name: name.to_string(),
        hook: crate::thin::pool::Hook(hook.clone()),
    })?;
    let previous = hook
        .previous
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    Ok(match previous {
        Some(p) => format!(
            "{done}; bitmap '{p}' (changes since checkpoint '{p}') is attached to snapshot '{name}', and bitmap '{name}' counts from now"
        ),
        None => format!("{done}; bitmap '{name}' counts from now"),
    })
}

/// Turns a volume's bitmaps over while its checkpoint's snapshot holds its writes.
struct CheckpointHook {
    store: Arc<Store>,
    name: String,
    granularity: Option<u64>,
    previous: std::sync::Mutex<Option<String>>,
}

impl crate::thin::pool::SnapshotHook for CheckpointHook {
    fn held(&self) -> Result<(), String> {
        let previous = self.store.checkpoint_begin(&self.name, self.granularity)?;
        *self.previous.lock().unwrap_or_else(|p| p.into_inner()) = previous;
        Ok(())
    }

    fn done(&self, taken: bool) {
        self.store.checkpoint_end(&self.name, taken);
    }
}
