//! `cairn serve`: listeners, handshakes, reactor threads and orderly shutdown.
//!
//! The main thread accepts connections and watches for SIGTERM/SIGINT (through a
//! signalfd). Each accepted connection gets a short-lived thread for its handshake, so a
//! slow or hostile client never stalls a reactor; once an export is chosen, the socket
//! moves to one of the reactor threads (round robin) and stays there. That is the only
//! hand-off between threads, once per connection.
//!
//! A request's path, in the order it meets these files: `admit` (a connection slot, or
//! room made by closing an idle one), [`handshake`] (options, the export chosen), then on
//! a reactor [`conn`] (bytes received, framed and checked, issued to the device, replies
//! and TLS), with [`pool`] (buffer memory and its budget), `rmw` (unaligned writes) and
//! [`observe`] (what `status` and the metrics see).

mod admit;
pub mod conn;
mod gate;
pub mod handshake;
pub mod observe;
pub mod pool;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_core::socket::SocketFile;
use cairn_core::{Error, Reactor, Switches};

use crate::proto;
use crate::server::admit::{victim, Admission, Full, Patience};
use crate::server::conn::{Export, Limits, Msg, NewConn, ServerLoop};
use crate::server::handshake::{Catalog, Negotiator, Step, TlsMode};
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
    pub fn parse(text: &str) -> Result<Listen, String> {
        if let Some(rest) = text.strip_prefix("tcp:") {
            if rest
                .rsplit_once(':')
                .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
            {
                return Err(format!(
                    "--listen {text}: expected tcp:HOST:PORT, e.g. tcp:127.0.0.1:10809"
                ));
            }
            Ok(Listen::Tcp(rest.to_string()))
        } else if let Some(rest) = text.strip_prefix("unix:") {
            if rest.is_empty() {
                return Err(format!("--listen {text}: expected unix:PATH"));
            }
            Ok(Listen::Unix(PathBuf::from(rest)))
        } else {
            Err(format!(
                "--listen {text}: expected tcp:HOST:PORT or unix:PATH"
            ))
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

/// Everything `serve` needs besides the listeners and the exports.
#[derive(Clone)]
pub struct Config {
    /// Reactor threads.
    pub threads: usize,
    /// Per-connection limits.
    pub limits: Limits,
    /// Bytes of request and reply buffers all connections together may hold.
    pub memory_budget: usize,
    /// Connections served at once; more are closed at accept (unless an idle one can
    /// make room). Lowered at start to what the descriptor limit allows.
    pub max_connections: usize,
    /// Connections served at once per client address (TCP) or user (Unix socket).
    pub max_connections_per_address: usize,
    /// A connection idle this long (nothing at the device, no request arrived or ended)
    /// may be closed:
    /// when its slot is needed, or at once with `idle_close`. `None`: never.
    pub idle_timeout: Option<Duration>,
    /// Close connections as soon as they are idle for `idle_timeout`, rather than only
    /// when their slot is needed.
    pub idle_close: bool,
    /// At a connection limit, a quiet connection (nothing of it at the device, no request
    /// partly received, no reply waiting to be read) idle this long gives up its slot to
    /// the new one (see [`crate::server::admit::victim`]), even before `idle_timeout`; one in the
    /// middle of a request or reply waits for `idle_timeout`. `None`: only connections
    /// idle for `idle_timeout` do.
    pub evict_idle_after: Option<Duration>,
    /// Options one handshake may send.
    pub max_options: u32,
    /// Longest a handshake may take.
    pub handshake_timeout: Duration,
    /// TLS offered or required.
    pub tls: TlsMode,
    /// Certificates for STARTTLS (required unless `tls` is off).
    pub tls_config: Option<Arc<rustls::ServerConfig>>,
    /// Engine switches for the reactors.
    pub switches: Switches,
    /// Idle polling of the reactors before they sleep, in nanoseconds (0: off).
    pub idle_poll_ns: u64,
    /// Longest the shutdown after SIGTERM may take (requests in flight finishing, caches
    /// written back); after it the process exits with status 1, saying what it abandons.
    pub shutdown_timeout: Duration,
    /// Run just before such an exit (e.g. to remove other socket files).
    pub on_abandon: Option<Arc<dyn Fn() + Send + Sync>>,
    /// Where connections and error replies are recorded for operators.
    pub observer: Arc<crate::Observer>,
    /// Other frontends served on the same reactors (FUSE mounts); with one, listening
    /// for NBD is optional.
    pub frontends: Vec<Arc<dyn cairn_core::Frontend>>,
}

/// Largest option payload read; bigger ones are skipped (up to `OPTION_SKIP_MAX`) and
/// answered with `NBD_REP_ERR_TOO_BIG`.
const OPTION_DATA_MAX: u32 = 64 << 10;
const OPTION_SKIP_MAX: u32 = 1 << 20;

struct Shared {
    catalog: Catalog,
    tls: TlsMode,
    tls_config: Option<Arc<rustls::ServerConfig>>,
    max_options: u32,
    handshake_timeout: Duration,
    shutting: AtomicBool,
    admission: Arc<Admission>,
    reactors: Vec<(Sender<Msg>, Arc<OwnedFd>)>,
    next: AtomicUsize,
}

enum Listener {
    Tcp(TcpListener),
    Unix {
        listener: UnixListener,
        /// The socket file it made (removed when dropped, after the listener is closed),
        /// unless the service manager passed the socket.
        _file: Option<SocketFile>,
    },
}

impl Listener {
    fn fd(&self) -> RawFd {
        match self {
            Listener::Tcp(l) => l.as_raw_fd(),
            Listener::Unix { listener, .. } => listener.as_raw_fd(),
        }
    }
}

/// The listening sockets of `cairn serve`: bound by [`Listeners::bind`] before any
/// device is opened, so that an address in use refuses the start before a file is
/// created or a superblock written; then served by [`serve`].
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
        .map(|fd| {
            // SAFETY: the service manager passed these descriptors to us.
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
            let mut domain: libc::c_int = 0;
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: reads one int option of a socket we own into `domain`.
            unsafe {
                libc::getsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_DOMAIN,
                    (&mut domain as *mut libc::c_int).cast(),
                    &mut len,
                )
            };
            // SAFETY: the descriptor is ours from here on (systemd's convention).
            if domain == libc::AF_UNIX {
                let l = unsafe { UnixListener::from_raw_fd(fd) };
                let l = Listener::Unix {
                    listener: l,
                    _file: None,
                };
                (l, format!("fd:{fd} (unix)"))
            } else {
                // SAFETY: as above: the descriptor is ours (systemd's convention).
                let l = unsafe { TcpListener::from_raw_fd(fd) };
                (Listener::Tcp(l), format!("fd:{fd} (tcp)"))
            }
        })
        .collect()
}

