//! A cordon survives a crash of the snapshot service: br-snapshot with `--cordon-file`,
//! br-ingest, br-decision and two fake workers as real processes. Worker 0 runs a long
//! request, worker 1 is empty, so the balancing policy sends new requests to worker 1 unless
//! it is cordoned. The operator cordons worker 1 (Snapshot.SetCordon), br-snapshot is killed
//! with SIGKILL and started again on the same ports; σ is rebuilt from the workers' Hellos and
//! full states (which know nothing of cordons). Checked: the rebuilt σ holds worker 1
//! cordoned, and Assigns decided on it never go to worker 1; an uncordon (which is also
//! written to the file) brings worker 1 back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use br_e2e::{FakeWorker, Service};
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::{self, AssignRequest, GetRequest, SetCordonRequest};
use br_testkit::{eventually, eventually_some, within};

const GROUP: &str = "cordon";
const START: Duration = Duration::from_secs(60);
const CALL: Duration = Duration::from_secs(20);

async fn sigma(snapshot: &Service) -> Option<v1::ClusterSnapshot> {
    let mut c = SnapshotClient::connect(snapshot.grpc_url()).await.ok()?;
    let req = GetRequest {
        group: GROUP.into(),
    };
    Some(c.get(req).await.ok()?.into_inner())
}

/// σ's version once both workers are LIVE in it, and whether worker 1 is cordoned there.
async fn both_live(snapshot: &Service) -> Option<(u64, bool)> {
    let s = sigma(snapshot).await?;
    let live = |id: u32| {
        s.workers
            .iter()
            .find(|w| w.worker_id == id && w.liveness == v1::Liveness::Live as i32)
    };
    let (w0, w1) = (live(0)?, live(1)?);
    assert!(!w0.cordoned, "worker 0 is never cordoned");
    Some((s.version, w1.cordoned))
}

async fn set_cordon(snapshot: &Service, worker_id: u32, cordoned: bool) {
    let mut c = SnapshotClient::connect(snapshot.grpc_url()).await.unwrap();
    let req = SetCordonRequest {
        group: GROUP.into(),
        worker_id,
        cordoned,
    };
    within(CALL, "SetCordon", c.set_cordon(req))
        .await
        .expect("SetCordon");
}

async fn assign(decision: &Service, id: &str) -> Result<v1::AssignResponse, tonic::Status> {
    let mut c = DecisionClient::connect(decision.grpc_url()).await.unwrap();
    let mut req = tonic::Request::new(AssignRequest {
        group: GROUP.into(),
        request_id: id.into(),
        prompt_tokens: 10,
        prompt_hash: None,
        max_tokens: None,
        expected_output_tokens: None,
        request_class: None,
    });
    req.set_timeout(Duration::from_secs(5));
    within(CALL, "an Assign", c.assign(req))
        .await
        .map(tonic::Response::into_inner)
}

/// Assigns until an answer is decided on σ of at least `version` and confirmed by the
/// snapshot service (not stale); returns it.
async fn fresh_assign(decision: &Service, prefix: &str, version: u64) -> v1::AssignResponse {
    let mut n = 0;
    eventually_some(START, "a fresh answer on the rebuilt σ", || {
        n += 1;
        let id = format!("{prefix}-{n}");
        async move {
            assign(decision, &id)
                .await
                .ok()
                .filter(|a| !a.stale && a.sigma_version >= version)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cordon_survives_a_snapshot_crash() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cordons.json");
    let file_arg = file.to_string_lossy().into_owned();
    let mut snapshot = Service::start(
        "br-snapshot",
        &["--cordon-file", &file_arg, "--reservation-ttl", "60s"],
    );
    snapshot.wait_for("/livez", START).await;
    let snap = snapshot.grpc_url();
    let ingest = Service::start("br-ingest", &["--snapshot-addr", &snap]);
    ingest.wait_for("/readyz", START).await;
    let decision = Service::start(
        "br-decision",
        &["--snapshot-addr", &snap, "--groups", GROUP],
    );
    let mut w0 = FakeWorker::connect(&ingest.grpc_url(), GROUP, 0, 8).await;
    let _w1 = FakeWorker::connect(&ingest.grpc_url(), GROUP, 1, 8).await;
    // worker 0 is busy: a request of 2000 tokens runs there
    w0.start("long", 2000).await;
    eventually(START, "σ holds worker 0's load", || async {
        sigma(&snapshot)
            .await
            .is_some_and(|s| s.requests.iter().any(|r| r.request_id == "long"))
    })
    .await;
    decision.wait_for("/readyz", START).await;

    // The control: routable, the empty worker 1 gets the request.
    let version = both_live(&snapshot).await.expect("both workers live").0;
    let control = fresh_assign(&decision, "control", version).await;
    assert_eq!(control.worker_id, 1, "the policy prefers the empty worker");

    set_cordon(&snapshot, 1, true).await;
    let (version, cordoned) = both_live(&snapshot).await.expect("both workers live");
    assert!(cordoned);
    let before = fresh_assign(&decision, "before", version).await;
    assert_eq!(before.worker_id, 0, "a cordoned worker gets nothing");

    // The crash: σ is gone; ingest re-sends the workers' Hellos and asks for their full
    // states in its next acks (worker 0 keeps generating, as a real rank would, so it gets
    // them; a shim's heartbeats do the same for an idle one).
    snapshot.restart();
    let w0 = tokio::sync::Mutex::new(w0);
    let (version, cordoned) = eventually_some(
        START,
        "σ rebuilt with both workers and worker 0's load",
        || async {
            w0.lock().await.step(1).await;
            let loaded = sigma(&snapshot)
                .await
                .is_some_and(|s| s.requests.iter().any(|r| r.request_id == "long"));
            both_live(&snapshot).await.filter(|_| loaded)
        },
    )
    .await;
    assert!(cordoned, "worker 1 is cordoned in the rebuilt σ");
    for i in 0..4 {
        let a = fresh_assign(&decision, &format!("after{i}"), version).await;
        assert_eq!(
            a.worker_id, 0,
            "after the restart worker 1 is still cordoned: {a:?}"
        );
    }
    let text = std::fs::read_to_string(&file).expect("the cordon file");
    let on_disk: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(on_disk["groups"][GROUP], serde_json::json!([1]), "{text}");

    // Uncordoned: routable again, and the file says so.
    set_cordon(&snapshot, 1, false).await;
    let (version, cordoned) = both_live(&snapshot).await.expect("both workers live");
    assert!(!cordoned);
    let back = fresh_assign(&decision, "back", version).await;
    assert_eq!(
        back.worker_id, 1,
        "uncordoned, the empty worker gets requests again"
    );
    let text = std::fs::read_to_string(&file).expect("the cordon file");
    let on_disk: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(on_disk["groups"], serde_json::json!({}), "{text}");
}
