//! One reactor's queue on an RBD image.
//!
//! A request takes a slot, gets a librbd completion whose argument is (queue index, slot)
//! and goes to librbd at once (librbd has no batch call). The queue is two pollers of its
//! reactor: [`ImageWatch`] watches the image's eventfd and takes every completion librbd
//! has (its own finish on the spot, others go to their queue's inbox); the queue itself
//! watches its inbox's eventfd. Both are armed only while the queue has requests in
//! librbd, so an idle reactor never wakes for another's completions.

use std::cell::{Cell, RefCell};
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::sync::Arc;

use cairn_core::{Core, Io, IoFlags, IoStatus, Op, Poller, Queue, QueueStats};

use super::device::{Shared, MAX_QUEUES, QUEUE_DEPTH};
use crate::file::Slots;

/// Completions taken from librbd per call.
const POLL_BATCH: usize = 32;

/// One reactor's queue on the image.
pub(super) struct RbdQueue {
    core: Rc<Core>,
    stats: QueueStats,
    shared: Arc<Shared>,
    index: usize,
    read_only: bool,
    slots: RefCell<Slots>,
    /// Requests handed to librbd and not yet finished here.
    in_librbd: Cell<usize>,
    /// Per slot: its FUA request's write is done and the flush after it is in librbd.
    flushing: Box<[Cell<bool>]>,
    /// The image's eventfd was reset by [`ImageWatch`]: whatever woke it must be taken
    /// from librbd, even with nothing of this queue's in flight (it may be another's).
    image_cleared: Cell<bool>,
}

/// Watches the image's eventfd for one queue (a second poller of the same reactor).
struct ImageWatch {
    queue: Rc<RbdQueue>,
}

impl RbdQueue {
    /// Opens the queue with `index` (claimed by the caller) on `core`.
    pub(super) fn open(
        core: &Rc<Core>,
        shared: Arc<Shared>,
        index: usize,
        read_only: bool,
    ) -> Rc<dyn Queue> {
        let queue = Rc::new(RbdQueue {
            core: core.clone(),
            stats: QueueStats::leaf(core.switches().stats),
            shared,
            index,
            read_only,
            slots: RefCell::new(Slots::new(QUEUE_DEPTH)),
            in_librbd: Cell::new(0),
            flushing: (0..QUEUE_DEPTH).map(|_| Cell::new(false)).collect(),
            image_cleared: Cell::new(false),
        });
        core.register_poller(queue.clone());
        core.register_poller(Rc::new(ImageWatch {
            queue: queue.clone(),
        }));
        queue
    }

    /// Hands the request in `slot` to librbd, or says why it could not start.
    fn start(&self, slot: u32, io: &Io) -> Result<(), IoStatus> {
        if self.read_only && io.op.is_write() {
            // librbd would say EROFS too, after a completion allocation; say it here.
            return Err(IoStatus::errno(libc::EROFS));
        }
        self.flushing[slot as usize].set(false);
        self.to_librbd(slot, io.op, io)
    }

    /// Submits `op` for the request in `slot` (its own operation, or the flush after a
    /// FUA write).
    fn to_librbd(&self, slot: u32, op: Op, io: &Io) -> Result<(), IoStatus> {
        let api = self.shared.api;
        let image = self.shared.image.handle();
        let arg = ((self.index as u64) << 32 | u64::from(slot)) as usize;
        let mut c = std::ptr::null_mut();
        // SAFETY: `c` is a live out-pointer; no callback: the completion comes back
        // through the image's eventfd and `rbd_poll_io_events`.
        let rc = unsafe { (api.rbd_aio_create_completion)(arg as *mut _, None, &mut c) };
        if rc < 0 {
            return Err(IoStatus::errno(-rc));
        }
        let iov = libc::iovec {
            iov_base: io.buf.cast(),
            iov_len: io.len as usize,
        };
        // SAFETY: a live image; the submitter keeps `io.buf` (io.len bytes) alive until
        // the completion is delivered, which is after librbd's completion. With one iovec
        // librbd copies the iovec itself before returning (with several, a read keeps the
        // array until it completes: cairn passes one). The completion is released by
        // whoever takes it from `rbd_poll_io_events`, or below if the submission fails.
        let rc = unsafe {
            match op {
                Op::Read => (api.rbd_aio_readv)(image, &iov, 1, io.offset, c),
                Op::Write => (api.rbd_aio_writev)(image, &iov, 1, io.offset, c),
                Op::Flush => (api.rbd_aio_flush)(image, c),
                Op::Discard => (api.rbd_aio_discard)(image, io.offset, io.len, c),
                Op::WriteZeroes => {
                    (api.rbd_aio_write_zeroes)(image, io.offset, io.len as usize, c, 0, 0)
                }
            }
        };
        if rc < 0 {
            // SAFETY: librbd refused the request, so the completion is still ours.
            unsafe { (api.rbd_aio_release)(c) };
            return Err(IoStatus::errno(-rc));
        }
        self.in_librbd.set(self.in_librbd.get() + 1);
        Ok(())
    }

