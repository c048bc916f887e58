//! What a crypt device counts, for `status` and the metrics: the requests and bytes it
//! encrypted and decrypted, the time its reactors spent in the cipher, and its key slots'
//! events. Not its latencies or errors: every device's queue statistics have those.
//!
//! Each queue counts in a block of its own with one writer (its reactor): a plain relaxed
//! load and store per counter, no locked instruction, as the queue statistics do. The
//! device keeps the blocks and sums them when asked, from the admin's or the metrics'
//! thread. The cipher's time is not read around every request (a clock read per I/O is
//! what the hot path must not do): one cipher call in [`TIME_EVERY`] is timed, and the
//! calls between are charged at the rate per byte that call measured.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// One cipher call in this many is timed.
pub const TIME_EVERY: u32 = 64;

/// What a crypt device counted since it opened (see [`CryptStats::counts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CryptCounts {
    /// Write, write-zeroes and discard requests whose data it encrypted.
    pub encrypted_requests: u64,
    /// Bytes it encrypted (write-zeroes and discard: the zeros it wrote in their place).
    pub encrypted_bytes: u64,
    /// Reads whose data it decrypted.
    pub decrypted_requests: u64,
    /// Bytes it decrypted.
    pub decrypted_bytes: u64,
    /// Nanoseconds its reactors spent in the cipher, estimated (see the module's doc).
    pub cipher_ns: u64,
    /// Key slots opened with a passphrase: at the device's open (a raw volume key opens
    /// none).
    pub key_slot_opens: u64,
    /// Key slots added since it opened (the admin's `crypt add`).
    pub key_slots_added: u64,
    /// Key slots removed since it opened (`crypt remove`).
    pub key_slots_removed: u64,
}

/// A crypt device's counters, as the admin and the metrics see them: a capability of
/// the crypt device.
pub trait CryptStats: Send + Sync {
    /// What it counted so far, over all its queues.
    fn counts(&self) -> CryptCounts;
}

/// The counters of one queue, in the order of [`CryptCounts`]'s first five fields.
#[derive(Debug, Default)]
pub(super) struct QueueCounters([AtomicU64; 5]);

const ENC_REQUESTS: usize = 0;
const ENC_BYTES: usize = 1;
const DEC_REQUESTS: usize = 2;
const DEC_BYTES: usize = 3;
const CIPHER_NS: usize = 4;

impl QueueCounters {
    /// Adds `v` to counter `i`. Only the queue's reactor writes, so a load and a store
    /// lose nothing.
    fn add(&self, i: usize, v: u64) {
        let c = &self.0[i];
        c.store(c.load(Relaxed).wrapping_add(v), Relaxed);
    }

    fn load(&self) -> [u64; 5] {
        std::array::from_fn(|i| self.0[i].load(Relaxed))
    }
}

/// A device's counters: its queues' blocks, what closed queues counted, and the key
/// slots' events.
#[derive(Debug, Default)]
pub(super) struct Ledger {
    /// The blocks of open queues, and the sums of those whose queue has closed (folded
    /// in when the next queue opens, so that the list stays as long as the queues open).
    queues: Mutex<(Vec<Arc<QueueCounters>>, [u64; 5])>,
    key_slot_opens: AtomicU64,
    key_slots_added: AtomicU64,
    key_slots_removed: AtomicU64,
}

/// A key slot event, for [`Ledger::slot_event`].
#[derive(Debug, Clone, Copy)]
pub(super) enum SlotEvent {
    Opened,
    Added,
    Removed,
}

impl Ledger {
    /// A block for a new queue.
    pub(super) fn open_queue(&self) -> Arc<QueueCounters> {
        let mut q = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        let (list, closed) = &mut *q;
        // A block only this list holds belongs to a queue gone: its counts move to the
        // sums, so that reopening queues never grows the list.
        list.retain(|b| {
            if Arc::strong_count(b) > 1 {
                return true;
            }
            for (sum, v) in closed.iter_mut().zip(b.load()) {
                *sum = sum.wrapping_add(v);
            }
            false
        });
        let block = Arc::new(QueueCounters::default());
        list.push(block.clone());
        block
    }

    pub(super) fn slot_event(&self, e: SlotEvent) {
        let c = match e {
            SlotEvent::Opened => &self.key_slot_opens,
            SlotEvent::Added => &self.key_slots_added,
            SlotEvent::Removed => &self.key_slots_removed,
        };
        c.fetch_add(1, Relaxed);
    }

