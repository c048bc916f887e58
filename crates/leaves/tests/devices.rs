//! Integration tests for the leaf devices, driven through `BlockingQueue`.
//!
//! Every test runs against every leaf: null, mem, and a file through io_uring, linux-aio
//! and plain syscalls, both buffered and with O_DIRECT. Files live in a temporary
//! directory on /dev/shm (tmpfs takes O_DIRECT on the kernels cairn targets), or under
//! the system temporary directory where /dev/shm is missing.
//!
//! Not here: random operation sequences against a model (see `model.rs`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cairn_core::blocking::{BlockingError, BlockingQueue, Request};
use cairn_core::{
    AlignedBuf, ClockMode, CoalesceMode, Device, Error, IoError, IoFlags, Op, ReapMode, StatsMode,
    Switches,
};
use cairn_leaves::LeafSpec;
use cairn_testkit::pattern;
use tempfile::TempDir;

/// Size of every device under test: room for 300 distinct 4 KiB blocks.
const DEVICE_BYTES: u64 = 2 << 20;

/// More requests than a file queue keeps in the kernel at once (256).
const MANY_REQUESTS: usize = 300;

const ENGINES: [&str; 3] = ["io_uring", "aio", "sync"];

/// A device under test, with the directory its file lives in (if it has one).
struct Subject {
    label: String,
    device: Arc<dyn Device>,
    /// Whether written data can be read back (false for null).
    stores: bool,
    /// The backing file, for devices that have one.
    path: Option<PathBuf>,
    // Dropped last, so the file outlives the device.
    _dir: Option<TempDir>,
}

impl Subject {
    fn queue(&self) -> BlockingQueue {
        self.queue_with(Switches::default())
    }

    fn queue_with(&self, switches: Switches) -> BlockingQueue {
        BlockingQueue::open(&self.device, switches)
            .unwrap_or_else(|e| panic!("{}: open queue: {e}", self.label))
    }

    fn block(&self) -> u64 {
        u64::from(self.device.geometry().block_bytes)
    }

    fn size(&self) -> u64 {
        self.device.geometry().size_bytes
    }
}

fn scratch_dir() -> TempDir {
    tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("create a temporary directory")
}

fn open_spec(text: &str) -> Result<Arc<dyn Device>, Error> {
    let spec = LeafSpec::parse(text).unwrap_or_else(|e| panic!("parse {text}: {e}"));
    cairn_leaves::open(&spec, "test")
}

fn file_subject(engine: &str, direct: bool) -> Subject {
    let dir = scratch_dir();
    let path = dir.path().join("dev");
    let spec = format!(
        "file:{},engine={engine},direct={},size={DEVICE_BYTES}",
        path.display(),
        u8::from(direct)
    );
    let device = open_spec(&spec).unwrap_or_else(|e| panic!("open {spec}: {e}"));
    Subject {
        label: format!("file engine={engine} direct={}", u8::from(direct)),
        device,
        stores: true,
        path: Some(path),
        _dir: Some(dir),
    }
}

/// One of each leaf, freshly created.
fn subjects() -> Vec<Subject> {
    let mut out = Vec::new();
    for (kind, stores) in [("null", false), ("mem", true)] {
        let spec = format!("{kind}:{DEVICE_BYTES}");
        out.push(Subject {
            label: kind.to_string(),
            device: open_spec(&spec).expect("open"),
            stores,
            path: None,
            _dir: None,
        });
    }
    for direct in [false, true] {
        for engine in ENGINES {
            out.push(file_subject(engine, direct));
        }
    }
    out
}

/// Every subject that keeps what is written.
fn storing_subjects() -> Vec<Subject> {
    subjects().into_iter().filter(|s| s.stores).collect()
}

fn read_vec(q: &BlockingQueue, offset: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0xa5u8; len as usize];
    q.read(offset, &mut buf)
        .unwrap_or_else(|e| panic!("read {len} bytes at {offset}: {e}"));
    buf
}

/// Reads the whole device and compares it with `model`, naming the first difference.
fn assert_device_eq(label: &str, q: &BlockingQueue, model: &[u8]) {
    let got = read_vec(q, 0, model.len() as u64);
    if let Some(at) = got.iter().zip(model).position(|(a, b)| a != b) {
        panic!(
            "{label}: byte {at} is {:#04x}, expected {:#04x}",
            got[at], model[at]
        );
    }
}

/// A write the model follows: stores it if the device keeps data.
fn write_model(s: &Subject, q: &BlockingQueue, model: &mut [u8], offset: u64, data: &[u8]) {
    q.write(offset, data, IoFlags::NONE)
        .unwrap_or_else(|e| panic!("{}: write {} at {offset}: {e}", s.label, data.len()));
    if s.stores {
        model[offset as usize..offset as usize + data.len()].copy_from_slice(data);
    }
}

