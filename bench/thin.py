#!/usr/bin/env python3
"""Thin pools: allocation, overwrite, snapshots, qcow2, metadata, check, block size.

  bench/thin.py [--rounds N] [--runtime SECS] [--parts local,snapshot,qcow2,metadata,check,blocks]
                [--block SIZE] [--iodepth N] [--setup-iodepth N] [--snapshots N]
                [--snapshot-every SECS] [--snapshot-runtime SECS] [--shm-reserve SIZE] [--quick]

Everything lives in a fresh directory under /dev/shm (the root disk is slow), removed at
the end, also on Ctrl-C or SIGTERM, with every process the script started. A pool is a
`thin-pool` (block --block, default 64K) on a sparse 64 GiB `file` device `d`, created
blank for every run, with one volume `vm`; "the data file alone" is that same file
device with no pool on it. The script runs target/release/cairn (or CAIRN_BIN) and never
builds it: it warns when the binary is older than the sources.

Parts (--parts, default all):
  local     cairn bench in process, 4 KiB, iodepth 32, one job: the data file alone
            against a thin volume.
              (a) randwrite into unallocated space: a 60 GiB region (--size=60G; the
                  volume is 60 GiB), a fresh data file (and pool) every run. Target:
                  thin >= 0.7x the file.
              (b) randwrite over 4 GiB written sequentially first (cairn bench --rw=write
                  --bs=1M --size=4G, once per variant; the rounds then reuse it), --size=4G.
                  Target >= 0.95x.
              (c) randread of the same 4 GiB. Target >= 0.95x.
  snapshot  cairn serve --admin with a 1 GiB volume, filled through the NBD export (fio
            rw=write bs=1M); then fio (ioengine=nbd) randwrite 4 KiB iodepth 32 for 20 s
            (--snapshot-runtime), its IOPS logged every 100 ms (--write_iops_log,
            --log_unix_epoch); 2 s after fio's connection shows in `status --json`, 21
            snapshots (--snapshots), one every 0.5 s (--snapshot-every): `cairn admin
            SOCK thin snapshot pool vm sN`, each timed twice: the command's wall clock
            (starting `cairn admin` included; the median of 5 `thin list` commands
            before the load shows what that start costs) and the time writes were held
            that its reply gives ("writes to 'vm' held for N us"; builds that print
            "writes held for N us, M us in all" fill the "in all" column too, and
            those that say what the hold went on, the writes in flight, the table copy
            and the commit, a note with each). The
            first write to a block after a snapshot copies it (copy on write): reported
            as the IOPS in the second after each snapshot (from the admin command's
            return) against the run's median second, the lowest 100 ms after a
            snapshot, and a per-second timeline. Also cairn serve's VmRSS once filled
            and after the run, and the pool's data in use after it.
            Target: < 10 ms per snapshot (writes held).
            Each snapshot can pin up to a volume's worth of copied blocks. When /dev/shm
            (less --shm-reserve) cannot hold the volume (snapshots + 1) times, the oldest
            snapshots are deleted as new ones come (`thin delete`, timed) so that at most
            K stay; the table gives K.
  qcow2     an NBD server in /dev/shm with 4 GiB, filled (fio rw=write bs=1M iodepth 8),
            then an internal snapshot, then fio (ioengine=nbd, one connection)
            randwrite and randread, 4 KiB, iodepth 32, --runtime each:
              cairn  cairn serve, a 4 GiB volume; `thin snapshot pool vm s0`
              qsd    qemu-storage-daemon: a qcow2 (qemu-img create -o cluster_size=64k)
                     on the file driver with aio=io_uring, exported on one iothread (as
                     bench/rbd.py runs qsd); the snapshot taken live over QMP
                     (blockdev-snapshot-internal-sync)
            Every run starts its server afresh (fill, snapshot, randwrite, randread),
            one server at a time. The randwrite starts right after the snapshot, so its
            first write to each block copies it: a server that copies faster is sooner
            past the copies (both are measured over the same --runtime; the qcow2 is
            left with qemu's defaults otherwise). Server CPU: utime+stime of all its threads
            (/proc/PID/stat), in seconds per 100k requests. Target: cairn >= 2x qsd on
            both.
  metadata  metadata bytes per TiB mapped, for two fills: a 16 GiB volume written
            sequentially (fio bs=1M) and a 4 GiB volume mapped whole by one 4 KiB write
            into each block, in random order (libnbd, iodepth --setup-iodepth). Read
            live from `status --json` (checkpoint_bytes + log_used_bytes, a commit
            period after the fill), then the server is stopped (SIGTERM), `cairn check`
            shows what is on disk, and the pool is opened again (opening writes a fresh
            checkpoint) and checkpoint_bytes read: per TiB = that / mapped x 2^40. When
            /dev/shm cannot hold 16 GiB, the sequential fill is halved until it fits
            (the table says how much).
  check     how long `cairn check STACKFILE` takes on a pool with a 1 GiB volume mapped
            by one 4 KiB write per block in random order (16384 blocks at 64K), then 100
            snapshots each followed by 1 MiB of random 4 KiB writes to the volume: after
            a kill -9 of the server (the log is replayed; check writes nothing, so each
            of the 5 runs replays it) and after a clean stop (SIGTERM) of a server
            started on it again; median (min..max) of 5 runs each. Also how long cairn
            serve takes to answer (nbdinfo) when started on the pool in each state.
  blocks    the block-size study, at 64K, 1M and 4M: local (a) and (b) and the snapshot
            part (snapshot latency, IOPS around snapshots, VmRSS with 1 GiB mapped), a
            table per block size, then a summary row per block size. This picks the
            default.

--quick (smoke runs; figures mean little): 256 MiB in place of 4 GiB and 1 GiB, 1 GiB in
place of 16, 5 snapshots one per 0.2 s from 1.5 s into a 4 s run, 10 snapshots with
256 KiB after each and 2 check runs in the check part. --iodepth sets the measured loads' depth (32),
--setup-iodepth that of the libnbd writers that prepare pools (32).

Interleaved rounds (odd rounds in reverse order); medians, with the spread (min..max of
the per-round ratios). JSON of every run goes to bench/out/thin-*.json, server logs to
bench/out/thin-serve.log and thin-qsd.log; tables to stdout (Markdown), progress to
stderr. The script reports what it measured; it asserts nothing. A run that fails (an
error from a client or an admin command, or no answer within its time limit: then the
script kills it, fio's job processes included) is counted as failed with its error, and
the rest goes on; once an admin command got no answer, the server's later admin commands
are not tried. While a load runs, a watchdog kills it if /dev/shm has less than
--shm-reserve (2G) free. Every cairn serve is stopped with SIGTERM (the tables note an
exit status other than 0).

The libnbd writers need Python's `nbd` module (python3-libnbd); the script looks for an
interpreter that has it (this one, then /usr/bin/python3).
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbd  # noqa: E402
from engine import CAIRN, OUT, ROOT, fmt_iops  # noqa: E402

SHM = "/dev/shm"
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
DATA_SIZE = "64G"
BLOCKS = ["64K", "1M", "4M"]
PARTS = ["local", "snapshot", "qcow2", "metadata", "check", "blocks"]

# Every process started and not yet waited for (pid -> Popen), and the loads among them
# that the /dev/shm watchdog may kill (pid -> why, once killed).
PROCS = {}
LOADS = set()
GUARD_KILLED = {}
WORK = {"dir": None}


class Failed(Exception):
    """A run that gave no result; the message says why."""


# ---------------------------------------------------------------- processes

def spawn(cmd, load=False, **kw):
    # A session of its own: a terminal's Ctrl-C reaches this script only, which then
    # stops everything in order (see killgroup for fio's job processes).
    p = subprocess.Popen(cmd, start_new_session=True, **kw)
    PROCS[p.pid] = p
    if load:
        LOADS.add(p.pid)
    return p


def reap(p):
    PROCS.pop(p.pid, None)
    LOADS.discard(p.pid)


def descendants(pid):
    """Every process below `pid` (fio's job processes call setsid: killing fio's group
    does not reach them, and they hold its output pipes)."""
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                kids.setdefault(int(nbd.stat_fields(d)[1]), []).append(int(d))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def killgroup(p, sig=signal.SIGKILL):
    """Sends `sig` to p's process group and to every process below it."""
    for pid in descendants(p.pid):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tail(text, n=1500):
    text = (text or "").strip()
    return f": {text[-n:]}" if text else ""


