#!/usr/bin/env python3
"""What unaligned requests cost: cairn serve answering a libnbd client that did not ask for
block sizes, aligned against unaligned, in one run.

  bench/unaligned.py [--runtime SECS] [--rounds N] [--device SPEC] [--no-build]

One server (`cairn serve --device SPEC`, default mem:1G, on a Unix socket), one client:
Python's libnbd with its own checks off and no block-size request, 4 KiB requests at
iodepth 32 (aio), random offsets in the first 1 GiB. Workloads, run in interleaved rounds:

  read-aligned     4 KiB reads at multiples of 4 KiB
  read-unaligned   4 KiB reads at a multiple of 4 KiB plus 1: the server reads the whole
                   blocks around them (4,608 bytes on mem's 512-byte blocks)
  write-aligned    4 KiB writes at multiples of 4 KiB
  write-unaligned  4 KiB writes at a multiple of 4 KiB plus 1: a read-modify-write of the
                   two edge blocks (512-byte blocks on mem), under the device's gate

The client is Python, so the figures are bounded by it (one core): they show what the
unaligned path costs relative to the aligned one as this client sees it, not cairn's
ceiling (bench/nbd.py has that). The server's CPU per I/O (utime+stime from /proc) shows
what the read-modify-write costs it. Prints a Markdown table: median IOPS per workload,
the unaligned/aligned ratio per round (median, spread), and server CPU per 100k I/Os.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import CAIRN, OUT, build  # noqa: E402
from nbd import CLK_TCK, ticks  # noqa: E402

PY = "/usr/bin/python3"
CLIENT = r"""
import nbd, os, random, sys, time
sock, kind, runtime = sys.argv[1], sys.argv[2], float(sys.argv[3])
h = nbd.NBD()
h.set_strict_mode(0)
h.set_request_block_size(False)
h.connect_unix(sock)
span = min(h.get_size(), 1 << 30) - 8192
rng = random.Random(7)
depth, bs = 32, 4096
shift = 1 if kind.endswith("-unaligned") else 0
write = kind.startswith("write")
buf = nbd.Buffer(bs)
data = os.urandom(bs)
done = 0
def cb(*args):
    global done
    done += 1
    return 1
end = time.monotonic() + runtime
start = time.monotonic()
while time.monotonic() < end:
    while h.aio_in_flight() < depth:
        off = rng.randrange(0, span // bs) * bs + shift
        if write:
            h.aio_pwrite(data, off, completion=cb)
        else:
            h.aio_pread(buf, off, completion=cb)
    h.poll(-1)
    while True:
        c = h.aio_peek_command_completed()
        if c == 0:
            break
        h.aio_command_completed(c)
while h.aio_in_flight() > 0:
    h.poll(-1)
print(done, done / (time.monotonic() - start))
"""
KINDS = ["read-aligned", "read-unaligned", "write-aligned", "write-unaligned"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", type=float, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="mem:1G")
    ap.add_argument("--no-build", action="store_true")
    args = ap.parse_args()
    if not args.no_build:
        build()
    os.makedirs(OUT, exist_ok=True)
    sock = os.path.join(OUT, "unaligned.sock")
    if os.path.exists(sock):
        os.unlink(sock)
    log = open(os.path.join(OUT, "unaligned-serve.log"), "w")
    srv = subprocess.Popen([CAIRN, "serve", "--listen", f"unix:{sock}", "--device", args.device],
                           stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(sock):
            if srv.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"cairn serve did not start; see {log.name}")
            time.sleep(0.02)
        res = {k: [] for k in KINDS}
        cpu = {k: [] for k in KINDS}
        for rnd in range(args.rounds):
            kinds = KINDS if rnd % 2 == 0 else KINDS[::-1]
            for k in kinds:
                t0 = ticks(srv.pid)
                r = subprocess.run([PY, "-c", CLIENT, sock, k, str(args.runtime)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                if r.returncode != 0:
                    sys.exit(f"{k}: the client failed: {r.stderr}")
                done, rate = r.stdout.split()
                res[k].append(float(rate))
                cpu[k].append((ticks(srv.pid) - t0) / CLK_TCK * 1e5 / max(int(done), 1))
                print(f"  {k} round {rnd + 1}: {res[k][-1]:.0f} IOPS", file=sys.stderr)
    finally:
        srv.terminate()
        srv.wait()
    print(f"`bench/unaligned.py --runtime {args.runtime:g} --rounds {args.rounds} --device "
          f"{args.device}`: Python libnbd without a block-size request, 4 KiB at iodepth 32, "
          f"{os.cpu_count()} CPUs; median of {args.rounds} interleaved rounds.\n")
    print("| requests | aligned IOPS | unaligned IOPS (offset +1) | unaligned / aligned | spread "
          "| server CPU s / 100k, aligned | unaligned | unaligned / aligned |")
    print("|---|---|---|---|---|---|---|---|")
    for op in ("read", "write"):
        a, u = res[f"{op}-aligned"], res[f"{op}-unaligned"]
        ca, cu = cpu[f"{op}-aligned"], cpu[f"{op}-unaligned"]
        ratios = [y / x for x, y in zip(a, u)]
        print(f"| 4 KiB {op}s | {statistics.median(a):.0f} | {statistics.median(u):.0f} | "
              f"{statistics.median(ratios):.2f}x | {min(ratios):.2f}..{max(ratios):.2f} | "
              f"{statistics.median(ca):.2f} | {statistics.median(cu):.2f} | "
              f"{statistics.median(y / x for x, y in zip(ca, cu)):.2f}x |")


if __name__ == "__main__":
    main()
