//! The command-line form of a leaf device: `null:SIZE`, `mem:SIZE`, `file:PATH[,key=value]`,
//! `nbd:URI[,key=value]`.
//!
//! Options follow the first comma: `block=` for null and mem; `engine=auto|io_uring|aio|sync`,
//! `direct=0|1` and `size=` for files; `connections=N` and `timeout=` for nbd. Paths and
//! URIs containing commas are not supported here (a stack file takes them).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use cairn_core::size::{parse_duration, parse_size};

use crate::error::{Error, SpecError};
use crate::DEFAULT_BLOCK_BYTES;

/// How a file device talks to the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Engine {
    /// Chosen when the file is opened, from what its file system does without blocking
    /// (the default; see `file::probe`).
    #[default]
    Auto,
    /// io_uring on the reactor's own ring.
    IoUring,
    /// linux-aio (`io_submit`), one context per queue, reaped from user space.
    Aio,
    /// Plain `pread`/`pwrite` on the reactor thread.
    Sync,
}

impl Engine {
    /// Parses `auto`, `io_uring`, `aio` or `sync`.
    pub fn parse(text: &str) -> Result<Engine, Error> {
        match text {
            "auto" => Ok(Engine::Auto),
            "io_uring" | "uring" => Ok(Engine::IoUring),
            "aio" | "libaio" => Ok(Engine::Aio),
            "sync" | "psync" => Ok(Engine::Sync),
            _ => Err(Error::UnknownEngine(text.to_string())),
        }
    }

