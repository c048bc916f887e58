//! TLS (rustls) for STARTTLS: certificates from a directory laid out as nbdkit and QEMU
//! expect (`server-cert.pem`, `server-key.pem`, and `ca-cert.pem` to verify clients), and
//! for the client as libnbd lays them out (`ca-cert.pem` to verify the server, and
//! `client-cert.pem` with `client-key.pem` if the server asks for a certificate).

use std::path::Path;
use std::sync::Arc;

use cairn_core::Error;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
pub use rustls::ServerConfig;

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
    let key = read_key(&key_path).map_err(|e| bad("server-key.pem", &e))?;
    let key_kind = describe_key(&key);
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
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
    let config = builder.with_single_cert(certs, key).map_err(|e| {
        if is_key_refusal(&e) {
            bad("server-key.pem", &key_refused(&key_kind, &e))
        } else {
            bad("server-cert.pem and server-key.pem", &e)
        }
    })?;
    Ok(Arc::new(config))
}

/// The private key in PEM file `path`; a file without one says which kinds are looked for.
fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => "no private key in the file (looked for \
             PEM blocks PRIVATE KEY, RSA PRIVATE KEY and EC PRIVATE KEY)"
            .to_string(),
        e => e.to_string(),
    })
}

/// Whether rustls refused a certificate and key because of the key itself.
fn is_key_refusal(e: &rustls::Error) -> bool {
    matches!(e, rustls::Error::General(m) if m.contains("private key"))
}

/// Why a key was refused: what it is, and what rustls (with aws-lc) signs with.
fn key_refused(kind: &str, e: &dyn std::fmt::Display) -> String {
    format!(
        "the key is {kind}, which TLS here cannot sign with (RSA keys of 2048 to 8192 bits, \
         ECDSA keys on P-256, P-384 or P-521, and Ed25519 keys work) ({e})"
    )
}

/// What a private key is, as far as its encoding tells: its algorithm, and for RSA the
/// size of its modulus, for EC its curve.
fn describe_key(key: &PrivateKeyDer<'_>) -> String {
    use pkcs8::der::Decode;
    let rsa_bits = |der: &[u8]| -> Option<usize> {
        let k = pkcs1::RsaPrivateKey::from_der(der).ok()?;
        let m = k.modulus.as_bytes();
        let first = m.iter().position(|&b| b != 0)?;
        Some((m.len() - first) * 8 - m[first].leading_zeros() as usize)
    };
    let rsa = |der: &[u8], form: &str| match rsa_bits(der) {
        Some(bits) => format!("an RSA key of {bits} bits ({form})"),
        None => format!("an RSA key that does not parse ({form})"),
    };
    match key {
        PrivateKeyDer::Pkcs1(k) => rsa(k.secret_pkcs1_der(), "PKCS#1"),
        PrivateKeyDer::Sec1(_) => "an EC key (SEC1)".to_string(),
        PrivateKeyDer::Pkcs8(k) => {
            let Ok(info) = pkcs8::PrivateKeyInfo::from_der(k.secret_pkcs8_der()) else {
                return "a PKCS#8 key that does not parse".to_string();
            };
            let curve = || match info
                .algorithm
                .parameters_oid()
                .map(|o| o.to_string())
                .as_deref()
            {
                Ok("1.2.840.10045.3.1.7") => "P-256".to_string(),
                Ok("1.3.132.0.34") => "P-384".to_string(),
                Ok("1.3.132.0.35") => "P-521".to_string(),
                Ok("1.3.132.0.10") => "secp256k1".to_string(),
                Ok(o) => format!("the curve {o}"),
                Err(_) => "an unnamed curve".to_string(),
            };
            match info.algorithm.oid.to_string().as_str() {
                "1.2.840.113549.1.1.1" => rsa(info.private_key, "PKCS#8"),
                "1.2.840.113549.1.1.10" => "an RSA-PSS key (PKCS#8)".to_string(),
                "1.2.840.10040.4.1" => "a DSA key (PKCS#8)".to_string(),
                "1.2.840.10045.2.1" => format!("an EC key on {} (PKCS#8)", curve()),
                "1.3.101.112" => "an Ed25519 key (PKCS#8)".to_string(),
                "1.3.101.113" => "an Ed448 key (PKCS#8)".to_string(),
                "1.3.101.110" | "1.3.101.111" => {
                    "an X25519 or X448 key, made for key agreement, not signing (PKCS#8)"
                        .to_string()
                }
                oid => format!("a key of algorithm {oid} (PKCS#8)"),
            }
        }
        _ => "a key of an unknown kind".to_string(),
    }
}

/// The system's trusted certificates, for `nbds://` URIs without `tls-certificates`.
const SYSTEM_ROOTS: &str = "/etc/ssl/certs/ca-certificates.crt";

/// The client side for `uri`: the server is verified against `ca-cert.pem` in its
/// `tls-certificates` directory (the system's roots without one), unless
/// `tls-verify-peer=false`; a client certificate is offered when the directory has one.
pub fn client_config(uri: &crate::uri::NbdUri) -> Result<Arc<rustls::ClientConfig>, String> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
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
            let key_path = key;
            let key =
                read_key(&key_path).map_err(|e| format!("TLS: {}: {e}", key_path.display()))?;
            let kind = describe_key(&key);
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| {
                    if is_key_refusal(&e) {
                        format!("TLS: {}: {}", key_path.display(), key_refused(&kind, &e))
                    } else {
                        bad(&e)
                    }
                })
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
