//! The algebra of the F-score, on random states: F = −ΔI exactly, continuity at m_g, the
//! m_g = 0 and G = 1 edge cases, and BR-H (H = 0, α = 1, β = G) = BR-0.

#![allow(clippy::unwrap_used)] // test fixtures: a panic is the failure report

use br_core::predict::{Oracle, Survival};
use br_core::score::{HorizonParams, Margins, br0_score};
use br_core::{ClusterState, Phase, RequestInfo};
use proptest::prelude::*;

fn state(loads: &[u32]) -> ClusterState {
    let mut st = ClusterState::with_workers(&vec![1024; loads.len()]);
    for (w, &l) in loads.iter().enumerate() {
        if l > 0 {
            st.reserve(RequestInfo {
                key: w as u64,
                worker: w as u32,
                prompt_tokens: l,
                generated: 0,
                phase: Phase::Running,
                prompt_hash: None,
                oracle_output: Some(l % 300 + 1),
                expected_output: None,
                class: None,
            })
            .unwrap();
        }
    }
    st
}

/// The barrier idle `I = G·M − Σ L` computed from scratch.
fn barrier_idle(loads: &[u64]) -> i128 {
    let g = loads.len() as i128;
    let max = *loads.iter().max().unwrap() as i128;
    g * max - loads.iter().map(|&l| l as i128).sum::<i128>()
}

proptest! {
    #[test]
    fn f_is_minus_delta_barrier_idle(loads in prop::collection::vec(0u32..200_000, 1..64), pick in any::<prop::sample::Index>(), ds in 0u64..400_000) {
        let g = pick.index(loads.len());
        let before: Vec<u64> = loads.iter().map(|&l| l as u64).collect();
        let mut after = before.clone();
        after[g] += ds;
        let margin = before.iter().max().unwrap() - before[g];
        let f = br0_score(ds, margin, loads.len() as u32);
        prop_assert_eq!(f, barrier_idle(&before) - barrier_idle(&after));
        // the working form used inside a tick gives the same number
        let st = state(&loads);
        let m = Margins::br0(&st);
        prop_assert_eq!(m.score(g as u32, ds as f64), f as f64);
    }

    #[test]
    fn continuous_at_the_margin(margin in 0u64..1_000_000, g in 1u32..64) {
        // left and right limits agree at Δs = m_g; the slope drops from 1 to −(G−1)
        prop_assert_eq!(br0_score(margin, margin, g), margin as i128);
        prop_assert_eq!(br0_score(margin + 1, margin, g) - br0_score(margin, margin, g), 1 - g as i128);
        if margin > 0 {
            prop_assert_eq!(br0_score(margin, margin, g) - br0_score(margin - 1, margin, g), 1);
        }
    }

    #[test]
    fn worker_at_the_max_always_loses(ds in 1u64..1_000_000, g in 2u32..64) {
        prop_assert_eq!(br0_score(ds, 0, g), -((g as i128 - 1) * ds as i128));
        prop_assert!(br0_score(ds, 0, g) < 0);
    }

    #[test]
    fn brh_with_zero_horizon_is_br0(loads in prop::collection::vec(0u32..100_000, 1..32), ds in 0u32..200_000, gamma in 0.1f64..1.0) {
        let st = state(&loads);
        let br0 = Margins::br0(&st);
        let params = HorizonParams { horizon: 0, alpha: 1.0, beta: None, gamma, gate: 0.5, ..HorizonParams::default() };
        let brh_survival = Margins::horizon(&st, &params, &Survival::default());
        let brh_oracle = Margins::horizon(&st, &params, &Oracle);
        for w in 0..loads.len() as u32 {
            prop_assert_eq!(brh_survival.score(w, ds as f64), br0.score(w, ds as f64));
            prop_assert_eq!(brh_oracle.score(w, ds as f64), br0.score(w, ds as f64));
        }
    }

    #[test]
    fn best_size_is_the_peak(loads in prop::collection::vec(0u32..50_000, 2..16), gamma in 0.3f64..0.95, beta in 1.0f64..50.0) {
        let st = state(&loads);
        let params = HorizonParams { horizon: 40, alpha: 1.0, beta: Some(beta), gamma, gate: 0.5, ..HorizonParams::default() };
        let m = Margins::horizon(&st, &params, &Oracle);
        for w in 0..loads.len() as u32 {
            let peak = m.best_size(w);
            prop_assume!(peak.is_finite());
            let f_peak = m.score(w, peak);
            for probe in [0.0, peak * 0.5, peak + 1.0, peak * 2.0 + 10.0] {
                prop_assert!(m.score(w, probe) <= f_peak + 1e-6, "F({probe}) > F(peak {peak})");
            }
        }
    }
}

#[test]
fn single_worker_group_makes_routing_moot() {
    // G = 1: I is always 0, so any admission scores 0.
    let st = state(&[500]);
    let m = Margins::br0(&st);
    assert_eq!(m.score(0, 123.0), 0.0);
    assert_eq!(br0_score(123, 0, 1), 0);
}

#[test]
fn horizon_margins_see_requests_leave() {
    // Worker 0 holds a long request that the oracle knows ends in 10 steps; worker 1 a short
    // lighter one that runs on. Beyond step 10, worker 0 is empty and has all the margin.
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
    st.reserve(mk(1, 0, 1000, 10)).unwrap();
    st.reserve(mk(2, 1, 600, 5000)).unwrap();
    let params = HorizonParams {
        horizon: 20,
        alpha: 1.0,
        beta: Some(2.0),
        gamma: 1.0,
        gate: 0.5,
        ..HorizonParams::default()
    };
    let m = Margins::horizon(&st, &params, &Oracle);
    assert_eq!(m.margin(1, 0), 400.0);
    assert_eq!(m.margin(0, 0), 0.0);
    assert_eq!(m.load(0), 1000.0);
    assert_eq!(m.margin(0, 15), 600.0 + 15.0);
    assert_eq!(m.margin(1, 15), 0.0);
}
