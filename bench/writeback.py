#!/usr/bin/env python3
"""Technique 3's benchmark: per-device flushers against `--writeback shared`.

  bench/writeback.py [--runtime SECS] [--rounds N] [--disks 4[,1,...]] [--memory 64M]
                     [--seek 4ms] [--bandwidth 150M] [--warmup SECS]

For each disk count, a stack file (bench/out/writeback-N.toml) stripes N caches (a raw
stripe, metadata = "none": it only spreads the load over the disks, as the original's
separate disks had no RAID, and a stripe with superblocks would first read each blank
member's first 64 MiB through its cache, starting the run with the caches full), each
over a modelled rotational disk (delay: a bandwidth cap and a seek penalty for every
request that does not start where the last one ended) over mem, with the kernel's
default [writeback] levels (background 10%, limit 20% of the caches' memory). One job
writes random 4 KiB blocks at iodepth 32 for --runtime seconds with --timeline 1s;
per-device and shared runs alternate in interleaved rounds, and the medians are
reported:

  IOPS          over the whole run, from the bench report (the first second is the
                caches absorbing writes until the dirty level reaches the throttle)
  steady IOPS   the mean of the per-second rows after --warmup seconds
  CoV           coefficient of variation (stdev / mean) of those per-second rows
  exit          seconds from the end of the run to the process's exit (the caches
                writing everything back)

Each run's JSON report, timeline CSV and SVG chart go to bench/out/writeback-*.
"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import CAIRN, OUT, ROOT, build  # noqa: E402


def stack(disks, memory, bandwidth, seek):
    text = ""
    for i in range(disks):
        text += f"""
[device.m{i}]
type = "mem"
size = "1G"
block = 4096
[device.h{i}]
type = "delay"
base = "m{i}"
bandwidth = "{bandwidth}"
seek = "{seek}"
[device.c{i}]
type = "cache"
base = "h{i}"
memory = "{memory}"
"""
    members = ", ".join(f'"c{i}"' for i in range(disks))
    text += f"""
[device.s]
type = "stripe"
members = [{members}]
chunk = "64K"
metadata = "none"
"""
    path = os.path.join(OUT, f"writeback-{disks}.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def run(path, disks, mode, runtime, warmup, rnd):
    stem = os.path.join(OUT, f"writeback-{disks}-{mode}-{rnd}")
    cmd = [CAIRN, "--writeback", mode, "bench", path, "--rw", "randwrite", "--bs", "4k",
           "--iodepth", "32", "--size", f"{disks}G", "--runtime", str(runtime), "--time_based",
           "--timeline", "1s", "--timeline-csv", stem + ".csv", "--timeline-svg", stem + ".svg",
           "--output-format", "json"]
    started = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - started
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stderr}")
    report = json.loads(p.stdout)
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(stem + ".csv") as f:
        rows = list(csv.DictReader(f))
    # Whole seconds only (the last row is a partial interval).
    per_sec = [float(r["iops"]) for r in rows if float(r["seconds"]) <= runtime + 0.5][:runtime]
    steady = per_sec[warmup:]
    mean = statistics.mean(steady)
    return {
        "iops": report["jobs"][0]["write"]["iops"],
        "steady": mean,
        "cov": statistics.pstdev(steady) / mean,
        "cov_all": statistics.pstdev(per_sec) / statistics.mean(per_sec),
        "writeback": statistics.mean(float(r["writeback_bytes_per_second"]) for r in rows[warmup:runtime]),
        "exit": wall - runtime,
        "rows": rows[:runtime],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--disks", default="4")
    ap.add_argument("--memory", default="64M")
    ap.add_argument("--bandwidth", default="150M")
    ap.add_argument("--seek", default="4ms")
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    if args.warmup + 5 > args.runtime:
        sys.exit("--runtime must be at least --warmup + 5 seconds")
    build()
    os.makedirs(OUT, exist_ok=True)
    out = [f"Median of {args.rounds} interleaved rounds of {args.runtime} s each "
           f"(`bench/writeback.py --runtime {args.runtime} --rounds {args.rounds} --disks {args.disks} "
           f"--memory {args.memory} --bandwidth {args.bandwidth} --seek {args.seek} "
           f"--warmup {args.warmup}`).", "",
           "| disks | writeback | IOPS | steady IOPS | CoV (steady) | CoV (whole run) | "
           "write-back MB/s | exit (s) |",
           "|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for disks in [int(d) for d in args.disks.split(",")]:
        path = stack(disks, args.memory, args.bandwidth, args.seek)
        res = {"per-device": [], "shared": []}
        for rnd in range(args.rounds):
            order = ["per-device", "shared"] if rnd % 2 == 0 else ["shared", "per-device"]
            for mode in order:
                r = run(path, disks, mode, args.runtime, args.warmup, rnd)
                print(f"# {disks} disks, {mode}, round {rnd}: {r}", file=sys.stderr, flush=True)
                res[mode].append(r)
        med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "rows"}
               for m, rs in res.items()}
        for mode in ("per-device", "shared"):
            m = med[mode]
            out.append(f"| {disks} | {mode} | {m['iops']:.0f} | {m['steady']:.0f} | {m['cov']:.3f} | "
                       f"{m['cov_all']:.2f} | {m['writeback'] / 1e6:.2f} | {m['exit']:.1f} |")
        a, b = med["per-device"], med["shared"]
        verdicts.append(
            f"{disks} disks: per-device / shared = {a['iops'] / b['iops']:.2f}x IOPS over the run, "
            f"{a['steady'] / b['steady']:.2f}x steady (target >= 1.2x); CoV {a['cov']:.3f} against "
            f"{b['cov']:.3f}, {a['cov'] / b['cov']:.2f} of shared's (target <= 0.5)")
    print("\n".join(out + [""] + verdicts))


if __name__ == "__main__":
    main()
