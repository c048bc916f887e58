use super::*;

#[test]
fn nbdcopy_round_trip_is_byte_exact() {
    const NAME: &str = "clients::nbdcopy_round_trip_is_byte_exact";
    let Some([nbdcopy]) = tools(NAME, ["nbdcopy"]) else {
        return;
    };
    let srv = Server::start(&["--device", "mem:32M"]);
    let src = srv.path("src.img");
    let back = srv.path("back.img");
    let data = random_bytes(32 << 20, 1);
    std::fs::write(&src, &data).unwrap();
    success(
        "nbdcopy into the export",
        &run(Command::new(&nbdcopy).args(["--flush", path_str(&src), &srv.uri()])),
    );
    success(
        "nbdcopy out of the export",
        &run(Command::new(&nbdcopy).args([&srv.uri(), path_str(&back)])),
    );
    assert_same("nbdcopy round trip", &std::fs::read(&back).unwrap(), &data);
    // One connection and many requests in flight: the same bytes again.
    let back1 = srv.path("back1.img");
    success(
        "nbdcopy out, one connection",
        &run(Command::new(&nbdcopy).args([
            "--connections=1",
            "--requests=64",
            "--request-size=65536",
            &srv.uri(),
            path_str(&back1),
        ])),
    );
    assert_same(
        "nbdcopy, one connection",
        &std::fs::read(&back1).unwrap(),
        &data,
    );
}

#[test]
fn qemu_img_convert_and_compare() {
    const NAME: &str = "clients::qemu_img_convert_and_compare";
    let Some([qemu_img]) = tools(NAME, ["qemu-img"]) else {
        return;
    };
    let srv = Server::start(&["--device", "mem:16M"]);
    let src = srv.path("src.raw");
    let data = random_bytes(16 << 20, 2);
    std::fs::write(&src, &data).unwrap();
    // -n: the target exists; -W and -m 16: many writes in flight, out of order.
    success(
        "qemu-img convert into the export",
        &run(Command::new(&qemu_img).args([
            "convert",
            "-n",
            "-W",
            "-m",
            "16",
            "-f",
            "raw",
            "-O",
            "raw",
            path_str(&src),
            &srv.uri(),
        ])),
    );
    let compare = |a: &Path| {
        run(Command::new(&qemu_img).args([
            "compare",
            "-s",
            "-f",
            "raw",
            "-F",
            "raw",
            path_str(a),
            &srv.uri(),
        ]))
    };
    let out = compare(&src);
    success("qemu-img compare -s", &out);
    // The comparison is not vacuous: one changed byte makes it fail with status 1.
    let mut changed = data.clone();
    changed[5 << 20] ^= 0xff;
    let other = srv.path("changed.raw");
    std::fs::write(&other, &changed).unwrap();
    let out = compare(&other);
    assert_eq!(
        out.status.code(),
        Some(1),
        "qemu-img compare of different images: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    // And out again, byte for byte.
    let back = srv.path("back.raw");
    success(
        "qemu-img convert out of the export",
        &run(Command::new(&qemu_img).args([
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            &srv.uri(),
            path_str(&back),
        ])),
    );
    assert_same("qemu-img round trip", &std::fs::read(&back).unwrap(), &data);
}

#[test]
fn qemu_io_patterns_zeroes_discards_flushes_and_aio() {
    const NAME: &str = "clients::qemu_io_patterns_zeroes_discards_flushes_and_aio";
    let Some([qemu_io]) = tools(NAME, ["qemu-io"]) else {
        return;
    };
    let srv = Server::start(&["--device", "mem:16M"]);
    let script = [
        "write -P 0xab 0 64k",
        "read -P 0xab 0 64k",
        "write -z 64k 64k",
        "read -P 0 64k 64k",
        "write -P 0xcd 128k 64k",
        "discard 128k 64k",
        "write -P 0xce 128k 4k",
        "read -P 0xce 128k 4k",
        "write -f -P 0x11 256k 4k",
        "read -P 0x11 256k 4k",
        "write -P 0x12 320k 64k",
        "write -z -u 320k 64k",
        "read -P 0 320k 64k",
        "write -z -f 384k 4k",
        "read -P 0 384k 4k",
        "flush",
        "aio_write -P 0x21 1M 64k",
        "aio_write -P 0x22 2M 64k",
        "aio_write -P 0x23 3M 1M",
        "aio_flush",
        "aio_read -P 0x21 1M 64k",
        "aio_read -P 0x22 2M 64k",
        "aio_read -P 0x23 3M 1M",
        "aio_flush",
        "writev -P 0x31 8M 4k 4k 8k",
        "readv -P 0x31 8M 16k",
        "read -P 0xab 0 64k",
        "flush",
    ];
    let mut cmd = Command::new(&qemu_io);
    cmd.args(["-f", "raw"]);
    for c in script {
        cmd.args(["-c", c]);
    }
    cmd.arg(srv.uri());
    let out = run(&mut cmd);
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "qemu-io: {}\n{all}", out.status);
    for bad in ["Pattern verification failed", "error", "failed"] {
        assert!(!all.contains(bad), "qemu-io printed {bad:?}:\n{all}");
    }
    // The check is not vacuous: a wrong pattern is reported.
    let out =
        run(Command::new(&qemu_io).args(["-f", "raw", "-c", "read -P 0x55 0 4k", &srv.uri()]));
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(all.contains("Pattern verification failed"), "{all}");
}

