//! What operators see of a running cairn: the device tree, the exports and their
//! connections, each device's statistics. The admin socket (`status`, `stats`) and the
//! metrics endpoint render it; nothing here runs on the I/O path (statistics are read
//! from the queues' counters while they run).

use std::sync::{Arc, Weak};

use cairn_core::size::{format_bytes, plural};
use cairn_core::{Array, Device, DeviceStatsSnapshot, Op};
use cairn_nbd::Observer;

/// An export as operators see it.
#[derive(Clone)]
pub struct ExportView {
    /// The name clients ask for (empty: the default export).
    pub name: String,
    /// The device behind it.
    pub device: String,
    /// Whether it refuses writes.
    pub read_only: bool,
    /// Its FUSE files (held weakly, as the devices are).
    pub fuse: Vec<Weak<cairn_fuse::FuseExport>>,
}

/// Everything a status or a scrape reads. Devices are held weakly: when serving ends they
/// close (and caches write back) as if nobody watched.
pub struct View {
    roots: Vec<Weak<dyn Device>>,
    exports: Vec<ExportView>,
    observer: Option<Arc<Observer>>,
    /// The stack file the devices were opened from, kept in step with their arrays.
    stack_file: Option<crate::stackfile::Keeper>,
    /// The server's exports, which `export add` adds to, and the largest payload.
    table: Option<(Arc<cairn_nbd::ExportTable>, u32)>,
}

impl View {
    /// A view of `roots` (each export's device) with the server's `exports` and
    /// connections (none for `cairn bench`).
    pub fn new(
        roots: &[Arc<dyn Device>],
        exports: Vec<ExportView>,
        observer: Option<Arc<Observer>>,
    ) -> View {
        View {
            roots: roots.iter().map(Arc::downgrade).collect(),
            exports,
            observer,
            stack_file: None,
            table: None,
        }
    }

    /// Lets the admin add exports to `table` (of a server whose largest payload is
    /// `max_payload`).
    pub fn with_table(mut self, table: Arc<cairn_nbd::ExportTable>, max_payload: u32) -> View {
        self.table = Some((table, max_payload));
        self
    }

    /// The server's export table and largest payload, when serving.
    pub fn table(&self) -> Option<&(Arc<cairn_nbd::ExportTable>, u32)> {
        self.table.as_ref()
    }

    /// Keeps `path`, the stack file the devices were opened from, in step with their
    /// arrays' members (see [`crate::stackfile`]).
    pub fn with_stack_file(mut self, path: Option<&std::path::Path>) -> View {
        self.stack_file = path.map(crate::stackfile::Keeper::new);
        self
    }

    /// The stack file kept in step, if any.
    pub fn stack_file(&self) -> Option<&crate::stackfile::Keeper> {
        self.stack_file.as_ref()
    }

    /// Brings the stack file in step with the arrays now: what was changed or no longer
    /// matches (empty without a stack file, or when in step).
    pub fn sync_stack_file(&self) -> Vec<String> {
        let Some(keeper) = &self.stack_file else {
            return Vec::new();
        };
        let arrays: Vec<crate::stackfile::Arrays> = all_devices(&self.roots())
            .into_iter()
            .filter_map(|(_, d)| {
                let array = d.capability::<dyn Array>()?;
                let members = array.members_now()?;
                let spares = array.spares_now().unwrap_or_default();
                Some((d.name().to_string(), members, spares))
            })
            .collect();
        keeper.sync(&arrays)
    }

    /// The root devices still open.
    pub fn roots(&self) -> Vec<Arc<dyn Device>> {
        self.roots.iter().filter_map(Weak::upgrade).collect()
    }

    /// The exports.
    /// The exports: those of the start, then those added while serving (`export add`).
    pub fn exports(&self) -> Vec<ExportView> {
        let mut all = self.exports.clone();
        if let Some((table, _)) = &self.table {
            all.extend(
                table
                    .snapshot()
                    .iter()
                    .filter(|l| l.added())
                    .map(|l| ExportView {
                        name: l.export.info.name.clone(),
                        device: l.export.device.name().to_string(),
                        read_only: true,
                        fuse: Vec::new(),
                    }),
            );
        }
        all
    }

    /// The server's connections and error replies, if it is a server.
    pub fn observer(&self) -> Option<&Observer> {
        self.observer.as_deref()
    }
}

/// Every device under `roots`, depth first, each once, with its depth.
pub fn all_devices(roots: &[Arc<dyn Device>]) -> Vec<(usize, Arc<dyn Device>)> {
    fn walk(d: &Arc<dyn Device>, depth: usize, out: &mut Vec<(usize, Arc<dyn Device>)>) {
        if out.iter().any(|(_, o)| o.name() == d.name()) {
            return;
        }
        out.push((depth, d.clone()));
        for c in d.children() {
            walk(&c, depth + 1, out);
        }
    }
    let mut out = Vec::new();
    for r in roots {
        walk(r, 0, &mut out);
    }
    out
}

