#!/usr/bin/env python3
"""Write-intent bitmap benchmarks (arrays that remember), side by side in one run.

  bench/bitmap.py [--rounds N] [--runtime SECS] [--size 1G]

A mirror at the defaults (superblocks and a bitmap) of two files on /dev/shm (each SIZE plus the 1 MiB metadata area).

  resync    kill -9 with 1% of the regions written: `cairn bench` writes 4 KiB blocks at
            random into the first 1% of the array (1 MiB regions: 10 of 1024 for 1 GiB) for
            12 s (the other regions' bits are cleared after the default 5 s delay), and is
            killed with writes in flight. Then `cairn serve` starts and resyncs; from its
            log: bytes read and written by the resync and its time; and the time from the
            start of `cairn serve` until the array is consistent (the 'done' line).
            Against the same with bitmap = "none" (a full resync).
            Targets: the resync moves <= 2% of the array's bytes, consistent in < 1 s.
  cost      4 KiB randwrite, iodepth 32, one job, --time_based for RUNTIME, on the healthy
            mirror: bitmap = "64M" (the default) against bitmap = "none", interleaved
            rounds. Target: >= 0.9x.

Medians of interleaved rounds are reported, with every round's figure.
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import CAIRN, OUT, build, fmt_iops, sh  # noqa: E402

DIR = "/dev/shm/cairn-bench-bitmap"


def stack_file(size_mib, bitmap):
    path = os.path.join(OUT, f"bitmap-{bitmap}.toml")
    with open(path, "w") as f:
        f.write(f"""
[device.a]
type = "file"
path = "{DIR}/a.img"
size = "{size_mib + 1}M"
[device.b]
type = "file"
path = "{DIR}/b.img"
size = "{size_mib + 1}M"
[device.m]
type = "mirror"
members = ["a", "b"]
bitmap = "{bitmap}"
""")
    return path


def fresh(size_mib):
    """New member files, the array created on them and filled once."""
    os.makedirs(DIR, exist_ok=True)
    for f in ("a.img", "b.img"):
        if os.path.exists(f"{DIR}/{f}"):
            os.remove(f"{DIR}/{f}")
    stack = stack_file(size_mib, "none")
    sh([CAIRN, "bench", stack, "--rw", "write", "--bs", "1M", "--iodepth", "8",
        "--size", f"{size_mib}M"])


def resync_once(size_mib, bitmap):
    """kill -9 under writes to 1% of the array, then serve until the resync is done:
    (bytes read, bytes written, resync seconds, seconds until consistent)."""
    stack = stack_file(size_mib, bitmap)
    hot = max(1, size_mib // 100)
    w = subprocess.Popen([CAIRN, "bench", stack, "--rw", "randwrite", "--bs", "4k",
                          "--iodepth", "8", "--size", f"{hot}M", "--time_based",
                          "--runtime", "60"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(12)
    w.send_signal(signal.SIGKILL)
    w.wait()
    sock = f"{DIR}/nbd.sock"
    started = time.monotonic()
    p = subprocess.Popen([CAIRN, "serve", stack, "--listen", f"unix:{sock}"],
                         stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stderr:
            m = re.search(r"resync of .* done: \d+ bytes in ([0-9.]+) s .*; "
                          r"read (\d+) bytes, wrote (\d+) bytes", line)
            if m:
                until = time.monotonic() - started
                return int(m.group(2)), int(m.group(3)), float(m.group(1)), until
        sys.exit("cairn serve ended without a resync line")
    finally:
        p.terminate()
        p.wait()


def randwrite(size_mib, bitmap, runtime):
    out = sh([CAIRN, "bench", stack_file(size_mib, bitmap), "--rw", "randwrite", "--bs", "4k",
              "--iodepth", "32", "--runtime", str(runtime), "--time_based",
              "--output-format", "json"])
    return json.loads(out)["jobs"][0]["write"]["iops"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--size", default="1G", help="array size: 1G, 512M, ...")
    args = ap.parse_args()
    size_mib = int(args.size[:-1]) * (1024 if args.size.endswith("G") else 1)
    array_bytes = size_mib << 20
    build()
    os.makedirs(OUT, exist_ok=True)
    fresh(size_mib)

    runs = {"1M": [], "none": []}
    for _ in range(args.rounds):
        for bitmap in runs:
            runs[bitmap].append(resync_once(size_mib, bitmap))
    cost = {"64M": [], "none": []}
    for _ in range(args.rounds):
        for bitmap in cost:
            cost[bitmap].append(randwrite(size_mib, bitmap, args.runtime))

    def med(rs, i):
        return statistics.median(r[i] for r in rs)

    print(f"Medians of {args.rounds} interleaved rounds (`bench/bitmap.py --rounds {args.rounds} "
          f"--runtime {args.runtime} --size {args.size}`), files on /dev/shm.\n")
    print("| resync after kill -9, 1% of regions written | bitmap, 1 MiB regions | no bitmap | target |")
    print("|---|---|---|---|")
    b, n = runs["1M"], runs["none"]
    print(f"| bytes read by the resync | {med(b, 0):.0f} ({med(b, 0) * 100 / array_bytes:.2f}%) | "
          f"{med(n, 0):.0f} ({med(n, 0) * 100 / array_bytes:.0f}%) | |")
    print(f"| bytes written by the resync | {med(b, 1):.0f} ({med(b, 1) * 100 / array_bytes:.2f}%) | "
          f"{med(n, 1):.0f} ({med(n, 1) * 100 / array_bytes:.0f}%) | <= 2% |")
    print(f"| resync time, s | {med(b, 2):.3f} | {med(n, 2):.3f} | |")
    print(f"| from `cairn serve` starting to consistent, s | {med(b, 3):.3f} | {med(n, 3):.3f} | < 1 s |")
    g, o = statistics.median(cost["64M"]), statistics.median(cost["none"])
    print("\n| 4 KiB randwrite qd32 on a healthy mirror | bitmap 64M (default) | no bitmap | ratio | target |")
    print("|---|---|---|---|---|")
    print(f"| IOPS | {fmt_iops(g)} | {fmt_iops(o)} | {g / o:.2f}x | >= 0.9x |")
    print(f"\nrounds: resync with bitmap {[(r[1], round(r[3], 3)) for r in b]} (bytes written, s); "
          f"without {[(r[1], round(r[3], 3)) for r in n]}; randwrite with bitmap "
          f"{[fmt_iops(x) for x in cost['64M']]}, without {[fmt_iops(x) for x in cost['none']]}")


if __name__ == "__main__":
    main()
