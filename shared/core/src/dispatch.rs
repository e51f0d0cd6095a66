//! The two-stage batch-admission dispatcher (one call per decode step) and the pool-bypass
//! router (one call per arriving request).
//!
//! Stage 1 (abundant capacity, `S_tot > S_greedy`): one request at a time, the best
//! single-request score for one chosen worker, found in O(log n) from the pool's size index.
//! Stage 2 (scarce capacity): workers in order of (free slots, min_h m_{g,h}); each gets the
//! best subset of `R_max` candidates; when no subset scores above zero it still gets the single
//! best one (the starvation guard), and is then done for this tick. The paper's candidates are
//! the `R_max` oldest waiting requests and its subsets fill a worker up to the max; at wide-EP
//! scale (G = 64..128) both lose half the gain, so by default the candidates come
//! from the tick's head ([`Stage2Window::TickHead`]) and fill to the mean ([`Stage2Fill::Mean`]).
//!
//! At moderate load (free slots everywhere, a few arrivals per tick) Stage 1 places every
//! request, and nearly every placement fits under the max: the F-score ties at `s_i` on most
//! ranks and the tie-break alone decides. Filling ranks up to the max raises them towards it,
//! so by default Stage 1 fills only to halfway between the group's mean and its max
//! ([`DispatcherConfig::stage1_level`]; moderate load).
//!
//! Two more choices narrow what is left of the gap at B = 64: a pool that holds no
//! more requests than the tick's free slots is placed whole by Stage 1 (nothing is left to
//! choose but where each goes; [`DispatcherConfig::stage1_shallow`]), and Stage 2 leaves a slot
//! empty on a worker above the mean rather than raise it further ([`Stage2Hold::AboveMean`]).
//!
//! BR-H can also measure Stage 2's mean fill at each rank's next predicted finish instead of now
//! ([`Stage2Target::NextFinish`], opt-in).
//!
//! The paper leaves three choices open; each is a [`DispatcherConfig`] field and the simulator
//! (see tools/sim/README.md) chose the defaults, as for the two Stage 2 choices above.

use serde::{Deserialize, Serialize};

use crate::pool::{Pool, PoolEntry};
use crate::score::{Margins, br0_score};
use crate::state::ClusterState;
use crate::{CoreError, RequestKey, WorkerId};

mod bypass;
mod config;
mod select;
mod trust;

