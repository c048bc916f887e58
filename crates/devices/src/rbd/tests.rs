//! Against a real cluster: scripts/ceph-cluster starts one (one monitor, one OSD) in a
//! directory of its own, and it is stopped by pid when the test ends, even by a panic.
//! Without root, the Ceph packages or librbd, the tests record a skip.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::ffi;
use super::session::Cluster;

use cairn_core::testing::skip;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster")
}

/// A running test cluster, stopped when dropped.
struct TestCluster {
    dir: tempfile::TempDir,
    conf: PathBuf,
}

impl TestCluster {
    fn start(test: &str) -> Option<TestCluster> {
        if !rustix::process::geteuid().is_root() {
            skip(test, "needs root (the Ceph daemons)");
            return None;
        }
        if let Err(e) = ffi::api() {
            skip(test, &e);
            return None;
        }
        let have = Command::new("sh")
            .args([
                "-c",
                "command -v ceph-mon && command -v ceph-osd && command -v ceph",
            ])
            .output()
            .is_ok_and(|o| o.status.success());
        if !have {
            skip(test, "ceph-mon, ceph-osd or ceph-common is not installed");
            return None;
        }
        let dir = tempfile::tempdir_in("/dev/shm").expect("a directory in /dev/shm");
        let out = Command::new(script())
            .arg("start")
            .arg(dir.path().join("c"))
            .output()
            .expect("run scripts/ceph-cluster");
        let cluster = TestCluster {
            conf: dir.path().join("c/ceph.conf"),
            dir,
        };
        assert!(
            out.status.success(),
            "scripts/ceph-cluster start failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(cluster)
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        let _ = Command::new(script())
            .arg("stop")
            .arg(self.dir.path().join("c"))
            .output();
    }
}

/// Waits for `n` completions on the image's eventfd and takes them from librbd:
/// (the argument given at submission, the return value) of each.
fn collect(
    api: &ffi::Api,
    image: ffi::ImageT,
    efd: &std::os::fd::OwnedFd,
    n: usize,
) -> Vec<(usize, isize)> {
    let mut got = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while got.len() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "completions did not come"
        );
        let mut fds = [rustix::event::PollFd::new(
            efd,
            rustix::event::PollFlags::IN,
        )];
        let _ = rustix::event::poll(&mut fds, None);
        let mut count = [0u8; 8];
        let _ = rustix::io::read(efd, &mut count);
        loop {
            let mut comps = [std::ptr::null_mut(); 16];
            // SAFETY: a live image; `comps` has room for the 16 asked for.
            let k = unsafe { (api.rbd_poll_io_events)(image, comps.as_mut_ptr(), 16) };
            assert!(k >= 0, "rbd_poll_io_events: {k}");
            if k == 0 {
                break;
            }
            for c in &comps[..k as usize] {
                // SAFETY: a completion librbd handed back, released once, here.
                unsafe {
                    got.push((
                        (api.rbd_aio_get_arg)(*c) as usize,
                        (api.rbd_aio_get_return_value)(*c),
                    ));
                    (api.rbd_aio_release)(*c);
                }
            }
        }
    }
    got
}

/// Submits `n` vectored requests of `chunk` bytes each, writes or reads: the k-th covers
/// `buf[k * chunk..]` at image offset `k * 3 * chunk` (gaps between them), and its
/// completion carries k as its argument.
///
/// # Safety
/// `buf` holds `n * chunk` bytes and stays valid until every completion is collected.
unsafe fn submit_chunks(
    api: &ffi::Api,
    image: ffi::ImageT,
    buf: *mut u8,
    n: usize,
    chunk: usize,
    write: bool,
) {
    let op = if write {
        api.rbd_aio_writev
    } else {
        api.rbd_aio_readv
    };
    for k in 0..n {
        let iov = libc::iovec {
            // SAFETY: k < n, so the chunk lies inside the caller's buffer.
            iov_base: unsafe { buf.add(k * chunk) }.cast(),
            iov_len: chunk,
        };
        let mut c = std::ptr::null_mut();
        // SAFETY: the caller's promise for the buffer; librbd copies the iovec at
        // submission; the completion is released by `collect`.
        unsafe {
            assert_eq!(
                (api.rbd_aio_create_completion)(k as *mut _, None, &mut c),
                0
            );
            assert_eq!(op(image, &iov, 1, (k * 3 * chunk) as u64, c), 0);
        }
    }
}

