//! Pulling chosen extents of an export into a [`Sink`]: the engine of `cairn backup`.
//!
//! One blocking connection on the caller's thread, no reactor: block status of one
//! metadata context (`base:allocation` for a full copy, `qemu:dirty-bitmap:NAME` for the
//! changes since a checkpoint) is asked a chunk at a time, and the extents it selects are
//! read with up to `depth` reads in flight, each reply handed to the sink as it arrives
//! (data at its offset, or a range the server says reads as zeroes). The next chunk's
//! status is asked while reads of the one before are in flight, on the same connection,
//! so the server always has work queued. Nothing is allocated per read: one buffer of
//! the largest read, one output buffer of request headers, a queue of planned reads no
//! longer than one status reply makes it.
//!
//! It is not the `nbd` device: no reconnection (a backup stops at the first failure and
//! says at which offset), no writes, and only this one use.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::time::Duration;

use crate::client::handshake::{self as client, HandshakeError, Negotiated, Want};
use crate::proto::{self, chunk, cmd, tflags, ReplyHeader};
use crate::uri::NbdUri;

use super::block_status::{read_reply_header, set_socket_timeout, Stream};

/// The most reads in flight.
pub const DEPTH_MAX: usize = 256;
/// The largest read asked for (the server's maximum payload may be smaller).
pub const REQUEST_MAX: u64 = 32 << 20;
/// The most block status asked for at once by default.
pub const STATUS_DEFAULT: u64 = 1 << 30;
/// The longest block status chunk read (a longer one is a broken server).
const STATUS_CHUNK_MAX: u64 = 16 << 20;
/// The longest chunk of any other kind but data (holes, errors, none).
const SMALL_CHUNK_MAX: u64 = 64 << 10;
/// The slot number in a block status request's cookie (reads use 0 to `DEPTH_MAX - 1`).
const STATUS_SLOT: u64 = 0xffff;
/// Bytes read from the socket at once for headers (a data payload at least this long
/// is received straight into the read buffer).
const INPUT_BUFFER: usize = 16 << 10;

/// Which extents of the export to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Select {
    /// Those `base:allocation` does not report as zeroes (everything, if the server has
    /// no block status).
    Allocated,
    /// Those the dirty bitmap NAME (`qemu:dirty-bitmap:NAME`) reports dirty.
    Dirty(String),
}

impl Select {
    /// The metadata context this selection reads.
    pub fn context(&self) -> String {
        match self {
            Select::Allocated => proto::BASE_ALLOCATION.to_string(),
            Select::Dirty(name) => format!("{}{name}", proto::DIRTY_BITMAP),
        }
    }

    /// Whether an extent with these status flags is read.
    fn wants(&self, flags: u32) -> bool {
        match self {
            Select::Allocated => flags & proto::state::ZERO == 0,
            Select::Dirty(_) => flags & proto::state::DIRTY != 0,
        }
    }
}

/// How a pull runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Reads in flight at most (1 to [`DEPTH_MAX`]).
    pub depth: usize,
    /// The longest read (cut to the server's maximum payload, in its blocks).
    pub request_bytes: u64,
    /// Block status asked for at once (cut to what a request can carry).
    pub status_bytes: u64,
    /// How long the connection may stay silent with requests in flight.
    pub timeout: Duration,
}

/// Where the data goes.
pub trait Sink {
    /// `data` was read at `offset`.
    fn data(&mut self, offset: u64, data: &[u8]) -> std::io::Result<()>;
    /// `[offset, offset + len)` reads as zeroes (a hole in a read's reply).
    fn zeroes(&mut self, offset: u64, len: u64) -> std::io::Result<()>;
}

/// What a pull did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pulled {
    /// Bytes asked for by reads.
    pub bytes_read: u64,
    /// Runs of selected extents (adjacent ones merged).
    pub extents: u64,
    /// Read requests.
    pub reads: u64,
    /// Block status requests.
    pub status_requests: u64,
}

