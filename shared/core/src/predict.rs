//! Termination predictors for BR-H.
//!
//! BR-H does not need an output-length regressor, only a binary classifier: will request i
//! finish within H more steps? Where the classifier is confident (probability ≥ the gate) the
//! request is projected to leave after `ĉ_i = (1 − p)·H + p·μ_rem` steps; otherwise it is
//! assumed to run past the horizon (the conservative anchor).
//!
//! The predictors learn online, from finished requests only ([`Finished`]: prompt length,
//! prompt hash, output length, the client's expected output length), one set per group (each
//! group's policy owns its own), with no offline training and bounded memory
//! ([`PredictorConfig`]): [`Survival`] by prompt-length octave with the group's whole
//! distribution as the cold-start prior, [`ExactMatch`] by prompt hash (an LRU of at most
//! `max_hashes`), [`Hinted`] by how far the clients' hints are off, [`Classed`] by the
//! gateway's request class, [`Oracle`] for simulation. [`PredictorStats`] is what
//! they hold (br-decision's `balanceroute_decision_predictor_*` gauges, br-sim's run line).

use crate::state::RequestInfo;

mod cache;
mod classed;
mod exact;
mod hinted;
mod histogram;
mod survival;

pub use cache::PredictionCache;
pub use classed::{Classed, DEFAULT_MAX_CLASSES};
pub use exact::ExactMatch;
pub use hinted::{DEFAULT_MIN_HINTED, Hinted};
use survival::BUCKETS;
pub use survival::Survival;

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
    /// A prediction is a function of the request's `prompt_tokens`, `generated`, `prompt_hash`,
    /// `oracle_output`, `expected_output` and `class` and of what the predictor learned;
    /// nothing else of the request (a [`PredictionCache`] reuses it while those six are
    /// unchanged).
    fn predict(&self, request: &RequestInfo, horizon: u32) -> Prediction;
    /// [`Predictor::predict`], and which parts of what it learned the prediction read
    /// ([`Reads`]). The default says "everything" ([`Reads::ALL`]): exact for any predictor,
    /// and a cache then re-predicts every request after any observation.
    fn predict_with_reads(&self, request: &RequestInfo, horizon: u32) -> (Prediction, Reads) {
        let reads = if self.learns() {
            Reads::ALL
        } else {
            Reads::NOTHING
        };
        (self.predict(request, horizon), reads)
    }
    /// A key that requests predicted alike share: two requests with the same `Some` key get
    /// the same prediction and [`Reads`] at any horizon, until the predictor learns. A
    /// [`PredictionCache`] refilling many entries asks the predictor once per key (Survival:
    /// the distribution and the generated tokens; thousands of requests share a few thousand
    /// keys). `None` (the default) promises nothing.
    fn alike(&self, _request: &RequestInfo) -> Option<u64> {
        None
    }
    /// What a [`PredictionCache`] asks on a miss, in one call: [`Lookup::Alike`] with the
    /// [`Predictor::alike`] key when that is `Some` (the tick may have made the prediction
    /// already), else [`Lookup::Made`] with [`Predictor::predict_with_reads`]'s answer. A
    /// predictor overrides it to find both with one search of what it learned.
    fn lookup(&self, request: &RequestInfo, horizon: u32) -> Lookup {
        match self.alike(request) {
            Some(k) => Lookup::Alike(k),
            None => {
                let (p, reads) = self.predict_with_reads(request, horizon);
                Lookup::Made(p, reads)
            }
        }
    }
    /// Learns from a finished request (online update).
    fn observe(&mut self, finished: &Finished);
    /// [`Predictor::observe`], and which parts of what it learned the observation changed (a
    /// [`PredictionCache`] re-predicts only the requests whose prediction read one of them).
    /// A part reported as *sampled* ([`Changed::with_sample`]) is a promise that predictions
    /// read it as an empirical conditional distribution that gained one length and nothing
    /// else, so the cache also keeps the predictions that length cannot change; a predictor
    /// that cannot promise it reports the part replaced ([`Changed::with`]).
    /// The default says "everything" when the predictor [`Predictor::learns`].
    fn learn(&mut self, finished: &Finished) -> Changed {
        self.observe(finished);
        if self.learns() {
            Changed::ALL
        } else {
            Changed::NOTHING
        }
    }
    /// Whether [`Predictor::observe`] can change what it predicts (a [`PredictionCache`] is
    /// invalidated by every observation of one that does).
    fn learns(&self) -> bool {
        true
    }
    /// What it holds (for a gauge and the simulator's report).
    fn stats(&self) -> PredictorStats {
        PredictorStats::default()
    }
}

/// [`Predictor::lookup`]'s answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Lookup {
    /// The request's [`Predictor::alike`] key.
    Alike(u64),
    /// Its prediction and what it read (its `alike` key is `None`).
    Made(Prediction, Reads),
}