#[test]
fn an_image_is_created_opened_written_and_read_back_through_the_eventfd() {
    let Some(tc) =
        TestCluster::start("an_image_is_created_opened_written_and_read_back_through_the_eventfd")
    else {
        return;
    };
    let cluster = Cluster::connect(Some(&tc.conf), None, Duration::from_secs(30)).expect("connect");
    let pool = cluster.pool("rbd", None).expect("pool rbd");
    pool.create("t", 64 << 20).expect("create");
    let image = pool.open("t", None).expect("open");
    assert_eq!(image.size().expect("size"), 64 << 20);
    let api = image.api();
    let efd = rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
    )
    .expect("eventfd");
    use std::os::fd::AsRawFd;
    // SAFETY: a live image; the eventfd outlives it (dropped after `image`).
    let rc = unsafe {
        (api.rbd_set_image_notification)(image.handle(), efd.as_raw_fd(), ffi::EVENT_TYPE_EVENTFD)
    };
    assert_eq!(rc, 0);

    // Eight 64 KiB writes of distinct bytes, then a flush, then the same ranges read back.
    let chunk = 64 << 10;
    let data: Vec<u8> = (0..8 * chunk).map(|i| (i * 7 + i / 4096) as u8).collect();
    // SAFETY: `data` outlives the requests (collected next); librbd only reads it.
    unsafe {
        submit_chunks(
            api,
            image.handle(),
            data.as_ptr().cast_mut(),
            8,
            chunk,
            true,
        )
    };
    let done = collect(api, image.handle(), &efd, 8);
    assert!(done.iter().all(|&(_, r)| r == 0), "writes: {done:?}");
    let mut c = std::ptr::null_mut();
    // SAFETY: as above.
    unsafe {
        assert_eq!(
            (api.rbd_aio_create_completion)(99 as *mut _, None, &mut c),
            0
        );
        assert_eq!((api.rbd_aio_flush)(image.handle(), c), 0);
    }
    assert_eq!(collect(api, image.handle(), &efd, 1), vec![(99, 0)]);

    let mut back = vec![0u8; 8 * chunk];
    // SAFETY: `back` outlives the requests (collected next).
    unsafe { submit_chunks(api, image.handle(), back.as_mut_ptr(), 8, chunk, false) };
    let done = collect(api, image.handle(), &efd, 8);
    assert!(
        done.iter().all(|&(_, r)| r == chunk as isize),
        "reads: {done:?}"
    );
    assert!(
        back == data,
        "what was read back differs from what was written"
    );
    drop(image);

    // Missing things: one line each, naming what.
    let e = pool
        .open("nope", None)
        .err()
        .expect("a missing image opened")
        .to_string();
    assert!(e.contains("rbd/nope") && e.contains("No such file"), "{e}");
    let e = pool
        .open("t", Some("nosnap"))
        .err()
        .expect("a missing snapshot opened")
        .to_string();
    assert!(e.contains("rbd/t@nosnap"), "{e}");
    let e = cluster
        .pool("nopool", None)
        .err()
        .expect("a missing pool opened")
        .to_string();
    assert!(e.contains("'nopool'") && e.contains("No such file"), "{e}");
    pool.remove("t").expect("remove");
}

#[test]
fn an_unreachable_cluster_fails_the_connect_naming_its_monitors() {
    if let Err(e) = ffi::api() {
        skip(
            "an_unreachable_cluster_fails_the_connect_naming_its_monitors",
            &e,
        );
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = dir.path().join("ceph.conf");
    // Port 1 on loopback: nothing listens there.
    std::fs::write(
        &conf,
        "[global]\nmon host = 127.0.0.1:1\nauth cluster required = none\nauth service required = none\nauth client required = none\n",
    )
    .expect("write conf");
    let e = Cluster::connect(Some(&conf), None, Duration::from_secs(2))
        .err()
        .expect("connected to nothing")
        .to_string();
    assert!(e.contains("127.0.0.1:1") && e.contains("within 2 s"), "{e}");
    let e = Cluster::connect(
        Some(&dir.path().join("missing.conf")),
        None,
        Duration::from_secs(2),
    )
    .err()
    .expect("read a missing conf")
    .to_string();
    assert!(e.contains("missing.conf"), "{e}");
}
