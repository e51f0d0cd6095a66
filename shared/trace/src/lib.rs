//! W3C trace context across BalanceRoute's processes (<https://www.w3.org/TR/trace-context/>).
//!
//! This crate owns how a trace crosses a process boundary, in one place for every service and
//! client:
//! - [`ServerLayer`]: a tower layer on every gRPC server (br-runtime puts it on every port):
//!   each call gets a server span (`otel.name` `package.Service/Method`, kind server) whose
//!   parent is the caller's `traceparent`/`tracestate` from the request metadata, so a trace
//!   continues instead of starting anew in each process.
//! - [`Inject`] / [`traced`]: a tonic interceptor for every gRPC client we own; it puts the
//!   current span's context into the outgoing metadata.
//! - [`W3c`]: the same two values carried inside a message, for what a long-lived stream
//!   cannot say in its metadata once per item (ingest's `ChangeBatch` on the Apply stream).
//! - [`context_from_headers`] and [`continue_trace`]: the same for an HTTP entry point
//!   (br-decision's HTTP/JSON port, the headers Envoy hands to its ext_proc picker).
//!
//! Propagation is off until [`install`] is called (br-runtime calls it when an OTLP exporter
//! is configured): until then the layer makes no span and the interceptor touches no header,
//! so a process that exports nothing pays one relaxed atomic load per call.

use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context as TaskContext, Poll};

use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::Instrument as _;
use tracing::instrument::Instrumented;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The W3C header (and metadata key) with the trace id, parent span id and flags.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header with vendor-specific trace state.
pub const TRACESTATE: &str = "tracestate";
/// Longest `traceparent` taken from a message (version 00 is 55 bytes; later versions may
/// append fields, so some room).
pub const MAX_TRACEPARENT: usize = 128;
/// Longest `tracestate` taken from a message (the W3C spec lets a vendor cut it at 512).
pub const MAX_TRACESTATE: usize = 512;

/// A span's identity, as a link names it (re-exported: callers need no OpenTelemetry
/// dependency of their own).
pub use opentelemetry::trace::SpanContext;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Turns propagation on for this process: W3C trace context (opentelemetry_sdk's
/// [`TraceContextPropagator`]) becomes the global propagator, servers continue callers' traces
/// and clients send theirs. Call once a tracing subscriber with an OpenTelemetry layer is
/// installed (without one there are no span contexts to send). A gateway embedding br-client
/// calls it too, after setting up its own tracing.
pub fn install() {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    ENABLED.store(true, Ordering::Release);
}

/// Whether [`install`] was called: propagation and server spans are on.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// `Some` if `cx` holds a valid remote or local span (a context to continue).
fn valid(cx: Context) -> Option<Context> {
    cx.span().span_context().is_valid().then_some(cx)
}

/// The caller's trace context from HTTP headers (or gRPC metadata, which are HTTP/2 headers);
/// `None` when propagation is off or the headers carry none (or a malformed one).
pub fn context_from_headers(headers: &http::HeaderMap) -> Option<Context> {
    if !enabled() {
        return None;
    }
    let cx =
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)));
    valid(cx)
}

/// Makes `span` continue the trace of `parent` (its parent span becomes the remote one). Call
/// right after creating the span, before it is entered or its context read: a started span's
/// parent cannot change.
pub fn continue_trace(span: &tracing::Span, parent: Option<Context>) {
    if let Some(cx) = parent
        && let Err(e) = span.set_parent(cx)
    {
        tracing::debug!(error = %e, "could not continue the caller's trace");
    }
}

/// The OpenTelemetry span context of `span`, when propagation is on and the span is exported
/// (for a span link made elsewhere, e.g. the Reserve span linking each Assign it serves).
pub fn span_context(span: &tracing::Span) -> Option<SpanContext> {
    if !enabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then_some(sc)
}

/// Makes `span` a child of the span `parent` (of this process or another): for a span started
/// in one task on behalf of work another task's span began (a batch sent for a message).
pub fn child_of(span: &tracing::Span, parent: SpanContext) {
    if parent.is_valid() {
        continue_trace(span, Some(Context::new().with_remote_span_context(parent)));
    }
}

/// Adds a link from `span` to each of `links` (invalid contexts are skipped).
pub fn add_links(span: &tracing::Span, links: impl IntoIterator<Item = SpanContext>) {
    for l in links {
        span.add_link(l);
    }
}

/// A trace context carried inside a message: the two W3C header values.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct W3c {
    pub traceparent: String,
    pub tracestate: String,
}

