//! `br-shim`: a sidecar reverse proxy in front of one OpenAI-compatible decode rank (vLLM,
//! SGLang, `br-emu engine`). It forwards every request untouched for the client, reads the
//! token stream of `/v1/completions` and `/v1/chat/completions` as it passes, and reports each
//! request's cumulative progress (prompt tokens, generated tokens, finished) to a
//! [`ProgressSink`], in production the telemetry reporter that streams to ingest.
//!
//! - Streaming: where allowed (`--inject-usage`, on by default), the shim asks the engine for
//!   per-chunk usage (vLLM's `stream_options: {include_usage, continuous_usage_stats}`) and
//!   removes from each chunk what the client did not ask for, byte-exactly (the member is cut
//!   out of the JSON text; nothing is re-serialised). Without usage it counts chunks.
//! - Chunks are forwarded as they arrive; only a chunk that must be trimmed waits for the end
//!   of its own SSE event.
//! - The request id is the gateway's `X-Request-Id` header, else the response's `id`, reported
//!   `unkeyed` so σ matches it to the worker's oldest reservation (the request-id rule, see
//!   `br_sigma::unkeyed`); `--require-request-id` refuses such requests instead.
//! - A client that goes away, an engine error or a failed upstream call ends the request
//!   (`finished = true`).
//! - The engine's health ([`health`]): probes and the outcome of every proxied call decide
//!   whether the worker is in routing (its telemetry stream up) and `/readyz`.

pub mod app;
pub mod config;
pub mod health;
pub mod metrics;
pub mod ranks;
pub mod report;
pub mod sse;
pub mod topology;

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use serde_json::Value;
use serde_json::value::RawValue;

pub use app::{Running, start};
pub use config::Args;
pub use metrics::ShimMetrics;
pub use report::{NullSink, ProgressSink, RecordingSink, Report};

pub use config::{
    DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_BUFFERED_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
};

/// The paths whose responses carry tokens.
pub const GENERATION_PATHS: [&str; 2] = ["/v1/completions", "/v1/chat/completions"];

/// The proxy's shared state.
pub struct Shim {
    client: reqwest::Client,
    upstream: String,
    inject_usage: bool,
    /// Cleared the first time the engine refuses a request only because of the injected
    /// `stream_options` (it does not support them): from then on the shim counts chunks.
    engine_takes_usage: AtomicBool,
    max_body: usize,
    /// One permit per byte of request body the shim holds to inspect (each buffered body costs
    /// about twice its size: as received and as sent on), so N concurrent large bodies cannot
    /// take N x 2 x `max_body` of memory.
    body_budget: Arc<tokio::sync::Semaphore>,
    max_buffered: usize,
    /// How long a body to inspect may take to arrive (`--body-timeout`).
    body_timeout: std::time::Duration,
    /// One permit per request in flight (held until its response body ends).
    in_flight: Arc<tokio::sync::Semaphore>,
    max_in_flight: usize,
    sink: Arc<dyn ProgressSink>,
    metrics: ShimMetrics,
    /// Told the outcome of every call to the engine.
    health: Arc<health::Health>,
    /// How the engine is told this shim's rank (when one server serves several).
    pin: topology::Pin,
    /// `--require-request-id`: refuse generation requests without `X-Request-Id`.
    require_request_id: bool,
}

impl std::fmt::Debug for Shim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shim")
            .field("upstream", &self.upstream)
            .field("inject_usage", &self.inject_usage)
            .finish_non_exhaustive()
    }
}

/// Why the shim could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    #[error("--upstream {0:?} must be an http:// URL")]
    BadUpstream(String),
    #[error("building the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}

