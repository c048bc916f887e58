//! AES-XTS with the plain64 IV, a sector at a time, as dm-crypt and LUKS use it.
//!
//! The key is two AES keys of equal length: the first ciphers the data, the second the
//! tweak (the sector's IV: its number as a little-endian u64 in 16 bytes). Each 16-byte
//! block `j` of a sector is `E(P xor T_j) xor T_j`, with `T_0 = E2(IV)` and `T_{j+1}` the
//! previous tweak times x in GF(2^128). Up to 16 KiB of sectors go to the cipher in one
//! call (their first tweaks too), so its wide implementations (AES-NI, VAES) work on many
//! blocks at once whatever the sector size.

use aes::cipher::{Array, BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};
use zeroize::Zeroize;

use super::error::CryptError;

/// One AES key size's pair of ciphers (boxed: their round keys are large; `aes` zeroes
/// them when dropped).
enum Pair {
    Aes128(Box<(aes::Aes128, aes::Aes128)>),
    Aes256(Box<(aes::Aes256, aes::Aes256)>),
}

/// AES-XTS under one key.
pub struct Xts {
    pair: Pair,
}

/// Bytes of an XTS key for AES-128 and AES-256.
pub const KEY_BYTES: [usize; 2] = [32, 64];

impl Xts {
    /// The cipher for `key` (32 bytes: AES-128-XTS; 64: AES-256-XTS).
    pub fn new(key: &[u8]) -> Result<Xts, CryptError> {
        let bad = |e: aes::cipher::InvalidLength| CryptError::Invalid(e.to_string());
        let half = key.len() / 2;
        let pair = match key.len() {
            32 => Pair::Aes128(Box::new((
                aes::Aes128::new_from_slice(&key[..half]).map_err(bad)?,
                aes::Aes128::new_from_slice(&key[half..]).map_err(bad)?,
            ))),
            64 => Pair::Aes256(Box::new((
                aes::Aes256::new_from_slice(&key[..half]).map_err(bad)?,
                aes::Aes256::new_from_slice(&key[half..]).map_err(bad)?,
            ))),
            n => {
                return Err(CryptError::Invalid(format!(
                    "an XTS key of {n} bytes (32 or 64 are)"
                )))
            }
        };
        Ok(Xts { pair })
    }

    /// Bits of its key (both halves, as LUKS counts them): 256 or 512.
    pub fn key_bits(&self) -> u32 {
        match self.pair {
            Pair::Aes128(_) => 256,
            Pair::Aes256(_) => 512,
        }
    }

    /// The first tweaks of `n` sectors whose IVs count from `iv` in steps of `step`, all
    /// in one call to the tweak cipher.
    fn tweaks(&self, out: &mut [[u8; 16]], mut iv: u64, step: u64) {
        for t in out.iter_mut() {
            *t = [0; 16];
            t[..8].copy_from_slice(&iv.to_le_bytes());
            // plain64 is the sector number modulo 2^64, as dm-crypt computes it: a LUKS2
            // header's iv_tweak may start it anywhere.
            iv = iv.wrapping_add(step);
        }
        let blocks = Array::cast_slice_from_core_mut(out);
        match &self.pair {
            Pair::Aes128(p) => p.1.encrypt_blocks(blocks),
            Pair::Aes256(p) => p.1.encrypt_blocks(blocks),
        }
    }

