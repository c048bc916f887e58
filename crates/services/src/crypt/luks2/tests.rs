//! Unit tests of LUKS2 headers: made, read back, opened, changed, damaged, refused.

use super::copies::{be64, SEQID_AT};
use super::fields::{base64_decode, base64_encode};
use super::*;

const PBKDF2: Kdf = Kdf::Pbkdf2 {
    hash: Hash::Sha256,
    iterations: 1000,
};
const ARGON2ID: Kdf = Kdf::Argon2id {
    time: 1,
    memory_kib: 8 << 10,
    parallel: 1,
};

/// A change to a header's JSON.
type Change = fn(&mut Value);

/// An in-memory device of 17 MiB: the header and 1 MiB of data.
struct Image(Vec<u8>);

impl Image {
    fn new() -> Image {
        Image(vec![0u8; 17 << 20])
    }

    fn write(&mut self) -> impl FnMut(u64, &[u8]) -> Result<(), CryptError> + '_ {
        |at, b| {
            let at = at as usize;
            self.0
                .get_mut(at..at + b.len())
                .ok_or_else(|| CryptError::Invalid("past the end".into()))?
                .copy_from_slice(b);
            Ok(())
        }
    }

    fn read(&self) -> impl FnMut(u64, &mut [u8]) -> Result<(), CryptError> + '_ {
        |at, b| {
            let at = at as usize;
            let from = self.0.get(at..at + b.len());
            b.copy_from_slice(from.ok_or_else(|| CryptError::Invalid("past the end".into()))?);
            Ok(())
        }
    }

    fn header(&self) -> Result<Header, CryptError> {
        Header::read(&mut self.read())
    }

    fn unlock(&self, pass: &[u8]) -> Result<(usize, Vec<u8>), CryptError> {
        let h = self.header()?;
        let (slot, key) = h.unlock(pass, &mut self.read())?;
        Ok((slot, key.0.clone()))
    }
}

fn key() -> Secret {
    Secret((0..64).map(|i| i * 3 + 1).collect())
}

#[test]
fn a_made_header_reads_back_and_opens() {
    for (kdf, sector) in [(PBKDF2, 4096), (ARGON2ID, 512)] {
        let mut img = Image::new();
        let made = Header::create(&mut img.write(), &key(), b"one", kdf, sector).unwrap();
        let h = img.header().unwrap();
        assert_eq!(h.uuid(), made.uuid());
        assert_eq!(h.seqid, 1);
        assert_eq!(h.key_bytes(), 64);
        assert_eq!(
            h.segment(),
            Segment {
                offset: 16 << 20,
                size: None,
                sector_bytes: sector,
                iv_tweak: 0,
            }
        );
        assert_eq!(h.slots(), vec![SlotInfo { index: 0, kdf }]);
        assert_eq!(img.unlock(b"one").unwrap(), (0, key().0.clone()));
        assert!(h.check(&key().0));
        assert!(!h.check(&[0u8; 64]));
        // A wrong passphrase: its own kind, and the words the admin replies with.
        let e = img.unlock(b"two").unwrap_err();
        assert!(matches!(e, CryptError::WrongPassphrase), "{e:?}");
        assert_eq!(e.to_string(), "no key slot opens with this passphrase");
        // The data area is left alone.
        assert!(img.0[16 << 20..].iter().all(|&b| b == 0));
    }
}

#[test]
fn a_damaged_copy_leaves_the_other_and_two_refuse() {
    let mut img = Image::new();
    Header::create(&mut img.write(), &key(), b"one", PBKDF2, 4096).unwrap();
    // A byte of the primary's JSON.
    img.0[4200] ^= 1;
    assert_eq!(img.unlock(b"one").unwrap().0, 0);
    // And the secondary's binary header.
    img.0[(16 << 10) + 20] ^= 1;
    let e = img.header().unwrap_err();
    assert!(matches!(e, CryptError::Damaged(_)), "{e:?}");
    let e = e.to_string();
    assert!(
        e.contains("both") && e.contains("primary") && e.contains("secondary"),
        "{e}"
    );
    // The secondary alone, found by scanning when the primary's magic is gone.
    let mut img = Image::new();
    Header::create(&mut img.write(), &key(), b"one", PBKDF2, 4096).unwrap();
    img.0[..4096].fill(0);
    assert_eq!(img.unlock(b"one").unwrap().0, 0);
}

