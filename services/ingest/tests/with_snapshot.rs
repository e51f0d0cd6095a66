//! br-ingest against the real br-snapshot (both in-process, over gRPC on 127.0.0.1), fed by the
//! real telemetry reporter: σ follows the workers' telemetry, and is rebuilt from the shims'
//! full states after the snapshot service restarts with a new epoch.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use br_client::reporter::{Reporter, ReporterConfig, ReporterHandle, ReporterTuning};
use br_proto::v1;
use common::*;
use tokio_util::sync::CancellationToken;

async fn start_snapshot(listen: &str) -> (br_snapshot::Running, CancellationToken) {
    br_snapshot::test_util::start(listen, &["--shutdown-grace", "1s"]).await
}

async fn get(addr: SocketAddr, group: &str) -> Option<v1::ClusterSnapshot> {
    let mut c = v1::snapshot_client::SnapshotClient::connect(format!("http://{addr}"))
        .await
        .ok()?;
    c.get(v1::GetRequest {
        group: group.into(),
    })
    .await
    .ok()
    .map(|r| r.into_inner())
}

/// Polls σ until `pred` holds (bounded); returns it.
async fn sigma_until(
    addr: SocketAddr,
    group: &str,
    what: &str,
    pred: impl Fn(&v1::ClusterSnapshot) -> bool,
) -> v1::ClusterSnapshot {
    br_testkit::eventually_some(WAIT, what, || async {
        get(addr, group).await.filter(|s| pred(s))
    })
    .await
}

fn request<'a>(s: &'a v1::ClusterSnapshot, id: &str) -> Option<&'a v1::RequestState> {
    s.requests.iter().find(|r| r.request_id == id)
}

fn reporter(ingest: SocketAddr, worker: u32) -> ReporterHandle {
    let cfg = ReporterConfig::new(format!("http://{ingest}"), "gs", worker, 16);
    let tuning = ReporterTuning {
        flush_interval: Duration::from_millis(2),
        backoff_initial: Duration::from_millis(10),
        backoff_max: Duration::from_millis(200),
        ..ReporterTuning::default()
    };
    Reporter::spawn_tuned(cfg, tuning).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigma_follows_telemetry_and_is_rebuilt_after_a_snapshot_restart() {
    let (snap, snap_stop) = start_snapshot("127.0.0.1:0").await;
    let saddr = snap.grpc_addr();
    let first_epoch = snap.extra().epoch;
    let ing = TestIngest::start(saddr, &[]).await;
    ing.connected().await;

    let w0 = reporter(ing.grpc, 0);
    let w1 = reporter(ing.grpc, 1);
    for j in 0..=40 {
        w0.progress("a", 100, j, false).unwrap();
        w1.progress("b", 200, j / 2, false).unwrap();
        w1.progress("done", 10, j, j == 40).unwrap();
    }
    let s = sigma_until(saddr, "gs", "both workers and their requests", |s| {
        s.workers.len() == 2
            && s.workers
                .iter()
                .all(|w| w.liveness == v1::Liveness::Live as i32)
            && request(s, "a").is_some_and(|r| r.generated_tokens == 40)
            && request(s, "b").is_some_and(|r| r.generated_tokens == 20)
            && request(s, "done").is_none()
    })
    .await;
    assert_eq!(s.epoch, first_epoch);
    let a = request(&s, "a").unwrap();
    assert_eq!((a.worker_id, a.incarnation), (0, w0.incarnation()));
    assert_eq!(a.prompt_tokens, 100);
    assert_eq!(a.state, v1::RequestPhase::Active as i32);
    // Load L_g = s_i + j of its requests.
    let l0 = s
        .workers
        .iter()
        .find(|w| w.worker_id == 0)
        .unwrap()
        .load_tokens;
    assert_eq!(l0, 140);

    // The snapshot service restarts on the same port: a new, empty σ with a new epoch. Ingest
    // reconnects, re-sends the Hellos and asks the shims for full states: σ is rebuilt.
    snap_stop.cancel();
    within(WAIT, "the snapshot service stops", snap.wait())
        .await
        .unwrap();
    let (snap2, snap2_stop) = start_snapshot(&saddr.to_string()).await;
    assert_ne!(snap2.extra().epoch, first_epoch);
    w0.progress("a", 100, 41, false).unwrap();
    let s = sigma_until(saddr, "gs", "σ rebuilt from full states", |s| {
        s.workers.len() == 2
            && s.workers
                .iter()
                .all(|w| w.liveness == v1::Liveness::Live as i32)
            && request(s, "a").is_some_and(|r| r.generated_tokens == 41)
            && request(s, "b").is_some_and(|r| r.generated_tokens == 20)
    })
    .await;
    assert_eq!(s.epoch, snap2.extra().epoch);
    assert!(request(&s, "done").is_none(), "finished requests stay gone");

    // A worker's stream ends: it becomes SUSPECT (its requests stay during the grace period).
    w1.shutdown().await;
    let s = sigma_until(saddr, "gs", "worker 1 suspect", |s| {
        s.workers
            .iter()
            .any(|w| w.worker_id == 1 && w.liveness != v1::Liveness::Live as i32)
    })
    .await;
    assert!(
        s.workers
            .iter()
            .any(|w| w.worker_id == 0 && w.liveness == v1::Liveness::Live as i32)
    );
    w0.shutdown().await;
    ing.stop().await;
    snap2_stop.cancel();
    within(WAIT, "the snapshot service stops", snap2.wait())
        .await
        .unwrap();
}
