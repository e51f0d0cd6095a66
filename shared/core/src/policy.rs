//! One policy trait over borrowed views of σ, the baselines today's routers use, the
//! BalanceRoute policies, and a factory that builds any of them by name.
//!
//! Two modes, as in real systems:
//! * [`Mode::OnArrival`]: the policy names a worker as each request arrives, and the request
//!   waits in that worker's local queue (vLLM, SGLang, every router in use today; also BR-0's
//!   pool bypass);
//! * [`Mode::Pooled`]: requests wait in a central pool and the policy admits a batch once per
//!   decode step (BR-0, BR-H, and BR-C's prefill waves for colocated prefill).

use std::fmt;
use std::str::FromStr;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::dispatch::{Admission, DispatcherConfig, HintTrust, dispatch_tick, route_bypass};
use crate::pool::{Pool, PoolEntry};
use crate::predict::{CacheCounts, Finished, Oracle, PredictionCache, Predictor, PredictorStats};
use crate::score::{HorizonParams, Margins};
use crate::state::{ClusterState, WorkerInfo};
use crate::{CoreError, WorkerId};

mod brc;
pub use brc::{BrcConfig, MAX_FILL_SLACK, MAX_LOOKAHEAD};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    OnArrival,
    Pooled,
}

pub trait Policy: Send + fmt::Debug {
    /// The name it was built from (`jsq`, `br0`, …).
    fn name(&self) -> &'static str;
    fn mode(&self) -> Mode;
    /// On-arrival policies: the worker for this request, `None` when no worker is live.
    /// Pooled policies return `None` (the request belongs in the pool).
    fn route(&mut self, entry: &PoolEntry, state: &ClusterState) -> Option<WorkerId>;
    /// Pooled policies: one batch admission; admitted requests leave `pool` and are appended to
    /// `out`. On-arrival policies do nothing.
    fn dispatch(&mut self, pool: &mut Pool, state: &ClusterState, out: &mut Vec<Admission>);
    /// A request finished (BR-H's predictors learn from this).
    fn observe_finished(&mut self, _finished: &Finished) {}
    /// What BR-H's predictor has learned and holds; `None` for a policy without one.
    fn predictor_stats(&self) -> Option<PredictorStats> {
        None
    }
    /// How BR-H's prediction cache answered over its life; `None` for a policy without a
    /// predictor. Cheap enough to ask after every tick.
    fn prediction_counts(&self) -> Option<CacheCounts> {
        None
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PredictorKind {
    Survival,
    ExactMatch,
    Oracle,
    /// The client's expected output length, trusted as far as it has proved right.
    Hinted,
    /// Hinted's model learned per request class (the gateway's class key).
    Classed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum PolicyKind {
    Random,
    RoundRobin,
    PowerOfTwo,
    /// Join the shortest queue: fewest queued + running requests.
    Jsq,
    /// vLLM's internal DP balancer: argmin 4·waiting + running.
    VllmDp,
    /// Least tokens (SGLang's minimum_tokens, SMG's DP minimum-tokens).
    MinTokens,
    Br0,
    Br0Bypass,
    BrH(PredictorKind),
    /// BR-C: prefill waves for ranks that prefill their own prompts (see [`BrcConfig`]).
    Brc,
}

impl PolicyKind {
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Random => "random",
            PolicyKind::RoundRobin => "rr",
            PolicyKind::PowerOfTwo => "p2c",
            PolicyKind::Jsq => "jsq",
            PolicyKind::VllmDp => "vllm-dp",
            PolicyKind::MinTokens => "mintok",
            PolicyKind::Br0 => "br0",
            PolicyKind::Br0Bypass => "br0-bypass",
            PolicyKind::BrH(PredictorKind::ExactMatch) => "brh",
            PolicyKind::BrH(PredictorKind::Survival) => "brh-survival",
            PolicyKind::BrH(PredictorKind::Oracle) => "brh-oracle",
            PolicyKind::BrH(PredictorKind::Hinted) => "brh-hinted",
            PolicyKind::BrH(PredictorKind::Classed) => "brh-class",
            PolicyKind::Brc => "brc",
        }
    }

    /// Every accepted name (`brh-exact` is an alias of `brh`).
    pub fn names() -> &'static [&'static str] {
        &[
            "random",
            "rr",
            "p2c",
            "jsq",
            "vllm-dp",
            "mintok",
            "br0",
            "br0-bypass",
            "brh",
            "brh-survival",
            "brh-exact",
            "brh-oracle",
            "brh-hinted",
            "brh-class",
            "brc",
        ]
    }

