//! Termination predictors for BR-H.
//!
//! BR-H does not need an output-length regressor, only a binary classifier: will request i
//! finish within H more steps? Where the classifier is confident (probability ≥ the gate) the
//! request is projected to leave after `ĉ_i = (1 − p)·H + p·μ_rem` steps; otherwise it is
//! assumed to run past the horizon (the conservative anchor).

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::state::RequestInfo;

/// What a predictor says about one running request, `horizon` steps ahead.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// P(the request finishes within `horizon` more tokens | it has generated `j` so far).
    pub p_finish: f64,
    /// E[remaining tokens | it finishes within the horizon]; meaningless when p_finish = 0.
    pub mean_remaining: f64,
}

impl Prediction {
    pub const RUNS_ON: Prediction = Prediction {
        p_finish: 0.0,
        mean_remaining: 0.0,
    };
}

pub trait Predictor: Send + Sync + std::fmt::Debug {
    fn name(&self) -> &'static str;
    fn predict(&self, request: &RequestInfo, horizon: u32) -> Prediction;
    /// Learns from a finished request (online update).
    fn observe(&mut self, prompt_hash: Option<u64>, output_tokens: u32);
    /// Whether [`Predictor::observe`] can change what it predicts (a [`PredictionCache`] is
    /// invalidated by every observation of one that does).
    fn learns(&self) -> bool {
        true
    }
}

/// `ĉ_i`: steps until the request is expected to leave, or `horizon + 1` (beyond the horizon)
/// when the predictor is not confident enough.
pub fn expected_remaining(p: &dyn Predictor, r: &RequestInfo, horizon: u32, gate: f64) -> f64 {
    if horizon == 0 {
        return 1.0;
    }
    let pred = p.predict(r, horizon);
    if pred.p_finish >= gate && pred.p_finish > 0.0 {
        (1.0 - pred.p_finish) * f64::from(horizon) + pred.p_finish * pred.mean_remaining
    } else {
        f64::from(horizon) + 1.0
    }
}

/// Each request's BR-H prediction (`⌈ĉ_i⌉` as a horizon step), kept between ticks.
///
/// A tick at G = 64 asks the predictor about every running request (16k of them), although
/// between two ticks most requests did not generate a token and the predictor learned nothing.
/// An entry is reused only when the request is exactly as it was when predicted (the whole
/// [`RequestInfo`]: generated tokens, phase, prompt hash, …), the horizon and gate are the same
/// and the predictor has not learned since ([`PredictionCache::invalidate`], which the policy
/// calls from `observe_finished`). So a cached tick decides exactly as an uncached one.
///
/// Entries sit in a table indexed by the request's slot in [`crate::ClusterState`] (a hash map
/// keyed by request was measured slower than predicting again: docs/benchmarks.md).
#[derive(Debug, Clone, Default)]
pub struct PredictionCache {
    /// By slot; an entry of a request that left is caught by the key comparison.
    entries: Vec<Option<Cached>>,
    /// Bumped when the predictor learns: every older entry is stale.
    generation: u64,
    /// (horizon, gate bits) the entries were computed for.
    params: Option<(u32, u64)>,
    hits: u64,
    misses: u64,
}

#[derive(Debug, Clone)]
struct Cached {
    request: RequestInfo,
    generation: u64,
    end: usize,
}

impl PredictionCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// The predictor learned (or was replaced): no entry may be reused.
    pub fn invalidate(&mut self) {
        self.generation = self.generation.wrapping_add(1);
    }

    /// (hits, misses) since it was made: how often a tick could skip the predictor.
    pub fn hit_counts(&self) -> (u64, u64) {
        (self.hits, self.misses)
    }

    /// Entries held (one per slot σ has had; σ's slots are reused, so this stays bounded).
    pub fn len(&self) -> usize {
        self.entries.iter().filter(|e| e.is_some()).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn begin_tick(&mut self, params: &crate::score::HorizonParams, slots: usize) {
        let p = (params.horizon, params.gate.to_bits());
        if self.params != Some(p) {
            self.params = Some(p);
            self.invalidate();
        }
        if self.entries.len() < slots {
            self.entries.resize(slots, None);
        } else {
            // σ shrank (a new σ was installed): forget the slots it no longer has.
            self.entries.truncate(slots);
        }
    }

    /// The cached end of `r` (in `slot`), or `compute()` (then cached).
    pub(crate) fn end(
        &mut self,
        slot: usize,
        r: &RequestInfo,
        compute: impl FnOnce() -> usize,
    ) -> usize {
        let generation = self.generation;
        let Some(entry) = self.entries.get_mut(slot) else {
            self.misses += 1;
            return compute();
        };
        if let Some(c) = entry
            && c.generation == generation
            && c.request == *r
        {
            self.hits += 1;
            return c.end;
        }
        let end = compute();
        *entry = Some(Cached {
            request: r.clone(),
            generation,
            end,
        });
        self.misses += 1;
        end
    }
}

