//! Unit tests: spans are collected by an in-process exporter (no network) and checked by
//! their ids, parents and links, the way a collector would see them.

use std::sync::{Arc, Mutex};

use opentelemetry::trace::{SpanId, SpanKind, TraceId, TracerProvider as _};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use tracing_subscriber::layer::SubscriberExt as _;

use super::*;

/// Keeps every exported span.
#[derive(Debug, Clone, Default)]
struct Collect(Arc<Mutex<Vec<SpanData>>>);

impl SpanExporter for Collect {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.0.lock().unwrap().extend(batch);
        Ok(())
    }
}

impl Collect {
    fn named(&self, name: &str) -> SpanData {
        let spans = self.0.lock().unwrap();
        let found: Vec<_> = spans.iter().filter(|s| s.name == name).cloned().collect();
        assert_eq!(found.len(), 1, "one span {name:?} in {spans:#?}");
        found.into_iter().next().unwrap()
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// A subscriber exporting to a fresh [`Collect`] (synchronously: each span is exported when
/// it closes), set for this thread until the guard drops; propagation on.
fn collecting() -> (
    Collect,
    SdkTracerProvider,
    tracing::subscriber::DefaultGuard,
) {
    let exporter = Collect::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    let guard = tracing::subscriber::set_default(subscriber);
    install();
    (exporter, provider, guard)
}

const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

fn caller_headers() -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    h.insert(
        TRACEPARENT,
        format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01")
            .parse()
            .unwrap(),
    );
    h.insert(TRACESTATE, "vendor=x".parse().unwrap());
    h
}

/// The inner service of the layer: records the trace context current while it is called,
/// as a handler's own spans would see it.
#[derive(Clone, Default)]
struct Handler(Arc<Mutex<Option<SpanContext>>>);

impl tower::Service<http::Request<()>> for Handler {
    type Response = ();
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<(), Self::Error>>;

    fn poll_ready(&mut self, _: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<()>) -> Self::Future {
        let cx = tracing::Span::current().context();
        *self.0.lock().unwrap() = Some(cx.span().span_context().clone());
        std::future::ready(Ok(()))
    }
}

#[tokio::test(flavor = "current_thread")]
async fn the_server_span_continues_the_callers_trace() {
    use tower::{Layer as _, Service as _};
    let (spans, _provider, _guard) = collecting();
    let handler = Handler::default();
    let mut svc = ServerLayer.layer(handler.clone());
    let mut req = http::Request::new(());
    *req.uri_mut() = "/balanceroute.v1.Decision/Assign".parse().unwrap();
    *req.headers_mut() = caller_headers();
    svc.call(req).await.unwrap();

    let span = spans.named("balanceroute.v1.Decision/Assign");
    assert_eq!(span.span_kind, SpanKind::Server);
    assert_eq!(
        span.span_context.trace_id(),
        TraceId::from_hex(CALLER_TRACE).unwrap()
    );
    assert_eq!(span.parent_span_id, SpanId::from_hex(CALLER_SPAN).unwrap());
    assert!(span.parent_span_is_remote);
    // the handler ran inside it
    let seen = handler.0.lock().unwrap().clone().unwrap();
    assert_eq!(seen.span_id(), span.span_context.span_id());
}

#[tokio::test(flavor = "current_thread")]
async fn a_call_without_a_caller_context_starts_a_trace_and_health_gets_no_span() {
    use tower::{Layer as _, Service as _};
    let (spans, _provider, _guard) = collecting();
    let mut svc = ServerLayer.layer(Handler::default());
    let mut req = http::Request::new(());
    *req.uri_mut() = "/balanceroute.v1.Snapshot/Reserve".parse().unwrap();
    // a malformed traceparent is no context
    req.headers_mut()
        .insert(TRACEPARENT, "00-nonsense-01".parse().unwrap());
    svc.call(req).await.unwrap();
    let span = spans.named("balanceroute.v1.Snapshot/Reserve");
    assert_eq!(span.parent_span_id, SpanId::INVALID);

    let mut req = http::Request::new(());
    *req.uri_mut() = "/grpc.health.v1.Health/Check".parse().unwrap();
    svc.call(req).await.unwrap();
    assert_eq!(spans.len(), 1, "no span for a health check");
}

#[test]
fn the_client_sends_the_current_span() {
    let (spans, _provider, _guard) = collecting();
    let span = tracing::info_span!("caller");
    let mut md = tonic::metadata::MetadataMap::new();
    span.in_scope(|| inject_current(&mut md));
    let sent = md.get(TRACEPARENT).unwrap().to_str().unwrap().to_owned();
    drop(span);
    let caller = spans.named("caller");
    assert_eq!(
        sent,
        format!(
            "00-{}-{}-01",
            caller.span_context.trace_id(),
            caller.span_context.span_id()
        )
    );
    // no current span: nothing sent
    let mut md = tonic::metadata::MetadataMap::new();
    inject_current(&mut md);
    assert!(md.get(TRACEPARENT).is_none());
}

#[test]
fn a_message_carries_a_context_that_the_receiver_continues() {
    let (spans, _provider, _guard) = collecting();
    let sender = tracing::info_span!("sender");
    let w = W3c::of(&sender);
    assert!(w.traceparent.starts_with("00-"), "{w:?}");
    let receiver = tracing::info_span!("receiver");
    continue_trace(&receiver, w.context());
    drop(receiver);
    drop(sender);
    let (s, r) = (spans.named("sender"), spans.named("receiver"));
    assert_eq!(r.span_context.trace_id(), s.span_context.trace_id());
    assert_eq!(r.parent_span_id, s.span_context.span_id());

    // too long, empty or malformed: no context (a new trace), never a panic
    let long = "x".repeat(MAX_TRACESTATE + 1);
    assert!(W3c::context_of(&w.traceparent, &long).is_none());
    assert!(W3c::context_of("", "").is_none());
    assert!(W3c::context_of("00-zz-yy-01", "").is_none());
    assert!(W3c::context_of(&w.traceparent, "").is_some());
}

#[test]
fn links_name_the_linked_spans() {
    let (spans, _provider, _guard) = collecting();
    let a = tracing::info_span!("assign_a");
    let b = tracing::info_span!("assign_b");
    let links: Vec<_> = [&a, &b].into_iter().filter_map(span_context).collect();
    assert_eq!(links.len(), 2);
    let reserve = tracing::info_span!("reserve");
    add_links(&reserve, links.clone());
    drop((reserve, a, b));
    let r = spans.named("reserve");
    let linked: Vec<_> = r.links.iter().map(|l| l.span_context.clone()).collect();
    assert_eq!(linked, links);
    assert_ne!(
        r.span_context.trace_id(),
        spans.named("assign_a").span_context.trace_id(),
        "a link, not a parent"
    );
}
