//! A FUSE export: the mount, the `FUSE_INIT` handshake, the state every reactor's part
//! shares, and the orderly end (flush, unmount, final flush).

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cairn_core::{Core, Device, Error, Frontend, FrontendPart, Geometry};
use zerocopy::IntoBytes;

use crate::abi;
use crate::mount::{Mount, Owner, Unmounted};
use crate::part::Part;

/// Largest read or write the kernel sends (`max_write`, and `max_pages` of 4 KiB).
pub const MAX_WRITE: u32 = 1 << 20;
/// Bytes before the data area of a `/dev/fuse` slot (room for the request's headers, so
/// that a write's data lands on an aligned address).
pub(crate) const HEAD: usize = 4096;
/// Room after the data for a read or read-modify-write widened to whole blocks.
pub(crate) const SLACK: usize = 8192;
/// Two blocks of scratch for read-modify-write.
pub(crate) const SCRATCH: usize = 8192;
/// The largest device block a FUSE export serves (read-modify-write reads whole blocks
/// into the scratch area).
pub const MAX_BLOCK: u32 = 4096;

/// How requests reach cairn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// FUSE over io_uring when the kernel offers it (`enable_uring` of the fuse module),
    /// else `/dev/fuse` reads.
    #[default]
    Auto,
    /// Always `/dev/fuse` reads (the "before").
    DevFuse,
}

/// What to export where.
#[derive(Clone)]
pub struct FuseConfig {
    /// The file the export appears as (created if missing).
    pub path: PathBuf,
    /// The export's name, for logs and the mount's source.
    pub name: String,
    /// The device served.
    pub device: Arc<dyn Device>,
    /// Mounted read-only, writes refused.
    pub read_only: bool,
    /// FUSE over io_uring or `/dev/fuse`.
    pub transport: Transport,
    /// Requests in flight per reactor (`/dev/fuse`) or per io_uring queue.
    pub depth: u32,
}

/// Shutdown phases (in [`Shared::phase`]).
/// Reactors an export can be served on.
const MAX_PARTS: usize = 256;

pub(crate) const SERVING: u8 = 0;
pub(crate) const FLUSHING: u8 = 1;
pub(crate) const ENDING: u8 = 2;

/// Attributes that `chmod`, `chown` and `touch` change (kept in memory).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Attr {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub atime: (u64, u32),
    pub mtime: (u64, u32),
    pub ctime: (u64, u32),
}

/// Writes in flight per reactor, and the gate a read-modify-write closes: a write of
/// partial blocks reads the blocks around it and writes them back whole, so while it runs
/// no other write may touch the device (on any reactor), and it starts only once the
/// writes in flight have ended. Aligned writes pay one uncontended atomic add each.
pub(crate) struct Gate {
    pub closed: AtomicBool,
    pub writes: Box<[Padded]>,
}

/// A counter on its own cache line.
#[repr(align(64))]
#[derive(Default)]
pub(crate) struct Padded(pub AtomicU32);

/// What one reactor's part answered. One writer (that reactor) adds with a relaxed load
/// and store, no locked instruction; `cairn admin status` reads them from its thread.
#[repr(align(64))]
#[derive(Default)]
pub(crate) struct Counts {
    pub requests: AtomicU64,
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    pub writes: AtomicU64,
    pub written_bytes: AtomicU64,
    pub flushes: AtomicU64,
    pub errors: AtomicU64,
}

/// Adds `n` to a counter that only the calling thread writes.
pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed) + n, Ordering::Relaxed);
}

/// What a FUSE export answered since it was mounted, summed over reactors.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FuseFigures {
    /// Requests answered (every kind, errors included).
    pub requests: u64,
    /// Reads answered with data, and their bytes.
    pub reads: u64,
    /// Bytes those reads returned.
    pub read_bytes: u64,
    /// Writes acknowledged.
    pub writes: u64,
    /// Bytes those writes took.
    pub written_bytes: u64,
    /// fsync requests (each a device flush).
    pub flushes: u64,
    /// Requests answered with an error.
    pub errors: u64,
}

