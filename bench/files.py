#!/usr/bin/env python3
"""Serving a file: cairn against nbdkit's file plugin and qemu-nbd, on every kind of file.

  bench/files.py [--kinds tmpfs,ext4,xfs,block] [--modes buffered,direct]
                 [--only WORKLOADS] [--servers NAMES] [--clients fio,cairn]
                 [--local] [--rounds N] [--runtime SECS]

Needs root (loop devices, mkfs, mount). Every kind serves one 1 GiB file of random bytes:
  tmpfs   /dev/shm/cairn-files/tmpfs.img
  ext4    a file on ext4, on a loop device (direct I/O) over an image in /dev/shm
  xfs     the same on xfs
  block   the loop device itself (direct I/O over a 1 GiB image in /dev/shm)
so the "disk" under each is memory and the servers' own costs show. Modes: buffered (the
page cache) and direct (O_DIRECT: cairn direct=1, qemu-nbd --cache=none; nbdkit 1.32's
file plugin has no O_DIRECT, so it serves buffered in both rows: it is the peer as a user
finds it).

Servers (--servers):
  cairn          cairn serve --device file:PATH[,direct=1]  (the engine cairn picks)
  cairn-uring    ... ,engine=io_uring     cairn-aio  ... ,engine=aio
  cairn-sync     ... ,engine=sync         (the explicit engines; not in the default set)
  nbdkit         nbdkit -f file PATH      (16 threads, pread/pwrite)
  qemu-uring     qemu-nbd -f raw -t --cache=writeback|none --aio=io_uring PATH
  qemu-threads   qemu-nbd -f raw -t --cache=writeback|none --aio=threads PATH
Clients: fio's nbd engine and cairn bench --device nbd:URI, one connection, over a Unix
socket, as in bench/nbd.py (which this script uses for starting, probing, CPU accounting
and stopping servers).

Workloads (--only): randread and randwrite (4 KiB, iodepth 32), seqread and seqwrite
(1 MiB, iodepth 8).

--local adds cairn bench on the file itself against fio with each of its engines there
(io_uring, libaio, psync), one job each at the workload's iodepth (psync: one request at
a time), the fastest of fio's being the peer. --local-tools picks them; cairn-coalesce-off
is cairn bench with completion coalescing off (`cairn --coalesce off bench`), its "before".

Variants run in interleaved rounds (odd rounds in reverse order, so that none always
follows another's writes still being written back); medians are reported with the ratio to the best peer,
and server CPU seconds per 100k requests against the peer with the least (in the direct
rows the peers are those doing O_DIRECT too: qemu-nbd's). Targets
>= 1.5x the best peer with cairn's client, >= 1.1x with fio's, server CPU per
request <= 0.6x the best peer's, cairn bench >= 1.0x fio's best engine. The script
reports what it measured; it asserts nothing.
"""
import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbd  # noqa: E402
from engine import CAIRN, OUT, build, compare, fmt_iops  # noqa: E402

SIZE = 1 << 30
DIR = "/dev/shm/cairn-files"
KINDS = ["tmpfs", "ext4", "xfs", "block"]
MODES = ["buffered", "direct"]
WORKLOADS = {
    "randread": ("randread", "4k", 32, "4 KiB random read, iodepth 32"),
    "randwrite": ("randwrite", "4k", 32, "4 KiB random write, iodepth 32"),
    "seqread": ("read", "1M", 8, "1 MiB sequential read, iodepth 8"),
    "seqwrite": ("write", "1M", 8, "1 MiB sequential write, iodepth 8"),
}
SERVERS = ["cairn", "cairn-uring", "cairn-aio", "cairn-sync", "nbdkit", "qemu-uring", "qemu-threads"]
DEFAULT_SERVERS = ["cairn", "nbdkit", "qemu-uring", "qemu-threads"]


def sh(*cmd):
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout.strip()


def random_file(path, size=SIZE, direct=False):
    """Writes `size` random bytes to `path` (through dd, with O_DIRECT for a device)."""
    src = os.path.join(DIR, "random.src")
    if not os.path.exists(src):
        with open(src, "wb") as f:
            for _ in range(SIZE >> 20):
                f.write(os.urandom(1 << 20))
    flags = ["oflag=direct"] if direct else []
    subprocess.run(["dd", f"if={src}", f"of={path}", "bs=1M", f"count={size >> 20}",
                    "conv=notrunc", *flags, "status=none"], check=True)
    if not direct:
        subprocess.run(["sync", path], check=True)


