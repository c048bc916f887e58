//! An RBD image as a cairn device: one image handle shared by every queue.
//!
//! Two handles on one image would pass the exclusive lock back and forth on every write
//! (measured: 119 writes/s against 1242 with one handle, BENCHMARKS.md), so the device
//! opens the image once and each reactor's queue submits on that handle; librbd's calls
//! are thread-safe. Completions come back through one eventfd registered with
//! `rbd_set_image_notification`, which every busy queue watches through its reactor's ring;
//! whichever queue wakes takes the completions from librbd (`rbd_poll_io_events`) and
//! finishes its own at once. A completion of another queue goes to that queue's
//! [`Inbox`]: its result is stored in the slot's cell, a bit is set, and the owner's
//! eventfd is written once per batch. No lock and no allocation on cairn's side; librbd
//! allocates its completion object per request.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cairn_core::{Caps, Core, Device, Error, Extent, Geometry, Queue};

use super::ffi::{self, Api};
use super::session::{fail, Cluster, Image};

/// Requests in flight per queue; more wait in the queue's FIFO.
pub(super) const QUEUE_DEPTH: usize = crate::file::QUEUE_DEPTH;
/// Queues (reactors) one device can have open at once: a completion names its queue in
/// the upper half of librbd's argument, and a batch's wake-ups are a 64-bit mask.
pub(super) const MAX_QUEUES: usize = 64;
/// Logical block size: librbd takes any byte range; 512 is what disks and NBD clients use.
const BLOCK_BYTES: u32 = 512;

/// The default of `timeout`: connecting, and every request to a monitor or an OSD.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// How the device reaches its cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Connection {
    /// One connection per (conf, id, timeout), shared by every image that names them.
    #[default]
    Shared,
    /// A connection of the image's own.
    Image,
}

impl Connection {
    /// Parses `shared` or `image`.
    pub fn parse(s: &str) -> Result<Connection, crate::Error> {
        match s {
            "shared" => Ok(Connection::Shared),
            "image" => Ok(Connection::Image),
            _ => Err(crate::Error::UnknownConnection(s.to_string())),
        }
    }

    /// The name [`Connection::parse`] takes.
    pub fn as_str(self) -> &'static str {
        match self {
            Connection::Shared => "shared",
            Connection::Image => "image",
        }
    }
}

/// Where an image is and how to reach it: the fields of `rbd:POOL/[NS/]IMAGE[,...]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbdTarget {
    /// The pool.
    pub pool: String,
    /// The namespace in the pool, if any.
    pub namespace: Option<String>,
    /// The image.
    pub image: String,
    /// The Ceph configuration file (librados' default search when `None`).
    pub conf: Option<PathBuf>,
    /// The client id, without `client.` (`admin` when `None`).
    pub id: Option<String>,
    /// Open this snapshot, read-only.
    pub snapshot: Option<String>,
    /// Bound on connecting and on every request.
    pub timeout: Duration,
    /// Shared or own cluster connection.
    pub connection: Connection,
}

impl RbdTarget {
    /// `POOL/[NS/]IMAGE[@SNAP]`.
    pub fn path(&self) -> String {
        let mut s = self.pool.clone();
        if let Some(ns) = &self.namespace {
            s = format!("{s}/{ns}");
        }
        s = format!("{s}/{}", self.image);
        if let Some(snap) = &self.snapshot {
            s = format!("{s}@{snap}");
        }
        s
    }
}

/// Completions of one queue that another queue took from librbd.
pub(super) struct Inbox {
    /// librbd's return value per slot, stored before the slot's bit is set.
    results: Box<[AtomicI64]>,
    /// One bit per slot with a result waiting.
    ready: Box<[AtomicU64]>,
    /// Written once per batch that posted here; the owner's reactor watches it.
    pub(super) wake: OwnedFd,
}

