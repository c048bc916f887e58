//! Volatile mem devices and power cuts: what a flush made durable survives, what was
//! only written does not, through mirrors, raid10 and the `fault` device's trigger.

use std::sync::Arc;

use cairn_config::StackFile;
use cairn_core::blocking::BlockingQueue;
use cairn_core::{Device, IoFlags, Op, Switches};
use cairn_leaves::LeafSpec;
use cairn_testkit::pattern;

fn queue(d: &Arc<dyn Device>) -> BlockingQueue {
    BlockingQueue::open(d, Switches::default()).unwrap()
}

fn read(q: &BlockingQueue, offset: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    q.read(offset, &mut b).unwrap();
    b
}

fn volatile_mem(size: &str) -> Arc<dyn Device> {
    let s = LeafSpec::parse(&format!("mem:{size},volatile=1")).unwrap();
    cairn_leaves::open(&s, "v").unwrap()
}

#[test]
fn flushed_writes_survive_and_unflushed_ones_do_not() {
    let d = volatile_mem("1M");
    let q = queue(&d);
    let a = pattern(1, 8192);
    q.write(0, &a, IoFlags::NONE).unwrap();
    q.flush().unwrap();
    // Partial pages on both ends, over flushed data and over nothing.
    let b = pattern(77, 10240);
    q.write(1536, &b, IoFlags::NONE).unwrap();
    assert_eq!(
        read(&q, 1536, b.len()),
        b,
        "unflushed data is visible before the cut"
    );
    d.power_cut();
    let got = read(&q, 0, 16384);
    assert_eq!(&got[..8192], &a[..], "flushed data survives");
    assert!(
        got[8192..].iter().all(|&x| x == 0),
        "unflushed data is gone"
    );
}

#[test]
fn zeroes_and_discards_are_volatile_too_and_fua_is_durable() {
    let d = volatile_mem("1M");
    let q = queue(&d);
    let a = pattern(9, 16384);
    q.write(0, &a, IoFlags::NONE).unwrap();
    q.flush().unwrap();
    q.zero(Op::WriteZeroes, 0, 4096, IoFlags::NONE).unwrap();
    q.zero(Op::Discard, 8192, 2048, IoFlags::NONE).unwrap();
    assert!(read(&q, 0, 4096).iter().all(|&x| x == 0));
    d.power_cut();
    assert_eq!(
        read(&q, 0, 16384),
        a,
        "unflushed zeroing is undone by the cut"
    );
    // A FUA write is durable when it completes.
    let f = pattern(200, 4096);
    q.write(65536, &f, IoFlags::FUA).unwrap();
    d.power_cut();
    assert_eq!(read(&q, 65536, 4096), f);
    // Flushed zeroes stay zero.
    q.zero(Op::WriteZeroes, 0, 8192, IoFlags::NONE).unwrap();
    q.flush().unwrap();
    d.power_cut();
    assert!(read(&q, 0, 8192).iter().all(|&x| x == 0));
    assert_eq!(read(&q, 8192, 8192), a[8192..].to_vec());
}

/// Where data starts on each member of an array with superblocks (the default).
const DATA_OFFSET: u64 = 1 << 20;

/// Whether `member` holds a cairn superblock in one of its two slots.
fn has_superblock(member: &Arc<dyn Device>) -> bool {
    let slots = read(&queue(member), 0, 16384);
    slots.starts_with(b"CAIRNSB\0") || slots[8192..].starts_with(b"CAIRNSB\0")
}

/// An array of `n` volatile 4 MiB mems, with superblocks (the default).
fn stack(kind: &str, n: usize) -> Arc<dyn Device> {
    let mut text = String::new();
    for i in 0..n {
        text += &format!("[device.m{i}]\ntype = \"mem\"\nsize = \"4M\"\nvolatile = true\n");
    }
    let members: Vec<String> = (0..n).map(|i| format!("\"m{i}\"")).collect();
    text += &format!(
        "[device.top]\ntype = \"{kind}\"\nmembers = [{}]\n",
        members.join(", ")
    );
    if kind == "raid10" {
        text += "chunk = \"64K\"\n";
    }
    StackFile::parse(&text).unwrap().open("top").unwrap()
}

