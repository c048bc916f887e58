#!/usr/bin/env python3
"""A remote mirror member back after an outage (issues "Arrays that remember" and
"Remote devices"), with and without the write-intent bitmap, side by side in one run.

  bench/readd.py [--rounds N] [--size 1G] [--outage SECS]

A mirror with metadata of a local file and a remote export (`cairn serve` of a file over a
Unix socket), both on /dev/shm, with `readd = "200ms"` and the remote's `timeout = "1s"`.
`cairn bench --admin` writes 4 KiB blocks at random into the first 1% of the array at
iodepth 8 throughout. After 3 s the remote server is killed (-9); it is started again after
OUTAGE seconds. The mirror marks the member failed, runs on degraded, and re-adds it by
itself once it answers. Reported from `cairn admin status`: the bytes the catch-up read
and wrote, and the time from the server's restart until the array is whole again ([UU]).
Against the same with bitmap = "none" (the member is rebuilt whole).

Medians of interleaved rounds, with every round's figures.
"""
import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import CAIRN, OUT, build  # noqa: E402

DIR = "/dev/shm/cairn-bench-readd"


def remote_stack(size_mib):
    path = os.path.join(OUT, "readd-remote.toml")
    with open(path, "w") as f:
        f.write(f"""
[device.r]
type = "file"
path = "{DIR}/r.img"
size = "{size_mib + 1}M"
[export.r]
device = "r"
""")
    return path


def local_stack(size_mib, bitmap):
    path = os.path.join(OUT, f"readd-{bitmap}.toml")
    with open(path, "w") as f:
        f.write(f"""
[device.a]
type = "file"
path = "{DIR}/a.img"
size = "{size_mib + 1}M"
[device.remote]
type = "nbd"
uri = "nbd+unix:///r?socket={DIR}/r.sock"
timeout = "1s"
[device.m]
type = "mirror"
members = ["a", "remote"]
bitmap = "{bitmap}"
readd = "200ms"
""")
    return path


def serve_remote(size_mib):
    sock = f"{DIR}/r.sock"
    if os.path.exists(sock):
        os.remove(sock)
    p = subprocess.Popen([CAIRN, "serve", remote_stack(size_mib), "--listen", f"unix:{sock}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not os.path.exists(sock):
        if p.poll() is not None:
            sys.exit("the remote cairn serve ended")
        time.sleep(0.02)
    return p


def status(admin):
    r = subprocess.run([CAIRN, "admin", admin, "status"], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else ""


def wait_for(admin, pred, limit=600):
    t = time.monotonic()
    while True:
        s = status(admin)
        if pred(s):
            return s
        if time.monotonic() - t > limit:
            sys.exit(f"timed out; status:\n{s}")
        time.sleep(0.02)


def once(size_mib, bitmap, outage):
    """(bytes read, bytes written, seconds from the restart to whole)."""
    remote = serve_remote(size_mib)
    admin = f"{DIR}/admin.sock"
    if os.path.exists(admin):
        os.remove(admin)
    hot = max(1, size_mib // 100)
    w = subprocess.Popen([CAIRN, "bench", local_stack(size_mib, bitmap), "--rw", "randwrite",
                          "--bs", "4k", "--iodepth", "8", "--size", f"{hot}M", "--time_based",
                          "--runtime", "1h", "--admin", admin],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(admin, lambda s: "[UU]" in s)
        time.sleep(3)
        remote.send_signal(signal.SIGKILL)
        remote.wait()
        wait_for(admin, lambda s: "[U_]" in s)
        time.sleep(outage)
        remote = serve_remote(size_mib)
        back = time.monotonic()
        s = wait_for(admin, lambda s: "[UU]" in s and "last rebuild" in s)
        whole = time.monotonic() - back
        m = re.search(r"last rebuild: read (\d+) bytes, wrote (\d+) bytes", s)
        return int(m.group(1)), int(m.group(2)), whole
    finally:
        w.send_signal(signal.SIGINT)
        w.wait()
        remote.send_signal(signal.SIGTERM)
        remote.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", default="1G", help="array size: 1G, 512M, ...")
    ap.add_argument("--outage", type=float, default=3.0)
    args = ap.parse_args()
    size_mib = int(args.size[:-1]) * (1024 if args.size.endswith("G") else 1)
    array_bytes = size_mib << 20
    build()
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(DIR, exist_ok=True)
    for f in ("a.img", "r.img"):
        if os.path.exists(f"{DIR}/{f}"):
            os.remove(f"{DIR}/{f}")
    runs = {"1M": [], "none": []}
    for _ in range(args.rounds):
        for bitmap in runs:
            runs[bitmap].append(once(size_mib, bitmap, args.outage))

    def med(rs, i):
        return statistics.median(r[i] for r in rs)

    b, n = runs["1M"], runs["none"]
    print(f"Medians of {args.rounds} interleaved rounds (`bench/readd.py --rounds {args.rounds} "
          f"--size {args.size} --outage {args.outage}`), files on /dev/shm.\n")
    print("| remote member back after an outage, 1% of the array written | bitmap, 1 MiB regions | no bitmap |")
    print("|---|---|---|")
    print(f"| bytes the catch-up read | {med(b, 0):.0f} ({med(b, 0) * 100 / array_bytes:.2f}%) | "
          f"{med(n, 0):.0f} ({med(n, 0) * 100 / array_bytes:.0f}%) |")
    print(f"| bytes it wrote | {med(b, 1):.0f} ({med(b, 1) * 100 / array_bytes:.2f}%) | "
          f"{med(n, 1):.0f} ({med(n, 1) * 100 / array_bytes:.0f}%) |")
    print(f"| from the server's restart to whole, s | {med(b, 2):.3f} | {med(n, 2):.3f} |")
    print(f"\nrounds (bytes written, s): bitmap {[(r[1], round(r[2], 3)) for r in b]}; "
          f"none {[(r[1], round(r[2], 3)) for r in n]}")


if __name__ == "__main__":
    main()