class Kinds:
    """The files to serve, one per kind, and what was made to hold them."""

    def __init__(self, kinds):
        self.paths = {}
        self.loops = []
        self.mounts = []
        os.makedirs(DIR, exist_ok=True)
        for k in kinds:
            print(f"preparing {k}", file=sys.stderr)
            if k == "tmpfs":
                path = os.path.join(DIR, "tmpfs.img")
                random_file(path)
            elif k == "block":
                img = os.path.join(DIR, "block.img")
                subprocess.run(["truncate", "-s", str(SIZE), img], check=True)
                path = self.loop(img)
                random_file(path, direct=True)
            else:
                img = os.path.join(DIR, f"{k}.fs")
                subprocess.run(["truncate", "-s", str(SIZE + (512 << 20)), img], check=True)
                dev = self.loop(img)
                # ext4 initialises its inode tables and journal lazily, in a kernel thread that
                # writes for minutes after the mount: every server measured then shares the
                # device with it. Initialised at mkfs, nothing writes but the servers.
                mkfs = (["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"]
                        if k == "ext4" else ["mkfs.xfs", "-q", "-f"])
                subprocess.run([*mkfs, dev], check=True)
                mnt = tempfile.mkdtemp(prefix=f"cairn-{k}-")
                subprocess.run(["mount", dev, mnt], check=True)
                self.mounts.append(mnt)
                path = os.path.join(mnt, "disk.img")
                random_file(path)
            self.paths[k] = path

    def loop(self, img):
        dev = sh("losetup", "--direct-io=on", "-f", "--show", img)
        self.loops.append(dev)
        return dev

    def close(self):
        for m in self.mounts:
            subprocess.run(["umount", m])
            os.rmdir(m)
        for d in self.loops:
            subprocess.run(["losetup", "-d", d])
        shutil.rmtree(DIR, ignore_errors=True)


class FileServer(nbd.Server):
    def __init__(self, name, path, direct, cairn_args):
        super().__init__(name, cairn_args)
        self.memory = False
        self.path = path
        self.direct = direct

    def unpinned_command(self):
        s, p = self.sock, self.path
        if self.name.startswith("cairn"):
            spec = f"file:{p}"
            if self.name != "cairn" and "~" not in self.name:
                spec += ",engine=" + {"cairn-uring": "io_uring", "cairn-aio": "aio",
                                      "cairn-sync": "sync"}[self.name]
            if self.direct:
                spec += ",direct=1"
            return [CAIRN, *self.cairn_args, "serve", "--listen", f"unix:{s}", "--device", spec]
        if self.name == "nbdkit":
            return ["nbdkit", "-U", s, "-f", "file", p]
        if self.name.startswith("qemu-"):
            aio = {"qemu-uring": "io_uring", "qemu-threads": "threads"}[self.name]
            cache = "none" if self.direct else "writeback"
            return ["qemu-nbd", "-k", s, "-f", "raw", "-t", f"--cache={cache}", f"--aio={aio}", p]
        raise ValueError(self.name)


def threads(pid):
    """(io-wq workers alive, context switches of every thread alive) of process `pid`."""
    workers = switches = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                workers += f.read().startswith("iou-wrk")
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        switches += int(line.split()[1])
        except OSError:
            pass
    return workers, switches


def serve_run(server, client, workload, path, direct, runtime, cairn_args):
    rw, bs, depth, _ = WORKLOADS[workload]
    srv = FileServer(server, path, direct, cairn_args)
    # cairn~K=V:K=V: an experiment's submission settings (CAIRN_EXP_SUBMIT).
    exp = server.partition("~")[2].replace(":", ",")
    try:
        if exp:
            os.environ["CAIRN_EXP_SUBMIT"] = exp
        try:
            srv.start()
        finally:
            os.environ.pop("CAIRN_EXP_SUBMIT", None)
        cmd = nbd.client_command(client, srv.uri, rw, bs, depth, runtime)
        before = srv.cpu_ticks()
        _, sw0 = threads(srv.pid)
        wall0 = time.monotonic()
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wall = time.monotonic() - wall0
        workers, sw1 = threads(srv.pid)
        after = srv.cpu_ticks()
        if r.returncode != 0:
            sys.exit(f"{client} against {server} failed ({r.returncode}):\n{r.stderr}\n{r.stdout[-2000:]}")
        j = nbd.parse_fio(r.stdout)
    finally:
        status = srv.stop()
    j["client"] = {"name": client, "cmd": cmd}
    j["server"] = {"name": server, "cmd": srv.cmd, "cpu_s": (after - before) / nbd.CLK_TCK,
                   "fio_wall_s": wall, "fill_s": 0, "exit_status": status,
                   "io_workers": workers, "switches": sw1 - sw0}
    return j


