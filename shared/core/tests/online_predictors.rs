//! The online predictors against independent answers: brute-force conditional distributions
//! over the same finished requests, a reference LRU for ExactMatch's memory bound, and
//! convergence to a known stationary distribution (BR-H).

use std::collections::VecDeque;

use br_core::predict::{ExactMatch, Finished, Prediction, Predictor, PredictorConfig, Survival};
use br_core::{Phase, RequestInfo};
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

fn request(prompt_tokens: u32, generated: u32, prompt_hash: Option<u64>) -> RequestInfo {
    RequestInfo {
        key: 1,
        worker: 0,
        prompt_tokens,
        generated,
        phase: Phase::Running,
        prompt_hash,
        oracle_output: None,
        expected_output: None,
        class: None,
    }
}

/// P(o ≤ j + h | o > j) and E[o − j | j < o ≤ j + h] over `lengths`, by counting.
fn brute(lengths: &[u32], j: u32, h: u32) -> Prediction {
    let alive: Vec<u32> = lengths.iter().copied().filter(|&o| o > j).collect();
    let fin: Vec<u32> = alive
        .iter()
        .copied()
        .filter(|&o| o <= j.saturating_add(h))
        .collect();
    if alive.is_empty() || fin.is_empty() {
        return Prediction::RUNS_ON;
    }
    Prediction {
        p_finish: fin.len() as f64 / alive.len() as f64,
        mean_remaining: fin.iter().map(|&o| f64::from(o)).sum::<f64>() / fin.len() as f64
            - f64::from(j),
    }
}

fn close(a: Prediction, b: Prediction) -> bool {
    (a.p_finish - b.p_finish).abs() < 1e-9 && (a.mean_remaining - b.mean_remaining).abs() < 1e-6
}

fn octave(prompt: u32) -> u32 {
    u32::BITS - prompt.leading_zeros()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Survival (bucketed) equals counting over the request's own prompt octave once that has
    /// `min_samples` lengths, over every length once the whole has, and runs on before.
    #[test]
    fn survival_matches_counting(
        finished in prop::collection::vec((1u32..20_000, 1u32..6_000), 0..120),
        max_len in 1u32..8_000,
        min_samples in 1u64..12,
        buckets in any::<bool>(),
        queries in prop::collection::vec((1u32..20_000, 0u32..7_000, 0u32..300), 1..12),
    ) {
        let mut s = Survival::with_buckets(max_len, min_samples, buckets);
        for &(prompt, out) in &finished {
            s.observe(&Finished { prompt_tokens: prompt, prompt_hash: None, output_tokens: out, expected_output: None, class: None });
        }
        let clamp = |o: u32| o.clamp(1, max_len);
        let all: Vec<u32> = finished.iter().map(|&(_, o)| clamp(o)).collect();
        for (prompt, j, h) in queries {
            let own: Vec<u32> = finished
                .iter()
                .filter(|&&(p, _)| octave(p) == octave(prompt))
                .map(|&(_, o)| clamp(o))
                .collect();
            let want = if buckets && own.len() as u64 >= min_samples {
                brute(&own, j, h)
            } else if all.len() as u64 >= min_samples {
                brute(&all, j, h)
            } else {
                Prediction::RUNS_ON
            };
            let got = s.predict(&request(prompt, j, None), h);
            prop_assert!(close(got, want), "prompt {prompt} j {j} h {h}: {got:?} != {want:?}");
        }
        // The memory bound: one histogram per octave seen plus the global one, each at most
        // two u64 arrays of next_pow2(max_len) + 1.
        let st = s.stats();
        let per = 2 * 8 * (max_len.next_power_of_two() as usize + 1);
        prop_assert!(st.bytes <= per * (st.buckets + 1), "{st:?}");
        prop_assert!(st.buckets <= 33);
        prop_assert_eq!(st.samples, finished.len() as u64);
    }

    /// ExactMatch remembers exactly the `max_hashes` most recently finished hashes (a
    /// reference LRU), the last `samples_per_hash` lengths of each, and predicts a hit from
    /// them; a forgotten hash falls back to Survival.
    #[test]
    fn exact_match_is_a_bounded_lru(
        stream in prop::collection::vec((0u64..40, 1u32..3_000), 0..300),
        max_hashes in 1usize..12,
        per_hash in 1usize..6,
        j in 0u32..2_000,
        h in 1u32..300,
    ) {
        let mut e = ExactMatch::new(Survival::new(4_096, 1), max_hashes, per_hash, 1);
        // most recent last: (hash, its lengths)
        let mut lru: VecDeque<(u64, VecDeque<u32>)> = VecDeque::new();
        let mut all = Vec::new();
        for &(hash, out) in &stream {
            e.observe(&Finished { prompt_tokens: 10, prompt_hash: Some(hash), output_tokens: out, expected_output: None, class: None });
            all.push(out);
            let mut lengths = match lru.iter().position(|(k, _)| *k == hash) {
                Some(i) => lru.remove(i).map(|(_, l)| l).unwrap_or_default(),
                None => {
                    if lru.len() == max_hashes {
                        lru.pop_front();
                    }
                    VecDeque::new()
                }
            };
            if lengths.len() == per_hash {
                lengths.pop_front();
            }
            lengths.push_back(out);
            lru.push_back((hash, lengths));
            prop_assert!(e.known_hashes() <= max_hashes);
            prop_assert_eq!(e.known_hashes(), lru.len());
        }
        for hash in 0u64..40 {
            let got = e.predict(&request(10, j, Some(hash)), h);
            let want = match lru.iter().find(|(k, _)| *k == hash) {
                Some((_, l)) if l.iter().any(|&o| o > j) => {
                    brute(&l.iter().copied().collect::<Vec<_>>(), j, h)
                }
                _ => brute(&all, j, h),
            };
            prop_assert!(close(got, want), "hash {hash}: {got:?} != {want:?}");
        }
    }
}

