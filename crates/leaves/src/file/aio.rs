//! The linux-aio engine: `io_submit` once per reactor batch, completions read straight
//! from the context's ring in user memory.
//!
//! Each queue owns an aio context with an eventfd attached to every request. With eager
//! reaping the reactor reads the completion ring right after `io_submit` returns, without
//! a system call (buffered I/O on most file systems has completed by then); with lazy
//! reaping it looks only after the eventfd has woken its blocking wait, as QEMU did before
//! "linux-aio: process completions from ioq_submit()". Discard and write-zeroes, which
//! linux-aio cannot express, run synchronously on the reactor thread.

use std::cell::{Cell, RefCell};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::sync::Arc;

use cairn_core::{Core, Error, Io, IoFlags, IoStatus, Op, Poller, Queue, QueueStats};

use super::{do_sync, FileShared, Slots, Step, QUEUE_DEPTH};

const IOCB_CMD_PREAD: u16 = 0;
const IOCB_CMD_PWRITE: u16 = 1;
const IOCB_CMD_FDSYNC: u16 = 3;
const IOCB_FLAG_RESFD: u32 = 1;
const AIO_RING_MAGIC: u32 = 0xa10a_10a1;

/// `struct iocb` from `<linux/aio_abi.h>` (little-endian layout).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Iocb {
    aio_data: u64,
    aio_key: u32,
    aio_rw_flags: i32,
    aio_lio_opcode: u16,
    aio_reqprio: i16,
    aio_fildes: u32,
    aio_buf: u64,
    aio_nbytes: u64,
    aio_offset: i64,
    aio_reserved2: u64,
    aio_flags: u32,
    aio_resfd: u32,
}

/// `struct io_event`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct IoEvent {
    data: u64,
    obj: u64,
    res: i64,
    res2: i64,
}

/// The header of the completion ring the kernel maps at the context's address.
#[repr(C)]
struct AioRing {
    id: u32,
    nr: u32,
    head: u32,
    tail: u32,
    magic: u32,
    compat_features: u32,
    incompat_features: u32,
    header_length: u32,
}

/// One file's queue on its own aio context.
pub struct AioQueue {
    core: Rc<Core>,
    stats: QueueStats,
    shared: Arc<FileShared>,
    ctx: u64,
    /// Closed after `io_destroy` (fields drop after `drop`).
    eventfd: OwnedFd,
    user_ring: bool,
    slots: RefCell<Slots>,
    iocbs: RefCell<Box<[Iocb]>>,
    /// Iocbs prepared but not yet passed to `io_submit` (the plug), in order.
    plugged: RefCell<Vec<*mut Iocb>>,
    in_kernel: Cell<usize>,
}

impl AioQueue {
    /// Opens a queue on `core` with its own aio context.
    pub fn open(core: &Rc<Core>, shared: Arc<FileShared>) -> Result<Rc<dyn Queue>, Error> {
        let mut ctx: u64 = 0;
        // SAFETY: io_setup writes the context id to `ctx`.
        let rc =
            unsafe { libc::syscall(libc::SYS_io_setup, QUEUE_DEPTH as libc::c_long, &mut ctx) };
        if rc < 0 {
            return Err(Error::last_os(
                "aio: io_setup (see /proc/sys/fs/aio-max-nr)",
            ));
        }
        let flags = rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC;
        let eventfd = match rustix::event::eventfd(0, flags) {
            Ok(fd) => fd,
            Err(e) => {
                // SAFETY: ctx came from io_setup, and nothing was submitted on it.
                unsafe { libc::syscall(libc::SYS_io_destroy, ctx) };
                return Err(Error::os("aio: eventfd", e.into()));
            }
        };
        // SAFETY: the context id is the address of the kernel-mapped ring header.
        let user_ring = unsafe {
            let ring = ctx as *const AioRing;
            (*ring).magic == AIO_RING_MAGIC && (*ring).incompat_features == 0
        };
        let queue = Rc::new(AioQueue {
            core: core.clone(),
            stats: QueueStats::leaf(core.switches().stats),
            shared,
            ctx,
            eventfd,
            user_ring,
            slots: RefCell::new(Slots::new(QUEUE_DEPTH)),
            iocbs: RefCell::new(vec![Iocb::default(); QUEUE_DEPTH].into_boxed_slice()),
            plugged: RefCell::new(Vec::with_capacity(QUEUE_DEPTH)),
            in_kernel: Cell::new(0),
        });
        core.register_poller(queue.clone());
        Ok(queue)
    }

    /// Prepares the iocb for the rest of the request in `slot` and plugs it.
    fn prepare(&self, slot: u32, io: &Io, done_bytes: u64) {
        let opcode = match io.op {
            Op::Read => IOCB_CMD_PREAD,
            Op::Write => IOCB_CMD_PWRITE,
            Op::Flush => IOCB_CMD_FDSYNC,
            Op::Discard | Op::WriteZeroes => {
                // linux-aio has no such command: do it now, complete through the FIFO.
                let status = do_sync(&self.shared, io);
                self.finish(slot, status);
                return;
            }
        };
        let rw_flags = if io.op == Op::Write && io.flags.contains(IoFlags::FUA) {
            libc::RWF_DSYNC
        } else {
            0
        };
        let mut iocbs = self.iocbs.borrow_mut();
        iocbs[slot as usize] = Iocb {
            aio_data: u64::from(slot),
            aio_rw_flags: rw_flags,
            aio_lio_opcode: opcode,
            aio_fildes: self.shared.fd() as u32,
            aio_buf: io.buf as u64 + done_bytes,
            aio_nbytes: io.len - done_bytes,
            aio_offset: (io.offset + done_bytes) as i64,
            aio_flags: IOCB_FLAG_RESFD,
            aio_resfd: self.eventfd.as_raw_fd() as u32,
            ..Iocb::default()
        };
        // The table is never resized, so the pointer stays valid while the queue lives.
        self.plugged
            .borrow_mut()
            .push(&mut iocbs[slot as usize] as *mut Iocb);
    }

