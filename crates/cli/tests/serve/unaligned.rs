use super::*;

/// A byte-granular model test: random reads, writes, write-zeroes, trims and flushes
/// at any offset and length, from a libnbd client that did not ask for block sizes
/// (and with its own checks off), each checked against an in-memory copy. At the end
/// a second client that did ask (and was told a minimum of 1) reads the whole device
/// back, and reads and writes at odd bytes with libnbd's own checks on.
const MODEL: &str = r#"
import os, random
import nbd

sock, name = os.environ["CAIRN_SOCK"], os.environ.get("CAIRN_EXPORT", "")
block = int(os.environ["CAIRN_BLOCK"])
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
    if h.get_block_size(nbd.SIZE_MINIMUM) != 1:
        failures.append(f"minimum block size {h.get_block_size(nbd.SIZE_MINIMUM)}, want 1")
    if h.get_block_size(nbd.SIZE_PREFERRED) != max(block, 4096):
        failures.append(f"preferred block size {h.get_block_size(nbd.SIZE_PREFERRED)}")
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
    g = nbd.NBD()
    g.set_request_block_size(True)
    g.set_export_name(name)
    g.connect_unix(sock)
    if g.get_block_size(nbd.SIZE_MINIMUM) != 1:
        failures.append("the second client sees another minimum block size")
    if read_all(g, size) != model:
        failures.append(f"{'structured' if structured else 'simple'}: the device differs from the model at the end")
    # It was told any byte is served: libnbd's own checks let these through.
    try:
        if g.pread(100, 1) != model[1:101]:
            failures.append("an unaligned read from a client that asked for block sizes differs")
        data = rng.randbytes(3 * block + 7)
        g.pwrite(data, block - 3)
        model[block - 3:block - 3 + len(data)] = data
        if g.pread(len(data) + 10, block - 8) != model[block - 8:block + len(data) + 2]:
            failures.append("an unaligned write from a client that asked for block sizes did not stick")
    except nbd.Error as e:
        failures.append(f"unaligned I/O from a client that asked for block sizes: {e.string}")
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
block = int(os.environ["CAIRN_BLOCK"])
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
    const NAME: &str = "unaligned::concurrent_unaligned_writes_to_the_same_blocks_lose_no_bytes";
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
    for (args, block) in [
        (&["--device", "mem:16M"][..], "512"),
        (&["--device", "mem:64M,block=4096"], "4096"),
        (&[stack.as_str()], "512"),
    ] {
        let srv = Server::start(&[args, &["--threads", "2"]].concat());
        let env = [("CAIRN_BLOCK", block.to_string())];
        libnbd_script(&python, RACE, &srv.sock, &env, "rounds done");
    }
    drop(dir);
}

/// What is refused: unaligned requests on an export with strict_alignment, from any
/// client; what is not: the same requests on other exports, from clients that asked for
/// block sizes (told a minimum of 1) or not, including past-the-end checks at byte
/// precision.
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

for name, asks, ok in (("relaxed", False, True), ("relaxed", True, True),
                       ("strict", False, False), ("strict", True, False)):
    h = connect(name, asks)
    size = h.get_size()
    minimum = h.get_block_size(nbd.SIZE_MINIMUM)
    if minimum != (512 if name == "strict" else 1):
        failures.append(f"{name}: advertised minimum block size {minimum}")
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
fn strict_alignment_keeps_einval_and_other_exports_serve_any_byte() {
    const NAME: &str = "unaligned::strict_alignment_keeps_einval_and_other_exports_serve_any_byte";
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
