//! Integration tests for `cairn bench` as a library: verification catches a device that
//! loses data and passes one that keeps it, `--fsync` issues flushes, failed I/O is
//! reported, and `JobSpec::plan` refuses what cannot run.
//!
//! Every run here is bounded by `io_size` (bytes), never by time, and nothing asserts on
//! timing.

use std::sync::Arc;

use cairn_bench::verify::Mismatch;
use cairn_bench::{run, Failure, JobSpec, Pattern, Report};
use cairn_core::{ClockMode, Device, Op, ReapMode, StatsMode, Switches};
use cairn_leaves::LeafSpec;
use tempfile::TempDir;

const ENGINES: [&str; 3] = ["io_uring", "aio", "sync"];

fn open(spec: &str) -> Arc<dyn Device> {
    let parsed = LeafSpec::parse(spec).unwrap_or_else(|e| panic!("{spec}: {e}"));
    cairn_leaves::open(&parsed, "bench-test").unwrap_or_else(|e| panic!("{spec}: {e}"))
}

fn scratch_dir() -> TempDir {
    tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("create a temporary directory")
}

/// A file device of 1 MiB in `dir`.
fn file_device(dir: &TempDir, engine: &str, direct: bool) -> Arc<dyn Device> {
    let path = dir.path().join(format!("{engine}-{}", u8::from(direct)));
    open(&format!(
        "file:{},engine={engine},direct={},size=1M",
        path.display(),
        u8::from(direct)
    ))
}

/// A verifying job over the first 256 KiB (64 blocks of 4 KiB), 8 requests in flight.
fn verify_spec(rw: Pattern) -> JobSpec {
    JobSpec {
        rw,
        bs: 4096,
        iodepth: 8,
        size: Some(256 << 10),
        // Mixed patterns run longer so that reads land on blocks written earlier.
        io_size: matches!(rw, Pattern::RandRw | Pattern::ReadWrite).then_some(4 << 20),
        verify: true,
        ..JobSpec::default()
    }
}

fn run_ok(spec: &JobSpec, device: Arc<dyn Device>, what: &str) -> Report {
    let report = run(spec, device, Switches::default(), false)
        .unwrap_or_else(|e| panic!("{what}: refused: {e}"));
    assert!(
        report.failure.is_none(),
        "{what}: failed: {}",
        report.failure.as_ref().unwrap()
    );
    report
}

mod verify {
    use super::*;

    fn expect_verify_failure(report: &Report, spec: &JobSpec, what: &str) {
        match &report.failure {
            Some(Failure::Verify { offset, mismatch }) => {
                assert_eq!(offset % spec.bs, 0, "{what}: offset {offset}");
                assert!(*offset < spec.size.unwrap(), "{what}: offset {offset}");
                assert_eq!(
                    *mismatch,
                    Mismatch::NoHeader { found: [0; 8] },
                    "{what}: null reads zeros"
                );
            }
            other => panic!("{what}: expected a verify failure, got {other:?}"),
        }
        assert_eq!(report.exit_code(), 1, "{what}");
        assert_eq!(report.to_json()["jobs"][0]["error"], libc::EILSEQ, "{what}");
    }

    #[test]
    fn null_fails_write_then_verify() {
        for rw in [Pattern::RandWrite, Pattern::Write] {
            let spec = verify_spec(rw);
            let report = run(&spec, open("null:1M"), Switches::default(), false).unwrap();
            expect_verify_failure(&report, &spec, rw.name());
            assert_eq!(report.verified_blocks, 0);
        }
    }

    #[test]
    fn null_fails_mixed_read_write_verify() {
        for rw in [Pattern::RandRw, Pattern::ReadWrite] {
            let spec = verify_spec(rw);
            let report = run(&spec, open("null:1M"), Switches::default(), false).unwrap();
            expect_verify_failure(&report, &spec, rw.name());
        }
    }