    /// Completes the request in `slot`, then starts waiting ones in the slot it frees
    /// (a loop, not recursion: a long wait of writes refused at once stays flat).
    fn finish(&self, mut slot: u32, mut status: IoStatus) {
        loop {
            let next = self
                .slots
                .borrow_mut()
                .finish(slot, status, &self.stats, &self.core);
            let Some((i, io)) = next else {
                return;
            };
            match self.start(i, &io) {
                Ok(()) => return,
                Err(s) => (slot, status) = (i, s),
            }
        }
    }

    /// librbd's result `res` for the request in `slot`.
    fn event(&self, slot: u32, res: i64) {
        self.in_librbd.set(self.in_librbd.get() - 1);
        let io = self.slots.borrow().entries[slot as usize].io;
        let flushing = self.flushing[slot as usize].replace(false);
        let mut status = if res < 0 {
            match (-res) as i32 {
                // An OSD or monitor that did not answer within `timeout`, a client the
                // cluster blocklisted (ESHUTDOWN), a range past an image that shrank
                // (EINVAL): EIO, as a disk that stopped answering would give (an array
                // fails the member).
                libc::ETIMEDOUT | libc::ESHUTDOWN | libc::EINVAL => IoStatus::errno(libc::EIO),
                errno => IoStatus::errno(errno),
            }
        } else if io.op == Op::Read && res as u64 != io.len {
            // A short read: the image shrank under the device.
            IoStatus::errno(libc::EIO)
        } else {
            IoStatus::OK
        };
        if status.is_ok()
            && !flushing
            && self.shared.cache_on
            && io.op.is_write()
            && io.flags.contains(IoFlags::FUA)
        {
            // A FUA request is durable when it completes. With librbd's cache off (what
            // session.rs asks) a completed write already is; a pool's or an image's own
            // configuration may turn the cache back on (seen at open): then a flush
            // after it makes sure.
            self.flushing[slot as usize].set(true);
            match self.to_librbd(slot, Op::Flush, &io) {
                Ok(()) => return,
                Err(s) => status = s,
            }
        }
        self.finish(slot, status);
    }

    /// Takes every completion librbd has for this image: this queue's finish now, other
    /// queues' go to their inboxes.
    fn take_from_librbd(&self) -> usize {
        take_events(&self.shared, self.index, |slot, res| self.event(slot, res))
    }

    /// Finishes what other queues left in this queue's inbox.
    fn take_from_inbox(&self) -> usize {
        let Some(inbox) = self.shared.inbox(self.index) else {
            return 0;
        };
        inbox.take(|slot, res| self.event(slot, res))
    }
}

