//! Two br-decision replicas of one group, both taking Assigns: with the rank split
//! (`--deciders 2 --decider-index i`) they no longer collide on free slots, and a replica
//! killed with SIGKILL leaves the other serving every Assign, its ranks included (the
//! takeover). Through a SIGKILL and restart of the snapshot service each replica answers
//! stale on its own ranks only.
//!
//! The gateway alternates its calls between the replicas (each call prefers one and fails over
//! to the other), so both pools hold work and both tick on the same σ. A collision is a
//! reservation the snapshot refuses because another replica filled the rank first
//! (`reserve_failures_total{reason="worker_full"}`). No timing is asserted: latencies and the
//! takeover time are printed (docs/benchmarks.md records them).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use br_client::assign::{AssignClient, Assignment};
use br_e2e::Service;
use br_e2e::replicated::{
    Outcome, Ran, ReplicatedStack, StackConfig, assert_each_request_ran_once, drive_workers,
    metric_sum,
};
use br_testkit::{eventually, within};
use tokio::sync::mpsc;

const GROUP: &str = "split";
/// A hang guard on a loaded 2-core machine, not a timing assertion.
const LONG: Duration = Duration::from_secs(120);
const WORKERS: u32 = 4;
/// Few slots, arrivals faster than they free: both pools hold work, every freed slot is
/// contested.
const CAPACITY: u32 = 2;
const BOTH_ALIVE: usize = 200;
const AFTER_KILL: usize = 80;
const HOLD_TICKS: u32 = 4;

/// The summed `worker_full` refusals and rank split conflicts of `deciders`.
async fn collisions(deciders: &[&Service]) -> (f64, f64) {
    let (mut full, mut conflicts) = (0.0, 0.0);
    for d in deciders {
        let m = br_testkit::http::metrics_url(&d.admin_url("/metrics")).await;
        full += m
            .samples("balanceroute_decision_reserve_failures_total")
            .filter(|s| s.labels.get("reason").map(String::as_str) == Some("worker_full"))
            .map(|s| s.value)
            .sum::<f64>();
        conflicts += m.sum("balanceroute_decision_rank_split_conflicts_total");
    }
    (full, conflicts)
}

/// Issues `ids` (10 ms apart), alternating between the two gateway clients, and waits for
/// every answer.
async fn issue(
    clients: &[AssignClient; 2],
    ids: std::ops::Range<usize>,
    answers: &mpsc::Sender<(String, u32, u32)>,
) -> Vec<Outcome> {
    collect(send(clients, ids, answers).await).await
}

/// Sends `ids` (10 ms apart), alternating between the two gateway clients; the calls run on.
async fn send(
    clients: &[AssignClient; 2],
    ids: std::ops::Range<usize>,
    answers: &mpsc::Sender<(String, u32, u32)>,
) -> tokio::task::JoinSet<Outcome> {
    let mut calls = tokio::task::JoinSet::new();
    let mut pace = tokio::time::interval(Duration::from_millis(10));
    for i in ids {
        pace.tick().await;
        let (client, tx) = (clients[i % 2].clone(), answers.clone());
        calls.spawn(Outcome::assign(client, GROUP, i, LONG, tx));
    }
    calls
}

/// Waits for every call [`send`] started to end.
async fn collect(mut calls: tokio::task::JoinSet<Outcome>) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    while let Some(o) = within(LONG, "every Assign ends", calls.join_next()).await {
        outcomes.push(o.unwrap());
    }
    outcomes
}

/// Waits until `metric` on every replica of `deciders` satisfies `ok`.
async fn on_every_replica(deciders: &[Service], what: &str, metric: &str, ok: fn(f64) -> bool) {
    for d in deciders {
        eventually(LONG, what, || async { ok(metric_sum(d, metric).await) }).await;
    }
}

fn latency_ms(outcomes: &[Outcome], q: f64) -> f64 {
    let mut l: Vec<f64> = outcomes
        .iter()
        .map(|o| (o.answered - o.issued).as_secs_f64() * 1e3)
        .collect();
    l.sort_by(f64::total_cmp);
    // nearest rank
    let rank = ((q * l.len() as f64).ceil() as usize).clamp(1, l.len().max(1));
    l.get(rank - 1).copied().unwrap_or(0.0)
}

struct Run {
    stack: ReplicatedStack,
    clients: [AssignClient; 2],
    answers: mpsc::Sender<(String, u32, u32)>,
    driver: tokio::task::JoinHandle<Vec<br_e2e::FakeWorker>>,
    ran: Ran,
}

