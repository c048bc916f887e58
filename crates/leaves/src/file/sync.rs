//! The sync engine: plain `pread`/`pwrite`/`fdatasync` on the reactor thread.
//!
//! Each request blocks the reactor for its duration, so this engine suits slow paths and
//! comparisons, not throughput. Completions still go through the reactor's FIFO.

use std::rc::Rc;
use std::sync::Arc;

use cairn_core::{Core, Io, Queue, QueueStats};

use super::{do_sync, FileShared};

/// One file's queue doing blocking system calls.
pub struct SyncQueue {
    core: Rc<Core>,
    stats: QueueStats,
    shared: Arc<FileShared>,
}

impl SyncQueue {
    /// Opens a queue on `core`.
    pub fn open(core: &Rc<Core>, shared: Arc<FileShared>) -> Rc<dyn Queue> {
        Rc::new(SyncQueue {
            core: core.clone(),
            stats: QueueStats::leaf(core.switches().stats),
            shared,
        })
    }
}

impl Queue for SyncQueue {
    fn submit(&self, io: Io) {
        let start = self.stats.begin(io.flags, || self.core.now_ns());
        let status = do_sync(&self.shared, &io);
        self.stats
            .finish(&io, start, || self.core.now_ns(), status.is_ok());
        self.core.complete(io.sink, io.token, status);
    }

    fn stats(&self) -> &QueueStats {
        &self.stats
    }
}