    /// The name as written in specs.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Auto => "auto",
            Engine::IoUring => "io_uring",
            Engine::Aio => "aio",
            Engine::Sync => "sync",
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A parsed leaf device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeafSpec {
    /// `null:SIZE[,block=N]`.
    Null {
        /// Size in bytes.
        size_bytes: u64,
        /// Logical block size.
        block_bytes: u32,
    },
    /// `mem:SIZE[,block=N][,volatile=0|1]`.
    Mem {
        /// Size in bytes.
        size_bytes: u64,
        /// Logical block size.
        block_bytes: u32,
        /// Writes stay volatile until a flush; a power cut loses them.
        volatile: bool,
    },
    /// `file:PATH[,engine=E][,direct=0|1][,size=SIZE]`.
    File {
        /// The file or block device.
        path: PathBuf,
        /// The engine.
        engine: Engine,
        /// Open with O_DIRECT.
        direct: bool,
        /// Create or extend to this size; without it the file's own size is used.
        size_bytes: Option<u64>,
        /// Create or extend past the file system's free space (`sparse=1`): without it,
        /// a size that would not fit is refused.
        sparse: bool,
    },
    /// `nbd:URI[,connections=N][,timeout=DURATION]`.
    Nbd {
        /// The server, as libnbd and qemu write it (`nbd://host/export`,
        /// `nbd+unix:///export?socket=PATH`).
        uri: String,
        /// Connections per queue (several need the server's multi-conn).
        connections: u32,
        /// How long a request may wait for its reply or a lost connection.
        timeout: Duration,
    },
    /// `rbd:POOL/[NAMESPACE/]IMAGE[,conf=PATH][,id=NAME][,snapshot=SNAP][,timeout=T][,connection=shared|image]`.
    Rbd(crate::rbd::RbdTarget),
}

/// The least an rbd device's `timeout` may be (librados counts whole seconds).
pub const RBD_TIMEOUT_MIN: Duration = Duration::from_secs(1);
/// The most an rbd device's `timeout` may be.
pub const RBD_TIMEOUT_MAX: Duration = Duration::from_secs(24 * 3600);

/// Checks an rbd device's timeout: whole seconds from 1 s to 24 h.
pub fn rbd_timeout(d: Duration) -> Result<Duration, Error> {
    if (RBD_TIMEOUT_MIN..=RBD_TIMEOUT_MAX).contains(&d) && d.subsec_nanos() == 0 {
        Ok(d)
    } else {
        Err(Error::RbdTimeout)
    }
}

/// Checks one name of an rbd image's path (pool, namespace, image, snapshot).
pub fn rbd_name(what: &str, name: &str) -> Result<(), Error> {
    let bad = name
        .chars()
        .find(|c| c.is_control() || (*c == '@' && what != "snapshot") || *c == '/');
    if name.is_empty() || bad.is_some() {
        return Err(Error::RbdName {
            what: what.to_string(),
            name: name.to_string(),
            bad,
        });
    }
    Ok(())
}

/// The least an nbd device's `timeout` may be.
pub const NBD_TIMEOUT_MIN: Duration = Duration::from_millis(100);
/// The most an nbd device's `timeout` may be.
pub const NBD_TIMEOUT_MAX: Duration = Duration::from_secs(24 * 3600);

impl LeafSpec {
    /// The body of a `[device.NAME]` table of a stack file that opens this device (keys
    /// one per line, TOML-quoted): what `cairn serve` writes for a member added online.
    /// A relative file path is made absolute against the current directory.
    pub fn stack_table(&self) -> String {
        fn quoted(s: &str) -> String {
            toml::Value::String(s.to_string()).to_string()
        }
        let mut out = String::new();
        match self {
            LeafSpec::Null {
                size_bytes,
                block_bytes,
            } => {
                out += &format!("type = \"null\"\nsize = {size_bytes}\nblock = {block_bytes}\n");
            }
            LeafSpec::Mem {
                size_bytes,
                block_bytes,
                volatile,
            } => {
                out += &format!(
                    "type = \"mem\"\nsize = {size_bytes}\nblock = {block_bytes}\nvolatile = {volatile}\n"
                );
            }
            LeafSpec::File {
                path,
                engine,
                direct,
                size_bytes,
                sparse,
            } => {
                let path = std::path::absolute(path).unwrap_or_else(|_| path.clone());
                out += &format!(
                    "type = \"file\"\npath = {}\nengine = \"{engine}\"\ndirect = {direct}\n",
                    quoted(&path.to_string_lossy())
                );
                if *sparse {
                    out += "sparse = true\n";
                }
                if let Some(size) = size_bytes {
                    out += &format!("size = {size}\n");
                }
            }
            LeafSpec::Nbd {
                uri,
                connections,
                timeout,
            } => {
                out += &format!(
                    "type = \"nbd\"\nuri = {}\nconnections = {connections}\ntimeout = \"{}ms\"\n",
                    quoted(uri),
                    timeout.as_millis()
                );
            }
            LeafSpec::Rbd(t) => {
                out += &format!("type = \"rbd\"\npool = {}\n", quoted(&t.pool));
                if let Some(ns) = &t.namespace {
                    out += &format!("namespace = {}\n", quoted(ns));
                }
                out += &format!("image = {}\n", quoted(&t.image));
                if let Some(conf) = &t.conf {
                    let conf = std::path::absolute(conf).unwrap_or_else(|_| conf.clone());
                    out += &format!("conf = {}\n", quoted(&conf.to_string_lossy()));
                }
                if let Some(id) = &t.id {
                    out += &format!("id = {}\n", quoted(id));
                }
                if let Some(snap) = &t.snapshot {
                    out += &format!("snapshot = {}\n", quoted(snap));
                }
                out += &format!(
                    "timeout = \"{}s\"\nconnection = \"{}\"\n",
                    t.timeout.as_secs(),
                    t.connection.as_str()
                );
            }
        }
        out
    }

    /// Parses the command-line form.
    pub fn parse(text: &str) -> Result<LeafSpec, Error> {
        let (kind, rest) = text
            .split_once(':')
            .ok_or_else(|| invalid(text, SpecError::NoType))?;
        let mut parts = rest.split(',');
        let first = parts.next().unwrap_or("");
        let mut options = Vec::new();
        for part in parts {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| invalid(text, SpecError::NotKeyValue(part.to_string())))?;
            if options.iter().any(|(seen, _)| *seen == k) {
                return Err(invalid(text, SpecError::Twice(k.to_string())));
            }
            options.push((k, v));
        }
        match kind {
            "null" => parse_memory(text, "null", first, &options),
            "mem" => parse_memory(text, "mem", first, &options),
            "file" => parse_file(text, first, &options),
            "nbd" => parse_nbd(text, first, &options),
            "rbd" => parse_rbd(text, first, &options).map(LeafSpec::Rbd),
            "nbds" | "nbd+unix" | "nbds+unix" | "nbd+vsock" | "nbds+vsock" => {
                Err(invalid(text, SpecError::UriWithoutType(text.to_string())))
            }
            _ => Err(invalid(text, SpecError::UnknownType(kind.to_string()))),
        }
    }

