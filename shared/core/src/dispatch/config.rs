//! The dispatcher's configuration: [`DispatcherConfig`] and the enums of its open choices
//! (the paper's and the ones the simulator chose defaults for).
//!
//! Separate from the dispatcher itself because it is the part the services and the simulator
//! set (serde names, defaults, validation), read apart from how a tick uses it.

use super::*;

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
    /// Weight of Stage 2's finish-stagger term (0, off, the default). With clients' expected
    /// output lengths, a candidate scores `w·n_g·min(d, Δ)` tokens more, d the steps between
    /// its expected finish and the nearest expected finish already on the rank, Δ the mean
    /// gap of those: a full rank's load climbs between its own finishes, and finishes spread
    /// evenly keep that climb short on every rank (the renewal term of tools/sim/README.md).
    /// It pays only with precise hints, so the policy scales the weight by how precise the
    /// group's finished requests have shown the hints to be ([`HintTrust`]: full at an RMS log
    /// error ≤ 0.05, none at ≥ 0.1 or before 64 hinted finishes; tools/sim/RESULTS.md, "Hints at
    /// placement"). Without hints it changes nothing.
    pub stagger_weight: f64,
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
            stagger_weight: 0.0,
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
        if !(self.stagger_weight.is_finite() && self.stagger_weight >= 0.0) {
            return Err(CoreError::InvalidConfig(format!(
                "stagger_weight must be finite and >= 0, got {}",
                self.stagger_weight
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
