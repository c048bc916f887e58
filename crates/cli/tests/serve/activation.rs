use super::*;

/// systemd-style socket activation: the listening socket arrives as fd 3 with
/// LISTEN_FDS=1, and the server serves on it without any --listen.
#[test]
fn serves_on_a_socket_passed_by_systemd_socket_activate() {
    let test = "activation::serves_on_a_socket_passed_by_systemd_socket_activate";
    let Some([activate, nbdinfo]) = tools(test, ["systemd-socket-activate", "nbdinfo"]) else {
        return;
    };
    let dir = tmpdir();
    let sock = dir.path().join("activated.sock");
    let mut child = Command::new(activate)
        .arg("-l")
        .arg(&sock)
        .arg(env!("CARGO_BIN_EXE_cairn"))
        .args(["serve", "--device", "mem:8M"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start systemd-socket-activate");
    let deadline = Instant::now() + READY_TIMEOUT;
    while !sock.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    // The first connection starts cairn, which takes over the listening socket.
    let out = run(Command::new(&nbdinfo)
        .arg("--size")
        .arg(format!("nbd+unix:///?socket={}", sock.display())));
    // SAFETY: signals our own child process.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let _ = child.wait();
    let size = success("nbdinfo --size through socket activation", &out);
    assert_eq!(size.trim(), (8u64 << 20).to_string());
}

/// `cairn serve --stdio` serves one connection on standard input, as libnbd's
/// `connect_command` runs it (a socketpair as stdin and stdout): data written reaches
/// the file, nothing but protocol goes to stdout, and the server exits 0 once the client
/// has gone, with the file flushed. A pipe on stdin is refused in one line, and so is
/// --listen with it.
const CONNECT_COMMAND: &str = r#"
import os, nbd
h = nbd.NBD()
h.connect_command([os.environ["CAIRN_BIN"], "serve", "--stdio", "--device",
                   "file:" + os.environ["CAIRN_FILE"]])
assert h.get_size() == 16 << 20, h.get_size()
h.pwrite(b"stdio" * 1000, 8192)
h.flush()
assert h.pread(5000, 8192) == b"stdio" * 1000
h.shutdown()
print("served on stdio")
"#;

#[test]
fn stdio_serves_one_connection_for_connect_command() {
    const NAME: &str = "activation::stdio_serves_one_connection_for_connect_command";
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    let dir = tmpdir();
    let file = dir.path().join("disk.img");
    std::fs::write(&file, vec![0u8; 16 << 20]).unwrap();
    let out = run(Command::new(&python)
        .args(["-c", CONNECT_COMMAND])
        .env("CAIRN_BIN", env!("CARGO_BIN_EXE_cairn"))
        .env("CAIRN_FILE", &file));
    assert!(
        out.status.success() && text(&out.stdout).contains("served on stdio"),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let err = text(&out.stderr);
    assert!(err.contains("on standard input (one connection)"), "{err}");
    assert!(err.contains("cairn: serve: stopped"), "{err}");
    let bytes = std::fs::read(&file).unwrap();
    assert!(
        bytes[8192..13192] == b"stdio".repeat(1000)[..],
        "the file lacks the write"
    );
    // Refusals: a pipe, and --listen beside --stdio.
    for (args, needle) in [
        (
            vec!["serve", "--stdio", "--device", "mem:1M"],
            "not a socket",
        ),
        (
            vec!["serve", "--stdio", "--listen", "unix:/nonexistent/x.sock"],
            "no --listen with it",
        ),
    ] {
        let out = run(Command::new(env!("CARGO_BIN_EXE_cairn"))
            .args(&args)
            .stdin(Stdio::piped()));
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle) && err.lines().count() == 1, "{err}");
        assert!(out.stdout.is_empty());
    }
}