/// Why a pull failed or could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PullError {
    /// The connection or its handshake failed.
    #[error("cannot connect: {0}")]
    Connect(HandshakeError),
    /// The export does not offer the metadata context the selection needs.
    #[error("the export offers no {wanted} (it offers: {offered})")]
    NoContext {
        /// The context asked for.
        wanted: String,
        /// What the server lists for the export, or why it could not be listed.
        offered: String,
    },
    /// The server answered a request with an error.
    #[error("the server failed the {what} at offset {offset} ({len} bytes): {error}{message}")]
    Server {
        /// `read` or `block status`.
        what: &'static str,
        /// The request's offset (or the one the error names).
        offset: u64,
        /// The request's length.
        len: u64,
        /// The error, as a local errno.
        error: std::io::Error,
        /// The server's message, as `: text`, or nothing.
        message: String,
    },
    /// The connection failed, closed or stayed silent too long.
    #[error("the connection failed with the request at offset {offset} unanswered: {error}")]
    Lost {
        /// The lowest offset in flight.
        offset: u64,
        /// What happened.
        error: std::io::Error,
    },
    /// A reply that breaks the protocol.
    #[error("the server broke the protocol at offset {offset}: {why}")]
    Protocol {
        /// The offset of the request it answered.
        offset: u64,
        /// What was wrong.
        why: String,
    },
    /// The sink failed.
    #[error("cannot write at offset {offset}: {error}")]
    Sink {
        /// Where the write was.
        offset: u64,
        /// Why it failed.
        error: std::io::Error,
    },
}

impl From<HandshakeError> for PullError {
    fn from(e: HandshakeError) -> PullError {
        PullError::Connect(e)
    }
}

/// An export, connected and negotiated for one selection.
pub struct Source {
    io: BufReader<Box<dyn Stream>>,
    neg: Negotiated,
    select: Select,
    /// The selection's context id; `None` only for `Allocated` on a server without
    /// block status (then everything is read).
    context: Option<u32>,
}

impl Source {
    /// Connects to `uri` and negotiates the context `select` needs; refuses a dirty
    /// bitmap the export does not offer, naming those it does.
    pub fn open(uri: &NbdUri, select: Select, timeout: Duration) -> Result<Source, PullError> {
        let wanted = select.context();
        let want = Want {
            extended: true,
            structured: true,
            allocation: select == Select::Allocated,
        };
        let c = client::connect_with_contexts(uri, want, &[wanted.as_str()], timeout)?;
        let context = c.neg.context_id(&wanted);
        if context.is_none() && select != Select::Allocated {
            // Closed first: a server may take one client at a time (qemu-nbd's default).
            drop(c);
            let offered = match client::list_contexts(uri, timeout) {
                Ok(l) if l.is_empty() => "none".to_string(),
                Ok(l) => l.join(", "),
                Err(e) => format!("unknown, the list failed: {e}"),
            };
            return Err(PullError::NoContext { wanted, offered });
        }
        let file = File::from(c.fd);
        set_socket_timeout(&file, timeout).map_err(HandshakeError::Io)?;
        let stream: Box<dyn Stream> = match c.tls {
            Some(tls) => Box::new(rustls::StreamOwned::new(*tls, file)),
            None => Box::new(file),
        };
        Ok(Source {
            io: BufReader::with_capacity(INPUT_BUFFER, stream),
            neg: c.neg,
            select,
            context,
        })
    }

    /// What was negotiated (the export's size, block sizes, headers).
    pub fn negotiated(&self) -> &Negotiated {
        &self.neg
    }

    /// Whether extents are chosen by block status (not so for a full copy from a server
    /// without `base:allocation`: everything is read).
    pub fn has_status(&self) -> bool {
        self.context.is_some()
    }

