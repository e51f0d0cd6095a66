//! The F-score: the change in barrier idle `−ΔI` (`I = G·M − ΣL`, the paper's I) if a
//! candidate subset `Q` is admitted to worker g.
//!
//! BR-0: `F_g(Q) = Δs(Q) − G·(Δs(Q) − m_g)+` with `m_g = M − L_g`.
//! BR-H: `F_g(Q) = α·(1ᵀd)·Δs(Q) − β·(Δs(Q)·1 − m_g)+ᵀ d` over projected margins
//! `m_{g,h}`, h = 0..H, and discounts `d = (1, γ, …, γ^H)`. H = 0, α = 1, β = G is BR-0.
//!
//! [`Margins`] holds one tick's working view: projected loads per worker and horizon step,
//! their maxima, and the discount vector. Admitting a subset updates it in O(H), so a tick that
//! admits many requests never rebuilds it.
//!
//! # The request term (a step model with c ≠ 0)
//! With `T = a·max L + c·max n + b` (n: requests per rank; `step::StepModel`) the barrier idles
//! `a·(max L − L_g) + c·(max n − n_g)` on rank g, so the idle time of a step is
//! `a·I + c·I_n`, `I_n = G·max n − Σ n` the idle request-slots. Admitting Q to g changes
//! `I_n` exactly as it changes `I`, with `|Q|` for `Δs(Q)` and `m^n_g = max n − n_g` for
//! `m_g`: the safe regime (`|Q| ≤ m^n_g`) removes `|Q|` idle slots, each request past the max
//! costs `G − 1`. `−Δ(idle time)/a` is then
//!
//! `F_g(Q) = [Δs − G·(Δs − m_g)+] + κ·[|Q| − G·(|Q| − m^n_g)+]`, `κ = c/a`
//!
//! in KV tokens (`HorizonParams::request_cost_tokens`). BR-H discounts both terms alike over
//! the projected counts `m^n_{g,h}` (a request counts while it is predicted to run). κ = 0
//! (the default) is the paper's score, computed by the same instructions as before the term
//! existed. Why count the barrier this way and not as `max_g (a·L_g + c·n_g)`: it is the form
//! `br-sim calibrate` fits from `(max L, max n, T)` samples, and the twin runs.

use std::cell::Cell;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::predict::{
    PredictionCache, Predictor, PredictorConfig, expected_remaining, expected_remaining_or_alike,
    expected_remaining_with_reads,
};
use crate::state::{ClusterState, RequestInfo};
use crate::{Phase, WorkerId};

/// BR-0 in exact integer arithmetic (the algebra's reference form).
pub fn br0_score(delta_s: u64, margin: u64, workers: u32) -> i128 {
    let d = i128::from(delta_s);
    let overflow = (d - i128::from(margin)).max(0);
    d - i128::from(workers) * overflow
}

/// BR-H parameters. The paper uses H = 80 with (β, γ) = (43, 0.86) or (14.67, 0.64).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HorizonParams {
    /// `H`: how many decode steps ahead margins are projected.
    pub horizon: u32,
    /// `α`: reward scale.
    pub alpha: f64,
    /// `β`: overflow penalty; `None` means `G` (the BR-0 value).
    pub beta: Option<f64>,
    /// `γ`: discount per step.
    pub gamma: f64,
    /// Confidence gate: a request counts as finishing inside the horizon only when the
    /// predictor's probability of that is at least this; otherwise it is assumed to run on.
    pub gate: f64,
    /// `κ = c/a`: the KV tokens one request costs the barrier, the weight of the request term
    /// (module docs). 0 (the default) is the paper's score; BR-0 uses it too.
    #[serde(default)]
    pub request_cost_tokens: f64,
    /// How the online predictors learn and what they may hold (flattened: `prompt_buckets`,
    /// `max_hashes`, ... sit beside `horizon` in a config or a br-sim policy spec).
    #[serde(flatten)]
    pub predictor: PredictorConfig,
}

