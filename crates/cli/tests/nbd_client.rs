//! cairn's NBD client against real servers (cairn serve, nbdkit and qemu-nbd): the
//! handshake, and the `nbd` device checked against a model with random batches of
//! requests in flight together; and against a raw-socket server that breaks the protocol
//! in each way a client must survive. Tools that are missing are skipped with a reason.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cairn_nbd::client::handshake::{connect, HandshakeError, Want};
use cairn_nbd::proto::tflags;
use cairn_nbd::uri::NbdUri;
use common::{skip, tmpdir, tool};

/// Kills the server when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the server `cmd` (output discarded) and waits until it listens on `sock`.
fn start(cmd: &mut Command, sock: &std::path::Path) -> Running {
    start_logging(cmd, sock, Stdio::null())
}

/// [`start`], with the server's stderr going to `log`.
fn start_logging(cmd: &mut Command, sock: &std::path::Path, log: Stdio) -> Running {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start the server");
    let mut srv = Running(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !sock.exists() {
        if let Ok(Some(status)) = srv.0.try_wait() {
            panic!("the server exited before listening: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            sock.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    srv
}

/// nbdkit's memory plugin of `size` on `dir/nbdkit.sock`.
fn nbdkit_memory(
    nbdkit: &std::path::Path,
    dir: &std::path::Path,
    size: &str,
) -> (Running, std::path::PathBuf) {
    let sock = dir.join("nbdkit.sock");
    let srv = start(
        Command::new(nbdkit)
            .args(["--foreground", "--exit-with-parent", "-U"])
            .arg(&sock)
            .args(["memory", &format!("size={size}")]),
        &sock,
    );
    (srv, sock)
}

/// qemu-nbd serving a new raw image of `size` bytes on `dir/qemu.sock`, with `option`.
fn qemu_nbd_image(
    qemu_nbd: &std::path::Path,
    dir: &std::path::Path,
    size: u64,
    option: &str,
) -> (Running, std::path::PathBuf) {
    let img = dir.join("q.img");
    std::fs::File::create(&img).unwrap().set_len(size).unwrap();
    let sock = dir.join("qemu.sock");
    let srv = start(
        Command::new(qemu_nbd)
            .args([
                "--persistent",
                "--shared=4",
                "--format=raw",
                option,
                "--socket",
            ])
            .arg(&sock)
            .arg(&img),
        &sock,
    );
    (srv, sock)
}

fn uri(sock: &std::path::Path, export: &str) -> NbdUri {
    NbdUri::parse(&format!("nbd+unix:///{export}?socket={}", sock.display())).unwrap()
}

const TIMEOUT: Duration = Duration::from_secs(10);

/// Against cairn serve: size, flags, block sizes, structured replies and the allocation
/// context as the server advertises them; an unknown export is refused with the reason.
#[test]
fn handshake_with_cairn_serve() {
    let dir = tmpdir();
    let sock = dir.path().join("nbd.sock");
    let _srv = start(
        Command::new(env!("CARGO_BIN_EXE_cairn"))
            .args(["serve", "--device", "mem:16M", "--listen"])
            .arg(format!("unix:{}", sock.display())),
        &sock,
    );
    let (_fd, n) = connect(&uri(&sock, ""), Want::default(), TIMEOUT).unwrap();
    assert_eq!(n.size, 16 << 20);
    assert!(n.flags & tflags::HAS_FLAGS != 0 && n.flags & tflags::SEND_FLUSH != 0);
    assert_eq!((n.min_block, n.preferred_block), (1, 4096));
    assert_eq!(n.max_payload, 64 << 20);
    assert!(n.structured);
    assert!(n.allocation_id.is_some());
    // Extended headers when asked for.
    let ext = Want {
        extended: true,
        ..Want::default()
    };
    let (_fd, n) = connect(&uri(&sock, ""), ext, TIMEOUT).unwrap();
    assert!(n.structured && n.extended && n.allocation_id.is_some());
    let plain = Want {
        extended: false,
        structured: false,
        allocation: true,
    };
    let (_fd, n) = connect(&uri(&sock, ""), plain, TIMEOUT).unwrap();
    assert!(!n.structured && n.allocation_id.is_none());
    match connect(&uri(&sock, "nope"), Want::default(), TIMEOUT) {
        Err(HandshakeError::Refused(why)) => assert!(why.contains("no such export"), "{why}"),
        other => panic!("an unknown export: {other:?}"),
    }
}

/// Against nbdkit's memory plugin and qemu-nbd: the size each was given.
#[test]
fn handshake_with_nbdkit_and_qemu_nbd() {
    let dir = tmpdir();
    if let Some(nbdkit) = tool("nbdkit") {
        let (_srv, sock) = nbdkit_memory(&nbdkit, dir.path(), "8M");
        let (_fd, n) = connect(&uri(&sock, ""), Want::default(), TIMEOUT).unwrap();
        assert_eq!(n.size, 8 << 20);
        assert!(n.structured);
    } else {
        skip("handshake_with_nbdkit", "no nbdkit (Debian: nbdkit)");
    }
    if let Some(qemu_nbd) = tool("qemu-nbd") {
        let (_srv, sock) = qemu_nbd_image(&qemu_nbd, dir.path(), 4 << 20, "--export-name=q");
        let (_fd, n) = connect(&uri(&sock, "q"), Want::default(), TIMEOUT).unwrap();
        assert_eq!(n.size, 4 << 20);
        assert!(n.structured && !n.extended && n.allocation_id.is_some());
        // qemu-nbd (8.2 and later) speaks extended headers.
        let ext = Want {
            extended: true,
            ..Want::default()
        };
        let (_fd, n) = connect(&uri(&sock, "q"), ext, TIMEOUT).unwrap();
        assert!(
            n.structured && n.extended && n.allocation_id.is_some(),
            "{n:?}"
        );
    } else {
        skip(
            "handshake_with_qemu_nbd",
            "no qemu-nbd (Debian: qemu-utils)",
        );
    }
}

/// A socket that does not speak NBD is refused with a reason, not a hang or a panic.
#[test]
fn a_server_that_is_not_nbd_is_refused() {
    let dir = tmpdir();
    let sock = dir.path().join("junk.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let t = std::thread::spawn(move || {
        use std::io::Write;
        let (mut c, _) = listener.accept().unwrap();
        let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        std::thread::sleep(Duration::from_millis(200));
    });
    match connect(&uri(&sock, ""), Want::default(), TIMEOUT) {
        Err(HandshakeError::Refused(why)) => assert!(why.contains("not an NBD server"), "{why}"),
        other => panic!("{other:?}"),
    }
    t.join().unwrap();
}

// ---------------------------------------------------------------------------------------
// The nbd device against a model.

use std::sync::Arc;

use cairn_core::blocking::{BlockingQueue, Request};
use cairn_core::{Array, Device, IoFlags, Op, Switches};
use cairn_leaves::LeafSpec;
use cairn_stacks::array::{ArrayAction, ArrayAdmin};

/// xorshift64*: a reproducible sequence without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn open_nbd(spec: &str) -> Arc<dyn Device> {
    let leaf = LeafSpec::parse(spec).unwrap();
    cairn_leaves::open(&leaf, "remote").unwrap()
}

/// Random batches of up to 16 requests on disjoint ranges, in flight together: reads are
/// checked against the model as it was before the batch, writes (with or without FUA),
/// discards (which must read back as zeroes) and write-zeroes change it; a request now and
/// then is larger than 32 MiB (the client's largest part), so it goes in parts. Every
/// 8 batches, block status must not claim zeroes where the model has data. At the end the
/// whole device is read back and compared.
fn model_run(device: &Arc<dyn Device>, seed: u64, batches: usize) {
    let g = device.geometry();
    let block = u64::from(g.block_bytes);
    let size = g.size_bytes;
    let blocks = size / block;
    let mut model = vec![0u8; size as usize];
    let q = BlockingQueue::open(device, Switches::default()).unwrap();
    // Start from zeroes whatever the server held.
    q.zero(Op::WriteZeroes, 0, size, IoFlags::NONE).unwrap();
    let mut rng = Rng(seed | 1);
    for batch in 0..batches {
        // Every tenth batch, one request of over 32 MiB (the client's largest part):
        // a write, then a read, in parts.
        let big = batch % 10 == 5 || batch % 10 == 6;
        let k = if big { 1 } else { 1 + rng.below(16) as usize };
        // Disjoint ranges: cut the device into k slices and pick one range inside each.
        let mut plans = Vec::new();
        for i in 0..k as u64 {
            let lo = blocks * i / k as u64;
            let hi = blocks * (i + 1) / k as u64;
            if hi <= lo {
                continue;
            }
            let first = if big {
                rng.below(blocks / 8)
            } else {
                lo + rng.below(hi - lo)
            };
            let most = if rng.below(40) == 0 {
                hi - first
            } else {
                (hi - first).min(64)
            };
            let n = if big {
                (36 << 20) / block + rng.below(blocks / 4)
            } else {
                1 + rng.below(most)
            };
            let op = match rng.below(12) {
                _ if big && batch % 10 == 5 => Op::Write,
                _ if big => Op::Read,
                0..=4 => Op::Read,
                5..=8 => Op::Write,
                9 => Op::Discard,
                10 => Op::WriteZeroes,
                _ => Op::Flush,
            };
            let flags = if op.is_write() && rng.below(4) == 0 {
                IoFlags::FUA
            } else {
                IoFlags::NONE
            };
            plans.push((op, flags, first * block, n * block));
        }
        let mut bufs: Vec<Vec<u8>> = plans
            .iter()
            .map(|&(op, _, off, len)| match op {
                Op::Write => {
                    // Not periodic: a part sent from the wrong place in the buffer shows.
                    let mut r = Rng(rng.next() | 1);
                    let _ = off;
                    (0..len / 8).flat_map(|_| r.next().to_le_bytes()).collect()
                }
                Op::Read => vec![0xA5; len as usize],
                _ => Vec::new(),
            })
            .collect();
        let mut reqs: Vec<Request<'_>> = plans
            .iter()
            .zip(bufs.iter_mut())
            .map(|(&(op, flags, offset, len), b)| Request {
                op,
                flags,
                offset,
                len,
                buf: if op.has_data() {
                    Some(b.as_mut_slice())
                } else {
                    None
                },
            })
            .collect();
        let results = q.run(&mut reqs);
        drop(reqs);
        for (i, r) in results.iter().enumerate() {
            let (op, _, off, len) = plans[i];
            assert!(
                r.is_ok(),
                "seed {seed} batch {batch}: {op} {off}+{len}: {r:?}"
            );
            let range = off as usize..(off + len) as usize;
            match op {
                Op::Read => assert!(
                    bufs[i] == model[range.clone()],
                    "seed {seed} batch {batch}: read {off}+{len} differs from the model"
                ),
                Op::Write => model[range].copy_from_slice(&bufs[i]),
                Op::Discard | Op::WriteZeroes => model[range].fill(0),
                Op::Flush => {}
            }
        }
        if batch % 8 == 7 {
            let start = rng.below(blocks) * block;
            let mut ext = Vec::new();
            device.extents(start, size - start, &mut ext).unwrap();
            let mut pos = start;
            for e in &ext {
                if e.zero {
                    let r = pos as usize..(pos + e.len) as usize;
                    assert!(
                        model[r].iter().all(|&b| b == 0),
                        "seed {seed}: block status claims zeroes at {pos}+{} over data",
                        e.len
                    );
                }
                pos += e.len;
            }
            assert!(
                pos > start && pos <= size,
                "extents from {start} end at {pos}"
            );
        }
    }
    let mut all = vec![0u8; size as usize];
    q.read(0, &mut all).unwrap();
    assert!(
        all == model,
        "seed {seed}: the device differs from the model at the end"
    );
}

/// The nbd device against cairn serve, with four connections (cairn serve allows
/// multi-conn on a mem device) and with one.
#[test]
fn nbd_device_matches_a_model_against_cairn_serve() {
    let dir = tmpdir();
    let sock = dir.path().join("nbd.sock");
    let _srv = start(
        Command::new(env!("CARGO_BIN_EXE_cairn"))
            .args(["serve", "--device", "mem:80M", "--listen"])
            .arg(format!("unix:{}", sock.display())),
        &sock,
    );
    for (seed, conns) in [(1, 4), (2, 1)] {
        let d = open_nbd(&format!(
            "nbd:nbd+unix:///?socket={},connections={conns}",
            sock.display()
        ));
        assert_eq!(d.geometry().size_bytes, 80 << 20);
        model_run(&d, seed, 60);
    }
}

#[test]
fn nbd_device_matches_a_model_against_nbdkit() {
    let Some(nbdkit) = tool("nbdkit") else {
        return skip(
            "nbd_device_matches_a_model_against_nbdkit",
            "no nbdkit (Debian: nbdkit)",
        );
    };
    let dir = tmpdir();
    let (_srv, sock) = nbdkit_memory(&nbdkit, dir.path(), "72M");
    let d = open_nbd(&format!(
        "nbd:nbd+unix:///?socket={},connections=2",
        sock.display()
    ));
    model_run(&d, 3, 60);
}

/// qemu-nbd speaks extended headers: the device's requests and replies use them.
#[test]
fn nbd_device_matches_a_model_against_qemu_nbd() {
    let Some(qemu_nbd) = tool("qemu-nbd") else {
        return skip(
            "nbd_device_matches_a_model_against_qemu_nbd",
            "no qemu-nbd (Debian: qemu-utils)",
        );
    };
    let dir = tmpdir();
    let (_srv, sock) = qemu_nbd_image(&qemu_nbd, dir.path(), 72 << 20, "--discard=unmap");
    let d = open_nbd(&format!("nbd:nbd+unix:///?socket={}", sock.display()));
    assert!(
        d.describe().contains("extended headers"),
        "{}",
        d.describe()
    );
    model_run(&d, 4, 60);
}

// ---------------------------------------------------------------------------------------
// A server that breaks the protocol.

/// How the fake server answers requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Misbehave {
    /// Correctly: reads return bytes equal to the offset's low byte.
    Not,
    /// A reply with a cookie no request has.
    WrongCookie,
    /// Half a reply header, then the connection closes.
    ShortReply,
    /// A structured read chunk far longer than the read.
    OversizedChunk,
    /// The reply header and half the data, then the connection closes.
    DisconnectMidReply,
    /// A data chunk whose offset is so large that offset plus length wraps around.
    DataOffsetWraps,
    /// A hole chunk whose offset is so large that offset plus length wraps around.
    HoleOffsetWraps,
}

/// A minimal NBD server on `sock` (structured replies, no extended headers), answering
/// reads per `mode`, on every connection it is given until the test ends.
fn fake_server(sock: &std::path::Path, mode: Misbehave) -> std::thread::JoinHandle<()> {
    use std::io::{Read, Write};
    let listener = std::os::unix::net::UnixListener::bind(sock).unwrap();
    std::thread::spawn(move || {
        for c in listener.incoming() {
            let Ok(mut c) = c else { return };
            std::thread::spawn(move || {
                let mut serve = || -> std::io::Result<()> {
                    c.write_all(&0x4e42_444d_4147_4943u64.to_be_bytes())?;
                    c.write_all(&0x4948_4156_454f_5054u64.to_be_bytes())?;
                    c.write_all(&3u16.to_be_bytes())?;
                    let mut f = [0u8; 4];
                    c.read_exact(&mut f)?;
                    let mut structured = false;
                    loop {
                        let mut h = [0u8; 16];
                        c.read_exact(&mut h)?;
                        let option = u32::from_be_bytes(h[8..12].try_into().unwrap());
                        let len = u32::from_be_bytes(h[12..16].try_into().unwrap());
                        let mut data = vec![0u8; len as usize];
                        c.read_exact(&mut data)?;
                        let reply = |c: &mut std::os::unix::net::UnixStream,
                                     kind: u32,
                                     d: &[u8]|
                         -> std::io::Result<()> {
                            c.write_all(&0x0003_e889_0455_65a9u64.to_be_bytes())?;
                            c.write_all(&option.to_be_bytes())?;
                            c.write_all(&kind.to_be_bytes())?;
                            c.write_all(&(d.len() as u32).to_be_bytes())?;
                            c.write_all(d)
                        };
                        match option {
                            8 => {
                                structured = true;
                                reply(&mut c, 1, &[])?
                            }
                            7 => {
                                let mut info = vec![0u8, 0];
                                info.extend_from_slice(&(1u64 << 20).to_be_bytes());
                                info.extend_from_slice(&(1u16 | 4).to_be_bytes());
                                reply(&mut c, 3, &info)?;
                                reply(&mut c, 1, &[])?;
                                break;
                            }
                            _ => reply(&mut c, (1 << 31) + 1, &[])?,
                        }
                    }
                    assert!(structured, "the client asks for structured replies");
                    loop {
                        let mut h = [0u8; 28];
                        c.read_exact(&mut h)?;
                        let command = u16::from_be_bytes(h[6..8].try_into().unwrap());
                        let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
                        let offset = u64::from_be_bytes(h[16..24].try_into().unwrap());
                        let len = u32::from_be_bytes(h[24..28].try_into().unwrap());
                        if command == 2 {
                            return Ok(());
                        }
                        if command == 1 {
                            let mut sink = vec![0u8; len as usize];
                            c.read_exact(&mut sink)?;
                        }
                        let data: Vec<u8> =
                            (0..u64::from(len)).map(|i| (offset + i) as u8).collect();
                        let chunk = |flags: u16, kind: u16, cookie: u64, plen: u32| {
                            let mut v = Vec::new();
                            v.extend_from_slice(&0x668e_33efu32.to_be_bytes());
                            v.extend_from_slice(&flags.to_be_bytes());
                            v.extend_from_slice(&kind.to_be_bytes());
                            v.extend_from_slice(&cookie.to_be_bytes());
                            v.extend_from_slice(&plen.to_be_bytes());
                            v
                        };
                        let mut read_reply = chunk(1, 1, cookie, len + 8);
                        read_reply.extend_from_slice(&offset.to_be_bytes());
                        read_reply.extend_from_slice(&data);
                        match (command, mode) {
                            (0, Misbehave::WrongCookie) => {
                                let mut r = read_reply.clone();
                                r[8..16]
                                    .copy_from_slice(&(cookie ^ 0x5a5a_0000_0000).to_be_bytes());
                                c.write_all(&r)?;
                            }
                            (0, Misbehave::ShortReply) => {
                                c.write_all(&read_reply[..10])?;
                                return Ok(());
                            }
                            (0, Misbehave::OversizedChunk) => {
                                c.write_all(&chunk(1, 1, cookie, 1 << 30))?;
                                c.write_all(&offset.to_be_bytes())?;
                                c.write_all(&data)?;
                            }
                            (0, Misbehave::DisconnectMidReply) => {
                                c.write_all(&read_reply[..read_reply.len() / 2])?;
                                return Ok(());
                            }
                            (0, Misbehave::DataOffsetWraps) => {
                                c.write_all(&chunk(1, 1, cookie, len + 8))?;
                                c.write_all(&(u64::MAX - 100).to_be_bytes())?;
                                c.write_all(&data)?;
                            }
                            (0, Misbehave::HoleOffsetWraps) => {
                                c.write_all(&chunk(1, 2, cookie, 12))?;
                                c.write_all(&(u64::MAX - 100).to_be_bytes())?;
                                c.write_all(&len.to_be_bytes())?;
                            }
                            (0, Misbehave::Not) => c.write_all(&read_reply)?,
                            _ => {
                                // Write, flush: a simple success.
                                let mut r = Vec::new();
                                r.extend_from_slice(&0x6744_6698u32.to_be_bytes());
                                r.extend_from_slice(&0u32.to_be_bytes());
                                r.extend_from_slice(&cookie.to_be_bytes());
                                c.write_all(&r)?;
                            }
                        }
                    }
                };
                let _ = serve();
            });
        }
    })
}

/// Runs `f` on its own thread and fails the test if it takes longer than `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .expect("the client hung (or panicked) on a misbehaving server")
}

