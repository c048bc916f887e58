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
use cairn_leaves::LeafSpec;
use proptest::prelude::*;
use proptest::test_runner::Config;
use tempfile::TempDir;

use cairn_testkit as common;
use cairn_testkit::ceph;
use common::{check_all, pattern, Step};

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
            let bytes = pattern(seed, len);
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
    cairn_config::StackFile::parse(&text)
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
    cairn_leaves::open(&spec, "model").expect("device opens")
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

/// An RBD image (tests/ceph: the run's cluster or one of this test's own), a fresh one
/// per case. Fewer cases than the local devices: each creates and removes an image.
#[test]
fn rbd_matches_the_model() {
    let test = "rbd_matches_the_model";
    let Some(tc) = ceph::TestCluster::shared(test) else {
        return;
    };
    let cluster = cairn_leaves::rbd::session::Cluster::connect(
        Some(tc.conf()),
        None,
        std::time::Duration::from_secs(30),
    )
    .expect("connect");
    let pool = cluster.pool("rbd", None).expect("pool rbd");
    let case = std::cell::Cell::new(0);
    let mut runner = proptest::test_runner::TestRunner::new(Config {
        cases: 24,
        ..config()
    });
    runner
        .run(&steps(BUFFERED), |steps| {
            case.set(case.get() + 1);
            let name = tc.name(&format!("m{}", case.get()));
            pool.create(&name, BUFFERED.size())
                .expect("create an image");
            let spec = format!("rbd:rbd/{name},conf={}", tc.conf().display());
            let result = run_model(BUFFERED, &open(&spec), &steps);
            pool.remove(&name).expect("remove the image");
            result.map(|_| ())
        })
        .unwrap_or_else(|e| panic!("{e}"));
}

/// The engines on every kind of file cairn serves: tmpfs, ext4 and xfs (each on a loop
/// device with direct I/O and 4 KiB sectors over a sparse image in /dev/shm), and a
/// loop device itself; buffered and O_DIRECT. Root only (loop devices, mkfs, mount).
mod kinds {
    use super::*;
    use std::io::Write;
    use std::path::PathBuf;
    use std::process::Command;

    use cairn_core::testing::skip;
    use cairn_leaves::file::probe::{self, Nowait};
    use cairn_leaves::file::FileDevice;
    use cairn_leaves::spec::Engine;

    const KINDS: [&str; 4] = ["tmpfs", "ext4", "xfs", "block"];

