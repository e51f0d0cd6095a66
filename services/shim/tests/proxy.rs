//! br-shim in front of a real upstream (the emulated engine, in-process) with a recording
//! reporter: what the client sees must be byte-identical with and without the shim, and the
//! reports must follow the stream.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;

use br_emu::engine::{EngineConfig, EngineServer, StepModel};
use br_shim::{ProgressSink, RecordingSink, Shim, ShimMetrics};
use br_testkit::{PATIENCE, ReservedPort, eventually};
use futures::StreamExt as _;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

struct Stack {
    engine: EngineServer,
    shim: SocketAddr,
    sink: RecordingSink,
    registry: prometheus::Registry,
    stop: CancellationToken,
}

/// The emulated engine (2 ranks, 10 ms steps scaled by `time_scale`), stopped by `stop`.
async fn engine(time_scale: f64, stop: &CancellationToken) -> EngineServer {
    EngineServer::start(
        EngineConfig {
            ranks: 2,
            slots: 4,
            model: StepModel {
                a_ms_per_token: 0.0,
                b_ms: 10.0,
                c_ms_per_request: 0.0,
                p_ms_per_prefill_token: 0.0,
            },
            time_scale,
            created: Some(1_700_000_000),
            ..EngineConfig::default()
        },
        stop.clone(),
    )
    .await
    .unwrap()
}

async fn stack(time_scale: f64, inject: bool) -> Stack {
    let stop = CancellationToken::new();
    let engine = engine(time_scale, &stop).await;
    let sink = RecordingSink::default();
    let registry = prometheus::Registry::new();
    let metrics = ShimMetrics::new(&registry).unwrap();
    let upstream = format!("http://{}", engine.addrs.ranks[0]);
    let shim = Arc::new(
        Shim::new(
            &upstream,
            inject,
            Arc::new(sink.clone()) as Arc<dyn ProgressSink>,
            metrics,
        )
        .unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let s = stop.clone();
    tokio::spawn(async move {
        axum::serve(listener, br_shim::router(shim))
            .with_graceful_shutdown(s.cancelled_owned())
            .await
            .unwrap();
    });
    Stack {
        engine,
        shim: addr,
        sink,
        registry,
        stop,
    }
}

impl Stack {
    fn direct(&self) -> String {
        format!("http://{}", self.engine.addrs.ranks[0])
    }
    fn proxied(&self) -> String {
        format!("http://{}", self.shim)
    }
    async fn close(self) {
        self.stop.cancel();
        self.engine.shutdown().await;
    }
}

async fn post(base: &str, path: &str, id: &str, body: &Value) -> (u16, Vec<u8>) {
    let resp = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .header("x-request-id", id)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.bytes().await.unwrap().to_vec())
}

/// The same request straight to the engine and through the shim: the bytes must match.
async fn same_bytes(s: &Stack, path: &str, id: &str, body: Value) -> Vec<u8> {
    let (st1, direct) = post(&s.direct(), path, id, &body).await;
    let (st2, proxied) = post(&s.proxied(), path, id, &body).await;
    assert_eq!((st1, st2), (200, 200));
    assert_eq!(
        String::from_utf8_lossy(&direct),
        String::from_utf8_lossy(&proxied),
        "{path} {body}"
    );
    proxied
}

fn last(sink: &RecordingSink, id: &str) -> br_shim::Report {
    sink.for_request(id).last().cloned().expect("reports")
}

