//! The admin port over real TLS: probes without a certificate, /metrics only for the admin role.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use br_certs::Ca;
use br_trust::admin::{AdminListener, Peer, require_admin};
use br_trust::tls::{TlsFiles, TlsMaterial};
use br_trust::{Identity, Role};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const TD: &str = "balanceroute.local";
const PATIENCE: Duration = Duration::from_secs(20);

fn files(dir: &std::path::Path, ca: &Ca, name: &str, role: Role) -> TlsFiles {
    let issued = ca.issue_role(TD, role).unwrap();
    let names = (format!("{name}.pem"), format!("{name}-key.pem"));
    br_certs::write(dir, &names, &issued).unwrap();
    TlsFiles {
        cert: dir.join(names.0),
        key: dir.join(names.1),
        ca: dir.join("ca.pem"),
    }
}

/// GET over TLS; `client` presents a certificate, `None` presents none (like a kubelet).
async fn fetch(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    client: Option<&Arc<TlsMaterial>>,
    path: &str,
) -> u16 {
    let cfg = match client {
        Some(m) => m.client_config(None),
        None => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
                roots.add(c.unwrap()).unwrap();
            }
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            Arc::new(
                rustls::ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .unwrap()
                    .with_root_certificates(roots)
                    .with_no_client_auth(),
            )
        }
    };
    let mut cfg = (*cfg).clone();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(name, tcp)
        .await
        .unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    tls.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let read = tls.read_to_end(&mut out);
    let _ = tokio::time::timeout(PATIENCE, read)
        .await
        .expect("no answer in time");
    let text = String::from_utf8_lossy(&out);
    let status = text.split_whitespace().nth(1).expect("a status line");
    status.parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_are_open_and_everything_else_needs_the_admin_role() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test CA").unwrap();
    std::fs::write(dir.path().join("ca.pem"), ca.cert_pem()).unwrap();
    let server = TlsMaterial::load(files(dir.path(), &ca, "decision", Role::Decision), TD).unwrap();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let listener = AdminListener::new(tcp, &server, Duration::from_secs(5)).unwrap();
    let app = Router::new()
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(|| async { "ready\n" }))
        .route("/metrics", get(|| async { "secret_requests 1\n" }))
        .layer(axum::middleware::from_fn(require_admin));
    tokio::spawn(async move {
        axum::serve(listener, app.into_make_service_with_connect_info::<Peer>())
            .await
            .unwrap();
    });
    let admin = TlsMaterial::load(files(dir.path(), &ca, "admin", Role::Admin), TD).unwrap();
    let gateway = TlsMaterial::load(files(dir.path(), &ca, "gateway", Role::Gateway), TD).unwrap();
    assert_eq!(
        admin.own_identity().unwrap().spiffe_id,
        Identity::uri_for_role(TD, Role::Admin)
    );
    let ca_pem = ca.cert_pem();
    assert_eq!(fetch(addr, ca_pem, None, "/livez").await, 200);
    assert_eq!(fetch(addr, ca_pem, None, "/readyz").await, 200);
    assert_eq!(fetch(addr, ca_pem, None, "/metrics").await, 403);
    assert_eq!(fetch(addr, ca_pem, Some(&gateway), "/metrics").await, 403);
    assert_eq!(fetch(addr, ca_pem, Some(&admin), "/metrics").await, 200);
    assert_eq!(fetch(addr, ca_pem, Some(&admin), "/livez").await, 200);
}
