use super::*;

/// A device that does not complete a request within the shutdown timeout: SIGTERM
/// still ends the server, with status 1, a line saying what it abandons, and its
/// socket files removed.
#[test]
fn a_stuck_device_ends_with_status_1_after_the_shutdown_timeout() {
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let stack = write_stack(
        &dir,
        "[device.a]\ntype = \"mem\"\nsize = \"8M\"\n\
             [device.d]\ntype = \"delay\"\nbase = \"a\"\nwrite = \"10s\"\n\
             [export.d]\ndevice = \"d\"\n",
    );
    let mut srv = Server::start_in(
        dir,
        &[
            path_str(&stack),
            "--shutdown-timeout",
            "1s",
            "--admin",
            path_str(&ctl),
        ],
    );
    let (mut c, _, _) = Raw::go(&srv.sock, "d");
    // In flight for 10 s: never answered before the deadline.
    c.request(0, CMD_WRITE, 1, 0, 4096, &[5u8; 4096]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    srv.signal(libc::SIGTERM);
    let (status, log) = srv.wait_exit();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("shutdown did not end within 1s"), "{log}");
    assert!(
        log.contains("requests in flight on d are abandoned"),
        "{log}"
    );
    assert!(!srv.sock.exists(), "the NBD socket file is left behind");
    assert!(!ctl.exists(), "the admin socket file is left behind");
}

/// Every event is one line with an RFC 3339 time and a level; each client's connect
/// and disconnect are logged with its export, duration, requests, bytes and why it
/// ended.
#[test]
fn logs_have_times_levels_and_a_line_per_connect_and_disconnect() {
    let mut srv = Server::start(&["--device", "mem:8M"]);
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    c.write_ok(1, 0, 0, &[3u8; 4096]);
    c.write_ok(2, 0, 4096, &[4u8; 4096]);
    c.request(0, CMD_FLUSH, 3, 0, 0, &[]).unwrap();
    c.expect(3, 0);
    c.disconnect();
    let deadline = Instant::now() + IO_TIMEOUT;
    while !srv.stderr().contains("disconnected from export") {
        assert!(Instant::now() < deadline, "{}", srv.stderr());
        std::thread::sleep(Duration::from_millis(10));
    }
    let (status, log) = srv.stop();
    assert!(status.success(), "{log}");
    for line in log.lines() {
        let (time, rest) = line.split_once(' ').unwrap_or(("", ""));
        let b = time.as_bytes();
        let rfc3339 = b.len() == 24
            && b[4] == b'-'
            && b[7] == b'-'
            && b[10] == b'T'
            && b[13] == b':'
            && b[16] == b':'
            && b[19] == b'.'
            && b[23] == b'Z'
            && time
                .chars()
                .enumerate()
                .all(|(i, ch)| [4, 7, 10, 13, 16, 19, 23].contains(&i) || ch.is_ascii_digit());
        assert!(rfc3339, "no RFC 3339 time: {line}");
        let level = rest.split_whitespace().next().unwrap_or("");
        assert!(
            ["ERROR", "WARN", "INFO", "DEBUG"].contains(&level),
            "no level: {line}"
        );
    }
    let connect = log.lines().find(|l| l.contains("connected to export ''"));
    assert!(connect.is_some_and(|l| l.contains(" INFO ")), "{log}");
    let gone = log
        .lines()
        .find(|l| l.contains("disconnected from export ''"))
        .unwrap_or_else(|| panic!("{log}"));
    // Counts of one are singular.
    assert!(
        gone.contains(" 4 requests (0 reads, 2 writes, 1 flush, 0 trims"),
        "{gone}"
    );
    // The signal by name, and a last line once everything is closed.
    assert!(log.contains(" SIGTERM received: "), "{log}");
    let last = log.lines().last().unwrap_or("");
    assert!(
        last.contains(" INFO ") && last.ends_with("cairn: serve: stopped"),
        "{log}"
    );
    assert!(gone.contains("(the client disconnected)"), "{gone}");
    assert!(gone.contains(" after "), "{gone}");
}

/// A client that leaves during the handshake is logged at info: it is no fault of the
/// server's (it was a warning).
#[test]
fn a_client_leaving_during_the_handshake_is_info() {
    let srv = Server::start(&["--device", "mem:8M"]);
    let s = UnixStream::connect(&srv.sock).expect("connect");
    let mut greeting = [0u8; 18];
    (&s).read_exact(&mut greeting)
        .expect("the server's greeting");
    // Half a client flags word, then gone.
    (&s).write_all(&[0, 0]).expect("write");
    drop(s);
    assert!(
        srv.wait_for_stderr("closed during the handshake", IO_TIMEOUT),
        "{}",
        srv.stderr()
    );
    let log = srv.stderr();
    let line = log
        .lines()
        .find(|l| l.contains("closed during the handshake"))
        .unwrap_or("");
    assert!(line.contains(" INFO "), "{log}");
    assert!(!log.contains(" WARN "), "{log}");
}

