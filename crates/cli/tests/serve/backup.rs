//! Incremental backup over NBD: checkpoints of a thin volume (kept in its pool's
//! metadata, no bitmap store), their snapshots exported with the changes since the
//! checkpoint before, a full backup with nbdcopy, an incremental one read through
//! `qemu:dirty-bitmap:NAME` with libnbd, and the restore compared byte for byte; the same
//! after `kill -9` during writes; bitmap stores on other devices; bad input.

use super::*;

/// Helpers for the scripts: the admin socket, connections, block status of a context,
/// and an incremental backup applied to a copy of the full one.
const PRELUDE: &str = r#"
import json
import os
import random
import shutil
import subprocess
import nbd

SOCK = os.environ["CAIRN_SOCK"]
DIR = os.environ["CAIRN_DIR"]
G = 65536

def admin(*words):
    out = subprocess.run([os.environ["CAIRN_BIN"], "admin", os.environ["CAIRN_ADMIN"], *words],
                         capture_output=True, text=True)
    assert out.returncode == 0, out
    return out.stdout

def connect(name, contexts=()):
    h = nbd.NBD()
    h.set_export_name(name)
    for c in contexts:
        h.add_meta_context(c)
    h.connect_unix(SOCK)
    return h

def runs(h, context):
    """(offset, length, flags) of the whole export in `context`."""
    size, off, out = h.get_size(), 0, []
    while off < size:
        got = []
        def cb(meta, start, entries, err):
            if meta == context:
                got.extend(entries)
            return 0
        h.block_status(min(size - off, 1 << 30), off, cb)
        assert got, "no extents for " + context
        for i in range(0, len(got), 2):
            n = min(got[i], size - off)
            out.append((off, n, got[i + 1]))
            off += n
    return out

def full_backup(export, path):
    subprocess.run(["nbdcopy", "nbd+unix:///%s?socket=%s" % (export, SOCK), path], check=True)

def incremental(export, bitmap, base, path):
    """Applies the dirty extents of `bitmap` read from `export` to a copy of `base`;
    returns the bytes read."""
    shutil.copyfile(base, path)
    ctx = "qemu:dirty-bitmap:" + bitmap
    h = connect(export, [ctx])
    assert h.can_meta_context(ctx), ctx
    read = 0
    with open(path, "r+b") as f:
        for off, n, flags in runs(h, ctx):
            assert flags in (0, 1), flags
            if flags & 1:
                for at in range(off, off + n, 32 << 20):
                    m = min(32 << 20, off + n - at)
                    f.seek(at)
                    f.write(h.pread(m, at))
                    read += m
    h.shutdown()
    return read

def same(a, b):
    with open(a, "rb") as x, open(b, "rb") as y:
        return x.read() == y.read()
"#;

