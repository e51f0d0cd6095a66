//! [`ExactMatch`]: the per-prompt-hash predictor (BR-H's `brh`), an LRU of recent output
//! lengths by prompt hash with [`Survival`] behind it for the prompts it has not seen.
//!
//! Separate from the survival model because its memory (the hash LRU and its recency queue)
//! is its own concern; it only asks the fallback when a hash misses.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use super::*;

/// One remembered prompt hash: its latest output lengths and when it last finished.
#[derive(Debug, Clone)]
struct HashEntry {
    lengths: VecDeque<u32>,
    /// The least and the greatest of `lengths` (0 while empty): they answer most predictions
    /// without reading `lengths`, a separate allocation and so a cache miss of its own.
    shortest: u32,
    longest: u32,
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
    pub(super) recency: VecDeque<(u64, u64)>,
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
            shortest: 0,
            longest: 0,
            stamp,
        });
        entry.stamp = stamp;
        if entry.lengths.len() >= self.samples_per_hash {
            entry.lengths.pop_front();
        }
        entry.lengths.push_back(f.output_tokens);
        entry.shortest = entry.lengths.iter().copied().min().unwrap_or(0);
        entry.longest = entry.lengths.iter().copied().max().unwrap_or(0);
        self.recency.push_back((stamp, h));
        if self.recency.len() > 2 * self.by_hash.len() + 1 {
            let by_hash = &self.by_hash;
            self.recency
                .retain(|(s, h)| by_hash.get(h).is_some_and(|e| e.stamp == *s));
        }
        evicted
    }
    /// The [`Predictor::alike`] key of a request with an unknown hash `h`: it is predicted by
    /// the fallback and reads the hash's shard, so it is alike within the shard (bit 63 keeps
    /// these keys apart from the fallback's own).
    fn shard_alike(&self, h: u64, r: &RequestInfo) -> Option<u64> {
        self.fallback
            .alike(r)
            .map(|k| 1 << 63 | u64::from(Self::shard(h)) << 40 | k)
    }

    /// The prediction of a request whose prompt hash is `known` (its entry, if remembered) in
    /// `shard`: from the hash's lengths, else the fallback's. Whether the hash is known is
    /// itself read (its shard), so the fallback's prediction reads the shard too.
    fn predict_hashed(
        &self,
        known: Option<&HashEntry>,
        r: &RequestInfo,
        horizon: u32,
        shard: Source,
    ) -> (Prediction, Reads) {
        match known.and_then(|e| self.predict_by_lengths(e, r, horizon, shard)) {
            Some(made) => made,
            None => {
                let (p, reads) = self.fallback.predict_with_reads(r, horizon);
                (p, Reads::two(shard, reads.0[0]))
            }
        }
    }

    /// The prediction from a remembered hash's lengths (`entry`; `shard` is the hash's), or
    /// `None` when fewer than `min_hits` of them are above the request's progress (the
    /// fallback predicts it then).
    fn predict_by_lengths(
        &self,
        entry: &HashEntry,
        r: &RequestInfo,
        horizon: u32,
        shard: Source,
    ) -> Option<(Prediction, Reads)> {
        let j = r.generated;
        let end = j.saturating_add(horizon);
        let reads = Reads::one(shard);
        // Every length above the horizon's end: all alive, none finishing within it.
        if end < entry.shortest && entry.lengths.len() >= self.min_hits {
            return Some((Prediction::RUNS_ON, reads));
        }
        // Every length at or below `j`: none alive (fewer than `min_hits`, which is ≥ 1).
        if j >= entry.longest {
            return None;
        }
        let (mut alive, mut finishing, mut sum) = (0usize, 0usize, 0u64);
        for &o in entry.lengths.iter().filter(|&&o| o > j) {
            alive += 1;
            if o <= end {
                finishing += 1;
                sum += u64::from(o);
            }
        }
        if alive < self.min_hits {
            return None;
        }
        if finishing == 0 {
            return Some((Prediction::RUNS_ON, reads));
        }
        let p = Prediction {
            p_finish: finishing as f64 / alive as f64,
            mean_remaining: sum as f64 / finishing as f64 - f64::from(j),
        };
        Some((p, reads))
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
        self.predict_hashed(self.by_hash.get(&h), r, horizon, Self::shard(h))
    }

    fn alike(&self, r: &RequestInfo) -> Option<u64> {
        let Some(h) = r.prompt_hash else {
            return self.fallback.alike(r);
        };
        if self.by_hash.contains_key(&h) {
            // predicted from its lengths, or by the fallback when too few are above its
            // progress: not alike other hashes' requests (see `lookup`)
            return None;
        }
        self.shard_alike(h, r)
    }

    fn lookup(&self, r: &RequestInfo, horizon: u32) -> Lookup {
        let Some(h) = r.prompt_hash else {
            return self.fallback.lookup(r, horizon);
        };
        // One search of the hashes for both answers (`alike` and then `predict_with_reads`
        // would search twice).
        let shard = Self::shard(h);
        match self.by_hash.get(&h) {
            // A remembered hash is predicted at once, also when the fallback predicts it
            // (too few lengths above its progress). Such a request is predicted as the
            // shard's unknown hashes are, but sharing the tick's memo with them was measured
            // not to pay: at G = 64 they seldom meet (64 shards), and the memo's first use
            // in a tick that fills the cache is 128 KiB of pages touched for the first time.
            Some(e) => {
                let (p, reads) = self.predict_hashed(Some(e), r, horizon, shard);
                Lookup::Made(p, reads)
            }
            None => match self.shard_alike(h, r) {
                Some(k) => Lookup::Alike(k),
                None => {
                    let (p, reads) = self.predict_hashed(None, r, horizon, shard);
                    Lookup::Made(p, reads)
                }
            },
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
