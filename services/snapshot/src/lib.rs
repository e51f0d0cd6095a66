//! br-snapshot: the single writer of σ per group (see `proto/balanceroute/v1/snapshot.proto`).
//!
//! * [`group`]: one group's state machine (σ, bounded delta history, reservation TTLs,
//!   grace-period fencing, watchers with bounded queues), without network; unit-tested.
//! * [`writer`]: the one task that owns every group, fed by a bounded command queue.
//! * [`service`]: the gRPC handlers (validation at the edge, then the writer).
//! * [`metrics`], [`config`], [`error`].
//!
//! σ itself is [`br_sigma::Sigma`], the same type (and the same "apply a change"
//! code) every watcher's replica uses, so a replica that applies the deltas in order holds the
//! writer's σ by construction.

pub mod config;
pub mod error;
pub mod group;
pub mod metrics;
pub mod service;
mod wire;
pub mod writer;

use std::net::SocketAddr;

use br_proto::v1::snapshot_server::SnapshotServer;
use br_runtime::admin::{AdminServer, Readiness};
use br_runtime::serve::{GrpcServer, ServeOutcome};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::Args;
pub use group::Settings;

/// Largest gRPC message accepted (an Apply batch or a Reserve call).
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// A started service: its bound addresses and its tasks.
#[derive(Debug)]
pub struct Running {
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub epoch: u64,
    grpc: JoinHandle<Result<ServeOutcome, tonic::transport::Error>>,
    admin: AdminServer,
    writer: JoinHandle<()>,
}

impl Running {
    /// Waits until the service has stopped (after `shutdown` was cancelled).
    pub async fn wait(self) -> Result<ServeOutcome, std::io::Error> {
        let outcome = match self.grpc.await {
            Ok(Ok(o)) => o,
            Ok(Err(e)) => return Err(std::io::Error::other(e)),
            Err(e) => return Err(std::io::Error::other(e)),
        };
        self.admin.wait().await?;
        let _ = self.writer.await;
        Ok(outcome)
    }
}

/// Binds both ports (port 0 picks a free one), starts the writer, the gRPC server (with
/// health and reflection) and the admin server; everything stops when `shutdown` is cancelled.
pub async fn start(args: &Args, shutdown: CancellationToken) -> Result<Running, std::io::Error> {
    let metrics = metrics::Metrics::new().map_err(std::io::Error::other)?;
    let readiness = Readiness::default();
    let admin = AdminServer::start(
        args.common.admin_listen,
        metrics.registry().clone(),
        readiness.clone(),
        shutdown.clone(),
    )
    .await?;
    let server = GrpcServer::bind(args.common.listen)
        .await?
        .with_grace(args.common.shutdown_grace);
    let grpc_addr = server.local_addr()?;
    let (writer, writer_task) = writer::spawn(args.settings(), metrics.clone(), shutdown.clone());
    let epoch = writer.epoch();
    let svc = service::SnapshotService::new(writer, metrics, shutdown.clone());
    let routes = tonic::service::Routes::new(
        SnapshotServer::new(svc)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(usize::MAX),
    );
    readiness.set(true);
    let grpc = tokio::spawn(async move {
        let r = server
            .serve(routes, &[br_proto::service_names::SNAPSHOT], shutdown)
            .await;
        readiness.set(false);
        r
    });
    tracing::info!(%grpc_addr, admin_addr = %admin.local_addr(), epoch, "br-snapshot started");
    Ok(Running {
        grpc_addr,
        admin_addr: admin.local_addr(),
        epoch,
        grpc,
        admin,
        writer: writer_task,
    })
}
