//! One reactor's part of a FUSE export: requests read from its clone of the session (and
//! fetched through its io_uring queues), turned into device requests on its queue, and
//! answered.
//!
//! Every request lives in a slot whose buffer holds its data: a write's data arrives at an
//! aligned address of the slot and goes to the device from there, a read's data comes from
//! the device into the slot and goes back to the kernel from there, so no byte is copied in
//! user space. Requests that do not cover whole device blocks are widened (reads) or done
//! as read-modify-write under the export's [`Gate`](crate::export::Gate).

use std::cell::{Cell, RefCell};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::Arc;

use cairn_core::device::Queue;
use cairn_core::{
    AlignedBuf, Core, Error, FrontendPart, Io, IoFlags, IoStatus, Op, Poller, RingUser, Sink,
    SinkId,
};
use io_uring::{opcode, types};
use rustix::io::Errno;
use zerocopy::IntoBytes;

use crate::abi::{self, fuse_opcode as fo};
use crate::export::{bump, Counts, Shared, ENDING, FLUSHING, HEAD, MAX_WRITE, SCRATCH, SLACK};
use crate::uring::{self, Ring};

const IN_HEADER: usize = std::mem::size_of::<abi::fuse_in_header>();
const OUT_HEADER: usize = std::mem::size_of::<abi::fuse_out_header>();
/// A write request's headers: `fuse_in_header` and `fuse_write_in`.
const WRITE_HEADERS: usize = IN_HEADER + std::mem::size_of::<abi::fuse_write_in>();
/// Data area of a slot: the largest request, widened to whole blocks.
const DATA: usize = MAX_WRITE as usize + SLACK;

/// How long a write waits before it looks at the gate again.
const GATE_RETRY_NS: u64 = 50_000;

// Tokens of device requests: slot << 4 | what.
const MAIN: u64 = 0;
const HEAD_BLOCK: u64 = 1;
const TAIL_BLOCK: u64 = 2;
/// Tokens that are not a slot's.
const GATE_TIMER: u64 = u64::MAX;
const PHASE_FLUSH: u64 = u64::MAX - 1;
const FINAL_FLUSH: u64 = u64::MAX - 2;
// Ring cookies on the reactor's own ring.
const POLL: u64 = 1;
const CANCEL: u64 = 2;

/// Where a slot's request came from, and where its answer goes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Via {
    /// Read from the part's `/dev/fuse` clone; answered by a write to it.
    Dev,
    /// Entry `i` of the part's io_uring queues; answered by its next commit.
    Ring(usize),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum StepKind {
    /// A device request covering whole blocks.
    Whole(Op, IoFlags),
    /// A write of partial blocks: the slot's data (at the front of its data area), or
    /// zeroes.
    Partial { zero: bool },
}

#[derive(Clone, Copy, Debug)]
struct Step {
    kind: StepKind,
    off: u64,
    len: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stage {
    /// No request.
    Free,
    /// A device request is in flight, or the answer is on its way.
    Busy,
    /// A whole-block write waits for a read-modify-write to end.
    WaitGate,
    /// A read-modify-write waits for the gate.
    WaitClose,
    /// A read-modify-write holds the gate and waits for the writes before it.
    WaitDrain,
    /// A read-modify-write reads its edge blocks (this many left).
    Edges(u8),
    /// A read-modify-write writes its blocks.
    Merged,
}

struct Slot {
    buf: AlignedBuf,
    /// Offset of the data area in `buf`.
    data: usize,
    via: Via,
    unique: u64,
    opcode: u32,
    /// Bytes of data the reply carries (reads, writes), or the write's count.
    n: usize,
    /// Where in the data area a read's answer starts.
    at: usize,
    steps: [Step; 3],
    nsteps: u8,
    step: u8,
    stage: Stage,
    /// An edge read of a read-modify-write failed.
    failed: bool,
}

const NO_STEP: Step = Step {
    kind: StepKind::Whole(Op::Flush, IoFlags::NONE),
    off: 0,
    len: 0,
};

impl Slot {
    fn new(buf: AlignedBuf, data: usize, via: Via) -> Slot {
        Slot {
            buf,
            data,
            via,
            unique: 0,
            opcode: 0,
            n: 0,
            at: 0,
            steps: [NO_STEP; 3],
            nsteps: 0,
            step: 0,
            stage: Stage::Free,
            failed: false,
        }
    }

    fn data_ptr(&mut self) -> *mut u8 {
        // SAFETY: `data` is within the buffer (see the layouts in `Part::dev_slot` and
        // `Part::ring_slot`).
        unsafe { self.buf.as_mut_ptr().add(self.data) }
    }

