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
//! last σ plus own reservations, carried forward by the [`Estimator`] (requests finish, slots
//! free) until σ is current again.
//!
//! After a restart of the snapshot service σ comes back new and nearly empty: the workers
//! re-register over the next moments (when ingest reconnects and re-sends their Hellos). That
//! σ is not the truth yet. For up to the adoption grace the view keeps every worker the new σ
//! does not know yet as the estimate has it (its requests, its load), and decisions for those
//! workers are answered stale and reserved once they are back; workers the new σ knows are
//! taken from it. The grace ends early once every worker is back.
//!
//! Also owns when σ last showed each worker live (with its incarnation) while current: a
//! worker's own reports are the truth about what it holds only once they had time to arrive
//! ([`SigmaView::ready_at`]).

use std::time::{Duration, Instant};

use br_core::{ClusterState, RequestInfo, RequestKey};
use br_proto::valid::GroupId;
use br_sigma::{Delta, Liveness, Sigma, SigmaError};
use rustc_hash::FxHashMap;

use super::LOCAL_KEY_BASE;
use super::estimate::{Advanced, Estimator};
use super::reservations::{Placed, Reservations};

/// Requests of σ's key space carried over from the estimate into a view built on a new σ get
/// keys from here (between σ's interned keys and the local ones), so they never collide.
const CARRIED_KEY_BASE: RequestKey = 1 << 61;

/// After a resubscription, σ that does not move for this long is taken as current as it is
/// (the server had no delta to send): the estimate ends.
const RESUME_LINGER: Duration = Duration::from_secs(1);

/// A new σ (another epoch) not yet adopted as the whole truth.
struct Adopting {
    /// The σ of the previous epoch: the incarnations and endpoints of workers not back yet.
    previous: Sigma,
    until: Instant,
}

/// σ and the view of one group. See the module docs.
pub(super) struct SigmaView {
    sigma: Option<Sigma>,
    /// The replica failed to apply a delta halfway: it needs a fresh snapshot.
    broken: bool,
    connected: bool,
    last_confirmed: Option<Instant>,
    /// When the current connection first confirmed σ.
    connected_at: Option<Instant>,
    /// Since when σ shows each worker live, with the incarnation it shows.
    live_since: FxHashMap<u32, (u64, Instant)>,
    view: ClusterState,
    dirty: bool,
    estimate: Estimator,
    adopting: Option<Adopting>,
    adopt_grace: Duration,
}

impl SigmaView {
    pub(super) fn new(adopt_grace: Duration) -> SigmaView {
        SigmaView {
            sigma: None,
            broken: false,
            connected: false,
            last_confirmed: None,
            connected_at: None,
            live_since: FxHashMap::default(),
            view: ClusterState::new(),
            dirty: false,
            estimate: Estimator::new(),
            adopting: None,
            adopt_grace,
        }
    }

    /// Gives back the replica's table capacity once a burst is over (σ does not change).
    pub(super) fn shrink_sparse(&mut self) {
        if let Some(s) = &mut self.sigma {
            s.shrink_sparse();
        }
    }

    pub(super) fn sigma(&self) -> Option<&Sigma> {
        self.sigma.as_ref()
    }

