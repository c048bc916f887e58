#!/usr/bin/env python3
"""Incremental backup: what an incremental backup reads and how long it takes,
against qemu-storage-daemon; what a bitmap costs the writes it counts.

  bench/backup.py [--rounds N] [--parts flow,cost] [--size SIZE] [--changed PERCENT]
                  [--runtime SECS] [--depth N] [--quick]

Everything lives in a fresh directory under /dev/shm, removed at the end (also on Ctrl-C
or SIGTERM) with every process the script started. The script runs target/release/cairn
(or CAIRN_BIN) and never builds it.

Parts (--parts, default both):
  flow   A --size (4 GiB) volume on each server, filled (fio rw=write bs=1M iodepth 8),
         then checkpoint c1 and a full backup of it, then --changed (1%) of the volume
         rewritten at random, then checkpoint c2 and an incremental backup of it:
           cairn  cairn serve: a thin pool (64K blocks) on a sparse file, volume vm (its
                  checkpoints kept by the pool); `cairn admin SOCK checkpoint pool vm cN`
                  and `export add cN pool cN` (the snapshot, read-only, offering the
                  changes since c(N-1))
           qsd    qemu-storage-daemon: a qcow2 (cluster_size=64k, aio=io_uring, one
                  iothread); c1: block-dirty-bitmap-add persistent; the point in time
                  the way libvirt's pull-mode backup makes it: a scratch qcow2 backed by
                  the disk (blockdev-add), then one QMP transaction (bitmap c2 added,
                  c1 disabled, blockdev-backup sync=none into the scratch), then
                  block-export-add of the scratch with bitmaps=[c1]
         The full backup: nbdcopy of the point-in-time export to a file in /dev/shm
         (timed). The incremental backup, the same client for both servers: Python
         libnbd asks block status of qemu:dirty-bitmap:c1 over the whole export, reads
         each dirty extent (up to 32 MiB a read) and writes it at its offset into a copy
         of the full backup (the copy is made before the clock starts); timed from
         connect to the last write; its bytes read are counted. It runs twice: one
         read at a time (as a simple client does), then with 16 reads in flight
         (aio_pread, into another copy). Then the same reads by clients in C, so that the
         client is not what is measured: nbdinfo --map=qemu:dirty-bitmap:c1 lists the
         dirty extents, then one qemu-io reads them (read, one at a time; aio_read, all
         at once), nothing written. Then `cairn backup URI --since c1` (the client of
         this repository, one connection, --depth reads in flight, default 16) into a
         copy of the full backup, before the others: its own seconds (connect to the
         fsync of the copy, from its --json) and the process's wall clock; the copy is
         compared with the Python client's restore. The rewrite: the volume
         in 64 KiB granules (the bitmaps' granularity), a random --changed of them, each
         rewritten whole with one 64 KiB write (libnbd, 32 in flight), then a flush.
         (Random 4 KiB writes over 1% of the bytes would dirty about 16% of 64 KiB
         granules; that case is the bitmap's granularity, not the backup's cost.) The
         restore (full + incremental) is compared with a full copy of c2 (not timed).
         Before the first round, 3 x --size is written to /dev/shm and removed (memory
         the VM touches the first time is slow).
         Targets: the incremental reads <= 1.5% of the volume and takes <= 0.05x the
         full backup; cairn's incremental <= 0.5x qsd's.
  cost   cairn bench in process, 4 KiB randwrite, iodepth 32, --runtime (5 s), over a
         --size region of (a) a file device in /dev/shm, (b) a thin volume on a pool on
         such a file (filled first): without a bitmap store, with one enabled bitmap
         whose bits are all set already (steady state: every write only tests its bit),
         and with one cleared before each run (fresh: the run's first write to each
         64 KiB granule writes the bit's page and syncs the store first). The bitmap is
         added (and cleared) by a cairn serve with an admin socket, stopped before the
         run. Target: with a bitmap >= 0.97x without.

Interleaved rounds (odd rounds reversed); medians with the spread of per-round ratios.
JSON of every run in bench/out/backup-*.json; tables (Markdown) on stdout, progress on
stderr. The script reports what it measured; it asserts nothing. --quick: 512 MiB, 2 s.
"""
import argparse
import json
import os
import random
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import thin  # noqa: E402
from thin import Failed, Cairn, Qsd, run, fresh, size_str, mib, out, spread, good, med  # noqa: E402
from engine import CAIRN, OUT, ROOT  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
G = 64 << 10
PARTS = ["flow", "cost"]

