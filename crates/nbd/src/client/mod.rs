//! The client side: the `nbd` device, a block device backed by any NBD server, and what
//! the rest of cairn calls to open one ([`NbdDevice::open`], its [`Options`]).
//!
//! Each reactor's queue drives its own connection(s) through the reactor's io_uring, as
//! the server side does: requests are encoded into a per-connection output queue and sent
//! with one `sendmsg` per pass (write payloads go from the submitter's buffer, no copy);
//! replies are received into an input buffer, or straight into a read's buffer when one
//! is being filled, and matched to their request by cookie. Nothing crosses to another
//! thread per request.
//!
//! A request larger than the server's maximum payload is split, and so is a trim or
//! write-zeroes range beyond 32 bits when extended headers were not negotiated; every
//! part of one request goes on the same connection. cairn's discard promises zeroes, which
//! NBD's trim does not, so a discard is sent as a write-zeroes that may punch a hole.
//!
//! Faults: a connection that fails (an error, the server closing it, a reply that breaks
//! the protocol, or no reply for `timeout`) is shut down. Requests not yet answered are
//! sent again once a connection is back: a thread reconnects with backoff, so the reactor
//! never blocks on a handshake. A request still waiting `timeout` after it was submitted
//! fails with EIO, and while every connection has been down longer than that (and none
//! was made since, by any queue of the device), new requests fail at once: a mirror over
//! a remote member then marks it failed.
//!
//! Writes acknowledged without FUA and not yet flushed are lost if the server restarts:
//! the device keeps an account of them (see `ledger`). When a connection holding such
//! writes is lost, the loss is counted, and the next flush on each queue (a flush that
//! was in flight then, sent again, included) fails with EIO, once, until whoever uses the
//! device says it made up for the loss ([`Device::lost_writes_made_up`]: an array
//! re-adding the member copies again what it may have missed); a loss of writes
//! acknowledged before that is not reported at all. An idle connection can die unnoticed
//! (it receives nothing), so each connection lost or made wakes every queue, which sends
//! a flush on each of its connections that holds such writes and was not heard from
//! since: [`Device::lost_writes`] says `Unverified` until they answer (or are found dead).
//!
//! With `nbds://` the connection starts TLS (rustls) before any option; requests are
//! encrypted into a ciphertext buffer and replies decrypted into the input buffer, on the
//! reactor like everything else.
//!
//! Block status (`Device::extents`) goes over a separate control connection, blocking:
//! it is rare (qemu-img map and convert), and keeping it off the data connections keeps
//! their replies to reads and writes alone.
//!
//! The files of this folder, in the order a request meets them:
//!
//! - this one: the device, its options, what every queue shares;
//! - [`handshake`]: connect and negotiate (blocking, once per connection);
//! - `connect`: a connection made and checked against the export the device opened, and
//!   the thread that makes connections again, with backoff;
//! - `queue/`, on a reactor: mod (the queue, its state, its connections' state,
//!   completions dispatched), then a request's path: request (taken, routed to a
//!   connection, split into NBD requests and framed; its completion), send (requests to
//!   the socket, sendmsg or TLS), recv (bytes from the socket, TLS decrypted), reply
//!   (replies parsed, simple, structured and extended; a part's completion), connection
//!   (a connection installed, given up, reset with its requests retried; flushes that
//!   verify connections holding unflushed writes);
//! - `ledger`: the device's account of writes acknowledged and perhaps lost;
//! - `block_status`: `Device::extents` over a control connection of its own;
//! - [`pull`]: not the device: chosen extents of an export (by `base:allocation` or a
//!   dirty bitmap) read with many requests in flight on one blocking connection, for
//!   `cairn backup`.

use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cairn_core::{Caps, Core, Device, Error, Extent, Geometry, Queue};

use crate::client::handshake::{self as client, Connected, Negotiated};
use crate::proto::tflags;
use crate::uri::NbdUri;

mod block_status;
mod connect;
pub mod handshake;
mod ledger;
pub mod pull;
mod queue;

use block_status::{map_extents, Stream};
use ledger::{Ledger, Unflushed};
use queue::NbdQueue;

