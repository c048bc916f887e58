//! RBD images against a real cluster (tests/ceph): librbd's calls as cairn makes them,
//! then the device: two reactors on one image, holes from the object map, a snapshot
//! read-only, every bad input one line, and an OSD that stops and comes back.
//! Without root, the Ceph packages or librbd, the tests record a skip.

use std::sync::Arc;
use std::time::Duration;

use cairn_core::blocking::{BlockingError, BlockingQueue, Request};
use cairn_core::testing::skip;
use cairn_core::{Device, Extent, IoFlags, IoStatus, Op, Switches};
use cairn_leaves::rbd::ffi;
use cairn_leaves::rbd::session::Cluster;
use cairn_leaves::LeafSpec;

use cairn_testkit::ceph;
use ceph::TestCluster;

fn open(spec: &str) -> Result<Arc<dyn Device>, String> {
    open_named(spec, "r")
}

fn open_named(spec: &str, name: &str) -> Result<Arc<dyn Device>, String> {
    let spec = LeafSpec::parse(spec).map_err(|e| e.to_string())?;
    cairn_leaves::open(&spec, name).map_err(|e| e.to_string())
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
        TestCluster::shared("an_image_is_created_opened_written_and_read_back_through_the_eventfd")
    else {
        return;
    };
    let cluster =
        Cluster::connect(Some(tc.conf()), None, Duration::from_secs(30)).expect("connect");
    let pool = cluster.pool("rbd", None).expect("pool rbd");
    let t = tc.name("t");
    pool.create(&t, 64 << 20).expect("create");
    let image = pool.open(&t, None).expect("open");
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
        .open(&t, Some("nosnap"))
        .err()
        .expect("a missing snapshot opened")
        .to_string();
    assert!(e.contains(&format!("rbd/{t}@nosnap")), "{e}");
    let e = cluster
        .pool("nopool", None)
        .err()
        .expect("a missing pool opened")
        .to_string();
    assert!(e.contains("'nopool'") && e.contains("No such file"), "{e}");
    pool.remove(&t).expect("remove");
}

