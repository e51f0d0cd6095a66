//! Mutual TLS with certificates that rotate under a running process.
//!
//! [`TlsMaterial`] loads the certificate chain, key and CA bundle from files and reloads them
//! when the files change (cert-manager and SPIRE rotate them in place): a background task
//! re-reads the files every `reload_every`, and a rotation that does not parse (a half-written
//! file) keeps the old material and is logged. Nothing is cached elsewhere: the rustls configs
//! built here read the current material on every handshake, so new connections use the new
//! certificate at once and established connections (and their streams) are untouched.
//!
//! Servers require a client certificate chained to the CA ([`TlsMaterial::server_config`]);
//! what the peer may do is decided after the handshake by its SPIFFE identity (`policy`).
//! Clients verify the server's chain against the CA and that the server presents an identity
//! of the trust domain (optionally of one expected role); DNS names are not checked, as in
//! SPIFFE's own TLS profile, so certificates need no per-address SANs.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::accept::Held;
use crate::identity::{Identity, IdentityReader, Role};

/// Where a process's certificate, key and CA bundle live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM: the certificate, then any intermediates.
    pub cert: PathBuf,
    /// PEM: its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM: the CA certificates peers are verified against.
    pub ca: PathBuf,
}

/// Why TLS material could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path}: no PEM {what} in the file")]
    Empty { path: PathBuf, what: &'static str },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("the certificate and key do not form a usable pair: {0}")]
    KeyPair(String),
    #[error("the CA bundle cannot verify clients: {0}")]
    Verifier(String),
    /// `--spiffe-role-map` is not usable (checked with the files, before anything is served).
    #[error(transparent)]
    RoleMap(#[from] crate::rolemap::RoleMapError),
}

/// One loaded generation of the files.
struct Generation {
    raw: [Vec<u8>; 3],
    certified: Arc<CertifiedKey>,
    roots: Arc<RootCertStore>,
    client_verifier: Arc<dyn ClientCertVerifier>,
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation").finish_non_exhaustive()
    }
}

/// The current certificate, key and CA of this process, reloaded when their files change.
#[derive(Debug)]
pub struct TlsMaterial {
    files: TlsFiles,
    reader: IdentityReader,
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<Generation>>,
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

fn parse_certs(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
    let certs = certs.map_err(|e| TlsError::Parse {
        path: path.to_owned(),
        message: e.to_string(),
    })?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            path: path.to_owned(),
            what: "certificate",
        });
    }
    Ok(certs)
}

