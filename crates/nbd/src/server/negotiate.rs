//! A connection's handshake, on a thread of its own: the byte stream (the socket, or TLS
//! after STARTTLS) with the deadline of `--handshake-timeout`, option headers read and
//! answered by the [`Negotiator`](crate::server::handshake::Negotiator) (which decides,
//! without I/O), then the socket handed to a reactor. The only hand-off between threads,
//! once per connection.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cairn_core::DirtyBitmaps;

use crate::proto;
use crate::server::conn::{Msg, NewConn};
use crate::server::handshake::{Negotiator, Session, Step};
use crate::server::observe::Client;
use crate::server::Shared;

/// Largest option payload read; bigger ones are skipped (up to `OPTION_SKIP_MAX`) and
/// answered with `NBD_REP_ERR_TOO_BIG`.
const OPTION_DATA_MAX: u32 = 64 << 10;

const OPTION_SKIP_MAX: u32 = 1 << 20;

/// Runs one handshake; on success the connection is on a reactor and counted there.
pub(super) fn handshake(fd: OwnedFd, (peer, client): (&str, Client), shared: &Shared) -> bool {
    let ch = Channel::Plain(UnixStream::from(fd));
    let deadline = Instant::now() + shared.handshake_timeout;
    let exports = shared.table.snapshot();
    match negotiate(ch, shared, &exports, deadline) {
        Ok(Some((ch, session))) => {
            let (s, tls) = match ch {
                Channel::Plain(s) => (s, None),
                Channel::Tls(t) => {
                    let (conn, s) = t.into_parts();
                    (s, Some(conn))
                }
            };
            let _ = s.set_read_timeout(None);
            let _ = s.set_write_timeout(None);
            let i = shared.next.fetch_add(1, Ordering::Relaxed) % shared.reactors.len();
            let (tx, w) = &shared.reactors[i];
            let nc = NewConn {
                fd: OwnedFd::from(s),
                export: exports[session.export].clone(),
                session,
                peer: peer.to_string(),
                client,
                tls,
            };
            if tx.send(Msg::Conn(Box::new(nc))).is_err() {
                return false;
            }
            cairn_core::event::wake(&**w);
            true
        }
        Ok(None) => false,
        Err(e) => {
            use std::io::ErrorKind::{BrokenPipe, ConnectionReset, UnexpectedEof};
            if matches!(e.kind(), UnexpectedEof | ConnectionReset | BrokenPipe) {
                // A client that leaves mid-handshake (a probe, a port scan, a client
                // giving up) is not a fault of the server's.
                log::info!("cairn: serve: {peer}: closed during the handshake");
            } else {
                log::warn!("cairn: serve: {peer}: handshake: {e}");
            }
            false
        }
    }
}

fn remaining(deadline: Instant) -> std::io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "took longer than --handshake-timeout",
        ));
    }
    Ok(left)
}

/// The handshake's byte stream: the socket, or TLS over it after STARTTLS.
enum Channel {
    Plain(UnixStream),
    Tls(Box<rustls::StreamOwned<rustls::ServerConnection, UnixStream>>),
}

impl Channel {
    fn socket(&self) -> &UnixStream {
        match self {
            Channel::Plain(s) => s,
            Channel::Tls(t) => &t.sock,
        }
    }

