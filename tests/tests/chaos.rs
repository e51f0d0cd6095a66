//! A short seeded chaos run for CI (issue 13, "Also"): two br-decision replicas behind
//! br-client's `AssignClient`, each reached through a `FaultProxy`, steady `Assign` load, and
//! one fault at a time drawn from a seeded generator: kill -9 a decision replica and restart it
//! on its ports, or freeze every open connection to one (half-open: no FIN, no RST; the
//! client's keepalive must find it). Then the invariants: no Assign lost before its deadline,
//! no request id run on two ranks, no reservation left to expire, and σ equal to the workers'
//! ground truth once quiet.
//!
//! `BR_CHAOS_SEED` (default 13) picks the faults; `BR_CHAOS_FAULTS` selects kinds
//! (comma-separated, default `decision-kill,decision-freeze`). Not injected here yet, though
//! their fixes are on main: `snapshot-kill`, `ingest-kill` (see scripts/chaos.sh).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use br_client::assign::{AssignClient, AssignParams, Assignment};
use br_e2e::{FakeWorker, Service};
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::{self, GetRequest};
use br_testkit::{FaultProxy, eventually, within};
use tokio::sync::mpsc;

const GROUP: &str = "chaos";
const START: Duration = Duration::from_secs(60);
/// A hang guard on a loaded 2-core machine, not a timing assertion.
const LONG: Duration = Duration::from_secs(120);
/// Every Assign's deadline: a call not answered by then is lost.
const DEADLINE: Duration = Duration::from_secs(30);
const WORKERS: u32 = 4;
const CAPACITY: u32 = 3;
const REQUESTS: usize = 300;
const HOLD_TICKS: u32 = 4;
const FAULTS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    DecisionKill,
    DecisionFreeze,
}

