//! The `cairn` binary: parses the command line, builds devices, runs the job.
//!
//! Parsing happens in two steps, as ripgrep does it: clap turns arguments into raw flags,
//! then [`settings`] validates them into the typed values the libraries take. Every
//! mistake ends in one line on stderr and exit status 2; a failed I/O or verification
//! during a run ends in exit status 1.

mod admin;
mod metrics;
mod settings;
mod stackfile;
mod stat;
mod view;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;

use cairn_devices::config::Tuning;

use settings::{Cli, Command, DeviceChoice, OutputFormat};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return settings::clap_exit(e),
    };
    init_logs(cli.global.log_level.filter());
    let code = match run(cli) {
        Ok(code) => code,
        Err(message) => {
            eprintln!("cairn: {message}");
            ExitCode::from(2)
        }
    };
    // Every device is closed by now: acknowledged writes that a cache could not write
    // back are lost, and the exit status says so.
    let lost = cairn_devices::cache::unwritten_at_close();
    if lost > 0 {
        log::error!(
            "cairn: {lost} cached pages ({} bytes) of acknowledged writes could not be written back and are lost",
            lost * cairn_devices::cache::PAGE
        );
        return ExitCode::from(1);
    }
    code
}

/// Events go to stderr one line each: an RFC 3339 time (UTC, milliseconds), the level,
/// the message. Errors in the command line or the stack file are not events: they stay
/// one plain line.
fn init_logs(level: log::LevelFilter) {
    use std::io::Write;
    env_logger::Builder::new()
        .filter_level(level)
        .target(env_logger::Target::Stderr)
        .format(|buf, r| {
            writeln!(
                buf,
                "{} {:<5} {}",
                buf.timestamp_millis(),
                r.level(),
                r.args()
            )
        })
        .init();
}