impl TlsMaterial {
    /// Loads the files once (an error names the file); call [`TlsMaterial::watch`] to follow
    /// rotations. `reader`: how peers' (and our own) certificates are read, a trust domain
    /// (`br/...` ids only) or an [`IdentityReader`] with a role map.
    pub fn load(
        files: TlsFiles,
        reader: impl Into<IdentityReader>,
    ) -> Result<Arc<TlsMaterial>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let generation = Self::build(&files, &provider)?;
        Ok(Arc::new(TlsMaterial {
            files,
            reader: reader.into(),
            provider,
            current: RwLock::new(Arc::new(generation)),
        }))
    }

    fn build(files: &TlsFiles, provider: &Arc<CryptoProvider>) -> Result<Generation, TlsError> {
        let raw = [read(&files.cert)?, read(&files.key)?, read(&files.ca)?];
        let chain = parse_certs(&files.cert, &raw[0])?;
        let key = PrivateKeyDer::from_pem_slice(&raw[1]).map_err(|e| TlsError::Parse {
            path: files.key.clone(),
            message: e.to_string(),
        })?;
        let signing = provider
            .key_provider
            .load_private_key(key)
            .map_err(|e| TlsError::KeyPair(e.to_string()))?;
        let certified = CertifiedKey::new(chain, signing);
        certified
            .keys_match()
            .map_err(|e| TlsError::KeyPair(e.to_string()))?;
        let mut roots = RootCertStore::empty();
        for ca in parse_certs(&files.ca, &raw[2])? {
            roots.add(ca).map_err(|e| TlsError::Parse {
                path: files.ca.clone(),
                message: e.to_string(),
            })?;
        }
        let roots = Arc::new(roots);
        let client_verifier =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
                .build()
                .map_err(|e| TlsError::Verifier(e.to_string()))?;
        Ok(Generation {
            raw,
            certified: Arc::new(certified),
            roots,
            client_verifier,
        })
    }

    fn generation(&self) -> Arc<Generation> {
        match self.current.read() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Re-reads the files; swaps in the new material if they changed and parse. Returns
    /// whether it swapped.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let now = self.generation();
        let raw = [
            read(&self.files.cert)?,
            read(&self.files.key)?,
            read(&self.files.ca)?,
        ];
        if raw == now.raw {
            return Ok(false);
        }
        let next = Self::build(&self.files, &self.provider)?;
        match self.current.write() {
            Ok(mut g) => *g = Arc::new(next),
            Err(poisoned) => *poisoned.into_inner() = Arc::new(next),
        }
        Ok(true)
    }

    /// Follows rotations: every `every`, [`TlsMaterial::reload`] until `stop` (or until the
    /// last other reference to the material is gone). A failed reload keeps the current
    /// material and is logged at WARN (the next tick tries again).
    pub fn watch(self: &Arc<Self>, every: Duration, stop: CancellationToken) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let Some(material) = weak.upgrade() else {
                    return;
                };
                match material.reload() {
                    Ok(true) => {
                        tracing::info!(cert = %material.files.cert.display(), "TLS certificate reloaded")
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "TLS files changed but cannot be loaded; keeping the current certificate")
                    }
                }
            }
        });
    }

    pub fn trust_domain(&self) -> &str {
        self.reader.trust_domain()
    }

    /// How this process reads identities (its servers' authorisation and its clients'
    /// check of servers use the same).
    pub fn reader(&self) -> &IdentityReader {
        &self.reader
    }

    /// This process's own identity, from its certificate.
    pub fn own_identity(&self) -> Result<Identity, crate::identity::IdentityError> {
        let g = self.generation();
        let leaf = g.certified.cert.first().map(|c| c.as_ref()).unwrap_or(&[]);
        self.reader.read_cert_der(leaf)
    }

    /// A server config that requires a client certificate chained to the CA. `alpn`: the
    /// protocols served (`h2` for gRPC, `http/1.1` for the admin server).
    pub fn server_config(self: &Arc<Self>, alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
        self.server_config_with(alpn, true)
    }

    /// A server config that asks for a client certificate and verifies one if given, but also
    /// lets clients without one connect: for the admin port, whose `/livez` and `/readyz` a
    /// kubelet probes without a certificate (the routes that reveal anything check the
    /// identity themselves, see `admin`).
    pub fn server_config_optional_client(
        self: &Arc<Self>,
        alpn: &[&[u8]],
    ) -> Arc<rustls::ServerConfig> {
        self.server_config_with(alpn, false)
    }

    fn server_config_with(
        self: &Arc<Self>,
        alpn: &[&[u8]],
        mandatory: bool,
    ) -> Arc<rustls::ServerConfig> {
        let verifier = Arc::new(CurrentClientVerifier {
            material: self.clone(),
            mandatory,
        });
        let builder = rustls::ServerConfig::builder_with_provider(self.provider.clone());
        let mut config = default_versions(builder)
            .with_client_cert_verifier(verifier)
            .with_cert_resolver(Arc::new(CurrentCert(self.clone())));
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }

    /// A client config presenting this process's certificate and accepting a server whose
    /// chain leads to the CA and whose identity is of the trust domain (and of `expect`, if
    /// given). ALPN `h2`.
    pub fn client_config(self: &Arc<Self>, expect: Option<Role>) -> Arc<rustls::ClientConfig> {
        let verifier = Arc::new(SpiffeServerVerifier {
            material: self.clone(),
            expect,
        });
        let builder = rustls::ClientConfig::builder_with_provider(self.provider.clone());
        let mut config = default_versions(builder)
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_cert_resolver(Arc::new(CurrentCert(self.clone())));
        config.alpn_protocols = vec![b"h2".to_vec()];
        Arc::new(config)
    }
}

/// rustls' default protocol versions (TLS 1.3 and 1.2) on a builder for either side.
fn default_versions<S: rustls::ConfigSide>(
    builder: rustls::ConfigBuilder<S, rustls::WantsVersions>,
) -> rustls::ConfigBuilder<S, rustls::WantsVerifier> {
    builder
        .with_protocol_versions(rustls::DEFAULT_VERSIONS)
        .expect("the ring provider supports the default protocol versions")
}

/// The handshake-signature checks both verifiers share: the provider's algorithms, nothing of
/// our own (what differs between them is how the certificate chain is judged).
macro_rules! handshake_signatures {
    () => {
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            let algorithms = &self.material.provider.signature_verification_algorithms;
            verify_tls12_signature(message, cert, dss, algorithms)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            let algorithms = &self.material.provider.signature_verification_algorithms;
            verify_tls13_signature(message, cert, dss, algorithms)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            let algorithms = &self.material.provider.signature_verification_algorithms;
            algorithms.supported_schemes()
        }
    };
}

/// Serves (and presents, as a client) whatever certificate is current.
#[derive(Debug)]
struct CurrentCert(Arc<TlsMaterial>);

impl ResolvesServerCert for CurrentCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.generation().certified.clone())
    }
}

