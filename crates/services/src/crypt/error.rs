//! What can go wrong with encryption at rest: [`CryptError`], for reading and changing
//! LUKS headers (a wrong passphrase, a damaged or unsupported header, a key slot not in
//! use), reading the secrets a `crypt` table names, and the header I/O on the base.
//! `CryptDevice::open` answers with `cairn_core::Error`, as every device's open does.

use std::path::PathBuf;

use cairn_core::blocking::BlockingError;

use super::device::PASSPHRASE_BYTES_MAX;

/// Why a LUKS header or a key slot operation was refused or failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CryptError {
    /// A value given by the user (an option, a key derivation, a size) is not
    /// acceptable; the message says which and why.
    #[error("{0}")]
    Invalid(String),
    /// No key slot opens with the passphrase given.
    #[error("no key slot opens with this passphrase")]
    WrongPassphrase,
    /// The key given is not the header's volume key (`what`: "master" in LUKS1's words,
    /// "volume" in LUKS2's).
    #[error("the key is not this header's {what} key")]
    WrongKey {
        /// The header's word for its key.
        what: &'static str,
    },
    /// The raw key of `key_file` is not the volume key of the base's header.
    #[error("key_file is not the volume key of base '{base}'")]
    WrongKeyFile {
        /// The base device.
        base: String,
    },
    /// Key slot `slot` is not in use.
    #[error("key slot {0} is not in use")]
    SlotNotInUse(usize),
    /// Key slot `slot` is the only one: removing it would lock the data away for good.
    #[error("key slot {0} is the only key slot: add another first")]
    LastSlot(usize),
    /// No key slot, or no room for one, is left (the message says which).
    #[error("{0}")]
    NoFreeSlot(String),
    /// No LUKS magic where the header goes.
    #[error("no LUKS header (bad magic)")]
    NoHeader,
    /// A header cairn does not open (another cipher, a feature it lacks); nothing is
    /// wrong with it.
    #[error("{0}")]
    Unsupported(String),
    /// A damaged header: which copy or structure, and why.
    #[error("{0}")]
    Damaged(String),
    /// A secret file (`key`: `passphrase_file`, `key_file`) could not be read.
    #[error("{key} '{}': {source}", path.display())]
    SecretIo {
        /// The table's key naming the file.
        key: String,
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A secret file is not a regular file (a FIFO could block the reader forever).
    #[error("{key} '{}' is {kind}: a secret is read from a regular file only", path.display())]
    SecretNotAFile {
        /// The table's key naming the file.
        key: String,
        /// The file.
        path: PathBuf,
        /// What it is ("a FIFO", "a directory"...).
        kind: &'static str,
    },
    /// A secret file larger than cryptsetup reads.
    #[error("{key} '{}' is larger than {PASSPHRASE_BYTES_MAX} bytes (cryptsetup's limit for a key file)", path.display())]
    SecretTooLarge {
        /// The table's key naming the file.
        key: String,
        /// The file.
        path: PathBuf,
    },
    /// An empty secret file.
    #[error("{key} '{}' is empty", path.display())]
    SecretEmpty {
        /// The table's key naming the file.
        key: String,
        /// The file.
        path: PathBuf,
    },
    /// The base holds no LUKS header (`create`: nor is it blank).
    #[error("base '{base}' holds {}", if *blank { "no LUKS header (create = true formats a blank one)" } else if *create { "something that is not a LUKS header: create formats only a blank base (zeros where the header goes)" } else { "something that is not a LUKS header" })]
    NotLuks {
        /// The base device.
        base: String,
        /// Whether the base is blank (zeros where a header goes).
        blank: bool,
        /// Whether `create` was asked for.
        create: bool,
    },
    /// `create` refused a base that is not blank (a wiped header's key slots, say).
    #[error("base '{base}' holds no LUKS header but is not blank: byte {at} is not zero (the key slots or data of a volume whose header was wiped, say); create formats only a base whose first {} are zeros, and writes nothing here: to destroy what it holds, zero them first", cairn_core::size::format_bytes(*blank_bytes))]
    NotBlank {
        /// The base device.
        base: String,
        /// The first byte that is not zero.
        at: u64,
        /// Bytes that must be zeros.
        blank_bytes: u64,
    },
    /// The header reaches past the end of the base.
    #[error("the header runs past the end of the base ({size} bytes)")]
    HeaderPastEnd {
        /// The base's size in bytes.
        size: u64,
    },
    /// A read or write of the header on the base failed (`doing`: "reading the base",
    /// "writing the base").
    #[error("{doing}: {source}")]
    Io {
        /// What cairn was doing.
        doing: &'static str,
        /// The base's error.
        source: BlockingError,
    },
    /// Opening a queue on the base failed.
    #[error("{0}")]
    Device(#[from] cairn_core::Error),
    /// Argon2 refused its parameters or failed (`doing`: "argon2 parameters",
    /// "argon2").
    #[error("{doing}: {error}")]
    Argon2 {
        /// What was asked of it.
        doing: &'static str,
        /// Its error.
        error: argon2::Error,
    },
    /// The kernel gave no random bytes.
    #[error("no random bytes from the kernel: {0}")]
    Random(rustix::io::Errno),
    /// An error about base `base`'s header.
    #[error("base '{base}': {source}")]
    Base {
        /// The base device.
        base: String,
        /// What went wrong.
        source: Box<CryptError>,
    },
    /// An error while formatting base `base`.
    #[error("formatting base '{base}': {source}")]
    Formatting {
        /// The base device.
        base: String,
        /// What went wrong.
        source: Box<CryptError>,
    },
}

impl CryptError {
    /// This error, said of base `base`.
    pub(crate) fn of_base(self, base: &str) -> CryptError {
        CryptError::Base {
            base: base.to_string(),
            source: Box::new(self),
        }
    }

    /// The error beneath the base's name: what a caller matches on.
    pub fn kind(&self) -> &CryptError {
        match self {
            CryptError::Base { source, .. } | CryptError::Formatting { source, .. } => {
                source.kind()
            }
            other => other,
        }
    }

    /// This error with the control characters of its text escaped: a refusal quotes
    /// strings read from a header (a cipher, a hash, a JSON name), which may hold a
    /// newline, and is one line.
    pub(crate) fn one_line(self) -> CryptError {
        match self {
            CryptError::Unsupported(m) => CryptError::Unsupported(super::one_line(m)),
            CryptError::Damaged(m) => CryptError::Damaged(super::one_line(m)),
            CryptError::Invalid(m) => CryptError::Invalid(super::one_line(m)),
            other => other,
        }
    }
}
