//! Property tests: stacked devices against a plain byte-vector model.
//!
//! Each case builds a fresh stack from a stack file (linear, stripe, mirror or raid10 over
//! mem devices, or over files on /dev/shm through io_uring and linux-aio), applies random
//! reads, writes, flushes, discards and write-zeroes of block-aligned sizes at offsets
//! chosen near chunk and member boundaries, so most requests are split, and checks every
//! read, every refusal and the final contents against the model. A request reaching past
//! the end is refused and changes nothing.
//!
//! A second property submits batches of non-overlapping requests together through
//! `BlockingQueue::run`, in an order unrelated to their offsets, so the pieces of many
//! requests are in flight on the members at once.
//!
//! At the end of each case every member is read directly, and every copy of every block
//! must hold the model's bytes where the layout puts it (the placement rules are written
//! out again here, independently of the code under test; `stack_layout.rs` checks them
//! against fixed examples).
//!
//! Each case runs with statistics on or off at random: off, a request of linear or stripe
//! that fits one member is only remapped, and the member answers the caller itself.
//!
//! Most stacks ask for the raw layout (`metadata = "none"`), whose placement is the
//! layout's arithmetic alone on members of a few KiB; a few run at the default, with
//! superblocks: the same placement after a 1 MiB metadata area on each member, which no
//! data may touch.

use std::sync::Arc;

use cairn_config::StackFile;
use cairn_core::blocking::{BlockingError, BlockingQueue, Request};
use cairn_core::stats::StatsMode;
use cairn_core::{Device, IoError, IoFlags, Op, Switches};
use proptest::prelude::*;
use proptest::test_runner::Config;
use tempfile::TempDir;

use cairn_testkit as common;
use common::{check_all, pattern, Step};

/// Logical block size of every member (and so of every stack).
const BLOCK: u64 = 512;
const K: u64 = 1024;
/// Where data starts on each member of an array with superblocks.
const DATA_OFFSET: u64 = 1 << 20;
/// The two superblock slots at the start of each member's metadata area.
const SLOTS_BYTES: u64 = 16 * K;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Linear,
    Stripe,
    Mirror,
    Raid10,
}

