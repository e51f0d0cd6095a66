//! Decision has no single point of failure: two br-decision replicas for one
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

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use br_client::assign::AssignClient;
use br_e2e::replicated::{
    Outcome, Ran, ReplicatedStack, StackConfig, assert_each_request_ran_once, drive_workers,
    metric_sum,
};
use br_testkit::{eventually, within};
use tokio::sync::mpsc;

const GROUP: &str = "failover";
/// A hang guard on a loaded 2-core machine, not a timing assertion.
const LONG: Duration = Duration::from_secs(120);
const WORKERS: u32 = 4;
/// Small on purpose: arrivals outpace the slots, so calls wait in the pool when the replica
/// carrying them dies.
const CAPACITY: u32 = 2;
const REQUESTS: usize = 240;
/// Each request runs for this many driver ticks.
const HOLD_TICKS: u32 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_decision_replica_under_load_loses_no_request() {
    let (mut stack, workers) =
        ReplicatedStack::start(&StackConfig::two_br0_deciders(GROUP, WORKERS, CAPACITY)).await;
    let d1 = stack.deciders.pop().unwrap();
    let mut d0 = stack.deciders.pop().unwrap();

    // The gateway: both replicas, default selection (the first healthy one), so every call
    // waits in d0's pool until d0 dies: the worst case for a failover.
    let client = AssignClient::connect_lazy_many([d0.grpc_url(), d1.grpc_url()], None).unwrap();
    let (answers_tx, answers_rx) = mpsc::channel(REQUESTS);
    let ran: Ran = Arc::default();
    // no telemetry faults here: the workers keep their streams
    let (_events, events_rx) = mpsc::channel(1);
    let driver = tokio::spawn(drive_workers(
        workers,
        answers_rx,
        events_rx,
        ran.clone(),
        HOLD_TICKS,
    ));
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
            let outcome = Outcome::assign(client, GROUP, i, LONG, tx).await;
            if outcome.result.is_ok() {
                *answered.lock().unwrap() += 1;
            }
            outcome
        });
    }
    drop(answers_tx);
    let mut outcomes = Vec::new();
    while let Some(o) = within(LONG, "every Assign ends", calls.join_next()).await {
        outcomes.push(o.unwrap());
    }
    let mut workers = within(LONG, "the workers finish everything", driver)
        .await
        .unwrap();
    let kill_at = kill_at.expect("d0 was killed");

    // 0 lost, 0 double assignments (one rank per id, by the workers' own record).
    assert_each_request_ran_once(&outcomes, &ran, REQUESTS, "decision failover");

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
        "no reservation was left behind"
    );
}
