//! The zeroing of freed blocks, on a thread of its own, so that a commit (and every flush
//! and FUA write waiting for one) never waits behind it: a discard of many blocks frees
//! them all at one commit, and zeroing them can take as long as writing them.
//!
//! The commit thread hands over blocks whose grace period is over ([`Zeroing::send`]);
//! each batch comes back zeroed, or with the error that stopped it, and the commit thread
//! then records and frees its blocks ([`Zeroing::take`]). A block goes back to the free
//! list only after its zeroing completed, so a block handed out reads as zeros even when
//! the record of its zeroing is not durable yet (after a crash, opening zeroes every free
//! block again). Not for the zeroing done while a pool opens: it is not running yet.

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use cairn_core::blocking::{BlockingError, BlockingQueue};
use cairn_core::{IoStatus, Switches};

use super::commit::{runs, zero_runs};
use super::error::ThinError;
use super::pool::{lock, Inner};

/// Blocks to zero: those a commit freed (recorded as zeroed once done) and all of them
/// (with those written and never mapped, which no record names).
pub(super) struct Batch {
    pub(super) freed: Vec<u64>,
    pub(super) all: Vec<u64>,
}

/// A batch done: zeroed, or not (the pool fails).
pub(super) struct Zeroed {
    pub(super) batch: Batch,
    pub(super) result: Result<(), ThinError>,
}

/// The zeroing thread as the commit thread sees it (started on its first batch).
pub(super) struct Zeroing {
    switches: Switches,
    /// Field order: the sender goes first, so that the thread sees the channel closed
    /// before it is joined.
    tx: Option<Sender<Batch>>,
    done: Arc<Mutex<Vec<Zeroed>>>,
    thread: Option<JoinHandle<()>>,
}

impl Zeroing {
    /// A zeroing thread for a pool whose queues use `switches`, not started yet.
    pub(super) fn new(switches: Switches) -> Zeroing {
        Zeroing {
            switches,
            tx: None,
            done: Arc::new(Mutex::new(Vec::new())),
            thread: None,
        }
    }

    /// Hands `batch` to the thread (starting it if needed); on return the blocks are
    /// its until [`Zeroing::take`] gives them back.
    pub(super) fn send(&mut self, inner: &Arc<Inner>, batch: Batch) -> Result<(), ThinError> {
        if self.tx.is_none() {
            let (tx, rx) = mpsc::channel();
            let (inner, done, switches) = (inner.clone(), self.done.clone(), self.switches);
            let thread = std::thread::Builder::new()
                .name(format!("thin-{}-zero", inner.name))
                .spawn(move || {
                    // SIGTERM and SIGINT are for `cairn serve`'s main thread.
                    cairn_core::reactor::block_signals_in_this_thread();
                    zero_batches(&inner, switches, &rx, &done);
                })
                .map_err(|e| {
                    let errno = e.raw_os_error().unwrap_or(libc::EAGAIN);
                    ThinError::io("starting the zeroing thread", failed(errno))
                })?;
            self.tx = Some(tx);
            self.thread = Some(thread);
        }
        let sent = self.tx.as_ref().map(|tx| tx.send(batch));
        match sent {
            Some(Ok(())) => Ok(()),
            _ => Err(ThinError::io(
                "the zeroing thread stopped",
                failed(libc::EIO),
            )),
        }
    }

    /// The batches done since the last call.
    pub(super) fn take(&self) -> Vec<Zeroed> {
        std::mem::take(&mut *lock(&self.done))
    }

    /// Waits for every batch sent to be done, stops the thread, and returns what
    /// [`Zeroing::take`] would (the pool stops).
    pub(super) fn finish(&mut self) -> Vec<Zeroed> {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.take()
    }
}

impl Drop for Zeroing {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The thread: zeroes each batch through a queue of its own on the data device, hands it
/// back and wakes the commit thread, until the channel closes.
fn zero_batches(
    inner: &Inner,
    switches: Switches,
    rx: &Receiver<Batch>,
    done: &Mutex<Vec<Zeroed>>,
) {
    let q = BlockingQueue::open(&inner.data, switches).inspect_err(|e| {
        log::error!(
            "cairn: {}: cannot open the data device to zero freed blocks: {e}",
            inner.name
        );
    });
    while let Ok(batch) = rx.recv() {
        let result = match &q {
            _ if inner.crashed.load(std::sync::atomic::Ordering::SeqCst) => Err(ThinError::Crashed),
            Ok(q) => zero_runs(q, inner, &runs(&batch.all)),
            Err(_) => Err(ThinError::io(
                "opening the data device for zeroing",
                failed(libc::EIO),
            )),
        };
        lock(done).push(Zeroed { batch, result });
        inner.kick();
    }
}

/// A device error of `errno`.
fn failed(errno: i32) -> BlockingError {
    BlockingError::Failed(IoStatus::errno(errno))
}
