//! BR-C, prefill waves: a pooled policy for ranks that prefill their own prompts in the steps
//! they decode (colocated prefill).
//!
//! With colocated prefill a lockstep step takes `a·max_g L_g + p·max_g P_g + c·max_g n_g + b`,
//! `P_g` the prompt tokens rank g runs in it. A prompt run by one rank alone costs every rank
//! its `p·P`; the same prompts run in the same step on all ranks, with equal token counts, cost
//! the group one `p·P` together. Where a request goes does not decide when its rank prefills
//! it (the rank runs its queue at its next step); *when* the router hands it over does. So BR-C
//! holds requests in the central pool and releases them in waves:
//!
//! 1. A rank counts as *prefilling* while σ shows requests on it without a first token
//!    (admitted and not reported yet, or reported by the rank's shim but still in prefill): a
//!    wave released then would run beside the previous wave's tail, or a rank with a long
//!    prompt, in steps of their own.
//! 2. A wave is released when no live rank is prefilling, at least `N = ceil(wave_fraction·G)`
//!    live ranks have a free slot and at least N requests wait: more ranks in one wave share
//!    one prefill stall (a wave of one prompt stalls the group as long as a wave of G prompts
//!    of that size), and a rank waiting for the wave leaves only its freed slots empty (at
//!    B = 256 a few slots of a rank's 256). Under light traffic the pool is what is short:
//!    requests are then held until N have arrived, or the guard releases them.
//! 3. Starvation guard: the policy counts the decode steps (read from σ's token clock, see
//!    `Waves::stepped`) at whose ticks a slot was free, requests waited and it admitted
//!    nothing; after `max_wait_steps` of them it releases a wave to whatever ranks have free
//!    slots, prefilling or not. Waves are first come, first served, so the oldest waiting
//!    request is in every wave: what the policy adds to its wait is at most `max_wait_steps`
//!    steps with a free slot (0: every tick with a free slot admits).
//!    While the pool is *shallow* (fewer requests wait than there are free slots) the guard
//!    fires after `shallow_wait_steps` instead. In a deep pool the requests wait for slots
//!    anyway and a long hold costs their time to first token little; in a shallow one each
//!    step held is a step added to every waiting request's TTFT, and a full wave seldom forms
//!    (at 85% of capacity on adp-shape, G = 8, about one request arrives every eight steps).
//!    On adp-shape one 16-step budget for both cost TTFT p99 1.6× the best baseline's at 85%
//!    load and kept 64% of the saturated gap; 64 deep and 2 shallow keep 77-81% of it at
//!    G = 8-32 with TTFT p99 1.05-1.07× (tools/sim/RESULTS.md, "Prefill waves").
//! 4. A wave takes the oldest requests, as many as the free slots of the ranks in it, and
//!    spreads their prompt tokens as evenly as the slots allow, largest prompt first. When the
//!    wave fills every free slot, each goes to the rank with the most tokens left to its share
//!    per free slot left (the share: the wave's tokens over its ranks): a rank with few free
//!    slots takes the large prompts, one with many the small ones, so the rank with the most
//!    tokens (the step's `max P`) is as low as greedy placement gets it. When there are fewer
//!    requests than free slots (a pool that is not deep), each goes to the rank with the fewest
//!    tokens of this wave (so one prompt per rank while they last), and among those to the
//!    least loaded: ranking by free slots there would send every lone request to the rank
//!    with the fewest free slots, the fullest one. Remaining ties go to the least load, then
//!    the lowest id. In a deep pool (more requests wait than there are free slots) the wave
//!    chooses among more than the oldest (`lookahead`, 0.5: the oldest `F + ceil(0.5·F)` for
//!    `F` free slots): largest first, each prompt that fits on a rank under the share of the
//!    requests first in line (or under the oldest prompt, if larger) goes there by the rule
//!    above, and one that fits nowhere is passed over for a later wave; the oldest request
//!    goes in every wave, whatever its size. Short conversations have prompts from a few
//!    tokens to 14k: the oldest `F` of them put one rank's prefill far above the others', and
//!    the prompts a little further back even it out. Saturated on azure2023_conv's request
//!    lengths that took BR-C from 70-79% of the gap to the aligned limit to 84-95% (adp-shape,
//!    prompts closer in size: 81-87% to 84-88%); a request passed over waits at most until it
//!    is the oldest, and then goes in the next wave.
//! 5. Then the wave's prompts are traded between its ranks for decode KV (`kv_swap`): while
//!    the rank with the most KV after admission (its KV tokens plus the wave's prompts on it)
//!    can trade one of its prompts for a smaller one of a rank with less, the difference below
//!    their KV gap and within the room the receiver has under the wave's most prompt tokens on
//!    a rank, the pair nearest half the gap is traded (the next rank down trades when the most
//!    can trade with none). Each rank keeps its count of prompts and the step's `max P` does
//!    not grow: what moves is the room the spread leaves under the rank with the most tokens,
//!    handed to the ranks with the least KV. Once waves align the prefill, the KV term is most
//!    of what is left of the gap to the aligned limit, and a KV spread that rule 4 leaves
//!    persists for as long as the requests run; the trades are small in each wave and add up
//!    over the waves (tools/sim/RESULTS.md, "Prefill waves"). Leaning the spread itself
//!    towards the ranks with less KV balanced KV further and cost more in `max P` than it
//!    saved: a prompt token added to the step's `max P` costs `p / a` times a KV token on the
//!    most loaded rank (2,400 at p = 0.48 ms and a = 2·10⁻⁴ ms), and that rank's KV changes
//!    as its requests finish. `kv_swap = false` leaves the spread as rule 4 makes it.
//! 6. Between waves, while the pool is shallow and a rank is prefilling, a rank with less
//!    prefill queued than the rank with the most (σ's prompt tokens without a first token)
//!    takes waiting prompts at once, oldest first, up to that most (`fill_under`). Chunk by
//!    chunk both ranks then run full chunks until the shorter queue ends, so a prompt under
//!    the most runs in steps whose `max P` the rank with the most already sets: holding it for
//!    a wave saves no step time and adds its wait. Among the ranks a prompt fits, it goes to
//!    the one with the least KV of those whose queued prefill is within `fill_slack` (1)
//!    times the prompt of the least queued: the least queued alone serves its TTFT and lets
//!    the KV spread grow; the least KV alone queues it behind more prefill. A prompt that fits
//!    nowhere waits for the wave or the guard, and the guard's count for the oldest request
//!    goes on while it waits. σ's queue is an upper bound (it learns a prompt's end from its
//!    first token, not its chunks), so a prompt may land beside the last chunk of a longer
//!    one and lengthen that step; a wave held for it would cost that and its wait. With
//!    12k-token prompts (mooncake's) at 60% and 85% load the pool is shallow and some rank is
//!    nearly always prefilling: holding every prompt for a wave put TTFT p99 at 1.26-1.69× the
//!    best baseline's, filling under at 0.77-1.04× (tools/sim/RESULTS.md, "Prefill waves";
//!    design note 0027). In a deep pool the slots are what is short and the waves stay as
//!    they are.
//!
//! Without colocated prefill (a decode tier) a request writes its first token at its first
//! step, so rule 1 holds a wave back a step at most; rules 2 and 3 still hold requests and
//! only delay them (no step cost to save).