    pub(super) fn counts(&self) -> CryptCounts {
        let q = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        let (list, closed) = &*q;
        let mut sum = *closed;
        for b in list {
            for (s, v) in sum.iter_mut().zip(b.load()) {
                *s = s.wrapping_add(v);
            }
        }
        CryptCounts {
            encrypted_requests: sum[ENC_REQUESTS],
            encrypted_bytes: sum[ENC_BYTES],
            decrypted_requests: sum[DEC_REQUESTS],
            decrypted_bytes: sum[DEC_BYTES],
            cipher_ns: sum[CIPHER_NS],
            key_slot_opens: self.key_slot_opens.load(Relaxed),
            key_slots_added: self.key_slots_added.load(Relaxed),
            key_slots_removed: self.key_slots_removed.load(Relaxed),
        }
    }
}

/// A queue's side of the counting: its block, and the sampling of the cipher's time.
pub(super) struct Tally {
    block: Arc<QueueCounters>,
    /// Cipher calls so far (wrapping), to pick the timed ones.
    calls: Cell<u32>,
    /// The cipher's time per byte at the last timed call, in picoseconds.
    ps_per_byte: Cell<u64>,
}

impl Tally {
    pub(super) fn new(block: Arc<QueueCounters>) -> Tally {
        Tally {
            block,
            calls: Cell::new(0),
            ps_per_byte: Cell::new(0),
        }
    }

    /// Runs `cipher` over `bytes` bytes and counts them, and `requests` requests (0 for a
    /// later piece of one), encrypted or decrypted. The first call and one in
    /// [`TIME_EVERY`] after are timed; the others are charged at the last rate measured.
    pub(super) fn cipher(&self, encrypt: bool, requests: u64, bytes: u64, cipher: impl FnOnce()) {
        let n = self.calls.get();
        self.calls.set(n.wrapping_add(1));
        let ns = if n.is_multiple_of(TIME_EVERY) {
            let start = cairn_core::clock::monotonic_ns();
            cipher();
            let ns = cairn_core::clock::monotonic_ns().saturating_sub(start);
            if let Some(rate) = ns.saturating_mul(1000).checked_div(bytes) {
                self.ps_per_byte.set(rate);
            }
            ns
        } else {
            cipher();
            bytes.saturating_mul(self.ps_per_byte.get()) / 1000
        };
        let (r, b) = if encrypt {
            (ENC_REQUESTS, ENC_BYTES)
        } else {
            (DEC_REQUESTS, DEC_BYTES)
        };
        self.block.add(r, requests);
        self.block.add(b, bytes);
        self.block.add(CIPHER_NS, ns);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_queues_keep_their_counts_and_leave_the_list() {
        let ledger = Ledger::default();
        let a = Tally::new(ledger.open_queue());
        a.cipher(true, 1, 4096, || {});
        a.cipher(false, 1, 512, || {});
        a.cipher(true, 0, 4096, || {});
        drop(a);
        for _ in 0..10 {
            let b = Tally::new(ledger.open_queue());
            b.cipher(false, 1, 1024, || {});
        }
        assert_eq!(ledger.queues.lock().unwrap().0.len(), 1);
        ledger.slot_event(SlotEvent::Opened);
        let c = ledger.counts();
        assert_eq!(
            (c.encrypted_requests, c.encrypted_bytes),
            (1, 8192),
            "{c:?}"
        );
        assert_eq!(
            (c.decrypted_requests, c.decrypted_bytes),
            (11, 512 + 10 * 1024),
            "{c:?}"
        );
        assert_eq!(
            (c.key_slot_opens, c.key_slots_added, c.key_slots_removed),
            (1, 0, 0)
        );
    }

    /// Calls between the timed ones are charged at the timed one's rate: a cipher that
    /// takes time shows some, whichever call was timed.
    #[test]
    fn untimed_calls_are_charged_at_the_last_rate() {
        let ledger = Ledger::default();
        let t = Tally::new(ledger.open_queue());
        let spin = || {
            let start = cairn_core::clock::monotonic_ns();
            while cairn_core::clock::monotonic_ns() - start < 100_000 {}
        };
        t.cipher(true, 1, 1000, spin);
        let timed = ledger.counts().cipher_ns;
        assert!(timed >= 100_000, "{timed}");
        t.cipher(true, 1, 1000, || {});
        let after = ledger.counts().cipher_ns;
        assert!(after >= 2 * 100_000 - 1, "{timed} then {after}");
    }
}
