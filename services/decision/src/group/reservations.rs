//! This service's own reservations that σ does not show yet: the second of the two per-request
//! state machines (a request's is in [`super::requests`]).
//!
//! `InFlight` (in a `Reserve` call) -> `Committed` (accepted at σ's epoch and version; waiting
//! for the delta that shows it) or `Uncommitted` (decided while the snapshot service was away,
//! or its call failed: to be reserved again when it is back). A reservation is forgotten once
//! σ shows it, once σ passed the version that accepted it, or when uncommitted past its TTL.
//! A new epoch (the snapshot service restarted) makes every committed one uncommitted again.
//!
//! An admission σ shows before it was sent (another replica, or an earlier incarnation of this
//! one, placed the id) is forgotten like any other, but σ's placement is kept with its key
//! until [`Reservations::take_lost`]: σ may drop the id again (released, finished) before the
//! next `Reserve` call, and the caller is still owed that placement.
//!
//! Owns: the reservations by key, the outbox (admitted, not sent yet), the list to re-commit,
//! the `Reserve` calls in flight and the key of each reservation in them, the ids to release
//! (one `Release` call) and those released recently (so a repeated `Cancel` finds nothing).
//! It decides what goes into the next `Reserve` call; [`super::wire`] builds the message. It
//! reads σ but never changes it, and knows nothing of callers.

use std::time::{Duration, Instant};

use br_core::{Phase, RequestInfo, RequestKey};
use br_proto::valid::RequestId;
use br_sigma::{Hints, Liveness, Sigma};
use rustc_hash::FxHashMap;

mod calls;
mod release;

/// Where σ places a request (what the view reads from σ, and what a reservation lost to
/// another replica is answered with): worker, incarnation, and σ's version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Placed {
    pub(super) worker: u32,
    pub(super) incarnation: u64,
    pub(super) sigma_version: u64,
}

/// One reservation to make at the snapshot service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub request_id: RequestId,
    pub worker: u32,
    pub incarnation: u64,
    pub prompt_tokens: u32,
    pub prompt_hash: Option<u64>,
    pub max_tokens: Option<u32>,
    /// The gateway's hints on the output, from the Assign.
    pub hints: Hints,
}

impl Reservation {
    /// The reservation as the view counts it: queued on its worker.
    pub(super) fn info(&self, key: RequestKey) -> RequestInfo {
        RequestInfo {
            key,
            worker: self.worker,
            prompt_tokens: self.prompt_tokens,
            generated: 0,
            phase: Phase::Queued,
            prompt_hash: self.prompt_hash,
            oracle_output: None,
            expected_output: self.hints.expected_output,
            class: self.hints.class,
        }
    }
}

/// One `Reserve` call to make: the assignments of one tick (or a re-commit after an outage).
#[derive(Debug, Clone)]
pub struct ReserveJob {
    pub id: u64,
    pub reservations: Vec<Reservation>,
    /// On-arrival policies route regardless of free slots, like today's routers, and the
    /// request waits in the rank's own queue.
    pub queue_if_full: bool,
}

/// How a `Reserve` call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveOutcome {
    /// No answer (unreachable, timed out, refused as a whole): nothing is known committed.
    Failed { error: String },
    /// The snapshot service answered, at σ's `epoch` and `version`. A reservation in neither
    /// list is treated as not committed.
    Answered {
        epoch: u64,
        version: u64,
        accepted: Vec<String>,
        rejected: Vec<Rejection>,
    },
}

/// One reservation the snapshot service refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub request_id: String,
    pub reason: RejectReason,
    pub detail: String,
}

/// Why the snapshot service refused a reservation: the contract's own enum (a plain enum, no
/// message), whose metric label is defined once, in br-proto (`RejectReason::label`).
pub use br_proto::v1::RejectReason;