impl Gate {
    /// An aligned write wants to start on reactor `me`: false while a read-modify-write
    /// holds the gate (the write waits).
    pub fn enter(&self, me: usize) -> bool {
        self.writes[me].0.fetch_add(1, Ordering::SeqCst);
        if self.closed.load(Ordering::SeqCst) {
            self.writes[me].0.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// An aligned write on reactor `me` has ended.
    pub fn leave(&self, me: usize) {
        self.writes[me].0.fetch_sub(1, Ordering::Release);
    }

    /// A read-modify-write wants the device to itself: true once the gate is its own.
    pub fn close(&self) -> bool {
        self.closed
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Whether every write that entered before the gate closed has ended.
    pub fn drained(&self) -> bool {
        self.writes.iter().all(|w| w.0.load(Ordering::SeqCst) == 0)
    }

    /// The read-modify-write has ended.
    pub fn open(&self) {
        self.closed.store(false, Ordering::SeqCst);
    }
}

/// What every reactor's part of one export shares.
pub(crate) struct Shared {
    pub path: PathBuf,
    pub name: String,
    pub device: Arc<dyn Device>,
    pub geo: Geometry,
    pub read_only: bool,
    pub depth: u32,
    /// The session's descriptor (the parts read from clones of it).
    pub session: OwnedFd,
    /// io_uring queues (one per possible CPU), or 0 for `/dev/fuse` only.
    pub uring_queues: u32,
    pub attr: Mutex<Attr>,
    pub gate: Gate,
    /// Per reactor, indexed like the gate's counters.
    pub counts: Box<[Counts]>,
    pub phase: AtomicU8,
    /// Parts that finished the flush asked for by [`Frontend::stop`], and the parts' wake
    /// descriptors.
    pub flushed: Mutex<usize>,
    pub flushed_cv: Condvar,
    pub wakes: Mutex<Vec<Arc<OwnedFd>>>,
}

impl Shared {
    pub fn phase(&self) -> u8 {
        self.phase.load(Ordering::Acquire)
    }
}

/// A device mounted as a file, served on the reactors it is started on.
pub struct FuseExport {
    shared: Arc<Shared>,
    mount: Mutex<Mount>,
}

/// The time of day, as FUSE attributes carry it (seconds, nanoseconds).
pub(crate) fn now() -> (u64, u32) {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs(), d.subsec_nanos())
}

/// Number of possible CPUs: the kernel makes one FUSE io_uring queue for each.
fn possible_cpus() -> u32 {
    let parse = |s: &str| -> Option<u32> {
        let mut n = 0;
        for part in s.trim().split(',') {
            let (a, b) = match part.split_once('-') {
                Some((a, b)) => (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?),
                None => {
                    let a = part.parse::<u32>().ok()?;
                    (a, a)
                }
            };
            n = n.max(b + 1).max(a + 1);
        }
        Some(n)
    };
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| parse(&s))
        // Without sysfs (not seen on Linux), the CPUs this process may run on: equal to
        // the possible ones on a machine without CPU hot-plug or an affinity mask.
        .unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, |n| n.get().try_into().unwrap_or(1))
        })
}

/// Waits up to `timeout` for `fd` to be readable.
fn wait_readable(fd: &OwnedFd, timeout: Duration) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut p = [PollFd::new(fd, PollFlags::IN)];
    let end = Instant::now() + timeout;
    loop {
        // Whole milliseconds, as poll(2) takes them.
        let left = end.saturating_duration_since(Instant::now()).as_millis() as i32;
        let left = Timespec {
            tv_sec: i64::from(left / 1000),
            tv_nsec: i64::from(left % 1000) * 1_000_000,
        };
        match rustix::event::poll(&mut p, Some(&left)) {
            Ok(n) if n > 0 => return true,
            Err(rustix::io::Errno::INTR) => {}
            _ => return false,
        }
    }
}

/// Whether the fuse module lets connections use io_uring.
pub fn uring_enabled() -> bool {
    std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
        .is_ok_and(|s| s.trim() == "Y" || s.trim() == "1")
}

