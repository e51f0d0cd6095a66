//! The requests this group knows by id, their callers, and the pool of the waiting ones: the
//! first of the two per-request state machines (a reservation's is in
//! [`super::reservations`]).
//!
//! `Waiting` (in the pool; pooled policies only) -> `Reserving` (admitted to a worker, its
//! reservation on its way into σ) -> `Answered` (kept for `answered_ttl` so that retries get
//! the same answer). A rejected reservation goes back to `Waiting`.
//!
//! Owns: the requests by key and by id (the local key space), each request's callers and
//! whether any is left, the pool, the answered requests and their expiry, and the pool-size
//! gauge. It keeps `ids` and `reqs` in step and counts the answered ones. It knows nothing of
//! σ, of reservations or of the wire: callers pass in the placement and the answer.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use br_core::{Pool, PoolEntry, RequestKey};
use br_proto::valid::{RequestClass, RequestId, ValidAssign};
use br_sigma::Hints;
use prometheus::IntGauge;
use rustc_hash::FxHashMap;
use tokio::sync::oneshot;

use super::LOCAL_KEY_BASE;
use crate::error::DecisionError;

/// What a waiting `Assign` call receives.
pub type Reply = oneshot::Sender<Result<Assignment, DecisionError>>;

/// The answer to an `Assign`: the worker that takes the request (what the gateway needs to
/// send it there) and how it was decided. [`super::wire`] turns it into an `AssignResponse`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub worker: u32,
    /// The worker's address, as σ knows it (empty if σ has none).
    pub endpoint: String,
    /// Name of the policy that decided.
    pub policy: &'static str,
    /// Arrival to admission (zero for on-arrival policies).
    pub pool_wait: Duration,
    pub incarnation: u64,
    /// The σ version the decision was made on.
    pub sigma_version: u64,
    /// Decided without the snapshot service confirming σ (and not reserved yet).
    pub stale: bool,
}

/// Where an admitted request goes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Placement {
    pub(super) worker: u32,
    pub(super) incarnation: u64,
    pub(super) admitted: Instant,
    pub(super) sigma_version: u64,
}

pub(super) enum State {
    Waiting,
    Reserving {
        at: Placement,
        /// Every caller has gone (cancelled or withdrawn): release once accepted.
        abandoned: bool,
        reroutes: u32,
    },
    Answered {
        resp: Assignment,
        at: Instant,
        /// Callers the answer reached (a handler dropped before reading it gives one back).
        delivered: u32,
    },
}

struct Waiter {
    call: u64,
    tx: Reply,
}

/// One request, from its first caller until it is forgotten.
pub(super) struct Req {
    pub(super) id: RequestId,
    pub(super) prompt_tokens: u32,
    pub(super) prompt_hash: Option<u64>,
    pub(super) max_tokens: Option<u32>,
    /// The gateway's hints on the output: the expected tokens, and the class id (its key
    /// is not kept: only the id travels further).
    pub(super) hints: Hints,
    pub(super) arrived: Instant,
    pub(super) state: State,
    waiters: Vec<Waiter>,
    /// The identity (SPIFFE id) of the first caller, under mutual TLS: only it may `Cancel`
    /// the request. `None` on a plaintext server, where any caller may.
    pub(super) owner: Option<Arc<str>>,
}

impl Req {
    /// Whether no caller waits for it (any more).
    pub(super) fn unwaited(&self) -> bool {
        self.waiters.is_empty()
    }

    fn entry(&self, key: RequestKey) -> PoolEntry {
        PoolEntry {
            key,
            prompt_tokens: self.prompt_tokens,
            prompt_hash: self.prompt_hash,
            oracle_output: None,
            expected_output: self.hints.expected_output,
            class: self.hints.class,
        }
    }

    fn send_all(&mut self, err: &DecisionError) {
        for w in self.waiters.drain(..) {
            let _ = w.tx.send(Err(err.clone()));
        }
    }
}

/// What a caller's departure left behind (see [`Requests::withdraw`]).
pub(super) enum Left {
    /// Other callers still wait, or the answer reached someone.
    Nothing,
    /// The last caller of a waiting or reserving request has gone.
    LastCaller(RequestKey),
    /// The answer of an answered request reached nobody after all.
    AnswerUnread(RequestKey),
}

