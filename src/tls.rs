//! TLS to Redis and PostgreSQL, with rustls and its `ring` crypto provider (no OpenSSL).
//!
//! - Redis: a `rediss://` URL, with the CA that signed the server's certificate
//!   (`--redis-ca-file`, else the system's trust store) and a client certificate and key
//!   when the server asks for one (`--redis-cert-file`, `--redis-key-file`), handed to
//!   redis-rs ([`redis_client`]).
//! - PostgreSQL: libpq's `sslmode` with `sslrootcert`, `sslcert`, `sslkey`, read from the
//!   connection string by `db.rs` and turned into a rustls connector here
//!   ([`pg_connector`]) with libpq's meanings: `prefer` and `require` encrypt without
//!   checking the certificate unless a root certificate is given (then the chain is
//!   checked, as `verify-ca`); `verify-ca` checks the chain; `verify-full` the chain and the
//!   host name.
//!
//! [`describe`] turns a handshake failure, wherever it sits in an error's chain, into
//! plain words for the one-line errors.

use crate::config::RedisTls;
use crate::store::{Redis, Topology};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// The one crypto provider of the process (`ring`), also installed as rustls's process
/// default, which redis-rs uses.
pub fn provider() -> Arc<CryptoProvider> {
    static P: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    P.get_or_init(|| {
        // Fails only if a provider is installed already: then that one is the default.
        let _ = rustls::crypto::ring::default_provider().install_default();
        CryptoProvider::get_default()
            .cloned()
            .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()))
    })
    .clone()
}

/// A TLS setting that cannot work (a file that cannot be read, a key without its
/// certificate): bad input, named by the flag or setting it came from.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{setting}: {problem}")]
pub struct SetupError {
    /// The flag or connection-string setting, e.g. `--redis-ca-file` or `sslrootcert`.
    pub setting: &'static str,
    pub problem: String,
}

fn setup(setting: &'static str, problem: impl Into<String>) -> SetupError {
    SetupError {
        setting,
        problem: problem.into(),
    }
}

fn read(setting: &'static str, path: &Path) -> Result<Vec<u8>, SetupError> {
    std::fs::read(path).map_err(|e| setup(setting, format!("cannot read {}: {e}", path.display())))
}

/// The certificates of a PEM file (a CA bundle or a certificate chain); at least one.
fn certificates(
    setting: &'static str,
    path: &Path,
) -> Result<(Vec<u8>, Vec<CertificateDer<'static>>), SetupError> {
    let pem = read(setting, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| setup(setting, format!("{} is not PEM: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(setup(
            setting,
            format!("{} holds no PEM certificate", path.display()),
        ));
    }
    Ok((pem, certs))
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1, not encrypted).
fn private_key(
    setting: &'static str,
    path: &Path,
) -> Result<(Vec<u8>, PrivateKeyDer<'static>), SetupError> {
    let pem = read(setting, path)?;
    let key = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
        setup(
            setting,
            format!(
                "{} holds no usable private key (PEM, not encrypted): {e}",
                path.display()
            ),
        )
    })?;
    Ok((pem, key))
}

