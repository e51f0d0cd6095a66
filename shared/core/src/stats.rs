//! The one percentile definition of the project.
//!
//! **Nearest rank**: the `q`-quantile of `n` samples is the smallest sample `x` such that at
//! least `⌈q·n⌉` samples (and at least one) are `≤ x`; `q` is clamped to `[0, 1]`. So p50 of
//! 1..=100 is 50, p95 is 95, p100 is the maximum, p0 the minimum; no interpolation, every
//! answer is a sample.
//!
//! [`quantile`] computes it exactly, for results that must reproduce bit for bit (br-sim's
//! report, and br-emu's load summary, which is printed beside br-sim's prediction). Latency
//! benchmarks record into an `hdrhistogram::Histogram` instead, whose `value_at_quantile` uses
//! the same rank rule over buckets of 3 significant digits: the two agree up to that
//! quantisation. A service that only has a Prometheus histogram (br-decision's live page, over
//! its Assign latency buckets) uses [`bucket_quantile`]: the same rank rule again, answering
//! the upper bound of the bucket that holds the sample. There is no other percentile code in
//! the workspace.

/// The `q`-quantile (0..=1) of `values` by nearest rank (see the module doc); 0 when empty.
/// Reorders `values` (a selection, O(n), not a sort). NaN-free input.
pub fn quantile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let n = values.len();
    let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as usize).clamp(1, n) - 1;
    let (_, v, _) = values.select_nth_unstable_by(rank, f64::total_cmp);
    *v
}

/// The `q`-quantile by nearest rank over a histogram with cumulative buckets, as Prometheus
/// keeps them: `cumulative[i]` samples are `≤ bounds[i]` (bounds ascending), `total` samples
/// in all (those above the last bound are in the implicit `+Inf` bucket). The answer is the
/// upper bound of the bucket holding the rank-`⌈q·n⌉` sample, so the exact quantile is at most
/// that (and above the bucket's lower bound); `+∞` when that sample is above every bound, `None`
/// with no samples.
pub fn bucket_quantile(bounds: &[f64], cumulative: &[u64], total: u64, q: f64) -> Option<f64> {
    if total == 0 {
        return None;
    }
    let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).clamp(1, total);
    let at = cumulative.iter().position(|c| *c >= rank);
    Some(
        at.and_then(|i| bounds.get(i).copied())
            .unwrap_or(f64::INFINITY),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn nearest_rank_on_one_to_hundred() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(quantile(&mut v, 0.5), 50.0);
        assert_eq!(quantile(&mut v, 0.95), 95.0);
        assert_eq!(quantile(&mut v, 0.99), 99.0);
        assert_eq!(quantile(&mut v, 1.0), 100.0);
        assert_eq!(quantile(&mut v, 0.0), 1.0);
        assert_eq!(quantile(&mut v, 2.0), 100.0);
        assert_eq!(quantile(&mut v, -1.0), 1.0);
        assert_eq!(quantile(&mut [], 0.5), 0.0);
        // Between ranks the next sample up is taken, never an interpolation.
        assert_eq!(quantile(&mut [10.0, 20.0, 30.0, 40.0], 0.5), 20.0);
        assert_eq!(quantile(&mut [10.0, 20.0, 30.0, 40.0], 0.51), 30.0);
    }

    proptest! {
        /// Against the definition computed independently: count the samples at or below.
        #[test]
        fn is_the_smallest_sample_with_enough_at_or_below(
            v in prop::collection::vec(-1e6f64..1e6, 1..200),
            q in 0.0f64..=1.0,
        ) {
            let mut w = v.clone();
            let x = quantile(&mut w, q);
            let need = ((q * v.len() as f64).ceil() as usize).max(1);
            let at_or_below = |y: f64| v.iter().filter(|s| **s <= y).count();
            prop_assert!(v.contains(&x));
            prop_assert!(at_or_below(x) >= need);
            prop_assert!(v.iter().filter(|s| **s < x).all(|s| at_or_below(*s) < need));
        }

        /// Over buckets, the answer is the smallest bound at or above the exact nearest-rank
        /// quantile of the samples (+∞ above the last bound).
        #[test]
        fn a_bucket_quantile_bounds_the_exact_one(
            v in prop::collection::vec(0.0f64..100.0, 1..200),
            q in 0.0f64..=1.0,
        ) {
            let bounds = [1.0, 5.0, 10.0, 25.0, 50.0, 75.0];
            let cumulative: Vec<u64> = bounds
                .iter()
                .map(|b| v.iter().filter(|s| **s <= *b).count() as u64)
                .collect();
            let exact = quantile(&mut v.clone(), q);
            let want = bounds.iter().copied().find(|b| exact <= *b).unwrap_or(f64::INFINITY);
            prop_assert_eq!(bucket_quantile(&bounds, &cumulative, v.len() as u64, q), Some(want));
        }
    }

    #[test]
    fn bucket_quantile_of_nothing_is_none() {
        assert_eq!(bucket_quantile(&[1.0], &[0], 0, 0.5), None);
        // 3 samples ≤ 1, 1 above every bound: p50 ≤ 1, p99 above the last bound
        assert_eq!(bucket_quantile(&[1.0, 2.0], &[3, 3], 4, 0.5), Some(1.0));
        assert_eq!(
            bucket_quantile(&[1.0, 2.0], &[3, 3], 4, 0.99),
            Some(f64::INFINITY)
        );
    }
}
