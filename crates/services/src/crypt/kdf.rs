//! Key derivation for key slots: turning a passphrase into the key of a slot's material
//! (PBKDF2 or argon2), ahead of the header change that adds the slot, and an estimate of
//! what a derivation costs on this machine before anyone pays it.
//!
//! Adding a key slot is slow only here: the derivation takes as long as its parameters
//! say (seconds by design, hours if they are absurd), while writing the slot takes
//! milliseconds. So a [`SlotKey`] is derived first, with no device held, and handed to
//! the header change; and [`check_cost`] refuses up front a derivation that would take
//! longer than [`NEW_SLOT_SECONDS_MAX`], from a calibration of a few milliseconds.
//!
//! Not here: opening a slot (the header's own parameters, paid when the volume opens).

use std::sync::Mutex;

use super::error::CryptError;
use super::{Hash, Kdf, Secret};

/// Longest a new key slot's derivation may be estimated to take, in seconds. The
/// defaults take about 2 s (argon2id over 1 GiB, 4 passes) and under 1 s (PBKDF2-SHA256,
/// 1,000,000 iterations) on a current 2-core machine.
pub const NEW_SLOT_SECONDS_MAX: f64 = 60.0;

/// Bytes of the salt of a slot cairn makes.
pub const SALT_BYTES: usize = 32;

/// A new key slot's key, derived from its passphrase with `kdf` and a fresh salt.
pub struct SlotKey {
    /// How it was derived (for LUKS1, PBKDF2 with the header's hash).
    pub kdf: Kdf,
    /// The salt it was derived with.
    pub salt: [u8; SALT_BYTES],
    /// The key that ciphers the slot's material.
    pub key: Secret,
}

impl SlotKey {
    /// Derives a key of `len` bytes from `passphrase` with `kdf` and a new random salt:
    /// as long as `kdf` says.
    pub fn derive(kdf: Kdf, passphrase: &[u8], len: usize) -> Result<SlotKey, CryptError> {
        let mut salt = [0u8; SALT_BYTES];
        super::random(&mut salt)?;
        let key = derive(kdf, passphrase, &salt, len)?;
        Ok(SlotKey { kdf, salt, key })
    }
}

impl std::fmt::Debug for SlotKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SlotKey({}, {:?})", self.kdf, self.key)
    }
}

/// The key of `len` bytes `kdf` derives from `passphrase` with `salt`.
pub fn derive(kdf: Kdf, passphrase: &[u8], salt: &[u8], len: usize) -> Result<Secret, CryptError> {
    let mut key = Secret(vec![0u8; len]);
    let (algorithm, time, memory_kib, lanes) = match kdf {
        Kdf::Pbkdf2 { hash, iterations } => {
            hash.pbkdf2(passphrase, salt, iterations, &mut key.0);
            return Ok(key);
        }
        Kdf::Argon2id {
            time,
            memory_kib,
            parallel,
        } => (argon2::Algorithm::Argon2id, time, memory_kib, parallel),
        Kdf::Argon2i {
            time,
            memory_kib,
            parallel,
        } => (argon2::Algorithm::Argon2i, time, memory_kib, parallel),
    };
    let params = argon2::Params::new(memory_kib, time, lanes, Some(len)).map_err(|error| {
        CryptError::Argon2 {
            doing: "argon2 parameters",
            error,
        }
    })?;
    let argon = argon2::Argon2::new(algorithm, argon2::Version::V0x13, params);
    // The lanes run on rayon's threads, started at the first use: with this thread's
    // signals blocked they inherit the mask, so a SIGTERM meant for `cairn serve` never
    // lands on one (and kills the process by default).
    cairn_core::reactor::with_signals_blocked(|| {
        argon.hash_password_into(passphrase, salt, &mut key.0)
    })
    .map_err(|error| CryptError::Argon2 {
        doing: "argon2",
        error,
    })?;
    Ok(key)
}

/// Refuses a derivation of a `len`-byte key with `kdf` estimated to take longer than
/// [`NEW_SLOT_SECONDS_MAX`] here; returns the estimate in seconds.
pub fn check_cost(kdf: Kdf, len: usize) -> Result<f64, CryptError> {
    let seconds = estimate_seconds(kdf, len);
    if seconds > NEW_SLOT_SECONDS_MAX {
        return Err(CryptError::Invalid(format!(
            "{kdf} would take about {} here, more than the {NEW_SLOT_SECONDS_MAX:.0} s a new \
             key slot may: choose fewer iterations or less memory",
            shown_seconds(seconds)
        )));
    }
    Ok(seconds)
}

