//! Certificates and TLS clients for the end-to-end tests that run the services with mutual TLS
//! on: one CA and its certificates written where the binaries read them (`--tls-*`), channels
//! presenting a chosen identity, the certificate a server presents on a fresh handshake, and an
//! HTTPS GET for the admin port with or without a client certificate.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use br_certs::{Ca, Issued, Validity};
use br_trust::{Identity, IdentityReader, Role, TlsFiles, TlsMaterial, WorkerIds};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tonic::transport::{Channel, Endpoint};

/// The trust domain of every certificate here (the services' default).
pub const TD: &str = "balanceroute.local";

/// How long a handshake or an HTTP answer may take before a test fails (a hang, not a timing).
const PATIENCE: Duration = Duration::from_secs(20);

/// A CA and the files of the certificates it issued, in a temporary directory.
pub struct Pki {
    dir: tempfile::TempDir,
    pub ca: Ca,
}

impl Pki {
    /// A CA (`ca.pem`) and one certificate per service role, gateway and admin, under the
    /// names `scripts/dev-certs.sh` uses.
    pub fn new() -> Pki {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let ca = Ca::new("e2e CA").expect("a CA");
        std::fs::write(dir.path().join("ca.pem"), ca.cert_pem()).expect("writing ca.pem");
        let pki = Pki { dir, ca };
        for role in Role::ALL {
            if role != Role::Worker {
                let issued = pki.ca.issue_role(TD, role).expect("a role certificate");
                br_certs::write(pki.dir(), &br_certs::role_files(role), &issued)
                    .expect("writing a role certificate");
            }
        }
        pki
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn with_ca(&self, names: (String, String)) -> TlsFiles {
        TlsFiles {
            cert: self.path(&names.0),
            key: self.path(&names.1),
            ca: self.path("ca.pem"),
        }
    }

    /// A role's files (written by [`Pki::new`]).
    pub fn role(&self, role: Role) -> TlsFiles {
        self.with_ca(br_certs::role_files(role))
    }

    /// A worker's files, issued on first use.
    pub fn worker(&self, group: &str, id: u32) -> TlsFiles {
        let names = br_certs::worker_files(group, id);
        if !self.path(&names.0).exists() {
            let issued = self.ca.issue_worker(TD, group, id).expect("a worker cert");
            br_certs::write(self.dir(), &names, &issued).expect("writing a worker cert");
        }
        self.with_ca(names)
    }

    /// The files of a shim serving the ranks `workers` of `group` (one certificate naming
    /// them all), issued on first use.
    pub fn workers(&self, group: &str, workers: WorkerIds) -> TlsFiles {
        let names = br_certs::workers_files(group, workers);
        if !self.path(&names.0).exists() {
            let issued = self
                .ca
                .issue_workers(TD, group, workers)
                .expect("a multi-rank worker cert");
            br_certs::write(self.dir(), &names, &issued).expect("writing a worker cert");
        }
        self.with_ca(names)
    }

    /// Writes `issued` as `<name>.pem`/`<name>-key.pem`, with our CA as the bundle (so the
    /// client trusts our servers whoever signed its own certificate).
    pub fn custom(&self, name: &str, issued: &Issued) -> TlsFiles {
        let names = (format!("{name}.pem"), format!("{name}-key.pem"));
        br_certs::write(self.dir(), &names, issued).expect("writing a certificate");
        self.with_ca(names)
    }

    /// A Kubernetes service account's files (`spiffe://<td>/ns/<namespace>/sa/<name>`, as
    /// csi-driver-spiffe issues them), issued on first use.
    pub fn service_account(&self, namespace: &str, name: &str) -> TlsFiles {
        let names = br_certs::service_account_files(namespace, name);
        if !self.path(&names.0).exists() {
            let issued = self
                .ca
                .issue_service_account(TD, namespace, name)
                .expect("a service-account cert");
            br_certs::write(self.dir(), &names, &issued).expect("writing a service-account cert");
        }
        self.with_ca(names)
    }

    /// A gateway certificate signed by another CA.
    pub fn foreign_gateway(&self) -> TlsFiles {
        let other = Ca::new("another CA").expect("a CA");
        let issued = other.issue_role(TD, Role::Gateway).expect("a certificate");
        self.custom("foreign-gateway", &issued)
    }

    /// A gateway certificate of our CA that expired an hour ago.
    pub fn expired_gateway(&self) -> TlsFiles {
        let uri = Identity::uri_for_role(TD, Role::Gateway);
        let issued = self
            .ca
            .issue(&uri, Validity::Expired)
            .expect("a certificate");
        self.custom("expired-gateway", &issued)
    }

    /// A certificate of our CA whose SPIFFE id is of another trust domain: authenticated by
    /// the handshake, but with no BalanceRoute identity.
    pub fn stranger(&self) -> TlsFiles {
        let issued = self
            .ca
            .issue(
                "spiffe://elsewhere.example/br/admin",
                Validity::For(Duration::from_secs(3600)),
            )
            .expect("a certificate");
        self.custom("stranger", &issued)
    }

    /// `--tls-cert F --tls-key F --tls-ca F` for a service with `role`'s certificate.
    pub fn flags(&self, role: Role) -> Vec<String> {
        tls_flags(&self.role(role))
    }
}

impl Default for Pki {
    fn default() -> Self {
        Pki::new()
    }
}

/// A lazily connecting channel to `url` presenting `files`' certificate; the server must be of
/// role `expect` when given.
pub fn channel(url: &str, files: &TlsFiles, expect: Option<Role>) -> Channel {
    channel_reading(url, files, expect, IdentityReader::new(TD))
}

/// [`channel`], reading the server's identity with `reader` (a role map for servers whose
/// certificates carry service-account ids).
pub fn channel_reading(
    url: &str,
    files: &TlsFiles,
    expect: Option<Role>,
    reader: IdentityReader,
) -> Channel {
    let material = TlsMaterial::load(files.clone(), reader).expect("client TLS material");
    let endpoint = Endpoint::from_shared(url.to_owned())
        .expect("a URL")
        .connect_timeout(PATIENCE);
    br_trust::tls::connect_lazy(endpoint, Some(&material), expect)
}

/// The leaf certificate (DER) a server at `addr` presents on a fresh handshake, with ALPN
/// `alpn` (`h2` for gRPC, `http/1.1` for the admin port).
pub async fn presented_cert(
    addr: SocketAddr,
    client: &TlsFiles,
    alpn: &[u8],
) -> CertificateDer<'static> {
    let material = TlsMaterial::load(client.clone(), TD).expect("client TLS material");
    let mut cfg = (*material.client_config(None)).clone();
    cfg.alpn_protocols = vec![alpn.to_vec()];
    let handshake = async {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let name = ServerName::try_from("localhost").expect("a server name");
        tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(name, tcp)
            .await
    };
    let tls = tokio::time::timeout(PATIENCE, handshake)
        .await
        .unwrap_or_else(|_| panic!("no TLS handshake with {addr} within {PATIENCE:?}"))
        .unwrap_or_else(|e| panic!("TLS handshake with {addr}: {e}"));
    let certs = tls.get_ref().1.peer_certificates().expect("a server cert");
    certs[0].clone().into_owned()
}

