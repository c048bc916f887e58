use super::filesystem::Mounted;
use super::*;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

/// Whether FUSE tests can run here (root, /dev/fuse); records a skip otherwise.
fn fuse_here(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip(test, "needs root (mounting FUSE)");
        return false;
    }
    if !Path::new("/dev/fuse").exists() {
        skip(test, "/dev/fuse is missing");
        return false;
    }
    true
}

/// The transports to run a test with: /dev/fuse reads always, FUSE over io_uring when
/// the fuse module allows it (else a skip is recorded for that half).
fn transports(test: &str) -> Vec<&'static str> {
    let mut v = vec!["off"];
    let on = std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
        .is_ok_and(|s| s.trim() == "Y");
    if on {
        v.push("auto");
    } else {
        skip(
            &format!("{test} (io_uring half)"),
            "the fuse module's enable_uring is not Y (scripts/test.sh sets it as root)",
        );
    }
    v
}

/// `cairn serve --device DEVICE --fuse DISK --fuse-io-uring TRANSPORT` (and NBD on a
/// Unix socket in `dir`, and the admin socket `dir/admin.sock`).
fn fuse_server(dir: TempDir, device: &str, disk: &Path, transport: &str) -> Server {
    let ctl = dir.path().join("admin.sock");
    Server::start_in(
        dir,
        &[
            "--device",
            device,
            "--fuse",
            path_str(disk),
            "--fuse-io-uring",
            transport,
            "--admin",
            path_str(&ctl),
        ],
    )
}

fn mounted(path: &Path) -> Option<String> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    mounts
        .lines()
        .find(|l| l.split(' ').nth(1) == Some(path_str(path)))
        .map(str::to_string)
}

/// Writes `data` at `offset` of `path` with dd (`extra`: oflag=direct and the like).
fn dd_write(path: &Path, src: &Path, seek_mib: u64, extra: &[&str]) {
    let out = run(Command::new("dd")
        .arg(format!("if={}", src.display()))
        .arg(format!("of={}", path.display()))
        .args(["bs=1M", "conv=notrunc,fsync", "status=none"])
        .arg(format!("seek={seek_mib}"))
        .args(extra));
    success("dd", &out);
}

/// dd writes (buffered and O_DIRECT) read back byte for byte with cmp, and qemu-img
/// finds the file and the same export over NBD identical; with each transport.
#[test]
fn dd_and_cmp_through_the_file_and_qemu_img_compare_over_nbd() {
    const NAME: &str = "fuse_export::dd_and_cmp_through_the_file_and_qemu_img_compare_over_nbd";
    if !fuse_here(NAME) {
        return;
    }
    let Some([qemu_img, cmp]) = tools(NAME, ["qemu-img", "cmp"]) else {
        return;
    };
    for transport in transports(NAME) {
        let dir = tmpdir();
        let disk = dir.path().join("disk");
        let src = dir.path().join("src");
        std::fs::write(&src, random_bytes(8 << 20, 7)).unwrap();
        let srv = fuse_server(dir, "mem:64M", &disk, transport);
        let m = std::fs::metadata(&disk).unwrap();
        assert!(m.is_file(), "{transport}: a regular file");
        assert_eq!(m.len(), 64 << 20, "{transport}: the device's size");
        let line = mounted(&disk).expect("mounted");
        assert!(line.contains("fuse.cairn"), "{line}");
        dd_write(&disk, &src, 3, &[]);
        dd_write(&disk, &src, 40, &["oflag=direct"]);
        for (skip_bytes, what) in [(3u64 << 20, "buffered"), (40 << 20, "O_DIRECT")] {
            let out = run(Command::new(&cmp)
                .args(["-n", &(8u64 << 20).to_string()])
                .arg(&src)
                .arg(&disk)
                .arg("0")
                .arg(skip_bytes.to_string()));
            success(&format!("{transport}: cmp of the {what} write"), &out);
        }
        // The rest reads as zeroes.
        let f = std::fs::File::open(&disk).unwrap();
        let mut buf = vec![0xffu8; 1 << 20];
        f.read_exact_at(&mut buf, 20 << 20).unwrap();
        assert!(buf.iter().all(|&b| b == 0), "{transport}: never written");
        drop(f);
        let out = run(Command::new(&qemu_img)
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&disk)
            .arg(srv.uri()));
        assert!(
            success(&format!("{transport}: qemu-img compare"), &out).contains("identical"),
            "{}",
            text(&out.stdout)
        );
        // The admin socket shows the file under its export, with what it answered.
        let ctl = srv.dir.path().join("admin.sock");
        let want = if transport == "off" {
            "/dev/fuse"
        } else {
            "io_uring"
        };
        let out = super::admin::admin(&ctl, &["status"]);
        let status = success(&format!("{transport}: admin status"), &out);
        let line = status
            .lines()
            .find(|l| l.trim_start().starts_with("fuse "))
            .unwrap_or_else(|| panic!("{transport}: no fuse line in:\n{status}"));
        assert!(
            line.contains(&format!("fuse {} ({want})", disk.display())),
            "{line}"
        );
        let out = super::admin::admin(&ctl, &["status", "--json"]);
        let doc: serde_json::Value =
            serde_json::from_str(success("status --json", &out).trim()).expect("JSON");
        let f = &doc["exports"][0]["fuse"][0];
        assert_eq!(f["path"], path_str(&disk), "{doc}");
        assert_eq!(f["transport"], want, "{doc}");
        let n = |k: &str| f[k].as_u64().unwrap_or_else(|| panic!("{k}: {f}"));
        assert!(n("written_bytes") >= 16 << 20, "{f}");
        assert!(n("writes") >= 16, "{f}");
        // cmp read 16 MiB and the zero check 1 MiB (at most 1 MiB per request).
        assert!(n("read_bytes") >= 17 << 20, "{f}");
        assert!(n("reads") >= 17, "{f}");
        assert!(n("flushes") >= 2, "{f}: dd conv=fsync, twice");
        assert!(
            n("requests") >= n("reads") + n("writes") + n("flushes") + n("errors"),
            "{f}"
        );
    }
}

