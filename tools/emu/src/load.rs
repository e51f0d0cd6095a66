//! `br-emu load`: a minimal gateway. It replays a workload (br-sim's trace loaders and
//! synthetic generators), asks BalanceRoute's decision service for each request's rank
//! (`Assign`), sends the request to that rank (through its shim) as an OpenAI streaming
//! completion with the trace's output length as `max_tokens` (`ignore_eos`), and records TTFT,
//! TPOT and throughput; it reads the engine's per-step loads from `GET /stats` for imbalance
//! and the balance ratio.
//!
//! Arrival times (`--arrival trace|poisson`, `--rate`) are model time, as in br-sim: with
//! `--engine-url` they are multiplied by the engine's time scale. Times are reported in model
//! ms (wall / the engine's time scale), the unit br-sim uses, so the two compare directly.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use br_client::assign::{AssignClient, AssignParams};
use br_core::stats::quantile;
use br_sim::cli::{Arrival, resolve_arrival, stamp_arrivals};
use br_sim::synth::{self, SynthConfig, SynthKind};
use br_sim::trace::{self, Filter, TraceRequest};
use bytes::Bytes;
use eventsource_stream::{Event, EventStreamError, Eventsource as _};
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::engine::Stats;

mod progress;
mod request;
mod table;

use progress::Progress;
use request::one;
pub use table::{Moments, TwinBand, table};

/// What to replay and where.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// The decision service's replicas (one or more URLs; a DNS name stands for every address
    /// it resolves to).
    pub decision_addrs: Vec<String>,
    /// Which replica an `Assign` goes to first (the others take over when it fails).
    pub selection: br_client::assign::Selection,
    /// Mutual TLS to the decision service (a gateway certificate), when configured.
    pub tls: Option<std::sync::Arc<br_trust::TlsMaterial>>,
    pub group: String,
    /// Rank g's base URL (its shim) at index g.
    pub rank_urls: Vec<String>,
    /// Send to the endpoint the worker announced (when not empty) instead of `rank_urls`.
    pub use_endpoint: bool,
    /// The engine's URL for `/stats` (any of its ports).
    pub engine_url: Option<String>,
    /// A trace file, or `paper-azure` / `paper-prop`.
    pub trace: String,
    pub limit: Option<usize>,
    pub filter_min_output: Option<u32>,
    pub seed: u64,
    /// Clients' expected output lengths to send with each Assign (`None`: none).
    pub hints: Option<br_sim::hints::Hints>,
    /// Classes to give the requests, whose keys each Assign carries (`None`: the trace's own,
    /// if it has any).
    pub classes: Option<br_sim::classes::Classes>,
    pub arrival: Arrival,
    pub rate: Option<f64>,
    pub rate_scale: f64,
    /// The model name in requests.
    pub model: String,
    /// Longest wait for `Assign` (pool wait included).
    pub assign_timeout: Duration,
    /// A label for the summary (e.g. the decision policy).
    pub label: String,
    /// A prefix for request ids (unique per run).
    pub run_id: String,
}

/// One request's outcome.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RequestResult {
    pub request_id: String,
    pub worker_id: Option<u32>,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub generated: u32,
    /// Arrival to Assign answered, wall ms.
    pub assign_ms: f64,
    /// Model ms from the run's start to when the decision service took the request into its
    /// pool (the answer's time less its `pool_wait`): the arrival the decision saw, which the
    /// twin replays (`--arrivals-csv`). Not when this tool called: a call can wait at the
    /// client for an HTTP/2 stream, and a burst reaches the decision over time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrival_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_hash: Option<u64>,
    /// The expected output length the Assign carried (after the cap at max_tokens), if any:
    /// what the decision saw, which the twin replays (`--arrivals-csv`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_output: Option<u32>,
    /// The class key the Assign carried (`request_class`), if any: replayed by the twin too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_class: Option<String>,
    /// Arrival to first token, wall ms.
    pub ttft_ms: Option<f64>,
    /// Mean time between tokens after the first, wall ms.
    pub tpot_ms: Option<f64>,
    /// Arrival to last token, wall ms.
    pub e2e_ms: Option<f64>,
    pub error: Option<String>,
}

