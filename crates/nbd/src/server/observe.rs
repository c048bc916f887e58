//! What a running server shows its operators: the connections open now, with what each
//! did, and the errors replied, by errno.
//!
//! A connection's counters have one writer, the reactor that serves it, which adds with a
//! relaxed load and store (no locked instruction per request); the admin socket and the
//! metrics endpoint read them from their own threads. The list of connections is locked
//! only when one opens or closes, and by readers.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use crate::proto::{cmd, errno};

/// The errors a reply can carry, with their names (the last one stands for any other).
pub const ERRNOS: [(u32, &str); 9] = [
    (errno::EPERM, "EPERM"),
    (errno::EIO, "EIO"),
    (errno::ENOMEM, "ENOMEM"),
    (errno::EINVAL, "EINVAL"),
    (errno::ENOSPC, "ENOSPC"),
    (errno::EOVERFLOW, "EOVERFLOW"),
    (errno::ENOTSUP, "ENOTSUP"),
    (errno::ESHUTDOWN, "ESHUTDOWN"),
    (0, "other"),
];

/// Connections and errors of one server.
pub struct Observer {
    conns: Mutex<Vec<Arc<ConnInfo>>>,
    memory: std::sync::OnceLock<Arc<crate::server::pool::Budget>>,
    next_id: AtomicU64,
    accepted: AtomicU64,
    errors: [AtomicU64; ERRNOS.len()],
}

impl Default for Observer {
    fn default() -> Observer {
        Observer {
            conns: Mutex::new(Vec::new()),
            memory: std::sync::OnceLock::new(),
            next_id: AtomicU64::new(1),
            accepted: AtomicU64::new(0),
            errors: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Observer {
    /// A connection to `export` from `peer` starts; it is connection `slot` of reactor
    /// `reactor`.
    pub(crate) fn open(
        &self,
        (peer, client): (&str, Client),
        export: &str,
        tls: bool,
        headers: &'static str,
        (reactor, slot): (usize, u32),
    ) -> Arc<ConnInfo> {
        let info = Arc::new(ConnInfo {
            id: self.next_id.fetch_add(1, Relaxed),
            peer: peer.to_string(),
            client,
            export: export.to_string(),
            tls,
            headers,
            since: SystemTime::now(),
            started: Instant::now(),
            counts: Default::default(),
            reactor,
            slot,
            active_ns: AtomicU64::new(cairn_core::clock::monotonic_ns()),
            evicting: AtomicBool::new(false),
            moving: AtomicBool::new(false),
            held: AtomicU64::new(0),
        });
        self.accepted.fetch_add(1, Relaxed);
        self.lock().push(info.clone());
        info
    }

    /// The connection `info` ended.
    pub(crate) fn close(&self, info: &ConnInfo) {
        self.lock().retain(|c| c.id != info.id);
    }

    /// An error reply was sent.
    pub(crate) fn error(&self, e: u32) {
        let i = ERRNOS
            .iter()
            .position(|&(n, _)| n == e)
            .unwrap_or(ERRNOS.len() - 1);
        self.errors[i].fetch_add(1, Relaxed);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<ConnInfo>>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The server's memory budget (set once it serves).
    pub(crate) fn set_memory(&self, budget: Arc<crate::server::pool::Budget>) {
        let _ = self.memory.set(budget);
    }

    /// Buffer memory: (bytes charged now, the budget, times a connection waited for it).
    pub fn memory(&self) -> Option<(usize, usize, u64)> {
        self.memory.get().map(|b| (b.used(), b.limit(), b.waits()))
    }

    /// The connections open now, oldest first.
    pub fn connections(&self) -> Vec<Arc<ConnInfo>> {
        self.lock().clone()
    }

    /// Connections that finished the handshake since the server started.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Relaxed)
    }

    /// Error replies sent since the server started, by errno name (every name of
    /// [`ERRNOS`], zeros included).
    pub fn errors(&self) -> Vec<(&'static str, u64)> {
        ERRNOS
            .iter()
            .zip(&self.errors)
            .map(|(&(_, name), n)| (name, n.load(Relaxed)))
            .collect()
    }
}

/// One connection, as its operators see it.
pub struct ConnInfo {
    /// Unique in this server's life.
    pub id: u64,
    /// The client's address (`unix` for a Unix socket).
    pub peer: String,
    /// Whom it counts against for `--max-connections-per-address`.
    pub client: Client,
    /// The export it chose.
    pub export: String,
    /// Whether it speaks TLS.
    pub tls: bool,
    /// What its replies are: `simple`, `structured` or `extended` (headers).
    pub headers: &'static str,
    /// When it connected.
    pub since: SystemTime,
    started: Instant,
    counts: ConnCounts,
    /// The reactor that serves it, and its slot there.
    pub(crate) reactor: usize,
    pub(crate) slot: u32,
    /// When its client last made progress (a request arrived or ended), in monotonic
    /// nanoseconds; `BUSY` while requests of it are at the device. Written by its reactor
    /// only when the value changes.
    active_ns: AtomicU64,
    /// Chosen for eviction already.
    pub(crate) evicting: AtomicBool,
    /// In the middle of a request or a reply: a request partly received, or replies
    /// waiting to be read. Written by its reactor only when the value changes.
    moving: AtomicBool,
    /// Bytes of buffers it holds (requests in flight, replies not yet sent).
    held: AtomicU64,
}

/// `active_ns` of a connection with requests at the device: never idle.
const BUSY: u64 = u64::MAX;

/// Whom a connection counts against for the per-address limit: the IP address of a TCP
/// client, the user id of a Unix socket client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Client {
    /// A TCP client (IPv4-mapped IPv6 addresses as IPv4).
    Ip(std::net::IpAddr),
    /// A Unix socket client, by its user id (`SO_PEERCRED`).
    Uid(u32),
}

impl std::fmt::Display for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Client::Ip(a) => write!(f, "{a}"),
            Client::Uid(u) => write!(f, "uid {u}"),
        }
    }
}

