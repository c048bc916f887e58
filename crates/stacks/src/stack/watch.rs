//! The members' thread of an array with metadata: a spare takes the place of each
//! member that fails ([`StackDevice::with_spares`]), and, with the `readd` option, a
//! member that failed by an I/O error is tried again and re-added once it answers, less
//! and less often while it keeps failing soon after each re-add.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;

use cairn_core::{Device, Error};

use super::{Shared, StackDevice};

/// A member re-added by `readd` that fails again within this long is flapping: the next
/// try waits twice as long as the one before.
const READD_FLAP_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);
/// Re-adds in a row that a flapping member gets before it is left failed (and the log
/// and `status` say so).
pub(super) const READD_FLAPS_MAX: u32 = 5;
/// The longest wait between two tries of a flapping member.
const READD_BACKOFF_MAX: std::time::Duration = std::time::Duration::from_secs(600);

/// The members' thread's bookkeeping of one member's automatic re-adds.
#[derive(Clone, Copy, Default)]
struct Readd {
    /// When to try it next, while it is failed.
    next_try: Option<std::time::Instant>,
    /// When it was last re-added.
    last: Option<std::time::Instant>,
    /// Re-adds in a row after which it failed again within [`READD_FLAP_WINDOW`].
    flaps: u32,
}

impl StackDevice {
    /// Gives the array (running on its superblocks) the spares its stack file lists:
    /// each must fit as a member would and be blank or this array's spare (not a member
    /// in use, nor another array's or someone's data); it gets a spare's superblock, and
    /// takes the place of the next member that fails.
    pub fn with_spares(self, spares: Vec<(Arc<dyn Device>, String)>) -> Result<StackDevice, Error> {
        if spares.is_empty() {
            return Ok(self);
        }
        let Some(meta) = self.shared.metadata.clone() else {
            return Err(Error::Invalid(format!(
                "device '{}': spares need metadata (their superblocks say whose spares they are)",
                self.shared.name
            )));
        };
        for (device, name) in &spares {
            self.shared
                .fits(device, name, meta.member_data(0))
                .and_then(|()| meta.make_spare(device, name))
                .map_err(|e| {
                    let what = if e.names_device() {
                        format!("spare {e}")
                    } else {
                        format!("spare '{name}': {e}")
                    };
                    Error::Invalid(format!("device '{}': {what}", self.shared.name))
                })?;
        }
        if !meta.dry() {
            let names: Vec<&str> = spares.iter().map(|(_, n)| n.as_str()).collect();
            log::info!(
                "cairn: {}: spares {}: each takes the place of the next member that fails",
                self.shared.name,
                names.join(", ")
            );
        }
        self.shared
            .spares
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(spares);
        if !meta.dry() {
            self.shared.watch_members();
        }
        Ok(self)
    }
}