/// What `Cancel` found (see [`Requests::cancel`]).
pub(super) enum Cancelled {
    Unknown,
    /// Its callers were told; it left the pool, or its reservation is abandoned.
    Withdrawn,
    /// Answered already: its reservation, if any, is the caller's to release.
    Answered(RequestKey),
}

/// The requests of one group. See the module docs.
pub(super) struct Requests {
    pool: Pool,
    reqs: FxHashMap<RequestKey, Req>,
    ids: FxHashMap<RequestId, RequestKey>,
    next_key: RequestKey,
    /// Answered requests by the time of their answer (entries of forgotten ones linger).
    answered: VecDeque<(Instant, RequestKey)>,
    answered_count: usize,
    pool_size: IntGauge,
}

impl Requests {
    pub(super) fn new(pool_size: IntGauge) -> Requests {
        Requests {
            pool: Pool::new(),
            reqs: FxHashMap::default(),
            ids: FxHashMap::default(),
            next_key: LOCAL_KEY_BASE,
            answered: VecDeque::new(),
            answered_count: 0,
            pool_size,
        }
    }

    /// Holds no request at all: none pooled, waiting, being reserved or answered.
    pub(super) fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    pub(super) fn get(&self, key: RequestKey) -> Option<&Req> {
        self.reqs.get(&key)
    }

    pub(super) fn contains(&self, key: RequestKey) -> bool {
        self.reqs.contains_key(&key)
    }

    pub(super) fn key_of(&self, id: &str) -> Option<RequestKey> {
        self.ids.get(id).copied()
    }

    pub(super) fn pool_len(&self) -> usize {
        self.pool.len()
    }

    pub(super) fn pool_is_empty(&self) -> bool {
        self.pool.is_empty()
    }

    /// Callers waiting, and requests being reserved.
    pub(super) fn callers_and_reserving(&self) -> (usize, usize) {
        self.reqs.values().fold((0, 0), |(calls, reserving), r| {
            let is = usize::from(matches!(r.state, State::Reserving { .. }));
            (calls + r.waiters.len(), reserving + is)
        })
    }

    pub(super) fn answered(&self) -> usize {
        self.answered_count
    }

    // ---------------------------------------------------------------- arrivals

    /// A call for an id already known: it joins the wait, or gets the answer at once. Gives
    /// `reply` back if the id is new.
    pub(super) fn join(&mut self, req: &ValidAssign, call: u64, reply: Reply) -> Option<Reply> {
        let Some(key) = self.key_of(req.request_id.as_str()) else {
            return Some(reply);
        };
        let Some(r) = self.reqs.get_mut(&key) else {
            let _ = reply.send(Err(DecisionError::ShuttingDown));
            return None;
        };
        if r.prompt_tokens != req.prompt_tokens {
            let _ = reply.send(Err(DecisionError::Conflict {
                request_id: req.request_id.to_string(),
                first: r.prompt_tokens,
                now: req.prompt_tokens,
            }));
            return None;
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
        None
    }

    /// Registers a new request under a fresh key, with its first caller.
    pub(super) fn insert(
        &mut self,
        req: ValidAssign,
        state: State,
        call: u64,
        reply: Reply,
        now: Instant,
    ) -> RequestKey {
        let key = self.next_key;
        self.next_key += 1;
        self.ids.insert(req.request_id.clone(), key);
        self.reqs.insert(
            key,
            Req {
                id: req.request_id,
                prompt_tokens: req.prompt_tokens,
                prompt_hash: req.prompt_hash,
                max_tokens: req.max_tokens,
                hints: Hints {
                    expected_output: req.expected_output_tokens,
                    class: req.request_class.as_ref().map(RequestClass::id),
                },
                arrived: now,
                state,
                waiters: vec![Waiter { call, tx: reply }],
                owner: None,
            },
        );
        key
    }

    /// Binds a request to the identity of the caller that brought it here, unless it is
    /// bound already (a retry by someone else does not take it over).
    pub(super) fn claim(&mut self, id: &str, owner: Arc<str>) {
        if let Some(r) = self.key_of(id).and_then(|k| self.reqs.get_mut(&k)) {
            r.owner.get_or_insert(owner);
        }
    }

    // ---------------------------------------------------------------- the pool

    /// Puts a request (back) in the `Waiting` state; returns what the pool or the router
    /// needs of it.
    pub(super) fn set_waiting(&mut self, key: RequestKey) -> Option<PoolEntry> {
        let r = self.reqs.get_mut(&key)?;
        r.state = State::Waiting;
        Some(r.entry(key))
    }

    /// Adds a waiting request to the pool; false if it was there already.
    pub(super) fn pool_push(&mut self, entry: PoolEntry) -> bool {
        // Refused only for a duplicate key.
        let pushed = self.pool.push(entry).is_ok();
        self.sync_gauge();
        pushed
    }

    /// The keys of the requests waiting in the pool.
    pub(super) fn pooled(&self) -> Vec<RequestKey> {
        self.pool_keys().collect()
    }

    /// The keys of the requests waiting in the pool, without collecting them.
    pub(super) fn pool_keys(&self) -> impl Iterator<Item = RequestKey> + '_ {
        self.pool.iter().map(|e| e.key)
    }