    /// Reads every selected extent into `sink`; stops at the first failure.
    pub fn pull(&mut self, options: Options, sink: &mut dyn Sink) -> Result<Pulled, PullError> {
        let mut e = Engine::new(&self.neg, &self.select, self.context, options);
        loop {
            e.fill();
            if !e.out.is_empty() {
                let w = self.io.get_mut();
                w.write_all(&e.out)
                    .and_then(|_| w.flush())
                    .map_err(|error| e.lost(error))?;
            }
            if e.finished() {
                e.pulled.extents = e.plan.runs;
                // A polite goodbye; the server may be gone already, which is no failure.
                e.out.clear();
                e.request(0, cmd::DISC, 0, 0, 0);
                let w = self.io.get_mut();
                let _ = w.write_all(&e.out).and_then(|_| w.flush());
                return Ok(e.pulled);
            }
            if e.in_flight == 0 && e.status.asked.is_none() {
                // Nothing asked and nothing left to ask: a bug, never a wait forever.
                return Err(e.protocol(0, "the pull stalled".into()));
            }
            e.receive(&mut self.io, sink)?;
        }
    }
}

/// A read in flight, or a free slot.
#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    cookie: u64,
    offset: u64,
    len: u64,
    /// Bytes its data and hole chunks covered so far.
    got: u64,
    busy: bool,
}

/// The block status walk: where the next request starts, the one in flight.
#[derive(Debug, Default)]
struct StatusWalk {
    next: u64,
    /// The request in flight: cookie, offset, length, bytes its extents covered so far.
    asked: Option<(u64, u64, u64, u64)>,
}

/// The state of one pull.
struct Engine<'a> {
    neg: &'a Negotiated,
    select: &'a Select,
    context: Option<u32>,
    depth: usize,
    status_bytes: u64,
    plan: Planner,
    slots: Vec<Slot>,
    /// Free slots, as a stack.
    free: Vec<usize>,
    in_flight: usize,
    status: StatusWalk,
    /// Cookies count up; the low 16 bits are the slot.
    serial: u64,
    /// Request headers to send.
    out: Vec<u8>,
    /// A read's data.
    buf: Vec<u8>,
    /// Payloads of other chunks.
    small: Vec<u8>,
    pulled: Pulled,
}

