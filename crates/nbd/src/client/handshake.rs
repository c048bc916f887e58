//! The client side of the NBD handshake (fixed newstyle), for the `nbd` device: connect,
//! negotiate structured replies and the `base:allocation` context, choose the export with
//! `NBD_OPT_GO` (asking for block sizes), and hand back the socket ready for transmission
//! with what was agreed.
//!
//! This is blocking code with a deadline: it runs once per connection (and at each
//! reconnect) on the thread that opens the connection, never on a reactor.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::proto::{self, info, opt, rep};
use crate::uri::{Address, NbdUri};

/// Largest option reply read (anything longer is a broken or hostile server).
const MAX_OPTION_REPLY: u32 = 64 << 10;

/// What the client asks for.
#[derive(Debug, Clone, Copy)]
pub struct Want {
    /// Extended headers (64-bit lengths; they imply structured replies).
    pub extended: bool,
    /// Structured replies (needed for block status and sparse reads).
    pub structured: bool,
    /// The `base:allocation` metadata context (needs `structured`).
    pub allocation: bool,
}

impl Default for Want {
    fn default() -> Want {
        Want {
            extended: false,
            structured: true,
            allocation: true,
        }
    }
}

/// What the server agreed to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// Export size in bytes.
    pub size: u64,
    /// Transmission flags (`proto::tflags`).
    pub flags: u16,
    /// Smallest request the server accepts (1 if it sent no block sizes).
    pub min_block: u32,
    /// Request size it prefers.
    pub preferred_block: u32,
    /// Largest payload it takes in one request.
    pub max_payload: u32,
    /// Structured replies are on.
    pub structured: bool,
    /// Extended headers are on (every request and reply uses them).
    pub extended: bool,
    /// The id of `base:allocation`, if the server has it.
    pub allocation_id: Option<u32>,
    /// Every metadata context the server agreed to, with its id (`base:allocation`
    /// included).
    pub contexts: Vec<(u32, String)>,
}

impl Negotiated {
    /// The id of the metadata context `name`, if the server agreed to it.
    pub fn context_id(&self, name: &str) -> Option<u32> {
        self.contexts
            .iter()
            .find(|(_, n)| n == name)
            .map(|(id, _)| *id)
    }
}

/// Why a handshake failed.
#[derive(Debug)]
pub enum HandshakeError {
    /// The connection failed or ended (worth retrying later).
    Io(std::io::Error),
    /// The server said no, or is not an NBD server (retrying will not help).
    Refused(String),
}

impl std::fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandshakeError::Io(e) => write!(f, "{e}"),
            HandshakeError::Refused(why) => f.write_str(why),
        }
    }
}

impl From<std::io::Error> for HandshakeError {
    fn from(e: std::io::Error) -> HandshakeError {
        HandshakeError::Io(e)
    }
}

fn refused(why: impl Into<String>) -> HandshakeError {
    HandshakeError::Refused(why.into())
}

/// A connected stream of either kind.
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn set_timeouts(&self, d: Duration) -> std::io::Result<()> {
        let d = Some(d.max(Duration::from_millis(1)));
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(d)?;
                s.set_write_timeout(d)
            }
            Stream::Unix(s) => {
                s.set_read_timeout(d)?;
                s.set_write_timeout(d)
            }
        }
    }

    fn into_fd(self) -> std::io::Result<OwnedFd> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(None)?;
                s.set_write_timeout(None)?;
                Ok(s.into())
            }
            Stream::Unix(s) => {
                s.set_read_timeout(None)?;
                s.set_write_timeout(None)?;
                Ok(s.into())
            }
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A connection in the transmission phase.
pub struct Connected {
    /// The socket (blocking mode, no timeouts).
    pub fd: OwnedFd,
    /// What was agreed.
    pub neg: Negotiated,
    /// The TLS session (`nbds://`): every byte on the socket from now on goes through it.
    pub tls: Option<Box<rustls::ClientConnection>>,
}

/// Connects to a server that `uri` names without TLS and negotiates, all within
/// `timeout`; the socket and what was agreed.
pub fn connect(
    uri: &NbdUri,
    want: Want,
    timeout: Duration,
) -> Result<(OwnedFd, Negotiated), HandshakeError> {
    if uri.tls {
        return Err(refused(
            "connect() is for plain connections: use connect_any",
        ));
    }
    let c = connect_any(uri, want, timeout)?;
    Ok((c.fd, c.neg))
}

