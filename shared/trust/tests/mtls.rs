//! Mutual TLS end to end on 127.0.0.1: a real tonic server behind br-trust's acceptor and
//! authorisation layer, real tonic clients through br-trust's connector, certificates from
//! br-certs. Each case asserts a typed outcome; no handshake is mocked.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use br_certs::{Ca, Issued, Validity};
use br_proto::v1;
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::decision_server::{Decision, DecisionServer};
use br_trust::policy::{self, AuthzLayer, DenyReason};
use br_trust::tls::{self, TlsFiles, TlsMaterial};
use br_trust::{Identity, Role};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};

const TD: &str = "balanceroute.local";
const PATIENCE: Duration = Duration::from_secs(20);

/// Answers Assign with the caller's SPIFFE id as the endpoint, so a test sees which identity
/// the handler was given.
struct Echo;

#[tonic::async_trait]
impl Decision for Echo {
    async fn assign(
        &self,
        req: tonic::Request<v1::AssignRequest>,
    ) -> Result<tonic::Response<v1::AssignResponse>, tonic::Status> {
        let who = policy::caller(&req).map(|i| i.spiffe_id.clone());
        Ok(tonic::Response::new(v1::AssignResponse {
            endpoint: who.unwrap_or_default(),
            ..Default::default()
        }))
    }

    async fn cancel(
        &self,
        _req: tonic::Request<v1::CancelRequest>,
    ) -> Result<tonic::Response<v1::CancelResponse>, tonic::Status> {
        Ok(tonic::Response::new(v1::CancelResponse::default()))
    }
}

struct Pki {
    dir: tempfile::TempDir,
    ca: Ca,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::new("test CA").unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.cert_pem()).unwrap();
        Pki { dir, ca }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes `issued` as `<name>.pem` / `<name>-key.pem`; returns the files with our CA.
    fn files(&self, name: &str, issued: &Issued) -> TlsFiles {
        let names = (format!("{name}.pem"), format!("{name}-key.pem"));
        br_certs::write(self.dir.path(), &names, issued).unwrap();
        TlsFiles {
            cert: self.path(&names.0),
            key: self.path(&names.1),
            ca: self.path("ca.pem"),
        }
    }

    fn role(&self, role: Role) -> TlsFiles {
        self.files(role.as_str(), &self.ca.issue_role(TD, role).unwrap())
    }
}

struct Server {
    addr: std::net::SocketAddr,
    material: Arc<TlsMaterial>,
    health: tonic_health::server::HealthReporter,
    denials: Arc<Mutex<Vec<(DenyReason, String)>>>,
    stop: CancellationToken,
}

async fn serve(files: TlsFiles) -> Server {
    let material = TlsMaterial::load(files, TD).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tls::incoming(
        br_trust::accept::accept(listener, Default::default(), None),
        material.server_config(&[b"h2"]),
        Duration::from_secs(5),
        None,
    );
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<DecisionServer<Echo>>().await;
    let denials = Arc::new(Mutex::new(Vec::new()));
    let d = denials.clone();
    let hook: policy::DenyHook = Arc::new(move |reason, msg: &str| {
        d.lock().unwrap().push((reason, msg.to_owned()));
    });
    let stop = CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .layer(AuthzLayer::new(TD, Some(hook)))
            .add_service(health_service)
            .add_service(DecisionServer::new(Echo))
            .serve_with_incoming_shutdown(incoming, s.cancelled())
            .await
            .unwrap();
    });
    Server {
        addr,
        material,
        health,
        denials,
        stop,
    }
}

async fn channel(server: &Server, client: &TlsFiles, expect: Option<Role>) -> Channel {
    let material = TlsMaterial::load(client.clone(), TD).unwrap();
    let endpoint = Endpoint::from_shared(format!("http://{}", server.addr)).unwrap();
    let connect = endpoint.connect_with_connector(tls::connector(material.client_config(expect)));
    tokio::time::timeout(PATIENCE, connect)
        .await
        .expect("connect timed out")
        .unwrap()
}

async fn try_channel(
    server: &Server,
    client: &TlsFiles,
) -> Result<Channel, tonic::transport::Error> {
    let material = TlsMaterial::load(client.clone(), TD).unwrap();
    let endpoint = Endpoint::from_shared(format!("http://{}", server.addr)).unwrap();
    let connect = endpoint.connect_with_connector(tls::connector(material.client_config(None)));
    tokio::time::timeout(PATIENCE, connect)
        .await
        .expect("connect timed out")
}