    /// Reads exactly `buf.len()` bytes before `deadline`: the time left is set again
    /// before every read, so a client trickling bytes cannot stretch it.
    fn read_exact(&mut self, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
        let mut filled = 0;
        while filled < buf.len() {
            let left = remaining(deadline)?;
            self.socket().set_read_timeout(Some(left))?;
            self.socket().set_write_timeout(Some(left))?;
            let r = match self {
                Channel::Plain(s) => s.read(&mut buf[filled..]),
                Channel::Tls(t) => t.read(&mut buf[filled..]),
            };
            match r {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "took longer than --handshake-timeout",
                    ))
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn write_all(&mut self, buf: &[u8], deadline: Instant) -> std::io::Result<()> {
        self.socket()
            .set_write_timeout(Some(remaining(deadline)?))?;
        self.socket().set_read_timeout(Some(remaining(deadline)?))?;
        match self {
            Channel::Plain(s) => s.write_all(buf),
            Channel::Tls(t) => {
                t.write_all(buf)?;
                t.flush()
            }
        }
    }
}

/// The fixed newstyle handshake: the channel (TLS once STARTTLS succeeded) and the
/// session; `Ok(None)` when the client left or was refused.
fn negotiate(
    mut s: Channel,
    shared: &Shared,
    exports: &[std::sync::Arc<crate::server::table::Listed>],
    deadline: Instant,
) -> std::io::Result<Option<(Channel, Session)>> {
    let mut hello = Vec::with_capacity(18);
    hello.extend_from_slice(&proto::NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&(proto::FLAG_FIXED_NEWSTYLE | proto::FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&hello, deadline)?;
    let mut cf = [0u8; 4];
    s.read_exact(&mut cf, deadline)?;
    let client_flags = u32::from_be_bytes(cf);
    if client_flags & !(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES) != 0 {
        // Unknown client flags: the protocol says to close.
        return Ok(None);
    }
    let catalog = crate::server::table::ExportTable::catalog(exports);
    let bitmaps = |i: usize| {
        let device = &exports[i].export.device;
        device
            .capability::<dyn DirtyBitmaps>()
            .map(|b| b.names())
            .unwrap_or_default()
    };
    let mut neg = Negotiator::new(&catalog, shared.tls, client_flags).with_bitmaps(&bitmaps);
    let mut out = Vec::with_capacity(256);
    let mut data = Vec::new();
    for _ in 0..shared.max_options {
        if shared.shutting.load(Ordering::Relaxed) {
            neg.shut_down();
        }
        let mut hb = [0u8; proto::OPTION_HEADER];
        s.read_exact(&mut hb, deadline)?;
        let Some(h) = proto::parse_option_header(&hb) else {
            return Ok(None);
        };
        out.clear();
        if h.len > OPTION_DATA_MAX {
            if h.len > OPTION_SKIP_MAX {
                return Ok(None);
            }
            skip_option(&mut s, h, &mut out, deadline)?;
            continue;
        }
        data.resize(h.len as usize, 0);
        s.read_exact(&mut data, deadline)?;
        let step = neg.option(h, &data, &mut out);
        s.write_all(&out, deadline)?;
        match step {
            Step::Continue => {}
            Step::Close => return Ok(None),
            Step::Go(session) => return Ok(Some((s, session))),
            Step::StartTls => {
                let Some(tls) = start_tls(s, shared, deadline)? else {
                    return Ok(None);
                };
                s = tls;
                neg.tls_started();
            }
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("more than {} options (--max-options)", shared.max_options),
    ))
}

/// Skips an option whose data is over `OPTION_DATA_MAX` and answers it with
/// `NBD_REP_ERR_TOO_BIG`.
fn skip_option(
    s: &mut Channel,
    h: proto::OptionHeader,
    out: &mut Vec<u8>,
    deadline: Instant,
) -> std::io::Result<()> {
    let mut left = h.len as usize;
    let mut sink = [0u8; 4096];
    while left > 0 {
        let n = left.min(sink.len());
        s.read_exact(&mut sink[..n], deadline)?;
        left -= n;
    }
    proto::put_option_reply(
        out,
        h.option,
        proto::rep::ERR_TOO_BIG,
        b"option data too large",
    );
    s.write_all(out, deadline)
}

/// STARTTLS was accepted: the TLS handshake, finished before the next option. `None` when
/// TLS cannot start (no certificates, or the channel is TLS already; the negotiator allows
/// STARTTLS once, on the plain socket).
fn start_tls(s: Channel, shared: &Shared, deadline: Instant) -> std::io::Result<Option<Channel>> {
    let Some(config) = shared.tls_config.clone() else {
        return Ok(None);
    };
    let conn = rustls::ServerConnection::new(config)
        .map_err(|e| std::io::Error::other(format!("TLS: {e}")))?;
    let Channel::Plain(sock) = s else {
        return Ok(None);
    };
    let mut t = rustls::StreamOwned::new(conn, sock);
    t.sock.set_read_timeout(Some(remaining(deadline)?))?;
    t.sock.set_write_timeout(Some(remaining(deadline)?))?;
    while t.conn.is_handshaking() {
        t.conn.complete_io(&mut t.sock)?;
    }
    Ok(Some(Channel::Tls(Box::new(t))))
}
