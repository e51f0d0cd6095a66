//! The state of one group, owned by one task: the σ replica, the pool, the policy, the requests
//! by id (waiting, being reserved, answered), and this service's own reservations that σ does
//! not show yet. Synchronous and free of I/O, so every rule is unit-tested without a network;
//! [`crate::task`] drives it.
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

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use br_core::dispatch::Admission;
use br_core::{ClusterState, Mode, Phase, Policy, Pool, PoolEntry, RequestInfo, RequestKey};
use br_proto::v1;
use br_proto::valid::{GroupId, RequestId, ValidAssign};
use br_sigma::{Delta, Liveness, Sigma, SigmaError};
use rustc_hash::FxHashMap;
use tokio::sync::oneshot;

use crate::error::DecisionError;
use crate::metrics::GroupMetrics;

/// Keys of requests this service knows locally start here; σ's interned keys start at 1.
pub const LOCAL_KEY_BASE: RequestKey = 1 << 62;
/// On-arrival requests whose reservation is rejected are routed again at most this often.
const MAX_REROUTES: u32 = 4;

/// What a waiting `Assign` call receives.
pub type Reply = oneshot::Sender<Result<v1::AssignResponse, DecisionError>>;

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
}

impl Default for GroupConfig {
    fn default() -> Self {
        GroupConfig {
            max_pool: 65_536,
            answered_ttl: Duration::from_secs(60),
            answered_max: 262_144,
            max_inflight_reserves: 2,
            local_ttl: Duration::from_secs(60),
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

/// One `Reserve` call to make: the assignments of one tick (or a re-commit after an outage).
#[derive(Debug, Clone)]
pub struct ReserveJob {
    pub id: u64,
    pub request: v1::ReserveRequest,
    keys: Vec<RequestKey>,
    recommit: bool,
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
}

struct Waiter {
    call: u64,
    tx: Reply,
}

#[derive(Debug, Clone, Copy)]
struct Placement {
    worker: u32,
    incarnation: u64,
    admitted: Instant,
    sigma_version: u64,
}

enum State {
    Waiting,
    Reserving {
        at: Placement,
        /// Every caller has gone (cancelled or withdrawn): release once accepted.
        abandoned: bool,
        reroutes: u32,
    },
    Answered {
        resp: v1::AssignResponse,
        at: Instant,
        /// Callers the answer reached (a handler dropped before reading it gives one back).
        delivered: u32,
    },
}

struct Req {
    id: RequestId,
    prompt_tokens: u32,
    prompt_hash: Option<u64>,
    max_tokens: Option<u32>,
    arrived: Instant,
    state: State,
    waiters: Vec<Waiter>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LocalState {
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
    id: RequestId,
    worker: u32,
    incarnation: u64,
    prompt_tokens: u32,
    prompt_hash: Option<u64>,
    max_tokens: Option<u32>,
    state: LocalState,
    /// Cancelled while its `Reserve` was in flight: release it once that call is answered (a
    /// Release sent now could reach the snapshot service before the Reserve and miss it).
    release_when_done: bool,
}

impl Local {
    /// `queue_if_full` for on-arrival policies: like today's routers they route regardless of
    /// free slots and the request waits in the rank's own queue.
    fn reservation(&self, queue_if_full: bool) -> v1::Reservation {
        v1::Reservation {
            request_id: self.id.to_string(),
            worker_id: self.worker,
            incarnation: self.incarnation,
            prompt_tokens: self.prompt_tokens,
            prompt_hash: self.prompt_hash,
            max_tokens: self.max_tokens,
            queue_if_full,
        }
    }
}

/// The state of one group. See the module docs.
pub struct GroupCore {
    group: GroupId,
    policy: Box<dyn Policy>,
    mode: Mode,
    cfg: GroupConfig,
    metrics: GroupMetrics,

    sigma: Option<Sigma>,
    /// The replica failed to apply a delta halfway: it needs a fresh snapshot.
    sigma_broken: bool,
    view: ClusterState,
    view_dirty: bool,
    connected: bool,
    last_confirmed: Option<Instant>,

    pool: Pool,
    reqs: FxHashMap<RequestKey, Req>,
    ids: FxHashMap<RequestId, RequestKey>,
    next_key: RequestKey,
    answered: VecDeque<(Instant, RequestKey)>,
    answered_count: usize,

    local: FxHashMap<RequestKey, Local>,
    outbox: Vec<RequestKey>,
    recommit: Vec<RequestKey>,
    inflight: FxHashMap<u64, ReserveJob>,
    next_job: u64,
    releases: Vec<String>,
    /// Ids released recently (σ may still show them until the Release is applied), so a
    /// repeated Cancel says NOT_FOUND.
    released: FxHashMap<RequestId, Instant>,
    /// Admissions since the last tick want a tick soon.
    tick_wanted: bool,
    shutting_down: bool,
    scratch: Vec<Admission>,
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
        GroupCore {
            group,
            policy,
            mode,
            cfg,
            metrics,
            sigma: None,
            sigma_broken: false,
            view: ClusterState::new(),
            view_dirty: false,
            connected: false,
            last_confirmed: None,
            pool: Pool::new(),
            reqs: FxHashMap::default(),
            ids: FxHashMap::default(),
            next_key: LOCAL_KEY_BASE,
            answered: VecDeque::new(),
            answered_count: 0,
            local: FxHashMap::default(),
            outbox: Vec::new(),
            recommit: Vec::new(),
            inflight: FxHashMap::default(),
            next_job: 1,
            releases: Vec::new(),
            released: FxHashMap::default(),
            tick_wanted: false,
            shutting_down: false,
            scratch: Vec::new(),
        }
    }

    pub fn group(&self) -> &GroupId {
        &self.group
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// True once a complete σ was received (it stays true through outages: the service keeps
    /// answering from its last σ).
    pub fn has_sigma(&self) -> bool {
        self.sigma.is_some()
    }

    /// True while σ is not confirmed current by the snapshot service.
    pub fn is_stale(&self) -> bool {
        self.sigma.is_some() && (!self.connected || self.sigma_broken)
    }

    /// The position the Watch follower resubscribes from.
    pub fn position(&self) -> (u64, u64) {
        match &self.sigma {
            Some(s) if !self.sigma_broken => (s.epoch(), s.version()),
            _ => (0, 0),
        }
    }

    pub fn sigma(&self) -> Option<&Sigma> {
        self.sigma.as_ref()
    }

    /// Whether a tick should run soon (arrivals or returned requests since the last one).
    pub fn tick_wanted(&self) -> bool {
        self.tick_wanted
    }

    pub fn pool_len(&self) -> usize {
        self.pool.len()
    }

    pub fn stats(&self) -> GroupStats {
        let mut s = GroupStats {
            pool: self.pool.len(),
            answered: self.answered_count,
            local: self.local.len(),
            inflight_reserves: self.inflight.len(),
            sigma: self.sigma.as_ref().map(|s| (s.epoch(), s.version())),
            stale: self.is_stale(),
            ..GroupStats::default()
        };
        for r in self.reqs.values() {
            s.waiting_calls += r.waiters.len();
            if matches!(r.state, State::Reserving { .. }) {
                s.reserving += 1;
            }
        }
        s.uncommitted = self
            .local
            .values()
            .filter(|l| matches!(l.state, LocalState::Uncommitted { .. }))
            .count();
        s
    }

    /// Stops taking new requests (waiting ones are still served).
    pub fn shut_down(&mut self) {
        self.shutting_down = true;
    }

    // ---------------------------------------------------------------- σ from the Watch feed

    /// Installs a replica (a snapshot, or a σ built directly in tests).
    pub fn set_sigma(&mut self, sigma: Sigma, now: Instant) {
        let new_epoch = self
            .sigma
            .as_ref()
            .is_some_and(|s| s.epoch() != sigma.epoch());
        self.sigma = Some(sigma);
        self.sigma_broken = false;
        self.connected = true;
        self.last_confirmed = Some(now);
        if new_epoch {
            // The snapshot service restarted: what it accepted before is gone unless the
            // workers report it. Reserve again whatever σ does not show.
            for (key, l) in &mut self.local {
                if matches!(l.state, LocalState::Committed { .. }) {
                    l.state = LocalState::Uncommitted { since: now };
                    self.recommit.push(*key);
                }
            }
        }
        self.sigma_moved(now);
    }

    /// Applies a delta in order. An error means the replica must resubscribe (a gap, another
    /// epoch) or be replaced (a change failed halfway); it is kept for answering meanwhile.
    pub fn on_delta(&mut self, d: &Delta, now: Instant) -> Result<(), SigmaError> {
        let Some(sigma) = self.sigma.as_mut() else {
            return Err(SigmaError::Gap {
                have: 0,
                prev: d.prev_version,
            });
        };
        if self.sigma_broken {
            return Err(SigmaError::Invalid(
                "replica awaits a fresh snapshot".into(),
            ));
        }
        // Finished requests teach the predictors (BR-H); read their hashes before they leave.
        let mut finished = Vec::new();
        for c in &d.changes {
            if let Some(v1::change::Kind::RequestFinished(f)) = &c.kind {
                let hash = sigma.request(&f.request_id).and_then(|r| r.prompt_hash);
                finished.push((hash, f.generated_tokens));
            }
        }
        let before = sigma.version();
        match sigma.apply_delta(d) {
            Ok(()) => {}
            Err(e @ SigmaError::Change { .. }) => {
                if sigma.version() == before {
                    // A prefix of the delta was applied: the replica matches no version.
                    self.sigma_broken = true;
                    self.view_dirty = true;
                }
                return Err(e);
            }
            Err(e) => return Err(e),
        }
        for (hash, tokens) in finished {
            self.policy.observe_finished(hash, tokens);
        }
        self.connected = true;
        self.last_confirmed = Some(now);
        self.sigma_moved(now);
        Ok(())
    }

    /// The Watch stream is up again (the replica may still be catching up).
    pub fn on_connected(&mut self, now: Instant) {
        self.connected = true;
        self.last_confirmed = Some(now);
        self.update_gauges(now);
    }

    /// The Watch stream is gone since `at`: keep answering from the last σ plus own
    /// reservations.
    pub fn on_disconnected(&mut self, at: Instant, now: Instant) {
        if self.connected {
            self.last_confirmed = Some(at);
        }
        self.connected = false;
        self.update_gauges(now);
    }

    fn sigma_moved(&mut self, now: Instant) {
        self.view_dirty = true;
        self.prune_local(now);
        // Freed slots may admit waiting requests.
        if !self.pool.is_empty() {
            self.tick_wanted = true;
        }
        if let Some(s) = &self.sigma {
            self.metrics.sigma_version.set(s.version() as i64);
        }
    }

    /// Forgets own reservations σ shows now (or already dropped again), and uncommitted ones
    /// past their TTL. O(own reservations), run on every σ change.
    fn prune_local(&mut self, now: Instant) {
        let Some(sigma) = &self.sigma else { return };
        let ttl = self.cfg.local_ttl;
        self.local.retain(|_, l| {
            if sigma.request(l.id.as_str()).is_some() {
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
    }

    /// Rebuilds the view from σ plus own reservations σ does not show yet.
    fn refresh_view(&mut self, now: Instant) {
        if !self.view_dirty {
            return;
        }
        self.view_dirty = false;
        self.prune_local(now);
        let Some(sigma) = &self.sigma else { return };
        self.view = sigma.cluster().clone();
        let mut gone = Vec::new();
        for (&key, l) in &self.local {
            if l.release_when_done {
                continue; // cancelled: counts for nothing
            }
            let current = sigma.incarnation(l.worker) == Some(l.incarnation)
                && sigma.liveness(l.worker) != Some(Liveness::Fenced);
            // After a snapshot-service restart σ is rebuilt from the workers' hellos: a worker
            // not (yet) in σ may come back with the same incarnation.
            let absent = sigma.worker(l.worker).is_none();
            let placed = current
                && self
                    .view
                    .reserve(RequestInfo {
                        key,
                        worker: l.worker,
                        prompt_tokens: l.prompt_tokens,
                        generated: 0,
                        phase: Phase::Queued,
                        prompt_hash: l.prompt_hash,
                        oracle_output: None,
                    })
                    .is_ok();
            // A reservation on a fenced or replaced worker is void. One on a suspect worker
            // cannot be placed (the view refuses new work for it) and is left out until the
            // worker is live again: it takes no new work either way.
            let waiting = absent && matches!(l.state, LocalState::Uncommitted { .. });
            if !current && !waiting && !matches!(l.state, LocalState::InFlight) {
                gone.push(key);
            } else if !placed {
                tracing::trace!(group = %self.group, request_id = %l.id, "own reservation not placeable in view");
            }
        }
        for key in gone {
            self.local.remove(&key);
        }
    }

    // ---------------------------------------------------------------- calls

    /// A new `Assign` call (or a retry of one). The answer goes to `reply`, now or later.
    pub fn assign(&mut self, req: ValidAssign, call: u64, reply: Reply, now: Instant) {
        if let Some(&key) = self.ids.get(req.request_id.as_str()) {
            let Some(r) = self.reqs.get_mut(&key) else {
                let _ = reply.send(Err(DecisionError::ShuttingDown));
                return;
            };
            if r.prompt_tokens != req.prompt_tokens {
                let _ = reply.send(Err(DecisionError::Conflict {
                    request_id: req.request_id.to_string(),
                    first: r.prompt_tokens,
                    now: req.prompt_tokens,
                }));
                return;
            }
            match &mut r.state {
                State::Answered {
                    resp, delivered, ..
                } => {
                    if reply.send(Ok(resp.clone())).is_ok() {
                        *delivered += 1;
                    }
                }
                // A retry joins the same wait.
                State::Waiting | State::Reserving { .. } => {
                    if let State::Reserving { abandoned, .. } = &mut r.state {
                        *abandoned = false;
                    }
                    r.waiters.push(Waiter { call, tx: reply });
                }
            }
            return;
        }
        if self.shutting_down {
            let _ = reply.send(Err(DecisionError::ShuttingDown));
            return;
        }
        if self.sigma.is_none() {
            let _ = reply.send(Err(DecisionError::NoSigma(self.group.to_string())));
            return;
        }
        let known = self
            .sigma
            .as_ref()
            .and_then(|s| s.request(req.request_id.as_str()))
            .map(|sr| (sr.worker, sr.incarnation));
        if let Some((worker, incarnation)) = known {
            // σ already places this id (decided by an earlier incarnation of this service, or
            // routed without us): that is the answer, as for any retry.
            let key = self.next_key;
            self.next_key += 1;
            let version = self.sigma.as_ref().map_or(0, Sigma::version);
            self.ids.insert(req.request_id.clone(), key);
            self.reqs.insert(
                key,
                Req {
                    id: req.request_id,
                    prompt_tokens: req.prompt_tokens,
                    prompt_hash: req.prompt_hash,
                    max_tokens: req.max_tokens,
                    arrived: now,
                    state: State::Reserving {
                        at: Placement {
                            worker,
                            incarnation,
                            admitted: now,
                            sigma_version: version,
                        },
                        abandoned: false,
                        reroutes: 0,
                    },
                    waiters: vec![Waiter { call, tx: reply }],
                },
            );
            self.answer(key, false, now);
            return;
        }
        self.refresh_view(now);
        if self.view.accepting_worker_ids().next().is_none() {
            let _ = reply.send(Err(DecisionError::NoLiveWorker(self.group.to_string())));
            return;
        }
        if self.mode == Mode::Pooled && self.pool.len() >= self.cfg.max_pool {
            let _ = reply.send(Err(DecisionError::PoolFull {
                group: self.group.to_string(),
                max: self.cfg.max_pool,
            }));
            return;
        }
        let key = self.next_key;
        self.next_key += 1;
        let entry = PoolEntry {
            key,
            prompt_tokens: req.prompt_tokens,
            prompt_hash: req.prompt_hash,
            oracle_output: None,
        };
        self.ids.insert(req.request_id.clone(), key);
        self.reqs.insert(
            key,
            Req {
                id: req.request_id,
                prompt_tokens: req.prompt_tokens,
                prompt_hash: req.prompt_hash,
                max_tokens: req.max_tokens,
                arrived: now,
                state: State::Waiting,
                waiters: vec![Waiter { call, tx: reply }],
            },
        );
        match self.mode {
            Mode::Pooled => {
                // Refused only for a duplicate key, which fresh keys never are.
                if self.pool.push(entry).is_ok() {
                    self.tick_wanted = true;
                }
                self.metrics.pool_size.set(self.pool.len() as i64);
            }
            Mode::OnArrival => self.route_now(key, entry, 0, now),
        }
    }

    /// An on-arrival policy picks the worker at once.
    fn route_now(&mut self, key: RequestKey, entry: PoolEntry, reroutes: u32, now: Instant) {
        match self.policy.route(&entry, &self.view) {
            Some(worker) => self.admit(key, worker, reroutes, now),
            None => self.fail(key, DecisionError::NoLiveWorker(self.group.to_string())),
        }
    }

    /// A caller went away (its deadline passed or it disconnected). `undelivered`: it had an
    /// answer it never read.
    pub fn withdraw(&mut self, id: &str, call: u64, undelivered: bool) {
        let Some(&key) = self.ids.get(id) else { return };
        let Some(r) = self.reqs.get_mut(&key) else {
            return;
        };
        r.waiters.retain(|w| w.call != call);
        match &mut r.state {
            State::Answered { delivered, .. } => {
                if undelivered {
                    *delivered = delivered.saturating_sub(1);
                    if *delivered == 0 {
                        // Nobody got the answer: the gateway will not send it.
                        self.release_answered(key);
                    }
                }
            }
            _ => {
                if r.waiters.is_empty() {
                    self.abandon(key);
                }
            }
        }
    }

    /// Every caller of a waiting or reserving request has gone.
    fn abandon(&mut self, key: RequestKey) {
        let Some(r) = self.reqs.get_mut(&key) else {
            return;
        };
        match &mut r.state {
            State::Waiting => {
                self.pool.remove(key);
                self.metrics.pool_size.set(self.pool.len() as i64);
                self.forget(key);
            }
            State::Reserving { abandoned, .. } => *abandoned = true,
            State::Answered { .. } => {}
        }
    }

    /// `Decision.Cancel`.
    pub fn cancel(&mut self, id: &str) -> CancelOutcome {
        let Some(&key) = self.ids.get(id) else {
            // Not known here (e.g. decided by a previous incarnation of this service): release
            // it if σ holds it as a reservation.
            if self.released.contains_key(id) {
                return CancelOutcome::NotFound;
            }
            let queued = self
                .sigma
                .as_ref()
                .and_then(|s| s.request(id))
                .filter(|r| r.phase == Phase::Queued)
                .map(|r| (r.key, r.id.clone()));
            return match queued {
                Some((skey, rid)) => {
                    self.releases.push(id.to_owned());
                    self.released.insert(rid, Instant::now());
                    self.drop_from_view(skey);
                    CancelOutcome::Released
                }
                None => CancelOutcome::NotFound,
            };
        };
        let Some(r) = self.reqs.get_mut(&key) else {
            return CancelOutcome::NotFound;
        };
        match &mut r.state {
            State::Waiting => {
                for w in r.waiters.drain(..) {
                    let _ = w.tx.send(Err(DecisionError::Cancelled));
                }
                self.pool.remove(key);
                self.metrics.pool_size.set(self.pool.len() as i64);
                self.forget(key);
                CancelOutcome::Withdrawn
            }
            State::Reserving { abandoned, .. } => {
                for w in r.waiters.drain(..) {
                    let _ = w.tx.send(Err(DecisionError::Cancelled));
                }
                *abandoned = true;
                CancelOutcome::Withdrawn
            }
            State::Answered { .. } => {
                if self.release_answered(key) {
                    CancelOutcome::Released
                } else {
                    CancelOutcome::NotFound
                }
            }
        }
    }

    /// Releases the reservation of an answered request if it is still only reserved; forgets
    /// the request. Returns whether there was a reservation to release.
    fn release_answered(&mut self, key: RequestKey) -> bool {
        let Some(r) = self.reqs.get(&key) else {
            return false;
        };
        let id = r.id.clone();
        let mut released = false;
        // σ is the truth once it shows the request; before that, the own copy is.
        let in_sigma = self
            .sigma
            .as_ref()
            .and_then(|s| s.request(id.as_str()))
            .map(|sr| (sr.phase, sr.key));
        match in_sigma {
            Some((Phase::Running, _)) => return false, // the worker's telemetry owns it now
            Some((Phase::Queued, skey)) => {
                self.releases.push(id.to_string());
                self.drop_from_view(skey);
                if self.local.remove(&key).is_some() {
                    self.view.remove(key).ok();
                }
                released = true;
            }
            None => {
                if let Some(l) = self.local.get_mut(&key) {
                    match l.state {
                        LocalState::InFlight => l.release_when_done = true,
                        LocalState::Committed { .. } => {
                            self.releases.push(id.to_string());
                            self.local.remove(&key);
                        }
                        LocalState::Uncommitted { .. } => {
                            self.local.remove(&key);
                        }
                    }
                    self.view.remove(key).ok();
                    released = true;
                }
            }
        }
        self.forget(key);
        released
    }

    fn drop_from_view(&mut self, key: RequestKey) {
        // σ still shows it until the Release is applied; the next rebuild brings it back until
        // then, which only over-counts a little for a moment.
        self.view.remove(key).ok();
    }

    fn forget(&mut self, key: RequestKey) {
        if let Some(r) = self.reqs.remove(&key) {
            if matches!(r.state, State::Answered { .. }) {
                self.answered_count -= 1;
            }
            self.ids.remove(r.id.as_str());
        }
    }

    fn fail(&mut self, key: RequestKey, err: DecisionError) {
        if let Some(r) = self.reqs.get_mut(&key) {
            for w in r.waiters.drain(..) {
                let _ = w.tx.send(Err(err.clone()));
            }
        }
        if let Some(l) = self.local.remove(&key)
            && l.state != LocalState::InFlight
        {
            self.view.remove(key).ok();
        }
        self.pool.remove(key);
        self.forget(key);
    }

    // ---------------------------------------------------------------- ticks

    /// One dispatcher tick: pooled policies admit a batch from the pool.
    pub fn tick(&mut self, now: Instant) {
        self.tick_wanted = false;
        if self.sigma.is_none() {
            return;
        }
        let started = Instant::now();
        if self.mode == Mode::Pooled
            && !self.pool.is_empty()
            && self.inflight.len() < self.cfg.max_inflight_reserves
        {
            self.refresh_view(now);
            let mut out = std::mem::take(&mut self.scratch);
            out.clear();
            self.policy.dispatch(&mut self.pool, &self.view, &mut out);
            for a in &out {
                self.admit(a.key, a.worker, 0, now);
            }
            self.scratch = out;
            self.metrics.pool_size.set(self.pool.len() as i64);
        }
        self.metrics.ticks_total.inc();
        self.metrics
            .tick_duration
            .observe(started.elapsed().as_secs_f64());
    }

    /// Admits a request to a worker: applied to the view at once, queued for `Reserve`.
    fn admit(&mut self, key: RequestKey, worker: u32, reroutes: u32, now: Instant) {
        let Some(sigma) = &self.sigma else { return };
        let Some(incarnation) = sigma.incarnation(worker) else {
            self.fail(key, DecisionError::NoLiveWorker(self.group.to_string()));
            return;
        };
        let sigma_version = sigma.version();
        let Some(r) = self.reqs.get_mut(&key) else {
            return;
        };
        if self.mode == Mode::Pooled {
            self.metrics
                .pool_wait
                .observe(now.saturating_duration_since(r.arrived).as_secs_f64());
        }
        r.state = State::Reserving {
            at: Placement {
                worker,
                incarnation,
                admitted: now,
                sigma_version,
            },
            abandoned: r.waiters.is_empty(),
            reroutes,
        };
        let info = RequestInfo {
            key,
            worker,
            prompt_tokens: r.prompt_tokens,
            generated: 0,
            phase: Phase::Queued,
            prompt_hash: r.prompt_hash,
            oracle_output: None,
        };
        if let Err(e) = self.view.reserve(info) {
            tracing::warn!(group = %self.group, error = %e, "admission not applicable to the view");
        }
        self.local.insert(
            key,
            Local {
                id: r.id.clone(),
                worker,
                incarnation,
                prompt_tokens: r.prompt_tokens,
                prompt_hash: r.prompt_hash,
                max_tokens: r.max_tokens,
                state: LocalState::InFlight,
                release_when_done: false,
            },
        );
        self.outbox.push(key);
    }

    // ---------------------------------------------------------------- Reserve / Release

    /// The next `Reserve` call to make, if any and if fewer than the limit are in flight.
    /// While σ is stale nothing is sent: the admissions are answered at once (stale) and
    /// reserved when the snapshot service is back.
    pub fn take_reserve(&mut self, now: Instant) -> Option<ReserveJob> {
        if self.is_stale() {
            if !self.outbox.is_empty() {
                let keys = std::mem::take(&mut self.outbox);
                for key in keys {
                    self.mark_uncommitted(key, now);
                    self.answer(key, true, now);
                }
            }
            return None;
        }
        if self.inflight.len() >= self.cfg.max_inflight_reserves {
            return None;
        }
        let (keys, recommit) = if !self.outbox.is_empty() {
            (std::mem::take(&mut self.outbox), false)
        } else if !self.recommit.is_empty() {
            let mut keys = std::mem::take(&mut self.recommit);
            keys.retain(|k| {
                self.local
                    .get(k)
                    .is_some_and(|l| matches!(l.state, LocalState::Uncommitted { .. }))
            });
            // Only where σ shows the worker live with the same incarnation; the others wait
            // for it (a restarted snapshot service learns the workers from their hellos).
            let sigma = self.sigma.as_ref();
            let (ready, later): (Vec<RequestKey>, Vec<RequestKey>) =
                keys.into_iter().partition(|k| {
                    self.local.get(k).is_some_and(|l| {
                        sigma.is_some_and(|s| {
                            s.incarnation(l.worker) == Some(l.incarnation)
                                && s.liveness(l.worker) == Some(Liveness::Live)
                        })
                    })
                });
            self.recommit = later;
            let keys = ready;
            if keys.is_empty() {
                return None;
            }
            for k in &keys {
                if let Some(l) = self.local.get_mut(k) {
                    l.state = LocalState::InFlight;
                }
            }
            (keys, true)
        } else {
            return None;
        };
        let (with_local, without): (Vec<RequestKey>, Vec<RequestKey>) =
            keys.into_iter().partition(|k| self.local.contains_key(k));
        for key in without {
            // σ showed it before it was sent (placed by an earlier incarnation of this service).
            self.answer_from_sigma(key, now);
        }
        let queue_if_full = self.mode == Mode::OnArrival;
        let (keys, reservations): (Vec<RequestKey>, Vec<v1::Reservation>) = with_local
            .into_iter()
            .filter_map(|k| {
                self.local
                    .get(&k)
                    .map(|l| (k, l.reservation(queue_if_full)))
            })
            .unzip();
        if keys.is_empty() {
            return None;
        }
        let id = self.next_job;
        self.next_job += 1;
        let job = ReserveJob {
            id,
            request: v1::ReserveRequest {
                group: self.group.to_string(),
                reservations,
            },
            keys,
            recommit,
        };
        self.inflight.insert(id, job.clone());
        Some(job)
    }

    /// The outcome of a `Reserve` call.
    pub fn on_reserve_done(
        &mut self,
        job_id: u64,
        result: Result<v1::ReserveResponse, tonic::Status>,
        now: Instant,
    ) {
        // A tick skipped for the in-flight limit may admit now.
        if !self.pool.is_empty() {
            self.tick_wanted = true;
        }
        let Some(mut job) = self.inflight.remove(&job_id) else {
            return;
        };
        // Cancelled while in flight: release (best effort, whatever the outcome) and forget.
        let mut keep = Vec::with_capacity(job.keys.len());
        let mut reservations = Vec::with_capacity(job.keys.len());
        for (key, r) in job.keys.iter().zip(job.request.reservations.drain(..)) {
            if self.local.get(key).is_some_and(|l| l.release_when_done) {
                self.local.remove(key);
                self.releases.push(r.request_id);
            } else {
                keep.push(*key);
                reservations.push(r);
            }
        }
        job.keys = keep;
        job.request.reservations = reservations;
        match result {
            Err(status) => {
                tracing::warn!(group = %self.group, code = ?status.code(), error = %status.message(),
                    n = job.keys.len(), "Reserve failed; answering from the local view (stale)");
                self.metrics
                    .reserve_failed("unavailable", job.keys.len() as u64);
                for key in job.keys {
                    self.mark_uncommitted(key, now);
                    if !job.recommit {
                        self.answer(key, true, now);
                    }
                }
            }
            Ok(resp) => {
                // By the job's own list: σ may show a request before its Reserve answer
                // arrives, and then the own copy is gone already.
                let mut by_id: FxHashMap<&str, RequestKey> = job
                    .request
                    .reservations
                    .iter()
                    .zip(&job.keys)
                    .map(|(r, k)| (r.request_id.as_str(), *k))
                    .collect();
                let mut accepted = Vec::with_capacity(resp.accepted.len());
                for id in &resp.accepted {
                    if let Some(k) = by_id.remove(id.as_str()) {
                        accepted.push((k, id.clone()));
                    }
                }
                let mut rejected = Vec::with_capacity(resp.rejected.len());
                for rej in &resp.rejected {
                    if let Some(k) = by_id.remove(rej.request_id.as_str()) {
                        rejected.push((k, rej.reason, rej.detail.clone()));
                    }
                }
                let unanswered: Vec<RequestKey> = by_id.into_values().collect();
                for (key, id) in accepted {
                    if let Some(l) = self.local.get_mut(&key) {
                        l.state = LocalState::Committed {
                            epoch: resp.epoch,
                            version: resp.version,
                        };
                    }
                    if job.recommit {
                        continue;
                    }
                    if self.reqs.contains_key(&key) {
                        self.answer(key, false, now);
                    } else {
                        // Forgotten meanwhile (nobody waits): it is in σ now, release it by
                        // id (the own copy may be gone already).
                        self.releases.push(id);
                        if self.local.remove(&key).is_some() {
                            self.view.remove(key).ok();
                        }
                    }
                }
                for (key, reason, detail) in rejected {
                    self.rejected(key, reason, &detail, job.recommit, now);
                }
                for key in unanswered {
                    // A server that neither accepts nor rejects: treat as not committed.
                    self.metrics.reserve_failed("unanswered", 1);
                    self.mark_uncommitted(key, now);
                    if !job.recommit {
                        self.answer(key, true, now);
                    }
                }
            }
        }
    }

    fn mark_uncommitted(&mut self, key: RequestKey, now: Instant) {
        if let Some(l) = self.local.get_mut(&key) {
            l.state = LocalState::Uncommitted { since: now };
            self.recommit.push(key);
        }
    }

    /// Sends the answer of an admitted request to its callers.
    fn answer(&mut self, key: RequestKey, stale: bool, now: Instant) {
        let Some(r) = self.reqs.get_mut(&key) else {
            // Forgotten meanwhile: nobody waits for this reservation.
            self.release_local(key);
            return;
        };
        let State::Reserving { at, abandoned, .. } = r.state else {
            return;
        };
        let endpoint = self
            .sigma
            .as_ref()
            .and_then(|s| s.endpoint(at.worker))
            .unwrap_or_default()
            .to_owned();
        let resp = v1::AssignResponse {
            worker_id: at.worker,
            endpoint,
            policy: self.policy.name().to_owned(),
            pool_wait_us: match self.mode {
                Mode::Pooled => at.admitted.saturating_duration_since(r.arrived).as_micros() as u64,
                Mode::OnArrival => 0,
            },
            incarnation: at.incarnation,
            sigma_version: at.sigma_version,
            stale,
        };
        let mut delivered = 0;
        if !abandoned {
            for w in r.waiters.drain(..) {
                if w.tx.send(Ok(resp.clone())).is_ok() {
                    delivered += 1;
                }
            }
        }
        r.waiters.clear();
        if delivered == 0 {
            // Every caller left before the answer: the gateway will not send the request. A
            // committed reservation is released by id (the own copy may have been pruned when
            // σ showed an earlier request of the same id).
            if stale {
                self.release_local(key);
            } else {
                let id = r.id.to_string();
                if self.local.remove(&key).is_some() {
                    self.view.remove(key).ok();
                }
                self.releases.push(id);
            }
            self.forget(key);
            return;
        }
        r.state = State::Answered {
            resp,
            at: now,
            delivered,
        };
        self.answered_count += 1;
        self.answered.push_back((now, key));
    }

    /// Drops one of this service's reservations, releasing it at the snapshot service if it
    /// may be there.
    fn release_local(&mut self, key: RequestKey) {
        if let Some(l) = self.local.remove(&key) {
            if !matches!(l.state, LocalState::Uncommitted { .. }) {
                self.releases.push(l.id.to_string());
            }
            self.view.remove(key).ok();
        }
    }

    /// Answers an admitted request with σ's placement of its id, if σ has one.
    fn answer_from_sigma(&mut self, key: RequestKey, now: Instant) {
        let Some(r) = self.reqs.get_mut(&key) else {
            return;
        };
        let placed = self.sigma.as_ref().and_then(|s| {
            let sr = s.request(r.id.as_str())?;
            Some((sr.worker, sr.incarnation, s.version()))
        });
        match (placed, &mut r.state) {
            (Some((worker, incarnation, version)), State::Reserving { at, .. }) => {
                at.worker = worker;
                at.incarnation = incarnation;
                at.sigma_version = version;
                self.answer(key, false, now);
            }
            _ => self.fail(
                key,
                DecisionError::ReserveRefused("lost its reservation".into()),
            ),
        }
    }

    fn rejected(
        &mut self,
        key: RequestKey,
        reason: i32,
        detail: &str,
        recommit: bool,
        now: Instant,
    ) {
        let reason = v1::RejectReason::try_from(reason).unwrap_or(v1::RejectReason::Unspecified);
        self.metrics.reserve_failed(reason.label(), 1);
        if self.local.remove(&key).is_some() {
            self.view.remove(key).ok();
        }
        if recommit {
            tracing::debug!(group = %self.group, ?reason, "re-reservation after an outage refused");
            return;
        }
        let Some(r) = self.reqs.get_mut(&key) else {
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
        if abandoned || r.waiters.is_empty() {
            self.forget(key);
            return;
        }
        let worker = at.worker;
        let id = r.id.clone();
        match reason {
            v1::RejectReason::WorkerFenced
            | v1::RejectReason::UnknownWorker
            | v1::RejectReason::StaleIncarnation
            | v1::RejectReason::WorkerFull => {
                // σ is behind: keep the worker out of this view until σ moves.
                self.view.set_accepting(worker, false).ok();
                let entry = PoolEntry {
                    key,
                    prompt_tokens: r.prompt_tokens,
                    prompt_hash: r.prompt_hash,
                    oracle_output: None,
                };
                match self.mode {
                    Mode::Pooled => {
                        r.state = State::Waiting;
                        if self.pool.push(entry).is_ok() {
                            self.tick_wanted = true;
                        }
                        self.metrics.pool_size.set(self.pool.len() as i64);
                    }
                    Mode::OnArrival => {
                        if reroutes >= MAX_REROUTES {
                            self.fail(key, DecisionError::NoLiveWorker(self.group.to_string()));
                        } else {
                            r.state = State::Waiting;
                            self.route_now(key, entry, reroutes + 1, now);
                        }
                    }
                }
            }
            v1::RejectReason::Duplicate => {
                // σ already holds this request id on another worker (e.g. reserved by an
                // earlier incarnation of this service): that placement is the answer.
                let placed = self.sigma.as_ref().and_then(|s| {
                    let sr = s.request(id.as_str())?;
                    Some((sr.worker, sr.incarnation, s.version()))
                });
                match placed {
                    Some((worker, incarnation, version)) => {
                        if let State::Reserving { at, .. } = &mut r.state {
                            at.worker = worker;
                            at.incarnation = incarnation;
                            at.sigma_version = version;
                        }
                        self.answer(key, false, now);
                    }
                    None => self.fail(
                        key,
                        DecisionError::ReserveRefused(format!("duplicate: {detail}")),
                    ),
                }
            }
            _ => self.fail(
                key,
                DecisionError::ReserveRefused(format!("{}: {detail}", reason.as_str_name())),
            ),
        }
    }

    /// Ids to release at the snapshot service (one `Release` call).
    pub fn take_release(&mut self) -> Option<v1::ReleaseRequest> {
        if self.releases.is_empty() {
            return None;
        }
        let mut ids = std::mem::take(&mut self.releases);
        let now = Instant::now();
        for id in &ids {
            if let Ok(rid) = RequestId::new(id) {
                self.released.insert(rid, now);
            }
        }
        ids.sort_unstable();
        ids.dedup();
        Some(v1::ReleaseRequest {
            group: self.group.to_string(),
            request_ids: ids,
        })
    }

    // ---------------------------------------------------------------- housekeeping

    /// Forgets old answers, drops waiters whose handler has gone, updates the gauges.
    pub fn housekeeping(&mut self, now: Instant) {
        while let Some(&(at, key)) = self.answered.front() {
            let expired = now.saturating_duration_since(at) >= self.cfg.answered_ttl
                || self.answered_count > self.cfg.answered_max;
            if !expired {
                break;
            }
            self.answered.pop_front();
            let current = self
                .reqs
                .get(&key)
                .is_some_and(|r| matches!(r.state, State::Answered { at: a, .. } if a == at));
            if current {
                self.forget(key);
            }
        }
        // Handlers that vanished without telling us (their future was dropped).
        // Only requests still waiting or being reserved have callers (not the answered ones,
        // which may be many).
        let mut gone = Vec::new();
        let pending = self
            .pool
            .iter()
            .map(|e| e.key)
            .chain(self.inflight.values().flat_map(|j| j.keys.iter().copied()))
            .chain(self.outbox.iter().copied());
        for key in pending {
            let Some(r) = self.reqs.get_mut(&key) else {
                continue;
            };
            if matches!(r.state, State::Answered { .. }) || r.waiters.is_empty() {
                continue;
            }
            r.waiters.retain(|w| !w.tx.is_closed());
            if r.waiters.is_empty() {
                gone.push(key);
            }
        }
        for key in gone {
            self.abandon(key);
        }
        if self.answered.len() > 2 * self.answered_count + 1024 {
            // Entries of cancelled requests linger in the queue; compact it.
            let reqs = &self.reqs;
            self.answered.retain(|(at, key)| {
                reqs.get(key)
                    .is_some_and(|r| matches!(r.state, State::Answered { at: a, .. } if a == *at))
            });
        }
        if !self.released.is_empty() {
            let sigma = self.sigma.as_ref();
            let ttl = self.cfg.answered_ttl;
            self.released.retain(|id, at| {
                sigma.is_some_and(|s| s.request(id.as_str()).is_some())
                    && now.saturating_duration_since(*at) < ttl
            });
        }
        // Expire own uncommitted reservations even while σ does not move.
        if self.local.values().any(|l| matches!(l.state, LocalState::Uncommitted { since } if now.saturating_duration_since(since) >= self.cfg.local_ttl)) {
            self.view_dirty = true;
        }
        self.update_gauges(now);
    }

    fn update_gauges(&self, now: Instant) {
        let stale = self.is_stale();
        self.metrics.sigma_stale.set(i64::from(stale));
        let staleness = match (stale, self.last_confirmed) {
            (true, Some(t)) => now.saturating_duration_since(t).as_secs_f64(),
            _ => 0.0,
        };
        self.metrics.sigma_staleness.set(staleness);
        self.metrics.pool_size.set(self.pool.len() as i64);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on purpose
mod tests {
    use super::*;
    use br_core::{PolicyConfig, PolicyKind, build_policy};
    use br_sigma::change;
    use tokio::sync::oneshot::error::TryRecvError;

    type Rx = oneshot::Receiver<Result<v1::AssignResponse, DecisionError>>;

    const EPOCH: u64 = 7;

    /// A group core plus a writer σ standing in for the snapshot service.
    struct Fx {
        core: GroupCore,
        writer: Sigma,
        now: Instant,
        call: u64,
    }

    fn core(kind: PolicyKind, cfg: GroupConfig) -> GroupCore {
        let metrics = crate::metrics::Metrics::new().unwrap().group("g");
        let policy = build_policy(&PolicyConfig::new(kind)).unwrap();
        GroupCore::new(GroupId::new("g").unwrap(), policy, cfg, metrics)
    }

    impl Fx {
        /// `workers` live workers of capacity `cap`, each with the given load already active.
        fn new(kind: PolicyKind, loads: &[u32], cap: u32) -> Fx {
            Fx::with_cfg(kind, loads, cap, GroupConfig::default())
        }

        fn with_cfg(kind: PolicyKind, loads: &[u32], cap: u32, cfg: GroupConfig) -> Fx {
            let mut writer = Sigma::with_epoch("g", EPOCH);
            let mut b = writer.batch();
            for (w, &load) in loads.iter().enumerate() {
                let w = w as u32;
                b.apply(change::worker_up(
                    w,
                    100 + u64::from(w),
                    cap,
                    &format!("http://w{w}"),
                ))
                .unwrap();
                if load > 0 {
                    b.apply(change::request_progress(
                        &format!("bg{w}"),
                        w,
                        100 + u64::from(w),
                        load,
                        0,
                    ))
                    .unwrap();
                }
            }
            b.commit();
            let mut fx = Fx {
                core: core(kind, cfg),
                writer,
                now: Instant::now(),
                call: 0,
            };
            fx.core.set_sigma(fx.writer.clone(), fx.now);
            fx
        }

        fn assign(&mut self, id: &str, s: u32) -> (u64, Rx) {
            self.call += 1;
            let (tx, rx) = oneshot::channel();
            let req = ValidAssign {
                group: GroupId::new("g").unwrap(),
                request_id: RequestId::new(id).unwrap(),
                prompt_tokens: s,
                prompt_hash: None,
                max_tokens: None,
            };
            self.core.assign(req, self.call, tx, self.now);
            (self.call, rx)
        }

        fn advance(&mut self, d: Duration) {
            self.now += d;
        }

        /// The snapshot service's side of a Reserve: accept what σ can take, reject the rest.
        /// Returns the response and the delta the Watch would carry.
        fn serve_reserve(&mut self, job: &ReserveJob) -> (v1::ReserveResponse, Option<Delta>) {
            let mut accepted = Vec::new();
            let mut rejected = Vec::new();
            let mut b = self.writer.batch();
            for r in &job.request.reservations {
                let c = change::request_reserved(
                    &r.request_id,
                    r.worker_id,
                    r.incarnation,
                    r.prompt_tokens,
                    r.prompt_hash,
                    r.max_tokens,
                );
                match b.apply(c) {
                    Ok(_) => accepted.push(r.request_id.clone()),
                    Err(e) => rejected.push(v1::ReservationRejection {
                        request_id: r.request_id.clone(),
                        reason: v1::RejectReason::WorkerFenced as i32,
                        detail: e.to_string(),
                    }),
                }
            }
            let delta = b.commit();
            (
                v1::ReserveResponse {
                    epoch: EPOCH,
                    version: self.writer.version(),
                    accepted,
                    rejected,
                },
                delta,
            )
        }

        /// Tick, reserve everything admitted, deliver the Reserve answer (and the delta).
        fn tick_and_commit(&mut self, deliver_delta: bool) -> usize {
            self.core.tick(self.now);
            let mut n = 0;
            while let Some(job) = self.core.take_reserve(self.now) {
                n += job.request.reservations.len();
                let (resp, delta) = self.serve_reserve(&job);
                self.core.on_reserve_done(job.id, Ok(resp), self.now);
                if deliver_delta && let Some(d) = delta {
                    self.core.on_delta(&d, self.now).unwrap();
                }
            }
            n
        }

        /// Applies writer changes as one delta and feeds it to the core.
        fn sigma_change(&mut self, changes: Vec<v1::Change>) {
            let mut b = self.writer.batch();
            for c in changes {
                b.apply(c).unwrap();
            }
            if let Some(d) = b.commit() {
                self.core.on_delta(&d, self.now).unwrap();
            }
        }
    }

    fn answer(rx: &mut Rx) -> v1::AssignResponse {
        rx.try_recv().expect("answered").expect("ok")
    }

    fn error(rx: &mut Rx) -> DecisionError {
        rx.try_recv().expect("answered").expect_err("an error")
    }

    fn pending(rx: &mut Rx) -> bool {
        matches!(rx.try_recv(), Err(TryRecvError::Empty))
    }

    #[test]
    fn pooled_requests_wait_for_a_tick_and_one_reserve_per_tick() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0, 0, 0, 0], 8);
        let mut rxs: Vec<Rx> = (0..3)
            .map(|i| fx.assign(&format!("r{i}"), 100 * (i + 1)).1)
            .collect();
        assert!(
            rxs.iter_mut().all(pending),
            "nothing answered before a tick"
        );
        assert_eq!(fx.core.stats().pool, 3);
        assert!(fx.core.tick_wanted());
        fx.advance(Duration::from_millis(3));
        fx.core.tick(fx.now);
        assert_eq!(fx.core.stats().pool, 0);
        let job = fx.core.take_reserve(fx.now).expect("one Reserve");
        assert_eq!(
            job.request.reservations.len(),
            3,
            "the whole tick in one call"
        );
        assert!(fx.core.take_reserve(fx.now).is_none());
        assert!(
            rxs.iter_mut().all(pending),
            "not answered before Reserve returns"
        );
        let (resp, _) = fx.serve_reserve(&job);
        fx.core.on_reserve_done(job.id, Ok(resp), fx.now);
        let answers: Vec<_> = rxs.iter_mut().map(answer).collect();
        let mut workers: Vec<u32> = answers.iter().map(|a| a.worker_id).collect();
        workers.sort_unstable();
        workers.dedup();
        assert_eq!(
            workers.len(),
            3,
            "empty workers: one request each: {answers:?}"
        );
        for a in &answers {
            assert_eq!(a.policy, "br0");
            assert_eq!(a.pool_wait_us, 3000);
            assert_eq!(a.incarnation, 100 + u64::from(a.worker_id));
            assert_eq!(a.endpoint, format!("http://w{}", a.worker_id));
            assert!(!a.stale);
        }
        let st = fx.core.stats();
        assert_eq!((st.answered, st.local, st.reserving), (3, 3, 0));
    }

    #[test]
    fn admitted_load_is_seen_by_the_next_tick_before_sigma_shows_it() {
        // Two workers; BR-0 must not put both big requests on the same worker even though the
        // first admission is not in σ yet when the second tick runs.
        let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
        let (_, mut a) = fx.assign("a", 1000);
        fx.tick_and_commit(false);
        let (_, mut b) = fx.assign("b", 1000);
        fx.tick_and_commit(false);
        assert_ne!(answer(&mut a).worker_id, answer(&mut b).worker_id);
    }

    #[test]
    fn own_reservations_are_dropped_once_sigma_shows_them() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
        let (_, mut a) = fx.assign("a", 500);
        fx.tick_and_commit(true);
        answer(&mut a);
        fx.core.tick(fx.now); // rebuild the view from σ
        assert_eq!(fx.core.stats().local, 0);
        let total: u64 = fx.core.view.workers().iter().map(|w| w.load()).sum();
        assert_eq!(total, 500, "counted once");
    }

    #[test]
    fn retries_join_the_wait_and_get_the_original_answer() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
        let (_, mut first) = fx.assign("r", 100);
        let (_, mut second) = fx.assign("r", 100);
        assert_eq!(fx.core.stats().pool, 1, "one request, two callers");
        assert_eq!(fx.core.stats().waiting_calls, 2);
        fx.tick_and_commit(false);
        let a = answer(&mut first);
        assert_eq!(answer(&mut second), a);
        let (_, mut third) = fx.assign("r", 100);
        assert_eq!(answer(&mut third), a, "after the answer: the same answer");
        let (_, mut bad) = fx.assign("r", 101);
        assert!(matches!(
            error(&mut bad),
            DecisionError::Conflict {
                first: 100,
                now: 101,
                ..
            }
        ));
        assert_eq!(fx.tick_and_commit(false), 0, "no second reservation");
    }

    #[test]
    fn cancel_withdraws_releases_or_finds_nothing() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
        let (_, mut waiting) = fx.assign("w", 100);
        assert_eq!(fx.core.cancel("w"), CancelOutcome::Withdrawn);
        assert_eq!(error(&mut waiting), DecisionError::Cancelled);
        assert_eq!(fx.core.stats().pool, 0);
        assert_eq!(fx.tick_and_commit(false), 0, "nothing reserved for it");

        let (_, mut done) = fx.assign("d", 100);
        fx.tick_and_commit(true);
        answer(&mut done);
        assert_eq!(fx.core.cancel("d"), CancelOutcome::Released);
        let rel = fx.core.take_release().expect("a Release");
        assert_eq!(rel.request_ids, vec!["d".to_string()]);
        assert_eq!(
            fx.core.cancel("d"),
            CancelOutcome::NotFound,
            "already cancelled"
        );
        assert_eq!(fx.core.cancel("never"), CancelOutcome::NotFound);

        // Active (the worker reported it): nothing to release.
        let (_, mut act) = fx.assign("act", 100);
        fx.tick_and_commit(true);
        let a = answer(&mut act);
        fx.sigma_change(vec![change::request_progress(
            "act",
            a.worker_id,
            a.incarnation,
            100,
            3,
        )]);
        assert_eq!(fx.core.cancel("act"), CancelOutcome::NotFound);
        assert!(fx.core.take_release().is_none());
    }

    #[test]
    fn cancel_during_reserve_releases_once_accepted() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
        let (_, mut rx) = fx.assign("r", 100);
        fx.core.tick(fx.now);
        let job = fx.core.take_reserve(fx.now).unwrap();
        assert_eq!(fx.core.cancel("r"), CancelOutcome::Withdrawn);
        assert_eq!(error(&mut rx), DecisionError::Cancelled);
        let (resp, _) = fx.serve_reserve(&job);
        fx.core.on_reserve_done(job.id, Ok(resp), fx.now);
        let rel = fx.core.take_release().expect("released");
        assert_eq!(rel.request_ids, vec!["r".to_string()]);
        let st = fx.core.stats();
        assert_eq!((st.pool, st.reserving, st.answered, st.local), (0, 0, 0, 0));
    }

    #[test]
    fn deadline_withdrawal_leaves_nothing_behind() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0], 1);
        // Fill the only slot so the next request waits.
        let (_, mut a) = fx.assign("a", 10);
        fx.tick_and_commit(true);
        answer(&mut a);
        let (call, mut b) = fx.assign("b", 10);
        fx.tick_and_commit(true);
        assert!(pending(&mut b), "no free slot: it waits");
        fx.core.withdraw("b", call, false);
        let st = fx.core.stats();
        assert_eq!((st.pool, st.waiting_calls, st.reserving), (0, 0, 0));
        // A retry of a withdrawn id is a new request.
        let (_, mut again) = fx.assign("b", 10);
        assert!(pending(&mut again));
        assert_eq!(fx.core.stats().pool, 1);

        // Withdrawn while its Reserve is in flight: released when accepted, never answered.
        let mut fx = Fx::new(PolicyKind::Br0, &[0], 4);
        let (call, _rx) = fx.assign("c", 10);
        fx.core.tick(fx.now);
        let job = fx.core.take_reserve(fx.now).unwrap();
        fx.core.withdraw("c", call, false);
        let (resp, _) = fx.serve_reserve(&job);
        fx.core.on_reserve_done(job.id, Ok(resp), fx.now);
        assert_eq!(
            fx.core.take_release().unwrap().request_ids,
            vec!["c".to_string()]
        );
        let st = fx.core.stats();
        assert_eq!((st.reserving, st.answered, st.local), (0, 0, 0));
    }

