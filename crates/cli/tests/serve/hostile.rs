use super::*;

/// A server on an ephemeral TCP port of 127.0.0.1, and the port.
fn tcp_server(args: &[&str]) -> (Server, u16) {
    let dir = tmpdir();
    let none = dir.path().join("no.sock");
    let srv = Server::spawn(dir, none, &["--listen", "tcp:127.0.0.1:0"], args);
    let port = srv.addrs[0]
        .strip_prefix("tcp:127.0.0.1:")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("ready line address {:?}", srv.addrs));
    (srv, port)
}

/// A client from `from` in transmission on export "".
fn go_from(from: [u8; 4], port: u16) -> Raw {
    Raw::connect_tcp_from(from, port)
        .handshake_on(&[], "", &[])
        .0
}

/// A write and a read back on `c`.
#[track_caller]
fn served(c: &mut Raw, what: &str, seed: u64) {
    let data = random_bytes(65536, seed);
    let at = (seed % 64) << 16;
    c.write_ok(seed, 0, at, &data);
    assert_same(what, &c.read_ok(seed + 1, at, 65536), &data);
}

#[test]
fn one_address_cannot_take_every_slot_at_the_defaults() {
    let (srv, port) = tcp_server(&["--device", "mem:16M"]);
    let mut idle = Vec::new();
    let mut refused = 0;
    for _ in 0..128 {
        match Raw::connect_tcp_from([127, 0, 0, 2], port).admitted_now() {
            Some(c) => idle.push(c.after_greeting(&[], "", &[]).0),
            None => refused += 1,
        }
    }
    assert_eq!(
        (idle.len(), refused),
        (32, 96),
        "128 connections from one address, at --max-connections-per-address 32"
    );
    // Others still get in; the address's own connections still work.
    let mut good = go_from([127, 0, 0, 1], port);
    served(&mut good, "a client from another address", 1);
    served(&mut idle[31], "the address's last admitted connection", 3);
    let log = srv.stderr();
    assert!(
        log.contains(
            "refused, 32 connections from 127.0.0.2 already (--max-connections-per-address)"
        ),
        "{log}"
    );
}

#[test]
fn a_good_client_is_served_while_128_idle_clients_sit_connected() {
    let (srv, port) = tcp_server(&[
        "--device",
        "mem:16M",
        "--max-connections",
        "128",
        "--idle-timeout",
        "3s",
    ]);
    // 128 addresses, one idle connection each: every slot of --max-connections.
    let started = Instant::now();
    let mut idle: Vec<Raw> = (1..=128u8).map(|i| go_from([127, 0, 1, i], port)).collect();
    // None has been idle for 3 s yet: a new client is refused. (On a machine so busy
    // that the 128 handshakes took seconds, the first may be idle that long already.)
    let fresh = started.elapsed() < Duration::from_secs(2);
    let admitted = Raw::connect_tcp_from([127, 0, 0, 1], port).admitted_now();
    if fresh && started.elapsed() < Duration::from_secs(3) {
        assert!(
            admitted.is_none(),
            "a 129th connection while the 128 are fresh"
        );
    }
    drop(admitted);
    std::thread::sleep(Duration::from_millis(3500));
    // Now the connection idle longest makes room: one of the first (each reactor
    // takes its connections in turn, so a busy machine may let the second or third
    // be idle longest by the server's clock).
    let mut good = go_from([127, 0, 0, 1], port);
    served(&mut good, "the new client", 5);
    let (gone, log) = evicted(&srv, "128 connections already (--max-connections)");
    assert!(!gone.is_empty(), "{log}");
    for v in &gone {
        let i = idle
            .iter()
            .position(|c| c.local() == *v)
            .unwrap_or_else(|| panic!("{v} closed, not an idle client: {log}"));
        assert!(i < 8, "idle client {i} of 128 closed first: {log}");
        assert_closed(&mut idle[i], "the connection idle longest");
    }
    served(&mut idle[127], "an idle client that wakes up", 7);
    served(&mut good, "the new client, again", 9);
    assert!(
        srv.wait_for_stderr(
            "closed: idle past --idle-timeout, its slot was needed",
            IO_TIMEOUT
        ),
        "{}",
        srv.stderr()
    );
}

/// The peers the server's log says were closed to make room after `why` (waiting
/// for the first such line: the log is read on another thread), and the log.
fn evicted(srv: &Server, why: &str) -> (Vec<String>, String) {
    let needle = format!("{why}: closing ");
    srv.wait_for_stderr(&needle, IO_TIMEOUT);
    let log = srv.stderr();
    let peers = log
        .lines()
        .filter_map(|l| l.split(&needle).nth(1))
        .filter_map(|r| r.split(' ').next())
        .map(str::to_string)
        .collect();
    (peers, log)
}

