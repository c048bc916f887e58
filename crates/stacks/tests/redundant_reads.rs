//! Reads of mirrors and raid10s under a running load: each read goes to one copy, in
//! turn, and never to a copy that does not hold current data. A member that fails between
//! two reads is not read again; a member re-added and being rebuilt is not read until its
//! rebuild is done (only below its progress, by the general path).
//!
//! Reads from other threads run throughout, each on its queue: a read sent after a write
//! was acknowledged must return that write's data.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use cairn_config::StackFile;
use cairn_core::blocking::{BlockingQueue, Request};
use cairn_core::{Array, Device, IoFlags, Op, Switches};
use cairn_stacks::array::{ArrayAction, ArrayAdmin};
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

fn queue(d: &Arc<dyn Device>) -> BlockingQueue {
    BlockingQueue::open(d, Switches::default()).expect("a queue")
}

fn admin(d: &Arc<dyn Device>) -> Arc<dyn ArrayAdmin> {
    d.capability::<dyn ArrayAdmin>()
        .expect("an array the admin changes")
}

fn read(q: &BlockingQueue, offset: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    q.read(offset, &mut buf).expect("read");
    buf
}

fn mem(name: &str, size: &str) -> String {
    format!("[device.{name}]\ntype = \"mem\"\nsize = \"{size}\"\n")
}

/// Threads reading `[0, len)` of a device in 4 KiB requests at spread offsets, each on a
/// queue of its own, until stopped. The data they must see is `now` once `settled`
/// is set (it is set after the write of `now` is acknowledged; a read sent before may
/// return the old data or the new).
struct Readers {
    stop: Arc<AtomicBool>,
    settled: Arc<AtomicBool>,
    /// Reads that returned the new data after `settled` was set before they were sent.
    checked: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<Result<(), String>>>,
}

impl Readers {
    fn start(d: &Arc<dyn Device>, len: u64, now: Arc<Vec<u8>>, threads: usize) -> Readers {
        let stop = Arc::new(AtomicBool::new(false));
        let settled = Arc::new(AtomicBool::new(false));
        let checked = Arc::new(AtomicU64::new(0));
        let (ready, started) = std::sync::mpsc::channel();
        let threads: Vec<_> = (0..threads as u64)
            .map(|t| {
                let d = d.clone();
                let (stop, settled, checked) = (stop.clone(), settled.clone(), checked.clone());
                let (now, ready) = (now.clone(), ready.clone());
                std::thread::spawn(move || {
                    let q = queue(&d);
                    let mut at = t * 12 * KIB;
                    let mut reads = 0;
                    while !stop.load(SeqCst) {
                        reads += 1;
                        if reads == 3 {
                            // Both copies were read on this queue.
                            let _ = ready.send(());
                        }
                        let after = settled.load(SeqCst);
                        let got = read(&q, at, 4 * KIB);
                        if after {
                            if got[..] != now[at as usize..][..4096] {
                                return Err(format!("a stale read at {at}"));
                            }
                            checked.fetch_add(1, SeqCst);
                        }
                        at = (at + 36 * KIB) % len;
                    }
                    Ok(())
                })
            })
            .collect();
        for _ in &threads {
            started.recv().expect("a reader started");
        }
        Readers {
            stop,
            settled,
            checked,
            threads,
        }
    }

    /// Stops them; the reads they checked (it fails if any was stale).
    fn stop(self) -> u64 {
        self.stop.store(true, SeqCst);
        for t in self.threads {
            t.join()
                .expect("a reader")
                .unwrap_or_else(|e| panic!("{e}"));
        }
        self.checked.load(SeqCst)
    }
}

/// A member whose write fails is failed, and no read goes to it after: it lost that
/// write. The reads run on queues that read both copies before (each read goes to the
/// next copy in turn), and on them too from the moment the write is acknowledged.
fn a_member_failed_between_two_reads(kind: &str, members: usize, metadata: &str) {
    let offset = if metadata == "none" { 0 } else { DATA_OFFSET };
    // Logical [0, 64K) is on members 0 and 1 at their start (raid10: its first chunk).
    let (len, failing) = (64 * KIB, 1);
    let mut text: String = (0..members).map(|i| mem(&format!("m{i}"), "4M")).collect();
    text += &format!(
        "[device.f]\ntype = \"fault\"\nbase = \"m{failing}\"\nfail = [\"write\"]\nsectors = [{}, {}]\ntimes = 1\n",
        offset / 512,
        (offset + len) / 512
    );
    let names: Vec<String> = (0..members)
        .map(|i| {
            if i == failing {
                "\"f\"".into()
            } else {
                format!("\"m{i}\"")
            }
        })
        .collect();
    text += &format!(
        "[device.r]\ntype = \"{kind}\"\nmetadata = \"{metadata}\"\nmembers = [{}]\n",
        names.join(", ")
    );
    let d = open(&text, "r");
    let q = queue(&d);
    // Both copies hold zeroes; each is read in turn.
    for _ in 0..4 {
        assert!(read(&q, 0, 4 * KIB).iter().all(|&b| b == 0));
    }
    let now = pattern(5, len as usize);
    let readers = Readers::start(&d, len, Arc::new(now.clone()), 2);
    q.write(0, &now, IoFlags::NONE)
        .expect("the write is acknowledged: one copy took it");
    readers.settled.store(true, SeqCst);
    let array = d.capability::<dyn Array>().expect("an array");
    assert_eq!(array.failed_members(), ["f"], "{kind} {metadata}");
    for i in 0..8 {
        assert!(
            read(&q, (i % 16) * 4 * KIB, 4 * KIB) == now[(i % 16) as usize * 4096..][..4096],
            "{kind} {metadata}: read {i} after the write is stale: the failed member was read"
        );
    }
    std::thread::sleep(Duration::from_millis(50));
    assert!(readers.stop() > 0, "{kind} {metadata}: no read was checked");
}

