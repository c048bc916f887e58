//! TLS (rustls) for STARTTLS: certificates from a directory laid out as nbdkit and QEMU
//! expect (`server-cert.pem`, `server-key.pem`, and `ca-cert.pem` to verify clients), and
//! for the client as libnbd lays them out (`ca-cert.pem` to verify the server, and
//! `client-cert.pem` with `client-key.pem` if the server asks for a certificate).

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

/// The system's trusted certificates, for `nbds://` URIs without `tls-certificates`.
const SYSTEM_ROOTS: &str = "/etc/ssl/certs/ca-certificates.crt";

/// The client side for `uri`: the server is verified against `ca-cert.pem` in its
/// `tls-certificates` directory (the system's roots without one), unless
/// `tls-verify-peer=false`; a client certificate is offered when the directory has one.
pub fn client_config(uri: &crate::uri::NbdUri) -> Result<Arc<rustls::ClientConfig>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let dir = uri.tls_certificates.as_deref();
    let builder = if uri.tls_verify_peer {
        let ca = match dir {
            Some(d) => d.join("ca-cert.pem"),
            None => std::path::PathBuf::from(SYSTEM_ROOTS),
        };
        let bad = |e: &dyn std::fmt::Display| format!("TLS: {}: {e}", ca.display());
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(&ca).map_err(|e| bad(&e))? {
            roots.add(c.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
        }
        builder.with_root_certificates(roots)
    } else {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyServer(provider)))
    };
    let client = dir.map(|d| (d.join("client-cert.pem"), d.join("client-key.pem")));
    match client {
        Some((cert, key)) if cert.exists() && key.exists() => {
            let bad = |e: &dyn std::fmt::Display| format!("TLS: {}: {e}", cert.display());
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cert)
                .map_err(|e| bad(&e))?
                .collect::<Result<_, _>>()
                .map_err(|e| bad(&e))?;
            let key = PrivateKeyDer::from_pem_file(&key)
                .map_err(|e| format!("TLS: {}: {e}", key.display()))?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| bad(&e))
                .map(Arc::new)
        }
        _ => Ok(Arc::new(builder.with_no_client_auth())),
    }
}

/// The name the server's certificate must carry: the URI's host, or `localhost` for a
/// Unix socket (as libnbd does).
pub fn server_name(uri: &crate::uri::NbdUri) -> rustls::pki_types::ServerName<'static> {
    use rustls::pki_types::ServerName;
    let host = match &uri.address {
        crate::uri::Address::Tcp { host, .. } => host.clone(),
        crate::uri::Address::Unix(_) => "localhost".to_string(),
    };
    ServerName::try_from(host)
        .unwrap_or_else(|_| ServerName::try_from("localhost").expect("a valid name"))
}

/// `tls-verify-peer=false`: any certificate is taken (signatures are still checked, so
/// the session is encrypted, just not authenticated).
#[derive(Debug)]
struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