REWRITE = r'''
import json, os, random, sys
import nbd
a = json.loads(sys.argv[1])
h = nbd.NBD()
h.connect_uri(a["uri"])
granules = h.get_size() // a["g"]
rng = random.Random(a["seed"])
chosen = rng.sample(range(granules), a["count"])
buf = nbd.Buffer.from_bytearray(bytearray(os.urandom(a["g"])))
for g in chosen:
    while h.aio_in_flight() >= 32:
        h.poll(-1)
    h.aio_pwrite(buf, g * a["g"])
while h.aio_in_flight() > 0:
    h.poll(-1)
h.flush()
h.shutdown()
print(json.dumps({"granules": len(chosen)}))
'''

INCREMENTAL = r'''
import json, sys, time
import nbd
a = json.loads(sys.argv[1])
ctx = "qemu:dirty-bitmap:" + a["bitmap"]
t0 = time.monotonic()
h = nbd.NBD()
h.add_meta_context(ctx)
h.connect_uri(a["uri"])
assert h.can_meta_context(ctx), ctx
size, off, extents = h.get_size(), 0, []
while off < size:
    got = []
    def cb(meta, start, entries, err):
        if meta == ctx:
            got.extend(entries)
        return 0
    h.block_status(min(size - off, 1 << 30), off, cb)
    for i in range(0, len(got), 2):
        n = min(got[i], size - off)
        if got[i + 1] & 1:
            extents.append((off, n))
        off += n
t_map = time.monotonic() - t0
pieces = [(at, min(32 << 20, start + n - at)) for start, n in extents
          for at in range(start, start + n, 32 << 20)]
read = 0
with open(a["target"], "r+b") as f:
    if a["depth"] == 1:
        for at, m in pieces:
            data = h.pread(m, at)
            f.seek(at)
            f.write(data)
            read += m
    else:
        done = []
        def landed(buf, at):
            def cb(err):
                f.seek(at)
                f.write(buf.to_bytearray())
                done.append(len(buf))
                return 1
            return cb
        for at, m in pieces:
            while h.aio_in_flight() >= a["depth"]:
                h.poll(-1)
            buf = nbd.Buffer(m)
            h.aio_pread(buf, at, completion=landed(buf, at))
        while h.aio_in_flight() > 0:
            h.poll(-1)
        read = sum(done)
h.shutdown()
print(json.dumps({"seconds": time.monotonic() - t0, "map_s": t_map, "bytes_read": read,
                  "extents": len(extents)}))
'''