impl Shim {
    /// A shim forwarding to `upstream` (e.g. `http://127.0.0.1:8000`).
    pub fn new(
        upstream: &str,
        inject_usage: bool,
        sink: Arc<dyn ProgressSink>,
        metrics: ShimMetrics,
    ) -> Result<Self, ShimError> {
        let upstream = upstream.trim_end_matches('/').to_owned();
        if !(upstream.starts_with("http://") && upstream.len() > "http://".len()) {
            return Err(ShimError::BadUpstream(upstream));
        }
        let client = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(5))
            .tcp_nodelay(true)
            .build()?;
        Ok(Shim {
            client,
            upstream,
            inject_usage,
            engine_takes_usage: AtomicBool::new(true),
            max_body: DEFAULT_MAX_BODY_BYTES,
            body_budget: Arc::new(tokio::sync::Semaphore::new(DEFAULT_MAX_BUFFERED_BODY_BYTES)),
            max_buffered: DEFAULT_MAX_BUFFERED_BODY_BYTES,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            in_flight: Arc::new(tokio::sync::Semaphore::new(DEFAULT_MAX_CONCURRENT_REQUESTS)),
            max_in_flight: DEFAULT_MAX_CONCURRENT_REQUESTS,
            sink,
            metrics,
            health: Arc::new(health::Health::always_up()),
            pin: topology::Pin::default(),
            require_request_id: false,
        })
    }

    /// Tells the engine this rank on every request (`--dp-rank-header`, `--dp-rank-field`).
    #[must_use]
    pub fn with_pin(mut self, pin: topology::Pin) -> Self {
        self.pin = pin;
        self
    }

    /// Shares `other`'s limits (requests at once, body bytes held, body timeout): the ranks
    /// one shim process serves share its memory and its connections.
    #[must_use]
    pub fn sharing_limits_of(mut self, other: &Shim) -> Self {
        self.max_body = other.max_body;
        self.in_flight = Arc::clone(&other.in_flight);
        self.max_in_flight = other.max_in_flight;
        self.body_budget = Arc::clone(&other.body_budget);
        self.max_buffered = other.max_buffered;
        self.body_timeout = other.body_timeout;
        self.client = other.client.clone();
        self
    }

    /// A refusal in the OpenAI error shape, counted under `reason`.
    pub(crate) fn refuse_for(&self, status: StatusCode, reason: &str, msg: String) -> Response {
        refuse(self, status, reason, msg)
    }

    /// Reports the outcome of every call to the engine to `health` (by default nothing
    /// judges them).
    #[must_use]
    pub fn with_health(mut self, health: Arc<health::Health>) -> Self {
        self.health = health;
        self
    }

    /// A call to the engine failed: counted by kind and judged.
    fn upstream_failed(&self, kind: health::UpstreamError, detail: &str) {
        self.metrics
            .upstream_errors
            .with_label_values(&[kind.label()])
            .inc();
        self.health.proxied_failed(kind, detail);
    }

    /// The engine answered with `status`: a 5xx is a failure, anything else proves it works.
    fn upstream_answered(&self, status: StatusCode) {
        if status.is_server_error() {
            self.upstream_failed(
                health::UpstreamError::Status5xx,
                &format!("answered {status}"),
            );
        } else {
            self.health.proxied_ok();
        }
    }

    /// A call to the engine failed before a response: counted, judged, answered 502.
    fn unreachable(&self, what: &str, e: &reqwest::Error) -> Response {
        let detail = error_chain(e);
        self.upstream_failed(health::UpstreamError::of(e), &detail);
        bad_gateway(format!("{what}: {detail}"))
    }

    /// Refuse generation requests without `X-Request-Id` (`--require-request-id`) instead of
    /// reporting them unkeyed.
    #[must_use]
    pub fn with_request_id_required(mut self, required: bool) -> Self {
        self.require_request_id = required;
        self
    }

    /// The largest request body and the most requests at once (`--max-body-bytes`,
    /// `--max-concurrent-requests`).
    #[must_use]
    pub fn with_limits(mut self, max_body: usize, max_in_flight: usize) -> Self {
        self.max_body = max_body;
        self.max_in_flight = max_in_flight;
        self.in_flight = Arc::new(tokio::sync::Semaphore::new(max_in_flight));
        self
    }

    /// The most request-body bytes buffered at once across all requests
    /// (`--max-buffered-body-bytes`; at least the largest body), and how long one may take to
    /// arrive (`--body-timeout`).
    #[must_use]
    pub fn with_body_budget(mut self, max_buffered: usize, timeout: std::time::Duration) -> Self {
        let max_buffered = max_buffered.clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
        self.max_buffered = max_buffered;
        self.body_budget = Arc::new(tokio::sync::Semaphore::new(max_buffered));
        self.body_timeout = timeout;
        self
    }

    pub fn metrics(&self) -> &ShimMetrics {
        &self.metrics
    }

    pub fn sink(&self) -> &Arc<dyn ProgressSink> {
        &self.sink
    }
}