impl Inbox {
    fn new() -> Result<Inbox, Error> {
        let flags = rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC;
        Ok(Inbox {
            results: (0..QUEUE_DEPTH).map(|_| AtomicI64::new(0)).collect(),
            ready: (0..QUEUE_DEPTH.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            wake: rustix::event::eventfd(0, flags)
                .map_err(|e| Error::os("rbd: eventfd", e.into()))?,
        })
    }

    /// Leaves `result` for the request in `slot` (the caller wakes the owner after).
    pub(super) fn post(&self, slot: u32, result: i64) {
        self.results[slot as usize].store(result, Ordering::Relaxed);
        // Release: the owner that sees the bit sees the result.
        self.ready[slot as usize / 64].fetch_or(1 << (slot % 64), Ordering::Release);
    }

    /// Calls `f(slot, result)` for every result left so far.
    pub(super) fn take(&self, mut f: impl FnMut(u32, i64)) -> usize {
        let mut n = 0;
        for (w, word) in self.ready.iter().enumerate() {
            if word.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = word.swap(0, Ordering::Acquire);
            while bits != 0 {
                let bit = bits.trailing_zeros();
                bits &= bits - 1;
                let slot = w as u32 * 64 + bit;
                f(slot, self.results[slot as usize].load(Ordering::Relaxed));
                n += 1;
            }
        }
        n
    }
}

/// What every queue of the device shares.
pub(super) struct Shared {
    pub(super) api: &'static Api,
    /// Dropped (closed) before `eventfd`, which librbd writes to until then.
    pub(super) image: Image,
    /// Registered with `rbd_set_image_notification`: librbd adds to it per completion.
    pub(super) eventfd: OwnedFd,
    /// A queue's inbox, made when a queue first takes its index, kept after.
    inboxes: Box<[OnceLock<Inbox>]>,
    /// Which indexes open queues hold.
    taken: Box<[AtomicBool]>,
    pub(super) timeout: Duration,
    /// librbd's cache is on for the image: a FUA write needs a flush after it.
    pub(super) cache_on: bool,
}

impl Shared {
    /// The inbox of the queue with `index` (made by the queue before it submits).
    pub(super) fn inbox(&self, index: usize) -> Option<&Inbox> {
        self.inboxes.get(index)?.get()
    }

    /// Claims a free queue index and makes sure its inbox exists.
    fn claim(&self) -> Result<usize, Error> {
        for (i, t) in self.taken.iter().enumerate() {
            if t.compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                if self.inboxes[i].get().is_none() {
                    match Inbox::new() {
                        // Only the holder of index i sets it.
                        Ok(inbox) => {
                            let _ = self.inboxes[i].set(inbox);
                        }
                        Err(e) => {
                            t.store(false, Ordering::Release);
                            return Err(e);
                        }
                    }
                }
                return Ok(i);
            }
        }
        Err(Error::Invalid(format!(
            "rbd: at most {MAX_QUEUES} reactors can use one image"
        )))
    }

    /// Gives back a queue's index (its requests all completed).
    pub(super) fn release(&self, index: usize) {
        self.taken[index].store(false, Ordering::Release);
    }
}

/// An RBD image.
pub struct RbdDevice {
    name: String,
    target: RbdTarget,
    monitors: String,
    read_only: bool,
    geometry: Geometry,
    /// The image's object size: block status asks from an object's start.
    object_bytes: u64,
    shared: Arc<Shared>,
}

