#!/usr/bin/env python3
"""The engine benchmarks, side by side with fio in one run.

  bench/engine.py [--runtime SECS] [--rounds N] [--only NAME,...]

Each comparison runs its variants in interleaved rounds (A B A B ...) and reports the
median of the per-round ratios with their spread (min..max), so drift on a shared machine
hits every variant alike. Raw JSON from every run goes to bench/out/engine-*.json; the summary table goes to stdout (Markdown).

Comparisons:
  null      4 KiB randread, iodepth 32, 1 job, on a null device: cairn vs fio's null engine
  uring     1 GiB file in /dev/shm, 4 KiB randread, iodepth 32: cairn io_uring vs fio io_uring,
            cairn at its default (sleep as soon as nothing completed) and with --idle-poll 5us
  aio       same file: cairn aio vs fio libaio
  jobs      two jobs (two reactors, one per core) against one, 4 KiB randread qd32, on a
            null device and on a raid10 over four mem devices
  clock     technique 2: null, stats on: --clock cached vs --clock precise
  stats     null: --stats on vs --stats off
  reap      technique 5: the /dev/shm file, --reap eager vs lazy, on aio; and on io_uring
            as a control (both modes run the same code there, so its ratio is the noise)
  reaploop  technique 5 where completions arrive asynchronously: a loop device with direct
            I/O over the /dev/shm file, read with O_DIRECT (root only; the script attaches
            and detaches the loop device)
  metrics   statistics off the hot path: null, and a raid10 of 4 null members (raw,
            metadata = "none": null members keep nothing), with Prometheus metrics
            scraped every 100 ms (`--metrics`) vs not served at all
  reapdisk  technique 5 on a file on the root disk with O_DIRECT (not in the default set:
            the disk is slow and drifts; --disk-file sets the 1 GiB file to use)

fio runs with --norandommap --randrepeat=0 (cairn's offsets are uniformly random too) and
records completion latency, as cairn does. cairn's null device zeroes read buffers;
fio's null engine does not touch them.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "bench", "out")
# CAIRN_BIN: a copy of the binary to measure (so that building goes on meanwhile); without
# it, the scripts build and measure target/release/cairn.
CAIRN = os.environ.get("CAIRN_BIN") or os.path.join(ROOT, "target", "release", "cairn")


def build():
    if not os.environ.get("CAIRN_BIN"):
        subprocess.run(["cargo", "build", "--release", "-q"], cwd=ROOT, check=True)
SHM_FILE = "/dev/shm/cairn-bench-1g"


def sh(cmd):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr}")
    return r.stdout


def prepare():
    if shutil.which("fio") is None:
        if os.geteuid() == 0:
            subprocess.run(["apt-get", "install", "-y", "-qq", "fio"], check=True)
        else:
            sys.exit("fio is not installed (apt-get install fio)")
    build()
    os.makedirs(OUT, exist_ok=True)
    if not os.path.exists(SHM_FILE) or os.path.getsize(SHM_FILE) != 1 << 30:
        with open(SHM_FILE, "wb") as f:
            for _ in range(1024):
                f.write(os.urandom(1 << 20))


def fio(engine, runtime, filename=None):
    cmd = ["fio", "--name=bench", f"--ioengine={engine}", "--rw=randread", "--bs=4k",
           "--iodepth=32", "--numjobs=1", f"--runtime={runtime}", "--time_based",
           "--norandommap", "--randrepeat=0", "--group_reporting", "--output-format=json"]
    cmd += [f"--filename={filename}"] if filename else ["--size=1G"]
    return json.loads(sh(cmd))


def free_port():
    import socket
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def scraped(run, every=0.1):
    """Runs `run(metrics_arg)` while a thread GETs its /metrics every `every` seconds;
    returns run's result, with the number of successful scrapes under ["scrapes"]."""
    import threading
    import time
    import urllib.request
    port = free_port()
    stop = threading.Event()
    count = [0]

    def scrape():
        while not stop.is_set():
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read()
                count[0] += 1
            except OSError:
                pass
            time.sleep(every)

    t = threading.Thread(target=scrape)
    t.start()
    try:
        j = run(f"tcp:127.0.0.1:{port}")
    finally:
        stop.set()
        t.join()
    j["scrapes"] = count[0]
    return j