/// An error and its sources ("error sending request: ... Connection refused").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// The proxy's routes: everything goes through [`proxy`].
pub fn router(shim: Arc<Shim>) -> Router {
    Router::new().fallback(proxy).with_state(shim)
}

fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

fn forward_headers(from: &HeaderMap) -> HeaderMap {
    let mut h = HeaderMap::with_capacity(from.len());
    for (k, v) in from {
        if !hop_by_hop(k) {
            h.append(k.clone(), v.clone());
        }
    }
    h
}

/// A refusal in the OpenAI error shape, counted under `reason`.
fn refuse(shim: &Shim, status: StatusCode, reason: &str, msg: String) -> Response {
    shim.metrics.refused.with_label_values(&[reason]).inc();
    tracing::debug!(reason, %msg, "request refused");
    let body = serde_json::json!({
        "error": { "message": msg, "type": reason, "code": status.as_u16() }
    });
    (status, axum::Json(body)).into_response()
}

fn too_large(shim: &Shim) -> Response {
    refuse(
        shim,
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!(
            "the request body is larger than the shim's --max-body-bytes {}",
            shim.max_body
        ),
    )
}

/// A response body that holds a permit (a request in flight) until it ends or is dropped.
fn holding(
    permit: tokio::sync::OwnedSemaphorePermit,
    s: impl Stream<Item = Result<Bytes, reqwest::Error>> + Send + 'static,
) -> Body {
    use futures::StreamExt as _;
    Body::from_stream(s.map(move |c| {
        let _held = &permit;
        c
    }))
}

fn bad_gateway(msg: String) -> Response {
    let body = serde_json::json!({
        "object": "error",
        "message": msg,
        "type": "BadGateway",
        "code": 502,
    });
    (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
}

/// What the client asked for in `stream_options`, when the shim asked for more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Strip {
    /// The client did not ask for `include_usage`: drop `usage` everywhere and the final
    /// usage-only chunk.
    all_usage: bool,
}

