//! floor-server: the cost floor the services are measured against. It serves the three
//! BalanceRoute services on one port with the same server the real ones run (br-runtime's
//! `GrpcServer`: the same tonic and tokio settings, HTTP/2 keepalive, stream and connection
//! limits, in-flight message budget, tracing layer and, with `--tls-*`, the same mutual TLS
//! and method × role table), and does no work behind it:
//!
//! * `Decision.Assign` answers at once, the ranks `0..--workers` in turn (no σ, no pool, no
//!   policy, no reservation); `Cancel` answers NOT_FOUND (the floor holds no request).
//! * `Snapshot.Apply` decodes each batch, drops it and acknowledges it in order (what ingest
//!   waits for); `Telemetry.Report` decodes each message, drops it and acknowledges it.
//! * Every other call answers UNIMPLEMENTED.
//!
//! What a service spends beyond the floor at the same offered load is what its own work costs:
//! `scripts/bench-cost.sh` (`make bench-cost`) runs the floor, br-all and the split deployment
//! side by side under one `assign-load` and prints the ratios.
//!
//! ```text
//! floor-server --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --ready-file floor.json
//! ```

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use br_proto::v1;
use br_proto::v1::decision_server::{Decision, DecisionServer};
use br_proto::v1::snapshot_server::{Snapshot, SnapshotServer};
use br_proto::v1::telemetry_server::{Telemetry, TelemetryServer};
use br_runtime::admin::Readiness;
use br_runtime::config::CommonArgs;
use br_runtime::skeleton::{self, Grpc, ServiceArgs, StartError};
use clap::Parser;
use tokio_stream::{Stream, StreamExt as _};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

/// The largest message the floor decodes: the snapshot service's (16 MiB), so a batch that
/// br-snapshot takes is taken here too.
const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

#[derive(Debug, Parser)]
#[command(name = "floor-server", version)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// Assign answers the ranks 0..N in turn.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    workers: u32,
}

impl ServiceArgs for Args {
    fn common(&self) -> &CommonArgs {
        &self.common
    }
}

type Running = skeleton::Running<Grpc>;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    skeleton::main("floor-server", start).await
}

/// The floor's three services; one counter shared by them.
#[derive(Debug, Clone)]
struct Floor {
    workers: u32,
    calls: Arc<AtomicU64>,
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

fn not_served<T>() -> Result<T, Status> {
    Err(Status::unimplemented(
        "floor-server answers Assign, Cancel, Apply and Report only",
    ))
}

#[tonic::async_trait]
impl Decision for Floor {
    async fn assign(
        &self,
        request: Request<v1::AssignRequest>,
    ) -> Result<Response<v1::AssignResponse>, Status> {
        let n = self.calls.fetch_add(1, Relaxed);
        drop(request);
        Ok(Response::new(v1::AssignResponse {
            worker_id: (n % u64::from(self.workers)) as u32,
            endpoint: String::new(),
            policy: "floor".into(),
            pool_wait_us: 0,
            incarnation: 1,
            sigma_version: n,
            stale: false,
        }))
    }

    async fn cancel(
        &self,
        _request: Request<v1::CancelRequest>,
    ) -> Result<Response<v1::CancelResponse>, Status> {
        Ok(Response::new(v1::CancelResponse {
            outcome: v1::CancelOutcome::NotFound as i32,
        }))
    }
}

#[tonic::async_trait]
impl Snapshot for Floor {
    type WatchStream = BoxStream<v1::WatchEvent>;
    type ApplyStream = BoxStream<v1::ApplyAck>;
    type ReserveStreamStream = BoxStream<v1::ReserveResult>;

    async fn watch(
        &self,
        _request: Request<v1::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        not_served()
    }

    async fn get(
        &self,
        _request: Request<v1::GetRequest>,
    ) -> Result<Response<v1::ClusterSnapshot>, Status> {
        not_served()
    }

    async fn apply(
        &self,
        request: Request<Streaming<v1::ChangeBatch>>,
    ) -> Result<Response<Self::ApplyStream>, Status> {
        let calls = Arc::clone(&self.calls);
        let acks = request.into_inner().map(move |batch| {
            let batch = batch?;
            Ok(v1::ApplyAck {
                batch_seq: batch.batch_seq,
                epoch: 1,
                version: calls.fetch_add(1, Relaxed),
                rejected: Vec::new(),
            })
        });
        Ok(Response::new(Box::pin(acks)))
    }

    async fn reserve(
        &self,
        _request: Request<v1::ReserveRequest>,
    ) -> Result<Response<v1::ReserveResponse>, Status> {
        not_served()
    }

    async fn reserve_stream(
        &self,
        _request: Request<Streaming<v1::ReserveCall>>,
    ) -> Result<Response<Self::ReserveStreamStream>, Status> {
        not_served()
    }

    async fn release(
        &self,
        _request: Request<v1::ReleaseRequest>,
    ) -> Result<Response<v1::ReleaseResponse>, Status> {
        not_served()
    }

    async fn list_groups(
        &self,
        _request: Request<v1::ListGroupsRequest>,
    ) -> Result<Response<v1::ListGroupsResponse>, Status> {
        not_served()
    }

