//! The state of one group, owned by one task: the σ replica, the pool, the policy, the requests
//! by id (waiting, being reserved, answered), and this service's own reservations that σ does
//! not show yet. Synchronous and free of I/O, so every rule is unit-tested without a network;
//! [`crate::task`] drives it. Time only comes in as the `now` argument: nothing here reads a
//! clock.
//!
//! # The parts
//! [`GroupCore`] is the one API [`crate::task`] uses. It composes three parts, each owning its
//! state and keeping its invariants behind its own methods:
//! * `requests`: the requests known by id, their callers, the pool of the waiting ones and the
//!   answered ones kept for retries (the first per-request state machine, below);
//! * `reservations`: this service's own reservations σ does not show yet, the `Reserve` calls
//!   in flight, what to re-commit and what to release (the second one);
//! * `view`: the σ replica, whether it is confirmed current, and the view the policy decides
//!   on (its rebuild reads the own reservations, through their methods).
//!
//! A transition that moves one request through several parts at once is a method of
//! [`GroupCore`], grouped by flow: `feed` (σ events from the Watch), `admit` (arrivals,
//! ticks, routing), `reserve` (the `Reserve` round trip and `Release`) and `depart`
//! (answers, withdrawals, cancels, failures). Domain types go in and out; the protobuf
//! messages are built and parsed only in [`wire`], at the edge.
//!
//! # The view
//! The policy decides on a *view*: a copy of σ's `ClusterState` plus this service's own
//! reservations σ does not contain yet (in flight to `Reserve`, accepted but not yet seen in a
//! delta, or decided while the snapshot service was away). The view is rebuilt lazily, only
//! when σ moved since the last decision, and admissions are applied to it at once, so the next
//! tick sees them. Local keys live in their own key space (`LOCAL_KEY_BASE` and up) and never
//! collide with the keys σ interns.
//!
//! # A request's life here
//! `Waiting` (in the pool; pooled policies only) -> `Reserving` (admitted, in a `Reserve` call)
//! -> `Answered` (kept for `answered_ttl` so retries get the same answer). A rejected
//! reservation goes back to `Waiting` (pooled) or is routed again (on-arrival). When every
//! caller of a request has gone (deadline, cancel, disconnect) it leaves the pool; if it had
//! been reserved but the answer reached nobody, the reservation is released.
//!
//! # A reservation's life here
//! `InFlight` (in a `Reserve` call) -> `Committed` (accepted; until a delta shows it) or
//! `Uncommitted` (decided while the snapshot service was away, or the call failed; reserved
//! again when it is back). It is forgotten once σ shows it.

mod admit;
mod depart;
mod estimate;
mod feed;
mod requests;
mod reservations;
mod reserve;
mod split;
mod view;
pub mod wire;

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on purpose
mod tests;

use std::time::{Duration, Instant};

use br_core::dispatch::Admission;
use br_core::{Mode, Policy, RequestKey};
use br_proto::valid::GroupId;
use br_sigma::{GroupSummary, Sigma};

use crate::metrics::GroupMetrics;

pub use requests::{Assignment, Reply};
pub use reservations::{Rejection, Reservation, ReserveJob, ReserveOutcome};
pub use split::RankSplit;

use requests::Requests;
use reservations::Reservations;
use split::SplitTurns;
use view::SigmaView;

/// Keys of requests this service knows locally start here; σ's interned keys start at 1.
pub const LOCAL_KEY_BASE: RequestKey = 1 << 62;

/// Limits of one group.
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// Most requests waiting in the pool (`--max-pool`).
    pub max_pool: usize,
    /// How long answered requests are remembered for idempotent retries (`--answered-ttl`).
    pub answered_ttl: Duration,
    /// Most answered requests remembered (oldest forgotten first).
    pub answered_max: usize,
    /// Most `Reserve` calls in flight at once; further admissions wait (backpressure).
    pub max_inflight_reserves: usize,
    /// Own reservations not (yet) committed to σ are forgotten after this long.
    pub local_ttl: Duration,
    /// After a restart of the snapshot service, how long workers its new σ does not know yet
    /// are kept in the view as they were (`--adopt-grace`).
    pub adopt_grace: Duration,
    /// How long a worker's reports take to show in σ once it is back; a stale reservation σ
    /// does not show by then is not re-committed (`--recommit-settle`).
    pub recommit_settle: Duration,
    /// Several replicas of this group: the ranks this one places on (`--deciders`,
    /// `--decider-index`, `--decider-takeover`). `None`: every rank.
    pub split: Option<RankSplit>,
}

impl Default for GroupConfig {
    fn default() -> Self {
        GroupConfig {
            max_pool: 65_536,
            answered_ttl: Duration::from_secs(20),
            answered_max: 262_144,
            max_inflight_reserves: 2,
            local_ttl: Duration::from_secs(60),
            adopt_grace: Duration::from_secs(10),
            recommit_settle: Duration::from_millis(500),
            split: None,
        }
    }
}

/// What `Cancel` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    Withdrawn,
    Released,
    NotFound,
}

