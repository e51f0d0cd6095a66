//! σ events from the Watch feed, as they reach the parts of a group: the replica and the view
//! change ([`super::view`]), waiting requests σ now places are answered with that placement,
//! own reservations σ shows now are forgotten and, after a restart of the snapshot service,
//! re-committed ([`super::reservations`]), the policy and the outage estimate learn from
//! finished requests (and the estimate from σ's pace), and freed slots want a tick. Owns no
//! state of its own.

use std::time::Instant;

use br_core::RequestKey;
use br_core::predict::Finished;
use br_sigma::{Delta, Sigma, SigmaError};

use super::{GroupCore, wire};

impl GroupCore {
    /// Installs a replica (a snapshot, or a σ built directly in tests).
    pub fn set_sigma(&mut self, sigma: Sigma, now: Instant) {
        // The rank split's clocks start again on a fresh snapshot (see `split`).
        if let Some(split) = &mut self.split {
            split.restart();
        }
        if self.view.install(sigma, now) {
            // The snapshot service restarted: what it accepted before is gone unless the
            // workers report it.
            self.reservations.recommit_committed(now);
        }
        let waiting = self.requests.pooled();
        self.answer_placed_waiting(&waiting, now);
        self.sigma_moved(now);
    }

    /// Applies a delta in order. An error means the replica must resubscribe (a gap, another
    /// epoch) or be replaced (a change failed halfway); it is kept for answering meanwhile.
    pub fn on_delta(&mut self, d: &Delta, now: Instant) -> Result<(), SigmaError> {
        // Finished requests teach the predictors (BR-H, online, per group): read their prompt
        // length, hash and the gateway's hints from the replica before they leave it. One σ
        // has not seen (a gap being repaired) teaches nothing but the outage estimate.
        let finished: Vec<(Option<Finished>, u32)> = wire::finished_requests(d)
            .map(|(id, tokens)| {
                let known = self.view.sigma().and_then(|s| s.request(id));
                let learn = known.map(|r| Finished {
                    prompt_tokens: r.prompt_tokens,
                    prompt_hash: r.prompt_hash,
                    output_tokens: tokens,
                    expected_output: r.hints.expected_output,
                    class: r.hints.class,
                });
                (learn, tokens)
            })
            .collect();
        self.view.apply_delta(d, now)?;
        for (learn, tokens) in finished {
            if let Some(f) = learn.filter(|f| f.output_tokens > 0) {
                self.policy.observe_finished(&f);
            }
            self.view.learn_finished(tokens);
        }
        self.update_predictor_gauges();
        if !self.requests.pool_is_empty() {
            let placed = self.waiting_placed_by(d);
            self.answer_placed_waiting(&placed, now);
        }
        self.sigma_moved(now);
        Ok(())
    }

    /// The requests waiting in the pool that `d` places (reserves, or reports running).
    ///
    /// Two ways to the same set, the cheaper one taken: the pool's requests checked against σ
    /// (a hit is then confirmed in the delta), or the delta's ids looked up among the requests
    /// by id. The pool is small (a request waits for one tick) while a delta carries a
    /// progress report of most running requests, and the requests by id also hold every
    /// answered one kept for retries (some 100k at 5k Assign/s with `--answered-ttl 20s`):
    /// looking each report's id up there, and then in σ, cost a cold string comparison or
    /// two per progress event: 3% of br-all's samples under 100k events/s
    /// (docs/benchmarks.md).
    fn waiting_placed_by(&self, d: &Delta) -> Vec<RequestKey> {
        let in_delta = wire::placed_requests(d).count();
        if self.requests.pool_len() > in_delta {
            return wire::placed_requests(d)
                .filter_map(|id| self.requests.key_of(id))
                .collect();
        }
        self.requests
            .pool_keys()
            .filter(|&key| {
                self.requests.get(key).is_some_and(|r| {
                    let id = r.id.as_str();
                    // σ places it (rare for a waiting request), and this delta did so.
                    self.view.placed(id).is_some() && wire::placed_requests(d).any(|p| p == id)
                })
            })
            .collect()
    }

    /// The Watch stream is up again (the replica may still be catching up).
    pub fn on_connected(&mut self, now: Instant) {
        self.view.confirmed(now);
        // No takeover ran while σ was stale; the clocks start again from now (see `split`).
        if let Some(split) = &mut self.split {
            split.restart();
        }
        self.observe_split(now);
        self.update_gauges(now);
    }

    /// The Watch stream is gone since `at`: keep answering from the last σ plus own
    /// reservations, carried forward by the estimated progress of the ranks.
    pub fn on_disconnected(&mut self, at: Instant, now: Instant) {
        self.view.disconnected(at);
        if self.view.sigma().is_some() && !self.view.estimating() {
            // The estimate starts from the view as σ last showed it.
            self.view.mark_dirty();
            self.refresh_view(now);
            let own = &self.reservations;
            self.view.start_estimate(|k| own.max_tokens(k));
        }
        self.update_gauges(now);
    }

    fn sigma_moved(&mut self, now: Instant) {
        self.view.learn(now);
        // The rank split's clock runs on σ, not on ticks (idle spells included).
        self.observe_split(now);
        self.reservations.prune(self.view.sigma(), now);
        // Freed slots may admit waiting requests.
        if !self.requests.pool_is_empty() {
            self.tick_wanted = true;
        }
        if let Some(s) = self.view.sigma() {
            self.metrics.sigma_version.set(s.version() as i64);
        }
    }

    /// The rank split reads σ: a rank's free time starts no earlier than its worker's reports
    /// had `--recommit-settle` to arrive since σ (current) showed it back (see `split`).
    fn observe_split(&mut self, now: Instant) {
        let (Some(split), Some(s)) = (&mut self.split, self.view.sigma()) else {
            return;
        };
        let (view, settle) = (&self.view, self.cfg.recommit_settle);
        split.observe(s.cluster(), now, |w| view.back_at(w).map(|t| t + settle));
    }
}
