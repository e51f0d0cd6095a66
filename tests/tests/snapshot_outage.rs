//! A snapshot-service outage under steady load: br-snapshot, br-ingest and
//! br-decision as real processes, four fake workers driven as one lockstep engine (every
//! request decodes one token per step, finishes at its own output length, and queues at its
//! rank while the rank is full), and a gateway loop calling `Assign` at a steady rate, each
//! call with a deadline, sending every answered request to its rank. The snapshot service is
//! killed with SIGKILL for a few seconds and started again on the same port.
//!
//! Invariants checked (per policy, BR-0 and JSQ):
//! * no `Assign` fails: every call is answered within its deadline, during the outage (from
//!   the last σ, its own reservations and the estimated progress of the ranks) and after the
//!   restart (the new, still-empty σ is not taken as the truth);
//! * answers during the outage say `stale`, and answers become fresh again after the restart;
//! * no request the workers finished during the outage comes back into σ (a re-commit of a
//!   stale reservation after the restart must not resurrect it).
//!
//! The numbers behind them (answers during the outage, time to the first fresh answer after
//! the restart) are printed, not asserted: speed is a benchmark's business.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use br_e2e::{FakeWorker, Service, Split};
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::{self, AssignRequest, GetRequest};
use br_testkit::eventually;
use tokio::sync::mpsc;

const GROUP: &str = "outage";
const START: Duration = Duration::from_secs(60);
const WORKERS: u32 = 4;
const CAPACITY: u32 = 4;
/// One lockstep decode step of the fake engine.
const STEP: Duration = Duration::from_millis(40);
/// Between two `Assign` calls of the gateway loop (~55% of the engine's capacity with the
/// output lengths below: 16 slots, ~36 tokens × 40 ms per request).
const ARRIVAL: Duration = Duration::from_millis(165);
/// Every call's deadline (the gateway's budget for routing one request).
const DEADLINE: Duration = Duration::from_secs(3);
/// Long enough for a few dozen requests to finish: decision learns the ranks' pace and
/// output lengths from σ before the outage.
const WARM_UP: Duration = Duration::from_secs(6);
const OUTAGE: Duration = Duration::from_secs(8);
const AFTER: Duration = Duration::from_secs(6);

/// The load loops' stop flag, polled between steps.
#[derive(Clone, Default)]
struct Stop(Arc<AtomicBool>);