#[test]
fn a_mirror_member_failed_between_two_reads_is_not_read_again() {
    for metadata in ["none", "1"] {
        a_member_failed_between_two_reads("mirror", 2, metadata);
    }
}

#[test]
fn a_raid10_member_failed_between_two_reads_is_not_read_again() {
    for metadata in ["none", "1"] {
        a_member_failed_between_two_reads("raid10", 4, metadata);
    }
}

/// A member failed by the admin misses a write; re-added while reads run, it is rebuilt
/// (slowly), and no read returns its old data meanwhile: it is current only below its
/// rebuild's progress until the rebuild ends.
#[test]
fn a_member_rebuilt_while_reads_run_is_not_read_ahead_of_its_rebuild() {
    let text = format!(
        "{}{}[device.r]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nbitmap = \"none\"\nrebuild_min = \"1M\"\nrebuild_max = \"2M\"\n",
        mem("a", "4M"),
        mem("b", "4M")
    );
    let d = open(&text, "r");
    let size = d.geometry().size_bytes;
    let q = queue(&d);
    q.write(0, &pattern(1, size as usize), IoFlags::NONE)
        .expect("fill");
    // The readers' queues exist, and have read both copies, before b fails.
    let now = Arc::new(pattern(2, size as usize));
    let readers = Readers::start(&d, size, now.clone(), 2);
    admin(&d)
        .act(&ArrayAction::Fail { member: "b".into() })
        .expect("fail b");
    q.write(0, &now, IoFlags::NONE)
        .expect("b misses this write");
    readers.settled.store(true, SeqCst);
    admin(&d)
        .act(&ArrayAction::ReAdd { member: "b".into() })
        .expect("re-add b");
    assert!(
        d.describe().contains("degraded"),
        "the rebuild (3 MiB at 2 MB/s) has not ended: {}",
        d.describe()
    );
    for _ in 0..2400 {
        if !d.describe().contains("degraded") {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!d.describe().contains("degraded"), "{}", d.describe());
    // Both copies current again: each is read in turn, and both hold the new data.
    for i in 0..4 {
        assert!(read(&q, i * 4 * KIB, 4 * KIB) == now[i as usize * 4096..][..4096]);
    }
    assert!(readers.stop() > 0, "no read was checked");
    let b = queue(&find(&d, "b"));
    assert!(
        read(&b, DATA_OFFSET, size) == now[..],
        "b holds the new data"
    );
}

/// A member is removed only once no read sent to it is in flight: the admin's `remove`
/// returns after a read sent to the member before it failed has ended (reads of it are
/// slow here), so its device is closed with nothing of the array in flight on it. (Reads
/// are counted in the gate a change of members waits on, one count for all those in
/// flight under one epoch: it is left when the last ends, not the first.)
#[test]
fn a_removed_member_has_no_read_in_flight_once_remove_returns() {
    let text = format!(
        "{}{}[device.b]\ntype = \"delay\"\nbase = \"b0\"\nread = \"300ms\"\n[device.r]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\n",
        mem("a", "4M"),
        mem("b0", "4M")
    );
    let d = open(&text, "r");
    let ended = Arc::new(AtomicBool::new(false));
    let (sent, on_its_way) = std::sync::mpsc::channel();
    let reader = {
        let (d, ended) = (d.clone(), ended.clone());
        std::thread::spawn(move || {
            let q = queue(&d);
            // A new queue reads the first copy first, then the second (b), then the
            // first again: of the two reads sent together, the one to b ends last.
            read(&q, 0, 4 * KIB);
            sent.send(()).expect("the test waits");
            let (mut x, mut y) = (vec![0u8; 4096], vec![0u8; 4096]);
            let mut two = [(0, &mut x), (4 * KIB, &mut y)].map(|(offset, buf)| Request {
                op: Op::Read,
                flags: IoFlags::NONE,
                offset,
                len: 0,
                buf: Some(buf.as_mut_slice()),
            });
            for r in q.run(&mut two) {
                r.expect("read");
            }
            ended.store(true, SeqCst);
        })
    };
    on_its_way.recv().expect("the reader");
    // Setting up, not measuring: the second read is sent meanwhile.
    std::thread::sleep(Duration::from_millis(50));
    admin(&d)
        .act(&ArrayAction::Fail { member: "b".into() })
        .expect("fail b");
    admin(&d)
        .act(&ArrayAction::Remove { member: "b".into() })
        .expect("remove b");
    assert!(
        ended.load(SeqCst),
        "remove returned while a read sent to b was in flight"
    );
    reader.join().expect("the reader");
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
