//! The admin HTTP server every service runs on `--admin-listen`:
//! `GET /metrics` (Prometheus text from the service's registries: one per component, several
//! in the all-in-one `br-all`; `?name[]=<family>`, repeated, keeps only the named families),
//! `GET /livez` (200 while the
//! process runs), `GET /readyz` (200 only while the service says it is ready, else 503 with
//! the reason when the service gave one). A service may mount routes of its own beside them
//! (br-decision's live page, `/live`); they get the same TLS and role rules as `/metrics`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

// Readiness lives in its own module so that `serve` (gRPC health following it) and this
// server both use it without `serve` depending on the admin server; re-exported here, where
// the services have always found it.
pub use crate::readiness::{Readiness, all_of};

#[derive(Clone)]
struct AdminState {
    registries: Arc<[prometheus::Registry]>,
    readiness: Readiness,
}

/// The admin routes, for embedding or testing without a socket.
pub fn router(registry: prometheus::Registry, readiness: Readiness) -> Router {
    router_of(vec![registry], readiness)
}

/// [`router`] whose `/metrics` gathers several registries (the all-in-one's components, each
/// with its own; their names never collide, being prefixed by the service).
pub fn router_of(registries: Vec<prometheus::Registry>, readiness: Readiness) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .with_state(AdminState {
            registries: registries.into(),
            readiness,
        })
}

/// The page, or only the families named by `name[]` parameters
/// (`/metrics?name[]=balanceroute_decision_sigma_version`, the filter Prometheus's Java client
/// offers): a poller that follows one series (a benchmark timing σ's arrival, a script) then
/// does not pay for rendering and sending every family, nor make the service pay for it.
async fn metrics(
    State(s): State<AdminState>,
    query: Result<Query<Vec<(String, String)>>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let names = match query {
        Ok(Query(params)) => match family_names(params) {
            Ok(names) => names,
            Err(e) => return (StatusCode::BAD_REQUEST, e).into_response(),
        },
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    };
    let encoder = prometheus::TextEncoder::new();
    let mut families: Vec<_> = s
        .registries
        .iter()
        .flat_map(|r| r.gather())
        .filter(|f| names.is_empty() || names.iter().any(|n| n == f.name()))
        .collect();
    if s.registries.len() > 1 {
        families.sort_by(|a, b| a.name().cmp(b.name()));
    }
    match encoder.encode_to_string(&families) {
        Ok(body) => ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], body).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "encoding metrics");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("encoding metrics: {e}\n"),
            )
                .into_response()
        }
    }
}

/// The families `/metrics`'s query names (none: every family). Any other parameter, or an
/// empty name, is refused with what the page takes.
fn family_names(params: Vec<(String, String)>) -> Result<Vec<String>, String> {
    params
        .into_iter()
        .map(|(k, v)| match (k.as_str(), v.is_empty()) {
            ("name[]", false) => Ok(v),
            ("name[]", true) => {
                Err("an empty name[]: /metrics?name[]=<family> names a metric family\n".to_owned())
            }
            _ => Err(format!(
                "unknown parameter {k:?}: /metrics takes only name[]=<family>, repeated\n"
            )),
        })
        .collect()
}

async fn livez() -> &'static str {
    "ok\n"
}

async fn readyz(State(s): State<AdminState>) -> (StatusCode, String) {
    if s.readiness.is_ready() {
        return (StatusCode::OK, "ready\n".into());
    }
    let why = s.readiness.why_not();
    let body = if why.is_empty() {
        "not ready\n".into()
    } else {
        format!("not ready: {why}\n")
    };
    (StatusCode::SERVICE_UNAVAILABLE, body)
}

/// A running admin server.
#[derive(Debug)]
pub struct AdminServer {
    local_addr: SocketAddr,
    task: JoinHandle<std::io::Result<()>>,
}

impl AdminServer {
    /// Binds `addr` (port 0 picks a free port) and serves until `shutdown` is cancelled.
    pub async fn start(
        addr: SocketAddr,
        registry: prometheus::Registry,
        readiness: Readiness,
        shutdown: CancellationToken,
    ) -> std::io::Result<AdminServer> {
        Self::start_with_tls(addr, None, registry, readiness, Router::new(), shutdown).await
    }

    /// [`AdminServer::start`], over TLS when `tls` is given, with the service's own `extra`
    /// routes beside the standard ones: `/livez` and `/readyz` stay open to clients without a
    /// certificate (kubelet probes), everything else (`/metrics` and every extra route) needs
    /// the admin role (see `br_trust::admin`).
    pub async fn start_with_tls(
        addr: SocketAddr,
        tls: Option<std::sync::Arc<br_trust::TlsMaterial>>,
        registry: prometheus::Registry,
        readiness: Readiness,
        extra: Router,
        shutdown: CancellationToken,
    ) -> std::io::Result<AdminServer> {
        Self::start_gathering(addr, tls, vec![registry], readiness, extra, shutdown).await
    }