/// Percentiles of one metric: exact, by br-core's nearest-rank definition, the one br-sim's
/// report uses, because these are printed beside br-sim's prediction and must be the same
/// statistic (a histogram's quantisation would show up as a disagreement).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct Pct {
    pub p50: f64,
    pub p95: f64,
    pub mean: f64,
}

impl Pct {
    pub fn of(mut v: Vec<f64>) -> Pct {
        if v.is_empty() {
            return Pct::default();
        }
        Pct {
            p50: quantile(&mut v, 0.50),
            p95: quantile(&mut v, 0.95),
            mean: v.iter().sum::<f64>() / v.len() as f64,
        }
    }

    fn scaled(self, k: f64) -> Pct {
        Pct {
            p50: self.p50 * k,
            p95: self.p95 * k,
            mean: self.mean * k,
        }
    }
}

/// The summary of one run (`--json`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Summary {
    pub label: String,
    /// The policy the decision service named in its answers.
    pub policy: String,
    pub workload: String,
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    /// The engine's time scale (wall = model × scale); 1 if unknown.
    pub time_scale: f64,
    pub wall_s: f64,
    /// Output tokens received.
    pub tokens: u64,
    /// Output tokens per second of model time (wall time / time scale).
    pub throughput_tok_s: f64,
    pub throughput_tok_s_wall: f64,
    /// Model ms.
    pub ttft_ms: Pct,
    /// Model ms.
    pub tpot_ms: Pct,
    /// Model ms from arrival to the Assign answer (pool wait).
    pub assign_ms: Pct,
    /// Mean over engine steps of max_g L_g − min_g L_g (KV tokens), the paper's metric.
    pub imbalance_tokens: Option<f64>,
    /// Mean over steps of G·max L − Σ L.
    pub idle_tokens: Option<f64>,
    /// Mean over engine steps of the balance ratio `Σ_g work_g / (G · max_g work_g)`, a rank's
    /// work its share of the step time `a·L_g + p·P_g + c·n_g` (br-sim's `avg_balance`, its
    /// `balance%`; 1 = no rank waits at the barrier).
    #[serde(default)]
    pub balance_ratio: Option<f64>,
    pub steps: Option<usize>,
    /// Mean model step time, ms.
    pub mean_step_ms: Option<f64>,
    /// Requests per rank.
    pub per_rank: Vec<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub results: Vec<RequestResult>,
}

