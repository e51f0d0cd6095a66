//! The accept loop of the services' plain HTTP ports (br-shim's proxy port, br-decision's
//! `--http-listen`): an axum router served over a listener that already bounds connections
//! (br-trust's accept loop: `--max-connections`, `--first-byte-timeout`), with hyper's
//! header-read timeout and a graceful drain on shutdown.
//!
//! Why not `axum::serve`: it gives hyper no timer, so hyper's header-read timeout never fires,
//! and a client that sends its headers a byte at a time (or sends a few and stops: slowloris)
//! holds its connection, and one of `--max-connections`, for as long as it likes. The
//! first-byte timeout does not help once one byte has come.

use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::serve::Listener;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio_util::sync::CancellationToken;

use crate::serve::ServeOutcome;

/// How [`serve_http`] serves its port.
#[derive(Debug, Clone, Copy)]
pub struct HttpServing {
    /// What the port is, in logs ("proxy", "HTTP/JSON").
    pub name: &'static str,
    /// A connection whose request head has not all arrived this long after it started reading
    /// it is closed (HTTP/1; an HTTP/2 client is bounded by the first-byte timeout and its
    /// keepalive instead).
    pub header_timeout: Duration,
    /// How long the open connections may finish their requests after `shutdown`; `None`: as
    /// long as they take (the caller bounds the wait; dropping the future drops every
    /// connection).
    pub grace: Option<Duration>,
}

/// Serves `router` on `listener` until `shutdown` is cancelled, then lets the open connections
/// end gracefully (after the request in flight). Each request carries its connection's
/// `ConnectInfo<L::Addr>` (the peer, as the listener describes it).
pub async fn serve_http<L>(
    mut listener: L,
    router: Router,
    how: HttpServing,
    shutdown: CancellationToken,
) -> ServeOutcome
where
    L: Listener,
    L::Addr: Clone + Send + Sync + 'static,
{
    let name = how.name;
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let (io, peer) = tokio::select! {
            c = listener.accept() => c,
            () = shutdown.cancelled() => break,
        };
        // reap the finished ones, so the set holds only open connections
        while connections.try_join_next().is_some() {}
        let router = router.clone();
        let stop = shutdown.clone();
        connections.spawn(async move {
            let svc = tower::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer.clone()));
                tower::ServiceExt::oneshot(router.clone(), req.map(axum::body::Body::new))
            });
            let svc = hyper_util::service::TowerToHyperService::new(svc);
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(how.header_timeout);
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), svc);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "{name} connection ended");
                    }
                }
                () = stop.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
    drop(listener);
    let drain = async { while connections.join_next().await.is_some() {} };
    let Some(grace) = how.grace else {
        drain.await;
        return ServeOutcome::Drained;
    };
    if tokio::time::timeout(grace, drain).await.is_ok() {
        ServeOutcome::Drained
    } else {
        tracing::warn!(?grace, "{name} grace period expired; dropping requests");
        connections.abort_all();
        ServeOutcome::GraceExpired
    }
}
