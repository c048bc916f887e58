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

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;

use io_uring::{opcode, types};

use cairn_core::buf::MAP_MIN;
use cairn_core::{
    AlignedBuf, Core, Device, Io, IoFlags, IoStatus, Op, Poller, Queue, RingUser, Sink, SinkId,
};

use crate::gather::{self, Segment};
use crate::proto::command::{self, Command, Refusal, Terms, Wide};
use crate::proto::{self, cflags, chunk, cmd, errno, tflags};
use crate::server::admit::Admission;
use crate::server::gate::{Gate, Pass, Wake};
use crate::server::handshake::{ExportInfo, Session};
use crate::server::observe::{Client, ConnInfo, Observer};
use crate::server::pool::{Budget, Buf, BufPool, Mem};

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
    raw_out: Vec<u8>,
    raw_sent: usize,
    /// How far `raw_in` was written since its pages last went back.
    raw_touched: usize,
}

/// Token of the flush a connection sends on shutdown (never a request index).
const SHUTDOWN_FLUSH: u32 = u32::MAX;

/// A connection's input buffer: mapped memory (an [`AlignedBuf`] of `MAP_MIN` bytes or
/// more), resident only where a receive wrote. From the heap, the allocator would zero a
/// reused block by writing it: after connections came and went, every new connection's
/// 256 KiB would be resident before it received a byte (measured: a server with 1,000
/// idle connections, after two rounds of 1,000 opened and closed, held 272 MiB; 20 MiB
/// with the mapping).
struct Input(AlignedBuf);

impl Input {
    /// Gives the first `touched` bytes' pages back to the kernel; they read as zeroes
    /// when next touched. The caller makes sure that no receive in flight writes here
    /// and that nothing in the buffer is still needed.
    fn release(&mut self, touched: usize) {
        let len = touched.next_multiple_of(4096).min(self.0.len());
        // SAFETY: the buffer is a private anonymous mapping of at least `len` bytes (an
        // AlignedBuf of MAP_MIN or more), owned here; MADV_DONTNEED only replaces its
        // pages with zero pages, and `&mut self` means nobody reads them meanwhile.
        unsafe { libc::madvise(self.0.as_mut_ptr().cast(), len, libc::MADV_DONTNEED) };
    }
}

impl std::ops::Deref for Input {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.0.as_slice()
    }
}

impl std::ops::DerefMut for Input {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.0.as_mut_slice()
    }
}

/// A reply waiting to be sent: a header and, for a read or a block status, a buffer.
struct Seg {
    /// Room for an extended chunk header and a read's 8-byte offset.
    head: [u8; 40],
    head_len: u8,
    buf: Option<Buf>,
    /// Where the data starts in `buf` (not 0 for a read widened to whole blocks).
    data_off: u32,
    data_len: u32,
}

impl gather::Segment for Seg {
    fn head(&self) -> &[u8] {
        &self.head[..usize::from(self.head_len)]
    }

    fn data(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], |b| {
            &b.as_slice()[self.data_off as usize..][..self.data_len as usize]
        })
    }
}

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
                .is_some_and(|t| t.raw_sent < t.raw_out.len() || t.conn.wants_write())
    }

    /// Moves decrypted bytes from the TLS session into the input buffer, feeding rustls
    /// the received ciphertext a record at a time (its plaintext buffer is small). Marks
    /// the connection dead on a TLS error.
    fn pump_tls(&mut self, peer: &str) {
        let ConnState {
            tls,
            inbuf,
            rs,
            re,
            dead,
            ..
        } = self;
        let Some(t) = tls.as_mut() else { return };
        loop {
            if *rs > 0 && (*rs == *re || *re == inbuf.len()) {
                inbuf.copy_within(*rs..*re, 0);
                *re -= *rs;
                *rs = 0;
            }
            while *re < inbuf.len() {
                match std::io::Read::read(&mut t.conn.reader(), &mut inbuf[*re..]) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => *re += n,
                }
            }
            if *re == inbuf.len() || t.raw_pos == t.raw_len {
                return;
            }
            let mut rd = &t.raw_in[t.raw_pos..t.raw_len];
            let before = rd.len();
            let fed = t.conn.read_tls(&mut rd);
            t.raw_pos += before - rd.len();
            let processed = fed.map_err(|e| e.to_string()).and_then(|_| {
                t.conn
                    .process_new_packets()
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            });
            if let Err(e) = processed {
                log::warn!("cairn: serve: {peer}: TLS: {e}");
                *dead = true;
                return;
            }
        }
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
    export: usize,
    queue: Rc<dyn Queue>,
    session: Session,
    /// What its requests are checked against.
    terms: Terms,
    /// The export's gate, which its writes pass (`None` when it has none).
    gate: Option<Arc<Gate>>,
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