    fn data_mut(&mut self) -> &mut [u8] {
        let d = self.data;
        &mut self.buf.as_mut_slice()[d..d + DATA + SCRATCH]
    }
}

/// A reactor's part of one FUSE export.
pub(crate) struct Part {
    core: Rc<Core>,
    shared: Arc<Shared>,
    me: usize,
    user: Cell<u16>,
    sink: Cell<SinkId>,
    queue: Rc<dyn Queue>,
    dev: OwnedFd,
    wake: Arc<OwnedFd>,
    slots: RefCell<Vec<Slot>>,
    free: RefCell<Vec<u32>>,
    /// `/dev/fuse` slots made so far (up to the export's depth).
    dev_slots: Cell<u32>,
    polled: Cell<bool>,
    stalled: Cell<bool>,
    pumping: Cell<bool>,
    waiting: RefCell<Vec<u32>>,
    timer: Cell<bool>,
    /// Device requests in flight.
    in_flight: Cell<u32>,
    /// Requests taken and not yet answered.
    busy: Cell<u32>,
    phase: Cell<u8>,
    gone: Cell<bool>,
    final_flush: Cell<u8>,
    ended: Cell<bool>,
    counted: Cell<bool>,
    ring: Option<Ring>,
    reaped: RefCell<Vec<(usize, i32)>>,
}

fn errno(status: IoStatus) -> i32 {
    -status.raw().clamp(1, 511)
}

impl Part {
    /// Starts the part on `core` (on the reactor's thread).
    pub fn start(
        core: &Rc<Core>,
        shared: Arc<Shared>,
        me: usize,
        count: usize,
    ) -> Result<Rc<Part>, Error> {
        let shown = shared.path.display().to_string();
        if me >= shared.gate.writes.len() {
            return Err(Error::Invalid(format!(
                "fuse {shown}: at most {} reactors",
                shared.gate.writes.len()
            )));
        }
        let dev = crate::mount::clone_session(&shared.session)?;
        let queue = shared.device.open_queue(core)?;
        let wake = cairn_core::event::eventfd("fuse")?;
        let mut slots = Vec::new();
        let ring = if shared.uring_queues > 0 {
            let mut entries = Vec::new();
            for qid in (0..shared.uring_queues as usize).filter(|q| q % count == me) {
                for _ in 0..shared.depth {
                    let mut buf = AlignedBuf::new(DATA + SCRATCH);
                    let header = Box::new(std::cell::UnsafeCell::new(
                        // SAFETY: all-zero bytes are a valid header.
                        unsafe { std::mem::zeroed::<abi::UringReqHeader>() },
                    ));
                    let iov = Box::new([
                        libc::iovec {
                            iov_base: header.get().cast(),
                            iov_len: std::mem::size_of::<abi::UringReqHeader>(),
                        },
                        libc::iovec {
                            iov_base: buf.as_mut_ptr().cast(),
                            iov_len: DATA,
                        },
                    ]);
                    slots.push(Slot::new(buf, 0, Via::Ring(entries.len())));
                    entries.push(uring::Entry {
                        header,
                        iov,
                        qid: qid as u16,
                    });
                }
            }
            Some(Ring::new(entries, wake.as_raw_fd())?)
        } else {
            None
        };
        let part = Rc::new(Part {
            core: core.clone(),
            shared: shared.clone(),
            me,
            user: Cell::new(0),
            sink: Cell::new(SinkId(u32::MAX)),
            queue,
            dev,
            wake: wake.clone(),
            slots: RefCell::new(slots),
            free: RefCell::new(Vec::new()),
            dev_slots: Cell::new(0),
            polled: Cell::new(false),
            stalled: Cell::new(false),
            pumping: Cell::new(false),
            waiting: RefCell::new(Vec::new()),
            timer: Cell::new(false),
            in_flight: Cell::new(0),
            busy: Cell::new(0),
            phase: Cell::new(shared.phase()),
            gone: Cell::new(false),
            final_flush: Cell::new(0),
            ended: Cell::new(false),
            counted: Cell::new(false),
            ring,
            reaped: RefCell::new(Vec::new()),
        });
        part.user.set(core.register_ring_user(part.clone())?);
        part.sink.set(core.register_sink(part.clone()));
        core.register_poller(part.clone());
        if let Some(ring) = &part.ring {
            for i in 0..ring.entries.len() {
                ring.register(part.dev.as_raw_fd(), i);
            }
            ring.unplug();
        }
        shared
            .wakes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(wake);
        part.arm_poll();
        Ok(part)
    }

    fn fd(&self) -> RawFd {
        self.dev.as_raw_fd()
    }

    fn arm_poll(&self) {
        if self.polled.get() || self.gone.get() || self.phase.get() == ENDING {
            return;
        }
        self.polled.set(true);
        let entry = opcode::PollAdd::new(types::Fd(self.fd()), libc::POLLIN as u32).build();
        // SAFETY: the descriptor is the part's own and lives as long as the part, which
        // the reactor keeps registered until the ring is dropped.
        unsafe { self.core.push_sqe(self.user.get(), POLL, entry) };
    }

    /// A `/dev/fuse` slot: headroom for the headers so that a write's data lands on an
    /// aligned address, the data area, then scratch for read-modify-write.
    fn dev_slot(&self) -> Option<u32> {
        if let Some(s) = self.free.borrow_mut().pop() {
            return Some(s);
        }
        if self.dev_slots.get() >= self.shared.depth {
            return None;
        }
        self.dev_slots.set(self.dev_slots.get() + 1);
        let mut slots = self.slots.borrow_mut();
        slots.push(Slot::new(
            AlignedBuf::new(HEAD + DATA + SCRATCH),
            HEAD,
            Via::Dev,
        ));
        Some(slots.len() as u32 - 1)
    }

