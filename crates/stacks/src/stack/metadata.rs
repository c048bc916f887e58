//! An array on its superblocks: [`StackDevice::with_metadata`] sets each member's health
//! from the state its superblocks record, and starts the control threads (the rebuild or
//! resync, and the thread that clears idle bitmap bits), which a change of members stops
//! and starts again.
//!
//! The rebuild itself is in `rebuild`; the superblocks and the bitmap are `crate::array`'s.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;

use super::{rebuild, ArrayOptions, Layout, Shared, StackDevice};

/// A control thread's stop flag and handle.
pub(super) type Thread = (Arc<AtomicBool>, std::thread::JoinHandle<()>);

#[derive(Default)]
pub(super) struct Threads {
    rebuild: Option<Thread>,
    bitmap: Option<Thread>,
}

impl Threads {
    /// Stops and joins both.
    pub(super) fn stop(&mut self) {
        for (stop, handle) in [self.rebuild.take(), self.bitmap.take()]
            .into_iter()
            .flatten()
        {
            stop.store(true, SeqCst);
            let _ = handle.join();
        }
    }
}

impl StackDevice {
    /// Runs the array on its superblocks: data starts after the metadata area; members
    /// that are missing are neither written nor read, and members that are not current
    /// (rebuilding, stale, new) are written but not read.
    pub fn with_metadata(
        mut self,
        metadata: crate::array::Metadata,
        options: ArrayOptions,
    ) -> StackDevice {
        use crate::array::superblock::MemberState;
        let Some(shared) = Arc::get_mut(&mut self.shared) else {
            unreachable!("a stacked device is shared only once it runs");
        };
        if let Some(health) = Arc::get_mut(&mut shared.health) {
            // No queue exists yet: the health is this device's alone.
            health.bitmap = metadata.bitmap().cloned();
        }
        for (m, state) in metadata.states().into_iter().enumerate() {
            let (ok, readable) = match state {
                MemberState::Active => (true, true),
                MemberState::Rebuilding => (true, false),
                MemberState::Failed | MemberState::Missing => (false, false),
            };
            shared.health.failed[m].store(!ok, Relaxed);
            shared.health.readable[m].store(readable, Relaxed);
            if state == MemberState::Rebuilding {
                let partial = metadata.partial(m) && shared.health.bitmap.is_some();
                shared.health.partial[m].store(partial, Relaxed);
                // Current below its checkpoint (for a partial recovery, below it every
                // dirty region was copied).
                if !partial {
                    shared.health.below[m].store(metadata.recovery_offset(m), Relaxed);
                }
            }
        }
        shared
            .health
            .one_copy
            .store(metadata.resync_pending(), Relaxed);
        shared.data_offset = metadata.data_offset();
        shared.options = options;
        // A member failed by a superblock write (the metadata logs it) is out of reads and
        // writes at once, as one failed by a data write is.
        let health = Arc::downgrade(&shared.health);
        metadata.set_on_fail(Box::new(move |m| {
            if let Some(h) = health.upgrade() {
                h.mark_failed(m);
            }
        }));
        let metadata = Arc::new(metadata);
        shared.metadata = Some(metadata.clone());
        if !metadata.dry() {
            let threads = self.shared.start_threads();
            *self.threads.lock().unwrap_or_else(|p| p.into_inner()) = threads;
            if options.readd.is_some() && self.layout.copies() > 1 {
                self.shared.watch_members();
            }
        }
        self
    }
}

impl Shared {
    /// Starts the rebuild thread if there is anything to rebuild, resync or replace, and
    /// the thread that clears idle bitmap bits if the array keeps a bitmap.
    fn start_threads(self: &Arc<Self>) -> Threads {
        let mut threads = Threads::default();
        let Some(metadata) = &self.metadata else {
            return threads;
        };
        if rebuild::needed(&self.health, &metadata.states()) {
            // Counting starts before the rebuild copies anything, and every write sent
            // before it started has ended (a switch that changes nothing), so the rebuild
            // sees every write that could overlap a copy.
            self.health.sync.on_now();
            self.health.switch(|_, _| {});
            let stop = Arc::new(AtomicBool::new(false));
            let job = rebuild::Job {
                name: self.name.clone(),
                layout: self.layout.clone(),
                health: self.health.clone(),
                metadata: metadata.clone(),
                data_offset: self.data_offset,
                stop: stop.clone(),
                rate: self.options,
            };
            match std::thread::Builder::new()
                .name(format!("cairn-sync-{}", self.name))
                .spawn(move || rebuild::run(job))
            {
                Ok(handle) => threads.rebuild = Some((stop, handle)),
                Err(e) => {
                    self.health.sync.off();
                    log::error!("cairn: {}: cannot start the rebuild: {e}", self.name)
                }
            }
        }
        if self.health.bitmap.is_some() {
            let stop = Arc::new(AtomicBool::new(false));
            let job = rebuild::Clearing {
                health: self.health.clone(),
                metadata: metadata.clone(),
                stop: stop.clone(),
                delay: self.options.bitmap_delay,
            };
            match std::thread::Builder::new()
                .name(format!("cairn-bitmap-{}", self.name))
                .spawn(move || rebuild::clear_bits(job))
            {
                Ok(handle) => threads.bitmap = Some((stop, handle)),
                Err(e) => log::error!(
                    "cairn: {}: cannot start the bitmap's thread (its bits stay set): {e}",
                    self.name
                ),
            }
        }
        threads
    }

    /// Stops the control threads, runs `change`, and starts them again on the members
    /// as they are then (a rebuild resumes from its checkpoint).
    pub(super) fn with_threads_stopped<T>(self: &Arc<Self>, change: impl FnOnce() -> T) -> T {
        let mut threads = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        threads.stop();
        let out = change();
        *threads = self.start_threads();
        out
    }
}
