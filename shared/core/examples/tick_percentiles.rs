//! p50 / p99 of one dispatcher tick (criterion reports means and medians; the budget in
//! docs/benchmarks.md is stated as percentiles, like the paper's 1.2 ms p50 / 2.8 ms p99).
//! Run: `cargo run --release -p br-core --example tick_percentiles [FILTER]` (FILTER: only the
//! rows whose name contains it, e.g. `"survival cached+learn"` under `perf record`).
//!
//! BR-0 is measured with the default Stage 2 (the tick's head, filled to the mean) and with
//! the paper's (`br0-paper-s2`: the R_max oldest, filled to the max), the previous default, to
//! show what the wide-EP Stage 2 costs; G = 128 with 8,192 waiting is the tick budget's case (1 ms
//! at p99). `br0-request-term` is BR-0 with the F-score's request term (κ = 1,250 tokens per
//! request: a step model with c = 0.25 ms per request at a = 2e-4 ms per token).
//!
//! BR-H rows come in three forms, measured side by side in one run:
//! * `uncached`: `Margins::horizon` + `dispatch_tick`, asking the predictor about every
//!   running request each tick (what the policy did before its prediction cache);
//! * `cached`: the policy itself, ticking on an unchanged σ (every prediction reused);
//! * `cached+step`: the policy, with 1 in 30 running requests generating a token between two
//!   ticks (a 1 ms tick against a ~30 ms decode step), so those are predicted again;
//! * `cached+learn`: as `cached+step`, and one running request finishes before every tick
//!   (the predictor learns from it) and a new one takes its slot: at G = 64 with ~1,250-token
//!   outputs about 13 requests finish per 30 ms step, so a 1 ms tick sees one every other
//!   tick; this is the cache's steady state in a live group.
//!
//! The last line is BR-H's (`brh`, ExactMatch) p99 over BR-0's at G = 64 with 4,096 waiting,
//! from this run's rows: `cached+learn` over `br0 step+finish`, `cached` over `br0` (the same
//! σ and pool for both policies: the scenarios' seeds are the rows').
//!
//! The predictors are warmed with 20,000 finished requests whose prompts span the scenarios'
//! (700..8,000 tokens: four prompt-length octaves) and whose hashes are the scenarios' 5,000.
//! Each row is 40 scenarios × 50 ticks. The first tick of each scenario (which fills a cached
//! policy's table) is counted like the others in p50/p99, and also apart: `p99_warm_us`
//! leaves it out, `first_p50_us` is its median.

use std::time::Instant;

use br_core::PredictorKind;
use br_core::bench_support::steady_state;
use br_core::dispatch::{Stage2Fill, Stage2Window, dispatch_tick};
use br_core::predict::{Finished, Oracle, Predictor};
use br_core::score::Margins;
use br_core::{ClusterState, Phase, PolicyConfig, PolicyKind, RequestInfo, build_policy};
use hdrhistogram::Histogram;

#[derive(Clone, Copy, PartialEq)]
enum Form {
    Policy,
    /// BR-0 with the paper's Stage 2.
    PaperStage2,
    /// BR-0 with the request term.
    RequestTerm,
    /// BR-0 with `CachedLearn`'s tokens and finishes between ticks.
    StepFinish,
    Uncached,
    CachedStep,
    CachedLearn,
}

/// What a running service would have learned (the predictors' warm-up): prompts and hashes
/// as in `steady_state`, outputs 1,000..1,500.
fn warm_finishes() -> impl Iterator<Item = Finished> {
    (0..20_000u32).map(|o| Finished {
        prompt_tokens: 700 + (o * 31) % 7_300,
        prompt_hash: Some(u64::from(o % 5_000)),
        output_tokens: 1000 + (o * 7919) % 500,
        expected_output: None,
        class: None,
    })
}