/// Raises this process's soft descriptor limit to its hard limit; panics if that
/// leaves fewer than `n`.
fn descriptors_for(n: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit of this process, on a local rlimit.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        if lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        }
    }
    assert!(
        lim.rlim_cur >= n,
        "this test needs {n} descriptors; RLIMIT_NOFILE allows {}",
        lim.rlim_cur
    );
}

/// The last lines of a log.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

#[test]
fn a_new_client_is_served_while_1000_idle_connections_are_held_at_the_defaults() {
    descriptors_for(1000 + 500);
    let (srv, port) = tcp_server(&["--device", "mem:16M"]);
    let before = rss(&srv);
    // 1,000 connections from 40 addresses (25 each, under the 32 allowed per
    // address), each through the handshake, then silent.
    let mut idle = Vec::new();
    let mut refused = 0;
    for i in 0..1000u32 {
        let from = [127, 0, 2, 1 + (i / 25) as u8];
        match Raw::connect_tcp_from(from, port).admitted_now() {
            Some(c) => idle.push(c.after_greeting(&[], "", &[]).0),
            None => refused += 1,
        }
    }
    let held = rss(&srv).saturating_sub(before);
    // A new client is served at once (within 10 s, for slow machines).
    let started = Instant::now();
    let Some(good) = Raw::connect_tcp_from([127, 0, 0, 1], port).admitted_now() else {
        panic!(
                "a new client was refused while {} idle connections were held ({refused} of 1,000 refused); log ends:\n{}",
                idle.len(),
                tail(&srv.stderr())
            )
    };
    let mut good = good.after_greeting(&[], "", &[]).0;
    served(&mut good, "a new client beside 1,000 idle connections", 21);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "the new client took {took:?}"
    );
    assert_eq!(
        (idle.len(), refused),
        (1000, 0),
        "idle connections admitted and refused"
    );
    // Idle connections are cheap: about 12 KiB each here.
    assert!(
        held < 1000 * (64 << 10),
        "1,000 idle connections hold {} KiB of resident memory",
        held >> 10
    );
    served(&mut idle[0], "the first idle connection", 23);
    served(&mut idle[999], "the last idle connection", 25);
}

#[test]
fn a_full_server_closes_an_idle_connection_of_the_client_holding_most_before_the_idle_timeout() {
    let (srv, port) = tcp_server(&[
        "--device",
        "mem:16M",
        "--max-connections",
        "8",
        "--evict-idle-after",
        "1s",
    ]);
    let started = Instant::now();
    // Three connections from one address, then five from another: every slot.
    let mut few: Vec<Raw> = (0..3).map(|_| go_from([127, 0, 3, 2], port)).collect();
    // The first of the five goes into the middle of a write at once (half its
    // payload sent): a request in flight, so it keeps its slot until --idle-timeout
    // though it is idle longest.
    let mut many = vec![go_from([127, 0, 3, 1], port)];
    let payload = random_bytes(8192, 77);
    many[0]
        .send(&header(0, CMD_WRITE, 77, 1 << 20, 8192))
        .unwrap();
    many[0].send(&payload[..4096]).unwrap();
    many.extend((1..5).map(|_| go_from([127, 0, 3, 1], port)));
    let early = Raw::connect_tcp_from([127, 0, 3, 9], port).admitted_now();
    let fresh = started.elapsed() < Duration::from_millis(900);
    let mut good = match early {
        // Nobody has been idle for 1 s: refused. Then someone has.
        None => {
            std::thread::sleep(Duration::from_millis(1500));
            go_from([127, 0, 3, 9], port)
        }
        // A machine so slow that the first handshakes were 1 s ago already.
        Some(c) => {
            assert!(
                !fresh,
                "a ninth connection was admitted while the eight were fresh"
            );
            c.after_greeting(&[], "", &[]).0
        }
    };
    served(&mut good, "the new client", 31);
    // The client holding five gave up one (its longest quiet connection), though the
    // other client's have been idle longer, and long before --idle-timeout (5m).
    let (gone, log) = evicted(&srv, "8 connections already (--max-connections)");
    assert_eq!(gone.len(), 1, "{log}");
    let i = many
        .iter()
        .position(|c| c.local() == gone[0])
        .unwrap_or_else(|| panic!("{} closed, not the client holding five: {log}", gone[0]));
    assert!(
        i > 0,
        "the connection in the middle of a write was closed: {log}"
    );
    assert_closed(
        &mut many[i],
        "the longest idle connection of the client holding the most",
    );
    many[0].send(&payload[4096..]).unwrap();
    many[0].expect(77, 0);
    assert_same(
        "the write that was in the middle",
        &many[0].read_ok(78, 1 << 20, 8192),
        &payload,
    );
    for (j, c) in few.iter_mut().enumerate() {
        served(
            c,
            "a connection of the client holding three",
            40 + 2 * j as u64,
        );
    }
    served(
        &mut many[1 + i % 4],
        "another connection of the client holding five",
        51,
    );
    assert!(
        log.contains("over --evict-idle-after) to make room"),
        "{log}"
    );
    assert!(
        srv.wait_for_stderr(
            "closed: idle for --evict-idle-after, its slot was needed",
            IO_TIMEOUT
        ),
        "{}",
        srv.stderr()
    );
}