    /// A short default name for reports: `null`, `mem` or the file's name.
    pub fn default_name(&self) -> String {
        match self {
            LeafSpec::Null { .. } => "null".into(),
            LeafSpec::Mem { .. } => "mem".into(),
            LeafSpec::File { path, .. } => path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "file".into()),
            LeafSpec::Nbd { uri, .. } => {
                // The server's host or socket, and the export: two remote members of one
                // array get different names.
                let Ok(u) = cairn_nbd::uri::NbdUri::parse(uri) else {
                    return "nbd".into();
                };
                let place = match &u.address {
                    cairn_nbd::uri::Address::Tcp { host, .. } => host.clone(),
                    cairn_nbd::uri::Address::Unix(p) => p
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                };
                if u.export.is_empty() {
                    format!("nbd-{place}")
                } else {
                    format!("nbd-{place}-{}", u.export)
                }
            }
            LeafSpec::Rbd(t) => match &t.snapshot {
                Some(snap) => format!("rbd-{}@{snap}", t.image),
                None => format!("rbd-{}", t.image),
            },
        }
    }
}

/// The refusal of device spec `text`, for `why`.
fn invalid(text: &str, why: SpecError) -> Error {
    Error::Spec {
        spec: text.to_string(),
        why,
    }
}

/// The refusal of device spec `text`, for the value of option `key`.
fn bad_value(text: &str, key: &'static str, why: impl Into<String>) -> Error {
    invalid(
        text,
        SpecError::Value {
            key,
            why: why.into(),
        },
    )
}

/// The size in option `key` of device `text`, in its error.
fn size_in(text: &str, key: &'static str, v: &str) -> Result<u64, Error> {
    parse_size(v).map_err(|e| bad_value(text, key, e))
}

/// `null:SIZE` or `mem:SIZE` (`kind`), with their options.
fn parse_memory(
    text: &str,
    kind: &'static str,
    first: &str,
    options: &[(&str, &str)],
) -> Result<LeafSpec, Error> {
    let size_bytes = size_in(text, "size", first)?;
    let mut block_bytes = DEFAULT_BLOCK_BYTES;
    let mut volatile = false;
    for &(k, v) in options {
        match k {
            "block" => {
                block_bytes = u32::try_from(size_in(text, "block", v)?)
                    .map_err(|_| bad_value(text, "block", "block size too large"))?
            }
            "volatile" if kind == "mem" => volatile = switch(text, "volatile", v)?,
            _ => {
                let known = if kind == "mem" {
                    "block, volatile"
                } else {
                    "block"
                };
                return Err(invalid(
                    text,
                    SpecError::UnknownOption {
                        key: k.to_string(),
                        kind,
                        known,
                    },
                ));
            }
        }
    }
    Ok(if kind == "null" {
        LeafSpec::Null {
            size_bytes,
            block_bytes,
        }
    } else {
        LeafSpec::Mem {
            size_bytes,
            block_bytes,
            volatile,
        }
    })
}

/// `file:PATH`, with its options.
fn parse_file(text: &str, first: &str, options: &[(&str, &str)]) -> Result<LeafSpec, Error> {
    if first.is_empty() {
        return Err(invalid(text, SpecError::Needs("file needs a path")));
    }
    let mut engine = Engine::default();
    let mut direct = false;
    let mut size_bytes = None;
    let mut sparse = false;
    for &(k, v) in options {
        match k {
            "engine" => {
                engine =
                    Engine::parse(v).map_err(|e| invalid(text, SpecError::Leaf(Box::new(e))))?
            }
            "direct" => direct = switch(text, "direct", v)?,
            "size" => size_bytes = Some(size_in(text, "size", v)?),
            "sparse" => sparse = switch(text, "sparse", v)?,
            _ => {
                return Err(invalid(
                    text,
                    SpecError::UnknownOption {
                        key: k.to_string(),
                        kind: "file",
                        known: "engine, direct, size, sparse",
                    },
                ))
            }
        }
    }
    Ok(LeafSpec::File {
        path: PathBuf::from(first),
        engine,
        direct,
        size_bytes,
        sparse,
    })
}