impl Shared {
    /// Starts the thread that puts spares in the place of failed members and re-adds
    /// members that answer again, unless it runs.
    pub(super) fn watch_members(self: &Arc<Self>) {
        let mut watcher = self.watcher.lock().unwrap_or_else(|p| p.into_inner());
        if watcher.is_some() {
            return;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (me, halt) = (self.clone(), stop.clone());
        match std::thread::Builder::new()
            .name(format!("cairn-members-{}", self.name))
            .spawn(move || me.watch_until(&halt))
        {
            Ok(handle) => *watcher = Some((stop, handle)),
            Err(e) => log::error!(
                "cairn: {}: cannot start the members' thread (spares stay unused, no member is re-added but by the admin): {e}",
                self.name
            ),
        }
    }

    /// Puts a spare in the place of each member that fails (and of each missing one),
    /// and, with `readd`, tries members that failed by an I/O error again, until `stop`.
    fn watch_until(self: Arc<Self>, stop: &AtomicBool) {
        cairn_core::reactor::block_signals_in_this_thread();
        let mut seen = u64::MAX;
        let mut readds = vec![Readd::default(); self.health.n];
        while !stop.load(SeqCst) {
            {
                let count = self
                    .health
                    .failures
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                let (count, _) = self
                    .health
                    .failed_now
                    .wait_timeout_while(count, std::time::Duration::from_millis(200), |c| {
                        *c == seen && !stop.load(SeqCst)
                    })
                    .unwrap_or_else(|p| p.into_inner());
                seen = *count;
            }
            let Some(meta) = self.metadata.as_ref().filter(|m| !m.dry()) else {
                return;
            };
            let changing = self.changing.lock().unwrap_or_else(|p| p.into_inner());
            while !stop.load(SeqCst) {
                let Some(m) = self.free_slot(meta) else { break };
                let spare = {
                    let mut spares = self.spares.lock().unwrap_or_else(|p| p.into_inner());
                    if spares.is_empty() {
                        break;
                    }
                    spares.remove(0)
                };
                let _seq = self.health.changing();
                if let Err(e) = self.add_device(meta, m, spare.0, &spare.1) {
                    log::warn!("cairn: {}: spare '{}' not used: {e}", self.name, spare.1);
                } else {
                    log::info!("cairn: {}: {}", self.name, self.members_line());
                }
            }
            drop(changing);
            if let Some(every) = self.options.readd {
                self.readd_due(meta, every, &mut readds);
            }
        }
    }

    /// Tries again each member that failed by an I/O error (not by the admin) once its
    /// time has come; re-adds it if its device answers with its superblock. A member that
    /// fails again soon after a re-add is tried after twice the wait each time, and left
    /// failed after [`READD_FLAPS_MAX`] such re-adds in a row.
    fn readd_due(
        self: &Arc<Self>,
        meta: &crate::array::Metadata,
        every: std::time::Duration,
        readds: &mut [Readd],
    ) {
        use crate::array::superblock::MemberState;
        let states = meta.states();
        let n = self.health.n;
        let now = std::time::Instant::now();
        for (m, r) in readds.iter_mut().enumerate().take(n) {
            let being_replaced = self.health.being_replaced(m);
            if self.health.ok(m)
                || states[m] != MemberState::Failed
                || self.by_admin[m].load(Relaxed)
                || self.given_up[m].load(Relaxed)
                || being_replaced
            {
                r.next_try = None;
                if self.health.ok(m) && r.last.is_some_and(|t| t.elapsed() >= READD_FLAP_WINDOW) {
                    // In use for a while since its re-add: not flapping.
                    r.flaps = 0;
                    r.last = None;
                }
                continue;
            }
            let member = self.health.name(m);
            match r.next_try {
                None => self.schedule_readd(m, &member, every, now, r),
                // Its device is read first without holding up admin actions (a remote
                // one may take its timeout to answer).
                Some(t) if t <= now => self.try_readd(meta, m, &member, every, now, r),
                Some(_) => {}
            }
        }
    }

    /// Failed member `m` (named `member`) is to be tried again: sets when, counting a
    /// failure soon after its last re-add as a flap (after [`READD_FLAPS_MAX`] in a row it
    /// is left failed).
    fn schedule_readd(
        &self,
        m: usize,
        member: &str,
        every: std::time::Duration,
        now: std::time::Instant,
        r: &mut Readd,
    ) {
        let soon = r.last.is_some_and(|t| t.elapsed() < READD_FLAP_WINDOW);
        r.flaps = if soon { r.flaps + 1 } else { 0 };
        if r.flaps >= READD_FLAPS_MAX {
            self.given_up[m].store(true, Relaxed);
            log::warn!(
                "cairn: {}: member {member} failed again within {READD_FLAP_WINDOW:?} of each of {} re-adds in a row: \
                 it is no longer re-added on its own (re-add it by hand once it is fixed: re-add {} {member})",
                self.name, r.flaps, self.name
            );
            r.last = None;
            return;
        }
        let wait = every
            .saturating_mul(1 << r.flaps.min(16))
            .min(READD_BACKOFF_MAX.max(every));
        if r.flaps == 0 {
            log::info!(
                "cairn: {}: member {member} will be tried again every {every:?}, and re-added once it answers",
                self.name
            );
        } else {
            log::warn!(
                "cairn: {}: member {member} failed again {:?} after it was re-added: next try in {wait:?} ({} of {READD_FLAPS_MAX} re-adds in a row)",
                self.name,
                r.last.map(|t| t.elapsed()).unwrap_or_default(),
                r.flaps
            );
        }
        r.next_try = Some(now + wait);
    }

    /// Tries failed member `m` (named `member`) now: re-adds it if its device answers
    /// with its superblock, else sets its next try.
    fn try_readd(
        self: &Arc<Self>,
        meta: &crate::array::Metadata,
        m: usize,
        member: &str,
        every: std::time::Duration,
        now: std::time::Instant,
        r: &mut Readd,
    ) {
        match meta.probe_member(m).and_then(|()| {
            let _changing = self.changing.lock().unwrap_or_else(|p| p.into_inner());
            if self.health.ok(m) {
                return Err(crate::Error::TakenBack);
            }
            let _seq = self.health.changing();
            self.take_back(meta, m)
        }) {
            Ok(how) => {
                log::info!(
                    "cairn: {}: member {member} answers again: re-added; {how}",
                    self.name
                );
                r.next_try = None;
                r.last = Some(std::time::Instant::now());
            }
            Err(e) => {
                log::debug!("cairn: {}: member {member} not re-added: {e}", self.name);
                let wait = every
                    .saturating_mul(1 << r.flaps.min(16))
                    .min(READD_BACKOFF_MAX.max(every));
                r.next_try = Some(now + wait);
            }
        }
    }
}