def cairn(device, runtime, *switches, pin=False, bench_args=()):
    # Pinning the reactor to CPU 0 leaves CPU 1 to the kernel's workers (io-wq, loop),
    # which makes run-to-run drift smaller; used for the reap comparisons.
    prefix = ["taskset", "-c", "0"] if pin and shutil.which("taskset") else []
    cmd = [*prefix, CAIRN, *switches, "bench", "--device", device, "--rw", "randread", "--bs", "4k",
           "--iodepth", "32", "--numjobs", "1", "--runtime", str(runtime), "--time_based",
           "--output-format", "json", *bench_args]
    return json.loads(sh(cmd))


def summary(j):
    job = j["jobs"][0]
    r = job["read"]
    out = {"iops": r["iops"], "clat_mean_ns": r["clat_ns"]["mean"],
           "clat_p99_ns": r["clat_ns"]["percentile"].get("99.000000", 0), "ctx": job["ctx"]}
    if "cairn" in j:
        reaps = j["cairn"]["reaps"]
        out["reaps"] = {k.split(".")[0] if k.endswith(".000000") else k: v
                        for k, v in reaps["percentile"].items()}
        out["reaps_nonempty"] = reaps["nonempty"]
    return out


def compare(name, variants, rounds, summarize=None, prefix="engine", alternate=False):
    """Runs each (label, thunk) of `variants` once per round, interleaved, keeping every
    run's JSON in bench/out/ (with `alternate`, odd rounds run them in reverse order).
    Returns {label: [summarize(json) per round]}."""
    summarize = summarize or summary
    results = {label: [] for label, _ in variants}
    for rnd in range(rounds):
        for label, thunk in (variants[::-1] if alternate and rnd % 2 else variants):
            j = thunk()
            with open(os.path.join(OUT, f"{prefix}-{name}-{label.replace(' ', '_')}-{rnd}.json"), "w") as f:
                json.dump(j, f, indent=1)
            results[label].append(summarize(j))
            iops = j["jobs"][0]["read"]["iops"] + j["jobs"][0]["write"]["iops"]
            print(f"  {name}: {label} round {rnd + 1}: {iops:.0f} IOPS", file=sys.stderr)
    return results


def med(rs, key):
    return statistics.median(r[key] for r in rs)


def fmt_iops(v):
    return f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.0f}k"


def reap_cells(rs):
    # Median over rounds of each completions-per-reap percentile.
    keys = ["1", "10", "50", "90", "99.990000"]
    return " / ".join(str(int(statistics.median(r["reaps"][k] for r in rs))) for k in keys)


