//! Members of a running array changed by the admin socket under a verifying load: a
//! member failed, removed, a new device added in its place and rebuilt, another member
//! replaced by a new device (copied while the old one keeps working, then swapped in).
//! The load never sees an error or a mismatch, the members end up identical, and the
//! array assembles from the new members at the next start.
//!
//! Two loads: `cairn bench --verify crc32c --admin` (the array in the same process) and
//! fio's nbd engine with crc32c verify through `cairn serve --admin`.
//!
//! Nothing asserts on timing: each step waits (with a generous bound) for `status` to
//! show the state the next step needs, and the loads run until told to stop.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{skip, text, tmpdir, tool};

/// Longest any one step may take.
const STEP: Duration = Duration::from_secs(120);
/// Where data starts on a member (after the metadata area).
const DATA_OFFSET: usize = 1 << 20;

fn cairn() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_cairn"));
    c.env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE");
    c
}

/// `cairn admin SOCK WORDS...`: the reply, or a panic naming the command.
fn admin(sock: &Path, words: &[&str]) -> String {
    let out = cairn().arg("admin").arg(sock).args(words).output().unwrap();
    assert!(
        out.status.success(),
        "admin {words:?} failed: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Waits until `status` satisfies `done` (or the process `alive` says it ended).
fn wait_status(sock: &Path, what: &str, done: impl Fn(&str) -> bool, child: &mut Child) -> String {
    let began = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the process ended ({status}) while waiting for: {what}");
        }
        let out = cairn()
            .arg("admin")
            .arg(sock)
            .arg("status")
            .output()
            .unwrap();
        let s = text(&out.stdout);
        if out.status.success() && done(&s) {
            return s;
        }
        assert!(
            began.elapsed() < STEP,
            "no '{what}' in {STEP:?}; status:\n{s}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn wait_socket(path: &Path, child: &mut Child) {
    let began = Instant::now();
    while !path.exists() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "the process ended ({status}) before listening on {}",
                path.display()
            );
        }
        assert!(began.elapsed() < STEP, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A child process, killed if the test ends (or panics) before it is stopped.
struct Proc(Option<Child>);

impl Proc {
    fn spawn(cmd: &mut Command) -> Proc {
        Proc(Some(cmd.spawn().expect("start cairn")))
    }

    fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("running")
    }

    /// Sends `signal` and waits for the output.
    fn stop(mut self, signal: i32) -> Output {
        let child = self.0.take().expect("running");
        // SAFETY: signals our own child, which has not been waited for.
        unsafe { libc::kill(child.id() as i32, signal) };
        child.wait_with_output().unwrap()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `cairn bench --verify crc32c` of 4 KiB random reads and writes on `stack` at `iodepth`,
/// running until stopped, with its admin socket at `sock` (waited for).
fn verifying_bench(stack: &Path, sock: &Path, iodepth: u32) -> Proc {
    let mut bench = Proc::spawn(
        cairn()
            .args([
                "bench", "--rw", "randrw", "--verify", "crc32c", "--bs", "4k",
            ])
            .args(["--iodepth", &iodepth.to_string()])
            .args(["--time_based", "--runtime", "1h", "--admin"])
            .arg(sock)
            .arg(stack)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    wait_socket(sock, bench.child());
    bench
}

/// The array's layout in a stack file: a mirror of a and b, or a raid10 of a, b, e, f.
struct Array {
    kind: &'static str,
    members: &'static [&'static str],
}

const MIRROR: Array = Array {
    kind: "mirror",
    members: &["a", "b"],
};
const RAID10: Array = Array {
    kind: "raid10",
    members: &["a", "b", "e", "f"],
};

fn stack_text(dir: &Path, array: &Array, members: &[&str]) -> String {
    let mut t = String::new();
    for m in members {
        t += &format!(
            "[device.{m}]\ntype = \"file\"\npath = \"{}\"\nsize = \"33M\"\n",
            dir.join(format!("{m}.img")).display()
        );
    }
    let list: Vec<String> = members.iter().map(|m| format!("\"{m}\"")).collect();
    t += &format!(
        "[device.m]\ntype = \"{}\"\nmembers = [{}]\nmetadata = \"1\"\n\
         bitmap = \"1M\"\nbitmap_delay = \"100ms\"\nrebuild_min = \"16M\"\nrebuild_max = \"32M\"\n",
        array.kind,
        list.join(", ")
    );
    if array.kind == "raid10" {
        t += "chunk = \"64K\"\ncopies = 2\n";
    }
    t += "[export.m]\ndevice = \"m\"\n";
    t
}

/// Fails, removes, adds and replaces members of the array behind `sock`, each step once
/// the previous one shows in `status`. The member names the array ends with.
fn change_members(sock: &Path, dir: &Path, array: &Array, child: &mut Child) -> Vec<String> {
    let spec = |n: &str| format!("file:{},size=33M", dir.join(format!("{n}.img")).display());
    wait_status(sock, "the array", |s| s.contains("m: "), child);
    let out = admin(sock, &["fail", "m", "a"]);
    assert!(out.contains("failed; running degraded"), "{out}");
    let out = admin(sock, &["remove", "m", "a"]);
    assert!(out.contains("removed"), "{out}");
    wait_status(sock, "a missing", |s| s.contains("a missing"), child);
    let out = admin(sock, &["add", "m", &spec("c")]);
    assert!(out.contains("'c.img' added in place of 'a'"), "{out}");
    assert!(out.contains("members now: [\"c.img\""), "{out}");
    wait_status(
        sock,
        "c rebuilt",
        |s| s.contains("c.img active") && !s.contains("rebuild ") && !s.contains("degraded"),
        child,
    );
    let out = admin(sock, &["replace", "m", "b", &spec("d")]);
    assert!(out.contains("replacing 'b' by 'd.img'"), "{out}");
    // Replacing b never makes the array degraded; it ends with d in b's place, in the
    // array's lines and in the device tree (`status` reads the tree first: one reply may
    // catch the swap between the two, so both are waited for).
    wait_status(
        sock,
        "b replaced by d, and gone from the device tree",
        |s| {
            assert!(!s.contains("degraded"), "degraded during a replace:\n{s}");
            s.contains("d.img active") && !s.contains("replacing") && !s.contains(" b ")
        },
        child,
    );
    let mut names: Vec<String> = array.members.iter().map(|m| format!("{m}.img")).collect();
    names[0] = "c.img".into();
    names[1] = "d.img".into();
    names
}

/// Every pair of copies holds the same data: for a mirror every member, for raid10 (two
/// copies, four members) members 0-1 and 2-3.
fn copies_agree(dir: &Path, names: &[String]) {
    let data = |n: &str| {
        let b = std::fs::read(dir.join(n)).unwrap();
        b[DATA_OFFSET..].to_vec()
    };
    for pair in names.chunks(2) {
        let (x, y) = (data(&pair[0]), data(&pair[1]));
        let at = x.iter().zip(&y).position(|(p, q)| p != q);
        assert!(
            at.is_none(),
            "{} and {} differ at data byte {at:?}",
            pair[0],
            pair[1]
        );
    }
}

/// The next start, from a stack file naming the new members: assembled clean, every
/// member active.
fn assembles_from_new_members(dir: &Path, array: &Array, names: &[String]) {
    // The stack file the process was started from was kept in step: it names them.
    let kept = std::fs::read_to_string(dir.join("stack.toml")).unwrap();
    // Members added online are named after their files; the others keep their names.
    let list: Vec<String> = names
        .iter()
        .map(|n| match n.as_str() {
            "c.img" | "d.img" => format!("\"{n}\""),
            other => format!("\"{}\"", other.trim_end_matches(".img")),
        })
        .collect();
    assert!(
        kept.contains(&format!("members = [{}]", list.join(", "))),
        "{kept}"
    );
    let out = cairn()
        .arg("check")
        .arg(dir.join("stack.toml"))
        .output()
        .unwrap();
    let all = text(&out.stdout) + &text(&out.stderr);
    assert!(out.status.success(), "{all}");
    assert!(!all.contains("degraded"), "{all}");
    let members: Vec<&str> = names.iter().map(|n| n.trim_end_matches(".img")).collect();
    let path = dir.join("after.toml");
    std::fs::write(&path, stack_text(dir, array, &members)).unwrap();
    let out = cairn().arg("check").arg(&path).output().unwrap();
    let all = text(&out.stdout) + &text(&out.stderr);
    assert!(out.status.success(), "{all}");
    assert!(
        !all.contains("degraded") && !all.contains("not stopped cleanly"),
        "{all}"
    );
    assert!(all.contains("metadata 1"), "{all}");
}

fn bench_verify_under_member_changes(array: &Array) {
    let dir = tmpdir();
    let stack = dir.path().join("stack.toml");
    std::fs::write(&stack, stack_text(dir.path(), array, array.members)).unwrap();
    let sock = dir.path().join("admin.sock");
    let mut bench = verifying_bench(&stack, &sock, 16);
    let names = change_members(&sock, dir.path(), array, bench.child());
    let out = bench.stop(libc::SIGINT);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(!stdout.contains("error"), "{stdout}");
    let checked: u64 = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("verify       : "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(checked > 0, "no block was read back and checked:\n{stdout}");
    assert!(stderr.contains("replace done"), "{stderr}");
    copies_agree(dir.path(), &names);
    assembles_from_new_members(dir.path(), array, &names);
}

/// `cairn bench --verify` on a mirror keeps checking every block it reads back while a
/// member is failed, removed, replaced by a new device that is rebuilt, and another is
/// replaced while it works: zero errors, zero mismatches.
#[test]
fn bench_verify_on_a_mirror_while_members_are_failed_removed_added_and_replaced() {
    bench_verify_under_member_changes(&MIRROR);
}

/// The same on a raid10 of four members with two copies.
#[test]
fn bench_verify_on_raid10_while_members_are_failed_removed_added_and_replaced() {
    bench_verify_under_member_changes(&RAID10);
}

/// fio's nbd engine with crc32c verify through `cairn serve`, rerun until the member
/// changes are done: every run ends with zero errors and zero verify failures.
#[test]
fn fio_nbd_verify_on_a_mirror_while_members_are_failed_removed_added_and_replaced() {
    const NAME: &str = "fio_nbd_verify_on_a_mirror_while_members_are_changed";
    let Some(fio) = tool("fio") else {
        skip(NAME, "fio is not installed");
        return;
    };
    let dir = tmpdir();
    let stack = dir.path().join("stack.toml");
    std::fs::write(&stack, stack_text(dir.path(), &MIRROR, MIRROR.members)).unwrap();
    let (sock, nbd) = (dir.path().join("admin.sock"), dir.path().join("nbd.sock"));
    let mut srv = Proc::spawn(
        cairn()
            .arg("serve")
            .arg("--listen")
            .arg(format!("unix:{}", nbd.display()))
            .arg("--admin")
            .arg(&sock)
            .arg(&stack)
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    wait_socket(&sock, srv.child());
    wait_socket(&nbd, srv.child());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (stop, uri, dir) = (
            stop.clone(),
            format!("nbd+unix:///m?socket={}", nbd.display()),
            dir.path().to_path_buf(),
        );
        std::thread::spawn(move || {
            let mut runs = 0u32;
            // At least one whole run after the changes are done.
            loop {
                let last = stop.load(std::sync::atomic::Ordering::SeqCst);
                let out = Command::new(&fio)
                    .current_dir(&dir)
                    .args([
                        "--name=verify",
                        "--ioengine=nbd",
                        &format!("--uri={uri}"),
                        "--rw=randwrite",
                        "--bs=4k",
                        "--size=16M",
                        &format!("--offset={}M", (runs % 2) * 16),
                        "--iodepth=16",
                        "--verify=crc32c",
                        "--do_verify=1",
                        "--verify_fatal=1",
                        "--verify_state_save=0",
                        "--output-format=terse",
                    ])
                    .output()
                    .unwrap();
                runs += 1;
                if !out.status.success() {
                    return Err(format!(
                        "fio run {runs} failed: {}{}",
                        text(&out.stdout),
                        text(&out.stderr)
                    ));
                }
                if last {
                    return Ok(runs);
                }
            }
        })
    };
    let names = change_members(&sock, dir.path(), &MIRROR, srv.child());
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let runs = load.join().unwrap().unwrap();
    assert!(runs >= 2, "fio ran {runs} times");
    let out = srv.stop(libc::SIGTERM);
    let log = text(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("replace done"), "{log}");
    copies_agree(dir.path(), &names);
    assembles_from_new_members(dir.path(), &MIRROR, &names);
}

/// Serves the mirror of `stack` with an admin socket and a Unix NBD socket in `dir`.
fn serve(dir: &Path, stack: &Path) -> Proc {
    let mut srv = Proc::spawn(
        cairn()
            .arg("serve")
            .arg("--listen")
            .arg(format!("unix:{}", dir.join("nbd.sock").display()))
            .arg("--admin")
            .arg(dir.join("admin.sock"))
            .arg(stack)
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    wait_socket(&dir.join("admin.sock"), srv.child());
    wait_socket(&dir.join("nbd.sock"), srv.child());
    srv
}

/// `replace m OLD file:NEW.img` and waits until NEW took OLD's place.
fn replace(dir: &Path, old: &str, new: &str, child: &mut Child) -> String {
    let spec = format!("file:{},size=33M", dir.join(format!("{new}.img")).display());
    let out = admin(&dir.join("admin.sock"), &["replace", "m", old, &spec]);
    wait_status(
        &dir.join("admin.sock"),
        "the replace done",
        |s| s.contains(&format!("{new}.img active")) && !s.contains("replacing"),
        child,
    );
    out
}

/// A restart after replacing every member: both members of a mirror replaced online,
/// writes, a clean stop, and `cairn serve` again with the stack file it was started from.
/// The file was updated in place, so the array starts on the new members and serves the
/// writes made after the replaces; the old members, listed again, are refused.
#[test]
fn a_restart_after_replaces_starts_on_the_members_now() {
    const NAME: &str = "a_restart_after_replaces_starts_on_the_members_now";
    let Some(qemu_io) = tool("qemu-io") else {
        skip(NAME, "qemu-io is not installed");
        return;
    };
    let dir = tmpdir();
    let stack = dir.path().join("stack.toml");
    // At the defaults: no metadata key.
    let original =
        stack_text(dir.path(), &MIRROR, MIRROR.members).replace("metadata = \"1\"\n", "");
    std::fs::write(&stack, &original).unwrap();
    let uri = format!(
        "nbd+unix:///m?socket={}",
        dir.path().join("nbd.sock").display()
    );
    let io = |cmd: &str| {
        let out = Command::new(&qemu_io)
            .args(["-f", "raw", &uri, "-c", cmd])
            .output()
            .unwrap();
        let all = text(&out.stdout) + &text(&out.stderr);
        assert!(
            out.status.success() && !all.contains("fail"),
            "qemu-io {cmd}: {all}"
        );
    };
    let mut srv = serve(dir.path(), &stack);
    io("write -P 0x11 0 4M");
    let reply = replace(dir.path(), "a", "c", srv.child());
    assert!(
        reply.contains("when the replace ends, stack file"),
        "{reply}"
    );
    replace(dir.path(), "b", "d", srv.child());
    io("write -P 0x22 0 4M");
    let status = wait_status(
        &dir.path().join("admin.sock"),
        "the stack file in step",
        |s| s.contains("in step with the arrays"),
        srv.child(),
    );
    assert!(!status.contains("no longer matches"), "{status}");
    let out = srv.stop(libc::SIGTERM);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let kept = std::fs::read_to_string(&stack).unwrap();
    assert!(kept.contains("members = [\"c.img\", \"d.img\"]"), "{kept}");
    // Started again from the same file: the new members, clean, the last writes.
    let srv = serve(dir.path(), &stack);
    io("read -P 0x22 0 4M");
    let out = srv.stop(libc::SIGTERM);
    let log = text(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(
        !log.contains("not stopped cleanly")
            && !log.contains("behind")
            && !log.contains("degraded"),
        "{log}"
    );
    // The old members, listed again: refused, naming the member.
    std::fs::write(dir.path().join("old.toml"), &original).unwrap();
    let out = cairn()
        .arg("check")
        .arg(dir.path().join("old.toml"))
        .output()
        .unwrap();
    let all = text(&out.stderr);
    assert!(!out.status.success(), "the old members were taken");
    assert!(
        all.contains("member 'a' was taken out of the array"),
        "{all}"
    );
}

/// A spare added online is written into the stack file (`spares`, and a table for it)
/// and carries a spare's superblock, so a restart from the file has it as a spare again,
/// and it takes the place of the next member that fails. (Was: spares were forgotten at
/// a restart.)
#[test]
fn a_spare_added_online_is_a_spare_again_after_a_restart() {
    let dir = tmpdir();
    let stack = dir.path().join("stack.toml");
    std::fs::write(&stack, stack_text(dir.path(), &MIRROR, MIRROR.members)).unwrap();
    let sock = dir.path().join("admin.sock");
    let srv = serve(dir.path(), &stack);
    let spec = format!("file:{},size=33M", dir.path().join("s.img").display());
    let out = admin(&sock, &["add", "m", &spec]);
    assert!(out.contains("added as a spare"), "{out}");
    let out = srv.stop(libc::SIGTERM);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let kept = std::fs::read_to_string(&stack).unwrap();
    assert!(kept.contains("spares = [\"s.img\"]"), "{kept}");
    assert!(kept.contains("[device.\"s.img\"]"), "{kept}");
    let mut srv = serve(dir.path(), &stack);
    let status = admin(&sock, &["status"]);
    assert!(status.contains("spares: s.img"), "{status}");
    let out = admin(&sock, &["fail", "m", "a"]);
    assert!(out.contains("failed"), "{out}");
    wait_status(
        &sock,
        "the spare in a's place, rebuilt",
        |s| s.contains("[UU] s.img active, b active"),
        srv.child(),
    );
    wait_status(
        &sock,
        "the stack file in step",
        |s| s.contains("in step with the arrays"),
        srv.child(),
    );
    let out = srv.stop(libc::SIGTERM);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let kept = std::fs::read_to_string(&stack).unwrap();
    assert!(
        kept.contains("members = [\"s.img\", \"b\"]") && !kept.contains("spares ="),
        "{kept}"
    );
    copies_agree(dir.path(), &["s.img".into(), "b.img".into()]);
}

/// A stack file the server cannot write is left as it is; the reply and `status` say
/// what no longer matches, and the next start from it is refused (never served stale).
#[test]
fn a_stack_file_that_cannot_be_written_is_reported() {
    let dir = tmpdir();
    let stack = dir.path().join("stack.toml");
    let original = stack_text(dir.path(), &MIRROR, MIRROR.members);
    std::fs::write(&stack, &original).unwrap();
    let mut p = std::fs::metadata(&stack).unwrap().permissions();
    p.set_readonly(true);
    std::fs::set_permissions(&stack, p).unwrap();
    let mut srv = serve(dir.path(), &stack);
    replace(dir.path(), "a", "c", srv.child());
    let status = wait_status(
        &dir.path().join("admin.sock"),
        "the stack file reported",
        |s| s.contains("no longer matches"),
        srv.child(),
    );
    assert!(
        status.contains("[device.m] members = [\"c.img\", \"b\"] (was [\"a\", \"b\"])"),
        "{status}"
    );
    let out = cairn()
        .arg("admin")
        .arg(dir.path().join("admin.sock"))
        .args(["status", "--json"])
        .output()
        .unwrap();
    let json = text(&out.stdout);
    assert!(json.contains("\"in_step\":false"), "{json}");
    let out = srv.stop(libc::SIGTERM);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(std::fs::read_to_string(&stack).unwrap(), original);
    let out = cairn()
        .arg("serve")
        .arg("--listen")
        .arg(format!("unix:{}", dir.path().join("nbd2.sock").display()))
        .arg(&stack)
        .output()
        .unwrap();
    let log = text(&out.stderr);
    assert!(
        !out.status.success(),
        "started from a stale stack file:\n{log}"
    );
    assert!(
        log.contains("member 'a' was taken out of the array"),
        "{log}"
    );
}

/// `add` (as a spare here: the array is whole) and `replace` refuse what cannot be a
/// member, each with its reason, and change nothing: the array stays as it was under its
/// verifying load, and a file that holds data keeps it.
#[test]
fn add_and_replace_refuse_bad_devices_and_change_nothing() {
    let dir = tmpdir();
    let d = dir.path();
    // Another array's member: made by a short run on its own stack file.
    let other = d.join("other.toml");
    std::fs::write(
        &other,
        format!(
            "[device.x]\ntype = \"file\"\npath = \"{0}/x.img\"\nsize = \"33M\"\n\
             [device.y]\ntype = \"file\"\npath = \"{0}/y.img\"\nsize = \"33M\"\n\
             [device.o]\ntype = \"mirror\"\nmembers = [\"x\", \"y\"]\nmetadata = \"1\"\n",
            d.display()
        ),
    )
    .unwrap();
    let out = cairn()
        .args(["bench", "--rw", "write", "--size", "1M"])
        .arg(&other)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    // A file that holds someone's data.
    let mut junk = b"precious data".to_vec();
    junk.resize(40 << 20, 7);
    std::fs::write(d.join("junk.img"), &junk).unwrap();
    let other_member = std::fs::read(d.join("x.img")).unwrap();
    let stack = d.join("stack.toml");
    std::fs::write(&stack, stack_text(d, &MIRROR, MIRROR.members)).unwrap();
    let sock = d.join("admin.sock");
    let mut bench = verifying_bench(&stack, &sock, 8);
    let before = wait_status(&sock, "the array", |s| s.contains("[UU]"), bench.child());
    let file = |n: &str| format!("file:{}", d.join(n).display());
    let big = |n: &str| format!("file:{},size=33M", d.join(n).display());
    for (words, why) in [
        (
            vec!["add", "m", "null:64M"],
            "does not keep what is written",
        ),
        (
            vec!["add", "m", &file("junk.img")],
            "holds data but no superblock",
        ),
        (
            vec!["replace", "m", "zz", &big("c.img")],
            "has no member 'zz'",
        ),
        (
            vec!["replace", "m", "a", &file("b.img")],
            "in use by this cairn",
        ),
        (
            vec!["replace", "m", "a", &file("nothing.img")],
            "no such file",
        ),
        (vec!["replace", "m", "a", "mem:8M"], "needs at least"),
        (
            vec!["replace", "m", "a", &file("junk.img")],
            "holds data but no superblock",
        ),
        (
            vec!["replace", "m", "a", &file("x.img")],
            "member of another array ('o'",
        ),
        (
            vec!["replace", "m", "a", "null:64M"],
            "does not keep what is written",
        ),
        (vec!["replace", "m", "a", "bogus:1"], "'bogus:1'"),
        (vec!["replace", "m", "a"], "usage: replace ARRAY OLD SPEC"),
        (vec!["add", "nope", "mem:64M"], "no device 'nope'"),
    ] {
        let out = cairn()
            .arg("admin")
            .arg(&sock)
            .args(&words)
            .output()
            .unwrap();
        let all = text(&out.stdout) + &text(&out.stderr);
        assert!(!out.status.success(), "{words:?} succeeded: {all}");
        assert!(all.contains(why), "{words:?}: {all}");
    }
    let after = admin(&sock, &["status"]);
    // The tree and the array are as they were (the bitmap's count may move with the load).
    let same = |s: &str| -> Vec<String> {
        s.lines()
            .filter(|l| !l.trim_start().starts_with("bitmap:"))
            .map(str::to_string)
            .collect()
    };
    assert_eq!(same(&before), same(&after));
    assert!(!after.contains("rebuild "), "{after}");
    assert_eq!(std::fs::read(d.join("junk.img")).unwrap(), junk);
    // Not even for a moment: another array's member is refused before any write.
    assert!(std::fs::read(d.join("x.img")).unwrap() == other_member);
    assert!(!d.join("nothing.img").exists());
    let out = bench.stop(libc::SIGINT);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(!stdout.contains("error"), "{stdout}");
}

/// A spare added to a whole array waits; when a member fails under the load (a `fault`
/// device failing its writes), the spare takes its place and is rebuilt online, and the
/// verifying load never sees an error. A second spare waits for the next failure.
#[test]
fn a_spare_takes_the_place_of_a_member_that_fails_under_load() {
    let dir = tmpdir();
    let d = dir.path();
    let file = |n: &str| {
        format!(
            "[device.{n}]\ntype = \"file\"\npath = \"{}\"\nsize = \"33M\"\n",
            d.join(format!("{n}.img")).display()
        )
    };
    let stack = d.join("stack.toml");
    std::fs::write(
        &stack,
        file("a")
            + &file("b")
            + "[device.fa]\ntype = \"fault\"\nbase = \"a\"\nfail = [\"write\"]\nafter_ios = 40000\n\
               [device.m]\ntype = \"mirror\"\nmembers = [\"fa\", \"b\"]\nmetadata = \"1\"\n\
               bitmap = \"1M\"\nrebuild_min = \"16M\"\n",
    )
    .unwrap();
    let sock = d.join("admin.sock");
    let mut bench = verifying_bench(&stack, &sock, 8);
    let spec = |n: &str| format!("file:{},size=33M", d.join(n).display());
    // Whether fa has failed yet or not, s1 ends up in its place.
    let out = admin(&sock, &["add", "m", &spec("s1.img")]);
    assert!(
        out.contains("added as a spare") || out.contains("added in place of 'fa'"),
        "{out}"
    );
    let s = wait_status(
        &sock,
        "s1 in fa's place, rebuilt",
        |s| s.contains("[UU] s1.img active, b active"),
        bench.child(),
    );
    assert!(!s.contains("spares:"), "{s}");
    let out = admin(&sock, &["add", "m", &spec("s2.img")]);
    assert!(out.contains("added as a spare"), "{out}");
    let s = admin(&sock, &["status"]);
    assert!(s.contains("spares: s2.img"), "{s}");
    // The next failure takes it.
    let out = admin(&sock, &["fail", "m", "b"]);
    assert!(out.contains("failed"), "{out}");
    wait_status(
        &sock,
        "s2 in b's place, rebuilt",
        |s| s.contains("[UU] s1.img active, s2.img active"),
        bench.child(),
    );
    let out = bench.stop(libc::SIGINT);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(!stdout.contains("error"), "{stdout}");
    assert!(stderr.contains("member 'fa' failed"), "{stderr}");
    assert!(
        stderr.contains("'s1.img' added in place of 'fa'"),
        "{stderr}"
    );
    copies_agree(d, &["s1.img".into(), "s2.img".into()]);
}

/// SIGUSR1 and SIGUSR2 make `cairn bench` log a status (the device tree and the array's
/// lines, as `cairn serve` does) and the job goes on; SIGINT then ends it with its
/// report and the signal named. (SIGUSR1 killed bench, with no report.)
#[test]
fn bench_logs_a_status_on_sigusr1_and_goes_on() {
    let dir = tmpdir();
    let stack = dir.path().join("stack.toml");
    std::fs::write(
        &stack,
        "[device.a]\ntype = \"mem\"\nsize = \"16M\"\n\
         [device.b]\ntype = \"mem\"\nsize = \"16M\"\n\
         [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\n",
    )
    .unwrap();
    let sock = dir.path().join("admin.sock");
    let mut bench = verifying_bench(&stack, &sock, 4);
    for signal in [libc::SIGUSR1, libc::SIGUSR2] {
        // SAFETY: signals our own child, which has not been waited for.
        unsafe { libc::kill(bench.child().id() as i32, signal) };
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            bench.child().try_wait().unwrap().is_none(),
            "bench ended on signal {signal}"
        );
    }
    let out = bench.stop(libc::SIGINT);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("verify"), "no report:\n{stdout}");
    let status: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("cairn: bench: status: "))
        .collect();
    assert!(
        status
            .iter()
            .filter(|l| l.contains("m: mirror of 2 members"))
            .count()
            == 2,
        "{stderr}"
    );
    assert!(status.iter().any(|l| l.contains("[UU]")), "{stderr}");
    assert!(stderr.contains("bench: SIGINT received"), "{stderr}");
}