impl Stop {
    fn stop(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    fn stopped(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// One `Assign` call as the gateway saw it.
#[derive(Debug, Clone)]
struct Call {
    id: String,
    sent: Instant,
    answered: Instant,
    /// The worker and the stale flag, or the gRPC code of the failure.
    outcome: Result<(u32, bool), tonic::Code>,
}

/// A request sent to a rank: its output length is the engine's secret.
struct Job {
    id: String,
    worker: u32,
    prompt: u32,
    output: u32,
}

/// The fake engine: per rank, a FIFO queue and the running requests; one step per `STEP`.
struct Engine {
    workers: Vec<FakeWorker>,
    queued: Vec<VecDeque<Job>>,
    running: Vec<HashMap<String, (u32, u32)>>, // id -> (generated, output)
    /// Ids finished at the ranks, with when.
    finished: Arc<Mutex<Vec<(String, Instant)>>>,
}

impl Engine {
    async fn step(&mut self) {
        for w in 0..self.workers.len() {
            while self.running[w].len() < CAPACITY as usize {
                let Some(job) = self.queued[w].pop_front() else {
                    break;
                };
                self.workers[w].start(&job.id, job.prompt).await;
                self.running[w].insert(job.id, (0, job.output));
            }
            self.workers[w].step(1).await;
            let mut done = Vec::new();
            for (id, (generated, output)) in self.running[w].iter_mut() {
                *generated += 1;
                if *generated >= *output {
                    done.push(id.clone());
                }
            }
            for id in done {
                self.running[w].remove(&id);
                self.workers[w].finish(&id).await;
                self.finished.lock().unwrap().push((id, Instant::now()));
            }
        }
    }
}

async fn sigma(snapshot: &Service) -> Option<v1::ClusterSnapshot> {
    let mut c = SnapshotClient::connect(snapshot.grpc_url()).await.ok()?;
    let r = c
        .get(GetRequest {
            group: GROUP.into(),
        })
        .await
        .ok()?;
    Some(r.into_inner())
}

async fn metric_sum(service: &Service, name: &str) -> f64 {
    br_testkit::http::metrics_url(&service.admin_url("/metrics"))
        .await
        .sum(name)
}

/// What one run measured.
#[derive(Debug, Default)]
struct Report {
    calls: usize,
    failed: Vec<(String, tonic::Code)>,
    answered_in_outage: usize,
    stale_in_outage: usize,
    fresh_after: Option<Duration>,
    /// Requests finished at their rank before the restart that σ held again after it.
    resurrected: BTreeSet<String>,
}

async fn run(policy: &str) -> Report {
    let t0 = Instant::now();
    let mark = |what: &str| eprintln!("[{policy} {:>6.2}s] {what}", t0.elapsed().as_secs_f64());
    let Split {
        mut snapshot,
        ingest,
        decision,
    } = Split::start(
        &[
            "--worker-grace",
            "30s",
            "--reservation-ttl",
            "10s",
            "--progress-interval",
            "100ms",
        ],
        &["--policy", policy, "--groups", GROUP],
    )
    .await;

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
    // ready once it can place: σ with the workers
    decision.wait_for("/readyz", START).await;

    // The engine: one task owns the workers; the gateway hands it jobs through a channel.
    let finished = Arc::new(Mutex::new(Vec::new()));
    let stop = Stop::default();
    let (jobs_tx, mut jobs_rx) = mpsc::channel::<Job>(4096);
    let engine = {
        let finished = finished.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut e = Engine {
                queued: (0..workers.len()).map(|_| VecDeque::new()).collect(),
                running: (0..workers.len()).map(|_| HashMap::new()).collect(),
                workers,
                finished,
            };
            let mut tick = tokio::time::interval(STEP);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !stop.stopped() {
                tick.tick().await;
                while let Ok(job) = jobs_rx.try_recv() {
                    let w = job.worker as usize;
                    e.queued[w].push_back(job);
                }
                e.step().await;
            }
            e.workers
        })
    };

    // The gateway: one call every ARRIVAL, each in its own task with its deadline.
    let calls = Arc::new(Mutex::new(Vec::<Call>::new()));
    let gateway = {
        let calls = calls.clone();
        let stop = stop.clone();
        let url = decision.grpc_url();
        tokio::spawn(async move {
            let client = DecisionClient::connect(url)
                .await
                .expect("decision reachable");
            let mut tick = tokio::time::interval(ARRIVAL);
            let mut inflight = Vec::new();
            let mut i: u32 = 0;
            while !stop.stopped() {
                tick.tick().await;
                i += 1;
                let id = format!("r{i}");
                let prompt = 100 + (i * 7919) % 900;
                // 20..=52 tokens: a few steps shorter or longer than the mean.
                let output = 20 + (i * 104_729) % 33;
                let mut c = client.clone();
                let calls = calls.clone();
                let jobs = jobs_tx.clone();
                inflight.push(tokio::spawn(async move {
                    let mut req = tonic::Request::new(AssignRequest {
                        group: GROUP.into(),
                        request_id: id.clone(),
                        prompt_tokens: prompt,
                        prompt_hash: None,
                        max_tokens: None,
                        expected_output_tokens: None,
                        request_class: None,
                    });
                    req.set_timeout(DEADLINE);
                    let sent = Instant::now();
                    let outcome = match c.assign(req).await {
                        Ok(r) => {
                            let r = r.into_inner();
                            let _ = jobs
                                .send(Job {
                                    id: id.clone(),
                                    worker: r.worker_id,
                                    prompt,
                                    output,
                                })
                                .await;
                            Ok((r.worker_id, r.stale))
                        }
                        Err(s) => Err(s.code()),
                    };
                    calls.lock().unwrap().push(Call {
                        id,
                        sent,
                        answered: Instant::now(),
                        outcome,
                    });
                }));
            }
            for t in inflight {
                let _ = t.await;
            }
        })
    };

    // Steady state first.
    tokio::time::sleep(WARM_UP).await;
    mark("warm: killing the snapshot service (SIGKILL)");
    let killed = Instant::now();
    snapshot.kill();
    tokio::time::sleep(OUTAGE).await;
    mark("restarting the snapshot service");
    let finished_before: BTreeSet<String> = finished
        .lock()
        .unwrap()
        .iter()
        .map(|(id, _)| id.clone())
        .collect();
    let restarted = Instant::now();
    snapshot.restart();
    snapshot.wait_for("/livez", START).await;

    // Under load after the restart: watch σ for requests that finished during the outage.
    let mut resurrected = BTreeSet::new();
    while restarted.elapsed() < AFTER {
        if let Some(s) = sigma(&snapshot).await {
            for r in &s.requests {
                if finished_before.contains(&r.request_id) {
                    resurrected.insert(r.request_id.clone());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    mark("stopping the load");
    stop.stop();
    gateway.await.expect("gateway loop");
    let _workers = engine.await.expect("engine loop");
    eventually(Duration::from_secs(20), "decision fresh again", || async {
        metric_sum(&decision, "balanceroute_decision_sigma_stale").await == 0.0
    })
    .await;

    let calls = calls.lock().unwrap().clone();
    let mut report = Report {
        calls: calls.len(),
        resurrected,
        ..Report::default()
    };
    for c in &calls {
        match c.outcome {
            Err(code) => report.failed.push((c.id.clone(), code)),
            Ok((_, stale)) => {
                if c.answered >= killed && c.answered < restarted {
                    report.answered_in_outage += 1;
                    report.stale_in_outage += usize::from(stale);
                }
                if !stale && c.sent >= restarted {
                    let at = c.answered.saturating_duration_since(restarted);
                    report.fresh_after = Some(report.fresh_after.map_or(at, |f| f.min(at)));
                }
            }
        }
    }
    mark(&format!(
        "{} calls, {} failed {:?}; during the {OUTAGE:?} outage {} answered ({} stale); first \
         fresh answer {:?} after the restart; {} finished requests back in σ {:?}",
        report.calls,
        report.failed.len(),
        report.failed.iter().take(8).collect::<Vec<_>>(),
        report.answered_in_outage,
        report.stale_in_outage,
        report.fresh_after,
        report.resurrected.len(),
        report.resurrected,
    ));
    report
}

fn check(policy: &str, r: &Report) {
    let expected_in_outage = (OUTAGE.as_millis() / ARRIVAL.as_millis()) as usize;
    assert!(
        r.failed.is_empty(),
        "{policy}: {} of {} Assign calls failed: {:?}",
        r.failed.len(),
        r.calls,
        r.failed
    );
    // Every call sent during the outage is answered (none failed, so only the ones still
    // waiting at the restart are not counted here).
    assert!(
        r.answered_in_outage * 2 >= expected_in_outage,
        "{policy}: only {} answers during the outage (~{expected_in_outage} calls)",
        r.answered_in_outage
    );
    assert_eq!(
        r.stale_in_outage, r.answered_in_outage,
        "{policy}: every answer during the outage says stale"
    );
    assert!(
        r.fresh_after.is_some(),
        "{policy}: no fresh answer after the restart"
    );
    assert!(
        r.resurrected.is_empty(),
        "{policy}: requests finished during the outage came back into σ: {:?}",
        r.resurrected
    );
}

/// Both kinds of policy, one after the other (two stacks at once would only measure the
/// machine): BR-0 waits in the pool for free slots, so a view that never frees any stalls it;
/// JSQ routes on arrival, so an empty σ after the restart leaves it no worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_outage_costs_no_assign() {
    let mut reports = Vec::new();
    for policy in ["br0", "jsq"] {
        reports.push((policy, run(policy).await));
    }
    for (policy, r) in &reports {
        check(policy, r);
    }
}