/// Writes that do not cover whole blocks (read-modify-write) from four threads at
/// once, each into its own quarter of every block, then fallocate's punch and zero
/// range, SEEK_DATA and SEEK_HOLE, and what a device cannot do (grow, shrink).
#[test]
fn partial_block_writes_fallocate_and_seek_through_the_file() {
    const NAME: &str = "fuse_export::partial_block_writes_fallocate_and_seek_through_the_file";
    if !fuse_here(NAME) {
        return;
    }
    for transport in transports(NAME) {
        let dir = tmpdir();
        let disk = dir.path().join("disk");
        let srv = fuse_server(dir, "mem:16M,block=4096", &disk, transport);
        const BLOCKS: u64 = 256;
        const ROUNDS: u64 = 16;
        // Four writers, each owning bytes [q*1024, q*1024+1024) of every block,
        // rewriting them in random order: a read-modify-write that is not alone on
        // the device would bring back another quarter's old bytes.
        let writers: Vec<_> = (0..4u64)
            .map(|q| {
                let disk = disk.clone();
                std::thread::spawn(move || {
                    let f = std::fs::OpenOptions::new().write(true).open(&disk).unwrap();
                    for round in 0..ROUNDS {
                        for i in 0..BLOCKS {
                            let blk = (i * 37 + q * 11 + round) % BLOCKS;
                            let data = random_bytes(1024, blk << 8 | q << 4 | round);
                            f.write_all_at(&data, blk * 4096 + q * 1024).unwrap();
                        }
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&disk)
            .unwrap();
        let mut model = vec![0u8; (BLOCKS * 4096) as usize];
        for blk in 0..BLOCKS {
            for q in 0..4u64 {
                let at = (blk * 4096 + q * 1024) as usize;
                model[at..at + 1024]
                    .copy_from_slice(&random_bytes(1024, blk << 8 | q << 4 | (ROUNDS - 1)));
            }
        }
        let mut got = vec![0u8; model.len()];
        f.read_exact_at(&mut got, 0).unwrap();
        assert_same(&format!("{transport}: quarters"), &got, &model);

        // Odd sizes at odd offsets, across block boundaries.
        for (i, (off, len)) in [(5u64, 3usize), (4095, 2), (8190, 9000), (100_001, 70_000)]
            .into_iter()
            .enumerate()
        {
            let data = random_bytes(len, 900 + i as u64);
            f.write_all_at(&data, off).unwrap();
            model[off as usize..off as usize + len].copy_from_slice(&data);
        }
        let fallocate = |mode: i32, off: i64, len: i64| -> std::io::Result<()> {
            // SAFETY: fallocate on a descriptor we own.
            if unsafe { libc::fallocate(f.as_raw_fd(), mode, off, len) } == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        };
        fallocate(
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            1000,
            50_000,
        )
        .unwrap();
        model[1000..51_000].fill(0);
        fallocate(libc::FALLOC_FL_ZERO_RANGE, 123_457, 9_999).unwrap();
        model[123_457..133_456].fill(0);
        fallocate(
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            8192,
            4096,
        )
        .unwrap();
        model[8192..12_288].fill(0);
        f.read_exact_at(&mut got, 0).unwrap();
        assert_same(&format!("{transport}: after fallocate"), &got, &model);
        f.sync_all().unwrap();

        let size = 16i64 << 20;
        let e = fallocate(0, size - 4096, 8192).unwrap_err();
        assert_eq!(
            e.raw_os_error(),
            Some(libc::EOPNOTSUPP),
            "{transport}: grow"
        );
        let e = f.set_len(0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{transport}: shrink");
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), size as u64);
        let e = f.write_at(b"x", size as u64).unwrap_err();
        assert_eq!(
            e.raw_os_error(),
            Some(libc::ENOSPC),
            "{transport}: past the end"
        );

        // Data where written, holes where never written or punched whole (the mem
        // device knows both, page by page): the punch of [1000, 51000) made the whole
        // pages [4096, 49152) holes; the page around 51000 still holds data.
        let seek = |off: i64, whence: i32| {
            // SAFETY: lseek on a descriptor we own.
            let r = unsafe { libc::lseek(f.as_raw_fd(), off, whence) };
            if r < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(r)
            }
        };
        assert_eq!(seek(0, libc::SEEK_DATA).unwrap(), 0, "{transport}");
        assert_eq!(
            seek(0, libc::SEEK_HOLE).unwrap(),
            4096,
            "{transport}: the punched pages"
        );
        assert_eq!(seek(4096, libc::SEEK_DATA).unwrap(), 49_152, "{transport}");
        let hole = seek(49_152, libc::SEEK_HOLE).unwrap();
        assert!(
            hole >= (BLOCKS * 4096) as i64 && hole < size,
            "{transport}: first hole after the punch at {hole}"
        );
        let e = seek(8 << 20, libc::SEEK_DATA).unwrap_err();
        assert_eq!(
            e.raw_os_error(),
            Some(libc::ENXIO),
            "{transport}: no data after 8M"
        );
        assert_eq!(seek(size - 1, libc::SEEK_HOLE).unwrap(), size - 1);
        drop(f);
        drop(srv);
    }
}

/// fio's io_uring engine with O_DIRECT on the file: random 4 KiB writes at iodepth
/// 32, each block with a crc32c, read back and checked.
#[test]
fn fio_io_uring_direct_verify_on_the_file() {
    const NAME: &str = "fuse_export::fio_io_uring_direct_verify_on_the_file";
    if !fuse_here(NAME) {
        return;
    }
    let Some([fio]) = tools(NAME, ["fio"]) else {
        return;
    };
    for transport in transports(NAME) {
        let dir = tmpdir();
        let disk = dir.path().join("disk");
        let srv = fuse_server(dir, "mem:64M", &disk, transport);
        let out = run(Command::new(&fio)
            .current_dir(srv.path(""))
            .args([
                "--name=verify",
                "--ioengine=io_uring",
                "--direct=1",
                "--rw=randwrite",
                "--bs=4k",
                "--size=48M",
                "--iodepth=32",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
                "--output-format=json",
            ])
            .arg(format!("--filename={}", disk.display())));
        let json = success(&format!("{transport}: fio verify"), &out);
        let v: Value = serde_json::from_str(&json[json.find('{').unwrap()..]).unwrap();
        let job = &v["jobs"][0];
        assert_eq!(job["error"], 0, "{transport}: {json}");
        assert_eq!(
            job["write"]["io_bytes"].as_u64(),
            Some(48 << 20),
            "{transport}: every block written"
        );
        assert!(
            job["read"]["io_bytes"].as_u64() == Some(48 << 20),
            "{transport}: every block read back and verified"
        );
    }
}

/// A read-only export is mounted read-only: reads work, opening for writing fails.
/// Bad --fuse arguments are refused before anything is mounted.
/// `--fuse` over a file that holds data, with another device served, is refused before
/// anything is opened or mounted, saying how to serve that file; the file is untouched.
/// (It mounted the default 1 GiB memory disk over the file: everything written was
/// lost at exit.) Needs no root: the refusal comes first.
#[test]
fn a_fuse_path_holding_data_is_refused_unless_it_is_the_served_file() {
    let dir = tmpdir();
    let data = dir.path().join("mydisk.img");
    let bytes = random_bytes(8 << 20, 77);
    std::fs::write(&data, &bytes).unwrap();
    for args in [
        vec!["serve", "--fuse", path_str(&data)],
        vec!["serve", "--device", "mem:16M", "--fuse", path_str(&data)],
    ] {
        let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args(&args));
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains("a file of 8388608 bytes is there")
                && err.contains(&format!("--device file:{}", data.display())),
            "{err}"
        );
        assert!(mounted(&data).is_none(), "{args:?}: mounted");
        assert!(
            std::fs::read(&data).unwrap() == bytes,
            "{args:?}: the file changed"
        );
    }
}

