//! [`StackDevice`], the stacked device, and [`Shared`], its state shared with its
//! control threads: building it from members and a layout, its `Device` impl (queues,
//! extents), its `Array` impl (what it reports) and `ArrayAdmin` impl (the admin's
//! actions), and its clean stop when dropped.
//!
//! The superblocks and the control threads they start are in `metadata`, changes of
//! members in `members` and `watch`, the status text in `status`, the I/O path in
//! `queue`, `submit` and `complete`.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;

use cairn_core::slab::Slab;
use cairn_core::{
    Array, Caps, Core, Device, Error, FlushBatcher, Geometry, Offer, Queue, QueueStats, SinkId,
    Want,
};

use super::health::{Gate, Health};
use super::metadata::{Thread, Threads};
use super::queue::{State, PARENTS};
use super::{AnyLayout, ArrayOptions, Layout, StackQueue, MISSING};
use crate::array::{ArrayAction, ArrayAdmin};

/// A device made of other devices.
pub struct StackDevice {
    pub(super) shared: Arc<Shared>,
}

impl std::ops::Deref for StackDevice {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.shared
    }
}

/// A stacked device's state, shared with its control threads (rebuild, bitmap, spares).
pub struct Shared {
    pub(super) name: String,
    pub(super) layout: Arc<AnyLayout>,
    pub(super) health: Arc<Health>,
    pub(super) geometry: Geometry,
    /// Where data starts on every member (after the metadata area, if any).
    pub(super) data_offset: u64,
    /// The superblocks, for an array that keeps them (its queues record failures in
    /// them).
    pub(super) metadata: Option<Arc<crate::array::Metadata>>,
    /// The array's rebuild rate and bitmap settings.
    pub(super) options: ArrayOptions,
    /// The rebuild thread and the thread that clears idle bitmap bits, while they run.
    pub(super) threads: std::sync::Mutex<Threads>,
    /// Held by every change of members (admin actions, the end of a replace).
    pub(super) changing: std::sync::Mutex<()>,
    /// Devices waiting to take the place of a member that fails, and their names.
    pub(super) spares: std::sync::Mutex<Vec<(Arc<dyn Device>, String)>>,
    /// The thread that puts them there, while there are spares, and re-adds members
    /// that answer again (`readd`).
    pub(super) watcher: std::sync::Mutex<Option<Thread>>,
    /// Per member: failed by the admin (never re-added but by the admin).
    pub(super) by_admin: Vec<AtomicBool>,
    /// The specs of the devices opened while it runs (`add`, `replace`), by name.
    pub(super) added: std::sync::Mutex<Vec<(String, String)>>,
    /// Per member: failed again soon after each of [`READD_FLAPS_MAX`] re-adds, so no
    /// longer re-added but by the admin.
    ///
    /// [`READD_FLAPS_MAX`]: super::watch::READD_FLAPS_MAX
    pub(super) given_up: Vec<AtomicBool>,
}

