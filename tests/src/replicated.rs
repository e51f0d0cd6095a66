//! A replicated control plane for the fault tests (decision failover, chaos): one br-snapshot,
//! one or more br-ingest replicas and br-decision replicas for one group, as real processes,
//! with fake workers spread over the ingest replicas; the gateway's record of each `Assign`
//! ([`Outcome`]) and the workers' side ([`drive_workers`]): every answered request run on its
//! rank, stepped and finished, with a record of which rank ran which id (the ground truth
//! against double assignment). What a test does to the stack (kills, freezes) and what it checks
//! stay in the test.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use br_client::assign::{AssignClient, AssignParams, Assignment};
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::{self, GetRequest};
use br_testkit::eventually;
use tokio::sync::mpsc;

use crate::{FakeWorker, Service};

/// How long a process may take to start on a loaded 2-core machine (a hang guard).
pub const START: Duration = Duration::from_secs(60);

/// What to start.
#[derive(Debug, Clone)]
pub struct StackConfig {
    pub group: &'static str,
    pub ingests: usize,
    pub deciders: usize,
    pub workers: u32,
    pub capacity: u32,
    /// br-snapshot's flags (besides ports).
    pub snapshot_args: Vec<String>,
    /// Every br-ingest's flags (besides ports and `--snapshot-addr`).
    pub ingest_args: Vec<String>,
    /// Every br-decision's flags (besides ports, `--snapshot-addr` and `--groups`).
    pub decision_args: Vec<String>,
    /// Whether each br-decision also gets `--deciders K --decider-index i` (K = `deciders`,
    /// i its position): the rank split.
    pub split_ranks: bool,
}

impl StackConfig {
    /// One snapshot service, one ingest and two BR-0 decision replicas placing on every rank,
    /// with the failover tests' timing ([`Self::snapshot_timing`] of 2 s and 10 s); change a
    /// field with `..` for a variant.
    pub fn two_br0_deciders(group: &'static str, workers: u32, capacity: u32) -> StackConfig {
        StackConfig {
            group,
            ingests: 1,
            deciders: 2,
            workers,
            capacity,
            snapshot_args: StackConfig::snapshot_timing("2s", "10s"),
            ingest_args: Vec::new(),
            decision_args: vec!["--policy".into(), "br0".into()],
            split_ranks: false,
        }
    }

    /// br-snapshot's flags for a test with faults: a lost worker is fenced after
    /// `worker_grace`, an uncommitted reservation expires after `reservation_ttl`, and
    /// progress is reported every 100 ms.
    pub fn snapshot_timing(worker_grace: &str, reservation_ttl: &str) -> Vec<String> {
        [
            "--worker-grace",
            worker_grace,
            "--reservation-ttl",
            reservation_ttl,
            "--progress-interval",
            "100ms",
        ]
        .map(str::to_owned)
        .to_vec()
    }
}

/// The running processes and the workers' first connections.
pub struct ReplicatedStack {
    pub group: &'static str,
    pub snapshot: Service,
    pub ingests: Vec<Service>,
    pub deciders: Vec<Service>,
}

impl ReplicatedStack {
    /// Starts the snapshot service, then the ingest and decision replicas, connects
    /// `cfg.workers` fake workers (worker i to ingest replica i mod n) and waits until every
    /// worker is LIVE in σ and every decision replica is ready.
    pub async fn start(cfg: &StackConfig) -> (ReplicatedStack, Vec<FakeWorker>) {
        let snapshot = Service::start("br-snapshot", &strs(&cfg.snapshot_args));
        snapshot.wait_for("/livez", START).await;
        let snap = snapshot.grpc_url();
        let mut ingest_args = vec!["--snapshot-addr", &snap];
        ingest_args.extend(strs(&cfg.ingest_args));
        let ingests: Vec<Service> = (0..cfg.ingests)
            .map(|_| Service::start("br-ingest", &ingest_args))
            .collect();
        let mut decision_args = vec!["--snapshot-addr", &snap, "--groups", cfg.group];
        decision_args.extend(strs(&cfg.decision_args));
        let k = cfg.deciders.to_string();
        let deciders: Vec<Service> = (0..cfg.deciders)
            .map(|i| {
                let index = i.to_string();
                let mut args = decision_args.clone();
                if cfg.split_ranks {
                    args.extend(["--deciders", &k, "--decider-index", &index]);
                }
                Service::start("br-decision", &args)
            })
            .collect();
        for i in &ingests {
            i.wait_for("/readyz", START).await;
        }
        let mut workers = Vec::new();
        for id in 0..cfg.workers {
            let ingest = &ingests[id as usize % ingests.len()];
            workers
                .push(FakeWorker::connect(&ingest.grpc_url(), cfg.group, id, cfg.capacity).await);
        }
        let stack = ReplicatedStack {
            group: cfg.group,
            snapshot,
            ingests,
            deciders,
        };
        eventually(
            Duration::from_secs(30),
            "every worker LIVE in σ",
            || async {
                stack.sigma().await.is_some_and(|s| {
                    s.workers
                        .iter()
                        .filter(|w| w.liveness == v1::Liveness::Live as i32)
                        .count()
                        == cfg.workers as usize
                })
            },
        )
        .await;
        for d in &stack.deciders {
            d.wait_for("/readyz", START).await;
        }
        (stack, workers)
    }

