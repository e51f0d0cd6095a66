//! Propagation off (no `install`, as in a process with no OTLP exporter): its own test binary,
//! since `install` is for the whole process. Even with an OpenTelemetry layer present, nothing
//! is read from a caller or sent to a peer, and the server layer makes no span.

#![allow(clippy::unwrap_used)] // tests may panic on purpose

use std::sync::{Arc, Mutex};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use tracing_subscriber::layer::SubscriberExt as _;

#[derive(Debug, Clone, Default)]
struct Collect(Arc<Mutex<Vec<SpanData>>>);

impl SpanExporter for Collect {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.0.lock().unwrap().extend(batch);
        Ok(())
    }
}

#[test]
fn nothing_is_propagated_before_install() {
    let exporter = Collect::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    let _guard = tracing::subscriber::set_default(subscriber);
    assert!(!br_trace::enabled());

    let mut headers = http::HeaderMap::new();
    headers.insert(
        br_trace::TRACEPARENT,
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            .parse()
            .unwrap(),
    );
    assert!(br_trace::context_from_headers(&headers).is_none());
    let server = br_trace::grpc_server_span("/balanceroute.v1.Decision/Assign", &headers);
    assert!(server.is_disabled(), "no server span while off");

    let span = tracing::info_span!("caller");
    let mut md = tonic::metadata::MetadataMap::new();
    span.in_scope(|| br_trace::inject_current(&mut md));
    assert!(md.is_empty(), "nothing sent while off: {md:?}");
    assert_eq!(br_trace::W3c::of(&span), br_trace::W3c::default());
    assert!(br_trace::span_context(&span).is_none());
    assert!(
        br_trace::W3c::context_of(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ""
        )
        .is_none()
    );
    drop(span);
    // the one span made here is the test's own
    let names: Vec<_> = exporter
        .0
        .lock()
        .unwrap()
        .iter()
        .map(|s| s.name.to_string())
        .collect();
    assert_eq!(names, ["caller"]);
}