pub use bypass::route_bypass;
pub use config::{
    ColdStart, DispatcherConfig, MAX_R_MAX, Stage1Scope, Stage1Worker, Stage2Fill, Stage2Hold,
    Stage2Target, Stage2Window, TieBreak,
};
use select::best_subset_with;
use select::{
    Head, all_margins_zero, best_single, best_worker, climbs, stage1_worker, stage2_worker,
};
pub use select::{best_subset, best_subset_counted};
pub use trust::{HintTrust, MIN_HINTED_FINISHES};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Stage {
    Greedy,
    Subset,
    /// Stage 2's starvation guard: admitted although no subset scored above zero.
    Guard,
    Bypass,
    /// A baseline's on-arrival choice.
    Baseline,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Admission {
    pub key: RequestKey,
    pub worker: WorkerId,
    pub prompt_tokens: u32,
    /// The F-score of the subset this request was admitted in (NaN for baselines).
    pub score: f64,
    pub stage: Stage,
}

/// One batch admission. Admitted requests leave `pool` and are appended to `out`, in order;
/// the caller applies them to σ. `margins` must have been built from `state` for this tick.
pub fn dispatch_tick(
    cfg: &DispatcherConfig,
    pool: &mut Pool,
    state: &ClusterState,
    margins: &mut Margins,
    out: &mut Vec<Admission>,
) {
    let free: Vec<u32> = state.workers().iter().map(|w| w.free_slots()).collect();
    let s_tot: u32 = free.iter().sum();
    // A shallow pool (every waiting request fits this tick's free slots) is Stage 1's whole.
    let s_greedy = if cfg.stage1_shallow && pool.len() <= s_tot as usize {
        0
    } else {
        cfg.s_greedy
            .unwrap_or(state.live_workers() * cfg.r_max as u32)
    };
    let live = state.live_workers().max(1);
    let load_sum = state.live_worker_ids().map(|w| margins.load(w)).sum();
    let (climb, climb_mean, fill_weight) = match cfg.stage2_target {
        Stage2Target::Now => (Vec::new(), 0.0, 1.0),
        Stage2Target::NextFinish => {
            let (climb, mean) = climbs(state, margins);
            (climb, mean, margins.reward_per_token())
        }
    };
    let mut t = Tick {
        pool,
        margins,
        free,
        s_tot,
        load_sum,
        live: f64::from(live),
        climb,
        climb_mean,
        fill_weight,
        stagger: cfg.stagger_weight,
        state,
        schedules: Vec::new(),
        out,
    };

    // Stage 1: abundant capacity. Candidates: the whole pool, or just the head batch.
    let mut head = match cfg.stage1_scope {
        Stage1Scope::WholePool => None,
        Stage1Scope::HeadBatch => {
            let budget = t.s_tot.saturating_sub(s_greedy) as usize;
            let mut batch = Pool::new();
            for e in t.pool.oldest(budget) {
                // keys are unique in `pool`, so they are unique here
                let _ = batch.push(e.clone());
            }
            Some(batch)
        }
    };
    if cfg.stage1_worker == Stage1Worker::ByScore {
        let mut order: Vec<PoolEntry> = match head.take() {
            Some(batch) => batch.iter().cloned().collect(),
            None => t.pool.iter().cloned().collect(),
        };
        // largest first; the sort is stable, so equal sizes keep arrival order
        order.sort_by_key(|e| std::cmp::Reverse(e.prompt_tokens));
        let mut admitted = vec![0u32; t.free.len()];
        for entry in order {
            if t.s_tot <= s_greedy {
                break;
            }
            let s = f64::from(entry.prompt_tokens);
            let target = t.stage1_target(cfg.stage1_level, state);
            let Some((w, score)) = best_worker(
                cfg.tie_break,
                state,
                &t.free,
                &admitted,
                t.margins,
                s,
                target,
            ) else {
                break;
            };
            admitted[w as usize] += 1;
            t.admit(&entry, w, score, Stage::Greedy);
        }
    } else {
        while t.s_tot > s_greedy && !t.pool.is_empty() {
            let Some(w) = stage1_worker(cfg.stage1_worker, &t.free, t.margins) else {
                break;
            };
            let candidates = head.as_ref().unwrap_or(t.pool);
            let all_level =
                cfg.cold_start == ColdStart::LargestFirst && all_margins_zero(state, t.margins);
            let pick = if all_level {
                candidates.largest().cloned()
            } else {
                best_single(candidates, t.margins, w)
            };
            let Some(entry) = pick else { break };
            if let Some(batch) = head.as_mut() {
                batch.remove(entry.key);
            }
            let score = t.margins.score(w, f64::from(entry.prompt_tokens));
            t.admit(&entry, w, score, Stage::Greedy);
        }
    }

    // Stage 2: scarce capacity. Each worker is served until it admits with a non-positive score.
    let mut done = vec![false; t.free.len()];
    let mut window: Vec<PoolEntry> = Vec::with_capacity(cfg.r_max);
    // With the tick-head window: the head, indexed by size, and the candidate scratch space;
    // `picked[i]` is the head index of `window[i]`.
    let mut tick_head = match cfg.stage2_window {
        Stage2Window::Oldest => None,
        Stage2Window::TickHead => {
            let len = (t.s_tot as usize).saturating_add(cfg.stage2_reach());
            Some(Head::new(t.pool, len))
        }
    };
    let mut near: Vec<(f64, u32)> = Vec::with_capacity(2 * cfg.r_max);
    let mut picked: Vec<u32> = Vec::with_capacity(cfg.r_max);
    while !t.pool.is_empty() {
        let Some(w) = stage2_worker(&t.free, &done, t.margins) else {
            break;
        };
        let fill = cfg.stage2_fill;
        window.clear();
        match tick_head.as_ref() {
            None => window.extend(t.pool.oldest(cfg.r_max).cloned()),
            Some(head) => {
                let peak = t.stage2_peak(fill, w);
                let tick = &t;
                head.candidates(
                    peak,
                    |ds| tick.stage2_score(fill, w, ds, 1),
                    cfg.r_max,
                    &mut near,
                    &mut picked,
                );
                window.extend(picked.iter().map(|&i| head.entries[i as usize].clone()));
            }
        }
        if window.is_empty() {
            // the head is used up (it holds at least as many requests as the tick has slots,
            // so only when the pool held fewer)
            break;
        }
        let sizes: Vec<f64> = window.iter().map(|e| f64::from(e.prompt_tokens)).collect();
        let (mask, fill_score) = if t.stagger > 0.0 {
            t.schedule(w);
            let extra: Vec<f64> = window
                .iter()
                .map(|e| t.stagger_bonus(w, e.expected_output))
                .collect();
            best_subset_with(&sizes, &extra, t.free[w as usize] as usize, |ds, k| {
                t.stage2_score(fill, w, ds, k)
            })
        } else {
            best_subset_counted(&sizes, t.free[w as usize] as usize, |ds, k| {
                t.stage2_score(fill, w, ds, k)
            })
        };
        let hold = fill == Stage2Fill::Mean
            && fill_score < 0.0
            && match cfg.stage2_hold {
                Stage2Hold::Never => false,
                Stage2Hold::AboveMean => t.mean_gap(w) < 0.0,
                Stage2Hold::Worse => true,
            };
        if hold {
            done[w as usize] = true;
            continue;
        }
        // Admitted or guarded by the F-score itself (−ΔI), whatever the fill preferred.
        let chosen: f64 = (0..sizes.len())
            .filter(|i| mask & (1 << i) != 0)
            .map(|i| sizes[i])
            .sum();
        let score = if mask == 0 {
            f64::NEG_INFINITY
        } else {
            t.margins.score_subset(w, chosen, mask.count_ones())
        };
        if score > 0.0 {
            for (i, entry) in window.iter().enumerate() {
                if mask & (1 << i) != 0 {
                    if let Some(head) = tick_head.as_mut() {
                        head.take(picked[i]);
                    }
                    t.admit(entry, w, score, Stage::Subset);
                }
            }
        } else {
            let (i, _) = sizes
                .iter()
                .enumerate()
                .map(|(i, &s)| {
                    let bonus = if t.stagger > 0.0 {
                        t.stagger_bonus(w, window[i].expected_output)
                    } else {
                        0.0
                    };
                    (i, t.stage2_score(fill, w, s, 1) + bonus)
                })
                .fold(
                    (0, f64::NEG_INFINITY),
                    |best, c| if c.1 > best.1 { c } else { best },
                );
            let score = t.margins.score(w, sizes[i]);
            if let Some(head) = tick_head.as_mut() {
                head.take(picked[i]);
            }
            t.admit(&window[i], w, score, Stage::Guard);
            done[w as usize] = true;
        }
    }
}

/// One tick's working state: what admitting a request changes.
struct Tick<'a> {
    pool: &'a mut Pool,
    margins: &'a mut Margins,
    /// Free slots per worker, as admissions take them.
    free: Vec<u32>,
    /// `S_tot`: the sum of `free`.
    s_tot: u32,
    /// Σ of the live workers' loads, as admissions add to them (Stage 2's mean fill).
    load_sum: f64,
    live: f64,
    /// With [`Stage2Target::NextFinish`]: per worker, what it climbs before its next predicted
    /// finish (empty otherwise), and the mean of that over the live workers.
    climb: Vec<f64>,
    climb_mean: f64,
    /// What a token past the mean costs Stage 2's mean fill, per token the fill falls short:
    /// 1 (in BR-0's units), or with [`Stage2Target::NextFinish`] the score's own reward per
    /// token, `α·Σd` (BR-H: about 7 with the paper's γ), so that the fill, not the horizon
    /// reward, decides where the rank lands.
    fill_weight: f64,
    /// `DispatcherConfig::stagger_weight`.
    stagger: f64,
    state: &'a ClusterState,
    /// With the stagger term: per worker (once asked), its running and admitted requests'
    /// expected finishes in steps from now, ascending.
    schedules: Vec<Option<Vec<u32>>>,
    out: &'a mut Vec<Admission>,
}

