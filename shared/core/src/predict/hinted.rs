//! [`Hinted`]: a client's expected output length, trusted as far as it has earned (BR-H's
//! `brh-hinted`), with [`Survival`] behind it.
//!
//! Separate from the other predictors because what it learns is not a distribution of
//! lengths but of how wrong the hints are: the ratio actual / expected over finished requests
//! that carried a hint, kept in log-spaced bins ([`RatioHistogram`]).

use super::*;

/// Bins per octave of the ratio actual / expected: 64 makes a bin 1.1% wide, so an exact hint
/// of 1,000 tokens is placed within about ±5 tokens (well inside BR-H's horizon).
const BINS_PER_OCTAVE: i32 = 64;
/// Ratios from 2^−12 to 2^12 are told apart (a hint 4,096 times too long or too short);
/// beyond that they count in the end bins.
const OCTAVES: i32 = 12;
/// Bins in all: 2·12 octaves of 64 (1,536).
const RATIO_BINS: usize = (2 * OCTAVES * BINS_PER_OCTAVE) as usize;
/// The bin whose centre is the ratio 1 (an exact hint).
const CENTRE_BIN: i32 = OCTAVES * BINS_PER_OCTAVE;

/// Hinted finishes a [`Hinted`] needs before it uses what it learned of the hints, by
/// default: the hint's weight compares two sample variances (of log lengths and of log
/// ratios), and at 64 samples each is within about 18% of its true value (one standard error,
/// √(2/63)), so hints that explain nothing are seldom given weight by chance; and 64 finishes
/// are a small share of what a group sees (hundreds a second at G = 32).
pub const DEFAULT_MIN_HINTED: u64 = 64;

/// Hints that explain less than this share of the spread of log output lengths are not used,
/// and the weight rises from 0 at it to 1 for exact hints (continuous, so no small change of
/// the estimate makes a jump). Hints that explain nothing have an estimated share that is not
/// exactly 0 (all-equal hints: Var[log r] and Var[log o] are the same sum rounded two ways;
/// at a few hundred samples a sampling error of several points), and a weight that small
/// would only perturb Survival's answer, which moves ties in BR-H's scores for no gain.
const MIN_EXPLAINED: f64 = 0.1;

/// The empirical distribution of the ratio actual / expected output length, in log-spaced
/// bins of [`BINS_PER_OCTAVE`] per octave, each bin's mass taken as spread evenly over its
/// ratios (so the distribution function is continuous and a horizon that cuts a bin takes its
/// share). Fixed size once used: [`RATIO_BINS`] counts and their prefix sums (about 48 KiB),
/// allocated at the first ratio, so a model that never sees a hint (a [`super::Classed`]
/// class whose gateway sends none) costs nothing for it.
#[derive(Debug, Clone)]
struct RatioHistogram {
    count: Vec<u64>,
    /// `below[k]`: the ratios counted in bins below k (`RATIO_BINS + 1` long), so the
    /// distribution function at any ratio is one lookup.
    below: Vec<u64>,
    /// `moment_below[k]`: the sum of the ratios below bin k, each counted as its bin's mean.
    moment_below: Vec<f64>,
    /// `edges[k]`: bin k's lowest ratio; `edges[RATIO_BINS]` the top of the last.
    edges: Vec<f64>,
    total: u64,
}

impl RatioHistogram {
    /// Empty, holding nothing until the first [`RatioHistogram::add`].
    fn new() -> Self {
        Self {
            count: Vec::new(),
            below: Vec::new(),
            moment_below: Vec::new(),
            edges: Vec::new(),
            total: 0,
        }
    }

    fn allocate(&mut self) {
        self.edges = (0..=RATIO_BINS as i32)
            .map(|k| f64::exp2((f64::from(k - CENTRE_BIN) - 0.5) / f64::from(BINS_PER_OCTAVE)))
            .collect();
        self.count = vec![0; RATIO_BINS];
        self.below = vec![0; RATIO_BINS + 1];
        self.moment_below = vec![0.0; RATIO_BINS + 1];
    }

    fn bytes(&self) -> usize {
        (self.count.capacity() + self.below.capacity()) * std::mem::size_of::<u64>()
            + (self.moment_below.capacity() + self.edges.capacity()) * std::mem::size_of::<f64>()
    }