/// `nbd:URI`, with its options.
fn parse_nbd(text: &str, first: &str, options: &[(&str, &str)]) -> Result<LeafSpec, Error> {
    use cairn_nbd::client::{CONNECTIONS_MAX, DEFAULT_TIMEOUT};
    if first.is_empty() {
        return Err(invalid(
            text,
            SpecError::Needs(
                "nbd needs a URI, such as nbd://HOST/EXPORT or nbd+unix:///?socket=PATH",
            ),
        ));
    }
    if first.starts_with("//") {
        // `nbd://HOST/...` given without the type: `nbd:` was taken as it.
        return Err(invalid(text, SpecError::UriWithoutType(text.to_string())));
    }
    cairn_nbd::uri::NbdUri::parse(first).map_err(|e| invalid(text, SpecError::Uri(e)))?;
    let mut connections = 1;
    let mut timeout = DEFAULT_TIMEOUT;
    for &(k, v) in options {
        match k {
            "connections" => {
                connections = v
                    .parse::<u32>()
                    .ok()
                    .filter(|n| (1..=CONNECTIONS_MAX).contains(n))
                    .ok_or_else(|| {
                        bad_value(
                            text,
                            "connections",
                            format!("connections must be from 1 to {CONNECTIONS_MAX}"),
                        )
                    })?
            }
            "timeout" => {
                timeout = parse_duration(v)
                    .ok()
                    .filter(|d| (NBD_TIMEOUT_MIN..=NBD_TIMEOUT_MAX).contains(d))
                    .ok_or_else(|| {
                        bad_value(
                            text,
                            "timeout",
                            "timeout must be a duration from 100ms to 24h, such as 30s",
                        )
                    })?
            }
            _ => {
                return Err(invalid(
                    text,
                    SpecError::UnknownOption {
                        key: k.to_string(),
                        kind: "nbd",
                        known: "connections, timeout",
                    },
                ))
            }
        }
    }
    Ok(LeafSpec::Nbd {
        uri: first.to_string(),
        connections,
        timeout,
    })
}

/// The rest of `rbd:POOL/[NS/]IMAGE,...`: the path `first` and the options.
fn parse_rbd(
    text: &str,
    first: &str,
    options: &[(&str, &str)],
) -> Result<crate::rbd::RbdTarget, Error> {
    let bad = |e: Error| invalid(text, SpecError::Leaf(Box::new(e)));
    let parts: Vec<&str> = first.split('/').collect();
    let (pool, namespace, image) = match parts[..] {
        [pool, image] => (pool, None, image),
        [pool, ns, image] => (pool, Some(ns), image),
        _ => {
            return Err(invalid(
                text,
                SpecError::Needs(
                    "rbd needs POOL/IMAGE or POOL/NAMESPACE/IMAGE, such as rbd:rbd/disk0",
                ),
            ))
        }
    };
    if image.contains('@') {
        return Err(invalid(
            text,
            SpecError::Needs("a snapshot is named with snapshot=SNAP, not IMAGE@SNAP"),
        ));
    }
    rbd_name("pool", pool).map_err(bad)?;
    if let Some(ns) = namespace {
        rbd_name("namespace", ns).map_err(bad)?;
    }
    rbd_name("image", image).map_err(bad)?;
    let mut t = crate::rbd::RbdTarget {
        pool: pool.into(),
        namespace: namespace.map(Into::into),
        image: image.into(),
        conf: None,
        id: None,
        snapshot: None,
        timeout: crate::rbd::DEFAULT_TIMEOUT,
        connection: crate::rbd::Connection::default(),
    };
    for &(k, v) in options {
        match k {
            "conf" => {
                if v.is_empty() {
                    return Err(invalid(text, SpecError::Needs("conf needs a path")));
                }
                t.conf = Some(PathBuf::from(v));
            }
            "id" => {
                rbd_name("client id", v).map_err(bad)?;
                t.id = Some(v.strip_prefix("client.").unwrap_or(v).into());
            }
            "snapshot" => {
                rbd_name("snapshot", v).map_err(bad)?;
                t.snapshot = Some(v.into());
            }
            "timeout" => {
                t.timeout = parse_duration(v)
                    .map_err(|_| Error::RbdTimeout)
                    .and_then(rbd_timeout)
                    .map_err(bad)?
            }
            "connection" => t.connection = crate::rbd::Connection::parse(v).map_err(bad)?,
            _ => {
                return Err(invalid(
                    text,
                    SpecError::UnknownOption {
                        key: k.to_string(),
                        kind: "rbd",
                        known: "conf, id, snapshot, timeout, connection",
                    },
                ))
            }
        }
    }
    Ok(t)
}

