//! `cairn bench`: the device opened (after a preflight that changes nothing), the admin
//! and metrics sockets, signals, the job, its report, and the write-back of caches on the
//! way out.

use std::io::IsTerminal;
use std::process::ExitCode;

use cairn_config::Tuning;

use crate::settings::{self, BenchArgs, DeviceChoice, GlobalArgs, OutputFormat};
use crate::{admin, metrics, out, serve, view, Devices};

/// Runs `cairn bench` with its validated flags; the exit code is the report's.
pub(crate) fn run(global: &GlobalArgs, args: &BenchArgs) -> Result<ExitCode, String> {
    let (spec, choice, format) = args.settings()?;
    let stack_path = match &choice {
        DeviceChoice::Stack { path, .. } => Some(path.clone()),
        _ => None,
    };
    let (devices, switches) = match choice {
        DeviceChoice::Leaf(leaf) => (Devices::Leaf(leaf), global.switches(&Tuning::default())?),
        DeviceChoice::Stack { path, name } => {
            let stack = settings::read_stack(&path)?;
            let switches = global.switches(&stack.tuning)?;
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
        cairn_core::capability::writeback_totals(d).dirty_bytes
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