def serve_summary(j):
    out = nbd.summary(j)
    srv = j["server"]
    out["io_workers"] = srv.get("io_workers", 0)
    out["switches_per_req"] = srv.get("switches", 0) / max(out["ios"], 1)
    return out


# --local tools that are cairn bench, with their global flags.
LOCAL_CAIRN = {"cairn": [], "cairn-coalesce-off": ["--coalesce", "off"]}
LOCAL_TOOLS = [*LOCAL_CAIRN, "fio-io_uring", "fio-libaio", "fio-psync"]


def local_run(tool, workload, path, direct, runtime):
    """cairn bench or fio with one engine on the file itself; CPU is the tool's own."""
    rw, bs, depth, _ = WORKLOADS[workload]
    if tool in LOCAL_CAIRN:
        spec = f"file:{path}" + (",direct=1" if direct else "")
        cmd = [CAIRN, *LOCAL_CAIRN[tool], "bench", "--log-level", "warn", "--device", spec, f"--rw={rw}",
               f"--bs={bs}", f"--iodepth={depth}", "--numjobs=1", f"--runtime={runtime}s",
               "--time_based", "--output-format=json"]
    else:
        engine = tool.removeprefix("fio-")
        # psync has one request in flight per job whatever the iodepth.
        jobs = ["--numjobs=1", f"--iodepth={depth}"]
        cmd = ["fio", "--name=local", f"--ioengine={engine}", f"--filename={path}",
               f"--size={SIZE}", f"--rw={rw}", f"--bs={bs}", *jobs, f"--direct={int(direct)}",
               f"--runtime={runtime}", "--time_based", "--norandommap", "--randrepeat=0",
               # fio drops the file's cached pages before a job by default; cairn reads
               # what the page cache holds, as every server here does.
               "--invalidate=0", "--group_reporting", "--output-format=json"]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(f"{shlex.join(cmd)} failed ({r.returncode}):\n{r.stderr}")
    j = nbd.parse_fio(r.stdout)
    j["cmd"] = cmd
    return j


def local_summary(j):
    job = j["jobs"][0]
    d = job["write"] if job["write"]["total_ios"] else job["read"]
    ios = job["read"]["total_ios"] + job["write"]["total_ios"]
    runtime_s = max(job["job_runtime"], 1) / 1000
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * runtime_s
    return {"iops": d["iops"], "bw": d["bw_bytes"], "cpu_per_100k": cpu * 1e5 / max(ios, 1)}


def med(rs, key):
    return nbd.med(rs, key)


def key_of(workload):
    return "bw" if WORKLOADS[workload][0] in ("read", "write") else "iops"


def cell(workload, v):
    return f"{v / 1e6:.0f} MB/s" if key_of(workload) == "bw" else fmt_iops(v)


def serve_table(kind, mode, w, res, servers, clients):
    title = WORKLOADS[w][3]
    key = key_of(w)
    # With direct I/O the peers that do O_DIRECT too (nbdkit's row is buffered).
    peers = [s for s in servers if not s.startswith("cairn") and not (mode == "direct" and s == "nbdkit")]
    lines = [f"{kind}, {mode}, {title}:", "",
             "| server | " + " | ".join(f"{c} | vs best peer | server CPU s / 100k | switches / req"
                                     for c in clients) + " | io-wq workers |",
             "|---|" + "---|---|---|---|" * len(clients) + "---|"]
    best = {}
    for c in clients:
        if peers:
            b = max(peers, key=lambda s: med(res[f"{s} {c}"], key))
            cb = min(peers, key=lambda s: med(res[f"{s} {c}"], "cpu_per_100k"))
            best[c] = (b, med(res[f"{b} {c}"], key), cb, med(res[f"{cb} {c}"], "cpu_per_100k"))
    for s in servers:
        cells = []
        for c in clients:
            rs = res[f"{s} {c}"]
            v = med(rs, key)
            ratio = f"{v / best[c][1]:.2f}x" if c in best else "-"
            cells.append(f"{cell(w, v)} | {ratio} | {med(rs, 'cpu_per_100k'):.2f} | "
                         f"{med(rs, 'switches_per_req'):.2f}")
        workers = max(r["io_workers"] for c in clients for r in res[f"{s} {c}"])
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {workers} |")
    lines.append("")
    for c in clients:
        if c in best and "cairn" in servers:
            b, bv, cb, cbv = best[c]
            v = med(res[f"cairn {c}"], key)
            cpu = med(res[f"cairn {c}"], "cpu_per_100k")
            # Each round's ratio against that round's figure of the same peer.
            rounds = [a[key] / max(p[key], 1e-9) for a, p in zip(res[f"cairn {c}"], res[f"{b} {c}"])]
            lines.append(f"client {c}: cairn / best peer ({b}) = {v / bv:.2f}x (rounds "
                         f"{min(rounds):.2f}..{max(rounds):.2f}); server CPU per request / least "
                         f"peer's ({cb}) = {cpu / max(cbv, 1e-9):.2f}x  ")
    lines.append("")
    return lines