async fn start(split_ranks: bool) -> Run {
    let (stack, workers) = ReplicatedStack::start(&StackConfig {
        split_ranks,
        ..StackConfig::two_br0_deciders(GROUP, WORKERS, CAPACITY)
    })
    .await;
    let urls: Vec<String> = stack.deciders.iter().map(Service::grpc_url).collect();
    let clients = [
        AssignClient::connect_lazy_many([urls[0].clone(), urls[1].clone()], None).unwrap(),
        AssignClient::connect_lazy_many([urls[1].clone(), urls[0].clone()], None).unwrap(),
    ];
    let (answers, answers_rx) = mpsc::channel(BOTH_ALIVE + AFTER_KILL);
    let ran: Ran = Arc::default();
    let (events, events_rx) = mpsc::channel(1);
    // no telemetry faults: the workers keep their streams
    std::mem::forget(events);
    let driver = tokio::spawn(drive_workers(
        workers,
        answers_rx,
        events_rx,
        ran.clone(),
        HOLD_TICKS,
    ));
    Run {
        stack,
        clients,
        answers,
        driver,
        ran,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_without_the_split_collide_on_free_slots() {
    let run = start(false).await;
    let outcomes = issue(&run.clients, 0..BOTH_ALIVE, &run.answers).await;
    let deciders: Vec<&Service> = run.stack.deciders.iter().collect();
    let (full, _) = collisions(&deciders).await;
    eprintln!(
        "without the split: {full} collisions, {} answered of {BOTH_ALIVE}, Assign p50 {:.1} ms p99 {:.1} ms",
        outcomes.iter().filter(|o| o.result.is_ok()).count(),
        latency_ms(&outcomes, 0.5),
        latency_ms(&outcomes, 0.99)
    );
    drop(run.answers);
    let _ = within(LONG, "the workers finish everything", run.driver).await;
    assert_each_request_ran_once(&outcomes, &run.ran, BOTH_ALIVE, "without the split");
    assert!(full > 0.0, "two replicas on one σ pick the same free slots");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_splitting_ranks_do_not_collide_and_one_serves_all_after_a_kill() {
    let mut run = start(true).await;
    let mut outcomes = issue(&run.clients, 0..BOTH_ALIVE, &run.answers).await;
    let (full, conflicts) = {
        let deciders: Vec<&Service> = run.stack.deciders.iter().collect();
        collisions(&deciders).await
    };
    eprintln!(
        "with the split: {full} collisions ({conflicts} on own ranks), {} answered of \
         {BOTH_ALIVE}, Assign p50 {:.1} ms p99 {:.1} ms",
        outcomes.iter().filter(|o| o.result.is_ok()).count(),
        latency_ms(&outcomes, 0.5),
        latency_ms(&outcomes, 0.99)
    );
    assert_eq!(conflicts, 0.0, "no replica filled another's rank");
    // takeovers (a rank free for the takeover time) may still race its owner, rarely
    assert!(
        full <= (BOTH_ALIVE / 100) as f64,
        "{full} collisions with the split"
    );

    // Kill replica 0 (it owns ranks 0 and 2): replica 1 must serve every Assign, on every
    // rank, once their free slots pass the takeover time.
    run.stack.deciders[0].kill();
    let kill_at = Instant::now();
    let after = issue(
        &run.clients,
        BOTH_ALIVE..BOTH_ALIVE + AFTER_KILL,
        &run.answers,
    )
    .await;
    let d1 = run.stack.deciders[1].grpc_url();
    assert!(
        after
            .iter()
            .all(|o| o.result.as_ref().is_ok_and(|a| a.replica == d1)),
        "after the kill every call is answered by replica 1"
    );
    let taken_over: Vec<&Outcome> = after
        .iter()
        .filter(|o| o.result.as_ref().is_ok_and(|a| a.worker_id % 2 == 0))
        .collect();
    assert!(
        !taken_over.is_empty(),
        "replica 1 took over the dead replica's ranks"
    );
    eprintln!(
        "after the kill: {} answered of {AFTER_KILL}, {} on the dead replica's ranks, first \
         of those {:?} after the kill; Assign p50 {:.1} ms p99 {:.1} ms",
        after.iter().filter(|o| o.result.is_ok()).count(),
        taken_over.len(),
        taken_over.iter().map(|o| o.answered - kill_at).min(),
        latency_ms(&after, 0.5),
        latency_ms(&after, 0.99)
    );
    outcomes.extend(after);
    drop(run.answers);
    let mut workers = within(LONG, "the workers finish everything", run.driver)
        .await
        .unwrap();
    assert_each_request_ran_once(&outcomes, &run.ran, BOTH_ALIVE + AFTER_KILL, "rank split");
    run.stack
        .wait_quiet(&mut workers, Duration::from_secs(30))
        .await;
}

/// Every answer of `outcomes` that said `stale`, with the replica that gave it.
fn stale_answers(outcomes: &[Outcome]) -> Vec<(&str, &Assignment)> {
    outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().ok().map(|a| (o.id.as_str(), a)))
        .filter(|(_, a)| a.stale)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_replicas_keep_to_their_ranks_through_a_restart_of_the_snapshot_service() {
    // Both replicas answer from their own stale views while the snapshot service is down, so
    // neither may place on the other's ranks then: neither can see the other's placements.
    // (Checked by mutation: with takeovers allowed while stale, replica 1 answered 4 of 17 on
    // replica 0's ranks.) After the restart every request runs once, none is lost, and σ ends
    // as empty as the workers. The takeover clock's wait for a rank's reports after the
    // restart is the unit tests' (`group::tests::split`): here the workers report again within
    // one progress interval, and a mutation that drops that wait passes.
    let mut run = start(true).await;
    let mut outcomes = issue(&run.clients, 0..BOTH_ALIVE / 2, &run.answers).await;
    let urls: Vec<String> = run.stack.deciders.iter().map(Service::grpc_url).collect();

    run.stack.snapshot.kill();
    let sigma_stale = "balanceroute_decision_sigma_stale";
    on_every_replica(&run.stack.deciders, "σ stale", sigma_stale, |v| v == 1.0).await;
    // Calls through the outage: each replica answers its own (alternate) ones, stale.
    let calls = send(&run.clients, BOTH_ALIVE / 2..BOTH_ALIVE, &run.answers).await;
    // Restart once both replicas have answered stale (the outage estimate frees slots).
    let answered_stale = "balanceroute_decision_stale_answers_total";
    on_every_replica(&run.stack.deciders, "stale answers", answered_stale, |v| {
        v >= 1.0
    })
    .await;
    run.stack.snapshot.restart();
    run.stack.snapshot.wait_for("/livez", LONG).await;
    outcomes.extend(collect(calls).await);
    on_every_replica(&run.stack.deciders, "σ fresh again", sigma_stale, |v| {
        v == 0.0
    })
    .await;
    let total = BOTH_ALIVE + AFTER_KILL;
    outcomes.extend(issue(&run.clients, BOTH_ALIVE..total, &run.answers).await);

    let stale = stale_answers(&outcomes);
    let (full, conflicts) = {
        let deciders: Vec<&Service> = run.stack.deciders.iter().collect();
        collisions(&deciders).await
    };
    eprintln!(
        "through the restart: {} stale answers, {full} collisions ({conflicts} on own ranks), \
         Assign p50 {:.1} ms p99 {:.1} ms",
        stale.len(),
        latency_ms(&outcomes, 0.5),
        latency_ms(&outcomes, 0.99)
    );
    assert!(!stale.is_empty(), "no answer during the outage was stale");
    let strays: Vec<_> = stale
        .iter()
        .filter(|(_, a)| {
            let index = urls
                .iter()
                .position(|u| *u == a.replica)
                .expect("a replica");
            a.worker_id % 2 != index as u32
        })
        .map(|(id, a)| (*id, a.worker_id, a.replica.as_str()))
        .collect();
    assert!(
        strays.is_empty(),
        "stale answers on another replica's rank: {strays:?}"
    );
    // Refusals on a replica's own ranks (a takeover racing the owner) stay rare: 4 in one of
    // 24 runs beside a CPU hog, 0 in the others, each request re-pooled, not lost. Replicas
    // that ignored the split would collide about every other call (95-137 in 200 in the test
    // without it).
    assert!(
        conflicts <= (total / 20) as f64,
        "{conflicts} refusals on a replica's own ranks"
    );
    drop(run.answers);
    let mut workers = within(LONG, "the workers finish everything", run.driver)
        .await
        .unwrap();
    assert_each_request_ran_once(&outcomes, &run.ran, total, "snapshot restart");
    run.stack
        .wait_quiet(&mut workers, Duration::from_secs(30))
        .await;
}
