//! Reports: fio's normal text layout, and fio's `--output-format=json --group_reporting`
//! field names for everything both report, with cairn's extras under `cairn`.

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_core::reactor::LoopStats;
use cairn_core::size::{format_bytes, format_count};
use cairn_core::stats::DeviceStatsSnapshot;
use cairn_core::{ClockMode, Device, Op, ReapMode, StatsMode, Switches};
use hdrhistogram::Histogram;
use serde_json::{json, Map, Value};

use crate::job::{DirStats, JobResult, DIRS};
use crate::{Failure, JobSpec, Progress};

/// Completion-latency percentiles fio prints (and the JSON carries).
pub const CLAT_PERCENTILES: [f64; 17] = [
    1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95,
    99.99,
];
/// Completions-per-reap percentiles, as in QEMU's "process completions from ioq_submit()".
pub const REAP_PERCENTILES: [f64; 11] = [
    1.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 99.99,
];
const DIR_NAMES: [&str; DIRS] = ["read", "write", "sync"];

/// Process CPU time and context switches.
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    /// User CPU time, nanoseconds.
    pub utime_ns: u64,
    /// System CPU time, nanoseconds.
    pub stime_ns: u64,
    /// Voluntary plus involuntary context switches.
    pub ctx: u64,
}

impl Usage {
    /// The whole process's usage so far (every thread, workers included).
    pub fn now() -> Usage {
        use nix::sys::resource::{getrusage, UsageWho};
        use nix::sys::time::TimeValLike;
        // getrusage of this process fails only for a bad `who`, which this is not.
        let Ok(ru) = getrusage(UsageWho::RUSAGE_SELF) else {
            return Usage::default();
        };
        let ns = |tv: nix::sys::time::TimeVal| tv.num_nanoseconds().max(0) as u64;
        Usage {
            utime_ns: ns(ru.user_time()),
            stime_ns: ns(ru.system_time()),
            ctx: (ru.voluntary_context_switches() + ru.involuntary_context_switches()) as u64,
        }
    }

    /// Usage between `earlier` and this.
    pub fn since(&self, earlier: &Usage) -> Usage {
        Usage {
            utime_ns: self.utime_ns.saturating_sub(earlier.utime_ns),
            stime_ns: self.stime_ns.saturating_sub(earlier.stime_ns),
            ctx: self.ctx.saturating_sub(earlier.ctx),
        }
    }
}

/// The merged results of every job (fio's group reporting).
pub struct Report {
    /// The options the run used.
    pub spec: JobSpec,
    /// The device's name.
    pub device_name: String,
    /// The device's one-line description.
    pub device_desc: String,
    /// The switches the run used.
    pub switches: Switches,
    /// Read, write and sync statistics, summed over jobs.
    pub dirs: [DirStats; DIRS],
    /// The writes that carried FUA (`--fua-every`), also counted in `dirs[1]`.
    pub fua: DirStats,
    /// Longest measured time of any job, nanoseconds.
    pub runtime_ns: u64,
    /// The first failure, if any.
    pub failure: Option<Failure>,
    /// Completions per non-empty reap, all jobs.
    pub reaps: Histogram<u64>,
    /// Reactor loop counters, summed.
    pub loop_stats: LoopStats,
    /// System clock reads, summed.
    pub clock_reads: u64,
    /// Per-device statistics (the device, then the ones below it), summed over queues.
    pub devices: Vec<(String, DeviceStatsSnapshot)>,
    /// Failed members of each device in `devices` (non-empty: running degraded).
    pub failed: Vec<Vec<String>>,
    /// Per-queue completions (one queue per job): `queues[job][device]` = (reads, writes).
    pub queues: Vec<Vec<(u64, u64)>>,
    /// Process CPU time and context switches over the run.
    pub usage: Usage,
    /// Wall time of the whole run, ramp included.
    pub elapsed: Duration,
    /// Blocks read back and checked by `--verify`.
    pub verified_blocks: u64,
    /// Per device, I/O during the run that the jobs did not send: caches' write-back,
    /// rebuilds, superblocks (devices with none left out).
    pub background: Vec<(String, DeviceStatsSnapshot)>,
}

