//! Allocation maps (`Device::extents`, NBD's `base:allocation`): holes are reported only
//! where reads return zeroes, data where something was written, through every layer.

use std::sync::Arc;

use cairn_core::blocking::BlockingQueue;
use cairn_core::{Device, Extent, IoFlags, Switches};
use cairn_devices::config::StackFile;
use cairn_devices::LeafSpec;

const MIB: u64 = 1 << 20;

fn map(d: &dyn Device, offset: u64, len: u64) -> Vec<Extent> {
    let mut out = Vec::new();
    d.extents(offset, len, &mut out).unwrap();
    // Consecutive, non-empty, never past the range, merged.
    assert!(out.iter().all(|e| e.len > 0));
    assert!(out.iter().map(|e| e.len).sum::<u64>() <= len);
    for w in out.windows(2) {
        assert!(w[0].hole != w[1].hole || w[0].zero != w[1].zero, "{out:?}");
    }
    out
}

fn leaf(spec: &str) -> Arc<dyn Device> {
    let s = LeafSpec::parse(spec).unwrap();
    cairn_devices::open(&s, &s.default_name()).unwrap()
}

fn write(d: &Arc<dyn Device>, offset: u64, len: u64) {
    let q = BlockingQueue::open(d, Switches::default()).unwrap();
    q.write(offset, &vec![0xa5u8; len as usize], IoFlags::NONE)
        .unwrap();
}

#[test]
fn null_is_one_hole() {
    let d = leaf("null:8M");
    assert_eq!(map(&*d, 4096, MIB), vec![Extent::hole(MIB)]);
}

#[test]
fn mem_reports_written_regions_as_data() {
    let d = leaf("mem:16M");
    assert_eq!(map(&*d, 0, 16 * MIB), vec![Extent::hole(16 * MIB)]);
    write(&d, 5 * MIB, 4096);
    // Region granularity (2 MiB): [4M, 6M) is data.
    assert_eq!(
        map(&*d, 0, 16 * MIB),
        vec![
            Extent::hole(4 * MIB),
            Extent::data(2 * MIB),
            Extent::hole(10 * MIB)
        ]
    );
    // A sub-range starts and ends where asked.
    assert_eq!(
        map(&*d, 5 * MIB, 2 * MIB),
        vec![Extent::data(MIB), Extent::hole(MIB)]
    );
}

#[test]
fn file_holes_come_from_the_file_system() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sparse.img");
    let d = leaf(&format!("file:{},size=16M", path.display()));
    write(&d, 8 * MIB, MIB);
    let m = map(&*d, 0, 16 * MIB);
    assert_eq!(m.iter().map(|e| e.len).sum::<u64>(), 16 * MIB);
    // Whatever the file system's granularity, the written MiB is data and the start is
    // a hole on every file system with holes (tmpfs, ext4, xfs, btrfs).
    let mut at = 0;
    for e in &m {
        if at < 9 * MIB && at + e.len > 8 * MIB {
            assert!(!e.hole && !e.zero, "{m:?}");
        }
        at += e.len;
    }
    if m.len() > 1 {
        assert!(m[0].hole && m[0].zero, "{m:?}");
    }
}

#[test]
fn stacks_map_through_their_layout() {
    let text = r#"
[device.a]
type = "mem"
size = "8M"
[device.b]
type = "mem"
size = "8M"
[device.c]
type = "mem"
size = "8M"
[device.d]
type = "mem"
size = "8M"
[device.r]
type = "raid10"
members = ["a", "b", "c", "d"]
chunk = "1M"
"#;
    let f = StackFile::parse(text).unwrap();
    let r = f.open("r").unwrap();
    assert_eq!(map(&*r, 0, 16 * MIB), vec![Extent::hole(16 * MIB)]);
    // Logical chunk 3 is on members c and d, row 1: member offset 1M, region 0.
    write(&r, 3 * MIB, 4096);
    let m = map(&*r, 0, 16 * MIB);
    // Chunks 1 and 3 share the members' first region (rows 0 and 1), so both read as
    // data; everything else is a hole.
    assert_eq!(
        m,
        vec![
            Extent::hole(MIB),
            Extent::data(MIB),
            Extent::hole(MIB),
            Extent::data(MIB),
            Extent::hole(12 * MIB)
        ]
    );
}

#[test]
fn wrappers_pass_the_base_map_through() {
    let text = r#"
[device.m]
type = "mem"
size = "8M"
[device.slow]
type = "delay"
base = "m"
read = "1us"
"#;
    let f = StackFile::parse(text).unwrap();
    let d = f.open("slow").unwrap();
    write(&d, 0, 4096);
    assert_eq!(
        map(&*d, 0, 8 * MIB),
        vec![Extent::data(2 * MIB), Extent::hole(6 * MIB)]
    );
}