/// Blocks SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 in this thread (and the threads it
/// starts), and returns a signalfd that reads them.
fn signal_fd() -> Result<OwnedFd, Error> {
    // SAFETY: sigset manipulation on a local, then a mask change for this thread.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGHUP);
        libc::sigaddset(&mut set, libc::SIGUSR1);
        libc::sigaddset(&mut set, libc::SIGUSR2);
        if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return Err(Error::last_os("serve: block signals"));
        }
        let fd = libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK);
        if fd < 0 {
            return Err(Error::last_os("serve: signalfd"));
        }
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// Ends the process with status 1 if the shutdown has not ended `config.shutdown_timeout`
/// from now (a device that never completes a request, say), saying what it abandons: the
/// requests in flight (never acknowledged) and, at most, the acknowledged writes the caches
/// had not written back when last seen.
///
/// Once [`Closing::now`] returns, it never holds a device again: the devices are then
/// closed by whoever drops them last (this thread is never joined, and a device whose last
/// reference it held would be closed here, or not at all when the process exits first:
/// an array would miss its clean superblock).
fn watchdog(config: &Config, exports: &[Export]) -> Closing {
    let devices: Vec<std::sync::Weak<dyn cairn_core::Device>> =
        exports.iter().map(|e| Arc::downgrade(&e.device)).collect();
    let mut open: Vec<String> = Vec::new();
    for e in exports {
        if !open.iter().any(|n| n == e.device.name()) {
            open.push(e.device.name().to_string());
        }
    }
    let (timeout, abandon) = (config.shutdown_timeout, config.on_abandon.clone());
    let closing = Closing(Arc::new(std::sync::Mutex::new(false)));
    let asked = closing.0.clone();
    let _ = std::thread::Builder::new()
        .name("cairn-shutdown".into())
        .spawn(move || {
            let end = Instant::now() + timeout;
            let mut dirty = 0u64;
            while Instant::now() < end {
                {
                    let closing = asked.lock().unwrap_or_else(|p| p.into_inner());
                    if !*closing {
                        let alive: Vec<_> =
                            devices.iter().filter_map(std::sync::Weak::upgrade).collect();
                        dirty = alive.iter().map(|d| d.writeback_counters().0).sum();
                    }
                }
                std::thread::sleep(Duration::from_millis(50).min(timeout));
            }
            let stage = if *asked.lock().unwrap_or_else(|p| p.into_inner()) {
                format!("closing {} did not end", open.join(", "))
            } else {
                format!("requests in flight on {} are abandoned", open.join(", "))
            };
            log::warn!(
                "cairn: serve: shutdown did not end within {timeout:?}: {stage}; up to {dirty} bytes of acknowledged writes the caches had not written back may be lost; exiting with status 1"
            );
            notify(&[sd_notify::NotifyState::Status(&format!(
                "shutdown did not end within {timeout:?}: exiting with status 1"
            ))]);
            if let Some(f) = abandon {
                f();
            }
            std::process::exit(1);
        });
    closing
}