    /// Reads requests from `/dev/fuse` while there are any and a slot is free.
    fn pump(&self) {
        if self.pumping.replace(true) {
            return;
        }
        loop {
            if self.gone.get() || self.phase.get() == ENDING {
                break;
            }
            let Some(s) = self.dev_slot() else {
                self.stalled.set(true);
                break;
            };
            let n = {
                let mut slots = self.slots.borrow_mut();
                let slot = &mut slots[s as usize];
                // From HEAD - WRITE_HEADERS: `WRITE_HEADERS + DATA` bytes before the
                // scratch area.
                let room = &mut slot.buf.as_mut_slice()[HEAD - WRITE_HEADERS..HEAD + DATA];
                rustix::io::read(&self.dev, room)
            };
            let n = match n {
                Ok(n) => n,
                Err(e) => {
                    self.free.borrow_mut().push(s);
                    match e {
                        Errno::INTR | Errno::NOENT => continue,
                        Errno::AGAIN => self.arm_poll(),
                        Errno::NODEV => self.connection_gone(),
                        e => {
                            log::warn!(
                                "cairn: fuse {}: read /dev/fuse: {}",
                                self.shared.path.display(),
                                std::io::Error::from(e)
                            );
                            self.connection_gone();
                        }
                    }
                    break;
                }
            };
            self.take(s, n);
        }
        self.pumping.set(false);
    }

    fn connection_gone(&self) {
        if !self.gone.replace(true) {
            self.maybe_end();
        }
    }

    /// A request arrived in slot `s` (`n` bytes, for `/dev/fuse`).
    fn take(&self, s: u32, n: usize) {
        self.busy.set(self.busy.get() + 1);
        let parsed = {
            let mut slots = self.slots.borrow_mut();
            let slot = &mut slots[s as usize];
            slot.stage = Stage::Busy;
            let (h, op, payload) = match slot.via {
                Via::Dev => {
                    let b = &slot.buf.as_slice()[HEAD - WRITE_HEADERS..HEAD - WRITE_HEADERS + n];
                    let h: Option<abi::fuse_in_header> = abi::read(b);
                    let op = b.get(IN_HEADER..).unwrap_or(&[]);
                    let mut op_bytes = [0u8; 128];
                    let k = op.len().min(128);
                    op_bytes[..k].copy_from_slice(&op[..k]);
                    (h, op_bytes, n.saturating_sub(WRITE_HEADERS))
                }
                Via::Ring(i) => {
                    let ring = self.ring.as_ref().expect("ring slots only with a ring");
                    // SAFETY: the kernel has finished writing the header (its command
                    // completed) and does not touch it until the next commit.
                    let hdr = unsafe { &*ring.entries[i].header.get() };
                    let h: Option<abi::fuse_in_header> = abi::read(&hdr.in_out);
                    (h, hdr.op_in, hdr.ent.payload_sz as usize)
                }
            };
            h.map(|h| (h, op, payload))
        };
        let Some((h, op, payload)) = parsed else {
            // Too short to answer: drop it (the kernel never sends one).
            self.release(s);
            return;
        };
        {
            let mut slots = self.slots.borrow_mut();
            let slot = &mut slots[s as usize];
            slot.unique = h.unique;
            slot.opcode = h.opcode;
        }
        self.dispatch(s, &h, &op, payload);
    }

    fn dispatch(&self, s: u32, h: &abi::fuse_in_header, op: &[u8; 128], payload: usize) {
        let size = self.shared.geo.size_bytes;
        let code = h.opcode;
        if code == fo::FUSE_GETATTR as u32 {
            self.reply_attr(s);
        } else if code == fo::FUSE_SETATTR as u32 {
            let a: abi::fuse_setattr_in = abi::read(op).unwrap_or_default();
            self.setattr(s, &a);
        } else if code == fo::FUSE_OPEN as u32 {
            let o: abi::fuse_open_in = abi::read(op).unwrap_or_default();
            if self.shared.read_only && (o.flags as i32 & libc::O_ACCMODE) != libc::O_RDONLY {
                self.reply_err(s, -libc::EROFS);
            } else {
                let out = abi::fuse_open_out {
                    fh: 0,
                    open_flags: abi::FOPEN_DIRECT_IO | abi::FOPEN_PARALLEL_DIRECT_WRITES,
                    ..Default::default()
                };
                self.reply(s, out.as_bytes());
            }
        } else if code == fo::FUSE_READ as u32 {
            let r: abi::fuse_read_in = abi::read(op).unwrap_or_default();
            self.read(
                s,
                r.offset,
                u64::from(r.size).min(u64::from(MAX_WRITE)),
                size,
            );
        } else if code == fo::FUSE_WRITE as u32 {
            let w: abi::fuse_write_in = abi::read(op).unwrap_or_default();
            self.write(s, w.offset, w.size as usize, payload, size);
        } else if code == fo::FUSE_FSYNC as u32 {
            self.submit(
                s,
                Io::nodata(Op::Flush, 0, 0, self.sink.get(), token(s, MAIN)),
            );
        } else if code == fo::FUSE_FALLOCATE as u32 {
            let f: abi::fuse_fallocate_in = abi::read(op).unwrap_or_default();
            self.fallocate(s, &f, size);
        } else if code == fo::FUSE_LSEEK as u32 {
            let l: abi::fuse_lseek_in = abi::read(op).unwrap_or_default();
            self.lseek(s, &l, size);
        } else if code == fo::FUSE_STATFS as u32 {
            let bsize = 4096u32;
            let out = abi::fuse_statfs_out {
                st: abi::fuse_kstatfs {
                    blocks: size / u64::from(bsize),
                    files: 1,
                    bsize,
                    frsize: bsize,
                    namelen: 255,
                    ..Default::default()
                },
            };
            self.reply(s, out.as_bytes());
        } else if code == fo::FUSE_FLUSH as u32
            || code == fo::FUSE_RELEASE as u32
            || code == fo::FUSE_ACCESS as u32
            || code == fo::FUSE_DESTROY as u32
        {
            self.reply(s, &[]);
        } else if code == fo::FUSE_FORGET as u32
            || code == fo::FUSE_BATCH_FORGET as u32
            || code == fo::FUSE_INTERRUPT as u32
        {
            // No answer: the root is never forgotten, and an interrupted request still
            // ends (device requests are not cancelled).
            self.release(s);
        } else {
            self.reply_err(s, -libc::ENOSYS);
        }
    }