/// What the members are.
#[derive(Debug, Clone, Copy)]
enum Leaf {
    Mem,
    /// A file on /dev/shm through this engine.
    File(&'static str),
}

/// One stack under test: `top`, built from members `d0`, `d1`, ... of the given sizes.
#[derive(Debug, Clone, Copy)]
struct Stack {
    kind: Kind,
    /// The bytes of each member the layout uses: the whole member in the raw layout;
    /// with metadata, the member is `DATA_OFFSET` bytes larger.
    member_bytes: &'static [u64],
    /// Chunk of stripe and raid10 (unused otherwise).
    chunk: u64,
    /// Copies of raid10 (unused otherwise).
    copies: u64,
    leaf: Leaf,
    /// Superblocks on the members (the default), or the raw layout (`metadata = "none"`).
    metadata: bool,
}

/// Members of unequal sizes, not multiples of each other or of 4 KiB: 40 KiB, 12.5 KiB,
/// 64 KiB, 1.5 KiB.
const LINEAR: Stack = Stack {
    kind: Kind::Linear,
    member_bytes: &[40 * K, 12 * K + 512, 64 * K, 1536],
    chunk: 0,
    copies: 1,
    leaf: Leaf::Mem,
    metadata: false,
};

/// The smaller member decides: 15 rows of 4 KiB chunks.
const STRIPE_4K_2: Stack = Stack {
    kind: Kind::Stripe,
    member_bytes: &[64 * K, 60 * K + 512],
    chunk: 4 * K,
    copies: 1,
    leaf: Leaf::Mem,
    metadata: false,
};

const STRIPE_4K_3: Stack = Stack {
    kind: Kind::Stripe,
    member_bytes: &[40 * K, 40 * K, 40 * K],
    chunk: 4 * K,
    copies: 1,
    leaf: Leaf::Mem,
    metadata: false,
};

/// Four rows of 64 KiB chunks; the 4 KiB tail of each member is unused.
const STRIPE_64K_2: Stack = Stack {
    kind: Kind::Stripe,
    member_bytes: &[260 * K, 260 * K],
    chunk: 64 * K,
    copies: 1,
    leaf: Leaf::Mem,
    metadata: false,
};

const STRIPE_64K_3: Stack = Stack {
    kind: Kind::Stripe,
    member_bytes: &[192 * K, 192 * K, 192 * K],
    chunk: 64 * K,
    copies: 1,
    leaf: Leaf::Mem,
    metadata: false,
};

const MIRROR_2: Stack = Stack {
    kind: Kind::Mirror,
    member_bytes: &[96 * K, 96 * K],
    chunk: 0,
    copies: 2,
    leaf: Leaf::Mem,
    metadata: false,
};

/// Unequal members: the smallest (96 KiB) decides.
const MIRROR_3: Stack = Stack {
    kind: Kind::Mirror,
    member_bytes: &[100 * K, 96 * K, 128 * K],
    chunk: 0,
    copies: 3,
    leaf: Leaf::Mem,
    metadata: false,
};

/// Eight rows of 4 KiB: 16 chunks.
const RAID10_4X2: Stack = Stack {
    kind: Kind::Raid10,
    member_bytes: &[32 * K, 32 * K, 32 * K, 32 * K],
    chunk: 4 * K,
    copies: 2,
    leaf: Leaf::Mem,
    metadata: false,
};

/// Seven rows of three: 21 positions, 10 chunks of two copies, the last position unused.
const RAID10_3X2: Stack = Stack {
    kind: Kind::Raid10,
    member_bytes: &[28 * K, 28 * K, 28 * K],
    chunk: 4 * K,
    copies: 2,
    leaf: Leaf::Mem,
    metadata: false,
};

/// Three rows of four 64 KiB chunks: 12 positions, 4 chunks of three copies.
const RAID10_4X3: Stack = Stack {
    kind: Kind::Raid10,
    member_bytes: &[192 * K, 192 * K, 192 * K, 192 * K],
    chunk: 64 * K,
    copies: 3,
    leaf: Leaf::Mem,
    metadata: false,
};

/// A stripe of three files through io_uring.
const STRIPE_URING_FILES: Stack = Stack {
    leaf: Leaf::File("io_uring"),
    ..STRIPE_4K_3
};

/// A raid10 of four files through linux-aio.
const RAID10_AIO_FILES: Stack = Stack {
    leaf: Leaf::File("aio"),
    ..RAID10_4X2
};

/// At the default, with superblocks: the same layouts after each member's metadata area.
const LINEAR_META: Stack = Stack {
    metadata: true,
    ..LINEAR
};

const STRIPE_4K_3_META: Stack = Stack {
    metadata: true,
    ..STRIPE_4K_3
};

/// A bitmap (one region: every write is to a marked region after the first).
const MIRROR_3_META: Stack = Stack {
    metadata: true,
    ..MIRROR_3
};

const RAID10_3X2_META: Stack = Stack {
    metadata: true,
    ..RAID10_3X2
};

/// Superblocks flushed through linux-aio.
const RAID10_AIO_FILES_META: Stack = Stack {
    metadata: true,
    ..RAID10_AIO_FILES
};

impl Stack {
    fn members(&self) -> usize {
        self.member_bytes.len()
    }

    /// Where the layout's bytes start on each member.
    fn data_offset(&self) -> u64 {
        if self.metadata {
            DATA_OFFSET
        } else {
            0
        }
    }

    /// Member `i`'s whole size.
    fn device_bytes(&self, i: usize) -> u64 {
        self.member_bytes[i] + self.data_offset()
    }

    fn smallest(&self) -> u64 {
        *self.member_bytes.iter().min().unwrap()
    }

    /// The stacked device's size, by each layout's rule.
    fn size(&self) -> u64 {
        let n = self.members() as u64;
        match self.kind {
            Kind::Linear => self.member_bytes.iter().sum(),
            Kind::Stripe => self.smallest() / self.chunk * self.chunk * n,
            Kind::Mirror => self.smallest(),
            Kind::Raid10 => self.smallest() / self.chunk * n / self.copies * self.chunk,
        }
    }

