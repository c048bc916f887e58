use super::admin::admin;
use super::*;

/// Reads every 4 KiB block of the export `CAIRN_READS` times in a row on one
/// connection (a mirror or raid10 takes its copies in turn, one request each, so every
/// copy is read), and fails if a block reads differently from one read to the next,
/// or, with `CAIRN_WANT` (a file of the export's size), anything but that file's bytes.
/// `CAIRN_OLD` (the data before) only names what a wrong read returned.
const CHECK: &str = r#"
import os
import nbd

what = os.environ["CAIRN_WHAT"]
reads = int(os.environ["CAIRN_READS"])

def load(var):
    path = os.environ.get(var)
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()

want, old = load("CAIRN_WANT"), load("CAIRN_OLD")
h = nbd.NBD()
h.connect_unix(os.environ["CAIRN_SOCK"])
size = h.get_size()
if want is not None and len(want) != size:
    raise SystemExit(f"{what}: the export holds {size} bytes, the data {len(want)}")
BS = 4096
zeros = bytes(BS)
blocks = size // BS
wrong = 0
unstable = 0
kinds = {"the old data": 0, "zeros": 0, "something else": 0}
examples = []
for i in range(blocks):
    at = i * BS
    got = [h.pread(BS, at) for _ in range(reads)]
    differ = any(g != got[0] for g in got)
    unstable += differ
    bad = []
    if want is not None:
        w = want[at:at + BS]
        bad = [k for k, g in enumerate(got) if g != w]
        for k in bad:
            g = got[k]
            if old is not None and g == old[at:at + BS]:
                kinds["the old data"] += 1
            elif g == zeros:
                kinds["zeros"] += 1
            else:
                kinds["something else"] += 1
    wrong += bool(bad)
    if (bad or differ) and len(examples) < 5:
        examples.append(f"block {i} (offset {at}): wrong reads {bad} of {reads}, "
                        f"{len({bytes(g) for g in got})} different contents")
h.shutdown()
kind = ", ".join(f"{n} {k}" for k, n in kinds.items() if n)
print(f"{what}: {blocks} blocks of 4 KiB, each read {reads} times in a row: "
      f"{wrong} blocks read wrong ({kind or 'none'}), "
      f"{unstable} blocks read differently from one read to the next")
for e in examples:
    print("  e.g.", e)
print("checked")
raise SystemExit(1 if wrong or unstable else 0)
"#;

/// Random 4 KiB writes of random bytes all over the export, 64 in flight at all
/// times; once `CAIRN_KILL_AFTER` of them are done, 64 more are sent (libnbd sends
/// from inside its calls: it is polled until it has nothing left to write), and 5 ms
/// later the server (`CAIRN_SERVER_PID`) gets SIGKILL. A write that fails before
/// fails the script.
const HAMMER: &str = r#"
import os
import random
import signal
import time
import nbd

DEPTH = 64
BS = 4096
pid = int(os.environ["CAIRN_SERVER_PID"])
kill_after = int(os.environ["CAIRN_KILL_AFTER"])
h = nbd.NBD()
h.connect_unix(os.environ["CAIRN_SOCK"])
blocks = h.get_size() // BS
rng = random.Random(32)
pending = []
done = 0

def retire():
    global pending, done
    still = []
    for cookie in pending:
        # Raises if the write failed.
        if h.aio_command_completed(cookie):
            done += 1
        else:
            still.append(cookie)
    pending = still

while True:
    while len(pending) < DEPTH:
        pending.append(h.aio_pwrite(rng.randbytes(BS), rng.randrange(blocks) * BS))
    if done >= kill_after:
        break
    h.poll(-1)
    retire()
# The last 64 sent whole, then the kill, once member a has taken them and b (20 ms a
# write) has not.
while h.aio_get_direction() & nbd.AIO_DIRECTION_WRITE:
    h.poll(-1)
retire()
time.sleep(0.005)
os.kill(pid, signal.SIGKILL)
print(f"SIGKILL after {done} writes, {len(pending)} in flight: killed")
"#;

/// Reads of each block in a row: a mirror's two copies twice each.
const READS: &str = "4";

/// The arrays' keys besides `type` and `members` (none of them `metadata`, nor
/// `bitmap`: those are at their defaults): rebuilds and resyncs of the 16 MiB of data
/// take 2 to 4 s, so that most of the first reads of a restart land while one runs.
const PACE: &str = "rebuild_min = \"4M\"\nrebuild_max = \"8M\"\n";

