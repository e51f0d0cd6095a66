//! Under mutual TLS a worker reports only its own requests: br-all with TLS, two workers on
//! their own certificates (`spiffe://<td>/br/worker/g0/0` and `.../1`), a gateway and the
//! admin. Worker 0 lies in every message: progress for worker 1's ACTIVE request, a start of
//! its RESERVED one, a finish of the one it runs unreserved, and a full state listing them
//! all. Each change is refused NOT_OWNER in σ's writer (counted by the snapshot service and
//! by ingest under the liar's name), σ keeps every request on worker 1, and worker 1's full
//! state afterwards is exactly what σ holds. The liar's stream goes on (a per-change refusal:
//! an honest worker reports such a request too when a gateway misroutes it).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use br_e2e::Service;
use br_e2e::pki::{self, Pki};
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::telemetry_client::TelemetryClient;
use br_proto::v1::{self, worker_report};
use br_testkit::{Metrics, eventually, eventually_some, within};
use br_trust::Role;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

const GROUP: &str = "g0";
const START: Duration = Duration::from_secs(60);
const CALL: Duration = Duration::from_secs(20);

/// One worker's telemetry stream, on its own certificate.
struct Worker {
    tx: mpsc::Sender<v1::WorkerReport>,
    seq: u64,
    /// The stream's end, if the server ended it.
    ended: tokio::sync::watch::Receiver<Option<tonic::Status>>,
}

impl Worker {
    async fn connect(ch: Channel, worker_id: u32) -> Worker {
        let (tx, rx) = mpsc::channel(16);
        let hello = v1::WorkerReport {
            kind: Some(worker_report::Kind::Hello(v1::Hello {
                group: GROUP.into(),
                worker_id,
                incarnation: 0x1d00 + u64::from(worker_id),
                capacity: 64,
                endpoint: format!("http://127.0.0.1:{}", 18000 + worker_id),
            })),
        };
        tx.send(hello).await.unwrap();
        let mut acks = within(CALL, "the Report stream opens", async {
            TelemetryClient::new(ch)
                .report(ReceiverStream::new(rx))
                .await
                .expect("the worker's Report stream")
                .into_inner()
        })
        .await;
        within(CALL, "the Hello's ack", acks.message())
            .await
            .expect("an ack")
            .expect("an ack, not the end");
        let (end_tx, ended) = tokio::sync::watch::channel(None);
        tokio::spawn(async move {
            loop {
                match acks.message().await {
                    Ok(Some(_)) => {}
                    Ok(None) => {
                        let _ = end_tx.send(Some(tonic::Status::ok("ended")));
                        return;
                    }
                    Err(s) => {
                        let _ = end_tx.send(Some(s));
                        return;
                    }
                }
            }
        });
        Worker { tx, seq: 0, ended }
    }

    async fn report(&mut self, updates: &[(&str, u32, u32, bool)], full_state: bool) {
        self.seq += 1;
        let updates = updates
            .iter()
            .map(|&(id, prompt, generated, finished)| v1::RequestProgress {
                request_id: id.into(),
                prompt_tokens: prompt,
                generated_tokens: generated,
                finished,
                unkeyed: false,
            })
            .collect();
        let msg = v1::WorkerReport {
            kind: Some(worker_report::Kind::Progress(v1::Progress {
                seq: self.seq,
                updates,
                full_state,
                ..Default::default()
            })),
        };
        self.tx.send(msg).await.expect("the stream is open");
    }
}

async fn assign(gw: &Channel, id: &str, prompt_tokens: u32) -> v1::AssignResponse {
    let req = v1::AssignRequest {
        group: GROUP.into(),
        request_id: id.into(),
        prompt_tokens,
        ..Default::default()
    };
    within(
        CALL,
        "an Assign",
        DecisionClient::new(gw.clone()).assign(req),
    )
    .await
    .expect("the Assign")
    .into_inner()
}

async fn sigma(admin: &Channel) -> v1::ClusterSnapshot {
    let req = v1::GetRequest {
        group: GROUP.into(),
    };
    within(
        CALL,
        "Snapshot.Get",
        SnapshotClient::new(admin.clone()).get(req),
    )
    .await
    .expect("σ as the admin")
    .into_inner()
}

/// (worker, phase, generated) of every request σ holds, by id.
async fn held(admin: &Channel) -> std::collections::BTreeMap<String, (u32, v1::RequestPhase, u32)> {
    sigma(admin)
        .await
        .requests
        .into_iter()
        .map(|r| {
            let phase = r.state();
            (r.request_id, (r.worker_id, phase, r.generated_tokens))
        })
        .collect()
}

