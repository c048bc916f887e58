//! Arrays with superblocks on their members (`metadata = "1"`): created on blank members,
//! assembled from them afterwards, and never read from a member that is not current.
//!
//! Real files in a scratch directory, real I/O through the devices, data read back and
//! compared. Each scenario also runs without metadata, where it must go wrong: that is
//! what the superblocks are for, and it shows the test can fail.

use std::path::Path;
use std::sync::Arc;

use cairn_config::StackFile;
use cairn_core::blocking::BlockingQueue;
use cairn_core::{Array, Device, IoFlags, Switches};
use cairn_stacks::array::{ArrayAction, ArrayAdmin};
use cairn_testkit::pattern;

const MIB: u64 = 1 << 20;

fn open(text: &str, name: &str) -> Result<Arc<dyn Device>, String> {
    StackFile::parse(text)
        .map_err(|e| e.to_string())?
        .open(name)
        .map_err(|e| e.to_string())
}

/// The array capability of `d` (it must be an array).
fn array(d: &Arc<dyn Device>) -> Arc<dyn Array> {
    d.capability::<dyn Array>().expect("an array")
}

fn admin(d: &Arc<dyn Device>) -> Arc<dyn ArrayAdmin> {
    d.capability::<dyn ArrayAdmin>()
        .expect("an array the admin changes")
}

fn queue(d: &Arc<dyn Device>) -> BlockingQueue {
    BlockingQueue::open(d, Switches::default()).expect("a queue")
}

fn file(name: &str, path: &Path) -> String {
    format!(
        "[device.{name}]\ntype = \"file\"\npath = \"{}\"\nsize = \"8M\"\n\n",
        path.display()
    )
}

/// Reads the whole device in 64 KiB requests, so that reads of a mirror alternate
/// between its members.
fn read_all(d: &Arc<dyn Device>) -> Vec<u8> {
    let q = queue(d);
    let size = d.geometry().size_bytes as usize;
    let mut out = vec![0u8; size];
    for (i, chunk) in out.chunks_mut(64 << 10).enumerate() {
        q.read((i * (64 << 10)) as u64, chunk).expect("read");
    }
    out
}

/// Scenario 1: a member fails, writes go on degraded, the array stops cleanly; started
/// again with the member healed, nothing may be read from it.
fn a_healed_member_after_a_degraded_run(metadata: &str) -> bool {
    let dir = tempfile::tempdir().expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    // Writes to the member's sectors from 3 MiB to 4 MiB fail: the first one fails the
    // member (the superblocks, at the start of the member, are not in the range).
    let degraded = format!(
        "{}{}[device.fa]\ntype = \"fault\"\nbase = \"a\"\nfail = [\"write\"]\nsectors = [6144, 8192]\n\n\
         [device.m]\ntype = \"mirror\"\nmembers = [\"fa\", \"b\"]\nmetadata = \"{metadata}\"\n",
        file("a", &a),
        file("b", &b)
    );
    let m = open(&degraded, "m").expect("open the mirror");
    let size = m.geometry().size_bytes as usize;
    {
        let q = queue(&m);
        q.write(0, &pattern(1, size), IoFlags::NONE)
            .expect("first pass");
        assert_eq!(array(&m).failed_members(), vec!["fa".to_string()]);
        q.write(0, &pattern(2, size), IoFlags::NONE)
            .expect("second pass, degraded");
        q.flush().expect("flush");
    }
    drop(m);
    let healed = format!(
        "{}{}[device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"{metadata}\"\n",
        file("a", &a),
        file("b", &b)
    );
    let m = open(&healed, "m").expect("open the mirror again");
    read_all(&m) == pattern(2, size)
}

#[test]
fn a_member_that_failed_is_not_read_after_a_restart() {
    assert!(a_healed_member_after_a_degraded_run("1"));
    // Without superblocks the healed member serves its stale data.
    assert!(!a_healed_member_after_a_degraded_run("none"));
}

/// Scenario 2: a member's file is gone and a blank one takes its place; nothing may be
/// read from the blank one (it would read as zeros).
fn a_blank_replacement(metadata: &str) -> bool {
    let dir = tempfile::tempdir().expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let text = format!(
        "{}{}[device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"{metadata}\"\n",
        file("a", &a),
        file("b", &b)
    );
    let m = open(&text, "m").expect("open the mirror");
    let size = m.geometry().size_bytes as usize;
    queue(&m)
        .write(0, &pattern(3, size), IoFlags::NONE)
        .expect("write");
    drop(m);
    std::fs::remove_file(&b).expect("lose member b");
    let m = open(&text, "m").expect("open with a blank b");
    let ok = read_all(&m) == pattern(3, size);
    // Writes reach the new member throughout (it is rebuilt from them and the rest).
    queue(&m)
        .write(0, &pattern(4, size), IoFlags::NONE)
        .expect("write again");
    drop(m);
    ok && read_all(&open(&text, "m").expect("open again")) == pattern(4, size)
}

#[test]
fn a_blank_replacement_is_not_read() {
    assert!(a_blank_replacement("1"));
    assert!(!a_blank_replacement("none"));
}

#[test]
fn members_that_do_not_belong_are_refused_naming_them() {
    let dir = tempfile::tempdir().expect("a directory");
    let p = |n: &str| dir.path().join(n);
    let mirror = |x: &str, y: &str| {
        format!(
            "{}{}[device.m]\ntype = \"mirror\"\nmembers = [\"{x}\", \"{y}\"]\nmetadata = \"1\"\n",
            file("a", &p("a.img")),
            file("b", &p("b.img"))
        )
    };
    drop(open(&mirror("a", "b"), "m").expect("create"));
    // Listed in the other order.
    let e = open(&mirror("b", "a"), "m").err().expect("refused");
    assert!(
        e.contains("'m'") && e.contains("member 2") && e.contains("'b'"),
        "{e}"
    );
    // A copy of one member's image as the other.
    std::fs::copy(p("a.img"), p("b.img")).expect("copy");
    let e = open(&mirror("a", "b"), "m").err().expect("refused");
    assert!(e.contains("member") && e.contains("'b'"), "{e}");
    // Data that is not a superblock: a foreign member, never used as data.
    std::fs::write(p("b.img"), vec![0x5a; 8 << 20]).expect("scribble");
    let before = std::fs::read(p("b.img")).expect("read");
    let e = open(&mirror("a", "b"), "m").err().expect("refused");
    assert!(
        e.contains("'b'") && e.contains("holds data but no cairn superblock"),
        "{e}"
    );
    assert!(
        std::fs::read(p("b.img")).expect("read") == before,
        "untouched"
    );
}

#[test]
fn a_missing_member_starts_degraded_on_purpose() {
    let dir = tempfile::tempdir().expect("a directory");
    let text = format!(
        "{}[device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"missing\"]\nmetadata = \"1\"\n",
        file("a", &dir.path().join("a.img"))
    );
    let m = open(&text, "m").expect("open degraded");
    assert_eq!(array(&m).failed_members(), vec!["missing".to_string()]);
    let size = m.geometry().size_bytes as usize;
    assert_eq!(size as u64, 8 * MIB - MIB);
    queue(&m)
        .write(0, &pattern(5, size), IoFlags::NONE)
        .expect("write");
    drop(m);
    assert!(read_all(&open(&text, "m").expect("again")) == pattern(5, size));
    // Without metadata, or in a stripe, `missing` is refused when the file is read.
    let e = StackFile::parse(&text.replace("metadata = \"1\"\n", "metadata = \"none\"\n"))
        .expect_err("refused")
        .to_string();
    assert!(e.contains("'m'") && e.contains("missing"), "{e}");
}

