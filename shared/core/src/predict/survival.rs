//! [`Survival`]: the empirical output-length distribution by prompt-length octave
//! (`brh-survival`, and [`super::ExactMatch`]'s fallback), with the global distribution as the
//! cold-start prior.
//!
//! Separate from the predictor trait and the cache: it is one predictor's model, read on its
//! own; its histograms are in `histogram.rs`.

use super::histogram::LengthHistogram;
use super::*;

/// Prompt-length octaves: bucket b holds prompts of 2^(b−1)..2^b − 1 tokens (0 for empty).
pub(super) const BUCKETS: usize = 33;

fn bucket_of(prompt_tokens: u32) -> usize {
    (u32::BITS - prompt_tokens.leading_zeros()) as usize
}

/// The empirical output-length distribution, updated online from finished requests; with
/// buckets, one per prompt-length octave besides the global one (the cold-start prior).
#[derive(Debug, Clone)]
pub struct Survival {
    global: LengthHistogram,
    /// Empty without buckets; else [`BUCKETS`] slots, each made on its first sample.
    buckets: Vec<Option<LengthHistogram>>,
    min_samples: u64,
}

impl Survival {
    /// Lengths above `max_len` are counted as `max_len`. Predicts "runs on" until it has seen
    /// `min_samples` finished requests. No prompt-length buckets.
    pub fn new(max_len: u32, min_samples: u64) -> Self {
        Self::with_buckets(max_len, min_samples, false)
    }

    /// [`Survival::new`], and with `buckets` one distribution per prompt-length octave, used
    /// for a request once its octave has `min_samples` lengths.
    pub fn with_buckets(max_len: u32, min_samples: u64, buckets: bool) -> Self {
        Self {
            global: LengthHistogram::new(max_len),
            buckets: if buckets {
                vec![None; BUCKETS]
            } else {
                Vec::new()
            },
            min_samples,
        }
    }

    pub fn samples(&self) -> u64 {
        self.global.total
    }

    /// The distribution a request with this prompt is predicted from: its octave's once that
    /// has `min_samples` lengths, else the global one once that has, else none.
    /// Also the source a prediction from it reads: its octave's once that is used (an octave
    /// only ever gains lengths, so it stays used), else the global one, which every
    /// observation changes (also the one that makes an octave usable).
    fn hist_and_source(&self, prompt_tokens: u32) -> (Option<&LengthHistogram>, Source) {
        let b = bucket_of(prompt_tokens);
        if let Some(h) = self
            .buckets
            .get(b)
            .and_then(Option::as_ref)
            .filter(|h| h.total >= self.min_samples)
        {
            return (Some(h), SOURCE_BUCKET0 + b as Source);
        }
        let global = (self.global.total >= self.min_samples).then_some(&self.global);
        (global, SOURCE_GLOBAL)
    }

    /// Whether the global distribution and octave `b`'s have `min_samples` lengths.
    fn usable(&self, b: usize) -> (bool, bool) {
        let usable = |h: &LengthHistogram| h.total >= self.min_samples;
        let octave = self.buckets.get(b).and_then(Option::as_ref);
        (usable(&self.global), octave.is_some_and(usable))
    }

    /// Observes `f` and says what that changed: one sample in the global distribution and,
    /// with buckets, in the prompt's octave (see [`Changed`]), unless it made a distribution
    /// usable: the global one reaching `min_samples` (its predictions were "runs on" for lack
    /// of data) or the octave reaching it (its requests move from the global distribution to
    /// their octave's), which replaces the global source.
    pub(super) fn learn_sample(&mut self, f: &Finished) -> Changed {
        let b = bucket_of(f.prompt_tokens);
        let before = self.usable(b);
        self.observe(f);
        let after = self.usable(b);
        // as the histograms count it
        let length = f.output_tokens.clamp(1, self.global.max_len);
        let mut changed = if before == after {
            Changed::NOTHING.with_sample(SOURCE_GLOBAL, length)
        } else {
            Changed::NOTHING.with(SOURCE_GLOBAL)
        };
        if !self.buckets.is_empty() {
            changed = changed.with_sample(SOURCE_BUCKET0 + b as Source, length);
        }
        changed
    }

    /// The median output length of a request that has generated `generated` tokens and not
    /// finished: a point estimate of when it ends (lengths above `max_len` count as
    /// `max_len`). `None` until `min_samples` lengths were observed, or when the request
    /// already outlived every one of them (then nothing is known: it runs on). Global (no
    /// prompt length known).
    pub fn median_output(&self, generated: u32) -> Option<u32> {
        if self.global.total < self.min_samples {
            return None;
        }
        self.global.conditional_median(generated)
    }

    pub(super) fn stats(&self) -> PredictorStats {
        let buckets = self.buckets.iter().flatten();
        PredictorStats {
            samples: self.global.total,
            hashes: 0,
            buckets: buckets.clone().count(),
            hinted: 0,
            classes: 0,
            bytes: self.global.bytes() + buckets.map(LengthHistogram::bytes).sum::<usize>(),
        }
    }
}

impl Default for Survival {
    fn default() -> Self {
        PredictorConfig::default().survival()
    }
}

impl Predictor for Survival {
    fn name(&self) -> &'static str {
        "survival"
    }

    fn predict(&self, r: &RequestInfo, horizon: u32) -> Prediction {
        self.predict_with_reads(r, horizon).0
    }

    fn predict_with_reads(&self, r: &RequestInfo, horizon: u32) -> (Prediction, Reads) {
        let (hist, source) = self.hist_and_source(r.prompt_tokens);
        let p = match hist {
            Some(h) => h.conditional(r.generated, horizon),
            None => Prediction::RUNS_ON,
        };
        (p, Reads::one(source))
    }

    fn alike(&self, r: &RequestInfo) -> Option<u64> {
        // A prediction is the distribution's conditional at `generated`: nothing else.
        let (_, source) = self.hist_and_source(r.prompt_tokens);
        Some(u64::from(source) << 32 | u64::from(r.generated))
    }

    fn observe(&mut self, f: &Finished) {
        self.global.add(f.output_tokens);
        if let Some(slot) = self.buckets.get_mut(bucket_of(f.prompt_tokens)) {
            slot.get_or_insert_with(|| LengthHistogram::new(self.global.max_len))
                .add(f.output_tokens);
        }
    }

    fn learn(&mut self, f: &Finished) -> Changed {
        self.learn_sample(f)
    }

    fn stats(&self) -> PredictorStats {
        Survival::stats(self)
    }
}
