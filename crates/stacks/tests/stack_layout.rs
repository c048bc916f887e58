//! Layout tests: known logical offsets land on known members at known member offsets.
//!
//! Each test builds a stack from a stack file of mem members, writes through the top
//! device, then reads every member directly (reached through `Device::children()` of the
//! top, so the test sees the very devices the stack writes to) and checks where the bytes
//! went, and that they went nowhere else. Reads go the other way too: bytes written
//! straight to a member appear at the expected logical offset of the top.
//!
//! The layouts, with `n` members and chunk `c`:
//!
//! ```text
//! linear   members end to end: logical x is on the member whose range holds it.
//!
//! stripe   chunk i (logical bytes i*c .. (i+1)*c) is on member i % n, row i / n,
//!          i.e. at member offset (i / n) * c. Three members:
//!                    d0   d1   d2
//!            row 0:   0    1    2
//!            row 1:   3    4    5
//!
//! mirror   every member holds every byte at the same offset.
//!
//! raid10   md's "near" layout: copy k of chunk i sits at grid position p = i*copies + k,
//!          on member p % n, row p / n (member offset (p / n) * c). The copies of a
//!          chunk are neighbours; with an odd member count a chunk wraps to the next row.
//!            4 members, 2 copies       3 members, 2 copies     4 members, 3 copies
//!                  d0  d1  d2  d3            d0  d1  d2              d0  d1  d2  d3
//!            row 0: 0   0   1   1     row 0:  0   0   1       row 0:  0   0   0   1
//!            row 1: 2   2   3   3     row 1:  1   2   2       row 1:  1   1   2   2
//!            row 2: 4   4   5   5     row 2:  3   3   4       row 2:  2   3   3   3
//! ```
//!
//! Every array here asks for the raw layout (`metadata = "none"`): no metadata area, so
//! member offsets are the layout's own arithmetic. Arrays with superblocks (the default)
//! put the same layout after a 1 MiB metadata area on each member; `array.rs` and
//! `stack_model.rs` cover them.
//!
//! Not here: random operations against a model (`stack_model.rs`), which also checks every
//! copy of every block against the same rules.

use std::sync::Arc;

use cairn_config::StackFile;
use cairn_core::blocking::BlockingQueue;
use cairn_core::{Device, IoFlags, Switches};
use cairn_testkit::pattern;

const K: u64 = 1024;
const CHUNK: u64 = 64 * K;

/// Opens `top` of a stack of mem members `d0..` of `member_bytes` each, in the raw layout.
fn stack(kind: &str, member_bytes: &[u64], extra: &str) -> Arc<dyn Device> {
    let mut text = String::new();
    for (i, size) in member_bytes.iter().enumerate() {
        text.push_str(&format!("[device.d{i}]\ntype = \"mem\"\nsize = {size}\n\n"));
    }
    let names: Vec<String> = (0..member_bytes.len())
        .map(|i| format!("\"d{i}\""))
        .collect();
    text.push_str(&format!(
        "[device.top]\ntype = \"{kind}\"\nmembers = [{}]\nmetadata = \"none\"\n{extra}\n",
        names.join(", ")
    ));
    let file = StackFile::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let top = file.open("top").unwrap_or_else(|e| panic!("{e}\n{text}"));
    let children: Vec<String> = top.children().iter().map(|c| c.name().into()).collect();
    let want: Vec<String> = (0..member_bytes.len()).map(|i| format!("d{i}")).collect();
    assert_eq!(children, want, "members in the order the file lists them");
    top
}

fn queue(device: &Arc<dyn Device>) -> BlockingQueue {
    BlockingQueue::open(device, Switches::default()).expect("queue opens")
}

/// Every member's whole contents, read directly.
fn members(top: &Arc<dyn Device>) -> Vec<Vec<u8>> {
    top.children()
        .iter()
        .map(|m| {
            let mut buf = vec![0xa5u8; m.geometry().size_bytes as usize];
            queue(m)
                .read(0, &mut buf)
                .unwrap_or_else(|e| panic!("read {}: {e}", m.name()));
            buf
        })
        .collect()
}

