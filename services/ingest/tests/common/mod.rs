//! Ingest's test helpers: an ingest started on 127.0.0.1:0, raw worker streams and their
//! messages. The fake snapshot service, the waits and the /metrics reader come from br-testkit.
#![allow(
    dead_code,
    unused_imports,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::net::SocketAddr;
use std::time::Duration;

use br_proto::v1;
pub use br_testkit::http::get as http_get;
pub use br_testkit::{FakeSnapshot, Metrics, ReservedPort, eventually, within};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

/// A hang guard, not a performance assertion.
pub const WAIT: Duration = br_testkit::PATIENCE;

pub struct TestIngest {
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    pub shutdown: CancellationToken,
    pub running: Option<br_ingest::Running>,
}

impl TestIngest {
    /// Starts ingest on ephemeral ports towards `snapshot`, with extra flags.
    pub async fn start(snapshot: SocketAddr, extra: &[&str]) -> TestIngest {
        let snap = format!("http://{snapshot}");
        let mut argv = vec![
            "br-ingest",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--snapshot-addr",
            &snap,
            "--shutdown-grace",
            "2s",
        ];
        argv.extend_from_slice(extra);
        let args: br_ingest::Args = br_runtime::config::parse_from(argv).unwrap();
        let shutdown = CancellationToken::new();
        let running = br_ingest::start(&args, shutdown.clone()).await.unwrap();
        TestIngest {
            grpc: running.grpc_addr(),
            admin: running.admin_addr(),
            shutdown,
            running: Some(running),
        }
    }

    /// Waits until the Apply stream to the snapshot service is up.
    pub async fn connected(&self) {
        eventually(WAIT, "ingest connected to the snapshot service", || async {
            self.metric("balanceroute_ingest_snapshot_connected", &[])
                .await
                == 1.0
        })
        .await;
    }

    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(r) = self.running.take() {
            within(WAIT, "ingest stops", r.wait()).await.unwrap();
        }
    }

    pub async fn metrics(&self) -> Metrics {
        br_testkit::http::metrics(self.admin).await
    }

    /// The value of the series `name` with exactly `labels`; 0 if it is absent (a labelled
    /// counter appears on its first increment).
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.metrics().await.get(name, labels).unwrap_or(0.0)
    }

    pub async fn worker(&self) -> Worker {
        Worker::connect(self.grpc).await
    }
}

/// A raw worker stream.
pub struct Worker {
    pub tx: mpsc::Sender<v1::WorkerReport>,
    pub acks: tonic::Streaming<v1::ReportAck>,
}

impl Worker {
    pub async fn connect(addr: SocketAddr) -> Worker {
        let mut client = v1::telemetry_client::TelemetryClient::connect(format!("http://{addr}"))
            .await
            .unwrap()
            .max_encoding_message_size(64 << 20);
        let (tx, rx) = mpsc::channel(1024);
        let acks = client
            .report(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Worker { tx, acks }
    }

    pub async fn send(&self, m: v1::WorkerReport) {
        self.tx.send(m).await.unwrap();
    }

    /// The next ack, or the status that ended the stream.
    pub async fn next(&mut self) -> Result<v1::ReportAck, tonic::Status> {
        match tokio::time::timeout(WAIT, self.acks.message()).await {
            Ok(Ok(Some(a))) => Ok(a),
            Ok(Ok(None)) => Err(tonic::Status::ok("stream ended")),
            Ok(Err(s)) => Err(s),
            Err(_) => panic!("no ack within {WAIT:?}"),
        }
    }

    pub async fn ack(&mut self) -> v1::ReportAck {
        self.next().await.expect("an ack")
    }

    /// Sends `m` and returns its ack.
    pub async fn call(&mut self, m: v1::WorkerReport) -> v1::ReportAck {
        self.send(m).await;
        self.ack().await
    }

    /// Says Hello and returns its ack.
    pub async fn hello(&mut self, group: &str, worker_id: u32, incarnation: u64) -> v1::ReportAck {
        self.call(hello(group, worker_id, incarnation)).await
    }
}

pub fn hello(group: &str, worker_id: u32, incarnation: u64) -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Hello(v1::Hello {
            group: group.into(),
            worker_id,
            incarnation,
            capacity: 64,
            endpoint: format!("http://10.0.0.{worker_id}:8000"),
        })),
    }
}

pub fn progress(seq: u64, full: bool, ups: &[(&str, u32, u32, bool)]) -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Progress(v1::Progress {
            seq,
            full_state: full,
            updates: ups
                .iter()
                .map(|(id, p, g, f)| v1::RequestProgress {
                    request_id: (*id).into(),
                    prompt_tokens: *p,
                    generated_tokens: *g,
                    finished: *f,
                    unkeyed: false,
                })
                .collect(),
            traceparent: String::new(),
            tracestate: String::new(),
        })),
    }
}

pub fn heartbeat(seq: u64) -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Heartbeat(v1::Heartbeat { seq })),
    }
}

pub fn status(a: &v1::ReportAck) -> v1::AckStatus {
    v1::AckStatus::try_from(a.status).unwrap()
}
