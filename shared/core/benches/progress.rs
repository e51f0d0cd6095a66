//! Cost of one progress report in the routing core, the call every telemetry event makes on
//! the snapshot writer and on every decision replica: `set_generated` (the key → slot lookup,
//! then the slot) against `set_generated_in` (the slot σ remembers, checked against its key).
//! σ as a busy group holds it: G = 64 ranks × 256 requests, their slots shuffled by churn, and
//! reports arrive in an order unrelated to the slots. Run: `cargo bench -p br-core --bench
//! progress`.

use br_core::{ClusterState, Phase, RequestInfo, RequestKey};
use criterion::{Criterion, criterion_group, criterion_main};
use rand::seq::SliceRandom as _;
use rand::{Rng as _, SeedableRng as _};

const WORKERS: u32 = 64;
const PER_WORKER: u32 = 256;

/// The state, and (key, slot) of every request in the order reports arrive.
fn busy_group(seed: u64) -> (ClusterState, Vec<(RequestKey, u32)>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut state = ClusterState::with_workers(&vec![PER_WORKER; WORKERS as usize]);
    let mut held: Vec<RequestKey> = Vec::new();
    // Fill, then churn: finish a random request and admit a new one, so that keys and slots
    // no longer line up, as after a while of real traffic.
    let total = (WORKERS * PER_WORKER) as usize;
    for (round, key) in (0..total * 3).zip(1 as RequestKey..) {
        if round >= total {
            let i = rng.random_range(0..held.len());
            state.remove(held.swap_remove(i)).expect("held");
        }
        let first = rng.random_range(0..WORKERS);
        let worker = (0..WORKERS)
            .map(|i| (first + i) % WORKERS)
            .find(|&w| state.worker(w).is_some_and(|w| w.requests() < PER_WORKER))
            .expect("one request fewer than the group holds leaves room");
        state
            .reserve(RequestInfo {
                key,
                worker,
                prompt_tokens: rng.random_range(700..8000),
                generated: 0,
                phase: Phase::Running,
                prompt_hash: None,
                oracle_output: None,
                expected_output: None,
                class: None,
            })
            .expect("room");
        held.push(key);
    }
    let mut reports: Vec<(RequestKey, u32)> = held
        .iter()
        .map(|&k| (k, state.slot_of(k).expect("held")))
        .collect();
    reports.shuffle(&mut rng);
    (state, reports)
}

fn progress(c: &mut Criterion) {
    let mut group = c.benchmark_group("progress_report");
    let (state, reports) = busy_group(7);
    group.throughput(criterion::Throughput::Elements(reports.len() as u64));
    group.bench_function("set_generated (key lookup)", |b| {
        let mut s = state.clone();
        let mut generated = 0;
        b.iter(|| {
            generated += 1;
            for &(key, _) in &reports {
                s.set_generated(key, generated).expect("held");
            }
        });
    });
    group.bench_function("set_generated_in (slot kept)", |b| {
        let mut s = state.clone();
        let mut generated = 0;
        b.iter(|| {
            generated += 1;
            for &(key, slot) in &reports {
                s.set_generated_in(slot, key, generated).expect("held");
            }
        });
    });
    group.finish();
}

criterion_group!(benches, progress);
criterion_main!(benches);
