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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

impl Kind {
    fn id_prefix(self) -> &'static str {
        match self {
            Kind::Completion => "cmpl-",
            Kind::Chat => "chatcmpl-",
        }
    }
    fn chunk_object(self) -> &'static str {
        match self {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        }
    }
    fn object(self) -> &'static str {
        match self {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion",
        }
    }
}

#[derive(Debug, Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
    #[serde(default)]
    continuous_usage_stats: Option<bool>,
}

/// The request fields the emulator reads (others are accepted and ignored).
#[derive(Debug, Deserialize)]
struct GenRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    messages: Option<Vec<Value>>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    /// Emulator extension: the prompt's token count, when the prompt text is a stand-in.
    #[serde(default)]
    prompt_tokens: Option<u32>,
    #[serde(default)]
    n: Option<u32>,
    /// SGLang's DP rank pin (honoured on the port that serves every rank).
    #[serde(default)]
    routed_dp_rank: Option<i64>,
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

/// Rough token count of a text (about 4 characters a token, at least 1).
fn text_tokens(s: &str) -> u32 {
    (s.chars().count().div_ceil(4)).max(1) as u32
}

fn prompt_tokens(req: &GenRequest) -> u32 {
    if let Some(n) = req.prompt_tokens {
        return n.max(1);
    }
    if let Some(p) = &req.prompt {
        return match p {
            Value::String(s) => text_tokens(s),
            // A list of token ids, or a list of prompts (the first one counts: n = 1).
            Value::Array(items) => match items.first() {
                Some(Value::Number(_)) => items.len().max(1) as u32,
                Some(Value::String(s)) => text_tokens(s),
                Some(Value::Array(ids)) => ids.len().max(1) as u32,
                _ => 1,
            },
            _ => 1,
        };
    }
    if let Some(msgs) = &req.messages {
        let mut n = 0u32;
        for m in msgs {
            n = n.saturating_add(4);
            match m.get("content") {
                Some(Value::String(s)) => n = n.saturating_add(text_tokens(s)),
                Some(Value::Array(parts)) => {
                    for p in parts {
                        if let Some(Value::String(t)) = p.get("text") {
                            n = n.saturating_add(text_tokens(t));
                        }
                    }
                }
                _ => {}
            }
        }
        return n.max(1);
    }
    1
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

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u32,
    total_tokens: u32,
    completion_tokens: u32,
}

#[derive(Serialize)]
struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    content: &'static str,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Choice {
    Chat {
        index: u32,
        delta: Delta,
        logprobs: Option<()>,
        finish_reason: Option<&'static str>,
    },
    Text {
        index: u32,
        text: &'static str,
        logprobs: Option<()>,
        finish_reason: Option<&'static str>,
        stop_reason: Option<()>,
    },
}

#[derive(Serialize)]
struct Chunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<Choice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

impl Gen {
    fn usage(&self, generated: u32) -> Usage {
        Usage {
            prompt_tokens: self.prompt,
            total_tokens: self.prompt.saturating_add(generated),
            completion_tokens: generated,
        }
    }

    fn event(&self, out: &mut Vec<u8>, choices: Vec<Choice>, usage: Option<Usage>) {
        let chunk = Chunk {
            id: &self.id,
            object: self.kind.chunk_object(),
            created: self.created,
            model: &self.model,
            choices,
            usage,
        };
        out.extend_from_slice(b"data: ");
        // Serialising these plain structs cannot fail.
        let _ = serde_json::to_writer(&mut *out, &chunk);
        out.extend_from_slice(b"\n\n");
    }