impl Report {
    /// Merges job results.
    pub fn new(
        spec: JobSpec,
        device: &Arc<dyn Device>,
        switches: Switches,
        results: Vec<JobResult>,
        usage: Usage,
        elapsed: Duration,
    ) -> Report {
        fn failed_tree(d: &Arc<dyn Device>, out: &mut Vec<Vec<String>>) {
            out.push(cairn_core::array::failed_members(d));
            for c in d.children() {
                failed_tree(&c, out);
            }
        }
        let mut failed = Vec::new();
        failed_tree(device, &mut failed);
        let queues = results
            .iter()
            .map(|r| {
                r.devices
                    .iter()
                    .map(|(_, d)| (d.ios[Op::Read.index()], d.ios[Op::Write.index()]))
                    .collect()
            })
            .collect();
        let mut results = results.into_iter();
        let first = results.next().expect("at least one job");
        let mut report = Report {
            spec,
            device_name: device.name().into(),
            device_desc: device.describe(),
            switches,
            dirs: first.dirs,
            fua: first.fua,
            runtime_ns: first.runtime_ns,
            failure: first.failure,
            reaps: first.reaps,
            loop_stats: first.loop_stats,
            clock_reads: first.clock_reads,
            devices: first.devices,
            failed,
            queues,
            usage,
            elapsed,
            verified_blocks: first.verified_blocks,
            background: Vec::new(),
        };
        for r in results {
            for (mine, theirs) in report.dirs.iter_mut().zip(&r.dirs) {
                mine.merge(theirs);
            }
            report.fua.merge(&r.fua);
            report.runtime_ns = report.runtime_ns.max(r.runtime_ns);
            if report.failure.is_none() {
                report.failure = r.failure;
            }
            let _ = report.reaps.add(&r.reaps);
            let l = &mut report.loop_stats;
            l.passes += r.loop_stats.passes;
            l.enters += r.loop_stats.enters;
            l.waits += r.loop_stats.waits;
            l.empty_reaps += r.loop_stats.empty_reaps;
            report.clock_reads += r.clock_reads;
            for ((_, mine), (_, theirs)) in report.devices.iter_mut().zip(&r.devices) {
                mine.merge(theirs);
            }
            report.verified_blocks += r.verified_blocks;
        }
        report
    }

    /// Exit status: 0, or 1 when an I/O or a verification failed.
    pub fn exit_code(&self) -> i32 {
        i32::from(self.failure.is_some())
    }

    fn runtime_s(&self) -> f64 {
        (self.runtime_ns as f64 / 1e9).max(1e-9)
    }

    /// Requests per second in direction `dir` (0 read, 1 write, 2 sync).
    pub fn iops(&self, dir: usize) -> f64 {
        self.dirs[dir].ios as f64 / self.runtime_s()
    }

    /// Total requests per second over reads and writes.
    pub fn total_iops(&self) -> f64 {
        self.iops(0) + self.iops(1)
    }

    fn cpu_percent(&self, ns: u64) -> f64 {
        let wall = self.elapsed.as_nanos() as f64 * f64::from(self.spec.numjobs);
        if wall == 0.0 {
            0.0
        } else {
            ns as f64 * 100.0 / wall
        }
    }

    fn mode_names(&self) -> (&'static str, &'static str, &'static str) {
        (
            match self.switches.clock {
                ClockMode::Cached => "cached",
                ClockMode::Precise => "precise",
            },
            match self.switches.reap {
                ReapMode::Eager => "eager",
                ReapMode::Lazy => "lazy",
            },
            match self.switches.stats {
                StatsMode::On => "on",
                StatsMode::Off => "off",
            },
        )
    }

