//! The LUKS2 header's fuzz target body and seeds (see `cairn_config::fuzz`): here, beside the
//! private parts they use (writing the copies again, a seed's digest made cheap).
//!
//! Input: flags, then the start of the device (both header copies, then key material).
//! With [`RESEAL`] the copies' checksums are made again first; with [`UNLOCK`] the
//! header is opened with [`PASSPHRASE`] when its costs are small.

use serde_json::json;

use super::fields::base64_encode;
use super::Header;
use crate::crypt::{CryptError, Hash, Kdf, Secret};
use crate::fuzz::luks::{PASSPHRASE, UNLOCK};
use cairn_core::fuzzing::{read_image, write_image, Input, RESEAL};

/// Most bytes a rewrite of the header may make the image (two copies of 4 MiB at most).
const IMAGE_MAX: usize = 8 << 20;
/// Most PBKDF2 iterations and key material bytes a header may ask for to be opened by
/// the target (more would make it slow, not wrong).
const ITERATIONS_CHEAP: u32 = 64;
const MATERIAL_CHEAP: usize = 1 << 20;

/// The target's body.
pub fn header(data: &[u8]) -> bool {
    let mut input = Input::new(data);
    let flags = input.u8();
    let mut image = input.rest().to_vec();
    if flags & RESEAL != 0 {
        reseal(&mut image);
    }
    let h =
        match Header::read(&mut |at, buf| read_image(&image, at, buf).map_err(CryptError::Invalid))
        {
            Ok(h) => h,
            Err(e) => {
                assert!(
                    !e.to_string().contains('\n'),
                    "a refusal of more than one line: {e}"
                );
                return false;
            }
        };
    // Written again (as adding a key slot does), the copies read back the same header.
    let mut again = image.clone();
    match h.write_copies(&mut |at, b| {
        write_image(&mut again, IMAGE_MAX, at, b).map_err(CryptError::Invalid)
    }) {
        Ok(()) => match Header::read(&mut |at, buf| {
            read_image(&again, at, buf).map_err(CryptError::Invalid)
        }) {
            Ok(back) => assert!(back == h, "a rewritten header reads back another"),
            Err(e) => panic!("a header cairn wrote does not read back: {e}"),
        },
        // Its JSON written again may be longer than the text read (`1E2` is `100.0`).
        Err(e) => assert!(e.to_string().contains("does not fit"), "{e}"),
    }
    let _ = (h.segment(), h.slots(), h.key_bytes(), h.uuid());
    if flags & UNLOCK != 0 && cheap(&h) {
        if let Ok((n, key)) = h.unlock(PASSPHRASE, &mut |at, buf| {
            read_image(&image, at, buf).map_err(CryptError::Invalid)
        }) {
            assert!(h.meta.keyslots[&n].bound && h.check(&key.0));
        }
    }
    true
}

/// Whether opening `h` costs little: PBKDF2 of few iterations, little key material.
fn cheap(h: &Header) -> bool {
    h.meta.digest.iterations <= ITERATIONS_CHEAP
        && h.meta.keyslots.values().filter(|k| k.bound).all(|k| {
            matches!(k.kdf, super::json::SlotKdf::Pbkdf2 { iterations, .. } if iterations <= ITERATIONS_CHEAP)
                && k.key_bytes.saturating_mul(k.stripes as usize) <= MATERIAL_CHEAP
        })
}

/// Makes the checksums of the copy at 0 and of the one after it (at the size the first
/// says) again, with the algorithm each names.
fn reseal(image: &mut [u8]) {
    let Some(size) = image
        .get(8..16)
        .map(|b| u64::from_be_bytes(b.try_into().expect("8")))
    else {
        return;
    };
    if !super::HEADER_BYTES.contains(&size) {
        return;
    }
    for at in [0, size as usize] {
        let Some(copy) = image.get_mut(at..at + size as usize) else {
            return;
        };
        let name = &copy[72..104];
        let name = &name[..name.iter().position(|&c| c == 0).unwrap_or(name.len())];
        let Some(hash) = std::str::from_utf8(name).ok().and_then(Hash::parse) else {
            continue;
        };
        copy[448..448 + 64].fill(0);
        let mut csum = vec![0u8; hash.len()];
        hash.digest(&[&copy[..]], &mut csum);
        copy[448..448 + csum.len()].copy_from_slice(&csum);
    }
}