    /// The bin holding `ratio` (the end bins hold everything beyond them).
    fn bin_of(&self, ratio: f64) -> usize {
        let guess = (ratio.log2() * f64::from(BINS_PER_OCTAVE) + f64::from(CENTRE_BIN) + 0.5)
            .floor()
            .clamp(0.0, (RATIO_BINS - 1) as f64) as usize;
        // log2's rounding may put a ratio on an edge into the neighbouring bin
        let mut k = guess;
        while k > 0 && ratio < self.edges[k] {
            k -= 1;
        }
        while k + 1 < RATIO_BINS && ratio >= self.edges[k + 1] {
            k += 1;
        }
        k
    }

    fn add(&mut self, ratio: f64) {
        if self.edges.is_empty() {
            self.allocate();
        }
        let k = self.bin_of(ratio);
        let mean = (self.edges[k] + self.edges[k + 1]) / 2.0;
        self.count[k] += 1;
        for b in &mut self.below[k + 1..] {
            *b += 1;
        }
        for m in &mut self.moment_below[k + 1..] {
            *m += mean;
        }
        self.total += 1;
    }

    /// (mass, first moment) of the ratios at or below `x`, the mass of each bin spread
    /// evenly over it.
    fn cumulative(&self, x: f64) -> (f64, f64) {
        if self.total == 0 || x < self.edges[0] {
            return (0.0, 0.0);
        }
        if x >= self.edges[RATIO_BINS] {
            return (self.total as f64, self.moment_below[RATIO_BINS]);
        }
        let k = self.bin_of(x);
        let (lo, hi) = (self.edges[k], self.edges[k + 1]);
        let share = ((x - lo) / (hi - lo)).clamp(0.0, 1.0);
        let part = self.count[k] as f64 * share;
        (
            self.below[k] as f64 + part,
            self.moment_below[k] + part * (lo + x.min(hi)) / 2.0,
        )
    }
}

/// Running sums of a variable's values (for its sample variance).
#[derive(Debug, Clone, Copy, Default)]
struct Moments {
    n: u64,
    sum: f64,
    sum_sq: f64,
}

impl Moments {
    fn add(&mut self, x: f64) {
        self.n += 1;
        self.sum += x;
        self.sum_sq += x * x;
    }

    fn variance(&self) -> f64 {
        if self.n < 2 {
            return 0.0;
        }
        let n = self.n as f64;
        let mean = self.sum / n;
        ((self.sum_sq / n - mean * mean) * n / (n - 1.0)).max(0.0)
    }
}

/// Predicts from the client's expected output length `e` (a hint) where hints have proved
/// worth something, else as [`Survival`] does.
///
/// It learns online, from every finished request that carried a hint, the distribution of
/// the ratio r = actual / expected (a [`RatioHistogram`]: hints consistently 2× too short
/// are learned as r ≈ 2 and corrected), and how much of the spread of output lengths the
/// hints explain: the share `1 − Var[log r] / Var[log o]` over those requests, and from it the
/// weight `w` in [0, 1] (1 for exact hints; 0 for hints that explain nothing, such as hints
/// shuffled among requests, where Var[log r] = Var[log o] + Var[log e], or all equal, where
/// Var[log r] = Var[log o], and for those that explain less than [`MIN_EXPLAINED`]). A request with hint e that generated j tokens is then predicted
/// from the mixture of the two predictive distributions, `w` of the hint's (o = r·e
/// conditioned on o > j) and `1 − w` of Survival's, so useless hints give Survival's answer
/// rather than a worse one.
///
/// Survival (its own [`Survival`], which learns from every finished request, hinted or not)
/// predicts alone a request without a hint, every request until [`Hinted`] has seen
/// `min_hinted` hinted finishes, and a request that has outlived every ratio learned for its
/// hint. Memory is fixed: the ratio bins (about 48 KiB, from the first hinted finish on)
/// besides Survival's.
#[derive(Debug, Clone)]
pub struct Hinted {
    fallback: Survival,
    ratios: RatioHistogram,
    /// log of the output length, and log of the ratio, over the hinted finishes.
    log_output: Moments,
    log_ratio: Moments,
    min_hinted: u64,
}

impl Hinted {
    pub fn new(fallback: Survival, min_hinted: u64) -> Self {
        Self {
            fallback,
            ratios: RatioHistogram::new(),
            log_output: Moments::default(),
            log_ratio: Moments::default(),
            min_hinted: min_hinted.max(1),
        }
    }

