//! Engine topologies, each against br-emu emulating it: one server for every DP
//! rank that honours vLLM's `X-data-parallel-rank` header or SGLang's `routed_dp_rank` body
//! field, with one shim per rank or one shim for several ranks. The engine counts the requests
//! each rank ran (`/stats`), so every test proves where its requests ran; the fake ingest shows
//! what each rank announced.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use br_emu::engine::{EngineConfig, EngineServer, StepModel};
use br_proto::v1::worker_report::Kind;
use br_testkit::{FakeIngest, PATIENCE, eventually};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const RANKS: usize = 4;

async fn engine(stop: &CancellationToken) -> EngineServer {
    EngineServer::start(
        EngineConfig {
            ranks: RANKS,
            slots: 8,
            model: StepModel {
                a_ms_per_token: 0.0,
                b_ms: 1.0,
                c_ms_per_request: 0.0,
                p_ms_per_prefill_token: 0.0,
            },
            time_scale: 1.0,
            ..EngineConfig::default()
        },
        stop.clone(),
    )
    .await
    .unwrap()
}

/// The requests each rank of the engine ran.
async fn per_rank(engine: &EngineServer) -> Vec<u64> {
    let v: Value = reqwest::get(format!("http://{}/stats", engine.addrs.dp))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    serde_json::from_value(v["requests_per_rank"].clone()).unwrap()
}

struct Stack {
    engine: EngineServer,
    /// Requests each rank had run once the shim was ready: the shim's rank check (one
    /// unpinned and one pinned request per rank) runs before its first Hello.
    baseline: Vec<u64>,
    shim: br_shim::Running,
    ingest: FakeIngest,
    _served: br_testkit::Served,
    stop: CancellationToken,
}

/// br-emu's port serving every rank, and a shim in front of it with `flags`, once ready.
async fn stack(flags: &[&str]) -> Stack {
    let mut s = started(flags).await;
    let shim = &s.shim;
    eventually(PATIENCE, "the shim ready", || async { shim.is_ready() }).await;
    s.baseline = per_rank(&s.engine).await;
    s
}

/// The same, just started: the shim may still be checking its ranks, or have refused them.
async fn started(flags: &[&str]) -> Stack {
    let stop = CancellationToken::new();
    let engine = engine(&stop).await;
    let ingest = FakeIngest::default();
    let served = ingest.start().await;
    let upstream = format!("http://{}", engine.addrs.dp);
    let ingest_url = format!("http://{}", served.addr);
    let mut argv = vec![
        "br-shim",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--upstream",
        &upstream,
        "--ingest-addr",
        &ingest_url,
        "--group",
        "topo",
        "--shutdown-grace",
        "1s",
    ];
    argv.extend_from_slice(flags);
    let args: br_shim::Args = br_runtime::config::parse_from(argv).unwrap();
    let shim = br_shim::start(&args, stop.clone()).await.unwrap();
    Stack {
        baseline: Vec::new(),
        engine,
        shim,
        ingest,
        _served: served,
        stop,
    }
}

impl Stack {
    /// Requests each rank ran since the shim was ready.
    async fn ran(&self) -> Vec<u64> {
        let now = per_rank(&self.engine).await;
        now.iter().zip(&self.baseline).map(|(n, b)| n - b).collect()
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.shim.http_addr())
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = reqwest::Client::new()
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// (worker_id, endpoint) of every Hello the fake ingest received.
    fn hellos(&self) -> Vec<(u32, String)> {
        self.ingest
            .messages()
            .into_iter()
            .filter_map(|m| match m.kind {
                Some(Kind::Hello(h)) => Some((h.worker_id, h.endpoint)),
                _ => None,
            })
            .collect()
    }

    async fn requests_total(&self, worker: &str) -> f64 {
        br_testkit::http::metrics(self.shim.admin_addr())
            .await
            .value(
                "balanceroute_shim_requests_total",
                &[("group", "topo"), ("worker", worker)],
            )
    }

    async fn close(self) {
        self.stop.cancel();
        self.shim.wait().await.unwrap();
        self.engine.shutdown().await;
    }
}

