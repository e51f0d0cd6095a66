//! The parts of σ: its workers, its requests, their liveness, and why a change is refused.

use br_core::{CoreError, Phase, RequestKey, WorkerId};
use br_proto::v1;
use br_proto::valid::RequestId;

use crate::MAX_WORKER_ID;

/// A delta between two versions of σ, as sent by `Snapshot.Watch`.
pub type Delta = v1::watch_event::Delta;

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
    pub(crate) fn to_wire(self) -> v1::Liveness {
        match self {
            Liveness::Live => v1::Liveness::Live,
            Liveness::Suspect => v1::Liveness::Suspect,
            Liveness::Fenced => v1::Liveness::Fenced,
        }
    }

    /// UNSPECIFIED (and unknown values) are FENCED, as the contract says.
    pub(crate) fn from_wire(v: i32) -> Liveness {
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
    /// The ingest replica its current Hello came through; empty if unknown.
    pub carrier: String,
    /// Cordoned by an operator: keeps its liveness and requests, takes no new ones. Belongs
    /// to the worker id (kept across incarnations and fences).
    pub cordoned: bool,
}

impl Worker {
    /// Whether the worker may take new assignments: LIVE and not cordoned.
    pub fn accepts_new_work(&self) -> bool {
        self.liveness == Liveness::Live && !self.cordoned
    }
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
    /// What the gateway said of its output beside `max_tokens`, as Assign took it.
    pub hints: Hints,
    /// Where the routing core keeps it, so a progress report skips the core's key → slot
    /// lookup ([`br_core::ClusterState::set_generated_in`]).
    pub(crate) slot: SlotHint,
}

/// What the gateway said of a request's output beside its `max_tokens`
/// (`AssignRequest.expected_output_tokens` and the id of its `request_class`): none for a
/// request that was never reserved (it appeared through telemetry) or whose reservation came
/// from a service older than these fields.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Hints {
    /// The client's expected output tokens.
    pub expected_output: Option<u32>,
    /// The id of the request's class (`br_proto::valid::class_id` of its key).
    pub class: Option<u64>,
}

/// A request's slot in the routing core, as last seen. Only a hint (the core checks it), and
/// no part of what the request is: two σ holding the same requests may keep them in other
/// slots (a replica filled from a snapshot, the writer one change at a time), so it compares
/// equal to any other.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SlotHint(pub(crate) u32);

impl PartialEq for SlotHint {
    fn eq(&self, _: &SlotHint) -> bool {
        true
    }
}

impl Eq for SlotHint {}

impl Request {
    /// KV tokens this request counts for on its worker.
    pub fn kv_tokens(&self) -> u64 {
        u64::from(self.prompt_tokens) + u64::from(self.generated_tokens)
    }
}

/// The writer's bound on the requests σ holds ([`crate::Sigma::set_bound`]): what a peer can
/// make the snapshot service hold, and what every watcher must be able to receive in one
/// snapshot ([`crate::max_snapshot_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestBound {
    /// Requests a worker may hold above its capacity B (reservations queued at the rank by
    /// on-arrival policies, requests waiting in the engine's own queue).
    pub over_capacity: u32,
    /// Requests the group may hold.
    pub per_group: usize,
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
    #[error("worker {0} is cordoned and takes no reservations")]
    WorkerCordoned(WorkerId),
    #[error("request {0:?} is not in σ")]
    UnknownRequest(String),
    #[error("request {0:?} is already in σ")]
    DuplicateRequest(String),
    #[error("request {0:?} is active, not reserved")]
    NotReserved(String),
    #[error("worker id {0} is above the limit of {MAX_WORKER_ID}")]
    WorkerIdTooLarge(WorkerId),
    /// The writer's bound: the worker already holds its capacity plus the margin.
    #[error(
        "worker {worker} holds {held} requests, at most {max} (its capacity plus the margin) are allowed"
    )]
    WorkerOverfull {
        worker: WorkerId,
        held: u32,
        max: u32,
    },
    /// The writer's bound: the group already holds its most requests.
    #[error("the group holds {held} requests, at most {max} are allowed")]
    GroupFull { held: usize, max: usize },
    /// A report of more generated tokens than the request's max_tokens.
    #[error(
        "request {request_id:?} reports {generated} generated tokens, above its max_tokens {max_tokens}"
    )]
    AboveMaxTokens {
        request_id: String,
        generated: u32,
        max_tokens: u32,
    },
    /// The core mirror refused an operation σ allowed: a bug, reported rather than panicking.
    #[error("routing core: {0}")]
    Core(#[from] CoreError),
}
