//! Which members of a stacked device have failed and which may be read ([`Health`]),
//! shared by the device and every queue: a member's failure (logged once, and the array
//! runs degraded), and the switch to a new set of member devices, which waits until no
//! request sent to the old set is in flight ([`Gate`]).
//!
//! Not here: what fails a member (a queue's completions in `complete`, the admin in
//! `members`), nor how one comes back (`rebuild`, `members`, `watch`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;

use cairn_core::{Device, IoStatus};

use super::{rebuild, repair};

/// Which members have failed, and which may be read; shared by every queue of the device.
///
/// Members are indexed `0..n` as the layout places them; index `n + m` is the replacement
/// being built for member `m` (`replace`), written with every write to `m` and never read.
/// Per-member vectors have `2 * n` entries.
pub(super) struct Health {
    pub(super) device: String,
    /// The layout's members.
    pub(super) n: usize,
    pub(super) names: std::sync::Mutex<Vec<String>>,
    pub(super) failed: Vec<AtomicBool>,
    /// Holds current data (a member being rebuilt, stale or new is written, not read).
    pub(super) readable: Vec<AtomicBool>,
    /// The copies may differ (the array was not stopped cleanly and is not resynced):
    /// every read goes to the first readable copy, so a block never reads two ways.
    pub(super) one_copy: AtomicBool,
    /// Writes are counted per region while a rebuild runs (see [`rebuild`]).
    pub(super) sync: rebuild::WriteCounts,
    /// Per member not readable: member offsets below this are current (rebuilt so far).
    pub(super) below: Vec<AtomicU64>,
    /// Per member: recovered from the bitmap, so current outside its regions to recover.
    pub(super) partial: Vec<AtomicBool>,
    /// The write-intent bitmap, if the array keeps one.
    pub(super) bitmap: Option<Arc<crate::array::bitmap::Bitmap>>,
    /// The member devices (`None`: missing, removed, or no replacement), changed only by
    /// [`Health::switch`]; queues follow at their next request.
    pub(super) devices: std::sync::Mutex<Vec<Option<Arc<dyn Device>>>>,
    /// Bumped by every change of `devices`.
    pub(super) epoch: AtomicU64,
    /// Members failed so far, and a wake-up for the spares' thread at each.
    pub(super) failures: std::sync::Mutex<u64>,
    pub(super) failed_now: std::sync::Condvar,
    /// Every queue's count of requests in flight, by epoch parity.
    pub(super) gates: std::sync::Mutex<Vec<std::sync::Weak<Gate>>>,
    /// Held by [`Health::switch`]: one at a time (control threads only).
    pub(super) switching: std::sync::Mutex<()>,
    /// Read repairs (redundant layouts).
    pub(super) repairs: repair::Repairs,
    /// Bumped when a change of members begins and when it ends (see
    /// [`Device::change_seq`]).
    pub(super) changes: AtomicU64,
}

/// A change of members in progress ([`Health::changing`]); ends when dropped.
pub(super) struct Changing<'a>(&'a AtomicU64);

impl Drop for Changing<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, SeqCst);
    }
}

/// A queue's requests in flight, counted by the parity of the epoch they were sent under:
/// once a switch sees the old parity's count at zero, every request any queue sends goes
/// to the new set of members, and no reply from an old one can come any more. An array
/// whose members can change counts every request (a queue's reads sent whole to one copy
/// under one count while any is in flight, see `StackQueue::enter_gate_read`); any other
/// redundant one counts its
/// changes of data, so that read repair can wait for those sent before it started
/// counting them per region (see [`repair`]).
#[derive(Default)]
pub(super) struct Gate {
    pub(super) writes: [AtomicU64; 2],
}

impl Health {
    /// The health of a device made of `members`: each takes writes and may be read, and
    /// no replacement is being built.
    pub(super) fn new(name: &str, members: Vec<Arc<dyn Device>>) -> Health {
        let n = members.len();
        let slots = 2 * n;
        let mut names: Vec<String> = members.iter().map(|m| m.name().to_string()).collect();
        names.resize(slots, String::new());
        let mut devices: Vec<Option<Arc<dyn Device>>> = members.into_iter().map(Some).collect();
        devices.resize(slots, None);
        Health {
            device: name.into(),
            n,
            names: std::sync::Mutex::new(names),
            // No replacement is being built: those indices are failed.
            failed: (0..slots).map(|i| AtomicBool::new(i >= n)).collect(),
            readable: (0..slots).map(|i| AtomicBool::new(i < n)).collect(),
            one_copy: AtomicBool::new(false),
            sync: rebuild::WriteCounts::new(),
            below: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            partial: (0..slots).map(|_| AtomicBool::new(false)).collect(),
            bitmap: None,
            devices: std::sync::Mutex::new(devices),
            epoch: AtomicU64::new(0),
            failures: std::sync::Mutex::new(0),
            failed_now: std::sync::Condvar::new(),
            gates: std::sync::Mutex::new(Vec::new()),
            switching: std::sync::Mutex::new(()),
            repairs: repair::Repairs::new(n),
            changes: AtomicU64::new(0),
        }
    }

    /// Takes writes and flushes.
    #[inline]
    pub(super) fn ok(&self, member: usize) -> bool {
        !self.failed[member].load(Relaxed)
    }

    /// May be read.
    #[inline]
    pub(super) fn readable(&self, member: usize) -> bool {
        self.readable[member].load(Relaxed)
    }