/// What a connection asked for, by NBD command.
#[derive(Default)]
struct ConnCounts {
    requests: AtomicU64,
    reads: AtomicU64,
    read_bytes: AtomicU64,
    writes: AtomicU64,
    written_bytes: AtomicU64,
    flushes: AtomicU64,
    trims: AtomicU64,
    zeroes: AtomicU64,
    block_status: AtomicU64,
    errors: AtomicU64,
    largest: AtomicU64,
}

/// A copy of a connection's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnFigures {
    /// Every request, of any command.
    pub requests: u64,
    /// Reads.
    pub reads: u64,
    /// Bytes the reads asked for.
    pub read_bytes: u64,
    /// Writes.
    pub writes: u64,
    /// Bytes the writes carried.
    pub written_bytes: u64,
    /// Flushes.
    pub flushes: u64,
    /// Trims.
    pub trims: u64,
    /// Write-zeroes.
    pub write_zeroes: u64,
    /// Block status queries.
    pub block_status: u64,
    /// Replies with an error.
    pub errors: u64,
    /// The longest range one request asked for, in bytes.
    pub largest: u64,
}

/// Adds to a counter only the calling thread writes.
#[inline]
fn bump(c: &AtomicU64, by: u64) {
    c.store(c.load(Relaxed).wrapping_add(by), Relaxed);
}

impl ConnInfo {
    /// A request arrived (called by the connection's reactor only).
    #[inline]
    pub(crate) fn request(&self, command: u16, len: u64) {
        let c = &self.counts;
        bump(&c.requests, 1);
        if len > c.largest.load(Relaxed) {
            c.largest.store(len, Relaxed);
        }
        match command {
            cmd::READ => {
                bump(&c.reads, 1);
                bump(&c.read_bytes, len);
            }
            cmd::WRITE => {
                bump(&c.writes, 1);
                bump(&c.written_bytes, len);
            }
            cmd::FLUSH => bump(&c.flushes, 1),
            cmd::TRIM => bump(&c.trims, 1),
            cmd::WRITE_ZEROES => bump(&c.zeroes, 1),
            cmd::BLOCK_STATUS => bump(&c.block_status, 1),
            _ => {}
        }
    }