async fn assign(ch: Channel) -> Result<v1::AssignResponse, tonic::Status> {
    let req = v1::AssignRequest {
        group: "g0".into(),
        request_id: "r".into(),
        prompt_tokens: 1,
        ..Default::default()
    };
    let mut client = DecisionClient::new(ch);
    tokio::time::timeout(PATIENCE, client.assign(req))
        .await
        .expect("call timed out")
        .map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_may_call_only_what_the_table_allows_and_handlers_see_the_identity() {
    let pki = Pki::new();
    let server = serve(pki.role(Role::Decision)).await;
    for role in Role::ALL {
        let files = if role == Role::Worker {
            pki.files("worker", &pki.ca.issue_worker(TD, "g0", 3).unwrap())
        } else {
            pki.role(role)
        };
        let ch = channel(&server, &files, Some(Role::Decision)).await;
        let got = assign(ch.clone()).await;
        if matches!(role, Role::Gateway | Role::Admin) {
            let want = Identity::uri_for_role(TD, role);
            assert_eq!(got.unwrap().endpoint, want, "{role}");
        } else {
            let status = got.unwrap_err();
            assert_eq!(status.code(), tonic::Code::PermissionDenied, "{role}");
            assert!(status.message().contains(role.as_str()), "{status:?}");
            assert!(status.message().contains("Assign"), "{status:?}");
        }
        // health: any authenticated peer
        let req = HealthCheckRequest {
            service: "balanceroute.v1.Decision".into(),
        };
        let h = HealthClient::new(ch).check(req).await.unwrap().into_inner();
        assert_eq!(h.status(), ServingStatus::Serving, "{role}");
    }
    let denials = server.denials.lock().unwrap().clone();
    // every role but gateway and admin (worker, ingest, decision, snapshot, all)
    assert_eq!(denials.len(), Role::ALL.len() - 2, "{denials:?}");
    assert!(
        denials
            .iter()
            .all(|(r, _)| *r == DenyReason::RoleNotAllowed)
    );
    server.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_no_certificate_another_ca_expired_and_no_identity_are_refused() {
    let pki = Pki::new();
    let server = serve(pki.role(Role::Decision)).await;

    // plaintext HTTP/2 to a TLS port: the handshake never completes
    let plain = Endpoint::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5));
    match plain.connect().await {
        Err(_) => {}
        Ok(ch) => assert!(
            assign(ch).await.is_err(),
            "plaintext must not get an answer"
        ),
    }

    // a certificate from another CA (the client trusts our CA, the server does not trust its)
    let other = Ca::new("other CA").unwrap();
    let mut files = pki.files("foreign", &other.issue_role(TD, Role::Gateway).unwrap());
    files.ca = pki.path("ca.pem");
    let refused = match try_channel(&server, &files).await {
        Err(_) => true,
        Ok(ch) => assign(ch).await.is_err(),
    };
    assert!(refused, "a certificate from another CA must be refused");

    // an expired certificate from our own CA
    let expired = pki.ca.issue(
        &Identity::uri_for_role(TD, Role::Gateway),
        Validity::Expired,
    );
    let files = pki.files("expired", &expired.unwrap());
    let refused = match try_channel(&server, &files).await {
        Err(_) => true,
        Ok(ch) => assign(ch).await.is_err(),
    };
    assert!(refused, "an expired certificate must be refused");

    // no client certificate at all: a rustls client without client auth
    let roots = {
        let mut r = rustls::RootCertStore::empty();
        let pem = std::fs::read(pki.path("ca.pem")).unwrap();
        use rustls::pki_types::pem::PemObject as _;
        for c in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
            r.add(c.unwrap()).unwrap();
        }
        r
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    let endpoint =
        Endpoint::from_shared(format!("http://localhost:{}", server.addr.port())).unwrap();
    let refused = match endpoint
        .connect_with_connector(tls::connector(Arc::new(cfg)))
        .await
    {
        Err(_) => true,
        Ok(ch) => assign(ch).await.is_err(),
    };
    assert!(refused, "a client without a certificate must be refused");

    // a certificate of our CA whose URI SAN is not ours: authenticated, no identity
    let stranger = pki.ca.issue(
        "spiffe://elsewhere.example/br/gateway",
        Validity::For(Duration::from_secs(3600)),
    );
    let files = pki.files("stranger", &stranger.unwrap());
    let ch = try_channel(&server, &files).await.unwrap();
    let status = assign(ch).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains("balanceroute.local"),
        "{status:?}"
    );
    server.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_refuses_a_server_of_the_wrong_role() {
    let pki = Pki::new();
    let server = serve(pki.role(Role::Gateway)).await;
    let client = pki.role(Role::Decision);
    let material = TlsMaterial::load(client, TD).unwrap();
    let endpoint = Endpoint::from_shared(format!("http://{}", server.addr)).unwrap();
    let cfg = material.client_config(Some(Role::Snapshot));
    let refused = match endpoint.connect_with_connector(tls::connector(cfg)).await {
        Err(_) => true,
        Ok(ch) => assign(ch).await.is_err(),
    };
    assert!(
        refused,
        "a gateway certificate must not pass as the snapshot service"
    );
    server.stop.cancel();
}

