use super::admin::admin;
use super::*;

/// `cairn serve` with its three sockets in `dir`, named `{prefix}nbd.sock`,
/// `{prefix}admin.sock` and `{prefix}metrics.sock`; a refused start's output.
fn serve_args(dir: &Path, prefix: [&str; 3]) -> Vec<String> {
    vec![
        "--listen".into(),
        format!(
            "unix:{}",
            dir.join(format!("{}nbd.sock", prefix[0])).display()
        ),
        "--admin".into(),
        dir.join(format!("{}admin.sock", prefix[1]))
            .display()
            .to_string(),
        "--metrics".into(),
        format!(
            "unix:{}",
            dir.join(format!("{}metrics.sock", prefix[2])).display()
        ),
        "--device".into(),
        "mem:8M".into(),
    ]
}

/// A `GET /metrics` on a Unix socket; the response.
fn scrape_unix(path: &Path) -> String {
    let mut s =
        UnixStream::connect(path).unwrap_or_else(|e| panic!("connect to {}: {e}", path.display()));
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// Every socket of the server in `dir` answers: an NBD write read back, an admin
/// command, a scrape.
fn all_answer(dir: &Path, what: &str) {
    let (mut c, size, _) = Raw::go(&dir.join("nbd.sock"), "");
    assert_eq!(size, 8 << 20, "{what}");
    c.write_ok(1, 0, 4096, &[0x5a; 4096]);
    assert_eq!(c.read_ok(2, 4096, 4096), vec![0x5a; 4096], "{what}");
    c.disconnect();
    let out = admin(&dir.join("admin.sock"), &["devices"]);
    assert_eq!(success(what, &out), "mem\n", "{what}");
    let scrape = scrape_unix(&dir.join("metrics.sock"));
    assert!(
        scrape.starts_with("HTTP/1.") && scrape.contains("cairn_device_requests_total"),
        "{what}: {scrape}"
    );
}

/// A server killed with SIGKILL leaves its three socket files; the next one on the
/// same paths replaces them and serves. A second one started while it runs is refused
/// with one line naming the path in use (each socket in turn), leaves nothing of its
/// own behind, and the first one goes on answering on all three.
#[test]
fn kill_9_then_the_same_paths_serve_and_a_second_server_is_refused_by_name() {
    let dir = tmpdir();
    let d = dir.path();
    let start = || {
        let args = serve_args(d, ["", "", ""]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        // The listen address is in `args`: `spawn` gets no other.
        Server::spawn(tmpdir(), d.join("nbd.sock"), &[], &args)
    };
    let mut first = start();
    all_answer(d, "the first server");
    first.signal(libc::SIGKILL);
    let (status, _) = first.wait_exit();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );
    for name in ["nbd.sock", "admin.sock", "metrics.sock"] {
        let meta = std::fs::symlink_metadata(d.join(name)).expect("left behind");
        assert!(std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()));
    }

    let again = start();
    all_answer(d, "started again after kill -9");
    let log = again.stderr();
    assert!(
        log.matches("replacing a stale socket").count() == 3,
        "each stale socket is logged as replaced:\n{log}"
    );

    // The prefix "x" gives a socket a fresh path: only the other ones collide.
    let cases = [
        (
            ["", "x", "x"],
            format!("--listen unix:{}", d.join("nbd.sock").display()),
        ),
        (
            ["x", "", "x"],
            format!("--admin {}", d.join("admin.sock").display()),
        ),
        (
            ["x", "x", ""],
            format!("--metrics unix:{}", d.join("metrics.sock").display()),
        ),
    ];
    for (prefix, label) in cases {
        let args = serve_args(d, prefix);
        let out = run(Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("serve")
            .args(&args)
            .env_remove("LISTEN_FDS"));
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{label}: {stderr}");
        assert_eq!(
            stderr,
            format!("cairn: {label}: another process is listening there (a running cairn?)\n"),
            "{label}"
        );
        for name in ["xnbd.sock", "xadmin.sock", "xmetrics.sock"] {
            assert!(
                !d.join(name).exists(),
                "{label}: the refused server left {name} behind"
            );
        }
        all_answer(
            d,
            &format!("the first server, after a second was refused ({label})"),
        );
    }
    drop(again);
    for name in ["nbd.sock", "admin.sock", "metrics.sock"] {
        assert!(!d.join(name).exists(), "{name} is removed at exit");
    }
}

/// What is not a socket at a socket's path (a regular file, a directory, a symbolic
/// link, even to a stale socket) is refused for what it is, and left as it is.
#[test]
fn what_is_not_a_socket_is_refused_for_what_it_is_and_left_alone() {
    let dir = tmpdir();
    let d = dir.path();
    let file = d.join("file");
    std::fs::write(&file, b"data").unwrap();
    let subdir = d.join("dir");
    std::fs::create_dir(&subdir).unwrap();
    let stale = d.join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let link = d.join("link");
    std::os::unix::fs::symlink(&stale, &link).unwrap();
    let cases: [(&Path, &str); 3] = [
        (&file, "a regular file"),
        (&subdir, "a directory"),
        (&link, "a symbolic link"),
    ];
    for (path, what) in cases {
        for (flag, value, label) in [
            (
                "--listen",
                format!("unix:{}", path.display()),
                "--listen unix:",
            ),
            ("--admin", path.display().to_string(), "--admin "),
            (
                "--metrics",
                format!("unix:{}", path.display()),
                "--metrics unix:",
            ),
        ] {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_cairn"));
            cmd.args(["serve", "--device", "mem:1M", flag, &value]);
            if flag != "--listen" {
                cmd.arg("--listen")
                    .arg(format!("unix:{}", d.join("nbd.sock").display()));
            }
            let out = run(&mut cmd);
            let stderr = text(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{flag} {what}: {stderr}");
            assert_eq!(
                    stderr,
                    format!(
                        "cairn: {label}{}: {what} is there, not a socket (only a socket nobody listens on is replaced)\n",
                        path.display()
                    )
                );
            assert!(!d.join("nbd.sock").exists(), "{flag} {what}: nbd.sock left");
        }
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"data");
    assert!(subdir.is_dir());
    assert_eq!(std::fs::read_link(&link).unwrap(), stale);
    assert!(std::os::unix::fs::FileTypeExt::is_socket(
        &std::fs::symlink_metadata(&stale).unwrap().file_type()
    ));
}
