//! `file`: a regular file or block device, through one of three engines.
//!
//! - [`uring`]: SQEs on the reactor's own io_uring;
//! - [`aio`]: linux-aio, one context per queue, reaped from its user-space ring;
//! - [`sync`]: plain `pread`/`pwrite` on the reactor thread.
//!
//! Unless the stack names one, the engine is chosen at open by [`probe`]: what the file
//! system does without blocking decides which engine serves the file fastest.
//!
//! Every engine gives the same bytes: flush is `fdatasync`, FUA is `RWF_DSYNC`, discard
//! punches a hole (so the range reads as zeros), write-zeroes uses `fallocate` and falls
//! back to writing zeros where the file system cannot. A discard or write-zeroes with FUA
//! is followed by `fdatasync` before it completes (`fallocate` has no flag for it).

pub mod aio;
pub mod probe;
pub mod sync;
pub mod uring;

use std::cell::Cell;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Arc, OnceLock};

use cairn_core::{
    AlignedBuf, Caps, Core, Device, Error, FlushBatcher, Geometry, Io, IoFlags, IoStatus, Op,
    Queue, QueueStats, Sink, SinkId,
};

use cairn_core::ondisk::lock_exclusive;

use crate::spec::Engine;

/// Requests a file queue keeps in the kernel at once; more wait in the queue, in order.
pub const QUEUE_DEPTH: usize = 256;

/// Size of the shared zero buffer used when `fallocate` cannot zero a range.
const ZERO_CHUNK_BYTES: usize = 1 << 20;

/// The open file shared by every queue.
pub struct FileShared {
    file: File,
    path: PathBuf,
    zeros: OnceLock<AlignedBuf>,
    /// `fdatasync` calls made for discards and write-zeroes with FUA.
    fua_syncs: std::sync::atomic::AtomicU64,
}

/// The `flock` taken at open belongs to the open file, which the kernel keeps open
/// as long as anything refers to it: an io_uring ring (or a fixed-file slot) drops its
/// reference some time after the ring is closed. So the lock is given back by hand when
/// the file is closed, and the file is free for the next opener at once.
impl Drop for FileShared {
    fn drop(&mut self) {
        let _ = rustix::fs::flock(&self.file, rustix::fs::FlockOperation::Unlock);
    }
}

impl FileShared {
    /// The raw descriptor (kept open as long as this value lives).
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Completes a discard or write-zeroes that ended with `status`: with FUA, what it
    /// changed is made durable first (`fdatasync`: `fallocate` has no flag for it).
    pub(crate) fn fua_zeroed(&self, io: &Io, status: IoStatus) -> IoStatus {
        if !status.is_ok() || !io.flags.contains(IoFlags::FUA) {
            return status;
        }
        self.fua_syncs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Err(e) = rustix::fs::fdatasync(&self.file) {
            return IoStatus::errno(e.raw_os_error());
        }
        status
    }

    fn zeros(&self) -> &AlignedBuf {
        self.zeros.get_or_init(|| AlignedBuf::new(ZERO_CHUNK_BYTES))
    }
}

/// A regular file or block device.
pub struct FileDevice {
    name: String,
    plan: probe::Plan,
    probe: probe::Probe,
    direct: bool,
    block_device: bool,
    geometry: Geometry,
    shared: Arc<FileShared>,
}

