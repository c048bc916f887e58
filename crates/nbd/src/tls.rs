//! TLS (rustls) for STARTTLS: certificates from a directory laid out as nbdkit and QEMU
//! expect (`server-cert.pem`, `server-key.pem`, and `ca-cert.pem` to verify clients).

use std::path::Path;
use std::sync::Arc;

use cairn_core::Error;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;

/// Loads the server's certificate chain and key from `dir`; with `verify_peer`, clients
/// must present a certificate signed by `dir/ca-cert.pem`.
pub fn load(dir: &Path, verify_peer: bool) -> Result<Arc<ServerConfig>, Error> {
    let bad = |what: &str, e: &dyn std::fmt::Display| {
        Error::Invalid(format!("--tls-certificates {}: {what}: {e}", dir.display()))
    };
    let cert_path = dir.join("server-cert.pem");
    let key_path = dir.join("server-key.pem");
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cert_path)
        .map_err(|e| bad("server-cert.pem", &e))?
        .collect::<Result<_, _>>()
        .map_err(|e| bad("server-cert.pem", &e))?;
    if certs.is_empty() {
        return Err(bad("server-cert.pem", &"no certificate in the file"));
    }
    let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|e| bad("server-key.pem", &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("protocol versions", &e))?;
    let builder = if verify_peer {
        let mut roots = rustls::RootCertStore::empty();
        let ca_path = dir.join("ca-cert.pem");
        for c in CertificateDer::pem_file_iter(&ca_path).map_err(|e| bad("ca-cert.pem", &e))? {
            let c = c.map_err(|e| bad("ca-cert.pem", &e))?;
            roots.add(c).map_err(|e| bad("ca-cert.pem", &e))?;
        }
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| bad("ca-cert.pem", &e))?;
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let config = builder
        .with_single_cert(certs, key)
        .map_err(|e| bad("server-cert.pem and server-key.pem", &e))?;
    Ok(Arc::new(config))
}