/// Tells the service manager (`NOTIFY_SOCKET`, systemd's Type=notify) how serving goes.
fn notify(states: &[sd_notify::NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(states) {
        log::warn!("cairn: serve: NOTIFY_SOCKET: {e}");
    }
}

/// Logs what SIGUSR1 and SIGUSR2 ask for: connections, and each export's device with its
/// failed members and, for arrays with metadata, their status.
fn log_status(exports: &[Export], connections: usize, budget: &crate::server::pool::Budget) {
    log::info!(
        "cairn: serve: status: {connections} connection(s); buffers {} of {} bytes (--memory-budget), {} waits for memory",
        budget.used(),
        budget.limit(),
        budget.waits()
    );
    let mut seen: Vec<String> = Vec::new();
    for e in exports {
        let d = &e.device;
        let failed = d.failed_members();
        log::warn!(
            "cairn: serve: export '{}': {} ({} bytes){}",
            e.info.name,
            d.name(),
            e.info.size,
            if failed.is_empty() {
                String::new()
            } else {
                format!(", degraded: failed {}", failed.join(", "))
            }
        );
        let mut stack = vec![d.clone()];
        while let Some(d) = stack.pop() {
            if seen.iter().any(|n| n == d.name()) {
                continue;
            }
            seen.push(d.name().to_string());
            if let Some(status) = d.array_status() {
                for line in status.lines() {
                    log::info!("cairn: serve: {line}");
                }
            }
            stack.extend(d.children());
        }
    }
}

/// Serves `exports` on `listeners` until SIGTERM or SIGINT; `ready` gets the addresses
/// once the reactors run.
pub fn serve(
    config: Config,
    listeners: Listeners,
    exports: Vec<Export>,
    ready: impl FnOnce(&[String]),
) -> Result<(), Error> {
    if exports.is_empty() {
        return Err(Error::Invalid("nothing to serve: no exports".into()));
    }
    if config.tls != TlsMode::Off && config.tls_config.is_none() {
        return Err(Error::Invalid("TLS needs --tls-certificates".into()));
    }
    let signals = signal_fd()?;
    let listeners = listeners.bound;
    if listeners.is_empty() && config.frontends.is_empty() {
        return Err(Error::Invalid(
            "no --listen address and no socket activation".into(),
        ));
    }
    for (l, _) in &listeners {
        // SAFETY: sets O_NONBLOCK on our own listening socket.
        unsafe {
            let flags = libc::fcntl(l.fd(), libc::F_GETFL);
            libc::fcntl(l.fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
    }
    let catalog = Catalog {
        exports: exports.iter().map(|e| e.info.clone()).collect(),
    };
    let wake_fds = (0..config.threads.max(1))
        .map(|_| cairn_core::event::eventfd("serve"))
        .collect::<Result<Vec<_>, _>>()?;
    let gates = Arc::new(crate::server::conn::Gates::new(&exports, wake_fds.clone()));
    let mut config = config;
    config.max_connections = fit_descriptors(config.max_connections, config.threads.max(1))?;
    // The reserve: one maximal request, widened to blocks, in its buffer's size class.
    let reserve = (config.limits.max_payload as usize + (2 << 20)).next_power_of_two();
    let budget = Arc::new(crate::server::pool::Budget::new(
        config.memory_budget,
        reserve,
        wake_fds.clone(),
    ));
    config.observer.set_memory(budget.clone());
    let exports = Arc::new(exports);
    let admission = Arc::new(Admission::new(
        config.max_connections,
        config.max_connections_per_address,
    ));
    let mut threads = Vec::new();
    let mut reactors = Vec::new();
    for (i, wake_fd) in wake_fds.into_iter().enumerate() {
        let (tx, rx) = mpsc::channel::<Msg>();
        let gates = gates.clone();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), Error>>();
        let observer = config.observer.clone();
        let frontends = config.frontends.clone();
        let count = config.threads.max(1);
        let (exports, admission, w, switches, limits, idle_poll_ns) = (
            exports.clone(),
            (admission.clone(), budget.clone()),
            wake_fd.clone(),
            config.switches,
            config.limits,
            config.idle_poll_ns,
        );
        let t = std::thread::Builder::new()
            .name(format!("cairn-serve{i}"))
            .spawn(move || {
                let reactor = match Reactor::new(switches) {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let lp = match ServerLoop::start(
                    reactor.core(),
                    exports,
                    rx,
                    (i, w),
                    gates,
                    admission,
                    limits,
                    observer,
                ) {
                    Ok(lp) => lp,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let mut parts = Vec::new();
                for f in &frontends {
                    match f.start(reactor.core(), i, count) {
                        Ok(p) => parts.push(p),
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    }
                }
                reactor.set_idle_poll(idle_poll_ns);
                let _ = ready_tx.send(Ok(()));
                // Until the connections and every frontend's part have ended.
                loop {
                    reactor.run();
                    if lp.ended() && parts.iter().all(|p| p.ended()) {
                        break;
                    }
                }
                reactor.drain(cairn_core::clock::monotonic_ns() + 10_000_000_000);
                drop(lp);
            })
            .map_err(|e| Error::os("serve: start a reactor thread", e))?;
        ready_rx
            .recv()
            .map_err(|_| Error::Invalid("serve: a reactor thread exited".into()))??;
        threads.push(t);
        reactors.push((tx, wake_fd));
    }
    let shared = Arc::new(Shared {
        catalog,
        tls: config.tls,
        tls_config: config.tls_config.clone(),
        max_options: config.max_options,
        handshake_timeout: config.handshake_timeout,
        shutting: AtomicBool::new(false),
        admission: admission.clone(),
        reactors,
        next: AtomicUsize::new(0),
    });
    let shown: Vec<String> = listeners.iter().map(|(_, s)| s.clone()).collect();
    ready(&shown);
    // Type=notify services: started (a no-op without NOTIFY_SOCKET).
    notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(&format!(
            "serving {} export(s) on {}",
            exports.len(),
            shown.join(", ")
        )),
    ]);

    // Accept until a signal arrives.
    let mut fds: Vec<libc::pollfd> = listeners
        .iter()
        .map(|(l, _)| libc::pollfd {
            fd: l.fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    fds.push(libc::pollfd {
        fd: signals.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    });
    let closing;
    // Idle connections are looked for this often: those idle for --idle-timeout with
    // --idle-close, and while connections wait for memory, those that hold some.
    let sweep = config
        .idle_timeout
        .map(|t| (t / 8).clamp(Duration::from_millis(50), Duration::from_secs(1)));
    let mut swept = Instant::now();
    'accept: loop {
        let wait = sweep.map_or(-1, |s| {
            s.saturating_sub(swept.elapsed()).as_millis().max(1) as libc::c_int
        });
        // SAFETY: polls our own descriptors, described by `fds`.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait) };
        if let (Some(s), Some(t)) = (sweep, config.idle_timeout) {
            if swept.elapsed() >= s {
                swept = Instant::now();
                if config.idle_close {
                    close_idle(&config.observer, &shared, t, false);
                } else if budget.short() {
                    close_idle(&config.observer, &shared, t, true);
                }
            }
        }
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::last_os("serve: poll"));
        }
        if fds.last().is_some_and(|p| p.revents != 0) {
            let mut info = [0u8; 128];
            // SAFETY: reads one signalfd_siginfo (128 bytes) into `info`.
            unsafe { libc::read(signals.as_raw_fd(), info.as_mut_ptr().cast(), info.len()) };
            let signo = u32::from_ne_bytes([info[0], info[1], info[2], info[3]]);
            if signo == libc::SIGUSR1 as u32 || signo == libc::SIGUSR2 as u32 {
                // A status report in the log; serving goes on.
                log_status(&exports, admission.live(), &budget);
                continue;
            }
            log::info!(
                "cairn: serve: signal {signo} received: finishing requests in flight, flushing, closing (at most {:?})",
                config.shutdown_timeout
            );
            notify(&[
                sd_notify::NotifyState::Stopping,
                sd_notify::NotifyState::Status(&format!(
                    "stopping (signal {signo}): finishing requests in flight, flushing, closing"
                )),
            ]);
            closing = watchdog(&config, &exports);
            break 'accept;
        }
        for (i, (l, _)) in listeners.iter().enumerate() {
            if fds[i].revents == 0 {
                continue;
            }
            loop {
                let accepted = match l {
                    Listener::Tcp(t) => t.accept().map(|(s, a)| {
                        let client = Client::Ip(a.ip().to_canonical());
                        (OwnedFd::from(s), a.to_string(), client, true)
                    }),
                    Listener::Unix { listener: u, .. } => u.accept().map(|(s, _)| {
                        let client = Client::Uid(peer_uid(s.as_raw_fd()));
                        (OwnedFd::from(s), "unix".to_string(), client, false)
                    }),
                };
                match accepted {
                    Ok((fd, peer, client, tcp)) => {
                        if !admit(&config, &shared, &peer, client) {
                            continue;
                        }
                        let shared = shared.clone();
                        let started = std::thread::Builder::new()
                            .name("cairn-handshake".into())
                            .spawn(move || {
                                if !handshake(fd, (&peer, client), tcp, &shared) {
                                    shared.admission.leave(client);
                                }
                            });
                        if started.is_err() {
                            admission.leave(client);
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        // Out of descriptors and the like: log, keep serving.
                        log::warn!("cairn: serve: accept: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                        break;
                    }
                }
            }
        }
    }
    // Stop accepting, then let every reactor finish its connections.
    drop(listeners);
    shared.shutting.store(true, Ordering::SeqCst);
    for (tx, w) in &shared.reactors {
        let _ = tx.send(Msg::Shutdown);
        cairn_core::event::signal(w.as_raw_fd());
    }
    // Frontends flush and let go of the kernel (FUSE unmounts) meanwhile.
    for f in &config.frontends {
        f.stop();
    }
    for t in threads {
        let _ = t.join();
    }
    // The devices are closed when `exports` is dropped, here, on this thread.
    closing.now();
    Ok(())
}

/// Descriptors kept for the server's own use beyond those open at start: a ring per
/// reactor and the files its device queues open, admin and metrics connections.
const FD_RESERVE: usize = 64;
const FD_RESERVE_PER_REACTOR: usize = 16;

/// `max_connections`, lowered (and logged) to what the descriptor limit allows: a
/// connection holds one descriptor, its socket, from `accept` (handshake included) to
/// its close. Without this, `accept` would fail with EMFILE at the limit instead of a
/// connection being refused or an idle one making room.
fn fit_descriptors(max_connections: usize, reactors: usize) -> Result<usize, Error> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `lim`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0
        || lim.rlim_cur == libc::RLIM_INFINITY
    {
        return Ok(max_connections);
    }
    let soft = lim.rlim_cur as usize;
    // The directory's own descriptor is listed too.
    let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count().saturating_sub(1));
    let reserve = FD_RESERVE + FD_RESERVE_PER_REACTOR * reactors;
    let room = soft.saturating_sub(open + reserve);
    if room >= max_connections {
        return Ok(max_connections);
    }
    if room == 0 {
        return Err(Error::Invalid(format!(
            "serve: the descriptor limit (RLIMIT_NOFILE) of {soft} leaves none for connections: {open} are open and {reserve} are kept for the server; raise it (ulimit -n, LimitNOFILE=)"
        )));
    }
    log::warn!(
        "cairn: serve: --max-connections lowered from {max_connections} to {room}: the descriptor limit (RLIMIT_NOFILE) is {soft}, of which {open} are open and {reserve} kept for the server; raise it (ulimit -n, LimitNOFILE=) to serve more"
    );
    Ok(room)
}

/// Tells the shutdown watchdog that the devices are being closed.
struct Closing(Arc<std::sync::Mutex<bool>>);

impl Closing {
    /// Returns once the watchdog holds no device and never will again.
    fn now(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = true;
    }
}

fn set_nodelay(fd: RawFd) {
    let one: libc::c_int = 1;
    // SAFETY: sets one int option on our own socket.
    unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
}

/// The user id of a Unix socket's peer (`u32::MAX` if the kernel does not say).
fn peer_uid(fd: RawFd) -> u32 {
    // SAFETY: ucred is plain data; all-zero is a valid value.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: reads SO_PEERCRED of our own socket into `cred`, `len` bytes long.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r == 0 {
        cred.uid
    } else {
        u32::MAX
    }
}

