//! Decision has no single point of failure (issue 13, item 5): two br-decision replicas for one
//! group behind br-client's `AssignClient`, steady `Assign` load from a gateway loop, fake
//! workers running what they are given; one replica is killed with SIGKILL mid-load.
//!
//! Invariants (no timing is asserted; the failover time is measured and printed):
//! * no request is lost: every `Assign` is answered with a rank before its deadline, the calls
//!   that were waiting in the killed replica's pool included (the client retries the same
//!   request id on the other replica);
//! * no double assignment: no request id is run by two ranks, each answer names the rank σ
//!   placed the id on, and no reservation is left behind to expire (an id placed twice would
//!   leave one);
//! * once quiet, σ equals the workers' ground truth (everything finished, nothing held).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use br_client::assign::{AssignClient, AssignParams, Assignment};
use br_e2e::{FakeWorker, Service};
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::{self, GetRequest};
use br_testkit::{eventually, within};
use tokio::sync::mpsc;

const GROUP: &str = "failover";
const START: Duration = Duration::from_secs(60);
/// A hang guard on a loaded 2-core machine, not a timing assertion.
const LONG: Duration = Duration::from_secs(120);
const WORKERS: u32 = 4;
/// Small on purpose: arrivals outpace the slots, so calls wait in the pool when the replica
/// carrying them dies.
const CAPACITY: u32 = 2;
const REQUESTS: usize = 240;
/// Each request runs for this many driver ticks.
const HOLD_TICKS: u32 = 4;

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
async fn killing_a_decision_replica_under_load_loses_no_request() {
    let snapshot = Service::start(
        "br-snapshot",
        &[
            "--worker-grace",
            "2s",
            "--reservation-ttl",
            "10s",
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
    let mut d0 = Service::start("br-decision", &decision_args);
    let d1 = Service::start("br-decision", &decision_args);
    ingest.wait_for("/readyz", START).await;

    let mut workers = Vec::new();
    for id in 0..WORKERS {
        workers.push(FakeWorker::connect(&ingest.grpc_url(), GROUP, id, CAPACITY).await);
    }
    eventually(
        Duration::from_secs(20),
        "every worker LIVE in σ",
        || async {
            sigma(&snapshot).await.is_some_and(|s| {
                s.workers
                    .iter()
                    .filter(|w| w.liveness == v1::Liveness::Live as i32)
                    .count()
                    == WORKERS as usize
            })
        },
    )
    .await;
    d0.wait_for("/readyz", START).await;
    d1.wait_for("/readyz", START).await;

    // The gateway: both replicas, default selection (the first healthy one), so every call
    // waits in d0's pool until d0 dies: the worst case for a failover.
    let client = AssignClient::connect_lazy_many([d0.grpc_url(), d1.grpc_url()], None).unwrap();
    let (answers_tx, answers_rx) = mpsc::channel(REQUESTS);
    let ran: Arc<Mutex<HashMap<String, Vec<u32>>>> = Arc::default();
    let driver = tokio::spawn(drive_workers(workers, answers_rx, ran.clone()));
    let answered = Arc::new(Mutex::new(0usize));
    let mut calls = tokio::task::JoinSet::new();
    let mut kill_at = None;
    let mut pace = tokio::time::interval(Duration::from_millis(10));
    for i in 0..REQUESTS {
        pace.tick().await;
        if i == REQUESTS / 3 {
            // Kill the replica carrying the load once calls are waiting in its pool.
            eventually(
                Duration::from_secs(30),
                "calls waiting in d0's pool",
                || async { metric_sum(&d0, "balanceroute_decision_pool_size").await >= 2.0 },
            )
            .await;
            d0.kill();
            kill_at = Some(Instant::now());
            eprintln!("killed d0 (SIGKILL) after {i} calls issued");
        }
        let (client, tx, answered) = (client.clone(), answers_tx.clone(), answered.clone());
        calls.spawn(async move {
            let id = format!("req-{i}");
            let prompt = 300 + (i as u32 * 37) % 700;
            let issued = Instant::now();
            let result = client
                .assign_within(&AssignParams::new(GROUP, &id, prompt), LONG)
                .await
                .map_err(|e| e.to_string());
            let answered_at = Instant::now();
            if let Ok(a) = &result {
                *answered.lock().unwrap() += 1;
                tx.send((id.clone(), a.worker_id, prompt)).await.unwrap();
            }
            Outcome {
                id,
                issued,
                answered: answered_at,
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
    let kill_at = kill_at.expect("d0 was killed");

    // 0 lost.
    let lost: Vec<_> = outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().err().map(|e| (&o.id, e)))
        .collect();
    assert!(
        lost.is_empty(),
        "{} of {REQUESTS} lost: {lost:?}",
        lost.len()
    );

    // 0 double assignments: one rank per id, by the workers' own record.
    let ran = ran.lock().unwrap().clone();
    assert_eq!(ran.len(), REQUESTS, "every request ran");
    let doubles: Vec<_> = ran.iter().filter(|(_, ws)| ws.len() != 1).collect();
    assert!(doubles.is_empty(), "ids run on two ranks: {doubles:?}");

    // The failover, measured: calls in flight at the kill that needed another replica, and
    // how long after the kill the first and the last of them was answered.
    let d1_url = d1.grpc_url();
    let moved: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.issued < kill_at && o.answered >= kill_at)
        .collect();
    let failed_over = moved
        .iter()
        .filter(|o| o.result.as_ref().is_ok_and(|a| a.attempts > 1))
        .count();
    assert!(
        outcomes
            .iter()
            .filter(|o| o.issued >= kill_at)
            .all(|o| o.result.as_ref().is_ok_and(|a| a.replica == d1_url)),
        "after the kill every call is answered by d1"
    );
    let first = outcomes
        .iter()
        .filter(|o| o.answered >= kill_at)
        .map(|o| o.answered - kill_at)
        .min();
    let last_moved = moved.iter().map(|o| o.answered - kill_at).max();
    eprintln!(
        "failover: {} calls in flight at the kill ({} retried on d1 with the same id); first \
         answer after the kill {:?}, last of those in flight {:?}; attempts max {}",
        moved.len(),
        failed_over,
        first,
        last_moved,
        outcomes
            .iter()
            .filter_map(|o| o.result.as_ref().ok().map(|a| a.attempts))
            .max()
            .unwrap_or(0)
    );
    assert!(
        failed_over > 0,
        "calls were waiting in d0 when it died and moved to d1"
    );

    // Quiet: σ equals the ground truth (nothing running, nothing reserved), and no
    // reservation expired (an id placed on one rank but run on another would have).
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
        "no reservation was left behind"
    );
}