/// The proxy handler.
pub async fn proxy(State(shim): State<Arc<Shim>>, req: Request) -> Response {
    let tracked = req.method() == Method::POST && GENERATION_PATHS.contains(&req.uri().path());
    let path_q = req
        .uri()
        .path_and_query()
        .map_or_else(|| req.uri().path().to_owned(), |p| p.as_str().to_owned());
    let url = format!("{}{}", shim.upstream, path_q);
    let Ok(permit) = Arc::clone(&shim.in_flight).try_acquire_owned() else {
        return refuse(
            &shim,
            StatusCode::SERVICE_UNAVAILABLE,
            "concurrency",
            format!(
                "the shim is proxying --max-concurrent-requests {} requests; retry",
                shim.max_in_flight
            ),
        );
    };
    // A declared length over the limit is refused before a byte is read.
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > shim.max_body as u64) {
        return too_large(&shim);
    }
    if tracked && let Some(refused) = require_request_id(&shim, req.headers()) {
        return refused;
    }
    let (parts, body) = req.into_parts();
    let mut headers = forward_headers(&parts.headers);
    shim.pin.apply_header(&mut headers);

    if !tracked {
        // Not inspected, so streamed through, but no longer than the limit either.
        let limited = http_body_util::Limited::new(body, shim.max_body);
        let body = reqwest::Body::wrap_stream(http_body_util::BodyDataStream::new(limited));
        return match shim
            .client
            .request(parts.method, &url)
            .headers(headers)
            .body(body)
            .send()
            .await
        {
            Ok(resp) => {
                shim.upstream_answered(resp.status());
                let mut out = Response::builder().status(resp.status());
                if let Some(h) = out.headers_mut() {
                    *h = forward_headers(resp.headers());
                }
                out.body(holding(permit, resp.bytes_stream()))
                    .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response())
            }
            Err(e) => shim.unreachable("upstream", &e),
        };
    }

    let (raw, _buffered) = match read_body(&shim, body, declared).await {
        Ok(read) => read,
        Err(refused) => return refused,
    };
    // Before `plan`: the body sent on, and the client's own if the engine refuses the usage
    // options, both carry the rank.
    let raw = shim.pin.apply_field(raw);
    let header_id = parts
        .headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
        .map(str::to_owned);

    let inject = shim.inject_usage && shim.engine_takes_usage.load(Ordering::Relaxed);
    let (out_body, stream, mut strip) = plan(&raw, inject);
    let mut track = Track::new(shim.clone(), header_id);

    let send = |body: Bytes| {
        shim.client
            .post(&url)
            .headers(headers.clone())
            .body(body)
            .send()
    };
    let mut resp = match send(out_body).await {
        Ok(r) => r,
        Err(e) => return shim.unreachable("upstream", &e),
    };
    if strip.is_some()
        && matches!(resp.status().as_u16(), 400 | 422)
        && resp.headers().get(header::CONTENT_TYPE).is_some()
    {
        // The engine refused the request we changed. If it accepts the client's own request,
        // it does not support per-chunk usage: count chunks from now on.
        match send(raw.clone()).await {
            Ok(r) if r.status().is_success() => {
                if shim.engine_takes_usage.swap(false, Ordering::Relaxed) {
                    tracing::warn!(
                        "the engine refuses stream_options; counting chunks instead of reading usage"
                    );
                }
                strip = None;
                resp = r;
            }
            Ok(r) => resp = r,
            Err(e) => return shim.unreachable("upstream", &e),
        }
    }
    let status = resp.status();
    shim.upstream_answered(status);
    let mut out = Response::builder().status(status);
    if let Some(h) = out.headers_mut() {
        *h = forward_headers(resp.headers());
    }
    let is_sse = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));

    if status.is_success() && stream && is_sse {
        let body = Tracked {
            _permit: permit,
            upstream: Box::pin(resp.bytes_stream()),
            splitter: sse::EventSplitter::default(),
            strip,
            held: None,
            track,
            done: false,
        };
        return out
            .body(Body::from_stream(body))
            .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response());
    }

    // Not streaming (or an error): one body; read its usage, forward it as it was.
    let bytes = match resp.bytes().await {
        Ok(b) => b,
        Err(e) => {
            let detail = error_chain(&e);
            shim.upstream_failed(health::UpstreamError::Body, &detail);
            return bad_gateway(format!("upstream body: {detail}"));
        }
    };
    if status.is_success()
        && let Some(info) = sse::peek(&bytes)
    {
        track.set_id(info.id.as_deref());
        if let Some(u) = info.usage {
            track.usage(u);
        }
    }
    track.finish();
    out.body(Body::from(bytes))
        .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response())
}

/// `--require-request-id`: a generation request without `X-Request-Id` cannot be matched to
/// its reservation by id, so in strict mode it is refused (400) before anything is forwarded.
fn require_request_id(shim: &Shim, headers: &HeaderMap) -> Option<Response> {
    let has_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|s| !s.is_empty());
    if !shim.require_request_id || has_id {
        return None;
    }
    Some(refuse(
        shim,
        StatusCode::BAD_REQUEST,
        "no_request_id",
        "this shim runs with --require-request-id: send the id given to Decision.Assign in the \
         X-Request-Id header"
            .to_owned(),
    ))
}