#[test]
fn a_torn_update_leaves_the_older_copy() {
    let mut img = Image::new();
    let mut h = Header::create(&mut img.write(), &key(), b"one", PBKDF2, 4096).unwrap();
    let before = img.0[..32 << 10].to_vec();
    h.add_slot(&mut img.write(), &key(), b"two", PBKDF2)
        .unwrap();
    assert_eq!(img.header().unwrap().seqid, 2);
    // The update got as far as the new primary's binary header (seqid 2) over the
    // old JSON area; the secondary is still the old one.
    img.0[16 << 10..32 << 10].copy_from_slice(&before[16 << 10..]);
    img.0[4 << 10..16 << 10].copy_from_slice(&before[4 << 10..16 << 10]);
    assert_eq!(be64(&img.0, SEQID_AT), 2);
    let h = img.header().unwrap();
    assert_eq!(h.seqid, 1);
    assert_eq!(h.slots().len(), 1);
    // With the new primary whole, it wins over the older secondary.
    let mut img2 = Image::new();
    let mut h = Header::create(&mut img2.write(), &key(), b"one", PBKDF2, 4096).unwrap();
    let old_secondary = img2.0[16 << 10..32 << 10].to_vec();
    h.add_slot(&mut img2.write(), &key(), b"two", PBKDF2)
        .unwrap();
    img2.0[16 << 10..32 << 10].copy_from_slice(&old_secondary);
    assert_eq!(img2.header().unwrap().seqid, 2);
    assert_eq!(img2.unlock(b"two").unwrap().0, 1);
}