fn completion() -> Value {
    json!({"model": "br-emu", "prompt": "x", "max_tokens": 2, "stream": true})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_one_api_server_for_all_ranks_the_shim_sets_the_rank_header() {
    let s = stack(&[
        "--worker-id",
        "2",
        "--dp-rank-header",
        "X-data-parallel-rank",
    ])
    .await;
    assert_eq!(s.post("/v1/completions", completion()).await.0, 200);
    // A client's own header is replaced: the shim's telemetry says the request runs on 2.
    let r = reqwest::Client::new()
        .post(s.url("/v1/chat/completions"))
        .header("x-data-parallel-rank", "0")
        .json(
            &json!({"model": "br-emu", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(s.ran().await, vec![0, 0, 2, 0]);
    assert_eq!(s.hellos()[0].0, 2);
    s.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_the_shim_sets_routed_dp_rank_in_the_body() {
    let s = stack(&["--worker-id", "3", "--dp-rank-field", "routed_dp_rank"]).await;
    assert_eq!(s.post("/v1/completions", completion()).await.0, 200);
    // the client's own field is replaced
    let mut body = completion();
    body["routed_dp_rank"] = json!(1);
    body["stream"] = json!(false);
    let (status, answer) = s.post("/v1/completions", body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(s.ran().await, vec![0, 0, 0, 2]);
    s.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shim_serves_several_ranks_each_with_its_stream_and_its_endpoint() {
    let s = stack(&[
        "--worker-ids",
        "0-3",
        "--dp-rank-header",
        "X-data-parallel-rank",
    ])
    .await;
    s.ingest
        .wait_for("a Hello per rank", |_| s.hellos().len() == RANKS)
        .await;
    let mut hellos = s.hellos();
    hellos.sort();
    let base = format!("http://{}", s.shim.http_addr());
    let want: Vec<(u32, String)> = (0..RANKS as u32)
        .map(|n| (n, format!("{base}/rank/{n}")))
        .collect();
    assert_eq!(
        hellos, want,
        "one stream per rank, each announcing its own base URL"
    );

    // The endpoint a rank announced is a base URL: the request runs on that rank.
    for (rank, path, n) in [(1, "/v1/completions", 2), (3, "/v1/chat/completions", 1)] {
        for _ in 0..n {
            let body = if path.contains("chat") {
                json!({"model": "br-emu", "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 2, "stream": true})
            } else {
                completion()
            };
            let (status, answer) = s.post(&format!("/rank/{rank}{path}"), body).await;
            assert_eq!(status, 200, "{answer}");
        }
    }
    assert_eq!(s.ran().await, vec![0, 2, 0, 1]);
    // and its telemetry is the rank's
    assert_eq!(s.requests_total("1").await, 2.0);
    assert_eq!(s.requests_total("3").await, 1.0);
    assert_eq!(s.requests_total("0").await, 0.0);

    // A generation without a rank, or for a rank not served, is refused (its load would
    // belong to no worker); other paths reach the engine.
    let (status, answer) = s.post("/v1/completions", completion()).await;
    assert_eq!(status, 404);
    assert!(
        answer["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("/rank/<n>/v1/completions")),
        "{answer}"
    );
    assert_eq!(s.post("/rank/9/v1/completions", completion()).await.0, 404);
    assert_eq!(s.post("/rank/x/v1/completions", completion()).await.0, 404);
    let models = reqwest::get(s.url("/v1/models")).await.unwrap();
    assert_eq!(models.status(), 200);
    let models = reqwest::get(s.url("/rank/2/v1/models")).await.unwrap();
    assert_eq!(models.status(), 200);
    assert_eq!(s.ran().await, vec![0, 2, 0, 1], "nothing more ran");
    let m = br_testkit::http::metrics(s.shim.admin_addr()).await;
    assert_eq!(
        m.value(
            "balanceroute_shim_refused_total",
            &[("group", "topo"), ("worker", "0"), ("reason", "no_rank")]
        ),
        3.0
    );
    // the process's own series carry the list it serves
    assert_eq!(
        m.value(
            "balanceroute_shim_engine_up",
            &[("group", "topo"), ("worker", "0-3")]
        ),
        1.0
    );
    s.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shim_for_several_sglang_ranks_pins_by_the_body_field() {
    let s = stack(&["--worker-ids", "1,2", "--dp-rank-field", "routed_dp_rank"]).await;
    for rank in [2, 2, 1] {
        let (status, answer) = s
            .post(&format!("/rank/{rank}/v1/completions"), completion())
            .await;
        assert_eq!(status, 200, "{answer}");
    }
    assert_eq!(s.ran().await, vec![0, 1, 2, 0]);
    s.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_the_server_does_not_have_ends_the_shim_before_any_hello() {
    let last = RANKS.to_string();
    let ids = format!("2-{last}");
    let s = started(&[
        "--worker-ids",
        &ids,
        "--dp-rank-header",
        "X-data-parallel-rank",
    ])
    .await;
    let err = tokio::time::timeout(PATIENCE, s.shim.wait())
        .await
        .expect("the shim went on serving a rank the engine refuses")
        .expect_err("the shim stopped cleanly");
    let msg = err.to_string();
    assert!(
        matches!(err, br_runtime::skeleton::ServeError::Config(_)),
        "{msg}"
    );
    assert!(
        msg.contains(&format!("rank {last}")) && msg.contains("must be a rank in"),
        "{msg}"
    );
    assert!(
        s.ingest
            .messages()
            .iter()
            .all(|m| !matches!(m.kind, Some(Kind::Hello(_)))),
        "a rank said Hello before the check"
    );
    s.stop.cancel();
    s.engine.shutdown().await;
}
