//! `cairn admin SOCKET throttle ...`: each throttle's limits, what it let through and
//! what waits, and live changes of its limits.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use cairn_core::Device;
use cairn_services::throttle::{ThrottleAdmin, ThrottleCounts};

use crate::admin_error::AdminError;
use crate::view::all_devices;

const USAGE: &str = "throttle list [--json] | set DEVICE KEY=VALUE... (iops, iops_read, iops_write, bps, bps_read, bps_write, each with _max and _max_length; 0 takes a limit away)";

/// The throttle devices served, by name.
pub(crate) fn throttles(roots: &[Arc<dyn Device>]) -> Vec<(String, Arc<dyn ThrottleAdmin>)> {
    all_devices(roots)
        .into_iter()
        .filter_map(|(_, d)| Some((d.name().to_string(), d.capability::<dyn ThrottleAdmin>()?)))
        .collect()
}

/// What each device counted at the last `throttle list`, for the rates since.
static LAST: Mutex<Vec<(String, Instant, ThrottleCounts)>> = Mutex::new(Vec::new());

/// Requests and bytes a second for `name` since the last look (`None` at the first).
fn rates(name: &str, now: ThrottleCounts) -> Option<(f64, f64)> {
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    let at = Instant::now();
    let before = last
        .iter()
        .position(|(n, _, _)| n == name)
        .map(|i| last.remove(i));
    last.push((name.to_string(), at, now));
    let (_, since, before) = before?;
    let secs = at.duration_since(since).as_secs_f64().max(1e-3);
    Some((
        now.requests.saturating_sub(before.requests) as f64 / secs,
        now.bytes.saturating_sub(before.bytes) as f64 / secs,
    ))
}

/// `throttle ACTION ...`.
pub(crate) fn command(args: &[&str], roots: &[Arc<dyn Device>]) -> Result<String, AdminError> {
    let all = throttles(roots);
    match args {
        ["list"] | ["list", "--json"] => {
            let json = args.len() == 2;
            let mut text = String::new();
            let mut items = Vec::new();
            for (name, p) in &all {
                let c = p.counts();
                let rate = rates(name, c);
                let limits = p.limits();
                text +=
                    &format!(
                    "{name}{}: {limits}; {} requests ({} waited), {} through; {} waiting now{}\n",
                    p.group().map(|g| format!(" (group {g})")).unwrap_or_default(),
                    c.requests,
                    c.delayed,
                    cairn_core::size::format_bytes(c.bytes),
                    c.waiting,
                    match rate {
                        Some((r, b)) => format!(
                            "; since the last look {r:.0} requests/s, {}/s",
                            cairn_core::size::format_bytes(b as u64)
                        ),
                        None => String::new(),
                    },
                );
                items.push(serde_json::json!({
                    "device": name,
                    "group": p.group(),
                    "limits": limits_json(&limits),
                    "requests": c.requests,
                    "bytes": c.bytes,
                    "delayed": c.delayed,
                    "waiting": c.waiting,
                    "since_last_look": rate.map(|(r, b)| serde_json::json!({
                        "requests_per_s": r,
                        "bytes_per_s": b,
                    })),
                }));
            }
            Ok(if json {
                format!("ok\n{}\n", serde_json::Value::from(items))
            } else if text.is_empty() {
                "ok\nno throttles\n".into()
            } else {
                format!("ok\n{text}")
            })
        }
        ["set", device, words @ ..] if !words.is_empty() => {
            let Some((_, p)) = all.iter().find(|(n, _)| n == device) else {
                return Err(AdminError::NoThrottle(device.to_string()));
            };
            let limits = cairn_config::change_limits(device, p.limits(), words)?;
            p.set_limits(limits);
            let shared = match p.group() {
                Some(g) => format!(" (group {g}: every device of it)"),
                None => String::new(),
            };
            log::info!("cairn: admin: throttle {device}{shared}: now {limits}");
            Ok(format!("ok: throttle {device}{shared}: now {limits}\n"))
        }
        _ => Err(AdminError::Usage(USAGE.into())),
    }
}

fn limits_json(l: &cairn_services::throttle::Limits) -> serde_json::Value {
    let r = |r: cairn_services::throttle::Rate| serde_json::json!({ "avg": r.avg, "max": r.max, "max_length": r.max_length });
    serde_json::json!({
        "iops": r(l.iops),
        "iops_read": r(l.iops_read),
        "iops_write": r(l.iops_write),
        "bps": r(l.bps),
        "bps_read": r(l.bps_read),
        "bps_write": r(l.bps_write),
    })
}
