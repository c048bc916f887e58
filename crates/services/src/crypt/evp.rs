//! A queue's cipher: [`Xts`](super::xts::Xts)'s own VAES code where the CPU has VAES,
//! else AES-256-XTS through AWS-LC (which cairn links already, for TLS; its assembly uses
//! VAES and AVX-512 where the CPU has both, else AES-NI), about twice the speed of the
//! portable [`Xts`](super::xts::Xts). An AWS-LC context belongs to one queue (contexts
//! are not shared between threads); where AWS-LC refuses a key (two equal halves, which
//! FIPS forbids) or the key is AES-128, the portable cipher does the work.
//!
//! AWS-LC's XTS takes one sector per call, with its own tweak encryption each time: for
//! 512-byte sectors that call is what the VAES code, many sectors per call, saves.

use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::Arc;

use aws_lc_sys as ffi;

use super::xts::Xts;

/// One key's encrypt and decrypt contexts. Freeing them cleanses their key schedules.
struct Contexts {
    enc: NonNull<ffi::EVP_CIPHER_CTX>,
    dec: NonNull<ffi::EVP_CIPHER_CTX>,
}

// SAFETY: the contexts are owned by this value alone and used through `&mut self` only;
// moving them to another thread is what a queue opened there does.
unsafe impl Send for Contexts {}

impl Drop for Contexts {
    fn drop(&mut self) {
        // SAFETY: both were made by EVP_CIPHER_CTX_new and are freed once, here.
        unsafe {
            ffi::EVP_CIPHER_CTX_free(self.enc.as_ptr());
            ffi::EVP_CIPHER_CTX_free(self.dec.as_ptr());
        }
    }
}

impl Contexts {
    /// Contexts for a 64-byte key, or `None` where AWS-LC will not take it.
    fn new(key: &[u8]) -> Option<Contexts> {
        if key.len() != 64 {
            return None;
        }
        let make = |enc: c_int| {
            // SAFETY: a new context, initialised with a cipher, a key of the length the
            // cipher takes (64 bytes) and no IV yet; freed if that fails.
            unsafe {
                let ctx = NonNull::new(ffi::EVP_CIPHER_CTX_new())?;
                let ok = ffi::EVP_CipherInit_ex(
                    ctx.as_ptr(),
                    ffi::EVP_aes_256_xts(),
                    std::ptr::null_mut(),
                    key.as_ptr(),
                    std::ptr::null(),
                    enc,
                );
                if ok == 1 {
                    Some(ctx)
                } else {
                    ffi::EVP_CIPHER_CTX_free(ctx.as_ptr());
                    None
                }
            }
        };
        let enc = make(1)?;
        let Some(dec) = make(0) else {
            // SAFETY: made above, not used elsewhere.
            unsafe { ffi::EVP_CIPHER_CTX_free(enc.as_ptr()) };
            return None;
        };
        Some(Contexts { enc, dec })
    }

    /// Ciphers `len` bytes from `src` to `dst` (which may be the same) in sectors of
    /// `sector` bytes, IVs from `iv` counting 512-byte units. False if AWS-LC failed.
    fn run(
        &mut self,
        dst: *mut u8,
        src: *const u8,
        len: usize,
        sector: usize,
        mut iv: u64,
        encrypt: bool,
    ) -> bool {
        let ctx = if encrypt { self.enc } else { self.dec };
        let step = (sector / 512) as u64;
        let mut at = 0;
        while at < len {
            let mut tweak = [0u8; 16];
            tweak[..8].copy_from_slice(&iv.to_le_bytes());
            let mut out_len: c_int = 0;
            // SAFETY: the context holds its key; the IV is 16 bytes; `src` and `dst` are
            // valid for `len` bytes (the caller's promise), and `at + sector <= len`.
            let ok = unsafe {
                ffi::EVP_CipherInit_ex(
                    ctx.as_ptr(),
                    std::ptr::null(),
                    std::ptr::null_mut(),
                    std::ptr::null(),
                    tweak.as_ptr(),
                    -1,
                ) == 1
                    && ffi::EVP_CipherUpdate(
                        ctx.as_ptr(),
                        dst.add(at),
                        &mut out_len,
                        src.add(at),
                        sector as c_int,
                    ) == 1
            };
            if !ok || out_len as usize != sector {
                return false;
            }
            at += sector;
            // plain64 wraps at 2^64, as in the portable cipher.
            iv = iv.wrapping_add(step);
        }
        true
    }
}