#[test]
fn a_read_only_export_is_mounted_read_only_and_bad_arguments_are_refused() {
    const NAME: &str =
        "fuse_export::a_read_only_export_is_mounted_read_only_and_bad_arguments_are_refused";
    if !fuse_here(NAME) {
        return;
    }
    let dir = tmpdir();
    let ro = dir.path().join("ro.img");
    let rw = dir.path().join("rw.img");
    let stack = write_stack(
        &dir,
        &format!(
            "[device.m]\ntype = \"mem\"\nsize = \"8M\"\n\
                 [export.a]\ndevice = \"m\"\nread_only = true\nfuse = \"{}\"\n\
                 [export.b]\ndevice = \"m\"\n",
            ro.display()
        ),
    );
    // Mistakes: exit status 2 and nothing mounted.
    let bad_dir = dir.path().join("adir");
    std::fs::create_dir(&bad_dir).unwrap();
    let in_dir = format!("{}:b", bad_dir.display());
    for (args, needle) in [
        (vec!["--fuse", &in_dir], "is a directory"),
        (
            vec!["--fuse", path_str(&rw)],
            "name the export (PATH:EXPORT)",
        ),
        (vec!["--fuse", "/tmp/x:nosuch"], "no export named 'nosuch'"),
        (
            vec![
                "--fuse",
                &format!("{}:b", rw.display()),
                "--fuse",
                &format!("{}:b", rw.display()),
            ],
            "named twice",
        ),
        (
            vec!["--fuse", path_str(&rw), "--fuse-depth", "0"],
            "--fuse-depth",
        ),
    ] {
        let out = run(Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("serve")
            .arg(&stack)
            .args([
                "--listen",
                &format!("unix:{}", dir.path().join("x.sock").display()),
            ])
            .args(&args));
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains(needle),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(mounted(&rw).is_none() && mounted(&ro).is_none(), "{args:?}");
    }
    let srv = Server::start_in(
        dir,
        &[path_str(&stack), "--fuse", &format!("{}:b", rw.display())],
    );
    let line = mounted(&ro).expect("ro.img mounted");
    assert!(
        line.split(' ')
            .nth(3)
            .unwrap()
            .split(',')
            .any(|o| o == "ro"),
        "{line}"
    );
    let e = std::fs::OpenOptions::new()
        .write(true)
        .open(&ro)
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS));
    // The same device, writable through the other export, shows through both.
    let data = random_bytes(1 << 20, 55);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&rw)
        .unwrap()
        .write_all_at(&data, 1 << 20)
        .unwrap();
    let mut got = vec![0u8; data.len()];
    std::fs::File::open(&ro)
        .unwrap()
        .read_exact_at(&mut got, 1 << 20)
        .unwrap();
    assert_same("through the read-only export", &got, &data);
    drop(srv);
    assert!(
        mounted(&ro).is_none() && mounted(&rw).is_none(),
        "unmounted at exit"
    );
    assert!(
        !ro.exists() && !rw.exists(),
        "the files cairn created are gone"
    );
}