/// Connects to `uri`'s server and negotiates, all within `timeout`: with `nbds://`, TLS
/// starts (STARTTLS) right after the greeting and the options go over it.
pub fn connect_any(
    uri: &NbdUri,
    want: Want,
    timeout: Duration,
) -> Result<Connected, HandshakeError> {
    connect_with_contexts(uri, want, &[], timeout)
}

/// [`connect_any`], asking for the metadata contexts `contexts` too (with structured
/// replies); [`Negotiated::contexts`] says which the server agreed to. A context the
/// server does not have is not an error here: the caller decides.
pub fn connect_with_contexts(
    uri: &NbdUri,
    want: Want,
    contexts: &[&str],
    timeout: Duration,
) -> Result<Connected, HandshakeError> {
    let (opened, no_zeroes) = open(uri, timeout)?;
    match opened {
        Opened::Plain(mut stream) => {
            let neg = options(&mut stream, &uri.export, want, contexts, no_zeroes)?;
            Ok(Connected {
                fd: stream.into_fd()?,
                neg,
                tls: None,
            })
        }
        Opened::Tls(mut tls) => {
            let neg = options(&mut *tls, &uri.export, want, contexts, no_zeroes)?;
            let rustls::StreamOwned { conn, sock } = *tls;
            Ok(Connected {
                fd: sock.into_fd()?,
                neg,
                tls: Some(Box::new(conn)),
            })
        }
    }
}

/// The metadata contexts the server offers on `uri`'s export (`NBD_OPT_LIST_META_CONTEXT`
/// with no query: all of them), on a connection of its own that ends with
/// `NBD_OPT_ABORT`. For error messages that name what a server has.
pub fn list_contexts(uri: &NbdUri, timeout: Duration) -> Result<Vec<String>, HandshakeError> {
    let (opened, _) = open(uri, timeout)?;
    match opened {
        Opened::Plain(mut stream) => list_on(&mut stream, &uri.export),
        Opened::Tls(mut tls) => list_on(&mut *tls, &uri.export),
    }
}

/// A connection past the greeting (and past STARTTLS with `nbds://`), ready for options.
enum Opened {
    Plain(Stream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, Stream>>),
}

/// Dials `uri`'s server and reads its greeting, with TLS started for `nbds://`, all
/// within `timeout` (which stays the socket's timeout until the handshake ends); whether
/// the server leaves out the zeroes after EXPORT_NAME.
fn open(uri: &NbdUri, timeout: Duration) -> Result<(Opened, bool), HandshakeError> {
    let config = if uri.tls {
        Some(crate::tls::client_config(uri).map_err(HandshakeError::Refused)?)
    } else {
        None
    };
    let deadline = Instant::now() + timeout;
    let mut stream = dial(&uri.address, deadline)?;
    stream.set_timeouts(deadline.saturating_duration_since(Instant::now()))?;
    let no_zeroes = greet(&mut stream)?;
    let opened = match config {
        None => Opened::Plain(stream),
        Some(config) => Opened::Tls(Box::new(start_tls(stream, uri, config)?)),
    };
    Ok((opened, no_zeroes))
}

/// Structured replies, then the list of every context of `export`, then ABORT.
fn list_on<S: Read + Write>(s: &mut S, export: &str) -> Result<Vec<String>, HandshakeError> {
    let want = Want {
        extended: false,
        structured: true,
        allocation: false,
    };
    let (structured, _) = ask_headers(s, want)?;
    if !structured {
        return Err(refused(
            "the server has no structured replies, so no metadata contexts",
        ));
    }
    let mut data = export_name_field(export)?;
    data.extend_from_slice(&0u32.to_be_bytes());
    send_option(s, opt::LIST_META_CONTEXT, &data)?;
    let mut names = Vec::new();
    loop {
        let (kind, data) = read_reply(s, opt::LIST_META_CONTEXT)?;
        match kind {
            rep::META_CONTEXT if data.len() >= 4 => {
                names.push(String::from_utf8_lossy(&data[4..]).into_owned());
            }
            rep::ACK => break,
            k if k & (1 << 31) != 0 => {
                return Err(refused(error_text(opt::LIST_META_CONTEXT, k, &data)))
            }
            k => {
                return Err(refused(format!(
                    "unexpected reply {k} to LIST_META_CONTEXT"
                )))
            }
        }
    }
    // The server may answer ABORT or just close: either way the list is complete.
    let _ = send_option(s, opt::ABORT, &[]);
    Ok(names)
}

