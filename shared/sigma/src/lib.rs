//! σ of one group: the snapshot service's store and every watcher's replica.
//!
//! This crate owns σ. The snapshot service is its single writer (through a [`Batch`]); the
//! decision service and any other watcher hold replicas (through [`Sigma::apply_delta`]).
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
//!
//! Modules: [`types`] (workers, requests, liveness, errors), the store ([`Sigma`]), [`Batch`]
//! (the writer's side), [`change`] (builders for the wire's changes) and [`Adoptions`] (the
//! writer's request-id rule for requests reported without the gateway's id) and [`summary`]
//! (what operators see of σ: per-rank loads and the barrier numbers, for brctl and the live
//! page); [`fixtures`] (tests only, or the `fixtures` feature) holds a small wire snapshot.

mod batch;
pub mod change;
#[cfg(any(test, feature = "fixtures"))]
pub mod fixtures;
mod id_key;
mod size;
mod store;
pub mod summary;
mod types;
mod unkeyed;

pub use batch::Batch;
pub use size::{DEFAULT_MAX_GROUP_REQUESTS, MAX_SNAPSHOT_MESSAGE_BYTES, max_snapshot_bytes};
pub use store::Sigma;
pub use summary::{GroupSummary, WorkerSummary};
pub use types::{Delta, Hints, Liveness, Request, RequestBound, SigmaError, Worker};
pub use unkeyed::{Adopted, Adoptions};

use br_proto::valid::limits;

/// The most KV tokens (prompt + generated) one request holds in σ.
pub use limits::MAX_REQUEST_TOKENS;
/// The largest worker id in a group: the contract's one limit, `br_proto::valid::limits`.
pub use limits::MAX_WORKER_ID;

/// The longest carrier (an ingest replica's id, `ChangeBatch.ingest_id`) σ holds, in bytes.
pub const MAX_CARRIER_BYTES: usize = 128;

// σ mirrors each group into a `br_core::ClusterState`, whose per-worker arrays hold ids below
// `br_core::MAX_WORKERS`; the contract's limit must fit in it.
const _: () = assert!(MAX_WORKER_ID < br_core::MAX_WORKERS);

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests;
