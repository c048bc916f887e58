//! The `cairn` binary: parses the command line, builds devices, runs the job.
//!
//! Parsing happens in two steps, as ripgrep does it: clap turns arguments into raw flags,
//! then [`settings`] validates them into the typed values the libraries take. Every
//! mistake ends in one line on stderr and exit status 2; a failed I/O or verification
//! during a run ends in exit status 1.

mod admin;
mod man;
mod metrics;
mod serve;
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
    let serving = matches!(cli.command, Command::Serve(_));
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
            "cairn: {} ({} bytes) of acknowledged writes could not be written back and are lost",
            cairn_core::size::plural(lost as u64, "cached page", "cached pages"),
            lost * cairn_devices::cache::PAGE
        );
        if serving {
            log::error!("cairn: serve: stopped, with acknowledged writes lost (exit status 1)");
        }
        return ExitCode::from(1);
    }
    if serving && code == ExitCode::SUCCESS {
        // Every device is closed and every cache written back: the last line of a run.
        log::info!("cairn: serve: stopped");
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
            // Caught from here on (queued until the thread below takes them), so that a
            // signal sent as soon as the admin socket appears finds them caught.
            let signals = bench_signals_caught();
            let admin = args.admin.as_deref().map(admin::bind).transpose()?;
            let metrics = args.metrics.as_deref().map(metrics::bind).transpose()?;
            let device = devices
                .open(switches)?
                .pop()
                .ok_or("bench: no device opened")?;
            let progress = std::io::stderr().is_terminal() && format == OutputFormat::Normal;
            let view = std::sync::Arc::new(
                view::View::new(std::slice::from_ref(&device), Vec::new(), None)
                    .with_stack_file(stack_path.as_deref()),
            );
            // SIGINT and SIGTERM end the job early, with its report (as fio's Ctrl-C);
            // SIGUSR1 and SIGUSR2 log a status, as they do for serve.
            bench_signals(signals, view.clone());
            let admin = match admin {
                Some(bound) => Some(admin::start(bound, view.clone())?),
                None => None,
            };
            let stack_file = serve::keep_stack_file(&view)?;
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
            // Held past the report: closing the device writes back what its caches hold
            // dirty, which is said (and can take a while) after the report.
            let closing = device.clone();
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
            close_writing_back(closing, switches);
            Ok(ExitCode::from(report.exit_code() as u8))
        }
        Command::Serve(args) => serve::serve(&cli.global, &args),
        Command::Admin(args) => {
            if args.command.is_empty() {
                if args.socket.as_os_str() == "help" {
                    out(&format!("commands:\n{}", admin::help_text()));
                    return Ok(ExitCode::SUCCESS);
                }
                return Err(format!(
                    "admin {}: no command given (`cairn admin help` lists them)",
                    args.socket.display()
                ));
            }
            admin::client(&args.socket, &args.command)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Stat(args) => {
            stat::run(&args.socket, args.interval.as_deref(), args.count)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Man(args) => {
            for page in man::write_pages(&args.dir)? {
                out(&format!("{}\n", page.display()));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Check(args) => {
            let stack = settings::read_stack(&args.stack)?;
            let switches = cli.global.switches(&stack.tuning)?;
            let report = stack
                .check(args.device.as_deref(), switches)
                .map_err(|e| format!("{}: {e}", args.stack.display()))?;
            out(&report);
            out(&format!("switches: {switches}\n"));
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Set while `cairn bench` closes its device after the report, writing its caches back:
/// a SIGINT or SIGTERM then quits at once, losing what is not written back yet.
static WRITING_BACK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Closes `device` (the last reference), saying first how much its caches hold dirty and
/// will write back, and every 2 s how much is left, until it is done. The write-back is a
/// flush of the device, sent while this function still holds it (so that its caches can
/// be watched); closing it then has nothing left to write.
fn close_writing_back(
    device: std::sync::Arc<dyn cairn_core::Device>,
    switches: cairn_core::Switches,
) {
    use cairn_core::size::format_bytes;
    use std::sync::atomic::Ordering::Relaxed;
    let dirty = |d: &std::sync::Arc<dyn cairn_core::Device>| -> u64 {
        view::all_devices(std::slice::from_ref(d))
            .iter()
            .map(|(_, d)| d.writeback_counters().0)
            .sum()
    };
    let left = dirty(&device);
    if left == 0 {
        return;
    }
    log::info!(
        "cairn: bench: writing back the {} the caches hold dirty before exiting (Ctrl-C quits at once: what is not written back yet is lost)",
        format_bytes(left)
    );
    WRITING_BACK.store(true, Relaxed);
    let began = std::time::Instant::now();
    let watched = device.clone();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let done = done.clone();
        std::thread::Builder::new()
            .name("cairn-writeback-watch".into())
            .spawn(move || {
                let mut ticks = 0u32;
                while !done.load(Relaxed) {
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    ticks += 1;
                    if !ticks.is_multiple_of(20) {
                        continue;
                    }
                    log::info!(
                        "cairn: bench: write-back: {} left",
                        format_bytes(dirty(&watched))
                    );
                }
            })
            .ok()
    };
    // A failed flush is said; closing the device tries again and counts what is lost.
    if let Err(e) = cairn_core::blocking::BlockingQueue::open(&device, switches)
        .map_err(|e| e.to_string())
        .and_then(|q| q.flush().map_err(|e| format!("{e:?}")))
    {
        log::warn!("cairn: bench: the flush before closing failed: {e}");
    }
    done.store(true, Relaxed);
    if let Some(w) = watcher {
        let _ = w.join();
    }
    drop(device);
    WRITING_BACK.store(false, Relaxed);
    log::info!(
        "cairn: bench: written back in {:.1} s",
        began.elapsed().as_secs_f64()
    );
}

/// Catches SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 (signal-hook's handler, which only wakes
/// its iterator): from here on they are queued, not acted on, until [`bench_signals`].
fn bench_signals_caught() -> Option<signal_hook::iterator::Signals> {
    use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
    signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGUSR1, SIGUSR2]).ok()
}

/// Waits for the caught signals on a thread of its own: SIGINT and SIGTERM end the
/// bench's jobs, SIGUSR1 and SIGUSR2 log a status of `view` (the device tree, failed
/// members, arrays) and the job goes on.
fn bench_signals(
    signals: Option<signal_hook::iterator::Signals>,
    view: std::sync::Arc<view::View>,
) {
    use signal_hook::consts::{SIGUSR1, SIGUSR2};
    let Some(mut signals) = signals else {
        return;
    };
    let _ = std::thread::Builder::new()
        .name("cairn-signals".into())
        .spawn(move || {
            for signo in signals.forever() {
                if signo == SIGUSR1 || signo == SIGUSR2 {
                    for line in admin::status_report(&view).lines() {
                        log::info!("cairn: bench: status: {line}");
                    }
                    continue;
                }
                if WRITING_BACK.load(std::sync::atomic::Ordering::Relaxed) {
                    log::error!(
                        "cairn: bench: {} received while writing back: quitting; what the caches had not written back is lost",
                        cairn_nbd::signal_name(signo)
                    );
                    std::process::exit(130);
                }
                if cairn_bench::INTERRUPTED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    // A second one: give up at once.
                    std::process::exit(130);
                }
                log::warn!(
                    "cairn: bench: {} received: ending the job (again to quit at once)",
                    cairn_nbd::signal_name(signo)
                );
            }
        });
}

/// The devices a run opens: a leaf given on the command line (`--device SPEC`), or
/// devices of a stack file. Each is opened twice: first as `cairn check` opens it
/// ([`Devices::preflight`]: nothing is created or written), so that every refusal comes
/// before any change, then for real.
pub(crate) enum Devices {
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
    pub(crate) fn preflight(&self, switches: cairn_core::Switches) -> Result<(), String> {
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

    /// The paths of the files and block devices these devices use (`type = "file"`
    /// leaves), as written.
    pub(crate) fn file_paths(&self) -> Vec<std::path::PathBuf> {
        match self {
            Devices::Leaf(cairn_devices::LeafSpec::File { path, .. }) => vec![path.clone()],
            Devices::Leaf(_) => Vec::new(),
            Devices::Stack { stack, .. } => stack
                .devices
                .values()
                .filter_map(|d| match d {
                    cairn_devices::config::DeviceSpec::Leaf(cairn_devices::LeafSpec::File {
                        path,
                        ..
                    }) => Some(path.clone()),
                    _ => None,
                })
                .collect(),
        }
    }

    /// Opens them for real (files created or extended, arrays started), in order.
    pub(crate) fn open(
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
