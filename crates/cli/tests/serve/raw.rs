use super::*;

#[test]
fn bad_request_magic_closes_the_connection() {
    let srv = Server::start(&["--device", "mem:16M"]);
    let (mut c, size, _) = Raw::go(&srv.sock, "");
    assert_eq!(size, 16 << 20);
    let mut h = header(0, CMD_READ, 1, 0, 4096);
    h[..4].copy_from_slice(&0xdead_beefu32.to_be_bytes());
    c.send(&h).unwrap();
    assert_closed(&mut c, "a request with a bad magic");
    // The server itself is fine.
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    c.read_ok(2, 0, 4096);
    c.disconnect();
}

#[test]
fn oversized_write_payload_is_skipped_never_parsed_as_requests() {
    let srv = Server::start(&["--device", "mem:16M", "--max-payload", "64K"]);
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    let data = random_bytes(4096, 3);
    c.write_ok(1, 0, 0, &data);
    // 128 KiB over a 64 KiB limit; the payload is nothing but valid READ headers, sent
    // in pieces so the server sees it across many receives.
    let payload = smuggled(128 << 10);
    c.send(&header(0, CMD_WRITE, 2, 0, 128 << 10)).unwrap();
    for piece in payload.chunks(9_999) {
        if c.send(piece).is_err() {
            break; // hung up: allowed
        }
    }
    match c.reply() {
        Ok((error, cookie)) => {
            assert!(
                cookie & SMUGGLED != SMUGGLED,
                "the server answered request {cookie:#x}, hidden in the payload"
            );
            assert_eq!((cookie, error), (2, EINVAL));
            // The connection still works, and nothing was written.
            assert_same("offset 0", &c.read_ok(3, 0, 4096), &data);
            c.disconnect();
            assert_closed(&mut c, "after DISC (no replies to the payload)");
        }
        Err(_) => assert_closed(&mut c, "an oversized write"),
    }

    // Far over any limit (over 256 MiB): the server hangs up rather than skip it.
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    c.send(&header(0, CMD_WRITE, 4, 0, (256 << 20) + 4096))
        .unwrap();
    let _ = c.send(&smuggled(64 << 10));
    assert_closed(&mut c, "a write of 256 MiB + 4 KiB");
}

/// At the defaults, writes and reads of more than 32 MiB (up to 48 MiB, as the NBD
/// reference project's integrityhuge test sends them, ignoring the advertised
/// maximum) are served, from a client that did not ask for block sizes.
#[test]
fn payloads_over_32_mib_are_served_at_the_defaults() {
    let srv = Server::start(&["--device", "mem:64M"]);
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    let data = random_bytes(48 << 20, 9);
    let mut w = c.s.try_clone().unwrap();
    let all = [
        header(0, CMD_WRITE, 1, 4096, data.len() as u32),
        data.clone(),
    ]
    .concat();
    let sender = std::thread::spawn(move || w.write_all(&all));
    c.expect(1, 0);
    sender.join().unwrap().unwrap();
    assert_same("48 MiB read back", &c.read_ok(2, 4096, 48 << 20), &data);
    // Over the maximum (64 MiB): refused, the payload skipped, the connection fine.
    let big = 64 << 20 | 4096;
    let mut w = c.s.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        w.write_all(&header(0, CMD_WRITE, 3, 0, big))?;
        w.write_all(&vec![0x5a; big as usize])
    });
    c.expect(3, EINVAL);
    sender.join().unwrap().unwrap();
    assert_same(
        "after the refusal",
        &c.read_ok(4, 4096, 4096),
        &data[..4096],
    );
    c.disconnect();
    assert!(
        srv.wait_for_stderr("is over --max-payload (67108864 bytes)", IO_TIMEOUT),
        "no log line for the refused write:\n{}",
        srv.stderr()
    );
}

