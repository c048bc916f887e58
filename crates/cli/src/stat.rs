//! `cairn stat SOCKET [INTERVAL]`: a running server's devices, like `iostat -x`.
//!
//! Each interval it asks the admin socket for `stats --json` and prints the difference
//! from the last answer as rates: a table redrawn in place on a terminal, one line per
//! device (prefixed with the time) when piped.

use std::io::IsTerminal;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

/// One device in one answer.
#[derive(Clone, Default)]
struct Sample {
    name: String,
    depth: usize,
    reads: u64,
    writes: u64,
    read_bytes: u64,
    written_bytes: u64,
    read_ns: u64,
    write_ns: u64,
    weighted_ns: u64,
    busy_ns: u64,
}

/// One answer: when (monotonic, in the server) and every device.
struct Answer {
    at_ns: u64,
    devices: Vec<Sample>,
}

fn parse(text: &str) -> Result<Answer, String> {
    let doc: Value =
        serde_json::from_str(text).map_err(|e| format!("stats --json: not JSON: {e}"))?;
    let num = |v: &Value| v.as_u64().unwrap_or(0);
    let op = |d: &Value, op: &str, key: &str| num(&d["ops"][op][key]);
    let devices = doc["devices"]
        .as_array()
        .ok_or("stats --json: no devices")?
        .iter()
        .map(|d| Sample {
            name: d["name"].as_str().unwrap_or("?").to_string(),
            depth: num(&d["depth"]) as usize,
            reads: op(d, "read", "requests"),
            writes: op(d, "write", "requests") + op(d, "write_zeroes", "requests"),
            read_bytes: op(d, "read", "bytes"),
            written_bytes: op(d, "write", "bytes") + op(d, "write_zeroes", "bytes"),
            read_ns: op(d, "read", "total_ns"),
            write_ns: op(d, "write", "total_ns") + op(d, "write_zeroes", "total_ns"),
            weighted_ns: ["read", "write", "flush", "discard", "write_zeroes"]
                .iter()
                .map(|o| op(d, o, "total_ns"))
                .sum(),
            busy_ns: num(&d["busy_ns"]),
        })
        .collect();
    Ok(Answer {
        at_ns: num(&doc["monotonic_ns"]),
        devices,
    })
}

/// The columns of one device over an interval of `dt_ns`.
fn row(now: &Sample, then: &Sample, dt_ns: u64) -> [f64; 8] {
    let dt = dt_ns.max(1) as f64;
    let per_s = |a: u64, b: u64| a.saturating_sub(b) as f64 * 1e9 / dt;
    let await_ms = |ns: (u64, u64), n: (u64, u64)| {
        let n = n.0.saturating_sub(n.1);
        if n == 0 {
            0.0
        } else {
            ns.0.saturating_sub(ns.1) as f64 / n as f64 / 1e6
        }
    };
    [
        per_s(now.reads, then.reads),
        per_s(now.writes, then.writes),
        per_s(now.read_bytes, then.read_bytes) / 1e6,
        per_s(now.written_bytes, then.written_bytes) / 1e6,
        await_ms((now.read_ns, then.read_ns), (now.reads, then.reads)),
        await_ms((now.write_ns, then.write_ns), (now.writes, then.writes)),
        now.weighted_ns.saturating_sub(then.weighted_ns) as f64 / dt,
        (now.busy_ns.saturating_sub(then.busy_ns) as f64 * 100.0 / dt).min(100.0),
    ]
}

const COLUMNS: [&str; 8] = [
    "r/s", "w/s", "rMB/s", "wMB/s", "r_await", "w_await", "aqu-sz", "%util",
];