    /// A waiting request σ places already: it leaves the pool, `Reserving` at that placement,
    /// to be answered by the caller. False if it is not waiting.
    pub(super) fn place_waiting(&mut self, key: RequestKey, at: Placement) -> bool {
        let Some(r) = self.reqs.get_mut(&key) else {
            return false;
        };
        if !matches!(r.state, State::Waiting) {
            return false;
        }
        r.state = State::Reserving {
            at,
            abandoned: r.waiters.is_empty(),
            reroutes: 0,
        };
        if self.pool.remove(key).is_some() {
            self.sync_gauge();
        }
        true
    }

    /// For the policy's dispatch (call [`Requests::sync_gauge`] after).
    pub(super) fn pool_mut(&mut self) -> &mut Pool {
        &mut self.pool
    }

    pub(super) fn sync_gauge(&self) {
        self.pool_size.set(self.pool.len() as i64);
    }

    /// Admits a request to a worker: `Reserving` from now on (abandoned already if nobody
    /// waits for it any more).
    pub(super) fn admit(&mut self, key: RequestKey, at: Placement, reroutes: u32) -> Option<&Req> {
        let r = self.reqs.get_mut(&key)?;
        r.state = State::Reserving {
            at,
            abandoned: r.waiters.is_empty(),
            reroutes,
        };
        Some(r)
    }

    /// σ places the request elsewhere than decided: that placement is its answer. False if
    /// it is not being reserved.
    pub(super) fn replace(
        &mut self,
        key: RequestKey,
        worker: u32,
        incarnation: u64,
        sigma_version: u64,
    ) -> bool {
        match self.reqs.get_mut(&key).map(|r| &mut r.state) {
            Some(State::Reserving { at, .. }) => {
                at.worker = worker;
                at.incarnation = incarnation;
                at.sigma_version = sigma_version;
                true
            }
            _ => false,
        }
    }

    // ---------------------------------------------------------------- answers and departures

    /// Sends the answer of a request being reserved to its callers (unless it was abandoned)
    /// and keeps it for retries. If it reached nobody the request is forgotten and its id is
    /// returned: its reservation is to be released.
    pub(super) fn deliver(
        &mut self,
        key: RequestKey,
        resp: Assignment,
        now: Instant,
    ) -> Option<RequestId> {
        let r = self.reqs.get_mut(&key)?;
        let State::Reserving { abandoned, .. } = r.state else {
            return None;
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
            // Every caller left before the answer: the gateway will not send the request.
            let id = r.id.clone();
            self.forget(key);
            return Some(id);
        }
        r.state = State::Answered {
            resp,
            at: now,
            delivered,
        };
        self.answered_count += 1;
        self.answered.push_back((now, key));
        None
    }

    /// Tells every caller of a request that it failed and forgets it.
    pub(super) fn fail(&mut self, key: RequestKey, err: &DecisionError) {
        if let Some(r) = self.reqs.get_mut(&key) {
            r.send_all(err);
        }
        if self.pool.remove(key).is_some() {
            self.sync_gauge();
        }
        self.forget(key);
    }