fn fault_kinds() -> Vec<Fault> {
    let spec =
        std::env::var("BR_CHAOS_FAULTS").unwrap_or_else(|_| "decision-kill,decision-freeze".into());
    spec.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| match s {
            "decision-kill" => Fault::DecisionKill,
            "decision-freeze" => Fault::DecisionFreeze,
            "snapshot-kill" | "ingest-kill" | "shim-kill" => panic!(
                "fault {s:?} is pending (this test does not inject it yet); \
                 scripts/chaos.sh lists it"
            ),
            other => panic!("unknown fault kind {other:?}"),
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

async fn sigma(snapshot: &Service) -> Option<v1::ClusterSnapshot> {
    let mut c = SnapshotClient::connect(snapshot.grpc_url()).await.ok()?;
    c.get(GetRequest {
        group: GROUP.into(),
    })
    .await
    .ok()
    .map(|r| r.into_inner())
}

async fn metric_sum(service: &Service, name: &str) -> f64 {
    br_testkit::http::metrics_url(&service.admin_url("/metrics"))
        .await
        .sum(name)
}

/// What the gateway saw for one request.
#[derive(Debug)]
struct Outcome {
    id: String,
    issued: Instant,
    answered: Instant,
    result: Result<Assignment, String>,
}

/// The workers' side: starts every answered request on its rank, steps and finishes them, and
/// records which rank ran which id (the ground truth against double assignment).
async fn drive_workers(
    mut workers: Vec<FakeWorker>,
    mut answers: mpsc::Receiver<(String, u32, u32)>,
    ran: Arc<Mutex<HashMap<String, Vec<u32>>>>,
) -> Vec<FakeWorker> {
    let mut running: BTreeMap<u32, Vec<(String, u32)>> = BTreeMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(25));
    let mut open = true;
    loop {
        tokio::select! {
            a = answers.recv(), if open => match a {
                Some((id, worker, prompt)) => {
                    ran.lock().unwrap().entry(id.clone()).or_default().push(worker);
                    workers[worker as usize].start(&id, prompt).await;
                    running.entry(worker).or_default().push((id, 0));
                }
                None => open = false,
            },
            _ = tick.tick() => {
                for w in workers.iter_mut() {
                    let list = running.entry(w.worker_id).or_default();
                    if list.is_empty() {
                        continue;
                    }
                    w.step(5).await;
                    for r in list.iter_mut() {
                        r.1 += 1;
                    }
                    let done: Vec<String> = list
                        .iter()
                        .filter(|r| r.1 >= HOLD_TICKS)
                        .map(|r| r.0.clone())
                        .collect();
                    list.retain(|r| r.1 < HOLD_TICKS);
                    for id in done {
                        w.finish(&id).await;
                    }
                }
                if !open && running.values().all(Vec::is_empty) {
                    return workers;
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_faults_under_load_keep_the_invariants() {
    let seed: u64 = std::env::var("BR_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(13);
    let kinds = fault_kinds();
    assert!(!kinds.is_empty(), "BR_CHAOS_FAULTS selects no fault");
    let mut rng = Rng(seed);
    eprintln!("chaos: seed {seed}, faults {kinds:?}");

    let snapshot = Service::start(
        "br-snapshot",
        &[
            "--worker-grace",
            "3s",
            "--reservation-ttl",
            "20s",
            "--progress-interval",
            "100ms",
        ],
    );
    snapshot.wait_for("/livez", START).await;
    let snap = snapshot.grpc_url();
    let ingest = Service::start("br-ingest", &["--snapshot-addr", &snap]);
    let decision_args = [
        "--snapshot-addr",
        &snap,
        "--policy",
        "br0",
        "--groups",
        GROUP,
    ];
    let mut deciders = vec![
        Service::start("br-decision", &decision_args),
        Service::start("br-decision", &decision_args),
    ];
    ingest.wait_for("/readyz", START).await;
    let mut workers = Vec::new();
    for id in 0..WORKERS {
        workers.push(FakeWorker::connect(&ingest.grpc_url(), GROUP, id, CAPACITY).await);
    }
    for d in &deciders {
        d.wait_for("/readyz", START).await;
    }
    let mut proxies = Vec::new();
    for d in &deciders {
        let upstream = format!("127.0.0.1:{}", d.grpc_port).parse().unwrap();
        proxies.push(FaultProxy::start(upstream).await);
    }
    let client =
        AssignClient::connect_lazy_many(proxies.iter().map(FaultProxy::url), None).unwrap();

    let (answers_tx, answers_rx) = mpsc::channel(REQUESTS);
    let ran: Arc<Mutex<HashMap<String, Vec<u32>>>> = Arc::default();
    let driver = tokio::spawn(drive_workers(workers, answers_rx, ran.clone()));
    let mut calls = tokio::task::JoinSet::new();
    let mut pace = tokio::time::interval(Duration::from_millis(15));
    let every = REQUESTS / (FAULTS + 1);
    let mut log = Vec::new();
    for i in 0..REQUESTS {
        pace.tick().await;
        if i > 0 && i % every == 0 && log.len() < FAULTS {
            // One fault at a time: the other replica is ready before this one is hit.
            let r = rng.below(2) as usize;
            let kind = kinds[rng.below(kinds.len() as u64) as usize];
            deciders[1 - r].wait_for("/readyz", START).await;
            match kind {
                Fault::DecisionKill => {
                    deciders[r].kill();
                    deciders[r].restart();
                }
                Fault::DecisionFreeze => proxies[r].freeze(),
            }
            log.push((i, r, kind));
            eprintln!("chaos: after {i} calls, {kind:?} on replica {r}");
        }
        let (client, tx) = (client.clone(), answers_tx.clone());
        calls.spawn(async move {
            let id = format!("c-{i}");
            let prompt = 200 + (i as u32 * 53) % 900;
            let issued = Instant::now();
            let result = client
                .assign_within(&AssignParams::new(GROUP, &id, prompt), DEADLINE)
                .await
                .map_err(|e| e.to_string());
            if let Ok(a) = &result {
                tx.send((id.clone(), a.worker_id, prompt)).await.unwrap();
            }
            Outcome {
                id,
                issued,
                answered: Instant::now(),
                result,
            }
        });
    }
    drop(answers_tx);
    let mut outcomes = Vec::new();
    while let Some(o) = within(LONG, "every Assign ends", calls.join_next()).await {
        outcomes.push(o.unwrap());
    }
    let workers = within(LONG, "the workers finish everything", driver)
        .await
        .unwrap();

    let lost: Vec<_> = outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().err().map(|e| (&o.id, e)))
        .collect();
    assert!(
        lost.is_empty(),
        "seed {seed}: {} of {REQUESTS} lost: {lost:?}",
        lost.len()
    );
    let ran = ran.lock().unwrap().clone();
    assert_eq!(ran.len(), REQUESTS, "every request ran");
    let doubles: Vec<_> = ran.iter().filter(|(_, ws)| ws.len() != 1).collect();
    assert!(
        doubles.is_empty(),
        "seed {seed}: ids run on two ranks: {doubles:?}"
    );
    let retried = outcomes
        .iter()
        .filter(|o| o.result.as_ref().is_ok_and(|a: &Assignment| a.attempts > 1))
        .count();
    let slowest = outcomes.iter().map(|o| o.answered - o.issued).max();
    eprintln!(
        "chaos: seed {seed}, faults {log:?}: {REQUESTS} answered, {retried} after a retry, slowest {slowest:?}"
    );
    assert_eq!(log.len(), FAULTS, "every fault was injected");

    eventually(
        Duration::from_secs(30),
        "σ empty like the workers",
        || async {
            workers.iter().all(|w| w.running.lock().unwrap().is_empty())
                && sigma(&snapshot).await.is_some_and(|s| {
                    s.requests.is_empty() && s.workers.iter().all(|w| w.load_tokens == 0)
                })
        },
    )
    .await;
    assert_eq!(
        metric_sum(
            &snapshot,
            "balanceroute_snapshot_reservations_expired_total"
        )
        .await,
        0.0,
        "seed {seed}: no reservation was left behind"
    );
}
