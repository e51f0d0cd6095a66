//! The F-score's request term (a step model `T = a·max L + c·max n + b` with c ≠ 0), on random
//! states: `F_g(Q) = −Δ(idle time)/a` exactly, with the idle time `a·I + c·I_n` recomputed from
//! scratch; κ = 0 is the paper's score bit for bit; BR-H with H = 0 is BR-0 with the term too;
//! admissions within a tick update the counts as σ would; and the term moves a placement the
//! token score alone would make the other way.

#![allow(clippy::unwrap_used)] // test fixtures: a panic is the failure report

use br_core::dispatch::{best_subset, best_subset_counted};
use br_core::predict::Oracle;
use br_core::score::{HorizonParams, Margins};
use br_core::{
    ClusterState, Phase, PolicyConfig, PolicyKind, Pool, PoolEntry, RequestInfo, build_policy,
};
use proptest::prelude::*;

/// A state whose worker w holds `requests[w]` running requests adding up to `loads[w]` tokens
/// (at least one token each).
fn state(workers: &[(u32, u32)]) -> ClusterState {
    let mut st = ClusterState::with_workers(&vec![1024; workers.len()]);
    let mut key = 0;
    for (w, &(load, n)) in workers.iter().enumerate() {
        let n = n.min(load);
        for i in 0..n {
            key += 1;
            // spread the load over the requests; the first takes the remainder
            let share = load / n + if i == 0 { load % n } else { 0 };
            st.reserve(RequestInfo {
                key,
                worker: w as u32,
                prompt_tokens: share,
                generated: 0,
                phase: Phase::Running,
                prompt_hash: None,
                oracle_output: Some(share % 200 + 1),
                expected_output: None,
                class: None,
            })
            .unwrap();
        }
    }
    st
}

/// `G·max x − Σ x` from scratch.
fn idle(xs: &[i128]) -> i128 {
    let g = xs.len() as i128;
    g * xs.iter().copied().max().unwrap() - xs.iter().sum::<i128>()
}

fn workers_strategy() -> impl Strategy<Value = Vec<(u32, u32)>> {
    prop::collection::vec((0u32..100_000, 0u32..40), 1..24)
}

proptest! {
    #[test]
    fn f_is_minus_the_change_of_barrier_idle_time(
        workers in workers_strategy(),
        pick in any::<prop::sample::Index>(),
        ds in 0u64..300_000,
        k in 1u32..8,
        kappa in 0u32..5_000,
    ) {
        let st = state(&workers);
        let g = pick.index(workers.len());
        let loads: Vec<i128> = st.workers().iter().map(|w| i128::from(w.load())).collect();
        let counts: Vec<i128> = st.workers().iter().map(|w| i128::from(w.requests())).collect();
        let before = idle(&loads) + i128::from(kappa) * idle(&counts);
        let (mut l2, mut n2) = (loads.clone(), counts.clone());
        l2[g] += i128::from(ds);
        n2[g] += i128::from(k);
        let after = idle(&l2) + i128::from(kappa) * idle(&n2);
        let m = Margins::br0_with_request_cost(&st, f64::from(kappa));
        // integers well inside f64's exact range: the score is exact
        prop_assert_eq!(m.score_subset(g as u32, ds as f64, k), (before - after) as f64);
    }

    #[test]
    fn kappa_zero_is_the_papers_score(
        workers in workers_strategy(),
        ds in 0u32..300_000,
        k in 1u32..8,
    ) {
        let st = state(&workers);
        let plain = Margins::br0(&st);
        let zero = Margins::br0_with_request_cost(&st, 0.0);
        prop_assert_eq!(&plain, &zero);
        for w in 0..workers.len() as u32 {
            // bit for bit, whatever the count
            prop_assert_eq!(zero.score_subset(w, f64::from(ds), k).to_bits(), plain.score(w, f64::from(ds)).to_bits());
        }
        let sizes = [f64::from(ds), 1_000.0, 7_000.0, 300.0];
        prop_assert_eq!(
            best_subset_counted(&sizes, 3, |x, n| zero.score_subset(0, x, n)),
            best_subset(&sizes, 3, |x| plain.score(0, x))
        );
    }

    #[test]
    fn brh_with_zero_horizon_is_br0_with_the_term(
        workers in workers_strategy(),
        ds in 0u32..300_000,
        k in 1u32..8,
        kappa in 1u32..5_000,
    ) {
        let st = state(&workers);
        let br0 = Margins::br0_with_request_cost(&st, f64::from(kappa));
        let params = HorizonParams {
            horizon: 0,
            beta: None,
            request_cost_tokens: f64::from(kappa),
            ..HorizonParams::default()
        };
        let brh = Margins::horizon(&st, &params, &Oracle);
        for w in 0..workers.len() as u32 {
            prop_assert_eq!(brh.score_subset(w, f64::from(ds), k), br0.score_subset(w, f64::from(ds), k));
            prop_assert_eq!(brh.request_margin(w, 0), br0.request_margin(w, 0));
        }
    }

    #[test]
    fn admitting_within_a_tick_equals_rebuilding_from_sigma(
        workers in workers_strategy(),
        admits in prop::collection::vec((any::<prop::sample::Index>(), 1u32..20_000), 1..12),
        kappa in 1u32..5_000,
        horizon in prop_oneof![Just(0u32), Just(20u32)],
    ) {
        let mut st = state(&workers);
        let params = HorizonParams {
            horizon,
            gamma: 0.9,
            request_cost_tokens: f64::from(kappa),
            ..HorizonParams::default()
        };
        let mut m = Margins::horizon(&st, &params, &Oracle);
        for (key, (pick, s)) in (1_000_000..).zip(admits) {
            let w = pick.index(workers.len()) as u32;
            m.admit(w, f64::from(s));
            // a queued request with no oracle length counts over the whole horizon, as an
            // admission does (its length is not known yet)
            st.reserve(RequestInfo {
                key,
                worker: w,
                prompt_tokens: s,
                generated: 0,
                phase: Phase::Queued,
                prompt_hash: None,
                oracle_output: Some(u32::MAX),
                expected_output: None,
                class: None,
            })
            .unwrap();
        }
        let rebuilt = Margins::horizon(&st, &params, &Oracle);
        for w in 0..workers.len() as u32 {
            for h in 0..rebuilt.horizon_steps() {
                prop_assert_eq!(m.request_margin(w, h), rebuilt.request_margin(w, h));
                prop_assert_eq!(m.margin(w, h), rebuilt.margin(w, h));
            }
        }
    }
}

