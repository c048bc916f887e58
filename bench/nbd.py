#!/usr/bin/env python3
"""The NBD benchmark: cairn serve against other NBD servers, with two clients.

  bench/nbd.py [--runtime SECS] [--rounds N] [--only WORKLOADS] [--servers NAMES]
               [--clients fio,cairn]

Each server is measured with each client over a Unix socket, one connection, one job:
  fio     fio's nbd engine (libnbd), the usual way to load an NBD server
  cairn   cairn bench --device nbd:URI, cairn's own client (the nbd device, driven on
          an io_uring reactor)
  cairn-poll  the same with --idle-poll 50us: the client's reactor keeps collecting
          replies for 50 us before it sleeps (not in the default set)
Variants (server x client) run in interleaved rounds and the medians are reported, as
in bench/engine.py. Every run starts its server afresh, waits until it answers (nbdinfo),
fills it if it keeps data in memory, runs fio, and stops it (SIGTERM, wait). Raw JSON
from every run goes to bench/out/nbd-*.json (fio's, with a "server" record added), server
logs to bench/out/nbd-SERVER.log, the tables to stdout (Markdown).

Workloads (--only):
  randread    4 KiB random reads, iodepth 32
  randwrite   4 KiB random writes, iodepth 32 (no flushes)
  seqread     1 MiB sequential reads, iodepth 8

Servers (--servers), all on the same 1 GiB of random data:
  cairn-mem       cairn serve --device mem:1G
  cairn-file      cairn serve --device file:/dev/shm/cairn-nbd.img,size=1G (the engine it picks)
  nbdkit-memory   nbdkit -f memory 1G                (sparse allocator, 16 threads)
  nbdkit-file     nbdkit -f file /dev/shm/cairn-nbd.img   (pread/pwrite, 16 threads)
  qemu-nbd        qemu-nbd -f raw -t --cache=writeback --aio=io_uring /dev/shm/cairn-nbd.img
  nbd-server      nbd-server with a generated config (bench/out/nbd-server.conf):
                  unixsock, one export of the /dev/shm file, default max_threads (4)

Every server keeps its defaults otherwise. The data: one 1 GiB file of random bytes,
/dev/shm/cairn-nbd.img, written at the start. The file servers serve that file itself
(one at a time; the random writes keep it random). The memory servers start empty, so
each of their runs first copies the file in with nbdcopy. Choices for qemu-nbd: tmpfs
has no O_DIRECT, so --cache=none (and --aio=native, which needs it) are out; writeback
is qemu-nbd's default and goes through the page cache that holds the tmpfs data anyway;
--aio=io_uring matches cairn-file's engine. -t keeps qemu-nbd up after the readiness
probe disconnects. nbd-server cannot stay in the foreground and serve more than one
connection (-d serves a single one), so it daemonizes; this script makes itself a child
subreaper so the daemon is still its child and can be waited for. nbd-server handles each
connection in a forked child; its CPU is counted through the parent's cutime/cstime.

Server CPU: utime+stime (plus reaped children's) of the server process, from
/proc/PID/stat just before and just after the client, in seconds per 100k I/Os, and as
cores busy over the run. The client's own CPU (usr+sys from its JSON; cairn bench writes
fio's format) is shown alongside: on a 2-core machine client and server share the cores. Latency is fio's total latency
(submission + completion) mean; p99 is of completion latency.

The targets: with cairn's client, cairn >= 1.5x the best peer for randread and randwrite;
cairn's client >= 2x fio's against cairn serve (randread); server CPU per 100k I/Os of
cairn <= 0.6x the best peer's. The script just reports the ratios.

This build against another (--before BIN|REV): adds cairn-mem@before and
cairn-file@before (for those of cairn-mem and cairn-file in --servers), served by BIN, or
by a release build of git revision REV (built in a worktree under bench/out/, with its own
target directory, once per revision). Each round runs both builds back to back, and a
table gives each round's ratio, this build over the other: the median and the spread
(odd rounds run the servers in reverse order, so neither build always goes first).
With --pin, every server runs on CPU 0 (cairn serve with one reactor) and every client on
CPU 1, so that they stop trading cores: steadier figures for comparing builds.
E.g. the check that serving unaligned requests costs aligned ones nothing:
  bench/nbd.py --before 976b533 --servers cairn-mem --clients fio,cairn --pin \
      --only randread,randwrite --rounds 15 --runtime 3
"""
import argparse
import ctypes
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import CAIRN, OUT, ROOT, build, compare, fmt_iops  # noqa: E402

