//! br-shim's request bounds as a real process: `--max-body-bytes` (413),
//! `--max-concurrent-requests` (503 `concurrency`), `--max-buffered-body-bytes` (503
//! `body_budget`) and `--body-timeout` (408), each a typed JSON error counted in the process's
//! own `/metrics`. `services/shim/tests/proxy.rs` checks the same rules against the library in
//! one process; here the binary is parsed, wired and served as an operator runs it: br-snapshot,
//! br-ingest and one `br-emu engine` behind three shims, one per bound.
//!
//! Invariants checked beside each refusal: the shim stays in routing (`/readyz` passes), and a
//! refused request never reaches σ (the rank's request count is back to zero once the accepted
//! ones have ended). Peak memory per body is a benchmark (`scripts/bench-shim-body.sh`,
//! docs/benchmarks.md), not an assertion here.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use br_e2e::Service;
use br_e2e::engine::EmuEngine;
use br_proto::v1::GetRequest;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_testkit::http::stalled_post;
use br_testkit::{eventually, eventually_some, within};
use futures::StreamExt as _;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt as _;

const GROUP: &str = "shim-bounds";
const START: Duration = Duration::from_secs(60);
/// A hang guard for the waits below, not a timing assertion.
const LONG: Duration = Duration::from_secs(60);
const MAX_BODY: usize = 4096;

struct Stack {
    snapshot: Service,
    ingest: Service,
    engine: EmuEngine,
}

impl Stack {
    async fn start() -> Stack {
        let snapshot = Service::start("br-snapshot", &[]);
        snapshot.wait_for("/livez", START).await;
        let ingest = Service::start("br-ingest", &["--snapshot-addr", &snapshot.grpc_url()]);
        ingest.wait_for("/readyz", START).await;
        // time-scale 1: a long completion streams for many seconds, so it holds its place
        // while the test looks; the test ends it by dropping the stream.
        let engine = EmuEngine::start(&["--ranks", "1", "--slots", "64", "--time-scale", "1"]);
        Stack {
            snapshot,
            ingest,
            engine,
        }
    }

    /// A shim for worker `id` with `limits`, in routing.
    async fn shim(&self, id: u32, limits: &[&str]) -> Service {
        let id = id.to_string();
        let upstream = self.engine.rank_url(0);
        let ingest = self.ingest.grpc_url();
        let mut args = vec![
            "--upstream",
            upstream.as_str(),
            "--ingest-addr",
            ingest.as_str(),
            "--group",
            GROUP,
            "--worker-id",
            id.as_str(),
            "--capacity",
            "64",
        ];
        args.extend(limits);
        let shim = Service::start("br-shim", &args);
        shim.wait_for("/readyz", START).await;
        shim
    }

    /// Requests σ holds on worker `id`.
    async fn requests_in_sigma(&self, id: u32) -> usize {
        let sigma = SnapshotClient::connect(self.snapshot.grpc_url())
            .await
            .expect("snapshot reachable")
            .get(GetRequest {
                group: GROUP.into(),
            })
            .await
            .expect("Get")
            .into_inner();
        sigma.requests.iter().filter(|r| r.worker_id == id).count()
    }

    /// Waits until worker `id` has no request in σ.
    async fn wait_empty(&self, id: u32) {
        eventually(LONG, "every request has left σ", || async {
            self.requests_in_sigma(id).await == 0
        })
        .await;
    }
}

fn base(shim: &Service) -> String {
    format!("http://{}", shim.grpc_addr())
}

/// POSTs `body` with `X-Request-Id: id`; the status and body.
async fn post(base: &str, id: &str, body: &Value) -> (u16, Vec<u8>) {
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .header("x-request-id", id)
        .json(body)
        .send()
        .await
        .expect("the shim answers");
    let status = r.status().as_u16();
    (status, r.bytes().await.expect("a body").to_vec())
}

fn error_type(body: &[u8]) -> String {
    let v: Value = serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("a JSON error ({e}): {}", String::from_utf8_lossy(body)));
    v["error"]["type"].as_str().expect("error.type").to_owned()
}

/// `balanceroute_shim_refused_total{reason}` of the shim serving worker `id`.
async fn refused(shim: &Service, id: u32, reason: &str) -> f64 {
    let worker = id.to_string();
    br_testkit::http::metrics(shim.admin_addr()).await.value(
        "balanceroute_shim_refused_total",
        &[("group", GROUP), ("reason", reason), ("worker", &worker)],
    )
}