#[test]
fn a_power_cut_reaches_every_member_of_mirrors_and_raid10() {
    for (kind, n) in [("mirror", 2), ("mirror", 3), ("raid10", 4)] {
        let d = stack(kind, n);
        let q = queue(&d);
        // Spans several chunks of the raid10, so every member holds some of it.
        let a = pattern(3, 512 << 10);
        q.write(0, &a, IoFlags::NONE).unwrap();
        q.flush().unwrap();
        let b = pattern(99, 256 << 10);
        q.write(128 << 10, &b, IoFlags::NONE).unwrap();
        d.power_cut();
        // Whichever copy a read goes to holds the flushed data.
        for _ in 0..n {
            assert_eq!(read(&q, 0, a.len()), a, "{kind} of {n}");
        }
        // The superblocks, written durably when the array started, survived the cut.
        for m in d.children() {
            assert!(
                has_superblock(&m),
                "{kind} of {n}: {} lost its superblock",
                m.name()
            );
        }
        // Every member lost its unflushed part: read the members directly, where their
        // data starts.
        let copies: Vec<Vec<u8>> = d
            .children()
            .iter()
            .map(|m| read(&queue(m), DATA_OFFSET, 256 << 10))
            .collect();
        if kind == "mirror" {
            for c in &copies {
                assert_eq!(&c[..], &a[..256 << 10], "{kind} of {n}: a member");
            }
        } else {
            // Near layout, 2 copies: members 0 and 1 hold the same chunks, as do 2 and 3.
            assert_eq!(copies[0], copies[1]);
            assert_eq!(copies[2], copies[3]);
            // Logical chunk 0 is chunk 0 of members 0 and 1.
            assert_eq!(&copies[0][..64 << 10], &a[..64 << 10]);
        }
    }
}

#[test]
fn a_fault_device_cuts_the_power_once_when_its_condition_holds() {
    let text = r#"
[device.m]
type = "mem"
size = "1M"
volatile = true
[device.cut]
type = "fault"
base = "m"
power_cut = true
after_ios = 3
"#;
    let f = StackFile::parse(text).unwrap();
    let d = f.open("cut").unwrap();
    assert!(
        d.describe().contains("cutting the power"),
        "{}",
        d.describe()
    );
    let q = queue(&d);
    let w1 = pattern(1, 4096);
    let w2 = pattern(2, 4096);
    q.write(0, &w1, IoFlags::NONE).unwrap(); // request 0
    q.flush().unwrap(); // 1
    q.write(4096, &w2, IoFlags::NONE).unwrap(); // 2
                                                // Request 3: the power goes; it fails, and w2 (never flushed) is lost.
    assert!(q.write(8192, &w2, IoFlags::NONE).is_err());
    assert_eq!(read(&q, 0, 4096), w1);
    assert!(read(&q, 4096, 8192).iter().all(|&x| x == 0));
    // Only once: the device works again afterwards.
    q.write(4096, &w2, IoFlags::NONE).unwrap();
    q.flush().unwrap();
    assert_eq!(read(&q, 4096, 4096), w2);
}

// FUA on a volatile mem, as on a real disk: a FUA write (or zeroing) is durable when it
// completes, its own range and nothing else. Other writes still in the volatile layer
// stay volatile until a flush; a flush makes everything completed before it durable; a
// power cut goes back to what was made durable.

#[test]
fn fua_makes_its_own_range_durable_and_nothing_else() {
    // 512-byte blocks: block 0 (page 0) written plainly, block 8 (page 1) with FUA.
    let d = volatile_mem("1M");
    let q = queue(&d);
    let a = pattern(1, 512);
    let b = pattern(2, 512);
    q.write(0, &a, IoFlags::NONE).unwrap();
    q.write(8 * 512, &b, IoFlags::FUA).unwrap();
    d.power_cut();
    assert_eq!(read(&q, 8 * 512, 512), b, "the FUA write is durable");
    assert!(
        read(&q, 0, 512).iter().all(|&x| x == 0),
        "an earlier unflushed write is not made durable by a later FUA"
    );
}

#[test]
fn fua_persists_its_own_blocks_of_a_page_and_not_its_neighbours() {
    // Both writes land in the same 4 KiB page: FUA is per byte range, not per page.
    let d = volatile_mem("1M");
    let q = queue(&d);
    let a = pattern(3, 1024);
    let b = pattern(4, 512);
    q.write(0, &a, IoFlags::NONE).unwrap();
    q.write(2048, &b, IoFlags::FUA).unwrap();
    q.write(3072, &a, IoFlags::NONE).unwrap();
    d.power_cut();
    let got = read(&q, 0, 4096);
    assert!(
        got[..2048].iter().all(|&x| x == 0),
        "blocks 0-3 were volatile"
    );
    assert_eq!(&got[2048..2560], &b[..], "block 4 was FUA");
    assert!(
        got[2560..].iter().all(|&x| x == 0),
        "blocks 5-7 were volatile"
    );
}