#[tokio::test]
async fn streaming_chat_passes_through_unchanged_and_reports_usage() {
    let s = stack(0.0, true).await;
    let body = json!({
        "model": "br-emu",
        "messages": [{"role": "user", "content": "hello there, how are you?"}],
        "max_tokens": 7,
        "stream": true,
    });
    let out = same_bytes(&s, "/v1/chat/completions", "chat-1", body).await;
    let text = String::from_utf8(out).unwrap();
    assert!(
        !text.contains("usage"),
        "the client asked for no usage: {text}"
    );
    assert!(text.ends_with("data: [DONE]\n\n"));
    let r = last(&s.sink, "chat-1");
    assert_eq!((r.generated, r.finished), (7, true));
    assert!(
        r.prompt_tokens > 0,
        "prompt tokens come from the injected usage"
    );
    // Cumulative and monotone, one report as the request starts.
    let reports = s.sink.for_request("chat-1");
    assert_eq!(reports[0].generated, 0);
    assert!(reports.windows(2).all(|w| w[0].generated <= w[1].generated));
    s.close().await;
}

#[tokio::test]
async fn usage_is_stripped_to_what_the_client_asked_for() {
    let s = stack(0.0, true).await;
    // include_usage only: per-chunk usage (injected) is removed, the final usage chunk stays.
    let body = json!({
        "model": "br-emu", "prompt": [1, 2, 3, 4, 5], "max_tokens": 5, "stream": true,
        "stream_options": {"include_usage": true},
    });
    let out = same_bytes(&s, "/v1/completions", "cmp-1", body).await;
    let text = String::from_utf8(out).unwrap();
    assert_eq!(text.matches("\"usage\"").count(), 1, "{text}");
    assert!(text.contains(
        r#""choices":[],"usage":{"prompt_tokens":5,"total_tokens":10,"completion_tokens":5}"#
    ));
    // Both flags: the shim changes nothing.
    let body = json!({
        "model": "br-emu", "prompt": "abcdefgh", "max_tokens": 3, "stream": true,
        "stream_options": {"include_usage": true, "continuous_usage_stats": true},
    });
    let out = same_bytes(&s, "/v1/completions", "cmp-2", body).await;
    assert_eq!(
        String::from_utf8(out).unwrap().matches("\"usage\"").count(),
        4
    );
    let r = last(&s.sink, "cmp-1");
    assert_eq!((r.prompt_tokens, r.generated, r.finished), (5, 5, true));
    let r = last(&s.sink, "cmp-2");
    assert_eq!((r.prompt_tokens, r.generated, r.finished), (2, 3, true));
    s.close().await;
}

#[tokio::test]
async fn non_streaming_and_other_paths_pass_through() {
    let s = stack(0.0, true).await;
    let body = json!({
        "model": "br-emu",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    });
    same_bytes(&s, "/v1/chat/completions", "full-1", body).await;
    let r = last(&s.sink, "full-1");
    assert_eq!((r.generated, r.finished), (4, true));

    let direct = reqwest::get(format!("{}/v1/models", s.direct()))
        .await
        .unwrap();
    let proxied = reqwest::get(format!("{}/v1/models", s.proxied()))
        .await
        .unwrap();
    assert_eq!(direct.status(), proxied.status());
    assert_eq!(
        direct.bytes().await.unwrap(),
        proxied.bytes().await.unwrap()
    );
    let health = reqwest::get(format!("{}/health", s.proxied()))
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    // An engine error passes through as it is, and ends the request.
    let (st1, e1) = post(
        &s.direct(),
        "/v1/completions",
        "bad-1",
        &json!({"model": "nope", "prompt": "x"}),
    )
    .await;
    let (st2, e2) = post(
        &s.proxied(),
        "/v1/completions",
        "bad-1",
        &json!({"model": "nope", "prompt": "x"}),
    )
    .await;
    assert_eq!((st1, e1), (st2, e2));
    assert!(last(&s.sink, "bad-1").finished);
    s.close().await;
}

#[tokio::test]
async fn without_usage_the_shim_counts_chunks() {
    let s = stack(0.0, false).await;
    let body = json!({"model": "br-emu", "prompt": "x", "max_tokens": 6, "stream": true});
    same_bytes(&s, "/v1/completions", "count-1", body).await;
    let r = last(&s.sink, "count-1");
    assert_eq!((r.prompt_tokens, r.generated, r.finished), (0, 6, true));
    s.close().await;
}