    /// Offsets where requests get split: member starts (linear), chunk starts (stripe,
    /// raid10), a few 4 KiB pages (mirror, which never splits).
    fn boundaries(&self) -> Vec<u64> {
        match self.kind {
            Kind::Linear => self
                .member_bytes
                .iter()
                .scan(0, |at, s| {
                    *at += s;
                    Some(*at)
                })
                .collect(),
            Kind::Stripe | Kind::Raid10 => (1..self.size() / self.chunk)
                .map(|i| i * self.chunk)
                .collect(),
            Kind::Mirror => vec![4 * K, 32 * K, self.size() / 2],
        }
    }

    /// Longest request: two and a half chunks, or enough to cross two linear members.
    fn max_len(&self) -> u64 {
        match self.kind {
            Kind::Linear => 80 * K,
            Kind::Stripe | Kind::Raid10 => self.chunk * 5 / 2,
            Kind::Mirror => 48 * K,
        }
    }

    /// Where copy `copy` of logical byte `offset` lives: (member, offset in the member's
    /// data area, which starts at [`Stack::data_offset`]).
    ///
    /// - linear: members end to end;
    /// - stripe: chunk `i` on member `i % n`, row `i / n`;
    /// - mirror: every member, at the same offset;
    /// - raid10 (md's near layout): copy `k` of chunk `i` at grid position
    ///   `p = i * copies + k`, on member `p % n`, row `p / n`.
    fn place(&self, offset: u64, copy: u64) -> (usize, u64) {
        let n = self.members() as u64;
        match self.kind {
            Kind::Linear => {
                let mut start = 0;
                for (m, &s) in self.member_bytes.iter().enumerate() {
                    if offset < start + s {
                        return (m, offset - start);
                    }
                    start += s;
                }
                unreachable!("offset {offset} past the end");
            }
            Kind::Stripe => {
                let i = offset / self.chunk;
                ((i % n) as usize, i / n * self.chunk + offset % self.chunk)
            }
            Kind::Mirror => (copy as usize, offset),
            Kind::Raid10 => {
                let p = offset / self.chunk * self.copies + copy;
                ((p % n) as usize, p / n * self.chunk + offset % self.chunk)
            }
        }
    }

    fn copies(&self) -> u64 {
        match self.kind {
            Kind::Linear | Kind::Stripe => 1,
            Kind::Mirror | Kind::Raid10 => self.copies,
        }
    }

    /// The stack file text; file members go in `dir`.
    fn toml(&self, dir: Option<&TempDir>) -> String {
        let mut text = String::new();
        for i in 0..self.members() {
            let size = self.device_bytes(i);
            text.push_str(&format!("[device.d{i}]\n"));
            match (self.leaf, dir) {
                (Leaf::Mem, _) => text.push_str(&format!("type = \"mem\"\nsize = {size}\n")),
                (Leaf::File(engine), Some(dir)) => text.push_str(&format!(
                    "type = \"file\"\npath = \"{}\"\nsize = {size}\nengine = \"{engine}\"\n",
                    dir.path().join(format!("d{i}.img")).display()
                )),
                (Leaf::File(_), None) => unreachable!("file members need a directory"),
            }
            text.push('\n');
        }
        let names: Vec<String> = (0..self.members()).map(|i| format!("\"d{i}\"")).collect();
        let (kind, extra) = match self.kind {
            Kind::Linear => ("linear", String::new()),
            Kind::Stripe => ("stripe", format!("chunk = {}\n", self.chunk)),
            Kind::Mirror => ("mirror", String::new()),
            Kind::Raid10 => (
                "raid10",
                format!("chunk = {}\ncopies = {}\n", self.chunk, self.copies),
            ),
        };
        let metadata = if self.metadata {
            ""
        } else {
            "metadata = \"none\"\n"
        };
        text.push_str(&format!(
            "[device.top]\ntype = \"{kind}\"\nmembers = [{}]\n{metadata}{extra}",
            names.join(", ")
        ));
        text
    }