/// SIGTERM flushes and unmounts; a cairn killed with SIGKILL leaves a dead mount,
/// which the next run detaches before it mounts again; what was written survives
/// both, on a file device.
#[test]
fn sigterm_unmounts_and_a_stale_mount_is_cleaned_up() {
    const NAME: &str = "fuse_export::sigterm_unmounts_and_a_stale_mount_is_cleaned_up";
    if !fuse_here(NAME) {
        return;
    }
    let dir = tmpdir();
    let img = dir.path().join("back.img");
    let disk = dir.path().join("disk");
    std::fs::write(&disk, b"").unwrap(); // an existing mount point stays at exit
    let device = format!("file:{},size=16M", img.display());
    let args = ["--device", &device, "--fuse", path_str(&disk)];
    // Each run in a directory of its own (a killed one leaves its socket behind).
    let start = || {
        let inner = tempfile::tempdir_in(dir.path()).unwrap();
        let sock = inner.path().join("nbd.sock");
        let listen = format!("unix:{}", sock.display());
        Server::spawn(inner, sock, &["--listen", &listen], &args)
    };
    let first = random_bytes(2 << 20, 61);
    let mut srv = start();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&disk)
        .unwrap()
        .write_all_at(&first, 4 << 20)
        .unwrap();
    let (status, log) = srv.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("flushed and unmounted"), "{log}");
    assert!(mounted(&disk).is_none(), "unmounted");
    assert!(disk.exists(), "a mount point that was there before stays");

    // Killed: the mount stays behind, dead.
    let mut srv = start();
    srv.signal(libc::SIGKILL);
    let _ = srv.wait_exit();
    assert!(mounted(&disk).is_some(), "a killed cairn leaves its mount");
    let e = std::fs::metadata(&disk).unwrap_err();
    assert!(
        matches!(
            e.raw_os_error(),
            Some(libc::ENOTCONN) | Some(libc::ECONNABORTED)
        ),
        "a dead mount: {e}"
    );

    let srv = start();
    assert!(
        srv.stderr().contains("detached the stale mount"),
        "{}",
        srv.stderr()
    );
    let mut got = vec![0u8; first.len()];
    std::fs::File::open(&disk)
        .unwrap()
        .read_exact_at(&mut got, 4 << 20)
        .unwrap();
    assert_same("after SIGTERM and a stale mount", &got, &first);
    drop(srv);
    assert!(mounted(&disk).is_none());
}

