//! `br-decision`'s flags. Each is also `BALANCEROUTE_<FLAG>` and a key of `--config FILE`
//! (TOML, flat: keys are flag names); precedence defaults < file < env < flags.

use std::time::Duration;

use br_core::dispatch::{
    ColdStart, DispatcherConfig, Stage1Scope, Stage1Worker, Stage2Fill, Stage2Hold, Stage2Target,
    Stage2Window, TieBreak,
};
use br_core::predict::PredictorConfig;
use br_core::score::HorizonParams;
use br_core::{PolicyConfig, PolicyKind};
use br_proto::valid::GroupId;
use br_runtime::config::CommonArgs;
use br_runtime::skeleton::ServiceArgs;
use clap::Parser;

use crate::group::{GroupConfig, RankSplit};
use crate::live::{LiveConfig, MAX_SAMPLES};
use crate::task::TickConfig;

pub const DEFAULT_LISTEN: &str = br_proto::defaults::DECISION_LISTEN;
pub const DEFAULT_ADMIN_LISTEN: &str = br_proto::defaults::DECISION_ADMIN_LISTEN;
/// Where the snapshot service is by default: br-all's port, like every client's default (the
/// split deployment names br-snapshot with `BALANCEROUTE_SNAPSHOT_ADDR`, deploy/split.env).
pub const DEFAULT_SNAPSHOT_ADDR: &str = br_proto::defaults::SNAPSHOT_ADDR;
pub const DEFAULT_POLICY: &str = "br0";
pub const DEFAULT_GROUPS: &str = "default";
pub const DEFAULT_TICK_INTERVAL: &str = "20ms";
pub const DEFAULT_TICK_MIN_INTERVAL: &str = "1ms";
pub const DEFAULT_MAX_POOL: usize = 16_384;
pub const DEFAULT_ANSWERED_TTL: &str = "20s";
pub const DEFAULT_ANSWERED_MAX: usize = 262_144;
pub const DEFAULT_MAX_WAIT: &str = "30s";
pub const DEFAULT_RESERVE_TIMEOUT: &str = "1s";
pub const DEFAULT_ADOPT_GRACE: &str = "10s";
pub const DEFAULT_RECOMMIT_SETTLE: &str = "500ms";
pub const DEFAULT_WATCH_BACKOFF_MAX: &str = "250ms";
pub const DEFAULT_EXT_PROC_TIMEOUT: &str = "10s";
/// The default of `--ext-proc-body-timeout`: br-shim's `--body-timeout`, the same wait for
/// the same body one hop earlier.
pub const DEFAULT_EXT_PROC_BODY_TIMEOUT: &str = "30s";
pub const DEFAULT_LIVE_SAMPLE_INTERVAL: &str = "500ms";
pub const DEFAULT_LIVE_HISTORY: &str = "5m";
pub const DEFAULT_DECIDER_TAKEOVER: &str = "100ms";
/// The live page's sample interval: fine enough to follow a decode step's worth of load
/// (tens of ms per step, so a few steps), coarse enough that sampling costs nothing.
const LIVE_SAMPLE_INTERVAL_RANGE: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(10));

/// br-decision: answers the gateway's Assign calls for the groups it serves. Requests wait in
/// a per-group pool until the dispatcher admits them (pooled policies br0, brh*), or are routed
/// at once (baselines, br0-bypass); every assignment is reserved in σ (Snapshot.Reserve) before
/// the call is answered.
#[derive(Debug, Clone, Parser)]
#[command(name = "br-decision", version)]
#[command(mut_arg("listen", |a| a.default_value(DEFAULT_LISTEN)))]
#[command(mut_arg("admin_listen", |a| a.default_value(DEFAULT_ADMIN_LISTEN)))]
pub struct Args {
    #[command(flatten)]
    pub common: CommonArgs,

    /// The snapshot service (Watch, Reserve, Release).
    #[arg(long, env = br_proto::defaults::env::SNAPSHOT_ADDR, default_value = DEFAULT_SNAPSHOT_ADDR)]
    pub snapshot_addr: String,

    /// Routing policy: random, rr, p2c, jsq, vllm-dp, mintok, br0-bypass (answer at once);
    /// br0, brh, brh-survival, brh-oracle, brh-hinted, brh-class (pooled, batch admission per
    /// tick; brh-hinted reads Assign's expected_output_tokens, brh-class also its
    /// request_class, learning each class apart); brc (pooled, prefill waves: for ranks
    /// that prefill their own prompts, colocated attention DP; see --brc-max-wait-steps).
    #[arg(long, env = "BALANCEROUTE_POLICY", default_value = DEFAULT_POLICY)]
    pub policy: PolicyKind,

    /// Comma-separated groups this service decides for. Assign for any other group is
    /// NOT_FOUND (groups are not watched lazily: a typo must not create state).
    #[arg(long, env = "BALANCEROUTE_GROUPS", value_delimiter = ',', default_value = DEFAULT_GROUPS)]
    pub groups: Vec<String>,

    /// Timer tick (also housekeeping: forgetting old answers, sweeping gone callers); every
    /// second instead while the group holds no request, reservation or stale σ.
    #[arg(long, env = "BALANCEROUTE_TICK_INTERVAL", value_parser = humantime::parse_duration, default_value = DEFAULT_TICK_INTERVAL)]
    pub tick_interval: Duration,

    /// Arrivals and σ changes trigger a tick at most this often (coalescing).
    #[arg(long, env = "BALANCEROUTE_TICK_MIN_INTERVAL", value_parser = humantime::parse_duration, default_value = DEFAULT_TICK_MIN_INTERVAL)]
    pub tick_min_interval: Duration,

    /// Most requests waiting in one group's pool; Assign beyond it is RESOURCE_EXHAUSTED.
    #[arg(long, env = "BALANCEROUTE_MAX_POOL", default_value_t = DEFAULT_MAX_POOL)]
    pub max_pool: usize,

    /// How long an answer is remembered for idempotent retries. A retry also gets the same
    /// answer while σ holds the request (reserved, then running), so this needs to cover a
    /// reservation that has not shown in σ's telemetry yet: at least the snapshot service's
    /// `--reservation-ttl` (10 s); the default is twice that. Each remembered answer costs
    /// about 370 bytes (100,000 of them at 5,000 Assign/s).
    #[arg(long, env = "BALANCEROUTE_ANSWERED_TTL", value_parser = humantime::parse_duration, default_value = DEFAULT_ANSWERED_TTL)]
    pub answered_ttl: Duration,

    /// Most answers remembered per group (oldest forgotten first).
    #[arg(long, env = "BALANCEROUTE_ANSWERED_MAX", default_value_t = DEFAULT_ANSWERED_MAX)]
    pub answered_max: usize,

    /// Longest an Assign waits when the caller sets no (or a longer) deadline.
    #[arg(long, env = "BALANCEROUTE_MAX_WAIT", value_parser = humantime::parse_duration, default_value = DEFAULT_MAX_WAIT)]
    pub max_wait: Duration,

