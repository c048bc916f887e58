//! The `nbd` device: a block device backed by an NBD server.
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
//! the device keeps an account of them ([`Ledger`]). When a connection holding such writes
//! is lost, the loss is counted, and the next flush on each queue (a flush that was in
//! flight then, sent again, included) fails with EIO, once, until whoever uses the device
//! says it made up for the loss ([`Device::lost_writes_made_up`]: an array re-adding the
//! member copies again what it may have missed); a loss of writes acknowledged before
//! that is not reported at all. An idle connection can die unnoticed (it receives
//! nothing), so each connection lost or made wakes every queue, which sends a flush on
//! each of its connections that holds such writes and was not heard from since:
//! [`Device::lost_writes`] says `Unverified` until they answer (or are found dead).
//!
//! With `nbds://` the connection starts TLS (rustls) before any option; requests are
//! encrypted into a ciphertext buffer and replies decrypted into the input buffer, on the
//! reactor like everything else.
//!
//! Block status (`Device::extents`) goes over a separate control connection, blocking:
//! it is rare (qemu-img map and convert), and keeping it off the data connections keeps
//! their replies to reads and writes alone.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use io_uring::{opcode, types};

use cairn_core::{
    Caps, Core, Device, Error, Extent, Geometry, Io, IoFlags, IoStatus, Op, Poller, Queue,
    QueueStats, RingUser, Sink, SinkId,
};

use crate::client::handshake::{self as client, Connected, HandshakeError, Negotiated, Want};
use crate::gather::{self, Segment};
use crate::proto::{self, chunk, cmd, tflags};
use crate::uri::NbdUri;

/// How long a request may wait for its reply, or for a connection to come back, by
/// default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// The most connections one queue opens.
pub const CONNECTIONS_MAX: u32 = 16;
/// Requests a queue accepts before it parks more in a FIFO.
const QUEUE_DEPTH: usize = 256;
/// NBD requests in flight per queue (a split request takes one per part).
const MAX_REQS: usize = 1024;
/// The largest read or write part sent, whatever the server allows.
const MAX_PART: u64 = 32 << 20;
/// Input buffer per connection.
const INBUF: usize = 256 << 10;
/// Largest chunk payload (other than read data) accepted; beyond it the server is broken.
const MAX_SMALL: u64 = 64 << 10;
/// Read data still to come from which it is received straight into the read's buffer.
const DIRECT_MIN: usize = 64 << 10;
/// iovecs per `sendmsg`.
const IOV_BATCH: usize = 64;
/// Longest wait between reconnection attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Longest a handshake may take.
const HANDSHAKE_MAX: Duration = Duration::from_secs(10);

const RECV: u64 = 1;
const SEND: u64 = 2;
const NONE: u32 = u32::MAX;
const NO_CONN: u16 = u16::MAX;

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

/// Writes a connection acknowledged that no flush has covered yet.
#[derive(Clone, Copy)]
struct Unflushed {
    /// The [`Ledger`] era when the newest was acknowledged.
    era: u64,
    /// The ledger's turnover when the connection was last heard from.
    heard: u64,
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
struct Ledger {
    turnover: AtomicU64,
    /// Connections made (but the first): a server that answers again.
    connects: AtomicU64,
    era: AtomicU64,
    losses: AtomicU64,
    made_up: AtomicU64,
    /// Every open queue's watch.
    watches: Mutex<Vec<Arc<Watch>>>,
}

/// What one queue publishes for the [`Ledger`]: on a cache line of its own, stored by the
/// queue, read by other threads.
#[repr(align(64))]
struct Watch {
    /// 0 while no connection of the queue holds unflushed writes; else 1 + the oldest
    /// turnover at which one that does was last heard from.
    unflushed: AtomicU64,
    /// Wakes the queue's reactor.
    wake: Arc<OwnedFd>,
}

impl Ledger {
    fn new() -> Ledger {
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
    fn turn(&self) {
        self.turnover.fetch_add(1, Ordering::SeqCst);
        let watches = self.watches.lock().unwrap_or_else(|e| e.into_inner());
        for w in watches.iter() {
            cairn_core::event::wake(&*w.wake);
        }
    }

    /// Records the loss of a connection holding unflushed writes, the newest
    /// acknowledged in era `era`: whether it counts (it was not made up for already).
    fn lost(&self, era: u64) -> bool {
        if era < self.era.load(Ordering::SeqCst) {
            return false;
        }
        self.losses.fetch_add(1, Ordering::SeqCst);
        true
    }

    fn state(&self, idle: &Mutex<Vec<Idle>>) -> cairn_core::LostWrites {
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

    fn made_up(&self) {
        // The era first: a loss found from now on of writes acknowledged before is not
        // counted; one counted before is in `losses` when it is read.
        self.era.fetch_add(1, Ordering::SeqCst);
        let l = self.losses.load(Ordering::SeqCst);
        self.made_up.fetch_max(l, Ordering::SeqCst);
    }
}

impl Shared {
    fn want() -> Want {
        Want {
            extended: true,
            structured: true,
            allocation: false,
        }
    }

    fn handshake_timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns).clamp(Duration::from_secs(1), HANDSHAKE_MAX)
    }

