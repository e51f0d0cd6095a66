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
mod config;
mod error;
pub mod forward;
mod metrics;
mod registry;
mod service;
pub mod session;

use std::collections::HashSet;

use br_runtime::admin::Readiness;
use br_runtime::config::Validate as _;
use br_runtime::skeleton::{self, Grpc, StartError};
use tokio_util::sync::CancellationToken;

pub use config::Args;
pub use error::StreamError;

/// A started ingest (see [`br_runtime::skeleton::Running`]); ready while it is connected to
/// the snapshot service.
pub type Running = skeleton::Running<Grpc>;

/// Binds the gRPC and admin listeners and starts serving; everything stops when `shutdown` is
/// cancelled (streams end with UNAVAILABLE, the gRPC server drains within the grace period).
/// Ingest without its ports: the Telemetry handlers and the forwarder, for [`start`] and for
/// the all-in-one `br-all` (which passes the snapshot service in-process as `upstream`).
#[derive(Debug)]
pub struct Component {
    /// The handlers: what a port serves ([`server`]).
    pub service: service::TelemetryService,
    /// Ready while the Apply stream to the snapshot service is up.
    pub readiness: Readiness,
    /// The forwarder; it ends after `shutdown`.
    pub forwarder_task: tokio::task::JoinHandle<()>,
}

/// Validates `args`, registers the metrics in `registry` and starts the forwarder towards
/// `upstream`; streams end and the forwarder stops when `shutdown` is cancelled.
pub fn component(
    args: &Args,
    registry: &prometheus::Registry,
    upstream: std::sync::Arc<dyn forward::ApplyLink>,
    shutdown: CancellationToken,
) -> Result<Component, StartError> {
    args.validate().map_err(StartError::Config)?;
    let metrics = metrics::Metrics::register(registry)?;
    let readiness = Readiness::default();
    let workers = registry::Registry::default();
    let (fwd, forwarder_task) = forward::spawn(
        forward::ForwarderConfig {
            upstream,
            batch_interval: args.batch_interval,
            batch_spacing: args.batch_spacing,
            max_buffered: args.max_buffered,
            ingest_id: args.ingest_id(),
        },
        workers.clone(),
        metrics.clone(),
        readiness.clone(),
        shutdown.clone(),
    );
    let limits = session::Limits {
        max_updates_per_message: args.max_updates_per_message,
        max_events_per_sec: args.max_events_per_sec_per_stream,
        max_tracked: 4 * br_proto::valid::limits::MAX_UPDATES_PER_PROGRESS,
    };
    let groups: Option<HashSet<String>> =
        (!args.groups.is_empty()).then(|| args.groups.iter().cloned().collect());
    let timeouts = service::Timeouts {
        hello: args.hello_timeout,
        idle: (!args.stream_idle_timeout.is_zero()).then_some(args.stream_idle_timeout),
    };
    let service = service::TelemetryService::new(service::TelemetryParts {
        limits,
        timeouts,
        max_worker_id: args.max_worker_id,
        allowed_groups: groups,
        registry: workers,
        forwarder: fwd,
        metrics,
        shutdown,
        message_span_every: args.message_span_every,
    });
    Ok(Component {
        service,
        readiness,
        forwarder_task,
    })
}

/// The gRPC server of the handlers, with `--max-message-bytes`.
pub fn server(
    svc: service::TelemetryService,
    args: &Args,
) -> br_proto::v1::telemetry_server::TelemetryServer<service::TelemetryService> {
    br_proto::v1::telemetry_server::TelemetryServer::new(svc)
        .max_decoding_message_size(args.max_message_bytes)
}

/// Binds the gRPC and admin listeners and starts serving; everything stops when `shutdown` is
/// cancelled (streams end with UNAVAILABLE, the gRPC server drains within the grace period).
pub async fn start(args: &Args, shutdown: CancellationToken) -> Result<Running, StartError> {
    args.validate().map_err(StartError::Config)?;
    let registry = prometheus::Registry::new();
    // The edge first: its TLS material is the forwarder's too.
    let edge = skeleton::Edge::load(&args.common, "ingest", &registry, &shutdown)?;
    let upstream =
        forward::GrpcApply::new(&args.snapshot_addr, edge.tls().cloned()).map_err(|e| {
            StartError::Upstream {
                flag: "--snapshot-addr",
                value: args.snapshot_addr.clone(),
                reason: e.to_string(),
            }
        })?;
    let Component {
        service: svc,
        readiness,
        forwarder_task: fwd_task,
    } = component(
        args,
        &registry,
        std::sync::Arc::new(upstream),
        shutdown.clone(),
    )?;
    let admin =
        skeleton::start_admin(&args.common, &edge, &registry, &readiness, &shutdown).await?;
    // br-runtime's server sets TCP_NODELAY on every accepted connection.
    let (server, grpc_addr) = skeleton::bind_grpc(&args.common, &edge).await?;
    let routes = tonic::service::Routes::new(crate::server(svc, args));
    let admin_addr = admin.local_addr();
    // The one start-up line (the skeleton's generic one is suppressed: `announced`).
    tracing::info!(version = env!("CARGO_PKG_VERSION"), grpc = %grpc_addr, admin = %admin_addr,
        tls = edge.tls().is_some(), snapshot = %args.snapshot_addr,
        ingest_id = %args.ingest_id(), "br-ingest started");
    let serve_shutdown = shutdown.clone();
    Ok(
        Running::spawn(grpc_addr, admin_addr, readiness, shutdown, (), async move {
            let served = server
                .serve(
                    routes,
                    &[br_proto::service_names::TELEMETRY],
                    serve_shutdown.clone(),
                )
                .await;
            if let Err(e) = &served {
                // Without its server ingest is useless: stop the forwarder and the admin port
                // too, so the process exits (with an error) instead of idling.
                tracing::error!(error = %e, "Telemetry server failed");
                serve_shutdown.cancel();
            }
            fwd_task.await?;
            skeleton::wait_admin(admin).await?;
            Ok(served?)
        })
        .announced(),
    )
}