def run(cmd, timeout, what, load=False):
    """Runs `cmd`; returns (stdout, stderr). Raises Failed on a non-zero exit or when it
    outlives `timeout` (its process group is then killed)."""
    p = spawn(cmd, load=load, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
              stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        killgroup(p)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            err = ""
        reap(p)
        raise Failed(f"{what}: still running after {timeout:.0f} s, killed{tail(err)}")
    reap(p)
    guard = GUARD_KILLED.pop(p.pid, None)
    if guard:
        raise Failed(f"{what}: killed by the watchdog: {guard}")
    if p.returncode != 0:
        raise Failed(f"{what} failed (exit status {p.returncode}){tail(err or out)}")
    return out, err


def shm_free():
    st = os.statvfs(SHM)
    return st.f_bavail * st.f_frsize


def watchdog(reserve, stop):
    while not stop.wait(0.2):
        if not LOADS:
            continue
        free = shm_free()
        if free < reserve:
            why = f"/dev/shm down to {free >> 20} MiB free (--shm-reserve {reserve >> 20} MiB)"
            for pid in list(LOADS):
                p = PROCS.get(pid)
                if p is not None and pid not in GUARD_KILLED:
                    GUARD_KILLED[pid] = why
                    killgroup(p)
                    print(f"  watchdog: {why}: {' '.join(p.args[:2])} killed", file=sys.stderr)


def cleanup():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for p in list(PROCS.values()):
        if p.poll() is None:
            killgroup(p, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in list(PROCS.values()):
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            killgroup(p)
            p.wait()
    PROCS.clear()
    if WORK["dir"]:
        shutil.rmtree(WORK["dir"], ignore_errors=True)


def on_signal(signum, frame):
    raise KeyboardInterrupt


# ---------------------------------------------------------------- sizes, files, JSON

def parse_size(s):
    m = re.fullmatch(r"(\d+)([KMGT]?)i?B?", s.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {s}")
    return int(m[1]) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m[2].upper()]


def size_str(n):
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def mib(n):
    if n < 10 * 1024:
        return f"{n:.0f} B"
    if n < 10 * MiB:
        return f"{n / 1024:.0f} KiB"
    return f"{n / MiB:.0f} MiB" if n < 10 * GiB else f"{n / GiB:.1f} GiB"


def fresh(name):
    return tempfile.mkdtemp(prefix=f"{name}-", dir=WORK["dir"])


def write_stack(d, block=None, volume=None):
    """d/stack.toml: the file device `d` (d/data, sparse 64 GiB); with `volume`, a pool on
    it and volume `vm` of that size, exported as `vm`."""
    text = (f'[device.d]\ntype = "file"\npath = "{d}/data"\nsize = "{DATA_SIZE}"\n'
            'sparse = true\n')
    if volume:
        text += '[device.pool]\ntype = "thin-pool"\ndata = "d"\n'
        if block:
            text += f'block = "{block}"\n'
        text += (f'[device.vm]\ntype = "thin"\npool = "pool"\nsize = "{size_str(volume)}"\n'
                 '[export.vm]\ndevice = "vm"\n')
    path = os.path.join(d, "stack.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def save(name, j):
    with open(os.path.join(OUT, f"thin-{name}.json"), "w") as f:
        json.dump(j, f, indent=1, default=str)


# ---------------------------------------------------------------- servers

class Server:
    """A server process on a Unix socket: start, wait until it answers, measure, stop."""

    kind = "server"
    uri = None

    def __init__(self, d):
        self.dir = d
        self.proc = None
        self.cmd = None
        self.log = None
        self.ready_s = None

    def launch(self):
        self.logname = os.path.join(OUT, f"thin-{self.kind}.log")
        self.log = open(self.logname, "a")
        self.log.write(f"--- {time.strftime('%H:%M:%S')} {' '.join(self.cmd)}\n")
        self.log.flush()
        t0 = time.monotonic()
        self.proc = spawn(self.cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                self._ended(self.proc.returncode)
                raise Failed(f"{self.kind} exited ({self.proc.returncode}) before answering; "
                             f"see {self.logname}")
            try:
                r = subprocess.run(["nbdinfo", "--size", self.uri], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, timeout=20)
                if r.returncode == 0:
                    break
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > deadline:
                self.kill9()
                raise Failed(f"{self.kind} did not answer within 300 s; see {self.logname}")
            time.sleep(0.02)
        self.ready_s = time.monotonic() - t0

    def cpu_ticks(self):
        return nbd.ticks(self.proc.pid)

    def rss_kib(self):
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return None

    def _ended(self, status):
        reap(self.proc)
        if self.log:
            self.log.write(f"--- exit status {status}\n")
            self.log.close()
            self.log = None
        return status

    def stop(self):
        """SIGTERM, wait; returns the exit status (negative: killed by that signal; a
        string when it had exited before)."""
        if self.proc is None:
            return None
        if self.proc.poll() is not None:
            if self.log is None:
                return self.proc.returncode  # stopped already
            return self._ended(f"{self.proc.returncode} (it had exited before the SIGTERM)")
        self.proc.send_signal(signal.SIGTERM)
        try:
            status = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            print(f"  {self.kind}: still running 60 s after SIGTERM; SIGKILL", file=sys.stderr)
            killgroup(self.proc)
            status = self.proc.wait()
        return self._ended(status)

    def kill9(self):
        if self.proc is None or self.log is None:
            return None
        if self.proc.poll() is not None:
            return self._ended(f"{self.proc.returncode} (it had exited before the kill -9)")
        killgroup(self.proc)
        return self._ended(self.proc.wait())


class Cairn(Server):
    """cairn serve STACK with an admin socket; the export `vm`."""

    kind = "serve"

    def __init__(self, d, stack):
        super().__init__(d)
        self.stack = stack
        self.sock = os.path.join(d, "nbd.sock")
        self.admin_sock = os.path.join(d, "admin.sock")
        self.uri = f"nbd+unix:///vm?socket={self.sock}"
        self.stuck = None

    def start(self):
        self.cmd = [CAIRN, "serve", self.stack, "--listen", f"unix:{self.sock}",
                    "--admin", self.admin_sock]
        self.launch()
        return self

    def admin_cmd(self, *args):
        return [CAIRN, "admin", self.admin_sock, *args]

    def admin(self, *args, timeout=60):
        """Runs an admin command; returns (stdout, wall seconds). Once one got no answer,
        the others are not tried (the server answers admin commands one at a time)."""
        what = f"cairn admin {' '.join(args)}"
        if self.stuck:
            raise Failed(f"{what}: not tried: {self.stuck}")
        t0 = time.monotonic()
        try:
            out, _ = run(self.admin_cmd(*args), timeout, what)
        except Failed as e:
            if "still running after" in str(e):
                self.stuck = f"an earlier admin command got no answer ({what})"
            raise
        return out, time.monotonic() - t0

    def connections(self):
        out, _ = self.admin("status", "--json")
        return sum(len(e["connections"]) for e in json.loads(out).get("exports", []))

    def pool(self):
        out, _ = self.admin("status", "--json")
        for p in json.loads(out).get("thin_pools", []):
            if p["name"] == "pool":
                return p
        raise Failed("status --json shows no thin pool 'pool'")


class Qsd(Server):
    """qemu-storage-daemon exporting a qcow2 as `vm`, with a QMP monitor."""

    kind = "qsd"

    def __init__(self, d, size):
        super().__init__(d)
        self.img = os.path.join(d, "q.qcow2")
        self.sock = os.path.join(d, "qsd.sock")
        self.qmp_sock = os.path.join(d, "qmp.sock")
        self.size = size
        self.uri = f"nbd+unix:///vm?socket={self.sock}"

    def start(self):
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=64k", self.img,
             size_str(self.size)], 60, "qemu-img create")
        self.cmd = ["qemu-storage-daemon", "--object", "iothread,id=io0",
                    "--blockdev", f"driver=file,node-name=f0,filename={self.img},aio=io_uring",
                    "--blockdev", "driver=qcow2,node-name=q0,file=f0",
                    "--nbd-server", f"addr.type=unix,addr.path={self.sock},max-connections=0",
                    "--export", "type=nbd,id=e0,node-name=q0,name=vm,writable=on,iothread=io0",
                    "--chardev", f"socket,id=m0,path={self.qmp_sock},server=on,wait=off",
                    "--monitor", "chardev=m0"]
        self.launch()
        return self

    def qmp(self, command, arguments=None, timeout=120):
        """Runs one QMP command (after qmp_capabilities); returns (reply, wall seconds)."""
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(timeout)
        try:
            s.connect(self.qmp_sock)
            f = s.makefile("rw")
            json.loads(f.readline())  # the greeting
            replies = []
            for c in ({"execute": "qmp_capabilities"},
                      {"execute": command, **({"arguments": arguments} if arguments else {})}):
                t0 = time.monotonic()
                f.write(json.dumps(c) + "\n")
                f.flush()
                while True:
                    r = json.loads(f.readline())
                    if "event" not in r:
                        break
                if "error" in r:
                    raise Failed(f"QMP {c['execute']}: {r['error']}")
                replies.append((r, time.monotonic() - t0))
            return replies[-1]
        except (OSError, ValueError) as e:
            raise Failed(f"QMP {command}: {e}")
        finally:
            s.close()


# ---------------------------------------------------------------- clients

def summary(j):
    job = j["jobs"][0]
    d = job["write"] if job["write"]["total_ios"] else job["read"]
    lat = d.get("lat_ns") or d.get("clat_ns") or {}
    return {"iops": job["read"]["iops"] + job["write"]["iops"],
            "ios": job["read"]["total_ios"] + job["write"]["total_ios"],
            "lat_mean_ns": lat.get("mean", 0),
            "clat_p99_ns": d.get("clat_ns", {}).get("percentile", {}).get("99.000000", 0)}


def cairn_bench(stack, device, rw, bs, depth, extra, timeout, what):
    cmd = [CAIRN, "bench", "--log-level", "warn", stack, "--device", device, f"--rw={rw}",
           f"--bs={bs}", f"--iodepth={depth}", "--numjobs=1", *extra, "--output-format=json"]
    t0 = time.monotonic()
    out, err = run(cmd, timeout, what, load=True)
    j = json.loads(out)
    j["bench"] = {"cmd": cmd, "wall_s": time.monotonic() - t0, "stderr": err[-2000:]}
    return j


def fio_cmd(uri, rw, bs, depth, runtime=None, size=None, extra=()):
    cmd = ["fio", "--name=thin", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}",
           f"--iodepth={depth}", "--numjobs=1", "--norandommap", "--randrepeat=0",
           "--group_reporting", "--output-format=json", *extra]
    if runtime:
        cmd += [f"--runtime={runtime}", "--time_based"]
    if size:
        cmd += [f"--size={size}"]
    return cmd


def fio_fill(uri, size, what):
    """Writes [0, size) sequentially, 1 MiB writes at iodepth 8; returns seconds taken."""
    t0 = time.monotonic()
    run(fio_cmd(uri, "write", "1M", 8, size=size_str(size)), size / (50 * MiB) + 120, what, load=True)
    return time.monotonic() - t0


def measured_fio(srv, rw, runtime, depth, what):
    """fio against `srv`, with the server's CPU over the run."""
    cmd = fio_cmd(srv.uri, rw, "4k", depth, runtime=runtime)
    before = srv.cpu_ticks()
    t0 = time.monotonic()
    out, _ = run(cmd, runtime + 60, what, load=True)
    wall = time.monotonic() - t0
    cpu = (srv.cpu_ticks() - before) / nbd.CLK_TCK
    j = nbd.parse_fio(out)
    j["server"] = {"kind": srv.kind, "cmd": srv.cmd, "cpu_s": cpu, "fio_wall_s": wall}
    return j


NBD_WRITER = r'''
import json, os, random, subprocess, sys, time
import nbd
a = json.loads(sys.argv[1])
h = nbd.NBD()
h.connect_uri(a["uri"])
size = h.get_size()
depth = a["depth"]
buf = nbd.Buffer.from_bytearray(bytearray(os.urandom(4096)))
errors = []
def done(err):
    v = getattr(err, "value", err)
    if v:
        errors.append(v)
    return 1
def write(offsets):
    for off in offsets:
        while h.aio_in_flight() >= depth:
            h.poll(-1)
        h.aio_pwrite(buf, off, completion=done)
    while h.aio_in_flight() > 0:
        h.poll(-1)
    h.flush()
rng = random.Random(a.get("seed", 37))
out = {"size": size}
if a.get("block"):
    order = list(range(size // a["block"]))
    rng.shuffle(order)
    t = time.monotonic()
    write(b * a["block"] for b in order)
    out["fill_writes"] = len(order)
    out["fill_s"] = time.monotonic() - t
snaps = []
for i in range(a.get("snapshots", 0)):
    t = time.monotonic()
    r = subprocess.run(a["snapshot_cmd"] + ["s%d" % i], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    snaps.append({"name": "s%d" % i, "rc": r.returncode, "wall_s": time.monotonic() - t,
                  "out": (r.stdout + r.stderr).strip()})
    if r.returncode != 0:
        break
    write(rng.randrange(size // 4096) * 4096 for _ in range(a["writes_after"]))
out["snapshots"] = snaps
out["error_count"] = len(errors)
out["errors"] = errors[:20]
h.shutdown()
print(json.dumps(out))
sys.exit(1 if errors or any(s["rc"] for s in snaps) else 0)
'''
PY_NBD = {"exe": None}


def nbd_python():
    if PY_NBD["exe"] is None:
        for exe in (sys.executable, "/usr/bin/python3"):
            if exe and subprocess.run([exe, "-c", "import nbd"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL).returncode == 0:
                PY_NBD["exe"] = exe
                break
        else:
            raise Failed("no Python with libnbd's `nbd` module (apt-get install python3-libnbd)")
    return PY_NBD["exe"]


def nbd_writer(what, timeout, **args):
    """The libnbd writer (NBD_WRITER): with block=B, one 4 KiB write at the start of every
    B-byte block of the export, in random order; then `snapshots` times: run
    snapshot_cmd + [sN], then `writes_after` random 4 KiB writes. Returns its report."""
    path = os.path.join(WORK["dir"], "nbd_writer.py")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(NBD_WRITER)
    out, _ = run([nbd_python(), path, json.dumps(args)], timeout, what, load=True)
    return json.loads(out)


# ---------------------------------------------------------------- rounds and tables

def rounds(name, variants, n, summarize, describe=None):
    """Runs each (label, thunk) once per round, interleaved, odd rounds in reverse order;
    keeps every run's JSON. Returns {label: [summary per round]} ({"error": ...} for a
    failed run)."""
    res = {label: [] for label, _ in variants}
    for rnd in range(n):
        for label, thunk in (variants[::-1] if rnd % 2 else variants):
            try:
                j = thunk()
                s = summarize(j)
            except Failed as e:
                j = s = {"error": str(e)}
                print(f"  {name}: {label} round {rnd + 1}: FAILED: {e}", file=sys.stderr)
            save(f"{name}-{label}-{rnd}", j)
            res[label].append(s)
            if "error" not in s:
                text = describe(s) if describe else f"{s['iops']:.0f} IOPS"
                print(f"  {name}: {label} round {rnd + 1}: {text}", file=sys.stderr)
    return res


def good(rs):
    return [r for r in rs if "error" not in r]


def med(rs, key):
    v = [r[key] for r in good(rs) if r.get(key) is not None]
    return statistics.median(v) if v else None


def ratios(a, b, key="iops"):
    return [x[key] / y[key] for x, y in zip(a, b)
            if "error" not in x and "error" not in y and x.get(key) is not None and y.get(key)]


def spread(per):
    if not per:
        return "-"
    return f"{statistics.median(per):.2f}x ({min(per):.2f}..{max(per):.2f})"


def iops(v):
    return fmt_iops(v) if v >= 1000 else f"{v:.0f}"


def cell(v, f=iops):
    return "-" if v is None else f(v)


def failures(res):
    """A line per variant with failed runs: which rounds, and the first one's error."""
    lines = []
    for label, rs in res.items():
        bad = [(i, r["error"]) for i, r in enumerate(rs) if "error" in r]
        if bad:
            rounds_s = ", ".join(str(i + 1) for i, _ in bad)
            lines.append(f"- {label}: failed in round(s) {rounds_s}: {bad[0][1][:600]}")
    return lines


def out(*lines):
    for line in lines:
        print(line)
    sys.stdout.flush()


# ---------------------------------------------------------------- part: local

def local_part(a, block, with_read=True, tag="local"):
    t, n, depth = a.runtime, a.rounds, a.iodepth
    fill = a.fill
    rows, errors = [], []

    def row(title, res, need, lat=True):
        f, th = res["file"], res["thin"]
        per = ratios(th, f)
        met = "-" if not per else ("yes" if statistics.median(per) >= need else "NO")
        lats = (f"{cell(med(f, 'lat_mean_ns'), lambda v: f'{v / 1e3:.1f}')} / "
                f"{cell(med(th, 'lat_mean_ns'), lambda v: f'{v / 1e3:.1f}')}")
        rows.append(f"| {title} | {cell(med(f, 'iops'))} | {cell(med(th, 'iops'))} | {spread(per)} | "
                    f"{lats} | >= {need}x | {met} |")
        errors.extend(failures({f"{title.split(')')[0]}) {k}": v for k, v in res.items()}))

    def unallocated(kind):
        d = fresh("alloc")
        try:
            stack = write_stack(d, block, 60 * GiB if kind == "thin" else None)
            return cairn_bench(stack, "vm" if kind == "thin" else "d", "randwrite", "4k", depth,
                               [f"--runtime={t}s", "--time_based", "--size=60G"], t + 300,
                               f"(a) randwrite, {kind}")
        finally:
            shutil.rmtree(d, ignore_errors=True)

    res = rounds(f"{tag}-{block}-alloc", [("file", lambda: unallocated("file")),
                                          ("thin", lambda: unallocated("thin"))], n, summary)
    row("(a) 4 KiB randwrite into unallocated space (60 GiB region; a fresh file, and pool, every run)",
        res, 0.7)

    dirs, stacks, fills = {}, {}, {}
    try:
        for kind in ("file", "thin"):
            d = dirs[kind] = fresh(f"filled-{kind}")
            stack = write_stack(d, block, 60 * GiB if kind == "thin" else None)
            try:
                j = cairn_bench(stack, "vm" if kind == "thin" else "d", "write", "1M", 8,
                                [f"--size={size_str(fill)}"], fill / (50 * MiB) + 300,
                                f"fill {size_str(fill)}, {kind}")
                save(f"{tag}-{block}-fill-{kind}", j)
                stacks[kind] = stack
                fills[kind] = j["bench"]["wall_s"]
            except Failed as e:
                stacks[kind] = e
                print(f"  {tag}: fill of {kind} FAILED: {e}", file=sys.stderr)

        def filled(kind, rw):
            if isinstance(stacks[kind], Failed):
                raise Failed(f"the fill failed: {stacks[kind]}")
            return cairn_bench(stacks[kind], "vm" if kind == "thin" else "d", rw, "4k", depth,
                               [f"--runtime={t}s", "--time_based", f"--size={size_str(fill)}"],
                               t + 300, f"{rw} over the filled {size_str(fill)}, {kind}")

        workloads = [("randwrite", "(b) 4 KiB randwrite over", 0.95)]
        if with_read:
            workloads.append(("randread", "(c) 4 KiB randread of", 0.95))
        for rw, title, need in workloads:
            res = rounds(f"{tag}-{block}-{rw}", [(k, lambda k=k, rw=rw: filled(k, rw))
                                                 for k in ("file", "thin")], n, summary)
            row(f"{title} {mib(fill)} written sequentially first", res, need)
    finally:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)

    out(f"## cairn bench in process, iodepth {depth}, one job: the data file alone against a thin "
        f"volume, block {block}\n",
        "| workload | file alone IOPS | thin IOPS | thin / file (spread) | lat mean µs file / thin "
        "| target | met |",
        "|---|---|---|---|---|---|---|", *rows, "")
    if fills:
        out("Sequential fill (1 MiB writes): " + ", ".join(
            f"{k} {fill / MiB / v:.0f} MiB/s" for k, v in fills.items()) + "\n")
    if errors:
        out("Failed runs:\n", *errors, "")
    return rows


# ---------------------------------------------------------------- part: snapshot

def timeline(path, snaps):
    """From fio's 100 ms IOPS log (unix ms, IOPS, ...): per-second IOPS and what
    happened after each snapshot."""
    samples = []
    try:
        with open(path) as f:
            for line in f:
                p = line.split(",")
                if len(p) >= 2:
                    samples.append((int(p[0]), float(p[1])))
    except OSError:
        return None
    if not samples:
        return None
    t0 = samples[0][0] - 100
    bins = {}
    for ts, v in samples:
        bins.setdefault((ts - t0 - 1) // 1000, []).append(v)
    last = max(bins)
    seconds = [statistics.mean(bins[k]) if k in bins else 0.0 for k in range(last + 1)]
    full = [statistics.mean(bins[k]) for k in range(last + 1) if len(bins.get(k, [])) >= 8]
    marks = [0] * len(seconds)
    after, lowest = [], []
    for s in snaps:
        if "end" not in s:
            continue
        k = int((s["at"] * 1000 - t0) // 1000)
        if 0 <= k < len(marks):
            marks[k] += 1
        end = s["end"] * 1000
        win = [v for ts, v in samples if end < ts <= end + 1000]
        if len(win) >= 8:
            after.append(statistics.mean(win))
            lowest.append(min(win))
    first = min((s["at"] * 1000 for s in snaps if "end" in s), default=None)
    before = [v for ts, v in samples if first is not None and ts <= first]
    return {"seconds": seconds, "snapshots_per_second": marks,
            "median_second": statistics.median(full) if full else None,
            "before_first": statistics.mean(before) if before else None,
            "after": after, "lowest_100ms_after": lowest}


def snapshot_run(a, block):
    d = fresh(f"snap-{block}")
    mapped = a.snap_mapped
    rec = {"block": block, "mapped": mapped}
    srv = Cairn(d, write_stack(d, block, mapped))
    try:
        srv.start()
        rec["serve_ready_s"] = srv.ready_s
        rec["fill_s"] = fio_fill(srv.uri, mapped, f"fill {size_str(mapped)} over NBD")
        time.sleep(1.2)  # a commit period: the mapping is in the pool's report
        rec["rss_filled_kib"] = srv.rss_kib()
        rec["pool_filled"] = srv.pool()
        # What `cairn admin` itself costs (start, connect, reply), without a snapshot.
        rec["admin_floor_ms"] = statistics.median(
            srv.admin("thin", "list", "pool")[1] * 1e3 for _ in range(5))
        room = shm_free() - a.shm_reserve
        keep = max(2, int(room // mapped) - 1)
        rec["keep"] = keep if keep < a.snapshots else None
        n_snap, every, warm = a.snapshots, a.snapshot_every, a.snapshot_warmup
        duration = max(a.snapshot_runtime, warm + n_snap * every + 2)
        rec["fio_runtime_s"] = duration
        log = os.path.join(d, "iops")
        cmd = fio_cmd(srv.uri, "randwrite", "4k", a.iodepth, runtime=duration,
                      extra=[f"--write_iops_log={log}", "--log_avg_msec=100", "--log_unix_epoch=1"])
        rec["fio_cmd"] = cmd
        p = spawn(cmd, load=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, text=True)
        # Pipes drained by threads: fio's stderr can fill with errors while we are busy.
        got = {}
        readers = [threading.Thread(target=lambda k=k, s=s: got.__setitem__(k, s.read()), daemon=True)
                   for k, s in (("out", p.stdout), ("err", p.stderr))]
        for r in readers:
            r.start()
        # The schedule starts once fio is connected (its start-up takes a while).
        deadline = time.monotonic() + 60
        while p.poll() is None and time.monotonic() < deadline and not srv.connections():
            time.sleep(0.02)
        start = time.time()
        snaps, deletes, alive = [], [], []
        for i in range(n_snap):
            target = start + warm + i * every
            while time.time() < target and p.poll() is None:
                time.sleep(min(0.005, max(0.0, target - time.time())))
            if p.poll() is not None:
                rec["snapshots_stopped"] = f"fio ended after {i} snapshots"
                break
            at = time.time()
            try:
                text, wall = srv.admin("thin", "snapshot", "pool", "vm", f"s{i}", timeout=60)
            except Failed as e:
                snaps.append({"name": f"s{i}", "at": at, "error": str(e)})
                rec["snapshots_stopped"] = f"snapshot s{i} failed: {e}"
                break
            # "(writes held for N us, M us in all)", or "(writes to 'vm' held for N us)".
            m = re.search(r"held for (\d+) us(?:, (\d+) us in all)?", text)
            # Builds that say what the hold went on: "held for N us: D us for the writes
            # in flight, C us to copy the table, M us to commit".
            parts = re.search(r"held for \d+ us: (\d+) us for the writes in flight, "
                              r"(\d+) us to copy the table, (\d+) us to commit", text)
            snaps.append({"name": f"s{i}", "at": at, "end": at + wall, "wall_s": wall,
                          "held_us": int(m[1]) if m else None,
                          "all_us": int(m[2]) if m and m[2] else None,
                          "parts_us": [int(x) for x in parts.groups()] if parts else None,
                          "out": text.strip()})
            alive.append(f"s{i}")
            if rec["keep"] and len(alive) > rec["keep"]:
                old = alive.pop(0)
                try:
                    _, wall = srv.admin("thin", "delete", "pool", old, timeout=60)
                    deletes.append({"name": old, "wall_s": wall})
                except Failed as e:
                    deletes.append({"name": old, "error": str(e)})
        rec["snapshots"], rec["deletes"] = snaps, deletes
        try:
            p.wait(timeout=max(5.0, start + duration + 60 - time.time()))
        except subprocess.TimeoutExpired:
            killgroup(p)
            p.wait()
            rec["fio_error"] = (f"fio still running {duration + 60:.0f} s after it started "
                                "(requests never answered?): killed")
        for r in readers:
            r.join(30)
        reap(p)
        guard = GUARD_KILLED.pop(p.pid, None)
        if guard:
            rec["fio_error"] = f"killed by the watchdog: {guard}"
        elif p.returncode != 0 and "fio_error" not in rec:
            rec["fio_error"] = f"fio failed (exit status {p.returncode}){tail(got.get('err'))}"
        try:
            rec["fio"] = nbd.parse_fio(got.get("out", ""))
            rec["iops"] = summary(rec["fio"])["iops"]
        except (ValueError, KeyError, IndexError):
            rec["iops"] = None
        logs = sorted(glob.glob(f"{log}_iops*.log"))
        rec["timeline"] = timeline(logs[0], snaps) if logs else None
        time.sleep(1.2)
        rec["rss_after_kib"] = srv.rss_kib()
        try:
            rec["pool_after"] = srv.pool()
        except Failed as e:
            rec["pool_after"] = {"error": str(e)}
    finally:
        rec["serve_exit_status"] = srv.stop()
        shutil.rmtree(d, ignore_errors=True)
    return rec


def snap_summary(rec):
    snaps = [s for s in rec["snapshots"] if "end" in s]
    tl = rec.get("timeline") or {}
    after = tl.get("after") or []
    ms = tl.get("median_second")
    s = {"requested": len(rec["snapshots"]), "taken": len(snaps),
         "failed_snapshot": next((x["error"] for x in rec["snapshots"] if "error" in x), None),
         "wall_ms": [x["wall_s"] * 1e3 for x in snaps],
         "held_ms": [x["held_us"] / 1e3 for x in snaps if x["held_us"] is not None],
         "all_ms": [x["all_us"] / 1e3 for x in snaps if x["all_us"] is not None],
         "drain_ms": [x["parts_us"][0] / 1e3 for x in snaps if x.get("parts_us")],
         "copy_ms": [x["parts_us"][1] / 1e3 for x in snaps if x.get("parts_us")],
         "commit_ms": [x["parts_us"][2] / 1e3 for x in snaps if x.get("parts_us")],
         "delete_ms": [x["wall_s"] * 1e3 for x in rec["deletes"] if "wall_s" in x],
         "admin_floor_ms": rec.get("admin_floor_ms"),
         "keep": rec.get("keep"), "iops": rec.get("iops"), "median_second": ms,
         "before_first": tl.get("before_first"),
         "after_median": statistics.median(after) if after else None,
         "after_min": min(after) if after else None,
         "after_ratio": statistics.median(after) / ms if after and ms else None,
         "lowest_100ms": min(tl.get("lowest_100ms_after") or [None]) if tl.get("lowest_100ms_after") else None,
         "seconds": tl.get("seconds") or [], "marks": tl.get("snapshots_per_second") or [],
         "rss_filled_kib": rec.get("rss_filled_kib"), "rss_after_kib": rec.get("rss_after_kib"),
         "used_after": (rec.get("pool_after") or {}).get("used_bytes"),
         "fio_error": rec.get("fio_error"), "serve_exit_status": rec.get("serve_exit_status"),
         "stopped": rec.get("snapshots_stopped")}
    return s


def snap_describe(s):
    held = f"held median {statistics.median(s['held_ms']):.2f} ms, max {max(s['held_ms']):.2f} ms" \
        if s["held_ms"] else "no snapshot"
    io = fmt_iops(s["iops"]) + " IOPS" if s["iops"] is not None else "fio gave no result"
    return f"{s['taken']} snapshots, {held}; {io}" + (f"; fio: {s['fio_error'][:200]}" if s["fio_error"] else "")


def pooled(rs, key):
    return [v for r in good(rs) for v in r[key]]


def mm(v, fmt="{:.2f}"):
    return f"{fmt.format(statistics.median(v))} / {fmt.format(max(v))}" if v else "-"


def snap_tables(a, res, blocks, timeline_table=True):
    rows1, rows2, notes = [], [], []
    for b in blocks:
        rs = res[b]
        ok = good(rs)
        held = pooled(rs, "held_ms")
        taken = sum(r["taken"] for r in ok)
        want = len(rs) * a.snapshots
        keep = {r["keep"] for r in ok if r["keep"]}
        dels = pooled(rs, "delete_ms")
        met = "-" if not held else ("yes" if max(held) < 10 else
                                    ("median only" if statistics.median(held) < 10 else "NO"))
        rows1.append(f"| {b} | {taken} of {want} | {mm(pooled(rs, 'wall_ms'))} | "
                     f"{cell(med(rs, 'admin_floor_ms'), lambda v: f'{v:.2f}')} | {mm(held)} | "
                     f"{mm(pooled(rs, 'all_ms'))} | < 10 ms | {met} | "
                     + (f"{len(dels)}, {mm(dels)} ms (at most {min(keep)} kept)" if keep else "none")
                     + " |")
        drain = pooled(rs, "drain_ms")
        if drain:
            notes.append(f"- {b}: writes held (median / max ms) for the writes in flight {mm(drain)}, "
                         f"to copy the table {mm(pooled(rs, 'copy_ms'))}, to commit "
                         f"{mm(pooled(rs, 'commit_ms'))}")
        per = [r["after_ratio"] for r in ok if r["after_ratio"] is not None]
        rss_f, rss_a = med(rs, "rss_filled_kib"), med(rs, "rss_after_kib")
        used = med(rs, "used_after")
        rows2.append(f"| {b} | {cell(med(rs, 'iops'))} | {cell(med(rs, 'before_first'))} | "
                     f"{cell(med(rs, 'median_second'))} | {cell(med(rs, 'after_median'))} "
                     f"(min {cell(min((r['after_min'] for r in ok if r['after_min'] is not None), default=None))}) | "
                     f"{spread(per)} | "
                     f"{cell(min((r['lowest_100ms'] for r in ok if r['lowest_100ms'] is not None), default=None))} | "
                     f"{cell(rss_f, lambda v: f'{v / 1024:.0f}')} / {cell(rss_a, lambda v: f'{v / 1024:.0f}')} | "
                     f"{cell(used, mib)} |")
        for i, r in enumerate(rs):
            why = r.get("error") or r.get("fio_error") or r.get("failed_snapshot") or r.get("stopped")
            if why:
                notes.append(f"- {b} round {i + 1}: {why[:600]}")
            st = r.get("serve_exit_status")
            if st not in (None, 0):
                notes.append(f"- {b} round {i + 1}: cairn serve exited with status {st} after SIGTERM "
                             "(not a clean stop)")
    out(f"## snapshots while fio writes: 4 KiB randwrite, iodepth {a.iodepth}, over a volume of "
        f"{mib(a.snap_mapped)} written sequentially first; {a.snapshots} snapshots one every "
        f"{a.snapshot_every} s from second {a.snapshot_warmup:g}; {a.rounds} round(s)\n",
        "Snapshot commands, all rounds pooled (median / max, ms):\n",
        "| block | taken | `cairn admin` wall clock | `cairn admin thin list` alone, before the load "
        "(median) | writes held | in all | target (held) | met | deleted |",
        "|---|---|---|---|---|---|---|---|---|", *rows1, "",
        "Writes around snapshots (IOPS; medians over rounds):\n",
        "| block | fio IOPS | IOPS before the first snapshot | median second of the run | "
        "second after a snapshot: median (min) | that / median second (spread over rounds) | "
        "lowest 100 ms after a snapshot | serve VmRSS MiB filled / after | data in use after |",
        "|---|---|---|---|---|---|---|---|---|", *rows2, "")
    if timeline_table:
        for b in blocks:
            ok = [r for r in res[b] if "error" not in r and r["seconds"]]
            if not ok:
                continue
            n = max(len(r["seconds"]) for r in ok)
            out(f"IOPS per second, block {b} (snapshots started in that second, of the first round):\n",
                "| second | snapshots | " + " | ".join(f"round {i + 1}" for i in range(len(ok))) + " |",
                "|---|---|" + "---|" * len(ok))
            for k in range(n):
                marks = ok[0]["marks"][k] if k < len(ok[0]["marks"]) else 0
                out(f"| {k} | {marks or ''} | " + " | ".join(
                    iops(r["seconds"][k]) if k < len(r["seconds"]) else "" for r in ok) + " |")
            out("")
    if notes:
        out("Notes:\n", *notes, "")
    return rows1, rows2


def snapshot_part(a, blocks):
    res = rounds("snapshot" if len(blocks) == 1 else "blocks-snapshot",
                 [(b, lambda b=b: snapshot_run(a, b)) for b in blocks], a.rounds,
                 snap_summary, snap_describe)
    return res


# ---------------------------------------------------------------- part: qcow2

def qcow2_run(a, kind):
    d = fresh(f"qcow2-{kind}")
    size = a.fill
    rec = {"server": kind, "size": size}
    if kind == "cairn":
        srv = Cairn(d, write_stack(d, a.block, size))
    else:
        srv = Qsd(d, size)
    try:
        srv.start()
        rec["ready_s"] = srv.ready_s
        rec["fill_s"] = fio_fill(srv.uri, size, f"{kind}: fill {size_str(size)}")
        if kind == "cairn":
            text, rec["snapshot_s"] = srv.admin("thin", "snapshot", "pool", "vm", "s0")
            rec["snapshot_out"] = text.strip()
        else:
            _, rec["snapshot_s"] = srv.qmp("blockdev-snapshot-internal-sync",
                                           {"device": "q0", "name": "s0"})
        rec["rss_kib"] = srv.rss_kib()
        for rw in ("randwrite", "randread"):
            try:
                rec[rw] = measured_fio(srv, rw, a.runtime, a.iodepth, f"fio {rw} against {kind}")
            except Failed as e:
                rec[rw] = {"error": str(e)}
    finally:
        rec["exit_status"] = srv.stop()
        shutil.rmtree(d, ignore_errors=True)
    return rec


def qcow2_summary(rec):
    s = {"snapshot_ms": rec["snapshot_s"] * 1e3, "fill_s": rec["fill_s"],
         "exit_status": rec.get("exit_status")}
    for rw in ("randwrite", "randread"):
        j = rec[rw]
        if "error" in j:
            s[rw] = {"error": j["error"]}
            continue
        x = summary(j)
        x["cpu_per_100k"] = j["server"]["cpu_s"] * 1e5 / max(x["ios"], 1)
        s[rw] = x
    return s


def qcow2_part(a):
    servers = ["cairn", "qsd"]
    res = rounds("qcow2", [(k, lambda k=k: qcow2_run(a, k)) for k in servers], a.rounds,
                 qcow2_summary, lambda s: ", ".join(
                     f"{rw} {fmt_iops(s[rw]['iops']) if 'error' not in s[rw] else 'FAILED'}"
                     for rw in ("randwrite", "randread")))
    out(f"## cairn thin volume against qemu-storage-daemon qcow2, both over NBD from /dev/shm: "
        f"{mib(a.fill)} filled, one internal snapshot, then fio 4 KiB iodepth {a.iodepth}, "
        f"{a.runtime} s\n")
    notes = []
    for rw in ("randwrite", "randread"):
        per = {k: [r[rw] if "error" not in r else r for r in res[k]] for k in servers}
        iops_r = ratios(per["cairn"], per["qsd"])
        cpu_r = ratios(per["cairn"], per["qsd"], "cpu_per_100k")
        met = "-" if not iops_r else ("yes" if statistics.median(iops_r) >= 2 else "NO")
        out(f"{rw}:\n", "| server | IOPS | cairn / qsd (spread) | lat mean µs | clat p99 µs | "
            "server CPU s / 100k | cairn / qsd CPU (spread) | snapshot ms | fill s | target | met |",
            "|---|---|---|---|---|---|---|---|---|---|---|")
        for k in servers:
            rs = per[k]
            out(f"| {k} | {cell(med(rs, 'iops'))} | {spread(iops_r) if k == 'cairn' else ''} | "
                f"{cell(med(rs, 'lat_mean_ns'), lambda v: f'{v / 1e3:.1f}')} | "
                f"{cell(med(rs, 'clat_p99_ns'), lambda v: f'{v / 1e3:.1f}')} | "
                f"{cell(med(rs, 'cpu_per_100k'), lambda v: f'{v:.2f}')} | "
                f"{spread(cpu_r) if k == 'cairn' else ''} | "
                f"{cell(med(res[k], 'snapshot_ms'), lambda v: f'{v:.1f}')} | "
                f"{cell(med(res[k], 'fill_s'), lambda v: f'{v:.1f}')} | "
                f"{'>= 2x' if k == 'cairn' else ''} | {met if k == 'cairn' else ''} |")
            notes += failures({f"{k} {rw}": rs})
        out("")
    for k in servers:
        for i, r in enumerate(res[k]):
            if r.get("exit_status") not in (None, 0):
                notes.append(f"- {k} round {i + 1}: exited with status {r['exit_status']} after SIGTERM")
    if notes:
        out("Failed runs:\n", *dict.fromkeys(notes), "")


# ---------------------------------------------------------------- part: metadata

CHECK_RE = [r"checkpoint \d+ \(\d+ pages\) valid", r"log: \d+ records in \d+ blocks replayed",
            r"check: [^;]+", r"not stopped cleanly[^;]*"]


def check_says(text):
    found = [m.group(0) for pat in CHECK_RE for m in [re.search(pat, text)] if m]
    return "; ".join(found) if found else text.strip()[-300:]


def cairn_check(stack):
    """cairn check STACK: (seconds, exit status, stdout + stderr)."""
    t0 = time.monotonic()
    r = subprocess.run([CAIRN, "check", "--log-level", "warn", stack], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=600)
    return time.monotonic() - t0, r.returncode, r.stdout + r.stderr


def meta_run(a, kind, size):
    d = fresh(f"meta-{kind}")
    stack = write_stack(d, a.block, size)
    rec = {"fill": kind, "size": size, "block": a.block}
    srv = Cairn(d, stack)
    try:
        srv.start()
        if kind == "sequential":
            rec["fill_s"] = fio_fill(srv.uri, size, f"sequential fill of {size_str(size)}")
        else:
            w = nbd_writer(f"random fill of {size_str(size)}", size / (4 * MiB) + 600,
                           uri=srv.uri, depth=a.setup_iodepth, block=parse_size(a.block))
            rec["writer"] = w
            rec["fill_s"] = w.get("fill_s")
        time.sleep(1.5)  # a commit period
        rec["live"] = srv.pool()
        rec["rss_kib"] = srv.rss_kib()
        rec["stop_status"] = srv.stop()
        rec["check_s"], rec["check_status"], text = cairn_check(stack)
        rec["check_out"] = text
        srv2 = Cairn(d, stack)
        try:
            srv2.start()
            rec["reopen_ready_s"] = srv2.ready_s
            rec["reopened"] = srv2.pool()
        finally:
            rec["stop_status_2"] = srv2.stop()
    finally:
        srv.kill9()
        shutil.rmtree(d, ignore_errors=True)
    return rec


def metadata_part(a):
    seq = a.meta_seq
    room = shm_free() - a.shm_reserve - GiB
    while seq > room and seq > GiB:
        seq //= 2
    if seq != a.meta_seq:
        print(f"  metadata: /dev/shm holds {mib(max(room, 0))} spare: sequential fill {mib(seq)} "
              f"in place of {mib(a.meta_seq)}", file=sys.stderr)
    rows, notes = [], []
    for kind, size in (("sequential", seq), ("random", a.meta_rand)):
        try:
            rec = meta_run(a, kind, size)
        except Failed as e:
            rec = {"error": str(e)}
            print(f"  metadata: {kind} FAILED: {e}", file=sys.stderr)
        save(f"metadata-{kind}", rec)
        if "error" in rec:
            rows.append(f"| {kind} | {mib(size)} | failed | | | | | | |")
            notes.append(f"- {kind}: {rec['error'][:600]}")
            continue
        live, again = rec["live"]["metadata"], rec["reopened"]["metadata"]
        mapped = sum(v["mapped_bytes"] for v in rec["reopened"]["volumes"])
        live_mapped = sum(v["mapped_bytes"] for v in rec["live"]["volumes"])
        live_b = live["checkpoint_bytes"] + live["log_used_bytes"]
        per_tib = again["checkpoint_bytes"] / mapped * TiB if mapped else None
        rows.append(f"| {kind} | {mib(mapped)} ({mib(live_mapped)} live) | "
                    f"{mib(live['checkpoint_bytes'])} + {mib(live['log_used_bytes'])} | "
                    f"{cell(live_b / live_mapped * TiB if live_mapped else None, mib)} | "
                    f"{mib(again['checkpoint_bytes'])} | {cell(per_tib, mib)} | "
                    f"{mib(again['checkpoint_capacity_bytes'])} + log {mib(again['log_bytes'])} | "
                    f"{rec['check_s'] * 1e3:.0f} ms, exit {rec['check_status']}: {check_says(rec['check_out'])} | "
                    f"{rec['stop_status']} |")
        if rec["check_status"] != 0:
            notes.append(f"- {kind}: cairn check exited {rec['check_status']}: {rec['check_out'][-800:]}")
        if rec["stop_status"] != 0:
            notes.append(f"- {kind}: cairn serve exited with status {rec['stop_status']} after SIGTERM "
                         "(not a clean stop: what check and the reopened pool show is a recovery)")
    out(f"## metadata per TiB mapped, block {a.block}\n",
        "| fill | mapped | live: checkpoint + log used | live, per TiB mapped | reopened: checkpoint | "
        "reopened, per TiB mapped | room: checkpoint area + log | cairn check after SIGTERM | "
        "serve exit status |",
        "|---|---|---|---|---|---|---|---|---|", *rows, "")
    if notes:
        out("Notes:\n", *notes, "")


# ---------------------------------------------------------------- part: check

def check_part(a):
    d = fresh("check")
    size = a.check_mapped
    stack = write_stack(d, a.block, size)
    rec = {"mapped": size, "block": a.block, "snapshots": a.check_snapshots,
           "writes_after": a.check_writes}
    srv = Cairn(d, stack)
    try:
        try:
            srv.start()
            rec["serve_ready_new_s"] = srv.ready_s
            rec["writer"] = nbd_writer(
                "random fill, then snapshots each followed by random writes", 3600,
                uri=srv.uri, depth=a.setup_iodepth, block=parse_size(a.block),
                snapshots=a.check_snapshots, writes_after=a.check_writes // 4096,
                snapshot_cmd=srv.admin_cmd("thin", "snapshot", "pool", "vm"))
            time.sleep(1.5)
            rec["pool"] = srv.pool()
            rec["rss_kib"] = srv.rss_kib()
            rec["kill9_status"] = srv.kill9()
            states = []
            for state in ("after kill -9 (log replayed)", "after SIGTERM"):
                runs = [cairn_check(stack) for _ in range(a.check_runs)]
                st = {"state": state, "times_s": [r[0] for r in runs],
                      "status": [r[1] for r in runs], "out": runs[0][2]}
                srv2 = Cairn(d, stack)
                try:
                    srv2.start()
                    st["serve_ready_s"] = srv2.ready_s
                    st["pool_on_open"] = srv2.pool()
                finally:
                    st["stop_status"] = srv2.stop()
                states.append(st)
            rec["states"] = states
        except Failed as e:
            rec["error"] = str(e)
            print(f"  check: FAILED: {e}", file=sys.stderr)
    finally:
        srv.kill9()
        shutil.rmtree(d, ignore_errors=True)
    save("check", rec)
    pool = rec.get("pool") or {}
    out(f"## cairn check on a pool: a {mib(size)} volume mapped by one 4 KiB write per {a.block} block "
        f"in random order, then {a.check_snapshots} snapshots each followed by "
        f"{a.check_writes // 1024} KiB of random 4 KiB writes\n")
    if pool:
        md = pool["metadata"]
        out(f"Pool: {len(pool['volumes'])} volumes, {mib(pool['used_bytes'])} of data in use; metadata: "
            f"checkpoint {mib(md['checkpoint_bytes'])}, log {mib(md['log_used_bytes'])} used; "
            f"cairn serve VmRSS {rec['rss_kib'] / 1024:.0f} MiB.\n")
    if "error" in rec:
        out(f"Failed: {rec['error'][:1500]}\n")
    if rec.get("states"):
        out(f"| state | cairn check: median (min..max) of {a.check_runs} | exit status | check says | "
            "cairn serve answered after | its exit status after SIGTERM |",
            "|---|---|---|---|---|---|")
        # The state the second row's checks saw is what the first row's server left.
        for st in rec["states"]:
            ts = [t * 1e3 for t in st["times_s"]]
            out(f"| {st['state']} | {statistics.median(ts):.0f} ms ({min(ts):.0f}..{max(ts):.0f}) | "
                f"{', '.join(str(s) for s in sorted(set(st['status'])))} | {check_says(st['out'])} | "
                f"{st['serve_ready_s']:.2f} s | {st['stop_status']} |")
        out("", "The SIGTERM row's checks ran on what the server started after the kill -9 left at "
            "its stop; its stop status is in the row above.", "")
        for st in rec["states"]:
            if any(st["status"]):
                out(f"cairn check failed {st['state']}:\n", "```", st["out"][-2000:], "```", "")


# ---------------------------------------------------------------- part: blocks

def blocks_part(a):
    local_rows = {}
    for b in BLOCKS:
        local_rows[b] = local_part(a, b, with_read=False, tag="blocks")
    res = snapshot_part(a, BLOCKS)
    snap_tables(a, res, BLOCKS, timeline_table=False)
    out("## block-size study: summary\n",
        "| block | (a) randwrite unallocated: thin / file | (b) randwrite overwrite: thin / file | "
        "snapshot writes held, ms median / max | second after a snapshot / median second | "
        "serve VmRSS MiB filled / after | data in use after the snapshot run |",
        "|---|---|---|---|---|---|---|")
    for b in BLOCKS:
        rs = res[b]
        ab = [r.split(" | ")[3] for r in local_rows[b]]
        per = [r["after_ratio"] for r in good(rs) if r["after_ratio"] is not None]
        rss_f, rss_a = med(rs, "rss_filled_kib"), med(rs, "rss_after_kib")
        out(f"| {b} | {ab[0] if ab else '-'} | {ab[1] if len(ab) > 1 else '-'} | "
            f"{mm(pooled(rs, 'held_ms'))} | {spread(per)} | "
            f"{cell(rss_f, lambda v: f'{v / 1024:.0f}')} / {cell(rss_a, lambda v: f'{v / 1024:.0f}')} | "
            f"{cell(med(rs, 'used_after'), mib)} |")
    out("")


# ---------------------------------------------------------------- main

def binary_check():
    if not os.path.exists(CAIRN):
        sys.exit(f"{CAIRN} is missing: build it (cargo build --release) or set CAIRN_BIN")
    if os.environ.get("CAIRN_BIN"):
        return
    # What the binary is built from (tests are not).
    srcs = glob.glob(os.path.join(ROOT, "crates", "*", "src", "**", "*.rs"), recursive=True)
    srcs += glob.glob(os.path.join(ROOT, "crates", "*", "build.rs"))
    srcs += glob.glob(os.path.join(ROOT, "crates", "*", "Cargo.toml"))
    srcs += [os.path.join(ROOT, "Cargo.toml"), os.path.join(ROOT, "Cargo.lock")]
    newer = [p for p in srcs if os.path.exists(p) and os.path.getmtime(p) > os.path.getmtime(CAIRN)]
    if newer:
        print(f"warning: {CAIRN} is older than {len(newer)} source file(s) (e.g. "
              f"{os.path.relpath(newer[0], ROOT)}): it may not be what the tree builds "
              "(cargo build --release, or CAIRN_BIN=...)", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runtime", type=int, default=5, help="seconds per measured run")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--block", default="64K", help="the pools' block, except in the study")
    ap.add_argument("--iodepth", type=int, default=32, help="iodepth of the measured loads")
    ap.add_argument("--setup-iodepth", type=int, default=32, help="iodepth of the libnbd writers")
    ap.add_argument("--snapshots", type=int, default=None, help="snapshots per run (21)")
    ap.add_argument("--snapshot-every", type=float, default=None, help="seconds between them (0.5)")
    ap.add_argument("--snapshot-runtime", type=float, default=None, help="fio's run in the snapshot part (20)")
    ap.add_argument("--shm-reserve", type=parse_size, default=2 * GiB,
                    help="free space /dev/shm keeps: the watchdog kills a load below it (2G)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    a = ap.parse_args()
    parts = [p for p in a.parts.split(",") if p]
    for p in parts:
        if p not in PARTS:
            sys.exit(f"unknown part {p!r}; known: {', '.join(PARTS)}")
    q = a.quick
    a.fill = 256 * MiB if q else 4 * GiB
    a.snap_mapped = 256 * MiB if q else GiB
    a.snapshots = a.snapshots if a.snapshots is not None else (5 if q else 21)
    a.snapshot_every = a.snapshot_every if a.snapshot_every is not None else (0.2 if q else 0.5)
    a.snapshot_runtime = a.snapshot_runtime if a.snapshot_runtime is not None else (4 if q else 20)
    a.snapshot_warmup = 1.5 if q else 2.0
    a.meta_seq = GiB if q else 16 * GiB
    a.meta_rand = 256 * MiB if q else 4 * GiB
    a.check_mapped = 256 * MiB if q else GiB
    a.check_snapshots = 10 if q else 100
    a.check_writes = 256 * 1024 if q else MiB
    a.check_runs = 2 if q else 5

    binary_check()
    missing = [t for t in ("fio", "nbdinfo") + (("qemu-img", "qemu-storage-daemon") if "qcow2" in parts else ())
               if shutil.which(t) is None]
    if missing:
        sys.exit(f"missing: {', '.join(missing)}")
    os.makedirs(OUT, exist_ok=True)
    # Ctrl-C and SIGTERM stop the script the same way (even where SIGINT came in ignored,
    # as for a background job of a shell script).
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    WORK["dir"] = tempfile.mkdtemp(prefix="cairn-thin-bench-", dir=SHM)
    stop = threading.Event()
    guard = threading.Thread(target=watchdog, args=(a.shm_reserve, stop), daemon=True)
    guard.start()
    try:
        rev = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                             stdout=subprocess.PIPE, text=True).stdout.strip()
        fio_v = subprocess.run(["fio", "--version"], stdout=subprocess.PIPE, text=True).stdout.strip()
        out(f"# Thin pools: `bench/thin.py {' '.join(sys.argv[1:])}`\n",
            f"{a.rounds} interleaved round(s) of {a.runtime} s; cairn {rev} "
            f"({time.strftime('%Y-%m-%d %H:%M', time.localtime(os.path.getmtime(CAIRN)))} build), "
            f"{fio_v}, {os.cpu_count()} CPUs; /dev/shm {mib(shm_free())} free at the start"
            + ("; --quick sizes" if q else "") + ".\n")
        if "local" in parts:
            local_part(a, a.block)
        if "snapshot" in parts:
            snap_tables(a, snapshot_part(a, [a.block]), [a.block])
        if "qcow2" in parts:
            qcow2_part(a)
        if "metadata" in parts:
            metadata_part(a)
        if "check" in parts:
            check_part(a)
        if "blocks" in parts:
            blocks_part(a)
    except KeyboardInterrupt:
        print("interrupted: stopping what runs and removing the files", file=sys.stderr)
        sys.exit(130)
    finally:
        stop.set()
        cleanup()


if __name__ == "__main__":
    main()
