//! Termination predictors for BR-H.
//!
//! BR-H does not need an output-length regressor, only a binary classifier: will request i
//! finish within H more steps? Where the classifier is confident (probability ≥ the gate) the
//! request is projected to leave after `ĉ_i = (1 − p)·H + p·μ_rem` steps; otherwise it is
//! assumed to run past the horizon (the conservative anchor).
//!
//! The predictors learn online, from finished requests only ([`Finished`]: prompt length,
//! prompt hash, output length), one set per group (each group's policy owns its own), with no
//! offline training and bounded memory ([`PredictorConfig`]): [`Survival`] by prompt-length
//! octave with the group's whole distribution as the cold-start prior, [`ExactMatch`] by prompt
//! hash (an LRU of at most `max_hashes`), [`Oracle`] for simulation. [`PredictorStats`] is what
//! they hold (br-decision's `balanceroute_decision_predictor_*` gauges, br-sim's run line).

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
    /// A prediction is a function of the request's `prompt_tokens`, `generated`, `prompt_hash`
    /// and `oracle_output` and of what the predictor learned; nothing else of the request (a
    /// [`PredictionCache`] reuses it while those four are unchanged).
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

/// A part of what a predictor learned, named so that a [`PredictionCache`] can tell which
/// predictions one observation made stale: an id below [`SOURCES`]. Survival's global
/// distribution, each of its prompt-length octaves, and a shard of ExactMatch's prompt hashes
/// are one each; [`SOURCE_ALL`] stands for everything a predictor learned.
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
const _: () = assert!(SOURCE_SHARD0 as usize + HASH_SHARDS as usize <= SOURCES);

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

/// Each request's BR-H prediction (`⌈ĉ_i⌉` as a horizon step), kept between ticks.
///
/// A tick at G = 64 asks the predictor about every running request (16k of them), although
/// between two ticks most requests did not generate a token and the predictor learned little.
/// An entry is reused only when what the prediction is a function of is unchanged: the
/// request's `prompt_tokens`, `generated`, `prompt_hash` and `oracle_output` (the
/// [`Predictor::predict`] contract), the horizon and gate, and every part of the predictor's
/// learning the prediction read ([`Reads`]) since it was made. An observation marks the parts
/// it changed ([`PredictionCache::learned`], which the policy calls with what
/// [`Predictor::learn`] returned). A Survival finish of length L adds one sample to its
/// prompt-length octave and to the global prior ([`Changed`]), which leaves unchanged the
/// predictions of every other octave, and in these two those of the requests that generated
/// L or more and of the ones predicted to run past the horizon with j + H < L: only the rest
/// (about the requests within H tokens below L, and the few predicted to finish soon) are
/// predicted again. So a cached tick decides exactly as an uncached one.
///
/// Entries sit in a dense table indexed by the request's slot in [`crate::ClusterState`], 32
/// bytes each (a hash map keyed by request was measured slower than predicting again, and a
/// table of whole `RequestInfo`s spent the refill tick writing 72-byte entries:
/// docs/benchmarks.md).
#[derive(Debug, Clone, Default)]
pub struct PredictionCache {
    /// By slot; an entry of a request that left is caught by the field comparison (or it is
    /// the same prediction anyway: the fields are all it depends on).
    entries: Vec<Entry>,
    /// What the predictor's observations changed, and when.
    changes: SourceChanges,
    /// (horizon, gate bits) the entries were computed for.
    params: Option<(u32, u64)>,
    /// The horizon H of `params` (0 before the first tick).
    horizon: u32,
    /// Within one tick: the predictions made, by [`Predictor::alike`] key (direct-mapped,
    /// [`MEMO_SLOTS`]; a slot of an earlier tick is told apart by its tick).
    memo: Vec<Memo>,
    tick: u32,
    counts: CacheCounts,
}

/// Slots of the per-tick memo (16 bytes each: 128 KiB, allocated on the first refill).
const MEMO_SLOTS: usize = 8192;

#[derive(Debug, Clone, Copy)]
struct Memo {
    key: u64,
    tick: u32,
    end: u16,
    reads: [Source; 2],
}

