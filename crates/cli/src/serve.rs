//! `cairn serve`: the exports asked for, every check that can refuse the start made
//! before anything is created or written, then the devices opened, FUSE mounted, the
//! operator's view (admin socket, metrics, the stack file kept in step) and the NBD
//! server run until SIGTERM.

use std::process::ExitCode;
use std::sync::Arc;

use cairn_nbd::proto::tflags;
use cairn_nbd::TlsMode;

use cairn_config::Tuning;

use crate::{admin, metrics, settings, stackfile, view, Devices};

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
        let leaf = cairn_leaves::LeafSpec::parse(text).map_err(|e| format!("--device: {e}"))?;
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
                // --read-only makes every export read-only; it never makes one writable.
                read_only: e.read_only || args.read_only,
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
    devices: &Devices,
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
        refuse_hiding_data(p, devices)?;
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

/// A FUSE file mounted over a regular file that holds data hides it: reads and writes go
/// to the export's device, and the file's bytes are out of sight until the unmount (a
/// user who meant to serve the file would lose every write). Refused, before anything
/// is opened, unless that file is one the served devices use (mounting an image over
/// itself, as qemu-storage-daemon's FUSE export allows: cairn keeps it open).
fn refuse_hiding_data(path: &std::path::Path, devices: &Devices) -> Result<(), String> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(()); // missing (created), or a stale mount: the mount step says
    };
    if !meta.is_file() || meta.len() == 0 {
        return Ok(());
    }
    let same = |other: &std::path::Path| {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(other).is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino())
    };
    if devices.file_paths().iter().any(|f| same(f)) {
        return Ok(());
    }
    Err(format!(
        "--fuse {}: a file of {} bytes is there, and the mount would hide it (the export's \
         device would be served in its place, and its bytes out of sight). To serve that \
         file: cairn serve --device file:{} --fuse PATH; to mount here, move it away first",
        path.display(),
        meta.len(),
        path.display()
    ))
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
pub(crate) fn keep_stack_file(
    view: &std::sync::Arc<view::View>,
) -> Result<Option<stackfile::Watch>, String> {
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
pub(crate) fn serve(
    global: &settings::GlobalArgs,
    args: &settings::ServeArgs,
) -> Result<ExitCode, String> {
    // The arguments and the stack file.
    let limits = args.limits()?;
    let (chosen, devices, switches) = chosen_exports(args, global)?;
    let (tls, tls_config) = tls_settings(args)?;
    let fuse = fuse_wanted(args, &chosen, &devices)?;
    let listen = listen_addresses(args, &fuse)?;
    let single = stdio_connection(args)?;

    // The devices, opened without changing anything: a foreign array member, a file in
    // use or a path that cannot be created refuses the start here.
    devices.preflight(switches)?;

    // Every address, bound: one in use refuses the start here. A stale socket is
    // replaced; a live one, or anything else at a socket's path, is refused.
    let listeners = cairn_nbd::Listeners::bind(&listen).map_err(|e| e.to_string())?;
    if listeners.is_empty() && fuse.is_empty() && single.is_none() {
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
        .map(|c| export_of(c, &opened, limits.max_payload))
        .collect();
    drop(opened);
    let observer = Arc::new(cairn_nbd::Observer::default());
    let table = cairn_nbd::ExportTable::new();
    let view =
        server_view(args, &exports, &fuse, &observer).with_table(table.clone(), limits.max_payload);
    let view = Arc::new(view);
    let frontends = fuse
        .into_iter()
        .map(|f| f as Arc<dyn cairn_core::Frontend>)
        .collect();
    let config = cairn_nbd::Config {
        observer,
        on_abandon: remove_sockets(admin.as_ref(), metrics.as_ref()),
        on_stop: Some(lift_limits(view.clone())),
        single,
        table,
        ..nbd_config(args, &limits, (tls, tls_config), switches, frontends)
    };
    // Held until serving ends only if a stack file is kept: its last sync needs them.
    let devices: Vec<Arc<dyn cairn_core::Device>> = match view.stack_file() {
        Some(_) => exports.iter().map(|e| e.device.clone()).collect(),
        None => Vec::new(),
    };
    let _stack_file = keep_stack_file(&view)?;
    let _admin = admin.map(|b| admin::start(b, view.clone())).transpose()?;
    let _metrics = metrics
        .map(|b| {
            let m = metrics::start(b, view.clone())?;
            log::info!("cairn: serve: metrics at {}", m.url);
            Ok::<_, String>(m)
        })
        .transpose()?;
    raise_descriptor_limit();
    let summary = summary(&exports);
    let restore = view.clone();
    cairn_nbd::serve(config, listeners, exports, |addrs| {
        // Exports added while an earlier run served, kept by their pools.
        crate::backup::restore_exports(&restore);
        log::info!(
            "cairn: serving {summary} on {}",
            if addrs.is_empty() {
                if args.stdio {
                    "standard input (one connection)".to_string()
                } else {
                    "no NBD address (FUSE only)".to_string()
                }
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

/// What removes the admin and metrics socket files when a stuck shutdown is abandoned
/// (the process exits at once then); `None` when there are none.
fn remove_sockets(
    admin: Option<&admin::Bound>,
    metrics: Option<&metrics::Bound>,
) -> Option<Arc<dyn Fn() + Send + Sync>> {
    let removers: Vec<cairn_core::socket::Remover> = admin
        .into_iter()
        .map(admin::Bound::file)
        .chain(metrics.into_iter().filter_map(metrics::Bound::file))
        .map(cairn_core::socket::SocketFile::remover)
        .collect();
    (!removers.is_empty()).then(|| {
        Arc::new(move || {
            for r in &removers {
                r.remove();
            }
        }) as Arc<dyn Fn() + Send + Sync>
    })
}

/// TLS as `--tls` and `--tls-certificates` ask for it, with the certificates loaded.
fn tls_settings(
    args: &settings::ServeArgs,
) -> Result<(TlsMode, Option<Arc<cairn_nbd::tls::ServerConfig>>), String> {
    let tls = match (args.tls, &args.tls_certificates) {
        (Some(settings::TlsArg::Off), _) => TlsMode::Off,
        (None, None) => TlsMode::Off,
        (Some(settings::TlsArg::On), None) | (Some(settings::TlsArg::Require), None) => {
            return Err("--tls on|require needs --tls-certificates DIR".into())
        }
        (Some(settings::TlsArg::Require), Some(_)) => TlsMode::Required,
        (_, Some(_)) => TlsMode::Optional,
    };
    if args.tls_verify_peer && tls == TlsMode::Off {
        return Err("--tls-verify-peer needs --tls-certificates DIR".into());
    }
    let config = match (&args.tls_certificates, tls) {
        (Some(dir), t) if t != TlsMode::Off => {
            Some(cairn_nbd::tls::load(dir, args.tls_verify_peer).map_err(|e| e.to_string())?)
        }
        _ => None,
    };
    Ok((tls, config))
}

/// The `--listen` addresses; the default one when none is given, no socket is passed by
/// socket activation and nothing is mounted instead.
fn listen_addresses(
    args: &settings::ServeArgs,
    fuse: &[(std::path::PathBuf, usize)],
) -> Result<Vec<cairn_nbd::Listen>, String> {
    let mut listen = args
        .listen
        .iter()
        .map(|l| cairn_nbd::Listen::parse(l).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    if args.stdio {
        if !listen.is_empty() {
            return Err(
                "--stdio serves one connection on standard input: no --listen with it".into(),
            );
        }
        return Ok(listen);
    }
    if listen.is_empty() && std::env::var_os("LISTEN_FDS").is_none() && fuse.is_empty() {
        listen.push(cairn_nbd::Listen::parse(settings::DEFAULT_LISTEN).map_err(|e| e.to_string())?);
    }
    Ok(listen)
}

/// With `--stdio`, the connection to serve: standard input, which must be a socket (the
/// client's end of a socketpair, as libnbd's `connect_command` and nbd-tester-client
/// give, or an accepted connection from inetd). Replies go back on the same socket.
fn stdio_connection(
    args: &settings::ServeArgs,
) -> Result<Option<Arc<std::os::fd::OwnedFd>>, String> {
    if !args.stdio {
        return Ok(None);
    }
    let fd =
        rustix::io::dup(std::io::stdin()).map_err(|e| format!("--stdio: standard input: {e}"))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| format!("--stdio: standard input: {e}"))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
        return Err(
            "--stdio: standard input is not a socket (a pipe, a file or a terminal); \
             run it from a client that passes a socket, as libnbd's connect_command, \
             nbdsh -c and inetd do"
                .into(),
        );
    }
    let _ = rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC);
    // Standard input and output become /dev/null: nothing stray can reach the protocol,
    // and the connection closes when cairn closes it (not only when cairn exits).
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(|e| format!("--stdio: /dev/null: {e}"))?;
    rustix::stdio::dup2_stdin(&null).map_err(|e| format!("--stdio: standard input: {e}"))?;
    rustix::stdio::dup2_stdout(&null).map_err(|e| format!("--stdio: standard output: {e}"))?;
    Ok(Some(Arc::new(fd)))
}

/// Export `c` of the devices `opened`: what clients are told (flags from the device's
/// capabilities, block sizes, the largest payload) and the device behind it.
fn export_of(
    c: Chosen,
    opened: &[Arc<dyn cairn_core::Device>],
    max_payload: u32,
) -> cairn_nbd::Export {
    let device = opened[c.device].clone();
    let g = device.geometry();
    // A thin pool's snapshot is read-only whatever the export says.
    let c = Chosen {
        read_only: c.read_only || device.read_only(),
        ..c
    };
    let mut flags = tflags::HAS_FLAGS | tflags::SEND_FLUSH | tflags::SEND_CACHE;
    if c.read_only {
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
    if c.read_only || device.coherent_across_queues() {
        flags |= tflags::CAN_MULTI_CONN;
    }
    let preferred = g.block_bytes.max(4096);
    // The minimum is what cairn serves: any byte (read-modify-write on the blocks
    // around it), or whole blocks with strict alignment. Advertising the device's block
    // made clients that honour block sizes (libnbd, qemu) refuse byte-granular requests
    // themselves, or widen them, although cairn serves them.
    let minimum = if c.strict_alignment { g.block_bytes } else { 1 };
    cairn_nbd::Export {
        info: cairn_nbd::ExportInfo {
            name: c.name,
            description: c.description,
            size: g.size_bytes,
            flags,
            min_block: minimum,
            preferred_block: preferred,
            max_payload: max_payload.max(preferred),
            default: c.default,
        },
        device,
        strict_alignment: c.strict_alignment,
    }
}

/// The server's settings from the arguments and limits (with an observer of its own and
/// nothing to run on an abandoned shutdown).
fn nbd_config(
    args: &settings::ServeArgs,
    limits: &settings::ServeLimits,
    (tls, tls_config): (TlsMode, Option<Arc<cairn_nbd::tls::ServerConfig>>),
    switches: cairn_core::Switches,
    frontends: Vec<Arc<dyn cairn_core::Frontend>>,
) -> cairn_nbd::Config {
    cairn_nbd::Config {
        observer: Arc::new(cairn_nbd::Observer::default()),
        threads: limits.threads,
        limits: cairn_nbd::Limits {
            max_payload: limits.max_payload,
            buffer_bytes: limits.buffer_bytes,
        },
        memory_budget: limits.memory_budget,
        frontends,
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
        on_abandon: None,
        on_stop: None,
        single: None,
        table: cairn_nbd::ExportTable::new(),
    }
}

/// What operators see of the server (status, stat, metrics): the exports' devices, each
/// export with its FUSE mounts, the connections, and the stack file kept in step.
fn server_view(
    args: &settings::ServeArgs,
    exports: &[cairn_nbd::Export],
    fuse: &[Arc<cairn_fuse::FuseExport>],
    observer: &Arc<cairn_nbd::Observer>,
) -> view::View {
    let devices: Vec<Arc<dyn cairn_core::Device>> =
        exports.iter().map(|e| e.device.clone()).collect();
    let views = exports
        .iter()
        .map(|e| view::ExportView {
            name: e.info.name.clone(),
            device: e.device.name().to_string(),
            read_only: e.info.flags & tflags::READ_ONLY != 0,
            fuse: fuse
                .iter()
                .filter(|f| f.export_name() == e.info.name)
                .map(Arc::downgrade)
                .collect(),
        })
        .collect();
    view::View::new(&devices, views, Some(observer.clone())).with_stack_file(args.stack.as_deref())
}

/// An export added while serving (`cairn admin export add`): device `device`.
pub(crate) fn added_export(
    name: &str,
    description: String,
    (device, read_only): (Arc<dyn cairn_core::Device>, bool),
    max_payload: u32,
) -> cairn_nbd::Export {
    let c = Chosen {
        name: name.to_string(),
        device: 0,
        read_only,
        description,
        default: false,
        fuse: None,
        strict_alignment: false,
    };
    export_of(c, &[device], max_payload)
}

/// The exports as the start-up line names them.
fn summary(exports: &[cairn_nbd::Export]) -> String {
    let each: Vec<String> = exports
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
    each.join(", ")
}

/// At the stop, every throttle's limits are taken away: the requests waiting at them go
/// on at once, so the stop finishes them instead of waiting for its timeout (a limit of a
/// few bytes a second could hold one for hours).
fn lift_limits(view: Arc<view::View>) -> Arc<dyn Fn() + Send + Sync> {
    Arc::new(move || {
        for (name, t) in crate::throttle::throttles(&view.roots()) {
            if !t.limits().is_none() {
                log::info!("cairn: serve: stopping: throttle {name}'s limits lifted, so that the requests waiting at it finish");
                t.set_limits(cairn_services::throttle::Limits::default());
            }
        }
    })
}