use serde::{Deserialize, Serialize};

use crate::dispatch::{Admission, Stage};
use crate::pool::{Pool, PoolEntry};
use crate::state::ClusterState;
use crate::{CoreError, WorkerId};

/// BR-C's parameters (`brc:max_wait_steps=64:shallow_wait_steps=2:wave_fraction=1:kv_swap=true`
/// on br-sim's command line).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BrcConfig {
    /// Decode steps with a free slot the policy may hold the oldest waiting request before it
    /// releases a wave regardless (the starvation guard), while the pool is deep. 0 admits at
    /// every tick with a free slot. 64 by default: on adp-shape with colocated prefill
    /// (tools/sim/RESULTS.md, "Prefill waves") the saturated gain grows up to 64 and no further
    /// (16: 64-67% of the gap to the aligned limit; 64: 76-81%; 128: no more than 64).
    pub max_wait_steps: u32,
    /// The guard's budget while the pool is shallow (fewer requests wait than there are free
    /// slots), at most the deep budget. 2 by default: at 60% and 85% load on adp-shape (G = 8-32)
    /// it keeps TTFT p99 within 1.07× the best baseline's with TPOT p95 8-30% (60%) and 28-38%
    /// (85%) lower (rule 3).
    pub shallow_wait_steps: u32,
    /// Once requests have finished, the deep pool's budget is at most this fraction of their
    /// mean output length (in steps, rounded up): a hold leaves freed slots empty, and what
    /// that costs is the hold over a slot's life. 0.05 by default: on adp-shape (3,653-token
    /// outputs) that is 183 steps, so `max_wait_steps` bounds it; on 300-token outputs at
    /// B = 16 (br-sim's `prefill_waves_align_the_ranks_prefill_and_pay_for_it`) a 64-step hold
    /// cost 1.3% of throughput against round-robin, 0.05 (15 steps) gains 0.5% and halves the
    /// prefill time beyond the aligned step.
    pub hold_fraction: f64,
    /// Fraction of live ranks that must have a free slot (and of requests that must wait) for a
    /// wave, in `(0, 1]`. 1 by default: a wave on part of the ranks stalls the rest as long.
    pub wave_fraction: f64,
    /// Whether a wave, once spread, trades prompts between its ranks to lower the most KV any
    /// rank holds after admission, at the same prompt count per rank and no more prompt tokens
    /// on the rank with the most (rule 5, `swap_for_kv`). True by default: on adp-shape
    /// saturated (tools/sim/RESULTS.md, "Prefill waves", measured before the look-ahead) it took
    /// BR-C from 77-81% of the gap to the aligned limit to 81-87% at G = 8-32, and changes
    /// nothing measurable at 60% and 85% load. False spreads the prompts by rule 4 alone.
    pub kv_swap: bool,
    /// How far past the oldest requests a wave in a deep pool may look for prompts that even
    /// out its ranks' prompt tokens, as a fraction of the free slots (rule 4): with `F` free
    /// slots it chooses among the oldest `F + ceil(lookahead·F)` waiting requests, the oldest
    /// always in. In `[0, 4]`; 0 takes exactly the oldest `F`. 0.5 by default: saturated with
    /// colocated prefill (tools/sim/RESULTS.md, "Prefill waves") it took BR-C from 70-79% of
    /// the gap to the aligned limit to 84-95% on azure2023_conv's request lengths and from
    /// 81-87% to 84-88% on adp-shape at G = 8-32 (0.25 and 1 within a point or two of it,
    /// each below it somewhere); below capacity the pool is shallow and every run was the
    /// same as without it.
    pub lookahead: f64,
    /// Whether, between waves and while the pool is shallow, waiting prompts go at once to the
    /// ranks with less prefill queued than the rank with the most (rule 6), up to that most:
    /// there a prompt runs in steps whose `max P` the rank with the most already sets, and
    /// holding it saves no step time. True by default: on mooncake's 12k-token prompts at 60%
    /// and 85% load (G = 8-32) it took BR-C's TTFT p99 from 1.26-1.69× the best baseline's to
    /// 0.77-1.04×; adp-shape and azure2023_conv moved within their seed spread
    /// (tools/sim/RESULTS.md, "Prefill waves"). False holds every prompt for a wave or the
    /// guard.
    pub fill_under: bool,
    /// Which rank a prompt filled under the most goes to (rule 6): among the ranks it fits,
    /// those whose queued prefill is within `fill_slack` times the prompt of the least queued,
    /// and of those the one with the least KV. In `[0, 4]`. 1 by default: on mooncake's request
    /// lengths at 60% and 85% load (G = 8-32, tools/sim/RESULTS.md, "Prefill waves") it keeps
    /// TTFT p99 within 1.04× the best baseline's with TPOT p95 within 0.07% of least-tokens'
    /// (4.4 s a token there, nearly all of it prefill). The least queued alone (0) lets the KV
    /// spread grow, TPOT p95 up to 0.6% above least-tokens'; the least KV alone queues prompts
    /// behind more prefill, TTFT p99 up to 1.38× (1.11× at 4). No value kept TPOT p95 within
    /// the seed spread in every 85% cell.
    pub fill_slack: f64,
}