fn refused(result: Result<(), BlockingError>) -> IoError {
    match result {
        Err(BlockingError::Refused(e)) => e,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

mod data {
    use super::*;

    /// (offset, length) pairs in bytes; those not aligned to a device's block are skipped.
    fn ranges(size: u64) -> Vec<(u64, u64)> {
        vec![
            (0, 512),
            (512, 1536),
            (3584, 1024),      // crosses the first page boundary
            (4096, 4096),      // exactly one page
            (7680, 9216),      // starts and ends inside pages
            (65536, 65536),    // 64 KiB
            (204_800, 12_288), // three pages
            (300_032, 131_072),
            (size - 131_072, 131_072), // up to the last byte
            (size - 4096, 4096),
            (size - 512, 512), // the last block
            (1024, 512),       // overwrites part of an earlier write
        ]
    }

    #[test]
    fn read_after_write_of_varied_sizes_and_offsets() {
        for s in subjects() {
            let q = s.queue();
            let block = s.block();
            let mut model = vec![0u8; s.size() as usize];
            for (i, (offset, len)) in ranges(s.size()).into_iter().enumerate() {
                if offset % block != 0 || len % block != 0 {
                    continue;
                }
                let data = pattern(i as u64 + 1, len as usize);
                write_model(&s, &q, &mut model, offset, &data);
                let got = read_vec(&q, offset, len);
                let want = &model[offset as usize..(offset + len) as usize];
                assert!(got == want, "{}: read back {len} at {offset}", s.label);
            }
            assert_device_eq(&s.label, &q, &model);
        }
    }

    #[test]
    fn unwritten_blocks_read_as_zeros() {
        for s in subjects() {
            let q = s.queue();
            let size = s.size();
            assert!(
                read_vec(&q, 0, size).iter().all(|&b| b == 0),
                "{}: a fresh device reads as zeros",
                s.label
            );
            let block = s.block();
            let middle = size / 2;
            q.write(middle, &pattern(7, block as usize), IoFlags::NONE)
                .unwrap();
            let before = read_vec(&q, middle - 4 * block, 4 * block);
            let after = read_vec(&q, middle + block, 4 * block);
            assert!(before.iter().all(|&b| b == 0), "{}: before", s.label);
            assert!(after.iter().all(|&b| b == 0), "{}: after", s.label);
        }
    }

    #[test]
    fn null_reads_zeros_even_after_writes() {
        let device = open_spec("null:1M").unwrap();
        let q = BlockingQueue::open(&device, Switches::default()).unwrap();
        q.write(4096, &pattern(3, 8192), IoFlags::NONE).unwrap();
        assert!(read_vec(&q, 4096, 8192).iter().all(|&b| b == 0));
    }

    #[test]
    fn data_reaches_the_file() {
        for s in storing_subjects() {
            let Some(path) = &s.path else { continue };
            let q = s.queue();
            let data = pattern(11, 8192);
            q.write(8192, &data, IoFlags::NONE).unwrap();
            q.flush().unwrap();
            let file = std::fs::read(path).unwrap();
            assert_eq!(file.len() as u64, DEVICE_BYTES, "{}", s.label);
            assert!(file[8192..16384] == data[..], "{}: file contents", s.label);
            assert!(file[..8192].iter().all(|&b| b == 0), "{}", s.label);
        }
    }

    #[test]
    fn every_device_has_the_size_it_was_given() {
        for s in subjects() {
            assert_eq!(s.size(), DEVICE_BYTES, "{}", s.label);
            let block = s.block();
            assert!(block.is_power_of_two() && block >= 512, "{}", s.label);
            assert!(!s.device.describe().is_empty());
        }
    }
}

mod durability {
    use super::*;

    #[test]
    fn flush_on_an_idle_device_and_after_writes() {
        for s in subjects() {
            let q = s.queue();
            q.flush()
                .unwrap_or_else(|e| panic!("{}: idle flush: {e}", s.label));
            let data = pattern(5, 3 * s.block() as usize);
            q.write(0, &data, IoFlags::NONE).unwrap();
            q.flush()
                .unwrap_or_else(|e| panic!("{}: flush: {e}", s.label));
            q.flush()
                .unwrap_or_else(|e| panic!("{}: second flush: {e}", s.label));
            if s.stores {
                assert_eq!(read_vec(&q, 0, data.len() as u64), data, "{}", s.label);
            }
        }
    }

    #[test]
    fn fua_write_reads_back() {
        for s in subjects() {
            let q = s.queue();
            let block = s.block();
            let data = pattern(9, 2 * block as usize);
            q.write(4 * block, &data, IoFlags::FUA)
                .unwrap_or_else(|e| panic!("{}: FUA write: {e}", s.label));
            let got = read_vec(&q, 4 * block, 2 * block);
            if s.stores {
                assert_eq!(got, data, "{}", s.label);
            } else {
                assert!(got.iter().all(|&b| b == 0));
            }
            if let Some(path) = &s.path {
                // A FUA write is in the file without a flush.
                let file = std::fs::read(path).unwrap();
                let at = 4 * block as usize;
                assert!(file[at..at + data.len()] == data[..], "{}", s.label);
            }
        }
    }

    #[test]
    fn flush_and_fua_writes_in_flight_together() {
        for s in subjects() {
            let q = s.queue();
            let block = s.block() as usize;
            let mut a = AlignedBuf::new(block);
            let mut b = AlignedBuf::new(block);
            a.as_mut_slice().copy_from_slice(&pattern(1, block));
            b.as_mut_slice().copy_from_slice(&pattern(2, block));
            let mut requests = vec![
                Request {
                    op: Op::Write,
                    flags: IoFlags::FUA,
                    offset: 0,
                    len: 0,
                    buf: Some(a.as_mut_slice()),
                },
                Request {
                    op: Op::Flush,
                    flags: IoFlags::NONE,
                    offset: 0,
                    len: 0,
                    buf: None,
                },
                Request {
                    op: Op::Write,
                    flags: IoFlags::NONE,
                    offset: block as u64,
                    len: 0,
                    buf: Some(b.as_mut_slice()),
                },
            ];
            let results = q.run(&mut requests);
            assert!(
                results.iter().all(Result::is_ok),
                "{}: {results:?}",
                s.label
            );
            q.flush().unwrap();
            if s.stores {
                let got = read_vec(&q, 0, 2 * block as u64);
                assert!(got[..block] == pattern(1, block)[..], "{}", s.label);
                assert!(got[block..] == pattern(2, block)[..], "{}", s.label);
            }
        }
    }
}

mod zeroing {
    use super::*;

    /// Every way to make a range read as zeros.
    const ZEROERS: [(Op, IoFlags); 4] = [
        (Op::Discard, IoFlags::NONE),
        (Op::WriteZeroes, IoFlags::NONE),
        (Op::WriteZeroes, IoFlags::NO_HOLE),
        (Op::Discard, IoFlags::FUA),
    ];

    /// (offset, length) pairs to zero inside the first 64 KiB, in bytes.
    fn ranges() -> Vec<(u64, u64)> {
        vec![
            (512, 512),       // one block inside a page
            (3584, 1024),     // across a page boundary, partial pages
            (8192, 4096),     // one whole page
            (12_800, 12_288), // partial, whole and partial pages
            (32_768, 16_384), // whole pages
            (49_152, 16_384), // to the end of the written region
        ]
    }

    #[test]
    fn zeroed_ranges_read_as_zeros_and_spare_neighbours() {
        for s in subjects() {
            let block = s.block();
            for (op, flags) in ZEROERS {
                let label = format!("{} {op} {flags:?}", s.label);
                let q = s.queue();
                let mut model = vec![0u8; s.size() as usize];
                write_model(&s, &q, &mut model, 0, &pattern(op as u64, 65536));
                for (offset, len) in ranges() {
                    if offset % block != 0 || len % block != 0 {
                        continue;
                    }
                    q.zero(op, offset, len, flags)
                        .unwrap_or_else(|e| panic!("{label}: {len} at {offset}: {e}"));
                    model[offset as usize..(offset + len) as usize].fill(0);
                    let window = read_vec(&q, 0, 65536 + 4096);
                    assert!(
                        window == model[..65536 + 4096],
                        "{label}: after zeroing {len} at {offset}"
                    );
                }
                assert_device_eq(&label, &q, &model);
            }
        }
    }

    #[test]
    fn zeroing_unwritten_space_and_the_device_end() {
        for s in subjects() {
            let q = s.queue();
            let size = s.size();
            let block = s.block();
            let mut model = vec![0u8; size as usize];
            let tail = pattern(77, 3 * block as usize);
            write_model(&s, &q, &mut model, size - 3 * block, &tail);
            for (op, flags) in ZEROERS {
                // Space never written stays zeros.
                q.zero(op, 16 * block, 8 * block, flags)
                    .unwrap_or_else(|e| panic!("{}: {op}: {e}", s.label));
            }
            q.zero(Op::Discard, size - block, block, IoFlags::NONE)
                .unwrap();
            model[(size - block) as usize..].fill(0);
            q.zero(Op::WriteZeroes, size - 3 * block, block, IoFlags::NO_HOLE)
                .unwrap();
            model[(size - 3 * block) as usize..(size - 2 * block) as usize].fill(0);
            assert_device_eq(&s.label, &q, &model);
            if let Some(path) = &s.path {
                // Zeroing never changes the file's length.
                assert_eq!(std::fs::metadata(path).unwrap().len(), size, "{}", s.label);
            }
        }
    }

    /// A discard or write-zeroes with FUA is made durable before it completes: on a file,
    /// `fallocate` has no flag for that, so an `fdatasync` follows it, on every engine,
    /// and only with FUA. (Was: FUA was ignored on them.)
    #[test]
    fn zeroing_with_fua_on_a_file_syncs_it_before_completing() {
        use cairn_leaves::file::FileDevice;
        use cairn_leaves::spec::Engine;
        let dir = scratch_dir();
        for engine in [Engine::IoUring, Engine::Aio, Engine::Sync] {
            let path = dir.path().join(format!("fua-{engine:?}"));
            let device = Arc::new(
                FileDevice::open("f", &path, engine, false, Some((1 << 20, false))).expect("open"),
            );
            let dyn_device: Arc<dyn Device> = device.clone();
            let q = BlockingQueue::open(&dyn_device, Switches::default()).expect("queue");
            q.write(0, &pattern(3, 65536), IoFlags::NONE)
                .expect("write");
            let mut want = 0;
            for (op, flags) in [
                (Op::Discard, IoFlags::NONE),
                (Op::WriteZeroes, IoFlags::NONE),
                (Op::WriteZeroes, IoFlags::NO_HOLE),
                (Op::Discard, IoFlags::FUA),
                (Op::WriteZeroes, IoFlags::FUA),
                (Op::WriteZeroes, IoFlags::FUA.with(IoFlags::NO_HOLE)),
            ] {
                q.zero(op, 8192, 4096, flags)
                    .unwrap_or_else(|e| panic!("{engine:?} {op} {flags:?}: {e}"));
                if flags.contains(IoFlags::FUA) {
                    want += 1;
                }
                assert_eq!(device.fua_syncs(), want, "{engine:?} {op} {flags:?}");
            }
            let mut model = pattern(3, 65536);
            model[8192..12288].fill(0);
            assert!(read_vec(&q, 0, 65536) == model, "{engine:?}: data");
        }
    }

    #[test]
    fn zeroing_a_large_range() {
        // Larger than the 1 MiB zero buffer files fall back to.
        for s in subjects() {
            let q = s.queue();
            let size = s.size();
            let mut model = vec![0u8; size as usize];
            write_model(&s, &q, &mut model, 0, &pattern(4, size as usize));
            for (op, flags) in [
                (Op::WriteZeroes, IoFlags::NO_HOLE),
                (Op::Discard, IoFlags::NONE),
            ] {
                let (offset, len) = (4096, size - 8192);
                q.zero(op, offset, len, flags)
                    .unwrap_or_else(|e| panic!("{}: {op}: {e}", s.label));
                model[offset as usize..(offset + len) as usize].fill(0);
                assert_device_eq(&s.label, &q, &model);
                write_model(&s, &q, &mut model, 0, &pattern(5, size as usize));
            }
        }
    }
}

mod refusals {
    use super::*;

    const RANGED: [Op; 4] = [Op::Read, Op::Write, Op::Discard, Op::WriteZeroes];

    /// Submits `op` over `[offset, offset+len)`, with a buffer for reads and writes.
    fn submit(q: &BlockingQueue, op: Op, offset: u64, len: u64) -> Result<(), BlockingError> {
        match op {
            Op::Read => {
                let mut buf = vec![0u8; len as usize];
                q.read(offset, &mut buf)
            }
            Op::Write => q.write(offset, &pattern(99, len as usize), IoFlags::NONE),
            _ => q.zero(op, offset, len, IoFlags::NONE),
        }
    }

    /// Fills the first and last 8 blocks with a pattern and returns the model.
    fn prepare(s: &Subject, q: &BlockingQueue) -> Vec<u8> {
        let size = s.size();
        let edge = 8 * s.block();
        let mut model = vec![0u8; size as usize];
        write_model(s, q, &mut model, 0, &pattern(1, edge as usize));
        write_model(s, q, &mut model, size - edge, &pattern(2, edge as usize));
        model
    }

    #[test]
    fn past_the_end_is_out_of_range() {
        for s in subjects() {
            let q = s.queue();
            let model = prepare(&s, &q);
            let size = s.size();
            let block = s.block();
            for op in RANGED {
                for (offset, len) in [
                    (size - block, 2 * block), // straddles the end
                    (size, block),             // starts at the end
                    (size + 64 * block, block),
                ] {
                    let e = refused(submit(&q, op, offset, len));
                    assert_eq!(
                        e,
                        IoError::OutOfRange {
                            op,
                            offset,
                            len,
                            size
                        },
                        "{}",
                        s.label
                    );
                    let errno = if matches!(op, Op::Write | Op::WriteZeroes) {
                        libc::ENOSPC
                    } else {
                        libc::EINVAL
                    };
                    assert_eq!(e.errno(), errno, "{}: {op}", s.label);
                }
            }
            assert_device_eq(&s.label, &q, &model);
        }
    }

    #[test]
    fn offset_plus_length_overflow_is_out_of_range() {
        for s in subjects() {
            let q = s.queue();
            let model = prepare(&s, &q);
            let size = s.size();
            let block = s.block();
            // The highest aligned offset: offset + len wraps around u64.
            let offset = u64::MAX - (block - 1);
            for op in RANGED {
                let e = refused(submit(&q, op, offset, block));
                assert_eq!(
                    e,
                    IoError::OutOfRange {
                        op,
                        offset,
                        len: block,
                        size
                    },
                    "{}",
                    s.label
                );
            }
            // A huge length from a small offset (discard and write-zeroes carry no buffer).
            let len = u64::MAX - (block - 1);
            for op in [Op::Discard, Op::WriteZeroes] {
                let e = refused(q.zero(op, block, len, IoFlags::NONE));
                assert_eq!(
                    e,
                    IoError::OutOfRange {
                        op,
                        offset: block,
                        len,
                        size
                    },
                    "{}",
                    s.label
                );
            }
            assert_device_eq(&s.label, &q, &model);
        }
    }

    #[test]
    fn misaligned_offsets_and_lengths_are_refused() {
        for s in subjects() {
            let q = s.queue();
            let model = prepare(&s, &q);
            let block = s.block();
            let block32 = block as u32;
            for op in RANGED {
                for (offset, len) in [
                    (1, block),
                    (block / 2, block),
                    (block, block / 2),
                    (0, block + 100),
                    (size_minus_half(&s), block), // misaligned and past the end
                ] {
                    let e = refused(submit(&q, op, offset, len));
                    assert_eq!(
                        e,
                        IoError::Misaligned {
                            op,
                            offset,
                            len,
                            block: block32
                        },
                        "{}",
                        s.label
                    );
                    assert_eq!(e.errno(), libc::EINVAL);
                }
            }
            assert_device_eq(&s.label, &q, &model);
        }
    }

    fn size_minus_half(s: &Subject) -> u64 {
        s.size() - s.block() / 2
    }

    #[test]
    fn empty_requests_are_refused() {
        for s in subjects() {
            let q = s.queue();
            let model = prepare(&s, &q);
            for op in RANGED {
                let e = refused(submit(&q, op, 0, 0));
                assert_eq!(e, IoError::BadLength { op, len: 0 }, "{}", s.label);
            }
            // A read or write request without a buffer.
            let mut requests = [Request {
                op: Op::Write,
                flags: IoFlags::NONE,
                offset: 0,
                len: 4096,
                buf: None,
            }];
            let e = refused(q.run(&mut requests).pop().unwrap());
            assert!(matches!(e, IoError::BadLength { op: Op::Write, .. }));
            assert_device_eq(&s.label, &q, &model);
        }
    }

    #[test]
    fn refused_requests_leave_the_rest_of_a_batch_alone() {
        for s in subjects() {
            let q = s.queue();
            let size = s.size();
            let block = s.block() as usize;
            let mut model = prepare(&s, &q);
            let mut good_a = AlignedBuf::new(block);
            let mut good_b = AlignedBuf::new(block);
            let mut past_end = AlignedBuf::new(2 * block);
            let mut short = AlignedBuf::new(block / 2);
            good_a.as_mut_slice().copy_from_slice(&pattern(10, block));
            good_b.as_mut_slice().copy_from_slice(&pattern(11, block));
            past_end.as_mut_slice().fill(0xee);
            short.as_mut_slice().fill(0xdd);
            let mut requests = vec![
                Request {
                    op: Op::Write,
                    flags: IoFlags::NONE,
                    offset: 2 * block as u64,
                    len: 0,
                    buf: Some(good_a.as_mut_slice()),
                },
                Request {
                    op: Op::Write,
                    flags: IoFlags::NONE,
                    offset: size - block as u64,
                    len: 0,
                    buf: Some(past_end.as_mut_slice()),
                },
                Request {
                    op: Op::Write,
                    flags: IoFlags::NONE,
                    offset: 0,
                    len: 0,
                    buf: Some(short.as_mut_slice()),
                },
                Request {
                    op: Op::Discard,
                    flags: IoFlags::NONE,
                    offset: size,
                    len: block as u64,
                    buf: None,
                },
                Request {
                    op: Op::Write,
                    flags: IoFlags::NONE,
                    offset: 5 * block as u64,
                    len: 0,
                    buf: Some(good_b.as_mut_slice()),
                },
            ];
            let results = q.run(&mut requests);
            assert_eq!(results.len(), 5);
            assert!(results[0].is_ok() && results[4].is_ok(), "{results:?}");
            assert!(matches!(
                results[1],
                Err(BlockingError::Refused(IoError::OutOfRange { .. }))
            ));
            assert!(matches!(
                results[2],
                Err(BlockingError::Refused(IoError::Misaligned { .. }))
            ));
            assert!(matches!(
                results[3],
                Err(BlockingError::Refused(IoError::OutOfRange {
                    op: Op::Discard,
                    ..
                }))
            ));
            if s.stores {
                model[2 * block..3 * block].copy_from_slice(&pattern(10, block));
                model[5 * block..6 * block].copy_from_slice(&pattern(11, block));
            }
            assert_device_eq(&s.label, &q, &model);
        }
    }
}

mod concurrency {
    use super::*;

    /// Writes `MANY_REQUESTS` distinct blocks in one batch (all in flight together) and
    /// returns the model.
    fn write_many(s: &Subject, q: &BlockingQueue, seed: u64) -> Vec<u8> {
        let block = s.block() as usize;
        let mut bufs: Vec<AlignedBuf> = (0..MANY_REQUESTS)
            .map(|i| {
                let mut b = AlignedBuf::new(block);
                b.as_mut_slice()
                    .copy_from_slice(&pattern(seed + i as u64, block));
                b
            })
            .collect();
        // Blocks in a scattered order, so neighbours are not submitted together.
        let mut requests: Vec<Request<'_>> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| Request {
                op: Op::Write,
                flags: if i % 7 == 0 {
                    IoFlags::FUA
                } else {
                    IoFlags::NONE
                },
                offset: ((i * 97) % MANY_REQUESTS * block) as u64,
                len: 0,
                buf: Some(b.as_mut_slice()),
            })
            .collect();
        let results = q.run(&mut requests);
        assert_eq!(results.len(), MANY_REQUESTS);
        for (i, r) in results.iter().enumerate() {
            assert!(r.is_ok(), "{}: write {i}: {r:?}", s.label);
        }
        let mut model = vec![0u8; s.size() as usize];
        if s.stores {
            for i in 0..MANY_REQUESTS {
                let at = (i * 97) % MANY_REQUESTS * block;
                model[at..at + block].copy_from_slice(&pattern(seed + i as u64, block));
            }
        }
        model
    }

    #[test]
    fn more_writes_in_flight_than_the_queue_depth() {
        for s in subjects() {
            let q = s.queue();
            let model = write_many(&s, &q, 1000);
            assert_device_eq(&s.label, &q, &model);
        }
    }

    #[test]
    fn more_reads_in_flight_than_the_queue_depth() {
        for s in subjects() {
            let q = s.queue();
            let model = write_many(&s, &q, 2000);
            let block = s.block() as usize;
            let mut bufs: Vec<AlignedBuf> = (0..MANY_REQUESTS)
                .map(|_| {
                    let mut b = AlignedBuf::new(block);
                    b.as_mut_slice().fill(0x5a);
                    b
                })
                .collect();
            let mut requests: Vec<Request<'_>> = bufs
                .iter_mut()
                .enumerate()
                .map(|(i, b)| Request {
                    op: Op::Read,
                    flags: IoFlags::NONE,
                    offset: (i * block) as u64,
                    len: 0,
                    buf: Some(b.as_mut_slice()),
                })
                .collect();
            let results = q.run(&mut requests);
            drop(requests);
            assert!(results.iter().all(Result::is_ok), "{}", s.label);
            for (i, b) in bufs.iter().enumerate() {
                assert!(
                    b.as_slice() == &model[i * block..(i + 1) * block],
                    "{}: block {i}",
                    s.label
                );
            }
        }
    }

    #[test]
    fn mixed_operations_in_flight_together() {
        // Rewrites, discards, write-zeroes and flushes, more of them than the queue holds.
        for s in subjects() {
            let q = s.queue();
            let mut model = write_many(&s, &q, 3000);
            let block = s.block() as usize;
            let mut bufs: Vec<AlignedBuf> = (0..MANY_REQUESTS)
                .map(|i| {
                    let mut b = AlignedBuf::new(block);
                    b.as_mut_slice()
                        .copy_from_slice(&pattern(5000 + i as u64, block));
                    b
                })
                .collect();
            let mut requests: Vec<Request<'_>> = bufs
                .iter_mut()
                .enumerate()
                .map(|(i, b)| {
                    let offset = (i * block) as u64;
                    match i % 4 {
                        0 => Request {
                            op: Op::Discard,
                            flags: IoFlags::NONE,
                            offset,
                            len: block as u64,
                            buf: None,
                        },
                        1 => Request {
                            op: Op::WriteZeroes,
                            flags: if i % 8 == 1 {
                                IoFlags::NO_HOLE
                            } else {
                                IoFlags::NONE
                            },
                            offset,
                            len: block as u64,
                            buf: None,
                        },
                        2 => Request {
                            op: Op::Flush,
                            flags: IoFlags::NONE,
                            offset: 0,
                            len: 0,
                            buf: None,
                        },
                        _ => Request {
                            op: Op::Write,
                            flags: IoFlags::NONE,
                            offset,
                            len: 0,
                            buf: Some(b.as_mut_slice()),
                        },
                    }
                })
                .collect();
            let results = q.run(&mut requests);
            for (i, r) in results.iter().enumerate() {
                assert!(r.is_ok(), "{}: request {i}: {r:?}", s.label);
            }
            if s.stores {
                for i in 0..MANY_REQUESTS {
                    let range = i * block..(i + 1) * block;
                    match i % 4 {
                        0 | 1 => model[range].fill(0),
                        2 => {}
                        _ => model[range].copy_from_slice(&pattern(5000 + i as u64, block)),
                    }
                }
            }
            assert_device_eq(&s.label, &q, &model);
        }
    }

    #[test]
    fn two_queues_share_one_device() {
        // Each queue has its own reactor; what one writes, the other reads.
        for s in storing_subjects() {
            let a = s.queue();
            let b = s.queue();
            let block = s.block();
            a.write(0, &pattern(1, block as usize), IoFlags::NONE)
                .unwrap();
            b.write(block, &pattern(2, block as usize), IoFlags::NONE)
                .unwrap();
            assert_eq!(
                read_vec(&b, 0, block),
                pattern(1, block as usize),
                "{}",
                s.label
            );
            assert_eq!(
                read_vec(&a, block, block),
                pattern(2, block as usize),
                "{}",
                s.label
            );
        }
    }

    #[test]
    fn queues_on_other_threads() {
        for s in storing_subjects() {
            let block = s.block();
            std::thread::scope(|scope| {
                for t in 0..2u64 {
                    let device = s.device.clone();
                    scope.spawn(move || {
                        let q = BlockingQueue::open(&device, Switches::default()).unwrap();
                        for i in 0..16u64 {
                            let offset = (t * 16 + i) * block;
                            q.write(offset, &pattern(offset, block as usize), IoFlags::NONE)
                                .unwrap();
                        }
                    });
                }
            });
            let q = s.queue();
            for n in 0..32u64 {
                let offset = n * block;
                assert_eq!(
                    read_vec(&q, offset, block),
                    pattern(offset, block as usize),
                    "{}: block {n}",
                    s.label
                );
            }
        }
    }
}

