//! The started shim judging its engine: a run of 5xx takes the worker out of routing (its
//! telemetry stream ends, `/readyz` fails saying why) and it comes back by itself; an engine
//! whose health endpoint fails does the same. The engine here is a scripted HTTP server (what
//! it answers is set by the test); the real engine killed and frozen is in tests/shim_health.rs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use axum::http::StatusCode;
use br_testkit::{FakeIngest, PATIENCE, eventually};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// What the scripted engine answers: `/health` and the generation paths, by status.
#[derive(Clone)]
struct Script {
    health: Arc<AtomicU16>,
    generate: Arc<AtomicU16>,
}

async fn scripted_engine(stop: &CancellationToken) -> (SocketAddr, Script) {
    let script = Script {
        health: Arc::new(AtomicU16::new(200)),
        generate: Arc::new(AtomicU16::new(200)),
    };
    let (h, g) = (script.health.clone(), script.generate.clone());
    let app = axum::Router::new()
        .route(
            "/health",
            axum::routing::get(move || {
                let h = h.clone();
                async move { StatusCode::from_u16(h.load(Ordering::SeqCst)).unwrap() }
            }),
        )
        .route(
            "/v1/completions",
            axum::routing::post(move || {
                let g = g.clone();
                async move {
                    let status = StatusCode::from_u16(g.load(Ordering::SeqCst)).unwrap();
                    let body = json!({"id": "cmpl-1", "choices": [{"text": "x"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}});
                    (status, axum::Json(body))
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let s = stop.clone();
    tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(s.cancelled_owned())
            .await
            .unwrap();
    });
    (addr, script)
}

async fn readyz(shim: &br_shim::Running) -> (u16, String) {
    let r = reqwest::get(format!("http://{}/readyz", shim.admin_addr()))
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn metrics(shim: &br_shim::Running) -> br_testkit::prom::Metrics {
    br_testkit::http::metrics(shim.admin_addr()).await
}

struct Started {
    shim: br_shim::Running,
    ingest: FakeIngest,
    _served: br_testkit::Served,
    engine: Script,
    stop: CancellationToken,
}

async fn started(extra: &[&str]) -> Started {
    let stop = CancellationToken::new();
    let (engine_addr, engine) = scripted_engine(&stop).await;
    let ingest = FakeIngest::default();
    let served = ingest.start().await;
    let upstream = format!("http://{engine_addr}");
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
        "hg",
        "--worker-id",
        "4",
        "--shutdown-grace",
        "1s",
    ];
    argv.extend_from_slice(extra);
    let args: br_shim::Args = br_runtime::config::parse_from(argv).unwrap();
    let shim = br_shim::start(&args, stop.clone()).await.unwrap();
    Started {
        shim,
        ingest,
        _served: served,
        engine,
        stop,
    }
}

async fn complete(shim: &br_shim::Running) -> u16 {
    reqwest::Client::new()
        .post(format!("http://{}/v1/completions", shim.http_addr()))
        .json(&json!({"prompt": "x"}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_of_5xx_takes_the_worker_out_of_routing_until_the_engine_serves_again() {
    let s = started(&["--engine-failure-threshold", "3"]).await;
    s.ingest
        .wait_for("the Hello once the engine answered a probe", |_| {
            s.ingest.hellos().len() == 1
        })
        .await;
    eventually(PATIENCE, "ready", || async {
        readyz(&s.shim).await.0 == 200
    })
    .await;
    let incarnation = s.ingest.hellos()[0];

    // Generations fail while /health still says 200: two failures are not a run...
    s.engine.generate.store(500, Ordering::SeqCst);
    assert_eq!(
        complete(&s.shim).await,
        500,
        "the engine's answer is passed on"
    );
    assert_eq!(complete(&s.shim).await, 500);
    assert_eq!(readyz(&s.shim).await.0, 200);
    assert_eq!(s.ingest.streams_ended_by_worker(), 0);
    // ...the third is.
    assert_eq!(complete(&s.shim).await, 500);
    s.ingest
        .wait_for("the worker ended its telemetry stream", |_| {
            s.ingest.streams_ended_by_worker() == 1
        })
        .await;
    let (status, body) = readyz(&s.shim).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("3 proxied requests in a row failed") && body.contains("status_5xx"),
        "{body}"
    );
    let m = metrics(&s.shim).await;
    let labels = |kind| [("group", "hg"), ("worker", "4"), ("kind", kind)];
    assert_eq!(
        m.value(
            "balanceroute_shim_upstream_errors_total",
            &labels("status_5xx")
        ),
        3.0
    );
    assert_eq!(
        m.value(
            "balanceroute_shim_upstream_errors_total",
            &labels("connection")
        ),
        0.0
    );
    assert_eq!(
        m.value(
            "balanceroute_shim_engine_up",
            &[("group", "hg"), ("worker", "4")]
        ),
        0.0
    );
    // once out of routing (the start, before the first probe answered, is not counted)
    assert_eq!(
        m.value(
            "balanceroute_shim_engine_down_total",
            &[("group", "hg"), ("worker", "4")]
        ),
        1.0
    );

    // The engine serves again: after the hold, the passing probes bring the worker back as
    // the same incarnation.
    s.engine.generate.store(200, Ordering::SeqCst);
    s.ingest
        .wait_for("a second Hello of the same incarnation", |_| {
            s.ingest.hellos() == vec![incarnation, incarnation]
        })
        .await;
    eventually(PATIENCE, "ready again", || async {
        readyz(&s.shim).await.0 == 200
    })
    .await;
    assert_eq!(complete(&s.shim).await, 200);
    s.stop.cancel();
    s.shim.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_health_endpoint_takes_the_worker_out_and_its_recovery_brings_it_back() {
    let s = started(&["--engine-probe-interval", "100ms"]).await;
    s.ingest
        .wait_for("the first Hello", |_| s.ingest.hellos().len() == 1)
        .await;
    s.engine.health.store(503, Ordering::SeqCst);
    s.ingest
        .wait_for("the worker ended its telemetry stream", |_| {
            s.ingest.streams_ended_by_worker() == 1
        })
        .await;
    let (status, body) = readyz(&s.shim).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("/health answered 503"), "{body}");
    let m = metrics(&s.shim).await;
    assert!(
        m.value(
            "balanceroute_shim_engine_probe_failures_total",
            &[("group", "hg"), ("worker", "4"), ("reason", "status")]
        ) >= 1.0
    );
    let down = |m: &br_testkit::prom::Metrics| {
        m.value(
            "balanceroute_shim_engine_down_total",
            &[("group", "hg"), ("worker", "4")],
        )
    };
    assert_eq!(down(&m), 1.0, "out of routing once");
    // No Hello while the engine is down.
    assert_eq!(s.ingest.hellos().len(), 1);
    s.engine.health.store(200, Ordering::SeqCst);
    s.ingest
        .wait_for("a second Hello", |_| s.ingest.hellos().len() == 2)
        .await;
    eventually(PATIENCE, "ready again", || async {
        readyz(&s.shim).await.0 == 200
    })
    .await;
    // and out again: each time counts
    s.engine.health.store(503, Ordering::SeqCst);
    s.ingest
        .wait_for("the worker ended its second stream", |_| {
            s.ingest.streams_ended_by_worker() == 2
        })
        .await;
    assert_eq!(down(&metrics(&s.shim).await), 2.0);
    s.stop.cancel();
    s.shim.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_hello_and_not_ready_before_the_engine_answers() {
    // An upstream where nothing listens: the shim serves, but is neither ready nor in σ.
    let down = br_testkit::ReservedPort::new();
    let ingest = FakeIngest::default();
    let served = ingest.start().await;
    let stop = CancellationToken::new();
    let upstream = down.url();
    let ingest_url = format!("http://{}", served.addr);
    let args: br_shim::Args = br_runtime::config::parse_from([
        "br-shim",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--upstream",
        &upstream,
        "--ingest-addr",
        &ingest_url,
        "--engine-probe-interval",
        "50ms",
    ])
    .unwrap();
    let shim = br_shim::start(&args, stop.clone()).await.unwrap();
    let m = eventually_probe_failed(&shim).await;
    assert!(
        m.value(
            "balanceroute_shim_engine_probe_failures_total",
            &[
                ("group", "default"),
                ("worker", "0"),
                ("reason", "connection")
            ]
        ) >= 2.0
    );
    // Two probes failed after start, so a Hello would have been sent by now had it been let.
    assert!(ingest.hellos().is_empty(), "{:?}", ingest.hellos());
    // never up, so never taken out of routing
    assert_eq!(
        m.value(
            "balanceroute_shim_engine_down_total",
            &[("group", "default"), ("worker", "0")]
        ),
        0.0
    );
    let (status, body) = readyz(&shim).await;
    assert_eq!(status, 503);
    assert!(
        body.contains("engine down") && body.contains("/health"),
        "{body}"
    );
    stop.cancel();
    shim.wait().await.unwrap();
}

async fn eventually_probe_failed(shim: &br_shim::Running) -> br_testkit::prom::Metrics {
    br_testkit::eventually_some(PATIENCE, "two failed probes", || async {
        let m = metrics(shim).await;
        (m.sum("balanceroute_shim_engine_probe_failures_total") >= 2.0).then_some(m)
    })
    .await
}
