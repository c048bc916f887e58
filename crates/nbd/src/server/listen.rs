//! Where `cairn serve` listens: the `--listen` addresses, bound before any device is
//! opened (so that an address in use refuses the start before anything changes), the
//! sockets passed by socket activation, and accepting a connection from them.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;

use cairn_core::socket::SocketFile;
use cairn_core::Error;

use crate::server::observe::Client;

/// Where to listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// `tcp:HOST:PORT`.
    Tcp(String),
    /// `unix:PATH`.
    Unix(PathBuf),
}

impl Listen {
    /// Parses `tcp:HOST:PORT` or `unix:PATH`.
    pub fn parse(text: &str) -> Result<Listen, crate::Error> {
        let bad = |expected| crate::Error::Listen {
            text: text.to_string(),
            expected,
        };
        if let Some(rest) = text.strip_prefix("tcp:") {
            if rest
                .rsplit_once(':')
                .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
            {
                return Err(bad("tcp:HOST:PORT, e.g. tcp:127.0.0.1:10809"));
            }
            Ok(Listen::Tcp(rest.to_string()))
        } else if let Some(rest) = text.strip_prefix("unix:") {
            if rest.is_empty() {
                return Err(bad("unix:PATH"));
            }
            Ok(Listen::Unix(PathBuf::from(rest)))
        } else {
            Err(bad("tcp:HOST:PORT or unix:PATH"))
        }
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Tcp(a) => write!(f, "tcp:{a}"),
            Listen::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

pub(super) enum Listener {
    Tcp(TcpListener),
    Unix {
        listener: UnixListener,
        /// The socket file it made (removed when dropped, after the listener is closed),
        /// unless the service manager passed the socket.
        _file: Option<SocketFile>,
    },
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Listener::Tcp(l) => l.as_fd(),
            Listener::Unix { listener, .. } => listener.as_fd(),
        }
    }
}

impl Listener {
    /// Accepts one connection: its socket, its peer (for logs) and whom it counts
    /// against. A TCP socket gets `TCP_NODELAY`: replies go out as soon as they are sent.
    pub(super) fn accept(&self) -> std::io::Result<(OwnedFd, String, Client)> {
        match self {
            Listener::Tcp(t) => t.accept().map(|(s, a)| {
                let _ = s.set_nodelay(true);
                let client = Client::Ip(a.ip().to_canonical());
                (OwnedFd::from(s), a.to_string(), client)
            }),
            Listener::Unix { listener, .. } => listener.accept().map(|(s, _)| {
                let (uid, name) = unix_peer(&s);
                (OwnedFd::from(s), name, Client::Uid(uid))
            }),
        }
    }

    fn set_nonblocking(&self) -> std::io::Result<()> {
        match self {
            Listener::Tcp(l) => l.set_nonblocking(true),
            Listener::Unix { listener, .. } => listener.set_nonblocking(true),
        }
    }
}

/// The listening sockets of `cairn serve`: bound by [`Listeners::bind`] before any
/// device is opened, so that an address in use refuses the start before a file is
/// created or a superblock written; then served by [`serve`](crate::server::serve).
pub struct Listeners {
    bound: Vec<(Listener, String)>,
}

impl Listeners {
    /// Takes the sockets passed by systemd-style socket activation (`LISTEN_PID`,
    /// `LISTEN_FDS`) and binds every address of `listen`. A `unix:` path follows
    /// [`cairn_core::socket`]'s rule: a stale socket is replaced, a live one or anything
    /// else is refused and left as it is.
    pub fn bind(listen: &[Listen]) -> Result<Listeners, Error> {
        let mut bound = activated();
        for l in listen {
            bound.push(bind_one(l)?);
        }
        Ok(Listeners { bound })
    }

    /// Whether there is none (no address and no socket activation).
    pub fn is_empty(&self) -> bool {
        self.bound.is_empty()
    }

    /// The listeners, each with the address it is shown by, switched to non-blocking
    /// accepts (the accept loop polls them).
    pub(super) fn ready(self) -> Result<Vec<(Listener, String)>, Error> {
        for (l, shown) in &self.bound {
            l.set_nonblocking()
                .map_err(|e| Error::os(format!("serve: {shown}: O_NONBLOCK"), e))?;
        }
        Ok(self.bound)
    }
}

fn bind_one(l: &Listen) -> Result<(Listener, String), Error> {
    match l {
        Listen::Tcp(addr) => {
            let addrs: Vec<SocketAddr> = addr
                .to_socket_addrs()
                .map_err(|e| Error::os(format!("--listen tcp:{addr}"), e))?
                .collect();
            let listener = TcpListener::bind(&addrs[..])
                .map_err(|e| Error::os(format!("--listen tcp:{addr}: bind"), e))?;
            let shown = listener
                .local_addr()
                .map(|a| format!("tcp:{a}"))
                .unwrap_or_else(|_| format!("tcp:{addr}"));
            Ok((Listener::Tcp(listener), shown))
        }
        Listen::Unix(path) => {
            let (listener, file) =
                cairn_core::socket::bind(path, &format!("--listen unix:{}", path.display()))?;
            Ok((
                Listener::Unix {
                    listener,
                    _file: Some(file),
                },
                format!("unix:{}", path.display()),
            ))
        }
    }
}

/// Listeners passed by systemd-style socket activation (`LISTEN_PID`, `LISTEN_FDS`).
fn activated() -> Vec<(Listener, String)> {
    let pid_ok = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
        == Some(std::process::id());
    let n = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.parse::<i32>().ok())
        .unwrap_or(0);
    if !pid_ok || n <= 0 {
        return Vec::new();
    }
    (3..3 + n)
        .map(|raw| {
            // SAFETY: the service manager passed descriptors 3 to 3 + LISTEN_FDS - 1 to
            // this process, which owns them from here on (systemd's convention); nothing
            // else in it takes them.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            let _ = rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC);
            let domain = rustix::net::sockopt::socket_domain(&fd);
            if domain.is_ok_and(|d| d == rustix::net::AddressFamily::UNIX) {
                let l = Listener::Unix {
                    listener: UnixListener::from(fd),
                    _file: None,
                };
                (l, format!("fd:{raw} (unix)"))
            } else {
                (
                    Listener::Tcp(TcpListener::from(fd)),
                    format!("fd:{raw} (tcp)"),
                )
            }
        })
        .collect()
}

/// A Unix socket's peer: its user id (`u32::MAX` if the kernel does not say), and how
/// logs and status name it, `unix (uid 1000, pid 4242)` (`SO_PEERCRED`: who connected).
fn unix_peer(socket: &UnixStream) -> (u32, String) {
    match rustix::net::sockopt::socket_peercred(socket) {
        Ok(c) => (
            c.uid.as_raw(),
            format!(
                "unix (uid {}, pid {})",
                c.uid.as_raw(),
                c.pid.as_raw_nonzero()
            ),
        ),
        Err(_) => (u32::MAX, "unix".to_string()),
    }
}
