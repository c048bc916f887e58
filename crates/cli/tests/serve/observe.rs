use super::admin::admin;
use super::*;

/// A client that does a fixed job, prints `done`, and stays connected until its stdin
/// closes. Its job, by letter: A writes 10 x 4 KiB at 0, flushes, reads 3 x 8 KiB and
/// sends one read past the end (strict mode off: the server answers EINVAL); B writes
/// 5 x 64 KiB at 1 MiB, flushes, reads 2 x 4 KiB; C writes 7 x 4 KiB at 4 MiB and
/// leaves at once.
const CLIENT: &str = r#"
import os, sys
import nbd
h = nbd.NBD()
h.set_strict_mode(0)
h.connect_uri(os.environ["CAIRN_URI"])
job = sys.argv[1]
if job == "A":
    for i in range(10):
        h.pwrite(bytes([i + 1]) * 4096, i * 4096)
    h.flush()
    for i in range(3):
        assert h.pread(8192, i * 8192) == bytes([2 * i + 1]) * 4096 + bytes([2 * i + 2]) * 4096
    try:
        h.pread(4096, h.get_size())
        sys.exit("a read past the end succeeded")
    except nbd.Error as e:
        assert e.errnum == 22, e
elif job == "B":
    for i in range(5):
        h.pwrite(bytes([100 + i]) * 65536, (1 << 20) + i * 65536)
    h.flush()
    for i in range(2):
        assert h.pread(4096, (1 << 20) + i * 65536) == bytes([100 + i]) * 4096
else:
    for i in range(7):
        h.pwrite(bytes([200 + i]) * 4096, (4 << 20) + i * 4096)
    h.flush()
print("done", flush=True)
if job != "C":
    sys.stdin.readline()
h.shutdown()
"#;

