//! [`Sigma`]: the store itself, its snapshot round trip and the one "apply a change".

use std::collections::BTreeMap;

use br_core::{ClusterState, Phase, RequestInfo, RequestKey, WorkerId};
use br_proto::v1;
use br_proto::v1::change::Kind;
use br_proto::valid::{RequestId, limits};
use rustc_hash::{FxBuildHasher, FxHashMap};

use crate::id_key::{ById, IdKey};
use crate::types::{Delta, Hints, Liveness, Request, RequestBound, SigmaError, SlotHint, Worker};
use crate::{MAX_CARRIER_BYTES, MAX_REQUEST_TOKENS, MAX_WORKER_ID};

mod snapshot;

/// σ of one group at one (epoch, version), with its routing-core mirror.
#[derive(Debug, Clone)]
pub struct Sigma {
    group: String,
    pub(crate) epoch: u64,
    pub(crate) version: u64,
    workers: BTreeMap<WorkerId, Worker>,
    /// By id, the id inline in the table where it fits ([`IdKey`]).
    pub(crate) requests: hashbrown::HashMap<IdKey, Request, FxBuildHasher>,
    pub(crate) ids: FxHashMap<RequestKey, RequestId>,
    next_key: RequestKey,
    cluster: ClusterState,
    /// Per worker id, the generated tokens σ has learnt of ([`Sigma::generated_tokens`]).
    /// A Vec indexed by worker id (at most `MAX_WORKER_ID + 1` entries, sized when a worker
    /// comes up) and not a field of [`Worker`]: the progress path then adds to it by index,
    /// with no map lookup and no change to the worker type, and a dense array of counters is
    /// the cheapest thing to keep beside the workers' map.
    generated: Vec<u64>,
    /// The writer's bound on the requests σ takes (None: a replica, which takes what the
    /// writer sent).
    bound: Option<RequestBound>,
}

impl Sigma {
    /// An empty σ holding nothing: epoch 0, version 0 (a replica before its first snapshot).
    pub fn new(group: impl Into<String>) -> Sigma {
        Sigma::with_epoch(group, 0)
    }

    /// An empty σ at version 0 of `epoch` (the snapshot service's store for a new group).
    pub fn with_epoch(group: impl Into<String>, epoch: u64) -> Sigma {
        Sigma::with_epoch_at(group, epoch, 0)
    }

    /// An empty σ at `version` of `epoch`: the snapshot service's store for a group it held
    /// before in this epoch and reclaimed, started above every version it served, so nobody's
    /// replica of the old σ passes for a version of the new one.
    pub fn with_epoch_at(group: impl Into<String>, epoch: u64, version: u64) -> Sigma {
        Sigma {
            group: group.into(),
            epoch,
            version,
            workers: BTreeMap::new(),
            requests: hashbrown::HashMap::default(),
            ids: FxHashMap::default(),
            next_key: 1,
            cluster: ClusterState::new(),
            generated: Vec::new(),
            bound: None,
        }
    }

    /// Bounds the requests this σ takes from now on (the writer's side; see
    /// [`RequestBound`]). A request that would put its worker above its capacity plus
    /// `over_capacity`, or the group above `per_group`, is refused
    /// ([`SigmaError::WorkerOverfull`], [`SigmaError::GroupFull`]); requests already held stay.
    /// Replicas need no bound: they take the writer's deltas, which never pass it.
    pub fn set_bound(&mut self, bound: RequestBound) {
        self.bound = Some(bound);
    }