impl FileDevice {
    /// Opens `path`; with `sized` (a size, and whether it may be sparse past the file
    /// system's free space), creates the file or extends it to that size.
    pub fn open(
        name: &str,
        path: &Path,
        engine: Engine,
        direct: bool,
        sized: Option<(u64, bool)>,
    ) -> Result<FileDevice, Error> {
        let shown = path.display();
        let block_device = check_path(path, sized.is_some())?;
        let mut flags = libc::O_CLOEXEC;
        if direct {
            flags |= libc::O_DIRECT;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(sized.is_some() && !block_device)
            .custom_flags(flags)
            .open(path)
            .map_err(|e| Error::os(format!("file {shown}: open"), e))?;
        // Before anything is changed: one user at a time (another cairn, another device
        // of the same stack file, or any program that takes the same lock).
        lock_exclusive(&file, path)?;
        let (actual, block_bytes) = if block_device {
            (
                block_device_bytes(&file, &shown)?,
                logical_block_bytes(&file, &shown)?,
            )
        } else {
            let len = file
                .metadata()
                .map_err(|e| Error::os(format!("file {shown}: stat"), e))?
                .len();
            (len, if direct { dio_align(&file) } else { 512 })
        };
        let size = serving_size(&file, path, sized, actual, block_device)?;
        let size = size - size % u64::from(block_bytes);
        if size == 0 {
            return Err(Error::Invalid(format!(
                "file {shown}: empty (add size=SIZE to extend it)"
            )));
        }
        let probe = probe::probe(&file, block_device, direct, block_bytes);
        let given = (engine != Engine::Auto).then_some(engine);
        let mut plan = probe::plan(&probe, given);
        if let Ok(exp) = std::env::var("CAIRN_EXP_SUBMIT") {
            experiment(&mut plan, &exp);
        }
        // Said once, when opened for real (not by a preflight's look).
        if !cairn_core::stats::unregistered_here() {
            log::info!("cairn: file {shown}: engine {}: {}", plan.label(), plan.why);
        }
        Ok(FileDevice {
            name: name.into(),
            plan,
            probe,
            direct,
            block_device,
            geometry: Geometry {
                size_bytes: size,
                block_bytes,
                caps: Caps::ALL,
            },
            shared: Arc::new(FileShared {
                file,
                path: path.into(),
                zeros: OnceLock::new(),
                fua_syncs: std::sync::atomic::AtomicU64::new(0),
            }),
        })
    }

    /// The engine in use (never [`Engine::Auto`]: that is resolved at open).
    pub fn engine(&self) -> Engine {
        self.plan.engine
    }

    /// The engine, how it submits, and why.
    pub fn plan(&self) -> &probe::Plan {
        &self.plan
    }

    /// What the file system did with non-blocking requests at open.
    pub fn probe(&self) -> &probe::Probe {
        &self.probe
    }

    /// How many discards and write-zeroes with FUA were made durable by an `fdatasync`
    /// of their own.
    pub fn fua_syncs(&self) -> u64 {
        self.shared
            .fua_syncs
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Overrides the plan with `CAIRN_EXP_SUBMIT` (comma-separated `r=BYTES` and `w=BYTES`:
/// reads and writes up to that size inline on io_uring, or `aio`, `sync`): for
/// bench/files.py's comparisons of submission modes only, and said in the log.
fn experiment(plan: &mut probe::Plan, exp: &str) {
    plan.engine = Engine::IoUring;
    plan.submit = uring::Submit::default();
    for kv in exp.split(',').filter(|s| !s.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        let n = v.parse().unwrap_or(0);
        match k {
            "r" => plan.submit.inline_reads = n,
            "w" => plan.submit.inline_writes = n,
            "aio" => plan.engine = Engine::Aio,
            "sync" => plan.engine = Engine::Sync,
            _ => {}
        }
    }
    plan.why = format!("CAIRN_EXP_SUBMIT={exp} (an experiment), over: {}", plan.why);
}

impl Device for FileDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn describe(&self) -> String {
        format!(
            "file {} ({}) engine={} direct={} {} bytes, {}-byte blocks; engine: {}",
            self.shared.path.display(),
            if self.block_device {
                "block device"
            } else {
                "regular file"
            },
            self.plan.label(),
            u8::from(self.direct),
            self.geometry.size_bytes,
            self.geometry.block_bytes,
            self.plan.why
        )
    }

    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        out: &mut Vec<cairn_core::Extent>,
    ) -> Result<(), Error> {
        use cairn_core::Extent;
        let end = offset + len;
        if self.block_device {
            Extent::push(out, Extent::data(len));
            return Ok(());
        }
        use rustix::fs::SeekFrom;
        use rustix::io::Errno;
        // The file position is not used for I/O (every engine reads and writes at
        // explicit offsets), so these seeks disturb nothing.
        let file = &self.shared.file;
        let mut at = offset;
        while at < end {
            let data = match rustix::fs::seek(file, SeekFrom::Data(at)) {
                Ok(data) => data,
                // No data after `at`: the rest is a hole.
                Err(Errno::NXIO) => {
                    Extent::push(out, Extent::hole(end - at));
                    return Ok(());
                }
                // The file system cannot tell: call it all data.
                Err(Errno::INVAL) | Err(Errno::OPNOTSUPP) => {
                    Extent::push(out, Extent::data(end - at));
                    return Ok(());
                }
                Err(e) => return Err(Error::os(format!("{}: SEEK_DATA", self.name), e.into())),
            };
            let data = data.min(end);
            Extent::push(out, Extent::hole(data - at));
            if data >= end {
                break;
            }
            let hole = rustix::fs::seek(file, SeekFrom::Hole(data)).map_or(end, |h| h.min(end));
            Extent::push(out, Extent::data(hole - data));
            at = hole;
        }
        Ok(())
    }

    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
        let inner = match self.plan.engine {
            Engine::IoUring | Engine::Auto => {
                uring::UringQueue::open(core, self.shared.clone(), self.plan.submit)?
            }
            Engine::Aio => aio::AioQueue::open(core, self.shared.clone())?,
            Engine::Sync => sync::SyncQueue::open(core, self.shared.clone()),
        };
        let queue = FlushBatchQueue::wrap(core, inner);
        cairn_core::stats::registry().add(self.name(), queue.stats());
        Ok(queue)
    }
}

/// Batches flushes in front of a file queue (technique 1 at the leaf): one `fdatasync`
/// covers every flush request that arrived before it started. Everything else passes
/// straight through to the engine's queue.
struct FlushBatchQueue {
    core: Rc<Core>,
    inner: Rc<dyn Queue>,
    batcher: FlushBatcher,
    sink: Cell<SinkId>,
}

impl FlushBatchQueue {
    fn wrap(core: &Rc<Core>, inner: Rc<dyn Queue>) -> Rc<dyn Queue> {
        let queue = Rc::new(FlushBatchQueue {
            core: core.clone(),
            inner,
            batcher: FlushBatcher::new(core.switches().flush),
            sink: Cell::new(SinkId(u32::MAX)),
        });
        queue.sink.set(core.register_sink(queue.clone()));
        queue
    }