/// A Fenwick tree over output lengths 1..=max_len (count and sum), for O(log n) tail queries.
#[derive(Debug, Clone)]
struct LengthHistogram {
    count: Vec<u64>,
    sum: Vec<u64>,
    total: u64,
}

impl LengthHistogram {
    fn new(max_len: u32) -> Self {
        let n = max_len as usize + 1;
        Self {
            count: vec![0; n],
            sum: vec![0; n],
            total: 0,
        }
    }

    fn max_len(&self) -> u32 {
        (self.count.len() - 1) as u32
    }

    fn add(&mut self, len: u32) {
        let len = len.clamp(1, self.max_len());
        let mut i = len as usize;
        while i < self.count.len() {
            self.count[i] += 1;
            self.sum[i] += u64::from(len);
            i += i & i.wrapping_neg();
        }
        self.total += 1;
    }

    /// (count, sum) of lengths ≤ len.
    fn prefix(&self, len: u32) -> (u64, u64) {
        let mut i = (len.min(self.max_len())) as usize;
        let (mut c, mut s) = (0, 0);
        while i > 0 {
            c += self.count[i];
            s += self.sum[i];
            i -= i & i.wrapping_neg();
        }
        (c, s)
    }

    /// The median output length of the requests still running after `generated` tokens:
    /// the smallest `L > generated` with P(o ≤ L | o > generated) ≥ 1/2. `None` when no
    /// observed length exceeds `generated`.
    fn conditional_median(&self, generated: u32) -> Option<u32> {
        let (c_j, _) = self.prefix(generated);
        let alive = self.total - c_j;
        if alive == 0 || generated >= self.max_len() {
            return None;
        }
        let need = c_j + alive.div_ceil(2);
        // prefix() is monotone in the length: binary search the first length reaching `need`.
        let (mut lo, mut hi) = (generated + 1, self.max_len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.prefix(mid).0 >= need {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Some(lo)
    }

    /// P(o ≤ j + h | o > j) and E[o − j | j < o ≤ j + h].
    fn conditional(&self, generated: u32, horizon: u32) -> Prediction {
        let (c_j, s_j) = self.prefix(generated);
        let alive = self.total - c_j;
        if alive == 0 {
            return Prediction::RUNS_ON;
        }
        let (c_h, s_h) = self.prefix(generated.saturating_add(horizon));
        let finishing = c_h - c_j;
        if finishing == 0 {
            return Prediction::RUNS_ON;
        }
        let mean_len = (s_h - s_j) as f64 / finishing as f64;
        Prediction {
            p_finish: finishing as f64 / alive as f64,
            mean_remaining: mean_len - f64::from(generated),
        }
    }
}

/// The empirical output-length distribution, updated online from finished requests.
#[derive(Debug, Clone)]
pub struct Survival {
    hist: LengthHistogram,
    min_samples: u64,
}

impl Survival {
    /// Lengths above `max_len` are counted as `max_len`. Predicts "runs on" until it has seen
    /// `min_samples` finished requests.
    pub fn new(max_len: u32, min_samples: u64) -> Self {
        Self {
            hist: LengthHistogram::new(max_len.max(1)),
            min_samples,
        }
    }

    pub fn samples(&self) -> u64 {
        self.hist.total
    }

    /// The median output length of a request that has generated `generated` tokens and not
    /// finished: a point estimate of when it ends (lengths above `max_len` count as
    /// `max_len`). `None` until `min_samples` lengths were observed, or when the request
    /// already outlived every one of them (then nothing is known: it runs on).
    pub fn median_output(&self, generated: u32) -> Option<u32> {
        if self.hist.total < self.min_samples {
            return None;
        }
        self.hist.conditional_median(generated)
    }
}

impl Default for Survival {
    fn default() -> Self {
        Self::new(32_768, 32)
    }
}

impl Predictor for Survival {
    fn name(&self) -> &'static str {
        "survival"
    }

    fn predict(&self, r: &RequestInfo, horizon: u32) -> Prediction {
        if self.hist.total < self.min_samples {
            return Prediction::RUNS_ON;
        }
        self.hist.conditional(r.generated, horizon)
    }

    fn observe(&mut self, _hash: Option<u64>, output_tokens: u32) {
        self.hist.add(output_tokens);
    }
}

/// Per-prompt-hash empirical lengths; falls back to [`Survival`] on a miss.
#[derive(Debug, Clone)]
pub struct ExactMatch {
    fallback: Survival,
    by_hash: FxHashMap<u64, VecDeque<u32>>,
    /// Insertion order of hashes, for bounded memory (oldest hash forgotten first).
    order: VecDeque<u64>,
    max_hashes: usize,
    samples_per_hash: usize,
    min_hits: usize,
}

impl ExactMatch {
    pub fn new(
        fallback: Survival,
        max_hashes: usize,
        samples_per_hash: usize,
        min_hits: usize,
    ) -> Self {
        Self {
            fallback,
            by_hash: FxHashMap::default(),
            order: VecDeque::new(),
            max_hashes: max_hashes.max(1),
            samples_per_hash: samples_per_hash.max(1),
            min_hits: min_hits.max(1),
        }
    }