def cpu_ns(pid):
    """CPU time of every thread of process `pid` so far (ns; /proc/PID/task/*/schedstat),
    fine enough for runs of a few milliseconds (the tick counts of /proc/PID/stat are
    10 ms)."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            pass
    return total


def c_incremental(sock, export, bitmap, aio):
    """The incremental backup's reads by clients written in C: nbdinfo lists the dirty
    extents (qemu:dirty-bitmap:BITMAP), then one qemu-io process reads them all through
    qemu's NBD client, one at a time (`read`: the reads' own times, as qemu-io prints
    them, added up) or all at once (`aio_read`, then `aio_flush`: the process's wall
    clock less that of the same process reading one 4 KiB block, i.e. its start and
    connection); nothing is written. Returns the reads' seconds, the map's (nbdinfo's
    wall clock, its start included), bytes read, extents."""
    t0 = time.monotonic()
    o, _ = run(["nbdinfo", f"--map=qemu:dirty-bitmap:{bitmap}", "--json",
                f"nbd+unix:///{export}?socket={sock}"], 120, "nbdinfo --map", load=True)
    extents = [(e["offset"], e["length"]) for e in json.loads(o) if e["type"] & 1]
    t_map = time.monotonic() - t0
    cmds = []
    for start, n in extents:
        for at in range(start, start + n, 32 << 20):
            m = min(32 << 20, start + n - at)
            cmds += ["-c", f"{'aio_read -q' if aio else 'read'} {at} {m}"]
    if aio:
        cmds += ["-c", "aio_flush"]
    opts = f"driver=nbd,server.type=unix,server.path={sock},export={export}"
    qemu_io = ["qemu-io", "--image-opts", opts, "-r"]
    if aio:
        t0 = time.monotonic()
        run(qemu_io + ["-c", "read 0 4096"], 120, "qemu-io start", load=True)
        start = time.monotonic() - t0
        t0 = time.monotonic()
        run(qemu_io + cmds, 600, "qemu-io reads", load=True)
        reads = max(0.0, time.monotonic() - t0 - start)
    else:
        o, _ = run(qemu_io + cmds, 600, "qemu-io reads", load=True)
        # "64 KiB, 1 ops; 00.00 sec (414.806 MiB/sec and 6636.8892 ops/sec)" per read:
        # its time is its ops over its rate (the seconds are printed to 10 ms only).
        reads = sum(int(m.group(1)) / float(m.group(2))
                    for m in re.finditer(r"(\d+) ops; [^(]*\([^)]* and ([\d.]+) ops/sec\)", o))
    return {"seconds": reads, "map_s": t_map,
            "bytes_read": sum(n for _, n in extents), "extents": len(extents)}


def cairn_backup(uri, bitmap, target, depth):
    """`cairn backup URI TARGET --since BITMAP --json` into `target` (a copy of the full
    backup): its summary, with the process's wall clock as wall_s and its CPU time
    (user and system, from the rusage of children reaped meanwhile) as cpu_s."""
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    o, _ = run([CAIRN, "backup", uri, target, "--since", bitmap, "--json",
                "--depth", str(depth)], 600, "cairn backup --since", load=True)
    j = json.loads(o)
    j["wall_s"] = time.monotonic() - t0
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    j["cpu_s"] = (ru.ru_utime - ru0.ru_utime) + (ru.ru_stime - ru0.ru_stime)
    return j


def script(name, text):
    path = os.path.join(thin.WORK["dir"], name)
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(text)
    return path


def py(name, text, args, timeout, what):
    o, _ = run([thin.nbd_python(), script(name, text), json.dumps(args)], timeout, what, load=True)
    return json.loads(o)


def save(name, j):
    with open(os.path.join(OUT, f"backup-{name}.json"), "w") as f:
        json.dump(j, f, indent=1, default=str)


def same_files(a, b):
    with open(a, "rb") as x, open(b, "rb") as y:
        while True:
            p, q = x.read(1 << 24), y.read(1 << 24)
            if p != q:
                return False
            if not p:
                return True


def nbdcopy(uri, path, what):
    t0 = time.monotonic()
    run(["nbdcopy", uri, path], 600, what, load=True)
    return time.monotonic() - t0


# ---------------------------------------------------------------- part: flow

def cairn_server(d, size):
    text = (f'[device.d]\ntype = "file"\npath = "{d}/data"\nsize = "{size_str(2 * size)}"\n'
            'sparse = true\n[device.pool]\ntype = "thin-pool"\ndata = "d"\n'
            f'[device.vm]\ntype = "thin"\npool = "pool"\nsize = "{size_str(size)}"\n'
            '[export.vm]\ndevice = "vm"\n')
    path = os.path.join(d, "stack.toml")
    with open(path, "w") as f:
        f.write(text)
    return Cairn(d, path)


class QsdBackup(Qsd):
    """qemu-storage-daemon with the pull-mode backup steps over QMP."""

    def qmp_all(self, cmds, timeout=120):
        t0 = time.monotonic()
        for c in cmds:
            self.qmp(c["execute"], c.get("arguments"), timeout)
        return time.monotonic() - t0

    def checkpoint(self, name, previous):
        """The point in time `name` exported as `name` (with bitmap `previous`)."""
        scratch = os.path.join(self.dir, f"{name}.scratch.qcow2")
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", self.img,
             scratch, size_str(self.size)], 60, "qemu-img create scratch")
        actions = [{"type": "block-dirty-bitmap-add",
                    "data": {"node": "q0", "name": name, "persistent": True}}]
        if previous:
            actions.append({"type": "block-dirty-bitmap-disable",
                            "data": {"node": "q0", "name": previous}})
        actions.append({"type": "blockdev-backup",
                        "data": {"device": "q0", "target": f"fl-{name}", "sync": "none",
                                 "job-id": f"job-{name}"}})
        export = {"type": "nbd", "id": f"e-{name}", "node-name": f"fl-{name}", "name": name}
        if previous:
            export["bitmaps"] = [previous]
        return self.qmp_all([
            {"execute": "blockdev-add", "arguments": {
                "driver": "qcow2", "node-name": f"fl-{name}", "backing": "q0",
                "file": {"driver": "file", "filename": scratch}}},
            {"execute": "transaction", "arguments": {"actions": actions}},
            {"execute": "block-export-add", "arguments": export},
        ])


def flow_run(a, kind):
    d = fresh(f"flow-{kind}")
    size = a.size
    rec = {"server": kind, "size": size}
    srv = cairn_server(d, size) if kind == "cairn" else QsdBackup(d, size)
    uri = lambda name: f"nbd+unix:///{name}?socket={srv.sock}"  # noqa: E731
    try:
        srv.start()
        rec["fill_s"] = thin.fio_fill(srv.uri, size, f"{kind}: fill")
        if kind == "cairn":
            t0 = time.monotonic()
            srv.admin("checkpoint", "pool", "vm", "c1")
            srv.admin("export", "add", "c1", "pool", "c1")
            rec["checkpoint1_s"] = time.monotonic() - t0
        else:
            rec["checkpoint1_s"] = srv.checkpoint("c1", None)
        full = os.path.join(d, "full.img")
        rec["full_s"] = nbdcopy(uri("c1"), full, f"{kind}: full backup")
        count = max(1, int(size // G * a.changed / 100))
        t0 = time.monotonic()
        py("rewrite.py", REWRITE, {"uri": srv.uri, "g": G, "seed": 38, "count": count},
           600, f"{kind}: rewrite")
        rec["rewrite_s"] = time.monotonic() - t0
        rec["granules_rewritten"] = count
        if kind == "cairn":
            t0 = time.monotonic()
            srv.admin("checkpoint", "pool", "vm", "c2")
            srv.admin("export", "add", "c2", "pool", "c2")
            rec["checkpoint2_s"] = time.monotonic() - t0
        else:
            rec["checkpoint2_s"] = srv.checkpoint("c2", "c1")
        restored = os.path.join(d, "restored.img")
        shutil.copyfile(full, restored)
        # cairn backup first, into the full backup itself (compared with the Python
        # client's restore below, then removed: /dev/shm holds a few copies at most).
        mine = os.path.join(d, "mine.img")
        os.rename(full, mine)
        cpu0 = cpu_ns(srv.proc.pid)
        inc = cairn_backup(uri("c2"), "c1", mine, a.depth)
        rec["incb_server_cpu_s"] = (cpu_ns(srv.proc.pid) - cpu0) / 1e9
        rec.update({f"incb_{k}": v for k, v in inc.items()})
        cpu0 = cpu_ns(srv.proc.pid)
        inc = py("incremental.py", INCREMENTAL,
                 {"uri": uri("c2"), "bitmap": "c1", "target": restored, "depth": 1}, 600,
                 f"{kind}: incremental backup")
        rec["inc_server_cpu_s"] = (cpu_ns(srv.proc.pid) - cpu0) / 1e9
        rec.update({f"inc_{k}": v for k, v in inc.items()})
        rec["incb_matches"] = same_files(mine, restored)
        os.remove(mine)
        # Again with 16 reads in flight (into another copy of the full backup).
        pipelined = os.path.join(d, "pipelined.img")
        shutil.copyfile(restored, pipelined)
        inc = py("incremental.py", INCREMENTAL,
                 {"uri": uri("c2"), "bitmap": "c1", "target": pipelined, "depth": 16}, 600,
                 f"{kind}: incremental backup, 16 in flight")
        rec.update({f"inc16_{k}": v for k, v in inc.items()})
        os.remove(pipelined)
        # The same reads by clients in C, one at a time and all at once.
        for key, aio in (("incc", False), ("inccaio", True)):
            cpu0 = cpu_ns(srv.proc.pid)
            inc = c_incremental(srv.sock, "c2", "c1", aio)
            rec[f"{key}_server_cpu_s"] = (cpu_ns(srv.proc.pid) - cpu0) / 1e9
            rec.update({f"{key}_{k}": v for k, v in inc.items()})
        c2 = os.path.join(d, "c2.img")
        rec["full2_s"] = nbdcopy(uri("c2"), c2, f"{kind}: full copy of c2")
        rec["restore_matches"] = same_files(restored, c2)
    finally:
        rec["exit_status"] = srv.stop()
        shutil.rmtree(d, ignore_errors=True)
    return rec


def warm_up(size):
    """Writes and removes `size` bytes in /dev/shm: a VM's memory is slow the first time it
    is touched (the first run was 5x slower at everything until this)."""
    path = os.path.join(thin.WORK["dir"], "warm-up")
    chunk = b"\0" * (16 * MiB)
    with open(path, "wb") as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)
    os.remove(path)


def flow_part(a):
    servers = ["cairn", "qsd"]
    warm_up(3 * a.size)
    res = thin.rounds("flow", [(k, lambda k=k: flow_run(a, k)) for k in servers], a.rounds,
                      lambda r: r,
                      lambda r: (f"incremental {r['inc_seconds'] * 1000:.0f} ms, "
                                 f"{mib(r['inc_bytes_read'])} read; full {r['full_s']:.2f} s; "
                                 f"restore {'matches' if r['restore_matches'] else 'DIFFERS'}"))
    out(f"## Incremental backup of {mib(a.size)} after {a.changed}% rewritten\n",
        "| server | full backup s | incremental ms | 16 in flight ms | read % of volume | "
        "dirty extents | incremental / full | restore matches | checkpoint c2 ms |",
        "|---|---|---|---|---|---|---|---|---|")
    for k in servers:
        rs = good(res[k])
        if not rs:
            out(f"| {k} | failed | | | | | | | |")
            continue
        per = [r["inc_seconds"] / r["full_s"] for r in rs]
        out(f"| {k} | {med(rs, 'full_s'):.2f} | {med(rs, 'inc_seconds') * 1000:.0f} | "
            f"{med(rs, 'inc16_seconds') * 1000:.0f} | "
            f"{100 * med(rs, 'inc_bytes_read') / a.size:.2f}% | {med(rs, 'inc_extents'):.0f} | "
            f"{spread(per)} | {sum(r['restore_matches'] for r in rs)}/{len(rs)} | "
            f"{med(rs, 'checkpoint2_s') * 1000:.0f} |")
    per = [c["inc_seconds"] / q["inc_seconds"] for c, q in zip(res["cairn"], res["qsd"])
           if "error" not in c and "error" not in q]
    per16 = [c["inc16_seconds"] / q["inc16_seconds"] for c, q in zip(res["cairn"], res["qsd"])
             if "error" not in c and "error" not in q]
    out("", f"cairn's incremental backup / qsd's (Python libnbd client, reads written into "
        f"the copy): {spread(per)} one read at a time, {spread(per16)} with 16 in flight "
        "(target <= 0.5x)", "")
    both = [(c, q) for c, q in zip(res["cairn"], res["qsd"])
            if "error" not in c and "error" not in q]
    cpu = [c["inc_server_cpu_s"] / q["inc_server_cpu_s"] for c, q in both]
    out(f"The servers' CPU time for the incremental (Python client, one read at a time): "
        f"cairn {statistics.median(c['inc_server_cpu_s'] for c, _ in both) * 1000:.1f} ms, "
        f"qsd {statistics.median(q['inc_server_cpu_s'] for _, q in both) * 1000:.1f} ms: "
        f"{spread(cpu)}")
    for key, what in (("incc", "one at a time"), ("inccaio", "all at once")):
        cpu = [c[f"{key}_server_cpu_s"] / q[f"{key}_server_cpu_s"] for c, q in both]
        out(f"The servers' CPU time for the C clients' map and reads ({what}): cairn "
            f"{statistics.median(c[f'{key}_server_cpu_s'] for c, _ in both) * 1000:.1f} ms, "
            f"qsd {statistics.median(q[f'{key}_server_cpu_s'] for _, q in both) * 1000:.1f} "
            f"ms: {spread(cpu)}")
        ratio = [c[f"{key}_seconds"] / q[f"{key}_seconds"] for c, q in both]
        out(f"C clients (qemu-io's reads of the dirty extents, {what}; the map by nbdinfo "
            f"{statistics.median(c[f'{key}_map_s'] for c, _ in both) * 1000:.0f} / "
            f"{statistics.median(q[f'{key}_map_s'] for _, q in both) * 1000:.0f} ms apart): cairn "
            f"{statistics.median(c[f'{key}_seconds'] for c, _ in both) * 1000:.0f} ms, qsd "
            f"{statistics.median(q[f'{key}_seconds'] for _, q in both) * 1000:.0f} ms: "
            f"{spread(ratio)} (target <= 0.5x)")
    for key, what in (("incb_seconds", "its own time, connect to fsync"),
                      ("incb_wall_s", "the process's wall clock")):
        ratio = [c[key] / q[key] for c, q in both]
        out(f"cairn backup --since c1 (--depth {a.depth}; {what}): cairn "
            f"{statistics.median(c[key] for c, _ in both) * 1000:.1f} ms, qsd "
            f"{statistics.median(q[key] for _, q in both) * 1000:.1f} ms: {spread(ratio)} "
            "(target <= 0.5x)")
    for key, what in (("incb_connect_seconds", "connect and negotiate"),
                      ("incb_pull_seconds", "block status and reads, DEST written")):
        out(f"  of which {what}: cairn "
            f"{statistics.median(c[key] for c, _ in both) * 1000:.1f} ms, qsd "
            f"{statistics.median(q[key] for _, q in both) * 1000:.1f} ms: "
            f"{spread([c[key] / q[key] for c, q in both])}")
    out(f"  cairn backup's own CPU time (user + system): against cairn "
        f"{statistics.median(c['incb_cpu_s'] for c, _ in both) * 1000:.1f} ms, against qsd "
        f"{statistics.median(q['incb_cpu_s'] for _, q in both) * 1000:.1f} ms")
    cpu = [c["incb_server_cpu_s"] / q["incb_server_cpu_s"] for c, q in both]
    out(f"The servers' CPU time for cairn backup --since: cairn "
        f"{statistics.median(c['incb_server_cpu_s'] for c, _ in both) * 1000:.1f} ms, qsd "
        f"{statistics.median(q['incb_server_cpu_s'] for _, q in both) * 1000:.1f} ms: "
        f"{spread(cpu)}; its restores matching the Python client's: "
        f"{sum(r['incb_matches'] for r, _ in both)}/{len(both)} (cairn), "
        f"{sum(r['incb_matches'] for _, r in both)}/{len(both)} (qsd)")
    out("")
    for line in thin.failures(res):
        out(line)


# ---------------------------------------------------------------- part: cost

def cost_stack(d, kind, size, store):
    text = (f'[device.d]\ntype = "file"\npath = "{d}/data"\nsize = "{size_str(2 * size)}"\n'
            'sparse = true\n')
    dev = "d"
    if kind == "thin":
        text += ('[device.pool]\ntype = "thin-pool"\ndata = "d"\n'
                 f'[device.vm]\ntype = "thin"\npool = "pool"\nsize = "{size_str(size)}"\n')
        dev = "vm"
    if store:
        text += f'bitmaps = "{d}/{dev}.bitmaps"\n'
    text += f'[export.x]\ndevice = "{dev}"\n'
    path = os.path.join(d, f"stack-{kind}-{'b' if store else 'n'}.toml")
    with open(path, "w") as f:
        f.write(text)
    return path, dev


def admin_session(d, stack, *commands):
    """cairn serve on `stack` long enough to run admin `commands`."""
    srv = Cairn(d, stack)
    srv.uri = f"nbd+unix:///x?socket={srv.sock}"
    srv.start()
    try:
        for c in commands:
            srv.admin(*c)
    finally:
        srv.stop()


def bench_run(a, stack, dev, what):
    j = thin.cairn_bench(stack, dev, "randwrite", "4k", 32,
                         [f"--size={size_str(a.size)}", f"--runtime={a.runtime}", "--time_based",
                          ], a.runtime + 120, what)
    return thin.summary(j) | {"cmd": j["bench"]["cmd"]}


def cost_part(a):
    for kind in ("file", "thin"):
        d = fresh(f"cost-{kind}")
        plain, dev = cost_stack(d, kind, a.size, False)
        tracked, _ = cost_stack(d, kind, a.size, True)
        # Fill (the thin volume maps every block, the file has its size), then a bitmap.
        thin.cairn_bench(plain, dev, "write", "1M", 8, [f"--size={size_str(a.size)}"], 600,
                         f"{kind}: fill")
        admin_session(d, tracked, ("bitmap", "add", dev, "b0"))
        thin.cairn_bench(tracked, dev, "write", "1M", 8, [f"--size={size_str(a.size)}"], 600,
                         f"{kind}: set every bit")

        def fresh_run():
            admin_session(d, tracked, ("bitmap", "clear", dev, "b0"))
            return bench_run(a, tracked, dev, f"{kind}: fresh bitmap")

        variants = [("none", lambda: bench_run(a, plain, dev, f"{kind}: no bitmap")),
                    ("steady", lambda: bench_run(a, tracked, dev, f"{kind}: steady bitmap")),
                    ("fresh", fresh_run)]
        res = thin.rounds(f"cost-{kind}", variants, a.rounds, lambda r: r)
        out(f"## A bitmap's cost: 4 KiB randwrite, iodepth 32, {a.runtime} s over "
            f"{mib(a.size)} of a {kind} device\n",
            "| bitmap | IOPS | / none (spread) | lat mean µs |", "|---|---|---|---|")
        for k, _ in variants:
            rs = res[k]
            m = med(rs, "iops")
            out(f"| {k} | {thin.cell(m)} | {spread(thin.ratios(rs, res['none']))} | "
                f"{thin.cell(med(rs, 'lat_mean_ns'), lambda v: f'{v / 1000:.1f}')} |")
        out("")
        for line in thin.failures(res):
            out(line)
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--size", type=thin.parse_size, default=None, help="the volume (4G)")
    ap.add_argument("--changed", type=float, default=1.0, help="percent rewritten (1)")
    ap.add_argument("--runtime", type=int, default=None, help="seconds per cost run (5)")
    ap.add_argument("--depth", type=int, default=16,
                    help="cairn backup's reads in flight (16)")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    a.size = a.size or (512 * MiB if a.quick else 4 * GiB)
    a.runtime = a.runtime or (2 if a.quick else 5)
    parts = [p for p in a.parts.split(",") if p]
    for p in parts:
        if p not in PARTS:
            sys.exit(f"unknown part {p!r}; known: {', '.join(PARTS)}")
    thin.binary_check()
    missing = [t for t in ("fio", "nbdcopy", "nbdinfo", "qemu-img", "qemu-storage-daemon")
               if shutil.which(t) is None]
    if missing:
        sys.exit(f"missing: {', '.join(missing)}")
    os.makedirs(OUT, exist_ok=True)
    thin.save = save  # the rounds' JSON as backup-*.json
    signal.signal(signal.SIGTERM, thin.on_signal)
    signal.signal(signal.SIGINT, thin.on_signal)
    thin.WORK["dir"] = tempfile.mkdtemp(prefix="cairn-backup-bench-", dir=thin.SHM)
    stop = threading.Event()
    threading.Thread(target=thin.watchdog, args=(2 * GiB, stop), daemon=True).start()
    try:
        rev = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                             stdout=subprocess.PIPE, text=True).stdout.strip()
        out(f"# Incremental backup: `bench/backup.py {' '.join(sys.argv[1:])}`\n",
            f"{a.rounds} interleaved round(s); cairn {rev}, {os.cpu_count()} CPUs.\n")
        if "flow" in parts:
            flow_part(a)
        if "cost" in parts:
            cost_part(a)
    except KeyboardInterrupt:
        print("interrupted: stopping what runs and removing the files", file=sys.stderr)
        sys.exit(130)
    finally:
        stop.set()
        thin.cleanup()


if __name__ == "__main__":
    main()