/// Whether a new connection from `client` may be served; if so it is counted. At a limit,
/// an idle connection is closed to make room (see [`crate::server::admit::victim`]): a quiet one
/// idle for `--evict-idle-after` (or `--idle-timeout`, if shorter), one in the middle of
/// a request or reply idle for `--idle-timeout`; else the new one is refused.
fn admit(config: &Config, shared: &Shared, peer: &str, client: Client) -> bool {
    let adm = &shared.admission;
    let full = match adm.check(client) {
        Ok(()) => {
            adm.enter(client);
            return true;
        }
        Err(full) => full,
    };
    let (only, limit, flag) = match full {
        Full::Client => (
            Some(client),
            format!(
                "{} connections from {client} already",
                config.max_connections_per_address
            ),
            "--max-connections-per-address",
        ),
        Full::Total => (
            None,
            format!("{} connections already", config.max_connections),
            "--max-connections",
        ),
    };
    let patience = Patience {
        quiet: match (config.evict_idle_after, config.idle_timeout) {
            (Some(e), Some(t)) => Some(e.min(t)),
            (e, t) => e.or(t),
        },
        moving: config.idle_timeout,
    };
    let conns = config.observer.connections();
    let now = cairn_core::clock::monotonic_ns();
    if let Some((victim, idle)) = victim(&conns, now, patience, only) {
        // The rule that let it go: the short one for a quiet connection (unless the idle
        // timeout is shorter still), the idle timeout for one in mid-transfer.
        let need = patience.of(victim).unwrap_or_default();
        let (rule, why) = if Some(need) == config.idle_timeout {
            (
                "--idle-timeout",
                "closed: idle past --idle-timeout, its slot was needed",
            )
        } else {
            (
                "--evict-idle-after",
                "closed: idle for --evict-idle-after, its slot was needed",
            )
        };
        log::info!(
            "cairn: serve: {peer}: {limit} ({flag}): closing {} (idle {:.0} s, over {rule}) to make room",
            victim.peer,
            idle.as_secs_f64()
        );
        evict(shared, victim, need, why);
        adm.enter(client);
        return true;
    }
    log::warn!("cairn: serve: {peer}: refused, {limit} ({flag})");
    false
}