impl RbdDevice {
    /// Connects (or shares a connection), opens the image and registers its eventfd.
    /// Blocks for at most the target's timeout per step; never call it on a reactor.
    pub fn open(name: &str, target: &RbdTarget) -> Result<RbdDevice, Error> {
        let conf = target.conf.as_deref();
        let id = target.id.as_deref();
        let cluster = match target.connection {
            Connection::Shared => Cluster::shared(conf, id, target.timeout)?,
            Connection::Image => Cluster::connect(conf, id, target.timeout)?,
        };
        let pool = cluster.pool(&target.pool, target.namespace.as_deref())?;
        let image = pool.open(&target.image, target.snapshot.as_deref())?;
        let size = image.size()?;
        let object_bytes = image.object_bytes()?;
        // cairn turns librbd's cache off; a pool's or the image's own configuration can
        // turn it back on, and then a completed write is not yet on the OSDs.
        let cache_on = image.config("rbd_cache").is_none_or(|v| v != "false");
        if cache_on {
            log::warn!(
                "cairn: rbd: {}: librbd's cache is on for this image (a pool or image override of rbd_cache): writes are durable after a flush, and each FUA write is followed by one",
                target.path()
            );
        }
        let api = image.api();
        if size < u64::from(BLOCK_BYTES) {
            return Err(Error::Invalid(format!(
                "rbd: image {} is {size} bytes: smaller than one {BLOCK_BYTES}-byte block",
                target.path()
            )));
        }
        let flags = rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC;
        let eventfd =
            rustix::event::eventfd(0, flags).map_err(|e| Error::os("rbd: eventfd", e.into()))?;
        // SAFETY: a live image; the eventfd outlives it (`Shared` drops the image first).
        // librbd decides at submission whether a request notifies, so this comes before
        // any request.
        let rc = unsafe {
            (api.rbd_set_image_notification)(
                image.handle(),
                eventfd.as_raw_fd(),
                ffi::EVENT_TYPE_EVENTFD,
            )
        };
        if rc < 0 {
            return Err(fail(
                format!("rbd: {}: rbd_set_image_notification", target.path()),
                rc,
            ));
        }
        let read_only = target.snapshot.is_some();
        Ok(RbdDevice {
            name: name.to_string(),
            monitors: cluster.monitors().to_string(),
            target: target.clone(),
            read_only,
            object_bytes,
            geometry: Geometry {
                // Whole blocks: a tail shorter than a block is not served.
                size_bytes: size - size % u64::from(BLOCK_BYTES),
                block_bytes: BLOCK_BYTES,
                caps: if read_only {
                    Caps {
                        flush: true,
                        fua: false,
                        discard: false,
                        write_zeroes: false,
                    }
                } else {
                    Caps::ALL
                },
            },
            shared: Arc::new(Shared {
                api,
                image,
                eventfd,
                inboxes: (0..MAX_QUEUES).map(|_| OnceLock::new()).collect(),
                taken: (0..MAX_QUEUES).map(|_| AtomicBool::new(false)).collect(),
                timeout: target.timeout,
                cache_on,
            }),
        })
    }
}

/// `rbd_diff_iterate2`'s callback: collects the ranges that hold data into the
/// `Vec<(u64, u64)>` (offset, length) at `arg`, in whatever order they come.
unsafe extern "C" fn diff_extent(
    offset: u64,
    len: usize,
    exists: std::ffi::c_int,
    arg: *mut std::ffi::c_void,
) -> std::ffi::c_int {
    // SAFETY: `arg` is the Vec that `extents` passed, alive and not otherwise borrowed
    // for the call (the walk's callbacks run one at a time, and before it returns).
    let ranges = unsafe { &mut *arg.cast::<Vec<(u64, u64)>>() };
    if exists != 0 && len > 0 {
        ranges.push((offset, len as u64));
    }
    0
}

/// The extents of `[offset, end)` given the data ranges `ranges` (any order, may overlap
/// or reach outside it): holes between them.
fn extents_from(mut ranges: Vec<(u64, u64)>, offset: u64, end: u64, out: &mut Vec<Extent>) {
    ranges.sort_unstable();
    let mut at = offset;
    for (o, l) in ranges {
        let (start, stop) = (o.max(at), o.saturating_add(l).min(end));
        if stop <= start {
            continue;
        }
        if start > at {
            Extent::push(out, Extent::hole(start - at));
        }
        Extent::push(out, Extent::data(stop - start));
        at = stop;
    }
    if at < end {
        Extent::push(out, Extent::hole(end - at));
    }
}

