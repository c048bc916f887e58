//! The io_uring engine: requests become SQEs on the reactor's own ring.
//!
//! The file is registered in the ring's fixed-file table when a slot is free, which saves
//! the kernel a file-reference round trip per request. Short reads and writes are resumed
//! where they stopped; ranges the file system cannot zero with `fallocate` are zeroed by
//! writing.
//!
//! Where io_uring would hand every request to a kernel worker (see [`super::probe`]),
//! small reads and writes are `preadv2`/`pwritev2` calls on the reactor thread instead
//! ([`Submit`]); writes with FUA never are (they wait for the disk).

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use cairn_core::{Core, Error, Io, IoFlags, IoStatus, Op, Queue, QueueStats, RingUser};
use io_uring::{opcode, squeue, types};

use super::{do_sync, fallocate_mode, write_zeros, FileShared, Slots, Step, QUEUE_DEPTH};

/// What a queue does with system calls on the reactor instead of io_uring.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Submit {
    /// Reads of up to this many bytes are `preadv2` calls on the reactor (0: none).
    pub inline_reads: u64,
    /// Writes of up to this many bytes are `pwritev2` calls on the reactor (0: none).
    pub inline_writes: u64,
}

impl Submit {
    /// How it reads in a log line: empty (all through io_uring), `writes inline up to
    /// 64KiB`, `reads and writes inline up to 64KiB`, ...
    pub fn describe(&self) -> String {
        let size = |n: u64| {
            if n == u64::MAX {
                String::new()
            } else {
                format!(" up to {}", cairn_core::size::format_bytes(n))
            }
        };
        match (self.inline_reads, self.inline_writes) {
            (0, 0) => String::new(),
            (0, w) => format!("writes inline{}", size(w)),
            (r, 0) => format!("reads inline{}", size(r)),
            (r, w) if r == w => format!("reads and writes inline{}", size(r)),
            (r, w) => format!("reads inline{}, writes inline{}", size(r), size(w)),
        }
    }
}

/// One file's queue on one reactor's io_uring.
pub struct UringQueue {
    core: Rc<Core>,
    stats: QueueStats,
    shared: Arc<FileShared>,
    fixed: Option<u32>,
    submit: Submit,
    user: Cell<u16>,
    slots: RefCell<Slots>,
}

impl UringQueue {
    /// Opens a queue on `core`.
    pub fn open(
        core: &Rc<Core>,
        shared: Arc<FileShared>,
        submit: Submit,
    ) -> Result<Rc<dyn Queue>, Error> {
        let fixed = core.register_file(shared.fd());
        let queue = Rc::new(UringQueue {
            core: core.clone(),
            stats: QueueStats::leaf(core.switches().stats),
            shared,
            fixed,
            submit,
            user: Cell::new(0),
            slots: RefCell::new(Slots::new(QUEUE_DEPTH)),
        });
        let id = core.register_ring_user(queue.clone())?;
        queue.user.set(id);
        Ok(queue)
    }

    fn target(&self) -> Target {
        match self.fixed {
            Some(i) => Target::Fixed(types::Fixed(i)),
            None => Target::Fd(types::Fd(self.shared.fd())),
        }
    }

    /// Builds and queues the SQE for what is left of the request in `slot`.
    fn push(&self, slot: u32, io: &Io, done_bytes: u64) {
        let entry = self.sqe(io, done_bytes);
        // SAFETY: the buffer belongs to the submitter until we deliver the completion; the
        // fd lives in `shared`, which this queue (registered with the ring) keeps alive.
        unsafe {
            self.core
                .push_storage_sqe(self.user.get(), u64::from(slot), entry)
        };
    }

