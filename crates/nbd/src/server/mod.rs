//! `cairn serve`: listeners, handshakes, reactor threads and orderly shutdown.
//!
//! The main thread accepts connections and watches for SIGTERM/SIGINT (through a
//! signalfd). Each accepted connection gets a short-lived thread for its handshake, so a
//! slow or hostile client never stalls a reactor; once an export is chosen, the socket
//! moves to one of the reactor threads (round robin) and stays there. That is the only
//! hand-off between threads, once per connection.
//!
//! A connection's path, in the order it meets these files: `listen` (accepted),
//! `admit` (a connection slot, or room made by closing an idle one), `negotiate` (its
//! handshake thread) driving [`handshake`] (options, the export chosen), then on a reactor
//! [`conn`]: `recv` (bytes received and framed), `request` (each request checked by
//! [`command::check`](crate::proto::command::check) and issued to the device, or
//! refused), `rmw` and `block_status` for the requests that need more, `reply` (replies
//! and TLS) and `limits` (the memory budget, idle buffers, eviction); with [`pool`]
//! (buffer memory and its budget), `gate` (unaligned writes ordered against others) and
//! [`observe`] (what `status` and the metrics see).

mod admit;
pub mod conn;
mod gate;
pub mod handshake;
mod listen;
mod negotiate;
pub mod observe;
pub mod pool;
pub mod table;

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cairn_core::{Array, Error, Reactor, Switches};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use rustix::event::{PollFd, PollFlags, Timespec};

pub use crate::server::listen::{Listen, Listeners};

use crate::server::admit::{admit, close_idle, Admission};
use crate::server::conn::{Export, Gates, Limits, Msg, ServerLoop};
use crate::server::handshake::TlsMode;
use crate::server::listen::Listener;
use crate::server::negotiate::handshake;
use crate::server::pool::Budget;
use crate::server::table::{ExportTable, Listed};

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
    /// Run when the shutdown begins, before requests in flight are waited for (e.g. to
    /// lift rate limits, so that requests waiting at them finish instead of holding the
    /// stop until its timeout).
    pub on_stop: Option<Arc<dyn Fn() + Send + Sync>>,
    /// Where connections and error replies are recorded for operators.
    pub observer: Arc<crate::Observer>,
    /// Other frontends served on the same reactors (FUSE mounts); with one, listening
    /// for NBD is optional.
    pub frontends: Vec<Arc<dyn cairn_core::Frontend>>,
    /// Serve this one connection (a socket: `cairn serve --stdio`, inetd style) instead
    /// of accepting any, and stop once it has ended.
    pub single: Option<Arc<OwnedFd>>,
    /// The table the exports go in, which an operator may add to while serving.
    pub table: Arc<ExportTable>,
}

struct Shared {
    table: Arc<ExportTable>,
    tls: TlsMode,
    tls_config: Option<Arc<rustls::ServerConfig>>,
    max_options: u32,
    handshake_timeout: Duration,
    shutting: AtomicBool,
    admission: Arc<Admission>,
    reactors: Vec<(Sender<Msg>, Arc<OwnedFd>)>,
    next: AtomicUsize,
}