/// The certificate the server presents on a fresh connection.
async fn presented_cert(
    server: &Server,
    client: &TlsFiles,
) -> rustls::pki_types::CertificateDer<'static> {
    let material = TlsMaterial::load(client.clone(), TD).unwrap();
    let tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tokio_rustls::TlsConnector::from(material.client_config(None))
        .connect(name, tcp)
        .await
        .unwrap();
    tls.get_ref().1.peer_certificates().unwrap()[0].clone()
}

/// The SPIFFE id the server presents on a fresh connection.
async fn presented_identity(server: &Server, client: &TlsFiles) -> String {
    let leaf = presented_cert(server, client).await;
    Identity::from_cert_der(leaf.as_ref(), TD)
        .unwrap()
        .spiffe_id
}

fn rewrite(files: &TlsFiles, issued: &Issued) {
    br_certs::write_file(&files.cert, issued.cert_pem.as_bytes(), 0o644).unwrap();
    br_certs::write_file(&files.key, issued.key_pem.as_bytes(), 0o600).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotating_the_servers_certificate_keeps_open_streams_and_new_connections_see_the_new_one() {
    let pki = Pki::new();
    let server_files = pki.role(Role::Decision);
    let server = serve(server_files.clone()).await;
    let client = pki.role(Role::Admin);
    assert_eq!(
        presented_identity(&server, &client).await,
        Identity::uri_for_role(TD, Role::Decision)
    );
    // a long-lived stream opened before the rotation
    let ch = channel(&server, &client, None).await;
    let req = HealthCheckRequest {
        service: "balanceroute.v1.Decision".into(),
    };
    let mut watch = HealthClient::new(ch.clone())
        .watch(req)
        .await
        .unwrap()
        .into_inner();
    let first = tokio::time::timeout(PATIENCE, watch.message())
        .await
        .unwrap();
    assert_eq!(first.unwrap().unwrap().status(), ServingStatus::Serving);

    // rotate: same path, a new certificate with a distinguishable id (as a renewal with a new
    // SAN would be), then reload as the file watcher does
    let renewed = pki.ca.issue(
        &Identity::uri_for_role(TD, Role::Decision),
        Validity::For(Duration::from_secs(7200)),
    );
    let renewed = renewed.unwrap();
    rewrite(&server_files, &renewed);
    assert!(
        server.material.reload().unwrap(),
        "the rotation is picked up"
    );
    assert!(
        !server.material.reload().unwrap(),
        "unchanged files are not reloaded"
    );

    // new connections get the new certificate (compare the DER)
    let presented = presented_cert(&server, &client).await;
    let want = {
        use rustls::pki_types::pem::PemObject as _;
        rustls::pki_types::CertificateDer::from_pem_slice(renewed.cert_pem.as_bytes()).unwrap()
    };
    assert_eq!(presented, want);

    // the stream opened before the rotation still delivers
    server
        .health
        .set_not_serving::<DecisionServer<Echo>>()
        .await;
    let next = tokio::time::timeout(PATIENCE, watch.message())
        .await
        .unwrap();
    assert_eq!(next.unwrap().unwrap().status(), ServingStatus::NotServing);
    // and the old connection still carries new calls
    assert_eq!(
        assign(ch).await.unwrap().endpoint,
        Identity::uri_for_role(TD, Role::Admin)
    );

    // a half-written rotation (garbage) keeps the current material
    std::fs::write(&server_files.cert, b"not a certificate").unwrap();
    assert!(server.material.reload().is_err());
    assert_eq!(
        presented_identity(&server, &client).await,
        Identity::uri_for_role(TD, Role::Decision)
    );
    server.stop.cancel();
}
