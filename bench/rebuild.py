#!/usr/bin/env python3
"""Array rebuild benchmarks (arrays that remember), side by side in one run.

  bench/rebuild.py [--rounds N] [--runtime SECS] [--size 1G]

A mirror at the defaults (superblocks and a bitmap) of two files on /dev/shm (each SIZE plus the 1 MiB metadata area),
filled once with written blocks. Comparisons, in interleaved rounds, medians reported:

  rebuild   member b removed, `cairn serve` started: the rebuild's own figure (bytes,
            seconds) from its log line, against `dd if=a of=c bs=1M` copying the same
            member file to a new file on /dev/shm (target: rebuild >= 0.8x dd)
  clients   4 KiB randread, iodepth 32, one job, --time_based for RUNTIME: the healthy
            array, against the same array while member b is rebuilt at the default rate
            limit (target: >= 0.7x)

The bitmap's resync after kill -9 and its cost on writes: bench/bitmap.py.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import CAIRN, OUT, build, fmt_iops, sh  # noqa: E402

DIR = "/dev/shm/cairn-bench-rebuild"


def stack_file(size):
    path = os.path.join(OUT, "rebuild.toml")
    member = f"{size + 1}M"
    with open(path, "w") as f:
        f.write(f"""
[device.a]
type = "file"
path = "{DIR}/a.img"
size = "{member}"
[device.b]
type = "file"
path = "{DIR}/b.img"
size = "{member}"
[device.m]
type = "mirror"
members = ["a", "b"]
""")
    return path


def rebuild_once(stack):
    """Removes b, serves until the rebuild's 'done' line; (bytes, seconds)."""
    os.remove(f"{DIR}/b.img")
    sock = f"{DIR}/nbd.sock"
    p = subprocess.Popen([CAIRN, "serve", stack, "--listen", f"unix:{sock}"],
                         stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stderr:
            m = re.search(r"rebuild of .* done: (\d+) bytes in ([0-9.]+) s", line)
            if m:
                return int(m.group(1)), float(m.group(2))
        sys.exit("cairn serve ended without a rebuild line")
    finally:
        p.terminate()
        p.wait()


def dd_once():
    """Copies member a to a new file; bytes per second from dd's own figure."""
    target = f"{DIR}/c.img"
    if os.path.exists(target):
        os.remove(target)
    t = time.monotonic()
    subprocess.run(["dd", f"if={DIR}/a.img", f"of={target}", "bs=1M"],
                   check=True, capture_output=True)
    secs = time.monotonic() - t
    size = os.path.getsize(target)
    os.remove(target)
    return size, secs


def randread(stack, runtime):
    out = sh([CAIRN, "bench", stack, "--rw", "randread", "--bs", "4k", "--iodepth", "32",
              "--runtime", str(runtime), "--time_based", "--output-format", "json"])
    return json.loads(out)["jobs"][0]["read"]["iops"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--size", default="1G", help="array size: 1G, 512M, ...")
    args = ap.parse_args()
    size_mib = int(args.size[:-1]) * (1024 if args.size.endswith("G") else 1)
    build()
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(DIR, exist_ok=True)
    for f in ("a.img", "b.img"):
        if os.path.exists(f"{DIR}/{f}"):
            os.remove(f"{DIR}/{f}")
    stack = stack_file(size_mib)
    # Create the array and fill it (verify blocks are not zeros).
    sh([CAIRN, "bench", stack, "--rw", "write", "--bs", "1M", "--iodepth", "8",
        "--size", args.size, "--verify", "crc32c"])

    rebuild, dd = [], []
    for _ in range(args.rounds):
        b, s = rebuild_once(stack)
        rebuild.append(b / s)
        b, s = dd_once()
        dd.append(b / s)
    healthy, during = [], []
    for _ in range(args.rounds):
        healthy.append(randread(stack, args.runtime))
        os.remove(f"{DIR}/b.img")
        during.append(randread(stack, args.runtime))
        # Let the next healthy round find b rebuilt.
        rebuild_once_after_partial(stack)

    r, d = statistics.median(rebuild), statistics.median(dd)
    h, g = statistics.median(healthy), statistics.median(during)
    print(f"Medians of {args.rounds} interleaved rounds (`bench/rebuild.py --rounds {args.rounds} "
          f"--runtime {args.runtime} --size {args.size}`), files on /dev/shm.\n")
    print("| measure | cairn | peer | ratio | target |")
    print("|---|---|---|---|---|")
    print(f"| rebuild of an idle {args.size} member, MB/s | {r / 1e6:.0f} | dd bs=1M to a new file: "
          f"{d / 1e6:.0f} | {r / d:.2f}x | >= 0.8x |")
    print(f"| 4 KiB randread qd32 IOPS | during a rebuild: {fmt_iops(g)} | healthy: {fmt_iops(h)} | "
          f"{g / h:.2f}x | >= 0.7x |")
    print(f"\nrounds: rebuild {[round(x / 1e6) for x in rebuild]} MB/s, dd {[round(x / 1e6) for x in dd]} "
          f"MB/s; randread healthy {[fmt_iops(x) for x in healthy]}, during {[fmt_iops(x) for x in during]}")


def rebuild_once_after_partial(stack):
    """Serves until the rebuild left part way by the previous run is done."""
    sock = f"{DIR}/nbd.sock"
    p = subprocess.Popen([CAIRN, "serve", stack, "--listen", f"unix:{sock}"],
                         stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stderr:
            if re.search(r"rebuild of .* done:", line):
                return
        sys.exit("cairn serve ended without a rebuild line")
    finally:
        p.terminate()
        p.wait()


if __name__ == "__main__":
    main()
