//! p50 / p99 of one dispatcher tick (criterion reports means and medians; the budget in
//! docs/benchmarks.md is stated as percentiles, like the paper's 1.2 ms p50 / 2.8 ms p99).
//! Run: `cargo run --release -p br-core --example tick_percentiles`.

use std::time::Instant;

use br_core::bench_support::steady_state;
use br_core::dispatch::{Stage2Fill, Stage2Window};
use br_core::policy::PredictorKind;
use br_core::{PolicyConfig, PolicyKind, build_policy};
use hdrhistogram::Histogram;

fn main() {
    println!(
        "{:<14} {:>4} {:>8} {:>10} {:>10} {:>10} {:>9}",
        "policy", "G", "waiting", "p50_us", "p99_us", "max_us", "admitted"
    );
    for (workers, waiting) in [(8u32, 256usize), (64, 4096), (128, 8192)] {
        // BR-0 also with the paper's Stage 2 (the R_max oldest, filled to the max), the
        // previous default, to show what the tick-head window and the mean fill cost
        let mut paper = PolicyConfig::new(PolicyKind::Br0);
        paper.dispatcher.stage2_window = Stage2Window::Oldest;
        paper.dispatcher.stage2_fill = Stage2Fill::Max;
        for (label, cfg) in [
            ("br0", PolicyConfig::new(PolicyKind::Br0)),
            ("br0-paper-s2", paper),
            (
                "brh-survival",
                PolicyConfig::new(PolicyKind::BrH(PredictorKind::Survival)),
            ),
            (
                "brh-oracle",
                PolicyConfig::new(PolicyKind::BrH(PredictorKind::Oracle)),
            ),
        ] {
            let kind = cfg.kind;
            // Nanoseconds up to a minute, 3 significant digits (nearest-rank quantiles).
            let mut samples =
                Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("valid bounds");
            let mut admitted = 0;
            // Fresh scenarios (different seeds) so the tick sees varied states.
            for seed in 0..40u64 {
                let (state, pool) = steady_state(workers, 256, waiting, seed);
                let mut policy = build_policy(&cfg).expect("valid config");
                if kind == PolicyKind::BrH(PredictorKind::Survival) {
                    // warm the predictor the way a running service would be
                    for o in 0..20_000u32 {
                        policy.observe_finished(None, 1000 + (o * 7919) % 500);
                    }
                }
                let mut out = Vec::with_capacity(1024);
                for _ in 0..50 {
                    let mut p = pool.clone();
                    out.clear();
                    let t = Instant::now();
                    policy.dispatch(&mut p, &state, &mut out);
                    let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    samples.saturating_record(ns);
                    admitted = out.len();
                }
            }
            let us = |ns: u64| ns as f64 / 1e3;
            let q = |p: f64| us(samples.value_at_quantile(p));
            println!(
                "{:<14} {:>4} {:>8} {:>10.1} {:>10.1} {:>10.1} {:>9}",
                label,
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
