//! AES-XTS with the plain64 IV, a sector at a time, as dm-crypt and LUKS use it.
//!
//! The key is two AES keys of equal length: the first ciphers the data, the second the
//! tweak (the sector's IV: its number as a little-endian u64 in 16 bytes). Each 16-byte
//! block `j` of a sector is `E(P xor T_j) xor T_j`, with `T_0 = E2(IV)` and `T_{j+1}` the
//! previous tweak times x in GF(2^128). Up to 16 KiB of sectors go to the cipher in one
//! call (their first tweaks too), so its wide implementations (AES-NI, VAES) work on many
//! blocks at once whatever the sector size. Where the CPU has VAES, VPCLMULQDQ and AVX2,
//! the sectors go to cairn's own VAES XTS instead (`vaes`: whitening and rounds in one
//! pass, 16 blocks in flight), which is several times faster than RustCrypto's blocks
//! with the XOR passes here.

use aes::cipher::{Array, BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};
use zeroize::Zeroize;

use super::error::CryptError;
use super::vaes::Vaes;

/// One AES key size's pair of ciphers (boxed: their round keys are large; `aes` zeroes
/// them when dropped).
enum Pair {
    Aes128(Box<(aes::Aes128, aes::Aes128)>),
    Aes256(Box<(aes::Aes256, aes::Aes256)>),
}

/// AES-XTS under one key.
pub struct Xts {
    pair: Pair,
    /// The VAES cipher for the same key, where the CPU has it: it does the work for
    /// sectors of a whole number of 32-byte pairs of blocks.
    vaes: Option<Vaes>,
}

/// Bytes of an XTS key for AES-128 and AES-256.
pub const KEY_BYTES: [usize; 2] = [32, 64];

impl Xts {
    /// The cipher for `key` (32 bytes: AES-128-XTS; 64: AES-256-XTS): VAES where the CPU
    /// has it, else the portable one.
    pub fn new(key: &[u8]) -> Result<Xts, CryptError> {
        let mut xts = Self::portable(key)?;
        xts.vaes = Vaes::new(key);
        Ok(xts)
    }

    /// The cipher for `key` without VAES whatever the CPU (RustCrypto's `aes` for the
    /// blocks): what a CPU without VAES runs, kept for comparisons and tests.
    pub fn portable(key: &[u8]) -> Result<Xts, CryptError> {
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
        Ok(Xts { pair, vaes: None })
    }