#[test]
fn fua_inside_an_unflushed_write_persists_only_the_overlap() {
    let d = volatile_mem("1M");
    let q = queue(&d);
    let y = pattern(5, 8192);
    let x = pattern(6, 4096);
    q.write(0, &y, IoFlags::NONE).unwrap();
    q.write(2048, &x, IoFlags::FUA).unwrap();
    let mut now = y.clone();
    now[2048..6144].copy_from_slice(&x);
    assert_eq!(
        read(&q, 0, 8192),
        now,
        "reads see both, the FUA write on top"
    );
    d.power_cut();
    let got = read(&q, 0, 8192);
    assert!(
        got[..2048].iter().all(|&v| v == 0),
        "the unflushed write's head is lost"
    );
    assert_eq!(&got[2048..6144], &x[..], "the FUA range is durable");
    assert!(
        got[6144..].iter().all(|&v| v == 0),
        "the unflushed write's tail is lost"
    );
}

#[test]
fn a_later_plain_write_over_a_fua_range_is_volatile_and_the_cut_restores_the_fua_data() {
    let d = volatile_mem("1M");
    let q = queue(&d);
    let flushed = pattern(7, 16384);
    q.write(0, &flushed, IoFlags::NONE).unwrap();
    q.flush().unwrap();
    // Unflushed, in another page: a FUA must not make it durable.
    let z = pattern(8, 4096);
    q.write(32768, &z, IoFlags::NONE).unwrap();
    let x = pattern(9, 4096);
    q.write(4096, &x, IoFlags::FUA).unwrap();
    // Over half the FUA range and past it, without FUA: volatile again, with new data.
    let y = pattern(10, 4096);
    q.write(6144, &y, IoFlags::NONE).unwrap();
    let mut now = flushed.clone();
    now[4096..8192].copy_from_slice(&x);
    now[6144..10240].copy_from_slice(&y);
    assert_eq!(read(&q, 0, 16384), now);
    d.power_cut();
    let mut durable = flushed.clone();
    durable[4096..8192].copy_from_slice(&x);
    assert_eq!(
        read(&q, 0, 16384),
        durable,
        "the FUA data is back under the lost write; the flushed data around it stays"
    );
    assert!(
        read(&q, 32768, 4096).iter().all(|&v| v == 0),
        "an unflushed write elsewhere is lost"
    );
    // A flush after a rewrite makes the rewrite durable, FUA'd range included.
    q.write(4096, &y, IoFlags::NONE).unwrap();
    q.flush().unwrap();
    d.power_cut();
    assert_eq!(read(&q, 4096, 4096), y);
}

#[test]
fn a_large_fua_write_across_regions_is_durable_and_its_neighbours_are_not() {
    // 1 MiB of FUA from 1.5 MiB (256 pages, across the 2 MiB region boundary), inside
    // 4 MiB of plain writes.
    let d = volatile_mem("8M");
    let q = queue(&d);
    let plain = pattern(13, 4 << 20);
    let fua = pattern(14, 1 << 20);
    q.write(0, &plain, IoFlags::NONE).unwrap();
    q.write(3 << 19, &fua, IoFlags::FUA).unwrap();
    q.zero(Op::WriteZeroes, 6 << 20, 1 << 20, IoFlags::FUA)
        .unwrap();
    d.power_cut();
    let got = read(&q, 0, 8 << 20);
    assert!(got[..3 << 19].iter().all(|&x| x == 0), "plain before: lost");
    assert_eq!(&got[3 << 19..5 << 19], &fua[..], "the FUA write is durable");
    assert!(got[5 << 19..].iter().all(|&x| x == 0), "plain after: lost");
}

#[test]
fn fua_zeroing_is_durable_and_leaves_other_writes_volatile() {
    let d = volatile_mem("1M");
    let q = queue(&d);
    let a = pattern(11, 16384);
    q.write(0, &a, IoFlags::NONE).unwrap();
    q.flush().unwrap();
    let b = pattern(12, 4096);
    q.write(65536, &b, IoFlags::NONE).unwrap();
    q.zero(Op::WriteZeroes, 0, 4096, IoFlags::FUA).unwrap();
    q.zero(Op::Discard, 8192, 1024, IoFlags::FUA).unwrap();
    d.power_cut();
    let got = read(&q, 0, 16384);
    assert!(
        got[..4096].iter().all(|&x| x == 0),
        "FUA write-zeroes is durable"
    );
    assert_eq!(&got[4096..8192], &a[4096..8192]);
    assert!(
        got[8192..9216].iter().all(|&x| x == 0),
        "FUA discard is durable"
    );
    assert_eq!(&got[9216..], &a[9216..]);
    assert!(
        read(&q, 65536, 4096).iter().all(|&x| x == 0),
        "the unflushed write is not made durable by the FUA zeroing"
    );
}