/// Why the run could not start.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("workload: {0}")]
    Workload(String),
    #[error("decision service: {0}")]
    Assign(#[from] br_client::assign::AssignError),
    #[error("http: {0}")]
    Http(#[from] reqwest::Error),
    #[error("{0}")]
    Invalid(String),
}

/// Loads or generates the workload with br-sim's loaders and stamps arrival times.
pub fn workload(cfg: &LoadConfig) -> Result<(String, Vec<TraceRequest>), LoadError> {
    let filter = Filter {
        min_output: cfg.filter_min_output,
        limit: cfg.limit,
    };
    let (name, reqs) = if let Some(kind) = SynthKind::from_name(&cfg.trace) {
        let mut sc = SynthConfig::new(kind);
        sc.seed = cfg.seed;
        // The published count, cut by `limit` below: the same requests `br-sim --limit N`
        // simulates. A longer run (a soak) asks for more: the generator goes on with the same
        // stream, so the first ones are still the published workload's.
        if let Some(l) = cfg.limit {
            sc.requests = sc.requests.max(l);
        }
        if let Some(r) = cfg.rate {
            sc.rate_per_s = r;
        }
        let (reqs, _) = filter.apply(synth::generate(kind, &sc));
        (format!("{} (synthetic)", kind.name()), reqs)
    } else {
        let path = PathBuf::from(&cfg.trace);
        let t = trace::load(&path, &filter).map_err(|e| LoadError::Workload(e.to_string()))?;
        (cfg.trace.clone(), t.requests)
    };
    if reqs.is_empty() {
        return Err(LoadError::Workload(format!("{name}: no requests")));
    }
    let mut reqs = reqs;
    if let Some(h) = &cfg.hints {
        h.apply(&mut reqs, cfg.seed);
    }
    let synthetic = SynthKind::from_name(&cfg.trace).is_some();
    let (arrival, _) = resolve_arrival(cfg.arrival, synthetic, &reqs);
    let mut reqs = stamp_arrivals(reqs, arrival, cfg.rate_scale, cfg.rate, cfg.seed)
        .map_err(LoadError::Workload)?;
    // After the arrivals are stamped and ordered, as br-sim makes them: the same flags and
    // seed give each request the class the twin gives it.
    if let Some(c) = &cfg.classes {
        // As br-sim: made classes do not replace the ones a trace records.
        let own = reqs.iter().filter(|r| r.class.is_some()).count();
        if own > 0 {
            return Err(LoadError::Workload(format!(
                "{name}: {own} requests carry their own class (`{}`); --classes would replace them",
                trace::CLASS_COLUMN
            )));
        }
        c.apply(&mut reqs, cfg.seed);
    }
    Ok((name, reqs))
}

struct Ctx {
    cfg: LoadConfig,
    assign: AssignClient,
    http: reqwest::Client,
    start: Instant,
    /// Wall seconds per model second.
    time_scale: f64,
}

/// Runs the whole workload and summarises it.
pub async fn run(cfg: LoadConfig) -> Result<Summary, LoadError> {
    if cfg.rank_urls.is_empty() && !cfg.use_endpoint {
        return Err(LoadError::Invalid(
            "give --rank-urls (one URL per rank) or --use-endpoint".into(),
        ));
    }
    let (name, reqs) = workload(&cfg)?;
    let http = reqwest::Client::builder()
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(5))
        .build()?;
    // Arrival times are model time, as in br-sim: with an engine, wall = model × its scale.
    let mut time_scale = 1.0;
    if let Some(e) = &cfg.engine_url {
        let e = e.trim_end_matches('/');
        let st: Stats = http
            .get(format!("{e}/stats?since={}", u64::MAX))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        if st.time_scale.is_finite() && st.time_scale > 0.0 {
            time_scale = st.time_scale;
        }
        http.post(format!("{e}/stats/reset"))
            .send()
            .await?
            .error_for_status()?;
    }
    // UNAVAILABLE (e.g. an on-arrival policy while σ shows every worker full) is retried
    // with the same request id until the deadline (the default retry policy).
    let options = br_client::assign::ClientOptions {
        selection: cfg.selection,
        ..Default::default()
    };
    let assign = AssignClient::with_options(cfg.decision_addrs.clone(), cfg.tls.as_ref(), options)?;
    let ctx = Arc::new(Ctx {
        cfg: cfg.clone(),
        assign,
        http: http.clone(),
        start: Instant::now(),
        time_scale,
    });
    let progress = Progress::start(reqs.len());
    let mut tasks = Vec::with_capacity(reqs.len());
    for (i, r) in reqs.iter().enumerate() {
        let ctx = ctx.clone();
        let r = r.clone();
        let progress = progress.clone();
        tasks.push(tokio::spawn(async move {
            let out = one(ctx, i, r).await;
            progress.record(&out.0);
            out
        }));
    }
    let mut results = Vec::with_capacity(tasks.len());
    let mut policy = String::new();
    for t in tasks {
        match t.await {
            Ok((res, p)) => {
                if policy.is_empty()
                    && let Some(p) = p
                {
                    policy = p;
                }
                results.push(res);
            }
            Err(e) => results.push(RequestResult {
                error: Some(format!("task: {e}")),
                ..RequestResult::default()
            }),
        }
    }
    progress.finish();
    let wall = ctx.start.elapsed().as_secs_f64();
    let stats = match &cfg.engine_url {
        Some(e) => Some(
            http.get(format!("{}/stats", e.trim_end_matches('/')))
                .send()
                .await?
                .error_for_status()?
                .json::<Stats>()
                .await?,
        ),
        None => None,
    };
    Ok(summarise(&cfg, name, policy, wall, results, stats.as_ref()))
}