    pub fn mode(self) -> Mode {
        match self {
            PolicyKind::Br0 | PolicyKind::BrH(_) | PolicyKind::Brc => Mode::Pooled,
            _ => Mode::OnArrival,
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "random" => PolicyKind::Random,
            "rr" | "round-robin" => PolicyKind::RoundRobin,
            "p2c" | "power-of-two" => PolicyKind::PowerOfTwo,
            "jsq" => PolicyKind::Jsq,
            "vllm-dp" => PolicyKind::VllmDp,
            "mintok" | "min-tokens" | "least-tokens" => PolicyKind::MinTokens,
            "br0" => PolicyKind::Br0,
            "br0-bypass" => PolicyKind::Br0Bypass,
            "brh" | "brh-exact" => PolicyKind::BrH(PredictorKind::ExactMatch),
            "brh-survival" => PolicyKind::BrH(PredictorKind::Survival),
            "brh-oracle" => PolicyKind::BrH(PredictorKind::Oracle),
            "brh-hinted" => PolicyKind::BrH(PredictorKind::Hinted),
            "brh-class" => PolicyKind::BrH(PredictorKind::Classed),
            "brc" => PolicyKind::Brc,
            other => {
                return Err(CoreError::InvalidConfig(format!(
                    "unknown policy {other:?}; expected one of {}",
                    PolicyKind::names().join(", ")
                )));
            }
        })
    }
}

impl TryFrom<String> for PolicyKind {
    type Error = CoreError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<PolicyKind> for String {
    fn from(k: PolicyKind) -> String {
        k.name().to_owned()
    }
}

/// Everything needed to build a policy. Serde-friendly so services read it from config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyConfig {
    pub kind: PolicyKind,
    #[serde(default)]
    pub dispatcher: DispatcherConfig,
    #[serde(default)]
    pub horizon: HorizonParams,
    /// BR-C's wave rules (read by `brc` only).
    #[serde(default)]
    pub brc: BrcConfig,
    /// Seed for the randomised baselines (and nothing else: the rest is deterministic).
    #[serde(default)]
    pub seed: u64,
}

impl PolicyConfig {
    pub fn new(kind: PolicyKind) -> Self {
        Self {
            kind,
            dispatcher: DispatcherConfig::default(),
            horizon: HorizonParams::default(),
            brc: BrcConfig::default(),
            seed: 0,
        }
    }

    pub fn validate(&self) -> Result<(), CoreError> {
        self.dispatcher.validate()?;
        self.brc.validate()?;
        let h = &self.horizon;
        if h.horizon > 4096 {
            return Err(CoreError::InvalidConfig(format!(
                "horizon {} is above 4096 steps",
                h.horizon
            )));
        }
        if !(h.gamma > 0.0 && h.gamma <= 1.0) {
            return Err(CoreError::InvalidConfig(format!(
                "gamma must be in (0, 1], got {}",
                h.gamma
            )));
        }
        if !(h.alpha.is_finite() && h.alpha > 0.0)
            || h.beta.is_some_and(|b| !(b.is_finite() && b > 0.0))
        {
            return Err(CoreError::InvalidConfig(
                "alpha and beta must be positive and finite".into(),
            ));
        }
        h.predictor.validate().map_err(CoreError::InvalidConfig)?;
        if !(0.0..=1.0).contains(&h.gate) {
            return Err(CoreError::InvalidConfig(format!(
                "gate must be in [0, 1], got {}",
                h.gate
            )));
        }
        if !(h.request_cost_tokens.is_finite() && h.request_cost_tokens >= 0.0) {
            return Err(CoreError::InvalidConfig(format!(
                "request_cost_tokens must be finite and >= 0, got {}",
                h.request_cost_tokens
            )));
        }
        Ok(())
    }
}