/// An export's name as options carry it: its length (32 bits), then its bytes.
fn export_name_field(export: &str) -> Result<Vec<u8>, HandshakeError> {
    if export.len() > 4096 {
        return Err(refused("the export name is longer than 4096 bytes"));
    }
    let mut name = Vec::with_capacity(4 + export.len());
    name.extend_from_slice(&(export.len() as u32).to_be_bytes());
    name.extend_from_slice(export.as_bytes());
    Ok(name)
}

/// A socket connected to `address`: the first of a host's addresses that answers
/// before `deadline`.
fn dial(address: &Address, deadline: Instant) -> std::io::Result<Stream> {
    let (host, port) = match address {
        Address::Unix(path) => return Ok(Stream::Unix(UnixStream::connect(path)?)),
        Address::Tcp { host, port } => (host, *port),
    };
    let mut last = None;
    for a in (host.as_str(), port).to_socket_addrs()? {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&a, left.max(Duration::from_millis(1))) {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(Stream::Tcp(s));
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no address")))
}

/// STARTTLS, then the TLS handshake with the server `uri` names, on `stream`.
fn start_tls(
    mut stream: Stream,
    uri: &NbdUri,
    config: Arc<rustls::ClientConfig>,
) -> Result<rustls::StreamOwned<rustls::ClientConnection, Stream>, HandshakeError> {
    send_option(&mut stream, opt::STARTTLS, &[])?;
    let (kind, data) = read_reply(&mut stream, opt::STARTTLS)?;
    if kind != rep::ACK {
        return Err(refused(error_text(opt::STARTTLS, kind, &data)));
    }
    let name = crate::tls::server_name(uri);
    let conn =
        rustls::ClientConnection::new(config, name).map_err(|e| refused(format!("TLS: {e}")))?;
    let mut tls = rustls::StreamOwned::new(conn, stream);
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock).map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidData {
                refused(format!("TLS: {e}"))
            } else {
                HandshakeError::Io(e)
            }
        })?;
    }
    Ok(tls)
}

fn read_u16(s: &mut impl Read) -> std::io::Result<u16> {
    let mut b = [0u8; 2];
    s.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}

fn read_u64(s: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

fn send_option(s: &mut impl Write, option: u32, data: &[u8]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(16 + data.len());
    out.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    s.write_all(&out)
}

/// One option reply: its type and data.
fn read_reply(s: &mut impl Read, option: u32) -> Result<(u32, Vec<u8>), HandshakeError> {
    let mut h = [0u8; 20];
    s.read_exact(&mut h)?;
    let magic = u64::from_be_bytes(h[0..8].try_into().expect("8 bytes"));
    let got = u32::from_be_bytes(h[8..12].try_into().expect("4 bytes"));
    let kind = u32::from_be_bytes(h[12..16].try_into().expect("4 bytes"));
    let len = u32::from_be_bytes(h[16..20].try_into().expect("4 bytes"));
    if magic != proto::REPLY_MAGIC {
        return Err(refused(format!(
            "bad option reply magic {magic:#x} (not an NBD server?)"
        )));
    }
    if got != option {
        return Err(refused(format!(
            "reply to option {} while {} was asked",
            opt::name(got),
            opt::name(option)
        )));
    }
    if len > MAX_OPTION_REPLY {
        return Err(refused(format!(
            "option reply of {len} bytes (at most {MAX_OPTION_REPLY})"
        )));
    }
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data)?;
    Ok((kind, data))
}

/// The text of an error reply.
fn error_text(option: u32, kind: u32, data: &[u8]) -> String {
    let what = match kind {
        rep::ERR_UNSUP => "not supported",
        rep::ERR_POLICY => "forbidden by policy",
        rep::ERR_INVALID => "invalid",
        rep::ERR_PLATFORM => "not available on this server",
        rep::ERR_TLS_REQD => "TLS is required",
        rep::ERR_UNKNOWN => "no such export",
        rep::ERR_SHUTDOWN => "the server is shutting down",
        rep::ERR_BLOCK_SIZE_REQD => "block sizes must be asked for",
        rep::ERR_TOO_BIG => "too big",
        _ => "an error",
    };
    let msg = String::from_utf8_lossy(data);
    if msg.is_empty() {
        format!("{}: {what}", opt::name(option))
    } else {
        format!("{}: {what} ({msg})", opt::name(option))
    }
}

/// The handshake on `s`, from the server's greeting to the end of `NBD_OPT_GO` (or
/// `NBD_OPT_EXPORT_NAME` on a server without GO).
pub fn negotiate<S: Read + Write>(
    s: &mut S,
    export: &str,
    want: Want,
) -> Result<Negotiated, HandshakeError> {
    let no_zeroes = greet(s)?;
    options(s, export, want, &[], no_zeroes)
}

