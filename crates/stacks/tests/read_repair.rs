//! Read repair of mirrors and raid10s: a read that fails on one copy is answered from
//! another, and the range is then rewritten on the copy that failed.
//!
//! A `fault` device with `times` fails a member's reads of one range once, as a bad block
//! that a rewrite heals; the member's bytes there are damaged first (written directly,
//! bypassing the array), so only a repair puts the right data back. Every check reads the
//! member itself, bypassing the array, and compares bytes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_config::StackFile;
use cairn_core::blocking::BlockingQueue;
use cairn_core::stats::RepairSnapshot;
use cairn_core::{Array, Device, IoFlags, Switches};
use cairn_testkit::pattern;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// Where data starts on a member of an array with metadata.
const DATA_OFFSET: u64 = MIB;

fn open(text: &str, name: &str) -> Arc<dyn Device> {
    StackFile::parse(text)
        .unwrap_or_else(|e| panic!("{e}\n{text}"))
        .open(name)
        .unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// The array capability of `d` (it must be an array).
fn array(d: &Arc<dyn Device>) -> Arc<dyn Array> {
    d.capability::<dyn Array>().expect("an array")
}

fn queue(d: &Arc<dyn Device>) -> BlockingQueue {
    BlockingQueue::open(d, Switches::default()).expect("a queue")
}

/// Device `name` in the tree under `top`.
fn find(top: &Arc<dyn Device>, name: &str) -> Arc<dyn Device> {
    fn walk(d: &Arc<dyn Device>, name: &str) -> Option<Arc<dyn Device>> {
        if d.name() == name {
            return Some(d.clone());
        }
        d.children().iter().find_map(|c| walk(c, name))
    }
    walk(top, name).unwrap_or_else(|| panic!("no device '{name}' under '{}'", top.name()))
}

fn read(q: &BlockingQueue, offset: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    q.read(offset, &mut buf).expect("read");
    buf
}

fn repairs(array: &str) -> RepairSnapshot {
    cairn_core::stats::registry()
        .repairs(array)
        .unwrap_or_else(|| panic!("'{array}' has no read repair counters"))
}

/// Waits until `array`'s repairs satisfy `done` (the repair thread works in the
/// background); the counts then.
fn wait_repairs(array: &str, done: impl Fn(&RepairSnapshot) -> bool) -> RepairSnapshot {
    let began = Instant::now();
    loop {
        let r = repairs(array);
        if done(&r) {
            return r;
        }
        assert!(
            began.elapsed() < Duration::from_secs(20),
            "'{array}': no repair came: {r:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn mem(name: &str, size: &str) -> String {
    format!("[device.{name}]\ntype = \"mem\"\nsize = \"{size}\"\n")
}

fn file(name: &str, dir: &std::path::Path) -> String {
    format!(
        "[device.{name}]\ntype = \"file\"\npath = \"{}\"\nsize = \"8M\"\n",
        dir.join(format!("{name}.img")).display()
    )
}

/// A fault over `base` that fails `fail` in member bytes `[offset, offset + len)` at most
/// `times` times.
fn fault(name: &str, base: &str, fail: &str, offset: u64, len: u64, times: u64) -> String {
    format!(
        "[device.{name}]\ntype = \"fault\"\nbase = \"{base}\"\nfail = {fail}\nsectors = [{}, {}]\ntimes = {times}\n",
        offset / 512,
        (offset + len) / 512
    )
}

/// Damages `[offset, offset + len)` of `member` directly, and checks it reads so.
fn damage(member: &Arc<dyn Device>, offset: u64, len: u64) {
    let q = queue(member);
    q.write(offset, &vec![0xee; len as usize], IoFlags::NONE)
        .expect("damage the member");
    assert!(read(&q, offset, len).iter().all(|&b| b == 0xee));
}

/// Mirror (with superblocks, the default), a read sent whole to one copy: the copy that
/// failed is rewritten once.
#[test]
fn a_mirror_rewrites_a_range_that_failed_to_read() {
    // Logical `at` is at `DATA_OFFSET + at` on each member.
    let (at, len) = (MIB, 64 * KIB);
    let text = format!(
        "{}{}{}[device.rr_mirror]\ntype = \"mirror\"\nmembers = [\"fa\", \"b\"]\n",
        mem("a", "4M"),
        mem("b", "4M"),
        fault("fa", "a", "[\"read\"]", DATA_OFFSET + at, len, 1)
    );
    let m = open(&text, "rr_mirror");
    let size = m.geometry().size_bytes;
    let good = pattern(1, size);
    queue(&m).write(0, &good, IoFlags::NONE).expect("fill");
    let a = find(&m, "a");
    damage(&a, DATA_OFFSET + at, len);
    assert_eq!(repairs("rr_mirror"), RepairSnapshot::default());
    // A new queue sends its first read to the first copy: member fa, which fails it.
    let q = queue(&m);
    assert!(
        read(&q, at, len) == good[at as usize..][..len as usize],
        "the read is answered from the other copy"
    );
    let r = wait_repairs("rr_mirror", |r| r.repaired > 0);
    assert_eq!(
        (r.repaired, r.repaired_bytes, r.failed),
        (1, len, 0),
        "{r:?}"
    );
    assert!(
        read(&queue(&a), DATA_OFFSET + at, len) == good[at as usize..][..len as usize],
        "the member that failed holds the good data again"
    );
    assert!(array(&m).failed_members().is_empty());
    assert!(
        m.describe().contains("read repairs: 1 rewritten, 0 failed"),
        "{}",
        m.describe()
    );
    // Both copies read well now (reads alternate between them), and nothing is
    // repaired twice.
    for _ in 0..4 {
        assert!(read(&q, at, len) == good[at as usize..][..len as usize]);
    }
    assert!(read(&q, 0, size) == good);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(repairs("rr_mirror").repaired, 1);
}

/// raid10 with metadata, a read split into pieces: the piece that failed is rewritten on
/// its member, and the array's status counts it.
#[test]
fn a_raid10_rewrites_a_piece_that_failed_to_read() {
    let dir = tempfile::tempdir().expect("a directory");
    let chunk = 64 * KIB;
    // Logical chunk 0 lives on members 0 and 1, at the start of their data areas; the
    // fault is on member 0 there.
    let text = format!(
        "{}{}{}{}{}[device.rr_raid10]\ntype = \"raid10\"\nmembers = [\"fa\", \"b\", \"c\", \"d\"]\nchunk = \"64K\"\ncopies = 2\nmetadata = \"1\"\n",
        file("a", dir.path()),
        file("b", dir.path()),
        file("c", dir.path()),
        file("d", dir.path()),
        fault("fa", "a", "[\"read\"]", DATA_OFFSET, chunk, 1)
    );
    let r10 = open(&text, "rr_raid10");
    let size = r10.geometry().size_bytes;
    let good = pattern(2, size);
    queue(&r10).write(0, &good, IoFlags::NONE).expect("fill");
    let a = find(&r10, "a");
    damage(&a, DATA_OFFSET, chunk);
    // Two chunks: two pieces, the first sent to copy 0 (member fa), which fails it.
    let q = queue(&r10);
    assert!(read(&q, 0, 2 * chunk) == good[..2 * chunk as usize]);
    let r = wait_repairs("rr_raid10", |r| r.repaired > 0);
    assert_eq!(
        (r.repaired, r.repaired_bytes, r.failed),
        (1, chunk, 0),
        "{r:?}"
    );
    assert!(read(&queue(&a), DATA_OFFSET, chunk) == good[..chunk as usize]);
    let status = array(&r10).status().expect("a status");
    assert!(
        status.contains("read repairs: 1 rewritten (64KiB), 0 failed: fa 1"),
        "{status}"
    );
    assert!(array(&r10).failed_members().is_empty(), "{status}");
    assert!(read(&q, 0, size) == good);
}

/// The rewrite fails too: the member is failed (and recorded so in the superblocks), and
/// the array goes on serving the data from the other copy.
#[test]
fn a_repair_that_fails_fails_the_member() {
    let dir = tempfile::tempdir().expect("a directory");
    let (at, len) = (2 * MIB, 32 * KIB);
    let text = |members: &str, extra: &str| {
        format!(
            "{}{}{extra}[device.rr_fail]\ntype = \"mirror\"\nmembers = [{members}]\nmetadata = \"1\"\n",
            file("a", dir.path()),
            file("b", dir.path()),
        )
    };
    let m = open(&text("\"a\", \"b\"", ""), "rr_fail");
    let size = m.geometry().size_bytes;
    let good = pattern(3, size);
    queue(&m).write(0, &good, IoFlags::NONE).expect("fill");
    drop(m);
    // Started again with member a behind a fault that fails its first read of the range,
    // and then the repair's write.
    let faulty = fault("fa", "a", "[\"read\", \"write\"]", DATA_OFFSET + at, len, 2);
    let m = open(&text("\"fa\", \"b\"", &faulty), "rr_fail");
    let q = queue(&m);
    assert!(read(&q, at, len) == good[at as usize..][..len as usize]);
    let r = wait_repairs("rr_fail", |r| r.failed > 0);
    assert_eq!((r.repaired, r.failed), (0, 1), "{r:?}");
    assert_eq!(array(&m).failed_members(), vec!["fa".to_string()]);
    let status = array(&m).status().expect("a status");
    assert!(
        status.contains("[_U]") && status.contains("fa failed"),
        "{status}"
    );
    assert!(
        status.contains("read repairs: 0 rewritten (0B), 1 failed: fa 0 (1 failed)"),
        "{status}"
    );
    // Every read is served from b, and writes go on degraded.
    for _ in 0..4 {
        assert!(read(&q, at, len) == good[at as usize..][..len as usize]);
    }
    assert!(read(&q, 0, size) == good);
    let newer = pattern(4, len);
    q.write(at, &newer, IoFlags::NONE)
        .expect("a degraded write");
    assert!(read(&q, at, len) == newer);
    drop(q);
    drop(m);
    // The superblocks say so: started again on the healed device, a (which missed the
    // degraded write) is rebuilt, not read; were it taken as current, the first read
    // of a new queue (copy 0: a) would return the older data.
    let m = open(&text("\"a\", \"b\"", ""), "rr_fail");
    let q = queue(&m);
    for _ in 0..4 {
        assert!(read(&q, at, len) == newer);
    }
}

/// The racing write of [`a_repair_never_undoes_a_write_that_races_it`]: `data` at `at`,
/// after 5 ms if `late`.
fn race(q: &BlockingQueue, at: u64, data: &[u8], late: bool) {
    if late {
        std::thread::sleep(Duration::from_millis(5));
    }
    q.write(at, data, IoFlags::NONE).expect("the racing write");
}

/// A write to the range races the repair, sent from this queue or from another thread's,
/// on a mirror in the raw layout (writes counted in their queue's in-flight counter) and
/// on one with superblocks (the default: counted by the metadata's epoch).
/// The good member is slow (reads forwarded after 20 ms, writes after 30 ms), so that the
/// write's copy there lands late, and the repair's read of it is slow too. Sent at once
/// after the failed read is answered, the write is in flight when the repair starts (it
/// must wait for writes it did not count); sent a little later, it starts while the
/// repair reads (it must not land on the repaired member before the repair's write). A
/// repair that wrote the data it read before the write would leave the repaired member
/// older than the other: both must hold the write.
#[test]
fn a_repair_never_undoes_a_write_that_races_it() {
    let rounds = [(false, false), (true, false), (false, true), (true, true)];
    for (layout, metadata, data_offset) in
        [("raw", "metadata = \"none\"\n", 0), ("sb", "", DATA_OFFSET)]
    {
        for (round, (other_thread, late)) in rounds.into_iter().enumerate() {
            race_round(
                &format!("{layout}{round}"),
                metadata,
                data_offset,
                round as u64,
                other_thread,
                late,
            );
        }
    }
}

/// One round of [`a_repair_never_undoes_a_write_that_races_it`], on mirror
/// `rr_race_{round}` with `metadata` lines, whose data starts at `data_offset` on each
/// member.
fn race_round(
    round: &str,
    metadata: &str,
    data_offset: u64,
    n: u64,
    other_thread: bool,
    late: bool,
) {
    let name = format!("rr_race_{round}");
    let (at, len) = (MIB + n * 64 * KIB, 16 * KIB);
    let text = format!(
        "{}{}{}[device.db]\ntype = \"delay\"\nbase = \"b\"\nread = \"20ms\"\nwrite = \"30ms\"\n[device.{name}]\ntype = \"mirror\"\nmembers = [\"fa\", \"db\"]\n{metadata}",
        mem("a", "4M"),
        mem("b", "4M"),
        fault("fa", "a", "[\"read\"]", data_offset + at, len, 1)
    );
    let m = open(&text, &name);
    let size = m.geometry().size_bytes;
    let old = pattern(5, size);
    queue(&m).write(0, &old, IoFlags::NONE).expect("fill");
    let (a, b) = (find(&m, "a"), find(&m, "b"));
    damage(&a, data_offset + at, len);
    let newer = pattern(6 + n as u8, len);
    // The other thread's queue is open before the race starts.
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let writer = other_thread.then(|| {
        let (m, newer) = (m.clone(), newer.clone());
        let (ready, is_ready) = std::sync::mpsc::channel::<()>();
        let handle = std::thread::spawn(move || {
            let q = queue(&m);
            ready.send(()).expect("ready");
            wait.recv().expect("go");
            race(&q, at, &newer, late);
        });
        is_ready.recv().expect("the writer's queue");
        handle
    });
    let q = queue(&m);
    assert!(
        read(&q, at, len) == old[at as usize..][..len as usize],
        "round {round}: the read comes before the write"
    );
    match writer {
        Some(handle) => {
            go.send(()).expect("go");
            handle.join().expect("the writer");
        }
        None => race(&q, at, &newer, late),
    }
    let r = wait_repairs(&name, |r| r.repaired + r.failed > 0);
    assert_eq!((r.repaired, r.failed), (1, 0), "round {round}: {r:?}");
    assert!(array(&m).failed_members().is_empty());
    // The repair's write has ended once it is counted: the copies must agree on the
    // newer data.
    let on_a = read(&queue(&a), data_offset + at, len);
    let on_b = read(&queue(&b), data_offset + at, len);
    assert!(
        on_b == newer,
        "round {round}: the good member has the write"
    );
    assert!(
        on_a == newer,
        "round {round}: the repaired member holds {}",
        if on_a == old[at as usize..][..len as usize] {
            "the older data: the repair undid the write"
        } else {
            "neither the older data nor the write"
        }
    );
    for _ in 0..2 {
        assert!(read(&q, at, len) == newer);
    }
}
