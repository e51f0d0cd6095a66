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

/// The most candidates Stage 2 may enumerate subsets of (2^8 = 256 subsets per worker).
pub const MAX_R_MAX: usize = 8;

/// Which worker Stage 1 serves next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Stage1Worker {
    /// The paper's wording: the worker with the most free slots (balances request counts).
    MostFreeSlots,
    /// The live worker with free slots and the least load (balances KV tokens).
    LeastLoaded,
    /// Request first: the Stage 1 candidates largest first (LPT), each to the worker with the
    /// best `F_g({i})`; ties (every worker where it fits scores `s_i`) go by `tie_break`. With
    /// fewest-requests this also balances how fast loads grow (one token per request per step).
    ByScore,
}

/// What Stage 1 does when every margin is 0 (all workers equally loaded, e.g. at cold start),
/// where the score of any request is `−(G−1)·s_i` and so favours the smallest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ColdStart {
    /// Follow the score literally: smallest request first.
    Score,
    /// Largest request first (LPT): the others then fill the margin it opens.
    LargestFirst,
}

/// Which waiting requests Stage 1 may pick from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Stage1Scope {
    /// The paper's wording: any request in the pool (by size index). Under a deep pool this
    /// reorders admissions by size (e.g. the largest prompts all first at cold start).
    WholePool,
    /// Only the oldest `S_tot − S_greedy` requests: the ones Stage 1 will admit this tick
    /// anyway. Stage 1 then decides only where each goes, never which go first.
    HeadBatch,
}

/// Which waiting requests Stage 2 chooses each worker's subset from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Stage2Window {
    /// The paper's wording: the `R_max` oldest waiting requests, read again after every
    /// admission. When a tick has many free slots (a large group: G·B/mean output of them free
    /// per step in steady state) the first workers served take the best of only `R_max`, and the
    /// tick as a whole admits nearly in arrival order.
    Oldest,
    /// The tick's head: the oldest `S_tot + max(stage2_lookahead, R_max − 1)` requests when
    /// Stage 2 starts (every request the tick could admit, plus a lookahead; the paper's window
    /// looks `R_max − 1` past the requests it admits). Each worker's `R_max` candidates are the
    /// ones of the head whose single scores are best for it (the sizes nearest its best size),
    /// so every worker chooses from the whole head. A tick that fills its slots passes over at
    /// most the lookahead, however many slots it fills.
    TickHead,
}

/// Up to which level Stage 2 fills a worker (which of the subsets that fit under the max it
/// prefers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Stage2Fill {
    /// The paper's F-score alone: every token admitted below the max is worth one, so each
    /// worker takes the largest subset that fits under the max. In a large group the max is an
    /// extreme of G loads, nearly every admission fits under it, and the score ties at `Δs`
    /// for every placement: workers are filled towards the max, and the many that end up near
    /// it keep the max from falling when its own requests finish.
    Max,
    /// To the group's mean: the score `F_g(Q) − 2·(Δs(Q) − (L̄ − L_g))+` (L̄ the mean load of
    /// the live workers, tracked through the tick), whose peak is at `min(m_g, L̄ − L_g)`: among
    /// subsets that fit under the max, the one that brings the worker nearest the mean (each
    /// token past the mean costs what a token short of it does). Equal to the F-score wherever
    /// the mean is above the max's reach (`Δs ≤ L̄ − L_g`).
    Mean,
}

