//! The `cairn` binary: parses the command line, builds devices, runs the job.
//!
//! Parsing happens in two steps, as ripgrep does it: clap turns arguments into raw flags,
//! then [`settings`] validates them into the typed values the libraries take. Every
//! mistake ends in one line on stderr and exit status 2; a failed I/O or verification
//! during a run ends in exit status 1.

#![forbid(unsafe_code)]

mod admin;
mod admin_error;
mod admin_threads;
mod backup;
mod backup_client;
mod bench;
mod bitmaps;
mod crypt;
mod man;
mod metrics;
mod serve;
mod settings;
mod stackfile;
mod stat;
mod throttle;
mod view;

use std::process::ExitCode;

use clap::Parser;

use settings::{Cli, Command};

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
    let lost = cairn_stacks::cache::unwritten_at_close();
    if lost > 0 {
        log::error!(
            "cairn: {} ({} bytes) of acknowledged writes could not be written back and are lost",
            cairn_core::size::plural(lost as u64, "cached page", "cached pages"),
            lost * cairn_stacks::cache::PAGE
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
        Command::Bench(args) => bench::run(&cli.global, &args),
        Command::Backup(args) => backup_client::run(&args.settings()?),
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
            let mut stack = settings::read_stack(&args.stack)?;
            let switches = cli.global.switches(&stack.tuning)?;
            if let Some(pool) = &args.repair_thin {
                let at = |e: cairn_core::Error| format!("{}: {e}", args.stack.display());
                stack.repair_thin(pool).map_err(at)?;
                // Opened for real and stopped cleanly: the repaired state is checkpointed.
                drop(
                    stack
                        .open_all(std::slice::from_ref(pool), switches)
                        .map_err(at)?,
                );
                stack = settings::read_stack(&args.stack)?;
                out(&format!("thin pool '{pool}' repaired\n"));
            }
            let report = stack
                .check(args.device.as_deref(), switches)
                .map_err(|e| format!("{}: {e}", args.stack.display()))?;
            out(&report);
            out(&format!("switches: {switches}\n"));
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The devices a run opens: a leaf given on the command line (`--device SPEC`), or
/// devices of a stack file. Each is opened twice: first as `cairn check` opens it
/// ([`Devices::preflight`]: nothing is created or written), so that every refusal comes
/// before any change, then for real.
pub(crate) enum Devices {
    Leaf(cairn_leaves::LeafSpec),
    Stack {
        stack: cairn_config::StackFile,
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
                cairn_config::preflight_leaf(leaf, &leaf.default_name()).map_err(|e| e.to_string())
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
            Devices::Leaf(cairn_leaves::LeafSpec::File { path, .. }) => vec![path.clone()],
            Devices::Leaf(_) => Vec::new(),
            Devices::Stack { stack, .. } => stack
                .devices
                .values()
                .filter_map(|d| match d {
                    cairn_config::DeviceSpec::Leaf(cairn_leaves::LeafSpec::File {
                        path, ..
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
                cairn_leaves::open(leaf, &leaf.default_name()).map_err(|e| e.to_string())?
            ]),
            Devices::Stack { stack, path, names } => stack
                .open_all(names, switches)
                .map_err(|e| format!("{}: {e}", path.display())),
        }
    }
}
