//! Errors of the NBD crate's own checks: an export added or removed while serving, a
//! `--listen` address, an NBD URI. Opening sockets and devices fails with
//! [`cairn_core::Error`]; a refused handshake with
//! [`crate::client::handshake::HandshakeError`].

/// Why an export change, a listen address or a URI is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An export added while serving has an empty name.
    #[error("an added export needs a name")]
    ExportUnnamed,
    /// An export of this name is served already.
    #[error("an export named '{0}' is served already")]
    ExportExists(String),
    /// No export of this name is served.
    #[error("no export named '{0}'")]
    NoExport(String),
    /// The export was served from the start, not added with `export add`: it stays.
    #[error(
        "export '{0}' is from the start (the stack file or the command line): only exports added with 'export add' are removed"
    )]
    ExportFromStart(String),
    /// A `--listen` address of the wrong form.
    #[error("--listen {text}: expected {expected}")]
    Listen {
        /// The address as given.
        text: String,
        /// The forms it may take.
        expected: &'static str,
    },
    /// An NBD URI that does not parse, or asks for what cairn does not do.
    #[error("'{uri}': {why}")]
    Uri {
        /// The URI as given.
        uri: String,
        /// What is wrong with it.
        why: String,
    },
}

impl From<Error> for cairn_core::Error {
    fn from(e: Error) -> cairn_core::Error {
        cairn_core::Error::Invalid(e.to_string())
    }
}