impl Default for BrcConfig {
    fn default() -> Self {
        Self {
            max_wait_steps: 64,
            shallow_wait_steps: 2,
            hold_fraction: 0.05,
            wave_fraction: 1.0,
            kv_swap: true,
            lookahead: 0.5,
            fill_under: true,
            fill_slack: 1.0,
        }
    }
}

impl BrcConfig {
    /// A shallow budget that was given (not left at its default) may not exceed the deep
    /// one: the default (2) follows a smaller `max_wait_steps` (the guard takes the smaller
    /// of the two), but a given value above it says two things at once. For the front ends
    /// that know which values were given (br-decision's flags, br-sim's policy specs).
    pub fn validate_given_shallow(&self) -> Result<(), CoreError> {
        if self.shallow_wait_steps > self.max_wait_steps {
            return Err(CoreError::InvalidConfig(format!(
                "shallow_wait_steps {} is above max_wait_steps {} (the shallow pool's hold is at most the deep pool's)",
                self.shallow_wait_steps, self.max_wait_steps
            )));
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<(), CoreError> {
        if !(self.hold_fraction > 0.0 && self.hold_fraction <= 1.0) {
            return Err(CoreError::InvalidConfig(format!(
                "hold_fraction must be in (0, 1], got {}",
                self.hold_fraction
            )));
        }
        if !(self.lookahead >= 0.0 && self.lookahead <= MAX_LOOKAHEAD) {
            return Err(CoreError::InvalidConfig(format!(
                "lookahead must be in [0, {MAX_LOOKAHEAD}], got {}",
                self.lookahead
            )));
        }
        if !(self.fill_slack >= 0.0 && self.fill_slack <= MAX_FILL_SLACK) {
            return Err(CoreError::InvalidConfig(format!(
                "fill_slack must be in [0, {MAX_FILL_SLACK}], got {}",
                self.fill_slack
            )));
        }
        if !(self.wave_fraction > 0.0 && self.wave_fraction <= 1.0) {
            return Err(CoreError::InvalidConfig(format!(
                "wave_fraction must be in (0, 1], got {}",
                self.wave_fraction
            )));
        }
        Ok(())
    }
}

/// The most [`BrcConfig::lookahead`] takes: a wave that fills empty ranks (G = 64, 256 free
/// slots each) then sorts and places 80k candidates, not 16k, in one tick.
pub const MAX_LOOKAHEAD: f64 = 4.0;

/// The most [`BrcConfig::fill_slack`] takes: at 4 a prompt may wait behind four times its own
/// prefill for a rank with less KV, past what any TTFT target allows.
pub const MAX_FILL_SLACK: f64 = 4.0;

/// The wave state between ticks.
#[derive(Debug, Clone)]
pub(crate) struct Waves {
    cfg: BrcConfig,
    /// Decode steps since the last admission at whose ticks a slot was free and requests waited
    /// (at most one per step: [`Waves::stepped`]).
    held: u32,
    /// Mean output length of the finished requests (exponentially weighted); `None` before
    /// the first.
    mean_output: Option<f64>,
    /// σ's token clock when `held` last counted a step.
    counted_at: Option<u64>,
}

/// Weight of each finished request in [`Waves::mean_output`]: about the last 500 count.
const OUTPUT_MEAN_WEIGHT: f64 = 1.0 / 512.0;

impl Waves {
    pub(crate) fn new(cfg: BrcConfig) -> Self {
        Self {
            cfg,
            held: 0,
            mean_output: None,
            counted_at: None,
        }
    }

    /// A request finished after `output_tokens` tokens.
    pub(crate) fn observe_finished(&mut self, output_tokens: u32) {
        let x = f64::from(output_tokens);
        self.mean_output = Some(match self.mean_output {
            None => x,
            Some(m) => m + OUTPUT_MEAN_WEIGHT * (x - m),
        });
    }

    /// Whether a hold at this tick counts: a decode step went by since the last one counted.
    /// The budgets are in steps; the simulator ticks once per step, a service on every arrival
    /// and σ change, several times a step. σ's token clock tells: in lockstep each decoding
    /// request writes one token per step, so once the clock has moved by the requests decoding
    /// now, at least a step went by (partial reports add up until it has). With nothing
    /// decoding there is no clock and every tick counts: a group that only prefills, or is
    /// idle, holds nothing for long.
    fn stepped(&mut self, state: &ClusterState) -> bool {
        let now = state.tokens_written();
        let decoding = state.decoding_requests();
        let stepped = match self.counted_at {
            None => true,
            // a new σ (the snapshot service restarted) starts its clock again
            Some(at) if now < at => true,
            Some(at) => decoding == 0 || now - at >= decoding,
        };
        if stepped {
            self.counted_at = Some(now);
        }
        stepped
    }

    /// The starvation guard's budget: `max_wait_steps` in a deep pool, shortened to
    /// `hold_fraction` of the mean output once one is known; `shallow_wait_steps` (at most
    /// that) in a shallow one.
    fn budget(&self, shallow: bool) -> u32 {
        let deep = match self.mean_output {
            Some(m) => {
                let by_output = (self.cfg.hold_fraction * m).ceil();
                self.cfg.max_wait_steps.min(by_output as u32)
            }
            None => self.cfg.max_wait_steps,
        };
        if shallow {
            self.cfg.shallow_wait_steps.min(deep)
        } else {
            deep
        }
    }

    pub(crate) fn dispatch(
        &mut self,
        pool: &mut Pool,
        state: &ClusterState,
        out: &mut Vec<Admission>,
    ) {
        if pool.is_empty() {
            self.held = 0;
            return;
        }
        let workers = state.workers();
        let free: Vec<WorkerId> = state
            .accepting_worker_ids()
            .filter(|&w| workers[w as usize].free_slots() > 0)
            .collect();
        if free.is_empty() {
            return;
        }
        let live = state.live_workers();
        let prefilling = state
            .live_worker_ids()
            .any(|w| workers[w as usize].prefilling > 0);
        let needed = ((self.cfg.wave_fraction * f64::from(live)).ceil() as usize).max(1);
        let slots: usize = free
            .iter()
            .map(|&w| workers[w as usize].free_slots() as usize)
            .sum();
        let budget = self.budget(pool.len() < slots);
        let guard = self.held >= budget;
        let ready = !prefilling && free.len() >= needed && pool.len() >= needed;
        if !guard && !ready {
            // Rule 6 (a deep pool waits for the wave: there the slots are what is short)
            if prefilling
                && self.cfg.fill_under
                && pool.len() < slots
                && self.fill_under(pool, state, &free, out)
            {
                // the oldest request went: the hold starts again for the next one
                self.held = 0;
                self.counted_at = Some(state.tokens_written());
                return;
            }
            if self.stepped(state) {
                self.held += 1;
            }
            return;
        }
        self.held = 0;
        self.counted_at = Some(state.tokens_written());
        let stage = if !ready { Stage::Guard } else { Stage::Greedy };
        // A deep pool (more requests wait than there are free slots) lets the wave choose
        // among more than the oldest `slots`: it takes prompts largest first while they fit
        // under `cap` on some rank, and passes over those that fit nowhere (they stay, older
        // than what came after them, for a later wave).
        let deep = pool.len() > slots && self.cfg.lookahead > 0.0;
        let extra = if deep {
            (self.cfg.lookahead * slots as f64).ceil() as usize
        } else {
            0
        };
        let mut wave: Vec<PoolEntry> = pool.oldest(slots + extra).cloned().collect();
        let oldest = wave.first().map(|e| (e.key, e.prompt_tokens));
        // the share is of the requests first in line, as many as the free slots: choosing among
        // more evens the ranks out, it does not make the wave larger
        let total: u64 = wave
            .iter()
            .take(slots)
            .map(|e| u64::from(e.prompt_tokens))
            .sum();
        // largest first; the older first among equal sizes (the pool gives them oldest first
        // and the sort is stable)
        wave.sort_by_key(|e| std::cmp::Reverse(e.prompt_tokens));
        // Filling every free slot: spread the tokens over the ranks' free slots. Fewer requests
        // than free slots: largest first to the rank with the fewest tokens of this wave, the
        // least loaded first among equals (the wave then also places by KV load).
        let fills = wave.len() >= slots;
        let share = total as f64 / free.len() as f64;
        // no rank above the share (or the oldest prompt, which goes whatever its size)
        let cap = share.max(oldest.map_or(0.0, |(_, t)| f64::from(t)));
        let mut oldest_placed = false;
        let mut left: Vec<u32> = free
            .iter()
            .map(|&w| workers[w as usize].free_slots())
            .collect();
        let mut tokens = vec![0u64; free.len()];
        let mut picks: Vec<(PoolEntry, usize)> = Vec::with_capacity(slots);
        for e in wave {
            let is_oldest = oldest.is_some_and(|(k, _)| k == e.key);
            // the oldest request is in every wave: keep a slot for it until it is placed
            let kept_for_oldest = usize::from(deep && !oldest_placed);
            if !is_oldest && picks.len() + kept_for_oldest >= slots {
                if kept_for_oldest == 1 {
                    continue;
                }
                break;
            }
            let fits = |j: usize| {
                !deep || is_oldest || (tokens[j] + u64::from(e.prompt_tokens)) as f64 <= cap
            };
            let load = |j: usize| workers[free[j] as usize].load();
            let best = (0..free.len())
                .filter(|&j| left[j] > 0 && fits(j))
                .max_by(|&x, &y| {
                    let first = if fills {
                        let room = |j: usize| (share - tokens[j] as f64) / f64::from(left[j]);
                        room(x).total_cmp(&room(y))
                    } else {
                        tokens[y].cmp(&tokens[x])
                    };
                    first
                        .then_with(|| load(y).cmp(&load(x)))
                        .then_with(|| free[y].cmp(&free[x]))
                });
            let Some(j) = best else {
                if deep {
                    continue;
                }
                break;
            };
            oldest_placed |= is_oldest;
            left[j] -= 1;
            tokens[j] += u64::from(e.prompt_tokens);
            picks.push((e, j));
        }
        if self.cfg.kv_swap {
            let prompts: Vec<u32> = picks.iter().map(|(e, _)| e.prompt_tokens).collect();
            let mut ranks: Vec<usize> = picks.iter().map(|&(_, j)| j).collect();
            let kv: Vec<u64> = free.iter().map(|&w| workers[w as usize].load()).collect();
            swap_for_kv(&prompts, &mut ranks, &kv);
            for (p, j) in picks.iter_mut().zip(ranks) {
                p.1 = j;
            }
        }
        admit(pool, picks, &free, stage, out);
    }

    /// Rule 6, between waves in a shallow pool while a rank is prefilling: a rank with less
    /// prefill queued than the most any live rank has (`top`: σ's prompt tokens without a
    /// first token) takes waiting prompts, oldest first, up to `top`; each goes, among the
    /// ranks it fits, to one whose queued prefill is within `fill_slack` times the prompt of
    /// the least queued, the one with the least KV (then the lowest id). A prompt that fits
    /// nowhere waits for the wave or the guard. Returns whether the oldest request went.
    fn fill_under(
        &self,
        pool: &mut Pool,
        state: &ClusterState,
        free: &[WorkerId],
        out: &mut Vec<Admission>,
    ) -> bool {
        let workers = state.workers();
        let top = state
            .live_worker_ids()
            .map(|w| workers[w as usize].prefill_tokens)
            .max()
            .unwrap_or(0);
        let mut queued: Vec<u64> = free
            .iter()
            .map(|&w| workers[w as usize].prefill_tokens)
            .collect();
        let mut left: Vec<u32> = free
            .iter()
            .map(|&w| workers[w as usize].free_slots())
            .collect();
        // KV after this tick's prompts
        let mut kv: Vec<u64> = free.iter().map(|&w| workers[w as usize].load()).collect();
        // the most room any rank with a free slot has left: a prompt above it is passed over
        // at once, and the scan ends when it is 0, so a tick costs O(pool + G · placed), not
        // O(pool · G) (a shallow pool at G = 64 can hold thousands while nothing fits)
        let room = |queued: &[u64], left: &[u32]| {
            (0..queued.len())
                .filter(|&j| left[j] > 0)
                .map(|j| top.saturating_sub(queued[j]))
                .max()
                .unwrap_or(0)
        };
        let mut most_room = room(&queued, &left);
        let oldest = pool.oldest(1).next().map(|e| e.key);
        let mut picks: Vec<(PoolEntry, usize)> = Vec::new();
        // the pool is shallow: every waiting request is a candidate
        for e in pool.oldest(pool.len()) {
            if most_room == 0 {
                break;
            }
            let prompt = u64::from(e.prompt_tokens);
            if prompt > most_room {
                continue;
            }
            let fits = |j: usize| left[j] > 0 && queued[j] + prompt <= top;
            let Some(least) = (0..free.len())
                .filter(|&j| fits(j))
                .map(|j| queued[j])
                .min()
            else {
                continue;
            };
            let near = least as f64 + self.cfg.fill_slack * prompt as f64;
            let Some(j) = (0..free.len())
                .filter(|&j| fits(j) && queued[j] as f64 <= near)
                .min_by_key(|&j| (kv[j], free[j]))
            else {
                continue;
            };
            left[j] -= 1;
            queued[j] += prompt;
            kv[j] += prompt;
            picks.push((e.clone(), j));
            most_room = room(&queued, &left);
        }
        let oldest_went = picks.iter().any(|(e, _)| Some(e.key) == oldest);
        admit(pool, picks, free, Stage::Greedy, out);
        oldest_went
    }
}

/// Takes each picked request (and the index into `free` of the rank it goes to) out of the pool
/// and appends its admission (BR-C scores nothing: NaN).
fn admit(
    pool: &mut Pool,
    picks: Vec<(PoolEntry, usize)>,
    free: &[WorkerId],
    stage: Stage,
    out: &mut Vec<Admission>,
) {
    for (e, j) in picks {
        pool.remove(e.key);
        out.push(Admission {
            key: e.key,
            worker: free[j],
            prompt_tokens: e.prompt_tokens,
            score: f64::NAN,
            stage,
        });
    }
}

/// Rule 5, the KV pass: swaps prompts of a wave between its ranks so that the rank with the most
/// KV after admission (its KV tokens `kv[j]` plus the wave's prompts on it) holds less, without
/// changing how many prompts each rank takes or raising the most prompt tokens any rank takes
/// (the step's `max P`). `ranks[i]` is the rank (an index into `kv`) prompt `i` goes to.
///
/// Each round orders the ranks by KV after admission, most first, and takes the first, `h`,
/// that can trade with a rank below it (those tried least first): a smaller prompt of the other
/// rank for a larger one of `h`'s, the difference below their KV gap (so the higher of the two
/// comes down) and within the room the other rank has under the wave's most tokens; of those,
/// the pair whose difference is nearest half the gap (then the lowest indices, so the pass is
/// deterministic). It stops when no rank can trade, or after as many rounds as prompts times
/// ranks.
///
/// For each of `h`'s prompts the other rank's best partner is found by binary search in its
/// prompts sorted by length, not by trying each: a wave that fills empty ranks (G = 64, 256
/// free slots each, 16k prompts) took 200 ms a tick trying every pair, a stall of every
/// Assign of the group.
fn swap_for_kv(prompts: &[u32], ranks: &mut [usize], kv: &[u64]) {
    let n = kv.len();
    if n < 2 || prompts.len() < 2 {
        return;
    }
    let mut tokens = vec![0u64; n];
    for (&p, &j) in prompts.iter().zip(ranks.iter()) {
        tokens[j] += u64::from(p);
    }
    let cap = tokens.iter().copied().max().unwrap_or(0);
    let after = |tokens: &[u64], j: usize| kv[j] + tokens[j];
    // each rank's prompts by index (the order ties are broken in), and by (length, index)
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, &j) in ranks.iter().enumerate() {
        members[j].push(i);
    }
    let mut by_length: Vec<Vec<(u32, usize)>> = members
        .iter()
        .map(|m| {
            let mut v: Vec<(u32, usize)> = m.iter().map(|&i| (prompts[i], i)).collect();
            v.sort_unstable();
            v
        })
        .collect();
    for _ in 0..prompts.len() * n {
        // the ranks by KV after admission, most first; the first of them that can trade
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&j| (std::cmp::Reverse(after(&tokens, j)), j));
        let mut traded = false;
        'pairs: for (i, &h) in order.iter().enumerate() {
            for &l in order[i + 1..].iter().rev() {
                let gap = after(&tokens, h) - after(&tokens, l);
                // a difference d is allowed when 0 < d < gap and d <= the room under the cap
                let reach = (cap - tokens[l]).min(gap.saturating_sub(1));
                if reach == 0 {
                    continue;
                }
                // (distance from half the gap, h's prompt, l's prompt): the nearest, then the
                // lowest indices
                let mut best: Option<(u64, usize, usize)> = None;
                for &y in &members[h] {
                    let Some((dist, x)) = partner(&by_length[l], prompts[y], gap, reach) else {
                        continue;
                    };
                    if best.is_none_or(|(b, _, _)| dist < b) {
                        best = Some((dist, y, x));
                    }
                }
                if let Some((_, y, x)) = best {
                    let d = u64::from(prompts[y] - prompts[x]);
                    ranks[y] = l;
                    ranks[x] = h;
                    tokens[h] -= d;
                    tokens[l] += d;
                    for (from, to, k) in [(h, l, y), (l, h, x)] {
                        members[from].retain(|&m| m != k);
                        let at = members[to].partition_point(|&m| m < k);
                        members[to].insert(at, k);
                        let entry = (prompts[k], k);
                        if let Ok(at) = by_length[from].binary_search(&entry) {
                            by_length[from].remove(at);
                        }
                        let at = by_length[to].partition_point(|&e| e < entry);
                        by_length[to].insert(at, entry);
                    }
                    traded = true;
                    break 'pairs;
                }
            }
        }
        if !traded {
            return;
        }
    }
}