/// When each source of a predictor's learning last changed, and how (see [`Changed`]).
#[derive(Debug, Clone)]
struct SourceChanges {
    /// `changed_at[s]`: the clock when source s last changed. An entry stamped at or after it
    /// is current. 256 long so that an entry's unused place ([`NO_SOURCE`], never changed) is
    /// checked like a used one, without a branch.
    changed_at: Box<[u32; 256]>,
    /// `replaced_at[s]`: the clock when source s last changed in more than one sample
    /// ([`Changed::replaces`]); an entry stamped before it and reading s is stale whatever
    /// its request.
    replaced_at: Box<[u32; 256]>,
    /// By source: its latest one-sample changes, which an entry stamped before them survives
    /// when none of their lengths affects its prediction.
    recent: Vec<RecentSamples>,
    /// Ticks on every change (every source starts at 0, every entry is stamped ≥ 0).
    clock: u32,
}

impl Default for SourceChanges {
    fn default() -> Self {
        Self {
            changed_at: Box::new([0; 256]),
            replaced_at: Box::new([0; 256]),
            recent: vec![RecentSamples::default(); SOURCES],
            clock: 0,
        }
    }
}

impl SourceChanges {
    /// One observation's changes, at the next clock (the caller keeps it from wrapping).
    fn record(&mut self, changed: Changed) {
        self.clock += 1;
        let clock = self.clock;
        // A prediction that read "everything" is stale after any change.
        let changed = changed.with(SOURCE_ALL);
        if changed == Changed::ALL {
            self.changed_at[..SOURCES]
                .iter_mut()
                .for_each(|c| *c = clock);
            self.replaced_at[..SOURCES]
                .iter_mut()
                .for_each(|c| *c = clock);
            return;
        }
        for s in changed.sources() {
            let i = usize::from(s);
            self.changed_at[i] = clock;
            match changed.sample_length() {
                Some(length) if !changed.replaces(s) => self.recent[i].push(clock, length),
                _ => self.replaced_at[i] = clock,
            }
        }
    }

    /// Whether nothing `entry` read changed since it was stamped (the common case, checked
    /// first and without a branch per source).
    fn unchanged_since(&self, entry: &Entry) -> bool {
        let [a, b] = entry.reads;
        self.changed_at[usize::from(a)] <= entry.stamp
            && self.changed_at[usize::from(b)] <= entry.stamp
    }

    /// Whether `entry` is still its request's prediction although something it read changed:
    /// no source it read was replaced since it was stamped, and no sample since affects it
    /// (its horizon `horizon`; see [`Changed`]).
    fn spare(&self, entry: &Entry, horizon: u32) -> bool {
        // An end of H + 1 is a request predicted to run on (see `remaining_from`).
        let runs_on = u32::from(entry.end) == horizon + 1;
        let spared = |s: Source| {
            let i = usize::from(s);
            self.changed_at[i] <= entry.stamp
                || (self.replaced_at[i] <= entry.stamp
                    && self.recent[i].spare(entry.stamp, entry.generated, runs_on, horizon))
        };
        let [a, b] = entry.reads;
        spared(a) && spared(b)
    }
}

/// One-sample changes a source keeps (the latest first overwritten); an entry stamped before
/// the oldest kept one is re-predicted after a change, as if the source were replaced.
/// Between two ticks a source changes about once per finish of its octave (at G = 64, about
/// one a millisecond), and a tick re-stamps every entry it keeps.
const RECENT_SAMPLES: usize = 8;

/// A ring of a source's latest one-sample changes: (clock, length).
#[derive(Debug, Clone, Copy, Default)]
struct RecentSamples {
    /// 0: an unused place (the clock is ≥ 1 at every change).
    at: [u32; RECENT_SAMPLES],
    length: [u32; RECENT_SAMPLES],
    next: usize,
    /// The clock of the latest change overwritten: an entry stamped before it may have missed
    /// it.
    dropped_at: u32,
}

impl RecentSamples {
    fn push(&mut self, clock: u32, length: u32) {
        // the oldest kept change (clocks only grow)
        self.dropped_at = self.at[self.next];
        self.at[self.next] = clock;
        self.length[self.next] = length;
        self.next = (self.next + 1) % RECENT_SAMPLES;
    }

