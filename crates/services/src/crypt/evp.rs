//! AES-256-XTS through AWS-LC (which cairn links already, for TLS): its assembly uses
//! VAES and AVX-512 where the CPU has them, about twice the speed of the portable
//! [`Xts`](super::xts::Xts) here. A context belongs to one queue (contexts are not
//! shared between threads); where AWS-LC refuses a key (two equal halves, which FIPS
//! forbids) or the key is AES-128, the portable cipher does the work.

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

/// A queue's cipher: AWS-LC's where it takes the key, else the portable one.
pub struct Cipher {
    xts: Arc<Xts>,
    fast: std::cell::RefCell<Option<Contexts>>,
}

impl Cipher {
    /// The cipher of `xts` for one queue, with AWS-LC contexts for `key` where it takes
    /// it (`fast`: false keeps the portable cipher, for comparisons).
    pub fn new(xts: Arc<Xts>, key: &[u8], fast: bool) -> Cipher {
        Cipher {
            fast: std::cell::RefCell::new(if fast { Contexts::new(key) } else { None }),
            xts,
        }
    }

    /// Whether AWS-LC does the work.
    pub fn is_fast(&self) -> bool {
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
    use super::*;

    #[test]
    fn aws_lc_and_the_portable_cipher_agree() {
        let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
        let xts = Arc::new(Xts::new(&key).unwrap());
        let fast = Cipher::new(xts.clone(), &key, true);
        assert!(fast.is_fast(), "AWS-LC refused a good key");
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
        let slow = Cipher::new(Arc::new(Xts::new(&same).unwrap()), &same, true);
        let mut d = plain[..4096].to_vec();
        slow.run(&mut d, 4096, 0, true);
        slow.run(&mut d, 4096, 0, false);
        assert_eq!(d, plain[..4096]);
    }
}
