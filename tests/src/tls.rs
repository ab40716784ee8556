//! Certificates made by a test (rcgen), a RabbitMQ node and a Redis server with TLS
//! listeners, and a one-route HTTPS server.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use crate::{PrivateRabbit, PrivateRedis};

/// A certificate and its key, as PEM files.
#[derive(Clone, Debug)]
pub struct Pair {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A test CA and what it signed, plus a second CA nobody trusts; PEM files in `dir`,
/// readable by the `rabbitmq` user.
pub struct Pki {
    pub dir: PathBuf,
    /// The CA every server and client certificate below is signed by.
    pub ca: PathBuf,
    /// Another CA (a client trusting only it must refuse the servers).
    pub other_ca: PathBuf,
    /// `localhost` and 127.0.0.1.
    pub server: Pair,
    /// A client certificate for mutual TLS.
    pub client: Pair,
    /// A server certificate for 127.0.0.1 that expired in 2021.
    pub expired: Pair,
    /// A server certificate for `elsewhere.example` only.
    pub wrong_name: Pair,
}

fn ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages =
        vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    (cert.pem(), Issuer::new(params, key))
}

fn leaf(
    issuer: &Issuer<'static, KeyPair>,
    cn: &str,
    sans: Vec<SanType>,
    usage: ExtendedKeyUsagePurpose,
    expired: bool,
) -> (String, String) {
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, cn);
    params.subject_alt_names = sans;
    params.use_authority_key_identifier_extension = true;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    params.extended_key_usages = vec![usage];
    if expired {
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
    }
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

impl Pki {
    /// Generates everything into `dir` (created).
    pub fn generate(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let write = |name: &str, text: &str| {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let pair = |name: &str, (cert, key): (String, String)| Pair {
            cert: write(&format!("{name}.pem"), &cert),
            key: write(&format!("{name}-key.pem"), &key),
        };
        let (ca_pem, issuer) = ca("chime test CA");
        let (other_pem, _) = ca("some other CA");
        let local = || {
            vec![
                SanType::DnsName("localhost".try_into().unwrap()),
                SanType::IpAddress(std::net::IpAddr::from([127, 0, 0, 1])),
            ]
        };
        let server = ExtendedKeyUsagePurpose::ServerAuth;
        let pki = Self {
            dir: dir.to_path_buf(),
            ca: write("ca.pem", &ca_pem),
            other_ca: write("other-ca.pem", &other_pem),
            server: pair("server", leaf(&issuer, "localhost", local(), server.clone(), false)),
            client: pair(
                "client",
                leaf(&issuer, "chime-client", vec![], ExtendedKeyUsagePurpose::ClientAuth, false),
            ),
            expired: pair("expired", leaf(&issuer, "localhost", local(), server.clone(), true)),
            wrong_name: pair(
                "wrong-name",
                leaf(
                    &issuer,
                    "elsewhere.example",
                    vec![SanType::DnsName("elsewhere.example".try_into().unwrap())],
                    server,
                    false,
                ),
            ),
        };
        // The RabbitMQ node runs as `rabbitmq` and must read its certificate and key.
        let _ = std::process::Command::new("chown").args(["-R", "rabbitmq:rabbitmq"]).arg(dir).status();
        let _ = std::process::Command::new("chmod").args(["-R", "a+rX"]).arg(dir).status();
        pki
    }
}

/// A private RabbitMQ node with a TLS listener that requires a client certificate signed by
/// the test CA (and its usual plaintext listener, which only the test's own helpers use).
pub async fn rabbit_with_tls(pki: &Pki, server: &Pair) -> (PrivateRabbit, u16) {
    let port = crate::free_port();
    let conf = format!(
        "listeners.ssl.default = {port}\n\
         ssl_options.cacertfile = {ca}\n\
         ssl_options.certfile = {cert}\n\
         ssl_options.keyfile = {key}\n\
         ssl_options.verify = verify_peer\n\
         ssl_options.fail_if_no_peer_cert = true\n",
        ca = pki.ca.display(),
        cert = server.cert.display(),
        key = server.key.display(),
    );
    (PrivateRabbit::start_with(&conf).await, port)
}

/// A private Redis with a TLS port that requires a client certificate signed by the test CA
/// (and a plaintext port for the test's own helpers).
pub async fn redis_with_tls(pki: &Pki, server: &Pair) -> (PrivateRedis, u16) {
    let port = crate::free_port();
    let (p, ca, cert, key) = (
        port.to_string(),
        pki.ca.display().to_string(),
        server.cert.display().to_string(),
        server.key.display().to_string(),
    );
    let args = [
        "--tls-port",
        &p,
        "--tls-cert-file",
        &cert,
        "--tls-key-file",
        &key,
        "--tls-ca-cert-file",
        &ca,
        "--tls-auth-clients",
        "yes",
    ];
    (PrivateRedis::start_with(&args).await, port)
}

/// An HTTPS server on 127.0.0.1 answering every request with `status` and counting them.
pub struct HttpsServer {
    pub port: u16,
    pub requests: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl HttpsServer {
    pub async fn start(server: &Pair, status: u16) -> Self {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        chime_shared::tls::install_crypto_provider();
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_file_iter(&server.cert).unwrap().map(Result::unwrap).collect();
        let key = PrivateKeyDer::from_pem_file(&server.key).unwrap();
        let config =
            rustls::ServerConfig::builder().with_no_client_auth().with_single_cert(certs, key).unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests = Arc::new(AtomicUsize::new(0));
        let counted = requests.clone();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, counted) = (acceptor.clone(), counted.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                    // Read the head, then the body by Content-Length.
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    let head_end = loop {
                        let Ok(n) = tls.read(&mut chunk).await else { return };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    while buf.len() < head_end + len {
                        let Ok(n) = tls.read(&mut chunk).await else { return };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                    }
                    counted.fetch_add(1, Ordering::SeqCst);
                    let reply =
                        format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                    let _ = tls.write_all(reply.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        Self { port, requests, task }
    }

    pub fn count(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for HttpsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