/// The best partner for a prompt of `py` tokens among a rank's prompts `sorted` by (length,
/// index): a shorter one, `py − px` at most `reach`, whose difference is nearest half of `gap`;
/// among the equally near, the lowest index. Returns (|2·(py − px) − gap|, its index).
fn partner(sorted: &[(u32, usize)], py: u32, gap: u64, reach: u64) -> Option<(u64, usize)> {
    if py == 0 {
        return None;
    }
    let lo = u64::from(py).saturating_sub(reach);
    let hi = u64::from(py) - 1;
    // the distance is |t2 − 2·px|, nearest at px = t2 / 2
    let t2 = 2 * i128::from(py) - i128::from(gap);
    let dist = |v: u32| (t2 - 2 * i128::from(v)).unsigned_abs() as u64;
    let first_of = |v: u32| sorted[sorted.partition_point(|&(p, _)| p < v)].1;
    let at_or_above = sorted.partition_point(|&(p, _)| 2 * i128::from(p) < t2);
    let mut found: Option<(u64, usize)> = None;
    // the shortest at or above the middle, within [lo, hi]
    let q = at_or_above.max(sorted.partition_point(|&(p, _)| u64::from(p) < lo));
    if let Some(&(v, _)) = sorted.get(q).filter(|&&(v, _)| u64::from(v) <= hi) {
        found = Some((dist(v), first_of(v)));
    }
    // the longest below the middle, within [lo, hi]
    let r = at_or_above.min(sorted.partition_point(|&(p, _)| u64::from(p) <= hi));
    if let Some(&(v, _)) = r
        .checked_sub(1)
        .and_then(|r| sorted.get(r))
        .filter(|&&(v, _)| u64::from(v) >= lo)
    {
        let c = (dist(v), first_of(v));
        if found.is_none_or(|f| c < f) {
            found = Some(c);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deep_budget_follows_the_mean_output_once_one_is_known() {
        let mut w = Waves::new(BrcConfig::default());
        // nothing finished yet: the configured bounds
        assert_eq!(w.budget(false), 64);
        assert_eq!(w.budget(true), 2);
        // 300-token outputs: 5% is 15 steps
        w.observe_finished(300);
        assert_eq!(w.budget(false), 15);
        assert_eq!(w.budget(true), 2);
        // 10-token outputs pull the mean down slowly (about the last 500 count), and the
        // shallow budget is never above the deep one
        for _ in 0..5_000 {
            w.observe_finished(10);
        }
        assert_eq!(w.budget(false), 1);
        assert_eq!(w.budget(true), 1);
        // long outputs: max_wait_steps bounds the budget
        for _ in 0..5_000 {
            w.observe_finished(100_000);
        }
        assert_eq!(w.budget(false), 64);
    }

    /// A request on `worker` with a `prompt_tokens` prompt, in `phase`, `generated` tokens
    /// written.
    fn request(
        key: u64,
        worker: WorkerId,
        prompt_tokens: u32,
        phase: crate::state::Phase,
        generated: u32,
    ) -> crate::state::RequestInfo {
        crate::state::RequestInfo {
            key,
            worker,
            prompt_tokens,
            generated,
            phase,
            prompt_hash: None,
            oracle_output: None,
            expected_output: None,
            class: None,
        }
    }

    /// A pool of `prompts`, oldest first, keyed from `first_key`.
    fn pool_of(first_key: u64, prompts: &[u32]) -> Pool {
        let mut pool = Pool::new();
        for (key, &prompt_tokens) in (first_key..).zip(prompts) {
            pool.push(PoolEntry {
                key,
                prompt_tokens,
                prompt_hash: None,
                oracle_output: None,
                expected_output: None,
                class: None,
            })
            .unwrap();
        }
        pool
    }

    /// Two ranks of 4 slots, one running request on each (1,000-token prompts, 10 tokens
    /// written); rank 0 is full with queued requests, so a wave is never ready and every
    /// tick is a hold.
    fn held_group() -> (ClusterState, Pool) {
        use crate::state::Phase;
        let mut st = ClusterState::with_workers(&[4, 4]);
        st.reserve(request(1, 0, 1_000, Phase::Running, 10))
            .unwrap();
        st.reserve(request(2, 1, 1_000, Phase::Running, 10))
            .unwrap();
        for key in 3..6 {
            st.reserve(request(key, 0, 1_000, Phase::Queued, 0))
                .unwrap();
        }
        (st, pool_of(100, &[500; 10]))
    }

    #[test]
    fn a_hold_counts_decode_steps_not_ticks() {
        let (mut st, mut pool) = held_group();
        let mut w = Waves::new(BrcConfig {
            max_wait_steps: 3,
            ..BrcConfig::default()
        });
        let mut out = Vec::new();
        // the first hold counts; ticks on the same σ (a service ticks on every arrival) do not
        for _ in 0..10 {
            w.dispatch(&mut pool, &st, &mut out);
        }
        assert_eq!((w.held, out.len()), (1, 0));
        // one rank's report of a step is half a step of this group: not yet
        st.set_generated(1, 11).unwrap();
        w.dispatch(&mut pool, &st, &mut out);
        assert_eq!(w.held, 1);
        // the other rank's report completes it
        st.set_generated(2, 11).unwrap();
        w.dispatch(&mut pool, &st, &mut out);
        assert_eq!(w.held, 2);
        // a simulator step counts at once
        st.advance_step();
        w.dispatch(&mut pool, &st, &mut out);
        assert_eq!((w.held, out.len()), (3, 0));
        // three steps held: the guard releases the oldest requests to the free slots
        st.advance_step();
        w.dispatch(&mut pool, &st, &mut out);
        assert_eq!((w.held, out.len()), (0, 3));
        assert!(out.iter().all(|a| a.stage == Stage::Guard));
    }

    #[test]
    fn with_nothing_running_every_hold_counts() {
        let (mut st, mut pool) = held_group();
        st.remove(1).unwrap();
        st.remove(2).unwrap();
        let mut w = Waves::new(BrcConfig {
            max_wait_steps: 3,
            // every free slot filled, as the count below says: with a look-ahead the wave
            // would keep rank 1 to its share of the prompt tokens
            lookahead: 0.0,
            ..BrcConfig::default()
        });
        let mut out = Vec::new();
        for _ in 0..3 {
            w.dispatch(&mut pool, &st, &mut out);
        }
        assert!(out.is_empty());
        w.dispatch(&mut pool, &st, &mut out);
        assert_eq!(out.len(), 5, "rank 0 has one free slot, rank 1 four");
    }

    /// Three ranks of 4 slots: rank 0 has a 10,000-token prompt queued (prefilling), rank 1
    /// decodes a request holding 40,010 KV tokens, rank 2 one holding 1,010; the pool holds
    /// `prompts`, oldest first (keys from 100).
    fn one_rank_prefilling(prompts: &[u32]) -> (ClusterState, Pool) {
        use crate::state::Phase;
        let mut st = ClusterState::with_workers(&[4, 4, 4]);
        st.reserve(request(1, 0, 10_000, Phase::Queued, 0)).unwrap();
        st.reserve(request(2, 1, 40_000, Phase::Running, 10))
            .unwrap();
        st.reserve(request(3, 2, 1_000, Phase::Running, 10))
            .unwrap();
        (st, pool_of(100, prompts))
    }

    fn placed(out: &[Admission]) -> Vec<(u64, WorkerId)> {
        out.iter().map(|a| (a.key, a.worker)).collect()
    }

    #[test]
    fn between_waves_prompts_fill_under_the_rank_with_the_most_prefill_queued() {
        let (st, mut pool) = one_rank_prefilling(&[6_000, 12_000, 5_000, 3_000]);
        assert_eq!(st.workers()[0].prefill_tokens, 10_000);
        let mut w = Waves::new(BrcConfig::default());
        let mut out = Vec::new();
        w.dispatch(&mut pool, &st, &mut out);
        // 6,000 fits under rank 0's 10,000 on ranks 1 and 2, both with nothing queued: the one
        // with less KV (2) takes it. 12,000 fits nowhere and waits. 5,000 fits only on rank 1
        // (rank 2 would reach 11,000). 3,000 fits on both, rank 1 with 5,000 queued and rank 2
        // with 6,000, within one prompt of each other: rank 2, the one with less KV (after the
        // 6,000 it took in this tick).
        assert_eq!(placed(&out), vec![(100, 2), (102, 1), (103, 2)]);
        assert!(out.iter().all(|a| a.stage == Stage::Greedy));
        assert_eq!(pool.len(), 1);
        assert!(pool.contains(101));
        // the oldest went: the hold starts again for the next
        assert_eq!(w.held, 0);
        // with a slack of a quarter prompt rank 2's 6,000 is too far above rank 1's 5,000 for
        // the 3,000: rank 1, for its TTFT, though it holds more KV
        let (st, mut pool) = one_rank_prefilling(&[6_000, 12_000, 5_000, 3_000]);
        let mut w = Waves::new(BrcConfig {
            fill_slack: 0.25,
            ..BrcConfig::default()
        });
        let mut out = Vec::new();
        w.dispatch(&mut pool, &st, &mut out);
        assert_eq!(placed(&out), vec![(100, 2), (102, 1), (103, 1)]);
    }

    #[test]
    fn a_prompt_that_fits_under_no_rank_keeps_the_hold_counting() {
        // the oldest (12,000) fits nowhere; the 3,000 behind it goes, and the hold of the
        // oldest counts on until the guard (2 steps, the pool being shallow) releases it
        let (mut st, mut pool) = one_rank_prefilling(&[12_000, 3_000]);
        let mut w = Waves::new(BrcConfig::default());
        let mut out = Vec::new();
        w.dispatch(&mut pool, &st, &mut out);
        assert_eq!(placed(&out), vec![(101, 2)]);
        assert_eq!(w.held, 1);
        st.advance_step();
        out.clear();
        w.dispatch(&mut pool, &st, &mut out);
        assert!(out.is_empty());
        assert_eq!(w.held, 2);
        st.advance_step();
        w.dispatch(&mut pool, &st, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].key, out[0].stage), (100, Stage::Guard));
    }

    #[test]
    fn without_fill_under_or_in_a_deep_pool_prompts_wait_for_the_wave() {
        let (st, mut pool) = one_rank_prefilling(&[6_000, 5_000, 3_000]);
        let mut w = Waves::new(BrcConfig {
            fill_under: false,
            ..BrcConfig::default()
        });
        let mut out = Vec::new();
        w.dispatch(&mut pool, &st, &mut out);
        assert!(out.is_empty());
        // nine free slots, nine waiting: a deep pool, where the slots are what is short
        let (st, mut pool) = one_rank_prefilling(&[1_000; 9]);
        let mut w = Waves::new(BrcConfig::default());
        w.dispatch(&mut pool, &st, &mut out);
        assert!(out.is_empty());
        assert_eq!(pool.len(), 9);
    }

    /// The KV pass as first written: every pair of prompts of two ranks tried. The pass must
    /// make exactly its trades.
    fn swap_for_kv_by_every_pair(prompts: &[u32], ranks: &mut [usize], kv: &[u64]) {
        let n = kv.len();
        if n < 2 || prompts.len() < 2 {
            return;
        }
        let mut tokens = vec![0u64; n];
        for (&p, &j) in prompts.iter().zip(ranks.iter()) {
            tokens[j] += u64::from(p);
        }
        let cap = tokens.iter().copied().max().unwrap_or(0);
        let after = |tokens: &[u64], j: usize| kv[j] + tokens[j];
        let mut members: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (i, &j) in ranks.iter().enumerate() {
            members[j].push(i);
        }
        for _ in 0..prompts.len() * n {
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by_key(|&j| (std::cmp::Reverse(after(&tokens, j)), j));
            let mut traded = false;
            'pairs: for (i, &h) in order.iter().enumerate() {
                for &l in order[i + 1..].iter().rev() {
                    let gap = after(&tokens, h) - after(&tokens, l);
                    let room = cap - tokens[l];
                    let mut best: Option<(u64, usize, usize)> = None;
                    for &y in &members[h] {
                        for &x in &members[l] {
                            let (py, px) = (u64::from(prompts[y]), u64::from(prompts[x]));
                            if py <= px {
                                continue;
                            }
                            let d = py - px;
                            if d >= gap || d > room {
                                continue;
                            }
                            let dist = (2 * d).abs_diff(gap);
                            if best.is_none_or(|(b, _, _)| dist < b) {
                                best = Some((dist, y, x));
                            }
                        }
                    }
                    if let Some((_, y, x)) = best {
                        let d = u64::from(prompts[y] - prompts[x]);
                        ranks[y] = l;
                        ranks[x] = h;
                        tokens[h] -= d;
                        tokens[l] += d;
                        for (from, to, k) in [(h, l, y), (l, h, x)] {
                            members[from].retain(|&m| m != k);
                            let at = members[to].partition_point(|&m| m < k);
                            members[to].insert(at, k);
                        }
                        traded = true;
                        break 'pairs;
                    }
                }
            }
            if !traded {
                return;
            }
        }
    }

    #[test]
    fn the_kv_pass_makes_the_trades_of_trying_every_pair() {
        // xorshift: many small waves with repeated lengths (ties), KV gaps of every size, and
        // spreads that are and are not even
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let mut traded = 0;
        for case in 0..4_000 {
            let n = 2 + next(7) as usize;
            let count = 2 + next(30) as usize;
            let coarse = case % 3 == 0; // few distinct lengths: many ties
            let prompts: Vec<u32> = (0..count)
                .map(|_| {
                    if coarse {
                        100 * (1 + next(4) as u32)
                    } else {
                        next(9_000) as u32
                    }
                })
                .collect();
            let start: Vec<usize> = (0..count).map(|_| next(n as u64) as usize).collect();
            let kv: Vec<u64> = (0..n)
                .map(|_| next(if case % 2 == 0 { 20_000 } else { 500 }))
                .collect();
            let (mut fast, mut every) = (start.clone(), start.clone());
            swap_for_kv(&prompts, &mut fast, &kv);
            swap_for_kv_by_every_pair(&prompts, &mut every, &kv);
            assert_eq!(fast, every, "case {case}: prompts {prompts:?} kv {kv:?}");
            traded += usize::from(fast != start);
        }
        // the cases exercise trades, not only waves with nothing to trade
        assert!(traded > 1_000, "{traded} of 4,000 cases traded");
    }

    #[test]
    fn the_kv_pass_trades_large_prompts_to_the_rank_with_less_kv() {
        // rank 0 holds 10,000 KV tokens more than rank 1; the spread gave each a 3,000-token
        // prompt and rank 0 also a 1,000 and rank 1 a 500 (4,000 and 3,500 tokens): rank 0 may
        // not go above 4,000 tokens, so the 1,000 and the 500 trade (rank 1 to 4,000, rank 0
        // to 3,500) and the 3,000s stay
        let prompts = [3_000, 3_000, 1_000, 500];
        let mut ranks = [0, 1, 0, 1];
        swap_for_kv(&prompts, &mut ranks, &[20_000, 10_000]);
        assert_eq!(ranks, [0, 1, 1, 0]);
        // no trade lowers the higher rank when the gap (500) is no larger than every difference
        let mut ranks = [0, 1, 0, 1];
        swap_for_kv(&prompts, &mut ranks, &[10_000, 10_000]);
        assert_eq!(ranks, [0, 1, 0, 1]);
        // a trade that would lift the receiving rank above the wave's most tokens is not made:
        // rank 1 already takes the most (4,000)
        let mut ranks = [0, 1, 0, 1];
        swap_for_kv(&[3_000, 3_000, 500, 1_000], &mut ranks, &[20_000, 10_000]);
        assert_eq!(ranks, [0, 1, 0, 1]);
    }

    #[test]
    fn fractions_outside_their_range_are_refused() {
        for (hold, wave) in [(0.0, 1.0), (1.5, 1.0), (f64::NAN, 1.0), (0.05, 0.0)] {
            let cfg = BrcConfig {
                hold_fraction: hold,
                wave_fraction: wave,
                ..BrcConfig::default()
            };
            assert!(cfg.validate().is_err(), "{hold} {wave}");
        }
        for slack in [-0.1, 4.1, f64::NAN, f64::INFINITY] {
            let cfg = BrcConfig {
                fill_slack: slack,
                ..BrcConfig::default()
            };
            assert!(cfg.validate().is_err(), "{slack}");
        }
        assert!(BrcConfig::default().validate().is_ok());
    }
}