IMG = "/dev/shm/cairn-nbd.img"
SIZE = 1 << 30
CLK_TCK = os.sysconf("SC_CLK_TCK")

WORKLOADS = {
    # name: (fio rw, bs, iodepth, title)
    "randread": ("randread", "4k", 32, "4 KiB random read, iodepth 32"),
    "randwrite": ("randwrite", "4k", 32, "4 KiB random write, iodepth 32"),
    "seqread": ("read", "1M", 8, "1 MiB sequential read, iodepth 8"),
}
SERVER_NAMES = ["cairn-mem", "cairn-file", "nbdkit-memory", "nbdkit-file", "qemu-nbd", "nbd-server"]
CLIENT_NAMES = ["fio", "cairn", "cairn-poll"]
DEFAULT_CLIENTS = ["fio", "cairn"]
CAIRN_SERVERS = ("cairn-mem", "cairn-file")
# The binary serving NAME@before (set by --before).
BEFORE = {"bin": None, "label": None}
# --pin: servers on CPU 0 (cairn with one reactor), clients on CPU 1.
PIN = {"on": False}


def sock_path(name):
    return os.path.join(OUT, f"nbd-{name}.sock")


class Server:
    """One server process: start, wait until it answers, stop."""

    def __init__(self, name, cairn_args=()):
        self.name = name
        self.sock = sock_path(name)
        self.export = ""
        self.memory = name.split("@")[0] in ("cairn-mem", "nbdkit-memory")
        self.cairn_args = list(cairn_args)
        self.proc = None
        self.pid = None
        self.log = None
        self.cmd = None

    @property
    def uri(self):
        return f"nbd+unix:///{self.export}?socket={self.sock}"

    def command(self):
        cmd = self.unpinned_command()
        if not PIN["on"]:
            return cmd
        if self.name.startswith("cairn-"):
            i = cmd.index("serve") + 1
            cmd = cmd[:i] + ["--threads", "1"] + cmd[i:]
        return ["taskset", "-c", "0", *cmd]

    def unpinned_command(self):
        s = self.sock
        name, _, build = self.name.partition("@")
        cairn = BEFORE["bin"] if build == "before" else CAIRN
        if name == "cairn-mem":
            return [cairn, *self.cairn_args, "serve", "--listen", f"unix:{s}", "--device", "mem:1G"]
        if name == "cairn-file":
            return [cairn, *self.cairn_args, "serve", "--listen", f"unix:{s}", "--device",
                    f"file:{IMG},size=1G"]
        if self.name == "nbdkit-memory":
            return ["nbdkit", "-U", s, "-f", "memory", "1G"]
        if self.name == "nbdkit-file":
            return ["nbdkit", "-U", s, "-f", "file", IMG]
        if self.name == "qemu-nbd":
            return ["qemu-nbd", "-k", s, "-f", "raw", "-t", "--cache=writeback", "--aio=io_uring", IMG]
        if self.name == "nbd-server":
            self.export = "bench"
            conf = os.path.join(OUT, "nbd-server.conf")
            with open(conf, "w") as f:
                f.write(f"[generic]\nunixsock = {s}\n\n[bench]\nexportname = {IMG}\n")
            return ["nbd-server", "-C", conf, "-p", os.path.join(OUT, "nbd-server.pid")]
        raise ValueError(self.name)

    def start(self):
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        cmd = self.cmd = self.command()
        self.log = open(os.path.join(OUT, f"nbd-{self.name}.log"), "a")
        self.log.write(f"--- {time.strftime('%H:%M:%S')} {shlex.join(cmd)}\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        if self.name == "nbd-server":
            # It forks into the background; the parent exits once the daemon is set up.
            pidfile = os.path.join(OUT, "nbd-server.pid")
            if self.proc.wait(timeout=10) != 0:
                sys.exit(f"nbd-server failed to start ({self.proc.returncode}); see {self.log.name}")
            self.proc = None
            deadline = time.monotonic() + 10
            while True:
                try:
                    with open(pidfile) as f:
                        self.pid = int(f.read().strip())
                    break
                except (OSError, ValueError):
                    if time.monotonic() > deadline:
                        sys.exit("nbd-server wrote no pid file")
                    time.sleep(0.02)
        else:
            self.pid = self.proc.pid
        deadline = time.monotonic() + 20
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                sys.exit(f"{self.name} exited ({self.proc.returncode}) before answering; see {self.log.name}")
            if os.path.exists(self.sock):
                r = subprocess.run(["nbdinfo", "--size", self.uri], stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True)
                if r.returncode == 0:
                    size = int(r.stdout.strip())
                    if size != SIZE:
                        sys.exit(f"{self.name}: export size {size}, expected {SIZE}")
                    break
            if time.monotonic() > deadline:
                sys.exit(f"{self.name} did not answer on {self.sock} within 20 s; see {self.log.name}")
            time.sleep(0.02)

    def fill(self):
        # One connection: nbdcopy's default of four is slower here, and qemu-nbd allows one.
        r = subprocess.run(["nbdcopy", "--connections=1", IMG, self.uri],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            sys.exit(f"{self.name}: nbdcopy failed ({r.returncode}): {r.stderr}")

    def cpu_ticks(self):
        """utime+stime+cutime+cstime of the server process, after its connection
        children (nbd-server) have exited and been reaped, plus any still alive."""
        deadline = time.monotonic() + 2
        while True:
            kids = children(self.pid)
            if not kids or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return sum(ticks(p) for p in [self.pid, *kids])

    def stop(self):
        """SIGTERM, wait; returns the exit status (negative: killed by that signal)."""
        status = None
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            if self.proc is not None:
                try:
                    status = self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    print(f"{self.name}: still running 15 s after SIGTERM; SIGKILL", file=sys.stderr)
                    self.proc.kill()
                    status = self.proc.wait()
            else:
                status = wait_adopted(self.pid, self.name)
        if status not in (0, None, -signal.SIGTERM):
            print(f"{self.name}: exited with status {status} after SIGTERM; see {self.log.name}",
                  file=sys.stderr)
        if self.log:
            self.log.write(f"--- exit status {status}\n")
            self.log.close()
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        self.pid = self.proc = None
        return status


def wait_adopted(pid, name):
    """Waits for a daemon this process adopted as child subreaper."""
    deadline = time.monotonic() + 15
    while True:
        try:
            done, st = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            # Not our child (subreaper unavailable): poll until it is gone.
            if not os.path.exists(f"/proc/{pid}") or proc_state(pid) == "Z":
                return None
            done, st = 0, 0
        if done:
            return os.waitstatus_to_exitcode(st)
        if time.monotonic() > deadline:
            print(f"{name}: still running 15 s after SIGTERM; SIGKILL", file=sys.stderr)
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 15
        time.sleep(0.02)


def stat_fields(pid):
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    # Fields after the command name (which may hold spaces), numbered from 3 (state).
    return s[s.rindex(")") + 2:].split()


def proc_state(pid):
    try:
        return stat_fields(pid)[0]
    except (OSError, IndexError):
        return None


def ticks(pid):
    try:
        f = stat_fields(pid)
    except OSError:
        return 0
    # utime, stime, cutime, cstime are fields 14-17 of proc(5): indexes 11-14 here.
    return sum(int(x) for x in f[11:15])


def children(pid):
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                f = stat_fields(d)
            except OSError:
                continue
            if f[1] == str(pid):
                kids.append(int(d))
    return kids


def parse_fio(text):
    # The nbd engine prints "fio: connected to NBD server" before the JSON.
    i = text.find("{")
    if i < 0:
        raise ValueError("no JSON in fio's output")
    return json.loads(text[i:])


def client_command(client, uri, rw, bs, depth, runtime):
    cmd = unpinned_client_command(client, uri, rw, bs, depth, runtime)
    return ["taskset", "-c", "1", *cmd] if PIN["on"] else cmd


def unpinned_client_command(client, uri, rw, bs, depth, runtime):
    if client in ("cairn", "cairn-poll"):
        poll = ["--idle-poll", "50us"] if client == "cairn-poll" else []
        return [CAIRN, "bench", "--log-level", "warn", *poll, "--device", f"nbd:{uri}",
                f"--rw={rw}", f"--bs={bs}", f"--iodepth={depth}", "--numjobs=1",
                f"--runtime={runtime}s", "--time_based", "--output-format=json"]
    return ["fio", "--name=nbd", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}",
            f"--iodepth={depth}", "--numjobs=1", f"--runtime={runtime}", "--time_based",
            "--norandommap", "--randrepeat=0", "--group_reporting", "--output-format=json"]


def run(server_name, client, workload, runtime, cairn_args):
    rw, bs, depth, _ = WORKLOADS[workload]
    srv = Server(server_name, cairn_args)
    try:
        srv.start()
        t0 = time.monotonic()
        if srv.memory:
            srv.fill()
        fill_s = time.monotonic() - t0
        cmd = client_command(client, srv.uri, rw, bs, depth, runtime)
        j, cpu_s, wall = measured_client(srv, cmd, f"{client} against {server_name}")
    finally:
        status = srv.stop()
    j["client"] = {"name": client, "cmd": cmd}
    j["server"] = {"name": server_name, "cmd": srv.cmd, "cpu_s": cpu_s,
                   "fio_wall_s": wall, "fill_s": fill_s, "exit_status": status}
    return j


def measured_client(srv, cmd, what):
    """Runs the client `cmd` against `srv` (anything with cpu_ticks()); returns its JSON,
    the server's CPU seconds over the run and the run's wall seconds."""
    before = srv.cpu_ticks()
    wall0 = time.monotonic()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.monotonic() - wall0
    after = srv.cpu_ticks()
    if r.returncode != 0:
        sys.exit(f"{what} failed ({r.returncode}):\n{r.stderr}\n{r.stdout[-2000:]}")
    return parse_fio(r.stdout), (after - before) / CLK_TCK, wall


def summary(j):
    job = j["jobs"][0]
    d = job["write"] if job["write"]["total_ios"] else job["read"]
    ios = job["read"]["total_ios"] + job["write"]["total_ios"]
    runtime_s = job["job_runtime"] / 1000
    fio_cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * runtime_s
    srv = j["server"]
    return {"iops": d["iops"], "bw": d["bw_bytes"], "lat_mean_ns": d["lat_ns"]["mean"],
            "clat_p99_ns": d["clat_ns"].get("percentile", {}).get("99.000000", 0),
            "ios": ios, "cpu_s": srv["cpu_s"],
            "cpu_per_100k": srv["cpu_s"] * 1e5 / max(ios, 1),
            "cpu_cores": srv["cpu_s"] / max(srv["fio_wall_s"], 1e-9),
            "fio_cpu_per_100k": fio_cpu * 1e5 / max(ios, 1)}


def med(rs, key):
    return statistics.median(r[key] for r in rs)


def prepare(args):
    missing = [t for t in ("fio", "nbdinfo", "nbdcopy") if shutil.which(t) is None]
    if missing:
        sys.exit(f"missing: {', '.join(missing)} (apt-get install fio libnbd-bin)")
    if not args.no_build:
        build()
    os.makedirs(OUT, exist_ok=True)
    # Adopt daemons (nbd-server) so they can be waited for. PR_SET_CHILD_SUBREAPER = 36.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    print(f"writing {SIZE >> 20} MiB of random data to {IMG}", file=sys.stderr)
    with open(IMG, "wb") as f:
        for _ in range(SIZE >> 20):
            f.write(os.urandom(1 << 20))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--runtime", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(WORKLOADS), help="workloads, comma-separated")
    ap.add_argument("--servers", default=",".join(SERVER_NAMES), help="servers, comma-separated")
    ap.add_argument("--clients", default=",".join(DEFAULT_CLIENTS),
                    help=f"clients, comma-separated (known: {', '.join(CLIENT_NAMES)})")
    ap.add_argument("--cairn-args", default="", help="global switches for cairn (e.g. '--threads 1')")
    ap.add_argument("--no-build", action="store_true", help="skip cargo build --release")
    ap.add_argument("--keep", action="store_true", help=f"keep {IMG} afterwards")
    ap.add_argument("--pin", action="store_true",
                    help="servers on CPU 0 (cairn serve --threads 1), clients on CPU 1")
    ap.add_argument("--before", metavar="BIN|REV",
                    help="also serve with this binary or git revision (NAME@before servers)")
    args = ap.parse_args()
    only = [w for w in args.only.split(",") if w]
    servers = [s for s in args.servers.split(",") if s]
    clients = [c for c in args.clients.split(",") if c]
    for c in clients:
        if c not in CLIENT_NAMES:
            sys.exit(f"unknown client {c!r}; known: {', '.join(CLIENT_NAMES)}")
    for w in only:
        if w not in WORKLOADS:
            sys.exit(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    for s in servers:
        if s not in SERVER_NAMES:
            sys.exit(f"unknown server {s!r}; known: {', '.join(SERVER_NAMES)}")
    tool = {"nbdkit-memory": "nbdkit", "nbdkit-file": "nbdkit", "qemu-nbd": "qemu-nbd",
            "nbd-server": "nbd-server"}
    for s in list(servers):
        if s in tool and shutil.which(tool[s]) is None:
            print(f"{s}: skipped ({tool[s]} is not installed)", file=sys.stderr)
            servers.remove(s)
    cairn_args = shlex.split(args.cairn_args)
    t, n = args.runtime, args.rounds
    PIN["on"] = args.pin
    if args.pin and (os.cpu_count() or 1) < 2:
        sys.exit("--pin needs two CPUs")
    if args.before:
        BEFORE["bin"], BEFORE["label"] = before_binary(args.before)
        servers = [x for s in servers
                   for x in ([s, f"{s}@before"] if s in CAIRN_SERVERS else [s])]
    try:
        prepare(args)
        out = [f"Median of {n} interleaved rounds of {t} s each (`bench/nbd.py --runtime {t} --rounds {n}"
               + (f" --cairn-args '{args.cairn_args}'" if cairn_args else "")
               + (" --pin" if args.pin else "")
               + (f" --before {args.before}" if args.before else "") + "`); "
               f"{subprocess.run(['fio', '--version'], stdout=subprocess.PIPE, text=True).stdout.strip()} "
               "ioengine=nbd and cairn bench --device nbd:URI, each over a Unix socket, one connection; "
               f"{os.cpu_count()} CPUs.", ""]
        for w in only:
            variants = [(f"{s} {c}", lambda s=s, c=c, w=w: run(s, c, w, t, cairn_args))
                        for s in servers for c in clients]
            res = compare(w, variants, n, summarize=summary, prefix="nbd",
                          alternate=bool(args.before))
            for c in clients:
                out += table(w, {s: res[f"{s} {c}"] for s in servers}, servers, c)
            if "fio" in clients and len(clients) > 1:
                out += client_table(w, res, servers, [c for c in clients if c != "fio"])
            if args.before:
                out += before_table(w, res, servers, clients)
    finally:
        if not args.keep and os.path.exists(IMG):
            os.unlink(IMG)
    print("\n".join(out))


def table(w, res, servers, client):
    rw, bs, depth, title = WORKLOADS[w]
    seq = rw == "read"
    key = "bw" if seq else "iops"
    peers = [s for s in servers if s.split("@")[0] not in CAIRN_SERVERS]
    best = max(peers, key=lambda s: med(res[s], key)) if peers else None
    best_v = med(res[best], key) if best else None
    unit = "MB/s" if seq else "IOPS"
    lines = [f"{title}, client {client}:", "",
             f"| server | {unit} | vs best peer | lat mean (µs) | clat p99 (µs) | server CPU (cores) | "
             f"server CPU s / 100k I/Os | {client} CPU s / 100k I/Os |",
             "|---|---|---|---|---|---|---|---|"]
    for s in servers:
        rs = res[s]
        v = med(rs, key)
        cell = f"{v / 1e6:.0f}" if seq else fmt_iops(v)
        ratio = f"{v / best_v:.2f}x" if best_v else "-"
        name = f"**{s}**" if s == best else s
        lines.append(f"| {name} | {cell} | {ratio} | {med(rs, 'lat_mean_ns') / 1000:.1f} | "
                     f"{med(rs, 'clat_p99_ns') / 1000:.1f} | {med(rs, 'cpu_cores'):.2f} | "
                     f"{med(rs, 'cpu_per_100k'):.2f} | {med(rs, 'fio_cpu_per_100k'):.2f} |")
    lines.append("")
    if best and w in ("randread", "randwrite"):
        cpu_best = min(peers, key=lambda s: med(res[s], "cpu_per_100k"))
        cpu_best_v = med(res[cpu_best], "cpu_per_100k")
        for c in CAIRN_SERVERS:
            if c in res:
                lines.append(f"{c}: cairn / best peer ({best}) = {med(res[c], key) / best_v:.2f}x "
                             f"(target 1.5x); server CPU per 100k I/Os / best peer's ({cpu_best}) = "
                             f"{med(res[c], 'cpu_per_100k') / max(cpu_best_v, 1e-9):.2f}x (target 0.6x)  ")
        lines.append("")
    return lines


def before_binary(spec):
    """The binary for NAME@before servers, and how to name it: BIN itself, or a release
    build of revision REV in a worktree under bench/out/ (built once)."""
    if os.path.isfile(spec) and os.access(spec, os.X_OK):
        return os.path.abspath(spec), spec
    r = subprocess.run(["git", "rev-parse", "--short", f"{spec}^{{commit}}"], cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(f"--before {spec}: neither an executable nor a git revision: {r.stderr.strip()}")
    rev = r.stdout.strip()
    tree = os.path.join(OUT, f"before-{rev}")
    target = os.path.join(OUT, "target-before")
    binary = os.path.join(target, "release", f"cairn-{rev}")
    if not os.path.exists(binary):
        os.makedirs(OUT, exist_ok=True)
        if not os.path.isdir(tree):
            subprocess.run(["git", "worktree", "add", "--detach", tree, rev], cwd=ROOT, check=True)
        print(f"building {rev} in {tree} (once)", file=sys.stderr)
        subprocess.run(["cargo", "build", "--release", "-q", "--bin", "cairn"], cwd=tree,
                       env={**os.environ, "CARGO_TARGET_DIR": target}, check=True)
        shutil.copy(os.path.join(target, "release", "cairn"), binary)
        subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT)
    return binary, rev


def before_table(w, res, servers, clients):
    """Each round's ratio of this build over the --before one, same server and client."""
    rw, bs, depth, title = WORKLOADS[w]
    key = "bw" if rw == "read" else "iops"
    lines = [f"{title}: this build / {BEFORE['label']}, per round (median, min..max):", "",
             "| server | client | this build | before | ratio | spread | server CPU / I/O, before / this build | spread |",
             "|---|---|---|---|---|---|---|---|"]
    cell = (lambda v: f"{v / 1e6:.0f} MB/s") if key == "bw" else fmt_iops
    for s in servers:
        if s.split("@")[0] not in CAIRN_SERVERS or "@" in s or f"{s}@before" not in servers:
            continue
        for c in clients:
            now, then = res[f"{s} {c}"], res[f"{s}@before {c}"]
            ratios = [a[key] / max(b[key], 1e-9) for a, b in zip(now, then)]
            # Server CPU per I/O, the other way up: above 1 means this build uses less.
            cpu = [b["cpu_per_100k"] / max(a["cpu_per_100k"], 1e-9) for a, b in zip(now, then)]
            lines.append(f"| {s} | {c} | {cell(med(now, key))} | {cell(med(then, key))} | "
                         f"{statistics.median(ratios):.3f}x | {min(ratios):.3f}..{max(ratios):.3f} | "
                         f"{statistics.median(cpu):.3f}x | {min(cpu):.3f}..{max(cpu):.3f} |")
    lines.append("")
    return lines


def client_table(w, res, servers, others):
    """Each server's figure with cairn's client(s) over fio's."""
    rw, bs, depth, title = WORKLOADS[w]
    key = "bw" if rw == "read" else "iops"
    cell = (lambda v: f"{v / 1e6:.0f} MB/s") if key == "bw" else fmt_iops
    lines = [f"{title}: cairn's client / fio's, same server, same run:", "",
             "| server | fio | " + " | ".join(f"{c} | {c} / fio" for c in others) + " |",
             "|---|---|" + "---|---|" * len(others)]
    for s in servers:
        f = med(res[f"{s} fio"], key)
        cells = [f"{cell(med(res[f'{s} {c}'], key))} | {med(res[f'{s} {c}'], key) / max(f, 1e-9):.2f}x"
                 for c in others]
        lines.append(f"| {s} | {cell(f)} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


if __name__ == "__main__":
    main()
