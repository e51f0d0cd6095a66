//! br-snapshot: the single writer of σ per group (see `proto/balanceroute/v1/snapshot.proto`).
//!
//! * `group`: one group's state machine (σ, bounded delta history, reservation TTLs,
//!   grace-period fencing, watchers with bounded queues), without network; unit-tested.
//! * [`writer`]: the one task that owns every group, fed by a bounded command queue.
//! * [`service`]: the gRPC handlers (validation at the edge, then the writer).
//! * [`Metrics`], [`Args`], and the service's error type.
//!
//! σ itself is [`br_sigma::Sigma`], the same type (and the same "apply a change"
//! code) every watcher's replica uses, so a replica that applies the deltas in order holds the
//! writer's σ by construction.

mod config;
mod cordons;
mod error;
mod group;
mod metrics;
pub mod service;
#[cfg(feature = "test-util")]
pub mod test_util;
mod wire;
pub mod writer;

use br_proto::v1::snapshot_server::SnapshotServer;
use br_runtime::admin::Readiness;
use br_runtime::config::Validate as _;
use br_runtime::skeleton::{self, Grpc, StartError};
use tokio_util::sync::CancellationToken;

pub use config::Args;
pub use group::{Event, Settings};
pub use metrics::Metrics;

/// Largest gRPC message accepted (an Apply batch or a Reserve call).
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// A started snapshot service (see [`br_runtime::skeleton::Running`]); its extra is the epoch.
pub type Running = skeleton::Running<Grpc, Started>;

/// What only a started snapshot service has.
#[derive(Debug, Clone, Copy)]
pub struct Started {
    /// This incarnation's random epoch: every σ it serves carries it.
    pub epoch: u64,
}

/// The snapshot service without its ports: the writer and the handlers, for [`start`] and
/// for the all-in-one `br-all`, which serves the handlers on its own port and calls them
/// in-process.
#[derive(Debug)]
pub struct Component {
    /// The handlers (cheap to clone): what a port serves ([`server`]) and what an in-process
    /// caller calls.
    pub service: service::SnapshotService,
    pub metrics: metrics::Metrics,
    /// This incarnation's random epoch.
    pub epoch: u64,
    /// The writer; it ends after `shutdown`.
    pub writer_task: tokio::task::JoinHandle<()>,
}

/// Validates `args` and starts the writer; the writer and the streams it feeds stop when
/// `shutdown` is cancelled.
pub fn component(args: &Args, shutdown: CancellationToken) -> Result<Component, StartError> {
    args.validate().map_err(StartError::Config)?;
    let metrics = metrics::Metrics::new()?;
    let cordons = match &args.cordon_file {
        Some(path) => {
            cordons::Cordons::load(path).map_err(|e| StartError::Config(e.to_string()))?
        }
        None => cordons::Cordons::in_memory(),
    };
    if !cordons.is_empty() {
        tracing::info!(cordoned = cordons.len(), "cordons read from --cordon-file");
    }
    let (writer, writer_task) =
        writer::spawn_with_cordons(args.settings(), metrics.clone(), shutdown.clone(), cordons);
    let epoch = writer.epoch();
    let service =
        service::SnapshotService::new(writer, metrics.clone(), args.max_watchers, shutdown);
    Ok(Component {
        service,
        metrics,
        epoch,
        writer_task,
    })
}

/// The gRPC server of the handlers, with the service's message limits.
pub fn server(svc: service::SnapshotService) -> SnapshotServer<service::SnapshotService> {
    SnapshotServer::new(svc)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(usize::MAX)
}

/// Binds both ports (port 0 picks a free one), starts the writer, the gRPC server (with
/// health and reflection) and the admin server; everything stops when `shutdown` is cancelled.
pub async fn start(args: &Args, shutdown: CancellationToken) -> Result<Running, StartError> {
    let Component {
        service: svc,
        metrics,
        epoch,
        writer_task,
    } = component(args, shutdown.clone())?;
    let readiness = Readiness::default();
    let edge = skeleton::Edge::load(&args.common, "snapshot", metrics.registry(), &shutdown)?;
    let admin = skeleton::start_admin(
        &args.common,
        &edge,
        metrics.registry(),
        &readiness,
        &shutdown,
    )
    .await?;
    let (server, grpc_addr) = skeleton::bind_grpc(&args.common, &edge).await?;
    let routes = tonic::service::Routes::new(crate::server(svc));
    readiness.set(true);
    let admin_addr = admin.local_addr();
    // The one start-up line (the skeleton's generic one is suppressed: `announced`).
    tracing::info!(version = env!("CARGO_PKG_VERSION"), grpc = %grpc_addr, admin = %admin_addr,
        tls = edge.tls().is_some(), epoch, "br-snapshot started");
    let ready = readiness.clone();
    let serve_shutdown = shutdown.clone();
    Ok(Running::spawn(
        grpc_addr,
        admin_addr,
        readiness,
        shutdown,
        Started { epoch },
        async move {
            let served = server
                .serve(routes, &[br_proto::service_names::SNAPSHOT], serve_shutdown)
                .await;
            ready.set(false);
            let outcome = served?;
            skeleton::wait_admin(admin).await?;
            writer_task.await?;
            Ok(outcome)
        },
    )
    .announced())
}