impl Tick<'_> {
    /// What Stage 2 maximises for worker w and a subset of `requests` requests: the F-score,
    /// less (with the mean fill) twice what `delta_s` puts the worker past the mean.
    fn stage2_score(&self, fill: Stage2Fill, w: WorkerId, delta_s: f64, requests: u32) -> f64 {
        let f = self.margins.score_subset(w, delta_s, requests);
        match fill {
            Stage2Fill::Max => f,
            Stage2Fill::Mean => f - 2.0 * self.fill_weight * (delta_s - self.mean_gap(w)).max(0.0),
        }
    }

    /// The load Stage 1 fills a worker up to, `L̄ + level·(M − L̄)` over the live workers as
    /// this tick's admissions left them; `None` at level 1 (the F-score alone, up to the max).
    fn stage1_target(&self, level: f64, state: &ClusterState) -> Option<f64> {
        if level >= 1.0 {
            return None;
        }
        // every live worker's load plus its margin is the max (h = 0)
        let w = state.live_worker_ids().next()?;
        let max = self.margins.load(w) + self.margins.margin(w, 0);
        let mean = self.load_sum / self.live;
        Some(mean + level * (max - mean))
    }

    /// `L̄ − L_g` (negative above the mean), or with [`Stage2Target::NextFinish`] the same
    /// for the loads at each rank's next finish.
    fn mean_gap(&self, w: WorkerId) -> f64 {
        let gap = self.load_sum / self.live - self.margins.load(w);
        match self.climb.get(w as usize) {
            Some(c) => gap - (c - self.climb_mean),
            None => gap,
        }
    }

    /// The prompt size Stage 2's score peaks at for worker w.
    fn stage2_peak(&self, fill: Stage2Fill, w: WorkerId) -> f64 {
        let peak = self.margins.best_size(w);
        match fill {
            Stage2Fill::Max => peak,
            Stage2Fill::Mean => peak.min(self.mean_gap(w)),
        }
    }

    /// Builds worker w's schedule of expected finishes if this tick has not yet.
    fn schedule(&mut self, w: WorkerId) {
        if self.schedules.len() <= w as usize {
            self.schedules.resize(w as usize + 1, None);
        }
        if self.schedules[w as usize].is_none() {
            let mut finishes: Vec<u32> = self
                .state
                .requests_of(w)
                .filter_map(|r| {
                    r.expected_output
                        .map(|e| e.saturating_sub(r.generated).max(1))
                })
                .collect();
            finishes.sort_unstable();
            self.schedules[w as usize] = Some(finishes);
        }
    }

    /// The stagger term for a request expected to run `expected` steps on worker w (0 without
    /// a hint or a schedule): `w·n_g·min(d, Δ)`, d the distance from its expected finish to
    /// the nearest one already on the rank, Δ the schedule's mean gap. A finish that lands
    /// where the rank has none shortens a climb; one that lands on another's does not.
    /// Capped at Δ so that requests expected to outlast the schedule are not put off.
    fn stagger_bonus(&self, w: WorkerId, expected: Option<u32>) -> f64 {
        let (Some(f), Some(Some(finishes))) = (expected, self.schedules.get(w as usize)) else {
            return 0.0;
        };
        let Some(&last) = finishes.last() else {
            return 0.0;
        };
        let gap = f64::from(last) / finishes.len() as f64;
        let at = finishes.partition_point(|&x| x <= f);
        let before = if at == 0 { f } else { f - finishes[at - 1] };
        let after = finishes.get(at).map_or(u32::MAX, |&b| b - f);
        let d = f64::from(before.min(after)).min(gap);
        let n = f64::from(self.state.workers()[w as usize].requests());
        self.stagger * n * d
    }

    fn admit(&mut self, entry: &PoolEntry, w: WorkerId, score: f64, stage: Stage) {
        if let (Some(f), Some(Some(finishes))) =
            (entry.expected_output, self.schedules.get_mut(w as usize))
        {
            let at = finishes.partition_point(|&x| x <= f);
            finishes.insert(at, f);
        }
        self.pool.remove(entry.key);
        self.margins.admit(w, f64::from(entry.prompt_tokens));
        self.load_sum += f64::from(entry.prompt_tokens);
        self.free[w as usize] -= 1;
        self.s_tot -= 1;
        self.out.push(Admission {
            key: entry.key,
            worker: w,
            prompt_tokens: entry.prompt_tokens,
            score,
            stage,
        });
    }
}