impl W3c {
    /// The context of `span` (empty when propagation is off or the span is not exported).
    pub fn of(span: &tracing::Span) -> W3c {
        let mut w = W3c::default();
        if !enabled() {
            return w;
        }
        let cx = span.context();
        if !cx.span().span_context().is_valid() {
            return w;
        }
        opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut w));
        w
    }

    /// The context these values name; `None` when propagation is off, or they are empty,
    /// too long or malformed (the receiver then starts a new trace: a bad value from a peer
    /// costs it its parentage, nothing else).
    pub fn context(&self) -> Option<Context> {
        Self::context_of(&self.traceparent, &self.tracestate)
    }

    /// [`W3c::context`] of borrowed values (a message's fields).
    pub fn context_of(traceparent: &str, tracestate: &str) -> Option<Context> {
        if !enabled()
            || traceparent.is_empty()
            || traceparent.len() > MAX_TRACEPARENT
            || tracestate.len() > MAX_TRACESTATE
        {
            return None;
        }
        let carrier = Pair {
            traceparent,
            tracestate,
        };
        valid(opentelemetry::global::get_text_map_propagator(|p| {
            p.extract(&carrier)
        }))
    }
}

impl Injector for W3c {
    fn set(&mut self, key: &str, value: String) {
        match key {
            TRACEPARENT => self.traceparent = value,
            TRACESTATE => self.tracestate = value,
            _ => {}
        }
    }
}

/// Borrowed `traceparent`/`tracestate` as a propagator reads them.
struct Pair<'a> {
    traceparent: &'a str,
    tracestate: &'a str,
}

impl Extractor for Pair<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            TRACEPARENT => Some(self.traceparent),
            TRACESTATE if !self.tracestate.is_empty() => Some(self.tracestate),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT, TRACESTATE]
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value),
        ) {
            self.0.insert(k, v);
        }
    }
}

/// Puts the current span's trace context into `metadata` (nothing when propagation is off or
/// no exported span is current).
pub fn inject_current(metadata: &mut tonic::metadata::MetadataMap) {
    if !enabled() {
        return;
    }
    let cx = tracing::Span::current().context();
    if !cx.span().span_context().is_valid() {
        return;
    }
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut MetadataInjector(metadata));
    });
}

/// The client side: a tonic interceptor that sends the current span's trace context with each
/// call (see [`inject_current`]). It runs where the call is made, so the context is the span
/// the calling future is instrumented with.
#[derive(Debug, Clone, Copy, Default)]
pub struct Inject;

impl tonic::service::Interceptor for Inject {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        inject_current(req.metadata_mut());
        Ok(req)
    }
}

/// A channel (or any gRPC service) whose calls carry the caller's trace context.
pub type Traced<S> = tonic::service::interceptor::InterceptedService<S, Inject>;

/// Wraps a channel so that every call made through it sends the current trace context:
/// `SnapshotClient::new(br_trace::traced(channel))`.
pub fn traced<S>(inner: S) -> Traced<S> {
    tonic::service::interceptor::InterceptedService::new(inner, Inject)
}

/// A server span named `name` that continues `parent`: an entry point that is not a gRPC call
/// (an HTTP/JSON request, a request Envoy hands to the ext_proc picker). Disabled (free) when
/// propagation is off.
pub fn server_span(name: impl std::fmt::Display, parent: Option<Context>) -> tracing::Span {
    if !enabled() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!("server", otel.name = %name, otel.kind = "server");
    continue_trace(&span, parent);
    span
}

/// The server side: a tower layer that gives each gRPC call a server span continuing the
/// caller's trace (see the crate docs). Health checks get no span (probes every few seconds
/// would drown the traces that matter).
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerLayer;

impl<S> tower::Layer<S> for ServerLayer {
    type Service = ServerService<S>;

    fn layer(&self, inner: S) -> ServerService<S> {
        ServerService { inner }
    }
}

/// See [`ServerLayer`].
#[derive(Debug, Clone)]
pub struct ServerService<S> {
    inner: S,
}

/// The health service's path prefix: no span for its calls.
const HEALTH_PREFIX: &str = "/grpc.health.v1.Health/";

/// The server span of a gRPC call of `path` (`/package.Service/Method`) whose caller sent
/// `headers`; disabled (free) when propagation is off.
pub fn grpc_server_span(path: &str, headers: &http::HeaderMap) -> tracing::Span {
    if !enabled() || path.starts_with(HEALTH_PREFIX) {
        return tracing::Span::none();
    }
    let name = path.strip_prefix('/').unwrap_or(path);
    let (service, method) = name.split_once('/').unwrap_or((name, ""));
    let span = tracing::info_span!(
        "grpc.server",
        otel.name = name,
        otel.kind = "server",
        rpc.system = "grpc",
        rpc.service = service,
        rpc.method = method,
    );
    continue_trace(&span, context_from_headers(headers));
    span
}

impl<S, B> tower::Service<http::Request<B>> for ServerService<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Instrumented<S::Future>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let span = grpc_server_span(req.uri().path(), req.headers());
        let fut = {
            let _in = span.enter();
            self.inner.call(req)
        };
        fut.instrument(span)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests;
