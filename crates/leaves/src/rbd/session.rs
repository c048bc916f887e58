//! A cluster connection, a pool and an open image, each closed when dropped.
//!
//! These calls block (connecting waits for the monitors, opening reads the image's header):
//! they run when a device opens, never on a reactor. Every wait is bounded by the timeout
//! given to [`Cluster::connect`], which is also set as librados' operation timeouts, so a
//! request to an OSD that is gone fails with ETIMEDOUT instead of waiting for ever.

use std::ffi::{c_int, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use cairn_core::Error;

use super::ffi::{self, Api, ImageT, IoCtxT, RadosT};

/// `-errno` as an [`Error`] saying what was being done.
pub(crate) fn fail(context: String, rc: c_int) -> Error {
    Error::os(context, std::io::Error::from_raw_os_error(-rc))
}

fn cstr(what: &str, s: &str) -> Result<CString, Error> {
    CString::new(s).map_err(|_| Error::Invalid(format!("rbd: {what} '{s}' holds a NUL byte")))
}

/// A connection to a cluster (`rados_t`).
pub struct Cluster {
    api: &'static Api,
    handle: RadosT,
    /// The monitors it was told to reach, for error messages.
    monitors: String,
}

// SAFETY: librados' cluster handle may be used from any thread (its calls take their own
// locks); cairn opens and closes it on one thread and only shares it read-only.
unsafe impl Send for Cluster {}
// SAFETY: as above; no `&self` method mutates cairn-side state.
unsafe impl Sync for Cluster {}

impl Cluster {
    /// Connects as client `id` (`admin` when `None`) with the configuration at `conf`
    /// (librados' default search when `None`), failing after `timeout`.
    pub fn connect(
        conf: Option<&Path>,
        id: Option<&str>,
        timeout: Duration,
    ) -> Result<Arc<Cluster>, Error> {
        let api = ffi::api()?;
        let id_c = id.map(|i| cstr("id", i)).transpose()?;
        let mut handle: RadosT = std::ptr::null_mut();
        // SAFETY: `handle` is a live out-pointer; the id string outlives the call. Signals
        // blocked for the threads librados may start (see `rados_connect` below).
        let rc = cairn_core::reactor::with_signals_blocked(|| unsafe {
            (api.rados_create)(
                &mut handle,
                id_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            )
        });
        if rc < 0 {
            return Err(fail("rbd: rados_create".into(), rc));
        }
        let mut cluster = Cluster {
            api,
            handle,
            monitors: String::new(),
        };
        let conf_text = conf.map(|p| p.display().to_string());
        let conf_c = conf_text.as_deref().map(|p| cstr("conf", p)).transpose()?;
        // SAFETY: a live handle; a NUL-terminated path or NULL (the default search).
        let rc = unsafe {
            (api.rados_conf_read_file)(
                handle,
                conf_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            )
        };
        if rc < 0 {
            let shown = conf_text
                .as_deref()
                .unwrap_or("the default places ($CEPH_CONF, /etc/ceph/ceph.conf)");
            return Err(fail(
                format!("rbd: read the Ceph configuration {shown}"),
                rc,
            ));
        }
        let secs = timeout.as_secs().max(1).to_string();
        for (key, value) in [
            // librados writes its own log lines to stderr unless told not to.
            ("log_to_stderr", "false"),
            ("err_to_stderr", "false"),
            ("client_mount_timeout", secs.as_str()),
            ("rados_mon_op_timeout", secs.as_str()),
            ("rados_osd_op_timeout", secs.as_str()),
            // librbd's cache acknowledges writes before the OSDs hold them once a flush has
            // been seen; cairn's writes complete when they are durable.
            ("rbd_cache", "false"),
            // A discard reads back as zeroes, also where it covers part of an object (by
            // default librbd skips those parts and leaves the old bytes).
            ("rbd_skip_partial_discard", "false"),
        ] {
            cluster.set(key, value)?;
        }
        cluster.monitors = cluster.get("mon_host").unwrap_or_default();
        // SAFETY: a live, configured handle. librados starts its threads here: with the
        // signals blocked, as every thread of cairn's but the one that waits for them.
        let rc =
            cairn_core::reactor::with_signals_blocked(|| unsafe { (api.rados_connect)(handle) });
        if rc < 0 {
            let mons = if cluster.monitors.is_empty() {
                "no monitors configured".to_string()
            } else {
                format!("monitors {}", cluster.monitors)
            };
            let who = id.map_or("client.admin".to_string(), |i| format!("client.{i}"));
            return Err(fail(
                format!("rbd: connect to the cluster as {who} ({mons}, within {secs} s)"),
                rc,
            ));
        }
        Ok(Arc::new(cluster))
    }

    /// The connection for (`conf`, `id`, `timeout`) that another device already holds, or
    /// a new one that later devices with the same three share.
    pub fn shared(
        conf: Option<&Path>,
        id: Option<&str>,
        timeout: Duration,
    ) -> Result<Arc<Cluster>, Error> {
        type Key = (Option<PathBuf>, Option<String>, Duration);
        static OPEN: Mutex<Vec<(Key, Weak<Cluster>)>> = Mutex::new(Vec::new());
        let key: Key = (conf.map(Path::to_path_buf), id.map(str::to_string), timeout);
        // Held across the connect, so that two devices opening at once share one too.
        let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
        open.retain(|(_, c)| c.strong_count() > 0);
        if let Some(c) = open
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, c)| c.upgrade())
        {
            return Ok(c);
        }
        let c = Cluster::connect(conf, id, timeout)?;
        open.push((key, Arc::downgrade(&c)));
        Ok(c)
    }

    /// The monitors it was told to reach (`mon_host`).
    pub fn monitors(&self) -> &str {
        &self.monitors
    }

    fn set(&self, key: &str, value: &str) -> Result<(), Error> {
        let (k, v) = (cstr("option", key)?, cstr("value", value)?);
        // SAFETY: a live handle and two NUL-terminated strings.
        let rc = unsafe { (self.api.rados_conf_set)(self.handle, k.as_ptr(), v.as_ptr()) };
        if rc < 0 {
            return Err(fail(format!("rbd: set {key}={value}"), rc));
        }
        Ok(())
    }

    fn get(&self, key: &str) -> Option<String> {
        let k = cstr("option", key).ok()?;
        let mut buf = [0u8; 1024];
        // SAFETY: a live handle, a NUL-terminated key, a buffer of the length given.
        let rc = unsafe {
            (self.api.rados_conf_get)(self.handle, k.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
        };
        if rc < 0 {
            return None;
        }
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Some(String::from_utf8_lossy(&buf[..end]).into_owned())
    }

    /// An I/O context on `pool`, in `namespace` when given.
    pub fn pool(self: &Arc<Self>, pool: &str, namespace: Option<&str>) -> Result<Arc<Pool>, Error> {
        let pool_c = cstr("pool", pool)?;
        let mut ioctx: IoCtxT = std::ptr::null_mut();
        // SAFETY: a connected handle, a NUL-terminated name, a live out-pointer.
        let rc = unsafe { (self.api.rados_ioctx_create)(self.handle, pool_c.as_ptr(), &mut ioctx) };
        if rc < 0 {
            return Err(fail(format!("rbd: open pool '{pool}'"), rc));
        }
        let mut p = Pool {
            cluster: self.clone(),
            ioctx,
            name: pool.to_string(),
        };
        if let Some(ns) = namespace {
            let ns_c = cstr("namespace", ns)?;
            // SAFETY: a live ioctx not yet shared; the string is copied by librados.
            unsafe { (self.api.rados_ioctx_set_namespace)(ioctx, ns_c.as_ptr()) };
            p.name = format!("{pool}/{ns}");
        }
        Ok(Arc::new(p))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: every pool and image holds an Arc of it, so all are gone and nothing
        // uses the handle any more.
        unsafe { (self.api.rados_shutdown)(self.handle) };
    }
}

