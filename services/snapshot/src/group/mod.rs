//! The state machine of one group, without network, tasks or clocks: σ (a [`Sigma`]) and
//! what the writer needs around it, composed from one module per concern:
//!
//! * [`apply`]: validated telemetry changes into σ; which Apply stream (ingest replica)
//!   carries each worker's Hello; workers whose carrier went away (kept routable for the
//!   carrier grace); SUSPECT workers and their grace-period fences.
//! * [`reserve`]: Reserve and Release, and the TTL of reservations.
//! * [`watchers`]: subscribers with bounded queues (never waited on), the bounded delta
//!   history, resets, catch-up deltas and snapshots, progress marks.
//! * [`queue`]: one watcher's queue, bounded in events and in bytes.
//!
//! This module owns σ and the order of things: each operation opens one σ batch, lets the
//! concern modules apply into it, commits it as at most one new version, then publishes the
//! delta to the watchers and the metrics. Every operation takes `now` (and wall-clock
//! milliseconds where ingest's clock is involved) and reads no clock, so the writer task
//! drives it with real time and the unit tests with made-up instants. It speaks domain types
//! (validated input, [`Applied`], [`Reserved`], [`Released`], [`Event`]); `crate::wire` turns
//! them into messages.

mod apply;
mod event;
mod queue;
mod reserve;
mod watchers;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use br_core::WorkerId;
use br_proto::v1;
use br_proto::valid::{RequestId, ValidReservation, ValidTelemetryChange};
use br_sigma::{Batch, Delta, Liveness, RequestBound, Sigma, SigmaError};
use rustc_hash::FxHashSet;
use tokio::time::Instant;

use crate::metrics::{GroupMetrics, Metrics};
use apply::{Arrival, Presence};
pub use event::Event;
pub use queue::{Budget as WatcherBudget, Receiver as WatchQueue};
use reserve::Reservations;
use watchers::Watchers;

/// Identifies one Apply stream (per process).
pub type StreamId = u64;

/// The tunables of the groups (from the flags).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Deltas kept for resumption.
    pub history: usize,
    /// Encoded bytes of the deltas kept for resumption (the oldest go first past it).
    pub history_bytes: usize,
    /// Deltas older than this are dropped from the history (zero: kept until the bounds
    /// above), so the memory a burst of writes took comes back once it is over.
    pub history_age: Duration,
    /// A RESERVED request without telemetry for this long expires.
    pub reservation_ttl: Duration,
    /// A SUSPECT worker without a Hello for this long is fenced.
    pub worker_grace: Duration,
    /// A LIVE worker whose ingest replica went away (its Apply stream ended) stays LIVE this
    /// long, routable on its last state, while its shim reconnects; then it is SUSPECT.
    pub carrier_grace: Duration,
    /// A progress mark is sent after this long without a delta.
    pub progress_interval: Duration,
    /// Events queued per watcher before it counts as slow.
    pub watcher_queue: usize,
    /// Bytes queued per watcher before it is ended (RESOURCE_EXHAUSTED).
    pub watcher_queue_bytes: usize,
    /// What every watcher queue of the process may hold together (each open one its share);
    /// one budget for every group of the writer.
    pub watcher_budget: Arc<WatcherBudget>,
    /// Groups held at once; a new one beyond is refused (RESOURCE_EXHAUSTED).
    pub max_groups: usize,
    /// An idle group (no live worker, request, watcher or pending fence) is forgotten after
    /// this long.
    pub group_idle_grace: Duration,
    /// Requests a worker may hold above its capacity, and a group in all (WORKER_FULL beyond).
    pub requests: RequestBound,
}

/// Why a change or reservation was not applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    pub reason: v1::RejectReason,
    pub detail: String,
}

impl Reject {
    pub fn new(reason: v1::RejectReason, detail: impl Into<String>) -> Reject {
        Reject {
            reason,
            detail: detail.into(),
        }
    }

    pub fn invalid(detail: impl Into<String>) -> Reject {
        Reject::new(v1::RejectReason::Invalid, detail)
    }

    /// The `reason` label of the rejection counter.
    pub fn label(&self) -> &'static str {
        self.reason.label()
    }
}