    pub fn known_hashes(&self) -> usize {
        self.by_hash.len()
    }
}

impl Default for ExactMatch {
    fn default() -> Self {
        Self::new(Survival::default(), 1 << 20, 16, 1)
    }
}

impl Predictor for ExactMatch {
    fn name(&self) -> &'static str {
        "exact-match"
    }

    fn predict(&self, r: &RequestInfo, horizon: u32) -> Prediction {
        let Some(samples) = r.prompt_hash.and_then(|h| self.by_hash.get(&h)) else {
            return self.fallback.predict(r, horizon);
        };
        let j = r.generated;
        let alive: Vec<u32> = samples.iter().copied().filter(|&o| o > j).collect();
        if alive.len() < self.min_hits {
            return self.fallback.predict(r, horizon);
        }
        let end = j.saturating_add(horizon);
        let finishing: Vec<u32> = alive.iter().copied().filter(|&o| o <= end).collect();
        if finishing.is_empty() {
            return Prediction::RUNS_ON;
        }
        let mean = finishing.iter().map(|&o| f64::from(o)).sum::<f64>() / finishing.len() as f64;
        Prediction {
            p_finish: finishing.len() as f64 / alive.len() as f64,
            mean_remaining: mean - f64::from(j),
        }
    }

    fn observe(&mut self, hash: Option<u64>, output_tokens: u32) {
        self.fallback.observe(hash, output_tokens);
        let Some(h) = hash else { return };
        if !self.by_hash.contains_key(&h) {
            if self.by_hash.len() >= self.max_hashes
                && let Some(old) = self.order.pop_front()
            {
                self.by_hash.remove(&old);
            }
            self.order.push_back(h);
        }
        let samples = self.by_hash.entry(h).or_default();
        if samples.len() >= self.samples_per_hash {
            samples.pop_front();
        }
        samples.push_back(output_tokens);
    }
}

/// The true remaining length (simulation only): an upper bound on what prediction can give.
#[derive(Debug, Clone, Default)]
pub struct Oracle;