/// A part of what a predictor learned, named so that a [`PredictionCache`] can tell which
/// predictions one observation made stale: an id below [`SOURCES`]. Survival's global
/// distribution, each of its prompt-length octaves, a shard of ExactMatch's prompt hashes and
/// Hinted's ratios are one each; [`SOURCE_ALL`] stands for everything a predictor learned.
pub type Source = u8;

/// Source ids are below this.
pub const SOURCES: usize = 128;
/// Everything: read by a prediction of a predictor that cannot say what it read, and changed
/// by an observation of one that cannot say what it changed.
pub const SOURCE_ALL: Source = 0;
/// Survival's global distribution (the cold-start prior).
const SOURCE_GLOBAL: Source = 1;
/// Survival's octave b is `SOURCE_BUCKET0 + b` (b < [`BUCKETS`]).
const SOURCE_BUCKET0: Source = 2;
/// ExactMatch's prompt hashes fall into this many shards, `SOURCE_SHARD0 + shard`.
const SOURCE_SHARD0: Source = SOURCE_BUCKET0 + BUCKETS as Source;
const HASH_SHARDS: u64 = 64;
/// Hinted's ratios of actual to expected output length and the hints' weight.
const SOURCE_HINTS: Source = SOURCE_SHARD0 + HASH_SHARDS as Source;
/// [`Classed`]'s classes: the ids from here to the last ([`SOURCES`] − 1), shared modulo
/// their number.
const SOURCE_CLASS0: Source = SOURCE_HINTS + 1;
const _: () = assert!((SOURCE_CLASS0 as usize) + 16 <= SOURCES);

/// The sources one prediction read: at most two (a cache entry holds them in two bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reads([Source; 2]);

/// No source (`u8::MAX` is above every id).
const NO_SOURCE: Source = u8::MAX;

impl Reads {
    /// Depends on nothing learned (Oracle; a horizon of 0).
    pub const NOTHING: Reads = Reads([NO_SOURCE, NO_SOURCE]);
    /// Depends on everything learned.
    pub const ALL: Reads = Reads([SOURCE_ALL, NO_SOURCE]);

    pub fn one(source: Source) -> Self {
        Reads([source.min(SOURCES as Source - 1), NO_SOURCE])
    }

    pub fn two(a: Source, b: Source) -> Self {
        Reads([a.min(SOURCES as Source - 1), b.min(SOURCES as Source - 1)])
    }

    /// The ids it holds.
    pub fn sources(self) -> impl Iterator<Item = Source> {
        self.0.into_iter().filter(|&s| s != NO_SOURCE)
    }
}

/// The sources one observation changed (a set over [`SOURCES`] ids), and how.
///
/// A source is either *replaced* (anything about it may have changed: every prediction that
/// read it is stale) or *sampled*: its only change is one more output length `sample_length`
/// in an empirical distribution that predictions read as [`Survival`]'s conditional does
/// (`P(o ≤ j + H | o > j)` and `E[o | j < o ≤ j + H]` over the lengths above `j`). Such a
/// sample leaves two kinds of prediction exactly as they were (a [`PredictionCache`] keeps
/// them): those of requests that generated `j ≥ sample_length` (the length is below their
/// age on both sides of the conditional), and those of requests predicted to run past the
/// horizon with `j + H < sample_length` (one more survivor lowers `p_finish` and changes
/// nothing else, so it stays under the gate).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Changed {
    replaced: u128,
    /// Disjoint from `replaced`.
    sampled: u128,
    /// The length the `sampled` sources gained (as counted: clamped like the distribution).
    sample_length: u32,
}

impl Changed {
    pub const NOTHING: Changed = Changed {
        replaced: 0,
        sampled: 0,
        sample_length: 0,
    };
    /// Everything the predictor learned (every prediction is stale).
    pub const ALL: Changed = Changed {
        replaced: u128::MAX,
        sampled: 0,
        sample_length: 0,
    };

    fn bit(source: Source) -> u128 {
        1u128 << (source as usize % SOURCES)
    }

    /// `source` replaced.
    pub fn with(self, source: Source) -> Self {
        let bit = Self::bit(source);
        Changed {
            replaced: self.replaced | bit,
            sampled: self.sampled & !bit,
            ..self
        }
        .normalized()
    }

    /// `source` gained one sample of `length` and nothing else (see [`Changed`]). One
    /// observation has one length: a second length in the same set replaces the sources
    /// sampled with the first.
    pub fn with_sample(self, source: Source, length: u32) -> Self {
        let bit = Self::bit(source);
        if self.replaced & bit != 0 {
            return self;
        }
        let base = if self.sampled != 0 && self.sample_length != length {
            self.sampled_replaced()
        } else {
            self
        };
        Changed {
            sampled: base.sampled | bit,
            sample_length: length,
            ..base
        }
    }

