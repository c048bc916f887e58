//! The LUKS1 header's target: decoded, encoded and decoded again, and (when asked and
//! cheap enough) opened with a passphrase, its key material read from the input. The
//! LUKS2 target lives in `crypt::luks2::fuzz`, beside the private parts it uses.
//!
//! Input: flags, then the start of the device (the header, then key material).

use crate::crypt::luks1::{Header, HEADER_BYTES};
use crate::crypt::{CryptError, Hash, Kdf, Secret};
use cairn_core::fuzzing::{read_image, Input};

/// Flag: open the header with [`PASSPHRASE`] when its costs are small.
pub const UNLOCK: u8 = 2;
/// The passphrase of the seeds' first key slot.
pub const PASSPHRASE: &[u8] = b"fuzz";
/// Most PBKDF2 iterations and key material bytes a header may ask for to be opened by
/// the target (more would make it slow, not wrong).
const ITERATIONS_CHEAP: u32 = 64;
const MATERIAL_CHEAP: u64 = 1 << 20;

/// The LUKS1 target's body.
pub fn luks1(data: &[u8]) -> bool {
    let mut input = Input::new(data);
    let flags = input.u8();
    let image = input.rest();
    let h = match Header::decode(image) {
        Ok(h) => h,
        Err(e) => {
            assert!(
                !e.to_string().contains('\n'),
                "a refusal of more than one line: {e}"
            );
            return false;
        }
    };
    assert_eq!(Header::decode(&h.encode()).ok().as_ref(), Some(&h));
    let _ = (h.segment(), h.slot_list());
    let cheap = h.digest_iterations <= ITERATIONS_CHEAP
        && h.slots.iter().filter(|s| s.active).all(|s| {
            s.iterations <= ITERATIONS_CHEAP
                && u64::from(h.key_bytes) * u64::from(s.stripes) <= MATERIAL_CHEAP
        });
    if flags & UNLOCK != 0 && cheap {
        let mut read =
            |at: u64, buf: &mut [u8]| read_image(image, at, buf).map_err(CryptError::Invalid);
        if let Ok((slot, key)) = h.unlock(PASSPHRASE, &mut read) {
            assert!(h.slots[slot].active && h.check(&key.0));
        }
    }
    true
}

/// A header cairn makes for a key of `key_bytes` with `hash`, slot 0 opened by
/// [`PASSPHRASE`], every cost cut to one iteration; the device's first 3 MiB.
fn made(key_bytes: usize, hash: Hash, second_slot: bool) -> (Header, Vec<u8>) {
    let mut image = vec![0u8; 3 << 20];
    let mut write = |at: u64, b: &[u8]| {
        image[at as usize..at as usize + b.len()].copy_from_slice(b);
        Ok(())
    };
    let key = Secret((0..key_bytes as u8).map(|i| i.wrapping_mul(29)).collect());
    let kdf = Kdf::Pbkdf2 {
        hash,
        iterations: 1,
    };
    let mut h = Header::create(&mut write, &key, PASSPHRASE, kdf).expect("a header");
    // The digest again with one iteration, so that the target can afford to open it.
    h.digest_iterations = 1;
    hash.pbkdf2(&key.0, &h.digest_salt, 1, &mut h.digest);
    if second_slot {
        h.add_slot(&mut write, &key, b"second", kdf)
            .expect("a second slot");
    }
    write(0, &h.encode()).expect("the header");
    (h, image)
}

fn with_flags(flags: u8, image: &[u8]) -> Vec<u8> {
    let mut out = vec![flags];
    out.extend_from_slice(image);
    out
}

/// Seeds: cairn-made headers (with slot 0's key material, to be opened), a full UUID
/// field, two slots, and damaged slots and magic.
pub fn luks1_seeds() -> Vec<(String, Vec<u8>)> {
    let (h, image) = made(32, Hash::Sha256, false);
    let material_end = (h.slots[0].material_sector as usize + 250) * 512;
    let mut out = vec![
        (
            "valid-sha256-opens".to_string(),
            with_flags(UNLOCK, &image[..material_end]),
        ),
        (
            "valid-sha256-header".into(),
            with_flags(UNLOCK, &image[..HEADER_BYTES]),
        ),
    ];
    let (_, sha1) = made(64, Hash::Sha1, false);
    out.push(("valid-sha1-64".into(), with_flags(0, &sha1[..HEADER_BYTES])));
    let (_, two) = made(64, Hash::Sha512, true);
    out.push((
        "valid-two-slots".into(),
        with_flags(UNLOCK, &two[..HEADER_BYTES]),
    ));
    let mut full = image[..HEADER_BYTES].to_vec();
    full[168..208].fill(b'7');
    out.push(("valid-uuid-full".into(), with_flags(0, &full)));
    let mut overlap = h.clone();
    overlap.slots[3].material_sector = overlap.slots[2].material_sector + 3;
    out.push(("damaged-overlap".into(), with_flags(0, &overlap.encode())));
    let mut magic = image[..HEADER_BYTES].to_vec();
    magic[3] = b'X';
    out.push(("damaged-magic".into(), with_flags(0, &magic)));
    out
}

/// The LUKS2 target's body (it lives in `crypt::luks2::fuzz`, beside the private parts
/// it uses).
pub use crate::crypt::luks2::fuzz::header as luks2_header;
/// The LUKS2 target's seeds.
pub use crate::crypt::luks2::fuzz::seeds as luks2_seeds;