impl Predictor for Oracle {
    fn name(&self) -> &'static str {
        "oracle"
    }

    fn predict(&self, r: &RequestInfo, horizon: u32) -> Prediction {
        match r.oracle_output {
            Some(o) if o > r.generated && o - r.generated <= horizon => Prediction {
                p_finish: 1.0,
                mean_remaining: f64::from(o - r.generated),
            },
            _ => Prediction::RUNS_ON,
        }
    }

    fn observe(&mut self, _hash: Option<u64>, _output_tokens: u32) {}

    fn learns(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Phase;

    fn running(generated: u32, hash: Option<u64>, oracle: Option<u32>) -> RequestInfo {
        RequestInfo {
            key: 1,
            worker: 0,
            prompt_tokens: 10,
            generated,
            phase: Phase::Running,
            prompt_hash: hash,
            oracle_output: oracle,
        }
    }

    #[test]
    fn survival_conditions_on_progress() {
        let mut s = Survival::new(4096, 1);
        for len in [100, 200, 300, 400] {
            s.observe(None, len);
        }
        // at j = 150: alive {200,300,400}; within 100 more: {200}
        let p = s.predict(&running(150, None, None), 100);
        assert!((p.p_finish - 1.0 / 3.0).abs() < 1e-12);
        assert!((p.mean_remaining - 50.0).abs() < 1e-12);
        // beyond every observed length: unknown, so it runs on
        assert_eq!(
            s.predict(&running(500, None, None), 100),
            Prediction::RUNS_ON
        );
    }

    #[test]
    fn median_output_conditions_on_progress() {
        let mut s = Survival::new(4096, 3);
        s.observe(None, 100);
        s.observe(None, 200);
        assert_eq!(s.median_output(0), None, "too few samples");
        for len in [300, 400] {
            s.observe(None, len);
        }
        // {100, 200, 300, 400}: half are done by 200.
        assert_eq!(s.median_output(0), Some(200));
        // Alive at 150: {200, 300, 400}; 2 of 3 are done by 300.
        assert_eq!(s.median_output(150), Some(300));
        assert_eq!(s.median_output(399), Some(400));
        assert_eq!(s.median_output(400), None, "outlived every observed length");
        // Against a brute-force median over the same lengths.
        let lens = [3u32, 3, 7, 9, 12, 12, 12, 40, 41, 1000];
        let mut s = Survival::new(4096, 1);
        for &l in &lens {
            s.observe(None, l);
        }
        for j in 0..1001 {
            let alive: Vec<u32> = lens.iter().copied().filter(|&o| o > j).collect();
            let want = (!alive.is_empty()).then(|| alive[alive.len().div_ceil(2) - 1]);
            assert_eq!(s.median_output(j), want, "j = {j}");
        }
    }

    #[test]
    fn survival_waits_for_enough_samples() {
        let mut s = Survival::new(4096, 3);
        s.observe(None, 10);
        assert_eq!(s.predict(&running(0, None, None), 100), Prediction::RUNS_ON);
    }

    #[test]
    fn exact_match_prefers_its_hash_and_falls_back() {
        let mut e = ExactMatch::new(Survival::new(4096, 1), 2, 4, 1);
        e.observe(Some(7), 50);
        e.observe(None, 1000);
        let hit = e.predict(&running(10, Some(7), None), 80);
        assert_eq!(hit.p_finish, 1.0);
        assert_eq!(hit.mean_remaining, 40.0);
        let miss = e.predict(&running(10, Some(8), None), 80);
        // survival over {50, 1000}: alive at 10 = 2, finishing within 90 = 1
        assert_eq!(miss.p_finish, 0.5);
        // bounded memory: a third hash evicts the oldest
        e.observe(Some(8), 1);
        e.observe(Some(9), 1);
        assert_eq!(e.known_hashes(), 2);
    }

    #[test]
    fn oracle_and_gate() {
        let o = Oracle;
        let r = running(100, None, Some(130));
        assert_eq!(expected_remaining(&o, &r, 80, 0.5), 30.0);
        let far = running(100, None, Some(1000));
        assert_eq!(expected_remaining(&o, &far, 80, 0.5), 81.0);
        let mut s = Survival::new(4096, 1);
        s.observe(None, 120);
        s.observe(None, 5000);
        // p = 0.5 at j = 100: below a 0.6 gate it runs on, at 0.5 it counts
        assert_eq!(expected_remaining(&s, &r, 80, 0.6), 81.0);
        assert_eq!(expected_remaining(&s, &r, 80, 0.5), 0.5 * 80.0 + 0.5 * 20.0);
    }
}