#[test]
fn at_its_per_address_limit_a_client_gives_up_its_own_longest_idle_connection() {
    let (srv, port) = tcp_server(&[
        "--device",
        "mem:16M",
        "--max-connections-per-address",
        "2",
        "--evict-idle-after",
        "1s",
    ]);
    // Another client's connection is idle longest of all, and stays.
    let mut other = go_from([127, 0, 4, 2], port);
    let mut mine: Vec<Raw> = (0..2).map(|_| go_from([127, 0, 4, 1], port)).collect();
    std::thread::sleep(Duration::from_millis(1500));
    let mut third = go_from([127, 0, 4, 1], port);
    served(&mut third, "a third connection of the address", 61);
    let (gone, log) = evicted(
        &srv,
        "2 connections from 127.0.4.1 already (--max-connections-per-address)",
    );
    assert_eq!(gone.len(), 1, "{log}");
    let i = mine
        .iter()
        .position(|c| c.local() == gone[0])
        .unwrap_or_else(|| panic!("{} closed, not one of the address's: {log}", gone[0]));
    assert_closed(&mut mine[i], "the address's longest idle connection");
    served(&mut mine[1 - i], "the address's other connection", 63);
    served(&mut other, "another address's connection", 65);
}

#[test]
fn max_connections_is_lowered_to_what_descriptors_allow() {
    let dir = tmpdir();
    let none = dir.path().join("no.sock");
    let srv = Server::spawn_limited(
        dir,
        none,
        &["--listen", "tcp:127.0.0.1:0"],
        &["--device", "mem:16M"],
        Some((160, 160)),
    );
    let port: u16 = srv.addrs[0]
        .strip_prefix("tcp:127.0.0.1:")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("ready line address {:?}", srv.addrs));
    let log = srv.stderr();
    let lowered: usize = log
        .split("--max-connections lowered from 4096 to ")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no lowered limit in the log:\n{log}"));
    assert!(
        (1..160).contains(&lowered),
        "lowered to {lowered} of 160 descriptors"
    );
    // That many are served (from several addresses), and the next is refused at
    // once rather than failing in accept for want of a descriptor.
    let mut conns: Vec<Raw> = (0..lowered)
        .map(|i| go_from([127, 0, 5, 1 + (i / 30) as u8], port))
        .collect();
    let refused = Raw::connect_tcp_from([127, 0, 5, 99], port).admitted_now();
    assert!(refused.is_none(), "one more than the lowered limit");
    served(&mut conns[lowered - 1], "the last connection let in", 71);
    let refusal = format!("refused, {lowered} connections already (--max-connections)");
    srv.wait_for_stderr(&refusal, IO_TIMEOUT);
    let log = srv.stderr();
    assert!(log.contains(&refusal), "{}", tail(&log));
    assert!(!log.contains("accept:"), "{}", tail(&log));

    // A soft limit below the hard one is raised to it.
    let mut hard = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit into a local rlimit.
    assert_eq!(
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut hard) },
        0
    );
    let hard = hard.rlim_max.min(1 << 20);
    if hard <= 256 {
        return skip(
            "max_connections_is_lowered_to_what_descriptors_allow",
            "the hard descriptor limit is 256 or less: nothing to raise",
        );
    }
    let dir = tmpdir();
    let none = dir.path().join("no.sock");
    let srv = Server::spawn_limited(
        dir,
        none,
        &["--listen", "tcp:127.0.0.1:0"],
        &["--device", "mem:16M"],
        Some((256, hard)),
    );
    let log = srv.stderr();
    assert!(
        log.contains(&format!(
            "descriptor limit (RLIMIT_NOFILE) raised from 256 to {hard}"
        )),
        "{log}"
    );
    if hard >= 4096 + 512 {
        assert!(!log.contains("lowered"), "{log}");
    }
}