    /// A fresh stack (with the directory its files live in, if any).
    fn open(&self) -> (Arc<dyn Device>, Option<TempDir>) {
        let dir = match self.leaf {
            Leaf::Mem => None,
            Leaf::File(_) => Some(
                tempfile::tempdir_in("/dev/shm")
                    .or_else(|_| tempfile::tempdir())
                    .expect("create a temporary directory"),
            ),
        };
        let text = self.toml(dir.as_ref());
        let file = StackFile::parse(&text).unwrap_or_else(|e| panic!("parse: {e}\n{text}"));
        assert_eq!(file.pick(None).unwrap(), "top");
        let top = file
            .open("top")
            .unwrap_or_else(|e| panic!("open: {e}\n{text}"));
        (top, dir)
    }
}

/// Block-aligned offsets: anywhere, a few blocks either side of a boundary, near the end,
/// and past the end.
fn offset(stack: Stack) -> impl Strategy<Value = u64> {
    let size = stack.size();
    let blocks = size / BLOCK;
    let max_blocks = stack.max_len() / BLOCK;
    let near = (prop::sample::select(stack.boundaries()), -8i64..=8).prop_map(move |(b, d)| {
        (b as i64 + d * BLOCK as i64).clamp(0, size as i64 - BLOCK as i64) as u64
    });
    prop_oneof![
        6 => (0..blocks).prop_map(|b| b * BLOCK),
        6 => near,
        2 => (1..=max_blocks.min(blocks)).prop_map(move |b| size - b * BLOCK),
        1 => (0..4u64).prop_map(move |b| size + b * BLOCK),
    ]
}

/// Block-aligned lengths up to the stack's longest request; short ones are common.
fn length(stack: Stack) -> impl Strategy<Value = u64> {
    let max_blocks = stack.max_len() / BLOCK;
    prop_oneof![
        3 => (1..=max_blocks).prop_map(|b| b * BLOCK),
        2 => (1..=16u64).prop_map(|b| b * BLOCK),
    ]
}

fn step(stack: Stack) -> impl Strategy<Value = Step> {
    let (offset, length) = (move || offset(stack), move || length(stack));
    prop_oneof![
        4 => (offset(), length()).prop_map(|(offset, len)| Step::Read { offset, len }),
        6 => (offset(), length(), any::<u64>(), any::<bool>())
            .prop_map(|(offset, len, seed, fua)| Step::Write { offset, len, seed, fua }),
        1 => Just(Step::Flush),
        2 => (offset(), length()).prop_map(|(offset, len)| Step::Discard { offset, len }),
        2 => (offset(), length(), any::<bool>())
            .prop_map(|(offset, len, no_hole)| Step::WriteZeroes { offset, len, no_hole }),
    ]
}

/// Up to 30 steps.
fn steps(stack: Stack) -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(step(stack), 1..=30)
}

/// What the stack must answer: in range, or refused as out of range.
fn expected(stack: Stack, step: &Step) -> Result<(), IoError> {
    let op = step.op();
    let (offset, len) = step.range();
    if op == Op::Flush || offset + len <= stack.size() {
        return Ok(());
    }
    Err(IoError::OutOfRange {
        op,
        offset,
        len,
        size: stack.size(),
    })
}