fn client(py: &Path, srv: &Server, job: &str) -> std::process::Child {
    Command::new(py)
        .args(["-c", CLIENT, job])
        .env("CAIRN_URI", srv.uri_for("disk"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start a python client")
}

/// Waits for a client's `done`.
fn done(c: &mut std::process::Child) {
    let mut line = String::new();
    BufReader::new(c.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "done", "the client failed");
}

pub(super) fn json(what: &str, out: &Output) -> Value {
    let text = success(what, out);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{what}: {e}: {text}"))
}

/// A sample of a Prometheus scrape, by its full name with labels; 0 when absent.
fn sample(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// The metrics URL a server started with `--metrics tcp:127.0.0.1:0` logged.
pub(super) fn metrics_url(srv: &Server) -> String {
    let log = srv.stderr();
    log.split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no metrics URL in the log:\n{log}"))
        .to_string()
}

pub(super) fn scrape(py: &Path, url: &str) -> String {
    let out = run(Command::new(py).args([
            "-c",
            "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())",
            url,
        ]));
    success("scrape", &out)
}

/// Two clients on a cache over a raid10: `status --json` shows each connection with
/// the requests and bytes it sent, `stats --json` the devices' counts (the cache's
/// are the clients' sum, the members got both copies of what was written back), the
/// text forms say the same, `cairn stat` prints its lines, and two metrics scrapes
/// around a third client differ by what it did. The raid10 is raw (`metadata =
/// "none"`), so that its members write only the clients' data: superblock and bitmap
/// writes would add to their counts, as many as the timing makes.
#[test]
fn status_stats_stat_and_metrics_count_what_the_clients_did() {
    let Some(py) = python_with_libnbd("status_stats_stat_and_metrics") else {
        return;
    };
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let mut t = String::new();
    for m in ["m0", "m1", "m2", "m3"] {
        t += &format!("[device.{m}]\ntype = \"mem\"\nsize = \"16M\"\n");
    }
    t += "[device.r]\ntype = \"raid10\"\nmembers = [\"m0\", \"m1\", \"m2\", \"m3\"]\nmetadata = \"none\"\n\
              [device.c]\ntype = \"cache\"\nbase = \"r\"\nmemory = \"8M\"\n\
              [export.disk]\ndevice = \"c\"\n";
    let stack = write_stack(&dir, &t);
    let srv = Server::start_in(
        dir,
        &[
            path_str(&stack),
            "--admin",
            path_str(&ctl),
            "--metrics",
            "tcp:127.0.0.1:0",
        ],
    );
    let url = metrics_url(&srv);
    let (mut a, mut b) = (client(&py, &srv, "A"), client(&py, &srv, "B"));
    done(&mut a);
    done(&mut b);

    // Connections: each one's own figures.
    let status = json("status --json", &admin(&ctl, &["status", "--json"]));
    let export = &status["exports"][0];
    assert_eq!(export["name"], "disk", "{status:#}");
    let conns = export["connections"].as_array().unwrap();
    assert_eq!(conns.len(), 2, "{status:#}");
    let by_writes = |n: u64| {
        conns
            .iter()
            .find(|c| c["writes"] == n)
            .unwrap_or_else(|| panic!("no connection with {n} writes: {status:#}"))
    };
    let (ca, cb) = (by_writes(10), by_writes(5));
    for (c, want) in [
        (ca, [15, 10, 40960, 4, 3 * 8192 + 4096, 1, 1]),
        (cb, [8, 5, 5 * 65536, 2, 8192, 1, 0]),
    ] {
        let got: Vec<u64> = [
            "requests",
            "writes",
            "written_bytes",
            "reads",
            "read_bytes",
            "flushes",
            "errors",
        ]
        .iter()
        .map(|k| c[*k].as_u64().unwrap())
        .collect();
        assert_eq!(got, want, "{c:#}");
        // Unix socket clients by who they are (SO_PEERCRED).
        let uid = {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata("/proc/self").expect("/proc/self").uid()
        };
        let peer = c["peer"].as_str().unwrap_or("");
        assert!(
            peer.starts_with(&format!("unix (uid {uid}, pid ")) && peer.ends_with(')'),
            "{c:#}"
        );
        assert!(c["since"].as_str().unwrap().ends_with('Z'), "{c:#}");
        // Answered and waiting: idle, and holding at most kept buffers.
        assert!(c["idle_seconds"].as_f64().is_some(), "{c:#}");
        assert!(c["held_bytes"].as_u64().is_some(), "{c:#}");
    }
    assert_eq!(status["error_replies"]["EINVAL"], 1, "{status:#}");
    let budget = &status["memory"];
    assert!(budget["budget_bytes"].as_u64().unwrap() > 0, "{status:#}");
    assert!(budget["used_bytes"].as_u64().is_some(), "{status:#}");
    let text = success("status", &admin(&ctl, &["status"]));
    assert!(text.contains("'disk' (c): 2 connections"), "{text}");
    assert!(
        text.contains("), idle ") && text.contains(", holding "),
        "{text}"
    );
    assert!(text.contains("buffer memory: "), "{text}");
    assert!(
        text.contains("10 writes (40KiB)") && text.contains("5 writes (320KiB)"),
        "{text}"
    );

    // Device statistics: the cache saw what the clients sent (the read past the end
    // never reached it); both flushes wrote everything back, two copies of each byte.
    let stats = json("stats --json", &admin(&ctl, &["stats", "--json"]));
    let dev = |name: &str| {
        stats["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == name)
            .unwrap_or_else(|| panic!("no device {name}: {stats:#}"))
            .clone()
    };
    let c = dev("c");
    let written = 40960 + 5 * 65536;
    assert_eq!(c["ops"]["write"]["requests"], 15, "{c:#}");
    assert_eq!(c["ops"]["write"]["bytes"], written, "{c:#}");
    assert_eq!(c["ops"]["read"]["requests"], 5, "{c:#}");
    assert_eq!(c["ops"]["read"]["bytes"], 3 * 8192 + 2 * 4096, "{c:#}");
    assert_eq!(c["ops"]["flush"]["requests"], 2, "{c:#}");
    assert_eq!(c["diskstats"]["writes_completed"], 15, "{c:#}");
    assert_eq!(c["diskstats"]["sectors_written"], written / 512, "{c:#}");
    assert_eq!(c["depth"], 0);
    let members: u64 = ["m0", "m1", "m2", "m3"]
        .iter()
        .map(|m| dev(m)["ops"]["write"]["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(members, 2 * written, "{stats:#}");
    assert_eq!(dev("m2")["depth"], 2);
    let text = success("stats", &admin(&ctl, &["stats"]));
    assert!(
        text.contains("diskstats") && text.contains("latency"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.trim_start().starts_with("c ") && l.split_whitespace().nth(5) == Some("15")),
        "{text}"
    );

    // `cairn stat`, piped: a header, then a line per device per report.
    let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args([
        "stat",
        path_str(&ctl),
        "100ms",
        "--count",
        "2",
    ]));
    let text = success("cairn stat", &out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1 + 2 * 6, "{text}");
    assert!(
        lines[0].contains("r/s") && lines[0].contains("%util"),
        "{text}"
    );
    for l in &lines[1..] {
        assert_eq!(l.split_whitespace().count(), 10, "{l}");
    }
    let bad = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args(["stat", path_str(&ctl), "1ms"]));
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    assert!(text_of(&bad.stderr).contains("INTERVAL"), "{bad:?}");

    // Metrics: a third client's work is the difference between two scrapes.
    let before = scrape(&py, &url);
    let mut c3 = client(&py, &srv, "C");
    done(&mut c3);
    assert!(c3.wait().unwrap().success());
    let after = scrape(&py, &url);
    let writes = r#"cairn_device_requests_total{device="c",op="write"}"#;
    let bytes = r#"cairn_device_bytes_total{device="c",op="write"}"#;
    assert_eq!(sample(&before, writes), 15.0, "{before}");
    assert_eq!(
        sample(&after, writes) - sample(&before, writes),
        7.0,
        "{after}"
    );
    assert_eq!(
        sample(&after, bytes) - sample(&before, bytes),
        28672.0,
        "{after}"
    );
    let accepted = "cairn_nbd_connections_accepted_total";
    assert_eq!(sample(&after, accepted) - sample(&before, accepted), 1.0);
    assert_eq!(
        sample(&before, r#"cairn_nbd_connections{export="disk"}"#),
        2.0
    );
    assert_eq!(
        sample(&after, r#"cairn_nbd_error_replies_total{errno="EINVAL"}"#),
        1.0
    );
    assert_eq!(sample(&after, r#"cairn_array_degraded{device="r"}"#), 0.0);
    assert!(
        after.contains("\ncairn_array_read_repairs_total{device=\"r\"} 0\n"),
        "{after}"
    );
    assert!(
        sample(&after, "cairn_nbd_buffer_budget_bytes") > 0.0,
        "{after}"
    );
    let count = r#"cairn_device_request_duration_seconds_count{device="c",op="write"}"#;
    let inf = r#"cairn_device_request_duration_seconds_bucket{device="c",op="write",le="+Inf"}"#;
    assert_eq!(sample(&after, count), 22.0, "{after}");
    assert_eq!(sample(&after, inf), 22.0, "{after}");
    if let Some(promtool) = tool("promtool") {
        let mut p = Command::new(promtool)
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        p.stdin.take().unwrap().write_all(after.as_bytes()).unwrap();
        let out = p.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "promtool check metrics: {}{}",
            text_of(&out.stdout),
            text_of(&out.stderr)
        );
    } else {
        skip(
            "status_stats_stat_and_metrics (promtool part)",
            "no promtool (Debian: prometheus)",
        );
    }

    for mut c in [a, b] {
        drop(c.stdin.take());
        assert!(c.wait().unwrap().success());
    }
    assert!(srv.wait_for_stderr("disconnected from export 'disk'", Duration::from_secs(10)));
}

/// With NOTIFY_SOCKET set (systemd's Type=notify), cairn sends READY=1 with a STATUS
/// once it listens, and STOPPING=1 when a signal stops it.
#[test]
fn notify_socket_gets_ready_and_stopping() {
    use std::os::unix::net::UnixDatagram;
    let dir = tmpdir();
    let notify = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&notify).unwrap();
    sock.set_read_timeout(Some(READY_TIMEOUT)).unwrap();
    let nbd = dir.path().join("nbd.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(["serve", "--device", "mem:16M", "--listen"])
        .arg(format!("unix:{}", nbd.display()))
        .env("NOTIFY_SOCKET", &notify)
        .env_remove("LISTEN_FDS")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 4096];
    let n = sock.recv(&mut buf).expect("a READY notification");
    let ready = text_of(&buf[..n]);
    assert!(ready.lines().any(|l| l == "READY=1"), "{ready}");
    assert!(
        ready.contains("STATUS=serving 1 export(s) on unix:"),
        "{ready}"
    );
    // It listens by then.
    assert!(std::os::unix::net::UnixStream::connect(&nbd).is_ok());
    // SAFETY: signals our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let n = sock.recv(&mut buf).expect("a STOPPING notification");
    let stopping = text_of(&buf[..n]);
    assert!(stopping.lines().any(|l| l == "STOPPING=1"), "{stopping}");
    assert!(stopping.contains("STATUS=stopping (SIGTERM)"), "{stopping}");
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text_of(&out.stderr));
}

/// A cache writing back under a write load shows its write-back rate in `status`
/// (text and JSON), and its base's statistics count the bytes written back.
#[test]
fn status_shows_a_caches_write_back_rate() {
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let stack = write_stack(
        &dir,
        "[device.m]\ntype = \"mem\"\nsize = \"64M\"\n\
             [device.slow]\ntype = \"delay\"\nbase = \"m\"\nbandwidth = \"20M\"\n\
             [device.c]\ntype = \"cache\"\nbase = \"slow\"\nmemory = \"4M\"\n",
    );
    let mut bench = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args([
            "bench",
            path_str(&stack),
            "--device",
            "c",
            "--rw",
            "randwrite",
        ])
        .args([
            "--runtime",
            "20s",
            "--time_based",
            "--admin",
            path_str(&ctl),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Written back at 20 MB/s, so a rate shows once a second of it has passed.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut seen = Value::Null;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(300));
        let out = admin(&ctl, &["status", "--json"]);
        if !out.status.success() {
            continue;
        }
        seen = serde_json::from_slice(&out.stdout).unwrap();
        if seen["devices"][0]["writeback_bytes_per_s"].as_u64() > Some(0) {
            break;
        }
    }
    let c = &seen["devices"][0];
    assert_eq!(c["name"], "c", "{seen:#}");
    let rate = c["writeback_bytes_per_s"].as_u64().unwrap_or(0);
    assert!(rate > 0 && rate < 100_000_000, "{seen:#}");
    let text = success("status", &admin(&ctl, &["status"]));
    assert!(
        text.contains("written back (") && text.contains("/s now)"),
        "{text}"
    );
    let stats = json("stats --json", &admin(&ctl, &["stats", "--json"]));
    let slow = stats["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "slow")
        .unwrap()
        .clone();
    assert!(
        slow["ops"]["write"]["bytes"].as_u64() > Some(0),
        "{stats:#}"
    );
    // SAFETY: signals our own child; the bench ends with its report.
    unsafe { libc::kill(bench.id() as libc::pid_t, libc::SIGINT) };
    assert!(bench.wait().unwrap().code().is_some());
}

fn text_of(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}
