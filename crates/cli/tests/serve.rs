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

mod nbdinfo {
    use super::*;

    #[test]
    fn json_reports_size_flags_block_sizes_and_base_allocation() {
        const NAME: &str = "nbdinfo::json_reports_size_flags_block_sizes_and_base_allocation";
        let Some([nbdinfo]) = tools(NAME, ["nbdinfo"]) else {
            return;
        };
        let srv = Server::start(&["--device", "mem:64M"]);
        let out = success(
            "nbdinfo --json",
            &run(Command::new(&nbdinfo).args(["--json", &srv.uri()])),
        );
        let json: Value = serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("nbdinfo --json is not JSON ({e}): {out}"));
        assert_eq!(json["protocol"], "newstyle-fixed", "{json:#}");
        assert_eq!(json["structured"], true, "{json:#}");
        let e = &json["exports"][0];
        assert_eq!(e["export-size"], 64u64 << 20, "{json:#}");
        assert_eq!(e["is_read_only"], false, "{json:#}");
        for key in [
            "can_flush",
            "can_trim",
            "can_zero",
            "can_fua",
            "can_multi_conn",
            "can_df",
            "can_fast_zero",
            "can_cache",
        ] {
            assert_eq!(e[key], true, "{key}: {json:#}");
        }
        assert_eq!(e["block_size_minimum"], 512, "{json:#}");
        assert_eq!(e["block_size_preferred"], 4096, "{json:#}");
        assert_eq!(e["block_size_maximum"], 67_108_864, "{json:#}");
        let contexts: Vec<&str> = e["contexts"]
            .as_array()
            .unwrap_or_else(|| panic!("no contexts: {json:#}"))
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(contexts.contains(&"base:allocation"), "{json:#}");
        // `--can` and `--is` answer with exit status 0 (true) or 2 (false).
        let can = |what: &[&str], uri: &str| {
            run(Command::new(&nbdinfo).args(what).arg(uri))
                .status
                .code()
        };
        for c in [
            "flush",
            "trim",
            "zero",
            "fua",
            "multi-conn",
            "df",
            "fast-zero",
            "cache",
        ] {
            assert_eq!(can(&["--can", c], &srv.uri()), Some(0), "--can {c}");
        }
        assert_eq!(can(&["--is", "read-only"], &srv.uri()), Some(2));
        assert_eq!(can(&["--can", "write"], &srv.uri()), Some(0));

        // A read-only export: no writes, trims or zeroes, but flush and multi-conn.
        let ro = Server::start(&["--device", "mem:16M", "--read-only"]);
        assert_eq!(can(&["--is", "read-only"], &ro.uri()), Some(0));
        for c in ["write", "trim", "zero", "fua", "fast-zero"] {
            assert_eq!(
                can(&["--can", c], &ro.uri()),
                Some(2),
                "read-only --can {c}"
            );
        }
        for c in ["flush", "multi-conn"] {
            assert_eq!(
                can(&["--can", c], &ro.uri()),
                Some(0),
                "read-only --can {c}"
            );
        }
    }

    #[test]
    fn map_covers_the_export_and_never_claims_zeroes_over_data() {
        const NAME: &str = "nbdinfo::map_covers_the_export_and_never_claims_zeroes_over_data";
        let Some([nbdinfo]) = tools(NAME, ["nbdinfo"]) else {
            return;
        };
        const SIZE: u64 = 16 << 20;
        let srv = Server::start(&["--device", "mem:16M"]);
        let map = |srv: &Server| -> Vec<(u64, u64, u64)> {
            let out = success(
                "nbdinfo --map --json",
                &run(Command::new(&nbdinfo).args(["--map", "--json", &srv.uri()])),
            );
            let json: Value = serde_json::from_str(&out)
                .unwrap_or_else(|e| panic!("nbdinfo --map --json is not JSON ({e}): {out}"));
            let runs: Vec<(u64, u64, u64)> = json
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
            // Contiguous from 0 to the end of the export.
            let mut at = 0;
            for &(offset, length, _) in &runs {
                assert_eq!(offset, at, "runs must be contiguous: {out}");
                assert!(length > 0, "{out}");
                at += length;
            }
            assert_eq!(at, SIZE, "the map must end at the export size: {out}");
            runs
        };
        // A fresh sparse RAM disk is one hole that reads as zeroes.
        assert_eq!(map(&srv), vec![(0, SIZE, 3)]);

        // Data at [3M, 4M): no run over it may claim zeroes (bit 1) or a hole (bit 0).
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        c.write_ok(1, 0, 3 << 20, &random_bytes(1 << 20, 7));
        let runs = map(&srv);
        for &(offset, length, kind) in &runs {
            if offset < 4 << 20 && offset + length > 3 << 20 {
                assert_eq!(kind & 3, 0, "data reported as hole or zero: {runs:?}");
            }
        }
        assert!(
            runs.iter().any(|&(_, _, kind)| kind == 3),
            "the unwritten rest should still be a hole: {runs:?}"
        );
        // Exactly [3M, 4M) is data (pages, not 2 MiB regions), and a trim of its first
        // half turns that half back into a hole, as nbdkit's memory plugin reports it.
        assert_eq!(
            runs,
            vec![
                (0, 3 << 20, 3),
                (3 << 20, 1 << 20, 0),
                (4 << 20, SIZE - (4 << 20), 3)
            ]
        );
        c.request(0, CMD_TRIM, 2, 3 << 20, 512 << 10, &[]).unwrap();
        c.expect(2, 0);
        assert_eq!(
            map(&srv),
            vec![
                (0, (3 << 20) + (512 << 10), 3),
                ((3 << 20) + (512 << 10), 512 << 10, 0),
                (4 << 20, SIZE - (4 << 20), 3)
            ]
        );
        c.disconnect();
        // qemu-img map says the same.
        let Some([qemu_img]) = tools(NAME, ["qemu-img"]) else {
            return;
        };
        let out = success(
            "qemu-img map",
            &run(Command::new(&qemu_img).args(["map", "--output=json", "-f", "raw", &srv.uri()])),
        );
        let json: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
        let data: Vec<(u64, u64)> = json
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["data"] == true)
            .map(|r| (r["start"].as_u64().unwrap(), r["length"].as_u64().unwrap()))
            .collect();
        assert_eq!(data, vec![((3 << 20) + (512 << 10), 512 << 10)], "{out}");
    }

    #[test]
    fn list_names_every_export_with_its_description() {
        const NAME: &str = "nbdinfo::list_names_every_export_with_its_description";
        let Some([nbdinfo]) = tools(NAME, ["nbdinfo"]) else {
            return;
        };
        let dir = tmpdir();
        let stack = write_stack(
            &dir,
            "[device.a]\ntype = \"mem\"\nsize = \"8M\"\n\n\
             [device.b]\ntype = \"mem\"\nsize = \"16M\"\n\n\
             [export.alpha]\ndevice = \"a\"\ndescription = \"the first disk\"\ndefault = true\n\n\
             [export.beta]\ndevice = \"b\"\nread_only = true\ndescription = \"the second, read-only\"\n",
        );
        let srv = Server::start_in(dir, &[path_str(&stack)]);
        let out = success(
            "nbdinfo --list --json",
            &run(Command::new(&nbdinfo).args(["--list", "--json", &srv.uri()])),
        );
        let json: Value = serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("nbdinfo --list --json is not JSON ({e}): {out}"));
        let exports = json["exports"].as_array().expect("exports");
        let found: Vec<(&str, &str, u64, bool)> = exports
            .iter()
            .map(|e| {
                (
                    e["export-name"].as_str().unwrap(),
                    e["description"].as_str().unwrap_or(""),
                    e["export-size"].as_u64().unwrap(),
                    e["is_read_only"].as_bool().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            found,
            vec![
                ("alpha", "the first disk", 8 << 20, false),
                ("beta", "the second, read-only", 16 << 20, true),
            ],
            "{out}"
        );
        // The plain listing shows the names and descriptions too.
        let plain = success(
            "nbdinfo --list",
            &run(Command::new(&nbdinfo).args(["--list", &srv.uri()])),
        );
        for s in [
            "export=\"alpha\"",
            "the first disk",
            "export=\"beta\"",
            "the second, read-only",
        ] {
            assert!(plain.contains(s), "{s:?} not in:\n{plain}");
        }
        // The empty name picks the default export; names pick theirs.
        let size = |uri: &str| {
            let out = success(
                "nbdinfo --size",
                &run(Command::new(&nbdinfo).args(["--size", uri])),
            );
            out.trim().parse::<u64>().unwrap()
        };
        assert_eq!(size(&srv.uri()), 8 << 20);
        assert_eq!(size(&srv.uri_for("beta")), 16 << 20);
        // An unknown name fails (and says which).
        let out = run(Command::new(&nbdinfo).arg(srv.uri_for("nope")));
        assert!(!out.status.success(), "nbdinfo on export 'nope' succeeded");
        assert!(text(&out.stderr).contains("nope"), "{}", text(&out.stderr));
    }

    #[test]
    fn tcp_port_0_listens_on_the_port_the_ready_line_names() {
        const NAME: &str = "nbdinfo::tcp_port_0_listens_on_the_port_the_ready_line_names";
        let Some([nbdinfo]) = tools(NAME, ["nbdinfo"]) else {
            return;
        };
        let dir = tmpdir();
        let none = dir.path().join("no.sock");
        let srv = Server::spawn(
            dir,
            none,
            &["--listen", "tcp:127.0.0.1:0"],
            &["--device", "mem:16M"],
        );
        assert_eq!(srv.addrs.len(), 1, "{:?}", srv.addrs);
        let port: u16 = srv.addrs[0]
            .strip_prefix("tcp:127.0.0.1:")
            .unwrap_or_else(|| panic!("ready line address {:?}", srv.addrs))
            .parse()
            .expect("a port number");
        assert_ne!(port, 0, "the ready line must show the bound port");
        let out = success(
            "nbdinfo --size over TCP",
            &run(Command::new(&nbdinfo).args(["--size", &format!("nbd://127.0.0.1:{port}/")])),
        );
        assert_eq!(out.trim(), (16u64 << 20).to_string());
    }
}

// ---------------------------------------------------------------------------------------
// Copying and checking data with nbdcopy, qemu-img, qemu-io and fio

mod clients {
    use super::*;

    #[test]
    fn nbdcopy_round_trip_is_byte_exact() {
        const NAME: &str = "clients::nbdcopy_round_trip_is_byte_exact";
        let Some([nbdcopy]) = tools(NAME, ["nbdcopy"]) else {
            return;
        };
        let srv = Server::start(&["--device", "mem:32M"]);
        let src = srv.path("src.img");
        let back = srv.path("back.img");
        let data = random_bytes(32 << 20, 1);
        std::fs::write(&src, &data).unwrap();
        success(
            "nbdcopy into the export",
            &run(Command::new(&nbdcopy).args(["--flush", path_str(&src), &srv.uri()])),
        );
        success(
            "nbdcopy out of the export",
            &run(Command::new(&nbdcopy).args([&srv.uri(), path_str(&back)])),
        );
        assert_same("nbdcopy round trip", &std::fs::read(&back).unwrap(), &data);
        // One connection and many requests in flight: the same bytes again.
        let back1 = srv.path("back1.img");
        success(
            "nbdcopy out, one connection",
            &run(Command::new(&nbdcopy).args([
                "--connections=1",
                "--requests=64",
                "--request-size=65536",
                &srv.uri(),
                path_str(&back1),
            ])),
        );
        assert_same(
            "nbdcopy, one connection",
            &std::fs::read(&back1).unwrap(),
            &data,
        );
    }

    #[test]
    fn qemu_img_convert_and_compare() {
        const NAME: &str = "clients::qemu_img_convert_and_compare";
        let Some([qemu_img]) = tools(NAME, ["qemu-img"]) else {
            return;
        };
        let srv = Server::start(&["--device", "mem:16M"]);
        let src = srv.path("src.raw");
        let data = random_bytes(16 << 20, 2);
        std::fs::write(&src, &data).unwrap();
        // -n: the target exists; -W and -m 16: many writes in flight, out of order.
        success(
            "qemu-img convert into the export",
            &run(Command::new(&qemu_img).args([
                "convert",
                "-n",
                "-W",
                "-m",
                "16",
                "-f",
                "raw",
                "-O",
                "raw",
                path_str(&src),
                &srv.uri(),
            ])),
        );
        let compare = |a: &Path| {
            run(Command::new(&qemu_img).args([
                "compare",
                "-s",
                "-f",
                "raw",
                "-F",
                "raw",
                path_str(a),
                &srv.uri(),
            ]))
        };
        let out = compare(&src);
        success("qemu-img compare -s", &out);
        // The comparison is not vacuous: one changed byte makes it fail with status 1.
        let mut changed = data.clone();
        changed[5 << 20] ^= 0xff;
        let other = srv.path("changed.raw");
        std::fs::write(&other, &changed).unwrap();
        let out = compare(&other);
        assert_eq!(
            out.status.code(),
            Some(1),
            "qemu-img compare of different images: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        // And out again, byte for byte.
        let back = srv.path("back.raw");
        success(
            "qemu-img convert out of the export",
            &run(Command::new(&qemu_img).args([
                "convert",
                "-f",
                "raw",
                "-O",
                "raw",
                &srv.uri(),
                path_str(&back),
            ])),
        );
        assert_same("qemu-img round trip", &std::fs::read(&back).unwrap(), &data);
    }

    #[test]
    fn qemu_io_patterns_zeroes_discards_flushes_and_aio() {
        const NAME: &str = "clients::qemu_io_patterns_zeroes_discards_flushes_and_aio";
        let Some([qemu_io]) = tools(NAME, ["qemu-io"]) else {
            return;
        };
        let srv = Server::start(&["--device", "mem:16M"]);
        let script = [
            "write -P 0xab 0 64k",
            "read -P 0xab 0 64k",
            "write -z 64k 64k",
            "read -P 0 64k 64k",
            "write -P 0xcd 128k 64k",
            "discard 128k 64k",
            "write -P 0xce 128k 4k",
            "read -P 0xce 128k 4k",
            "write -f -P 0x11 256k 4k",
            "read -P 0x11 256k 4k",
            "write -P 0x12 320k 64k",
            "write -z -u 320k 64k",
            "read -P 0 320k 64k",
            "write -z -f 384k 4k",
            "read -P 0 384k 4k",
            "flush",
            "aio_write -P 0x21 1M 64k",
            "aio_write -P 0x22 2M 64k",
            "aio_write -P 0x23 3M 1M",
            "aio_flush",
            "aio_read -P 0x21 1M 64k",
            "aio_read -P 0x22 2M 64k",
            "aio_read -P 0x23 3M 1M",
            "aio_flush",
            "writev -P 0x31 8M 4k 4k 8k",
            "readv -P 0x31 8M 16k",
            "read -P 0xab 0 64k",
            "flush",
        ];
        let mut cmd = Command::new(&qemu_io);
        cmd.args(["-f", "raw"]);
        for c in script {
            cmd.args(["-c", c]);
        }
        cmd.arg(srv.uri());
        let out = run(&mut cmd);
        let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "qemu-io: {}\n{all}", out.status);
        for bad in ["Pattern verification failed", "error", "failed"] {
            assert!(!all.contains(bad), "qemu-io printed {bad:?}:\n{all}");
        }
        // The check is not vacuous: a wrong pattern is reported.
        let out =
            run(Command::new(&qemu_io).args(["-f", "raw", "-c", "read -P 0x55 0 4k", &srv.uri()]));
        let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
        assert!(all.contains("Pattern verification failed"), "{all}");
    }

    #[test]
    /// fio with crc32c verify through a write-back cache much smaller than the data (so
    /// pages are evicted, written back under pressure, and written through when the cache
    /// is all dirty); then the export is copied out with nbdcopy, the server stopped, and
    /// the file below the cache must equal the copy: what the cache served is what it
    /// wrote back.
    fn fio_verify_through_a_small_write_back_cache_then_the_file_matches() {
        const NAME: &str =
            "clients::fio_verify_through_a_small_write_back_cache_then_the_file_matches";
        let Some([fio, nbdcopy]) = tools(NAME, ["fio", "nbdcopy"]) else {
            return;
        };
        let dir = tmpdir();
        let disk = dir.path().join("disk.img");
        let stack = write_stack(
            &dir,
            &format!(
                "[writeback]\nbackground = \"10%\"\nlimit = \"20%\"\nexpire = \"200ms\"\ninterval = \"100ms\"\n\
                 [device.f]\ntype = \"file\"\npath = \"{}\"\nsize = \"64M\"\n\
                 [device.c]\ntype = \"cache\"\nbase = \"f\"\nmemory = \"4M\"\n",
                disk.display()
            ),
        );
        let mut srv = Server::start_in(dir, &[path_str(&stack)]);
        let out = fio_randwrite_verify(&fio, &srv, &[]);
        success("fio through the cache", &out);
        let copy = srv.path("copy.img");
        let out = run(Command::new(&nbdcopy).arg(srv.uri()).arg(&copy));
        success("nbdcopy", &out);
        let (status, log) = srv.stop();
        assert!(status.success(), "exit status {status}; stderr:\n{log}");
        let copied = std::fs::read(&copy).unwrap();
        let file = std::fs::read(&disk).unwrap();
        assert_eq!(copied.len(), 64 << 20);
        assert_same(
            "the file below the cache against the export",
            &file,
            &copied,
        );
    }

    #[test]
    fn fio_nbd_engine_randwrite_with_crc32c_verify() {
        const NAME: &str = "clients::fio_nbd_engine_randwrite_with_crc32c_verify";
        let Some([fio]) = tools(NAME, ["fio"]) else {
            return;
        };
        let srv = Server::start(&["--device", "mem:64M"]);
        let out = fio_randwrite_verify(&fio, &srv, &["--output-format=json"]);
        let stdout = success("fio", &out);
        // fio's nbd engine prints a line before the JSON.
        let start = stdout
            .find("\n{")
            .map(|i| i + 1)
            .or_else(|| stdout.starts_with('{').then_some(0))
            .unwrap_or_else(|| panic!("no JSON from fio: {stdout}"));
        let json: Value = serde_json::from_str(&stdout[start..])
            .unwrap_or_else(|e| panic!("fio JSON ({e}): {stdout}"));
        let job = &json["jobs"][0];
        assert_eq!(job["error"], 0, "{job:#}");
        assert_eq!(job["write"]["io_bytes"], 64u64 << 20, "{job:#}");
        // The verify pass reads everything back.
        assert_eq!(job["read"]["io_bytes"], 64u64 << 20, "{job:#}");
    }
}

// ---------------------------------------------------------------------------------------
// libnbd with its client-side checks off: what polite clients never send

mod strict_off {
    use super::*;

    const SCRIPT: &str = r#"
import errno, os
import nbd

sock = os.environ["CAIRN_SOCK"]
failures = []
checked = 0
pattern = bytes((i * 7 + 1) % 251 for i in range(4096))

def connect(name, structured, meta=False):
    h = nbd.NBD()
    h.set_strict_mode(0)
    h.set_request_structured_replies(structured)
    if meta:
        h.add_meta_context("base:allocation")
    h.set_export_name(name)
    h.connect_unix(sock)
    return h

def refused(h, what, want, f):
    """f must fail with one of the errnos in want, answered by the server; the connection
    must still work afterwards and offset 0 must still hold the pattern."""
    global checked
    checked += 1
    want = want if isinstance(want, tuple) else (want,)
    names = "/".join(errno.errorcode[w] for w in want)
    try:
        f()
        failures.append(f"{what}: succeeded, want {names}")
    except nbd.Error as e:
        if e.errnum not in want:
            failures.append(f"{what}: {e.errno} ({e.errnum}), want {names}: {e.string}")
        elif "command failed" not in (e.string or ""):
            failures.append(f"{what}: refused by libnbd, never reached the server: {e.string}")
    try:
        if bytes(h.pread(4096, 0)) != pattern:
            failures.append(f"after {what}: offset 0 changed")
    except nbd.Error as e:
        failures.append(f"after {what}: a normal read failed: {e.string}")

def works(what, f):
    global checked
    checked += 1
    try:
        f()
    except nbd.Error as e:
        failures.append(f"{what}: failed: {e.string}")

EINVAL, ENOSPC, EPERM = errno.EINVAL, errno.ENOSPC, errno.EPERM
junk = b"\xee" * 8192
for structured in (True, False):
    mode = "structured" if structured else "simple"
    h = connect("rw", structured)
    if h.get_structured_replies_negotiated() != structured:
        failures.append(f"{mode}: structured replies negotiated: {h.get_structured_replies_negotiated()}")
    size = h.get_size()
    h.pwrite(pattern, 0)
    r = lambda what, want, f: refused(h, f"{mode}: {what}", want, f)
    r("read past the end", EINVAL, lambda: h.pread(4096, size))
    r("read across the end", EINVAL, lambda: h.pread(8192, size - 4096))
    r("read at offset 2^63", EINVAL, lambda: h.pread(512, 1 << 63))
    r("read whose end overflows 64 bits", EINVAL, lambda: h.pread(1024, (1 << 64) - 512))
    r("write past the end", ENOSPC, lambda: h.pwrite(junk[:4096], size))
    r("write across the end", ENOSPC, lambda: h.pwrite(junk, size - 4096))
    r("write whose end overflows 64 bits", (ENOSPC, EINVAL), lambda: h.pwrite(junk[:1024], (1 << 64) - 512))
    r("write-zeroes past the end", ENOSPC, lambda: h.zero(4096, size))
    r("trim past the end", EINVAL, lambda: h.trim(4096, size))
    r("cache past the end", EINVAL, lambda: h.cache(4096, size))
    r("read at offset 1", EINVAL, lambda: h.pread(512, 1))
    r("read of 100 bytes", EINVAL, lambda: h.pread(100, 0))
    r("write at offset 1", EINVAL, lambda: h.pwrite(junk[:512], 1))
    r("write of 100 bytes", EINVAL, lambda: h.pwrite(junk[:100], 0))
    r("trim at offset 1", EINVAL, lambda: h.trim(512, 1))
    r("write-zeroes at offset 1", EINVAL, lambda: h.zero(512, 1))
    r("read with unknown flag 1<<9", EINVAL, lambda: h.pread(512, 0, 1 << 9))
    r("write with unknown flag 1<<9", EINVAL, lambda: h.pwrite(junk[:4096], 0, 1 << 9))
    r("write with REQ_ONE", EINVAL, lambda: h.pwrite(junk[:4096], 0, nbd.CMD_FLAG_REQ_ONE))
    r("write with DF", EINVAL, lambda: h.pwrite(junk[:4096], 0, nbd.CMD_FLAG_DF))
    r("trim with NO_HOLE", EINVAL, lambda: h.trim(4096, 0, nbd.CMD_FLAG_NO_HOLE))
    r("flush with NO_HOLE", EINVAL, lambda: h.flush(nbd.CMD_FLAG_NO_HOLE))
    r("block status without a metadata context", EINVAL, lambda: h.block_status(4096, 0, lambda *a: 0))
    # Length 0: the spec leaves it open; cairn refuses it, as nbdkit does.
    r("read of length 0", EINVAL, lambda: h.pread(0, 4096))
    r("write of length 0", EINVAL, lambda: h.pwrite(b"", 4096))
    r("trim of length 0", EINVAL, lambda: h.trim(0, 4096))
    r("write-zeroes of length 0", EINVAL, lambda: h.zero(0, 4096))
    r("cache of length 0", EINVAL, lambda: h.cache(0, 4096))
    if not structured:
        r("read with DF without structured replies", EINVAL, lambda: h.pread(512, 0, nbd.CMD_FLAG_DF))
    # What a polite client does still works, with every flag the export offers.
    works(f"{mode}: write with FUA", lambda: h.pwrite(junk[:4096], 1 << 20, nbd.CMD_FLAG_FUA))
    works(f"{mode}: trim with FUA", lambda: h.trim(8192, 1 << 20, nbd.CMD_FLAG_FUA))
    works(f"{mode}: write-zeroes with NO_HOLE and FUA", lambda: h.zero(8192, 1 << 20, nbd.CMD_FLAG_NO_HOLE | nbd.CMD_FLAG_FUA))
    works(f"{mode}: write-zeroes with FAST_ZERO", lambda: h.zero(8192, 1 << 20, nbd.CMD_FLAG_FAST_ZERO))
    works(f"{mode}: flush with FUA", lambda: h.flush(nbd.CMD_FLAG_FUA))
    works(f"{mode}: cache", lambda: h.cache(1 << 20, 0))
    if structured:
        works(f"{mode}: read with DF", lambda: h.pread(1 << 20, 0, nbd.CMD_FLAG_DF))
    if bytes(h.pread(8192, 1 << 20)) != bytes(8192):
        failures.append(f"{mode}: write-zeroes did not zero")
    h.shutdown()

# The read-only export of the same device: writes of every kind are EPERM.
ro = connect("ro", True)
if not ro.is_read_only():
    failures.append("export ro is not read-only")
refused(ro, "read-only: write", EPERM, lambda: ro.pwrite(junk[:4096], 0))
refused(ro, "read-only: write with FUA", EPERM, lambda: ro.pwrite(junk[:4096], 0, nbd.CMD_FLAG_FUA))
refused(ro, "read-only: trim", EPERM, lambda: ro.trim(4096, 0))
refused(ro, "read-only: write-zeroes", EPERM, lambda: ro.zero(4096, 0))
refused(ro, "read-only: write-zeroes with FAST_ZERO", EPERM, lambda: ro.zero(4096, 0, nbd.CMD_FLAG_FAST_ZERO))
works("read-only: flush", lambda: ro.flush())
ro.shutdown()

# Block status with base:allocation selected.
h = connect("rw", True, meta=True)
if not h.can_meta_context("base:allocation"):
    failures.append("base:allocation was not negotiated")
else:
    seen = []
    def cb(context, offset, entries, err):
        seen.append((context, offset, list(entries)))
        return 0
    works("block status", lambda: h.block_status(size, 0, cb))
    total = sum(seen[0][2][0::2]) if seen else 0
    if not seen or seen[0][0] != "base:allocation" or not 0 < total <= size:
        failures.append(f"block status: {seen}")
    elif seen[0][2][1] & 2:
        failures.append(f"block status claims zeroes over data at offset 0: {seen}")
    seen.clear()
    works("block status with REQ_ONE", lambda: h.block_status(size, 0, cb, nbd.CMD_FLAG_REQ_ONE))
    if len(seen) != 1 or len(seen[0][2]) != 2 or seen[0][2][0] > size:
        failures.append(f"block status with REQ_ONE: not one extent: {seen}")
    refused(h, "block status past the end", EINVAL, lambda: h.block_status(4096, size, cb))
    refused(h, "block status with unknown flag 1<<9", EINVAL, lambda: h.block_status(4096, 0, cb, 1 << 9))
    refused(h, "block status of length 0", EINVAL, lambda: h.block_status(0, 0, cb))
h.shutdown()

print(f"{checked} checks")
for f in failures:
    print("FAIL", f)
raise SystemExit(1 if failures else 0)
"#;

    #[test]
    fn refused_requests_get_the_right_errno_and_the_connection_survives() {
        const NAME: &str =
            "strict_off::refused_requests_get_the_right_errno_and_the_connection_survives";
        let Some(python) = python_with_libnbd(NAME) else {
            return;
        };
        let dir = tmpdir();
        let stack = write_stack(
            &dir,
            "[device.a]\ntype = \"mem\"\nsize = \"16M\"\n\n\
             [export.rw]\ndevice = \"a\"\ndefault = true\n\n\
             [export.ro]\ndevice = \"a\"\nread_only = true\n",
        );
        let srv = Server::start_in(dir, &[path_str(&stack)]);
        libnbd_script(&python, SCRIPT, &srv.sock, &[], " checks");
    }
}

// ---------------------------------------------------------------------------------------
// Clients that did not ask for block sizes: requests at any byte (issue 16)

mod unaligned {
    use super::*;