    /// Timeout of one Reserve or Release call to the snapshot service.
    #[arg(long, env = "BALANCEROUTE_RESERVE_TIMEOUT", value_parser = humantime::parse_duration, default_value = DEFAULT_RESERVE_TIMEOUT)]
    pub reserve_timeout: Duration,

    /// After a restart of the snapshot service its new σ is nearly empty until the workers
    /// re-register: for up to this long, workers it does not know yet stay in the view as they
    /// were (answers for them are stale and reserved once they are back). Ends early once
    /// every worker is back.
    #[arg(long, env = "BALANCEROUTE_ADOPT_GRACE", value_parser = humantime::parse_duration, default_value = DEFAULT_ADOPT_GRACE)]
    pub adopt_grace: Duration,

    /// After an outage, how long a worker's reports take to reach σ once it is back. A
    /// reservation answered stale before then that σ still does not show is not reserved
    /// again (the worker finished it, or never got it).
    #[arg(long, env = "BALANCEROUTE_RECOMMIT_SETTLE", value_parser = humantime::parse_duration, default_value = DEFAULT_RECOMMIT_SETTLE)]
    pub recommit_settle: Duration,

    /// Longest delay between two attempts to resubscribe to σ (Watch) while the snapshot
    /// service is away; each delay is jittered (br-backoff's equal jitter).
    #[arg(long, env = "BALANCEROUTE_WATCH_BACKOFF_MAX", value_parser = humantime::parse_duration, default_value = DEFAULT_WATCH_BACKOFF_MAX)]
    pub watch_backoff_max: Duration,

    /// Dispatcher: Stage 2 candidate window R_max (1..=8). Unset: the core's default.
    #[arg(long, env = "BALANCEROUTE_R_MAX")]
    pub r_max: Option<usize>,

    /// Dispatcher: Stage 1 runs while total free slots exceed this (default G·R_max).
    #[arg(long, env = "BALANCEROUTE_S_GREEDY")]
    pub s_greedy: Option<u32>,

    /// Dispatcher: which worker Stage 1 serves (e.g. by-score, least-loaded, most-free-slots).
    /// Unset: the core's default.
    #[arg(long, env = "BALANCEROUTE_STAGE1_WORKER", value_parser = kebab::<Stage1Worker>)]
    pub stage1_worker: Option<Stage1Worker>,

    /// Dispatcher: which requests Stage 1 may pick from (head-batch, whole-pool).
    #[arg(long, env = "BALANCEROUTE_STAGE1_SCOPE", value_parser = kebab::<Stage1Scope>)]
    pub stage1_scope: Option<Stage1Scope>,

    /// Dispatcher: which requests Stage 2 chooses from (tick-head, oldest). Unset: the core's
    /// default.
    #[arg(long, env = "BALANCEROUTE_STAGE2_WINDOW", value_parser = kebab::<Stage2Window>)]
    pub stage2_window: Option<Stage2Window>,

    /// Dispatcher: up to which level Stage 2 fills a worker (mean, max). Unset: the core's
    /// default.
    #[arg(long, env = "BALANCEROUTE_STAGE2_FILL", value_parser = kebab::<Stage2Fill>)]
    pub stage2_fill: Option<Stage2Fill>,

    /// Dispatcher: with the tick-head window, how many requests beyond the tick's free slots
    /// Stage 2 may choose from. Unset: the core's default.
    #[arg(long, env = "BALANCEROUTE_STAGE2_LOOKAHEAD")]
    pub stage2_lookahead: Option<u32>,

    /// Dispatcher: up to which level Stage 1 fills a worker, between the group's mean load (0)
    /// and its max (1, the paper's F-score alone). Unset: the core's default.
    #[arg(long, env = "BALANCEROUTE_STAGE1_LEVEL")]
    pub stage1_level: Option<f64>,

    /// Dispatcher: whether Stage 1 places the whole pool when it holds no more requests than
    /// the tick's free slots (true, false). Unset: the core's default.
    #[arg(long, env = "BALANCEROUTE_STAGE1_SHALLOW")]
    pub stage1_shallow: Option<bool>,

    /// Dispatcher: when Stage 2 leaves a worker's slot empty rather than move it away from the
    /// mean (never, above-mean, worse). Unset: the core's default.
    #[arg(long, env = "BALANCEROUTE_STAGE2_HOLD", value_parser = kebab::<Stage2Hold>)]
    pub stage2_hold: Option<Stage2Hold>,

    /// Dispatcher: which load Stage 2's mean fill compares ranks by (now, next-finish: each
    /// rank's projected load before its next predicted finish; BR-H only, BR-0 has no
    /// horizon). Unset: the core's default.
    #[arg(long, env = "BALANCEROUTE_STAGE2_TARGET", value_parser = kebab::<Stage2Target>)]
    pub stage2_target: Option<Stage2Target>,

    /// Dispatcher: weight of Stage 2's finish-stagger term, which places a request whose
    /// client sent an expected output length so that its finish falls where its rank has none
    /// (≥ 0; 0, the default, is off; 1 is the value measured in br-sim). The group uses it
    /// only while its finished requests show the hints precise to a few percent (an RMS log
    /// error ≤ 0.05 at full weight, none at ≥ 0.1, nothing before 64 hinted finishes): coarser
    /// hints change nothing.
    #[arg(long, env = "BALANCEROUTE_STAGGER_WEIGHT", value_parser = non_negative_f64)]
    pub stagger_weight: Option<f64>,

    /// BR-C (--policy brc): decode steps it may hold the oldest waiting request for a wave
    /// while at least as many requests wait as there are free slots (64; steps are counted
    /// from the ranks' token reports, not from ticks; also at most --brc-hold-fraction, 5%, of
    /// the finished requests' mean output length). 0 releases at every step with a free slot.
    #[arg(long, env = "BALANCEROUTE_BRC_MAX_WAIT_STEPS")]
    pub brc_max_wait_steps: Option<u32>,

    /// BR-C: the same while fewer requests wait than there are free slots (2, or
    /// --brc-max-wait-steps if that is smaller; a value above it is refused): each step held
    /// there adds to every waiting request's TTFT.
    #[arg(long, env = "BALANCEROUTE_BRC_SHALLOW_WAIT_STEPS")]
    pub brc_shallow_wait_steps: Option<u32>,

    /// BR-C: once requests have finished, the deep pool's hold is also at most this fraction
    /// of their mean output length, in decode steps rounded up (0.05; in (0, 1]): a hold
    /// leaves freed slots empty, and what that costs is the hold over a slot's life.
    #[arg(long, env = "BALANCEROUTE_BRC_HOLD_FRACTION")]
    pub brc_hold_fraction: Option<f64>,

    /// BR-C: the fraction of live ranks that must have a free slot, and of requests that must
    /// wait, for a wave (1; in (0, 1]): a wave on part of the ranks stalls the rest as long.
    #[arg(long, env = "BALANCEROUTE_BRC_WAVE_FRACTION")]
    pub brc_wave_fraction: Option<f64>,

