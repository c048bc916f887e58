//! Throttle devices served: requests over the limit wait and are
//! then served, data intact; the admin shows what waited and changes limits live; the
//! metrics count it. No assertion on time: only on what was counted.

use super::*;

/// 64 reads and 64 writes sent at once to a throttle of 100 IOPS, each write read back.
const BURST: &str = r#"
import os
import nbd
h = nbd.NBD()
h.connect_unix(os.environ["CAIRN_SOCK"])
data = {i: os.urandom(4096) for i in range(64)}
cmds = [h.aio_pwrite(data[i], i * 8192) for i in range(64)]
cmds += [h.aio_pread(nbd.Buffer(4096), i * 8192 + 4096) for i in range(64)]
while h.aio_in_flight() > 0:
    h.poll(-1)
for c in cmds:
    assert h.aio_command_completed(c)
for i in range(64):
    assert h.pread(4096, i * 8192) == data[i], i
print("served")
"#;

#[test]
fn a_throttle_delays_what_is_over_its_limit_and_changes_live() {
    const NAME: &str = "throttle::a_throttle_delays_what_is_over_its_limit_and_changes_live";
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let stack = write_stack(
        &dir,
        "[device.m]\ntype = \"mem\"\nsize = \"16M\"\n\
         [device.t]\ntype = \"throttle\"\nbase = \"m\"\niops = 100\ngroup = \"g\"\n\
         [export.t]\ndevice = \"t\"\n",
    );
    let srv = Server::start_in(
        tmpdir(),
        &[
            path_str(&stack),
            "--admin",
            path_str(&ctl),
            "--metrics",
            "tcp:127.0.0.1:0",
        ],
    );
    libnbd_script(&python, BURST, &srv.sock, &[], "served");
    let list = super::observe::json(
        "throttle list --json",
        &super::admin::admin(&ctl, &["throttle", "list", "--json"]),
    );
    let t = &list[0];
    assert_eq!(t["device"], "t", "{list:#}");
    assert_eq!(t["group"], "g", "{list:#}");
    assert_eq!(t["limits"]["iops"]["avg"], 100, "{list:#}");
    // 192 requests (the read-back ones too); a tenth of a second's burst (10) goes at
    // once, the rest of the 128 sent together must wait.
    assert_eq!(t["requests"], 192, "{list:#}");
    assert!(t["delayed"].as_u64().unwrap() >= 100, "{list:#}");
    assert_eq!(t["waiting"], 0, "{list:#}");
    // A live change, and refusals that change nothing.
    let out = super::admin::admin(&ctl, &["throttle", "set", "t", "iops=5000", "bps_read=64M"]);
    let said = success("throttle set", &out);
    assert!(
        said.contains("iops 5000/s") && said.contains("bps_read 64MiB/s"),
        "{said}"
    );
    for (words, why) in [
        (
            vec!["throttle", "set", "t", "iops=10", "iops_max=5"],
            "below",
        ),
        (vec!["throttle", "set", "t", "speed=3"], "unknown key"),
        (vec!["throttle", "set", "t", "iops"], "KEY=VALUE"),
        (
            vec!["throttle", "set", "m", "iops=5"],
            "no throttle device 'm'",
        ),
    ] {
        super::admin::refused(&ctl, &words, why);
    }
    let text = success(
        "throttle list",
        &super::admin::admin(&ctl, &["throttle", "list"]),
    );
    assert!(
        text.contains("t (group g): iops 5000/s, bps_read 64MiB/s"),
        "{text}"
    );
    let metrics = super::observe::scrape(&python, &super::observe::metrics_url(&srv));
    assert!(
        metrics.contains("cairn_throttle_requests_total{device=\"t\"} 192"),
        "{metrics}"
    );
    // 0 takes a limit away, the last one too: the throttle then passes everything.
    let said = success(
        "throttle set",
        &super::admin::admin(&ctl, &["throttle", "set", "t", "iops=0", "bps_read=0"]),
    );
    assert!(said.contains("now no limits"), "{said}");
}

/// 200 reads queued behind a throttle of 1 request a second, 190 or more of them waiting
/// as `throttle list` shows; then a live change releases them: raising the limit, or
/// taking the only one away. Every read completes with its data, which the old limit
/// would have taken over three minutes to allow (the script has two).
const HELD: &str = r#"
import json
import os
import subprocess
import time
import nbd
h = nbd.NBD()
h.connect_unix(os.environ["CAIRN_SOCK"])
cmds = [h.aio_pread(nbd.Buffer(4096), i * 4096) for i in range(200)]
def admin(*words):
    out = subprocess.run([os.environ["CAIRN_BIN"], "admin", os.environ["CAIRN_ADMIN"], *words],
                         check=True, capture_output=True, text=True).stdout
    return out