/// A queue's cipher: the VAES one where the CPU has it, else AWS-LC's where it takes the
/// key, else the portable one.
pub struct Cipher {
    xts: Arc<Xts>,
    fast: std::cell::RefCell<Option<Contexts>>,
}

impl Cipher {
    /// The cipher of `xts` for one queue: `xts` itself if it has VAES, else with AWS-LC
    /// contexts for `key` where AWS-LC takes it (`fast`: false keeps `xts` alone, for
    /// comparisons).
    pub fn new(xts: Arc<Xts>, key: &[u8], fast: bool) -> Cipher {
        let aws_lc = fast && !xts.is_vaes();
        Cipher {
            fast: std::cell::RefCell::new(if aws_lc { Contexts::new(key) } else { None }),
            xts,
        }
    }

    /// Whether AWS-LC does the work.
    pub fn is_aws_lc(&self) -> bool {
        self.fast.borrow().is_some()
    }

    /// Encrypts or decrypts `data` in place (see [`Xts::run`]).
    pub fn run(&self, data: &mut [u8], sector: usize, iv: u64, encrypt: bool) {
        debug_assert!(data.len().is_multiple_of(sector));
        if let Some(c) = self.fast.borrow_mut().as_mut() {
            let p = data.as_mut_ptr();
            if c.run(p, p, data.len(), sector, iv, encrypt) {
                return;
            }
        }
        self.xts.run(data, sector, iv, encrypt);
    }

