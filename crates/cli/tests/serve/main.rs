//! Integration tests for `cairn serve` with real NBD clients: nbdinfo, nbdcopy, qemu-img,
//! qemu-io, fio's nbd engine, libnbd from Python with its safety checks off, a raw socket
//! that speaks the protocol by hand (and breaks it on purpose), and, as root, ext4 on a
//! RAID10 export through nbdfuse and a loop device.
//!
//! Every test starts its own server on a Unix socket in a temporary directory (one test
//! uses TCP on port 0) and stops it with SIGTERM. Sizes are small; nothing asserts on
//! timing beyond generous upper bounds on things that must eventually happen.
//!
//! A test whose tool is missing does not pass silently: it writes `SKIP <test>: <reason>`
//! to stderr and appends it to the file named by `CAIRN_SKIP_LOG` (scripts/test.sh counts
//! those lines), then returns.
//!
//! This file holds what the tests share (servers, clients, a raw protocol speaker); each
//! feature's tests are a file of their own: the protocol by hand (`raw`, `strict_off`,
//! `unaligned`), real clients (`nbdinfo`, `clients`, `filesystem`), limits and hostile
//! clients (`hostile`), TLS (`tls`), starting and stopping (`activation`, `sockets`,
//! `refused_starts`, `shutdown`), arrays through serve (`arrays`, `array_defaults`), the
//! operator's view (`admin`, `observe`), the FUSE export (`fuse_export`) and Ceph RBD
//! images (`rbd`, on a cluster from tests/ceph).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use tempfile::TempDir;

use cairn_testkit::ceph;
#[path = "../common/mod.rs"]
mod common;
use common::{skip, text, tmpdir, tool, tools};

/// Longest a server may take to print its ready line.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest a server may take to exit after SIGTERM.
const EXIT_TIMEOUT: Duration = Duration::from_secs(20);
/// Longest a raw-socket read or write may block.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a client tool may run.
const TOOL_TIMEOUT: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------------------
// Skipping (`skip`, `tool`, `tools` are in `common`)