    /// A byte-granular model test: random reads, writes, write-zeroes, trims and flushes
    /// at any offset and length, from a libnbd client that did not ask for block sizes
    /// (and with its own checks off), each checked against an in-memory copy. At the end
    /// a second client that did ask reads the whole device back.
    const MODEL: &str = r#"
import os, random
import nbd

sock, name = os.environ["CAIRN_SOCK"], os.environ.get("CAIRN_EXPORT", "")
want_block = int(os.environ["CAIRN_BLOCK"])
rng = random.Random(int(os.environ["CAIRN_SEED"]))
ops = int(os.environ["CAIRN_OPS"])

def connect(structured, block_sizes):
    h = nbd.NBD()
    h.set_strict_mode(0)
    h.set_request_block_size(block_sizes)
    h.set_request_structured_replies(structured)
    h.set_export_name(name)
    h.connect_unix(sock)
    return h

def read_all(h, size):
    out = bytearray()
    while len(out) < size:
        n = min(8 << 20, size - len(out))
        out += h.pread(n, len(out))
    return out

failures = []
counts = {}
for structured in (True, False):
    h = connect(structured, False)
    size = h.get_size()
    block = h.get_block_size(nbd.SIZE_MINIMUM)
    if block != want_block:
        failures.append(f"minimum block size {block}, want {want_block}")
    model = read_all(h, size)
    def where():
        # Mostly near block boundaries, where the edges are; sometimes anywhere, and
        # sometimes at the very end of the device.
        k = rng.random()
        if k < 0.6:
            off = rng.randrange(0, size // block) * block + rng.randrange(-8, 9)
            ln = rng.choice([1, 2, 7, block - 1, block, block + 1, 3 * block + 5,
                             rng.randrange(1, 4 * block)])
        elif k < 0.9:
            off = rng.randrange(0, size)
            ln = rng.randrange(1, 300_000)
        else:
            ln = rng.randrange(1, 3 * block)
            off = size - ln - rng.randrange(0, 3)
        off = min(max(off, 0), size - 1)
        return off, max(1, min(ln, size - off))
    for i in range(ops):
        op = rng.choices("rwztf", weights=[30, 35, 15, 15, 5])[0]
        counts[op] = counts.get(op, 0) + 1
        off, ln = where()
        fua = nbd.CMD_FLAG_FUA if rng.random() < 0.2 else 0
        what = f"{'structured' if structured else 'simple'} op {i}: {op} {ln} bytes at {off}"
        try:
            if op == "r":
                got = h.pread(ln, off)
                if got != model[off:off + ln]:
                    bad = next(j for j in range(ln) if got[j] != model[off + j])
                    failures.append(f"{what}: byte {off + bad} is {got[bad]:#x}, want {model[off + bad]:#x}")
                    break
            elif op == "w":
                data = rng.randbytes(ln)
                h.pwrite(data, off, fua)
                model[off:off + ln] = data
            elif op == "z":
                flags = fua | (nbd.CMD_FLAG_NO_HOLE if rng.random() < 0.5 else 0)
                h.zero(ln, off, flags)
                model[off:off + ln] = bytes(ln)
            elif op == "t":
                h.trim(ln, off, fua)
                # Partial blocks keep their bytes; each whole block inside reads as it was
                # or as zeroes.
                s = (off + block - 1) // block * block
                e = (off + ln) // block * block
                for b in range(s, e, block):
                    got = h.pread(block, b)
                    if got != model[b:b + block] and got != bytes(block):
                        failures.append(f"{what}: trimmed block {b} is neither old nor zero")
                    model[b:b + block] = got
            else:
                h.flush()
        except nbd.Error as e:
            failures.append(f"{what}: {e.string}")
            break
        if failures:
            break
    # A client that did ask for block sizes sees the same bytes.
    g = connect(True, True)
    if g.get_block_size(nbd.SIZE_MINIMUM) != want_block:
        failures.append("the second client sees another block size")
    if read_all(g, size) != model:
        failures.append(f"{'structured' if structured else 'simple'}: the device differs from the model at the end")
    try:
        g.pread(100, 1)
        failures.append("a client that asked for block sizes was served an unaligned read")
    except nbd.Error as e:
        if e.errnum != 22:
            failures.append(f"unaligned read from a client that asked for block sizes: {e.string}")
    g.shutdown()
    h.shutdown()
    if failures:
        break

print("ops", counts)
for f in failures:
    print("FAIL", f)
raise SystemExit(1 if failures else 0)
"#;

    fn model(name: &str, srv: &Server, export: &str, block: u32, seed: u64) {
        let Some(python) = python_with_libnbd(name) else {
            return;
        };
        let env = [
            ("CAIRN_EXPORT", export.to_string()),
            ("CAIRN_BLOCK", block.to_string()),
            ("CAIRN_SEED", seed.to_string()),
            ("CAIRN_OPS", "1500".to_string()),
        ];
        libnbd_script(&python, MODEL, &srv.sock, &env, "ops {");
        let log = srv.stderr();
        assert!(
            log.contains("not aligned to the export's"),
            "the server did not see unaligned requests:\n{log}"
        );
    }

    #[test]
    fn model_on_mem() {
        let srv = Server::start(&["--device", "mem:16M"]);
        model("unaligned::model_on_mem", &srv, "", 512, 1);
    }

    #[test]
    fn model_on_mem_with_4k_blocks() {
        let srv = Server::start(&["--device", "mem:16M,block=4096"]);
        model("unaligned::model_on_mem_with_4k_blocks", &srv, "", 4096, 2);
    }

    #[test]
    fn model_on_raid10() {
        let dir = tmpdir();
        let mut toml = String::new();
        for i in 0..4 {
            toml += &format!("[device.m{i}]\ntype = \"mem\"\nsize = \"8M\"\n\n");
        }
        toml += "[device.r]\ntype = \"raid10\"\nmembers = [\"m0\", \"m1\", \"m2\", \"m3\"]\n\
                 chunk = \"64K\"\n\n[export.r]\ndevice = \"r\"\ndefault = true\n";
        let stack = write_stack(&dir, &toml);
        let srv = Server::start_in(dir, &[path_str(&stack)]);
        model("unaligned::model_on_raid10", &srv, "r", 512, 3);
    }

    /// A file opened with O_DIRECT on a loop device with 4096-byte sectors: the device's
    /// blocks are 4 KiB, and every read-modify-write reads and writes aligned buffers.
    #[test]
    fn model_on_a_direct_file_with_4k_blocks() {
        const NAME: &str = "unaligned::model_on_a_direct_file_with_4k_blocks";
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            skip(NAME, "needs root (losetup)");
            return;
        }
        let Some([losetup]) = tools(NAME, ["losetup"]) else {
            return;
        };
        let dir = tmpdir();
        let img = dir.path().join("disk.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        let out = run(Command::new(&losetup)
            .args([
                "--find",
                "--show",
                "--sector-size",
                "4096",
                "--direct-io=on",
            ])
            .arg(&img));
        if !out.status.success() {
            skip(
                NAME,
                &format!("losetup: no loop device: {}", text(&out.stderr).trim()),
            );
            return;
        }
        let dev = text(&out.stdout).trim().to_string();
        let _detach = filesystem::Mounted {
            umount: PathBuf::new(),
            losetup: losetup.clone(),
            fusermount: PathBuf::new(),
            mnt: None,
            loop_dev: Some(dev.clone()),
            fuse: None,
        };
        let spec = format!("file:{dev},direct=1");
        let srv = Server::start_in(dir, &["--device", &spec]);
        model(NAME, &srv, "", 4096, 4);
    }

    /// Concurrent unaligned writes to the same blocks, from one connection and from two
    /// on different reactors, and aligned writes racing read-modify-writes of the blocks
    /// they cover: no byte written by a request that succeeded is lost.
    const RACE: &str = r#"
import os, random
import nbd

sock = os.environ["CAIRN_SOCK"]
rng = random.Random(5)
failures = []

def connect():
    h = nbd.NBD()
    h.set_strict_mode(0)
    h.set_request_block_size(False)
    h.connect_unix(sock)
    return h

def drain(hs):
    for h in hs:
        while h.aio_in_flight() > 0:
            h.poll(-1)

a, b = connect(), connect()
block = a.get_block_size(nbd.SIZE_MINIMUM)
size = a.get_size()
blocks = size // block
base = 0

def fresh(n):
    global base
    if base + n > blocks:
        raise SystemExit("ran out of fresh blocks")
    base += n
    return base - n

for rnd in range(20):
    # 1. One connection: every block gets 8 writes to disjoint byte ranges, all in flight
    #    at once, mixed with write-zeroes of other ranges.
    n = 16
    first = fresh(n)
    want = {}
    for k in range(n):
        at = (first + k) * block
        cuts = sorted(rng.sample(range(1, block), 15))
        pieces = list(zip([0] + cuts, cuts + [block]))
        rng.shuffle(pieces)
        for j, (lo, hi) in enumerate(pieces):
            if j % 5 == 4:
                a.aio_zero(hi - lo, at + lo)
                want[(at + lo, hi - lo)] = bytes(hi - lo)
            else:
                data = bytes([(rnd * 31 + k * 7 + j) % 255 + 1]) * (hi - lo)
                a.aio_pwrite(data, at + lo)
                want[(at + lo, hi - lo)] = data
    drain([a])
    # 2. Two connections (two reactors): the same, each taking every other piece.
    first2 = fresh(n)
    for k in range(n):
        at = (first2 + k) * block
        cuts = sorted(rng.sample(range(1, block), 15))
        for j, (lo, hi) in enumerate(zip([0] + cuts, cuts + [block])):
            data = bytes([(rnd * 17 + k * 5 + j) % 255 + 1]) * (hi - lo)
            (a if j % 2 else b).aio_pwrite(data, at + lo)
            want[(at + lo, hi - lo)] = data
    drain([a, b])
    # 3. Aligned writes of whole blocks on one connection, racing read-modify-writes of
    #    a few bytes of the same blocks on the other. Each block must end up as the
    #    aligned write, with or without the few bytes on top: never with a byte of what
    #    was there before (zeroes).
    first3 = fresh(n)
    races = []
    for k in range(n):
        at = (first3 + k) * block
        lo = rng.randrange(1, block - 64)
        hi = lo + rng.randrange(1, 64)
        whole = bytes([0xaa]) * block
        few = bytes([0xbb]) * (hi - lo)
        if k % 2:
            a.aio_pwrite(whole, at)
            b.aio_pwrite(few, at + lo)
        else:
            b.aio_pwrite(few, at + lo)
            a.aio_pwrite(whole, at)
        races.append((at, lo, hi))
    drain([a, b])
    for (off, ln), data in want.items():
        got = a.pread(ln, off)
        if got != data:
            failures.append(f"round {rnd}: {ln} bytes at {off} lost ({got[:8]!r}, want {data[:8]!r})")
    for at, lo, hi in races:
        got = a.pread(block, at)
        one = bytes([0xaa]) * block
        two = one[:lo] + bytes([0xbb]) * (hi - lo) + one[hi:]
        if got != one and got != two:
            failures.append(f"round {rnd}: block at {at} lost an aligned write's bytes")
    want.clear()
    if failures:
        break

a.shutdown()
b.shutdown()
print("rounds done")
for f in failures[:20]:
    print("FAIL", f)
raise SystemExit(1 if failures else 0)
"#;

    #[test]
    fn concurrent_unaligned_writes_to_the_same_blocks_lose_no_bytes() {
        const NAME: &str =
            "unaligned::concurrent_unaligned_writes_to_the_same_blocks_lose_no_bytes";
        let Some(python) = python_with_libnbd(NAME) else {
            return;
        };
        // A delay on writes keeps each read-modify-write's read and write 2 ms apart,
        // so that the other connection's writes land between them unless they are ordered.
        let dir = tmpdir();
        let stack = write_stack(
            &dir,
            "[device.m]\ntype = \"mem\"\nsize = \"16M\"\n\n\
             [device.slow]\ntype = \"delay\"\nbase = \"m\"\nwrite = \"2ms\"\n",
        );
        let stack = path_str(&stack).to_string();
        for args in [
            &["--device", "mem:16M"][..],
            &["--device", "mem:64M,block=4096"],
            &[stack.as_str()],
        ] {
            let srv = Server::start(&[args, &["--threads", "2"]].concat());
            libnbd_script(&python, RACE, &srv.sock, &[], "rounds done");
        }
        drop(dir);
    }

    /// What is refused: unaligned requests from a client that asked for block sizes, and
    /// from any client on an export with strict_alignment; what is not: the same requests
    /// from a client that did not ask, including past-the-end checks at byte precision.
    const POLICY: &str = r#"
import errno, os
import nbd

sock = os.environ["CAIRN_SOCK"]
failures = []

def connect(name, block_sizes):
    h = nbd.NBD()
    h.set_strict_mode(0)
    h.set_request_block_size(block_sizes)
    h.set_export_name(name)
    h.connect_unix(sock)
    return h

def expect(what, want, f):
    try:
        f()
        if want:
            failures.append(f"{what}: succeeded, want {errno.errorcode[want]}")
    except nbd.Error as e:
        if e.errnum != want:
            failures.append(f"{what}: {e.string}, want {errno.errorcode[want] if want else 'success'}")

for name, asks, ok in (("relaxed", False, True), ("relaxed", True, False),
                       ("strict", False, False), ("strict", True, False)):
    h = connect(name, asks)
    size = h.get_size()
    w = f"{name}, {'asked' if asks else 'did not ask'} for block sizes"
    want = 0 if ok else errno.EINVAL
    expect(f"{w}: read 100 at 1", want, lambda: h.pread(100, 1))
    expect(f"{w}: write 100 at 1", want, lambda: h.pwrite(b"x" * 100, 1))
    expect(f"{w}: zero 100 at 1", want, lambda: h.zero(100, 1))
    expect(f"{w}: trim 100 at 1", want, lambda: h.trim(100, 1))
    expect(f"{w}: cache 100 at 1", want, lambda: h.cache(100, 1))
    if ok:
        expect(f"{w}: read of the last byte", 0, lambda: h.pread(1, size - 1))
        expect(f"{w}: read one byte past the end", errno.EINVAL, lambda: h.pread(2, size - 1))
        expect(f"{w}: write one byte past the end", errno.ENOSPC, lambda: h.pwrite(b"xy", size - 1))
        expect(f"{w}: fast zero of part of a block", errno.ENOTSUP,
               lambda: h.zero(100, 1, nbd.CMD_FLAG_FAST_ZERO))
        expect(f"{w}: read of 1 MiB + 14 at 1", 0, lambda: h.pread(1048590, 1))
        h.pwrite(b"x" * 100, 1)
        if h.pread(102, 0) != b"\0" + b"x" * 100 + b"\0":
            failures.append(f"{w}: the write did not stick")
    h.shutdown()

for f in failures:
    print("FAIL", f)
print("checked")
raise SystemExit(1 if failures else 0)
"#;

    #[test]
    fn asked_for_block_sizes_or_strict_alignment_keeps_einval() {
        const NAME: &str = "unaligned::asked_for_block_sizes_or_strict_alignment_keeps_einval";
        let Some(python) = python_with_libnbd(NAME) else {
            return;
        };
        let dir = tmpdir();
        let stack = write_stack(
            &dir,
            "[device.a]\ntype = \"mem\"\nsize = \"16M\"\n\n\
             [device.b]\ntype = \"mem\"\nsize = \"16M\"\n\n\
             [export.relaxed]\ndevice = \"a\"\n\n\
             [export.strict]\ndevice = \"b\"\nstrict_alignment = true\n",
        );
        let srv = Server::start_in(dir, &[path_str(&stack)]);
        libnbd_script(&python, POLICY, &srv.sock, &[], "checked");
    }

    #[test]
    fn strict_alignment_flag_needs_device_and_refuses_unaligned() {
        const NAME: &str = "unaligned::strict_alignment_flag_needs_device_and_refuses_unaligned";
        let dir = tmpdir();
        let stack = write_stack(
            &dir,
            "[device.a]\ntype = \"mem\"\nsize = \"16M\"\n\n[export.x]\ndevice = \"a\"\n",
        );
        let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args([
            "serve",
            "--strict-alignment",
            path_str(&stack),
        ]));
        assert!(!out.status.success());
        assert!(
            text(&out.stderr).contains("--strict-alignment applies to --device"),
            "{}",
            text(&out.stderr)
        );
        let Some(python) = python_with_libnbd(NAME) else {
            return;
        };
        let srv = Server::start(&["--device", "mem:16M", "--strict-alignment"]);
        let script = "import nbd, os\nh = nbd.NBD()\nh.set_strict_mode(0)\n\
                      h.set_request_block_size(False)\nh.connect_unix(os.environ['CAIRN_SOCK'])\n\
                      try:\n    h.pread(100, 1)\n    raise SystemExit('served')\n\
                      except nbd.Error as e:\n    assert e.errnum == 22, e.string\nprint('refused')\n";
        libnbd_script(&python, script, &srv.sock, &[], "refused");
    }
}

// ---------------------------------------------------------------------------------------
// A raw socket: the protocol by hand, and broken on purpose

mod raw {
    use super::*;

    #[test]
    fn bad_request_magic_closes_the_connection() {
        let srv = Server::start(&["--device", "mem:16M"]);
        let (mut c, size, _) = Raw::go(&srv.sock, "");
        assert_eq!(size, 16 << 20);
        let mut h = header(0, CMD_READ, 1, 0, 4096);
        h[..4].copy_from_slice(&0xdead_beefu32.to_be_bytes());
        c.send(&h).unwrap();
        assert_closed(&mut c, "a request with a bad magic");
        // The server itself is fine.
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        c.read_ok(2, 0, 4096);
        c.disconnect();
    }

    #[test]
    fn oversized_write_payload_is_skipped_never_parsed_as_requests() {
        let srv = Server::start(&["--device", "mem:16M", "--max-payload", "64K"]);
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        let data = random_bytes(4096, 3);
        c.write_ok(1, 0, 0, &data);
        // 128 KiB over a 64 KiB limit; the payload is nothing but valid READ headers, sent
        // in pieces so the server sees it across many receives.
        let payload = smuggled(128 << 10);
        c.send(&header(0, CMD_WRITE, 2, 0, 128 << 10)).unwrap();
        for piece in payload.chunks(9_999) {
            if c.send(piece).is_err() {
                break; // hung up: allowed
            }
        }
        match c.reply() {
            Ok((error, cookie)) => {
                assert!(
                    cookie & SMUGGLED != SMUGGLED,
                    "the server answered request {cookie:#x}, hidden in the payload"
                );
                assert_eq!((cookie, error), (2, EINVAL));
                // The connection still works, and nothing was written.
                assert_same("offset 0", &c.read_ok(3, 0, 4096), &data);
                c.disconnect();
                assert_closed(&mut c, "after DISC (no replies to the payload)");
            }
            Err(_) => assert_closed(&mut c, "an oversized write"),
        }

        // Far over any limit (over 256 MiB): the server hangs up rather than skip it.
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        c.send(&header(0, CMD_WRITE, 4, 0, (256 << 20) + 4096))
            .unwrap();
        let _ = c.send(&smuggled(64 << 10));
        assert_closed(&mut c, "a write of 256 MiB + 4 KiB");
    }

    /// At the defaults, writes and reads of more than 32 MiB (up to 48 MiB, as the NBD
    /// reference project's integrityhuge test sends them, ignoring the advertised
    /// maximum) are served, from a client that did not ask for block sizes.
    #[test]
    fn payloads_over_32_mib_are_served_at_the_defaults() {
        let srv = Server::start(&["--device", "mem:64M"]);
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        let data = random_bytes(48 << 20, 9);
        let mut w = c.s.try_clone().unwrap();
        let all = [
            header(0, CMD_WRITE, 1, 4096, data.len() as u32),
            data.clone(),
        ]
        .concat();
        let sender = std::thread::spawn(move || w.write_all(&all));
        c.expect(1, 0);
        sender.join().unwrap().unwrap();
        assert_same("48 MiB read back", &c.read_ok(2, 4096, 48 << 20), &data);
        // Over the maximum (64 MiB): refused, the payload skipped, the connection fine.
        let big = 64 << 20 | 4096;
        let mut w = c.s.try_clone().unwrap();
        let sender = std::thread::spawn(move || {
            w.write_all(&header(0, CMD_WRITE, 3, 0, big))?;
            w.write_all(&vec![0x5a; big as usize])
        });
        c.expect(3, EINVAL);
        sender.join().unwrap().unwrap();
        assert_same(
            "after the refusal",
            &c.read_ok(4, 4096, 4096),
            &data[..4096],
        );
        c.disconnect();
        assert!(
            srv.wait_for_stderr("is over --max-payload (67108864 bytes)", IO_TIMEOUT),
            "no log line for the refused write:\n{}",
            srv.stderr()
        );
    }

    #[test]
    fn read_longer_than_max_payload_is_refused_with_einval() {
        let srv = Server::start(&["--device", "mem:16M", "--max-payload", "64K"]);
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        c.request(0, CMD_READ, 1, 0, 128 << 10, &[]).unwrap();
        let (error, cookie) = c.reply().unwrap();
        assert_eq!(cookie, 1);
        assert_eq!(
            error, EINVAL,
            "a 128 KiB read with --max-payload 64K (the NBD spec: the server SHOULD \
             report EINVAL for a request larger than the advertised maximum block size)"
        );
        c.read_ok(2, 0, 4096);
        c.disconnect();
    }

    /// A client that did not ask for block sizes: an unaligned write whose payload
    /// arrives in small pieces (received into the middle of its blocks), pipelined with
    /// unaligned reads, over simple replies.
    #[test]
    fn unaligned_write_payload_arrives_in_pieces() {
        let srv = Server::start(&["--device", "mem:16M,block=4096"]);
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        let old = random_bytes(3 * 4096, 6);
        c.write_ok(1, 0, 0, &old);
        let data = random_bytes(10_000, 7);
        c.send(&header(0, CMD_WRITE, 2, 3, data.len() as u32))
            .unwrap();
        for piece in data.chunks(999) {
            c.send(piece).unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        c.expect(2, 0);
        let mut want = old.clone();
        want[3..3 + data.len()].copy_from_slice(&data);
        // Three reads in flight at once, each at an odd offset.
        for (cookie, offset, len) in [(3u64, 1u64, 5000u32), (4, 5001, 4000), (5, 9001, 3287)] {
            c.request(0, CMD_READ, cookie, offset, len, &[]).unwrap();
        }
        let mut got = vec![0u8; 12_288];
        got[0] = want[0];
        for _ in 0..3 {
            let (error, cookie) = c.reply().unwrap();
            assert_eq!(error, 0, "read {cookie}");
            let (offset, len) = match cookie {
                3 => (1, 5000),
                4 => (5001, 4000),
                _ => (9001, 3287),
            };
            let b = c.read_exact(len).unwrap();
            got[offset..offset + len].copy_from_slice(&b);
        }
        assert_same("after the unaligned write", &got, &want);
        c.disconnect();
    }

    /// Writes that wait for buffer memory (the connection holds its limit) are counted
    /// once each in the connection's figures, however often their header is looked at.
    #[test]
    fn writes_waiting_for_buffer_memory_are_counted_once() {
        let dir = tmpdir();
        let ctl = dir.path().join("admin.sock");
        // Slow writes: the next header arrives while the connection holds its limit.
        let stack = write_stack(
            &dir,
            "[device.m]\ntype = \"mem\"\nsize = \"16M\"\n\n\
             [device.slow]\ntype = \"delay\"\nbase = \"m\"\nwrite = \"20ms\"\n",
        );
        let srv = Server::start_in(
            dir,
            &[
                path_str(&stack),
                "--max-payload",
                "1M",
                "--buffer-memory",
                "1M",
                "--admin",
                path_str(&ctl),
            ],
        );
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        let mut all = Vec::new();
        let data = random_bytes(1 << 20, 8);
        for i in 0..8u64 {
            all.extend_from_slice(&header(0, CMD_WRITE, i, i << 20, 1 << 20));
            all.extend_from_slice(&data);
        }
        let mut w = c.s.try_clone().unwrap();
        let sender = std::thread::spawn(move || w.write_all(&all));
        for _ in 0..8 {
            let (error, cookie) = c.reply().unwrap();
            assert_eq!(error, 0, "write {cookie}");
        }
        sender.join().unwrap().unwrap();
        let out = admin::admin(&ctl, &["status", "--json"]);
        let status: Value = serde_json::from_str(&text(&out.stdout))
            .unwrap_or_else(|e| panic!("status --json: {e}: {}", text(&out.stdout)));
        let conn = &status["exports"][0]["connections"][0];
        assert_eq!(conn["requests"], 8, "{status:#}");
        assert_eq!(conn["writes"], 8, "{status:#}");
        assert_eq!(conn["written_bytes"], 8u64 << 20, "{status:#}");
        assert_same(
            "the last write",
            &c.read_ok(9, 7 << 20, 4096),
            &data[..4096],
        );
        c.disconnect();
    }

    #[test]
    fn refused_writes_skip_their_payload() {
        let dir = tmpdir();
        let stack = write_stack(
            &dir,
            "[device.a]\ntype = \"mem\"\nsize = \"16M\"\n\n\
             [export.rw]\ndevice = \"a\"\ndefault = true\n\n\
             [export.ro]\ndevice = \"a\"\nread_only = true\n",
        );
        let srv = Server::start_in(dir, &[path_str(&stack)]);
        // The client asks for block sizes, so misaligned writes are refused too.
        let (mut c, size, flags) = Raw::go_strict(&srv.sock, "rw");
        assert_eq!(flags & TFLAG_READ_ONLY, 0);
        let head = random_bytes(4096, 4);
        let tail = random_bytes(4096, 5);
        c.write_ok(1, 0, 0, &head);
        c.write_ok(2, 0, size - 4096, &tail);
        let check = |c: &mut Raw, what: &str| {
            assert_same(
                &format!("after {what}: head"),
                &c.read_ok(90, 0, 4096),
                &head,
            );
            assert_same(
                &format!("after {what}: tail"),
                &c.read_ok(91, size - 4096, 4096),
                &tail,
            );
        };
        // (what, flags, offset, length, errno): each carries a payload of fake requests.
        let cases: [(&str, u16, u64, u32, u32); 6] = [
            ("a write past the end", 0, size, 4096, ENOSPC),
            ("a write across the end", 0, size - 4096, 8192, ENOSPC),
            ("a write at offset 1", 0, 1, 4096, EINVAL),
            ("a write of 100 bytes", 0, 0, 100, EINVAL),
            ("a write with unknown flag 1<<9", 1 << 9, 0, 4096, EINVAL),
            ("a write with DF", FLAG_DF, 0, 4096, EINVAL),
        ];
        for (i, (what, f, offset, len, errno)) in cases.into_iter().enumerate() {
            let cookie = 10 + i as u64;
            c.request(f, CMD_WRITE, cookie, offset, len, &smuggled(len as usize))
                .unwrap();
            c.expect(cookie, errno);
            check(&mut c, what);
        }
        // The read-only export of the same device.
        let (mut ro, _, flags) = Raw::go(&srv.sock, "ro");
        assert_ne!(flags & TFLAG_READ_ONLY, 0);
        ro.request(0, CMD_WRITE, 20, 0, 8192, &smuggled(8192))
            .unwrap();
        ro.expect(20, EPERM);
        ro.request(0, CMD_TRIM, 21, 0, 8192, &[]).unwrap();
        ro.expect(21, EPERM);
        assert_same("read-only head", &ro.read_ok(22, 0, 4096), &head);
        check(&mut c, "the read-only export's refusals");
        for (mut x, what) in [(c, "rw"), (ro, "ro")] {
            x.disconnect();
            assert_closed(
                &mut x,
                &format!("{what}: after DISC (no replies to payloads)"),
            );
        }
    }

    #[test]
    fn unknown_commands_get_einval_and_the_connection_survives() {
        let srv = Server::start(&["--device", "mem:16M"]);
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        let data = random_bytes(4096, 6);
        c.write_ok(1, 0, 0, &data);
        c.request(0, 99, 2, 0, 0, &[]).unwrap();
        c.expect(2, EINVAL);
        c.request(0, 99, 3, 4096, 4096, &[]).unwrap();
        c.expect(3, EINVAL);
        c.request(0, u16::MAX, 4, 0, 512, &[]).unwrap();
        c.expect(4, EINVAL);
        // Block status needs structured replies and a metadata context: neither here.
        c.request(0, CMD_BLOCK_STATUS, 5, 0, 4096, &[]).unwrap();
        c.expect(5, EINVAL);
        assert_same("after unknown commands", &c.read_ok(6, 0, 4096), &data);
        c.request(FLAG_FUA, CMD_FLUSH, 7, 0, 0, &[]).unwrap();
        c.expect(7, 0);
        // A flush's offset and length are reserved (must be 0).
        c.request(0, CMD_FLUSH, 8, 4096, 0, &[]).unwrap();
        c.expect(8, EINVAL);
        c.request(0, CMD_FLUSH, 9, 0, 4096, &[]).unwrap();
        c.expect(9, EINVAL);
        // Requests of length 0 are refused, a write's included (no payload follows).
        for (cookie, command) in [(10, CMD_READ), (11, CMD_WRITE), (12, CMD_TRIM)] {
            c.request(0, command, cookie, 4096, 0, &[]).unwrap();
            c.expect(cookie, EINVAL);
        }
        assert_same("after refused requests", &c.read_ok(13, 0, 4096), &data);
        c.disconnect();
        assert_closed(&mut c, "after DISC");
    }

    #[test]
    fn disc_after_pipelined_requests_answers_them_all_then_closes() {
        let srv = Server::start(&["--device", "mem:16M"]);
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        let mut batch = Vec::new();
        let blocks: Vec<Vec<u8>> = (0..32).map(|i| random_bytes(4096, 100 + i)).collect();
        for (i, b) in blocks.iter().enumerate() {
            batch.extend_from_slice(&header(0, CMD_WRITE, i as u64, i as u64 * 4096, 4096));
            batch.extend_from_slice(b);
        }
        batch.extend_from_slice(&header(0, CMD_FLUSH, 1000, 0, 0));
        batch.extend_from_slice(&header(0, CMD_DISC, 1001, 0, 0));
        c.send(&batch).unwrap();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..33 {
            let (error, cookie) = c.reply().expect("every request before DISC is answered");
            assert_eq!(error, 0, "request {cookie}");
            assert!(seen.insert(cookie), "two replies for {cookie}");
        }
        assert!(seen.contains(&1000));
        assert_closed(&mut c, "after DISC");
        // The writes landed.
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        for (i, b) in blocks.iter().enumerate() {
            assert_same(
                &format!("block {i}"),
                &c.read_ok(i as u64, i as u64 * 4096, 4096),
                b,
            );
        }
        c.disconnect();
    }

    #[test]
    fn structured_replies_by_hand() {
        let srv = Server::start(&["--device", "mem:16M"]);
        let (mut c, size, _) = Raw::handshake(&srv.sock, &[OPT_STRUCTURED_REPLY], "");
        let data = random_bytes(8192, 8);
        c.write_ok(1, FLAG_FUA, 4096, &data); // writes still get simple replies
        c.request(FLAG_DF, CMD_READ, 2, 4096, 8192, &[]).unwrap();
        let h = c.read_exact(20).unwrap();
        assert_eq!(be_u32(&h), STRUCTURED_REPLY_MAGIC, "{h:02x?}");
        let (flags, kind, cookie, len) = (
            be_u16(&h[4..]),
            be_u16(&h[6..]),
            be_u64(&h[8..]),
            be_u32(&h[16..]),
        );
        assert_eq!((kind, cookie), (CHUNK_OFFSET_DATA, 2));
        assert_ne!(flags & CHUNK_DONE, 0, "DF: one chunk, the last");
        assert_eq!(len, 8 + 8192);
        let body = c.read_exact(len as usize).unwrap();
        assert_eq!(be_u64(&body), 4096, "the chunk's offset");
        assert_same("structured read", &body[8..], &data);
        // An error chunk for a read past the end.
        c.request(0, CMD_READ, 3, size, 4096, &[]).unwrap();
        let h = c.read_exact(20).unwrap();
        assert_eq!(be_u32(&h), STRUCTURED_REPLY_MAGIC, "{h:02x?}");
        assert_eq!((be_u16(&h[6..]), be_u64(&h[8..])), (CHUNK_ERROR, 3));
        assert_ne!(be_u16(&h[4..]) & CHUNK_DONE, 0);
        let body = c.read_exact(be_u32(&h[16..]) as usize).unwrap();
        assert_eq!(be_u32(&body), EINVAL);
        assert_eq!(
            be_u16(&body[4..]) as usize,
            body.len() - 6,
            "message length"
        );
        c.disconnect();
        assert_closed(&mut c, "after DISC");
    }

    #[test]
    fn export_name_option_with_and_without_zeroes() {
        let srv = Server::start(&["--device", "mem:16M"]);
        for (client_flags, tail) in [(3u32, 10usize), (1, 10 + 124)] {
            let mut c = Raw::connect(&srv.sock);
            assert_eq!(c.greeting().unwrap() & 3, 3, "fixed newstyle, no zeroes");
            c.send(&client_flags.to_be_bytes()).unwrap();
            c.opt(OPT_EXPORT_NAME, b"").unwrap();
            let t = c.read_exact(tail).unwrap();
            assert_eq!(be_u64(&t), 16 << 20, "size");
            assert_ne!(be_u16(&t[8..]) & 1, 0, "HAS_FLAGS");
            assert!(t[10..].iter().all(|&b| b == 0), "the 124 zero bytes");
            c.read_ok(1, 0, 4096);
            c.disconnect();
            assert_closed(&mut c, "after DISC");
        }
        // An unknown name has no error reply: the server hangs up.
        let mut c = Raw::connect(&srv.sock);
        c.greeting().unwrap();
        c.send(&3u32.to_be_bytes()).unwrap();
        c.opt(OPT_EXPORT_NAME, b"nope").unwrap();
        assert_closed(&mut c, "EXPORT_NAME of an unknown export");
    }

    #[test]
    fn handshake_garbage_closes_the_connection() {
        let srv = Server::start(&["--device", "mem:16M"]);
        let start = || {
            let mut c = Raw::connect(&srv.sock);
            c.greeting().unwrap();
            c
        };
        // Unknown client flags.
        let mut c = start();
        c.send(&0x8000_0003u32.to_be_bytes()).unwrap();
        assert_closed(&mut c, "unknown client flags");
        // An option with the wrong magic.
        let mut c = start();
        c.send(&3u32.to_be_bytes()).unwrap();
        c.send(b"GARBAGE!\0\0\0\x07\0\0\0\x06").unwrap();
        assert_closed(&mut c, "an option with a bad magic");
        // Option data far over any limit (2 MiB).
        let mut c = start();
        c.send(&3u32.to_be_bytes()).unwrap();
        let mut h = IHAVEOPT.to_be_bytes().to_vec();
        h.extend_from_slice(&OPT_GO.to_be_bytes());
        h.extend_from_slice(&(2u32 << 20).to_be_bytes());
        c.send(&h).unwrap();
        let _ = c.send(&[0u8; 4096]);
        assert_closed(&mut c, "2 MiB of option data");
        // The client leaves in the middle of an option.
        let mut c = start();
        c.send(&3u32.to_be_bytes()).unwrap();
        c.send(&IHAVEOPT.to_be_bytes()).unwrap();
        drop(c);
        // ABORT is acknowledged, then the server closes.
        let mut c = start();
        c.send(&3u32.to_be_bytes()).unwrap();
        c.opt(OPT_ABORT, &[]).unwrap();
        let (o, t, _) = c.opt_reply().unwrap();
        assert_eq!((o, t), (OPT_ABORT, REP_ACK));
        assert_closed(&mut c, "after ABORT");

        // Errors that keep the handshake going: too big (skipped), unsupported, unknown
        // export; then GO still works on the same connection.
        let mut c = start();
        c.send(&3u32.to_be_bytes()).unwrap();
        c.opt(OPT_GO, &[0u8; 100 << 10]).unwrap();
        assert_eq!(c.opt_reply().unwrap().1, REP_ERR_TOO_BIG);
        c.opt(99, &[]).unwrap();
        assert_eq!(c.opt_reply().unwrap().1, REP_ERR_UNSUP);
        c.opt(OPT_GO, &go_data("nope")).unwrap();
        assert_eq!(c.opt_reply().unwrap().1, REP_ERR_UNKNOWN);
        c.opt(OPT_GO, &go_data("")).unwrap();
        loop {
            let (_, t, data) = c.opt_reply().unwrap();
            match t {
                REP_ACK => break,
                REP_INFO => {}
                t => panic!("GO after errors: reply {t:#x}: {}", text(&data)),
            }
        }
        c.read_ok(1, 0, 4096);
        c.disconnect();
        assert_closed(&mut c, "after DISC");
    }

    #[test]
    fn more_options_than_max_options_closes_the_connection() {
        let srv = Server::start(&["--device", "mem:16M", "--max-options", "4"]);
        let mut c = Raw::connect(&srv.sock);
        c.greeting().unwrap();
        c.send(&3u32.to_be_bytes()).unwrap();
        for _ in 0..4 {
            c.opt(99, &[]).unwrap();
            assert_eq!(c.opt_reply().unwrap().1, REP_ERR_UNSUP);
        }
        // The fifth option, even a good GO, is one too many.
        let _ = c.opt(OPT_GO, &go_data(""));
        assert_closed(&mut c, "a fifth option with --max-options 4");
        // Four options and a GO as the fourth is fine.
        let (mut c, _, _) = Raw::handshake(
            &srv.sock,
            &[
                OPT_STRUCTURED_REPLY,
                OPT_STRUCTURED_REPLY,
                OPT_STRUCTURED_REPLY,
            ],
            "",
        );
        c.write_ok(1, 0, 0, &[7u8; 512]);
        c.disconnect();
    }

    #[test]
    fn silent_clients_are_dropped_after_the_handshake_timeout() {
        let srv = Server::start(&["--device", "mem:16M", "--handshake-timeout", "1s"]);
        // Never reads the greeting, never sends anything.
        let mut a = Raw::connect(&srv.sock);
        // Sends its flags, then nothing.
        let mut b = Raw::connect(&srv.sock);
        b.greeting().unwrap();
        b.send(&3u32.to_be_bytes()).unwrap();
        // Half an option header, then nothing.
        let mut c = Raw::connect(&srv.sock);
        c.greeting().unwrap();
        c.send(&3u32.to_be_bytes()).unwrap();
        c.send(&IHAVEOPT.to_be_bytes()).unwrap();
        let mut g = [0u8; 18];
        a.s.read_exact(&mut g).unwrap();
        assert_closed(&mut a, "a client that sends nothing");
        assert_closed(&mut b, "a client that sends its flags only");
        assert_closed(&mut c, "a client that stops in an option header");
        // The timeout is for the handshake only: an idle client in transmission stays.
        let (mut d, _, _) = Raw::go(&srv.sock, "");
        std::thread::sleep(Duration::from_millis(1500));
        d.read_ok(1, 0, 4096);
        d.disconnect();
    }

    #[test]
    fn a_trickling_client_is_dropped_at_the_handshake_deadline() {
        let srv = Server::start(&["--device", "mem:16M", "--handshake-timeout", "1s"]);
        let mut c = Raw::connect(&srv.sock);
        c.greeting().unwrap();
        c.send(&3u32.to_be_bytes()).unwrap();
        let mut h = IHAVEOPT.to_be_bytes().to_vec();
        h.extend_from_slice(&3u32.to_be_bytes()); // LIST
        h.extend_from_slice(&1000u32.to_be_bytes()); // with 1000 bytes of data
        c.send(&h).unwrap();
        c.s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let started = Instant::now();
        let limit = Duration::from_secs(10);
        let mut buf = [0u8; 64];
        loop {
            assert!(
                started.elapsed() < limit,
                "a client trickling one byte per 300 ms is still connected {limit:?} into a 1 s handshake timeout"
            );
            if c.send(b"x").is_err() {
                break;
            }
            match c.s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => panic!("unexpected bytes: {:02x?}", &buf[..n]),
                Err(e) if e.kind() == ErrorKind::ConnectionReset => break,
                Err(_) => {} // still open
            }
        }
    }

