//! librados and librbd, loaded when the first rbd device opens.
//!
//! cairn links neither: a build, and every device but rbd, needs no Ceph package. The
//! libraries are opened once per process with `dlopen` (the `libloading` crate) and stay
//! loaded until it exits. The entry points are the C API of Ceph 16.2 (Pacific) and later:
//! `src/include/rados/librados.h` and `src/include/rbd/librbd.h` in ceph/ceph.
//!
//! Every call through [`Api`] is `unsafe`: the caller passes live handles and buffers that
//! outlive the request, as the C API asks.

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use libloading::Library;

use crate::Error;

/// A cluster connection (`rados_t`).
pub type RadosT = *mut c_void;
/// An I/O context on one pool (`rados_ioctx_t`).
pub type IoCtxT = *mut c_void;
/// An open image (`rbd_image_t`).
pub type ImageT = *mut c_void;
/// One asynchronous request's completion (`rbd_completion_t`).
pub type CompletionT = *mut c_void;
/// A completion's callback (`rbd_callback_t`); cairn passes none (see
/// [`EVENT_TYPE_EVENTFD`]).
pub type CallbackT = Option<unsafe extern "C" fn(CompletionT, *mut c_void)>;
/// `rbd_diff_iterate2`'s callback: (offset, length, exists, arg); a negative return stops
/// the walk and is returned by it.
pub type DiffCallbackT = Option<unsafe extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int>;

/// One of an image's configuration options as it applies to the image
/// (`rbd_config_option_t`): the client's, or a pool's or the image's own override.
#[repr(C)]
pub struct ConfigOption {
    /// The option's name (`rbd_cache`), owned by librbd until the list's cleanup.
    pub name: *mut c_char,
    /// Its value as text.
    pub value: *mut c_char,
    /// Where it comes from (`rbd_config_source_t`: 0 the client's configuration, 1 the
    /// pool, 2 the image).
    pub source: c_int,
}

/// `rbd_set_image_notification`'s type for an eventfd: librbd adds 1 to it per completed
/// request that was submitted after the registration, and queues the completion for
/// `rbd_poll_io_events`.
pub const EVENT_TYPE_EVENTFD: c_int = 2;

/// `RBD_FEATURE_FAST_DIFF`: the image keeps an object map that says which objects hold
/// data, so `rbd_diff_iterate2` with `whole_object` reads that map instead of every object.
pub const FEATURE_FAST_DIFF: u64 = 1 << 4;
/// `RBD_FEATURE_STRIPINGV2`: "fancy" striping, where librbd before 1.17 reports
/// `rbd_diff_iterate2`'s extents per object, not in image order.
pub const FEATURE_STRIPINGV2: u64 = 1 << 1;
/// `RBD_FLAG_FAST_DIFF_INVALID`: the fast-diff map needs a rebuild and cannot be trusted.
pub const FLAG_FAST_DIFF_INVALID: u64 = 1 << 1;

/// The soname of librbd, and the Debian package that ships it.
pub const LIBRBD: &str = "librbd.so.1";
/// The soname of librados, and the Debian package that ships it.
pub const LIBRADOS: &str = "librados.so.2";