impl FuseExport {
    /// Mounts `config.device` at `config.path` and answers the kernel's `FUSE_INIT`.
    pub fn mount(config: FuseConfig) -> Result<FuseExport, Error> {
        let geo = config.device.geometry();
        let shown = config.path.display().to_string();
        if geo.block_bytes > MAX_BLOCK || !geo.block_bytes.is_power_of_two() {
            return Err(Error::Invalid(format!(
                "fuse {shown}: device blocks of {} bytes; a FUSE export serves blocks of up to {MAX_BLOCK}",
                geo.block_bytes
            )));
        }
        if !(1..=1024).contains(&config.depth) {
            return Err(Error::Invalid(format!(
                "fuse {shown}: depth {} (1 to 1024)",
                config.depth
            )));
        }
        let source = if config.name.is_empty() {
            "cairn".to_string()
        } else {
            format!("cairn:{}", config.name)
        };
        let mount = Mount::new(&config.path, &source, config.read_only)?;
        let uring = config.transport == Transport::Auto && uring_enabled();
        let agreed =
            init(&mount.fd, uring).map_err(|e| Error::Invalid(format!("fuse {shown}: {e}")))?;
        let uring_queues = if agreed { possible_cpus() } else { 0 };
        let Owner { mode, uid, gid } = mount.owner;
        let t = now();
        let shared = Arc::new(Shared {
            path: mount.path.clone(),
            name: config.name,
            device: config.device,
            geo,
            read_only: config.read_only,
            depth: config.depth,
            session: mount
                .fd
                .try_clone()
                .map_err(|e| Error::os("fuse: dup the session", e))?,
            uring_queues,
            attr: Mutex::new(Attr {
                mode,
                uid,
                gid,
                atime: t,
                mtime: t,
                ctime: t,
            }),
            gate: Gate {
                closed: AtomicBool::new(false),
                writes: (0..MAX_PARTS).map(|_| Padded::default()).collect(),
            },
            counts: (0..MAX_PARTS).map(|_| Counts::default()).collect(),
            phase: AtomicU8::new(SERVING),
            flushed: Mutex::new(0),
            flushed_cv: Condvar::new(),
            wakes: Mutex::new(Vec::new()),
        });
        Ok(FuseExport {
            shared,
            mount: Mutex::new(mount),
        })
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Whether requests come over io_uring (else through `/dev/fuse` reads).
    pub fn uses_io_uring(&self) -> bool {
        self.shared.uring_queues > 0
    }

    /// The name of the export it serves (empty: the default export).
    pub fn export_name(&self) -> &str {
        &self.shared.name
    }

    /// What it answered since it was mounted, summed over reactors.
    pub fn figures(&self) -> FuseFigures {
        let mut f = FuseFigures::default();
        for c in self.shared.counts.iter() {
            let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
            f.requests += get(&c.requests);
            f.reads += get(&c.reads);
            f.read_bytes += get(&c.read_bytes);
            f.writes += get(&c.writes);
            f.written_bytes += get(&c.written_bytes);
            f.flushes += get(&c.flushes);
            f.errors += get(&c.errors);
        }
        f
    }
}

/// Answers `FUSE_INIT` (read on this thread, right after the mount). Returns whether
/// FUSE over io_uring was agreed on.
fn init(fd: &OwnedFd, uring: bool) -> Result<bool, String> {
    if !wait_readable(fd, Duration::from_secs(10)) {
        return Err("the kernel sent no FUSE_INIT within 10 s".into());
    }
    let mut buf = vec![0u8; 80 + MAX_WRITE as usize + 4096];
    let n = rustix::io::read(fd, &mut buf[..])
        .map_err(|e| format!("read FUSE_INIT: {}", std::io::Error::from(e)))?;
    let got = &buf[..n];
    let h: abi::fuse_in_header = abi::read(got).ok_or("a short FUSE_INIT")?;
    if h.opcode != abi::fuse_opcode::FUSE_INIT as u32 {
        return Err(format!("expected FUSE_INIT, got opcode {}", h.opcode));
    }
    let body = &got[std::mem::size_of::<abi::fuse_in_header>()..];
    let mut i = abi::fuse_init_in::default();
    // Older kernels send only the first 16 bytes (no flags2).
    let have = body.len().min(std::mem::size_of::<abi::fuse_init_in>());
    i.as_mut_bytes()[..have].copy_from_slice(&body[..have]);
    let reply = |error: i32, out: &[u8]| -> Result<(), String> {
        let head = abi::fuse_out_header {
            len: (16 + out.len()) as u32,
            error,
            unique: h.unique,
        };
        let mut msg = head.as_bytes().to_vec();
        msg.extend_from_slice(out);
        rustix::io::write(fd, &msg)
            .map(drop)
            .map_err(|e| format!("answer FUSE_INIT: {}", std::io::Error::from(e)))
    };
    if i.major != 7 || i.minor < abi::MIN_MINOR {
        let _ = reply(-libc::EPROTO, &[]);
        return Err(format!(
            "the kernel speaks FUSE {}.{}; cairn needs 7.{} or later",
            i.major,
            i.minor,
            abi::MIN_MINOR
        ));
    }
    let offered = u64::from(i.flags) | (u64::from(i.flags2) << 32);
    let mut want = u64::from(
        abi::FUSE_ASYNC_READ
            | abi::FUSE_BIG_WRITES
            | abi::FUSE_ASYNC_DIO
            | abi::FUSE_MAX_PAGES
            | abi::FUSE_NO_OPENDIR_SUPPORT
            | abi::FUSE_INIT_EXT,
    ) | abi::FUSE_DIRECT_IO_ALLOW_MMAP;
    if uring {
        want |= abi::OVER_IO_URING;
    }
    let agreed = offered & want;
    let out = abi::fuse_init_out {
        major: 7,
        minor: i.minor.min(abi::MINOR),
        max_readahead: i.max_readahead,
        flags: agreed as u32,
        flags2: (agreed >> 32) as u32,
        max_background: 256,
        congestion_threshold: 192,
        max_write: MAX_WRITE,
        time_gran: 1,
        max_pages: (MAX_WRITE / 4096) as u16,
        ..Default::default()
    };
    reply(0, out.as_bytes())?;
    Ok(agreed & abi::OVER_IO_URING != 0)
}

impl Frontend for FuseExport {
    fn describe(&self) -> String {
        format!(
            "fuse {} (export '{}', {}{})",
            self.shared.path.display(),
            self.shared.name,
            if self.uses_io_uring() {
                format!("io_uring, {} queues", self.shared.uring_queues)
            } else {
                "/dev/fuse".to_string()
            },
            if self.shared.read_only {
                ", read-only"
            } else {
                ""
            }
        )
    }