impl Default for HorizonParams {
    /// The paper's H = 80 with its (β, γ) = (43, 0.86) pair. br-sim chose this pair over
    /// (14.67, 0.64): steady-state imbalance 12.6k vs 13.1k (oracle) and 13.7k vs 16.0k
    /// (Survival) on paper-azure at G = 8; longer effective horizons (γ ≥ 0.95 with β = 8) were
    /// 5× worse, since far-future margins then outweigh overflow now. See tools/sim/README.md.
    fn default() -> Self {
        Self {
            horizon: 80,
            alpha: 1.0,
            beta: Some(43.0),
            gamma: 0.86,
            gate: 0.5,
            request_cost_tokens: 0.0,
            predictor: PredictorConfig::default(),
        }
    }
}

impl HorizonParams {
    /// BR-0 as a horizon score.
    pub fn br0() -> Self {
        Self {
            horizon: 0,
            alpha: 1.0,
            beta: None,
            gamma: 1.0,
            gate: 1.0,
            request_cost_tokens: 0.0,
            predictor: PredictorConfig::default(),
        }
    }

    /// BR-0 with the request term weighted `request_cost_tokens`.
    pub fn br0_with_request_cost(request_cost_tokens: f64) -> Self {
        Self {
            request_cost_tokens,
            ..Self::br0()
        }
    }
}

/// The first horizon step (1..=`steps`) at which request r no longer counts: `⌈ĉ_i⌉`, at
/// least 1 (it counts now), at most the horizon's end.
fn horizon_end(
    predictor: &dyn Predictor,
    r: &RequestInfo,
    horizon: u32,
    gate: f64,
    steps: usize,
) -> usize {
    end_step(expected_remaining(predictor, r, horizon, gate), steps)
}

/// `⌈ĉ_i⌉` as a horizon step: at least 1, at most `steps` (`(ĉ.ceil().max(1.0) as
/// usize).min(steps)`, without the call to `ceil` the baseline x86-64 target makes: every
/// request of a tick that fills the prediction cache comes here, most of them predicted to
/// run on, `ĉ = steps`).
fn end_step(remaining: f64, steps: usize) -> usize {
    if remaining >= steps as f64 {
        steps
    } else if remaining > 1.0 {
        // 1 < ĉ < steps: its integer part rounded up unless it is whole
        let t = remaining as usize;
        t + usize::from((t as f64) < remaining)
    } else {
        // at most 1, or NaN (which `max(1.0)` also makes 1)
        1
    }
}

/// A break of `F_g`'s slope for [`Margins::best_size`]: the margin at one horizon step. Ordered
/// so that a `BinaryHeap` (a max-heap) pops the smallest margin first, and of equal margins the
/// earliest step.
struct Break {
    margin: f64,
    step: usize,
}

impl Ord for Break {
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .margin
            .total_cmp(&self.margin)
            .then(other.step.cmp(&self.step))
    }
}

impl PartialOrd for Break {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Break {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Break {}

/// One tick's projected loads and margins.
#[derive(Debug, Clone)]
pub struct Margins {
    steps: usize,
    /// `loads[w * steps + h]`: projected load of worker w, h steps ahead.
    loads: Vec<f64>,
    /// `max[h]` over live workers.
    max: Vec<f64>,
    alive: Vec<bool>,
    discounts: Vec<f64>,
    discount_sum: f64,
    alpha: f64,
    beta: f64,
    /// κ of the request term; 0 leaves `counts` and `max_counts` empty and the score the
    /// paper's.
    request_cost: f64,
    /// `counts[w * steps + h]`: requests projected on worker w, h steps ahead (with κ > 0).
    counts: Vec<f64>,
    /// `max_counts[h]` over live workers (with κ > 0).
    max_counts: Vec<f64>,
    /// `min_h m_{g,h}` per worker, computed when first asked and kept until an admission
    /// changes it (see [`MinMargins`]).
    min_margins: MinMargins,
}

/// Two margins are equal when their loads, maxima and parameters are: which minimum margins
/// one of them has computed so far is not part of its value.
impl PartialEq for Margins {
    fn eq(&self, other: &Self) -> bool {
        let Self {
            steps,
            loads,
            max,
            alive,
            discounts,
            discount_sum,
            alpha,
            beta,
            request_cost,
            counts,
            max_counts,
            min_margins: _,
        } = self;
        *steps == other.steps
            && *loads == other.loads
            && *max == other.max
            && *alive == other.alive
            && *discounts == other.discounts
            && *discount_sum == other.discount_sum
            && *alpha == other.alpha
            && *beta == other.beta
            && *request_cost == other.request_cost
            && *counts == other.counts
            && *max_counts == other.max_counts
    }
}

/// Each worker's `min_h m_{g,h}`, computed when first asked and kept until an admission changes
/// it. A tick asks for it many times per admission: Stage 2 compares every worker's at each pick
/// (O(G·H) per pick, a fifth of BR-H's tick at G = 64, H = 80, recomputed), and the F-score of a
/// size at or under it has no penalty term, which is what 98% of that tick's ~2,000 scores are
/// (so they skip the O(H) penalty loop). An admission to w moves only w's margins unless it
/// raises `M(h)`, which moves every worker's. Each kept value is the fold `min_margin` computes,
/// so the answers are the uncached ones bit for bit. Interior mutability keeps the score `&self`,
/// as every caller holds it (a `Margins` is one tick's, on one thread).
#[derive(Debug, Clone)]
struct MinMargins {
    value: Vec<Cell<f64>>,
    fresh: Vec<Cell<bool>>,
}

impl MinMargins {
    fn new(workers: usize) -> Self {
        Self {
            value: vec![Cell::new(0.0); workers],
            fresh: vec![Cell::new(false); workers],
        }
    }

