//! σ of one group: the snapshot service's store and every watcher's replica.
//!
//! There is exactly one implementation of "apply a [`v1::Change`]" ([`Sigma::apply_change`]),
//! used by the writer (the snapshot service, through a [`Batch`]) and by every replica (through
//! [`Sigma::apply_delta`]). So a replica that starts from the writer's σ at version `v` and
//! applies the deltas `v+1..=n` holds the writer's σ at `n` by construction; the property tests
//! below check it, including the snapshot round trip ([`Sigma::to_snapshot`] /
//! [`Sigma::from_snapshot`]).
//!
//! Next to the wire-level view (workers with incarnation, endpoint and liveness; requests keyed
//! by their string ids), a `Sigma` keeps a [`br_core::ClusterState`] mirror in step, which is
//! what the routing core reads: request ids are interned to [`RequestKey`]s (a bidirectional
//! map, entries dropped when a request leaves σ; keys are never reused within one `Sigma`, and
//! are local to it: a replica's keys differ from the writer's), a SUSPECT worker is
//! `set_accepting(false)`, a FENCED one `fence_worker`.
//!
//! Errors: a change that cannot be applied (it names an unknown worker or request, a stale
//! incarnation, or fails validation) returns an error and leaves σ untouched. A delta is
//! applied change by change, so when [`Sigma::apply_delta`] fails in the middle of a delta
//! ([`SigmaError::Change`]) σ holds a prefix of it: the replica no longer matches any version
//! and must be replaced by a fresh snapshot (the watcher resubscribes from scratch). The version
//! is not advanced in that case. A conforming server never sends such a delta.

use std::collections::BTreeMap;

use br_core::{ClusterState, CoreError, Phase, RequestInfo, RequestKey, WorkerId};
use br_proto::v1;
use br_proto::v1::change::Kind;
use br_proto::valid::{RequestId, limits};
use rustc_hash::FxHashMap;

/// A delta between two versions of σ, as sent by `Snapshot.Watch`.
pub type Delta = v1::watch_event::Delta;

/// The largest worker id σ accepts: the routing core sizes per-worker arrays by id and refuses
/// ids of `br_core::state::MAX_WORKERS` and above. (The wire allows up to 65,535; the snapshot
/// service rejects a Hello above this as INVALID.)
pub const MAX_WORKER_ID: u32 = br_core::state::MAX_WORKERS - 1;

/// Liveness of a worker (see `balanceroute.v1.Liveness`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Liveness {
    /// Its telemetry stream is connected; it may receive new assignments.
    Live,
    /// Its stream is gone and the grace period runs: it keeps its requests, takes no new ones.
    Suspect,
    /// Out: holds no requests in σ, takes none until a Hello brings it back.
    Fenced,
}

impl Liveness {
    fn to_wire(self) -> v1::Liveness {
        match self {
            Liveness::Live => v1::Liveness::Live,
            Liveness::Suspect => v1::Liveness::Suspect,
            Liveness::Fenced => v1::Liveness::Fenced,
        }
    }

    /// UNSPECIFIED (and unknown values) are FENCED, as the contract says.
    fn from_wire(v: i32) -> Liveness {
        match v1::Liveness::try_from(v) {
            Ok(v1::Liveness::Live) => Liveness::Live,
            Ok(v1::Liveness::Suspect) => Liveness::Suspect,
            _ => Liveness::Fenced,
        }
    }
}

/// One worker (DP rank) in σ. Its load is in [`Sigma::cluster`] (`worker(id).load()`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    pub id: WorkerId,
    /// The shim's process incarnation (non-zero).
    pub incarnation: u64,
    /// B (max_num_seqs).
    pub capacity: u32,
    /// Where the gateway sends this rank's requests; may be empty.
    pub endpoint: String,
    pub liveness: Liveness,
}

/// One request in σ. `phase` is [`Phase::Queued`] for RESERVED and [`Phase::Running`] for
/// ACTIVE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub id: RequestId,
    /// This request's key in [`Sigma::cluster`].
    pub key: RequestKey,
    pub worker: WorkerId,
    /// The worker incarnation it was reserved on / reported by.
    pub incarnation: u64,
    /// s_i.
    pub prompt_tokens: u32,
    /// j (0 while RESERVED).
    pub generated_tokens: u32,
    pub phase: Phase,
    pub prompt_hash: Option<u64>,
    pub max_tokens: Option<u32>,
}

impl Request {
    /// KV tokens this request counts for on its worker.
    pub fn kv_tokens(&self) -> u64 {
        u64::from(self.prompt_tokens) + u64::from(self.generated_tokens)
    }
}

