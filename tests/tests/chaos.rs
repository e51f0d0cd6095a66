//! A short seeded chaos run for CI: the replicated stack (one br-snapshot,
//! two br-ingest replicas, two br-decision replicas reached through `FaultProxy`s by
//! br-client's `AssignClient`, four workers spread over the ingest replicas), steady `Assign`
//! load, and one fault at a time from a seeded schedule:
//!
//! | kind | what |
//! |---|---|
//! | `decision-kill` | kill -9 a decision replica, restart it on its ports |
//! | `decision-freeze` | freeze every open connection to a decision replica (half-open: no FIN, no RST; the client's keepalive must find it) |
//! | `snapshot-kill` | kill -9 the snapshot service, restart it on its ports (σ is rebuilt from the workers' full states; decision answers stale meanwhile) |
//! | `snapshot-freeze` | SIGSTOP the snapshot service for 1-3 s, then SIGCONT |
//! | `ingest-kill` | kill -9 an ingest replica; its workers' shims reconnect to the other replica (same incarnation, full state), and it is restarted on its ports |
//! | `shim-kill` | a worker's shim dies and restarts: its stream ends without a word, it says Hello again as a new incarnation with its full state (its requests keep running) |
//!
//! Then the invariants: no Assign lost before its deadline, no request id run on two ranks,
//! no reservation left to expire, and σ equal to the workers' ground truth once quiet.
//!
//! `BR_CHAOS_SEED` (default 13) draws the schedule (which kinds in which order, on which
//! replica or worker, after how many calls, how long a freeze lasts): the same seed gives the
//! same schedule. `BR_CHAOS_FAULTS` selects the kinds (comma-separated, default all); each
//! selected kind is injected at least once when there are no more kinds than faults
//! (`BR_CHAOS_COUNT`, default 6). scripts/chaos.sh runs it for minutes with new seeds.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use br_client::assign::{AssignClient, Assignment};
use br_e2e::replicated::{
    Outcome, Ran, ReplicatedStack, START, StackConfig, WorkerEvent, assert_each_request_ran_once,
    drive_workers, metric_sum,
};
use br_testkit::{FaultProxy, within};
use tokio::sync::{mpsc, oneshot};

const GROUP: &str = "chaos";
/// A hang guard on a loaded 2-core machine, not a timing assertion.
const LONG: Duration = Duration::from_secs(120);
/// Every Assign's deadline: a call not answered by then is lost.
const DEADLINE: Duration = Duration::from_secs(30);
const WORKERS: u32 = 4;
const CAPACITY: u32 = 3;
const REQUESTS: usize = 350;
const HOLD_TICKS: u32 = 4;
const DEFAULT_FAULTS: usize = 6;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    DecisionKill,
    DecisionFreeze,
    SnapshotKill,
    SnapshotFreeze,
    IngestKill,
    ShimKill,
}

const KINDS: [(&str, Fault); 6] = [
    ("decision-kill", Fault::DecisionKill),
    ("decision-freeze", Fault::DecisionFreeze),
    ("snapshot-kill", Fault::SnapshotKill),
    ("snapshot-freeze", Fault::SnapshotFreeze),
    ("ingest-kill", Fault::IngestKill),
    ("shim-kill", Fault::ShimKill),
];

fn fault_kinds() -> Vec<Fault> {
    let Ok(spec) = std::env::var("BR_CHAOS_FAULTS") else {
        return KINDS.iter().map(|k| k.1).collect();
    };
    spec.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            KINDS
                .iter()
                .find(|k| k.0 == s)
                .unwrap_or_else(|| {
                    panic!("unknown fault kind {s:?}; known: {:?}", KINDS.map(|k| k.0))
                })
                .1
        })
        .collect()
}

/// SplitMix64: a seeded, dependency-free generator (the run is reproducible by its seed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One planned fault: before call `at`, `kind` on replica or worker `target`, frozen for
/// `pause` where it freezes.
#[derive(Debug, Clone, Copy)]
struct Planned {
    at: usize,
    kind: Fault,
    target: usize,
    pause: Duration,
}