/// The monotonic clock the queues use, in nanoseconds.
pub fn now_ns() -> u64 {
    cairn_core::clock::monotonic_ns()
}

/// The statistics of `device` now: zeros if no queue of it opened yet.
pub fn device_stats(device: &str, now_ns: u64) -> DeviceStatsSnapshot {
    cairn_core::stats::registry()
        .device(device, now_ns)
        .unwrap_or_else(|| DeviceStatsSnapshot {
            enabled: true,
            ios: [0; Op::COUNT],
            sectors: [0; Op::COUNT],
            ticks_ns: [0; Op::COUNT],
            errors: 0,
            in_flight: 0,
            busy_ns: 0,
            latency: Default::default(),
        })
}

/// An RFC 3339 time, UTC, to the second.
pub fn rfc3339(t: std::time::SystemTime) -> String {
    match jiff::Timestamp::try_from(t) {
        Ok(ts) => format!("{ts:.0}"),
        Err(_) => "?".into(),
    }
}

/// `N requests: R reads (BYTES), W writes (BYTES)`, as a status line shows them.
fn io_counts(requests: u64, reads: u64, read_bytes: u64, writes: u64, written: u64) -> String {
    format!(
        "{}: {} ({}), {} ({})",
        plural(requests, "request", "requests"),
        plural(reads, "read", "reads"),
        format_bytes(read_bytes),
        plural(writes, "write", "writes"),
        format_bytes(written)
    )
}

/// The same counts as [`io_counts`], added to a JSON object.
fn add_io_counts(
    v: &mut serde_json::Value,
    requests: u64,
    reads: u64,
    read_bytes: u64,
    writes: u64,
    written: u64,
) {
    for (key, n) in [
        ("requests", requests),
        ("reads", reads),
        ("read_bytes", read_bytes),
        ("writes", writes),
        ("written_bytes", written),
    ] {
        v[key] = n.into();
    }
}

/// How a FUSE export gets its requests.
fn fuse_transport(x: &cairn_fuse::FuseExport) -> &'static str {
    if x.uses_io_uring() {
        "io_uring"
    } else {
        "/dev/fuse"
    }
}

/// The exports and their connections, for `status`.
pub fn exports_text(view: &View) -> String {
    let mut out = String::new();
    let conns = view
        .observer()
        .map(Observer::connections)
        .unwrap_or_default();
    if view.exports().is_empty() {
        return out;
    }
    out += "exports:\n";
    let now = cairn_core::clock::monotonic_ns();
    for e in &view.exports() {
        let mine: Vec<_> = conns.iter().filter(|c| c.export == e.name).collect();
        out += &format!(
            "  '{}' ({}{}): {} connection{}\n",
            e.name,
            e.device,
            if e.read_only { ", read-only" } else { "" },
            mine.len(),
            if mine.len() == 1 { "" } else { "s" }
        );
        for x in e.fuse.iter().filter_map(Weak::upgrade) {
            let f = x.figures();
            out += &format!(
                "    fuse {} ({}): {}, {}, {}\n",
                x.path().display(),
                fuse_transport(&x),
                io_counts(f.requests, f.reads, f.read_bytes, f.writes, f.written_bytes),
                plural(f.flushes, "flush", "flushes"),
                plural(f.errors, "error", "errors")
            );
        }
        for c in mine {
            let f = c.figures();
            out += &format!(
                "    #{} {}{} ({} headers) since {} ({:.1} s), {}, holding {}: {}, {}, {}, {}, {} block status, {}\n",
                c.id,
                c.peer,
                if c.tls { " TLS" } else { "" },
                c.headers,
                rfc3339(c.since),
                c.age().as_secs_f64(),
                match c.idle_for(now) {
                    Some(d) => format!("idle {:.1} s", d.as_secs_f64()),
                    None => "busy".to_string(),
                },
                format_bytes(c.held()),
                io_counts(f.requests, f.reads, f.read_bytes, f.writes, f.written_bytes),
                plural(f.flushes, "flush", "flushes"),
                plural(f.trims, "trim", "trims"),
                plural(f.write_zeroes, "write-zeroes", "write-zeroes"),
                f.block_status,
                plural(f.errors, "error", "errors")
            );
        }
    }
    if let Some(o) = view.observer() {
        let errors: Vec<String> = o
            .errors()
            .into_iter()
            .filter(|&(_, n)| n > 0)
            .map(|(name, n)| format!("{name} {n}"))
            .collect();
        out += &format!(
            "  {} since start; error replies: {}\n",
            plural(o.accepted(), "connection", "connections"),
            if errors.is_empty() {
                "none".to_string()
            } else {
                errors.join(", ")
            }
        );
        if let Some((used, limit, waits)) = o.memory() {
            out += &format!(
                "  buffer memory: {} of a {} budget; connections waited for memory {} times\n",
                format_bytes(used as u64),
                format_bytes(limit as u64),
                waits
            );
        }
    }
    out
}