#[test]
fn an_unreachable_cluster_fails_the_connect_naming_its_monitors() {
    if let Err(e) = ffi::api() {
        skip(
            "an_unreachable_cluster_fails_the_connect_naming_its_monitors",
            &e.to_string(),
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

/// `op` (a read or a write) of each buffer in `bufs`, all in flight at once, the k-th at
/// `base + k * len`; panics if one fails.
fn run_all(q: &BlockingQueue, op: Op, base: u64, bufs: &mut [Vec<u8>]) {
    let mut reqs: Vec<Request<'_>> = bufs
        .iter_mut()
        .enumerate()
        .map(|(k, b)| Request {
            op,
            flags: IoFlags::NONE,
            offset: base + (k * b.len()) as u64,
            len: 0,
            buf: Some(b.as_mut_slice()),
        })
        .collect();
    for r in q.run(&mut reqs) {
        r.unwrap_or_else(|e| panic!("{op:?}: {e}"));
    }
}

/// `n` writes of `chunk` bytes in flight at once from `q`, at `base + k * chunk`, each
/// filled with `tag` and k; then the same ranges read back, also all in flight.
fn write_and_read_back(q: &BlockingQueue, base: u64, n: usize, chunk: usize, tag: u8) {
    let mut bufs: Vec<Vec<u8>> = (0..n)
        .map(|k| {
            (0..chunk)
                .map(|i| tag ^ (k as u8).wrapping_mul(31) ^ (i as u8))
                .collect()
        })
        .collect();
    let want = bufs.clone();
    run_all(q, Op::Write, base, &mut bufs);
    let mut back = vec![vec![0u8; chunk]; n];
    run_all(q, Op::Read, base, &mut back);
    for (k, (got, want)) in back.iter().zip(&want).enumerate() {
        assert!(
            got == want,
            "request {k} from queue {tag} read back other bytes"
        );
    }
}

#[test]
fn two_reactors_on_one_image_each_get_their_completions() {
    let Some(tc) = TestCluster::shared("two_reactors_on_one_image_each_get_their_completions")
    else {
        return;
    };
    let device = open_named(&tc.image("two", 64 << 20, ""), "rbd-two-reactors").expect("open");
    // Each reactor keeps 64 requests in flight (more than the queue's slots would need
    // to wait for) many times over; whichever wakes for the image's eventfd takes the
    // other's completions too and must hand them over.
    std::thread::scope(|s| {
        for tag in [1u8, 2] {
            let device = &device;
            s.spawn(move || {
                let q = BlockingQueue::open(device, Switches::default()).expect("queue");
                for round in 0..20u64 {
                    let base = u64::from(tag) * (16 << 20) + round * (64 << 12);
                    write_and_read_back(&q, base, 64, 4096, tag);
                }
            });
        }
    });
    // Both queues are gone: a third opens (their indexes were given back) and sees
    // what both wrote.
    let q = BlockingQueue::open(&device, Switches::default()).expect("queue");
    let mut a = vec![0u8; 4096];
    q.read(16 << 20, &mut a).expect("read");
    assert_eq!(a[4], 1 ^ 4);
    q.read(32 << 20, &mut a).expect("read");
    assert_eq!(a[4], 2 ^ 4);
    // Every queue's requests are counted under the device's name (admin stats, metrics).
    let s = cairn_core::stats::registry()
        .device("rbd-two-reactors", u64::MAX)
        .expect("the device is in the statistics registry");
    assert_eq!(s.ios[Op::Write.index()], 2 * 20 * 64);
    assert_eq!(s.ios[Op::Read.index()], 2 * 20 * 64 + 2);
    assert_eq!(s.errors, 0);
}

#[test]
fn holes_come_from_the_object_map() {
    let Some(tc) = TestCluster::shared("holes_come_from_the_object_map") else {
        return;
    };
    const MIB: u64 = 1 << 20;
    // 16 objects of 4 MiB (the default); data in objects 2 and 9.
    let device = open(&tc.image("holes", 64 * MIB, "")).expect("open");
    let q = BlockingQueue::open(&device, Switches::default()).expect("queue");
    q.write(9 * MIB, &[7u8; 4096], IoFlags::NONE)
        .expect("write");
    q.write(37 * MIB, &[7u8; 512], IoFlags::NONE)
        .expect("write");
    let map = |offset: u64, len: u64| {
        let mut out = Vec::new();
        device.extents(offset, len, &mut out).expect("extents");
        out
    };
    assert_eq!(
        map(0, 64 * MIB),
        vec![
            Extent::hole(8 * MIB),
            Extent::data(4 * MIB),
            Extent::hole(24 * MIB),
            Extent::data(4 * MIB),
            Extent::hole(24 * MIB),
        ]
    );
    // A range inside an object and across a boundary: cut to the range.
    assert_eq!(map(10 * MIB, MIB), vec![Extent::data(MIB)]);
    assert_eq!(
        map(11 * MIB, 2 * MIB),
        vec![Extent::data(MIB), Extent::hole(MIB)]
    );
    // Object 2 discarded whole: a hole again, and it reads back as zeroes.
    q.zero(Op::Discard, 8 * MIB, 4 * MIB, IoFlags::NONE)
        .expect("discard");
    assert_eq!(map(0, 32 * MIB), vec![Extent::hole(32 * MIB)]);
    let mut back = vec![1u8; 4096];
    q.read(9 * MIB, &mut back).expect("read");
    assert!(
        back.iter().all(|&b| b == 0),
        "a discarded range reads non-zero"
    );
}

#[test]
fn a_snapshot_opens_read_only_with_the_bytes_it_had() {
    let Some(tc) = TestCluster::shared("a_snapshot_opens_read_only_with_the_bytes_it_had") else {
        return;
    };
    let spec = tc.image("snap", 8 << 20, "");
    let device = open(&spec).expect("open");
    let q = BlockingQueue::open(&device, Switches::default()).expect("queue");
    q.write(4096, &[1u8; 8192], IoFlags::NONE).expect("write");
    q.flush().expect("flush");
    tc.rbd(&["snap", "create", &format!("rbd/{}@s1", tc.name("snap"))]);
    q.write(4096, &[2u8; 8192], IoFlags::NONE).expect("write");
    drop(q);

    let snap = open(&format!("{spec},snapshot=s1")).expect("open the snapshot");
    assert!(snap.describe().contains("read-only"), "{}", snap.describe());
    let caps = snap.geometry().caps;
    assert!(!caps.discard && !caps.write_zeroes && !caps.fua);
    let q = BlockingQueue::open(&snap, Switches::default()).expect("queue");
    let mut back = vec![0u8; 8192];
    q.read(4096, &mut back).expect("read the snapshot");
    assert!(
        back.iter().all(|&b| b == 1),
        "the snapshot holds later bytes"
    );
    assert_eq!(
        q.write(4096, &[3u8; 512], IoFlags::NONE),
        Err(BlockingError::Failed(IoStatus::errno(libc::EROFS)))
    );
    assert!(matches!(
        q.zero(Op::Discard, 0, 4096, IoFlags::NONE),
        Err(BlockingError::Refused(_))
    ));
    // More writes in flight than the queue has slots: each waiting one fails in turn.
    let mut bufs = vec![vec![3u8; 512]; 1000];
    let mut reqs: Vec<Request<'_>> = bufs
        .iter_mut()
        .map(|b| Request {
            op: Op::Write,
            flags: IoFlags::NONE,
            offset: 0,
            len: 0,
            buf: Some(b.as_mut_slice()),
        })
        .collect();
    for r in q.run(&mut reqs) {
        assert_eq!(r, Err(BlockingError::Failed(IoStatus::errno(libc::EROFS))));
    }
    // The image itself has the later bytes, the snapshot's write changed nothing.
    let q = BlockingQueue::open(&device, Switches::default()).expect("queue");
    q.read(4096, &mut back).expect("read the image");
    assert!(back.iter().all(|&b| b == 2), "the image lost a write");
}

#[test]
fn every_bad_target_is_one_clear_line() {
    let Some(tc) = TestCluster::shared("every_bad_target_is_one_clear_line") else {
        return;
    };
    let conf = tc.conf().display().to_string();
    let image = tc.image("bad", 1 << 20, "");
    let name = tc.name("bad");
    for (spec, says) in [
        (
            format!("rbd:rbd/{name}-none,conf={conf}"),
            format!("rbd/{name}-none"),
        ),
        (
            format!("rbd:nopool/{name},conf={conf}"),
            "'nopool'".to_string(),
        ),
        (
            format!("{image},snapshot=nosnap"),
            format!("rbd/{name}@nosnap"),
        ),
        (
            format!("rbd:rbd/{name},conf=/nonexistent/ceph.conf"),
            "/nonexistent/ceph.conf".to_string(),
        ),
    ] {
        let e = open(&spec).err().unwrap_or_else(|| panic!("{spec} opened"));
        assert!(e.contains(&says), "{spec}: {e}");
        assert!(!e.contains('\n'), "{spec}: more than one line: {e}");
    }
    // The image is untouched: all zeroes still.
    let device = open(&image).expect("open");
    let q = BlockingQueue::open(&device, Switches::default()).expect("queue");
    let mut back = vec![1u8; 1 << 20];
    q.read(0, &mut back).expect("read");
    assert!(back.iter().all(|&b| b == 0));
}

#[test]
fn a_stopped_osd_fails_requests_with_eio_and_they_work_again_once_it_is_back() {
    let test = "a_stopped_osd_fails_requests_with_eio_and_they_work_again_once_it_is_back";
    let Some(tc) = TestCluster::own(test) else {
        return;
    };
    let device = open(&tc.image("osd", 8 << 20, ",timeout=3")).expect("open");
    let q = BlockingQueue::open(&device, Switches::default()).expect("queue");
    q.write(0, &[5u8; 4096], IoFlags::NONE).expect("write");
    tc.osd_stop();
    assert_eq!(
        q.write(4096, &[6u8; 4096], IoFlags::NONE),
        Err(BlockingError::Failed(IoStatus::errno(libc::EIO)))
    );
    let mut back = vec![0u8; 4096];
    assert_eq!(
        q.read(0, &mut back),
        Err(BlockingError::Failed(IoStatus::errno(libc::EIO)))
    );
    tc.osd_start();
    q.write(8192, &[7u8; 4096], IoFlags::NONE)
        .expect("write once the OSD is back");
    q.read(0, &mut back).expect("read once the OSD is back");
    assert!(back.iter().all(|&b| b == 5));
    q.read(8192, &mut back).expect("read");
    assert!(back.iter().all(|&b| b == 7));
}

#[test]
fn a_denied_key_and_a_key_without_caps_are_one_line_each() {
    let test = "a_denied_key_and_a_key_without_caps_are_one_line_each";
    let Some(tc) = TestCluster::own_cephx(test) else {
        return;
    };
    let spec = tc.image("cephx", 8 << 20, "");
    let name = tc.name("cephx");
    // A conf for client NAME whose keyring is `keyring`.
    let conf_for = |client: &str, keyring: &std::path::Path| {
        let conf = tc.dir().join(format!("{client}.conf"));
        let text = std::fs::read_to_string(tc.conf()).unwrap()
            + &format!("\n[client.{client}]\nkeyring = {}\n", keyring.display());
        std::fs::write(&conf, text).unwrap();
        conf
    };
    // A key the cluster has never seen.
    let bad = tc.dir().join("bad.keyring");
    let key = std::process::Command::new("ceph-authtool")
        .arg("--gen-print-key")
        .output()
        .expect("ceph-authtool");
    std::fs::write(
        &bad,
        format!(
            "[client.stranger]\n\tkey = {}\n",
            String::from_utf8_lossy(&key.stdout).trim()
        ),
    )
    .unwrap();
    let conf = conf_for("stranger", &bad);
    let e = open(&format!(
        "rbd:rbd/{name},conf={},id=stranger,timeout=5",
        conf.display()
    ))
    .err()
    .expect("a stranger's key opened the image");
    assert!(e.contains("client.stranger"), "{e}");
    assert!(!e.contains('\n'), "{e}");
    // A key the cluster knows, allowed to read the monitors and nothing else.
    let nocaps = tc.dir().join("nocaps.keyring");
    tc.ceph(&[
        "auth",
        "get-or-create",
        "client.nocaps",
        "mon",
        "allow r",
        "-o",
        nocaps.to_str().unwrap(),
    ]);
    let conf = conf_for("nocaps", &nocaps);
    let e = open(&format!(
        "rbd:rbd/{name},conf={},id=nocaps,timeout=5",
        conf.display()
    ))
    .err()
    .expect("a key without caps opened the image");
    assert!(e.contains(&format!("rbd/{name}")), "{e}");
    assert!(!e.contains('\n'), "{e}");
    // client.admin (the conf's keyring) reads and writes it.
    let device = open(&spec).expect("admin opens the image");
    let q = BlockingQueue::open(&device, Switches::default()).expect("queue");
    q.write(0, &[9u8; 4096], IoFlags::NONE).expect("write");
    let mut back = vec![0u8; 4096];
    q.read(0, &mut back).expect("read");
    assert!(back.iter().all(|&b| b == 9));
}

#[test]
fn librbds_cache_stays_off_unless_the_image_turns_it_on() {
    let Some(tc) = TestCluster::shared("librbds_cache_stays_off_unless_the_image_turns_it_on")
    else {
        return;
    };
    let spec = tc.image("cache", 8 << 20, "");
    let device = open(&spec).expect("open");
    assert!(
        !device.describe().contains("cache on"),
        "{}",
        device.describe()
    );
    drop(device);
    // An image-level override wins over what cairn sets on its connection: the device
    // sees it, and its FUA writes (each followed by a flush) still read back.
    tc.rbd(&[
        "config",
        "image",
        "set",
        &format!("rbd/{}", tc.name("cache")),
        "rbd_cache",
        "true",
    ]);
    let device = open(&spec).expect("open");
    assert!(
        device.describe().contains("librbd's cache on"),
        "{}",
        device.describe()
    );
    let q = BlockingQueue::open(&device, Switches::default()).expect("queue");
    q.write(4096, &[4u8; 8192], IoFlags::FUA)
        .expect("FUA write");
    let mut back = vec![0u8; 8192];
    q.read(4096, &mut back).expect("read");
    assert!(back.iter().all(|&b| b == 4));
    drop(q);
    drop(device);
    let image = tc.export("cache");
    assert!(
        image[4096..12288].iter().all(|&b| b == 4),
        "the FUA write is not in the image"
    );
}