/// How long a request may wait for its reply, or for a connection to come back, by
/// default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// The most connections one queue opens.
pub const CONNECTIONS_MAX: u32 = 16;
/// The largest read or write part sent, whatever the server allows.
const MAX_PART: u64 = 32 << 20;
/// Longest wait between reconnection attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Longest a handshake may take.
const HANDSHAKE_MAX: Duration = Duration::from_secs(10);

/// Options of an `nbd` device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Connections per queue (several only if the server can take them: multi-conn).
    pub connections: u32,
    /// How long a request may wait before it fails with EIO.
    pub timeout: Duration,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            connections: 1,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

impl Options {
    /// Refuses options out of range, before anything connects.
    fn check(&self) -> Result<(), Error> {
        if !(1..=CONNECTIONS_MAX).contains(&self.connections) {
            return Err(Error::Invalid(format!(
                "connections = {} is out of range (from 1 to {CONNECTIONS_MAX})",
                self.connections
            )));
        }
        if self.timeout < Duration::from_millis(100) {
            return Err(Error::Invalid(format!(
                "timeout {:?} is too short (at least 100ms)",
                self.timeout
            )));
        }
        Ok(())
    }
}

/// What every queue of one device shares.
struct Shared {
    name: String,
    uri: NbdUri,
    uri_text: String,
    neg: Negotiated,
    geometry: Geometry,
    connections: usize,
    timeout_ns: u64,
    /// FUA asked for but not offered: a flush follows the write.
    emulate_fua: bool,
    /// The longest read or write part: the server's maximum payload (at most
    /// `MAX_PART`) in whole blocks.
    max_part: u64,
    /// The longest trim or write-zeroes range in a compact (32-bit) header, in blocks.
    max_compact_range: u64,
    /// Negotiated connections not used by any queue (from the open, or a closed queue).
    idle: Mutex<Vec<Idle>>,
    /// Writes acknowledged and perhaps lost since.
    ledger: Ledger,
    /// The connection block status goes over.
    control: Mutex<Option<(Box<dyn Stream>, Negotiated)>>,
    control_cookie: AtomicU64,
    reconnects: AtomicU64,
}

/// A negotiated connection no queue uses, with the writes it acknowledged that no flush
/// has covered yet (a queue closed without flushing them).
struct Idle {
    made: Connected,
    unflushed: Option<Unflushed>,
}

/// A block device backed by an NBD server.
pub struct NbdDevice {
    shared: Arc<Shared>,
}

impl NbdDevice {
    /// Connects to the server `uri_text` names (libnbd's URI forms), negotiates, and
    /// keeps that connection for the first queue.
    pub fn open(name: &str, uri_text: &str, options: Options) -> Result<NbdDevice, Error> {
        let uri = NbdUri::parse(uri_text)?;
        options.check()?;
        let timeout = options.timeout.clamp(Duration::from_secs(1), HANDSHAKE_MAX);
        let first = client::connect_any(&uri, Shared::want(), timeout)
            .map_err(|e| Error::Invalid(format!("cannot connect to {uri_text}: {e}")))?;
        let neg = first.neg.clone();
        let geometry = geometry_of(name, uri_text, &neg)?;
        let (block, caps) = (u64::from(geometry.block_bytes), geometry.caps);
        let writable = neg.flags & tflags::READ_ONLY == 0;
        let multi = neg.flags & tflags::CAN_MULTI_CONN != 0;
        let connections = if options.connections > 1 && !multi {
            log::warn!(
                "cairn: {name}: {uri_text} does not allow several connections (no multi-conn): using one per queue, not {}",
                options.connections
            );
            1
        } else {
            options.connections as usize
        };
        Ok(NbdDevice {
            shared: Arc::new(Shared {
                name: name.to_string(),
                uri,
                uri_text: uri_text.to_string(),
                emulate_fua: writable && !caps.fua && caps.flush,
                max_part: u64::from(neg.max_payload).min(MAX_PART).max(block) / block * block,
                max_compact_range: u64::from(u32::MAX) / block * block,
                geometry,
                neg,
                connections,
                timeout_ns: options.timeout.as_nanos() as u64,
                idle: Mutex::new(vec![Idle {
                    made: first,
                    unflushed: None,
                }]),
                ledger: Ledger::new(),
                control: Mutex::new(None),
                control_cookie: AtomicU64::new(1),
                reconnects: AtomicU64::new(0),
            }),
        })
    }