/// How the pool-bypass router breaks ties between equal scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TieBreak {
    LowestId,
    /// Least `load()` (running + queued tokens), then lowest id.
    LeastLoaded,
    /// Fewest requests (running + queued), then least load.
    FewestRequests,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DispatcherConfig {
    /// Stage 1 runs while total free slots exceed this. `None`: `G·R_max`.
    pub s_greedy: Option<u32>,
    /// Stage 2 candidate window (the paper: 4, i.e. at most 16 subsets).
    pub r_max: usize,
    pub stage1_worker: Stage1Worker,
    pub stage1_scope: Stage1Scope,
    pub cold_start: ColdStart,
    pub tie_break: TieBreak,
    pub stage2_window: Stage2Window,
    pub stage2_fill: Stage2Fill,
    /// With the tick-head window: how many requests beyond the tick's free slots Stage 2 may
    /// choose from (at least `R_max − 1`, the paper's window's reach).
    pub stage2_lookahead: u32,
    /// Up to which level Stage 1's by-score placement fills a worker, between the group's
    /// mean load (0) and its max (1), in `0..=1`. Below 1 a placement is scored
    /// `F_g({i}) − 2·(s_i − (T − L_g))+` with `T = L̄ + level·(M − L̄)`: among the ranks where
    /// the request fits under the max (all of which score `F = s_i`), the ones it leaves at or
    /// below `T` win, and the tie-break chooses among those. 1 is the paper's F-score alone
    /// (fill to the max). Stage 2 is not affected (see `stage2_fill`).
    pub stage1_level: f64,
    /// Stage 1 also places the whole pool when it holds no more requests than the tick has
    /// free slots, however few those are: every waiting request is admitted this tick, so there
    /// is no choice of *which* (Stage 2's subset search) left, only of *where*.
    pub stage1_shallow: bool,
    /// When Stage 2 leaves a slot empty rather than move a worker away from the mean.
    pub stage2_hold: Stage2Hold,
    /// Which load Stage 2's mean fill (and its hold) compares ranks by.
    pub stage2_target: Stage2Target,
}

/// Which load of a rank Stage 2's mean fill brings to the group's mean (and the hold compares
/// with it). A full rank's load changes only at its own finishes: between two of them it climbs
/// by its running count every step. What an admission decides is where the rank stands until
/// its *next* finish (the refill of that slot corrects it again), so under a long-output
/// workload the rank that becomes the max is the one refilled longest before its next finish
/// (on paper-azure the max rank had been refilled 49 steps before under Poisson).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Stage2Target {
    /// The loads now (BR-0 has nothing else: its margins have no horizon).
    Now,
    /// Each rank's projected load just before its next predicted finish (its peak until the
    /// slot it frees is refilled), from the horizon projection: `L_g + climb_g`, where
    /// `climb_g` is what the rank's running requests add before the first step at which its
    /// projected load falls (the horizon's end if none does), and the mean is over the live
    /// ranks' peaks. A rank whose next finish is far off is filled below the mean by what it
    /// will climb more than the others; one about to finish takes a larger prompt. The fill
    /// then weighs a token past the target at the score's own reward per token (`α·Σd`), so
    /// that it, not the horizon reward, sets where the rank lands. Without a horizon (BR-0,
    /// H = 0) every climb is 0, the weight 1, and this is `Now`.
    ///
    /// Not the default (tools/sim/README.md, "BR-H measured at each rank's next finish"; B = 64,
    /// 5 seeds): at G ≥ 16 it lifts BR-H 2–7 points of the gap on the paper shapes, to level
    /// with or above BR-0 on paper-azure, but it is below BR-0 at G = 8 and (with online
    /// predictors) on paper-prop, and it takes away BR-H's gain on prompt-heavy short-output
    /// traffic (mooncake), where the horizon reward filling towards a max about to fall helps.
    NextFinish,
}

/// When Stage 2 (with the mean fill) leaves a worker's free slots empty for this tick rather
/// than admit. A worker's load changes only when it admits or one of its own requests ends, so
/// a request admitted to a worker already above the mean stays above it until that worker's
/// next finish; at B = 64 that is what put the max rank where it was (88–94% of the
/// steady steps the max rank had been left above the mean by its last admission).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Stage2Hold {
    /// Every free slot is offered a subset (the paper; the starvation guard admits even when
    /// nothing scores above zero).
    Never,
    /// A worker whose load is above the group's mean (as the tick has left them) and whose best
    /// subset scores below zero on the mean-fill score (admitting it leaves the worker further
    /// from the mean than an empty slot does) admits nothing this tick. Its slot waits for its
    /// own requests to end and bring it below the mean; the requests go to workers below it.
    /// Workers at or below the mean are never held, so a tick with any such worker free admits.
    AboveMean,
    /// As `AboveMean` below the mean too: any worker the best subset would take further from
    /// the mean is held. It removes more imbalance but leaves more slots empty, and loses
    /// throughput (tools/sim/README.md): kept for the comparison.
    Worse,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        Self {
            s_greedy: None,
            r_max: 4,
            stage1_worker: Stage1Worker::ByScore,
            stage1_scope: Stage1Scope::HeadBatch,
            cold_start: ColdStart::LargestFirst,
            tie_break: TieBreak::FewestRequests,
            stage2_window: Stage2Window::TickHead,
            stage2_fill: Stage2Fill::Mean,
            stage2_lookahead: 15,
            stage1_level: 0.5,
            stage1_shallow: true,
            stage2_hold: Stage2Hold::AboveMean,
            stage2_target: Stage2Target::Now,
        }
    }
}

