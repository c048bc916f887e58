//! Thin pools served: snapshots taken while a client writes, then `kill -9` with writes in
//! flight; after a restart every flushed write and every snapshot reads back, and
//! `cairn check` finds the pool clean.

use super::*;

/// Writes and snapshots, then the kill. Pages carry `(page << 32) | tag` in every 8
/// bytes (tag 0: zeros). Phase 1 fills the first half with tag 1 and flushes; snapshot
/// s1; phase 2 writes 2000 random pages with tag 2 and flushes; snapshot s2; 500 more
/// with tag 2 and a flush (durable by that flush's commit alone); phase 3
/// writes random pages (of the first three quarters: the last stays unwritten), each with
/// a tag of its own, 64 in flight, and once 1500 are done
/// kills the server. What every page may read afterwards goes to CAIRN_EXPECT (JSON).
const WRITER: &str = r#"
import json
import os
import random
import signal
import struct
import subprocess
import time
import nbd

PAGE = 4096
h = nbd.NBD()
h.connect_unix(os.environ["CAIRN_SOCK"])
pages = h.get_size() // PAGE
rng = random.Random(37)

def content(p, tag):
    return struct.pack("<Q", (p << 32) | tag) * (PAGE // 8) if tag else bytes(PAGE)

def write_all(items, depth=32):
    pending = []
    for p, tag in items:
        while len(pending) >= depth:
            h.poll(-1)
            pending = [c for c in pending if not h.aio_command_completed(c)]
        pending.append(h.aio_pwrite(content(p, tag), p * PAGE))
    while pending:
        h.poll(-1)
        pending = [c for c in pending if not h.aio_command_completed(c)]

def snapshot(name):
    out = subprocess.run([os.environ["CAIRN_BIN"], "admin", os.environ["CAIRN_ADMIN"],
                          "thin", "snapshot", "pool", "vm", name],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "taken" in out.stdout, out
    return out.stdout

now = [0] * pages
write_all([(p, 1) for p in range(pages // 2)])
h.flush()
for p in range(pages // 2):
    now[p] = 1
s1 = list(now)
snapshot("s1")
batch = [(rng.randrange(pages * 3 // 4), 2) for _ in range(2000)]
write_all(batch)
h.flush()
for p, t in batch:
    now[p] = t
s2 = list(now)
snapshot("s2")
# Right after the snapshot's commit: writes made durable by a flush alone (no other
# commit comes before the kill, unless the pool's 1 s timer fires).
batch = [(rng.randrange(pages * 3 // 4), 2) for _ in range(500)]
write_all(batch)
h.flush()
for p, t in batch:
    now[p] = t
# Phase 3: each write a tag of its own; the kill comes with 64 in flight.
allowed = [[t] for t in now]
pid = int(os.environ["CAIRN_SERVER_PID"])
pending = []
done = 0
tag = 3
while done < 1500:
    while len(pending) < 64:
        p = rng.randrange(pages * 3 // 4)
        allowed[p].append(tag)
        pending.append(h.aio_pwrite(content(p, tag), p * PAGE))
        tag += 1
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
time.sleep(0.002)
os.kill(pid, signal.SIGKILL)
json.dump({"s1": s1, "s2": s2, "vm": allowed}, open(os.environ["CAIRN_EXPECT"], "w"))
print(f"SIGKILL after {done} unflushed writes: killed")
"#;

/// Reads every page of exports vm, s1 and s2 and compares with CAIRN_EXPECT: the
/// snapshots exactly, vm a value each page was allowed. Then writes a page into blocks
/// of vm never written, and reads the rest of each block: zeros.
const CHECKER: &str = r#"
import json
import os
import struct
import nbd

PAGE = 4096
expect = json.load(open(os.environ["CAIRN_EXPECT"]))
bad = []
for name in ("s1", "s2", "vm"):
    h = nbd.NBD()
    h.set_export_name(name)
    h.connect_unix(os.environ["CAIRN_SOCK"])
    want = expect[name]
    assert h.get_size() // PAGE == len(want), (name, h.get_size())
    if name != "vm":
        assert h.is_read_only(), name
    for p in range(len(want)):
        b = h.pread(PAGE, p * PAGE)
        if b == bytes(PAGE):
            tag = 0
        else:
            v = struct.unpack_from("<Q", b)[0]
            tag = v & 0xffffffff if b == struct.pack("<Q", v) * (PAGE // 8) and v >> 32 == p else -1
        ok = tag in want[p] if name == "vm" else tag == want[p]
        if not ok:
            bad.append((name, p, tag, want[p] if name != "vm" else want[p][:4]))
    h.shutdown()
print(len(bad), "pages wrong", bad[:5])
assert not bad
# Blocks never written read as zeros even once a write lands in them: space the killed
# server took for writes it never committed was zeroed before reuse.
h = nbd.NBD()
h.set_export_name("vm")
h.connect_unix(os.environ["CAIRN_SOCK"])
vm = expect["vm"]
holes = [b for b in range(len(vm) // 16) if all(vm[b * 16 + i] == [0] for i in range(16))]
assert len(holes) >= 8, len(holes)
stale = 0
for b in holes[:64]:
    h.pwrite(struct.pack("<Q", (b * 16 << 32) | 99) * (PAGE // 8), b * 16 * PAGE)
    rest = h.pread(15 * PAGE, (b * 16 + 1) * PAGE)
    stale += rest != bytes(15 * PAGE)
print(stale, "new blocks held stale data")
assert stale == 0
print("checked")
"#;

fn stack_text(data: &Path, snapshots: bool) -> String {
    let mut s = format!(
        "[device.d]\ntype = \"file\"\npath = \"{}\"\nsize = \"128M\"\nsparse = true\n\
         [device.pool]\ntype = \"thin-pool\"\ndata = \"d\"\n\
         [device.vm]\ntype = \"thin\"\npool = \"pool\"\nsize = \"32M\"\n\
         [export.vm]\ndevice = \"vm\"\n",
        data.display()
    );
    if snapshots {
        for n in ["s1", "s2"] {
            s += &format!(
                "[device.{n}]\ntype = \"thin\"\npool = \"pool\"\n[export.{n}]\ndevice = \"{n}\"\n"
            );
        }
    }
    s
}

#[test]
fn kill_9_after_snapshots_with_writes_in_flight_keeps_every_flushed_write_and_snapshot() {
    const NAME: &str =
        "thin::kill_9_after_snapshots_with_writes_in_flight_keeps_every_flushed_write_and_snapshot";
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    let dir = tmpdir();
    let data = dir.path().join("pool.img");
    let expect = dir.path().join("expect.json");
    let ctl = dir.path().join("admin.sock");
    let stack = write_stack(&dir, &stack_text(&data, false));
    let mut srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    let pid = srv.child.as_ref().expect("running").id();
    libnbd_script(
        &python,
        WRITER,
        &srv.sock,
        &[
            ("CAIRN_SERVER_PID", pid.to_string()),
            ("CAIRN_BIN", env!("CARGO_BIN_EXE_cairn").to_string()),
            ("CAIRN_ADMIN", path_str(&ctl).to_string()),
            ("CAIRN_EXPECT", path_str(&expect).to_string()),
        ],
        "killed",
    );
    let (status, log) = srv.wait_exit();
    assert!(!status.success(), "killed, yet {status}:\n{log}");

    // The pool as the kill left it: replayed and checked, nothing written.
    let before = std::fs::read(&data).unwrap();
    let stack = write_stack(&dir, &stack_text(&data, true));
    let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args(["check", path_str(&stack)]));
    let text = success("cairn check", &out);
    assert!(text.contains("check: clean"), "{text}");
    assert!(text.contains("volume 's2'"), "{text}");
    assert!(
        std::fs::read(&data).unwrap() == before,
        "cairn check wrote to the pool"
    );

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
    libnbd_script(
        &python,
        CHECKER,
        &srv.sock,
        &[("CAIRN_EXPECT", path_str(&expect).to_string())],
        "checked",
    );
    let out = super::admin::admin(&ctl, &["thin", "list", "pool"]);
    let text = success("thin list", &out);
    for v in ["vm:", "s1:", "s2:"] {
        assert!(text.contains(v), "{text}");
    }
    // Status and the metrics show the pool and what each volume maps.
    let status = super::observe::json(
        "status --json",
        &super::admin::admin(&ctl, &["status", "--json"]),
    );
    let pool = &status["thin_pools"][0];
    assert_eq!(pool["name"], "pool", "{status:#}");
    let s1 = pool["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "s1")
        .expect("s1 in status");
    assert_eq!(s1["mapped_bytes"], 16 << 20, "{status:#}");
    assert_eq!(s1["read_only"], true);
    let metrics = super::observe::scrape(&python, &super::observe::metrics_url(&srv));
    assert!(
        metrics.contains("cairn_thin_volume_mapped_bytes{pool=\"pool\",volume=\"s1\"} 16777216"),
        "{metrics}"
    );
    assert!(
        metrics.contains("cairn_thin_pool_data_bytes{pool=\"pool\",state=\"used\"}"),
        "{metrics}"
    );
    // A served snapshot cannot go; one that is not served can.
    let out = super::admin::admin(&ctl, &["thin", "delete", "pool", "s1"]);
    assert!(!out.status.success(), "deleted a served snapshot");
    assert!(text_of(&out).contains("is open"), "{}", text_of(&out));
}

fn text_of(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Writes 600 pages, a flush every 50, and kills the server with the last 20 unflushed.
const FLUSHING_WRITER: &str = r#"
import os
import signal
import struct
import nbd

PAGE = 4096
h = nbd.NBD()
h.connect_unix(os.environ["CAIRN_SOCK"])
for i in range(620):
    p = (i * 37) % (h.get_size() // PAGE)
    h.pwrite(struct.pack("<Q", (p << 32) | (i + 1)) * (PAGE // 8), p * PAGE)
    if i % 50 == 49:
        h.flush()
os.kill(int(os.environ["CAIRN_SERVER_PID"]), signal.SIGKILL)
print("killed")
"#;

/// One byte flipped in the first log block after a crash (flushed commits after it):
/// `cairn check` and `cairn serve` refuse in one line, exit 2, the pool file unchanged
/// (before, check said clean and serve zeroed every flushed write's block as free);
/// `cairn check --repair-thin` accepts the loss on the operator's word, and the pool
/// then checks clean and serves.
#[test]
fn a_damaged_log_block_is_refused_until_the_operator_repairs() {
    const NAME: &str = "thin::a_damaged_log_block_is_refused_until_the_operator_repairs";
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    let dir = tmpdir();
    let data = dir.path().join("pool.img");
    let stack = write_stack(&dir, &stack_text(&data, false));
    let mut srv = Server::start_in(tmpdir(), &[path_str(&stack)]);
    let pid = srv.child.as_ref().expect("running").id();
    libnbd_script(
        &python,
        FLUSHING_WRITER,
        &srv.sock,
        &[("CAIRN_SERVER_PID", pid.to_string())],
        "killed",
    );
    let _ = srv.wait_exit();

    // The first block of the log the newest superblock points at.
    use cairn_services::thin::superblock as sbk;
    let mut bytes = std::fs::read(&data).unwrap();
    let sb = sbk::pick(&bytes[..2 * sbk::SLOT_BYTES]).newest().unwrap();
    let pages = sb.log_bytes / 4096;
    let first = (sb.log_offset + (sb.log_start_seq % pages) * 4096) as usize;
    bytes[first + 2000] ^= 0x04;
    std::fs::write(&data, &bytes).unwrap();

    let cairn = env!("CARGO_BIN_EXE_cairn");
    for words in [
        vec!["check", "--log-level", "error", path_str(&stack)],
        vec![
            "serve",
            "--log-level",
            "error",
            "--listen",
            "tcp:127.0.0.1:0",
            path_str(&stack),
        ],
    ] {
        let out = run(Command::new(cairn).args(&words));
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{words:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{words:?}: one line: {err}");
        assert!(
            err.contains("damaged") && err.contains("--repair-thin"),
            "{err}"
        );
        assert!(
            std::fs::read(&data).unwrap() == bytes,
            "{words:?} wrote to the pool"
        );
    }
    let out = run(Command::new(cairn).args(["check", "--repair-thin", "pool", path_str(&stack)]));
    let said = success("cairn check --repair-thin", &out);
    assert!(
        said.contains("repaired") && said.contains("check: clean"),
        "{said}"
    );
    let out = run(Command::new(cairn).args(["check", path_str(&stack)]));
    let said = success("cairn check after the repair", &out);
    assert!(said.contains("check: clean"), "{said}");
    // Refused for what is not a thin pool.
    let out = run(Command::new(cairn).args(["check", "--repair-thin", "d", path_str(&stack)]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("not a thin pool"));
}