    /// fio's normal text output.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        self.header_text(&mut out);
        for (dir, d) in self.dirs.iter().enumerate() {
            if d.ios > 0 {
                self.dir_text(&mut out, dir, d);
            }
        }
        self.reactor_text(&mut out);
        let _ = writeln!(out, "\nDisk stats (read/write):");
        for (i, (name, d)) in self.devices.iter().enumerate() {
            self.disk_text(&mut out, i, name, d);
        }
        self.background_text(&mut out);
        out
    }

    /// The text report's first lines: the job, the device, the switches, the failure.
    fn header_text(&self, out: &mut String) {
        let s = &self.spec;
        let (clock, reap, stats) = self.mode_names();
        let _ = writeln!(
            out,
            "cairn: (g=0): rw={}, bs=(R) {}B-{}B, (W) {}B-{}B, iodepth={}, numjobs={}",
            s.rw.name(),
            s.bs,
            s.bs,
            s.bs,
            s.bs,
            s.iodepth,
            s.numjobs
        );
        let _ = writeln!(
            out,
            "  device   : {} ({})",
            self.device_name, self.device_desc
        );
        let _ = writeln!(out, "  switches : clock={clock} reap={reap} stats={stats}");
        if let Some(f) = &self.failure {
            let _ = writeln!(out, "  error    : {f}");
        }
    }

    /// One direction's lines of the text report (and the FUA writes after the writes).
    fn dir_text(&self, out: &mut String, dir: usize, d: &DirStats) {
        let msec = self.runtime_ns / 1_000_000;
        let bw = d.bytes as f64 / self.runtime_s();
        if dir == 2 {
            let _ = writeln!(
                out,
                "  sync (flush): IOPS={}, total={}",
                format_count(self.iops(dir)),
                d.ios
            );
        } else {
            let _ = writeln!(
                out,
                "  {}: IOPS={}, BW={}/s ({:.1}MB/s)({}/{}msec)",
                DIR_NAMES[dir],
                format_count(self.iops(dir)),
                format_bytes(bw as u64),
                bw / 1e6,
                format_bytes(d.bytes),
                msec
            );
        }
        clat_text(out, d);
        if dir == 1 && self.fua.ios > 0 {
            let _ = writeln!(
                out,
                "  write with FUA (--fua-every {}): IOPS={}, total={}",
                self.spec.fua_every,
                format_count(self.fua.ios as f64 / self.runtime_s()),
                self.fua.ios
            );
            clat_text(out, &self.fua);
        }
    }

    /// The text report's CPU, reactor, reap and verify lines.
    fn reactor_text(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "  cpu          : usr={:.2}%, sys={:.2}%, ctx={}",
            self.cpu_percent(self.usage.utime_ns),
            self.cpu_percent(self.usage.stime_ns),
            self.usage.ctx
        );
        let ios = (self.dirs[0].ios + self.dirs[1].ios + self.dirs[2].ios).max(1);
        let _ = writeln!(
            out,
            "  reactor      : passes={}, io_uring_enter={}, waits={}, clock reads={} ({:.3} per I/O)",
            self.loop_stats.passes,
            self.loop_stats.enters,
            self.loop_stats.waits,
            self.clock_reads,
            self.clock_reads as f64 / ios as f64
        );
        if self.reaps.is_empty() {
            let _ = writeln!(
                out,
                "  reaps        : none (the device completes without a ring)"
            );
        } else {
            let _ = writeln!(
                out,
                "  reaps        : {} non-empty ({} empty), completions per reap:",
                self.reaps.len(),
                self.loop_stats.empty_reaps
            );
            let cells: Vec<String> = REAP_PERCENTILES
                .iter()
                .map(|&p| format!("{p}th=[{}]", self.reaps.value_at_quantile(p / 100.0)))
                .collect();
            let _ = writeln!(out, "     | {}", cells.join(", "));
        }
        if self.spec.verify {
            let _ = writeln!(
                out,
                "  verify       : {} blocks read back and checked",
                self.verified_blocks
            );
        }
    }

    /// Device `i`'s lines of the text report's disk stats, as fio's, with its latency
    /// per op.
    fn disk_text(&self, out: &mut String, i: usize, name: &str, d: &DeviceStatsSnapshot) {
        let runtime_ns = self.runtime_ns.max(1) as f64;
        if let Some(f) = self.failed.get(i).filter(|f| !f.is_empty()) {
            let _ = writeln!(out, "  {name}: DEGRADED, failed members: {}", f.join(", "));
            // (aligned by position: the device tree and the queue tree agree inline)
        }
        if !d.enabled {
            let _ = writeln!(out, "  {name}: statistics off (--stats off)");
            return;
        }
        let (r, w) = (Op::Read.index(), Op::Write.index());
        let in_queue_ms: u64 = d.ticks_ns.iter().sum::<u64>() / 1_000_000;
        let _ = writeln!(
            out,
            "  {name}: ios={}/{}, sectors={}/{}, ticks={}/{}, in_queue={}, util={:.2}%",
            d.ios[r],
            d.ios[w],
            d.sectors[r],
            d.sectors[w],
            d.ticks_ns[r] / 1_000_000,
            d.ticks_ns[w] / 1_000_000,
            in_queue_ms,
            (d.busy_ns as f64 * 100.0 / runtime_ns).min(100.0)
        );
        for op in Op::ALL {
            let h = &d.latency[op.index()];
            if h.is_empty() {
                continue;
            }
            let _ = writeln!(
                out,
                "    {} latency (nsec): mean={:.0}, 50th={}, 90th={}, 99th={}, 99.9th={}, max={}",
                op,
                h.mean(),
                h.quantile(0.5),
                h.quantile(0.9),
                h.quantile(0.99),
                h.quantile(0.999),
                h.max()
            );
        }
    }

    /// The text report's background I/O, if any.
    fn background_text(&self, out: &mut String) {
        if self.background.is_empty() {
            return;
        }
        let _ = writeln!(
            out,
            "\nBackground I/O (read/write; not the job's requests: caches' write-back, rebuilds, superblocks):"
        );
        let (r, w) = (Op::Read.index(), Op::Write.index());
        for (name, d) in &self.background {
            let _ = writeln!(
                out,
                "  {name}: ios={}/{}, sectors={}/{}",
                d.ios[r], d.ios[w], d.sectors[r], d.sectors[w]
            );
        }
    }

    /// [`Report::background`] for the JSON report.
    fn background_json(&self) -> Value {
        let (r, w) = (Op::Read.index(), Op::Write.index());
        Value::Array(
            self.background
                .iter()
                .map(|(name, d)| {
                    json!({
                        "name": name,
                        "read_ios": d.ios[r],
                        "write_ios": d.ios[w],
                        "read_bytes": d.sectors[r] * 512,
                        "write_bytes": d.sectors[w] * 512,
                    })
                })
                .collect(),
        )
    }

    fn dir_json(&self, dir: usize) -> Value {
        let d = &self.dirs[dir];
        let runtime_ms = self.runtime_ns / 1_000_000;
        let bw_bytes = (d.bytes as f64 / self.runtime_s()) as u64;
        let (clat, lat) = clat_json(d);
        if dir == 2 {
            return json!({ "total_ios": d.ios, "lat_ns": clat });
        }
        json!({
            "io_bytes": d.bytes,
            "io_kbytes": d.bytes / 1024,
            "bw_bytes": bw_bytes,
            "bw": bw_bytes / 1024,
            "iops": self.iops(dir),
            "runtime": runtime_ms,
            "total_ios": d.ios,
            "short_ios": 0,
            "drop_ios": 0,
            "slat_ns": { "min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0 },
            "clat_ns": clat,
            "lat_ns": lat,
        })
    }

    /// The FUA writes (`--fua-every`), under `cairn`: fio has no such split.
    fn fua_json(&self) -> Value {
        let (clat, _) = clat_json(&self.fua);
        json!({
            "every": self.spec.fua_every,
            "total_ios": self.fua.ios,
            "iops": self.fua.ios as f64 / self.runtime_s(),
            "clat_ns": clat,
        })
    }

    /// fio-compatible JSON (`--output-format=json --group_reporting`).
    pub fn to_json(&self) -> Value {
        let s = &self.spec;
        let runtime_ms = self.runtime_ns / 1_000_000;
        json!({
            "fio version": concat!("cairn-", env!("CARGO_PKG_VERSION")),
            "timestamp": std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            "global options": {
                "rw": s.rw.name(), "bs": s.bs.to_string(), "iodepth": s.iodepth.to_string(),
                "numjobs": s.numjobs.to_string(), "rwmixread": s.rwmixread.to_string(),
            },
            "jobs": [{
                "jobname": "cairn",
                "groupid": 0,
                "error": self.failure.as_ref().map_or(0, |f| match f {
                    Failure::Io { errno, .. } => *errno,
                    Failure::Verify { .. } => libc::EILSEQ,
                    Failure::Setup(_) => libc::EINVAL,
                }),
                "elapsed": self.elapsed.as_secs(),
                "job_runtime": runtime_ms,
                "read": self.dir_json(0),
                "write": self.dir_json(1),
                "trim": self.empty_dir_json(),
                "sync": self.dir_json(2),
                "usr_cpu": self.cpu_percent(self.usage.utime_ns),
                "sys_cpu": self.cpu_percent(self.usage.stime_ns),
                "ctx": self.usage.ctx,
                "majf": 0,
                "minf": 0,
            }],
            "disk_util": self.disk_util_json(),
            "cairn": self.cairn_json(),
        })
    }

    /// fio's `disk_util`: each device's counts, as fio gives a disk's.
    fn disk_util_json(&self) -> Vec<Value> {
        self.devices
            .iter()
            .map(|(name, d)| {
                let (r, w) = (Op::Read.index(), Op::Write.index());
                json!({
                    "name": name,
                    "read_ios": d.ios[r], "write_ios": d.ios[w],
                    "read_merges": 0, "write_merges": 0,
                    "read_ticks": d.ticks_ns[r] / 1_000_000,
                    "write_ticks": d.ticks_ns[w] / 1_000_000,
                    "in_queue": d.ticks_ns.iter().sum::<u64>() / 1_000_000,
                    "util": (d.busy_ns as f64 * 100.0 / self.runtime_ns.max(1) as f64).min(100.0),
                })
            })
            .collect()
    }

    /// What cairn adds under `cairn`: the device and switches, the reactor's counters,
    /// verification, FUA writes, every device's statistics and the background I/O.
    fn cairn_json(&self) -> Value {
        let (clock, reap, stats) = self.mode_names();
        let mut reap_pct = Map::new();
        for p in REAP_PERCENTILES {
            let v = if self.reaps.is_empty() {
                0
            } else {
                self.reaps.value_at_quantile(p / 100.0)
            };
            reap_pct.insert(format!("{p:.6}"), json!(v));
        }
        let devices: Vec<Value> = (self.devices.iter().enumerate())
            .map(|(index, (name, d))| self.device_json(index, name, d))
            .collect();
        json!({
            "device": { "name": self.device_name, "description": self.device_desc },
            "switches": { "clock": clock, "reap": reap, "stats": stats },
            "failure": self.failure.as_ref().map(|f| f.to_string()),
            "reaps": {
                "nonempty": self.reaps.len(),
                "empty": self.loop_stats.empty_reaps,
                "mean": if self.reaps.is_empty() { 0.0 } else { self.reaps.mean() },
                "percentile": reap_pct,
            },
            "reactor": {
                "passes": self.loop_stats.passes,
                "io_uring_enter": self.loop_stats.enters,
                "waits": self.loop_stats.waits,
                "clock_reads": self.clock_reads,
            },
            "verify": { "enabled": self.spec.verify, "blocks_checked": self.verified_blocks },
            "fua_writes": self.fua_json(),
            "devices": devices,
            "background_io": self.background_json(),
        })
    }

    /// Device `index`'s statistics under `cairn.devices`: per op, per queue, and its
    /// failed members.
    fn device_json(&self, index: usize, name: &str, d: &DeviceStatsSnapshot) -> Value {
        let queues: Vec<Value> = self
            .queues
            .iter()
            .enumerate()
            .filter_map(|(job, q)| {
                q.get(index)
                    .map(|(r, w)| json!({ "job": job, "read_ios": r, "write_ios": w }))
            })
            .collect();
        let mut ops = Map::new();
        for op in Op::ALL {
            let i = op.index();
            let h = &d.latency[i];
            let mut pct = Map::new();
            if !h.is_empty() {
                for p in CLAT_PERCENTILES {
                    pct.insert(format!("{p:.6}"), json!(h.quantile(p / 100.0)));
                }
            }
            ops.insert(
                op.name().into(),
                json!({
                    "ios": d.ios[i], "sectors": d.sectors[i], "ticks_ns": d.ticks_ns[i],
                    "lat_ns": { "mean": if h.is_empty() { 0.0 } else { h.mean() },
                                "max": h.max(), "percentile": pct },
                }),
            );
        }
        json!({
            "name": name, "stats": if d.enabled { "on" } else { "off" },
            "errors": d.errors, "in_flight": d.in_flight, "busy_ns": d.busy_ns, "ops": ops,
            "queues": queues,
            "failed_members": self.failed.get(index).cloned().unwrap_or_default(),
        })
    }

    fn empty_dir_json(&self) -> Value {
        json!({
            "io_bytes": 0, "io_kbytes": 0, "bw_bytes": 0, "bw": 0, "iops": 0.0, "runtime": 0,
            "total_ios": 0, "short_ios": 0, "drop_ios": 0,
            "clat_ns": { "min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0, "percentile": {} },
            "lat_ns": { "min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0 },
        })
    }
}

/// fio's `clat_ns` (with percentiles) and `lat_ns` objects for one direction.
fn clat_json(d: &DirStats) -> (Value, Value) {
    let mut pct = Map::new();
    if d.ios > 0 {
        for p in CLAT_PERCENTILES {
            pct.insert(
                format!("{p:.6}"),
                json!(d.clat.value_at_quantile(p / 100.0)),
            );
        }
    }
    let (min, max) = if d.ios > 0 {
        (d.clat.min(), d.clat.max())
    } else {
        (0, 0)
    };
    let clat = json!({
        "min": min, "max": max, "mean": d.mean_ns(), "stddev": d.stddev_ns(), "N": d.ios,
        "percentile": pct,
    });
    let lat = json!({
        "min": min, "max": max, "mean": d.mean_ns(), "stddev": d.stddev_ns(), "N": d.ios,
    });
    (clat, lat)
}

/// fio's `clat` lines for one direction.
fn clat_text(out: &mut String, d: &DirStats) {
    let _ = writeln!(
        out,
        "    clat (nsec): min={}, max={}, avg={:.2}, stdev={:.2}",
        d.clat.min(),
        d.clat.max(),
        d.mean_ns(),
        d.stddev_ns()
    );
    let _ = writeln!(out, "    clat percentiles (nsec):");
    let cells: Vec<String> = CLAT_PERCENTILES
        .iter()
        .map(|&p| format!("{p:6.2}th=[{:>8}]", d.clat.value_at_quantile(p / 100.0)))
        .collect();
    for row in cells.chunks(4) {
        let _ = writeln!(out, "     | {}", row.join(", "));
    }
}

/// Refreshes a one-line status on stderr every second until every job is done.
pub(crate) fn show_progress(spec: &JobSpec, progresses: &[Arc<Progress>], started: Instant) {
    let total = |f: fn(&Progress) -> u64| progresses.iter().map(|p| f(p)).sum::<u64>();
    let mut last = (0u64, 0u64, Instant::now());
    let mut stderr = std::io::stderr();
    loop {
        let all_done = progresses.iter().all(|p| p.done.load(Relaxed));
        if all_done {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
        let now = Instant::now();
        let dt = now.duration_since(last.2).as_secs_f64();
        if dt < 1.0 {
            continue;
        }
        let r = total(|p| p.reads.load(Relaxed));
        let w = total(|p| p.writes.load(Relaxed));
        let eta = spec.runtime.map(|rt| {
            (rt + spec.ramp_time)
                .saturating_sub(now.duration_since(started))
                .as_secs()
        });
        let _ = write!(
            stderr,
            "\r\x1b[K[r={},w={} IOPS]{}",
            format_count(r.saturating_sub(last.0) as f64 / dt),
            format_count(w.saturating_sub(last.1) as f64 / dt),
            eta.map_or(String::new(), |e| format!("[eta {e}s]"))
        );
        let _ = stderr.flush();
        last = (r, w, now);
    }
    let _ = write!(stderr, "\r\x1b[K");
    let _ = stderr.flush();
}