while True:
    h.poll(0)
    if json.loads(admin("throttle", "list", "--json"))[0]["waiting"] >= 190:
        break
    time.sleep(0.01)
print(admin("throttle", "set", "t", os.environ["CAIRN_CHANGE"]).strip())
while h.aio_in_flight() > 0:
    h.poll(-1)
for c in cmds:
    assert h.aio_command_completed(c)
print("released")
"#;

#[test]
fn a_changed_limit_releases_the_requests_already_waiting() {
    const NAME: &str = "throttle::a_changed_limit_releases_the_requests_already_waiting";
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    for change in ["iops=1000000", "iops=0"] {
        let dir = tmpdir();
        let ctl = dir.path().join("admin.sock");
        let stack = write_stack(
            &dir,
            "[device.m]\ntype = \"mem\"\nsize = \"1M\"\n\
             [device.t]\ntype = \"throttle\"\nbase = \"m\"\niops = 1\n\
             [export.t]\ndevice = \"t\"\n",
        );
        let srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
        let out = libnbd_script(
            &python,
            HELD,
            &srv.sock,
            &[
                ("CAIRN_BIN", env!("CARGO_BIN_EXE_cairn").to_string()),
                ("CAIRN_ADMIN", path_str(&ctl).to_string()),
                ("CAIRN_CHANGE", change.to_string()),
            ],
            "released",
        );
        let want = if change == "iops=0" {
            "now no limits"
        } else {
            "now iops 1000000/s"
        };
        assert!(out.contains(want), "{change}: {out}");
        let list = super::observe::json(
            "throttle list --json",
            &super::admin::admin(&ctl, &["throttle", "list", "--json"]),
        );
        assert_eq!(list[0]["requests"], 200, "{list:#}");
        assert_eq!(list[0]["waiting"], 0, "{list:#}");
    }
}

/// 200 reads wait at a throttle of 1 request a second when the server is told to stop:
/// the stop lifts the limits, the reads finish, and cairn exits 0 (it used to wait them
/// out until its shutdown timeout and exit 1).
const QUEUED: &str = r#"
import json
import os
import subprocess
import time
import nbd
h = nbd.NBD()
h.connect_unix(os.environ["CAIRN_SOCK"])
cmds = [h.aio_pread(nbd.Buffer(4096), i * 4096) for i in range(200)]
def waiting():
    out = subprocess.run([os.environ["CAIRN_BIN"], "admin", os.environ["CAIRN_ADMIN"],
                          "throttle", "list", "--json"], check=True, capture_output=True, text=True).stdout
    return json.loads(out)[0]["waiting"]
while waiting() < 190:
    h.poll(0)
    time.sleep(0.01)
print("queued")
"#;

/// After QUEUED: the client reads its replies as they come (a server stopping must be
/// able to send them), then stays until it is killed.
const DRAIN: &str = r#"
import sys
sys.stdout.flush()
try:
    while h.aio_in_flight() > 0:
        h.poll(-1)
except Exception:
    pass
time.sleep(600)
"#;

#[test]
fn a_stop_lifts_the_limits_for_the_requests_waiting() {
    const NAME: &str = "throttle::a_stop_lifts_the_limits_for_the_requests_waiting";
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let stack = write_stack(
        &dir,
        "[device.m]\ntype = \"mem\"\nsize = \"1M\"\n\
         [device.t]\ntype = \"throttle\"\nbase = \"m\"\niops = 1\n\
         [export.t]\ndevice = \"t\"\n",
    );
    let mut srv = Server::start_in(
        tmpdir(),
        &[
            path_str(&stack),
            "--admin",
            path_str(&ctl),
            "--shutdown-timeout",
            "60s",
        ],
    );
    // The client stays connected (its reads queued) while the server stops.
    let mut client = Command::new(&python)
        .args(["-c", &format!("{QUEUED}{DRAIN}")])
        .env("CAIRN_SOCK", &srv.sock)
        .env("CAIRN_BIN", env!("CARGO_BIN_EXE_cairn"))
        .env("CAIRN_ADMIN", &ctl)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the client");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(client.stdout.take().expect("stdout")),
        &mut line,
    )
    .expect("read the client");
    assert_eq!(line.trim(), "queued");
    let (status, log) = srv.stop();
    let _ = client.kill();
    let _ = client.wait();
    assert!(
        status.success(),
        "cairn serve exited {status:?} with reads waiting at its throttle:\n{log}"
    );
    assert!(log.contains("limits lifted"), "{log}");
}