    #[test]
    fn mem_passes() {
        for rw in [Pattern::RandWrite, Pattern::RandRw, Pattern::ReadWrite] {
            let report = run_ok(&verify_spec(rw), open("mem:1M"), rw.name());
            assert!(report.verified_blocks > 0, "{}", rw.name());
            assert_eq!(report.exit_code(), 0);
        }
    }

    #[test]
    fn sequential_write_verifies_every_block() {
        // 64 blocks written once each, then all 64 read back.
        let report = run_ok(&verify_spec(Pattern::Write), open("mem:1M"), "write");
        assert_eq!(report.verified_blocks, 64);
        assert_eq!(report.dirs[1].ios, 64);
        let json = report.to_json();
        assert_eq!(json["cairn"]["verify"]["blocks_checked"], 64);
        assert_eq!(json["cairn"]["verify"]["enabled"], true);
    }

    #[test]
    fn files_pass() {
        let dir = scratch_dir();
        for direct in [false, true] {
            for engine in ENGINES {
                let what = format!("{engine} direct={direct}");
                for rw in [Pattern::RandWrite, Pattern::RandRw] {
                    let device = file_device(&dir, engine, direct);
                    let report = run_ok(&verify_spec(rw), device, &what);
                    assert!(report.verified_blocks > 0, "{what} {}", rw.name());
                }
            }
        }
    }

    #[test]
    fn two_jobs_verify_their_own_slices() {
        let spec = JobSpec {
            numjobs: 2,
            size: Some(1 << 20),
            ..verify_spec(Pattern::RandWrite)
        };
        let report = run_ok(&spec, open("mem:1M"), "numjobs=2");
        assert!(report.verified_blocks > 0);
        // Each job writes its whole slice once, sequentially, then reads it all back.
        let spec = JobSpec {
            rw: Pattern::Write,
            ..spec
        };
        let report = run_ok(&spec, open("mem:1M"), "numjobs=2 sequential");
        assert_eq!(report.verified_blocks, 256);
        assert_eq!(report.queues.len(), 2);
    }

    #[test]
    fn every_switch_setting_verifies() {
        let dir = scratch_dir();
        for reap in [ReapMode::Eager, ReapMode::Lazy] {
            for clock in [ClockMode::Cached, ClockMode::Precise] {
                for stats in [StatsMode::On, StatsMode::Off] {
                    let switches = Switches {
                        clock,
                        reap,
                        stats,
                        ..Switches::default()
                    };
                    for engine in ENGINES {
                        let device = file_device(&dir, engine, false);
                        let spec = verify_spec(Pattern::RandWrite);
                        let report = run(&spec, device, switches, false).unwrap();
                        assert!(report.failure.is_none(), "{engine} {switches:?}");
                        assert!(report.verified_blocks > 0, "{engine} {switches:?}");
                    }
                }
            }
        }
    }
}

mod accounting {
    use super::*;

    #[test]
    fn io_size_bounds_the_run() {
        for rw in [Pattern::RandRead, Pattern::Read, Pattern::Write] {
            let spec = JobSpec {
                rw,
                io_size: Some(1 << 20),
                iodepth: 16,
                ..JobSpec::default()
            };
            let report = run_ok(&spec, open("null:64M"), rw.name());
            let dir = usize::from(rw == Pattern::Write);
            assert_eq!(report.dirs[dir].ios, 256, "{}", rw.name());
            assert_eq!(report.dirs[dir].bytes, 1 << 20, "{}", rw.name());
            assert_eq!(report.dirs[1 - dir].ios, 0, "{}", rw.name());
            assert_eq!(report.dirs[2].ios, 0, "{}", rw.name());
        }
    }

    #[test]
    fn mixed_patterns_do_both() {
        let spec = JobSpec {
            rw: Pattern::RandRw,
            rwmixread: 70,
            io_size: Some(4 << 20),
            ..JobSpec::default()
        };
        let report = run_ok(&spec, open("mem:4M"), "randrw");
        let (r, w) = (report.dirs[0].ios, report.dirs[1].ios);
        assert_eq!(r + w, 1024);
        assert!(r > w && w > 0, "reads {r}, writes {w}");
    }

