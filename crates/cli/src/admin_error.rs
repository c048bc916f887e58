//! What an admin command can fail with. Every "error: ..." reply of the admin socket is
//! one of these, written by [`reply`]: the command's own refusals (usage, a name that is
//! not served, a device without the capability asked for) and, wrapped, the error a
//! device returned (a thin pool's, a bitmap store's, an array's, a crypt header's).

use std::fmt;

use cairn_services::{CryptError, DirtyError, ThinError};

/// Why an admin command did nothing (or, for a device's own error, what it says).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// The words do not fit the command; the usage line says what it takes.
    #[error("usage: {0}")]
    Usage(String),
    /// No command of that name.
    #[error("unknown command '{name}' (known: {known})")]
    UnknownCommand {
        /// The word given.
        name: String,
        /// The commands there are, comma-separated.
        known: String,
    },
    /// No served device of that name, at any depth of the served stacks.
    #[error("no device '{0}' is served (see the 'devices' command)")]
    NoDevice(String),
    /// No served thin pool of that name; with the pools that are, when the command lists
    /// them.
    #[error("no thin pool '{pool}' is served{}", Pools(.served))]
    NoPool {
        /// The name given.
        pool: String,
        /// The pools served, or `None` when the reply does not list them.
        served: Option<Vec<String>>,
    },
    /// The pool has no volume of that name.
    #[error("pool '{pool}' has no volume '{volume}'")]
    NoVolume {
        /// The pool.
        pool: String,
        /// The volume asked for.
        volume: String,
    },
    /// An array action on a device that is not an array with metadata.
    #[error("'{device}' is not an array with metadata: it has no '{action}'")]
    NotAnArray {
        /// The device named.
        device: String,
        /// The action asked for.
        action: String,
    },
    /// A bitmap command on a device without a bitmap store.
    #[error(
        "device '{0}' keeps no dirty bitmaps (give it a store: bitmaps = \"PATH\" in its \
         [device.{0}] table)"
    )]
    NoBitmaps(String),
    /// No served throttle device of that name.
    #[error("no throttle device '{0}' is served")]
    NoThrottle(String),
    /// No served crypt device of that name.
    #[error("no crypt device '{0}' is served")]
    NoCrypt(String),
    /// An export command on a server that serves no NBD.
    #[error("no NBD server here")]
    NoServer,
    /// A size or granularity that does not parse.
    #[error("{what} '{text}': {why}")]
    BadSize {
        /// "size" or "granularity".
        what: &'static str,
        /// The word given.
        text: String,
        /// Why it does not parse.
        why: String,
    },
    /// A key slot that is not a number.
    #[error("'{0}' is not a key slot number")]
    BadSlot(String),
    /// The command line itself could not be taken: too long, not UTF-8, or too many
    /// commands running, or the server stopping.
    #[error("{0}")]
    NotTaken(String),
    /// A value the stack file's rules refuse (limits, a key derivation, an export name),
    /// or a device that would not open.
    #[error(transparent)]
    Setting(#[from] cairn_core::Error),
    /// An export name that an export added online may not have.
    #[error(
        "export name '{0}' has a '/' (an export added here is named as a thin volume is: no \
         '/', spaces or control characters)"
    )]
    ExportName(String),
    /// The export table's refusal (a name taken, no such export).
    #[error(transparent)]
    Export(#[from] cairn_nbd::Error),
    /// An array's refusal (no such member, the last copy of some data, a new member that
    /// does not fit, ...).
    #[error(transparent)]
    Array(#[from] cairn_stacks::Error),
    /// A thin pool's refusal (no such volume, a name taken, out of space, ...).
    #[error(transparent)]
    Thin(#[from] ThinError),
    /// A bitmap store's refusal (no such bitmap, a name taken, the store full, ...).
    #[error(transparent)]
    Bitmap(#[from] DirtyError),
    /// A crypt device's refusal, with the device it came from.
    #[error("crypt {device}: {source}")]
    Crypt {
        /// The crypt device.
        device: String,
        /// What it said.
        source: CryptError,
    },
    /// A passphrase file that cannot be used (not a regular file, too large, unreadable).
    #[error(transparent)]
    Passphrase(CryptError),
}

impl AdminError {
    /// A crypt device's error, with its name.
    pub fn crypt(device: &str, source: CryptError) -> Self {
        AdminError::Crypt {
            device: device.to_string(),
            source,
        }
    }
}

/// The pools list of [`AdminError::NoPool`]: " (pools: a, b)", " (pools: none)", or
/// nothing.
struct Pools<'a>(&'a Option<Vec<String>>);

impl fmt::Display for Pools<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            None => Ok(()),
            Some(v) if v.is_empty() => write!(f, " (pools: none)"),
            Some(v) => write!(f, " (pools: {})", v.join(", ")),
        }
    }
}

/// A command's reply: its text as it is, or "error: WHY" on a line.
pub fn reply(done: Result<String, AdminError>) -> String {
    match done {
        Ok(text) => text,
        Err(e) => format!("error: {e}\n"),
    }
}

/// A size word of a command, parsed; `what` names it in the error.
pub fn size(what: &'static str, text: &str) -> Result<u64, AdminError> {
    cairn_core::size::parse_size(text).map_err(|e| AdminError::BadSize {
        what,
        text: text.to_string(),
        why: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_keep_the_words_the_docs_quote() {
        let e = |e: AdminError| reply(Err(e));
        assert_eq!(
            e(AdminError::NoDevice("r".into())),
            "error: no device 'r' is served (see the 'devices' command)\n"
        );
        assert_eq!(
            e(AdminError::NoPool {
                pool: "p".into(),
                served: Some(vec![])
            }),
            "error: no thin pool 'p' is served (pools: none)\n"
        );
        assert_eq!(
            e(AdminError::NoPool {
                pool: "p".into(),
                served: Some(vec!["a".into(), "b".into()])
            }),
            "error: no thin pool 'p' is served (pools: a, b)\n"
        );
        assert_eq!(
            e(AdminError::NoPool {
                pool: "p".into(),
                served: None
            }),
            "error: no thin pool 'p' is served\n"
        );
        assert_eq!(
            e(AdminError::NoBitmaps("d".into())),
            "error: device 'd' keeps no dirty bitmaps (give it a store: bitmaps = \"PATH\" in its [device.d] table)\n"
        );
        assert_eq!(
            e(size("size", "12Q").unwrap_err())
                .split(':')
                .take(2)
                .collect::<Vec<_>>(),
            ["error", " size '12Q'"]
        );
        assert_eq!(reply(Ok("ok\n".into())), "ok\n");
    }
}