/// Reads every member directly; every copy of every block must hold the model's bytes.
/// With metadata, each member starts with a superblock, and the rest of its metadata
/// area is untouched.
fn check_members(stack: Stack, top: &Arc<dyn Device>, model: &[u8]) -> Result<(), TestCaseError> {
    let members = top.children();
    prop_assert_eq!(members.len(), stack.members());
    let mut contents = Vec::new();
    for (i, m) in members.iter().enumerate() {
        prop_assert_eq!(m.geometry().size_bytes, stack.device_bytes(i));
        let q = BlockingQueue::open(m, Switches::default()).expect("member queue opens");
        let mut buf = vec![0xa5u8; stack.device_bytes(i) as usize];
        q.read(0, &mut buf)
            .map_err(|e| TestCaseError::fail(format!("read member d{i}: {e}")))?;
        if stack.metadata {
            let slots = &buf[..SLOTS_BYTES as usize];
            prop_assert!(
                slots.starts_with(b"CAIRNSB\0")
                    || slots[8 * K as usize..].starts_with(b"CAIRNSB\0"),
                "member d{} has no superblock",
                i
            );
            let rest = &buf[SLOTS_BYTES as usize..DATA_OFFSET as usize];
            if let Some(at) = rest.iter().position(|&b| b != 0) {
                prop_assert!(
                    false,
                    "member d{} has bytes in its metadata area at {}",
                    i,
                    SLOTS_BYTES as usize + at
                );
            }
        }
        contents.push(buf);
    }
    for offset in (0..stack.size()).step_by(BLOCK as usize) {
        let want = &model[offset as usize..(offset + BLOCK) as usize];
        for copy in 0..stack.copies() {
            let (m, at) = stack.place(offset, copy);
            let at = at + stack.data_offset();
            let got = &contents[m][at as usize..(at + BLOCK) as usize];
            prop_assert!(
                got == want,
                "copy {} of block at {} (member d{}, offset {}) differs from the model",
                copy,
                offset,
                m,
                at
            );
        }
    }
    prop_assert_eq!(cairn_core::array::failed_members(top), Vec::<String>::new());
    Ok(())
}

/// Applies one step to the stack and to the model, checking what the stack answers.
fn apply(
    stack: Stack,
    q: &BlockingQueue,
    model: &mut [u8],
    step: &Step,
) -> Result<(), TestCaseError> {
    let want = expected(stack, step);
    let (offset, len) = step.range();
    let at = offset as usize;
    let got = match *step {
        Step::Read { .. } => {
            let mut buf = vec![0xa5u8; len as usize];
            let r = q.read(offset, &mut buf);
            if r.is_ok() {
                prop_assert!(
                    buf == model[at..at + len as usize],
                    "{:?} read the wrong bytes",
                    step
                );
            }
            r
        }
        Step::Write { seed, .. } => {
            let bytes = pattern(seed, len);
            let r = q.write(offset, &bytes, step.flags());
            if r.is_ok() {
                model[at..at + len as usize].copy_from_slice(&bytes);
            }
            r
        }
        Step::Flush => q.flush(),
        Step::Discard { .. } | Step::WriteZeroes { .. } => {
            let r = q.zero(step.op(), offset, len, step.flags());
            if r.is_ok() {
                model[at..at + len as usize].fill(0);
            }
            r
        }
    };
    match (&want, &got) {
        (Ok(()), Ok(())) => {}
        (Err(w), Err(BlockingError::Refused(g))) => prop_assert_eq!(w, g, "{:?}", step),
        _ => prop_assert!(false, "{:?}: expected {:?}, got {:?}", step, want, got),
    }
    if want.is_err() {
        // A refused request changes nothing.
        check_all(q, model)?;
    }
    Ok(())
}

/// Runs `steps` on a fresh stack and checks it against the model throughout.
/// The switches of a case: statistics on or off (off, requests of linear and stripe that
/// fit one member are remapped and answered by the member itself).
fn switches(stats_off: bool) -> Switches {
    Switches {
        stats: if stats_off {
            StatsMode::Off
        } else {
            StatsMode::On
        },
        ..Switches::default()
    }
}

fn run_model(stack: Stack, steps: &[Step], stats_off: bool) -> Result<(), TestCaseError> {
    let (top, _dir) = stack.open();
    let geometry = top.geometry();
    prop_assert_eq!(geometry.size_bytes, stack.size());
    prop_assert_eq!(u64::from(geometry.block_bytes), BLOCK);
    let q = BlockingQueue::open(&top, switches(stats_off)).expect("queue opens");
    let mut model = vec![0u8; stack.size() as usize];
    // Bytes of each operation that succeeded (flushes: requests), as the stacked device
    // must count them however it sends them on (remapped and counted by a member for it,
    // or answered by itself).
    let mut done = [0u64; Op::COUNT];
    for step in steps {
        apply(stack, &q, &mut model, step)?;
        if expected(stack, step).is_ok() {
            done[step.op().index()] += if step.op() == Op::Flush {
                1
            } else {
                step.range().1
            };
        } else {
            // `apply` read everything back to see that nothing changed.
            done[Op::Read.index()] += stack.size();
        }
    }
    if !stats_off {
        let snap = q.queue().stats().snapshot(u64::MAX);
        for op in Op::ALL {
            let i = op.index();
            let counted = if op == Op::Flush {
                snap.ios[i]
            } else {
                snap.sectors[i] * 512
            };
            prop_assert_eq!(counted, done[i], "statistics of {}", op);
        }
        prop_assert_eq!(snap.in_flight, 0);
        prop_assert_eq!(snap.errors, 0);
    }
    check_all(&q, &model)?;
    q.flush()
        .map_err(|e| TestCaseError::fail(format!("flush: {e}")))?;
    drop(q);
    check_members(stack, &top, &model)
}

