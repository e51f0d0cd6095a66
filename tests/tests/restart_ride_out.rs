//! Gateways ride out a crash of br-all: 24 gateway clients (br-client's `AssignClient`, one
//! connection each, default retry policy) send a steady `Assign` load with a 10 s deadline;
//! br-all is killed with SIGKILL mid-load and started again on the same port 3 s later (the
//! fake workers' streams reconnect as a shim's do and send their full state).
//!
//! Invariants (no timing is asserted; the outage and br-all's start-up are measured and
//! printed):
//! * no request is lost: every `Assign` is answered with a rank before its deadline, the calls
//!   made while br-all was down included (the client retries the same request id until the
//!   deadline, not a fixed number of times);
//! * nothing is placed twice: no request id is run by two ranks, and once quiet σ holds
//!   nothing (a reservation of an id placed twice would be left behind) and no reservation
//!   expired.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use br_client::assign::AssignClient;
use br_e2e::replicated::{
    Outcome, Ran, WorkerEvent, assert_each_request_ran_once, drive_workers, metric_sum, sigma_at,
    wait_quiet,
};
use br_e2e::{FakeWorker, Service};
use br_proto::v1;
use br_testkit::{eventually, within};
use tokio::sync::mpsc;

const GROUP: &str = "restart";
/// A hang guard on a loaded 2-core machine, not a timing assertion.
const LONG: Duration = Duration::from_secs(120);
const WORKERS: u32 = 4;
const CAPACITY: u32 = 4;
/// Gateway processes, each with its own client (its own connection).
const GATEWAYS: usize = 24;
const REQUESTS: usize = 480;
/// One call every PACE: REQUESTS span about 9.6 s, so calls arrive before, during and after
/// the outage.
const PACE: Duration = Duration::from_millis(20);
/// The call after which br-all is killed.
const KILL_AT: usize = REQUESTS / 4;
/// The fault's length: how long br-all stays dead before it is started again.
const DOWN_FOR: Duration = Duration::from_secs(3);
/// Every call's deadline: the shortest one the restart must not lose.
const DEADLINE: Duration = Duration::from_secs(10);
const HOLD_TICKS: u32 = 4;

async fn live_workers(url: &str) -> usize {
    sigma_at(url, GROUP).await.map_or(0, |s| {
        s.workers
            .iter()
            .filter(|w| w.liveness == v1::Liveness::Live as i32)
            .count()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_and_restarted_br_all_loses_no_request_with_a_10s_deadline() {
    let all = Service::start(
        "br-all",
        &[
            "--worker-grace",
            "2s",
            "--reservation-ttl",
            "10s",
            "--progress-interval",
            "100ms",
            "--policy",
            "br0",
            "--groups",
            GROUP,
        ],
    );
    let url = all.grpc_url();
    let mut workers = Vec::new();
    for id in 0..WORKERS {
        workers.push(FakeWorker::connect(&url, GROUP, id, CAPACITY).await);
    }
    eventually(LONG, "every worker LIVE in σ", || async {
        live_workers(&url).await == WORKERS as usize
    })
    .await;
    all.wait_for("/readyz", LONG).await;
    let mut running = Some(all);

    let clients: Vec<AssignClient> = (0..GATEWAYS)
        .map(|_| AssignClient::connect_lazy(url.clone()).unwrap())
        .collect();
    let (answers_tx, answers_rx) = mpsc::channel(REQUESTS);
    let (events_tx, events_rx) = mpsc::channel(WORKERS as usize);
    let ran: Ran = Arc::default();
    let driver = tokio::spawn(drive_workers(
        workers,
        answers_rx,
        events_rx,
        ran.clone(),
        HOLD_TICKS,
    ));

    let mut calls = tokio::task::JoinSet::new();
    let mut restart = None;
    let mut pace = tokio::time::interval(PACE);
    for i in 0..REQUESTS {
        pace.tick().await;
        if i == KILL_AT {
            let mut all = running.take().expect("killed once");
            all.kill();
            let killed_at = Instant::now();
            eprintln!("killed br-all (SIGKILL) after {i} calls issued");
            let events = events_tx.clone();
            let url = url.clone();
            // The restart runs beside the load: calls keep arriving while br-all is down.
            restart = Some(tokio::spawn(async move {
                // the fault's length, not a wait for something to happen
                tokio::time::sleep(DOWN_FOR).await;
                let spawned = Instant::now();
                let all = tokio::task::spawn_blocking(move || {
                    all.start_again();
                    all
                })
                .await
                .unwrap();
                let bound = spawned.elapsed();
                // The shims' streams reconnect (same incarnation: only br-all restarted).
                for worker in 0..WORKERS {
                    let (done, reconnected) = tokio::sync::oneshot::channel();
                    events
                        .send(WorkerEvent::Reconnect {
                            worker,
                            ingest: url.clone(),
                            restarted: false,
                            done,
                        })
                        .await
                        .unwrap();
                    reconnected.await.unwrap();
                }
                all.wait_for("/readyz", LONG).await;
                let ready = spawned.elapsed();
                eprintln!(
                    "br-all restarted: ready file {bound:?} after spawn, /readyz (workers \
                     reconnected) {ready:?} after spawn; outage {:?}",
                    killed_at.elapsed()
                );
                all
            }));
        }
        let client = clients[i % GATEWAYS].clone();
        let tx = answers_tx.clone();
        calls.spawn(async move { Outcome::assign(client, GROUP, i, DEADLINE, tx).await });
    }
    drop((answers_tx, events_tx));
    let mut outcomes = Vec::new();
    while let Some(o) = within(LONG, "every Assign ends", calls.join_next()).await {
        outcomes.push(o.unwrap());
    }
    let all = within(LONG, "br-all is back", restart.expect("br-all was killed"))
        .await
        .unwrap();
    let mut workers = within(LONG, "the workers finish everything", driver)
        .await
        .unwrap();

    let attempts: Vec<u32> = outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().ok().map(|a| a.attempts))
        .collect();
    eprintln!(
        "{} calls, {} retried, attempts max {}",
        outcomes.len(),
        attempts.iter().filter(|&&a| a > 1).count(),
        attempts.iter().max().unwrap_or(&0)
    );
    assert!(
        attempts.iter().any(|&a| a > 1),
        "calls were retried across the outage"
    );
    // 0 lost, 0 double assignments (one rank per id, by the workers' own record).
    assert_each_request_ran_once(&outcomes, &ran, REQUESTS, "br-all restart");

    // Quiet: σ equals the ground truth (nothing running, nothing reserved), and no
    // reservation expired (an id placed on one rank but run on another would have).
    wait_quiet(&url, GROUP, &mut workers, LONG).await;
    assert_eq!(
        metric_sum(&all, "balanceroute_snapshot_reservations_expired_total").await,
        0.0,
        "no reservation was left behind"
    );
}