#[test]
fn idle_connections_stay_small_after_others_came_and_went() {
    descriptors_for(300 + 500);
    let srv = Server::start(&[
        "--device",
        "null:1G",
        "--max-connections",
        "1000",
        "--max-connections-per-address",
        "1000",
    ]);
    let closed = |srv: &Server| srv.stderr().matches("disconnected from export").count();
    // Connections that come and go: their input buffers go back to the allocator.
    for round in 1..=2 {
        let conns: Vec<Raw> = (0..300).map(|_| Raw::go(&srv.sock, "").0).collect();
        drop(conns);
        let deadline = Instant::now() + IO_TIMEOUT;
        while closed(&srv) < 300 * round && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(closed(&srv), 300 * round, "connections closed");
    }
    // New idle connections must not each hold a 256 KiB input buffer that the
    // allocator zeroed by writing it.
    let before = rss(&srv);
    let idle: Vec<Raw> = (0..300).map(|_| Raw::go(&srv.sock, "").0).collect();
    std::thread::sleep(Duration::from_millis(200));
    let per = rss(&srv).saturating_sub(before) / idle.len() as u64;
    assert!(
        per < 64 << 10,
        "{} KiB per idle connection after others came and went",
        per >> 10
    );
}

#[test]
fn connections_give_their_input_buffers_back_once_idle() {
    let srv = Server::start(&[
        "--device",
        "mem:16M",
        "--max-connections-per-address",
        "200",
        "--log-level",
        "debug",
    ]);
    let before = rss(&srv);
    // 100 clients each send 9,000 flushes at once (246 KiB of headers: a full input
    // buffer), read every reply, then go quiet.
    let burst: Vec<u8> = (0..9000u64)
        .flat_map(|j| header(0, CMD_FLUSH, j, 0, 0))
        .collect();
    let mut conns = Vec::new();
    for _ in 0..100 {
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        c.send(&burst).unwrap();
        for j in 0..9000u64 {
            c.expect(j, 0);
        }
        conns.push(c);
    }
    let busy = rss(&srv).saturating_sub(before) / 100;
    // Idle for a second, they give back what their input buffers held (256 KiB
    // each); what stays is their request and reply tables (about 90 KiB each).
    let deadline = Instant::now() + IO_TIMEOUT;
    let mut idle = busy;
    while idle >= 192 << 10 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        idle = rss(&srv).saturating_sub(before) / 100;
    }
    assert!(
        idle < 192 << 10,
        "{} KiB per idle connection after a burst ({} KiB just after it)",
        idle >> 10,
        busy >> 10
    );
    // And they serve as before: a burst, one request, then a write and a read.
    for (i, c) in conns.iter_mut().enumerate() {
        let i = i as u64;
        c.send(&burst).unwrap();
        for j in 0..9000u64 {
            c.expect(j, 0);
        }
        c.write_ok(100_000 + i, 0, i << 16, &random_bytes(4096, i));
        assert_same(
            "a write read back after the input buffer went back",
            &c.read_ok(200_000 + i, i << 16, 4096),
            &random_bytes(4096, i),
        );
    }
    let given = srv
        .stderr()
        .matches("KiB of input buffer given back")
        .count();
    // (Those whose bursts arrived in pieces never filled their buffers past 64 KiB.)
    assert!(given > 0, "no input buffer given back");
}

