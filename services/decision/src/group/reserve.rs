//! The `Reserve` round trip and `Release`: which admissions go out in the next call (none
//! while σ is stale, and none for a worker a new σ does not know yet: they are answered stale
//! at once and re-committed later, unless their worker's reports show them finished), and
//! what each
//! outcome does to the requests, the own reservations and the view. Accepted: answered.
//! Rejected because of the worker: back to the pool (or routed again), with the worker kept
//! out of the view until σ moves. A duplicate: answered with σ's placement (retryable
//! UNAVAILABLE while this replica's σ does not show it yet), and so is an admission σ placed
//! elsewhere before it was sent (with the placement σ showed then). Failed or left
//! unanswered: answered stale and re-committed. Owns no state of its own; the messages are
//! built and parsed in [`super::wire`].

use std::time::Instant;

use br_core::{Mode, RequestKey};

use super::GroupCore;
use super::requests::State;
use super::reservations::Placed;
use super::reservations::{Recommit, RejectReason, ReserveJob, ReserveOutcome, worker_refused};
use crate::error::DecisionError;

/// On-arrival requests whose reservation is rejected are routed again at most this often.
const MAX_REROUTES: u32 = 4;

impl GroupCore {
    /// The next `Reserve` call to make, if any and if fewer than the limit are in flight.
    /// While σ is stale nothing is sent: the admissions are answered at once (stale) and
    /// reserved when the snapshot service is back.
    pub fn take_reserve(&mut self, now: Instant) -> Option<ReserveJob> {
        // Admissions σ placed elsewhere before they were sent: answered with that placement
        // (σ may have dropped the id since), whether or not σ is current now.
        for (key, placed) in self.reservations.take_lost() {
            self.answer_lost(key, placed, now);
        }
        if self.is_stale() {
            for key in self.reservations.take_outbox() {
                self.not_sent(key, now);
            }
            return None;
        }
        if self.view.adopting() {
            // A new σ that does not know the worker yet would refuse it: answered like during
            // the outage, reserved once the worker is back.
            let view = &self.view;
            for key in self.reservations.take_outbox_where(|r| view.away(r.worker)) {
                self.not_sent(key, now);
            }
        }
        let sigma = self.view.sigma()?;
        let when = Recommit {
            now,
            settle: self.cfg.recommit_settle,
            ready_at: |w, inc| self.view.ready_at(w, inc),
        };
        let batch = self.reservations.next_batch(sigma, &when)?;
        if !batch.dropped.is_empty() {
            tracing::info!(group = %self.group, n = batch.dropped.len(),
                "stale reservations not re-committed: their workers' reports do not list them");
            self.metrics
                .recommits_dropped
                .inc_by(batch.dropped.len() as u64);
            for &key in &batch.dropped {
                self.view.remove(key);
            }
        }
        if batch.recommit && !batch.send.is_empty() {
            self.metrics.recommits_sent.inc_by(batch.send.len() as u64);
        }
        for key in batch.lost {
            self.answer_lost(key, None, now);
        }
        let queue_if_full = self.mode == Mode::OnArrival;
        self.reservations
            .start_job(batch.send, batch.recommit, queue_if_full)
    }

    /// An admission that cannot be reserved now: answered at once (stale) from the view, and
    /// reserved when the snapshot service (and its worker) is back.
    fn not_sent(&mut self, key: RequestKey, now: Instant) {
        self.reservations.mark_uncommitted(key, now);
        self.answer(key, true, now);
    }

    /// The outcome of a `Reserve` call.
    pub fn on_reserve_done(&mut self, job: u64, outcome: ReserveOutcome, now: Instant) {
        // A tick skipped for the in-flight limit may admit now.
        if !self.requests.pool_is_empty() {
            self.tick_wanted = true;
        }
        let Some(done) = self.reservations.finish_job(job) else {
            return;
        };
        match outcome {
            ReserveOutcome::Failed { error } => {
                let n = done.keys().len();
                tracing::warn!(group = %self.group, %error, n,
                    "Reserve failed; answering from the local view (stale)");
                self.metrics.reserve_failed("unavailable", n as u64);
                self.not_committed(done.keys(), done.recommit, now);
            }
            ReserveOutcome::Answered {
                epoch,
                version,
                accepted,
                rejected,
            } => {
                let sorted = done.sort(&accepted, rejected);
                for (key, id) in sorted.accepted {
                    self.reservations.commit(key, epoch, version);
                    if done.recommit {
                        continue;
                    }
                    if self.requests.contains(key) {
                        self.answer(key, false, now);
                    } else {
                        // Forgotten meanwhile (nobody waits): it is in σ now, release it by
                        // id (the own copy may be gone already).
                        self.reservations.release(id.to_string());
                        self.drop_own(key);
                    }
                }
                for (key, rej) in sorted.rejected {
                    self.rejected(key, rej.reason, &rej.detail, done.recommit, now);
                }
                // A server that neither accepts nor rejects: treat as not committed.
                if !sorted.unanswered.is_empty() {
                    let n = sorted.unanswered.len() as u64;
                    self.metrics.reserve_failed("unanswered", n);
                }
                self.not_committed(&sorted.unanswered, done.recommit, now);
            }
        }
    }