/// Writes `len` pattern bytes at logical `offset` of a fresh stack and checks that they
/// land exactly at `places` (member, member offset), each holding the whole piece in
/// order, and that every other member byte is still zero.
#[track_caller]
fn lands(top: &Arc<dyn Device>, offset: u64, len: u64, places: &[(usize, u64)]) {
    let data = pattern(offset / 512 + 1, len);
    queue(top).write(offset, &data, IoFlags::NONE).unwrap();
    let mut contents = members(top);
    for &(m, at) in places {
        let range = at as usize..(at + len) as usize;
        assert!(
            contents[m][range.clone()] == data[..],
            "logical {offset}+{len}: not on member d{m} at {at}"
        );
        contents[m][range].fill(0);
    }
    for (m, c) in contents.iter().enumerate() {
        if let Some(at) = c.iter().position(|&b| b != 0) {
            panic!("logical {offset}+{len}: stray bytes on member d{m} at {at}");
        }
    }
}

/// Writes a whole device with each 512-byte block stamped with its logical block number,
/// then returns, for every member, the logical block each of its blocks holds (`None`
/// where nothing was written).
fn stamps(top: &Arc<dyn Device>) -> Vec<Vec<Option<u64>>> {
    let size = top.geometry().size_bytes;
    let mut data = vec![0u8; size as usize];
    for (b, block) in data.chunks_mut(512).enumerate() {
        for word in block.chunks_mut(8) {
            word.copy_from_slice(&(b as u64 + 1).to_le_bytes());
        }
    }
    queue(top).write(0, &data, IoFlags::NONE).unwrap();
    members(top)
        .iter()
        .map(|c| {
            c.chunks(512)
                .map(|block| {
                    let n = u64::from_le_bytes(block[..8].try_into().unwrap());
                    assert!(
                        block.chunks(8).all(|w| w == &block[..8]),
                        "a block holds pieces of two logical blocks"
                    );
                    n.checked_sub(1)
                })
                .collect()
        })
        .collect()
}

mod stripe {
    use super::*;

    #[test]
    fn chunks_go_round_robin() {
        // Three members of 10 chunks: 30 chunks.
        let top = || stack("stripe", &[10 * CHUNK; 3], "chunk = \"64K\"");
        assert_eq!(top().geometry().size_bytes, 30 * CHUNK);
        lands(&top(), 0, 4096, &[(0, 0)]);
        lands(&top(), CHUNK, 4096, &[(1, 0)]);
        lands(&top(), 2 * CHUNK + 512, 512, &[(2, 512)]);
        lands(&top(), 3 * CHUNK, CHUNK, &[(0, CHUNK)]);
        lands(&top(), 7 * CHUNK + 4096, 8192, &[(1, 2 * CHUNK + 4096)]);
        // The last chunk: 29 = row 9 of member 2.
        lands(&top(), 30 * CHUNK - 512, 512, &[(2, 10 * CHUNK - 512)]);
    }

    #[test]
    fn a_write_across_chunks_is_split_between_members() {
        // 8 KiB from 4 KiB before the end of chunk 0: 4 KiB at the end of d0's first
        // chunk, 4 KiB at the start of d1.
        let top = stack("stripe", &[4 * CHUNK; 2], "chunk = \"64K\"");
        let data = pattern(3, 8192);
        queue(&top)
            .write(CHUNK - 4096, &data, IoFlags::NONE)
            .unwrap();
        let m = members(&top);
        assert!(m[0][(CHUNK - 4096) as usize..CHUNK as usize] == data[..4096]);
        assert!(m[1][..4096] == data[4096..]);
        assert_eq!(m[0].iter().filter(|&&b| b != 0).count(), 4096);
        assert_eq!(m[1].iter().filter(|&&b| b != 0).count(), 4096);
    }

    #[test]
    fn every_block_of_a_4k_stripe() {
        // 4 KiB chunks (8 blocks), two members of 16 KiB plus a tail too small for a
        // chunk: rows 0..3, 8 chunks.
        let top = stack("stripe", &[16 * K + 1024, 20 * K], "chunk = \"4K\"");
        assert_eq!(top.geometry().size_bytes, 32 * K);
        let s = stamps(&top);
        for (m, blocks) in s.iter().enumerate() {
            for (b, &logical) in blocks.iter().enumerate() {
                let (row, within) = (b / 8, b % 8);
                if row >= 4 {
                    assert_eq!(logical, None, "d{m} block {b} is past the last row");
                } else {
                    let chunk = row * 2 + m;
                    assert_eq!(logical, Some((chunk * 8 + within) as u64), "d{m} block {b}");
                }
            }
        }
    }