    /// [`AdminServer::start_with_tls`] whose `/metrics` gathers several registries (see
    /// [`router_of`]).
    pub async fn start_gathering(
        addr: SocketAddr,
        tls: Option<std::sync::Arc<br_trust::TlsMaterial>>,
        registries: Vec<prometheus::Registry>,
        readiness: Readiness,
        extra: Router,
        shutdown: CancellationToken,
    ) -> std::io::Result<AdminServer> {
        let listener = TcpListener::bind(addr).await?;
        let local_addr = listener.local_addr()?;
        let app = router_of(registries, readiness).merge(extra);
        let tls_on = tls.is_some();
        let task = match tls {
            None => tokio::spawn(async move {
                axum::serve(listener, app)
                    .with_graceful_shutdown(shutdown.cancelled_owned())
                    .await
            }),
            Some(material) => {
                let listener = br_trust::admin::AdminListener::new(
                    listener,
                    &material,
                    crate::serve::TLS_HANDSHAKE_TIMEOUT,
                )?;
                let app = app.layer(axum::middleware::from_fn(br_trust::admin::require_admin));
                tokio::spawn(async move {
                    axum::serve(
                        listener,
                        app.into_make_service_with_connect_info::<br_trust::admin::Peer>(),
                    )
                    .with_graceful_shutdown(shutdown.cancelled_owned())
                    .await
                })
            }
        };
        // DEBUG: the process's one start-up line (INFO) names this address.
        tracing::debug!(addr = %local_addr, tls = tls_on, "admin HTTP server listening");
        Ok(AdminServer { local_addr, task })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits until the server has stopped (after the shutdown token is cancelled).
    pub async fn wait(self) -> std::io::Result<()> {
        match self.task.await {
            Ok(r) => r,
            Err(e) => Err(std::io::Error::other(e)),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    async fn get(addr: SocketAddr, path: &str) -> (u16, String, String) {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).await.unwrap();
        let (head, body) = buf.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, head.to_string(), body.to_string())
    }

    /// A part that stays not ready for a new reason shows the new reason in the combined one
    /// (br-all's decision goes from "no complete σ" to "no live worker" without becoming ready;
    /// the combined /readyz kept saying "no complete σ").
    #[tokio::test]
    async fn all_of_follows_a_new_reason_while_the_part_stays_not_ready() {
        let part = Readiness::default();
        part.set_not_ready("no σ yet");
        let stop = CancellationToken::new();
        let combined = all_of(vec![("decision", part.clone())], stop.clone());
        assert_eq!(combined.why_not(), "decision: no σ yet");
        let mut rx = combined.subscribe();
        part.set_not_ready("no live worker");
        tokio::time::timeout(std::time::Duration::from_secs(10), rx.changed())
            .await
            .expect("the combined readiness is told within 10 s")
            .unwrap();
        assert!(!combined.is_ready());
        assert_eq!(combined.why_not(), "decision: no live worker");
        // The same reason again is no change.
        part.set_not_ready("no live worker");
        assert!(!rx.has_changed().unwrap());
        stop.cancel();
    }

    #[tokio::test]
    async fn endpoints_over_tcp() {
        let registry = prometheus::Registry::new();
        let c = prometheus::IntCounter::new("balanceroute_test_things_total", "things").unwrap();
        registry.register(Box::new(c.clone())).unwrap();
        c.inc_by(3);
        let ready = Readiness::default();
        let shutdown = CancellationToken::new();
        let server = AdminServer::start(
            "127.0.0.1:0".parse().unwrap(),
            registry,
            ready.clone(),
            shutdown.clone(),
        )
        .await
        .unwrap();
        let addr = server.local_addr();
        assert_ne!(addr.port(), 0);

        let (code, _, body) = get(addr, "/livez").await;
        assert_eq!((code, body.as_str()), (200, "ok\n"));

        let (code, _, _) = get(addr, "/readyz").await;
        assert_eq!(code, 503, "not ready until the service says so");
        ready.set(true);
        let (code, _, body) = get(addr, "/readyz").await;
        assert_eq!((code, body.as_str()), (200, "ready\n"));
        ready.set(false);
        let (code, _, body) = get(addr, "/readyz").await;
        assert_eq!((code, body.as_str()), (503, "not ready\n"));
        ready.set_not_ready("group g0: no live worker");
        let (code, _, body) = get(addr, "/readyz").await;
        assert_eq!(
            (code, body.as_str()),
            (503, "not ready: group g0: no live worker\n")
        );
        ready.set(true);
        assert_eq!(get(addr, "/readyz").await.0, 200);

        let (code, head, body) = get(addr, "/metrics").await;
        assert_eq!(code, 200);
        assert!(
            head.to_lowercase().contains("content-type: text/plain"),
            "{head}"
        );
        assert!(body.contains("balanceroute_test_things_total 3"), "{body}");

        assert_eq!(get(addr, "/nope").await.0, 404);

        shutdown.cancel();
        tokio::time::timeout(std::time::Duration::from_secs(5), server.wait())
            .await
            .unwrap()
            .unwrap();
    }

    /// `name[]` keeps the named families of every registry (br-all gathers several) and
    /// nothing else; a name no family has gives an empty page; anything else is refused.
    #[tokio::test]
    async fn metrics_keeps_only_the_families_named() {
        let (a, b) = (prometheus::Registry::new(), prometheus::Registry::new());
        let count = |r: &prometheus::Registry, name: &str, n: u64| {
            let c = prometheus::IntCounter::new(name, "things").unwrap();
            r.register(Box::new(c.clone())).unwrap();
            c.inc_by(n);
        };
        count(&a, "balanceroute_a_total", 1);
        count(&a, "balanceroute_a_other_total", 2);
        count(&b, "balanceroute_b_total", 3);
        let shutdown = CancellationToken::new();
        let server = AdminServer::start_gathering(
            "127.0.0.1:0".parse().unwrap(),
            None,
            vec![a, b],
            Readiness::new(true),
            Router::new(),
            shutdown.clone(),
        )
        .await
        .unwrap();
        let addr = server.local_addr();
        let samples = |body: &str| -> Vec<String> {
            body.lines()
                .filter(|l| !l.starts_with('#'))
                .map(str::to_owned)
                .collect()
        };

        let (code, _, body) = get(addr, "/metrics").await;
        assert_eq!(code, 200);
        assert_eq!(samples(&body).len(), 3, "{body}");
        let (code, _, body) = get(addr, "/metrics?name[]=balanceroute_a_total").await;
        assert_eq!(code, 200);
        assert_eq!(samples(&body), ["balanceroute_a_total 1"], "{body}");
        assert!(
            body.contains("# TYPE balanceroute_a_total counter"),
            "{body}"
        );
        // Repeated, from two registries, percent-encoded as clients send the brackets.
        let (code, _, body) = get(
            addr,
            "/metrics?name%5B%5D=balanceroute_b_total&name[]=balanceroute_a_total",
        )
        .await;
        assert_eq!(code, 200);
        assert_eq!(
            samples(&body),
            ["balanceroute_a_total 1", "balanceroute_b_total 3"],
            "{body}"
        );
        let (code, _, body) = get(addr, "/metrics?name[]=balanceroute_none").await;
        assert_eq!((code, body.as_str()), (200, ""));

        for (query, says) in [
            ("name=balanceroute_a_total", "unknown parameter \"name\""),
            ("name[]=", "an empty name[]"),
            ("match[]=up", "unknown parameter \"match[]\""),
        ] {
            let (code, _, body) = get(addr, &format!("/metrics?{query}")).await;
            assert_eq!(code, 400, "{query}: {body}");
            assert!(body.contains(says), "{query}: {body}");
        }

        shutdown.cancel();
        tokio::time::timeout(std::time::Duration::from_secs(5), server.wait())
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn a_service_mounts_its_own_routes_beside_the_standard_ones() {
        let shutdown = CancellationToken::new();
        let extra = Router::new().route("/live", axum::routing::get(|| async { "page" }));
        let server = AdminServer::start_with_tls(
            "127.0.0.1:0".parse().unwrap(),
            None,
            prometheus::Registry::new(),
            Readiness::new(true),
            extra,
            shutdown.clone(),
        )
        .await
        .unwrap();
        let addr = server.local_addr();
        let (code, _, body) = get(addr, "/live").await;
        assert_eq!((code, body.as_str()), (200, "page"));
        assert_eq!(get(addr, "/readyz").await.0, 200);
        assert_eq!(get(addr, "/metrics").await.0, 200);
        shutdown.cancel();
        tokio::time::timeout(std::time::Duration::from_secs(5), server.wait())
            .await
            .unwrap()
            .unwrap();
    }

    #[test]
    fn readiness_is_shared_and_notifies() {
        let r = Readiness::default();
        let mut rx = r.subscribe();
        assert!(!r.is_ready());
        r.clone().set(true);
        assert!(r.is_ready());
        assert!(rx.has_changed().unwrap());
        rx.mark_unchanged();
        r.set(true);
        assert!(
            !rx.has_changed().unwrap(),
            "no notification without a change"
        );
    }
}