    fn forget_all(&self) {
        self.fresh.iter().for_each(|f| f.set(false));
    }

    fn forget(&self, w: WorkerId) {
        self.fresh[w as usize].set(false);
    }
}

impl Margins {
    /// BR-0 margins: the current loads (running + queued), H = 0.
    pub fn br0(state: &ClusterState) -> Self {
        Self::br0_with_request_cost(state, 0.0)
    }

    /// BR-0 margins with the request term weighted `request_cost_tokens` (κ = c/a; the
    /// requests of a worker are its running and queued ones, as its load is).
    pub fn br0_with_request_cost(state: &ClusterState, request_cost_tokens: f64) -> Self {
        let mut m = Self::empty(
            state,
            &HorizonParams::br0_with_request_cost(request_cost_tokens),
        );
        let counted = m.counted();
        for (w, info) in state.workers().iter().enumerate() {
            if info.alive {
                m.loads[w] = info.load() as f64;
                if counted {
                    m.counts[w] = f64::from(info.requests());
                }
            }
        }
        m.recompute_max();
        m
    }

    /// BR-H margins: each request's load `w_i + h` counts at step h while it is predicted to run
    /// (`h < ĉ_i`). Built with difference arrays in O(requests + G·H). Asks the predictor about
    /// every request; a policy that ticks repeatedly uses [`Margins::horizon_cached`].
    pub fn horizon(
        state: &ClusterState,
        params: &HorizonParams,
        predictor: &dyn Predictor,
    ) -> Self {
        let steps = params.horizon as usize + 1;
        Self::project(state, params, |_, r| {
            horizon_end(predictor, r, params.horizon, params.gate, steps)
        })
    }

    /// [`Margins::horizon`], asking the predictor only about requests whose prediction is not
    /// in `cache` (new ones, ones that generated a token since, or all of them after the
    /// predictor learned). Equal to the uncached margins by construction: the cache holds
    /// exactly the value the predictor would give again (see [`PredictionCache`]).
    pub fn horizon_cached(
        state: &ClusterState,
        params: &HorizonParams,
        predictor: &dyn Predictor,
        cache: &mut PredictionCache,
    ) -> Self {
        let steps = params.horizon as usize + 1;
        cache.begin_tick(params.horizon, params.gate, state.slot_count());
        Self::project(state, params, |slot, r| {
            cache.end(
                slot,
                r,
                || {
                    expected_remaining_or_alike(predictor, r, params.horizon, params.gate)
                        .map(|(remaining, reads)| (end_step(remaining, steps), reads))
                },
                || {
                    let (remaining, reads) =
                        expected_remaining_with_reads(predictor, r, params.horizon, params.gate);
                    (end_step(remaining, steps), reads)
                },
            )
        })
    }