    /// Every sampled source counted as replaced.
    fn sampled_replaced(self) -> Self {
        Changed {
            replaced: self.replaced | self.sampled,
            sampled: 0,
            sample_length: 0,
        }
    }

    pub fn union(self, other: Changed) -> Self {
        let mut u = if other.sampled == 0 {
            self
        } else if self.sampled == 0 || self.sample_length == other.sample_length {
            Changed {
                sampled: self.sampled | other.sampled,
                sample_length: other.sample_length,
                ..self
            }
        } else {
            self.sampled_replaced().union(other.sampled_replaced())
        };
        u.replaced |= other.replaced;
        u.sampled &= !u.replaced;
        u.normalized()
    }

    /// With no source sampled, no length either (so that equal sets compare equal).
    fn normalized(self) -> Self {
        if self.sampled == 0 {
            Changed {
                sample_length: 0,
                ..self
            }
        } else {
            self
        }
    }

    /// Whether `source` changed at all (replaced or sampled).
    pub fn contains(self, source: Source) -> bool {
        (self.replaced | self.sampled) & Self::bit(source) != 0
    }

    /// Whether `source` changed in more than one sample.
    pub fn replaces(self, source: Source) -> bool {
        self.replaced & Self::bit(source) != 0
    }

    /// The length the sampled sources gained, if any source was only sampled.
    pub fn sample_length(self) -> Option<u32> {
        (self.sampled != 0).then_some(self.sample_length)
    }

    /// The changed ids, ascending.
    pub fn sources(self) -> impl Iterator<Item = Source> {
        let mut left = self.replaced | self.sampled;
        std::iter::from_fn(move || {
            (left != 0).then(|| {
                let s = left.trailing_zeros() as Source;
                left &= left - 1;
                s
            })
        })
    }
}

/// What the control plane learns of a request when it finishes: all an online predictor is
/// taught from (σ's deltas carry it to the decision service; the simulator reports it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub prompt_tokens: u32,
    /// The gateway's prompt hash, when it sent one (`AssignRequest.prompt_hash`).
    pub prompt_hash: Option<u64>,
    /// Output tokens generated in all.
    pub output_tokens: u32,
    /// The client's expected output length, when it sent one (the request's
    /// [`RequestInfo::expected_output`]): what [`Hinted`] learns to trust or not.
    pub expected_output: Option<u32>,
    /// The request's class id, if it had one ([`RequestInfo::class`]).
    pub class: Option<u64>,
}

/// The size of what an online predictor has learned: its memory bound made visible.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PredictorStats {
    /// Finished requests observed.
    pub samples: u64,
    /// Prompt hashes remembered (ExactMatch).
    pub hashes: usize,
    /// Prompt-length buckets with a distribution of their own (Survival).
    pub buckets: usize,
    /// Finished requests that carried the client's expected output length, observed
    /// (Hinted: what it learned how far to trust the hints from).
    pub hinted: u64,
    /// Request classes with a model of their own (Classed).
    pub classes: usize,
    /// Heap bytes held, approximately (the tables' capacities).
    pub bytes: usize,
}

/// How a [`PredictionCache`] answered for one request at one tick, counted over its life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheCounts {
    /// Nothing the prediction is a function of changed: reused.
    pub reused: u64,
    /// What the prediction read gained samples that cannot change it ([`Changed`]): reused.
    /// A cache that re-predicted after every change of what a prediction read would have
    /// made these.
    pub spared: u64,
    /// Asked of the predictor (or of the tick's memo of predictions alike).
    pub made: u64,
}

/// `ĉ_i`: steps until the request is expected to leave, or `horizon + 1` (beyond the horizon)
/// when the predictor is not confident enough.
pub fn expected_remaining(p: &dyn Predictor, r: &RequestInfo, horizon: u32, gate: f64) -> f64 {
    if horizon == 0 {
        return 1.0;
    }
    remaining_from(p.predict(r, horizon), horizon, gate)
}

/// [`expected_remaining`], and what the prediction read of the predictor's learning.
pub fn expected_remaining_with_reads(
    p: &dyn Predictor,
    r: &RequestInfo,
    horizon: u32,
    gate: f64,
) -> (f64, Reads) {
    if horizon == 0 {
        return (1.0, Reads::NOTHING);
    }
    let (pred, reads) = p.predict_with_reads(r, horizon);
    (remaining_from(pred, horizon, gate), reads)
}

/// [`expected_remaining_with_reads`] when the predictor makes it at once, or the request's
/// [`Predictor::alike`] key ([`Predictor::lookup`]).
pub fn expected_remaining_or_alike(
    p: &dyn Predictor,
    r: &RequestInfo,
    horizon: u32,
    gate: f64,
) -> Result<(f64, Reads), u64> {
    if horizon == 0 {
        return Ok((1.0, Reads::NOTHING));
    }
    match p.lookup(r, horizon) {
        Lookup::Alike(k) => Err(k),
        Lookup::Made(pred, reads) => Ok((remaining_from(pred, horizon, gate), reads)),
    }
}

