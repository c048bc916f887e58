//! A blocking front end to one queue, for tests, tools and slow paths.
//!
//! [`BlockingQueue`] owns a reactor on the calling thread, submits a batch of requests,
//! and runs the reactor until every one has completed. It is not for the hot path: each
//! call allocates its result vector.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use crate::buf::AlignedBuf;
use crate::device::{Device, Geometry, Queue};
use crate::error::{Error, IoError};
use crate::io::{Io, IoFlags, IoStatus, Op, SinkId};
use crate::reactor::{Core, Reactor, Sink, Switches};

struct Collector {
    core: Rc<Core>,
    results: RefCell<Vec<Option<IoStatus>>>,
    pending: Cell<usize>,
}

impl Sink for Collector {
    fn io_done(&self, token: u64, status: IoStatus) {
        self.results.borrow_mut()[token as usize] = Some(status);
        let left = self.pending.get() - 1;
        self.pending.set(left);
        if left == 0 {
            self.core.stop();
        }
    }
}

/// One request for [`BlockingQueue::run`]: the buffer is read from (writes) or filled
/// (reads) in place.
#[derive(Debug)]
pub struct Request<'a> {
    /// The operation.
    pub op: Op,
    /// Flags (FUA, NO_HOLE).
    pub flags: IoFlags,
    /// Byte offset.
    pub offset: u64,
    /// Length for discard and write-zeroes (reads and writes use the buffer's length).
    pub len: u64,
    /// Data for reads and writes.
    pub buf: Option<&'a mut [u8]>,
}

/// Why a blocking request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BlockingError {
    /// Refused at the edge: nothing was submitted.
    #[error("{0}")]
    Refused(IoError),
    /// The device failed it.
    #[error("{0}")]
    Failed(IoStatus),
}

/// A queue driven synchronously on the calling thread.
pub struct BlockingQueue {
    // Field order: the queue goes before the reactor that owns its ring.
    queue: Rc<dyn Queue>,
    collector: Rc<Collector>,
    sink: SinkId,
    geometry: Geometry,
    reactor: Reactor,
}

impl BlockingQueue {
    /// Opens a queue of `device` on a new reactor owned by this thread.
    pub fn open(device: &Arc<dyn Device>, switches: Switches) -> Result<BlockingQueue, Error> {
        let reactor = Reactor::new(switches)?;
        let core = reactor.core().clone();
        let queue = device.open_queue(&core)?;
        let collector = Rc::new(Collector {
            core: core.clone(),
            results: RefCell::new(Vec::new()),
            pending: Cell::new(0),
        });
        let sink = core.register_sink(collector.clone());
        Ok(BlockingQueue {
            queue,
            collector,
            sink,
            geometry: device.geometry(),
            reactor,
        })
    }

    /// The device's geometry.
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// The queue (for statistics).
    pub fn queue(&self) -> &Rc<dyn Queue> {
        &self.queue
    }

    /// Submits every request at once (they are in flight together) and waits for all.
    /// Each is checked at the edge first; a refused one is not submitted.
    pub fn run(&self, requests: &mut [Request<'_>]) -> Vec<Result<(), BlockingError>> {
        let mut out: Vec<Result<(), BlockingError>> = Vec::with_capacity(requests.len());
        let mut ios = Vec::new();
        for (i, r) in requests.iter_mut().enumerate() {
            let (buf, len) = match r.buf.as_deref_mut() {
                Some(b) if r.op.has_data() => (b.as_mut_ptr(), b.len() as u64),
                _ => (
                    std::ptr::null_mut(),
                    if r.op.has_range() { r.len } else { 0 },
                ),
            };
            if r.op.has_data() && buf.is_null() {
                out.push(Err(BlockingError::Refused(IoError::BadLength {
                    op: r.op,
                    len: 0,
                })));
                continue;
            }
            match self.geometry.check(r.op, r.offset, len) {
                Ok(()) => {
                    out.push(Ok(()));
                    ios.push(Io {
                        op: r.op,
                        flags: r.flags,
                        offset: r.offset,
                        len,
                        buf,
                        sink: self.sink,
                        token: i as u64,
                    });
                }
                Err(e) => out.push(Err(BlockingError::Refused(e))),
            }
        }
        if ios.is_empty() {
            return out;
        }
        // A batch starts: the cached clock may be as old as this queue's last use, and
        // every request's latency is measured from it.
        self.reactor.core().clock().refresh();
        *self.collector.results.borrow_mut() = vec![None; requests.len()];
        self.collector.pending.set(ios.len());
        for io in ios {
            self.queue.submit(io);
        }
        self.reactor.run();
        let results = self.collector.results.borrow();
        for (i, slot) in out.iter_mut().enumerate() {
            if slot.is_ok() {
                match results[i] {
                    Some(s) if s.is_ok() => {}
                    Some(s) => *slot = Err(BlockingError::Failed(s)),
                    None => *slot = Err(BlockingError::Failed(IoStatus::errno(libc::EIO))),
                }
            }
        }
        out
    }

    fn one(&self, mut r: Request<'_>) -> Result<(), BlockingError> {
        self.run(std::slice::from_mut(&mut r))
            .pop()
            .expect("one result")
    }

    /// Reads `buf.len()` bytes at `offset` (through an aligned bounce buffer, so O_DIRECT
    /// devices accept any `buf`).
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), BlockingError> {
        let mut bounce = AlignedBuf::new(buf.len());
        let r = Request {
            op: Op::Read,
            flags: IoFlags::NONE,
            offset,
            len: 0,
            buf: Some(bounce.as_mut_slice()),
        };
        self.one(r)?;
        buf.copy_from_slice(bounce.as_slice());
        Ok(())
    }

    /// Writes `data` at `offset` (through an aligned bounce buffer).
    pub fn write(&self, offset: u64, data: &[u8], flags: IoFlags) -> Result<(), BlockingError> {
        let mut bounce = AlignedBuf::new(data.len());
        bounce.as_mut_slice().copy_from_slice(data);
        self.one(Request {
            op: Op::Write,
            flags,
            offset,
            len: 0,
            buf: Some(bounce.as_mut_slice()),
        })
    }

    /// Flushes.
    pub fn flush(&self) -> Result<(), BlockingError> {
        self.one(Request {
            op: Op::Flush,
            flags: IoFlags::NONE,
            offset: 0,
            len: 0,
            buf: None,
        })
    }

    /// Discards or write-zeroes a range.
    pub fn zero(&self, op: Op, offset: u64, len: u64, flags: IoFlags) -> Result<(), BlockingError> {
        self.one(Request {
            op,
            flags,
            offset,
            len,
            buf: None,
        })
    }
}

impl Drop for BlockingQueue {
    fn drop(&mut self) {
        self.reactor.core().unregister_sink(self.sink);
    }
}