    /// True while σ is not confirmed current by the snapshot service.
    pub(super) fn is_stale(&self) -> bool {
        self.sigma.is_some() && (!self.connected || self.broken)
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
    /// of another epoch than the one it replaces (the snapshot service restarted): then it
    /// is adopted gradually (see the module docs).
    pub(super) fn install(&mut self, sigma: Sigma, now: Instant) -> bool {
        let new_epoch = self
            .sigma
            .as_ref()
            .is_some_and(|s| s.epoch() != sigma.epoch());
        let previous = self.sigma.replace(sigma);
        self.broken = false;
        self.confirmed(now);
        self.dirty = true;
        if new_epoch {
            if !self.estimate.running() {
                // Never saw it go away (the stream broke and came back at once): carry the
                // last view forward from now.
                let view = self.view.clone();
                self.estimate.start(&view, now, |_| None);
            }
            // Only the previous epoch's σ: an adoption in progress keeps its own previous.
            let previous = match self.adopting.take() {
                Some(a) => a.previous,
                None => previous.unwrap_or_else(|| Sigma::new("")),
            };
            self.adopting = Some(Adopting {
                previous,
                until: now + self.adopt_grace,
            });
            self.live_since.clear();
        } else if self.adopting.is_none() {
            self.estimate.stop();
        }
        self.track_live(now);
        self.end_adoption_if_done(now);
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
        // σ moved in the same epoch: it is current again, the estimate has done its job
        // (unless a new epoch is still being adopted).
        if self.adopting.is_none() {
            self.estimate.stop();
        }
        self.track_live(now);
        self.end_adoption_if_done(now);
        Ok(())
    }

    /// The snapshot service confirmed σ (a snapshot, a delta, or the stream is up again).
    pub(super) fn confirmed(&mut self, now: Instant) {
        if !self.connected {
            self.connected_at = Some(now);
        }
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

    /// Starts carrying the view forward from when σ was last confirmed (the caller has just
    /// rebuilt the view). `max_tokens` gives an own reservation's cap.
    pub(super) fn start_estimate(&mut self, max_tokens: impl Fn(RequestKey) -> Option<u32>) {
        if self.sigma.is_none() || self.estimate.running() {
            return;
        }
        let since = self.last_confirmed.unwrap_or_else(Instant::now);
        self.estimate.start(&self.view, since, max_tokens);
    }

    /// Learns the ranks' pace from σ (while it is current and not being adopted).
    pub(super) fn learn(&mut self, now: Instant) {
        if self.connected
            && self.adopting.is_none()
            && let Some(s) = &self.sigma
        {
            self.estimate.observe_sigma(s.cluster(), now);
        }
    }

    /// σ reported a request finished after `tokens` tokens.
    pub(super) fn learn_finished(&mut self, tokens: u32) {
        self.estimate.observe_finished(tokens);
    }

    /// Whether decisions are carried by the estimate (σ stale, or a new σ being adopted).
    pub(super) fn estimating(&self) -> bool {
        self.estimate.running()
    }

    /// Whether a new σ is being adopted.
    pub(super) fn adopting(&self) -> bool {
        self.adopting.is_some()
    }

    /// Workers the view keeps from before a restart of the snapshot service (not back yet).
    pub(super) fn awaited(&self) -> usize {
        let (Some(s), Some(c)) = (&self.sigma, self.estimate.cluster()) else {
            return 0;
        };
        if self.adopting.is_none() {
            return 0;
        }
        c.live_worker_ids()
            .filter(|&w| s.worker(w).is_none())
            .count()
    }

    /// Whether `worker` is one the new σ does not know yet (routing to it is answered stale
    /// and reserved when it is back).
    pub(super) fn away(&self, worker: u32) -> bool {
        self.adopting.is_some()
            && self
                .sigma
                .as_ref()
                .is_some_and(|s| s.worker(worker).is_none())
    }

    /// When σ, current, has shown `worker` live with `incarnation` since (and this connection
    /// has confirmed σ since): from then on the worker's own reports are in σ. None if σ
    /// does not show it so.
    pub(super) fn ready_at(&self, worker: u32, incarnation: u64) -> Option<Instant> {
        self.live_entry(worker)
            .filter(|&(inc, _)| inc == incarnation)
            .map(|(_, ready)| ready)
    }

    /// [`Self::ready_at`] for the incarnation σ shows `worker` live with now.
    pub(super) fn back_at(&self, worker: u32) -> Option<Instant> {
        self.live_entry(worker).map(|(_, ready)| ready)
    }

    /// The incarnation σ shows `worker` live with, and when its reports are in σ; None while
    /// σ is not current. One lookup serves both [`Self::ready_at`] and [`Self::back_at`].
    fn live_entry(&self, worker: u32) -> Option<(u64, Instant)> {
        if !self.connected {
            return None;
        }
        let &(inc, since) = self.live_since.get(&worker)?;
        Some((inc, self.connected_at.map_or(since, |c| c.max(since))))
    }

    /// Ends the estimate once σ is current (connected, not adopting) for [`RESUME_LINGER`]
    /// without moving: a resubscription that missed nothing brings no delta.
    fn end_estimate_if_current(&mut self, now: Instant) {
        let current_for = self
            .connected_at
            .map_or(Duration::ZERO, |c| now.saturating_duration_since(c));
        if self.connected
            && !self.broken
            && self.adopting.is_none()
            && self.estimate.running()
            && current_for >= RESUME_LINGER
        {
            self.estimate.stop();
            self.dirty = true;
        }
    }

    /// Ends an adoption once every worker of the estimate is back, or at its deadline.
    /// Returns whether it ended.
    pub(super) fn end_adoption_if_done(&mut self, now: Instant) -> bool {
        let Some(a) = &self.adopting else {
            return false;
        };
        let all_back = match (&self.sigma, self.estimate.cluster()) {
            (Some(s), Some(c)) => c.live_worker_ids().all(|w| s.worker(w).is_some()),
            _ => true,
        };
        if !all_back && now < a.until {
            return false;
        }
        self.adopting = None;
        if self.connected {
            self.estimate.stop();
        }
        self.dirty = true;
        true
    }

    /// Steps the estimate forward; the view is rebuilt if it changed.
    pub(super) fn advance(&mut self, now: Instant) -> Advanced {
        let did = self.estimate.advance(now);
        if did.changed() {
            self.dirty = true;
        }
        did
    }

    fn track_live(&mut self, now: Instant) {
        let Some(s) = &self.sigma else { return };
        let mut seen: FxHashMap<u32, (u64, Instant)> = FxHashMap::default();
        for w in s.workers() {
            if w.liveness == Liveness::Live {
                let since = match self.live_since.get(&w.id) {
                    Some(&(inc, t)) if inc == w.incarnation => t,
                    _ => now,
                };
                seen.insert(w.id, (w.incarnation, since));
            }
        }
        self.live_since = seen;
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

    /// The address of a worker as σ knows it (or, while a new σ is adopted and does not know
    /// the worker yet, as the previous one did; empty if unknown).
    pub(super) fn endpoint(&self, worker: u32) -> String {
        self.sigma
            .as_ref()
            .and_then(|s| s.endpoint(worker))
            .or_else(|| {
                let a = self.adopting.as_ref()?;
                self.away(worker).then(|| a.previous.endpoint(worker))?
            })
            .unwrap_or_default()
            .to_owned()
    }

    /// The incarnation of a worker as σ knows it (or the previous σ, as for [`Self::endpoint`]).
    pub(super) fn incarnation(&self, worker: u32) -> Option<u64> {
        let s = self.sigma.as_ref()?;
        if self.away(worker) {
            return self.adopting.as_ref()?.previous.incarnation(worker);
        }
        s.incarnation(worker)
    }

    // ---------------------------------------------------------------- the view

    pub(super) fn cluster(&self) -> &ClusterState {
        &self.view
    }

    /// Runs `decide` on the view with the `closed` ranks not accepting (their load still
    /// counts), then reopens them: the rank split's ranks another replica owns. Every closed
    /// rank has free slots, so it was accepting.
    pub(super) fn with_closed<R>(
        &mut self,
        closed: &[u32],
        decide: impl FnOnce(&ClusterState) -> R,
    ) -> R {
        for &w in closed {
            self.view.set_accepting(w, false).ok();
        }
        let decided = decide(&self.view);
        for &w in closed {
            self.view.set_accepting(w, true).ok();
        }
        decided
    }

    /// The next decision needs a rebuild (an own reservation may have expired).
    pub(super) fn mark_dirty(&mut self) {
        self.dirty = true;
    }

    /// Whether any worker in the view takes new requests.
    pub(super) fn accepting_any(&self) -> bool {
        self.view.accepting_worker_ids().next().is_some()
    }

    /// [`Self::accepting_any`] of the view as the next rebuild would make it, without
    /// rebuilding it, when that answer is σ's own: σ is current and neither an estimate nor
    /// an adoption carries the view, so a rebuild copies σ's workers and their accepting
    /// flags as they are (own reservations add requests, not workers). None when only a
    /// rebuild can say. A pooled Assign asks this on arrival; rebuilding the view there (a
    /// copy of σ's `ClusterState`) after every σ change cost one copy per Assign under
    /// telemetry load, where one per tick does.
    pub(super) fn accepting_any_without_rebuild(&self) -> Option<bool> {
        let plain =
            self.connected && !self.broken && !self.estimate.running() && self.adopting.is_none();
        let sigma = self.sigma.as_ref().filter(|_| plain)?;
        if !self.dirty {
            return Some(self.accepting_any());
        }
        Some(sigma.cluster().accepting_worker_ids().next().is_some())
    }

    /// Counts an admission at once (and in the estimate, while one runs).
    pub(super) fn reserve(&mut self, info: RequestInfo, max_tokens: Option<u32>, group: &GroupId) {
        self.estimate.admit(&info, max_tokens);
        if let Err(e) = self.view.reserve(info) {
            tracing::warn!(group = %group, error = %e, "admission not applicable to the view");
        }
    }

    /// Stops counting a request (σ still shows a released one until the Release is applied;
    /// the next rebuild brings it back until then, which only over-counts a little for a
    /// moment).
    pub(super) fn remove(&mut self, key: RequestKey) {
        self.estimate.remove(key);
        self.view.remove(key).ok();
    }

    /// σ is behind: keep the worker out of this view until σ moves.
    pub(super) fn refuse_worker(&mut self, worker: u32) {
        self.view.set_accepting(worker, false).ok();
    }

    /// Rebuilds the view if σ moved since the last rebuild (or the estimate did): from σ plus
    /// own reservations σ does not show yet; while σ is stale, from the estimate; while a new
    /// σ is adopted, from σ for the workers it knows and the estimate for the others. Drops
    /// own reservations that σ shows, that expired or that are void.
    pub(super) fn refresh(
        &mut self,
        own: &mut Reservations,
        now: Instant,
        group: &GroupId,
    ) -> Advanced {
        self.end_adoption_if_done(now);
        self.end_estimate_if_current(now);
        let did = self.advance(now);
        if !self.dirty {
            return did;
        }
        self.dirty = false;
        own.prune(self.sigma.as_ref(), now);
        let Some(sigma) = &self.sigma else { return did };
        if self.adopting.is_none()
            && let Some(estimated) = self.estimate.cluster()
        {
            // σ is stale: the estimate carries σ and the own reservations (those dropped since,
            // e.g. expired, leave it).
            let gone: Vec<RequestKey> = estimated
                .requests()
                .map(|r| r.key)
                .filter(|&k| k >= LOCAL_KEY_BASE && !own.contains(k))
                .collect();
            for k in gone {
                self.estimate.remove(k);
            }
            if let Some(estimated) = self.estimate.cluster() {
                self.view.clone_from(estimated);
            }
            return did;
        }
        // Into the view's own tables: this runs on every tick after σ moved.
        self.view.clone_from(sigma.cluster());
        own.drop_void(sigma);
        for (key, res, current) in own.for_view(sigma) {
            // One on a suspect worker cannot be placed (the view refuses new work for it) and
            // is left out until the worker is live again: it takes no new work either way.
            let placed = current && self.view.reserve(res.info(key)).is_ok();
            if !placed {
                tracing::trace!(group = %group, request_id = %res.request_id, "own reservation not placeable in view");
            }
        }
        if self.adopting.is_some()
            && let Some(estimated) = self.estimate.cluster()
        {
            carry_over(&mut self.view, estimated, sigma, own);
        }
        did
    }
}

/// Adds to `view` (built on a new σ) every worker σ does not know yet, as the estimate has it:
/// its load and slots, σ's requests under carried keys, own reservations under their keys.
fn carry_over(
    view: &mut ClusterState,
    estimated: &ClusterState,
    sigma: &Sigma,
    own: &Reservations,
) {
    let away: Vec<u32> = estimated
        .live_worker_ids()
        .filter(|&w| sigma.worker(w).is_none())
        .collect();
    for w in away {
        let Some(info) = estimated.worker(w) else {
            continue;
        };
        if view.upsert_worker(w, info.capacity).is_err() {
            continue;
        }
        for r in estimated.requests_of(w) {
            let mut r = r.clone();
            if r.key >= LOCAL_KEY_BASE {
                if !own.contains(r.key) {
                    continue;
                }
            } else {
                r.key += CARRIED_KEY_BASE;
            }
            view.reserve(r).ok();
        }
        if !info.accepting {
            view.set_accepting(w, false).ok();
        }
    }
}
