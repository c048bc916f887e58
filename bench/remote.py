#!/usr/bin/env python3
"""Remote devices across a network link: a mirror of a local and a remote copy.

  sudo bench/remote.py [--runtime SECS] [--rounds N] [--connections N]

Two network namespaces joined by a veth pair (10.232.0.1 and 10.232.0.2, only inside
them), made at the start and removed at the end (root only). `cairn serve --device
mem:1G` listens in the first; in the second, cairn bench runs 4 KiB random writes,
iodepth 32, one job, on:

  remote    the nbd device alone (nbd://10.232.0.1/)
  mirror    a mirror of a local file on /dev/shm and that remote export

Variants run in interleaved rounds and the medians are reported, as in bench/engine.py.
The target: the mirror's IOPS >= 0.8x the remote export's alone (a write completes when
both copies have it, so the remote copy sets the pace). Also reported: the mirror of two
local files, which shows what the mirror itself costs. Every byte of the local files and
of the server's mem device is written once before the rounds, so no run pays for first
touches of memory (a mem device in the bench process would start empty every run). The
mirrors are raw (metadata = "none"): the export is also written directly by the "remote"
runs, and the files hold data from the start, so a mirror with superblocks would find its
members foreign. Stack files go to bench/out/remote-*.toml, the server's log to
bench/out/remote-server.log.
"""
import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import CAIRN, OUT, build, compare, fmt_iops  # noqa: E402

NS_A, NS_B = "cairn-bench-a", "cairn-bench-b"
DEV_A, DEV_B = "cbva", "cbvb"
ADDR_A, ADDR_B = "10.232.0.1", "10.232.0.2"


def ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)


def make_link():
    ip("netns", "del", NS_A, check=False)
    ip("netns", "del", NS_B, check=False)
    ip("netns", "add", NS_A)
    ip("netns", "add", NS_B)
    ip("link", "add", DEV_A, "netns", NS_A, "type", "veth", "peer", "name", DEV_B, "netns", NS_B)
    for ns, dev, addr in ((NS_A, DEV_A, ADDR_A), (NS_B, DEV_B, ADDR_B)):
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        ip("-n", ns, "link", "set", dev, "up")
        ip("-n", ns, "link", "set", "lo", "up")


def remove_link():
    ip("netns", "del", NS_A, check=False)
    ip("netns", "del", NS_B, check=False)


def stack(name, text):
    path = os.path.join(OUT, f"remote-{name}.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, default=1, help="connections of the nbd device")
    ap.add_argument("--no-build", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    if not args.no_build:
        build()
    os.makedirs(OUT, exist_ok=True)
    uri = f"nbd://{ADDR_A}/"
    remote = f'[device.remote]\ntype = "nbd"\nuri = "{uri}"\nconnections = {args.connections}\n'
    shm = [f"/dev/shm/cairn-remote-{i}.img" for i in range(3)]
    for path in shm:
        with open(path, "wb") as f:
            for _ in range(1024):
                f.write(b"\x5a" * (1 << 20))
    local = lambda name, i: f'[device.{name}]\ntype = "file"\npath = "{shm[i]}"\n'  # noqa: E731
    files = {
        "remote": stack("remote", remote),
        "mirror": stack("mirror", remote + local("local", 0)
                        + '[device.m]\ntype = "mirror"\nmembers = ["local", "remote"]\n'
                        + 'metadata = "none"\n'),
        "local mirror": stack("local-mirror", local("a", 1) + local("b", 2)
                              + '[device.m]\ntype = "mirror"\nmembers = ["a", "b"]\n'
                              + 'metadata = "none"\n'),
    }
    make_link()
    log = open(os.path.join(OUT, "remote-server.log"), "w")
    server = subprocess.Popen(["ip", "netns", "exec", NS_A, CAIRN, "serve", "--device", "mem:1G",
                               "--listen", f"tcp:{ADDR_A}:10809"], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while subprocess.run(["ip", "netns", "exec", NS_B, CAIRN, "check", files["remote"]],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode:
            if time.monotonic() > deadline or server.poll() is not None:
                sys.exit("the server did not answer; see bench/out/remote-server.log")
            time.sleep(0.1)
        fill = subprocess.run(["ip", "netns", "exec", NS_B, CAIRN, "bench", "--log-level", "warn",
                               files["remote"], "--rw", "write", "--bs", "1M", "--iodepth", "8"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if fill.returncode != 0:
            sys.exit(f"filling the remote export failed:\n{fill.stderr}")

        def run(name):
            cmd = ["ip", "netns", "exec", NS_B, CAIRN, "bench", "--log-level", "warn", files[name],
                   "--rw", "randwrite", "--bs", "4k", "--iodepth", "32", "--runtime",
                   f"{args.runtime}s", "--time_based", "--output-format", "json"]
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if r.returncode != 0:
                sys.exit(f"{name}: cairn bench failed ({r.returncode}):\n{r.stderr}")
            import json
            return json.loads(r.stdout)

        def summary(j):
            job = j["jobs"][0]
            return {"iops": job["write"]["iops"], "lat": job["write"]["lat_ns"]["mean"],
                    "cpu": job["usr_cpu"] + job["sys_cpu"]}

        names = ["remote", "mirror", "local mirror"]
        res = compare("randwrite", [(n, lambda n=n: run(n)) for n in names], args.rounds,
                      summarize=summary, prefix="remote")
    finally:
        server.terminate()
        server.wait()
        log.close()
        remove_link()
        for path in shm:
            os.unlink(path)
    med = lambda n, k: sorted(r[k] for r in res[n])[len(res[n]) // 2]  # noqa: E731
    base = med("remote", "iops")
    print(f"Median of {args.rounds} interleaved rounds of {args.runtime} s each "
          f"(`bench/remote.py --runtime {args.runtime} --rounds {args.rounds} --connections "
          f"{args.connections}`); 4 KiB random writes, iodepth 32, one job, over a veth pair "
          f"between two network namespaces; {os.cpu_count()} CPUs.\n")
    print("| device | IOPS | vs remote alone | lat mean (µs) | client CPU (%) |")
    print("|---|---|---|---|---|")
    for n in names:
        print(f"| {n} | {fmt_iops(med(n, 'iops'))} | {med(n, 'iops') / base:.2f}x | "
              f"{med(n, 'lat') / 1000:.1f} | {med(n, 'cpu'):.0f} |")
    print(f"\nmirror / remote alone = {med('mirror', 'iops') / base:.2f}x (target 0.8x)")


if __name__ == "__main__":
    main()