/// One step of the power-cut model.
#[derive(Debug, Clone)]
enum Action {
    Write {
        offset: u64,
        len: u64,
        seed: u8,
        fua: bool,
    },
    Zero {
        offset: u64,
        len: u64,
        discard: bool,
        fua: bool,
    },
    Flush,
    PowerCut,
    Read {
        offset: u64,
        len: u64,
    },
}

/// Fails naming the first byte (a device offset) where `got` and `want` differ.
fn same(
    got: &[u8],
    want: &[u8],
    offset: u64,
    when: &str,
) -> Result<(), proptest::test_runner::TestCaseError> {
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(proptest::test_runner::TestCaseError::fail(format!(
            "{when}: byte {} reads {}, the model says {}",
            offset + i as u64,
            got[i],
            want[i]
        ))),
    }
}

/// The model's device: 48 blocks of 512 bytes, six pages, so requests cross pages.
const MODEL_BLOCK: u64 = 512;
const MODEL_BLOCKS: u64 = 48;

fn cut_steps() -> impl proptest::strategy::Strategy<Value = Vec<Action>> {
    use proptest::prelude::*;
    let range = (0..MODEL_BLOCKS).prop_flat_map(|first| {
        (Just(first), 1..=(MODEL_BLOCKS - first).min(20))
            .prop_map(|(f, n)| (f * MODEL_BLOCK, n * MODEL_BLOCK))
    });
    let step = prop_oneof![
        8 => (range.clone(), any::<u8>(), prop::bool::weighted(0.3))
            .prop_map(|((offset, len), seed, fua)| Action::Write { offset, len, seed, fua }),
        2 => (range.clone(), any::<bool>(), prop::bool::weighted(0.3))
            .prop_map(|((offset, len), discard, fua)| Action::Zero { offset, len, discard, fua }),
        2 => Just(Action::Flush),
        2 => Just(Action::PowerCut),
        3 => range.prop_map(|(offset, len)| Action::Read { offset, len }),
    ];
    proptest::collection::vec(step, 1..60)
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config {
        cases: 256,
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    })]

    /// Random writes, FUA writes, zeroings, flushes and power cuts against a model of
    /// what a disk with a volatile write cache may and must keep. A cut must keep every
    /// byte a completed flush or FUA request made durable and may lose the rest; cairn
    /// loses all of the rest, which the model follows exactly: it keeps what reads see
    /// and what is durable, a write changes the first, a FUA request both (its own range
    /// only), a flush copies the first to the second and a cut the second to the first.
    #[test]
    fn a_power_cut_keeps_exactly_what_flush_and_fua_made_durable(steps in cut_steps()) {
        let size = MODEL_BLOCK * MODEL_BLOCKS;
        let d = volatile_mem(&size.to_string());
        let q = queue(&d);
        let mut now = vec![0u8; size as usize];
        let mut durable = vec![0u8; size as usize];
        for (i, step) in steps.iter().enumerate() {
            match *step {
                Action::Write { offset, len, seed, fua } => {
                    let data = pattern(seed, len as usize);
                    let flags = if fua { IoFlags::FUA } else { IoFlags::NONE };
                    q.write(offset, &data, flags).unwrap();
                    let r = offset as usize..(offset + len) as usize;
                    now[r.clone()].copy_from_slice(&data);
                    if fua {
                        durable[r].copy_from_slice(&data);
                    }
                }
                Action::Zero { offset, len, discard, fua } => {
                    let op = if discard { Op::Discard } else { Op::WriteZeroes };
                    let flags = if fua { IoFlags::FUA } else { IoFlags::NONE };
                    q.zero(op, offset, len, flags).unwrap();
                    let r = offset as usize..(offset + len) as usize;
                    now[r.clone()].fill(0);
                    if fua {
                        durable[r].fill(0);
                    }
                }
                Action::Flush => {
                    q.flush().unwrap();
                    durable.copy_from_slice(&now);
                }
                Action::PowerCut => {
                    d.power_cut();
                    now.copy_from_slice(&durable);
                    same(&read(&q, 0, size as usize), &now, 0, &format!("after the cut at step {i}"))?;
                }
                Action::Read { offset, len } => {
                    let r = offset as usize..(offset + len) as usize;
                    same(&read(&q, offset, len as usize), &now[r], offset, &format!("read at step {i}"))?;
                }
            }
        }
        d.power_cut();
        same(&read(&q, 0, size as usize), &durable, 0, "after the final cut")?;
    }
}
