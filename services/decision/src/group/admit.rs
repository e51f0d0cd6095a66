//! How a request gets a worker: an `Assign` arrives (a retry joins the first call, an id σ
//! already places is answered from σ, and so is a waiting one once σ places it), waits in the
//! pool for a tick (pooled policies) or is routed at once (on-arrival ones), and is admitted:
//! counted in the view at once and queued as an own reservation for the next `Reserve` call.
//! Owns no state of its own.

use std::time::Instant;

use br_core::{Mode, PoolEntry, RequestKey};
use br_proto::valid::ValidAssign;

use super::GroupCore;
use super::requests::{Placement, Reply, State};
use super::reservations::Reservation;
use crate::error::DecisionError;

impl GroupCore {
    /// A new `Assign` call (or a retry of one). The answer goes to `reply`, now or later.
    pub fn assign(&mut self, req: ValidAssign, call: u64, reply: Reply, now: Instant) {
        let Some(reply) = self.requests.join(&req, call, reply) else {
            return;
        };
        if self.shutting_down {
            let _ = reply.send(Err(DecisionError::ShuttingDown));
            return;
        }
        if self.view.sigma().is_none() {
            let _ = reply.send(Err(DecisionError::NoSigma(self.group.to_string())));
            return;
        }
        if let Some(p) = self.view.placed(req.request_id.as_str()) {
            // σ already places this id (decided by an earlier incarnation of this service, or
            // routed without us): that is the answer, as for any retry.
            let at = Placement {
                worker: p.worker,
                incarnation: p.incarnation,
                admitted: now,
                sigma_version: p.sigma_version,
            };
            let state = State::Reserving {
                at,
                abandoned: false,
                reroutes: 0,
            };
            let key = self.requests.insert(req, state, call, reply, now);
            self.answer(key, false, now);
            return;
        }
        // A pooled request waits for the tick, which rebuilds the view once for every arrival
        // since σ moved; on arrival it only needs to know whether any worker takes work.
        let accepting = match self.view.accepting_any_without_rebuild() {
            Some(any) if self.mode == Mode::Pooled => any,
            _ => {
                self.refresh_view(now);
                self.view.accepting_any()
            }
        };
        if !accepting {
            let _ = reply.send(Err(DecisionError::NoLiveWorker(self.group.to_string())));
            return;
        }
        if self.mode == Mode::Pooled && self.requests.pool_len() >= self.cfg.max_pool {
            let _ = reply.send(Err(DecisionError::PoolFull {
                group: self.group.to_string(),
                max: self.cfg.max_pool,
            }));
            return;
        }
        let key = self.requests.insert(req, State::Waiting, call, reply, now);
        let Some(entry) = self.requests.set_waiting(key) else {
            return;
        };
        match self.mode {
            Mode::Pooled => {
                if self.requests.pool_push(entry) {
                    self.tick_wanted = true;
                }
            }
            Mode::OnArrival => self.route_now(key, entry, 0, now),
        }
    }

    /// Waiting requests (of `keys`) whose id σ places now are answered with that placement,
    /// as on arrival. Another replica reserved the id: the gateway's call waited there, that
    /// replica's answer never reached it (its connection froze) and the gateway retried here
    /// while σ did not show the id yet. Left waiting, such a request would hold out for a
    /// slot its own reservation in σ occupies, and the calls behind it with it.
    pub(super) fn answer_placed_waiting(&mut self, keys: &[RequestKey], now: Instant) {
        for &key in keys {
            let Some(r) = self.requests.get(key) else {
                continue;
            };
            let Some(p) = self.view.placed(r.id.as_str()) else {
                continue;
            };
            let at = Placement {
                worker: p.worker,
                incarnation: p.incarnation,
                admitted: now,
                sigma_version: p.sigma_version,
            };
            if self.requests.place_waiting(key, at) {
                self.answer(key, false, now);
            }
        }
    }

    /// An on-arrival policy picks the worker at once.
    pub(super) fn route_now(
        &mut self,
        key: RequestKey,
        entry: PoolEntry,
        reroutes: u32,
        now: Instant,
    ) {
        match self.policy.route(&entry, self.view.cluster()) {
            Some(worker) => self.admit(key, worker, reroutes, now),
            None => self.fail(key, DecisionError::NoLiveWorker(self.group.to_string())),
        }
    }

    /// One dispatcher tick: pooled policies admit a batch from the pool. False if there is
    /// no σ yet (nothing to decide on).
    pub fn tick(&mut self, now: Instant) -> bool {
        self.tick_wanted = false;
        if self.view.sigma().is_none() {
            return false;
        }
        if self.mode == Mode::Pooled
            && !self.requests.pool_is_empty()
            && !self.reservations.inflight_full()
        {
            self.refresh_view(now);
            let mut out = std::mem::take(&mut self.scratch);
            out.clear();
            if let Some(split) = &self.split {
                split.closed(
                    self.view.cluster(),
                    now,
                    self.view.is_stale(),
                    &mut self.closed,
                );
            }
            let (policy, pool) = (&mut self.policy, self.requests.pool_mut());
            self.view.with_closed(&self.closed, |cluster| {
                policy.dispatch(pool, cluster, &mut out)
            });
            self.count_predictions();
            for a in &out {
                self.admit(a.key, a.worker, 0, now);
            }
            self.scratch = out;
            self.requests.sync_gauge();
        }
        true
    }

    /// Admits a request to a worker: applied to the view at once, queued for `Reserve`.
    fn admit(&mut self, key: RequestKey, worker: u32, reroutes: u32, now: Instant) {
        let Some(sigma) = self.view.sigma() else {
            return;
        };
        let sigma_version = sigma.version();
        // While a new σ is adopted, a worker it does not know yet has its previous incarnation.
        let Some(incarnation) = self.view.incarnation(worker) else {
            self.fail(key, DecisionError::NoLiveWorker(self.group.to_string()));
            return;
        };
        let at = Placement {
            worker,
            incarnation,
            admitted: now,
            sigma_version,
        };
        let Some(r) = self.requests.admit(key, at, reroutes) else {
            return;
        };
        if self.mode == Mode::Pooled {
            self.metrics
                .pool_wait
                .observe(now.saturating_duration_since(r.arrived).as_secs_f64());
        }
        let res = Reservation {
            request_id: r.id.clone(),
            worker,
            incarnation,
            prompt_tokens: r.prompt_tokens,
            prompt_hash: r.prompt_hash,
            max_tokens: r.max_tokens,
            hints: r.hints,
        };
        self.view
            .reserve(res.info(key), res.max_tokens, &self.group);
        self.reservations.admit(key, res, now);
    }
}
