#!/usr/bin/env python3
"""Ceph RBD images: cairn against fio's rbd engine and qemu-storage-daemon.

  bench/rbd.py [--rounds N] [--runtime SECS] [--parts local,serve,cache,rss,connection]
               [--keep DIR]

Needs root and Ceph's packages (ceph-mon, ceph-osd, ceph-common; scripts/ceph-cluster
starts a one-monitor, one-OSD cluster in /dev/shm/cairn-rbd-bench and stops it at the
end). The image `rbd/bench` (1 GiB) is filled with `rbd bench` once, before anything is
measured, so reads hit written objects. Every run uses that image, one at a time.

Parts (--parts):
  local       4 KiB randread and randwrite at iodepth 32 on the image:
                cairn        cairn bench --device rbd:rbd/bench,conf=C
                fio          fio --ioengine=rbd with librbd's cache off, as cairn runs it:
                             a write completes once the OSDs hold it
                fio-default  fio --ioengine=rbd as installed: librbd 16's default cache
                             policy (writearound) acknowledges a write before the OSDs
                             hold it; shown for reference, not a peer for durable writes
              Target: cairn >= 1.0x fio (same librbd, same durability).
  serve       the image served over NBD (a Unix socket, one connection), 4 KiB randread
              and randwrite at iodepth 32 with cairn's NBD client (cairn bench --device
              nbd:URI) and fio's nbd engine:
                cairn   cairn serve --device rbd:rbd/bench,conf=C
                qsd     qemu-storage-daemon --blockdev driver=rbd,...,cache.direct=on
                        (librbd's cache off, as cairn), one iothread, an NBD export
              Server CPU (utime+stime of every thread, librbd's included, from
              /proc/PID/stat) per 100k requests. Targets: cairn >= 1.5x qsd with cairn's
              client, server CPU per request <= 0.6x qsd's.
  cache       a write-back cache in memory (128 MiB) over the image against the image
              alone: 4 KiB random writes, iodepth 32, 256 MiB of writes to the first
              64 MiB, timed from start to the process's exit, so that the cache's write-back
              of everything dirty is in the time. Two caches: `cache` with the default
              dirty budget (background 10%, limit 20% of its memory: writers are paced to
              the write-back rate once 20 MiB are dirty), `cache-roomy` with
              [writeback] background = "50%", limit = "100%" (the whole working set may
              be dirty until the end). Target: >= 10x.
  rss         memory: cairn serve and qemu-storage-daemon with 1 and with 8 images
              (bench-0..7, 64 MiB each) exported, after 4 MiB was read from each: VmRSS,
              and per image ((RSS8 - RSS1) / 7).
  connection  one cluster connection for the 8 images against one each
              (connection=shared|image): a stripe of the 8 (metadata none, 64 KiB
              chunks), 4 KiB randread and randwrite, two jobs at iodepth 32.

Interleaved rounds (odd rounds in reverse order); medians, with the spread (min..max of
the per-round ratios). JSON of every run goes to bench/out/rbd-*.json; tables to stdout
(Markdown). The script reports what it measured; it asserts nothing.

qemu's rbd driver for Debian's qemu 10 is in qemu-block-extra from bookworm-backports
(the main suite's 7.2 module does not load into qemu 10); as root, the script installs
it when it is missing.
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbd  # noqa: E402
from engine import CAIRN, OUT, ROOT, build, fmt_iops  # noqa: E402

DIR = "/dev/shm/cairn-rbd-bench"
IMAGE = "bench"
IMAGE_MIB = 1024
SMALL_MIB = 64
SMALL = [f"bench-{i}" for i in range(8)]
WORKLOADS = {"randread": ("randread", "4k", 32), "randwrite": ("randwrite", "4k", 32)}
QEMU_RBD = "/usr/lib/x86_64-linux-gnu/qemu/block-rbd.so"


def sh(*cmd, env=None):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr}")
    return r.stdout


class Cluster:
    def __init__(self, keep):
        self.dir = keep or DIR
        self.own = keep is None

    def start(self):
        if self.own:
            if os.path.exists(self.dir):
                subprocess.run([os.path.join(ROOT, "scripts/ceph-cluster"), "stop", f"{self.dir}/c"])
                shutil.rmtree(self.dir)
            os.makedirs(self.dir)
            sh(os.path.join(ROOT, "scripts/ceph-cluster"), "start", f"{self.dir}/c")
        self.conf = f"{self.dir}/c/ceph.conf"
        # fio's rbd engine reads CEPH_CONF; this copy turns librbd's cache off for it.
        self.nocache = f"{self.dir}/nocache.conf"
        with open(self.conf) as f, open(self.nocache, "w") as g:
            g.write(f.read() + "\n[client]\nrbd cache = false\n")

    def stop(self):
        if self.own:
            subprocess.run([os.path.join(ROOT, "scripts/ceph-cluster"), "stop", f"{self.dir}/c"])
            shutil.rmtree(self.dir, ignore_errors=True)

    def rbd(self, *args):
        return sh("rbd", "-c", self.conf, *args)

    def image(self, name, mib, fill=True):
        if name in self.rbd("ls", "rbd").split():
            return
        self.rbd("create", "--size", f"{mib}M", f"rbd/{name}")
        if fill:
            self.rbd("bench", "--io-type", "write", "--io-size", "4M", "--io-pattern", "seq",
                     "--io-total", f"{mib}M", f"rbd/{name}")

    def spec(self, name, extra=""):
        return f"rbd:rbd/{name},conf={self.conf}{extra}"


def timed(cmd, env=None):
    """Runs `cmd`; returns (stdout, wall seconds from start to exit). Its CPU (every
    thread's, librbd's too) is the change of this process's children's times around it."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, err = p.communicate()
    wall = time.monotonic() - t0
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{err[-3000:]}")
    return out, wall


