//! BR-H learns online from what σ reports finished: the prompt length and hash σ holds for the
//! request, and its final output length; the gauges show what the predictor holds.

use br_core::PredictorKind;

use super::*;

#[test]
fn brh_learns_from_finished_requests_in_sigma() {
    let mut fx = Fx::new(PolicyKind::BrH(PredictorKind::ExactMatch), &[0, 0], 4);
    assert_eq!(fx.core.policy.predictor_stats().map(|s| s.samples), Some(0));
    // Reserved with a hash (as the gateway sends it), runs, finishes after 300 tokens.
    fx.sigma_change(vec![change::request_reserved(
        "a",
        0,
        100,
        5_000,
        Some(42),
        None,
    )]);
    fx.sigma_change(vec![change::request_progress("a", 0, 100, 5_000, 120)]);
    fx.sigma_change(vec![change::request_finished("a", 300)]);
    // One without a hash (a worker reported it; no reservation).
    fx.sigma_change(vec![change::request_progress("b", 1, 101, 900, 10)]);
    fx.sigma_change(vec![change::request_finished("b", 50)]);
    let st = fx
        .core
        .policy
        .predictor_stats()
        .expect("BR-H has a predictor");
    assert_eq!(st.samples, 2);
    assert_eq!(st.hashes, 1, "only a sent a hash");
    assert_eq!(st.buckets, 2, "5,000 and 900 tokens are different octaves");
    let [samples, hashes, buckets] = &fx.core.metrics.predictor_entries;
    assert_eq!((samples.get(), hashes.get(), buckets.get()), (2, 1, 2));
    assert!(fx.core.metrics.predictor_bytes.get() > 0);
}

#[test]
fn br0_has_no_predictor_and_leaves_the_gauges_at_zero() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 4);
    fx.sigma_change(vec![change::request_progress("a", 0, 100, 800, 10)]);
    fx.sigma_change(vec![change::request_finished("a", 20)]);
    assert_eq!(fx.core.policy.predictor_stats(), None);
    assert_eq!(fx.core.metrics.predictor_entries[0].get(), 0);
    let _a = fx.assign("a", 100);
    assert_eq!(fx.tick_and_commit(true), 1);
    assert!(fx.core.metrics.predictions.iter().all(|c| c.get() == 0));
}

/// BR-H's ticks count how its prediction cache answered for each request: predicted at the
/// first tick that sees it, reused while nothing it depends on changes, spared when a finish's
/// length cannot change it.
#[test]
fn brh_counts_its_predictions_by_answer() {
    let mut fx = Fx::new(PolicyKind::BrH(PredictorKind::Survival), &[500, 800], 64);
    let counts = |fx: &Fx| fx.core.metrics.predictions.each_ref().map(|c| c.get());
    let _a = fx.assign("a", 100);
    assert_eq!(fx.tick_and_commit(true), 1);
    assert_eq!(counts(&fx), [0, 0, 2], "bg0 and bg1, the first time");
    let _b = fx.assign("b", 100);
    assert_eq!(fx.tick_and_commit(true), 1);
    assert_eq!(counts(&fx), [2, 0, 3], "bg0 and bg1 again, and a");
    // a finishes after 5,000 tokens: beyond the horizon of every request still running (all
    // at 0 tokens, predicted to run on), so no prediction changes.
    fx.sigma_change(vec![change::request_finished("a", 5_000)]);
    let _c = fx.assign("c", 100);
    assert_eq!(fx.tick_and_commit(true), 1);
    assert_eq!(
        counts(&fx),
        [2, 2, 4],
        "bg0 and bg1 spared, b the first time"
    );
}