    /// The bound set by [`Sigma::set_bound`], if any.
    pub fn bound(&self) -> Option<RequestBound> {
        self.bound
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
    /// [`crate::Batch`], a replica applies whole deltas.
    pub fn apply_change(&mut self, c: &v1::Change) -> Result<bool, SigmaError> {
        let Some(kind) = &c.kind else {
            return Err(SigmaError::Invalid("Change.kind is missing".into()));
        };
        match kind {
            Kind::WorkerUp(u) => self.worker_up(
                u.worker_id,
                u.incarnation,
                u.capacity,
                &u.endpoint,
                &u.carrier,
            ),
            Kind::WorkerSuspect(s) => self.worker_suspect(s.worker_id, s.incarnation),
            Kind::WorkerFenced(f) => self.worker_fenced(f.worker_id, f.incarnation),
            Kind::RequestReserved(r) => self.request_reserved(r),
            Kind::RequestProgress(p) => self.request_progress(p),
            Kind::RequestFinished(f) => self.remove_request(&f.request_id, false).map(|_| true),
            Kind::RequestExpired(e) => self.remove_request(&e.request_id, true).map(|_| true),
            Kind::RequestReleased(r) => self.remove_request(&r.request_id, true).map(|_| true),
            Kind::WorkerCordon(c) => self.worker_cordon(c.worker_id, c.cordoned),
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
        self.requests.get(&ById(request_id)).map(|r| r.key)
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
        self.requests.get(&ById(request_id))
    }

    /// Every request, in no particular order.
    pub fn requests(&self) -> impl Iterator<Item = &Request> + '_ {
        self.requests.values()
    }

    pub fn request_count(&self) -> usize {
        self.requests.len()
    }

    /// The tokens `worker` generated that this σ learnt of from progress reports: what each
    /// report adds to a request's `generated_tokens`, and a request's tokens when it first
    /// shows running. Monotonic for the worker id (across incarnations and fences); a report
    /// that restates or lowers the count adds nothing. It counts from this σ's creation: a σ
    /// built from a snapshot starts at 0, as the snapshot's tokens were generated at times it
    /// does not know. Local to this σ (not on the wire), so a watcher can turn it into a
    /// decode rate by sampling it; 0 for a worker σ never held.
    pub fn generated_tokens(&self, worker: WorkerId) -> u64 {
        self.generated.get(worker as usize).copied().unwrap_or(0)
    }

    /// Gives back the capacity of the request maps once a burst that filled them is over
    /// (see [`br_memory::shrink_sparse_map`]); σ itself does not change. For housekeeping.
    pub fn shrink_sparse(&mut self) {
        if br_memory::is_sparse(self.requests.len(), self.requests.capacity()) {
            self.requests.shrink_to(2 * self.requests.len());
        }
        br_memory::shrink_sparse_map(&mut self.ids);
    }

    // ---- the changes ----

    fn worker_up(
        &mut self,
        id: WorkerId,
        incarnation: u64,
        capacity: u32,
        endpoint: &str,
        carrier: &str,
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
        if carrier.len() > MAX_CARRIER_BYTES || carrier.chars().any(char::is_control) {
            return Err(SigmaError::Invalid(format!(
                "carrier is longer than {MAX_CARRIER_BYTES} bytes or has control characters"
            )));
        }
        // The cordon is the operator's, on the worker id: a new incarnation keeps it.
        let cordoned = self.workers.get(&id).is_some_and(|w| w.cordoned);
        match self.workers.get(&id) {
            Some(w) if w.incarnation == incarnation => {
                // A new carrier alone is a change too: the worker's stream moved to another
                // ingest replica (a takeover), which replicas see.
                let same = w.capacity == capacity && w.endpoint == endpoint && w.carrier == carrier;
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
        if cordoned {
            self.cluster.set_accepting(id, false)?;
        }
        if self.generated.len() <= id as usize {
            self.generated.resize(id as usize + 1, 0);
        }
        self.workers.insert(
            id,
            Worker {
                id,
                incarnation,
                capacity,
                endpoint: endpoint.to_owned(),
                liveness: Liveness::Live,
                carrier: carrier.to_owned(),
                cordoned,
            },
        );
        Ok(true)
    }

    fn worker_cordon(&mut self, id: WorkerId, cordoned: bool) -> Result<bool, SigmaError> {
        let w = self
            .workers
            .get_mut(&id)
            .ok_or(SigmaError::UnknownWorker(id))?;
        if w.cordoned == cordoned {
            return Ok(false);
        }
        w.cordoned = cordoned;
        let accepts = w.accepts_new_work();
        if w.liveness != Liveness::Fenced {
            self.cluster.set_accepting(id, accepts)?;
        }
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
        check_tokens(r.prompt_tokens, 0)?;
        let w = self.check_worker(r.worker_id, r.incarnation)?;
        match w.liveness {
            Liveness::Live => {}
            Liveness::Suspect => return Err(SigmaError::WorkerSuspect(r.worker_id)),
            Liveness::Fenced => return Err(SigmaError::WorkerFenced(r.worker_id)),
        }
        if w.cordoned {
            return Err(SigmaError::WorkerCordoned(r.worker_id));
        }
        if self.requests.contains_key(&ById(id.as_str())) {
            return Err(SigmaError::DuplicateRequest(r.request_id.clone()));
        }
        self.check_room(r.worker_id)?;
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
            hints: Hints {
                expected_output: r.expected_output_tokens,
                class: r.request_class_id,
            },
            slot: SlotHint::default(),
        })?;
        Ok(true)
    }

    fn request_progress(&mut self, p: &v1::change::RequestProgress) -> Result<bool, SigmaError> {
        // The common report (more tokens of a request σ holds) is applied on the writer and
        // on every replica, once per progress event: it takes one lookup by id and allocates
        // nothing. An id σ holds was validated when it came in, so only a new one is checked
        // (and interned), in the order the checks always had.
        let Some(old) = self.requests.get_mut(&ById(&p.request_id)) else {
            let id = request_id(&p.request_id)?;
            check_tokens(p.prompt_tokens, p.generated_tokens)?;
            let w = self.check_worker(p.worker_id, p.incarnation)?;
            if w.liveness == Liveness::Fenced {
                return Err(SigmaError::WorkerFenced(p.worker_id));
            }
            self.check_room(p.worker_id)?;
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
                hints: Hints::default(),
                slot: SlotHint::default(),
            })?;
            self.count_generated(p.worker_id, p.generated_tokens);
            return Ok(true);
        };
        check_tokens(p.prompt_tokens, p.generated_tokens)?;
        let w = worker_of(&self.workers, p.worker_id, p.incarnation)?;
        if w.liveness == Liveness::Fenced {
            return Err(SigmaError::WorkerFenced(p.worker_id));
        }
        if old.worker == p.worker_id
            && old.incarnation == p.incarnation
            && old.prompt_tokens == p.prompt_tokens
            && old.generated_tokens == p.generated_tokens
            && old.phase == Phase::Running
        {
            return Ok(false);
        }
        if let Some(max) = old.max_tokens
            && p.generated_tokens > max
        {
            // The gateway's max_tokens is the contract's upper bound on what the request
            // generates (the engine stops there); a report above it is not the engine's state.
            return Err(SigmaError::AboveMaxTokens {
                request_id: p.request_id.clone(),
                generated: p.generated_tokens,
                max_tokens: max,
            });
        }
        if old.worker == p.worker_id
            && old.prompt_tokens == p.prompt_tokens
            && old.generated_tokens <= p.generated_tokens
        {
            // The common case: more tokens on the same worker (O(log G) in the core).
            self.cluster
                .set_generated_in(old.slot.0, old.key, p.generated_tokens)?;
            let more = p.generated_tokens - old.generated_tokens;
            old.generated_tokens = p.generated_tokens;
            old.incarnation = p.incarnation;
            old.phase = Phase::Running;
            self.count_generated(p.worker_id, more);
            return Ok(true);
        }
        let mut r = old.clone();
        if r.worker != p.worker_id {
            self.check_room(p.worker_id)?;
        }
        // Moved to another worker, or the prompt count changed: re-insert in the core.
        self.cluster.remove(r.key)?;
        // The tokens since the last report were generated where the report comes from.
        let more = p.generated_tokens.saturating_sub(r.generated_tokens);
        r.worker = p.worker_id;
        r.incarnation = p.incarnation;
        r.prompt_tokens = p.prompt_tokens;
        r.generated_tokens = p.generated_tokens;
        r.phase = Phase::Running;
        r.slot = self.core_insert(&r)?;
        self.requests.insert(IdKey::new(&r.id), r);
        self.count_generated(p.worker_id, more);
        Ok(true)
    }

    /// Removes a request; with `reserved_only`, only a RESERVED one (expiry, release).
    fn remove_request(&mut self, id: &str, reserved_only: bool) -> Result<Request, SigmaError> {
        let r = self
            .requests
            .get(&ById(id))
            .ok_or_else(|| SigmaError::UnknownRequest(id.to_owned()))?;
        if reserved_only && r.phase != Phase::Queued {
            return Err(SigmaError::NotReserved(id.to_owned()));
        }
        self.cluster.remove(r.key)?;
        let r = self
            .requests
            .remove(&ById(id))
            .ok_or_else(|| SigmaError::UnknownRequest(id.to_owned()))?;
        self.ids.remove(&r.key);
        Ok(r)
    }

    // ---- helpers ----

    /// Adds to [`Sigma::generated_tokens`] once a report is applied (σ's errors leave it as
    /// it was). The worker is in σ, so its entry exists.
    fn count_generated(&mut self, worker: WorkerId, tokens: u32) {
        if let Some(n) = self.generated.get_mut(worker as usize) {
            *n += u64::from(tokens);
        }
    }

    /// The worker, if σ holds it with this incarnation.
    fn check_worker(&self, id: WorkerId, incarnation: u64) -> Result<&Worker, SigmaError> {
        worker_of(&self.workers, id, incarnation)
    }

    /// Whether the writer's bound lets one more request onto `worker` (always, without a
    /// bound).
    fn check_room(&self, worker: WorkerId) -> Result<(), SigmaError> {
        let Some(bound) = self.bound else {
            return Ok(());
        };
        if self.requests.len() >= bound.per_group {
            return Err(SigmaError::GroupFull {
                held: self.requests.len(),
                max: bound.per_group,
            });
        }
        let capacity = self.workers.get(&worker).map_or(0, |w| w.capacity);
        let held = self.cluster.worker(worker).map_or(0, |w| w.requests());
        let max = capacity.saturating_add(bound.over_capacity);
        if held >= max {
            return Err(SigmaError::WorkerOverfull { worker, held, max });
        }
        Ok(())
    }

    /// Adds a new request (its worker checked by the caller), interning its id.
    fn insert(&mut self, mut r: Request) -> Result<(), SigmaError> {
        r.key = self.next_key;
        r.slot = self.core_insert(&r)?;
        self.next_key += 1;
        self.ids.insert(r.key, r.id.clone());
        self.requests.insert(IdKey::new(&r.id), r);
        Ok(())
    }

    /// Inserts into the core. A SUSPECT or cordoned worker still gets telemetry-reported
    /// requests (they run on it), so it accepts for the duration of the insert. Returns the
    /// request's slot there.
    fn core_insert(&mut self, r: &Request) -> Result<SlotHint, SigmaError> {
        let info = RequestInfo {
            key: r.key,
            worker: r.worker,
            prompt_tokens: r.prompt_tokens,
            generated: r.generated_tokens,
            phase: r.phase,
            prompt_hash: r.prompt_hash,
            oracle_output: None,
            expected_output: r.hints.expected_output,
            class: r.hints.class,
        };
        let blocked = self
            .workers
            .get(&r.worker)
            .is_some_and(|w| !w.accepts_new_work());
        if blocked {
            self.cluster.set_accepting(r.worker, true)?;
        }
        let key = info.key;
        let res = self.cluster.reserve(info);
        if blocked {
            self.cluster.set_accepting(r.worker, false)?;
        }
        res?;
        Ok(SlotHint(self.cluster.slot_of(key).unwrap_or_default()))
    }

    /// Drops requests the core already removed (a fenced or replaced worker).
    fn forget(&mut self, dropped: &[RequestInfo]) {
        for info in dropped {
            if let Some(id) = self.ids.remove(&info.key) {
                self.requests.remove(&ById(id.as_str()));
            }
        }
    }
}