/// An I/O context on one pool (and namespace).
pub struct Pool {
    cluster: Arc<Cluster>,
    ioctx: IoCtxT,
    /// `POOL` or `POOL/NAMESPACE`, for messages.
    name: String,
}

// SAFETY: an ioctx may be used from several threads for I/O (librados locks inside);
// cairn only changes it (the namespace) before sharing it.
unsafe impl Send for Pool {}
// SAFETY: as above.
unsafe impl Sync for Pool {}

impl Pool {
    /// Creates image `name` of `size` bytes (the default features and object size).
    pub fn create(&self, name: &str, size: u64) -> Result<(), Error> {
        let name_c = cstr("image", name)?;
        let mut order: c_int = 0;
        // SAFETY: a live ioctx, a NUL-terminated name, a live out-pointer.
        let rc =
            unsafe { (self.cluster.api.rbd_create)(self.ioctx, name_c.as_ptr(), size, &mut order) };
        if rc < 0 {
            return Err(fail(format!("rbd: create image {}/{name}", self.name), rc));
        }
        Ok(())
    }

    /// Removes image `name`.
    pub fn remove(&self, name: &str) -> Result<(), Error> {
        let name_c = cstr("image", name)?;
        // SAFETY: a live ioctx and a NUL-terminated name.
        let rc = unsafe { (self.cluster.api.rbd_remove)(self.ioctx, name_c.as_ptr()) };
        if rc < 0 {
            return Err(fail(format!("rbd: remove image {}/{name}", self.name), rc));
        }
        Ok(())
    }

