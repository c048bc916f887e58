use super::admin::{admin, block, version_of};
use super::ceph::TestCluster;
use super::*;

const MIB: u64 = 1 << 20;

/// A served image: nbdcopy in and out compare equal, `nbdinfo --map` shows the objects
/// never written as holes, qemu-img compares the export with the file, and `rbd export`
/// holds the same bytes once the server has stopped.
#[test]
fn an_image_served_round_trips_maps_holes_and_compares() {
    const NAME: &str = "rbd::an_image_served_round_trips_maps_holes_and_compares";
    let Some([nbdcopy, nbdinfo, qemu_img]) = tools(NAME, ["nbdcopy", "nbdinfo", "qemu-img"]) else {
        return;
    };
    let Some(tc) = TestCluster::shared(NAME) else {
        return;
    };
    let spec = tc.image("served", 64 * MIB, "");
    let srv = Server::start(&["--device", &spec]);
    // A local file with data in objects 1 and 5 (4 MiB each), holes elsewhere.
    let work = tmpdir();
    let src = work.path().join("src.img");
    {
        let f = std::fs::File::create(&src).unwrap();
        f.set_len(64 * MIB).unwrap();
        use std::os::unix::fs::FileExt;
        f.write_all_at(&random_bytes(4 * MIB as usize, 1), 4 * MIB)
            .unwrap();
        f.write_all_at(&random_bytes(MIB as usize, 2), 21 * MIB)
            .unwrap();
    }
    success(
        "nbdcopy up",
        &run(Command::new(&nbdcopy).args(["--destination-is-zero", path_str(&src), &srv.uri()])),
    );
    let back = work.path().join("back.img");
    success(
        "nbdcopy down",
        &run(Command::new(&nbdcopy).args([&srv.uri(), path_str(&back)])),
    );
    assert_same(
        "nbdcopy round trip",
        &std::fs::read(&back).unwrap(),
        &std::fs::read(&src).unwrap(),
    );
    let (runs, out) = map_runs(&nbdinfo, &srv.uri());
    // Type 3: hole and zero; 0: data.
    assert_eq!(
        runs,
        vec![
            (0, 4 * MIB, 3),
            (4 * MIB, 4 * MIB, 0),
            (8 * MIB, 12 * MIB, 3),
            (20 * MIB, 4 * MIB, 0),
            (24 * MIB, 40 * MIB, 3),
        ],
        "{out}"
    );
    success(
        "qemu-img compare",
        &run(Command::new(&qemu_img).args([
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            path_str(&src),
            &srv.uri(),
        ])),
    );
    drop(srv);
    assert_same(
        "rbd export",
        &tc.export("served"),
        &std::fs::read(&src).unwrap(),
    );
}

/// `cairn bench --verify` through an image: every block read is checked.
#[test]
fn bench_verifies_what_it_wrote_through_an_image() {
    const NAME: &str = "rbd::bench_verifies_what_it_wrote_through_an_image";
    let Some(tc) = TestCluster::shared(NAME) else {
        return;
    };
    let spec = tc.image("bench", 16 * MIB, "");
    let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args([
        "bench",
        "--device",
        &spec,
        "--rw",
        "randrw",
        "--iodepth",
        "16",
        "--io_size",
        "8M",
        "--verify",
        "crc32c",
        "--output-format",
        "json",
    ]));
    let text = success("cairn bench --verify", &out);
    let json: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let checked = json["cairn"]["verify"]["blocks_checked"]
        .as_u64()
        .unwrap_or_else(|| panic!("no verify count: {text}"));
    assert!(checked > 0, "no block was read back and checked: {text}");
}

/// A write-back cache in memory over an image: what a flush covered is in the image
/// after `kill -9` (rbd export); a write after the flush is there or not, never torn.
#[test]
fn a_cache_over_an_image_keeps_what_was_flushed_through_kill_9() {
    const NAME: &str = "rbd::a_cache_over_an_image_keeps_what_was_flushed_through_kill_9";
    let Some(tc) = TestCluster::shared(NAME) else {
        return;
    };
    const PAGES: u64 = 256;
    tc.image("cached", 8 * MIB, "");
    let dir = tmpdir();
    let stack = write_stack(
        &dir,
        &format!(
            "[device.img]\ntype = \"rbd\"\npool = \"rbd\"\nimage = \"{}\"\nconf = \"{}\"\n\
             [device.c]\ntype = \"cache\"\nbase = \"img\"\nmemory = \"16M\"\n",
            tc.name("cached"),
            tc.conf().display()
        ),
    );
    let mut srv = Server::start(&[path_str(&stack)]);
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    // Pages 0..256 (every other 4 KiB of the first 2 MiB) at version 1, flushed; then
    // version 2 of the even ones, not flushed.
    for p in 0..PAGES {
        c.write_ok(p + 1, 0, p * 8192, &block(p, 1));
    }
    c.request(0, CMD_FLUSH, 999, 0, 0, &[]).unwrap();
    c.expect(999, 0);
    for p in (0..PAGES).step_by(2) {
        c.write_ok(p + 1000, 0, p * 8192, &block(p, 2));
    }
    srv.signal(libc::SIGKILL);
    let _ = srv.wait_exit();
    let image = tc.export("cached");
    for p in 0..PAGES {
        let at = (p * 8192) as usize;
        let v = version_of(p, &image[at..at + 4096], "after kill -9");
        let ok = if p % 2 == 0 { [1, 2] } else { [1, 1] };
        assert!(ok.contains(&v), "page {p}: version {v} after kill -9");
    }
}