#[test]
fn read_longer_than_max_payload_is_refused_with_einval() {
    let srv = Server::start(&["--device", "mem:16M", "--max-payload", "64K"]);
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    c.request(0, CMD_READ, 1, 0, 128 << 10, &[]).unwrap();
    let (error, cookie) = c.reply().unwrap();
    assert_eq!(cookie, 1);
    assert_eq!(
        error, EINVAL,
        "a 128 KiB read with --max-payload 64K (the NBD spec: the server SHOULD \
             report EINVAL for a request larger than the advertised maximum block size)"
    );
    c.read_ok(2, 0, 4096);
    c.disconnect();
}

/// A client that did not ask for block sizes: an unaligned write whose payload
/// arrives in small pieces (received into the middle of its blocks), pipelined with
/// unaligned reads, over simple replies.
#[test]
fn unaligned_write_payload_arrives_in_pieces() {
    let srv = Server::start(&["--device", "mem:16M,block=4096"]);
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    let old = random_bytes(3 * 4096, 6);
    c.write_ok(1, 0, 0, &old);
    let data = random_bytes(10_000, 7);
    c.send(&header(0, CMD_WRITE, 2, 3, data.len() as u32))
        .unwrap();
    for piece in data.chunks(999) {
        c.send(piece).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    c.expect(2, 0);
    let mut want = old.clone();
    want[3..3 + data.len()].copy_from_slice(&data);
    // Three reads in flight at once, each at an odd offset.
    for (cookie, offset, len) in [(3u64, 1u64, 5000u32), (4, 5001, 4000), (5, 9001, 3287)] {
        c.request(0, CMD_READ, cookie, offset, len, &[]).unwrap();
    }
    let mut got = vec![0u8; 12_288];
    got[0] = want[0];
    for _ in 0..3 {
        let (error, cookie) = c.reply().unwrap();
        assert_eq!(error, 0, "read {cookie}");
        let (offset, len) = match cookie {
            3 => (1, 5000),
            4 => (5001, 4000),
            _ => (9001, 3287),
        };
        let b = c.read_exact(len).unwrap();
        got[offset..offset + len].copy_from_slice(&b);
    }
    assert_same("after the unaligned write", &got, &want);
    c.disconnect();
}

/// Writes that wait for buffer memory (the connection holds its limit) are counted
/// once each in the connection's figures, however often their header is looked at.
#[test]
fn writes_waiting_for_buffer_memory_are_counted_once() {
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    // Slow writes: the next header arrives while the connection holds its limit.
    let stack = write_stack(
        &dir,
        "[device.m]\ntype = \"mem\"\nsize = \"16M\"\n\n\
             [device.slow]\ntype = \"delay\"\nbase = \"m\"\nwrite = \"20ms\"\n",
    );
    let srv = Server::start_in(
        dir,
        &[
            path_str(&stack),
            "--max-payload",
            "1M",
            "--buffer-memory",
            "1M",
            "--admin",
            path_str(&ctl),
        ],
    );
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    let mut all = Vec::new();
    let data = random_bytes(1 << 20, 8);
    for i in 0..8u64 {
        all.extend_from_slice(&header(0, CMD_WRITE, i, i << 20, 1 << 20));
        all.extend_from_slice(&data);
    }
    let mut w = c.s.try_clone().unwrap();
    let sender = std::thread::spawn(move || w.write_all(&all));
    for _ in 0..8 {
        let (error, cookie) = c.reply().unwrap();
        assert_eq!(error, 0, "write {cookie}");
    }
    sender.join().unwrap().unwrap();
    let out = admin::admin(&ctl, &["status", "--json"]);
    let status: Value = serde_json::from_str(&text(&out.stdout))
        .unwrap_or_else(|e| panic!("status --json: {e}: {}", text(&out.stdout)));
    let conn = &status["exports"][0]["connections"][0];
    assert_eq!(conn["requests"], 8, "{status:#}");
    assert_eq!(conn["writes"], 8, "{status:#}");
    assert_eq!(conn["written_bytes"], 8u64 << 20, "{status:#}");
    assert_same(
        "the last write",
        &c.read_ok(9, 7 << 20, 4096),
        &data[..4096],
    );
    c.disconnect();
}

#[test]
fn refused_writes_skip_their_payload() {
    let dir = tmpdir();
    let stack = write_stack(
        &dir,
        "[device.a]\ntype = \"mem\"\nsize = \"16M\"\n\n\
             [export.rw]\ndevice = \"a\"\ndefault = true\nstrict_alignment = true\n\n\
             [export.ro]\ndevice = \"a\"\nread_only = true\n",
    );
    let srv = Server::start_in(dir, &[path_str(&stack)]);
    // A strict export, so misaligned writes are refused too.
    let (mut c, size, flags) = Raw::go_strict(&srv.sock, "rw");
    assert_eq!(flags & TFLAG_READ_ONLY, 0);
    let head = random_bytes(4096, 4);
    let tail = random_bytes(4096, 5);
    c.write_ok(1, 0, 0, &head);
    c.write_ok(2, 0, size - 4096, &tail);
    let check = |c: &mut Raw, what: &str| {
        assert_same(
            &format!("after {what}: head"),
            &c.read_ok(90, 0, 4096),
            &head,
        );
        assert_same(
            &format!("after {what}: tail"),
            &c.read_ok(91, size - 4096, 4096),
            &tail,
        );
    };
    // (what, flags, offset, length, errno): each carries a payload of fake requests.
    let cases: [(&str, u16, u64, u32, u32); 6] = [
        ("a write past the end", 0, size, 4096, ENOSPC),
        ("a write across the end", 0, size - 4096, 8192, ENOSPC),
        ("a write at offset 1", 0, 1, 4096, EINVAL),
        ("a write of 100 bytes", 0, 0, 100, EINVAL),
        ("a write with unknown flag 1<<9", 1 << 9, 0, 4096, EINVAL),
        ("a write with DF", FLAG_DF, 0, 4096, EINVAL),
    ];
    for (i, (what, f, offset, len, errno)) in cases.into_iter().enumerate() {
        let cookie = 10 + i as u64;
        c.request(f, CMD_WRITE, cookie, offset, len, &smuggled(len as usize))
            .unwrap();
        c.expect(cookie, errno);
        check(&mut c, what);
    }
    // The read-only export of the same device.
    let (mut ro, _, flags) = Raw::go(&srv.sock, "ro");
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    ro.request(0, CMD_WRITE, 20, 0, 8192, &smuggled(8192))
        .unwrap();
    ro.expect(20, EPERM);
    ro.request(0, CMD_TRIM, 21, 0, 8192, &[]).unwrap();
    ro.expect(21, EPERM);
    assert_same("read-only head", &ro.read_ok(22, 0, 4096), &head);
    check(&mut c, "the read-only export's refusals");
    for (mut x, what) in [(c, "rw"), (ro, "ro")] {
        x.disconnect();
        assert_closed(
            &mut x,
            &format!("{what}: after DISC (no replies to payloads)"),
        );
    }
}

#[test]
fn unknown_commands_get_einval_and_the_connection_survives() {
    let srv = Server::start(&["--device", "mem:16M"]);
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    let data = random_bytes(4096, 6);
    c.write_ok(1, 0, 0, &data);
    c.request(0, 99, 2, 0, 0, &[]).unwrap();
    c.expect(2, EINVAL);
    c.request(0, 99, 3, 4096, 4096, &[]).unwrap();
    c.expect(3, EINVAL);
    c.request(0, u16::MAX, 4, 0, 512, &[]).unwrap();
    c.expect(4, EINVAL);
    // Block status needs structured replies and a metadata context: neither here.
    c.request(0, CMD_BLOCK_STATUS, 5, 0, 4096, &[]).unwrap();
    c.expect(5, EINVAL);
    assert_same("after unknown commands", &c.read_ok(6, 0, 4096), &data);
    c.request(FLAG_FUA, CMD_FLUSH, 7, 0, 0, &[]).unwrap();
    c.expect(7, 0);
    // A flush's offset and length are reserved (must be 0).
    c.request(0, CMD_FLUSH, 8, 4096, 0, &[]).unwrap();
    c.expect(8, EINVAL);
    c.request(0, CMD_FLUSH, 9, 0, 4096, &[]).unwrap();
    c.expect(9, EINVAL);
    // Requests of length 0 are refused, a write's included (no payload follows).
    for (cookie, command) in [(10, CMD_READ), (11, CMD_WRITE), (12, CMD_TRIM)] {
        c.request(0, command, cookie, 4096, 0, &[]).unwrap();
        c.expect(cookie, EINVAL);
    }
    assert_same("after refused requests", &c.read_ok(13, 0, 4096), &data);
    c.disconnect();
    assert_closed(&mut c, "after DISC");
}

#[test]
fn disc_after_pipelined_requests_answers_them_all_then_closes() {
    let srv = Server::start(&["--device", "mem:16M"]);
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    let mut batch = Vec::new();
    let blocks: Vec<Vec<u8>> = (0..32).map(|i| random_bytes(4096, 100 + i)).collect();
    for (i, b) in blocks.iter().enumerate() {
        batch.extend_from_slice(&header(0, CMD_WRITE, i as u64, i as u64 * 4096, 4096));
        batch.extend_from_slice(b);
    }
    batch.extend_from_slice(&header(0, CMD_FLUSH, 1000, 0, 0));
    batch.extend_from_slice(&header(0, CMD_DISC, 1001, 0, 0));
    c.send(&batch).unwrap();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..33 {
        let (error, cookie) = c.reply().expect("every request before DISC is answered");
        assert_eq!(error, 0, "request {cookie}");
        assert!(seen.insert(cookie), "two replies for {cookie}");
    }
    assert!(seen.contains(&1000));
    assert_closed(&mut c, "after DISC");
    // The writes landed.
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    for (i, b) in blocks.iter().enumerate() {
        assert_same(
            &format!("block {i}"),
            &c.read_ok(i as u64, i as u64 * 4096, 4096),
            b,
        );
    }
    c.disconnect();
}

#[test]
fn structured_replies_by_hand() {
    let srv = Server::start(&["--device", "mem:16M"]);
    let (mut c, size, _) = Raw::handshake(&srv.sock, &[OPT_STRUCTURED_REPLY], "");
    let data = random_bytes(8192, 8);
    c.write_ok(1, FLAG_FUA, 4096, &data); // writes still get simple replies
    c.request(FLAG_DF, CMD_READ, 2, 4096, 8192, &[]).unwrap();
    let h = c.read_exact(20).unwrap();
    assert_eq!(be_u32(&h), STRUCTURED_REPLY_MAGIC, "{h:02x?}");
    let (flags, kind, cookie, len) = (
        be_u16(&h[4..]),
        be_u16(&h[6..]),
        be_u64(&h[8..]),
        be_u32(&h[16..]),
    );
    assert_eq!((kind, cookie), (CHUNK_OFFSET_DATA, 2));
    assert_ne!(flags & CHUNK_DONE, 0, "DF: one chunk, the last");
    assert_eq!(len, 8 + 8192);
    let body = c.read_exact(len as usize).unwrap();
    assert_eq!(be_u64(&body), 4096, "the chunk's offset");
    assert_same("structured read", &body[8..], &data);
    // An error chunk for a read past the end.
    c.request(0, CMD_READ, 3, size, 4096, &[]).unwrap();
    let h = c.read_exact(20).unwrap();
    assert_eq!(be_u32(&h), STRUCTURED_REPLY_MAGIC, "{h:02x?}");
    assert_eq!((be_u16(&h[6..]), be_u64(&h[8..])), (CHUNK_ERROR, 3));
    assert_ne!(be_u16(&h[4..]) & CHUNK_DONE, 0);
    let body = c.read_exact(be_u32(&h[16..]) as usize).unwrap();
    assert_eq!(be_u32(&body), EINVAL);
    assert_eq!(
        be_u16(&body[4..]) as usize,
        body.len() - 6,
        "message length"
    );
    c.disconnect();
    assert_closed(&mut c, "after DISC");
}

#[test]
fn export_name_option_with_and_without_zeroes() {
    let srv = Server::start(&["--device", "mem:16M"]);
    for (client_flags, tail) in [(3u32, 10usize), (1, 10 + 124)] {
        let mut c = Raw::connect(&srv.sock);
        assert_eq!(c.greeting().unwrap() & 3, 3, "fixed newstyle, no zeroes");
        c.send(&client_flags.to_be_bytes()).unwrap();
        c.opt(OPT_EXPORT_NAME, b"").unwrap();
        let t = c.read_exact(tail).unwrap();
        assert_eq!(be_u64(&t), 16 << 20, "size");
        assert_ne!(be_u16(&t[8..]) & 1, 0, "HAS_FLAGS");
        assert!(t[10..].iter().all(|&b| b == 0), "the 124 zero bytes");
        c.read_ok(1, 0, 4096);
        c.disconnect();
        assert_closed(&mut c, "after DISC");
    }
    // An unknown name has no error reply: the server hangs up.
    let mut c = Raw::connect(&srv.sock);
    c.greeting().unwrap();
    c.send(&3u32.to_be_bytes()).unwrap();
    c.opt(OPT_EXPORT_NAME, b"nope").unwrap();
    assert_closed(&mut c, "EXPORT_NAME of an unknown export");
}

#[test]
fn handshake_garbage_closes_the_connection() {
    let srv = Server::start(&["--device", "mem:16M"]);
    let start = || {
        let mut c = Raw::connect(&srv.sock);
        c.greeting().unwrap();
        c
    };
    // Unknown client flags.
    let mut c = start();
    c.send(&0x8000_0003u32.to_be_bytes()).unwrap();
    assert_closed(&mut c, "unknown client flags");
    // An option with the wrong magic.
    let mut c = start();
    c.send(&3u32.to_be_bytes()).unwrap();
    c.send(b"GARBAGE!\0\0\0\x07\0\0\0\x06").unwrap();
    assert_closed(&mut c, "an option with a bad magic");
    // Option data far over any limit (2 MiB).
    let mut c = start();
    c.send(&3u32.to_be_bytes()).unwrap();
    let mut h = IHAVEOPT.to_be_bytes().to_vec();
    h.extend_from_slice(&OPT_GO.to_be_bytes());
    h.extend_from_slice(&(2u32 << 20).to_be_bytes());
    c.send(&h).unwrap();
    let _ = c.send(&[0u8; 4096]);
    assert_closed(&mut c, "2 MiB of option data");
    // The client leaves in the middle of an option.
    let mut c = start();
    c.send(&3u32.to_be_bytes()).unwrap();
    c.send(&IHAVEOPT.to_be_bytes()).unwrap();
    drop(c);
    // ABORT is acknowledged, then the server closes.
    let mut c = start();
    c.send(&3u32.to_be_bytes()).unwrap();
    c.opt(OPT_ABORT, &[]).unwrap();
    let (o, t, _) = c.opt_reply().unwrap();
    assert_eq!((o, t), (OPT_ABORT, REP_ACK));
    assert_closed(&mut c, "after ABORT");

    // Errors that keep the handshake going: too big (skipped), unsupported, unknown
    // export; then GO still works on the same connection.
    let mut c = start();
    c.send(&3u32.to_be_bytes()).unwrap();
    c.opt(OPT_GO, &[0u8; 100 << 10]).unwrap();
    assert_eq!(c.opt_reply().unwrap().1, REP_ERR_TOO_BIG);
    c.opt(99, &[]).unwrap();
    assert_eq!(c.opt_reply().unwrap().1, REP_ERR_UNSUP);
    c.opt(OPT_GO, &go_data("nope")).unwrap();
    assert_eq!(c.opt_reply().unwrap().1, REP_ERR_UNKNOWN);
    c.opt(OPT_GO, &go_data("")).unwrap();
    loop {
        let (_, t, data) = c.opt_reply().unwrap();
        match t {
            REP_ACK => break,
            REP_INFO => {}
            t => panic!("GO after errors: reply {t:#x}: {}", text(&data)),
        }
    }
    c.read_ok(1, 0, 4096);
    c.disconnect();
    assert_closed(&mut c, "after DISC");
}

#[test]
fn more_options_than_max_options_closes_the_connection() {
    let srv = Server::start(&["--device", "mem:16M", "--max-options", "4"]);
    let mut c = Raw::connect(&srv.sock);
    c.greeting().unwrap();
    c.send(&3u32.to_be_bytes()).unwrap();
    for _ in 0..4 {
        c.opt(99, &[]).unwrap();
        assert_eq!(c.opt_reply().unwrap().1, REP_ERR_UNSUP);
    }
    // The fifth option, even a good GO, is one too many.
    let _ = c.opt(OPT_GO, &go_data(""));
    assert_closed(&mut c, "a fifth option with --max-options 4");
    // Four options and a GO as the fourth is fine.
    let (mut c, _, _) = Raw::handshake(
        &srv.sock,
        &[
            OPT_STRUCTURED_REPLY,
            OPT_STRUCTURED_REPLY,
            OPT_STRUCTURED_REPLY,
        ],
        "",
    );
    c.write_ok(1, 0, 0, &[7u8; 512]);
    c.disconnect();
}

#[test]
fn silent_clients_are_dropped_after_the_handshake_timeout() {
    let srv = Server::start(&["--device", "mem:16M", "--handshake-timeout", "1s"]);
    // Never reads the greeting, never sends anything.
    let mut a = Raw::connect(&srv.sock);
    // Sends its flags, then nothing.
    let mut b = Raw::connect(&srv.sock);
    b.greeting().unwrap();
    b.send(&3u32.to_be_bytes()).unwrap();
    // Half an option header, then nothing.
    let mut c = Raw::connect(&srv.sock);
    c.greeting().unwrap();
    c.send(&3u32.to_be_bytes()).unwrap();
    c.send(&IHAVEOPT.to_be_bytes()).unwrap();
    let mut g = [0u8; 18];
    a.s.read_exact(&mut g).unwrap();
    assert_closed(&mut a, "a client that sends nothing");
    assert_closed(&mut b, "a client that sends its flags only");
    assert_closed(&mut c, "a client that stops in an option header");
    // The timeout is for the handshake only: an idle client in transmission stays.
    let (mut d, _, _) = Raw::go(&srv.sock, "");
    std::thread::sleep(Duration::from_millis(1500));
    d.read_ok(1, 0, 4096);
    d.disconnect();
}

#[test]
fn a_trickling_client_is_dropped_at_the_handshake_deadline() {
    let srv = Server::start(&["--device", "mem:16M", "--handshake-timeout", "1s"]);
    let mut c = Raw::connect(&srv.sock);
    c.greeting().unwrap();
    c.send(&3u32.to_be_bytes()).unwrap();
    let mut h = IHAVEOPT.to_be_bytes().to_vec();
    h.extend_from_slice(&3u32.to_be_bytes()); // LIST
    h.extend_from_slice(&1000u32.to_be_bytes()); // with 1000 bytes of data
    c.send(&h).unwrap();
    c.s.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let started = Instant::now();
    let limit = Duration::from_secs(10);
    let mut buf = [0u8; 64];
    loop {
        assert!(
                started.elapsed() < limit,
                "a client trickling one byte per 300 ms is still connected {limit:?} into a 1 s handshake timeout"
            );
        if c.send(b"x").is_err() {
            break;
        }
        match c.s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => panic!("unexpected bytes: {:02x?}", &buf[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => break,
            Err(_) => {} // still open
        }
    }
}

#[test]
fn misbehaving_clients_do_not_stall_a_well_behaved_one() {
    const NAME: &str = "raw::misbehaving_clients_do_not_stall_a_well_behaved_one";
    let Some([nbdcopy]) = tools(NAME, ["nbdcopy"]) else {
        return;
    };
    // One reactor thread: every connection shares it.
    let srv = Server::start(&[
        "--device",
        "mem:16M",
        "--threads",
        "1",
        "--handshake-timeout",
        "60s",
    ]);
    // A: silent in the handshake.
    let mut a = Raw::connect(&srv.sock);
    a.greeting().unwrap();
    // B: a 1 MiB write whose payload stops after 1000 bytes.
    let (mut b, _, _) = Raw::go(&srv.sock, "");
    let b_data = random_bytes(1 << 20, 9);
    b.send(&header(0, CMD_WRITE, 1, 15 << 20, 1 << 20)).unwrap();
    b.send(&b_data[..1000]).unwrap();
    // C: 1000 reads of 64 KiB, and it reads none of the replies (yet).
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    let mut reads = Vec::new();
    for i in 0..1000u64 {
        reads.extend_from_slice(&header(0, CMD_READ, i, (i % 200) * 65536, 65536));
    }
    c.send(&reads).unwrap();
    // D: garbage after the handshake.
    let (mut d, _, _) = Raw::go(&srv.sock, "");
    d.send(&[0xffu8; 100]).unwrap();

    // Meanwhile nbdcopy copies 16 MiB in and out.
    let src = srv.path("src.img");
    let back = srv.path("back.img");
    let data = random_bytes(16 << 20, 10);
    std::fs::write(&src, &data).unwrap();
    success(
        "nbdcopy in, beside misbehaving clients",
        &run(Command::new(&nbdcopy).args([path_str(&src), &srv.uri()])),
    );
    success(
        "nbdcopy out, beside misbehaving clients",
        &run(Command::new(&nbdcopy).args([&srv.uri(), path_str(&back)])),
    );
    assert_same("nbdcopy round trip", &std::fs::read(&back).unwrap(), &data);

    assert_closed(&mut d, "garbage after the handshake");
    // B finishes its write; C reads its replies: all were kept.
    b.send(&b_data[1000..]).unwrap();
    b.expect(1, 0);
    assert_same("B's write", &b.read_ok(2, 15 << 20, 1 << 20), &b_data);
    let mut seen = vec![false; 1000];
    for _ in 0..1000 {
        let (error, cookie) = c.reply().expect("C's replies");
        assert_eq!(error, 0, "C's read {cookie}");
        assert!(!std::mem::replace(&mut seen[cookie as usize], true));
        c.read_exact(65536).unwrap();
    }
    for x in [&mut b, &mut c] {
        x.disconnect();
        assert_closed(x, "after DISC");
    }
    drop(a);
}

#[test]
fn max_connections_refuses_a_third_connection_at_once() {
    let srv = Server::start(&["--device", "mem:16M", "--max-connections", "2"]);
    let (mut a, _, _) = Raw::go(&srv.sock, "");
    let (mut b, _, _) = Raw::go(&srv.sock, "");
    let mut c = Raw::connect(&srv.sock);
    assert_closed(&mut c, "a third connection with --max-connections 2");
    let data = random_bytes(4096, 11);
    a.write_ok(1, 0, 0, &data);
    assert_same("B reads A's write", &b.read_ok(2, 0, 4096), &data);
    // Connections that end in every way give their slot back.
    a.disconnect();
    assert_closed(&mut a, "after DISC");
    for round in 0..3 {
        let mut x = admitted(&srv.sock);
        match round {
            0 => drop(x), // leaves during the handshake
            1 => {
                x.send(&0xffff_ffffu32.to_be_bytes()).unwrap();
                assert_closed(&mut x, "bad client flags");
            }
            _ => {
                x.send(&3u32.to_be_bytes()).unwrap();
                x.opt(OPT_GO, &go_data("")).unwrap();
                while x.opt_reply().unwrap().1 != REP_ACK {}
                x.send(&[0u8; 28]).unwrap();
                assert_closed(&mut x, "bad request magic");
            }
        }
    }
    let mut x = admitted(&srv.sock);
    x.send(&3u32.to_be_bytes()).unwrap();
    x.opt(OPT_GO, &go_data("")).unwrap();
    while x.opt_reply().unwrap().1 != REP_ACK {}
    assert_same("a later client", &x.read_ok(3, 0, 4096), &data);
    // B all along, and x: two at once again.
    assert_same("B still works", &b.read_ok(4, 0, 4096), &data);
    let mut y = Raw::connect(&srv.sock);
    assert_closed(&mut y, "a third connection again");
}