    #[test]
    fn misbehaving_clients_do_not_stall_a_well_behaved_one() {
        const NAME: &str = "raw::misbehaving_clients_do_not_stall_a_well_behaved_one";
        let Some([nbdcopy]) = tools(NAME, ["nbdcopy"]) else {
            return;
        };
        // One reactor thread: every connection shares it.
        let srv = Server::start(&[
            "--device",
            "mem:16M",
            "--threads",
            "1",
            "--handshake-timeout",
            "60s",
        ]);
        // A: silent in the handshake.
        let mut a = Raw::connect(&srv.sock);
        a.greeting().unwrap();
        // B: a 1 MiB write whose payload stops after 1000 bytes.
        let (mut b, _, _) = Raw::go(&srv.sock, "");
        let b_data = random_bytes(1 << 20, 9);
        b.send(&header(0, CMD_WRITE, 1, 15 << 20, 1 << 20)).unwrap();
        b.send(&b_data[..1000]).unwrap();
        // C: 1000 reads of 64 KiB, and it reads none of the replies (yet).
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        let mut reads = Vec::new();
        for i in 0..1000u64 {
            reads.extend_from_slice(&header(0, CMD_READ, i, (i % 200) * 65536, 65536));
        }
        c.send(&reads).unwrap();
        // D: garbage after the handshake.
        let (mut d, _, _) = Raw::go(&srv.sock, "");
        d.send(&[0xffu8; 100]).unwrap();

        // Meanwhile nbdcopy copies 16 MiB in and out.
        let src = srv.path("src.img");
        let back = srv.path("back.img");
        let data = random_bytes(16 << 20, 10);
        std::fs::write(&src, &data).unwrap();
        success(
            "nbdcopy in, beside misbehaving clients",
            &run(Command::new(&nbdcopy).args([path_str(&src), &srv.uri()])),
        );
        success(
            "nbdcopy out, beside misbehaving clients",
            &run(Command::new(&nbdcopy).args([&srv.uri(), path_str(&back)])),
        );
        assert_same("nbdcopy round trip", &std::fs::read(&back).unwrap(), &data);

        assert_closed(&mut d, "garbage after the handshake");
        // B finishes its write; C reads its replies: all were kept.
        b.send(&b_data[1000..]).unwrap();
        b.expect(1, 0);
        assert_same("B's write", &b.read_ok(2, 15 << 20, 1 << 20), &b_data);
        let mut seen = vec![false; 1000];
        for _ in 0..1000 {
            let (error, cookie) = c.reply().expect("C's replies");
            assert_eq!(error, 0, "C's read {cookie}");
            assert!(!std::mem::replace(&mut seen[cookie as usize], true));
            c.read_exact(65536).unwrap();
        }
        for x in [&mut b, &mut c] {
            x.disconnect();
            assert_closed(x, "after DISC");
        }
        drop(a);
    }

    #[test]
    fn max_connections_refuses_a_third_connection_at_once() {
        let srv = Server::start(&["--device", "mem:16M", "--max-connections", "2"]);
        let (mut a, _, _) = Raw::go(&srv.sock, "");
        let (mut b, _, _) = Raw::go(&srv.sock, "");
        let mut c = Raw::connect(&srv.sock);
        assert_closed(&mut c, "a third connection with --max-connections 2");
        let data = random_bytes(4096, 11);
        a.write_ok(1, 0, 0, &data);
        assert_same("B reads A's write", &b.read_ok(2, 0, 4096), &data);
        // Connections that end in every way give their slot back.
        a.disconnect();
        assert_closed(&mut a, "after DISC");
        for round in 0..3 {
            let mut x = admitted(&srv.sock);
            match round {
                0 => drop(x), // leaves during the handshake
                1 => {
                    x.send(&0xffff_ffffu32.to_be_bytes()).unwrap();
                    assert_closed(&mut x, "bad client flags");
                }
                _ => {
                    x.send(&3u32.to_be_bytes()).unwrap();
                    x.opt(OPT_GO, &go_data("")).unwrap();
                    while x.opt_reply().unwrap().1 != REP_ACK {}
                    x.send(&[0u8; 28]).unwrap();
                    assert_closed(&mut x, "bad request magic");
                }
            }
        }
        let mut x = admitted(&srv.sock);
        x.send(&3u32.to_be_bytes()).unwrap();
        x.opt(OPT_GO, &go_data("")).unwrap();
        while x.opt_reply().unwrap().1 != REP_ACK {}
        assert_same("a later client", &x.read_ok(3, 0, 4096), &data);
        // B all along, and x: two at once again.
        assert_same("B still works", &b.read_ok(4, 0, 4096), &data);
        let mut y = Raw::connect(&srv.sock);
        assert_closed(&mut y, "a third connection again");
    }
}

// ---------------------------------------------------------------------------------------
// SIGTERM

mod shutdown {
    use super::*;

    /// A device that does not complete a request within the shutdown timeout: SIGTERM
    /// still ends the server, with status 1, a line saying what it abandons, and its
    /// socket files removed.
    #[test]
    fn a_stuck_device_ends_with_status_1_after_the_shutdown_timeout() {
        let dir = tmpdir();
        let ctl = dir.path().join("admin.sock");
        let stack = write_stack(
            &dir,
            "[device.a]\ntype = \"mem\"\nsize = \"8M\"\n\
             [device.d]\ntype = \"delay\"\nbase = \"a\"\nwrite = \"10s\"\n\
             [export.d]\ndevice = \"d\"\n",
        );
        let mut srv = Server::start_in(
            dir,
            &[
                path_str(&stack),
                "--shutdown-timeout",
                "1s",
                "--admin",
                path_str(&ctl),
            ],
        );
        let (mut c, _, _) = Raw::go(&srv.sock, "d");
        // In flight for 10 s: never answered before the deadline.
        c.request(0, CMD_WRITE, 1, 0, 4096, &[5u8; 4096]).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        srv.signal(libc::SIGTERM);
        let (status, log) = srv.wait_exit();
        assert_eq!(status.code(), Some(1), "{log}");
        assert!(log.contains("shutdown did not end within 1s"), "{log}");
        assert!(
            log.contains("requests in flight on d are abandoned"),
            "{log}"
        );
        assert!(!srv.sock.exists(), "the NBD socket file is left behind");
        assert!(!ctl.exists(), "the admin socket file is left behind");
    }

    /// Every event is one line with an RFC 3339 time and a level; each client's connect
    /// and disconnect are logged with its export, duration, requests, bytes and why it
    /// ended.
    #[test]
    fn logs_have_times_levels_and_a_line_per_connect_and_disconnect() {
        let mut srv = Server::start(&["--device", "mem:8M"]);
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        c.write_ok(1, 0, 0, &[3u8; 4096]);
        c.write_ok(2, 0, 4096, &[4u8; 4096]);
        c.disconnect();
        let deadline = Instant::now() + IO_TIMEOUT;
        while !srv.stderr().contains("disconnected from export") {
            assert!(Instant::now() < deadline, "{}", srv.stderr());
            std::thread::sleep(Duration::from_millis(10));
        }
        let (status, log) = srv.stop();
        assert!(status.success(), "{log}");
        for line in log.lines() {
            let (time, rest) = line.split_once(' ').unwrap_or(("", ""));
            let b = time.as_bytes();
            let rfc3339 = b.len() == 24
                && b[4] == b'-'
                && b[7] == b'-'
                && b[10] == b'T'
                && b[13] == b':'
                && b[16] == b':'
                && b[19] == b'.'
                && b[23] == b'Z'
                && time
                    .chars()
                    .enumerate()
                    .all(|(i, ch)| [4, 7, 10, 13, 16, 19, 23].contains(&i) || ch.is_ascii_digit());
            assert!(rfc3339, "no RFC 3339 time: {line}");
            let level = rest.split_whitespace().next().unwrap_or("");
            assert!(
                ["ERROR", "WARN", "INFO", "DEBUG"].contains(&level),
                "no level: {line}"
            );
        }
        let connect = log.lines().find(|l| l.contains("connected to export ''"));
        assert!(connect.is_some_and(|l| l.contains(" INFO ")), "{log}");
        let gone = log
            .lines()
            .find(|l| l.contains("disconnected from export ''"))
            .unwrap_or_else(|| panic!("{log}"));
        assert!(gone.contains(" 3 requests"), "{gone}");
        assert!(gone.contains("(the client disconnected)"), "{gone}");
        assert!(gone.contains(" after "), "{gone}");
    }