    fn start(
        &self,
        core: &Rc<Core>,
        index: usize,
        count: usize,
    ) -> Result<Rc<dyn FrontendPart>, Error> {
        let part = Part::start(core, self.shared.clone(), index, count)?;
        Ok(part)
    }

    fn stop(&self) {
        let shared = &self.shared;
        let parts = shared
            .wakes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        shared.phase.store(FLUSHING, Ordering::Release);
        for w in &parts {
            cairn_core::event::wake(w);
        }
        // Every part flushes what it acknowledged; then the file goes away.
        let mut done = shared.flushed.lock().unwrap_or_else(|p| p.into_inner());
        while *done < parts.len() {
            done = shared
                .flushed_cv
                .wait(done)
                .unwrap_or_else(|p| p.into_inner());
        }
        drop(done);
        let shown = shared.path.display();
        match self
            .mount
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .unmount()
        {
            Ok(Unmounted::Clean) => log::info!("cairn: fuse {shown}: flushed and unmounted"),
            Ok(Unmounted::Detached) => log::warn!(
                "cairn: fuse {shown}: still in use (a loop device or an open file): flushed and detached; its users get errors from now on"
            ),
            Err(e) => log::warn!("cairn: {e}"),
        }
        shared.phase.store(ENDING, Ordering::Release);
        for w in &parts {
            cairn_core::event::wake(w);
        }
    }
}