    /// σ of the group, as the snapshot service answers `Get` (None while it is down).
    pub async fn sigma(&self) -> Option<v1::ClusterSnapshot> {
        sigma_at(&self.snapshot.grpc_url(), self.group).await
    }

    /// [`wait_quiet`] on this stack's snapshot service.
    pub async fn wait_quiet(&self, workers: &mut [FakeWorker], within: Duration) {
        wait_quiet(&self.snapshot.grpc_url(), self.group, workers, within).await;
    }
}

/// σ of `group` as the snapshot service at `url` answers `Get` (None while it is down).
pub async fn sigma_at(url: &str, group: &str) -> Option<v1::ClusterSnapshot> {
    let mut c = SnapshotClient::connect(url.to_owned()).await.ok()?;
    c.get(GetRequest {
        group: group.into(),
    })
    .await
    .ok()
    .map(|r| r.into_inner())
}

/// Waits (at most `within`) until every worker holds nothing and σ agrees: every worker
/// LIVE as its current incarnation (a fenced one would hold no load whatever it ran), no
/// request, no load on any rank. The workers heartbeat meanwhile, as idle shims do.
pub async fn wait_quiet(url: &str, group: &str, workers: &mut [FakeWorker], within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        for w in workers.iter_mut() {
            w.heartbeat().await;
        }
        let sigma = sigma_at(url, group).await;
        let quiet = workers.iter().all(|w| w.running.lock().unwrap().is_empty())
            && sigma.as_ref().is_some_and(|s| {
                let live = workers.iter().all(|w| {
                    s.workers.iter().any(|x| {
                        x.worker_id == w.worker_id
                            && x.incarnation == w.incarnation
                            && x.liveness == v1::Liveness::Live as i32
                    })
                });
                live && s.requests.is_empty() && s.workers.iter().all(|w| w.load_tokens == 0)
            });
        if quiet {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "σ not empty like the workers, or a worker not LIVE, within {within:?}: {sigma:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// The sum over every label set of a metric on `service`'s `/metrics`.
pub async fn metric_sum(service: &Service, name: &str) -> f64 {
    br_testkit::http::metrics_url(&service.admin_url("/metrics"))
        .await
        .sum(name)
}

/// What the gateway saw for one request.
#[derive(Debug)]
pub struct Outcome {
    pub id: String,
    pub issued: Instant,
    pub answered: Instant,
    pub result: Result<Assignment, String>,
}

impl Outcome {
    /// One gateway call of the fault tests: `Assign` of `req-{i}` (a prompt of 300-999 tokens
    /// picked from `i`) to `group` through `client`, bounded by `timeout` (see [`Self::call`]).
    pub async fn assign(
        client: AssignClient,
        group: &str,
        i: usize,
        timeout: Duration,
        answers: mpsc::Sender<(String, u32, u32)>,
    ) -> Outcome {
        let prompt = 300 + (i as u32 * 37) % 700;
        Self::call(client, group, format!("req-{i}"), prompt, timeout, answers).await
    }

    /// `Assign` of request `id` with a `prompt`-token prompt to `group` through `client`,
    /// bounded by `timeout`; an answered call is handed to the workers' driver
    /// ([`drive_workers`]) on `answers` as (id, rank, prompt).
    pub async fn call(
        client: AssignClient,
        group: &str,
        id: String,
        prompt: u32,
        timeout: Duration,
        answers: mpsc::Sender<(String, u32, u32)>,
    ) -> Outcome {
        let issued = Instant::now();
        let result = client
            .assign_within(&AssignParams::new(group, &id, prompt), timeout)
            .await
            .map_err(|e| e.to_string());
        let answered = Instant::now();
        if let Ok(a) = &result {
            answers
                .send((id.clone(), a.worker_id, prompt))
                .await
                .expect("the workers' driver runs until every answer is in");
        }
        Outcome {
            id,
            issued,
            answered,
            result,
        }
    }
}

/// Which rank ran which request id (more than one rank: a double assignment).
pub type Ran = Arc<Mutex<HashMap<String, Vec<u32>>>>;

/// What happens to one worker's telemetry while it keeps running its requests.
#[derive(Debug)]
pub enum WorkerEvent {
    /// Its stream is lost (its ingest replica died, or its shim restarted): it connects again
    /// to `ingest`, as a new incarnation when `restarted`, and sends its full state. `done`
    /// is told once its Hello is accepted.
    Reconnect {
        worker: u32,
        ingest: String,
        restarted: bool,
        done: tokio::sync::oneshot::Sender<()>,
    },
}

/// How long a worker keeps trying to reconnect (a hang guard).
const RECONNECT_PATIENCE: Duration = Duration::from_secs(60);

/// The workers' side: starts every answered request (id, rank, prompt tokens) on its rank,
/// steps every running request each tick (an idle worker sends a heartbeat instead) and
/// finishes it after `hold_ticks`, records which
/// rank ran which id in `ran`, and applies `events` as they come. Returns the workers once
/// `answers` is closed and nothing runs any more.
pub async fn drive_workers(
    mut workers: Vec<FakeWorker>,
    mut answers: mpsc::Receiver<(String, u32, u32)>,
    mut events: mpsc::Receiver<WorkerEvent>,
    ran: Ran,
    hold_ticks: u32,
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
            Some(e) = events.recv() => match e {
                WorkerEvent::Reconnect { worker, ingest, restarted, done } => {
                    workers[worker as usize]
                        .reconnect(&ingest, restarted, RECONNECT_PATIENCE)
                        .await;
                    let _ = done.send(());
                }
            },
            _ = tick.tick() => {
                for w in workers.iter_mut() {
                    let list = running.entry(w.worker_id).or_default();
                    if list.is_empty() {
                        // An idle rank stays LIVE, as a shim's heartbeats keep it.
                        w.heartbeat().await;
                        continue;
                    }
                    w.step(5).await;
                    for r in list.iter_mut() {
                        r.1 += 1;
                    }
                    let done: Vec<String> = list
                        .iter()
                        .filter(|r| r.1 >= hold_ticks)
                        .map(|r| r.0.clone())
                        .collect();
                    list.retain(|r| r.1 < hold_ticks);
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

/// The invariants every fault run keeps: no Assign ended in an error (none lost), every one of
/// `requests` ran, and none ran on two ranks (by the workers' own record). `context` names the
/// run (a seed, a fault) in the failure message.
pub fn assert_each_request_ran_once(
    outcomes: &[Outcome],
    ran: &Ran,
    requests: usize,
    context: &str,
) {
    let lost: Vec<_> = outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().err().map(|e| (&o.id, e)))
        .collect();
    assert!(
        lost.is_empty(),
        "{context}: {} of {requests} lost: {lost:?}",
        lost.len()
    );
    assert_eq!(
        ran.lock().unwrap().len(),
        requests,
        "{context}: every request ran"
    );
    let doubles = doubles(ran);
    assert!(
        doubles.is_empty(),
        "{context}: ids run on two ranks: {doubles:?}"
    );
}

/// The ids run on more than one rank.
pub fn doubles(ran: &Ran) -> Vec<(String, Vec<u32>)> {
    ran.lock()
        .unwrap()
        .iter()
        .filter(|(_, ws)| ws.len() != 1)
        .map(|(id, ws)| (id.clone(), ws.clone()))
        .collect()
}
