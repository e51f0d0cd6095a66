//! "seq u64::MAX wedges a stream". Against the real br-ingest (and br-snapshot): a
//! Report stream that sends seq u64::MAX used to have every later message answered STALE_SEQ
//! for as long as it lived, its worker LIVE in σ on a state that no longer moved. Now that
//! message ends the stream OUT_OF_RANGE, unapplied and counted, and the worker's next stream
//! (same incarnation, seq from 1 again) goes on and moves σ.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use br_e2e::Service;
use br_proto::v1;
use br_proto::v1::worker_report::Kind;
use br_testkit::{eventually, eventually_some};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const START: Duration = Duration::from_secs(60);
const PATIENCE: Duration = Duration::from_secs(30);

fn hello() -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(Kind::Hello(v1::Hello {
            group: "g".into(),
            worker_id: 0,
            incarnation: 7,
            capacity: 4,
            endpoint: String::new(),
        })),
    }
}

fn progress(seq: u64, generated: u32) -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(Kind::Progress(v1::Progress {
            seq,
            full_state: true,
            updates: vec![v1::RequestProgress {
                request_id: "r".into(),
                prompt_tokens: 10,
                generated_tokens: generated,
                finished: false,
                unkeyed: false,
            }],
            traceparent: String::new(),
            tracestate: String::new(),
        })),
    }
}

struct Stream {
    tx: mpsc::Sender<v1::WorkerReport>,
    acks: tonic::Streaming<v1::ReportAck>,
}

impl Stream {
    /// A Report stream whose Hello was acknowledged; None if ingest refused it.
    async fn open(url: &str) -> Option<Stream> {
        let mut client = v1::telemetry_client::TelemetryClient::connect(url.to_owned())
            .await
            .ok()?;
        let (tx, rx) = mpsc::channel(4);
        tx.send(hello()).await.ok()?;
        let mut acks = client
            .report(ReceiverStream::new(rx))
            .await
            .ok()?
            .into_inner();
        let ack = acks.message().await.ok()??;
        assert_eq!(ack.seq, 0);
        Some(Stream { tx, acks })
    }

    async fn send(&mut self, m: v1::WorkerReport) -> Result<v1::ReportAck, tonic::Status> {
        self.tx.send(m).await.unwrap();
        let r = tokio::time::timeout(PATIENCE, self.acks.message())
            .await
            .expect("an answer within the patience");
        r.map(|a| a.expect("the stream ended without a status"))
    }
}

async fn generated_in_sigma(snapshot: &Service) -> Option<u32> {
    let mut c = v1::snapshot_client::SnapshotClient::connect(snapshot.grpc_url())
        .await
        .ok()?;
    let s = c
        .get(v1::GetRequest { group: "g".into() })
        .await
        .ok()?
        .into_inner();
    s.requests
        .iter()
        .find(|r| r.request_id == "r")
        .map(|r| r.generated_tokens)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seq_u64_max_ends_the_stream_and_the_next_stream_goes_on() {
    let snapshot = Service::start("br-snapshot", &[]);
    snapshot.wait_for("/livez", START).await;
    let ingest = Service::start("br-ingest", &["--snapshot-addr", &snapshot.grpc_url()]);
    ingest.wait_for("/readyz", START).await;
    let url = ingest.grpc_url();

    let mut s = Stream::open(&url).await.expect("the first stream");
    let ack = s.send(progress(u64::MAX - 1, 1)).await.unwrap();
    assert_eq!(ack.status, v1::AckStatus::Ok as i32);
    eventually(PATIENCE, "σ shows 1 generated token", || async {
        generated_in_sigma(&snapshot).await == Some(1)
    })
    .await;
    let status = s.send(progress(u64::MAX, 2)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
    assert!(status.message().contains("seq"), "{status:?}");

    let metrics = br_testkit::http::metrics_url(&ingest.admin_url("/metrics")).await;
    assert_eq!(
        metrics.value(
            "balanceroute_ingest_rejected_total",
            &[("reason", "seq_exhausted")]
        ),
        1.0
    );

    // The shim reconnects: same identity, a new seq space; its state moves σ again.
    let mut next = eventually_some(PATIENCE, "a new stream for the worker", || async {
        // The old stream's end is processed first; until then this Hello may be refused.
        let mut n = Stream::open(&url).await?;
        match n.send(progress(1, 3)).await {
            Ok(a) if a.status == v1::AckStatus::Ok as i32 => Some(n),
            _ => None,
        }
    })
    .await;
    let ack = next.send(progress(2, 4)).await.unwrap();
    assert_eq!(ack.status, v1::AckStatus::Ok as i32);
    eventually(PATIENCE, "σ follows the new stream", || async {
        generated_in_sigma(&snapshot).await == Some(4)
    })
    .await;
}
