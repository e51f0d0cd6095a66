use super::cache::{Entry, RECENT_SAMPLES, SourceChanges};
use super::histogram::{INITIAL_HISTOGRAM, LengthHistogram};
use super::*;
use crate::Phase;

pub(super) fn fin(prompt_hash: Option<u64>, output_tokens: u32) -> Finished {
    Finished {
        prompt_tokens: 10,
        prompt_hash,
        output_tokens,
        expected_output: None,
        class: None,
    }
}

pub(super) fn running(generated: u32, hash: Option<u64>, oracle: Option<u32>) -> RequestInfo {
    RequestInfo {
        key: 1,
        worker: 0,
        prompt_tokens: 10,
        generated,
        phase: Phase::Running,
        prompt_hash: hash,
        oracle_output: oracle,
        expected_output: None,
        class: None,
    }
}

#[test]
fn survival_conditions_on_progress() {
    let mut s = Survival::new(4096, 1);
    for len in [100, 200, 300, 400] {
        s.observe(&fin(None, len));
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
    s.observe(&fin(None, 100));
    s.observe(&fin(None, 200));
    assert_eq!(s.median_output(0), None, "too few samples");
    for len in [300, 400] {
        s.observe(&fin(None, len));
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
        s.observe(&fin(None, l));
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
    s.observe(&fin(None, 10));
    assert_eq!(s.predict(&running(0, None, None), 100), Prediction::RUNS_ON);
}

#[test]
fn exact_match_prefers_its_hash_and_falls_back() {
    let mut e = ExactMatch::new(Survival::new(4096, 1), 2, 4, 1);
    e.observe(&fin(Some(7), 50));
    e.observe(&fin(None, 1000));
    let hit = e.predict(&running(10, Some(7), None), 80);
    assert_eq!(hit.p_finish, 1.0);
    assert_eq!(hit.mean_remaining, 40.0);
    let miss = e.predict(&running(10, Some(8), None), 80);
    // survival over {50, 1000}: alive at 10 = 2, finishing within 90 = 1
    assert_eq!(miss.p_finish, 0.5);
    // bounded memory: a third hash evicts the oldest
    e.observe(&fin(Some(8), 1));
    e.observe(&fin(Some(9), 1));
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
    s.observe(&fin(None, 120));
    s.observe(&fin(None, 5000));
    // p = 0.5 at j = 100: below a 0.6 gate it runs on, at 0.5 it counts
    assert_eq!(expected_remaining(&s, &r, 80, 0.6), 81.0);
    assert_eq!(expected_remaining(&s, &r, 80, 0.5), 0.5 * 80.0 + 0.5 * 20.0);
}
#[test]
fn survival_cold_start_then_its_own_octave() {
    let mut s = Survival::with_buckets(4096, 4, true);
    let short = |j| RequestInfo {
        prompt_tokens: 100,
        ..running(j, None, None)
    };
    let long = |j| RequestInfo {
        prompt_tokens: 5_000,
        ..running(j, None, None)
    };
    // Nothing learned: the conservative anchor (runs on), BR-0's view.
    assert_eq!(s.predict(&long(0), 80), Prediction::RUNS_ON);
    for _ in 0..4 {
        s.observe(&Finished {
            prompt_tokens: 100,
            prompt_hash: None,
            output_tokens: 50,
            expected_output: None,
            class: None,
        });
    }
    // The long prompt's octave has nothing yet: the global distribution is its prior.
    assert_eq!(s.predict(&long(0), 80).p_finish, 1.0);
    for _ in 0..3 {
        s.observe(&Finished {
            prompt_tokens: 5_000,
            prompt_hash: None,
            output_tokens: 1_000,
            expected_output: None,
            class: None,
        });
    }
    // 3 < min_samples in its octave: still the prior (4 of 7 finish within 80).
    assert!((s.predict(&long(0), 80).p_finish - 4.0 / 7.0).abs() < 1e-12);
    s.observe(&Finished {
        prompt_tokens: 5_000,
        prompt_hash: None,
        output_tokens: 1_000,
        expected_output: None,
        class: None,
    });
    // Its own octave now: every long prompt ran 1,000 tokens.
    assert_eq!(s.predict(&long(0), 80), Prediction::RUNS_ON);
    let near_end = s.predict(&long(950), 80);
    assert_eq!(near_end.p_finish, 1.0);
    assert_eq!(near_end.mean_remaining, 50.0);
    assert_eq!(s.predict(&short(0), 80).p_finish, 1.0);
    let st = Predictor::stats(&s);
    assert_eq!((st.samples, st.buckets, st.hashes), (8, 2, 0));
}

#[test]
fn exact_match_forgets_the_least_recently_finished() {
    let mut e = ExactMatch::new(Survival::new(4096, 1), 2, 4, 1);
    e.observe(&fin(Some(7), 50));
    e.observe(&fin(Some(8), 60));
    e.observe(&fin(Some(7), 50)); // 7 is now the most recent
    e.observe(&fin(Some(9), 70)); // evicts 8, not 7 (insertion order would evict 7)
    assert_eq!(e.known_hashes(), 2);
    assert_eq!(
        e.predict(&running(0, Some(7), None), 80).mean_remaining,
        50.0
    );
    assert_eq!(
        e.predict(&running(0, Some(9), None), 80).mean_remaining,
        70.0
    );
    // 8 is forgotten: Survival over {50, 60, 50, 70}
    let miss = e.predict(&running(0, Some(8), None), 80);
    assert!((miss.mean_remaining - 57.5).abs() < 1e-12);
    // Many repeats of one hash keep the recency queue bounded.
    for _ in 0..1_000 {
        e.observe(&fin(Some(7), 50));
    }
    assert!(e.recency.len() <= 2 * e.known_hashes() + 1);
    assert_eq!(e.stats().hashes, 2);
}

#[test]
fn histogram_grows_by_doubling_and_keeps_its_sums() {
    let mut h = LengthHistogram::new(10_000);
    assert_eq!(h.size(), INITIAL_HISTOGRAM);
    for len in [3u32, 64, 65, 700, 9_999, 20_000] {
        h.add(len);
    }
    assert_eq!(h.size(), 16_384);
    // 20,000 counts as max_len 10,000.
    assert_eq!(h.prefix(64), (2, 67));
    assert_eq!(h.prefix(699), (3, 132));
    assert_eq!(h.prefix(9_999), (5, 132 + 700 + 9_999));
    assert_eq!(h.prefix(u32::MAX), (6, 132 + 700 + 9_999 + 10_000));
    assert_eq!(h.conditional_median(64), Some(700));
}

/// One-sample changes are kept in a ring: an entry older than the oldest kept change is
/// re-predicted (it may have missed one that changed it), however harmless the kept ones.
#[test]
fn an_entry_older_than_the_kept_samples_is_stale() {
    let horizon = 80;
    let entry = |stamp, generated, end| Entry {
        stamp,
        generated,
        end,
        reads: [SOURCE_GLOBAL, NO_SOURCE],
        ..Entry::EMPTY
    };
    let runs_on = (horizon + 1) as u16;
    let mut changes = SourceChanges::default();
    // clock 1: made the entries below
    changes.record(Changed::NOTHING.with(SOURCE_GLOBAL));
    let old = entry(1, 500, runs_on);
    // One sample beyond its horizon at a time: each spares it.
    for _ in 0..RECENT_SAMPLES {
        changes.record(Changed::NOTHING.with_sample(SOURCE_GLOBAL, 1_000));
        assert!(!changes.unchanged_since(&old));
        assert!(changes.spare(&old, horizon));
    }
    // One more: the first is overwritten, so the entry could have missed it.
    changes.record(Changed::NOTHING.with_sample(SOURCE_GLOBAL, 1_000));
    assert!(!changes.spare(&old, horizon));
    // One stamped after the overwritten change is still spared.
    assert!(changes.spare(&entry(2, 500, runs_on), horizon));
    // A sample inside its horizon, or above the age of one predicted to finish, is not.
    let before = changes.clock;
    changes.record(Changed::NOTHING.with_sample(SOURCE_GLOBAL, 560));
    assert!(!changes.spare(&entry(before, 500, runs_on), horizon));
    assert!(
        changes.spare(&entry(before, 479, runs_on), horizon),
        "beyond its horizon"
    );
    assert!(
        !changes.spare(&entry(before, 480, runs_on), horizon),
        "at its end"
    );
    assert!(
        changes.spare(&entry(before, 560, 10), horizon),
        "at its age"
    );
    assert!(!changes.spare(&entry(before, 559, 10), horizon));
    // Replaced: nothing is spared.
    changes.record(Changed::NOTHING.with(SOURCE_GLOBAL));
    assert!(!changes.spare(&entry(changes.clock - 1, 600, runs_on), horizon));
    // A source the entry did not read.
    changes.record(Changed::NOTHING.with(SOURCE_BUCKET0));
    assert!(changes.unchanged_since(&entry(changes.clock - 1, 600, runs_on)));
}

#[test]
fn changed_keeps_one_sample_length() {
    let c = Changed::NOTHING
        .with_sample(SOURCE_GLOBAL, 10)
        .with_sample(SOURCE_BUCKET0, 10);
    assert_eq!(c.sample_length(), Some(10));
    assert!(c.contains(SOURCE_BUCKET0) && !c.replaces(SOURCE_BUCKET0));
    // Another length in the same set: both replaced (a cache cannot hold two).
    let d = c.with_sample(SOURCE_BUCKET0 + 1, 20);
    assert!(d.replaces(SOURCE_GLOBAL) && d.replaces(SOURCE_BUCKET0));
    assert!(!d.replaces(SOURCE_BUCKET0 + 1));
    assert_eq!(d.sample_length(), Some(20));
    let u = c.union(Changed::NOTHING.with_sample(SOURCE_BUCKET0 + 1, 20));
    assert!(u.replaces(SOURCE_GLOBAL) && u.replaces(SOURCE_BUCKET0 + 1));
    assert_eq!(u.sample_length(), None);
    // Replacing wins over sampling, in either order.
    let r = c.with(SOURCE_GLOBAL);
    assert!(r.replaces(SOURCE_GLOBAL) && !r.replaces(SOURCE_BUCKET0));
    assert!(r.with_sample(SOURCE_GLOBAL, 10).replaces(SOURCE_GLOBAL));
    assert_eq!(c.union(Changed::ALL), Changed::ALL);
    // Its sources, ascending, sampled and replaced alike.
    let ids: Vec<Source> = c.with(SOURCE_SHARD0).sources().collect();
    assert_eq!(ids, [SOURCE_GLOBAL, SOURCE_BUCKET0, SOURCE_SHARD0]);
    assert_eq!(Changed::ALL.sources().count(), SOURCES);
    assert_eq!(Changed::NOTHING.sources().count(), 0);
}

mod exact_match_summary {
    use std::collections::{HashMap, VecDeque};

    use proptest::prelude::*;

    use super::*;

    /// ExactMatch's prediction from a hash's lengths as its definition states it (a pass over
    /// all of them), against the predictor's, which answers most requests from the lengths'
    /// least and greatest without reading them.
    fn by_definition(
        lengths: Option<&VecDeque<u32>>,
        fallback: &Survival,
        r: &RequestInfo,
        horizon: u32,
        min_hits: usize,
    ) -> Prediction {
        let Some(lengths) = lengths else {
            return fallback.predict(r, horizon);
        };
        let j = r.generated;
        let alive: Vec<u32> = lengths.iter().copied().filter(|&o| o > j).collect();
        if alive.len() < min_hits {
            return fallback.predict(r, horizon);
        }
        let done: Vec<u32> = alive
            .iter()
            .copied()
            .filter(|&o| o <= j.saturating_add(horizon))
            .collect();
        if done.is_empty() {
            return Prediction::RUNS_ON;
        }
        let sum: u64 = done.iter().map(|&o| u64::from(o)).sum();
        Prediction {
            p_finish: done.len() as f64 / alive.len() as f64,
            mean_remaining: sum as f64 / done.len() as f64 - f64::from(j),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn exact_match_predicts_as_its_definition(
            finishes in proptest::collection::vec((0u64..6, 1u32..400), 0..60),
            samples_per_hash in 1usize..6,
            min_hits in 1usize..4,
            asks in proptest::collection::vec(
                (0u64..8, prop_oneof![0u32..450, Just(120), Just(390)], 0u32..120),
                1..40,
            ),
        ) {
            let mut e = ExactMatch::new(Survival::new(4096, 1), 1024, samples_per_hash, min_hits);
            let mut fallback = Survival::new(4096, 1);
            let mut kept: HashMap<u64, VecDeque<u32>> = HashMap::new();
            for &(h, len) in &finishes {
                let f = fin(Some(h), len);
                e.observe(&f);
                fallback.observe(&f);
                let l = kept.entry(h).or_default();
                if l.len() >= samples_per_hash {
                    l.pop_front();
                }
                l.push_back(len);
            }
            for &(h, generated, horizon) in &asks {
                let r = running(generated, Some(h), None);
                let want = by_definition(kept.get(&h), &fallback, &r, horizon, min_hits);
                prop_assert_eq!(e.predict(&r, horizon), want, "hash {} at {}", h, generated);
                // `lookup` is `alike`, else `predict_with_reads`, in one search
                let (p, reads) = e.predict_with_reads(&r, horizon);
                let want = match e.alike(&r) {
                    Some(k) => Lookup::Alike(k),
                    None => Lookup::Made(p, reads),
                };
                prop_assert_eq!(e.lookup(&r, horizon), want);
            }
            // Requests alike are predicted alike, with the same reads, at any horizon.
            let mut by_key: HashMap<u64, Vec<RequestInfo>> = HashMap::new();
            for &(h, generated, _) in &asks {
                let r = running(generated, Some(h), None);
                if let Some(k) = e.alike(&r) {
                    by_key.entry(k).or_default().push(r);
                }
            }
            for alike in by_key.values() {
                for horizon in [0, 1, 37, 119] {
                    let first = e.predict_with_reads(&alike[0], horizon);
                    for r in &alike[1..] {
                        prop_assert_eq!(e.predict_with_reads(r, horizon), first);
                    }
                }
            }
        }
    }
}
