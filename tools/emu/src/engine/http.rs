//! The OpenAI-compatible HTTP API of the emulated engine (the subset vLLM serves that a
//! gateway and the shim use): `/v1/completions`, `/v1/chat/completions` (SSE streaming and
//! not), `/v1/models`, `/health`, plus `/stats` (per-step loads) and `POST /stats/reset`.
//!
//! The port that serves every rank picks one as vLLM's API server (the `X-data-parallel-rank`
//! header) or SGLang's DP controller (the `routed_dp_rank` body field) would; each rank counts
//! the requests it ran (`/stats`'s `requests_per_rank`), so a test can tell which rank a request
//! ran on.
//!
//! Wire details follow vLLM: the response id is `cmpl-`/`chatcmpl-` plus the `X-Request-Id`
//! header when given; chunks are compact JSON without unset fields; `stream_options`
//! `include_usage` adds a final usage-only chunk (`choices: []`) and `continuous_usage_stats`
//! adds `usage` to every chunk; `ignore_eos` is always in effect (a request generates exactly
//! `max_tokens` tokens).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::watch;

use super::core::Progress;
use super::driver::{EngineHandle, SubmitError};

mod request;
mod response;
mod stats;

use request::{GenRequest, Kind, prompt_tokens};
use response::{full_response, stream_response};
pub use stats::Stats;
use stats::{stats, stats_reset};

/// The header vLLM's API server reads to pin a request to one DP rank.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";
/// The body field SGLang's DP controller reads to pin a request to one DP rank.
pub const DP_RANK_FIELD: &str = "routed_dp_rank";
/// What each token decodes to.
pub const TOKEN_TEXT: &str = " tok";

/// Settings of the HTTP API.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// The model name served (`/v1/models`, and echoed in responses).
    pub model: String,
    /// `created` of every response; the current time when `None` (tests fix it to compare
    /// bytes).
    pub created: Option<u64>,
    /// `max_tokens` when a request gives none.
    pub default_max_tokens: u32,
    pub ranks: usize,
    pub slots: usize,
    pub a_ms_per_token: f64,
    pub b_ms: f64,
    pub c_ms_per_request: f64,
    pub p_ms_per_prefill_token: f64,
    /// Colocated prefill's budget per rank per step (`None`: a decode tier).
    pub prefill_chunk: Option<u32>,
    pub time_scale: f64,
}

#[derive(Clone)]
struct AppState {
    engine: EngineHandle,
    cfg: Arc<ApiConfig>,
    /// The rank this port serves, or `None` for the port that honours `X-data-parallel-rank`.
    rank: Option<usize>,
    rr: Arc<AtomicUsize>,
    ids: Arc<AtomicUsize>,
    /// Requests each rank accepted, since start.
    per_rank: Arc<Vec<AtomicU64>>,
}

/// The routes of one port: `rank = Some(g)` for rank g's own port, `None` for the DP port.
pub fn router(engine: EngineHandle, cfg: Arc<ApiConfig>, rank: Option<usize>) -> Router {
    let per_rank = Arc::new((0..engine.ranks()).map(|_| AtomicU64::new(0)).collect());
    router_shared(engine, cfg, rank, Arc::default(), Arc::default(), per_rank)
}

pub(crate) fn router_shared(
    engine: EngineHandle,
    cfg: Arc<ApiConfig>,
    rank: Option<usize>,
    rr: Arc<AtomicUsize>,
    ids: Arc<AtomicUsize>,
    per_rank: Arc<Vec<AtomicU64>>,
) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/stats", get(stats))
        .route("/stats/reset", post(stats_reset))
        .with_state(AppState {
            engine,
            cfg,
            rank,
            rr,
            ids,
            per_rank,
        })
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    let body = serde_json::json!({
        "object": "error",
        "message": msg.into(),
        "type": "BadRequestError",
        "param": null,
        "code": status.as_u16(),
    });
    (status, axum::Json(body)).into_response()
}

async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    generate(s, headers, body, Kind::Completion).await
}

async fn chat_completions(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    generate(s, headers, body, Kind::Chat).await
}

