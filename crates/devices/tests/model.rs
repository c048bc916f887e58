//! Property tests: random operation sequences against a plain byte-vector model.
//!
//! Each case opens a fresh device, applies up to 40 random reads, writes, flushes,
//! discards and write-zeroes (block-aligned or not, inside the device, across 4 KiB pages
//! and across the device's end), and checks every read, every refusal and the final
//! contents against the model. A refused request must change nothing.
//!
//! A second property runs the same sequence through the three file engines and compares
//! the files they leave behind byte for byte. Both run on buffered files with 512-byte
//! blocks and on O_DIRECT files with 4 KiB blocks.

use std::path::Path;
use std::sync::Arc;

use cairn_core::blocking::{BlockingError, BlockingQueue};
use cairn_core::{Device, IoError, IoFlags, Op, Switches};
use cairn_devices::LeafSpec;
use proptest::prelude::*;
use proptest::test_runner::Config;
use tempfile::TempDir;

mod common;
use common::{check_all, data, Step};

/// The block size and length of the devices a property runs on.
#[derive(Debug, Clone, Copy)]
struct Shape {
    block: u64,
    blocks: u64,
    /// Longest request, in blocks.
    max_blocks: u64,
}

impl Shape {
    fn size(self) -> u64 {
        self.block * self.blocks
    }
}

/// Buffered devices: 83 blocks of 512 bytes, ten 4 KiB pages and three blocks, so the end
/// is not on a page boundary; requests up to six pages.
const BUFFERED: Shape = Shape {
    block: 512,
    blocks: 83,
    max_blocks: 48,
};

/// O_DIRECT files on tmpfs (4 KiB blocks): 21 blocks, requests up to 12.
const DIRECT: Shape = Shape {
    block: 4096,
    blocks: 21,
    max_blocks: 12,
};

/// Offsets: mostly block-aligned inside or just past the device, sometimes right before a
/// page boundary, sometimes unaligned, sometimes so large that offset + len overflows.
fn offset(shape: Shape) -> impl Strategy<Value = u64> {
    let Shape {
        block,
        blocks,
        max_blocks,
    } = shape;
    let size = shape.size();
    prop_oneof![
        10 => (0..blocks + 8).prop_map(move |b| b * block),
        3 => (1..=size / 4096).prop_map(move |page| page * 4096 - block),
        3 => (0..max_blocks).prop_map(move |b| size - b * block),
        1 => (0..size).prop_filter("unaligned", move |o| o % block != 0),
        1 => Just(u64::MAX - (block - 1)),
    ]
}

/// Lengths: mostly whole blocks (up to six pages), sometimes zero or unaligned.
fn length(shape: Shape) -> impl Strategy<Value = u64> {
    let Shape {
        block, max_blocks, ..
    } = shape;
    prop_oneof![
        12 => (1..=max_blocks).prop_map(move |b| b * block),
        2 => Just(4096u64),
        1 => Just(0u64),
        1 => (1..2 * block).prop_filter("unaligned", move |l| l % block != 0),
    ]
}

fn step(shape: Shape) -> impl Strategy<Value = Step> {
    let (offset, length) = (|| offset(shape), || length(shape));
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

fn steps(shape: Shape) -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(step(shape), 1..=40)
}

/// What the device must answer, worked out independently of `Geometry::check`.
fn expected(shape: Shape, step: &Step) -> Result<(), IoError> {
    let (block, size) = (shape.block, shape.size());
    let op = step.op();
    let (offset, len) = step.range();
    if op == Op::Flush {
        return Ok(());
    }
    if len == 0 {
        return Err(IoError::BadLength { op, len });
    }
    if offset % block != 0 || len % block != 0 {
        return Err(IoError::Misaligned {
            op,
            offset,
            len,
            block: block as u32,
        });
    }
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(IoError::OutOfRange {
            op,
            offset,
            len,
            size,
        }),
    }
}