#[test]
fn slots_are_added_and_removed() {
    let mut img = Image::new();
    let mut h = Header::create(&mut img.write(), &key(), b"one", PBKDF2, 4096).unwrap();
    let wrong = Secret(vec![9u8; 64]);
    let e = h
        .add_slot(&mut img.write(), &wrong, b"x", PBKDF2)
        .unwrap_err();
    assert!(
        matches!(e, CryptError::WrongKey { what: "volume" }),
        "{e:?}"
    );
    assert!(
        e.to_string().contains("not this header's volume key"),
        "{e}"
    );
    assert_eq!(
        h.add_slot(&mut img.write(), &key(), b"two", ARGON2ID)
            .unwrap(),
        1
    );
    assert_eq!(img.unlock(b"two").unwrap(), (1, key().0.clone()));
    let read = img.header().unwrap();
    assert_eq!(read.seqid, 2);
    assert_eq!(read.meta.keyslots[&1].area_offset, (32 << 10) + 258048);
    h.remove_slot(&mut img.write(), 0).unwrap();
    assert!(img.unlock(b"one").is_err());
    assert_eq!(img.unlock(b"two").unwrap().0, 1);
    let e = h.remove_slot(&mut img.write(), 1).unwrap_err();
    assert!(matches!(e, CryptError::LastSlot(1)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "key slot 1 is the only key slot: add another first"
    );
    assert!(h
        .remove_slot(&mut img.write(), 0)
        .unwrap_err()
        .to_string()
        .contains("not in use"));
    // The freed number and area are used again.
    assert_eq!(
        h.add_slot(&mut img.write(), &key(), b"three", PBKDF2)
            .unwrap(),
        0
    );
    assert_eq!(
        img.header().unwrap().meta.keyslots[&0].area_offset,
        32 << 10
    );
    assert_eq!(img.unlock(b"three").unwrap().0, 0);
    let read = img.header().unwrap();
    assert_eq!(read.seqid, 4);
    let d = &read.json["digests"]["0"]["keyslots"];
    assert_eq!(d, &json!(["1", "0"]));
}

#[test]
fn unknown_fields_survive_a_rewrite() {
    let mut img = Image::new();
    let mut h = Header::create(&mut img.write(), &key(), b"one", PBKDF2, 4096).unwrap();
    let mut json = h.json.clone();
    json["config"]["flags"] = json!(["allow-discards"]);
    json["tokens"]["0"] = json!({"type": "x", "keyslots": ["0"]});
    h.commit(&mut img.write(), json).unwrap();
    h.add_slot(&mut img.write(), &key(), b"two", PBKDF2)
        .unwrap();
    h.remove_slot(&mut img.write(), 0).unwrap();
    let read = img.header().unwrap();
    assert_eq!(read.json["config"]["flags"], json!(["allow-discards"]));
    assert_eq!(
        read.json["tokens"]["0"],
        json!({"type": "x", "keyslots": []})
    );
}

#[test]
fn unsupported_and_out_of_bounds_metadata_is_refused() {
    let mut img = Image::new();
    let h = Header::create(&mut img.write(), &key(), b"one", PBKDF2, 4096).unwrap();
    let cases: [(&str, Change); 8] = [
        ("integrity", |j| j["segments"]["0"]["integrity"] = json!({})),
        ("cipher", |j| {
            j["segments"]["0"]["encryption"] = json!("serpent-xts-plain64")
        }),
        ("mandatory", |j| {
            j["config"]["requirements"] = json!({"mandatory": ["online-reencrypt-v2"]})
        }),
        ("2 data segments", |j| {
            j["segments"]["1"] = j["segments"]["0"].clone()
        }),
        ("kdf", |j| {
            j["keyslots"]["0"]["kdf"]["type"] = json!("scrypt")
        }),
        ("do not fit", |j| {
            j["keyslots"]["0"]["area"]["offset"] = json!("16777216")
        }),
        ("inside the header", |j| {
            j["segments"]["0"]["offset"] = json!("1048576")
        }),
        ("json_size", |j| j["config"]["json_size"] = json!("4190208")),
    ];
    for (want, change) in cases {
        let mut json = h.json.clone();
        change(&mut json);
        let e = Meta::parse(&json, h.header_bytes)
            .unwrap_err()
            .into_error()
            .to_string();
        assert!(e.contains(want), "{want}: {e}");
    }
    // A refusal is not taken for damage: the error names it, not both copies.
    let mut h = h;
    let mut json = h.json.clone();
    json["segments"]["0"]["integrity"] = json!({});
    h.json = json;
    h.write_copies(&mut img.write()).unwrap();
    let e = img.header().unwrap_err();
    assert!(matches!(e, CryptError::Unsupported(_)), "{e:?}");
    let e = e.to_string();
    assert!(e.contains("integrity") && !e.contains("both"), "{e}");
}

/// The primary copy of `img` (16 KiB) with its checksum made again after a change.
fn reseal(img: &mut Image) {
    let copy = &mut img.0[..16 << 10];
    copy[448..448 + 64].fill(0);
    let mut csum = [0u8; 32];
    Hash::Sha256.digest(&[&copy[..]], &mut csum);
    copy[448..448 + 32].copy_from_slice(&csum);
}

/// Label and UUID fields filled to their last byte read as cryptsetup reads them (the
/// last byte is the terminator), so that a rewrite writes back what was read: the
/// label used to lose its last byte and the UUID its fortieth on the first rewrite.
#[test]
fn full_string_fields_read_as_they_are_written_back() {
    let mut img = Image::new();
    Header::create(&mut img.write(), &key(), b"one", PBKDF2, 4096).unwrap();
    img.0[24..24 + 48].fill(b'L');
    img.0[168..168 + 40].fill(b'u');
    img.0[208..208 + 48].fill(b'S');
    reseal(&mut img);
    let h = img.header().unwrap();
    assert_eq!(h.uuid(), "u".repeat(39));
    h.write_copies(&mut img.write()).unwrap();
    let again = img.header().unwrap();
    assert_eq!(
        (again.label, again.subsystem, again.uuid()),
        (h.label, h.subsystem, h.uuid())
    );
    assert_eq!(&again.label[..47], &[b'L'; 47][..]);
    // A UUID that is not text makes its copy damaged (the other copy serves), rather
    // than read with replacement characters and written back changed.
    let good = img.header().unwrap().uuid().to_string();
    img.0[168] = 0xff;
    reseal(&mut img);
    assert_eq!(img.header().unwrap().uuid(), good);
}

/// A refusal quoting a header's string (here the checksum algorithm's name, and a
/// JSON string) is one line whatever the string holds; it used to hold the newline.
#[test]
fn a_refusal_quoting_a_header_string_is_one_line() {
    let mut img = Image::new();
    let h = Header::create(&mut img.write(), &key(), b"one", PBKDF2, 4096).unwrap();
    let good = img.0.clone();
    img.0[72..72 + 8].copy_from_slice(b"sha256\n\0");
    img.0[(16 << 10) + 72..(16 << 10) + 72 + 8].copy_from_slice(b"sha256\n\0");
    let e = img.header().unwrap_err().to_string();
    assert!(e.contains("sha256\\n") && !e.contains('\n'), "{e}");
    img.0 = good;
    let mut h = h;
    h.json["segments"]["0"]["encryption"] = json!("serpent\nxts");
    h.write_copies(&mut img.write()).unwrap();
    let e = img.header().unwrap_err().to_string();
    assert!(e.contains("serpent\\nxts") && !e.contains('\n'), "{e}");
}

#[test]
fn not_luks2_is_refused() {
    let img = Image::new();
    assert!(matches!(img.header().unwrap_err(), CryptError::NoHeader));
    let mut img = Image::new();
    img.0[..6].copy_from_slice(&MAGIC);
    img.0[7] = 1;
    assert!(img.header().unwrap_err().to_string().contains("version 1"));
}

#[test]
fn base64_round_trips() {
    for n in 0..40usize {
        let b: Vec<u8> = (0..n).map(|i| (i * 37 + 5) as u8).collect();
        let s = base64_encode(&b);
        assert_eq!(s.len(), n.div_ceil(3) * 4);
        assert_eq!(base64_decode(&s).unwrap(), b);
    }
    assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
    assert_eq!(base64_encode(b"fo"), "Zm8=");
    assert_eq!(base64_decode("Zg==").unwrap(), b"f");
    for bad in ["Zg=", "Z===", "Zg==Zg==", "Z!==", "Zm9v\n"] {
        assert!(base64_decode(bad).is_none(), "{bad}");
    }
}