    fn run(cmd: &mut Command) -> Result<String, String> {
        let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "{cmd:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// The places, made for one test and taken down when it ends (even by a panic).
    struct Places {
        dir: TempDir,
        mounts: Vec<PathBuf>,
        loops: Vec<String>,
        /// The bare loop device, DIRECT.size() bytes of 4 KiB sectors.
        block: String,
    }

    impl Places {
        fn new(test: &str) -> Option<Places> {
            if !rustix::process::geteuid().is_root() {
                skip(test, "needs root (loop devices, mkfs, mount)");
                return None;
            }
            for tool in ["losetup", "mkfs.ext4", "mkfs.xfs", "mount", "umount"] {
                if run(Command::new("sh").args(["-c", &format!("command -v {tool}")])).is_err() {
                    skip(
                        test,
                        &format!("{tool} is not installed (xfsprogs, e2fsprogs)"),
                    );
                    return None;
                }
            }
            let mut places = Places {
                dir: tempfile::tempdir_in("/dev/shm").expect("a directory in /dev/shm"),
                mounts: Vec::new(),
                loops: Vec::new(),
                block: String::new(),
            };
            let made = places.make();
            if let Err(e) = made {
                // Loop devices exhausted, say: not a fault of cairn's, but say so loudly.
                skip(test, &format!("could not make the file systems: {e}"));
                return None;
            }
            Some(places)
        }

        fn make(&mut self) -> Result<(), String> {
            std::fs::create_dir(self.dir.path().join("tmpfs")).map_err(|e| e.to_string())?;
            for (kind, mib) in [("ext4", 64u64), ("xfs", 320)] {
                let dev = self.attach(&format!("{kind}.fs"), mib << 20)?;
                let mkfs: &[&str] = if kind == "ext4" {
                    &["mkfs.ext4", "-q", "-F"]
                } else {
                    &["mkfs.xfs", "-q", "-f"]
                };
                run(Command::new(mkfs[0]).args(&mkfs[1..]).arg(&dev))?;
                let mnt = self.dir.path().join(kind);
                std::fs::create_dir(&mnt).map_err(|e| e.to_string())?;
                run(Command::new("mount").arg(&dev).arg(&mnt))?;
                self.mounts.push(mnt);
            }
            self.block = self.attach("block.img", DIRECT.size())?;
            Ok(())
        }

        fn attach(&mut self, name: &str, bytes: u64) -> Result<String, String> {
            let img = self.dir.path().join(name);
            std::fs::File::create(&img)
                .and_then(|f| f.set_len(bytes))
                .map_err(|e| e.to_string())?;
            let dev = run(Command::new("losetup")
                .args([
                    "--direct-io=on",
                    "--sector-size",
                    "4096",
                    "--find",
                    "--show",
                ])
                .arg(&img))?;
            self.loops.push(dev.clone());
            Ok(dev)
        }

        /// A fresh path on `kind` (for the block kind, the loop device, zeroed).
        fn path(&self, kind: &str, name: &str) -> PathBuf {
            if kind == "block" {
                std::fs::write(&self.block, vec![0u8; DIRECT.size() as usize])
                    .expect("zero the loop device");
                return PathBuf::from(&self.block);
            }
            let path = self.dir.path().join(kind).join(name);
            let _ = std::fs::remove_file(&path);
            path
        }
    }

    impl Drop for Places {
        fn drop(&mut self) {
            for m in &self.mounts {
                let _ = run(Command::new("umount").arg(m));
            }
            for d in &self.loops {
                let _ = run(Command::new("losetup").args(["-d", d]));
            }
        }
    }

    /// The shape a kind and mode take: a loop device has 4 KiB blocks either way.
    fn shape(kind: &str, direct: bool) -> Shape {
        if direct || kind == "block" {
            DIRECT
        } else {
            BUFFERED
        }
    }

    /// What a non-blocking read of the first block gives, asked here independently of the
    /// probe.
    fn nowait_read(path: &Path, direct: bool) -> Nowait {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(if direct { libc::O_DIRECT } else { 0 })
            .open(path)
            .expect("open for the test's own probe");
        let mut buf = cairn_core::AlignedBuf::new(4096);
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: 4096,
        };
        use std::os::fd::AsRawFd;
        // SAFETY: iov describes the 4096 bytes of `buf`, which outlives the call.
        let rc = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, 0, libc::RWF_NOWAIT) };
        match std::io::Error::last_os_error().raw_os_error() {
            _ if rc >= 0 => Nowait::Completes,
            Some(libc::EAGAIN) => Nowait::WouldBlock,
            Some(libc::EOPNOTSUPP) => Nowait::Unsupported,
            e => panic!("{}: preadv2: {e:?}", path.display()),
        }
    }

    /// On every kind, buffered and direct: the probe names the file system, its read
    /// answer is the one the kernel gives this test, the engine in use is the one the
    /// plan makes of the probe (and `describe` says which and why), the write probe
    /// leaves the bytes as they were and a hole a hole.
    #[test]
    fn the_engine_chosen_is_the_one_the_probe_reports() {
        let Some(places) = Places::new("the_engine_chosen_is_the_one_the_probe_reports") else {
            return;
        };
        for kind in KINDS {
            for direct in [false, true] {
                let shape = shape(kind, direct);
                let what = format!("{kind} direct={direct}");
                let path = places.path(kind, "probed");
                let bytes = pattern(7, shape.size());
                if kind != "block" {
                    // A new sparse file first: block 0 must stay a hole.
                    drop(open(&file_spec(&path, "auto", shape)));
                    let file = std::fs::File::open(&path).expect("open");
                    let data_at = rustix::fs::seek(&file, rustix::fs::SeekFrom::Data(0));
                    assert!(
                        !matches!(data_at, Ok(0)),
                        "{what}: the probe left data in the first block of a sparse file"
                    );
                }
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .and_then(|mut f| f.write_all(&bytes))
                    .expect("write the pattern");
                let device = FileDevice::open(
                    "probed",
                    &path,
                    Engine::Auto,
                    direct,
                    Some((shape.size(), false)),
                )
                .unwrap_or_else(|e| panic!("{what}: open: {e}"));
                let probe = device.probe().clone();
                let want_kind = if kind == "block" {
                    "block device"
                } else {
                    kind
                };
                assert_eq!(probe.kind, want_kind, "{what}");
                assert_eq!(probe.direct, direct, "{what}");
                let plan = probe::plan(&probe, None);
                assert_eq!(device.plan(), &plan, "{what}");
                assert_eq!(device.engine(), plan.engine, "{what}");
                assert_ne!(device.engine(), Engine::Auto, "{what}");
                let described = device.describe();
                assert!(
                    described.contains(&plan.label()) && described.contains(&plan.why),
                    "{what}: {described}"
                );
                // The kernel's answer now, asked by the test (the page cache may have
                // warmed since: a buffered WouldBlock may have become Completes).
                let now = nowait_read(&path, direct);
                let same = now == probe.read
                    || (!direct && probe.read == Nowait::WouldBlock && now == Nowait::Completes);
                assert!(
                    same,
                    "{what}: probe read {:?}, kernel now {now:?}",
                    probe.read
                );
                if kind == "tmpfs" {
                    assert_eq!(probe.read, Nowait::Unsupported, "{what}");
                }
                let q = BlockingQueue::open(
                    &(Arc::new(device) as Arc<dyn Device>),
                    Switches::default(),
                )
                .expect("queue");
                let mut back = vec![0u8; bytes.len()];
                q.read(0, &mut back).expect("read back");
                assert!(back == bytes, "{what}: the probe changed the data");
            }
        }
    }

    /// Every engine, and the one chosen, passes the random-operation model test on every
    /// kind, buffered and direct.
    #[test]
    fn every_engine_matches_the_model_on_every_kind_of_file() {
        let Some(places) = Places::new("every_engine_matches_the_model_on_every_kind_of_file")
        else {
            return;
        };
        for kind in KINDS {
            for direct in [false, true] {
                let shape = shape(kind, direct);
                for engine in ["auto", "io_uring", "aio", "sync"] {
                    let mut runner = proptest::test_runner::TestRunner::new(Config {
                        cases: 12,
                        failure_persistence: None,
                        ..Config::default()
                    });
                    let result = runner.run(&steps(shape), |steps| {
                        let path = places.path(kind, engine);
                        let mut spec = file_spec(&path, engine, shape);
                        if direct != (shape.block == DIRECT.block) {
                            spec = spec.replace(",direct=1,", ",direct=0,");
                        }
                        let device = open(&spec);
                        let model = run_model(shape, &device, &steps)?;
                        drop(device);
                        let mut file = std::fs::read(&path).expect("read the file back");
                        file.truncate(model.len());
                        prop_assert!(file == model, "the file holds other bytes");
                        Ok(())
                    });
                    if let Err(e) = result {
                        panic!("{kind} direct={direct} engine={engine}: {e}");
                    }
                }
            }
        }
    }
}