    /// The difference-array projection shared by both builders: `end_of(slot, r)` is the first step
    /// (1..=H+1) at which request r no longer counts.
    fn project(
        state: &ClusterState,
        params: &HorizonParams,
        mut end_of: impl FnMut(usize, &RequestInfo) -> usize,
    ) -> Self {
        let mut m = Self::empty(state, params);
        let steps = m.steps;
        let counted = m.counted();
        // Per worker, one row of `steps + 1` differences. The requests are visited in slot
        // order, the order σ and the prediction cache hold them in memory (by worker they
        // would be visited in a scattered order); the sums are of whole tokens, exact in f64
        // in any order.
        let width = steps + 1;
        let rows = state.workers().len() * width;
        let mut constant = vec![0.0f64; rows];
        let mut slope = vec![0.0f64; rows];
        // requests per step (the request term only): one from now until its predicted end
        let mut present = vec![0.0f64; if counted { rows } else { 0 }];
        for (slot, r) in state.slotted_requests() {
            let w = r.worker as usize;
            if !m.alive.get(w).copied().unwrap_or(false) {
                continue;
            }
            let end = end_of(slot, r);
            let row = w * width;
            let kv = r.kv_tokens() as f64;
            constant[row] += kv;
            constant[row + end] -= kv;
            // A queued request starts writing once it runs; count growth for running ones.
            if r.phase == Phase::Running {
                slope[row] += 1.0;
                slope[row + end] -= 1.0;
            }
            if counted {
                present[row] += 1.0;
                present[row + end] -= 1.0;
            }
        }
        for (w, &alive) in m.alive.iter().enumerate() {
            if !alive {
                continue;
            }
            let row = w * width;
            let (mut c, mut s) = (0.0, 0.0);
            for h in 0..steps {
                c += constant[row + h];
                s += slope[row + h];
                m.loads[w * steps + h] = c + s * h as f64;
            }
            if counted {
                let mut n = 0.0;
                let counts = &mut m.counts[w * steps..(w + 1) * steps];
                for (count, delta) in counts.iter_mut().zip(&present[row..row + steps]) {
                    n += delta;
                    *count = n;
                }
            }
        }
        m.recompute_max();
        m
    }

    fn empty(state: &ClusterState, params: &HorizonParams) -> Self {
        let steps = params.horizon as usize + 1;
        let n = state.workers().len();
        let discounts: Vec<f64> = (0..steps).map(|h| params.gamma.powi(h as i32)).collect();
        let discount_sum = discounts.iter().sum();
        let g = f64::from(state.live_workers().max(1));
        let counted = params.request_cost_tokens > 0.0;
        Self {
            steps,
            loads: vec![0.0; n * steps],
            max: vec![0.0; steps],
            alive: state.workers().iter().map(|w| w.alive).collect(),
            discounts,
            discount_sum,
            alpha: params.alpha,
            beta: params.beta.unwrap_or(g),
            request_cost: if counted {
                params.request_cost_tokens
            } else {
                0.0
            },
            counts: if counted {
                vec![0.0; n * steps]
            } else {
                Vec::new()
            },
            max_counts: if counted {
                vec![0.0; steps]
            } else {
                Vec::new()
            },
            min_margins: MinMargins::new(n),
        }
    }

    /// Whether the score has the request term (κ > 0).
    fn counted(&self) -> bool {
        self.request_cost > 0.0
    }

    fn recompute_max(&mut self) {
        self.min_margins.forget_all();
        self.max.iter_mut().for_each(|x| *x = 0.0);
        self.max_counts.iter_mut().for_each(|x| *x = 0.0);
        let counted = self.counted();
        for (w, alive) in self.alive.iter().enumerate() {
            if *alive {
                for h in 0..self.steps {
                    self.max[h] = self.max[h].max(self.loads[w * self.steps + h]);
                    if counted {
                        self.max_counts[h] =
                            self.max_counts[h].max(self.counts[w * self.steps + h]);
                    }
                }
            }
        }
    }

    /// κ, the weight of the request term (0: the paper's score).
    pub fn request_cost_tokens(&self) -> f64 {
        self.request_cost
    }