    #[test]
    fn an_answer_nobody_read_is_released() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0], 4);
        let (call, rx) = fx.assign("r", 10);
        fx.tick_and_commit(false);
        drop(rx); // the handler read nothing (its future was dropped after the send)
        fx.core.withdraw("r", call, true);
        assert_eq!(
            fx.core.take_release().unwrap().request_ids,
            vec!["r".to_string()]
        );
        assert_eq!(fx.core.stats().answered, 0);
    }

    #[test]
    fn callers_that_vanish_are_swept() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0], 1);
        let (_, mut a) = fx.assign("a", 10);
        fx.tick_and_commit(true);
        answer(&mut a);
        let (_, b) = fx.assign("b", 10);
        drop(b); // no Withdraw arrived (the queue was full)
        fx.core.housekeeping(fx.now);
        assert_eq!(fx.core.stats().pool, 0);
    }

    #[test]
    fn rejected_reservations_go_back_to_the_pool_and_avoid_the_worker() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0, 500], 8);
        let (_, mut rx) = fx.assign("r", 100);
        fx.core.tick(fx.now);
        let job = fx.core.take_reserve(fx.now).unwrap();
        let first = job.request.reservations[0].worker_id;
        assert_eq!(first, 0, "the lighter worker");
        fx.core.on_reserve_done(
            job.id,
            Ok(v1::ReserveResponse {
                epoch: EPOCH,
                version: fx.writer.version(),
                accepted: vec![],
                rejected: vec![v1::ReservationRejection {
                    request_id: "r".into(),
                    reason: v1::RejectReason::WorkerFenced as i32,
                    detail: "fenced".into(),
                }],
            }),
            fx.now,
        );
        assert!(pending(&mut rx), "retried, not failed");
        assert_eq!(fx.core.stats().pool, 1);
        fx.tick_and_commit(false);
        assert_eq!(
            answer(&mut rx).worker_id,
            1,
            "σ is behind: avoid the fenced worker"
        );
    }

    #[test]
    fn duplicate_rejection_answers_with_sigmas_placement() {
        let mut fx = Fx::new(PolicyKind::Jsq, &[0, 0], 8);
        let (_, mut rx) = fx.assign("r", 50);
        let job = fx.core.take_reserve(fx.now).unwrap();
        assert_eq!(job.request.reservations[0].worker_id, 0);
        // Meanwhile σ got "r" on worker 1 (another replica, or an earlier incarnation).
        fx.sigma_change(vec![change::request_reserved("r", 1, 101, 50, None, None)]);
        fx.core.on_reserve_done(
            job.id,
            Ok(v1::ReserveResponse {
                epoch: EPOCH,
                version: fx.writer.version(),
                accepted: vec![],
                rejected: vec![v1::ReservationRejection {
                    request_id: "r".into(),
                    reason: v1::RejectReason::Duplicate as i32,
                    detail: "on worker 1".into(),
                }],
            }),
            fx.now,
        );
        let a = answer(&mut rx);
        assert_eq!((a.worker_id, a.incarnation), (1, 101));
    }

    #[test]
    fn an_id_sigma_already_places_is_answered_from_sigma() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
        fx.sigma_change(vec![change::request_reserved(
            "old", 1, 101, 50, None, None,
        )]);
        let (_, mut rx) = fx.assign("old", 50);
        let a = answer(&mut rx);
        assert_eq!((a.worker_id, a.incarnation, a.stale), (1, 101, false));
        assert_eq!(fx.tick_and_commit(false), 0, "no second reservation");
        assert_eq!(fx.core.stats().pool, 0);
    }

    #[test]
    fn sigma_showing_a_reservation_before_its_answer_still_answers() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
        let (_, mut rx) = fx.assign("r", 10);
        fx.core.tick(fx.now);
        let job = fx.core.take_reserve(fx.now).unwrap();
        let (resp, delta) = fx.serve_reserve(&job);
        // The Watch delta overtakes the Reserve answer, and a tick rebuilds the view.
        fx.core.on_delta(&delta.unwrap(), fx.now).unwrap();
        fx.core.tick(fx.now);
        fx.core.on_reserve_done(job.id, Ok(resp), fx.now);
        assert!(!answer(&mut rx).stale);
        assert_eq!(fx.core.stats().local, 0);
    }

    #[test]
    fn on_arrival_policies_answer_without_a_tick_and_reroute_rejections() {
        let mut fx = Fx::new(PolicyKind::Jsq, &[0, 0, 0], 8);
        let (_, mut a) = fx.assign("a", 10);
        assert_eq!(fx.core.stats().pool, 0, "no pool");
        let job = fx.core.take_reserve(fx.now).expect("reserved at once");
        assert_eq!(job.request.reservations[0].worker_id, 0);
        // Rejected: routed again, to another worker.
        fx.core.on_reserve_done(
            job.id,
            Ok(v1::ReserveResponse {
                epoch: EPOCH,
                version: fx.writer.version(),
                accepted: vec![],
                rejected: vec![v1::ReservationRejection {
                    request_id: "a".into(),
                    reason: v1::RejectReason::WorkerFull as i32,
                    detail: String::new(),
                }],
            }),
            fx.now,
        );
        assert!(pending(&mut a));
        let job = fx.core.take_reserve(fx.now).expect("rerouted");
        assert_eq!(job.request.reservations[0].worker_id, 1);
        let (resp, _) = fx.serve_reserve(&job);
        fx.core.on_reserve_done(job.id, Ok(resp), fx.now);
        let r = answer(&mut a);
        assert_eq!(
            (r.worker_id, r.pool_wait_us, r.policy.as_str()),
            (1, 0, "jsq")
        );
        // JSQ spreads by count; worker 0 said "full" and stays out until σ moves.
        let (_, mut b) = fx.assign("b", 10);
        fx.tick_and_commit(false);
        let (_, mut c) = fx.assign("c", 10);
        fx.tick_and_commit(false);
        assert_eq!([answer(&mut b).worker_id, answer(&mut c).worker_id], [2, 1]);
    }

    #[test]
    fn not_ready_no_worker_and_full_pool_are_typed() {
        let mut c = core(PolicyKind::Br0, GroupConfig::default());
        let (tx, mut rx) = oneshot::channel();
        c.assign(
            ValidAssign {
                group: GroupId::new("g").unwrap(),
                request_id: RequestId::new("r").unwrap(),
                prompt_tokens: 1,
                prompt_hash: None,
                max_tokens: None,
            },
            1,
            tx,
            Instant::now(),
        );
        assert!(matches!(error(&mut rx), DecisionError::NoSigma(_)));

        let mut fx = Fx::new(PolicyKind::Br0, &[], 8);
        let (_, mut rx) = fx.assign("r", 1);
        assert!(matches!(error(&mut rx), DecisionError::NoLiveWorker(_)));

        let cfg = GroupConfig {
            max_pool: 2,
            ..GroupConfig::default()
        };
        let mut fx = Fx::with_cfg(PolicyKind::Br0, &[0], 8, cfg);
        let (_, _a) = fx.assign("a", 1);
        let (_, _b) = fx.assign("b", 1);
        let (_, mut c) = fx.assign("c", 1);
        assert!(matches!(
            error(&mut c),
            DecisionError::PoolFull { max: 2, .. }
        ));
    }

    #[test]
    fn while_stale_answers_from_the_view_and_reserves_when_back() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
        let t0 = fx.now;
        fx.core.on_disconnected(t0, t0);
        assert!(fx.core.is_stale());
        let (_, mut a) = fx.assign("a", 300);
        let (_, mut b) = fx.assign("b", 300);
        fx.core.tick(fx.now);
        assert!(
            fx.core.take_reserve(fx.now).is_none(),
            "no Reserve while away"
        );
        let (ra, rb) = (answer(&mut a), answer(&mut b));
        assert!(ra.stale && rb.stale);
        assert_ne!(
            ra.worker_id, rb.worker_id,
            "own reservations count in the view"
        );
        assert_eq!(fx.core.stats().uncommitted, 2);
        // A retry gets the same (stale) answer.
        let (_, mut again) = fx.assign("a", 300);
        assert_eq!(answer(&mut again), ra);
        // Back: the decisions made while away are reserved.
        fx.advance(Duration::from_secs(1));
        fx.core.on_connected(fx.now);
        let job = fx.core.take_reserve(fx.now).expect("re-commit");
        let mut ids: Vec<_> = job
            .request
            .reservations
            .iter()
            .map(|r| r.request_id.clone())
            .collect();
        ids.sort();
        assert_eq!(ids, ["a", "b"]);
        let (resp, delta) = fx.serve_reserve(&job);
        fx.core.on_reserve_done(job.id, Ok(resp), fx.now);
        fx.core.on_delta(&delta.unwrap(), fx.now).unwrap();
        fx.core.tick(fx.now);
        let st = fx.core.stats();
        assert_eq!((st.uncommitted, st.local, st.stale), (0, 0, false));
    }

    #[test]
    fn a_failed_reserve_call_answers_stale_and_recommits() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0], 8);
        let (_, mut a) = fx.assign("a", 1);
        fx.core.tick(fx.now);
        let job = fx.core.take_reserve(fx.now).unwrap();
        fx.core
            .on_reserve_done(job.id, Err(tonic::Status::unavailable("down")), fx.now);
        assert!(answer(&mut a).stale);
        let job = fx
            .core
            .take_reserve(fx.now)
            .expect("retried as a re-commit");
        assert_eq!(job.request.reservations[0].request_id, "a");
    }

    #[test]
    fn a_new_epoch_recommits_what_sigma_lost() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0], 8);
        let (_, mut a) = fx.assign("a", 1);
        fx.tick_and_commit(false); // accepted, not yet seen in σ
        answer(&mut a);
        // The snapshot service restarts (new epoch) and σ is rebuilt without "a".
        let mut fresh = Sigma::with_epoch("g", EPOCH + 1);
        let mut b = fresh.batch();
        b.apply(change::worker_up(0, 100, 8, "http://w0")).unwrap();
        b.commit();
        fx.core.set_sigma(fresh, fx.now);
        let job = fx
            .core
            .take_reserve(fx.now)
            .expect("re-commit after the restart");
        assert_eq!(job.request.reservations[0].request_id, "a");
    }

    #[test]
    fn recommits_wait_until_the_worker_is_back() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0], 8);
        fx.core.on_disconnected(fx.now, fx.now);
        let (_, mut a) = fx.assign("a", 1);
        fx.core.tick(fx.now);
        assert!(fx.core.take_reserve(fx.now).is_none());
        assert!(answer(&mut a).stale);
        // The restarted snapshot service has no workers yet.
        let mut fresh = Sigma::with_epoch("g", EPOCH + 1);
        fx.core.set_sigma(fresh.clone(), fx.now);
        assert!(
            fx.core.take_reserve(fx.now).is_none(),
            "worker 0 not back yet"
        );
        fx.core.tick(fx.now);
        assert_eq!(
            fx.core.stats().uncommitted,
            1,
            "kept while the worker may come back"
        );
        // Its hello arrives (same incarnation): now it is reserved again.
        let mut b = fresh.batch();
        b.apply(change::worker_up(0, 100, 8, "http://w0")).unwrap();
        let d = b.commit().unwrap();
        fx.core.on_delta(&d, fx.now).unwrap();
        let job = fx.core.take_reserve(fx.now).expect("re-commit");
        assert_eq!(job.request.reservations[0].request_id, "a");
    }

    #[test]
    fn answers_are_forgotten_after_the_ttl() {
        let cfg = GroupConfig {
            answered_ttl: Duration::from_secs(5),
            ..GroupConfig::default()
        };
        let mut fx = Fx::with_cfg(PolicyKind::Br0, &[0], 8, cfg);
        let (_, mut a) = fx.assign("a", 1);
        fx.tick_and_commit(true);
        answer(&mut a);
        fx.advance(Duration::from_secs(4));
        fx.core.housekeeping(fx.now);
        assert_eq!(fx.core.stats().answered, 1);
        fx.advance(Duration::from_secs(2));
        fx.core.housekeeping(fx.now);
        assert_eq!(fx.core.stats().answered, 0);
    }

    #[test]
    fn the_pool_waits_for_free_slots_and_admits_when_sigma_frees_them() {
        let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 1);
        let (_, mut a) = fx.assign("a", 10);
        let (_, mut b) = fx.assign("b", 10);
        let (_, mut c) = fx.assign("c", 10);
        fx.tick_and_commit(true);
        let wa = answer(&mut a).worker_id;
        let wb = answer(&mut b).worker_id;
        assert_ne!(wa, wb);
        assert!(pending(&mut c), "both workers full");
        fx.sigma_change(vec![change::request_progress(
            "a",
            wa,
            100 + u64::from(wa),
            10,
            5,
        )]);
        fx.sigma_change(vec![change::request_finished("a", 5)]);
        fx.tick_and_commit(true);
        assert_eq!(answer(&mut c).worker_id, wa);
    }

    mod prop {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Assign(u8, u16),
            Withdraw(u8),
            Cancel(u8),
            Tick,
            Serve { accept: bool, deliver_delta: bool },
            Fail,
            Disconnect,
            Connect,
            Housekeeping,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (0u8..8, 1u16..500).prop_map(|(i, s)| Op::Assign(i, s)),
                2 => (0u8..8).prop_map(Op::Withdraw),
                1 => (0u8..8).prop_map(Op::Cancel),
                3 => Just(Op::Tick),
                3 => (any::<bool>(), any::<bool>())
                    .prop_map(|(accept, deliver_delta)| Op::Serve { accept, deliver_delta }),
                1 => Just(Op::Fail),
                1 => Just(Op::Disconnect),
                1 => Just(Op::Connect),
                1 => Just(Op::Housekeeping),
            ]
        }

        struct Sim {
            fx: Fx,
            jobs: VecDeque<ReserveJob>,
            deltas: Vec<Delta>,
            callers: Vec<(String, u64, Rx)>,
            /// The last answer each id's caller actually received.
            delivered: FxHashMap<String, u32>,
        }

        impl Sim {
            fn collect(&mut self) {
                while let Some(job) = self.fx.core.take_reserve(self.fx.now) {
                    self.jobs.push_back(job);
                }
                if let Some(rel) = self.fx.core.take_release() {
                    let mut b = self.fx.writer.batch();
                    for id in rel.request_ids {
                        let queued = b
                            .sigma()
                            .request(&id)
                            .is_some_and(|r| r.phase == Phase::Queued);
                        if queued {
                            b.apply(change::request_released(&id)).unwrap();
                        }
                    }
                    if let Some(d) = b.commit() {
                        self.deltas.push(d);
                    }
                }
                // Callers read what arrived.
                let mut still = Vec::new();
                for (id, call, mut rx) in self.callers.drain(..) {
                    match rx.try_recv() {
                        Ok(Ok(a)) => {
                            self.delivered.insert(id, a.worker_id);
                        }
                        Ok(Err(_)) | Err(TryRecvError::Closed) => {}
                        Err(TryRecvError::Empty) => still.push((id, call, rx)),
                    }
                }
                self.callers = still;
            }

            fn serve(&mut self, accept: bool, deliver_delta: bool) {
                let Some(job) = self.jobs.pop_front() else {
                    return;
                };
                if accept {
                    let (resp, delta) = self.fx.serve_reserve(&job);
                    if let Some(d) = delta {
                        self.deltas.push(d);
                    }
                    self.fx.core.on_reserve_done(job.id, Ok(resp), self.fx.now);
                } else {
                    self.fx.core.on_reserve_done(
                        job.id,
                        Err(tonic::Status::unavailable("down")),
                        self.fx.now,
                    );
                }
                if deliver_delta {
                    self.deliver();
                }
            }

            fn deliver(&mut self) {
                for d in std::mem::take(&mut self.deltas) {
                    self.fx.core.on_delta(&d, self.fx.now).unwrap();
                }
            }

            fn run(&mut self, op: Op) {
                match op {
                    Op::Assign(i, s) => {
                        let id = format!("p{i}");
                        let (call, rx) = self.fx.assign(&id, u32::from(s));
                        self.callers.push((id, call, rx));
                    }
                    Op::Withdraw(i) => {
                        let id = format!("p{i}");
                        if let Some(pos) = self.callers.iter().position(|c| c.0 == id) {
                            let (id, call, mut rx) = self.callers.remove(pos);
                            rx.close();
                            let undelivered = matches!(rx.try_recv(), Ok(Ok(_)));
                            self.fx.core.withdraw(&id, call, undelivered);
                        }
                    }
                    Op::Cancel(i) => {
                        self.fx.core.cancel(&format!("p{i}"));
                    }
                    Op::Tick => self.fx.core.tick(self.fx.now),
                    Op::Serve {
                        accept,
                        deliver_delta,
                    } => self.serve(accept, deliver_delta),
                    Op::Fail => self.serve(false, false),
                    Op::Disconnect => self.fx.core.on_disconnected(self.fx.now, self.fx.now),
                    Op::Connect => self.fx.core.on_connected(self.fx.now),
                    Op::Housekeeping => self.fx.core.housekeeping(self.fx.now),
                }
                self.fx.advance(Duration::from_millis(1));
                self.collect();
            }
        }

        /// Runs `ops`, lets everything settle, and checks that every reservation σ holds is
        /// one whose caller received an answer naming that worker.
        fn settle_and_check(ops: Vec<Op>) -> Result<(), TestCaseError> {
            let mut sim = Sim {
                fx: Fx::new(PolicyKind::Br0, &[0, 0, 0], 3),
                jobs: VecDeque::new(),
                deltas: Vec::new(),
                callers: Vec::new(),
                delivered: FxHashMap::default(),
            };
            for op in ops {
                sim.run(op);
            }
            // Settle: the service is reachable, callers still waiting give up, every
            // Reserve is answered and every delta seen.
            sim.run(Op::Connect);
            for (id, call, mut rx) in std::mem::take(&mut sim.callers) {
                rx.close();
                match rx.try_recv() {
                    Ok(Ok(a)) => {
                        sim.delivered.insert(id, a.worker_id);
                    }
                    _ => sim.fx.core.withdraw(&id, call, false),
                }
            }
            for _ in 0..50 {
                sim.collect();
                sim.serve(true, true);
                sim.fx.core.tick(sim.fx.now);
                sim.deliver();
            }
            sim.collect();
            sim.deliver();
            let st = sim.fx.core.stats();
            prop_assert_eq!((st.pool, st.reserving, st.inflight_reserves), (0, 0, 0));
            for r in sim.fx.writer.requests() {
                let got = sim.delivered.get(r.id.as_str());
                prop_assert_eq!(
                    got,
                    Some(&r.worker),
                    "{} reserved on {} in σ",
                    r.id,
                    r.worker
                );
            }
            // The replica agrees with the writer.
            let replica = sim.fx.core.sigma().unwrap();
            prop_assert_eq!(replica.version(), sim.fx.writer.version());
            Ok(())
        }

        /// A case proptest found: a cancelled request's id was reused while a re-reservation
        /// of the old one was in flight, and σ showing the old one made the new one's own
        /// copy vanish, so its release was skipped.
        #[test]
        fn reused_ids_leave_nothing_behind() {
            use Op::*;
            let serve = |accept| Serve {
                accept,
                deliver_delta: false,
            };
            let ops = vec![
                Assign(3, 1),
                Tick,
                Assign(0, 1),
                Tick,
                Assign(2, 1),
                serve(true),
                Assign(0, 1),
                serve(true),
                Assign(4, 1),
                Withdraw(2),
                Tick,
                Assign(0, 1),
                Assign(2, 1),
                Tick,
                Withdraw(2),
                serve(false),
                serve(true),
                Assign(2, 1),
                Tick,
            ];
            settle_and_check(ops).unwrap();
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            /// Whatever happens, once everything settles every reservation σ holds is one whose
            /// caller received an answer naming that worker: nothing is left behind for callers
            /// that left, were cancelled, or never heard back.
            #[test]
            fn nothing_is_left_behind(ops in proptest::collection::vec(op(), 1..80)) {
                settle_and_check(ops)?;
            }
        }
    }
}
