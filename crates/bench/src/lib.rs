//! `cairn bench`: a fio-style load generator that runs on cairn's own reactors.
//!
//! A [`JobSpec`] holds fio's options with fio's meanings; [`JobSpec::plan`] checks them
//! against the device once, and [`run`] starts one reactor thread per job, each keeping
//! `iodepth` requests in flight on its own queue of the device. Results come back as a
//! [`Report`], printed the way fio prints (`normal`) or as fio-compatible JSON.
//!
//! Not here: the device graph (see `cairn-config`), the command line (see the `cairn`
//! binary).
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod chart;
mod job;
pub mod report;
pub mod verify;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_core::capability::writeback_totals;
use cairn_core::{Device, Op, Switches, Writeback};

pub use job::JobResult;
pub use report::Report;

/// fio's `--rw`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Random reads.
    RandRead,
    /// Random writes.
    RandWrite,
    /// Sequential mixed reads and writes (`rw`, `readwrite`).
    ReadWrite,
    /// Random mixed reads and writes.
    RandRw,
}

impl Pattern {
    /// Parses fio's names.
    pub fn parse(text: &str) -> Result<Pattern, String> {
        Ok(match text {
            "read" => Pattern::Read,
            "write" => Pattern::Write,
            "randread" => Pattern::RandRead,
            "randwrite" => Pattern::RandWrite,
            "rw" | "readwrite" => Pattern::ReadWrite,
            "randrw" => Pattern::RandRw,
            _ => {
                return Err(format!(
                    "invalid --rw '{text}' (use read, write, randread, randwrite, rw or randrw)"
                ))
            }
        })
    }

    /// fio's name.
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Read => "read",
            Pattern::Write => "write",
            Pattern::RandRead => "randread",
            Pattern::RandWrite => "randwrite",
            Pattern::ReadWrite => "rw",
            Pattern::RandRw => "randrw",
        }
    }

    /// Whether offsets are random.
    pub fn random(self) -> bool {
        matches!(
            self,
            Pattern::RandRead | Pattern::RandWrite | Pattern::RandRw
        )
    }

    /// Percentage of reads, given `--rwmixread`.
    pub fn read_percent(self, rwmixread: u32) -> u32 {
        match self {
            Pattern::Read | Pattern::RandRead => 100,
            Pattern::Write | Pattern::RandWrite => 0,
            Pattern::ReadWrite | Pattern::RandRw => rwmixread,
        }
    }
}

/// The job options, with fio's names and meanings.
#[derive(Debug, Clone, PartialEq)]
pub struct JobSpec {
    /// `--rw`.
    pub rw: Pattern,
    /// `--rwmixread`: percentage of reads in mixed patterns.
    pub rwmixread: u32,
    /// `--bs`: bytes per request.
    pub bs: u64,
    /// `--iodepth`: requests each job keeps in flight.
    pub iodepth: u32,
    /// `--numjobs`: jobs, one reactor thread each.
    pub numjobs: u32,
    /// `--runtime`: stop after this long (measured after the ramp).
    pub runtime: Option<Duration>,
    /// `--time_based`: keep going until `runtime` even when `io_size` is done.
    pub time_based: bool,
    /// `--ramp_time`: run this long before measuring.
    pub ramp_time: Duration,
    /// `--offset`: start of the region.
    pub offset: u64,
    /// `--size`: length of the region (default: to the device's end).
    pub size: Option<u64>,
    /// `--io_size`: bytes each job transfers (default: the region's size).
    pub io_size: Option<u64>,
    /// `--fsync N`: each slot flushes after every N of its own writes, and waits.
    pub fsync: u32,
    /// `--fua-every N` (cairn's own; fio's `writefua` is all or nothing): every Nth write
    /// of each job carries FUA; 0 for none.
    pub fua_every: u32,
    /// `--verify crc32c`.
    pub verify: bool,
    /// `--randseed`.
    pub randseed: u64,
    /// `--timeline SECS`: one line per interval on stderr (throughput, dirty bytes,
    /// write-back rate).
    pub timeline: Option<Duration>,
    /// `--timeline-csv FILE`: the same rows as CSV.
    pub timeline_csv: Option<std::path::PathBuf>,
    /// `--timeline-svg FILE`: the same rows as an SVG chart.
    pub timeline_svg: Option<std::path::PathBuf>,
    /// `--idle-poll TIME`: before a job's reactor sleeps, it keeps collecting completions
    /// this long (0: off).
    pub idle_poll: Duration,
}