/// One request of a batch, before it is given a place: `gap` blocks after the previous
/// one, `len` blocks long; `order` decides when it is submitted.
#[derive(Debug, Clone)]
struct Item {
    gap_blocks: u64,
    len_blocks: u64,
    /// 0 read, 1 write, 2 discard, 3 write-zeroes, 4 flush.
    kind: u8,
    seed: u64,
    order: u32,
}

/// A batch: requests laid out one after another from a random start, plus perhaps one
/// request reaching past the end, which must be refused without disturbing the rest.
#[derive(Debug, Clone)]
struct Batch {
    start_blocks: u64,
    items: Vec<Item>,
    past_the_end: Option<u32>,
}

fn batch(stack: Stack) -> impl Strategy<Value = Batch> {
    let blocks = stack.size() / BLOCK;
    let max_blocks = stack.max_len() / BLOCK;
    let item = (
        0..=4u64,
        1..=max_blocks,
        prop_oneof![3 => Just(0u8), 4 => Just(1u8), 1 => Just(2u8), 1 => Just(3u8), 1 => Just(4u8)],
        any::<u64>(),
        any::<u32>(),
    )
        .prop_map(|(gap_blocks, len_blocks, kind, seed, order)| Item {
            gap_blocks,
            len_blocks,
            kind,
            seed,
            order,
        });
    (
        0..blocks / 2,
        prop::collection::vec(item, 1..=16),
        prop::option::weighted(0.3, any::<u32>()),
    )
        .prop_map(|(start_blocks, items, past_the_end)| Batch {
            start_blocks,
            items,
            past_the_end,
        })
}

/// Up to four batches.
fn batches(stack: Stack) -> impl Strategy<Value = Vec<Batch>> {
    prop::collection::vec(batch(stack), 1..=4)
}