impl StackDevice {
    /// Stacks `members` with `layout` (the layout was built from the members' sizes).
    pub fn new(
        name: &str,
        layout: Arc<AnyLayout>,
        members: Vec<Arc<dyn Device>>,
    ) -> Result<StackDevice, Error> {
        if members.is_empty() {
            return Err(Error::Invalid(format!(
                "{name}: a {} needs members",
                layout.kind()
            )));
        }
        let block_bytes = members
            .iter()
            .map(|m| m.geometry().block_bytes)
            .max()
            .unwrap_or(512);
        let mut caps = Caps::ALL;
        for m in &members {
            let c = m.geometry().caps;
            caps.flush &= c.flush;
            caps.fua &= c.fua;
            caps.discard &= c.discard;
            caps.write_zeroes &= c.write_zeroes;
        }
        let size_bytes = layout.size_bytes() / u64::from(block_bytes) * u64::from(block_bytes);
        if size_bytes == 0 {
            return Err(Error::Invalid(format!(
                "{name}: members too small for a {}",
                layout.kind()
            )));
        }
        let n = members.len();
        let health = Arc::new(Health::new(name, members));
        if layout.copies() > 1 {
            cairn_core::stats::registry().add_repairs(name, &health.repairs.counters);
        }
        Ok(StackDevice {
            shared: Arc::new(Shared {
                name: name.into(),
                geometry: Geometry {
                    size_bytes,
                    block_bytes,
                    caps,
                },
                layout,
                health,
                data_offset: 0,
                metadata: None,
                options: ArrayOptions::default(),
                threads: std::sync::Mutex::new(Threads::default()),
                changing: std::sync::Mutex::new(()),
                spares: std::sync::Mutex::new(Vec::new()),
                watcher: std::sync::Mutex::new(None),
                by_admin: (0..n).map(|_| AtomicBool::new(false)).collect(),
                added: std::sync::Mutex::new(Vec::new()),
                given_up: (0..n).map(|_| AtomicBool::new(false)).collect(),
            }),
        })
    }
}

impl Shared {
    /// The layout's member devices now.
    fn members(&self) -> Vec<Arc<dyn Device>> {
        self.health
            .devices()
            .into_iter()
            .take(self.health.n)
            .flatten()
            .collect()
    }
}

impl Drop for StackDevice {
    fn drop(&mut self) {
        // Every queue is gone (they hold the device's members, not the device), so no
        // write is in flight: the array stops clean, with the members that failed
        // recorded as failed (a repair that fails one records it first).
        self.health.repairs.stop();
        if let Some((stop, handle)) = self
            .watcher
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            stop.store(true, SeqCst);
            self.health.failed_event();
            let _ = handle.join();
        }
        self.threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stop();
        if let Some(meta) = &self.metadata {
            let failed: Vec<bool> = (0..self.health.n).map(|m| !self.health.ok(m)).collect();
            // How far the copies agree: where this run's resync got (its threads are
            // stopped), or where the last one had got if none ran.
            let sync = &self.health.sync;
            let resynced = if sync.resync.load(Relaxed) {
                sync.synced_below.load(Relaxed)
            } else {
                0
            };
            meta.stop(&failed, resynced.max(meta.resync_from()));
        }
    }
}

