//! The engine topologies of the README's Integrating section, end to end: real
//! br-snapshot, br-ingest, br-decision (JSQ) and br-shim processes in front of a `br-emu
//! engine` process emulating each topology, one group per topology:
//! - `per-rank`: vLLM with one API server per rank (one shim per rank, each rank's own port);
//! - `vllm-dp`: vLLM with ONE API server for all ranks (one shim per rank, `--dp-rank-header`);
//! - `sglang-dp`: SGLang's DP controller (one shim per rank, `--dp-rank-field routed_dp_rank`);
//! - `multi`: one shim process serving every rank of one server (`--worker-ids`, the path
//!   prefix `/rank/<n>/` each rank announces as its endpoint).
//!
//! A gateway calls Assign and sends the completion to the endpoint Assign answered with, as
//! it is. Checked for each topology: a request in flight is ACTIVE in σ on the worker Assign
//! chose (the shim's telemetry reached σ as that worker), and every request ran on the engine
//! rank Assign chose (br-emu counts the requests each rank ran).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use br_e2e::engine::EmuEngine;
use br_e2e::{Service, Split};
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::{self, AssignRequest, GetRequest};
use br_testkit::eventually_some;
use futures::StreamExt as _;
use serde_json::json;

const START: Duration = Duration::from_secs(60);
/// A hang guard for the waits below, not a timing assertion.
const LONG: Duration = Duration::from_secs(60);
const RANKS: u32 = 2;

#[derive(Debug, Clone, Copy)]
enum Topology {
    PerRank,
    VllmDp,
    SglangDp,
    Multi,
}

impl Topology {
    fn group(self) -> &'static str {
        match self {
            Topology::PerRank => "per-rank",
            Topology::VllmDp => "vllm-dp",
            Topology::SglangDp => "sglang-dp",
            Topology::Multi => "multi",
        }
    }

    /// The shims of this topology in front of `engine`.
    fn shims(self, engine: &EmuEngine, ingest: &str) -> Vec<Service> {
        let group = self.group();
        let shim = |upstream: String, extra: Vec<String>| {
            let mut args = vec![
                "--upstream".to_owned(),
                upstream,
                "--ingest-addr".into(),
                ingest.to_owned(),
                "--group".into(),
                group.into(),
                "--capacity".into(),
                "64".into(),
            ];
            args.extend(extra);
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            Service::start("br-shim", &refs)
        };
        let per_rank = |pin: Option<(&str, &str)>| -> Vec<Service> {
            (0..RANKS)
                .map(|g| {
                    let mut extra = vec!["--worker-id".to_owned(), g.to_string()];
                    let upstream = match pin {
                        None => engine.rank_url(g as usize),
                        Some((flag, name)) => {
                            extra.extend([flag.to_owned(), name.to_owned()]);
                            engine.dp_url()
                        }
                    };
                    shim(upstream, extra)
                })
                .collect()
        };
        match self {
            Topology::PerRank => per_rank(None),
            Topology::VllmDp => per_rank(Some(("--dp-rank-header", "X-data-parallel-rank"))),
            Topology::SglangDp => per_rank(Some(("--dp-rank-field", "routed_dp_rank"))),
            Topology::Multi => vec![shim(
                engine.dp_url(),
                vec![
                    "--worker-ids".into(),
                    format!("0-{}", RANKS - 1),
                    "--dp-rank-header".into(),
                    "X-data-parallel-rank".into(),
                ],
            )],
        }
    }
}

async fn sigma(snapshot: &Service, group: &str) -> v1::ClusterSnapshot {
    SnapshotClient::connect(snapshot.grpc_url())
        .await
        .expect("snapshot reachable")
        .get(GetRequest {
            group: group.into(),
        })
        .await
        .expect("Get")
        .into_inner()
}

async fn assign(decision: &Service, group: &str, id: &str) -> v1::AssignResponse {
    let mut c = DecisionClient::connect(decision.grpc_url())
        .await
        .expect("decision reachable");
    let mut r = tonic::Request::new(AssignRequest {
        group: group.into(),
        request_id: id.into(),
        prompt_tokens: 16,
        ..Default::default()
    });
    r.set_timeout(Duration::from_secs(10));
    c.assign(r).await.expect("Assign").into_inner()
}

