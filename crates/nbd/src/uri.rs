//! NBD URIs, in the forms libnbd and QEMU accept (the NBD project's URI specification):
//!
//!   nbd://HOST[:PORT]/[EXPORT]              TCP, port 10809 by default
//!   nbds://HOST[:PORT]/[EXPORT]             the same, TLS required
//!   nbd+unix:///[EXPORT]?socket=PATH        a Unix socket
//!   nbds+unix:///[EXPORT]?socket=PATH       a Unix socket, TLS required
//!
//! The export name is the path without its first `/`, percent-decoded. Query keys
//! understood besides `socket`: `tls-certificates=DIR` (the directory layout `cairn serve`
//! takes: `ca-cert.pem`, and `client-cert.pem` with `client-key.pem` for a client
//! certificate) and `tls-verify-peer=false`. Any other key is refused rather than ignored.

use std::path::PathBuf;

/// Where the server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// A TCP host (name, IPv4, or IPv6 without brackets) and port.
    Tcp {
        /// Host name or address.
        host: String,
        /// Port.
        port: u16,
    },
    /// A Unix socket.
    Unix(PathBuf),
}

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    /// Where the server is.
    pub address: Address,
    /// The export asked for ("" for the default).
    pub export: String,
    /// TLS required (`nbds`).
    pub tls: bool,
    /// Certificates directory for TLS.
    pub tls_certificates: Option<PathBuf>,
    /// Whether the server's certificate is checked (default true).
    pub tls_verify_peer: bool,
}

/// The NBD port.
pub const DEFAULT_PORT: u16 = 10809;

impl NbdUri {
    /// Parses `text`; the error says what is wrong with it.
    pub fn parse(text: &str) -> Result<NbdUri, crate::Error> {
        let bad = |why: &str| crate::Error::Uri {
            uri: text.to_string(),
            why: why.to_string(),
        };
        let u = url::Url::parse(text).map_err(|e| bad(&e.to_string()))?;
        let (tls, unix) = match u.scheme() {
            "nbd" => (false, false),
            "nbds" => (true, false),
            "nbd+unix" => (false, true),
            "nbds+unix" => (true, true),
            other => {
                return Err(bad(&format!(
                    "unknown scheme '{other}' (nbd, nbds, nbd+unix, nbds+unix)"
                )))
            }
        };
        if !u.username().is_empty() || u.password().is_some() {
            return Err(bad("user names are not supported"));
        }
        if u.fragment().is_some() {
            return Err(bad("a fragment (#...) means nothing here"));
        }
        let path = u.path();
        let raw_export = path.strip_prefix('/').unwrap_or(path);
        let export =
            percent_decode(raw_export).ok_or_else(|| bad("the export name is not UTF-8"))?;
        let (mut socket, mut certificates, mut verify) = (None, None, true);
        for (k, v) in u.query_pairs() {
            match &*k {
                "socket" => socket = Some(PathBuf::from(&*v)),
                "tls-certificates" => certificates = Some(PathBuf::from(&*v)),
                "tls-verify-peer" => {
                    verify = match &*v {
                        "true" | "1" | "yes" => true,
                        "false" | "0" | "no" => false,
                        _ => return Err(bad("tls-verify-peer is true or false")),
                    }
                }
                other => return Err(bad(&format!("unknown query key '{other}'"))),
            }
        }
        let address = if unix {
            if u.host_str().is_some_and(|h| !h.is_empty()) {
                return Err(bad(
                    "a +unix URI has no host (nbd+unix:///EXPORT?socket=PATH)",
                ));
            }
            match socket {
                Some(p) if !p.as_os_str().is_empty() => Address::Unix(p),
                _ => return Err(bad("a +unix URI needs ?socket=PATH")),
            }
        } else {
            if socket.is_some() {
                return Err(bad("socket= is for nbd+unix:// URIs"));
            }
            let host = match u.host() {
                Some(url::Host::Ipv6(a)) => a.to_string(),
                Some(h) => h.to_string(),
                None => return Err(bad("no host")),
            };
            if host.is_empty() {
                return Err(bad("no host"));
            }
            Address::Tcp {
                host,
                port: u.port().unwrap_or(DEFAULT_PORT),
            }
        };
        Ok(NbdUri {
            address,
            export,
            tls,
            tls_certificates: certificates,
            tls_verify_peer: verify,
        })
    }
}

/// `%XX` decoding (the `url` crate leaves paths encoded).
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok()?;
            if let Ok(v) = u8::from_str_radix(hex, 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(host: &str, port: u16) -> Address {
        Address::Tcp {
            host: host.into(),
            port,
        }
    }

    #[test]
    fn the_forms_libnbd_and_qemu_accept() {
        let u = NbdUri::parse("nbd://example.com/disk").unwrap();
        assert_eq!(u.address, tcp("example.com", 10809));
        assert_eq!((u.export.as_str(), u.tls), ("disk", false));
        let u = NbdUri::parse("nbds://10.0.0.2:10810/").unwrap();
        assert_eq!(u.address, tcp("10.0.0.2", 10810));
        assert_eq!((u.export.as_str(), u.tls), ("", true));
        let u = NbdUri::parse("nbd://[::1]:9000/a%20b").unwrap();
        assert_eq!(u.address, tcp("::1", 9000));
        assert_eq!(u.export, "a b");
        let u = NbdUri::parse("nbd+unix:///vm1?socket=/run/nbd.sock").unwrap();
        assert_eq!(u.address, Address::Unix("/run/nbd.sock".into()));
        assert_eq!(u.export, "vm1");
        let u = NbdUri::parse("nbd+unix://?socket=/tmp/s").unwrap();
        assert_eq!(u.export, "");
        let u = NbdUri::parse(
            "nbds+unix:///x?socket=/s&tls-certificates=/etc/pki/nbd&tls-verify-peer=false",
        )
        .unwrap();
        assert!(u.tls && !u.tls_verify_peer);
        assert_eq!(u.tls_certificates, Some("/etc/pki/nbd".into()));
        assert_eq!(NbdUri::parse("nbd://h").unwrap().export, "");
    }

    #[test]
    fn bad_uris_say_why() {
        for (text, why) in [
            ("http://h/x", "unknown scheme"),
            ("nbd+unix:///x", "needs ?socket"),
            ("nbd+unix://host/x?socket=/s", "no host"),
            ("nbd://h/x?socket=/s", "socket= is for"),
            ("nbd://h/x?color=red", "unknown query key 'color'"),
            ("nbd://u@h/x", "user names"),
            ("nbd://h/x#f", "fragment"),
            ("nbd://h:99999/", "invalid port"),
            ("nbd:///x", "host"),
            ("nbd://h/x?tls-verify-peer=maybe", "true or false"),
        ] {
            let e = NbdUri::parse(text).unwrap_err();
            assert!(
                matches!(&e, crate::Error::Uri { uri, why: w } if uri == text && w.contains(why)),
                "{text}: {e:?}"
            );
        }
    }

    #[test]
    fn percent_decoding_keeps_what_is_not_an_escape() {
        assert_eq!(percent_decode("a%2Fb").as_deref(), Some("a/b"));
        assert_eq!(percent_decode("100%").as_deref(), Some("100%"));
        assert_eq!(percent_decode("%zz%4").as_deref(), Some("%zz%4"));
        assert_eq!(percent_decode("%ff"), None);
    }
}