/// SIGUSR1 and SIGUSR2 log a status and never stop the server; SIGHUP stops it as
/// SIGTERM does, with the socket file removed.
#[test]
fn sigusr1_and_sigusr2_log_a_status_and_serving_goes_on() {
    let mut srv = Server::start(&["--device", "mem:8M"]);
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    for (sig, n) in [(libc::SIGUSR1, 1), (libc::SIGUSR2, 2)] {
        srv.signal(sig);
        let deadline = Instant::now() + IO_TIMEOUT;
        while srv.stderr().matches("serve: status: ").count() < n {
            assert!(
                Instant::now() < deadline,
                "no status after signal {sig}:\n{}",
                srv.stderr()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let log = srv.stderr();
    assert!(log.contains("status: 1 connection;"), "{log}");
    // A healthy export is logged at info, not as a warning.
    let export = log
        .lines()
        .find(|l| l.contains("export '': mem"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(export.contains(" INFO "), "{export}");
    // Still serving, the connected client and a new one.
    c.write_ok(1, 0, 0, &[7u8; 4096]);
    let (mut d, _, _) = Raw::go(&srv.sock, "");
    d.write_ok(2, 0, 4096, &[8u8; 4096]);
    srv.signal(libc::SIGHUP);
    let (status, log) = srv.wait_exit();
    assert!(status.success(), "exit status {status}; stderr:\n{log}");
    assert!(!srv.sock.exists(), "the socket file is removed at exit");
}

#[test]
fn sigterm_flushes_acknowledged_writes_and_exits_0() {
    let dir = tmpdir();
    let disk = dir.path().join("disk.img");
    let device = format!("file:{},size=64M", disk.display());
    let mut srv = Server::start_in(dir, &["--device", &device]);
    let (mut c, size, _) = Raw::go(&srv.sock, "");
    assert_eq!(size, 64 << 20);
    let a = random_bytes(1 << 20, 12);
    let b = random_bytes(256 << 10, 13);
    c.write_ok(1, 0, 0, &a);
    c.write_ok(2, FLAG_FUA, 32 << 20, &b);
    // The client stays connected, idle.
    let (status, log) = srv.stop();
    assert!(status.success(), "exit status {status}; stderr:\n{log}");
    assert!(log.contains("SIGTERM received"), "{log}");
    assert_closed(&mut c, "a connected client at SIGTERM");
    assert!(!srv.sock.exists(), "the socket file is removed at exit");
    let file = std::fs::read(&disk).unwrap();
    assert_eq!(file.len(), 64 << 20);
    assert_same("first write", &file[..1 << 20], &a);
    assert_same("FUA write", &file[32 << 20..(32 << 20) + (256 << 10)], &b);
}

/// Through a write-back cache that would keep the data for 30 s: the client has gone
/// without a flush, and SIGTERM still leaves every acknowledged write in the file
/// (the cache is written back before the process exits).
#[test]
fn sigterm_writes_a_cache_back_before_exit() {
    let dir = tmpdir();
    let disk = dir.path().join("disk.img");
    let stack = write_stack(
        &dir,
        &format!(
            "[writeback]\nexpire = \"30s\"\ninterval = \"30s\"\n\
                 [device.f]\ntype = \"file\"\npath = \"{}\"\nsize = \"16M\"\n\
                 [device.c]\ntype = \"cache\"\nbase = \"f\"\nmemory = \"8M\"\n",
            disk.display()
        ),
    );
    let mut srv = Server::start_in(dir, &[path_str(&stack)]);
    let a = random_bytes(4 << 20, 21);
    {
        let (mut c, size, _) = Raw::go(&srv.sock, "");
        assert_eq!(size, 16 << 20);
        c.write_ok(1, 0, 4096, &a);
        c.disconnect();
    }
    let (status, log) = srv.stop();
    assert!(status.success(), "exit status {status}; stderr:\n{log}");
    let file = std::fs::read(&disk).unwrap();
    assert_same("cached write after exit", &file[4096..4096 + a.len()], &a);
}

#[test]
fn sigterm_finishes_requests_in_flight_and_refuses_later_ones_with_eshutdown() {
    let dir = tmpdir();
    let disk = dir.path().join("disk.img");
    // Writes take 3 s: one stays in flight while the server shuts down.
    let stack = write_stack(
        &dir,
        &format!(
            "[device.f]\ntype = \"file\"\npath = \"{}\"\nsize = \"16M\"\n\n\
                 [device.slow]\ntype = \"delay\"\nbase = \"f\"\nwrite = \"3s\"\n",
            disk.display()
        ),
    );
    let mut srv = Server::start_in(dir, &[path_str(&stack)]);
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    let data = random_bytes(64 << 10, 14);
    c.request(0, CMD_WRITE, 1, 0, data.len() as u32, &data)
        .unwrap();
    // Requests are parsed in order: once a read sent after the write is answered (reads
    // are not delayed), the write's whole payload is in and the write is in flight.
    assert_same(
        "a read beside the write",
        &c.read_ok(50, 1 << 20, 4096),
        &[0u8; 4096],
    );
    srv.signal(libc::SIGTERM);
    assert!(
        srv.wait_for_stderr("SIGTERM received", IO_TIMEOUT),
        "{}",
        srv.stderr()
    );
    // The reactor learns of the shutdown a moment after that line: probe with reads
    // until one is refused. The write in flight must not be answered before that.
    let mut write_error = None;
    let mut cookie = 100;
    let mut refused = false;
    while !refused {
        cookie += 1;
        c.request(0, CMD_READ, cookie, 1 << 20, 4096, &[])
            .expect("send a read after SIGTERM");
        loop {
            let (error, got) = c.reply().expect("a reply after SIGTERM");
            if got == 1 {
                write_error = Some(error);
                assert!(
                    refused,
                    "the write in flight finished before any later request was refused"
                );
                continue;
            }
            assert_eq!(got, cookie);
            match error {
                0 => {
                    c.read_exact(4096).unwrap();
                    std::thread::sleep(Duration::from_millis(20));
                }
                ESHUTDOWN => refused = true,
                e => panic!("read after SIGTERM: error {e}"),
            }
            break;
        }
    }
    // Later writes are refused too (their payload skipped), and flushes.
    c.request(0, CMD_WRITE, 2, 1 << 20, 8192, &smuggled(8192))
        .unwrap();
    c.request(0, CMD_FLUSH, 3, 0, 0, &[]).unwrap();
    let mut replies = HashMap::new();
    while !(replies.contains_key(&2)
        && replies.contains_key(&3)
        && (write_error.is_some() || replies.contains_key(&1)))
    {
        let (error, got) = c.reply().expect("replies during shutdown");
        assert!(
            got & SMUGGLED != SMUGGLED,
            "answered hidden request {got:#x}"
        );
        replies.insert(got, error);
    }
    assert_eq!(replies.get(&2), Some(&ESHUTDOWN), "{replies:?}");
    assert_eq!(replies.get(&3), Some(&ESHUTDOWN), "{replies:?}");
    let write_error = write_error.or(replies.get(&1).copied());
    assert_eq!(write_error, Some(0), "the write in flight completes");
    assert_closed(&mut c, "after shutdown");
    let (status, log) = srv.wait_exit();
    assert!(status.success(), "exit status {status}; stderr:\n{log}");
    let file = std::fs::read(&disk).unwrap();
    assert_same("the write in flight", &file[..64 << 10], &data);
    assert!(
        file[1 << 20..(1 << 20) + 8192].iter().all(|&x| x == 0),
        "a write refused with ESHUTDOWN reached the disk"
    );
}
#[test]
fn sigterm_answers_a_write_whose_payload_is_still_arriving() {
    let dir = tmpdir();
    let disk = dir.path().join("disk.img");
    let device = format!("file:{},size=16M", disk.display());
    let mut srv = Server::start_in(dir, &["--device", &device]);
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    let data = random_bytes(64 << 10, 15);
    c.send(&header(0, CMD_WRITE, 1, 0, data.len() as u32))
        .unwrap();
    c.send(&data[..1000]).unwrap();
    // Let the server read the header (it is idle: this only sets the scene).
    std::thread::sleep(Duration::from_millis(300));
    srv.signal(libc::SIGTERM);
    assert!(
        srv.wait_for_stderr("SIGTERM received", IO_TIMEOUT),
        "{}",
        srv.stderr()
    );
    std::thread::sleep(Duration::from_millis(300));
    // The rest of the payload: the request was in flight before the signal, so it
    // gets a reply (done, or refused with ESHUTDOWN) before the server hangs up.
    let sent = c.send(&data[1000..]);
    let reply = c.reply();
    let (status, log) = srv.wait_exit();
    assert!(status.success(), "exit status {status}; stderr:\n{log}");
    let (error, cookie) = reply.unwrap_or_else(|e| {
        panic!(
            "no reply to a write in flight at SIGTERM ({e}; sending the rest of its \
                 payload: {sent:?})"
        )
    });
    assert_eq!(cookie, 1);
    assert!(error == 0 || error == ESHUTDOWN, "error {error}");
    assert_closed(&mut c, "after the reply");
    if error == 0 {
        let file = std::fs::read(&disk).unwrap();
        assert_same("the write", &file[..64 << 10], &data);
    }
}