/// A Python interpreter that can `import nbd` (python3-libnbd), or `None` after recording
/// a skip. Debian's module lives in /usr/bin/python3's path, which another python3 first
/// on PATH (pyenv and the like) does not see, so that one is tried first.
fn python_with_libnbd(test: &str) -> Option<PathBuf> {
    let mut candidates = vec![PathBuf::from("/usr/bin/python3")];
    candidates.extend(tool("python3"));
    for py in candidates {
        let ok = Command::new(&py)
            .args(["-c", "import nbd"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Some(py);
        }
    }
    skip(
        test,
        "no python3 can import nbd (install python3-libnbd for /usr/bin/python3)",
    );
    None
}

/// Runs a libnbd Python `script` against the server listening on `sock` (as CAIRN_SOCK,
/// with `env` besides), asserts that it succeeded, and returns its stdout, which must
/// contain `done` (the script's last word: it did not stop early).
#[track_caller]
fn libnbd_script(
    python: &Path,
    script: &str,
    sock: &Path,
    env: &[(&str, String)],
    done: &str,
) -> String {
    let mut cmd = Command::new(python);
    cmd.args(["-c", script]).env("CAIRN_SOCK", sock);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let stdout = success("the libnbd script", &run(&mut cmd));
    assert!(stdout.contains(done), "{stdout}");
    stdout
}

// ---------------------------------------------------------------------------------------
// Running things

fn path_str(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

/// Runs `cmd` to the end (stdin closed), killing it after `limit`.
fn run_for(cmd: &mut Command, limit: Duration) -> Output {
    let desc = format!("{cmd:?}");
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{desc}: cannot start: {e}"));
    let pid = child.id() as libc::pid_t;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => panic!("{desc}: {e}"),
        Err(_) => {
            // SAFETY: signals the child we started, which has not been reaped (its
            // waiter has not reported).
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("{desc}: still running after {limit:?}; killed")
        }
    }
}

fn run(cmd: &mut Command) -> Output {
    run_for(cmd, TOOL_TIMEOUT)
}

/// Asserts that `out` is a success; returns its stdout.
#[track_caller]
fn success(what: &str, out: &Output) -> String {
    assert!(
        out.status.success(),
        "{what}: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Deterministic pseudo-random bytes (splitmix64).
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x1234_5678;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Asserts equal bytes, naming the first difference (never prints megabytes).
#[track_caller]
fn assert_same(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i}: got {:#04x}, want {:#04x}",
            got[i], want[i]
        );
    }
}

// ---------------------------------------------------------------------------------------
// The server

/// A `cairn serve` process; SIGTERM and a wait on drop.
struct Server {
    child: Option<Child>,
    dir: TempDir,
    /// The Unix socket (when it listens on one).
    sock: PathBuf,
    /// The addresses from the ready line (`unix:...`, `tcp:HOST:PORT`).
    addrs: Vec<String>,
    log: Arc<Mutex<String>>,
    reader: Option<JoinHandle<()>>,
}

impl Server {
    /// Serves with `args` on a Unix socket in a new temporary directory.
    fn start(args: &[&str]) -> Server {
        Server::start_in(tmpdir(), args)
    }

    /// Serves with `args` on `dir/nbd.sock`; `dir` lives as long as the server.
    fn start_in(dir: TempDir, args: &[&str]) -> Server {
        let sock = dir.path().join("nbd.sock");
        let listen = format!("unix:{}", sock.display());
        Server::spawn(dir, sock, &["--listen", &listen], args)
    }

    fn spawn(dir: TempDir, sock: PathBuf, listen: &[&str], args: &[&str]) -> Server {
        Server::spawn_limited(dir, sock, listen, args, None)
    }

    /// [`Server::spawn`], with the descriptor limit (RLIMIT_NOFILE) set to `nofile` (soft,
    /// hard) when given.
    fn spawn_limited(
        dir: TempDir,
        sock: PathBuf,
        listen: &[&str],
        args: &[&str],
        nofile: Option<(u64, u64)>,
    ) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_cairn"));
        if let Some((soft, hard)) = nofile {
            use std::os::unix::process::CommandExt;
            // SAFETY: between fork and exec, setrlimit only (async-signal-safe), on a
            // value copied into the closure.
            unsafe {
                cmd.pre_exec(move || {
                    let lim = libc::rlimit {
                        rlim_cur: soft,
                        rlim_max: hard,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                })
            };
        }
        let mut child = cmd
            .arg("serve")
            .args(listen)
            .args(args)
            .env_remove("RUST_BACKTRACE")
            .env_remove("RUST_LIB_BACKTRACE")
            .env_remove("LISTEN_FDS")
            .env_remove("LISTEN_PID")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start cairn serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel::<String>();
        let reader = {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    {
                        let mut l = log.lock().unwrap();
                        l.push_str(&line);
                        l.push('\n');
                    }
                    let _ = tx.send(line);
                }
            })
        };
        // From here a panic drops the server, which stops the process.
        let mut server = Server {
            child: Some(child),
            dir,
            sock,
            addrs: Vec::new(),
            log,
            reader: Some(reader),
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line.contains(" cairn: serving ") => {
                    let (_, addrs) = line
                        .rsplit_once(" on ")
                        .unwrap_or_else(|| panic!("ready line without ' on ': {line}"));
                    server.addrs = addrs.split(", ").map(str::to_string).collect();
                    break;
                }
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => panic!(
                    "cairn serve {args:?}: no ready line after {READY_TIMEOUT:?}; stderr:\n{}",
                    server.stderr()
                ),
                Err(RecvTimeoutError::Disconnected) => {
                    let status = server.child.as_mut().unwrap().wait();
                    server.child = None;
                    panic!(
                        "cairn serve {args:?} exited before it was ready ({status:?}); stderr:\n{}",
                        server.stderr()
                    );
                }
            }
        }
        server
    }

    fn uri(&self) -> String {
        self.uri_for("")
    }

    fn uri_for(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.sock.display())
    }

    /// A path in the server's temporary directory.
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn stderr(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    fn signal(&self, sig: libc::c_int) {
        let pid = self.child.as_ref().expect("server running").id() as libc::pid_t;
        // SAFETY: signals our own child, which is not reaped while `child` is Some.
        unsafe { libc::kill(pid, sig) };
    }

    /// Waits until stderr contains `needle`.
    fn wait_for_stderr(&self, needle: &str, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.stderr().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.stderr().contains(needle)
    }

    /// Waits for the process to exit (after a signal); kills it after EXIT_TIMEOUT.
    fn wait_exit(&mut self) -> (ExitStatus, String) {
        let mut child = self.child.take().expect("server running");
        let deadline = Instant::now() + EXIT_TIMEOUT;
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait for cairn serve") {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "cairn serve still running {EXIT_TIMEOUT:?} after SIGTERM; stderr:\n{}",
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let log = self.stderr();
        assert!(!log.contains("panicked"), "cairn serve panicked:\n{log}");
        (status, log)
    }

    /// SIGTERM, then the exit status and everything on stderr.
    fn stop(&mut self) -> (ExitStatus, String) {
        self.signal(libc::SIGTERM);
        self.wait_exit()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.is_none() {
            return;
        }
        if std::thread::panicking() {
            if let Some(mut child) = self.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
            return;
        }
        let (status, log) = self.stop();
        assert!(
            status.success(),
            "cairn serve exited with {status} on SIGTERM; stderr:\n{log}"
        );
    }
}