    #[test]
    fn reads_come_from_the_member_the_layout_names() {
        let top = stack("stripe", &[4 * CHUNK; 3], "chunk = \"64K\"");
        let d2 = top.children()[2].clone();
        let data = pattern(9, 4096);
        // Chunk 5 is member 2, row 1.
        queue(&d2)
            .write(CHUNK + 8192, &data, IoFlags::NONE)
            .unwrap();
        let mut got = vec![0u8; 4096];
        queue(&top).read(5 * CHUNK + 8192, &mut got).unwrap();
        assert_eq!(got, data);
    }
}

mod raid10 {
    use super::*;

    fn r(members: usize, copies: u64) -> Arc<dyn Device> {
        stack(
            "raid10",
            &vec![8 * CHUNK; members],
            &format!("chunk = \"64K\"\ncopies = {copies}"),
        )
    }

    #[test]
    fn four_members_two_copies() {
        assert_eq!(r(4, 2).geometry().size_bytes, 16 * CHUNK);
        // Chunk 0 on members 0 and 1, chunk 1 on 2 and 3, chunk 2 on 0 and 1 one row down.
        lands(&r(4, 2), 0, 4096, &[(0, 0), (1, 0)]);
        lands(&r(4, 2), CHUNK, 4096, &[(2, 0), (3, 0)]);
        lands(&r(4, 2), 2 * CHUNK, CHUNK, &[(0, CHUNK), (1, CHUNK)]);
        lands(
            &r(4, 2),
            5 * CHUNK + 100 * 512,
            512,
            &[(2, 2 * CHUNK + 100 * 512), (3, 2 * CHUNK + 100 * 512)],
        );
        // The last block: chunk 15 on members 2 and 3, row 7.
        lands(
            &r(4, 2),
            16 * CHUNK - 512,
            512,
            &[(2, 8 * CHUNK - 512), (3, 8 * CHUNK - 512)],
        );
    }

    #[test]
    fn three_members_two_copies() {
        // 8 rows x 3 members = 24 positions = 12 chunks.
        assert_eq!(r(3, 2).geometry().size_bytes, 12 * CHUNK);
        lands(&r(3, 2), 0, 4096, &[(0, 0), (1, 0)]);
        // Chunk 1: member 2 row 0, and member 0 row 1.
        lands(&r(3, 2), CHUNK, 4096, &[(2, 0), (0, CHUNK)]);
        lands(
            &r(3, 2),
            2 * CHUNK + 512,
            1024,
            &[(1, CHUNK + 512), (2, CHUNK + 512)],
        );
        lands(&r(3, 2), 3 * CHUNK, 512, &[(0, 2 * CHUNK), (1, 2 * CHUNK)]);
    }

    #[test]
    fn four_members_three_copies() {
        // 8 rows x 4 members = 32 positions = 10 chunks (two positions unused).
        assert_eq!(r(4, 3).geometry().size_bytes, 10 * CHUNK);
        lands(&r(4, 3), 0, 4096, &[(0, 0), (1, 0), (2, 0)]);
        // Chunk 1: positions 3, 4, 5 = member 3 row 0, members 0 and 1 row 1.
        lands(&r(4, 3), CHUNK, 4096, &[(3, 0), (0, CHUNK), (1, CHUNK)]);
        // Chunk 2: positions 6, 7, 8 = members 2 and 3 row 1, member 0 row 2.
        lands(
            &r(4, 3),
            2 * CHUNK,
            512,
            &[(2, CHUNK), (3, CHUNK), (0, 2 * CHUNK)],
        );
    }

