//! LUKS2 headers between cairn and cryptsetup, both ways: images cryptsetup made open in
//! cairn to the volume key `cryptsetup luksDump --dump-volume-key` prints, and data
//! cryptsetup encrypted decrypts with it; headers cairn made, and changed, are read by
//! cryptsetup (`luksDump`, `open --test-passphrase`), and slots cryptsetup adds to them
//! open in cairn. (Skipped, saying so, where cryptsetup is missing.)

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use cairn_core::testing::skip;
use cairn_services::crypt::luks2::Header;
use cairn_services::crypt::xts::Xts;
use cairn_services::crypt::{CryptError, Hash, Kdf, Secret, Segment, SlotInfo};

const PBKDF2: Kdf = Kdf::Pbkdf2 {
    hash: Hash::Sha256,
    iterations: 1000,
};
/// cryptsetup's smallest argon2id costs.
const ARGON2ID: Kdf = Kdf::Argon2id {
    time: 4,
    memory_kib: 32,
    parallel: 1,
};
const FAST_PBKDF2: [&str; 4] = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];
const FAST_ARGON2ID: [&str; 8] = [
    "--pbkdf",
    "argon2id",
    "--pbkdf-force-iterations",
    "4",
    "--pbkdf-memory",
    "32",
    "--pbkdf-parallel",
    "1",
];

use cairn_testkit as common;
use common::{run, tool};

fn cryptsetup(test: &str) -> Option<PathBuf> {
    let found = tool("cryptsetup");
    if found.is_none() {
        skip(
            test,
            "cryptsetup is not installed (apt-get install cryptsetup-bin)",
        );
    }
    found
}

/// Whether `cmd` succeeds.
fn succeeds(cmd: &mut Command) -> bool {
    cmd.output().expect("run").status.success()
}

/// A scratch directory in /dev/shm with passphrase files.
struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Scratch {
        Scratch {
            dir: tempfile::tempdir_in("/dev/shm").unwrap(),
        }
    }

    /// A file holding `pass` (what `--key-file` reads).
    fn pass(&self, pass: &str) -> PathBuf {
        let p = self.dir.path().join(format!("pass-{pass}"));
        std::fs::write(&p, pass).unwrap();
        p
    }

    /// An image of `mib` MiB of zeros.
    fn image(&self, name: &str, mib: u64) -> PathBuf {
        let p = self.dir.path().join(name);
        let f = File::create(&p).unwrap();
        f.set_len(mib << 20).unwrap();
        p
    }
}

fn read_at(path: &Path) -> impl FnMut(u64, &mut [u8]) -> Result<(), CryptError> {
    let f = File::open(path).unwrap();
    move |at, buf| {
        f.read_exact_at(buf, at)
            .map_err(|e| CryptError::Invalid(e.to_string()))
    }
}

fn write_at(path: &Path) -> impl FnMut(u64, &[u8]) -> Result<(), CryptError> {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    move |at, buf| {
        f.write_all_at(buf, at)
            .map_err(|e| CryptError::Invalid(e.to_string()))
    }
}

fn header(path: &Path) -> Result<Header, String> {
    Header::read(&mut read_at(path)).map_err(|e| e.to_string())
}

/// The slot `pass` opens and the volume key.
fn unlock(path: &Path, pass: &str) -> Result<(usize, Vec<u8>), String> {
    let (slot, key) = header(path)?
        .unlock(pass.as_bytes(), &mut read_at(path))
        .map_err(|e| e.to_string())?;
    Ok((slot, key.0.clone()))
}

fn format(cs: &Path, img: &Path, pass: &Path, args: &[&str]) {
    run(Command::new(cs)
        .args(["luksFormat", "--type", "luks2", "--batch-mode"])
        .args(args)
        .arg("--key-file")
        .arg(pass)
        .arg(img));
}

fn dump(cs: &Path, img: &Path) -> String {
    run(Command::new(cs).arg("luksDump").arg(img))
}