async fn assert_in_routing(shim: &Service) {
    let r = reqwest::get(shim.admin_url("/readyz")).await.unwrap();
    let status = r.status().as_u16();
    assert_eq!(status, 200, "{}", r.text().await.unwrap_or_default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shim_process_refuses_oversize_bodies_and_one_request_too_many_typed_and_counted() {
    let s = Stack::start().await;
    let max_body = MAX_BODY.to_string();
    let shim = s
        .shim(
            0,
            &[
                "--max-body-bytes",
                &max_body,
                "--max-concurrent-requests",
                "1",
            ],
        )
        .await;
    let base = base(&shim);

    // Declared too long: 413, typed.
    let big = json!({"model": "br-emu", "prompt": "x".repeat(MAX_BODY + 100), "stream": true});
    let (status, body) = post(&base, "big-declared", &big).await;
    assert_eq!(status, 413, "{}", String::from_utf8_lossy(&body));
    assert_eq!(error_type(&body), "body_too_large");
    // Streamed without a length (chunked), too long: 413 as well.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..10).map(|_| Ok(vec![b' '; MAX_BODY / 4])).collect();
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .header("x-request-id", "big-chunked")
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 413);
    assert_eq!(error_type(&r.bytes().await.unwrap()), "body_too_large");
    assert_eq!(refused(&shim, 0, "body_too_large").await, 2.0);

    // One long completion streaming holds the only place ...
    let long = json!({"model": "br-emu", "prompt": "x", "max_tokens": 4000, "stream": true});
    let first = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .header("x-request-id", "holder")
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status().as_u16(), 200);
    let mut first = first.bytes_stream();
    within(LONG, "the first chunk", first.next())
        .await
        .expect("a first chunk")
        .expect("chunk");
    // ... so the next request is 503 `concurrency`, typed, and counted.
    let short = json!({"model": "br-emu", "prompt": "x", "max_tokens": 1});
    let (status, body) = post(&base, "one-too-many", &short).await;
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&body));
    assert_eq!(error_type(&body), "concurrency");
    assert!(refused(&shim, 0, "concurrency").await >= 1.0);
    assert_in_routing(&shim).await;
    // Only the running request reaches σ (after the telemetry's lag); a refused one that
    // leaked would keep the count above 1 and time this out.
    eventually(LONG, "only the running request is in σ", || async {
        s.requests_in_sigma(0).await == 1
    })
    .await;

    // The client goes away: the place is free again and σ forgets the request.
    drop(first);
    eventually(LONG, "the place is free again", || async {
        post(&base, "after", &short).await.0 == 200
    })
    .await;
    s.wait_empty(0).await;
    assert_in_routing(&shim).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shim_process_bounds_the_bodies_it_holds_and_times_out_a_slow_one() {
    let s = Stack::start().await;
    let max_body = MAX_BODY.to_string();
    // Budget 6,000: one stalled 4,000-byte body that has sent 3,000 leaves room for a small
    // body, not for another large one.
    let budget = s
        .shim(
            1,
            &[
                "--max-body-bytes",
                &max_body,
                "--max-buffered-body-bytes",
                "6000",
            ],
        )
        .await;
    let base_budget = base(&budget);
    let large = json!({"model": "br-emu", "prompt": "x".repeat(3950), "max_tokens": 1});
    let small = json!({"model": "br-emu", "prompt": "x", "max_tokens": 1});
    let stalled = tokio::sync::Mutex::new(stalled_post(budget.grpc_addr(), 4000, 3000).await);
    let body = eventually_some(LONG, "a large body over the budget is refused", || async {
        let (status, b) = post(&base_budget, "large", &large).await;
        assert!(
            status == 200 || status == 503,
            "{status}: {}",
            String::from_utf8_lossy(&b)
        );
        if status == 503 {
            return Some(b);
        }
        // The shim read this body before the stalled one's bytes, so the stalled one may be
        // the body it refused: stall again, and the next try finds the budget held.
        let mut held = stalled.lock().await;
        let mut buf = [0u8; 512];
        if matches!(held.try_read(&mut buf), Ok(n) if n > 0) {
            *held = stalled_post(budget.grpc_addr(), 4000, 3000).await;
        }
        None
    })
    .await;
    assert_eq!(error_type(&body), "body_budget");
    assert!(refused(&budget, 1, "body_budget").await >= 1.0);
    let (status, _) = post(&base_budget, "small", &small).await;
    assert_eq!(status, 200, "a small body still fits");
    // The stalled client goes away: its share comes back.
    drop(stalled.into_inner());
    eventually(LONG, "the large body is taken again", || async {
        post(&base_budget, "large-again", &large).await.0 == 200
    })
    .await;
    assert_in_routing(&budget).await;

    // --body-timeout: a body that stops arriving is answered 408, typed, and its share of the
    // budget comes back.
    let slow = s
        .shim(
            2,
            &[
                "--max-body-bytes",
                &max_body,
                "--max-buffered-body-bytes",
                &max_body,
                "--body-timeout",
                "300ms",
            ],
        )
        .await;
    let mut c = stalled_post(slow.grpc_addr(), 4000, 3000).await;
    let mut answer = Vec::new();
    within(LONG, "the shim answers the stalled body", async {
        let mut buf = [0u8; 4096];
        loop {
            let n = c.read(&mut buf).await.unwrap();
            answer.extend_from_slice(&buf[..n]);
            if n == 0 || String::from_utf8_lossy(&answer).contains("body_timeout") {
                break;
            }
        }
    })
    .await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"type\":\"body_timeout\""), "{answer}");
    assert_eq!(refused(&slow, 2, "body_timeout").await, 1.0);
    let (status, _) = post(&base(&slow), "after-timeout", &large).await;
    assert_eq!(status, 200, "the timed-out body's share is free again");
    assert_in_routing(&slow).await;

    for id in [1, 2] {
        s.wait_empty(id).await;
    }
}
