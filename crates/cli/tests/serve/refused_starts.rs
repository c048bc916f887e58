use super::*;

/// A stack file in `dir`: a mirror `m` with metadata of files `a` and `b` (8 MiB each,
/// created by `size=`, unless `b_spec` says otherwise).
fn mirror_stack(dir: &Path, b_spec: &str) -> PathBuf {
    let text = format!(
        "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"8M\"\n\
             [device.b]\ntype = \"file\"\npath = \"{}\"\n{b_spec}\n\
             [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n",
        dir.join("a.img").display(),
        dir.join("b.img").display(),
    );
    let path = dir.join("stack.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs `cairn WORDS...`; asserts exit status 2 and one line on stderr, and returns
/// it.
#[track_caller]
fn refused(words: &[&str]) -> String {
    let out = run(Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(words)
        .env_remove("LISTEN_FDS"));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{words:?}: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{words:?}: one line: {stderr}");
    assert!(!stderr.contains("created"), "{words:?}: {stderr}");
    stderr
}

/// A port in use (for NBD, or for the metrics) refuses `cairn serve` of a mirror
/// with metadata whose 64 MiB member is still to be created: nothing is created and
/// no superblock written (before, the member was created and the array started, and
/// only then was the bind refused).
#[test]
fn a_port_in_use_refuses_before_a_member_is_created() {
    let dir = tmpdir();
    let d = dir.path();
    let stack = mirror_stack(d, "size = \"64M\"");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let tcp = format!("tcp:127.0.0.1:{port}");
    let sock = format!("unix:{}", d.join("nbd.sock").display());
    let stack = path_str(&stack);
    for words in [
        vec!["serve", "--listen", &tcp, stack],
        vec!["serve", "--listen", &sock, "--metrics", &tcp, stack],
    ] {
        let line = refused(&words);
        assert!(
            line.contains(&format!("{tcp}: ")) && line.contains("in use"),
            "{line}"
        );
        for f in ["a.img", "b.img", "nbd.sock"] {
            assert!(!d.join(f).exists(), "{words:?}: {f} was created: {line}");
        }
    }
    let line = refused(&["bench", "--size", "1M", "--metrics", &tcp, stack]);
    assert!(line.contains(&format!("--metrics {tcp}: ")), "{line}");
    assert!(!d.join("a.img").exists() && !d.join("b.img").exists());
}

/// 16 KiB of non-zero bytes (no superblock) followed by zeros, `len` bytes in all.
fn foreign(path: &Path, len: usize) -> Vec<u8> {
    let mut bytes = random_bytes(16 << 10, 0xf0e1);
    bytes.iter_mut().for_each(|b| *b |= 1);
    bytes.resize(len, 0);
    std::fs::write(path, &bytes).unwrap();
    bytes
}

/// A mirror with metadata of a new member and a foreign one (another program's data
/// where the superblocks go) is refused by `cairn serve` and `cairn bench`: the new
/// member's file is not created, and the foreign file is unchanged byte for byte, even
/// when `size=` would extend it (before, the new member was created first, and a
/// foreign file to extend was extended).
#[test]
fn a_foreign_member_refuses_before_the_new_one_is_created() {
    let dir = tmpdir();
    let d = dir.path();
    let b = d.join("b.img");
    let sock = format!("unix:{}", d.join("nbd.sock").display());
    for (len, b_spec) in [(8 << 20, ""), (2 << 20, "size = \"8M\"")] {
        let before = foreign(&b, len);
        let stack = mirror_stack(d, b_spec);
        let stack = path_str(&stack);
        for words in [
            vec!["serve", "--listen", &sock, stack],
            vec!["bench", "--size", "1M", stack],
        ] {
            let line = refused(&words);
            assert!(line.contains("'b'"), "{words:?} ({b_spec}): {line}");
            assert!(
                !d.join("a.img").exists(),
                "{words:?} ({b_spec}): a.img created"
            );
            assert!(!d.join("nbd.sock").exists(), "{words:?}: nbd.sock left");
            let after = std::fs::read(&b).unwrap();
            assert!(after == before, "{words:?} ({b_spec}): b.img changed");
        }
    }
}

/// An admin socket path another process listens on, or that holds a regular file or
/// a directory, refuses `cairn serve` and `cairn bench` before the members are
/// created; a stale socket there is replaced, and the start goes on.
#[test]
fn an_admin_path_in_use_refuses_before_members_are_created_and_a_stale_one_is_replaced() {
    let dir = tmpdir();
    let d = dir.path();
    let stack = mirror_stack(d, "size = \"8M\"");
    let stack = path_str(&stack);
    let ctl = d.join("admin.sock");
    let ctl_s = path_str(&ctl);
    let sock = format!("unix:{}", d.join("nbd.sock").display());
    let nothing_created = |what: &str| {
        for f in ["a.img", "b.img", "nbd.sock"] {
            assert!(!d.join(f).exists(), "{what}: {f} was created");
        }
    };
    let live = std::os::unix::net::UnixListener::bind(&ctl).unwrap();
    for words in [
        vec!["serve", "--listen", &sock, "--admin", ctl_s, stack],
        vec!["bench", "--size", "1M", "--admin", ctl_s, stack],
    ] {
        let line = refused(&words);
        assert_eq!(
            line,
            format!(
                "cairn: --admin {ctl_s}: another process is listening there (a running cairn?)\n"
            )
        );
        nothing_created("a live admin socket");
    }
    // Still the test's listener.
    let _c = UnixStream::connect(&ctl).expect("the live socket is left alone");
    live.accept().expect("and still answers");
    drop(live);

    std::fs::remove_file(&ctl).unwrap();
    std::fs::write(&ctl, b"keep").unwrap();
    let line = refused(&["serve", "--listen", &sock, "--admin", ctl_s, stack]);
    assert!(line.contains("a regular file is there"), "{line}");
    nothing_created("a regular file");
    assert_eq!(std::fs::read(&ctl).unwrap(), b"keep");
    std::fs::remove_file(&ctl).unwrap();
    std::fs::create_dir(&ctl).unwrap();
    let line = refused(&["bench", "--size", "1M", "--admin", ctl_s, stack]);
    assert!(line.contains("a directory is there"), "{line}");
    nothing_created("a directory");
    std::fs::remove_dir(&ctl).unwrap();

    // Stale (its server is gone): replaced, and the members are created.
    drop(std::os::unix::net::UnixListener::bind(&ctl).unwrap());
    let srv = Server::spawn(
        tmpdir(),
        d.join("nbd.sock"),
        &["--listen", &sock],
        &["--admin", ctl_s, stack],
    );
    assert!(
        srv.stderr().contains("replacing a stale socket"),
        "{}",
        srv.stderr()
    );
    assert!(d.join("a.img").exists() && d.join("b.img").exists());
    let out = super::admin::admin(&ctl, &["devices"]);
    assert!(success("admin devices", &out).starts_with("m\n"));
}
