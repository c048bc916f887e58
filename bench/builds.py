#!/usr/bin/env python3
"""This build against another, in process: `cairn bench` on stacks, thin volumes and
crypt devices, each stack run by both binaries in interleaved rounds.

  bench/builds.py --before BIN|REV [--rounds N] [--runtime SECS] [--only CASES] [--pin]

NBD serving has its own comparison (bench/nbd.py --before); this one covers the layers
above the leaves, where a change of code layout (crates, capabilities, wrappers that
forward through one base) could cost a request something. --before takes a binary or a
git revision, built once in a worktree under bench/out/ as bench/nbd.py does.

Cases (--only, default all), 4 KiB requests at iodepth 32, one job (one reactor thread):
  stripe-read    stripe (chunk 64K, no superblocks) over four null devices, randread:
                 the inline stacked dispatch path with no data copied
  raid10-read    raid10 over four 256 MiB mem devices at the default (superblocks and a
  raid10-write   write-intent bitmap), randread / randwrite
  thin-read      a 1 GiB thin volume in a pool on a sparse file in /dev/shm, written
  thin-write     in full first (cairn bench --rw=write --bs=1M, once per binary, each
                 binary with its own pool), then randread / randwrite over it
  crypt-read     crypt (LUKS2, AES-256-XTS, 4096-byte sectors) over a 256 MiB mem device,
  crypt-write    created afresh every run, randread / randwrite

Every run is a fresh process. Reported per case: each binary's median IOPS, the median and
range of the per-round ratio (this build over the other; odd rounds run the other first),
and CPU per I/O: the user + system seconds the bench process used (getrusage of the child,
so opening the stack is included, a few ms against --runtime) over the I/Os it completed,
shown the other way up (above 1: this build uses less). --pin runs both on CPU 0.
Markdown on stdout, every run's JSON in bench/out/builds-*.json; it asserts nothing.
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import CAIRN, OUT, build, fmt_iops  # noqa: E402
from nbd import before_binary  # noqa: E402

CASES = ["stripe-read", "raid10-read", "raid10-write", "thin-read", "thin-write",
         "crypt-read", "crypt-write"]
PASS = b"benchmark passphrase"


def stack_text(kind, d):
    """The stack file of a case's kind, and the device to load."""
    if kind == "stripe":
        text = "".join(f'[device.n{i}]\ntype = "null"\nsize = "1G"\n' for i in range(4))
        text += ('[device.s]\ntype = "stripe"\nchunk = "64K"\nmetadata = "none"\n'
                 'members = ["n0", "n1", "n2", "n3"]\n')
        return text, "s"
    if kind == "raid10":
        text = "".join(f'[device.m{i}]\ntype = "mem"\nsize = "256M"\n' for i in range(4))
        text += '[device.r]\ntype = "raid10"\nmembers = ["m0", "m1", "m2", "m3"]\n'
        return text, "r"
    if kind == "thin":
        return (f'[device.d]\ntype = "file"\npath = "{d}/data"\nsize = "8G"\nsparse = true\n'
                '[device.pool]\ntype = "thin-pool"\ndata = "d"\n'
                '[device.vm]\ntype = "thin"\npool = "pool"\nsize = "1G"\n'), "vm"
    pf = os.path.join(d, "pass")
    with open(pf, "wb") as f:
        f.write(PASS)
    return ('[device.m]\ntype = "mem"\nsize = "256M"\n'
            f'[device.c]\ntype = "crypt"\nbase = "m"\npassphrase_file = "{pf}"\n'
            'create = true\nformat = "luks2"\nkdf = "pbkdf2"\nkdf_iterations = 1000\n'), "c"


def bench(binary, stack, device, rw, bs, runtime, pin, extra=()):
    """One `cairn bench` run: its JSON, with the child's CPU seconds under ["cpu_s"]."""
    prefix = ["taskset", "-c", "0"] if pin and shutil.which("taskset") else []
    cmd = [*prefix, binary, "bench", "--log-level", "warn", stack, "--device", device,
           f"--rw={rw}", f"--bs={bs}", "--iodepth=32", "--numjobs=1", "--output-format=json",
           *extra]
    if runtime:
        cmd += [f"--runtime={runtime}", "--time_based"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
    j = json.loads(r.stdout)
    j["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return j


class Variant:
    """One binary's side of the comparison: a directory of its own under /dev/shm, and
    for the thin cases a pool written in full once."""

    def __init__(self, label, binary, top):
        self.label, self.binary = label, binary
        self.dir = tempfile.mkdtemp(prefix=f"{label}-", dir=top)
        self.filled = set()

    def run(self, case, runtime, pin):
        kind, rw = case.split("-")
        text, device = stack_text(kind, self.dir)
        stack = os.path.join(self.dir, f"{kind}.toml")
        with open(stack, "w") as f:
            f.write(text)
        if kind == "thin" and kind not in self.filled:
            bench(self.binary, stack, device, "write", "1M", None, pin, ["--size=1G"])
            self.filled.add(kind)
        j = bench(self.binary, stack, device, "rand" + rw, "4k", runtime, pin)
        job = j["jobs"][0]
        ios = job["read"]["total_ios"] + job["write"]["total_ios"]
        return j, {"iops": job["read"]["iops"] + job["write"]["iops"],
                   "cpu_per_io_us": j["cpu_s"] / max(ios, 1) * 1e6}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("--before", required=True, help="a cairn binary or a git revision")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--runtime", type=int, default=4)
    p.add_argument("--only", default=",".join(CASES))
    p.add_argument("--pin", action="store_true")
    a = p.parse_args()
    cases = [c for c in a.only.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"--only: unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    build()
    before, rev = before_binary(a.before)
    os.makedirs(OUT, exist_ok=True)
    top = tempfile.mkdtemp(prefix="cairn-builds-", dir="/dev/shm")
    try:
        sides = [Variant("now", CAIRN, top), Variant("before", before, top)]
        res = {c: {v.label: [] for v in sides} for c in cases}
        for rnd in range(a.rounds):
            for case in cases:
                for v in (sides[::-1] if rnd % 2 else sides):
                    j, s = v.run(case, a.runtime, a.pin)
                    with open(os.path.join(OUT, f"builds-{case}-{v.label}-{rnd}.json"), "w") as f:
                        json.dump(j, f, indent=1)
                    res[case][v.label].append(s)
                    print(f"  {case}: {v.label} round {rnd + 1}: {s['iops']:.0f} IOPS, "
                          f"{s['cpu_per_io_us']:.3f} us CPU/I/O", file=sys.stderr)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    print(f"cairn bench, this build / {rev}, 4 KiB qd32, {a.rounds} rounds of {a.runtime} s"
          f"{', pinned to CPU 0' if a.pin else ''}:\n")
    print("| case | this build | before | ratio | spread | CPU / I/O, before / this build | spread |")
    print("|---|---|---|---|---|---|---|")
    for case in cases:
        now, then = res[case]["now"], res[case]["before"]
        r = [x["iops"] / y["iops"] for x, y in zip(now, then)]
        c = [y["cpu_per_io_us"] / x["cpu_per_io_us"] for x, y in zip(now, then)]
        print(f"| {case} | {fmt_iops(statistics.median(x['iops'] for x in now))} | "
              f"{fmt_iops(statistics.median(y['iops'] for y in then))} | "
              f"{statistics.median(r):.3f}x | {min(r):.3f}..{max(r):.3f} | "
              f"{statistics.median(c):.3f}x | {min(c):.3f}..{max(c):.3f} |")


if __name__ == "__main__":
    main()
