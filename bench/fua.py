#!/usr/bin/env python3
"""FUA through a write-back cache and a volatile mem: this build against an earlier one.

  bench/fua.py [--before BIN|REV] [--runtime SECS] [--rounds N] [--only cache,hot,mem]
               [--fua-every 0,10,100] [--memory 256M] [--size 1G] [--hot 16M] [--iodepth 32]

cache  A cache used to turn every FUA write into a flush of everything dirty (write every
       dirty page back, then flush the base); it now sends only the FUA write's own pages
       through to the base, with FUA. One job writes random 4 KiB blocks at --iodepth over
       the whole --size of a cache of --memory over a file in /dev/shm (engine io_uring),
       the cache at the default [writeback] levels (so dirty data stays above the
       background level: pages are written back all the time and writers are paced),
       every Nth write with FUA (`cairn bench --fua-every N`) for each N of --fua-every
       (0: no FUA at all, the control: both builds run the same code then).
hot    The same over only the first --hot bytes (a hot set below the background level:
       nothing is written back but for flushes, FUA and `expire`).
mem    A volatile mem kept its unflushed pages in one mutex-guarded hash map (a boxed page
       allocated per page written) and flushed all of them for a FUA write; it now writes
       to its store without a lock and keeps a durable copy that FUA writes update for
       their own range. Two jobs (two reactors) write random 4 KiB blocks at --iodepth to
       mem:--size,volatile=1, every Nth write with FUA as above.

--before names the build to compare with: an executable, or a git revision built once in
a worktree under bench/out/ (default 093ee74, the commit that added --fua-every, before
the mem and cache changes). The other side is this tree's release build (or $CAIRN_BIN).
Each round runs both, in alternating order (odd rounds run the before build first), on a
fresh base file; the table gives medians over the rounds, and each ratio is the median
of the per-round ratios with their spread (min..max).

  IOPS          writes a second, FUA ones included
  FUA clat      completion latency of the FUA writes: mean and 99th percentile
  write clat    mean completion latency of all writes (FUA ones included)

Each run's JSON report goes to bench/out/fua-*.json. /dev/shm makes the base's own FUA
(RWF_DSYNC) and flush (fdatasync) nearly free, so what is measured is the cache's own
work; on a disk, each avoided flush would also save the disk's cache flush.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import CAIRN, OUT, build  # noqa: E402
from nbd import before_binary  # noqa: E402

BASE = "/dev/shm/cairn-fua-base.img"
DEFAULT_BEFORE = "093ee74"


def cache_stack(memory, size):
    path = os.path.join(OUT, "fua-cache.toml")
    with open(path, "w") as f:
        f.write(f"""[device.f]
type = "file"
path = "{BASE}"
size = "{size}"
engine = "io_uring"

[device.c]
type = "cache"
base = "f"
memory = "{memory}"
""")
    return path


def run(binary, target, label, case, every, args, rnd):
    if os.path.exists(BASE):
        os.remove(BASE)
    cmd = [binary, "bench"] + target + [
        "--rw", "randwrite", "--bs", "4k", "--iodepth", str(args.iodepth),
        "--runtime", str(args.runtime), "--time_based", "--fua-every", str(every),
        "--output-format", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stderr}")
    report = json.loads(p.stdout)
    with open(os.path.join(OUT, f"fua-{case}-{every}-{label}-{rnd}.json"), "w") as f:
        json.dump(report, f, indent=1)
    w = report["jobs"][0]["write"]
    fua = report["cairn"]["fua_writes"]
    return {
        "iops": w["iops"],
        "fua_iops": fua["iops"],
        "fua_mean_us": fua["clat_ns"]["mean"] / 1e3,
        "fua_p99_us": fua["clat_ns"]["percentile"].get("99.000000", 0) / 1e3,
        "clat_mean_us": w["clat_ns"]["mean"] / 1e3,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=DEFAULT_BEFORE, metavar="BIN|REV")
    ap.add_argument("--runtime", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="cache,hot,mem")
    ap.add_argument("--fua-every", default="0,10,100")
    ap.add_argument("--memory", default="256M")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--hot", default="16M")
    ap.add_argument("--iodepth", type=int, default=32)
    args = ap.parse_args()
    build()
    os.makedirs(OUT, exist_ok=True)
    before, rev = before_binary(args.before)
    cases = {
        "cache": ([cache_stack(args.memory, args.size)],
                  f"cache of {args.memory} over a {args.size} file in /dev/shm, 1 job"),
        "hot": ([cache_stack(args.memory, args.size), "--size", args.hot],
                f"the same, first {args.hot} only"),
        "mem": (["--device", f"mem:{args.size},volatile=1", "--numjobs", "2"],
                f"mem:{args.size},volatile=1, 2 jobs"),
    }
    sides = [("this", CAIRN), ("before", before)]
    out = [f"`bench/fua.py --before {args.before} --runtime {args.runtime} --rounds {args.rounds} "
           f"--only {args.only} --fua-every {args.fua_every} --memory {args.memory} "
           f"--size {args.size} --hot {args.hot} --iodepth {args.iodepth}`: 4 KiB random writes, iodepth "
           f"{args.iodepth} per job, medians of {args.rounds} rounds of {args.runtime} s, this "
           f"build and {rev} alternating.", "",
           "| device | FUA every | build | IOPS | FUA writes/s | FUA clat mean (µs) | "
           "FUA clat p99 (µs) | write clat mean (µs) |",
           "|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for case in args.only.split(","):
        target, title = cases[case]
        for every in [int(n) for n in args.fua_every.split(",")]:
            res = {label: [] for label, _ in sides}
            for rnd in range(args.rounds):
                for label, binary in (sides[::-1] if rnd % 2 else sides):
                    r = run(binary, target, label, case, every, args, rnd)
                    print(f"# {case}, every {every}, {label}, round {rnd}: {r}",
                          file=sys.stderr, flush=True)
                    res[label].append(r)
            for label, _ in sides:
                m = {k: statistics.median(r[k] for r in res[label]) for k in res[label][0]}
                fua = (f"{m['fua_iops']:.0f} | {m['fua_mean_us']:.0f} | {m['fua_p99_us']:.0f}"
                       if every else "- | - | -")
                out.append(f"| {title} | {every or '-'} | {'this' if label == 'this' else rev} | "
                           f"{m['iops']:.0f} | {fua} | {m['clat_mean_us']:.1f} |")

            def ratio(key):
                per = [a[key] / b[key] for a, b in zip(res["this"], res["before"]) if b[key] > 0]
                if not per:
                    return "-"
                return f"{statistics.median(per):.2f}x ({min(per):.2f}..{max(per):.2f})"

            line = f"{case}, FUA every {every or '- (none)'}: this / {rev}: IOPS {ratio('iops')}"
            if every:
                line += (f", FUA clat mean {ratio('fua_mean_us')}, "
                         f"FUA clat p99 {ratio('fua_p99_us')}")
            verdicts.append(line)
    if os.path.exists(BASE):
        os.remove(BASE)
    print("\n".join(out + [""] + verdicts))


if __name__ == "__main__":
    main()