/// Reads a body to inspect within `--max-body-bytes` and `--body-timeout`, taking each byte
/// out of the shared `--max-buffered-body-bytes` budget as it arrives: a client that declares
/// a large body and sends little holds only what it sent. The permit is held as long as the
/// body is.
async fn read_body(
    shim: &Shim,
    mut body: Body,
    declared: Option<u64>,
) -> Result<(Bytes, Option<tokio::sync::OwnedSemaphorePermit>), Response> {
    use http_body_util::BodyExt as _;
    let deadline = tokio::time::Instant::now() + shim.body_timeout;
    // Declared lengths are checked against the limit before this; the pages of an unused
    // reservation are never touched.
    let mut buf = bytes::BytesMut::with_capacity(
        declared
            .map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX))
            .min(shim.max_body),
    );
    let mut held: Option<tokio::sync::OwnedSemaphorePermit> = None;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => {
                return Err(refuse(
                    shim,
                    StatusCode::REQUEST_TIMEOUT,
                    "body_timeout",
                    format!(
                        "the request body did not arrive within the shim's --body-timeout {:?}",
                        shim.body_timeout
                    ),
                ));
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return Err(
                    (StatusCode::BAD_REQUEST, format!("request body: {e}\n")).into_response()
                );
            }
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue; // trailers
        };
        if buf.len() + data.len() > shim.max_body {
            return Err(too_large(shim));
        }
        let Some(taken) = u32::try_from(data.len())
            .ok()
            .and_then(|n| Arc::clone(&shim.body_budget).try_acquire_many_owned(n).ok())
        else {
            return Err(refuse(
                shim,
                StatusCode::SERVICE_UNAVAILABLE,
                "body_budget",
                format!(
                    "the shim holds --max-buffered-body-bytes {} of request bodies; retry",
                    shim.max_buffered
                ),
            ));
        };
        match &mut held {
            Some(h) => h.merge(taken),
            None => held = Some(taken),
        }
        buf.extend_from_slice(&data);
    }
    Ok((buf.freeze(), held))
}

/// Decides what to send upstream: the original bytes, or the request with `stream_options`
/// asking for per-chunk usage, plus what to strip for the client.
///
/// Only the top level is parsed: every value stays the text it came as (a `RawValue` borrowed
/// from `raw`), so a large prompt or message list is neither built into a tree nor re-encoded.
/// The peak is the body plus the body sent on; a `serde_json::Value` tree of a 15 MB list of
/// messages took 22x the body (scripts/bench-shim-body.sh).
fn plan(raw: &Bytes, inject: bool) -> (Bytes, bool, Option<Strip>) {
    let Ok(mut top) = serde_json::from_slice::<BTreeMap<String, &RawValue>>(raw) else {
        return (raw.clone(), false, None);
    };
    let stream = top
        .get("stream")
        .and_then(|v| serde_json::from_str::<bool>(v.get()).ok())
        .unwrap_or(false);
    if !(stream && inject) {
        return (raw.clone(), stream, None);
    }
    let mut opts = match top.get("stream_options") {
        None => serde_json::Map::new(),
        Some(v) => match serde_json::from_str::<Value>(v.get()) {
            Ok(Value::Object(o)) => o,
            // stream_options of the wrong type: leave it for the engine to reject.
            _ => return (raw.clone(), stream, None),
        },
    };
    let flag = |o: &serde_json::Map<String, Value>, k: &str| {
        o.get(k).and_then(Value::as_bool).unwrap_or(false)
    };
    let include = flag(&opts, "include_usage");
    let continuous = include && flag(&opts, "continuous_usage_stats");
    if continuous {
        return (raw.clone(), stream, None);
    }
    opts.insert("include_usage".into(), Value::Bool(true));
    opts.insert("continuous_usage_stats".into(), Value::Bool(true));
    let Ok(opts) = serde_json::value::to_raw_value(&opts) else {
        return (raw.clone(), stream, None);
    };
    top.insert("stream_options".into(), &opts);
    // The body and a little more: no regrowth (and no transient second copy) while writing.
    let mut out = Vec::with_capacity(raw.len() + opts.get().len() + 64);
    match serde_json::to_writer(&mut out, &top) {
        Ok(()) => (
            Bytes::from(out),
            stream,
            Some(Strip {
                all_usage: !include,
            }),
        ),
        Err(_) => (raw.clone(), stream, None),
    }
}