impl CancelOutcome {
    pub fn label(self) -> &'static str {
        match self {
            CancelOutcome::Withdrawn => "withdrawn",
            CancelOutcome::Released => "released",
            CancelOutcome::NotFound => "not_found",
        }
    }
}

/// Whether a group can place an Assign now (what readiness is made of).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placing {
    /// No complete σ has arrived yet.
    NoSigma,
    /// σ is there, but no worker in it is live and accepting: every Assign is UNAVAILABLE.
    NoLiveWorker,
    /// An Assign can be placed (from the last σ, also while the snapshot service is away).
    Ready,
}

/// What the group's task says about it at one instant (see `GroupCore::live_now`).
#[derive(Debug, Clone, PartialEq)]
pub struct LiveNow {
    /// σ as the replica holds it; `None` before the first complete σ.
    pub summary: Option<GroupSummary>,
    /// σ's count of each rank's generated tokens ([`Sigma::generated_tokens`]), one per
    /// `summary.workers`, in its order.
    pub generated_tokens: Vec<u64>,
    /// Requests waiting in the pool.
    pub pool: usize,
    /// σ not confirmed current (the snapshot service unreachable).
    pub stale: bool,
    pub placing: Placing,
}

impl LiveNow {
    /// σ's count of generated tokens of the `i`-th rank of `summary.workers`.
    pub fn generated(&self, i: usize) -> Option<u64> {
        self.generated_tokens.get(i).copied()
    }
}

/// Numbers for tests and logs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupStats {
    pub pool: usize,
    pub waiting_calls: usize,
    pub reserving: usize,
    pub answered: usize,
    /// Own reservations σ does not show yet.
    pub local: usize,
    pub inflight_reserves: usize,
    pub uncommitted: usize,
    pub sigma: Option<(u64, u64)>,
    pub stale: bool,
    /// Decisions are carried by the estimated progress (σ stale, or a new σ being adopted).
    pub estimating: bool,
    /// Workers kept from the last view while a new σ is adopted (not back yet).
    pub awaited: usize,
}

/// The state of one group. See the module docs.
pub struct GroupCore {
    group: GroupId,
    policy: Box<dyn Policy>,
    mode: Mode,
    cfg: GroupConfig,
    metrics: GroupMetrics,
    view: SigmaView,
    requests: Requests,
    reservations: Reservations,
    /// Admissions since the last tick want a tick soon.
    tick_wanted: bool,
    shutting_down: bool,
    scratch: Vec<Admission>,
    /// With a rank split: the free time of each rank, and the ranks closed to this tick.
    split: Option<SplitTurns>,
    closed: Vec<br_core::WorkerId>,
    /// BR-H's prediction-cache answers already added to `predictions_total`.
    predictions_counted: br_core::predict::CacheCounts,
}

impl std::fmt::Debug for GroupCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupCore")
            .field("group", &self.group)
            .field("policy", &self.policy.name())
            .field("stats", &self.stats())
            .finish()
    }
}

impl GroupCore {
    pub fn new(
        group: GroupId,
        policy: Box<dyn Policy>,
        cfg: GroupConfig,
        metrics: GroupMetrics,
    ) -> GroupCore {
        let mode = policy.mode();
        let split = cfg.split.map(SplitTurns::new);
        GroupCore {
            view: SigmaView::new(cfg.adopt_grace),
            requests: Requests::new(metrics.pool_size.clone()),
            reservations: Reservations::new(cfg.max_inflight_reserves, cfg.local_ttl),
            group,
            policy,
            mode,
            cfg,
            metrics,
            tick_wanted: false,
            shutting_down: false,
            scratch: Vec::new(),
            split,
            closed: Vec::new(),
            predictions_counted: Default::default(),
        }
    }

    pub fn group(&self) -> &GroupId {
        &self.group
    }

    /// True once a complete σ was received (it stays true through outages: the service keeps
    /// answering from its last σ).
    pub fn has_sigma(&self) -> bool {
        self.view.sigma().is_some()
    }

    /// Whether an Assign can be placed now: a complete σ with a live, accepting worker (the
    /// last σ counts while the snapshot service is away: the service keeps answering).
    pub fn placing(&self) -> Placing {
        // σ itself, not the view (rebuilt lazily, at the next tick or Assign): liveness comes
        // from σ either way, and this runs after every event of the group's task.
        match self.view.sigma() {
            None => Placing::NoSigma,
            Some(s) if s.cluster().accepting_worker_ids().next().is_some() => Placing::Ready,
            Some(_) => Placing::NoLiveWorker,
        }
    }

    /// True while σ is not confirmed current by the snapshot service.
    pub fn is_stale(&self) -> bool {
        self.view.is_stale()
    }

    pub fn sigma(&self) -> Option<&Sigma> {
        self.view.sigma()
    }

    /// Whether a tick should run soon (arrivals or returned requests since the last one).
    pub fn tick_wanted(&self) -> bool {
        self.tick_wanted
    }

