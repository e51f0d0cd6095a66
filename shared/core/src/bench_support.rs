//! Deterministic steady-state scenarios for the dispatcher benchmarks (benches/, examples/).
//! Public so the benchmark and the percentile printer build identical inputs; not part of the
//! routing API.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::{ClusterState, Phase, Pool, PoolEntry, RequestInfo};

/// A group of `workers` ranks with `slots` each, nearly full of running requests (a few free
/// slots per worker, as in steady state under heavy load), and `waiting` requests in the pool.
/// Prompt sizes follow the paper's Azure shape (700..8000 tokens), outputs ~1000..1500.
pub fn steady_state(workers: u32, slots: u32, waiting: usize, seed: u64) -> (ClusterState, Pool) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut st = ClusterState::with_workers(&vec![slots; workers as usize]);
    let mut key = 0u64;
    let free: Vec<u32> = (0..workers)
        .map(|_| rng.random_range(0..=8u32).min(slots))
        .collect();
    // Filled a request per worker at a time, as arrivals spread over the workers fill a live
    // σ: each worker's requests sit apart in σ's slots, not side by side.
    for i in 0..slots {
        for w in (0..workers).filter(|&w| i < slots - free[w as usize]) {
            key += 1;
            let output = rng.random_range(1000..1500);
            let _ = st.reserve(RequestInfo {
                key,
                worker: w,
                prompt_tokens: rng.random_range(700..8000),
                generated: rng.random_range(0..output),
                phase: Phase::Running,
                prompt_hash: Some(rng.random_range(0..5000)),
                oracle_output: Some(output),
                expected_output: None,
                class: None,
            });
        }
    }
    let mut pool = Pool::new();
    for _ in 0..waiting {
        key += 1;
        let _ = pool.push(PoolEntry {
            key,
            prompt_tokens: rng.random_range(700..8000),
            prompt_hash: Some(rng.random_range(0..5000)),
            oracle_output: Some(rng.random_range(1000..1500)),
            expected_output: None,
            class: None,
        });
    }
    (st, pool)
}