/// The Redis client for `url`: with the CA and client certificate of `tls` for a
/// `rediss://` URL. Reads the files now, so a missing or malformed file is said at start.
pub fn redis_client(url: &str, tls: &RedisTls) -> Result<Redis, SetupError> {
    let bad_url = |detail: &str| {
        let detail = match crate::conninfo::percent_encoding_hint(url) {
            Some(hint) => format!("{detail}; {hint}"),
            None => detail.to_string(),
        };
        setup(
            "--redis-url",
            format!(
                "not a Redis URL ({detail}): e.g. redis://:password@127.0.0.1:6379/0, rediss://... for TLS, \
                 redis+cluster://host:port,host:port or redis+sentinel://host:port,host:port/<master-name>"
            ),
        )
    };
    let is_tls = match Topology::of(url) {
        Topology::Single => Redis::open(url, None).map_err(|e| bad_url(&e.0))?.is_tls(),
        _ => {
            let scheme = url.split("://").next().unwrap_or("");
            scheme.starts_with("rediss") || scheme.starts_with("valkeys")
        }
    };
    let files = [
        ("--redis-ca-file", &tls.ca_file),
        ("--redis-cert-file", &tls.cert_file),
        ("--redis-key-file", &tls.key_file),
    ];
    if !is_tls {
        if let Some((flag, _)) = files.iter().find(|(_, f)| f.is_some()) {
            return Err(setup(
                flag,
                "is for TLS, but the Redis URL does not start with rediss://",
            ));
        }
        return Redis::open(url, None).map_err(|e| bad_url(&e.0));
    }
    provider();
    let root_cert = match &tls.ca_file {
        Some(path) => Some(certificates("--redis-ca-file", path)?.0),
        None => None,
    };
    let client_tls = match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
            client_cert: certificates("--redis-cert-file", cert)?.0,
            client_key: private_key("--redis-key-file", key)?.0,
        }),
        (None, None) => None,
        (Some(_), None) => {
            return Err(setup(
                "--redis-key-file",
                "--redis-cert-file needs the key of that certificate too",
            ))
        }
        (None, Some(_)) => {
            return Err(setup(
                "--redis-cert-file",
                "--redis-key-file needs its certificate too",
            ))
        }
    };
    let certs = (root_cert.is_some() || client_tls.is_some()).then_some(redis::TlsCertificates {
        client_tls,
        root_cert,
    });
    Redis::open(url, certs).map_err(|e| setup("--redis-url", e.0))
}

/// libpq's `sslmode` (`allow` is not offered).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    pub fn parse(s: &str) -> Result<SslMode, SetupError> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(setup(
                    "sslmode",
                    format!(
                        "{other:?} is not one of disable, prefer, require, verify-ca, verify-full"
                    ),
                ))
            }
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// Where the CA certificates that PostgreSQL's certificate must chain to come from
/// (`sslrootcert`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RootCert {
    /// A PEM file of CA certificates.
    File(PathBuf),
    /// `sslrootcert=system`: the system's trust store.
    System,
}

/// The TLS settings of a PostgreSQL connection string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgTls {
    pub mode: SslMode,
    pub root: Option<RootCert>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// The rustls connector for a PostgreSQL connection with these settings. Reads the files
/// now, so a missing or malformed one is said at start.
pub fn pg_connector(t: &PgTls) -> Result<tokio_postgres_rustls::MakeRustlsConnect, SetupError> {
    let provider = provider();
    let roots = match &t.root {
        Some(RootCert::File(path)) => {
            let mut store = RootCertStore::empty();
            for c in certificates("sslrootcert", path)?.1 {
                store.add(c).map_err(|e| {
                    setup(
                        "sslrootcert",
                        format!("{}: not a CA certificate: {e}", path.display()),
                    )
                })?;
            }
            Some(store)
        }
        Some(RootCert::System) => {
            let found = rustls_native_certs::load_native_certs();
            let mut store = RootCertStore::empty();
            store.add_parsable_certificates(found.certs);
            if store.is_empty() {
                return Err(setup(
                    "sslrootcert",
                    "system: no CA certificate found in the system's trust store",
                ));
            }
            Some(store)
        }
        None => None,
    };
    let verifier: Arc<dyn ServerCertVerifier> = match (roots, t.mode) {
        (None, SslMode::VerifyCa | SslMode::VerifyFull) => {
            return Err(setup(
                "sslrootcert",
                format!(
                    "sslmode={} needs sslrootcert=<CA file> (or sslrootcert=system for the system's trust store)",
                    t.mode.as_str()
                ),
            ))
        }
        (None, _) => Arc::new(AnyCertificate(provider.clone())),
        (Some(roots), mode) => {
            let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| setup("sslrootcert", e.to_string()))?;
            if mode == SslMode::VerifyFull {
                webpki
            } else {
                Arc::new(ChainOnly(webpki))
            }
        }
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| setup("sslmode", e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let mut config = match (&t.cert, &t.key) {
        (Some(cert), Some(key)) => {
            let chain = certificates("sslcert", cert)?.1;
            let key = private_key("sslkey", key)?.1;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| setup("sslkey", format!("does not fit sslcert: {e}")))?
        }
        (None, None) => builder.with_no_client_auth(),
        (Some(_), None) => return Err(setup("sslkey", "sslcert needs sslkey too")),
        (None, Some(_)) => return Err(setup("sslcert", "sslkey needs sslcert too")),
    };
    // What libpq 17 sends; servers that do not know ALPN ignore it.
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

/// `verify-ca` (and `require` with a root certificate): the chain must lead to one of
/// the roots; the host name is not checked. webpki checks the chain before the name, so
/// a name mismatch means the chain was good.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer` and `require` without a root certificate: encrypted, the certificate not
/// checked (libpq's meaning). The handshake signatures are still verified.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
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
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The rustls error somewhere in `e`'s chain (directly, inside an `io::Error`, or behind
/// the `Arc` redis-rs keeps its causes in), said in plain words with `ca_hint` (the flag
/// or setting that names a CA) where a CA is missing. `None` when TLS is not the cause.
pub fn describe(e: &(dyn std::error::Error + 'static), ca_hint: &str) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(t) = find_rustls(err) {
            return Some(format!("TLS handshake failed: {}", words(t, ca_hint)));
        }
        cur = err.source();
    }
    None
}