    #[test]
    fn fsync_records_sync_ios() {
        let dir = scratch_dir();
        let mut devices = vec![("mem", open("mem:1M"))];
        for engine in ENGINES {
            devices.push((engine, file_device(&dir, engine, false)));
        }
        for (name, device) in devices {
            // One slot: a flush after every write, so as many flushes as writes.
            let spec = JobSpec {
                rw: Pattern::Write,
                iodepth: 1,
                fsync: 1,
                io_size: Some(64 << 10),
                ..JobSpec::default()
            };
            let report = run_ok(&spec, device.clone(), name);
            assert_eq!(report.dirs[1].ios, 16, "{name}");
            assert_eq!(report.dirs[2].ios, 16, "{name}");
            assert_eq!(report.dirs[2].bytes, 0, "{name}");
            assert_eq!(report.to_json()["jobs"][0]["sync"]["total_ios"], 16);
            // A flush after every fourth write.
            let spec = JobSpec { fsync: 4, ..spec };
            let report = run_ok(&spec, device.clone(), name);
            assert_eq!(report.dirs[2].ios, 4, "{name}");
            // Several slots: each flushes after its own writes.
            let spec = JobSpec {
                fsync: 1,
                iodepth: 4,
                rw: Pattern::RandWrite,
                ..spec
            };
            let report = run_ok(&spec, device, name);
            assert_eq!(report.dirs[2].ios, report.dirs[1].ios, "{name}");
            assert!(report.dirs[2].ios > 0, "{name}");
        }
    }

    #[test]
    fn fua_every_sends_every_nth_write_with_fua() {
        // Fourteen sequential writes, one at a time, on a volatile mem: the 4th, 8th and
        // 12th carry FUA. After a power cut exactly those are durable; the others (neither
        // flushed nor FUA) are lost. (Verify blocks are never all zeros.)
        let device = open("mem:1M,block=4k,volatile=1");
        let spec = JobSpec {
            rw: Pattern::Write,
            iodepth: 1,
            fua_every: 4,
            size: Some(56 << 10),
            verify: true,
            ..JobSpec::default()
        };
        let report = run_ok(&spec, device.clone(), "fua");
        assert_eq!(report.dirs[1].ios, 14);
        assert_eq!(report.fua.ios, 3);
        let json = report.to_json();
        assert_eq!(json["cairn"]["fua_writes"]["total_ios"], 3);
        assert_eq!(json["cairn"]["fua_writes"]["every"], 4);
        assert!(report.to_text().contains("write with FUA (--fua-every 4)"));
        device.power_cut();
        let q = cairn_core::blocking::BlockingQueue::open(&device, Switches::default()).unwrap();
        let mut durable = vec![0u8; 56 << 10];
        q.read(0, &mut durable).unwrap();
        let data: Vec<bool> = durable
            .chunks(4096)
            .map(|b| b.iter().any(|&x| x != 0))
            .collect();
        for (block, &d) in data.iter().enumerate() {
            // FUA makes its own write durable and no other.
            assert_eq!(
                d,
                block % 4 == 3,
                "block {block}: FUA on the 4th, 8th and 12th"
            );
        }
        // Without --fua-every, no write carries FUA: the cut takes the device back to
        // what the first run made durable.
        let report = run_ok(
            &JobSpec {
                fua_every: 0,
                ..spec
            },
            device.clone(),
            "none",
        );
        assert_eq!(report.fua.ios, 0);
        assert!(!report.to_text().contains("FUA"));
        device.power_cut();
        let mut b = vec![0u8; 56 << 10];
        q.read(0, &mut b).unwrap();
        assert!(b == durable, "no write of the second run is durable");
    }