/// The whole flow: writes, checkpoint c1, full backup of c1; writes of every kind,
/// checkpoint c2, the incremental backup (the changes since c1 on snapshot c2) applied to
/// the full one equals c2; every granule written with data is reported changed, and none
/// left alone (zeroes and discards of a block that was a hole stay unchanged: it reads as
/// zeros both times). CAIRN_EXPECT gets them for nbdinfo and qemu-img.
const FLOW: &str = r#"
h = connect("vm")
size = h.get_size()
rng = random.Random(38)
for i in range(300):
    h.pwrite(rng.randbytes(4096), rng.randrange(size // 4096) * 4096)
h.flush()
admin("checkpoint", "pool", "vm", "c1")
admin("export", "add", "c1", "pool", "c1")
full = os.path.join(DIR, "full.img")
full_backup("c1", full)

touched = []
written = set()
for i in range(60):
    off, n = rng.randrange(size - 20000), rng.randrange(1, 20000)
    h.pwrite(rng.randbytes(n), off)
    touched.append((off, n))
    written |= set(range(off // G, (off + n - 1) // G + 1))
h.zero(3 * G + 512, 40 * G)
touched.append((40 * G, 3 * G + 512))
h.trim(2 * G, 100 * G)
touched.append((100 * G, 2 * G))
# Blocks zeroed or discarded whole after their writes may read as they did at c1.
written -= set(range(40, 43)) | set(range(100, 102))
h.flush()
listed = admin("checkpoint", "list", "pool", "--json").splitlines()[-1]
assert [c["name"] for c in json.loads(listed)] == ["c1"], listed
admin("checkpoint", "pool", "vm", "c2")
# Writes after c2 count as changes since c2, not in the changes from c1 to c2.
h.pwrite(b"late" * 1024, size - 4096)
h.flush()
admin("export", "add", "c2", "pool", "c2")

want = sorted({g for off, n in touched for g in range(off // G, (off + n - 1) // G + 1)})
b = connect("c2", ["qemu:dirty-bitmap:c1"])
got = sorted({g for off, n, f in runs(b, "qemu:dirty-bitmap:c1") if f & 1
              for g in range(off // G, (off + n) // G)})
b.shutdown()
assert written <= set(got) <= set(want), (sorted(written - set(got))[:10],
                                          sorted(set(got) - set(want))[:10])
json.dump(got, open(os.environ["CAIRN_EXPECT"], "w"))

restored = os.path.join(DIR, "restored.img")
read = incremental("c2", "c1", full, restored)
assert read == len(got) * G, (read, len(got))
c2 = os.path.join(DIR, "c2.img")
full_backup("c2", c2)
assert same(restored, c2), "the restore differs from snapshot c2"
assert not same(full, c2)
print("incremental read", read, "of", size, "bytes: restored")
"#;

/// A thin volume served from a pool: no bitmap store, its checkpoints are the pool's.
fn stack_text(data: &Path) -> String {
    format!(
        "[device.d]\ntype = \"file\"\npath = \"{}\"\nsize = \"256M\"\nsparse = true\n\
         [device.pool]\ntype = \"thin-pool\"\ndata = \"d\"\n\
         [device.vm]\ntype = \"thin\"\npool = \"pool\"\nsize = \"64M\"\n\
         [export.vm]\ndevice = \"vm\"\n",
        data.display(),
    )
}

fn env_for(dir: &Path, ctl: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("CAIRN_BIN", env!("CARGO_BIN_EXE_cairn").to_string()),
        ("CAIRN_ADMIN", path_str(ctl).to_string()),
        ("CAIRN_DIR", path_str(dir).to_string()),
        (
            "CAIRN_EXPECT",
            path_str(&dir.join("expect.json")).to_string(),
        ),
    ]
}

/// A test's set-up: libnbd's Python and nbdcopy (else a skip), a directory, the admin
/// socket's path, and the stack file of a pool with volume vm.
fn set_up(test: &str) -> Option<(PathBuf, TempDir, PathBuf, PathBuf)> {
    let python = python_with_libnbd(test)?;
    tools(test, ["nbdcopy"])?;
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let stack = write_stack(&dir, &stack_text(&dir.path().join("pool.img")));
    Some((python, dir, ctl, stack))
}

/// Granule runs (offset, length) of the dirty granules `want`, merged.
fn dirty_runs(want: &[u64], g: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &n in want {
        match out.last_mut() {
            Some((o, l)) if *o + *l == n * g => *l += g,
            _ => out.push((n * g, g)),
        }
    }
    out
}

#[test]
fn checkpoints_give_an_incremental_backup_that_restores_the_snapshot() {
    const NAME: &str = "backup::checkpoints_give_an_incremental_backup_that_restores_the_snapshot";
    let Some((python, dir, ctl, stack)) = set_up(NAME) else {
        return;
    };
    let Some([nbdinfo, qemu_img]) = tools(NAME, ["nbdinfo", "qemu-img"]) else {
        return;
    };
    let srv = Server::start_in(
        tmpdir(),
        &[
            path_str(&stack),
            "--admin",
            path_str(&ctl),
            "--metrics",
            "tcp:127.0.0.1:0",
        ],
    );
    let script = format!("{PRELUDE}{FLOW}");
    libnbd_script(
        &python,
        &script,
        &srv.sock,
        &env_for(dir.path(), &ctl),
        "restored",
    );

    // nbdinfo and qemu-img see exactly the granules written between the checkpoints.
    let want: Vec<u64> =
        serde_json::from_slice(&std::fs::read(dir.path().join("expect.json")).unwrap()).unwrap();
    let uri = srv.uri_for("c2");
    let out = success(
        "nbdinfo --map=qemu:dirty-bitmap:c1",
        &run(Command::new(&nbdinfo).args(["--map=qemu:dirty-bitmap:c1", "--json", &uri])),
    );
    let json: Value = serde_json::from_str(&out).unwrap();
    let dirty: Vec<(u64, u64)> = json
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["type"].as_u64() == Some(1))
        .map(|r| (r["offset"].as_u64().unwrap(), r["length"].as_u64().unwrap()))
        .collect();
    assert_eq!(dirty, dirty_runs(&want, 65536), "{out}");
    let opts = format!(
        "driver=nbd,server.type=unix,server.path={},export=c2,x-dirty-bitmap=qemu:dirty-bitmap:c1",
        srv.sock.display()
    );
    let out = success(
        "qemu-img map x-dirty-bitmap",
        &run(Command::new(&qemu_img).args(["map", "--output=json", "--image-opts", &opts])),
    );
    let json: Value = serde_json::from_str(&out).unwrap();
    // qemu shows a dirty range as "data": false.
    let mut dirty: Vec<(u64, u64)> = Vec::new();
    for r in json.as_array().unwrap() {
        if r["data"] == false {
            let (o, l) = (r["start"].as_u64().unwrap(), r["length"].as_u64().unwrap());
            match dirty.last_mut() {
                Some((po, pl)) if *po + *pl == o => *pl += l,
                _ => dirty.push((o, l)),
            }
        }
    }
    assert_eq!(dirty, dirty_runs(&want, 65536), "{out}");

    // The pool lists both checkpoints; status shows the exports added while serving.
    let text = success(
        "checkpoint list",
        &super::admin::admin(&ctl, &["checkpoint", "list", "pool"]),
    );
    assert!(
        text.contains("vm c1: snapshot 'c1', changes in units of 64KiB")
            && text.contains("vm c2: snapshot 'c2'"),
        "{text}"
    );
    let status = super::observe::json(
        "status --json",
        &super::admin::admin(&ctl, &["status", "--json"]),
    );
    let checkpoints = &status["thin_pools"][0]["checkpoints"];
    assert_eq!(checkpoints[0]["name"], "c1", "{status:#}");
    assert_eq!(checkpoints[1]["volume"], "vm", "{status:#}");
    assert_eq!(checkpoints[1]["snapshot"], true, "{status:#}");
    let text = success(
        "thin list",
        &super::admin::admin(&ctl, &["thin", "list", "pool"]),
    );
    assert!(
        text.contains("  c2: 64MiB virtual, ") && text.contains("checkpoint of vm"),
        "{text}"
    );
    // Exports added while serving are listed with the others.
    let exports = status["exports"].as_array().unwrap();
    let c2 = exports
        .iter()
        .find(|e| e["name"] == "c2")
        .expect("c2 in status");
    assert_eq!(c2["read_only"], true, "{status:#}");
    assert!(exports.iter().any(|e| e["name"] == "vm"), "{status:#}");
    let metrics = super::observe::scrape(&python, &super::observe::metrics_url(&srv));
    assert!(
        metrics.contains("cairn_nbd_connections{export=\"c2\"} 0"),
        "{metrics}"
    );
    for c in ["c1", "c2"] {
        let line = format!("cairn_thin_checkpoint_info{{pool=\"pool\",volume=\"vm\",checkpoint=\"{c}\",snapshot=\"true\"}} 1");
        assert!(metrics.contains(&line), "{line} in {metrics}");
    }
    // The newest checkpoint's snapshot stays (the changes since it are counted against
    // it); an older one goes, its changes kept: the volume still offers the changes since
    // c1, and they are those since c2 and before it.
    success(
        "export remove",
        &super::admin::admin(&ctl, &["export", "remove", "c2"]),
    );
    super::admin::refused(
        &ctl,
        &["thin", "delete", "pool", "c2"],
        "newest checkpoint: the changes since it are counted against it",
    );
    success(
        "export remove",
        &super::admin::admin(&ctl, &["export", "remove", "c1"]),
    );
    success(
        "thin delete",
        &super::admin::admin(&ctl, &["thin", "delete", "pool", "c1"]),
    );
    let text = success(
        "checkpoint list",
        &super::admin::admin(&ctl, &["checkpoint", "list", "pool"]),
    );
    assert!(
        text.contains("vm c1: snapshot deleted, the ")
            && text.contains(" changed from it to 'c2' kept"),
        "{text}"
    );
    // The metrics say so too: c1 is kept without its snapshot, with the bytes of its
    // changes to c2 (the blocks written between them).
    let metrics = super::observe::scrape(&python, &super::observe::metrics_url(&srv));
    let kept = format!(
        "cairn_thin_checkpoint_kept_bytes{{pool=\"pool\",volume=\"vm\",checkpoint=\"c1\"}} {}",
        dirty_runs(&want, 65536).iter().map(|r| r.1).sum::<u64>()
    );
    assert!(
        metrics.contains("cairn_thin_checkpoint_info{pool=\"pool\",volume=\"vm\",checkpoint=\"c1\",snapshot=\"false\"} 1")
            && metrics.contains(&kept),
        "{kept} in {metrics}"
    );
    let out = success(
        "nbdinfo --map=qemu:dirty-bitmap:c1 of vm",
        &run(Command::new(&nbdinfo).args([
            "--map=qemu:dirty-bitmap:c1",
            "--json",
            &srv.uri_for("vm"),
        ])),
    );
    let json: Value = serde_json::from_str(&out).unwrap();
    let since_c1: u64 = json
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["type"].as_u64() == Some(1))
        .map(|r| r["length"].as_u64().unwrap())
        .sum();
    // Those from c1 to c2, and the last block (written after c2).
    let mut all: std::collections::BTreeSet<u64> = want.iter().copied().collect();
    all.insert((64 << 20) / 65536 - 1);
    assert_eq!(since_c1, all.len() as u64 * 65536, "{out}");
}

/// Checkpoint c1 and its full backup, then random writes with 64 in flight and the
/// server killed; after the restart, checkpoint c2: the incremental backup from c1
/// restores c2 exactly, and the bitmap is not inconsistent.
const KILL: &str = r#"
import signal
h = connect("vm")
size = h.get_size()
rng = random.Random(39)
for i in range(200):
    h.pwrite(rng.randbytes(4096), rng.randrange(size // 4096) * 4096)
h.flush()
admin("checkpoint", "pool", "vm", "c1")
admin("export", "add", "c1", "pool", "c1")
full_backup("c1", os.path.join(DIR, "full.img"))
pending, done = [], 0
while done < 3000:
    while len(pending) < 64:
        pending.append(h.aio_pwrite(rng.randbytes(4096), rng.randrange(size // 4096) * 4096))
    h.poll(-1)
    still = []
    for c in pending:
        if h.aio_command_completed(c):
            done += 1
        else:
            still.append(c)
    pending = still
while h.aio_get_direction() & nbd.AIO_DIRECTION_WRITE:
    h.poll(-1)
os.kill(int(os.environ["CAIRN_SERVER_PID"]), signal.SIGKILL)
print("killed")
"#;

const AFTER_KILL: &str = r#"
listed = json.loads(admin("checkpoint", "list", "pool", "--json").splitlines()[-1])
assert [c["name"] for c in listed] == ["c1"] and listed[0]["snapshot"], listed
admin("checkpoint", "pool", "vm", "c2")
admin("export", "add", "c2", "pool", "c2")
restored = os.path.join(DIR, "restored.img")
read = incremental("c2", "c1", os.path.join(DIR, "full.img"), restored)
c2 = os.path.join(DIR, "c2.img")
full_backup("c2", c2)
assert same(restored, c2), "the restore differs from snapshot c2"
print("read", read, "bytes: restored")
"#;

#[test]
fn kill_9_during_writes_leaves_a_bitmap_that_restores_exactly() {
    const NAME: &str = "backup::kill_9_during_writes_leaves_a_bitmap_that_restores_exactly";
    let Some((python, dir, ctl, stack)) = set_up(NAME) else {
        return;
    };
    let mut srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    let pid = srv.child.as_ref().expect("running").id();
    let mut env = env_for(dir.path(), &ctl);
    env.push(("CAIRN_SERVER_PID", pid.to_string()));
    libnbd_script(
        &python,
        &format!("{PRELUDE}{KILL}"),
        &srv.sock,
        &env,
        "killed",
    );
    let (status, log) = srv.wait_exit();
    assert!(!status.success(), "killed, yet {status}:\n{log}");

    let srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    let env = env_for(dir.path(), &ctl);
    libnbd_script(
        &python,
        &format!("{PRELUDE}{AFTER_KILL}"),
        &srv.sock,
        &env,
        "restored",
    );
}

/// Writes to export d, then asks block status with two contexts at once: one reply
/// carries a chunk for each.
const BOTH_CONTEXTS: &str = r#"
h = connect("d")
h.pwrite(b"x" * 5000, 70000)
h.zero(4096, 1 << 20)
h.trim(65536, 4 << 20)
h.flush()
h.shutdown()
ctx = "qemu:dirty-bitmap:b0"
h = connect("d", ["base:allocation", ctx])
seen = {}
def cb(meta, start, entries, err):
    seen[meta] = list(entries)
    return 0
h.block_status(2 << 20, 0, cb)
assert sorted(seen) == ["base:allocation", ctx], seen
assert seen[ctx][:6] == [65536, 0, 65536, 1, (1 << 20) - 131072, 0], seen[ctx]
print("written")
"#;

/// Holds a connection reading bitmap b0 of export d until stdin closes.
const HOLDER: &str = r#"
import sys
h = connect("d", ["qemu:dirty-bitmap:b0"])
assert h.can_meta_context("qemu:dirty-bitmap:b0")
print("holding", flush=True)
sys.stdin.read()
h.shutdown()
"#;

/// A bitmap on a plain file device, by hand: added online, set by writes exactly, kept
/// across a restart; and every kind of bad input refused with a clear line.
#[test]
fn bitmaps_by_hand_on_a_file_device_and_bad_input() {
    const NAME: &str = "backup::bitmaps_by_hand_on_a_file_device_and_bad_input";
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    let Some([nbdinfo]) = tools(NAME, ["nbdinfo"]) else {
        return;
    };
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let store = dir.path().join("d.bitmaps");
    let data = dir.path().join("d.img");
    let cairn = env!("CARGO_BIN_EXE_cairn");

    // Stack files that cannot hold bitmaps are refused before anything is written.
    let bad = [
        (
            "[device.d]\ntype = \"file\"\npath = \"d.img\"\nsize = \"16M\"\n\
             [device.p]\ntype = \"thin-pool\"\ndata = \"d\"\nbitmaps = \"p.bitmaps\"\n",
            "a thin pool cannot hold dirty bitmaps",
        ),
        (
            "[device.a]\ntype = \"mem\"\nsize = \"16M\"\nbitmaps = \"x.bitmaps\"\n\
             [device.b]\ntype = \"mem\"\nsize = \"16M\"\nbitmaps = \"x.bitmaps\"\n",
            "each needs a store of its own",
        ),
        (
            "[device.a]\ntype = \"mem\"\nsize = \"16M\"\nbitmaps = 3\n",
            "key 'bitmaps' must be the path",
        ),
    ];
    for (text, why) in bad {
        let stack = write_stack(&dir, text);
        let out = run(Command::new(cairn).args(["check", path_str(&stack)]));
        assert!(!out.status.success(), "{text}");
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(said.contains(why), "{said}");
    }
    assert!(!dir.path().join("x.bitmaps").exists() && !dir.path().join("d.img").exists());

    let stack = write_stack(
        &dir,
        &format!(
            "[device.d]\ntype = \"file\"\npath = \"{}\"\nsize = \"16M\"\nbitmaps = \"{}\"\n\
             [device.m]\ntype = \"mem\"\nsize = \"16M\"\n\
             [export.d]\ndevice = \"d\"\n[export.m]\ndevice = \"m\"\n",
            data.display(),
            store.display()
        ),
    );
    let mut srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    let admin = |words: &[&str]| super::admin::admin(&ctl, words);
    let refused = |words: &[&str], why: &str| super::admin::refused(&ctl, words, why);
    refused(&["bitmap", "add", "m", "b0"], "keeps no dirty bitmaps");
    refused(&["bitmap", "add", "d", "a:b"], "is not a bitmap name");
    refused(&["bitmap", "add", "d", "b0", "3k"], "a power of two");
    refused(&["bitmap", "add", "d", "b0", "1k"], "a power of two");
    success("bitmap add", &admin(&["bitmap", "add", "d", "b0"]));
    success("bitmap add", &admin(&["bitmap", "add", "d", "fine", "4k"]));
    refused(&["bitmap", "add", "d", "b0"], "exists");
    refused(&["bitmap", "remove", "d", "nope"], "no bitmap 'nope'");
    refused(&["bitmap", "merge", "d", "b0"], "usage");
    refused(&["checkpoint", "pool", "d", "c1"], "no thin pool 'pool'");
    refused(&["export", "add", "x", "pool", "v"], "no thin pool 'pool'");
    refused(&["export", "remove", "d"], "only exports added");

    // Writes set the bits of exactly the granules they touch.
    let uri = srv.uri_for("d");
    let write = format!("{PRELUDE}{BOTH_CONTEXTS}");
    let env = env_for(dir.path(), &ctl);
    libnbd_script(&python, &write, &srv.sock, &env, "written");
    let map = |uri: &str, ctx: &str| -> Vec<(u64, u64)> {
        let out = success(
            "nbdinfo --map",
            &run(Command::new(&nbdinfo).args([&format!("--map={ctx}"), "--json", uri])),
        );
        let json: Value = serde_json::from_str(&out).unwrap();
        json.as_array()
            .unwrap()
            .iter()
            .filter(|r| r["type"].as_u64() == Some(1))
            .map(|r| (r["offset"].as_u64().unwrap(), r["length"].as_u64().unwrap()))
            .collect()
    };
    let k = 65536;
    assert_eq!(
        map(&uri, "qemu:dirty-bitmap:b0"),
        [(k, k), (16 * k, k), (64 * k, k)]
    );
    assert_eq!(
        map(&uri, "qemu:dirty-bitmap:fine"),
        [(69632, 8192), (1 << 20, 4096), (4 << 20, 65536)]
    );
    // An unknown bitmap is not offered: the client says so.
    let out = run(Command::new(&nbdinfo).args(["--map=qemu:dirty-bitmap:nope", &uri]));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("qemu:dirty-bitmap:nope"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A bitmap a client reads cannot be removed or cleared until it leaves.
    let mut holder = Command::new(&python)
        .args(["-c", &format!("{PRELUDE}{HOLDER}")])
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env("CAIRN_SOCK", &srv.sock)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(holder.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "holding");
    refused(&["bitmap", "remove", "d", "b0"], "being read");
    refused(&["bitmap", "clear", "d", "b0"], "being read");
    drop(holder.stdin.take());
    assert!(holder.wait().unwrap().success());
    let listed = success("bitmap list", &admin(&["bitmap", "list", "d"]));
    assert!(
        listed.contains("b0: granularity 64KiB, dirty 192KiB"),
        "{listed}"
    );

    // Kept across a restart; a merge of a finer bitmap sets the granules it touches.
    srv.stop();
    let srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    let uri = srv.uri_for("d");
    assert_eq!(
        map(&uri, "qemu:dirty-bitmap:b0"),
        [(k, k), (16 * k, k), (64 * k, k)]
    );
    success(
        "bitmap clear",
        &super::admin::admin(&ctl, &["bitmap", "clear", "d", "b0"]),
    );
    assert_eq!(map(&uri, "qemu:dirty-bitmap:b0"), []);
    success(
        "bitmap merge",
        &super::admin::admin(&ctl, &["bitmap", "merge", "d", "b0", "fine"]),
    );
    assert_eq!(
        map(&uri, "qemu:dirty-bitmap:b0"),
        [(k, k), (16 * k, k), (64 * k, k)]
    );
    success(
        "bitmap remove",
        &super::admin::admin(&ctl, &["bitmap", "remove", "d", "fine"]),
    );
    drop(srv);

    // A store whose two directory copies are damaged refuses the start, writing nothing.
    let mut bytes = std::fs::read(&store).unwrap();
    bytes[20] ^= 1;
    bytes[(256 << 10) + 20] ^= 1;
    std::fs::write(&store, &bytes).unwrap();
    let before = std::fs::read(&data).unwrap();
    let out = run(Command::new(cairn).args(["check", path_str(&stack)]));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no readable directory"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(std::fs::read(&data).unwrap() == before && std::fs::read(&store).unwrap() == bytes);
}

/// Writes at 64 KiB and at 4,160 KiB of a 5 MiB device: granules 1 and 65 of 80 at
/// 64 KiB, the last one in the bitmap's partial last word.
const EDGE_WRITES: &str = r#"
h = connect("d")
h.pwrite(b"x" * 4096, 64 * 1024)
h.pwrite(b"y" * 4096, 4160 * 1024)
h.flush()
h.shutdown()
print("written")
"#;

/// A device whose size is not a whole number of 64 granules keeps the changes at its
/// end across a restart; a page of bits zeroed while it is stopped flags the bitmap
/// inconsistent, all of that page dirty, and says so in the log.
#[test]
fn a_bitmap_keeps_the_changes_at_a_devices_end_and_flags_a_zeroed_page() {
    const NAME: &str =
        "backup::a_bitmap_keeps_the_changes_at_a_devices_end_and_flags_a_zeroed_page";
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let store = dir.path().join("d.bitmaps");
    let stack = write_stack(
        &dir,
        &format!(
            "[device.d]\ntype = \"file\"\npath = \"{}\"\nsize = \"5M\"\nbitmaps = \"{}\"\n\
             [export.d]\ndevice = \"d\"\n",
            dir.path().join("d.img").display(),
            store.display()
        ),
    );
    let start = || Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    let list = || {
        success(
            "bitmap list",
            &super::admin::admin(&ctl, &["bitmap", "list", "d"]),
        )
    };
    let mut srv = start();
    success(
        "bitmap add",
        &super::admin::admin(&ctl, &["bitmap", "add", "d", "b0", "64K"]),
    );
    let env = env_for(dir.path(), &ctl);
    libnbd_script(
        &python,
        &format!("{PRELUDE}{EDGE_WRITES}"),
        &srv.sock,
        &env,
        "written",
    );
    let want = "b0: granularity 64KiB, dirty 128KiB\n";
    assert!(list().contains(want), "{}", list());
    let (status, log) = srv.stop();
    assert!(status.success(), "{status}: {log}");
    let mut srv = start();
    assert!(list().ends_with(want), "after a restart: {}", list());
    let (status, log) = srv.stop();
    assert!(status.success(), "{status}: {log}");

    // Its one page of bits zeroed (the first area starts after the two directory copies).
    let mut bytes = std::fs::read(&store).unwrap();
    bytes[512 << 10..(512 << 10) + 4096].fill(0);
    std::fs::write(&store, &bytes).unwrap();
    let mut srv = start();
    let text = list();
    assert!(
        text.contains("b0: granularity 64KiB, dirty 5MiB, INCONSISTENT"),
        "{text}"
    );
    let (_, log) = srv.stop();
    assert!(
        log.contains(&format!(
            "bitmap store {}: bitmap 'b0': page 0 of its bits fails its check (zeroed)",
            store.display()
        )),
        "{log}"
    );
}

/// Two connections write (paced, up to 64 in flight each) while checkpoints c1, c2 and
/// c3 are taken from another thread; each write goes to a page never written before, so
/// a write counted in the wrong interval is missed by the restore. full(c1) plus the incremental from c2 plus the one from c3 must equal c3.
const UNDER_LOAD: &str = r#"
import threading, time
hs = [connect("vm"), connect("vm")]
size = hs[0].get_size()
rng = random.Random(40)
pages = list(range(size // 4096))
rng.shuffle(pages)
done = threading.Event()
taken = []
failed = []
def retire(err):
    if getattr(err, "value", err):
        failed.append(err)
    return 1
def checkpoints():
    for name in ("c1", "c2", "c3"):
        time.sleep(0.3)
        admin("checkpoint", "pool", "vm", name)
        admin("export", "add", name, "pool", name)
        taken.append(name)
    done.set()
t = threading.Thread(target=checkpoints)
start = time.monotonic()
t.start()
writes = 0
while not done.is_set():
    due = min(len(pages), int((time.monotonic() - start) * 8000))
    for h in hs:
        while h.aio_in_flight() < 64 and writes < due:
            h.aio_pwrite(rng.randbytes(4096), pages[writes] * 4096, completion=retire)
            writes += 1
        h.poll(0)
    time.sleep(0.0005)
for h in hs:
    while h.aio_in_flight() > 0:
        h.poll(-1)
assert not failed, failed[:3]
t.join()
assert taken == ["c1", "c2", "c3"], taken
assert writes < len(pages), "every page written: the test would not see a miss"
full = os.path.join(DIR, "full.img")
full_backup("c1", full)
r2 = os.path.join(DIR, "r2.img")
incremental("c2", "c1", full, r2)
r3 = os.path.join(DIR, "r3.img")
incremental("c3", "c2", r2, r3)
c3 = os.path.join(DIR, "c3.img")
full_backup("c3", c3)
assert same(r3, c3), "full(c1) + c1..c2 + c2..c3 differs from snapshot c3"
print(writes, "writes: restored")
"#;

#[test]
fn checkpoints_under_load_chain_incrementals_exactly() {
    const NAME: &str = "backup::checkpoints_under_load_chain_incrementals_exactly";
    let Some((python, dir, ctl, stack)) = set_up(NAME) else {
        return;
    };
    let srv = Server::start_in(
        tmpdir(),
        &[
            path_str(&stack),
            "--admin",
            path_str(&ctl),
            "--threads",
            "2",
        ],
    );
    let env = env_for(dir.path(), &ctl);
    libnbd_script(
        &python,
        &format!("{PRELUDE}{UNDER_LOAD}"),
        &srv.sock,
        &env,
        "restored",
    );
}

/// A volume made online, served writable by `export add --writable`: written, the
/// server restarted, and read back through the same export (kept by the pool), with a
/// snapshot's read-only export beside it; refusals for a second writer and a writable
/// snapshot; `export remove` forgets an export across the next restart.
const WRITABLE: &str = r#"
h = connect("v2w")
assert not h.is_read_only()
h.pwrite(b"kept" * 1024, 65536)
h.flush()
h.shutdown()
print("written")
"#;

const AFTER_RESTART: &str = r#"
h = connect("v2w")
assert h.pread(4096, 65536) == b"kept" * 1024
h.pwrite(b"more" * 1024, 0)
h.flush()
s = connect("s1")
assert s.is_read_only()
assert s.pread(4096, 65536) == b"kept" * 1024
print("read back")
"#;

#[test]
fn exports_added_while_serving_are_kept_across_a_restart_and_may_write() {
    const NAME: &str =
        "backup::exports_added_while_serving_are_kept_across_a_restart_and_may_write";
    let Some((python, dir, ctl, stack)) = set_up(NAME) else {
        return;
    };
    let start = || Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    let admin = |words: &[&str]| success(&words.join(" "), &super::admin::admin(&ctl, words));
    let refused = |words: &[&str], why: &str| super::admin::refused(&ctl, words, why);
    let env = env_for(dir.path(), &ctl);

    let mut srv = start();
    admin(&["thin", "create", "pool", "v2", "16M"]);
    let added = admin(&["export", "add", "v2w", "pool", "v2", "--writable"]);
    assert!(
        added.contains("serves volume 'v2' of pool 'pool' writable")
            && added.contains("kept in thin pool 'pool' for the next start"),
        "{added}"
    );
    refused(
        &["export", "add", "again", "pool", "v2", "--writable"],
        "export 'v2w' writes volume 'v2' of pool 'pool' already",
    );
    libnbd_script(
        &python,
        &format!("{PRELUDE}{WRITABLE}"),
        &srv.sock,
        &env,
        "written",
    );
    admin(&["thin", "snapshot", "pool", "v2", "s1"]);
    refused(
        &["export", "add", "s1w", "pool", "s1", "--writable"],
        "'s1' is a snapshot: it is served read-only",
    );
    admin(&["export", "add", "s1", "pool", "s1"]);
    admin(&["export", "add", "gone", "pool", "s1"]);
    admin(&["export", "remove", "gone"]);
    srv.stop();

    let mut srv = start();
    let list = admin(&["export", "list"]);
    assert!(
        list.contains("'v2w': volume v2 of thin pool pool (16777216 bytes)\n")
            && list.contains("'s1': volume s1 of thin pool pool (16777216 bytes, read-only)")
            && !list.contains("'gone'"),
        "{list}"
    );
    libnbd_script(
        &python,
        &format!("{PRELUDE}{AFTER_RESTART}"),
        &srv.sock,
        &env,
        "read back",
    );
    // A volume served keeps its delete refused; once its export goes, it may go.
    refused(&["thin", "delete", "pool", "s1"], "is open");
    admin(&["export", "remove", "s1"]);
    srv.stop();
    let srv = start();
    let list = admin(&["export", "list"]);
    assert!(list.contains("'v2w'") && !list.contains("'s1'"), "{list}");
    admin(&["thin", "delete", "pool", "s1"]);
    drop(srv);
}

/// `thin grow` of a volume the stack file sizes: the next connection and `export list`
/// see the new size, the stack file's `size` follows (so the next start takes it), and a
/// stack file left smaller is refused at the start with the line to write.
#[test]
fn a_grown_volume_is_seen_by_the_next_connection_and_the_stack_file_follows() {
    const NAME: &str =
        "backup::a_grown_volume_is_seen_by_the_next_connection_and_the_stack_file_follows";
    let Some((_python, _dir, ctl, stack)) = set_up(NAME) else {
        return;
    };
    let Some([nbdinfo]) = tools(NAME, ["nbdinfo"]) else {
        return;
    };
    let before = std::fs::read_to_string(&stack).unwrap();
    let start = || Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    let admin = |words: &[&str]| success(&words.join(" "), &super::admin::admin(&ctl, words));
    let size_of = |srv: &Server| {
        let out = success(
            "nbdinfo --size",
            &run(Command::new(&nbdinfo).args(["--size", &srv.uri_for("vm")])),
        );
        out.trim().parse::<u64>().unwrap()
    };
    let mut srv = start();
    assert_eq!(size_of(&srv), 64 << 20);
    // Past four times the size it was opened with, too.
    let grown = admin(&["thin", "grow", "pool", "vm", "320M"]);
    assert!(
        grown.contains("updated: [device.vm] size = \"320M\" (grown)"),
        "{grown}"
    );
    assert_eq!(size_of(&srv), 320 << 20);
    let list = admin(&["export", "list"]);
    assert!(
        list.contains(&format!("({} bytes)", 320u64 << 20)),
        "{list}"
    );
    srv.stop();
    let after = std::fs::read_to_string(&stack).unwrap();
    assert_eq!(
        after,
        before
            .replace("size = \"64M\"\n\n[export", "size = \"320M\"\n\n[export")
            .replace("size = \"64M\"\n[export", "size = \"320M\"\n[export"),
        "{after}"
    );
    let srv = start();
    assert_eq!(size_of(&srv), 320 << 20);
    drop(srv);
    // The stack file put back as it was: refused, saying what to write.
    std::fs::write(&stack, &before).unwrap();
    let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args(["check", path_str(&stack)]));
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("set size = \"320M\" in its table, or leave the key out"),
        "{text}"
    );
}

/// Writes to vm between checkpoints c1 and c2, both taken while serving; the server
/// stops, and the stack file gains a table and an export for snapshot c2: started
/// again, that export offers the changes since c1 (with no bitmap store anywhere), and
/// they are the blocks written.
const BETWEEN: &str = r#"
h = connect("vm")
h.pwrite(b"a" * 4096, 0)
h.flush()
admin("checkpoint", "pool", "vm", "c1")
h.pwrite(b"b" * 4096, 5 * G + 100)
h.pwrite(b"c" * 8192, 9 * G - 4096)
h.flush()
admin("checkpoint", "pool", "vm", "c2")
h.pwrite(b"d" * 4096, 20 * G)
h.flush()
print("written")
"#;

#[test]
fn a_checkpoints_snapshot_exported_from_the_stack_file_offers_the_changes_before_it() {
    const NAME: &str =
        "backup::a_checkpoints_snapshot_exported_from_the_stack_file_offers_the_changes_before_it";
    let Some((python, dir, ctl, stack)) = set_up(NAME) else {
        return;
    };
    let Some([nbdinfo]) = tools(NAME, ["nbdinfo"]) else {
        return;
    };
    let mut srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    let env = env_for(dir.path(), &ctl);
    libnbd_script(
        &python,
        &format!("{PRELUDE}{BETWEEN}"),
        &srv.sock,
        &env,
        "written",
    );
    srv.stop();
    let mut text = std::fs::read_to_string(&stack).unwrap();
    text += "[device.c2]\ntype = \"thin\"\npool = \"pool\"\n[export.c2]\ndevice = \"c2\"\n";
    std::fs::write(&stack, text).unwrap();
    let srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    let map = |export: &str, ctx: &str| -> Vec<(u64, u64)> {
        let out = success(
            "nbdinfo --map",
            &run(Command::new(&nbdinfo).args([
                &format!("--map=qemu:dirty-bitmap:{ctx}"),
                "--json",
                &srv.uri_for(export),
            ])),
        );
        let json: Value = serde_json::from_str(&out).unwrap();
        json.as_array()
            .unwrap()
            .iter()
            .filter(|r| r["type"].as_u64() == Some(1))
            .map(|r| (r["offset"].as_u64().unwrap(), r["length"].as_u64().unwrap()))
            .collect()
    };
    const G: u64 = 65536;
    // On c2: blocks 5, 8 and 9 changed from c1 (the write after c2 is not in it).
    assert_eq!(map("c2", "c1"), vec![(5 * G, G), (8 * G, 2 * G)]);
    // On the volume: the same and block 20 since c1; block 20 alone since c2.
    assert_eq!(
        map("vm", "c1"),
        vec![(5 * G, G), (8 * G, 2 * G), (20 * G, G)]
    );
    assert_eq!(map("vm", "c2"), vec![(20 * G, G)]);
    drop(srv);
}

/// The README's backup steps, up to the Python fragment: writes, checkpoint c1 and its
/// full backup by `cairn backup` into vm1.img, more writes, checkpoint c2 exported; then
/// (the fragment, run next) c2.img; and the reference: c2 whole.
const README_STEPS: &str = r#"
rng = random.Random(53)
h = connect("vm")
size = h.get_size()
for i in range(64):
    h.pwrite(rng.randbytes(4096), rng.randrange(size // 4096) * 4096)
h.flush()
admin("checkpoint", "pool", "vm", "c1")
admin("export", "add", "c1", "pool", "c1")
def backup(*args):
    out = subprocess.run([os.environ["CAIRN_BIN"], "backup", *args], cwd=DIR,
                         capture_output=True, text=True)
    assert out.returncode == 0, out
backup("nbd+unix:///c1?socket=" + SOCK, "vm1.img")
for i in range(32):
    h.pwrite(rng.randbytes(4096), rng.randrange(size // 4096) * 4096)
h.flush()
admin("checkpoint", "pool", "vm", "c2")
admin("export", "add", "c2", "pool", "c2")
backup("nbd+unix:///c2?socket=" + SOCK, "c2-whole.img")
print("ready")
"#;

/// The Python fragment the README prints for reading the changes since c1 runs as
/// printed (its socket path aside): the copy it makes equals snapshot c2, and stays
/// sparse (the README once copied the full backup byte for byte, holes included).
#[test]
fn the_readmes_backup_fragment_restores_c2_sparsely() {
    const NAME: &str = "backup::the_readmes_backup_fragment_restores_c2_sparsely";
    let Some((python, dir, ctl, stack)) = set_up(NAME) else {
        return;
    };
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"))
        .expect("read the README");
    let at = readme
        .find("this Python libnbd fragment")
        .expect("the README's backup fragment");
    let start = at + readme[at..].find("```python\n").expect("its code") + "```python\n".len();
    let end = start + readme[start..].find("```").expect("its end");
    let fragment: String = readme[start..end]
        .lines()
        .map(|l| l.strip_prefix("   ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(fragment.contains("/run/cairn.sock"), "{fragment}");
    let srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    let env = env_for(dir.path(), &ctl);
    libnbd_script(
        &python,
        &format!("{PRELUDE}{README_STEPS}"),
        &srv.sock,
        &env,
        "ready",
    );
    let fragment = fragment.replace("/run/cairn.sock", path_str(&srv.sock));
    let out = run(Command::new(&python)
        .args(["-c", &fragment])
        .current_dir(dir.path()));
    success("the README's Python fragment", &out);
    let c2 = std::fs::read(dir.path().join("c2.img")).expect("the fragment's c2.img");
    let whole = std::fs::read(dir.path().join("c2-whole.img")).expect("c2 whole");
    assert!(
        c2 == whole,
        "the fragment's c2.img differs from snapshot c2"
    );
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir.path().join("c2.img")).unwrap();
    assert!(
        meta.blocks() * 512 < meta.len() / 4,
        "c2.img is not sparse: {} of {} bytes allocated",
        meta.blocks() * 512,
        meta.len()
    );
}