/// Submits one batch at once and checks every result against the model.
fn run_batch(
    stack: Stack,
    q: &BlockingQueue,
    model: &mut [u8],
    batch: &Batch,
) -> Result<(), TestCaseError> {
    let size = stack.size();
    // Give each item its range; drop those that would not fit.
    let mut placed: Vec<(Step, u32)> = Vec::new();
    let mut at = batch.start_blocks * BLOCK;
    for item in &batch.items {
        let offset = at + item.gap_blocks * BLOCK;
        let len = item.len_blocks * BLOCK;
        if offset + len > size {
            break;
        }
        at = offset + len;
        let step = match item.kind {
            0 => Step::Read { offset, len },
            1 => Step::Write {
                offset,
                len,
                seed: item.seed,
                fua: item.seed % 3 == 0,
            },
            2 => Step::Discard { offset, len },
            3 => Step::WriteZeroes {
                offset,
                len,
                no_hole: item.seed % 2 == 0,
            },
            _ => Step::Flush,
        };
        placed.push((step, item.order));
    }
    if let Some(order) = batch.past_the_end {
        let step = Step::Write {
            offset: size - BLOCK,
            len: 2 * BLOCK,
            seed: 7,
            fua: false,
        };
        placed.push((step, order));
    }
    // Submission order is unrelated to the offsets.
    placed.sort_by_key(|(_, order)| *order);
    let steps: Vec<Step> = placed.into_iter().map(|(s, _)| s).collect();

    let mut bufs: Vec<Vec<u8>> = steps
        .iter()
        .map(|s| match *s {
            Step::Read { len, .. } => vec![0xa5; len as usize],
            Step::Write { len, seed, .. } => pattern(seed, len),
            _ => Vec::new(),
        })
        .collect();
    let results = {
        let mut requests: Vec<Request<'_>> = steps
            .iter()
            .zip(bufs.iter_mut())
            .map(|(s, buf)| {
                let (offset, len) = s.range();
                Request {
                    op: s.op(),
                    flags: s.flags(),
                    offset,
                    len,
                    buf: if s.op().has_data() {
                        Some(buf.as_mut_slice())
                    } else {
                        None
                    },
                }
            })
            .collect();
        q.run(&mut requests)
    };
    prop_assert_eq!(results.len(), steps.len());
    // Reads saw the bytes from before the batch (nothing else in it overlaps them), so
    // check them all before applying any write to the model.
    for ((s, buf), r) in steps.iter().zip(&bufs).zip(&results) {
        match (expected(stack, s), r) {
            (Ok(()), Ok(())) => {
                if let Step::Read { offset, len } = *s {
                    let at = offset as usize;
                    prop_assert!(
                        buf[..] == model[at..at + len as usize],
                        "{:?} read the wrong bytes in a batch",
                        s
                    );
                }
            }
            (Err(w), Err(BlockingError::Refused(g))) => prop_assert_eq!(&w, g, "{:?}", s),
            (w, g) => prop_assert!(false, "{:?}: expected {:?}, got {:?}", s, w, g),
        }
    }
    for (s, buf) in steps.iter().zip(&bufs) {
        if expected(stack, s).is_err() {
            continue;
        }
        let (offset, len) = s.range();
        let range = offset as usize..(offset + len) as usize;
        match s {
            Step::Write { .. } => model[range].copy_from_slice(buf),
            Step::Discard { .. } | Step::WriteZeroes { .. } => model[range].fill(0),
            _ => {}
        }
    }
    check_all(q, model)
}

fn run_batches(stack: Stack, batches: &[Batch], stats_off: bool) -> Result<(), TestCaseError> {
    let (top, _dir) = stack.open();
    let q = BlockingQueue::open(&top, switches(stats_off)).expect("queue opens");
    let mut model = vec![0u8; stack.size() as usize];
    // Start from data everywhere, so that discards and reads have something to see.
    let fill = pattern(99, stack.size());
    q.write(0, &fill, IoFlags::NONE)
        .map_err(|e| TestCaseError::fail(format!("fill: {e}")))?;
    model.copy_from_slice(&fill);
    for batch in batches {
        run_batch(stack, &q, &mut model, batch)?;
    }
    drop(q);
    check_members(stack, &top, &model)
}