/// The worker, if `workers` holds it with this incarnation ([`Sigma::check_worker`] for a
/// caller that holds another field of σ borrowed).
fn worker_of(
    workers: &BTreeMap<WorkerId, Worker>,
    id: WorkerId,
    incarnation: u64,
) -> Result<&Worker, SigmaError> {
    let w = workers.get(&id).ok_or(SigmaError::UnknownWorker(id))?;
    if w.incarnation != incarnation {
        return Err(SigmaError::StaleIncarnation {
            worker: id,
            have: w.incarnation,
            got: incarnation,
        });
    }
    Ok(w)
}

fn request_id(s: &str) -> Result<RequestId, SigmaError> {
    RequestId::new(s).map_err(|e| SigmaError::Invalid(e.to_string()))
}

/// One request's token counts: each within the wire's limit, and its KV tokens (prompt +
/// generated) within [`MAX_REQUEST_TOKENS`].
fn check_tokens(prompt: u32, generated: u32) -> Result<(), SigmaError> {
    for (field, v) in [("prompt_tokens", prompt), ("generated_tokens", generated)] {
        if v > limits::MAX_TOKENS {
            return Err(SigmaError::Invalid(format!(
                "{field} {v} is above {}",
                limits::MAX_TOKENS
            )));
        }
    }
    let kv = u64::from(prompt) + u64::from(generated);
    if kv > u64::from(MAX_REQUEST_TOKENS) {
        return Err(SigmaError::Invalid(format!(
            "prompt_tokens + generated_tokens is {kv}, above {MAX_REQUEST_TOKENS}"
        )));
    }
    Ok(())
}
