//! A shim whose engine dies or freezes takes its worker out of routing, and brings it back when
//! the engine answers again. Real processes: br-snapshot, br-ingest, br-decision
//! (JSQ), two `br-emu engine`s with a br-shim each; the first engine is killed with SIGKILL and
//! restarted, or frozen with SIGSTOP and thawed. A gateway loop (Assign, then the completion
//! through the chosen worker's shim) runs across the fault.
//!
//! Invariants checked: once σ shows the worker SUSPECT, decision assigns nothing to it; the
//! shim's `/readyz` fails saying why; when the engine is back the worker is LIVE again as the
//! same incarnation (within the snapshot service's worker grace), `/readyz` passes and requests
//! reach it. How long each step took is printed (a measurement, not an assertion: a loaded
//! 2-core machine is no clock).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use br_e2e::engine::EmuEngine;
use br_e2e::{Service, Split};
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::{self, AssignRequest, GetRequest};
use br_testkit::{eventually, eventually_some};
use serde_json::json;

const GROUP: &str = "shim-health";
const START: Duration = Duration::from_secs(60);
/// A hang guard for the waits below, not a timing assertion.
const LONG: Duration = Duration::from_secs(60);

struct Rank {
    engine: EmuEngine,
    shim: Service,
}

struct Stack {
    snapshot: Service,
    _ingest: Service,
    decision: Service,
    ranks: Vec<Rank>,
}

impl Stack {
    async fn start() -> Stack {
        // A grace long enough that every fault below ends before the worker is fenced: it
        // comes back as the same incarnation with its requests.
        let Split {
            snapshot,
            ingest,
            decision,
        } = Split::start(
            &["--worker-grace", "60s"],
            &["--policy", "jsq", "--groups", GROUP],
        )
        .await;
        let mut ranks = Vec::new();
        for id in 0..2u32 {
            let engine =
                EmuEngine::start(&["--ranks", "1", "--slots", "64", "--time-scale", "0.1"]);
            let shim = Service::start(
                "br-shim",
                &[
                    "--upstream",
                    &engine.rank_url(0),
                    "--ingest-addr",
                    &ingest.grpc_url(),
                    "--group",
                    GROUP,
                    "--worker-id",
                    &id.to_string(),
                    "--capacity",
                    "64",
                ],
            );
            ranks.push(Rank { engine, shim });
        }
        let s = Stack {
            snapshot,
            _ingest: ingest,
            decision,
            ranks,
        };
        for id in 0..2 {
            s.wait_liveness(id, v1::Liveness::Live).await;
            s.ranks[id as usize].shim.wait_for("/readyz", START).await;
        }
        s.decision.wait_for("/readyz", START).await;
        s
    }

    async fn sigma(&self) -> v1::ClusterSnapshot {
        SnapshotClient::connect(self.snapshot.grpc_url())
            .await
            .expect("snapshot reachable")
            .get(GetRequest {
                group: GROUP.into(),
            })
            .await
            .expect("Get")
            .into_inner()
    }

    /// The worker's (liveness, incarnation) in σ.
    async fn worker(&self, id: u32) -> Option<(i32, u64)> {
        self.sigma()
            .await
            .workers
            .iter()
            .find(|w| w.worker_id == id)
            .map(|w| (w.liveness, w.incarnation))
    }

    /// Waits until σ shows worker `id` with `liveness`; returns its incarnation.
    async fn wait_liveness(&self, id: u32, liveness: v1::Liveness) -> u64 {
        eventually_some(LONG, &format!("worker {id} {liveness:?} in σ"), || async {
            self.worker(id)
                .await
                .and_then(|(l, inc)| (l == liveness as i32).then_some(inc))
        })
        .await
    }

    /// Waits until decision's replica of σ holds the version σ has now.
    async fn decision_caught_up(&self) {
        let version = self.sigma().await.version as f64;
        eventually(LONG, "decision's σ replica caught up", || async {
            br_testkit::http::metrics_url(&self.decision.admin_url("/metrics"))
                .await
                .sum("balanceroute_decision_sigma_version")
                >= version
        })
        .await;
    }

    /// One Assign: the worker chosen and its endpoint.
    async fn assign(&self, id: &str) -> v1::AssignResponse {
        let mut c = DecisionClient::connect(self.decision.grpc_url())
            .await
            .expect("decision reachable");
        let mut r = tonic::Request::new(AssignRequest {
            group: GROUP.into(),
            request_id: id.into(),
            prompt_tokens: 16,
            ..Default::default()
        });
        r.set_timeout(Duration::from_secs(10));
        c.assign(r).await.expect("Assign").into_inner()
    }

    /// What a gateway does: Assign, then the completion through the chosen worker's shim.
    /// The worker chosen and the HTTP status (0: no response).
    async fn gateway(&self, id: &str) -> (u32, u16) {
        let a = self.assign(id).await;
        let status = reqwest::Client::new()
            .post(format!("{}/v1/completions", a.endpoint))
            .header("x-request-id", id)
            .json(&json!({"model": "br-emu", "prompt": "x", "max_tokens": 4, "stream": true}))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .map_or(0, |r| r.status().as_u16());
        (a.worker_id, status)
    }

