//! Reservations: Reserve, Release and the TTL.
//!
//! Owns what the decision service's assignments do to σ (checked one by one: unknown worker,
//! stale incarnation, already in σ, not LIVE, full) and the deadline of every reservation that
//! entered σ: a RESERVED request that no telemetry made ACTIVE by then expires in
//! [`Reservations::expire_due`]. Like `apply`, every function works inside the caller's σ batch.

use std::collections::VecDeque;
use std::time::Duration;

use br_core::{Phase, RequestKey};
use br_proto::v1;
use br_proto::valid::{RequestId, ValidReservation};
use br_sigma::{Adoptions, Batch, Hints, Liveness, MAX_WORKER_ID, change};
use tokio::time::Instant;

use super::{Reject, current_worker};

/// The reservations' deadlines.
pub(super) struct Reservations {
    ttl: Duration,
    /// (deadline, key) in reservation order; the TTL is constant, so deadlines are sorted.
    /// Entries whose request left σ (or became active) are skipped when they come due.
    due: VecDeque<(Instant, RequestKey)>,
}

impl Reservations {
    pub(super) fn new(ttl: Duration) -> Reservations {
        Reservations {
            ttl,
            due: VecDeque::new(),
        }
    }

    /// Applies each reservation on its own into `b`: returns the accepted ids (an idempotent
    /// repeat is accepted again) and the rejected ones with why.
    pub(super) fn reserve(
        &mut self,
        b: &mut Batch<'_>,
        reservations: Vec<ValidReservation>,
        now: Instant,
    ) -> (Vec<RequestId>, Vec<(RequestId, Reject)>) {
        let mut accepted = Vec::new();
        let mut rejected = Vec::new();
        let deadline = now + self.ttl;
        for r in reservations {
            match reserve_one(b, &r) {
                Ok(new) => {
                    if new && let Some(key) = b.sigma().key_of(r.request_id.as_str()) {
                        self.due.push_back((deadline, key));
                    }
                    accepted.push(r.request_id);
                }
                Err(rej) => rejected.push((r.request_id, rej)),
            }
        }
        (accepted, rejected)
    }

    /// Expires the reservations due by `now` that are still RESERVED; returns how many.
    pub(super) fn expire_due(&mut self, b: &mut Batch<'_>, now: Instant) -> u64 {
        let mut expired = 0;
        while let Some(&(deadline, key)) = self.due.front() {
            if deadline > now {
                break;
            }
            self.due.pop_front();
            let due = b.sigma().id_of(key).and_then(|id| {
                let r = b.sigma().request(id)?;
                (r.phase == Phase::Queued).then(|| id.to_owned())
            });
            if let Some(id) = due
                && b.apply(change::request_expired(&id)).is_ok()
            {
                expired += 1;
            }
        }
        expired
    }
}

/// Releases RESERVED requests (others are ignored); returns how many, and how many of them
/// were handed on by the request-id rule: a reservation an unkeyed request took (so σ no
/// longer holds it) releases the oldest reservation left on its worker in its place (see
/// `br_sigma::unkeyed`).
pub(super) fn release(
    b: &mut Batch<'_>,
    ids: &[RequestId],
    adoptions: &mut Adoptions,
) -> (u32, u64) {
    let mut released = 0;
    let mut handed_on = 0;
    for id in ids {
        let held = b.sigma().request(id.as_str()).map(|r| r.phase);
        match held {
            Some(Phase::Queued) => {
                if b.apply(change::request_released(id.as_str())).is_ok() {
                    released += 1;
                }
            }
            Some(Phase::Running) => {}
            None => {
                if let Ok(Some(_)) = adoptions.named(b, id.as_str()) {
                    released += 1;
                    handed_on += 1;
                }
            }
        }
    }
    (released, handed_on)
}

/// One reservation: Ok(true) if it entered σ, Ok(false) for an idempotent repeat.
fn reserve_one(b: &mut Batch<'_>, r: &ValidReservation) -> Result<bool, Reject> {
    if r.worker_id > MAX_WORKER_ID {
        return Err(Reject::new(
            v1::RejectReason::UnknownWorker,
            format!("worker {} is not in σ", r.worker_id),
        ));
    }
    let liveness = current_worker(b, r.worker_id, r.incarnation)?;
    if let Some(held) = b.sigma().request(r.request_id.as_str()) {
        if held.worker == r.worker_id && held.incarnation == r.incarnation {
            return Ok(false);
        }
        return Err(Reject::new(
            v1::RejectReason::Duplicate,
            format!(
                "request {:?} is already in σ on worker {}",
                r.request_id.as_str(),
                held.worker
            ),
        ));
    }
    if liveness != Liveness::Live {
        return Err(Reject::new(
            v1::RejectReason::WorkerFenced,
            format!(
                "worker {} is {:?} and takes no new requests",
                r.worker_id, liveness
            ),
        ));
    }
    let capacity = b.sigma().worker(r.worker_id).map_or(0, |w| w.capacity);
    let used = b
        .sigma()
        .cluster()
        .worker(r.worker_id)
        .map_or(0, |w| w.requests());
    if used >= capacity && !r.queue_if_full {
        return Err(Reject::new(
            v1::RejectReason::WorkerFull,
            format!("worker {} holds {used} of {capacity} requests", r.worker_id),
        ));
    }
    b.apply(change::request_reserved_hinted(
        r.request_id.as_str(),
        r.worker_id,
        r.incarnation,
        r.prompt_tokens,
        r.prompt_hash,
        r.max_tokens,
        Hints {
            expected_output: r.expected_output_tokens,
            class: r.request_class_id,
        },
    ))?;
    Ok(true)
}