    /// `m^n_{g,h} = max n(h) − n_g(h)`: free request-slots under the busiest worker (0 without
    /// the request term, which does not track counts).
    pub fn request_margin(&self, w: WorkerId, h: usize) -> f64 {
        if self.counted() {
            self.max_counts[h] - self.counts[w as usize * self.steps + h]
        } else {
            0.0
        }
    }

    pub fn horizon_steps(&self) -> usize {
        self.steps
    }

    /// `m_{g,h} = M(h) − L_g(h)`.
    pub fn margin(&self, w: WorkerId, h: usize) -> f64 {
        self.max[h] - self.loads[w as usize * self.steps + h]
    }

    /// `min_h m_{g,h}`: Stage 2's tie-break key.
    pub fn min_margin(&self, w: WorkerId) -> f64 {
        let i = w as usize;
        if self.min_margins.fresh[i].get() {
            return self.min_margins.value[i].get();
        }
        let min = (0..self.steps)
            .map(|h| self.margin(w, h))
            .fold(f64::INFINITY, f64::min);
        self.min_margins.value[i].set(min);
        self.min_margins.fresh[i].set(true);
        min
    }

    /// Current projected load of worker w (h = 0).
    pub fn load(&self, w: WorkerId) -> f64 {
        self.loads[w as usize * self.steps]
    }

    /// Projected load of worker w, h steps ahead (h < [`Margins::horizon_steps`]), with this
    /// tick's admissions counted at every step.
    pub fn projected_load(&self, w: WorkerId, h: usize) -> f64 {
        self.loads[w as usize * self.steps + h]
    }

    /// What one admitted token adds to the score while it fits under every margin: `α·Σd`
    /// (1 for BR-0). A penalty added to the score per token (Stage 2's mean fill) is in these
    /// units.
    pub fn reward_per_token(&self) -> f64 {
        self.alpha * self.discount_sum
    }

    /// `F_g({i})` for one request of `delta_s` prompt tokens.
    pub fn score(&self, w: WorkerId, delta_s: f64) -> f64 {
        self.score_subset(w, delta_s, 1)
    }

    /// `F_g(Q)` for a subset of `requests` requests with prompt load `delta_s` (the count
    /// matters only with the request term).
    pub fn score_subset(&self, w: WorkerId, delta_s: f64, requests: u32) -> f64 {
        let base = w as usize * self.steps;
        let mut penalty = 0.0;
        // At or under every margin each step adds d·0 = +0: the sum stays 0 without the loop.
        if delta_s > self.min_margin(w) {
            for h in 0..self.steps {
                let margin = self.max[h] - self.loads[base + h];
                // branch-free: a step under its margin adds d·0 = +0 here too
                penalty += self.discounts[h] * (delta_s - margin).max(0.0);
            }
        }
        let tokens = self.alpha * self.discount_sum * delta_s - self.beta * penalty;
        if !self.counted() {
            return tokens;
        }
        let k = f64::from(requests);
        let mut over_count = 0.0;
        for h in 0..self.steps {
            let over = k - (self.max_counts[h] - self.counts[base + h]);
            if over > 0.0 {
                over_count += self.discounts[h] * over;
            }
        }
        tokens + self.request_cost * (self.alpha * self.discount_sum * k - self.beta * over_count)
    }

    /// The prompt size that maximises `F_g` (F is concave and piecewise linear in Δs: it rises
    /// with slope α·Σd until the margins are used up, each margin passed taking β·d_h off). The
    /// request term does not depend on Δs, so it does not move the peak.
    pub fn best_size(&self, w: WorkerId) -> f64 {
        if self.steps == 1 {
            return self.margin(w, 0);
        }
        // The breaks in order of margin, then step (the order a stable sort by margin gives, so
        // the slope is summed the same way), taken from a heap: the slope usually turns within
        // the first few, and sorting all H + 1 cost a tenth of BR-H's tick at G = 64. (Two linear
        // scans for the first two breaks before the heap measured slower.)
        let mut breaks: BinaryHeap<Break> = (0..self.steps)
            .map(|h| Break {
                margin: self.margin(w, h),
                step: h,
            })
            .collect();
        let mut slope = self.alpha * self.discount_sum;
        while let Some(Break { margin, step }) = breaks.pop() {
            slope -= self.beta * self.discounts[step];
            if slope <= 0.0 {
                return margin;
            }
        }
        f64::INFINITY
    }