fn main() {
    // `tick_percentiles FILTER`: only the rows whose name contains FILTER (for a profile).
    let filter = std::env::args().nth(1);
    println!(
        "{:<26} {:>4} {:>8} {:>9} {:>9} {:>12} {:>9} {:>12} {:>9}",
        "policy",
        "G",
        "waiting",
        "p50_us",
        "p99_us",
        "p99_warm_us",
        "max_us",
        "first_p50_us",
        "admitted"
    );
    // the paper's Stage 2, the previous default
    // p99 (µs) of the rows the ratio line is made of, by name, at G = 64 with 4,096 waiting
    let mut at64: Vec<(String, f64)> = Vec::new();
    let mut paper = PolicyConfig::new(PolicyKind::Br0);
    paper.dispatcher.stage2_window = Stage2Window::Oldest;
    paper.dispatcher.stage2_fill = Stage2Fill::Max;
    for (workers, waiting) in [(8u32, 256usize), (64, 4096), (128, 8192)] {
        let rows = [
            (PolicyKind::Br0, Form::Policy),
            (PolicyKind::Br0, Form::PaperStage2),
            (PolicyKind::Br0, Form::RequestTerm),
            (PolicyKind::Br0, Form::StepFinish),
        ];
        let brh = [
            PredictorKind::Survival,
            PredictorKind::ExactMatch,
            PredictorKind::Oracle,
        ]
        .into_iter()
        .flat_map(|p| {
            [
                Form::Uncached,
                Form::Policy,
                Form::CachedStep,
                Form::CachedLearn,
            ]
            .map(|f| (PolicyKind::BrH(p), f))
        });
        for (kind, form) in rows.into_iter().chain(brh) {
            let name = match (kind, form) {
                (_, Form::PaperStage2) => format!("{}-paper-s2", kind.name()),
                (_, Form::RequestTerm) => format!("{}-request-term", kind.name()),
                (_, Form::StepFinish) => format!("{} step+finish", kind.name()),
                (PolicyKind::Br0, _) => kind.name().to_owned(),
                (_, Form::Uncached) => format!("{} uncached", kind.name()),
                (_, Form::Policy) => format!("{} cached", kind.name()),
                (_, Form::CachedStep) => format!("{} cached+step", kind.name()),
                (_, Form::CachedLearn) => format!("{} cached+learn", kind.name()),
            };
            if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
                continue;
            }
            // Nanoseconds up to a minute, 3 significant digits (nearest-rank quantiles).
            let mut samples =
                Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("valid bounds");
            // The same ticks without each scenario's first (a cached policy's first tick
            // fills its table: once per group and start, not per tick) and the first alone.
            let mut warm = samples.clone();
            let mut first = samples.clone();
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
                    PolicyKind::BrH(PredictorKind::ExactMatch) => {
                        Box::new(cfg.horizon.predictor.exact_match())
                    }
                    _ => Box::new(cfg.horizon.predictor.survival()),
                };
                if matches!(kind, PolicyKind::BrH(p) if p != PredictorKind::Oracle) {
                    // warm the predictor the way a running service would be
                    for f in warm_finishes() {
                        policy.observe_finished(&f);
                        reference.observe(&f);
                    }
                }
                let mut out = Vec::with_capacity(1024);
                for round in 0..50u64 {
                    if matches!(
                        form,
                        Form::CachedStep | Form::CachedLearn | Form::StepFinish
                    ) {
                        step_some(&mut state, round);
                    }
                    if matches!(form, Form::CachedLearn | Form::StepFinish) {
                        finish_one(&mut state, policy.as_mut(), round);
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
                    // The first tick of a cached policy fills its cache (the predictor
                    // asked about every request, and the table's pages touched for the first
                    // time): counted like any other tick in p50/p99, and apart.
                    samples.saturating_record(ns);
                    if round == 0 {
                        first.saturating_record(ns);
                    } else {
                        warm.saturating_record(ns);
                    }
                    admitted = out.len();
                }
            }
            let us = |ns: u64| ns as f64 / 1e3;
            let q = |p: f64| us(samples.value_at_quantile(p));
            if (workers, waiting) == (64, 4096) {
                at64.push((name.clone(), q(0.99)));
            }

            println!(
                "{:<26} {:>4} {:>8} {:>9.1} {:>9.1} {:>12.1} {:>9.1} {:>12.1} {:>9}",
                name,
                workers,
                waiting,
                q(0.5),
                q(0.99),
                us(warm.value_at_quantile(0.99)),
                us(samples.max()),
                us(first.value_at_quantile(0.5)),
                admitted
            );
        }
    }
    let p99 = |name: &str| at64.iter().find(|(n, _)| n == name).map(|r| r.1);
    let ratio = |brh: &str, br0: &str| match (p99(brh), p99(br0)) {
        (Some(h), Some(z)) => format!("{:.2}x", h / z),
        _ => "-".to_owned(),
    };
    println!(
        "brh/br0 tick p99 ratio at G = 64: {} (cached+learn), {} (cached)",
        ratio("brh cached+learn", "br0 step+finish"),
        ratio("brh cached", "br0")
    );
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

/// One running request (a different one each round) finishes: the policy learns from it, and
/// a new request is reserved on the same worker (σ keeps its size; the new one is predicted
/// at the next tick).
fn finish_one(state: &mut ClusterState, policy: &mut dyn br_core::Policy, round: u64) {
    let n = state.request_count();
    if n == 0 {
        return;
    }
    let Some(done) = state.requests().nth((round as usize * 7_919) % n).cloned() else {
        return;
    };
    let Ok(done) = state.remove(done.key) else {
        return;
    };
    policy.observe_finished(&Finished {
        prompt_tokens: done.prompt_tokens,
        prompt_hash: done.prompt_hash,
        output_tokens: done.generated.max(1),
        expected_output: None,
        class: None,
    });
    let _ = state.reserve(RequestInfo {
        key: 1_000_000_000 + round,
        generated: 0,
        phase: Phase::Queued,
        prompt_tokens: 700 + (round as u32 * 4_099) % 7_300,
        prompt_hash: Some(round % 5_000),
        ..done
    });
}