    /// Whether a prediction made at `stamp` for a request that generated `generated` (and runs
    /// on past the horizon `horizon`, or not) is unchanged by every sample since `stamp`; the
    /// caller knows the source was not replaced since then.
    #[inline]
    fn spare(&self, stamp: u32, generated: u32, runs_on: bool, horizon: u32) -> bool {
        if self.dropped_at > stamp {
            return false;
        }
        // A sample changes the prediction when it is above the age and, for a request
        // predicted to run on, within the horizon above it (`u32::MAX`: no such bound).
        let edge = if runs_on {
            generated.saturating_add(horizon)
        } else {
            u32::MAX
        };
        // branch-free over the ring (it is scanned for many requests per tick)
        let mut harmful = false;
        for (&at, &l) in self.at.iter().zip(&self.length) {
            harmful |= (at > stamp) & (l > generated) & (l <= edge);
        }
        !harmful
    }
}

/// One slot's prediction and what it was computed from (32 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    prompt_hash: u64,
    prompt_tokens: u32,
    generated: u32,
    oracle_output: u32,
    /// The clock when it was computed.
    stamp: u32,
    /// `⌈ĉ_i⌉` (at most the horizon's steps, ≤ 4,097).
    end: u16,
    reads: [Source; 2],
    /// `VALID | HAS_HASH | HAS_ORACLE`.
    flags: u8,
}

const VALID: u8 = 1;
const HAS_HASH: u8 = 2;
const HAS_ORACLE: u8 = 4;

impl Entry {
    const EMPTY: Entry = Entry {
        prompt_hash: 0,
        prompt_tokens: 0,
        generated: 0,
        oracle_output: 0,
        stamp: 0,
        end: 0,
        reads: [NO_SOURCE; 2],
        flags: 0,
    };

    /// The fields of `r` a prediction is a function of, in an entry's form.
    fn key_of(r: &RequestInfo) -> Entry {
        Entry {
            prompt_hash: r.prompt_hash.unwrap_or(0),
            prompt_tokens: r.prompt_tokens,
            generated: r.generated,
            oracle_output: r.oracle_output.unwrap_or(0),
            flags: VALID
                | if r.prompt_hash.is_some() { HAS_HASH } else { 0 }
                | if r.oracle_output.is_some() {
                    HAS_ORACLE
                } else {
                    0
                },
            ..Entry::EMPTY
        }
    }

    fn same_request(&self, key: &Entry) -> bool {
        self.flags == key.flags
            && self.generated == key.generated
            && self.prompt_tokens == key.prompt_tokens
            && self.prompt_hash == key.prompt_hash
            && self.oracle_output == key.oracle_output
    }
}