/// Sends a streaming completion to `endpoint` as a gateway does (the endpoint as Assign gave
/// it, plus the OpenAI path).
async fn send(endpoint: &str, id: &str, max_tokens: u32) -> reqwest::Response {
    let r = reqwest::Client::new()
        .post(format!("{endpoint}/v1/completions"))
        .header("x-request-id", id)
        .json(&json!({"model": "br-emu", "prompt": "x", "max_tokens": max_tokens, "stream": true}))
        .send()
        .await
        .expect("the shim answers");
    assert_eq!(r.status(), 200, "{endpoint}: {id}");
    r
}

async fn check(topology: Topology, snapshot: &Service, ingest: &str, decision: &Service) {
    let group = topology.group();
    let engine = EmuEngine::start(&[
        "--ranks",
        &RANKS.to_string(),
        "--slots",
        "64",
        "--time-scale",
        "0.1",
    ]);
    let shims = topology.shims(&engine, ingest);
    eventually_some(
        LONG,
        &format!("{group}: every worker LIVE in σ"),
        || async {
            let s = sigma(snapshot, group).await;
            let live = s
                .workers
                .iter()
                .filter(|w| w.liveness == v1::Liveness::Live as i32)
                .count();
            (live == RANKS as usize).then_some(())
        },
    )
    .await;
    decision.wait_for("/readyz", START).await;
    // What the engine ran before any request: the shims' rank checks (a pinned shim asks the
    // engine, before its first Hello, whether it serves its ranks).
    let before = engine.requests_per_rank().await;

    // One long request per rank, in flight: ACTIVE in σ on the worker Assign chose.
    let mut open = Vec::new();
    for i in 0..RANKS {
        let id = format!("{group}-long-{i}");
        let a = assign(decision, group, &id).await;
        let resp = send(&a.endpoint, &id, 100_000).await;
        let mut body = resp.bytes_stream();
        body.next()
            .await
            .expect("a first chunk")
            .expect("the stream");
        eventually_some(
            LONG,
            &format!("{group}: {id} active with tokens on worker {}", a.worker_id),
            || async {
                sigma(snapshot, group)
                    .await
                    .requests
                    .iter()
                    .any(|r| {
                        r.request_id == id && r.worker_id == a.worker_id && r.generated_tokens > 0
                    })
                    .then_some(())
            },
        )
        .await;
        open.push((a.worker_id, body));
    }
    let mut chosen: Vec<u32> = open.iter().map(|(w, _)| *w).collect();
    chosen.sort_unstable();
    assert_eq!(
        chosen,
        (0..RANKS).collect::<Vec<_>>(),
        "{group}: JSQ spreads the long ones"
    );
    drop(open);

    // Short ones: each ran on the rank Assign chose.
    let mut want = vec![0u64; RANKS as usize];
    for &w in &chosen {
        want[w as usize] += 1;
    }
    for i in 0..6 {
        let id = format!("{group}-short-{i}");
        let a = assign(decision, group, &id).await;
        let mut body = send(&a.endpoint, &id, 3).await.bytes_stream();
        while let Some(chunk) = body.next().await {
            chunk.expect("the stream completes");
        }
        want[a.worker_id as usize] += 1;
    }
    // Three in a row to the endpoint worker 1 announced (as σ holds it): all run on rank 1,
    // whatever the engine would have picked by itself (br-emu round-robins unpinned requests).
    let endpoint = sigma(snapshot, group)
        .await
        .workers
        .iter()
        .find(|w| w.worker_id == 1)
        .map(|w| w.endpoint.clone())
        .expect("worker 1 in σ");
    for i in 0..3 {
        let id = format!("{group}-direct-{i}");
        let mut body = send(&endpoint, &id, 3).await.bytes_stream();
        while let Some(chunk) = body.next().await {
            chunk.expect("the stream completes");
        }
        want[1] += 1;
    }
    let ran: Vec<u64> = engine
        .requests_per_rank()
        .await
        .iter()
        .zip(&before)
        .map(|(n, b)| n - b)
        .collect();
    assert_eq!(
        ran, want,
        "{group}: the requests per engine rank are those Assign chose"
    );
    drop(shims);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_topology_runs_each_request_on_the_rank_assign_chose() {
    let groups = "per-rank,vllm-dp,sglang-dp,multi";
    let Split {
        snapshot,
        ingest,
        decision,
    } = Split::start(&[], &["--policy", "jsq", "--groups", groups]).await;
    for t in [
        Topology::PerRank,
        Topology::VllmDp,
        Topology::SglangDp,
        Topology::Multi,
    ] {
        check(t, &snapshot, &ingest.grpc_url(), &decision).await;
    }
}