/// Applies one step to the device and to the model, checking what the device answers.
fn apply(
    shape: Shape,
    q: &BlockingQueue,
    model: &mut [u8],
    step: &Step,
) -> Result<(), TestCaseError> {
    let want = expected(shape, step);
    let (offset, len) = step.range();
    let got = match *step {
        Step::Read { .. } => {
            let mut buf = vec![0xa5u8; len as usize];
            let r = q.read(offset, &mut buf);
            if r.is_ok() {
                let at = offset as usize;
                prop_assert!(
                    buf == model[at..at + len as usize],
                    "{:?} read the wrong bytes",
                    step
                );
            }
            r
        }
        Step::Write { seed, fua, .. } => {
            let flags = if fua { IoFlags::FUA } else { IoFlags::NONE };
            let bytes = data(seed, len);
            let r = q.write(offset, &bytes, flags);
            if r.is_ok() {
                let at = offset as usize;
                model[at..at + len as usize].copy_from_slice(&bytes);
            }
            r
        }
        Step::Flush => q.flush(),
        Step::Discard { .. } => q.zero(Op::Discard, offset, len, IoFlags::NONE),
        Step::WriteZeroes { no_hole, .. } => {
            let flags = if no_hole {
                IoFlags::NO_HOLE
            } else {
                IoFlags::NONE
            };
            q.zero(Op::WriteZeroes, offset, len, flags)
        }
    };
    match (&want, &got) {
        (Ok(()), Ok(())) => {
            if matches!(step, Step::Discard { .. } | Step::WriteZeroes { .. }) {
                model[offset as usize..(offset + len) as usize].fill(0);
            }
        }
        (Err(w), Err(BlockingError::Refused(g))) => prop_assert_eq!(w, g, "{:?}", step),
        _ => prop_assert!(false, "{:?}: expected {:?}, got {:?}", step, want, got),
    }
    if want.is_err() {
        // A refused request changes nothing.
        check_all(q, model)?;
    }
    Ok(())
}

fn scratch_dir() -> TempDir {
    tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("create a temporary directory")
}

/// A cache device over a mem of DIRECT's size, with a flusher that wakes every 5 ms and
/// writes back anything older than 10 ms, so write-back races the requests.
fn cache_over_mem(memory: &str) -> Arc<dyn Device> {
    cache_over_mem_with(memory, cairn_core::WritebackMode::PerDevice)
}

fn cache_over_mem_with(memory: &str, writeback: cairn_core::WritebackMode) -> Arc<dyn Device> {
    let text = format!(
        "[writeback]\nbackground = \"25%\"\nlimit = \"50%\"\nexpire = \"10ms\"\ninterval = \"5ms\"\n\
         [device.m]\ntype = \"mem\"\nsize = {}\nblock = 4096\n\
         [device.c]\ntype = \"cache\"\nbase = \"m\"\nmemory = \"{memory}\"\n",
        DIRECT.size()
    );
    cairn_devices::config::StackFile::parse(&text)
        .expect("stack parses")
        .open_with(
            "c",
            Switches {
                writeback,
                ..Switches::default()
            },
        )
        .expect("cache opens")
}

fn open(spec: &str) -> Arc<dyn Device> {
    let spec = LeafSpec::parse(spec).expect("spec parses");
    cairn_devices::open(&spec, "model").expect("device opens")
}

fn file_spec(path: &Path, engine: &str, shape: Shape) -> String {
    let direct = u8::from(shape.block == DIRECT.block);
    format!(
        "file:{},engine={engine},direct={direct},size={}",
        path.display(),
        shape.size()
    )
}

/// Runs `steps` on a fresh device and checks it against the model throughout.
fn run_model(
    shape: Shape,
    device: &Arc<dyn Device>,
    steps: &[Step],
) -> Result<Vec<u8>, TestCaseError> {
    let geometry = device.geometry();
    prop_assert_eq!(geometry.size_bytes, shape.size());
    prop_assert_eq!(u64::from(geometry.block_bytes), shape.block);
    let q = BlockingQueue::open(device, Switches::default()).expect("queue opens");
    let mut model = vec![0u8; shape.size() as usize];
    for step in steps {
        apply(shape, &q, &mut model, step)?;
    }
    check_all(&q, &model)?;
    Ok(model)
}

