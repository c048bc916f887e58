//! Connections made: dialled and negotiated (see [`handshake`](super::handshake)), and
//! checked to talk to the export the device was opened on; the thread that makes them
//! again for a queue, waiting longer after each failure, so that the reactor never blocks
//! on a handshake.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::time::Duration;

use crate::client::handshake::{self as client, Connected, HandshakeError, Negotiated, Want};
use crate::proto::tflags;

use super::{Shared, BACKOFF_MAX, HANDSHAKE_MAX};

impl Shared {
    pub(super) fn want() -> Want {
        Want {
            extended: true,
            structured: true,
            allocation: false,
        }
    }

    pub(super) fn handshake_timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns).clamp(Duration::from_secs(1), HANDSHAKE_MAX)
    }

    /// Whether a connection made later talks to the same export the device was opened on.
    pub(super) fn compatible(&self, n: &Negotiated) -> Result<(), String> {
        let need = self.neg.flags
            & (tflags::READ_ONLY
                | tflags::SEND_FLUSH
                | tflags::SEND_FUA
                | tflags::SEND_WRITE_ZEROES);
        if n.size != self.neg.size {
            return Err(format!(
                "the export is now {} bytes, not {}",
                n.size, self.neg.size
            ));
        }
        if n.flags & need != need {
            return Err(format!(
                "the export's flags changed from {:#x} to {:#x}",
                self.neg.flags, n.flags
            ));
        }
        if n.min_block > self.neg.min_block.max(512) {
            return Err(format!(
                "the export's minimum block grew to {}",
                n.min_block
            ));
        }
        Ok(())
    }

    pub(super) fn connect(&self) -> Result<Connected, HandshakeError> {
        let c = client::connect_any(&self.uri, Shared::want(), self.handshake_timeout())?;
        self.compatible(&c.neg).map_err(HandshakeError::Refused)?;
        self.ledger.connects.fetch_add(1, Ordering::SeqCst);
        self.ledger.turn();
        Ok(c)
    }
}

/// From the connector thread.
pub(super) enum Made {
    /// A connection, negotiated and checked.
    Conn(Connected),
    /// The thread is done.
    Done,
}

/// The reconnecting thread: makes `missing` connections, waiting `delay` (then doubling
/// up to `BACKOFF_MAX`) between failed attempts, until the queue is gone.
pub(super) fn connector(
    shared: &Shared,
    missing: usize,
    first_delay: Duration,
    tx: &Sender<Made>,
    wake: &OwnedFd,
    stop: &AtomicBool,
) {
    let mut delay = first_delay;
    let mut made = 0;
    let mut failures = 0u32;
    // After a failed attempt: the ledger's count of connections made then (another
    // queue reaching the server ends the wait).
    let mut answered: Option<u64> = None;
    while made < missing && !stop.load(Ordering::Relaxed) {
        if !delay.is_zero() {
            // Sleep in short steps so a closed queue is noticed.
            let until = std::time::Instant::now() + delay;
            while std::time::Instant::now() < until && !stop.load(Ordering::Relaxed) {
                if answered.is_some_and(|n| n != shared.ledger.connects.load(Ordering::SeqCst)) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20).min(delay));
            }
        }
        match shared.connect() {
            Ok(c) => {
                if tx.send(Made::Conn(c)).is_err() {
                    return;
                }
                cairn_core::event::wake(wake);
                made += 1;
                delay = Duration::ZERO;
                failures = 0;
                answered = None;
            }
            Err(e) => {
                failures += 1;
                answered = Some(shared.ledger.connects.load(Ordering::SeqCst));
                if failures == 1 || failures.is_power_of_two() {
                    log::warn!(
                        "cairn: {}: reconnecting to {}: {e} (attempt {failures})",
                        shared.name,
                        shared.uri_text
                    );
                }
                delay = (delay * 2).clamp(Duration::from_millis(50), BACKOFF_MAX);
            }
        }
    }
    let _ = tx.send(Made::Done);
    cairn_core::event::wake(wake);
}