    async fn readyz(&self, rank: usize) -> (u16, String) {
        let r = reqwest::get(self.ranks[rank].shim.admin_url("/readyz"))
            .await
            .expect("shim admin reachable");
        (r.status().as_u16(), r.text().await.unwrap())
    }
}

/// Runs `n` gateway requests one after another; the (worker, status) of each.
async fn gateway_loop(s: &Stack, prefix: &str, n: usize) -> Vec<(u32, u16)> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        out.push(s.gateway(&format!("{prefix}-{i}")).await);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_engine_takes_its_worker_out_of_routing_and_its_restart_brings_it_back() {
    let mut s = Stack::start().await;
    let incarnation = s.wait_liveness(0, v1::Liveness::Live).await;
    let before = gateway_loop(&s, "before", 4).await;
    assert!(before.iter().all(|(_, st)| *st == 200), "{before:?}");
    assert!(
        before.iter().any(|(w, _)| *w == 0),
        "JSQ alternates: {before:?}"
    );

    // kill -9 the engine of worker 0, while a gateway keeps sending.
    let killed = Instant::now();
    s.ranks[0].engine.kill();
    let during = gateway_loop(&s, "after-kill", 30).await;
    let failed = during.iter().filter(|(_, st)| *st != 200).count();
    s.wait_liveness(0, v1::Liveness::Suspect).await;
    println!(
        "kill -9: worker 0 SUSPECT in σ {:?} after the kill (at most); {failed} of the next 30 \
         gateway requests failed: {during:?}",
        killed.elapsed()
    );
    assert!(
        during.iter().all(|(w, st)| *w == 0 || *st == 200),
        "only the dead engine's requests fail: {during:?}"
    );
    s.decision_caught_up().await;
    let (status, body) = s.readyz(0).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("engine down"), "{body}");

    // SUSPECT in σ: decision assigns nothing to it.
    let out = gateway_loop(&s, "out", 10).await;
    assert!(
        out.iter().all(|(w, st)| *w == 1 && *st == 200),
        "assigned to the worker whose engine is dead: {out:?}"
    );
    let m = br_testkit::http::metrics(s.ranks[0].shim.admin_addr()).await;
    let labels = [("group", GROUP), ("worker", "0")];
    assert_eq!(m.value("balanceroute_shim_engine_up", &labels), 0.0);

    // The engine restarts on its port: the worker is back by itself, as the same incarnation.
    let restarted = Instant::now();
    s.ranks[0].engine.restart();
    let back = s.wait_liveness(0, v1::Liveness::Live).await;
    println!(
        "restart: worker 0 LIVE again {:?} after the restart",
        restarted.elapsed()
    );
    assert_eq!(
        back, incarnation,
        "a reconnect within the grace keeps the incarnation"
    );
    s.ranks[0].shim.wait_for("/readyz", LONG).await;
    // JSQ: worker 1 holds the reservations made meanwhile, so worker 0 is chosen again and
    // its request runs.
    eventually(
        LONG,
        "a request assigned to worker 0 and served",
        || async {
            let (w, st) = s.gateway(&format!("back-{}", rand_id())).await;
            w == 0 && st == 200
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_engine_takes_its_worker_out_of_routing_until_it_thaws() {
    let s = Stack::start().await;
    let incarnation = s.wait_liveness(0, v1::Liveness::Live).await;

    let thaw = s.ranks[0].engine.freeze();
    let frozen = Instant::now();
    s.wait_liveness(0, v1::Liveness::Suspect).await;
    println!(
        "SIGSTOP: worker 0 SUSPECT in σ {:?} after the freeze (at most)",
        frozen.elapsed()
    );
    s.decision_caught_up().await;
    let (status, body) = s.readyz(0).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("did not answer within"), "{body}");
    let out = gateway_loop(&s, "frozen", 6).await;
    assert!(
        out.iter().all(|(w, st)| *w == 1 && *st == 200),
        "assigned to the worker whose engine is frozen: {out:?}"
    );

    thaw.send(()).expect("the thaw thread waits");
    let thawed = Instant::now();
    let back = s.wait_liveness(0, v1::Liveness::Live).await;
    println!(
        "SIGCONT: worker 0 LIVE again {:?} after the thaw",
        thawed.elapsed()
    );
    assert_eq!(back, incarnation);
    s.ranks[0].shim.wait_for("/readyz", LONG).await;
    eventually(
        LONG,
        "a request assigned to worker 0 and served",
        || async {
            let (w, st) = s.gateway(&format!("thawed-{}", rand_id())).await;
            w == 0 && st == 200
        },
    )
    .await;
}

/// A fresh request id suffix (each Assign of a retry loop is a new request).
fn rand_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}
