#!/usr/bin/env python3
"""Hostile clients against cairn serve: the server's resident memory (VmRSS).

  bench/hostile.py [--bin PATH] [--budget SIZE]
  bench/hostile.py --idle 0,100,1000,4000 [--bin PATH] [--headers simple,extended,tls]
                   [--then none|read|burst] [--churn N]

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
(simple: no options; extended: NBD_OPT_EXTENDED_HEADERS; tls: STARTTLS with a P-256
certificate made by openssl, then simple headers) a fresh `cairn serve --device null:1G
--max-connections 5000 --max-connections-per-address 5000` takes clients that finish the
handshake (GO) and then send nothing, from 127.0.3.1, 127.0.3.2, ... (100 per address);
at each count (cumulative), two seconds after the last handshake (three with --then
burst), the script reads the
server's VmRSS, its open descriptors (/proc/PID/fd) and threads. --then read: each client
first reads 4 KiB; --then burst: each first sends 9,000 flushes at once (246 KiB of
headers, as a deeply pipelining client would) and reads the replies. --churn N: before
the measured clients, N connections are opened and closed, twice (the allocator's reuse
of their memory). The last column divides the growth since 0 connections by the
connections open.
"""
import argparse, os, signal, socket, ssl, struct, subprocess, sys, tempfile, time

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
    if "--max-connections-per-address" in helptext:  # older builds have no such limit
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

def certificates():
    """A self-signed P-256 certificate for 127.0.0.1, in a new directory."""
    d = tempfile.mkdtemp(prefix="hostile-tls-")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-keyout", f"{d}/server-key.pem", "-out", f"{d}/server-cert.pem"],
                   check=True, capture_output=True)
    return d

def go_tls(i, port, source):
    """The handshake with STARTTLS, then GO over TLS; returns the TLS socket."""
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    recv_exact(s, 18)
    s.sendall(struct.pack(">I", 3))
    s.sendall(struct.pack(">QII", 0x49484156454F5054, 5, 0))
    _, _, t, n = struct.unpack(">QIII", recv_exact(s, 20))
    recv_exact(s, n)
    assert t == 1, f"STARTTLS: reply type {t:#x}"
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    s = ctx.wrap_socket(s)
    s.sendall(struct.pack(">QII", 0x49484156454F5054, 7, 6) + struct.pack(">IH", 0, 0))
    while True:
        _, _, t, n = struct.unpack(">QIII", recv_exact(s, 20))
        recv_exact(s, n)
        if t == 1:
            return s
        assert t < 0x80000000, f"GO: error reply {t:#x}"

def request(extended, command, cookie, offset=0, length=0):
    if extended:
        return struct.pack(">IHHQQQ", 0x21E41C71, 0, command, cookie, offset, length)
    return struct.pack(">IHHQQI", 0x25609513, 0, command, cookie, offset, length)

def drain(socks):
    """Reads whatever replies wait on `socks`, so that nothing waits to be sent."""
    for s in socks:
        s.setblocking(False)
        try:
            while s.recv(1 << 16):
                pass
        except (BlockingIOError, ssl.SSLWantReadError):
            pass
        s.setblocking(True)

def idle(binary, counts, headers, then, churn, port=10898):
    """Rows (connections, VmRSS KiB, descriptors, threads, KiB per connection)."""
    args = [binary, "serve", "--device", "null:1G", "--listen", f"tcp:127.0.0.1:{port}",
            "--max-connections", "5000", "--max-connections-per-address", "5000",
            "--log-level", "warn"]
    if headers == "tls":
        args += ["--tls-certificates", certificates()]
    log = open("/tmp/hostile-idle.log", "w+")
    srv = subprocess.Popen(args, stderr=log)
    time.sleep(1)
    extended = headers == "extended"
    def connect(i, block):
        src = f"127.0.{block}.{1 + i // 100}"
        return go_tls(i, port, src) if headers == "tls" else go(i, port, extended, src)
    socks, rows, base = [], [], None
    try:
        if churn:  # connections that come and go before the measured ones
            for _ in range(2):
                old = [connect(i, 4) for i in range(churn)]
                for s in old:
                    s.close()
                time.sleep(1)
        for n in counts:
            while len(socks) < n:
                i = len(socks)
                s = connect(i, 3)
                if then == "read":
                    s.sendall(request(extended, 0, i, 0, 4096))
                elif then == "burst":  # 9,000 flushes at once (246 KiB of headers)
                    s.sendall(b"".join(request(extended, 3, j) for j in range(9000)))
                socks.append(s)
                if then == "burst" and len(socks) % 50 == 0:
                    time.sleep(0.2)
                    drain(socks[-50:])
            # An idle connection's input buffer goes back after a second idle (and up to
            # a second more).
            time.sleep(3 if then == "burst" else 2)
            if then != "none":
                drain(socks)
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
    ap.add_argument("--headers", default="simple,extended",
                    help="with --idle: simple, extended and/or tls, comma-separated")
    ap.add_argument("--then", default="none", choices=["none", "read", "burst"],
                    help="with --idle: what each client does before it goes idle")
    ap.add_argument("--churn", type=int, default=0,
                    help="with --idle: first open and close this many connections, twice")
    a = ap.parse_args()
    if a.idle:
        counts = [int(c) for c in a.idle.split(",")]
        print("| headers | before going idle | idle connections | server VmRSS | descriptors"
              " | threads | per connection |")
        print("|---|---|---|---|---|---|---|")
        then = {"none": "nothing", "read": "one 4 KiB read",
                "burst": "9,000 flushes at once"}[a.then]
        if a.churn:
            then += f"; {a.churn} came and went, twice"
        for headers in a.headers.split(","):
            for n, kib, nfd, nth, per in idle(a.bin, counts, headers, a.then, a.churn):
                print(f"| {headers} | {then} | {n} | {kib / 1024:.1f} MiB | {nfd} | {nth} | {per} |")
        return
    print("| scenario | server VmRSS | status |\n|---|---|---|")
    for mode in ("half", "noread"):
        mib, status = scenario(mode, a.bin, a.budget)
        print(f"| {mode} | {mib} MiB | {status} |")

if __name__ == "__main__":
    main()