fn pick_rank(s: &AppState, headers: &HeaderMap, field: Option<i64>) -> Result<usize, String> {
    if let Some(r) = s.rank {
        return Ok(r);
    }
    let ranks = s.engine.ranks();
    let header = match headers.get(DP_RANK_HEADER) {
        Some(v) => {
            let parsed = v.to_str().ok().and_then(|t| t.trim().parse::<usize>().ok());
            match parsed {
                Some(r) if r < ranks => Some(r),
                _ => return Err(format!("{DP_RANK_HEADER} must be a rank in 0..{ranks}")),
            }
        }
        None => None,
    };
    let field = match field {
        Some(r) => match usize::try_from(r) {
            Ok(r) if r < ranks => Some(r),
            _ => return Err(format!("{DP_RANK_FIELD} must be a rank in 0..{ranks}")),
        },
        None => None,
    };
    match (header, field) {
        // Two pins that disagree: a proxy set one and forgot the other; say so.
        (Some(h), Some(f)) if h != f => Err(format!(
            "{DP_RANK_HEADER} {h} and {DP_RANK_FIELD} {f} name different ranks"
        )),
        (Some(r), _) | (None, Some(r)) => Ok(r),
        (None, None) => Ok(s.rr.fetch_add(1, Ordering::Relaxed) % ranks.max(1)),
    }
}

struct Gen {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    prompt: u32,
    max_tokens: u32,
    include_usage: bool,
    continuous: bool,
}

async fn generate(s: AppState, headers: HeaderMap, body: Bytes, kind: Kind) -> Response {
    let req: GenRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid request: {e}")),
    };
    if kind == Kind::Chat && req.messages.is_none() {
        return error(StatusCode::BAD_REQUEST, "messages is required");
    }
    if kind == Kind::Completion && req.prompt.is_none() {
        return error(StatusCode::BAD_REQUEST, "prompt is required");
    }
    if req.n.unwrap_or(1) != 1 {
        return error(StatusCode::BAD_REQUEST, "the emulator supports n = 1 only");
    }
    let stream = req.stream.unwrap_or(false);
    if !stream && req.stream_options.is_some() {
        // As vLLM: stream_options only with stream = true.
        return error(
            StatusCode::BAD_REQUEST,
            "Stream options can only be defined when `stream=True`.",
        );
    }
    if let Some(m) = &req.model
        && m != &s.cfg.model
    {
        return error(
            StatusCode::NOT_FOUND,
            format!("The model `{m}` does not exist."),
        );
    }
    let rank = match pick_rank(&s, &headers, req.routed_dp_rank) {
        Ok(r) => r,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    let base_id = match headers.get("x-request-id").and_then(|v| v.to_str().ok()) {
        Some(id) if !id.is_empty() => id.to_owned(),
        _ => format!("emu{:016x}", s.ids.fetch_add(1, Ordering::Relaxed)),
    };
    let prompt = prompt_tokens(&req);
    let opts = req.stream_options.unwrap_or_default();
    let g = Gen {
        kind,
        id: format!("{}{}", kind.id_prefix(), base_id),
        created: s.cfg.created.unwrap_or_else(now_secs),
        model: s.cfg.model.clone(),
        prompt,
        max_tokens: req
            .max_completion_tokens
            .or(req.max_tokens)
            .unwrap_or(s.cfg.default_max_tokens)
            .max(1),
        include_usage: opts.include_usage.unwrap_or(false),
        continuous: opts.include_usage.unwrap_or(false)
            && opts.continuous_usage_stats.unwrap_or(false),
    };
    let rx = match s.engine.submit(rank, g.prompt, g.max_tokens).await {
        Ok(rx) => {
            if let Some(n) = s.per_rank.get(rank) {
                n.fetch_add(1, Ordering::Relaxed);
            }
            rx
        }
        Err(e @ SubmitError::NoSuchRank(..)) => {
            return error(StatusCode::BAD_REQUEST, e.to_string());
        }
        Err(e @ SubmitError::Closed) => {
            return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string());
        }
    };
    if stream {
        stream_response(g, rx)
    } else {
        full_response(g, rx).await
    }
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(s): State<AppState>) -> Response {
    let body = serde_json::json!({
        "object": "list",
        "data": [{
            "id": s.cfg.model,
            "object": "model",
            "created": s.cfg.created.unwrap_or_else(now_secs),
            "owned_by": "br-emu",
            "root": s.cfg.model,
            "parent": null,
        }],
    });
    axum::Json(body).into_response()
}

async fn health() -> StatusCode {
    StatusCode::OK
}

/// The addresses a running engine serves.
#[derive(Debug, Clone)]
pub struct EngineAddrs {
    /// Rank g's own port.
    pub ranks: Vec<SocketAddr>,
    /// The port that honours `X-data-parallel-rank`.
    pub dp: SocketAddr,
}