/// The exports and their connections, for `status --json`.
pub fn exports_json(view: &View) -> serde_json::Value {
    let conns = view
        .observer()
        .map(Observer::connections)
        .unwrap_or_default();
    let now = cairn_core::clock::monotonic_ns();
    let exports: Vec<serde_json::Value> = view
        .exports()
        .iter()
        .map(|e| {
            let list: Vec<serde_json::Value> = conns
                .iter()
                .filter(|c| c.export == e.name)
                .map(|c| {
                    let f = c.figures();
                    let mut v = serde_json::json!({
                        "id": c.id,
                        "peer": c.peer,
                        "tls": c.tls,
                        "headers": c.headers,
                        "since": rfc3339(c.since),
                        "seconds": c.age().as_secs_f64(),
                        "flushes": f.flushes,
                        "trims": f.trims,
                        "write_zeroes": f.write_zeroes,
                        "block_status": f.block_status,
                        "errors": f.errors,
                        "largest_request_bytes": f.largest,
                        "idle_seconds": c.idle_for(now).map(|d| d.as_secs_f64()),
                        "held_bytes": c.held(),
                    });
                    add_io_counts(
                        &mut v,
                        f.requests,
                        f.reads,
                        f.read_bytes,
                        f.writes,
                        f.written_bytes,
                    );
                    v
                })
                .collect();
            let fuse: Vec<serde_json::Value> = e
                .fuse
                .iter()
                .filter_map(Weak::upgrade)
                .map(|x| {
                    let f = x.figures();
                    let mut v = serde_json::json!({
                        "path": x.path().display().to_string(),
                        "transport": fuse_transport(&x),
                        "flushes": f.flushes,
                        "errors": f.errors,
                    });
                    add_io_counts(
                        &mut v,
                        f.requests,
                        f.reads,
                        f.read_bytes,
                        f.writes,
                        f.written_bytes,
                    );
                    v
                })
                .collect();
            serde_json::json!({
                "name": e.name,
                "device": e.device,
                "read_only": e.read_only,
                "connections": list,
                "fuse": fuse,
            })
        })
        .collect();
    let errors: serde_json::Map<String, serde_json::Value> = view
        .observer()
        .map(|o| {
            o.errors()
                .into_iter()
                .map(|(n, v)| (n.to_string(), v.into()))
                .collect()
        })
        .unwrap_or_default();
    serde_json::json!({
        "exports": exports,
        "connections_accepted": view.observer().map_or(0, Observer::accepted),
        "error_replies": errors,
        "memory": view.observer().and_then(Observer::memory).map(|(used, limit, waits)| {
            serde_json::json!({"used_bytes": used, "budget_bytes": limit, "waits": waits})
        }),
    })
}

/// Operation names, in [`Op`] index order.
pub const OP_NAMES: [&str; Op::COUNT] = ["read", "write", "flush", "discard", "write_zeroes"];

/// `/proc/diskstats`' 17 fields for a device (after major, minor and name): write-zeroes
/// count as writes, as the kernel counts them; nothing is merged; times in milliseconds.
pub fn diskstats(s: &DeviceStatsSnapshot) -> [u64; 17] {
    let ms = |ns: u64| ns / 1_000_000;
    let (r, w, f, d, z) = (
        Op::Read.index(),
        Op::Write.index(),
        Op::Flush.index(),
        Op::Discard.index(),
        Op::WriteZeroes.index(),
    );
    let weighted: u64 = s.ticks_ns.iter().sum();
    [
        s.ios[r],
        0,
        s.sectors[r],
        ms(s.ticks_ns[r]),
        s.ios[w] + s.ios[z],
        0,
        s.sectors[w] + s.sectors[z],
        ms(s.ticks_ns[w] + s.ticks_ns[z]),
        s.in_flight,
        ms(s.busy_ns),
        ms(weighted),
        s.ios[d],
        0,
        s.sectors[d],
        ms(s.ticks_ns[d]),
        s.ios[f],
        ms(s.ticks_ns[f]),
    ]
}

