//! Statistics of stacked devices: however a request travels (remapped to a member that
//! counts it for the stacked device too, or answered by the stacked device itself), every
//! device counts every request that passed through it, in its queue's snapshot and in the
//! process-wide registry that the admin socket and the metrics endpoint read.
//!
//! The linears here ask for the raw layout (`metadata = "none"`): members of an array with
//! superblocks also count the superblock reads and writes, and these tests count client
//! requests exactly (`stack_model.rs` checks the stacked device's own counts with
//! metadata).

use std::sync::Arc;

use cairn_config::StackFile;
use cairn_core::blocking::BlockingQueue;
use cairn_core::reactor::DispatchMode;
use cairn_core::stats::{registry, DeviceStatsSnapshot};
use cairn_core::{Device, IoFlags, Op, Switches};
use cairn_testkit::pattern;

const K: u64 = 1024;

/// Opens device `top` of the stack file `text`, whose device names carry `prefix` so that
/// tests running at once in this process do not share registry entries.
fn open(text: &str, top: &str) -> Arc<dyn Device> {
    let file = StackFile::parse(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    file.open(top).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

fn mem(name: &str, size: u64) -> String {
    format!("[device.{name}]\ntype = \"mem\"\nsize = {size}\n\n")
}

fn registered(name: &str) -> DeviceStatsSnapshot {
    registry()
        .device(name, u64::MAX)
        .unwrap_or_else(|| panic!("'{name}' is not in the registry"))
}

/// (requests, bytes) of `op`.
fn counted(s: &DeviceStatsSnapshot, op: Op) -> (u64, u64) {
    (s.ios[op.index()], s.sectors[op.index()] * 512)
}

/// Three writes to a linear of two 64 KiB members: one whole in each member, one across
/// both (split in two). Each is read back.
fn three_writes(q: &BlockingQueue) {
    for (seed, offset, len) in [(1, 0, 4 * K), (2, 64 * K, 4 * K), (3, 60 * K, 8 * K)] {
        let data = pattern(seed, len);
        q.write(offset, &data, IoFlags::NONE).expect("write");
        let mut back = vec![0u8; len as usize];
        q.read(offset, &mut back).expect("read");
        assert!(back == data, "read back what was written at {offset}");
    }
}

#[test]
fn a_request_remapped_to_a_member_counts_for_both() {
    let text = format!(
        "{}{}[device.ds_lin]\ntype = \"linear\"\nmembers = [\"ds_a\", \"ds_b\"]\nmetadata = \"none\"\n",
        mem("ds_a", 64 * K),
        mem("ds_b", 64 * K)
    );
    let top = open(&text, "ds_lin");
    let q = BlockingQueue::open(&top, Switches::default()).expect("queue opens");
    three_writes(&q);
    q.flush().expect("flush");

    // The requests that fit one member were remapped: the stacked device's own counters
    // saw only the split write (and the flush); its members counted the others for it.
    let own = q.queue().stats().counters();
    assert_eq!(
        own.ios(Op::Write),
        1,
        "only the split write is the stack's own"
    );
    assert_eq!(
        own.ios(Op::Read),
        1,
        "only the split read is the stack's own"
    );

    for s in [q.queue().stats().snapshot(u64::MAX), registered("ds_lin")] {
        assert_eq!(counted(&s, Op::Write), (3, 16 * K));
        assert_eq!(counted(&s, Op::Read), (3, 16 * K));
        assert_eq!(s.ios[Op::Flush.index()], 1);
        assert_eq!((s.in_flight, s.errors), (0, 0));
        assert_eq!(s.latency[Op::Write.index()].len(), 3);
    }
    // Each member: its whole request, and its piece of the split one.
    let members = q.queue().children();
    for (i, name) in ["ds_a", "ds_b"].into_iter().enumerate() {
        for s in [members[i].stats().snapshot(u64::MAX), registered(name)] {
            assert_eq!(counted(&s, Op::Write), (2, 8 * K), "{name}");
            assert_eq!(counted(&s, Op::Read), (2, 8 * K), "{name}");
            assert_eq!(s.in_flight, 0, "{name}");
        }
    }
    // Closing the queues keeps the totals (the registry folds closed queues in).
    drop(members);
    drop(q);
    assert_eq!(counted(&registered("ds_lin"), Op::Write), (3, 16 * K));
    assert_eq!(counted(&registered("ds_a"), Op::Write), (2, 8 * K));
}

#[test]
fn stacks_over_stacks_and_wrappers_count_every_level() {
    // top = linear(mid, slow); mid = linear(m0, m1) over mem; slow = delay over mem.
    // A stacked member and a wrapper cannot count for the device above them: the top
    // device counts those requests itself; mid still delegates to its mem members.
    let text = format!(
        "{}{}{}[device.dn_mid]\ntype = \"linear\"\nmembers = [\"dn_m0\", \"dn_m1\"]\nmetadata = \"none\"\n\n\
         [device.dn_slow]\ntype = \"delay\"\nbase = \"dn_m2\"\nread = \"1us\"\n\n\
         [device.dn_top]\ntype = \"linear\"\nmembers = [\"dn_mid\", \"dn_slow\"]\nmetadata = \"none\"\n",
        mem("dn_m0", 32 * K),
        mem("dn_m1", 32 * K),
        mem("dn_m2", 64 * K),
    );
    let top = open(&text, "dn_top");
    for dispatch in [DispatchMode::Inline, DispatchMode::Handoff] {
        let before: Vec<DeviceStatsSnapshot> = ["dn_top", "dn_mid", "dn_slow", "dn_m0", "dn_m1"]
            .iter()
            .map(|n| registry().device(n, u64::MAX).unwrap_or_else(empty))
            .collect();
        let q = BlockingQueue::open(
            &top,
            Switches {
                dispatch,
                ..Switches::default()
            },
        )
        .expect("queue opens");
        // 4 KiB in m0, 4 KiB in m1, 8 KiB across mid and slow (split), 4 KiB in slow.
        for (seed, offset, len) in [
            (1, 0, 4 * K),
            (2, 32 * K, 4 * K),
            (3, 60 * K, 8 * K),
            (4, 100 * K, 4 * K),
        ] {
            let data = pattern(seed, len);
            q.write(offset, &data, IoFlags::NONE).expect("write");
            let mut back = vec![0u8; len as usize];
            q.read(offset, &mut back).expect("read");
            assert!(back == data, "{dispatch:?}: read back at {offset}");
        }
        let s = q.queue().stats().snapshot(u64::MAX);
        assert_eq!(counted(&s, Op::Write), (4, 20 * K), "{dispatch:?}");
        drop(q);
        let want = [
            ("dn_top", 4, 20 * K),
            ("dn_mid", 3, 12 * K),
            ("dn_slow", 2, 8 * K),
            ("dn_m0", 1, 4 * K),
            ("dn_m1", 2, 8 * K),
        ];
        for ((name, ios, bytes), b) in want.into_iter().zip(&before) {
            let s = registered(name).since(b);
            assert_eq!(counted(&s, Op::Write), (ios, bytes), "{dispatch:?} {name}");
            assert_eq!(counted(&s, Op::Read), (ios, bytes), "{dispatch:?} {name}");
        }
    }
}

fn empty() -> DeviceStatsSnapshot {
    cairn_core::stats::QueueStats::new(cairn_core::stats::StatsMode::On).snapshot(0)
}