def children_cpu():
    r = os.times()
    return r.children_user + r.children_system


def local_run(cl, tool, workload, runtime):
    rw, bs, depth = WORKLOADS[workload]
    env = dict(os.environ)
    if tool == "cairn":
        cmd = [CAIRN, "bench", "--log-level", "warn", "--device", cl.spec(IMAGE), f"--rw={rw}",
               f"--bs={bs}", f"--iodepth={depth}", f"--runtime={runtime}s", "--time_based",
               "--output-format=json"]
    else:
        env["CEPH_CONF"] = cl.nocache if tool == "fio" else cl.conf
        cmd = ["fio", "--name=rbd", "--ioengine=rbd", "--clientname=admin", "--pool=rbd",
               f"--rbdname={IMAGE}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={depth}",
               f"--runtime={runtime}", "--time_based", "--norandommap", "--randrepeat=0",
               "--output-format=json"]
    c0 = children_cpu()
    out, wall = timed(cmd, env)
    cpu = children_cpu() - c0
    j = nbd.parse_fio(out)
    j["bench"] = {"tool": tool, "cmd": cmd, "cpu_s": cpu, "wall_s": wall}
    return j


def iops_of(j):
    job = j["jobs"][0]
    return job["read"]["iops"] + job["write"]["iops"]


def ios_of(j):
    job = j["jobs"][0]
    return job["read"]["total_ios"] + job["write"]["total_ios"]


def local_summary(j):
    return {"iops": iops_of(j), "cpu_per_100k": j["bench"]["cpu_s"] * 1e5 / max(ios_of(j), 1),
            "lat_mean_ns": max(j["jobs"][0]["read"]["lat_ns"]["mean"], j["jobs"][0]["write"]["lat_ns"]["mean"])}


