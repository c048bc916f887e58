//! `cairn backup`, the backup client: a full copy then the changes since a checkpoint,
//! from a cairn thin volume (the README's flow) and from qemu-nbd exporting a qcow2 with
//! a persistent bitmap, each restore compared byte for byte with the point in time; and
//! what it refuses (no such bitmap, a DEST of another size or none) or stops on (a read
//! the server fails, a server gone mid-copy) with DEST unchanged or the offset named.

use super::*;

/// A pool on a sparse file, with the 16 MiB thin volume vm exported.
fn thin_stack(dir: &TempDir) -> PathBuf {
    write_stack(
        dir,
        &format!(
            "[device.d]\ntype = \"file\"\npath = \"{}\"\nsize = \"64M\"\nsparse = true\n\
             [device.pool]\ntype = \"thin-pool\"\ndata = \"d\"\n\
             [device.vm]\ntype = \"thin\"\npool = \"pool\"\nsize = \"16M\"\n\
             [export.vm]\ndevice = \"vm\"\n",
            dir.path().join("pool.img").display()
        ),
    )
}

/// `cairn backup ARGS`.
fn backup(args: &[&str]) -> Output {
    run(Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("backup")
        .args(args))
}

/// Every byte of export `name`, read with simple replies.
fn export_bytes(sock: &Path, name: &str) -> Vec<u8> {
    let (mut c, size, _) = Raw::go(sock, name);
    let mut all = Vec::with_capacity(size as usize);
    let mut off = 0;
    while off < size {
        let n = (size - off).min(1 << 20) as u32;
        all.extend(c.read_ok(off + 1, off, n));
        off += u64::from(n);
    }
    c.disconnect();
    all
}

/// Writes `count` random runs (up to 96 KiB each, seeded) to export `name`.
fn scatter(sock: &Path, name: &str, count: usize, seed: u64) {
    let (mut c, size, _) = Raw::go(sock, name);
    for i in 0..count {
        let r = random_bytes(16, seed + i as u64);
        let at = u64::from_le_bytes(r[0..8].try_into().unwrap()) % (size - (96 << 10));
        let len = 1 + u64::from_le_bytes(r[8..16].try_into().unwrap()) % (96 << 10);
        c.write_ok(i as u64 + 1, 0, at, &random_bytes(len as usize, seed ^ at));
    }
    c.request(0, CMD_FLUSH, 9999, 0, 0, &[]).unwrap();
    c.expect(9999, 0);
    c.disconnect();
}

fn admin_ok(ctl: &Path, words: &[&str]) {
    success(
        &format!("admin {words:?}"),
        &super::admin::admin(ctl, words),
    );
}

/// The README's flow with `cairn backup`: checkpoint c1 exported, a full backup of it
/// (sparse: the volume's holes are not read); writes, a discard and a write after c2;
/// checkpoint c2 exported, `backup --since c1` into the full backup (block status asked
/// a megabyte at a time): it equals c2, and read only part of the volume.
#[test]
fn full_then_since_restores_each_snapshot() {
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let stack = thin_stack(&dir);
    let srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    scatter(&srv.sock, "vm", 20, 1);
    admin_ok(&ctl, &["checkpoint", "pool", "vm", "c1"]);
    admin_ok(&ctl, &["export", "add", "c1", "pool", "c1"]);
    let dest = dir.path().join("vm.img");
    let out = backup(&[&srv.uri_for("c1"), path_str(&dest)]);
    let line = success("backup of c1", &out);
    assert!(line.starts_with("backup: full copy of "), "{line}");
    let c1 = export_bytes(&srv.sock, "c1");
    assert_same("full backup of c1", &std::fs::read(&dest).unwrap(), &c1);
    use std::os::unix::fs::MetadataExt;
    let allocated = std::fs::metadata(&dest).unwrap().blocks() * 512;
    assert!(
        allocated < 8 << 20,
        "{allocated} bytes allocated: holes were written"
    );

    scatter(&srv.sock, "vm", 12, 100);
    let (mut c, _, _) = Raw::go(&srv.sock, "vm");
    c.request(0, CMD_TRIM, 1, 1 << 20, 256 << 10, &[]).unwrap();
    c.expect(1, 0);
    c.disconnect();
    admin_ok(&ctl, &["checkpoint", "pool", "vm", "c2"]);
    // After c2: in neither snapshot.
    scatter(&srv.sock, "vm", 3, 200);
    admin_ok(&ctl, &["export", "add", "c2", "pool", "c2"]);
    let out = backup(&[
        &srv.uri_for("c2"),
        path_str(&dest),
        "--since",
        "c1",
        "--json",
        "--depth",
        "4",
        "--request-size",
        "128K",
        "--status-size",
        "1M",
    ]);
    let j: Value = serde_json::from_str(&success("backup --since c1", &out)).unwrap();
    let c2 = export_bytes(&srv.sock, "c2");
    assert_same("full + incremental", &std::fs::read(&dest).unwrap(), &c2);
    assert_ne!(c1, c2);
    let read = j["bytes_read"].as_u64().unwrap();
    assert!(read > 0 && read < 8 << 20, "{j}");
    assert_eq!(j["since"], "c1", "{j}");
    // Block status a megabyte at a time: one request per megabyte of the volume.
    assert_eq!(j["status_requests"], 16, "{j}");
    assert_eq!(j["export_bytes"], 16 << 20, "{j}");
}