/// Blocks SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 in this thread (and the threads it
/// starts, reactors included, which are never interrupted), and returns a signalfd that
/// reads them.
fn signal_fd() -> Result<SignalFd, Error> {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    for s in [
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGUSR1,
        Signal::SIGUSR2,
    ] {
        set.add(s);
    }
    let os = |what: &str, e: nix::Error| Error::os(what, std::io::Error::from(e));
    set.thread_block()
        .map_err(|e| os("serve: block signals", e))?;
    SignalFd::with_flags(&set, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(|e| os("serve: signalfd", e))
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
fn watchdog(config: &Config, exports: &[Arc<Listed>]) -> Closing {
    if let Some(f) = &config.on_stop {
        f();
    }
    let devices: Vec<std::sync::Weak<dyn cairn_core::Device>> = exports
        .iter()
        .map(|e| Arc::downgrade(&e.export.device))
        .collect();
    let mut open: Vec<String> = Vec::new();
    for e in exports.iter().map(|l| &l.export) {
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
                        dirty = alive
                            .iter()
                            .map(|d| cairn_core::capability::writeback_totals(d).dirty_bytes)
                            .sum();
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
fn log_status(exports: &[Arc<Listed>], connections: usize, budget: &crate::server::pool::Budget) {
    log::info!(
        "cairn: serve: status: {}; buffers {} of {} (--memory-budget), {} for memory",
        cairn_core::size::plural(connections as u64, "connection", "connections"),
        cairn_core::size::format_bytes(budget.used() as u64),
        cairn_core::size::format_bytes(budget.limit() as u64),
        cairn_core::size::plural(budget.waits(), "wait", "waits")
    );
    let mut seen: Vec<String> = Vec::new();
    for e in exports.iter().map(|l| &l.export) {
        let d = &e.device;
        let failed = cairn_core::array::failed_members(d);
        // A healthy export is news at info; a degraded one is a warning.
        let level = if failed.is_empty() {
            log::Level::Info
        } else {
            log::Level::Warn
        };
        log::log!(
            level,
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
            if let Some(status) = d.capability::<dyn Array>().and_then(|a| a.status()) {
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
    mut config: Config,
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
    // Before any thread starts: they inherit the blocked signals.
    let signals = signal_fd()?;
    let single = config.single.take();
    if single.is_some() && !listeners.is_empty() {
        return Err(Error::Invalid(
            "--stdio serves one connection on standard input: no --listen with it".into(),
        ));
    }
    if listeners.is_empty() && config.frontends.is_empty() && single.is_none() {
        return Err(Error::Invalid(
            "no --listen address and no socket activation".into(),
        ));
    }
    let listeners = listeners.ready()?;
    let wake_fds = (0..config.threads.max(1))
        .map(|_| cairn_core::event::eventfd("serve"))
        .collect::<Result<Vec<_>, _>>()?;
    config.max_connections = fit_descriptors(config.max_connections, config.threads.max(1))?;
    // The reserve: one maximal request, widened to blocks, in its buffer's size class.
    let reserve = (config.limits.max_payload as usize + (2 << 20)).next_power_of_two();
    let budget = Arc::new(Budget::new(config.memory_budget, reserve, wake_fds.clone()));
    config.observer.set_memory(budget.clone());
    let gates = Arc::new(Gates::new(&exports, wake_fds.clone()));
    let count = exports.len();
    let table = config.table.clone();
    table.start(
        exports
            .into_iter()
            .zip(gates.of_export.iter().cloned())
            .collect(),
        (gates.wake.clone(), config.threads.max(1)),
    );
    let admission = Arc::new(Admission::new(
        config.max_connections,
        config.max_connections_per_address,
    ));
    let mut threads = Vec::new();
    let mut reactors = Vec::new();
    for (i, wake) in wake_fds.into_iter().enumerate() {
        let (tx, rx) = mpsc::channel::<Msg>();
        let parts = ReactorParts {
            index: i,
            inbox: rx,
            wake: wake.clone(),
            gates: gates.clone(),
            admission: (admission.clone(), budget.clone()),
        };
        threads.push(start_reactor(&config, parts)?);
        reactors.push((tx, wake));
    }
    let shared = Arc::new(Shared {
        table: table.clone(),
        tls: config.tls,
        tls_config: config.tls_config.clone(),
        max_options: config.max_options,
        handshake_timeout: config.handshake_timeout,
        shutting: AtomicBool::new(false),
        admission,
        reactors,
        next: AtomicUsize::new(0),
    });
    announce(ready, &listeners, count);
    let served = Served {
        config: &config,
        shared: &shared,
        budget: &budget,
    };
    let closing = match single {
        Some(fd) => served.serve_one(fd, &signals)?,
        None => served.accept_until_signal(&listeners, &signals)?,
    };
    stop(listeners, &shared, &config.frontends, threads);
    closing.now();
    // The devices are closed here, on this thread, when the exports leave the table:
    // others may hold the table longer (the operator's view of it, in an admin command
    // still running), and a device closed by them could be cut off by the exit.
    drop(table.close());
    Ok(())
}

/// Tells `ready` and the service manager (Type=notify; a no-op without NOTIFY_SOCKET)
/// where serving has started.
fn announce(ready: impl FnOnce(&[String]), listeners: &[(Listener, String)], exports: usize) {
    let shown: Vec<String> = listeners.iter().map(|(_, s)| s.clone()).collect();
    ready(&shown);
    notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(&format!(
            "serving {exports} export(s) on {}",
            shown.join(", ")
        )),
    ]);
}

/// Stops accepting, then lets every reactor finish its connections, and every frontend
/// flush and let go of the kernel (FUSE unmounts) meanwhile.
fn stop(
    listeners: Vec<(Listener, String)>,
    shared: &Shared,
    frontends: &[Arc<dyn cairn_core::Frontend>],
    threads: Vec<JoinHandle<()>>,
) {
    drop(listeners);
    shared.shutting.store(true, Ordering::SeqCst);
    for (tx, w) in &shared.reactors {
        let _ = tx.send(Msg::Shutdown);
        cairn_core::event::wake(&**w);
    }
    for f in frontends {
        f.stop();
    }
    for t in threads {
        let _ = t.join();
    }
}

/// What one reactor thread serves.
struct ReactorParts {
    index: usize,
    inbox: mpsc::Receiver<Msg>,
    wake: Arc<OwnedFd>,
    gates: Arc<Gates>,
    admission: (Arc<Admission>, Arc<Budget>),
}

/// Starts reactor thread `parts.index` and waits until it serves (or failed to start).
fn start_reactor(config: &Config, parts: ReactorParts) -> Result<JoinHandle<()>, Error> {
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), Error>>();
    let observer = config.observer.clone();
    let frontends = config.frontends.clone();
    let count = config.threads.max(1);
    let (switches, limits, idle_poll_ns) = (config.switches, config.limits, config.idle_poll_ns);
    let t = std::thread::Builder::new()
        .name(format!("cairn-serve{}", parts.index))
        .spawn(move || {
            let i = parts.index;
            let started = Reactor::new(switches).and_then(|reactor| {
                let lp = ServerLoop::start(
                    reactor.core(),
                    parts.inbox,
                    (i, parts.wake),
                    parts.gates,
                    parts.admission,
                    limits,
                    observer,
                )?;
                let ends = frontends
                    .iter()
                    .map(|f| f.start(reactor.core(), i, count))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok((reactor, lp, ends))
            });
            let (reactor, lp, ends) = match started {
                Ok(r) => r,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            reactor.set_idle_poll(idle_poll_ns);
            let _ = ready_tx.send(Ok(()));
            // Until the connections and every frontend's part have ended.
            loop {
                reactor.run();
                if lp.ended() && ends.iter().all(|p| p.ended()) {
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
    Ok(t)
}

/// What the accepting thread works with once the reactors run.
struct Served<'a> {
    config: &'a Config,
    shared: &'a Arc<Shared>,
    budget: &'a Budget,
}

impl Served<'_> {
    /// Accepts connections until SIGTERM, SIGINT or SIGHUP; logs a status on SIGUSR1 or
    /// SIGUSR2. Returns the shutdown's watchdog.
    fn accept_until_signal(
        &self,
        listeners: &[(Listener, String)],
        signals: &SignalFd,
    ) -> Result<Closing, Error> {
        let config = self.config;
        let mut fds: Vec<PollFd<'_>> = listeners
            .iter()
            .map(|(l, _)| PollFd::new(l, PollFlags::IN))
            .collect();
        fds.push(PollFd::new(signals, PollFlags::IN));
        // Idle connections are looked for this often: those idle for --idle-timeout with
        // --idle-close, and while connections wait for memory, those that hold some.
        let sweep = config
            .idle_timeout
            .map(|t| (t / 8).clamp(Duration::from_millis(50), Duration::from_secs(1)));
        let mut swept = Instant::now();
        loop {
            let wait = sweep.map(|s| {
                let left = s
                    .saturating_sub(swept.elapsed())
                    .max(Duration::from_millis(1));
                Timespec::try_from(left).unwrap_or(Timespec {
                    tv_sec: 1,
                    tv_nsec: 0,
                })
            });
            let polled = rustix::event::poll(&mut fds, wait.as_ref());
            if let (Some(s), Some(t)) = (sweep, config.idle_timeout) {
                if swept.elapsed() >= s {
                    swept = Instant::now();
                    if config.idle_close {
                        close_idle(&config.observer, self.shared, t, false);
                    } else if self.budget.short() {
                        close_idle(&config.observer, self.shared, t, true);
                    }
                }
            }
            match polled {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(Error::os("serve: poll", e.into())),
            }
            if fds.last().is_some_and(|p| !p.revents().is_empty()) {
                if let Some(closing) = self.signalled(signals) {
                    return Ok(closing);
                }
                continue;
            }
            for (i, (l, _)) in listeners.iter().enumerate() {
                if !fds[i].revents().is_empty() {
                    self.accept_all(l);
                }
            }
        }
    }

    /// Serves the one connection `fd` (its handshake on a thread, as for an accepted
    /// one), until it has ended or a signal stops the server. Returns the shutdown's
    /// watchdog.
    fn serve_one(&self, fd: Arc<OwnedFd>, signals: &SignalFd) -> Result<Closing, Error> {
        // The one descriptor of it (a clone of the settings may hold another).
        let fd = Arc::try_unwrap(fd)
            .or_else(|shared| rustix::io::dup(&*shared))
            .map_err(|e| Error::os("serve: standard input", e.into()))?;
        let (peer, client) = (
            "stdio".to_string(),
            crate::server::observe::Client::Uid(u32::MAX),
        );
        self.shared.admission.enter(client);
        let shared = self.shared.clone();
        std::thread::Builder::new()
            .name("cairn-handshake".into())
            .spawn(move || {
                if !handshake(fd, (&peer, client), &shared) {
                    shared.admission.leave(client);
                }
            })
            .map_err(|e| Error::os("serve: start the handshake thread", e))?;
        loop {
            let mut fds = [PollFd::new(signals, PollFlags::IN)];
            let tick = Timespec {
                tv_sec: 0,
                tv_nsec: 50_000_000,
            };
            match rustix::event::poll(&mut fds, Some(&tick)) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(Error::os("serve: poll", e.into())),
            }
            if !fds[0].revents().is_empty() {
                if let Some(closing) = self.signalled(signals) {
                    return Ok(closing);
                }
            }
            if self.shared.admission.live() == 0 {
                log::info!("cairn: serve: the connection on standard input ended: stopping");
                return Ok(watchdog(self.config, &self.shared.table.snapshot()));
            }
        }
    }

    /// A signal arrived: a status report in the log (SIGUSR1, SIGUSR2; serving goes on),
    /// or the shutdown begins (its watchdog returned).
    fn signalled(&self, signals: &SignalFd) -> Option<Closing> {
        let signo = match signals.read_signal() {
            Ok(Some(info)) => info.ssi_signo as i32,
            _ => return None,
        };
        if signo == libc::SIGUSR1 || signo == libc::SIGUSR2 {
            log_status(
                &self.shared.table.snapshot(),
                self.shared.admission.live(),
                self.budget,
            );
            return None;
        }
        let name = signal_name(signo);
        log::info!(
            "cairn: serve: {name} received: finishing requests in flight, flushing, closing (at most {})",
            cairn_core::size::format_duration(self.config.shutdown_timeout)
        );
        notify(&[
            sd_notify::NotifyState::Stopping,
            sd_notify::NotifyState::Status(&format!(
                "stopping ({name}): finishing requests in flight, flushing, closing"
            )),
        ]);
        Some(watchdog(self.config, &self.shared.table.snapshot()))
    }

    /// Accepts every connection waiting on `listener`; each admitted one gets a thread
    /// for its handshake.
    fn accept_all(&self, listener: &Listener) {
        loop {
            match listener.accept() {
                Ok((fd, peer, client)) => {
                    if !admit(self.config, self.shared, &peer, client) {
                        continue;
                    }
                    let shared = self.shared.clone();
                    let started = std::thread::Builder::new()
                        .name("cairn-handshake".into())
                        .spawn(move || {
                            if !handshake(fd, (&peer, client), &shared) {
                                shared.admission.leave(client);
                            }
                        });
                    if started.is_err() {
                        self.shared.admission.leave(client);
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

/// Descriptors kept for the server's own use beyond those open at start: a ring per
/// reactor and the files its device queues open, admin and metrics connections.
const FD_RESERVE: usize = 64;
const FD_RESERVE_PER_REACTOR: usize = 16;

/// `max_connections`, lowered (and logged) to what the descriptor limit allows: a
/// connection holds one descriptor, its socket, from `accept` (handshake included) to
/// its close. Without this, `accept` would fail with EMFILE at the limit instead of a
/// connection being refused or an idle one making room.
fn fit_descriptors(max_connections: usize, reactors: usize) -> Result<usize, Error> {
    let Some(soft) = rustix::process::getrlimit(rustix::process::Resource::Nofile).current else {
        // Unlimited.
        return Ok(max_connections);
    };
    let soft = usize::try_from(soft).unwrap_or(usize::MAX);
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

/// A signal's name, as `kill -l` prints it with the SIG prefix (`SIGTERM`), or its number.
pub fn signal_name(signo: i32) -> String {
    nix::sys::signal::Signal::try_from(signo)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("signal {signo}"))
}