    /// Opens image `name`, read-only at `snapshot` when one is named.
    pub fn open(self: &Arc<Self>, name: &str, snapshot: Option<&str>) -> Result<Image, Error> {
        let name_c = cstr("image", name)?;
        let snap_c = snapshot.map(|s| cstr("snapshot", s)).transpose()?;
        let snap_p = snap_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
        let mut image: ImageT = std::ptr::null_mut();
        let api = self.cluster.api;
        // SAFETY: a live ioctx, NUL-terminated strings (or NULL), a live out-pointer.
        // librbd starts threads of its own at the first open: signals blocked, as above.
        let rc = cairn_core::reactor::with_signals_blocked(|| unsafe {
            if snapshot.is_some() {
                (api.rbd_open_read_only)(self.ioctx, name_c.as_ptr(), &mut image, snap_p)
            } else {
                (api.rbd_open)(self.ioctx, name_c.as_ptr(), &mut image, snap_p)
            }
        });
        if rc < 0 {
            let what = match snapshot {
                Some(s) => format!("{}/{name}@{s}", self.name),
                None => format!("{}/{name}", self.name),
            };
            return Err(fail(format!("rbd: open image {what}"), rc));
        }
        Ok(Image {
            pool: self.clone(),
            handle: image,
        })
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: images opened from it hold an Arc of it, so all are gone.
        unsafe { (self.cluster.api.rados_ioctx_destroy)(self.ioctx) };
    }
}

/// An open image.
pub struct Image {
    pool: Arc<Pool>,
    handle: ImageT,
}

// SAFETY: librbd's image calls are thread-safe (SPDK and rbd-nbd submit on one handle from
// several threads); cairn closes the handle once, when the last owner drops it.
unsafe impl Send for Image {}
// SAFETY: as above.
unsafe impl Sync for Image {}

impl Image {
    /// The raw handle, for the asynchronous calls.
    pub fn handle(&self) -> ImageT {
        self.handle
    }

    /// The API the image was opened with.
    pub fn api(&self) -> &'static Api {
        self.pool.cluster.api
    }

    /// The image's size in bytes.
    pub fn size(&self) -> Result<u64, Error> {
        let mut size = 0u64;
        // SAFETY: a live image and out-pointer.
        let rc = unsafe { (self.api().rbd_get_size)(self.handle, &mut size) };
        if rc < 0 {
            return Err(fail("rbd: image size".into(), rc));
        }
        Ok(size)
    }

    /// Whether `rbd_diff_iterate2` can tell holes from the object map: fast-diff on and
    /// its map valid (without it, the walk would read every object), and no fancy
    /// striping (whose extents come per object, out of image order).
    pub fn fast_diff(&self) -> bool {
        let (mut features, mut flags) = (0u64, 0u64);
        // SAFETY: a live image and out-pointers.
        let ok = unsafe {
            (self.api().rbd_get_features)(self.handle, &mut features) == 0
                && (self.api().rbd_get_flags)(self.handle, &mut flags) == 0
        };
        ok && features & ffi::FEATURE_FAST_DIFF != 0
            && features & ffi::FEATURE_STRIPINGV2 == 0
            && flags & ffi::FLAG_FAST_DIFF_INVALID == 0
    }

    /// The value of librbd option `name` as it applies to this image (a pool's or the
    /// image's own override wins over the client's setting), if librbd lists it.
    pub fn config(&self, name: &str) -> Option<String> {
        let api = self.api();
        let mut max: c_int = 0;
        // SAFETY: with room for none, librbd only writes how many there are to `max`.
        let rc =
            unsafe { (api.rbd_config_image_list)(self.handle, std::ptr::null_mut(), &mut max) };
        if rc != -libc::ERANGE || max <= 0 {
            return None;
        }
        let mut options: Vec<ffi::ConfigOption> = (0..max)
            .map(|_| ffi::ConfigOption {
                name: std::ptr::null_mut(),
                value: std::ptr::null_mut(),
                source: 0,
            })
            .collect();
        // SAFETY: room for `max` entries; librbd fills them and sets `max` to how many.
        let rc =
            unsafe { (api.rbd_config_image_list)(self.handle, options.as_mut_ptr(), &mut max) };
        if rc < 0 {
            return None;
        }
        let found = options[..max.max(0) as usize].iter().find_map(|o| {
            // SAFETY: librbd set both to NUL-terminated strings, alive until the cleanup.
            let (n, v) = unsafe {
                (
                    std::ffi::CStr::from_ptr(o.name),
                    std::ffi::CStr::from_ptr(o.value),
                )
            };
            (n.to_bytes() == name.as_bytes()).then(|| v.to_string_lossy().into_owned())
        });
        // SAFETY: the entries librbd filled, given back once.
        unsafe { (api.rbd_config_image_list_cleanup)(options.as_mut_ptr(), max) };
        found
    }

    /// The size of the image's objects in bytes (its stripe unit, which is the object
    /// size unless fancy striping is on).
    pub fn object_bytes(&self) -> Result<u64, Error> {
        let mut unit = 0u64;
        // SAFETY: a live image and out-pointer.
        let rc = unsafe { (self.api().rbd_get_stripe_unit)(self.handle, &mut unit) };
        if rc < 0 || unit == 0 {
            return Err(fail("rbd: image object size".into(), rc.min(-libc::EINVAL)));
        }
        Ok(unit)
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        // SAFETY: the owner has collected every request it submitted (the device drains
        // before it drops the image), so librbd holds no buffer of ours.
        unsafe { (self.api().rbd_close)(self.handle) };
    }
}