fn summarise(
    cfg: &LoadConfig,
    workload: String,
    policy: String,
    wall_s: f64,
    results: Vec<RequestResult>,
    stats: Option<&Stats>,
) -> Summary {
    let scale = stats
        .map(|s| s.time_scale)
        .filter(|s| *s > 0.0)
        .unwrap_or(1.0);
    let to_model = 1.0 / scale;
    let ok: Vec<&RequestResult> = results.iter().filter(|r| r.error.is_none()).collect();
    let tokens: u64 = results.iter().map(|r| u64::from(r.generated)).sum();
    let ranks = cfg.rank_urls.len().max(
        results
            .iter()
            .filter_map(|r| r.worker_id)
            .max()
            .map_or(0, |w| w as usize + 1),
    );
    let mut per_rank = vec![0u64; ranks];
    for r in &results {
        if let Some(w) = r.worker_id {
            per_rank[w as usize] += 1;
        }
    }
    Summary {
        label: cfg.label.clone(),
        policy,
        workload,
        requests: results.len(),
        completed: ok.len(),
        failed: results.len() - ok.len(),
        time_scale: scale,
        wall_s,
        tokens,
        throughput_tok_s: tokens as f64 / (wall_s * to_model).max(1e-9),
        throughput_tok_s_wall: tokens as f64 / wall_s.max(1e-9),
        ttft_ms: Pct::of(ok.iter().filter_map(|r| r.ttft_ms).collect()).scaled(to_model),
        tpot_ms: Pct::of(ok.iter().filter_map(|r| r.tpot_ms).collect()).scaled(to_model),
        assign_ms: Pct::of(ok.iter().map(|r| r.assign_ms).collect()).scaled(to_model),
        imbalance_tokens: stats.map(Stats::mean_max_minus_min),
        idle_tokens: stats.map(Stats::mean_idle_tokens),
        balance_ratio: stats.and_then(Stats::mean_balance),
        steps: stats.map(|s| s.steps),
        mean_step_ms: stats.map(Stats::mean_model_ms),
        per_rank,
        results,
    }
}

/// The run's requests as the arrivals the decision service saw, in br-sim's generic CSV
/// (`arrival_ms,prompt_tokens,output_tokens,prompt_hash,expected_output_tokens`, model ms, in
/// arrival order), for `br-sim run --trace FILE --arrival trace`: the twin then sees the same
/// arrival process as the live run, not an idealised one (a saturated burst all in the pool at
/// time 0, which the live decision never sees), and the same hints (empty where none was sent),
/// so a policy that reads them (`brh-hinted`, the stagger term) decides on the same input.
/// When any Assign carried a class, a `request_class` column holds each request's key (empty
/// where none was sent), for the same reason. A request that was never assigned has no arrival
/// and is left out.
pub fn arrivals_csv(results: &[RequestResult]) -> String {
    let mut rows: Vec<&RequestResult> = results.iter().filter(|r| r.arrival_ms.is_some()).collect();
    rows.sort_by(|a, b| {
        a.arrival_ms
            .partial_cmp(&b.arrival_ms)
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    // Without classes the file is what it was before the column existed.
    let classes = rows.iter().any(|r| r.request_class.is_some());
    let mut out = format!(
        "arrival_ms,prompt_tokens,output_tokens,prompt_hash,{}{}\n",
        trace::EXPECTED_OUTPUT_COLUMN,
        if classes {
            format!(",{}", trace::CLASS_COLUMN)
        } else {
            String::new()
        }
    );
    for r in rows {
        let hash = r.prompt_hash.map(|h| h.to_string()).unwrap_or_default();
        let hint = r.expected_output.map(|e| e.to_string()).unwrap_or_default();
        out.push_str(&format!(
            "{:.3},{},{},{hash},{hint}",
            r.arrival_ms.unwrap_or(0.0),
            r.prompt_tokens,
            r.output_tokens
        ));
        if classes {
            // A key is printable ASCII without spaces, but may hold a comma or a quote.
            out.push(',');
            out.push_str(&csv_field(r.request_class.as_deref().unwrap_or("")));
        }
        out.push('\n');
    }
    out
}

/// A CSV field: quoted (quotes doubled) when it holds a comma or a quote.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests;