/// Takes every completion librbd has for the image: `own(slot, result)` for those of the
/// queue with index `own_index`, the others posted to their queue's inbox, each owner
/// woken once. Returns how many were the caller's.
fn take_events(shared: &Shared, own_index: usize, mut own: impl FnMut(u32, i64)) -> usize {
    let api = shared.api;
    let image = shared.image.handle();
    let mut comps = [std::ptr::null_mut(); POLL_BATCH];
    let mut mine = 0;
    let mut woken: u64 = 0;
    loop {
        // SAFETY: a live image; room for POLL_BATCH completions.
        let n = unsafe { (api.rbd_poll_io_events)(image, comps.as_mut_ptr(), POLL_BATCH as _) };
        if n <= 0 {
            break;
        }
        for c in &comps[..n as usize] {
            // SAFETY: a completion librbd handed back (to this caller only); read, then
            // released once.
            let (arg, res) = unsafe {
                let arg = (api.rbd_aio_get_arg)(*c) as usize as u64;
                let res = (api.rbd_aio_get_return_value)(*c) as i64;
                (api.rbd_aio_release)(*c);
                (arg, res)
            };
            let (queue, slot) = ((arg >> 32) as usize, arg as u32);
            if queue == own_index {
                own(slot, res);
                mine += 1;
            } else if let Some(inbox) = shared.inbox(queue) {
                inbox.post(slot, res);
                woken |= 1 << (queue % MAX_QUEUES);
            }
        }
        if (n as usize) < POLL_BATCH {
            break;
        }
    }
    while woken != 0 {
        let q = woken.trailing_zeros() as usize;
        woken &= woken - 1;
        if let Some(inbox) = shared.inbox(q) {
            cairn_core::event::wake(&inbox.wake);
        }
    }
    mine
}

impl Queue for RbdQueue {
    fn submit(&self, io: Io) {
        let start = self.stats.begin(io.flags, || self.core.now_ns());
        let slot = self.slots.borrow_mut().take(io, start);
        if let Some(slot) = slot {
            if let Err(status) = self.start(slot, &io) {
                self.finish(slot, status);
            }
        }
    }

    fn stats(&self) -> &QueueStats {
        &self.stats
    }
}

impl Poller for RbdQueue {
    fn unplug(&self) {}

    fn reap(&self) -> usize {
        if self.in_librbd.get() == 0 {
            return 0;
        }
        self.take_from_inbox()
    }

    fn busy(&self) -> bool {
        self.in_librbd.get() > 0
    }

    fn event_fd(&self) -> RawFd {
        self.shared
            .inbox(self.index)
            .map_or(-1, |i| i.wake.as_raw_fd())
    }

    fn clear_event(&self) {
        if let Some(inbox) = self.shared.inbox(self.index) {
            cairn_core::event::reset(&inbox.wake);
        }
    }
}

impl Poller for ImageWatch {
    fn unplug(&self) {}

    fn reap(&self) -> usize {
        // Having reset the image's eventfd, this queue owes a look at librbd's queue even
        // when nothing of its own is in flight: the completions that woke it may be
        // another queue's, and no other queue will be woken for them.
        if self.queue.in_librbd.get() == 0 && !self.queue.image_cleared.replace(false) {
            return 0;
        }
        self.queue.take_from_librbd() + self.queue.take_from_inbox()
    }

    fn busy(&self) -> bool {
        self.queue.in_librbd.get() > 0
    }

    fn event_fd(&self) -> RawFd {
        self.queue.shared.eventfd.as_raw_fd()
    }

    fn clear_event(&self) {
        cairn_core::event::reset(&self.queue.shared.eventfd);
        self.queue.image_cleared.set(true);
    }
}

impl Drop for RbdQueue {
    fn drop(&mut self) {
        // librbd may still write into buffers of requests in flight: wait for them, for
        // as long as it takes (librados' op timeout ends most within `timeout`; a lock
        // hand-over or a refresh may take longer), saying so each `timeout`. Their
        // submitters are gone, so nothing is delivered. `cairn serve`'s shutdown deadline
        // ends the process if this lasts too long.
        let mut warn_at = std::time::Instant::now() + self.shared.timeout;
        while self.in_librbd.get() > 0 {
            let mut got = take_events(&self.shared, self.index, |_, _| {});
            if let Some(inbox) = self.shared.inbox(self.index) {
                got += inbox.take(|_, _| {});
            }
            self.in_librbd.set(self.in_librbd.get().saturating_sub(got));
            if got == 0 {
                if std::time::Instant::now() >= warn_at {
                    log::warn!(
                        "cairn: rbd: {} requests still in librbd; waiting for them before the queue closes",
                        self.in_librbd.get()
                    );
                    warn_at += self.shared.timeout;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        self.shared.release(self.index);
    }
}