    fn sqe(&self, io: &Io, done_bytes: u64) -> squeue::Entry {
        let t = self.target();
        // SAFETY: done_bytes < len, so the pointer stays inside the request's buffer.
        let buf = unsafe { io.buf.add(done_bytes as usize) };
        let len = (io.len - done_bytes) as u32;
        let offset = io.offset + done_bytes;
        match io.op {
            Op::Read => match t {
                Target::Fixed(f) => opcode::Read::new(f, buf, len).offset(offset).build(),
                Target::Fd(f) => opcode::Read::new(f, buf, len).offset(offset).build(),
            },
            Op::Write => {
                let rwf = if io.flags.contains(IoFlags::FUA) {
                    libc::RWF_DSYNC
                } else {
                    0
                };
                match t {
                    Target::Fixed(f) => opcode::Write::new(f, buf, len)
                        .offset(offset)
                        .rw_flags(rwf)
                        .build(),
                    Target::Fd(f) => opcode::Write::new(f, buf, len)
                        .offset(offset)
                        .rw_flags(rwf)
                        .build(),
                }
            }
            Op::Flush => {
                let flags = types::FsyncFlags::DATASYNC;
                match t {
                    Target::Fixed(f) => opcode::Fsync::new(f).flags(flags).build(),
                    Target::Fd(f) => opcode::Fsync::new(f).flags(flags).build(),
                }
            }
            Op::Discard | Op::WriteZeroes => {
                let mode = fallocate_mode(io);
                match t {
                    Target::Fixed(f) => opcode::Fallocate::new(f, io.len)
                        .offset(io.offset)
                        .mode(mode)
                        .build(),
                    Target::Fd(f) => opcode::Fallocate::new(f, io.len)
                        .offset(io.offset)
                        .mode(mode)
                        .build(),
                }
            }
        }
    }

    fn finish(&self, slot: u32, status: IoStatus) {
        let next = self
            .slots
            .borrow_mut()
            .finish(slot, status, &self.stats, &self.core);
        if let Some((i, io)) = next {
            self.push(i, &io, 0);
        }
    }
}

enum Target {
    Fixed(types::Fixed),
    Fd(types::Fd),
}

impl Queue for UringQueue {
    fn submit(&self, io: Io) {
        let start = self.stats.begin(io.flags, || self.core.now_ns());
        // A write with FUA waits for the disk: never on the reactor.
        let inline = match io.op {
            Op::Write => io.len <= self.submit.inline_writes && !io.flags.contains(IoFlags::FUA),
            Op::Read => io.len <= self.submit.inline_reads,
            _ => false,
        };
        if inline {
            let status = do_sync(&self.shared, &io);
            self.stats
                .finish(&io, start, || self.core.now_ns(), status.is_ok());
            self.core.complete(io.sink, io.token, status);
            return;
        }
        let slot = self.slots.borrow_mut().take(io, start);
        if let Some(slot) = slot {
            self.push(slot, &io, 0);
        }
    }

    fn stats(&self) -> &QueueStats {
        &self.stats
    }
}

impl RingUser for UringQueue {
    fn ring_complete(&self, cookie: u64, res: i32) {
        let slot = cookie as u32;
        let step = self.slots.borrow_mut().progress(slot, i64::from(res));
        match step {
            Step::Resume(io, done) => self.push(slot, &io, done),
            Step::Finish(status) => {
                let io = self.slots.borrow().entries[slot as usize].io;
                let errno = status.raw();
                let fallback = matches!(io.op, Op::Discard | Op::WriteZeroes)
                    && (errno == libc::EOPNOTSUPP || errno == libc::EINVAL);
                let status = if fallback {
                    write_zeros(&self.shared, io.offset, io.len)
                } else {
                    status
                };
                let status = if matches!(io.op, Op::Discard | Op::WriteZeroes) {
                    // Rare (a FUA trim): on the reactor thread, as the fallback is.
                    self.shared.fua_zeroed(&io, status)
                } else {
                    status
                };
                self.finish(slot, status);
            }
        }
    }
}

impl Drop for UringQueue {
    fn drop(&mut self) {
        if let Some(slot) = self.fixed {
            self.core.unregister_file(slot);
        }
        debug_assert_eq!(
            self.slots.borrow().in_use(),
            0,
            "queue dropped with requests in flight"
        );
    }
}