#[tokio::test]
async fn response_id_is_used_without_x_request_id() {
    let s = stack(0.0, true).await;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.proxied()))
        .json(&json!({"model": "br-emu", "prompt": "x", "max_tokens": 2, "stream": true}))
        .send()
        .await
        .unwrap();
    let text = resp.text().await.unwrap();
    let first: Value =
        serde_json::from_str(text.lines().next().unwrap().strip_prefix("data: ").unwrap()).unwrap();
    let id = first["id"].as_str().unwrap();
    let r = last(&s.sink, id);
    assert_eq!((r.generated, r.finished), (2, true));
    s.close().await;
}

#[tokio::test]
async fn client_disconnect_finishes_the_request() {
    // Slow steps (10 ms) so the request is still running when the client leaves.
    let s = stack(1.0, true).await;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.proxied()))
        .header("x-request-id", "gone-1")
        .json(&json!({
            "model": "br-emu", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 100000, "stream": true,
        }))
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let mut seen = 0;
    while seen < 3 {
        let chunk = body.next().await.unwrap().unwrap();
        seen += String::from_utf8_lossy(&chunk).matches("data: ").count();
    }
    drop(body);
    eventually(PATIENCE, "a client disconnect ends the request", || async {
        s.sink.for_request("gone-1").iter().any(|r| r.finished)
    })
    .await;
    let r = last(&s.sink, "gone-1");
    assert!(r.generated < 100000);
    s.close().await;
}

#[tokio::test]
async fn upstream_down_is_a_502_and_ends_the_request() {
    let sink = RecordingSink::default();
    let registry = prometheus::Registry::new();
    let metrics = ShimMetrics::new(&registry).unwrap();
    // A port that refuses connections (bound, never listening: nothing else can take it).
    let down = ReservedPort::new();
    let dead = down.addr();
    let shim = Arc::new(
        Shim::new(
            &format!("http://{dead}"),
            true,
            Arc::new(sink.clone()),
            metrics,
        )
        .unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move { axum::serve(listener, br_shim::router(shim)).await });
    let (status, _) = post(
        &format!("http://{addr}"),
        "/v1/completions",
        "down-1",
        &json!({"prompt": "x", "stream": true}),
    )
    .await;
    assert_eq!(status, 502);
    assert!(last(&sink, "down-1").finished);
    task.abort();
}

#[tokio::test]
async fn exports_the_proxy_metrics_with_their_values() {
    let s = stack(0.0, true).await;
    let body = json!({"model": "br-emu", "prompt": "x", "max_tokens": 3, "stream": true});
    post(&s.proxied(), "/v1/completions", "m-1", &body).await;
    // Scraped over HTTP from the admin server the binary runs.
    let admin = br_runtime::admin::AdminServer::start(
        "127.0.0.1:0".parse().unwrap(),
        s.registry.clone(),
        br_runtime::admin::Readiness::new(true),
        s.stop.clone(),
    )
    .await
    .unwrap();
    let m = br_testkit::http::metrics(admin.local_addr()).await;
    // The whole contract (with the accept counter the service skeleton registers) is checked
    // on the started shim below; here the proxy's own metrics and values.
    assert_eq!(m.value("balanceroute_shim_tokens_total", &[]), 3.0);
    assert_eq!(m.value("balanceroute_shim_active_requests", &[]), 0.0);
    s.close().await;
}

/// An engine that refuses `stream_options` (as older OpenAI-compatible servers do).
async fn strict_engine() -> SocketAddr {
    use axum::body::Bytes;
    use axum::http::StatusCode;
    use axum::response::IntoResponse;
    async fn complete(body: Bytes) -> axum::response::Response {
        let v: Value = serde_json::from_slice(&body).unwrap();
        if v.get("stream_options").is_some() {
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(json!({"error": "unknown field stream_options"})),
            )
                .into_response();
        }
        let sse = "data: {\"id\":\"s1\",\"choices\":[{\"text\":\"a\"}]}\n\n\
                   data: {\"id\":\"s1\",\"choices\":[{\"text\":\"b\"}]}\n\n\
                   data: {\"id\":\"s1\",\"choices\":[{\"text\":\"c\"}]}\n\ndata: [DONE]\n\n";
        ([("content-type", "text/event-stream")], sse).into_response()
    }
    let app = axum::Router::new().route("/v1/completions", axum::routing::post(complete));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

