//! Tests of a group's state machine through [`GroupCore`]'s API, with explicit instants. One
//! fixture for all of them, [`Fx`]: a core plus a writer σ standing in for the snapshot
//! service. `Reserve` and `Release` go through [`wire`] both ways, as in [`crate::task`].
//!
//! By concern: [`admission`] (the pool, ticks, retries, routing), [`reserve`] (the `Reserve`
//! outcomes), [`depart`] (cancels, withdrawals, vanished callers), [`stale`] (outages and
//! re-commits), [`outage`] (the estimated view of a long outage, a restarted snapshot
//! service, no resurrection), [`learn`] (BR-H's predictors learn from σ's finishes), `wire` (the
//! messages), and [`prop`] (the property test: nothing is ever left
//! behind in σ).

mod admission;
mod depart;
mod learn;
mod outage;
mod prop;
mod reserve;
mod split;
mod stale;
mod wire;

use std::time::{Duration, Instant};

use br_core::{PolicyConfig, PolicyKind, build_policy};
use br_proto::v1;
use br_proto::valid::{GroupId, RequestId, ValidAssign};
use br_sigma::{Delta, Hints, Sigma, change};
use tokio::sync::oneshot;
use tokio::sync::oneshot::error::TryRecvError;

use super::{Assignment, CancelOutcome, GroupConfig, GroupCore, ReserveJob};
use crate::error::DecisionError;

type Rx = oneshot::Receiver<Result<Assignment, DecisionError>>;

const EPOCH: u64 = 7;

/// A group core plus a writer σ standing in for the snapshot service.
struct Fx {
    core: GroupCore,
    writer: Sigma,
    now: Instant,
    call: u64,
}

/// An arbitrary starting instant (the tests only ever add to it).
fn t0() -> Instant {
    Instant::now()
}

fn core(kind: PolicyKind, cfg: GroupConfig) -> GroupCore {
    let metrics = crate::metrics::Metrics::new().unwrap().group("g");
    let policy = build_policy(&PolicyConfig::new(kind)).unwrap();
    GroupCore::new(GroupId::new("g").unwrap(), policy, cfg, metrics)
}

fn valid(id: &str, s: u32) -> ValidAssign {
    ValidAssign {
        group: GroupId::new("g").unwrap(),
        request_id: RequestId::new(id).unwrap(),
        prompt_tokens: s,
        prompt_hash: None,
        max_tokens: None,
        expected_output_tokens: None,
        request_class: None,
    }
}

impl Fx {
    /// `workers` live workers of capacity `cap`, each with the given load already active.
    fn new(kind: PolicyKind, loads: &[u32], cap: u32) -> Fx {
        Fx::with_cfg(kind, loads, cap, GroupConfig::default())
    }

    fn with_cfg(kind: PolicyKind, loads: &[u32], cap: u32, cfg: GroupConfig) -> Fx {
        let mut writer = Sigma::with_epoch("g", EPOCH);
        let mut b = writer.batch();
        for (w, &load) in loads.iter().enumerate() {
            let w = w as u32;
            b.apply(change::worker_up(
                w,
                100 + u64::from(w),
                cap,
                &format!("http://w{w}"),
            ))
            .unwrap();
            if load > 0 {
                b.apply(change::request_progress(
                    &format!("bg{w}"),
                    w,
                    100 + u64::from(w),
                    load,
                    0,
                ))
                .unwrap();
            }
        }
        b.commit();
        let mut fx = Fx {
            core: core(kind, cfg),
            writer,
            now: t0(),
            call: 0,
        };
        fx.core.set_sigma(fx.writer.clone(), fx.now);
        fx
    }

    fn assign(&mut self, id: &str, s: u32) -> (u64, Rx) {
        self.call += 1;
        let (tx, rx) = oneshot::channel();
        self.core.assign(valid(id, s), self.call, tx, self.now);
        (self.call, rx)
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
    }