    /// Whether nothing here waits on the clock: no request of any kind, no reservation or
    /// release, σ current and not being estimated or adopted. Housekeeping then has nothing
    /// to expire or sweep and may run far less often; any command or σ update ends it.
    pub fn is_quiet(&self) -> bool {
        !self.tick_wanted
            && self.requests.is_empty()
            && self.reservations.is_idle()
            && !self.view.is_stale()
            && !self.view.estimating()
            && !self.view.adopting()
    }

    pub fn stats(&self) -> GroupStats {
        let (waiting_calls, reserving) = self.requests.callers_and_reserving();
        GroupStats {
            pool: self.requests.pool_len(),
            waiting_calls,
            reserving,
            answered: self.requests.answered(),
            local: self.reservations.len(),
            inflight_reserves: self.reservations.inflight(),
            uncommitted: self.reservations.uncommitted(),
            sigma: self.view.sigma().map(|s| (s.epoch(), s.version())),
            stale: self.is_stale(),
            estimating: self.view.estimating(),
            awaited: self.view.awaited(),
        }
    }

    /// What the live page samples: σ's summary as the replica holds it and its count of each
    /// rank's generated tokens (O(ranks)), the pool and whether σ is stale.
    pub fn live_now(&self) -> LiveNow {
        let sigma = self.view.sigma();
        LiveNow {
            summary: sigma.map(Sigma::summary),
            generated_tokens: sigma.map_or_else(Vec::new, |s| {
                s.workers().map(|w| s.generated_tokens(w.id)).collect()
            }),
            pool: self.requests.pool_len(),
            stale: self.is_stale(),
            placing: self.placing(),
        }
    }

    /// Stops taking new requests (waiting ones are still served).
    pub fn shut_down(&mut self) {
        self.shutting_down = true;
    }

    /// Whether [`Self::shut_down`] was called (σ's feed ending then is the shutdown's, not an
    /// outage).
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down
    }

    /// Forgets old answers, drops waiters whose handler has gone, updates the gauges.
    pub fn housekeeping(&mut self, now: Instant) {
        self.requests
            .expire_answered(now, self.cfg.answered_ttl, self.cfg.answered_max);
        // Handlers that vanished without telling us (their future was dropped). Only requests
        // still waiting or being reserved have callers (not the answered ones, which may be
        // many).
        for key in self
            .requests
            .sweep_closed_callers(self.reservations.keys_in_progress())
        {
            self.requests.abandon(key);
        }
        self.requests.compact_answered();
        self.view.shrink_sparse();
        self.reservations
            .expire_released(self.view.sigma(), now, self.cfg.answered_ttl);
        // Expire own uncommitted reservations even while σ does not move.
        if self.reservations.uncommitted_expired(now) {
            self.view.mark_dirty();
        }
        // Carry the estimate forward even while nothing asks for a decision (the gauges,
        // and freed slots want a tick).
        if self.view.estimating() || self.view.adopting() {
            self.refresh_view(now);
        }
        self.update_gauges(now);
    }

    /// What BR-H's predictor holds (after it learned from finished requests).
    fn update_predictor_gauges(&self) {
        let Some(st) = self.policy.predictor_stats() else {
            return;
        };
        let clamp = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let [samples, hashes, buckets, hinted, classes] = &self.metrics.predictor_entries;
        samples.set(clamp(st.samples));
        hashes.set(clamp(st.hashes as u64));
        buckets.set(clamp(st.buckets as u64));
        hinted.set(clamp(st.hinted));
        classes.set(clamp(st.classes as u64));
        self.metrics.predictor_bytes.set(clamp(st.bytes as u64));
    }

    /// Adds BR-H's prediction-cache answers since the last call to `predictions_total`
    /// (after a tick: the cache answers at ticks only).
    fn count_predictions(&mut self) {
        let Some(now) = self.policy.prediction_counts() else {
            return;
        };
        let last = std::mem::replace(&mut self.predictions_counted, now);
        let [reused, spared, made] = &self.metrics.predictions;
        reused.inc_by(now.reused.saturating_sub(last.reused));
        spared.inc_by(now.spared.saturating_sub(last.spared));
        made.inc_by(now.made.saturating_sub(last.made));
    }

    fn update_gauges(&self, now: Instant) {
        self.metrics.sigma_stale.set(i64::from(self.is_stale()));
        self.metrics
            .sigma_staleness
            .set(self.view.staleness(now).as_secs_f64());
        self.metrics.pool_size.set(self.requests.pool_len() as i64);
        self.metrics.workers_awaited.set(self.view.awaited() as i64);
    }

    /// Rebuilds the view if σ (or, while σ is stale, the estimate of it) moved since the last
    /// decision.
    fn refresh_view(&mut self, now: Instant) {
        let did = self.view.refresh(&mut self.reservations, now, &self.group);
        if did.finished > 0 {
            self.metrics
                .estimated_finishes
                .inc_by(u64::from(did.finished));
            // Freed slots may admit waiting requests.
            if !self.requests.pool_is_empty() {
                self.tick_wanted = true;
            }
        }
    }

    /// Drops one of this service's reservations from the reservations and the view (no
    /// Release: the caller decides that).
    fn drop_own(&mut self, key: RequestKey) {
        if self.reservations.remove(key).is_some() {
            self.view.remove(key);
        }
    }
}