/// Why σ could not take a snapshot, a delta or a change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SigmaError {
    /// The delta is of another epoch than the σ held.
    #[error("delta of epoch {got} does not apply to σ of epoch {have}")]
    EpochMismatch { have: u64, got: u64 },
    /// The delta does not start at the version held (a gap, or an old delta).
    #[error("delta from version {prev} does not apply to σ at version {have}")]
    Gap { have: u64, prev: u64 },
    /// A delta whose version is not above its prev_version.
    #[error("delta goes from version {prev} to {version}")]
    BadVersion { prev: u64, version: u64 },
    /// Change `index` of a delta failed; σ holds the changes before it (see the module docs).
    #[error("change {index} of the delta: {source}")]
    Change {
        index: usize,
        source: Box<SigmaError>,
    },
    /// A field is malformed (empty or oversized id, zero incarnation, missing oneof, ...).
    #[error("invalid: {0}")]
    Invalid(String),
    #[error("worker {0} is not in σ")]
    UnknownWorker(WorkerId),
    #[error("worker {worker} has incarnation {have}, not {got}")]
    StaleIncarnation {
        worker: WorkerId,
        have: u64,
        got: u64,
    },
    #[error("worker {0} is fenced")]
    WorkerFenced(WorkerId),
    #[error("worker {0} is suspect and takes no reservations")]
    WorkerSuspect(WorkerId),
    #[error("request {0:?} is not in σ")]
    UnknownRequest(String),
    #[error("request {0:?} is already in σ")]
    DuplicateRequest(String),
    #[error("request {0:?} is active, not reserved")]
    NotReserved(String),
    #[error("worker id {0} is above the limit of {MAX_WORKER_ID}")]
    WorkerIdTooLarge(WorkerId),
    /// The core mirror refused an operation σ allowed: a bug, reported rather than panicking.
    #[error("routing core: {0}")]
    Core(#[from] CoreError),
}

/// σ of one group at one (epoch, version), with its routing-core mirror.
#[derive(Debug, Clone)]
pub struct Sigma {
    group: String,
    epoch: u64,
    version: u64,
    workers: BTreeMap<WorkerId, Worker>,
    requests: FxHashMap<RequestId, Request>,
    ids: FxHashMap<RequestKey, RequestId>,
    next_key: RequestKey,
    cluster: ClusterState,
}

impl Sigma {
    /// An empty σ holding nothing: epoch 0, version 0 (a replica before its first snapshot).
    pub fn new(group: impl Into<String>) -> Sigma {
        Sigma::with_epoch(group, 0)
    }

    /// An empty σ at version 0 of `epoch` (the snapshot service's store for a new group).
    pub fn with_epoch(group: impl Into<String>, epoch: u64) -> Sigma {
        Sigma {
            group: group.into(),
            epoch,
            version: 0,
            workers: BTreeMap::new(),
            requests: FxHashMap::default(),
            ids: FxHashMap::default(),
            next_key: 1,
            cluster: ClusterState::new(),
        }
    }

    /// Builds σ from a full snapshot, validating it: a non-empty group, a non-zero epoch,
    /// workers with distinct ids (at most [`MAX_WORKER_ID`]), non-zero incarnations and
    /// capacities; requests with valid distinct ids on a known, non-fenced worker of the same
    /// incarnation, RESERVED ones with no generated tokens. `load_tokens` is recomputed.
    pub fn from_snapshot(snap: &v1::ClusterSnapshot) -> Result<Sigma, SigmaError> {
        if snap.group.is_empty() || snap.group.len() > limits::MAX_GROUP_BYTES {
            return Err(SigmaError::Invalid(format!(
                "group must be 1..={} bytes",
                limits::MAX_GROUP_BYTES
            )));
        }
        if snap.epoch == 0 {
            return Err(SigmaError::Invalid("snapshot epoch must not be 0".into()));
        }
        let mut s = Sigma::with_epoch(snap.group.clone(), snap.epoch);
        s.version = snap.version;
        for w in &snap.workers {
            if s.workers.contains_key(&w.worker_id) {
                return Err(SigmaError::Invalid(format!(
                    "worker {} listed twice",
                    w.worker_id
                )));
            }
            s.worker_up(w.worker_id, w.incarnation, w.capacity, &w.endpoint)?;
        }
        for r in &snap.requests {
            let id = request_id(&r.request_id)?;
            let phase = match v1::RequestPhase::try_from(r.state) {
                Ok(v1::RequestPhase::Reserved) => Phase::Queued,
                Ok(v1::RequestPhase::Active) => Phase::Running,
                _ => {
                    return Err(SigmaError::Invalid(format!(
                        "request {:?} has no valid state",
                        r.request_id
                    )));
                }
            };
            if phase == Phase::Queued && r.generated_tokens != 0 {
                return Err(SigmaError::Invalid(format!(
                    "reserved request {:?} has generated tokens",
                    r.request_id
                )));
            }
            check_tokens("prompt_tokens", r.prompt_tokens)?;
            check_tokens("generated_tokens", r.generated_tokens)?;
            if s.requests.contains_key(id.as_str()) {
                return Err(SigmaError::DuplicateRequest(r.request_id.clone()));
            }
            s.check_worker(r.worker_id, r.incarnation)?;
            let fenced = snap.workers.iter().any(|w| {
                w.worker_id == r.worker_id && Liveness::from_wire(w.liveness) == Liveness::Fenced
            });
            if fenced {
                return Err(SigmaError::WorkerFenced(r.worker_id));
            }
            s.insert(Request {
                id,
                key: 0,
                worker: r.worker_id,
                incarnation: r.incarnation,
                prompt_tokens: r.prompt_tokens,
                generated_tokens: r.generated_tokens,
                phase,
                prompt_hash: r.prompt_hash,
                max_tokens: r.max_tokens,
            })?;
        }
        for w in &snap.workers {
            match Liveness::from_wire(w.liveness) {
                Liveness::Live => {}
                Liveness::Suspect => {
                    s.worker_suspect(w.worker_id, w.incarnation)?;
                }
                Liveness::Fenced => {
                    s.worker_fenced(w.worker_id, w.incarnation)?;
                }
            }
        }
        Ok(s)
    }