    /// XORs each block of `dst` (from `src`, when given) with its tweak: the sectors of
    /// `sector` bytes each start from their tweak in `first`.
    fn whiten(dst: &mut [[u8; 16]], src: Option<&[[u8; 16]]>, sector: usize, first: &[[u8; 16]]) {
        let per = sector / 16;
        for (k, t0) in first.iter().enumerate() {
            let mut t = u128::from_le_bytes(*t0);
            let range = k * per..(k + 1) * per;
            let d = &mut dst[range.clone()];
            let mut step = |block: &mut [u8; 16], from: [u8; 16]| {
                *block = (u128::from_le_bytes(from) ^ t).to_le_bytes();
                // Times x: a shift left, with x^128 = x^7 + x^2 + x + 1.
                let carry = t >> 127;
                t = (t << 1) ^ (carry * 0x87);
            };
            match src {
                Some(src) => {
                    for (block, from) in d.iter_mut().zip(&src[range]) {
                        step(block, *from);
                    }
                }
                None => {
                    for block in d.iter_mut() {
                        let from = *block;
                        step(block, from);
                    }
                }
            }
        }
    }

    /// Ciphers `dst` (whole `sector`-byte sectors, taken from `src` when given, else in
    /// place), its first sector's IV `iv`, the IV counting 512-byte units (plain64, as
    /// LUKS uses it for any sector size). Up to [`BATCH_BYTES`] go to the cipher at once,
    /// their tweaks computed together.
    fn cipher(
        &self,
        dst: &mut [u8],
        src: Option<&[u8]>,
        sector: usize,
        mut iv: u64,
        encrypt: bool,
    ) {
        let step = (sector / 512) as u64;
        let mut first = [[0u8; 16]; BATCH_BYTES / 512];
        let batch = (BATCH_BYTES / sector).clamp(1, first.len()) * sector;
        let (dst, rest) = dst.as_chunks_mut::<16>();
        debug_assert!(rest.is_empty() && (dst.len() * 16).is_multiple_of(sector));
        let src = src.map(|s| s.as_chunks::<16>().0);
        for (i, d) in dst.chunks_mut(batch / 16).enumerate() {
            let n = d.len() * 16 / sector;
            let first = &mut first[..n];
            self.tweaks(first, iv, step);
            iv = iv.wrapping_add(step * n as u64);
            let from = src.map(|s| &s[i * batch / 16..][..d.len()]);
            Self::whiten(d, from, sector, first);
            let blocks = Array::cast_slice_from_core_mut(d);
            match (&self.pair, encrypt) {
                (Pair::Aes128(p), true) => p.0.encrypt_blocks(blocks),
                (Pair::Aes128(p), false) => p.0.decrypt_blocks(blocks),
                (Pair::Aes256(p), true) => p.0.encrypt_blocks(blocks),
                (Pair::Aes256(p), false) => p.0.decrypt_blocks(blocks),
            }
            Self::whiten(d, None, sector, first);
        }
    }

    /// Encrypts `sector` (a whole number of 16-byte blocks) in place, its IV `iv`.
    pub fn encrypt(&self, sector: &mut [u8], iv: u64) {
        self.cipher(sector, None, sector.len(), iv, true);
    }

    /// Decrypts `sector` in place, its IV `iv`.
    pub fn decrypt(&self, sector: &mut [u8], iv: u64) {
        self.cipher(sector, None, sector.len(), iv, false);
    }

    /// Encrypts or decrypts `data` (whole `sector`-byte sectors) in place, its first
    /// sector's IV `iv` (plain64: counting 512-byte units whatever the sector size).
    pub fn run(&self, data: &mut [u8], sector: usize, iv: u64, encrypt: bool) {
        self.cipher(data, None, sector, iv, encrypt);
    }

    /// Encrypts `src` into `dst` (of the same length), as [`Xts::run`]: the plaintext is
    /// read once, never changed.
    pub fn encrypt_from(&self, src: &[u8], dst: &mut [u8], sector: usize, iv: u64) {
        debug_assert_eq!(src.len(), dst.len());
        self.cipher(dst, Some(src), sector, iv, true);
    }
}

/// Bytes ciphered in one call: their three passes (whiten, cipher, whiten) stay in the
/// core's first-level caches.
const BATCH_BYTES: usize = 16 << 10;

/// Zeroes a key held in a `Vec` when dropped.
pub struct Secret(pub Vec<u8>);