def local_table(kind, mode, w, res, tools):
    key = key_of(w)
    fios = [t for t in tools if t.startswith("fio-")]
    best = max(fios, key=lambda t: med(res[t], key))
    lines = [f"{kind}, {mode}, {WORKLOADS[w][3]}, on the file itself:", "",
             "| tool | result | vs fio's best | CPU s / 100k |", "|---|---|---|---|"]
    for t in tools:
        v = med(res[t], key)
        lines.append(f"| {t} | {cell(w, v)} | {v / med(res[best], key):.2f}x | "
                     f"{med(res[t], 'cpu_per_100k'):.2f} |")
    lines.append("")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--only", default=",".join(WORKLOADS))
    ap.add_argument("--servers", default=",".join(DEFAULT_SERVERS), help=f"known: {', '.join(SERVERS)}")
    ap.add_argument("--clients", default="fio,cairn")
    ap.add_argument("--local", action="store_true", help="also cairn bench against fio on the file")
    ap.add_argument("--no-serve", action="store_true", help="only the --local comparison")
    ap.add_argument("--local-tools", default="cairn,fio-io_uring,fio-libaio,fio-psync",
                    help=f"known: {', '.join(LOCAL_TOOLS)}")
    ap.add_argument("--runtime", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cairn-args", default="")
    ap.add_argument("--no-build", action="store_true")
    args = ap.parse_args()
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    kinds, modes, only = split(args.kinds), split(args.modes), split(args.only)
    servers, clients = split(args.servers), split(args.clients)
    for name, got, known in [("kind", kinds, KINDS), ("mode", modes, MODES),
                             ("workload", only, WORKLOADS), ("server", servers, SERVERS),
                             ("client", clients, ["fio", "cairn"]),
                             ("local tool", split(args.local_tools), LOCAL_TOOLS)]:
        for g in got:
            if g not in known and not (name == "server" and g.startswith("cairn~")):
                sys.exit(f"unknown {name} {g!r}; known: {', '.join(known)}")
    if os.geteuid() != 0:
        sys.exit("bench/files.py needs root (loop devices, mkfs, mount)")
    if not args.no_build:
        build()
    os.makedirs(OUT, exist_ok=True)
    cairn_args = shlex.split(args.cairn_args)
    t, n = args.runtime, args.rounds
    made = Kinds(kinds)
    out = [f"Median of {n} interleaved rounds of {t} s each (`bench/files.py --kinds {args.kinds} "
           f"--modes {args.modes} --only {args.only} --servers {args.servers} --clients {args.clients}"
           + (f" --local --local-tools {args.local_tools}" if args.local else "")
           + f" --rounds {n} --runtime {t}`); "
           f"{sh('fio', '--version')}, {sh('nbdkit', '--version')}, "
           f"{sh('qemu-nbd', '--version').splitlines()[0]}; {os.cpu_count()} CPUs.", ""]
    try:
        for k in kinds:
            path = made.paths[k]
            for m in modes:
                direct = m == "direct"
                for w in only:
                    if not args.no_serve:
                        variants = [(f"{s} {c}", lambda s=s, c=c, w=w: serve_run(
                            s, c, w, path, direct, t, cairn_args))
                            for s in servers for c in clients]
                        res = compare(f"{k}-{m}-{w}", variants, n, summarize=serve_summary,
                                      prefix="files", alternate=True)
                        out += serve_table(k, m, w, res, servers, clients)
                    if args.local:
                        tools = split(args.local_tools)
                        variants = [(tl, lambda tl=tl, w=w: local_run(tl, w, path, direct, t))
                                    for tl in tools]
                        res = compare(f"{k}-{m}-{w}-local", variants, n,
                                      summarize=local_summary, prefix="files", alternate=True)
                        out += local_table(k, m, w, res, tools)
                    print("\n".join(out), file=sys.stderr)
    finally:
        made.close()
    print("\n".join(out))


if __name__ == "__main__":
    main()