fn find_rustls<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    if let Some(t) = err.downcast_ref::<rustls::Error>() {
        return Some(t);
    }
    if let Some(io) = err.downcast_ref::<std::io::Error>() {
        let inner: &(dyn std::error::Error + 'static) = io.get_ref()?;
        return find_rustls(inner);
    }
    if let Some(arc) = err.downcast_ref::<Arc<dyn std::error::Error + Send + Sync>>() {
        let inner: &(dyn std::error::Error + 'static) = &**arc;
        return find_rustls(inner);
    }
    None
}

fn words(e: &rustls::Error, ca_hint: &str) -> String {
    use rustls::AlertDescription as A;
    use rustls::Error as E;
    match e {
        E::InvalidCertificate(c) => match c {
            CertificateError::UnknownIssuer => format!(
                "certificate signed by unknown authority (give the CA that signed the server's certificate with {ca_hint})"
            ),
            CertificateError::NotValidForNameContext { expected, presented } => format!(
                "the server's certificate is not valid for {} (it names {})",
                expected.to_str(),
                presented
                    .iter()
                    .map(|p| name_of(p))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            CertificateError::NotValidForName => {
                "the server's certificate is not valid for this host name".into()
            }
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                "the server's certificate has expired".into()
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                "the server's certificate is not valid yet (check the clocks)".into()
            }
            other => format!("the server's certificate was refused: {other:?}"),
        },
        E::AlertReceived(A::CertificateRequired) => {
            "the server requires a client certificate".into()
        }
        E::AlertReceived(
            a @ (A::BadCertificate
            | A::UnknownCA
            | A::UnsupportedCertificate
            | A::CertificateUnknown
            | A::CertificateExpired
            | A::CertificateRevoked
            | A::AccessDenied
            | A::DecryptError),
        ) => format!("the server refused our client certificate ({a:?})"),
        E::InvalidMessage(_) | E::InappropriateMessage { .. } => {
            "the server does not speak TLS on this port (a plain-text port?)".into()
        }
        other => other.to_string(),
    }
}

/// A name as rustls presents it (`DnsName("db")`, `IpAddress(10.0.0.5)`), bare.
fn name_of(presented: &str) -> &str {
    let bare = presented
        .strip_prefix("DnsName(\"")
        .and_then(|s| s.strip_suffix("\")"))
        .or_else(|| {
            presented
                .strip_prefix("IpAddress(")
                .and_then(|s| s.strip_suffix(')'))
        });
    bare.unwrap_or(presented)
}
