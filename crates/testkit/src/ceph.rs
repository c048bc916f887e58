//! A Ceph cluster for the rbd tests: scripts/ceph-cluster starts one (one monitor, one
//! OSD) in a directory of its own, stopped by pid when the test ends, even by a panic.
//!
//! scripts/test.sh starts one for the whole run and names its configuration in
//! $CAIRN_TEST_CEPH_CONF; tests that do not stop daemons use that one (each on images of
//! its own), others and a plain `cargo test` start their own. Without root, the Ceph
//! packages or librbd, the tests record a skip. The cli tests include this file too.
// Each test binary uses some of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use cairn_core::testing::skip;

/// The environment variable naming a running cluster's ceph.conf.
pub const CONF_ENV: &str = "CAIRN_TEST_CEPH_CONF";

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster")
}

/// A running test cluster; the one this test started is stopped when dropped.
pub struct TestCluster {
    /// Where its files are, if this test started it.
    own: Option<tempfile::TempDir>,
    conf: PathBuf,
    /// Prefix of this test's image names.
    prefix: String,
}

/// Whether a test can talk to a cluster here; records the skip if not.
fn can_run(test: &str) -> bool {
    if !rustix::process::geteuid().is_root() {
        skip(test, "needs root (the Ceph daemons)");
        return false;
    }
    if let Err(e) = cairn_leaves::rbd::ffi::api() {
        skip(test, &e.to_string());
        return false;
    }
    let have = Command::new("sh")
        .args([
            "-c",
            "command -v ceph-mon && command -v ceph-osd && command -v ceph && command -v rbd",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    if !have {
        skip(test, "ceph-mon, ceph-osd or ceph-common is not installed");
        return false;
    }
    true
}

impl TestCluster {
    /// The run's cluster if scripts/test.sh started one, else one of this test's own.
    pub fn shared(test: &str) -> Option<TestCluster> {
        if !can_run(test) {
            return None;
        }
        match std::env::var_os(CONF_ENV) {
            Some(conf) if Path::new(&conf).exists() => Some(TestCluster {
                own: None,
                conf: PathBuf::from(conf),
                prefix: prefix(test),
            }),
            _ => Some(TestCluster::start(test)),
        }
    }

    /// A cluster of this test's own (for tests that stop its OSD).
    pub fn own(test: &str) -> Option<TestCluster> {
        can_run(test).then(|| TestCluster::start_with(test, "start"))
    }

    /// A cluster of this test's own with cephx authentication (its keys in
    /// [`TestCluster::dir`]`/keyring`, client.admin's among them).
    pub fn own_cephx(test: &str) -> Option<TestCluster> {
        can_run(test).then(|| TestCluster::start_with(test, "start-cephx"))
    }

    fn start(test: &str) -> TestCluster {
        TestCluster::start_with(test, "start")
    }

    fn start_with(test: &str, how: &str) -> TestCluster {
        let dir = tempfile::tempdir_in("/dev/shm").expect("a directory in /dev/shm");
        let out = Command::new(script())
            .arg(how)
            .arg(dir.path().join("c"))
            .output()
            .expect("run scripts/ceph-cluster");
        let cluster = TestCluster {
            conf: dir.path().join("c/ceph.conf"),
            own: Some(dir),
            prefix: prefix(test),
        };
        assert!(
            out.status.success(),
            "scripts/ceph-cluster start failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        cluster
    }

    /// Its ceph.conf.
    pub fn conf(&self) -> &Path {
        &self.conf
    }

    /// The directory of its files (ceph.conf, keyring, logs).
    pub fn dir(&self) -> &Path {
        self.conf.parent().expect("ceph.conf is in a directory")
    }

    /// An image name of this test's own.
    pub fn name(&self, what: &str) -> String {
        format!("{}-{what}", self.prefix)
    }

    /// Runs the `rbd` tool on this cluster; panics with its stderr if it fails.
    pub fn rbd(&self, args: &[&str]) -> Output {
        run_ok(Command::new("rbd").arg("-c").arg(&self.conf).args(args))
    }

    /// Runs the `ceph` tool on this cluster; its stdout. Panics if it fails.
    pub fn ceph(&self, args: &[&str]) -> String {
        let out = run_ok(Command::new("ceph").arg("-c").arg(&self.conf).args(args));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The bytes of image `rbd/NAME` (NAME from [`TestCluster::name`]), by `rbd export`.
    pub fn export(&self, what: &str) -> Vec<u8> {
        let dir = tempfile::tempdir_in("/dev/shm").expect("a directory in /dev/shm");
        let file = dir.path().join("export.img");
        self.rbd(&[
            "export",
            "--no-progress",
            &format!("rbd/{}", self.name(what)),
            file.to_str().expect("a UTF-8 path"),
        ]);
        std::fs::read(&file).expect("read the export")
    }

    /// Creates image `rbd/NAME` (NAME from [`TestCluster::name`]) of `bytes`; returns the
    /// device spec `rbd:rbd/NAME,conf=...` with `extra` options appended.
    pub fn image(&self, what: &str, bytes: u64, extra: &str) -> String {
        let name = self.name(what);
        self.rbd(&[
            "create",
            "--size",
            &format!("{bytes}B"),
            &format!("rbd/{name}"),
        ]);
        format!("rbd:rbd/{name},conf={}{extra}", self.conf.display())
    }

    /// Stops the OSD (own clusters only).
    pub fn osd_stop(&self) {
        self.script("osd-stop");
    }

    /// Starts the OSD again and waits until it is up (own clusters only).
    pub fn osd_start(&self) {
        self.script("osd-start");
    }

    fn script(&self, cmd: &str) {
        let dir = self
            .own
            .as_ref()
            .expect("only a test's own cluster is stopped and started");
        run_ok(Command::new(script()).arg(cmd).arg(dir.path().join("c")));
    }
}

/// Runs `cmd`; panics with its stderr if it fails.
fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Image names: the test's name and the process id, so tests sharing a cluster (and
/// runs after a crashed one) never meet.
fn prefix(test: &str) -> String {
    let short: String = test
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
        .take(40)
        .collect();
    format!("{short}-{}", std::process::id())
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        match &self.own {
            Some(dir) => {
                let _ = Command::new(script())
                    .arg("stop")
                    .arg(dir.path().join("c"))
                    .output();
            }
            None => {
                // The shared cluster stays: remove this test's images.
                let Ok(out) = Command::new("rbd")
                    .arg("-c")
                    .arg(&self.conf)
                    .args(["ls", "rbd"])
                    .output()
                else {
                    return;
                };
                for name in String::from_utf8_lossy(&out.stdout).lines() {
                    if name.starts_with(&self.prefix) {
                        let _ = Command::new("rbd")
                            .arg("-c")
                            .arg(&self.conf)
                            .args(["snap", "purge", &format!("rbd/{name}")])
                            .output();
                        let _ = Command::new("rbd")
                            .arg("-c")
                            .arg(&self.conf)
                            .args(["rm", "--no-progress", &format!("rbd/{name}")])
                            .output();
                    }
                }
            }
        }
    }
}