async fn metrics(all: &Service, pki: &Pki) -> Metrics {
    let admin = pki.role(Role::Admin);
    let (code, body) = pki::https_get(all.admin_addr(), &admin.ca, Some(&admin), "/metrics")
        .await
        .expect("/metrics as the admin");
    assert_eq!(code, 200, "{body}");
    Metrics::parse(&body).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_names_another_workers_requests_changes_nothing() {
    use v1::RequestPhase::{Active, Reserved};
    let pki = Pki::new();
    let mut flags = pki.flags(Role::All);
    // long enough that no reservation expires while the test runs
    flags.extend(["--groups", GROUP, "--reservation-ttl", "5m"].map(String::from));
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let all = Service::start("br-all", &args);
    let url = all.grpc_url();
    let expect = Some(Role::All);
    let admin = pki::channel(&url, &pki.role(Role::Admin), expect);
    let gw = pki::channel(&url, &pki.role(Role::Gateway), expect);
    let mut w0 = Worker::connect(pki::channel(&url, &pki.worker(GROUP, 0), expect), 0).await;
    let mut w1 = Worker::connect(pki::channel(&url, &pki.worker(GROUP, 1), expect), 1).await;

    // Everything the gateway assigns goes to worker 1 while worker 0 is cordoned.
    eventually(START, "σ holds both workers", || async {
        sigma(&admin).await.workers.len() == 2
    })
    .await;
    let cordon = v1::SetCordonRequest {
        group: GROUP.into(),
        worker_id: 0,
        cordoned: true,
    };
    within(
        CALL,
        "SetCordon",
        SnapshotClient::new(admin.clone()).set_cordon(cordon),
    )
    .await
    .expect("cordoning worker 0");
    let active = eventually_some(START, "the first Assign is answered", || async {
        let req = v1::AssignRequest {
            group: GROUP.into(),
            request_id: "w1-active".into(),
            prompt_tokens: 30,
            ..Default::default()
        };
        DecisionClient::new(gw.clone()).assign(req).await.ok()
    })
    .await
    .into_inner();
    assert_eq!(active.worker_id, 1, "{active:?}");
    assert_eq!(assign(&gw, "w1-reserved", 40).await.worker_id, 1);

    // Worker 1 runs its reserved request and one the gateway sent unreserved.
    w1.report(
        &[("w1-active", 30, 3, false), ("w1-unreserved", 20, 2, false)],
        false,
    )
    .await;
    eventually(START, "σ holds worker 1's reports", || async {
        let h = held(&admin).await;
        h.get("w1-active") == Some(&(1, Active, 3))
            && h.get("w1-unreserved") == Some(&(1, Active, 2))
            && h.get("w1-reserved") == Some(&(1, Reserved, 0))
    })
    .await;

    // Worker 0 lies in every message, then reports a request of its own: once σ holds that
    // one, σ's writer has judged every lie before it (one stream, one Apply stream, in order).
    w0.report(&[("w1-active", 30, 50, false)], false).await;
    w0.report(&[("w1-reserved", 99, 0, false)], false).await;
    w0.report(&[("w1-unreserved", 20, 2, true)], false).await;
    w0.report(
        &[
            ("w1-active", 30, 60, false),
            ("w1-reserved", 99, 1, false),
            ("w0-own", 10, 1, false),
        ],
        true,
    )
    .await;
    eventually(START, "σ holds worker 0's own request", || async {
        held(&admin).await.get("w0-own") == Some(&(0, Active, 1))
    })
    .await;
    let h = held(&admin).await;
    assert_eq!(h.get("w1-active"), Some(&(1, Active, 3)), "{h:?}");
    assert_eq!(h.get("w1-reserved"), Some(&(1, Reserved, 0)), "{h:?}");
    assert_eq!(h.get("w1-unreserved"), Some(&(1, Active, 2)), "{h:?}");

    // Refused, typed and counted: by σ's writer, and by ingest under the liar's name.
    // (ingest may coalesce a request's reports of one tick into one change: at least one
    // refusal per request named, and ingest counts each one σ's writer refused)
    let refused = metrics(&all, &pki).await.value(
        "balanceroute_snapshot_rejected_total",
        &[("reason", "not_owner")],
    );
    assert!((3.0..=5.0).contains(&refused), "{refused}");
    eventually(START, "ingest counted the refusals", || async {
        metrics(&all, &pki).await.get(
            "balanceroute_ingest_rejected_total",
            &[("reason", "not_owner")],
        ) == Some(refused)
    })
    .await;
    // the liar's stream goes on (a refusal per change, not of the worker)
    assert!(w0.ended.borrow().is_none(), "{:?}", w0.ended.borrow());

    // Worker 1's full state is what σ holds afterwards.
    w1.report(
        &[("w1-active", 30, 8, false), ("w1-unreserved", 20, 5, false)],
        true,
    )
    .await;
    eventually(START, "σ holds worker 1's full state", || async {
        let h = held(&admin).await;
        h.get("w1-active") == Some(&(1, Active, 8))
            && h.get("w1-unreserved") == Some(&(1, Active, 5))
    })
    .await;
    let h = held(&admin).await;
    assert_eq!(h.get("w1-reserved"), Some(&(1, Reserved, 0)), "{h:?}");
    assert_eq!(h.len(), 4, "{h:?}");
    let loads: Vec<(u32, u64)> = sigma(&admin)
        .await
        .workers
        .iter()
        .map(|w| (w.worker_id, w.load_tokens))
        .collect();
    assert!(loads.contains(&(0, 11)), "{loads:?}");
    assert!(loads.contains(&(1, 38 + 40 + 25)), "{loads:?}");
    assert!(w0.ended.borrow().is_none() && w1.ended.borrow().is_none());
}