    /// Finished requests observed, hinted or not.
    pub fn samples(&self) -> u64 {
        self.fallback.samples()
    }

    /// Hinted finishes observed.
    pub fn hinted_samples(&self) -> u64 {
        self.ratios.total
    }

    /// The share of the hint's prediction in the mixture (see [`Hinted`]): 0 until
    /// `min_hinted` hinted finishes were observed.
    pub fn hint_weight(&self) -> f64 {
        if self.ratios.total < self.min_hinted {
            return 0.0;
        }
        let spread = self.log_output.variance();
        if spread <= 0.0 {
            // every output alike: Survival already knows it, a hint adds nothing
            return 0.0;
        }
        let explained = 1.0 - self.log_ratio.variance() / spread;
        ((explained - MIN_EXPLAINED) / (1.0 - MIN_EXPLAINED)).clamp(0.0, 1.0)
    }

    /// Learns how far `f`'s hint was off, if it carried one (and says whether it did).
    fn learn_hint(&mut self, f: &Finished) -> bool {
        let Some(expected) = f.expected_output else {
            return false;
        };
        let o = f64::from(f.output_tokens.max(1));
        let ratio = o / f64::from(expected.max(1));
        self.ratios.add(ratio);
        self.log_output.add(o.ln());
        self.log_ratio.add(ratio.ln());
        true
    }

    /// The hint's prediction for a request with hint `expected` that generated `generated`
    /// tokens: from the ratios above `generated / expected`. `None` when less than one learned
    /// ratio's mass is above it (the request outlived what the hints say).
    fn hint_prediction(&self, expected: u32, generated: u32, horizon: u32) -> Option<Prediction> {
        let e = f64::from(expected.max(1));
        let j = f64::from(generated);
        let h = f64::from(horizon);
        let (done, done_moment) = self.ratios.cumulative(j / e);
        let alive = self.ratios.total as f64 - done;
        if alive < 1.0 {
            return None;
        }
        let (by_end, by_end_moment) = self.ratios.cumulative((j + h) / e);
        let finishing = by_end - done;
        if finishing <= 0.0 {
            return Some(Prediction::RUNS_ON);
        }
        let mean_output = e * (by_end_moment - done_moment) / finishing;
        Some(Prediction {
            p_finish: (finishing / alive).min(1.0),
            mean_remaining: (mean_output - j).clamp(0.0, h),
        })
    }
}

/// `w` of `hinted` and `1 − w` of `survival`: the mixture's P(finish within the horizon) and
/// its mean remaining given a finish.
fn mixture(w: f64, hinted: Prediction, survival: Prediction) -> Prediction {
    let p = w * hinted.p_finish + (1.0 - w) * survival.p_finish;
    if p <= 0.0 {
        return Prediction::RUNS_ON;
    }
    let weighted = w * hinted.p_finish * hinted.mean_remaining
        + (1.0 - w) * survival.p_finish * survival.mean_remaining;
    Prediction {
        p_finish: p,
        mean_remaining: weighted / p,
    }
}

impl Default for Hinted {
    fn default() -> Self {
        PredictorConfig::default().hinted()
    }
}