    /// An error reply went to it (called by the connection's reactor only).
    #[inline]
    pub(crate) fn error(&self) {
        bump(&self.counts.errors, 1);
    }

    /// Notes what the connection is doing (called by its reactor when something
    /// happened): `busy` while requests are at the device, else idle since `since_ns`
    /// (its client's last progress).
    #[inline]
    pub(crate) fn active(&self, busy: bool, since_ns: u64) {
        let v = if busy { BUSY } else { since_ns };
        if self.active_ns.load(Relaxed) != v {
            self.active_ns.store(v, Relaxed);
        }
    }

    /// Notes whether a request or reply of it is partly moved (called by its reactor).
    #[inline]
    pub(crate) fn moving(&self, moving: bool) {
        if self.moving.load(Relaxed) != moving {
            self.moving.store(moving, Relaxed);
        }
    }

    /// Whether a request of it is partly received or replies wait for it to read them.
    pub fn in_transfer(&self) -> bool {
        self.moving.load(Relaxed)
    }

    /// Notes the bytes of buffers it holds (called by its reactor).
    #[inline]
    pub(crate) fn holding(&self, bytes: usize) {
        if self.held.load(Relaxed) != bytes as u64 {
            self.held.store(bytes as u64, Relaxed);
        }
    }

    /// Bytes of buffers it holds: requests in flight, replies not yet sent.
    pub fn held(&self) -> u64 {
        self.held.load(Relaxed)
    }

    /// How long it has been idle at `now_ns` (monotonic): nothing at the device, and no
    /// request arrived or ended (bytes trickled within a request do not count). `None`
    /// while busy.
    pub fn idle_for(&self, now_ns: u64) -> Option<std::time::Duration> {
        let a = self.active_ns.load(Relaxed);
        (a != BUSY).then(|| std::time::Duration::from_nanos(now_ns.saturating_sub(a)))
    }

    /// How long it has been connected.
    pub fn age(&self) -> std::time::Duration {
        self.started.elapsed()
    }

    /// Its counters now.
    pub fn figures(&self) -> ConnFigures {
        let c = &self.counts;
        ConnFigures {
            requests: c.requests.load(Relaxed),
            reads: c.reads.load(Relaxed),
            read_bytes: c.read_bytes.load(Relaxed),
            writes: c.writes.load(Relaxed),
            written_bytes: c.written_bytes.load(Relaxed),
            flushes: c.flushes.load(Relaxed),
            trims: c.trims.load(Relaxed),
            write_zeroes: c.zeroes.load(Relaxed),
            block_status: c.block_status.load(Relaxed),
            errors: c.errors.load(Relaxed),
            largest: c.largest.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_command_and_forgets_closed_connections() {
        let o = Observer::default();
        let ip = Client::Ip([10, 0, 0, 1].into());
        let a = o.open(("10.0.0.1:5000", ip), "disk", false, "simple", (0, 0));
        let b = o.open(("unix", Client::Uid(0)), "disk", true, "extended", (1, 0));
        a.request(cmd::WRITE, 4096);
        a.request(cmd::WRITE, 512);
        a.request(cmd::READ, 8192);
        a.request(cmd::FLUSH, 0);
        b.request(cmd::TRIM, 1 << 20);
        a.error();
        o.error(errno::EINVAL);
        o.error(12345);
        let f = a.figures();
        assert_eq!((f.requests, f.writes, f.written_bytes), (4, 2, 4608));
        assert_eq!(
            (f.reads, f.read_bytes, f.flushes, f.errors),
            (1, 8192, 1, 1)
        );
        assert_eq!(b.figures().trims, 1);
        assert_eq!(o.connections().len(), 2);
        o.close(&a);
        let left = o.connections();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].id, b.id);
        assert_eq!(o.accepted(), 2);
        let errors = o.errors();
        assert!(errors.contains(&("EINVAL", 1)) && errors.contains(&("other", 1)));
        assert!(errors.contains(&("EIO", 0)));
    }
}