    /// The caller `call` went away; `undelivered`: it had an answer it never read.
    pub(super) fn withdraw(&mut self, id: &str, call: u64, undelivered: bool) -> Left {
        let Some(key) = self.key_of(id) else {
            return Left::Nothing;
        };
        let Some(r) = self.reqs.get_mut(&key) else {
            return Left::Nothing;
        };
        r.waiters.retain(|w| w.call != call);
        match &mut r.state {
            State::Answered { delivered, .. } => {
                if undelivered {
                    *delivered = delivered.saturating_sub(1);
                    if *delivered == 0 {
                        // Nobody got the answer: the gateway will not send it.
                        return Left::AnswerUnread(key);
                    }
                }
                Left::Nothing
            }
            _ if r.waiters.is_empty() => Left::LastCaller(key),
            _ => Left::Nothing,
        }
    }

    /// Every caller of a waiting or reserving request has gone: a waiting one leaves the pool
    /// and is forgotten, a reserving one is released once its reservation is accepted.
    pub(super) fn abandon(&mut self, key: RequestKey) {
        let Some(r) = self.reqs.get_mut(&key) else {
            return;
        };
        match &mut r.state {
            State::Waiting => {
                self.pool.remove(key);
                self.sync_gauge();
                self.forget(key);
            }
            State::Reserving { abandoned, .. } => *abandoned = true,
            State::Answered { .. } => {}
        }
    }

    /// `Decision.Cancel` of a known id: its callers are told, and it is withdrawn (if not
    /// answered yet).
    pub(super) fn cancel(&mut self, key: RequestKey) -> Cancelled {
        let Some(r) = self.reqs.get_mut(&key) else {
            return Cancelled::Unknown;
        };
        match &mut r.state {
            State::Waiting => {
                r.send_all(&DecisionError::Cancelled);
                self.pool.remove(key);
                self.sync_gauge();
                self.forget(key);
                Cancelled::Withdrawn
            }
            State::Reserving { abandoned, .. } => {
                *abandoned = true;
                r.send_all(&DecisionError::Cancelled);
                Cancelled::Withdrawn
            }
            State::Answered { .. } => Cancelled::Answered(key),
        }
    }

    /// Forgets a request (not its pool entry: a waiting one leaves the pool first).
    pub(super) fn forget(&mut self, key: RequestKey) {
        if let Some(r) = self.reqs.remove(&key) {
            if matches!(r.state, State::Answered { .. }) {
                self.answered_count -= 1;
            }
            self.ids.remove(r.id.as_str());
        }
    }

    // ---------------------------------------------------------------- housekeeping

    /// Forgets answers older than `ttl`, and the oldest beyond `max`.
    pub(super) fn expire_answered(&mut self, now: Instant, ttl: Duration, max: usize) {
        while let Some(&(at, key)) = self.answered.front() {
            let expired = now.saturating_duration_since(at) >= ttl || self.answered_count > max;
            if !expired {
                break;
            }
            self.answered.pop_front();
            if answered_at(&self.reqs, key, at) {
                self.forget(key);
            }
        }
    }

    /// Drops the callers whose handler has gone, among the waiting requests and `others`;
    /// returns the requests left without any.
    pub(super) fn sweep_closed_callers(
        &mut self,
        others: impl Iterator<Item = RequestKey>,
    ) -> Vec<RequestKey> {
        let mut gone = Vec::new();
        for key in self.pool.iter().map(|e| e.key).chain(others) {
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
        gone
    }

    /// Entries of forgotten requests linger in the answered queue; compacts it when they
    /// dominate. Then the tables give back what a burst of requests made them hold.
    pub(super) fn compact_answered(&mut self) {
        if self.answered.len() > 2 * self.answered_count + 1024 {
            let reqs = &self.reqs;
            self.answered
                .retain(|&(at, key)| answered_at(reqs, key, at));
        }
        br_memory::shrink_sparse_map(&mut self.reqs);
        br_memory::shrink_sparse_map(&mut self.ids);
        br_memory::shrink_sparse_queue(&mut self.answered);
    }
}

/// Whether `key` is (still) the request answered at `at`.
fn answered_at(reqs: &FxHashMap<RequestKey, Req>, key: RequestKey, at: Instant) -> bool {
    reqs.get(&key)
        .is_some_and(|r| matches!(r.state, State::Answered { at: a, .. } if a == at))
}
