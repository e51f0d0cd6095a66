//! The `Reserve` calls of [`Reservations`]: what the next call carries (the outbox, or the
//! re-commits whose worker is back), the calls in flight, and how an answer is matched to
//! their reservations.
//!
//! Separate from the state the parent module keeps and prunes against σ: this is the one
//! half of the state machine that talks to the snapshot service's `Reserve`.

use super::*;

impl Reservations {
    /// Everything admitted since the last call, while σ is stale: nothing is sent, the
    /// callers are answered from the view and the reservations re-committed later.
    pub(in crate::group) fn take_outbox(&mut self) -> Vec<RequestKey> {
        std::mem::take(&mut self.outbox)
    }

    /// The admissions since the last call whose reservation matches `f` (taken out of the
    /// next call).
    pub(in crate::group) fn take_outbox_where(
        &mut self,
        f: impl Fn(&Reservation) -> bool,
    ) -> Vec<RequestKey> {
        let local = &self.local;
        let (taken, kept) = std::mem::take(&mut self.outbox)
            .into_iter()
            .partition(|k| local.get(k).is_some_and(|l| f(&l.res)));
        self.outbox = kept;
        taken
    }

    /// Takes the admissions forgotten before they were sent (out of the outbox), each with the
    /// placement σ showed for its id when it was forgotten (None: forgotten for another
    /// reason, e.g. failed).
    pub(in crate::group) fn take_lost(&mut self) -> Vec<(RequestKey, Option<Placed>)> {
        let local = &self.local;
        let mut lost = Vec::new();
        self.outbox.retain(|k| {
            let keep = local.contains_key(k);
            if !keep {
                lost.push(*k);
            }
            keep
        });
        let placed = &mut self.placed_elsewhere;
        let lost = lost.into_iter().map(|k| (k, placed.remove(&k))).collect();
        // A placement whose key left the outbox some other way is owed to no one.
        placed.clear();
        lost
    }

    /// Decides what the next `Reserve` call carries, if one may start: the admissions since
    /// the last call, else the re-commits whose worker σ shows live with the same
    /// incarnation (the others wait for it: a restarted snapshot service learns the workers
    /// from their hellos).
    ///
    /// A re-commit admitted before its worker was back in a current σ waits until the
    /// worker's reports had `settle` to arrive: σ then shows it (and it is forgotten by
    /// [`Reservations::prune`]) unless the worker finished it, or never got it. Either way it
    /// must not come back into σ: it is dropped, not re-committed. One admitted after that
    /// (its `Reserve` call failed) is re-committed at once.
    pub(in crate::group) fn next_batch<F: Fn(u32, u64) -> Option<Instant>>(
        &mut self,
        sigma: &Sigma,
        when: &Recommit<F>,
    ) -> Option<Batch> {
        if self.inflight_full() {
            return None;
        }
        let mut dropped = Vec::new();
        let (keys, recommit) = if !self.outbox.is_empty() {
            (std::mem::take(&mut self.outbox), false)
        } else if !self.recommit.is_empty() {
            let mut keys = std::mem::take(&mut self.recommit);
            keys.retain(|k| {
                self.local
                    .get(k)
                    .is_some_and(|l| matches!(l.state, LocalState::Uncommitted { .. }))
            });
            let mut ready = Vec::new();
            let mut later = Vec::new();
            for k in keys {
                let Some(l) = self.local.get(&k) else {
                    continue;
                };
                let live = sigma.incarnation(l.res.worker) == Some(l.res.incarnation)
                    && sigma.liveness(l.res.worker) == Some(Liveness::Live);
                let back = (when.ready_at)(l.res.worker, l.res.incarnation);
                match back {
                    Some(back) if live => {
                        if l.admitted >= back {
                            ready.push(k);
                        } else if when.now >= back + when.settle {
                            dropped.push(k);
                        } else {
                            later.push(k);
                        }
                    }
                    _ => later.push(k),
                }
            }
            for k in &dropped {
                self.local.remove(k);
            }
            self.recommit = later;
            for k in &ready {
                if let Some(l) = self.local.get_mut(k) {
                    l.state = LocalState::InFlight;
                }
            }
            (ready, true)
        } else {
            return None;
        };
        if keys.is_empty() && dropped.is_empty() {
            return None;
        }
        let (send, lost) = keys.into_iter().partition(|k| self.local.contains_key(k));
        Some(Batch {
            send,
            lost,
            recommit,
            dropped,
        })
    }

    /// Starts a `Reserve` call with the reservations of `keys`.
    pub(in crate::group) fn start_job(
        &mut self,
        keys: Vec<RequestKey>,
        recommit: bool,
        queue_if_full: bool,
    ) -> Option<ReserveJob> {
        let (keys, reservations): (Vec<RequestKey>, Vec<Reservation>) = keys
            .into_iter()
            .filter_map(|k| self.local.get(&k).map(|l| (k, l.res.clone())))
            .unzip();
        if keys.is_empty() {
            return None;
        }
        let id = self.next_job;
        self.next_job += 1;
        let ids = reservations.iter().map(|r| r.request_id.clone()).collect();
        self.inflight.insert(
            id,
            Inflight {
                keys,
                ids,
                recommit,
            },
        );
        Some(ReserveJob {
            id,
            reservations,
            queue_if_full,
        })
    }

    /// A `Reserve` call returned. Reservations cancelled while it was in flight are released
    /// (best effort, whatever the outcome) and forgotten; the others are returned.
    pub(in crate::group) fn finish_job(&mut self, job: u64) -> Option<Finished> {
        let job = self.inflight.remove(&job)?;
        let mut keys = Vec::with_capacity(job.keys.len());
        let mut ids = Vec::with_capacity(job.keys.len());
        for (key, id) in job.keys.into_iter().zip(job.ids) {
            if self.local.get(&key).is_some_and(|l| l.release_when_done) {
                self.local.remove(&key);
                self.releases.push(id.to_string());
            } else {
                keys.push(key);
                ids.push(id);
            }
        }
        Some(Finished {
            keys,
            ids,
            recommit: job.recommit,
        })
    }

    /// Accepted at σ's `epoch` and `version`.
    pub(in crate::group) fn commit(&mut self, key: RequestKey, epoch: u64, version: u64) {
        if let Some(l) = self.local.get_mut(&key) {
            l.state = LocalState::Committed { epoch, version };
        }
    }

    /// Keys whose answer is still to come: in a `Reserve` call, or waiting for the next.
    pub(in crate::group) fn keys_in_progress(&self) -> impl Iterator<Item = RequestKey> + '_ {
        self.inflight
            .values()
            .flat_map(|j| j.keys.iter().copied())
            .chain(self.outbox.iter().copied())
    }
}
