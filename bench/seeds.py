#!/usr/bin/env python3
"""Each of the five techniques reproduced by one command, beside the original's figures.

  bench/seeds.py [1-5 | all | flush clock writeback dispatch reap ...]
                 [--rounds 5] [--runtime 5] [--wb-runtime 20] [--wb-disks 1,4,10]
                 [--slices 5] [--no-callgrind]

For each technique cairn's "before" (the switch that turns it off) and "after" (the
default) run side by side in one run: interleaved rounds (before, after, after, before,
...), medians over rounds. Every ratio printed is the median of the per-round ratios (each
round's after over the same round's before), with its spread (min..max over rounds). The
original's figures come from its patch (../shared/seeds/, DESIGN.md's table) and are
printed first, in the original's own units and shape, then cairn's in the same shape.

  1 flush      md "batch flush requests" (v5.2): dbench, 128 clients on a RAID10.
               End to end: `cairn serve` of a raid10 over four delay(flush = 1ms) over mem
               on a Unix socket, fio's nbd engine with 32 jobs (one connection each,
               the export is multi-conn), 4 KiB randwrite with --fsync=1: MB/s and flush
               latency mean and max, --flush batched against serial. In process: cairn
               bench on the same raid10, 128 clients (iodepth 128, --fsync 1).
  2 clock      block "cache current nsec time in struct blk_plug" (v6.9): null device,
               statistics on, 4 KiB randread qd32: IOPS and clock reads per I/O,
               --clock cached against precise; with perf, a `perf diff` of the two runs'
               clock symbols (where the time went).
  3 writeback  "writeback: switch to per-bdi threads" (2.6.32): caches over modelled
               rotational disks (bench/writeback.py's stack), 1, 4 and 10 disks, random
               4 KiB writes: IOPS, steady IOPS and their CoV, --writeback per-device
               against shared, and the per-second timeline of both modes side by side
               (the round with the median steady IOPS).
  4 dispatch   dm "fix excessive dm-mq context switching" (v4.6): linear and stripe over
               null against bare null, 4 KiB randread qd32: IOPS and context switches,
               --dispatch inline against handoff; against bare null with statistics on
               (the default) and off, each round `--slices` one-second runs of each,
               alternating; with valgrind, instructions per I/O of both.
  5 reap       QEMU "linux-aio: process completions from ioq_submit()" (2.7): a 1 GiB file
               in /dev/shm through linux-aio (completions are ready at submit), 4 KiB
               randread at iodepth 128 (the original's ring size), --reap eager against
               lazy: completions per reap at the original's percentiles, IOPS and MB/s,
               mean completion latency. As root, the same through a loop device in
               direct-I/O mode, where completions arrive after the submit.

Raw JSON of every run goes to bench/out/seeds-*.json. Needs fio (technique 1: with its nbd
engine) and, for technique 2's profile, perf (skipped with a note without it).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import CAIRN, OUT, SHM_FILE, build, prepare, sh  # noqa: E402
import stack  # noqa: E402
import writeback  # noqa: E402

NAMES = ["flush", "clock", "writeback", "dispatch", "reap"]


def rounds(name, before, after, n):
    """Runs the (label, thunk) pairs `before` and `after` once per round, alternating
    which goes first, keeping every run's JSON. Returns ([before results], [after
    results])."""
    res = {before[0]: [], after[0]: []}
    for r in range(n):
        order = [before, after] if r % 2 == 0 else [after, before]
        for label, thunk in order:
            out = thunk()
            with open(os.path.join(OUT, f"seeds-{name}-{label.replace(' ', '_')}-{r}.json"), "w") as f:
                json.dump(out, f, indent=1, default=str)
            res[label].append(out)
            print(f"  {name}: {label} round {r + 1}/{n} done", file=sys.stderr, flush=True)
    return res[before[0]], res[after[0]]


def med(values):
    return statistics.median(values)


def spread(before, after, key):
    """Median of the per-round ratios after/before of `key`, and their min..max."""
    ratios = [a[key] / b[key] for a, b in zip(after, before) if b[key]]
    return f"{med(ratios):.2f}x (rounds {min(ratios):.2f}..{max(ratios):.2f}, n={len(ratios)})"


def title(n, text):
    print(f"\n{'=' * 78}\n{n}. {text}\n{'=' * 78}")


# 1. Flush batching

def wait_socket(path, proc, limit=30):
    end = time.time() + limit
    while time.time() < end:
        if os.path.exists(path):
            return
        if proc.poll() is not None:
            sys.exit(f"cairn serve exited with {proc.returncode}")
        time.sleep(0.05)
    sys.exit("cairn serve: no socket after 30 s")


def flush_served(mode, runtime, jobs, stack_file):
    """cairn serve (--flush MODE) of the raid10, fio's nbd engine with JOBS connections."""
    d = tempfile.mkdtemp(prefix="cairn-seeds-")
    sock = os.path.join(d, "nbd.sock")
    log = open(os.path.join(d, "log"), "w")
    srv = subprocess.Popen([CAIRN, "--flush", mode, "serve", stack_file, "--device", "r",
                            "--listen", f"unix:{sock}"], stdout=log, stderr=log)
    try:
        wait_socket(sock, srv)
        text = sh(["fio", "--name=flush", "--ioengine=nbd",
                           f"--uri=nbd+unix:///?socket={sock}", "--rw=randwrite", "--bs=4k",
                           "--fsync=1", "--iodepth=1", f"--numjobs={jobs}", "--size=256M",
                           "--norandommap", "--randrepeat=0", f"--runtime={runtime}",
                           "--time_based", "--group_reporting", "--output-format=json"])
        j = json.loads(text[text.index("{"):])
    finally:
        srv.terminate()
        srv.wait()
        shutil.rmtree(d, ignore_errors=True)
    job = j["jobs"][0]
    w, s = job["write"], job["sync"]
    return {"mbps": w["bw_bytes"] / 1e6, "iops": w["iops"],
            "flush_mean_ms": s["lat_ns"]["mean"] / 1e6, "flush_max_ms": s["lat_ns"]["max"] / 1e6,
            "flushes": s["total_ios"], "json": j}


