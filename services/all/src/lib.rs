//! br-all: BalanceRoute in one process, like the monolithic mode of Grafana Mimir and Loki
//! (`-target=all`): the embedded default for one machine, beside the split deployment for a
//! fleet.
//!
//! One gRPC port (`--listen`, default 127.0.0.1:50060) serves `Telemetry` (the shims),
//! `Snapshot` (brctl, other watchers) and `Decision` (the gateways), with health and
//! reflection listing all three; one admin port (`--admin-listen`, default 127.0.0.1:9060)
//! serves the metrics of all three and a `/readyz` that holds while ingest is connected to σ
//! and decision can place a request. With `--tls-*` the port applies br-trust's one method ×
//! role table, as each split service does.
//!
//! The components are the services' own ([`br_snapshot::component`],
//! [`br_ingest::component`], [`br_decision::start_embedded`]); they talk in-process
//! through the seams the split deployment crosses over gRPC (`direct`): ingest's Apply
//! stream, decision's Watch followers and its Reserve/Release calls. No loopback socket is
//! involved, and the semantics are the same code.
//!
//! Flags: the union of the three services' ([`Args`]).

mod config;
mod direct;

use std::sync::Arc;

use br_proto::service_names;
use br_runtime::config::Validate as _;
use br_runtime::skeleton::StartError;
use tokio_util::sync::CancellationToken;

pub use config::Args;

/// A started br-all: the decision service's handle (its readiness is the whole process's,
/// its extra the decision's groups).
pub type Running = br_decision::Running;

/// Starts the three components and binds both ports; returns at once (see
/// [`br_runtime::skeleton`]). The ready file is `{"grpc": ..., "admin": ...}`, plus
/// br-decision's optional listeners (`--http-listen`, `--ext-proc-listen`) when given.
pub async fn start(args: &Args, shutdown: CancellationToken) -> Result<Running, StartError> {
    args.validate().map_err(StartError::Config)?;
    let decision = args.decision.to_config().map_err(StartError::Config)?;
    let reserve_timeout = decision.reserve_timeout;
    // The snapshot writer outlives the gRPC drain: calls still waiting in decision's pool
    // need Reserve until they are answered. Decision cancels `after` once the drain is over.
    let after = CancellationToken::new();
    let snapshot = br_snapshot::component(&args.snapshot, after.clone())?;
    let local = Arc::new(direct::Local::new(
        snapshot.service.clone(),
        reserve_timeout,
    ));
    let ingest_registry = prometheus::Registry::new();
    let ingest = br_ingest::component(
        &args.ingest,
        &ingest_registry,
        local.clone(),
        shutdown.clone(),
    )?;
    let mount = {
        let snapshot = snapshot.service.clone();
        let telemetry = ingest.service.clone();
        let ingest_args = args.ingest.clone();
        Box::new(move |routes: tonic::service::Routes| {
            routes
                .add_service(br_snapshot::server(snapshot))
                .add_service(br_ingest::server(telemetry, &ingest_args))
        })
    };
    let epoch = snapshot.epoch;
    let running = br_decision::start_embedded(
        &args.decision,
        shutdown,
        br_decision::Embedding {
            upstream: br_decision::Upstream {
                ops: local.clone(),
                watch: local,
            },
            mount,
            names: vec![service_names::SNAPSHOT, service_names::TELEMETRY],
            registries: vec![snapshot.metrics.registry().clone(), ingest_registry],
            // The snapshot component can work from the start; ingest once its Apply stream
            // is open (at once, in-process; it reopens after an error like a gRPC link).
            readiness: vec![("ingest", ingest.readiness)],
            edge_name: "all",
            after,
            tasks: vec![snapshot.writer_task, ingest.forwarder_task],
        },
    )
    .await?;
    // The one start-up line: what an operator checks first (ports, groups, TLS, version).
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        grpc = %running.grpc_addr(),
        admin = %running.admin_addr(),
        http = ?running.http_json_addr(),
        ext_proc = ?running.listener(br_decision::EXT_PROC_KEY),
        tls = args.common.tls.enabled(),
        policy = %decision.policy.kind,
        groups = ?decision.groups,
        epoch,
        "br-all started: snapshot, ingest and decision in one process"
    );
    Ok(running.announced())
}