/// A stack file in `dir`.
/// fio's nbd engine against `srv`: 64 MiB of random 4 KiB writes at iodepth 16, each
/// block with a crc32c, all read back and checked at the end.
fn fio_randwrite_verify(fio: &Path, srv: &Server, extra: &[&str]) -> Output {
    run(Command::new(fio)
        .current_dir(srv.dir.path())
        .args([
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={}", srv.uri()),
            "--rw=randwrite",
            "--bs=4k",
            "--size=64M",
            "--iodepth=16",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
        ])
        .args(extra))
}

/// `nbdinfo --map --json URI`: its runs as (offset, length, type), and its output.
fn map_runs(nbdinfo: &Path, uri: &str) -> (Vec<(u64, u64, u64)>, String) {
    let out = success(
        "nbdinfo --map --json",
        &run(Command::new(nbdinfo).args(["--map", "--json", uri])),
    );
    let json: Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("nbdinfo --map --json is not JSON ({e}): {out}"));
    let runs = json
        .as_array()
        .unwrap_or_else(|| panic!("not an array: {out}"))
        .iter()
        .map(|r| {
            (
                r["offset"].as_u64().unwrap(),
                r["length"].as_u64().unwrap(),
                r["type"].as_u64().unwrap(),
            )
        })
        .collect();
    (runs, out)
}

fn write_stack(dir: &TempDir, text: &str) -> PathBuf {
    let path = dir.path().join("stack.toml");
    std::fs::write(&path, text).expect("write the stack file");
    path
}

// ---------------------------------------------------------------------------------------
// The protocol, by hand (numbers from the NBD protocol document, not from cairn's crate)

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;

const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_TRIM: u16 = 4;
const CMD_BLOCK_STATUS: u16 = 7;

const FLAG_FUA: u16 = 1 << 0;
const FLAG_DF: u16 = 1 << 2;

const CHUNK_DONE: u16 = 1;
const CHUNK_OFFSET_DATA: u16 = 1;
const CHUNK_ERROR: u16 = (1 << 15) + 1;

const TFLAG_READ_ONLY: u16 = 1 << 1;

const EPERM: u32 = 1;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;
const ESHUTDOWN: u32 = 108;

/// Cookies of the fake requests hidden in write payloads start with these 16 bits.
const SMUGGLED: u64 = 0x5a5a << 48;

fn be_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes(b[..2].try_into().unwrap())
}
fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}
fn be_u64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

/// A request header.
fn header(flags: u16, command: u16, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(28);
    b.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b.extend_from_slice(&flags.to_be_bytes());
    b.extend_from_slice(&command.to_be_bytes());
    b.extend_from_slice(&cookie.to_be_bytes());
    b.extend_from_slice(&offset.to_be_bytes());
    b.extend_from_slice(&len.to_be_bytes());
    b
}

/// `len` bytes of well-formed READ request headers (cookies `SMUGGLED | i`): the payload
/// of a write that a server must skip, never parse.
fn smuggled(len: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(len + 28);
    let mut i = 0u64;
    while b.len() < len {
        b.extend_from_slice(&header(0, CMD_READ, SMUGGLED | i, 0, 512));
        i += 1;
    }
    b.truncate(len);
    b
}