macro_rules! api {
    ($($lib:ident $name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The entry points cairn uses, resolved once.
        #[allow(missing_docs)]
        pub struct Api {
            $(pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
        }

        impl Api {
            /// The entry points, or the first one missing and what the loader said.
            fn resolve(rados: &Library, rbd: &Library) -> Result<Api, (&'static str, String)> {
                Ok(Api {
                    $($name: {
                        let lib = api!(@pick $lib, rados, rbd);
                        // SAFETY: the type is the function's C prototype in Pacific's
                        // librados.h / librbd.h; the library stays loaded for the process
                        // (it is kept in a static), so the pointer never dangles.
                        unsafe {
                            *lib.get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                            .map_err(|e| (stringify!($name), e.to_string()))?
                        }
                    },)*
                })
            }
        }
    };
    (@pick rados, $rados:ident, $rbd:ident) => { $rados };
    (@pick rbd, $rados:ident, $rbd:ident) => { $rbd };
}

api! {
    rados rados_create: fn(*mut RadosT, *const c_char) -> c_int;
    rados rados_conf_read_file: fn(RadosT, *const c_char) -> c_int;
    rados rados_conf_set: fn(RadosT, *const c_char, *const c_char) -> c_int;
    rados rados_conf_get: fn(RadosT, *const c_char, *mut c_char, usize) -> c_int;
    rados rados_connect: fn(RadosT) -> c_int;
    rados rados_shutdown: fn(RadosT);
    rados rados_ioctx_create: fn(RadosT, *const c_char, *mut IoCtxT) -> c_int;
    rados rados_ioctx_set_namespace: fn(IoCtxT, *const c_char);
    rados rados_ioctx_destroy: fn(IoCtxT);
    rbd rbd_version: fn(*mut c_int, *mut c_int, *mut c_int);
    rbd rbd_create: fn(IoCtxT, *const c_char, u64, *mut c_int) -> c_int;
    rbd rbd_remove: fn(IoCtxT, *const c_char) -> c_int;
    rbd rbd_open: fn(IoCtxT, *const c_char, *mut ImageT, *const c_char) -> c_int;
    rbd rbd_open_read_only: fn(IoCtxT, *const c_char, *mut ImageT, *const c_char) -> c_int;
    rbd rbd_close: fn(ImageT) -> c_int;
    rbd rbd_get_size: fn(ImageT, *mut u64) -> c_int;
    rbd rbd_get_features: fn(ImageT, *mut u64) -> c_int;
    rbd rbd_get_flags: fn(ImageT, *mut u64) -> c_int;
    rbd rbd_get_stripe_unit: fn(ImageT, *mut u64) -> c_int;
    rbd rbd_config_image_list: fn(ImageT, *mut ConfigOption, *mut c_int) -> c_int;
    rbd rbd_config_image_list_cleanup: fn(*mut ConfigOption, c_int);
    rbd rbd_aio_create_completion: fn(*mut c_void, CallbackT, *mut CompletionT) -> c_int;
    rbd rbd_aio_release: fn(CompletionT);
    rbd rbd_aio_get_return_value: fn(CompletionT) -> isize;
    rbd rbd_aio_get_arg: fn(CompletionT) -> *mut c_void;
    rbd rbd_aio_readv: fn(ImageT, *const libc::iovec, c_int, u64, CompletionT) -> c_int;
    rbd rbd_aio_writev: fn(ImageT, *const libc::iovec, c_int, u64, CompletionT) -> c_int;
    rbd rbd_aio_flush: fn(ImageT, CompletionT) -> c_int;
    rbd rbd_aio_discard: fn(ImageT, u64, u64, CompletionT) -> c_int;
    rbd rbd_aio_write_zeroes: fn(ImageT, u64, usize, CompletionT, c_int, c_int) -> c_int;
    rbd rbd_set_image_notification: fn(ImageT, c_int, c_int) -> c_int;
    rbd rbd_poll_io_events: fn(ImageT, *mut CompletionT, c_int) -> c_int;
    rbd rbd_diff_iterate2: fn(ImageT, *const c_char, u64, u64, u8, u8, DiffCallbackT, *mut c_void) -> c_int;
}

struct Loaded {
    api: Api,
    // Kept so that the pointers in `api` stay valid; never unloaded.
    _rados: Library,
    _rbd: Library,
}

static LOADED: OnceLock<Result<Loaded, Error>> = OnceLock::new();

/// The loaded API, or why it could not be loaded (which package to install).
pub fn api() -> Result<&'static Api, Error> {
    LOADED
        .get_or_init(|| load(LIBRADOS, LIBRBD))
        .as_ref()
        .map(|l| &l.api)
        .map_err(Clone::clone)
}

fn load(rados: &str, rbd: &str) -> Result<Loaded, Error> {
    let open = |name: &str, package: &'static str| {
        // SAFETY: loading runs the libraries' initialisers; librados and librbd have no
        // initialiser that assumes anything of the process beyond a C++ runtime.
        unsafe { Library::new(name) }.map_err(|e| Error::LibraryMissing {
            library: name.to_string(),
            package,
            why: e.to_string(),
        })
    };
    let rados_lib = open(rados, "librados2")?;
    let rbd_lib = open(rbd, "librbd1")?;
    let api = Api::resolve(&rados_lib, &rbd_lib).map_err(|(symbol, why)| Error::LibraryTooOld {
        library: rbd.to_string(),
        symbol,
        why,
    })?;
    Ok(Loaded {
        api,
        _rados: rados_lib,
        _rbd: rbd_lib,
    })
}

/// librbd's version (major, minor, extra): 1.16 is Pacific's.
pub fn version(api: &Api) -> (i32, i32, i32) {
    let (mut a, mut b, mut c) = (0, 0, 0);
    // SAFETY: the three pointers are to live locals.
    unsafe { (api.rbd_version)(&mut a, &mut b, &mut c) };
    (a, b, c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_names_the_package_to_install() {
        let Err(e) = load("libcairn-no-such-rados.so.2", LIBRBD) else {
            panic!("a library that does not exist was loaded");
        };
        assert!(
            matches!(&e, Error::LibraryMissing { library, package: "librados2", .. }
                if library == "libcairn-no-such-rados.so.2"),
            "{e:?}"
        );
        let e = e.to_string();
        assert!(e.contains("libcairn-no-such-rados.so.2"), "{e}");
        assert!(e.contains("apt-get install librados2"), "{e}");
    }

    #[test]
    fn librbd_loads_where_it_is_installed() {
        let installed = [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
        ]
        .iter()
        .any(|d| std::path::Path::new(d).join(LIBRBD).exists());
        match api() {
            Ok(api) => {
                let (major, minor, _) = version(api);
                assert!(major == 1 && minor >= 16, "librbd {major}.{minor}");
            }
            Err(e) => assert!(!installed, "librbd is installed but did not load: {e}"),
        }
    }
}
