//! Ingest never acknowledges OK what the snapshot service refused: when an
//! ApplyAck refuses a live worker's change, ingest ends that worker's stream with a typed
//! status naming why, and br-client's reporter (what br-shim runs) says Hello again. Before,
//! the worker kept getting ACK_OK while every change it sent was dropped (401 changes, worker
//! FENCED for over a minute).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use br_client::reporter::{Reporter, ReporterConfig, ReporterTuning};
use br_proto::v1;
use br_proto::v1::telemetry_change::Kind as TcKind;
use common::*;

const GROUP: &str = "gr";

/// The snapshot service refuses the reporter's changes as a stale incarnation (σ holds another
/// one of that worker): ingest ends the stream with ABORTED, and the reporter comes back with a
/// new incarnation, its Hello and its full state, which the snapshot service takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_change_ends_the_stream_and_the_reporter_says_hello_again() {
    let fake = FakeSnapshot::new();
    let served = fake.start().await;
    let ingest = TestIngest::start(served.addr, &[]).await;
    ingest.connected().await;

    let cfg = ReporterConfig::new(format!("http://{}", ingest.grpc), GROUP, 4, 16);
    let tuning = ReporterTuning {
        flush_interval: Duration::from_millis(2),
        backoff_initial: Duration::from_millis(10),
        backoff_max: Duration::from_millis(200),
        ..ReporterTuning::default()
    };
    let h = Reporter::spawn_tuned(cfg, tuning).unwrap();
    let first = h.incarnation();
    // σ "holds another incarnation": every change of the first one is refused from now on.
    let refused = Arc::new(Mutex::new(0u32));
    let r2 = refused.clone();
    fake.reject_changes(move |k| {
        let inc = match k {
            TcKind::RequestProgress(p) => p.incarnation,
            TcKind::WorkerSync(s) => s.incarnation,
            _ => return None,
        };
        (inc == first).then(|| {
            *r2.lock().unwrap() += 1;
            (
                v1::RejectReason::StaleIncarnation,
                format!("worker 4 is incarnation 9, not {first}"),
            )
        })
    });
    h.progress("victim", 10, 1, false).unwrap();

    fake.wait_for("a Hello of a new incarnation, then its full state", |f| {
        let changes = f.changes();
        let hello = changes.iter().position(|(_, k)| {
            matches!(k, TcKind::WorkerHello(w) if w.worker_id == 4 && w.incarnation != first)
        });
        hello.is_some_and(|at| {
            changes[at..].iter().any(|(_, k)| {
                matches!(k, TcKind::WorkerSync(s)
                    if s.incarnation != first && s.request_ids.iter().any(|r| r == "victim"))
            })
        })
    })
    .await;
    assert!(*refused.lock().unwrap() >= 1);
    let now = h.incarnation();
    assert_ne!(now, first, "the reporter took a new incarnation");
    assert!(h.stats().refusals >= 1, "{:?}", h.stats());
    // The new incarnation's progress is taken; the reporter stays connected.
    h.progress("victim", 10, 5, false).unwrap();
    fake.wait_for("the new incarnation's progress", |f| {
        f.progress_of("victim")
            .iter()
            .any(|p| p.incarnation == now && p.generated_tokens == 5)
    })
    .await;
    eventually(WAIT, "the reporter connected again", || async {
        h.is_connected()
    })
    .await;
    assert_eq!(
        ingest
            .metric(
                "balanceroute_ingest_rejected_total",
                &[("reason", "refused_by_snapshot")]
            )
            .await,
        1.0,
        "one stream ended, counted once"
    );
    h.shutdown().await;
    ingest.stop().await;
}

/// A Hello the snapshot service refuses because the worker is LIVE through another ingest
/// replica ends the stream with ALREADY_EXISTS naming it; other workers' streams live on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_live_elsewhere_ends_the_stream_with_already_exists() {
    let fake = FakeSnapshot::new();
    let served = fake.start().await;
    let ingest = TestIngest::start(served.addr, &[]).await;
    ingest.connected().await;
    fake.reject_changes(|k| match k {
        TcKind::WorkerHello(h) if h.worker_id == 1 => Some((
            v1::RejectReason::ConnectedElsewhere,
            "worker 1 is LIVE as incarnation 5 through ingest-b".into(),
        )),
        _ => None,
    });
    let mut bystander = ingest.worker().await;
    assert_eq!(
        status(&bystander.hello(GROUP, 2, 22).await),
        v1::AckStatus::Ok
    );
    let mut dup = ingest.worker().await;
    assert_eq!(status(&dup.hello(GROUP, 1, 11).await), v1::AckStatus::Ok);
    // Heartbeats until the relay ends the stream (acks never wait for the snapshot service).
    let mut seq = 0;
    let ended = loop {
        seq += 1;
        if dup.tx.send(heartbeat(seq)).await.is_err() {
            // The server ended the stream between two heartbeats (it dropped its receiving
            // side): the ending status follows whatever acks are still queued.
            break loop {
                if let Err(s) = dup.next().await {
                    break s;
                }
            };
        }
        match dup.next().await {
            Ok(_) => {}
            Err(s) => break s,
        }
        assert!(seq < 10_000, "the stream was never ended");
    };
    assert_eq!(ended.code(), tonic::Code::AlreadyExists, "{ended:?}");
    assert!(ended.message().contains("ingest-b"), "{ended:?}");
    // The bystander's stream lives on.
    assert_eq!(
        status(&bystander.call(heartbeat(1)).await),
        v1::AckStatus::Ok
    );
    assert_eq!(
        ingest
            .metric(
                "balanceroute_ingest_rejected_total",
                &[("reason", "connected_elsewhere")]
            )
            .await,
        1.0
    );
    ingest.stop().await;
}

/// A change the snapshot service refuses because σ holds the request under another worker
/// (NOT_OWNER) is about that request, not the worker: counted under the reporter's stream,
/// and the stream goes on (an honest worker reports such a request when a gateway misroutes
/// it). Its other changes are applied as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_of_another_workers_request_is_counted_and_the_stream_goes_on() {
    let fake = FakeSnapshot::new();
    let served = fake.start().await;
    let ingest = TestIngest::start(served.addr, &[]).await;
    ingest.connected().await;
    fake.reject_changes(|k| match k {
        TcKind::RequestProgress(p) if p.request_id == "theirs" => Some((
            v1::RejectReason::NotOwner,
            "request \"theirs\" belongs to worker 1, not to worker 0".into(),
        )),
        _ => None,
    });
    let mut w = ingest.worker().await;
    assert_eq!(status(&w.hello(GROUP, 0, 7).await), v1::AckStatus::Ok);
    let ack = w
        .call(progress(
            1,
            false,
            &[("theirs", 10, 3, false), ("mine", 5, 1, false)],
        ))
        .await;
    assert_eq!(status(&ack), v1::AckStatus::Ok, "acked before σ judges");
    eventually(WAIT, "ingest counted the refusal", || async {
        ingest
            .metric(
                "balanceroute_ingest_rejected_total",
                &[("reason", "not_owner")],
            )
            .await
            == 1.0
    })
    .await;
    fake.wait_for("the worker's own progress", |f| {
        !f.progress_of("mine").is_empty()
    })
    .await;
    // the stream lives on, and ended nothing
    assert_eq!(status(&w.call(heartbeat(2)).await), v1::AckStatus::Ok);
    assert_eq!(
        ingest
            .metric(
                "balanceroute_ingest_rejected_total",
                &[("reason", "refused_by_snapshot")]
            )
            .await,
        0.0
    );
    ingest.stop().await;
}