/// The volume key as `luksDump --dump-volume-key` prints it: "MK dump:" then hex bytes
/// over several lines.
fn dumped_key(cs: &Path, img: &Path, pass: &Path) -> Vec<u8> {
    let out = run(Command::new(cs)
        .args([
            "luksDump",
            "--dump-volume-key",
            "--batch-mode",
            "--key-file",
        ])
        .arg(pass)
        .arg(img));
    let hex: String = out
        .split("MK dump:")
        .nth(1)
        .expect("a key dump")
        .split_whitespace()
        .take_while(|w| w.len() == 2 && w.chars().all(|c| c.is_ascii_hexdigit()))
        .collect();
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

/// Whether cryptsetup opens `img` with the passphrase in `pass`.
fn opens(cs: &Path, img: &Path, pass: &Path) -> bool {
    succeeds(
        Command::new(cs)
            .args(["open", "--test-passphrase", "--key-file"])
            .arg(pass)
            .arg(img),
    )
}

/// The `Keyslots:` section's slot numbers in a luksDump.
fn dumped_slots(dump: &str) -> Vec<usize> {
    let section = dump
        .split("Keyslots:")
        .nth(1)
        .and_then(|s| s.split("Tokens:").next())
        .expect("a Keyslots section");
    section
        .lines()
        .filter_map(|l| l.strip_prefix("  ")?.strip_suffix(": luks2"))
        .map(|n| n.parse().unwrap())
        .collect()
}

fn dumped(dump: &str, field: &str) -> String {
    dump.lines()
        .find_map(|l| l.trim_start().strip_prefix(field))
        .unwrap_or_else(|| panic!("no {field} in {dump}"))
        .trim()
        .to_string()
}

/// Header copies of 64 KiB and 1 MiB of key slots: the data starts at 2 MiB.
const SMALL_LAYOUT: [&str; 4] = [
    "--luks2-metadata-size",
    "64k",
    "--luks2-keyslots-size",
    "1m",
];

/// An image cryptsetup formats, and what cairn must find in it.
struct Case {
    what: &'static str,
    /// luksFormat's options besides the sector size.
    args: Vec<&'static str>,
    sector: u32,
    kdf: Kdf,
    key_bytes: usize,
    /// Where the data starts.
    offset: u64,
}

/// A case with cryptsetup's default layout and a 64-byte key.
fn case(what: &'static str, args: &[&[&'static str]], sector: u32, kdf: Kdf) -> Case {
    Case {
        what,
        args: args.concat(),
        sector,
        kdf,
        key_bytes: 64,
        offset: 16 << 20,
    }
}

#[test]
fn cryptsetup_images_open_to_the_dumped_volume_key() {
    const NAME: &str = "luks2::cryptsetup_images_open_to_the_dumped_volume_key";
    let Some(cs) = cryptsetup(NAME) else { return };
    let s = Scratch::new();
    let pass = s.pass("correct horse");
    let cases = [
        case("argon2id 512", &[&FAST_ARGON2ID], 512, ARGON2ID),
        case("argon2id 4096", &[&FAST_ARGON2ID], 4096, ARGON2ID),
        case("pbkdf2 512", &[&FAST_PBKDF2], 512, PBKDF2),
        Case {
            key_bytes: 32,
            ..case(
                "pbkdf2 4096 aes-128",
                &[&FAST_PBKDF2, &["--key-size", "256"]],
                4096,
                PBKDF2,
            )
        },
        Case {
            offset: 2 << 20,
            ..case("small layout", &[&FAST_PBKDF2, &SMALL_LAYOUT], 512, PBKDF2)
        },
    ];
    for c in cases {
        let Case {
            what,
            args,
            sector,
            kdf,
            key_bytes,
            offset,
        } = c;
        let img = s.image("c.img", 32);
        let sector_arg = sector.to_string();
        format(
            &cs,
            &img,
            &pass,
            &[&args[..], &["--sector-size", &sector_arg]].concat(),
        );
        let d = dump(&cs, &img);
        let h = header(&img).unwrap();
        assert_eq!(h.uuid(), dumped(&d, "UUID:"), "{what}");
        assert_eq!(h.key_bytes(), key_bytes, "{what}");
        assert_eq!(
            h.segment(),
            Segment {
                offset,
                size: None,
                sector_bytes: sector,
                iv_tweak: 0,
            },
            "{what}"
        );
        assert_eq!(h.slots(), vec![SlotInfo { index: 0, kdf }], "{what}");
        let (slot, key) = unlock(&img, "correct horse").unwrap();
        assert_eq!(slot, 0, "{what}");
        assert_eq!(key, dumped_key(&cs, &img, &pass), "{what}");
        assert!(h.check(&key), "{what}");
        let e = unlock(&img, "wrong horse").unwrap_err();
        assert!(e.contains("no key slot opens"), "{what}: {e}");
    }
    // The last image has 64 KiB header copies: with the primary gone, cairn finds the
    // secondary at 64 KiB by scanning, as cryptsetup does.
    let last = s.dir.path().join("c.img");
    write_at(&last)(0, &[0u8; 4096]).unwrap();
    assert_eq!(unlock(&last, "correct horse").unwrap().0, 0);
    assert!(opens(&cs, &last, &pass));

    // A second slot cryptsetup adds opens with its own passphrase.
    let img = s.image("add.img", 32);
    format(&cs, &img, &pass, &FAST_ARGON2ID);
    let other = s.pass("battery staple");
    run(Command::new(&cs)
        .args(["luksAddKey", "--batch-mode"])
        .args(FAST_PBKDF2)
        .arg("--key-file")
        .arg(&pass)
        .arg(&img)
        .arg(&other));
    let (slot, key) = unlock(&img, "battery staple").unwrap();
    assert_eq!(slot, 1);
    assert_eq!(key, dumped_key(&cs, &img, &pass));
    assert_eq!(
        header(&img).unwrap().slots(),
        vec![
            SlotInfo {
                index: 0,
                kdf: ARGON2ID
            },
            SlotInfo {
                index: 1,
                kdf: PBKDF2
            }
        ]
    );
}

