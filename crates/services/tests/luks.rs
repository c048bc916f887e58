//! LUKS1 images made by cryptsetup and by qemu open in cairn: the master key cairn
//! finds is the one `cryptsetup luksDump --dump-volume-key` prints, and a sector qemu
//! wrote decrypts to what it wrote. A wrong passphrase opens nothing. (Skipped, saying
//! so, where cryptsetup or qemu-img is missing.)

use std::path::Path;
use std::process::Command;

use cairn_core::testing::skip;
use cairn_services::crypt::luks1::Header;
use cairn_services::crypt::xts::Xts;
use cairn_services::crypt::CryptError;

use cairn_testkit as common;
use common::{run, tool};

fn open(path: &Path, pass: &[u8]) -> Result<(usize, Vec<u8>, Header), String> {
    let image = std::fs::read(path).unwrap();
    let h = Header::decode(&image).map_err(|e| e.to_string())?;
    let mut read = |at: u64, buf: &mut [u8]| {
        let at = at as usize;
        let from = image.get(at..at + buf.len());
        buf.copy_from_slice(from.ok_or_else(|| CryptError::Invalid("past the end".into()))?);
        Ok(())
    };
    let (slot, mk) = h.unlock(pass, &mut read).map_err(|e| e.to_string())?;
    Ok((slot, mk.0.clone(), h))
}

#[test]
fn a_cryptsetup_luks1_image_opens_with_the_same_master_key() {
    const NAME: &str = "luks::a_cryptsetup_luks1_image_opens_with_the_same_master_key";
    let Some(cryptsetup) = tool("cryptsetup") else {
        skip(
            NAME,
            "cryptsetup is not installed (apt-get install cryptsetup-bin)",
        );
        return;
    };
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let img = dir.path().join("c.img");
    let pass = dir.path().join("pass");
    std::fs::write(&pass, b"correct horse").unwrap();
    std::fs::File::create(&img)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    for (hash, key) in [("sha256", "512"), ("sha1", "256")] {
        run(Command::new(&cryptsetup)
            .args([
                "luksFormat",
                "--type",
                "luks1",
                "--batch-mode",
                "--pbkdf-force-iterations",
                "1000",
                "--hash",
                hash,
                "--key-size",
                key,
                "--key-file",
            ])
            .arg(&pass)
            .arg(&img));
        let dump = run(Command::new(&cryptsetup)
            .args([
                "luksDump",
                "--dump-volume-key",
                "--batch-mode",
                "--key-file",
            ])
            .arg(&pass)
            .arg(&img));
        // "MK dump:\t12 34 ..." then continuation lines of hex.
        let hex: String = dump
            .split("MK dump:")
            .nth(1)
            .expect("a key dump")
            .split_whitespace()
            .take_while(|w| w.len() == 2 && w.chars().all(|c| c.is_ascii_hexdigit()))
            .collect();
        let want: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let (slot, mk, h) = open(&img, b"correct horse").unwrap();
        assert_eq!(slot, 0);
        assert_eq!(mk, want, "{hash}");
        assert_eq!(h.key_bytes as usize * 8, key.parse::<usize>().unwrap());
        assert_eq!(h.payload_sector, 4096);
        let e = open(&img, b"wrong horse").unwrap_err();
        assert!(e.contains("no key slot"), "{e}");
    }
    // A second slot opens with its own passphrase.
    let other = dir.path().join("other");
    std::fs::write(&other, b"battery staple").unwrap();
    run(Command::new(&cryptsetup)
        .args([
            "luksAddKey",
            "--batch-mode",
            "--pbkdf-force-iterations",
            "1000",
            "--key-file",
        ])
        .arg(&pass)
        .arg(&img)
        .arg(&other));
    let (slot, _, _) = open(&img, b"battery staple").unwrap();
    assert_eq!(slot, 1);
}

#[test]
fn a_sector_qemu_wrote_decrypts_to_what_it_wrote() {
    const NAME: &str = "luks::a_sector_qemu_wrote_decrypts_to_what_it_wrote";
    let (Some(qemu_img), Some(qemu_io)) = (tool("qemu-img"), tool("qemu-io")) else {
        skip(NAME, "qemu-img or qemu-io is not installed");
        return;
    };
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let img = dir.path().join("q.img");
    let secret = "secret,id=sec0,data=letmein";
    run(Command::new(&qemu_img)
        .args(["create", "-q", "-f", "luks", "--object", secret])
        .args(["-o", "key-secret=sec0,iter-time=10"])
        .arg(&img)
        .arg("4M"));
    let opts = format!(
        "driver=luks,key-secret=sec0,file.filename={}",
        img.display()
    );
    run(Command::new(&qemu_io).args([
        "--object",
        secret,
        "--image-opts",
        &opts,
        "-c",
        "write -P 0xab 0 4096",
        "-c",
        "write -P 0x5c 1048576 512",
    ]));
    let (_, mk, h) = open(&img, b"letmein").unwrap();
    let image = std::fs::read(&img).unwrap();
    let payload = h.payload_sector as usize * 512;
    let x = Xts::new(&mk).unwrap();
    let mut first = image[payload..payload + 4096].to_vec();
    assert!(first.iter().any(|&b| b != 0xab), "stored in the clear");
    x.run(&mut first, 512, 0, false);
    assert!(first.iter().all(|&b| b == 0xab));
    // The IV is the sector's number in the payload.
    let at = payload + (1 << 20);
    let mut s = image[at..at + 512].to_vec();
    x.decrypt(&mut s, (1 << 20) / 512);
    assert!(s.iter().all(|&b| b == 0x5c));
    assert!(open(&img, b"letmeout").is_err());
}