impl Drop for Secret {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// IEEE 1619-2007 XTS-AES test vectors 1 (AES-128, all-zero keys and data) and 10
    /// (AES-256, a 512-byte sector): the published ciphertexts' first bytes.
    #[test]
    fn the_standards_vectors() {
        let x = Xts::new(&[0u8; 32]).unwrap();
        let mut data = [0u8; 32];
        x.encrypt(&mut data, 0);
        assert_eq!(
            data.to_vec(),
            hex("917cf69ebd68b2ec9b9fe9a3eadda692cd43d2f59598ed858c02c2652fbf922e")
        );
        x.decrypt(&mut data, 0);
        assert_eq!(data, [0u8; 32]);
        let key = hex(
            "2718281828459045235360287471352662497757247093699959574966967627\
             3141592653589793238462643383279502884197169399375105820974944592",
        );
        let x = Xts::new(&key).unwrap();
        let mut sector: Vec<u8> = (0..512).map(|i| i as u8).collect();
        x.encrypt(&mut sector, 0xff);
        assert_eq!(
            sector[..16].to_vec(),
            hex("1c3b3a102f770386e4836c99e370cf9b")
        );
        x.decrypt(&mut sector, 0xff);
        assert!(sector.iter().enumerate().all(|(i, &b)| b == i as u8));
    }

    #[test]
    fn sectors_cipher_apart_and_iv_counts_512_byte_units() {
        let x = Xts::new(&[7u8; 64]).unwrap();
        let mut a = vec![0x5au8; 8192];
        x.run(&mut a, 4096, 8, true);
        assert_ne!(a[..4096], a[4096..], "the same data at two sectors");
        // The second 4096-byte sector has IV 8 + 8.
        let mut b = vec![0x5au8; 4096];
        x.encrypt(&mut b, 16);
        assert_eq!(b[..], a[4096..]);
        x.run(&mut a, 4096, 8, false);
        assert!(a.iter().all(|&v| v == 0x5a));
    }

    /// The IV wraps at 2^64 as dm-crypt's plain64 does (a LUKS2 header's iv_tweak may
    /// start it anywhere); it used to overflow, a panic in a debug build.
    #[test]
    fn the_iv_wraps_past_its_largest_value() {
        let x = Xts::new(&[9u8; 64]).unwrap();
        let plain: Vec<u8> = (0..4096u32).map(|i| (i * 5) as u8).collect();
        for sector in [512usize, 4096] {
            let mut whole = plain.clone();
            let first = u64::MAX - (sector / 512) as u64 + 1;
            x.run(&mut whole, sector, first, true);
            for (k, s) in plain.chunks(sector).enumerate() {
                let mut one = s.to_vec();
                x.encrypt(&mut one, first.wrapping_add((k * sector / 512) as u64));
                assert_eq!(
                    one[..],
                    whole[k * sector..(k + 1) * sector],
                    "{sector}: {k}"
                );
            }
        }
    }

    #[test]
    fn batches_across_sectors_match_one_sector_at_a_time() {
        let x = Xts::new(&[3u8; 64]).unwrap();
        let plain: Vec<u8> = (0..40960u32).map(|i| (i * 7 + i / 300) as u8).collect();
        for sector in [512usize, 4096] {
            let mut whole = plain.clone();
            x.run(&mut whole, sector, 5, true);
            let mut out = vec![0u8; plain.len()];
            x.encrypt_from(&plain, &mut out, sector, 5);
            assert_eq!(out, whole, "{sector}: out of place");
            for (k, s) in plain.chunks(sector).enumerate() {
                let mut one = s.to_vec();
                x.encrypt(&mut one, 5 + (k * sector / 512) as u64);
                assert_eq!(
                    one[..],
                    whole[k * sector..(k + 1) * sector],
                    "{sector}: sector {k}"
                );
            }
            x.run(&mut whole, sector, 5, false);
            assert_eq!(whole, plain);
        }
    }
}