    /// The full σ, deterministic: workers sorted by id, requests by request id.
    pub fn to_snapshot(&self) -> v1::ClusterSnapshot {
        let workers = self
            .workers
            .values()
            .map(|w| v1::WorkerState {
                worker_id: w.id,
                incarnation: w.incarnation,
                capacity: w.capacity,
                endpoint: w.endpoint.clone(),
                liveness: w.liveness.to_wire() as i32,
                load_tokens: self.cluster.worker(w.id).map_or(0, |c| c.load()),
            })
            .collect();
        let mut reqs: Vec<&Request> = self.requests.values().collect();
        reqs.sort_unstable_by(|a, b| a.id.cmp(&b.id));
        let requests = reqs
            .into_iter()
            .map(|r| v1::RequestState {
                request_id: r.id.to_string(),
                worker_id: r.worker,
                incarnation: r.incarnation,
                prompt_tokens: r.prompt_tokens,
                generated_tokens: r.generated_tokens,
                state: match r.phase {
                    Phase::Queued => v1::RequestPhase::Reserved,
                    Phase::Running => v1::RequestPhase::Active,
                } as i32,
                prompt_hash: r.prompt_hash,
                max_tokens: r.max_tokens,
            })
            .collect();
        v1::ClusterSnapshot {
            group: self.group.clone(),
            epoch: self.epoch,
            version: self.version,
            workers,
            requests,
        }
    }

    /// Applies a delta if it continues this σ: same epoch, `prev_version` = [`version`]
    /// (Self::version). Otherwise nothing changes and the error says why
    /// ([`SigmaError::EpochMismatch`], [`SigmaError::Gap`]). See the module docs for a change
    /// that fails halfway.
    pub fn apply_delta(&mut self, d: &Delta) -> Result<(), SigmaError> {
        if d.epoch != self.epoch {
            return Err(SigmaError::EpochMismatch {
                have: self.epoch,
                got: d.epoch,
            });
        }
        if d.prev_version != self.version {
            return Err(SigmaError::Gap {
                have: self.version,
                prev: d.prev_version,
            });
        }
        if d.version <= d.prev_version {
            return Err(SigmaError::BadVersion {
                prev: d.prev_version,
                version: d.version,
            });
        }
        for (index, c) in d.changes.iter().enumerate() {
            self.apply_change(c).map_err(|e| SigmaError::Change {
                index,
                source: Box::new(e),
            })?;
        }
        self.version = d.version;
        Ok(())
    }

    /// Applies one change exactly as `types.proto` specifies it. Returns whether σ changed (a
    /// change that restates σ, or a Suspect/Fenced of an incarnation σ does not hold, changes
    /// nothing). On error σ is untouched. Does not move the version: the writer commits a
    /// [`Batch`], a replica applies whole deltas.
    pub fn apply_change(&mut self, c: &v1::Change) -> Result<bool, SigmaError> {
        let Some(kind) = &c.kind else {
            return Err(SigmaError::Invalid("Change.kind is missing".into()));
        };
        match kind {
            Kind::WorkerUp(u) => {
                self.worker_up(u.worker_id, u.incarnation, u.capacity, &u.endpoint)
            }
            Kind::WorkerSuspect(s) => self.worker_suspect(s.worker_id, s.incarnation),
            Kind::WorkerFenced(f) => self.worker_fenced(f.worker_id, f.incarnation),
            Kind::RequestReserved(r) => self.request_reserved(r),
            Kind::RequestProgress(p) => self.request_progress(p),
            Kind::RequestFinished(f) => self.remove_request(&f.request_id, false).map(|_| true),
            Kind::RequestExpired(e) => self.remove_request(&e.request_id, true).map(|_| true),
            Kind::RequestReleased(r) => self.remove_request(&r.request_id, true).map(|_| true),
        }
    }

