//! Writes acknowledged and perhaps lost: the device's [`Ledger`] of writes acknowledged
//! without FUA that no flush has covered yet, and what each queue publishes for it (its
//! [`Watch`]). The queue's side (publishing, and the flushes that verify its connections
//! after a turnover) is in `queue/connection.rs`.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::Idle;

/// Writes a connection acknowledged that no flush has covered yet.
#[derive(Clone, Copy)]
pub(super) struct Unflushed {
    /// The [`Ledger`] era when the newest was acknowledged.
    pub(super) era: u64,
    /// The ledger's turnover when the connection was last heard from.
    pub(super) heard: u64,
}

/// The device's account of the writes it acknowledged that its server may not hold.
///
/// A write acknowledged without FUA is durable once a flush covers it. If the connection
/// it went on is lost first, the server may have restarted and lost it: that is a loss
/// (`losses`), reported by the next flush on each queue until the device's user makes up
/// for it (`made_up`). A make-up also starts a new `era`: a loss found later of writes
/// all acknowledged in an earlier era is made up for already, and not counted.
///
/// A connection dies unnoticed while it is idle (nothing is received on it), so a flush
/// that succeeds on one connection says nothing of writes acknowledged on another that
/// may talk to a server that is gone. `turnover` counts the connections lost and made
/// (but the device's first); each queue publishes in its [`Watch`] the oldest turnover at
/// which one of its connections holding unflushed writes was last heard from (a reply to
/// a request sent at that turnover or later). Such a connection not heard from since the
/// current turnover is unverified: the server may have restarted under it. Every turnover
/// wakes every queue, which sends a flush on each of those connections: it makes their
/// writes durable, or finds the connection dead (a loss).
///
/// The queue's side costs no atomic read-modify-write: it reads `era` and `turnover`
/// once per pass that sends anything, and stores to its own watch when what it
/// publishes changes.
pub(super) struct Ledger {
    pub(super) turnover: AtomicU64,
    /// Connections made (but the first): a server that answers again.
    pub(super) connects: AtomicU64,
    pub(super) era: AtomicU64,
    pub(super) losses: AtomicU64,
    pub(super) made_up: AtomicU64,
    /// Every open queue's watch.
    pub(super) watches: Mutex<Vec<Arc<Watch>>>,
}

/// What one queue publishes for the [`Ledger`]: on a cache line of its own, stored by the
/// queue, read by other threads.
#[repr(align(64))]
pub(super) struct Watch {
    /// 0 while no connection of the queue holds unflushed writes; else 1 + the oldest
    /// turnover at which one that does was last heard from.
    pub(super) unflushed: AtomicU64,
    /// Wakes the queue's reactor.
    pub(super) wake: Arc<OwnedFd>,
}

impl Ledger {
    pub(super) fn new() -> Ledger {
        Ledger {
            turnover: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            era: AtomicU64::new(0),
            losses: AtomicU64::new(0),
            made_up: AtomicU64::new(0),
            watches: Mutex::new(Vec::new()),
        }
    }

    /// A connection was lost or made: every queue looks at its connections.
    pub(super) fn turn(&self) {
        self.turnover.fetch_add(1, Ordering::SeqCst);
        let watches = self.watches.lock().unwrap_or_else(|e| e.into_inner());
        for w in watches.iter() {
            cairn_core::event::wake(&*w.wake);
        }
    }

    /// Records the loss of a connection holding unflushed writes, the newest
    /// acknowledged in era `era`: whether it counts (it was not made up for already).
    pub(super) fn lost(&self, era: u64) -> bool {
        if era < self.era.load(Ordering::SeqCst) {
            return false;
        }
        self.losses.fetch_add(1, Ordering::SeqCst);
        true
    }

    pub(super) fn state(&self, idle: &Mutex<Vec<Idle>>) -> cairn_core::LostWrites {
        if self.losses.load(Ordering::SeqCst) > self.made_up.load(Ordering::SeqCst) {
            return cairn_core::LostWrites::Lost;
        }
        let t = self.turnover.load(Ordering::SeqCst);
        let queues = self
            .watches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|w| matches!(w.unflushed.load(Ordering::Acquire), v if v != 0 && v - 1 < t));
        let pooled = idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|i| i.unflushed.is_some_and(|u| u.heard < t));
        if queues || pooled {
            cairn_core::LostWrites::Unverified
        } else {
            cairn_core::LostWrites::None
        }
    }

    pub(super) fn made_up(&self) {
        // The era first: a loss found from now on of writes acknowledged before is not
        // counted; one counted before is in `losses` when it is read.
        self.era.fetch_add(1, Ordering::SeqCst);
        let l = self.losses.load(Ordering::SeqCst);
        self.made_up.fetch_max(l, Ordering::SeqCst);
    }
}