/// The model test for one file engine; the file must end up holding the model's bytes.
fn run_file_model(shape: Shape, engine: &str, steps: &[Step]) -> Result<(), TestCaseError> {
    // A fresh directory for each case, so no case sees another's file.
    let dir = scratch_dir();
    let path = dir.path().join(engine);
    let device = open(&file_spec(&path, engine, shape));
    let model = run_model(shape, &device, steps)?;
    drop(device);
    let file = std::fs::read(&path).expect("read the backing file");
    prop_assert!(file == model, "{} left different bytes in its file", engine);
    Ok(())
}

/// Runs `steps` through each engine on its own file; the files must be identical.
fn run_engines(shape: Shape, steps: &[Step]) -> Result<(), TestCaseError> {
    let engines = ["io_uring", "aio", "sync"];
    let dir = scratch_dir();
    let mut files = Vec::new();
    for engine in engines {
        let path = dir.path().join(engine);
        let device = open(&file_spec(&path, engine, shape));
        let q = BlockingQueue::open(&device, Switches::default()).expect("queue opens");
        let mut model = vec![0u8; shape.size() as usize];
        for step in steps {
            apply(shape, &q, &mut model, step)?;
        }
        q.flush().expect("flush");
        drop(q);
        drop(device);
        files.push(std::fs::read(&path).expect("read the backing file"));
    }
    prop_assert_eq!(files[0].len() as u64, shape.size());
    for (engine, file) in engines.iter().zip(&files).skip(1) {
        prop_assert!(file == &files[0], "{} and io_uring files differ", engine);
    }
    Ok(())
}

fn config() -> Config {
    Config {
        cases: 64,
        // Failures are printed with their minimal case; nothing is written to the tree.
        failure_persistence: None,
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn mem_matches_the_model(steps in steps(BUFFERED)) {
        run_model(BUFFERED, &open(&format!("mem:{}", BUFFERED.size())), &steps)?;
    }

    #[test]
    fn small_cache_matches_the_model(steps in steps(DIRECT)) {
        // 16 pages over 21: eviction, and writes through when every page is dirty.
        run_model(DIRECT, &cache_over_mem("64K"), &steps)?;
    }

    #[test]
    fn roomy_cache_matches_the_model(steps in steps(DIRECT)) {
        run_model(DIRECT, &cache_over_mem("1M"), &steps)?;
    }

    #[test]
    fn cache_written_back_by_the_shared_pool_matches_the_model(steps in steps(DIRECT)) {
        run_model(DIRECT, &cache_over_mem_with("64K", cairn_core::WritebackMode::Shared), &steps)?;
    }

    #[test]
    fn volatile_mem_matches_the_model(steps in steps(BUFFERED)) {
        // Without a power cut, the volatile layer must be invisible.
        run_model(BUFFERED, &open(&format!("mem:{},volatile=1", BUFFERED.size())), &steps)?;
    }

    #[test]
    fn io_uring_file_matches_the_model(steps in steps(BUFFERED)) {
        run_file_model(BUFFERED, "io_uring", &steps)?;
    }

    #[test]
    fn aio_file_matches_the_model(steps in steps(BUFFERED)) {
        run_file_model(BUFFERED, "aio", &steps)?;
    }

    #[test]
    fn sync_file_matches_the_model(steps in steps(BUFFERED)) {
        run_file_model(BUFFERED, "sync", &steps)?;
    }

    #[test]
    fn the_three_engines_leave_identical_files(steps in steps(BUFFERED)) {
        run_engines(BUFFERED, &steps)?;
    }

    #[test]
    fn direct_files_match_the_model(steps in steps(DIRECT)) {
        for engine in ["io_uring", "aio", "sync"] {
            run_file_model(DIRECT, engine, &steps)?;
        }
    }

    #[test]
    fn the_three_engines_leave_identical_direct_files(steps in steps(DIRECT)) {
        run_engines(DIRECT, &steps)?;
    }
}