    /// Encrypts `src` into `dst` (see [`Xts::encrypt_from`]).
    pub fn encrypt_from(&self, src: &[u8], dst: &mut [u8], sector: usize, iv: u64) {
        debug_assert!(src.len() == dst.len() && src.len().is_multiple_of(sector));
        if let Some(c) = self.fast.borrow_mut().as_mut() {
            if c.run(dst.as_mut_ptr(), src.as_ptr(), src.len(), sector, iv, true) {
                return;
            }
        }
        self.xts.encrypt_from(src, dst, sector, iv);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use proptest::test_runner::Config;

    use super::*;

    /// AWS-LC's cipher for `key` (64 bytes, unequal halves).
    fn aws_lc(key: &[u8]) -> Cipher {
        let c = Cipher::new(Arc::new(Xts::portable(key).unwrap()), key, true);
        assert!(c.is_aws_lc(), "AWS-LC refused a good key");
        c
    }

    #[test]
    fn aws_lc_and_the_portable_cipher_agree() {
        let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
        let xts = Arc::new(Xts::portable(&key).unwrap());
        let fast = aws_lc(&key);
        let plain: Vec<u8> = (0..32768u32).map(|i| (i * 13 + i / 777) as u8).collect();
        for sector in [512, 4096] {
            let mut a = plain.clone();
            fast.run(&mut a, sector, 77, true);
            let mut b = plain.clone();
            xts.run(&mut b, sector, 77, true);
            assert_eq!(a, b, "{sector}: in place");
            let mut c = vec![0u8; plain.len()];
            fast.encrypt_from(&plain, &mut c, sector, 77);
            assert_eq!(c, b, "{sector}: out of place");
            fast.run(&mut a, sector, 77, false);
            assert_eq!(a, plain, "{sector}: decrypted");
        }
        // Across the IV's wrap at 2^64, too.
        let mut a = plain.clone();
        fast.run(&mut a, 512, u64::MAX - 3, true);
        let mut b = plain.clone();
        xts.run(&mut b, 512, u64::MAX - 3, true);
        assert_eq!(a, b, "across the wrap");
        // Equal halves: AWS-LC refuses them; the portable cipher still works.
        let same = [7u8; 64];
        let slow = Cipher::new(Arc::new(Xts::portable(&same).unwrap()), &same, true);
        assert!(!slow.is_aws_lc());
        let mut d = plain[..4096].to_vec();
        slow.run(&mut d, 4096, 0, true);
        slow.run(&mut d, 4096, 0, false);
        assert_eq!(d, plain[..4096]);
    }

    /// A queue's cipher on a CPU with VAES is the VAES one, for both key sizes and for
    /// keys AWS-LC refuses; elsewhere AWS-LC's for a 64-byte key.
    #[test]
    fn a_queue_takes_vaes_where_the_cpu_has_it() {
        for key in [vec![3u8; 32], vec![7u8; 64], (0..64).collect()] {
            let xts = Arc::new(Xts::new(&key).unwrap());
            let c = Cipher::new(xts.clone(), &key, true);
            if xts.is_vaes() {
                assert!(!c.is_aws_lc(), "{} bytes", key.len());
            } else {
                assert_eq!(c.is_aws_lc(), key.len() == 64 && key[0] != key[32]);
            }
        }
    }

    /// An IV anywhere, often within a few sectors of 2^64 (where plain64 wraps).
    fn iv() -> impl Strategy<Value = u64> {
        prop_oneof![
            any::<u64>(),
            (0..64u64).prop_map(|d| u64::MAX - d),
            0..64u64
        ]
    }

    proptest! {
        #![proptest_config(Config { cases: 256, failure_persistence: None, ..Config::default() })]

        /// The VAES cipher gives what AWS-LC gives and the portable cipher gives, for
        /// AES-256 keys, every LUKS sector size and 1 to 40 sectors per call, in place and
        /// out of place; and its decryption gives the plaintext back. On a CPU without
        /// VAES, `Xts::new` is the portable cipher and this compares it with AWS-LC.
        #[test]
        fn vaes_matches_aws_lc_and_the_portable_cipher(
            key in prop::collection::vec(any::<u8>(), 64),
            shift in 0..4u32,
            sectors in 1..=40usize,
            iv in iv(),
            seed in any::<u32>(),
        ) {
            prop_assume!(key[..32] != key[32..]);
            let sector = 512usize << shift;
            let plain: Vec<u8> = (0..sector * sectors)
                .map(|i| (i as u32).wrapping_mul(2654435761).wrapping_add(seed).to_le_bytes()[3])
                .collect();
            let vaes = Xts::new(&key).unwrap();
            let mut want = plain.clone();
            aws_lc(&key).run(&mut want, sector, iv, true);
            let mut portable = plain.clone();
            Xts::portable(&key).unwrap().run(&mut portable, sector, iv, true);
            prop_assert_eq!(&portable, &want, "portable against AWS-LC");
            let mut got = plain.clone();
            vaes.run(&mut got, sector, iv, true);
            prop_assert_eq!(&got, &want, "in place");
            let mut out = vec![0u8; plain.len()];
            vaes.encrypt_from(&plain, &mut out, sector, iv);
            prop_assert_eq!(&out, &want, "out of place");
            vaes.run(&mut got, sector, iv, false);
            prop_assert_eq!(&got, &plain, "decrypted");
        }

        /// The same for AES-128 keys (which AWS-LC's AES-256 context does not take),
        /// against the portable cipher, and for sectors of any whole number of pairs of
        /// blocks (a key slot's material is ciphered as one unit of its own length).
        #[test]
        fn vaes_matches_the_portable_cipher_for_aes_128_and_odd_sizes(
            key in prop::collection::vec(any::<u8>(), 32),
            wide in any::<bool>(),
            pairs in 1..=300usize,
            sectors in 1..=20usize,
            iv in iv(),
        ) {
            let key = if wide { [key.clone(), key.iter().map(|b| b ^ 0xa5).collect()].concat() } else { key };
            let sector = 32 * pairs;
            let plain: Vec<u8> = (0..sector * sectors).map(|i| (i * 31 + i / 511) as u8).collect();
            let mut want = plain.clone();
            Xts::portable(&key).unwrap().run(&mut want, sector, iv, true);
            let vaes = Xts::new(&key).unwrap();
            let mut got = plain.clone();
            vaes.run(&mut got, sector, iv, true);
            prop_assert_eq!(&got, &want, "encrypted");
            vaes.run(&mut got, sector, iv, false);
            prop_assert_eq!(&got, &plain, "decrypted");
        }
    }
}
