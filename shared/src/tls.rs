//! TLS for RabbitMQ (`amqps://`) and Redis (`rediss://`): rustls with the platform's roots
//! (`SSL_CERT_FILE` / `SSL_CERT_DIR` are honoured), or a CA file alone when `[amqp.tls]` /
//! `[redis.tls]` names one, and a client certificate for mutual TLS.
//!
//! chime never falls back to plaintext: a TLS URL either completes a verified handshake or
//! fails with an error that names the endpoint and the TLS cause
//! ([`explain`]). Settings that would be ignored (TLS files with a plain URL), a list that
//! mixes plain and TLS URLs, and Redis's `#insecure` are rejected by
//! [`crate::Config::validate`].

use serde::Deserialize;
use std::path::{Path, PathBuf};

/// `[amqp.tls]` / `[redis.tls]`: what TLS needs beyond the platform's roots. Only used with
/// `amqps://` / `rediss://` URLs (set with a plain URL it is an error, never ignored).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM file of the CA(s) that sign the server's certificate, trusted instead of the
    /// platform's roots.
    pub ca_file: Option<PathBuf>,
    /// PEM certificate chain presented to the server (mutual TLS; needs `client_key`).
    pub client_cert: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of `client_cert`.
    pub client_key: Option<PathBuf>,
}

/// Makes rustls's ring provider the process default unless one is set already (a program
/// that links rustls with another provider too would otherwise have none).
#[cfg(feature = "tls")]
pub fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// A TLS file that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {message}")]
pub struct TlsFileError {
    /// The setting (`amqp.tls.ca_file`).
    pub key: String,
    /// What is wrong with the file.
    pub message: String,
}

/// Reads the PEM file of setting `key`, checking that it holds a `what` block
/// (`CERTIFICATE`, `PRIVATE KEY`).
pub fn read_pem(key: &str, path: &Path, what: &str) -> Result<Vec<u8>, TlsFileError> {
    let bytes = std::fs::read(path).map_err(|e| TlsFileError {
        key: key.into(),
        message: format!("cannot read {}: {e}", path.display()),
    })?;
    let text = String::from_utf8_lossy(&bytes);
    let found = text.lines().any(|l| l.starts_with("-----BEGIN ") && l.contains(what));
    if !found {
        return Err(TlsFileError {
            key: key.into(),
            message: format!("{} holds no PEM {what} block", path.display()),
        });
    }
    Ok(bytes)
}

/// The three files of one `[*.tls]` section, read and checked.
#[derive(Debug, Default)]
pub struct TlsFiles {
    /// PEM CA certificates to trust.
    pub ca: Option<Vec<u8>>,
    /// PEM client certificate chain and key (mutual TLS).
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl TlsFiles {
    /// Reads the files `tls` names; `section` is `amqp.tls` or `redis.tls` (for errors).
    pub fn read(section: &str, tls: &TlsConfig) -> Result<Self, TlsFileError> {
        let ca = match &tls.ca_file {
            Some(p) => Some(read_pem(&format!("{section}.ca_file"), p, "CERTIFICATE")?),
            None => None,
        };
        let identity = match (&tls.client_cert, &tls.client_key) {
            (Some(c), Some(k)) => Some((
                read_pem(&format!("{section}.client_cert"), c, "CERTIFICATE")?,
                read_pem(&format!("{section}.client_key"), k, "PRIVATE KEY")?,
            )),
            (None, None) => None,
            (Some(_), None) => {
                return Err(TlsFileError {
                    key: format!("{section}.client_key"),
                    message: "client_cert is set without client_key".into(),
                });
            }
            (None, Some(_)) => {
                return Err(TlsFileError {
                    key: format!("{section}.client_cert"),
                    message: "client_key is set without client_cert".into(),
                });
            }
        };
        Ok(Self { ca, identity })
    }
}

/// The TLS connector for `amqps://` under `[amqp.tls]`: verified against the platform's roots
/// (`SSL_CERT_FILE` / `SSL_CERT_DIR` honoured), or against `amqp.tls.ca_file` alone when it is
/// set — as for Redis: a broker with a private CA is not also vouched for by every public CA.
/// The client certificate is presented when configured. (lapin's own TLS setup would trust the
/// CA file in addition to the platform's roots.)
#[cfg(feature = "tls")]
pub fn amqp_tls(tls: &TlsConfig) -> Result<lapin::tcp::RustlsConnector, TlsFileError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let key = "amqp.tls";
    let files = TlsFiles::read(key, tls)?;
    let invalid = |what: &str, e: &dyn std::fmt::Display| TlsFileError {
        key: format!("{key}.{what}"),
        message: format!("not usable: {e}"),
    };
    let roots: Vec<CertificateDer<'static>> = match &files.ca {
        Some(pem) => CertificateDer::pem_slice_iter(pem)
            .collect::<Result<_, _>>()
            .map_err(|e| invalid("ca_file", &e))?,
        None => {
            let found = rustls_native_certs::load_native_certs();
            for e in &found.errors {
                tracing::debug!(error = %e, "a platform root certificate could not be loaded");
            }
            found.certs
        }
    };
    let mut tls = lapin::tcp::RustlsConnectorConfig::default();
    tls.add_parsable_certificates(roots);
    let connector = match files.identity {
        Some((chain, pem_key)) => {
            let certs = CertificateDer::pem_slice_iter(&chain)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| invalid("client_cert", &e))?;
            let private = PrivateKeyDer::from_pem_slice(&pem_key).map_err(|e| invalid("client_key", &e))?;
            tls.connector_with_single_cert(certs, private)
        }
        None => tls.connector_with_no_client_auth(),
    };
    connector.map_err(|e| invalid("ca_file", &e))
}