/// The whole schedule, from the seed alone: the kinds in a seeded order (each selected kind
/// once before any repeats), spaced evenly with a seeded jitter.
fn schedule(seed: u64, kinds: &[Fault], count: usize) -> Vec<Planned> {
    let mut rng = Rng(seed);
    let mut order = kinds.to_vec();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let every = REQUESTS / (count + 1);
    (0..count)
        .map(|k| {
            let kind = order[k % order.len()];
            let target = match kind {
                Fault::ShimKill => rng.below(u64::from(WORKERS)) as usize,
                _ => rng.below(2) as usize,
            };
            Planned {
                at: every * (k + 1) + rng.below(every as u64 / 2) as usize,
                kind,
                target,
                pause: Duration::from_millis(1000 + rng.below(2000)),
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_faults_under_load_keep_the_invariants() {
    let seed: u64 = std::env::var("BR_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(13);
    let count: usize = std::env::var("BR_CHAOS_COUNT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_FAULTS);
    let kinds = fault_kinds();
    assert!(!kinds.is_empty(), "BR_CHAOS_FAULTS selects no fault");
    assert!((1..REQUESTS / 4).contains(&count), "BR_CHAOS_COUNT {count}");
    let plan = schedule(seed, &kinds, count);
    eprintln!("chaos: seed {seed}, faults {kinds:?}, schedule {plan:?}");

    // two ingest replicas (a worker's stream moves between them), and a longer grace and TTL
    // than the failover tests' for faults that stack
    let (mut stack, workers) = ReplicatedStack::start(&StackConfig {
        ingests: 2,
        snapshot_args: StackConfig::snapshot_timing("3s", "20s"),
        ..StackConfig::two_br0_deciders(GROUP, WORKERS, CAPACITY)
    })
    .await;
    let mut proxies = Vec::new();
    for d in &stack.deciders {
        proxies.push(FaultProxy::start(d.grpc_addr()).await);
    }
    let client =
        AssignClient::connect_lazy_many(proxies.iter().map(FaultProxy::url), None).unwrap();
    // Which ingest replica each worker's shim is connected to.
    let mut carrier: Vec<usize> = (0..WORKERS as usize).map(|w| w % 2).collect();

    let (answers_tx, answers_rx) = mpsc::channel(REQUESTS);
    let (events, events_rx) = mpsc::channel(16);
    let ran: Ran = Arc::default();
    let driver = tokio::spawn(drive_workers(
        workers,
        answers_rx,
        events_rx,
        ran.clone(),
        HOLD_TICKS,
    ));
    let mut calls = tokio::task::JoinSet::new();
    let mut pace = tokio::time::interval(Duration::from_millis(15));
    let mut next = plan.iter().peekable();
    let mut injected = Vec::new();
    for i in 0..REQUESTS {
        pace.tick().await;
        if let Some(f) = next.next_if(|f| f.at == i) {
            // One fault at a time: what the last one broke is back before the next.
            for d in &stack.deciders {
                d.wait_for("/readyz", START).await;
            }
            for g in &stack.ingests {
                g.wait_for("/readyz", START).await;
            }
            let r = f.target;
            match f.kind {
                Fault::DecisionKill => stack.deciders[r].restart(),
                Fault::DecisionFreeze => proxies[r].freeze(),
                Fault::SnapshotKill => stack.snapshot.restart(),
                Fault::SnapshotFreeze => stack.snapshot.freeze_for(f.pause),
                Fault::IngestKill => {
                    stack.ingests[r].kill();
                    // Their shims fail over to the other replica (the same incarnation).
                    let moved = reconnect(&events, &mut carrier, &stack, |c| c == r, 1 - r).await;
                    stack.ingests[r].restart();
                    eprintln!("chaos: ingest {r} killed; workers {moved:?} moved over");
                }
                Fault::ShimKill => {
                    restart_shim(&events, r, &stack.ingests[carrier[r]].grpc_url()).await;
                }
            }
            injected.push((i, f.kind, r));
            eprintln!("chaos: after {i} calls, {:?} on {r}", f.kind);
        }
        let prompt = 200 + (i as u32 * 53) % 900;
        calls.spawn(Outcome::call(
            client.clone(),
            GROUP,
            format!("c-{i}"),
            prompt,
            DEADLINE,
            answers_tx.clone(),
        ));
    }
    drop(answers_tx);
    let mut outcomes = Vec::new();
    while let Some(o) = within(LONG, "every Assign ends", calls.join_next()).await {
        outcomes.push(o.unwrap());
    }
    drop(events);
    let mut workers = within(LONG, "the workers finish everything", driver)
        .await
        .unwrap();

    assert_each_request_ran_once(&outcomes, &ran, REQUESTS, &format!("seed {seed}"));
    let retried = outcomes
        .iter()
        .filter(|o| o.result.as_ref().is_ok_and(|a: &Assignment| a.attempts > 1))
        .count();
    let stale = outcomes
        .iter()
        .filter(|o| o.result.as_ref().is_ok_and(|a: &Assignment| a.stale))
        .count();
    let slowest = outcomes.iter().map(|o| o.answered - o.issued).max();
    eprintln!(
        "chaos: seed {seed}, faults {injected:?}: {REQUESTS} answered, {retried} after a retry, \
         {stale} stale, slowest {slowest:?}"
    );
    assert_eq!(injected.len(), plan.len(), "every fault was injected");

    // Quiet: the workers hold nothing and σ agrees (after a snapshot restart, σ was rebuilt
    // from the workers' full states).
    for g in &stack.ingests {
        g.wait_for("/readyz", START).await;
    }
    stack
        .wait_quiet(&mut workers, Duration::from_secs(30))
        .await;
    assert_eq!(
        metric_sum(
            &stack.snapshot,
            "balanceroute_snapshot_reservations_expired_total"
        )
        .await,
        0.0,
        "seed {seed}: no reservation was left behind (since the snapshot service's last start)"
    );
}

/// Moves every worker whose carrier matches `from` to ingest replica `to`, as its shim would
/// (the same incarnation, a full state), and waits until each is accepted. Returns them.
async fn reconnect(
    events: &mpsc::Sender<WorkerEvent>,
    carrier: &mut [usize],
    stack: &ReplicatedStack,
    from: impl Fn(usize) -> bool,
    to: usize,
) -> Vec<u32> {
    let mut moved = Vec::new();
    let mut acks = Vec::new();
    for (w, c) in carrier.iter_mut().enumerate() {
        if from(*c) {
            let (done, accepted) = oneshot::channel();
            events
                .send(WorkerEvent::Reconnect {
                    worker: w as u32,
                    ingest: stack.ingests[to].grpc_url(),
                    restarted: false,
                    done,
                })
                .await
                .unwrap();
            *c = to;
            moved.push(w as u32);
            acks.push(accepted);
        }
    }
    for a in acks {
        within(LONG, "a worker reconnected", a).await.unwrap();
    }
    moved
}

/// A worker's shim restarts: the stream ends and a new incarnation says Hello to `ingest`.
async fn restart_shim(events: &mpsc::Sender<WorkerEvent>, worker: usize, ingest: &str) {
    let (done, accepted) = oneshot::channel();
    events
        .send(WorkerEvent::Reconnect {
            worker: worker as u32,
            ingest: ingest.to_owned(),
            restarted: true,
            done,
        })
        .await
        .unwrap();
    within(LONG, "the restarted shim accepted", accepted)
        .await
        .unwrap();
}