impl<'a> Engine<'a> {
    fn new(
        neg: &'a Negotiated,
        select: &'a Select,
        context: Option<u32>,
        o: Options,
    ) -> Engine<'a> {
        let block = u64::from(neg.min_block.max(1));
        let request = o
            .request_bytes
            .clamp(1, REQUEST_MAX)
            .min(u64::from(neg.max_payload));
        let request = (request / block * block).max(block);
        // A compact header carries 32 bits of length.
        let most = if neg.extended {
            u64::MAX
        } else {
            u64::from(u32::MAX) / block * block
        };
        let depth = o.depth.clamp(1, DEPTH_MAX);
        let mut e = Engine {
            neg,
            select,
            context,
            depth,
            status_bytes: o.status_bytes.clamp(block, most),
            plan: Planner::new(block, neg.size, request),
            slots: vec![Slot::default(); depth],
            free: (0..depth).rev().collect(),
            in_flight: 0,
            status: StatusWalk::default(),
            serial: 0,
            out: Vec::with_capacity(depth * proto::EXTENDED_HEADER + proto::EXTENDED_HEADER),
            buf: vec![0u8; request as usize],
            small: Vec::new(),
            pulled: Pulled::default(),
        };
        if context.is_none() {
            // No block status: the whole export is one selected extent.
            e.plan.feed(0, neg.size, true);
            e.plan.close();
            e.status.next = neg.size;
        }
        e
    }

    /// Queues reads for free slots, and the next block status when few reads are
    /// planned and none is in flight, into `out`.
    fn fill(&mut self) {
        self.out.clear();
        while !self.free.is_empty() {
            let Some((offset, len)) = self.plan.pieces.pop_front() else {
                break;
            };
            let i = self.free.pop().expect("a free slot");
            self.serial += 1;
            let cookie = self.serial << 16 | i as u64;
            debug_assert!(!self.slots[i].busy, "a free slot is busy");
            self.slots[i] = Slot {
                cookie,
                offset,
                len,
                got: 0,
                busy: true,
            };
            self.in_flight += 1;
            self.pulled.reads += 1;
            self.pulled.bytes_read += len;
            let df = self.neg.structured && self.neg.flags & tflags::SEND_DF != 0;
            let flags = if df { proto::cflags::DF } else { 0 };
            self.request(flags, cmd::READ, cookie, offset, len);
        }
        let size = self.neg.size;
        if self.status.asked.is_none()
            && self.status.next < size
            && self.plan.pieces.len() < self.depth
        {
            let offset = self.status.next;
            let len = self.status_bytes.min(size - offset);
            self.serial += 1;
            let cookie = self.serial << 16 | STATUS_SLOT;
            self.status.asked = Some((cookie, offset, len, 0));
            self.pulled.status_requests += 1;
            self.request(0, cmd::BLOCK_STATUS, cookie, offset, len);
        }
    }

    /// Appends one request header to `out`.
    fn request(&mut self, flags: u16, command: u16, cookie: u64, offset: u64, len: u64) {
        if self.neg.extended {
            proto::put_extended_request(&mut self.out, flags, command, cookie, offset, len);
        } else {
            let r = proto::Request {
                flags,
                command,
                cookie,
                offset,
                len,
            };
            proto::put_request(&mut self.out, &r);
        }
    }

    /// Whether everything selected was read.
    fn finished(&self) -> bool {
        self.in_flight == 0
            && self.status.asked.is_none()
            && self.status.next >= self.neg.size
            && self.plan.pieces.is_empty()
    }

    /// Receives one reply (or chunk of one) and acts on it.
    fn receive(&mut self, io: &mut impl Read, sink: &mut dyn Sink) -> Result<(), PullError> {
        let header = read_reply_header(io, self.neg.extended).map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidData {
                self.protocol(self.lowest(), e.to_string())
            } else {
                self.lost(e)
            }
        })?;
        match header {
            ReplyHeader::Simple { error, cookie } => self.simple(io, sink, error, cookie),
            ReplyHeader::Chunk {
                flags,
                kind,
                cookie,
                len,
                ..
            } => {
                if cookie & 0xffff == STATUS_SLOT {
                    self.status_chunk(io, cookie, kind, len)?;
                } else {
                    let i = self.slot_of(cookie)?;
                    self.read_chunk(io, sink, i, kind, len)?;
                }
                if flags & chunk::FLAG_DONE != 0 {
                    self.done(cookie)?;
                }
                Ok(())
            }
        }
    }

    /// A simple reply: an error, or a read's data.
    fn simple(
        &mut self,
        io: &mut impl Read,
        sink: &mut dyn Sink,
        error: u32,
        cookie: u64,
    ) -> Result<(), PullError> {
        if cookie & 0xffff == STATUS_SLOT {
            let (offset, len) = self.status_range(cookie)?;
            if error == 0 {
                return Err(self.protocol(offset, "a simple reply to block status".into()));
            }
            return Err(server_error("block status", offset, len, error, ""));
        }
        let i = self.slot_of(cookie)?;
        let Slot { offset, len, .. } = self.slots[i];
        if error != 0 {
            return Err(server_error("read", offset, len, error, ""));
        }
        if self.neg.extended {
            return Err(self.protocol(offset, "a simple reply with extended headers".into()));
        }
        self.data_into_sink(io, sink, offset, len as usize)?;
        self.slots[i].got = len;
        self.done(cookie)
    }

    /// One chunk of the reply to read `i`.
    fn read_chunk(
        &mut self,
        io: &mut impl Read,
        sink: &mut dyn Sink,
        i: usize,
        kind: u16,
        len: u64,
    ) -> Result<(), PullError> {
        let s = self.slots[i];
        match kind {
            chunk::OFFSET_DATA if len >= 8 && len - 8 <= s.len => {
                let mut at = [0u8; 8];
                io.read_exact(&mut at).map_err(|e| self.lost(e))?;
                let at = u64::from_be_bytes(at);
                let n = len - 8;
                if !inside(&s, at, n) {
                    return Err(self.protocol(s.offset, format!("data at {at} outside its read")));
                }
                self.data_into_sink(io, sink, at, n as usize)?;
                self.slots[i].got += n;
            }
            chunk::OFFSET_HOLE if len == 12 => {
                self.small_payload(io, len, s.offset)?;
                let at = proto::be64(&self.small[0..8]);
                let n = u64::from(proto::be32(&self.small[8..12]));
                if !inside(&s, at, n) || n == 0 {
                    return Err(self.protocol(s.offset, format!("a hole at {at} outside its read")));
                }
                sink.zeroes(at, n)
                    .map_err(|error| PullError::Sink { offset: at, error })?;
                self.slots[i].got += n;
            }
            chunk::NONE if len == 0 => {}
            k if k & (1 << 15) != 0 => return Err(self.error_chunk(io, "read", &s, k, len)),
            k => {
                let why = format!("a chunk of type {k} and {len} bytes to a read");
                return Err(self.protocol(s.offset, why));
            }
        }
        Ok(())
    }

    /// Receives `n` bytes of data into the buffer and hands them to the sink.
    fn data_into_sink(
        &mut self,
        io: &mut impl Read,
        sink: &mut dyn Sink,
        offset: u64,
        n: usize,
    ) -> Result<(), PullError> {
        debug_assert!(n <= self.buf.len(), "a read longer than its buffer");
        if let Err(e) = io.read_exact(&mut self.buf[..n]) {
            return Err(self.lost(e));
        }
        sink.data(offset, &self.buf[..n])
            .map_err(|error| PullError::Sink { offset, error })
    }

    /// One chunk of the reply to the block status in flight.
    fn status_chunk(
        &mut self,
        io: &mut impl Read,
        cookie: u64,
        kind: u16,
        len: u64,
    ) -> Result<(), PullError> {
        let (offset, asked) = self.status_range(cookie)?;
        match kind {
            chunk::NONE if len == 0 => return Ok(()),
            chunk::BLOCK_STATUS | chunk::BLOCK_STATUS_EXT if len <= STATUS_CHUNK_MAX => {}
            k if k & (1 << 15) != 0 => {
                let s = Slot {
                    offset,
                    len: asked,
                    ..Slot::default()
                };
                return Err(self.error_chunk(io, "block status", &s, k, len));
            }
            k => {
                let why = format!("a chunk of type {k} and {len} bytes to block status");
                return Err(self.protocol(offset, why));
            }
        }
        self.small.resize(len as usize, 0);
        if let Err(e) = io.read_exact(&mut self.small) {
            return Err(self.lost(e));
        }
        // Taken out while the planner is fed from it, and put back (its memory reused).
        let small = std::mem::take(&mut self.small);
        let r = match status_extents(kind, &small) {
            None => Err(self.protocol(offset, format!("a block status chunk of {len} bytes"))),
            // Another context's: not asked for, ignored.
            Some(e) if Some(e.id) != self.context => Ok(()),
            Some(e) => self.walk(offset, asked, e),
        };
        self.small = small;
        r
    }

    /// Feeds the extents of a status chunk to the planner, from where the request's
    /// extents so far ended.
    fn walk(&mut self, offset: u64, asked: u64, extents: Extents<'_>) -> Result<(), PullError> {
        let Some((_, _, _, covered)) = self.status.asked.as_mut() else {
            return Err(self.protocol(offset, "no block status asked".into()));
        };
        let end = offset + asked;
        let mut pos = offset + *covered;
        for (elen, flags) in extents {
            if pos >= end {
                break;
            }
            if elen == 0 {
                return Err(self.protocol(pos, "an extent of length 0".into()));
            }
            // A length from the server: it may reach beyond the request, or 2^64.
            let e = pos.saturating_add(elen).min(end);
            self.plan.feed(pos, e - pos, self.select.wants(flags));
            pos = e;
        }
        if let Some((_, _, _, covered)) = self.status.asked.as_mut() {
            *covered = pos - offset;
        }
        Ok(())
    }

    /// The end of a reply: a read's slot is freed (its chunks must have covered it), the
    /// block status walk moves on past what its extents covered.
    fn done(&mut self, cookie: u64) -> Result<(), PullError> {
        if cookie & 0xffff == STATUS_SLOT {
            let (offset, _) = self.status_range(cookie)?;
            let covered = self.status.asked.map_or(0, |a| a.3);
            if covered == 0 {
                return Err(self.protocol(offset, "block status described nothing".into()));
            }
            self.status.asked = None;
            self.status.next = offset + covered;
            if self.status.next >= self.neg.size {
                self.plan.close();
            }
            return Ok(());
        }
        let i = self.slot_of(cookie)?;
        let s = self.slots[i];
        if s.got != s.len {
            let why = format!("the reply to a read of {} bytes carried {}", s.len, s.got);
            return Err(self.protocol(s.offset, why));
        }
        self.slots[i].busy = false;
        self.free.push(i);
        self.in_flight -= 1;
        Ok(())
    }

    /// The slot of a read in flight with this cookie.
    fn slot_of(&self, cookie: u64) -> Result<usize, PullError> {
        let i = (cookie & 0xffff) as usize;
        match self.slots.get(i) {
            Some(s) if s.busy && s.cookie == cookie => Ok(i),
            _ => Err(self.protocol(self.lowest(), format!("a reply to unknown cookie {cookie}"))),
        }
    }

    /// The block status in flight with this cookie: its offset and length.
    fn status_range(&self, cookie: u64) -> Result<(u64, u64), PullError> {
        match self.status.asked {
            Some((c, offset, len, _)) if c == cookie => Ok((offset, len)),
            _ => Err(self.protocol(self.lowest(), format!("a reply to unknown cookie {cookie}"))),
        }
    }

    /// Reads a small chunk's payload into `small`.
    fn small_payload(&mut self, io: &mut impl Read, len: u64, at: u64) -> Result<(), PullError> {
        if len > SMALL_CHUNK_MAX {
            return Err(self.protocol(at, format!("a chunk of {len} bytes")));
        }
        self.small.resize(len as usize, 0);
        if let Err(e) = io.read_exact(&mut self.small) {
            return Err(self.lost(e));
        }
        Ok(())
    }

    /// An error chunk to the request `s` (of kind `what`).
    fn error_chunk(
        &mut self,
        io: &mut impl Read,
        what: &'static str,
        s: &Slot,
        kind: u16,
        len: u64,
    ) -> PullError {
        if let Err(e) = self.small_payload(io, len, s.offset) {
            return e;
        }
        let p = &self.small;
        if p.len() < 6 {
            return self.protocol(s.offset, format!("an error chunk of {len} bytes"));
        }
        let error = proto::be32(&p[0..4]);
        let n = usize::from(proto::be16(&p[4..6]));
        let text = p.get(6..6 + n).map(String::from_utf8_lossy);
        let mut offset = s.offset;
        if kind == chunk::ERROR_OFFSET {
            if let Some(at) = p.get(6 + n..14 + n) {
                offset = proto::be64(at);
            }
        }
        let message = text.map(|t| format!(": {t}")).unwrap_or_default();
        server_error(what, offset, s.len, error, &message)
    }

    /// The lowest offset in flight (of reads, else of the block status).
    fn lowest(&self) -> u64 {
        let reads = self.slots.iter().filter(|s| s.busy).map(|s| s.offset).min();
        reads
            .or(self.status.asked.map(|a| a.1))
            .unwrap_or(self.status.next)
    }

    fn lost(&self, error: std::io::Error) -> PullError {
        let error = if matches!(
            error.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            std::io::Error::new(std::io::ErrorKind::TimedOut, "no reply in time")
        } else if error.kind() == std::io::ErrorKind::UnexpectedEof {
            std::io::Error::new(error.kind(), "the server closed the connection")
        } else {
            error
        };
        PullError::Lost {
            offset: self.lowest(),
            error,
        }
    }

    fn protocol(&self, offset: u64, why: String) -> PullError {
        PullError::Protocol { offset, why }
    }
}