/// Names of the [`diskstats`] fields, for JSON.
pub const DISKSTATS_FIELDS: [&str; 17] = [
    "reads_completed",
    "reads_merged",
    "sectors_read",
    "ms_reading",
    "writes_completed",
    "writes_merged",
    "sectors_written",
    "ms_writing",
    "ios_in_progress",
    "ms_doing_io",
    "weighted_ms_doing_io",
    "discards_completed",
    "discards_merged",
    "sectors_discarded",
    "ms_discarding",
    "flushes_completed",
    "ms_flushing",
];

/// Latency quantiles reported, with their names.
pub const QUANTILES: [(f64, &str); 5] = [
    (0.5, "p50"),
    (0.9, "p90"),
    (0.99, "p99"),
    (0.999, "p99.9"),
    (1.0, "max"),
];

fn micros(ns: u64) -> String {
    if ns >= 10_000_000 {
        format!("{:.0}ms", ns as f64 / 1e6)
    } else {
        format!("{:.1}us", ns as f64 / 1e3)
    }
}

/// `stats`: a `/proc/diskstats` line per device (indented by the stack), then the
/// latency of every operation a device served.
pub fn stats_text(view: &View) -> String {
    let now = now_ns();
    let all = all_devices(&view.roots());
    let snaps: Vec<(usize, String, DeviceStatsSnapshot)> = all
        .iter()
        .map(|(depth, d)| (*depth, d.name().to_string(), device_stats(d.name(), now)))
        .collect();
    let mut out = String::from(
        "diskstats (reads merged-0 sectors ms, writes merged-0 sectors ms, in-flight, io-ms, weighted-ms, discards merged-0 sectors ms, flushes ms):\n",
    );
    let width = snaps
        .iter()
        .map(|(depth, n, _)| 2 * depth + n.len())
        .max()
        .unwrap_or(0);
    for (depth, name, s) in &snaps {
        let fields: Vec<String> = diskstats(s).iter().map(u64::to_string).collect();
        out += &format!(
            "  {:<width$} {}{}\n",
            format!("{}{name}", "  ".repeat(*depth)),
            fields.join(" "),
            if s.errors > 0 {
                format!("  ({})", plural(s.errors, "error", "errors"))
            } else {
                String::new()
            }
        );
    }
    out += "latency (completion, per request):\n";
    out += &format!(
        "  {:<width$} {:<12} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
        "device", "op", "requests", "mean", "p50", "p90", "p99", "p99.9", "max"
    );
    for (depth, name, s) in &snaps {
        for (i, op) in OP_NAMES.iter().enumerate() {
            let h = &s.latency[i];
            if h.is_empty() {
                continue;
            }
            let mut row = format!(
                "  {:<width$} {:<12} {:>10} {:>9}",
                format!("{}{name}", "  ".repeat(*depth)),
                op,
                h.len(),
                micros(h.mean() as u64)
            );
            for (q, _) in QUANTILES {
                row += &format!(" {:>9}", micros(h.quantile(q)));
            }
            out += &row;
            out += "\n";
        }
    }
    if snaps.iter().any(|(_, _, s)| !s.enabled) {
        out += "statistics are off (--stats off): the counts stay at zero\n";
    }
    out
}

/// `stats --json`: the same, and what `cairn stat` computes its rates from.
pub fn stats_json(view: &View) -> serde_json::Value {
    let now = now_ns();
    let devices: Vec<serde_json::Value> = all_devices(&view.roots())
        .iter()
        .map(|(depth, d)| {
            let s = device_stats(d.name(), now);
            let fields: serde_json::Map<String, serde_json::Value> = DISKSTATS_FIELDS
                .iter()
                .zip(diskstats(&s))
                .map(|(k, v)| (k.to_string(), v.into()))
                .collect();
            let ops: serde_json::Map<String, serde_json::Value> = OP_NAMES
                .iter()
                .enumerate()
                .map(|(i, op)| {
                    let h = &s.latency[i];
                    let mut o = serde_json::json!({
                        "requests": s.ios[i],
                        "bytes": s.sectors[i] * 512,
                        "total_ns": s.ticks_ns[i],
                        "mean_ns": h.mean() as u64,
                    });
                    for (q, name) in QUANTILES {
                        o[format!("{name}_ns")] = h.quantile(q).into();
                    }
                    (op.to_string(), o)
                })
                .collect();
            serde_json::json!({
                "name": d.name(),
                "depth": depth,
                "enabled": s.enabled,
                "diskstats": fields,
                "ops": ops,
                "errors": s.errors,
                "in_flight": s.in_flight,
                "busy_ns": s.busy_ns,
            })
        })
        .collect();
    serde_json::json!({ "monotonic_ns": now, "devices": devices })
}
