//! The transmission phase: connections served on a reactor.
//!
//! Each reactor thread has one [`ServerLoop`], which owns the connections handed to that
//! reactor. A connection's socket is read and written with io_uring (one `Recv` and at most
//! one `SendMsg` in flight), its requests go straight into the export's queue on the same
//! reactor, and replies collect in an output queue that is sent with one `sendmsg` per
//! pass: requests and replies batch the way the block layer's plug batches I/O. Nothing
//! crosses to another thread per request.
//!
//! Memory per connection is bounded: a fixed input buffer, data buffers from a pool with
//! a byte limit, and a cap on requests and replies outstanding. When a limit is reached
//! the connection stops reading from its socket until replies drain (backpressure).
//! The input buffer is mapped memory, resident only where a receive wrote; once a
//! connection that wrote it beyond `TRIM_MIN` has been idle for `TRIM_IDLE_NS` (a
//! second), its pages go back to the kernel, so that idle connections stay cheap whatever
//! they did before.
//!
//! A request's path through the files of this folder: `recv` (a receive completes;
//! the header at the head of the input is framed), `request` (checked, then refused or
//! issued: a buffer, the device request, the gate), `rmw` or `block_status` for
//! requests that need more, then `reply` (the reply queued and sent) once the device
//! completes; `limits` holds what bounds a connection's memory and time.

use cairn_core::size::plural;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;

use cairn_core::buf::MAP_MIN;
use cairn_core::{
    AlignedBuf, Core, Device, DirtyBitmaps, Io, IoStatus, Op, Poller, Queue, RingUser, Sink, SinkId,
};

mod block_status;
mod limits;
mod recv;
mod reply;
mod request;
mod rmw;

use crate::proto::command::{Terms, Wide};
use crate::proto::{self, tflags};
use crate::server::admit::Admission;
use crate::server::gate::{Gate, Pass, Wake};
use crate::server::handshake::{ExportInfo, Session};
use crate::server::observe::{Client, ConnInfo, Observer};
use crate::server::pool::{Budget, Buf, BufPool, Mem};
use crate::server::table::Listed;
use crate::tls_send::TlsOut;
use recv::Input;
use reply::Seg;

/// A served export: what clients see, and the device behind it.
pub struct Export {
    /// Name, size, flags and block sizes.
    pub info: ExportInfo,
    /// The device requests go to.
    pub device: Arc<dyn Device>,
    /// Requests not aligned to the device's blocks are refused (EINVAL) even from clients
    /// that did not ask for block sizes, instead of being served by read-modify-write.
    pub strict_alignment: bool,
}

/// The gates of a server's exports: one per device that some export without strict
/// alignment serves (exports of the same device share it), and the wake-ups they send.
pub(crate) struct Gates {
    /// Per export, its device's gate: `None` for a read-only export, and for one whose
    /// device no export without strict alignment can write.
    pub of_export: Vec<Option<Arc<Gate>>>,
    /// How released gates wake reactors.
    pub wake: Arc<Wake>,
}

impl Gates {
    /// Gates for `exports` served on reactors woken through `fds`. A device gets a gate
    /// when an export without strict alignment can write it; then every export that can
    /// write it passes that gate, strict or not.
    pub fn new(exports: &[Export], fds: Vec<Arc<OwnedFd>>) -> Gates {
        let reactors = fds.len();
        let wake = Arc::new(Wake::new(fds));
        let writable = |e: &Export| e.info.flags & tflags::READ_ONLY == 0;
        let key = |e: &Export| Arc::as_ptr(&e.device).cast::<()>();
        let mut by_device: Vec<(*const (), Arc<Gate>)> = Vec::new();
        for e in exports {
            if writable(e) && !e.strict_alignment && by_device.iter().all(|(k, _)| *k != key(e)) {
                by_device.push((key(e), Arc::new(Gate::new(reactors, wake.clone()))));
            }
        }
        let of_export = exports
            .iter()
            .map(|e| {
                // A read-only export refuses writes before they reach a gate.
                let (_, g) = by_device
                    .iter()
                    .find(|(k, _)| writable(e) && *k == key(e))?;
                Some(g.clone())
            })
            .collect();
        Gates { of_export, wake }
    }
}