/// GO's data: the export name and no information requests.
fn go_data(name: &str) -> Vec<u8> {
    go_data_asking(name, &[])
}

/// GO data asking for these information items (3: block sizes).
fn go_data_asking(name: &str, items: &[u16]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(items.len() as u16).to_be_bytes());
    for i in items {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

/// A client on a raw Unix socket.
struct Raw {
    s: UnixStream,
}

impl Raw {
    fn connect(sock: &Path) -> Raw {
        let s = UnixStream::connect(sock)
            .unwrap_or_else(|e| panic!("connect to {}: {e}", sock.display()));
        s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
        Raw { s }
    }

    /// Reads the 18-byte greeting; returns the handshake flags.
    fn greeting(&mut self) -> std::io::Result<u16> {
        let mut g = [0u8; 18];
        self.s.read_exact(&mut g)?;
        assert_eq!(be_u64(&g[0..]), NBDMAGIC, "greeting: NBDMAGIC");
        assert_eq!(be_u64(&g[8..]), IHAVEOPT, "greeting: IHAVEOPT");
        Ok(be_u16(&g[16..]))
    }

    fn send(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.s.write_all(b)
    }

    fn opt(&mut self, option: u32, data: &[u8]) -> std::io::Result<()> {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.send(&b)
    }

    /// One option reply: (option, reply type, data).
    fn opt_reply(&mut self) -> std::io::Result<(u32, u32, Vec<u8>)> {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h)?;
        assert_eq!(be_u64(&h), OPT_REPLY_MAGIC, "option reply magic");
        let mut data = vec![0u8; be_u32(&h[16..]) as usize];
        self.s.read_exact(&mut data)?;
        Ok((be_u32(&h[8..]), be_u32(&h[12..]), data))
    }

    /// Greeting, client flags 3 (fixed newstyle, no zeroes), `options` (each answered
    /// with replies until an ACK or an error), then GO for `name` with no information
    /// requests. Returns the client, the export size and the transmission flags.
    fn handshake(sock: &Path, options: &[u32], name: &str) -> (Raw, u64, u16) {
        Raw::handshake_asking(sock, options, name, &[])
    }

    /// The handshake, with GO asking for these information items.
    fn handshake_asking(
        sock: &Path,
        options: &[u32],
        name: &str,
        items: &[u16],
    ) -> (Raw, u64, u16) {
        Raw::connect(sock).handshake_on(options, name, items)
    }

    /// A TCP connection to 127.0.0.1:`port` from the local address `from` (any of
    /// 127.0.0.0/8 is this machine's).
    fn connect_tcp_from(from: [u8; 4], port: u16) -> Raw {
        use std::os::fd::FromRawFd;
        let sin = |a: [u8; 4], port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(a),
            },
            sin_zero: [0; 8],
        };
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: a new socket, bound and connected with valid sockaddr_in values; the
        // descriptor is owned by the stream from here on.
        let s = unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
            let src = sin(from, 0);
            let dst = sin([127, 0, 0, 1], port);
            assert_eq!(
                libc::bind(fd, (&src as *const libc::sockaddr_in).cast(), len),
                0,
                "bind to {from:?}: {}",
                std::io::Error::last_os_error()
            );
            assert_eq!(
                libc::connect(fd, (&dst as *const libc::sockaddr_in).cast(), len),
                0,
                "connect from {from:?}: {}",
                std::io::Error::last_os_error()
            );
            // Any stream socket reads and writes like this one.
            UnixStream::from_raw_fd(fd)
        };
        s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
        Raw { s }
    }

    /// The local address of a TCP connection, as the server names its peer.
    fn local(&self) -> String {
        use std::os::fd::AsRawFd;
        // SAFETY: sockaddr_in is plain data; all-zero is a valid value.
        let mut sin: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: getsockname of our own socket into `sin`, `len` bytes long.
        let r = unsafe {
            libc::getsockname(
                self.s.as_raw_fd(),
                (&mut sin as *mut libc::sockaddr_in).cast(),
                &mut len,
            )
        };
        assert_eq!(r, 0, "getsockname: {}", std::io::Error::last_os_error());
        let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
        format!("{ip}:{}", u16::from_be(sin.sin_port))
    }

    /// Whether the server lets this connection through the handshake (a refused one is
    /// closed before the greeting).
    fn admitted_now(mut self) -> Option<Raw> {
        self.greeting().ok()?;
        Some(self)
    }

    /// [`Raw::handshake_asking`] on this connection.
    fn handshake_on(mut self, options: &[u32], name: &str, items: &[u16]) -> (Raw, u64, u16) {
        self.greeting().expect("greeting");
        self.after_greeting(options, name, items)
    }

    /// The rest of [`Raw::handshake_asking`] on a connection that has its greeting.
    fn after_greeting(self, options: &[u32], name: &str, items: &[u16]) -> (Raw, u64, u16) {
        let mut c = self;
        c.send(&3u32.to_be_bytes()).expect("client flags");
        for &o in options {
            c.opt(o, &[]).expect("send an option");
            let (ro, t, data) = c.opt_reply().expect("option reply");
            assert_eq!(ro, o);
            assert_eq!(t, REP_ACK, "option {o}: {}", text(&data));
        }
        c.opt(OPT_GO, &go_data_asking(name, items))
            .expect("send GO");
        let (mut size, mut flags) = (None, 0);
        loop {
            let (o, t, data) = c.opt_reply().expect("GO reply");
            assert_eq!(o, OPT_GO);
            match t {
                REP_ACK => break,
                REP_INFO if be_u16(&data) == 0 => {
                    size = Some(be_u64(&data[2..]));
                    flags = be_u16(&data[10..]);
                }
                REP_INFO => {}
                t => panic!("GO '{name}': reply {t:#x}: {}", text(&data)),
            }
        }
        (c, size.expect("GO sent NBD_INFO_EXPORT"), flags)
    }

    /// A client in transmission on export `name`, simple replies.
    fn go(sock: &Path, name: &str) -> (Raw, u64, u16) {
        Raw::handshake(sock, &[], name)
    }

    /// Like [`Raw::go`], but the client asked for block sizes: it must honour them.
    fn go_strict(sock: &Path, name: &str) -> (Raw, u64, u16) {
        Raw::handshake_asking(sock, &[], name, &[3])
    }

    fn request(
        &mut self,
        flags: u16,
        command: u16,
        cookie: u64,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> std::io::Result<()> {
        let mut b = header(flags, command, cookie, offset, len);
        b.extend_from_slice(payload);
        self.send(&b)
    }

    /// One simple reply: (error, cookie).
    fn reply(&mut self) -> std::io::Result<(u32, u64)> {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h)?;
        assert_eq!(
            be_u32(&h),
            SIMPLE_REPLY_MAGIC,
            "simple reply magic; header {h:02x?}"
        );
        Ok((be_u32(&h[4..]), be_u64(&h[8..])))
    }

    /// Reads a simple reply and checks its cookie and error.
    #[track_caller]
    fn expect(&mut self, cookie: u64, error: u32) {
        let (e, c) = self.reply().expect("read a reply");
        assert!(
            c & SMUGGLED != SMUGGLED,
            "the server answered request {c:#x}, hidden in a write's payload"
        );
        assert_eq!((c, e), (cookie, error), "reply (cookie, error)");
    }

    fn read_exact(&mut self, n: usize) -> std::io::Result<Vec<u8>> {
        let mut b = vec![0u8; n];
        self.s.read_exact(&mut b)?;
        Ok(b)
    }

    #[track_caller]
    fn read_ok(&mut self, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
        self.request(0, CMD_READ, cookie, offset, len, &[])
            .expect("send a read");
        self.expect(cookie, 0);
        self.read_exact(len as usize).expect("read data")
    }

    #[track_caller]
    fn write_ok(&mut self, cookie: u64, flags: u16, offset: u64, data: &[u8]) {
        self.request(flags, CMD_WRITE, cookie, offset, data.len() as u32, data)
            .expect("send a write");
        self.expect(cookie, 0);
    }

    fn disconnect(&mut self) {
        let _ = self.request(0, CMD_DISC, 0, 0, 0, &[]);
    }

    /// Waits for the server to close the connection; `Err` if it stays open for
    /// IO_TIMEOUT or sends anything first.
    fn closed(&mut self) -> Result<(), String> {
        let mut extra = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match self.s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => extra.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::ConnectionReset => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(format!(
                        "still open after {IO_TIMEOUT:?} ({} bytes received)",
                        extra.len()
                    ))
                }
                Err(e) => return Err(format!("read failed: {e}")),
            }
        }
        if extra.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{} unexpected bytes before the close: {:02x?}",
                extra.len(),
                &extra[..extra.len().min(64)]
            ))
        }
    }
}