    /// Reservations not (known to be) in σ: re-committed later; a first attempt is answered
    /// from the local view (stale).
    fn not_committed(&mut self, keys: &[RequestKey], recommit: bool, now: Instant) {
        for &key in keys {
            self.reservations.mark_uncommitted(key, now);
            if !recommit {
                self.answer(key, true, now);
            }
        }
    }

    /// One reservation the snapshot service refused.
    fn rejected(
        &mut self,
        key: RequestKey,
        reason: RejectReason,
        detail: &str,
        recommit: bool,
        now: Instant,
    ) {
        self.metrics.reserve_failed(reason.label(), 1);
        self.drop_own(key);
        if recommit {
            tracing::debug!(group = %self.group, ?reason, "re-reservation after an outage refused");
            return;
        }
        let Some(r) = self.requests.get(key) else {
            return;
        };
        let State::Reserving {
            at,
            abandoned,
            reroutes,
        } = r.state
        else {
            return;
        };
        if abandoned || r.unwaited() {
            self.requests.forget(key);
            return;
        }
        if reason == RejectReason::WorkerFull
            && self.split.as_ref().is_some_and(|s| s.owns(at.worker))
        {
            // Another replica filled one of this one's ranks before its takeover time: two
            // replicas claim one index, or they disagree on K (or a takeover raced the owner).
            self.metrics.rank_split_conflicts.inc();
        }
        if worker_refused(reason) {
            // σ is behind: keep the worker out of this view until σ moves.
            self.view.refuse_worker(at.worker);
            match self.mode {
                Mode::Pooled => {
                    if let Some(entry) = self.requests.set_waiting(key)
                        && self.requests.pool_push(entry)
                    {
                        self.tick_wanted = true;
                    }
                }
                Mode::OnArrival => {
                    if reroutes >= MAX_REROUTES {
                        self.fail(key, DecisionError::NoLiveWorker(self.group.to_string()));
                    } else if let Some(entry) = self.requests.set_waiting(key) {
                        self.route_now(key, entry, reroutes + 1, now);
                    }
                }
            }
        } else if reason == RejectReason::Duplicate {
            // σ already holds this request id on another worker (reserved by another replica,
            // or by an earlier incarnation of this one): that placement is the answer. If this
            // replica's σ does not show it yet (its Watch lags the Reserve round trip, as when
            // a replica that reserved the id died and the gateway retried it here at once),
            // the call ends retryably: the client's retry of the same id is answered from σ
            // (on arrival, see `admit`), never a final error for a request that will run.
            if !self.answer_from_sigma(key, now) {
                let id = self
                    .requests
                    .get(key)
                    .map(|r| r.id.to_string())
                    .unwrap_or_default();
                tracing::info!(group = %self.group, request = %id, %detail,
                    "duplicate reservation not in this replica's σ yet; the client retries");
                self.fail(key, DecisionError::PlacedElsewhere(id));
            }
        } else {
            self.fail(
                key,
                DecisionError::ReserveRefused(format!("{}: {detail}", reason.as_str_name())),
            );
        }
    }

    /// An admission forgotten before it was sent: answered with σ's placement of its id, or
    /// the one σ showed when it was forgotten; without either, the call ends retryably
    /// (UNAVAILABLE, as for a duplicate this replica's σ does not show): the client's retry of
    /// the same id is answered from σ or admitted again, never a final error.
    fn answer_lost(&mut self, key: RequestKey, placed: Option<Placed>, now: Instant) {
        if self.answer_from_sigma(key, now) {
            return;
        }
        if let Some(p) = placed
            && self
                .requests
                .replace(key, p.worker, p.incarnation, p.sigma_version)
        {
            self.answer(key, false, now);
            return;
        }
        let id = self
            .requests
            .get(key)
            .map(|r| r.id.to_string())
            .unwrap_or_default();
        tracing::info!(group = %self.group, request = %id,
            "admission lost before its Reserve call, and σ shows no placement; the client retries");
        self.fail(key, DecisionError::PlacedElsewhere(id));
    }

    /// Answers a request being reserved with σ's placement of its id. False if σ has none (or
    /// the request is not being reserved): the caller fails it.
    fn answer_from_sigma(&mut self, key: RequestKey, now: Instant) -> bool {
        let Some(r) = self.requests.get(key) else {
            return true;
        };
        let Some(p) = self.view.placed(r.id.as_str()) else {
            return false;
        };
        if !self
            .requests
            .replace(key, p.worker, p.incarnation, p.sigma_version)
        {
            return false;
        }
        self.answer(key, false, now);
        true
    }

    /// Ids to release at the snapshot service (one `Release` call).
    pub fn take_release(&mut self, now: Instant) -> Option<Vec<String>> {
        self.reservations.take_release(now)
    }

    /// Whether a `Release` of `id` is still to be sent (so a `Cancel` answered RELEASED waits
    /// for it to be acknowledged).
    pub fn release_pending(&self, id: &str) -> bool {
        self.reservations.release_pending(id)
    }
}
