//! A device's queue on one reactor: its state (request slots, NBD requests in flight, its
//! connections with their input and output buffers), its life (opened with connections,
//! closed giving them back to the device), and the completions dispatched to the files
//! of this folder, which follow a request's path: `request`, `send`, `recv`, `reply`,
//! and `connection` for connections coming and going.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use cairn_core::{
    Core, Error, Io, IoStatus, Op, Poller, Queue, QueueStats, RingUser, Sink, SinkId,
};

use crate::client::handshake::{Connected, Negotiated};
use crate::gather;
use crate::proto;
use crate::tls_send::TlsOut;

use super::connect::Made;
use super::ledger::{Unflushed, Watch};
use super::{Idle, Shared, CONNECTIONS_MAX};

mod connection;
mod recv;
mod reply;
mod request;
mod send;

/// Requests a queue accepts before it parks more in a FIFO.
const QUEUE_DEPTH: usize = 256;
/// NBD requests in flight per queue (a split request takes one per part).
const MAX_REQS: usize = 1024;
/// Input buffer per connection.
const INBUF: usize = 256 << 10;
/// Largest chunk payload (other than read data) accepted; beyond it the server is broken.
const MAX_SMALL: u64 = 64 << 10;
/// Read data still to come from which it is received straight into the read's buffer.
const DIRECT_MIN: usize = 64 << 10;
/// iovecs per `sendmsg`.
const IOV_BATCH: usize = 64;

const RECV: u64 = 1;
const SEND: u64 = 2;
const NONE: u32 = u32::MAX;
const NO_CONN: u16 = u16::MAX;

/// Ciphertext received per `recv` on a TLS connection.
const RAW_IN: usize = 64 << 10;
/// Plaintext encrypted per send on a TLS connection: large, for large writes to go in
/// few sends; it bounds the ciphertext buffer.
const TLS_BATCH: usize = 4 << 20;

/// The token of the queue's own flushes (timers use 0).
const VERIFY: u64 = 1;

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

/// A TLS connection's ciphertext around its rustls session: requests are encrypted into
/// `out` and sent from there; what arrives in `raw_in` is decrypted into the input buffer
/// (never straight into a read's buffer).
struct ClientTls {
    conn: Box<rustls::ClientConnection>,
    raw_in: Box<[u8]>,
    /// Received ciphertext not yet given to rustls: `raw_in[raw_pos..raw_len]`.
    raw_pos: usize,
    raw_len: usize,
    /// Requests encrypted, on their way to the socket.
    out: TlsOut,
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

impl State {
    /// A new queue's state: every slot and NBD request free, its connections down, all
    /// of it allocated up front.
    fn new(shared: &Shared) -> State {
        State {
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
            free_ios: (0..QUEUE_DEPTH as u32).rev().collect(),
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
        }
    }
}

/// One device's queue on one reactor.
pub(super) struct NbdQueue {
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

impl NbdQueue {
    /// Opens a queue on `core`'s reactor: registered with the reactor, with connections
    /// made (see `connect_all`) or being made in the background.
    pub(super) fn open(core: &Rc<Core>, shared: Arc<Shared>) -> Result<Rc<dyn Queue>, Error> {
        let (tx, rx) = channel();
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
            st: RefCell::new(State::new(&shared)),
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
        q.connect_all(&mut q.st.borrow_mut());
        Ok(q)
    }

    fn mark_dirty(&self, st: &mut State, ci: usize) {
        if !st.conns[ci].dirty {
            st.conns[ci].dirty = true;
            st.dirty.push(ci as u16);
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
}

fn range_of(io: &Io) -> u64 {
    if io.op == Op::Flush {
        0
    } else {
        io.len
    }
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
                t.raw_pos == t.raw_len && !t.out.pending() && !t.conn.wants_write()
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