/// A 64 MiB image whose 512-byte sector `i` is `le32(i)` repeated.
fn pattern(path: &Path) {
    let mut b = Vec::with_capacity(64 << 20);
    for i in 0u32..(64 << 11) {
        for _ in 0..128 {
            b.extend_from_slice(&i.to_le_bytes());
        }
    }
    std::fs::write(path, b).unwrap();
}

#[test]
fn data_cryptsetup_encrypted_decrypts_with_cairns_key() {
    const NAME: &str = "luks2::data_cryptsetup_encrypted_decrypts_with_cairns_key";
    let Some(cs) = cryptsetup(NAME) else { return };
    let s = Scratch::new();
    let pass = s.pass("pass");
    for sector in [4096usize, 512] {
        // cryptsetup encrypts a file in place, in userspace (no device-mapper needed),
        // moving the data behind a new header.
        let img = s.dir.path().join("data.img");
        pattern(&img);
        run(Command::new(&cs)
            .args(["reencrypt", "--encrypt", "--type", "luks2", "--batch-mode"])
            .args(["--reduce-device-size", "32M", "--force-offline-reencrypt"])
            .args(FAST_PBKDF2)
            .args(["--sector-size", &sector.to_string(), "--key-file"])
            .arg(&pass)
            .arg(&img));
        let h = header(&img).unwrap();
        let seg = h.segment();
        assert_eq!((seg.offset, seg.sector_bytes as usize), (16 << 20, sector));
        let (_, key) = unlock(&img, "pass").unwrap();
        let x = Xts::new(&key).unwrap();
        let units = (sector / 512) as u64;
        let image = std::fs::read(&img).unwrap();
        for k in [0u64, 1, 2, 1000, (16 << 20) / sector as u64 - 1] {
            let at = (seg.offset + k * sector as u64) as usize;
            let stored = &image[at..at + sector];
            let mut plain = stored.to_vec();
            // plain64 counts 512-byte units whatever the sector size.
            x.run(&mut plain, sector, seg.iv_tweak + k * units, false);
            for (j, unit) in plain.chunks(512).enumerate() {
                let want = (k * units + j as u64) as u32;
                assert!(
                    unit.chunks(4).all(|w| w == want.to_le_bytes()),
                    "sector {sector}: sector {k} unit {j}"
                );
            }
            if k > 0 && units > 1 {
                let mut wrong = stored.to_vec();
                x.run(&mut wrong, sector, seg.iv_tweak + k, false);
                assert_ne!(wrong, plain, "sector {k} also decrypts with IV {k}");
            }
        }
    }
}

