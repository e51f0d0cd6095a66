//! [`PredictionCache`]: each request's BR-H prediction kept between ticks, reused while
//! nothing it was computed from has changed.
//!
//! Separate from the predictors: it works for any [`Predictor`] through the [`Reads`] and
//! [`Changed`] it reports, and its invalidation bookkeeping (per-source clocks, the per-tick
//! memo, the dense entry table) is the densest code of the module.

use super::*;

/// Each request's BR-H prediction (`⌈ĉ_i⌉` as a horizon step), kept between ticks.
///
/// A tick at G = 64 asks the predictor about every running request (16k of them), although
/// between two ticks most requests did not generate a token and the predictor learned little.
/// An entry is reused only when what the prediction is a function of is unchanged: the
/// request's `prompt_tokens`, `generated`, `prompt_hash`, `oracle_output`, `expected_output`
/// and `class` (the [`Predictor::predict`] contract), the horizon and gate, and every part of the predictor's
/// learning the prediction read ([`Reads`]) since it was made. An observation marks the parts
/// it changed ([`PredictionCache::learned`], which the policy calls with what
/// [`Predictor::learn`] returned). A Survival finish of length L adds one sample to its
/// prompt-length octave and to the global prior ([`Changed`]), which leaves unchanged the
/// predictions of every other octave, and in these two those of the requests that generated
/// L or more and of the ones predicted to run past the horizon with j + H < L: only the rest
/// (about the requests within H tokens below L, and the few predicted to finish soon) are
/// predicted again. So a cached tick decides exactly as an uncached one.
///
/// Entries sit in a dense table indexed by the request's slot in [`crate::ClusterState`], 48
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
pub(super) struct SourceChanges {
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
    pub(super) clock: u32,
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
    pub(super) fn record(&mut self, changed: Changed) {
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
    pub(super) fn unchanged_since(&self, entry: &Entry) -> bool {
        let [a, b] = entry.reads;
        self.changed_at[usize::from(a)] <= entry.stamp
            && self.changed_at[usize::from(b)] <= entry.stamp
    }

    /// Whether `entry` is still its request's prediction although something it read changed:
    /// no source it read was replaced since it was stamped, and no sample since affects it
    /// (its horizon `horizon`; see [`Changed`]).
    pub(super) fn spare(&self, entry: &Entry, horizon: u32) -> bool {
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
pub(super) const RECENT_SAMPLES: usize = 8;

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

/// One slot's prediction and what it was computed from (48 bytes: the expected output length
/// took it past 32, the class past 40).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) prompt_hash: u64,
    pub(super) class: u64,
    pub(super) prompt_tokens: u32,
    pub(super) generated: u32,
    pub(super) oracle_output: u32,
    pub(super) expected_output: u32,
    /// The clock when it was computed.
    pub(super) stamp: u32,
    /// `⌈ĉ_i⌉` (at most the horizon's steps, ≤ 4,097).
    pub(super) end: u16,
    pub(super) reads: [Source; 2],
    /// `VALID | HAS_HASH | HAS_ORACLE | HAS_EXPECTED | HAS_CLASS`.
    pub(super) flags: u8,
}

const VALID: u8 = 1;
const HAS_HASH: u8 = 2;
const HAS_ORACLE: u8 = 4;
const HAS_EXPECTED: u8 = 8;
const HAS_CLASS: u8 = 16;
const _: () = assert!(std::mem::size_of::<Entry>() == 48);

impl Entry {
    pub(super) const EMPTY: Entry = Entry {
        prompt_hash: 0,
        class: 0,
        prompt_tokens: 0,
        generated: 0,
        oracle_output: 0,
        expected_output: 0,
        stamp: 0,
        end: 0,
        reads: [NO_SOURCE; 2],
        flags: 0,
    };

    /// The fields of `r` a prediction is a function of, in an entry's form.
    fn key_of(r: &RequestInfo) -> Entry {
        Entry {
            prompt_hash: r.prompt_hash.unwrap_or(0),
            class: r.class.unwrap_or(0),
            prompt_tokens: r.prompt_tokens,
            generated: r.generated,
            oracle_output: r.oracle_output.unwrap_or(0),
            expected_output: r.expected_output.unwrap_or(0),
            flags: VALID
                | if r.prompt_hash.is_some() { HAS_HASH } else { 0 }
                | if r.oracle_output.is_some() {
                    HAS_ORACLE
                } else {
                    0
                }
                | if r.expected_output.is_some() {
                    HAS_EXPECTED
                } else {
                    0
                }
                | if r.class.is_some() { HAS_CLASS } else { 0 },
            ..Entry::EMPTY
        }
    }

    fn same_request(&self, key: &Entry) -> bool {
        self.flags == key.flags
            && self.generated == key.generated
            && self.prompt_tokens == key.prompt_tokens
            && self.prompt_hash == key.prompt_hash
            && self.oracle_output == key.oracle_output
            && self.expected_output == key.expected_output
            && self.class == key.class
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

    /// The cached end of `r` (in `slot`), else `lookup()`'s (then cached with what it read),
    /// asked only on a miss: `Ok` the end made, or `Err` the predictor's [`Predictor::alike`]
    /// key for `r`, and then the end made earlier in the tick for that key, or `compute()`.
    // Inlined into the projection's loop over σ (its one caller): as a call, its register
    // saves and the closures' captures cost about 22 instructions a request on a tick that
    // reuses every entry and 45 on one that fills the table (callgrind, G = 64: 9% and 12%
    // of the tick).
    #[inline(always)]
    pub(crate) fn end(
        &mut self,
        slot: usize,
        r: &RequestInfo,
        lookup: impl FnOnce() -> Result<(usize, Reads), u64>,
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
        let (end, reads) = match lookup() {
            Ok(made) => made,
            Err(k) => {
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