impl DispatcherConfig {
    /// How many waiting requests a tick that fills its slots may pass over: the paper's
    /// `R_max − 1`, or the tick-head window's lookahead when that is larger.
    pub fn stage2_reach(&self) -> usize {
        match self.stage2_window {
            Stage2Window::Oldest => self.r_max - 1,
            Stage2Window::TickHead => (self.stage2_lookahead as usize).max(self.r_max - 1),
        }
    }

    pub fn validate(&self) -> Result<(), CoreError> {
        if self.r_max == 0 || self.r_max > MAX_R_MAX {
            return Err(CoreError::InvalidConfig(format!(
                "r_max must be in 1..={MAX_R_MAX}, got {}",
                self.r_max
            )));
        }
        if !(0.0..=1.0).contains(&self.stage1_level) {
            return Err(CoreError::InvalidConfig(format!(
                "stage1_level must be in 0..=1, got {}",
                self.stage1_level
            )));
        }
        Ok(())
    }
}

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
        let (mask, fill_score) =
            best_subset_counted(&sizes, t.free[w as usize] as usize, |ds, k| {
                t.stage2_score(fill, w, ds, k)
            });
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
                .map(|(i, &s)| (i, t.stage2_score(fill, w, s, 1)))
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

    fn admit(&mut self, entry: &PoolEntry, w: WorkerId, score: f64, stage: Stage) {
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

/// Per worker, what its projected load climbs before its first projected fall (its next
/// predicted finish), or over the whole horizon if it does not fall; 0 for a dead worker. And
/// the mean over the live workers. O(G·H).
fn climbs(state: &ClusterState, margins: &Margins) -> (Vec<f64>, f64) {
    let steps = margins.horizon_steps();
    let mut climb = vec![0.0; state.workers().len()];
    for w in state.live_worker_ids() {
        let mut peak = margins.projected_load(w, 0);
        for h in 1..steps {
            let next = margins.projected_load(w, h);
            if next < peak {
                break;
            }
            peak = next;
        }
        climb[w as usize] = peak - margins.load(w);
    }
    let live = f64::from(state.live_workers().max(1));
    let mean = state
        .live_worker_ids()
        .map(|w| climb[w as usize])
        .sum::<f64>()
        / live;
    (climb, mean)
}

fn all_margins_zero(state: &ClusterState, margins: &Margins) -> bool {
    state.live_worker_ids().all(|w| margins.margin(w, 0) <= 0.0)
}

fn stage1_worker(rule: Stage1Worker, free: &[u32], margins: &Margins) -> Option<WorkerId> {
    let candidates = free
        .iter()
        .enumerate()
        .filter(|(_, f)| **f > 0)
        .map(|(w, f)| (w as WorkerId, *f));
    match rule {
        // most free slots; ties: least loaded, then lowest id
        Stage1Worker::MostFreeSlots => candidates
            .min_by(|a, b| {
                b.1.cmp(&a.1)
                    .then(margins.load(a.0).total_cmp(&margins.load(b.0)))
            })
            .map(|c| c.0),
        // least loaded; ties: most free slots, then lowest id
        Stage1Worker::LeastLoaded | Stage1Worker::ByScore => candidates
            .min_by(|a, b| {
                margins
                    .load(a.0)
                    .total_cmp(&margins.load(b.0))
                    .then(b.1.cmp(&a.1))
            })
            .map(|c| c.0),
    }
}

/// The worker with a free slot and the best score for one request of size `s`, ties broken by
/// `tie` over this tick's working loads and request counts. With a fill `target` the score
/// also loses twice what the request puts the worker above it (Stage 1's fill level); the
/// F-score is returned either way.
fn best_worker(
    tie: TieBreak,
    state: &ClusterState,
    free: &[u32],
    admitted: &[u32],
    margins: &Margins,
    s: f64,
    target: Option<f64>,
) -> Option<(WorkerId, f64)> {
    let key = |w: WorkerId| {
        let requests = state.workers()[w as usize].requests() + admitted[w as usize];
        tie_key(tie, w, requests, margins.load(w))
    };
    let mut best: Option<(WorkerId, f64)> = None;
    for (w, &f) in free.iter().enumerate() {
        if f == 0 {
            continue;
        }
        let w = w as WorkerId;
        let mut score = margins.score(w, s);
        if let Some(target) = target {
            score -= 2.0 * (s - (target - margins.load(w))).max(0.0);
        }
        let better = match best {
            None => true,
            Some((bw, bs)) => score > bs || (score == bs && key(w) < key(bw)),
        };
        if better {
            best = Some((w, score));
        }
    }
    best.map(|(w, _)| (w, margins.score(w, s)))
}

/// Stage 2's priority: most free slots, then the largest `min_h m_{g,h}`, then lowest id.
fn stage2_worker(free: &[u32], done: &[bool], margins: &Margins) -> Option<WorkerId> {
    let mut best: Option<(WorkerId, u32, f64)> = None;
    for (w, &f) in free.iter().enumerate() {
        if f == 0 || done[w] {
            continue;
        }
        // fewer free slots lose whatever their margin: no need to compute it
        if best.is_some_and(|(_, bf, _)| f < bf) {
            continue;
        }
        // kept by `margins` between picks: most picks recompute only the last one's worker
        let m = margins.min_margin(w as WorkerId);
        let better = match best {
            None => true,
            Some((_, bf, bm)) => f > bf || m > bm,
        };
        if better {
            best = Some((w as WorkerId, f, m));
        }
    }
    best.map(|b| b.0)
}

/// The pool request with the highest single-request score for worker w. F is concave in the
/// prompt size, so the best request is next to the score's peak: the largest one at or below
/// it, or the smallest one above it.
fn best_single(pool: &Pool, margins: &Margins, w: WorkerId) -> Option<PoolEntry> {
    let peak = margins.best_size(w);
    let limit = if peak.is_finite() {
        peak.max(0.0).floor() as u64
    } else {
        u64::MAX
    };
    let below = pool.largest_at_most(limit);
    let above = pool.smallest_above(limit);
    match (below, above) {
        (Some(b), Some(a)) => {
            let (fb, fa) = (
                margins.score(w, f64::from(b.prompt_tokens)),
                margins.score(w, f64::from(a.prompt_tokens)),
            );
            Some(if fa > fb { a.clone() } else { b.clone() })
        }
        (Some(x), None) | (None, Some(x)) => Some(x.clone()),
        (None, None) => None,
    }
}

/// The tick's head for Stage 2's tick-head window: its requests in arrival order and an index
/// of the ones not yet admitted, sorted by (size, arrival). Built once per tick in O(h log h)
/// (h = S_tot + lookahead); a query is a binary search plus O(R_max), and an admission a
/// binary search and a shift of a few KB, so a tick costs O(h log h + admissions·(G + R_max)).
struct Head {
    entries: Vec<PoolEntry>,
    /// (prompt tokens, index in `entries`) of the requests still waiting, ascending.
    by_size: Vec<(u32, u32)>,
}

impl Head {
    fn new(pool: &Pool, len: usize) -> Self {
        let entries: Vec<PoolEntry> = pool.oldest(len).cloned().collect();
        let mut by_size: Vec<(u32, u32)> = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.prompt_tokens, i as u32))
            .collect();
        by_size.sort_unstable();
        Self { entries, by_size }
    }

    /// Marks a request of the head admitted.
    fn take(&mut self, index: u32) {
        let key = (self.entries[index as usize].prompt_tokens, index);
        if let Ok(at) = self.by_size.binary_search(&key) {
            self.by_size.remove(at);
        }
    }

    /// A worker's candidates: the `r_max` waiting requests of the head with the best single
    /// `score`, oldest first among equal scores, left in `out` (head indices) in arrival order.
    /// The score is concave in the prompt size with its peak at `peak`, so they are among the
    /// `r_max` largest at or below it and the `r_max` smallest above it (each the oldest first
    /// among equal sizes).
    fn candidates(
        &self,
        peak: f64,
        score: impl Fn(f64) -> f64,
        r_max: usize,
        near: &mut Vec<(f64, u32)>,
        out: &mut Vec<u32>,
    ) {
        let limit = if peak.is_finite() {
            peak.max(0.0).floor().min(f64::from(u32::MAX)) as u32
        } else {
            u32::MAX
        };
        let split = self.by_size.partition_point(|&(s, _)| s <= limit);
        near.clear();
        let mut push = |&(s, i): &(u32, u32)| near.push((score(f64::from(s)), i));
        // at or below the peak: largest sizes first, each size's run oldest first
        let (mut hi, mut below) = (split, 0);
        while hi > 0 && below < r_max {
            let size = self.by_size[hi - 1].0;
            let lo = self.by_size[..hi].partition_point(|&(s, _)| s < size);
            for e in self.by_size[lo..hi].iter().take(r_max - below) {
                push(e);
                below += 1;
            }
            hi = lo;
        }
        self.by_size[split..].iter().take(r_max).for_each(push);
        near.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        near.truncate(r_max);
        out.clear();
        out.extend(near.iter().map(|c| c.1));
        // arrival order, so best_subset's ties go to the oldest as with the paper's window
        out.sort_unstable();
    }
}