class Server:
    """cairn serve or qemu-storage-daemon exporting `images` over NBD on a Unix socket."""

    def __init__(self, kind, cl, images):
        self.kind, self.cl, self.images = kind, cl, images
        self.dir = tempfile.mkdtemp(prefix="cairn-rbd-bench-", dir="/dev/shm")
        self.sock = os.path.join(self.dir, "nbd.sock")
        self.log = open(os.path.join(OUT, f"rbd-{kind}.log"), "a")

    def uri(self, i=0):
        return f"nbd+unix:///{self.name(i)}?socket={self.sock}"

    def name(self, i):
        return f"e{i}"

    def start(self):
        if self.kind == "cairn":
            stack = os.path.join(self.dir, "stack.toml")
            with open(stack, "w") as f:
                for i, img in enumerate(self.images):
                    f.write(f'[device.d{i}]\ntype = "rbd"\npool = "rbd"\nimage = "{img}"\n'
                            f'conf = "{self.cl.conf}"\n[export.{self.name(i)}]\ndevice = "d{i}"\n')
            self.cmd = [CAIRN, "serve", "--listen", f"unix:{self.sock}", stack]
        else:
            self.cmd = ["qemu-storage-daemon", "--object", "iothread,id=io0",
                        "--nbd-server", f"addr.type=unix,addr.path={self.sock},max-connections=0"]
            for i, img in enumerate(self.images):
                self.cmd += ["--blockdev",
                             f"driver=rbd,node-name=r{i},pool=rbd,image={img},conf={self.cl.conf},"
                             "cache.direct=on",
                             "--export", f"type=nbd,id=x{i},node-name=r{i},name={self.name(i)},"
                             "writable=on,iothread=io0"]
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{self.kind} exited ({self.proc.returncode}); see {self.log.name}")
            if os.path.exists(self.sock) and subprocess.run(
                    ["nbdinfo", "--size", self.uri()], stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL).returncode == 0:
                return
            time.sleep(0.1)
        sys.exit(f"{self.kind} did not answer within 60 s")

    def cpu_ticks(self):
        return nbd.ticks(self.proc.pid)

    def rss_kib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def serve_run(cl, server, client, workload, runtime):
    rw, bs, depth = WORKLOADS[workload]
    srv = Server(server, cl, [IMAGE])
    try:
        srv.start()
        cmd = nbd.client_command(client, srv.uri(), rw, bs, depth, runtime)
        j, cpu_s, wall = nbd.measured_client(srv, cmd, f"{client} against {server}")
    finally:
        srv.stop()
    j["server"] = {"name": server, "cmd": srv.cmd, "cpu_s": cpu_s,
                   "fio_wall_s": wall, "fill_s": 0, "exit_status": srv.proc.returncode}
    j["client"] = {"name": client, "cmd": cmd}
    return j


def stack_bench(tool, text, device, args):
    """cairn bench on `device` of a stack file holding `text`; its JSON, with the wall time
    from start to exit and the CPU of the whole process."""
    d = tempfile.mkdtemp(prefix="cairn-rbd-stack-", dir="/dev/shm")
    stack = os.path.join(d, "stack.toml")
    with open(stack, "w") as f:
        f.write(text)
    cmd = [CAIRN, "bench", "--log-level", "warn", stack, "--device", device, *args,
           "--output-format=json"]
    c0 = children_cpu()
    try:
        out, wall = timed(cmd)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    j = json.loads(out)
    j["bench"] = {"tool": tool, "cmd": cmd, "cpu_s": children_cpu() - c0, "wall_s": wall}
    return j


def cache_run(cl, variant):
    text = '[writeback]\nbackground = "50%"\nlimit = "100%"\n' if variant == "cache-roomy" else ""
    text += (f'[device.img]\ntype = "rbd"\npool = "rbd"\nimage = "{IMAGE}"\nconf = "{cl.conf}"\n'
             '[device.c]\ntype = "cache"\nbase = "img"\nmemory = "128M"\n')
    return stack_bench(variant, text, "img" if variant == "image" else "c",
                       ["--rw=randwrite", "--bs=4k", "--iodepth=32", "--size=64M", "--io_size=256M"])


def cache_summary(j):
    ios = ios_of(j)
    return {"iops": ios / j["bench"]["wall_s"], "bench_iops": iops_of(j),
            "wall_s": j["bench"]["wall_s"]}