impl PredictionCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// The predictor was replaced: no entry may be reused (not even one that read nothing
    /// the old predictor learned).
    pub fn invalidate(&mut self) {
        self.entries.iter_mut().for_each(|e| *e = Entry::EMPTY);
    }

    /// The predictor learned; `changed` is what [`Predictor::learn`] said it changed.
    pub fn learned(&mut self, changed: Changed) {
        if changed == Changed::NOTHING {
            return;
        }
        if self.changes.clock == u32::MAX {
            // The clock would wrap and make old stamps look new: start over.
            self.entries.iter_mut().for_each(|e| *e = Entry::EMPTY);
            self.changes = SourceChanges::default();
        }
        self.changes.record(changed);
    }

    /// (hits, misses) since it was made: how often a tick could skip the predictor (hits
    /// include the [`CacheCounts::spared`]).
    pub fn hit_counts(&self) -> (u64, u64) {
        let c = self.counts;
        (c.reused + c.spared, c.made)
    }

    /// Its answers since it was made, by kind.
    pub fn counts(&self) -> CacheCounts {
        self.counts
    }

    /// Entries held (one per slot σ has had; σ's slots are reused, so this stays bounded).
    pub fn len(&self) -> usize {
        self.entries.iter().filter(|e| e.flags & VALID != 0).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Starts a tick scored with `horizon` steps and confidence `gate` (the two parameters of
    /// the score a cached end depends on; taken by value so the cache needs nothing of
    /// `score`, which builds on it).
    pub(crate) fn begin_tick(&mut self, horizon: u32, gate: f64, slots: usize) {
        let p = (horizon, gate.to_bits());
        if self.params != Some(p) {
            self.params = Some(p);
            self.horizon = horizon;
            self.entries.iter_mut().for_each(|e| *e = Entry::EMPTY);
        }
        // σ's slot count only shrinks when a new σ was installed: forget the slots it no
        // longer has.
        self.entries.resize(slots, Entry::EMPTY);
        self.tick = self.tick.wrapping_add(1);
        if self.tick == 0 {
            // wrapped: no memo slot may look current
            self.memo.clear();
            self.tick = 1;
        }
    }

    /// The cached end of `r` (in `slot`), or `compute()` (then cached with what it read);
    /// `alike()` is the predictor's [`Predictor::alike`] key for `r`, asked only on a miss.
    pub(crate) fn end(
        &mut self,
        slot: usize,
        r: &RequestInfo,
        alike: impl FnOnce() -> Option<u64>,
        compute: impl FnOnce() -> (usize, Reads),
    ) -> usize {
        let Some(entry) = self.entries.get_mut(slot) else {
            self.counts.made += 1;
            return compute().0;
        };
        let key = Entry::key_of(r);
        if entry.same_request(&key) {
            if self.changes.unchanged_since(entry) {
                self.counts.reused += 1;
                return usize::from(entry.end);
            }
            if self.changes.spare(entry, self.horizon) {
                // Current now: later checks need only the changes after this one.
                entry.stamp = self.changes.clock;
                self.counts.spared += 1;
                return usize::from(entry.end);
            }
        }
        self.counts.made += 1;
        let (end, reads) = match alike() {
            None => compute(),
            Some(k) => {
                if self.memo.is_empty() {
                    self.memo = vec![
                        Memo {
                            key: 0,
                            tick: 0,
                            end: 0,
                            reads: [NO_SOURCE; 2],
                        };
                        MEMO_SLOTS
                    ];
                }
                // Fibonacci hashing onto the table's 13 bits.
                let i = (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 51) as usize % MEMO_SLOTS;
                let m = &mut self.memo[i];
                if m.tick == self.tick && m.key == k {
                    (usize::from(m.end), Reads(m.reads))
                } else {
                    let (end, reads) = compute();
                    if let Ok(e) = u16::try_from(end) {
                        *m = Memo {
                            key: k,
                            tick: self.tick,
                            end: e,
                            reads: reads.0,
                        };
                    }
                    (end, reads)
                }
            }
        };
        match u16::try_from(end) {
            Ok(e) => {
                *entry = Entry {
                    stamp: self.changes.clock,
                    end: e,
                    reads: reads.0,
                    ..key
                }
            }
            // beyond what an entry holds (a horizon above 65,534 steps): not cached
            Err(_) => *entry = Entry::EMPTY,
        }
        end
    }
}

/// A Fenwick tree over output lengths 1..=size (count and sum), for O(log n) tail queries.
///
/// It starts small and doubles as longer lengths arrive (up to the next power of two above
/// `max_len`), so a bucket that only ever sees short outputs costs a few kilobytes, not
/// `16·max_len` bytes: that is what lets [`Survival`] keep one per prompt-length bucket.
#[derive(Debug, Clone)]
struct LengthHistogram {
    /// Fenwick arrays over 1..=size; `size` (= len − 1) is a power of two.
    count: Vec<u64>,
    sum: Vec<u64>,
    total: u64,
    total_sum: u64,
    max_len: u32,
}

/// Initial size of a histogram (grown by doubling).
const INITIAL_HISTOGRAM: usize = 64;

impl LengthHistogram {
    fn new(max_len: u32) -> Self {
        let max_len = max_len.max(1);
        let n = INITIAL_HISTOGRAM.min((max_len as usize).next_power_of_two()) + 1;
        Self {
            count: vec![0; n],
            sum: vec![0; n],
            total: 0,
            total_sum: 0,
            max_len,
        }
    }

    /// Lengths 1..=size are held (a power of two).
    fn size(&self) -> usize {
        self.count.len() - 1
    }

    /// Heap bytes held.
    fn bytes(&self) -> usize {
        (self.count.capacity() + self.sum.capacity()) * std::mem::size_of::<u64>()
    }

    /// Doubles until `len` fits. With a power-of-two size n, the entries 1..=n keep their
    /// ranges, the new entry 2n covers everything (the old total) and the ones in between
    /// cover only lengths above n, of which there are none yet.
    fn grow_to(&mut self, len: usize) {
        while self.size() < len {
            let n = self.size();
            // exact: the memory bound is 16·(size + 1) bytes, not whatever doubling gives
            self.count.reserve_exact(n);
            self.sum.reserve_exact(n);
            self.count.resize(2 * n + 1, 0);
            self.sum.resize(2 * n + 1, 0);
            self.count[2 * n] = self.total;
            self.sum[2 * n] = self.total_sum;
        }
    }

    fn add(&mut self, len: u32) {
        let len = len.clamp(1, self.max_len);
        self.grow_to(len as usize);
        let mut i = len as usize;
        while i < self.count.len() {
            self.count[i] += 1;
            self.sum[i] += u64::from(len);
            i += i & i.wrapping_neg();
        }
        self.total += 1;
        self.total_sum += u64::from(len);
    }

    /// (count, sum) of lengths ≤ len.
    fn prefix(&self, len: u32) -> (u64, u64) {
        if len as usize >= self.size() {
            return (self.total, self.total_sum);
        }
        let mut i = len as usize;
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
        if alive == 0 {
            return None;
        }
        let need = c_j + alive.div_ceil(2);
        // prefix() is monotone in the length: binary search the first length reaching `need`
        // (some observed length above `generated` exists, so generated < size).
        let (mut lo, mut hi) = (generated + 1, self.size() as u32);
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
}

impl Default for PredictorConfig {
    fn default() -> Self {
        Self {
            prompt_buckets: true,
            max_hashes: 65_536,
            samples_per_hash: 16,
            min_samples: 32,
            max_len: 32_768,
        }
    }
}

impl PredictorConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.max_hashes == 0 || self.samples_per_hash == 0 || self.max_len == 0 {
            return Err("max_hashes, samples_per_hash and max_len must be at least 1".into());
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
}

/// Prompt-length octaves: bucket b holds prompts of 2^(b−1)..2^b − 1 tokens (0 for empty).
const BUCKETS: usize = 33;

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
    fn learn_sample(&mut self, f: &Finished) -> Changed {
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

    fn stats(&self) -> PredictorStats {
        let buckets = self.buckets.iter().flatten();
        PredictorStats {
            samples: self.global.total,
            hashes: 0,
            buckets: buckets.clone().count(),
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

/// One remembered prompt hash: its latest output lengths and when it last finished.
#[derive(Debug, Clone)]
struct HashEntry {
    lengths: VecDeque<u32>,
    stamp: u64,
}

/// Per-prompt-hash empirical lengths; falls back to [`Survival`] on a miss.
///
/// At most `max_hashes` hashes are kept, least recently finished forgotten first (an LRU by
/// observation: `predict` takes `&self`, and a prompt that stops finishing stops mattering).
#[derive(Debug, Clone)]
pub struct ExactMatch {
    fallback: Survival,
    by_hash: FxHashMap<u64, HashEntry>,
    /// (stamp, hash) in observation order. An element whose stamp is no longer its hash's is
    /// stale (the hash finished again since) and skipped; compacted when it has more stale
    /// elements than live ones, so it stays within 2·max_hashes + 1.
    recency: VecDeque<(u64, u64)>,
    clock: u64,
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
            recency: VecDeque::new(),
            clock: 0,
            max_hashes: max_hashes.max(1),
            samples_per_hash: samples_per_hash.max(1),
            min_hits: min_hits.max(1),
        }
    }

    pub fn known_hashes(&self) -> usize {
        self.by_hash.len()
    }

    /// Forgets the least recently finished hash, and says which.
    fn evict_one(&mut self) -> Option<u64> {
        while let Some((stamp, h)) = self.recency.pop_front() {
            if self.by_hash.get(&h).is_some_and(|e| e.stamp == stamp) {
                self.by_hash.remove(&h);
                return Some(h);
            }
        }
        None
    }

    /// The source of a prompt hash's shard: a prediction for a request with this hash reads
    /// it (the hash's lengths, or that it has none), and an observation of it or its
    /// eviction changes it.
    fn shard(hash: u64) -> Source {
        // Fibonacci hashing: the top bits of the product spread any hash pattern.
        SOURCE_SHARD0 + (hash.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58) as Source
    }

    /// [`Predictor::learn`]: what the fallback's observation changed, the hash's shard, and
    /// the shard of the hash evicted to make room, if one was.
    fn learn_evicting(&mut self, f: &Finished) -> Changed {
        let mut changed = self.fallback.learn_sample(f);
        for h in f.prompt_hash.into_iter().chain(self.remember(f)) {
            changed = changed.with(Self::shard(h));
        }
        changed
    }

    /// Remembers `f`'s length under its hash (the fallback has observed it); returns the hash
    /// evicted to make room, if one was.
    fn remember(&mut self, f: &Finished) -> Option<u64> {
        let h = f.prompt_hash?;
        self.clock += 1;
        let stamp = self.clock;
        let mut evicted = None;
        if !self.by_hash.contains_key(&h) && self.by_hash.len() >= self.max_hashes {
            evicted = self.evict_one();
        }
        let entry = self.by_hash.entry(h).or_insert_with(|| HashEntry {
            lengths: VecDeque::new(),
            stamp,
        });
        entry.stamp = stamp;
        if entry.lengths.len() >= self.samples_per_hash {
            entry.lengths.pop_front();
        }
        entry.lengths.push_back(f.output_tokens);
        self.recency.push_back((stamp, h));
        if self.recency.len() > 2 * self.by_hash.len() + 1 {
            let by_hash = &self.by_hash;
            self.recency
                .retain(|(s, h)| by_hash.get(h).is_some_and(|e| e.stamp == *s));
        }
        evicted
    }
}

impl Default for ExactMatch {
    fn default() -> Self {
        PredictorConfig::default().exact_match()
    }
}

impl Predictor for ExactMatch {
    fn name(&self) -> &'static str {
        "exact-match"
    }

    fn predict(&self, r: &RequestInfo, horizon: u32) -> Prediction {
        self.predict_with_reads(r, horizon).0
    }

    fn predict_with_reads(&self, r: &RequestInfo, horizon: u32) -> (Prediction, Reads) {
        let Some(h) = r.prompt_hash else {
            return self.fallback.predict_with_reads(r, horizon);
        };
        // Whether its hash is known is itself read: its shard.
        let shard = Self::shard(h);
        let fallback = |this: &Self| {
            let (p, reads) = this.fallback.predict_with_reads(r, horizon);
            (p, Reads::two(shard, reads.0[0]))
        };
        let Some(entry) = self.by_hash.get(&h) else {
            return fallback(self);
        };
        let j = r.generated;
        let end = j.saturating_add(horizon);
        let (mut alive, mut finishing, mut sum) = (0usize, 0usize, 0u64);
        for &o in entry.lengths.iter().filter(|&&o| o > j) {
            alive += 1;
            if o <= end {
                finishing += 1;
                sum += u64::from(o);
            }
        }
        if alive < self.min_hits {
            return fallback(self);
        }
        let reads = Reads::one(shard);
        if finishing == 0 {
            return (Prediction::RUNS_ON, reads);
        }
        let p = Prediction {
            p_finish: finishing as f64 / alive as f64,
            mean_remaining: sum as f64 / finishing as f64 - f64::from(j),
        };
        (p, reads)
    }

    fn alike(&self, r: &RequestInfo) -> Option<u64> {
        match r.prompt_hash {
            None => self.fallback.alike(r),
            // An unknown hash is predicted by the fallback and reads the hash's shard: alike
            // within the shard (bit 63 keeps these keys apart from the fallback's own).
            Some(h) if !self.by_hash.contains_key(&h) => self
                .fallback
                .alike(r)
                .map(|k| 1 << 63 | u64::from(Self::shard(h)) << 40 | k),
            Some(_) => None,
        }
    }

    fn observe(&mut self, f: &Finished) {
        self.fallback.observe(f);
        self.remember(f);
    }

    fn learn(&mut self, f: &Finished) -> Changed {
        self.learn_evicting(f)
    }

    fn stats(&self) -> PredictorStats {
        let mut s = self.fallback.stats();
        s.hashes = self.by_hash.len();
        let per_hash = std::mem::size_of::<(u64, HashEntry)>()
            + self.samples_per_hash * std::mem::size_of::<u32>();
        s.bytes += self.by_hash.capacity() * per_hash
            + self.recency.capacity() * std::mem::size_of::<(u64, u64)>();
        s
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