/// A server's error for a request.
fn server_error(what: &'static str, offset: u64, len: u64, error: u32, message: &str) -> PullError {
    let code = if error == 0 { proto::errno::EIO } else { error };
    PullError::Server {
        what,
        offset,
        len,
        error: std::io::Error::from_raw_os_error(proto::errno::to_local(code)),
        message: message.to_string(),
    }
}

/// Whether `[at, at + n)` lies inside the read `s`.
fn inside(s: &Slot, at: u64, n: u64) -> bool {
    at >= s.offset && at.checked_add(n).is_some_and(|e| e <= s.offset + s.len)
}

/// The extents of a block status chunk: its context id, then (length, flags) pairs.
#[derive(Debug, Clone, Copy)]
struct Extents<'p> {
    id: u32,
    wide: bool,
    rest: &'p [u8],
}

/// Parses a block status chunk's payload (`BLOCK_STATUS` or `BLOCK_STATUS_EXT`), or
/// `None` if its length does not fit the kind.
fn status_extents(kind: u16, p: &[u8]) -> Option<Extents<'_>> {
    let (wide, head, each) = match kind {
        chunk::BLOCK_STATUS => (false, 4, 8),
        chunk::BLOCK_STATUS_EXT => (true, 8, 16),
        _ => return None,
    };
    if p.len() < head || !(p.len() - head).is_multiple_of(each) {
        return None;
    }
    Some(Extents {
        id: proto::be32(&p[0..4]),
        wide,
        rest: &p[head..],
    })
}

