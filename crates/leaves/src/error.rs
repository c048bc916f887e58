//! Errors of leaf devices' specs and of loading Ceph's client library: why a device's
//! command-line form (`file:PATH,engine=aio`) or one of its values is refused, and why
//! librbd could not be used.
//!
//! Opening a device fails with [`cairn_core::Error`] (its context names the device and
//! what cairn was doing); the request path keeps [`cairn_core::IoError`].

/// Everything a leaf's spec, one of its values, or loading librbd can fail at.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The command-line form of a device is refused: `spec` is all of it, as given.
    #[error("invalid device '{spec}': {why}")]
    Spec {
        /// The device's spec, as given.
        spec: String,
        /// What is wrong with it.
        why: SpecError,
    },
    /// `engine=` names no engine.
    #[error("unknown engine '{0}' (use auto, io_uring, aio or sync)")]
    UnknownEngine(String),
    /// An rbd device's `connection=` is neither `shared` nor `image`.
    #[error("connection must be shared or image, not '{0}'")]
    UnknownConnection(String),
    /// An rbd device's timeout is not whole seconds from 1 s to 24 h.
    #[error("timeout must be whole seconds from 1s to 24h, such as 30s")]
    RbdTimeout,
    /// A name of an rbd image's path (pool, namespace, image, snapshot, client id) is
    /// empty or holds a character Ceph does not take there.
    #[error(
        "the {what} name {}",
        match bad {
            None => "is empty".to_string(),
            Some(c) => format!("'{}' holds {c:?}", name.escape_default()),
        }
    )]
    RbdName {
        /// Which name (`pool`, `image`...).
        what: String,
        /// The name given.
        name: String,
        /// The first character refused (`None`: the name is empty).
        bad: Option<char>,
    },
    /// librados or librbd is not installed (or does not load).
    #[error(
        "rbd: cannot load {library} ({why}): install Ceph's client library (Debian: apt-get install {package})"
    )]
    LibraryMissing {
        /// The library's soname.
        library: String,
        /// The Debian package that ships it.
        package: &'static str,
        /// What the dynamic loader said.
        why: String,
    },
    /// librbd or librados lacks a function cairn calls: it is older than Pacific.
    #[error(
        "rbd: {library} lacks an entry point cairn needs ({symbol}: {why}): Ceph 16.2 (Pacific) or later is needed"
    )]
    LibraryTooOld {
        /// The library's soname (librbd's, as the message has always said).
        library: String,
        /// The function missing.
        symbol: &'static str,
        /// What the dynamic loader said.
        why: String,
    },
}

/// What is wrong with a device's spec ([`Error::Spec`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// No `TYPE:` before the rest.
    #[error("expected null:SIZE, mem:SIZE, file:PATH, nbd:URI or rbd:POOL/IMAGE")]
    NoType,
    /// A type cairn does not know.
    #[error("unknown type '{0}' (use null, mem, file, nbd or rbd)")]
    UnknownType(String),
    /// An NBD URI given as the whole spec (`nbd://host/x` for `nbd:nbd://host/x`): the
    /// spec as it should have been written follows.
    #[error("an NBD URI is given after the type: nbd:{0}")]
    UriWithoutType(String),
    /// An option that is not `key=value`.
    #[error("option '{0}' is not key=value")]
    NotKeyValue(String),
    /// An option given twice.
    #[error("option '{0}' given twice")]
    Twice(String),
    /// An option the type does not take.
    #[error("unknown option '{key}' for {kind} (known: {known})")]
    UnknownOption {
        /// The option.
        key: String,
        /// The device type.
        kind: &'static str,
        /// The options it takes.
        known: &'static str,
    },
    /// The part after `TYPE:` is missing or has the wrong form; the message says what
    /// the type needs.
    #[error("{0}")]
    Needs(&'static str),
    /// The value of `key` is refused; `why` says what it must be.
    #[error("{why}")]
    Value {
        /// The option (`size` for a null or mem device's size).
        key: &'static str,
        /// Why, as a sentence naming what it must be.
        why: String,
    },
    /// The NBD URI does not parse.
    #[error("{0}")]
    Uri(cairn_nbd::Error),
    /// A value of an rbd or file option is refused ([`Error::UnknownEngine`],
    /// [`Error::RbdName`], ...).
    #[error("{0}")]
    Leaf(Box<Error>),
}

impl From<Error> for cairn_core::Error {
    fn from(e: Error) -> cairn_core::Error {
        cairn_core::Error::Invalid(e.to_string())
    }
}
