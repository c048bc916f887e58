#!/usr/bin/env python3
"""Hostile clients against cairn serve: the server's resident memory (VmRSS).

  bench/hostile.py [--bin PATH] [--budget SIZE]

Two scenarios, each against a fresh `cairn serve --device null:1G` on TCP port 10899
(--max-connections 200 --max-connections-per-address 200, so that every client is let
in, the second flag only for builds that have it; each client connects from its own 127.0.x.y address):
  half    100 clients each send a 32 MiB write's header and half its payload, as much of
          it as the server takes within 0.5 s, then nothing
  noread  40 clients each send 64 reads of 1 MiB and never read a reply
Three seconds after the last client, the script reads the server's VmRSS from
/proc/PID/status, then sends SIGUSR1 for its status line (memory charged, the budget,
waits for memory). --budget passes --memory-budget (default: the server's own default).
"""
import argparse, os, signal, socket, struct, subprocess, sys, time

def rss(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) >> 10

def go(i, port):
    s = socket.socket()
    s.bind((f"127.0.{2 + i // 250}.{1 + i % 250}", 0))
    s.connect(("127.0.0.1", port))
    g = b""
    while len(g) < 18:
        g += s.recv(18 - len(g))
    s.sendall(struct.pack(">I", 3))
    s.sendall(struct.pack(">QII", 0x49484156454F5054, 7, 6) + struct.pack(">IH", 0, 0))
    while True:
        h = b""
        while len(h) < 20:
            h += s.recv(20 - len(h))
        _, _, t, n = struct.unpack(">QIII", h)
        d = b""
        while len(d) < n:
            d += s.recv(n - len(d))
        if t == 1:
            return s

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

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/cairn")
    ap.add_argument("--budget", default="")
    a = ap.parse_args()
    print("| scenario | server VmRSS | status |\n|---|---|---|")
    for mode in ("half", "noread"):
        mib, status = scenario(mode, a.bin, a.budget)
        print(f"| {mode} | {mib} MiB | {status} |")

if __name__ == "__main__":
    main()