/// A connection that finished its handshake, on its way to a reactor.
pub struct NewConn {
    /// The socket.
    pub fd: OwnedFd,
    /// The export it chose.
    pub export: Arc<crate::server::table::Listed>,
    /// What was negotiated.
    pub session: Session,
    /// Where the client is, for logs.
    pub peer: String,
    /// Whom it counts against for the per-address limit.
    pub client: Client,
    /// The TLS session, if the client started TLS.
    pub tls: Option<rustls::ServerConnection>,
}

/// Messages to a reactor's server loop.
pub enum Msg {
    /// Serve this connection.
    Conn(Box<NewConn>),
    /// Stop: finish what is in flight, flush, answer the rest with ESHUTDOWN, close.
    Shutdown,
    /// Close connection `id` in slot `slot`, idle for at least `idle` when it was chosen,
    /// for `why`. Still idle, it closes at once (replies it never read are dropped); busy
    /// again meanwhile, it stops reading and closes once its requests are answered.
    Evict {
        /// Its slot on the reactor.
        slot: u32,
        /// Its id (a slot is reused once a connection closes).
        id: u64,
        /// How long it must still be idle to be closed at once.
        idle: std::time::Duration,
        /// Why, for the log.
        why: &'static str,
    },
}

/// Per-connection limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest read or write payload accepted.
    pub max_payload: u32,
    /// Data buffer bytes a connection may hold.
    pub buffer_bytes: usize,
}

/// Input buffer per connection: room for many small requests per `recv`.
const INBUF: usize = 256 << 10;
/// An idle connection whose input buffer (with a TLS connection's ciphertext buffer) was
/// written beyond this gives its pages back.
const TRIM_MIN: usize = 64 << 10;
/// How long a connection must be idle (nothing at the device, no request arriving or
/// ending) before its input buffer's pages go back.
const TRIM_IDLE_NS: u64 = 1_000_000_000;
/// The device token of the timer that looks for input buffers to give back (no
/// connection has index `u32::MAX`).
const TRIM_TOKEN: u64 = u64::MAX;
const _: () = assert!(INBUF >= MAP_MIN, "the input buffer must be a mapping");
/// Requests plus unsent replies per connection.
const MAX_PENDING: usize = 512;
/// iovecs per `sendmsg`.
const IOV_BATCH: usize = 64;
/// Extents per block status reply.
const MAX_EXTENTS: usize = 1 << 16;
/// A write's buffer is charged to the memory budget this far ahead of its payload.
const PAYLOAD_STEP: usize = 1 << 20;
/// Plaintext encrypted per send on a TLS connection (its ciphertext buffer stays small).
const TLS_BATCH: usize = 256 << 10;
/// Beyond this a refused write's payload is not even skipped: the connection is dropped.
/// Skipping costs no memory, only the bandwidth of reading it.
const SKIP_MAX: u64 = 256 << 20;

const RECV: u64 = 1;
const SEND: u64 = 2;
/// A cancellation of the receive in flight (see `TRIM_IDLE_NS`).
const CANCEL: u64 = 3;
/// Ciphertext received per `recv` on a TLS connection.
const RAW_IN: usize = 64 << 10;

/// A TLS connection's ciphertext buffers around the rustls session.
struct TlsIo {
    conn: rustls::ServerConnection,
    /// `RAW_IN` bytes are used (the mapping is at least `MAP_MIN`, see [`Input`]).
    raw_in: Input,
    /// Received ciphertext not yet given to rustls: `raw_in[raw_pos..raw_len]`.
    raw_pos: usize,
    raw_len: usize,
    /// Replies encrypted, on their way to the socket.
    out: TlsOut,
    /// How far `raw_in` was written since its pages last went back.
    raw_touched: usize,
}

/// Token of the flush a connection sends on shutdown (never a request index).
const SHUTDOWN_FLUSH: u32 = u32::MAX;

#[derive(Default)]
struct Req {
    cookie: u64,
    command: u16,
    flags: u16,
    offset: u64,
    len: u64,
    buf: Option<Buf>,
    /// Where the client's bytes start in `buf`: 0, except for an unaligned read or write,
    /// whose buffer holds the whole blocks around them.
    data_off: u32,
    /// A trim or write-zeroes with FUA: flush before replying.
    then_flush: bool,
    /// How it passed the export's gate (writes of every kind, on exports with a gate).
    pass: Pass,
    /// Plain, waiting at the gate, or a step of a read-modify-write.
    stage: Stage,
    /// What only unaligned requests and requests waiting at a gate need.
    slow: Option<Box<Slow>>,
    /// Device requests of the current step still in flight (read-modify-write).
    pending: u8,
    /// The first error of a read-modify-write's step (0: none).
    error: i32,
}

