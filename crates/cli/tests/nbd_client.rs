//! cairn's NBD client (the `nbd` device's handshake) against real servers: cairn serve,
//! nbdkit and qemu-nbd. Tools that are missing are skipped with a reason.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cairn_nbd::client::{connect, HandshakeError, Want};
use cairn_nbd::proto::tflags;
use cairn_nbd::uri::NbdUri;
use common::{skip, tmpdir, tool};

/// Kills the server when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the server `cmd` (output discarded) and waits until it listens on `sock`.
fn start(cmd: &mut Command, sock: &std::path::Path) -> Running {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the server");
    let mut srv = Running(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !sock.exists() {
        if let Ok(Some(status)) = srv.0.try_wait() {
            panic!("the server exited before listening: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            sock.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    srv
}

fn uri(sock: &std::path::Path, export: &str) -> NbdUri {
    NbdUri::parse(&format!("nbd+unix:///{export}?socket={}", sock.display())).unwrap()
}

const TIMEOUT: Duration = Duration::from_secs(10);

/// Against cairn serve: size, flags, block sizes, structured replies and the allocation
/// context as the server advertises them; an unknown export is refused with the reason.
#[test]
fn handshake_with_cairn_serve() {
    let dir = tmpdir();
    let sock = dir.path().join("nbd.sock");
    let _srv = start(
        Command::new(env!("CARGO_BIN_EXE_cairn"))
            .args(["serve", "--device", "mem:16M", "--listen"])
            .arg(format!("unix:{}", sock.display())),
        &sock,
    );
    let (_fd, n) = connect(&uri(&sock, ""), Want::default(), TIMEOUT).unwrap();
    assert_eq!(n.size, 16 << 20);
    assert!(n.flags & tflags::HAS_FLAGS != 0 && n.flags & tflags::SEND_FLUSH != 0);
    assert_eq!((n.min_block, n.preferred_block), (512, 4096));
    assert_eq!(n.max_payload, 32 << 20);
    assert!(n.structured);
    assert!(n.allocation_id.is_some());
    // cairn serve does not offer extended headers yet: structured replies it is.
    let ext = Want {
        extended: true,
        ..Want::default()
    };
    let (_fd, n) = connect(&uri(&sock, ""), ext, TIMEOUT).unwrap();
    assert!(n.structured && !n.extended && n.allocation_id.is_some());
    let plain = Want {
        extended: false,
        structured: false,
        allocation: true,
    };
    let (_fd, n) = connect(&uri(&sock, ""), plain, TIMEOUT).unwrap();
    assert!(!n.structured && n.allocation_id.is_none());
    match connect(&uri(&sock, "nope"), Want::default(), TIMEOUT) {
        Err(HandshakeError::Refused(why)) => assert!(why.contains("no such export"), "{why}"),
        other => panic!("an unknown export: {other:?}"),
    }
}

/// Against nbdkit's memory plugin and qemu-nbd: the size each was given.
#[test]
fn handshake_with_nbdkit_and_qemu_nbd() {
    let dir = tmpdir();
    if let Some(nbdkit) = tool("nbdkit") {
        let sock = dir.path().join("nbdkit.sock");
        let _srv = start(
            Command::new(nbdkit)
                .args(["--foreground", "--exit-with-parent", "-U"])
                .arg(&sock)
                .args(["memory", "size=8M"]),
            &sock,
        );
        let (_fd, n) = connect(&uri(&sock, ""), Want::default(), TIMEOUT).unwrap();
        assert_eq!(n.size, 8 << 20);
        assert!(n.structured);
    } else {
        skip("handshake_with_nbdkit", "no nbdkit (Debian: nbdkit)");
    }
    if let Some(qemu_nbd) = tool("qemu-nbd") {
        let img = dir.path().join("q.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(4 << 20)
            .unwrap();
        let sock = dir.path().join("qemu.sock");
        let _srv = start(
            Command::new(qemu_nbd)
                .args([
                    "--persistent",
                    "--shared=4",
                    "--format=raw",
                    "--export-name=q",
                    "--socket",
                ])
                .arg(&sock)
                .arg(&img),
            &sock,
        );
        let (_fd, n) = connect(&uri(&sock, "q"), Want::default(), TIMEOUT).unwrap();
        assert_eq!(n.size, 4 << 20);
        assert!(n.structured && !n.extended && n.allocation_id.is_some());
        // qemu-nbd (8.2 and later) speaks extended headers.
        let ext = Want {
            extended: true,
            ..Want::default()
        };
        let (_fd, n) = connect(&uri(&sock, "q"), ext, TIMEOUT).unwrap();
        assert!(
            n.structured && n.extended && n.allocation_id.is_some(),
            "{n:?}"
        );
    } else {
        skip(
            "handshake_with_qemu_nbd",
            "no qemu-nbd (Debian: qemu-utils)",
        );
    }
}

/// A socket that does not speak NBD is refused with a reason, not a hang or a panic.
#[test]
fn a_server_that_is_not_nbd_is_refused() {
    let dir = tmpdir();
    let sock = dir.path().join("junk.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let t = std::thread::spawn(move || {
        use std::io::Write;
        let (mut c, _) = listener.accept().unwrap();
        let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        std::thread::sleep(Duration::from_millis(200));
    });
    match connect(&uri(&sock, ""), Want::default(), TIMEOUT) {
        Err(HandshakeError::Refused(why)) => assert!(why.contains("not an NBD server"), "{why}"),
        other => panic!("{other:?}"),
    }
    t.join().unwrap();
}