#[test]
/// fio with crc32c verify through a write-back cache much smaller than the data (so
/// pages are evicted, written back under pressure, and written through when the cache
/// is all dirty); then the export is copied out with nbdcopy, the server stopped, and
/// the file below the cache must equal the copy: what the cache served is what it
/// wrote back.
fn fio_verify_through_a_small_write_back_cache_then_the_file_matches() {
    const NAME: &str = "clients::fio_verify_through_a_small_write_back_cache_then_the_file_matches";
    let Some([fio, nbdcopy]) = tools(NAME, ["fio", "nbdcopy"]) else {
        return;
    };
    let dir = tmpdir();
    let disk = dir.path().join("disk.img");
    let stack = write_stack(
            &dir,
            &format!(
                "[writeback]\nbackground = \"10%\"\nlimit = \"20%\"\nexpire = \"200ms\"\ninterval = \"100ms\"\n\
                 [device.f]\ntype = \"file\"\npath = \"{}\"\nsize = \"64M\"\n\
                 [device.c]\ntype = \"cache\"\nbase = \"f\"\nmemory = \"4M\"\n",
                disk.display()
            ),
        );
    let mut srv = Server::start_in(dir, &[path_str(&stack)]);
    let out = fio_randwrite_verify(&fio, &srv, &[]);
    success("fio through the cache", &out);
    let copy = srv.path("copy.img");
    let out = run(Command::new(&nbdcopy).arg(srv.uri()).arg(&copy));
    success("nbdcopy", &out);
    let (status, log) = srv.stop();
    assert!(status.success(), "exit status {status}; stderr:\n{log}");
    let copied = std::fs::read(&copy).unwrap();
    let file = std::fs::read(&disk).unwrap();
    assert_eq!(copied.len(), 64 << 20);
    assert_same(
        "the file below the cache against the export",
        &file,
        &copied,
    );
}

#[test]
fn fio_nbd_engine_randwrite_with_crc32c_verify() {
    const NAME: &str = "clients::fio_nbd_engine_randwrite_with_crc32c_verify";
    let Some([fio]) = tools(NAME, ["fio"]) else {
        return;
    };
    let srv = Server::start(&["--device", "mem:64M"]);
    let out = fio_randwrite_verify(&fio, &srv, &["--output-format=json"]);
    let stdout = success("fio", &out);
    // fio's nbd engine prints a line before the JSON.
    let start = stdout
        .find("\n{")
        .map(|i| i + 1)
        .or_else(|| stdout.starts_with('{').then_some(0))
        .unwrap_or_else(|| panic!("no JSON from fio: {stdout}"));
    let json: Value = serde_json::from_str(&stdout[start..])
        .unwrap_or_else(|e| panic!("fio JSON ({e}): {stdout}"));
    let job = &json["jobs"][0];
    assert_eq!(job["error"], 0, "{job:#}");
    assert_eq!(job["write"]["io_bytes"], 64u64 << 20, "{job:#}");
    // The verify pass reads everything back.
    assert_eq!(job["read"]["io_bytes"], 64u64 << 20, "{job:#}");
}