    /// SIGUSR1 and SIGUSR2 log a status and never stop the server; SIGHUP stops it as
    /// SIGTERM does, with the socket file removed.
    #[test]
    fn sigusr1_and_sigusr2_log_a_status_and_serving_goes_on() {
        let mut srv = Server::start(&["--device", "mem:8M"]);
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        for (sig, n) in [(libc::SIGUSR1, 1), (libc::SIGUSR2, 2)] {
            srv.signal(sig);
            let deadline = Instant::now() + IO_TIMEOUT;
            while srv.stderr().matches("serve: status: ").count() < n {
                assert!(
                    Instant::now() < deadline,
                    "no status after signal {sig}:\n{}",
                    srv.stderr()
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let log = srv.stderr();
        assert!(log.contains("1 connection(s)"), "{log}");
        assert!(log.contains("export '': mem"), "{log}");
        // Still serving, the connected client and a new one.
        c.write_ok(1, 0, 0, &[7u8; 4096]);
        let (mut d, _, _) = Raw::go(&srv.sock, "");
        d.write_ok(2, 0, 4096, &[8u8; 4096]);
        srv.signal(libc::SIGHUP);
        let (status, log) = srv.wait_exit();
        assert!(status.success(), "exit status {status}; stderr:\n{log}");
        assert!(!srv.sock.exists(), "the socket file is removed at exit");
    }

    #[test]
    fn sigterm_flushes_acknowledged_writes_and_exits_0() {
        let dir = tmpdir();
        let disk = dir.path().join("disk.img");
        let device = format!("file:{},size=64M", disk.display());
        let mut srv = Server::start_in(dir, &["--device", &device]);
        let (mut c, size, _) = Raw::go(&srv.sock, "");
        assert_eq!(size, 64 << 20);
        let a = random_bytes(1 << 20, 12);
        let b = random_bytes(256 << 10, 13);
        c.write_ok(1, 0, 0, &a);
        c.write_ok(2, FLAG_FUA, 32 << 20, &b);
        // The client stays connected, idle.
        let (status, log) = srv.stop();
        assert!(status.success(), "exit status {status}; stderr:\n{log}");
        assert!(log.contains("signal 15"), "{log}");
        assert_closed(&mut c, "a connected client at SIGTERM");
        assert!(!srv.sock.exists(), "the socket file is removed at exit");
        let file = std::fs::read(&disk).unwrap();
        assert_eq!(file.len(), 64 << 20);
        assert_same("first write", &file[..1 << 20], &a);
        assert_same("FUA write", &file[32 << 20..(32 << 20) + (256 << 10)], &b);
    }

    /// Through a write-back cache that would keep the data for 30 s: the client has gone
    /// without a flush, and SIGTERM still leaves every acknowledged write in the file
    /// (the cache is written back before the process exits).
    #[test]
    fn sigterm_writes_a_cache_back_before_exit() {
        let dir = tmpdir();
        let disk = dir.path().join("disk.img");
        let stack = write_stack(
            &dir,
            &format!(
                "[writeback]\nexpire = \"30s\"\ninterval = \"30s\"\n\
                 [device.f]\ntype = \"file\"\npath = \"{}\"\nsize = \"16M\"\n\
                 [device.c]\ntype = \"cache\"\nbase = \"f\"\nmemory = \"8M\"\n",
                disk.display()
            ),
        );
        let mut srv = Server::start_in(dir, &[path_str(&stack)]);
        let a = random_bytes(4 << 20, 21);
        {
            let (mut c, size, _) = Raw::go(&srv.sock, "");
            assert_eq!(size, 16 << 20);
            c.write_ok(1, 0, 4096, &a);
            c.disconnect();
        }
        let (status, log) = srv.stop();
        assert!(status.success(), "exit status {status}; stderr:\n{log}");
        let file = std::fs::read(&disk).unwrap();
        assert_same("cached write after exit", &file[4096..4096 + a.len()], &a);
    }

    #[test]
    fn sigterm_finishes_requests_in_flight_and_refuses_later_ones_with_eshutdown() {
        let dir = tmpdir();
        let disk = dir.path().join("disk.img");
        // Writes take 3 s: one stays in flight while the server shuts down.
        let stack = write_stack(
            &dir,
            &format!(
                "[device.f]\ntype = \"file\"\npath = \"{}\"\nsize = \"16M\"\n\n\
                 [device.slow]\ntype = \"delay\"\nbase = \"f\"\nwrite = \"3s\"\n",
                disk.display()
            ),
        );
        let mut srv = Server::start_in(dir, &[path_str(&stack)]);
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        let data = random_bytes(64 << 10, 14);
        c.request(0, CMD_WRITE, 1, 0, data.len() as u32, &data)
            .unwrap();
        // Requests are parsed in order: once a read sent after the write is answered (reads
        // are not delayed), the write's whole payload is in and the write is in flight.
        assert_same(
            "a read beside the write",
            &c.read_ok(50, 1 << 20, 4096),
            &[0u8; 4096],
        );
        srv.signal(libc::SIGTERM);
        assert!(
            srv.wait_for_stderr("signal 15", IO_TIMEOUT),
            "{}",
            srv.stderr()
        );
        // The reactor learns of the shutdown a moment after that line: probe with reads
        // until one is refused. The write in flight must not be answered before that.
        let mut write_error = None;
        let mut cookie = 100;
        let mut refused = false;
        while !refused {
            cookie += 1;
            c.request(0, CMD_READ, cookie, 1 << 20, 4096, &[])
                .expect("send a read after SIGTERM");
            loop {
                let (error, got) = c.reply().expect("a reply after SIGTERM");
                if got == 1 {
                    write_error = Some(error);
                    assert!(
                        refused,
                        "the write in flight finished before any later request was refused"
                    );
                    continue;
                }
                assert_eq!(got, cookie);
                match error {
                    0 => {
                        c.read_exact(4096).unwrap();
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    ESHUTDOWN => refused = true,
                    e => panic!("read after SIGTERM: error {e}"),
                }
                break;
            }
        }
        // Later writes are refused too (their payload skipped), and flushes.
        c.request(0, CMD_WRITE, 2, 1 << 20, 8192, &smuggled(8192))
            .unwrap();
        c.request(0, CMD_FLUSH, 3, 0, 0, &[]).unwrap();
        let mut replies = HashMap::new();
        while !(replies.contains_key(&2)
            && replies.contains_key(&3)
            && (write_error.is_some() || replies.contains_key(&1)))
        {
            let (error, got) = c.reply().expect("replies during shutdown");
            assert!(
                got & SMUGGLED != SMUGGLED,
                "answered hidden request {got:#x}"
            );
            replies.insert(got, error);
        }
        assert_eq!(replies.get(&2), Some(&ESHUTDOWN), "{replies:?}");
        assert_eq!(replies.get(&3), Some(&ESHUTDOWN), "{replies:?}");
        let write_error = write_error.or(replies.get(&1).copied());
        assert_eq!(write_error, Some(0), "the write in flight completes");
        assert_closed(&mut c, "after shutdown");
        let (status, log) = srv.wait_exit();
        assert!(status.success(), "exit status {status}; stderr:\n{log}");
        let file = std::fs::read(&disk).unwrap();
        assert_same("the write in flight", &file[..64 << 10], &data);
        assert!(
            file[1 << 20..(1 << 20) + 8192].iter().all(|&x| x == 0),
            "a write refused with ESHUTDOWN reached the disk"
        );
    }
    #[test]
    fn sigterm_answers_a_write_whose_payload_is_still_arriving() {
        let dir = tmpdir();
        let disk = dir.path().join("disk.img");
        let device = format!("file:{},size=16M", disk.display());
        let mut srv = Server::start_in(dir, &["--device", &device]);
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        let data = random_bytes(64 << 10, 15);
        c.send(&header(0, CMD_WRITE, 1, 0, data.len() as u32))
            .unwrap();
        c.send(&data[..1000]).unwrap();
        // Let the server read the header (it is idle: this only sets the scene).
        std::thread::sleep(Duration::from_millis(300));
        srv.signal(libc::SIGTERM);
        assert!(
            srv.wait_for_stderr("signal 15", IO_TIMEOUT),
            "{}",
            srv.stderr()
        );
        std::thread::sleep(Duration::from_millis(300));
        // The rest of the payload: the request was in flight before the signal, so it
        // gets a reply (done, or refused with ESHUTDOWN) before the server hangs up.
        let sent = c.send(&data[1000..]);
        let reply = c.reply();
        let (status, log) = srv.wait_exit();
        assert!(status.success(), "exit status {status}; stderr:\n{log}");
        let (error, cookie) = reply.unwrap_or_else(|e| {
            panic!(
                "no reply to a write in flight at SIGTERM ({e}; sending the rest of its \
                 payload: {sent:?})"
            )
        });
        assert_eq!(cookie, 1);
        assert!(error == 0 || error == ESHUTDOWN, "error {error}");
        assert_closed(&mut c, "after the reply");
        if error == 0 {
            let file = std::fs::read(&disk).unwrap();
            assert_same("the write", &file[..64 << 10], &data);
        }
    }
}

// ---------------------------------------------------------------------------------------
// A real file system, as root

mod filesystem {
    use super::*;

    /// Undoes a mount, a loop device and a FUSE mount, in that order, even on panic.
    pub(super) struct Mounted {
        pub(super) umount: PathBuf,
        pub(super) losetup: PathBuf,
        pub(super) fusermount: PathBuf,
        pub(super) mnt: Option<PathBuf>,
        pub(super) loop_dev: Option<String>,
        pub(super) fuse: Option<(PathBuf, Child)>,
    }

    impl Mounted {
        /// Unmounts the file system.
        pub(super) fn unmount(&mut self) {
            if let Some(m) = self.mnt.clone() {
                retry_busy("umount", || {
                    let mut c = Command::new(&self.umount);
                    c.arg(&m);
                    c
                });
                self.mnt = None;
            }
        }

        pub(super) fn detach(&mut self) {
            if let Some(l) = self.loop_dev.clone() {
                retry_busy("losetup -d", || {
                    let mut c = Command::new(&self.losetup);
                    c.args(["-d", &l]);
                    c
                });
                self.loop_dev = None;
            }
        }

        /// Unmounts the FUSE file; returns nbdfuse's exit status.
        fn unfuse(&mut self) -> Option<ExitStatus> {
            let dir = self.fuse.as_ref()?.0.clone();
            retry_busy("fusermount3 -u", || {
                let mut c = Command::new(&self.fusermount);
                c.arg("-u").arg(&dir);
                c
            });
            let (_, mut child) = self.fuse.take()?;
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if let Ok(Some(status)) = child.try_wait() {
                    return Some(status);
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("nbdfuse still running 30 s after fusermount3 -u");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// Runs a teardown command until it succeeds. "Busy" can be a passing state (a loop
    /// device is released asynchronously; a process of the parallel test run may hold a
    /// descriptor it inherited across fork for a moment), so it is retried for 20 s.
    pub(super) fn retry_busy(what: &str, make: impl Fn() -> Command) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let out = run_for(&mut make(), Duration::from_secs(60));
            if out.status.success() {
                return;
            }
            if !text(&out.stderr).to_lowercase().contains("busy") || Instant::now() > deadline {
                success(what, &out);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    impl Drop for Mounted {
        /// Whatever is still set up after a panic or a skip goes, quietly.
        fn drop(&mut self) {
            if let Some(m) = self.mnt.take() {
                let _ = Command::new(&self.umount).arg("-l").arg(m).status();
            }
            if let Some(l) = self.loop_dev.take() {
                let _ = Command::new(&self.losetup).args(["-d", &l]).status();
            }
            if let Some((dir, mut child)) = self.fuse.take() {
                let _ = Command::new(&self.fusermount)
                    .args(["-u", "-z"])
                    .arg(dir)
                    .status();
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    #[test]
    fn ext4_on_a_raid10_export_through_nbdfuse_and_a_loop_device() {
        const NAME: &str = "filesystem::ext4_on_a_raid10_export_through_nbdfuse_and_a_loop_device";
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            skip(NAME, "needs root (losetup, mount)");
            return;
        }
        if !Path::new("/dev/fuse").exists() {
            skip(NAME, "/dev/fuse is missing");
            return;
        }
        let Some([nbdfuse, fusermount, losetup, mkfs, fsck, mount, umount]) = tools(
            NAME,
            [
                "nbdfuse",
                "fusermount3",
                "losetup",
                "mkfs.ext4",
                "fsck.ext4",
                "mount",
                "umount",
            ],
        ) else {
            return;
        };
        let probe = run_for(Command::new(&losetup).arg("-f"), Duration::from_secs(30));
        if !probe.status.success() {
            skip(
                NAME,
                &format!("losetup -f: no loop device: {}", text(&probe.stderr).trim()),
            );
            return;
        }

        // RAID10 of four 33 MiB files with superblocks (the default): 32 MiB of data on
        // each, 64 MiB in all.
        let dir = tmpdir();
        let mut toml = String::new();
        for i in 0..4 {
            toml += &format!(
                "[device.d{i}]\ntype = \"file\"\npath = \"{}\"\nsize = \"33M\"\n\n",
                dir.path().join(format!("d{i}.img")).display()
            );
        }
        toml += "[device.r]\ntype = \"raid10\"\nmembers = [\"d0\", \"d1\", \"d2\", \"d3\"]\nchunk = \"64K\"\n";
        let stack = write_stack(&dir, &toml);
        let mut srv = Server::start_in(dir, &[path_str(&stack)]);

        let fuse_dir = srv.path("fuse");
        let mnt = srv.path("mnt");
        std::fs::create_dir(&fuse_dir).unwrap();
        std::fs::create_dir(&mnt).unwrap();
        let pidfile = srv.path("nbdfuse.pid");
        let fuse_log = srv.path("nbdfuse.log");
        let child = Command::new(&nbdfuse)
            .arg("-P")
            .arg(&pidfile)
            .arg(&fuse_dir)
            .arg(srv.uri())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(srv.path("nbdfuse.out")).unwrap())
            .stderr(std::fs::File::create(&fuse_log).unwrap())
            .spawn()
            .expect("start nbdfuse");
        let mut m = Mounted {
            umount: umount.clone(),
            losetup: losetup.clone(),
            fusermount,
            mnt: None,
            loop_dev: None,
            fuse: Some((fuse_dir.clone(), child)),
        };
        // Ready once the pid file is written.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !std::fs::read_to_string(&pidfile).is_ok_and(|s| !s.trim().is_empty()) {
            let exited = m.fuse.as_mut().unwrap().1.try_wait().unwrap();
            if let Some(status) = exited {
                m.fuse = None;
                let log = std::fs::read_to_string(&fuse_log).unwrap_or_default();
                if log.contains("fuse:") || log.contains("fusermount") {
                    skip(NAME, &format!("FUSE cannot mount here: {}", log.trim()));
                    return;
                }
                panic!("nbdfuse exited ({status}) before it was ready:\n{log}");
            }
            assert!(Instant::now() < deadline, "nbdfuse not ready after 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        let image = fuse_dir.join("nbd");
        assert_eq!(std::fs::metadata(&image).unwrap().len(), 64 << 20);

        let out = run_for(
            Command::new(&losetup)
                .args(["--find", "--show"])
                .arg(&image),
            Duration::from_secs(60),
        );
        if !out.status.success() {
            skip(
                NAME,
                &format!("losetup cannot attach: {}", text(&out.stderr).trim()),
            );
            return;
        }
        let dev = text(&out.stdout).trim().to_string();
        m.loop_dev = Some(dev.clone());
        success(
            "mkfs.ext4",
            &run(Command::new(&mkfs).args(["-q", "-F", &dev])),
        );
        success(
            "mount",
            &run(Command::new(&mount).args(["-t", "ext4", &dev]).arg(&mnt)),
        );
        m.mnt = Some(mnt.clone());
        let files: Vec<(PathBuf, Vec<u8>)> = (0..8)
            .map(|i| {
                let sub = mnt.join(format!("dir{}", i % 3));
                std::fs::create_dir_all(&sub).unwrap();
                (
                    sub.join(format!("file{i}")),
                    random_bytes((1 << 20) + i * 4096 + 17, 200 + i as u64),
                )
            })
            .collect();
        for (path, data) in &files {
            let mut f = std::fs::File::create(path).unwrap();
            f.write_all(data).unwrap();
            f.sync_all().unwrap();
        }
        std::fs::File::open(&mnt).unwrap().sync_all().unwrap();
        m.unmount();
        let out = run(Command::new(&fsck).args(["-f", "-n", &dev]));
        success("fsck.ext4 -f -n (a clean file system)", &out);
        // Mounted again, read-only: every file reads back.
        success(
            "mount -o ro",
            &run(Command::new(&mount)
                .args(["-t", "ext4", "-o", "ro", &dev])
                .arg(&mnt)),
        );
        m.mnt = Some(mnt.clone());
        for (path, data) in &files {
            assert_same(
                &path.display().to_string(),
                &std::fs::read(path).unwrap(),
                data,
            );
        }
        m.unmount();
        m.detach();
        let status = m.unfuse().expect("nbdfuse was running");
        assert!(status.success(), "nbdfuse exit status {status}");
        let (status, log) = srv.stop();
        assert!(status.success(), "exit status {status}; stderr:\n{log}");
        // md's near layout with four members and two copies: d0 mirrors d1, d2 mirrors d3,
        // in their data areas (after the 1 MiB metadata area, whose superblocks name each
        // member).
        let member =
            |i: usize| std::fs::read(srv.path(&format!("d{i}.img"))).unwrap()[1 << 20..].to_vec();
        assert_same("raid10 members d0 and d1", &member(0), &member(1));
        assert_same("raid10 members d2 and d3", &member(2), &member(3));
        assert!(member(0).iter().any(|&x| x != 0), "nothing reached d0");
    }
}

// ---------------------------------------------------------------------------------------
// TLS

mod tls {
    use super::*;

    /// A CA and a server certificate for `localhost` signed by it, made with openssl in
    /// `dir` (laid out as `--tls-certificates` and libnbd's `tls-certificates` expect).
    fn make_certs(test: &str, dir: &Path) -> bool {
        make_certs_with(test, dir, &["-newkey", "rsa:2048"])
    }

    /// [`make_certs`] with the server's key made by these `openssl req` arguments.
    fn make_certs_with(test: &str, dir: &Path, server_key: &[&str]) -> bool {
        let Some([openssl]) = tools(test, ["openssl"]) else {
            return false;
        };
        let sh = |args: &[&str]| {
            let out = run(Command::new(&openssl).args(args).current_dir(dir));
            success(&format!("openssl {args:?}"), &out);
        };
        sh(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca-key.pem",
            "-out",
            "ca-cert.pem",
            "-days",
            "2",
            "-subj",
            "/CN=cairn test CA",
        ]);
        sh(&[
            &["req"][..],
            server_key,
            &[
                "-nodes",
                "-keyout",
                "server-key.pem",
                "-out",
                "server.csr",
                "-subj",
                "/CN=localhost",
            ],
        ]
        .concat());
        std::fs::write(
            dir.join("ext.cnf"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        sh(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca-cert.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            "server-cert.pem",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ]);
        true
    }

    fn tls_uri(server: &Server, certs: &Path) -> String {
        format!(
            "nbds+unix:///?socket={}&tls-certificates={}",
            server.sock.display(),
            certs.display()
        )
    }

    #[test]
    fn nbdcopy_round_trip_over_tls_and_tls_required_refuses_plain_clients() {
        let test = "tls::nbdcopy_round_trip_over_tls_and_tls_required_refuses_plain_clients";
        let Some([nbdinfo, nbdcopy]) = tools(test, ["nbdinfo", "nbdcopy"]) else {
            return;
        };
        let certs = tmpdir();
        if !make_certs(test, certs.path()) {
            return;
        }
        let c = path_str(certs.path());
        let server = Server::start(&[
            "--device",
            "mem:64M",
            "--tls",
            "require",
            "--tls-certificates",
            c,
        ]);
        // A plain client is refused (TLS required) and nothing is served to it.
        let out = run(Command::new(&nbdinfo).arg(server.uri()));
        assert!(
            !out.status.success(),
            "plain nbdinfo succeeded: {}",
            text(&out.stdout)
        );
        // Over TLS: the handshake finishes and the export is described.
        let uri = tls_uri(&server, certs.path());
        let info = success("nbdinfo over TLS", &run(Command::new(&nbdinfo).arg(&uri)));
        assert!(info.contains("with TLS"), "{info}");
        // Data survives the round trip through rustls in both directions, large
        // requests (many TLS records each) included.
        let src = server.path("src.img");
        let back = server.path("back.img");
        let data = random_bytes(24 << 20, 7);
        std::fs::write(&src, &data).unwrap();
        success(
            "nbdcopy in over TLS",
            &run(Command::new(&nbdcopy).arg(&src).arg(&uri)),
        );
        success(
            "nbdcopy out over TLS",
            &run(Command::new(&nbdcopy).arg(&uri).arg(&back)),
        );
        let got = std::fs::read(&back).unwrap();
        assert_same("TLS round trip", &got[..data.len()], &data);
    }

    /// A TLS connection that received a burst of requests and went idle gives its
    /// buffers back (its receive cancelled, its ciphertext and input buffers dropped),
    /// then serves as before.
    #[test]
    fn an_idle_tls_connection_gives_its_buffers_back_and_serves_on() {
        let test = "tls::an_idle_tls_connection_gives_its_buffers_back_and_serves_on";
        let Some([python]) = tools(test, ["python3"]) else {
            return;
        };
        let certs = tmpdir();
        if !make_certs(test, certs.path()) {
            return;
        }
        let c = path_str(certs.path());
        let server = Server::start(&[
            "--device",
            "mem:16M",
            "--tls",
            "require",
            "--tls-certificates",
            c,
            "--log-level",
            "debug",
        ]);
        // A raw client over Python's ssl: it sends each burst in one write, so that the
        // server receives it in full records (libnbd writes request by request).
        let script = r#"
import os, socket, ssl, struct, sys, time
def exact(s, n):
    b = b""
    while len(b) < n:
        d = s.recv(n - len(b))
        assert d, "closed"
        b += d
    return b
def option(s, o, data=b""):
    s.sendall(struct.pack(">QII", 0x49484156454F5054, o, len(data)) + data)
    while True:
        _, ro, t, n = struct.unpack(">QIII", exact(s, 20))
        exact(s, n)
        assert t < 0x80000000, f"option {o}: error {t:#x}"
        if t == 1:
            return
def request(s, command, cookie, offset=0, length=0, data=b""):
    return struct.pack(">IHHQQI", 0x25609513, 0, command, cookie, offset, length) + data
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
exact(s, 18)
s.sendall(struct.pack(">I", 3))
option(s, 5)
ctx = ssl.create_default_context(cafile=sys.argv[2] + "/ca-cert.pem")
s = ctx.wrap_socket(s, server_hostname="localhost")
option(s, 7, struct.pack(">IH", 0, 0))
for round in range(3):
    # 9,000 flushes in one write: some 250 KiB of requests.
    s.sendall(b"".join(request(s, 3, j) for j in range(9000)))
    for j in range(9000):
        magic, err, cookie = struct.unpack(">IIQ", exact(s, 16))
        assert (magic, err, cookie) == (0x67446698, 0, j), (magic, err, cookie, j)
    # Idle long enough for the server to take its buffers back (a second, and up to
    # a second more before it looks).
    time.sleep(2.5)
    data = os.urandom(65536)
    s.sendall(request(s, 1, 1, 1 << 20, 65536, data) + request(s, 0, 2, 1 << 20, 65536))
    assert struct.unpack(">IIQ", exact(s, 16)) == (0x67446698, 0, 1)
    assert struct.unpack(">IIQ", exact(s, 16)) == (0x67446698, 0, 2)
    assert exact(s, 65536) == data
print("done")
"#;
        let out = run(Command::new(&python)
            .args(["-c", script])
            .arg(&server.sock)
            .arg(certs.path()));
        let stdout = success("the raw TLS client", &out);
        assert!(stdout.contains("done"), "{stdout}");
        // The log is read on another thread: give it time to catch up.
        let deadline = Instant::now() + IO_TIMEOUT;
        while server.stderr().matches("KiB of ciphertext buffer)").count() < 3
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        let log = server.stderr();
        assert!(!log.contains("WARN"), "{log}");
        assert_eq!(
            log.matches("KiB of ciphertext buffer)").count(),
            3,
            "input and ciphertext buffers given back after each burst: {log}"
        );
    }

    /// cairn's own client over TLS (`nbds+unix://`, the nbd device): a verified random
    /// read/write load through a server that requires TLS, so every byte went through
    /// rustls on both sides; a server certificate from another CA is refused unless
    /// `tls-verify-peer=false`.
    #[test]
    fn the_nbd_device_speaks_tls() {
        let test = "tls::the_nbd_device_speaks_tls";
        let certs = tmpdir();
        if !make_certs(test, certs.path()) {
            return;
        }
        let c = path_str(certs.path());
        let server = Server::start(&[
            "--device",
            "mem:64M",
            "--tls",
            "require",
            "--tls-certificates",
            c,
        ]);
        let uri = tls_uri(&server, certs.path());
        let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args([
            "bench",
            "--device",
            &format!("nbd:{uri}"),
            "--rw",
            "randrw",
            "--bs",
            "64k",
            "--runtime",
            "1s",
            "--time_based",
            "--verify",
            "crc32c",
        ]));
        let report = success("cairn bench over nbds://", &out);
        assert!(report.contains("blocks read back and checked"), "{report}");
        assert!(!report.contains("err="), "{report}");
        // Another CA: the server's certificate is not trusted.
        let other = tmpdir();
        if !make_certs(test, other.path()) {
            return;
        }
        let wrong = format!(
            "nbd:nbds+unix:///?socket={}&tls-certificates={}",
            server.sock.display(),
            other.path().display()
        );
        let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args([
            "bench",
            "--device",
            &wrong,
            "--runtime",
            "100ms",
        ]));
        assert!(!out.status.success(), "an untrusted server was accepted");
        let err = text(&out.stderr);
        assert!(
            err.contains("cannot connect") && err.contains("TLS"),
            "{err}"
        );
        let unverified = format!("{wrong}&tls-verify-peer=false");
        let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args([
            "bench",
            "--device",
            &unverified,
            "--runtime",
            "200ms",
            "--time_based",
        ]));
        success("cairn bench with tls-verify-peer=false", &out);
    }

    #[test]
    fn tls_is_optional_with_certificates_and_refused_without() {
        let test = "tls::tls_is_optional_with_certificates_and_refused_without";
        let Some([nbdinfo]) = tools(test, ["nbdinfo"]) else {
            return;
        };
        let certs = tmpdir();
        if !make_certs(test, certs.path()) {
            return;
        }
        let c = path_str(certs.path());
        // Certificates given: TLS is offered, plain clients still served.
        let server = Server::start(&["--device", "mem:16M", "--tls-certificates", c]);
        success(
            "plain nbdinfo",
            &run(Command::new(&nbdinfo).arg(server.uri())),
        );
        let info = success(
            "nbdinfo over TLS",
            &run(Command::new(&nbdinfo).arg(tls_uri(&server, certs.path()))),
        );
        assert!(info.contains("with TLS"), "{info}");
        drop(server);
        // No certificates: a client that insists on TLS is refused, cleanly.
        let server = Server::start(&["--device", "mem:16M"]);
        let out = run(Command::new(&nbdinfo).arg(tls_uri(&server, certs.path())));
        assert!(!out.status.success());
        success(
            "plain nbdinfo",
            &run(Command::new(&nbdinfo).arg(server.uri())),
        );
    }

    /// RSA keys of sizes ring refused (2432 bits, as the NBD reference project's test
    /// certificates have) and the usual 3072, in PKCS#8 and PKCS#1 form: the server
    /// starts, and data goes through TLS both ways.
    #[test]
    fn rsa_keys_of_2432_and_3072_bits_in_both_forms_serve_over_tls() {
        let test = "tls::rsa_keys_of_2432_and_3072_bits_in_both_forms_serve_over_tls";
        let Some([nbdcopy, openssl]) = tools(test, ["nbdcopy", "openssl"]) else {
            return;
        };
        for bits in ["2432", "3072"] {
            let certs = tmpdir();
            if !make_certs_with(test, certs.path(), &["-newkey", &format!("rsa:{bits}")]) {
                return;
            }
            for form in ["PKCS#8", "PKCS#1"] {
                if form == "PKCS#1" {
                    let key = certs.path().join("server-key.pem");
                    let out = run(Command::new(&openssl)
                        .args(["rsa", "-traditional", "-in"])
                        .arg(&key)
                        .arg("-out")
                        .arg(&key));
                    success("openssl rsa -traditional", &out);
                    let pem = std::fs::read_to_string(&key).unwrap();
                    assert!(pem.contains("BEGIN RSA PRIVATE KEY"), "{pem}");
                }
                let server = Server::start(&[
                    "--device",
                    "mem:16M",
                    "--tls",
                    "require",
                    "--tls-certificates",
                    path_str(certs.path()),
                ]);
                let uri = tls_uri(&server, certs.path());
                let src = server.path("src.img");
                let back = server.path("back.img");
                let data = random_bytes(1 << 20, bits.len() as u64);
                std::fs::write(&src, &data).unwrap();
                let what = format!("{bits}-bit RSA key ({form})");
                success(
                    &format!("nbdcopy in over TLS, {what}"),
                    &run(Command::new(&nbdcopy).arg(&src).arg(&uri)),
                );
                success(
                    &format!("nbdcopy out over TLS, {what}"),
                    &run(Command::new(&nbdcopy).arg(&uri).arg(&back)),
                );
                let got = std::fs::read(&back).unwrap();
                assert_same(&what, &got[..data.len()], &data);
            }
        }
    }

    /// Keys TLS cannot sign with are refused at start with what they are, not "failed to
    /// parse"; a file without a key says so.
    #[test]
    fn refused_keys_say_what_they_are() {
        let test = "tls::refused_keys_say_what_they_are";
        for (key, want) in [
            (
                &["-newkey", "rsa:1024"][..],
                "an RSA key of 1024 bits (PKCS#8)",
            ),
            (
                &["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:secp256k1"],
                "an EC key on secp256k1",
            ),
            (&["-newkey", "ed448"], "an Ed448 key"),
        ] {
            let certs = tmpdir();
            if !make_certs_with(test, certs.path(), key) {
                return;
            }
            let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args([
                "serve",
                "--listen",
                "unix:/nonexistent/never.sock",
                "--device",
                "mem:16M",
                "--tls-certificates",
                path_str(certs.path()),
            ]));
            assert!(!out.status.success(), "{key:?}: cairn serve started");
            let err = text(&out.stderr);
            assert!(
                err.contains(want) && err.contains("RSA keys of 2048 to 8192 bits"),
                "{key:?}: {err}"
            );
            assert_eq!(err.trim().lines().count(), 1, "{err}");
        }
        let certs = tmpdir();
        if !make_certs(test, certs.path()) {
            return;
        }
        std::fs::write(certs.path().join("server-key.pem"), "not a key\n").unwrap();
        let out = run(Command::new(env!("CARGO_BIN_EXE_cairn")).args([
            "serve",
            "--device",
            "mem:16M",
            "--tls-certificates",
            path_str(certs.path()),
        ]));
        assert!(!out.status.success());
        assert!(
            text(&out.stderr).contains("server-key.pem: no private key in the file"),
            "{}",
            text(&out.stderr)
        );
    }

    /// A client certificate signed by the test CA, in `client/` next to a copy of the CA
    /// (libnbd's layout: ca-cert.pem, client-cert.pem, client-key.pem).
    fn make_client_cert(test: &str, certs: &Path, client: &Path) -> bool {
        let Some([openssl]) = tools(test, ["openssl"]) else {
            return false;
        };
        let sh = |args: &[&str]| {
            let out = run(Command::new(&openssl).args(args).current_dir(certs));
            success(&format!("openssl {args:?}"), &out);
        };
        sh(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "client-key.pem",
            "-out",
            "client.csr",
            "-subj",
            "/CN=cairn test client",
        ]);
        std::fs::write(
            certs.join("client-ext.cnf"),
            "basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
             extendedKeyUsage=clientAuth
",
        )
        .unwrap();
        sh(&[
            "x509",
            "-req",
            "-in",
            "client.csr",
            "-CA",
            "ca-cert.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            "client-cert.pem",
            "-days",
            "2",
            "-extfile",
            "client-ext.cnf",
        ]);
        for f in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
            std::fs::copy(certs.join(f), client.join(f)).unwrap();
        }
        true
    }

    #[test]
    fn verify_peer_wants_a_client_certificate_from_the_ca() {
        let test = "tls::verify_peer_wants_a_client_certificate_from_the_ca";
        let Some([nbdinfo]) = tools(test, ["nbdinfo"]) else {
            return;
        };
        let certs = tmpdir();
        let client = tmpdir();
        if !make_certs(test, certs.path()) || !make_client_cert(test, certs.path(), client.path()) {
            return;
        }
        let server = Server::start(&[
            "--device",
            "mem:16M",
            "--tls",
            "require",
            "--tls-verify-peer",
            "--tls-certificates",
            path_str(certs.path()),
        ]);
        // With the client certificate: served.
        let with = tls_uri(&server, client.path());
        success(
            "nbdinfo with a client certificate",
            &run(Command::new(&nbdinfo).arg(&with)),
        );
        // Trusting the server but without a certificate of its own: refused.
        let bare = tmpdir();
        std::fs::copy(
            certs.path().join("ca-cert.pem"),
            bare.path().join("ca-cert.pem"),
        )
        .unwrap();
        let out = run(Command::new(&nbdinfo).arg(tls_uri(&server, bare.path())));
        assert!(
            !out.status.success(),
            "served a client without a certificate"
        );
    }

    #[test]
    fn bad_tls_settings_are_refused_at_start() {
        let bin = env!("CARGO_BIN_EXE_cairn");
        let dir = tmpdir();
        for (args, needle) in [
            (vec!["--tls", "require"], "--tls-certificates"),
            (vec!["--tls-verify-peer"], "--tls-certificates"),
            (
                vec!["--tls-certificates", path_str(dir.path())],
                "server-cert.pem",
            ),
        ] {
            let out = run(Command::new(bin)
                .arg("serve")
                .args(["--listen", &format!("unix:{}/x.sock", dir.path().display())])
                .args(&args));
            assert_eq!(out.status.code(), Some(2), "{args:?}");
            let err = text(&out.stderr);
            assert!(err.contains(needle), "{args:?}: {err}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// Socket activation

mod activation {
    use super::*;

    /// systemd-style socket activation: the listening socket arrives as fd 3 with
    /// LISTEN_FDS=1, and the server serves on it without any --listen.
    #[test]
    fn serves_on_a_socket_passed_by_systemd_socket_activate() {
        let test = "activation::serves_on_a_socket_passed_by_systemd_socket_activate";
        let Some([activate, nbdinfo]) = tools(test, ["systemd-socket-activate", "nbdinfo"]) else {
            return;
        };
        let dir = tmpdir();
        let sock = dir.path().join("activated.sock");
        let mut child = Command::new(activate)
            .arg("-l")
            .arg(&sock)
            .arg(env!("CARGO_BIN_EXE_cairn"))
            .args(["serve", "--device", "mem:8M"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start systemd-socket-activate");
        let deadline = Instant::now() + READY_TIMEOUT;
        while !sock.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        // The first connection starts cairn, which takes over the listening socket.
        let out = run(Command::new(&nbdinfo)
            .arg("--size")
            .arg(format!("nbd+unix:///?socket={}", sock.display())));
        // SAFETY: signals our own child process.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let _ = child.wait();
        let size = success("nbdinfo --size through socket activation", &out);
        assert_eq!(size.trim(), (8u64 << 20).to_string());
    }
}

mod admin {
    use super::*;

    pub(super) fn admin(sock: &Path, words: &[&str]) -> Output {
        run(Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("admin")
            .arg(sock)
            .args(words))
    }

    /// `status` prints the device tree with sizes, health and what caches wrote back,
    /// then the arrays; `status --json` gives the same for scripts; a raid10 member that
    /// fails shows as degraded in both. The raid10 keeps superblocks (the default): 8 MiB
    /// of data on each 9 MiB member.
    #[test]
    fn status_shows_the_tree_health_and_caches_and_json_for_scripts() {
        let dir = tmpdir();
        let ctl = dir.path().join("admin.sock");
        let mut t = String::new();
        for d in ["d0", "d1", "d2", "d3"] {
            t += &format!("[device.{d}]\ntype = \"mem\"\nsize = \"9M\"\n");
        }
        t += "[device.f3]\ntype = \"fault\"\nbase = \"d3\"\nfail = [\"write\"]\nafter_ios = 3\n\
              [device.r]\ntype = \"raid10\"\nmembers = [\"d0\", \"d1\", \"d2\", \"f3\"]\nchunk = \"64K\"\n\
              [device.c]\ntype = \"cache\"\nbase = \"r\"\nmemory = \"4M\"\n\
              [export.c]\ndevice = \"c\"\n";
        let stack = write_stack(&dir, &t);
        let srv = Server::start_in(dir, &[path_str(&stack), "--admin", path_str(&ctl)]);
        let (mut c, _, _) = Raw::go(&srv.sock, "c");
        for i in 0..64u64 {
            c.write_ok(i + 1, 0, i * 65536, &[i as u8; 65536]);
        }
        c.request(0, CMD_FLUSH, 999, 0, 0, &[]).unwrap();
        c.expect(999, 0);
        let out = success("status", &admin(&ctl, &["status"]));
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("c (16MiB) write-back cache"), "{out}");
        assert!(lines[0].contains("written back"), "{out}");
        assert!(
            lines[1].starts_with("  r (16MiB) raid10 of 4 members"),
            "{out}"
        );
        assert!(lines[1].contains("[DEGRADED: failed f3]"), "{out}");
        assert!(
            lines.iter().any(|l| l.starts_with("    d0 (9MiB) mem")),
            "{out}"
        );
        assert!(
            lines.iter().any(|l| l.starts_with("      d3 (9MiB) mem")),
            "{out}"
        );
        // And the array's own lines, as /proc/mdstat shows md's.
        assert!(
            out.contains("r: raid10 of 4 members, 16MiB, metadata 1")
                && out.contains("[UUU_] d0 active, d1 active, d2 active, f3 failed"),
            "{out}"
        );
        let out = success("status --json", &admin(&ctl, &["status", "--json"]));
        let doc: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
        let devices = doc["devices"].as_array().expect("devices");
        let r = devices.iter().find(|d| d["name"] == "r").expect("r");
        assert_eq!(r["size_bytes"], 16 << 20);
        assert_eq!(r["depth"], 1);
        assert_eq!(r["failed_members"], serde_json::json!(["f3"]));
        assert_eq!(r["children"], serde_json::json!(["d0", "d1", "d2", "f3"]));
        let cache = devices.iter().find(|d| d["name"] == "c").expect("c");
        assert!(
            cache["written_back_bytes"].as_u64().unwrap() >= 4 << 20,
            "{cache}"
        );
        let out = admin(&ctl, &["status", "x"]);
        assert!(!out.status.success());
        c.disconnect();
    }

    /// `power-cut` through the admin socket loses exactly what no flush made durable:
    /// through a cache over a volatile mem, flushed and FUA writes survive, the rest is
    /// gone, even when written before a FUA write. A bad command changes nothing.
    #[test]
    fn power_cut_loses_only_what_no_flush_made_durable() {
        let dir = tmpdir();
        let stack = write_stack(
            &dir,
            "[writeback]\nexpire = \"30s\"\ninterval = \"30s\"\n\
             [device.m]\ntype = \"mem\"\nsize = \"16M\"\nblock = 4096\nvolatile = true\n\
             [device.c]\ntype = \"cache\"\nbase = \"m\"\nmemory = \"8M\"\n",
        );
        let ctl = dir.path().join("admin.sock");
        let mut srv = Server::start_in(dir, &[path_str(&stack), "--admin", path_str(&ctl)]);
        let mode = std::fs::metadata(&ctl).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600,
            "the admin socket is its owner's only"
        );
        let out = admin(&ctl, &["devices"]);
        assert_eq!(success("admin devices", &out), "c\n  m\n");

        let (mut c, _, _) = Raw::go(&srv.sock, "");
        let a = random_bytes(1 << 20, 31);
        let b = random_bytes(64 << 10, 32);
        let lost = random_bytes(256 << 10, 33);
        let fua = random_bytes(128 << 10, 34);
        c.write_ok(1, 0, 0, &a);
        c.request(0, CMD_FLUSH, 2, 0, 0, &[]).unwrap();
        c.expect(2, 0);
        c.write_ok(3, 0, 0, &b);
        c.write_ok(4, 0, 4 << 20, &lost);
        // Last: a FUA write makes its own range durable, not the writes before it.
        c.write_ok(5, FLAG_FUA, 8 << 20, &fua);

        // Mistakes: exit status 2, one line, nothing cut.
        for (words, needle) in [
            (vec!["power-cut", "c", "nosuch"], "no device 'nosuch'"),
            (vec!["explode"], "unknown command 'explode'"),
        ] {
            let out = admin(&ctl, &words);
            assert_eq!(out.status.code(), Some(2), "{words:?}");
            assert!(
                text(&out.stderr).contains(needle),
                "{words:?}: {}",
                text(&out.stderr)
            );
        }
        assert_same(
            "before the cut",
            &c.read_ok(6, 4 << 20, lost.len() as u32),
            &lost,
        );

        let out = admin(&ctl, &["power-cut"]);
        assert_eq!(success("admin power-cut", &out).trim(), "power cut: c");
        assert!(
            srv.wait_for_stderr("power cut of c", Duration::from_secs(5)),
            "{}",
            srv.stderr()
        );
        assert_same("flushed", &c.read_ok(7, 0, 1 << 20), &a);
        assert_same("FUA", &c.read_ok(8, 8 << 20, fua.len() as u32), &fua);
        assert_same(
            "never flushed",
            &c.read_ok(9, 4 << 20, lost.len() as u32),
            &vec![0u8; lost.len()],
        );
        // The device goes on working after the cut.
        c.write_ok(10, 0, 4 << 20, &b);
        assert_same("after the cut", &c.read_ok(11, 4 << 20, b.len() as u32), &b);
        c.disconnect();
        let (status, log) = srv.stop();
        assert!(status.success(), "exit status {status}; stderr:\n{log}");
        assert!(!ctl.exists(), "the admin socket is removed at exit");
    }

    /// A 4 KiB block carrying its page and version in a header (as `--verify` blocks
    /// do), the rest derived from both, so that a read names the version it found and a
    /// mix of two versions is caught.
    pub(super) fn block(page: u64, version: u64) -> Vec<u8> {
        if version == 0 {
            return vec![0u8; 4096];
        }
        let mut b = page.to_le_bytes().to_vec();
        b.extend_from_slice(&version.to_le_bytes());
        b.extend_from_slice(&random_bytes(4096 - 16, page << 32 ^ version));
        b
    }

    /// The version `data` (read from `page`) holds; panics on anything else.
    pub(super) fn version_of(page: u64, data: &[u8], what: &str) -> u64 {
        if data.iter().all(|&b| b == 0) {
            return 0;
        }
        let p = u64::from_le_bytes(data[..8].try_into().unwrap());
        let v = u64::from_le_bytes(data[8..16].try_into().unwrap());
        assert_eq!(p, page, "{what}: page {page} holds page {p}'s block");
        assert!(
            data == block(page, v),
            "{what}: page {page}: a torn or mixed block (header says version {v})"
        );
        v
    }

    /// The crash test end to end: a client pipelines random writes (some FUA) and
    /// flushes to three exports while their power is cut through the admin socket at
    /// random moments, writes in flight. After each cut every page must read back the
    /// version a completed flush or FUA write made durable, or a newer one written since,
    /// never an older one: through a cache over a raid10 of volatile mems, a raid10 of
    /// caches, and a mirror of caches.
    #[test]
    fn power_cuts_at_random_moments_keep_every_flushed_write() {
        const PAGES: u64 = 64;
        let dir = tmpdir();
        let mut text = String::from(
            "[writeback]\nbackground = \"10%\"\nlimit = \"50%\"\nexpire = \"5ms\"\ninterval = \"2ms\"\n",
        );
        let mem = |n: &str| {
            format!("[device.{n}]\ntype = \"mem\"\nsize = \"4M\"\nblock = 4096\nvolatile = true\n")
        };
        let cache = |n: &str, base: &str| {
            format!("[device.{n}]\ntype = \"cache\"\nbase = \"{base}\"\nmemory = \"1M\"\n")
        };
        // a: cache over raid10 of volatile mems.
        for i in 0..4 {
            text += &mem(&format!("am{i}"));
        }
        text += "[device.ar]\ntype = \"raid10\"\nmembers = [\"am0\", \"am1\", \"am2\", \"am3\"]\nchunk = \"16K\"\n";
        text += &cache("a", "ar");
        // b: raid10 of caches over volatile mems.
        for i in 0..4 {
            text += &mem(&format!("bm{i}"));
            text += &cache(&format!("bc{i}"), &format!("bm{i}"));
        }
        text += "[device.b]\ntype = \"raid10\"\nmembers = [\"bc0\", \"bc1\", \"bc2\", \"bc3\"]\nchunk = \"16K\"\n";
        // c: mirror of caches over volatile mems.
        for i in 0..2 {
            text += &mem(&format!("cm{i}"));
            text += &cache(&format!("cc{i}"), &format!("cm{i}"));
        }
        text += "[device.c]\ntype = \"mirror\"\nmembers = [\"cc0\", \"cc1\"]\n";
        for e in ["a", "b", "c"] {
            text += &format!("[export.{e}]\ndevice = \"{e}\"\n");
        }
        let stack = write_stack(&dir, &text);
        let ctl = dir.path().join("admin.sock");
        let mut srv = Server::start_in(dir, &[path_str(&stack), "--admin", path_str(&ctl)]);

        let mut rng = 0x5eed_u64;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut cuts = 0;
        for export in ["a", "b", "c"] {
            let (mut c, _, _) = Raw::go(&srv.sock, export);
            // Per page: the durable version, and versions written since (possibly newer
            // on the device after a cut).
            let mut durable = vec![0u64; PAGES as usize];
            let mut since: Vec<Vec<u64>> = vec![Vec::new(); PAGES as usize];
            let mut version = 0u64;
            let mut cookie = 1u64;
            for round in 0..60 {
                // A batch of writes to distinct pages, all in flight together.
                let mut pages: Vec<u64> = Vec::new();
                while pages.len() < 8 {
                    let p = next(PAGES);
                    if !pages.contains(&p) {
                        pages.push(p);
                    }
                }
                let mut fua = Vec::new();
                for &p in &pages {
                    version += 1;
                    let flags = if next(10) == 0 { FLAG_FUA } else { 0 };
                    c.request(flags, CMD_WRITE, cookie, p * 4096, 4096, &block(p, version))
                        .unwrap();
                    since[p as usize].push(version);
                    fua.push((cookie, p, version, flags != 0));
                    cookie += 1;
                }
                let cut = next(6) == 0;
                if cut {
                    // The cut lands while the batch is in flight (or just done).
                    let out = admin(&ctl, &["power-cut"]);
                    success("admin power-cut", &out);
                    cuts += 1;
                }
                for _ in 0..pages.len() {
                    let (err, ck) = c.reply().unwrap();
                    assert_eq!(err, 0, "{export} round {round}: write {ck} failed");
                    let &(_, p, v, f) = fua.iter().find(|w| w.0 == ck).expect("a known cookie");
                    if f && !cut {
                        // Acknowledged FUA with no cut since it was sent: durable.
                        durable[p as usize] = v;
                        since[p as usize].retain(|&x| x > v);
                    }
                }
                if cut {
                    for p in 0..PAGES {
                        c.request(0, CMD_READ, cookie, p * 4096, 4096, &[]).unwrap();
                        c.expect(cookie, 0);
                        cookie += 1;
                        let data = c.read_exact(4096).unwrap();
                        let what = format!("{export}, round {round}, after cut {cuts}");
                        let v = version_of(p, &data, &what);
                        let allowed = v == durable[p as usize] || since[p as usize].contains(&v);
                        assert!(
                            allowed,
                            "{what}: page {p} reads version {v}; durable {}, written since {:?}",
                            durable[p as usize], since[p as usize]
                        );
                        assert!(
                            v >= durable[p as usize],
                            "{what}: page {p} went back in time"
                        );
                    }
                    // A fresh start: every page rewritten and flushed.
                    for p in 0..PAGES {
                        version += 1;
                        c.write_ok(cookie, 0, p * 4096, &block(p, version));
                        cookie += 1;
                        durable[p as usize] = version;
                        since[p as usize].clear();
                    }
                    c.request(0, CMD_FLUSH, cookie, 0, 0, &[]).unwrap();
                    c.expect(cookie, 0);
                    cookie += 1;
                } else if next(3) == 0 {
                    // Every write above is acknowledged: a flush makes them all durable.
                    c.request(0, CMD_FLUSH, cookie, 0, 0, &[]).unwrap();
                    c.expect(cookie, 0);
                    cookie += 1;
                    for p in 0..PAGES as usize {
                        if let Some(&last) = since[p].last() {
                            durable[p] = last;
                        }
                        since[p].clear();
                    }
                }
            }
            c.disconnect();
        }
        assert!(cuts >= 10, "only {cuts} power cuts");
        let (status, log) = srv.stop();
        assert!(status.success(), "exit status {status}; stderr:\n{log}");
    }

    /// Removing the admin socket's file while serving does not keep SIGTERM from ending
    /// the server (its thread used to be woken by connecting to the file).
    #[test]
    fn sigterm_ends_the_server_even_when_the_admin_socket_file_is_gone() {
        let dir = tmpdir();
        let ctl = dir.path().join("admin.sock");
        let mut srv = Server::start_in(dir, &["--device", "mem:1M", "--admin", path_str(&ctl)]);
        std::fs::remove_file(&ctl).unwrap();
        let (status, log) = srv.stop();
        assert!(status.success(), "exit status {status}; stderr:\n{log}");
    }

    /// An admin socket path that cannot be bound is refused before anything listens.
    #[test]
    fn an_admin_socket_in_use_is_refused() {
        let dir = tmpdir();
        let ctl = dir.path().join("admin.sock");
        std::fs::write(&ctl, b"").unwrap();
        let out = run(Command::new(env!("CARGO_BIN_EXE_cairn"))
            .args(["serve", "--listen"])
            .arg(format!("unix:{}", dir.path().join("nbd.sock").display()))
            .arg("--admin")
            .arg(&ctl));
        assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("--admin"),
            "{}",
            text(&out.stderr)
        );
        assert!(ctl.exists(), "a file that was there is left alone");
        let out = admin(&dir.path().join("none.sock"), &["help"]);
        assert_eq!(out.status.code(), Some(2));
    }
}

/// The Unix sockets cairn listens on (NBD's `unix:` addresses, the admin socket, the
/// metrics endpoint's `unix:` form) follow one rule: a stale socket (nobody listens: what
/// `kill -9` leaves) is replaced, a live one is refused by name, and nothing is removed.
mod sockets {
    use super::admin::admin;
    use super::*;

    /// `cairn serve` with its three sockets in `dir`, named `{prefix}nbd.sock`,
    /// `{prefix}admin.sock` and `{prefix}metrics.sock`; a refused start's output.
    fn serve_args(dir: &Path, prefix: [&str; 3]) -> Vec<String> {
        vec![
            "--listen".into(),
            format!(
                "unix:{}",
                dir.join(format!("{}nbd.sock", prefix[0])).display()
            ),
            "--admin".into(),
            dir.join(format!("{}admin.sock", prefix[1]))
                .display()
                .to_string(),
            "--metrics".into(),
            format!(
                "unix:{}",
                dir.join(format!("{}metrics.sock", prefix[2])).display()
            ),
            "--device".into(),
            "mem:8M".into(),
        ]
    }

    /// A `GET /metrics` on a Unix socket; the response.
    fn scrape_unix(path: &Path) -> String {
        let mut s = UnixStream::connect(path)
            .unwrap_or_else(|e| panic!("connect to {}: {e}", path.display()));
        s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    /// Every socket of the server in `dir` answers: an NBD write read back, an admin
    /// command, a scrape.
    fn all_answer(dir: &Path, what: &str) {
        let (mut c, size, _) = Raw::go(&dir.join("nbd.sock"), "");
        assert_eq!(size, 8 << 20, "{what}");
        c.write_ok(1, 0, 4096, &[0x5a; 4096]);
        assert_eq!(c.read_ok(2, 4096, 4096), vec![0x5a; 4096], "{what}");
        c.disconnect();
        let out = admin(&dir.join("admin.sock"), &["devices"]);
        assert_eq!(success(what, &out), "mem\n", "{what}");
        let scrape = scrape_unix(&dir.join("metrics.sock"));
        assert!(
            scrape.starts_with("HTTP/1.") && scrape.contains("cairn_device_requests_total"),
            "{what}: {scrape}"
        );
    }

    /// A server killed with SIGKILL leaves its three socket files; the next one on the
    /// same paths replaces them and serves. A second one started while it runs is refused
    /// with one line naming the path in use (each socket in turn), leaves nothing of its
    /// own behind, and the first one goes on answering on all three.
    #[test]
    fn kill_9_then_the_same_paths_serve_and_a_second_server_is_refused_by_name() {
        let dir = tmpdir();
        let d = dir.path();
        let start = || {
            let args = serve_args(d, ["", "", ""]);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            // The listen address is in `args`: `spawn` gets no other.
            Server::spawn(tmpdir(), d.join("nbd.sock"), &[], &args)
        };
        let mut first = start();
        all_answer(d, "the first server");
        first.signal(libc::SIGKILL);
        let (status, _) = first.wait_exit();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
        for name in ["nbd.sock", "admin.sock", "metrics.sock"] {
            let meta = std::fs::symlink_metadata(d.join(name)).expect("left behind");
            assert!(std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()));
        }

        let again = start();
        all_answer(d, "started again after kill -9");
        let log = again.stderr();
        assert!(
            log.matches("replacing a stale socket").count() == 3,
            "each stale socket is logged as replaced:\n{log}"
        );

        // The prefix "x" gives a socket a fresh path: only the other ones collide.
        let cases = [
            (
                ["", "x", "x"],
                format!("--listen unix:{}", d.join("nbd.sock").display()),
            ),
            (
                ["x", "", "x"],
                format!("--admin {}", d.join("admin.sock").display()),
            ),
            (
                ["x", "x", ""],
                format!("--metrics unix:{}", d.join("metrics.sock").display()),
            ),
        ];
        for (prefix, label) in cases {
            let args = serve_args(d, prefix);
            let out = run(Command::new(env!("CARGO_BIN_EXE_cairn"))
                .arg("serve")
                .args(&args)
                .env_remove("LISTEN_FDS"));
            let stderr = text(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{label}: {stderr}");
            assert_eq!(
                stderr,
                format!("cairn: {label}: another process is listening there (a running cairn?)\n"),
                "{label}"
            );
            for name in ["xnbd.sock", "xadmin.sock", "xmetrics.sock"] {
                assert!(
                    !d.join(name).exists(),
                    "{label}: the refused server left {name} behind"
                );
            }
            all_answer(
                d,
                &format!("the first server, after a second was refused ({label})"),
            );
        }
        drop(again);
        for name in ["nbd.sock", "admin.sock", "metrics.sock"] {
            assert!(!d.join(name).exists(), "{name} is removed at exit");
        }
    }

    /// What is not a socket at a socket's path (a regular file, a directory, a symbolic
    /// link, even to a stale socket) is refused for what it is, and left as it is.
    #[test]
    fn what_is_not_a_socket_is_refused_for_what_it_is_and_left_alone() {
        let dir = tmpdir();
        let d = dir.path();
        let file = d.join("file");
        std::fs::write(&file, b"data").unwrap();
        let subdir = d.join("dir");
        std::fs::create_dir(&subdir).unwrap();
        let stale = d.join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
        let link = d.join("link");
        std::os::unix::fs::symlink(&stale, &link).unwrap();
        let cases: [(&Path, &str); 3] = [
            (&file, "a regular file"),
            (&subdir, "a directory"),
            (&link, "a symbolic link"),
        ];
        for (path, what) in cases {
            for (flag, value, label) in [
                (
                    "--listen",
                    format!("unix:{}", path.display()),
                    "--listen unix:",
                ),
                ("--admin", path.display().to_string(), "--admin "),
                (
                    "--metrics",
                    format!("unix:{}", path.display()),
                    "--metrics unix:",
                ),
            ] {
                let mut cmd = Command::new(env!("CARGO_BIN_EXE_cairn"));
                cmd.args(["serve", "--device", "mem:1M", flag, &value]);
                if flag != "--listen" {
                    cmd.arg("--listen")
                        .arg(format!("unix:{}", d.join("nbd.sock").display()));
                }
                let out = run(&mut cmd);
                let stderr = text(&out.stderr);
                assert_eq!(out.status.code(), Some(2), "{flag} {what}: {stderr}");
                assert_eq!(
                    stderr,
                    format!(
                        "cairn: {label}{}: {what} is there, not a socket (only a socket nobody listens on is replaced)\n",
                        path.display()
                    )
                );
                assert!(!d.join("nbd.sock").exists(), "{flag} {what}: nbd.sock left");
            }
        }
        assert_eq!(std::fs::read(&file).unwrap(), b"data");
        assert!(subdir.is_dir());
        assert_eq!(std::fs::read_link(&link).unwrap(), stale);
        assert!(std::os::unix::fs::FileTypeExt::is_socket(
            &std::fs::symlink_metadata(&stale).unwrap().file_type()
        ));
    }
}

/// Every check that can refuse a start (arguments, addresses and sockets bound, paths,
/// array members examined) runs before anything is created or written: a refused
/// `cairn serve` or `cairn bench` leaves every file as it found it.
mod refused_starts {
    use super::*;

    /// A stack file in `dir`: a mirror `m` with metadata of files `a` and `b` (8 MiB each,
    /// created by `size=`, unless `b_spec` says otherwise).
    fn mirror_stack(dir: &Path, b_spec: &str) -> PathBuf {
        let text = format!(
            "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"8M\"\n\
             [device.b]\ntype = \"file\"\npath = \"{}\"\n{b_spec}\n\
             [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n",
            dir.join("a.img").display(),
            dir.join("b.img").display(),
        );
        let path = dir.join("stack.toml");
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Runs `cairn WORDS...`; asserts exit status 2 and one line on stderr, and returns
    /// it.
    #[track_caller]
    fn refused(words: &[&str]) -> String {
        let out = run(Command::new(env!("CARGO_BIN_EXE_cairn"))
            .args(words)
            .env_remove("LISTEN_FDS"));
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{words:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{words:?}: one line: {stderr}");
        assert!(!stderr.contains("created"), "{words:?}: {stderr}");
        stderr
    }

    /// A port in use (for NBD, or for the metrics) refuses `cairn serve` of a mirror
    /// with metadata whose 64 MiB member is still to be created: nothing is created and
    /// no superblock written (before, the member was created and the array started, and
    /// only then was the bind refused).
    #[test]
    fn a_port_in_use_refuses_before_a_member_is_created() {
        let dir = tmpdir();
        let d = dir.path();
        let stack = mirror_stack(d, "size = \"64M\"");
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let tcp = format!("tcp:127.0.0.1:{port}");
        let sock = format!("unix:{}", d.join("nbd.sock").display());
        let stack = path_str(&stack);
        for words in [
            vec!["serve", "--listen", &tcp, stack],
            vec!["serve", "--listen", &sock, "--metrics", &tcp, stack],
        ] {
            let line = refused(&words);
            assert!(
                line.contains(&format!("{tcp}: ")) && line.contains("in use"),
                "{line}"
            );
            for f in ["a.img", "b.img", "nbd.sock"] {
                assert!(!d.join(f).exists(), "{words:?}: {f} was created: {line}");
            }
        }
        let line = refused(&["bench", "--size", "1M", "--metrics", &tcp, stack]);
        assert!(line.contains(&format!("--metrics {tcp}: ")), "{line}");
        assert!(!d.join("a.img").exists() && !d.join("b.img").exists());
    }

    /// 16 KiB of non-zero bytes (no superblock) followed by zeros, `len` bytes in all.
    fn foreign(path: &Path, len: usize) -> Vec<u8> {
        let mut bytes = random_bytes(16 << 10, 0xf0e1);
        bytes.iter_mut().for_each(|b| *b |= 1);
        bytes.resize(len, 0);
        std::fs::write(path, &bytes).unwrap();
        bytes
    }

    /// A mirror with metadata of a new member and a foreign one (another program's data
    /// where the superblocks go) is refused by `cairn serve` and `cairn bench`: the new
    /// member's file is not created, and the foreign file is unchanged byte for byte, even
    /// when `size=` would extend it (before, the new member was created first, and a
    /// foreign file to extend was extended).
    #[test]
    fn a_foreign_member_refuses_before_the_new_one_is_created() {
        let dir = tmpdir();
        let d = dir.path();
        let b = d.join("b.img");
        let sock = format!("unix:{}", d.join("nbd.sock").display());
        for (len, b_spec) in [(8 << 20, ""), (2 << 20, "size = \"8M\"")] {
            let before = foreign(&b, len);
            let stack = mirror_stack(d, b_spec);
            let stack = path_str(&stack);
            for words in [
                vec!["serve", "--listen", &sock, stack],
                vec!["bench", "--size", "1M", stack],
            ] {
                let line = refused(&words);
                assert!(line.contains("'b'"), "{words:?} ({b_spec}): {line}");
                assert!(
                    !d.join("a.img").exists(),
                    "{words:?} ({b_spec}): a.img created"
                );
                assert!(!d.join("nbd.sock").exists(), "{words:?}: nbd.sock left");
                let after = std::fs::read(&b).unwrap();
                assert!(after == before, "{words:?} ({b_spec}): b.img changed");
            }
        }
    }

    /// An admin socket path another process listens on, or that holds a regular file or
    /// a directory, refuses `cairn serve` and `cairn bench` before the members are
    /// created; a stale socket there is replaced, and the start goes on.
    #[test]
    fn an_admin_path_in_use_refuses_before_members_are_created_and_a_stale_one_is_replaced() {
        let dir = tmpdir();
        let d = dir.path();
        let stack = mirror_stack(d, "size = \"8M\"");
        let stack = path_str(&stack);
        let ctl = d.join("admin.sock");
        let ctl_s = path_str(&ctl);
        let sock = format!("unix:{}", d.join("nbd.sock").display());
        let nothing_created = |what: &str| {
            for f in ["a.img", "b.img", "nbd.sock"] {
                assert!(!d.join(f).exists(), "{what}: {f} was created");
            }
        };
        let live = std::os::unix::net::UnixListener::bind(&ctl).unwrap();
        for words in [
            vec!["serve", "--listen", &sock, "--admin", ctl_s, stack],
            vec!["bench", "--size", "1M", "--admin", ctl_s, stack],
        ] {
            let line = refused(&words);
            assert_eq!(
                line,
                format!("cairn: --admin {ctl_s}: another process is listening there (a running cairn?)\n")
            );
            nothing_created("a live admin socket");
        }
        // Still the test's listener.
        let _c = UnixStream::connect(&ctl).expect("the live socket is left alone");
        live.accept().expect("and still answers");
        drop(live);

        std::fs::remove_file(&ctl).unwrap();
        std::fs::write(&ctl, b"keep").unwrap();
        let line = refused(&["serve", "--listen", &sock, "--admin", ctl_s, stack]);
        assert!(line.contains("a regular file is there"), "{line}");
        nothing_created("a regular file");
        assert_eq!(std::fs::read(&ctl).unwrap(), b"keep");
        std::fs::remove_file(&ctl).unwrap();
        std::fs::create_dir(&ctl).unwrap();
        let line = refused(&["bench", "--size", "1M", "--admin", ctl_s, stack]);
        assert!(line.contains("a directory is there"), "{line}");
        nothing_created("a directory");
        std::fs::remove_dir(&ctl).unwrap();

        // Stale (its server is gone): replaced, and the members are created.
        drop(std::os::unix::net::UnixListener::bind(&ctl).unwrap());
        let srv = Server::spawn(
            tmpdir(),
            d.join("nbd.sock"),
            &["--listen", &sock],
            &["--admin", ctl_s, stack],
        );
        assert!(
            srv.stderr().contains("replacing a stale socket"),
            "{}",
            srv.stderr()
        );
        assert!(d.join("a.img").exists() && d.join("b.img").exists());
        let out = super::admin::admin(&ctl, &["devices"]);
        assert!(success("admin devices", &out).starts_with("m\n"));
    }
}

/// Arrays with superblocks through `cairn serve`: killed with SIGKILL under a write load
/// and started again, a mirror resyncs, every write a flush made durable reads back (or
/// a newer one), and its members agree.
mod arrays {
    use super::admin::{admin, block, version_of};
    use super::*;

    /// `status` on the admin socket shows each array with metadata like /proc/mdstat:
    /// members and states, degraded or not, and a rebuild's progress.
    #[test]
    fn status_shows_members_states_and_rebuild_progress() {
        let dir = tmpdir();
        let ctl = dir.path().join("admin.sock");
        let file = |n: &str| {
            format!(
                "[device.{n}]\ntype = \"file\"\npath = \"{}\"\nsize = \"33M\"\n",
                dir.path().join(format!("{n}.img")).display()
            )
        };
        let text = format!(
            "{}{}[device.slow]\ntype = \"delay\"\nbase = \"b\"\nbandwidth = \"2M\"\n\
             [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"slow\"]\nmetadata = \"1\"\n\
             [device.d]\ntype = \"mirror\"\nmembers = [\"c\", \"missing\"]\nmetadata = \"1\"\n\
             [export.m]\ndevice = \"m\"\n[export.d]\ndevice = \"d\"\n",
            file("a"),
            file("b"),
        ) + &file("c");
        let stack = write_stack(&dir, &text);
        // Made once with both members, then b is replaced by a blank file: rebuilt at the
        // next start, at 2 MB/s (16 s), long enough to be seen.
        {
            let mut srv = Server::start_in(tmpdir(), &[path_str(&stack)]);
            let (status, log) = srv.stop();
            assert!(status.success(), "{log}");
        }
        std::fs::remove_file(dir.path().join("b.img")).unwrap();
        let mut srv = Server::start_in(dir, &[path_str(&stack), "--admin", path_str(&ctl)]);
        let out = success("admin status", &admin(&ctl, &["status"]));
        assert!(out.contains("m: mirror of 2 members"), "{out}");
        assert!(out.contains("[U_] a active, slow rebuilding"), "{out}");
        assert!(out.contains("rebuild ") && out.contains("% ("), "{out}");
        assert!(
            out.contains("d: mirror of 2 members") && out.contains("degraded"),
            "{out}"
        );
        assert!(out.contains("[U_] c active, missing missing"), "{out}");
        let (status, log) = srv.stop();
        assert!(status.success(), "{log}");
        // Stopped part way, the rebuild kept its checkpoint for the next start.
        assert!(log.contains("rebuild stopped at"), "{log}");
    }

    /// `fail` and `remove` on a running mirror: the array goes on degraded with every
    /// write reading back, never gives up its last current copy; the stack file then
    /// names the member `missing`, and added back it is rebuilt whole (it was taken out).
    #[test]
    fn admin_fail_and_remove_a_member_then_it_is_added_back_whole() {
        const PAGES: u64 = 64;
        let dir = tmpdir();
        let ctl = dir.path().join("admin.sock");
        let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
        let stack = write_stack(
            &dir,
            &format!(
                "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                 [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                 [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n\
                 bitmap = \"64K\"\nbitmap_delay = \"100ms\"\n",
                a.display(),
                b.display()
            ),
        );
        let stride = 128u64 << 10;
        let write_all = |srv: &Server, version: u64| {
            let (mut c, _, _) = Raw::go(&srv.sock, "");
            for p in 0..PAGES {
                c.request(0, CMD_WRITE, p + 1, p * stride, 4096, &block(p, version))
                    .unwrap();
                c.expect(p + 1, 0);
            }
            c.request(0, CMD_FLUSH, 999, 0, 0, &[]).unwrap();
            c.expect(999, 0);
            for p in 0..PAGES {
                c.request(0, CMD_READ, p + 1000, p * stride, 4096, &[])
                    .unwrap();
                c.expect(p + 1000, 0);
                let data = c.read_exact(4096).unwrap();
                assert_eq!(version_of(p, &data, "read back"), version);
            }
            c.disconnect();
        };
        let srv_args = [path_str(&stack), "--admin", path_str(&ctl)];
        let mut srv = Server::start_in(tmpdir(), &srv_args);
        write_all(&srv, 1);
        // Bits clear once the regions stay idle.
        let clean = || {
            let out = success("status", &admin(&ctl, &["status"]));
            out.contains("bitmap: 0 of")
        };
        let t = std::time::Instant::now();
        while !clean() {
            assert!(t.elapsed() < Duration::from_secs(60), "bits never cleared");
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = success("fail a", &admin(&ctl, &["fail", "m", "a"]));
        assert!(out.contains("member 'a' failed"), "{out}");
        let out = success("status", &admin(&ctl, &["status"]));
        assert!(out.contains("[_U] a failed, b active"), "{out}");
        // The last current copy is kept, and bad requests change nothing.
        for (words, why) in [
            (&["fail", "m", "b"][..], "no current copy"),
            (&["fail", "m", "a"][..], "failed already"),
            (&["remove", "m", "b"][..], "in use"),
            (&["fail", "m", "zz"][..], "no member 'zz'"),
            (&["fail", "a", "x"][..], "not an array"),
            (&["fail", "nope", "a"][..], "no device 'nope'"),
            (&["fail", "m"][..], "usage"),
        ] {
            let out = admin(&ctl, words);
            assert!(!out.status.success(), "{words:?} succeeded");
            let text = text(&out.stdout) + &text(&out.stderr);
            assert!(text.contains(why), "{words:?}: {text}");
        }
        // Degraded writes, to 4 of the 64 pages' regions.
        {
            let (mut c, _, _) = Raw::go(&srv.sock, "");
            for p in [3u64, 20, 21, 40] {
                c.request(0, CMD_WRITE, p + 1, p * stride, 4096, &block(p, 2))
                    .unwrap();
                c.expect(p + 1, 0);
            }
            c.disconnect();
        }
        let out = success("remove a", &admin(&ctl, &["remove", "m", "a"]));
        assert!(out.contains("removed"), "{out}");
        let out = success("status", &admin(&ctl, &["status"]));
        assert!(out.contains("a missing, b active"), "{out}");
        assert!(out.contains("bitmap: 4 of"), "{out}");
        let (status, log) = srv.stop();
        assert!(status.success(), "{log}");
        assert!(log.contains("failed by the admin"), "{log}");
        // The stack file says so, and a carries a superblock that says it was taken out:
        // the next start runs on b alone, and never reads a as current.
        let kept = std::fs::read_to_string(&stack).unwrap();
        assert!(kept.contains("members = [\"missing\", \"b\"]"), "{kept}");
        let mut srv = Server::start_in(tmpdir(), &srv_args);
        // Added back, a is rebuilt whole from b (its old contents are out of date).
        let out = success(
            "add a back",
            &admin(&ctl, &["add", "m", &format!("file:{}", a.display())]),
        );
        assert!(out.contains("added in place of"), "{out}");
        assert!(
            srv.wait_for_stderr(" done: ", Duration::from_secs(60)),
            "{}",
            srv.stderr()
        );
        let whole = 8u64 << 20;
        assert!(
            srv.stderr()
                .contains(&format!("read {whole} bytes, wrote {whole} bytes")),
            "{}",
            srv.stderr()
        );
        let (status, log) = srv.stop();
        assert!(status.success(), "{log}");
        let (da, db) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        let data = (1 << 20)..(9 << 20);
        assert!(da[data.clone()] == db[data], "the members differ");
        for p in 0..PAGES {
            let at = (1 << 20) + (p * stride) as usize;
            let v = if [3, 20, 21, 40].contains(&p) { 2 } else { 1 };
            assert_eq!(version_of(p, &da[at..at + 4096], "member a"), v);
        }
    }

    /// `re-add` on a running mirror: a member failed while writes went on comes back
    /// copying only the regions written while it was out (all of it without a bitmap),
    /// and then holds every write: with the other member failed, every page reads back.
    #[test]
    fn admin_re_add_takes_a_failed_member_back_copying_only_what_it_missed() {
        const PAGES: u64 = 64;
        let stride = 128u64 << 10;
        for bitmap in ["64K", "none"] {
            let dir = tmpdir();
            let ctl = dir.path().join("admin.sock");
            let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
            let stack = write_stack(
                &dir,
                &format!(
                    "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                     [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                     [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n\
                     bitmap = \"{bitmap}\"\n{delay}",
                    a.display(),
                    b.display(),
                    delay = if bitmap == "none" {
                        ""
                    } else {
                        "bitmap_delay = \"100ms\"\n"
                    }
                ),
            );
            let mut srv =
                Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
            let write = |pages: &[u64], version: u64| {
                let (mut c, _, _) = Raw::go(&srv.sock, "");
                for &p in pages {
                    c.request(0, CMD_WRITE, p + 1, p * stride, 4096, &block(p, version))
                        .unwrap();
                    c.expect(p + 1, 0);
                }
                c.request(0, CMD_FLUSH, 999, 0, 0, &[]).unwrap();
                c.expect(999, 0);
                c.disconnect();
            };
            let read_all = |changed: &[u64], what: &str| {
                let (mut c, _, _) = Raw::go(&srv.sock, "");
                for p in 0..PAGES {
                    c.request(0, CMD_READ, p + 1000, p * stride, 4096, &[])
                        .unwrap();
                    c.expect(p + 1000, 0);
                    let data = c.read_exact(4096).unwrap();
                    let v = if changed.contains(&p) { 2 } else { 1 };
                    assert_eq!(version_of(p, &data, what), v, "{what}");
                }
                c.disconnect();
            };
            let all: Vec<u64> = (0..PAGES).collect();
            write(&all, 1);
            let status = || success("status", &admin(&ctl, &["status"]));
            let t = std::time::Instant::now();
            while bitmap != "none" && !status().contains("bitmap: 0 of") {
                assert!(t.elapsed() < Duration::from_secs(60), "bits never cleared");
                std::thread::sleep(Duration::from_millis(50));
            }
            // Bad requests change nothing.
            for (words, why) in [
                (&["re-add", "m", "a"][..], "has not failed"),
                (&["re-add", "m", "zz"][..], "no member 'zz'"),
                (&["re-add", "m"][..], "usage"),
            ] {
                let out = admin(&ctl, words);
                assert!(!out.status.success(), "{words:?} succeeded");
                let text = text(&out.stdout) + &text(&out.stderr);
                assert!(text.contains(why), "{words:?}: {text}");
            }
            success("fail a", &admin(&ctl, &["fail", "m", "a"]));
            let changed = [3u64, 20, 21, 40];
            write(&changed, 2);
            let out = success("re-add a", &admin(&ctl, &["re-add", "m", "a"]));
            if bitmap == "none" {
                assert!(out.contains("rebuilding it whole"), "{out}");
            } else {
                assert!(
                    out.contains("copying the 4 of 128 regions of 64KiB"),
                    "{out}"
                );
            }
            let t = std::time::Instant::now();
            while !status().contains("[UU]") {
                assert!(
                    t.elapsed() < Duration::from_secs(60),
                    "never rebuilt: {}",
                    status()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            let moved = if bitmap == "none" {
                8u64 << 20
            } else {
                4 * (64 << 10)
            };
            assert!(
                status().contains(&format!("read {moved} bytes, wrote {moved} bytes")),
                "{}",
                status()
            );
            read_all(&changed, "both members");
            // a alone holds every write: the one it missed came with the re-add.
            success("fail b", &admin(&ctl, &["fail", "m", "b"]));
            read_all(&changed, "a alone");
            let (code, log) = srv.stop();
            assert!(code.success(), "{log}");
            assert!(log.contains("member a re-added by the admin"), "{log}");
            let (da, db) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
            let data = (1 << 20)..(9 << 20);
            assert!(
                da[data.clone()] == db[data],
                "the members differ ({bitmap})"
            );
        }
    }

    /// A member left out of a start (named `missing`) and added back while the array
    /// runs is known by its superblock: only the regions written without it are copied.
    /// A device of the same array that ran on without it (events ahead) is refused.
    #[test]
    fn a_member_left_out_of_a_start_and_added_back_copies_only_what_it_missed() {
        const PAGES: u64 = 64;
        let stride = 128u64 << 10;
        let dir = tmpdir();
        let ctl = dir.path().join("admin.sock");
        let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
        let text = |members: &str| {
            format!(
                "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                 [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                 [device.m]\ntype = \"mirror\"\nmembers = [{members}]\nmetadata = \"1\"\n\
                 bitmap = \"64K\"\nbitmap_delay = \"100ms\"\n",
                a.display(),
                b.display()
            )
        };
        let both = write_stack(&dir, &text("\"a\", \"b\""));
        let args = [path_str(&both), "--admin", path_str(&ctl)];
        let write = |srv: &Server, pages: &[u64], version: u64| {
            let (mut c, _, _) = Raw::go(&srv.sock, "");
            for &p in pages {
                c.request(0, CMD_WRITE, p + 1, p * stride, 4096, &block(p, version))
                    .unwrap();
                c.expect(p + 1, 0);
            }
            c.request(0, CMD_FLUSH, 999, 0, 0, &[]).unwrap();
            c.expect(999, 0);
            c.disconnect();
        };
        let all: Vec<u64> = (0..PAGES).collect();
        let mut srv = Server::start_in(tmpdir(), &args);
        write(&srv, &all, 1);
        let status = || success("status", &admin(&ctl, &["status"]));
        let t = std::time::Instant::now();
        while !status().contains("bitmap: 0 of") {
            assert!(t.elapsed() < Duration::from_secs(60), "bits never cleared");
            std::thread::sleep(Duration::from_millis(50));
        }
        let (code, log) = srv.stop();
        assert!(code.success(), "{log}");
        // Started without b, on purpose.
        let one = dir.path().join("one.toml");
        let without_b = text("\"a\", \"missing\"");
        let b_table = format!(
            "[device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n",
            b.display()
        );
        std::fs::write(&one, without_b.replace(&b_table, "")).unwrap();
        let mut srv = Server::start_in(tmpdir(), &[path_str(&one), "--admin", path_str(&ctl)]);
        let changed = [3u64, 20, 21, 40];
        write(&srv, &changed, 2);
        let spec = format!("file:{}", b.display());
        let out = success("add b", &admin(&ctl, &["add", "m", &spec]));
        assert!(out.contains("added in place of 'missing'"), "{out}");
        let t = std::time::Instant::now();
        while !status().contains("[UU]") {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "never rebuilt: {}",
                status()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let moved = 4 * (64u64 << 10);
        assert!(
            status().contains(&format!("read {moved} bytes, wrote {moved} bytes")),
            "{}",
            status()
        );
        // b alone reads back every write.
        success("fail a", &admin(&ctl, &["fail", "m", "a"]));
        {
            let (mut c, _, _) = Raw::go(&srv.sock, "");
            for p in 0..PAGES {
                c.request(0, CMD_READ, p + 1000, p * stride, 4096, &[])
                    .unwrap();
                c.expect(p + 1000, 0);
                let data = c.read_exact(4096).unwrap();
                let v = if changed.contains(&p) { 2 } else { 1 };
                assert_eq!(version_of(p, &data, "b alone"), v);
            }
            c.disconnect();
        }
        let (code, log) = srv.stop();
        assert!(code.success(), "{log}");
        assert!(log.contains("copying the 4 of 128 regions"), "{log}");
    }

    #[test]
    fn kill_9_under_writes_then_resync_keeps_every_flushed_write_and_the_copies_agree() {
        // Pages spread over the whole array, so that the write-intent bitmap (64 KiB
        // regions, bits cleared after 100 ms idle) sees regions set and cleared while
        // the server runs, and the kill lands with writes in flight to some of them.
        const PAGES: u64 = 256;
        const STRIDE: u64 = 32 << 10;
        let images = tmpdir();
        let (a, b) = (images.path().join("a.img"), images.path().join("b.img"));
        let stack = write_stack(
            &images,
            &format!(
                "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                 [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                 [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n\
                 bitmap = \"64K\"\nbitmap_delay = \"100ms\"\n",
                a.display(),
                b.display()
            ),
        );
        let mut rng = 0x6b11_u64;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        // Per page: the version a flush made durable, and versions written since.
        let mut durable = vec![0u64; PAGES as usize];
        let mut since: Vec<Vec<u64>> = vec![Vec::new(); PAGES as usize];
        let mut version = 0u64;
        for kill in 0..6 {
            let mut srv = Server::start(&[path_str(&stack)]);
            if kill > 0 {
                assert!(
                    srv.wait_for_stderr("resync of", Duration::from_secs(60))
                        && srv.wait_for_stderr(" done: ", Duration::from_secs(60)),
                    "no resync after kill {kill}:\n{}",
                    srv.stderr()
                );
            }
            let (mut c, _, _) = Raw::go(&srv.sock, "");
            let mut cookie = 1u64;
            for p in 0..PAGES {
                c.request(0, CMD_READ, cookie, p * STRIDE, 4096, &[])
                    .unwrap();
                c.expect(cookie, 0);
                cookie += 1;
                let data = c.read_exact(4096).unwrap();
                let what = format!("after kill {kill}");
                let v = version_of(p, &data, &what);
                let allowed = v == durable[p as usize] || since[p as usize].contains(&v);
                assert!(
                    allowed,
                    "{what}: page {p} reads version {v}; durable {}, written since {:?}",
                    durable[p as usize], since[p as usize]
                );
                // What reads back now is what the array holds from here on.
                durable[p as usize] = v;
                since[p as usize].clear();
            }
            if kill == 5 {
                c.disconnect();
                let (status, log) = srv.stop();
                assert!(status.success(), "exit status {status}; stderr:\n{log}");
                break;
            }
            // Batches of pipelined writes, a flush now and then, and the kill with a
            // batch in flight.
            let batches = 5 + next(20);
            for batch in 0..=batches {
                let mut pages = Vec::new();
                while pages.len() < 16 {
                    let p = next(PAGES);
                    if !pages.contains(&p) {
                        pages.push(p);
                    }
                }
                for &p in &pages {
                    version += 1;
                    c.request(0, CMD_WRITE, cookie, p * STRIDE, 4096, &block(p, version))
                        .unwrap();
                    since[p as usize].push(version);
                    cookie += 1;
                }
                if batch == batches {
                    srv.signal(libc::SIGKILL);
                    break;
                }
                for _ in 0..pages.len() {
                    let (err, _) = c.reply().unwrap();
                    assert_eq!(err, 0, "a write failed");
                }
                if next(4) == 0 {
                    // Idle long enough for bits to be cleared.
                    std::thread::sleep(Duration::from_millis(250));
                }
                if next(3) == 0 {
                    c.request(0, CMD_FLUSH, cookie, 0, 0, &[]).unwrap();
                    c.expect(cookie, 0);
                    cookie += 1;
                    for p in 0..PAGES as usize {
                        if let Some(&last) = since[p].last() {
                            durable[p] = last;
                        }
                        since[p].clear();
                    }
                }
            }
            let (status, _) = srv.wait_exit();
            assert!(!status.success(), "killed");
        }
        // Resynced and stopped cleanly: the two members hold the same data.
        let (da, db) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        let data = (1 << 20)..(9 << 20);
        assert!(
            da[data.clone()] == db[data],
            "the members differ after the resync"
        );
    }

    /// Pages (4 KiB, 64 KiB apart) of a 16 MiB mirror through crashes during a rebuild.
    const PAGES: u64 = 256;
    const STRIDE: u64 = 64 << 10;
    const DATA_BYTES: usize = 16 << 20;

    /// A pseudo-random `next(n)` in `0..n` (xorshift), from `seed`.
    fn xorshift(seed: u64) -> impl FnMut(u64) -> u64 {
        let mut rng = seed;
        move |n| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        }
    }

    /// What each page may read: the version a flush (or an acknowledged FUA write) made
    /// durable, or one written since.
    struct Pages {
        durable: Vec<u64>,
        since: Vec<Vec<u64>>,
        version: u64,
    }

    impl Pages {
        fn new() -> Pages {
            Pages {
                durable: vec![0; PAGES as usize],
                since: vec![Vec::new(); PAGES as usize],
                version: 0,
            }
        }

        /// Writes every page once through a server of `stack`, flushes, stops it.
        fn fill(&mut self, stack: &Path) {
            let mut srv = Server::start(&[path_str(stack)]);
            let (mut c, _, _) = Raw::go(&srv.sock, "");
            self.version += 1;
            for p in 0..PAGES {
                c.request(
                    0,
                    CMD_WRITE,
                    p + 1,
                    p * STRIDE,
                    4096,
                    &block(p, self.version),
                )
                .unwrap();
                c.expect(p + 1, 0);
                self.durable[p as usize] = self.version;
            }
            c.request(0, CMD_FLUSH, 9999, 0, 0, &[]).unwrap();
            c.expect(9999, 0);
            c.disconnect();
            let (status, log) = srv.stop();
            assert!(status.success(), "exit status {status}; stderr:\n{log}");
        }

        /// Reads every page, checks it, and takes what it read as durable (what reads
        /// back now is what the array holds from here on).
        /// The last start of a crash test: the rebuild runs to its end, and then reads
        /// (which may now use either copy) still find every page as it was; the server
        /// stops cleanly.
        fn finish_rebuild(
            &mut self,
            mut srv: Server,
            mut c: Raw,
            cookie: &mut u64,
            what: &str,
            logs: &mut String,
        ) {
            assert!(
                srv.wait_for_stderr(" done: ", Duration::from_secs(120)),
                "{what}: the rebuild never ended:\n{}",
                srv.stderr()
            );
            let so_far = format!("{logs}--- {what} (running)\n{}", srv.stderr());
            self.check(
                &mut c,
                cookie,
                &format!("{what}, after the rebuild"),
                &so_far,
            );
            c.disconnect();
            let (status, log) = srv.stop();
            assert!(status.success(), "exit status {status}; stderr:\n{log}");
            *logs += &format!("--- {what} (stopped after the rebuild)\n{log}");
        }

        fn check(&mut self, c: &mut Raw, cookie: &mut u64, what: &str, logs: &str) {
            for p in 0..PAGES {
                c.request(0, CMD_READ, *cookie, p * STRIDE, 4096, &[])
                    .unwrap();
                c.expect(*cookie, 0);
                *cookie += 1;
                let data = c.read_exact(4096).unwrap();
                let v = version_of(p, &data, what);
                let (d, s) = (&mut self.durable[p as usize], &mut self.since[p as usize]);
                assert!(
                    v == *d || s.contains(&v),
                    "{what}: page {p} reads version {v}; durable {d}, written since {s:?}\n{logs}"
                );
                *d = v;
                s.clear();
            }
        }

        /// 16 distinct pages picked at random.
        fn batch(&self, next: &mut impl FnMut(u64) -> u64) -> Vec<u64> {
            let mut pages = Vec::new();
            while pages.len() < 16 {
                let p = next(PAGES);
                if !pages.contains(&p) {
                    pages.push(p);
                }
            }
            pages
        }

        /// A new version of page `p` is being written: which.
        fn written(&mut self, p: u64) -> u64 {
            self.version += 1;
            self.since[p as usize].push(self.version);
            self.version
        }

        /// Version `v` of page `p` is durable (an acknowledged FUA write).
        fn durable_now(&mut self, p: u64, v: u64) {
            self.durable[p as usize] = v;
            self.since[p as usize].retain(|&x| x > v);
        }

        /// A flush completed: the last version written of every page is durable.
        fn flushed(&mut self) {
            for p in 0..PAGES as usize {
                if let Some(&v) = self.since[p].last() {
                    self.durable[p] = v;
                }
                self.since[p].clear();
            }
        }

        /// Rebuilt and stopped cleanly: both member files hold every page as last read,
        /// and the same data.
        fn members_hold(&self, a: &Path, b: &Path, logs: &str) {
            let (da, db) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
            let mut wrong = Vec::new();
            for p in 0..PAGES {
                let at = (1 << 20) + (p * STRIDE) as usize;
                let va = version_of(p, &da[at..at + 4096], "member a");
                let vb = version_of(p, &db[at..at + 4096], "member b");
                let d = self.durable[p as usize];
                if va != d || vb != d {
                    wrong.push(format!(
                        "page {p} (offset {}): a holds {va}, b {vb}, the array read {d}",
                        p * STRIDE
                    ));
                }
            }
            assert!(
                wrong.is_empty(),
                "after the rebuild, {} pages are not as the array read them:\n{}\n{logs}",
                wrong.len(),
                wrong.join("\n")
            );
            let data = (1 << 20)..(1 << 20) + DATA_BYTES;
            assert!(
                da[data.clone()] == db[data],
                "the members differ after the rebuild:\n{logs}"
            );
        }
    }

    /// Kills the server (SIGKILL) while a mirror rebuilds a blank member, writes in
    /// flight, several times; once, stops it cleanly instead. After each start every page
    /// reads the version a flush made durable or one written since; a rebuild stopped
    /// cleanly resumes from its checkpoint; and once the last rebuild is done the members
    /// hold the same data. The new member sits under a `delay` device (5 ms a write, 8 MB/s)
    /// so that a kill lands with writes done on one member and not yet on the other. A
    /// round writes for 0.2 to 2.5 s, and the rebuild of 16 MiB at 2 to 4 MB/s takes
    /// longer, so the kills land while it runs (were one to land after it, the checks still
    /// hold; they only test less).
    #[test]
    fn kill_9_during_a_rebuild_then_it_resumes_and_every_flushed_write_survives() {
        const ROUNDS: usize = 4;
        /// The round that ends with SIGTERM (the others with SIGKILL): the first, while
        /// the rebuild runs (a resync, after a kill, starts over at the next start).
        const CLEAN_STOP: usize = 0;
        let images = tmpdir();
        let (a, b) = (images.path().join("a.img"), images.path().join("b.img"));
        let stack = write_stack(
            &images,
            &format!(
                "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.slow]\ntype = \"delay\"\nbase = \"b\"\n\
                 write = \"5ms\"\nbandwidth = \"8M\"\n\
                 [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"slow\"]\nmetadata = \"1\"\n\
                 bitmap = \"64K\"\nbitmap_delay = \"100ms\"\n\
                 rebuild_min = \"2M\"\nrebuild_max = \"4M\"\n",
                a.display(),
                b.display()
            ),
        );
        let mut next = xorshift(0x2eb1);
        let mut pages = Pages::new();

        // Made with both members and written once, then b is replaced by a blank file
        // (the stack's `size` makes it again): the next start rebuilds it.
        pages.fill(&stack);
        std::fs::remove_file(&b).unwrap();

        // Where the next start must resume the rebuild (after a clean stop part way).
        let mut resume_at: Option<u64> = None;
        // Whether the rebuild or resync is known to be over (then a clean stop leaves
        // nothing to do at the next start).
        let mut over = false;
        // Every round's stderr, for the messages of the last checks.
        let mut logs = String::new();
        for round in 0..=ROUNDS {
            let mut srv = Server::start(&[path_str(&stack)]);
            let what = format!("round {round}");
            if !over {
                assert!(
                    srv.wait_for_stderr(" started at ", Duration::from_secs(60)),
                    "{what}: no rebuild or resync:\n{}",
                    srv.stderr()
                );
            }
            if let Some(at) = resume_at.take() {
                let log = srv.stderr();
                assert!(
                    log.contains(&format!("rebuild of 'slow' started at {at} of ")),
                    "{what}: the rebuild does not resume at its checkpoint {at}:\n{log}"
                );
            }
            let (mut c, _, _) = Raw::go(&srv.sock, "");
            let mut cookie = 1u64;
            let so_far = |srv: &Server| format!("{logs}--- {what} (running)\n{}", srv.stderr());
            pages.check(&mut c, &mut cookie, &what, &so_far(&srv));
            if round == ROUNDS {
                pages.finish_rebuild(srv, c, &mut cookie, &what, &mut logs);
                break;
            }
            // Batches of pipelined writes, a flush now and then, until a moment picked at
            // random; then the kill with a batch in flight (or, once, a clean stop).
            let end = Instant::now() + Duration::from_millis(200 + next(2300));
            loop {
                let batch = pages.batch(&mut next);
                for &p in &batch {
                    let v = pages.written(p);
                    c.request(0, CMD_WRITE, cookie, p * STRIDE, 4096, &block(p, v))
                        .unwrap();
                    cookie += 1;
                }
                let last = Instant::now() >= end;
                if last && round != CLEAN_STOP {
                    // Most often with the batch written to a and on its way to b.
                    std::thread::sleep(Duration::from_millis(1 + next(4)));
                    srv.signal(libc::SIGKILL);
                    break;
                }
                for _ in 0..batch.len() {
                    let (err, _) = c.reply().unwrap();
                    assert_eq!(err, 0, "{what}: a write failed");
                }
                if last || next(2) == 0 {
                    c.request(0, CMD_FLUSH, cookie, 0, 0, &[]).unwrap();
                    c.expect(cookie, 0);
                    cookie += 1;
                    pages.flushed();
                }
                if last {
                    break;
                }
                // Quiet moments, in which the rebuild may copy what the writes touch.
                std::thread::sleep(Duration::from_millis(next(20)));
            }
            let log = if round == CLEAN_STOP {
                c.disconnect();
                let (status, log) = srv.stop();
                assert!(status.success(), "exit status {status}; stderr:\n{log}");
                // Stopped part way, the rebuild keeps its checkpoint for the next start.
                resume_at = log.split("stopped at ").nth(1).map(|rest| {
                    let n = rest.split(' ').next().unwrap();
                    n.parse().unwrap_or_else(|_| panic!("a checkpoint: {n}"))
                });
                log
            } else {
                let (status, log) = srv.wait_exit();
                assert!(!status.success(), "killed");
                log
            };
            let how = if round == CLEAN_STOP {
                "SIGTERM"
            } else {
                "SIGKILL"
            };
            logs += &format!("--- {what} ({how})\n{log}");
            // After a kill, a resync always follows; after a clean stop, a rebuild
            // only if this one had not ended.
            over = round == CLEAN_STOP && log.contains(" done: ");
        }
        // Rebuilt and stopped cleanly: both members hold every page as last read, and the
        // same data.
        pages.members_hold(&a, &b, &logs);
    }

    /// Cuts the power of a mirror whose members are write-back caches (`cache` over
    /// files) while it rebuilds a blank member, writes in flight, and kills the server
    /// right after (SIGKILL, as the cut would end it), several times. The cut (`power-cut`
    /// on the admin socket) loses what the caches held that no flush or FUA write made
    /// durable, so after each start every page must read the version a flush or an
    /// acknowledged FUA write made durable, or one written since; and once the last
    /// rebuild is done and the server stopped cleanly, the members hold the same data,
    /// every page as last read. The new member's cache sits over a `delay` device (5 ms a
    /// write, 8 MB/s) so that its write-back lags; the cache of the other does not. A
    /// round writes for 0.2 to 2.5 s, and the rebuild (or resync, after a cut) of 16 MiB
    /// at 2 to 4 MB/s takes longer, so the cuts land while it runs (were one to land after
    /// it, the checks still hold; they only test less).
    ///
    /// The bitmap's regions are 1 MiB (16 pages each), not 64 KiB: setting a bit writes
    /// the superblocks with FUA and a flush, which write back everything the caches hold,
    /// and with a region per page nearly every batch set one, so the cuts found the
    /// caches all but clean. With 16 regions every bit is set after the first batches
    /// (none is cleared while a rebuild runs), and a cut takes what was written since the
    /// last flush and not yet written back (a batch, typically, on both members).
    #[test]
    fn power_cut_during_a_rebuild_then_every_flushed_write_survives() {
        /// Rounds that end with a power cut; one more runs the rebuild to its end.
        const ROUNDS: usize = 4;
        let images = tmpdir();
        let (a, b) = (images.path().join("a.img"), images.path().join("b.img"));
        let stack = write_stack(
            &images,
            &format!(
                "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.ca]\ntype = \"cache\"\nbase = \"a\"\nmemory = \"16M\"\n\
                 [device.slow]\ntype = \"delay\"\nbase = \"b\"\n\
                 write = \"5ms\"\nbandwidth = \"8M\"\n\
                 [device.cb]\ntype = \"cache\"\nbase = \"slow\"\nmemory = \"16M\"\n\
                 [device.m]\ntype = \"mirror\"\nmembers = [\"ca\", \"cb\"]\nmetadata = \"1\"\n\
                 bitmap = \"1M\"\nbitmap_delay = \"100ms\"\n\
                 rebuild_min = \"2M\"\nrebuild_max = \"4M\"\n",
                a.display(),
                b.display()
            ),
        );
        // (A flush or an acknowledged FUA write makes a version durable; after a start
        // the caches are empty: what reads back is on a member's file.)
        let mut next = xorshift(0x9c07);
        let mut pages = Pages::new();

        // Made with both members and written once, then b is replaced by a blank file
        // (the stack's `size` makes it again): the next start rebuilds it.
        pages.fill(&stack);
        std::fs::remove_file(&b).unwrap();

        // Every round's stderr, for the messages of the last checks.
        let mut logs = String::new();
        for round in 0..=ROUNDS {
            // The admin socket in the server's own directory: a killed server leaves
            // its file behind.
            let dir = tmpdir();
            let ctl = dir.path().join("admin.sock");
            let mut srv = Server::start_in(dir, &[path_str(&stack), "--admin", path_str(&ctl)]);
            let what = format!("round {round}");
            // A rebuild at the first start, a resync (and the rebuild, from the start)
            // after each cut.
            assert!(
                srv.wait_for_stderr(" started at ", Duration::from_secs(60)),
                "{what}: no rebuild or resync:\n{}",
                srv.stderr()
            );
            let (mut c, _, _) = Raw::go(&srv.sock, "");
            let mut cookie = 1u64;
            let so_far = |srv: &Server| format!("{logs}--- {what} (running)\n{}", srv.stderr());
            pages.check(&mut c, &mut cookie, &what, &so_far(&srv));
            if round == ROUNDS {
                pages.finish_rebuild(srv, c, &mut cookie, &what, &mut logs);
                break;
            }
            // Batches of pipelined writes (a few FUA), a flush now and then, until a
            // moment picked at random; then the power cut, with the last batch in flight
            // or acknowledged and not flushed, and the kill.
            let end = Instant::now() + Duration::from_millis(200 + next(2300));
            loop {
                let batch = pages.batch(&mut next);
                // (cookie, page, version, FUA) of each write of the batch.
                let mut sent = Vec::new();
                for &p in &batch {
                    let v = pages.written(p);
                    let flags = if next(32) == 0 { FLAG_FUA } else { 0 };
                    c.request(flags, CMD_WRITE, cookie, p * STRIDE, 4096, &block(p, v))
                        .unwrap();
                    sent.push((cookie, p, v, flags != 0));
                    cookie += 1;
                }
                // The last batch: the cut lands with it in flight, or once it is
                // acknowledged and not flushed (in cache memory only, but for FUA writes).
                let last = Instant::now() >= end;
                let in_flight = last && next(2) == 0;
                if in_flight {
                    std::thread::sleep(Duration::from_millis(next(4)));
                } else {
                    for _ in 0..batch.len() {
                        let (err, ck) = c.reply().unwrap();
                        assert_eq!(err, 0, "{what}: write {ck} failed");
                        let &(_, p, v, fua) =
                            sent.iter().find(|w| w.0 == ck).expect("a known cookie");
                        if fua {
                            // Acknowledged FUA: durable (on every member it reached).
                            pages.durable_now(p, v);
                        }
                    }
                }
                if last {
                    // Cache memory loses what no flush or FUA made durable; the kill
                    // ends the process as the cut would.
                    let out = success("admin power-cut", &admin(&ctl, &["power-cut"]));
                    assert!(out.contains("power cut: m"), "{what}: {out}");
                    srv.signal(libc::SIGKILL);
                    break;
                }
                if next(2) == 0 {
                    c.request(0, CMD_FLUSH, cookie, 0, 0, &[]).unwrap();
                    c.expect(cookie, 0);
                    cookie += 1;
                    pages.flushed();
                }
                // Quiet moments, in which the rebuild may copy what the writes touch.
                std::thread::sleep(Duration::from_millis(next(20)));
            }
            let (status, log) = srv.wait_exit();
            assert!(!status.success(), "killed");
            assert!(
                log.contains("power cut of m"),
                "{what}: no power cut:\n{log}"
            );
            logs += &format!("--- {what} (power cut, SIGKILL)\n{log}");
        }
        // Rebuilt and stopped cleanly (the caches wrote everything back): both members
        // hold every page as last read, and the same data.
        pages.members_hold(&a, &b, &logs);
    }
}

// ---------------------------------------------------------------------------------------
// Arrays at the defaults (stack files with no `metadata` key, so superblocks), through real
// clients: the three ways the raw layout served wrong data (issue 32)

mod array_defaults {
    use super::admin::admin;
    use super::*;

    /// Reads every 4 KiB block of the export `CAIRN_READS` times in a row on one
    /// connection (a mirror or raid10 takes its copies in turn, one request each, so every
    /// copy is read), and fails if a block reads differently from one read to the next,
    /// or, with `CAIRN_WANT` (a file of the export's size), anything but that file's bytes.
    /// `CAIRN_OLD` (the data before) only names what a wrong read returned.
    const CHECK: &str = r#"
import os
import nbd

what = os.environ["CAIRN_WHAT"]
reads = int(os.environ["CAIRN_READS"])

def load(var):
    path = os.environ.get(var)
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()

want, old = load("CAIRN_WANT"), load("CAIRN_OLD")
h = nbd.NBD()
h.connect_unix(os.environ["CAIRN_SOCK"])
size = h.get_size()
if want is not None and len(want) != size:
    raise SystemExit(f"{what}: the export holds {size} bytes, the data {len(want)}")
BS = 4096
zeros = bytes(BS)
blocks = size // BS
wrong = 0
unstable = 0
kinds = {"the old data": 0, "zeros": 0, "something else": 0}
examples = []
for i in range(blocks):
    at = i * BS
    got = [h.pread(BS, at) for _ in range(reads)]
    differ = any(g != got[0] for g in got)
    unstable += differ
    bad = []
    if want is not None:
        w = want[at:at + BS]
        bad = [k for k, g in enumerate(got) if g != w]
        for k in bad:
            g = got[k]
            if old is not None and g == old[at:at + BS]:
                kinds["the old data"] += 1
            elif g == zeros:
                kinds["zeros"] += 1
            else:
                kinds["something else"] += 1
    wrong += bool(bad)
    if (bad or differ) and len(examples) < 5:
        examples.append(f"block {i} (offset {at}): wrong reads {bad} of {reads}, "
                        f"{len({bytes(g) for g in got})} different contents")
h.shutdown()
kind = ", ".join(f"{n} {k}" for k, n in kinds.items() if n)
print(f"{what}: {blocks} blocks of 4 KiB, each read {reads} times in a row: "
      f"{wrong} blocks read wrong ({kind or 'none'}), "
      f"{unstable} blocks read differently from one read to the next")
for e in examples:
    print("  e.g.", e)
print("checked")
raise SystemExit(1 if wrong or unstable else 0)
"#;

    /// Random 4 KiB writes of random bytes all over the export, 64 in flight at all
    /// times; once `CAIRN_KILL_AFTER` of them are done, 64 more are sent (libnbd sends
    /// from inside its calls: it is polled until it has nothing left to write), and 5 ms
    /// later the server (`CAIRN_SERVER_PID`) gets SIGKILL. A write that fails before
    /// fails the script.
    const HAMMER: &str = r#"
import os
import random
import signal
import time
import nbd

DEPTH = 64
BS = 4096
pid = int(os.environ["CAIRN_SERVER_PID"])
kill_after = int(os.environ["CAIRN_KILL_AFTER"])
h = nbd.NBD()
h.connect_unix(os.environ["CAIRN_SOCK"])
blocks = h.get_size() // BS
rng = random.Random(32)
pending = []
done = 0

def retire():
    global pending, done
    still = []
    for cookie in pending:
        # Raises if the write failed.
        if h.aio_command_completed(cookie):
            done += 1
        else:
            still.append(cookie)
    pending = still

while True:
    while len(pending) < DEPTH:
        pending.append(h.aio_pwrite(rng.randbytes(BS), rng.randrange(blocks) * BS))
    if done >= kill_after:
        break
    h.poll(-1)
    retire()
# The last 64 sent whole, then the kill, once member a has taken them and b (20 ms a
# write) has not.
while h.aio_get_direction() & nbd.AIO_DIRECTION_WRITE:
    h.poll(-1)
retire()
time.sleep(0.005)
os.kill(pid, signal.SIGKILL)
print(f"SIGKILL after {done} writes, {len(pending)} in flight: killed")
"#;

    /// Reads of each block in a row: a mirror's two copies twice each.
    const READS: &str = "4";

    /// The arrays' keys besides `type` and `members` (none of them `metadata`, nor
    /// `bitmap`: those are at their defaults): rebuilds and resyncs of the 16 MiB of data
    /// take 2 to 4 s, so that most of the first reads of a restart land while one runs.
    const PACE: &str = "rebuild_min = \"4M\"\nrebuild_max = \"8M\"\n";

    /// Every block of `srv`'s export read `READS` times: the same each time, and
    /// `want`'s bytes when given (`old`: the data before, to name what a wrong read got).
    #[track_caller]
    fn check_reads(
        python: &Path,
        srv: &Server,
        want: Option<&Path>,
        old: Option<&Path>,
        what: &str,
    ) {
        let mut env = vec![
            ("CAIRN_WHAT", what.to_string()),
            ("CAIRN_READS", READS.to_string()),
        ];
        for (var, file) in [("CAIRN_WANT", want), ("CAIRN_OLD", old)] {
            if let Some(f) = file {
                env.push((var, path_str(f).to_string()));
            }
        }
        libnbd_script(python, CHECK, &srv.sock, &env, "checked");
    }

    /// The export's size in bytes.
    fn export_size(srv: &Server) -> u64 {
        let (mut c, size, _) = Raw::go(&srv.sock, "");
        c.disconnect();
        size
    }

    /// `size` random bytes (from `seed`) in the file `path`.
    fn data_file(path: &Path, size: u64, seed: u64) -> PathBuf {
        std::fs::write(path, random_bytes(size as usize, seed)).unwrap();
        path.to_path_buf()
    }

    /// nbdcopy of `data` into the whole export, flushed.
    #[track_caller]
    fn copy_in(nbdcopy: &Path, srv: &Server, data: &Path) {
        success(
            "nbdcopy into the export",
            &run(Command::new(nbdcopy).args(["--flush", path_str(data), &srv.uri()])),
        );
    }

    /// SIGTERM, a successful exit; the log.
    #[track_caller]
    fn stop_clean(srv: &mut Server) -> String {
        let (status, log) = srv.stop();
        assert!(status.success(), "exit status {status}; stderr:\n{log}");
        log
    }

    /// Polls `status` on the admin socket `ctl` until it contains `done`.
    #[track_caller]
    fn wait_status(ctl: &Path, done: &str, srv: &Server) {
        let t = Instant::now();
        loop {
            let out = success("admin status", &admin(ctl, &["status"]));
            if out.contains(done) {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "no '{done}' in status after 60 s:\n{out}\nstderr:\n{}",
                srv.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Asserts that the member files `a` and `b` hold the same bytes from `data_offset`
    /// on (each copy's data area), counting the 4 KiB blocks that differ and naming the
    /// first.
    #[track_caller]
    fn copies_agree(a: &Path, b: &Path, data_offset: usize, what: &str) {
        let (da, db) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
        assert_eq!(da.len(), db.len(), "{what}: the members' sizes differ");
        let (da, db) = (&da[data_offset..], &db[data_offset..]);
        let differ: Vec<usize> = da
            .chunks(4096)
            .zip(db.chunks(4096))
            .enumerate()
            .filter(|(_, (x, y))| x != y)
            .map(|(i, _)| i)
            .collect();
        assert!(
            differ.is_empty(),
            "{what}: {} blocks of 4 KiB differ between {} and {} past offset {data_offset} \
             (the first: data block {})",
            differ.len(),
            a.display(),
            b.display(),
            differ[0]
        );
    }

    /// A member fails writes while the client writes new data over the whole export;
    /// stopped cleanly and started again with the member healthy (its file as the failure
    /// left it: old data), every block reads the new data, on every read, and once the
    /// member is rebuilt too. With the raw layout (the old default) nothing recorded the
    /// failure: the stale member was read as current, every other read returning the old
    /// data. A mirror of two files, its member failing data writes only (its superblock
    /// writes pass: the failure comes mid-write), and a raid10 of four, its member failing
    /// every write (its superblock too, at the start).
    #[test]
    fn a_member_that_failed_writes_is_never_read_after_a_restart() {
        const NAME: &str =
            "array_defaults::a_member_that_failed_writes_is_never_read_after_a_restart";
        let Some([nbdcopy]) = tools(NAME, ["nbdcopy"]) else {
            return;
        };
        let Some(python) = python_with_libnbd(NAME) else {
            return;
        };
        struct Case {
            level: &'static str,
            members: usize,
            member_bytes: u64,
            /// The member under the fault.
            faulty: usize,
            /// The member holding the same data as the faulty one (raid10's near layout
            /// puts a chunk's two copies on neighbouring members).
            partner: usize,
            /// The fault device's keys.
            fault: &'static str,
            /// The array's keys besides `type` and `members`.
            extra: &'static str,
        }
        let cases = [
            Case {
                level: "mirror",
                members: 2,
                member_bytes: 17 << 20,
                faulty: 1,
                partner: 0,
                // The data area only: every sector from 1 MiB on.
                fault: "fail = [\"write\"]\nsectors = [2048, 34816]\n",
                extra: "",
            },
            Case {
                level: "raid10",
                members: 4,
                member_bytes: 9 << 20,
                faulty: 3,
                partner: 2,
                fault: "fail = [\"write\"]\n",
                extra: "chunk = \"64K\"\ncopies = 2\n",
            },
        ];
        for case in cases {
            let level = case.level;
            let dir = tmpdir();
            let ctl = dir.path().join("admin.sock");
            let files: Vec<PathBuf> = (0..case.members)
                .map(|i| dir.path().join(format!("d{i}.img")))
                .collect();
            let mut leaves = String::new();
            for (i, f) in files.iter().enumerate() {
                leaves += &format!(
                    "[device.d{i}]\ntype = \"file\"\npath = \"{}\"\nsize = \"{}\"\n",
                    f.display(),
                    case.member_bytes
                );
            }
            let array = |faulty_name: &str| {
                let names: Vec<String> = (0..case.members)
                    .map(|i| {
                        if i == case.faulty {
                            format!("\"{faulty_name}\"")
                        } else {
                            format!("\"d{i}\"")
                        }
                    })
                    .collect();
                format!(
                    "[device.r]\ntype = \"{level}\"\nmembers = [{}]\n{}{PACE}",
                    names.join(", "),
                    case.extra
                )
            };
            let healthy = dir.path().join("healthy.toml");
            std::fs::write(
                &healthy,
                format!("{leaves}{}", array(&format!("d{}", case.faulty))),
            )
            .unwrap();
            let faulty = dir.path().join("faulty.toml");
            std::fs::write(
                &faulty,
                format!(
                    "{leaves}[device.f]\ntype = \"fault\"\nbase = \"d{}\"\n{}{}",
                    case.faulty,
                    case.fault,
                    array("f")
                ),
            )
            .unwrap();

            // The old data, on every member.
            let mut srv = Server::start_in(tmpdir(), &[path_str(&healthy)]);
            let size = export_size(&srv);
            let old = data_file(&dir.path().join("old.bin"), size, 1);
            let new = data_file(&dir.path().join("new.bin"), size, 2);
            copy_in(&nbdcopy, &srv, &old);
            stop_clean(&mut srv);

            // The new data, while the member fails writes (`fault` above).
            let mut srv = Server::start_in(tmpdir(), &[path_str(&faulty)]);
            copy_in(&nbdcopy, &srv, &new);
            let log = stop_clean(&mut srv);
            // (Named `'f'` when its superblock write failed, `f` when a data write did.)
            assert!(
                log.replace('\'', "").contains("member f failed"),
                "{level}: {log}"
            );

            // Healthy again, with its old data: never read until rebuilt.
            let mut srv =
                Server::start_in(tmpdir(), &[path_str(&healthy), "--admin", path_str(&ctl)]);
            let what = format!("{level}, started again with the stale member");
            check_reads(&python, &srv, Some(&new), Some(&old), &what);
            // Known as the member that missed writes (`is back`, with the bitmap's regions
            // to copy), not as a blank one.
            let log = srv.stderr();
            let back = format!("member 'd{}' is back (events ", case.faulty);
            assert!(log.contains(&back), "{level}: {log}");
            wait_status(&ctl, &format!("[{}]", "U".repeat(case.members)), &srv);
            let what = format!("{level}, the stale member rebuilt");
            check_reads(&python, &srv, Some(&new), Some(&old), &what);
            let log = stop_clean(&mut srv);
            // Each member holds its share of the two copies, after its metadata area.
            let data_offset = case.member_bytes - size * 2 / case.members as u64;
            copies_agree(
                &files[case.partner],
                &files[case.faulty],
                data_offset as usize,
                &format!("{level}, after the rebuild:\n{log}"),
            );
        }
    }

    /// SIGKILL while a client has 64 random writes in flight; started again, every
    /// block reads the same bytes each time (a mirror reads one copy until its resync is
    /// done), and after the resync the two copies are the same. With the raw layout (the
    /// old default) nothing knew the stop was unclean: the copies stayed different where
    /// writes had reached one member and not the other, and such blocks changed from one
    /// read to the next. Member b sits under a `delay` device (20 ms a write), a slower
    /// disk, so that the kill lands with the writes in flight done on a and not on b.
    /// (Without it, on files in /dev/shm, the old code's copies came out the same in the
    /// run tried; with 2 ms, and the kill as soon as 64 writes were queued in libnbd, in
    /// 1 run of 7. This way 16 to 53 blocks differed, in 8 runs of 8.)
    #[test]
    fn kill_9_under_writes_then_the_copies_agree_and_reads_are_stable() {
        const NAME: &str =
            "array_defaults::kill_9_under_writes_then_the_copies_agree_and_reads_are_stable";
        let Some(python) = python_with_libnbd(NAME) else {
            return;
        };
        let dir = tmpdir();
        let ctl = dir.path().join("admin.sock");
        let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
        let stack = write_stack(
            &dir,
            &format!(
                "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.slow]\ntype = \"delay\"\nbase = \"b\"\nwrite = \"20ms\"\n\
                 [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"slow\"]\n{PACE}",
                a.display(),
                b.display()
            ),
        );
        let mut srv = Server::start_in(tmpdir(), &[path_str(&stack)]);
        let size = export_size(&srv);
        let pid = srv.child.as_ref().expect("running").id();
        libnbd_script(
            &python,
            HAMMER,
            &srv.sock,
            &[
                ("CAIRN_SERVER_PID", pid.to_string()),
                ("CAIRN_KILL_AFTER", "2000".to_string()),
            ],
            "killed",
        );
        let (status, log) = srv.wait_exit();
        assert!(!status.success(), "killed, yet {status}:\n{log}");

        let mut srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
        check_reads(&python, &srv, None, None, "started again after SIGKILL");
        assert!(
            srv.wait_for_stderr(" done: ", Duration::from_secs(60)),
            "no resync:\n{}",
            srv.stderr()
        );
        wait_status(&ctl, "[UU]", &srv);
        check_reads(&python, &srv, None, None, "resynced");
        let log = stop_clean(&mut srv);
        assert!(log.contains("resync of"), "{log}");
        let data_offset = std::fs::metadata(&a).unwrap().len() - size;
        copies_agree(
            &a,
            &b,
            data_offset as usize,
            &format!("after the resync:\n{log}"),
        );
    }

    /// A member's file replaced by a blank one (sparse, all zeros, the same size) while
    /// the server is stopped: started again, it is a new member, rebuilt from the other,
    /// and never read before: every block reads the data, each time, and after the
    /// rebuild both files hold it. With the raw layout (the old default) the blank file
    /// was served as data: every other read returned zeros.
    #[test]
    fn a_blank_file_in_place_of_a_member_is_rebuilt_not_read() {
        const NAME: &str = "array_defaults::a_blank_file_in_place_of_a_member_is_rebuilt_not_read";
        let Some([nbdcopy]) = tools(NAME, ["nbdcopy"]) else {
            return;
        };
        let Some(python) = python_with_libnbd(NAME) else {
            return;
        };
        let dir = tmpdir();
        let ctl = dir.path().join("admin.sock");
        let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
        let stack = write_stack(
            &dir,
            &format!(
                "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\n{PACE}",
                a.display(),
                b.display()
            ),
        );
        let args = [path_str(&stack), "--admin", path_str(&ctl)];
        let mut srv = Server::start_in(tmpdir(), &args);
        let size = export_size(&srv);
        let data = data_file(&dir.path().join("data.bin"), size, 3);
        copy_in(&nbdcopy, &srv, &data);
        stop_clean(&mut srv);

        let member_bytes = std::fs::metadata(&b).unwrap().len();
        std::fs::remove_file(&b).unwrap();
        std::fs::File::create(&b)
            .and_then(|f| f.set_len(member_bytes))
            .unwrap();

        let mut srv = Server::start_in(tmpdir(), &args);
        check_reads(
            &python,
            &srv,
            Some(&data),
            None,
            "started with a blank member",
        );
        wait_status(&ctl, "[UU]", &srv);
        check_reads(&python, &srv, Some(&data), None, "the blank member rebuilt");
        let log = stop_clean(&mut srv);
        assert!(log.contains("is blank"), "{log}");
        let data_offset = (member_bytes - size) as usize;
        copies_agree(&a, &b, data_offset, &format!("after the rebuild:\n{log}"));
        let held = std::fs::read(&b).unwrap();
        assert_same(
            "the rebuilt member's data area",
            &held[data_offset..],
            &std::fs::read(&data).unwrap(),
        );
    }
}

// ---------------------------------------------------------------------------------------
// What operators see of a running server: status with connections, stats, `cairn stat`,
// Prometheus metrics, and the service manager's notifications

mod observe {
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

    fn json(what: &str, out: &Output) -> Value {
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

    fn scrape(py: &Path, url: &str) -> String {
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
        let log = srv.stderr();
        let url = log
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no metrics URL in the log:\n{log}"))
            .to_string();
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
            assert_eq!(c["peer"], "unix", "{c:#}");
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
                .any(|l| l.trim_start().starts_with("c ")
                    && l.split_whitespace().nth(5) == Some("15")),
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
        let bad =
            run(Command::new(env!("CARGO_BIN_EXE_cairn")).args(["stat", path_str(&ctl), "1ms"]));
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
        let inf =
            r#"cairn_device_request_duration_seconds_bucket{device="c",op="write",le="+Inf"}"#;
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
        assert!(
            stopping.contains("STATUS=stopping (signal 15)"),
            "{stopping}"
        );
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
}

// ---------------------------------------------------------------------------------------
// The FUSE export (`--fuse PATH[:EXPORT]`): as root, with /dev/fuse

mod fuse_export {
    use super::filesystem::Mounted;
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;

    /// Whether FUSE tests can run here (root, /dev/fuse); records a skip otherwise.
    fn fuse_here(test: &str) -> bool {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            skip(test, "needs root (mounting FUSE)");
            return false;
        }
        if !Path::new("/dev/fuse").exists() {
            skip(test, "/dev/fuse is missing");
            return false;
        }
        true
    }

    /// The transports to run a test with: /dev/fuse reads always, FUSE over io_uring when
    /// the fuse module allows it (else a skip is recorded for that half).
    fn transports(test: &str) -> Vec<&'static str> {
        let mut v = vec!["off"];
        let on = std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
            .is_ok_and(|s| s.trim() == "Y");
        if on {
            v.push("auto");
        } else {
            skip(
                &format!("{test} (io_uring half)"),
                "the fuse module's enable_uring is not Y (scripts/test.sh sets it as root)",
            );
        }
        v
    }

    /// `cairn serve --device DEVICE --fuse DISK --fuse-io-uring TRANSPORT` (and NBD on a
    /// Unix socket in `dir`, and the admin socket `dir/admin.sock`).
    fn fuse_server(dir: TempDir, device: &str, disk: &Path, transport: &str) -> Server {
        let ctl = dir.path().join("admin.sock");
        Server::start_in(
            dir,
            &[
                "--device",
                device,
                "--fuse",
                path_str(disk),
                "--fuse-io-uring",
                transport,
                "--admin",
                path_str(&ctl),
            ],
        )
    }

    fn mounted(path: &Path) -> Option<String> {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        mounts
            .lines()
            .find(|l| l.split(' ').nth(1) == Some(path_str(path)))
            .map(str::to_string)
    }

    /// Writes `data` at `offset` of `path` with dd (`extra`: oflag=direct and the like).
    fn dd_write(path: &Path, src: &Path, seek_mib: u64, extra: &[&str]) {
        let out = run(Command::new("dd")
            .arg(format!("if={}", src.display()))
            .arg(format!("of={}", path.display()))
            .args(["bs=1M", "conv=notrunc,fsync", "status=none"])
            .arg(format!("seek={seek_mib}"))
            .args(extra));
        success("dd", &out);
    }

    /// dd writes (buffered and O_DIRECT) read back byte for byte with cmp, and qemu-img
    /// finds the file and the same export over NBD identical; with each transport.
    #[test]
    fn dd_and_cmp_through_the_file_and_qemu_img_compare_over_nbd() {
        const NAME: &str = "fuse_export::dd_and_cmp_through_the_file_and_qemu_img_compare_over_nbd";
        if !fuse_here(NAME) {
            return;
        }
        let Some([qemu_img, cmp]) = tools(NAME, ["qemu-img", "cmp"]) else {
            return;
        };
        for transport in transports(NAME) {
            let dir = tmpdir();
            let disk = dir.path().join("disk");
            let src = dir.path().join("src");
            std::fs::write(&src, random_bytes(8 << 20, 7)).unwrap();
            let srv = fuse_server(dir, "mem:64M", &disk, transport);
            let m = std::fs::metadata(&disk).unwrap();
            assert!(m.is_file(), "{transport}: a regular file");
            assert_eq!(m.len(), 64 << 20, "{transport}: the device's size");
            let line = mounted(&disk).expect("mounted");
            assert!(line.contains("fuse.cairn"), "{line}");
            dd_write(&disk, &src, 3, &[]);
            dd_write(&disk, &src, 40, &["oflag=direct"]);
            for (skip_bytes, what) in [(3u64 << 20, "buffered"), (40 << 20, "O_DIRECT")] {
                let out = run(Command::new(&cmp)
                    .args(["-n", &(8u64 << 20).to_string()])
                    .arg(&src)
                    .arg(&disk)
                    .arg("0")
                    .arg(skip_bytes.to_string()));
                success(&format!("{transport}: cmp of the {what} write"), &out);
            }
            // The rest reads as zeroes.
            let f = std::fs::File::open(&disk).unwrap();
            let mut buf = vec![0xffu8; 1 << 20];
            f.read_exact_at(&mut buf, 20 << 20).unwrap();
            assert!(buf.iter().all(|&b| b == 0), "{transport}: never written");
            drop(f);
            let out = run(Command::new(&qemu_img)
                .args(["compare", "-f", "raw", "-F", "raw"])
                .arg(&disk)
                .arg(srv.uri()));
            assert!(
                success(&format!("{transport}: qemu-img compare"), &out).contains("identical"),
                "{}",
                text(&out.stdout)
            );
            // The admin socket shows the file under its export, with what it answered.
            let ctl = srv.dir.path().join("admin.sock");
            let want = if transport == "off" {
                "/dev/fuse"
            } else {
                "io_uring"
            };
            let out = super::admin::admin(&ctl, &["status"]);
            let status = success(&format!("{transport}: admin status"), &out);
            let line = status
                .lines()
                .find(|l| l.trim_start().starts_with("fuse "))
                .unwrap_or_else(|| panic!("{transport}: no fuse line in:\n{status}"));
            assert!(
                line.contains(&format!("fuse {} ({want})", disk.display())),
                "{line}"
            );
            let out = super::admin::admin(&ctl, &["status", "--json"]);
            let doc: serde_json::Value =
                serde_json::from_str(success("status --json", &out).trim()).expect("JSON");
            let f = &doc["exports"][0]["fuse"][0];
            assert_eq!(f["path"], path_str(&disk), "{doc}");
            assert_eq!(f["transport"], want, "{doc}");
            let n = |k: &str| f[k].as_u64().unwrap_or_else(|| panic!("{k}: {f}"));
            assert!(n("written_bytes") >= 16 << 20, "{f}");
            assert!(n("writes") >= 16, "{f}");
            // cmp read 16 MiB and the zero check 1 MiB (at most 1 MiB per request).
            assert!(n("read_bytes") >= 17 << 20, "{f}");
            assert!(n("reads") >= 17, "{f}");
            assert!(n("flushes") >= 2, "{f}: dd conv=fsync, twice");
            assert!(
                n("requests") >= n("reads") + n("writes") + n("flushes") + n("errors"),
                "{f}"
            );
        }
    }

    /// Writes that do not cover whole blocks (read-modify-write) from four threads at
    /// once, each into its own quarter of every block, then fallocate's punch and zero
    /// range, SEEK_DATA and SEEK_HOLE, and what a device cannot do (grow, shrink).
    #[test]
    fn partial_block_writes_fallocate_and_seek_through_the_file() {
        const NAME: &str = "fuse_export::partial_block_writes_fallocate_and_seek_through_the_file";
        if !fuse_here(NAME) {
            return;
        }
        for transport in transports(NAME) {
            let dir = tmpdir();
            let disk = dir.path().join("disk");
            let srv = fuse_server(dir, "mem:16M,block=4096", &disk, transport);
            const BLOCKS: u64 = 256;
            const ROUNDS: u64 = 16;
            // Four writers, each owning bytes [q*1024, q*1024+1024) of every block,
            // rewriting them in random order: a read-modify-write that is not alone on
            // the device would bring back another quarter's old bytes.
            let writers: Vec<_> = (0..4u64)
                .map(|q| {
                    let disk = disk.clone();
                    std::thread::spawn(move || {
                        let f = std::fs::OpenOptions::new().write(true).open(&disk).unwrap();
                        for round in 0..ROUNDS {
                            for i in 0..BLOCKS {
                                let blk = (i * 37 + q * 11 + round) % BLOCKS;
                                let data = random_bytes(1024, blk << 8 | q << 4 | round);
                                f.write_all_at(&data, blk * 4096 + q * 1024).unwrap();
                            }
                        }
                    })
                })
                .collect();
            for w in writers {
                w.join().unwrap();
            }
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&disk)
                .unwrap();
            let mut model = vec![0u8; (BLOCKS * 4096) as usize];
            for blk in 0..BLOCKS {
                for q in 0..4u64 {
                    let at = (blk * 4096 + q * 1024) as usize;
                    model[at..at + 1024]
                        .copy_from_slice(&random_bytes(1024, blk << 8 | q << 4 | (ROUNDS - 1)));
                }
            }
            let mut got = vec![0u8; model.len()];
            f.read_exact_at(&mut got, 0).unwrap();
            assert_same(&format!("{transport}: quarters"), &got, &model);

            // Odd sizes at odd offsets, across block boundaries.
            for (i, (off, len)) in [(5u64, 3usize), (4095, 2), (8190, 9000), (100_001, 70_000)]
                .into_iter()
                .enumerate()
            {
                let data = random_bytes(len, 900 + i as u64);
                f.write_all_at(&data, off).unwrap();
                model[off as usize..off as usize + len].copy_from_slice(&data);
            }
            let fallocate = |mode: i32, off: i64, len: i64| -> std::io::Result<()> {
                // SAFETY: fallocate on a descriptor we own.
                if unsafe { libc::fallocate(f.as_raw_fd(), mode, off, len) } == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            };
            fallocate(
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                1000,
                50_000,
            )
            .unwrap();
            model[1000..51_000].fill(0);
            fallocate(libc::FALLOC_FL_ZERO_RANGE, 123_457, 9_999).unwrap();
            model[123_457..133_456].fill(0);
            fallocate(
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                8192,
                4096,
            )
            .unwrap();
            model[8192..12_288].fill(0);
            f.read_exact_at(&mut got, 0).unwrap();
            assert_same(&format!("{transport}: after fallocate"), &got, &model);
            f.sync_all().unwrap();

            let size = 16i64 << 20;
            let e = fallocate(0, size - 4096, 8192).unwrap_err();
            assert_eq!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP),
                "{transport}: grow"
            );
            let e = f.set_len(0).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{transport}: shrink");
            assert_eq!(std::fs::metadata(&disk).unwrap().len(), size as u64);
            let e = f.write_at(b"x", size as u64).unwrap_err();
            assert_eq!(
                e.raw_os_error(),
                Some(libc::ENOSPC),
                "{transport}: past the end"
            );

            // Data where written, holes where never written or punched whole (the mem
            // device knows both, page by page): the punch of [1000, 51000) made the whole
            // pages [4096, 49152) holes; the page around 51000 still holds data.
            let seek = |off: i64, whence: i32| {
                // SAFETY: lseek on a descriptor we own.
                let r = unsafe { libc::lseek(f.as_raw_fd(), off, whence) };
                if r < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(r)
                }
            };
            assert_eq!(seek(0, libc::SEEK_DATA).unwrap(), 0, "{transport}");
            assert_eq!(
                seek(0, libc::SEEK_HOLE).unwrap(),
                4096,
                "{transport}: the punched pages"
            );
            assert_eq!(seek(4096, libc::SEEK_DATA).unwrap(), 49_152, "{transport}");
            let hole = seek(49_152, libc::SEEK_HOLE).unwrap();
            assert!(
                hole >= (BLOCKS * 4096) as i64 && hole < size,
                "{transport}: first hole after the punch at {hole}"
            );
            let e = seek(8 << 20, libc::SEEK_DATA).unwrap_err();
            assert_eq!(
                e.raw_os_error(),
                Some(libc::ENXIO),
                "{transport}: no data after 8M"
            );
            assert_eq!(seek(size - 1, libc::SEEK_HOLE).unwrap(), size - 1);
            drop(f);
            drop(srv);
        }
    }

    /// fio's io_uring engine with O_DIRECT on the file: random 4 KiB writes at iodepth
    /// 32, each block with a crc32c, read back and checked.
    #[test]
    fn fio_io_uring_direct_verify_on_the_file() {
        const NAME: &str = "fuse_export::fio_io_uring_direct_verify_on_the_file";
        if !fuse_here(NAME) {
            return;
        }
        let Some([fio]) = tools(NAME, ["fio"]) else {
            return;
        };
        for transport in transports(NAME) {
            let dir = tmpdir();
            let disk = dir.path().join("disk");
            let srv = fuse_server(dir, "mem:64M", &disk, transport);
            let out = run(Command::new(&fio)
                .current_dir(srv.path(""))
                .args([
                    "--name=verify",
                    "--ioengine=io_uring",
                    "--direct=1",
                    "--rw=randwrite",
                    "--bs=4k",
                    "--size=48M",
                    "--iodepth=32",
                    "--verify=crc32c",
                    "--do_verify=1",
                    "--verify_fatal=1",
                    "--output-format=json",
                ])
                .arg(format!("--filename={}", disk.display())));
            let json = success(&format!("{transport}: fio verify"), &out);
            let v: Value = serde_json::from_str(&json[json.find('{').unwrap()..]).unwrap();
            let job = &v["jobs"][0];
            assert_eq!(job["error"], 0, "{transport}: {json}");
            assert_eq!(
                job["write"]["io_bytes"].as_u64(),
                Some(48 << 20),
                "{transport}: every block written"
            );
            assert!(
                job["read"]["io_bytes"].as_u64() == Some(48 << 20),
                "{transport}: every block read back and verified"
            );
        }
    }

    /// A read-only export is mounted read-only: reads work, opening for writing fails.
    /// Bad --fuse arguments are refused before anything is mounted.
    #[test]
    fn a_read_only_export_is_mounted_read_only_and_bad_arguments_are_refused() {
        const NAME: &str =
            "fuse_export::a_read_only_export_is_mounted_read_only_and_bad_arguments_are_refused";
        if !fuse_here(NAME) {
            return;
        }
        let dir = tmpdir();
        let ro = dir.path().join("ro.img");
        let rw = dir.path().join("rw.img");
        let stack = write_stack(
            &dir,
            &format!(
                "[device.m]\ntype = \"mem\"\nsize = \"8M\"\n\
                 [export.a]\ndevice = \"m\"\nread_only = true\nfuse = \"{}\"\n\
                 [export.b]\ndevice = \"m\"\n",
                ro.display()
            ),
        );
        // Mistakes: exit status 2 and nothing mounted.
        let bad_dir = dir.path().join("adir");
        std::fs::create_dir(&bad_dir).unwrap();
        let in_dir = format!("{}:b", bad_dir.display());
        for (args, needle) in [
            (vec!["--fuse", &in_dir], "is a directory"),
            (
                vec!["--fuse", path_str(&rw)],
                "name the export (PATH:EXPORT)",
            ),
            (vec!["--fuse", "/tmp/x:nosuch"], "no export named 'nosuch'"),
            (
                vec![
                    "--fuse",
                    &format!("{}:b", rw.display()),
                    "--fuse",
                    &format!("{}:b", rw.display()),
                ],
                "named twice",
            ),
            (
                vec!["--fuse", path_str(&rw), "--fuse-depth", "0"],
                "--fuse-depth",
            ),
        ] {
            let out = run(Command::new(env!("CARGO_BIN_EXE_cairn"))
                .arg("serve")
                .arg(&stack)
                .args([
                    "--listen",
                    &format!("unix:{}", dir.path().join("x.sock").display()),
                ])
                .args(&args));
            assert_eq!(
                out.status.code(),
                Some(2),
                "{args:?}: {}",
                text(&out.stderr)
            );
            assert!(
                text(&out.stderr).contains(needle),
                "{args:?}: {}",
                text(&out.stderr)
            );
            assert!(mounted(&rw).is_none() && mounted(&ro).is_none(), "{args:?}");
        }
        let srv = Server::start_in(
            dir,
            &[path_str(&stack), "--fuse", &format!("{}:b", rw.display())],
        );
        let line = mounted(&ro).expect("ro.img mounted");
        assert!(
            line.split(' ')
                .nth(3)
                .unwrap()
                .split(',')
                .any(|o| o == "ro"),
            "{line}"
        );
        let e = std::fs::OpenOptions::new()
            .write(true)
            .open(&ro)
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EROFS));
        // The same device, writable through the other export, shows through both.
        let data = random_bytes(1 << 20, 55);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&rw)
            .unwrap()
            .write_all_at(&data, 1 << 20)
            .unwrap();
        let mut got = vec![0u8; data.len()];
        std::fs::File::open(&ro)
            .unwrap()
            .read_exact_at(&mut got, 1 << 20)
            .unwrap();
        assert_same("through the read-only export", &got, &data);
        drop(srv);
        assert!(
            mounted(&ro).is_none() && mounted(&rw).is_none(),
            "unmounted at exit"
        );
        assert!(
            !ro.exists() && !rw.exists(),
            "the files cairn created are gone"
        );
    }

    /// SIGTERM flushes and unmounts; a cairn killed with SIGKILL leaves a dead mount,
    /// which the next run detaches before it mounts again; what was written survives
    /// both, on a file device.
    #[test]
    fn sigterm_unmounts_and_a_stale_mount_is_cleaned_up() {
        const NAME: &str = "fuse_export::sigterm_unmounts_and_a_stale_mount_is_cleaned_up";
        if !fuse_here(NAME) {
            return;
        }
        let dir = tmpdir();
        let img = dir.path().join("back.img");
        let disk = dir.path().join("disk");
        std::fs::write(&disk, b"").unwrap(); // an existing mount point stays at exit
        let device = format!("file:{},size=16M", img.display());
        let args = ["--device", &device, "--fuse", path_str(&disk)];
        // Each run in a directory of its own (a killed one leaves its socket behind).
        let start = || {
            let inner = tempfile::tempdir_in(dir.path()).unwrap();
            let sock = inner.path().join("nbd.sock");
            let listen = format!("unix:{}", sock.display());
            Server::spawn(inner, sock, &["--listen", &listen], &args)
        };
        let first = random_bytes(2 << 20, 61);
        let mut srv = start();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&disk)
            .unwrap()
            .write_all_at(&first, 4 << 20)
            .unwrap();
        let (status, log) = srv.stop();
        assert!(status.success(), "{log}");
        assert!(log.contains("flushed and unmounted"), "{log}");
        assert!(mounted(&disk).is_none(), "unmounted");
        assert!(disk.exists(), "a mount point that was there before stays");

        // Killed: the mount stays behind, dead.
        let mut srv = start();
        srv.signal(libc::SIGKILL);
        let _ = srv.wait_exit();
        assert!(mounted(&disk).is_some(), "a killed cairn leaves its mount");
        let e = std::fs::metadata(&disk).unwrap_err();
        assert!(
            matches!(
                e.raw_os_error(),
                Some(libc::ENOTCONN) | Some(libc::ECONNABORTED)
            ),
            "a dead mount: {e}"
        );

        let srv = start();
        assert!(
            srv.stderr().contains("detached the stale mount"),
            "{}",
            srv.stderr()
        );
        let mut got = vec![0u8; first.len()];
        std::fs::File::open(&disk)
            .unwrap()
            .read_exact_at(&mut got, 4 << 20)
            .unwrap();
        assert_same("after SIGTERM and a stale mount", &got, &first);
        drop(srv);
        assert!(mounted(&disk).is_none());
    }

    /// ext4 on a raid10 export through `losetup` on the FUSE file: files written and
    /// fsynced, unmounted, fsck clean, every file read back.
    #[test]
    fn ext4_on_a_raid10_export_through_the_fuse_file_and_a_loop_device() {
        ext4_on_fuse(
            "fuse_export::ext4_on_a_raid10_export_through_the_fuse_file_and_a_loop_device",
            false,
        );
    }

    /// The same, with the power cut through the admin socket between fsyncs (the raid10's
    /// members are write-back caches, so the cut loses what no flush made durable), then
    /// cairn killed, restarted on the same files (the dead mount is cleaned up): the
    /// journal replays, fsck is clean, and every fsynced file is intact.
    #[test]
    fn ext4_survives_a_power_cut_between_fsyncs_through_the_fuse_file() {
        ext4_on_fuse(
            "fuse_export::ext4_survives_a_power_cut_between_fsyncs_through_the_fuse_file",
            true,
        );
    }

    fn ext4_on_fuse(name: &str, power_cut: bool) {
        if !fuse_here(name) {
            return;
        }
        let Some([losetup, mkfs, fsck, mount, umount]) = tools(
            name,
            ["losetup", "mkfs.ext4", "fsck.ext4", "mount", "umount"],
        ) else {
            return;
        };
        let probe = run_for(Command::new(&losetup).arg("-f"), Duration::from_secs(30));
        if !probe.status.success() {
            skip(
                name,
                &format!("losetup -f: no loop device: {}", text(&probe.stderr).trim()),
            );
            return;
        }
        let transport = *transports(name).last().unwrap();
        let dir = tmpdir();
        // RAID10 of four 33 MiB files (behind write-back caches for the power cut), with
        // superblocks (the default): 64 MiB.
        let mut toml = String::from(
            "[writeback]\nexpire = \"60s\"\ninterval = \"60s\"\nbackground = \"80%\"\nlimit = \"90%\"\n",
        );
        let mut members = Vec::new();
        for i in 0..4 {
            toml += &format!(
                "[device.d{i}]\ntype = \"file\"\npath = \"{}\"\nsize = \"33M\"\n",
                dir.path().join(format!("d{i}.img")).display()
            );
            if power_cut {
                toml +=
                    &format!("[device.c{i}]\ntype = \"cache\"\nbase = \"d{i}\"\nmemory = \"8M\"\n");
                members.push(format!("\"c{i}\""));
            } else {
                members.push(format!("\"d{i}\""));
            }
        }
        toml += &format!(
            "[device.r]\ntype = \"raid10\"\nmembers = [{}]\nchunk = \"64K\"\n",
            members.join(", ")
        );
        let stack = write_stack(&dir, &toml);
        let disk = dir.path().join("disk");
        let ctl = dir.path().join("admin.sock");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let start = || {
            let inner = tempfile::tempdir_in(dir.path()).unwrap();
            let sock = inner.path().join("nbd.sock");
            let listen = format!("unix:{}", sock.display());
            Server::spawn(
                inner,
                sock,
                &["--listen", &listen],
                &[
                    path_str(&stack),
                    "--fuse",
                    path_str(&disk),
                    "--fuse-io-uring",
                    transport,
                    "--admin",
                    path_str(&ctl),
                ],
            )
        };
        let mut srv = start();
        let mut m = Mounted {
            umount: umount.clone(),
            losetup: losetup.clone(),
            fusermount: PathBuf::from("/bin/false"),
            mnt: None,
            loop_dev: None,
            fuse: None,
        };
        let attach = |m: &mut Mounted| -> String {
            let out = run_for(
                Command::new(&losetup).args(["--find", "--show"]).arg(&disk),
                Duration::from_secs(60),
            );
            let dev = success("losetup", &out).trim().to_string();
            m.loop_dev = Some(dev.clone());
            dev
        };
        let dev = attach(&mut m);
        success(
            "mkfs.ext4",
            &run(Command::new(&mkfs).args(["-q", "-F", &dev])),
        );
        success(
            "mount",
            &run(Command::new(&mount)
                .args(["-t", "ext4", "-o", "commit=600", &dev])
                .arg(&mnt)),
        );
        m.mnt = Some(mnt.clone());
        let files: Vec<(PathBuf, Vec<u8>)> = (0..6)
            .map(|i| {
                let sub = mnt.join(format!("dir{}", i % 3));
                (
                    sub.join(format!("file{i}")),
                    random_bytes((512 << 10) + i * 4096 + 17, 300 + i as u64),
                )
            })
            .collect();
        let write = |path: &Path, data: &[u8], fsync: bool| {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            let mut f = std::fs::File::create(path).unwrap();
            f.write_all(data).unwrap();
            if fsync {
                f.sync_all().unwrap();
                std::fs::File::open(path.parent().unwrap())
                    .unwrap()
                    .sync_all()
                    .unwrap();
            } else {
                // To the device, without a flush: what the cut takes.
                // SAFETY: sync_file_range on a descriptor we own.
                unsafe {
                    libc::sync_file_range(
                        f.as_raw_fd(),
                        0,
                        0,
                        libc::SYNC_FILE_RANGE_WAIT_BEFORE
                            | libc::SYNC_FILE_RANGE_WRITE
                            | libc::SYNC_FILE_RANGE_WAIT_AFTER,
                    )
                };
            }
        };
        let synced = if power_cut { 4 } else { files.len() };
        for (path, data) in &files[..synced] {
            write(path, data, true);
        }
        if power_cut {
            write(&files[4].0, &files[4].1, false);
            let out = run(Command::new(env!("CARGO_BIN_EXE_cairn"))
                .arg("admin")
                .arg(&ctl)
                .arg("power-cut"));
            success("admin power-cut", &out);
            // The machine is gone: nothing more reaches the devices.
            srv.signal(libc::SIGKILL);
            let _ = srv.wait_exit();
            let _ = std::fs::remove_file(&ctl);
            // The file system goes with errors; the loop device with it.
            let _ = run(Command::new(&umount).arg(&mnt));
            if mounted(&mnt).is_some() {
                let _ = run(Command::new(&umount).arg("-l").arg(&mnt));
            }
            m.mnt = None;
            m.detach();
            srv = start();
            assert!(
                srv.stderr().contains("detached the stale mount"),
                "{}",
                srv.stderr()
            );
            let dev = attach(&mut m);
            // Mounting replays the journal.
            success(
                "mount after the cut",
                &run(Command::new(&mount).args(["-t", "ext4", &dev]).arg(&mnt)),
            );
            m.mnt = Some(mnt.clone());
        }
        m.unmount();
        let dev = m.loop_dev.clone().unwrap();
        let out = run(Command::new(&fsck).args(["-f", "-n", &dev]));
        success("fsck.ext4 -f -n (a clean file system)", &out);
        success(
            "mount -o ro",
            &run(Command::new(&mount)
                .args(["-t", "ext4", "-o", "ro", &dev])
                .arg(&mnt)),
        );
        m.mnt = Some(mnt.clone());
        for (path, data) in &files[..synced] {
            assert_same(
                &path.display().to_string(),
                &std::fs::read(path).unwrap(),
                data,
            );
        }
        m.unmount();
        m.detach();
        let (status, log) = srv.stop();
        assert!(status.success(), "{log}");
        assert!(mounted(&disk).is_none(), "unmounted at exit");
    }
}

// ---------------------------------------------------------------------------------------
// Hostile clients: idle slots, connections per address, memory

mod hostile {
    use super::*;

    /// A server on an ephemeral TCP port of 127.0.0.1, and the port.
    fn tcp_server(args: &[&str]) -> (Server, u16) {
        let dir = tmpdir();
        let none = dir.path().join("no.sock");
        let srv = Server::spawn(dir, none, &["--listen", "tcp:127.0.0.1:0"], args);
        let port = srv.addrs[0]
            .strip_prefix("tcp:127.0.0.1:")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("ready line address {:?}", srv.addrs));
        (srv, port)
    }

    /// A client from `from` in transmission on export "".
    fn go_from(from: [u8; 4], port: u16) -> Raw {
        Raw::connect_tcp_from(from, port)
            .handshake_on(&[], "", &[])
            .0
    }

    /// A write and a read back on `c`.
    #[track_caller]
    fn served(c: &mut Raw, what: &str, seed: u64) {
        let data = random_bytes(65536, seed);
        let at = (seed % 64) << 16;
        c.write_ok(seed, 0, at, &data);
        assert_same(what, &c.read_ok(seed + 1, at, 65536), &data);
    }

    #[test]
    fn one_address_cannot_take_every_slot_at_the_defaults() {
        let (srv, port) = tcp_server(&["--device", "mem:16M"]);
        let mut idle = Vec::new();
        let mut refused = 0;
        for _ in 0..128 {
            match Raw::connect_tcp_from([127, 0, 0, 2], port).admitted_now() {
                Some(c) => idle.push(c.after_greeting(&[], "", &[]).0),
                None => refused += 1,
            }
        }
        assert_eq!(
            (idle.len(), refused),
            (32, 96),
            "128 connections from one address, at --max-connections-per-address 32"
        );
        // Others still get in; the address's own connections still work.
        let mut good = go_from([127, 0, 0, 1], port);
        served(&mut good, "a client from another address", 1);
        served(&mut idle[31], "the address's last admitted connection", 3);
        let log = srv.stderr();
        assert!(
            log.contains(
                "refused, 32 connections from 127.0.0.2 already (--max-connections-per-address)"
            ),
            "{log}"
        );
    }

    #[test]
    fn a_good_client_is_served_while_128_idle_clients_sit_connected() {
        let (srv, port) = tcp_server(&[
            "--device",
            "mem:16M",
            "--max-connections",
            "128",
            "--idle-timeout",
            "3s",
        ]);
        // 128 addresses, one idle connection each: every slot of --max-connections.
        let started = Instant::now();
        let mut idle: Vec<Raw> = (1..=128u8).map(|i| go_from([127, 0, 1, i], port)).collect();
        // None has been idle for 3 s yet: a new client is refused. (On a machine so busy
        // that the 128 handshakes took seconds, the first may be idle that long already.)
        let fresh = started.elapsed() < Duration::from_secs(2);
        let admitted = Raw::connect_tcp_from([127, 0, 0, 1], port).admitted_now();
        if fresh && started.elapsed() < Duration::from_secs(3) {
            assert!(
                admitted.is_none(),
                "a 129th connection while the 128 are fresh"
            );
        }
        drop(admitted);
        std::thread::sleep(Duration::from_millis(3500));
        // Now the connection idle longest makes room: one of the first (each reactor
        // takes its connections in turn, so a busy machine may let the second or third
        // be idle longest by the server's clock).
        let mut good = go_from([127, 0, 0, 1], port);
        served(&mut good, "the new client", 5);
        let (gone, log) = evicted(&srv, "128 connections already (--max-connections)");
        assert!(!gone.is_empty(), "{log}");
        for v in &gone {
            let i = idle
                .iter()
                .position(|c| c.local() == *v)
                .unwrap_or_else(|| panic!("{v} closed, not an idle client: {log}"));
            assert!(i < 8, "idle client {i} of 128 closed first: {log}");
            assert_closed(&mut idle[i], "the connection idle longest");
        }
        served(&mut idle[127], "an idle client that wakes up", 7);
        served(&mut good, "the new client, again", 9);
        assert!(
            srv.wait_for_stderr(
                "closed: idle past --idle-timeout, its slot was needed",
                IO_TIMEOUT
            ),
            "{}",
            srv.stderr()
        );
    }

    /// The peers the server's log says were closed to make room after `why` (waiting
    /// for the first such line: the log is read on another thread), and the log.
    fn evicted(srv: &Server, why: &str) -> (Vec<String>, String) {
        let needle = format!("{why}: closing ");
        srv.wait_for_stderr(&needle, IO_TIMEOUT);
        let log = srv.stderr();
        let peers = log
            .lines()
            .filter_map(|l| l.split(&needle).nth(1))
            .filter_map(|r| r.split(' ').next())
            .map(str::to_string)
            .collect();
        (peers, log)
    }

    /// Raises this process's soft descriptor limit to its hard limit; panics if that
    /// leaves fewer than `n`.
    fn descriptors_for(n: u64) {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit and setrlimit of this process, on a local rlimit.
        unsafe {
            assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
            if lim.rlim_cur < lim.rlim_max {
                lim.rlim_cur = lim.rlim_max;
                assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
            }
        }
        assert!(
            lim.rlim_cur >= n,
            "this test needs {n} descriptors; RLIMIT_NOFILE allows {}",
            lim.rlim_cur
        );
    }

    /// The last lines of a log.
    fn tail(log: &str) -> String {
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    #[test]
    fn a_new_client_is_served_while_1000_idle_connections_are_held_at_the_defaults() {
        descriptors_for(1000 + 500);
        let (srv, port) = tcp_server(&["--device", "mem:16M"]);
        let before = rss(&srv);
        // 1,000 connections from 40 addresses (25 each, under the 32 allowed per
        // address), each through the handshake, then silent.
        let mut idle = Vec::new();
        let mut refused = 0;
        for i in 0..1000u32 {
            let from = [127, 0, 2, 1 + (i / 25) as u8];
            match Raw::connect_tcp_from(from, port).admitted_now() {
                Some(c) => idle.push(c.after_greeting(&[], "", &[]).0),
                None => refused += 1,
            }
        }
        let held = rss(&srv).saturating_sub(before);
        // A new client is served at once (within 10 s, for slow machines).
        let started = Instant::now();
        let Some(good) = Raw::connect_tcp_from([127, 0, 0, 1], port).admitted_now() else {
            panic!(
                "a new client was refused while {} idle connections were held ({refused} of 1,000 refused); log ends:\n{}",
                idle.len(),
                tail(&srv.stderr())
            )
        };
        let mut good = good.after_greeting(&[], "", &[]).0;
        served(&mut good, "a new client beside 1,000 idle connections", 21);
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(10),
            "the new client took {took:?}"
        );
        assert_eq!(
            (idle.len(), refused),
            (1000, 0),
            "idle connections admitted and refused"
        );
        // Idle connections are cheap: about 12 KiB each here.
        assert!(
            held < 1000 * (64 << 10),
            "1,000 idle connections hold {} KiB of resident memory",
            held >> 10
        );
        served(&mut idle[0], "the first idle connection", 23);
        served(&mut idle[999], "the last idle connection", 25);
    }

    #[test]
    fn a_full_server_closes_an_idle_connection_of_the_client_holding_most_before_the_idle_timeout()
    {
        let (srv, port) = tcp_server(&[
            "--device",
            "mem:16M",
            "--max-connections",
            "8",
            "--evict-idle-after",
            "1s",
        ]);
        let started = Instant::now();
        // Three connections from one address, then five from another: every slot.
        let mut few: Vec<Raw> = (0..3).map(|_| go_from([127, 0, 3, 2], port)).collect();
        // The first of the five goes into the middle of a write at once (half its
        // payload sent): a request in flight, so it keeps its slot until --idle-timeout
        // though it is idle longest.
        let mut many = vec![go_from([127, 0, 3, 1], port)];
        let payload = random_bytes(8192, 77);
        many[0]
            .send(&header(0, CMD_WRITE, 77, 1 << 20, 8192))
            .unwrap();
        many[0].send(&payload[..4096]).unwrap();
        many.extend((1..5).map(|_| go_from([127, 0, 3, 1], port)));
        let early = Raw::connect_tcp_from([127, 0, 3, 9], port).admitted_now();
        let fresh = started.elapsed() < Duration::from_millis(900);
        let mut good = match early {
            // Nobody has been idle for 1 s: refused. Then someone has.
            None => {
                std::thread::sleep(Duration::from_millis(1500));
                go_from([127, 0, 3, 9], port)
            }
            // A machine so slow that the first handshakes were 1 s ago already.
            Some(c) => {
                assert!(
                    !fresh,
                    "a ninth connection was admitted while the eight were fresh"
                );
                c.after_greeting(&[], "", &[]).0
            }
        };
        served(&mut good, "the new client", 31);
        // The client holding five gave up one (its longest quiet connection), though the
        // other client's have been idle longer, and long before --idle-timeout (5m).
        let (gone, log) = evicted(&srv, "8 connections already (--max-connections)");
        assert_eq!(gone.len(), 1, "{log}");
        let i = many
            .iter()
            .position(|c| c.local() == gone[0])
            .unwrap_or_else(|| panic!("{} closed, not the client holding five: {log}", gone[0]));
        assert!(
            i > 0,
            "the connection in the middle of a write was closed: {log}"
        );
        assert_closed(
            &mut many[i],
            "the longest idle connection of the client holding the most",
        );
        many[0].send(&payload[4096..]).unwrap();
        many[0].expect(77, 0);
        assert_same(
            "the write that was in the middle",
            &many[0].read_ok(78, 1 << 20, 8192),
            &payload,
        );
        for (j, c) in few.iter_mut().enumerate() {
            served(
                c,
                "a connection of the client holding three",
                40 + 2 * j as u64,
            );
        }
        served(
            &mut many[1 + i % 4],
            "another connection of the client holding five",
            51,
        );
        assert!(
            log.contains("over --evict-idle-after) to make room"),
            "{log}"
        );
        assert!(
            srv.wait_for_stderr(
                "closed: idle for --evict-idle-after, its slot was needed",
                IO_TIMEOUT
            ),
            "{}",
            srv.stderr()
        );
    }

    #[test]
    fn at_its_per_address_limit_a_client_gives_up_its_own_longest_idle_connection() {
        let (srv, port) = tcp_server(&[
            "--device",
            "mem:16M",
            "--max-connections-per-address",
            "2",
            "--evict-idle-after",
            "1s",
        ]);
        // Another client's connection is idle longest of all, and stays.
        let mut other = go_from([127, 0, 4, 2], port);
        let mut mine: Vec<Raw> = (0..2).map(|_| go_from([127, 0, 4, 1], port)).collect();
        std::thread::sleep(Duration::from_millis(1500));
        let mut third = go_from([127, 0, 4, 1], port);
        served(&mut third, "a third connection of the address", 61);
        let (gone, log) = evicted(
            &srv,
            "2 connections from 127.0.4.1 already (--max-connections-per-address)",
        );
        assert_eq!(gone.len(), 1, "{log}");
        let i = mine
            .iter()
            .position(|c| c.local() == gone[0])
            .unwrap_or_else(|| panic!("{} closed, not one of the address's: {log}", gone[0]));
        assert_closed(&mut mine[i], "the address's longest idle connection");
        served(&mut mine[1 - i], "the address's other connection", 63);
        served(&mut other, "another address's connection", 65);
    }

    #[test]
    fn max_connections_is_lowered_to_what_descriptors_allow() {
        let dir = tmpdir();
        let none = dir.path().join("no.sock");
        let srv = Server::spawn_limited(
            dir,
            none,
            &["--listen", "tcp:127.0.0.1:0"],
            &["--device", "mem:16M"],
            Some((160, 160)),
        );
        let port: u16 = srv.addrs[0]
            .strip_prefix("tcp:127.0.0.1:")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("ready line address {:?}", srv.addrs));
        let log = srv.stderr();
        let lowered: usize = log
            .split("--max-connections lowered from 4096 to ")
            .nth(1)
            .and_then(|r| r.split(':').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no lowered limit in the log:\n{log}"));
        assert!(
            (1..160).contains(&lowered),
            "lowered to {lowered} of 160 descriptors"
        );
        // That many are served (from several addresses), and the next is refused at
        // once rather than failing in accept for want of a descriptor.
        let mut conns: Vec<Raw> = (0..lowered)
            .map(|i| go_from([127, 0, 5, 1 + (i / 30) as u8], port))
            .collect();
        let refused = Raw::connect_tcp_from([127, 0, 5, 99], port).admitted_now();
        assert!(refused.is_none(), "one more than the lowered limit");
        served(&mut conns[lowered - 1], "the last connection let in", 71);
        let refusal = format!("refused, {lowered} connections already (--max-connections)");
        srv.wait_for_stderr(&refusal, IO_TIMEOUT);
        let log = srv.stderr();
        assert!(log.contains(&refusal), "{}", tail(&log));
        assert!(!log.contains("accept:"), "{}", tail(&log));

        // A soft limit below the hard one is raised to it.
        let mut hard = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit into a local rlimit.
        assert_eq!(
            unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut hard) },
            0
        );
        let hard = hard.rlim_max.min(1 << 20);
        if hard <= 256 {
            return skip(
                "max_connections_is_lowered_to_what_descriptors_allow",
                "the hard descriptor limit is 256 or less: nothing to raise",
            );
        }
        let dir = tmpdir();
        let none = dir.path().join("no.sock");
        let srv = Server::spawn_limited(
            dir,
            none,
            &["--listen", "tcp:127.0.0.1:0"],
            &["--device", "mem:16M"],
            Some((256, hard)),
        );
        let log = srv.stderr();
        assert!(
            log.contains(&format!(
                "descriptor limit (RLIMIT_NOFILE) raised from 256 to {hard}"
            )),
            "{log}"
        );
        if hard >= 4096 + 512 {
            assert!(!log.contains("lowered"), "{log}");
        }
    }

    #[test]
    fn idle_connections_stay_small_after_others_came_and_went() {
        descriptors_for(300 + 500);
        let srv = Server::start(&[
            "--device",
            "null:1G",
            "--max-connections",
            "1000",
            "--max-connections-per-address",
            "1000",
        ]);
        let closed = |srv: &Server| srv.stderr().matches("disconnected from export").count();
        // Connections that come and go: their input buffers go back to the allocator.
        for round in 1..=2 {
            let conns: Vec<Raw> = (0..300).map(|_| Raw::go(&srv.sock, "").0).collect();
            drop(conns);
            let deadline = Instant::now() + IO_TIMEOUT;
            while closed(&srv) < 300 * round && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            assert_eq!(closed(&srv), 300 * round, "connections closed");
        }
        // New idle connections must not each hold a 256 KiB input buffer that the
        // allocator zeroed by writing it.
        let before = rss(&srv);
        let idle: Vec<Raw> = (0..300).map(|_| Raw::go(&srv.sock, "").0).collect();
        std::thread::sleep(Duration::from_millis(200));
        let per = rss(&srv).saturating_sub(before) / idle.len() as u64;
        assert!(
            per < 64 << 10,
            "{} KiB per idle connection after others came and went",
            per >> 10
        );
    }

    #[test]
    fn connections_give_their_input_buffers_back_once_idle() {
        let srv = Server::start(&[
            "--device",
            "mem:16M",
            "--max-connections-per-address",
            "200",
            "--log-level",
            "debug",
        ]);
        let before = rss(&srv);
        // 100 clients each send 9,000 flushes at once (246 KiB of headers: a full input
        // buffer), read every reply, then go quiet.
        let burst: Vec<u8> = (0..9000u64)
            .flat_map(|j| header(0, CMD_FLUSH, j, 0, 0))
            .collect();
        let mut conns = Vec::new();
        for _ in 0..100 {
            let (mut c, _, _) = Raw::go(&srv.sock, "");
            c.send(&burst).unwrap();
            for j in 0..9000u64 {
                c.expect(j, 0);
            }
            conns.push(c);
        }
        let busy = rss(&srv).saturating_sub(before) / 100;
        // Idle for a second, they give back what their input buffers held (256 KiB
        // each); what stays is their request and reply tables (about 90 KiB each).
        let deadline = Instant::now() + IO_TIMEOUT;
        let mut idle = busy;
        while idle >= 192 << 10 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
            idle = rss(&srv).saturating_sub(before) / 100;
        }
        assert!(
            idle < 192 << 10,
            "{} KiB per idle connection after a burst ({} KiB just after it)",
            idle >> 10,
            busy >> 10
        );
        // And they serve as before: a burst, one request, then a write and a read.
        for (i, c) in conns.iter_mut().enumerate() {
            let i = i as u64;
            c.send(&burst).unwrap();
            for j in 0..9000u64 {
                c.expect(j, 0);
            }
            c.write_ok(100_000 + i, 0, i << 16, &random_bytes(4096, i));
            assert_same(
                "a write read back after the input buffer went back",
                &c.read_ok(200_000 + i, i << 16, 4096),
                &random_bytes(4096, i),
            );
        }
        let given = srv
            .stderr()
            .matches("KiB of input buffer given back")
            .count();
        // (Those whose bursts arrived in pieces never filled their buffers past 64 KiB.)
        assert!(given > 0, "no input buffer given back");
    }

    #[test]
    fn idle_close_closes_idle_connections_and_spares_busy_ones() {
        // Writes to the slow device take 2.5 s: longer than the idle timeout.
        let dir = tmpdir();
        let stack = write_stack(
            &dir,
            "[device.m]\ntype = \"mem\"\nsize = \"16M\"\n\n\
             [device.slow]\ntype = \"delay\"\nbase = \"m\"\nwrite = \"2500ms\"\n\n\
             [export.\"\"]\ndevice = \"slow\"\n",
        );
        let srv = Server::start(&[path_str(&stack), "--idle-timeout", "1s", "--idle-close"]);
        let (mut idle, _, _) = Raw::go(&srv.sock, "");
        let (mut busy, _, _) = Raw::go(&srv.sock, "");
        let (mut chatty, _, _) = Raw::go(&srv.sock, "");
        // Sends a write's header, then its payload a byte every 100 ms: never idle by
        // bytes moved, but no request arrives or ends.
        let (mut trickle, _, _) = Raw::go(&srv.sock, "");
        trickle.send(&header(0, CMD_WRITE, 7, 8192, 4096)).unwrap();
        let data = random_bytes(4096, 13);
        busy.request(0, CMD_WRITE, 1, 0, 4096, &data).unwrap();
        let mut trickled = 0;
        for i in 0..20 {
            chatty.read_ok(100 + i, 0, 4096);
            // Fails once the server closed it; the check is below.
            if trickle.send(&[0x5a]).is_ok() {
                trickled += 1;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // Closed about 1 s in, while it still trickled (at 2 s the loop ends).
        assert!(
            (5..20).contains(&trickled),
            "the trickling client sent {trickled} of 20 bytes before it was closed"
        );
        assert_closed(
            &mut idle,
            "a connection idle past --idle-timeout with --idle-close",
        );
        assert_closed(
            &mut trickle,
            "a connection trickling one request's payload past --idle-timeout",
        );
        // The write at the device for 2.5 s kept its connection.
        busy.expect(1, 0);
        assert_same("the slow write", &busy.read_ok(2, 0, 4096), &data);
        chatty.read_ok(200, 0, 4096);
        let log = srv.stderr();
        assert!(
            log.contains("closed: idle for --idle-timeout (--idle-close)"),
            "{log}"
        );
    }

    /// The server's resident memory, from /proc.
    fn rss(srv: &Server) -> u64 {
        let pid = srv.child.as_ref().expect("server running").id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("VmRSS in {status}"));
        kb << 10
    }

    #[test]
    fn rss_stays_under_the_memory_budget_with_half_payloads_and_clients_that_never_read() {
        const BUDGET: u64 = 256 << 20;
        let srv = Server::start(&[
            "--device",
            "null:1G",
            "--memory-budget",
            "256M",
            "--max-connections",
            "200",
            "--max-connections-per-address",
            "200",
            "--idle-timeout",
            "4s",
        ]);
        // The bound README.md documents: the budget, 1 MiB per connection, 64 MiB.
        let bound = BUDGET + 140 * (1 << 20) + (64 << 20);
        let mut peak = rss(&srv);
        let mut hostile = Vec::new();
        // 100 clients send a 32 MiB write's header and half its payload, as fast as the
        // server takes it.
        let half = vec![0xabu8; 16 << 20];
        for i in 0..100u64 {
            let (mut c, _, _) = Raw::go(&srv.sock, "");
            c.send(&header(0, CMD_WRITE, i, 0, 32 << 20)).unwrap();
            c.s.set_nonblocking(true).unwrap();
            let mut sent = 0;
            while sent < half.len() {
                match c.s.write(&half[sent..]) {
                    Ok(n) => sent += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) => panic!("half payload: {e}"),
                }
            }
            hostile.push(c);
            peak = peak.max(rss(&srv));
        }
        // 40 clients ask for 64 MiB of reads each and never read a reply.
        for _ in 0..40 {
            let (mut c, _, _) = Raw::go(&srv.sock, "");
            let mut reads = Vec::new();
            for j in 0..64u64 {
                reads.extend_from_slice(&header(0, CMD_READ, j, j << 20, 1 << 20));
            }
            c.send(&reads).unwrap();
            hostile.push(c);
            peak = peak.max(rss(&srv));
        }
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(100));
            peak = peak.max(rss(&srv));
        }
        assert!(
            peak < bound,
            "peak RSS {} MiB over the bound of {} MiB",
            peak >> 20,
            bound >> 20
        );
        // The budget was reached: connections waited for memory.
        srv.signal(libc::SIGUSR1);
        assert!(
            srv.wait_for_stderr("waits for memory", IO_TIMEOUT),
            "{}",
            srv.stderr()
        );
        let log = srv.stderr();
        let waits: u64 = log
            .lines()
            .find_map(|l| l.split(" (--memory-budget), ").nth(1))
            .and_then(|w| w.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no wait count in {log}"));
        assert!(
            waits > 0,
            "the hostile clients never filled the budget: {log}"
        );
        // A good client is served: the idle hostile connections that hold memory are
        // closed once they have been idle for --idle-timeout.
        let (mut good, _, _) = Raw::go(&srv.sock, "");
        good.s
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let data = random_bytes(1 << 20, 17);
        good.write_ok(1, 0, 0, &data);
        good.request(0, CMD_READ, 2, 0, 1 << 20, &[]).unwrap();
        if let Err(e) = good.reply() {
            let log = srv.stderr();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            panic!(
                "the good client's read: {e}; log ends:\n{}",
                tail.join("\n")
            );
        }
        assert_eq!(good.read_exact(1 << 20).unwrap().len(), 1 << 20);
        assert!(rss(&srv) < bound);
        let log = srv.stderr();
        assert!(
            log.contains("closed: idle past --idle-timeout, holding memory others waited for"),
            "{log}"
        );
    }
}
