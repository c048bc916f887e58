//! The `cairn` binary: parses the command line, builds devices, runs the job.
//!
//! Parsing happens in two steps, as ripgrep does it: clap turns arguments into raw flags,
//! then [`settings`] validates them into the typed values the libraries take. Every
//! mistake ends in one line on stderr and exit status 2; a failed I/O or verification
//! during a run ends in exit status 1.

mod settings;

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
    match run(cli) {
        Ok(code) => code,
        Err(message) => {
            eprintln!("cairn: {message}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode, String> {
    match cli.command {
        Command::Bench(args) => {
            let (spec, choice, format) = args.settings()?;
            let (device, switches) = match choice {
                DeviceChoice::Leaf(leaf) => {
                    let switches = cli.global.switches(&Tuning::new())?;
                    let device = cairn_devices::open(&leaf, &leaf.default_name())
                        .map_err(|e| e.to_string())?;
                    (device, switches)
                }
                DeviceChoice::Stack { path, name } => {
                    let stack = settings::read_stack(&path)?;
                    let switches = cli.global.switches(&stack.tuning)?;
                    let name = stack.pick(name.as_deref()).map_err(|e| e.to_string())?;
                    let device = stack
                        .open(&name)
                        .map_err(|e| format!("{}: {e}", path.display()))?;
                    (device, switches)
                }
            };
            let progress = std::io::stderr().is_terminal() && format == OutputFormat::Normal;
            let report = cairn_bench::run(&spec, device, switches, progress)?;
            match format {
                OutputFormat::Normal => print!("{}", report.to_text()),
                OutputFormat::Json => {
                    let text = serde_json::to_string_pretty(&report.to_json())
                        .map_err(|e| format!("cannot write JSON: {e}"))?;
                    println!("{text}");
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
        Command::Check(args) => {
            let stack = settings::read_stack(&args.stack)?;
            let switches = cli.global.switches(&stack.tuning)?;
            let names = match &args.device {
                Some(n) => vec![stack.pick(Some(n)).map_err(|e| e.to_string())?],
                None => stack.roots(),
            };
            // Open everything first: an error prints one line and no half a tree.
            let devices = names
                .iter()
                .map(|name| stack.open(name))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("{}: {e}", args.stack.display()))?;
            for device in devices {
                print!("{}", cairn_devices::config::tree(&*device));
            }
            println!(
                "switches: clock={:?} reap={:?} stats={:?} flush={:?} dispatch={:?}",
                switches.clock, switches.reap, switches.stats, switches.flush, switches.dispatch
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}