/// What cairn backup refuses before it writes anything: a bitmap the export does not
/// offer (the line names those it does), a DEST of another size, no DEST at all.
#[test]
fn refusals_leave_dest_unchanged() {
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let stack = thin_stack(&dir);
    let srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    scatter(&srv.sock, "vm", 4, 7);
    admin_ok(&ctl, &["checkpoint", "pool", "vm", "c1"]);
    admin_ok(&ctl, &["checkpoint", "pool", "vm", "c2"]);
    admin_ok(&ctl, &["export", "add", "c2", "pool", "c2"]);
    let dest = dir.path().join("old.img");
    let old = random_bytes(16 << 20, 5);
    std::fs::write(&dest, &old).unwrap();
    let refused = |args: &[&str], why: &str| {
        let out = backup(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(why), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "one line: {err}");
    };
    let uri = srv.uri_for("c2");
    refused(
        &[&uri, path_str(&dest), "--since", "c9"],
        "offers no qemu:dirty-bitmap:c9 (it offers: base:allocation, qemu:dirty-bitmap:c1)",
    );
    assert_same("DEST after a refusal", &std::fs::read(&dest).unwrap(), &old);
    std::fs::write(&dest, &old[..15 << 20]).unwrap();
    refused(
        &[&uri, path_str(&dest), "--since", "c1"],
        "is 15728640 bytes and the export 16777216: not a backup of this export",
    );
    assert_same(
        "DEST after a refusal",
        &std::fs::read(&dest).unwrap(),
        &old[..15 << 20],
    );
    let missing = dir.path().join("missing.img");
    refused(
        &[&uri, path_str(&missing), "--since", "c1"],
        "does not exist: --since updates an earlier backup",
    );
    assert!(!missing.exists());
    refused(
        &[&uri, path_str(&dest), "--depth", "0"],
        "--depth 0 is out of range",
    );
}

