#!/usr/bin/env python3
"""The FUSE export against the chains it replaces (a kernel-facing export without
NBD in between), side by side in one run. Needs root, /dev/fuse, dbench, fio, nbdfuse and
qemu-storage-daemon.

  bench/fuse.py [--rounds N] [--size 4G] [--dbench-time 10] [--clients 32] [--fio-time 5]

The chains, each serving a device of SIZE:
  cairn-uring    cairn serve --fuse (FUSE over io_uring; the fuse module's enable_uring
                 must be Y, which this script sets), on a mem device
  cairn-dev      the same with --fuse-io-uring off (/dev/fuse reads)
  nbdfuse        cairn serve (NBD, Unix socket) of the same mem device, nbdfuse's file
  qsd            qemu-storage-daemon's FUSE export (--export type=fuse) of a raw file in
                 /dev/shm (memory too; QEMU has no RAM disk of its own)
  cairn-uring-shm  cairn serve --fuse of that same kind of /dev/shm file, for a like for
                 like comparison with qsd
  kernel         no user-space server at all: the loop device straight on a /dev/shm
                 file. The ceiling any chain can reach on this machine.

For each: ext4 on a loop device over the chain's file (--loop-direct-io: losetup
--direct-io=on, for every chain), dbench CLIENTS clients for
DBENCH_TIME seconds (MB/s); then fio 4 KiB randread and randwrite at iodepth 32,
--ioengine=io_uring --direct=1, on the chain's file itself (IOPS). Chains interleave
within each round; medians over rounds, with every round's figures.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import CAIRN, build  # noqa: E402

DIR = "/dev/shm/cairn-bench-fuse"
CHAINS = ["cairn-uring", "cairn-dev", "nbdfuse", "qsd", "cairn-uring-shm", "kernel"]


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def wait_for(pred, what, limit=30):
    end = time.time() + limit
    while time.time() < end:
        if pred():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what}: not ready after {limit} s")


def mounted(path):
    with open("/proc/self/mounts") as f:
        return any(line.split(" ")[1] == path for line in f)


class Chain:
    """Starts a chain; `file` is the file it exposes."""

    def __init__(self, name, size):
        self.name, self.size, self.procs, self.file = name, size, [], None
        d = os.path.join(DIR, name)
        os.makedirs(d, exist_ok=True)
        self.dir = d
        log = open(os.path.join(d, "log"), "w")
        if name.startswith("cairn-"):
            self.file = os.path.join(d, "disk")
            device = f"mem:{size}"
            if name == "cairn-uring-shm":
                img = os.path.join(d, "img")
                run(["truncate", "-s", size, img])
                device = f"file:{img}"
            uring = "off" if name == "cairn-dev" else "auto"
            self.procs.append(subprocess.Popen(
                [CAIRN, "serve", "--device", device, "--fuse", self.file,
                 "--fuse-io-uring", uring], stdout=log, stderr=log))
            wait_for(lambda: mounted(self.file), f"{name} mount")
            with open(os.path.join(d, "log")) as f:
                want = "io_uring" if uring == "auto" else "/dev/fuse"
                text = f.read()
                if want not in text:
                    raise RuntimeError(f"{name}: not served through {want}:\n{text}")
        elif name == "nbdfuse":
            sock = os.path.join(d, "nbd.sock")
            self.procs.append(subprocess.Popen(
                [CAIRN, "serve", "--device", f"mem:{size}", "--listen", f"unix:{sock}"],
                stdout=log, stderr=log))
            wait_for(lambda: os.path.exists(sock), "cairn serve socket")
            mnt = os.path.join(d, "mnt")
            os.makedirs(mnt, exist_ok=True)
            self.fuse_dir = mnt
            self.procs.append(subprocess.Popen(
                ["nbdfuse", mnt, f"nbd+unix:///?socket={sock}"], stdout=log, stderr=log))
            self.file = os.path.join(mnt, "nbd")
            wait_for(lambda: mounted(mnt) and os.path.exists(self.file), "nbdfuse")
        elif name == "kernel":
            self.file = os.path.join(d, "img")
            run(["truncate", "-s", size, self.file])
        elif name == "qsd":
            img = os.path.join(d, "img")
            run(["truncate", "-s", size, img])
            self.file = os.path.join(d, "disk")
            open(self.file, "w").close()
            self.procs.append(subprocess.Popen(
                ["qemu-storage-daemon",
                 "--blockdev", f"driver=file,node-name=f0,filename={img},aio=io_uring",
                 "--blockdev", "driver=raw,node-name=d0,file=f0",
                 "--export", f"type=fuse,id=e0,node-name=d0,mountpoint={self.file},writable=on"],
                stdout=log, stderr=log))
            wait_for(lambda: mounted(self.file), "qemu-storage-daemon mount")

    def stop(self):
        if self.name == "nbdfuse":
            subprocess.run(["fusermount3", "-u", self.fuse_dir], capture_output=True)
        if self.name == "qsd":
            subprocess.run(["fusermount3", "-u", self.file], capture_output=True)
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def dbench(chain, seconds, clients, loop_direct):
    dev = run(["losetup", "--find", "--show", f"--direct-io={'on' if loop_direct else 'off'}",
               chain.file]).stdout.strip()
    mnt = os.path.join(DIR, "ext4")
    os.makedirs(mnt, exist_ok=True)
    try:
        run(["mkfs.ext4", "-q", "-F", dev])
        run(["mount", "-t", "ext4", dev, mnt])
        try:
            out = run(["dbench", "-D", mnt, "-t", str(seconds), str(clients)],
                      timeout=seconds + 300).stdout
        finally:
            subprocess.run(["umount", mnt], capture_output=True)
    finally:
        for _ in range(50):
            if subprocess.run(["losetup", "-d", dev], capture_output=True).returncode == 0:
                break
            time.sleep(0.2)
    m = re.search(r"Throughput ([0-9.]+) MB/sec", out)
    if not m:
        raise RuntimeError(f"dbench said:\n{out}")
    return float(m.group(1))


def fio(chain, rw, seconds):
    out = run(["fio", "--name=f", f"--filename={chain.file}", "--ioengine=io_uring",
               "--direct=1", f"--rw={rw}", "--bs=4k", "--iodepth=32", "--time_based",
               f"--runtime={seconds}", "--output-format=json"]).stdout
    j = json.loads(out[out.index("{"):])["jobs"][0]
    return j["read" if rw == "randread" else "write"]["iops"]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", default="4G")
    ap.add_argument("--dbench-time", type=int, default=10)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--fio-time", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=CHAINS)
    ap.add_argument("--loop-direct-io", action="store_true",
                    help="losetup --direct-io=on for every chain (default off)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/fuse.py: needs root (FUSE mounts, loop devices)")
    build()
    with open("/sys/module/fuse/parameters/enable_uring", "w") as f:
        f.write("Y")
    shutil.rmtree(DIR, ignore_errors=True)
    os.makedirs(DIR)
    results = {c: {"dbench": [], "randread": [], "randwrite": []} for c in a.only}
    for r in range(a.rounds):
        for name in a.only:
            chain = Chain(name, a.size)
            try:
                d = dbench(chain, a.dbench_time, a.clients, a.loop_direct_io)
                rr = fio(chain, "randread", a.fio_time)
                rw = fio(chain, "randwrite", a.fio_time)
            finally:
                chain.stop()
            results[name]["dbench"].append(d)
            results[name]["randread"].append(rr)
            results[name]["randwrite"].append(rw)
            print(f"round {r + 1} {name:16} dbench {d:8.1f} MB/s  randread {rr / 1e3:7.1f}k"
                  f"  randwrite {rw / 1e3:7.1f}k", flush=True)
    med = {c: {k: statistics.median(v) for k, v in m.items()} for c, m in results.items()}
    print(f"\nmedians of {a.rounds} rounds (size {a.size}, dbench {a.clients} clients "
          f"{a.dbench_time} s, fio {a.fio_time} s):")
    print("| chain | dbench MB/s | fio randread IOPS | fio randwrite IOPS |")
    print("|---|---|---|---|")
    for c in a.only:
        m = med[c]
        print(f"| {c} | {m['dbench']:.1f} | {m['randread'] / 1e3:.1f}k "
              f"| {m['randwrite'] / 1e3:.1f}k |")
    if "cairn-uring" in med:
        base = med["cairn-uring"]
        for other in ("nbdfuse", "qsd", "cairn-dev", "kernel"):
            if other in med:
                o = med[other]
                print(f"cairn-uring / {other}: dbench {base['dbench'] / o['dbench']:.2f}x, "
                      f"randread {base['randread'] / o['randread']:.2f}x, "
                      f"randwrite {base['randwrite'] / o['randwrite']:.2f}x")


if __name__ == "__main__":
    main()