mod opening {
    use super::*;

    fn file_spec(path: &Path, engine: &str, extra: &str) -> String {
        format!("file:{},engine={engine}{extra}", path.display())
    }

    /// A file backs one device at a time: a second open (another device, or another
    /// cairn) is refused before anything changes, naming the holder; closing frees it.
    #[test]
    fn a_file_in_use_is_refused_until_closed() {
        let dir = scratch_dir();
        let path = dir.path().join("locked");
        for engine in ENGINES {
            let first = open_spec(&file_spec(&path, engine, ",size=64k")).unwrap();
            let e = match open_spec(&file_spec(&path, engine, ",size=128k")) {
                Ok(_) => panic!("{engine}: the file opened twice"),
                Err(e) => e.to_string(),
            };
            assert!(
                e.contains("in use") && e.contains("this cairn") && e.contains("locked"),
                "{e}"
            );
            // Refused before the size was changed.
            assert_eq!(std::fs::metadata(&path).unwrap().len(), 64 << 10);
            drop(first);
            open_spec(&file_spec(&path, engine, "")).expect("free again once closed");
        }
    }

    /// A file whose device is closed is free at once, even when the device did I/O
    /// through a ring: the kernel drops a ring's (or a fixed-file slot's) reference to
    /// the file some time after, and the lock must not wait for it. `cairn serve` opens
    /// a stack once to check it and then for real, in one process (CI saw the second
    /// open refused: "in use by this cairn").
    #[test]
    fn a_file_is_free_as_soon_as_its_device_is_closed_after_io() {
        let dir = scratch_dir();
        let path = dir.path().join("reopened");
        for engine in ENGINES {
            for round in 0..100u64 {
                let device = open_spec(&file_spec(&path, engine, ",size=64k"))
                    .unwrap_or_else(|e| panic!("{engine}: round {round}: {e}"));
                let q = BlockingQueue::open(&device, Switches::default()).unwrap();
                let data = pattern(round, 4096);
                q.write(4096 * (round % 16), &data, IoFlags::NONE).unwrap();
                assert_eq!(read_vec(&q, 4096 * (round % 16), 4096), data);
                drop(q);
                drop(device);
            }
        }
    }