    #[test]
    fn device_statistics_follow_the_stats_switch() {
        for stats in [StatsMode::On, StatsMode::Off] {
            let spec = JobSpec {
                rw: Pattern::RandWrite,
                io_size: Some(1 << 20),
                ..JobSpec::default()
            };
            let switches = Switches {
                stats,
                ..Switches::default()
            };
            let report = run(&spec, open("mem:4M"), switches, false).unwrap();
            assert!(report.failure.is_none());
            let (_, d) = &report.devices[0];
            assert_eq!(d.enabled, stats == StatsMode::On);
            let writes = if stats == StatsMode::On { 256 } else { 0 };
            assert_eq!(d.ios[Op::Write.index()], writes);
            assert_eq!(report.dirs[1].ios, 256, "the job counts either way");
        }
    }

    #[test]
    fn failed_io_is_reported() {
        // Reads past the end of a file truncated under the device fail with EIO.
        let dir = scratch_dir();
        for engine in ENGINES {
            let path = dir.path().join(format!("shrunk-{engine}"));
            let device = open(&format!("file:{},engine={engine},size=1M", path.display()));
            std::fs::File::options()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(0)
                .unwrap();
            let spec = JobSpec {
                rw: Pattern::RandRead,
                io_size: Some(256 << 10),
                ..JobSpec::default()
            };
            let report = run(&spec, device, Switches::default(), false).unwrap();
            match report.failure {
                Some(Failure::Io { op, errno, .. }) => {
                    assert_eq!(op, Op::Read, "{engine}");
                    assert_eq!(errno, libc::EIO, "{engine}");
                }
                ref other => panic!("{engine}: expected an I/O failure, got {other:?}"),
            }
            assert_eq!(report.exit_code(), 1);
        }
    }

    #[test]
    fn reports_render() {
        let spec = JobSpec {
            io_size: Some(1 << 20),
            ..JobSpec::default()
        };
        let report = run_ok(&spec, open("null:16M"), "render");
        let text = report.to_text();
        assert!(text.contains("rw=randread"), "{text}");
        assert!(text.contains("read: IOPS="), "{text}");
        let json = report.to_json();
        let read = &json["jobs"][0]["read"];
        assert_eq!(read["total_ios"], 256);
        assert_eq!(read["io_bytes"], 1 << 20);
        assert!(read["clat_ns"]["percentile"]["99.000000"].is_u64());
        assert_eq!(json["global options"]["rw"], "randread");
    }
}

mod depth {
    //! A job keeps `iodepth` requests in flight, with or without `--verify`.

    use std::cell::RefCell;
    use std::os::fd::RawFd;
    use std::rc::Rc;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

    use cairn_core::{Core, Error, Geometry, Io, Poller, Queue, QueueStats};

    use super::*;

    /// How many batches a [`Gate`] passed on, and how many of them held `iodepth` requests.
    #[derive(Default)]
    struct Seen {
        batches: AtomicU64,
        full: AtomicU64,
    }

    /// A device in front of another that holds every request until the reactor polls it,
    /// then passes the batch on. A job whose callbacks refill every slot hands it a full
    /// batch on each pass, so the batch size is the number of requests in flight.
    struct Gate {
        inner: Arc<dyn Device>,
        iodepth: usize,
        seen: Arc<Seen>,
    }

    struct GateQueue {
        inner: Rc<dyn Queue>,
        held: RefCell<Vec<Io>>,
        iodepth: usize,
        seen: Arc<Seen>,
        eventfd: RawFd,
    }

    impl Device for Gate {
        fn name(&self) -> &str {
            "gate"
        }

        fn describe(&self) -> String {
            format!("gate in front of {}", self.inner.describe())
        }

        fn geometry(&self) -> Geometry {
            self.inner.geometry()
        }

        fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
            // SAFETY: a plain eventfd, closed when the queue is dropped.
            let eventfd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            assert!(eventfd >= 0, "eventfd");
            let queue = Rc::new(GateQueue {
                inner: self.inner.open_queue(core)?,
                held: RefCell::new(Vec::new()),
                iodepth: self.iodepth,
                seen: self.seen.clone(),
                eventfd,
            });
            core.register_poller(queue.clone());
            Ok(queue)
        }
    }

    impl Queue for GateQueue {
        fn submit(&self, io: Io) {
            self.held.borrow_mut().push(io);
        }

        fn stats(&self) -> &QueueStats {
            self.inner.stats()
        }
    }

    impl Poller for GateQueue {
        fn unplug(&self) {}

        fn reap(&self) -> usize {
            let batch: Vec<Io> = self.held.borrow_mut().drain(..).collect();
            if !batch.is_empty() {
                self.seen.batches.fetch_add(1, Relaxed);
                if batch.len() == self.iodepth {
                    self.seen.full.fetch_add(1, Relaxed);
                }
            }
            for io in &batch {
                self.inner.submit(*io);
            }
            batch.len()
        }

        fn busy(&self) -> bool {
            !self.held.borrow().is_empty()
        }

        fn event_fd(&self) -> RawFd {
            self.eventfd
        }

        fn clear_event(&self) {}
    }

    impl Drop for GateQueue {
        fn drop(&mut self) {
            // SAFETY: our own eventfd, closed once.
            unsafe { libc::close(self.eventfd) };
        }
    }

    #[test]
    fn every_pattern_keeps_iodepth_in_flight() {
        for verify in [false, true] {
            for rw in [
                Pattern::Read,
                Pattern::Write,
                Pattern::RandRead,
                Pattern::RandWrite,
                Pattern::ReadWrite,
                Pattern::RandRw,
            ] {
                let what = format!("{} verify={verify}", rw.name());
                let seen = Arc::new(Seen::default());
                let gate = Arc::new(Gate {
                    inner: open("mem:1M"),
                    iodepth: 8,
                    seen: seen.clone(),
                });
                let spec = JobSpec {
                    rw,
                    iodepth: 8,
                    size: Some(256 << 10),
                    io_size: Some(4 << 20),
                    verify,
                    ..JobSpec::default()
                };
                let report = run_ok(&spec, gate, &what);
                assert_eq!(report.dirs[0].ios + report.dirs[1].ios, 1024, "{what}");
                let (batches, full) = (seen.batches.load(Relaxed), seen.full.load(Relaxed));
                // 1024 requests 8 at a time is 128 full batches; the last few, as slots
                // finish, and a verify pass may add more.
                assert!(full >= 128, "{what}: {full} of {batches} batches were full");
            }
        }
    }
}

mod plan {
    use super::*;

    fn refused(spec: JobSpec, device: &str, mention: &str) {
        let device = open(device);
        match spec.plan(&*device) {
            Err(message) => assert!(
                message.contains(mention),
                "message {message:?} should mention {mention:?}"
            ),
            Ok(plan) => panic!("{spec:?} planned as {plan:?}"),
        }
        // `run` refuses the same way, before starting anything.
        assert!(run(&spec, device, Switches::default(), false).is_err());
    }

    #[test]
    fn valid_specs_plan() {
        let device = open("mem:1M");
        let plan = JobSpec::default().plan(&*device).unwrap();
        assert_eq!(plan.regions, vec![(0, 1 << 20)]);
        assert_eq!(plan.io_size, 1 << 20);
        let spec = JobSpec {
            offset: 4096,
            size: Some(10_000),
            numjobs: 3,
            ..JobSpec::default()
        };
        // The region is cut to whole blocks of --bs; every job shares it.
        assert_eq!(spec.plan(&*device).unwrap().regions, vec![(4096, 8192); 3]);
        let spec = JobSpec {
            verify: true,
            numjobs: 2,
            iodepth: 4,
            ..JobSpec::default()
        };
        let plan = spec.plan(&*device).unwrap();
        assert_eq!(plan.regions, vec![(0, 512 << 10), (512 << 10, 512 << 10)]);
    }