#[track_caller]
fn assert_closed(c: &mut Raw, what: &str) {
    if let Err(e) = c.closed() {
        panic!("{what}: the server should close the connection: {e}");
    }
}

/// Connects until the server admits the connection (a slot freed by a closed connection
/// is given back a moment after the client sees the close).
fn admitted(sock: &Path) -> Raw {
    let deadline = Instant::now() + IO_TIMEOUT;
    loop {
        let mut c = Raw::connect(sock);
        if c.greeting().is_ok() {
            return c;
        }
        assert!(
            Instant::now() < deadline,
            "no connection admitted for {IO_TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------------------------------
// nbdinfo

mod nbdinfo;

// ---------------------------------------------------------------------------------------
// Incremental backup: dirty bitmaps, checkpoints and their exports

mod backup;

/// `cairn backup`, the client: full and incremental copies from cairn and qemu-nbd.
mod backup_client;

// ---------------------------------------------------------------------------------------
// Rate limits

mod throttle;

// ---------------------------------------------------------------------------------------
// Encryption: LUKS volumes both ways with qemu and cryptsetup, key slots online

mod crypt;

// ---------------------------------------------------------------------------------------
// Copying and checking data with nbdcopy, qemu-img, qemu-io and fio

mod clients;

// ---------------------------------------------------------------------------------------
// libnbd with its client-side checks off: what polite clients never send

mod strict_off;

// ---------------------------------------------------------------------------------------
// Clients that did not ask for block sizes: requests at any byte

mod unaligned;

// ---------------------------------------------------------------------------------------
// A raw socket: the protocol by hand, and broken on purpose

mod raw;

// ---------------------------------------------------------------------------------------
// SIGTERM

mod shutdown;

// ---------------------------------------------------------------------------------------
// A real file system, as root

mod filesystem;

// ---------------------------------------------------------------------------------------
// TLS

mod tls;

// ---------------------------------------------------------------------------------------
// Socket activation

mod activation;

mod admin;

/// The Unix sockets cairn listens on (NBD's `unix:` addresses, the admin socket, the
/// metrics endpoint's `unix:` form) follow one rule: a stale socket (nobody listens: what
/// `kill -9` leaves) is replaced, a live one is refused by name, and nothing is removed.
mod sockets;

/// Every check that can refuse a start (arguments, addresses and sockets bound, paths,
/// array members examined) runs before anything is created or written: a refused
/// `cairn serve` or `cairn bench` leaves every file as it found it.
mod refused_starts;

/// Arrays with superblocks through `cairn serve`: killed with SIGKILL under a write load
/// and started again, a mirror resyncs, every write a flush made durable reads back (or
/// a newer one), and its members agree.
mod arrays;

// ---------------------------------------------------------------------------------------
// Arrays at the defaults (stack files with no `metadata` key, so superblocks), through real
// clients: the three ways the raw layout served wrong data

mod array_defaults;

// ---------------------------------------------------------------------------------------
// What operators see of a running server: status with connections, stats, `cairn stat`,
// Prometheus metrics, and the service manager's notifications

mod observe;

// ---------------------------------------------------------------------------------------
// The FUSE export (`--fuse PATH[:EXPORT]`): as root, with /dev/fuse

mod fuse_export;

// ---------------------------------------------------------------------------------------
// Hostile clients: idle slots, connections per address, memory

mod hostile;

// ---------------------------------------------------------------------------------------
// Ceph RBD images: served, cached, mirrored with a local file (a cluster from tests/ceph)

mod rbd;

// ---------------------------------------------------------------------------------------
// Thin pools: snapshots while a client writes, kill -9, check and restart

mod thin;