    #[test]
    fn file_created_with_size() {
        let dir = scratch_dir();
        for engine in ENGINES {
            let path = dir.path().join(format!("new-{engine}"));
            assert!(!path.exists());
            let device = open_spec(&file_spec(&path, engine, ",size=192k")).unwrap();
            assert_eq!(device.geometry().size_bytes, 192 << 10);
            assert_eq!(std::fs::metadata(&path).unwrap().len(), 192 << 10);
        }
    }

    #[test]
    fn existing_file_opened_without_size_keeps_its_data() {
        let dir = scratch_dir();
        let path = dir.path().join("old");
        let data = pattern(42, 65536);
        let mut contents = data.clone();
        contents.extend_from_slice(&[9u8; 100]); // a partial block at the end is not used
        std::fs::write(&path, &contents).unwrap();
        for direct in ["0", "1"] {
            for engine in ENGINES {
                let spec = file_spec(&path, engine, &format!(",direct={direct}"));
                let device = open_spec(&spec).unwrap();
                assert_eq!(device.geometry().size_bytes, 65536, "{spec}");
                let q = BlockingQueue::open(&device, Switches::default()).unwrap();
                assert_eq!(read_vec(&q, 0, 65536), data, "{spec}");
                let e = refused(q.write(65536, &[1u8; 4096], IoFlags::NONE));
                assert!(matches!(e, IoError::OutOfRange { .. }), "{spec}");
            }
        }
        assert_eq!(std::fs::read(&path).unwrap(), contents);
    }