#[test]
fn cairn_made_headers_satisfy_cryptsetup() {
    const NAME: &str = "luks2::cairn_made_headers_satisfy_cryptsetup";
    let Some(cs) = cryptsetup(NAME) else { return };
    let s = Scratch::new();
    let (one, two, three) = (s.pass("one"), s.pass("two"), s.pass("three"));
    for (kdf, sector, pbkdf) in [(PBKDF2, 4096, "pbkdf2"), (ARGON2ID, 512, "argon2id")] {
        let img = s.image("cairn.img", 32);
        let mut key = Secret(vec![0u8; 64]);
        cairn_services::crypt::random(&mut key.0).unwrap();
        let mut h = Header::create(&mut write_at(&img), &key, b"one", kdf, sector).unwrap();
        let d = dump(&cs, &img);
        assert_eq!(dumped(&d, "Version:"), "2", "{pbkdf}");
        assert_eq!(dumped(&d, "Epoch:"), "1", "{pbkdf}");
        assert_eq!(dumped(&d, "UUID:"), h.uuid(), "{pbkdf}");
        assert_eq!(dumped(&d, "PBKDF:"), pbkdf);
        assert_eq!(dumped(&d, "sector:"), format!("{sector} [bytes]"));
        assert_eq!(dumped(&d, "offset:"), "16777216 [bytes]");
        assert_eq!(dumped_slots(&d), vec![0], "{pbkdf}");
        assert!(opens(&cs, &img, &one), "{pbkdf}");
        assert!(!opens(&cs, &img, &two), "{pbkdf}");
        assert_eq!(dumped_key(&cs, &img, &one), key.0, "{pbkdf}");

        // cairn adds slot 1 and removes slot 0.
        assert_eq!(
            h.add_slot(&mut write_at(&img), &key, b"two", kdf).unwrap(),
            1
        );
        h.remove_slot(&mut write_at(&img), 0).unwrap();
        let d = dump(&cs, &img);
        assert_eq!(dumped(&d, "Epoch:"), "3", "{pbkdf}");
        assert_eq!(dumped_slots(&d), vec![1], "{pbkdf}");
        assert_eq!(dumped(&d, "Area offset:"), "290816 [bytes]", "{pbkdf}");
        assert!(opens(&cs, &img, &two), "{pbkdf}");
        assert!(!opens(&cs, &img, &one), "{pbkdf}");

        // cryptsetup adds a slot to the header cairn made (slot 0, free again) ...
        run(Command::new(&cs)
            .args(["luksAddKey", "--batch-mode"])
            .args(FAST_PBKDF2)
            .arg("--key-file")
            .arg(&two)
            .arg(&img)
            .arg(&three));
        let h = header(&img).unwrap();
        let slots: Vec<usize> = h.slots().iter().map(|s| s.index).collect();
        assert_eq!(slots, vec![0, 1], "{pbkdf}");
        let (slot, got) = unlock(&img, "three").unwrap();
        assert_eq!((slot, &got), (0, &key.0), "{pbkdf}");
        // ... and cairn rewrites the JSON cryptsetup wrote, which cryptsetup still reads.
        let mut h = h;
        h.remove_slot(&mut write_at(&img), 1).unwrap();
        assert_eq!(dumped_slots(&dump(&cs, &img)), vec![0], "{pbkdf}");
        assert!(opens(&cs, &img, &three), "{pbkdf}");
        assert!(!opens(&cs, &img, &two), "{pbkdf}");
    }
}

#[test]
fn bad_input_is_refused() {
    const NAME: &str = "luks2::bad_input_is_refused";
    let Some(cs) = cryptsetup(NAME) else { return };
    let s = Scratch::new();
    let pass = s.pass("pass");
    let img = s.image("l1.img", 32);
    run(Command::new(&cs)
        .args(["luksFormat", "--type", "luks1", "--batch-mode"])
        .args(["--pbkdf-force-iterations", "1000", "--key-file"])
        .arg(&pass)
        .arg(&img));
    let e = header(&img).unwrap_err();
    assert!(e.contains("version 1"), "{e}");
    let zeros = s.image("zero.img", 32);
    let e = header(&zeros).unwrap_err();
    assert!(e.contains("no LUKS header"), "{e}");
    let img = s.image("l2.img", 32);
    format(&cs, &img, &pass, &FAST_PBKDF2);
    let e = unlock(&img, "Pass").unwrap_err();
    assert!(e.contains("no key slot opens"), "{e}");
    // An encryption in place begun but not run: cryptsetup marks it a mandatory
    // requirement, which cairn refuses.
    let img2 = s.image("reencrypt.img", 64);
    run(Command::new(&cs)
        .args(["reencrypt", "--encrypt", "--init-only", "--type", "luks2"])
        .args(["--reduce-device-size", "32M", "--batch-mode"])
        .args(FAST_PBKDF2)
        .arg("--key-file")
        .arg(&pass)
        .arg(&img2));
    let e = header(&img2).unwrap_err();
    assert!(
        e.contains("mandatory") && e.contains("online-reencrypt"),
        "{e}"
    );
    // Both copies damaged (a byte of each JSON text).
    let mut write = write_at(&img);
    for at in [4096 + 10, (16 << 10) + 4096 + 10] {
        write(at, b"#").unwrap();
    }
    let e = header(&img).unwrap_err();
    assert!(e.contains("both"), "{e}");
}