/// A read the server fails stops the backup: exit status 1, the offset named.
#[test]
fn a_failed_read_stops_the_backup_at_its_offset() {
    let dir = tmpdir();
    // Sectors [4096, 4104): the 4 KiB at 2 MiB fail to read.
    let stack = write_stack(
        &dir,
        "[device.m]\ntype = \"mem\"\nsize = \"4M\"\n\
         [device.f]\ntype = \"fault\"\nbase = \"m\"\nfail = [\"read\"]\nsectors = [4096, 4104]\n\
         [export.f]\ndevice = \"f\"\n",
    );
    let srv = Server::start(&[path_str(&stack)]);
    let (mut c, _, _) = Raw::go(&srv.sock, "f");
    for i in 0..4u64 {
        c.write_ok(i + 1, 0, i << 20, &random_bytes(1 << 20, i));
    }
    c.disconnect();
    let dest = dir.path().join("f.img");
    let out = backup(&[&srv.uri(), path_str(&dest), "--request-size", "64K"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the server failed the read at offset 2097152 (65536 bytes)")
            && err.contains("is incomplete"),
        "{err}"
    );
}

/// The server killed while reads are in flight: exit status 1, the offset named.
#[test]
fn a_server_gone_mid_copy_stops_the_backup() {
    let dir = tmpdir();
    let stack = write_stack(
        &dir,
        "[device.m]\ntype = \"mem\"\nsize = \"8M\"\n\
         [device.slow]\ntype = \"delay\"\nbase = \"m\"\nread = \"20ms\"\n\
         [export.slow]\ndevice = \"slow\"\n",
    );
    let mut srv = Server::start(&[path_str(&stack)]);
    let (mut c, _, _) = Raw::go(&srv.sock, "slow");
    for i in 0..8u64 {
        c.write_ok(i + 1, 0, i << 20, &random_bytes(1 << 20, i));
    }
    c.disconnect();
    let dest = dir.path().join("slow.img");
    // 128 reads of 64 KiB, one at a time, 20 ms each: seconds, and the server is
    // killed once the first have landed.
    let child = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(["backup", &srv.uri(), path_str(&dest)])
        .args(["--request-size", "64K", "--depth", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + TOOL_TIMEOUT;
    while std::fs::metadata(&dest).map_or(0, |m| {
        use std::os::unix::fs::MetadataExt;
        m.blocks()
    }) == 0
    {
        assert!(Instant::now() < deadline, "the backup never wrote");
        std::thread::sleep(Duration::from_millis(5));
    }
    srv.signal(libc::SIGKILL);
    let _ = srv.wait_exit();
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the connection failed with the request at offset ")
            && err.contains("is incomplete"),
        "{err}"
    );
}

/// qemu-nbd exporting a qcow2 with a persistent bitmap (`qemu-img bitmap --add`, `-B`):
/// the full backup equals the image, the one `--since b1` applied to it equals the image
/// after the writes b1 counted; a bitmap qemu-nbd does not export is refused.
#[test]
fn qemu_nbd_bitmap_gives_the_same_restore() {
    const NAME: &str = "backup_client::qemu_nbd_bitmap_gives_the_same_restore";
    let Some([qemu_img, qemu_nbd, qemu_io]) = tools(NAME, ["qemu-img", "qemu-nbd", "qemu-io"])
    else {
        return;
    };
    let dir = tmpdir();
    let img = dir.path().join("disk.qcow2");
    let img_s = path_str(&img);
    let q = |cmd: &Path, args: &[&str]| {
        success(&format!("{args:?}"), &run(Command::new(cmd).args(args)))
    };
    q(&qemu_img, &["create", "-q", "-f", "qcow2", img_s, "16M"]);
    let io = |cmds: &[&str]| {
        let mut a = vec!["-f", "qcow2", img_s];
        for c in cmds {
            a.extend(["-c", c]);
        }
        q(&qemu_io, &a);
    };
    io(&[
        "write -P 0x11 0 1M",
        "write -P 0x22 5M 300k",
        "write -P 0x33 15M 1M",
    ]);
    let raw = |name: &str| {
        let p = dir.path().join(name);
        q(
            &qemu_img,
            &["convert", "-f", "qcow2", "-O", "raw", img_s, path_str(&p)],
        );
        std::fs::read(&p).unwrap()
    };
    let sock = dir.path().join("q.sock");
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let nbd = |bitmap: Option<&str>| {
        let mut cmd = Command::new(&qemu_nbd);
        cmd.args(["-r", "-t", "-e", "4", "-f", "qcow2", "-k", path_str(&sock)]);
        if let Some(b) = bitmap {
            cmd.args(["-B", b]);
        }
        let _ = std::fs::remove_file(&sock);
        let child = cmd
            .arg(img_s)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let guard = Killed(child);
        let deadline = Instant::now() + TOOL_TIMEOUT;
        while !sock.exists() {
            assert!(Instant::now() < deadline, "qemu-nbd never listened");
            std::thread::sleep(Duration::from_millis(10));
        }
        guard
    };
    let dest = dir.path().join("backup.img");
    let srv = nbd(None);
    success("full backup", &backup(&[&uri, path_str(&dest)]));
    drop(srv);
    assert_same(
        "full backup",
        &std::fs::read(&dest).unwrap(),
        &raw("before.raw"),
    );

    q(&qemu_img, &["bitmap", "--add", img_s, "b1"]);
    io(&[
        "write -P 0x44 512k 1M",
        "write -z 15M 64k",
        "write -P 0x55 9M 4k",
    ]);
    let after = raw("after.raw");
    let _srv = nbd(Some("b1"));
    let out = backup(&[&uri, path_str(&dest), "--since", "b1", "--json"]);
    let j: Value = serde_json::from_str(&success("backup --since b1", &out)).unwrap();
    assert_same(
        "full + changes since b1",
        &std::fs::read(&dest).unwrap(),
        &after,
    );
    let read = j["bytes_read"].as_u64().unwrap();
    assert!(((1 << 20) + (68 << 10)..4 << 20).contains(&read), "{j}");
    let out = backup(&[&uri, path_str(&dest), "--since", "b2"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("offers no qemu:dirty-bitmap:b2") && err.contains("qemu:dirty-bitmap:b1"),
        "{err}"
    );
}

/// Kills the child when dropped.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