/// The part of a request that only unaligned requests and requests waiting at a gate
/// need: boxed, so that every other request stays small.
#[derive(Default)]
struct Slow {
    /// A read-modify-write's range (an unaligned write or write-zeroes).
    wide: Option<Wide>,
    /// A write waiting at the gate: the device request to submit once it may.
    waiting_io: Option<Io>,
}

impl Req {
    /// Request `r` as received, with its data buffer.
    fn of(r: &proto::Request, buf: Option<Buf>) -> Req {
        Req {
            cookie: r.cookie,
            command: r.command,
            flags: r.flags,
            offset: r.offset,
            len: r.len,
            buf,
            ..Req::default()
        }
    }

    /// A read-modify-write's range.
    fn wide(&self) -> Option<Wide> {
        self.slow.as_ref().and_then(|s| s.wide)
    }
}

/// Where a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Stage {
    /// One device request in flight (and perhaps a flush after it).
    #[default]
    Plain,
    /// Waiting at the gate for an earlier read-modify-write (or, being one, for earlier
    /// writes) on the same blocks.
    Waiting,
    /// A read-modify-write reads its edge blocks.
    Edges,
    /// A read-modify-write writes its blocks.
    Writing,
    /// A read-modify-write with FUA flushes.
    Flushing,
}

/// Where the receive in flight writes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RecvTarget {
    Inbuf,
    Payload,
    Raw,
}

/// Where the next received bytes go.
enum Rx {
    /// Request headers, into the input buffer.
    Header,
    /// The payload of write request `req`, of which `got` bytes arrived.
    Payload { req: u32, got: u32 },
    /// A refused request's payload, skipped; then the error reply is sent.
    Skip {
        left: u64,
        cookie: u64,
        offset: u64,
        error: u32,
    },
}

struct ConnState {
    inbuf: Input,
    rs: usize,
    re: usize,
    /// How far the input buffer was written since its pages last went back.
    touched: usize,
    /// Listed in `ServerLoop::wide`: its input buffer is to be given back once idle.
    wide: bool,
    /// The receive in flight is being cancelled, so that the input buffer it would
    /// write can be given back.
    trimming: bool,
    rx: Rx,
    recv_armed: bool,
    recv_target: RecvTarget,
    send_armed: bool,
    dirty: bool,
    reqs: Vec<Req>,
    free_reqs: Vec<u32>,
    in_flight: u32,
    /// When the client last made progress (cached clock): a request arrived (its header)
    /// or ended at the device. Idle time counts from it, so bytes trickled in the middle
    /// of a request, or a reply read a byte at a time, do not keep a connection busy.
    progress_ns: u64,
    pool: BufPool,
    out: VecDeque<Seg>,
    /// Bytes of the front segment already sent.
    out_sent: usize,
    iov: Vec<libc::iovec>,
    msg: libc::msghdr,
    /// No more requests will be read (end of stream, DISC, or shutdown).
    eof: bool,
    /// Hard disconnect: send nothing more, close once nothing is in flight.
    dead: bool,
    /// Waiting for a buffer or room in the output queue.
    blocked: bool,
    /// Waiting for memory of the server's budget (listed in `ServerLoop::mem_waiting`).
    mem_wait: bool,
    shutdown_flush: ShutdownFlush,
    tls: Option<Box<TlsIo>>,
    counts: Counts,
    /// When the connection came to this reactor.
    since: std::time::Instant,
    /// Why it ended, once it does (the first reason wins).
    ended: &'static str,
    /// A request error was logged already (one per connection).
    warned: bool,
    /// The request at the head of the input was counted already: it waits for a buffer.
    recounted: bool,
}

impl ConnState {
    /// Records why the connection ends, unless a reason is known already.
    fn end(&mut self, why: &'static str) {
        if self.ended.is_empty() {
            self.ended = why;
        }
    }
}