/// Superblocks are the default: a stack file without `metadata` that names members
/// holding data but no superblock (a raw array's, written before superblocks were the
/// default, or another program's) is refused naming the member and the way out, and
/// nothing is written; `metadata = "none"` serves them as they are.
#[test]
fn members_holding_data_are_refused_at_the_default() {
    let dir = tempfile::tempdir().expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let raw = format!(
        "{}{}[device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"none\"\n",
        file("a", &a),
        file("b", &b)
    );
    let m = open(&raw, "m").expect("a raw mirror");
    let size = m.geometry().size_bytes as usize;
    assert_eq!(size as u64, 8 * MIB, "raw: no metadata area");
    queue(&m)
        .write(0, &pattern(7, size), IoFlags::NONE)
        .expect("write");
    drop(m);
    let default = raw.replace("metadata = \"none\"\n", "");
    let images = || (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let before = images();
    let Err(e) = open(&default, "m") else {
        panic!("members holding data were taken at the default")
    };
    assert!(
        e.contains("member 'a' holds data but no cairn superblock")
            && e.contains("non-zero bytes at offset 0")
            && e.contains("add metadata = \"none\" to [device.m]"),
        "{e}"
    );
    assert!(images() == before, "a refused start changed a member");
    // Asked for by name, the raw layout serves the data as it is.
    assert!(read_all(&open(&raw, "m").expect("raw again")) == pattern(7, size));

    // Data past the first MiB, on a member whose first MiB is zeros, is found too (the
    // allocation map shows where to look); a sparse new member is blank.
    let (c, d) = (dir.path().join("c.img"), dir.path().join("d.img"));
    let mut img = vec![0u8; 8 << 20];
    img[(3 << 20) + 17] = 1;
    std::fs::write(&c, &img).expect("c");
    let text = format!(
        "{}{}[device.m]\ntype = \"mirror\"\nmembers = [\"d\", \"c\"]\n",
        file("c", &c),
        file("d", &d)
    );
    let Err(e) = open(&text, "m") else {
        panic!("a member holding data past its first MiB was taken")
    };
    assert!(
        e.contains("member 'c' holds data") && e.contains(&format!("offset {}", (3 << 20) + 17)),
        "{e}"
    );
    assert!(std::fs::read(&c).unwrap() == img, "c changed");
    assert!(
        std::fs::read(&d).unwrap().iter().all(|&x| x == 0),
        "d was written"
    );
    // Zeroed, c is blank: the array is created with superblocks (data after 1 MiB).
    std::fs::write(&c, vec![0u8; 8 << 20]).expect("zero c");
    let m = open(&text, "m").expect("created");
    assert_eq!(m.geometry().size_bytes, 8 * MIB - MIB);
    assert!(array(&m).status().is_some(), "superblocks by default");
}

/// Members replaced online are marked taken out: started again from the stack file as it
/// was before the replaces, the array is refused (alone or together, they never serve
/// the data from before the replace), and started from the current members it serves
/// what was written.
#[test]
fn members_replaced_online_are_never_assembled_again() {
    let dir = tempfile::tempdir().expect("a directory");
    let p = |n: &str| dir.path().join(n);
    let text = |x: &str, y: &str| {
        format!(
            "{}{}[device.m]\ntype = \"mirror\"\nmembers = [\"{x}\", \"{y}\"]\n",
            file(x, &p(x)),
            file(y, &p(y))
        )
    };
    let m = open(&text("a", "b"), "m").expect("open the mirror");
    let size = m.geometry().size_bytes as usize;
    queue(&m)
        .write(0, &pattern(1, size), IoFlags::NONE)
        .expect("first pass");
    for (old, new) in [("a", "c"), ("b", "d")] {
        let spec = format!("file:{},size=8M", p(new).display());
        admin(&m)
            .act(&ArrayAction::Replace {
                old: old.into(),
                spec: spec.clone(),
            })
            .expect("replace");
        wait_status(&m, &format!("{new} active"));
        for _ in 0..2400 {
            if !array(&m).status().unwrap_or_default().contains("replacing") {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
    queue(&m)
        .write(0, &pattern(2, size), IoFlags::NONE)
        .expect("second pass, on c and d");
    drop(m);
    let images = || {
        ["a", "b", "c", "d"]
            .map(|n| std::fs::read(p(n)).expect("an image"))
            .to_vec()
    };
    let before = images();
    for stale in [
        text("a", "b"),
        text("b", "a").replace("[\"b\", \"a\"]", "[\"a\", \"missing\"]"),
        format!(
            "{}[device.m]\ntype = \"mirror\"\nmembers = [\"missing\", \"b\"]\n",
            file("b", &p("b"))
        ),
    ] {
        let Err(e) = open(&stale, "m") else {
            panic!("a member replaced online was assembled again:\n{stale}")
        };
        assert!(e.contains("was taken out of the array at event"), "{e}");
        assert!(e.contains("replaced by member"), "{e}");
    }
    assert!(images() == before, "a refused start changed a member");
    let m = open(&text("c", "d"), "m").expect("the current members");
    assert!(read_all(&m) == pattern(2, size));
}

/// A member that fails again each time it is re-added (`readd`) is tried after longer and
/// longer waits, then left failed, and `status` says so: never re-added forever.
#[test]
fn a_member_that_keeps_failing_is_not_re_added_forever() {
    let dir = tempfile::tempdir().expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    // Writes to 4 KiB at 2 MiB of a (data at 1 MiB) always fail; its superblocks work.
    let text = format!(
        "{}{}[device.fa]\ntype = \"fault\"\nbase = \"a\"\nfail = [\"write\"]\nsectors = [4096, 4104]\n\n\
         [device.m]\ntype = \"mirror\"\nmembers = [\"fa\", \"b\"]\nreadd = \"100ms\"\n",
        file("a", &a),
        file("b", &b)
    );
    let m = open(&text, "m").expect("open the mirror");
    let size = m.geometry().size_bytes as usize;
    queue(&m)
        .write(0, &pattern(1, size), IoFlags::NONE)
        .expect("written (to b)");
    let status = wait_status(&m, "re-adds given up");
    assert!(status.contains("[_U]"), "{status}");
    std::thread::sleep(std::time::Duration::from_millis(500));
    let later = array(&m).status().expect("status");
    assert!(later.contains("fa failed (re-adds given up)"), "{later}");
    assert!(read_all(&m) == pattern(1, size));
}

/// Rewrites every member's newest superblock through `edit` (into its other slot, as the
/// array would), to stage what a crash leaves.
fn edit_superblocks(
    paths: &[&Path],
    edit: impl Fn(&mut cairn_stacks::array::superblock::Superblock),
) {
    use cairn_core::ondisk::Picked;
    use cairn_stacks::array::superblock::{pick, SLOT_BYTES};
    use std::io::{Seek, SeekFrom, Write};
    for p in paths {
        let area = std::fs::read(p).expect("read")[..2 * SLOT_BYTES].to_vec();
        let Picked::Valid { record: mut sb, .. } = pick(&area) else {
            panic!("no superblock on {}", p.display())
        };
        edit(&mut sb);
        sb.generation += 1;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(p)
            .expect("open");
        f.seek(SeekFrom::Start((sb.slot() * SLOT_BYTES) as u64))
            .expect("seek");
        f.write_all(&sb.encode()).expect("write");
    }
}

/// `kill -9` during a rebuild: the next start resyncs the bitmap's dirty regions and
/// resumes the rebuild from its checkpoint, instead of copying the whole array from 0.
#[test]
fn after_a_crash_during_a_rebuild_both_resume() {
    use cairn_stacks::array::superblock::MemberState;
    let dir = tempfile::tempdir().expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let member = |name: &str, path: &Path| {
        format!(
            "[device.{name}]\ntype = \"file\"\npath = \"{}\"\nsize = \"65M\"\n\n",
            path.display()
        )
    };
    let text = format!(
        "{}{}[device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nbitmap = \"1M\"\n",
        member("a", &a),
        member("b", &b)
    );
    let m = open(&text, "m").expect("open");
    let size = m.geometry().size_bytes as usize;
    assert_eq!(size as u64, 64 * MIB);
    queue(&m)
        .write(0, &pattern(9, size), IoFlags::NONE)
        .expect("write");
    drop(m);
    // As a crash leaves it: b rebuilt up to 48 MiB (its checkpoint), the array not
    // stopped cleanly, one region (the first MiB) dirty in the bitmap.
    edit_superblocks(&[&a, &b], |sb| {
        sb.flags = 0;
        sb.roles[1].state = MemberState::Rebuilding;
        sb.roles[1].recovery_offset = 48 * MIB;
        sb.bitmap.iter_mut().for_each(|x| *x = 0);
        sb.bitmap[0] = 1;
    });
    let m = open(&text, "m").expect("open after the crash");
    let status = wait_status(&m, "last resync");
    let read: u64 = status
        .split("read ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("bytes read");
    // One dirty MiB, and the 16 MiB above the checkpoint: not 64 MiB.
    assert!(read <= 17 * MIB, "read {read} bytes: {status}");
    assert!(read >= 16 * MIB, "read {read} bytes: {status}");
    assert!(!status.contains("degraded"), "{status}");
    assert!(read_all(&m) == pattern(9, size));
}

/// Polls the array's status until `done` holds of it (at most 120 s).
fn wait_until(m: &Arc<dyn Device>, what: &str, done: impl Fn(&str) -> bool) -> String {
    for _ in 0..2400 {
        let s = array(m).status().expect("an array's status");
        if done(&s) {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!(
        "not {what} within 120 s: {}",
        array(m).status().unwrap_or_default()
    );
}

/// The number after `key` in a status text (`resync 42.0%`, `bitmap: 3 of`, `read 123`).
fn number_after(status: &str, key: &str) -> Option<f64> {
    let rest = status.split(key).nth(1)?;
    let n: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    n.parse().ok()
}

/// A mirror of two 65M files whose copies differ at 60 MiB, staged as an unclean stop
/// with every bitmap bit set (64 regions of 1 MiB), resynced at 4 MB/s: the stack text.
fn unclean_mirror_resyncing_slowly(dir: &Path, bitmap: &str) -> (String, [std::path::PathBuf; 2]) {
    let (a, b) = (dir.join("a.img"), dir.join("b.img"));
    let member = |name: &str, path: &Path| {
        format!(
            "[device.{name}]\ntype = \"file\"\npath = \"{}\"\nsize = \"65M\"\n\n",
            path.display()
        )
    };
    let slow = format!(
        "{}{}[device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\n{bitmap}rebuild_min = \"1M\"\nrebuild_max = \"4M\"\n",
        member("a", &a),
        member("b", &b)
    );
    let m = open(&slow, "m").expect("create");
    let size = m.geometry().size_bytes as usize;
    assert_eq!(size as u64, 64 * MIB);
    queue(&m)
        .write(0, &pattern(9, size), IoFlags::NONE)
        .expect("write");
    drop(m);
    // A write in flight at the crash reached a and not b, at 60 MiB of the array.
    let mut other = std::fs::read(&b).expect("read b");
    let at = (MIB + 60 * MIB) as usize;
    other[at..at + 4096].fill(0xee);
    std::fs::write(&b, &other).expect("write b");
    edit_superblocks(&[&a, &b], |sb| {
        sb.flags = 0;
        sb.bitmap.iter_mut().for_each(|x| *x = 0xff);
    });
    (slow, [a, b])
}

/// Bytes the last resync read, from `status`.
fn resync_read(m: &Arc<dyn Device>) -> u64 {
    let s = wait_status(m, "last resync");
    number_after(&s, "read ").expect("bytes read") as u64
}

/// The members' data areas are the same.
fn copies_agree(a: &Path, b: &Path) -> bool {
    let (x, y) = (std::fs::read(a).expect("a"), std::fs::read(b).expect("b"));
    x[MIB as usize..] == y[MIB as usize..]
}

/// A crash during a resync: the bitmap is its checkpoint. Bits of the regions it has
/// passed are cleared behind it, so the next start resyncs only what it had not reached
/// (and what was written since), not the whole array again. (Was: no bit was cleared
/// while a resync ran, and every start resynced every region dirty at the first.)
#[test]
fn a_resync_cut_short_by_a_crash_resumes_from_the_bitmap() {
    let dir = tempfile::tempdir().expect("a directory");
    let (slow, [a, b]) =
        unclean_mirror_resyncing_slowly(dir.path(), "bitmap = \"1M\"\nbitmap_delay = \"100ms\"\n");
    let m = open(&slow, "m").expect("open after the crash");
    let size = m.geometry().size_bytes as usize;
    let seen = wait_until(&m, "resync under way, with bits cleared behind it", |s| {
        s.contains("    resync ") && number_after(s, "bitmap: ").is_some_and(|dirty| dirty <= 48.0)
    });
    drop(m);
    // As a crash leaves the superblocks: the bits as last cleared, no resync offset.
    edit_superblocks(&[&a, &b], |sb| {
        assert_eq!(sb.flags, 0, "stopped during the resync: still not clean");
        sb.resync_offset = 0;
    });
    let m = open(&slow.replace("rebuild_max = \"4M\"\n", ""), "m").expect("open again");
    let read = resync_read(&m);
    assert!(read > 0, "nothing resynced: {seen}");
    assert!(
        read <= 48 * MIB,
        "read {read} bytes, the whole array again? {seen}"
    );
    assert!(read_all(&m) == pattern(9, size), "data changed");
    drop(m);
    assert!(copies_agree(&a, &b), "the copies differ after the resync");
}

/// A stop during a resync records how far it got (the copies agree below: nothing is in
/// flight at a stop), and the next start resumes there, without a bitmap too. (Was: the
/// resync started over from 0.)
#[test]
fn a_resync_stopped_cleanly_resumes_where_it_stopped() {
    use cairn_core::ondisk::Picked;
    use cairn_stacks::array::superblock::{pick, SLOT_BYTES};
    let dir = tempfile::tempdir().expect("a directory");
    let (slow, [a, b]) = unclean_mirror_resyncing_slowly(dir.path(), "bitmap = \"none\"\n");
    let m = open(&slow, "m").expect("open after the crash");
    let size = m.geometry().size_bytes as usize;
    wait_until(&m, "a quarter resynced", |s| {
        number_after(s, "    resync ").is_some_and(|pct| pct >= 25.0)
    });
    drop(m);
    let area = std::fs::read(&a).expect("a")[..2 * SLOT_BYTES].to_vec();
    let Picked::Valid { record: sb, .. } = pick(&area) else {
        panic!("no superblock on a")
    };
    assert_eq!(sb.flags, 0, "not resynced yet: not clean");
    assert!(
        sb.resync_offset >= 16 * MIB,
        "resync offset {}",
        sb.resync_offset
    );
    let m = open(&slow.replace("rebuild_max = \"4M\"\n", ""), "m").expect("open again");
    let read = resync_read(&m);
    assert!(
        read <= 64 * MIB - sb.resync_offset,
        "read {read} bytes, resync offset {}",
        sb.resync_offset
    );
    assert!(read_all(&m) == pattern(9, size), "data changed");
    drop(m);
    assert!(copies_agree(&a, &b), "the copies differ after the resync");
}

/// Spares named in the stack file carry a spare's superblock: a restart knows them for
/// spares again, and one takes the place of a member that fails and is rebuilt. A spare
/// that holds data, belongs to another array or is a member in use is refused by name,
/// and nothing is written to it. (Was: spares were only added online, and forgotten at
/// a restart.)
#[test]
fn spares_in_the_stack_file_are_kept_in_their_superblocks_and_used() {
    use cairn_core::ondisk::Picked;
    use cairn_stacks::array::superblock::{pick, SLOT_BYTES};
    let dir = tempfile::tempdir().expect("a directory");
    let p = |n: &str| dir.path().join(format!("{n}.img"));
    let text = |members: &str, spares: &str| {
        format!(
            "{}{}{}{}[device.m]\ntype = \"mirror\"\nmembers = [{members}]\nspares = [{spares}]\n",
            file("a", &p("a")),
            file("b", &p("b")),
            file("s", &p("s")),
            file("t", &p("t"))
        )
    };
    let is_spare = |n: &str| {
        let area = std::fs::read(p(n)).expect("read")[..2 * SLOT_BYTES].to_vec();
        matches!(pick(&area), Picked::Valid { record: sb, .. } if sb.spare())
    };
    let m = open(&text("\"a\", \"b\"", "\"s\""), "m").expect("create with a spare");
    let size = m.geometry().size_bytes as usize;
    queue(&m)
        .write(0, &pattern(4, size), IoFlags::NONE)
        .expect("write");
    assert!(array(&m).status().expect("status").contains("spares: s"));
    drop(m);
    assert!(is_spare("s"), "s has no spare's superblock");
    // Started again, s is a spare again; a member failing takes it.
    let m = open(&text("\"a\", \"b\"", "\"s\""), "m").expect("assemble with the spare");
    assert!(array(&m).status().expect("status").contains("spares: s"));
    admin(&m)
        .act(&ArrayAction::Fail { member: "a".into() })
        .expect("fail a");
    let status = wait_status(&m, "[UU] s active, b active");
    assert!(!status.contains("spares:"), "{status}");
    assert!(read_all(&m) == pattern(4, size), "data changed");
    drop(m);
    assert!(!is_spare("s"), "s is a member now");
    let m = open(&text("\"s\", \"b\"", ""), "m").expect("assemble on s and b");
    assert!(read_all(&m) == pattern(4, size), "s was not rebuilt");
    drop(m);
    // Refused, each by name, and left as it was: a spare holding data, or another
    // array's member.
    let images = || {
        ["a", "b", "s", "t"]
            .map(|n| std::fs::read(p(n)).unwrap_or_default())
            .to_vec()
    };
    // (A member in use named as a spare too is refused by the stack file's checks and
    // by the file's lock before the superblocks are read.)
    let before = images();
    std::fs::write(p("t"), vec![7u8; 8 << 20]).expect("data on t");
    let e = open(&text("\"s\", \"b\"", "\"t\""), "m")
        .err()
        .expect("a spare holding data is refused");
    assert!(e.contains("spare 't' holds data"), "{e}");
    std::fs::remove_file(p("t")).expect("remove t");
    let other = format!(
        "{}{}[device.o]\ntype = \"mirror\"\nmembers = [\"t\", \"x\"]\n",
        file("t", &p("t")),
        file("x", &p("x"))
    );
    drop(open(&other, "o").expect("another array on t"));
    let before_t = std::fs::read(p("t")).expect("t");
    let e = open(&text("\"s\", \"b\"", "\"t\""), "m")
        .err()
        .expect("another array's member is refused");
    assert!(e.contains("spare 't' is a member of another array"), "{e}");
    assert!(
        std::fs::read(p("t")).expect("t") == before_t,
        "t was written"
    );
    assert!(
        images()[..3] == before[..3],
        "a refused start changed a member"
    );
    // Spares need metadata, and are not members too.
    for (extra, why) in [
        ("metadata = \"none\"\n", "needs metadata"),
        ("", "a member too"),
    ] {
        let t = text(
            "\"s\", \"b\"",
            if why == "a member too" {
                "\"b\""
            } else {
                "\"t\""
            },
        ) + extra;
        let e = StackFile::parse(&t)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("'spares'") && e.contains(why), "{e}");
    }
}

/// `cairn check` examines arrays and writes nothing: blank members stay blank, and an
/// array's superblocks keep their bytes.
#[test]
fn check_writes_no_superblock() {
    let dir = tempfile::tempdir().expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let text = format!(
        "{}{}[device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n",
        file("a", &a),
        file("b", &b)
    );
    let head = |p: &Path| std::fs::read(p).expect("read")[..16384].to_vec();
    let stack = StackFile::parse(&text).expect("parse");
    let report = stack
        .check(None, Switches::default())
        .expect("check on blank members");
    assert!(report.contains("metadata 1"), "{report}");
    assert!(
        report.contains("to be created by serve or bench"),
        "{report}"
    );
    // It validates: the files `size=` would create are not created.
    assert!(!a.exists() && !b.exists(), "check created the member files");
    drop(open(&text, "m").expect("create"));
    let before = (head(&a), head(&b));
    stack.check(None, Switches::default()).expect("check");
    assert!((head(&a), head(&b)) == before, "check rewrote a superblock");
}

/// `cairn check` and the preflight `serve` and `bench` run before opening for real see
/// what a file that `size=` would extend holds now: a foreign one (another program's
/// bytes where the superblocks go, however short) is refused as the real open would
/// refuse it, and nothing is extended or created; a blank one to extend, and one in a
/// directory that does not exist, are told apart.
#[test]
fn check_and_preflight_examine_a_member_to_be_extended_and_change_nothing() {
    let dir = tempfile::tempdir().expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let text = format!(
        "{}{}[device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n",
        file("a", &a),
        file("b", &b)
    );
    let stack = StackFile::parse(&text).expect("parse");
    let names = ["m".to_string()];
    // Foreign bytes in the first block, in the second superblock slot, past the slots,
    // in a file shorter than a block, and in the last partial block of a file.
    let mib = MIB as usize;
    for (len, at) in [
        (2 * mib, 0),
        (2 * mib, 12288),
        (2 * mib, mib + 4096),
        (100, 50),
        (1000, 700),
        (2 * mib + 100, 2 * mib + 50),
    ] {
        let mut bytes = vec![0u8; len];
        bytes[at] = 0x7f;
        std::fs::write(&b, &bytes).unwrap();
        let e = stack
            .check(None, Switches::default())
            .expect_err("check takes a foreign member for blank")
            .to_string();
        assert!(e.contains("'b'") && e.contains("holds data"), "{e}");
        let e = stack
            .preflight(&names, Switches::default())
            .expect_err("the preflight takes a foreign member for blank")
            .to_string();
        assert!(e.contains("'b'") && e.contains("holds data"), "{e}");
        assert!(!a.exists(), "a.img was created");
        assert_eq!(std::fs::read(&b).unwrap(), bytes, "b.img changed");
    }
    // Blank and short: the array would be created.
    std::fs::write(&b, vec![0u8; mib + 100]).unwrap();
    stack
        .preflight(&names, Switches::default())
        .expect("blank members to create and to extend");
    let report = stack.check(None, Switches::default()).expect("check");
    assert!(
        report.contains("to be extended by serve or bench"),
        "{report}"
    );
    assert_eq!(std::fs::metadata(&b).unwrap().len(), MIB + 100);
    assert!(!a.exists());
    // A member whose directory does not exist is refused before anything is created.
    let c = dir.path().join("none").join("c.img");
    let text = format!(
        "{}{}[device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"c\"]\nmetadata = \"1\"\n",
        file("a", &a),
        file("c", &c)
    );
    let stack = StackFile::parse(&text).expect("parse");
    let e = stack
        .preflight(&names, Switches::default())
        .expect_err("a file that cannot be created")
        .to_string();
    assert!(e.contains("c.img") && e.contains("No such file"), "{e}");
    assert!(!a.exists());
}

/// The preflight's reads (superblocks, metadata areas) are in no statistics: operators
/// see the served devices' I/O once, as if it had not run.
#[test]
fn a_preflight_counts_no_io_in_the_statistics() {
    let dir = tempfile::tempdir().expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    std::fs::write(&b, vec![0u8; 2 * MIB as usize]).unwrap();
    let text = format!(
        "{}{}[device.pf-m]\ntype = \"mirror\"\nmembers = [\"pf-a\", \"pf-b\"]\nmetadata = \"1\"\n",
        file("pf-a", &a),
        file("pf-b", &b)
    );
    let stack = StackFile::parse(&text).expect("parse");
    stack
        .preflight(&["pf-m".to_string()], Switches::default())
        .expect("preflight");
    let now = cairn_core::clock::monotonic_ns();
    for name in ["pf-a", "pf-b", "pf-m"] {
        assert!(
            cairn_core::stats::registry().device(name, now).is_none(),
            "{name} has statistics"
        );
    }
    let m = open(&text, "pf-m").expect("open for real");
    let now = cairn_core::clock::monotonic_ns();
    let reads = cairn_core::stats::registry()
        .device("pf-b", now)
        .map(|s| s.ios[0]);
    assert!(reads.is_some_and(|r| r > 0), "the real open's reads count");
    drop(m);
}

/// A member that fails under a write is recorded as failed in the other members'
/// superblocks before that write is answered: were the process killed right then, the
/// next start would not read the failed member (scenario 3's premise).
#[test]
fn a_failure_is_on_disk_before_the_write_that_found_it_completes() {
    use cairn_core::ondisk::Picked;
    use cairn_stacks::array::superblock::{pick, MemberState};
    let dir = tempfile::tempdir().expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let text = format!(
        "{}{}[device.fa]\ntype = \"fault\"\nbase = \"a\"\nfail = [\"write\"]\nsectors = [6144, 8192]\n\n\
         [device.m]\ntype = \"mirror\"\nmembers = [\"fa\", \"b\"]\nmetadata = \"1\"\n",
        file("a", &a),
        file("b", &b)
    );
    let m = open(&text, "m").expect("open the mirror");
    let q = queue(&m);
    q.write(2 * MIB, &pattern(6, MIB as usize), IoFlags::NONE)
        .expect("written to b; a fails");
    // The device is still open: nothing has been written at a clean stop yet.
    let area = std::fs::read(&b).expect("read b")[..16384].to_vec();
    let Picked::Valid { record: sb, .. } = pick(&area) else {
        panic!("b has no valid superblock")
    };
    assert_eq!(sb.roles[0].state, MemberState::Failed, "{sb:?}");
    assert_eq!(sb.roles[1].state, MemberState::Active);
    assert!(!sb.clean());
    drop(q);
    drop(m);
}

/// A member failed because its superblock could not be written (its first 4 KiB refuse
/// writes: slot 0) is out of reads and writes at once, and every view says so.
#[test]
fn a_member_whose_superblock_fails_is_out_of_reads_and_writes() {
    let dir = tempfile::tempdir().expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let text = format!(
        "{}{}[device.fa]\ntype = \"fault\"\nbase = \"a\"\nfail = [\"write\"]\nsectors = [0, 8]\n\n\
         [device.m]\ntype = \"mirror\"\nmembers = [\"fa\", \"b\"]\n",
        file("a", &a),
        file("b", &b)
    );
    let m = open(&text, "m").expect("open the mirror (slot 1 takes the first superblock)");
    assert!(array(&m).failed_members().is_empty());
    let size = m.geometry().size_bytes as usize;
    let q = queue(&m);
    // The first write dirties a bitmap region: the superblocks are written again, to slot
    // 0, which fa refuses. The write itself goes on.
    q.write(0, &pattern(1, size), IoFlags::NONE)
        .expect("written (to b at least)");
    assert_eq!(array(&m).failed_members(), vec!["fa".to_string()]);
    let status = array(&m).status().expect("an array with metadata");
    assert!(
        status.contains("[_U]") && status.contains("degraded") && status.contains("fa failed"),
        "{status}"
    );
    assert!(
        m.describe().contains("degraded: fa failed"),
        "{}",
        m.describe()
    );
    // Nothing more reaches fa: a second pass leaves a.img's data area as the first left it.
    let data_offset = 1 << 20;
    let before = std::fs::read(&a).expect("read a")[data_offset..].to_vec();
    q.write(0, &pattern(2, size), IoFlags::NONE)
        .expect("second pass");
    q.flush().expect("flush");
    let after = std::fs::read(&a).expect("read a")[data_offset..].to_vec();
    assert!(before == after, "a write reached the failed member");
    // Nor is anything read from it: whatever it holds, reads return the second pass.
    std::fs::write(&a, vec![0xeeu8; 8 << 20]).expect("scribble over a");
    assert!(
        read_all(&m) == pattern(2, size),
        "a read went to the failed member"
    );
    assert!(
        read_all(&m) == pattern(2, size),
        "a read went to the failed member"
    );
    drop(q);
    drop(m);
}

/// Makes the members' superblocks say the array did not stop cleanly, as `kill -9` or a
/// power cut would leave them.
fn mark_unclean(paths: &[&Path]) {
    edit_superblocks(paths, |sb| sb.flags = 0);
}

/// Scenario 3: after an unclean stop the copies may differ where writes were in flight.
/// Until they are resynced, every block reads from one copy, so it never reads two ways.
#[test]
fn after_an_unclean_stop_a_block_never_reads_two_ways() {
    let dir = tempfile::tempdir().expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let text = format!(
        "{}{}[device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n",
        file("a", &a),
        file("b", &b)
    );
    let m = open(&text, "m").expect("create");
    let size = m.geometry().size_bytes as usize;
    queue(&m)
        .write(0, &pattern(7, size), IoFlags::NONE)
        .expect("write");
    drop(m);
    // Writes in flight at the crash reached one copy and not the other.
    let mut other = std::fs::read(&b).expect("read b");
    other[(MIB + 3 * MIB) as usize..(MIB + 4 * MIB) as usize].fill(0xee);
    std::fs::write(&b, &other).expect("write b");
    mark_unclean(&[&a, &b]);
    for _ in 0..2 {
        let m = open(&text, "m").expect("assemble");
        let first = read_all(&m);
        // (Compared without printing: the device is megabytes.)
        assert!(first == read_all(&m), "a block read two ways");
        assert!(first == pattern(7, size), "reads come from the first copy");
        // Stopped cleanly now, it still says so at the next start: not resynced yet.
        drop(m);
    }
}

/// Waits (bounded) until the array no longer lists members it does not read.
fn wait_rebuilt(m: &Arc<dyn Device>) {
    for _ in 0..2400 {
        if !m.describe().contains("degraded") {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("not rebuilt within 120 s: {}", m.describe());
}

/// A blank replacement is rebuilt online while a client writes, and then every member
/// holds the same data, equal to what the client wrote.
#[test]
fn a_replacement_is_rebuilt_online_under_writes() {
    let dir = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let file64 = |name: &str, path: &Path| {
        format!(
            "[device.{name}]\ntype = \"file\"\npath = \"{}\"\nsize = \"129M\"\n\n",
            path.display()
        )
    };
    let text = format!(
        "{}{}[device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n",
        file64("a", &a),
        file64("b", &b)
    );
    let m = open(&text, "m").expect("create");
    let size = m.geometry().size_bytes as usize;
    let mut model = pattern(8, size);
    queue(&m).write(0, &model, IoFlags::NONE).expect("fill");
    drop(m);
    std::fs::remove_file(&b).expect("lose b");
    let m = open(&text, "m").expect("assemble with a blank b");
    // Writes while the rebuild runs, spread over the array.
    let q = queue(&m);
    let mut x: u64 = 0x9e37_79b9;
    for i in 0..400u32 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let at = (x % (size as u64 / 65536)) as usize * 65536;
        let data = pattern(100 + (i % 100) as u8, 65536);
        q.write(at as u64, &data, IoFlags::NONE).expect("write");
        model[at..at + 65536].copy_from_slice(&data);
    }
    drop(q);
    wait_rebuilt(&m);
    assert!(read_all(&m) == model, "the array reads what was written");
    drop(m);
    let (da, db) = (std::fs::read(&a).expect("a"), std::fs::read(&b).expect("b"));
    let data = (MIB as usize)..(MIB as usize + size);
    assert!(
        da[data.clone()] == db[data.clone()],
        "the copies differ after the rebuild"
    );
    assert!(
        da[data] == model[..],
        "a member does not hold what was written"
    );
    // Rebuilt: the next start reads both members and rebuilds nothing.
    let m = open(&text, "m").expect("again");
    assert!(!m.describe().contains("degraded"), "{}", m.describe());
}

/// A raid10 member replaced by a blank file is rebuilt from its copy partners: then the
/// array reads what was written, and with 4 members and 2 copies, members 2 and 3 (which
/// hold the same chunks) are byte-identical.
#[test]
fn a_raid10_member_is_rebuilt_from_its_copies() {
    let dir = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("a directory");
    let paths: Vec<_> = (0..4)
        .map(|i| dir.path().join(format!("r{i}.img")))
        .collect();
    let mut text: String = paths
        .iter()
        .enumerate()
        .map(|(i, p)| file(&format!("r{i}"), p))
        .collect();
    text += "[device.r]\ntype = \"raid10\"\nmembers = [\"r0\", \"r1\", \"r2\", \"r3\"]\nchunk = \"64K\"\nmetadata = \"1\"\n";
    let r = open(&text, "r").expect("create");
    let size = r.geometry().size_bytes as usize;
    let model = pattern(9, size);
    queue(&r).write(0, &model, IoFlags::NONE).expect("fill");
    drop(r);
    std::fs::remove_file(&paths[2]).expect("lose r2");
    let r = open(&text, "r").expect("assemble with a blank r2");
    wait_rebuilt(&r);
    assert!(read_all(&r) == model, "the array reads what was written");
    drop(r);
    let data = (MIB as usize)..(8 * MIB as usize);
    let (m2, m3) = (
        std::fs::read(&paths[2]).expect("r2"),
        std::fs::read(&paths[3]).expect("r3"),
    );
    assert!(
        m2[data.clone()] == m3[data],
        "r2 and r3 differ after the rebuild"
    );
}

/// A raid10 rebuild checkpoint never claims a member row whose chunks are not all
/// copied, and resuming from it never skips a chunk that has a copy in a row not done.
#[test]
fn raid10_checkpoints_are_conservative() {
    use cairn_stacks::stack::{Layout, Raid10};
    for (n, copies) in [(4usize, 2usize), (3, 2), (5, 3), (2, 2), (6, 4)] {
        let chunk = 64 << 10;
        let r = Raid10::new(n, copies, chunk, 64 * chunk, 512).expect("layout");
        for done in 0..(64 * n as u64 / copies as u64) {
            let at = done * chunk;
            let rows = r.member_rows_below(at) / chunk;
            // Every grid position in those rows belongs to a chunk below `done`.
            for row in 0..rows {
                for m in 0..n as u64 {
                    let p = row * n as u64 + m;
                    assert!(
                        p / (copies as u64) < done,
                        "n {n} c {copies}: row {row} claimed at {done}"
                    );
                }
            }
            // Resuming from the checkpoint starts at or before `done`, and every chunk
            // before the resume point has all its copies in rows below the checkpoint.
            let resume = r.logical_below_rows(rows * chunk) / chunk;
            assert!(
                resume <= done,
                "n {n} c {copies}: resume {resume} past {done}"
            );
            for i in 0..resume {
                for k in 0..copies as u64 {
                    let (_, off) = r.locate(i * chunk, k as usize);
                    assert!(
                        off / chunk < rows,
                        "n {n} c {copies}: chunk {i} copy {k} not below row {rows}"
                    );
                }
            }
        }
    }
}

/// A mirror of two 65 MiB files in a scratch directory (on /dev/shm when there is one),
/// with 1 MiB bitmap regions: 64 of them.
struct Bitmapped {
    _dir: tempfile::TempDir,
    a: std::path::PathBuf,
    b: std::path::PathBuf,
    c: std::path::PathBuf,
}

impl Bitmapped {
    fn new() -> Bitmapped {
        let dir = tempfile::tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .expect("a directory");
        Bitmapped {
            a: dir.path().join("a.img"),
            b: dir.path().join("b.img"),
            c: dir.path().join("c.img"),
            _dir: dir,
        }
    }

    /// The stack file with `members` (of `a`, `b`, `c`, `missing`), the bitmap's region
    /// and its delay.
    fn text(&self, members: &[&str], bitmap: &str, delay: &str) -> String {
        let mut t = String::new();
        for (name, path) in [("a", &self.a), ("b", &self.b), ("c", &self.c)] {
            t += &format!(
                "[device.{name}]\ntype = \"file\"\npath = \"{}\"\nsize = \"65M\"\n\n",
                path.display()
            );
        }
        let list: Vec<String> = members.iter().map(|m| format!("\"{m}\"")).collect();
        t += &format!(
            "[device.m]\ntype = \"mirror\"\nmembers = [{}]\nmetadata = \"1\"\nbitmap = \"{bitmap}\"\n",
            list.join(", ")
        );
        if bitmap != "none" {
            t += &format!("bitmap_delay = \"{delay}\"\n");
        }
        t
    }
}

/// Waits (bounded) until `status` holds `what`.
fn wait_status(m: &Arc<dyn Device>, what: &str) -> String {
    for _ in 0..2400 {
        let s = array(m).status().expect("an array's status");
        if s.contains(what) {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!(
        "no '{what}' within 120 s: {}",
        array(m).status().unwrap_or_default()
    );
}

/// Writes 4 KiB at the start of each region in `regions` (1 MiB regions) into the array
/// and the model.
fn touch(m: &Arc<dyn Device>, model: &mut [u8], regions: &[u64], pass: u8) {
    let q = queue(m);
    for &r in regions {
        let at = (r * MIB) as usize + 8192;
        let data = pattern(pass.wrapping_add(r as u8), 4096);
        q.write(at as u64, &data, IoFlags::NONE).expect("write");
        model[at..at + 4096].copy_from_slice(&data);
    }
    q.flush().expect("flush");
}

/// The data areas of two member files are equal, and equal to `model`.
fn members_hold(x: &Path, y: &Path, model: &[u8]) {
    let (dx, dy) = (
        std::fs::read(x).expect("read"),
        std::fs::read(y).expect("read"),
    );
    let data = (MIB as usize)..(MIB as usize + model.len());
    assert!(dx[data.clone()] == dy[data.clone()], "the copies differ");
    assert!(
        dx[data] == model[..],
        "a member does not hold what was written"
    );
}

/// Fills a new bitmapped mirror on `members` and waits until its bits are all clear;
/// returns what it holds.
fn filled_and_clean(t: &Bitmapped, members: &[&str]) -> Vec<u8> {
    let m = open(&t.text(members, "1M", "100ms"), "m").expect("create");
    let size = m.geometry().size_bytes as usize;
    let model = pattern(21, size);
    queue(&m).write(0, &model, IoFlags::NONE).expect("fill");
    let s = wait_status(&m, "bitmap: 0 of 64 regions");
    assert!(s.contains("of 1MiB"), "{s}");
    model
}

/// After an unclean stop only the regions whose bits were set are resynced: the resync
/// reads and writes those bytes and no others, and then the copies agree.
#[test]
fn the_bitmap_resyncs_only_dirty_regions() {
    let t = Bitmapped::new();
    let mut model = filled_and_clean(&t, &["a", "b"]);
    // Writes to 3 regions; then the array stops (bits still set: the delay is an hour).
    let m = open(&t.text(&["a", "b"], "1M", "1h"), "m").expect("assemble");
    touch(&m, &mut model, &[5, 6, 40], 1);
    assert!(array(&m).status().unwrap().contains("bitmap: 3 of 64"));
    drop(m);
    // As after kill -9: not stopped cleanly, and one copy of region 40 did not get
    // its last write.
    let mut other = std::fs::read(&t.b).expect("read b");
    let at = (MIB + 40 * MIB + 8192) as usize;
    other[at..at + 4096].fill(0xee);
    std::fs::write(&t.b, &other).expect("write b");
    mark_unclean(&[&t.a, &t.b]);
    let m = open(&t.text(&["a", "b"], "1M", "1h"), "m").expect("assemble unclean");
    let s = wait_status(&m, "last resync");
    let three = 3 * MIB;
    assert!(
        s.contains(&format!("read {three} bytes, wrote {three} bytes")),
        "{s}"
    );
    assert!(read_all(&m) == model, "the array reads what was written");
    drop(m);
    members_hold(&t.a, &t.b, &model);
}

/// A member away for a while is brought back by copying only the regions written while
/// it was away; without a bitmap all of it is copied. Either way it then holds what was
/// written.
#[test]
fn a_member_away_comes_back_by_the_bitmap() {
    for bitmap in ["1M", "none"] {
        let t = Bitmapped::new();
        let mut model = filled_and_clean(&t, &["a", "b"]);
        let away = open(&t.text(&["a", "missing"], bitmap, "100ms"), "m").expect("degraded");
        let size = away.geometry().size_bytes;
        touch(&away, &mut model, &[1, 2, 30, 63], 2);
        // Degraded: no bit is cleared however long the regions stay idle.
        std::thread::sleep(std::time::Duration::from_millis(400));
        if bitmap != "none" {
            assert!(array(&away).status().unwrap().contains("bitmap: 4 of 64"));
        }
        drop(away);
        let back = open(&t.text(&["a", "b"], bitmap, "1h"), "m").expect("b is back");
        let s = wait_status(&back, "last rebuild");
        let moved = if bitmap == "none" { size } else { 4 * MIB };
        assert!(
            s.contains(&format!("read {moved} bytes, wrote {moved} bytes")),
            "bitmap {bitmap}: {s}"
        );
        assert!(read_all(&back) == model, "the array reads what was written");
        drop(back);
        members_hold(&t.a, &t.b, &model);
    }
}

/// A member that left before the bitmap was last cleared missed writes the bitmap no
/// longer shows: it is rebuilt whole, never from the bitmap.
#[test]
fn a_member_away_across_a_clearing_is_rebuilt_whole() {
    let t = Bitmapped::new();
    let mut model = filled_and_clean(&t, &["a", "b"]);
    // b leaves; c takes its place, is rebuilt, and the array writes and clears its bits.
    let m = open(&t.text(&["a", "c"], "1M", "100ms"), "m").expect("with c");
    let size = m.geometry().size_bytes;
    wait_rebuilt(&m);
    touch(&m, &mut model, &[7, 50], 3);
    wait_status(&m, "bitmap: 0 of 64");
    drop(m);
    // b comes back in c's place: region 7 and 50 are news to it, and no bit says so.
    let m = open(&t.text(&["a", "b"], "1M", "1h"), "m").expect("b again");
    let s = wait_status(&m, "last rebuild");
    assert!(
        s.contains(&format!("read {size} bytes, wrote {size} bytes")),
        "{s}"
    );
    assert!(read_all(&m) == model, "the array reads what was written");
    drop(m);
    members_hold(&t.a, &t.b, &model);
}

/// A write reaches a member only after its region's bit is on disk: while a write to a
/// clean region is on its way (each member delays writes by 200 ms), whenever a member
/// file holds the new data, its superblock (read afterwards) has the bit set.
#[test]
fn a_write_reaches_a_member_only_after_its_bit() {
    use cairn_core::ondisk::Picked;
    use cairn_stacks::array::superblock::{pick, SLOT_BYTES};
    let t = Bitmapped::new();
    let mut text = t.text(&["da", "db"], "1M", "1h");
    for (name, base) in [("da", "a"), ("db", "b")] {
        text +=
            &format!("[device.{name}]\ntype = \"delay\"\nbase = \"{base}\"\nwrite = \"200ms\"\n\n");
    }
    let m = open(&text, "m").expect("create");
    let region = 10u64;
    let at = region * MIB + 4096;
    let data = pattern(77, 4096);
    let writer = {
        let (m, data) = (m.clone(), data.clone());
        std::thread::spawn(move || queue(&m).write(at, &data, IoFlags::NONE))
    };
    let bit_on_disk = |path: &Path| {
        let area = std::fs::read(path).expect("read")[..2 * SLOT_BYTES].to_vec();
        let Picked::Valid { record: sb, .. } = pick(&area) else {
            panic!("no superblock on {}", path.display())
        };
        sb.bitmap[(region / 8) as usize] & (1 << (region % 8)) != 0
    };
    let data_on_disk = |path: &Path| {
        let f = std::fs::read(path).expect("read");
        let o = (MIB + at) as usize;
        f[o..o + 4096] == data[..]
    };
    let mut seen_data = false;
    loop {
        let finished = writer.is_finished();
        for p in [&t.a, &t.b] {
            if data_on_disk(p) {
                seen_data = true;
                assert!(
                    bit_on_disk(&t.a) && bit_on_disk(&t.b),
                    "{} holds the write, and a superblock has no bit for its region",
                    p.display()
                );
            }
        }
        if finished {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    writer.join().expect("the writer").expect("the write");
    assert!(seen_data, "the write reached the members");
}

/// Damaged superblocks on a real member: a torn newest slot falls back on the other; both
/// slots corrupted, a truncated member, or another array's superblock are refused with
/// one line naming the member, and nothing is written to any member.
#[test]
fn damaged_superblocks_fall_back_or_are_refused_cleanly() {
    use cairn_stacks::array::superblock::SLOT_BYTES;
    let dir = tempfile::tempdir().expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let text = format!(
        "{}{}[device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n",
        file("a", &a),
        file("b", &b)
    );
    let m = open(&text, "m").expect("create");
    let size = m.geometry().size_bytes as usize;
    queue(&m)
        .write(0, &pattern(9, size), IoFlags::NONE)
        .expect("write");
    drop(m);
    let good_b = std::fs::read(&b).expect("b");
    let newest = |img: &[u8]| {
        use cairn_core::ondisk::Picked;
        use cairn_stacks::array::superblock::pick;
        match pick(&img[..2 * SLOT_BYTES]) {
            Picked::Valid { slot, .. } => slot,
            other => panic!("{other:?}"),
        }
    };
    // Torn: the newest slot's second half never reached the disk.
    let mut torn = good_b.clone();
    let s = newest(&torn) * SLOT_BYTES;
    torn[s + SLOT_BYTES / 2..s + SLOT_BYTES].fill(0);
    std::fs::write(&b, &torn).expect("write b");
    let m = open(&text, "m").expect("a torn slot falls back on the other");
    assert!(read_all(&m) == pattern(9, size));
    drop(m);
    // Each damage below is refused, and leaves both members as they were (b is opened
    // as it is, without a size that would extend a truncated file).
    let as_is = format!(
        "{}[device.b]\ntype = \"file\"\npath = \"{}\"\n\n\
         [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n",
        file("a", &a),
        b.display()
    );
    type Damage = Box<dyn Fn(&mut Vec<u8>)>;
    let damages: Vec<(&str, Damage)> = vec![
        (
            "holds data but no cairn superblock",
            Box::new(|img: &mut Vec<u8>| {
                img[100] ^= 0x40;
                img[SLOT_BYTES + 100] ^= 0x40;
            }),
        ),
        (
            "smaller than",
            Box::new(|img: &mut Vec<u8>| img.truncate(10 << 10)),
        ),
        (
            "different arrays",
            Box::new(|img: &mut Vec<u8>| {
                use cairn_core::ondisk::Picked;
                use cairn_stacks::array::superblock::pick;
                let Picked::Valid {
                    record: mut sb,
                    slot,
                    ..
                } = pick(&img[..2 * SLOT_BYTES])
                else {
                    panic!("no superblock")
                };
                sb.array_uuid = [0x5a; 16];
                img[slot * SLOT_BYTES..(slot + 1) * SLOT_BYTES].copy_from_slice(&sb.encode());
            }),
        ),
    ];
    for (why, damage) in damages {
        let good_b = std::fs::read(&b).expect("b");
        let mut bad = good_b.clone();
        damage(&mut bad);
        std::fs::write(&b, &bad).expect("write b");
        let before_a = std::fs::read(&a).expect("a");
        let e = open(&as_is, "m")
            .err()
            .unwrap_or_else(|| panic!("{why}: accepted"));
        assert!(e.contains(why) && e.contains("'b'"), "{why}: {e}");
        assert!(!e.contains('\n'), "one line: {e}");
        assert!(
            std::fs::read(&a).expect("a") == before_a,
            "{why}: a was written"
        );
        assert!(std::fs::read(&b).expect("b") == bad, "{why}: b was written");
        std::fs::write(&b, &good_b).expect("restore b");
    }
}

/// A member that ran on without the others (the array was started with them named
/// `missing`) holds writes the others never saw: added back to an array of the others,
/// it is refused with its events named, and nothing changes.
#[test]
fn a_member_that_ran_on_without_the_others_is_refused_when_added() {
    let dir = tempfile::tempdir().expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let mirror = |members: &str| {
        let mut t = String::new();
        if members.contains("\"a\"") {
            t += &file("a", &a);
        }
        if members.contains("\"b\"") {
            t += &file("b", &b);
        }
        t + &format!(
            "[device.m]\ntype = \"mirror\"\nmembers = [{members}]\nmetadata = \"1\"\nbitmap = \"64K\"\n"
        )
    };
    let data = pattern(1, 4096);
    {
        let m = open(&mirror("\"a\", \"b\""), "m").expect("created");
        queue(&m).write(0, &data, IoFlags::FUA).expect("write");
    }
    // b runs on alone and takes a write a never sees.
    {
        let m = open(&mirror("\"missing\", \"b\""), "m").expect("b alone");
        queue(&m)
            .write(0, &pattern(2, 4096), IoFlags::FUA)
            .expect("write");
    }
    // a alone (the operator vouched for it by naming b missing), then b is added back.
    let m = open(&mirror("\"a\", \"missing\""), "m").expect("a alone");
    let spec = format!("file:{}", b.display());
    let before = std::fs::read(&b).unwrap();
    let e = admin(&m)
        .act(&ArrayAction::Add { spec: spec.clone() })
        .expect_err("b is newer");
    assert!(
        matches!(e.cause(), cairn_stacks::Error::RanOn { .. }),
        "{e:?}"
    );
    let e = e.to_string();
    assert!(e.contains("ran on without") && e.contains("events"), "{e}");
    assert!(std::fs::read(&b).unwrap() == before, "b was changed");
    assert!(
        array(&m).status().unwrap().contains("[U_]"),
        "{}",
        array(&m).status().unwrap()
    );
}

/// Each superblock's data offset and size add up, but assembling a linear array adds
/// one member's size to the newest superblock's offset: sizes that overflow there are
/// refused with one line naming the member (they overflowed: a panic in a debug build,
/// a wrapped sum that passed in a release one), and nothing is written.
#[test]
fn superblocks_whose_sizes_overflow_together_are_refused() {
    let dir = tempfile::tempdir().expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let text = format!(
        "{}{}[device.m]\ntype = \"linear\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n",
        file("a", &a),
        file("b", &b)
    );
    drop(open(&text, "m").expect("create"));
    edit_superblocks(&[&b], |sb| sb.data_offset = 1 << 62);
    edit_superblocks(&[&a], |sb| sb.member_data_bytes = u64::MAX - sb.data_offset);
    let before = (std::fs::read(&a).expect("a"), std::fs::read(&b).expect("b"));
    let e = open(&text, "m").err().expect("refused");
    assert!(e.contains("'a'") && e.contains("past any device"), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");
    let after = (std::fs::read(&a).expect("a"), std::fs::read(&b).expect("b"));
    assert!(after == before, "a member was written");
}

/// The admin's refusals are values a caller can match on, with the words the admin reads:
/// an action on an array without redundancy, a member the array does not have, a member
/// in use removed, a working member re-added, the last current copy failed, a device
/// too small or a spec that does not parse added. A refusal changes nothing.
#[test]
fn admin_refusals_say_what_is_wrong_as_values() {
    use cairn_stacks::{Error, MemberIs};
    let dir = tempfile::tempdir().expect("a directory");
    let p = |n: &str| dir.path().join(format!("{n}.img"));
    let stripe = format!(
        "{}{}[device.s]\ntype = \"stripe\"\nmembers = [\"a\", \"b\"]\n",
        file("a", &p("a")),
        file("b", &p("b"))
    );
    let s = open(&stripe, "s").expect("a stripe");
    let e = admin(&s)
        .act(&ArrayAction::Fail { member: "a".into() })
        .expect_err("a stripe has no redundancy");
    assert!(
        matches!(
            e,
            Error::NotRedundant {
                level: "stripe",
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "'s' is a stripe: it has no redundancy to run without a member"
    );
    drop(s);
    let mirror = format!(
        "{}{}[device.m]\ntype = \"mirror\"\nmembers = [\"c\", \"d\"]\n",
        file("c", &p("c")),
        file("d", &p("d"))
    );
    let m = open(&mirror, "m").expect("a mirror");
    let act = |a: ArrayAction| admin(&m).act(&a).expect_err("refused");
    let e = act(ArrayAction::Fail {
        member: "zz".into(),
    });
    assert!(
        matches!(&e, Error::NoSuchMember { member, members, .. }
            if member == "zz" && members == &["c".to_string(), "d".to_string()]),
        "{e:?}"
    );
    assert_eq!(e.to_string(), "'m' has no member 'zz' (its members: c, d)");
    let e = act(ArrayAction::Remove { member: "c".into() });
    assert!(
        matches!(
            e,
            Error::MemberState {
                state: MemberIs::InUse,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(e.to_string(), "member 'c' of 'm' is in use: fail it first");
    let e = act(ArrayAction::ReAdd { member: "d".into() });
    assert!(
        matches!(
            e,
            Error::MemberState {
                state: MemberIs::NotFailed,
                ..
            }
        ),
        "{e:?}"
    );
    admin(&m)
        .act(&ArrayAction::Fail { member: "c".into() })
        .expect("fail c");
    let e = act(ArrayAction::Fail { member: "d".into() });
    assert!(
        matches!(&e, Error::LastCopy { holders, .. } if holders == &["c".to_string(), "d".to_string()]),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "failing 'd' would leave data of 'm' with no current copy (it lives on 'c', 'd'); let a rebuild finish first"
    );
    let e = act(ArrayAction::Replace {
        old: "c".into(),
        spec: "mem:8M".into(),
    });
    assert!(
        matches!(
            e,
            Error::MemberState {
                state: MemberIs::FailedOrMissing,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "member 'c' of 'm' has failed or is missing: add a new device in its place instead (add m SPEC)"
    );
    let e = act(ArrayAction::Add {
        spec: "mem:1M".into(),
    });
    assert!(
        matches!(
            e,
            Error::TooSmall {
                size_bytes: MIB,
                ..
            }
        ),
        "{e:?}"
    );
    let e = act(ArrayAction::Add {
        spec: "mem:1M,bogus=1".into(),
    });
    assert!(matches!(e, Error::Spec { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        "'mem:1M,bogus=1': invalid device 'mem:1M,bogus=1': unknown option 'bogus' for mem (known: block, volatile)"
    );
    assert!(
        array(&m).status().expect("status").contains("[_U]"),
        "{}",
        array(&m).status().unwrap_or_default()
    );
}