impl From<SigmaError> for Reject {
    fn from(e: SigmaError) -> Reject {
        use v1::RejectReason as R;
        let reason = match &e {
            SigmaError::UnknownWorker(_) => R::UnknownWorker,
            SigmaError::StaleIncarnation { .. } => R::StaleIncarnation,
            SigmaError::WorkerFenced(_) | SigmaError::WorkerSuspect(_) => R::WorkerFenced,
            SigmaError::WorkerCordoned(_) => R::WorkerCordoned,
            SigmaError::DuplicateRequest(_) => R::Duplicate,
            // The writer's bound on what a worker (or the group) holds: like a full worker,
            // the change or reservation is refused and the rest of the batch applies.
            SigmaError::WorkerOverfull { .. } | SigmaError::GroupFull { .. } => R::WorkerFull,
            SigmaError::UnknownRequest(_) | SigmaError::NotReserved(_) => R::UnknownRequest,
            _ => R::Invalid,
        };
        Reject::new(reason, e.to_string())
    }
}

/// What an Apply batch did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub epoch: u64,
    /// σ's version after the batch (unchanged if it altered nothing).
    pub version: u64,
    /// The changes not applied, by their index in the batch.
    pub rejected: Vec<(usize, Reject)>,
}

/// What a Reserve call did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    pub epoch: u64,
    /// σ's version that holds the accepted reservations.
    pub version: u64,
    /// In σ, idempotent repeats included.
    pub accepted: Vec<RequestId>,
    pub rejected: Vec<(RequestId, Reject)>,
}

/// What a SetCordon call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cordoned {
    /// σ's version that holds the cordon state.
    pub version: u64,
    /// Whether σ changed.
    pub changed: bool,
}

/// What a Release call did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Released {
    pub version: u64,
    /// How many RESERVED requests left σ.
    pub released: u32,
}

/// The worker as σ holds it, if it is this incarnation (what telemetry and reservations both
/// check first).
fn current_worker(b: &Batch<'_>, id: WorkerId, inc: u64) -> Result<Liveness, Reject> {
    let w = b.sigma().worker(id).ok_or_else(|| {
        Reject::new(
            v1::RejectReason::UnknownWorker,
            format!("worker {id} is not in σ"),
        )
    })?;
    if w.incarnation != inc {
        return Err(Reject::new(
            v1::RejectReason::StaleIncarnation,
            format!("worker {id} is incarnation {}, not {inc}", w.incarnation),
        ));
    }
    Ok(w.liveness)
}

/// One group: σ plus what the writer needs around it.
pub struct Group {
    sigma: Sigma,
    settings: Arc<Settings>,
    presence: Presence,
    reservations: Reservations,
    /// The request-id rule's memory of reservations unkeyed requests took.
    adoptions: br_sigma::Adoptions,
    watchers: Watchers,
    metrics: GroupMetrics,
    /// Since when the group has been idle (see [`Group::is_idle`]); None while it is not.
    idle_since: Option<Instant>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("group", &self.sigma.group())
            .field("epoch", &self.sigma.epoch())
            .field("version", &self.sigma.version())
            .field("watchers", &self.watchers.count())
            .finish_non_exhaustive()
    }
}

impl Group {
    #[cfg(test)]
    pub fn new(
        name: &str,
        epoch: u64,
        settings: Arc<Settings>,
        metrics: &Metrics,
        now: Instant,
    ) -> Group {
        Group::starting_at(name, epoch, 0, settings, metrics, now)
    }

    /// A new group whose σ starts at `version` (above every version of a group of the same
    /// name this epoch held and reclaimed).
    pub fn starting_at(
        name: &str,
        epoch: u64,
        version: u64,
        settings: Arc<Settings>,
        metrics: &Metrics,
        now: Instant,
    ) -> Group {
        let mut sigma = Sigma::with_epoch_at(name, epoch, version);
        sigma.set_bound(settings.requests);
        let mut g = Group {
            sigma,
            presence: Presence::default(),
            reservations: Reservations::new(settings.reservation_ttl),
            adoptions: br_sigma::Adoptions::default(),
            watchers: Watchers::new(&settings, now),
            settings,
            metrics: metrics.group(name),
            idle_since: None,
        };
        g.observe();
        g
    }

    /// Nothing in the group needs it kept: every worker fenced (or none), no request, no
    /// open watcher, no Apply stream carrying a Hello, no pending fence. Forgetting it then
    /// loses only the fenced workers' records (a fenced incarnation never comes back).
    pub fn is_idle(&self) -> bool {
        self.sigma.request_count() == 0
            && self.sigma.workers().all(|w| w.liveness == Liveness::Fenced)
            && self.presence.is_empty()
            && self.watchers.is_empty()
    }