impl Default for JobSpec {
    fn default() -> JobSpec {
        JobSpec {
            rw: Pattern::RandRead,
            rwmixread: 50,
            bs: 4096,
            iodepth: 32,
            numjobs: 1,
            runtime: None,
            time_based: false,
            ramp_time: Duration::ZERO,
            offset: 0,
            size: None,
            io_size: None,
            fsync: 0,
            fua_every: 0,
            verify: false,
            randseed: 0x2545_f491_4f6c_dd1d,
            timeline: None,
            timeline_csv: None,
            timeline_svg: None,
            idle_poll: Duration::ZERO,
        }
    }
}

/// Upper bound on iodepth (requests per job).
pub const IODEPTH_MAX: u32 = 4096;
/// Upper bound on numjobs.
pub const NUMJOBS_MAX: u32 = 256;
/// Upper bound on `--bs`.
pub const BS_MAX: u64 = 64 << 20;
/// Upper bound on each job's buffers (`iodepth` x `bs`), allocated up front.
pub const JOB_BUFFER_BYTES_MAX: u64 = 1 << 30;
/// Largest region `--verify` tracks (blocks per job).
pub const VERIFY_BLOCKS_MAX: u64 = 64 << 20;

/// A job's region and limits, checked against the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Per job: (first byte, length) of its region.
    pub regions: Vec<(u64, u64)>,
    /// Bytes each job transfers before stopping (unless time-based).
    pub io_size: u64,
}

impl JobSpec {
    /// Checks the options against a device geometry and works out each job's region.
    pub fn plan(&self, device: &dyn Device) -> Result<Plan, String> {
        let geo = device.geometry();
        let block = u64::from(geo.block_bytes);
        if self.iodepth == 0 || self.iodepth > IODEPTH_MAX {
            return Err(format!(
                "--iodepth must be from 1 to {IODEPTH_MAX}, not {}",
                self.iodepth
            ));
        }
        if self.numjobs == 0 || self.numjobs > NUMJOBS_MAX {
            return Err(format!(
                "--numjobs must be from 1 to {NUMJOBS_MAX}, not {}",
                self.numjobs
            ));
        }
        if self.rwmixread > 100 {
            return Err(format!(
                "--rwmixread must be from 0 to 100, not {}",
                self.rwmixread
            ));
        }
        if self.bs == 0 || !self.bs.is_multiple_of(block) || self.bs > BS_MAX {
            return Err(format!(
                "--bs {} must be a non-zero multiple of the device's {block}-byte block size, at most {BS_MAX}",
                self.bs
            ));
        }
        if u64::from(self.iodepth) * self.bs > JOB_BUFFER_BYTES_MAX {
            return Err(format!(
                "--iodepth {} x --bs {} needs more than the {} MiB of buffers a job may allocate",
                self.iodepth,
                self.bs,
                JOB_BUFFER_BYTES_MAX >> 20
            ));
        }
        if self.verify && self.bs < verify::HEADER_BYTES as u64 {
            return Err(format!(
                "--verify needs --bs of at least {} bytes",
                verify::HEADER_BYTES
            ));
        }
        if !self.offset.is_multiple_of(block) {
            return Err(format!(
                "--offset {} is not a multiple of the device's {block}-byte block size",
                self.offset
            ));
        }
        if self.offset >= geo.size_bytes {
            return Err(format!(
                "--offset {} is at or past the end of the device ({} bytes)",
                self.offset, geo.size_bytes
            ));
        }
        let size = self.size.unwrap_or(geo.size_bytes - self.offset);
        match self.offset.checked_add(size) {
            Some(end) if end <= geo.size_bytes => {}
            _ => {
                return Err(format!(
                    "--offset {} plus --size {size} reaches past the end of the device ({} bytes)",
                    self.offset, geo.size_bytes
                ))
            }
        }
        let mut regions = Vec::new();
        if self.verify && self.numjobs > 1 {
            // Verifying jobs must not overwrite each other's blocks: split the region.
            let share = size / u64::from(self.numjobs) / self.bs * self.bs;
            for j in 0..u64::from(self.numjobs) {
                regions.push((self.offset + j * share, share));
            }
        } else {
            let usable = size / self.bs * self.bs;
            regions.resize(self.numjobs as usize, (self.offset, usable));
        }
        let per_job = regions[0].1;
        if per_job < self.bs {
            return Err(format!(
                "the region ({size} bytes{}) is smaller than --bs {}",
                if self.verify && self.numjobs > 1 {
                    ", split between verifying jobs"
                } else {
                    ""
                },
                self.bs
            ));
        }
        let blocks = per_job / self.bs;
        if self.verify {
            if blocks > VERIFY_BLOCKS_MAX {
                return Err(format!(
                    "--verify tracks at most {VERIFY_BLOCKS_MAX} blocks per job; this region has {blocks} (lower --size or raise --bs)"
                ));
            }
            if blocks < 2 * u64::from(self.iodepth) {
                return Err(format!(
                    "--verify needs at least 2 x iodepth blocks per job so requests never overlap; this region has {blocks}"
                ));
            }
        }
        let io_size = self.io_size.unwrap_or(per_job);
        if io_size == 0 {
            return Err("--io_size must not be zero".into());
        }
        if let Some(runtime) = self.runtime {
            if runtime.is_zero() {
                return Err("--runtime must be more than zero".into());
            }
        }
        Ok(Plan { regions, io_size })
    }
}