    /// BR-C: trade a wave's prompts between its ranks for decode KV, each rank keeping its
    /// count of prompts and the step's most prompt tokens on a rank not growing: true or false
    /// (true). false leaves the wave spread by prompt tokens alone.
    #[arg(long, env = "BALANCEROUTE_BRC_KV_SWAP", action = clap::ArgAction::Set)]
    pub brc_kv_swap: Option<bool>,

    /// BR-C: while more requests wait than there are free slots, a wave chooses its prompts
    /// among the oldest free slots × (1 + this) requests, the oldest always in, so that no
    /// rank runs more prompt tokens than the wave's share (0.5; in [0, 4]; 0 takes exactly
    /// the oldest).
    #[arg(long, env = "BALANCEROUTE_BRC_LOOKAHEAD")]
    pub brc_lookahead: Option<f64>,

    /// BR-C: between waves, while fewer requests wait than there are free slots and a rank is
    /// prefilling, give waiting prompts at once to ranks with less prefill queued than the rank
    /// with the most, up to that most (its steps already last that long): true or false
    /// (true). false holds every prompt for a wave or the guard.
    #[arg(long, env = "BALANCEROUTE_BRC_FILL_UNDER", action = clap::ArgAction::Set)]
    pub brc_fill_under: Option<bool>,

    /// BR-C: a prompt given under the most goes to the rank with the least KV among those
    /// whose queued prefill is within this many times the prompt of the least queued (1; in
    /// [0, 4]; 0: the least queued).
    #[arg(long, env = "BALANCEROUTE_BRC_FILL_SLACK")]
    pub brc_fill_slack: Option<f64>,

    /// Dispatcher: at equal loads, largest-first or score.
    #[arg(long, env = "BALANCEROUTE_COLD_START", value_parser = kebab::<ColdStart>)]
    pub cold_start: Option<ColdStart>,

    /// Tie break between equal scores (lowest-id, least-loaded, fewest-requests).
    #[arg(long, env = "BALANCEROUTE_TIE_BREAK", value_parser = kebab::<TieBreak>)]
    pub tie_break: Option<TieBreak>,

    /// BR-H horizon H in decode steps (0..=4096). Unset: the core's default.
    #[arg(long, env = "BALANCEROUTE_HORIZON")]
    pub horizon: Option<u32>,

    /// BR-H reward scale α.
    #[arg(long, env = "BALANCEROUTE_ALPHA")]
    pub alpha: Option<f64>,

    /// BR-H overflow penalty β; `G` means the group size (the BR-0 value).
    #[arg(long, env = "BALANCEROUTE_BETA", value_parser = parse_beta)]
    pub beta: Option<Beta>,

    /// BR-H discount γ per step, in (0, 1].
    #[arg(long, env = "BALANCEROUTE_GAMMA")]
    pub gamma: Option<f64>,

    /// BR-H confidence gate in [0, 1].
    #[arg(long, env = "BALANCEROUTE_GATE")]
    pub gate: Option<f64>,

    /// The F-score's request term, BR-0 and BR-H: KV tokens one running request costs the
    /// barrier, `c/a` of the step model `T = a·max L + c·max n + b` (`br-sim calibrate` prints
    /// it). Unset or 0: the paper's score.
    #[arg(long, env = "BALANCEROUTE_REQUEST_COST_TOKENS")]
    pub request_cost_tokens: Option<f64>,
    /// BR-H's Survival predictor learns one output-length distribution per prompt-length
    /// octave (besides the group's whole one, its cold-start prior): true or false (true).
    #[arg(long, env = "BALANCEROUTE_PREDICTOR_BUCKETS", action = clap::ArgAction::Set)]
    pub predictor_buckets: Option<bool>,

    /// BR-H's ExactMatch predictor remembers at most this many prompt hashes per group, least
    /// recently finished forgotten first (65536; 16 lengths each).
    #[arg(long, env = "BALANCEROUTE_PREDICTOR_MAX_HASHES")]
    pub predictor_max_hashes: Option<usize>,

    /// brh-class learns a model for at most this many request classes per group (64; each
    /// holds the lengths it saw, and 48 KiB more once a request of it carried a hint); further
    /// class keys are predicted as requests without one. 1..=4096.
    #[arg(long, env = "BALANCEROUTE_PREDICTOR_MAX_CLASSES")]
    pub predictor_max_classes: Option<usize>,

    /// Seed of the randomised baselines (random, p2c).
    #[arg(long, env = "BALANCEROUTE_SEED", default_value_t = 0)]
    pub seed: u64,

    /// Serve Envoy's external processing (`envoy.service.ext_proc.v3.ExternalProcessor`) on
    /// this address: an endpoint picker for Envoy-based gateways (the Gateway API Inference
    /// Extension's protocol). Off unless given; mutual TLS and authorisation as `--listen`.
    #[arg(long, env = "BALANCEROUTE_EXT_PROC_LISTEN")]
    pub ext_proc_listen: Option<std::net::SocketAddr>,

    /// The group of an ext_proc request without an `x-balanceroute-group` header. Unset: the
    /// served group when `--groups` names one, else such a request is refused (400).
    #[arg(long, env = "BALANCEROUTE_EXT_PROC_DEFAULT_GROUP")]
    pub ext_proc_default_group: Option<String>,

    /// Longest the Assign of one ext_proc request waits (also capped by `--max-wait`). Keep
    /// Envoy's ext_proc `message_timeout` above it, or Envoy gives up first.
    #[arg(long, env = "BALANCEROUTE_EXT_PROC_TIMEOUT", value_parser = humantime::parse_duration, default_value = DEFAULT_EXT_PROC_TIMEOUT)]
    pub ext_proc_timeout: Duration,

    /// The request-body bytes all ext_proc streams together may buffer (each also at most
    /// 16 MiB). A body message that does not fit is refused at once with a 503
    /// ImmediateResponse and counted in `balanceroute_decision_ext_proc_budget_refusals_total`.
    #[arg(long, env = "BALANCEROUTE_EXT_PROC_MAX_BUFFERED_BYTES", default_value_t = crate::edge::ext_proc::DEFAULT_MAX_BUFFERED_BYTES)]
    pub ext_proc_max_buffered_bytes: usize,

    /// Longest an ext_proc stream waits for its request body once its headers arrived. Past
    /// it the request is refused with a 408 ImmediateResponse, the stream ends, what it held
    /// (its buffered bytes, its request id) is released, and it is counted in
    /// `balanceroute_decision_ext_proc_body_timeouts_total`. Envoy ends a stream it gave up
    /// on by itself; this bounds one whose client stops sending and whose Envoy keeps waiting.
    #[arg(long, env = "BALANCEROUTE_EXT_PROC_BODY_TIMEOUT", value_parser = humantime::parse_duration, default_value = DEFAULT_EXT_PROC_BODY_TIMEOUT)]
    pub ext_proc_body_timeout: Duration,