def rss_run(cl, server, n):
    srv = Server(server, cl, SMALL[:n])
    try:
        srv.start()
        for i in range(n):
            subprocess.run(["nbdcopy", "--requests=8", "--connections=1", srv.uri(i), "null:"],
                           check=True, stdout=subprocess.DEVNULL)
        # Reading 64 MiB through each: their buffers, caches and threads are all alive.
        time.sleep(1)
        return {"rss_kib": srv.rss_kib(), "threads": len(os.listdir(f"/proc/{srv.proc.pid}/task"))}
    finally:
        srv.stop()


def connection_run(cl, mode, workload, runtime):
    rw, bs, depth = WORKLOADS[workload]
    text = "".join(f'[device.d{i}]\ntype = "rbd"\npool = "rbd"\nimage = "{img}"\n'
                   f'conf = "{cl.conf}"\nconnection = "{mode}"\n' for i, img in enumerate(SMALL))
    members = ", ".join(f'"d{i}"' for i in range(len(SMALL)))
    text += f'[device.s]\ntype = "stripe"\nmembers = [{members}]\nchunk = "64K"\nmetadata = "none"\n'
    return stack_bench(mode, text, "s", [f"--rw={rw}", f"--bs={bs}", f"--iodepth={depth}", "--numjobs=2",
                                         f"--runtime={runtime}s", "--time_based"])


def total_iops(j):
    return sum(job["read"]["iops"] + job["write"]["iops"] for job in j["jobs"])


def rounds(name, variants, n, summarize):
    res = {label: [] for label, _ in variants}
    for rnd in range(n):
        for label, thunk in (variants[::-1] if rnd % 2 else variants):
            j = thunk()
            with open(os.path.join(OUT, f"rbd-{name}-{label}-{rnd}.json"), "w") as f:
                json.dump(j, f, indent=1)
            s = summarize(j)
            res[label].append(s)
            print(f"  {name}: {label} round {rnd + 1}: {s['iops']:.0f} IOPS", file=sys.stderr)
    return res


def med(rs, key):
    return statistics.median(r[key] for r in rs)


def spread(a, b, key="iops"):
    ratios = [x[key] / y[key] for x, y in zip(a, b) if y[key]]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}..{max(ratios):.2f})"