    /// Whether the VAES cipher does the work (for sectors of a whole number of pairs of
    /// blocks, as every LUKS sector size is).
    pub fn is_vaes(&self) -> bool {
        self.vaes.is_some()
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
        if let Some(v) = self.vaes.as_ref().filter(|_| Vaes::takes(sector)) {
            v.run(dst, src, sector, iv, step, encrypt);
            return;
        }
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

    /// Data units of 512 bytes in IEEE 1619's vectors 4 to 14: bytes 0 to 255, twice.
    fn pattern() -> Vec<u8> {
        (0..512).map(|i| i as u8).collect()
    }

    /// One of IEEE 1619's vectors: key 1 then key 2, the data unit sequence number, the
    /// plaintext, the ciphertext.
    type Vector = (Vec<u8>, u64, Vec<u8>, Vec<u8>);

    /// IEEE 1619-2007 (Annex B) XTS-AES test vectors, the values copied from its tables.
    fn the_standards_table() -> Vec<Vector> {
        vec![
            // Vector 1: XTS-AES-128, zero keys, unit 0, 32 zero bytes.
            (
                vec![0; 32],
                0,
                vec![0; 32],
                hex("917cf69ebd68b2ec9b9fe9a3eadda692cd43d2f59598ed858c02c2652fbf922e"),
            ),
            // Vector 2.
            (
                hex("1111111111111111111111111111111122222222222222222222222222222222"),
                0x3333333333,
                vec![0x44; 32],
                hex("c454185e6a16936e39334038acef838bfb186fff7480adc4289382ecd6d394f0"),
            ),
            // Vector 3.
            (
                hex("fffefdfcfbfaf9f8f7f6f5f4f3f2f1f022222222222222222222222222222222"),
                0x3333333333,
                vec![0x44; 32],
                hex("af85336b597afc1a900b2eb21ec949d292df4c047e0b21532186a5971a227a89"),
            ),
            // Vector 4: XTS-AES-128, a 512-byte unit.
            (
                hex("2718281828459045235360287471352631415926535897932384626433832795"),
                0,
                pattern(),
                hex(
                    "27a7479befa1d476489f308cd4cfa6e2a96e4bbe3208ff25287dd3819616e89c\
                     c78cf7f5e543445f8333d8fa7f56000005279fa5d8b5e4ad40e736ddb4d35412\
                     328063fd2aab53e5ea1e0a9f332500a5df9487d07a5c92cc512c8866c7e860ce\
                     93fdf166a24912b422976146ae20ce846bb7dc9ba94a767aaef20c0d61ad0265\
                     5ea92dc4c4e41a8952c651d33174be51a10c421110e6d81588ede82103a252d8\
                     a750e8768defffed9122810aaeb99f9172af82b604dc4b8e51bcb08235a6f434\
                     1332e4ca60482a4ba1a03b3e65008fc5da76b70bf1690db4eae29c5f1badd03c\
                     5ccf2a55d705ddcd86d449511ceb7ec30bf12b1fa35b913f9f747a8afd1b130e\
                     94bff94effd01a91735ca1726acd0b197c4e5b03393697e126826fb6bbde8ecc\
                     1e08298516e2c9ed03ff3c1b7860f6de76d4cecd94c8119855ef5297ca67e9f3\
                     e7ff72b1e99785ca0a7e7720c5b36dc6d72cac9574c8cbbc2f801e23e56fd344\
                     b07f22154beba0f08ce8891e643ed995c94d9a69c9f1b5f499027a78572aeebd\
                     74d20cc39881c213ee770b1010e4bea718846977ae119f7a023ab58cca0ad752\
                     afe656bb3c17256a9f6e9bf19fdd5a38fc82bbe872c5539edb609ef4f79c203e\
                     bb140f2e583cb2ad15b4aa5b655016a8449277dbd477ef2c8d6c017db738b18d\
                     eb4a427d1923ce3ff262735779a418f20a282df920147beabe421ee5319d0568",
                ),
            ),
            // Vector 10: XTS-AES-256, a 512-byte unit, unit number 0xff.
            (
                hex(
                    "2718281828459045235360287471352662497757247093699959574966967627\
                     3141592653589793238462643383279502884197169399375105820974944592",
                ),
                0xff,
                pattern(),
                hex(
                    "1c3b3a102f770386e4836c99e370cf9bea00803f5e482357a4ae12d414a3e63b\
                     5d31e276f8fe4a8d66b317f9ac683f44680a86ac35adfc3345befecb4bb188fd\
                     5776926c49a3095eb108fd1098baec70aaa66999a72a82f27d848b21d4a741b0\
                     c5cd4d5fff9dac89aeba122961d03a757123e9870f8acf1000020887891429ca\
                     2a3e7a7d7df7b10355165c8b9a6d0a7de8b062c4500dc4cd120c0f7418dae3d0\
                     b5781c34803fa75421c790dfe1de1834f280d7667b327f6c8cd7557e12ac3a0f\
                     93ec05c52e0493ef31a12d3d9260f79a289d6a379bc70c50841473d1a8cc81ec\
                     583e9645e07b8d9670655ba5bbcfecc6dc3966380ad8fecb17b6ba02469a020a\
                     84e18e8f84252070c13e9f1f289be54fbc481457778f616015e1327a02b140f1\
                     505eb309326d68378f8374595c849d84f4c333ec4423885143cb47bd71c5edae\
                     9be69a2ffeceb1bec9de244fbe15992b11b77c040f12bd8f6a975a44a0f90c29\
                     a9abc3d4d893927284c58754cce294529f8614dcd2aba991925fedc4ae74ffac\
                     6e333b93eb4aff0479da9a410e4450e0dd7ae4c6e2910900575da401fc07059f\
                     645e8b7e9bfdef33943054ff84011493c27b3429eaedb4ed5376441a77ed4385\
                     1ad77f16f541dfd269d50d6a5f14fb0aab1cbb4c1550be97f7ab4066193c4caa\
                     773dad38014bd2092fa755c824bb5e54c4f36ffda9fcea70b9c6e693e148c151",
                ),
            ),
        ]
    }

    /// IEEE 1619's vectors 1 to 4 (AES-128) and 10 (AES-256), whole, each way, through
    /// the cipher this CPU gets (VAES where it has it) and the portable one.
    #[test]
    fn the_standards_vectors() {
        for (n, (key, unit, plain, cipher)) in the_standards_table().into_iter().enumerate() {
            for x in [Xts::new(&key).unwrap(), Xts::portable(&key).unwrap()] {
                let what = format!("vector {n} ({} bytes), vaes {}", plain.len(), x.is_vaes());
                let mut data = plain.clone();
                x.encrypt(&mut data, unit);
                assert_eq!(data, cipher, "{what}: encrypted");
                x.decrypt(&mut data, unit);
                assert_eq!(data, plain, "{what}: decrypted");
                let mut out = vec![0u8; plain.len()];
                x.encrypt_from(&plain, &mut out, plain.len(), unit);
                assert_eq!(out, cipher, "{what}: out of place");
            }
        }
    }

    /// The test above runs the VAES cipher on a CPU that has it; it says so, so that a
    /// run on such a CPU cannot pass without it.
    #[test]
    fn this_cpu_gets_vaes_where_it_has_it() {
        let x = Xts::new(&[1u8; 64]).unwrap();
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            x.is_vaes(),
            std::arch::is_x86_feature_detected!("vaes")
                && std::arch::is_x86_feature_detected!("vpclmulqdq")
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("aes")
        );
        assert!(!Xts::portable(&[1u8; 64]).unwrap().is_vaes());
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