/// A mirror of a local file and an image: the OSD stopped under writes fails the image
/// (the client sees no error); the cluster back, `readd` puts it back through the
/// bitmap, and both copies hold the same bytes.
#[test]
fn a_mirror_of_a_file_and_an_image_rides_out_a_stopped_osd() {
    const NAME: &str = "rbd::a_mirror_of_a_file_and_an_image_rides_out_a_stopped_osd";
    let Some(tc) = TestCluster::own(NAME) else {
        return;
    };
    const PAGES: u64 = 64;
    const STRIDE: u64 = 128 << 10;
    tc.image("mirrored", 9 * MIB, "");
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let file = dir.path().join("a.img");
    let stack = write_stack(
        &dir,
        &format!(
            "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
             [device.img]\ntype = \"rbd\"\npool = \"rbd\"\nimage = \"{}\"\nconf = \"{}\"\n\
             timeout = 3\n\
             [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"img\"]\n\
             bitmap = \"64K\"\nbitmap_delay = \"100ms\"\nreadd = \"1s\"\n",
            file.display(),
            tc.name("mirrored"),
            tc.conf().display()
        ),
    );
    let mut srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    let write_all = |srv: &Server, version: u64, step: usize| {
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        for p in (0..PAGES).step_by(step) {
            c.write_ok(p + 1, 0, p * STRIDE, &block(p, version));
        }
        c.request(0, CMD_FLUSH, 999, 0, 0, &[]).unwrap();
        c.expect(999, 0);
        for p in 0..PAGES {
            let data = c.read_ok(p + 1000, p * STRIDE, 4096);
            let v = version_of(p, &data, "read back");
            assert!(
                v == version || !(p as usize).is_multiple_of(step),
                "page {p}: version {v}"
            );
        }
        c.disconnect();
    };
    write_all(&srv, 1, 1);
    tc.osd_stop();
    // Every fourth page at version 2: the first write to the image times out (3 s),
    // the array fails it and goes on with the file alone.
    write_all(&srv, 2, 4);
    let out = success("status", &admin(&ctl, &["status"]));
    assert!(out.contains("img failed"), "{out}");
    tc.osd_start();
    let t = Instant::now();
    loop {
        let out = success("status", &admin(&ctl, &["status"]));
        if out.contains("[UU] a active, img active") && out.contains("last rebuild:") {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the image was not re-added:\n{out}\n{}",
            srv.stderr()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    write_all(&srv, 3, 8);
    let (status, log) = srv.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("re-added"), "{log}");
    // Both copies' data areas (after the superblocks) hold the same bytes.
    let (a, b) = (std::fs::read(&file).unwrap(), tc.export("mirrored"));
    let data_offset = u64::from_le_bytes(a[80..88].try_into().unwrap()) as usize;
    assert_eq!(
        data_offset,
        u64::from_le_bytes(b[80..88].try_into().unwrap()) as usize
    );
    assert_same("the mirror's copies", &b[data_offset..], &a[data_offset..]);
}

/// A missing image refuses the start with one line naming it; nothing is created.
#[test]
fn a_missing_image_refuses_the_start_in_one_line() {
    const NAME: &str = "rbd::a_missing_image_refuses_the_start_in_one_line";
    let Some(tc) = TestCluster::shared(NAME) else {
        return;
    };
    let name = tc.name("absent");
    let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args([
        "serve",
        "--listen",
        &format!("unix:{}", tmpdir().path().join("s").display()),
        "--device",
        &format!("rbd:rbd/{name},conf={}", tc.conf().display()),
    ]));
    assert!(!out.status.success());
    let err = text(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains(&format!("rbd/{name}")), "{err}");
    let listed = text(&tc.rbd(&["ls", "rbd"]).stdout);
    assert!(!listed.contains(&name), "{listed}");
}

/// SIGTERM while requests wait on a stopped OSD (the device's timeout is the default
/// 30 s): the server gives up on them after `--shutdown-timeout`, says so, and exits 1.
#[test]
fn sigterm_with_requests_stuck_on_a_stopped_osd_ends_at_the_shutdown_timeout() {
    const NAME: &str =
        "rbd::sigterm_with_requests_stuck_on_a_stopped_osd_ends_at_the_shutdown_timeout";
    let Some(tc) = TestCluster::own(NAME) else {
        return;
    };
    let spec = tc.image("stuck", 8 * MIB, "");
    let mut srv = Server::start(&["--device", &spec, "--shutdown-timeout", "2s"]);
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    c.write_ok(1, 0, 0, &block(0, 1));
    tc.osd_stop();
    // Sent, never answered while the OSD is down.
    for p in 1..5u64 {
        c.request(0, CMD_WRITE, p + 1, p * 4096, 4096, &block(p, 1))
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(500));
    srv.signal(libc::SIGTERM);
    // wait_exit gives it 20 s: less than the 30 s the requests would take to time out.
    let (status, log) = srv.wait_exit();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("abandoned"), "{log}");
}
