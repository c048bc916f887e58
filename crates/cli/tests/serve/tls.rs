use super::*;

/// A CA and a server certificate for `localhost` signed by it, made with openssl in
/// `dir` (laid out as `--tls-certificates` and libnbd's `tls-certificates` expect).
fn make_certs(test: &str, dir: &Path) -> bool {
    make_certs_with(test, dir, &["-newkey", "rsa:2048"])
}

/// [`make_certs`] with the server's key made by these `openssl req` arguments.
fn make_certs_with(test: &str, dir: &Path, server_key: &[&str]) -> bool {
    let Some([openssl]) = tools(test, ["openssl"]) else {
        return false;
    };
    let sh = |args: &[&str]| {
        let out = run(Command::new(&openssl).args(args).current_dir(dir));
        success(&format!("openssl {args:?}"), &out);
    };
    sh(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca-key.pem",
        "-out",
        "ca-cert.pem",
        "-days",
        "2",
        "-subj",
        "/CN=cairn test CA",
    ]);
    sh(&[
        &["req"][..],
        server_key,
        &[
            "-nodes",
            "-keyout",
            "server-key.pem",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ],
    ]
    .concat());
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    sh(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca-cert.pem",
        "-CAkey",
        "ca-key.pem",
        "-CAcreateserial",
        "-out",
        "server-cert.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
    true
}

fn tls_uri(server: &Server, certs: &Path) -> String {
    format!(
        "nbds+unix:///?socket={}&tls-certificates={}",
        server.sock.display(),
        certs.display()
    )
}

#[test]
fn nbdcopy_round_trip_over_tls_and_tls_required_refuses_plain_clients() {
    let test = "tls::nbdcopy_round_trip_over_tls_and_tls_required_refuses_plain_clients";
    let Some([nbdinfo, nbdcopy]) = tools(test, ["nbdinfo", "nbdcopy"]) else {
        return;
    };
    let certs = tmpdir();
    if !make_certs(test, certs.path()) {
        return;
    }
    let c = path_str(certs.path());
    let server = Server::start(&[
        "--device",
        "mem:64M",
        "--tls",
        "require",
        "--tls-certificates",
        c,
    ]);
    // A plain client is refused (TLS required) and nothing is served to it.
    let out = run(Command::new(&nbdinfo).arg(server.uri()));
    assert!(
        !out.status.success(),
        "plain nbdinfo succeeded: {}",
        text(&out.stdout)
    );
    // Over TLS: the handshake finishes and the export is described.
    let uri = tls_uri(&server, certs.path());
    let info = success("nbdinfo over TLS", &run(Command::new(&nbdinfo).arg(&uri)));
    assert!(info.contains("with TLS"), "{info}");
    // Data survives the round trip through rustls in both directions, large
    // requests (many TLS records each) included.
    let src = server.path("src.img");
    let back = server.path("back.img");
    let data = random_bytes(24 << 20, 7);
    std::fs::write(&src, &data).unwrap();
    success(
        "nbdcopy in over TLS",
        &run(Command::new(&nbdcopy).arg(&src).arg(&uri)),
    );
    success(
        "nbdcopy out over TLS",
        &run(Command::new(&nbdcopy).arg(&uri).arg(&back)),
    );
    let got = std::fs::read(&back).unwrap();
    assert_same("TLS round trip", &got[..data.len()], &data);
}