/// Every block of `srv`'s export read `READS` times: the same each time, and
/// `want`'s bytes when given (`old`: the data before, to name what a wrong read got).
#[track_caller]
fn check_reads(python: &Path, srv: &Server, want: Option<&Path>, old: Option<&Path>, what: &str) {
    let mut env = vec![
        ("CAIRN_WHAT", what.to_string()),
        ("CAIRN_READS", READS.to_string()),
    ];
    for (var, file) in [("CAIRN_WANT", want), ("CAIRN_OLD", old)] {
        if let Some(f) = file {
            env.push((var, path_str(f).to_string()));
        }
    }
    libnbd_script(python, CHECK, &srv.sock, &env, "checked");
}

/// The export's size in bytes.
fn export_size(srv: &Server) -> u64 {
    let (mut c, size, _) = Raw::go(&srv.sock, "");
    c.disconnect();
    size
}

/// `size` random bytes (from `seed`) in the file `path`.
fn data_file(path: &Path, size: u64, seed: u64) -> PathBuf {
    std::fs::write(path, random_bytes(size as usize, seed)).unwrap();
    path.to_path_buf()
}

/// nbdcopy of `data` into the whole export, flushed.
#[track_caller]
fn copy_in(nbdcopy: &Path, srv: &Server, data: &Path) {
    success(
        "nbdcopy into the export",
        &run(Command::new(nbdcopy).args(["--flush", path_str(data), &srv.uri()])),
    );
}

/// SIGTERM, a successful exit; the log.
#[track_caller]
fn stop_clean(srv: &mut Server) -> String {
    let (status, log) = srv.stop();
    assert!(status.success(), "exit status {status}; stderr:\n{log}");
    log
}