#[test]
fn horizon_counts_drop_requests_at_their_predicted_end() {
    // worker 0: two requests, one ends in 5 steps (oracle); worker 1: one request that runs on
    let mut st = ClusterState::with_workers(&[8, 8]);
    let mk = |key, worker, s, o| RequestInfo {
        key,
        worker,
        prompt_tokens: s,
        generated: 0,
        phase: Phase::Running,
        prompt_hash: None,
        oracle_output: Some(o),
        expected_output: None,
        class: None,
    };
    st.reserve(mk(1, 0, 100, 5)).unwrap();
    st.reserve(mk(2, 0, 100, 5000)).unwrap();
    st.reserve(mk(3, 1, 100, 5000)).unwrap();
    let params = HorizonParams {
        horizon: 10,
        request_cost_tokens: 100.0,
        ..HorizonParams::default()
    };
    let m = Margins::horizon(&st, &params, &Oracle);
    assert_eq!(m.request_margin(0, 0), 0.0);
    assert_eq!(m.request_margin(1, 0), 1.0);
    // from step 5 on, request 1 is gone: both workers run one
    assert_eq!(m.request_margin(0, 5), 0.0);
    assert_eq!(m.request_margin(1, 5), 0.0);
    assert_eq!(m.request_margin(1, 4), 1.0);
}

#[test]
fn the_request_term_moves_a_placement() {
    // Worker 0 is light in tokens but runs the most requests; worker 1 holds the token max with
    // one request. A 2,000-token request scores +2,000 on worker 0 and −2,000 on worker 1 by
    // tokens alone; with κ = 3,000 tokens per request worker 0's count overflow costs 3,000
    // (−1,000 in all) and worker 1's spare count gains 3,000 (+1,000). Stage 1 fills to the
    // max here (stage1_level = 1, the F-score alone): the default's fill level would keep the
    // request off the token max whatever κ, and this test is about the F-score's term.
    let st = state(&[(1_000, 3), (5_000, 1)]);
    let place = |kappa: f64| {
        let mut cfg = PolicyConfig::new(PolicyKind::Br0);
        cfg.dispatcher.stage1_level = 1.0;
        cfg.horizon.request_cost_tokens = kappa;
        let mut policy = build_policy(&cfg).unwrap();
        let mut pool = Pool::new();
        pool.push(PoolEntry {
            key: 99,
            prompt_tokens: 2_000,
            prompt_hash: None,
            oracle_output: None,
            expected_output: None,
            class: None,
        })
        .unwrap();
        let mut out = Vec::new();
        policy.dispatch(&mut pool, &st, &mut out);
        assert_eq!(out.len(), 1);
        (out[0].worker, out[0].score)
    };
    assert_eq!(place(0.0), (0, 2_000.0));
    assert_eq!(place(3_000.0), (1, 1_000.0));
    // a small κ does not outweigh the token overflow
    assert_eq!(place(500.0).0, 0);
}

#[test]
fn a_negative_or_non_finite_request_cost_is_refused() {
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        let mut cfg = PolicyConfig::new(PolicyKind::Br0);
        cfg.horizon.request_cost_tokens = bad;
        assert!(build_policy(&cfg).is_err(), "{bad}");
    }
}
