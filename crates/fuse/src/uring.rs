//! FUSE over io_uring: a reactor's own ring of 128-byte SQEs, on which each entry of the
//! reactor's queues waits for a request (`REGISTER`), and answers it and waits for the next
//! in one command (`COMMIT_AND_FETCH`).
//!
//! The kernel makes one queue per possible CPU and hands a request to the queue of the CPU
//! its caller runs on; it switches a connection to io_uring once every queue has an entry.
//! A reactor takes the queues `q` with `q % reactors == index`. The ring is a poller of the
//! reactor: its SQEs go to the kernel when the reactor unplugs, its completions are read
//! from user space when the reactor reaps, and an eventfd registered with it wakes the
//! reactor when it sleeps.

use std::cell::{Cell, RefCell, UnsafeCell};
use std::os::fd::RawFd;

use cairn_core::Error;
use io_uring::{squeue, IoUring};
use zerocopy::IntoBytes;

use crate::abi::{self, UringCmdReq, UringReqHeader};

/// One entry: its header buffer and the iovecs that describe it and its payload.
pub(crate) struct Entry {
    pub header: Box<UnsafeCell<UringReqHeader>>,
    pub iov: Box<[libc::iovec; 2]>,
    pub qid: u16,
}

/// The ring and what is queued on it.
pub(crate) struct Ring {
    ring: RefCell<IoUring<squeue::Entry128>>,
    queued: Cell<u32>,
    /// Commands the kernel holds (each entry has one outstanding, save while cairn works
    /// on its request).
    pub outstanding: Cell<u32>,
    pub entries: Vec<Entry>,
}

/// Builds a `URING_CMD` SQE for `/dev/fuse` by hand: the `io-uring` crate's builder has no
/// way to set `len`, which `REGISTER` needs (2: the header and payload iovecs).
fn uring_cmd(fd: RawFd, cmd_op: u32, addr: u64, len: u32, req: &UringCmdReq) -> squeue::Entry128 {
    let mut sqe = [0u8; 128];
    sqe[0] = io_uring::opcode::UringCmd80::CODE;
    sqe[4..8].copy_from_slice(&fd.to_ne_bytes());
    sqe[8..12].copy_from_slice(&cmd_op.to_ne_bytes());
    sqe[16..24].copy_from_slice(&addr.to_ne_bytes());
    sqe[24..28].copy_from_slice(&len.to_ne_bytes());
    sqe[48..48 + std::mem::size_of::<UringCmdReq>()].copy_from_slice(req.as_bytes());
    // SAFETY: `Entry128` is `repr(C)`: a 64-byte `io_uring_sqe` and 64 more bytes of
    // command, 128 bytes in all, any bit pattern of which is a valid value; the layout
    // above is the kernel's (opcode, fd, cmd_op, addr, len, then the command at 48).
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(sqe) }
}

impl Ring {
    /// A ring for `entries`, whose completions signal `wake`.
    pub fn new(entries: Vec<Entry>, wake: RawFd) -> Result<Ring, Error> {
        let n = (entries.len() as u32 * 2).next_power_of_two().max(8);
        // The kernel copies each request into its entry's buffers in task work on this
        // thread. Cooperative task work does not interrupt a reactor at work (it runs at
        // its next system call, one per pass) and still wakes a sleeping one: twice the
        // 4 KiB random-read IOPS of a plain ring here (177k to 360k, bench/fuse.py). Not
        // DEFER_TASKRUN: that runs only in an io_uring_enter on this ring, and the reactor
        // sleeps on its own.
        let ring = IoUring::<squeue::Entry128>::builder()
            .setup_cqsize(n * 2)
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .build(n)
            .map_err(|e| Error::os("fuse: create the io_uring for FUSE queues", e))?;
        ring.submitter()
            .register_eventfd(wake)
            .map_err(|e| Error::os("fuse: register the eventfd of the FUSE io_uring", e))?;
        Ok(Ring {
            ring: RefCell::new(ring),
            queued: Cell::new(0),
            outstanding: Cell::new(0),
            entries,
        })
    }

    fn push(&self, sqe: squeue::Entry128) {
        let mut ring = self.ring.borrow_mut();
        // SAFETY: each SQE points at an entry's iovecs and buffers, which live as long as
        // the ring (the ring is dropped first, see `Part`).
        while unsafe { ring.submission().push(&sqe) }.is_err() {
            let _ = ring.submit();
        }
        self.queued.set(self.queued.get() + 1);
        self.outstanding.set(self.outstanding.get() + 1);
    }

    /// Queues the `REGISTER` of entry `i` on the session clone `fd`.
    pub fn register(&self, fd: RawFd, i: usize) {
        let e = &self.entries[i];
        let req = UringCmdReq {
            qid: e.qid,
            ..Default::default()
        };
        let sqe = uring_cmd(fd, abi::URING_CMD_REGISTER, e.iov.as_ptr() as u64, 2, &req)
            .user_data(i as u64);
        self.push(sqe);
    }

    /// Queues the `COMMIT_AND_FETCH` of entry `i` (its reply is in its buffers).
    pub fn commit(&self, fd: RawFd, i: usize, commit_id: u64) {
        let req = UringCmdReq {
            qid: self.entries[i].qid,
            commit_id,
            ..Default::default()
        };
        let sqe = uring_cmd(fd, abi::URING_CMD_COMMIT_AND_FETCH, 0, 0, &req).user_data(i as u64);
        self.push(sqe);
    }

    /// Hands what is queued to the kernel.
    pub fn unplug(&self) {
        if self.queued.get() > 0 {
            let ring = self.ring.borrow();
            if ring.submit().is_ok() {
                self.queued.set(0);
            }
        }
    }

    /// Collects completions (entry index, result) into `out`, without a system call.
    pub fn reap(&self, out: &mut Vec<(usize, i32)>) {
        let mut ring = self.ring.borrow_mut();
        for cqe in ring.completion() {
            out.push((cqe.user_data() as usize, cqe.result()));
        }
        self.outstanding
            .set(self.outstanding.get().saturating_sub(out.len() as u32));
    }
}