#[test]
fn idle_close_closes_idle_connections_and_spares_busy_ones() {
    // Writes to the slow device take 2.5 s: longer than the idle timeout.
    let dir = tmpdir();
    let stack = write_stack(
        &dir,
        "[device.m]\ntype = \"mem\"\nsize = \"16M\"\n\n\
             [device.slow]\ntype = \"delay\"\nbase = \"m\"\nwrite = \"2500ms\"\n\n\
             [export.\"\"]\ndevice = \"slow\"\n",
    );
    let srv = Server::start(&[path_str(&stack), "--idle-timeout", "1s", "--idle-close"]);
    let (mut idle, _, _) = Raw::go(&srv.sock, "");
    let (mut busy, _, _) = Raw::go(&srv.sock, "");
    let (mut chatty, _, _) = Raw::go(&srv.sock, "");
    // Sends a write's header, then its payload a byte every 100 ms: never idle by
    // bytes moved, but no request arrives or ends.
    let (mut trickle, _, _) = Raw::go(&srv.sock, "");
    trickle.send(&header(0, CMD_WRITE, 7, 8192, 4096)).unwrap();
    let data = random_bytes(4096, 13);
    busy.request(0, CMD_WRITE, 1, 0, 4096, &data).unwrap();
    let mut trickled = 0;
    for i in 0..20 {
        chatty.read_ok(100 + i, 0, 4096);
        // Fails once the server closed it; the check is below.
        if trickle.send(&[0x5a]).is_ok() {
            trickled += 1;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Closed about 1 s in, while it still trickled (at 2 s the loop ends).
    assert!(
        (5..20).contains(&trickled),
        "the trickling client sent {trickled} of 20 bytes before it was closed"
    );
    assert_closed(
        &mut idle,
        "a connection idle past --idle-timeout with --idle-close",
    );
    assert_closed(
        &mut trickle,
        "a connection trickling one request's payload past --idle-timeout",
    );
    // The write at the device for 2.5 s kept its connection.
    busy.expect(1, 0);
    assert_same("the slow write", &busy.read_ok(2, 0, 4096), &data);
    chatty.read_ok(200, 0, 4096);
    let log = srv.stderr();
    assert!(
        log.contains("closed: idle for --idle-timeout (--idle-close)"),
        "{log}"
    );
}

/// The server's resident memory, from /proc.
fn rss(srv: &Server) -> u64 {
    let pid = srv.child.as_ref().expect("server running").id();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("VmRSS in {status}"));
    kb << 10
}

#[test]
fn rss_stays_under_the_memory_budget_with_half_payloads_and_clients_that_never_read() {
    const BUDGET: u64 = 256 << 20;
    let srv = Server::start(&[
        "--device",
        "null:1G",
        "--memory-budget",
        "256M",
        "--max-connections",
        "200",
        "--max-connections-per-address",
        "200",
        "--idle-timeout",
        "4s",
    ]);
    // The bound README.md documents: the budget, 1 MiB per connection, 64 MiB.
    let bound = BUDGET + 140 * (1 << 20) + (64 << 20);
    let mut peak = rss(&srv);
    let mut hostile = Vec::new();
    // 100 clients send a 32 MiB write's header and half its payload, as fast as the
    // server takes it.
    let half = vec![0xabu8; 16 << 20];
    for i in 0..100u64 {
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        c.send(&header(0, CMD_WRITE, i, 0, 32 << 20)).unwrap();
        c.s.set_nonblocking(true).unwrap();
        let mut sent = 0;
        while sent < half.len() {
            match c.s.write(&half[sent..]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => panic!("half payload: {e}"),
            }
        }
        hostile.push(c);
        peak = peak.max(rss(&srv));
    }
    // 40 clients ask for 64 MiB of reads each and never read a reply.
    for _ in 0..40 {
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        let mut reads = Vec::new();
        for j in 0..64u64 {
            reads.extend_from_slice(&header(0, CMD_READ, j, j << 20, 1 << 20));
        }
        c.send(&reads).unwrap();
        hostile.push(c);
        peak = peak.max(rss(&srv));
    }
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(100));
        peak = peak.max(rss(&srv));
    }
    assert!(
        peak < bound,
        "peak RSS {} MiB over the bound of {} MiB",
        peak >> 20,
        bound >> 20
    );
    // The budget was reached: connections waited for memory.
    srv.signal(libc::SIGUSR1);
    assert!(
        srv.wait_for_stderr("waits for memory", IO_TIMEOUT),
        "{}",
        srv.stderr()
    );
    let log = srv.stderr();
    let waits: u64 = log
        .lines()
        .find_map(|l| l.split(" (--memory-budget), ").nth(1))
        .and_then(|w| w.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no wait count in {log}"));
    assert!(
        waits > 0,
        "the hostile clients never filled the budget: {log}"
    );
    // A good client is served: the idle hostile connections that hold memory are
    // closed once they have been idle for --idle-timeout.
    let (mut good, _, _) = Raw::go(&srv.sock, "");
    good.s
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let data = random_bytes(1 << 20, 17);
    good.write_ok(1, 0, 0, &data);
    good.request(0, CMD_READ, 2, 0, 1 << 20, &[]).unwrap();
    if let Err(e) = good.reply() {
        let log = srv.stderr();
        let tail: Vec<&str> = log.lines().rev().take(15).collect();
        panic!(
            "the good client's read: {e}; log ends:\n{}",
            tail.join("\n")
        );
    }
    assert_eq!(good.read_exact(1 << 20).unwrap().len(), 1 << 20);
    assert!(rss(&srv) < bound);
    let log = srv.stderr();
    assert!(
        log.contains("closed: idle past --idle-timeout, holding memory others waited for"),
        "{log}"
    );
}