/// One request's progress, reported as it changes; reports `finished` when dropped early
/// (the client went away or the engine failed).
struct Track {
    shim: Arc<Shim>,
    id: Option<String>,
    /// The id is the gateway's (`X-Request-Id`), not the engine's: reported keyed.
    keyed: bool,
    prompt: u32,
    generated: u32,
    chunks: u32,
    usage_seen: bool,
    finished: bool,
}

impl Track {
    fn new(shim: Arc<Shim>, id: Option<String>) -> Self {
        shim.metrics.requests.inc();
        shim.metrics.active.inc();
        let t = Track {
            shim,
            keyed: id.is_some(),
            id,
            prompt: 0,
            generated: 0,
            chunks: 0,
            usage_seen: false,
            finished: false,
        };
        // Known at once: σ sees the request active on this worker before its first token.
        t.report();
        t
    }

    fn set_id(&mut self, id: Option<&str>) {
        if self.id.is_none()
            && let Some(id) = id.filter(|s| !s.is_empty())
        {
            self.id = Some(id.to_owned());
        }
    }

    fn report(&self) {
        if let Some(id) = &self.id {
            let sink = &self.shim.sink;
            if self.keyed {
                sink.progress(id, self.prompt, self.generated, self.finished);
            } else {
                sink.progress_unkeyed(id, self.prompt, self.generated, self.finished);
            }
            self.shim.metrics.reports.inc();
        }
    }

    fn set_generated(&mut self, g: u32) {
        if g > self.generated {
            self.shim
                .metrics
                .tokens
                .inc_by(u64::from(g - self.generated));
            self.generated = g;
        }
    }

    fn usage(&mut self, u: sse::UsageInfo) {
        self.usage_seen = true;
        if u.prompt_tokens > 0 {
            self.prompt = u.prompt_tokens;
        }
        self.set_generated(u.completion_tokens);
    }

    /// Reads one SSE event's chunk.
    fn observe(&mut self, data: &[u8]) {
        let Some(info) = sse::peek(data) else {
            return;
        };
        let had_id = self.id.is_some();
        self.set_id(info.id.as_deref());
        let before = (self.prompt, self.generated);
        if info.choices > 0 {
            self.chunks = self.chunks.saturating_add(1);
        }
        match info.usage {
            Some(u) => self.usage(u),
            None if !self.usage_seen && info.choices > 0 => self.set_generated(self.chunks),
            None => {}
        }
        if !had_id || before != (self.prompt, self.generated) {
            self.report();
        }
    }

    fn finish(&mut self) {
        if !self.finished {
            self.finished = true;
            self.shim.metrics.active.dec();
            self.report();
        }
    }
}

impl Drop for Track {
    fn drop(&mut self) {
        if !self.finished {
            tracing::debug!(request_id = ?self.id, generated = self.generated,
                "request ended early (client gone or engine error)");
        }
        self.finish();
    }
}