impl Iterator for Extents<'_> {
    type Item = (u64, u32);

    fn next(&mut self) -> Option<(u64, u32)> {
        let each = if self.wide { 16 } else { 8 };
        let e = self.rest.get(..each)?;
        self.rest = &self.rest[each..];
        Some(if self.wide {
            // The flags of a 64-bit extent: the low 32 bits carry every defined one.
            (proto::be64(&e[0..8]), proto::be64(&e[8..16]) as u32)
        } else {
            (u64::from(proto::be32(&e[0..4])), proto::be32(&e[4..8]))
        })
    }
}

/// Turns selected extents, in order, into reads: adjacent ones merged, each read at most
/// `request` bytes, widened to whole blocks (the server's minimum) and clipped to the
/// export, never overlapping one planned before.
#[derive(Debug)]
struct Planner {
    block: u64,
    size: u64,
    request: u64,
    /// The run of selected extents not yet planned in full: start, end.
    run: Option<(u64, u64)>,
    /// The end of the last read planned.
    planned_end: u64,
    /// Reads planned and not yet sent: offset, length.
    pieces: VecDeque<(u64, u64)>,
    runs: u64,
}

impl Planner {
    fn new(block: u64, size: u64, request: u64) -> Planner {
        debug_assert!(request >= block && request.is_multiple_of(block));
        Planner {
            block,
            size,
            request,
            run: None,
            planned_end: 0,
            pieces: VecDeque::new(),
            runs: 0,
        }
    }

