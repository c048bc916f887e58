//! Crypt devices served: LUKS volumes cairn makes open in qemu and cryptsetup,
//! and theirs open in cairn, both ways with data compared byte for byte; key slots added
//! and removed online (key rotation), seen by cryptsetup; bad passphrases refused.

use super::*;

/// Writes and write-zeroes of random sizes (512-byte units) and trims of whole 4 KiB
/// blocks through the export, checked by reading back, over a device zeroed first; the plaintext the device must hold goes to
/// CAIRN_WANT.
const MODEL: &str = r#"
import os
import random
import nbd
h = nbd.NBD()
h.connect_unix(os.environ["CAIRN_SOCK"])
size = h.get_size()
rng = random.Random(39)
model = bytearray(size)
h.zero(size, 0)
for i in range(200):
    kind = rng.randrange(10)
    off = rng.randrange(size // 512) * 512
    n = min(rng.randrange(1, 64) * 512, size - off)
    if kind < 7:
        data = rng.randbytes(n)
        h.pwrite(data, off)
        model[off:off + n] = data
    elif kind < 9:
        h.zero(n, off)
        model[off:off + n] = bytes(n)
    else:
        # Whole 4 KiB blocks: a server may ignore the parts of a trim in partial blocks.
        off, n = off // 4096 * 4096, max(n // 4096, 1) * 4096
        n = min(n, size - off)
        h.trim(n, off)
        model[off:off + n] = bytes(n)
    if i % 20 == 0:
        assert h.pread(size, 0) == model, i
h.flush()
assert h.pread(size, 0) == model
with open(os.environ["CAIRN_WANT"], "wb") as f:
    f.write(model)
print("written")
"#;

/// A crypt device over file `base`, the passphrase from file `pass`.
fn crypt_stack(dir: &Path, base: &Path, pass: &Path, extra: &str) -> PathBuf {
    let path = dir.join("stack.toml");
    std::fs::write(
        &path,
        format!(
            "[device.d]\ntype = \"file\"\npath = \"{}\"\n\
             [device.c]\ntype = \"crypt\"\nbase = \"d\"\npassphrase_file = \"{}\"\n{extra}\n\
             [export.c]\ndevice = \"c\"\n",
            base.display(),
            pass.display()
        ),
    )
    .unwrap();
    path
}

/// `qemu-img convert` of LUKS1 image `img` opened with passphrase file `pass` to raw.
fn qemu_plaintext(qemu_img: &Path, img: &Path, pass: &Path, out: &Path) {
    success(
        "qemu-img convert",
        &run(Command::new(qemu_img).args([
            "convert",
            "--object",
            &format!("secret,id=sec0,file={}", pass.display()),
            "--image-opts",
            &format!(
                "driver=luks,key-secret=sec0,file.filename={}",
                img.display()
            ),
            "-O",
            "raw",
            path_str(out),
        ])),
    );
}

/// `cryptsetup luksDump IMG`.
fn luks_dump(cryptsetup: &Path, img: &Path) -> String {
    success(
        "luksDump",
        &run(Command::new(cryptsetup).arg("luksDump").arg(img)),
    )
}

/// Whether cryptsetup opens `img` with the passphrase in file `pass`.
fn cryptsetup_takes(cryptsetup: &Path, img: &Path, pass: &Path) -> bool {
    run(Command::new(cryptsetup)
        .args(["open", "--test-passphrase", "--key-file"])
        .arg(pass)
        .arg(img))
    .status
    .success()
}

/// A new file of `bytes` zeros (sparse).
fn blank_file(path: &Path, bytes: u64) {
    std::fs::File::create(path).unwrap().set_len(bytes).unwrap();
}

fn same_file(a: &Path, b: &Path) -> bool {
    std::fs::read(a).unwrap() == std::fs::read(b).unwrap()
}

/// cairn formats a LUKS1 volume (`create`), a client writes it; key slot 1 is added and
/// slot 0 removed online; cryptsetup sees exactly that and takes only the new
/// passphrase; qemu-img's luks driver decrypts the same plaintext; cairn reopens it with
/// the new passphrase and refuses the old one.
#[test]
fn a_cairn_made_luks1_volume_opens_in_qemu_and_cryptsetup_after_key_rotation() {
    const NAME: &str =
        "crypt::a_cairn_made_luks1_volume_opens_in_qemu_and_cryptsetup_after_key_rotation";
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    let Some([qemu_img, cryptsetup, nbdcopy]) = tools(NAME, ["qemu-img", "cryptsetup", "nbdcopy"])
    else {
        return;
    };
    let dir = tmpdir();
    let d = dir.path();
    let (img, pass1, pass2) = (d.join("c.img"), d.join("pass1"), d.join("pass2"));
    std::fs::write(&pass1, b"first passphrase").unwrap();
    std::fs::write(&pass2, b"second passphrase").unwrap();
    blank_file(&img, (2 << 20) + (4 << 20));
    let stack = crypt_stack(
        d,
        &img,
        &pass1,
        "create = true\nformat = \"luks1\"\nkdf_iterations = 1000\n",
    );
    let ctl = d.join("admin.sock");
    let want = d.join("want.raw");
    let mut srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    libnbd_script(
        &python,
        MODEL,
        &srv.sock,
        &[("CAIRN_WANT", path_str(&want).to_string())],
        "written",
    );
    // The base holds no 512-byte sector of the plaintext.
    let plain = std::fs::read(&want).unwrap();
    let base = std::fs::read(&img).unwrap();
    for (i, p) in plain.chunks(512).enumerate() {
        let c = &base[(2 << 20) + i * 512..][..512];
        assert_ne!(c, p, "sector {i} is in the clear");
    }
    // Key rotation, online.
    let add = super::admin::admin(
        &ctl,
        &["crypt", "add", "c", path_str(&pass2), "kdf_iterations=1000"],
    );
    assert!(
        success("crypt add", &add).contains("key slot 1 added"),
        "{add:?}"
    );
    success(
        "crypt remove",
        &super::admin::admin(&ctl, &["crypt", "remove", "c", "0"]),
    );
    for (words, why) in [
        (vec!["crypt", "remove", "c", "1"], "only key slot"),
        (vec!["crypt", "remove", "c", "5"], "not in use"),
        (vec!["crypt", "remove", "c", "x"], "not a key slot"),
        (vec!["crypt", "remove", "d", "1"], "no crypt device 'd'"),
        (vec!["crypt", "add", "c", "/nonexistent"], "/nonexistent"),
        (
            vec!["crypt", "add", "c", path_str(&pass2), "speed=3"],
            "unknown key",
        ),
        (
            vec!["crypt", "add", "c", path_str(&pass2), "kdf=argon2id"],
            "luks2",
        ),
        (vec!["crypt", "list", "extra"], "usage"),
    ] {
        super::admin::refused(&ctl, &words, why);
    }
    let list = super::observe::json(
        "crypt list --json",
        &super::admin::admin(&ctl, &["crypt", "list", "--json"]),
    );
    assert_eq!(list[0]["format"], "luks1", "{list:#}");
    assert_eq!(list[0]["opened_by_slot"], 0, "{list:#}");
    let slots: Vec<u64> = list[0]["slots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["slot"].as_u64().unwrap())
        .collect();
    assert_eq!(slots, [1], "{list:#}");
    let listed = success("crypt list", &super::admin::admin(&ctl, &["crypt", "list"]));
    assert!(
        listed.contains("c: crypt over d: luks1") && listed.contains("opened by key slot 0"),
        "{listed}"
    );
    let (status, log) = srv.stop();
    assert!(status.success(), "{log}");
    assert!(!log.contains("second passphrase") && !log.contains("first passphrase"));
    // cryptsetup: slot 0 gone, slot 1 there, only the new passphrase opens it.
    let dump = luks_dump(&cryptsetup, &img);
    assert!(
        dump.contains("Key Slot 0: DISABLED") && dump.contains("Key Slot 1: ENABLED"),
        "{dump}"
    );
    let test = |pass: &Path| cryptsetup_takes(&cryptsetup, &img, pass);
    assert!(test(&pass2), "cryptsetup refuses the new passphrase");
    assert!(!test(&pass1), "cryptsetup takes the removed passphrase");
    // qemu decrypts the same plaintext.
    let got = d.join("qemu.raw");
    qemu_plaintext(&qemu_img, &img, &pass2, &got);
    assert!(same_file(&got, &want), "qemu-img reads other data");
    // cairn reopens it with the new passphrase, and not the old.
    let stack = crypt_stack(d, &img, &pass2, "");
    let srv = Server::start_in(tmpdir(), &[path_str(&stack)]);
    let again = d.join("again.raw");
    success(
        "nbdcopy",
        &run(Command::new(&nbdcopy).args([&srv.uri(), path_str(&again)])),
    );
    assert!(same_file(&again, &want), "cairn reads other data reopened");
    drop(srv);
    let stack = crypt_stack(d, &img, &pass1, "");
    let out = run(Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(["serve", "--listen"])
        .arg(format!("unix:{}", d.join("x.sock").display()))
        .arg(&stack));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("no key slot opens with this passphrase"),
        "{err}"
    );
}

/// A LUKS1 image qemu-img made and qemu-io wrote serves through cairn: what qemu wrote
/// reads back; what cairn writes, qemu reads.
#[test]
fn a_qemu_made_luks1_image_reads_and_writes_through_cairn() {
    const NAME: &str = "crypt::a_qemu_made_luks1_image_reads_and_writes_through_cairn";
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    let Some([qemu_img, qemu_io]) = tools(NAME, ["qemu-img", "qemu-io"]) else {
        return;
    };
    let dir = tmpdir();
    let d = dir.path();
    let (img, pass) = (d.join("q.img"), d.join("pass"));
    std::fs::write(&pass, b"qemu's passphrase").unwrap();
    let secret = format!("secret,id=sec0,file={}", pass.display());
    success(
        "qemu-img create",
        &run(Command::new(&qemu_img).args([
            "create",
            "-f",
            "luks",
            "--object",
            &secret,
            "-o",
            "key-secret=sec0,iter-time=10",
            path_str(&img),
            "8M",
        ])),
    );
    let opts = format!(
        "driver=luks,key-secret=sec0,file.filename={}",
        img.display()
    );
    let qemu_io_cmd = |cmd: &str| {
        success(
            cmd,
            &run(Command::new(&qemu_io).args([
                "--object",
                &secret,
                "--image-opts",
                &opts,
                "-c",
                cmd,
            ])),
        )
    };
    qemu_io_cmd("write -P 0xab 0 64k");
    qemu_io_cmd("write -P 0x5c 1M 4k");
    qemu_io_cmd("write -P 0x11 8388096 512");
    let stack = crypt_stack(d, &img, &pass, "");
    let srv = Server::start_in(tmpdir(), &[path_str(&stack)]);
    libnbd_script(
        &python,
        r#"
import os
import nbd
h = nbd.NBD()
h.connect_unix(os.environ["CAIRN_SOCK"])
assert h.get_size() == 8 << 20, h.get_size()
assert h.pread(65536, 0) == b"\xab" * 65536
assert h.pread(4096, 1 << 20) == b"\x5c" * 4096
assert h.pread(512, (8 << 20) - 512) == b"\x11" * 512
h.pwrite(b"cairn wrote this" * 256, 2 << 20)
h.flush()
print("checked")
"#,
        &srv.sock,
        &[],
        "checked",
    );
    drop(srv);
    let out = qemu_io_cmd("read -P 0xab 0 64k");
    assert!(!out.contains("Pattern verification failed"), "{out}");
    let raw = d.join("q.raw");
    qemu_plaintext(&qemu_img, &img, &pass, &raw);
    let plain = std::fs::read(&raw).unwrap();
    assert_eq!(
        &plain[2 << 20..(2 << 20) + 4096],
        b"cairn wrote this".repeat(256)
    );
    assert!(plain[1 << 20..(1 << 20) + 4096].iter().all(|&b| b == 0x5c));
}

/// A file cryptsetup encrypted in place (LUKS2, 4096-byte sectors, argon2id) serves
/// through cairn with the plaintext it held; a client's writes read back; key slots
/// added (argon2id and pbkdf2) and removed online are what `cryptsetup luksDump` lists
/// and what `--test-passphrase` takes; a restart opens it with the new passphrase.
#[test]
fn a_cryptsetup_made_luks2_volume_serves_its_data_and_rotates_keys_online() {
    const NAME: &str =
        "crypt::a_cryptsetup_made_luks2_volume_serves_its_data_and_rotates_keys_online";
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    let Some([cryptsetup, nbdcopy]) = tools(NAME, ["cryptsetup", "nbdcopy"]) else {
        return;
    };
    let dir = tmpdir();
    let d = dir.path();
    let (img, pass1, pass2, pass3) = (
        d.join("c.img"),
        d.join("pass1"),
        d.join("pass2"),
        d.join("pass3"),
    );
    std::fs::write(&pass1, b"one").unwrap();
    std::fs::write(&pass2, b"two").unwrap();
    std::fs::write(&pass3, b"three").unwrap();
    // 48 MiB of a pattern, encrypted in place behind a 16 MiB header: the first 16 MiB
    // of it (the device is reduced by 32 MiB) are the start of the volume.
    let pattern: Vec<u8> = (0..48u32 << 20).map(|i| (i / 4093 + i) as u8).collect();
    std::fs::write(&img, &pattern).unwrap();
    success(
        "cryptsetup reencrypt --encrypt",
        &run(Command::new(&cryptsetup)
            .args(["reencrypt", "--encrypt", "--type", "luks2", "--batch-mode"])
            .args(["--reduce-device-size", "32M", "--force-offline-reencrypt"])
            .args(["--pbkdf", "argon2id", "--pbkdf-force-iterations", "4"])
            .args(["--pbkdf-memory", "32", "--pbkdf-parallel", "1"])
            .args(["--sector-size", "4096", "--key-file"])
            .arg(&pass1)
            .arg(&img)),
    );
    let stack = crypt_stack(d, &img, &pass1, "");
    let ctl = d.join("admin.sock");
    let mut srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    let got = d.join("got.raw");
    success(
        "nbdcopy",
        &run(Command::new(&nbdcopy).args([&srv.uri(), path_str(&got)])),
    );
    let got = std::fs::read(&got).unwrap();
    // The segment runs to the end of the file, as `cryptsetup open` would map it: 32 MiB,
    // the first 16 of them what was encrypted.
    assert_eq!(got.len(), 32 << 20);
    assert!(
        got[..16 << 20] == pattern[..16 << 20],
        "cairn reads other data than cryptsetup encrypted"
    );
    let want = d.join("want.raw");
    libnbd_script(
        &python,
        MODEL,
        &srv.sock,
        &[("CAIRN_WANT", path_str(&want).to_string())],
        "written",
    );
    for (pass, words) in [
        (
            &pass2,
            vec!["kdf_iterations=4", "kdf_memory=32M", "kdf_parallel=1"],
        ),
        (&pass3, vec!["kdf=pbkdf2", "kdf_iterations=1000"]),
    ] {
        let mut args = vec!["crypt", "add", "c", path_str(pass)];
        args.extend(words);
        success("crypt add", &super::admin::admin(&ctl, &args));
    }
    success(
        "crypt remove",
        &super::admin::admin(&ctl, &["crypt", "remove", "c", "0"]),
    );
    super::admin::refused(
        &ctl,
        &["crypt", "add", "c", path_str(&pass2), "kdf_memory=1K"],
        "kdf_memory",
    );
    let list = super::observe::json(
        "crypt list --json",
        &super::admin::admin(&ctl, &["crypt", "list", "--json"]),
    );
    assert_eq!(list[0]["format"], "luks2", "{list:#}");
    assert_eq!(list[0]["sector_size"], 4096, "{list:#}");
    let slots: Vec<(u64, String)> = list[0]["slots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["slot"].as_u64().unwrap(),
                s["kdf"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(slots.len(), 2, "{list:#}");
    assert!(
        slots[0].0 == 1 && slots[0].1.starts_with("argon2id"),
        "{list:#}"
    );
    assert!(
        slots[1].0 == 2 && slots[1].1.starts_with("pbkdf2"),
        "{list:#}"
    );
    let (status, log) = srv.stop();
    assert!(status.success(), "{log}");
    let dump = luks_dump(&cryptsetup, &img);
    assert!(
        !dump.contains("\n  0: luks2")
            && dump.contains("\n  1: luks2")
            && dump.contains("\n  2: luks2"),
        "{dump}"
    );
    let test = |pass: &Path| cryptsetup_takes(&cryptsetup, &img, pass);
    assert!(
        test(&pass2) && test(&pass3),
        "cryptsetup refuses a new passphrase"
    );
    assert!(!test(&pass1), "cryptsetup takes the removed passphrase");
    // Reopened with a new passphrase: what the client wrote.
    let stack = crypt_stack(d, &img, &pass3, "");
    let srv = Server::start_in(tmpdir(), &[path_str(&stack)]);
    let again = d.join("again.raw");
    success(
        "nbdcopy",
        &run(Command::new(&nbdcopy).args([&srv.uri(), path_str(&again)])),
    );
    assert!(same_file(&again, &want), "cairn reads other data reopened");
}

/// A LUKS2 volume cairn formats with its defaults but a cheap key derivation:
/// cryptsetup's luksDump shows the layout cairn documents, the passphrase opens it, and
/// with the volume key cryptsetup finds, OpenSSL's XTS deciphers what a client wrote.
#[test]
fn a_cairn_made_luks2_volume_has_the_documented_layout() {
    const NAME: &str = "crypt::a_cairn_made_luks2_volume_has_the_documented_layout";
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    let Some([cryptsetup]) = tools(NAME, ["cryptsetup"]) else {
        return;
    };
    let dir = tmpdir();
    let d = dir.path();
    let (img, pass) = (d.join("c.img"), d.join("pass"));
    std::fs::write(&pass, b"passphrase\n").unwrap();
    blank_file(&img, 20 << 20);
    let stack = crypt_stack(
        d,
        &img,
        &pass,
        "create = true\nkdf_iterations = 4\nkdf_memory = \"32M\"\nkdf_parallel = 1\n",
    );
    let want = d.join("want.raw");
    let srv = Server::start_in(tmpdir(), &[path_str(&stack)]);
    libnbd_script(
        &python,
        MODEL,
        &srv.sock,
        &[("CAIRN_WANT", path_str(&want).to_string())],
        "written",
    );
    drop(srv);
    let dump = luks_dump(&cryptsetup, &img);
    for line in [
        "Version:       \t2",
        "offset: 16777216 [bytes]",
        "cipher: aes-xts-plain64",
        "sector: 4096 [bytes]",
        "PBKDF:      argon2id",
        "Memory:     32768",
        "Threads:    1",
    ] {
        assert!(dump.contains(line), "no '{line}' in:\n{dump}");
    }
    assert!(cryptsetup_takes(&cryptsetup, &img, &pass));
    assert_eq!(std::fs::read(&want).unwrap().len(), 4 << 20);
    // Another implementation reads the data: cryptsetup takes the volume key from
    // cairn's header, OpenSSL (through Python's cryptography) deciphers the sectors.
    let has_xts = Command::new(&python)
        .args([
            "-c",
            "from cryptography.hazmat.primitives.ciphers import modes; modes.XTS",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_xts {
        skip(
            NAME,
            "python3 has no cryptography module (apt-get install python3-cryptography)",
        );
        return;
    }
    let dump = success(
        "luksDump --dump-volume-key",
        &run(Command::new(&cryptsetup)
            .args([
                "luksDump",
                "--dump-volume-key",
                "--batch-mode",
                "--key-file",
            ])
            .arg(&pass)
            .arg(&img)),
    );
    let key: String = dump
        .split("MK dump:")
        .nth(1)
        .expect("no MK dump")
        .split_whitespace()
        .take(64)
        .collect();
    libnbd_script(
        &python,
        r#"
import os
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
key = bytes.fromhex(os.environ["CAIRN_KEY"])
image = open(os.environ["CAIRN_IMG"], "rb").read()
want = open(os.environ["CAIRN_WANT"], "rb").read()
data = image[16 << 20:]
for k in range(len(want) // 4096):
    # plain64 counts 512-byte units: 4096-byte sector k has IV 8k.
    tweak = (8 * k).to_bytes(16, "little")
    d = Cipher(algorithms.AES(key), modes.XTS(tweak)).decryptor()
    assert d.update(data[k * 4096:(k + 1) * 4096]) + d.finalize() == want[k * 4096:(k + 1) * 4096], k
print("deciphered")
"#,
        Path::new("/nonexistent"),
        &[
            ("CAIRN_KEY", key),
            ("CAIRN_IMG", path_str(&img).to_string()),
            ("CAIRN_WANT", path_str(&want).to_string()),
        ],
        "deciphered",
    );
}

/// `cairn check FILE`: its output and exit status.
fn check(stack: &Path) -> (Option<i32>, String) {
    let out = run(Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("check")
        .arg(stack));
    (
        out.status.code(),
        format!("{}{}", text(&out.stdout), text(&out.stderr)),
    )
}

/// A LUKS2 volume cryptsetup made, under a stack file with `create = true` kept (as the
/// README shows it): with its first 4 KiB zeroed, `cairn check` and `serve` open it from
/// its secondary header copy (no "to be formatted") and serve the data cryptsetup
/// encrypted; with both header copies zeroed (the key slots and data left), both refuse
/// with one line and the file is unchanged.
#[test]
fn create_never_formats_a_cryptsetup_volume_whose_header_was_wiped() {
    const NAME: &str = "crypt::create_never_formats_a_cryptsetup_volume_whose_header_was_wiped";
    let Some([cryptsetup, nbdcopy]) = tools(NAME, ["cryptsetup", "nbdcopy"]) else {
        return;
    };
    let dir = tmpdir();
    let d = dir.path();
    let (img, pass) = (d.join("c.img"), d.join("pass"));
    std::fs::write(&pass, b"wiped").unwrap();
    // 24 MiB of a pattern encrypted in place behind an 8 MiB header: the first 8 MiB of
    // the pattern are the start of the volume.
    let pattern: Vec<u8> = (0..24u32 << 20).map(|i| (i / 4093 + i) as u8).collect();
    std::fs::write(&img, &pattern).unwrap();
    success(
        "cryptsetup reencrypt --encrypt",
        &run(Command::new(&cryptsetup)
            .args(["reencrypt", "--encrypt", "--type", "luks2", "--batch-mode"])
            .args(["--reduce-device-size", "16M", "--force-offline-reencrypt"])
            .args(["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"])
            .args(["--sector-size", "4096", "--key-file"])
            .arg(&pass)
            .arg(&img)),
    );
    let wipe = |len: usize| {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
        f.write_all_at(&vec![0u8; len], 0).unwrap();
    };
    wipe(4096);
    let stack = crypt_stack(d, &img, &pass, "create = true\n");
    let (code, said) = check(&stack);
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.contains("luks2") && said.contains("UUID") && !said.contains("formatted"),
        "{said}"
    );
    let srv = Server::start_in(tmpdir(), &[path_str(&stack)]);
    let got = d.join("got.raw");
    success(
        "nbdcopy",
        &run(Command::new(&nbdcopy).args([&srv.uri(), path_str(&got)])),
    );
    drop(srv);
    let got = std::fs::read(&got).unwrap();
    assert!(
        got[..8 << 20] == pattern[..8 << 20],
        "cairn reads other data than cryptsetup encrypted"
    );
    // Both copies zeroed: nothing opens it, and create must not format over its key
    // slots and data.
    wipe(32 << 10);
    let before = std::fs::read(&img).unwrap();
    let (code, said) = check(&stack);
    assert_eq!(code, Some(2), "{said}");
    assert!(
        said.contains("holds no LUKS header but is not blank"),
        "{said}"
    );
    let out = run(Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(["serve", "--listen"])
        .arg(format!("unix:{}", d.join("x.sock").display()))
        .arg(&stack));
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("holds no LUKS header but is not blank") && !err.contains("formatted"),
        "{err}"
    );
    assert!(
        std::fs::read(&img).unwrap() == before,
        "the refused start wrote"
    );
}

/// A mirror of two files with superblocks (a stop that is not clean shows at the next
/// start) under a LUKS1 crypt device cairn formats, with an admin socket: the stack file.
fn crypt_over_a_mirror(d: &Path, pass: &Path) -> PathBuf {
    let stack = d.join("stack.toml");
    std::fs::write(
        &stack,
        format!(
            "[device.a]\ntype = \"file\"\npath = \"{0}/a.img\"\nsize = \"8M\"\n\
             [device.b]\ntype = \"file\"\npath = \"{0}/b.img\"\nsize = \"8M\"\n\
             [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\n\
             [device.c]\ntype = \"crypt\"\nbase = \"m\"\npassphrase_file = \"{1}\"\n\
             create = true\nformat = \"luks1\"\nkdf_iterations = 1000\n\
             [export.c]\ndevice = \"c\"\n",
            d.display(),
            pass.display()
        ),
    )
    .unwrap();
    stack
}

/// Seconds in a refusal's estimate: "about 12 s", "about 72 min", "about 3 h".
fn estimate_seconds(said: &str) -> f64 {
    let about = said.split("would take about ").nth(1).expect("an estimate");
    let mut words = about.split_whitespace();
    let n: f64 = words.next().unwrap().parse().unwrap();
    match words.next().unwrap() {
        "s" => n,
        "min" => n * 60.0,
        "h" => n * 3600.0,
        unit => panic!("unit '{unit}' in: {said}"),
    }
}

/// The admin's crypt commands never hang the server. A key derivation of hours
/// (kdf_iterations=4294967295) is refused up front with its estimate; a passphrase file
/// that is a FIFO nobody writes, a directory or a file over cryptsetup's 8 MiB is
/// refused at once; while an accepted derivation of several seconds runs (its iterations
/// taken from that estimate), `status`, `crypt list` and `thin list` answer and a client
/// writes and reads the device (with python3's libnbd); SIGTERM then stops the server cleanly
/// (exit status 0, the mirror's superblocks clean at the next start) and the add that
/// was cut short added nothing.
#[test]
fn a_slow_key_slot_derivation_holds_up_neither_other_commands_nor_the_shutdown() {
    const NAME: &str =
        "crypt::a_slow_key_slot_derivation_holds_up_neither_other_commands_nor_the_shutdown";
    let dir = tmpdir();
    let d = dir.path();
    let (pass, pass2) = (d.join("pass"), d.join("pass2"));
    std::fs::write(&pass, b"first").unwrap();
    std::fs::write(&pass2, b"second").unwrap();
    let stack = crypt_over_a_mirror(d, &pass);
    let ctl = d.join("admin.sock");
    let mut srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    let add = |file: &Path, words: &[&str]| {
        let mut args = vec!["crypt", "add", "c", path_str(file)];
        args.extend(words);
        super::admin::admin(&ctl, &args)
    };
    let huge = add(&pass2, &["kdf_iterations=4294967295"]);
    let said = text(&huge.stderr);
    assert!(
        !huge.status.success() && said.contains("more than the 60 s a new key slot may"),
        "{said}"
    );
    let secs = estimate_seconds(&said);
    assert!(secs > 600.0, "{said}");
    let fifo = d.join("fifo");
    success("mkfifo", &run(Command::new("mkfifo").arg(&fifo)));
    let big = d.join("big");
    std::fs::write(&big, vec![b'x'; (8 << 20) + 1]).unwrap();
    for (file, why) in [
        (&fifo, "is a FIFO"),
        (&d.to_path_buf(), "is a directory"),
        (&big, "is larger than 8388608 bytes"),
    ] {
        super::admin::refused(&ctl, &["crypt", "add", "c", path_str(file)], why);
    }
    // About 20 s of derivation here, by the estimate: well within the bound.
    let iterations = (4_294_967_295.0 * 20.0 / secs) as u64;
    let slow = std::thread::spawn({
        let (ctl, pass2) = (ctl.clone(), pass2.clone());
        move || {
            super::admin::admin(
                &ctl,
                &[
                    "crypt",
                    "add",
                    "c",
                    path_str(&pass2),
                    &format!("kdf_iterations={iterations}"),
                ],
            )
        }
    });
    assert!(
        srv.wait_for_stderr("deriving a new key slot's key", Duration::from_secs(60)),
        "{}",
        srv.stderr()
    );
    let status = success("status", &super::admin::admin(&ctl, &["status"]));
    assert!(status.contains("crypt over m"), "{status}");
    // The key slots, another family's command and the device's own I/O answer too.
    let list = success("crypt list", &super::admin::admin(&ctl, &["crypt", "list"]));
    assert!(list.contains("key slots: 0 pbkdf2"), "{list}");
    let thin = super::admin::admin(&ctl, &["thin", "list", "pool"]);
    let said = text(&thin.stderr);
    assert!(said.contains("pool"), "{said}");
    if let Some(python) = python_with_libnbd(NAME) {
        libnbd_script(&python, CIPHERED, &srv.sock, &[], "done");
    }
    assert!(
        !slow.is_finished(),
        "the derivation ended before the checks"
    );
    let (code, log) = srv.stop();
    assert!(code.success(), "{log}");
    assert!(!log.contains("did not end"), "{log}");
    let cut = slow.join().unwrap();
    assert!(!cut.status.success(), "{cut:?}");
    // The next start finds the mirror stopped cleanly, and only key slot 0.
    let srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
    let list = success("crypt list", &super::admin::admin(&ctl, &["crypt", "list"]));
    assert!(list.contains("key slots: 0 pbkdf2"), "{list}");
    assert!(!list.contains(", 1 "), "{list}");
    assert!(
        !srv.stderr().contains("not stopped cleanly"),
        "{}",
        srv.stderr()
    );
}

/// Three 4 KiB writes and two 8 KiB reads through a client.
const CIPHERED: &str = r#"
import os
import nbd
h = nbd.NBD()
h.connect_unix(os.environ["CAIRN_SOCK"])
for i in range(3):
    h.pwrite(bytes([i + 1]) * 4096, i * 4096)
assert h.pread(8192, 0) == bytes([1]) * 4096 + bytes([2]) * 4096
assert h.pread(8192, 4096)[4096:] == bytes([3]) * 4096
h.flush()
print("done")
"#;

/// A crypt device's own counters after known I/O: `status` (text and --json) and the
/// metrics show the requests and bytes it encrypted and decrypted, some time in the
/// cipher, and its key slot opened at the start and one added since.
#[test]
fn status_and_the_metrics_count_what_a_crypt_device_ciphered() {
    const NAME: &str = "crypt::status_and_the_metrics_count_what_a_crypt_device_ciphered";
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    let dir = tmpdir();
    let d = dir.path();
    let (pass, pass2) = (d.join("pass"), d.join("pass2"));
    std::fs::write(&pass, b"first").unwrap();
    std::fs::write(&pass2, b"second").unwrap();
    let stack = write_stack(
        &dir,
        &format!(
            "[device.m]\ntype = \"mem\"\nsize = \"8M\"\n\
             [device.c]\ntype = \"crypt\"\nbase = \"m\"\npassphrase_file = \"{}\"\n\
             create = true\nformat = \"luks1\"\nkdf_iterations = 1000\n\
             [export.c]\ndevice = \"c\"\n",
            pass.display()
        ),
    );
    let ctl = d.join("admin.sock");
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
    libnbd_script(&python, CIPHERED, &srv.sock, &[], "done");
    let add = super::admin::admin(
        &ctl,
        &["crypt", "add", "c", path_str(&pass2), "kdf_iterations=1000"],
    );
    success("crypt add", &add);
    let status = success("status", &super::admin::admin(&ctl, &["status"]));
    assert!(
        status.contains("crypt c: encrypted 3 requests") && status.contains("decrypted 2 requests"),
        "{status}"
    );
    assert!(
        status.contains("2 key slots in use, 1 opened, 1 added, 0 removed"),
        "{status}"
    );
    let json = super::observe::json(
        "status --json",
        &super::admin::admin(&ctl, &["status", "--json"]),
    );
    let c = &json["crypt"][0];
    assert_eq!(c["device"], "c", "{json:#}");
    assert_eq!(
        (&c["encrypted_requests"], &c["encrypted_bytes"]),
        (&3.into(), &12288.into()),
        "{json:#}"
    );
    assert_eq!(
        (&c["decrypted_requests"], &c["decrypted_bytes"]),
        (&2.into(), &16384.into()),
        "{json:#}"
    );
    assert!(c["cipher_seconds"].as_f64().unwrap() > 0.0, "{json:#}");
    assert_eq!(c["key_slots"], 2, "{json:#}");
    let metrics = super::observe::scrape(&python, &super::observe::metrics_url(&srv));
    for line in [
        "cairn_crypt_requests_total{device=\"c\",direction=\"encrypt\"} 3",
        "cairn_crypt_bytes_total{device=\"c\",direction=\"encrypt\"} 12288",
        "cairn_crypt_requests_total{device=\"c\",direction=\"decrypt\"} 2",
        "cairn_crypt_bytes_total{device=\"c\",direction=\"decrypt\"} 16384",
        "cairn_crypt_key_slots{device=\"c\"} 2",
        "cairn_crypt_key_slot_events_total{device=\"c\",event=\"opened\"} 1",
        "cairn_crypt_key_slot_events_total{device=\"c\",event=\"added\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} not in:\n{metrics}");
    }
    assert!(
        metrics.contains("cairn_crypt_cipher_seconds_total{device=\"c\"}"),
        "{metrics}"
    );
}
