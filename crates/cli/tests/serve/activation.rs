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