/// `ĉ_i` from a prediction: at most `horizon` when the predictor is confident (a mix of the
/// horizon and a mean within it; rounding could put it an ulp above), `horizon + 1` exactly
/// when it is not. So a request's end step is the horizon's last plus one (`H + 1`) exactly
/// when it is predicted to run on, which a [`PredictionCache`] relies on.
fn remaining_from(pred: Prediction, horizon: u32, gate: f64) -> f64 {
    if pred.p_finish >= gate && pred.p_finish > 0.0 {
        let h = f64::from(horizon);
        ((1.0 - pred.p_finish) * h + pred.p_finish * pred.mean_remaining).min(h)
    } else {
        f64::from(horizon) + 1.0
    }
}

/// How the online predictors learn and how much they may hold (BR-H's `brh`, `brh-survival`).
///
/// Both learn only from finished requests ([`Finished`]: prompt length, prompt hash if the
/// gateway sent one, final output length), per group (each group's policy has its own), with
/// no offline training. Memory is bounded: at most `max_hashes` prompt hashes of at most
/// `samples_per_hash` lengths each (least recently finished forgotten first; about 180 bytes
/// a hash with the defaults, so ~11 MiB per group at most), and one length histogram per
/// prompt-length octave (at most 33) of at most `16·(2·max_len + 1)` bytes.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct PredictorConfig {
    /// Survival conditions on the prompt's length octave (`⌊log2 s⌋`): a request is predicted
    /// from the finished requests whose prompts were about as long, once its octave has
    /// `min_samples` of them; before that from every finished request (the prior).
    pub prompt_buckets: bool,
    /// ExactMatch: most prompt hashes remembered (LRU by last finish).
    pub max_hashes: usize,
    /// ExactMatch: most recent output lengths kept per hash.
    pub samples_per_hash: usize,
    /// Finished requests a distribution needs before it is used (fewer: fall back to the
    /// coarser one, and with none, the request is assumed to run on: BR-0's view).
    pub min_samples: u64,
    /// Longest output length told apart (longer ones count as this).
    pub max_len: u32,
    /// Hinted: finishes with a hint observed before hints are used (see
    /// [`DEFAULT_MIN_HINTED`]).
    pub min_hinted: u64,
    /// Classed: request classes told apart per group (see [`DEFAULT_MAX_CLASSES`]); further
    /// classes are predicted as requests without one.
    pub max_classes: usize,
}

impl Default for PredictorConfig {
    fn default() -> Self {
        Self {
            prompt_buckets: true,
            max_hashes: 65_536,
            samples_per_hash: 16,
            min_samples: 32,
            max_len: 32_768,
            min_hinted: DEFAULT_MIN_HINTED,
            max_classes: DEFAULT_MAX_CLASSES,
        }
    }
}

impl PredictorConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.max_hashes == 0
            || self.samples_per_hash == 0
            || self.max_len == 0
            || self.max_classes == 0
        {
            return Err(
                "max_hashes, samples_per_hash, max_len and max_classes must be at least 1".into(),
            );
        }
        if self.max_classes > 4096 {
            return Err(format!(
                "max_classes {} out of range (≤ 4096: a hinted class holds about 48 KiB)",
                self.max_classes
            ));
        }
        if self.max_hashes > 1 << 24 || self.samples_per_hash > 1024 || self.max_len > 1 << 24 {
            return Err(format!(
                "predictor memory out of range: max_hashes {} (≤ 2^24), samples_per_hash {} \
                 (≤ 1024), max_len {} (≤ 2^24)",
                self.max_hashes, self.samples_per_hash, self.max_len
            ));
        }
        Ok(())
    }

    pub fn survival(&self) -> Survival {
        Survival::with_buckets(self.max_len, self.min_samples, self.prompt_buckets)
    }

    pub fn exact_match(&self) -> ExactMatch {
        ExactMatch::new(self.survival(), self.max_hashes, self.samples_per_hash, 1)
    }

    pub fn hinted(&self) -> Hinted {
        Hinted::new(self.survival(), self.min_hinted)
    }

    pub fn classed(&self) -> Classed {
        Classed::new(self.hinted(), self.min_samples, self.max_classes)
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

    fn predict_with_reads(&self, r: &RequestInfo, horizon: u32) -> (Prediction, Reads) {
        (self.predict(r, horizon), Reads::NOTHING)
    }

    fn observe(&mut self, _finished: &Finished) {}

    fn learn(&mut self, _finished: &Finished) -> Changed {
        Changed::NOTHING
    }

    fn learns(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests;