    fn finish(&self, slot: u32, status: IoStatus) {
        let next = self
            .slots
            .borrow_mut()
            .finish(slot, status, &self.stats, &self.core);
        if let Some((i, io)) = next {
            self.prepare(i, &io, 0);
        }
    }

    fn event(&self, slot: u32, res: i64) {
        self.in_kernel.set(self.in_kernel.get() - 1);
        let step = self.slots.borrow_mut().progress(slot, res);
        match step {
            Step::Resume(io, done) => self.prepare(slot, &io, done),
            Step::Finish(status) => self.finish(slot, status),
        }
    }

    /// Reads completions from the user-space ring; returns how many.
    fn reap_user_ring(&self) -> usize {
        let ring = self.ctx as *mut AioRing;
        // SAFETY: the ring header and its events stay mapped until io_destroy; the kernel
        // publishes `tail` after writing events (hence Acquire), and reads `head`, which we
        // publish with Release after copying the events out. These are the same rules
        // libaio and QEMU follow when they reap in user space.
        unsafe {
            let nr = (*ring).nr;
            let head_ref = AtomicU32::from_ptr(&raw mut (*ring).head);
            let tail_ref = AtomicU32::from_ptr(&raw mut (*ring).tail);
            let events = (ring as *mut u8).add(std::mem::size_of::<AioRing>()) as *const IoEvent;
            let mut head = head_ref.load(Ordering::Relaxed);
            let tail = tail_ref.load(Ordering::Acquire);
            let mut n = 0;
            while head != tail {
                let ev = std::ptr::read_volatile(events.add(head as usize));
                head = (head + 1) % nr;
                fence(Ordering::Release);
                head_ref.store(head, Ordering::Release);
                self.event(ev.data as u32, ev.res);
                n += 1;
            }
            n
        }
    }

    fn reap_syscall(&self) -> usize {
        let mut events = [IoEvent::default(); 64];
        let mut total = 0;
        loop {
            let zero = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: events has room for 64 entries.
            let n = unsafe {
                libc::syscall(
                    libc::SYS_io_getevents,
                    self.ctx,
                    0,
                    64,
                    events.as_mut_ptr(),
                    &zero,
                )
            };
            if n <= 0 {
                return total;
            }
            for ev in &events[..n as usize] {
                self.event(ev.data as u32, ev.res);
            }
            total += n as usize;
        }
    }
}

impl Queue for AioQueue {
    fn submit(&self, io: Io) {
        let start = self.stats.begin(io.flags, || self.core.now_ns());
        let slot = self.slots.borrow_mut().take(io, start);
        if let Some(slot) = slot {
            self.prepare(slot, &io, 0);
        }
    }

    fn stats(&self) -> &QueueStats {
        &self.stats
    }
}

impl Poller for AioQueue {
    fn unplug(&self) {
        loop {
            let mut plugged = self.plugged.borrow_mut();
            if plugged.is_empty() {
                return;
            }
            // SAFETY: each pointer is a prepared iocb in our table, which stays put until
            // its event is reaped; the buffers are kept alive by their submitters.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_io_submit,
                    self.ctx,
                    plugged.len() as libc::c_long,
                    plugged.as_ptr(),
                )
            };
            if rc > 0 {
                plugged.drain(..rc as usize);
                self.in_kernel.set(self.in_kernel.get() + rc as usize);
                continue;
            }
            let errno = if rc == 0 {
                libc::EAGAIN
            } else {
                super::last_errno()
            };
            if errno == libc::EAGAIN && self.in_kernel.get() > 0 {
                // The context is full: the rest goes in with the next batch.
                return;
            }
            // The first iocb was refused outright: fail it and go on with the rest.
            let refused = plugged.remove(0);
            drop(plugged);
            // SAFETY: the pointer is into our iocb table.
            let slot = unsafe { (*refused).aio_data } as u32;
            self.finish(slot, IoStatus::errno(errno));
        }
    }

    fn reap(&self) -> usize {
        if self.in_kernel.get() == 0 {
            return 0;
        }
        if self.user_ring {
            self.reap_user_ring()
        } else {
            self.reap_syscall()
        }
    }

    fn busy(&self) -> bool {
        // Plugged requests count: the reactor arms its wait before it unplugs.
        self.in_kernel.get() > 0 || !self.plugged.borrow().is_empty()
    }

    fn event_fd(&self) -> RawFd {
        self.eventfd.as_raw_fd()
    }

    fn clear_event(&self) {
        cairn_core::event::reset(&self.eventfd);
    }
}

impl Drop for AioQueue {
    fn drop(&mut self) {
        // SAFETY: io_destroy waits for in-flight requests, then unmaps the ring, which
        // nothing reads after this. The eventfd is closed after it, as a field.
        unsafe { libc::syscall(libc::SYS_io_destroy, self.ctx) };
    }
}