/// The true P(o ≤ j + h | o > j) of a length uniform on lo..=hi.
fn uniform_p_finish(lo: u32, hi: u32, j: u32, h: u32) -> f64 {
    let alive = (lo.max(j + 1)..=hi).count() as f64;
    let fin = (lo.max(j + 1)..=hi.min(j + h)).count() as f64;
    if alive == 0.0 { 0.0 } else { fin / alive }
}

/// On a stationary stream the learned distributions approach the true ones: short prompts run
/// 500..=1,500 tokens, long ones 100..=200, and each of 20 templates always runs its own
/// length. After 20,000 finishes (about 7,000 per octave) Survival's per-octave tail probabilities are within 0.03 of the
/// truth (about 3 standard errors at the rarest query; the global mixture would be off by far
/// more), and ExactMatch is exact on templates.
#[test]
fn converges_on_a_stationary_stream() {
    let mut rng = SmallRng::seed_from_u64(16);
    let mut e = PredictorConfig::default().exact_match();
    let template_len = |t: u64| 300 + 37 * t as u32;
    let draw = |rng: &mut SmallRng| -> Finished {
        if rng.random_bool(0.3) {
            let t = rng.random_range(0..20u64);
            Finished {
                prompt_tokens: 2_000,
                prompt_hash: Some(t),
                output_tokens: template_len(t),
                expected_output: None,
                class: None,
            }
        } else if rng.random_bool(0.5) {
            Finished {
                prompt_tokens: rng.random_range(300..500),
                prompt_hash: None,
                output_tokens: rng.random_range(500..=1_500),
                expected_output: None,
                class: None,
            }
        } else {
            Finished {
                prompt_tokens: rng.random_range(9_000..16_000),
                prompt_hash: None,
                output_tokens: rng.random_range(100..=200),
                expected_output: None,
                class: None,
            }
        }
    };
    // Cold: nothing is predicted to finish (the conservative anchor).
    assert_eq!(
        e.predict(&request(400, 1_400, None), 80),
        Prediction::RUNS_ON
    );
    for _ in 0..20_000 {
        let f = draw(&mut rng);
        e.observe(&f);
    }
    for (j, h) in [(0, 80), (600, 80), (1_000, 200), (1_400, 80)] {
        let got = e.predict(&request(400, j, None), h).p_finish;
        let want = uniform_p_finish(500, 1_500, j, h);
        assert!(
            (got - want).abs() < 0.03,
            "short j {j} h {h}: {got} vs {want}"
        );
    }
    for (j, h) in [(0, 80), (100, 50), (150, 20)] {
        let got = e.predict(&request(12_000, j, None), h).p_finish;
        let want = uniform_p_finish(100, 200, j, h);
        assert!(
            (got - want).abs() < 0.03,
            "long j {j} h {h}: {got} vs {want}"
        );
    }
    for t in 0..20u64 {
        let len = template_len(t);
        let p = e.predict(&request(2_000, len - 40, Some(t)), 80);
        assert_eq!(p.p_finish, 1.0, "template {t}");
        assert_eq!(p.mean_remaining, 40.0, "template {t}");
    }
    let st = e.stats();
    assert_eq!((st.samples, st.hashes), (20_000, 20));
    // octaves of 300..500 (9 and 10... 256..511 is octave 9), 2,000 (11) and 9,000..16,000 (14)
    assert!(st.buckets <= 4, "{st:?}");
}