    /// The extent `[offset, offset + len)`, after every extent fed before it.
    fn feed(&mut self, offset: u64, len: u64, selected: bool) {
        if !selected || len == 0 {
            self.close();
            return;
        }
        match &mut self.run {
            Some((_, end)) if *end == offset => *end += len,
            _ => {
                self.close();
                self.run = Some((offset, offset + len));
                self.runs += 1;
            }
        }
        self.cut(false);
    }

    /// Plans what remains of the open run: it ended.
    fn close(&mut self) {
        self.cut(true);
        self.run = None;
    }

    /// Plans whole reads of the open run, and with `all` its remainder too.
    fn cut(&mut self, all: bool) {
        let Some((start, end)) = self.run else {
            return;
        };
        let mut a = (start / self.block * self.block).max(self.planned_end);
        let b = end.next_multiple_of(self.block).min(self.size);
        while a < b && (all || b - a >= self.request) {
            let n = (b - a).min(self.request);
            self.pieces.push_back((a, n));
            a += n;
            self.planned_end = a;
        }
        if !all {
            self.run = Some((a.max(start), end));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(p: &mut Planner) -> Vec<(u64, u64)> {
        p.pieces.drain(..).collect()
    }

    #[test]
    fn adjacent_extents_merge_into_reads_of_at_most_the_request() {
        let mut p = Planner::new(512, 1 << 20, 4096);
        p.feed(0, 1024, true);
        p.feed(1024, 1024, true);
        assert!(p.pieces.is_empty(), "a run still open is not cut short");
        p.feed(2048, 8192, true);
        assert_eq!(planned(&mut p), vec![(0, 4096), (4096, 4096)]);
        p.feed(10240, 512, false);
        assert_eq!(planned(&mut p), vec![(8192, 2048)]);
        p.feed(20000, 100, true);
        p.close();
        // Widened to whole blocks.
        assert_eq!(planned(&mut p), vec![(19968, 512)]);
        assert_eq!(p.runs, 2);
    }

    #[test]
    fn reads_never_overlap_and_stop_at_the_export_end() {
        // Two selected extents in one block: the second adds nothing.
        let mut p = Planner::new(4096, 10_000, 1 << 20);
        p.feed(0, 100, true);
        p.feed(100, 200, false);
        p.feed(300, 100, true);
        p.feed(400, 9000, false);
        p.feed(9400, 600, true);
        p.close();
        assert_eq!(planned(&mut p), vec![(0, 4096), (8192, 10_000 - 8192)]);
    }

    #[test]
    fn status_chunks_parse_by_kind_and_refuse_ragged_lengths() {
        let mut p = 7u32.to_be_bytes().to_vec();
        p.extend_from_slice(&4096u32.to_be_bytes());
        p.extend_from_slice(&1u32.to_be_bytes());
        let e = status_extents(chunk::BLOCK_STATUS, &p).expect("parses");
        assert_eq!(e.id, 7);
        assert_eq!(e.collect::<Vec<_>>(), vec![(4096, 1)]);
        p.push(0);
        assert!(status_extents(chunk::BLOCK_STATUS, &p).is_none());
        let mut w = 7u32.to_be_bytes().to_vec();
        w.extend_from_slice(&1u32.to_be_bytes());
        w.extend_from_slice(&(1u64 << 40).to_be_bytes());
        w.extend_from_slice(&3u64.to_be_bytes());
        let e = status_extents(chunk::BLOCK_STATUS_EXT, &w).expect("parses");
        assert_eq!(e.collect::<Vec<_>>(), vec![(1 << 40, 3)]);
        assert!(status_extents(chunk::BLOCK_STATUS_EXT, &w[..20]).is_none());
    }

    #[test]
    fn selections_read_what_they_name() {
        let all = Select::Allocated;
        assert!(all.wants(0) && all.wants(proto::state::HOLE));
        assert!(!all.wants(proto::state::ZERO));
        let dirty = Select::Dirty("c1".into());
        assert_eq!(dirty.context(), "qemu:dirty-bitmap:c1");
        assert!(dirty.wants(1) && !dirty.wants(0) && !dirty.wants(2));
    }
}