/// Writes to stdout; a reader that went away (`| head`) is not an error, and nothing is
/// printed after it (cairn keeps SIGPIPE ignored, so that devices are still closed in
/// order, caches written back, and so on).
fn out(text: &str) {
    use std::io::Write;
    thread_local! {
        static GONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if GONE.with(|g| g.get()) {
        return;
    }
    let mut o = std::io::stdout().lock();
    if let Err(e) = o.write_all(text.as_bytes()).and_then(|_| o.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            GONE.with(|g| g.set(true));
        } else {
            eprintln!("cairn: cannot write to stdout: {e}");
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode, String> {
    match cli.command {
        Command::Bench(args) => {
            let (spec, choice, format) = args.settings()?;
            let stack_path = match &choice {
                DeviceChoice::Stack { path, .. } => Some(path.clone()),
                _ => None,
            };
            let (devices, switches) = match choice {
                DeviceChoice::Leaf(leaf) => (
                    Devices::Leaf(leaf),
                    cli.global.switches(&Tuning::default())?,
                ),
                DeviceChoice::Stack { path, name } => {
                    let stack = settings::read_stack(&path)?;
                    let switches = cli.global.switches(&stack.tuning)?;
                    let name = stack.pick(name.as_deref()).map_err(|e| e.to_string())?;
                    let names = vec![name];
                    (Devices::Stack { stack, path, names }, switches)
                }
            };
            // Everything that can refuse the run is checked before anything is created
            // or written: the device opened as `cairn check` opens it, then the admin
            // and metrics sockets bound; only then is the device opened for real.
            devices.preflight(switches)?;
            let admin = args.admin.as_deref().map(admin::bind).transpose()?;
            let metrics = args.metrics.as_deref().map(metrics::bind).transpose()?;
            let device = devices
                .open(switches)?
                .pop()
                .ok_or("bench: no device opened")?;
            let progress = std::io::stderr().is_terminal() && format == OutputFormat::Normal;
            // SIGINT and SIGTERM end the job early, with its report (as fio's Ctrl-C).
            interrupt_ends_bench();
            let view = std::sync::Arc::new(
                view::View::new(std::slice::from_ref(&device), Vec::new(), None)
                    .with_stack_file(stack_path.as_deref()),
            );
            let admin = match admin {
                Some(bound) => Some(admin::start(bound, view.clone())?),
                None => None,
            };
            let stack_file = keep_stack_file(&view)?;
            let view_for_sync = view.clone();
            let metrics = match metrics {
                Some(bound) => {
                    let m = metrics::start(bound, view)?;
                    log::info!("cairn: bench: metrics at {}", m.url);
                    Some(m)
                }
                None => None,
            };
            let held = stack_file.as_ref().map(|_| device.clone());
            let report = cairn_bench::run(&spec, device, switches, progress);
            drop(stack_file);
            // A change of members that ended since the last look reaches the stack file
            // before the device closes.
            view_for_sync.sync_stack_file();
            drop(held);
            drop(admin);
            drop(metrics);
            let report = report?;
            match format {
                OutputFormat::Normal => out(&report.to_text()),
                OutputFormat::Json => {
                    let text = serde_json::to_string_pretty(&report.to_json())
                        .map_err(|e| format!("cannot write JSON: {e}"))?;
                    out(&format!("{text}\n"));
                }
            }
            if let Some(f) = &report.failure {
                eprintln!("cairn: {f}");
            } else if report.dirs.iter().all(|d| d.ios == 0) {
                eprintln!(
                    "cairn: warning: nothing was measured (the job finished during --ramp_time; raise --io_size or use --time_based)"
                );
            }
            Ok(ExitCode::from(report.exit_code() as u8))
        }
        Command::Serve(args) => serve(&cli.global, &args),
        Command::Admin(args) => {
            admin::client(&args.socket, &args.command)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Stat(args) => {
            stat::run(&args.socket, args.interval.as_deref(), args.count)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Check(args) => {
            let stack = settings::read_stack(&args.stack)?;
            let switches = cli.global.switches(&stack.tuning)?;
            let report = stack
                .check(args.device.as_deref(), switches)
                .map_err(|e| format!("{}: {e}", args.stack.display()))?;
            out(&report);
            out(&format!(
                "switches: clock={:?} reap={:?} stats={:?} flush={:?} dispatch={:?} writeback={:?}\n",
                switches.clock,
                switches.reap,
                switches.stats,
                switches.flush,
                switches.dispatch,
                switches.writeback
            ));
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Takes SIGINT and SIGTERM (signal-hook's handler, which only wakes its iterator) and
/// waits for them on a thread of its own, which ends the bench's jobs when one comes.
fn interrupt_ends_bench() {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM]) else {
        return;
    };
    let _ = std::thread::Builder::new()
        .name("cairn-signals".into())
        .spawn(move || {
            for _ in signals.forever() {
                if cairn_bench::INTERRUPTED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    // A second one: give up at once.
                    std::process::exit(130);
                }
                log::warn!("cairn: interrupted: ending the job (again to quit at once)");
            }
        });
}

/// The devices a run opens: a leaf given on the command line (`--device SPEC`), or
/// devices of a stack file. Each is opened twice: first as `cairn check` opens it
/// ([`Devices::preflight`]: nothing is created or written), so that every refusal comes
/// before any change, then for real.
enum Devices {
    Leaf(cairn_devices::LeafSpec),
    Stack {
        stack: cairn_devices::config::StackFile,
        /// The stack file, for error lines.
        path: std::path::PathBuf,
        /// Devices of the file, each once.
        names: Vec<String>,
    },
}

impl Devices {
    /// Whatever would refuse [`Devices::open`], found without changing anything.
    fn preflight(&self, switches: cairn_core::Switches) -> Result<(), String> {
        match self {
            Devices::Leaf(leaf) => {
                cairn_devices::config::preflight_leaf(leaf, &leaf.default_name())
                    .map_err(|e| e.to_string())
            }
            Devices::Stack { stack, path, names } => stack
                .preflight(names, switches)
                .map_err(|e| format!("{}: {e}", path.display())),
        }
    }

    /// Opens them for real (files created or extended, arrays started), in order.
    fn open(
        &self,
        switches: cairn_core::Switches,
    ) -> Result<Vec<std::sync::Arc<dyn cairn_core::Device>>, String> {
        match self {
            Devices::Leaf(leaf) => Ok(vec![
                cairn_devices::open(leaf, &leaf.default_name()).map_err(|e| e.to_string())?
            ]),
            Devices::Stack { stack, path, names } => names
                .iter()
                .map(|name| {
                    stack
                        .open_with(name, switches)
                        .map_err(|e| format!("{}: {e}", path.display()))
                })
                .collect(),
        }
    }
}

/// An export `serve` was asked for.
struct Chosen {
    name: String,
    /// Its device: an index into the devices opened (see [`Devices`]).
    device: usize,
    read_only: bool,
    description: String,
    /// Chosen by the empty name.
    default: bool,
    /// Also mounted here (FUSE).
    fuse: Option<std::path::PathBuf>,
    /// Unaligned requests refused even from clients that did not ask for block sizes.
    strict_alignment: bool,
}

/// The exports asked for (`--device`, or the stack file's `[export.NAME]` tables) and the
/// devices they serve, each device once, none opened yet.
fn chosen_exports(
    args: &settings::ServeArgs,
    global: &settings::GlobalArgs,
) -> Result<(Vec<Chosen>, Devices, cairn_core::Switches), String> {
    let Some(path) = &args.stack else {
        let text = args
            .device
            .as_deref()
            .unwrap_or(settings::DEFAULT_SERVE_DEVICE);
        let leaf = cairn_devices::LeafSpec::parse(text).map_err(|e| format!("--device {e}"))?;
        let chosen = Chosen {
            name: String::new(),
            device: 0,
            read_only: args.read_only,
            description: text.to_string(),
            default: true,
            fuse: None,
            strict_alignment: args.strict_alignment,
        };
        let switches = global.switches(&Tuning::default())?;
        return Ok((vec![chosen], Devices::Leaf(leaf), switches));
    };
    let stack = settings::read_stack(path)?;
    let switches = global.switches(&stack.tuning)?;
    let mut names: Vec<String> = Vec::new();
    let chosen = if args.device.is_some() || stack.exports.is_empty() {
        let name = stack
            .pick(args.device.as_deref())
            .map_err(|e| format!("{}: {e}", path.display()))?;
        names.push(name.clone());
        vec![Chosen {
            name: String::new(),
            device: 0,
            read_only: args.read_only,
            description: name,
            default: true,
            fuse: None,
            strict_alignment: args.strict_alignment,
        }]
    } else {
        if args.read_only {
            return Err(
                "--read-only applies to --device; set read_only in the [export.NAME] tables".into(),
            );
        }
        if args.strict_alignment {
            return Err(
                "--strict-alignment applies to --device; set strict_alignment in the [export.NAME] tables"
                    .into(),
            );
        }
        let mut v = Vec::new();
        for (name, e) in &stack.exports {
            // Devices shared by several exports are opened once.
            let device = match names.iter().position(|n| *n == e.device) {
                Some(i) => i,
                None => {
                    names.push(e.device.clone());
                    names.len() - 1
                }
            };
            let description = if e.description.is_empty() {
                e.device.clone()
            } else {
                e.description.clone()
            };
            v.push(Chosen {
                name: name.clone(),
                device,
                read_only: e.read_only,
                description,
                default: e.default,
                fuse: e.fuse.clone(),
                strict_alignment: e.strict_alignment,
            });
        }
        v
    };
    let devices = Devices::Stack {
        stack,
        path: path.clone(),
        names,
    };
    Ok((chosen, devices, switches))
}

/// The FUSE files asked for (`--fuse PATH[:EXPORT]`, `fuse = "PATH"` in an export's
/// table), each with the index of its export in `chosen`.
fn fuse_wanted(
    args: &settings::ServeArgs,
    chosen: &[Chosen],
) -> Result<Vec<(std::path::PathBuf, usize)>, String> {
    if !(1..=1024).contains(&args.fuse_depth) {
        return Err(format!("--fuse-depth {}: from 1 to 1024", args.fuse_depth));
    }
    let mut wanted: Vec<(std::path::PathBuf, usize)> = Vec::new();
    for (i, c) in chosen.iter().enumerate() {
        if let Some(p) = &c.fuse {
            wanted.push((p.clone(), i));
        }
    }
    for text in &args.fuse {
        // PATH:EXPORT when the text after the last ':' names an export, else PATH.
        let (path, index) = match text.rsplit_once(':') {
            Some((p, name)) if !p.is_empty() => match chosen.iter().position(|c| c.name == name) {
                Some(i) => (p, i),
                None if chosen.len() > 1 || !chosen.iter().any(|c| c.name.is_empty()) => {
                    return Err(format!(
                        "--fuse {text}: no export named '{name}' (exports: {})",
                        chosen
                            .iter()
                            .map(|c| format!("'{}'", c.name))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                }
                None => (text.as_str(), 0),
            },
            _ => match chosen.iter().position(|c| c.name.is_empty() || c.default) {
                Some(i) => (text.as_str(), i),
                None => {
                    return Err(format!(
                        "--fuse {text}: name the export (PATH:EXPORT); none is the default"
                    ))
                }
            },
        };
        if path.is_empty() {
            return Err(format!("--fuse {text}: expected PATH[:EXPORT]"));
        }
        wanted.push((std::path::PathBuf::from(path), index));
    }
    let mut seen = std::collections::HashSet::new();
    for (p, _) in &wanted {
        let abs = std::path::absolute(p).map_err(|e| format!("--fuse {}: {e}", p.display()))?;
        if !seen.insert(abs.clone()) {
            return Err(format!(
                "fuse {}: named twice; each export needs a file of its own",
                abs.display()
            ));
        }
    }
    Ok(wanted)
}

/// Mounts the FUSE files `wanted` (see [`fuse_wanted`]) of the exports `chosen`, whose
/// devices are `devices`.
fn mount_fuse(
    args: &settings::ServeArgs,
    wanted: Vec<(std::path::PathBuf, usize)>,
    chosen: &[Chosen],
    devices: &[std::sync::Arc<dyn cairn_core::Device>],
) -> Result<Vec<std::sync::Arc<cairn_fuse::FuseExport>>, String> {
    let transport = match args.fuse_io_uring {
        settings::FuseUringArg::Auto => cairn_fuse::Transport::Auto,
        settings::FuseUringArg::Off => cairn_fuse::Transport::DevFuse,
    };
    if !wanted.is_empty()
        && transport == cairn_fuse::Transport::Auto
        && !cairn_fuse::uring_enabled()
    {
        log::info!(
            "cairn: serve: FUSE over io_uring is off in this kernel (echo Y > /sys/module/fuse/parameters/enable_uring to allow it): FUSE requests are read from /dev/fuse"
        );
    }
    let mut out = Vec::new();
    for (path, i) in wanted {
        let c = &chosen[i];
        let export = cairn_fuse::FuseExport::mount(cairn_fuse::FuseConfig {
            path,
            name: c.name.clone(),
            device: devices[c.device].clone(),
            read_only: c.read_only,
            transport,
            depth: args.fuse_depth,
        })
        .map_err(|e| e.to_string())?;
        log::info!("cairn: serve: {}", cairn_core::Frontend::describe(&export));
        out.push(std::sync::Arc::new(export));
    }
    Ok(out)
}

/// Members changed without a command (a replace ending, a spare taking a member's place)
/// reach the view's stack file within a second, while the returned thread runs.
fn keep_stack_file(view: &std::sync::Arc<view::View>) -> Result<Option<stackfile::Watch>, String> {
    if view.stack_file().is_none() {
        return Ok(None);
    }
    let weak = std::sync::Arc::downgrade(view);
    stackfile::watch(move || weak.upgrade().map(|v| v.sync_stack_file()).is_some())
        .map(Some)
        .map_err(|e| format!("cannot start the stack file's thread: {e}"))
}

/// Raises the soft limit on open descriptors (RLIMIT_NOFILE) to the hard limit: every
/// connection holds one, and soft limits are often 1,024. `cairn serve` then lowers
/// --max-connections to what the limit allows (saying so in the log).
fn raise_descriptor_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let lim = getrlimit(Resource::Nofile);
    // `None` is RLIM_INFINITY.
    let before = lim.current.unwrap_or(u64::MAX);
    // The kernel refuses more than fs.nr_open, which an unlimited hard limit stands for.
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|n| n.trim().parse::<u64>().ok())
        .unwrap_or(1 << 20);
    let want = lim.maximum.unwrap_or(u64::MAX).min(nr_open);
    if before >= want {
        return;
    }
    let raised = Rlimit {
        current: Some(want),
        ..lim
    };
    if setrlimit(Resource::Nofile, raised).is_ok() {
        log::info!("cairn: serve: descriptor limit (RLIMIT_NOFILE) raised from {before} to {want}");
    }
}

/// `cairn serve`: checks everything that can refuse the start (arguments, the devices as
/// `cairn check` opens them, every address bound) before anything is created or written,
/// then opens the devices and serves until SIGTERM or SIGINT.
fn serve(global: &settings::GlobalArgs, args: &settings::ServeArgs) -> Result<ExitCode, String> {
    use cairn_nbd::proto::tflags;
    use std::sync::Arc;

    // The arguments and the stack file.
    let limits = args.limits()?;
    let (chosen, devices, switches) = chosen_exports(args, global)?;
    let tls = match (args.tls, &args.tls_certificates) {
        (Some(settings::TlsArg::Off), _) => cairn_nbd::TlsMode::Off,
        (None, None) => cairn_nbd::TlsMode::Off,
        (Some(settings::TlsArg::On), None) | (Some(settings::TlsArg::Require), None) => {
            return Err("--tls on|require needs --tls-certificates DIR".into())
        }
        (Some(settings::TlsArg::Require), Some(_)) => cairn_nbd::TlsMode::Required,
        (_, Some(_)) => cairn_nbd::TlsMode::Optional,
    };
    if args.tls_verify_peer && tls == cairn_nbd::TlsMode::Off {
        return Err("--tls-verify-peer needs --tls-certificates DIR".into());
    }
    let tls_config = match (&args.tls_certificates, tls) {
        (Some(dir), t) if t != cairn_nbd::TlsMode::Off => {
            Some(cairn_nbd::tls::load(dir, args.tls_verify_peer).map_err(|e| e.to_string())?)
        }
        _ => None,
    };
    let fuse = fuse_wanted(args, &chosen)?;
    let mut listen = args
        .listen
        .iter()
        .map(|l| cairn_nbd::Listen::parse(l))
        .collect::<Result<Vec<_>, _>>()?;
    if listen.is_empty() && std::env::var_os("LISTEN_FDS").is_none() && fuse.is_empty() {
        listen.push(cairn_nbd::Listen::parse(settings::DEFAULT_LISTEN)?);
    }

    // The devices, opened without changing anything: a foreign array member, a file in
    // use or a path that cannot be created refuses the start here.
    devices.preflight(switches)?;

    // Every address, bound: one in use refuses the start here. A stale socket is
    // replaced; a live one, or anything else at a socket's path, is refused.
    let listeners = cairn_nbd::Listeners::bind(&listen).map_err(|e| e.to_string())?;
    if listeners.is_empty() && fuse.is_empty() {
        return Err("no --listen address and no socket activation".into());
    }
    let admin = args.admin.as_deref().map(admin::bind).transpose()?;
    let metrics = args.metrics.as_deref().map(metrics::bind).transpose()?;

    // Only now is anything created or written: files `size=` creates or extends, array
    // superblocks, FUSE mounts.
    let opened = devices.open(switches)?;
    let fuse = mount_fuse(args, fuse, &chosen, &opened)?;
    let exports: Vec<cairn_nbd::Export> = chosen
        .into_iter()
        .map(|c| {
            let Chosen {
                name,
                device,
                read_only,
                description,
                default,
                strict_alignment,
                ..
            } = c;
            let device = opened[device].clone();
            let g = device.geometry();
            let mut flags = tflags::HAS_FLAGS | tflags::SEND_FLUSH | tflags::SEND_CACHE;
            if read_only {
                flags |= tflags::READ_ONLY;
            } else {
                if g.caps.fua {
                    flags |= tflags::SEND_FUA;
                }
                if g.caps.discard {
                    flags |= tflags::SEND_TRIM;
                }
                if g.caps.write_zeroes {
                    flags |= tflags::SEND_WRITE_ZEROES | tflags::SEND_FAST_ZERO;
                }
            }
            if read_only || device.coherent_across_queues() {
                flags |= tflags::CAN_MULTI_CONN;
            }
            let preferred = g.block_bytes.max(4096);
            cairn_nbd::Export {
                info: cairn_nbd::ExportInfo {
                    name,
                    description,
                    size: g.size_bytes,
                    flags,
                    min_block: g.block_bytes,
                    preferred_block: preferred,
                    max_payload: limits.max_payload.max(preferred),
                    default,
                },
                device,
                strict_alignment,
            }
        })
        .collect();
    drop(opened);
    let fuse_views: Vec<(String, std::sync::Weak<cairn_fuse::FuseExport>)> = fuse
        .iter()
        .map(|f| (f.export_name().to_string(), Arc::downgrade(f)))
        .collect();
    let observer = Arc::new(cairn_nbd::Observer::default());
    // Socket files go too when a stuck shutdown is abandoned (the process exits at once).
    let removers: Vec<cairn_core::socket::Remover> = admin
        .iter()
        .map(admin::Bound::file)
        .chain(metrics.iter().filter_map(metrics::Bound::file))
        .map(cairn_core::socket::SocketFile::remover)
        .collect();
    let config = cairn_nbd::Config {
        observer: observer.clone(),
        threads: limits.threads,
        limits: cairn_nbd::Limits {
            max_payload: limits.max_payload,
            buffer_bytes: limits.buffer_bytes,
        },
        memory_budget: limits.memory_budget,
        frontends: fuse
            .into_iter()
            .map(|f| f as Arc<dyn cairn_core::Frontend>)
            .collect(),
        max_connections: args.max_connections,
        max_connections_per_address: args.max_connections_per_address,
        idle_timeout: limits.idle_timeout,
        idle_close: args.idle_close,
        evict_idle_after: limits.evict_idle_after,
        max_options: args.max_options,
        handshake_timeout: limits.handshake_timeout,
        tls,
        tls_config,
        switches,
        idle_poll_ns: limits.idle_poll_ns,
        shutdown_timeout: limits.shutdown_timeout,
        on_abandon: (!removers.is_empty()).then(|| {
            Arc::new(move || {
                for r in &removers {
                    r.remove();
                }
            }) as Arc<dyn Fn() + Send + Sync>
        }),
    };
    let summary: Vec<String> = exports
        .iter()
        .map(|e| {
            format!(
                "'{}' ({}, {} bytes{})",
                e.info.name,
                e.info.description,
                e.info.size,
                if e.info.flags & tflags::READ_ONLY != 0 {
                    ", read-only"
                } else {
                    ""
                }
            )
        })
        .collect();
    let devices: Vec<Arc<dyn cairn_core::Device>> =
        exports.iter().map(|e| e.device.clone()).collect();
    let view = Arc::new(
        view::View::new(
            &devices,
            exports
                .iter()
                .map(|e| view::ExportView {
                    name: e.info.name.clone(),
                    device: e.device.name().to_string(),
                    read_only: e.info.flags & tflags::READ_ONLY != 0,
                    fuse: fuse_views
                        .iter()
                        .filter(|(name, _)| *name == e.info.name)
                        .map(|(_, f)| f.clone())
                        .collect(),
                })
                .collect(),
            Some(observer.clone()),
        )
        .with_stack_file(args.stack.as_deref()),
    );
    // Held until serving ends only if a stack file is kept: its last sync needs them.
    let devices = if view.stack_file().is_some() {
        devices
    } else {
        Vec::new()
    };
    let _stack_file = keep_stack_file(&view)?;
    let _admin = match admin {
        Some(bound) => Some(admin::start(bound, view.clone())?),
        None => None,
    };
    let _metrics = match metrics {
        Some(bound) => {
            let m = metrics::start(bound, view.clone())?;
            log::info!("cairn: serve: metrics at {}", m.url);
            Some(m)
        }
        None => None,
    };
    raise_descriptor_limit();
    cairn_nbd::serve(config, listeners, exports, |addrs| {
        log::info!(
            "cairn: serving {} on {}",
            summary.join(", "),
            if addrs.is_empty() {
                "no NBD address (FUSE only)".to_string()
            } else {
                addrs.join(", ")
            }
        );
    })
    .map_err(|e| e.to_string())?;
    // A change of members that ended since the last look reaches the file before the
    // devices close.
    view.sync_stack_file();
    drop(devices);
    Ok(ExitCode::SUCCESS)
}