    /// The SSE events for tokens `from+1 ..= to` (and the role chunk first, for chat).
    fn token_events(&self, out: &mut Vec<u8>, from: u32, to: u32) {
        if from == 0 && to > 0 && self.kind == Kind::Chat {
            let usage = self.continuous.then(|| self.usage(0));
            self.event(
                out,
                vec![Choice::Chat {
                    index: 0,
                    delta: Delta {
                        role: Some("assistant"),
                        content: "",
                    },
                    logprobs: None,
                    finish_reason: None,
                }],
                usage,
            );
        }
        for k in from + 1..=to {
            let finish = (k >= self.max_tokens).then_some("length");
            let choice = match self.kind {
                Kind::Chat => Choice::Chat {
                    index: 0,
                    delta: Delta {
                        role: None,
                        content: TOKEN_TEXT,
                    },
                    logprobs: None,
                    finish_reason: finish,
                },
                Kind::Completion => Choice::Text {
                    index: 0,
                    text: TOKEN_TEXT,
                    logprobs: None,
                    finish_reason: finish,
                    stop_reason: None,
                },
            };
            let usage = self.continuous.then(|| self.usage(k));
            self.event(out, vec![choice], usage);
        }
    }

    fn final_events(&self, out: &mut Vec<u8>, generated: u32) {
        if self.include_usage {
            self.event(out, Vec::new(), Some(self.usage(generated)));
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
    }
}

struct StreamState {
    g: Gen,
    rx: watch::Receiver<Progress>,
    sent: u32,
    finished: bool,
}

fn stream_response(g: Gen, rx: watch::Receiver<Progress>) -> Response {
    let state = StreamState {
        g,
        rx,
        sent: 0,
        finished: false,
    };
    let body = futures::stream::unfold(state, |mut st| async move {
        if st.finished {
            return None;
        }
        loop {
            // The engine task went away: end the stream (the client sees it cut short).
            if st.rx.changed().await.is_err() {
                return None;
            }
            let p = *st.rx.borrow_and_update();
            if p.generated <= st.sent && !p.done {
                continue;
            }
            let mut out = Vec::with_capacity(256);
            st.g.token_events(&mut out, st.sent, p.generated);
            st.sent = p.generated;
            if p.done {
                st.g.final_events(&mut out, p.generated);
                st.finished = true;
            }
            return Some((Ok::<_, std::convert::Infallible>(Bytes::from(out)), st));
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

#[derive(Serialize)]
struct Message {
    role: &'static str,
    content: String,
}

#[derive(Serialize)]
#[serde(untagged)]
enum FullChoice {
    Chat {
        index: u32,
        message: Message,
        logprobs: Option<()>,
        finish_reason: &'static str,
    },
    Text {
        index: u32,
        text: String,
        logprobs: Option<()>,
        finish_reason: &'static str,
        stop_reason: Option<()>,
    },
}

#[derive(Serialize)]
struct Full<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<FullChoice>,
    usage: Usage,
}

async fn full_response(g: Gen, mut rx: watch::Receiver<Progress>) -> Response {
    let generated = loop {
        let p = *rx.borrow_and_update();
        if p.done {
            break p.generated;
        }
        if rx.changed().await.is_err() {
            return error(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped");
        }
    };
    let text = TOKEN_TEXT.repeat(generated as usize);
    let choice = match g.kind {
        Kind::Chat => FullChoice::Chat {
            index: 0,
            message: Message {
                role: "assistant",
                content: text,
            },
            logprobs: None,
            finish_reason: "length",
        },
        Kind::Completion => FullChoice::Text {
            index: 0,
            text,
            logprobs: None,
            finish_reason: "length",
            stop_reason: None,
        },
    };
    let full = Full {
        id: &g.id,
        object: g.kind.object(),
        created: g.created,
        model: &g.model,
        choices: vec![choice],
        usage: g.usage(generated),
    };
    match serde_json::to_vec(&full) {
        Ok(v) => ([(header::CONTENT_TYPE, "application/json")], Bytes::from(v)).into_response(),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
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

#[derive(Debug, Deserialize)]
struct StatsQuery {
    /// Only steps from this index on.
    #[serde(default)]
    since: Option<u64>,
    /// Include the per-rank loads of every step.
    #[serde(default)]
    loads: Option<bool>,
}

/// `GET /stats`: the engine's configuration and its per-step loads.
#[derive(Debug, Serialize, Deserialize, Clone, Default)]
pub struct Stats {
    pub ranks: usize,
    pub slots: usize,
    pub a_ms_per_token: f64,
    pub b_ms: f64,
    /// c: ms per running request on the busiest rank (0 for the two-term model).
    #[serde(default)]
    pub c_ms_per_request: f64,
    pub time_scale: f64,
    /// Index of the first step listed.
    pub first_step: u64,
    /// Steps listed.
    pub steps: usize,
    pub max_load: Vec<u64>,
    pub min_load: Vec<u64>,
    pub sum_load: Vec<u64>,
    /// The most running requests on one rank per step (with `max_load` and a step time, a
    /// `br-sim calibrate` sample).
    #[serde(default)]
    pub max_running: Vec<u32>,
    /// Model step time a·max L + c·max n + b per step, ms.
    pub model_ms: Vec<f64>,
    /// Wall-clock step time per step, ms.
    pub wall_ms: Vec<f64>,
    /// Per step, each rank's load (only with `?loads=true`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loads: Vec<Vec<u64>>,
    /// Requests each rank accepted since start (or the last reset), whichever port they came
    /// through.
    #[serde(default)]
    pub requests_per_rank: Vec<u64>,
}

impl Stats {
    /// The paper's imbalance metric: mean over steps of max_g L_g − min_g L_g (KV tokens).
    pub fn mean_max_minus_min(&self) -> f64 {
        if self.steps == 0 {
            return 0.0;
        }
        let s: u64 = self
            .max_load
            .iter()
            .zip(&self.min_load)
            .map(|(a, b)| a - b)
            .sum();
        s as f64 / self.steps as f64
    }

    /// Mean of I(k) = G·max L − Σ L (idle token-slots at the barrier).
    pub fn mean_idle_tokens(&self) -> f64 {
        if self.steps == 0 {
            return 0.0;
        }
        let g = self.ranks as u64;
        let s: u64 = self
            .max_load
            .iter()
            .zip(&self.sum_load)
            .map(|(m, sum)| g * m - sum)
            .sum();
        s as f64 / self.steps as f64
    }

    /// Mean model step time, ms.
    pub fn mean_model_ms(&self) -> f64 {
        if self.steps == 0 {
            return 0.0;
        }
        self.model_ms.iter().sum::<f64>() / self.steps as f64
    }
}

async fn stats(State(s): State<AppState>, Query(q): Query<StatsQuery>) -> Response {
    let ranks = s.engine.ranks();
    let out = s.engine.with_stats(|log| {
        let skip = q
            .since
            .map_or(0, |k| k.saturating_sub(log.first_step) as usize)
            .min(log.steps());
        let loads = if q.loads.unwrap_or(false) {
            log.loads[skip * ranks..]
                .chunks(ranks.max(1))
                .map(<[u64]>::to_vec)
                .collect()
        } else {
            Vec::new()
        };
        Stats {
            ranks,
            slots: s.cfg.slots,
            a_ms_per_token: s.cfg.a_ms_per_token,
            b_ms: s.cfg.b_ms,
            c_ms_per_request: s.cfg.c_ms_per_request,
            time_scale: s.cfg.time_scale,
            first_step: log.first_step + skip as u64,
            steps: log.steps() - skip,
            max_load: log.max_load[skip..].to_vec(),
            min_load: log.min_load[skip..].to_vec(),
            sum_load: log.sum_load[skip..].to_vec(),
            max_running: log.max_running[skip..].to_vec(),
            model_ms: log.model_ms[skip..].to_vec(),
            wall_ms: log.wall_ms[skip..].to_vec(),
            loads,
            requests_per_rank: s
                .per_rank
                .iter()
                .map(|n| n.load(Ordering::Relaxed))
                .collect(),
        }
    });
    axum::Json(out).into_response()
}

async fn stats_reset(State(s): State<AppState>) -> StatusCode {
    s.engine.with_stats(|log| log.reset());
    for n in s.per_rank.iter() {
        n.store(0, Ordering::Relaxed);
    }
    StatusCode::NO_CONTENT
}

/// The addresses a running engine serves.
#[derive(Debug, Clone)]
pub struct EngineAddrs {
    /// Rank g's own port.
    pub ranks: Vec<SocketAddr>,
    /// The port that honours `X-data-parallel-rank`.
    pub dp: SocketAddr,
}