def flush_inproc(mode, runtime, stack_file):
    j = stack.bench(stack_file, "r", runtime, "--rw", "randwrite", "--iodepth", "128",
                    "--fsync", "1", switches=("--flush", mode))
    s = stack.summary(j)
    return {"mbps": s["write_bw"] / 1e6, "iops": s["write_iops"],
            "flush_mean_ms": s["flush_mean"] / 1e6, "flush_max_ms": s["flush_max"] / 1e6,
            "flushes": s["flushes"], "json": j}


def technique_flush(a):
    title(1, 'Flush batching: md "batch flush requests" (Linux v5.2)')
    print("""The original (dbench on a raid10 of 4 SSDs, from the patch; flush latency from
DESIGN.md's table):
  before (serial)   Throughput 345.009 MB/sec (sync open)  128 clients  128 procs  max_latency=267.939 ms
  after (batched)   Throughput 1034.88 MB/sec (sync open)  128 clients  128 procs  max_latency=60.712 ms
  after / before = 3.00x; flush latency 3.97 ms -> 0.013 ms""")
    f = stack.stack_file("t1")
    for what, label, thunk in [
        ("end to end", f"fio nbd engine, {a.flush_jobs} jobs (a connection each), 4 KiB randwrite, "
         "--fsync=1, against cairn serve",
         lambda m: flush_served(m, a.runtime, a.flush_jobs, f)),
        ("in process", "cairn bench, 128 clients (iodepth 128), 4 KiB randwrite, --fsync 1",
         lambda m: flush_inproc(m, a.runtime, f)),
    ]:
        before, after = rounds(f"flush-{what.replace(' ', '-')}",
                               ("serial", lambda: thunk("serial")),
                               ("batched", lambda: thunk("batched")), a.rounds)
        print(f"\ncairn, {what}: {label};\nraid10 over four delay(flush = 1ms) over mem, "
              f"medians of {a.rounds} rounds of {a.runtime} s:")
        clients = a.flush_jobs if what == "end to end" else 128
        for name, rs in (("before (serial) ", before), ("after (batched) ", after)):
            print(f"  {name}  Throughput {med(r['mbps'] for r in rs):.3f} MB/sec  "
                  f"{clients} clients  flushes={int(med(r['flushes'] for r in rs))}  "
                  f"flush latency mean={med(r['flush_mean_ms'] for r in rs):.3f} ms "
                  f"max={med(r['flush_max_ms'] for r in rs):.3f} ms")
        print(f"  after / before = {spread(before, after, 'mbps')} MB/s; flush latency mean "
              f"{med(r['flush_mean_ms'] for r in before):.3f} ms -> "
              f"{med(r['flush_mean_ms'] for r in after):.3f} ms")


