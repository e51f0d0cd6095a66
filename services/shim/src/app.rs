//! Wiring: the proxy on `--listen`, the telemetry reporter towards `--ingest-addr` and the
//! admin server, started and stopped as one service. Used by `main` and by the tests.

use std::sync::Arc;
use std::time::Duration;

use br_runtime::admin::Readiness;
use br_runtime::config::Validate as _;
use br_runtime::serve::ServeOutcome;
use br_runtime::skeleton::{self, Http, ServeError, StartError};
use tokio_util::sync::CancellationToken;

use crate::config::Args;
use crate::report::{NullSink, ProgressSink, ReporterSink};
use crate::{Shim, ShimMetrics};

/// A started shim (see [`br_runtime::skeleton::Running`]): `http_addr()` is the proxy.
pub type Running = skeleton::Running<Http>;

/// How often the `ingest_connected` gauge is refreshed from the reporter.
const CONNECTED_REFRESH: Duration = Duration::from_millis(500);

/// Validates `args`, binds the proxy and admin ports (port 0 picks a free one), starts the
/// reporter and serves; everything stops when `shutdown` is cancelled. Open streams get
/// `--shutdown-grace` to finish, then they are cut.
pub async fn start(args: &Args, shutdown: CancellationToken) -> Result<Running, StartError> {
    args.validate().map_err(StartError::Config)?;
    let registry = prometheus::Registry::new();
    let metrics = ShimMetrics::new(&registry)?;
    // The proxy port carries the engine's own (plaintext HTTP) traffic, as the engine's port
    // does; TLS and the loopback default apply to the admin port and to the ingest stream.
    let edge = skeleton::Edge::load(&args.common, "shim", &registry, &shutdown)?;
    let (listener, http_addr) = skeleton::bind_listen(&args.common, &edge).await?;
    let endpoint = args
        .endpoint
        .clone()
        .unwrap_or_else(|| format!("http://{http_addr}"));

    let mut reporter = None;
    let sink: Arc<dyn ProgressSink> = if args.ingest_addr.is_empty() {
        tracing::warn!("no --ingest-addr: forwarding without reporting progress");
        Arc::new(NullSink)
    } else {
        let mut cfg = br_client::reporter::ReporterConfig::new(
            args.ingest_addr.clone(),
            args.group.clone(),
            args.worker_id,
            args.capacity,
        );
        cfg.endpoint = endpoint.clone();
        cfg.tls = edge.tls().cloned();
        let handle =
            br_client::reporter::Reporter::spawn(cfg).map_err(|e| StartError::Upstream {
                flag: "--ingest-addr",
                value: args.ingest_addr.clone(),
                reason: e.to_string(),
            })?;
        reporter = Some(handle.clone());
        Arc::new(ReporterSink(handle))
    };

    let shim = Shim::new(
        &args.upstream,
        args.inject_usage,
        sink.clone(),
        metrics.clone(),
    )
    .map_err(|e| StartError::Upstream {
        flag: "--upstream",
        value: args.upstream.clone(),
        reason: e.to_string(),
    })?
    .with_limits(args.max_body_bytes, args.max_concurrent_requests)
    .with_body_budget(args.max_buffered_body_bytes, args.body_timeout)
    .with_request_id_required(args.require_request_id);
    let readiness = Readiness::default();
    let admin =
        skeleton::start_admin(&args.common, &edge, &registry, &readiness, &shutdown).await?;
    let admin_addr = admin.local_addr();

    // The ingest_connected gauge and the refusals counter follow the reporter.
    {
        let gauge = metrics.ingest_connected.clone();
        let refusals = metrics.ingest_refusals.clone();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(CONNECTED_REFRESH);
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        gauge.set(i64::from(sink.connected()));
                        // the reporter's count only rises; the counter follows it
                        let seen = sink.refusals();
                        refusals.inc_by(seen.saturating_sub(refusals.get()));
                    }
                    () = stop.cancelled() => break,
                }
            }
        });
    }

    tracing::info!(listen = %http_addr, admin = %admin_addr, upstream = %args.upstream,
        group = %args.group, worker_id = args.worker_id, capacity = args.capacity,
        endpoint = %endpoint, "br-shim serving");
    readiness.set(true);
    let app = crate::router(Arc::new(shim));
    let grace = args.common.shutdown_grace;
    let serve_shutdown = shutdown.clone();
    Ok(Running::spawn(
        http_addr,
        admin_addr,
        readiness,
        shutdown,
        (),
        async move {
            let server = axum::serve(listener, app)
                .with_graceful_shutdown(serve_shutdown.clone().cancelled_owned());
            let outcome = tokio::select! {
                r = server => {
                    r.map_err(|source| ServeError::Io { server: "proxy", source })?;
                    ServeOutcome::Drained
                }
                // Streams can be long: after the grace period, stop waiting for them.
                () = async { serve_shutdown.cancelled().await; tokio::time::sleep(grace).await } => {
                    tracing::warn!("grace period over; closing open streams");
                    ServeOutcome::GraceExpired
                }
            };
            if let Some(r) = reporter {
                r.shutdown().await;
            }
            skeleton::wait_admin(admin).await?;
            Ok(outcome)
        },
    ))
}