/// Each way of breaking the protocol fails the reads it concerns with EIO (within the
/// device's 1 s timeout, since reconnecting meets the same server), never a panic or a
/// hang; a write on the same connection beforehand still succeeds, and a correct server
/// reads back the bytes it serves.
#[test]
fn a_misbehaving_server_gives_eio_not_a_panic_or_a_hang() {
    let dir = tmpdir();
    for mode in [
        Misbehave::Not,
        Misbehave::WrongCookie,
        Misbehave::ShortReply,
        Misbehave::OversizedChunk,
        Misbehave::DisconnectMidReply,
        Misbehave::DataOffsetWraps,
        Misbehave::HoleOffsetWraps,
    ] {
        let sock = dir.path().join(format!("{mode:?}.sock"));
        let _server = fake_server(&sock, mode);
        let spec = format!("nbd:nbd+unix:///?socket={},timeout=1s", sock.display());
        let results = within(Duration::from_secs(30), move || {
            let d = open_nbd(&spec);
            let q = BlockingQueue::open(&d, Switches::default()).unwrap();
            let w = q.write(0, &[7u8; 4096], IoFlags::NONE);
            let mut bufs = vec![vec![0u8; 4096]; 4];
            let mut reqs: Vec<Request<'_>> = bufs
                .iter_mut()
                .enumerate()
                .map(|(i, b)| Request {
                    op: Op::Read,
                    flags: IoFlags::NONE,
                    offset: 8192 * i as u64,
                    len: 0,
                    buf: Some(b.as_mut_slice()),
                })
                .collect();
            let r = q.run(&mut reqs);
            drop(reqs);
            (w, r, bufs)
        });
        let (w, reads, bufs) = results;
        assert!(w.is_ok(), "{mode:?}: the write: {w:?}");
        for (i, r) in reads.iter().enumerate() {
            if mode == Misbehave::Not {
                assert!(r.is_ok(), "{mode:?}: read {i}: {r:?}");
                let want: Vec<u8> = (0..4096u64).map(|j| (8192 * i as u64 + j) as u8).collect();
                assert!(
                    bufs[i] == want,
                    "{mode:?}: read {i} returned the wrong bytes"
                );
            } else {
                match r {
                    Err(cairn_core::blocking::BlockingError::Failed(s)) => {
                        assert_eq!(s.raw(), libc::EIO, "{mode:?}: read {i}: {s}")
                    }
                    other => panic!("{mode:?}: read {i} should fail with EIO: {other:?}"),
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Across hosts: two network namespaces joined by a veth pair.

/// Two network namespaces, `a` and `b`, joined by a veth pair with addresses
/// 10.231.N.1 (in `a`) and 10.231.N.2 (in `b`); removed (with the pair) when dropped.
struct VethPair {
    a: String,
    b: String,
    dev_a: String,
    net: u32,
}

impl VethPair {
    fn ip(args: &[&str]) -> Result<(), String> {
        let out = Command::new("ip")
            .args(args)
            .output()
            .map_err(|e| format!("ip: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "ip {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    fn new() -> Result<VethPair, String> {
        let tag = std::process::id() % 100_000;
        let net = 1 + tag % 250;
        let p = VethPair {
            a: format!("cairn-a-{tag}"),
            b: format!("cairn-b-{tag}"),
            dev_a: format!("cva{tag}"),
            net,
        };
        let dev_b = format!("cvb{tag}");
        Self::ip(&["netns", "add", &p.a])?;
        Self::ip(&["netns", "add", &p.b])?;
        Self::ip(&[
            "link", "add", &p.dev_a, "netns", &p.a, "type", "veth", "peer", "name", &dev_b,
            "netns", &p.b,
        ])?;
        for (ns, dev, host) in [(&p.a, &p.dev_a, 1), (&p.b, &dev_b, 2)] {
            Self::ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("10.231.{net}.{host}/24"),
                "dev",
                dev,
            ])?;
            Self::ip(&["-n", ns, "link", "set", dev, "up"])?;
            Self::ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(p)
    }

    fn addr_a(&self) -> String {
        format!("10.231.{}.1", self.net)
    }

    /// `cmd` run inside namespace `ns`.
    fn exec(ns: &str, program: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).arg(program);
        c
    }

    fn link_a(&self, up: bool) {
        Self::ip(&[
            "-n",
            &self.a,
            "link",
            "set",
            &self.dev_a,
            if up { "up" } else { "down" },
        ])
        .unwrap();
    }
}

impl Drop for VethPair {
    fn drop(&mut self) {
        let _ = Self::ip(&["netns", "del", &self.a]);
        let _ = Self::ip(&["netns", "del", &self.b]);
    }
}

/// A mirror of a local mem device and a remote export, across a veth link: under a
/// verified random read/write load the link is cut for 4 s. Requests to the remote member
/// time out (2 s), the mirror marks it failed and runs on degraded, the client sees no
/// error and every read checks out; the link comes back and the remote server answers
/// again.
#[test]
fn a_mirror_across_a_veth_link_survives_the_link_going_down() {
    const TEST: &str = "a_mirror_across_a_veth_link_survives_the_link_going_down";
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip(TEST, "needs root (network namespaces)");
    }
    if tool("ip").is_none() {
        return skip(TEST, "no ip (Debian: iproute2)");
    }
    let pair = match VethPair::new() {
        Ok(p) => p,
        Err(e) => return skip(TEST, &format!("cannot make network namespaces: {e}")),
    };
    let cairn = std::path::PathBuf::from(env!("CARGO_BIN_EXE_cairn"));
    let dir = tmpdir();
    let server_log = dir.path().join("server.log");
    let listen = format!("tcp:{}:10809", pair.addr_a());
    let _srv = Running(
        VethPair::exec(&pair.a, &cairn)
            .args(["serve", "--device", "mem:64M", "--listen", &listen])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&server_log).unwrap())
            .spawn()
            .unwrap(),
    );
    let uri = format!("nbd://{}/", pair.addr_a());
    // `cairn check` of a stack file with the remote device connects to it.
    let probe_file = dir.path().join("probe.toml");
    std::fs::write(
        &probe_file,
        format!("[device.r]\ntype = \"nbd\"\nuri = \"{uri}\"\ntimeout = \"1s\"\n"),
    )
    .unwrap();
    // Wait until the server answers from the other namespace.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let probe = VethPair::exec(&pair.b, &cairn)
            .arg("check")
            .arg(&probe_file)
            .output()
            .unwrap();
        if probe.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the server never answered: {}",
            common::text(&probe.stderr)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let stack = dir.path().join("mirror.toml");
    std::fs::write(
        &stack,
        format!(
            "[device.local]\ntype = \"mem\"\nsize = \"64M\"\n\n\
             [device.remote]\ntype = \"nbd\"\nuri = \"{uri}\"\ntimeout = \"2s\"\n\n\
             [device.m]\ntype = \"mirror\"\nmembers = [\"local\", \"remote\"]\n"
        ),
    )
    .unwrap();
    let bench_log = dir.path().join("bench.log");
    let mut bench = Running(
        VethPair::exec(&pair.b, &cairn)
            .arg("bench")
            .arg(&stack)
            .args([
                "--rw",
                "randrw",
                "--iodepth",
                "16",
                "--runtime",
                "9s",
                "--time_based",
                "--verify",
                "crc32c",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&bench_log).unwrap())
            .spawn()
            .unwrap(),
    );
    std::thread::sleep(Duration::from_secs(2));
    pair.link_a(false);
    std::thread::sleep(Duration::from_secs(4));
    pair.link_a(true);
    let mut out = String::new();
    use std::io::Read;
    bench
        .0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let status = bench.0.wait().unwrap();
    let log = std::fs::read_to_string(&bench_log).unwrap();
    assert!(status.success(), "bench failed: {status}\n{out}\n{log}");
    assert!(
        log.contains("member 'remote' failed"),
        "the mirror never marked the remote member failed:\n{log}"
    );
    assert!(out.contains("blocks read back and checked"), "{out}");
    assert!(!out.contains("err="), "{out}");
    // The link is back: the server answers across it again.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let probe = VethPair::exec(&pair.b, &cairn)
            .arg("check")
            .arg(&probe_file)
            .output()
            .unwrap();
        if probe.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the server is unreachable after the link came back"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

// ---------------------------------------------------------------------------------------
// Extended headers in cairn serve.

/// Starts cairn serve with `args`, its log in `log`, and waits for `sock`.
fn serve_logged(args: &[&str], sock: &std::path::Path, log: &std::path::Path) -> Running {
    start_logging(
        Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("serve")
            .args(args)
            .arg("--listen")
            .arg(format!("unix:{}", sock.display())),
        sock,
        std::fs::File::create(log).unwrap().into(),
    )
}

/// qemu-io and qemu-img (10.0, which ask for extended headers) against cairn serve: each
/// connection is logged with extended headers; a write-zeroes of 6 GiB (which may punch
/// holes) goes as one request (the log's longest request), zeroes what it covers and
/// nothing else; data past 4 GiB
/// reads back; qemu-img map sees the allocation of an 8 GiB export.
#[test]
fn qemu_tools_use_extended_headers_with_cairn_serve() {
    let Some([qemu_io, qemu_img]) = common::tools(
        "qemu_tools_use_extended_headers_with_cairn_serve",
        ["qemu-io", "qemu-img"],
    ) else {
        return;
    };
    let dir = tmpdir();
    let sock = dir.path().join("nbd.sock");
    let log = dir.path().join("serve.log");
    let _srv = serve_logged(&["--device", "mem:8G"], &sock, &log);
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let out = Command::new(&qemu_io)
        .args(["-f", "raw"])
        .args([
            "-c",
            "write -P 0xab 0 1M",
            "-c",
            "write -P 0x11 3G 1M",
            "-c",
            "write -P 0xcd 7G 1M",
            "-c",
            "write -z -u -n 1G 6G",
            "-c",
            "read -P 0xab 0 1M",
            "-c",
            "read -P 0 3G 1M",
            "-c",
            "read -P 0xcd 7G 1M",
        ])
        .arg(&uri)
        .output()
        .unwrap();
    let text = common::text(&out.stdout) + &common::text(&out.stderr);
    assert!(out.status.success(), "qemu-io: {text}");
    assert!(!text.contains("failed"), "qemu-io: {text}");
    assert!(
        text.contains("wrote 6442450944/6442450944 bytes at offset 1073741824"),
        "{text}"
    );
    let map = Command::new(&qemu_img)
        .args(["map", "--output=json", "-f", "raw"])
        .arg(&uri)
        .output()
        .unwrap();
    assert!(
        map.status.success(),
        "qemu-img map: {}",
        common::text(&map.stderr)
    );
    let extents: serde_json::Value = serde_json::from_slice(&map.stdout).unwrap();
    let data: Vec<(u64, u64)> = extents
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["data"] == true)
        .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect();
    // What was written and not zeroed is data; what was never written is not (the mem
    // device may keep reporting a zeroed region as data, which is allowed).
    let covers = |at: u64| data.iter().any(|&(s, l)| s <= at && at < s + l);
    assert!(covers(0) && covers(7 << 30), "map: {data:?}");
    assert!(!covers(2 << 30) && !covers(5 << 30), "map: {data:?}");
    drop(_srv);
    let log = std::fs::read_to_string(&log).unwrap();
    let connected = log.matches("(extended headers)").count();
    assert!(
        connected >= 2,
        "qemu-io and qemu-img did not use extended headers:\n{log}"
    );
    assert!(
        log.contains("the longest 6442450944 bytes"),
        "the 6 GiB write-zeroes did not arrive as one request:\n{log}"
    );
}

/// A raw client with extended headers: a trim of 6 GiB in one request, then block status
/// over the whole 8 GiB export, answered with 64-bit extents (a hole longer than 4 GiB);
/// a request with a payload it should not have is refused and the connection goes on.
#[test]
fn extended_trim_and_block_status_over_4_gib() {
    use std::io::{Read, Write};
    let dir = tmpdir();
    let sock = dir.path().join("nbd.sock");
    let log = dir.path().join("serve.log");
    let _srv = serve_logged(&["--device", "mem:8G"], &sock, &log);
    let want = Want {
        extended: true,
        structured: true,
        allocation: true,
    };
    let (fd, n) = connect(&uri(&sock, ""), want, TIMEOUT).unwrap();
    assert!(n.extended && n.allocation_id.is_some(), "{n:?}");
    let mut s = std::os::unix::net::UnixStream::from(fd);
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    use cairn_nbd::proto::{self, cflags, chunk, cmd};
    let send = |s: &mut std::os::unix::net::UnixStream,
                flags: u16,
                command: u16,
                cookie: u64,
                offset: u64,
                len: u64,
                payload: &[u8]| {
        let mut b = Vec::new();
        proto::put_extended_request(&mut b, flags, command, cookie, offset, len);
        b.extend_from_slice(payload);
        s.write_all(&b).unwrap();
    };
    // One chunk: (flags, kind, cookie, offset echoed, payload).
    let recv = |s: &mut std::os::unix::net::UnixStream| {
        let mut h = [0u8; proto::EXTENDED_HEADER];
        s.read_exact(&mut h).unwrap();
        let proto::DecodedReply::Header(
            proto::ReplyHeader::Chunk {
                flags,
                kind,
                cookie,
                offset,
                len,
            },
            _,
        ) = proto::parse_reply(&h, true)
        else {
            panic!("not an extended chunk: {h:?}");
        };
        let mut p = vec![0u8; len as usize];
        s.read_exact(&mut p).unwrap();
        (flags, kind, cookie, offset, p)
    };
    let g = 1u64 << 30;
    // Data at 0 and at 7 GiB, then a trim of [1 GiB, 7 GiB).
    send(
        &mut s,
        cflags::PAYLOAD_LEN,
        cmd::WRITE,
        1,
        0,
        4096,
        &[0xab; 4096],
    );
    send(
        &mut s,
        cflags::PAYLOAD_LEN,
        cmd::WRITE,
        2,
        7 * g,
        4096,
        &[0xcd; 4096],
    );
    send(&mut s, 0, cmd::TRIM, 3, g, 6 * g, &[]);
    for _ in 0..3 {
        let (flags, kind, cookie, offset, p) = recv(&mut s);
        assert_eq!(
            (flags, kind),
            (chunk::FLAG_DONE, chunk::NONE),
            "cookie {cookie}"
        );
        assert!(p.is_empty());
        let want_offset = [0, 0, 7 * g, g][cookie as usize];
        assert_eq!(offset, want_offset, "the request's offset is echoed");
    }
    send(&mut s, 0, cmd::BLOCK_STATUS, 4, 0, 8 * g, &[]);
    let (flags, kind, cookie, _, p) = recv(&mut s);
    assert_eq!(
        (flags & chunk::FLAG_DONE, kind, cookie),
        (chunk::FLAG_DONE, chunk::BLOCK_STATUS_EXT, 4)
    );
    let count = u32::from_be_bytes(p[4..8].try_into().unwrap()) as usize;
    assert_eq!(p.len(), 8 + 16 * count);
    let extents: Vec<(u64, u64)> = p[8..]
        .chunks_exact(16)
        .map(|e| {
            (
                u64::from_be_bytes(e[0..8].try_into().unwrap()),
                u64::from_be_bytes(e[8..16].try_into().unwrap()),
            )
        })
        .collect();
    assert!(
        extents
            .iter()
            .any(|&(len, st)| len > 4 * g && st & u64::from(proto::state::HOLE) != 0),
        "no hole of over 4 GiB in one extent: {extents:?}"
    );
    assert_eq!(
        extents.iter().map(|e| e.0).sum::<u64>(),
        8 * g,
        "{extents:?}"
    );
    // A flush with a payload: skipped and refused, and the connection goes on.
    send(
        &mut s,
        cflags::PAYLOAD_LEN,
        cmd::FLUSH,
        5,
        0,
        16,
        &[0x21; 16],
    );
    let (_, kind, cookie, _, p) = recv(&mut s);
    assert_eq!((kind, cookie), (chunk::ERROR, 5));
    assert_eq!(
        u32::from_be_bytes(p[0..4].try_into().unwrap()),
        proto::errno::EINVAL
    );
    send(&mut s, 0, cmd::READ, 6, 7 * g, 4096, &[]);
    let (flags, kind, cookie, offset, p) = recv(&mut s);
    assert_eq!(
        (flags, kind, cookie, offset),
        (chunk::FLAG_DONE, chunk::OFFSET_DATA, 6, 7 * g)
    );
    assert_eq!(u64::from_be_bytes(p[0..8].try_into().unwrap()), 7 * g);
    assert!(p[8..].iter().all(|&b| b == 0xcd) && p.len() == 8 + 4096);
}

/// A mirror of a local file and a remote export (`readd`): the remote server is killed
/// while the mirror serves, writes go on to the local member and the remote one is failed
/// after its timeout; when the server is back, the mirror re-adds it by itself and copies
/// only the 4 regions written while it was away. Then the remote member alone reads back
/// every write, and the two members' data areas are byte-identical.
#[test]
fn a_remote_mirror_member_that_comes_back_is_re_added_by_the_bitmap() {
    use cairn_config::StackFile;
    const PAGES: u64 = 64;
    const STRIDE: u64 = 128 << 10;
    let dir = tmpdir();
    let (a, r) = (dir.path().join("a.img"), dir.path().join("r.img"));
    let sock = dir.path().join("r.sock");
    let remote = dir.path().join("remote.toml");
    std::fs::write(
        &remote,
        format!(
            "[device.r]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n[export.r]\ndevice = \"r\"\n",
            r.display()
        ),
    )
    .unwrap();
    let serve = || {
        start(
            Command::new(env!("CARGO_BIN_EXE_cairn"))
                .arg("serve")
                .arg(&remote)
                .arg("--listen")
                .arg(format!("unix:{}", sock.display())),
            &sock,
        )
    };
    let srv = serve();
    let stack = StackFile::parse(&format!(
        "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
         [device.remote]\ntype = \"nbd\"\nuri = \"nbd+unix:///r?socket={}\"\ntimeout = \"1s\"\n\
         [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"remote\"]\nmetadata = \"1\"\n\
         bitmap = \"64K\"\nbitmap_delay = \"100ms\"\nreadd = \"200ms\"\n",
        a.display(),
        sock.display()
    ))
    .unwrap();
    let m = stack.open("m").unwrap();
    let array = m.capability::<dyn Array>().expect("an array");
    let status = || array.status().unwrap_or_default();
    let wait = |what: &str, done: &dyn Fn(&str) -> bool| {
        let t = Instant::now();
        while !done(&status()) {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "never {what}:\n{}",
                status()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let page = |p: u64, v: u8| vec![v ^ (p as u8); 4096];
    let q = BlockingQueue::open(&m, Switches::default()).unwrap();
    let write = |pages: &[u64], v: u8| {
        for &p in pages {
            q.write(p * STRIDE, &page(p, v), IoFlags::NONE).unwrap();
        }
        q.flush().unwrap();
    };
    let changed = [3u64, 20, 21, 40];
    let read_all = |what: &str| {
        let mut buf = vec![0u8; 4096];
        for p in 0..PAGES {
            q.read(p * STRIDE, &mut buf).unwrap();
            let v = if changed.contains(&p) { 2 } else { 1 };
            assert!(buf == page(p, v), "{what}: page {p} is not version {v}");
        }
    };
    let all: Vec<u64> = (0..PAGES).collect();
    write(&all, 1);
    wait("clean bits", &|s| s.contains("bitmap: 0 of"));
    drop(srv);
    // The remote member times out and fails; the client's writes succeed on the other.
    write(&changed, 2);
    wait("the remote member failed", &|s| s.contains("[U_]"));
    let _srv = serve();
    wait("re-added and rebuilt", &|s| s.contains("[UU]"));
    let moved = 4 * (64u64 << 10);
    assert!(
        status().contains(&format!("read {moved} bytes, wrote {moved} bytes")),
        "{}",
        status()
    );
    read_all("both members");
    let out = m
        .capability::<dyn ArrayAdmin>()
        .expect("an array the admin changes")
        .act(&ArrayAction::Fail { member: "a".into() })
        .unwrap();
    assert!(out.contains("failed"), "{out}");
    read_all("the remote member alone");
    // A member the admin failed is not taken back by itself (several tries' worth).
    std::thread::sleep(Duration::from_secs(1));
    assert!(status().contains("[_U]"), "{}", status());
    drop(q);
    drop(m);
    let (da, dr) = (std::fs::read(&a).unwrap(), std::fs::read(&r).unwrap());
    let data = (1 << 20)..(17 << 20);
    assert!(da[data.clone()] == dr[data], "the members differ");
}

/// A mirror served by `cairn serve` (its reactors running all along) of a local file and
/// a remote export that loses writes it acknowledged but had not flushed when its server
/// dies: a write-back `cache` over a file, served by a second `cairn serve` that is
/// killed. Its connections are idle when it dies, so the mirror learns of it only when
/// it next sends something. Two outages, each after writes that no flush covered:
///
/// 1. The remote server is killed and started again at once (no request of the mirror
///    fails on the way). Writes it lost must not be taken for durable (the bitmap
///    thread's flush goes through a new connection to the new server): their bits stay
///    set until the member has failed, been re-added and had them copied again. (If the
///    mirror happened to flush them before the kill, nothing is lost and nothing fails.)
/// 2. The remote server stays down until the member has failed (a write that needs the
///    member's superblock waits for the timeout), then comes back: the member is re-added,
///    and the mirror's first flush after that must not fail it again (the connection it
///    goes to died with writes unflushed, which the re-add has copied since).
///
/// An outage costs at most one re-add (the second exactly one), and the member stays in
/// use after it (a client flush then goes through). Every write reads back through the
/// mirror, through the remote member alone, and the members' data areas are
/// byte-identical.
#[test]
fn a_remote_member_that_lost_writes_is_resynced_for_them_and_re_added_once() {
    const PAGE: u64 = 4096;
    const REGION: u64 = 64 << 10;
    const SPAN: u64 = 2 << 20;
    let dir = tmpdir();
    let d = dir.path();
    let (a, r) = (d.join("a.img"), d.join("r.img"));
    let (rsock, msock, admin_sock, log) = (
        d.join("r.sock"),
        d.join("m.sock"),
        d.join("admin.sock"),
        d.join("m.log"),
    );
    // Dirty cache pages are written back only by a flush (or at 1 h).
    let remote = d.join("remote.toml");
    std::fs::write(
        &remote,
        format!(
            "[writeback]\nexpire = \"1h\"\ninterval = \"1h\"\n\
             [device.f]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
             [device.r]\ntype = \"cache\"\nbase = \"f\"\nmemory = \"4M\"\n\
             [export.r]\ndevice = \"r\"\n",
            r.display()
        ),
    )
    .unwrap();
    let serve_remote = || {
        // A killed server leaves its socket behind: wait for the new one.
        let _ = std::fs::remove_file(&rsock);
        start(
            Command::new(env!("CARGO_BIN_EXE_cairn"))
                .arg("serve")
                .arg(&remote)
                .arg("--listen")
                .arg(format!("unix:{}", rsock.display())),
            &rsock,
        )
    };
    let mirror = d.join("mirror.toml");
    std::fs::write(
        &mirror,
        format!(
            "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
             [device.remote]\ntype = \"nbd\"\nuri = \"nbd+unix:///r?socket={}\"\ntimeout = \"1s\"\n\
             [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"remote\"]\nmetadata = \"1\"\n\
             bitmap = \"64K\"\nbitmap_delay = \"100ms\"\nreadd = \"200ms\"\n\
             [export.m]\ndevice = \"m\"\n",
            a.display(),
            rsock.display()
        ),
    )
    .unwrap();
    let mut srv = Some(serve_remote());
    let mut m = start_logging(
        Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("serve")
            .arg(&mirror)
            .arg("--listen")
            .arg(format!("unix:{}", msock.display()))
            .arg("--admin")
            .arg(&admin_sock),
        &msock,
        std::fs::File::create(&log).unwrap().into(),
    );
    let admin = |words: &[&str]| -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("admin")
            .arg(&admin_sock)
            .args(words)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "admin {words:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    let wait = |what: &str, done: &dyn Fn(&str) -> bool| {
        let t = Instant::now();
        loop {
            let s = admin(&["status"]);
            if done(&s) {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "never {what}:\n{s}\nlog:\n{}",
                log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let settled = |s: &str| s.contains("[UU]") && s.contains("bitmap: 0 of");
    let client = open_nbd(&format!("nbd:nbd+unix:///m?socket={}", msock.display()));
    let q = BlockingQueue::open(&client, Switches::default()).unwrap();
    let mut model = vec![0u8; SPAN as usize];
    // Writes pages `pages` of region `region` with version `v`, all in flight together,
    // and no flush.
    let mut write = |region: u64, pages: std::ops::Range<u64>, v: u8| {
        let mut bufs: Vec<Vec<u8>> = pages
            .clone()
            .map(|p| vec![v ^ (region as u8) ^ (p as u8); PAGE as usize])
            .collect();
        let mut reqs: Vec<Request> = bufs
            .iter_mut()
            .zip(pages)
            .map(|(b, p)| {
                let at = region * REGION + p * PAGE;
                model[at as usize..(at + PAGE) as usize].copy_from_slice(b);
                Request {
                    op: Op::Write,
                    flags: IoFlags::NONE,
                    offset: at,
                    len: 0,
                    buf: Some(b.as_mut_slice()),
                }
            })
            .collect();
        for (i, r) in q.run(&mut reqs).into_iter().enumerate() {
            r.unwrap_or_else(|e| panic!("write {i} to region {region}: {e}"));
        }
    };
    // Everything written once and flushed; every bit clean.
    for region in 0..SPAN / REGION {
        write(region, 0..REGION / PAGE, 1);
    }
    q.flush().unwrap();
    wait("clean bits", &|s| settled(s));

    let readds = |l: &str| l.matches("member remote answers again: re-added").count();
    let failures = |l: &str| {
        l.matches("member remote failed").count() + l.matches("member 'remote' failed").count()
    };
    // Re-adds so far, once the log has the line of each failure's re-add (it comes right
    // after the re-add, before the bits can be clean again).
    let readded = || {
        let t = Instant::now();
        loop {
            let l = log_text();
            if readds(&l) >= failures(&l).min(1) {
                return readds(&l);
            }
            assert!(t.elapsed() < Duration::from_secs(60), "{l}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };

    // 1. Writes the remote acknowledges into its cache; its server dies and is back at once.
    write(5, 0..8, 2);
    drop(srv.take());
    srv = Some(serve_remote());
    wait("settled after the quick restart", &|s| settled(s));
    q.flush().unwrap();
    wait("settled after a flush", &|s| settled(s));
    let first = readded();
    assert!(first <= 1, "one outage, {first} re-adds:\n{}", log_text());

    // 2. Again, and the server stays down until the member has failed.
    write(9, 0..8, 3);
    drop(srv.take());
    // Its bit must be set on the members: the remote's superblock waits for the timeout.
    write(12, 0..4, 4);
    wait("the remote member failed", &|s| s.contains("[U_]"));
    srv = Some(serve_remote());
    wait("re-added and settled", &|s| settled(s));
    q.flush().unwrap();
    wait("settled after a flush", &|s| settled(s));
    let t = Instant::now();
    while readds(&log_text()) < first + 1 {
        assert!(t.elapsed() < Duration::from_secs(60), "{}", log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    let l = log_text();
    assert_eq!(
        readds(&l),
        first + 1,
        "the second outage re-added the member more than once:\n{l}"
    );

    let read_all = |what: &str| {
        let mut buf = vec![0u8; SPAN as usize];
        q.read(0, &mut buf).unwrap();
        for (i, (got, want)) in buf
            .chunks(PAGE as usize)
            .zip(model.chunks(PAGE as usize))
            .enumerate()
        {
            assert!(
                got == want,
                "{what}: page {i} (region {}) differs",
                i as u64 * PAGE / REGION
            );
        }
    };
    read_all("the mirror");
    let out = admin(&["fail", "m", "a"]);
    assert!(out.contains("failed"), "{out}");
    read_all("the remote member alone");
    drop(q);
    drop(client);
    // A clean stop flushes the remote (its cache writes everything back) before it dies.
    // SAFETY: signals our own child, which has not been waited for.
    unsafe { libc::kill(m.0.id() as i32, libc::SIGTERM) };
    let _ = m.0.wait();
    drop(srv);
    let (da, dr) = (std::fs::read(&a).unwrap(), std::fs::read(&r).unwrap());
    let data = (1usize << 20)..(17 << 20);
    assert!(da[data.clone()] == dr[data], "the members differ");
}

/// `cairn serve` of a write-back cache over a file, whose server is killed (losing the
/// writes it acknowledged into its cache and had not flushed) and started again, for
/// the `nbd` device's account of such writes, with two queues `a` and `b` (each with its
/// own connection):
///
/// - after a write on `a` and the restart, a flush on `b` (sent again over a new
///   connection to the new server) succeeds, but vouches for nothing of `a`'s write: the
///   device says it is unverified until `a` has looked at its connection;
/// - `a` finds it dead at its next request: the loss is counted, and the next flush on
///   each queue fails, once (a queue opened later too), until the loss is made up for;
/// - a loss found after a make-up, of writes acknowledged before it, is not reported; one
///   of writes acknowledged after it is.
#[test]
fn writes_a_restarted_server_lost_fail_each_queues_next_flush_until_made_up() {
    use cairn_core::LostWrites;
    let dir = tmpdir();
    let d = dir.path();
    let (r, rsock, remote) = (d.join("r.img"), d.join("r.sock"), d.join("remote.toml"));
    std::fs::write(
        &remote,
        format!(
            "[writeback]\nexpire = \"1h\"\ninterval = \"1h\"\n\
             [device.f]\ntype = \"file\"\npath = \"{}\"\nsize = \"4M\"\n\
             [device.r]\ntype = \"cache\"\nbase = \"f\"\nmemory = \"1M\"\n\
             [export.r]\ndevice = \"r\"\n",
            r.display()
        ),
    )
    .unwrap();
    let serve = || {
        let _ = std::fs::remove_file(&rsock);
        start(
            Command::new(env!("CARGO_BIN_EXE_cairn"))
                .arg("serve")
                .arg(&remote)
                .arg("--listen")
                .arg(format!("unix:{}", rsock.display())),
            &rsock,
        )
    };
    let mut srv = serve();
    let dev = open_nbd(&format!(
        "nbd:nbd+unix:///r?socket={},timeout=5s",
        rsock.display()
    ));
    let a = BlockingQueue::open(&dev, Switches::default()).unwrap();
    let b = BlockingQueue::open(&dev, Switches::default()).unwrap();
    let page = |v: u8| vec![v; 4096];
    let mut buf = vec![0u8; 4096];
    b.write(0, &page(9), IoFlags::NONE).unwrap();
    b.flush().unwrap();
    assert_eq!(dev.lost_writes(), LostWrites::None);

    a.write(4096, &page(1), IoFlags::NONE).unwrap();
    drop(srv);
    srv = serve();
    b.flush().expect("b's flush: nothing of b's was lost");
    assert_eq!(dev.lost_writes(), LostWrites::Unverified);
    a.read(0, &mut buf).expect("a read is sent again");
    assert_eq!(buf, page(9), "flushed, so kept");
    assert_eq!(dev.lost_writes(), LostWrites::Lost);
    a.read(4096, &mut buf).unwrap();
    assert_eq!(
        buf,
        page(0),
        "the server lost the write that was not flushed"
    );
    for (q, name) in [(&b, "b"), (&a, "a")] {
        assert!(q.flush().is_err(), "{name}'s first flush reports the loss");
        q.flush()
            .unwrap_or_else(|e| panic!("{name}'s second flush: {e}"));
    }
    let c = BlockingQueue::open(&dev, Switches::default()).unwrap();
    assert!(c.flush().is_err(), "a queue opened later reports it too");
    drop(c);
    assert_eq!(dev.lost_writes(), LostWrites::Lost);
    dev.lost_writes_made_up();
    assert_eq!(dev.lost_writes(), LostWrites::None);
    let c = BlockingQueue::open(&dev, Switches::default()).unwrap();
    c.flush().expect("made up for: nothing to report");
    drop(c);

    // Acknowledged before a make-up, found lost after it: not reported.
    a.write(8192, &page(2), IoFlags::NONE).unwrap();
    drop(srv);
    srv = serve();
    dev.lost_writes_made_up();
    a.read(0, &mut buf).unwrap();
    assert_eq!(dev.lost_writes(), LostWrites::None);
    a.flush().expect("a loss made up for before it was found");
    b.flush().expect("a loss made up for before it was found");

    // Acknowledged after the make-up: reported.
    a.write(8192, &page(3), IoFlags::NONE).unwrap();
    drop(srv);
    let _srv = serve();
    a.read(0, &mut buf).unwrap();
    assert_eq!(dev.lost_writes(), LostWrites::Lost);
    assert!(a.flush().is_err());
    a.flush().unwrap();
}