def ensure_qsd_rbd():
    if os.path.exists(QEMU_RBD) or os.geteuid() != 0:
        return os.path.exists(QEMU_RBD)
    src = "/tmp/cairn-bookworm-backports.list"
    with open(src, "w") as f:
        f.write("deb http://deb.debian.org/debian bookworm-backports main\n")
    opt = f"Dir::Etc::sourcelist={src}"
    subprocess.run(["apt-get", "-o", opt, "update", "-qq"])
    subprocess.run(["apt-get", "-o", opt, "install", "-y", "-qq", "-t", "bookworm-backports",
                    "qemu-block-extra"], env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    return os.path.exists(QEMU_RBD)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--parts", default="local,serve,cache,rss,connection")
    ap.add_argument("--keep", help="use the cluster already running in DIR (DIR/c/ceph.conf)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    build()
    os.makedirs(OUT, exist_ok=True)
    cl = Cluster(args.keep)
    cl.start()
    try:
        cl.image(IMAGE, IMAGE_MIB)
        if "rss" in parts or "connection" in parts:
            for img in SMALL:
                cl.image(img, SMALL_MIB)
        n, t = args.rounds, args.runtime
        print(f"# Ceph RBD (one OSD, bluestore on /dev/shm), {n} rounds of {t} s\n")
        if "local" in parts:
            for w in WORKLOADS:
                tools = ["cairn", "fio", "fio-default"]
                res = rounds(f"local-{w}", [(x, lambda x=x: local_run(cl, x, w, t)) for x in tools],
                             n, local_summary)
                print(f"## {w}, 4 KiB, iodepth 32, on the image\n")
                print("| tool | IOPS | cairn / tool (spread) | mean latency | CPU s per 100k |")
                print("|---|---|---|---|---|")
                for x in tools:
                    print(f"| {x} | {fmt_iops(med(res[x], 'iops'))} | {spread(res['cairn'], res[x])} "
                          f"| {med(res[x], 'lat_mean_ns') / 1e3:.0f} us | {med(res[x], 'cpu_per_100k'):.1f} |")
                print()
        if "serve" in parts:
            if not ensure_qsd_rbd():
                print("qemu's rbd driver is missing (qemu-block-extra from bookworm-backports): no serve part\n")
            else:
                for w in WORKLOADS:
                    for client in ["cairn", "fio"]:
                        res = rounds(f"serve-{w}-{client}",
                                     [(s, lambda s=s: serve_run(cl, s, client, w, t)) for s in ["cairn", "qsd"]],
                                     n, nbd.summary)
                        print(f"## served over NBD: {w}, 4 KiB, iodepth 32, {client}'s client\n")
                        print("| server | IOPS | cairn / qsd (spread) | server CPU s per 100k | cairn / qsd CPU |")
                        print("|---|---|---|---|---|")
                        for s in ["cairn", "qsd"]:
                            cpu = spread(res["cairn"], res["qsd"], "cpu_per_100k")
                            print(f"| {s} | {fmt_iops(med(res[s], 'iops'))} | "
                                  f"{spread(res['cairn'], res['qsd']) if s == 'cairn' else ''} | "
                                  f"{med(res[s], 'cpu_per_100k'):.2f} | {cpu if s == 'cairn' else ''} |")
                        print()
        if "cache" in parts:
            variants = ["cache", "cache-roomy", "image"]
            res = rounds("cache", [(v, lambda v=v: cache_run(cl, v)) for v in variants],
                         n, cache_summary)
            print("## write-back cache (128 MiB) over the image: 256 MiB of 4 KiB random writes to 64 MiB, "
                  "iodepth 32, until the process exits (everything written back)\n")
            print("| device | IOPS to exit | seconds | IOPS while writing | / image (spread) |")
            print("|---|---|---|---|---|")
            for v in variants:
                print(f"| {v} | {fmt_iops(med(res[v], 'iops'))} | {med(res[v], 'wall_s'):.1f} | "
                      f"{fmt_iops(med(res[v], 'bench_iops'))} | "
                      f"{spread(res[v], res['image']) if v != 'image' else ''} |")
            print()
        if "rss" in parts and ensure_qsd_rbd():
            print("## memory: RSS after reading each image whole\n")
            print("| server | 1 image | 8 images | per image | threads (8 images) |")
            print("|---|---|---|---|---|")
            for s in ["cairn", "qsd"]:
                one = [rss_run(cl, s, 1) for _ in range(max(1, n // 2))]
                eight = [rss_run(cl, s, 8) for _ in range(max(1, n // 2))]
                r1, r8 = med(one, "rss_kib"), med(eight, "rss_kib")
                print(f"| {s} | {r1 / 1024:.0f} MiB | {r8 / 1024:.0f} MiB | {(r8 - r1) / 7 / 1024:.1f} MiB | "
                      f"{med(eight, 'threads'):.0f} |")
            print()
        if "connection" in parts:
            for w in WORKLOADS:
                res = rounds(f"connection-{w}",
                             [(m, lambda m=m: connection_run(cl, m, w, t)) for m in ["shared", "image"]],
                             n, lambda j: {"iops": total_iops(j),
                                           "cpu_per_100k": j["bench"]["cpu_s"] * 1e5 / max(
                                               sum(ios_of({"jobs": [x]}) for x in j["jobs"]), 1)})
                print(f"## 8 images striped, {w}, 4 KiB, 2 jobs x iodepth 32: one connection or one each\n")
                print("| connection | IOPS | shared / image (spread) | CPU s per 100k |")
                print("|---|---|---|---|")
                for m in ["shared", "image"]:
                    print(f"| {m} | {fmt_iops(med(res[m], 'iops'))} | "
                          f"{spread(res['shared'], res['image']) if m == 'shared' else ''} | "
                          f"{med(res[m], 'cpu_per_100k'):.1f} |")
                print()
    finally:
        cl.stop()


if __name__ == "__main__":
    main()
