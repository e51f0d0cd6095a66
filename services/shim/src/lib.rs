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
//! - The engine's health (`health`): probes and the outcome of every proxied call decide
//!   whether the worker is in routing (its telemetry stream up) and `/readyz`.

mod app;
mod body;
mod builder;
mod config;
mod health;
mod metrics;
mod proxy;
mod rank_router;
mod ranks;
mod report;
mod sse;
mod stream;
mod topology;
mod track;

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
pub use builder::{Shim, ShimError};
pub use config::Args;
pub use metrics::ShimMetrics;
pub(crate) use proxy::proxy;
pub use report::{ProgressSink, RecordingSink, Report, ReporterSink};

pub(crate) use config::{
    DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_BUFFERED_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
};

/// The paths whose responses carry tokens.
pub(crate) const GENERATION_PATHS: [&str; 2] = ["/v1/completions", "/v1/chat/completions"];

/// An error and its sources ("error sending request: ... Connection refused").
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
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

/// A refusal in the OpenAI error shape, counted under `reason`.
pub(crate) fn refuse(shim: &Shim, status: StatusCode, reason: &str, msg: String) -> Response {
    shim.metrics.refused.with_label_values(&[reason]).inc();
    tracing::debug!(reason, %msg, "request refused");
    let body = serde_json::json!({
        "error": { "message": msg, "type": reason, "code": status.as_u16() }
    });
    (status, axum::Json(body)).into_response()
}

pub(crate) fn too_large(shim: &Shim) -> Response {
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

pub(crate) fn bad_gateway(msg: String) -> Response {
    let body = serde_json::json!({
        "object": "error",
        "message": msg,
        "type": "BadGateway",
        "code": 502,
    });
    (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
}

#[cfg(test)]
mod tests;