    #[test]
    fn size_extends_an_existing_file_and_keeps_its_data() {
        let dir = scratch_dir();
        let path = dir.path().join("grow");
        let data = pattern(8, 8192);
        std::fs::write(&path, &data).unwrap();
        let device = open_spec(&file_spec(&path, "io_uring", ",size=64k")).unwrap();
        assert_eq!(device.geometry().size_bytes, 65536);
        let q = BlockingQueue::open(&device, Switches::default()).unwrap();
        assert_eq!(read_vec(&q, 0, 8192), data);
        assert!(read_vec(&q, 8192, 65536 - 8192).iter().all(|&b| b == 0));
        drop(q);
        drop(device);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 65536);
    }

    #[test]
    fn reopening_with_another_engine_sees_the_same_bytes() {
        let dir = scratch_dir();
        let path = dir.path().join("shared");
        let first = open_spec(&file_spec(&path, "aio", ",size=1M")).unwrap();
        let q = BlockingQueue::open(&first, Switches::default()).unwrap();
        let data = pattern(6, 12288);
        q.write(40960, &data, IoFlags::NONE).unwrap();
        q.flush().unwrap();
        drop(q);
        drop(first);
        for engine in ENGINES {
            let device = open_spec(&file_spec(&path, engine, "")).unwrap();
            assert_eq!(device.geometry().size_bytes, 1 << 20);
            let q = BlockingQueue::open(&device, Switches::default()).unwrap();
            assert_eq!(read_vec(&q, 40960, 12288), data, "{engine}");
        }
    }

    #[test]
    fn missing_file_without_size_is_an_error() {
        let dir = scratch_dir();
        let path = dir.path().join("absent");
        for engine in ENGINES {
            match open_spec(&file_spec(&path, engine, "")) {
                Err(Error::Invalid(message)) => {
                    assert!(message.contains("no such file"), "{message}")
                }
                Err(other) => panic!("unexpected error: {other}"),
                Ok(_) => panic!("opened a missing file"),
            }
            assert!(!path.exists(), "nothing is created");
        }
        // With size= but in a directory that does not exist: the open fails.
        let nested = dir.path().join("no/such/dir/file");
        match open_spec(&file_spec(&nested, "sync", ",size=1M")) {
            Err(Error::Os { .. }) => {}
            Err(other) => panic!("unexpected error: {other}"),
            Ok(_) => panic!("opened a file in a missing directory"),
        }
    }

    #[test]
    fn empty_file_and_directory_are_errors() {
        let dir = scratch_dir();
        let empty = dir.path().join("empty");
        std::fs::write(&empty, b"").unwrap();
        assert!(matches!(
            open_spec(&file_spec(&empty, "io_uring", "")).err(),
            Some(Error::Invalid(_))
        ));
        assert!(matches!(
            open_spec(&file_spec(dir.path(), "io_uring", "")).err(),
            Some(Error::Invalid(_))
        ));
    }

    #[test]
    fn bad_specs_are_refused() {
        for bad in [
            "",
            "null",
            "null:",
            "null:1x",
            "null:-1",
            "disk:1M",
            "mem:1M,block",
            "mem:1M,foo=1",
            "mem:1M,block=4k,block=4k",
            "file:",
            "file:/tmp/x,engine=spdk",
            "file:/tmp/x,direct=2",
            "file:/tmp/x,size=big",
            "file:/tmp/x,block=4k",
        ] {
            assert!(LeafSpec::parse(bad).is_err(), "{bad:?} parsed");
        }
        // Parsed, but refused when opened.
        for bad in [
            "null:0",
            "mem:0",
            "mem:1000",
            "null:1M,block=1000",
            "mem:1M,block=256",
            "null:1M,block=128k",
            "mem:128T",
        ] {
            match open_spec(bad) {
                Err(Error::Invalid(_)) => {}
                Err(other) => panic!("{bad}: unexpected error {other}"),
                Ok(_) => panic!("{bad} opened"),
            }
        }
    }

    #[test]
    fn block_size_option() {
        for kind in ["null", "mem"] {
            let device = open_spec(&format!("{kind}:1M,block=4k")).unwrap();
            assert_eq!(device.geometry().block_bytes, 4096);
            let q = BlockingQueue::open(&device, Switches::default()).unwrap();
            let e = refused(q.write(512, &[1u8; 512], IoFlags::NONE));
            assert!(matches!(e, IoError::Misaligned { block: 4096, .. }));
            q.write(4096, &[1u8; 4096], IoFlags::NONE).unwrap();
        }
    }
}