    /// Connections lost and made again since the device was opened.
    pub fn reconnects(&self) -> u64 {
        self.shared.reconnects.load(Ordering::Relaxed)
    }

    /// What was negotiated with the server when the device was opened.
    pub fn negotiated(&self) -> &Negotiated {
        &self.shared.neg
    }
}

impl Device for NbdDevice {
    fn name(&self) -> &str {
        &self.shared.name
    }

    fn describe(&self) -> String {
        let s = &self.shared;
        let n = &s.neg;
        format!(
            "nbd {} ({}{}{}, blocks {}/{}/{}, {} connection{} per queue, timeout {:?})",
            s.uri_text,
            if s.uri.tls { "TLS, " } else { "" },
            if n.extended {
                "extended headers"
            } else if n.structured {
                "structured replies"
            } else {
                "simple replies"
            },
            if n.flags & tflags::READ_ONLY != 0 {
                ", read-only"
            } else {
                ""
            },
            n.min_block,
            n.preferred_block,
            n.max_payload,
            s.connections,
            if s.connections == 1 { "" } else { "s" },
            Duration::from_nanos(s.timeout_ns)
        )
    }

    fn geometry(&self) -> Geometry {
        self.shared.geometry
    }

    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
        NbdQueue::open(core, self.shared.clone())
    }

    fn extents(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        if !self.shared.neg.structured {
            // Without structured replies there is no block status.
            out.push(Extent::data(len));
            return Ok(());
        }
        let got = match self.control_status(offset, len) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::Unsupported => {
                out.push(Extent::data(len));
                return Ok(());
            }
            Err(e) => {
                return Err(Error::os(
                    format!(
                        "{}: block status from {}",
                        self.shared.name, self.shared.uri_text
                    ),
                    e,
                ))
            }
        };
        map_extents(&got, offset, len, self.shared.geometry.block_bytes, out);
        Ok(())
    }

    fn coherent_across_queues(&self) -> bool {
        self.shared.neg.flags & tflags::CAN_MULTI_CONN != 0
    }

    fn lost_writes(&self) -> cairn_core::LostWrites {
        self.shared.ledger.state(&self.shared.idle)
    }

    fn lost_writes_made_up(&self) {
        self.shared.ledger.made_up();
        log::info!(
            "cairn: {}: writes acknowledged until now that {} may have lost are made up for",
            self.shared.name,
            self.shared.uri_text
        );
    }
}

/// The device's geometry from what the server agreed: its size in whole blocks (of the
/// server's minimum block, at least 512 bytes; a partial block at the end is left out),
/// and what it can do (nothing that writes on a read-only export).
fn geometry_of(name: &str, uri_text: &str, neg: &Negotiated) -> Result<Geometry, Error> {
    let block = neg.min_block.max(512);
    let size_bytes = neg.size / u64::from(block) * u64::from(block);
    if size_bytes == 0 {
        return Err(Error::Invalid(format!(
            "{uri_text}: the export ({} bytes) is smaller than one {block}-byte block",
            neg.size
        )));
    }
    if size_bytes != neg.size {
        log::warn!(
            "cairn: {name}: {uri_text}: the export's last {} bytes are not a whole {block}-byte block and are left out",
            neg.size - size_bytes
        );
    }
    let f = neg.flags;
    let writable = f & tflags::READ_ONLY == 0;
    Ok(Geometry {
        size_bytes,
        block_bytes: block,
        caps: Caps {
            flush: f & tflags::SEND_FLUSH != 0,
            fua: writable && f & tflags::SEND_FUA != 0,
            discard: writable && f & tflags::SEND_WRITE_ZEROES != 0,
            write_zeroes: writable && f & tflags::SEND_WRITE_ZEROES != 0,
        },
    })
}