/// The server's greeting and the client's flags; whether the server leaves out the
/// zeroes after EXPORT_NAME.
fn greet<S: Read + Write>(s: &mut S) -> Result<bool, HandshakeError> {
    let magic = read_u64(s)?;
    if magic != proto::NBDMAGIC {
        return Err(refused("not an NBD server (no NBDMAGIC)"));
    }
    let style = read_u64(s)?;
    if style != proto::IHAVEOPT {
        return Err(refused(
            "the server speaks the oldstyle handshake, which cairn does not",
        ));
    }
    let hflags = read_u16(s)?;
    if hflags & proto::FLAG_FIXED_NEWSTYLE == 0 {
        return Err(refused(
            "the server does not speak the fixed newstyle handshake",
        ));
    }
    let no_zeroes = hflags & proto::FLAG_NO_ZEROES != 0;
    let mut cflags = proto::FLAG_C_FIXED_NEWSTYLE;
    if no_zeroes {
        cflags |= proto::FLAG_C_NO_ZEROES;
    }
    s.write_all(&cflags.to_be_bytes())?;
    Ok(no_zeroes)
}

/// The options, from after the greeting (and TLS) to the end of GO; `contexts`: the
/// metadata contexts asked for besides `base:allocation` (which `want` asks for).
fn options<S: Read + Write>(
    s: &mut S,
    export: &str,
    want: Want,
    contexts: &[&str],
    no_zeroes: bool,
) -> Result<Negotiated, HandshakeError> {
    let name = export_name_field(export)?;
    let (structured, extended) = ask_headers(s, want)?;
    let mut queries: Vec<&str> = Vec::with_capacity(1 + contexts.len());
    if want.allocation {
        queries.push(proto::BASE_ALLOCATION);
    }
    queries.extend(contexts.iter().filter(|c| **c != proto::BASE_ALLOCATION));
    let contexts = if structured && !queries.is_empty() {
        ask_contexts(s, &name, &queries)?
    } else {
        Vec::new()
    };
    let allocation_id = contexts
        .iter()
        .find(|(_, n)| n == proto::BASE_ALLOCATION)
        .map(|(id, _)| *id);
    // What a server that sends no block sizes is taken to mean.
    let agreed = Negotiated {
        size: 0,
        flags: 0,
        min_block: 1,
        preferred_block: 4096,
        max_payload: 32 << 20,
        structured,
        extended,
        allocation_id,
        contexts,
    };
    go(s, &name, no_zeroes, agreed)
}

/// Extended headers, else structured replies, as far as `want` asks for them and the
/// server takes them: (structured, extended).
fn ask_headers<S: Read + Write>(s: &mut S, want: Want) -> Result<(bool, bool), HandshakeError> {
    let (mut structured, mut extended) = (false, false);
    if want.extended {
        send_option(s, opt::EXTENDED_HEADERS, &[])?;
        let (kind, data) = read_reply(s, opt::EXTENDED_HEADERS)?;
        match kind {
            rep::ACK => (structured, extended) = (true, true),
            k if k & (1 << 31) != 0 => {
                log::debug!(
                    "cairn: nbd client: {}",
                    error_text(opt::EXTENDED_HEADERS, k, &data)
                );
            }
            k => return Err(refused(format!("unexpected reply {k} to EXTENDED_HEADERS"))),
        }
    }
    if want.structured && !structured {
        send_option(s, opt::STRUCTURED_REPLY, &[])?;
        let (kind, data) = read_reply(s, opt::STRUCTURED_REPLY)?;
        match kind {
            rep::ACK => structured = true,
            k if k & (1 << 31) != 0 => {
                log::debug!(
                    "cairn: nbd client: {}",
                    error_text(opt::STRUCTURED_REPLY, k, &data)
                );
            }
            k => return Err(refused(format!("unexpected reply {k} to STRUCTURED_REPLY"))),
        }
    }
    Ok((structured, extended))
}