/// Asks the reactor of `victim` to close it (see [`Msg::Evict`]).
fn evict(
    shared: &Shared,
    victim: &crate::server::observe::ConnInfo,
    idle: Duration,
    why: &'static str,
) {
    victim.evicting.store(true, Ordering::Relaxed);
    if let Some((tx, w)) = shared.reactors.get(victim.reactor) {
        let msg = Msg::Evict {
            slot: victim.slot,
            id: victim.id,
            idle,
            why,
        };
        if tx.send(msg).is_ok() {
            cairn_core::event::signal(w.as_raw_fd());
        }
    }
}

/// Closes every connection idle for `timeout`: with `--idle-close`, or (`holding`) those
/// that hold buffer memory while other connections wait for it.
fn close_idle(observer: &crate::Observer, shared: &Shared, timeout: Duration, holding: bool) {
    let now = cairn_core::clock::monotonic_ns();
    for c in observer.connections() {
        if c.evicting.load(Ordering::Relaxed)
            || c.idle_for(now).is_none_or(|d| d < timeout)
            || (holding && c.held() == 0)
        {
            continue;
        }
        let why = if holding {
            log::info!(
                "cairn: serve: {}: closing, idle for {:?} (--idle-timeout) with {} bytes of buffers that other connections wait for (--memory-budget)",
                c.peer,
                timeout,
                c.held()
            );
            "closed: idle past --idle-timeout, holding memory others waited for"
        } else {
            log::info!(
                "cairn: serve: {}: closing, idle for {:?} (--idle-timeout, --idle-close)",
                c.peer,
                timeout
            );
            "closed: idle for --idle-timeout (--idle-close)"
        };
        evict(shared, &c, timeout, why);
    }
}

