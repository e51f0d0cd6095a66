//! br-ingest: the telemetry front door of BalanceRoute.
//!
//! One long-lived `Telemetry.Report` stream per decode worker (its shim). Each stream starts
//! with a Hello, then carries cumulative per-request progress with a sequence number. Ingest
//! validates every message ([`session`]), keeps each worker's cumulative state so duplicates
//! and reordering change nothing, coalesces the resulting changes into one batch per group per
//! short tick ([`coalesce`]) and streams them over one `Snapshot.Apply` stream ([`forward`]).
//! It holds no authoritative state: after a restart of either side the shims' full states
//! rebuild σ.
//!
//! Acks never wait for the snapshot service (BUFFERED while it is away); every buffer is
//! bounded; every rejection is typed and counted in `balanceroute_ingest_rejected_total`.

pub mod change;
pub mod coalesce;
pub mod config;
pub mod error;
pub mod forward;
pub mod metrics;
pub mod registry;
pub mod service;
pub mod session;

use std::collections::HashSet;
use std::net::SocketAddr;

use br_runtime::admin::{AdminServer, Readiness};
use br_runtime::serve::GrpcServer;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::Args;
pub use error::{StartError, StreamError};

/// A started ingest.
#[derive(Debug)]
pub struct Running {
    /// Where the Telemetry service listens.
    pub grpc_addr: SocketAddr,
    /// Where /metrics, /livez and /readyz are served.
    pub admin_addr: SocketAddr,
    /// Whether ingest is connected to the snapshot service.
    pub readiness: Readiness,
    task: JoinHandle<()>,
}

impl Running {
    /// Waits until everything has stopped (after the shutdown token is cancelled).
    pub async fn wait(self) {
        if let Err(e) = self.task.await {
            tracing::error!(error = %e, "ingest task failed");
        }
    }
}

/// Binds the gRPC and admin listeners and starts serving; everything stops when `shutdown` is
/// cancelled (streams end with UNAVAILABLE, the gRPC server drains within the grace period).
pub async fn start(args: &Args, shutdown: CancellationToken) -> Result<Running, StartError> {
    let registry = prometheus::Registry::new();
    let metrics = metrics::Metrics::register(&registry)?;
    let readiness = Readiness::default();
    let admin = AdminServer::start(
        args.common.admin_listen,
        registry,
        readiness.clone(),
        shutdown.clone(),
    )
    .await
    .map_err(|source| StartError::Bind {
        what: "--admin-listen",
        source,
    })?;
    // br-runtime's server sets TCP_NODELAY on every accepted connection.
    let server = GrpcServer::bind(args.common.listen)
        .await
        .map_err(|source| StartError::Bind {
            what: "--listen",
            source,
        })?
        .with_grace(args.common.shutdown_grace);
    let grpc_addr = server.local_addr().map_err(|source| StartError::Bind {
        what: "--listen",
        source,
    })?;

    let workers = registry::Registry::default();
    let (fwd, fwd_task) = forward::spawn(
        forward::ForwarderConfig {
            snapshot_addr: args.snapshot_addr.clone(),
            batch_interval: args.batch_interval,
            max_buffered: args.max_buffered,
        },
        workers.clone(),
        metrics.clone(),
        readiness.clone(),
        shutdown.clone(),
    )
    .map_err(|e| StartError::SnapshotAddr {
        addr: args.snapshot_addr.clone(),
        reason: e.to_string(),
    })?;

    let limits = session::Limits {
        max_updates_per_message: args.max_updates_per_message,
        max_events_per_sec: args.max_events_per_sec_per_stream,
        max_tracked: 4 * br_proto::valid::limits::MAX_UPDATES_PER_PROGRESS,
    };
    let groups: Option<HashSet<String>> =
        (!args.groups.is_empty()).then(|| args.groups.iter().cloned().collect());
    let svc = service::TelemetryService::new(
        limits,
        args.max_worker_id,
        groups,
        workers,
        fwd,
        metrics,
        shutdown.clone(),
    );
    let routes = tonic::service::Routes::new(
        br_proto::v1::telemetry_server::TelemetryServer::new(svc)
            .max_decoding_message_size(args.max_message_bytes),
    );
    let admin_addr = admin.local_addr();
    let task = tokio::spawn(async move {
        match server
            .serve(
                routes,
                &[br_proto::service_names::TELEMETRY],
                shutdown.clone(),
            )
            .await
        {
            Ok(outcome) => tracing::info!(?outcome, "Telemetry server stopped"),
            Err(e) => {
                tracing::error!(error = %e, "Telemetry server failed");
                shutdown.cancel();
            }
        }
        let _ = fwd_task.await;
        if let Err(e) = admin.wait().await {
            tracing::error!(error = %e, "admin server failed");
        }
    });
    Ok(Running {
        grpc_addr,
        admin_addr,
        readiness,
        task,
    })
}