    /// Whether a connection made later talks to the same export the device was opened on.
    fn compatible(&self, n: &Negotiated) -> Result<(), String> {
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

    fn connect(&self) -> Result<Connected, HandshakeError> {
        let c = client::connect_any(&self.uri, Shared::want(), self.handshake_timeout())?;
        self.compatible(&c.neg).map_err(HandshakeError::Refused)?;
        self.ledger.connects.fetch_add(1, Ordering::SeqCst);
        self.ledger.turn();
        Ok(c)
    }
}

/// A block device backed by an NBD server.
pub struct NbdDevice {
    shared: Arc<Shared>,
}

impl NbdDevice {
    /// Connects to the server `uri_text` names (libnbd's URI forms), negotiates, and
    /// keeps that connection for the first queue.
    pub fn open(name: &str, uri_text: &str, options: Options) -> Result<NbdDevice, Error> {
        let uri = NbdUri::parse(uri_text).map_err(Error::Invalid)?;
        if !(1..=CONNECTIONS_MAX).contains(&options.connections) {
            return Err(Error::Invalid(format!(
                "connections = {} is out of range (from 1 to {CONNECTIONS_MAX})",
                options.connections
            )));
        }
        if options.timeout < Duration::from_millis(100) {
            return Err(Error::Invalid(format!(
                "timeout {:?} is too short (at least 100ms)",
                options.timeout
            )));
        }
        let timeout = options.timeout.clamp(Duration::from_secs(1), HANDSHAKE_MAX);
        let first = client::connect_any(&uri, Shared::want(), timeout)
            .map_err(|e| Error::Invalid(format!("cannot connect to {uri_text}: {e}")))?;
        let neg = first.neg.clone();
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
        let caps = Caps {
            flush: f & tflags::SEND_FLUSH != 0,
            fua: writable && f & tflags::SEND_FUA != 0,
            discard: writable && f & tflags::SEND_WRITE_ZEROES != 0,
            write_zeroes: writable && f & tflags::SEND_WRITE_ZEROES != 0,
        };
        let multi = f & tflags::CAN_MULTI_CONN != 0;
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
                max_part: u64::from(neg.max_payload)
                    .min(MAX_PART)
                    .max(u64::from(block))
                    / u64::from(block)
                    * u64::from(block),
                max_compact_range: u64::from(u32::MAX) / u64::from(block) * u64::from(block),
                geometry: Geometry {
                    size_bytes,
                    block_bytes: block,
                    caps,
                },
                neg: neg.clone(),
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

    fn control_status(&self, offset: u64, len: u64) -> std::io::Result<Vec<(u64, u32)>> {
        let s = &self.shared;
        let mut control = s.control.lock().unwrap_or_else(|e| e.into_inner());
        if control.is_none() {
            let want = Want {
                allocation: true,
                ..Shared::want()
            };
            let c = client::connect_any(&s.uri, want, s.handshake_timeout())
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            let file = File::from(c.fd);
            set_socket_timeout(&file, Duration::from_nanos(s.timeout_ns))?;
            let stream: Box<dyn Stream> = match c.tls {
                Some(tls) => Box::new(rustls::StreamOwned::new(*tls, file)),
                None => Box::new(file),
            };
            *control = Some((stream, c.neg));
        }
        let Some((file, n)) = control.as_mut() else {
            return Err(std::io::Error::other("no control connection"));
        };
        let cookie = s.control_cookie.fetch_add(1, Ordering::Relaxed);
        let r = client::block_status(file, n, cookie, offset, len);
        if r.as_ref().is_err_and(|e| e.raw_os_error().is_none()) {
            // The stream is in an unknown state: start again next time.
            *control = None;
        }
        r
    }
}

/// The control connection: a socket, or TLS over one.
trait Stream: std::io::Read + std::io::Write + Send {}
impl<T: std::io::Read + std::io::Write + Send> Stream for T {}

/// Read and write timeouts on a blocking socket.
fn set_socket_timeout(file: &File, d: Duration) -> std::io::Result<()> {
    use rustix::net::sockopt::{set_socket_timeout, Timeout};
    // Zero is no timeout, as for setsockopt itself.
    let d = (!d.is_zero()).then_some(d);
    for which in [Timeout::Recv, Timeout::Send] {
        set_socket_timeout(file, which, d)?;
    }
    Ok(())
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

/// Turns a server's extents (length, state flags) into cairn's for `[offset, offset +
/// len)`: clipped to the range, and never claiming a hole or zeroes for a partial block
/// (such an edge is reported as data).
pub fn map_extents(got: &[(u64, u32)], offset: u64, len: u64, block: u32, out: &mut Vec<Extent>) {
    let block = u64::from(block);
    let end = offset + len;
    let mut pos = offset;
    for &(elen, flags) in got {
        if pos >= end || elen == 0 {
            break;
        }
        let e = (pos + elen).min(end);
        let hole = flags & proto::state::HOLE != 0;
        let zero = flags & proto::state::ZERO != 0;
        if !hole && !zero {
            Extent::push(out, Extent::data(e - pos));
        } else {
            let a = pos.next_multiple_of(block).min(e);
            let b = if e == end { e } else { e / block * block };
            if b > a {
                Extent::push(out, Extent::data(a - pos));
                Extent::push(
                    out,
                    Extent {
                        len: b - a,
                        hole,
                        zero,
                    },
                );
                Extent::push(out, Extent::data(e - b));
            } else {
                Extent::push(out, Extent::data(e - pos));
            }
        }
        pos = e;
    }
    if pos == offset {
        // A server that said nothing useful: all data is never wrong.
        Extent::push(out, Extent::data(len));
    }
}

/// A request as the queue tracks it.
#[derive(Clone, Copy)]
struct IoSlot {
    io: Io,
    /// When it was submitted (statistics and the timeout).
    start_ns: u64,
    /// The connection its parts go to, or `NO_CONN`.
    conn: u16,
    /// Bytes of the range issued so far.
    next: u64,
    /// A flush part is still to be sent (FUA emulated, or the request is a flush).
    tail_flush: bool,
    /// Parts sent and not yet answered.
    outstanding: u32,
    /// First error a part met (0: none).
    error: i32,
    /// The server broke the protocol answering it: it fails when its connection is reset.
    poisoned: bool,
    /// A flush of the queue's own, checking that connection `conn` is still there.
    internal: bool,
    in_use: bool,
}

impl IoSlot {
    fn issued_all(&self) -> bool {
        self.next >= range_of(&self.io) && !self.tail_flush
    }
}

/// One NBD request in flight (a part of an `IoSlot`).
#[derive(Clone, Copy)]
struct Req {
    slot: u32,
    conn: u16,
    command: u16,
    offset: u64,
    len: u64,
    /// Read bytes the replies accounted for (data and holes).
    covered: u64,
    /// For a flush: the connection's acknowledged writes when it was sent.
    covers: u64,
    /// The ledger's turnover as the queue knew it when it was sent (its reply proves the
    /// connection alive at that turnover or later).
    turnover: u64,
    gen: u16,
    in_use: bool,
}

/// A request header waiting to be sent, and its write payload.
struct Out {
    head: [u8; proto::EXTENDED_HEADER],
    head_len: u8,
    data: *const u8,
    data_len: u32,
    /// The request it is (its `Req`).
    req: u32,
}

impl gather::Segment for Out {
    fn head(&self) -> &[u8] {
        &self.head[..usize::from(self.head_len)]
    }

    fn data(&self) -> &[u8] {
        if self.data_len == 0 {
            return &[];
        }
        // SAFETY: a write's payload, which its submitter keeps until the completion
        // (after the reply, so after it is sent).
        unsafe { std::slice::from_raw_parts(self.data, self.data_len as usize) }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Link {
    /// Negotiated and serving.
    Up,
    /// Shut down; waiting for its receive and send to finish before it is reset.
    Dying,
    /// No socket.
    Down,
}

/// Where received bytes go next.
#[derive(Clone, Copy)]
enum Rx {
    /// Reply headers, into the input buffer.
    Header,
    /// Read data for `req`: `left` bytes to `dst`; `done`: the chunk ends the reply.
    Data {
        req: u32,
        dst: *mut u8,
        left: usize,
        done: bool,
    },
}

struct Conn {
    link: Link,
    fd: Option<OwnedFd>,
    extended: bool,
    /// Requests whose parts go out on this connection, in order.
    ready: VecDeque<u32>,
    out: VecDeque<Out>,
    out_sent: usize,
    iov: Vec<libc::iovec>,
    msg: libc::msghdr,
    send_armed: bool,
    recv_armed: bool,
    recv_direct: bool,
    inbuf: Box<[u8]>,
    rs: usize,
    re: usize,
    rx: Rx,
    /// NBD requests sent (or queued to send) and not yet answered.
    outstanding: u32,
    /// When a reply last arrived, or the first request was sent after a quiet spell.
    progress_ns: u64,
    /// Writes acknowledged without FUA, and how many of them a finished flush covers.
    acked_writes: u64,
    flushed_writes: u64,
    /// The ledger's era when the newest write was acknowledged, and its turnover when the
    /// connection was last heard from.
    unflushed_era: u64,
    heard: u64,
    /// A flush of the queue's own is checking it.
    verifying: bool,
    dirty: bool,
    why: &'static str,
    /// The TLS session and its ciphertext buffers (`nbds://`).
    tls: Option<Box<ClientTls>>,
}

/// Ciphertext received per `recv` on a TLS connection.
const RAW_IN: usize = 64 << 10;
/// Requests encrypted for one send on a TLS connection stop once this much is waiting.
const RAW_OUT_MAX: usize = 4 << 20;

/// A TLS connection's ciphertext around its rustls session: requests are encrypted into
/// `raw_out` and sent from there; what arrives in `raw_in` is decrypted into the input
/// buffer (never straight into a read's buffer).
struct ClientTls {
    conn: Box<rustls::ClientConnection>,
    raw_in: Box<[u8]>,
    /// Received ciphertext not yet given to rustls: `raw_in[raw_pos..raw_len]`.
    raw_pos: usize,
    raw_len: usize,
    raw_out: Vec<u8>,
    raw_sent: usize,
}

impl Conn {
    fn new() -> Conn {
        Conn {
            link: Link::Down,
            fd: None,
            extended: false,
            ready: VecDeque::with_capacity(QUEUE_DEPTH),
            out: VecDeque::with_capacity(MAX_REQS),
            out_sent: 0,
            iov: Vec::with_capacity(IOV_BATCH),
            // SAFETY: msghdr is plain data; all-zero is a valid empty header.
            msg: unsafe { std::mem::zeroed() },
            send_armed: false,
            recv_armed: false,
            recv_direct: false,
            inbuf: vec![0u8; INBUF].into_boxed_slice(),
            rs: 0,
            re: 0,
            rx: Rx::Header,
            outstanding: 0,
            progress_ns: 0,
            acked_writes: 0,
            flushed_writes: 0,
            unflushed_era: 0,
            heard: 0,
            verifying: false,
            dirty: false,
            why: "",
            tls: None,
        }
    }

    /// Holds writes acknowledged that no flush has covered yet.
    fn owes(&self) -> bool {
        self.link != Link::Down && self.acked_writes > self.flushed_writes
    }

    fn quiet(&self) -> bool {
        !self.send_armed && !self.recv_armed
    }
}

struct State {
    conns: Vec<Conn>,
    ios: Vec<IoSlot>,
    free_ios: Vec<u32>,
    /// Requests beyond the queue depth, waiting for a slot.
    overflow: VecDeque<(Io, u64)>,
    reqs: Vec<Req>,
    free_reqs: Vec<u32>,
    /// Requests waiting for a connection.
    parked: VecDeque<u32>,
    dirty: Vec<u16>,
    spare: Vec<u16>,
    tick_armed: bool,
    connecting: bool,
    /// Every connection down since (`None`: at least one is up), and the ledger's count of
    /// connections made then.
    down_since: Option<u64>,
    down_connects: u64,
    /// The ledger's losses this queue has reported (a flush failed after them).
    reported: u64,
    /// The ledger's era and turnover as last read.
    era: u64,
    turnover: u64,
    /// What the queue last stored in its watch.
    published: u64,
    /// Delay before the next reconnection attempt.
    backoff: Duration,
    /// When a connection was last made again.
    connected_ns: u64,
}

/// From the connector thread.
enum Made {
    /// A connection, negotiated and checked.
    Conn(Connected),
    /// The thread is done.
    Done,
}

/// One device's queue on one reactor.
pub struct NbdQueue {
    core: Rc<Core>,
    shared: Arc<Shared>,
    stats: QueueStats,
    user: Cell<u16>,
    sink: Cell<SinkId>,
    wake: Arc<OwnedFd>,
    tx: Sender<Made>,
    rx: Receiver<Made>,
    stop: Arc<AtomicBool>,
    watch: Arc<Watch>,
    st: RefCell<State>,
}

/// The token of the queue's own flushes (timers use 0).
const VERIFY: u64 = 1;

impl NbdQueue {
    fn open(core: &Rc<Core>, shared: Arc<Shared>) -> Result<Rc<dyn Queue>, Error> {
        let (tx, rx) = channel();
        let idle = QUEUE_DEPTH as u32;
        let wake = cairn_core::event::eventfd("nbd reconnect")?;
        let watch = Arc::new(Watch {
            unflushed: AtomicU64::new(0),
            wake: wake.clone(),
        });
        let q = Rc::new(NbdQueue {
            core: core.clone(),
            stats: QueueStats::named_leaf(core.switches().stats, &shared.name),
            wake,
            user: Cell::new(0),
            sink: Cell::new(SinkId(u32::MAX)),
            tx,
            rx,
            stop: Arc::new(AtomicBool::new(false)),
            watch: watch.clone(),
            st: RefCell::new(State {
                conns: (0..shared.connections).map(|_| Conn::new()).collect(),
                ios: vec![
                    IoSlot {
                        io: Io::nodata(Op::Flush, 0, 0, SinkId(u32::MAX), 0),
                        start_ns: 0,
                        conn: NO_CONN,
                        next: 0,
                        tail_flush: false,
                        outstanding: 0,
                        error: 0,
                        poisoned: false,
                        internal: false,
                        in_use: false,
                    };
                    QUEUE_DEPTH
                ],
                free_ios: (0..idle).rev().collect(),
                overflow: VecDeque::new(),
                reqs: vec![
                    Req {
                        slot: NONE,
                        conn: NO_CONN,
                        command: 0,
                        offset: 0,
                        len: 0,
                        covered: 0,
                        covers: 0,
                        turnover: 0,
                        gen: 0,
                        in_use: false,
                    };
                    MAX_REQS
                ],
                free_reqs: (0..MAX_REQS as u32).rev().collect(),
                parked: VecDeque::with_capacity(QUEUE_DEPTH),
                dirty: Vec::with_capacity(CONNECTIONS_MAX as usize),
                spare: Vec::with_capacity(CONNECTIONS_MAX as usize),
                tick_armed: false,
                connecting: false,
                down_since: None,
                down_connects: 0,
                reported: 0,
                era: shared.ledger.era.load(Ordering::SeqCst),
                turnover: shared.ledger.turnover.load(Ordering::SeqCst),
                published: 0,
                backoff: Duration::ZERO,
                connected_ns: 0,
            }),
            shared,
        });
        q.shared
            .ledger
            .watches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(watch);
        q.user.set(core.register_ring_user(q.clone())?);
        q.sink.set(core.register_sink(q.clone()));
        core.register_poller(q.clone());
        // Connections: kept ones first, then new ones; a server that is down now leaves
        // the queue reconnecting in the background (requests wait up to the timeout).
        let mut st = q.st.borrow_mut();
        let now = core.now_ns();
        for i in 0..st.conns.len() {
            let kept = q
                .shared
                .idle
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop();
            let got = match kept {
                Some(c) => Ok(c),
                None => q.shared.connect().map(|made| Idle {
                    made,
                    unflushed: None,
                }),
            };
            match got {
                Ok(c) => q.install(&mut st, i, c, now),
                Err(e) => {
                    log::warn!(
                        "cairn: {}: cannot connect to {}: {e}; retrying in the background",
                        q.shared.name,
                        q.shared.uri_text
                    );
                    break;
                }
            }
        }
        if st.conns.iter().all(|c| c.link != Link::Up) {
            st.down_since = Some(now);
            st.down_connects = q.shared.ledger.connects.load(Ordering::SeqCst);
        }
        q.start_connector(&mut st);
        drop(st);
        Ok(q)
    }

    fn install(&self, st: &mut State, ci: usize, idle: Idle, now: u64) {
        let Idle { made, unflushed } = idle;
        // Requests sent from now on carry a turnover no older than this connection.
        st.era = self.shared.ledger.era.load(Ordering::SeqCst);
        st.turnover = self.shared.ledger.turnover.load(Ordering::SeqCst);
        let c = &mut st.conns[ci];
        debug_assert!(c.link == Link::Down);
        c.fd = Some(made.fd);
        c.extended = made.neg.extended;
        c.tls = made.tls.map(|mut conn| {
            // What is buffered is bounded here (RAW_OUT_MAX a send), not by rustls.
            conn.set_buffer_limit(None);
            Box::new(ClientTls {
                conn,
                raw_in: vec![0u8; RAW_IN].into_boxed_slice(),
                raw_pos: 0,
                raw_len: 0,
                raw_out: Vec::with_capacity(RAW_IN),
                raw_sent: 0,
            })
        });
        c.link = Link::Up;
        c.rs = 0;
        c.re = 0;
        c.rx = Rx::Header;
        c.out.clear();
        c.out_sent = 0;
        c.outstanding = 0;
        c.progress_ns = now;
        // Writes a closed queue left unflushed on it are owed still.
        c.acked_writes = u64::from(unflushed.is_some());
        c.flushed_writes = 0;
        c.unflushed_era = unflushed.map_or(0, |u| u.era);
        c.heard = unflushed.map_or(0, |u| u.heard);
        c.verifying = false;
        c.why = "";
        st.down_since = None;
        self.publish(st);
        // Requests that waited for a connection go first, in their order.
        while let Some(slot) = st.parked.pop_front() {
            st.ios[slot as usize].conn = ci as u16;
            st.conns[ci].ready.push_back(slot);
        }
        self.issue(st, ci);
    }

    /// Starts a thread that makes connections until every one is up (if none runs).
    fn start_connector(&self, st: &mut State) {
        let missing = st.conns.iter().filter(|c| c.link == Link::Down).count();
        if st.connecting || missing == 0 {
            return;
        }
        st.connecting = true;
        let shared = self.shared.clone();
        let tx = self.tx.clone();
        let wake = self.wake.clone();
        let stop = self.stop.clone();
        let first_delay = st.backoff;
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-connect-{}", shared.name))
            .spawn(move || {
                cairn_core::reactor::block_signals_in_this_thread();
                connector(&shared, missing, first_delay, &tx, &wake, &stop);
            });
        if let Err(e) = spawned {
            log::error!(
                "cairn: {}: cannot start a thread to reconnect: {e}",
                self.shared.name
            );
            st.connecting = false;
        }
    }

    /// Sends the parts of requests waiting on connection `ci`, as far as request slots go.
    fn issue(&self, st: &mut State, ci: usize) {
        if st.conns[ci].link != Link::Up {
            return;
        }
        let shared = &*self.shared;
        let max_part = shared.max_part;
        let extended = st.conns[ci].extended;
        let max_range = if extended {
            u64::MAX
        } else {
            shared.max_compact_range
        };
        let now = self.core.now_ns();
        while let Some(&slot) = st.conns[ci].ready.front() {
            let s = &st.ios[slot as usize];
            if s.next >= range_of(&s.io) && s.outstanding > 0 {
                // A flush after writes (FUA emulated) goes only once they are
                // acknowledged: `part_done` puts the request back then.
                st.conns[ci].ready.pop_front();
                continue;
            }
            let Some(r) = st.free_reqs.pop() else { break };
            let s = &mut st.ios[slot as usize];
            let io = s.io;
            let (command, mut flags, offset, len, data) = if s.next < range_of(&io) {
                let left = io.len - s.next;
                let offset = io.offset + s.next;
                match io.op {
                    Op::Read => (cmd::READ, 0, offset, left.min(max_part), None),
                    Op::Write => {
                        let len = left.min(max_part);
                        // SAFETY: next < len, so the pointer stays inside the buffer.
                        let p = unsafe { io.buf.add(s.next as usize) };
                        (cmd::WRITE, 0, offset, len, Some(p.cast_const()))
                    }
                    Op::Discard => (cmd::WRITE_ZEROES, 0, offset, left.min(max_range), None),
                    Op::WriteZeroes => {
                        let f = if io.flags.contains(IoFlags::NO_HOLE) {
                            proto::cflags::NO_HOLE
                        } else {
                            0
                        };
                        (cmd::WRITE_ZEROES, f, offset, left.min(max_range), None)
                    }
                    Op::Flush => unreachable!("a flush has no range"),
                }
            } else {
                s.tail_flush = false;
                (cmd::FLUSH, 0, 0, 0, None)
            };
            if io.flags.contains(IoFlags::FUA)
                && io.op.is_write()
                && command != cmd::FLUSH
                && shared.neg.flags & tflags::SEND_FUA != 0
            {
                flags |= proto::cflags::FUA;
            }
            if command != cmd::FLUSH {
                s.next += len;
            }
            s.outstanding += 1;
            let done_issuing = s.issued_all();
            let c = &mut st.conns[ci];
            let req = &mut st.reqs[r as usize];
            let gen = req.gen;
            *req = Req {
                slot,
                conn: ci as u16,
                command,
                offset,
                len,
                covered: 0,
                covers: c.acked_writes,
                turnover: st.turnover,
                gen,
                in_use: true,
            };
            let cookie = u64::from(r) | (u64::from(gen) << 32);
            let mut head = [0u8; proto::EXTENDED_HEADER];
            let head_len = encode_request(&mut head, extended, flags, command, cookie, offset, len);
            c.out.push_back(Out {
                head,
                head_len: head_len as u8,
                data: data.unwrap_or(std::ptr::null()),
                data_len: if data.is_some() { len as u32 } else { 0 },
                req: r,
            });
            if c.outstanding == 0 {
                c.progress_ns = now;
            }
            c.outstanding += 1;
            if done_issuing {
                c.ready.pop_front();
            }
        }
        self.mark_dirty(st, ci);
    }

    fn mark_dirty(&self, st: &mut State, ci: usize) {
        if !st.conns[ci].dirty {
            st.conns[ci].dirty = true;
            st.dirty.push(ci as u16);
        }
    }

    /// Finishes a request: statistics, the completion, and its slot to a waiting one.
    fn finish(&self, st: &mut State, slot: u32, mut errno: i32) {
        let s = st.ios[slot as usize];
        if s.internal {
            // The queue's own flush: what it found is in the connection's counters now.
            if let Some(c) = st.conns.get_mut(usize::from(s.conn)) {
                c.verifying = false;
            }
            self.free_slot(st, slot);
            return;
        }
        if s.io.op == Op::Flush {
            let ledger = &self.shared.ledger;
            let lost = ledger.losses.load(Ordering::Acquire);
            if lost > st.reported {
                if errno == 0 && lost > ledger.made_up.load(Ordering::Acquire) {
                    log::warn!(
                        "cairn: {}: flush fails: writes acknowledged but not flushed were on a connection to {} that was lost",
                        self.shared.name,
                        self.shared.uri_text
                    );
                    errno = libc::EIO;
                }
                if errno != 0 {
                    // Whoever sent it knows now.
                    st.reported = lost;
                }
            }
        }
        let status = IoStatus::from_result(-errno);
        self.stats.done(
            s.io.flags,
            s.io.op,
            s.io.len,
            s.start_ns,
            self.core.now_ns(),
            status.is_ok(),
        );
        self.core.complete(s.io.sink, s.io.token, status);
        self.free_slot(st, slot);
    }

    fn free_slot(&self, st: &mut State, slot: u32) {
        st.ios[slot as usize].in_use = false;
        st.free_ios.push(slot);
        if let Some((io, start)) = st.overflow.pop_front() {
            self.start(st, io, start);
        }
    }

    /// Stores in the queue's watch the oldest turnover at which a connection holding
    /// unflushed writes was heard from (see [`Ledger`]), if that changed.
    fn publish(&self, st: &mut State) {
        let v = st
            .conns
            .iter()
            .filter(|c| c.owes())
            .map(|c| c.heard + 1)
            .min()
            .unwrap_or(0);
        if v != st.published {
            st.published = v;
            self.watch.unflushed.store(v, Ordering::Release);
            if v != 0 {
                // The tick looks for turnovers while writes are owed (see `verify`).
                self.arm_tick(st);
            }
        }
    }

    /// Sends a flush of the queue's own on each connection that holds unflushed writes
    /// and was not heard from since the latest turnover: it makes them durable, or finds
    /// the connection dead (a loss). Runs at each reap (each pass of an eager reactor, or
    /// a wake-up while connecting) and at each tick, which stays armed while writes are
    /// owed: an idle queue finds out within a tick.
    fn verify(&self, st: &mut State) {
        if st.published == 0 || !self.shared.geometry.caps.flush {
            return;
        }
        let now = self.shared.ledger.turnover.load(Ordering::SeqCst);
        // `published` is 1 + the oldest turnover heard at: every one heard since.
        if st.published > now {
            return;
        }
        // Its reply proves the connection alive at this turnover.
        st.turnover = now;
        for ci in 0..st.conns.len() {
            let c = &st.conns[ci];
            if c.link != Link::Up || !c.owes() || c.heard >= now || c.verifying {
                continue;
            }
            let Some(slot) = st.free_ios.pop() else {
                // Every slot is busy: their replies will tell (and the next wake-up).
                return;
            };
            st.ios[slot as usize] = IoSlot {
                io: Io::nodata(Op::Flush, 0, 0, self.sink.get(), VERIFY),
                start_ns: self.core.now_ns(),
                conn: ci as u16,
                next: 0,
                tail_flush: true,
                outstanding: 0,
                error: 0,
                poisoned: false,
                internal: true,
                in_use: true,
            };
            st.conns[ci].verifying = true;
            st.conns[ci].ready.push_back(slot);
            self.issue(st, ci);
        }
        self.arm_tick(st);
    }

    /// Takes a slot for `io` and routes it to a connection (or parks it, or fails it).
    fn start(&self, st: &mut State, io: Io, start_ns: u64) {
        let Some(slot) = st.free_ios.pop() else {
            st.overflow.push_back((io, start_ns));
            return;
        };
        let shared = &*self.shared;
        st.ios[slot as usize] = IoSlot {
            io,
            start_ns,
            conn: NO_CONN,
            next: 0,
            tail_flush: io.op == Op::Flush
                || (shared.emulate_fua && io.op.is_write() && io.flags.contains(IoFlags::FUA)),
            outstanding: 0,
            error: 0,
            poisoned: false,
            internal: false,
            in_use: true,
        };
        if io.op == Op::Flush && !shared.geometry.caps.flush {
            // Nothing to make durable that the server would not already have.
            self.finish(st, slot, 0);
            return;
        }
        if io.op.is_write() && shared.neg.flags & tflags::READ_ONLY != 0 {
            self.finish(st, slot, libc::EROFS);
            return;
        }
        self.route(st, slot);
    }

    fn route(&self, st: &mut State, slot: u32) {
        let best = st
            .conns
            .iter()
            .enumerate()
            .filter(|(_, c)| c.link == Link::Up)
            .min_by_key(|(_, c)| c.outstanding as usize + c.ready.len())
            .map(|(i, _)| i);
        match best {
            Some(ci) => {
                st.ios[slot as usize].conn = ci as u16;
                st.conns[ci].ready.push_back(slot);
                self.issue(st, ci);
                // Its reply is now due: the timeout is watched.
                self.arm_tick(st);
            }
            None => {
                let now = self.core.now_ns();
                // Down too long, unless the server answered another connection since
                // (this queue's connector is woken by that and tries at once).
                let gone = st
                    .down_since
                    .is_some_and(|t| now.saturating_sub(t) > self.shared.timeout_ns)
                    && self.shared.ledger.connects.load(Ordering::SeqCst) == st.down_connects;
                if gone {
                    self.finish(st, slot, libc::EIO);
                } else {
                    st.ios[slot as usize].conn = NO_CONN;
                    st.parked.push_back(slot);
                    self.arm_tick(st);
                }
            }
        }
    }

    fn arm_tick(&self, st: &mut State) {
        if st.tick_armed {
            return;
        }
        st.tick_armed = true;
        let every = (self.shared.timeout_ns / 4).clamp(20_000_000, 1_000_000_000);
        self.core
            .add_timer(self.core.now_ns() + every, self.sink.get(), 0);
    }

    /// Checks the timeout: requests parked too long fail, a connection silent too long
    /// with requests outstanding is given up.
    fn tick(&self) {
        let mut st = self.st.borrow_mut();
        st.tick_armed = false;
        let now = self.core.now_ns();
        let timeout = self.shared.timeout_ns;
        let mut keep = VecDeque::new();
        std::mem::swap(&mut keep, &mut st.parked);
        for slot in keep.drain(..) {
            if now.saturating_sub(st.ios[slot as usize].start_ns) > timeout {
                self.finish(&mut st, slot, libc::EIO);
            } else {
                st.parked.push_back(slot);
            }
        }
        for ci in 0..st.conns.len() {
            let c = &st.conns[ci];
            if c.link == Link::Up
                && c.outstanding > 0
                && now.saturating_sub(c.progress_ns) > timeout
            {
                self.kill(&mut st, ci, "no reply within the timeout");
            }
        }
        self.verify(&mut st);
        let busy = !st.parked.is_empty()
            || st.published != 0
            || st
                .conns
                .iter()
                .any(|c| c.outstanding > 0 || c.link != Link::Up);
        if busy {
            self.arm_tick(&mut st);
        }
    }

    /// Gives up connection `ci`: its socket is shut down, and once its receive and send
    /// have finished it is reset (see `reset`).
    fn kill(&self, st: &mut State, ci: usize, why: &'static str) {
        let c = &mut st.conns[ci];
        if c.link != Link::Up {
            return;
        }
        log::warn!(
            "cairn: {}: connection to {} lost ({why}); {} request{} outstanding",
            self.shared.name,
            self.shared.uri_text,
            c.outstanding,
            if c.outstanding == 1 { "" } else { "s" }
        );
        c.link = Link::Dying;
        c.why = why;
        if let Some(fd) = &c.fd {
            let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
        }
        self.mark_dirty(st, ci);
    }

    /// A dead connection whose SQEs have all finished: close it, and retry or fail what
    /// was on it.
    fn reset(&self, st: &mut State, ci: usize) {
        let now = self.core.now_ns();
        let c = &mut st.conns[ci];
        c.fd = None;
        c.tls = None;
        c.link = Link::Down;
        c.out.clear();
        c.out_sent = 0;
        c.rs = 0;
        c.re = 0;
        c.rx = Rx::Header;
        c.outstanding = 0;
        c.ready.clear();
        c.verifying = false;
        if c.acked_writes > c.flushed_writes && self.shared.geometry.caps.flush {
            let n = c.acked_writes - c.flushed_writes;
            if self.shared.ledger.lost(c.unflushed_era) {
                log::warn!(
                    "cairn: {}: the connection to {} that was lost held writes acknowledged but not flushed ({n} or fewer): they may be lost, and the next flush fails",
                    self.shared.name,
                    self.shared.uri_text
                );
            } else {
                log::info!(
                    "cairn: {}: the connection to {} that was lost held writes acknowledged but not flushed ({n} or fewer), made up for already",
                    self.shared.name,
                    self.shared.uri_text
                );
            }
        }
        c.acked_writes = 0;
        c.flushed_writes = 0;
        self.publish(st);
        // The server may have restarted: every queue looks at its other connections.
        self.shared.ledger.turn();
        for r in 0..st.reqs.len() {
            let q = &mut st.reqs[r];
            if q.in_use && q.conn == ci as u16 {
                q.in_use = false;
                q.gen = q.gen.wrapping_add(1);
                st.free_reqs.push(r as u32);
            }
        }
        for slot in 0..st.ios.len() as u32 {
            let s = &mut st.ios[slot as usize];
            if !s.in_use || s.conn != ci as u16 {
                continue;
            }
            if s.internal {
                // The connection it checked is gone: the loss is counted above.
                self.finish(st, slot, 0);
                continue;
            }
            if s.poisoned {
                self.finish(st, slot, libc::EIO);
                continue;
            }
            // Not acknowledged: safe to send again, from the start. A flush too: if the
            // connection held unflushed writes, the loss is counted, and the flush fails
            // when it is done unless the loss was made up for.
            s.next = 0;
            s.outstanding = 0;
            s.error = 0;
            s.tail_flush = s.io.op == Op::Flush
                || (self.shared.emulate_fua
                    && s.io.op.is_write()
                    && s.io.flags.contains(IoFlags::FUA));
            s.conn = NO_CONN;
            st.parked.push_back(slot);
        }
        // Oldest first.
        let ios = &st.ios;
        st.parked
            .make_contiguous()
            .sort_by_key(|&s| ios[s as usize].start_ns);
        if st.conns.iter().all(|c| c.link != Link::Up) && st.down_since.is_none() {
            st.down_since = Some(now);
            st.down_connects = self.shared.ledger.connects.load(Ordering::SeqCst);
        }
        // Requests go to another connection if one is up, else wait for the reconnect.
        let parked: Vec<u32> = st.parked.drain(..).collect();
        for slot in parked {
            self.route(st, slot);
        }
        self.start_connector(st);
        self.arm_tick(st);
    }

    /// A reply part for `r` is complete with `errno` (0: success).
    fn part_done(&self, st: &mut State, r: u32, errno: i32) {
        let q = st.reqs[r as usize];
        let ci = q.conn as usize;
        st.reqs[r as usize].in_use = false;
        st.reqs[r as usize].gen = q.gen.wrapping_add(1);
        st.free_reqs.push(r);
        let era = st.era;
        let c = &mut st.conns[ci];
        c.outstanding -= 1;
        // Any reply: the connection was alive at the turnover its request was sent at.
        c.heard = c.heard.max(q.turnover);
        let slot = q.slot;
        let s = &mut st.ios[slot as usize];
        let mut errno = errno;
        if errno == 0 && q.command == cmd::READ && q.covered != q.len {
            errno = libc::EIO;
            log::warn!(
                "cairn: {}: a read reply from {} covered {} of {} bytes",
                self.shared.name,
                self.shared.uri_text,
                q.covered,
                q.len
            );
        }
        if errno == 0 {
            match q.command {
                cmd::WRITE | cmd::WRITE_ZEROES if !s.io.flags.contains(IoFlags::FUA) => {
                    c.acked_writes += 1;
                    c.unflushed_era = era;
                }
                cmd::FLUSH => c.flushed_writes = c.flushed_writes.max(q.covers),
                _ => {}
            }
        }
        // Published before the request completes: whoever learns of the write can see
        // that it is not flushed yet.
        self.publish(st);
        let s = &mut st.ios[slot as usize];
        if s.error == 0 {
            s.error = errno;
        }
        s.outstanding -= 1;
        if s.outstanding == 0 && s.issued_all() {
            let e = s.error;
            self.finish(st, slot, e);
        } else if s.outstanding == 0 && s.tail_flush && s.conn == ci as u16 {
            if s.error != 0 {
                let e = s.error;
                self.finish(st, slot, e);
            } else {
                // The writes are acknowledged: now their flush.
                st.conns[ci].ready.push_back(slot);
            }
        }
        // A request slot came free: more parts may go.
        if !st.conns[ci].ready.is_empty() {
            self.issue(st, ci);
        }
        for other in 0..st.conns.len() {
            if other != ci && !st.conns[other].ready.is_empty() {
                self.issue(st, other);
            }
        }
    }

    /// Parses every complete reply in connection `ci`'s input.
    fn parse(&self, st: &mut State, ci: usize) {
        loop {
            let c = &mut st.conns[ci];
            if c.link != Link::Up {
                return;
            }
            match c.rx {
                Rx::Data { dst, left, .. } => {
                    let n = left.min(c.re - c.rs);
                    if n > 0 {
                        // SAFETY: dst has `left` bytes of the read's buffer left, which
                        // the submitter keeps until the completion.
                        unsafe { std::ptr::copy_nonoverlapping(c.inbuf[c.rs..].as_ptr(), dst, n) };
                        c.rs += n;
                    }
                    if !self.data_landed(st, ci, n) {
                        return;
                    }
                }
                Rx::Header => {
                    if !self.parse_header(st, ci) {
                        return;
                    }
                }
            }
        }
    }

    /// `n` more bytes of the read data being received are in its buffer: move on, and
    /// finish the part once its reply is complete. Whether all of the data is there.
    fn data_landed(&self, st: &mut State, ci: usize, n: usize) -> bool {
        let c = &mut st.conns[ci];
        let Rx::Data {
            req,
            dst,
            left,
            done,
        } = c.rx
        else {
            return true;
        };
        if n < left {
            // SAFETY: n < left, inside the same buffer.
            let dst = unsafe { dst.add(n) };
            c.rx = Rx::Data {
                req,
                dst,
                left: left - n,
                done,
            };
            return false;
        }
        c.rx = Rx::Header;
        if done {
            self.part_done(st, req, 0);
        }
        true
    }

    /// Handles the reply header at the start of the input, if it is all there; whether
    /// it was (and parsing can go on).
    fn parse_header(&self, st: &mut State, ci: usize) -> bool {
        let c = &st.conns[ci];
        let input = &c.inbuf[c.rs..c.re];
        let (h, size) = match proto::parse_reply(input, c.extended) {
            proto::DecodedReply::Incomplete => return false,
            proto::DecodedReply::Bad(m) => {
                self.violation(st, ci, None, "a reply with a bad magic number", m.into());
                return false;
            }
            proto::DecodedReply::Header(h, size) => (h, size),
        };
        let (cookie, simple_error) = match h {
            proto::ReplyHeader::Simple { error, cookie } => (cookie, Some(error)),
            proto::ReplyHeader::Chunk { cookie, .. } => (cookie, None),
        };
        let r = (cookie & 0xffff_ffff) as usize;
        let gen = (cookie >> 32) as u16;
        let known = cookie >> 48 == 0
            && st
                .reqs
                .get(r)
                .is_some_and(|q| q.in_use && q.gen == gen && q.conn == ci as u16);
        if !known {
            self.violation(st, ci, None, "a reply with a cookie no request has", cookie);
            return false;
        }
        let r = r as u32;
        let q = st.reqs[r as usize];
        if let Some(error) = simple_error {
            let c = &mut st.conns[ci];
            c.rs += size;
            if error != 0 {
                self.part_error(st, r, error);
            } else if q.command == cmd::READ {
                let s = &st.ios[q.slot as usize];
                // SAFETY: the part lies inside the request's range and buffer.
                let dst = unsafe { s.io.buf.add((q.offset - s.io.offset) as usize) };
                st.reqs[r as usize].covered = q.len;
                st.conns[ci].rx = Rx::Data {
                    req: r,
                    dst,
                    left: q.len as usize,
                    done: true,
                };
            } else {
                self.part_done(st, r, 0);
            }
            return true;
        }
        let proto::ReplyHeader::Chunk {
            flags, kind, len, ..
        } = h
        else {
            return false;
        };
        let done = flags & chunk::FLAG_DONE != 0;
        if kind == chunk::OFFSET_DATA {
            if q.command != cmd::READ || len < 8 || len - 8 > q.len {
                self.violation(
                    st,
                    ci,
                    Some(r),
                    "a data chunk that does not fit its read",
                    len,
                );
                return false;
            }
            let c = &mut st.conns[ci];
            if c.re - c.rs < size + 8 {
                return false;
            }
            let offset = proto::be64(&c.inbuf[c.rs + size..c.rs + size + 8]);
            let n = len - 8;
            if offset < q.offset || offset + n > q.offset + q.len {
                self.violation(st, ci, Some(r), "a data chunk outside its read", offset);
                return false;
            }
            c.rs += size + 8;
            let s = &st.ios[q.slot as usize];
            // SAFETY: [offset, offset + n) lies inside the part, so inside the buffer.
            let dst = unsafe { s.io.buf.add((offset - s.io.offset) as usize) };
            st.reqs[r as usize].covered += n;
            st.conns[ci].rx = Rx::Data {
                req: r,
                dst,
                left: n as usize,
                done,
            };
            return true;
        }
        // Every other chunk is small and handled whole from the input buffer.
        if len > MAX_SMALL {
            self.violation(st, ci, Some(r), "an oversized reply chunk", len);
            return false;
        }
        let c = &st.conns[ci];
        if c.re - c.rs < size + len as usize {
            return false;
        }
        let p = &c.inbuf[c.rs + size..c.rs + size + len as usize];
        let mut error = 0u32;
        match kind {
            chunk::NONE if len == 0 && done => {}
            chunk::OFFSET_HOLE if q.command == cmd::READ && len == 12 => {
                let offset = proto::be64(&p[0..8]);
                let n = u64::from(proto::be32(&p[8..12]));
                if offset < q.offset || offset + n > q.offset + q.len {
                    self.violation(st, ci, Some(r), "a hole chunk outside its read", offset);
                    return false;
                }
                let s = &st.ios[q.slot as usize];
                // SAFETY: inside the part, so inside the buffer.
                unsafe {
                    std::ptr::write_bytes(
                        s.io.buf.add((offset - s.io.offset) as usize),
                        0,
                        n as usize,
                    )
                };
                st.reqs[r as usize].covered += n;
            }
            k if k & (1 << 15) != 0 && len >= 6 => {
                error = proto::be32(&p[0..4]);
                if error == 0 {
                    error = proto::errno::EIO;
                }
            }
            _ => {
                self.violation(st, ci, Some(r), "an unexpected reply chunk", kind.into());
                return false;
            }
        }
        st.conns[ci].rs += size + len as usize;
        if error != 0 {
            // Recorded now; the part ends with its last chunk.
            let slot = q.slot as usize;
            if st.ios[slot].error == 0 {
                st.ios[slot].error = proto::errno::to_local(error);
            }
            if error == proto::errno::ESHUTDOWN {
                self.kill(st, ci, "the server is shutting down");
                return false;
            }
        }
        if done {
            self.part_done(st, r, 0);
        }
        true
    }

    fn part_error(&self, st: &mut State, r: u32, error: u32) {
        let ci = st.reqs[r as usize].conn as usize;
        if error == proto::errno::ESHUTDOWN {
            // Not done by a server that is going away: sent again on the next connection.
            self.kill(st, ci, "the server is shutting down");
            return;
        }
        self.part_done(st, r, proto::errno::to_local(error));
    }

    /// The server broke the protocol: the request it concerns (if known) fails with
    /// EIO and is not retried; the connection is given up. The failure is delivered when
    /// the connection is reset, once no send still reads the request's buffer.
    fn violation(&self, st: &mut State, ci: usize, r: Option<u32>, what: &str, value: u64) {
        log::warn!(
            "cairn: {}: {} sent {what} ({value:#x})",
            self.shared.name,
            self.shared.uri_text
        );
        if let Some(r) = r {
            let slot = st.reqs[r as usize].slot;
            st.ios[slot as usize].poisoned = true;
        }
        self.kill(st, ci, "a protocol error");
    }

    /// Pushes connection `ci`'s send and receive, or resets it once it is dead and quiet.
    fn arm(&self, st: &mut State, ci: usize) {
        st.conns[ci].dirty = false;
        let c = &mut st.conns[ci];
        match c.link {
            Link::Down => return,
            Link::Dying => {
                if c.quiet() {
                    self.reset(st, ci);
                }
                return;
            }
            Link::Up => {}
        }
        let Some(fd) = c.fd.as_ref().map(|f| f.as_raw_fd()) else {
            return;
        };
        if c.tls.is_some() {
            if !c.send_armed {
                if let Err(why) = self.push_send_tls(c, ci, fd) {
                    self.kill(st, ci, why);
                    return;
                }
            }
            let c = &mut st.conns[ci];
            let fed = c.tls.as_ref().is_some_and(|t| t.raw_pos == t.raw_len);
            if !c.recv_armed && c.outstanding > 0 && fed {
                self.push_recv_tls(c, ci, fd);
            }
            return;
        }
        if !c.send_armed && !c.out.is_empty() {
            self.push_send(c, ci, fd);
        }
        if !c.recv_armed && c.outstanding > 0 {
            self.push_recv(c, ci, fd);
        }
    }

    fn push_send(&self, c: &mut Conn, ci: usize, fd: RawFd) {
        gather::gather(&mut c.iov, &c.out, c.out_sent, IOV_BATCH);
        c.msg.msg_iov = c.iov.as_mut_ptr();
        c.msg.msg_iovlen = c.iov.len() as _;
        let entry = opcode::SendMsg::new(types::Fd(fd), &c.msg as *const libc::msghdr)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build();
        c.send_armed = true;
        // SAFETY: the msghdr, the iovecs and the headers live in the connection, which
        // sits in a vector that never grows, and the output queue never reallocates (it
        // holds at most MAX_REQS entries, its reserved capacity); write payloads belong to
        // submitters until their completion, which comes after the reply. Nothing is
        // touched or freed until this SQE completes.
        unsafe {
            self.core
                .push_sqe(self.user.get(), ((ci as u64) << 8) | SEND, entry)
        };
    }

    /// Encrypts every waiting request and sends the ciphertext.
    fn push_send_tls(&self, c: &mut Conn, ci: usize, fd: RawFd) -> Result<(), &'static str> {
        use std::io::Write;
        let Conn { out, tls, .. } = c;
        let Some(t) = tls.as_mut() else { return Ok(()) };
        if t.raw_sent == t.raw_out.len() {
            t.raw_out.clear();
            t.raw_sent = 0;
            while t.raw_out.len() < RAW_OUT_MAX {
                let Some(o) = out.pop_front() else { break };
                let mut w = t.conn.writer();
                w.write_all(o.head()).map_err(|_| "a TLS error")?;
                w.write_all(o.data()).map_err(|_| "a TLS error")?;
                while t.conn.wants_write() {
                    if t.conn.write_tls(&mut t.raw_out).is_err() {
                        return Err("a TLS error");
                    }
                }
            }
            while t.conn.wants_write() {
                if t.conn.write_tls(&mut t.raw_out).is_err() {
                    return Err("a TLS error");
                }
            }
        }
        if t.raw_sent == t.raw_out.len() {
            return Ok(());
        }
        let entry = opcode::Send::new(
            types::Fd(fd),
            t.raw_out[t.raw_sent..].as_ptr(),
            (t.raw_out.len() - t.raw_sent) as u32,
        )
        .flags(libc::MSG_NOSIGNAL)
        .build();
        c.send_armed = true;
        // SAFETY: nothing is appended to the ciphertext buffer until this SQE completes,
        // and the connection is not freed while it is in flight.
        unsafe {
            self.core
                .push_sqe(self.user.get(), ((ci as u64) << 8) | SEND, entry)
        };
        Ok(())
    }

    fn push_recv_tls(&self, c: &mut Conn, ci: usize, fd: RawFd) {
        let Some(t) = c.tls.as_mut() else { return };
        let entry = opcode::Recv::new(types::Fd(fd), t.raw_in.as_mut_ptr(), RAW_IN as u32).build();
        c.recv_armed = true;
        c.recv_direct = false;
        // SAFETY: the ciphertext buffer belongs to the connection and is not touched until
        // this SQE completes.
        unsafe {
            self.core
                .push_sqe(self.user.get(), ((ci as u64) << 8) | RECV, entry)
        };
    }

    /// Gives received ciphertext to rustls and parses the plaintext, as much as the input
    /// buffer takes at a time.
    fn tls_input(&self, st: &mut State, ci: usize) {
        use std::io::Read;
        loop {
            let Conn {
                tls, inbuf, rs, re, ..
            } = &mut st.conns[ci];
            let Some(t) = tls.as_mut() else { return };
            while t.raw_pos < t.raw_len {
                let mut rd = &t.raw_in[t.raw_pos..t.raw_len];
                match t.conn.read_tls(&mut rd) {
                    Ok(k) if k > 0 => t.raw_pos += k,
                    _ => break,
                }
                if let Err(e) = t.conn.process_new_packets() {
                    log::warn!(
                        "cairn: {}: TLS with {}: {e}",
                        self.shared.name,
                        self.shared.uri_text
                    );
                    self.kill(st, ci, "a TLS error");
                    return;
                }
            }
            if *rs == *re {
                (*rs, *re) = (0, 0);
            } else if *re == inbuf.len() && *rs > 0 {
                inbuf.copy_within(*rs..*re, 0);
                *re -= *rs;
                *rs = 0;
            }
            let mut got = false;
            if *re < inbuf.len() {
                match t.conn.reader().read(&mut inbuf[*re..]) {
                    Ok(0) => {
                        self.kill(st, ci, "the server closed the TLS session");
                        return;
                    }
                    Ok(k) => {
                        *re += k;
                        got = true;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(_) => {
                        self.kill(st, ci, "a TLS error");
                        return;
                    }
                }
            }
            let wants_write = t.conn.wants_write();
            if wants_write {
                self.mark_dirty(st, ci);
            }
            self.parse(st, ci);
            if !got || st.conns[ci].link != Link::Up {
                return;
            }
        }
    }

    fn push_recv(&self, c: &mut Conn, ci: usize, fd: RawFd) {
        // Straight into a read's buffer only when much of it is missing: small replies
        // come many to a receive through the input buffer (a 4 KiB copy costs less than a
        // receive of its own).
        let direct = matches!(c.rx, Rx::Data { left, .. } if left >= DIRECT_MIN) && c.rs == c.re;
        let (ptr, len) = match c.rx {
            Rx::Data { dst, left, .. } if direct => (dst, left),
            _ => {
                if c.rs == c.re {
                    c.rs = 0;
                    c.re = 0;
                } else if c.re == c.inbuf.len() || c.rs > INBUF / 2 {
                    c.inbuf.copy_within(c.rs..c.re, 0);
                    c.re -= c.rs;
                    c.rs = 0;
                }
                let re = c.re;
                (c.inbuf[re..].as_mut_ptr(), c.inbuf.len() - re)
            }
        };
        let entry =
            opcode::Recv::new(types::Fd(fd), ptr, len.min(u32::MAX as usize) as u32).build();
        c.recv_armed = true;
        c.recv_direct = direct;
        // SAFETY: the target (the input buffer, or the read's buffer, which its submitter
        // keeps until the completion) is not touched until this SQE completes.
        unsafe {
            self.core
                .push_sqe(self.user.get(), ((ci as u64) << 8) | RECV, entry)
        };
    }

    fn received(&self, st: &mut State, ci: usize, res: i32) {
        let c = &mut st.conns[ci];
        c.recv_armed = false;
        if c.link != Link::Up {
            self.mark_dirty(st, ci);
            return;
        }
        if res == -libc::EINTR || res == -libc::EAGAIN {
            self.mark_dirty(st, ci);
            return;
        }
        if res <= 0 {
            let why = if res == 0 {
                "the server closed the connection"
            } else {
                "a receive failed"
            };
            self.kill(st, ci, why);
            return;
        }
        c.progress_ns = self.core.now_ns();
        let n = res as usize;
        if let Some(t) = c.tls.as_mut() {
            t.raw_pos = 0;
            t.raw_len = n;
            self.tls_input(st, ci);
            self.mark_dirty(st, ci);
            return;
        }
        if c.recv_direct {
            self.data_landed(st, ci, n);
        } else {
            c.re += n;
        }
        self.parse(st, ci);
        self.mark_dirty(st, ci);
    }

    fn sent(&self, st: &mut State, ci: usize, res: i32) {
        let c = &mut st.conns[ci];
        c.send_armed = false;
        if c.link != Link::Up {
            self.mark_dirty(st, ci);
            return;
        }
        if res < 0 {
            if res == -libc::EINTR || res == -libc::EAGAIN {
                self.mark_dirty(st, ci);
                return;
            }
            self.kill(st, ci, "a send failed");
            return;
        }
        if let Some(t) = c.tls.as_mut() {
            t.raw_sent += res as usize;
            if t.raw_sent >= t.raw_out.len() {
                t.raw_out.clear();
                t.raw_sent = 0;
            }
            self.mark_dirty(st, ci);
            return;
        }
        gather::consume(&mut c.out, &mut c.out_sent, res as usize, drop);
        self.mark_dirty(st, ci);
    }

    /// A connection from the connector thread.
    fn connected(&self, st: &mut State, made: Connected) {
        let Some(ci) = st.conns.iter().position(|c| c.link == Link::Down) else {
            // More than needed: keep it for a later queue.
            self.keep(made);
            return;
        };
        log::info!(
            "cairn: {}: connected to {} again",
            self.shared.name,
            self.shared.uri_text
        );
        self.shared.reconnects.fetch_add(1, Ordering::Relaxed);
        // A server that drops every connection soon after it is made is not hammered:
        // the next attempt waits longer each time, until one lasts a while.
        let now = self.core.now_ns();
        st.backoff = if now.saturating_sub(st.connected_ns) < 1_000_000_000 {
            (st.backoff * 2).clamp(Duration::from_millis(50), BACKOFF_MAX)
        } else {
            Duration::ZERO
        };
        st.connected_ns = now;
        self.install(
            st,
            ci,
            Idle {
                made,
                unflushed: None,
            },
            now,
        );
    }

    fn keep(&self, made: Connected) {
        let mut idle = self.shared.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < 2 * CONNECTIONS_MAX as usize {
            idle.push(Idle {
                made,
                unflushed: None,
            });
        }
    }
}

/// Encodes a request header into `head`; its length.
fn encode_request(
    head: &mut [u8; proto::EXTENDED_HEADER],
    extended: bool,
    flags: u16,
    command: u16,
    cookie: u64,
    offset: u64,
    len: u64,
) -> usize {
    let magic = if extended {
        proto::EXTENDED_REQUEST_MAGIC
    } else {
        proto::REQUEST_MAGIC
    };
    head[0..4].copy_from_slice(&magic.to_be_bytes());
    head[4..6].copy_from_slice(&flags.to_be_bytes());
    head[6..8].copy_from_slice(&command.to_be_bytes());
    head[8..16].copy_from_slice(&cookie.to_be_bytes());
    head[16..24].copy_from_slice(&offset.to_be_bytes());
    if extended {
        head[24..32].copy_from_slice(&len.to_be_bytes());
        proto::EXTENDED_HEADER
    } else {
        head[24..28].copy_from_slice(&(len as u32).to_be_bytes());
        proto::REQUEST_HEADER
    }
}

fn range_of(io: &Io) -> u64 {
    if io.op == Op::Flush {
        0
    } else {
        io.len
    }
}

/// The reconnecting thread: makes `missing` connections, waiting `delay` (then doubling
/// up to `BACKOFF_MAX`) between failed attempts, until the queue is gone.
fn connector(
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

impl Queue for NbdQueue {
    fn submit(&self, io: Io) {
        let start = self.core.now_ns();
        self.stats.start(io.flags, start);
        let mut st = self.st.borrow_mut();
        self.start(&mut st, io, start);
    }

    fn stats(&self) -> &QueueStats {
        &self.stats
    }
}

impl RingUser for NbdQueue {
    fn ring_complete(&self, cookie: u64, res: i32) {
        let mut st = self.st.borrow_mut();
        let ci = (cookie >> 8) as usize;
        if ci >= st.conns.len() {
            return;
        }
        match cookie & 0xff {
            RECV => self.received(&mut st, ci, res),
            _ => self.sent(&mut st, ci, res),
        }
    }
}

impl Sink for NbdQueue {
    fn io_done(&self, _token: u64, _status: IoStatus) {
        self.tick();
    }
}

impl Poller for NbdQueue {
    fn unplug(&self) {
        let mut st = self.st.borrow_mut();
        if !st.dirty.is_empty() {
            // Read before anything goes out: a write acknowledged later belongs to this
            // era or a later one, and a reply to a request not sent yet proves its
            // connection alive at this turnover (see `Ledger`).
            let ledger = &self.shared.ledger;
            st.era = ledger.era.load(Ordering::Acquire);
            let turnover = ledger.turnover.load(Ordering::Acquire);
            if turnover != st.turnover {
                // Rare (a connection lost or made): requests issued before, still to
                // send, carry the turnover they go out at.
                st.turnover = turnover;
                let State { conns, reqs, .. } = &mut *st;
                for c in conns.iter() {
                    for o in &c.out {
                        reqs[o.req as usize].turnover = turnover;
                    }
                }
            }
        }
        // Resetting a dead connection can dirty others (its requests move): go round
        // until nothing is dirty. The two vectors trade places, so nothing allocates.
        while !st.dirty.is_empty() {
            let mut work = std::mem::take(&mut st.spare);
            std::mem::swap(&mut work, &mut st.dirty);
            for &ci in &work {
                self.arm(&mut st, ci as usize);
            }
            work.clear();
            st.spare = work;
        }
    }

    fn reap(&self) -> usize {
        let mut st = self.st.borrow_mut();
        self.verify(&mut st);
        if !st.connecting {
            return 0;
        }
        let mut n = 0;
        loop {
            match self.rx.try_recv() {
                Ok(Made::Conn(c)) => {
                    self.connected(&mut st, c);
                    n += 1;
                }
                Ok(Made::Done) => {
                    st.connecting = false;
                    // Connections lost while it ran need another run.
                    self.start_connector(&mut st);
                }
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => break,
            }
        }
        n
    }

    fn busy(&self) -> bool {
        self.st.borrow().connecting
    }

    fn event_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }

    fn clear_event(&self) {
        cairn_core::event::reset(&*self.wake);
    }
}

impl Drop for NbdQueue {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.shared
            .ledger
            .watches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|w| !Arc::ptr_eq(w, &self.watch));
        let st = self.st.get_mut();
        for c in st.conns.iter_mut() {
            let drained = c.tls.as_ref().is_none_or(|t| {
                t.raw_pos == t.raw_len && t.raw_sent == t.raw_out.len() && !t.conn.wants_write()
            });
            let idle = c.link == Link::Up
                && c.quiet()
                && c.outstanding == 0
                && c.out.is_empty()
                && c.rs == c.re
                && drained
                && matches!(c.rx, Rx::Header);
            if let (true, Some(fd)) = (idle, c.fd.take()) {
                let neg = Negotiated {
                    extended: c.extended,
                    ..self.shared.neg.clone()
                };
                // Writes it acknowledged that no flush covered stay on the ledger's books
                // with it (kept even beyond the pool's size).
                let unflushed = c.owes().then_some(Unflushed {
                    era: c.unflushed_era,
                    heard: c.heard,
                });
                let mut pool = self.shared.idle.lock().unwrap_or_else(|e| e.into_inner());
                if pool.len() < 2 * CONNECTIONS_MAX as usize || unflushed.is_some() {
                    pool.push(Idle {
                        made: Connected {
                            fd,
                            neg,
                            tls: c.tls.take().map(|t| t.conn),
                        },
                        unflushed,
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_never_claim_partial_blocks() {
        let mut out = Vec::new();
        // data 1000, hole 5000, data to the end: the hole shrinks to whole blocks.
        map_extents(
            &[
                (1000, 0),
                (5000, proto::state::HOLE | proto::state::ZERO),
                (10_000, 0),
            ],
            0,
            8192,
            512,
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                Extent::data(1024),
                Extent::hole(5632 - 1024),
                Extent::data(8192 - 5632)
            ]
        );
        let total: u64 = out.iter().map(|e| e.len).sum();
        assert_eq!(total, 8192);
    }

    #[test]
    fn extents_clip_and_fall_back() {
        let mut out = Vec::new();
        map_extents(&[], 4096, 4096, 512, &mut out);
        assert_eq!(out, vec![Extent::data(4096)]);
        out.clear();
        map_extents(&[(1 << 40, proto::state::ZERO)], 0, 4096, 512, &mut out);
        assert_eq!(
            out,
            vec![Extent {
                len: 4096,
                hole: false,
                zero: true
            }]
        );
    }

    #[test]
    fn request_headers() {
        let mut h = [0u8; proto::EXTENDED_HEADER];
        let n = encode_request(&mut h, false, 1, cmd::WRITE, 7, 4096, 512);
        assert_eq!(n, proto::REQUEST_HEADER);
        assert_eq!(
            proto::parse_request(&h[..n]),
            proto::Decoded::Request(proto::Request {
                flags: 1,
                command: cmd::WRITE,
                cookie: 7,
                offset: 4096,
                len: 512
            })
        );
        let n = encode_request(&mut h, true, 0, cmd::TRIM, 9, 0, 5 << 30);
        assert_eq!(n, proto::EXTENDED_HEADER);
        let mut v = Vec::new();
        proto::put_extended_request(&mut v, 0, cmd::TRIM, 9, 0, 5 << 30);
        assert_eq!(&h[..], &v[..]);
    }
}
