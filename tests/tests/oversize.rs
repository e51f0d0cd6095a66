//! A request above a server's decoding limit is answered RESOURCE_EXHAUSTED, as
//! gRPC's status codes say, not tonic's OUT_OF_RANGE, keeping tonic's message; checked against
//! the real binaries for a unary call (Decision.Assign, tonic's default 4 MiB limit), a
//! server-streaming one (Snapshot.Watch, 16 MiB) and a client-streaming one (Snapshot.Apply,
//! whose handler maps the error it reads mid-stream), each counted, and the servers keep
//! serving.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use br_e2e::Service;
use br_proto::v1;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

const START: Duration = Duration::from_secs(60);
/// Above br-snapshot's 16 MiB and tonic's default 4 MiB.
const OVERSIZE: usize = 17 << 20;

fn assert_too_large(status: &tonic::Status, rpc: &str) {
    assert_eq!(status.code(), Code::ResourceExhausted, "{rpc}: {status:?}");
    assert!(
        status.message().contains("message length too large"),
        "{rpc}: tonic's message is kept: {status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_requests_are_resource_exhausted_on_every_kind_of_rpc() {
    let snapshot = Service::start("br-snapshot", &[]);
    snapshot.wait_for("/livez", START).await;
    let snap_url = snapshot.grpc_url();
    let decision = Service::start(
        "br-decision",
        &["--snapshot-addr", &snap_url, "--groups", "g"],
    );
    decision.wait_for("/livez", START).await;

    // Unary: Decision.Assign.
    let mut assign = v1::decision_client::DecisionClient::connect(decision.grpc_url())
        .await
        .unwrap();
    let status = assign
        .assign(v1::AssignRequest {
            group: "g".into(),
            request_id: "x".repeat(OVERSIZE),
            prompt_tokens: 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_too_large(&status, "Assign");

    // Server-streaming: Snapshot.Watch.
    let mut snap = v1::snapshot_client::SnapshotClient::connect(snap_url.clone())
        .await
        .unwrap();
    let status = snap
        .watch(v1::WatchRequest {
            group: "g".repeat(OVERSIZE),
            epoch: 0,
            last_version: 0,
        })
        .await
        .unwrap_err();
    assert_too_large(&status, "Watch");

    // Client-streaming: Snapshot.Apply, one batch above the limit.
    let (tx, rx) = mpsc::channel(1);
    let mut acks = snap
        .apply(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    tx.send(v1::ChangeBatch {
        ingest_id: String::new(),
        traceparent: String::new(),
        tracestate: String::new(),
        batch_seq: 1,
        group: "g".repeat(OVERSIZE),
        changes: Vec::new(),
    })
    .await
    .unwrap();
    let status = acks.message().await.unwrap_err();
    assert_too_large(&status, "Apply");
    let metrics = br_testkit::http::metrics_url(&snapshot.admin_url("/metrics")).await;
    let refused = metrics.value(
        "balanceroute_snapshot_refused_total",
        &[("reason", "message_too_large")],
    );
    assert!(refused >= 1.0, "the Apply refusal is counted");
    // The unary and server-streaming refusals, rewritten by the serving layer, are counted by
    // each service's oversize counter (exactly one each: nothing else was oversize).
    let watch_refusals = metrics.value("balanceroute_snapshot_oversize_calls_total", &[]);
    assert_eq!(watch_refusals, 1.0, "the Watch refusal is counted once");
    let decision_metrics = br_testkit::http::metrics_url(&decision.admin_url("/metrics")).await;
    let assign_refusals = decision_metrics.value("balanceroute_decision_oversize_calls_total", &[]);
    assert_eq!(assign_refusals, 1.0, "the Assign refusal is counted once");

    // Both still serve a call of normal size.
    let status = assign
        .assign(v1::AssignRequest {
            group: "other".into(),
            request_id: "r".into(),
            prompt_tokens: 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_ne!(status.code(), Code::ResourceExhausted, "{status:?}");
    snap.get(v1::GetRequest { group: "g".into() })
        .await
        .unwrap();
}