    /// Also serve Assign and Cancel as HTTP/JSON (`POST /v1/assign`, `POST /v1/cancel`) on
    /// this address, for gateways without gRPC. Off when unset. Same rules as `--listen`:
    /// plaintext only on loopback, mutual TLS with the same roles when `--tls-*` are given,
    /// and the same `--max-connections` and `--first-byte-timeout`.
    #[arg(long, env = "BALANCEROUTE_HTTP_LISTEN")]
    pub http_listen: Option<std::net::SocketAddr>,

    /// K: decision replicas serving the same groups together. With K > 1 each places only on
    /// the ranks g with `g mod K = --decider-index` (every rank counts in its score), so two
    /// replicas never reach for one free slot; a rank left with free slots for
    /// `--decider-takeover` is open to every replica (its owner is dead or idle). 1: every
    /// replica places everywhere (collisions are refused by the snapshot and re-pooled).
    /// Pooled policies only.
    #[arg(long, env = "BALANCEROUTE_DECIDERS", default_value_t = 1)]
    pub deciders: u32,

    /// This replica's index in 0..K (`--deciders`); every replica of a group needs its own
    /// (e.g. a StatefulSet's ordinal).
    #[arg(long, env = "BALANCEROUTE_DECIDER_INDEX", default_value_t = 0)]
    pub decider_index: u32,

    /// With `--deciders` K > 1: how long another replica's rank must show free slots before
    /// this one places there too. Bounds how long a dead replica's ranks stay unused; keep it
    /// well above the time a replica takes to fill a freed slot (a σ delta and a tick). A rank
    /// σ shows back (a restarted snapshot service, a reconnection) waits
    /// `--recommit-settle` for its reports first.
    #[arg(long, env = "BALANCEROUTE_DECIDER_TAKEOVER", value_parser = humantime::parse_duration, default_value = DEFAULT_DECIDER_TAKEOVER)]
    pub decider_takeover: Duration,

    /// The live page (`/live` on the admin port): how often each group is sampled (σ's
    /// per-rank loads, decode rates and state changes, imbalance, pool, Assign rate and
    /// latency), 100ms to 10s.
    #[arg(long, env = "BALANCEROUTE_LIVE_SAMPLE_INTERVAL", value_parser = humantime::parse_duration, default_value = DEFAULT_LIVE_SAMPLE_INTERVAL)]
    pub live_sample_interval: Duration,

    /// The live page: how much history each group keeps (the ring holds this / the sample
    /// interval samples, at most 7,200; at most 260 bytes + 24 per rank each).
    #[arg(long, env = "BALANCEROUTE_LIVE_HISTORY", value_parser = humantime::parse_duration, default_value = DEFAULT_LIVE_HISTORY)]
    pub live_history: Duration,
}

/// `--beta`: a number, or `G` (the group size).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Beta(pub Option<f64>);

impl std::fmt::Display for Beta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(b) => write!(f, "{b}"),
            None => f.write_str("G"),
        }
    }
}

/// Parses a core enum by its serde (kebab-case) name, so new variants need no change here.
/// A finite number ≥ 0.
fn non_negative_f64(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("expected a number: {e}"))?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("must be finite and >= 0, got {v}"))
    }
}

fn kebab<T: serde::de::DeserializeOwned>(s: &str) -> Result<T, String> {
    use serde::de::IntoDeserializer as _;
    let de: serde::de::value::StrDeserializer<'_, serde::de::value::Error> = s.into_deserializer();
    T::deserialize(de).map_err(|e| e.to_string())
}

fn parse_beta(s: &str) -> Result<Beta, String> {
    if s.eq_ignore_ascii_case("g") {
        return Ok(Beta(None));
    }
    s.parse::<f64>()
        .map(|b| Beta(Some(b)))
        .map_err(|e| format!("expected a number or G: {e}"))
}

/// Everything the service needs beyond the common flags, validated.
#[derive(Debug, Clone)]
pub struct DecisionConfig {
    pub snapshot_addr: String,
    pub policy: PolicyConfig,
    pub groups: Vec<GroupId>,
    pub ticks: TickConfig,
    pub group: GroupConfig,
    pub max_wait: Duration,
    pub reserve_timeout: Duration,
    pub watch_backoff_max: Duration,
    /// `--http-listen`: the HTTP/JSON listener, if any.
    pub http_listen: Option<std::net::SocketAddr>,
    /// The ext_proc endpoint picker, when `--ext-proc-listen` is given.
    pub ext_proc: Option<ExtProcConfig>,
    /// The live page's sampling (`--live-*`).
    pub live: LiveConfig,
}

/// The ext_proc endpoint picker's settings (`--ext-proc-*`).
#[derive(Debug, Clone)]
pub struct ExtProcConfig {
    pub listen: std::net::SocketAddr,
    /// The group of a request that names none.
    pub default_group: Option<GroupId>,
    /// How long one request's Assign may wait.
    pub timeout: Duration,
    /// The request-body bytes every stream together may buffer.
    pub max_buffered_bytes: usize,
    /// How long a stream waits for its request body.
    pub body_timeout: Duration,
}

