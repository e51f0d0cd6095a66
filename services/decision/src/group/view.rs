//! σ as this service sees it: the replica from the Watch feed, whether the snapshot service
//! confirms it current, and the *view* the policy decides on.
//!
//! The view is a copy of σ's `ClusterState` plus this service's own reservations σ does not
//! show yet ([`super::reservations`]). It is rebuilt lazily, only when σ moved since the last
//! decision (or an own reservation expired); admissions are applied to it at once, so the next
//! tick sees them.
//!
//! Owns: the replica (and whether a delta broke it halfway), the connection state and when σ
//! was last confirmed, the view and whether it is out of date. Staleness: σ is stale while the
//! Watch stream is down or the replica awaits a fresh snapshot; decisions then go on from the
//! last σ plus own reservations.

use std::time::{Duration, Instant};

use br_core::{ClusterState, RequestInfo, RequestKey};
use br_proto::valid::GroupId;
use br_sigma::{Delta, Sigma, SigmaError};

use super::reservations::Reservations;

/// Where σ places a request: worker, incarnation, and σ's version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Placed {
    pub(super) worker: u32,
    pub(super) incarnation: u64,
    pub(super) sigma_version: u64,
}

/// σ and the view of one group. See the module docs.
pub(super) struct SigmaView {
    sigma: Option<Sigma>,
    /// The replica failed to apply a delta halfway: it needs a fresh snapshot.
    broken: bool,
    connected: bool,
    last_confirmed: Option<Instant>,
    view: ClusterState,
    dirty: bool,
}

impl SigmaView {
    pub(super) fn new() -> SigmaView {
        SigmaView {
            sigma: None,
            broken: false,
            connected: false,
            last_confirmed: None,
            view: ClusterState::new(),
            dirty: false,
        }
    }

    pub(super) fn sigma(&self) -> Option<&Sigma> {
        self.sigma.as_ref()
    }

    /// True while σ is not confirmed current by the snapshot service.
    pub(super) fn is_stale(&self) -> bool {
        self.sigma.is_some() && (!self.connected || self.broken)
    }

    /// The position the Watch follower resubscribes from.
    pub(super) fn position(&self) -> (u64, u64) {
        match &self.sigma {
            Some(s) if !self.broken => (s.epoch(), s.version()),
            _ => (0, 0),
        }
    }

    /// How long σ has been unconfirmed (zero while it is current).
    pub(super) fn staleness(&self, now: Instant) -> Duration {
        match (self.is_stale(), self.last_confirmed) {
            (true, Some(t)) => now.saturating_duration_since(t),
            _ => Duration::ZERO,
        }
    }

    // ---------------------------------------------------------------- the feed

    /// Installs a replica (a snapshot, or a σ built directly in tests). Returns whether it is
    /// of another epoch than the one it replaces (the snapshot service restarted).
    pub(super) fn install(&mut self, sigma: Sigma, now: Instant) -> bool {
        let new_epoch = self
            .sigma
            .as_ref()
            .is_some_and(|s| s.epoch() != sigma.epoch());
        self.sigma = Some(sigma);
        self.broken = false;
        self.confirmed(now);
        self.dirty = true;
        new_epoch
    }

    /// Applies a delta in order. An error means the replica must resubscribe (a gap, another
    /// epoch) or be replaced (a change failed halfway); it is kept for answering meanwhile.
    pub(super) fn apply_delta(&mut self, d: &Delta, now: Instant) -> Result<(), SigmaError> {
        let Some(sigma) = self.sigma.as_mut() else {
            return Err(SigmaError::Gap {
                have: 0,
                prev: d.prev_version,
            });
        };
        if self.broken {
            return Err(SigmaError::Invalid(
                "replica awaits a fresh snapshot".into(),
            ));
        }
        let before = sigma.version();
        match sigma.apply_delta(d) {
            Ok(()) => {}
            Err(e @ SigmaError::Change { .. }) => {
                if sigma.version() == before {
                    // A prefix of the delta was applied: the replica matches no version.
                    self.broken = true;
                    self.dirty = true;
                }
                return Err(e);
            }
            Err(e) => return Err(e),
        }
        self.confirmed(now);
        self.dirty = true;
        Ok(())
    }

    /// The snapshot service confirmed σ (a snapshot, a delta, or the stream is up again).
    pub(super) fn confirmed(&mut self, now: Instant) {
        self.connected = true;
        self.last_confirmed = Some(now);
    }

    /// The Watch stream is gone since `at`.
    pub(super) fn disconnected(&mut self, at: Instant) {
        if self.connected {
            self.last_confirmed = Some(at);
        }
        self.connected = false;
    }

    // ---------------------------------------------------------------- reading σ

    /// σ's placement of a request id, if it has one.
    pub(super) fn placed(&self, id: &str) -> Option<Placed> {
        let s = self.sigma.as_ref()?;
        let r = s.request(id)?;
        Some(Placed {
            worker: r.worker,
            incarnation: r.incarnation,
            sigma_version: s.version(),
        })
    }

    /// The address of a worker as σ knows it (empty if unknown).
    pub(super) fn endpoint(&self, worker: u32) -> String {
        self.sigma
            .as_ref()
            .and_then(|s| s.endpoint(worker))
            .unwrap_or_default()
            .to_owned()
    }

    // ---------------------------------------------------------------- the view

    pub(super) fn cluster(&self) -> &ClusterState {
        &self.view
    }

    /// The next decision needs a rebuild (an own reservation may have expired).
    pub(super) fn mark_dirty(&mut self) {
        self.dirty = true;
    }

    /// Whether any worker in the view takes new requests.
    pub(super) fn accepting_any(&self) -> bool {
        self.view.accepting_worker_ids().next().is_some()
    }

    /// Counts an admission at once.
    pub(super) fn reserve(&mut self, info: RequestInfo, group: &GroupId) {
        if let Err(e) = self.view.reserve(info) {
            tracing::warn!(group = %group, error = %e, "admission not applicable to the view");
        }
    }

    /// Stops counting a request (σ still shows a released one until the Release is applied;
    /// the next rebuild brings it back until then, which only over-counts a little for a
    /// moment).
    pub(super) fn remove(&mut self, key: RequestKey) {
        self.view.remove(key).ok();
    }

    /// σ is behind: keep the worker out of this view until σ moves.
    pub(super) fn refuse_worker(&mut self, worker: u32) {
        self.view.set_accepting(worker, false).ok();
    }

    /// Rebuilds the view from σ plus own reservations σ does not show yet, if σ moved since
    /// the last rebuild. Drops own reservations that σ shows, that expired or that are void.
    pub(super) fn refresh(&mut self, own: &mut Reservations, now: Instant, group: &GroupId) {
        if !self.dirty {
            return;
        }
        self.dirty = false;
        own.prune(self.sigma.as_ref(), now);
        let Some(sigma) = &self.sigma else { return };
        self.view = sigma.cluster().clone();
        own.drop_void(sigma);
        for (key, res, current) in own.for_view(sigma) {
            // One on a suspect worker cannot be placed (the view refuses new work for it) and
            // is left out until the worker is live again: it takes no new work either way.
            let placed = current && self.view.reserve(res.info(key)).is_ok();
            if !placed {
                tracing::trace!(group = %group, request_id = %res.request_id, "own reservation not placeable in view");
            }
        }
    }
}