fn config() -> Config {
    Config {
        cases: 48,
        // Failures are printed with their minimal case; nothing is written to the tree.
        failure_persistence: None,
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn linear_of_unequal_members(steps in steps(LINEAR), stats_off in any::<bool>()) {
        run_model(LINEAR, &steps, stats_off)?;
    }

    #[test]
    fn stripe_4k_chunks_2_members(steps in steps(STRIPE_4K_2), stats_off in any::<bool>()) {
        run_model(STRIPE_4K_2, &steps, stats_off)?;
    }

    #[test]
    fn stripe_4k_chunks_3_members(steps in steps(STRIPE_4K_3), stats_off in any::<bool>()) {
        run_model(STRIPE_4K_3, &steps, stats_off)?;
    }

    #[test]
    fn stripe_64k_chunks_2_members(steps in steps(STRIPE_64K_2), stats_off in any::<bool>()) {
        run_model(STRIPE_64K_2, &steps, stats_off)?;
    }

    #[test]
    fn stripe_64k_chunks_3_members(steps in steps(STRIPE_64K_3), stats_off in any::<bool>()) {
        run_model(STRIPE_64K_3, &steps, stats_off)?;
    }

    #[test]
    fn mirror_2_members(steps in steps(MIRROR_2), stats_off in any::<bool>()) {
        run_model(MIRROR_2, &steps, stats_off)?;
    }

    #[test]
    fn mirror_3_unequal_members(steps in steps(MIRROR_3), stats_off in any::<bool>()) {
        run_model(MIRROR_3, &steps, stats_off)?;
    }

    #[test]
    fn raid10_4_members_2_copies(steps in steps(RAID10_4X2), stats_off in any::<bool>()) {
        run_model(RAID10_4X2, &steps, stats_off)?;
    }

    #[test]
    fn raid10_3_members_2_copies(steps in steps(RAID10_3X2), stats_off in any::<bool>()) {
        run_model(RAID10_3X2, &steps, stats_off)?;
    }

    #[test]
    fn raid10_4_members_3_copies(steps in steps(RAID10_4X3), stats_off in any::<bool>()) {
        run_model(RAID10_4X3, &steps, stats_off)?;
    }

    #[test]
    fn stripe_of_io_uring_files(steps in steps(STRIPE_URING_FILES), stats_off in any::<bool>()) {
        run_model(STRIPE_URING_FILES, &steps, stats_off)?;
    }

    #[test]
    fn raid10_of_aio_files(steps in steps(RAID10_AIO_FILES), stats_off in any::<bool>()) {
        run_model(RAID10_AIO_FILES, &steps, stats_off)?;
    }

    #[test]
    fn linear_with_metadata(steps in steps(LINEAR_META), stats_off in any::<bool>()) {
        run_model(LINEAR_META, &steps, stats_off)?;
    }

    #[test]
    fn stripe_with_metadata(steps in steps(STRIPE_4K_3_META), stats_off in any::<bool>()) {
        run_model(STRIPE_4K_3_META, &steps, stats_off)?;
    }

    #[test]
    fn mirror_with_metadata(steps in steps(MIRROR_3_META), stats_off in any::<bool>()) {
        run_model(MIRROR_3_META, &steps, stats_off)?;
    }

    #[test]
    fn raid10_with_metadata(steps in steps(RAID10_3X2_META), stats_off in any::<bool>()) {
        run_model(RAID10_3X2_META, &steps, stats_off)?;
    }

    #[test]
    fn raid10_of_aio_files_with_metadata(steps in steps(RAID10_AIO_FILES_META), stats_off in any::<bool>()) {
        run_model(RAID10_AIO_FILES_META, &steps, stats_off)?;
    }

    #[test]
    fn concurrent_batches_linear(batches in batches(LINEAR), stats_off in any::<bool>()) {
        run_batches(LINEAR, &batches, stats_off)?;
    }

    #[test]
    fn concurrent_batches_stripe(batches in batches(STRIPE_4K_3), stats_off in any::<bool>()) {
        run_batches(STRIPE_4K_3, &batches, stats_off)?;
    }

    #[test]
    fn concurrent_batches_mirror(batches in batches(MIRROR_3), stats_off in any::<bool>()) {
        run_batches(MIRROR_3, &batches, stats_off)?;
    }

    #[test]
    fn concurrent_batches_raid10(batches in batches(RAID10_3X2), stats_off in any::<bool>()) {
        run_batches(RAID10_3X2, &batches, stats_off)?;
    }

    #[test]
    fn concurrent_batches_raid10_3_copies(batches in batches(RAID10_4X3), stats_off in any::<bool>()) {
        run_batches(RAID10_4X3, &batches, stats_off)?;
    }

    #[test]
    fn concurrent_batches_mirror_with_metadata(batches in batches(MIRROR_3_META), stats_off in any::<bool>()) {
        run_batches(MIRROR_3_META, &batches, stats_off)?;
    }

    #[test]
    fn concurrent_batches_raid10_with_metadata(batches in batches(RAID10_3X2_META), stats_off in any::<bool>()) {
        run_batches(RAID10_3X2_META, &batches, stats_off)?;
    }

    #[test]
    fn concurrent_batches_on_io_uring_files(batches in batches(STRIPE_URING_FILES), stats_off in any::<bool>()) {
        run_batches(STRIPE_URING_FILES, &batches, stats_off)?;
    }

    #[test]
    fn concurrent_batches_on_aio_files(batches in batches(RAID10_AIO_FILES), stats_off in any::<bool>()) {
        run_batches(RAID10_AIO_FILES, &batches, stats_off)?;
    }
}