impl Args {
    /// The validated configuration.
    pub fn to_config(&self) -> Result<DecisionConfig, String> {
        let mut groups: Vec<GroupId> = Vec::new();
        for g in &self.groups {
            let g = g.trim();
            let id = GroupId::new(g).map_err(|e| format!("--groups: {e}"))?;
            if !groups.contains(&id) {
                groups.push(id);
            }
        }
        if groups.is_empty() {
            return Err("--groups must name at least one group".into());
        }
        let d = DispatcherConfig::default();
        let h = HorizonParams::default();
        let policy = PolicyConfig {
            kind: self.policy,
            dispatcher: DispatcherConfig {
                s_greedy: self.s_greedy.or(d.s_greedy),
                r_max: self.r_max.unwrap_or(d.r_max),
                stage1_worker: self.stage1_worker.unwrap_or(d.stage1_worker),
                stage1_scope: self.stage1_scope.unwrap_or(d.stage1_scope),
                cold_start: self.cold_start.unwrap_or(d.cold_start),
                tie_break: self.tie_break.unwrap_or(d.tie_break),
                stage2_window: self.stage2_window.unwrap_or(d.stage2_window),
                stage2_fill: self.stage2_fill.unwrap_or(d.stage2_fill),
                stage2_lookahead: self.stage2_lookahead.unwrap_or(d.stage2_lookahead),
                stage1_level: self.stage1_level.unwrap_or(d.stage1_level),
                stage1_shallow: self.stage1_shallow.unwrap_or(d.stage1_shallow),
                stage2_hold: self.stage2_hold.unwrap_or(d.stage2_hold),
                stage2_target: self.stage2_target.unwrap_or(d.stage2_target),
                stagger_weight: self.stagger_weight.unwrap_or(d.stagger_weight),
            },
            horizon: HorizonParams {
                horizon: self.horizon.unwrap_or(h.horizon),
                alpha: self.alpha.unwrap_or(h.alpha),
                beta: self.beta.map_or(h.beta, |b| b.0),
                gamma: self.gamma.unwrap_or(h.gamma),
                gate: self.gate.unwrap_or(h.gate),
                request_cost_tokens: self.request_cost_tokens.unwrap_or(h.request_cost_tokens),
                predictor: PredictorConfig {
                    prompt_buckets: self.predictor_buckets.unwrap_or(h.predictor.prompt_buckets),
                    max_hashes: self.predictor_max_hashes.unwrap_or(h.predictor.max_hashes),
                    max_classes: self
                        .predictor_max_classes
                        .unwrap_or(h.predictor.max_classes),
                    ..h.predictor
                },
            },
            brc: {
                let b = br_core::BrcConfig::default();
                br_core::BrcConfig {
                    max_wait_steps: self.brc_max_wait_steps.unwrap_or(b.max_wait_steps),
                    shallow_wait_steps: self.brc_shallow_wait_steps.unwrap_or(b.shallow_wait_steps),
                    hold_fraction: self.brc_hold_fraction.unwrap_or(b.hold_fraction),
                    wave_fraction: self.brc_wave_fraction.unwrap_or(b.wave_fraction),
                    kv_swap: self.brc_kv_swap.unwrap_or(b.kv_swap),
                    lookahead: self.brc_lookahead.unwrap_or(b.lookahead),
                    fill_under: self.brc_fill_under.unwrap_or(b.fill_under),
                    fill_slack: self.brc_fill_slack.unwrap_or(b.fill_slack),
                }
            },
            seed: self.seed,
        };
        // BR-C's fractions through its own validation, one at a time, so the error names the
        // flag that is out of range (the core's message names the field)
        let b = br_core::BrcConfig::default();
        for (flag, cfg) in [
            (
                "--brc-hold-fraction",
                br_core::BrcConfig {
                    hold_fraction: policy.brc.hold_fraction,
                    ..b
                },
            ),
            (
                "--brc-wave-fraction",
                br_core::BrcConfig {
                    wave_fraction: policy.brc.wave_fraction,
                    ..b
                },
            ),
            (
                "--brc-lookahead",
                br_core::BrcConfig {
                    lookahead: policy.brc.lookahead,
                    ..b
                },
            ),
            (
                "--brc-fill-slack",
                br_core::BrcConfig {
                    fill_slack: policy.brc.fill_slack,
                    ..b
                },
            ),
        ] {
            cfg.validate().map_err(|e| format!("{flag}: {e}"))?;
        }
        if self.brc_shallow_wait_steps.is_some() {
            policy
                .brc
                .validate_given_shallow()
                .map_err(|e| format!("--brc-shallow-wait-steps, --brc-max-wait-steps: {e}"))?;
        }
        policy.validate().map_err(|e| e.to_string())?;
        let split = RankSplit::new(self.deciders, self.decider_index, self.decider_takeover)
            .map_err(|e| e.to_string())?;
        if split.is_some() && policy.kind.mode() != br_core::Mode::Pooled {
            return Err(format!(
                "--deciders {} splits the ticks of pooled policies (br0, brh*); {} routes on arrival",
                self.deciders, self.policy
            ));
        }
        let positive = |name: &str, d: Duration| {
            if d.is_zero() {
                Err(format!("--{name} must be positive"))
            } else {
                Ok(())
            }
        };
        positive("tick-interval", self.tick_interval)?;
        positive("max-wait", self.max_wait)?;
        positive("reserve-timeout", self.reserve_timeout)?;
        positive("answered-ttl", self.answered_ttl)?;
        positive("watch-backoff-max", self.watch_backoff_max)?;
        if self.tick_min_interval > self.tick_interval {
            return Err("--tick-min-interval must not exceed --tick-interval".into());
        }
        if self.max_pool == 0 {
            return Err("--max-pool must be positive".into());
        }
        if self.answered_max == 0 {
            return Err("--answered-max must be positive".into());
        }
        let ext_proc = match self.ext_proc_listen {
            None => None,
            Some(listen) => {
                positive("ext-proc-timeout", self.ext_proc_timeout)?;
                positive("ext-proc-body-timeout", self.ext_proc_body_timeout)?;
                let max = self.ext_proc_max_buffered_bytes;
                if !(1024..=tokio::sync::Semaphore::MAX_PERMITS).contains(&max) {
                    return Err(format!(
                        "--ext-proc-max-buffered-bytes {max} must be at least 1024 (and fit a semaphore)"
                    ));
                }
                let default_group = match &self.ext_proc_default_group {
                    Some(g) => {
                        let id = GroupId::new(g.trim())
                            .map_err(|e| format!("--ext-proc-default-group: {e}"))?;
                        if !groups.contains(&id) {
                            return Err(format!(
                                "--ext-proc-default-group {g:?} is not one of --groups"
                            ));
                        }
                        Some(id)
                    }
                    // One served group: a request that names none can only mean it.
                    None if groups.len() == 1 => Some(groups[0].clone()),
                    None => None,
                };
                Some(ExtProcConfig {
                    listen,
                    default_group,
                    timeout: self.ext_proc_timeout.min(self.max_wait),
                    max_buffered_bytes: self.ext_proc_max_buffered_bytes,
                    body_timeout: self.ext_proc_body_timeout,
                })
            }
        };
        let live = self.live_config()?;
        if !(self.snapshot_addr.starts_with("http://")
            || self.snapshot_addr.starts_with("https://"))
        {
            return Err(format!(
                "--snapshot-addr {:?} must start with http:// or https://",
                self.snapshot_addr
            ));
        }
        Ok(DecisionConfig {
            snapshot_addr: self.snapshot_addr.clone(),
            policy,
            groups,
            ticks: TickConfig {
                interval: self.tick_interval,
                min_interval: self.tick_min_interval,
            },
            group: GroupConfig {
                max_pool: self.max_pool,
                answered_ttl: self.answered_ttl,
                answered_max: self.answered_max,
                adopt_grace: self.adopt_grace,
                recommit_settle: self.recommit_settle,
                split,
                ..GroupConfig::default()
            },
            max_wait: self.max_wait,
            reserve_timeout: self.reserve_timeout,
            watch_backoff_max: self.watch_backoff_max,
            ext_proc,
            http_listen: self.http_listen,
            live,
        })
    }

    fn live_config(&self) -> Result<LiveConfig, String> {
        let (lo, hi) = LIVE_SAMPLE_INTERVAL_RANGE;
        let interval = self.live_sample_interval;
        if !(lo..=hi).contains(&interval) {
            return Err(format!(
                "--live-sample-interval {} must be between {} and {}",
                humantime::format_duration(interval),
                humantime::format_duration(lo),
                humantime::format_duration(hi),
            ));
        }
        if self.live_history < interval {
            return Err("--live-history must be at least --live-sample-interval".into());
        }
        let samples = self.live_history.as_nanos().div_ceil(interval.as_nanos());
        if samples > MAX_SAMPLES as u128 {
            return Err(format!(
                "--live-history / --live-sample-interval is {samples} samples per group, above \
                 {MAX_SAMPLES}: keep less history or sample less often"
            ));
        }
        Ok(LiveConfig {
            interval,
            samples: samples as usize,
        })
    }
}