    #[test]
    fn a_write_across_chunks_goes_to_both_pairs() {
        // The last 4 KiB of chunk 0 and the first 4 KiB of chunk 1 (4 members, 2 copies).
        let top = r(4, 2);
        let data = pattern(5, 8192);
        queue(&top)
            .write(CHUNK - 4096, &data, IoFlags::NONE)
            .unwrap();
        let m = members(&top);
        for d in [0, 1] {
            assert!(
                m[d][(CHUNK - 4096) as usize..CHUNK as usize] == data[..4096],
                "d{d}"
            );
        }
        for d in [2, 3] {
            assert!(m[d][..4096] == data[4096..], "d{d}");
        }
    }

    #[test]
    fn every_block_of_an_odd_raid10() {
        // 4 KiB chunks (8 blocks), 3 members of 7 rows: 21 positions, 10 chunks of two
        // copies; the last position (member 2, row 6) holds nothing.
        let top = stack("raid10", &[28 * K; 3], "chunk = \"4K\"");
        assert_eq!(top.geometry().size_bytes, 40 * K);
        let s = stamps(&top);
        for (m, blocks) in s.iter().enumerate() {
            for (b, &logical) in blocks.iter().enumerate() {
                let (row, within) = (b / 8, b % 8);
                let position = row * 3 + m;
                if position >= 20 {
                    assert_eq!(
                        logical, None,
                        "d{m} block {b}: position {position} is unused"
                    );
                } else {
                    let chunk = position / 2;
                    assert_eq!(logical, Some((chunk * 8 + within) as u64), "d{m} block {b}");
                }
            }
        }
    }

    #[test]
    fn reads_see_a_copy() {
        // Different bytes on the two copies of chunk 1 (members 2 and 3, row 0): every
        // read through the top returns one copy whole, never a mix.
        let top = r(4, 2);
        let children = top.children();
        let (a, b) = (pattern(1, 4096), pattern(2, 4096));
        queue(&children[2]).write(0, &a, IoFlags::NONE).unwrap();
        queue(&children[3]).write(0, &b, IoFlags::NONE).unwrap();
        let q = queue(&top);
        for _ in 0..8 {
            let mut got = vec![0u8; 4096];
            q.read(CHUNK, &mut got).unwrap();
            assert!(got == a || got == b, "a read returned neither copy");
        }
        // Chunk 0's members hold nothing: a read of it is zeros from either copy.
        let mut got = vec![0xa5u8; 4096];
        q.read(0, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 0));
    }
}

mod linear {
    use super::*;

    #[test]
    fn members_end_to_end() {
        let sizes = [1000 * 512, 24 * 512, 4096];
        let top = || stack("linear", &sizes, "");
        assert_eq!(top().geometry().size_bytes, 1024 * 512 + 4096);
        lands(&top(), 0, 512, &[(0, 0)]);
        lands(&top(), 999 * 512, 512, &[(0, 999 * 512)]);
        lands(&top(), 1000 * 512, 512, &[(1, 0)]);
        lands(&top(), 1024 * 512 + 512, 512, &[(2, 512)]);
        lands(&top(), 1024 * 512 + 3584, 512, &[(2, 3584)]);
    }

    #[test]
    fn a_write_across_three_members() {
        // From the last block of d0, over all of d1, into the first block of d2.
        let top = stack("linear", &[1000 * 512, 24 * 512, 4096], "");
        let data = pattern(4, 26 * 512);
        queue(&top).write(999 * 512, &data, IoFlags::NONE).unwrap();
        let m = members(&top);
        assert!(m[0][999 * 512..] == data[..512]);
        assert!(m[1][..] == data[512..25 * 512]);
        assert!(m[2][..512] == data[25 * 512..]);
        assert!(m[2][512..].iter().all(|&b| b == 0));
        assert!(m[0][..999 * 512].iter().all(|&b| b == 0));
    }
}

mod mirror {
    use super::*;

    #[test]
    fn every_member_holds_everything() {
        let top = || stack("mirror", &[256 * K, 300 * K, 256 * K], "");
        // The smallest member decides the size.
        assert_eq!(top().geometry().size_bytes, 256 * K);
        lands(&top(), 4096, 4096, &[(0, 4096), (1, 4096), (2, 4096)]);
        lands(
            &top(),
            256 * K - 512,
            512,
            &[(0, 256 * K - 512), (1, 256 * K - 512), (2, 256 * K - 512)],
        );
    }
}
