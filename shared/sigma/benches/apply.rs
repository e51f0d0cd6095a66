//! Cost of one progress report applied to σ, the call every telemetry event makes on the
//! snapshot writer and on every decision replica: the lookup of the request by its id in σ's
//! table, then the routing core's slot. σ as a busy group holds it: G = 64 ranks × 256
//! requests after two rounds of churn, and reports arrive in an order unrelated to arrival.
//! Two shapes of id: 37 bytes (`cmpl-` and a UUID's 32 hex digits, as vLLM names a
//! completion), kept inline in σ's table, and 73 bytes (a gateway's longer id), kept behind a
//! pointer. Run: `cargo bench -p br-sigma --bench apply`.

use br_proto::v1;
use br_sigma::{Sigma, change};
use criterion::{Criterion, criterion_group, criterion_main};
use rand::seq::SliceRandom as _;
use rand::{Rng as _, SeedableRng as _};

const WORKERS: u32 = 64;
const PER_WORKER: u32 = 256;

fn id(prefix: &str, digits: usize, rng: &mut rand::rngs::StdRng) -> String {
    let hex: String = (0..digits)
        .map(|_| char::from_digit(rng.random_range(0..16), 16).expect("a hex digit"))
        .collect();
    format!("{prefix}{hex}")
}

/// σ of a busy group, and one progress report per request it holds, shuffled.
fn busy_group(prefix: &str, digits: usize, seed: u64) -> (Sigma, Vec<v1::Change>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut sigma = Sigma::with_epoch("g", 1);
    let mut b = sigma.batch();
    for w in 0..WORKERS {
        b.apply(change::worker_up(
            w,
            1,
            PER_WORKER,
            &format!("10.0.0.{w}:8000"),
        ))
        .expect("a new worker");
    }
    let total = (WORKERS * PER_WORKER) as usize;
    let mut held: Vec<(String, u32, u32)> = Vec::new();
    let mut on_worker = vec![0u32; WORKERS as usize];
    for round in 0..total * 3 {
        if round >= total {
            let i = rng.random_range(0..held.len());
            let (gone, w, _) = held.swap_remove(i);
            on_worker[w as usize] -= 1;
            b.apply(change::request_finished(&gone, 10)).expect("held");
        }
        let first = rng.random_range(0..WORKERS);
        let worker = (0..WORKERS)
            .map(|i| (first + i) % WORKERS)
            .find(|&w| on_worker[w as usize] < PER_WORKER)
            .expect("one request fewer than the group holds leaves room");
        let rid = id(prefix, digits, &mut rng);
        let prompt = rng.random_range(700..8000);
        b.apply(change::request_progress(&rid, worker, 1, prompt, 1))
            .expect("room");
        on_worker[worker as usize] += 1;
        held.push((rid, worker, prompt));
    }
    let _ = b.commit();
    held.shuffle(&mut rng);
    let reports = held
        .iter()
        .map(|(rid, w, prompt)| change::request_progress(rid, *w, 1, *prompt, 2))
        .collect();
    (sigma, reports)
}

fn apply(c: &mut Criterion) {
    let mut group = c.benchmark_group("progress_report");
    for (name, prefix, digits) in [
        ("37-byte ids", "cmpl-", 32),
        ("73-byte ids", "chatcmpl-", 64),
    ] {
        let (sigma, mut reports) = busy_group(prefix, digits, 7);
        group.throughput(criterion::Throughput::Elements(reports.len() as u64));
        group.bench_function(name, |b| {
            let mut s = sigma.clone();
            let mut generated = 2;
            b.iter(|| {
                generated += 1;
                for r in &mut reports {
                    if let Some(v1::change::Kind::RequestProgress(p)) = &mut r.kind {
                        p.generated_tokens = generated;
                    }
                    s.apply_change(r).expect("held");
                }
            });
        });
    }
    group.finish();
}

criterion_group!(benches, apply);
criterion_main!(benches);