/// Builds a policy from its configuration.
pub fn build_policy(cfg: &PolicyConfig) -> Result<Box<dyn Policy>, CoreError> {
    cfg.validate()?;
    let rng = SmallRng::seed_from_u64(cfg.seed);
    Ok(match cfg.kind {
        PolicyKind::Random => Box::new(RandomPolicy { rng }),
        PolicyKind::RoundRobin => Box::new(RoundRobin { next: 0 }),
        PolicyKind::PowerOfTwo => Box::new(PowerOfTwo { rng }),
        PolicyKind::Jsq => Box::new(ArgMin {
            name: "jsq",
            key: |w| u64::from(w.requests()),
        }),
        PolicyKind::VllmDp => Box::new(ArgMin {
            name: "vllm-dp",
            key: |w| 4 * u64::from(w.queued) + u64::from(w.running),
        }),
        PolicyKind::MinTokens => Box::new(ArgMin {
            name: "mintok",
            key: WorkerInfo::load,
        }),
        PolicyKind::Br0 => Box::new(BalanceRoute {
            kind: cfg.kind,
            cfg: cfg.clone(),
            predictor: None,
            cache: PredictionCache::new(),
            hint_trust: HintTrust::default(),
        }),
        PolicyKind::Brc => Box::new(Brc {
            waves: brc::Waves::new(cfg.brc),
        }),
        PolicyKind::Br0Bypass => Box::new(Br0Bypass {
            cfg: cfg.dispatcher,
        }),
        PolicyKind::BrH(p) => {
            let predictor: Box<dyn Predictor> = match p {
                PredictorKind::Survival => Box::new(cfg.horizon.predictor.survival()),
                PredictorKind::ExactMatch => Box::new(cfg.horizon.predictor.exact_match()),
                PredictorKind::Oracle => Box::new(Oracle),
                PredictorKind::Hinted => Box::new(cfg.horizon.predictor.hinted()),
                PredictorKind::Classed => Box::new(cfg.horizon.predictor.classed()),
            };
            Box::new(BalanceRoute {
                kind: cfg.kind,
                cfg: cfg.clone(),
                predictor: Some(predictor),
                cache: PredictionCache::new(),
                hint_trust: HintTrust::default(),
            })
        }
    })
}

/// Workers a baseline may route to: live and accepting new requests.
fn live(state: &ClusterState) -> Vec<WorkerId> {
    state.accepting_worker_ids().collect()
}

#[derive(Debug)]
struct RandomPolicy {
    rng: SmallRng,
}

impl Policy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }
    fn mode(&self) -> Mode {
        Mode::OnArrival
    }
    fn route(&mut self, _e: &PoolEntry, state: &ClusterState) -> Option<WorkerId> {
        let ids = live(state);
        (!ids.is_empty()).then(|| ids[self.rng.random_range(0..ids.len())])
    }
    fn dispatch(&mut self, _: &mut Pool, _: &ClusterState, _: &mut Vec<Admission>) {}
}

#[derive(Debug)]
struct RoundRobin {
    next: u32,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "rr"
    }
    fn mode(&self) -> Mode {
        Mode::OnArrival
    }
    fn route(&mut self, _e: &PoolEntry, state: &ClusterState) -> Option<WorkerId> {
        let ids = live(state);
        if ids.is_empty() {
            return None;
        }
        // the first live id at or after the cursor, wrapping
        let pick = ids
            .iter()
            .copied()
            .find(|&w| w >= self.next)
            .unwrap_or(ids[0]);
        self.next = pick + 1;
        Some(pick)
    }
    fn dispatch(&mut self, _: &mut Pool, _: &ClusterState, _: &mut Vec<Admission>) {}
}

#[derive(Debug)]
struct PowerOfTwo {
    rng: SmallRng,
}

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "p2c"
    }
    fn mode(&self) -> Mode {
        Mode::OnArrival
    }
    fn route(&mut self, _e: &PoolEntry, state: &ClusterState) -> Option<WorkerId> {
        let ids = live(state);
        match ids.len() {
            0 => None,
            1 => Some(ids[0]),
            n => {
                let a = self.rng.random_range(0..n);
                let b = (a + 1 + self.rng.random_range(0..n - 1)) % n;
                let (wa, wb) = (ids[a], ids[b]);
                let ra = state.workers()[wa as usize].requests();
                let rb = state.workers()[wb as usize].requests();
                Some(if rb < ra { wb } else { wa })
            }
        }
    }
    fn dispatch(&mut self, _: &mut Pool, _: &ClusterState, _: &mut Vec<Admission>) {}
}