#[tokio::test]
async fn an_engine_without_stream_options_gets_the_clients_request_and_chunks_are_counted() {
    let upstream = strict_engine().await;
    let sink = RecordingSink::default();
    let registry = prometheus::Registry::new();
    let shim = Arc::new(
        Shim::new(
            &format!("http://{upstream}"),
            true,
            Arc::new(sink.clone()),
            ShimMetrics::new(&registry).unwrap(),
        )
        .unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, br_shim::router(shim)).await });
    let body = json!({"prompt": "x", "max_tokens": 3, "stream": true});
    for id in ["strict-1", "strict-2"] {
        let (s1, direct) = post(&format!("http://{upstream}"), "/v1/completions", id, &body).await;
        let (s2, proxied) = post(&format!("http://{addr}"), "/v1/completions", id, &body).await;
        assert_eq!((s1, s2), (200, 200));
        assert_eq!(direct, proxied);
        let r = last(&sink, id);
        assert_eq!((r.prompt_tokens, r.generated, r.finished), (0, 3, true));
    }
}

#[tokio::test]
async fn forwards_while_ingest_is_away() {
    // The real reporter, pointed at a port where no ingest listens: it keeps the state and
    // retries in the background; the client's traffic is not affected.
    let down = ReservedPort::new();
    let dead = down.addr();
    let reporter = br_client::reporter::Reporter::spawn(br_client::reporter::ReporterConfig::new(
        format!("http://{dead}"),
        "g",
        0,
        4,
    ))
    .unwrap();
    let stop = CancellationToken::new();
    let engine = EngineServer::start(
        EngineConfig {
            ranks: 1,
            time_scale: 0.0,
            created: Some(1),
            ..EngineConfig::default()
        },
        stop.clone(),
    )
    .await
    .unwrap();
    let registry = prometheus::Registry::new();
    let sink = br_shim::ReporterSink(reporter.clone());
    assert!(!sink.connected());
    let shim = Arc::new(
        Shim::new(
            &format!("http://{}", engine.addrs.ranks[0]),
            true,
            Arc::new(sink),
            ShimMetrics::new(&registry).unwrap(),
        )
        .unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, br_shim::router(shim)).await });
    for i in 0..3 {
        let body = json!({"model": "br-emu", "prompt": "x", "max_tokens": 8, "stream": true});
        let id = format!("away-{i}");
        let (s1, direct) = post(
            &format!("http://{}", engine.addrs.ranks[0]),
            "/v1/completions",
            &id,
            &body,
        )
        .await;
        let (s2, proxied) = post(&format!("http://{addr}"), "/v1/completions", &id, &body).await;
        assert_eq!((s1, s2), (200, 200));
        assert_eq!(direct, proxied);
    }
    assert!(
        reporter.stats().pending > 0,
        "the reporter keeps the state for later"
    );
    reporter.shutdown().await;
    stop.cancel();
    engine.shutdown().await;
}