/// The client's body: the engine's stream, observed and (if needed) trimmed.
struct Tracked {
    /// This request's place among `--max-concurrent-requests`, until the stream ends.
    _permit: tokio::sync::OwnedSemaphorePermit,
    upstream: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
    splitter: sse::EventSplitter,
    strip: Option<Strip>,
    /// With `Strip::all_usage`: the events from the first terminal chunk on, held until the
    /// usage-only chunk the shim drops. An engine asked for usage moves `system_fingerprint`
    /// from each terminal chunk to that last chunk (vLLM does), so the shim puts it back
    /// where the client, who did not ask for usage, would have found it. Each event is kept
    /// with whether it is a terminal chunk.
    held: Option<Vec<(Vec<u8>, bool)>>,
    track: Track,
    done: bool,
}

impl Tracked {
    /// Observes every complete event in `data`; returns what the client gets.
    fn process(&mut self, data: Bytes) -> Bytes {
        let events = self.splitter.push(&data);
        let Some(strip) = self.strip else {
            for ev in &events {
                if let Some(d) = sse::event_data(ev) {
                    self.track.observe(&d);
                }
            }
            return data;
        };
        let mut out = Vec::with_capacity(data.len());
        for ev in events {
            let info = sse::event_data(&ev).and_then(|d| {
                self.track.observe(&d);
                sse::peek(&d).map(|info| (d, info))
            });
            let Some((d, info)) = info else {
                // not a chunk (a comment, `[DONE]`): after any held event, in order
                match &mut self.held {
                    Some(held) => held.push((ev.to_vec(), false)),
                    None => out.extend_from_slice(&ev),
                }
                continue;
            };
            if info.choices == 0 {
                if strip.all_usage && info.usage.is_some() {
                    // the usage-only chunk the client did not ask for
                    let fingerprint = sse::member(&d, "system_fingerprint");
                    self.release_held(&mut out, fingerprint);
                    continue;
                }
                if !strip.all_usage {
                    out.extend_from_slice(&ev); // the final usage chunk the client asked for
                    continue;
                }
            }
            let trimmed = match sse::remove_member(&d, "usage") {
                Some(trimmed) => sse::replace_data(&ev, &trimmed),
                None => ev.to_vec(),
            };
            if strip.all_usage && (info.finishing || self.held.is_some()) {
                self.held
                    .get_or_insert_with(Vec::new)
                    .push((trimmed, info.finishing));
                continue;
            }
            out.extend_from_slice(&trimmed);
        }
        Bytes::from(out)
    }

    /// Appends the held events to `out`, each terminal chunk with `fingerprint` (raw JSON) as
    /// its last member.
    fn release_held(&mut self, out: &mut Vec<u8>, fingerprint: Option<&[u8]>) {
        for (ev, terminal) in self.held.take().unwrap_or_default() {
            let with = fingerprint.filter(|_| terminal).and_then(|fp| {
                let d = sse::event_data(&ev)?;
                let d = sse::append_member(&d, "system_fingerprint", fp)?;
                Some(sse::replace_data(&ev, &d))
            });
            out.extend_from_slice(with.as_deref().unwrap_or(&ev));
        }
    }
}

impl Stream for Tracked {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            match self.upstream.as_mut().poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(data))) => {
                    self.track.shim.health.engine_streamed();
                    let out = self.process(data);
                    if out.is_empty() {
                        continue;
                    }
                    return Poll::Ready(Some(Ok(out)));
                }
                Poll::Ready(Some(Err(e))) => {
                    self.done = true;
                    tracing::warn!(request_id = ?self.track.id, error = %e, "engine stream failed");
                    self.track
                        .shim
                        .upstream_failed(health::UpstreamError::Body, &error_chain(&e));
                    self.track.finish();
                    return Poll::Ready(Some(Err(std::io::Error::other(e))));
                }
                Poll::Ready(None) => {
                    self.done = true;
                    self.track.finish();
                    // held events whose usage chunk never came go on as they are
                    let mut out = Vec::new();
                    self.release_held(&mut out, None);
                    let rest = self.splitter.rest();
                    if self.strip.is_some() {
                        out.extend_from_slice(&rest);
                    }
                    if out.is_empty() {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Ok(Bytes::from(out))));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
