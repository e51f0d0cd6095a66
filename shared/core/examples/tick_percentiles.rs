//! p50 / p99 of one dispatcher tick (criterion reports means and medians; the budget in
//! docs/benchmarks.md is stated as percentiles, like the paper's 1.2 ms p50 / 2.8 ms p99).
//! Run: `cargo run --release -p br-core --example tick_percentiles`.
//!
//! BR-0 is measured with the default Stage 2 (the tick's head, filled to the mean) and with
//! the paper's (`br0-paper-s2`: the R_max oldest, filled to the max), the previous default, to
//! show what the wide-EP Stage 2 costs; G = 128 with 8,192 waiting is issue 16's budget (1 ms
//! at p99). `br0-request-term` is BR-0 with the F-score's request term (κ = 1,250 tokens per
//! request: a step model with c = 0.25 ms per request at a = 2e-4 ms per token).
//!
//! BR-H rows come in three forms, measured side by side in one run:
//! * `uncached`: `Margins::horizon` + `dispatch_tick`, asking the predictor about every
//!   running request each tick (what the policy did before its prediction cache);
//! * `cached`: the policy itself, ticking on an unchanged σ (every prediction reused);
//! * `cached+step`: the policy, with 1 in 30 running requests generating a token between two
//!   ticks (a 1 ms tick against a ~30 ms decode step), so those are predicted again.

use std::time::Instant;

use br_core::bench_support::steady_state;
use br_core::dispatch::{Stage2Fill, Stage2Window, dispatch_tick};
use br_core::policy::PredictorKind;
use br_core::predict::{Finished, Oracle, Predictor, Survival};
use br_core::score::Margins;
use br_core::{ClusterState, Phase, PolicyConfig, PolicyKind, build_policy};
use hdrhistogram::Histogram;

#[derive(Clone, Copy, PartialEq)]
enum Form {
    Policy,
    /// BR-0 with the paper's Stage 2.
    PaperStage2,
    /// BR-0 with the request term.
    RequestTerm,
    Uncached,
    CachedStep,
}

/// Lengths a running service would have learned (the Survival predictor's warm-up).
fn warm_lengths() -> impl Iterator<Item = u32> {
    (0..20_000u32).map(|o| 1000 + (o * 7919) % 500)
}

fn main() {
    println!(
        "{:<26} {:>4} {:>8} {:>10} {:>10} {:>10} {:>9}",
        "policy", "G", "waiting", "p50_us", "p99_us", "max_us", "admitted"
    );
    // the paper's Stage 2, the previous default
    let mut paper = PolicyConfig::new(PolicyKind::Br0);
    paper.dispatcher.stage2_window = Stage2Window::Oldest;
    paper.dispatcher.stage2_fill = Stage2Fill::Max;
    for (workers, waiting) in [(8u32, 256usize), (64, 4096), (128, 8192)] {
        let rows = [
            (PolicyKind::Br0, Form::Policy),
            (PolicyKind::Br0, Form::PaperStage2),
            (PolicyKind::Br0, Form::RequestTerm),
            (PolicyKind::BrH(PredictorKind::Survival), Form::Uncached),
            (PolicyKind::BrH(PredictorKind::Survival), Form::Policy),
            (PolicyKind::BrH(PredictorKind::Survival), Form::CachedStep),
            (PolicyKind::BrH(PredictorKind::Oracle), Form::Uncached),
            (PolicyKind::BrH(PredictorKind::Oracle), Form::Policy),
            (PolicyKind::BrH(PredictorKind::Oracle), Form::CachedStep),
        ];
        for (kind, form) in rows {
            // Nanoseconds up to a minute, 3 significant digits (nearest-rank quantiles).
            let mut samples =
                Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("valid bounds");
            let mut admitted = 0;
            let cfg = match form {
                Form::PaperStage2 => paper.clone(),
                Form::RequestTerm => {
                    let mut c = PolicyConfig::new(kind);
                    c.horizon.request_cost_tokens = 1250.0;
                    c
                }
                _ => PolicyConfig::new(kind),
            };
            // Fresh scenarios (different seeds) so the tick sees varied states.
            for seed in 0..40u64 {
                let (mut state, pool) = steady_state(workers, 256, waiting, seed);
                let mut policy = build_policy(&cfg).expect("valid config");
                let mut reference: Box<dyn Predictor> = match kind {
                    PolicyKind::BrH(PredictorKind::Oracle) => Box::new(Oracle),
                    _ => Box::new(Survival::default()),
                };
                if kind == PolicyKind::BrH(PredictorKind::Survival) {
                    // warm the predictor the way a running service would be
                    for o in warm_lengths() {
                        let f = Finished {
                            prompt_tokens: 4_096,
                            prompt_hash: None,
                            output_tokens: o,
                        };
                        policy.observe_finished(&f);
                        reference.observe(&f);
                    }
                }
                let mut out = Vec::with_capacity(1024);
                for round in 0..50u64 {
                    if form == Form::CachedStep {
                        step_some(&mut state, round);
                    }
                    let mut p = pool.clone();
                    out.clear();
                    let t = Instant::now();
                    if form == Form::Uncached {
                        let mut m = Margins::horizon(&state, &cfg.horizon, reference.as_ref());
                        dispatch_tick(&cfg.dispatcher, &mut p, &state, &mut m, &mut out);
                    } else {
                        policy.dispatch(&mut p, &state, &mut out);
                    }
                    let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    // The first tick of a cached policy fills its cache: that is the
                    // uncached cost again, counted like any other tick.
                    samples.saturating_record(ns);
                    admitted = out.len();
                }
            }
            let us = |ns: u64| ns as f64 / 1e3;
            let q = |p: f64| us(samples.value_at_quantile(p));
            let name = match (kind, form) {
                (_, Form::PaperStage2) => format!("{}-paper-s2", kind.name()),
                (_, Form::RequestTerm) => format!("{}-request-term", kind.name()),
                (PolicyKind::Br0, _) => kind.name().to_owned(),
                (_, Form::Uncached) => format!("{} uncached", kind.name()),
                (_, Form::Policy) => format!("{} cached", kind.name()),
                (_, Form::CachedStep) => format!("{} cached+step", kind.name()),
            };
            println!(
                "{:<26} {:>4} {:>8} {:>10.1} {:>10.1} {:>10.1} {:>9}",
                name,
                workers,
                waiting,
                q(0.5),
                q(0.99),
                us(samples.max()),
                admitted
            );
        }
    }
}

/// One in 30 running requests (a different thirtieth each round) generates a token.
fn step_some(state: &mut ClusterState, round: u64) {
    let grow: Vec<(u64, u32)> = state
        .requests()
        .filter(|r| r.phase == Phase::Running && r.key % 30 == round % 30)
        .map(|r| (r.key, r.generated + 1))
        .collect();
    for (key, generated) in grow {
        let _ = state.set_generated(key, generated);
    }
}
