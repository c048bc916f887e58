#!/usr/bin/env python3
"""Hostile clients against cairn serve: the server's resident memory (VmRSS).

  bench/hostile.py [--bin PATH] [--budget SIZE]
  bench/hostile.py --idle 0,100,1000,4000 [--bin PATH] [--used]

Two scenarios, each against a fresh `cairn serve --device null:1G` on TCP port 10899
(--max-connections 200 --max-connections-per-address 200, so that every client is let
in, the second flag only for builds that have it; each client connects from its own 127.0.x.y address):
  half    100 clients each send a 32 MiB write's header and half its payload, as much of
          it as the server takes within 0.5 s, then nothing
  noread  40 clients each send 64 reads of 1 MiB and never read a reply
Three seconds after the last client, the script reads the server's VmRSS from
/proc/PID/status, then sends SIGUSR1 for its status line (memory charged, the budget,
waits for memory). --budget passes --memory-budget (default: the server's own default).

--idle COUNTS measures what an idle connection costs instead. For each kind of header
(simple: no options; extended: NBD_OPT_EXTENDED_HEADERS) a fresh `cairn serve --device
null:1G --max-connections 5000 --max-connections-per-address 5000` takes clients that
finish the handshake (GO) and then send nothing, from 127.0.3.1, 127.0.3.2, ... (100 per
address); at each count (cumulative), two seconds after the last handshake, the script
reads the server's VmRSS, its open descriptors (/proc/PID/fd) and threads. With --used
each client first reads 4 KiB, then goes idle. The last column divides the growth since
0 connections by the connections open.
"""
import argparse, os, signal, socket, struct, subprocess, sys, time

def rss(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) >> 10

def recv_exact(s, n):
    b = b""
    while len(b) < n:
        d = s.recv(n - len(b))
        if not d:
            raise EOFError("the server closed the connection")
        b += d
    return b

def go(i, port, extended=False, source=None):
    s = socket.socket()
    s.bind((source or f"127.0.{2 + i // 250}.{1 + i % 250}", 0))
    s.connect(("127.0.0.1", port))
    recv_exact(s, 18)
    s.sendall(struct.pack(">I", 3))
    if extended:  # NBD_OPT_EXTENDED_HEADERS, answered with an ACK
        s.sendall(struct.pack(">QII", 0x49484156454F5054, 11, 0))
        _, _, t, n = struct.unpack(">QIII", recv_exact(s, 20))
        recv_exact(s, n)
        assert t == 1, f"EXTENDED_HEADERS: reply type {t:#x}"
    s.sendall(struct.pack(">QII", 0x49484156454F5054, 7, 6) + struct.pack(">IH", 0, 0))
    while True:
        _, _, t, n = struct.unpack(">QIII", recv_exact(s, 20))
        recv_exact(s, n)
        if t == 1:
            return s
        assert t < 0x80000000, f"GO: error reply {t:#x}"

def scenario(mode, binary, budget, port=10899):
    args = [binary, "serve", "--device", "null:1G", "--listen", f"tcp:127.0.0.1:{port}",
            "--max-connections", "200"]
    helptext = subprocess.run([binary, "serve", "--help"], capture_output=True, text=True).stdout
    if "--max-connections-per-address" in helptext:  # builds before issue 18 have no such limit
        args += ["--max-connections-per-address", "200"]
    if budget:
        args += ["--memory-budget", budget]
    log = open(f"/tmp/hostile-{mode}.log", "w+")
    srv = subprocess.Popen(args, stderr=log)
    time.sleep(1)
    socks, chunk = [], b"\xab" * (1 << 20)
    n = 100 if mode == "half" else 40
    for i in range(n):
        s = go(i, port)
        if mode == "half":
            s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 1, i, 0, 32 << 20))
            s.settimeout(0.5)
            left = 16 << 20
            try:
                while left:
                    k = min(left, len(chunk))
                    s.sendall(chunk[:k])
                    left -= k
            except socket.timeout:
                pass
        else:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(b"".join(struct.pack(">IHHQQI", 0x25609513, 0, 0, j, j << 20, 1 << 20)
                               for j in range(64)))
        socks.append(s)
    time.sleep(3)
    mib = rss(srv.pid)
    srv.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    log.seek(0)
    status = next((l.split("status: ", 1)[1].strip() for l in log if "status: " in l), "")
    srv.terminate()
    srv.wait()
    for s in socks:
        s.close()
    return mib, status

def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))

def threads(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("Threads"):
            return int(line.split()[1])

def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1])

def idle(binary, counts, extended, used, port=10898):
    args = [binary, "serve", "--device", "null:1G", "--listen", f"tcp:127.0.0.1:{port}",
            "--max-connections", "5000", "--max-connections-per-address", "5000",
            "--log-level", "warn"]
    log = open(f"/tmp/hostile-idle.log", "w+")
    srv = subprocess.Popen(args, stderr=log)
    time.sleep(1)
    socks, rows, base = [], [], None
    try:
        for n in counts:
            while len(socks) < n:
                i = len(socks)
                s = go(i, port, extended, f"127.0.3.{1 + i // 100}")
                if used:
                    if extended:
                        s.sendall(struct.pack(">IHHQQQ", 0x21E41C71, 0, 0, i, 0, 4096))
                    else:
                        s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 0, i, 0, 4096))
                socks.append(s)
            time.sleep(2)
            if used:  # take the replies, so that nothing waits to be sent
                for s in socks:
                    s.setblocking(False)
                    try:
                        while s.recv(1 << 16):
                            pass
                    except BlockingIOError:
                        pass
                time.sleep(0.5)
            kib = rss_kib(srv.pid)
            if base is None:
                base = kib
            per = f"{(kib - base) / len(socks):.1f} KiB" if socks else "-"
            rows.append((n, kib, fds(srv.pid), threads(srv.pid), per))
    finally:
        srv.terminate()
        srv.wait()
        for s in socks:
            s.close()
    return rows

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/cairn")
    ap.add_argument("--budget", default="")
    ap.add_argument("--idle", default="", help="connection counts, e.g. 0,100,1000,4000")
    ap.add_argument("--used", action="store_true", help="with --idle: one 4 KiB read first")
    a = ap.parse_args()
    if a.idle:
        counts = [int(c) for c in a.idle.split(",")]
        print("| headers | idle connections | server VmRSS | descriptors | threads | per connection |")
        print("|---|---|---|---|---|---|")
        for extended in (False, True):
            for n, kib, nfd, nth, per in idle(a.bin, counts, extended, a.used):
                h = "extended" if extended else "simple"
                print(f"| {h} | {n} | {kib / 1024:.1f} MiB | {nfd} | {nth} | {per} |")
        return
    print("| scenario | server VmRSS | status |\n|---|---|---|")
    for mode in ("half", "noread"):
        mib, status = scenario(mode, a.bin, a.budget)
        print(f"| {mode} | {mib} MiB | {status} |")

if __name__ == "__main__":
    main()