    async fn set_cordon(
        &self,
        _request: Request<v1::SetCordonRequest>,
    ) -> Result<Response<v1::SetCordonResponse>, Status> {
        not_served()
    }
}

#[tonic::async_trait]
impl Telemetry for Floor {
    type ReportStream = BoxStream<v1::ReportAck>;

    async fn report(
        &self,
        request: Request<Streaming<v1::WorkerReport>>,
    ) -> Result<Response<Self::ReportStream>, Status> {
        let acks = request.into_inner().map(|report| {
            let seq = match report?.kind {
                Some(v1::worker_report::Kind::Progress(p)) => p.seq,
                Some(v1::worker_report::Kind::Heartbeat(h)) => h.seq,
                Some(v1::worker_report::Kind::Hello(_)) | None => 0,
            };
            Ok(v1::ReportAck {
                seq,
                status: v1::AckStatus::Ok as i32,
                detail: String::new(),
                full_state_requested: false,
            })
        });
        Ok(Response::new(Box::pin(acks)))
    }
}

/// Binds both ports and serves until `shutdown` (see [`br_runtime::skeleton`]).
async fn start(args: &Args, shutdown: CancellationToken) -> Result<Running, StartError> {
    let registry = prometheus::Registry::new();
    let edge = skeleton::Edge::load(&args.common, "floor", &registry, &shutdown)?;
    let readiness = Readiness::new(true);
    let admin =
        skeleton::start_admin(&args.common, &edge, &registry, &readiness, &shutdown).await?;
    let (server, grpc_addr) = skeleton::bind_grpc(&args.common, &edge).await?;
    let floor = Floor {
        workers: args.workers,
        calls: Arc::new(AtomicU64::new(0)),
    };
    let routes = tonic::service::Routes::new(DecisionServer::new(floor.clone()))
        .add_service(
            SnapshotServer::new(floor.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES),
        )
        .add_service(TelemetryServer::new(floor).max_decoding_message_size(MAX_MESSAGE_BYTES));
    let admin_addr = admin.local_addr();
    let serve_shutdown = shutdown.clone();
    Ok(Running::spawn(
        grpc_addr,
        admin_addr,
        readiness,
        shutdown,
        (),
        async move {
            let outcome = server
                .serve(
                    routes,
                    &[
                        br_proto::service_names::DECISION,
                        br_proto::service_names::SNAPSHOT,
                        br_proto::service_names::TELEMETRY,
                    ],
                    serve_shutdown,
                )
                .await?;
            skeleton::wait_admin(admin).await?;
            Ok(outcome)
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use br_proto::v1::decision_client::DecisionClient;
    use br_proto::v1::snapshot_client::SnapshotClient;
    use br_proto::v1::telemetry_client::TelemetryClient;

    async fn started() -> (Running, CancellationToken, String) {
        let args = Args::try_parse_from(["floor-server", "--workers", "3"]).expect("flags");
        let stop = CancellationToken::new();
        let running = start(&args, stop.clone()).await.expect("floor starts");
        let url = format!("http://{}", running.grpc_addr());
        (running, stop, url)
    }

    /// Assign answers at once, the ranks in turn; Apply and Report acknowledge every message
    /// in order; what the floor does not serve says so.
    #[tokio::test]
    async fn it_answers_assign_and_acknowledges_telemetry_in_order() {
        let (running, stop, url) = started().await;
        let mut decision = DecisionClient::connect(url.clone()).await.expect("connect");
        let mut ranks = Vec::new();
        for i in 0..4 {
            let a = decision
                .assign(v1::AssignRequest {
                    group: "default".into(),
                    request_id: format!("r{i}"),
                    prompt_tokens: 100,
                    ..Default::default()
                })
                .await
                .expect("assign")
                .into_inner();
            assert_eq!(a.pool_wait_us, 0);
            ranks.push(a.worker_id);
        }
        assert_eq!(ranks, [0, 1, 2, 0]);

        let mut snapshot = SnapshotClient::connect(url.clone()).await.expect("connect");
        let batches = (1..=3).map(|seq| v1::ChangeBatch {
            batch_seq: seq,
            group: "default".into(),
            ..Default::default()
        });
        let acks: Vec<u64> = snapshot
            .apply(tokio_stream::iter(batches))
            .await
            .expect("apply")
            .into_inner()
            .map(|a| a.expect("ack").batch_seq)
            .collect()
            .await;
        assert_eq!(acks, [1, 2, 3]);
        let refused = snapshot
            .get(v1::GetRequest::default())
            .await
            .expect_err("Get is not served");
        assert_eq!(refused.code(), tonic::Code::Unimplemented);

        let mut telemetry = TelemetryClient::connect(url).await.expect("connect");
        let reports = [
            v1::worker_report::Kind::Hello(v1::Hello::default()),
            v1::worker_report::Kind::Progress(v1::Progress {
                seq: 7,
                ..Default::default()
            }),
            v1::worker_report::Kind::Heartbeat(v1::Heartbeat { seq: 9 }),
        ]
        .map(|k| v1::WorkerReport { kind: Some(k) });
        let acks: Vec<u64> = telemetry
            .report(tokio_stream::iter(reports))
            .await
            .expect("report")
            .into_inner()
            .map(|a| a.expect("ack").seq)
            .collect()
            .await;
        assert_eq!(acks, [0, 7, 9]);

        stop.cancel();
        running.wait().await.expect("drains");
    }
}
