//! `--hello-timeout` and `--stream-idle-timeout`: a stream that never says Hello, or goes
//! silent after it, is ended with DEADLINE_EXCEEDED and counted; the silent worker is reported
//! disconnected to the snapshot service exactly as if its stream had dropped. (The same against
//! the real processes with a raw HTTP/2 client: tests/tests/stream_timeouts.rs.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use br_proto::v1;
use br_proto::v1::telemetry_change::Kind as TcKind;
use common::*;

async fn timeouts(ing: &TestIngest, reason: &str) -> f64 {
    ing.metrics().await.value(
        "balanceroute_ingest_stream_timeouts_total",
        &[("reason", reason)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_hello_is_ended_with_deadline_exceeded() {
    let snap = FakeSnapshot::default();
    let srv = snap.start().await;
    let ing = TestIngest::start(srv.addr, &["--hello-timeout", "300ms"]).await;
    ing.connected().await;
    assert_eq!(timeouts(&ing, "hello").await, 0.0);

    let mut mute = ing.worker().await;
    let end = mute.next().await.expect_err("the stream is ended");
    assert_eq!(end.code(), tonic::Code::DeadlineExceeded, "{end:?}");
    assert_eq!(timeouts(&ing, "hello").await, 1.0);
    assert_eq!(
        ing.metrics()
            .await
            .sum("balanceroute_ingest_rejected_total"),
        0.0,
        "a timeout is not a rejection"
    );
    assert!(snap.changes().is_empty(), "nothing reached σ");
    drop(mute);
    ing.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_is_ended_and_its_worker_disconnected() {
    let snap = FakeSnapshot::default();
    let srv = snap.start().await;
    let ing = TestIngest::start(srv.addr, &["--stream-idle-timeout", "500ms"]).await;
    ing.connected().await;

    let mut w = ing.worker().await;
    assert_eq!(status(&w.hello("g0", 3, 42).await), v1::AckStatus::Ok);
    // Messages keep it: heartbeats spaced well inside the timeout.
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(100));
    for seq in 1..=12 {
        tick.tick().await;
        let ack = w.call(heartbeat(seq)).await;
        assert_eq!(ack.seq, seq);
    }
    assert_eq!(timeouts(&ing, "idle").await, 0.0);
    // Then silence.
    let end = w.next().await.expect_err("the silent stream is ended");
    assert_eq!(end.code(), tonic::Code::DeadlineExceeded, "{end:?}");
    assert_eq!(timeouts(&ing, "idle").await, 1.0);
    snap.wait_for("the silent worker's disconnect", |s| {
        s.changes().iter().any(|(_, k)| {
            matches!(k, TcKind::WorkerDisconnected(d) if d.worker_id == 3 && d.incarnation == 42)
        })
    })
    .await;
    // The slot is free: the same worker reconnects at once.
    let mut again = ing.worker().await;
    assert_eq!(status(&again.hello("g0", 3, 43).await), v1::AckStatus::Ok);
    drop((w, again));
    ing.stop().await;
}

/// A pause of this whole process (a busy host stopped the VM for seconds) is not the peer's
/// silence: the worker, stopped with it, speaks as soon as both run again, and keeps its
/// stream. A real silence afterwards still ends it. One thread runs ingest and the worker
/// here, so blocking it stops both, as the host does.
#[tokio::test(flavor = "current_thread")]
async fn a_pause_of_this_process_is_not_the_peers_silence() {
    let snap = FakeSnapshot::default();
    let srv = snap.start().await;
    let ing = TestIngest::start(srv.addr, &["--stream-idle-timeout", "500ms"]).await;
    ing.connected().await;

    let mut w = ing.worker().await;
    assert_eq!(status(&w.hello("g0", 5, 42).await), v1::AckStatus::Ok);
    assert_eq!(w.call(heartbeat(1)).await.seq, 1);
    // Everything stops for 2 s: the idle limit passes 1.5 s before ingest runs again.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let ack = w.call(heartbeat(2)).await;
    assert_eq!(ack.seq, 2, "the stream outlived the pause");
    assert_eq!(timeouts(&ing, "idle").await, 0.0);
    // Then a silence while ingest runs.
    let end = w.next().await.expect_err("the silent stream is ended");
    assert_eq!(end.code(), tonic::Code::DeadlineExceeded, "{end:?}");
    assert_eq!(timeouts(&ing, "idle").await, 1.0);
    drop(w);
    ing.stop().await;
}