/// A Redis client for `url` with `[redis.tls]`: `rediss://` is verified against the platform's
/// roots, or against `redis.tls.ca_file` alone when it is set; a client certificate is
/// presented when configured.
pub fn redis_client(url: &str, tls: &TlsConfig) -> redis::RedisResult<redis::Client> {
    #[cfg(feature = "tls")]
    install_crypto_provider();
    if *tls == TlsConfig::default() {
        return redis::Client::open(url);
    }
    redis_client_with_files(url, tls)
}

#[cfg(not(feature = "tls"))]
fn redis_client_with_files(_: &str, _: &TlsConfig) -> redis::RedisResult<redis::Client> {
    Err(redis::RedisError::from((
        redis::ErrorKind::InvalidClientConfig,
        "TLS",
        "[redis.tls] needs chime-shared's `tls` feature".to_string(),
    )))
}

#[cfg(feature = "tls")]
fn redis_client_with_files(url: &str, tls: &TlsConfig) -> redis::RedisResult<redis::Client> {
    let files = TlsFiles::read("redis.tls", tls).map_err(|e| {
        redis::RedisError::from((redis::ErrorKind::InvalidClientConfig, "TLS", e.to_string()))
    })?;
    redis::Client::build_with_tls(
        url,
        redis::TlsCertificates {
            client_tls: files
                .identity
                .map(|(client_cert, client_key)| redis::ClientTlsConfig { client_cert, client_key }),
            root_cert: files.ca,
        },
    )
}

/// Says in words what a TLS failure in `error` (lapin's, redis's or reqwest's text) means,
/// when it is one.
pub fn explain(error: &str) -> Option<&'static str> {
    const CAUSES: &[(&str, &str)] = &[
        (
            "UnknownIssuer",
            "TLS: the server's certificate is signed by a CA this client does not trust \
             (set tls.ca_file to the CA's PEM, or SSL_CERT_FILE)",
        ),
        (
            "NotValidForName",
            "TLS: the server's certificate does not name the host in the URL (connect by a name \
             the certificate lists)",
        ),
        ("not valid for name", "TLS: the server's certificate does not name the host in the URL"),
        ("Expired", "TLS: the server's certificate has expired (or the local clock is wrong)"),
        ("certificate expired", "TLS: the server's certificate has expired (or the local clock is wrong)"),
        ("NotValidYet", "TLS: the server's certificate is not valid yet (or the local clock is wrong)"),
        ("Revoked", "TLS: the server's certificate is revoked"),
        (
            "CertificateRequired",
            "TLS: the server requires a client certificate (set tls.client_cert and tls.client_key)",
        ),
        ("UnknownCA", "TLS: the server does not trust this client's certificate (AlertReceived(UnknownCA))"),
        (
            "BadCertificate",
            "TLS: the server rejected this client's certificate (AlertReceived(BadCertificate))",
        ),
        ("InvalidContentType", "TLS: the server did not answer with TLS (is this a plaintext port?)"),
        ("CorruptMessage", "TLS: the server did not answer with TLS (is this a plaintext port?)"),
    ];
    CAUSES.iter().find(|(needle, _)| error.contains(needle)).map(|(_, says)| *says)
}

/// An error and its causes, one after the other, followed by what it means when it is a
/// TLS failure (reqwest's `error sending request` alone says nothing).
pub fn describe_error(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    with_explanation(out)
}

/// `error`, followed by what it means when it is a TLS failure.
pub fn with_explanation(error: String) -> String {
    match explain(&error) {
        Some(says) if !error.contains(says) => format!("{error} ({says})"),
        _ => error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_causes_are_named() {
        let e = "invalid peer certificate: UnknownIssuer".to_string();
        assert!(with_explanation(e).contains("signed by a CA this client does not trust"));
        assert!(explain("invalid peer certificate: NotValidForName").unwrap().contains("does not name"));
        assert!(explain("invalid peer certificate: Expired").unwrap().contains("expired"));
        assert_eq!(explain("Connection refused (os error 111)"), None);
    }

    #[test]
    fn half_an_identity_is_refused() {
        let tls = TlsConfig { client_cert: Some("/x.pem".into()), ..TlsConfig::default() };
        let e = TlsFiles::read("redis.tls", &tls).unwrap_err();
        assert_eq!(e.key, "redis.tls.client_key");
        let e = read_pem("amqp.tls.ca_file", Path::new("/nonexistent/ca.pem"), "CERTIFICATE").unwrap_err();
        assert!(e.to_string().starts_with("amqp.tls.ca_file: cannot read /nonexistent/ca.pem"), "{e}");
    }
}
