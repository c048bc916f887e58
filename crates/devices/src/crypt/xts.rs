//! AES-XTS with the plain64 IV, a sector at a time, as dm-crypt and LUKS use it.
//!
//! The key is two AES keys of equal length: the first ciphers the data, the second the
//! tweak (the sector's IV: its number as a little-endian u64 in 16 bytes). Each 16-byte
//! block `j` of a sector is `E(P xor T_j) xor T_j`, with `T_0 = E2(IV)` and `T_{j+1}` the
//! previous tweak times x in GF(2^128). The whole sector's blocks go to the cipher in one
//! call, so its wide implementations (AES-NI, VAES) work on many blocks at once.

use aes::cipher::{Array, BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};
use zeroize::Zeroize;

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
    pub fn new(key: &[u8]) -> Result<Xts, String> {
        let half = key.len() / 2;
        let pair = match key.len() {
            32 => Pair::Aes128(Box::new((
                aes::Aes128::new_from_slice(&key[..half]).map_err(|e| e.to_string())?,
                aes::Aes128::new_from_slice(&key[half..]).map_err(|e| e.to_string())?,
            ))),
            64 => Pair::Aes256(Box::new((
                aes::Aes256::new_from_slice(&key[..half]).map_err(|e| e.to_string())?,
                aes::Aes256::new_from_slice(&key[half..]).map_err(|e| e.to_string())?,
            ))),
            n => return Err(format!("an XTS key of {n} bytes (32 or 64 are)")),
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

    /// The first tweak of the sector whose IV is `iv`.
    fn tweak(&self, iv: u64) -> [u8; 16] {
        let mut t = Array::from([0u8; 16]);
        t[..8].copy_from_slice(&iv.to_le_bytes());
        match &self.pair {
            Pair::Aes128(p) => p.1.encrypt_block(&mut t),
            Pair::Aes256(p) => p.1.encrypt_block(&mut t),
        }
        t.into()
    }

    /// XORs each block of `data` with its tweak, starting from the sector's IV `iv`.
    fn whiten(&self, data: &mut [[u8; 16]], first: [u8; 16]) {
        let mut t = u128::from_le_bytes(first);
        for block in data {
            let b = u128::from_le_bytes(*block) ^ t;
            *block = b.to_le_bytes();
            // Times x: a shift left, with x^128 = x^7 + x^2 + x + 1.
            let carry = t >> 127;
            t = (t << 1) ^ (carry * 0x87);
        }
    }

    /// Encrypts `sector` (a whole number of 16-byte blocks) in place, its IV `iv`.
    pub fn encrypt(&self, sector: &mut [u8], iv: u64) {
        self.sector(sector, iv, true);
    }

    /// Decrypts `sector` in place, its IV `iv`.
    pub fn decrypt(&self, sector: &mut [u8], iv: u64) {
        self.sector(sector, iv, false);
    }

    fn sector(&self, sector: &mut [u8], iv: u64, encrypt: bool) {
        let (blocks, rest) = sector.as_chunks_mut::<16>();
        debug_assert!(rest.is_empty(), "a sector of whole blocks");
        let first = self.tweak(iv);
        self.whiten(blocks, first);
        let arrays = Array::cast_slice_from_core_mut(blocks);
        match (&self.pair, encrypt) {
            (Pair::Aes128(p), true) => p.0.encrypt_blocks(arrays),
            (Pair::Aes128(p), false) => p.0.decrypt_blocks(arrays),
            (Pair::Aes256(p), true) => p.0.encrypt_blocks(arrays),
            (Pair::Aes256(p), false) => p.0.decrypt_blocks(arrays),
        }
        self.whiten(blocks, first);
    }

    /// Encrypts or decrypts `data` (whole `sector`-byte sectors) whose first sector has
    /// IV `iv`, the IV counting 512-byte units (plain64, as LUKS uses it for any sector
    /// size).
    pub fn run(&self, data: &mut [u8], sector: usize, mut iv: u64, encrypt: bool) {
        for s in data.chunks_mut(sector) {
            self.sector(s, iv, encrypt);
            iv += (sector / 512) as u64;
        }
    }
}

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
}