/// A TLS connection that received a burst of requests and went idle gives its
/// buffers back (its receive cancelled, its ciphertext and input buffers dropped),
/// then serves as before.
#[test]
fn an_idle_tls_connection_gives_its_buffers_back_and_serves_on() {
    let test = "tls::an_idle_tls_connection_gives_its_buffers_back_and_serves_on";
    let Some([python]) = tools(test, ["python3"]) else {
        return;
    };
    let certs = tmpdir();
    if !make_certs(test, certs.path()) {
        return;
    }
    let c = path_str(certs.path());
    let server = Server::start(&[
        "--device",
        "mem:16M",
        "--tls",
        "require",
        "--tls-certificates",
        c,
        "--log-level",
        "debug",
    ]);
    // A raw client over Python's ssl: it sends each burst in one write, so that the
    // server receives it in full records (libnbd writes request by request).
    let script = r#"
import os, socket, ssl, struct, sys, time
def exact(s, n):
    b = b""
    while len(b) < n:
        d = s.recv(n - len(b))
        assert d, "closed"
        b += d
    return b
def option(s, o, data=b""):
    s.sendall(struct.pack(">QII", 0x49484156454F5054, o, len(data)) + data)
    while True:
        _, ro, t, n = struct.unpack(">QIII", exact(s, 20))
        exact(s, n)
        assert t < 0x80000000, f"option {o}: error {t:#x}"
        if t == 1:
            return
def request(s, command, cookie, offset=0, length=0, data=b""):
    return struct.pack(">IHHQQI", 0x25609513, 0, command, cookie, offset, length) + data
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
exact(s, 18)
s.sendall(struct.pack(">I", 3))
option(s, 5)
ctx = ssl.create_default_context(cafile=sys.argv[2] + "/ca-cert.pem")
s = ctx.wrap_socket(s, server_hostname="localhost")
option(s, 7, struct.pack(">IH", 0, 0))
for round in range(3):
    # 9,000 flushes in one write: some 250 KiB of requests.
    s.sendall(b"".join(request(s, 3, j) for j in range(9000)))
    for j in range(9000):
        magic, err, cookie = struct.unpack(">IIQ", exact(s, 16))
        assert (magic, err, cookie) == (0x67446698, 0, j), (magic, err, cookie, j)
    # Idle long enough for the server to take its buffers back (a second, and up to
    # a second more before it looks).
    time.sleep(2.5)
    data = os.urandom(65536)
    s.sendall(request(s, 1, 1, 1 << 20, 65536, data) + request(s, 0, 2, 1 << 20, 65536))
    assert struct.unpack(">IIQ", exact(s, 16)) == (0x67446698, 0, 1)
    assert struct.unpack(">IIQ", exact(s, 16)) == (0x67446698, 0, 2)
    assert exact(s, 65536) == data
print("done")
"#;
    let out = run(Command::new(&python)
        .args(["-c", script])
        .arg(&server.sock)
        .arg(certs.path()));
    let stdout = success("the raw TLS client", &out);
    assert!(stdout.contains("done"), "{stdout}");
    // The log is read on another thread: give it time to catch up.
    let deadline = Instant::now() + IO_TIMEOUT;
    while server.stderr().matches("KiB of ciphertext buffer)").count() < 3
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = server.stderr();
    assert!(!log.contains("WARN"), "{log}");
    assert_eq!(
        log.matches("KiB of ciphertext buffer)").count(),
        3,
        "input and ciphertext buffers given back after each burst: {log}"
    );
}

/// cairn's own client over TLS (`nbds+unix://`, the nbd device): a verified random
/// read/write load through a server that requires TLS, so every byte went through
/// rustls on both sides; a server certificate from another CA is refused unless
/// `tls-verify-peer=false`.
#[test]
fn the_nbd_device_speaks_tls() {
    let test = "tls::the_nbd_device_speaks_tls";
    let certs = tmpdir();
    if !make_certs(test, certs.path()) {
        return;
    }
    let c = path_str(certs.path());
    let server = Server::start(&[
        "--device",
        "mem:64M",
        "--tls",
        "require",
        "--tls-certificates",
        c,
    ]);
    let uri = tls_uri(&server, certs.path());
    let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args([
        "bench",
        "--device",
        &format!("nbd:{uri}"),
        "--rw",
        "randrw",
        "--bs",
        "64k",
        "--runtime",
        "1s",
        "--time_based",
        "--verify",
        "crc32c",
    ]));
    let report = success("cairn bench over nbds://", &out);
    assert!(report.contains("blocks read back and checked"), "{report}");
    assert!(!report.contains("err="), "{report}");
    // Another CA: the server's certificate is not trusted.
    let other = tmpdir();
    if !make_certs(test, other.path()) {
        return;
    }
    let wrong = format!(
        "nbd:nbds+unix:///?socket={}&tls-certificates={}",
        server.sock.display(),
        other.path().display()
    );
    let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args([
        "bench",
        "--device",
        &wrong,
        "--runtime",
        "100ms",
    ]));
    assert!(!out.status.success(), "an untrusted server was accepted");
    let err = text(&out.stderr);
    assert!(
        err.contains("cannot connect") && err.contains("TLS"),
        "{err}"
    );
    let unverified = format!("{wrong}&tls-verify-peer=false");
    let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args([
        "bench",
        "--device",
        &unverified,
        "--runtime",
        "200ms",
        "--time_based",
    ]));
    success("cairn bench with tls-verify-peer=false", &out);
}

