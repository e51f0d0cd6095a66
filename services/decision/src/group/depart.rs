//! How a request leaves: answered (and kept for retries), failed, withdrawn by its callers
//! (deadline, disconnect) or cancelled. Whatever leaves, its reservation must not stay behind
//! in σ for a request nobody will send: one whose answer reached nobody, or that was cancelled,
//! is released (at once, or once its `Reserve` call returns). Owns no state of its own.

use std::sync::Arc;
use std::time::Instant;

use br_core::{Mode, Phase, RequestKey};

use super::requests::{Assignment, Cancelled, Left, State};
use super::reservations::LocalState;
use super::{CancelOutcome, GroupCore};
use crate::error::DecisionError;

impl GroupCore {
    /// Sends the answer of an admitted request to its callers.
    pub(super) fn answer(&mut self, key: RequestKey, stale: bool, now: Instant) {
        let Some(r) = self.requests.get(key) else {
            // Forgotten meanwhile: nobody waits for this reservation.
            self.release_local(key);
            return;
        };
        let State::Reserving { at, .. } = r.state else {
            return;
        };
        let resp = Assignment {
            worker: at.worker,
            endpoint: self.view.endpoint(at.worker),
            policy: self.policy.name(),
            pool_wait: match self.mode {
                Mode::Pooled => at.admitted.saturating_duration_since(r.arrived),
                Mode::OnArrival => std::time::Duration::ZERO,
            },
            incarnation: at.incarnation,
            sigma_version: at.sigma_version,
            stale,
        };
        if stale {
            self.metrics.stale_answers.inc();
        }
        let Some(id) = self.requests.deliver(key, resp, now) else {
            return;
        };
        // Every caller left before the answer: the gateway will not send the request. A
        // committed reservation is released by id (the own copy may have been pruned when σ
        // showed an earlier request of the same id).
        if stale {
            self.release_local(key);
        } else {
            self.drop_own(key);
            self.reservations.release(id.to_string());
        }
    }

    /// Drops one of this service's reservations, releasing it at the snapshot service if it
    /// may be there.
    fn release_local(&mut self, key: RequestKey) {
        if self.reservations.release_local(key) {
            self.view.remove(key);
        }
    }

    /// Fails a request: its callers get `err`, its own reservation is dropped.
    pub(super) fn fail(&mut self, key: RequestKey, err: DecisionError) {
        self.requests.fail(key, &err);
        if let Some(state) = self.reservations.remove(key)
            && state != LocalState::InFlight
        {
            self.view.remove(key);
        }
    }

    /// A caller went away (its deadline passed or it disconnected). `undelivered`: it had an
    /// answer it never read.
    pub fn withdraw(&mut self, id: &str, call: u64, undelivered: bool) {
        match self.requests.withdraw(id, call, undelivered) {
            Left::Nothing => {}
            Left::LastCaller(key) => self.requests.abandon(key),
            // Nobody got the answer: the gateway will not send it.
            Left::AnswerUnread(key) => {
                self.release_answered(key);
            }
        }
    }

    /// Binds request `id` (if it is still here after its `Assign`) to the caller's identity,
    /// the one [`Self::cancel_by`] accepts; a request keeps its first owner.
    pub fn claim(&mut self, id: &str, owner: Arc<str>) {
        self.requests.claim(id, owner);
    }

    /// `Decision.Cancel` by `caller` (a SPIFFE id, under mutual TLS): only the identity whose
    /// `Assign` brought the request here may cancel it. An id this service did not assign
    /// (another replica or an earlier incarnation did) has no owner to check, so a caller with
    /// an identity may not release σ's reservation of it: that reservation expires by its
    /// TTL instead. `None` (plaintext, or the admin role) may cancel anything, as [`Self::cancel`].
    pub fn cancel_by(
        &mut self,
        id: &str,
        caller: Option<&str>,
        now: Instant,
    ) -> Result<CancelOutcome, DecisionError> {
        let Some(caller) = caller else {
            return Ok(self.cancel(id, now));
        };
        let not_owner = || DecisionError::NotOwner {
            request_id: id.to_owned(),
            caller: caller.to_owned(),
        };
        match self.requests.key_of(id).and_then(|k| self.requests.get(k)) {
            Some(r) => match &r.owner {
                Some(owner) if **owner != *caller => Err(not_owner()),
                _ => Ok(self.cancel(id, now)),
            },
            None => {
                let in_sigma = self.view.sigma().and_then(|s| s.request(id));
                if in_sigma.is_some_and(|r| r.phase == Phase::Queued)
                    && !self.reservations.recently_released(id)
                {
                    Err(not_owner())
                } else {
                    Ok(CancelOutcome::NotFound)
                }
            }
        }
    }

    /// `Decision.Cancel` without an identity to check.
    pub fn cancel(&mut self, id: &str, now: Instant) -> CancelOutcome {
        let Some(key) = self.requests.key_of(id) else {
            return self.cancel_unknown(id, now);
        };
        match self.requests.cancel(key) {
            Cancelled::Unknown => CancelOutcome::NotFound,
            Cancelled::Withdrawn => CancelOutcome::Withdrawn,
            Cancelled::Answered(key) => {
                if self.release_answered(key) {
                    CancelOutcome::Released
                } else {
                    CancelOutcome::NotFound
                }
            }
        }
    }

    /// Cancel of an id not known here (e.g. decided by a previous incarnation of this
    /// service): release it if σ holds it as a reservation.
    fn cancel_unknown(&mut self, id: &str, now: Instant) -> CancelOutcome {
        if self.reservations.recently_released(id) {
            return CancelOutcome::NotFound;
        }
        let queued = self
            .view
            .sigma()
            .and_then(|s| s.request(id))
            .filter(|r| r.phase == Phase::Queued)
            .map(|r| (r.key, r.id.clone()));
        let Some((skey, rid)) = queued else {
            return CancelOutcome::NotFound;
        };
        self.reservations.release(id.to_owned());
        self.reservations.note_released(rid, now);
        self.view.remove(skey);
        CancelOutcome::Released
    }

    /// Releases the reservation of an answered request if it is still only reserved; forgets
    /// the request. Returns whether there was a reservation to release.
    fn release_answered(&mut self, key: RequestKey) -> bool {
        let Some(r) = self.requests.get(key) else {
            return false;
        };
        let id = r.id.clone();
        // σ is the truth once it shows the request; before that, the own copy is.
        let in_sigma = self
            .view
            .sigma()
            .and_then(|s| s.request(id.as_str()))
            .map(|sr| (sr.phase, sr.key));
        let released = match in_sigma {
            Some((Phase::Running, _)) => return false, // the worker's telemetry owns it now
            Some((Phase::Queued, skey)) => {
                self.reservations.release(id.to_string());
                self.view.remove(skey);
                self.drop_own(key);
                true
            }
            None => {
                let had = self.reservations.release_unseen(key);
                if had {
                    self.view.remove(key);
                }
                had
            }
        };
        self.requests.forget(key);
        released
    }
}
