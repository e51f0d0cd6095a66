//! br-ingest with traces exported makes no span per telemetry message: a worker's stream
//! sends 400 untraced Progress messages, then one its reporter traced (a `traceparent`, as a
//! shim exporting traces sends). Spans leave ingest in the order they end, so once the traced
//! message's span has reached the OTLP receiver every earlier one has too. Checked: the
//! traced message continues its reporter's trace, and of the 400 untraced ones only the
//! sampled one (the stream's first, with the default `--message-span-every 1000`) has a span;
//! before, each of the 400 had its own root trace.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use br_e2e::Service;
use br_e2e::otlp::Receiver;
use br_proto::v1::telemetry_client::TelemetryClient;
use br_proto::v1::{self, worker_report};
use br_testkit::within;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const GROUP: &str = "spans";
const START: Duration = Duration::from_secs(60);
const SPANS: Duration = Duration::from_secs(30);
const UNTRACED: u64 = 400;
const MESSAGE_SPAN: &str = "balanceroute.v1.Telemetry/Report batch";
/// The reporter's trace of the last message.
const TRACE: &str = "4af7651916cd43dd8448eb211c8031a0";
const PARENT: &str = "f7ad6b7169203335";

fn progress(seq: u64, traceparent: String) -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(worker_report::Kind::Progress(v1::Progress {
            seq,
            updates: vec![v1::RequestProgress {
                request_id: "r".into(),
                prompt_tokens: 100,
                generated_tokens: u32::try_from(seq).unwrap(),
                finished: false,
                unkeyed: false,
            }],
            full_state: false,
            traceparent,
            tracestate: String::new(),
        })),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untraced_messages_are_sampled_traced_ones_continue() {
    let otlp = Receiver::start().await;
    let snapshot = Service::start("br-snapshot", &[]);
    snapshot.wait_for("/livez", START).await;
    let endpoint = otlp.endpoint();
    let ingest = Service::start_with_env(
        "br-ingest",
        &[
            "--snapshot-addr",
            &snapshot.grpc_url(),
            "--otlp-endpoint",
            &endpoint,
        ],
        &[("RUST_LOG", "info"), ("OTEL_BSP_SCHEDULE_DELAY", "100")],
    );
    ingest.wait_for("/readyz", START).await;

    let (tx, rx) = mpsc::channel(64);
    tx.send(v1::WorkerReport {
        kind: Some(worker_report::Kind::Hello(v1::Hello {
            group: GROUP.into(),
            worker_id: 0,
            incarnation: 0x5a11,
            capacity: 8,
            endpoint: "http://127.0.0.1:18000".into(),
        })),
    })
    .await
    .unwrap();
    let mut acks = within(START, "the Report stream opens", async {
        TelemetryClient::connect(ingest.grpc_url())
            .await
            .expect("ingest reachable")
            .report(ReceiverStream::new(rx))
            .await
            .expect("the Report stream")
            .into_inner()
    })
    .await;
    let mut last_ack = 0;
    for seq in 1..=UNTRACED + 1 {
        let traceparent = if seq == UNTRACED + 1 {
            format!("00-{TRACE}-{PARENT}-01")
        } else {
            String::new()
        };
        tx.send(progress(seq, traceparent)).await.unwrap();
        // one message in flight at a time, so each is handled (and its span ended) in order
        while last_ack < seq {
            let ack = within(START, "an ack", acks.message())
                .await
                .expect("an ack, not an error")
                .expect("an ack, not the end");
            last_ack = last_ack.max(ack.seq);
        }
    }

    let traced = otlp
        .wait_for(SPANS, "the traced message's span", |spans| {
            spans
                .iter()
                .find(|s| s.service == "br-ingest" && s.name == MESSAGE_SPAN && s.trace_id == TRACE)
                .cloned()
        })
        .await;
    assert_eq!(
        traced.parent_span_id, PARENT,
        "it continues its reporter's trace"
    );
    assert_eq!(traced.kind, SpanKind::Consumer);
    let roots: Vec<String> = otlp
        .spans()
        .into_iter()
        .filter(|s| s.service == "br-ingest" && s.name == MESSAGE_SPAN && s.trace_id != TRACE)
        .map(|s| s.attr("seq").unwrap_or("?").to_owned())
        .collect();
    assert_eq!(
        roots,
        vec!["1".to_owned()],
        "of {UNTRACED} untraced messages only the sampled first has a span"
    );
    drop(tx);
}