impl Device for StackDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn describe(&self) -> String {
        let mut out = format!(
            "{} of {} members, {} ({} bytes)",
            self.layout.kind(),
            self.health.n,
            self.layout.describe(),
            self.geometry.size_bytes
        );
        if let Some(meta) = &self.metadata {
            use crate::array::superblock::MemberState;
            out += &format!(", metadata 1, data at {}", self.data_offset);
            let not_read: Vec<String> = meta
                .states()
                .iter()
                .enumerate()
                .filter(|(m, _)| !self.health.readable(*m))
                .map(|(m, s)| {
                    let state = match s {
                        MemberState::Active if !self.health.ok(m) => "failed",
                        s => s.name(),
                    };
                    format!("{} {state}", self.health.name(m))
                })
                .collect();
            if !not_read.is_empty() {
                out += &format!(", degraded: {}", not_read.join(", "));
            }
        }
        let r = self.health.repairs.counters.snapshot();
        if r.repaired + r.failed > 0 {
            out += &format!(
                ", read repairs: {} rewritten, {} failed",
                r.repaired, r.failed
            );
        }
        out
    }

    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
        let slots = 2 * self.health.n;
        let queue = Rc::new(StackQueue {
            core: core.clone(),
            targets: std::cell::UnsafeCell::new(Vec::new()),
            stats: QueueStats::named(core.switches().stats, self.name()),
            layout: self.layout.clone(),
            n: self.health.n,
            opened: RefCell::new((0..slots).map(|_| None).collect()),
            retired: RefCell::new(Vec::new()),
            fallback: RefCell::new(None),
            shadows: RefCell::new(vec![false; self.health.n]),
            replacing: Cell::new(false),
            gated: self.layout.copies() > 1 && self.metadata.as_ref().is_some_and(|m| !m.dry()),
            gate_writes: self.layout.copies() > 1,
            epoch: Cell::new(u64::MAX),
            read_gate: Cell::new(0),
            read_epoch: Cell::new(0),
            reads_held: [Cell::new(0), Cell::new(0)],
            gate: Arc::new(Gate::default()),
            health: self.health.clone(),
            sink: Cell::new(SinkId(u32::MAX)),
            state: RefCell::new(State {
                parents: Slab::with_capacity(PARENTS),
                children: Slab::with_capacity(PARENTS * 2),
                lone: Slab::with_capacity(PARENTS),
                reads: Slab::with_capacity(PARENTS),
            }),
            next_copy: Cell::new(0),
            flushes: FlushBatcher::new(core.switches().flush),
            copies: self.layout.copies(),
            remap: Cell::new(None),
            data_offset: self.data_offset,
            metadata: self.metadata.clone(),
            bitmap: self.health.bitmap.clone(),
        });
        queue.refresh(self.health.epoch.load(SeqCst), true)?;
        self.health
            .gates
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::downgrade(&queue.gate));
        queue.sink.set(core.register_sink(queue.clone()));
        Ok(queue)
    }

    fn children(&self) -> Vec<Arc<dyn Device>> {
        self.members()
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        out: &mut Vec<cairn_core::Extent>,
    ) -> Result<(), Error> {
        // Piece by piece from the first healthy copy; stop early on a long map (callers
        // ask again from where it ends).
        const MAX_EXTENTS: usize = 4096;
        let end = offset + len;
        let mut at = offset;
        let mut piece = Vec::new();
        let members = self.members();
        while at < end && out.len() < MAX_EXTENTS {
            let n = self.layout.piece_len(at, end - at);
            let copy = (0..self.layout.copies())
                .find(|&k| self.health.readable(self.layout.locate(at, k).0))
                .unwrap_or(0);
            let (member, member_offset) = self.layout.locate(at, copy);
            piece.clear();
            members[member].extents(member_offset + self.data_offset, n, &mut piece)?;
            let mut got = 0;
            for e in &piece {
                let l = e.len.min(n - got);
                cairn_core::Extent::push(out, cairn_core::Extent { len: l, ..*e });
                got += l;
                if got == n {
                    break;
                }
            }
            if got < n {
                // The member stopped early: so do we.
                break;
            }
            at += n;
        }
        Ok(())
    }

    fn offer(self: Arc<Self>, want: Want) -> Option<Offer> {
        want.offer::<dyn Array>(|| self.clone())
            .or_else(|| want.offer::<dyn ArrayAdmin>(|| self))
    }
}

impl Array for StackDevice {
    fn redundant(&self) -> bool {
        self.layout.copies() > 1
    }

    fn sync_progress(&self) -> Option<(u64, u64)> {
        self.metadata.as_ref()?;
        let sync = &self.health.sync;
        sync.running().then(|| {
            (
                sync.done_bytes.load(Relaxed),
                sync.total_bytes.load(Relaxed),
            )
        })
    }

    fn status(&self) -> Option<String> {
        use cairn_core::size::format_bytes;
        let meta = self.metadata.as_ref()?;
        let states = meta.states();
        let (flags, members) = self.member_states(&states);
        let degraded = flags.contains('_');
        let mut out = format!(
            "{}: {} of {} members, {}, metadata 1 {}{}\n    [{flags}] {}\n",
            self.name,
            self.layout.kind(),
            self.health.n,
            format_bytes(self.geometry.size_bytes),
            meta.uuid_text(),
            if degraded { ", degraded" } else { "" },
            members.join(", ")
        );
        out += &self.sync_line();
        out += &self.spares_line();
        out += &self.bitmap_line();
        out += &self.repairs_line();
        Some(out)
    }