#[test]
fn tls_is_optional_with_certificates_and_refused_without() {
    let test = "tls::tls_is_optional_with_certificates_and_refused_without";
    let Some([nbdinfo]) = tools(test, ["nbdinfo"]) else {
        return;
    };
    let certs = tmpdir();
    if !make_certs(test, certs.path()) {
        return;
    }
    let c = path_str(certs.path());
    // Certificates given: TLS is offered, plain clients still served.
    let server = Server::start(&["--device", "mem:16M", "--tls-certificates", c]);
    success(
        "plain nbdinfo",
        &run(Command::new(&nbdinfo).arg(server.uri())),
    );
    let info = success(
        "nbdinfo over TLS",
        &run(Command::new(&nbdinfo).arg(tls_uri(&server, certs.path()))),
    );
    assert!(info.contains("with TLS"), "{info}");
    drop(server);
    // No certificates: a client that insists on TLS is refused, cleanly.
    let server = Server::start(&["--device", "mem:16M"]);
    let out = run(Command::new(&nbdinfo).arg(tls_uri(&server, certs.path())));
    assert!(!out.status.success());
    success(
        "plain nbdinfo",
        &run(Command::new(&nbdinfo).arg(server.uri())),
    );
}

/// RSA keys of sizes ring refused (2432 bits, as the NBD reference project's test
/// certificates have) and the usual 3072, in PKCS#8 and PKCS#1 form: the server
/// starts, and data goes through TLS both ways.
#[test]
fn rsa_keys_of_2432_and_3072_bits_in_both_forms_serve_over_tls() {
    let test = "tls::rsa_keys_of_2432_and_3072_bits_in_both_forms_serve_over_tls";
    let Some([nbdcopy, openssl]) = tools(test, ["nbdcopy", "openssl"]) else {
        return;
    };
    for bits in ["2432", "3072"] {
        let certs = tmpdir();
        if !make_certs_with(test, certs.path(), &["-newkey", &format!("rsa:{bits}")]) {
            return;
        }
        for form in ["PKCS#8", "PKCS#1"] {
            if form == "PKCS#1" {
                let key = certs.path().join("server-key.pem");
                let out = run(Command::new(&openssl)
                    .args(["rsa", "-traditional", "-in"])
                    .arg(&key)
                    .arg("-out")
                    .arg(&key));
                success("openssl rsa -traditional", &out);
                let pem = std::fs::read_to_string(&key).unwrap();
                assert!(pem.contains("BEGIN RSA PRIVATE KEY"), "{pem}");
            }
            let server = Server::start(&[
                "--device",
                "mem:16M",
                "--tls",
                "require",
                "--tls-certificates",
                path_str(certs.path()),
            ]);
            let uri = tls_uri(&server, certs.path());
            let src = server.path("src.img");
            let back = server.path("back.img");
            let data = random_bytes(1 << 20, bits.len() as u64);
            std::fs::write(&src, &data).unwrap();
            let what = format!("{bits}-bit RSA key ({form})");
            success(
                &format!("nbdcopy in over TLS, {what}"),
                &run(Command::new(&nbdcopy).arg(&src).arg(&uri)),
            );
            success(
                &format!("nbdcopy out over TLS, {what}"),
                &run(Command::new(&nbdcopy).arg(&uri).arg(&back)),
            );
            let got = std::fs::read(&back).unwrap();
            assert_same(&what, &got[..data.len()], &data);
        }
    }
}

/// Keys TLS cannot sign with are refused at start with what they are, not "failed to
/// parse"; a file without a key says so.
#[test]
fn refused_keys_say_what_they_are() {
    let test = "tls::refused_keys_say_what_they_are";
    for (key, want) in [
        (
            &["-newkey", "rsa:1024"][..],
            "an RSA key of 1024 bits (PKCS#8)",
        ),
        (
            &["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:secp256k1"],
            "an EC key on secp256k1",
        ),
        (&["-newkey", "ed448"], "an Ed448 key"),
    ] {
        let certs = tmpdir();
        if !make_certs_with(test, certs.path(), key) {
            return;
        }
        let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args([
            "serve",
            "--listen",
            "unix:/nonexistent/never.sock",
            "--device",
            "mem:16M",
            "--tls-certificates",
            path_str(certs.path()),
        ]));
        assert!(!out.status.success(), "{key:?}: cairn serve started");
        let err = text(&out.stderr);
        assert!(
            err.contains(want) && err.contains("RSA keys of 2048 to 8192 bits"),
            "{key:?}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    let certs = tmpdir();
    if !make_certs(test, certs.path()) {
        return;
    }
    std::fs::write(certs.path().join("server-key.pem"), "not a key\n").unwrap();
    let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args([
        "serve",
        "--device",
        "mem:16M",
        "--tls-certificates",
        path_str(certs.path()),
    ]));
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("server-key.pem: no private key in the file"),
        "{}",
        text(&out.stderr)
    );
}