/// Runs one handshake; on success the connection is on a reactor and counted there.
fn handshake(fd: OwnedFd, (peer, client): (&str, Client), tcp: bool, shared: &Shared) -> bool {
    if tcp {
        set_nodelay(fd.as_raw_fd());
    }
    let ch = Channel::Plain(UnixStream::from(fd));
    let deadline = Instant::now() + shared.handshake_timeout;
    match negotiate(ch, shared, deadline) {
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
                session,
                peer: peer.to_string(),
                client,
                tls,
            };
            if tx.send(Msg::Conn(Box::new(nc))).is_err() {
                return false;
            }
            cairn_core::event::signal(w.as_raw_fd());
            true
        }
        Ok(None) => false,
        Err(e) => {
            if e.kind() != std::io::ErrorKind::UnexpectedEof {
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
    deadline: Instant,
) -> std::io::Result<Option<(Channel, crate::server::handshake::Session)>> {
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
    let mut neg = Negotiator::new(&shared.catalog, shared.tls, client_flags);
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
            let mut left = h.len as usize;
            let mut sink = [0u8; 4096];
            while left > 0 {
                let n = left.min(sink.len());
                s.read_exact(&mut sink[..n], deadline)?;
                left -= n;
            }
            proto::put_option_reply(
                &mut out,
                h.option,
                proto::rep::ERR_TOO_BIG,
                b"option data too large",
            );
            s.write_all(&out, deadline)?;
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
                let Some(config) = shared.tls_config.clone() else {
                    return Ok(None);
                };
                let conn = rustls::ServerConnection::new(config)
                    .map_err(|e| std::io::Error::other(format!("TLS: {e}")))?;
                // The negotiator allows STARTTLS once, on the plain socket.
                let Channel::Plain(sock) = s else {
                    return Ok(None);
                };
                let mut t = rustls::StreamOwned::new(conn, sock);
                // Finish the TLS handshake before the next option.
                t.sock.set_read_timeout(Some(remaining(deadline)?))?;
                t.sock.set_write_timeout(Some(remaining(deadline)?))?;
                while t.conn.is_handshaking() {
                    t.conn.complete_io(&mut t.sock)?;
                }
                s = Channel::Tls(Box::new(t));
                neg.tls_started();
            }
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("more than {} options (--max-options)", shared.max_options),
    ))
}
