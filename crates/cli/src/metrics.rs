//! `--metrics tcp:HOST:PORT|unix:PATH`: Prometheus metrics over HTTP (`GET /metrics`, the
//! text exposition format 0.0.4, encoded by the `prometheus` crate).
//!
//! Every scrape reads the queues' counters as they run (see `cairn_core::stats`): nothing
//! is collected on the I/O path for it, and a scrape never waits for a reactor. The HTTP
//! server has a thread of its own.

use std::sync::Arc;

use prometheus::proto::{
    Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType,
};

use cairn_core::socket::SocketFile;
use cairn_core::{Array, Device, WriteBackCache};
use cairn_nbd::Observer;

use crate::view::{self, all_devices, View, OP_NAMES};

/// Upper bounds of the latency histograms' buckets, in seconds (10 us to 10 s).
const BUCKETS_S: [f64; 19] = [
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The endpoint's socket, bound and not yet answering: [`bind`] comes before any device
/// is opened (an address in use refuses the start before anything is created), [`start`]
/// once the devices are open. Dropping it closes the socket (and removes a `unix:` file).
pub struct Bound {
    listener: tiny_http::Listener,
    /// A `unix:` endpoint's file.
    file: Option<SocketFile>,
    /// Where it listens, as a URL.
    pub url: String,
}

impl Bound {
    /// A `unix:` endpoint's socket file (see [`SocketFile::remover`] for exits that skip
    /// drops).
    pub fn file(&self) -> Option<&SocketFile> {
        self.file.as_ref()
    }
}

/// The running endpoint; dropping it stops its thread.
pub struct Metrics {
    server: Arc<tiny_http::Server>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Where it listens, as a URL.
    pub url: String,
    /// Removed (a `unix:` endpoint's file) once the server is stopped, after `drop`.
    _file: Option<SocketFile>,
}

impl Drop for Metrics {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Binds the endpoint at `spec`: `tcp:HOST:PORT` (port 0 for any) or `unix:PATH`, where
/// a stale socket is replaced and a live one, or anything that is not a socket, is
/// refused and left as it is (see [`cairn_core::socket`]).
pub fn bind(spec: &str) -> Result<Bound, String> {
    let err = |e: &dyn std::fmt::Display| format!("--metrics {spec}: {e}");
    if let Some(addr) = spec.strip_prefix("tcp:") {
        let listener = std::net::TcpListener::bind(addr).map_err(|e| err(&e))?;
        let url = match listener.local_addr() {
            Ok(a) => format!("http://{a}/metrics"),
            Err(_) => format!("http://{addr}/metrics"),
        };
        Ok(Bound {
            listener: listener.into(),
            file: None,
            url,
        })
    } else if let Some(path) = spec.strip_prefix("unix:") {
        if path.is_empty() {
            return Err(err(&"a path is needed after unix:"));
        }
        let (listener, file) =
            cairn_core::socket::bind(std::path::Path::new(path), &format!("--metrics {spec}"))
                .map_err(|e| e.to_string())?;
        Ok(Bound {
            listener: listener.into(),
            file: Some(file),
            url: format!("unix:{path}"),
        })
    } else {
        Err(err(&"expected tcp:HOST:PORT or unix:PATH"))
    }
}

/// Starts serving metrics of `view` on the endpoint `bound`.
pub fn start(bound: Bound, view: Arc<View>) -> Result<Metrics, String> {
    // tiny_http starts threads of its own, which inherit the signal mask of the thread
    // that starts them: they must not take the signals the server waits for (SIGTERM's
    // default would kill it). So it is started from a short-lived thread that blocks
    // signals as the reactors do; the caller's mask is left as it is.
    std::thread::Builder::new()
        .name("cairn-metrics".into())
        .spawn(move || {
            cairn_core::reactor::block_signals_in_this_thread();
            start_masked(bound, view)
        })
        .map_err(|e| format!("--metrics: {e}"))?
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

fn start_masked(bound: Bound, view: Arc<View>) -> Result<Metrics, String> {
    let Bound {
        listener,
        file,
        url,
    } = bound;
    let err = |e: &dyn std::fmt::Display| format!("--metrics: {e}");
    let server = tiny_http::Server::from_listener(listener, None).map_err(|e| err(&e))?;
    let server = Arc::new(server);
    let s = server.clone();
    let thread = std::thread::Builder::new()
        .name("cairn-metrics".into())
        .spawn(move || {
            for request in s.incoming_requests() {
                let (code, body, kind) = match (request.method(), request.url()) {
                    (tiny_http::Method::Get, "/metrics") => (
                        200,
                        render(&view),
                        "text/plain; version=0.0.4; charset=utf-8",
                    ),
                    (tiny_http::Method::Get, "/") => (
                        200,
                        "cairn: metrics are at /metrics\n".to_string(),
                        "text/plain; charset=utf-8",
                    ),
                    _ => (
                        404,
                        "not found: GET /metrics\n".to_string(),
                        "text/plain; charset=utf-8",
                    ),
                };
                let header = tiny_http::Header::from_bytes(&b"Content-Type"[..], kind.as_bytes())
                    .expect("a valid header");
                let _ = request.respond(
                    tiny_http::Response::from_string(body)
                        .with_status_code(code)
                        .with_header(header),
                );
            }
        })
        .map_err(|e| err(&e))?;
    Ok(Metrics {
        server,
        thread: Some(thread),
        url,
        _file: file,
    })
}

fn label(name: &str, value: &str) -> LabelPair {
    let mut l = LabelPair::default();
    l.set_name(name.to_string());
    l.set_value(value.to_string());
    l
}

fn family(name: &str, help: &str, kind: MetricType) -> MetricFamily {
    let mut f = MetricFamily::default();
    f.set_name(name.to_string());
    f.set_help(help.to_string());
    f.set_field_type(kind);
    f
}

fn counter(labels: &[(&str, &str)], v: f64) -> Metric {
    let mut m = Metric::default();
    m.set_label(labels.iter().map(|(n, v)| label(n, v)).collect());
    let mut c = Counter::default();
    c.set_value(v);
    m.set_counter(c);
    m
}

fn gauge(labels: &[(&str, &str)], v: f64) -> Metric {
    let mut m = Metric::default();
    m.set_label(labels.iter().map(|(n, v)| label(n, v)).collect());
    let mut g = Gauge::default();
    g.set_value(v);
    m.set_gauge(g);
    m
}

/// The families of one scrape.
fn families(view: &View) -> Vec<MetricFamily> {
    let all = all_devices(&view.roots());
    let mut out = io_families(&all);
    out.extend(cache_families(&all));
    out.extend(array_families(&all));
    out.extend(thin_families(&view.roots()));
    out.extend(checkpoint_families(&view.roots()));
    out.extend(bitmap_families(&view.roots()));
    out.extend(throttle_families(&view.roots()));
    out.extend(crypt_families(&view.roots()));
    if let Some(o) = view.observer() {
        out.extend(nbd_families(view, o));
    }
    out.retain(|f| !f.get_metric().is_empty());
    out
}

/// Every device's requests, bytes, errors and latencies per operation, in flight, busy
/// time and size.
fn io_families(all: &[(usize, Arc<dyn Device>)]) -> Vec<MetricFamily> {
    let now = view::now_ns();
    let mut requests = family(
        "cairn_device_requests_total",
        "Requests completed without error, per device and operation.",
        MetricType::COUNTER,
    );
    let mut bytes = family(
        "cairn_device_bytes_total",
        "Bytes transferred (or discarded, or zeroed) by completed requests.",
        MetricType::COUNTER,
    );
    let mut errors = family(
        "cairn_device_errors_total",
        "Requests that completed with an error.",
        MetricType::COUNTER,
    );
    let mut latency = family(
        "cairn_device_request_duration_seconds",
        "Completion latency of requests (errors included); bucket bounds within 3%.",
        MetricType::HISTOGRAM,
    );
    let mut in_flight = family(
        "cairn_device_in_flight_requests",
        "Requests in flight now.",
        MetricType::GAUGE,
    );
    let mut busy = family(
        "cairn_device_busy_seconds_total",
        "Time with at least one request in flight (the largest over the device's queues).",
        MetricType::COUNTER,
    );
    let mut size = family(
        "cairn_device_size_bytes",
        "Size of the device.",
        MetricType::GAUGE,
    );
    let bounds_ns: Vec<u64> = BUCKETS_S.iter().map(|s| (s * 1e9) as u64).collect();
    for (_, d) in all {
        let name = d.name();
        let s = view::device_stats(name, now);
        for (i, op) in OP_NAMES.iter().enumerate() {
            let l = [("device", name), ("op", op)];
            requests.mut_metric().push(counter(&l, s.ios[i] as f64));
            bytes
                .mut_metric()
                .push(counter(&l, (s.sectors[i] * 512) as f64));
            latency
                .mut_metric()
                .push(histogram(&l, &s.latency[i], s.ticks_ns[i], &bounds_ns));
        }
        let l = [("device", name)];
        errors.mut_metric().push(counter(&l, s.errors as f64));
        in_flight.mut_metric().push(gauge(&l, s.in_flight as f64));
        busy.mut_metric().push(counter(&l, s.busy_ns as f64 / 1e9));
        size.mut_metric()
            .push(gauge(&l, d.geometry().size_bytes as f64));
    }
    vec![requests, bytes, errors, latency, in_flight, busy, size]
}

/// One latency histogram: `h`'s counts under each of [`BUCKETS_S`] (`bounds_ns`), and
/// the sum of the latencies, `ticks_ns`.
fn histogram(
    labels: &[(&str, &str)],
    h: &cairn_core::stats::LatencyHistogram,
    ticks_ns: u64,
    bounds_ns: &[u64],
) -> Metric {
    let mut m = Metric::default();
    m.set_label(labels.iter().map(|(n, v)| label(n, v)).collect());
    let mut hist = Histogram::default();
    hist.set_sample_count(h.len());
    hist.set_sample_sum(ticks_ns as f64 / 1e9);
    let buckets: Vec<Bucket> = BUCKETS_S
        .iter()
        .zip(h.cumulative(bounds_ns))
        .map(|(&le, n)| {
            let mut b = Bucket::default();
            b.set_upper_bound(le);
            b.set_cumulative_count(n);
            b
        })
        .collect();
    hist.set_bucket(buckets);
    m.set_histogram(hist);
    m
}

/// Write-back caches: bytes dirty, bytes written back.
fn cache_families(all: &[(usize, Arc<dyn Device>)]) -> Vec<MetricFamily> {
    let mut dirty = family(
        "cairn_cache_dirty_bytes",
        "Bytes a write-back cache holds that its base does not have yet.",
        MetricType::GAUGE,
    );
    let mut written_back = family(
        "cairn_cache_written_back_bytes_total",
        "Bytes a write-back cache wrote to its base.",
        MetricType::COUNTER,
    );
    for (_, d) in all {
        let l = [("device", d.name())];
        if let Some(c) = d.capability::<dyn WriteBackCache>() {
            let c = c.counters();
            dirty.mut_metric().push(gauge(&l, c.dirty_bytes as f64));
            written_back
                .mut_metric()
                .push(counter(&l, c.written_bytes as f64));
        }
    }
    vec![dirty, written_back]
}

/// Mirrors and raid10s: degraded, failed members, a rebuild's progress, read repairs.
fn array_families(all: &[(usize, Arc<dyn Device>)]) -> Vec<MetricFamily> {
    let mut degraded = family(
        "cairn_array_degraded",
        "1 if a mirror or raid10 runs with a failed or missing member.",
        MetricType::GAUGE,
    );
    let mut failed = family(
        "cairn_array_failed_members",
        "Members of a mirror or raid10 that failed or are missing.",
        MetricType::GAUGE,
    );
    let mut sync_done = family(
        "cairn_array_sync_done_bytes",
        "While a rebuild or resync runs: bytes it visited.",
        MetricType::GAUGE,
    );
    let mut sync_total = family(
        "cairn_array_sync_total_bytes",
        "While a rebuild or resync runs: bytes it has to visit.",
        MetricType::GAUGE,
    );
    let mut syncing = family(
        "cairn_array_sync_running",
        "1 while a rebuild or resync runs.",
        MetricType::GAUGE,
    );
    let mut repaired = family(
        "cairn_array_read_repairs_total",
        "Ranges of a mirror or raid10 rewritten on a copy that failed a read (read repair).",
        MetricType::COUNTER,
    );
    let mut repaired_bytes = family(
        "cairn_array_read_repair_bytes_total",
        "Bytes rewritten by read repair.",
        MetricType::COUNTER,
    );
    let mut repair_failed = family(
        "cairn_array_read_repair_failures_total",
        "Read repair rewrites that failed (each failed its member).",
        MetricType::COUNTER,
    );
    for (_, d) in all {
        let name = d.name();
        let l = [("device", name)];
        let Some(array) = d.capability::<dyn Array>().filter(|a| a.redundant()) else {
            continue;
        };
        let f = array.failed_members().len();
        degraded
            .mut_metric()
            .push(gauge(&l, if f > 0 { 1.0 } else { 0.0 }));
        failed.mut_metric().push(gauge(&l, f as f64));
        let p = array.sync_progress();
        syncing
            .mut_metric()
            .push(gauge(&l, if p.is_some() { 1.0 } else { 0.0 }));
        if let Some((done, total)) = p {
            sync_done.mut_metric().push(gauge(&l, done as f64));
            sync_total.mut_metric().push(gauge(&l, total as f64));
        }
        if let Some(r) = cairn_core::stats::registry().repairs(name) {
            repaired.mut_metric().push(counter(&l, r.repaired as f64));
            repaired_bytes
                .mut_metric()
                .push(counter(&l, r.repaired_bytes as f64));
            repair_failed
                .mut_metric()
                .push(counter(&l, r.failed as f64));
        }
    }
    vec![
        degraded,
        failed,
        syncing,
        sync_done,
        sync_total,
        repaired,
        repaired_bytes,
        repair_failed,
    ]
}

/// The NBD server: connections per export, handshakes, error replies, buffer memory.
fn nbd_families(view: &View, o: &Observer) -> Vec<MetricFamily> {
    let mut out = Vec::new();
    let conns = o.connections();
    let mut open = family(
        "cairn_nbd_connections",
        "NBD connections open now, per export.",
        MetricType::GAUGE,
    );
    for e in view.exports() {
        let n = conns.iter().filter(|c| c.export == e.name).count();
        open.mut_metric()
            .push(gauge(&[("export", &e.name)], n as f64));
    }
    let mut accepted = family(
        "cairn_nbd_connections_accepted_total",
        "NBD connections that finished the handshake since the start.",
        MetricType::COUNTER,
    );
    accepted
        .mut_metric()
        .push(counter(&[], o.accepted() as f64));
    let mut replies = family(
        "cairn_nbd_error_replies_total",
        "NBD replies that carried an error, per errno.",
        MetricType::COUNTER,
    );
    for (errno, n) in o.errors() {
        replies
            .mut_metric()
            .push(counter(&[("errno", errno)], n as f64));
    }
    out.extend([open, accepted, replies]);
    if let Some((used, limit, waits)) = o.memory() {
        let mut memory = family(
            "cairn_nbd_buffer_bytes",
            "Request and reply buffer memory charged to the server's budget now.",
            MetricType::GAUGE,
        );
        memory.mut_metric().push(gauge(&[], used as f64));
        let mut budget = family(
            "cairn_nbd_buffer_budget_bytes",
            "The server's budget for request and reply buffers (--memory-budget).",
            MetricType::GAUGE,
        );
        budget.mut_metric().push(gauge(&[], limit as f64));
        let mut waited = family(
            "cairn_nbd_buffer_waits_total",
            "Times a connection waited for buffer memory (backpressure).",
            MetricType::COUNTER,
        );
        waited.mut_metric().push(counter(&[], waits as f64));
        out.extend([memory, budget, waited]);
    }
    out
}

/// Thin pools: data and metadata use, and each volume's mapped bytes.
fn thin_families(roots: &[Arc<dyn cairn_core::Device>]) -> Vec<MetricFamily> {
    let mut data = family(
        "cairn_thin_pool_data_bytes",
        "A thin pool's data space, and the part in use (state=\"used\").",
        MetricType::GAUGE,
    );
    let mut meta = family(
        "cairn_thin_pool_metadata_bytes",
        "A thin pool's metadata: checkpoint capacity and log size (state=\"total\"), the last checkpoint and the log since (state=\"used\").",
        MetricType::GAUGE,
    );
    let mut mapped = family(
        "cairn_thin_volume_mapped_bytes",
        "Bytes a thin volume (or snapshot, or clone) maps.",
        MetricType::GAUGE,
    );
    let mut vsize = family(
        "cairn_thin_volume_size_bytes",
        "A thin volume's virtual size.",
        MetricType::GAUGE,
    );
    for (_, pool) in crate::admin::pools(roots) {
        let r = pool.report();
        let total = (r.data_blocks * r.block_bytes) as f64;
        let used = (r.used_blocks * r.block_bytes) as f64;
        data.mut_metric()
            .push(gauge(&[("pool", &r.name), ("state", "total")], total));
        data.mut_metric()
            .push(gauge(&[("pool", &r.name), ("state", "used")], used));
        let mtotal = (r.checkpoint_capacity + r.log_bytes / 2) as f64;
        let mused = (r.checkpoint_bytes + r.log_used) as f64;
        meta.mut_metric()
            .push(gauge(&[("pool", &r.name), ("state", "total")], mtotal));
        meta.mut_metric()
            .push(gauge(&[("pool", &r.name), ("state", "used")], mused));
        for (name, size, m, _, _) in &r.volumes {
            let l = [("pool", r.name.as_str()), ("volume", name.as_str())];
            mapped.mut_metric().push(gauge(&l, *m as f64));
            vsize.mut_metric().push(gauge(&l, *size as f64));
        }
    }
    vec![data, meta, mapped, vsize]
}

/// Thin volumes' backup checkpoints: each that exists, and what a deleted snapshot's
/// changes keep.
fn checkpoint_families(roots: &[Arc<dyn cairn_core::Device>]) -> Vec<MetricFamily> {
    let mut info = family(
        "cairn_thin_checkpoint_info",
        "A backup checkpoint of a thin volume: 1 while it exists (snapshot=\"false\" once its snapshot is deleted and its changes kept).",
        MetricType::GAUGE,
    );
    let mut kept = family(
        "cairn_thin_checkpoint_kept_bytes",
        "Bytes a checkpoint whose snapshot is deleted keeps as changed up to the next checkpoint.",
        MetricType::GAUGE,
    );
    for (_, pool) in crate::admin::pools(roots) {
        let name = pool.report().name;
        for c in pool.checkpoints() {
            let l = [
                ("pool", name.as_str()),
                ("volume", c.volume.as_str()),
                ("checkpoint", c.name.as_str()),
            ];
            let snapshot = if c.snapshot { "true" } else { "false" };
            let labelled = [l[0], l[1], l[2], ("snapshot", snapshot)];
            info.mut_metric().push(gauge(&labelled, 1.0));
            if let Some((_, bytes)) = &c.kept {
                kept.mut_metric().push(gauge(&l, *bytes as f64));
            }
        }
    }
    vec![info, kept]
}

/// Dirty bitmaps: what each covers, and whether it may miss changes.
fn bitmap_families(roots: &[Arc<dyn cairn_core::Device>]) -> Vec<MetricFamily> {
    let mut dirty = family(
        "cairn_bitmap_dirty_bytes",
        "Bytes a dirty bitmap marks as changed since it started (what an incremental backup from it reads).",
        MetricType::GAUGE,
    );
    let mut bad = family(
        "cairn_bitmap_inconsistent",
        "1 when a dirty bitmap may miss changes (an incremental backup must not trust it).",
        MetricType::GAUGE,
    );
    for (device, list) in crate::bitmaps::served(roots) {
        for b in list {
            let l = [("device", device.as_str()), ("bitmap", b.name.as_str())];
            dirty.mut_metric().push(gauge(&l, b.dirty_bytes as f64));
            bad.mut_metric()
                .push(gauge(&l, if b.inconsistent { 1.0 } else { 0.0 }));
        }
    }
    vec![dirty, bad]
}

/// Throttle devices: what they let through, delayed, and hold now.
fn throttle_families(roots: &[Arc<dyn cairn_core::Device>]) -> Vec<MetricFamily> {
    let mut requests = family(
        "cairn_throttle_requests_total",
        "Requests a throttle device let through (flushes not counted).",
        MetricType::COUNTER,
    );
    let mut bytes = family(
        "cairn_throttle_bytes_total",
        "Bytes of the requests a throttle device let through.",
        MetricType::COUNTER,
    );
    let mut delayed = family(
        "cairn_throttle_delayed_total",
        "Requests a throttle device made wait for its limits.",
        MetricType::COUNTER,
    );
    let mut waiting = family(
        "cairn_throttle_waiting_requests",
        "Requests waiting at a throttle device now.",
        MetricType::GAUGE,
    );
    for (name, throttle) in crate::throttle::throttles(roots) {
        let c = throttle.counts();
        let l = [("device", name.as_str())];
        requests.mut_metric().push(counter(&l, c.requests as f64));
        bytes.mut_metric().push(counter(&l, c.bytes as f64));
        delayed.mut_metric().push(counter(&l, c.delayed as f64));
        waiting.mut_metric().push(gauge(&l, c.waiting as f64));
    }
    vec![requests, bytes, delayed, waiting]
}

/// Crypt devices: what they enciphered and deciphered, the cipher's time, key slots.
fn crypt_families(roots: &[Arc<dyn cairn_core::Device>]) -> Vec<MetricFamily> {
    let mut requests = family(
        "cairn_crypt_requests_total",
        "Requests whose data a crypt device encrypted (writes, write-zeroes, discards) or decrypted (reads).",
        MetricType::COUNTER,
    );
    let mut bytes = family(
        "cairn_crypt_bytes_total",
        "Bytes a crypt device encrypted or decrypted.",
        MetricType::COUNTER,
    );
    let mut cipher = family(
        "cairn_crypt_cipher_seconds_total",
        "Time a crypt device's reactors spent in the cipher, estimated (one cipher call in 64 timed).",
        MetricType::COUNTER,
    );
    let mut slots = family(
        "cairn_crypt_key_slots",
        "Key slots in use in a crypt device's header.",
        MetricType::GAUGE,
    );
    let mut events = family(
        "cairn_crypt_key_slot_events_total",
        "Key slots opened (with a passphrase, at the start), added and removed.",
        MetricType::COUNTER,
    );
    for (name, c, in_use) in crate::crypt::counted(roots) {
        let name = name.as_str();
        for (dir, r, b) in [
            ("encrypt", c.encrypted_requests, c.encrypted_bytes),
            ("decrypt", c.decrypted_requests, c.decrypted_bytes),
        ] {
            let l = [("device", name), ("direction", dir)];
            requests.mut_metric().push(counter(&l, r as f64));
            bytes.mut_metric().push(counter(&l, b as f64));
        }
        let l = [("device", name)];
        cipher
            .mut_metric()
            .push(counter(&l, c.cipher_ns as f64 / 1e9));
        slots.mut_metric().push(gauge(&l, in_use as f64));
        for (event, n) in [
            ("opened", c.key_slot_opens),
            ("added", c.key_slots_added),
            ("removed", c.key_slots_removed),
        ] {
            let l = [("device", name), ("event", event)];
            events.mut_metric().push(counter(&l, n as f64));
        }
    }
    vec![requests, bytes, cipher, slots, events]
}

/// One scrape's text.
pub fn render(view: &View) -> String {
    use prometheus::Encoder;
    let mut buf = Vec::new();
    match prometheus::TextEncoder::new().encode(&families(view), &mut buf) {
        Ok(()) => String::from_utf8_lossy(&buf).into_owned(),
        Err(e) => format!("# cairn: cannot encode the metrics: {e}\n"),
    }
}