# 2. Cached clock

def clock_run(mode, runtime):
    j = stack.bench(None, "null:1G", runtime, "--rw", "randread", "--bs", "4k", "--iodepth", "32",
                    switches=("--clock", mode, "--stats", "on"))
    job = j["jobs"][0]
    ios = job["read"]["total_ios"]
    return {"iops": job["read"]["iops"], "reads_per_io": j["cairn"]["reactor"]["clock_reads"] / max(ios, 1),
            "json": j}


def perf_diff(runtime):
    """`perf diff` of a precise and a cached run: the lines of clock symbols, and the
    top of the profile."""
    d = tempfile.mkdtemp(prefix="cairn-perf-")
    try:
        data = {}
        for mode in ("precise", "cached"):
            data[mode] = os.path.join(d, f"{mode}.data")
            r = subprocess.run(["perf", "record", "-q", "-F", "2999", "-o", data[mode], "--",
                                CAIRN, "--clock", mode, "--stats", "on", "bench", "--device",
                                "null:1G", "--runtime", str(runtime), "--time_based"],
                               capture_output=True, text=True)
            if r.returncode != 0:
                return f"  (perf record failed: {r.stderr.strip().splitlines()[-1:]})"
        r = subprocess.run(["perf", "diff", data["precise"], data["cached"]],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return f"  (perf diff failed: {r.stderr.strip()[:200]})"
        lines = [ln for ln in r.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
        clock = [ln for ln in lines
                 if any(k in ln for k in ("clock_gettime", "read_tsc", "ktime", "vdso", "Instant", "timespec"))]
        out = ["  perf diff, precise (baseline) -> cached; the clock's symbols:"]
        out += [f"  {ln.rstrip()}" for ln in clock[:6]] or ["  (no clock symbol sampled)"]
        out += ["  and the top of the baseline profile:"]
        out += [f"  {ln.rstrip()}" for ln in lines[:6]]
        return "\n".join(out)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def technique_clock(a):
    title(2, 'Cached clock: block "cache current nsec time in struct blk_plug" (Linux v6.9)')
    print("""The original (peak IOPS, iostats on; 7 runs each, the patch):
  before   IOPS=108.41M, BW=52.93GiB/s, IOS/call=31/31   (108.29M..108.43M)
  after    IOPS=118.79M, BW=58.00GiB/s, IOS/call=31/32   (118.62M..118.80M)
  after / before = 1.096x ("more than a 9% improvement"); perf diff:
    10.55%     -9.88%  [kernel.vmlinux]  [k] read_tsc
     1.31%     -1.22%  [kernel.vmlinux]  [k] ktime_get""")
    before, after = rounds("clock", ("precise", lambda: clock_run("precise", a.runtime)),
                           ("cached", lambda: clock_run("cached", a.runtime)), a.rounds)
    print(f"\ncairn: null device, statistics on, 4 KiB randread qd32, one job; medians of "
          f"{a.rounds} rounds of {a.runtime} s:")
    for name, rs in (("before (--clock precise)", before), ("after (--clock cached) ", after)):
        iops = [r["iops"] for r in rs]
        print(f"  {name}  IOPS={med(iops) / 1e6:.3f}M, BW={med(iops) * 4096 / 2**30:.2f}GiB/s, "
              f"clock reads per I/O={med(r['reads_per_io'] for r in rs):.3f}   "
              f"({min(iops) / 1e6:.3f}M..{max(iops) / 1e6:.3f}M)")
    print(f"  after / before = {spread(before, after, 'iops')}")
    if shutil.which("perf"):
        print(perf_diff(a.runtime))
    else:
        print("  (perf is not installed: no profile)")


# 3. Per-device writeback

def technique_writeback(a):
    title(3, 'Per-device writeback: "writeback: switch to per-bdi threads" (Linux 2.6.32)')
    print("""The original (the patch's words and vmstat):
  random writes (ffsb), 1 SATA disk:  per-bdi about 8% faster than pdflush
  10 disks, btrfs:                    26% faster
  SSD writeback on XFS:               steady around 1 GB/s, pdflush 750 MB/s "fluctuating wildly"
  vmstat bo column, 10 one-second rows, per-bdi:  71024 60692 29540 54876 92168 62924 58256 57460 74748 53248
                                        pdflush:  74064   352 78164 78156 82244     8 102800 12328 106940 ...""")
    os.makedirs(OUT, exist_ok=True)
    runtime, warmup = a.wb_runtime, min(5, a.wb_runtime // 3)
    for disks in [int(x) for x in a.wb_disks.split(",")]:
        path = writeback.stack(disks, "64M", "150M", "4ms")
        before, after = rounds(
            f"writeback-{disks}",
            ("shared", lambda: writeback.run(path, disks, "shared", runtime, warmup, 0)),
            ("per-device", lambda: writeback.run(path, disks, "per-device", runtime, warmup, 0)),
            a.rounds)
        print(f"\ncairn, {disks} disk{'s' if disks > 1 else ''}: a stripe of {disks} caches (64 MiB "
              f"each) over modelled disks (150 MB/s, 4 ms seek); one job, random 4 KiB writes "
              f"qd32; medians of {a.rounds} rounds of {runtime} s (steady: after {warmup} s):")
        for name, rs in (("before (shared)    ", before), ("after (per-device) ", after)):
            print(f"  {name} IOPS {med(r['iops'] for r in rs):8.0f}  steady {med(r['steady'] for r in rs):8.0f}"
                  f"  CoV {med(r['cov'] for r in rs):.3f}  write-back "
                  f"{med(r['writeback'] for r in rs) / 1e6:.1f} MB/s")
        print(f"  after / before: IOPS {spread(before, after, 'iops')}; steady "
              f"{spread(before, after, 'steady')}")
        print(f"  CoV of the steady seconds: {med(r['cov'] for r in after):.3f} per-device against "
              f"{med(r['cov'] for r in before):.3f} shared")
        # The timeline of the round with the median steady IOPS, both modes side by side.
        pick = lambda rs: sorted(rs, key=lambda r: r["steady"])[len(rs) // 2]  # noqa: E731
        b, p = pick(before), pick(after)
        print("  one round each (the median), per second, vmstat-like (w/s: writes "
              "acknowledged; dirty: MiB in the caches; wb: MB/s written back):")
        print(f"  {'s':>3} | {'per-device w/s':>14} {'dirty':>6} {'wb':>6} | "
              f"{'shared w/s':>10} {'dirty':>6} {'wb':>6}")
        for i in range(min(len(b["rows"]), len(p["rows"]))):
            x, y = p["rows"][i], b["rows"][i]
            print(f"  {i + 1:>3} | {float(x['iops']):>14.0f} {int(x['dirty_bytes']) / 2**20:>6.1f} "
                  f"{float(x['writeback_bytes_per_second']) / 1e6:>6.1f} | {float(y['iops']):>10.0f} "
                  f"{int(y['dirty_bytes']) / 2**20:>6.1f} {float(y['writeback_bytes_per_second']) / 1e6:>6.1f}")


# 4. Inline stacked dispatch

def dispatch_run(device, mode, runtime, stack_file, stats="on"):
    j = stack.bench(stack_file, device, runtime, "--rw", "randread", "--bs", "4k", "--iodepth",
                    "32", switches=("--dispatch", mode, "--stats", stats))
    job = j["jobs"][0]
    return {"iops": job["read"]["iops"], "ctx": job["ctx"], "usr": job["usr_cpu"],
            "sys": job["sys_cpu"], "ios": job["read"]["total_ios"], "json": j}


def instructions_per_io(f, device, stats):
    """Instructions per 4 KiB read under valgrind: the difference between two runs of
    different lengths, so that start-up and reports cancel. None without valgrind."""
    if not shutil.which("valgrind"):
        return None
    total = {}
    for size in (50, 150):
        with tempfile.NamedTemporaryFile(dir=OUT, suffix=".cg") as out:
            p = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no",
                                f"--cachegrind-out-file={out.name}", CAIRN, "--stats", stats,
                                "bench", f, "--device", device, "--rw", "randread", "--bs", "4k",
                                "--iodepth", "32", "--io_size", f"{size}M", "--output-format", "json"],
                               capture_output=True, text=True)
        refs = [l for l in p.stderr.splitlines() if "I refs:" in l or "I   refs:" in l]
        if p.returncode != 0 or not refs:
            return None
        total[size] = int(refs[0].split(":")[1].replace(",", "").split()[0])
    return (total[150] - total[50]) / ((150 - 50) * 2**20 / 4096)


def technique_dispatch(a):
    title(4, 'Inline stacked dispatch: dm "fix excessive dm-mq context switching" (Linux v4.6)')
    print("""The original (dm-mq over null_blk, multithreaded async reads, fio; the patch):
  Before: cpu          : usr=15.10%, sys=59.39%, ctx=7905181, majf=0, minf=475
  After:  cpu          : usr=20.60%, sys=79.35%, ctx=2008, majf=0, minf=472
  read IOPS ~950K -> ~1350K (1.42x); the raw null_blk device ~1950K (after: 0.69x of raw)""")
    f = stack.stack_file("t4")
    n = a.slices
    for dev in ("linear", "stripe"):
        # Against bare null, statistics on (the default: a request that fits one member
        # is remapped and the member counts it for the stacked device too) and off
        # (remapped, counted nowhere). Each round runs the four `n` times, one second
        # each, alternating, so that a slow second of the machine (the spread between
        # runs is 10-20% here) falls on both sides of a ratio; handoff runs once per round.
        runs = {k: [] for k in ("null", "inline", "null-off", "inline-off", "handoff")}
        for r in range(a.rounds):
            order = ["null", "inline", "null-off", "inline-off"]
            if r % 2:
                order.reverse()
            got = {k: [] for k in order}
            for _ in range(n):
                for which in order:
                    stats = "off" if which.endswith("-off") else "on"
                    target = "n" if which.startswith("null") else dev
                    got[which].append(dispatch_run(target, "inline", 1, f, stats))
            for which in order:
                rs = got[which]
                runs[which].append({"iops": statistics.mean(x["iops"] for x in rs),
                                    "ctx": sum(x["ctx"] for x in rs),
                                    "usr": statistics.mean(x["usr"] for x in rs),
                                    "sys": statistics.mean(x["sys"] for x in rs),
                                    "ios": sum(x["ios"] for x in rs),
                                    "json": [x["json"] for x in rs]})
            runs["handoff"].append(dispatch_run(dev, "handoff", a.runtime, f))
            for which, rs in runs.items():
                with open(os.path.join(OUT, f"seeds-dispatch-{dev}-{which}-{r}.json"), "w") as o:
                    json.dump(rs[-1]["json"], o, indent=1)
            print(f"  dispatch {dev}: round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
        before, after, bare = runs["handoff"], runs["inline"], runs["null"]
        print(f"\ncairn: {dev} over two null devices against a bare null device; 4 KiB randread "
              f"qd32, one job; medians of {a.rounds} rounds (handoff: one {a.runtime} s run per "
              f"round; inline and bare null: {n} one-second runs per round, alternating):")
        for name, rs in (("Before (handoff):", before), ("After (inline): ", after)):
            print(f"  {name} cpu          : usr={med(r['usr'] for r in rs):.2f}%, "
                  f"sys={med(r['sys'] for r in rs):.2f}%, ctx={int(med(r['ctx'] for r in rs))}  "
                  f"({med(r['ctx'] * 1e4 / max(r['ios'], 1) for r in rs):.3f} per 10,000 I/Os)")
        print(f"  read IOPS {med(r['iops'] for r in before) / 1e3:.0f}K -> "
              f"{med(r['iops'] for r in after) / 1e3:.0f}K; bare null {med(r['iops'] for r in bare) / 1e3:.0f}K")
        print(f"  inline / handoff = {spread(before, after, 'iops')}")
        print(f"  inline / bare null = {spread(bare, after, 'iops')}  (statistics on)")
        print(f"  inline / bare null = {spread(runs['null-off'], runs['inline-off'], 'iops')}  "
              f"(statistics off: {med(r['iops'] for r in runs['inline-off']) / 1e3:.0f}K against "
              f"{med(r['iops'] for r in runs['null-off']) / 1e3:.0f}K)")
        if not a.no_callgrind:
            counts = {(d, st): instructions_per_io(f, d, st) for d in ("n", dev) for st in ("on", "off")}
            if None in counts.values():
                print("  instructions per I/O: valgrind not available or failed (skipped)")
            else:
                # valgrind counts each byte of the null read's `rep stosb` (its 4 KiB
                # memset) as one instruction; on the CPU it is one instruction.
                for st in ("on", "off"):
                    b, s_ = counts[("n", st)], counts[(dev, st)]
                    print(f"  instructions per I/O (valgrind), statistics {st}: bare null {b:.0f}, "
                          f"{dev} {s_:.0f} (+{s_ - b:.0f}; {b / s_:.3f}x; without the memset's "
                          f"4096 counted bytes {(b - 4096) / (s_ - 4096):.3f}x)")


# 5. Eager completion reaping

PCTS = ["1", "10", "20", "30", "40", "50", "60", "70", "80", "90", "99.990000"]


def reap_run(device, mode, runtime, depth):
    prefix = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    cmd = [*prefix, CAIRN, "--reap", mode, "bench", "--device", device,
           "--rw", "randread", "--bs", "4k", "--iodepth", str(depth), "--runtime", str(runtime),
           "--time_based", "--output-format", "json"]
    j = json.loads(sh(cmd))
    r = j["jobs"][0]["read"]
    reaps = {k.split(".")[0] if k.endswith(".000000") else k: v
             for k, v in j["cairn"]["reaps"]["percentile"].items()}
    return {"iops": r["iops"], "mbps": r["bw_bytes"] / 1e6, "clat_us": r["clat_ns"]["mean"] / 1e3,
            "reaps": reaps, "json": j}


def technique_reap(a):
    title(5, 'Eager completion reaping: QEMU "linux-aio: process completions from ioq_submit()" (2.7)')
    print("""The original (fio, 8 jobs, linux-aio through QEMU; the patch): completions per reap
                1th 10th  20th  30th  40th  50th  60th  70th  80th  90th  99.99th
        Before    2    4    42   112   128   128   128   128   128   128    128
         After    1    1     4    14    33    45    47    48    50    51    108
  read : bw=1822.7MB/s, iops=179779; clat avg=1051.45 usec   (before)
  read : bw=1921.2MB/s, iops=189529; clat avg=988.78 usec    (after)
  after / before = 1.05x""")
    prepare()
    sets = [("shm", f"file:{SHM_FILE},engine=aio",
             "a 1 GiB file in /dev/shm through linux-aio (buffered: completions are ready when "
             "io_submit returns)")]
    loop = None
    if os.geteuid() == 0 and shutil.which("losetup"):
        loop = sh(["losetup", "--direct-io=on", "-f", "--show", SHM_FILE]).strip()
        sets.append(("loop", f"file:{loop},engine=aio,direct=1",
                     f"the same file through a loop device in direct-I/O mode ({loop}), O_DIRECT "
                     "linux-aio (completions arrive later, from the loop device's workers)"))
    else:
        print("\n(not root: the loop-device half is skipped)")
    try:
        for key, device, what in sets:
            before, after = rounds(
                f"reap-{key}", ("lazy", lambda d=device: reap_run(d, "lazy", a.runtime, a.reap_depth)),
                ("eager", lambda d=device: reap_run(d, "eager", a.runtime, a.reap_depth)), a.rounds)
            print(f"\ncairn: {what}; 4 KiB randread, iodepth {a.reap_depth}, one job, reactor "
                  f"pinned to CPU 0; medians of {a.rounds} rounds of {a.runtime} s:")
            print("  completions per reap")
            print("        " + " ".join(f"{p.split('.')[0] + 'th' if p != '99.990000' else '99.99th':>6}"
                                          for p in PCTS))
            for name, rs in (("Before", before), (" After", after)):
                print(f"  {name}" + " ".join(f"{int(med(r['reaps'][p] for r in rs)):>6}" for p in PCTS))
            for name, rs in (("before (lazy)", before), ("after (eager)", after)):
                print(f"  read : bw={med(r['mbps'] for r in rs):.1f}MB/s, iops={med(r['iops'] for r in rs):.0f}; "
                      f"clat avg={med(r['clat_us'] for r in rs):.2f} usec   ({name})")
            print(f"  after / before = {spread(before, after, 'iops')}")
    finally:
        if loop:
            subprocess.run(["losetup", "-d", loop], capture_output=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="*", default=["all"],
                    help="1-5, a name (flush clock writeback dispatch reap), or all")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--wb-runtime", type=int, default=20,
                    help="seconds per technique-3 run (default 20)")
    ap.add_argument("--wb-disks", default="1,4,10")
    ap.add_argument("--flush-jobs", type=int, default=32)
    ap.add_argument("--reap-depth", type=int, default=128)
    ap.add_argument("--slices", type=int, default=5,
                    help="technique 4: one-second runs per round of each device against bare null")
    ap.add_argument("--no-callgrind", action="store_true",
                    help="technique 4: skip the instruction counts under valgrind")
    a = ap.parse_args()
    chosen = []
    for w in a.which:
        if w == "all":
            chosen += NAMES
        elif w.isdigit() and 1 <= int(w) <= 5:
            chosen.append(NAMES[int(w) - 1])
        elif w in NAMES:
            chosen.append(w)
        else:
            sys.exit(f"bench/seeds.py: '{w}': expected 1-5, all, or one of {', '.join(NAMES)}")
    if a.rounds < 5:
        print(f"note: {a.rounds} rounds; the ratios are meant as medians of at least 5",
              file=sys.stderr)
    if a.slices < 1:
        sys.exit("--slices: at least 1")
    if a.wb_runtime < 10:
        sys.exit("--wb-runtime: at least 10 seconds")
    build()
    os.makedirs(OUT, exist_ok=True)
    print(f"bench/seeds.py {' '.join(sys.argv[1:])}  (cairn at {CAIRN}, {os.cpu_count()} CPUs)")
    for name in dict.fromkeys(chosen):
        globals()[f"technique_{name}"](a)


if __name__ == "__main__":
    main()