#[tokio::test]
async fn an_engine_that_dies_mid_stream_finishes_the_request() {
    let s = stack(1.0, true).await;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.proxied()))
        .header("x-request-id", "dies-1")
        .json(&json!({"model": "br-emu", "prompt": "x", "max_tokens": 100000, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let mut text = String::new();
    while text.matches("data: ").count() < 2 {
        text.push_str(&String::from_utf8_lossy(
            &body.next().await.unwrap().unwrap(),
        ));
    }
    // The engine stops: its stream ends without [DONE].
    s.stop.cancel();
    while let Some(Ok(chunk)) = body.next().await {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(!text.contains("[DONE]"));
    let r = last(&s.sink, "dies-1");
    assert!(
        r.finished && r.generated >= 2 && r.generated < 100000,
        "{r:?}"
    );
    s.engine.shutdown().await;
}

/// br-shim as its binary runs it (`br_shim::start`), against the emulated engine and the real
/// br-ingest and br-snapshot, all in-process on port 0.
mod wiring {
    use super::*;
    use br_proto::v1;
    use br_runtime::serve::ServeOutcome;
    use br_runtime::skeleton::StartError;
    use std::time::Duration;

    const WAIT: Duration = Duration::from_secs(20);

    fn shim_args(upstream: &str, ingest: &str, extra: &[&str]) -> br_shim::Args {
        let mut argv = vec![
            "br-shim",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--upstream",
            upstream,
            "--ingest-addr",
            ingest,
            "--group",
            "wired",
            "--worker-id",
            "3",
            "--capacity",
            "4",
            "--shutdown-grace",
            "5s",
        ];
        argv.extend_from_slice(extra);
        br_runtime::config::parse_from(argv).unwrap()
    }

    async fn sigma(snapshot: SocketAddr) -> Option<v1::ClusterSnapshot> {
        let mut c = v1::snapshot_client::SnapshotClient::connect(format!("http://{snapshot}"))
            .await
            .ok()?;
        c.get(v1::GetRequest {
            group: "wired".into(),
        })
        .await
        .ok()
        .map(|r| r.into_inner())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn started_shim_proxies_reports_to_ingest_and_shuts_down_cleanly() {
        let stop = CancellationToken::new();
        let snapshot_args: br_snapshot::Args = br_runtime::config::parse_from([
            "br-snapshot",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--shutdown-grace",
            "2s",
        ])
        .unwrap();
        let snapshot = br_snapshot::start(&snapshot_args, stop.clone())
            .await
            .unwrap();
        let snapshot_url = format!("http://{}", snapshot.grpc_addr());
        let ingest_args: br_ingest::Args = br_runtime::config::parse_from([
            "br-ingest",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--snapshot-addr",
            &snapshot_url,
            "--shutdown-grace",
            "2s",
        ])
        .unwrap();
        let ingest = br_ingest::start(&ingest_args, stop.clone()).await.unwrap();
        // Slow steps (10 ms) so a long request is still running while σ is read.
        let engine = engine(1.0, &stop).await;
        let upstream = format!("http://{}", engine.addrs.ranks[0]);

        let shim_stop = CancellationToken::new();
        let args = shim_args(&upstream, &format!("http://{}", ingest.grpc_addr()), &[]);
        let shim = br_shim::start(&args, shim_stop.clone()).await.unwrap();
        let proxy = format!("http://{}", shim.http_addr());
        assert_ne!(shim.http_addr().port(), 0);
        // Ready once its engine has answered a probe (the first is sent at start).
        eventually(PATIENCE, "the shim ready", || async { shim.is_ready() }).await;
        assert!(shim.is_ready());
        let readyz = reqwest::get(format!("http://{}/readyz", shim.admin_addr()))
            .await
            .unwrap();
        assert_eq!(readyz.status(), 200);
        // Every name under `# shim`, as the binary exports them (its own and the skeleton's).
        let m = br_testkit::http::metrics(shim.admin_addr()).await;
        let names = m.assert_contract("shim");
        assert_eq!(names.len(), 12, "{names:?}");

        // It proxies: the same bytes with and without it.
        let body = json!({"model": "br-emu", "prompt": "x", "max_tokens": 3, "stream": true});
        let (s1, direct) = post(&upstream, "/v1/completions", "w-short", &body).await;
        let (s2, proxied) = post(&proxy, "/v1/completions", "w-short", &body).await;
        assert_eq!((s1, s2), (200, 200));
        assert_eq!(direct, proxied);

        // It reports to ingest: the worker announced itself with this shim as its endpoint,
        // and a request in flight through it is in σ with its tokens.
        let resp = reqwest::Client::new()
            .post(format!("{proxy}/v1/completions"))
            .header("x-request-id", "w-long")
            .json(&json!({"model": "br-emu", "prompt": "x", "max_tokens": 100000, "stream": true}))
            .send()
            .await
            .unwrap();
        let mut stream = resp.bytes_stream();
        let first = stream.next().await.unwrap().unwrap();
        assert!(String::from_utf8_lossy(&first).contains("data: "));
        let saddr = snapshot.grpc_addr();
        eventually(WAIT, "the shim's worker and its request in σ", || async {
            let Some(s) = sigma(saddr).await else {
                return false;
            };
            let worker = s.workers.iter().any(|w| {
                w.worker_id == 3
                    && w.capacity == 4
                    && w.endpoint == proxy
                    && w.liveness == v1::Liveness::Live as i32
            });
            let request = s
                .requests
                .iter()
                .any(|r| r.request_id == "w-long" && r.worker_id == 3 && r.generated_tokens > 0);
            worker && request
        })
        .await;
        // The client leaves: the request is finished and leaves σ.
        drop(stream);
        eventually(WAIT, "the finished request leaves σ", || async {
            sigma(saddr)
                .await
                .is_some_and(|s| s.requests.iter().all(|r| r.request_id != "w-long"))
        })
        .await;

        // Shutdown: a clean drain, and the proxy port is closed.
        let http_addr = shim.http_addr();
        shim_stop.cancel();
        let outcome = tokio::time::timeout(WAIT, shim.wait())
            .await
            .expect("the shim stops within the wait")
            .unwrap();
        assert_eq!(outcome, ServeOutcome::Drained);
        assert!(tokio::net::TcpStream::connect(http_addr).await.is_err());

        stop.cancel();
        engine.shutdown().await;
        tokio::time::timeout(WAIT, ingest.wait())
            .await
            .unwrap()
            .unwrap();
        tokio::time::timeout(WAIT, snapshot.wait())
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn a_worker_id_above_the_contract_limit_is_refused_at_start() {
        let mut args = shim_args("http://127.0.0.1:1", "", &[]);
        args.worker_id = br_proto::valid::limits::MAX_WORKER_ID + 1;
        let err = br_shim::start(&args, CancellationToken::new())
            .await
            .unwrap_err();
        let StartError::Config(msg) = &err else {
            panic!("expected a config error, got {err}");
        };
        assert!(msg.contains("--worker-id 1024"), "{msg}");
        assert!(msg.contains("1023"), "names the limit: {msg}");
        // The limit itself is a valid id.
        args.worker_id = br_proto::valid::limits::MAX_WORKER_ID;
        let running = br_shim::start(&args, CancellationToken::new())
            .await
            .unwrap();
        tokio::time::timeout(WAIT, running.stop())
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn a_taken_port_is_a_bind_error_naming_the_flag() {
        let taken = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        let mut args = shim_args("http://127.0.0.1:1", "", &[]);
        args.common.admin_listen = addr.parse().unwrap();
        let err = br_shim::start(&args, CancellationToken::new())
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                StartError::Bind {
                    flag: "--admin-listen",
                    ..
                }
            ),
            "{err}"
        );
    }
}

/// A shim in front of `engine`'s first rank with the limits `limit` sets, served on a free
/// port; its metrics go to `registry`.
async fn serve_limited(
    engine: &EngineServer,
    registry: &prometheus::Registry,
    limit: impl FnOnce(Shim) -> Shim,
) -> SocketAddr {
    let shim = Shim::new(
        &format!("http://{}", engine.addrs.ranks[0]),
        true,
        Arc::new(RecordingSink::default()) as Arc<dyn ProgressSink>,
        ShimMetrics::new(registry).unwrap(),
    )
    .unwrap();
    let shim = limit(shim);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, br_shim::router(Arc::new(shim))).await });
    addr
}

/// A shim with `--max-body-bytes 4096 --max-concurrent-requests 1` in front of a slow engine.
async fn limited_shim(engine: &EngineServer, registry: &prometheus::Registry) -> SocketAddr {
    serve_limited(engine, registry, |s| s.with_limits(4096, 1)).await
}

/// What `registry` holds now, parsed.
fn gathered(registry: &prometheus::Registry) -> br_testkit::prom::Metrics {
    br_testkit::prom::Metrics::parse(
        &prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .unwrap(),
    )
    .unwrap()
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_and_one_request_too_many_is_503_both_typed() {
    let stop = CancellationToken::new();
    let engine = engine(1.0, &stop).await;
    let registry = prometheus::Registry::new();
    let base = format!("http://{}", limited_shim(&engine, &registry).await);
    let client = reqwest::Client::new();
    let error_type = |b: &[u8]| {
        let v: Value = serde_json::from_slice(b).unwrap();
        v["error"]["type"].as_str().unwrap().to_owned()
    };
    // Declared too long, and streamed (chunked, no length) too long: 413, JSON, typed.
    let big = json!({"prompt": "x".repeat(5000), "stream": true});
    let (status, body) = post(&base, "/v1/completions", "big-1", &big).await;
    assert_eq!(status, 413);
    assert_eq!(error_type(&body), "body_too_large");
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..10).map(|_| Ok(vec![b' '; 1000])).collect();
    let resp = client
        .post(format!("{base}/v1/chat/completions"))
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 413);
    assert_eq!(error_type(&resp.bytes().await.unwrap()), "body_too_large");

    // One request streaming (its first chunk read: it holds the only place) ...
    let slow = json!({"model": "br-emu", "prompt": "x", "max_tokens": 40, "stream": true});
    let first = client
        .post(format!("{base}/v1/completions"))
        .json(&slow)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status().as_u16(), 200);
    let mut first = first.bytes_stream();
    first.next().await.unwrap().unwrap();
    // ... so the next is 503, typed; other paths too.
    let (status, body) = post(&base, "/v1/completions", "c-2", &slow).await;
    assert_eq!(status, 503);
    assert_eq!(error_type(&body), "concurrency");
    let other = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(other.status().as_u16(), 503);
    // Once the first ends its place is free again.
    while let Some(chunk) = first.next().await {
        chunk.unwrap();
    }
    let (status, _) = post(
        &base,
        "/v1/completions",
        "c-3",
        &json!({"prompt": "x", "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200);

    let m = gathered(&registry);
    assert_eq!(
        m.value(
            "balanceroute_shim_refused_total",
            &[("reason", "body_too_large")]
        ),
        2.0
    );
    assert_eq!(
        m.value(
            "balanceroute_shim_refused_total",
            &[("reason", "concurrency")]
        ),
        2.0
    );
    stop.cancel();
    engine.shutdown().await;
}

/// Bodies are held while inspected, and all of them together are bounded: with
/// `--max-buffered-body-bytes 6000` and a 4,000-byte body being read (its client stalls after
/// 3,000), another 4,000-byte body is refused 503 `body_budget`, a small one still goes
/// through, and once the first is gone the large one is taken again. A client that declares
/// 4,000 and sends 100 holds only those 100.
#[tokio::test]
async fn bodies_held_at_once_are_bounded_by_the_budget_and_refused_typed() {
    use tokio::io::AsyncWriteExt as _;
    let stop = CancellationToken::new();
    let engine = engine(1.0, &stop).await;
    let registry = prometheus::Registry::new();
    let addr = serve_limited(&engine, &registry, |s| {
        s.with_limits(4096, 8)
            .with_body_budget(6000, std::time::Duration::from_secs(60))
    })
    .await;
    let base = format!("http://{addr}");
    // about 4,000 bytes of JSON
    let large = json!({"model": "br-emu", "prompt": "x".repeat(3950), "max_tokens": 1});
    let small = json!({"model": "br-emu", "prompt": "x", "max_tokens": 1});
    let refused = |m: &br_testkit::prom::Metrics| {
        m.value(
            "balanceroute_shim_refused_total",
            &[("reason", "body_budget")],
        )
    };

    // A client that declares 4,000 bytes and sends 100 holds 100: the large body fits.
    let mut lying = stall(addr, 100).await;
    let (status, _) = post(&base, "/v1/completions", "large-0", &large).await;
    assert_eq!(
        status, 200,
        "the 100 bytes sent are held, not the 4,000 declared"
    );
    lying.shutdown().await.unwrap();
    // One that has sent 3,000 holds 3,000.
    let stalled = tokio::sync::Mutex::new(stall(addr, 3000).await);
    // Once the shim holds it, another large body does not fit.
    let body = eventually_some_refusal(&base, &large, addr, &stalled).await;
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["type"], "body_budget", "{v}");
    assert!(refused(&gathered(&registry)) >= 1.0);
    let (status, _) = post(&base, "/v1/completions", "small", &small).await;
    assert_eq!(status, 200, "a small body still fits");

    // The stalled client goes away: its share comes back.
    drop(stalled.into_inner());
    eventually(PATIENCE, "the large body is taken again", || async {
        post(&base, "/v1/completions", "large-again", &large)
            .await
            .0
            == 200
    })
    .await;
    stop.cancel();
    engine.shutdown().await;
}

/// A client that declares a 4,000-byte completion body, sends `sent` bytes of it and stalls.
async fn stall(addr: SocketAddr, sent: usize) -> tokio::net::TcpStream {
    br_testkit::http::stalled_post(addr, 4000, sent).await
}

/// A body that does not arrive within `--body-timeout` is answered 408, typed, and its share
/// of the budget comes back.
#[tokio::test]
async fn a_body_slower_than_the_timeout_is_408_typed() {
    use tokio::io::AsyncReadExt as _;
    let stop = CancellationToken::new();
    let engine = engine(1.0, &stop).await;
    let registry = prometheus::Registry::new();
    let addr = serve_limited(&engine, &registry, |s| {
        s.with_limits(4096, 8)
            .with_body_budget(4096, std::time::Duration::from_millis(300))
    })
    .await;
    let mut c = stall(addr, 3000).await;
    let mut answer = Vec::new();
    br_testkit::within(PATIENCE, "the shim answers the stalled body", async {
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
    // its 3,000 bytes are free again: a full-size body fits
    let large = json!({"model": "br-emu", "prompt": "x".repeat(3950), "max_tokens": 1});
    let (status, _) = post(
        &format!("http://{addr}"),
        "/v1/completions",
        "after",
        &large,
    )
    .await;
    assert_eq!(status, 200);
    stop.cancel();
    engine.shutdown().await;
}

/// Posts `body` until the shim answers 503; that answer's body. A 200 means the shim read this
/// body before the stalled one's bytes, and may have refused the stalled one for it: then the
/// client stalls again, so the next try finds the budget held.
async fn eventually_some_refusal(
    base: &str,
    body: &Value,
    addr: SocketAddr,
    stalled: &tokio::sync::Mutex<tokio::net::TcpStream>,
) -> Vec<u8> {
    br_testkit::eventually_some(PATIENCE, "a body over the budget is refused", || async {
        let (status, b) = post(base, "/v1/completions", "large", body).await;
        assert!(
            status == 200 || status == 503,
            "{status}: {}",
            String::from_utf8_lossy(&b)
        );
        if status == 503 {
            return Some(b);
        }
        let mut held = stalled.lock().await;
        let mut buf = [0u8; 512];
        if matches!(held.try_read(&mut buf), Ok(n) if n > 0) {
            *held = stall(addr, 3000).await;
        }
        None
    })
    .await
}