/// Why a run failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// A request failed.
    Io {
        /// The operation.
        op: cairn_core::Op,
        /// Its offset.
        offset: u64,
        /// The errno.
        errno: i32,
    },
    /// A verified read found the wrong data.
    Verify {
        /// The block's offset.
        offset: u64,
        /// What was wrong.
        mismatch: verify::Mismatch,
    },
    /// The job could not start (e.g. its queue could not be opened).
    Setup(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Io { op, offset, errno } => write!(
                f,
                "{op} at offset {offset} failed: {}",
                std::io::Error::from_raw_os_error(*errno)
            ),
            Failure::Verify { offset, mismatch } => {
                write!(f, "verify failed at offset {offset}: {mismatch}")
            }
            Failure::Setup(m) => f.write_str(m),
        }
    }
}

/// Set (by SIGINT or SIGTERM, say) to end every running job early, as fio does on
/// Ctrl-C: requests in flight complete, and the report covers what ran.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Live counters a job publishes for the progress line.
#[derive(Debug, Default)]
pub struct Progress {
    /// Completed reads.
    pub reads: AtomicU64,
    /// Completed writes.
    pub writes: AtomicU64,
    /// Set when the job has finished.
    pub done: AtomicBool,
}

/// Prints (and with `--timeline-csv` writes) one row per interval until every job is
/// done: I/Os and bytes per second, the caches' dirty bytes, and their write-back rate
/// (as the original's vmstat columns did).
fn timeline(
    spec: &JobSpec,
    device: &Arc<dyn Device>,
    switches: Switches,
    progresses: &[Arc<Progress>],
    every: Duration,
) -> Result<(), String> {
    use std::io::Write;
    let mut csv = match &spec.timeline_csv {
        Some(path) => {
            let mut f = std::fs::File::create(path)
                .map_err(|e| format!("--timeline-csv {}: {e}", path.display()))?;
            writeln!(
                f,
                "seconds,iops,bytes_per_second,dirty_bytes,writeback_bytes_per_second"
            )
            .map_err(|e| format!("--timeline-csv {}: {e}", path.display()))?;
            Some(f)
        }
        None => None,
    };
    let ios = || -> u64 {
        progresses
            .iter()
            .map(|p| p.reads.load(Relaxed) + p.writes.load(Relaxed))
            .sum()
    };
    let mut rows = Vec::new();
    let start = Instant::now();
    let (mut last_t, mut last_ios, mut last_written) =
        (start, ios(), writeback_totals(device).written_bytes);
    eprintln!(
        "{:>8} {:>10} {:>10} {:>12} {:>14}",
        "seconds", "IOPS", "MB/s", "dirty MiB", "writeback MB/s"
    );
    while !progresses.iter().all(|p| p.done.load(Relaxed)) {
        std::thread::sleep(every.min(Duration::from_millis(50)));
        if last_t.elapsed() < every && !progresses.iter().all(|p| p.done.load(Relaxed)) {
            continue;
        }
        let now = Instant::now();
        let dt = now.duration_since(last_t).as_secs_f64().max(1e-9);
        let n = ios();
        let Writeback {
            dirty_bytes: dirty,
            written_bytes: written,
        } = writeback_totals(device);
        let iops = (n - last_ios) as f64 / dt;
        let bw = iops * spec.bs as f64;
        let wb = written.saturating_sub(last_written) as f64 / dt;
        let t = now.duration_since(start).as_secs_f64();
        eprintln!(
            "{t:>8.1} {iops:>10.0} {:>10.1} {:>12.1} {:>14.1}",
            bw / 1e6,
            dirty as f64 / (1 << 20) as f64,
            wb / 1e6
        );
        if let Some(f) = csv.as_mut() {
            writeln!(f, "{t:.3},{iops:.0},{bw:.0},{dirty},{wb:.0}")
                .map_err(|e| format!("--timeline-csv: {e}"))?;
        }
        rows.push(chart::Row {
            seconds: t,
            iops,
            bytes_per_second: bw,
            dirty_bytes: dirty,
            writeback_bytes_per_second: wb,
        });
        (last_t, last_ios, last_written) = (now, n, written);
    }
    if let Some(path) = &spec.timeline_svg {
        let mode = match switches.writeback {
            cairn_core::WritebackMode::PerDevice => "per-device",
            cairn_core::WritebackMode::Shared => "shared",
        };
        let title = format!(
            "cairn bench {}: {} {}, iodepth {}, --writeback {mode}",
            device.name(),
            spec.rw.name(),
            if spec.bs.is_multiple_of(1024) {
                format!("{}k", spec.bs / 1024)
            } else {
                format!("{}", spec.bs)
            },
            spec.iodepth,
        );
        chart::write_svg(path, &title, &rows)?;
    }
    Ok(())
}

