//! The request-id rule, on σ's writer: how a request that reached its worker without the
//! gateway's id (telemetry `unkeyed`: the shim knew only the engine's response id) is matched
//! to a reservation, so that its load is counted once.
//!
//! A gateway reserves request `R` through `Assign`; if it then sends the request without
//! `X-Request-Id`, the worker reports it as `U` (the engine's id), which no reservation names.
//! Counting `U` as new load while `R` stays RESERVED until its TTL counts the request twice.
//! The rule:
//! - **adopt**: the first report of an unkeyed `U` that σ does not hold takes over the worker's
//!   oldest outstanding reservation (same incarnation): that reservation is released and `U`
//!   enters σ in its place (RESERVED with its prompt tokens, hash, `max_tokens` and hints, then
//!   ACTIVE by the report), in the same version. With no reservation on the worker, `U` is
//!   new load (a request that was never reserved, or whose reservation expired).
//! - **hand on**: the oldest reservation may not have been `U`'s (a mix of keyed and unkeyed
//!   requests on one worker). If the adopted reservation's own id later shows up (a keyed
//!   report of it, or a `Release` from `Cancel`), then `U`'s real reservation is still
//!   outstanding, and the oldest reservation left on the worker is released in its place
//!   (itself remembered the same way).
//!
//! So every arrival, unkeyed or keyed, removes at most one reservation and adds one request:
//! σ holds each real request once, as a reservation until it arrives and as itself after
//! (the property test in `tests.rs` checks it against a model of the worker). Only the
//! writer runs this (the snapshot service); watchers see the ordinary changes it makes
//! (RequestReleased, RequestReserved, RequestProgress), so older replicas apply them as they
//! are.

use std::collections::VecDeque;

use br_core::{Phase, WorkerId};
use br_proto::valid::RequestId;
use rustc_hash::FxHashMap;

use crate::batch::Batch;
use crate::change;
use crate::types::{Liveness, Request, SigmaError};

/// The default bound on the reservations remembered as taken (per group): far above the
/// reservations a group holds at once (they expire with the reservation TTL anyway).
pub const DEFAULT_MAX_TAKEN: usize = 65_536;

/// What an unkeyed first report did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adopted {
    /// It took over this reservation (released in the same version).
    Matched(Request),
    /// The worker had no reservation: the request is new load.
    Unmatched,
}

/// The reservations whose place an unkeyed request took, and on which worker (the writer's
/// memory, not part of σ; bounded, oldest forgotten first).
#[derive(Debug, Clone)]
pub struct Adoptions {
    taken: FxHashMap<RequestId, WorkerId>,
    order: VecDeque<RequestId>,
    max: usize,
}

impl Default for Adoptions {
    fn default() -> Self {
        Adoptions::new(DEFAULT_MAX_TAKEN)
    }
}

impl Adoptions {
    pub fn new(max: usize) -> Adoptions {
        Adoptions {
            taken: FxHashMap::default(),
            order: VecDeque::new(),
            max: max.max(1),
        }
    }

    /// How many taken reservations are remembered.
    pub fn len(&self) -> usize {
        self.taken.len()
    }

    pub fn is_empty(&self) -> bool {
        self.taken.is_empty()
    }

    /// The first report of unkeyed request `id` (σ holds no request `id`) on `worker`
    /// (`incarnation`): takes over the worker's oldest reservation, if it has one (see the
    /// module docs). After a match σ holds `id` RESERVED with the reservation's prompt tokens
    /// (when the worker is LIVE; a SUSPECT worker takes no reservation, so the caller reports
    /// `id` with the returned reservation's prompt tokens itself).
    pub fn adopt(
        &mut self,
        b: &mut Batch<'_>,
        id: &str,
        worker: WorkerId,
        incarnation: u64,
    ) -> Result<Adopted, SigmaError> {
        if b.sigma().request(id).is_some() {
            return Ok(Adopted::Unmatched);
        }
        let Some(old) = oldest_reserved(b, worker, incarnation) else {
            return Ok(Adopted::Unmatched);
        };
        b.apply(change::request_released(old.id.as_str()))?;
        if b.sigma().liveness(worker) == Some(Liveness::Live) {
            b.apply(change::request_reserved_hinted(
                id,
                worker,
                incarnation,
                old.prompt_tokens,
                old.prompt_hash,
                old.max_tokens,
                old.hints,
            ))?;
        }
        self.remember(old.id.clone(), worker);
        Ok(Adopted::Matched(old))
    }

    /// The worker whose reservation `id` was, if an unkeyed request took it.
    pub fn taken_on(&self, id: &str) -> Option<WorkerId> {
        self.taken.get(id).copied()
    }

    /// Request `id`, which σ does not hold, is named by its own id (a keyed report of it, or
    /// a Release): if an unkeyed request took its reservation, the oldest reservation left on
    /// that worker is released in its place (and remembered as taken). Returns the
    /// reservation released, if any.
    pub fn named(&mut self, b: &mut Batch<'_>, id: &str) -> Result<Option<RequestId>, SigmaError> {
        if b.sigma().request(id).is_some() {
            return Ok(None);
        }
        let Some(worker) = self.taken.remove(id) else {
            return Ok(None);
        };
        let Some(incarnation) = b.sigma().incarnation(worker) else {
            return Ok(None);
        };
        let Some(old) = oldest_reserved(b, worker, incarnation) else {
            return Ok(None);
        };
        b.apply(change::request_released(old.id.as_str()))?;
        self.remember(old.id.clone(), worker);
        Ok(Some(old.id))
    }

    fn remember(&mut self, id: RequestId, worker: WorkerId) {
        self.taken.insert(id.clone(), worker);
        self.order.push_back(id);
        while self.order.len() > self.max {
            if let Some(gone) = self.order.pop_front() {
                self.taken.remove(&gone);
            }
        }
        // `named` removes from `taken` only; entries it left in `order` are dropped here
        // once they outnumber the live ones, so `order` stays bounded by 2 x max.
        if self.order.len() > 2 * self.taken.len() + 64 {
            let taken = &self.taken;
            self.order.retain(|id| taken.contains_key(id));
        }
    }
}

/// The worker's oldest RESERVED request of `incarnation`: the one σ's writer took first (keys
/// are handed out in arrival order and never reused within one σ).
fn oldest_reserved(b: &Batch<'_>, worker: WorkerId, incarnation: u64) -> Option<Request> {
    let sigma = b.sigma();
    sigma
        .cluster()
        .requests_of(worker)
        .filter(|info| info.phase == Phase::Queued)
        .filter_map(|info| sigma.id_of(info.key).and_then(|id| sigma.request(id)))
        .filter(|r| r.incarnation == incarnation)
        .min_by_key(|r| r.key)
        .cloned()
}