/// The column names, aligned over [`cells`].
fn column_names() -> String {
    COLUMNS
        .iter()
        .map(|c| format!("{c:>9}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn cells(r: &[f64; 8]) -> String {
    r.iter()
        .map(|v| format!("{v:>9.2}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `cairn stat`.
pub fn run(socket: &Path, interval: Option<&str>, count: Option<u64>) -> Result<(), String> {
    let interval = match interval {
        Some(t) => cairn_core::size::parse_duration(t).map_err(|e| format!("INTERVAL: {e}"))?,
        None => Duration::from_secs(1),
    };
    if interval < Duration::from_millis(10) {
        return Err("INTERVAL: at least 10ms".into());
    }
    if count == Some(0) {
        return Err("--count: at least 1".into());
    }
    let ask = || crate::admin::request(socket, "stats --json").and_then(|t| parse(&t));
    let tty = std::io::stdout().is_terminal();
    let mut last = ask()?;
    let width = |a: &Answer| {
        a.devices
            .iter()
            .map(|d| d.name.len() + 2 * d.depth)
            .max()
            .unwrap_or(6)
            .max(6)
    };
    if !tty {
        let w = width(&last);
        crate::out(&format!(
            "{:<24} {:<w$} {}\n",
            "time",
            "device",
            column_names()
        ));
    }
    let mut done = 0;
    loop {
        std::thread::sleep(interval);
        let now = match ask() {
            Ok(a) => a,
            // The server went away between reports: the watch ends.
            Err(e) if done > 0 => {
                eprintln!("cairn: stat: {e}");
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let dt = now.at_ns.saturating_sub(last.at_ns);
        let time = crate::view::rfc3339(std::time::SystemTime::now());
        let w = width(&now);
        let mut text = String::new();
        if tty {
            // Home, clear, then the table.
            text += "\x1b[H\x1b[2J";
            text += &format!(
                "{time}  every {:?}\n{:<w$} {}\n",
                interval,
                "device",
                column_names()
            );
        }
        for d in &now.devices {
            let then = last
                .devices
                .iter()
                .find(|o| o.name == d.name)
                .cloned()
                .unwrap_or_default();
            let r = row(d, &then, dt);
            if tty {
                text += &format!(
                    "{:<w$} {}\n",
                    format!("{}{}", "  ".repeat(d.depth), d.name),
                    cells(&r)
                );
            } else {
                text += &format!("{time:<24} {:<w$} {}\n", d.name, cells(&r));
            }
        }
        crate::out(&text);
        last = now;
        done += 1;
        if count.is_some_and(|c| done >= c) {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_from_two_answers() {
        let then = Sample {
            reads: 100,
            read_bytes: 100 * 4096,
            read_ns: 100 * 50_000,
            weighted_ns: 100 * 50_000,
            busy_ns: 1_000_000_000,
            ..Default::default()
        };
        let now = Sample {
            reads: 1100,
            writes: 500,
            read_bytes: 1100 * 4096,
            written_bytes: 500 * 8192,
            read_ns: 100 * 50_000 + 1000 * 100_000,
            write_ns: 500 * 2_000_000,
            weighted_ns: 100 * 50_000 + 1000 * 100_000 + 500 * 2_000_000,
            busy_ns: 1_500_000_000,
            ..Default::default()
        };
        let r = row(&now, &then, 2_000_000_000);
        assert_eq!(r[0], 500.0);
        assert_eq!(r[1], 250.0);
        assert!((r[2] - 1000.0 * 4096.0 / 2e6).abs() < 1e-9);
        assert!((r[3] - 500.0 * 8192.0 / 2e6).abs() < 1e-9);
        assert!((r[4] - 0.1).abs() < 1e-9);
        assert!((r[5] - 2.0).abs() < 1e-9);
        assert!((r[6] - 0.55).abs() < 1e-9);
        assert!((r[7] - 25.0).abs() < 1e-9);
    }

    #[test]
    fn parses_what_stats_json_gives() {
        let text = r#"{"monotonic_ns":5,"devices":[{"name":"m","depth":1,"busy_ns":7,
            "ops":{"read":{"requests":2,"bytes":8192,"total_ns":10},
                   "write":{"requests":3,"bytes":512,"total_ns":20},
                   "write_zeroes":{"requests":1,"bytes":4096,"total_ns":5},
                   "flush":{"requests":1,"bytes":0,"total_ns":1}}}]}"#;
        let a = parse(text).unwrap();
        assert_eq!(a.at_ns, 5);
        let d = &a.devices[0];
        assert_eq!((d.name.as_str(), d.depth), ("m", 1));
        assert_eq!((d.reads, d.writes, d.written_bytes), (2, 4, 4608));
        assert_eq!((d.weighted_ns, d.busy_ns), (36, 7));
        assert!(parse("nope").is_err());
    }
}
