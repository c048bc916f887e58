//! `--dispatch handoff`: the "before" of technique 4.
//!
//! Linux dm-mq once passed every cloned request to a kblockd worker instead of submitting
//! it on the caller's CPU, and paid for it in context switches (7.9 million against 2,008
//! in the fix's measurement). [`HandoffQueue`] rebuilds that path so its cost can be
//! measured: a stacked device's member queue lives on a worker thread with its own
//! reactor; requests go to it over a channel, completions come back over another, and
//! each side wakes the other with an eventfd (once per batch, not per request).

use std::cell::{Cell, RefCell};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::Arc;

use crate::device::{Device, Queue};
use crate::error::Error;
use crate::io::{Io, IoStatus, SinkId};
use crate::reactor::{Core, Poller, Reactor, Sink, Switches};
use crate::slab::Slab;
use crate::stats::QueueStats;

/// The submitting side: a queue whose requests run on a worker thread.
pub struct HandoffQueue {
    core: Rc<Core>,
    stats: QueueStats,
    /// Taken when the queue is dropped, so that the worker sees the channel close.
    to_worker: Option<Sender<(Io, u32)>>,
    from_worker: Receiver<(u32, IoStatus)>,
    worker_wake: Arc<OwnedFd>,
    my_wake: Arc<OwnedFd>,
    requests: RefCell<Slab<(Io, u64)>>,
    unsent: Cell<bool>,
}

impl HandoffQueue {
    /// Starts a worker thread that opens `device` on its own reactor, and returns the
    /// queue that hands requests to it.
    pub fn open(
        core: &Rc<Core>,
        device: Arc<dyn Device>,
        switches: Switches,
    ) -> Result<Rc<dyn Queue>, Error> {
        let (to_worker, requests) = mpsc::channel::<(Io, u32)>();
        let (completions, from_worker) = mpsc::channel::<(u32, IoStatus)>();
        let worker_wake = crate::event::eventfd("handoff")?;
        let my_wake = crate::event::eventfd("handoff")?;
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), Error>>();
        let (w_wake, m_wake) = (worker_wake.clone(), my_wake.clone());
        std::thread::Builder::new()
            .name(format!("cairn-handoff-{}", device.name()))
            .spawn(move || {
                worker(
                    device,
                    switches,
                    requests,
                    completions,
                    w_wake,
                    m_wake,
                    ready_tx,
                )
            })
            .map_err(|e| Error::os("handoff: start worker thread", e))?;
        ready_rx
            .recv()
            .map_err(|_| Error::Invalid("handoff: worker thread exited".into()))??;
        let queue = Rc::new(HandoffQueue {
            core: core.clone(),
            stats: QueueStats::new(core.switches().stats),
            to_worker: Some(to_worker),
            from_worker,
            worker_wake,
            my_wake,
            requests: RefCell::new(Slab::with_capacity(256)),
            unsent: Cell::new(false),
        });
        core.register_poller(queue.clone());
        Ok(queue)
    }
}

impl Queue for HandoffQueue {
    fn submit(&self, io: Io) {
        let now = self.core.now_ns();
        self.stats.start(io.flags, now);
        let index = self.requests.borrow_mut().insert((io, now));
        let sent = self
            .to_worker
            .as_ref()
            .is_some_and(|tx| tx.send((io, index)).is_ok());
        if !sent {
            // The worker is gone: fail the request through the FIFO.
            self.requests.borrow_mut().remove(index);
            self.stats.done(io.flags, io.op, io.len, now, now, false);
            self.core
                .complete(io.sink, io.token, IoStatus::errno(libc::EIO));
            return;
        }
        self.unsent.set(true);
    }

    fn stats(&self) -> &QueueStats {
        &self.stats
    }
}

impl Drop for HandoffQueue {
    fn drop(&mut self) {
        // Close the channel, then wake the worker so that it sees it closed, finishes
        // what it has in flight and exits (it would otherwise sleep for ever: a thread
        // leaked per queue).
        self.to_worker = None;
        crate::event::wake(&self.worker_wake);
    }
}

impl Poller for HandoffQueue {
    fn unplug(&self) {
        // One wake-up of the worker per batch.
        if self.unsent.replace(false) {
            crate::event::wake(&self.worker_wake);
        }
    }

