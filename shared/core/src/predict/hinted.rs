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
/// share). Fixed size: [`RATIO_BINS`] counts and their prefix sums.
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
    fn new() -> Self {
        let edges = (0..=RATIO_BINS as i32)
            .map(|k| f64::exp2((f64::from(k - CENTRE_BIN) - 0.5) / f64::from(BINS_PER_OCTAVE)))
            .collect();
        Self {
            count: vec![0; RATIO_BINS],
            below: vec![0; RATIO_BINS + 1],
            moment_below: vec![0.0; RATIO_BINS + 1],
            edges,
            total: 0,
        }
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
        if x < self.edges[0] {
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
/// hint. Memory is fixed: the ratio bins (about 48 KiB) besides Survival's.
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
    fn from_hint(&self, expected: u32, generated: u32, horizon: u32) -> Option<Prediction> {
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
        let p = match self.from_hint(expected, r.generated, horizon) {
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
        s.bytes += self.ratios.bytes();
        s
    }
}