    fn device_flush(&self) {
        self.inner
            .submit(Io::nodata(Op::Flush, 0, 0, self.sink.get(), 0));
    }
}

impl Queue for FlushBatchQueue {
    #[inline]
    fn submit(&self, io: Io) {
        if io.op != Op::Flush {
            self.inner.submit(io);
        } else if self.batcher.arrive(io, self.core.now_ns()) {
            self.device_flush();
        }
    }

    fn stats(&self) -> &QueueStats {
        self.inner.stats()
    }

    fn children(&self) -> Vec<Rc<dyn Queue>> {
        self.inner.children()
    }
}

impl Sink for FlushBatchQueue {
    fn io_done(&self, _token: u64, status: IoStatus) {
        let again = self
            .batcher
            .finish(|io, _| self.core.deliver(io.sink, io.token, status));
        if again {
            self.device_flush();
        }
    }
}

/// Whether `path` names a device node's place: under /dev, but not in its RAM file
/// systems (/dev/shm and the like), where image files are fine.
pub fn under_dev(path: &Path) -> bool {
    path.starts_with("/dev")
        && !["/dev/shm", "/dev/hugepages", "/dev/mqueue"]
            .iter()
            .any(|d| path.starts_with(d))
}

/// Whether `path` is a block device; refuses it if it is missing and not to be created
/// (`sized`), or neither a regular file nor a block device.
fn check_path(path: &Path, sized: bool) -> Result<bool, Error> {
    let shown = path.display();
    let existing = std::fs::metadata(path).ok();
    let block_device = existing
        .as_ref()
        .is_some_and(|m| m.file_type().is_block_device());
    // Under /dev a missing name is a disk that is not there, not an image to make (with
    // size= or without).
    if existing.is_none() && under_dev(path) {
        return Err(Error::Invalid(format!(
            "file {shown}: no such device (a block device under /dev is served as it is, and no file is made there; check its name with lsblk)"
        )));
    }
    if existing.is_none() && !sized {
        return Err(Error::Invalid(format!(
            "file {shown}: no such file (add size=SIZE to create it)"
        )));
    }
    if let Some(m) = &existing {
        if !block_device && !m.file_type().is_file() {
            return Err(Error::Invalid(format!(
                "file {shown}: not a regular file or block device"
            )));
        }
    }
    Ok(block_device)
}

/// The bytes served of `file` (`path`), which holds `actual`: all of them, or the size
/// `sized` asks for, the file extended to it if it is larger (a block device is not).
fn serving_size(
    file: &File,
    path: &Path,
    sized: Option<(u64, bool)>,
    actual: u64,
    block_device: bool,
) -> Result<u64, Error> {
    let shown = path.display();
    match sized {
        Some((want, sparse)) if want > actual => {
            if block_device {
                return Err(Error::Invalid(format!(
                    "file {shown}: size={want} is larger than the block device ({actual} bytes)"
                )));
            }
            room_for(path, want, actual, sparse)?;
            file.set_len(want)
                .map_err(|e| Error::os(format!("file {shown}: extend to {want} bytes"), e))?;
            Ok(want)
        }
        Some((want, _)) => {
            if want < actual && !block_device && !cairn_core::stats::unregistered_here() {
                log::warn!(
                    "cairn: file {shown}: holds {}, size={} serves its first {} only",
                    cairn_core::size::format_bytes(actual),
                    cairn_core::size::format_bytes(want),
                    cairn_core::size::format_bytes(want)
                );
            }
            Ok(want)
        }
        None => Ok(actual),
    }
}

/// A block device's size in bytes: where its end is (the kernel answers a seek to the
/// end of a block device with its size, as `BLKGETSIZE64` does). Every read and write
/// gives its offset, so the file position this moves is never used.
fn block_device_bytes(file: &File, path: &impl std::fmt::Display) -> Result<u64, Error> {
    use std::io::Seek;
    let mut f = file;
    f.seek(std::io::SeekFrom::End(0))
        .map_err(|e| Error::os(format!("file {path}: read block device size"), e))
}

/// A block device's logical block size (`BLKSSZGET`), 512 at least.
fn logical_block_bytes(file: &File, path: &impl std::fmt::Display) -> Result<u32, Error> {
    let value = rustix::fs::ioctl_blksszget(file)
        .map_err(|e| Error::os(format!("file {path}: read logical block size"), e.into()))?;
    // The kernel writes an int.
    Ok((value as i32).max(512) as u32)
}

/// The O_DIRECT offset alignment of a regular file (statx DIOALIGN), 4096 if unknown.
fn dio_align(file: &File) -> u32 {
    use rustix::fs::{AtFlags, StatxFlags};
    match rustix::fs::statx(file, "", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN) {
        Ok(stx)
            if stx.stx_mask & StatxFlags::DIOALIGN.bits() != 0 && stx.stx_dio_offset_align > 0 =>
        {
            stx.stx_dio_offset_align.clamp(512, 65536)
        }
        _ => 4096,
    }
}

/// Refuses to create or extend `path` from `now` to `want` bytes when the difference is
/// more than its file system has free (`statvfs`, what an unprivileged writer may use),
/// unless `sparse`: a sparse file larger than the space behind it fails writes with
/// ENOSPC once the space runs out.
pub fn room_for(path: &Path, want: u64, now: u64, sparse: bool) -> Result<(), Error> {
    if sparse || want <= now {
        return Ok(());
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let at = if path.exists() { path } else { dir };
    let Ok(fs) = rustix::fs::statvfs(at) else {
        return Ok(()); // the open that follows says what is wrong
    };
    let free = fs.f_bavail.saturating_mul(fs.f_frsize);
    if want - now > free {
        use cairn_core::size::format_bytes;
        return Err(Error::Invalid(format!(
            "file {}: size={} needs {} more than it holds, and its file system has {} free \
             (writes past that would fail); add sparse=1 (sparse = true in a stack file) to \
             make it a sparse file anyway",
            path.display(),
            format_bytes(want),
            format_bytes(want - now),
            format_bytes(free)
        )));
    }
    Ok(())
}

/// `fallocate` flags for a discard or write-zeroes request.
pub(crate) fn fallocate_mode(io: &Io) -> i32 {
    if io.op == Op::WriteZeroes && io.flags.contains(IoFlags::NO_HOLE) {
        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
    } else {
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
    }
}

/// Performs one request with blocking system calls. Used by the sync engine, and by the
/// others for what their kernel interface cannot do.
pub(crate) fn do_sync(shared: &FileShared, io: &Io) -> IoStatus {
    let fd = shared.fd();
    match io.op {
        Op::Read => rw_loop(io, |buf, len, off| {
            // SAFETY: buf is valid for len bytes (submitter's guarantee).
            unsafe { libc::pread(fd, buf.cast(), len, off as libc::off_t) }
        }),
        Op::Write => {
            let rwf = if io.flags.contains(IoFlags::FUA) {
                libc::RWF_DSYNC
            } else {
                0
            };
            rw_loop(io, |buf, len, off| {
                let iov = libc::iovec {
                    iov_base: buf.cast(),
                    iov_len: len,
                };
                // SAFETY: iov describes len valid bytes.
                unsafe { libc::pwritev2(fd, &iov, 1, off as libc::off_t, rwf) }
            })
        }
        Op::Flush => match rustix::fs::fdatasync(&shared.file) {
            Ok(()) => IoStatus::OK,
            Err(e) => IoStatus::errno(e.raw_os_error()),
        },
        Op::Discard | Op::WriteZeroes => {
            let mode = rustix::fs::FallocateFlags::from_bits_retain(fallocate_mode(io) as u32);
            let status = match rustix::fs::fallocate(&shared.file, mode, io.offset, io.len) {
                Ok(()) => IoStatus::OK,
                Err(rustix::io::Errno::OPNOTSUPP) | Err(rustix::io::Errno::INVAL) => {
                    write_zeros(shared, io.offset, io.len)
                }
                Err(e) => IoStatus::errno(e.raw_os_error()),
            };
            shared.fua_zeroed(io, status)
        }
    }
}

/// Writes zeros over a range, for file systems and devices without hole punching.
pub(crate) fn write_zeros(shared: &FileShared, offset: u64, len: u64) -> IoStatus {
    let zeros = shared.zeros();
    let mut done = 0;
    while done < len {
        let n = (len - done).min(zeros.len() as u64) as usize;
        match rustix::io::pwrite(&shared.file, &zeros.as_slice()[..n], offset + done) {
            Ok(0) => return IoStatus::errno(libc::EIO),
            Ok(written) => done += written as u64,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return IoStatus::errno(e.raw_os_error()),
        }
    }
    IoStatus::OK
}

fn rw_loop(io: &Io, mut call: impl FnMut(*mut u8, usize, u64) -> isize) -> IoStatus {
    let mut done = 0u64;
    while done < io.len {
        // SAFETY: done < len, so the pointer stays inside the buffer.
        let buf = unsafe { io.buf.add(done as usize) };
        let rc = call(buf, (io.len - done) as usize, io.offset + done);
        if rc < 0 {
            let errno = last_errno();
            if errno == libc::EINTR {
                continue;
            }
            return IoStatus::errno(errno);
        }
        if rc == 0 {
            // The file ends before the device does (it was truncated under us).
            return IoStatus::errno(libc::EIO);
        }
        done += rc as u64;
    }
    IoStatus::OK
}

pub(crate) fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Per-request bookkeeping shared by the asynchronous engines: a fixed table of slots and
/// a FIFO of requests waiting for one.
pub(crate) struct Slots {
    pub(crate) entries: Vec<Slot>,
    free: Vec<u32>,
    pub(crate) waiting: std::collections::VecDeque<(Io, u64)>,
}

/// The next step for a request after a kernel result.
pub(crate) enum Step {
    /// Submit again for what is left: (request, bytes already done).
    Resume(Io, u64),
    /// Complete with this status.
    Finish(IoStatus),
}

#[derive(Clone, Copy)]
pub(crate) struct Slot {
    pub(crate) io: Io,
    pub(crate) done_bytes: u64,
    pub(crate) start_ns: u64,
}

impl Slots {
    pub(crate) fn new(depth: usize) -> Slots {
        let idle = Io::nodata(Op::Flush, 0, 0, cairn_core::SinkId(u32::MAX), 0);
        Slots {
            entries: vec![
                Slot {
                    io: idle,
                    done_bytes: 0,
                    start_ns: 0
                };
                depth
            ],
            free: (0..depth as u32).rev().collect(),
            waiting: std::collections::VecDeque::new(),
        }
    }

    /// Takes a slot for `io`, or parks `io` in the waiting FIFO and returns `None`.
    pub(crate) fn take(&mut self, io: Io, start_ns: u64) -> Option<u32> {
        match self.free.pop() {
            Some(i) => {
                self.entries[i as usize] = Slot {
                    io,
                    done_bytes: 0,
                    start_ns,
                };
                Some(i)
            }
            None => {
                self.waiting.push_back((io, start_ns));
                None
            }
        }
    }

    /// What the kernel's result `res` (bytes, or -errno) means for the request in `slot`.
    pub(crate) fn progress(&mut self, slot: u32, res: i64) -> Step {
        let s = &mut self.entries[slot as usize];
        if res < 0 {
            let errno = (-res) as i32;
            return if errno == libc::EAGAIN || errno == libc::EINTR {
                Step::Resume(s.io, s.done_bytes)
            } else {
                Step::Finish(IoStatus::errno(errno))
            };
        }
        if !s.io.op.has_data() {
            return Step::Finish(IoStatus::OK);
        }
        if res == 0 {
            // Unexpected end of file: the file was truncated under the device.
            return Step::Finish(IoStatus::errno(libc::EIO));
        }
        s.done_bytes += res as u64;
        if s.done_bytes < s.io.len {
            Step::Resume(s.io, s.done_bytes)
        } else {
            Step::Finish(IoStatus::OK)
        }
    }

    /// Completes the request in `slot` (statistics, then the completion) and gives the
    /// slot to the next waiting request, which is returned for the engine to start.
    pub(crate) fn finish(
        &mut self,
        slot: u32,
        status: IoStatus,
        stats: &QueueStats,
        core: &Core,
    ) -> Option<(u32, Io)> {
        let s = self.entries[slot as usize];
        stats.done(
            s.io.flags,
            s.io.op,
            s.io.len,
            s.start_ns,
            core.now_ns(),
            status.is_ok(),
        );
        core.complete(s.io.sink, s.io.token, status);
        self.free.push(slot);
        let (io, start) = self.waiting.pop_front()?;
        self.take(io, start).map(|i| (i, io))
    }

    pub(crate) fn in_use(&self) -> usize {
        self.entries.len() - self.free.len()
    }
}
