//! The choices one tick makes: which worker Stage 1 or Stage 2 serves next, which pooled
//! request or subset of candidates it gets, and the tick-head index the candidates come from.
//!
//! Separate from [`super::dispatch_tick`], which sequences the stages: these are the pure
//! selection rules it calls, each readable (and measurable) on its own.

use super::bypass::tie_key;
use super::*;

/// Per worker, what its projected load climbs before its first projected fall (its next
/// predicted finish), or over the whole horizon if it does not fall; 0 for a dead worker. And
/// the mean over the live workers. O(G·H).
pub(super) fn climbs(state: &ClusterState, margins: &Margins) -> (Vec<f64>, f64) {
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

pub(super) fn all_margins_zero(state: &ClusterState, margins: &Margins) -> bool {
    state.live_worker_ids().all(|w| margins.margin(w, 0) <= 0.0)
}

pub(super) fn stage1_worker(
    rule: Stage1Worker,
    free: &[u32],
    margins: &Margins,
) -> Option<WorkerId> {
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
pub(super) fn best_worker(
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
pub(super) fn stage2_worker(free: &[u32], done: &[bool], margins: &Margins) -> Option<WorkerId> {
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
pub(super) fn best_single(pool: &Pool, margins: &Margins, w: WorkerId) -> Option<PoolEntry> {
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
pub(super) struct Head {
    pub(super) entries: Vec<PoolEntry>,
    /// (prompt tokens, index in `entries`) of the requests still waiting, ascending.
    by_size: Vec<(u32, u32)>,
}

impl Head {
    pub(super) fn new(pool: &Pool, len: usize) -> Self {
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
    pub(super) fn take(&mut self, index: u32) {
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
    pub(super) fn candidates(
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
    best_subset_by(sizes, |_| 0.0, max_items, score)
}

/// [`best_subset_counted`] with `extra[i]` added to a subset's score for each member i.
pub(super) fn best_subset_with(
    sizes: &[f64],
    extra: &[f64],
    max_items: usize,
    score: impl Fn(f64, u32) -> f64,
) -> (u32, f64) {
    best_subset_by(sizes, |i| extra[i], max_items, score)
}

/// The enumeration behind both: every non-empty subset of at most `max_items` members, scored
/// `score(Σ sizes, members) + Σ extra(i)` (ties: the first in enumeration order).
fn best_subset_by(
    sizes: &[f64],
    extra: impl Fn(usize) -> f64,
    max_items: usize,
    score: impl Fn(f64, u32) -> f64,
) -> (u32, f64) {
    let n = sizes.len().min(MAX_R_MAX);
    let mut best = (0u32, f64::NEG_INFINITY);
    for mask in 1u32..(1u32 << n) {
        if mask.count_ones() as usize > max_items {
            continue;
        }
        let members = (0..n).filter(|i| mask & (1 << i) != 0);
        let (ds, bonus) = members.fold((0.0, 0.0), |(d, b), i| (d + sizes[i], b + extra(i)));
        let f = score(ds, mask.count_ones()) + bonus;
        if f > best.1 {
            best = (mask, f);
        }
    }
    best
}