    fn attr(&self) -> abi::fuse_attr_out {
        let a = *self.shared.attr.lock().unwrap_or_else(|p| p.into_inner());
        let size = self.shared.geo.size_bytes;
        abi::fuse_attr_out {
            attr_valid: 1,
            attr: abi::fuse_attr {
                ino: abi::FUSE_ROOT_ID,
                size,
                blocks: size.div_ceil(512),
                atime: a.atime.0,
                mtime: a.mtime.0,
                ctime: a.ctime.0,
                atimensec: a.atime.1,
                mtimensec: a.mtime.1,
                ctimensec: a.ctime.1,
                mode: libc::S_IFREG | (a.mode & 0o7777),
                nlink: 1,
                uid: a.uid,
                gid: a.gid,
                blksize: self.shared.geo.block_bytes.max(4096),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn reply_attr(&self, s: u32) {
        let out = self.attr();
        self.reply(s, out.as_bytes());
    }

    fn setattr(&self, s: u32, a: &abi::fuse_setattr_in) {
        if a.valid & abi::FATTR_SIZE != 0 && a.size != self.shared.geo.size_bytes {
            // A device does not change size: `dd` needs conv=notrunc, as with a disk.
            self.reply_err(s, -libc::EPERM);
            return;
        }
        let now = crate::export::now();
        {
            let mut attr = self.shared.attr.lock().unwrap_or_else(|p| p.into_inner());
            if a.valid & abi::FATTR_MODE != 0 {
                attr.mode = a.mode & 0o7777;
            }
            if a.valid & abi::FATTR_UID != 0 {
                attr.uid = a.uid;
            }
            if a.valid & abi::FATTR_GID != 0 {
                attr.gid = a.gid;
            }
            if a.valid & abi::FATTR_ATIME_NOW != 0 {
                attr.atime = now;
            } else if a.valid & abi::FATTR_ATIME != 0 {
                attr.atime = (a.atime, a.atimensec);
            }
            if a.valid & abi::FATTR_MTIME_NOW != 0 {
                attr.mtime = now;
            } else if a.valid & abi::FATTR_MTIME != 0 {
                attr.mtime = (a.mtime, a.mtimensec);
            }
            attr.ctime = now;
        }
        self.reply_attr(s);
    }

    fn read(&self, s: u32, off: u64, len: u64, size: u64) {
        if off >= size || len == 0 {
            self.reply_data(s, 0, 0);
            return;
        }
        let n = len.min(size - off);
        let (aoff, aend) = self.widen(off, n);
        let io = {
            let mut slots = self.slots.borrow_mut();
            let slot = &mut slots[s as usize];
            slot.n = n as usize;
            slot.at = (off - aoff) as usize;
            self.io(
                s,
                Op::Read,
                IoFlags::NONE,
                aoff,
                aend - aoff,
                slot.data_ptr(),
            )
        };
        self.submit(s, io);
    }

    fn write(&self, s: u32, off: u64, n: usize, payload: usize, size: u64) {
        if self.shared.read_only {
            self.reply_err(s, -libc::EROFS);
            return;
        }
        if payload != n || n > MAX_WRITE as usize {
            self.reply_err(s, -libc::EIO);
            return;
        }
        if n == 0 {
            self.reply_write(s, 0);
            return;
        }
        if off >= size {
            self.reply_err(s, -libc::ENOSPC);
            return;
        }
        // What fits is written; the caller sees a short write, then ENOSPC, as on a disk.
        let n = (n as u64).min(size - off);
        let b = u64::from(self.shared.geo.block_bytes);
        let kind = if off.is_multiple_of(b) && n.is_multiple_of(b) {
            StepKind::Whole(Op::Write, IoFlags::NONE)
        } else {
            StepKind::Partial { zero: false }
        };
        self.plan(s, n as usize, &[Step { kind, off, len: n }]);
    }

    fn fallocate(&self, s: u32, f: &abi::fuse_fallocate_in, size: u64) {
        if self.shared.read_only {
            self.reply_err(s, -libc::EROFS);
            return;
        }
        let keep = f.mode & abi::FALLOC_KEEP_SIZE != 0;
        let mode = f.mode & !abi::FALLOC_KEEP_SIZE;
        let end = f.offset.saturating_add(f.length);
        if end > size && !keep {
            // The file would grow: a device does not.
            self.reply_err(s, -libc::EOPNOTSUPP);
            return;
        }
        let (off, end) = (f.offset.min(size), end.min(size));
        let caps = self.shared.geo.caps;
        let whole = match mode {
            // Plain allocation: every block of a device is there already.
            0 => {
                self.reply(s, &[]);
                return;
            }
            abi::FALLOC_PUNCH_HOLE if keep && caps.discard => {
                StepKind::Whole(Op::Discard, IoFlags::NONE)
            }
            abi::FALLOC_PUNCH_HOLE if keep && caps.write_zeroes => {
                StepKind::Whole(Op::WriteZeroes, IoFlags::NONE)
            }
            abi::FALLOC_ZERO_RANGE if caps.write_zeroes => {
                StepKind::Whole(Op::WriteZeroes, IoFlags::NO_HOLE)
            }
            _ => {
                self.reply_err(s, -libc::EOPNOTSUPP);
                return;
            }
        };
        if off >= end {
            self.reply(s, &[]);
            return;
        }
        let b = u64::from(self.shared.geo.block_bytes);
        let (ra, rb) = (off.div_ceil(b) * b, end - end % b);
        let mut steps = Vec::with_capacity(3);
        if ra >= rb {
            // Within one or two partial blocks.
            steps.push(Step {
                kind: StepKind::Partial { zero: true },
                off,
                len: end - off,
            });
        } else {
            if off < ra {
                steps.push(Step {
                    kind: StepKind::Partial { zero: true },
                    off,
                    len: ra - off,
                });
            }
            steps.push(Step {
                kind: whole,
                off: ra,
                len: rb - ra,
            });
            if rb < end {
                steps.push(Step {
                    kind: StepKind::Partial { zero: true },
                    off: rb,
                    len: end - rb,
                });
            }
        }
        self.plan(s, 0, &steps);
    }

    fn lseek(&self, s: u32, l: &abi::fuse_lseek_in, size: u64) {
        const SEEK_DATA: u32 = 3;
        const SEEK_HOLE: u32 = 4;
        if l.whence != SEEK_DATA && l.whence != SEEK_HOLE {
            self.reply_err(s, -libc::EINVAL);
            return;
        }
        if l.offset >= size {
            self.reply_err(s, -libc::ENXIO);
            return;
        }
        let want_data = l.whence == SEEK_DATA;
        let mut pos = l.offset;
        let mut extents = Vec::new();
        // Look in windows of 1 GiB, so that a huge sparse device is not mapped at once.
        while pos < size {
            let len = (size - pos).min(1 << 30);
            extents.clear();
            if self.shared.device.extents(pos, len, &mut extents).is_err() || extents.is_empty() {
                extents.clear();
                extents.push(cairn_core::Extent::data(len));
            }
            for e in &extents {
                let is_data = !e.zero || !e.hole;
                if is_data == want_data {
                    let out = abi::fuse_lseek_out { offset: pos };
                    self.reply(s, out.as_bytes());
                    return;
                }
                pos += e.len;
            }
        }
        if want_data {
            self.reply_err(s, -libc::ENXIO);
        } else {
            // The end of the file is a hole.
            let out = abi::fuse_lseek_out { offset: size };
            self.reply(s, out.as_bytes());
        }
    }

    /// Runs `steps` one after the other, then answers (`n`: the count a write reports).
    fn plan(&self, s: u32, n: usize, steps: &[Step]) {
        {
            let mut slots = self.slots.borrow_mut();
            let slot = &mut slots[s as usize];
            slot.n = n;
            slot.nsteps = steps.len() as u8;
            slot.step = 0;
            slot.steps[..steps.len()].copy_from_slice(steps);
        }
        self.advance(s);
    }

    /// Starts (or retries) the current step of slot `s`.
    fn advance(&self, s: u32) {
        let (step, stage) = {
            let slots = self.slots.borrow();
            let slot = &slots[s as usize];
            if slot.step >= slot.nsteps {
                drop(slots);
                self.finish_plan(s);
                return;
            }
            (slot.steps[slot.step as usize], slot.stage)
        };
        let gate = &self.shared.gate;
        match step.kind {
            StepKind::Whole(op, flags) => {
                if !gate.enter(self.me) {
                    self.wait(s, Stage::WaitGate);
                    return;
                }
                let io = {
                    let mut slots = self.slots.borrow_mut();
                    let slot = &mut slots[s as usize];
                    slot.stage = Stage::Busy;
                    let buf = if op == Op::Write {
                        slot.data_ptr()
                    } else {
                        std::ptr::null_mut()
                    };
                    self.io(s, op, flags, step.off, step.len, buf)
                };
                self.submit(s, io);
            }
            StepKind::Partial { zero } => {
                if stage != Stage::WaitDrain && !gate.close() {
                    self.wait(s, Stage::WaitClose);
                    return;
                }
                if !gate.drained() {
                    self.wait(s, Stage::WaitDrain);
                    return;
                }
                self.edges(s, step, zero);
            }
        }
    }

    fn wait(&self, s: u32, stage: Stage) {
        self.slots.borrow_mut()[s as usize].stage = stage;
        self.waiting.borrow_mut().push(s);
        if !self.timer.replace(true) {
            self.core.add_timer(
                self.core.now_ns() + GATE_RETRY_NS,
                self.sink.get(),
                GATE_TIMER,
            );
        }
    }

    /// A read-modify-write holds the gate: lays the new bytes out where they go in their
    /// blocks and reads the edge blocks around them.
    fn edges(&self, s: u32, step: Step, zero: bool) {
        let b = u64::from(self.shared.geo.block_bytes);
        let (aoff, aend) = self.widen(step.off, step.len);
        let end = step.off + step.len;
        let head = (step.off - aoff) as usize;
        let mut reads = Vec::with_capacity(2);
        {
            let mut slots = self.slots.borrow_mut();
            let slot = &mut slots[s as usize];
            let len = step.len as usize;
            let data = slot.data_mut();
            if zero {
                data[head..head + len].fill(0);
            } else {
                data.copy_within(0..len, head);
            }
            let scratch = slot.data + DATA;
            // SAFETY: the scratch area (two blocks of at most 4 KiB) follows the data area.
            let mut at = |k: usize| unsafe { slot.buf.as_mut_ptr().add(scratch + k * 4096) };
            if head != 0 {
                reads.push((aoff, at(0), HEAD_BLOCK));
            }
            if !end.is_multiple_of(b) && (aend - b != aoff || head == 0) {
                reads.push((aend - b, at(1), TAIL_BLOCK));
            }
            slot.stage = Stage::Edges(reads.len() as u8);
        }
        if reads.is_empty() {
            self.merged(s);
            return;
        }
        for (off, buf, what) in reads {
            self.in_flight.set(self.in_flight.get() + 1);
            self.queue.submit(Io {
                op: Op::Read,
                flags: IoFlags::NONE,
                offset: off,
                len: b,
                buf,
                sink: self.sink.get(),
                token: token(s, what),
            });
        }
    }

    /// The edge blocks are in: completes the blocks and writes them.
    fn merged(&self, s: u32) {
        let b = u64::from(self.shared.geo.block_bytes);
        let io = {
            let mut slots = self.slots.borrow_mut();
            let slot = &mut slots[s as usize];
            let step = slot.steps[slot.step as usize];
            let (aoff, aend) = self.widen(step.off, step.len);
            let end = step.off + step.len;
            let head = (step.off - aoff) as usize;
            let total = (aend - aoff) as usize;
            let bb = b as usize;
            let data = slot.data_mut();
            if head != 0 {
                data.copy_within(DATA..DATA + head, 0);
            }
            if !end.is_multiple_of(b) {
                // The tail block is the head block when both edges are in one block.
                let src = if aend - b == aoff && head != 0 {
                    DATA
                } else {
                    DATA + 4096
                };
                let t = (end - (aend - b)) as usize;
                data.copy_within(src + t..src + bb, total - bb + t);
            }
            slot.stage = Stage::Merged;
            self.io(
                s,
                Op::Write,
                IoFlags::NONE,
                aoff,
                aend - aoff,
                slot.data_ptr(),
            )
        };
        self.in_flight.set(self.in_flight.get() + 1);
        self.queue.submit(io);
    }

    fn finish_plan(&self, s: u32) {
        let (opcode, n) = {
            let slots = self.slots.borrow();
            (slots[s as usize].opcode, slots[s as usize].n)
        };
        if opcode == fo::FUSE_WRITE as u32 {
            self.reply_write(s, n);
        } else {
            self.reply(s, &[]);
        }
    }

    /// A device request of slot `s` (its main request: the reply follows its completion).
    fn io(&self, s: u32, op: Op, flags: IoFlags, offset: u64, len: u64, buf: *mut u8) -> Io {
        Io {
            op,
            flags,
            offset,
            len,
            buf,
            sink: self.sink.get(),
            token: token(s, MAIN),
        }
    }

    /// `[off, off + len)` widened to whole device blocks.
    fn widen(&self, off: u64, len: u64) -> (u64, u64) {
        let b = u64::from(self.shared.geo.block_bytes);
        (off - off % b, (off + len).div_ceil(b) * b)
    }

    fn submit(&self, s: u32, io: Io) {
        self.slots.borrow_mut()[s as usize].stage = Stage::Busy;
        self.in_flight.set(self.in_flight.get() + 1);
        self.queue.submit(io);
    }

    fn reply_write(&self, s: u32, n: usize) {
        bump(&self.counts().written_bytes, n as u64);
        let out = abi::fuse_write_out {
            size: n as u32,
            padding: 0,
        };
        self.reply(s, out.as_bytes());
    }

    fn reply_err(&self, s: u32, error: i32) {
        self.send(s, error, None, 0);
    }

    /// Answers with a small struct (copied into place).
    fn reply(&self, s: u32, bytes: &[u8]) {
        self.send(s, 0, Some(bytes), 0);
    }

    /// This reactor's counters.
    fn counts(&self) -> &Counts {
        &self.shared.counts[self.me]
    }

    /// Answers a read: `n` bytes at `at` in the slot's data area.
    fn reply_data(&self, s: u32, at: usize, n: usize) {
        {
            let mut slots = self.slots.borrow_mut();
            let slot = &mut slots[s as usize];
            slot.at = at;
            slot.n = n;
        }
        self.send(s, 0, None, n);
    }

    /// Sends the answer of slot `s`: an error, a small struct, or `data` bytes of its data
    /// area (from `slot.at`).
    fn send(&self, s: u32, error: i32, small: Option<&[u8]>, data: usize) {
        let mut slots = self.slots.borrow_mut();
        let slot = &mut slots[s as usize];
        self.count_answer(slot.opcode, error, data);
        let body = if error != 0 {
            0
        } else {
            small.map_or(data, <[u8]>::len)
        };
        let head = abi::fuse_out_header {
            len: (OUT_HEADER + body) as u32,
            error,
            unique: slot.unique,
        };
        match slot.via {
            Via::Dev => {
                self.write_answer(slot, &head, small, body);
                drop(slots);
                self.release(s);
            }
            Via::Ring(i) => {
                let ring = self.ring.as_ref().expect("ring slots only with a ring");
                let commit = stage_ring_answer(ring, slot, i, &head, small, data, body);
                drop(slots);
                self.busy.set(self.busy.get() - 1);
                if self.gone.get() {
                    // The connection is gone; nobody waits for the answer.
                    self.maybe_end();
                    return;
                }
                ring.commit(self.fd(), i, commit);
                self.maybe_end();
            }
        }
    }

    /// Counts an answer in this reactor's counters: an error, or the request it ends.
    #[inline]
    fn count_answer(&self, opcode: u32, error: i32, data: usize) {
        let c = self.counts();
        bump(&c.requests, 1);
        if error != 0 {
            bump(&c.errors, 1);
        } else if opcode == fo::FUSE_READ as u32 {
            bump(&c.reads, 1);
            bump(&c.read_bytes, data as u64);
        } else if opcode == fo::FUSE_WRITE as u32 {
            bump(&c.writes, 1);
        } else if opcode == fo::FUSE_FSYNC as u32 {
            bump(&c.flushes, 1);
        }
    }

    /// Writes the answer `head` and its `body` bytes (`small`, else the slot's data from
    /// `slot.at`) to `/dev/fuse`.
    #[inline]
    fn write_answer(
        &self,
        slot: &mut Slot,
        head: &abi::fuse_out_header,
        small: Option<&[u8]>,
        body: usize,
    ) {
        // The header goes right before the body, so that one write sends both.
        let start = match small {
            Some(b) if head.error == 0 => {
                slot.buf.as_mut_slice()[OUT_HEADER..OUT_HEADER + b.len()].copy_from_slice(b);
                0
            }
            _ if head.error == 0 => slot.data + slot.at - OUT_HEADER,
            _ => 0,
        };
        slot.buf.as_mut_slice()[start..start + OUT_HEADER].copy_from_slice(head.as_bytes());
        let answer = &slot.buf.as_slice()[start..start + OUT_HEADER + body];
        match rustix::io::write(&self.dev, answer) {
            // ENOENT: the request was interrupted or aborted; ENODEV: unmounted.
            Ok(_) | Err(Errno::NOENT) | Err(Errno::NODEV) => {}
            Err(e) => log::warn!(
                "cairn: fuse {}: answer a request: {}",
                self.shared.path.display(),
                std::io::Error::from(e)
            ),
        }
    }

    /// Slot `s` is free again (`/dev/fuse` slots go back on the free list).
    fn release(&self, s: u32) {
        let via = {
            let mut slots = self.slots.borrow_mut();
            slots[s as usize].stage = Stage::Free;
            slots[s as usize].via
        };
        self.busy.set(self.busy.get() - 1);
        if via == Via::Dev {
            self.free.borrow_mut().push(s);
            if self.stalled.replace(false) {
                self.pump();
            }
        }
        self.maybe_end();
    }

    fn gate_timer(&self) {
        self.timer.set(false);
        let waiting = std::mem::take(&mut *self.waiting.borrow_mut());
        for s in waiting {
            self.advance(s);
        }
    }

    /// A device request of slot `s` has completed.
    fn done(&self, s: u32, status: IoStatus) {
        let (stage, step) = {
            let slots = self.slots.borrow();
            let slot = &slots[s as usize];
            (slot.stage, slot.steps.get(slot.step as usize).copied())
        };
        let opcode = self.slots.borrow()[s as usize].opcode;
        if opcode == fo::FUSE_READ as u32 {
            if status.is_ok() {
                let (at, n) = {
                    let slots = self.slots.borrow();
                    (slots[s as usize].at, slots[s as usize].n)
                };
                self.reply_data(s, at, n);
            } else {
                self.reply_err(s, errno(status));
            }
            return;
        }
        if opcode == fo::FUSE_FSYNC as u32 {
            if status.is_ok() {
                self.reply(s, &[]);
            } else {
                self.reply_err(s, errno(status));
            }
            return;
        }
        // A write or fallocate step.
        let gate = &self.shared.gate;
        match stage {
            Stage::Edges(left) => {
                let failed = {
                    let mut slots = self.slots.borrow_mut();
                    let slot = &mut slots[s as usize];
                    slot.failed |= !status.is_ok();
                    if left > 1 {
                        slot.stage = Stage::Edges(left - 1);
                        return;
                    }
                    std::mem::take(&mut slot.failed)
                };
                if failed {
                    gate.open();
                    self.reply_err(s, -libc::EIO);
                    return;
                }
                self.merged(s);
            }
            Stage::Merged => {
                gate.open();
                self.step_done(s, status);
            }
            _ => {
                if matches!(step.map(|st| st.kind), Some(StepKind::Whole(..))) {
                    gate.leave(self.me);
                }
                self.step_done(s, status);
            }
        }
    }

    fn step_done(&self, s: u32, status: IoStatus) {
        if !status.is_ok() {
            self.reply_err(s, errno(status));
            return;
        }
        self.slots.borrow_mut()[s as usize].step += 1;
        self.advance(s);
    }

    /// Ends the part once shutdown (or the connection's end) allows and nothing is in
    /// flight: a final flush, then the reactor may stop.
    fn maybe_end(&self) {
        let ending = self.gone.get() || self.phase.get() == ENDING;
        if !ending || self.ended.get() || self.in_flight.get() > 0 {
            return;
        }
        if self.busy.get() > 0 {
            return;
        }
        match self.final_flush.get() {
            0 => {
                self.final_flush.set(1);
                self.in_flight.set(self.in_flight.get() + 1);
                self.queue
                    .submit(Io::nodata(Op::Flush, 0, 0, self.sink.get(), FINAL_FLUSH));
            }
            1 => {}
            _ => {
                self.ended.set(true);
                self.count_flushed();
                if self.polled.get() {
                    // Take the poll back, so that the ring has nothing of ours in flight.
                    let entry =
                        opcode::PollRemove::new((u64::from(self.user.get()) << 48) | POLL).build();
                    // SAFETY: the cancel refers to our own poll; it holds no buffers.
                    unsafe { self.core.push_sqe(self.user.get(), CANCEL, entry) };
                }
                self.core.stop();
            }
        }
    }

    /// Tells [`Frontend::stop`](cairn_core::Frontend::stop) that this part has flushed
    /// (once: after the flush it asked for, or at the part's end, whichever comes first).
    fn count_flushed(&self) {
        if self.counted.replace(true) {
            return;
        }
        let mut n = self
            .shared
            .flushed
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        *n += 1;
        self.shared.flushed_cv.notify_all();
    }

    /// The shutdown phase changed (seen through the wake eventfd).
    fn phase_changed(&self) {
        let p = self.shared.phase();
        if p == self.phase.get() {
            return;
        }
        self.phase.set(p);
        if p == FLUSHING {
            self.in_flight.set(self.in_flight.get() + 1);
            self.queue
                .submit(Io::nodata(Op::Flush, 0, 0, self.sink.get(), PHASE_FLUSH));
        } else if p == ENDING {
            self.maybe_end();
        }
    }
}

fn token(s: u32, what: u64) -> u64 {
    (u64::from(s) << 4) | what
}

/// Puts the answer `head` and its `body` bytes (`small`, else `data` bytes of the slot's
/// data area from `slot.at`, moved to its start) in ring entry `i`, and frees the slot.
/// Returns the commit id to send it with.
#[inline]
fn stage_ring_answer(
    ring: &Ring,
    slot: &mut Slot,
    i: usize,
    head: &abi::fuse_out_header,
    small: Option<&[u8]>,
    data: usize,
    body: usize,
) -> u64 {
    if head.error == 0 {
        match small {
            Some(b) => slot.buf.as_mut_slice()[..b.len()].copy_from_slice(b),
            None if slot.at != 0 => {
                let at = slot.at;
                slot.buf.as_mut_slice().copy_within(at..at + data, 0);
            }
            None => {}
        }
    }
    // SAFETY: the kernel does not touch the header until the commit, which the caller
    // sends after this returns.
    let hdr = unsafe { &mut *ring.entries[i].header.get() };
    hdr.in_out[..OUT_HEADER].copy_from_slice(head.as_bytes());
    hdr.ent.payload_sz = body as u32;
    slot.stage = Stage::Free;
    hdr.ent.commit_id
}

impl Sink for Part {
    fn io_done(&self, token: u64, status: IoStatus) {
        match token {
            GATE_TIMER => {
                self.gate_timer();
                return;
            }
            PHASE_FLUSH | FINAL_FLUSH => {
                self.in_flight.set(self.in_flight.get() - 1);
                let last = token == FINAL_FLUSH;
                if !status.is_ok() {
                    log::warn!(
                        "cairn: fuse {}: {} flush failed: {status}",
                        self.shared.path.display(),
                        if last { "final" } else { "before unmount" }
                    );
                }
                if last {
                    self.final_flush.set(2);
                } else {
                    self.count_flushed();
                }
                self.maybe_end();
                return;
            }
            _ => {}
        }
        self.in_flight.set(self.in_flight.get() - 1);
        self.done((token >> 4) as u32, status);
        self.maybe_end();
    }
}

impl RingUser for Part {
    fn ring_complete(&self, cookie: u64, _res: i32) {
        if cookie == POLL {
            self.polled.set(false);
            self.pump();
        }
    }
}

impl Poller for Part {
    fn unplug(&self) {
        if let Some(ring) = &self.ring {
            ring.unplug();
        }
    }

    fn reap(&self) -> usize {
        let mut found = 0;
        if self.phase.get() != self.shared.phase() {
            self.phase_changed();
            found += 1;
        }
        if let Some(ring) = &self.ring {
            let mut reaped = std::mem::take(&mut *self.reaped.borrow_mut());
            reaped.clear();
            ring.reap(&mut reaped);
            found += reaped.len();
            for &(i, res) in &reaped {
                let s = self.ring_slot(i);
                if res < 0 {
                    // ENOTCONN and friends: the queue is gone (unmounted), or the entry
                    // was refused; either way it waits for nothing any more.
                    if res != -libc::ENOTCONN && res != -libc::ECANCELED {
                        log::warn!(
                            "cairn: fuse {}: io_uring queue entry: {}; requests go through /dev/fuse",
                            self.shared.path.display(),
                            std::io::Error::from_raw_os_error(-res)
                        );
                    }
                    continue;
                }
                self.take(s, 0);
            }
            *self.reaped.borrow_mut() = reaped;
        }
        found
    }

    fn busy(&self) -> bool {
        !self.ended.get()
    }

    fn event_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }

    fn clear_event(&self) {
        cairn_core::event::reset(&self.wake);
    }
}

impl Part {
    /// The slot of ring entry `i` (ring slots come first, in entry order).
    fn ring_slot(&self, i: usize) -> u32 {
        i as u32
    }
}

impl FrontendPart for Part {
    fn ended(&self) -> bool {
        self.ended.get()
    }
}

impl Drop for Part {
    fn drop(&mut self) {
        // The ring goes before the buffers its entries point at.
        self.ring = None;
    }
}