/// The argmin baselines: the live worker with the smallest key, lowest id on ties.
struct ArgMin {
    name: &'static str,
    key: fn(&WorkerInfo) -> u64,
}

impl fmt::Debug for ArgMin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArgMin").field("name", &self.name).finish()
    }
}

impl Policy for ArgMin {
    fn name(&self) -> &'static str {
        self.name
    }
    fn mode(&self) -> Mode {
        Mode::OnArrival
    }
    fn route(&mut self, _e: &PoolEntry, state: &ClusterState) -> Option<WorkerId> {
        state
            .accepting_worker_ids()
            .min_by_key(|&w| ((self.key)(&state.workers()[w as usize]), w))
    }
    fn dispatch(&mut self, _: &mut Pool, _: &ClusterState, _: &mut Vec<Admission>) {}
}

#[derive(Debug)]
struct Br0Bypass {
    cfg: DispatcherConfig,
}

impl Policy for Br0Bypass {
    fn name(&self) -> &'static str {
        "br0-bypass"
    }
    fn mode(&self) -> Mode {
        Mode::OnArrival
    }
    fn route(&mut self, e: &PoolEntry, state: &ClusterState) -> Option<WorkerId> {
        route_bypass(e, state, self.cfg.tie_break)
    }
    fn dispatch(&mut self, _: &mut Pool, _: &ClusterState, _: &mut Vec<Admission>) {}
}

/// BR-C: the central pool released in prefill waves.
#[derive(Debug)]
struct Brc {
    waves: brc::Waves,
}

impl Policy for Brc {
    fn name(&self) -> &'static str {
        "brc"
    }
    fn mode(&self) -> Mode {
        Mode::Pooled
    }
    fn route(&mut self, _e: &PoolEntry, _state: &ClusterState) -> Option<WorkerId> {
        None
    }
    fn dispatch(&mut self, pool: &mut Pool, state: &ClusterState, out: &mut Vec<Admission>) {
        self.waves.dispatch(pool, state, out);
    }
    fn observe_finished(&mut self, finished: &Finished) {
        self.waves.observe_finished(finished.output_tokens);
    }
}

/// BR-0 (no predictor) and BR-H (with one): the two-stage dispatcher over the central pool.
#[derive(Debug)]
struct BalanceRoute {
    kind: PolicyKind,
    cfg: PolicyConfig,
    predictor: Option<Box<dyn Predictor>>,
    /// BR-H: each request's prediction between ticks (unused by BR-0).
    cache: PredictionCache,
    /// How precise the clients' expected output lengths have proved (the stagger term's gate).
    hint_trust: HintTrust,
}

impl Policy for BalanceRoute {
    fn name(&self) -> &'static str {
        self.kind.name()
    }
    fn mode(&self) -> Mode {
        Mode::Pooled
    }
    fn route(&mut self, _e: &PoolEntry, _state: &ClusterState) -> Option<WorkerId> {
        None
    }
    fn dispatch(&mut self, pool: &mut Pool, state: &ClusterState, out: &mut Vec<Admission>) {
        if pool.is_empty() || state.total_free_slots() == 0 {
            return;
        }
        let mut margins = match &self.predictor {
            None => Margins::br0_with_request_cost(state, self.cfg.horizon.request_cost_tokens),
            Some(p) => {
                Margins::horizon_cached(state, &self.cfg.horizon, p.as_ref(), &mut self.cache)
            }
        };
        let mut cfg = self.cfg.dispatcher;
        if cfg.stagger_weight > 0.0 {
            cfg.stagger_weight *= self.hint_trust.factor();
        }
        dispatch_tick(&cfg, pool, state, &mut margins, out);
    }
    fn observe_finished(&mut self, finished: &Finished) {
        self.hint_trust.observe(finished);
        if let Some(p) = self.predictor.as_mut() {
            // Only the predictions that read what this observation changed are made again.
            self.cache.learned(p.learn(finished));
        }
    }
    fn predictor_stats(&self) -> Option<PredictorStats> {
        self.predictor.as_ref().map(|p| p.stats())
    }
    fn prediction_counts(&self) -> Option<CacheCounts> {
        self.predictor.as_ref().map(|_| self.cache.counts())
    }
}
