//! The keys of `type = "crypt"`.

use toml::Value;

use super::{err, DeviceSpec, Error, Keys};
use cairn_services::crypt::device::CryptOptions;
use cairn_services::crypt::volume::Format;
use cairn_services::crypt::{Hash, Kdf};

/// Every key a crypt table may have.
pub(crate) const CRYPT_KEYS: [&str; 12] = [
    "base",
    "passphrase_file",
    "key_file",
    "create",
    "format",
    "sector_size",
    "key_size",
    "kdf",
    "kdf_iterations",
    "kdf_memory",
    "kdf_parallel",
    "kdf_hash",
];

/// Argon2id's memory, from 32 KiB to 4 GiB (cryptsetup's bounds).
const ARGON2_MEMORY: std::ops::RangeInclusive<u64> = (32 << 10)..=(4 << 30);

/// The key derivation `words` (`KEY=VALUE`: kdf, kdf_iterations, kdf_memory,
/// kdf_parallel, kdf_hash) ask for a new slot of a `format` header on `device`; `None`:
/// the device's own.
pub fn crypt_kdf(device: &str, format: Format, words: &[&str]) -> Result<Option<Kdf>, Error> {
    let table = super::words_table(words)?;
    let keys = Keys {
        device,
        noun: "device",
        kind: "crypt",
        table: &table,
        known: &CRYPT_KEYS[7..],
    };
    keys.check_unknown()?;
    keys.kdf(Some(format))
}

impl Keys<'_> {
    fn path(&self, key: &str) -> Result<Option<std::path::PathBuf>, Error> {
        match self.string(key)? {
            Some(p) if p.is_empty() || p.contains('\0') => {
                Err(self.bad(key, "must be a file's path (not empty, no NUL)"))
            }
            p => Ok(p.map(std::path::PathBuf::from)),
        }
    }

    /// Refuses a passphrase or key written in the table itself (before the unknown keys,
    /// to say why).
    pub(crate) fn no_inline_secret(&self) -> Result<(), Error> {
        if self.table.contains_key("passphrase") || self.table.contains_key("key") {
            return Err(err(format!(
                "device '{}': a key is never written in the stack file: put it in a file \
                 (readable by cairn only) and name it with passphrase_file or key_file",
                self.device
            )));
        }
        Ok(())
    }

    /// A `crypt` device.
    pub(crate) fn crypt(&self) -> Result<DeviceSpec, Error> {
        let passphrase_file = self.path("passphrase_file")?;
        let key_file = self.path("key_file")?;
        if passphrase_file.is_none() && key_file.is_none() {
            return Err(err(format!(
                "device '{}': a crypt device needs passphrase_file (or key_file, the raw volume key)",
                self.device
            )));
        }
        let create = self.bool("create")?.unwrap_or(false);
        if create && passphrase_file.is_none() {
            return Err(self.bad(
                "passphrase_file",
                "is missing: create makes key slot 0, opened by that passphrase",
            ));
        }
        let format = match self.string("format")? {
            None => None,
            Some(f) => Some(
                Format::parse(f)
                    .ok_or_else(|| self.bad("format", "must be \"luks2\" or \"luks1\""))?,
            ),
        };
        let sector_bytes = match self.integer("sector_size")? {
            None => None,
            Some(s @ (512 | 4096)) => Some(s as u32),
            Some(_) => return Err(self.out_of_range("sector_size", "512 or 4096")),
        };
        if sector_bytes == Some(4096) && format == Some(Format::Luks1) {
            return Err(self.bad(
                "sector_size",
                "= 4096 needs format = \"luks2\" (LUKS1 has 512-byte sectors)",
            ));
        }
        let key_bytes = match self.integer("key_size")? {
            None | Some(512) => 64,
            Some(256) => 32,
            Some(_) => {
                return Err(
                    self.out_of_range("key_size", "512 (AES-256-XTS) or 256 (AES-128-XTS) bits")
                )
            }
        };
        let kdf = self.kdf(format)?;
        for key in ["sector_size", "key_size"] {
            if self.table.contains_key(key) && !create {
                return Err(self.bad(key, "is only for create: an existing header says it"));
            }
        }
        Ok(DeviceSpec::Crypt {
            base: self.base()?,
            options: CryptOptions {
                passphrase_file,
                key_file,
                create,
                format,
                sector_bytes,
                kdf,
                key_bytes,
            },
        })
    }

    /// `kdf` and its parameters, for slots cairn makes.
    fn kdf(&self, format: Option<Format>) -> Result<Option<Kdf>, Error> {
        let iterations = self.integer("kdf_iterations")?;
        let memory = self.size_in("kdf_memory", ARGON2_MEMORY, "")?;
        let parallel = self.integer("kdf_parallel")?;
        let hash = match self.string("kdf_hash")? {
            None => None,
            Some(h) => Some(
                Hash::parse(h)
                    .ok_or_else(|| self.bad("kdf_hash", "must be sha1, sha256 or sha512"))?,
            ),
        };
        let kind = match self.table.get("kdf") {
            None if iterations.is_none()
                && memory.is_none()
                && parallel.is_none()
                && hash.is_none() =>
            {
                return Ok(None)
            }
            None if format == Some(Format::Luks1) || hash.is_some() => "pbkdf2",
            None => "argon2id",
            Some(Value::String(k)) if ["pbkdf2", "argon2id", "argon2i"].contains(&k.as_str()) => {
                k.as_str()
            }
            Some(_) => {
                return Err(self.bad("kdf", "must be \"argon2id\", \"pbkdf2\" or \"argon2i\""))
            }
        };
        if kind == "pbkdf2" {
            for key in ["kdf_memory", "kdf_parallel"] {
                if self.table.contains_key(key) {
                    return Err(
                        self.bad(key, "is argon2id's: pbkdf2 has kdf_iterations and kdf_hash")
                    );
                }
            }
            let iterations = match iterations {
                None => 1_000_000,
                Some(n @ 1000..=0xffff_ffff) => n as u32,
                Some(_) => {
                    return Err(self.out_of_range("kdf_iterations", "from 1000 to 4294967295"))
                }
            };
            return Ok(Some(Kdf::Pbkdf2 {
                hash: hash.unwrap_or(Hash::Sha256),
                iterations,
            }));
        }
        if format == Some(Format::Luks1) {
            return Err(self.bad(
                "kdf",
                "= \"argon2id\" needs format = \"luks2\" (LUKS1 has pbkdf2 only)",
            ));
        }
        if hash.is_some() {
            return Err(self.bad("kdf_hash", "is pbkdf2's: argon2id has no hash to choose"));
        }
        let Kdf::Argon2id {
            time: t0,
            memory_kib: m0,
            parallel: p0,
        } = Kdf::DEFAULT_ARGON2ID
        else {
            unreachable!("the argon2id default")
        };
        let time = match iterations {
            None => t0,
            Some(n @ 1..=1000) => n as u32,
            Some(_) => {
                return Err(
                    self.out_of_range("kdf_iterations", "from 1 to 1000 passes for argon2id")
                )
            }
        };
        let parallel = match parallel {
            None => p0,
            Some(n @ 1..=16) => n as u32,
            Some(_) => return Err(self.out_of_range("kdf_parallel", "from 1 to 16 lanes")),
        };
        let memory_kib = memory.map_or(m0, |m| (m >> 10) as u32);
        Ok(Some(if kind == "argon2i" {
            Kdf::Argon2i {
                time,
                memory_kib,
                parallel,
            }
        } else {
            Kdf::Argon2id {
                time,
                memory_kib,
                parallel,
            }
        }))
    }
}