/// An on/off option of a device spec (`direct=1`, `sparse=0`; `true` and `false` too).
fn switch(text: &str, key: &'static str, value: &str) -> Result<bool, Error> {
    match value {
        "0" | "false" => Ok(false),
        "1" | "true" => Ok(true),
        _ => Err(bad_value(text, key, format!("{key} must be 0 or 1"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses() {
        assert_eq!(
            LeafSpec::parse("null:1G"),
            Ok(LeafSpec::Null {
                size_bytes: 1 << 30,
                block_bytes: 512
            })
        );
        assert_eq!(
            LeafSpec::parse("mem:64M,block=4k"),
            Ok(LeafSpec::Mem {
                size_bytes: 64 << 20,
                block_bytes: 4096,
                volatile: false
            })
        );
        assert_eq!(
            LeafSpec::parse("file:/dev/shm/a,engine=aio,direct=1,size=1G"),
            Ok(LeafSpec::File {
                path: "/dev/shm/a".into(),
                engine: Engine::Aio,
                direct: true,
                size_bytes: Some(1 << 30),
                sparse: false,
            })
        );
    }

    #[test]
    fn parses_nbd() {
        assert_eq!(
            LeafSpec::parse("nbd:nbd+unix:///disk?socket=/tmp/s,connections=4,timeout=2s"),
            Ok(LeafSpec::Nbd {
                uri: "nbd+unix:///disk?socket=/tmp/s".into(),
                connections: 4,
                timeout: Duration::from_secs(2)
            })
        );
        assert_eq!(
            LeafSpec::parse("nbd:nbd://127.0.0.1:10809/"),
            Ok(LeafSpec::Nbd {
                uri: "nbd://127.0.0.1:10809/".into(),
                connections: 1,
                timeout: cairn_nbd::client::DEFAULT_TIMEOUT
            })
        );
    }

    #[test]
    fn parses_rbd() {
        let t = match LeafSpec::parse(
            "rbd:rbd/ns1/disk,conf=/etc/ceph/c.conf,id=client.cairn,snapshot=s1,timeout=5s,connection=image",
        ) {
            Ok(LeafSpec::Rbd(t)) => t,
            other => panic!("{other:?}"),
        };
        assert_eq!(t.path(), "rbd/ns1/disk@s1");
        assert_eq!(
            t.conf.as_deref(),
            Some(std::path::Path::new("/etc/ceph/c.conf"))
        );
        assert_eq!(t.id.as_deref(), Some("cairn"));
        assert_eq!(t.timeout, Duration::from_secs(5));
        assert_eq!(t.connection, crate::rbd::Connection::Image);
        let t = match LeafSpec::parse("rbd:p/img") {
            Ok(LeafSpec::Rbd(t)) => t,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            (t.pool.as_str(), t.namespace.as_deref(), t.image.as_str()),
            ("p", None, "img")
        );
        assert_eq!(t.timeout, crate::rbd::DEFAULT_TIMEOUT);
        assert_eq!(t.connection, crate::rbd::Connection::Shared);
        assert_eq!(LeafSpec::Rbd(t).default_name(), "rbd-img");
    }

    #[test]
    fn refuses() {
        for bad in [
            "null",
            "null:",
            "null:1x",
            "disk:1G",
            "mem:1G,foo=1",
            "mem:1G,block",
            "file:",
            "file:/a,engine=spdk",
            "file:/a,direct=2",
            "file:/a,size=1G,size=2G",
            "nbd:",
            "nbd:http://x/",
            "nbd:nbd://h/e,connections=0",
            "nbd:nbd://h/e,connections=17",
            "nbd:nbd://h/e,timeout=1ms",
            "nbd:nbd://h/e,timeout=x",
            "nbd:nbd://h/e,tls=1",
            "rbd:",
            "rbd:disk",
            "rbd:a/b/c/d",
            "rbd:rbd/",
            "rbd:/disk",
            "rbd:rbd/disk@s1",
            "rbd:rbd/disk,snapshot=",
            "rbd:rbd/disk,timeout=0s",
            "rbd:rbd/disk,timeout=1500ms",
            "rbd:rbd/disk,timeout=2d",
            "rbd:rbd/disk,connection=pooled",
            "rbd:rbd/disk,conf=",
            "rbd:rbd/disk,size=1G",
        ] {
            assert!(LeafSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn refusals_say_why_in_one_line() {
        for (bad, why) in [
            (
                "null",
                "expected null:SIZE, mem:SIZE, file:PATH, nbd:URI or rbd:POOL/IMAGE",
            ),
            ("null:1G,block", "option 'block' is not key=value"),
            ("null:1G,block=4k,block=8k", "option 'block' given twice"),
            ("null:1G,block=8G", "block size too large"),
            (
                "null:1G,volatile=1",
                "unknown option 'volatile' for null (known: block)",
            ),
            ("mem:1G,volatile=2", "volatile must be 0 or 1"),
            (
                "mem:1G,foo=1",
                "unknown option 'foo' for mem (known: block, volatile)",
            ),
            ("file:", "file needs a path"),
            ("file:/a,sparse=yes", "sparse must be 0 or 1"),
            (
                "file:/a,foo=1",
                "unknown option 'foo' for file (known: engine, direct, size, sparse)",
            ),
            (
                "nbd:",
                "nbd needs a URI, such as nbd://HOST/EXPORT or nbd+unix:///?socket=PATH",
            ),
            (
                "nbd://h/e",
                "an NBD URI is given after the type: nbd:nbd://h/e",
            ),
            (
                "nbds://h/e",
                "an NBD URI is given after the type: nbd:nbds://h/e",
            ),
            (
                "nbd:nbd://h/e,connections=0",
                "connections must be from 1 to 16",
            ),
            (
                "nbd:nbd://h/e,timeout=1ms",
                "timeout must be a duration from 100ms to 24h, such as 30s",
            ),
            (
                "nbd:nbd://h/e,tls=1",
                "unknown option 'tls' for nbd (known: connections, timeout)",
            ),
            (
                "disk:1G",
                "unknown type 'disk' (use null, mem, file, nbd or rbd)",
            ),
        ] {
            assert_eq!(
                LeafSpec::parse(bad).map_err(|e| e.to_string()),
                Err(format!("invalid device '{bad}': {why}")),
                "{bad}"
            );
        }
    }

    /// A caller tells refusals apart by kind: an option the type does not take, a value
    /// out of range (which option), a bad name in an rbd path (which name, which
    /// character).
    #[test]
    fn refusals_say_which_option_and_why_as_values() {
        let why = |text: &str| match LeafSpec::parse(text) {
            Err(Error::Spec { spec, why }) => {
                assert_eq!(spec, text);
                why
            }
            other => panic!("{text}: {other:?}"),
        };
        assert_eq!(
            why("file:/a,foo=1"),
            SpecError::UnknownOption {
                key: "foo".into(),
                kind: "file",
                known: "engine, direct, size, sparse",
            }
        );
        assert!(matches!(
            why("mem:1G,volatile=2"),
            SpecError::Value {
                key: "volatile",
                ..
            }
        ));
        assert!(matches!(
            why("null:1G,block=8G"),
            SpecError::Value { key: "block", .. }
        ));
        let SpecError::Leaf(e) = why("rbd:rbd/disk,snapshot=a/b") else {
            panic!("not an rbd name");
        };
        assert_eq!(
            *e,
            Error::RbdName {
                what: "snapshot".into(),
                name: "a/b".into(),
                bad: Some('/'),
            }
        );
        assert_eq!(e.to_string(), "the snapshot name 'a/b' holds '/'");
        assert_eq!(
            Engine::parse("fast"),
            Err(Error::UnknownEngine("fast".into()))
        );
    }
}