/// The non-empty subset of `sizes` with at most `max_items` members that maximises `score`
/// (ties: the first in enumeration order). Returns (bitmask, score); (0, −∞) when nothing fits.
pub fn best_subset(sizes: &[f64], max_items: usize, score: impl Fn(f64) -> f64) -> (u32, f64) {
    best_subset_counted(sizes, max_items, |ds, _| score(ds))
}

/// [`best_subset`] for a score of the subset's size and its number of members (the F-score's
/// request term, `score::Margins::score_subset`).
pub fn best_subset_counted(
    sizes: &[f64],
    max_items: usize,
    score: impl Fn(f64, u32) -> f64,
) -> (u32, f64) {
    let n = sizes.len().min(MAX_R_MAX);
    let mut best = (0u32, f64::NEG_INFINITY);
    for mask in 1u32..(1u32 << n) {
        if mask.count_ones() as usize > max_items {
            continue;
        }
        let ds: f64 = (0..n)
            .filter(|i| mask & (1 << i) != 0)
            .map(|i| sizes[i])
            .sum();
        let f = score(ds, mask.count_ones());
        if f > best.1 {
            best = (mask, f);
        }
    }
    best
}

/// Pool bypass: route one arriving request to the live worker with the best `F_g({i})` (BR-0),
/// preferring workers with a free slot; ties broken by `tie`. `None` when no worker is live.
pub fn route_bypass(entry: &PoolEntry, state: &ClusterState, tie: TieBreak) -> Option<WorkerId> {
    let max = state.max_load();
    let g = state.live_workers();
    let any_free = state.workers().iter().any(|w| w.free_slots() > 0);
    let mut best: Option<(WorkerId, i128)> = None;
    for w in state.accepting_worker_ids() {
        let info = &state.workers()[w as usize];
        if any_free && info.free_slots() == 0 {
            continue;
        }
        let f = br0_score(u64::from(entry.prompt_tokens), max - info.load(), g);
        let better = match best {
            None => true,
            Some((bw, bf)) => f > bf || (f == bf && tie_prefers(tie, state, w, bw)),
        };
        if better {
            best = Some((w, f));
        }
    }
    best.map(|b| b.0)
}

/// Whether `a` wins a tie against `b`, by σ's loads and request counts.
pub(crate) fn tie_prefers(tie: TieBreak, state: &ClusterState, a: WorkerId, b: WorkerId) -> bool {
    let key = |w: WorkerId| {
        let info = &state.workers()[w as usize];
        tie_key(tie, w, info.requests(), info.load() as f64)
    };
    key(a) < key(b)
}

/// The order in which tied workers are preferred (smaller first): the one definition both the
/// pool-bypass router and Stage 1's placement use. Loads are whole token counts (exact in f64).
fn tie_key(tie: TieBreak, w: WorkerId, requests: u32, load: f64) -> (u32, f64, WorkerId) {
    match tie {
        TieBreak::LowestId => (0, 0.0, w),
        TieBreak::LeastLoaded => (0, load, w),
        TieBreak::FewestRequests => (requests, load, w),
    }
}