def raid10_file(name, leaf, size, metadata=None):
    """bench/out/NAME: device r, a raid10 over four `leaf` devices m0..m3 of `size`, with
    superblocks (the default) or `metadata` ("none": the raw layout)."""
    path = os.path.join(OUT, name)
    with open(path, "w") as f:
        for i in range(4):
            f.write(f'[device.m{i}]\ntype = "{leaf}"\nsize = "{size}"\n')
        f.write('[device.r]\ntype = "raid10"\nmembers = ["m0", "m1", "m2", "m3"]\n')
        if metadata:
            f.write(f'metadata = "{metadata}"\n')
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="null,uring,aio,jobs,clock,stats,reap,reaploop")
    ap.add_argument("--disk-file", default="/var/tmp/cairn-disk-1g")
    args = ap.parse_args()
    only = set(args.only.split(","))
    prepare()
    t, n = args.runtime, args.rounds
    rows = []

    def ratio_row(title, res, a, b, need, tie=0.0):
        # The ratio is the median of the per-round ratios (each round's A over the same
        # round's B), with their spread; A and B are the medians of their own runs.
        ia, ib = med(res[a], "iops"), med(res[b], "iops")
        per = [x["iops"] / y["iops"] for x, y in zip(res[a], res[b])]
        r = statistics.median(per)
        ok = "yes" if r >= need else ("tie" if r >= need - tie else "NO")
        rows.append(f"| {title} | {a}: {fmt_iops(ia)} | {b}: {fmt_iops(ib)} | {r:.2f}x "
                    f"({min(per):.2f}..{max(per):.2f}) | >= {need}x | {ok} |")

    if "null" in only:
        res = compare("null", [("cairn null", lambda: cairn("null:1G", t)),
                               ("fio null", lambda: fio("null", t))], n)
        ratio_row("4K randread qd32, null device", res, "cairn null", "fio null", 2.0)
    if "uring" in only:
        # tmpfs has no non-blocking reads here, so both programs' reads all run on an
        # io-wq worker, the bottleneck. fio submits each request with an io_uring_enter
        # that also collects (GETEVENTS, min_complete 0) and so never sleeps while it has
        # requests to send; cairn sleeps as soon as nothing has completed, and each sleep
        # costs the worker a wake-up. `--idle-poll 5us` (poll briefly before sleeping)
        # is fio's behaviour; the default (sleep at once) is measured too.
        shm = f"file:{SHM_FILE},engine=io_uring"
        res = compare("uring", [("cairn io_uring", lambda: cairn(shm, t)),
                                ("fio io_uring", lambda: fio("io_uring", t, SHM_FILE)),
                                ("cairn io_uring --idle-poll 5us",
                                 lambda: cairn(shm, t, bench_args=("--idle-poll", "5us")))], n)
        ratio_row("4K randread qd32, 1 GiB /dev/shm file", res, "cairn io_uring", "fio io_uring", 1.0)
        ratio_row("the same, cairn polling 5 us before it sleeps", res,
                  "cairn io_uring --idle-poll 5us", "fio io_uring", 1.0)
    if "aio" in only:
        res = compare("aio", [("cairn aio", lambda: cairn(f"file:{SHM_FILE},engine=aio", t)),
                              ("fio libaio", lambda: fio("libaio", t, SHM_FILE))], n)
        ratio_row("4K randread qd32, 1 GiB /dev/shm file", res, "cairn aio", "fio libaio", 1.0)
    if "jobs" in only:
        # Two reactors on the two cores against one: each job has its own reactor and its
        # own queues, so nothing is shared on the I/O path.
        stack_file = raid10_file("jobs-raid10.toml", "mem", "256M")
        for label, target in (("null", ["--device", "null:1G"]),
                              ("raid10 over four mem", [stack_file, "--device", "r"])):
            def jobs(k, target=target):
                cmd = [CAIRN, "bench", *target, "--rw", "randread", "--bs", "4k", "--iodepth",
                       "32", "--numjobs", str(k), "--runtime", str(t),
                       "--time_based", "--output-format", "json"]
                return json.loads(sh(cmd))
            res = compare(f"jobs-{label.split()[0]}", [("2 jobs", lambda: jobs(2)),
                                                       ("1 job", lambda: jobs(1))], n)
            ratio_row(f"4K randread qd32, two jobs against one: {label}", res, "2 jobs", "1 job", 1.8)
    if "clock" in only:
        res = compare("clock", [("clock cached", lambda: cairn("null:1G", t, "--clock", "cached")),
                                ("clock precise", lambda: cairn("null:1G", t, "--clock", "precise"))], n)
        ratio_row("technique 2: null, stats on", res, "clock cached", "clock precise", 1.09)
    if "stats" in only:
        res = compare("stats", [("stats on", lambda: cairn("null:1G", t, "--stats", "on")),
                                ("stats off", lambda: cairn("null:1G", t, "--stats", "off"))], n)
        ratio_row("statistics cost: null (on/off must be > 0.95)", res, "stats on", "stats off", 0.95)
    if "metrics" in only:
        # Raw: null members cannot keep superblocks.
        stack = raid10_file("metrics-raid10.toml", "null", "1G", metadata="none")
        for label, dev in (("null", "null:1G"), ("raid10 of null", f"{stack}")):
            target = ["--device", "r"] if dev == stack else []

            def run(metrics=None, dev=dev, target=target):
                extra = ["--metrics", metrics] if metrics else []
                if dev.endswith(".toml"):
                    cmd = [CAIRN, "bench", dev, *target, "--rw", "randread", "--bs", "4k",
                           "--iodepth", "32", "--numjobs", "1", "--runtime", str(t),
                           "--time_based", "--output-format", "json", *extra]
                    return json.loads(sh(cmd))
                return cairn(dev, t, bench_args=extra)

            scrapes = []

            def with_scrapes(run=run):
                j = scraped(run)
                scrapes.append(j["scrapes"])
                return j

            res = compare(f"metrics-{label.replace(' ', '-')}",
                          [("scraped", with_scrapes), ("no metrics", run)], n)
            ratio_row(f"metrics scraped every 100 ms ({min(scrapes)}+ scrapes a run): {label}",
                      res, "scraped", "no metrics", 0.97)
    reap_rows = []
    reap_sets = []
    if "reap" in only:
        reap_sets += [("aio", f"file:{SHM_FILE},engine=aio", "aio /dev/shm"),
                      ("io_uring", f"file:{SHM_FILE},engine=io_uring",
                       "io_uring /dev/shm (control: same code path in both modes)")]
    loop = None
    if "reaploop" in only:
        if os.geteuid() != 0:
            print("reaploop: skipped (needs root for losetup)", file=sys.stderr)
        else:
            loop = sh(["losetup", "--direct-io=on", "-f", "--show", SHM_FILE]).strip()
            reap_sets += [("aio", f"file:{loop},engine=aio,direct=1", "aio loop-dio")]
    if "reapdisk" in only:
        if not os.path.exists(args.disk_file) or os.path.getsize(args.disk_file) != 1 << 30:
            subprocess.run(["dd", "if=/dev/urandom", f"of={args.disk_file}", "bs=1M", "count=1024",
                            "oflag=direct", "status=none"], check=True)
        reap_sets += [(e, f"file:{args.disk_file},engine={e},direct=1", f"{e} disk O_DIRECT")
                      for e in ("io_uring", "aio")]
    try:
        run_reap_sets(reap_sets, t, n, ratio_row, reap_rows)
    finally:
        if loop:
            subprocess.run(["losetup", "-d", loop], check=False)

    print(f"\nMedian of {n} interleaved rounds of {t} s each (`bench/engine.py --runtime {t} --rounds {n}`).\n")
    print("| comparison | A | B | A/B | target | met |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(r)
    if reap_rows:
        print("\nTechnique 5, completions per reap (percentiles 1 / 10 / 50 / 90 / 99.99):\n")
        print("| file | reap | IOPS | clat mean (µs) | clat p99 (µs) | ctx | completions per reap |")
        print("|---|---|---|---|---|---|---|")
        for r in reap_rows:
            print(r)


def run_reap_sets(reap_sets, t, n, ratio_row, reap_rows):
    """Runs eager against lazy on each (engine, device, label)."""
    if reap_sets:
        for engine, dev, where in reap_sets:
            res = compare(f"reap-{where.replace(' ', '-').replace('/', '')}", [
                ("eager", lambda dev=dev: cairn(dev, t, "--reap", "eager", pin=True)),
                ("lazy", lambda dev=dev: cairn(dev, t, "--reap", "lazy", pin=True))], n)
            # "Not worse": a ratio within 3% of 1 is a tie, the spread the control shows.
            need = 0.0 if "control" in where else 1.0
            ratio_row(f"technique 5: {where}, reap", res, "eager", "lazy", need, tie=0.03)
            for label in ("eager", "lazy"):
                rs = res[label]
                reap_rows.append(
                    f"| {where} | {label} | {fmt_iops(med(rs, 'iops'))} | {med(rs, 'clat_mean_ns') / 1000:.1f} | "
                    f"{med(rs, 'clat_p99_ns') / 1000:.1f} | {int(med(rs, 'ctx'))} | {reap_cells(rs)} |")


if __name__ == "__main__":
    main()