/// Runs the job on `device` and collects the results.
///
/// With `progress`, a status line on stderr is refreshed every second.
pub fn run(
    spec: &JobSpec,
    device: Arc<dyn Device>,
    switches: Switches,
    progress: bool,
) -> Result<Report, String> {
    let plan = spec.plan(&*device)?;
    if let Some(path) = spec
        .timeline_svg
        .as_ref()
        .filter(|_| spec.timeline.is_some())
    {
        // Refused before the job starts rather than after it.
        std::fs::File::create(path)
            .map_err(|e| format!("--timeline-svg {}: {e}", path.display()))?;
    }
    let started = Instant::now();
    let usage_before = report::Usage::now();
    // Every device's I/O from every queue (the jobs', caches' write-back threads,
    // rebuilds, superblock writes), to tell the jobs' own requests from the rest.
    let names = tree_names(&*device);
    let all_before = registry_snapshots(&names);
    let progresses: Vec<Arc<Progress>> = (0..spec.numjobs)
        .map(|_| Arc::new(Progress::default()))
        .collect();
    let mut handles = Vec::new();
    for (index, region) in plan.regions.iter().enumerate() {
        let spec = spec.clone();
        let device = device.clone();
        let region = *region;
        let io_size = plan.io_size;
        let prog = progresses[index].clone();
        let handle = std::thread::Builder::new()
            .name(format!("cairn-job{index}"))
            .spawn(move || {
                let result = job::run_job(
                    &spec,
                    index as u32,
                    device,
                    switches,
                    region,
                    io_size,
                    &prog,
                );
                prog.done.store(true, Relaxed);
                result
            })
            .map_err(|e| format!("cannot start job thread: {e}"))?;
        handles.push(handle);
    }
    if let Some(every) = spec.timeline {
        timeline(spec, &device, switches, &progresses, every)?;
    } else if progress {
        report::show_progress(spec, &progresses, started);
    }
    let mut results = Vec::new();
    for h in handles {
        match h.join() {
            Ok(r) => results.push(r),
            Err(_) => return Err("a job thread panicked".into()),
        }
    }
    let usage = report::Usage::now().since(&usage_before);
    let all_after = registry_snapshots(&names);
    let mut report = Report::new(
        spec.clone(),
        &device,
        switches,
        results,
        usage,
        started.elapsed(),
    );
    report.background = background_io(&names, &all_before, &all_after, &report.devices);
    Ok(report)
}

/// The names of `device` and every device below it, each once, from the top.
fn tree_names(device: &dyn Device) -> Vec<String> {
    // (A stack file's graph is at most 64 levels deep: the recursion is bounded.)
    fn walk(d: &dyn Device, out: &mut Vec<String>) {
        if out.iter().any(|n| n == d.name()) {
            return;
        }
        out.push(d.name().to_string());
        for c in d.children() {
            walk(&*c, out);
        }
    }
    let mut out = Vec::new();
    walk(device, &mut out);
    out
}

/// Each named device's totals over every queue of this process (`None`: no queue yet).
fn registry_snapshots(names: &[String]) -> Vec<Option<cairn_core::DeviceStatsSnapshot>> {
    let now = cairn_core::clock::monotonic_ns();
    names
        .iter()
        .map(|n| cairn_core::stats::registry().device(n, now))
        .collect()
}

/// Per device, the I/O done during the run by others than the jobs' own queues: the
/// caches' write-back, rebuilds and resyncs, superblock and bitmap writes. Devices with
/// none are left out.
fn background_io(
    names: &[String],
    before: &[Option<cairn_core::DeviceStatsSnapshot>],
    after: &[Option<cairn_core::DeviceStatsSnapshot>],
    jobs: &[(String, cairn_core::DeviceStatsSnapshot)],
) -> Vec<(String, cairn_core::DeviceStatsSnapshot)> {
    let mut out = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let Some(total) = &after[i] else { continue };
        let mut other = match &before[i] {
            Some(b) => total.since(b),
            None => total.clone(),
        };
        // The jobs' own requests on this device (a name may appear more than once in
        // the job's tree: each is the same device).
        if let Some((_, own)) = jobs.iter().find(|(n, _)| n == name) {
            other = other.since(own);
        }
        let (r, w) = (Op::Read.index(), Op::Write.index());
        if other.ios[r] + other.ios[w] > 0 {
            out.push((name.clone(), other));
        }
    }
    out
}