/// A header cairn makes with `kdf` for a 32-byte key (slot 0 opened by [`PASSPHRASE`]),
/// its digest made with one iteration, and the device's first 17 MiB.
fn made(kdf: Kdf, sector_bytes: u32) -> (Header, Vec<u8>) {
    let mut image = vec![0u8; 17 << 20];
    let limit = image.len();
    let mut write =
        |at: u64, b: &[u8]| write_image(&mut image, limit, at, b).map_err(CryptError::Invalid);
    let key = Secret((0..32u8).map(|i| i.wrapping_mul(41) ^ 0x5c).collect());
    let mut h = Header::create(&mut write, &key, PASSPHRASE, kdf, sector_bytes).expect("a header");
    let mut json = h.json.clone();
    let id = h.meta.digest_id.clone();
    let mut digest = [0u8; 32];
    Hash::Sha256.pbkdf2(&key.0, &h.meta.digest.salt, 1, &mut digest);
    json["digests"][&id]["iterations"] = json!(1);
    json["digests"][&id]["digest"] = json!(base64_encode(&digest));
    h.commit(&mut write, json).expect("a cheaper digest");
    (h, image)
}

fn with_flags(flags: u8, image: &[u8]) -> Vec<u8> {
    let mut out = vec![flags];
    out.extend_from_slice(image);
    out
}

/// Seeds: cairn-made headers (one with slot 0's key material, to be opened), an argon2
/// slot, two slots, the secondary copy alone, full string fields, damaged JSON.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let pbkdf2 = Kdf::Pbkdf2 {
        hash: Hash::Sha256,
        iterations: 1,
    };
    let (h, image) = made(pbkdf2, 512);
    let headers = 2 * h.header_bytes as usize;
    let slot = &h.meta.keyslots[&0];
    let material_end = (slot.area_offset + slot.area_bytes) as usize;
    let mut out = vec![
        (
            "valid-opens".to_string(),
            with_flags(UNLOCK, &image[..material_end]),
        ),
        ("valid-header".into(), with_flags(UNLOCK, &image[..headers])),
    ];
    let argon2 = Kdf::Argon2id {
        time: 1,
        memory_kib: 64,
        parallel: 1,
    };
    let (_, image2) = made(argon2, 4096);
    out.push(("valid-argon2".into(), with_flags(0, &image2[..headers])));
    let (mut two, mut image3) = made(pbkdf2, 4096);
    let key = Secret((0..32u8).map(|i| i.wrapping_mul(41) ^ 0x5c).collect());
    let limit = image3.len();
    two.add_slot(
        &mut |at, b| write_image(&mut image3, limit, at, b).map_err(CryptError::Invalid),
        &key,
        b"second",
        pbkdf2,
    )
    .expect("a second slot");
    out.push((
        "valid-two-slots".into(),
        with_flags(UNLOCK, &image3[..headers]),
    ));
    let mut secondary = image[..headers].to_vec();
    secondary[..4096].fill(0);
    out.push(("valid-secondary".into(), with_flags(0, &secondary)));
    let mut full = image[..headers].to_vec();
    full[24..24 + 48].fill(b'L');
    full[168..168 + 40].fill(b'u');
    out.push(("valid-full-strings".into(), with_flags(RESEAL, &full)));
    let mut json = image[..headers].to_vec();
    json[4096] = b'[';
    out.push(("damaged-json".into(), with_flags(RESEAL, &json)));
    out
}