/// A client certificate signed by the test CA, in `client/` next to a copy of the CA
/// (libnbd's layout: ca-cert.pem, client-cert.pem, client-key.pem).
fn make_client_cert(test: &str, certs: &Path, client: &Path) -> bool {
    let Some([openssl]) = tools(test, ["openssl"]) else {
        return false;
    };
    let sh = |args: &[&str]| {
        let out = run(Command::new(&openssl).args(args).current_dir(certs));
        success(&format!("openssl {args:?}"), &out);
    };
    sh(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "client-key.pem",
        "-out",
        "client.csr",
        "-subj",
        "/CN=cairn test client",
    ]);
    std::fs::write(
        certs.join("client-ext.cnf"),
        "basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
             extendedKeyUsage=clientAuth
",
    )
    .unwrap();
    sh(&[
        "x509",
        "-req",
        "-in",
        "client.csr",
        "-CA",
        "ca-cert.pem",
        "-CAkey",
        "ca-key.pem",
        "-CAcreateserial",
        "-out",
        "client-cert.pem",
        "-days",
        "2",
        "-extfile",
        "client-ext.cnf",
    ]);
    for f in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
        std::fs::copy(certs.join(f), client.join(f)).unwrap();
    }
    true
}

#[test]
fn verify_peer_wants_a_client_certificate_from_the_ca() {
    let test = "tls::verify_peer_wants_a_client_certificate_from_the_ca";
    let Some([nbdinfo]) = tools(test, ["nbdinfo"]) else {
        return;
    };
    let certs = tmpdir();
    let client = tmpdir();
    if !make_certs(test, certs.path()) || !make_client_cert(test, certs.path(), client.path()) {
        return;
    }
    let server = Server::start(&[
        "--device",
        "mem:16M",
        "--tls",
        "require",
        "--tls-verify-peer",
        "--tls-certificates",
        path_str(certs.path()),
    ]);
    // With the client certificate: served.
    let with = tls_uri(&server, client.path());
    success(
        "nbdinfo with a client certificate",
        &run(Command::new(&nbdinfo).arg(&with)),
    );
    // Trusting the server but without a certificate of its own: refused.
    let bare = tmpdir();
    std::fs::copy(
        certs.path().join("ca-cert.pem"),
        bare.path().join("ca-cert.pem"),
    )
    .unwrap();
    let out = run(Command::new(&nbdinfo).arg(tls_uri(&server, bare.path())));
    assert!(
        !out.status.success(),
        "served a client without a certificate"
    );
}

#[test]
fn bad_tls_settings_are_refused_at_start() {
    let bin = env!("CARGO_BIN_EXE_cairn");
    let dir = tmpdir();
    for (args, needle) in [
        (vec!["--tls", "require"], "--tls-certificates"),
        (vec!["--tls-verify-peer"], "--tls-certificates"),
        (
            vec!["--tls-certificates", path_str(dir.path())],
            "server-cert.pem",
        ),
    ] {
        let out = run(Command::new(bin)
            .arg("serve")
            .args(["--listen", &format!("unix:{}/x.sock", dir.path().display())])
            .args(&args));
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = text(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// `cairn backup` over TLS (`nbds+unix://`): a full copy of a file served by a server
/// that requires TLS equals the file.
#[test]
fn cairn_backup_copies_over_tls() {
    let test = "tls::cairn_backup_copies_over_tls";
    let certs = tmpdir();
    if !make_certs(test, certs.path()) {
        return;
    }
    let data = tmpdir();
    let image = data.path().join("disk.img");
    let bytes = random_bytes(8 << 20, 77);
    std::fs::write(&image, &bytes).unwrap();
    let server = Server::start(&[
        "--device",
        &format!("file:{}", image.display()),
        "--tls",
        "require",
        "--tls-certificates",
        path_str(certs.path()),
    ]);
    let dest = data.path().join("copy.img");
    let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args([
        "backup",
        &tls_uri(&server, certs.path()),
        path_str(&dest),
        "--request-size",
        "256K",
    ]));
    let line = success("cairn backup over nbds://", &out);
    assert!(line.contains("8MiB read"), "{line}");
    assert_same("backup over TLS", &std::fs::read(&dest).unwrap(), &bytes);
}
