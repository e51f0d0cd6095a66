//! The proxy port's HTTP server: the shim's axum router over br-trust's accept loop (its
//! connection bound and first-byte timeout), with hyper's header-read timeout
//! (`--header-read-timeout`) and a graceful drain on shutdown.
//!
//! Why not `axum::serve`: it gives hyper no timer, so hyper's header-read timeout never
//! fires, and a client that opens a connection and sends its headers a byte at a time (or
//! sends a few and stops: slowloris) holds the connection, and one of `--max-connections`,
//! for as long as it likes. The first-byte timeout does not help once one byte has come.
//! br-decision's HTTP/JSON port serves the same way (`services/decision/src/http.rs`).

use std::time::Duration;

use axum::Router;
use axum::serve::Listener as _;
use br_trust::accept::AcceptListener;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio_util::sync::CancellationToken;

/// Serves `app` on `listener` until `shutdown` is cancelled, then lets the open connections
/// finish their requests (the caller bounds that wait with `--shutdown-grace`; dropping this
/// future drops every connection). A connection whose request headers have not all arrived
/// `header_timeout` after it started reading them is closed (HTTP/1; an HTTP/2 client is
/// bounded by the first-byte timeout and its keepalive instead).
pub async fn serve(
    mut listener: AcceptListener,
    app: Router,
    header_timeout: Duration,
    shutdown: CancellationToken,
) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let (io, _peer) = tokio::select! {
            c = listener.accept() => c,
            () = shutdown.cancelled() => break,
        };
        // reap the finished ones, so the set holds only open connections
        while connections.try_join_next().is_some() {}
        let app = app.clone();
        let stop = shutdown.clone();
        connections.spawn(async move {
            let svc = hyper_util::service::TowerToHyperService::new(app);
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), svc);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "proxy connection ended");
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
    while connections.join_next().await.is_some() {}
}