/// `12 s`, `3 h`: an estimate, rounded.
fn shown_seconds(s: f64) -> String {
    if s < 600.0 {
        format!("{s:.0} s")
    } else if s < 36_000.0 {
        format!("{:.0} min", s / 60.0)
    } else {
        format!("{:.0} h", s / 3600.0)
    }
}

/// Seconds a derivation of a `len`-byte key with `kdf` takes here, from the rates
/// [`calibrated`] measured. PBKDF2 computes one chain of `iterations` per block of the
/// hash's length; argon2 fills `memory_kib` once per pass, its lanes in parallel on up to
/// as many cores as this machine has.
pub fn estimate_seconds(kdf: Kdf, len: usize) -> f64 {
    match kdf {
        Kdf::Pbkdf2 { hash, iterations } => {
            let blocks = len.div_ceil(hash.len()).max(1) as f64;
            f64::from(iterations) * blocks / calibrated(Some(hash))
        }
        Kdf::Argon2id {
            time,
            memory_kib,
            parallel,
        }
        | Kdf::Argon2i {
            time,
            memory_kib,
            parallel,
        } => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
            let lanes = f64::from(parallel.max(1)).min(cores);
            f64::from(memory_kib) * f64::from(time) / (calibrated(None) * lanes)
        }
    }
}

/// Work a second on one core, measured once per process: PBKDF2 iterations (one block)
/// for `Some(hash)`, argon2 KiB filled for `None`. Each measure takes a few milliseconds:
/// work doubled until it lasts 20 ms of this thread's CPU time, not of the wall clock, so
/// that a busy machine (the thread waiting for a core) does not make a derivation look
/// many times dearer than it is and refuse the defaults.
fn calibrated(hash: Option<Hash>) -> f64 {
    static RATES: Mutex<Vec<(Option<Hash>, f64)>> = Mutex::new(Vec::new());
    let mut rates = RATES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, r)) = rates.iter().find(|(h, _)| *h == hash) {
        return *r;
    }
    let mut work: u32 = 1024;
    let rate = loop {
        let kdf = match hash {
            Some(hash) => Kdf::Pbkdf2 {
                hash,
                iterations: work,
            },
            None => Kdf::Argon2id {
                time: 1,
                memory_kib: work,
                parallel: 1,
            },
        };
        let len = hash.map_or(32, Hash::len);
        let began = thread_cpu_secs();
        // A calibration that fails (it cannot with these parameters) gives the rate of
        // what it measured anyway.
        let _ = derive(kdf, b"calibration", &[0u8; SALT_BYTES], len);
        let secs = thread_cpu_secs() - began;
        if secs >= 0.02 || work >= 1 << 22 {
            break f64::from(work) / secs.max(1e-9);
        }
        work *= 2;
    };
    rates.push((hash, rate));
    rate
}

/// CPU time this thread has used, in seconds.
fn thread_cpu_secs() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_derivation_of_hours_is_refused_and_the_defaults_are_not() {
        let huge = Kdf::Pbkdf2 {
            hash: Hash::Sha256,
            iterations: u32::MAX,
        };
        let e = check_cost(huge, 64).unwrap_err().to_string();
        assert!(
            e.contains("would take about") && e.contains("more than the 60 s"),
            "{e}"
        );
        let deep = Kdf::Argon2id {
            time: 1000,
            memory_kib: 4 << 20,
            parallel: 4,
        };
        assert!(check_cost(deep, 64).is_err());
        for kdf in [Kdf::DEFAULT_PBKDF2, Kdf::DEFAULT_ARGON2ID] {
            let s = check_cost(kdf, 64).unwrap();
            assert!(s < NEW_SLOT_SECONDS_MAX / 4.0, "{kdf}: {s} s");
        }
    }

    #[test]
    fn a_slot_key_is_what_the_kdf_derives_with_its_salt() {
        let kdf = Kdf::Pbkdf2 {
            hash: Hash::Sha256,
            iterations: 1000,
        };
        let k = SlotKey::derive(kdf, b"pass", 64).unwrap();
        let again = derive(kdf, b"pass", &k.salt, 64).unwrap();
        assert_eq!(k.key.0, again.0);
        assert_ne!(SlotKey::derive(kdf, b"pass", 64).unwrap().salt, k.salt);
    }
}
