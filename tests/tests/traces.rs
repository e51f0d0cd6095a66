//! Distributed traces end to end: br-snapshot, br-ingest, br-decision and a br-shim (before a
//! `br-emu engine`) as real processes exporting to an OTLP receiver (tests/src/otlp.rs), a fake
//! worker (which exports nothing) beside the shim, and
//! `Assign` callers that send a known W3C `traceparent`. Checked from the spans the receiver
//! got, as a collector would see them:
//! - decision's server span of each Assign (gRPC, and HTTP/JSON) has the caller's trace id and
//!   the caller's span as its parent;
//! - the tick's `Reserve` client span links each Assign span it carries, and the snapshot
//!   service's `Reserve` server span is its child, in its trace;
//! - a telemetry batch's spans in ingest (the message, then the batch sent on) and the
//!   snapshot service's span applying it share one trace, parent to child; the shim's span of
//!   the message is its root (a fake worker's message starts the trace in ingest).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use br_e2e::engine::EmuEngine;
use br_e2e::otlp::{Receiver, Span};
use br_e2e::{FakeWorker, Service};
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::{AssignRequest, CancelRequest};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;

const GROUP: &str = "traced";
const START: Duration = Duration::from_secs(60);
/// A hang guard for the waits on spans (exported every 100 ms here), not a timing assertion.
const SPANS: Duration = Duration::from_secs(30);

/// The callers' traces: one trace id and parent span id per Assign (`traceparent` fields).
const CALLERS: [(&str, &str); 3] = [
    ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"),
    ("1bf7651916cd43dd8448eb211c80319d", "c7ad6b7169203332"),
    ("2cf7651916cd43dd8448eb211c80319e", "d7ad6b7169203333"),
];
const HTTP_CALLER: (&str, &str) = ("3df7651916cd43dd8448eb211c80319f", "e7ad6b7169203334");

fn traceparent((trace, span): (&str, &str)) -> String {
    format!("00-{trace}-{span}-01")
}

/// Every service exports to `otlp` quickly (a 100 ms batch delay) with its info spans, while
/// it logs only warnings: `--trace-filter` chooses the spans apart from RUST_LOG (with
/// RUST_LOG's `warn` for both, none of the info spans below would reach the receiver).
fn start(bin: &'static str, otlp: &Receiver, extra: &[&str]) -> Service {
    let endpoint = otlp.endpoint();
    let mut args = vec![
        "--otlp-endpoint",
        endpoint.as_str(),
        "--trace-filter",
        "info",
    ];
    args.extend_from_slice(extra);
    Service::start_with_env(
        bin,
        &args,
        &[("RUST_LOG", "warn"), ("OTEL_BSP_SCHEDULE_DELAY", "100")],
    )
}

