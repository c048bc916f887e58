#!/usr/bin/env python3
"""Encryption: what the crypt device costs against the cipher alone, and
against qemu-storage-daemon's luks driver over NBD.

  bench/crypt.py [--rounds N] [--runtime SECS] [--parts cipher,qsd,neighbour] [--quick]

Everything lives in a fresh directory under /dev/shm, removed at the end (also on Ctrl-C
or SIGTERM) with every process the script started. The script runs target/release/cairn
(or CAIRN_BIN) and never builds it.

  cipher  `cairn bench` (one job: one reactor thread) writing and reading 64 MiB of a crypt device
          over a mem device (LUKS2, 4096-byte sectors, AES-256-XTS; and LUKS1, 512-byte
          sectors), 4 KiB and 128 KiB requests at iodepth 16, against `openssl speed -evp
          aes-256-xts -bytes N` on one core, run in the same round. cairn's figure is per
          core: bytes over the CPU seconds the bench process used (user + system), which
          includes the bench's own work and the mem device's copies. The same bench over
          the mem device alone is shown for reference, and taken away (its CPU seconds per
          byte) for the crypt layer's own figure. Target: >= 0.9x openssl.
  qsd     one LUKS1 image (1 GiB, made by qemu-img, written full once) served over a Unix
          socket by qemu-storage-daemon (luks driver over a file, aio=io_uring, an
          iothread) and by `cairn serve` (crypt over a file device), one after the other;
          the client is cairn's NBD device driven by `cairn bench`: 4 KiB randread and
          randwrite at iodepth 32. Target: cairn >= 1.5x qsd on both.

  neighbour  whether ciphering on the reactor stalls another device's requests more than
          the cipher's own cost: one `cairn serve --threads 1` (one reactor for both)
          with export `p` (mem) probed by fio (ioengine=nbd, 4 KiB randread, iodepth 1),
          while export `n` takes 128 KiB writes at iodepth 8 from a second fio: `n` a
          crypt over mem, against `n` a plain mem (the same load without the cipher) and
          no load at all. Reported: the probe's mean and 99th percentile latency, and
          the cipher's own time per 128 KiB write (from the cipher part's openssl figure).

Medians of --rounds (3) interleaved rounds, with the range of per-round ratios. Tables
(Markdown) on stdout, JSON in bench/out/crypt-*.json, progress on stderr. The script
reports what it measured; it asserts nothing. --quick: 2 s runs, 1 round.
"""
import argparse
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import thin  # noqa: E402
from thin import Failed, run, fresh, out, spread  # noqa: E402
from engine import CAIRN, OUT, ROOT  # noqa: E402

MiB = 1 << 20
PASS = b"benchmark passphrase"


def save(name, j):
    with open(os.path.join(OUT, f"crypt-{name}.json"), "w") as f:
        json.dump(j, f, indent=1, default=str)


def openssl_speed(bs, seconds):
    """openssl's AES-256-XTS on one core at `bs` bytes: bytes per second."""
    o, _ = run(["openssl", "speed", "-evp", "aes-256-xts", "-bytes", str(bs), "-seconds",
                str(seconds)], seconds + 60, "openssl speed")
    for line in o.splitlines():
        if line.lower().startswith("aes-256-xts"):
            return float(line.split()[-1].rstrip("k")) * 1000
    raise Failed(f"openssl speed printed no aes-256-xts line: {o[-500:]}")