    fn report(&self) -> Option<cairn_core::ArrayReport> {
        let meta = self.metadata.as_ref()?;
        let states = meta.states();
        let members = self.member_report(&states);
        let repairs = &self.health.repairs;
        let r = repairs.counters.snapshot();
        Some(cairn_core::ArrayReport {
            level: self.layout.kind(),
            size_bytes: self.geometry.size_bytes,
            uuid: meta.uuid_text(),
            metadata: 1,
            events: meta.events(),
            copies: self.layout.copies(),
            degraded: (0..self.health.n).any(|m| !self.health.readable(m)),
            unclean: self
                .health
                .one_copy
                .load(std::sync::atomic::Ordering::Relaxed),
            members,
            sync: self.sync_report(),
            spares: self.spare_names(),
            bitmap: self
                .health
                .bitmap
                .as_ref()
                .map(|b| (b.region_bytes(), b.regions() as u64, b.dirty_count() as u64)),
            read_repairs: (
                r.repaired,
                r.repaired_bytes,
                r.failed,
                repairs.pending_count() as u64,
            ),
        })
    }

    fn change_seq(&self) -> u64 {
        self.health.changes.load(SeqCst)
    }

    fn members_now(&self) -> Option<Vec<(String, Option<String>)>> {
        use crate::array::superblock::MemberState;
        // Only arrays with metadata change members.
        let states = self.metadata.as_ref().filter(|m| !m.dry())?.states();
        let added = self.added.lock().unwrap_or_else(|p| p.into_inner());
        Some(
            (0..self.health.n)
                .map(|m| {
                    if states[m] == MemberState::Missing {
                        return (MISSING.to_string(), None);
                    }
                    let name = self.health.name(m);
                    let spec = added
                        .iter()
                        .find(|(n, _)| *n == name)
                        .map(|(_, s)| s.clone());
                    (name, spec)
                })
                .collect(),
        )
    }

    fn spares_now(&self) -> Option<Vec<(String, Option<String>)>> {
        self.metadata.as_ref().filter(|m| !m.dry())?;
        let added = self.added.lock().unwrap_or_else(|p| p.into_inner());
        let spares = self.spares.lock().unwrap_or_else(|p| p.into_inner());
        Some(
            spares
                .iter()
                .map(|(_, name)| {
                    let spec = added
                        .iter()
                        .find(|(n, _)| n == name)
                        .map(|(_, s)| s.clone());
                    (name.clone(), spec)
                })
                .collect(),
        )
    }

    fn failed_members(&self) -> Vec<String> {
        (0..self.health.n)
            .filter(|&m| !self.health.ok(m))
            .map(|m| self.health.name(m))
            .collect()
    }
}

impl ArrayAdmin for StackDevice {
    fn act(&self, action: &ArrayAction) -> Result<String, crate::Error> {
        let name = &self.name;
        let Some(meta) = self.metadata.as_ref().filter(|m| !m.dry()) else {
            return Err(crate::Error::NoMetadata {
                array: name.clone(),
                action: action.name(),
            });
        };
        if self.layout.copies() < 2 {
            return Err(crate::Error::NotRedundant {
                array: name.clone(),
                level: self.layout.kind(),
            });
        }
        // One change of members at a time.
        let _changing = self.changing.lock().unwrap_or_else(|p| p.into_inner());
        let _seq = self.health.changing();
        match action {
            ArrayAction::Fail { member } => self.fail(meta, member),
            ArrayAction::Remove { member } => self.shared.remove(meta, member),
            ArrayAction::Add { spec } => self.shared.add(meta, spec),
            ArrayAction::ReAdd { member } => self.shared.readd(meta, member),
            ArrayAction::Replace { old, spec } => self.shared.replace(meta, old, spec),
        }
    }
}