/// What a connection did, logged when it closes.
#[derive(Default, Debug)]
struct Counts {
    /// Requests not aligned to the device's blocks, served by widening them.
    unaligned: u64,
    recvs: u64,
    recv_bytes: u64,
    sends: u64,
    send_bytes: u64,
}

impl ConnState {
    /// Whether replies are waiting to go out (segments, or ciphertext on TLS).
    fn output_pending(&self) -> bool {
        !self.out.is_empty()
            || self
                .tls
                .as_ref()
                .is_some_and(|t| t.out.pending() || t.conn.wants_write())
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ShutdownFlush {
    NotYet,
    Sent,
    Done,
}

struct Conn {
    index: u32,
    fd: OwnedFd,
    export: Arc<crate::server::table::Listed>,
    queue: Rc<dyn Queue>,
    session: Session,
    /// What its requests are checked against.
    terms: Terms,
    /// The export's gate, which its writes pass (`None` when it has none).
    gate: Option<Arc<Gate>>,
    /// The dirty bitmaps its block status reports, with their context ids.
    bitmaps: Vec<(u32, Arc<dyn cairn_core::DirtyMap>)>,
    peer: String,
    /// What operators see of it.
    info: Arc<ConnInfo>,
    st: RefCell<ConnState>,
}

impl Conn {
    /// Bytes of a request header on this connection.
    #[inline]
    fn header_len(&self) -> usize {
        if self.session.extended {
            proto::EXTENDED_HEADER
        } else {
            proto::REQUEST_HEADER
        }
    }
}

/// What `next_request` wants the caller to do (outside the state borrow).
enum Next {
    Submit(Io),
    Again,
    Stop,
}

/// A reactor's queue of one export: the export's id, the queue, the connections using it.
type ExportQueue = (u64, Rc<dyn Queue>, usize);

/// The server side of one reactor: a ring user (socket I/O), a sink (device completions)
/// and a poller (new connections, and one send per connection per pass).
pub struct ServerLoop {
    core: Rc<Core>,
    user: Cell<u16>,
    sink: Cell<SinkId>,
    /// This reactor's queue of each export it serves, by export id, with the
    /// connections using it.
    queues: RefCell<Vec<ExportQueue>>,
    conns: RefCell<Vec<Option<Rc<Conn>>>>,
    free_conns: RefCell<Vec<u32>>,
    dirty: RefCell<Vec<u32>>,
    spare: RefCell<Vec<u32>>,
    inbox: Receiver<Msg>,
    wake: Arc<OwnedFd>,
    shutting: Cell<bool>,
    admission: Arc<Admission>,
    limits: Limits,
    observer: Arc<Observer>,
    /// This reactor's index (its slot in the gates' counters).
    reactor: usize,
    gates: Arc<Gates>,
    /// Requests waiting at a gate: (connection, request).
    waiting: RefCell<Vec<(u32, u32)>>,
    /// The gates' generation when the waiting requests were last retried.
    retried_at: Cell<u64>,
    /// Device requests to submit once the connection's state is no longer borrowed.
    submits: RefCell<Vec<(u32, Io)>>,
    /// This reactor's share of the memory budget, and its kept buffers.
    mem: Rc<Mem>,
    /// Connections waiting for memory.
    mem_waiting: RefCell<Vec<u32>>,
    /// The budget's generation when they last retried.
    mem_retried_at: Cell<u64>,
    /// Connections (index, id) whose input buffers were written beyond `TRIM_MIN`, to
    /// be given back once they are idle.
    wide: RefCell<Vec<(u32, u64)>>,
    /// The timer that looks at them is set.
    trim_timer: Cell<bool>,
}

impl ServerLoop {
    /// Registers a server loop on `core`; connections arrive through `inbox`, announced by
    /// a write to the eventfd `wake`. `admission` counts open connections across
    /// reactors.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        core: &Rc<Core>,
        inbox: Receiver<Msg>,
        (reactor, wake): (usize, Arc<OwnedFd>),
        gates: Arc<Gates>,
        (admission, budget): (Arc<Admission>, Arc<Budget>),
        limits: Limits,
        observer: Arc<Observer>,
    ) -> Result<Rc<ServerLoop>, cairn_core::Error> {
        let lp = Rc::new(ServerLoop {
            core: core.clone(),
            user: Cell::new(0),
            sink: Cell::new(SinkId(u32::MAX)),
            queues: RefCell::new(Vec::new()),
            conns: RefCell::new(Vec::new()),
            free_conns: RefCell::new(Vec::new()),
            dirty: RefCell::new(Vec::new()),
            spare: RefCell::new(Vec::new()),
            inbox,
            wake,
            shutting: Cell::new(false),
            admission,
            limits,
            observer,
            reactor,
            gates,
            waiting: RefCell::new(Vec::new()),
            retried_at: Cell::new(0),
            submits: RefCell::new(Vec::new()),
            // Kept buffers count against the budget: an eighth of it at most per reactor.
            mem: Mem::new(budget.clone(), limits.buffer_bytes.min(budget.limit() / 8)),
            mem_waiting: RefCell::new(Vec::new()),
            mem_retried_at: Cell::new(0),
            wide: RefCell::new(Vec::new()),
            trim_timer: Cell::new(false),
        });
        lp.user.set(core.register_ring_user(lp.clone())?);
        lp.sink.set(core.register_sink(lp.clone()));
        core.register_poller(lp.clone());
        Ok(lp)
    }

    fn conn(&self, index: u32) -> Option<Rc<Conn>> {
        self.conns.borrow().get(index as usize).cloned().flatten()
    }

    fn mark_dirty(&self, conn: &Conn, st: &mut ConnState) {
        if !st.dirty {
            st.dirty = true;
            self.dirty.borrow_mut().push(conn.index);
        }
    }

    /// This reactor's queue of `export`, for one more connection.
    fn queue_for(&self, export: &Listed) -> Result<Rc<dyn Queue>, cairn_core::Error> {
        let mut queues = self.queues.borrow_mut();
        if let Some(q) = queues.iter_mut().find(|q| q.0 == export.id) {
            q.2 += 1;
            return Ok(q.1.clone());
        }
        let q = export.export.device.open_queue(&self.core)?;
        queues.push((export.id, q.clone(), 1));
        Ok(q)
    }

    /// A connection to `export` ended: an added export's queue closes with its last one
    /// (the device may be closed once the export is removed).
    fn queue_done(&self, export: &Listed) {
        let mut queues = self.queues.borrow_mut();
        if let Some(i) = queues.iter().position(|q| q.0 == export.id) {
            queues[i].2 -= 1;
            if queues[i].2 == 0 && export.added {
                queues.remove(i);
            }
        }
    }

    /// What requests on a connection to `export` with `session` are checked against.
    fn terms(&self, e: &Export, session: &Session) -> Terms {
        Terms {
            flags: session.flags,
            structured: session.structured,
            extended: session.extended,
            block_status: session.base_allocation || !session.bitmaps.is_empty(),
            // The export advertises a minimum block of 1 unless it is strict: every
            // client may then send any byte, whether it asked for block sizes or not.
            relaxed: !e.strict_alignment,
            fast_zero: e.info.flags & tflags::SEND_FAST_ZERO != 0,
            max_payload: self.limits.max_payload,
            geometry: e.device.geometry(),
        }
    }

    /// A new connection's state: empty buffers, nothing in flight.
    fn new_state(&self, tls: Option<rustls::ServerConnection>, id: u64) -> ConnState {
        let mut out = VecDeque::new();
        out.reserve_exact(MAX_PENDING + 1);
        // SAFETY: msghdr is plain data; all-zero is a valid empty header.
        let msg: libc::msghdr = unsafe { std::mem::zeroed() };
        ConnState {
            inbuf: Input(AlignedBuf::new(INBUF)),
            rs: 0,
            re: 0,
            touched: 0,
            wide: false,
            trimming: false,
            rx: Rx::Header,
            recv_armed: false,
            recv_target: RecvTarget::Inbuf,
            send_armed: false,
            dirty: false,
            reqs: Vec::with_capacity(MAX_PENDING),
            free_reqs: Vec::with_capacity(MAX_PENDING),
            in_flight: 0,
            progress_ns: self.core.now_ns(),
            pool: BufPool::new(self.mem.clone(), self.limits.buffer_bytes, id),
            out,
            out_sent: 0,
            iov: Vec::with_capacity(IOV_BATCH),
            msg,
            eof: false,
            dead: false,
            blocked: false,
            mem_wait: false,
            shutdown_flush: ShutdownFlush::NotYet,
            counts: Counts::default(),
            since: std::time::Instant::now(),
            ended: "",
            warned: false,
            recounted: false,

            tls: tls.map(|mut c| {
                // Replies are bounded by the connection's own limits.
                c.set_buffer_limit(None);
                Box::new(TlsIo {
                    conn: c,
                    raw_in: Input(AlignedBuf::new(RAW_IN.max(MAP_MIN))),
                    raw_pos: 0,
                    raw_len: 0,
                    out: TlsOut::with_capacity(RAW_IN),
                    raw_touched: 0,
                })
            }),
        }
    }

    fn accept(&self, nc: NewConn) {
        let export = nc.export.clone();
        let queue = match self.queue_for(&export) {
            Ok(q) => q,
            Err(e) => {
                log::warn!(
                    "cairn: serve: {}: cannot open export '{}': {e}",
                    nc.peer,
                    export.export.info.name
                );
                self.admission.leave(nc.client);
                return;
            }
        };
        // The bitmaps it asked for, held for as long as it lives (a bitmap being read is
        // not removed); one removed since the handshake ends it.
        let mut bitmaps = Vec::with_capacity(nc.session.bitmaps.len());
        let kept = export.export.device.capability::<dyn DirtyBitmaps>();
        for (id, name) in &nc.session.bitmaps {
            match kept.as_ref().and_then(|k| k.reader(name)) {
                Some(b) => bitmaps.push((*id, b)),
                None => {
                    log::warn!(
                        "cairn: serve: {}: export '{}': bitmap '{name}' was removed during the handshake",
                        nc.peer,
                        export.export.info.name
                    );
                    self.queue_done(&export);
                    self.admission.leave(nc.client);
                    return;
                }
            }
        }
        export
            .conns
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let index = match self.free_conns.borrow_mut().pop() {
            Some(i) => i,
            None => {
                let mut conns = self.conns.borrow_mut();
                conns.push(None);
                conns.len() as u32 - 1
            }
        };
        let headers = if nc.session.extended {
            "extended"
        } else if nc.session.structured {
            "structured"
        } else {
            "simple"
        };
        let info = self.observer.open(
            (&nc.peer, nc.client),
            &export.export.info.name,
            nc.tls.is_some(),
            headers,
            (self.reactor, index),
        );
        let id = info.id;
        let conn = Rc::new(Conn {
            index,
            info,
            fd: nc.fd,
            terms: self.terms(&export.export, &nc.session),
            gate: export.gate.clone(),
            export,
            queue,
            bitmaps,
            session: nc.session,
            peer: nc.peer,
            st: RefCell::new(self.new_state(nc.tls, id)),
        });
        self.conns.borrow_mut()[index as usize] = Some(conn.clone());
        let mut st = conn.st.borrow_mut();
        log::info!(
            "cairn: serve: {}: connected to export '{}'{} ({} headers)",
            conn.peer,
            conn.export.export.info.name,
            if st.tls.is_some() { " over TLS" } else { "" },
            conn.info.headers
        );
        if self.shutting.get() {
            st.end("the server is shutting down");
            st.eof = true;
        }
        self.mark_dirty(&conn, &mut st);
        drop(st);
        // A TLS session may hold requests that arrived with the end of the handshake.
        self.process(&conn);
    }

    /// Parses and starts every complete request in the input.
    fn process(&self, conn: &Conn) {
        {
            let mut st = conn.st.borrow_mut();
            st.pump_tls(&conn.peer);
            let raw = st.tls.as_mut().map_or(0, |t| {
                t.raw_touched = t.raw_touched.max(t.raw_len);
                t.raw_touched
            });
            if st.re > st.touched || raw > 0 {
                st.touched = st.touched.max(st.re);
                if st.touched + raw > TRIM_MIN && !st.wide {
                    st.wide = true;
                    self.wide.borrow_mut().push((conn.index, conn.info.id));
                    self.set_trim_timer();
                }
            }
        }
        loop {
            let next = {
                let mut st = conn.st.borrow_mut();
                self.next_request(conn, &mut st)
            };
            match next {
                Next::Submit(io) => conn.queue.submit(io),
                Next::Again => {}
                Next::Stop => break,
            }
        }
        if !self.submits.borrow().is_empty() {
            self.drain_submits();
        }
        let mut st = conn.st.borrow_mut();
        self.maybe_shutdown_flush(conn, &mut st);
        self.mark_dirty(conn, &mut st);
    }

    /// On shutdown, once nothing is in flight, one flush makes the connection's writes
    /// durable before it closes.
    fn maybe_shutdown_flush(&self, conn: &Conn, st: &mut ConnState) {
        if self.shutting.get()
            && st.shutdown_flush == ShutdownFlush::NotYet
            && st.in_flight == 0
            && matches!(st.rx, Rx::Header)
            && !st.dead
        {
            st.shutdown_flush = ShutdownFlush::Sent;
            st.in_flight += 1;
            let io = Io::nodata(
                Op::Flush,
                0,
                0,
                self.sink.get(),
                (u64::from(conn.index) << 32) | u64::from(SHUTDOWN_FLUSH),
            );
            // Submitted from here: a queue never completes inside submit, so this cannot
            // re-enter the connection's state.
            conn.queue.submit(io);
        }
    }

    /// Pushes the SQEs a connection needs (a send, a receive), or closes it when done.
    fn arm(&self, conn: &Rc<Conn>) {
        let mut st = conn.st.borrow_mut();
        st.dirty = false;
        let fd = conn.fd.as_raw_fd();
        // What the idle timeout sees: busy while requests are at the device, else idle
        // from the client's last progress (a request that arrived or ended). Waiting for
        // memory is busy too, unless replies wait that the client does not read: such a
        // connection is closed when others wait for memory.
        let waits = st.mem_wait && !st.output_pending();
        conn.info.active(st.in_flight > 0 || waits, st.progress_ns);
        conn.info
            .moving(!matches!(st.rx, Rx::Header) || st.rs < st.re || st.output_pending());
        conn.info.holding(st.pool.outstanding());
        let finished = st.in_flight == 0 && !st.output_pending() && !self.awaiting_flush(&st);
        if st.dead || (st.eof && finished) {
            if st.recv_armed || st.send_armed {
                // Make a pending receive or send finish now; we are called again then.
                let _ = rustix::net::shutdown(&conn.fd, rustix::net::Shutdown::Both);
            } else if st.in_flight == 0 {
                drop(st);
                self.close(conn);
            }
            // Else device requests are in flight: their completions call us again.
            return;
        }
        if !st.send_armed && st.output_pending() {
            if st.tls.is_some() {
                self.push_send_tls(conn, &mut st, fd);
            } else {
                self.push_send(conn, &mut st, fd);
            }
        }
        if !st.recv_armed && !st.eof && !st.mem_wait {
            self.push_recv(conn, &mut st, fd);
        }
    }

    fn awaiting_flush(&self, st: &ConnState) -> bool {
        self.shutting.get() && st.shutdown_flush != ShutdownFlush::Done
    }

    fn close(&self, conn: &Rc<Conn>) {
        let mut st = conn.st.borrow_mut();
        if st.ended.is_empty() && st.dead {
            st.ended = "a TLS or connection error";
        }
        let c = &st.counts;
        let f = conn.info.figures();
        log::info!(
            "cairn: serve: {}: disconnected from export '{}' after {:.3} s: {} ({}, {}, {}, {}, {}, {} block status; the longest {} bytes{}), {} bytes received, {} bytes sent ({})",
            conn.peer,
            conn.export.export.info.name,
            st.since.elapsed().as_secs_f64(),
            plural(f.requests, "request", "requests"),
            plural(f.reads, "read", "reads"),
            plural(f.writes, "write", "writes"),
            plural(f.flushes, "flush", "flushes"),
            plural(f.trims, "trim", "trims"),
            plural(f.write_zeroes, "write-zeroes", "write-zeroes"),
            f.block_status,
            f.largest,
            if c.unaligned > 0 {
                format!("; {} not aligned to blocks", c.unaligned)
            } else {
                String::new()
            },
            c.recv_bytes,
            c.send_bytes,
            if st.ended.is_empty() { "closed" } else { st.ended }
        );
        st.out.clear();
        drop(st);
        self.observer.close(&conn.info);
        self.conns.borrow_mut()[conn.index as usize] = None;
        self.free_conns.borrow_mut().push(conn.index);
        conn.export
            .conns
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        self.queue_done(&conn.export);
        self.admission.leave(conn.info.client);
        if self.shutting.get() && self.conns.borrow().iter().all(Option::is_none) {
            self.core.stop();
        }
    }

    /// Whether shutdown has begun and every connection has closed.
    pub fn ended(&self) -> bool {
        self.shutting.get() && self.conns.borrow().iter().all(Option::is_none)
    }

    fn shutdown(&self) {
        if self.shutting.replace(true) {
            return;
        }
        let conns: Vec<Rc<Conn>> = self.conns.borrow().iter().flatten().cloned().collect();
        if conns.is_empty() {
            self.core.stop();
        }
        for c in conns {
            self.process(&c);
        }
    }
}

impl Sink for ServerLoop {
    fn io_done(&self, token: u64, status: IoStatus) {
        if token == TRIM_TOKEN {
            self.trim_idle();
            return;
        }
        let Some(conn) = self.conn((token >> 32) as u32) else {
            return;
        };
        let index = token as u32;
        let resubmit = {
            let mut st = conn.st.borrow_mut();
            st.in_flight -= 1;
            st.progress_ns = self.core.now_ns();
            if index == SHUTDOWN_FLUSH {
                st.shutdown_flush = ShutdownFlush::Done;
                if !status.is_ok() {
                    log::warn!(
                        "cairn: serve: {}: flush on shutdown failed: {status}",
                        conn.peer
                    );
                }
                st.end("the server is shutting down");
                st.eof = true;
                self.mark_dirty(&conn, &mut st);
                return;
            }
            let r = &mut st.reqs[index as usize];
            if r.stage != Stage::Plain {
                self.rmw_done(&conn, &mut st, index, status);
                None
            } else if status.is_ok() && r.then_flush {
                r.then_flush = false;
                st.in_flight += 1;
                Some(Io::nodata(Op::Flush, 0, 0, self.sink.get(), token))
            } else {
                self.finish_plain(&conn, &mut st, index, status);
                None
            }
        };
        if let Some(io) = resubmit {
            conn.queue.submit(io);
            return;
        }
        if !self.submits.borrow().is_empty() {
            self.drain_submits();
        }
        let (blocked, flush) = {
            let st = conn.st.borrow();
            (st.blocked, self.shutting.get() && st.in_flight == 0)
        };
        if blocked || flush {
            conn.st.borrow_mut().blocked = false;
            self.process(&conn);
        }
    }
}

impl RingUser for ServerLoop {
    fn ring_complete(&self, cookie: u64, res: i32) {
        let Some(conn) = self.conn((cookie >> 8) as u32) else {
            return;
        };
        match cookie & 0xff {
            RECV => self.received(&conn, res),
            SEND => self.sent(&conn, res),
            // A cancellation's own completion: the receive it cancelled says the rest.
            _ => {}
        }
    }
}

impl Poller for ServerLoop {
    fn unplug(&self) {
        // Swap the dirty list out (no allocation: the two vectors trade places).
        let mut work = std::mem::take(&mut *self.spare.borrow_mut());
        std::mem::swap(&mut work, &mut *self.dirty.borrow_mut());
        for &i in &work {
            if let Some(c) = self.conn(i) {
                self.arm(&c);
            }
        }
        work.clear();
        *self.spare.borrow_mut() = work;
    }

    fn reap(&self) -> usize {
        let mut n = 0;
        if !self.waiting.borrow().is_empty() {
            n += self.retry_waiting();
        }
        if !self.mem_waiting.borrow().is_empty() {
            n += self.retry_memory();
        }
        if self.mem.budget().short() && self.mem.keeps() {
            // Connections wait for memory somewhere: kept buffers go back.
            self.mem.drop_cache();
        }
        loop {
            match self.inbox.try_recv() {
                Ok(Msg::Conn(c)) => {
                    self.accept(*c);
                    n += 1;
                }
                Ok(Msg::Evict {
                    slot,
                    id,
                    idle,
                    why,
                }) => self.evict(slot, id, idle, why),
                Ok(Msg::Shutdown) | Err(TryRecvError::Disconnected) => {
                    self.shutdown();
                    break;
                }
                Err(TryRecvError::Empty) => break,
            }
        }
        n
    }

    fn busy(&self) -> bool {
        !self.shutting.get()
    }

    fn event_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }

    fn clear_event(&self) {
        cairn_core::event::reset(&*self.wake);
    }
}