    /// May be read anywhere, as reads go now: current, and the array not resyncing after
    /// an unclean stop (reads then all go to the first readable copy, see
    /// [`Health::one_copy_at`]). Where this holds, the first copy `healthy_copy` would
    /// try is the one on `member`.
    #[inline(always)]
    pub(super) fn may_read(&self, member: usize) -> bool {
        !self.one_copy.load(Relaxed) && self.readable(member)
    }

    /// May be read for `len` bytes at member offset `at` (data area), which hold array
    /// offset `logical` on (one piece): a member being rebuilt is current below its
    /// progress, and one recovered from the bitmap outside the regions that were dirty.
    #[inline]
    pub(super) fn readable_at(&self, member: usize, logical: u64, at: u64, len: u64) -> bool {
        self.readable(member) || (self.ok(member) && self.current_at(member, logical, at, len))
    }

    #[cold]
    fn current_at(&self, member: usize, logical: u64, at: u64, len: u64) -> bool {
        at + len <= self.below[member].load(Relaxed)
            || (self.partial[member].load(Relaxed)
                && self
                    .bitmap
                    .as_ref()
                    .is_some_and(|b| b.regions_of(logical, len).all(|r| !b.to_recover(r))))
    }

    /// Whether a read of `len` bytes at `logical` must go to the first readable copy: the
    /// array was not stopped cleanly, the resync has not passed the read's end yet, and
    /// (with a bitmap) a region it touches was dirty.
    #[inline]
    pub(super) fn one_copy_at(&self, logical: u64, len: u64) -> bool {
        self.one_copy.load(Relaxed)
            && logical + len > self.sync.synced_below.load(Relaxed)
            && self
                .bitmap
                .as_ref()
                .is_none_or(|b| b.regions_of(logical, len).any(|r| b.to_recover(r)))
    }

    /// Marks a change of members as running until the guard drops, for readers of
    /// [`Device::change_seq`].
    pub(super) fn changing(&self) -> Changing<'_> {
        self.changes.fetch_add(1, SeqCst);
        Changing(&self.changes)
    }

    /// Takes `member` out of reads and writes; whether it was in use until now.
    pub(super) fn mark_failed(&self, member: usize) -> bool {
        self.readable[member].store(false, Relaxed);
        let newly = !self.failed[member].swap(true, Relaxed);
        if newly {
            self.failed_event();
        }
        newly
    }

    pub(super) fn fail(&self, member: usize, status: IoStatus) {
        if self.mark_failed(member) {
            if member >= self.n {
                log::warn!(
                    "cairn: {}: replacement '{}' for '{}' failed ({status}); the replace is abandoned",
                    self.device,
                    self.name(member),
                    self.name(member - self.n)
                );
            } else {
                log::warn!(
                    "cairn: {}: member '{}' failed ({status}); running degraded",
                    self.device,
                    self.name(member)
                );
            }
        }
    }

    /// Wakes the spares' thread: a member failed.
    #[cold]
    pub(super) fn failed_event(&self) {
        *self.failures.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.failed_now.notify_all();
    }

    /// Member `m`'s name.
    pub(super) fn name(&self, m: usize) -> String {
        let names = self.names.lock().unwrap_or_else(|p| p.into_inner());
        names.get(m).cloned().unwrap_or_default()
    }

    /// The member devices now (`0..n`, then the replacements).
    pub(super) fn devices(&self) -> Vec<Option<Arc<dyn Device>>> {
        self.devices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether a replacement is being built for member `m`.
    fn replacing(&self, m: usize) -> bool {
        self.devices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(self.n + m)
            .is_some_and(Option::is_some)
    }

    /// Whether a working replacement is being built for member `m`.
    pub(super) fn being_replaced(&self, m: usize) -> bool {
        self.replacing(m) && self.ok(self.n + m)
    }

    /// Changes the member devices: `change` edits them and their names; queues follow at
    /// their next request. Returns once no change of data sent to the old set is in
    /// flight, so that from then on every write reaches the new set (a write never
    /// misses a member being rebuilt). With no change, it waits for every change of data
    /// sent before it was called. Switches run one at a time (two at once would wait for
    /// each other's parity); callers never hold the metadata's lock (a write waiting for
    /// its bitmap bit would wait for it).
    pub(super) fn switch(
        &self,
        change: impl FnOnce(&mut Vec<Option<Arc<dyn Device>>>, &mut Vec<String>),
    ) {
        let _one = self.switching.lock().unwrap_or_else(|p| p.into_inner());
        let old = {
            let mut devices = self.devices.lock().unwrap_or_else(|p| p.into_inner());
            let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
            change(&mut devices, &mut names);
            self.epoch.fetch_add(1, SeqCst)
        };
        let parity = (old & 1) as usize;
        let began = std::time::Instant::now();
        let mut told = false;
        loop {
            let busy = {
                let mut gates = self.gates.lock().unwrap_or_else(|p| p.into_inner());
                gates.retain(|g| g.strong_count() > 0);
                gates
                    .iter()
                    .filter_map(std::sync::Weak::upgrade)
                    .any(|g| g.writes[parity].load(SeqCst) != 0)
            };
            if !busy {
                return;
            }
            if !told && began.elapsed() > std::time::Duration::from_secs(5) {
                log::warn!(
                    "cairn: {}: waiting for writes sent earlier to end (before a change of members or the first read repair)",
                    self.device
                );
                told = true;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}
