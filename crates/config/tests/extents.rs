//! Allocation maps (`Device::extents`, NBD's `base:allocation`): holes are reported only
//! where reads return zeroes, data where something was written, through every layer.

use std::sync::Arc;

use cairn_config::StackFile;
use cairn_core::blocking::BlockingQueue;
use cairn_core::{Device, Extent, IoFlags, Switches};
use cairn_leaves::LeafSpec;

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
    cairn_leaves::open(&s, &s.default_name()).unwrap()
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

fn zero(d: &Arc<dyn Device>, op: cairn_core::Op, offset: u64, len: u64, flags: IoFlags) {
    let q = BlockingQueue::open(d, Switches::default()).unwrap();
    q.zero(op, offset, len, flags).unwrap();
}

#[test]
fn mem_reports_written_pages_as_data_and_trimmed_pages_as_holes() {
    use cairn_core::Op;
    let d = leaf("mem:16M");
    assert_eq!(map(&*d, 0, 16 * MIB), vec![Extent::hole(16 * MIB)]);
    write(&d, 5 * MIB, 4096);
    // Page granularity (4 KiB): only the page written is data.
    assert_eq!(
        map(&*d, 0, 16 * MIB),
        vec![
            Extent::hole(5 * MIB),
            Extent::data(4096),
            Extent::hole(11 * MIB - 4096)
        ]
    );
    // A sub-range starts and ends where asked, mid-page included.
    assert_eq!(
        map(&*d, 5 * MIB + 512, 2 * MIB),
        vec![Extent::data(3584), Extent::hole(2 * MIB - 3584)]
    );
    // A trim of the page makes it a hole again.
    zero(&d, Op::Discard, 5 * MIB, 4096, IoFlags::NONE);
    assert_eq!(map(&*d, 0, 16 * MIB), vec![Extent::hole(16 * MIB)]);
    // Zeroing part of a page keeps it data (it still holds bytes); zeroing all of it
    // without NO_HOLE makes it a hole; with NO_HOLE it stays allocated, and reads as
    // zeroes (NBD_STATE_ZERO without NBD_STATE_HOLE).
    write(&d, 8 * MIB, 3 * 4096);
    zero(&d, Op::WriteZeroes, 8 * MIB + 512, 1024, IoFlags::NONE);
    zero(&d, Op::WriteZeroes, 8 * MIB + 4096, 4096, IoFlags::NONE);
    zero(&d, Op::WriteZeroes, 8 * MIB + 8192, 4096, IoFlags::NO_HOLE);
    assert_eq!(
        map(&*d, 8 * MIB, 3 * 4096),
        vec![
            Extent::data(4096),
            Extent::hole(4096),
            Extent::allocated_zero(4096)
        ]
    );
    // NO_HOLE provisions even a range never written.
    zero(&d, Op::WriteZeroes, 12 * MIB, 8192, IoFlags::NO_HOLE);
    assert_eq!(map(&*d, 12 * MIB, 8192), vec![Extent::allocated_zero(8192)]);
}

#[test]
fn mem_with_large_blocks_maps_whole_blocks() {
    // 64 KiB blocks: a block with one page written is data, whole.
    let d = leaf("mem:16M,block=65536");
    write(&d, 3 * 65536, 65536);
    assert_eq!(
        map(&*d, 0, 8 * 65536),
        vec![
            Extent::hole(3 * 65536),
            Extent::data(65536),
            Extent::hole(4 * 65536)
        ]
    );
    let q = BlockingQueue::open(&d, Switches::default()).unwrap();
    q.zero(cairn_core::Op::Discard, 3 * 65536, 65536, IoFlags::NONE)
        .unwrap();
    assert_eq!(map(&*d, 0, 8 * 65536), vec![Extent::hole(8 * 65536)]);
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
    // Logical chunk 3 is on members c and d, row 1: member offset 1M.
    write(&r, 3 * MIB, 4096);
    let m = map(&*r, 0, 16 * MIB);
    // Only that page is data.
    assert_eq!(
        m,
        vec![
            Extent::hole(3 * MIB),
            Extent::data(4096),
            Extent::hole(13 * MIB - 4096)
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
        vec![Extent::data(4096), Extent::hole(8 * MIB - 4096)]
    );
}

/// A cache maps what its base maps, with its dirty pages (written, not yet written back)
/// as data on top; pages it holds clean (read, or written back) change nothing. (Was:
/// once anything was cached, all data: an array made over caches then read 64 MiB of
/// every member to find it blank.)
#[test]
fn a_cache_maps_its_dirty_pages_over_the_base_map() {
    // The flusher waits: the written pages stay dirty until the flush.
    let text = r#"
[writeback]
background = "90%"
limit = "95%"
expire = "1h"
interval = "1h"
[device.m]
type = "mem"
size = "8M"
[device.c]
type = "cache"
base = "m"
memory = "1M"
"#;
    let f = StackFile::parse(text).unwrap();
    let d = f.open("c").unwrap();
    let q = BlockingQueue::open(&d, Switches::default()).unwrap();
    let mut buf = vec![0u8; 65536];
    q.read(0, &mut buf).unwrap();
    // Cached clean pages, none dirty: the base's map.
    assert_eq!(map(&*d, 0, 8 * MIB), vec![Extent::hole(8 * MIB)]);
    write(&d, 3 * MIB, 8192);
    write(&d, 3 * MIB + 16384, 4096);
    let want = vec![
        Extent::hole(3 * MIB),
        Extent::data(8192),
        Extent::hole(8192),
        Extent::data(4096),
        Extent::hole(5 * MIB - 20480),
    ];
    let base = d.children()[0].clone();
    assert_eq!(
        map(&*base, 0, 8 * MIB),
        vec![Extent::hole(8 * MIB)],
        "not written back yet"
    );
    assert_eq!(map(&*d, 0, 8 * MIB), want, "dirty pages");
    // Inside the range, and from an offset inside a page.
    assert_eq!(
        map(&*d, 3 * MIB + 4096, 16384),
        vec![Extent::data(4096), Extent::hole(8192), Extent::data(4096)]
    );
    // Written back: the base maps them itself.
    q.flush().unwrap();
    assert_eq!(map(&*base, 0, 8 * MIB), want, "written back");
    assert_eq!(map(&*d, 0, 8 * MIB), want, "written back");
}