    /// Records an admission of one request of `delta_s` prompt tokens to worker w for the rest
    /// of the tick (it counts at every horizon step: its length is not known yet).
    pub fn admit(&mut self, w: WorkerId, delta_s: f64) {
        let base = w as usize * self.steps;
        let mut raised = false;
        for h in 0..self.steps {
            self.loads[base + h] += delta_s;
            if self.loads[base + h] > self.max[h] {
                self.max[h] = self.loads[base + h];
                raised = true;
            }
        }
        if self.counted() {
            for h in 0..self.steps {
                self.counts[base + h] += 1.0;
                self.max_counts[h] = self.max_counts[h].max(self.counts[base + h]);
            }
        }
        // a raised M(h) moves every worker's margin at h, else only w's moved
        if raised {
            self.min_margins.forget_all();
        } else {
            self.min_margins.forget(w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::predict::Oracle;
    use crate::state::RequestInfo;
    use proptest::prelude::*;

    /// One running request: (worker, prompt tokens, generated, output length).
    type Running = (u32, u32, u32, u32);

    /// Requests spread over `workers` ranks, as a proptest strategy: loads that differ from step
    /// to step of the horizon (each request leaves when its output is done).
    fn running(workers: u32) -> impl Strategy<Value = Vec<Running>> {
        prop::collection::vec(
            (0..workers, 1u32..5_000, 0u32..50, 1u32..120)
                .prop_map(|(w, p, g, out)| (w, p, g.min(out - 1), out)),
            0..(workers as usize * 6),
        )
    }

    /// σ of `workers` ranks of 64 slots holding `requests` (keys 1, 2, …, in the order
    /// given: interleaved over the workers, as arrivals fill a live σ).
    fn sigma_of(workers: u32, requests: &[Running]) -> ClusterState {
        let mut st = ClusterState::with_workers(&vec![64; workers as usize]);
        for (key, &(w, prompt, generated, out)) in requests.iter().enumerate() {
            let _ = st.reserve(RequestInfo {
                key: key as u64 + 1,
                worker: w,
                prompt_tokens: prompt,
                generated,
                phase: Phase::Running,
                prompt_hash: None,
                oracle_output: Some(out),
                expected_output: None,
                class: None,
            });
        }
        st
    }

    /// BR-H margins over `requests` (the oracle predictor: each request's end is known).
    fn horizon_margins(workers: u32, requests: &[Running], horizon: u32, gamma: f64) -> Margins {
        let st = sigma_of(workers, requests);
        let params = HorizonParams {
            horizon,
            gamma,
            ..HorizonParams::default()
        };
        Margins::horizon(&st, &params, &Oracle)
    }

    /// `best_size` as it was written first: sort every break by margin (stably, so equal
    /// margins keep step order) and scan until the slope turns.
    fn best_size_by_sorting(m: &Margins, w: WorkerId) -> f64 {
        if m.steps == 1 {
            return m.margin(w, 0);
        }
        let mut breaks: Vec<(f64, f64)> = (0..m.steps)
            .map(|h| (m.margin(w, h), m.discounts[h]))
            .collect();
        breaks.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut slope = m.alpha * m.discount_sum;
        for (margin, d) in breaks {
            slope -= m.beta * d;
            if slope <= 0.0 {
                return margin;
            }
        }
        f64::INFINITY
    }

    /// `min_h m_{g,h}` and `F_g` computed afresh from the loads, every step of the sum written
    /// out (the code the kept minimum margins replace).
    fn min_margin_afresh(m: &Margins, w: WorkerId) -> f64 {
        (0..m.steps)
            .map(|h| m.max[h] - m.loads[w as usize * m.steps + h])
            .fold(f64::INFINITY, f64::min)
    }

    fn score_afresh(m: &Margins, w: WorkerId, delta_s: f64) -> f64 {
        let base = w as usize * m.steps;
        let mut penalty = 0.0;
        for h in 0..m.steps {
            let over = delta_s - (m.max[h] - m.loads[base + h]);
            if over > 0.0 {
                penalty += m.discounts[h] * over;
            }
        }
        m.alpha * m.discount_sum * delta_s - m.beta * penalty
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// `end_step` is `⌈ĉ⌉` clamped to 1..=steps as `f64::ceil` gives it, for any ĉ
        /// (whole, fractional, an ulp off a whole step, out of range, NaN).
        #[test]
        fn end_step_is_the_clamped_ceiling(
            whole in -3i64..300,
            frac in prop_oneof![
                Just(0.0),
                Just(f64::EPSILON),
                Just(-f64::EPSILON),
                0.0f64..1.0,
            ],
            odd in prop_oneof![Just(None), Just(Some(f64::NAN)), Just(Some(f64::INFINITY)),
                Just(Some(f64::NEG_INFINITY)), Just(Some(1e300))],
            steps in 1usize..260,
        ) {
            let x = odd.unwrap_or(whole as f64 + frac);
            let want = (x.ceil().max(1.0) as usize).min(steps);
            prop_assert_eq!(end_step(x, steps), want, "ĉ = {}", x);
            let next = f64::from_bits((whole as f64).to_bits() + 1);
            let want = (next.ceil().max(1.0) as usize).min(steps);
            prop_assert_eq!(end_step(next, steps), want, "ĉ = {}", next);
        }

        /// The projection is its definition summed request by request: a live worker's load
        /// at step h is, over its requests still predicted to run then (h < ⌈ĉ_i⌉), w_i + h
        /// for a running one and w_i for a queued one, and its request count is how many;
        /// a fenced worker projects nothing. σ's slots hold the workers' requests interleaved
        /// (in the order they came), as a live σ does.
        #[test]
        fn the_projection_is_its_definition(
            requests in running(5),
            queued in prop::collection::vec((0u32..5, 1u32..5_000, 1u32..120), 0..8),
            fenced in prop::option::of(0u32..5),
            horizon in 0u32..90,
            request_cost_tokens in prop_oneof![Just(0.0), Just(1_250.0)],
        ) {
            let mut st = sigma_of(5, &requests);
            for (key, &(w, prompt, out)) in (requests.len() as u64 + 1..).zip(&queued) {
                let _ = st.reserve(RequestInfo {
                    key,
                    worker: w,
                    prompt_tokens: prompt,
                    generated: 0,
                    phase: Phase::Queued,
                    prompt_hash: None,
                    oracle_output: Some(out),
                    expected_output: None,
                    class: None,
                });
            }
            if let Some(w) = fenced {
                st.fence_worker(w).unwrap();
            }
            let params = HorizonParams {
                horizon,
                request_cost_tokens,
                ..HorizonParams::default()
            };
            let m = Margins::horizon(&st, &params, &Oracle);
            let steps = horizon as usize + 1;
            prop_assert_eq!(m.horizon_steps(), steps);
            for (w, info) in st.workers().iter().enumerate() {
                for h in 0..steps {
                    let (mut load, mut count) = (0.0, 0.0);
                    for r in st.requests_of(w as WorkerId) {
                        let end = horizon_end(&Oracle, r, horizon, params.gate, steps);
                        if h < end {
                            let growth = if r.phase == Phase::Running { h as f64 } else { 0.0 };
                            load += r.kv_tokens() as f64 + growth;
                            count += 1.0;
                        }
                    }
                    if !info.alive {
                        prop_assert_eq!((load, count), (0.0, 0.0), "fenced: nothing left");
                    }
                    prop_assert_eq!(m.projected_load(w as WorkerId, h), load);
                    if request_cost_tokens > 0.0 {
                        prop_assert_eq!(m.counts[w * steps + h], count);
                    }
                }
            }
        }

        /// The kept minimum margins, and the scores that skip their penalty loop under them,
        /// are the ones computed afresh, to the bit, whichever workers were asked between
        /// admissions (some admissions raise `M(h)`, most do not).
        #[test]
        fn kept_min_margins_and_scores_are_the_recomputed_ones(
            requests in running(6),
            horizon in 0u32..60,
            steps in prop::collection::vec(
                ((0u32..6, 0u32..6_000), prop::collection::vec((0u32..6, 0u32..8_000), 0..6)),
                0..30,
            ),
        ) {
            let mut m = horizon_margins(6, &requests, horizon, 0.86);
            for ((w, ds), asked) in steps {
                for (v, size) in asked {
                    prop_assert_eq!(m.min_margin(v).to_bits(), min_margin_afresh(&m, v).to_bits());
                    let size = f64::from(size);
                    prop_assert_eq!(m.score(v, size).to_bits(), score_afresh(&m, v, size).to_bits());
                }
                m.admit(w, f64::from(ds));
            }
            for v in 0..6 {
                prop_assert_eq!(m.min_margin(v).to_bits(), min_margin_afresh(&m, v).to_bits());
            }
        }

        /// The heap gives the sorted scan's answer to the bit, before and after admissions
        /// (which make many margins equal: a rank at the max has margin 0 at every step).
        #[test]
        fn best_size_is_the_sorted_scan(
            requests in running(8),
            horizon in 0u32..100,
            gamma in prop::sample::select(vec![0.5, 0.86, 0.99, 1.0]),
            admissions in prop::collection::vec((0u32..8, 0u32..20_000), 0..12),
        ) {
            let same = |m: &Margins| -> Result<(), TestCaseError> {
                for w in 0..8 {
                    prop_assert_eq!(m.best_size(w).to_bits(), best_size_by_sorting(m, w).to_bits());
                }
                Ok(())
            };
            let mut m = horizon_margins(8, &requests, horizon, gamma);
            same(&m)?;
            for (w, ds) in admissions {
                m.admit(w, f64::from(ds));
                same(&m)?;
            }
        }
    }

    fn state_with_loads(loads: &[u32]) -> ClusterState {
        let mut st = ClusterState::with_workers(&vec![64; loads.len()]);
        for (w, &l) in loads.iter().enumerate() {
            if l > 0 {
                st.reserve(RequestInfo {
                    key: w as u64 + 1,
                    worker: w as u32,
                    prompt_tokens: l,
                    generated: 0,
                    phase: Phase::Running,
                    prompt_hash: None,
                    oracle_output: None,
                    expected_output: None,
                    class: None,
                })
                .unwrap();
            }
        }
        st
    }

    #[test]
    fn regimes_and_continuity() {
        // G = 4, margin 100
        assert_eq!(br0_score(60, 100, 4), 60);
        assert_eq!(br0_score(100, 100, 4), 100);
        assert_eq!(br0_score(101, 100, 4), 101 - 4);
        // overflow form: G·m − (G−1)·Δs
        assert_eq!(br0_score(150, 100, 4), 4 * 100 - 3 * 150);
        // m = 0 always negative
        assert_eq!(br0_score(10, 0, 8), -(7 * 10));
        // G = 1: the lone worker is the max, every admission is overflow and F = 0: routing is moot
        assert_eq!(br0_score(123, 0, 1), 0);
    }

    #[test]
    fn margins_br0_match_integer_form() {
        let st = state_with_loads(&[500, 200, 0, 350]);
        let m = Margins::br0(&st);
        for w in 0..4u32 {
            let margin = 500 - st.worker(w).unwrap().load();
            for ds in [0u64, 1, 50, 150, 300, 499, 500, 501, 2000] {
                assert_eq!(m.score(w, ds as f64), br0_score(ds, margin, 4) as f64);
            }
            assert_eq!(m.best_size(w), margin as f64);
        }
    }

    #[test]
    fn admit_moves_the_max() {
        let st = state_with_loads(&[100, 0]);
        let mut m = Margins::br0(&st);
        m.admit(1, 60.0);
        assert_eq!((m.margin(0, 0), m.min_margin(0)), (0.0, 0.0));
        assert_eq!((m.margin(1, 0), m.min_margin(1)), (40.0, 40.0));
        // raises the max: worker 0's kept minimum margin must move with it
        m.admit(1, 90.0);
        assert_eq!((m.margin(0, 0), m.min_margin(0)), (50.0, 50.0));
        assert_eq!((m.margin(1, 0), m.min_margin(1)), (0.0, 0.0));
    }
}
