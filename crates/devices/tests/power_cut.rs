//! Volatile mem devices and power cuts: what a flush made durable survives, what was
//! only written does not, through mirrors, raid10 and the `fault` device's trigger.

use std::sync::Arc;

use cairn_core::blocking::BlockingQueue;
use cairn_core::{Device, IoFlags, Op, Switches};
use cairn_devices::config::StackFile;
use cairn_devices::LeafSpec;

fn queue(d: &Arc<dyn Device>) -> BlockingQueue {
    BlockingQueue::open(d, Switches::default()).unwrap()
}

fn read(q: &BlockingQueue, offset: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    q.read(offset, &mut b).unwrap();
    b
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8))
        .collect()
}

fn volatile_mem(size: &str) -> Arc<dyn Device> {
    let s = LeafSpec::parse(&format!("mem:{size},volatile=1")).unwrap();
    cairn_devices::open(&s, "v").unwrap()
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
