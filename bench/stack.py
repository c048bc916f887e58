#!/usr/bin/env python3
"""The stack benchmarks (techniques 1 and 4), side by side in one run.

  bench/stack.py [--runtime SECS] [--rounds N] [--only NAME,...]

Variants run in interleaved rounds and the medians are reported, as in bench/engine.py.
Stack files are written to bench/out/. Comparisons:

  t4        technique 4: 4 KiB randread qd32 on linear and stripe over null, against the
            bare null device (IOPS ratio, context switches per 10,000 I/Os), and inline
            against --dispatch handoff; raw arrays (metadata = "none"), as dm-linear over
            null_blk was in the original, and null members keep nothing anyway
  t1        technique 1: raid10 over four delay(flush = 1ms) over mem, 4 KiB randwrite,
            iodepth 128, fsync 1 (every client writes then flushes): --flush batched
            against serial, with flush latency mean and max
  raid10    raid10 over four mem devices against one mem device, 4 KiB randread qd32

The raid10s run at the default, with superblocks and a write-intent bitmap, as a user's
would (md's RAID10 in technique 1's original had its superblocks too).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import CAIRN, OUT, ROOT, build, compare, fmt_iops, sh  # noqa: E402

STACKS = {
    "t4": """
[device.n]
type = "null"
size = "2G"
[device.a]
type = "null"
size = "1G"
[device.b]
type = "null"
size = "1G"
[device.linear]
type = "linear"
members = ["a", "b"]
metadata = "none"
[device.c]
type = "null"
size = "1G"
[device.d]
type = "null"
size = "1G"
[device.stripe]
type = "stripe"
members = ["c", "d"]
chunk = "64K"
metadata = "none"
""",
    "t1": "".join(f"""
[device.m{i}]
type = "mem"
size = "256M"
[device.d{i}]
type = "delay"
base = "m{i}"
flush = "1ms"
""" for i in range(4)) + """
[device.r]
type = "raid10"
members = ["d0", "d1", "d2", "d3"]
chunk = "64K"
""",
    "raid10": "".join(f"""
[device.m{i}]
type = "mem"
size = "1G"
""" for i in range(4)) + """
[device.r]
type = "raid10"
members = ["m0", "m1", "m2", "m3"]
chunk = "64K"
[device.single]
type = "mem"
size = "2G"
""",
}


def stack_file(name):
    path = os.path.join(OUT, f"stack-{name}.toml")
    with open(path, "w") as f:
        f.write(STACKS[name])
    return path


def bench(stack, device, runtime, *args, switches=()):
    cmd = [CAIRN, *switches, "bench", *([stack] if stack else []), "--device", device,
           "--runtime", str(runtime),
           "--time_based", "--output-format", "json", *args]
    return json.loads(sh(cmd))


def summary(j):
    job = j["jobs"][0]
    r, w, s = job["read"], job["write"], job["sync"]
    ios = r["total_ios"] + w["total_ios"] + s["total_ios"]
    return {"read_iops": r["iops"], "write_iops": w["iops"], "write_bw": w["bw_bytes"],
            "ctx": job["ctx"], "ctx_per_10k": job["ctx"] * 1e4 / max(ios, 1),
            "flush_mean": s["lat_ns"]["mean"], "flush_max": s["lat_ns"]["max"],
            "flushes": s["total_ios"]}


def rounds(name, variants, n):
    return compare(name, variants, n, summarize=summary, prefix="stack")


def med(rs, key):
    return statistics.median(r[key] for r in rs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="t4,t1,raid10")
    args = ap.parse_args()
    only = set(args.only.split(","))
    build()
    os.makedirs(OUT, exist_ok=True)
    t, n = args.runtime, args.rounds
    out = [f"Median of {n} interleaved rounds of {t} s each (`bench/stack.py --runtime {t} --rounds {n}`).", ""]

    if "t4" in only:
        f = stack_file("t4")
        res = rounds("t4", [
            ("null", lambda: bench(f, "n", t)),
            ("linear", lambda: bench(f, "linear", t)),
            ("stripe", lambda: bench(f, "stripe", t)),
            ("linear handoff", lambda: bench(f, "linear", t, switches=("--dispatch", "handoff"))),
            ("stripe handoff", lambda: bench(f, "stripe", t, switches=("--dispatch", "handoff"))),
        ], n)
        bare = med(res["null"], "read_iops")
        out += ["Technique 4 (4 KiB randread, iodepth 32, one job; targets: stacked >= 0.9x null "
                "with < 1 context switch per 10,000 I/Os):", "",
                "| device | dispatch | IOPS | vs null | ctx per 10k I/Os |", "|---|---|---|---|---|"]
        for label in ("null", "linear", "stripe", "linear handoff", "stripe handoff"):
            rs = res[label]
            iops = med(rs, "read_iops")
            dev, _, mode = label.partition(" ")
            out.append(f"| {dev} | {mode or 'inline'} | {fmt_iops(iops)} | {iops / bare:.2f}x | "
                       f"{med(rs, 'ctx_per_10k'):.3f} |")
        for dev in ("linear", "stripe"):
            ratio = med(res[dev], "read_iops") / med(res[f"{dev} handoff"], "read_iops")
            out.append(f"\n{dev}: inline / handoff = {ratio:.2f}x (the original gained 1.42x)")
        out.append("")

    if "t1" in only:
        f = stack_file("t1")
        job = ("--rw", "randwrite", "--iodepth", "128", "--fsync", "1")
        res = rounds("t1", [
            ("batched", lambda: bench(f, "r", t, *job, switches=("--flush", "batched"))),
            ("serial", lambda: bench(f, "r", t, *job, switches=("--flush", "serial"))),
        ], n)
        out += ["Technique 1 (raid10 over four delay(flush = 1ms) over mem; 128 clients each "
                "writing 4 KiB then flushing; target: batched >= 3x serial):", "",
                "| flush | writes/s | MB/s | flushes | flush latency mean (ms) | max (ms) |",
                "|---|---|---|---|---|---|"]
        for label in ("batched", "serial"):
            rs = res[label]
            out.append(f"| {label} | {fmt_iops(med(rs, 'write_iops'))} | {med(rs, 'write_bw') / 1e6:.1f} | "
                       f"{int(med(rs, 'flushes'))} | {med(rs, 'flush_mean') / 1e6:.3f} | "
                       f"{med(rs, 'flush_max') / 1e6:.3f} |")
        ratio = med(res["batched"], "write_iops") / med(res["serial"], "write_iops")
        out.append(f"\nbatched / serial = {ratio:.1f}x (the original: 345 -> 1035 MB/s, 3.0x)\n")

    if "raid10" in only:
        f = stack_file("raid10")
        res = rounds("raid10", [("single", lambda: bench(f, "single", t)),
                                ("raid10", lambda: bench(f, "r", t))], n)
        a, b = med(res["raid10"], "read_iops"), med(res["single"], "read_iops")
        out += ["raid10 over four mem devices against one mem device (4 KiB randread qd32; "
                "target >= 0.8x):", "",
                f"| raid10 | single mem | ratio |", "|---|---|---|",
                f"| {fmt_iops(a)} | {fmt_iops(b)} | {a / b:.2f}x |", ""]

    print("\n".join(out))


if __name__ == "__main__":
    main()