    fn reap(&self) -> usize {
        let mut n = 0;
        while let Ok((index, status)) = self.from_worker.try_recv() {
            let (io, start) = self.requests.borrow_mut().remove(index);
            self.stats
                .finish(&io, start, || self.core.now_ns(), status.is_ok());
            self.core.complete(io.sink, io.token, status);
            n += 1;
        }
        n
    }

    fn busy(&self) -> bool {
        !self.requests.borrow().is_empty()
    }

    fn event_fd(&self) -> RawFd {
        self.my_wake.as_raw_fd()
    }

    fn clear_event(&self) {
        crate::event::reset(&self.my_wake);
    }
}

/// The worker's side: receives requests, submits them on its reactor, sends completions.
struct Worker {
    core: Rc<Core>,
    queue: RefCell<Option<Rc<dyn Queue>>>,
    sink: Cell<SinkId>,
    requests: Receiver<(Io, u32)>,
    completions: Sender<(u32, IoStatus)>,
    wake_me: Arc<OwnedFd>,
    wake_submitter: Arc<OwnedFd>,
    in_flight: Cell<usize>,
    unsent: Cell<bool>,
    closed: Cell<bool>,
}

impl Sink for Worker {
    fn io_done(&self, token: u64, status: IoStatus) {
        self.in_flight.set(self.in_flight.get() - 1);
        let _ = self.completions.send((token as u32, status));
        self.unsent.set(true);
    }
}

impl Poller for Worker {
    fn unplug(&self) {
        if self.unsent.replace(false) {
            crate::event::wake(&self.wake_submitter);
        }
        if self.closed.get() && self.in_flight.get() == 0 {
            self.core.stop();
        }
    }

    fn reap(&self) -> usize {
        let queue = self.queue.borrow().clone();
        let Some(queue) = queue else { return 0 };
        let mut n = 0;
        loop {
            match self.requests.try_recv() {
                Ok((io, index)) => {
                    self.in_flight.set(self.in_flight.get() + 1);
                    queue.submit(Io {
                        sink: self.sink.get(),
                        token: u64::from(index),
                        ..io
                    });
                    n += 1;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.closed.set(true);
                    break;
                }
            }
        }
        n
    }

    fn busy(&self) -> bool {
        // Always wait for the submitter's wake-up, until it has gone and nothing is in
        // flight (then the worker's drain ends at once).
        !(self.closed.get() && self.in_flight.get() == 0)
    }

    fn event_fd(&self) -> RawFd {
        self.wake_me.as_raw_fd()
    }

    fn clear_event(&self) {
        crate::event::reset(&self.wake_me);
    }
}

fn worker(
    device: Arc<dyn Device>,
    switches: Switches,
    requests: Receiver<(Io, u32)>,
    completions: Sender<(u32, IoStatus)>,
    wake_me: Arc<OwnedFd>,
    wake_submitter: Arc<OwnedFd>,
    ready: Sender<Result<(), Error>>,
) {
    crate::reactor::block_signals_in_this_thread();
    let reactor = match Reactor::new(switches) {
        Ok(r) => r,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let core = reactor.core().clone();
    let w = Rc::new(Worker {
        core: core.clone(),
        queue: RefCell::new(None),
        sink: Cell::new(SinkId(u32::MAX)),
        requests,
        completions,
        wake_me,
        wake_submitter,
        in_flight: Cell::new(0),
        unsent: Cell::new(false),
        closed: Cell::new(false),
    });
    match device.open_queue(&core) {
        Ok(q) => *w.queue.borrow_mut() = Some(q),
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    }
    w.sink.set(core.register_sink(w.clone()));
    core.register_poller(w.clone());
    let _ = ready.send(Ok(()));
    reactor.run();
    // Requests still in flight on the member queue are drained before the reactor goes.
    reactor.drain(crate::clock::monotonic_ns() + 5_000_000_000);
    *w.queue.borrow_mut() = None;
}

/// Opens a stacked device's member on `core`: inline, or behind a worker thread when the
/// reactor runs with `--dispatch handoff`.
pub fn open_member(core: &Rc<Core>, device: &Arc<dyn Device>) -> Result<Rc<dyn Queue>, Error> {
    match core.switches().dispatch {
        crate::reactor::DispatchMode::Inline => device.open_queue(core),
        crate::reactor::DispatchMode::Handoff => {
            HandoffQueue::open(core, device.clone(), core.switches())
        }
    }
}