/// Polls `status` on the admin socket `ctl` until it contains `done`.
#[track_caller]
fn wait_status(ctl: &Path, done: &str, srv: &Server) {
    let t = Instant::now();
    loop {
        let out = success("admin status", &admin(ctl, &["status"]));
        if out.contains(done) {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no '{done}' in status after 60 s:\n{out}\nstderr:\n{}",
            srv.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Asserts that the member files `a` and `b` hold the same bytes from `data_offset`
/// on (each copy's data area), counting the 4 KiB blocks that differ and naming the
/// first.
#[track_caller]
fn copies_agree(a: &Path, b: &Path, data_offset: usize, what: &str) {
    let (da, db) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert_eq!(da.len(), db.len(), "{what}: the members' sizes differ");
    let (da, db) = (&da[data_offset..], &db[data_offset..]);
    let differ: Vec<usize> = da
        .chunks(4096)
        .zip(db.chunks(4096))
        .enumerate()
        .filter(|(_, (x, y))| x != y)
        .map(|(i, _)| i)
        .collect();
    assert!(
        differ.is_empty(),
        "{what}: {} blocks of 4 KiB differ between {} and {} past offset {data_offset} \
             (the first: data block {})",
        differ.len(),
        a.display(),
        b.display(),
        differ[0]
    );
}

/// A member fails writes while the client writes new data over the whole export;
/// stopped cleanly and started again with the member healthy (its file as the failure
/// left it: old data), every block reads the new data, on every read, and once the
/// member is rebuilt too. With the raw layout (the old default) nothing recorded the
/// failure: the stale member was read as current, every other read returning the old
/// data. A mirror of two files, its member failing data writes only (its superblock
/// writes pass: the failure comes mid-write), and a raid10 of four, its member failing
/// every write (its superblock too, at the start).
#[test]
fn a_member_that_failed_writes_is_never_read_after_a_restart() {
    const NAME: &str = "array_defaults::a_member_that_failed_writes_is_never_read_after_a_restart";
    let Some([nbdcopy]) = tools(NAME, ["nbdcopy"]) else {
        return;
    };
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    struct Case {
        level: &'static str,
        members: usize,
        member_bytes: u64,
        /// The member under the fault.
        faulty: usize,
        /// The member holding the same data as the faulty one (raid10's near layout
        /// puts a chunk's two copies on neighbouring members).
        partner: usize,
        /// The fault device's keys.
        fault: &'static str,
        /// The array's keys besides `type` and `members`.
        extra: &'static str,
    }
    let cases = [
        Case {
            level: "mirror",
            members: 2,
            member_bytes: 17 << 20,
            faulty: 1,
            partner: 0,
            // The data area only: every sector from 1 MiB on.
            fault: "fail = [\"write\"]\nsectors = [2048, 34816]\n",
            extra: "",
        },
        Case {
            level: "raid10",
            members: 4,
            member_bytes: 9 << 20,
            faulty: 3,
            partner: 2,
            fault: "fail = [\"write\"]\n",
            extra: "chunk = \"64K\"\ncopies = 2\n",
        },
    ];
    for case in cases {
        let level = case.level;
        let dir = tmpdir();
        let ctl = dir.path().join("admin.sock");
        let files: Vec<PathBuf> = (0..case.members)
            .map(|i| dir.path().join(format!("d{i}.img")))
            .collect();
        let mut leaves = String::new();
        for (i, f) in files.iter().enumerate() {
            leaves += &format!(
                "[device.d{i}]\ntype = \"file\"\npath = \"{}\"\nsize = \"{}\"\n",
                f.display(),
                case.member_bytes
            );
        }
        let array = |faulty_name: &str| {
            let names: Vec<String> = (0..case.members)
                .map(|i| {
                    if i == case.faulty {
                        format!("\"{faulty_name}\"")
                    } else {
                        format!("\"d{i}\"")
                    }
                })
                .collect();
            format!(
                "[device.r]\ntype = \"{level}\"\nmembers = [{}]\n{}{PACE}",
                names.join(", "),
                case.extra
            )
        };
        let healthy = dir.path().join("healthy.toml");
        std::fs::write(
            &healthy,
            format!("{leaves}{}", array(&format!("d{}", case.faulty))),
        )
        .unwrap();
        let faulty = dir.path().join("faulty.toml");
        std::fs::write(
            &faulty,
            format!(
                "{leaves}[device.f]\ntype = \"fault\"\nbase = \"d{}\"\n{}{}",
                case.faulty,
                case.fault,
                array("f")
            ),
        )
        .unwrap();

        // The old data, on every member.
        let mut srv = Server::start_in(tmpdir(), &[path_str(&healthy)]);
        let size = export_size(&srv);
        let old = data_file(&dir.path().join("old.bin"), size, 1);
        let new = data_file(&dir.path().join("new.bin"), size, 2);
        copy_in(&nbdcopy, &srv, &old);
        stop_clean(&mut srv);

        // The new data, while the member fails writes (`fault` above).
        let mut srv = Server::start_in(tmpdir(), &[path_str(&faulty)]);
        copy_in(&nbdcopy, &srv, &new);
        let log = stop_clean(&mut srv);
        // (Named `'f'` when its superblock write failed, `f` when a data write did.)
        assert!(
            log.replace('\'', "").contains("member f failed"),
            "{level}: {log}"
        );

        // Healthy again, with its old data: never read until rebuilt.
        let mut srv = Server::start_in(tmpdir(), &[path_str(&healthy), "--admin", path_str(&ctl)]);
        let what = format!("{level}, started again with the stale member");
        check_reads(&python, &srv, Some(&new), Some(&old), &what);
        // Known as the member that missed writes (`is back`, with the bitmap's regions
        // to copy), not as a blank one.
        let log = srv.stderr();
        let back = format!("member 'd{}' is back (events ", case.faulty);
        assert!(log.contains(&back), "{level}: {log}");
        wait_status(&ctl, &format!("[{}]", "U".repeat(case.members)), &srv);
        let what = format!("{level}, the stale member rebuilt");
        check_reads(&python, &srv, Some(&new), Some(&old), &what);
        let log = stop_clean(&mut srv);
        // Each member holds its share of the two copies, after its metadata area.
        let data_offset = case.member_bytes - size * 2 / case.members as u64;
        copies_agree(
            &files[case.partner],
            &files[case.faulty],
            data_offset as usize,
            &format!("{level}, after the rebuild:\n{log}"),
        );
    }
}

/// SIGKILL while a client has 64 random writes in flight; started again, every
/// block reads the same bytes each time (a mirror reads one copy until its resync is
/// done), and after the resync the two copies are the same. With the raw layout (the
/// old default) nothing knew the stop was unclean: the copies stayed different where
/// writes had reached one member and not the other, and such blocks changed from one
/// read to the next. Member b sits under a `delay` device (20 ms a write), a slower
/// disk, so that the kill lands with the writes in flight done on a and not on b.
/// (Without it, on files in /dev/shm, the old code's copies came out the same in the
/// run tried; with 2 ms, and the kill as soon as 64 writes were queued in libnbd, in
/// 1 run of 7. This way 16 to 53 blocks differed, in 8 runs of 8.)
#[test]
fn kill_9_under_writes_then_the_copies_agree_and_reads_are_stable() {
    const NAME: &str =
        "array_defaults::kill_9_under_writes_then_the_copies_agree_and_reads_are_stable";
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let stack = write_stack(
        &dir,
        &format!(
            "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.slow]\ntype = \"delay\"\nbase = \"b\"\nwrite = \"20ms\"\n\
                 [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"slow\"]\n{PACE}",
            a.display(),
            b.display()
        ),
    );
    let mut srv = Server::start_in(tmpdir(), &[path_str(&stack)]);
    let size = export_size(&srv);
    let pid = srv.child.as_ref().expect("running").id();
    libnbd_script(
        &python,
        HAMMER,
        &srv.sock,
        &[
            ("CAIRN_SERVER_PID", pid.to_string()),
            ("CAIRN_KILL_AFTER", "2000".to_string()),
        ],
        "killed",
    );
    let (status, log) = srv.wait_exit();
    assert!(!status.success(), "killed, yet {status}:\n{log}");

    let mut srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    check_reads(&python, &srv, None, None, "started again after SIGKILL");
    assert!(
        srv.wait_for_stderr(" done: ", Duration::from_secs(60)),
        "no resync:\n{}",
        srv.stderr()
    );
    wait_status(&ctl, "[UU]", &srv);
    check_reads(&python, &srv, None, None, "resynced");
    let log = stop_clean(&mut srv);
    assert!(log.contains("resync of"), "{log}");
    let data_offset = std::fs::metadata(&a).unwrap().len() - size;
    copies_agree(
        &a,
        &b,
        data_offset as usize,
        &format!("after the resync:\n{log}"),
    );
}

/// A member's file replaced by a blank one (sparse, all zeros, the same size) while
/// the server is stopped: started again, it is a new member, rebuilt from the other,
/// and never read before: every block reads the data, each time, and after the
/// rebuild both files hold it. With the raw layout (the old default) the blank file
/// was served as data: every other read returned zeros.
#[test]
fn a_blank_file_in_place_of_a_member_is_rebuilt_not_read() {
    const NAME: &str = "array_defaults::a_blank_file_in_place_of_a_member_is_rebuilt_not_read";
    let Some([nbdcopy]) = tools(NAME, ["nbdcopy"]) else {
        return;
    };
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let stack = write_stack(
        &dir,
        &format!(
            "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\n{PACE}",
            a.display(),
            b.display()
        ),
    );
    let args = [path_str(&stack), "--admin", path_str(&ctl)];
    let mut srv = Server::start_in(tmpdir(), &args);
    let size = export_size(&srv);
    let data = data_file(&dir.path().join("data.bin"), size, 3);
    copy_in(&nbdcopy, &srv, &data);
    stop_clean(&mut srv);

    let member_bytes = std::fs::metadata(&b).unwrap().len();
    std::fs::remove_file(&b).unwrap();
    std::fs::File::create(&b)
        .and_then(|f| f.set_len(member_bytes))
        .unwrap();

    let mut srv = Server::start_in(tmpdir(), &args);
    check_reads(
        &python,
        &srv,
        Some(&data),
        None,
        "started with a blank member",
    );
    wait_status(&ctl, "[UU]", &srv);
    check_reads(&python, &srv, Some(&data), None, "the blank member rebuilt");
    let log = stop_clean(&mut srv);
    assert!(log.contains("is blank"), "{log}");
    let data_offset = (member_bytes - size) as usize;
    copies_agree(&a, &b, data_offset, &format!("after the rebuild:\n{log}"));
    let held = std::fs::read(&b).unwrap();
    assert_same(
        "the rebuilt member's data area",
        &held[data_offset..],
        &std::fs::read(&data).unwrap(),
    );
}