def bench_cpu(cmd, timeout, what):
    """Runs `cmd` (a cairn bench printing JSON); returns (json, CPU seconds it used)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    o, _ = run(cmd, timeout, what, load=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(o), cpu


def mem_stack(d, crypt):
    text = '[device.m]\ntype = "mem"\nsize = "1100M"\n'
    if crypt:
        pf = os.path.join(d, "pass")
        with open(pf, "wb") as f:
            f.write(PASS)
        text += (f'[device.c]\ntype = "crypt"\nbase = "m"\npassphrase_file = "{pf}"\n'
                 f'create = true\nformat = "{crypt}"\nkdf = "pbkdf2"\nkdf_iterations = 1000\n')
    path = os.path.join(d, "stack.toml")
    with open(path, "w") as f:
        f.write(text)
    return path, ("c" if crypt else "m")


def cairn_local(a, crypt, rw, bs):
    d = fresh("cipher")
    try:
        stack, dev = mem_stack(d, crypt)
        cmd = [CAIRN, "bench", "--log-level", "warn", stack, "--device", dev, f"--rw={rw}",
               f"--bs={bs}", "--iodepth=16", "--numjobs=1", "--size=64M",
               f"--runtime={a.runtime}", "--time_based", "--output-format=json"]
        j, cpu = bench_cpu(cmd, a.runtime + 120, f"cairn bench {dev} {rw} {bs}")
        job = j["jobs"][0]
        r = job["read"] if rw == "read" else job["write"]
        secs = r["runtime"] / 1000 if r.get("runtime") else a.runtime
        return {"bytes_per_s": r["bw_bytes"], "bytes": r["io_bytes"], "cpu_s": cpu,
                "wall_s": secs, "per_core": r["io_bytes"] / cpu if cpu else None, "cmd": cmd}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def cipher_part(a):
    sizes = [(4096, "4k"), (131072, "128k")]
    variants = [("luks2", "luks2"), ("luks1", "luks1"), ("mem alone", None)]
    res = {}
    for rnd in range(a.rounds):
        for bs, name in (sizes[::-1] if rnd % 2 else sizes):
            try:
                v = openssl_speed(bs, a.runtime)
                res.setdefault(("openssl", name), []).append(v)
                print(f"  openssl {name}: {v / 1e6:.0f} MB/s", file=sys.stderr)
            except Failed as e:
                print(f"  openssl {name}: FAILED: {e}", file=sys.stderr)
            for rw in ["write", "read"]:
                for label, crypt in variants:
                    try:
                        r = cairn_local(a, crypt, rw, name)
                        save(f"cipher-{label.replace(' ', '_')}-{rw}-{name}-{rnd}", r)
                        res.setdefault((label, rw, name), []).append(r)
                        print(f"  {label} {rw} {name}: {r['bytes_per_s'] / 1e6:.0f} MB/s, "
                              f"{r['per_core'] / 1e6:.0f} MB per CPU second", file=sys.stderr)
                    except Failed as e:
                        print(f"  {label} {rw} {name}: FAILED: {e}", file=sys.stderr)
    out("## The cipher's cost: crypt over mem against `openssl speed -evp aes-256-xts`\n",
        "MB = 10^6 bytes. Per core: bytes moved over the CPU seconds the bench process used. "
        "The crypt layer alone: the same with the CPU time of the mem device and the load "
        "generator (the `mem alone` run of the round, per byte) taken away.\n",
        "| device | request | openssl MB/s | cairn MB/s | cairn MB per CPU s | per core / openssl (range) | crypt layer alone / openssl (range) |",
        "|---|---|---|---|---|---|---|")
    for bs, name in sizes:
        ssl = res.get(("openssl", name), [])
        for rw in ["write", "read"]:
            for label, _ in variants:
                rs = res.get((label, rw, name), [])
                if not rs:
                    out(f"| {label} | {rw} {name} | - | - | - | - |")
                    continue
                per = [r["per_core"] / s for r, s in zip(rs, ssl) if r["per_core"]]
                base = res.get(("mem alone", rw, name), [])
                alone = [1 / (1 / r["per_core"] - 1 / m["per_core"]) / s
                         for r, m, s in zip(rs, base, ssl)
                         if r["per_core"] and m["per_core"] and m["per_core"] > r["per_core"]]
                med_ssl = statistics.median(ssl) / 1e6 if ssl else 0
                plain = label == "mem alone"
                out(f"| {label} | {rw} {name} | {med_ssl:.0f} | "
                    f"{statistics.median(r['bytes_per_s'] for r in rs) / 1e6:.0f} | "
                    f"{statistics.median(r['per_core'] for r in rs) / 1e6:.0f} | "
                    f"{spread(per) if not plain else '(no cipher)'} | "
                    f"{spread(alone) if not plain else '-'} |")
    out("", "Target: crypt >= 0.9x openssl per core at 4 KiB and 128 KiB.", "")


# ---------------------------------------------------------------- qsd against cairn serve

class Qsd(thin.Server):
    kind = "qsd-luks"

    def __init__(self, d, img, passfile):
        super().__init__(d)
        self.sock = os.path.join(d, "qsd.sock")
        self.uri = f"nbd+unix:///c?socket={self.sock}"
        self.img, self.passfile = img, passfile

    def start(self):
        self.cmd = ["qemu-storage-daemon",
                    "--object", f"secret,id=sec0,file={self.passfile}",
                    "--object", "iothread,id=io0",
                    "--blockdev", f"driver=file,node-name=f0,filename={self.img},aio=io_uring",
                    "--blockdev", "driver=luks,node-name=l0,file=f0,key-secret=sec0",
                    "--nbd-server", f"addr.type=unix,addr.path={self.sock},max-connections=0",
                    "--export", "type=nbd,id=e0,node-name=l0,name=c,writable=on,iothread=io0"]
        self.launch()
        return self


class CairnServe(thin.Server):
    """`cairn serve STACK` on a Unix socket, `uri` naming `export`."""

    kind = "serve-crypt"

    def __init__(self, d, stack, export, extra=()):
        super().__init__(d)
        self.sock = os.path.join(d, "nbd.sock")
        self.uri = f"nbd+unix:///{export}?socket={self.sock}"
        self.stack, self.extra = stack, list(extra)

    def start(self):
        self.cmd = [CAIRN, "serve", "--log-level", "warn", *self.extra, self.stack,
                    "--listen", f"unix:{self.sock}"]
        self.launch()
        return self


def crypt_file_stack(d, img, passfile):
    """A stack file serving LUKS image `img` as export `c`."""
    stack = os.path.join(d, "serve.toml")
    with open(stack, "w") as f:
        f.write(f'[device.d]\ntype = "file"\npath = "{img}"\n'
                f'[device.c]\ntype = "crypt"\nbase = "d"\npassphrase_file = "{passfile}"\n'
                '[export.c]\ndevice = "c"\n')
    return stack


def client(a, d, srv, rw):
    stack = os.path.join(d, f"client-{srv.kind}.toml")
    with open(stack, "w") as f:
        f.write(f'[device.r]\ntype = "nbd"\nuri = "{srv.uri}"\n')
    cmd = [CAIRN, "bench", "--log-level", "warn", stack, "--device", "r", f"--rw={rw}",
           "--bs=4k", "--iodepth=32", "--numjobs=1", f"--runtime={a.runtime}", "--time_based",
           "--output-format=json"]
    o, _ = run(cmd, a.runtime + 120, f"cairn bench over NBD to {srv.kind} {rw}", load=True)
    j = json.loads(o)
    job = j["jobs"][0]
    r = job["read"] if rw == "randread" else job["write"]
    return {"iops": r["iops"], "cmd": cmd, "server_cpu_ticks": srv.cpu_ticks()}


def qsd_part(a):
    d = fresh("qsd")
    img, pf = os.path.join(d, "luks1.img"), os.path.join(d, "pass")
    with open(pf, "wb") as f:
        f.write(PASS)
    secret = f"secret,id=sec0,file={pf}"
    run(["qemu-img", "create", "-q", "-f", "luks", "--object", secret, "-o",
         "key-secret=sec0,iter-time=10", img, "1G"], 120, "qemu-img create -f luks")
    # Written full once, so both read real ciphertext (through qemu's driver).
    run(["qemu-io", "--object", secret, "--image-opts",
         f"driver=luks,key-secret=sec0,file.filename={img}", "-c", "write -P 0x5a 0 1G"],
        600, "qemu-io fill")
    stack = crypt_file_stack(d, img, pf)
    servers = [("cairn", lambda: CairnServe(d, stack, "c")), ("qsd", lambda: Qsd(d, img, pf))]
    res = {}
    try:
        for rnd in range(a.rounds):
            for label, make in (servers[::-1] if rnd % 2 else servers):
                srv = make()
                try:
                    srv.start()
                    for rw in ["randread", "randwrite"]:
                        try:
                            r = client(a, d, srv, rw)
                            save(f"qsd-{label}-{rw}-{rnd}", r)
                            res.setdefault((label, rw), []).append(r["iops"])
                            print(f"  {label} {rw} round {rnd + 1}: {r['iops']:.0f} IOPS",
                                  file=sys.stderr)
                        except Failed as e:
                            print(f"  {label} {rw} round {rnd + 1}: FAILED: {e}", file=sys.stderr)
                finally:
                    srv.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    out("## A LUKS1 image over NBD: cairn serve (crypt) against qemu-storage-daemon (luks)\n",
        "Client: cairn's NBD device under `cairn bench`, 4 KiB, iodepth 32, one connection.\n",
        "| workload | cairn IOPS | qsd IOPS | cairn / qsd (range) | target |", "|---|---|---|---|---|")
    for rw in ["randread", "randwrite"]:
        c, q = res.get(("cairn", rw), []), res.get(("qsd", rw), [])
        per = [x / y for x, y in zip(c, q) if y]
        med = lambda v: f"{statistics.median(v):.0f}" if v else "-"  # noqa: E731
        out(f"| {rw} | {med(c)} | {med(q)} | {spread(per)} | >= 1.5x |")
    out("")


# ---------------------------------------------------------------- neighbour

def fio_json(o):
    return json.loads(o[o.index("{"):])


def neighbour_part(a):
    variants = [("no load", None), ("mem neighbour", "mem"), ("crypt neighbour", "crypt")]
    res = {}
    for rnd in range(a.rounds):
        for label, kind in (variants[::-1] if rnd % 2 else variants):
            d = fresh("neighbour")
            pf = os.path.join(d, "pass")
            with open(pf, "wb") as f:
                f.write(PASS)
            text = ('[device.p]\ntype = "mem"\nsize = "256M"\n'
                    '[device.m]\ntype = "mem"\nsize = "300M"\n[export.p]\ndevice = "p"\n')
            if kind == "crypt":
                text += (f'[device.c]\ntype = "crypt"\nbase = "m"\npassphrase_file = "{pf}"\n'
                         'create = true\nkdf = "pbkdf2"\nkdf_iterations = 1000\n'
                         '[export.n]\ndevice = "c"\n')
            else:
                text += '[export.n]\ndevice = "m"\n'
            stack = os.path.join(d, "stack.toml")
            with open(stack, "w") as f:
                f.write(text)
            srv = CairnServe(d, stack, "p", ["--threads", "1"])
            load = None
            try:
                srv.start()
                if kind:
                    cmd = thin.fio_cmd(f"nbd+unix:///n?socket={srv.sock}", "randwrite", "128k", 8,
                                       runtime=a.runtime + 3, size="256M")
                    load = thin.spawn(cmd, load=True, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    time.sleep(1)
                probe = thin.fio_cmd(srv.uri, "randread", "4k", 1, runtime=a.runtime, size="256M")
                o, _ = run(probe, a.runtime + 60, f"probe fio ({label})", load=True)
                job = fio_json(o)["jobs"][0]["read"]
                r = {"probe_mean_us": job["clat_ns"]["mean"] / 1000,
                     "probe_p99_us": job["clat_ns"]["percentile"]["99.000000"] / 1000,
                     "probe_iops": job["iops"]}
                if load:
                    lo, _ = load.communicate(timeout=a.runtime + 60)
                    thin.reap(load)
                    r["load_bytes_per_s"] = fio_json(lo)["jobs"][0]["write"]["bw_bytes"]
                    load = None
                save(f"neighbour-{label.replace(' ', '_')}-{rnd}", r)
                res.setdefault(label, []).append(r)
                print(f"  {label} round {rnd + 1}: probe mean {r['probe_mean_us']:.1f} us, "
                      f"p99 {r['probe_p99_us']:.1f} us, load "
                      f"{r.get('load_bytes_per_s', 0) / 1e6:.0f} MB/s", file=sys.stderr)
            except (Failed, ValueError, KeyError, subprocess.TimeoutExpired) as e:
                print(f"  {label} round {rnd + 1}: FAILED: {e}", file=sys.stderr)
            finally:
                if load:
                    thin.killgroup(load)
                    load.wait()
                    thin.reap(load)
                srv.stop()
                shutil.rmtree(d, ignore_errors=True)
    out("## A neighbour's cipher on the same reactor\n",
        "`cairn serve --threads 1`: export `p` (mem) probed with 4 KiB reads at iodepth 1 while "
        "export `n` takes 128 KiB writes at iodepth 8.\n",
        "| neighbour | probe mean (µs) | probe p99 (µs) | neighbour MB/s |", "|---|---|---|---|")
    for label, _ in variants:
        rs = res.get(label, [])
        med = lambda k: (f"{statistics.median(r[k] for r in rs):.1f}"  # noqa: E731
                         if rs and all(k in r for r in rs) else "-")
        mbs = (f"{statistics.median(r['load_bytes_per_s'] for r in rs) / 1e6:.0f}"
               if rs and all("load_bytes_per_s" in r for r in rs) else "-")
        out(f"| {label} | {med('probe_mean_us')} | {med('probe_p99_us')} | {mbs} |")
    out("")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--runtime", type=int, default=None)
    ap.add_argument("--parts", default="cipher,qsd,neighbour")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.runtime = a.runtime or (2 if a.quick else 5)
    parts = a.parts.split(",")
    thin.binary_check()
    need = ["openssl", "nbdinfo"] + (["qemu-img", "qemu-io", "qemu-storage-daemon"]
                                     if "qsd" in parts else []) + (
        ["fio"] if "neighbour" in parts else [])
    missing = [t for t in need if shutil.which(t) is None]
    if missing:
        sys.exit(f"missing: {', '.join(missing)}")
    os.makedirs(OUT, exist_ok=True)
    signal.signal(signal.SIGTERM, thin.on_signal)
    signal.signal(signal.SIGINT, thin.on_signal)
    thin.WORK["dir"] = tempfile.mkdtemp(prefix="cairn-crypt-bench-", dir=thin.SHM)
    try:
        rev = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                             stdout=subprocess.PIPE, text=True).stdout.strip()
        out(f"# Encryption: `bench/crypt.py {' '.join(sys.argv[1:])}`\n",
            f"{a.rounds} round(s) of {a.runtime} s; cairn {rev}, {os.cpu_count()} CPUs.\n")
        if "cipher" in parts:
            cipher_part(a)
        if "qsd" in parts:
            qsd_part(a)
        if "neighbour" in parts:
            neighbour_part(a)
    except KeyboardInterrupt:
        print("interrupted: stopping what runs and removing the files", file=sys.stderr)
        sys.exit(130)
    finally:
        thin.cleanup()


if __name__ == "__main__":
    main()