mod switches {
    use super::*;

    fn all_switches() -> Vec<Switches> {
        let mut out = Vec::new();
        for reap in [ReapMode::Eager, ReapMode::Lazy] {
            for clock in [ClockMode::Cached, ClockMode::Precise] {
                for stats in [StatsMode::On, StatsMode::Off] {
                    // Completion coalescing off with the precise clock, on with the cached.
                    let coalesce = match clock {
                        ClockMode::Cached => CoalesceMode::On,
                        ClockMode::Precise => CoalesceMode::Off,
                    };
                    out.push(Switches {
                        clock,
                        reap,
                        stats,
                        coalesce,
                        ..Switches::default()
                    });
                }
            }
        }
        out
    }

    #[test]
    fn every_reap_and_clock_mode_gives_the_same_bytes() {
        for s in subjects() {
            for switches in all_switches() {
                let label = format!("{} {switches:?}", s.label);
                let q = s.queue_with(switches);
                let block = s.block() as usize;
                // More requests than the queue depth, so some wait for a slot.
                let mut bufs: Vec<AlignedBuf> = (0..MANY_REQUESTS)
                    .map(|i| {
                        let mut b = AlignedBuf::new(block);
                        b.as_mut_slice()
                            .copy_from_slice(&pattern(i as u64 + 17, block));
                        b
                    })
                    .collect();
                let mut requests: Vec<Request<'_>> = bufs
                    .iter_mut()
                    .enumerate()
                    .map(|(i, b)| Request {
                        op: Op::Write,
                        flags: IoFlags::NONE,
                        offset: (i * block) as u64,
                        len: 0,
                        buf: Some(b.as_mut_slice()),
                    })
                    .collect();
                let results = q.run(&mut requests);
                assert!(results.iter().all(Result::is_ok), "{label}: {results:?}");
                q.flush().unwrap();
                q.zero(Op::Discard, 0, block as u64, IoFlags::NONE).unwrap();
                q.zero(
                    Op::WriteZeroes,
                    block as u64,
                    block as u64,
                    IoFlags::NO_HOLE,
                )
                .unwrap();
                let got = read_vec(&q, 0, (MANY_REQUESTS * block) as u64);
                for i in 0..MANY_REQUESTS {
                    let chunk = &got[i * block..(i + 1) * block];
                    if i < 2 || !s.stores {
                        assert!(chunk.iter().all(|&b| b == 0), "{label}: block {i}");
                    } else {
                        assert!(
                            chunk == &pattern(i as u64 + 17, block)[..],
                            "{label}: block {i}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn statistics_count_only_when_on() {
        for s in subjects() {
            for stats in [StatsMode::On, StatsMode::Off] {
                let q = s.queue_with(Switches {
                    stats,
                    ..Switches::default()
                });
                let block = s.block() as usize;
                for i in 0..5 {
                    q.write((i * block) as u64, &pattern(1, block), IoFlags::NONE)
                        .unwrap();
                }
                read_vec(&q, 0, 2 * block as u64);
                q.flush().unwrap();
                // What the queue counted itself and what its members counted for it.
                let snap = q.queue().stats().snapshot(u64::MAX);
                let on = stats == StatsMode::On;
                assert_eq!(q.queue().stats().enabled(), on, "{}", s.label);
                let (writes, reads) = if on { (5, 1) } else { (0, 0) };
                let (w, r) = (Op::Write.index(), Op::Read.index());
                assert_eq!(snap.ios[w], writes, "{} {stats:?}", s.label);
                assert_eq!(snap.ios[r], reads, "{} {stats:?}", s.label);
                assert_eq!(
                    snap.sectors[w] * 512,
                    writes * block as u64,
                    "{} {stats:?}",
                    s.label
                );
                assert_eq!(snap.in_flight, 0, "{} {stats:?}", s.label);
            }
        }
    }
}

/// A file that cannot be served is refused in one line, and none is made.
#[test]
fn a_missing_file_a_directory_or_an_empty_file_is_refused_in_one_line() {
    use cairn_leaves::file::FileDevice;
    use cairn_leaves::spec::Engine;
    let dir = scratch_dir();
    let (missing, empty) = (dir.path().join("missing"), dir.path().join("empty"));
    std::fs::File::create(&empty).expect("create");
    for (path, why) in [
        (&missing, "no such file (add size=SIZE to create it)"),
        (
            &dir.path().to_path_buf(),
            "not a regular file or block device",
        ),
        (&empty, "empty (add size=SIZE to extend it)"),
    ] {
        let e = FileDevice::open("f", path, Engine::Auto, false, None)
            .err()
            .map(|e| e.to_string());
        assert_eq!(e, Some(format!("file {}: {why}", path.display())));
    }
    assert!(!missing.exists(), "nothing made");
    // A missing name under /dev is a disk that is not there: no hint to create it, and
    // nothing made there with a size either.
    let disk = std::path::Path::new("/dev/cairn-no-such-disk");
    for size in [None, Some((1 << 20, true))] {
        let e = FileDevice::open("f", disk, Engine::Auto, false, size)
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            e,
            Some(format!(
                "file {}: no such device (a block device under /dev is served as it is, and no file is made there; check its name with lsblk)",
                disk.display()
            ))
        );
        assert!(!disk.exists(), "{} made", disk.display());
    }
}
