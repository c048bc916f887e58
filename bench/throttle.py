#!/usr/bin/env python3
"""Rate limits: whether limits hold, how a group shares, and what an export
without limits pays.

  bench/throttle.py [--rounds N] [--runtime SECS] [--quick]

Everything lives in a fresh directory under /dev/shm, removed at the end (also on Ctrl-C
or SIGTERM) with every process the script started. The script runs target/release/cairn
(or CAIRN_BIN) and never builds it. Every run starts one cairn serve over mem devices
(1 GiB each) and measures with fio (ioengine=nbd, one connection per job) for --runtime
(10 s):

  iops    export `a` with `iops = 10000`: fio randread 4 KiB, iodepth 32. Target: within
          5% of 10000 (the throttle's first tenth of a second of burst is in the count).
  bps     export `a` with `bps = "50M"`: fio randwrite 64 KiB, iodepth 16. Target: within
          5% of 50 MiB/s.
  group   exports `a` and `b` in group `g` with `iops = 10000`: two fio randread jobs at
          once, one per export. Target: each within 10% of half.
  free    export `a` without limits, against the same server with `b` limited
          (`iops = 1000`, idle) and a server with no throttle at all: fio randread 4 KiB,
          iodepth 32, interleaved rounds. Target: >= 0.98x.

Medians of --rounds (3) rounds with the range. Tables (Markdown) on stdout, JSON in
bench/out/throttle-*.json, progress on stderr. The script reports what it measured; it
asserts nothing. --quick: 3 s runs, 1 round.
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
import threading
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbd  # noqa: E402
import thin  # noqa: E402
from thin import Failed, Cairn, run, fresh, out  # noqa: E402
from engine import OUT, ROOT  # noqa: E402

MiB = 1 << 20


def stack(d, exports):
    """A stack file: mem devices m0, m1 and exports {name: (device, extra keys)}."""
    text = "".join(f'[device.m{i}]\ntype = "mem"\nsize = "1G"\n' for i in range(2))
    for name, (dev, extra) in exports.items():
        text += f'[export.{name}]\ndevice = "{dev}"\n{extra}'
    path = os.path.join(d, "stack.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def server(d, exports):
    srv = Cairn(d, stack(d, exports))
    srv.uri = f"nbd+unix:///a?socket={srv.sock}"
    return srv.start()


def fio(srv, export, rw, bs, depth, runtime, what):
    uri = f"nbd+unix:///{export}?socket={srv.sock}"
    cmd = thin.fio_cmd(uri, rw, bs, depth, runtime=runtime, size="1G")
    o, _ = run(cmd, runtime + 60, what, load=True)
    j = nbd.parse_fio(o)
    job = j["jobs"][0]
    d = job["read"] if rw.endswith("read") else job["write"]
    return {"iops": d["iops"], "bytes_per_s": d["bw_bytes"], "cmd": cmd}


def one(a, name, exports, jobs):
    """Serves `exports`, runs fio `jobs` [(export, rw, bs, depth)] at once; returns
    their results."""
    d = fresh(name)
    srv = server(d, exports)
    try:
        results = [None] * len(jobs)

        def go(i, job):
            try:
                results[i] = fio(srv, *job, a.runtime, f"{name}: fio {job}")
            except Failed as e:
                results[i] = {"error": str(e)}

        threads = [threading.Thread(target=go, args=(i, j)) for i, j in enumerate(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        listed, _ = srv.admin("throttle", "list", "--json")
        rec = {"jobs": results, "throttles": json.loads(listed.splitlines()[-1] or "[]")}
    finally:
        rec_status = srv.stop()
        shutil.rmtree(d, ignore_errors=True)
    rec["exit_status"] = rec_status
    for r in results:
        if r and "error" in r:
            raise Failed(r["error"])
    return rec


def save(name, j):
    with open(os.path.join(OUT, f"throttle-{name}.json"), "w") as f:
        json.dump(j, f, indent=1, default=str)


def mm(v):
    return f"{statistics.median(v):.0f} ({min(v):.0f}..{max(v):.0f})" if v else "-"


def ratio(v):
    return f"{statistics.median(v):.3f}x ({min(v):.3f}..{max(v):.3f})" if v else "-"


def limits_part(a):
    cases = [
        ("iops", {"a": ("m0", "iops = 10000\n")}, [("a", "randread", "4k", 32)],
         lambda r: r["jobs"][0]["iops"], 10000, "IOPS"),
        ("bps", {"a": ("m0", 'bps = "50M"\n')}, [("a", "randwrite", "64k", 16)],
         lambda r: r["jobs"][0]["bytes_per_s"] / MiB, 50, "MiB/s"),
    ]
    out("## Limits held\n", "| limit | measured, median (range) | / limit (range) | target |",
        "|---|---|---|---|")
    for name, exports, jobs, measure, want, unit in cases:
        got = []
        for rnd in range(a.rounds):
            try:
                r = one(a, f"{name}-{rnd}", exports, jobs)
                save(f"{name}-{rnd}", r)
                got.append(measure(r))
                print(f"  {name} round {rnd + 1}: {got[-1]:.1f} {unit}", file=sys.stderr)
            except Failed as e:
                print(f"  {name} round {rnd + 1}: FAILED: {e}", file=sys.stderr)
        out(f"| {name} = {want} {unit} | {mm(got)} | {ratio([g / want for g in got])} | within 5% |")
    out("")


def group_part(a):
    exports = {"a": ("m0", 'iops = 10000\ngroup = "g"\n'), "b": ("m1", 'group = "g"\n')}
    jobs = [("a", "randread", "4k", 32), ("b", "randread", "4k", 32)]
    shares = {"a": [], "b": []}
    for rnd in range(a.rounds):
        try:
            r = one(a, f"group-{rnd}", exports, jobs)
            save(f"group-{rnd}", r)
            for k, j in zip("ab", r["jobs"]):
                shares[k].append(j["iops"])
            print(f"  group round {rnd + 1}: a {shares['a'][-1]:.0f}, b {shares['b'][-1]:.0f} IOPS",
                  file=sys.stderr)
        except Failed as e:
            print(f"  group round {rnd + 1}: FAILED: {e}", file=sys.stderr)
    out("## Two exports in one group (`iops = 10000` for both together)\n",
        "| export | IOPS, median (range) | / half (range) | target |", "|---|---|---|---|")
    for k in "ab":
        out(f"| {k} | {mm(shares[k])} | {ratio([v / 5000 for v in shares[k]])} | within 10% |")
    out("")


def free_part(a):
    variants = [
        ("no throttle", {"a": ("m0", "")}),
        ("beside a limited export", {"a": ("m0", ""), "b": ("m1", "iops = 1000\n")}),
    ]
    res = {k: [] for k, _ in variants}
    for rnd in range(a.rounds):
        for label, exports in (variants[::-1] if rnd % 2 else variants):
            try:
                r = one(a, f"free-{rnd}", exports, [("a", "randread", "4k", 32)])
                save(f"free-{label.replace(' ', '_')}-{rnd}", r)
                res[label].append(r["jobs"][0]["iops"])
                print(f"  free: {label} round {rnd + 1}: {res[label][-1]:.0f} IOPS", file=sys.stderr)
            except Failed as e:
                print(f"  free: {label} round {rnd + 1}: FAILED: {e}", file=sys.stderr)
    per = [b / n for n, b in zip(res["no throttle"], res["beside a limited export"])]
    out("## An export without limits\n", "| server | IOPS, median (range) |", "|---|---|")
    for k, _ in variants:
        out(f"| {k} | {mm(res[k])} |")
    out("", f"without limits beside a limited export / no throttle: {ratio(per)} (target >= 0.98x)", "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--runtime", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.runtime = a.runtime or (3 if a.quick else 10)
    thin.binary_check()
    if shutil.which("fio") is None or shutil.which("nbdinfo") is None:
        sys.exit("missing: fio, nbdinfo")
    os.makedirs(OUT, exist_ok=True)
    signal.signal(signal.SIGTERM, thin.on_signal)
    signal.signal(signal.SIGINT, thin.on_signal)
    thin.WORK["dir"] = tempfile.mkdtemp(prefix="cairn-throttle-bench-", dir=thin.SHM)
    try:
        rev = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                             stdout=subprocess.PIPE, text=True).stdout.strip()
        out(f"# Rate limits: `bench/throttle.py {' '.join(sys.argv[1:])}`\n",
            f"{a.rounds} round(s) of {a.runtime} s; cairn {rev}, {os.cpu_count()} CPUs.\n")
        limits_part(a)
        group_part(a)
        free_part(a)
    except KeyboardInterrupt:
        print("interrupted: stopping what runs and removing the files", file=sys.stderr)
        sys.exit(130)
    finally:
        thin.cleanup()


if __name__ == "__main__":
    main()