impl Device for RbdDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn describe(&self) -> String {
        format!(
            "rbd {}{} ({}{}, monitors {}) {} bytes, {}-byte blocks; connection {}, timeout {} s{}",
            self.target.path(),
            if self.read_only { " read-only" } else { "" },
            match &self.target.conf {
                Some(p) => format!("conf {}", p.display()),
                None => "default conf".into(),
            },
            self.target
                .id
                .as_deref()
                .map(|id| format!(", client.{id}"))
                .unwrap_or_default(),
            if self.monitors.is_empty() {
                "?"
            } else {
                &self.monitors
            },
            self.geometry.size_bytes,
            self.geometry.block_bytes,
            self.target.connection.as_str(),
            self.target.timeout.as_secs(),
            if self.shared.cache_on {
                "; librbd's cache on (a pool or image override): FUA writes are flushed"
            } else {
                ""
            },
        )
    }

    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
        let index = self.shared.claim()?;
        let queue = super::queue::RbdQueue::open(core, self.shared.clone(), index, self.read_only);
        // Operators see every queue's I/O under the device's name (admin stats, metrics).
        cairn_core::stats::registry().add(self.name(), queue.stats());
        Ok(queue)
    }

    fn extents(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        let image = &self.shared.image;
        if !image.fast_diff() {
            // Without the object map the walk reads every object: call it all data.
            Extent::push(out, Extent::data(len));
            return Ok(());
        }
        // Asked from an object's start: librbd before 1.17 (Pacific's) reports a range
        // that starts inside an object at the wrong offset on this path (Ceph bug 53784).
        let end = offset + len;
        let from = offset - offset % self.object_bytes;
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        // SAFETY: a live image; the callback gets `ranges`, which outlives the call, and
        // the call returns only after its last callback. Without fast-diff (not called
        // then) the callbacks could come from a librbd thread while this one waits.
        let rc = unsafe {
            (self.shared.api.rbd_diff_iterate2)(
                image.handle(),
                std::ptr::null(),
                from,
                end - from,
                1,
                1,
                Some(diff_extent),
                (&mut ranges as *mut Vec<(u64, u64)>).cast(),
            )
        };
        if rc < 0 {
            return Err(fail(
                format!("rbd: {}: rbd_diff_iterate2", self.target.path()),
                rc,
            ));
        }
        extents_from(ranges, offset, end, out);
        Ok(())
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Completions nobody took (none once every queue has drained): give them back.
        let mut comps = [std::ptr::null_mut(); 32];
        loop {
            // SAFETY: a live image; room for 32.
            let n = unsafe {
                (self.api.rbd_poll_io_events)(self.image.handle(), comps.as_mut_ptr(), 32)
            };
            if n <= 0 {
                break;
            }
            for c in &comps[..n as usize] {
                // SAFETY: a completion librbd handed back, released once.
                unsafe { (self.api.rbd_aio_release)(*c) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(ranges: &[(u64, u64)], offset: u64, end: u64) -> Vec<Extent> {
        let mut out = Vec::new();
        extents_from(ranges.to_vec(), offset, end, &mut out);
        out
    }

    #[test]
    fn data_ranges_become_extents_of_the_range_asked() {
        // Out of order, overlapping, reaching before and past the range.
        let ranges = [(40, 20), (0, 10), (5, 10), (90, 50)];
        assert_eq!(
            map(&ranges, 8, 100),
            vec![
                Extent::data(7),
                Extent::hole(25),
                Extent::data(20),
                Extent::hole(30),
                Extent::data(10),
            ]
        );
        assert_eq!(map(&[], 0, 64), vec![Extent::hole(64)]);
        assert_eq!(map(&[(0, 4096)], 0, 4096), vec![Extent::data(4096)]);
        // Ranges wholly outside: all hole.
        assert_eq!(map(&[(0, 8), (200, 8)], 100, 150), vec![Extent::hole(50)]);
    }
}