/// The server side of one reactor: a ring user (socket I/O), a sink (device completions)
/// and a poller (new connections, and one send per connection per pass).
pub struct ServerLoop {
    core: Rc<Core>,
    user: Cell<u16>,
    sink: Cell<SinkId>,
    exports: Arc<Vec<Export>>,
    queues: RefCell<Vec<Option<Rc<dyn Queue>>>>,
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
        exports: Arc<Vec<Export>>,
        inbox: Receiver<Msg>,
        (reactor, wake): (usize, Arc<OwnedFd>),
        gates: Arc<Gates>,
        (admission, budget): (Arc<Admission>, Arc<Budget>),
        limits: Limits,
        observer: Arc<Observer>,
    ) -> Result<Rc<ServerLoop>, cairn_core::Error> {
        let n = exports.len();
        let lp = Rc::new(ServerLoop {
            core: core.clone(),
            user: Cell::new(0),
            sink: Cell::new(SinkId(u32::MAX)),
            exports,
            queues: RefCell::new((0..n).map(|_| None).collect()),
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

    fn queue_for(&self, export: usize) -> Result<Rc<dyn Queue>, cairn_core::Error> {
        if let Some(q) = &self.queues.borrow()[export] {
            return Ok(q.clone());
        }
        let q = self.exports[export].device.open_queue(&self.core)?;
        self.queues.borrow_mut()[export] = Some(q.clone());
        Ok(q)
    }

    /// What requests on a connection to `export` with `session` are checked against.
    fn terms(&self, export: usize, session: &Session) -> Terms {
        let e = &self.exports[export];
        Terms {
            flags: session.flags,
            structured: session.structured,
            extended: session.extended,
            base_allocation: session.base_allocation,
            relaxed: !e.strict_alignment && !session.block_sizes_agreed,
            fast_zero: e.info.flags & tflags::SEND_FAST_ZERO != 0,
            max_payload: self.limits.max_payload,
            geometry: e.device.geometry(),
        }
    }

    fn accept(&self, nc: NewConn) {
        let export = nc.session.export;
        let queue = match self.queue_for(export) {
            Ok(q) => q,
            Err(e) => {
                log::warn!(
                    "cairn: serve: {}: cannot open export '{}': {e}",
                    nc.peer,
                    self.exports[export].info.name
                );
                self.admission.leave(nc.client);
                return;
            }
        };
        let index = match self.free_conns.borrow_mut().pop() {
            Some(i) => i,
            None => {
                let mut conns = self.conns.borrow_mut();
                conns.push(None);
                conns.len() as u32 - 1
            }
        };
        let mut out = VecDeque::new();
        out.reserve_exact(MAX_PENDING + 1);
        // SAFETY: msghdr is plain data; all-zero is a valid empty header.
        let msg: libc::msghdr = unsafe { std::mem::zeroed() };
        let headers = if nc.session.extended {
            "extended"
        } else if nc.session.structured {
            "structured"
        } else {
            "simple"
        };
        let info = self.observer.open(
            (&nc.peer, nc.client),
            &self.exports[export].info.name,
            nc.tls.is_some(),
            headers,
            (self.reactor, index),
        );
        let id = info.id;
        let conn = Rc::new(Conn {
            index,
            info,
            fd: nc.fd,
            export,
            queue,
            terms: self.terms(export, &nc.session),
            gate: self.gates.of_export[export].clone(),
            session: nc.session,
            peer: nc.peer,
            st: RefCell::new(ConnState {
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

                tls: nc.tls.map(|mut c| {
                    // Replies are bounded by the connection's own limits.
                    c.set_buffer_limit(None);
                    Box::new(TlsIo {
                        conn: c,
                        raw_in: Input(AlignedBuf::new(RAW_IN.max(MAP_MIN))),
                        raw_pos: 0,
                        raw_len: 0,
                        raw_out: Vec::with_capacity(RAW_IN),
                        raw_sent: 0,
                        raw_touched: 0,
                    })
                }),
            }),
        });
        self.conns.borrow_mut()[index as usize] = Some(conn.clone());
        let mut st = conn.st.borrow_mut();
        log::info!(
            "cairn: serve: {}: connected to export '{}'{} ({} headers)",
            conn.peer,
            self.exports[export].info.name,
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

    /// Looks at the connections with wide input buffers in a second.
    fn set_trim_timer(&self) {
        if !self.trim_timer.replace(true) && !self.shutting.get() {
            self.core.add_timer(
                self.core.now_ns() + TRIM_IDLE_NS,
                self.sink.get(),
                TRIM_TOKEN,
            );
        }
    }

    /// Gives back the input buffers of listed connections idle for `TRIM_IDLE_NS`: at
    /// once when no receive targets the buffer (a payload received directly), else once
    /// the receive in flight is cancelled (see `received`; on TLS, the ciphertext buffer
    /// goes back then too). Cold: at most once a second, and only while some
    /// connection's input buffer is wide.
    #[cold]
    fn trim_idle(&self) {
        self.trim_timer.set(false);
        let now = self.core.now_ns();
        let listed = std::mem::take(&mut *self.wide.borrow_mut());
        let mut keep = Vec::new();
        for (index, id) in listed {
            let Some(conn) = self.conn(index) else {
                continue;
            };
            if conn.info.id != id {
                continue;
            }
            let mut st = conn.st.borrow_mut();
            let idle = st.in_flight == 0 && now.saturating_sub(st.progress_ns) >= TRIM_IDLE_NS;
            if !idle || st.rs != st.re || st.eof || st.dead {
                keep.push((index, id));
            } else if st.recv_armed && st.recv_target != RecvTarget::Payload {
                if !st.trimming {
                    st.trimming = true;
                    let cookie = u64::from(index) << 8;
                    self.core
                        .cancel_sqe(self.user.get(), cookie | RECV, cookie | CANCEL);
                }
                keep.push((index, id));
            } else {
                let touched = st.touched;
                st.inbuf.release(touched);
                (st.rs, st.re, st.touched, st.wide) = (0, 0, 0, false);
                log::debug!(
                    "cairn: serve: {}: idle: {} KiB of input buffer given back",
                    conn.peer,
                    touched >> 10
                );
            }
        }
        self.wide.borrow_mut().extend(keep);
        if !self.wide.borrow().is_empty() {
            self.set_trim_timer();
        }
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

    /// A reply without data: a simple reply, or with extended headers (which forbid
    /// simple replies) a NONE chunk or an ERROR chunk.
    fn reply_simple(&self, conn: &Conn, st: &mut ConnState, cookie: u64, offset: u64, error: u32) {
        let mut head = [0u8; 40];
        let head_len = if conn.session.extended {
            if error == 0 {
                head[..32].copy_from_slice(&proto::extended_chunk_header(
                    chunk::FLAG_DONE,
                    chunk::NONE,
                    cookie,
                    offset,
                    0,
                ));
                32
            } else {
                head[..32].copy_from_slice(&proto::extended_chunk_header(
                    chunk::FLAG_DONE,
                    chunk::ERROR,
                    cookie,
                    offset,
                    6,
                ));
                head[32..36].copy_from_slice(&error.to_be_bytes());
                // Message length 0.
                38
            }
        } else {
            head[..proto::SIMPLE_REPLY].copy_from_slice(&proto::simple_reply(error, cookie));
            proto::SIMPLE_REPLY as u8
        };
        st.out.push_back(Seg {
            head,
            head_len,
            buf: None,
            data_off: 0,
            data_len: 0,
        });
    }

    /// An error reply in the form the command needs (structured for reads when
    /// structured replies are on; always a chunk with extended headers).
    fn reply_error(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        command: u16,
        (cookie, offset): (u64, u64),
        e: u32,
    ) {
        conn.info.error();
        self.observer.error(e);
        if !conn.session.extended
            && conn.session.structured
            && (command == cmd::READ || command == cmd::BLOCK_STATUS)
        {
            let mut head = [0u8; 40];
            head[..20].copy_from_slice(&proto::chunk_header(
                chunk::FLAG_DONE,
                chunk::ERROR,
                cookie,
                6,
            ));
            head[20..24].copy_from_slice(&e.to_be_bytes());
            // Message length 0.
            st.out.push_back(Seg {
                head,
                head_len: 26,
                buf: None,
                data_off: 0,
                data_len: 0,
            });
        } else {
            self.reply_simple(conn, st, cookie, offset, e);
        }
    }

    /// Successful reply without data.
    fn reply_ok(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        command: u16,
        (cookie, offset): (u64, u64),
    ) {
        if !conn.session.extended && conn.session.structured && command == cmd::READ {
            let mut head = [0u8; 40];
            head[..20].copy_from_slice(&proto::chunk_header(
                chunk::FLAG_DONE,
                chunk::NONE,
                cookie,
                0,
            ));
            st.out.push_back(Seg {
                head,
                head_len: 20,
                buf: None,
                data_off: 0,
                data_len: 0,
            });
        } else {
            self.reply_simple(conn, st, cookie, offset, 0);
        }
    }

    fn alloc_req(st: &mut ConnState, req: Req) -> u32 {
        match st.free_reqs.pop() {
            Some(i) => {
                st.reqs[i as usize] = req;
                i
            }
            None => {
                st.reqs.push(req);
                st.reqs.len() as u32 - 1
            }
        }
    }

    /// The next step of input processing; never calls out of the connection.
    fn next_request(&self, conn: &Conn, st: &mut ConnState) -> Next {
        if st.dead {
            return Next::Stop;
        }
        match st.rx {
            Rx::Payload { req, got } => return self.take_payload(conn, st, req, got),
            Rx::Skip { .. } => return self.skip_payload(conn, st),
            Rx::Header => {}
        }
        if st.eof && !self.shutting.get() {
            return Next::Stop;
        }
        if st.reqs.len() - st.free_reqs.len() + st.out.len() >= MAX_PENDING {
            st.blocked = true;
            return Next::Stop;
        }
        let Some(r) = self.frame(conn, st) else {
            return Next::Stop;
        };
        // A request parsed again after waiting for a buffer was counted the first time.
        if !std::mem::take(&mut st.recounted) {
            conn.info.request(r.command, r.len);
            st.progress_ns = self.core.now_ns();
        }
        match command::check(&r, &conn.terms, self.shutting.get()) {
            Ok(Command::Io {
                op,
                flags,
                then_flush,
            }) => self.start_io(conn, st, &r, (op, flags), then_flush),
            Ok(Command::Unaligned { op, wide }) => self.unaligned(conn, st, &r, op, wide),
            Ok(Command::BlockStatus) => self.block_status(conn, st, &r),
            Ok(Command::Cache) => {
                // A hint; every device here reads at memory or page-cache speed.
                st.rs += conn.header_len();
                self.reply_simple(conn, st, r.cookie, r.offset, 0);
                Next::Again
            }
            Ok(Command::Disconnect) => {
                st.rs += conn.header_len();
                st.end("the client disconnected");
                st.eof = true;
                Next::Stop
            }
            Err(why) => self.refuse(conn, st, &r, why),
        }
    }

    /// Payload bytes of write `req` (`got` of them in so far) that came with the header
    /// (or through TLS) are in the input buffer; the rest is received straight into the
    /// request's buffer.
    fn take_payload(&self, conn: &Conn, st: &mut ConnState, req: u32, got: u32) -> Next {
        let want = st.reqs[req as usize].len as usize - got as usize;
        let n = (st.re - st.rs).min(want);
        if n == 0 {
            return Next::Stop;
        }
        let (rs, got_us) = (st.rs, got as usize);
        let ConnState {
            inbuf, reqs, pool, ..
        } = &mut *st;
        let r = &mut reqs[req as usize];
        let at = r.data_off as usize + got_us;
        if let Some(b) = r.buf.as_mut() {
            if !pool.ensure(b, at + n) {
                return self.wait_memory(conn, st);
            }
            b.as_mut_slice()[at..at + n].copy_from_slice(&inbuf[rs..rs + n]);
        }
        st.rs += n;
        if n < want {
            st.rx = Rx::Payload {
                req,
                got: got + n as u32,
            };
            return Next::Stop;
        }
        st.rx = Rx::Header;
        match self.payload_done(conn, st, req) {
            Some(io) => Next::Submit(io),
            None => Next::Again,
        }
    }

    /// Skips what is in the input of a refused request's payload; once all of it has
    /// gone by, the error reply.
    fn skip_payload(&self, conn: &Conn, st: &mut ConnState) -> Next {
        let Rx::Skip {
            left,
            cookie,
            offset,
            error,
        } = st.rx
        else {
            return Next::Again;
        };
        let n = ((st.re - st.rs) as u64).min(left);
        st.rs += n as usize;
        if n < left {
            st.rx = Rx::Skip {
                left: left - n,
                cookie,
                offset,
                error,
            };
            return Next::Stop;
        }
        st.rx = Rx::Header;
        self.reply_error(conn, st, cmd::WRITE, (cookie, offset), error);
        Next::Again
    }

    /// The request header at the head of the input, if a whole one is there (not yet
    /// consumed). A bad magic ends the connection: nothing after it can be trusted.
    fn frame(&self, conn: &Conn, st: &mut ConnState) -> Option<proto::Request> {
        let input = &st.inbuf[st.rs..st.re];
        let decoded = if conn.session.extended {
            proto::parse_extended_request(input)
        } else {
            proto::parse_request(input)
        };
        match decoded {
            proto::Decoded::Incomplete => None,
            proto::Decoded::BadMagic(m) => {
                log::warn!(
                    "cairn: serve: {}: bad request magic {m:#010x}; disconnecting",
                    conn.peer
                );
                st.end("a protocol error (bad request magic)");
                st.dead = true;
                None
            }
            proto::Decoded::Request(r) => Some(r),
        }
    }

    /// Refuses request `r`: skips its payload if it has one (never parsed as requests),
    /// then the error reply.
    #[cold]
    fn refuse(&self, conn: &Conn, st: &mut ConnState, r: &proto::Request, why: Refusal) -> Next {
        if why == Refusal::OverMaxPayload && !st.warned {
            // Once per connection: a client that ignores the maximum keeps sending.
            st.warned = true;
            log::warn!(
                "cairn: serve: {}: a {} of {} bytes is over --max-payload ({} bytes): refused with EINVAL",
                conn.peer,
                if r.command == cmd::READ { "read" } else { "write" },
                r.len,
                self.limits.max_payload
            );
        }
        st.rs += conn.header_len();
        let payload = command::payload_len(r, conn.session.extended);
        if payload == 0 {
            self.reply_error(conn, st, r.command, (r.cookie, r.offset), why.errno());
            return Next::Again;
        }
        if payload > SKIP_MAX {
            log::warn!(
                "cairn: serve: {}: write payload of {payload} bytes is over any limit; disconnecting",
                conn.peer
            );
            st.end("a protocol error (write payload over any limit)");
            st.dead = true;
            return Next::Stop;
        }
        st.rx = Rx::Skip {
            left: payload,
            cookie: r.cookie,
            offset: r.offset,
            error: why.errno(),
        };
        Next::Again
    }

    /// Starts checked request `r` on whole blocks: its buffer, then the device request
    /// (a write's once its payload is in).
    #[inline]
    fn start_io(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        r: &proto::Request,
        (op, flags): (Op, IoFlags),
        then_flush: bool,
    ) -> Next {
        let hl = conn.header_len();
        let mut buf = None;
        if op.has_data() {
            // A read's buffer is filled at once; a write's as its payload arrives: for
            // now, what came with the header.
            let touched = if op == Op::Read {
                r.len as usize
            } else {
                (st.re - st.rs - hl).min(r.len as usize)
            };
            match self.take_buffer(conn, st, r.len as usize, touched) {
                Ok(b) => buf = Some(b),
                Err(next) => return next,
            }
        }
        st.rs += hl;
        let index = Self::alloc_req(
            st,
            Req {
                then_flush,
                ..Req::of(r, buf)
            },
        );
        if op == Op::Write {
            return self.take_write_payload(conn, st, index, 0);
        }
        let token = (u64::from(conn.index) << 32) | u64::from(index);
        let (ptr, len) = if op == Op::Flush {
            (std::ptr::null_mut(), 0)
        } else {
            let req = &mut st.reqs[index as usize];
            let p = req
                .buf
                .as_mut()
                .map_or(std::ptr::null_mut(), |b| b.as_mut_ptr());
            (p, r.len)
        };
        let io = Io {
            op,
            flags,
            offset: if op == Op::Flush { 0 } else { r.offset },
            len,
            buf: ptr,
            sink: self.sink.get(),
            token,
        };
        st.in_flight += 1;
        if op.is_write() {
            return match self.pass_gate(conn, st, index, io) {
                Some(io) => Next::Submit(io),
                None => Next::Again,
            };
        }
        Next::Submit(io)
    }

    /// A data buffer of `len` bytes for the request at the head of the input, `touched`
    /// of them charged to the memory budget now. `Err` is what to do while there is none
    /// (the request is parsed again then, not counted twice).
    #[inline]
    fn take_buffer(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        len: usize,
        touched: usize,
    ) -> Result<Buf, Next> {
        let Some(mut b) = st.pool.get(len) else {
            st.blocked = true;
            st.recounted = true;
            return Err(Next::Stop);
        };
        if !st.pool.ensure(&mut b, touched) {
            st.pool.put(b);
            st.recounted = true;
            return Err(self.wait_memory(conn, st));
        }
        Ok(b)
    }

    /// Write `index`'s payload follows its header: takes what has arrived (into its
    /// buffer at `at`), and receives the rest; once all is in, the device request.
    fn take_write_payload(&self, conn: &Conn, st: &mut ConnState, index: u32, at: usize) -> Next {
        let len = st.reqs[index as usize].len as usize;
        let avail = (st.re - st.rs).min(len);
        let (rs, re) = (st.rs, st.rs + avail);
        let ConnState { inbuf, reqs, .. } = &mut *st;
        if let Some(b) = reqs[index as usize].buf.as_mut() {
            b.as_mut_slice()[at..at + avail].copy_from_slice(&inbuf[rs..re]);
        }
        st.rs += avail;
        if avail < len {
            st.rx = Rx::Payload {
                req: index,
                got: avail as u32,
            };
            return Next::Stop;
        }
        match self.payload_done(conn, st, index) {
            Some(io) => Next::Submit(io),
            None => Next::Again,
        }
    }

    /// Write `req`'s payload has fully arrived: the device request to submit now, if any.
    /// An unaligned write starts its read-modify-write instead, and a write may wait at
    /// the gate.
    fn payload_done(&self, conn: &Conn, st: &mut ConnState, req: u32) -> Option<Io> {
        st.in_flight += 1;
        if st.reqs[req as usize].wide().is_some() {
            self.rmw_start(conn, st, req);
            return None;
        }
        let io = self.write_io(conn, st, req);
        self.pass_gate(conn, st, req, io)
    }

    /// Lets write `req` (a write, trim or write-zeroes, counted in flight) through the
    /// export's gate: the device request to submit now, or `None` while it waits.
    #[inline]
    fn pass_gate(&self, conn: &Conn, st: &mut ConnState, req: u32, io: Io) -> Option<Io> {
        let Some(gate) = conn.gate.as_ref() else {
            return Some(io);
        };
        let pass = gate.write(self.reactor, io.offset, io.offset + io.len);
        st.reqs[req as usize].pass = pass;
        match pass {
            Pass::Ticket(id) => self.wait_for_ticket(conn, st, req, id, io),
            _ => Some(io),
        }
    }

    /// A write got a ticket (a read-modify-write is active): the device request if the
    /// ticket is good already, else it waits.
    #[cold]
    fn wait_for_ticket(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        req: u32,
        id: u64,
        io: Io,
    ) -> Option<Io> {
        let seen = self.gates.wake.generation();
        if conn.gate.as_ref().is_none_or(|g| g.ready(id)) {
            return Some(io);
        }
        let r = &mut st.reqs[req as usize];
        r.stage = Stage::Waiting;
        r.slow.get_or_insert_with(Box::default).waiting_io = Some(io);
        self.wait(conn.index, req, seen);
        None
    }

    /// Request `req` of connection `conn` waits at a gate, checked at generation `seen`.
    fn wait(&self, conn: u32, req: u32, seen: u64) {
        self.waiting.borrow_mut().push((conn, req));
        self.gates.wake.waiting(self.reactor, seen);
    }

    /// Retries the requests waiting at a gate if anything was released since the last
    /// try; returns how many started.
    #[cold]
    fn retry_waiting(&self) -> usize {
        let wake = &self.gates.wake;
        let now = wake.generation();
        if now == self.retried_at.get() {
            return 0;
        }
        self.retried_at.set(now);
        wake.retrying(self.reactor);
        let list = std::mem::take(&mut *self.waiting.borrow_mut());
        let before = list.len();
        for (ci, ri) in list {
            let Some(conn) = self.conn(ci) else { continue };
            let mut st = conn.st.borrow_mut();
            let r = &st.reqs[ri as usize];
            if r.wide().is_some() {
                self.rmw_try(&conn, &mut st, ri);
            } else if let Pass::Ticket(id) = r.pass {
                let io = r.slow.as_ref().and_then(|s| s.waiting_io);
                if let Some(io) = io.and_then(|io| self.wait_for_ticket(&conn, &mut st, ri, id, io))
                {
                    let r = &mut st.reqs[ri as usize];
                    r.stage = Stage::Plain;
                    r.slow = None;
                    self.submits.borrow_mut().push((ci, io));
                }
            }
            self.mark_dirty(&conn, &mut st);
        }
        // Those that wait again were pushed back by `wait`.
        let still = self.waiting.borrow().len();
        self.drain_submits();
        before.saturating_sub(still)
    }

    /// The connection needs memory the budget does not have: it stops reading until some
    /// comes back (a release anywhere wakes this reactor).
    #[cold]
    fn wait_memory(&self, conn: &Conn, st: &mut ConnState) -> Next {
        if !st.mem_wait {
            st.mem_wait = true;
            self.mem_waiting.borrow_mut().push(conn.index);
            self.mem.budget().waiting(self.reactor, self.mem.seen());
        }
        Next::Stop
    }

    /// Lets the connections waiting for memory try again if any came back; returns how
    /// many did.
    #[cold]
    fn retry_memory(&self) -> usize {
        let budget = self.mem.budget();
        let now = budget.generation();
        if !self.mem.take_freed() && now == self.mem_retried_at.get() {
            return 0;
        }
        self.mem_retried_at.set(now);
        budget.retrying(self.reactor);
        let list = std::mem::take(&mut *self.mem_waiting.borrow_mut());
        let n = list.len();
        for ci in list {
            let Some(conn) = self.conn(ci) else { continue };
            {
                let mut st = conn.st.borrow_mut();
                st.mem_wait = false;
                self.mark_dirty(&conn, &mut st);
            }
            self.process(&conn);
        }
        n
    }

    /// Submits the device requests that read-modify-writes and gates queued.
    fn drain_submits(&self) {
        loop {
            let next = self.submits.borrow_mut().pop();
            let Some((ci, io)) = next else { break };
            if let Some(c) = self.conn(ci) {
                c.queue.submit(io);
            }
        }
    }

    /// A request not aligned to the device's blocks, from a client that did not ask for
    /// block sizes (checked: `wide`, its blocks, are inside the export). A read reads the
    /// whole blocks around it; a write or write-zeroes is a read-modify-write of its edge
    /// blocks; a trim trims the whole blocks inside it (the spec lets a server ignore the
    /// rest).
    #[cold]
    #[inline(never)]
    fn unaligned(
        &self,
        conn: &Conn,
        st: &mut ConnState,
        r: &proto::Request,
        op: Op,
        w: Wide,
    ) -> Next {
        let block = w.block;
        let buf_len = match op {
            Op::Read => w.len,
            // The blocks, then room to read the edge blocks into.
            Op::Write => w.len + 2 * block,
            Op::WriteZeroes => 2 * block,
            _ => 0,
        } as usize;
        let mut buf = None;
        if buf_len > 0 {
            // Rare (clients that did not ask for block sizes): charged whole at once.
            match self.take_buffer(conn, st, buf_len, buf_len) {
                Ok(b) => buf = Some(b),
                Err(next) => return next,
            }
        }
        st.rs += conn.header_len();
        if st.counts.unaligned == 0 {
            log::info!(
                "cairn: serve: {}: the client sends requests not aligned to the export's {block}-byte blocks (it did not ask for block sizes); serving them by read-modify-write",
                conn.peer
            );
        }
        st.counts.unaligned += 1;
        let (whole_off, whole_len) = w.whole();
        if op == Op::Discard && whole_len == 0 {
            // No whole block to trim: nothing to do.
            self.reply_ok(conn, st, r.command, (r.cookie, r.offset));
            return Next::Again;
        }
        let index = Self::alloc_req(
            st,
            Req {
                data_off: if matches!(op, Op::Read | Op::Write) {
                    w.head as u32
                } else {
                    0
                },
                then_flush: r.flags & cflags::FUA != 0
                    && matches!(op, Op::Discard | Op::WriteZeroes),
                slow: matches!(op, Op::Write | Op::WriteZeroes).then(|| {
                    Box::new(Slow {
                        wide: Some(w),
                        waiting_io: None,
                    })
                }),
                ..Req::of(r, buf)
            },
        );
        let token = (u64::from(conn.index) << 32) | u64::from(index);
        match op {
            Op::Read => {
                let buf = st.reqs[index as usize]
                    .buf
                    .as_mut()
                    .map_or(std::ptr::null_mut(), |b| b.as_mut_ptr());
                st.in_flight += 1;
                Next::Submit(Io {
                    op,
                    flags: IoFlags::NONE,
                    offset: w.offset,
                    len: w.len,
                    buf,
                    sink: self.sink.get(),
                    token,
                })
            }
            Op::Discard => {
                st.in_flight += 1;
                let io = Io::nodata(Op::Discard, whole_off, whole_len, self.sink.get(), token);
                match self.pass_gate(conn, st, index, io) {
                    Some(io) => Next::Submit(io),
                    None => Next::Again,
                }
            }
            // Like an aligned write's payload, but into the middle of the blocks.
            Op::Write => self.take_write_payload(conn, st, index, w.head as usize),
            _ => {
                st.in_flight += 1;
                self.rmw_start(conn, st, index);
                Next::Again
            }
        }
    }

    /// Starts read-modify-write `req` (counted in flight once): takes a ticket for its
    /// blocks, and reads its edge blocks once the ticket is good.
    fn rmw_start(&self, conn: &Conn, st: &mut ConnState, req: u32) {
        let r = &mut st.reqs[req as usize];
        if let (Some(gate), Some(w)) = (conn.gate.as_ref(), r.wide()) {
            r.pass = Pass::Ticket(gate.rmw(w.offset, w.offset + w.len));
        }
        self.rmw_try(conn, st, req);
    }

    /// Read-modify-write `req` (counted in flight once) starts if its ticket is good, or
    /// waits.
    fn rmw_try(&self, conn: &Conn, st: &mut ConnState, req: u32) {
        let seen = self.gates.wake.generation();
        if let (Some(gate), Pass::Ticket(id)) = (conn.gate.as_ref(), st.reqs[req as usize].pass) {
            if !gate.ready(id) {
                st.reqs[req as usize].stage = Stage::Waiting;
                self.wait(conn.index, req, seen);
                return;
            }
        }
        st.in_flight -= 1;
        let r = &mut st.reqs[req as usize];
        let Some(w) = r.wide() else { return };
        let (edges, n) = w.edges();
        // A write's buffer holds its blocks, then the edge blocks read; a write-zeroes'
        // holds just the edge blocks.
        let scratch = if r.command == cmd::WRITE { w.len } else { 0 } as usize;
        let base = r
            .buf
            .as_mut()
            .map_or(std::ptr::null_mut(), |b| b.as_mut_ptr());
        r.stage = Stage::Edges;
        r.pending = n as u8;
        let token = (u64::from(conn.index) << 32) | u64::from(req);
        for (i, at) in edges[..n].iter().enumerate() {
            // SAFETY: the buffer holds `scratch` bytes and then two blocks.
            let buf = unsafe { base.add(scratch + i * w.block as usize) };
            let io = Io {
                op: Op::Read,
                flags: IoFlags::NONE,
                offset: w.offset + at,
                len: w.block,
                buf,
                sink: self.sink.get(),
                token,
            };
            self.submits.borrow_mut().push((conn.index, io));
        }
        st.in_flight += n as u32;
        if n == 0 {
            self.rmw_write(conn, st, req);
        }
    }

    /// A device request of read-modify-write `req` ended; when the step's last has, the
    /// next step starts.
    fn rmw_done(&self, conn: &Conn, st: &mut ConnState, req: u32, status: IoStatus) {
        let r = &mut st.reqs[req as usize];
        if !status.is_ok() && r.error == 0 {
            r.error = status.raw();
        }
        r.pending = r.pending.saturating_sub(1);
        if r.pending > 0 {
            return;
        }
        if r.error != 0 {
            return self.rmw_finish(conn, st, req);
        }
        match r.stage {
            Stage::Edges => self.rmw_write(conn, st, req),
            Stage::Writing if r.then_flush => {
                r.then_flush = false;
                r.stage = Stage::Flushing;
                r.pending = 1;
                let token = (u64::from(conn.index) << 32) | u64::from(req);
                let io = Io::nodata(Op::Flush, 0, 0, self.sink.get(), token);
                self.submits.borrow_mut().push((conn.index, io));
                st.in_flight += 1;
            }
            _ => self.rmw_finish(conn, st, req),
        }
    }

    /// Read-modify-write `req` read its edge blocks: lays the new bytes (or zeroes) over
    /// them and writes.
    fn rmw_write(&self, conn: &Conn, st: &mut ConnState, req: u32) {
        let r = &mut st.reqs[req as usize];
        let (Some(w), Some(b)) = (r.wide(), r.buf.as_mut()) else {
            return self.rmw_finish(conn, st, req);
        };
        let (edges, n) = w.edges();
        let block = w.block as usize;
        let token = (u64::from(conn.index) << 32) | u64::from(req);
        let sink = self.sink.get();
        let mut submits = self.submits.borrow_mut();
        r.stage = Stage::Writing;
        if r.command == cmd::WRITE {
            let scratch = w.len as usize;
            let data = b.as_mut_slice();
            for (i, &at) in edges[..n].iter().enumerate() {
                for (from, to) in w.kept(at) {
                    let src = scratch + i * block + (from - at) as usize;
                    data.copy_within(src..src + (to - from) as usize, from as usize);
                }
            }
            let mut flags = IoFlags::NONE;
            if r.flags & cflags::FUA != 0 {
                flags = flags.with(IoFlags::FUA);
            }
            submits.push((
                conn.index,
                Io {
                    op: Op::Write,
                    flags,
                    offset: w.offset,
                    len: w.len,
                    buf: b.as_mut_ptr(),
                    sink,
                    token,
                },
            ));
            r.pending = 1;
        } else {
            // Write-zeroes: zero the covered bytes of each edge block and write it back;
            // zero the whole blocks between them.
            let data = b.as_mut_slice();
            let (head, end) = (w.head, w.head + w.inner);
            for (i, &at) in edges[..n].iter().enumerate() {
                let (lo, hi) = (head.clamp(at, at + w.block), end.clamp(at, at + w.block));
                data[i * block + (lo - at) as usize..i * block + (hi - at) as usize].fill(0);
            }
            let base = b.as_mut_ptr();
            for (i, &at) in edges[..n].iter().enumerate() {
                submits.push((
                    conn.index,
                    Io {
                        op: Op::Write,
                        flags: IoFlags::NONE,
                        offset: w.offset + at,
                        len: w.block,
                        // SAFETY: the buffer holds two blocks.
                        buf: unsafe { base.add(i * block) },
                        sink,
                        token,
                    },
                ));
            }
            let (whole_off, whole_len) = w.whole();
            let mut pending = n;
            if whole_len > 0 {
                let mut io = Io::nodata(Op::WriteZeroes, whole_off, whole_len, sink, token);
                if r.flags & cflags::NO_HOLE != 0 {
                    io.flags = io.flags.with(IoFlags::NO_HOLE);
                }
                submits.push((conn.index, io));
                pending += 1;
            }
            r.pending = pending as u8;
        }
        st.in_flight += u32::from(r.pending);
    }

    /// Read-modify-write `req` has ended (or failed): releases its ticket and replies.
    fn rmw_finish(&self, conn: &Conn, st: &mut ConnState, req: u32) {
        let r = std::mem::take(&mut st.reqs[req as usize]);
        st.free_reqs.push(req);
        if let Some(g) = conn.gate.as_ref() {
            g.done(self.reactor, r.pass);
        }
        if let Some(b) = r.buf {
            st.pool.put(b);
        }
        if r.error != 0 {
            let e = errno::from_local(r.error);
            self.reply_error(conn, st, r.command, (r.cookie, r.offset), e);
        } else {
            self.reply_simple(conn, st, r.cookie, r.offset, 0);
        }
        self.mark_dirty(conn, st);
    }

    /// The device write for request `req`, whose payload has fully arrived.
    fn write_io(&self, conn: &Conn, st: &mut ConnState, req: u32) -> Io {
        let r = &mut st.reqs[req as usize];
        let mut flags = IoFlags::NONE;
        if r.flags & cflags::FUA != 0 {
            flags = flags.with(IoFlags::FUA);
        }
        Io {
            op: Op::Write,
            flags,
            offset: r.offset,
            len: r.len,
            buf: r
                .buf
                .as_mut()
                .map_or(std::ptr::null_mut(), |b| b.as_mut_ptr()),
            sink: self.sink.get(),
            token: (u64::from(conn.index) << 32) | u64::from(req),
        }
    }

    /// Answers a block status request from the device's allocation map.
    /// The request's header (`hl` bytes) is consumed here, once its reply has memory.
    fn block_status(&self, conn: &Conn, st: &mut ConnState, r: &proto::Request) -> Next {
        let hl = conn.header_len();
        let device = &self.exports[conn.export].device;
        let mut extents = Vec::new();
        let len = r.len;
        // Unaligned (only from a relaxed client): ask about the whole blocks, then drop
        // the bytes before the request's start.
        let w = Wide::new(r.offset, len, u64::from(conn.terms.geometry.block_bytes));
        if let Err(e) = device.extents(w.offset, w.len, &mut extents) {
            if !st.warned {
                // Once per connection: a client asking again does not flood the log.
                st.warned = true;
                log::warn!("cairn: serve: {}: block status: {e}", conn.peer);
            }
            st.rs += hl;
            self.reply_error(conn, st, r.command, (r.cookie, r.offset), errno::EIO);
            return Next::Again;
        }
        if extents.is_empty() {
            extents.push(cairn_core::Extent::data(w.len));
        }
        let mut skip = w.head;
        extents.retain_mut(|e| {
            let cut = e.len.min(skip);
            skip -= cut;
            e.len -= cut;
            e.len > 0
        });
        let max = if r.flags & cflags::REQ_ONE != 0 {
            1
        } else {
            MAX_EXTENTS
        };
        let extended = conn.session.extended;
        // Compact descriptors are (u32 length, u32 flags); extended ones (after an id and
        // a count) are (u64 length, u64 flags).
        let per = if extended { 16 } else { 8 };
        let mut body = Vec::with_capacity(8 + per * extents.len().min(max));
        body.extend_from_slice(&proto::BASE_ALLOCATION_ID.to_be_bytes());
        if extended {
            body.extend_from_slice(&0u32.to_be_bytes()); // the count, filled in below
        }
        let mut covered = 0u64;
        let mut count = 0u32;
        let most = if extended {
            u64::MAX
        } else {
            u64::from(u32::MAX) & !4095
        };
        for (n, e) in extents.iter().enumerate() {
            if covered >= len || n == max || e.len == 0 {
                break;
            }
            // Descriptors must not run past the request, and compact ones are 32-bit.
            let l = e.len.min(len - covered).min(most);
            let mut flags = 0;
            if e.hole {
                flags |= proto::state::HOLE;
            }
            if e.zero {
                flags |= proto::state::ZERO;
            }
            if extended {
                body.extend_from_slice(&l.to_be_bytes());
                body.extend_from_slice(&u64::from(flags).to_be_bytes());
            } else {
                body.extend_from_slice(&(l as u32).to_be_bytes());
                body.extend_from_slice(&flags.to_be_bytes());
            }
            covered += l;
            count += 1;
            if l < e.len {
                // Cut short: the rest of this extent is for the client to ask again.
                break;
            }
        }
        if extended {
            body[4..8].copy_from_slice(&count.to_be_bytes());
        }
        // Bounded by MAX_EXTENTS, so it may go over the pool's limit once.
        let mut buf = st.pool.get_always(body.len());
        if !st.pool.ensure(&mut buf, body.len()) {
            st.pool.put(buf);
            st.recounted = true;
            return self.wait_memory(conn, st);
        }
        st.rs += hl;
        buf.as_mut_slice()[..body.len()].copy_from_slice(&body);
        let mut head = [0u8; 40];
        let head_len = if extended {
            head[..32].copy_from_slice(&proto::extended_chunk_header(
                chunk::FLAG_DONE,
                chunk::BLOCK_STATUS_EXT,
                r.cookie,
                r.offset,
                body.len() as u64,
            ));
            32
        } else {
            head[..20].copy_from_slice(&proto::chunk_header(
                chunk::FLAG_DONE,
                chunk::BLOCK_STATUS,
                r.cookie,
                body.len() as u32,
            ));
            20
        };
        st.out.push_back(Seg {
            head,
            head_len,
            buf: Some(buf),
            data_off: 0,
            data_len: body.len() as u32,
        });
        Next::Again
    }

    /// Bytes arrived from the socket (`res` > 0), or the stream ended or failed.
    fn received(&self, conn: &Conn, res: i32) {
        if res == -libc::ECANCELED {
            // Cancelled to give the input buffer back (`trim_idle`), or, the slot reused,
            // a late cancellation meant for a connection before: nothing was received.
            let mut st = conn.st.borrow_mut();
            st.recv_armed = false;
            if std::mem::take(&mut st.trimming) && st.rs == st.re {
                let touched = st.touched;
                st.inbuf.release(touched);
                let mut raw = 0;
                if let Some(t) = st.tls.as_mut().filter(|t| t.raw_pos == t.raw_len) {
                    raw = std::mem::take(&mut t.raw_touched);
                    t.raw_in.release(raw);
                }
                log::debug!(
                    "cairn: serve: {}: idle: {} KiB of input buffer given back ({} KiB of ciphertext buffer)",
                    conn.peer,
                    touched >> 10,
                    raw >> 10
                );
                (st.rs, st.re, st.touched) = (0, 0, 0);
                if st.wide {
                    st.wide = false;
                    self.wide
                        .borrow_mut()
                        .retain(|&(i, id)| (i, id) != (conn.index, conn.info.id));
                }
            }
            self.mark_dirty(conn, &mut st);
            return;
        }
        let submit = {
            let mut st = conn.st.borrow_mut();
            st.recv_armed = false;
            st.trimming = false;
            st.counts.recvs += 1;
            st.counts.recv_bytes += res.max(0) as u64;
            if res <= 0 {
                if res < 0 && res != -libc::ECONNRESET && !st.eof {
                    log::warn!(
                        "cairn: serve: {}: receive failed: {}",
                        conn.peer,
                        std::io::Error::from_raw_os_error(-res)
                    );
                }
                st.end(if res == 0 {
                    "the client closed the connection"
                } else {
                    "receive failed"
                });
                st.eof = true;
                if let Rx::Payload { req, .. } = st.rx {
                    // The client went away in the middle of a write: drop it.
                    let b = st.reqs[req as usize].buf.take();
                    if let Some(b) = b {
                        st.pool.put(b);
                    }
                    st.free_reqs.push(req);
                    st.rx = Rx::Header;
                }
                self.mark_dirty(conn, &mut st);
                None
            } else {
                let n = res as usize;
                match st.recv_target {
                    RecvTarget::Payload => match st.rx {
                        Rx::Payload { req, got } => {
                            let got = got + n as u32;
                            if u64::from(got) < st.reqs[req as usize].len {
                                st.rx = Rx::Payload { req, got };
                                None
                            } else {
                                st.rx = Rx::Header;
                                self.payload_done(conn, &mut st, req)
                            }
                        }
                        _ => None,
                    },
                    RecvTarget::Inbuf => {
                        st.re += n;
                        None
                    }
                    RecvTarget::Raw => {
                        if let Some(t) = st.tls.as_mut() {
                            t.raw_pos = 0;
                            t.raw_len = n;
                        }
                        None
                    }
                }
            }
        };
        if let Some(io) = submit {
            conn.queue.submit(io);
        }
        self.process(conn);
    }

    /// `res` bytes of the output went out (or sending failed).
    fn sent(&self, conn: &Conn, res: i32) {
        let mut st = conn.st.borrow_mut();
        st.send_armed = false;
        st.counts.sends += 1;
        st.counts.send_bytes += res.max(0) as u64;
        if res < 0 {
            if res != -libc::EPIPE && res != -libc::ECONNRESET {
                log::warn!(
                    "cairn: serve: {}: send failed: {}",
                    conn.peer,
                    std::io::Error::from_raw_os_error(-res)
                );
            }
            st.end("send failed");
            st.dead = true;
        } else if let Some(t) = st.tls.as_mut() {
            t.raw_sent += res as usize;
            if t.raw_sent >= t.raw_out.len() {
                t.raw_out.clear();
                t.raw_sent = 0;
            }
        } else {
            let ConnState {
                out,
                out_sent,
                pool,
                ..
            } = &mut *st;
            gather::consume(out, out_sent, res as usize, |seg| {
                if let Some(b) = seg.buf {
                    pool.put(b);
                }
            });
        }
        let was_blocked = std::mem::replace(&mut st.blocked, false);
        self.mark_dirty(conn, &mut st);
        drop(st);
        if was_blocked {
            self.process(conn);
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
                // SAFETY: shutdown on our own socket; it stays open until `close`.
                unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
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

    fn push_send(&self, conn: &Conn, st: &mut ConnState, fd: RawFd) {
        let ConnState {
            out,
            out_sent,
            iov,
            msg,
            ..
        } = st;
        gather::gather(iov, out, *out_sent, IOV_BATCH);
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len() as _;
        let entry = opcode::SendMsg::new(types::Fd(fd), msg as *const libc::msghdr)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build();
        st.send_armed = true;
        // SAFETY: the msghdr, the iovecs and every buffer they point at live in the
        // connection's state (the output queue never reallocates: it was reserved for
        // MAX_PENDING segments) and stay untouched until this SQE completes; the
        // connection is not freed while an SQE is in flight.
        unsafe {
            self.core
                .push_sqe(self.user.get(), (u64::from(conn.index) << 8) | SEND, entry)
        };
    }

    /// Encrypts every waiting reply and sends the ciphertext.
    fn push_send_tls(&self, conn: &Conn, st: &mut ConnState, fd: RawFd) {
        let ConnState {
            out,
            out_sent,
            pool,
            tls,
            ..
        } = st;
        let Some(t) = tls.as_mut() else { return };
        if t.raw_sent == t.raw_out.len() {
            t.raw_out.clear();
            t.raw_sent = 0;
            // At most TLS_BATCH bytes of replies at a time, so that the ciphertext of a
            // client that does not read stays small; `out_sent` is how much of the front
            // reply was encrypted already.
            let mut room = TLS_BATCH;
            while room > 0 {
                let Some(seg) = out.front() else { break };
                let (head, data) = (seg.head(), seg.data());
                let total = head.len() + data.len();
                let (from, to) = (*out_sent, (*out_sent + room).min(total));
                let mut w = t.conn.writer();
                let mut ok = true;
                if from < head.len() {
                    ok &= w.write_all(&head[from..to.min(head.len())]).is_ok();
                }
                if to > head.len() {
                    let d = from.max(head.len()) - head.len();
                    ok &= w.write_all(&data[d..to - head.len()]).is_ok();
                }
                if !ok {
                    st.end("a TLS error");
                    st.dead = true;
                    return;
                }
                room -= to - from;
                if to == total {
                    *out_sent = 0;
                    if let Some(b) = out.pop_front().and_then(|seg| seg.buf) {
                        pool.put(b);
                    }
                } else {
                    *out_sent = to;
                }
            }
            while t.conn.wants_write() {
                if t.conn.write_tls(&mut t.raw_out).is_err() {
                    break;
                }
            }
        }
        if t.raw_sent == t.raw_out.len() {
            return;
        }
        let entry = opcode::Send::new(
            types::Fd(fd),
            t.raw_out[t.raw_sent..].as_ptr(),
            (t.raw_out.len() - t.raw_sent) as u32,
        )
        .flags(libc::MSG_NOSIGNAL)
        .build();
        st.send_armed = true;
        // SAFETY: the ciphertext buffer is not touched (no more is appended) until this
        // SQE completes, and the connection is not freed while an SQE is in flight.
        unsafe {
            self.core
                .push_sqe(self.user.get(), (u64::from(conn.index) << 8) | SEND, entry)
        };
    }

    fn push_recv(&self, conn: &Conn, st: &mut ConnState, fd: RawFd) {
        if st.tls.is_some() {
            // Only once rustls has every byte received so far, and decrypted input has
            // somewhere to go.
            st.pump_tls(&conn.peer);
            if st.re == st.inbuf.len() || st.dead {
                return;
            }
            let Some(t) = st.tls.as_mut() else { return };
            if t.raw_pos < t.raw_len {
                return;
            }
            let entry =
                opcode::Recv::new(types::Fd(fd), t.raw_in.as_mut_ptr(), RAW_IN as u32).build();
            st.recv_armed = true;
            st.recv_target = RecvTarget::Raw;
            // SAFETY: the ciphertext buffer belongs to the connection and is not touched
            // until this SQE completes.
            unsafe {
                self.core
                    .push_sqe(self.user.get(), (u64::from(conn.index) << 8) | RECV, entry)
            };
            return;
        }
        let direct = matches!(st.rx, Rx::Payload { .. }) && st.rs == st.re;
        let (ptr, len) = match st.rx {
            Rx::Payload { req, got } if direct => {
                let ConnState { reqs, pool, .. } = &mut *st;
                let r = &mut reqs[req as usize];
                let Some(b) = r.buf.as_mut() else { return };
                let (at, end) = (
                    r.data_off as usize + got as usize,
                    (r.data_off as u64 + r.len) as usize,
                );
                // Memory for the next megabyte of the payload, taken before it arrives.
                if !pool.ensure(b, end.min(at + PAYLOAD_STEP)) {
                    self.wait_memory(conn, st);
                    return;
                }
                let room = b.charged().min(end) - at;
                // SAFETY: at < data_off + r.len <= the buffer's length, and `room` bytes
                // from there are inside it.
                (unsafe { b.as_mut_ptr().add(at) }, room)
            }
            _ => {
                if st.rs == st.re {
                    st.rs = 0;
                    st.re = 0;
                } else if st.re == st.inbuf.len() || st.rs > INBUF / 2 {
                    let (rs, re) = (st.rs, st.re);
                    st.inbuf.copy_within(rs..re, 0);
                    st.re -= st.rs;
                    st.rs = 0;
                }
                if st.re == st.inbuf.len() {
                    // Full of unparsed requests: wait until replies drain.
                    return;
                }
                let re = st.re;
                (st.inbuf[re..].as_mut_ptr(), st.inbuf.len() - re)
            }
        };
        let entry = opcode::Recv::new(types::Fd(fd), ptr, len as u32).build();
        st.recv_armed = true;
        st.recv_target = if direct {
            RecvTarget::Payload
        } else {
            RecvTarget::Inbuf
        };
        // SAFETY: the target (input buffer or request buffer) belongs to the connection
        // and is not touched or freed until this SQE completes.
        unsafe {
            self.core
                .push_sqe(self.user.get(), (u64::from(conn.index) << 8) | RECV, entry)
        };
    }

    fn close(&self, conn: &Rc<Conn>) {
        let mut st = conn.st.borrow_mut();
        if st.ended.is_empty() && st.dead {
            st.ended = "a TLS or connection error";
        }
        let c = &st.counts;
        let f = conn.info.figures();
        log::info!(
            "cairn: serve: {}: disconnected from export '{}' after {:.3} s: {} requests ({} reads, {} writes, {} flushes, {} trims, {} write-zeroes, {} block status; the longest {} bytes{}), {} bytes received, {} bytes sent ({})",
            conn.peer,
            self.exports[conn.export].info.name,
            st.since.elapsed().as_secs_f64(),
            f.requests,
            f.reads,
            f.writes,
            f.flushes,
            f.trims,
            f.write_zeroes,
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
        self.admission.leave(conn.info.client);
        if self.shutting.get() && self.conns.borrow().iter().all(Option::is_none) {
            self.core.stop();
        }
    }

    /// Closes connection `id` in `slot` (see [`Msg::Evict`]).
    #[cold]
    fn evict(&self, slot: u32, id: u64, idle: std::time::Duration, why: &'static str) {
        let Some(conn) = self.conn(slot) else { return };
        if conn.info.id != id {
            return;
        }
        let now = cairn_core::clock::monotonic_ns();
        let mut st = conn.st.borrow_mut();
        st.end(why);
        if conn.info.idle_for(now).is_some_and(|d| d >= idle) {
            st.dead = true;
        } else {
            st.eof = true;
        }
        self.mark_dirty(&conn, &mut st);
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
                let r = std::mem::take(&mut st.reqs[index as usize]);
                st.free_reqs.push(index);
                if r.pass != Pass::None {
                    if let Some(g) = conn.gate.as_ref() {
                        g.done(self.reactor, r.pass);
                    }
                }
                if !status.is_ok() {
                    if let Some(b) = r.buf {
                        st.pool.put(b);
                    }
                    let e = errno::from_local(status.raw());
                    self.reply_error(&conn, &mut st, r.command, (r.cookie, r.offset), e);
                } else if r.command == cmd::READ {
                    let mut head = [0u8; 40];
                    let head_len = if conn.session.extended {
                        head[..32].copy_from_slice(&proto::extended_chunk_header(
                            chunk::FLAG_DONE,
                            chunk::OFFSET_DATA,
                            r.cookie,
                            r.offset,
                            8 + r.len,
                        ));
                        head[32..40].copy_from_slice(&r.offset.to_be_bytes());
                        40
                    } else if conn.session.structured {
                        head[..20].copy_from_slice(&proto::chunk_header(
                            chunk::FLAG_DONE,
                            chunk::OFFSET_DATA,
                            r.cookie,
                            8 + r.len as u32,
                        ));
                        head[20..28].copy_from_slice(&r.offset.to_be_bytes());
                        28
                    } else {
                        head[..16].copy_from_slice(&proto::simple_reply(0, r.cookie));
                        16
                    };
                    st.out.push_back(Seg {
                        head,
                        head_len,
                        buf: r.buf,
                        data_off: r.data_off,
                        data_len: r.len as u32,
                    });
                } else {
                    if let Some(b) = r.buf {
                        st.pool.put(b);
                    }
                    self.reply_simple(&conn, &mut st, r.cookie, r.offset, 0);
                }
                self.mark_dirty(&conn, &mut st);
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
        cairn_core::event::clear(self.wake.as_raw_fd());
    }
}