/// The first certificate of a PEM file, DER.
pub fn leaf_der(pem: &str) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(pem.as_bytes()).expect("a PEM certificate")
}

/// `GET path` over HTTPS to an admin port: the status and body, or why the connection was
/// refused (handshake failed or the server closed without answering). `client`: the
/// certificate presented (`None`: none, as a kubelet probe).
pub async fn https_get(
    addr: SocketAddr,
    ca: &Path,
    client: Option<&TlsFiles>,
    path: &str,
) -> Result<(u16, String), String> {
    https_get_reading(addr, ca, client, path, IdentityReader::new(TD)).await
}

/// [`https_get`], reading the server's identity with `reader` when a client certificate is
/// presented (a role map for servers whose certificates carry service-account ids).
pub async fn https_get_reading(
    addr: SocketAddr,
    ca: &Path,
    client: Option<&TlsFiles>,
    path: &str,
    reader: IdentityReader,
) -> Result<(u16, String), String> {
    let cfg = match client {
        Some(files) => {
            let material = TlsMaterial::load(files.clone(), reader).expect("client TLS material");
            (*material.client_config(None)).clone()
        }
        None => {
            let mut roots = rustls::RootCertStore::empty();
            let pem = std::fs::read(ca).expect("reading the CA");
            for c in CertificateDer::pem_slice_iter(&pem) {
                roots.add(c.expect("a CA cert")).expect("adding the CA");
            }
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .expect("TLS versions")
                .with_root_certificates(roots)
                .with_no_client_auth()
        }
    };
    let mut cfg = cfg;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let name = ServerName::try_from("localhost").expect("a server name");
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
        tls.write_all(req.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut out = Vec::new();
        // TLS 1.3: a refused client certificate shows up here, as the server's alert
        tls.read_to_end(&mut out)
            .await
            .map_err(|e| format!("read: {e}"))?;
        Ok::<_, String>(out)
    };
    let out = tokio::time::timeout(PATIENCE, exchange)
        .await
        .unwrap_or_else(|_| panic!("GET {path} on {addr}: no answer within {PATIENCE:?}"))?;
    let text = String::from_utf8_lossy(&out);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no HTTP status line in {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// `GET path` in plaintext HTTP to a TLS port: `Ok` only if the server answered HTTP.
pub async fn plaintext_get(addr: SocketAddr, path: &str) -> Result<u16, String> {
    let exchange = async {
        let mut tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
        tcp.write_all(req.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut out = Vec::new();
        tcp.read_to_end(&mut out)
            .await
            .map_err(|e| format!("read: {e}"))?;
        Ok::<_, String>(out)
    };
    let out = tokio::time::timeout(PATIENCE, exchange)
        .await
        .unwrap_or_else(|_| panic!("plaintext GET {path} on {addr}: no end within {PATIENCE:?}"))?;
    let text = String::from_utf8_lossy(&out);
    match text.strip_prefix("HTTP/1.") {
        Some(rest) => rest
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("a broken status line: {text:?}")),
        None => Err(format!("no HTTP answer ({} bytes)", out.len())),
    }
}

/// `--tls-cert F --tls-key F --tls-ca F` for a process given `files`.
pub fn tls_flags(files: &TlsFiles) -> Vec<String> {
    let s = |p: &Path| p.to_string_lossy().into_owned();
    vec![
        "--tls-cert".into(),
        s(&files.cert),
        "--tls-key".into(),
        s(&files.key),
        "--tls-ca".into(),
        s(&files.ca),
    ]
}