/// `SET_META_CONTEXT` for `queries` on the export `name` (its length first): the
/// contexts the server agreed to, with their ids (only those asked for: a server that
/// names another is ignored).
fn ask_contexts<S: Read + Write>(
    s: &mut S,
    name: &[u8],
    queries: &[&str],
) -> Result<Vec<(u32, String)>, HandshakeError> {
    let mut data = name.to_vec();
    data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        if q.len() > 4096 {
            return Err(refused("a metadata context name is longer than 4096 bytes"));
        }
        data.extend_from_slice(&(q.len() as u32).to_be_bytes());
        data.extend_from_slice(q.as_bytes());
    }
    send_option(s, opt::SET_META_CONTEXT, &data)?;
    let mut agreed: Vec<(u32, String)> = Vec::with_capacity(queries.len());
    loop {
        let (kind, data) = read_reply(s, opt::SET_META_CONTEXT)?;
        match kind {
            rep::META_CONTEXT if data.len() >= 4 => {
                let id = u32::from_be_bytes(data[..4].try_into().expect("4 bytes"));
                let got = &data[4..];
                if let Some(q) = queries.iter().find(|q| q.as_bytes() == got) {
                    if !agreed.iter().any(|(_, n)| n == q) {
                        agreed.push((id, q.to_string()));
                    }
                }
            }
            rep::ACK => return Ok(agreed),
            k if k & (1 << 31) != 0 => {
                log::debug!(
                    "cairn: nbd client: {}",
                    error_text(opt::SET_META_CONTEXT, k, &data)
                );
                return Ok(Vec::new());
            }
            k => return Err(refused(format!("unexpected reply {k} to SET_META_CONTEXT"))),
        }
    }
}

/// `NBD_OPT_GO` on the export `name` (its length first), asking for block sizes: what
/// was `agreed` so far, with the export's size, flags and block sizes; on a server
/// without GO, `NBD_OPT_EXPORT_NAME` instead.
fn go<S: Read + Write>(
    s: &mut S,
    name: &[u8],
    no_zeroes: bool,
    mut agreed: Negotiated,
) -> Result<Negotiated, HandshakeError> {
    let mut data = name.to_vec();
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
    send_option(s, opt::GO, &data)?;
    let mut size = None;
    loop {
        let (kind, data) = read_reply(s, opt::GO)?;
        match kind {
            rep::INFO if data.len() >= 2 => {
                let t = u16::from_be_bytes([data[0], data[1]]);
                match t {
                    info::EXPORT if data.len() == 12 => {
                        size = Some(u64::from_be_bytes(data[2..10].try_into().expect("8")));
                        agreed.flags = u16::from_be_bytes([data[10], data[11]]);
                    }
                    info::BLOCK_SIZE if data.len() == 14 => {
                        let f =
                            |i: usize| u32::from_be_bytes(data[i..i + 4].try_into().expect("4"));
                        (agreed.min_block, agreed.preferred_block, agreed.max_payload) =
                            (f(2), f(6), f(10));
                    }
                    _ => {}
                }
            }
            rep::ACK => break,
            rep::ERR_UNSUP if !agreed.extended => {
                // A server without GO: the old way (no error replies, no block sizes).
                return export_name(s, &name[4..], no_zeroes, agreed);
            }
            k if k & (1 << 31) != 0 => return Err(refused(error_text(opt::GO, k, &data))),
            _ => {}
        }
    }
    agreed.size = size.ok_or_else(|| refused("GO ended without the export's size"))?;
    check_go(&agreed)?;
    Ok(agreed)
}

/// Refuses transmission flags without `HAS_FLAGS`, and block sizes that make no sense.
fn check_go(n: &Negotiated) -> Result<(), HandshakeError> {
    if n.flags & proto::tflags::HAS_FLAGS == 0 {
        return Err(refused("the transmission flags lack HAS_FLAGS"));
    }
    let (min_block, preferred_block, max_payload) = (n.min_block, n.preferred_block, n.max_payload);
    if !min_block.is_power_of_two()
        || min_block > 64 << 10
        || !preferred_block.is_power_of_two()
        || preferred_block < min_block
        || max_payload < preferred_block
    {
        return Err(refused(format!(
            "block sizes make no sense: minimum {min_block}, preferred {preferred_block}, maximum {max_payload}"
        )));
    }
    Ok(())
}

/// `NBD_OPT_EXPORT_NAME`: size and flags, then (unless no-zeroes) 124 zero bytes.
fn export_name<S: Read + Write>(
    s: &mut S,
    export: &[u8],
    no_zeroes: bool,
    agreed: Negotiated,
) -> Result<Negotiated, HandshakeError> {
    send_option(s, opt::EXPORT_NAME, export)?;
    let size = read_u64(s)?;
    let flags = read_u16(s)?;
    if !no_zeroes {
        let mut zeroes = [0u8; 124];
        s.read_exact(&mut zeroes)?;
    }
    Ok(Negotiated {
        size,
        flags,
        min_block: 1,
        preferred_block: 4096,
        max_payload: 32 << 20,
        extended: false,
        ..agreed
    })
}