    #[test]
    fn iodepth_zero() {
        let spec = JobSpec {
            iodepth: 0,
            ..JobSpec::default()
        };
        refused(spec, "null:1M", "--iodepth");
    }

    #[test]
    fn buffers_bounded() {
        // 4096 x 64 MiB would be 256 GiB of buffers: refused before anything is allocated.
        let spec = JobSpec {
            iodepth: 4096,
            bs: 64 << 20,
            ..JobSpec::default()
        };
        refused(spec, "null:1T", "buffers");
    }

    #[test]
    fn unaligned_block_size() {
        for bs in [0, 1000, 4097] {
            let spec = JobSpec {
                bs,
                ..JobSpec::default()
            };
            refused(spec, "null:1M", "--bs");
        }
        // 512 bytes is fine on a 512-byte device but not on a 4 KiB one.
        let spec = JobSpec {
            bs: 512,
            ..JobSpec::default()
        };
        assert!(spec.plan(&*open("null:1M")).is_ok());
        refused(spec, "null:1M,block=4k", "--bs");
    }

    #[test]
    fn region_past_the_end() {
        let spec = JobSpec {
            offset: 512 << 10,
            size: Some(1 << 20),
            ..JobSpec::default()
        };
        refused(spec, "null:1M", "--size");
        let spec = JobSpec {
            offset: 4096,
            size: Some(u64::MAX - 100),
            ..JobSpec::default()
        };
        refused(spec, "null:1M", "--size");
    }

    #[test]
    fn offset_past_the_end() {
        for offset in [1 << 20, 2 << 20] {
            let spec = JobSpec {
                offset,
                ..JobSpec::default()
            };
            refused(spec, "null:1M", "--offset");
        }
        let spec = JobSpec {
            offset: 1000,
            ..JobSpec::default()
        };
        refused(spec, "null:1M", "--offset");
    }

    #[test]
    fn region_smaller_than_a_block() {
        let spec = JobSpec {
            size: Some(2048),
            ..JobSpec::default()
        };
        refused(spec, "null:1M", "smaller than --bs");
    }

    #[test]
    fn verify_with_too_small_a_region() {
        // 16 blocks cannot keep 32 requests from overlapping.
        let spec = JobSpec {
            verify: true,
            iodepth: 32,
            size: Some(64 << 10),
            ..JobSpec::default()
        };
        refused(spec, "mem:1M", "--verify");
        // Split between 8 jobs, each slice is 8 blocks: too few for 8 in flight.
        let spec = JobSpec {
            verify: true,
            iodepth: 8,
            numjobs: 8,
            size: Some(256 << 10),
            ..JobSpec::default()
        };
        refused(spec, "mem:1M", "--verify");
        // Split between 128 jobs, a slice is smaller than one block.
        let spec = JobSpec {
            verify: true,
            iodepth: 1,
            numjobs: 128,
            size: Some(256 << 10),
            ..JobSpec::default()
        };
        refused(spec, "mem:1M", "smaller than --bs");
    }

    #[test]
    fn other_limits() {
        let base = JobSpec::default();
        let cases = [
            (
                JobSpec {
                    numjobs: 0,
                    ..base.clone()
                },
                "--numjobs",
            ),
            (
                JobSpec {
                    rwmixread: 101,
                    ..base.clone()
                },
                "--rwmixread",
            ),
            (
                JobSpec {
                    io_size: Some(0),
                    ..base.clone()
                },
                "--io_size",
            ),
            (
                JobSpec {
                    runtime: Some(std::time::Duration::ZERO),
                    ..base.clone()
                },
                "--runtime",
            ),
            (
                JobSpec {
                    iodepth: cairn_bench::IODEPTH_MAX + 1,
                    ..base.clone()
                },
                "--iodepth",
            ),
        ];
        for (spec, mention) in cases {
            refused(spec, "null:1M", mention);
        }
    }
}