fn one(spans: &[Span], what: impl Fn(&Span) -> bool) -> Option<&Span> {
    spans.iter().find(|s| what(s))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_crosses_decision_snapshot_and_ingest() {
    let otlp = Receiver::start().await;
    let snapshot = start("br-snapshot", &otlp, &[]);
    snapshot.wait_for("/livez", START).await;
    let snap = snapshot.grpc_url();
    let ingest = start("br-ingest", &otlp, &["--snapshot-addr", &snap]);
    let decision = start(
        "br-decision",
        &otlp,
        &[
            "--snapshot-addr",
            &snap,
            "--groups",
            GROUP,
            "--http-listen",
            "127.0.0.1:0",
        ],
    );
    ingest.wait_for("/readyz", START).await;
    // rank 0: a shim before an emulated engine, exporting its spans too; rank 1: a fake worker
    let engine = EmuEngine::start(&["--ranks", "1", "--slots", "64", "--time-scale", "0.1"]);
    let shim = start(
        "br-shim",
        &otlp,
        &[
            "--upstream",
            &engine.rank_url(0),
            "--ingest-addr",
            &ingest.grpc_url(),
            "--group",
            GROUP,
            "--worker-id",
            "0",
            "--capacity",
            "64",
        ],
    );
    shim.wait_for("/readyz", START).await;
    let mut worker = FakeWorker::connect(&ingest.grpc_url(), GROUP, 1, 64).await;
    decision.wait_for("/readyz", START).await;

    // Assigns with the callers' contexts, at once, so a tick may carry several in one Reserve.
    let channel = tonic::transport::Endpoint::from_shared(decision.grpc_url())
        .unwrap()
        .connect()
        .await
        .expect("decision reachable");
    let calls = CALLERS.iter().enumerate().map(|(i, caller)| {
        let mut client = DecisionClient::new(channel.clone());
        let mut req = tonic::Request::new(AssignRequest {
            group: GROUP.into(),
            request_id: format!("traced-{i}"),
            prompt_tokens: 100,
            prompt_hash: None,
            max_tokens: None,
            expected_output_tokens: None,
            request_class: None,
        });
        req.set_timeout(Duration::from_secs(10));
        req.metadata_mut()
            .insert("traceparent", traceparent(*caller).parse().unwrap());
        req.metadata_mut()
            .insert("tracestate", "caller=1".parse().unwrap());
        async move { client.assign(req).await }
    });
    for answer in futures::future::join_all(calls).await {
        let answer = answer.expect("Assign answered").into_inner();
        assert!(answer.worker_id < 2, "{answer:?}");
    }
    // ... and one through the HTTP/JSON port.
    let http = decision.http_port.expect("--http-listen bound");
    let resp = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{http}/v1/assign"))
        .header("traceparent", traceparent(HTTP_CALLER))
        .header("content-type", "application/json")
        .body(
            serde_json::json!({"group": GROUP, "request_id": "traced-http", "prompt_tokens": 50})
                .to_string(),
        )
        .send()
        .await
        .expect("HTTP/JSON Assign");
    assert!(resp.status().is_success(), "{:?}", resp.text().await);

    // 1. decision's server span of each Assign continues its caller's trace.
    let mut assign_spans = Vec::new();
    for caller in CALLERS {
        let what = format!("decision's Assign server span in trace {}", caller.0);
        let s = otlp
            .wait_for(SPANS, &what, |spans| {
                one(spans, |s| {
                    s.service == "br-decision"
                        && s.name == "balanceroute.v1.Decision/Assign"
                        && s.kind == SpanKind::Server
                        && s.trace_id == caller.0
                })
                .cloned()
            })
            .await;
        assert_eq!(
            s.parent_span_id, caller.1,
            "the caller's span is its parent: {s:?}"
        );
        assert_eq!(s.attr("rpc.system"), Some("grpc"), "{s:?}");
        assign_spans.push(s);
    }
    let http_span = otlp
        .wait_for(SPANS, "decision's HTTP/JSON Assign span", |spans| {
            one(spans, |s| {
                s.service == "br-decision"
                    && s.kind == SpanKind::Server
                    && s.trace_id == HTTP_CALLER.0
            })
            .cloned()
        })
        .await;
    assert_eq!(http_span.parent_span_id, HTTP_CALLER.1, "{http_span:?}");
    assert_eq!(http_span.name, "POST /v1/assign");
    assign_spans.push(http_span);

    // 2. Each Assign span is linked from a Reserve client span of decision, and that Reserve's
    //    server span in the snapshot service is its child, in its trace.
    for assign in &assign_spans {
        let linked = (assign.trace_id.clone(), assign.span_id.clone());
        let reserve = otlp
            .wait_for(
                SPANS,
                &format!("a Reserve span linking {linked:?}"),
                |spans| {
                    one(spans, |s| {
                        s.service == "br-decision"
                            && s.name == "balanceroute.v1.Snapshot/Reserve"
                            && s.kind == SpanKind::Client
                            && s.links.contains(&linked)
                    })
                    .cloned()
                },
            )
            .await;
        assert_ne!(
            reserve.trace_id, assign.trace_id,
            "a Reserve serves many Assigns: a link, not a parent"
        );
        let served = otlp
            .wait_for(SPANS, "the snapshot service's Reserve span", |spans| {
                one(spans, |s| {
                    s.service == "br-snapshot"
                        && s.name == "balanceroute.v1.Snapshot/Reserve"
                        && s.kind == SpanKind::Server
                        && s.trace_id == reserve.trace_id
                })
                .cloned()
            })
            .await;
        assert_eq!(
            served.parent_span_id, reserve.span_id,
            "the snapshot's Reserve is a child of decision's: {served:?} {reserve:?}"
        );
    }

    // 2b. A Cancel of a reservation: decision's client span of the Release it sends, and the
    //     snapshot service's span serving it as its child.
    DecisionClient::new(channel.clone())
        .cancel(CancelRequest {
            group: GROUP.into(),
            request_id: "traced-2".into(),
        })
        .await
        .expect("Cancel answered");
    let release = otlp
        .wait_for(SPANS, "decision's Release client span", |spans| {
            one(spans, |s| {
                s.service == "br-decision"
                    && s.name == "balanceroute.v1.Snapshot/Release"
                    && s.kind == SpanKind::Client
            })
            .cloned()
        })
        .await;
    let served = otlp
        .wait_for(SPANS, "the snapshot service's Release span", |spans| {
            one(spans, |s| {
                s.service == "br-snapshot"
                    && s.name == "balanceroute.v1.Snapshot/Release"
                    && s.kind == SpanKind::Server
                    && s.trace_id == release.trace_id
            })
            .cloned()
        })
        .await;
    assert_eq!(
        served.parent_span_id, release.span_id,
        "the snapshot's Release is a child of decision's: {served:?} {release:?}"
    );

    // 3. A telemetry batch: ingest's span of the message, its batch span towards the snapshot
    //    service, and the snapshot service's span applying it, in one trace; its root is the
    //    shim's span of the message when a shim sent it. (The shim sends its full state
    //    every few seconds and after Hello; the fake worker's progress is sent here.)
    worker.start("traced-1", 100).await;
    worker.step(5).await;
    let completion = reqwest::Client::new()
        .post(format!(
            "http://127.0.0.1:{}/v1/completions",
            shim.grpc_port
        ))
        .header("x-request-id", "traced-shim")
        .json(
            &serde_json::json!({"model": "br-emu", "prompt": "x", "max_tokens": 4, "stream": true}),
        )
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .expect("a completion through the shim");
    assert!(
        completion.status().is_success(),
        "{:?}",
        completion.status()
    );
    completion.bytes().await.expect("the whole stream");
    let chain = |spans: &[Span], from_shim: bool| -> Option<[Span; 3]> {
        spans
            .iter()
            .filter(|s| {
                s.service == "br-snapshot"
                    && s.name == "balanceroute.v1.Snapshot/Apply batch"
                    && s.kind == SpanKind::Consumer
            })
            .find_map(|applied| {
                let sent = one(spans, |s| {
                    s.service == "br-ingest"
                        && s.name == "balanceroute.v1.Snapshot/Apply batch"
                        && s.kind == SpanKind::Producer
                        && s.span_id == applied.parent_span_id
                })?;
                let message = one(spans, |s| {
                    s.service == "br-ingest"
                        && s.name == "balanceroute.v1.Telemetry/Report batch"
                        && s.kind == SpanKind::Consumer
                        && s.span_id == sent.parent_span_id
                        && (s.parent_span_id.is_empty() != from_shim)
                })?;
                Some([message.clone(), sent.clone(), applied.clone()])
            })
    };
    let [message, sent, applied] = otlp
        .wait_for(
            SPANS,
            "a fake worker's batch traced from ingest into the snapshot service",
            |s| chain(s, false),
        )
        .await;
    assert_eq!(sent.trace_id, applied.trace_id);
    assert_eq!(message.trace_id, sent.trace_id);

    let [message, sent, applied] = otlp
        .wait_for(
            SPANS,
            "a shim's batch traced through ingest into the snapshot service",
            |s| chain(s, true),
        )
        .await;
    assert_eq!(sent.trace_id, applied.trace_id);
    assert_eq!(message.trace_id, sent.trace_id);
    let root = otlp
        .wait_for(SPANS, "the shim's span of the message", |spans| {
            one(spans, |s| s.span_id == message.parent_span_id).cloned()
        })
        .await;
    assert_eq!(root.service, "br-shim", "{root:?}");
    assert_eq!(root.name, "balanceroute.v1.Telemetry/Report batch");
    assert_eq!(root.kind, SpanKind::Producer);
    assert_eq!(root.trace_id, message.trace_id);
    assert_eq!(root.parent_span_id, "", "the shim's span is the root");
    worker.die();
    drop((shim, engine));
}