impl ServiceArgs for Args {
    fn common(&self) -> &CommonArgs {
        &self.common
    }

    fn check(&self) -> Result<(), String> {
        self.to_config().map(|_| ())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;
    use clap::CommandFactory as _;
    use std::io::Write as _;

    fn parse(args: &[&str]) -> Result<Args, br_runtime::config::ConfigError> {
        br_runtime::config::parse_from(std::iter::once("br-decision").chain(args.iter().copied()))
    }

    /// The configuration of a `--config` file holding `toml` and no flags.
    fn from_file(toml: &str) -> DecisionConfig {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(toml.as_bytes()).unwrap();
        parse(&["--config", f.path().to_str().unwrap()])
            .unwrap()
            .to_config()
            .unwrap()
    }

    #[test]
    fn defaults_start_with_no_arguments() {
        let a = parse(&[]).unwrap();
        let c = a.to_config().unwrap();
        assert_eq!(a.common.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(a.common.admin_listen.to_string(), DEFAULT_ADMIN_LISTEN);
        assert_eq!(c.snapshot_addr, DEFAULT_SNAPSHOT_ADDR);
        assert_eq!(c.policy.kind, PolicyKind::Br0);
        assert_eq!(c.groups.len(), 1);
        assert_eq!(c.groups[0].as_str(), "default");
        assert_eq!(c.ticks.interval, Duration::from_millis(20));
        assert_eq!(c.ticks.min_interval, Duration::from_millis(1));
        assert_eq!(c.group.max_pool, DEFAULT_MAX_POOL);
        assert_eq!(c.group.answered_ttl, Duration::from_secs(20));
        assert_eq!(c.policy.dispatcher, DispatcherConfig::default());
        assert_eq!(c.policy.horizon, HorizonParams::default());
        assert_eq!(c.group.adopt_grace, Duration::from_secs(10));
        assert_eq!(c.group.recommit_settle, Duration::from_millis(500));
        assert_eq!(c.watch_backoff_max, Duration::from_millis(250));
        assert_eq!(c.http_listen, None, "HTTP/JSON is off by default");
        assert_eq!(
            c.live,
            LiveConfig {
                interval: Duration::from_millis(500),
                samples: 600
            },
            "5 minutes of history at 2 samples a second"
        );
    }

    #[test]
    fn the_live_history_is_bounded() {
        let live = |args: &[&str]| parse(args).map(|a| a.to_config().map(|c| c.live));
        let c = live(&["--live-sample-interval", "250ms", "--live-history", "10m"]);
        assert_eq!(c.unwrap().unwrap().samples, 2_400);
        let c = live(&["--live-sample-interval", "1s", "--live-history", "1500ms"]);
        assert_eq!(c.unwrap().unwrap().samples, 2, "rounded up");
        for bad in [
            &["--live-sample-interval", "50ms"][..],
            &["--live-sample-interval", "11s"],
            &["--live-sample-interval", "1s", "--live-history", "500ms"],
            &["--live-sample-interval", "100ms", "--live-history", "1h"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn flags_and_file() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(b"policy = \"jsq\"\ngroups = \"g1,g2\"\ntick_interval = \"5ms\"\nr_max = 3\nbeta = \"G\"\n")
            .unwrap();
        let a = parse(&[
            "--config",
            f.path().to_str().unwrap(),
            "--max-pool",
            "10",
            "--tick-min-interval",
            "500us",
        ])
        .unwrap();
        let c = a.to_config().unwrap();
        assert_eq!(c.policy.kind, PolicyKind::Jsq);
        let g: Vec<&str> = c.groups.iter().map(GroupId::as_str).collect();
        assert_eq!(g, ["g1", "g2"]);
        assert_eq!(c.ticks.interval, Duration::from_millis(5));
        assert_eq!(c.ticks.min_interval, Duration::from_micros(500));
        assert_eq!(c.group.max_pool, 10);
        assert_eq!(c.policy.dispatcher.r_max, 3);
        assert_eq!(c.policy.horizon.beta, None);
        let a = parse(&[
            "--stage1-worker",
            "most-free-slots",
            "--tie-break",
            "lowest-id",
        ])
        .unwrap();
        let c = a.to_config().unwrap();
        assert_eq!(
            c.policy.dispatcher.stage1_worker,
            Stage1Worker::MostFreeSlots
        );
        assert_eq!(c.policy.dispatcher.tie_break, TieBreak::LowestId);
        // Stage 1's fill level: the core's default unset, the paper's rule at 1, 0..=1 only
        assert_eq!(
            parse(&[])
                .unwrap()
                .to_config()
                .unwrap()
                .policy
                .dispatcher
                .stage1_level,
            br_core::dispatch::DispatcherConfig::default().stage1_level
        );
        let c = parse(&["--stage1-level", "1"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.policy.dispatcher.stage1_level, 1.0);
        for bad in ["1.5", "-0.1", "x"] {
            let refused = parse(&["--stage1-level", bad]).map(|a| a.to_config());
            assert!(!matches!(refused, Ok(Ok(_))), "--stage1-level {bad}");
        }
        // the shallow-pool rule and Stage 2's hold: the core's defaults unset, settable
        let d = parse(&[]).unwrap().to_config().unwrap().policy.dispatcher;
        assert_eq!(d.stage1_shallow, DispatcherConfig::default().stage1_shallow);
        assert_eq!(d.stage2_hold, DispatcherConfig::default().stage2_hold);
        let c = parse(&["--stage1-shallow", "false", "--stage2-hold", "never"])
            .unwrap()
            .to_config()
            .unwrap();
        assert!(!c.policy.dispatcher.stage1_shallow);
        assert_eq!(c.policy.dispatcher.stage2_hold, Stage2Hold::Never);
        assert!(parse(&["--stage2-hold", "sometimes"]).is_err());
        assert_eq!(d.stage2_target, DispatcherConfig::default().stage2_target);
        let c = parse(&["--stage2-target", "next-finish"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.policy.dispatcher.stage2_target, Stage2Target::NextFinish);
        assert!(parse(&["--stage2-target", "later"]).is_err());
        assert!(parse(&["--stage1-shallow", "maybe"]).is_err());
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(parse(&["--policy", "nope"]).is_err());
        assert!(parse(&["--groups", ""]).is_err());
        assert!(parse(&["--r-max", "0"]).is_err());
        assert!(parse(&["--max-pool", "0"]).is_err());
        assert!(parse(&["--tick-interval", "1ms", "--tick-min-interval", "2ms"]).is_err());
        assert!(parse(&["--snapshot-addr", "127.0.0.1:50061"]).is_err());
        assert!(parse(&["--gamma", "0"]).is_err());
        assert!(parse(&["--stage1-worker", "x"]).is_err());
        assert!(parse(&["--watch-backoff-max", "0s"]).is_err());
        assert!(parse(&["--request-cost-tokens", "-1"]).is_err());
    }

    #[test]
    fn the_rank_split_is_off_by_default_and_a_split_that_cannot_work_is_refused() {
        let c = parse(&[]).unwrap().to_config().unwrap();
        assert_eq!(c.group.split, None);
        let c = parse(&["--deciders", "2", "--decider-index", "1"])
            .unwrap()
            .to_config()
            .unwrap();
        let split = c.group.split.expect("a split");
        assert!(split.owns(1) && split.owns(3) && !split.owns(0));
        assert_eq!(split.takeover(), Duration::from_millis(100));
        // refused at parsing (which validates), with the typed error's message
        let refused = |args: &[&str]| match parse(args) {
            Err(e) => e.to_string(),
            Ok(a) => a.to_config().unwrap_err(),
        };
        assert!(
            refused(&["--deciders", "2", "--decider-index", "2"])
                .contains("--decider-index 2 must be below --deciders 2")
        );
        assert!(refused(&["--deciders", "0"]).contains("at least 1"));
        assert!(refused(&["--decider-index", "1"]).contains("needs --deciders"));
        assert!(refused(&["--deciders", "2", "--decider-takeover", "0s"]).contains("positive"));
        assert!(refused(&["--deciders", "2", "--policy", "jsq"]).contains("routes on arrival"));
        // the file's keys, as deploy/k8s/base/config/decision.toml names them
        let c = from_file("deciders = 3\ndecider_index = 2\ndecider_takeover = \"250ms\"\n");
        let split = c.group.split.expect("a split");
        assert!(split.owns(2) && split.owns(5) && !split.owns(3));
        assert_eq!(split.takeover(), Duration::from_millis(250));
    }

    #[test]
    fn the_stagger_term_is_off_by_default_and_refuses_a_negative_weight() {
        let d = parse(&[]).unwrap().to_config().unwrap();
        assert_eq!(d.policy.dispatcher.stagger_weight, 0.0);
        let c = parse(&["--stagger-weight", "1"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.policy.dispatcher.stagger_weight, 1.0);
        for bad in ["-1", "NaN", "inf", "x"] {
            assert!(parse(&["--stagger-weight", bad]).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_request_term_is_off_by_default_and_set_by_flag() {
        let c = parse(&[]).unwrap().to_config().unwrap();
        assert_eq!(c.policy.horizon.request_cost_tokens, 0.0);
        let c = parse(&["--request-cost-tokens", "2500"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.policy.horizon.request_cost_tokens, 2500.0);
    }

    #[test]
    fn ext_proc_is_off_by_default_and_its_group_defaults_to_the_one_served() {
        assert!(parse(&[]).unwrap().to_config().unwrap().ext_proc.is_none());
        let c = parse(&[
            "--ext-proc-listen",
            "127.0.0.1:0",
            "--ext-proc-timeout",
            "2s",
        ])
        .unwrap()
        .to_config()
        .unwrap();
        let e = c.ext_proc.unwrap();
        assert_eq!(e.listen.to_string(), "127.0.0.1:0");
        assert_eq!(e.default_group.unwrap().as_str(), "default");
        assert_eq!(e.timeout, Duration::from_secs(2));
        // two groups: none is implied; a named one must be served
        let a = parse(&["--groups", "a,b", "--ext-proc-listen", "127.0.0.1:0"]).unwrap();
        assert!(
            a.to_config()
                .unwrap()
                .ext_proc
                .unwrap()
                .default_group
                .is_none()
        );
        let a = parse(&[
            "--groups",
            "a,b",
            "--ext-proc-listen",
            "127.0.0.1:0",
            "--ext-proc-default-group",
            "b",
        ])
        .unwrap();
        let g = a.to_config().unwrap().ext_proc.unwrap().default_group;
        assert_eq!(g.unwrap().as_str(), "b");
        let bad = [
            "--ext-proc-listen",
            "127.0.0.1:0",
            "--ext-proc-default-group",
            "c",
        ];
        assert!(parse(&bad).is_err());
        let zero = [
            "--ext-proc-listen",
            "127.0.0.1:0",
            "--ext-proc-timeout",
            "0s",
        ];
        assert!(parse(&zero).is_err());
        // the timeout never exceeds --max-wait
        let capped = ["--ext-proc-listen", "127.0.0.1:0", "--max-wait", "1s"];
        let e = parse(&capped)
            .unwrap()
            .to_config()
            .unwrap()
            .ext_proc
            .unwrap();
        assert_eq!(e.timeout, Duration::from_secs(1));
    }

    #[test]
    fn every_flag_has_its_env_var() {
        assert_eq!(
            br_runtime::config::check_env_names(&Args::command()),
            Ok(())
        );
    }

    #[test]
    fn predictor_flags() {
        let c = parse(&[]).unwrap().to_config().unwrap();
        assert_eq!(c.policy.horizon.predictor, PredictorConfig::default());
        let c = parse(&[
            "--policy",
            "brh",
            "--predictor-buckets",
            "false",
            "--predictor-max-hashes",
            "1000",
            "--predictor-max-classes",
            "8",
        ])
        .unwrap()
        .to_config()
        .unwrap();
        assert!(!c.policy.horizon.predictor.prompt_buckets);
        assert_eq!(c.policy.horizon.predictor.max_hashes, 1000);
        assert_eq!(c.policy.horizon.predictor.max_classes, 8);
        let refused = parse(&["--predictor-max-hashes", "0"]).map(|a| a.to_config());
        assert!(!matches!(refused, Ok(Ok(_))), "no hash table at all");
        for classes in ["0", "4097"] {
            let refused = parse(&["--predictor-max-classes", classes]).map(|a| a.to_config());
            assert!(!matches!(refused, Ok(Ok(_))), "{classes} classes");
        }
        assert!(parse(&["--predictor-buckets", "maybe"]).is_err());
    }

    #[test]
    fn every_policy_name_parses() {
        for name in PolicyKind::names() {
            let a = parse(&["--policy", name]).unwrap();
            assert!(a.to_config().is_ok(), "{name}");
        }
    }

    #[test]
    fn brc_takes_its_hold_budgets_and_keeps_the_rest_of_its_defaults() {
        let c = parse(&["--policy", "brc"]).unwrap().to_config().unwrap();
        assert_eq!(c.policy.brc, br_core::BrcConfig::default());
        let c = parse(&[
            "--policy",
            "brc",
            "--brc-max-wait-steps",
            "16",
            "--brc-shallow-wait-steps",
            "0",
        ])
        .unwrap()
        .to_config()
        .unwrap();
        assert_eq!(
            (c.policy.brc.max_wait_steps, c.policy.brc.shallow_wait_steps),
            (16, 0)
        );
        assert_eq!(
            c.policy.brc.hold_fraction,
            br_core::BrcConfig::default().hold_fraction
        );
        assert!(parse(&["--brc-max-wait-steps", "-1"]).is_err());
        // The default shallow budget follows a smaller deep one; a given one above it is refused.
        let c = parse(&["--policy", "brc", "--brc-max-wait-steps", "1"])
            .unwrap()
            .to_config()
            .unwrap();
        assert_eq!(c.policy.brc.max_wait_steps, 1);
        for args in [
            &["--brc-max-wait-steps", "4", "--brc-shallow-wait-steps", "5"][..],
            &["--brc-shallow-wait-steps", "65"][..],
        ] {
            let mut all = vec!["--policy", "brc"];
            all.extend_from_slice(args);
            let err = parse(&all)
                .map_err(|e| e.to_string())
                .and_then(|a| a.to_config())
                .unwrap_err();
            assert!(
                err.contains("--brc-shallow-wait-steps") && err.contains("--brc-max-wait-steps"),
                "{err}"
            );
        }
    }

    #[test]
    fn brc_kv_swap_is_on_by_default_turned_off_by_false_and_refuses_anything_else() {
        let brc = |args: &[&str]| {
            let mut all = vec!["--policy", "brc"];
            all.extend_from_slice(args);
            parse(&all)
                .map_err(|e| e.to_string())
                .and_then(|a| a.to_config())
        };
        assert!(brc(&[]).unwrap().policy.brc.kv_swap);
        assert!(!brc(&["--brc-kv-swap", "false"]).unwrap().policy.brc.kv_swap);
        assert!(brc(&["--brc-kv-swap", "true"]).unwrap().policy.brc.kv_swap);
        let c = from_file("policy = \"brc\"\nbrc_kv_swap = false\n");
        assert!(!c.policy.brc.kv_swap);
        for bad in ["2", "maybe", ""] {
            assert!(
                brc(&["--brc-kv-swap", bad]).is_err(),
                "--brc-kv-swap {bad:?}"
            );
        }
    }

    #[test]
    fn brc_takes_its_hold_and_wave_fractions_and_refuses_them_outside_0_to_1() {
        let c = parse(&[
            "--policy",
            "brc",
            "--brc-hold-fraction",
            "0.1",
            "--brc-wave-fraction",
            "0.5",
        ])
        .unwrap()
        .to_config()
        .unwrap();
        assert_eq!(
            c.policy.brc,
            br_core::BrcConfig {
                hold_fraction: 0.1,
                wave_fraction: 0.5,
                ..br_core::BrcConfig::default()
            }
        );
        assert!(c.policy.brc.kv_swap, "the KV pass is on unless turned off");
        // the file's keys and the variables name them too
        let c = from_file("policy = \"brc\"\nbrc_hold_fraction = 1\nbrc_wave_fraction = 0.25\n");
        assert_eq!(
            (c.policy.brc.hold_fraction, c.policy.brc.wave_fraction),
            (1.0, 0.25)
        );
        // refused at parsing (which validates), with BrcConfig's error under the flag's name
        let refused = |args: &[&str]| match parse(args) {
            Err(e) => e.to_string(),
            Ok(a) => a.to_config().unwrap_err(),
        };
        for (flag, field) in [
            ("--brc-hold-fraction", "hold_fraction"),
            ("--brc-wave-fraction", "wave_fraction"),
        ] {
            for bad in ["0", "-0.5", "1.5", "NaN", "inf"] {
                // `--flag=-0.5`: clap reads a lone `-0.5` as a flag
                let e = refused(&["--policy", "brc", &format!("{flag}={bad}")]);
                assert!(
                    e.contains(&format!("{flag}: "))
                        && e.contains(&format!("{field} must be in (0, 1]")),
                    "{flag} {bad}: {e}"
                );
            }
            assert!(parse(&[flag, "x"]).is_err(), "{flag} x");
            // 1 is the top of the range, not beyond it
            assert!(parse(&["--policy", "brc", flag, "1"]).is_ok(), "{flag} 1");
        }
    }

    #[test]
    fn brc_lookahead_defaults_to_half_and_refuses_values_outside_0_to_4() {
        let lookahead = |args: &[&str]| -> Result<f64, String> {
            let mut all = vec!["--policy", "brc"];
            all.extend_from_slice(args);
            match parse(&all) {
                Err(e) => Err(e.to_string()),
                Ok(a) => a.to_config().map(|c| c.policy.brc.lookahead),
            }
        };
        assert_eq!(lookahead(&[]), Ok(0.5));
        assert_eq!(lookahead(&["--brc-lookahead", "0"]), Ok(0.0));
        assert_eq!(lookahead(&["--brc-lookahead", "4"]), Ok(4.0));
        for bad in ["-0.5", "4.5", "NaN", "inf"] {
            let e = lookahead(&[&format!("--brc-lookahead={bad}")]).unwrap_err();
            assert!(
                e.contains("--brc-lookahead: ") && e.contains("lookahead must be in [0, 4]"),
                "{bad}: {e}"
            );
        }
        assert!(lookahead(&["--brc-lookahead", "x"]).is_err());
        let c = from_file("policy = \"brc\"\nbrc_lookahead = 1\n");
        assert_eq!(c.policy.brc.lookahead, 1.0);
    }

    #[test]
    fn brc_fills_under_by_default_and_its_slack_is_refused_outside_0_to_4() {
        let brc = |args: &[&str]| -> Result<br_core::BrcConfig, String> {
            let mut all = vec!["--policy", "brc"];
            all.extend_from_slice(args);
            match parse(&all) {
                Err(e) => Err(e.to_string()),
                Ok(a) => a.to_config().map(|c| c.policy.brc),
            }
        };
        let d = brc(&[]).unwrap();
        assert!(d.fill_under);
        assert_eq!(d.fill_slack, 1.0);
        assert!(!brc(&["--brc-fill-under", "false"]).unwrap().fill_under);
        assert!(brc(&["--brc-fill-under", "maybe"]).is_err());
        assert_eq!(brc(&["--brc-fill-slack", "0"]).unwrap().fill_slack, 0.0);
        assert_eq!(brc(&["--brc-fill-slack", "4"]).unwrap().fill_slack, 4.0);
        for bad in ["-0.1", "4.5", "NaN", "inf"] {
            let e = brc(&[&format!("--brc-fill-slack={bad}")]).unwrap_err();
            assert!(
                e.contains("--brc-fill-slack: ") && e.contains("fill_slack must be in [0, 4]"),
                "{bad}: {e}"
            );
        }
        let c = from_file("policy = \"brc\"\nbrc_fill_under = false\nbrc_fill_slack = 2\n");
        assert!(!c.policy.brc.fill_under);
        assert_eq!(c.policy.brc.fill_slack, 2.0);
    }
}
