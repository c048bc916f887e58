//! Encryption at rest: the `crypt` device over LUKS1 and LUKS2 headers, AES-XTS.
//!
//! [`xts`] ciphers sectors (with VAES where the CPU has it, in `vaes`); [`luks1`] and [`luks2`] read, make and change the headers
//! (key slots, the volume key's digest, where the data starts); what they share is here.
//! [`error`] says what can go wrong ([`CryptError`]); [`counters`] what a device counts.

pub mod counters;
pub mod device;
pub mod error;
pub mod evp;
pub mod kdf;
pub mod luks1;
pub mod luks2;
mod queue;
#[cfg(target_arch = "x86_64")]
mod vaes;
#[cfg(not(target_arch = "x86_64"))]
#[path = "vaes_other.rs"]
mod vaes;
pub mod volume;
pub mod xts;

pub use error::CryptError;
pub use kdf::SlotKey;
pub use luks1::Hash;
pub use xts::Secret;

/// Reads bytes at an offset of the device holding the header.
pub type ReadAt<'a> = dyn FnMut(u64, &mut [u8]) -> Result<(), CryptError> + 'a;

/// Writes bytes at an offset of the device holding the header.
pub type WriteAt<'a> = dyn FnMut(u64, &[u8]) -> Result<(), CryptError> + 'a;

/// How a key slot turns a passphrase into the key that ciphers its key material.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kdf {
    /// PBKDF2 with HMAC of `hash` (LUKS1 and LUKS2).
    Pbkdf2 {
        /// The hash.
        hash: Hash,
        /// Iterations.
        iterations: u32,
    },
    /// Argon2id (LUKS2 only).
    Argon2id {
        /// Passes over the memory (`time` in LUKS2's JSON).
        time: u32,
        /// Memory in KiB.
        memory_kib: u32,
        /// Lanes (`cpus`).
        parallel: u32,
    },
    /// Argon2i (LUKS2 only; cryptsetup's `--pbkdf argon2i`).
    Argon2i {
        /// Passes over the memory.
        time: u32,
        /// Memory in KiB.
        memory_kib: u32,
        /// Lanes.
        parallel: u32,
    },
}

impl Kdf {
    /// cairn's default for new LUKS2 key slots: argon2id over 1 GiB, 4 passes, 4 lanes
    /// (about cryptsetup's benchmarked choice on a current machine; a few seconds to
    /// open on two cores).
    pub const DEFAULT_ARGON2ID: Kdf = Kdf::Argon2id {
        time: 4,
        memory_kib: 1 << 20,
        parallel: 4,
    };
    /// cairn's default for new LUKS1 key slots: PBKDF2-SHA256, 1,000,000 iterations.
    pub const DEFAULT_PBKDF2: Kdf = Kdf::Pbkdf2 {
        hash: Hash::Sha256,
        iterations: 1_000_000,
    };
}

impl std::fmt::Display for Kdf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kdf::Pbkdf2 { hash, iterations } => {
                write!(f, "pbkdf2 ({}, {iterations} iterations)", hash.name())
            }
            Kdf::Argon2id {
                time,
                memory_kib,
                parallel,
            } => write!(
                f,
                "argon2id (time {time}, memory {memory_kib} KiB, {parallel} lanes)"
            ),
            Kdf::Argon2i {
                time,
                memory_kib,
                parallel,
            } => write!(
                f,
                "argon2i (time {time}, memory {memory_kib} KiB, {parallel} lanes)"
            ),
        }
    }
}

/// Where the encrypted data lies and how it is ciphered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Byte offset of the first data sector on the base device.
    pub offset: u64,
    /// Bytes of data, or `None`: up to the end of the base ("dynamic").
    pub size: Option<u64>,
    /// Bytes per encryption sector: 512 or 4096.
    pub sector_bytes: u32,
    /// The IV of the first data sector (plain64 counts 512-byte units from it).
    pub iv_tweak: u64,
}

/// One key slot, as the admin lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    /// Its number.
    pub index: usize,
    /// How it derives its key.
    pub kdf: Kdf,
}

/// `msg` with its control characters escaped: a refusal quotes strings read from a
/// header (a cipher, a hash, a JSON name), which may hold a newline, and is one line.
pub(crate) fn one_line(msg: String) -> String {
    if !msg.chars().any(char::is_control) {
        return msg;
    }
    msg.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Fills `buf` with random bytes from the kernel.
pub fn random(buf: &mut [u8]) -> Result<(), CryptError> {
    let mut filled = 0;
    while filled < buf.len() {
        match rustix::rand::getrandom(&mut buf[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(CryptError::Random(e)),
        }
    }
    Ok(())
}

/// A new random (version 4) UUID as text.
pub fn uuid() -> Result<String, CryptError> {
    let mut b = [0u8; 16];
    random(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        h[..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..].concat()
    ))
}