    /// How long the group has been idle at `now` (as of its last tick).
    pub fn idle_for(&self, now: Instant) -> Duration {
        self.idle_since
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t))
    }

    /// Forgets the group: its metric series go (the caller drops it).
    pub fn retire(self) {
        self.metrics.remove();
    }

    pub fn sigma(&self) -> &Sigma {
        &self.sigma
    }

    pub fn version(&self) -> u64 {
        self.sigma.version()
    }

    #[cfg(test)]
    pub fn watcher_count(&self) -> usize {
        self.watchers.count()
    }

    /// The current σ.
    pub fn snapshot(&self) -> v1::ClusterSnapshot {
        self.sigma.to_snapshot()
    }

    /// Applies one batch of validated telemetry changes (each with its index in the batch)
    /// from Apply stream `stream` of an unnamed ingest; see [`Group::apply_from`].
    #[cfg(test)]
    pub fn apply(
        &mut self,
        changes: Vec<(usize, ValidTelemetryChange)>,
        stream: StreamId,
        now: Instant,
        wall_ms: u64,
    ) -> Applied {
        self.apply_from(changes, stream, "", now, wall_ms, None)
    }

    /// Applies one batch of validated telemetry changes (each with its index in the batch)
    /// from Apply stream `stream` of ingest replica `carrier` as one version (or none if
    /// nothing changed). Rejected changes are returned by index (and counted); the rest apply
    /// in order. With the operator's `cordons` (the writer's, which outlive σ: see
    /// [`crate::cordons`]), a cordoned worker that the batch brings into σ uncordoned (its
    /// first Hello after a restart of this service, or after its group was reclaimed) is
    /// cordoned in the same version, so no watcher ever sees it routable.
    pub fn apply_from(
        &mut self,
        changes: Vec<(usize, ValidTelemetryChange)>,
        stream: StreamId,
        carrier: &str,
        now: Instant,
        wall_ms: u64,
        cordons: Option<&std::collections::BTreeSet<u32>>,
    ) -> Applied {
        self.idle_since = None;
        let at = Arrival {
            stream,
            carrier,
            now,
            wall_ms,
            grace: self.settings.worker_grace,
        };
        let mut rejected = Vec::new();
        let mut seen: FxHashSet<RequestId> = FxHashSet::default();
        let mut ids = apply::IdRule {
            adoptions: &mut self.adoptions,
            counts: apply::UnkeyedCounts::default(),
        };
        let mut b = self.sigma.batch();
        for (index, c) in changes {
            if let Err(r) = self.presence.apply(&mut b, c, &at, &mut seen, &mut ids) {
                self.metrics.family().reject(r.label());
                rejected.push((index, r));
            }
        }
        for &w in cordons.into_iter().flatten() {
            if b.sigma().worker(w).is_some_and(|x| !x.cordoned) {
                // cannot fail: σ holds the worker
                let _ = b.apply(br_sigma::change::worker_cordon(w, true));
                tracing::info!(group = %b.sigma().group(), worker = w,
                    "worker is back in σ and stays cordoned");
            }
        }
        let counts = ids.counts;
        if let Some(d) = b.commit() {
            self.publish(d, now);
        }
        self.metrics.unkeyed_matched.inc_by(counts.matched);
        self.metrics.unkeyed_unmatched.inc_by(counts.unmatched);
        self.metrics.unkeyed_handed_on.inc_by(counts.handed_on);
        self.count_carriers();
        self.log_not_owner(carrier, &rejected);
        Applied {
            epoch: self.sigma.epoch(),
            version: self.sigma.version(),
            rejected,
        }
    }

    /// Logs the batch's reports of another worker's requests, once per batch (a peer that
    /// names many is one line, not one per request): a worker that lies about its requests,
    /// an ingest replica forwarding what its streams were not entitled to, or a gateway that
    /// sent a request to another rank than the one it reserved.
    fn log_not_owner(&self, carrier: &str, rejected: &[(usize, Reject)]) {
        let mut refused = rejected
            .iter()
            .filter(|(_, r)| r.reason == v1::RejectReason::NotOwner);
        let Some((_, first)) = refused.next() else {
            return;
        };
        tracing::warn!(group = %self.sigma.group(), ingest = carrier,
            refused = 1 + refused.count(), first = %first.detail,
            "refused reports of requests σ holds under another worker; σ keeps them where they are");
    }

    /// An Apply stream ended: every LIVE worker whose current Hello came on it stays routable
    /// for the carrier grace while its shim reconnects (σ does not change now).
    pub fn stream_ended(&mut self, stream: StreamId, now: Instant) {
        self.presence
            .stream_ended(&self.sigma, stream, now + self.settings.carrier_grace);
        self.count_carriers();
    }

    fn count_carriers(&mut self) {
        let c = self.presence.take_counts();
        self.metrics.orphaned.inc_by(c.orphaned);
        self.metrics.takeovers.inc_by(c.takeovers);
        self.metrics.orphans_expired.inc_by(c.orphans_expired);
    }

    /// Commits reservations (validated by br-proto) as one version; each accepted or rejected
    /// (and counted) on its own.
    pub fn reserve(&mut self, reservations: Vec<ValidReservation>, now: Instant) -> Reserved {
        self.idle_since = None;
        let mut b = self.sigma.batch();
        let (accepted, rejected) = self.reservations.reserve(&mut b, reservations, now);
        if let Some(d) = b.commit() {
            self.publish(d, now);
        }
        for (_, rej) in &rejected {
            self.metrics.family().reject(rej.label());
        }
        Reserved {
            epoch: self.sigma.epoch(),
            version: self.sigma.version(),
            accepted,
            rejected,
        }
    }

    /// Releases RESERVED requests (others are ignored) as one version.
    pub fn release(&mut self, ids: &[RequestId], now: Instant) -> Released {
        let mut b = self.sigma.batch();
        let (released, handed_on) = reserve::release(&mut b, ids, &mut self.adoptions);
        if let Some(d) = b.commit() {
            self.publish(d, now);
        }
        self.metrics.unkeyed_handed_on.inc_by(handed_on);
        Released {
            version: self.sigma.version(),
            released,
        }
    }

    /// Cordons or uncordons a worker (Snapshot.SetCordon) as one version, or none if it already
    /// was in that state. `Err` if σ does not hold the worker.
    pub fn set_cordon(
        &mut self,
        worker: u32,
        cordoned: bool,
        now: Instant,
    ) -> Result<Cordoned, SigmaError> {
        self.idle_since = None;
        let mut b = self.sigma.batch();
        let changed = b.apply(br_sigma::change::worker_cordon(worker, cordoned))?;
        if let Some(d) = b.commit() {
            self.publish(d, now);
        }
        Ok(Cordoned {
            version: self.sigma.version(),
            changed,
        })
    }

    /// The group at a glance (Snapshot.ListGroups), without copying σ.
    pub fn summary(&self) -> v1::GroupSummary {
        let (mut workers, mut live, mut cordoned) = (0, 0, 0);
        for w in self.sigma.workers() {
            workers += 1;
            live += u32::from(w.liveness == Liveness::Live);
            cordoned += u32::from(w.cordoned);
        }
        v1::GroupSummary {
            group: self.sigma.group().to_owned(),
            epoch: self.sigma.epoch(),
            version: self.sigma.version(),
            workers,
            live_workers: live,
            cordoned_workers: cordoned,
            requests: self.sigma.request_count() as u64,
        }
    }

    /// What time does: expires reservations and fences workers that are due (one version for
    /// both), then serves watchers (resets lagging ones that have room again, progress marks,
    /// drops closed ones).
    pub fn tick(&mut self, now: Instant) {
        let mut b = self.sigma.batch();
        let expired = self.reservations.expire_due(&mut b, now);
        let fenced = self.presence.due(&mut b, now, self.settings.worker_grace);
        if let Some(d) = b.commit() {
            self.publish(d, now);
        }
        self.metrics.expired.inc_by(expired);
        self.metrics.fenced.inc_by(fenced);
        self.count_carriers();
        self.watchers.tick(&self.sigma, &self.metrics, now);
        self.sigma.shrink_sparse();
        self.idle_since = if self.is_idle() {
            Some(self.idle_since.unwrap_or(now))
        } else {
            None
        };
    }

    /// Ends every watcher's stream (shutdown).
    pub fn drop_watchers(&mut self) {
        self.watchers.drop_all(&self.metrics);
    }

    /// Registers a watcher holding (epoch, last_version) and returns its queue, already
    /// holding what brings it up to date (see `Snapshot.Watch`).
    pub fn subscribe(&mut self, epoch: u64, last_version: u64) -> WatchQueue {
        self.idle_since = None;
        self.watchers
            .subscribe(&self.sigma, &self.metrics, epoch, last_version)
    }

    /// A batch committed: its delta goes to the watchers, the metrics follow σ.
    fn publish(&mut self, d: Delta, now: Instant) {
        self.watchers.publish(d, &self.sigma, &self.metrics, now);
        self.metrics.batches.inc();
        self.observe();
    }

    fn observe(&mut self) {
        let (mut reserved, mut active) = (0, 0);
        for w in self.sigma.cluster().workers() {
            reserved += w.queued as usize;
            active += w.running as usize;
        }
        self.metrics
            .observe(self.sigma.version(), self.sigma.cluster(), reserved, active);
    }
}