impl Predictor for Hinted {
    fn name(&self) -> &'static str {
        "hinted"
    }

    fn predict(&self, r: &RequestInfo, horizon: u32) -> Prediction {
        self.predict_with_reads(r, horizon).0
    }

    /// A request without a hint reads only what Survival read. One with a hint also reads
    /// [`SOURCE_HINTS`] (the ratios and the weight, which every hinted finish replaces: after
    /// one, every hinted request is predicted again, at the cost of a ratio lookup and a
    /// Survival prediction each), including while the weight is 0, since a hinted finish may
    /// make it positive. Survival's part is read as Survival reads it, so its one-sample
    /// changes keep the mixture's prediction wherever they keep Survival's (a sample at or
    /// below `j` changes neither part; a survivor beyond `j + H` only lowers Survival's
    /// p_finish, and so the mixture's).
    fn predict_with_reads(&self, r: &RequestInfo, horizon: u32) -> (Prediction, Reads) {
        let (survival, reads) = self.fallback.predict_with_reads(r, horizon);
        let Some(expected) = r.expected_output else {
            return (survival, reads);
        };
        let read = Reads::two(SOURCE_HINTS, reads.0[0]);
        let w = self.hint_weight();
        if w <= 0.0 {
            return (survival, read);
        }
        let p = match self.hint_prediction(expected, r.generated, horizon) {
            Some(hinted) if w >= 1.0 => hinted,
            Some(hinted) => mixture(w, hinted, survival),
            None => survival,
        };
        (p, read)
    }

    fn alike(&self, r: &RequestInfo) -> Option<u64> {
        // Without a hint it predicts as Survival does, reading what Survival reads; hinted
        // requests are each their own (their hints differ).
        match r.expected_output {
            None => self.fallback.alike(r),
            Some(_) => None,
        }
    }

    fn observe(&mut self, f: &Finished) {
        self.fallback.observe(f);
        self.learn_hint(f);
    }

    /// What Survival's observation changed, and [`SOURCE_HINTS`] replaced when `f` carried a
    /// hint.
    fn learn(&mut self, f: &Finished) -> Changed {
        let changed = self.fallback.learn_sample(f);
        if self.learn_hint(f) {
            changed.with(SOURCE_HINTS)
        } else {
            changed
        }
    }

    fn stats(&self) -> PredictorStats {
        let mut s = self.fallback.stats();
        s.hinted = self.ratios.total;
        s.bytes += self.ratios.bytes();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests as predict_tests;
    use super::*;

    /// 1,000 output lengths spread over 100..2,000 (a fixed scramble, no RNG).
    fn outputs() -> Vec<u32> {
        (0..1_000u32).map(|i| 100 + (i * 7_919) % 1_900).collect()
    }

    fn finished(output_tokens: u32, expected_output: Option<u32>) -> Finished {
        Finished {
            expected_output,
            ..predict_tests::fin(None, output_tokens)
        }
    }

    fn running(generated: u32, expected_output: Option<u32>) -> RequestInfo {
        RequestInfo {
            expected_output,
            ..predict_tests::running(generated, None, None)
        }
    }

    /// A Hinted and a Survival taught the same finishes, the i-th with `hint(i, output)`.
    fn taught(hint: impl Fn(usize, u32) -> Option<u32>) -> (Hinted, Survival) {
        let (mut h, mut s) = (Hinted::default(), Survival::default());
        for (i, o) in outputs().into_iter().enumerate() {
            let f = finished(o, hint(i, o));
            let _ = h.learn(&f);
            s.observe(&f);
        }
        (h, s)
    }

    #[test]
    fn exact_hints_place_the_finish() {
        let (h, s) = taught(|_, o| Some(o));
        assert!(h.hint_weight() > 0.99, "{}", h.hint_weight());
        // 50 tokens left of an exact hint of 1,000: it finishes within 80, in about 50
        let p = h.predict(&running(950, Some(1_000)), 80);
        assert!(p.p_finish > 0.99, "{p:?}");
        assert!((p.mean_remaining - 50.0).abs() < 6.0, "{p:?}");
        // Survival alone, not knowing this request, is far from confident
        assert!(s.predict(&running(950, None), 80).p_finish < 0.2);
        // 200 tokens left: it runs past the horizon
        assert_eq!(h.predict(&running(800, Some(1_000)), 80).p_finish, 0.0);
    }

    #[test]
    fn hints_consistently_half_the_truth_are_corrected() {
        let (h, _) = taught(|_, o| Some(o.div_ceil(2)));
        assert!(h.hint_weight() > 0.99, "{}", h.hint_weight());
        // a hint of 500 means about 1,000: at j = 950 it finishes in about 50
        let p = h.predict(&running(950, Some(500)), 80);
        assert!(p.p_finish > 0.99, "{p:?}");
        assert!((p.mean_remaining - 50.0).abs() < 6.0, "{p:?}");
        // and at j = 400, where the raw hint says 100 more, it runs on (Survival's share of
        // the mixture, 1 − w, is a few millionths: the halving rounds up odd lengths)
        let p = h.predict(&running(400, Some(500)), 80);
        assert!(p.p_finish < 1e-3, "{p:?}");
    }

    #[test]
    fn without_a_hint_it_is_survival_exactly() {
        // half the finishes hinted: Survival learns from all of them
        let (h, s) = taught(|i, o| (i % 2 == 0).then_some(o));
        for j in [0, 100, 500, 1_000, 1_500, 1_990, 2_500] {
            for horizon in [1, 80, 400] {
                let r = running(j, None);
                assert_eq!(
                    h.predict_with_reads(&r, horizon),
                    s.predict_with_reads(&r, horizon),
                    "j {j}, H {horizon}"
                );
                assert_eq!(h.alike(&r), s.alike(&r));
            }
        }
    }

    /// Hints that say nothing of their own request are given no weight: the predictions are
    /// Survival's.
    fn useless_hints_give_survival(hint: impl Fn(usize, u32) -> Option<u32>) {
        let (h, s) = taught(hint);
        assert_eq!(h.hint_weight(), 0.0);
        for j in [0, 300, 900, 1_200, 1_900] {
            for e in [150, 1_000, 1_900] {
                let hinted = h.predict(&running(j, Some(e)), 80);
                let survival = s.predict(&running(j, None), 80);
                assert!(
                    (hinted.p_finish - survival.p_finish).abs() < 1e-9
                        && (hinted.mean_remaining - survival.mean_remaining).abs() < 1e-9,
                    "j {j}, e {e}: {hinted:?} against {survival:?}"
                );
            }
        }
    }

    #[test]
    fn shuffled_hints_predict_as_survival() {
        let all = outputs();
        // each finish carries another request's length
        useless_hints_give_survival(|i, _| Some(all[(i * 31 + 7) % all.len()]));
    }

    #[test]
    fn constant_hints_predict_as_survival() {
        useless_hints_give_survival(|_, _| Some(1_050));
    }

    #[test]
    fn noisy_hints_weigh_between_survival_and_the_hint() {
        // ±20% error (a fixed pattern): informative, not exact
        let (h, s) = taught(|i, o| Some(o * [8, 10, 12][i % 3] / 10));
        let w = h.hint_weight();
        assert!(w > 0.5 && w < 1.0, "{w}");
        let hinted = h.predict(&running(950, Some(1_000)), 80).p_finish;
        let survival = s.predict(&running(950, None), 80).p_finish;
        assert!(hinted > survival + 0.1, "{hinted} against {survival}");
    }

    #[test]
    fn hints_are_used_after_min_hinted_hinted_finishes() {
        let mut h = Hinted::default();
        let mut s = Survival::default();
        let r = running(950, Some(1_000));
        for (i, o) in outputs()
            .into_iter()
            .take(DEFAULT_MIN_HINTED as usize)
            .enumerate()
        {
            // before: Survival's answer, reading the hints too (the next finish may change it)
            assert_eq!(h.hint_weight(), 0.0, "after {i}");
            let (p, reads) = h.predict_with_reads(&r, 80);
            assert_eq!(p, s.predict(&running(950, None), 80));
            assert!(reads.sources().any(|x| x == SOURCE_HINTS));
            let f = finished(o, Some(o));
            // a hinted finish replaces the hints' source; Survival's part is sampled
            let changed = h.learn(&f);
            assert!(changed.replaces(SOURCE_HINTS));
            s.observe(&f);
        }
        assert!(h.hint_weight() > 0.99);
        assert!(h.predict(&r, 80).p_finish > 0.99);
        // an unhinted finish leaves the hints as they were
        assert!(!h.learn(&finished(700, None)).contains(SOURCE_HINTS));
    }

    #[test]
    fn ratio_histogram_is_continuous_and_bounded() {
        let mut r = RatioHistogram::new();
        // nothing held, nothing below any ratio, until the first ratio
        assert_eq!(
            (r.bytes(), r.cumulative(1.0), r.cumulative(f64::MAX)),
            (0, (0.0, 0.0), (0.0, 0.0))
        );
        r.add(1.0);
        r.add(1e-9);
        r.add(1e9);
        assert_eq!(r.total, 3);
        // the exact ratio's bin is centred on 1 (in log): about half its mass below
        let (below_one, _) = r.cumulative(1.0);
        assert!((below_one - 1.5).abs() < 0.01, "{below_one}");
        let mut last = 0.0;
        for k in 0..=4_000 {
            let x = f64::exp2(f64::from(k - 2_000) / 150.0);
            let (c, _) = r.cumulative(x);
            assert!(c >= last - 1e-12 && c <= 3.0, "{x}: {c} after {last}");
            last = c;
        }
        assert_eq!(r.cumulative(f64::MAX).0, 3.0);
    }
}