    /// The snapshot service's side of a Reserve (the message [`wire`] builds for the job):
    /// accept what σ can take, reject the rest. Returns the response and the delta the Watch
    /// would carry.
    fn serve_reserve(&mut self, job: &ReserveJob) -> (v1::ReserveResponse, Option<Delta>) {
        let req = super::wire::reserve_request(self.core.group(), job);
        assert_eq!(req.group, "g");
        let mut accepted = Vec::new();
        let mut rejected = Vec::new();
        let mut b = self.writer.batch();
        for r in &req.reservations {
            let c = change::request_reserved_hinted(
                &r.request_id,
                r.worker_id,
                r.incarnation,
                r.prompt_tokens,
                r.prompt_hash,
                r.max_tokens,
                Hints {
                    expected_output: r.expected_output_tokens,
                    class: r.request_class_id,
                },
            );
            match b.apply(c) {
                Ok(_) => accepted.push(r.request_id.clone()),
                Err(e) => rejected.push(v1::ReservationRejection {
                    request_id: r.request_id.clone(),
                    reason: v1::RejectReason::WorkerFenced as i32,
                    detail: e.to_string(),
                }),
            }
        }
        let delta = b.commit();
        (
            v1::ReserveResponse {
                epoch: EPOCH,
                version: self.writer.version(),
                accepted,
                rejected,
            },
            delta,
        )
    }

    /// Delivers the result of `job`'s `Reserve` call, as the task does.
    fn done(&mut self, job: &ReserveJob, result: Result<v1::ReserveResponse, tonic::Status>) {
        let outcome = super::wire::reserve_outcome(result);
        self.core.on_reserve_done(job.id, outcome, self.now);
    }

    /// The next `Release` call, as the task would send it.
    fn release(&mut self) -> Option<v1::ReleaseRequest> {
        let ids = self.core.take_release(self.now)?;
        Some(super::wire::release_request(self.core.group(), ids))
    }

    /// Tick, reserve everything admitted, deliver the Reserve answer (and the delta).
    fn tick_and_commit(&mut self, deliver_delta: bool) -> usize {
        self.core.tick(self.now);
        let mut n = 0;
        while let Some(job) = self.core.take_reserve(self.now) {
            n += job.reservations.len();
            let (resp, delta) = self.serve_reserve(&job);
            self.done(&job, Ok(resp));
            if deliver_delta && let Some(d) = delta {
                self.core.on_delta(&d, self.now).unwrap();
            }
        }
        n
    }

    /// Applies writer changes as one delta and feeds it to the core.
    fn sigma_change(&mut self, changes: Vec<v1::Change>) {
        let mut b = self.writer.batch();
        for c in changes {
            b.apply(c).unwrap();
        }
        if let Some(d) = b.commit() {
            self.core.on_delta(&d, self.now).unwrap();
        }
    }
}

/// A `Reserve` answer refusing one request.
fn refused(fx: &Fx, id: &str, reason: v1::RejectReason, detail: &str) -> v1::ReserveResponse {
    v1::ReserveResponse {
        epoch: EPOCH,
        version: fx.writer.version(),
        accepted: vec![],
        rejected: vec![v1::ReservationRejection {
            request_id: id.into(),
            reason: reason as i32,
            detail: detail.into(),
        }],
    }
}

fn answer(rx: &mut Rx) -> Assignment {
    rx.try_recv().expect("answered").expect("ok")
}

fn error(rx: &mut Rx) -> DecisionError {
    rx.try_recv().expect("answered").expect_err("an error")
}

fn pending(rx: &mut Rx) -> bool {
    matches!(rx.try_recv(), Err(TryRecvError::Empty))
}

/// The request ids of a job, in order.
fn ids(job: &ReserveJob) -> Vec<&str> {
    job.reservations
        .iter()
        .map(|r| r.request_id.as_str())
        .collect()
}