/// ext4 on a raid10 export through `losetup` on the FUSE file: files written and
/// fsynced, unmounted, fsck clean, every file read back.
#[test]
fn ext4_on_a_raid10_export_through_the_fuse_file_and_a_loop_device() {
    ext4_on_fuse(
        "fuse_export::ext4_on_a_raid10_export_through_the_fuse_file_and_a_loop_device",
        false,
    );
}

/// The same, with the power cut through the admin socket between fsyncs (the raid10's
/// members are write-back caches, so the cut loses what no flush made durable), then
/// cairn killed, restarted on the same files (the dead mount is cleaned up): the
/// journal replays, fsck is clean, and every fsynced file is intact.
#[test]
fn ext4_survives_a_power_cut_between_fsyncs_through_the_fuse_file() {
    ext4_on_fuse(
        "fuse_export::ext4_survives_a_power_cut_between_fsyncs_through_the_fuse_file",
        true,
    );
}

fn ext4_on_fuse(name: &str, power_cut: bool) {
    if !fuse_here(name) {
        return;
    }
    let Some([losetup, mkfs, fsck, mount, umount]) = tools(
        name,
        ["losetup", "mkfs.ext4", "fsck.ext4", "mount", "umount"],
    ) else {
        return;
    };
    let probe = run_for(Command::new(&losetup).arg("-f"), Duration::from_secs(30));
    if !probe.status.success() {
        skip(
            name,
            &format!("losetup -f: no loop device: {}", text(&probe.stderr).trim()),
        );
        return;
    }
    let transport = *transports(name).last().unwrap();
    let dir = tmpdir();
    // RAID10 of four 33 MiB files (behind write-back caches for the power cut), with
    // superblocks (the default): 64 MiB.
    let mut toml = String::from(
            "[writeback]\nexpire = \"60s\"\ninterval = \"60s\"\nbackground = \"80%\"\nlimit = \"90%\"\n",
        );
    let mut members = Vec::new();
    for i in 0..4 {
        toml += &format!(
            "[device.d{i}]\ntype = \"file\"\npath = \"{}\"\nsize = \"33M\"\n",
            dir.path().join(format!("d{i}.img")).display()
        );
        if power_cut {
            toml += &format!("[device.c{i}]\ntype = \"cache\"\nbase = \"d{i}\"\nmemory = \"8M\"\n");
            members.push(format!("\"c{i}\""));
        } else {
            members.push(format!("\"d{i}\""));
        }
    }
    toml += &format!(
        "[device.r]\ntype = \"raid10\"\nmembers = [{}]\nchunk = \"64K\"\n",
        members.join(", ")
    );
    let stack = write_stack(&dir, &toml);
    let disk = dir.path().join("disk");
    let ctl = dir.path().join("admin.sock");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let start = || {
        let inner = tempfile::tempdir_in(dir.path()).unwrap();
        let sock = inner.path().join("nbd.sock");
        let listen = format!("unix:{}", sock.display());
        Server::spawn(
            inner,
            sock,
            &["--listen", &listen],
            &[
                path_str(&stack),
                "--fuse",
                path_str(&disk),
                "--fuse-io-uring",
                transport,
                "--admin",
                path_str(&ctl),
            ],
        )
    };
    let mut srv = start();
    let mut m = Mounted {
        umount: umount.clone(),
        losetup: losetup.clone(),
        fusermount: PathBuf::from("/bin/false"),
        mnt: None,
        loop_dev: None,
        fuse: None,
    };
    let attach = |m: &mut Mounted| -> String {
        let out = run_for(
            Command::new(&losetup).args(["--find", "--show"]).arg(&disk),
            Duration::from_secs(60),
        );
        let dev = success("losetup", &out).trim().to_string();
        m.loop_dev = Some(dev.clone());
        dev
    };
    let dev = attach(&mut m);
    success(
        "mkfs.ext4",
        &run(Command::new(&mkfs).args(["-q", "-F", &dev])),
    );
    success(
        "mount",
        &run(Command::new(&mount)
            .args(["-t", "ext4", "-o", "commit=600", &dev])
            .arg(&mnt)),
    );
    m.mnt = Some(mnt.clone());
    let files: Vec<(PathBuf, Vec<u8>)> = (0..6)
        .map(|i| {
            let sub = mnt.join(format!("dir{}", i % 3));
            (
                sub.join(format!("file{i}")),
                random_bytes((512 << 10) + i * 4096 + 17, 300 + i as u64),
            )
        })
        .collect();
    let write = |path: &Path, data: &[u8], fsync: bool| {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut f = std::fs::File::create(path).unwrap();
        f.write_all(data).unwrap();
        if fsync {
            f.sync_all().unwrap();
            std::fs::File::open(path.parent().unwrap())
                .unwrap()
                .sync_all()
                .unwrap();
        } else {
            // To the device, without a flush: what the cut takes.
            // SAFETY: sync_file_range on a descriptor we own.
            unsafe {
                libc::sync_file_range(
                    f.as_raw_fd(),
                    0,
                    0,
                    libc::SYNC_FILE_RANGE_WAIT_BEFORE
                        | libc::SYNC_FILE_RANGE_WRITE
                        | libc::SYNC_FILE_RANGE_WAIT_AFTER,
                )
            };
        }
    };
    let synced = if power_cut { 4 } else { files.len() };
    for (path, data) in &files[..synced] {
        write(path, data, true);
    }
    if power_cut {
        write(&files[4].0, &files[4].1, false);
        let out = run(Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("admin")
            .arg(&ctl)
            .arg("power-cut"));
        success("admin power-cut", &out);
        // The machine is gone: nothing more reaches the devices.
        srv.signal(libc::SIGKILL);
        let _ = srv.wait_exit();
        let _ = std::fs::remove_file(&ctl);
        // The file system goes with errors; the loop device with it.
        let _ = run(Command::new(&umount).arg(&mnt));
        if mounted(&mnt).is_some() {
            let _ = run(Command::new(&umount).arg("-l").arg(&mnt));
        }
        m.mnt = None;
        m.detach();
        srv = start();
        assert!(
            srv.stderr().contains("detached the stale mount"),
            "{}",
            srv.stderr()
        );
        let dev = attach(&mut m);
        // Mounting replays the journal.
        success(
            "mount after the cut",
            &run(Command::new(&mount).args(["-t", "ext4", &dev]).arg(&mnt)),
        );
        m.mnt = Some(mnt.clone());
    }
    m.unmount();
    let dev = m.loop_dev.clone().unwrap();
    let out = run(Command::new(&fsck).args(["-f", "-n", &dev]));
    success("fsck.ext4 -f -n (a clean file system)", &out);
    success(
        "mount -o ro",
        &run(Command::new(&mount)
            .args(["-t", "ext4", "-o", "ro", &dev])
            .arg(&mnt)),
    );
    m.mnt = Some(mnt.clone());
    for (path, data) in &files[..synced] {
        assert_same(
            &path.display().to_string(),
            &std::fs::read(path).unwrap(),
            data,
        );
    }
    m.unmount();
    m.detach();
    let (status, log) = srv.stop();
    assert!(status.success(), "{log}");
    assert!(mounted(&disk).is_none(), "unmounted at exit");
}