/// The worker cannot take it, which σ did not show yet: another worker may.
pub fn worker_refused(reason: RejectReason) -> bool {
    matches!(
        reason,
        RejectReason::WorkerFenced
            | RejectReason::WorkerCordoned
            | RejectReason::UnknownWorker
            | RejectReason::StaleIncarnation
            | RejectReason::WorkerFull
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LocalState {
    /// In a `Reserve` call.
    InFlight,
    /// Accepted at σ (epoch, version); waiting for the delta to show it.
    Committed { epoch: u64, version: u64 },
    /// Decided without the snapshot service; to be reserved when it is back.
    Uncommitted { since: Instant },
}

/// One of this service's reservations that σ does not show yet.
#[derive(Debug, Clone)]
struct Local {
    res: Reservation,
    state: LocalState,
    /// When it was admitted (the gateway had its answer soon after, at the latest when it
    /// became uncommitted and was answered stale).
    admitted: Instant,
    /// Cancelled while its `Reserve` was in flight: release it once that call is answered (a
    /// Release sent now could reach the snapshot service before the Reserve and miss it).
    release_when_done: bool,
}

/// A `Reserve` call in flight: the key of each reservation in it.
struct Inflight {
    keys: Vec<RequestKey>,
    ids: Vec<RequestId>,
    recommit: bool,
}

/// What goes into the next `Reserve` call (see [`Reservations::next_batch`]).
pub(super) struct Batch {
    /// To reserve.
    pub(super) send: Vec<RequestKey>,
    /// Admitted, but σ showed the id before it was sent (the own copy is gone): answer from σ.
    pub(super) lost: Vec<RequestKey>,
    /// Re-commits after an outage (their callers were answered already).
    pub(super) recommit: bool,
    /// Uncommitted ones forgotten instead of re-committed: admitted before their worker was
    /// back in σ, and its reports since do not list them (finished, or never sent to it).
    pub(super) dropped: Vec<RequestKey>,
}

/// When re-commits go out (see [`Reservations::next_batch`]).
pub(super) struct Recommit<F: Fn(u32, u64) -> Option<Instant>> {
    pub(super) now: Instant,
    /// How long a worker's reports take to show in σ once it is back.
    pub(super) settle: Duration,
    /// Since when σ, current, shows the worker live with this incarnation.
    pub(super) ready_at: F,
}

/// A `Reserve` call that returned, without the reservations cancelled meanwhile.
pub(super) struct Finished {
    keys: Vec<RequestKey>,
    ids: Vec<RequestId>,
    pub(super) recommit: bool,
}

/// A `Reserve` answer matched to the reservations of the call.
pub(super) struct Sorted {
    pub(super) accepted: Vec<(RequestKey, RequestId)>,
    pub(super) rejected: Vec<(RequestKey, Rejection)>,
    /// Neither accepted nor rejected.
    pub(super) unanswered: Vec<RequestKey>,
}

impl Finished {
    pub(super) fn keys(&self) -> &[RequestKey] {
        &self.keys
    }

    /// Matches the answer to the call by id (not by σ: it may show a request before its
    /// `Reserve` answer arrives, and then the own copy is gone already).
    pub(super) fn sort(&self, accepted: &[String], rejected: Vec<Rejection>) -> Sorted {
        let mut by_id: FxHashMap<&str, (RequestKey, &RequestId)> = self
            .ids
            .iter()
            .zip(&self.keys)
            .map(|(id, &k)| (id.as_str(), (k, id)))
            .collect();
        let accepted = accepted
            .iter()
            .filter_map(|id| by_id.remove(id.as_str()))
            .map(|(k, id)| (k, id.clone()))
            .collect();
        let rejected = rejected
            .into_iter()
            .filter_map(|rej| Some((by_id.remove(rej.request_id.as_str())?.0, rej)))
            .collect();
        let unanswered = by_id.into_values().map(|(k, _)| k).collect();
        Sorted {
            accepted,
            rejected,
            unanswered,
        }
    }
}

/// Whether σ shows `worker` with this incarnation and not fenced.
fn current(sigma: &Sigma, worker: u32, incarnation: u64) -> bool {
    sigma.incarnation(worker) == Some(incarnation)
        && sigma.liveness(worker) != Some(Liveness::Fenced)
}

/// The own reservations of one group. See the module docs.
pub(super) struct Reservations {
    local: FxHashMap<RequestKey, Local>,
    /// Admitted since the last `Reserve` call.
    outbox: Vec<RequestKey>,
    /// Uncommitted, to reserve again when the snapshot service (and the worker) is back.
    recommit: Vec<RequestKey>,
    inflight: FxHashMap<u64, Inflight>,
    next_job: u64,
    releases: Vec<String>,
    /// Ids released recently (σ may still show them until the Release is applied), so a
    /// repeated Cancel says NOT_FOUND.
    released: FxHashMap<RequestId, Instant>,
    /// Outbox keys forgotten because σ showed their id placed elsewhere: that placement.
    placed_elsewhere: FxHashMap<RequestKey, Placed>,
    max_inflight: usize,
    /// How long an uncommitted reservation is kept.
    ttl: Duration,
}

impl Reservations {
    pub(super) fn new(max_inflight: usize, ttl: Duration) -> Reservations {
        Reservations {
            local: FxHashMap::default(),
            outbox: Vec::new(),
            recommit: Vec::new(),
            inflight: FxHashMap::default(),
            next_job: 1,
            releases: Vec::new(),
            released: FxHashMap::default(),
            placed_elsewhere: FxHashMap::default(),
            max_inflight,
            ttl,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.local.len()
    }

    /// Holds nothing that time acts on: no reservation, call, release or recent release.
    pub(super) fn is_idle(&self) -> bool {
        self.local.is_empty()
            && self.outbox.is_empty()
            && self.recommit.is_empty()
            && self.inflight.is_empty()
            && self.releases.is_empty()
            && self.released.is_empty()
            && self.placed_elsewhere.is_empty()
    }

    /// `Reserve` calls in flight.
    pub(super) fn inflight(&self) -> usize {
        self.inflight.len()
    }

    pub(super) fn inflight_full(&self) -> bool {
        self.inflight.len() >= self.max_inflight
    }

    pub(super) fn uncommitted(&self) -> usize {
        self.local
            .values()
            .filter(|l| matches!(l.state, LocalState::Uncommitted { .. }))
            .count()
    }

    /// A new admission: in flight from now on, sent with the next `Reserve` call.
    pub(super) fn admit(&mut self, key: RequestKey, res: Reservation, now: Instant) {
        self.local.insert(
            key,
            Local {
                res,
                state: LocalState::InFlight,
                admitted: now,
                release_when_done: false,
            },
        );
        self.outbox.push(key);
    }

    pub(super) fn contains(&self, key: RequestKey) -> bool {
        self.local.contains_key(&key)
    }

    /// The gateway's `max_tokens` of a reservation, if it gave one.
    pub(super) fn max_tokens(&self, key: RequestKey) -> Option<u32> {
        self.local.get(&key).and_then(|l| l.res.max_tokens)
    }

    /// Forgets a reservation (nothing is released); returns the state it was in.
    pub(super) fn remove(&mut self, key: RequestKey) -> Option<LocalState> {
        self.local.remove(&key).map(|l| l.state)
    }

    /// Not (known to be) at the snapshot service: reserve it again when it is back.
    pub(super) fn mark_uncommitted(&mut self, key: RequestKey, now: Instant) {
        if let Some(l) = self.local.get_mut(&key) {
            l.state = LocalState::Uncommitted { since: now };
            self.recommit.push(key);
        }
    }

    /// The snapshot service restarted: what it accepted before is gone unless the workers
    /// report it. Reserve again whatever σ does not show.
    pub(super) fn recommit_committed(&mut self, now: Instant) {
        for (key, l) in &mut self.local {
            if matches!(l.state, LocalState::Committed { .. }) {
                l.state = LocalState::Uncommitted { since: now };
                self.recommit.push(*key);
            }
        }
    }

    // ---------------------------------------------------------------- against σ

    /// Forgets own reservations σ shows now (or already dropped again), and uncommitted ones
    /// past their TTL. O(own reservations), run on every σ change.
    pub(super) fn prune(&mut self, sigma: Option<&Sigma>, now: Instant) {
        let Some(sigma) = sigma else { return };
        let ttl = self.ttl;
        let mut unsent_placed = FxHashMap::default();
        self.local.retain(|key, l| {
            if let Some(r) = sigma.request(l.res.request_id.as_str()) {
                if l.state == LocalState::InFlight {
                    unsent_placed.insert(
                        *key,
                        Placed {
                            worker: r.worker,
                            incarnation: r.incarnation,
                            sigma_version: sigma.version(),
                        },
                    );
                }
                return false; // σ shows it now
            }
            match l.state {
                LocalState::Committed { epoch, version } => {
                    // σ passed the version that accepted it: it already left σ again.
                    !(sigma.epoch() == epoch && sigma.version() >= version)
                }
                LocalState::Uncommitted { since } => now.saturating_duration_since(since) < ttl,
                LocalState::InFlight => true,
            }
        });
        // Only those not sent yet: a sent one's `Reserve` answer says what became of it.
        if !unsent_placed.is_empty() {
            for key in &self.outbox {
                if let Some(p) = unsent_placed.remove(key) {
                    self.placed_elsewhere.insert(*key, p);
                }
            }
        }
    }

    /// Forgets reservations on a fenced or replaced worker: they are void. Kept: those in
    /// flight, uncommitted ones on a worker σ does not show (after a snapshot-service restart
    /// σ is rebuilt from the workers' hellos, and it may come back with the same
    /// incarnation), and cancelled ones waiting for their call to return.
    pub(super) fn drop_void(&mut self, sigma: &Sigma) {
        self.local.retain(|_, l| {
            let waiting = sigma.worker(l.res.worker).is_none()
                && matches!(l.state, LocalState::Uncommitted { .. });
            l.release_when_done
                || current(sigma, l.res.worker, l.res.incarnation)
                || waiting
                || l.state == LocalState::InFlight
        });
    }

    /// The reservations the view counts, and whether their worker is current in σ (a
    /// cancelled one counts for nothing).
    pub(super) fn for_view<'a>(
        &'a self,
        sigma: &'a Sigma,
    ) -> impl Iterator<Item = (RequestKey, &'a Reservation, bool)> + 'a {
        self.local
            .iter()
            .filter(|(_, l)| !l.release_when_done)
            .map(|(&k, l)| (k, &l.res, current(sigma, l.res.worker, l.res.incarnation)))
    }

    /// Whether an uncommitted reservation is past its TTL (the next view rebuild drops it).
    pub(super) fn uncommitted_expired(&self, now: Instant) -> bool {
        self.local.values().any(|l| {
            matches!(l.state, LocalState::Uncommitted { since }
                if now.saturating_duration_since(since) >= self.ttl)
        })
    }
}