    /// Starts a batch of changes for the writer: the changes are applied at once, and
    /// [`Batch::commit`] turns those that changed σ into the next version's delta.
    #[must_use = "a batch's changes are applied at once; commit it to move the version"]
    pub fn batch(&mut self) -> Batch<'_> {
        Batch {
            sigma: self,
            changes: Vec::new(),
        }
    }

    pub fn group(&self) -> &str {
        &self.group
    }

    /// 0 for a σ that holds nothing yet ([`Sigma::new`]).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// The routing core's view, kept in step with every change.
    pub fn cluster(&self) -> &ClusterState {
        &self.cluster
    }

    /// The core key of a request in σ.
    pub fn key_of(&self, request_id: &str) -> Option<RequestKey> {
        self.requests.get(request_id).map(|r| r.key)
    }

    /// The request id of a core key.
    pub fn id_of(&self, key: RequestKey) -> Option<&str> {
        self.ids.get(&key).map(RequestId::as_str)
    }

    pub fn worker(&self, id: WorkerId) -> Option<&Worker> {
        self.workers.get(&id)
    }

    /// Every worker, sorted by id (including SUSPECT and FENCED ones).
    pub fn workers(&self) -> impl Iterator<Item = &Worker> + '_ {
        self.workers.values()
    }

    pub fn endpoint(&self, worker: WorkerId) -> Option<&str> {
        self.workers.get(&worker).map(|w| w.endpoint.as_str())
    }

    pub fn incarnation(&self, worker: WorkerId) -> Option<u64> {
        self.workers.get(&worker).map(|w| w.incarnation)
    }

    pub fn liveness(&self, worker: WorkerId) -> Option<Liveness> {
        self.workers.get(&worker).map(|w| w.liveness)
    }

    pub fn request(&self, request_id: &str) -> Option<&Request> {
        self.requests.get(request_id)
    }

    /// Every request, in no particular order.
    pub fn requests(&self) -> impl Iterator<Item = &Request> + '_ {
        self.requests.values()
    }

    pub fn request_count(&self) -> usize {
        self.requests.len()
    }

    // ---- the changes ----

    fn worker_up(
        &mut self,
        id: WorkerId,
        incarnation: u64,
        capacity: u32,
        endpoint: &str,
    ) -> Result<bool, SigmaError> {
        if id > MAX_WORKER_ID {
            return Err(SigmaError::WorkerIdTooLarge(id));
        }
        if incarnation == 0 {
            return Err(SigmaError::Invalid("incarnation must not be 0".into()));
        }
        if capacity == 0 || capacity > limits::MAX_CAPACITY {
            return Err(SigmaError::Invalid(format!(
                "capacity {capacity} is not in 1..={}",
                limits::MAX_CAPACITY
            )));
        }
        if endpoint.len() > limits::MAX_ENDPOINT_BYTES || endpoint.chars().any(char::is_control) {
            return Err(SigmaError::Invalid(
                "endpoint is too long or has control characters".into(),
            ));
        }
        match self.workers.get(&id) {
            Some(w) if w.incarnation == incarnation => {
                let same = w.capacity == capacity && w.endpoint == endpoint;
                if same && w.liveness == Liveness::Live {
                    return Ok(false);
                }
            }
            Some(_) => {
                // Another incarnation: the old one's requests leave with it.
                let dropped = self.cluster.fence_worker(id)?;
                self.forget(&dropped);
            }
            None => {}
        }
        self.cluster.upsert_worker(id, capacity)?;
        self.workers.insert(
            id,
            Worker {
                id,
                incarnation,
                capacity,
                endpoint: endpoint.to_owned(),
                liveness: Liveness::Live,
            },
        );
        Ok(true)
    }

    fn worker_suspect(&mut self, id: WorkerId, incarnation: u64) -> Result<bool, SigmaError> {
        match self.workers.get_mut(&id) {
            Some(w) if w.incarnation == incarnation && w.liveness == Liveness::Live => {
                self.cluster.set_accepting(id, false)?;
                w.liveness = Liveness::Suspect;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    fn worker_fenced(&mut self, id: WorkerId, incarnation: u64) -> Result<bool, SigmaError> {
        match self.workers.get(&id) {
            Some(w) if w.incarnation == incarnation && w.liveness != Liveness::Fenced => {
                let dropped = self.cluster.fence_worker(id)?;
                self.forget(&dropped);
                if let Some(w) = self.workers.get_mut(&id) {
                    w.liveness = Liveness::Fenced;
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    fn request_reserved(&mut self, r: &v1::change::RequestReserved) -> Result<bool, SigmaError> {
        let id = request_id(&r.request_id)?;
        if r.prompt_tokens == 0 {
            return Err(SigmaError::Invalid("prompt_tokens must not be 0".into()));
        }
        check_tokens("prompt_tokens", r.prompt_tokens)?;
        let w = self.check_worker(r.worker_id, r.incarnation)?;
        match w.liveness {
            Liveness::Live => {}
            Liveness::Suspect => return Err(SigmaError::WorkerSuspect(r.worker_id)),
            Liveness::Fenced => return Err(SigmaError::WorkerFenced(r.worker_id)),
        }
        if self.requests.contains_key(id.as_str()) {
            return Err(SigmaError::DuplicateRequest(r.request_id.clone()));
        }
        self.insert(Request {
            id,
            key: 0,
            worker: r.worker_id,
            incarnation: r.incarnation,
            prompt_tokens: r.prompt_tokens,
            generated_tokens: 0,
            phase: Phase::Queued,
            prompt_hash: r.prompt_hash,
            max_tokens: r.max_tokens,
        })?;
        Ok(true)
    }

    fn request_progress(&mut self, p: &v1::change::RequestProgress) -> Result<bool, SigmaError> {
        let id = request_id(&p.request_id)?;
        check_tokens("prompt_tokens", p.prompt_tokens)?;
        check_tokens("generated_tokens", p.generated_tokens)?;
        let w = self.check_worker(p.worker_id, p.incarnation)?;
        if w.liveness == Liveness::Fenced {
            return Err(SigmaError::WorkerFenced(p.worker_id));
        }
        let Some(old) = self.requests.get(id.as_str()) else {
            self.insert(Request {
                id,
                key: 0,
                worker: p.worker_id,
                incarnation: p.incarnation,
                prompt_tokens: p.prompt_tokens,
                generated_tokens: p.generated_tokens,
                phase: Phase::Running,
                prompt_hash: None,
                max_tokens: None,
            })?;
            return Ok(true);
        };
        if old.worker == p.worker_id
            && old.incarnation == p.incarnation
            && old.prompt_tokens == p.prompt_tokens
            && old.generated_tokens == p.generated_tokens
            && old.phase == Phase::Running
        {
            return Ok(false);
        }
        let key = old.key;
        if old.worker == p.worker_id
            && old.prompt_tokens == p.prompt_tokens
            && old.generated_tokens <= p.generated_tokens
        {
            // The common case: more tokens on the same worker (O(log G) in the core).
            self.cluster.set_generated(key, p.generated_tokens)?;
            if let Some(r) = self.requests.get_mut(id.as_str()) {
                r.generated_tokens = p.generated_tokens;
                r.incarnation = p.incarnation;
                r.phase = Phase::Running;
            }
            return Ok(true);
        }
        // Moved to another worker, or the prompt count changed: re-insert in the core.
        let mut r = old.clone();
        self.cluster.remove(key)?;
        r.worker = p.worker_id;
        r.incarnation = p.incarnation;
        r.prompt_tokens = p.prompt_tokens;
        r.generated_tokens = p.generated_tokens;
        r.phase = Phase::Running;
        self.core_insert(&r)?;
        self.requests.insert(r.id.clone(), r);
        Ok(true)
    }

    /// Removes a request; with `reserved_only`, only a RESERVED one (expiry, release).
    fn remove_request(&mut self, id: &str, reserved_only: bool) -> Result<Request, SigmaError> {
        let r = self
            .requests
            .get(id)
            .ok_or_else(|| SigmaError::UnknownRequest(id.to_owned()))?;
        if reserved_only && r.phase != Phase::Queued {
            return Err(SigmaError::NotReserved(id.to_owned()));
        }
        self.cluster.remove(r.key)?;
        let r = self
            .requests
            .remove(id)
            .ok_or_else(|| SigmaError::UnknownRequest(id.to_owned()))?;
        self.ids.remove(&r.key);
        Ok(r)
    }

    // ---- helpers ----

    /// The worker, if σ holds it with this incarnation.
    fn check_worker(&self, id: WorkerId, incarnation: u64) -> Result<&Worker, SigmaError> {
        let w = self.workers.get(&id).ok_or(SigmaError::UnknownWorker(id))?;
        if w.incarnation != incarnation {
            return Err(SigmaError::StaleIncarnation {
                worker: id,
                have: w.incarnation,
                got: incarnation,
            });
        }
        Ok(w)
    }

    /// Adds a new request (its worker checked by the caller), interning its id.
    fn insert(&mut self, mut r: Request) -> Result<(), SigmaError> {
        r.key = self.next_key;
        self.core_insert(&r)?;
        self.next_key += 1;
        self.ids.insert(r.key, r.id.clone());
        self.requests.insert(r.id.clone(), r);
        Ok(())
    }

    /// Inserts into the core. A SUSPECT worker still gets telemetry-reported requests (they
    /// run on it), so it accepts for the duration of the insert.
    fn core_insert(&mut self, r: &Request) -> Result<(), SigmaError> {
        let info = RequestInfo {
            key: r.key,
            worker: r.worker,
            prompt_tokens: r.prompt_tokens,
            generated: r.generated_tokens,
            phase: r.phase,
            prompt_hash: r.prompt_hash,
            oracle_output: None,
        };
        let suspect = self.liveness(r.worker) == Some(Liveness::Suspect);
        if suspect {
            self.cluster.set_accepting(r.worker, true)?;
        }
        let res = self.cluster.reserve(info);
        if suspect {
            self.cluster.set_accepting(r.worker, false)?;
        }
        Ok(res?)
    }

    /// Drops requests the core already removed (a fenced or replaced worker).
    fn forget(&mut self, dropped: &[RequestInfo]) {
        for info in dropped {
            if let Some(id) = self.ids.remove(&info.key) {
                self.requests.remove(id.as_str());
            }
        }
    }
}

fn request_id(s: &str) -> Result<RequestId, SigmaError> {
    RequestId::new(s).map_err(|e| SigmaError::Invalid(e.to_string()))
}

fn check_tokens(field: &str, v: u32) -> Result<(), SigmaError> {
    if v > limits::MAX_TOKENS {
        return Err(SigmaError::Invalid(format!(
            "{field} {v} is above {}",
            limits::MAX_TOKENS
        )));
    }
    Ok(())
}

/// The writer's side: changes applied to σ at once, collected into the next version's delta.
/// Read σ through [`Batch::sigma`] while deciding what to apply next.
#[derive(Debug)]
pub struct Batch<'a> {
    sigma: &'a mut Sigma,
    changes: Vec<v1::Change>,
}

impl Batch<'_> {
    /// Applies `change`; keeps it for the delta if it changed σ. On error nothing changes.
    pub fn apply(&mut self, change: v1::Change) -> Result<bool, SigmaError> {
        let changed = self.sigma.apply_change(&change)?;
        if changed {
            self.changes.push(change);
        }
        Ok(changed)
    }

    pub fn sigma(&self) -> &Sigma {
        self.sigma
    }

    /// The changes kept so far.
    pub fn changes(&self) -> &[v1::Change] {
        &self.changes
    }

    /// Moves σ to the next version and returns its delta, or `None` (and the version stays)
    /// if no change altered σ.
    pub fn commit(self) -> Option<Delta> {
        if self.changes.is_empty() {
            return None;
        }
        let prev = self.sigma.version;
        self.sigma.version += 1;
        Some(Delta {
            epoch: self.sigma.epoch,
            prev_version: prev,
            version: self.sigma.version,
            changes: self.changes,
        })
    }
}

/// Builders for [`v1::Change`]s, so callers need not spell out the oneof.
pub mod change {
    use super::v1;
    use super::v1::change::{self as c, Kind};

    fn wrap(kind: Kind) -> v1::Change {
        v1::Change { kind: Some(kind) }
    }

    pub fn worker_up(
        worker_id: u32,
        incarnation: u64,
        capacity: u32,
        endpoint: &str,
    ) -> v1::Change {
        wrap(Kind::WorkerUp(c::WorkerUp {
            worker_id,
            incarnation,
            capacity,
            endpoint: endpoint.to_owned(),
        }))
    }

    pub fn worker_suspect(worker_id: u32, incarnation: u64) -> v1::Change {
        wrap(Kind::WorkerSuspect(c::WorkerSuspect {
            worker_id,
            incarnation,
        }))
    }

    pub fn worker_fenced(worker_id: u32, incarnation: u64) -> v1::Change {
        wrap(Kind::WorkerFenced(c::WorkerFenced {
            worker_id,
            incarnation,
        }))
    }

    pub fn request_reserved(
        request_id: &str,
        worker_id: u32,
        incarnation: u64,
        prompt_tokens: u32,
        prompt_hash: Option<u64>,
        max_tokens: Option<u32>,
    ) -> v1::Change {
        wrap(Kind::RequestReserved(c::RequestReserved {
            request_id: request_id.to_owned(),
            worker_id,
            incarnation,
            prompt_tokens,
            prompt_hash,
            max_tokens,
        }))
    }

    pub fn request_progress(
        request_id: &str,
        worker_id: u32,
        incarnation: u64,
        prompt_tokens: u32,
        generated_tokens: u32,
    ) -> v1::Change {
        wrap(Kind::RequestProgress(c::RequestProgress {
            request_id: request_id.to_owned(),
            worker_id,
            incarnation,
            prompt_tokens,
            generated_tokens,
        }))
    }

    pub fn request_finished(request_id: &str, generated_tokens: u32) -> v1::Change {
        wrap(Kind::RequestFinished(c::RequestFinished {
            request_id: request_id.to_owned(),
            generated_tokens,
        }))
    }

    pub fn request_expired(request_id: &str) -> v1::Change {
        wrap(Kind::RequestExpired(c::RequestExpired {
            request_id: request_id.to_owned(),
        }))
    }

    pub fn request_released(request_id: &str) -> v1::Change {
        wrap(Kind::RequestReleased(c::RequestReleased {
            request_id: request_id.to_owned(),
        }))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::change::*;
    use super::*;
    use proptest::prelude::*;

    fn sigma() -> Sigma {
        Sigma::with_epoch("g", 7)
    }

    fn commit(s: &mut Sigma, changes: Vec<v1::Change>) -> Option<Delta> {
        let mut b = s.batch();
        for c in changes {
            b.apply(c).unwrap();
        }
        b.commit()
    }

    fn load(s: &Sigma, w: WorkerId) -> u64 {
        s.cluster().worker(w).unwrap().load()
    }

    #[test]
    fn reservation_progress_finish_move_loads() {
        let mut s = sigma();
        let d = commit(
            &mut s,
            vec![
                worker_up(0, 11, 4, "http://a"),
                worker_up(1, 12, 4, ""),
                request_reserved("r1", 0, 11, 100, Some(5), Some(50)),
            ],
        )
        .unwrap();
        assert_eq!((d.prev_version, d.version, s.version()), (0, 1, 1));
        assert_eq!(load(&s, 0), 100);
        let key = s.key_of("r1").unwrap();
        assert_eq!(s.id_of(key), Some("r1"));
        assert_eq!(s.cluster().get(key).unwrap().phase, Phase::Queued);

        commit(&mut s, vec![request_progress("r1", 0, 11, 100, 7)]);
        assert_eq!(load(&s, 0), 107);
        assert_eq!(s.cluster().worker(0).unwrap().running, 1);
        assert_eq!(s.request("r1").unwrap().prompt_hash, Some(5));
        // restating is no change, and no version
        assert!(commit(&mut s, vec![request_progress("r1", 0, 11, 100, 7)]).is_none());
        assert_eq!(s.version(), 2);
        // the worker's report moves it, and its prompt count wins
        commit(&mut s, vec![request_progress("r1", 1, 12, 90, 8)]);
        assert_eq!((load(&s, 0), load(&s, 1)), (0, 98));
        assert_eq!(s.key_of("r1"), Some(key), "the key survives a move");
        commit(&mut s, vec![request_finished("r1", 8)]);
        assert_eq!(load(&s, 1), 0);
        assert_eq!((s.key_of("r1"), s.id_of(key)), (None, None));
    }

    #[test]
    fn worker_lifecycle_follows_the_contract() {
        let mut s = sigma();
        commit(
            &mut s,
            vec![
                worker_up(0, 11, 4, ""),
                request_reserved("a", 0, 11, 10, None, None),
                request_progress("b", 0, 11, 20, 1),
            ],
        );
        // suspect of another incarnation: ignored
        assert!(!s.apply_change(&worker_suspect(0, 99)).unwrap());
        assert!(s.apply_change(&worker_suspect(0, 11)).unwrap());
        assert_eq!(s.liveness(0), Some(Liveness::Suspect));
        assert_eq!(load(&s, 0), 31, "a suspect keeps its load");
        assert_eq!(s.cluster().worker(0).unwrap().free_slots(), 0);
        assert_eq!(
            s.apply_change(&request_reserved("c", 0, 11, 1, None, None)),
            Err(SigmaError::WorkerSuspect(0))
        );
        // telemetry still lands on a suspect worker
        assert!(s.apply_change(&request_progress("d", 0, 11, 5, 0)).unwrap());
        assert!(!s.cluster().worker(0).unwrap().accepting);
        // reconnect of the same incarnation: live, requests stay
        assert!(s.apply_change(&worker_up(0, 11, 8, "x")).unwrap());
        assert_eq!((s.request_count(), load(&s, 0)), (3, 36));
        assert_eq!(s.endpoint(0), Some("x"));
        // fenced: requests gone
        assert!(!s.apply_change(&worker_fenced(0, 12)).unwrap());
        assert!(s.apply_change(&worker_fenced(0, 11)).unwrap());
        assert_eq!((s.request_count(), load(&s, 0)), (0, 0));
        assert_eq!(
            s.apply_change(&request_progress("e", 0, 11, 5, 0)),
            Err(SigmaError::WorkerFenced(0))
        );
        // a new incarnation starts clean, replacing an old one with requests
        s.apply_change(&worker_up(0, 13, 4, "")).unwrap();
        s.apply_change(&request_reserved("f", 0, 13, 3, None, None))
            .unwrap();
        s.apply_change(&worker_up(0, 14, 4, "")).unwrap();
        assert_eq!((s.request_count(), load(&s, 0)), (0, 0));
        assert_eq!(s.incarnation(0), Some(14));
        assert!(s.key_of("f").is_none());
    }

    #[test]
    fn errors_leave_sigma_untouched() {
        let mut s = sigma();
        commit(
            &mut s,
            vec![
                worker_up(0, 11, 4, ""),
                request_reserved("a", 0, 11, 10, None, None),
                request_progress("b", 0, 11, 20, 1),
            ],
        );
        let before = s.to_snapshot();
        let bad = [
            v1::Change { kind: None },
            worker_up(MAX_WORKER_ID + 1, 1, 1, ""),
            worker_up(1, 0, 1, ""),
            worker_up(1, 1, 0, ""),
            request_reserved("", 0, 11, 1, None, None),
            request_reserved(&"x".repeat(257), 0, 11, 1, None, None),
            request_reserved("a", 0, 11, 1, None, None),
            request_reserved("z", 3, 11, 1, None, None),
            request_reserved("z", 0, 12, 1, None, None),
            request_reserved("z", 0, 11, 0, None, None),
            request_progress("z", 0, 11, limits::MAX_TOKENS + 1, 0),
            request_finished("nope", 0),
            request_expired("b"),
            request_released("b"),
            request_released("nope"),
        ];
        for c in &bad {
            assert!(s.apply_change(c).is_err(), "{c:?}");
            assert_eq!(s.to_snapshot(), before, "{c:?}");
        }
    }

    #[test]
    fn deltas_apply_only_in_order() {
        let mut w = sigma();
        let d1 = commit(&mut w, vec![worker_up(0, 1, 2, "")]).unwrap();
        let d2 = commit(&mut w, vec![request_progress("a", 0, 1, 3, 4)]).unwrap();
        let mut r = Sigma::from_snapshot(&Sigma::with_epoch("g", 7).to_snapshot()).unwrap();
        assert_eq!(
            r.apply_delta(&d2),
            Err(SigmaError::Gap { have: 0, prev: 1 })
        );
        let mut other = d1.clone();
        other.epoch = 8;
        assert_eq!(
            r.apply_delta(&other),
            Err(SigmaError::EpochMismatch { have: 7, got: 8 })
        );
        r.apply_delta(&d1).unwrap();
        assert_eq!(
            r.apply_delta(&d1),
            Err(SigmaError::Gap { have: 1, prev: 0 })
        );
        r.apply_delta(&d2).unwrap();
        assert_eq!(r.to_snapshot(), w.to_snapshot());
        assert_eq!(Sigma::new("g").epoch(), 0);
    }

    #[test]
    fn bad_snapshots_are_refused() {
        let mut s = sigma();
        commit(
            &mut s,
            vec![
                worker_up(0, 1, 2, ""),
                worker_up(1, 2, 2, ""),
                request_progress("a", 0, 1, 3, 4),
            ],
        );
        let good = s.to_snapshot();
        assert!(Sigma::from_snapshot(&good).is_ok());
        let mut m = good.clone();
        m.epoch = 0;
        assert!(Sigma::from_snapshot(&m).is_err());
        let mut m = good.clone();
        m.workers[1].worker_id = 0;
        assert!(Sigma::from_snapshot(&m).is_err());
        let mut m = good.clone();
        m.requests[0].incarnation = 9;
        assert!(Sigma::from_snapshot(&m).is_err());
        let mut m = good.clone();
        m.workers[0].liveness = v1::Liveness::Fenced as i32;
        assert!(Sigma::from_snapshot(&m).is_err());
        let mut m = good.clone();
        m.requests.push(m.requests[0].clone());
        assert!(Sigma::from_snapshot(&m).is_err());
        let mut m = good;
        m.requests[0].state = v1::RequestPhase::Reserved as i32;
        assert!(Sigma::from_snapshot(&m).is_err(), "reserved with tokens");
    }

    // ---- property tests ----

    #[derive(Debug, Clone)]
    enum Op {
        Up(u32, u64, u32, bool),
        Suspect(u32, u64),
        Fence(u32, u64),
        Reserve(u8, u32, u64, u32, Option<u64>),
        Progress(u8, u32, u64, u32, u32),
        Finish(u8, u32),
        Expire(u8),
        Release(u8),
        Commit,
    }

    fn op() -> impl Strategy<Value = Op> {
        let w = 0u32..4;
        let inc = 1u64..3;
        let r = 0u8..12;
        prop_oneof![
            (w.clone(), inc.clone(), 1u32..4, any::<bool>())
                .prop_map(|(a, b, c, d)| Op::Up(a, b, c, d)),
            (w.clone(), inc.clone()).prop_map(|(a, b)| Op::Suspect(a, b)),
            (w.clone(), inc.clone()).prop_map(|(a, b)| Op::Fence(a, b)),
            (
                r.clone(),
                w.clone(),
                inc.clone(),
                1u32..100,
                proptest::option::of(0u64..3)
            )
                .prop_map(|(a, b, c, d, e)| Op::Reserve(a, b, c, d, e)),
            (r.clone(), w, inc, 0u32..100, 0u32..50)
                .prop_map(|(a, b, c, d, e)| Op::Progress(a, b, c, d, e)),
            (r.clone(), 0u32..50).prop_map(|(a, b)| Op::Finish(a, b)),
            r.clone().prop_map(Op::Expire),
            r.prop_map(Op::Release),
            Just(Op::Commit),
        ]
    }

    fn to_change(op: &Op) -> Option<v1::Change> {
        let id = |r: &u8| format!("req-{r}");
        Some(match op {
            Op::Up(w, i, c, e) => worker_up(*w, *i, *c, if *e { "http://e" } else { "" }),
            Op::Suspect(w, i) => worker_suspect(*w, *i),
            Op::Fence(w, i) => worker_fenced(*w, *i),
            Op::Reserve(r, w, i, p, h) => request_reserved(&id(r), *w, *i, *p, *h, Some(9)),
            Op::Progress(r, w, i, p, g) => request_progress(&id(r), *w, *i, *p, *g),
            Op::Finish(r, g) => request_finished(&id(r), *g),
            Op::Expire(r) => request_expired(&id(r)),
            Op::Release(r) => request_released(&id(r)),
            Op::Commit => return None,
        })
    }

    /// The core mirror agrees with σ's own entries, and its incremental loads with loads
    /// recomputed from scratch.
    fn check_mirror(s: &Sigma) {
        let core = s.cluster();
        assert_eq!(core.request_count(), s.request_count());
        let mut expect: BTreeMap<WorkerId, (u32, u32, u64, u64)> = BTreeMap::new();
        for r in s.requests() {
            assert_eq!(s.id_of(r.key), Some(r.id.as_str()));
            let info = core.get(r.key).unwrap();
            assert_eq!(
                (
                    info.worker,
                    info.prompt_tokens,
                    info.generated,
                    info.phase,
                    info.prompt_hash
                ),
                (
                    r.worker,
                    r.prompt_tokens,
                    r.generated_tokens,
                    r.phase,
                    r.prompt_hash
                )
            );
            let w = s.worker(r.worker).unwrap();
            assert_eq!(w.incarnation, r.incarnation);
            assert_ne!(w.liveness, Liveness::Fenced);
            let e = expect.entry(r.worker).or_default();
            match r.phase {
                Phase::Queued => {
                    e.0 += 1;
                    e.2 += r.kv_tokens();
                }
                Phase::Running => {
                    e.1 += 1;
                    e.3 += r.kv_tokens();
                }
            }
        }
        assert_eq!(s.ids.len(), s.requests.len());
        let mut max = 0;
        let mut live = 0;
        for w in s.workers() {
            let c = core.worker(w.id).unwrap();
            let (q, run, ql, rl) = expect.get(&w.id).copied().unwrap_or_default();
            assert_eq!(
                (c.queued, c.running, c.queued_load, c.running_load),
                (q, run, ql, rl)
            );
            assert_eq!(c.alive, w.liveness != Liveness::Fenced);
            assert_eq!(c.accepting, w.liveness == Liveness::Live);
            assert_eq!(c.capacity, w.capacity);
            if c.alive {
                live += 1;
                max = max.max(ql + rl);
            }
        }
        assert_eq!(core.live_workers(), live);
        assert_eq!(core.max_load(), max);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn any_version_plus_its_deltas_is_the_latest(ops in proptest::collection::vec(op(), 1..120)) {
            let mut w = Sigma::with_epoch("g", 42);
            let mut snaps = vec![w.to_snapshot()];
            let mut deltas: Vec<Delta> = Vec::new();
            let mut batch: Vec<v1::Change> = Vec::new();
            let flush = |w: &mut Sigma, batch: &mut Vec<v1::Change>, snaps: &mut Vec<v1::ClusterSnapshot>, deltas: &mut Vec<Delta>| {
                let mut b = w.batch();
                for c in batch.drain(..) {
                    let before = b.sigma().to_snapshot();
                    if b.apply(c).is_err() {
                        // an error changes nothing
                        assert_eq!(b.sigma().to_snapshot(), before);
                    }
                }
                if let Some(d) = b.commit() {
                    deltas.push(d);
                    snaps.push(w.to_snapshot());
                }
                check_mirror(w);
            };
            for op in &ops {
                match to_change(op) {
                    Some(c) => batch.push(c),
                    None => flush(&mut w, &mut batch, &mut snaps, &mut deltas),
                }
            }
            flush(&mut w, &mut batch, &mut snaps, &mut deltas);
            let last = w.to_snapshot();
            prop_assert_eq!(last.version as usize, deltas.len());
            for (v, snap) in snaps.iter().enumerate() {
                let mut r = Sigma::from_snapshot(snap).unwrap();
                prop_assert_eq!(&r.to_snapshot(), snap, "snapshot round trip");
                check_mirror(&r);
                for d in &deltas[v..] {
                    r.apply_delta(d).unwrap();
                }
                check_mirror(&r);
                prop_assert_eq!(&r.to_snapshot(), &last);
            }
        }
    }
}
