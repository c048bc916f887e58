//! The bitmap store directory's target: a directory copy decoded, encoded and decoded
//! again.
//!
//! Input: flags, then the copy (as many bytes as given: a copy is read whole, up to
//! [`SLOT`]). With [`RESEAL`] its checksum is made again first.

use crate::dirty::format::{
    area_bytes, Directory, Entry, AREAS, CHECKPOINT, DISABLED, FRAME, INCONSISTENT, PAGE, PENDING,
    SLOT, VERSION,
};
use cairn_core::fuzzing::{Input, RESEAL};
use cairn_core::ondisk::record::Checksum;

/// The target's body.
pub fn directory(data: &[u8]) -> bool {
    let mut input = Input::new(data);
    let flags = input.u8();
    let mut copy = input.take(SLOT as usize).to_vec();
    if flags & RESEAL != 0 {
        reseal(&mut copy);
    }
    let Ok(d) = Directory::decode(&copy) else {
        return false;
    };
    assert_eq!(Directory::decode(&d.encode()).as_ref(), Ok(&d));
    true
}

/// The checksum made again over the length the copy says (when it fits the copy), the
/// rest left as it is.
fn reseal(copy: &mut [u8]) {
    let Checksum::Length { at, len_at } = FRAME.checksum() else {
        return;
    };
    let Some(len) = copy.get(len_at..len_at + 4) else {
        return;
    };
    let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
    if (len_at..=copy.len()).contains(&len) {
        let crc = crc32c::crc32c(&copy[len_at..len]);
        copy[at..at + 4].copy_from_slice(&crc.to_le_bytes());
    }
}

fn with_flags(flags: u8, b: &[u8]) -> Vec<u8> {
    let mut out = vec![flags];
    out.extend_from_slice(b);
    out
}

/// A directory of `version` with bitmaps of every flag, owners, and areas laid out one
/// after the other.
fn full(version: u32) -> Directory {
    let mut area = AREAS;
    let mut entry = |name: &str, owner: &str, shift, bits, flags| {
        let e = Entry {
            name: name.into(),
            owner: owner.into(),
            shift,
            bits,
            flags,
            area,
        };
        area += area_bytes(version, bits);
        e
    };
    Directory {
        version,
        seq: 42,
        identity: if version == 1 {
            0
        } else {
            0x5eed_cafe_f00d_0001
        },
        device: "a-device-with-a-long-name".into(),
        device_bytes: 64 << 30,
        entries: vec![
            entry("b0", "", 16, 1 << 20, 0),
            entry("backup.1", "snap-2", 12, 1 << 24, DISABLED | INCONSISTENT),
            entry("cp@3", "snap-3", 20, 65536, CHECKPOINT | PENDING),
        ],
    }
}

/// Seeds: an empty directory, directories with bitmaps of every flag and owner in both
/// versions, one torn and the same resealed, one cut short.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let empty = Directory {
        version: VERSION,
        seq: 1,
        identity: 7,
        device: "vm1".into(),
        device_bytes: 1 << 30,
        entries: Vec::new(),
    };
    // A byte of the first name changed (to another valid name): torn, or resealed.
    let mut torn = full(VERSION).encode();
    torn[113] = b'c';
    vec![
        ("valid-empty".into(), with_flags(0, &empty.encode())),
        (
            "valid-entries".into(),
            with_flags(0, &full(VERSION).encode()),
        ),
        ("valid-version-1".into(), with_flags(0, &full(1).encode())),
        ("valid-resealed".into(), with_flags(RESEAL, &torn)),
        ("damaged-torn".into(), with_flags(0, &torn)),
        (
            "damaged-short".into(),
            with_flags(RESEAL, &full(VERSION).encode()[..100]),
        ),
        (
            "damaged-page".into(),
            with_flags(0, &vec![0u8; PAGE as usize]),
        ),
    ]
}
