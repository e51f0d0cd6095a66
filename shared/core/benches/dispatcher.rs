//! Dispatcher tick cost: one batch admission in steady state (a few free slots per worker, a
//! full pool), at the paper's setting (G = 8, R_max = 4, 256 waiting), at G = 64 with 4,096
//! waiting, and at wide-EP scale (G = 128, 8,192 waiting; the tick budget is 1 ms at p99,
//! measured by `examples/tick_percentiles.rs`). Run: `cargo bench -p br-core --bench dispatcher`.
//!
//! `br0-request-term` is BR-0 with the F-score's request term (κ = 1,250 tokens per request).
//! BR-H is measured twice: through the policy (its prediction cache is warm after the first
//! iteration, as between ticks on an unchanged σ) and `uncached` (`Margins::horizon` +
//! `dispatch_tick`: every running request predicted each tick, as before the cache).

use br_core::bench_support::steady_state;
use br_core::dispatch::dispatch_tick;
use br_core::predict::Oracle;
use br_core::score::Margins;
use br_core::{PolicyConfig, PolicyKind, build_policy};
use criterion::{BatchSize, Criterion, criterion_group, criterion_main};

fn tick(c: &mut Criterion) {
    let mut group = c.benchmark_group("dispatcher_tick");
    for (workers, waiting) in [(8u32, 256usize), (64, 4096), (128, 8192)] {
        let (state, pool) = steady_state(workers, 256, waiting, 42);
        for kind in [
            PolicyKind::Br0,
            PolicyKind::BrH(br_core::PredictorKind::Oracle),
        ] {
            let cfg = PolicyConfig::new(kind);
            group.bench_function(
                format!("{}/G{workers}/waiting{waiting}", kind.name()),
                |b| {
                    let mut policy = build_policy(&cfg).expect("valid config");
                    let mut out = Vec::with_capacity(1024);
                    b.iter_batched(
                        || pool.clone(),
                        |mut p| {
                            out.clear();
                            policy.dispatch(&mut p, &state, &mut out);
                            out.len()
                        },
                        BatchSize::SmallInput,
                    );
                },
            );
        }
        // the F-score's request term (a step model with c ≠ 0): κ = c/a = 1,250 tokens, i.e.
        // c = 0.25 ms per request at a = 2e-4 ms per token
        let mut cfg = PolicyConfig::new(PolicyKind::Br0);
        cfg.horizon.request_cost_tokens = 1250.0;
        group.bench_function(
            format!("br0-request-term/G{workers}/waiting{waiting}"),
            |b| {
                let mut policy = build_policy(&cfg).expect("valid config");
                let mut out = Vec::with_capacity(1024);
                b.iter_batched(
                    || pool.clone(),
                    |mut p| {
                        out.clear();
                        policy.dispatch(&mut p, &state, &mut out);
                        out.len()
                    },
                    BatchSize::SmallInput,
                );
            },
        );
        let cfg = PolicyConfig::new(PolicyKind::BrH(br_core::PredictorKind::Oracle));
        group.bench_function(
            format!("brh-oracle-uncached/G{workers}/waiting{waiting}"),
            |b| {
                let mut out = Vec::with_capacity(1024);
                b.iter_batched(
                    || pool.clone(),
                    |mut p| {
                        out.clear();
                        let mut m = Margins::horizon(&state, &cfg.horizon, &Oracle);
                        dispatch_tick(&cfg.dispatcher, &mut p, &state, &mut m, &mut out);
                        out.len()
                    },
                    BatchSize::SmallInput,
                );
            },
        );
    }
    group.finish();
}

criterion_group!(benches, tick);
criterion_main!(benches);