impl rustls::client::ResolvesClientCert for CurrentCert {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.0.generation().certified.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Verifies client chains against whatever CA bundle is current.
#[derive(Debug)]
struct CurrentClientVerifier {
    material: Arc<TlsMaterial>,
    mandatory: bool,
}

impl ClientCertVerifier for CurrentClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        self.mandatory
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // Hints are optional; the CA bundle can change under us, so send none.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let g = self.material.generation();
        g.client_verifier
            .verify_client_cert(end_entity, intermediates, now)
    }

    handshake_signatures!();
}

/// A server is who its SPIFFE id says, in our trust domain, chained to our CA.
#[derive(Debug)]
struct SpiffeServerVerifier {
    material: Arc<TlsMaterial>,
    expect: Option<Role>,
}

impl ServerCertVerifier for SpiffeServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let g = self.material.generation();
        let parsed = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &g.roots,
            intermediates,
            now,
            self.material.provider.signature_verification_algorithms.all,
        )?;
        let identity = self
            .material
            .reader
            .read_cert_der(end_entity)
            .map_err(|e| rustls::Error::General(format!("server identity: {e}")))?;
        if let Some(want) = self.expect
            && !identity.role.serves_as(want)
        {
            return Err(rustls::Error::General(format!(
                "the server is {identity}, not a {want}"
            )));
        }
        Ok(ServerCertVerified::assertion())
    }

    handshake_signatures!();
}

/// Connects a tonic channel over mutual TLS: `Endpoint::connect_with_connector(connector(..))`.
/// The URI's host and port are dialled as they are (scheme `http`: TLS is done here).
pub fn connector(
    config: Arc<rustls::ClientConfig>,
) -> impl tower::Service<
    http::Uri,
    Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>,
    Error = io::Error,
    Future = impl Future<
        Output = io::Result<hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>>,
    > + Send,
> + Clone
+ Send {
    tower::service_fn(move |uri: http::Uri| {
        let config = config.clone();
        async move {
            let host = uri
                .host()
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no host in the URI"))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            let port = uri.port_u16().unwrap_or(443);
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let name = ServerName::try_from(host)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await?;
            Ok(hyper_util::rt::TokioIo::new(tls))
        }
    })
}

/// Called with `"handshake"` or `"timeout"` for each failed TLS handshake (for a counter).
pub type HandshakeFailureHook = Arc<dyn Fn(&str) + Send + Sync>;

/// Completes the TLS handshakes of `accepted` connections (see [`crate::accept::accept`] for
/// their bounds) concurrently: a slow or silent client holds only its own task, for at most
/// `handshake_timeout`. Yields established streams for `Server::serve_with_incoming`. Failed
/// handshakes are logged at DEBUG and passed to `on_failure` (for a counter).
pub fn incoming(
    accepted: impl futures::Stream<Item = io::Result<Held<TcpStream>>> + Send + 'static,
    config: Arc<rustls::ServerConfig>,
    handshake_timeout: Duration,
    on_failure: Option<HandshakeFailureHook>,
) -> tokio_stream::wrappers::ReceiverStream<
    io::Result<tokio_rustls::server::TlsStream<Held<TcpStream>>>,
> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    tokio::spawn(async move {
        let mut accepted = std::pin::pin!(accepted);
        loop {
            let tcp = tokio::select! {
                () = tx.closed() => return,
                next = futures::StreamExt::next(&mut accepted) => match next {
                    Some(Ok(tcp)) => tcp,
                    Some(Err(_)) => continue, // logged and counted by the accept loop
                    None => return,
                },
            };
            let peer: Option<SocketAddr> = tcp.peer_addr().ok();
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            let on_failure = on_failure.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(handshake_timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(?peer, error = %e, "TLS handshake failed");
                        if let Some(f) = &on_failure {
                            f("handshake");
                        }
                    }
                    Err(_) => {
                        tracing::debug!(?peer, "TLS handshake timed out");
                        if let Some(f) = &on_failure {
                            f("timeout");
                        }
                    }
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// A lazily connecting channel to `endpoint`: plaintext without `tls`, mutual TLS with it
/// (verifying that the server is of role `expect`, when given). Every client of a service
/// connects through this, so TLS is one flag away for all of them.
pub fn connect_lazy(
    endpoint: tonic::transport::Endpoint,
    tls: Option<&Arc<TlsMaterial>>,
    expect: Option<Role>,
) -> tonic::transport::Channel {
    match tls {
        None => endpoint.connect_lazy(),
        Some(material) => {
            endpoint.connect_with_connector_lazy(connector(material.client_config(expect)))
        }
    }
}

/// Connects now (see [`connect_lazy`]).
pub async fn connect(
    endpoint: &tonic::transport::Endpoint,
    tls: Option<&Arc<TlsMaterial>>,
    expect: Option<Role>,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    match tls {
        None => endpoint.connect().await,
        Some(material) => {
            endpoint
                .connect_with_connector(connector(material.client_config(expect)))
                .await
        }
    }
}
