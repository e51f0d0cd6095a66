//! Telemetry into σ, and worker liveness.
//!
//! Owns what ingest's validated changes do to σ (Hello, WorkerDisconnected, RequestProgress,
//! WorkerSync), which Apply stream (ingest replica) carries each worker's current Hello, and
//! the worker's path out when its stream goes away:
//! - a reported disconnect (the shim's own stream ended) makes it SUSPECT at once;
//! - the end of its carrier's Apply stream (the ingest replica stopped, crashed or lost its
//!   link) leaves it LIVE, an orphan, for the carrier grace, so it stays routable on its last
//!   state while its shim reconnects; a Hello of it through any stream takes it over, else it
//!   becomes SUSPECT when the carrier grace ends;
//! - a SUSPECT worker is fenced when the worker grace ends.
//!
//! [`Presence::due`] carries out the timers once `now` passes them. A Hello of another
//! incarnation is refused (CONNECTED_ELSEWHERE) while the worker is LIVE through another open
//! Apply stream: one replica never evicts a worker another replica still carries. Every
//! function works inside the caller's σ batch, so the group commits what one call changed as
//! one version.

use std::collections::BTreeMap;
use std::time::Duration;

use br_core::{Phase, WorkerId};
use br_proto::v1;
use br_proto::valid::{RequestId, ValidRequestProgress, ValidTelemetryChange as V};
use br_sigma::{Adopted, Adoptions, Batch, Liveness, MAX_WORKER_ID, Sigma, change};
use rustc_hash::{FxHashMap, FxHashSet};
use tokio::time::Instant;

use super::{Reject, StreamId, current_worker};

/// Where and when one Apply batch arrived.
pub(super) struct Arrival<'a> {
    pub stream: StreamId,
    /// The sending ingest replica (ChangeBatch.ingest_id; may be empty).
    pub carrier: &'a str,
    pub now: Instant,
    /// Our wall clock, ms since the Unix epoch (ingest reports disconnects in its wall clock).
    pub wall_ms: u64,
    pub grace: Duration,
}

/// Which stream says each worker is connected, which workers lost their carrier, and when
/// each SUSPECT worker is fenced.
#[derive(Default)]
pub(super) struct Presence {
    /// Suspect workers: (incarnation, when to fence).
    fences: BTreeMap<WorkerId, (u64, Instant)>,
    /// LIVE workers whose carrier's Apply stream ended: (incarnation, when they become SUSPECT
    /// unless a Hello arrives first).
    orphans: BTreeMap<WorkerId, (u64, Instant)>,
    /// The open Apply stream that carried each worker's current Hello.
    hello_stream: FxHashMap<WorkerId, StreamId>,
    /// Counted since the group last took them ([`Presence::take_counts`]).
    counts: Counts,
}

/// What happened to carriers, for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Counts {
    /// LIVE workers whose carrier's Apply stream ended (kept routable for the carrier grace).
    pub orphaned: u64,
    /// Workers whose Hello arrived through another Apply stream than the one that carried them
    /// (their shim reconnected through another replica, or their replica's link came back).
    pub takeovers: u64,
    /// Orphans whose carrier grace ended without a Hello (then SUSPECT).
    pub orphans_expired: u64,
}

impl Presence {
    /// No worker's Hello is carried by a stream and no fence is pending.
    pub(super) fn is_empty(&self) -> bool {
        self.fences.is_empty() && self.hello_stream.is_empty()
    }

    /// Applies one validated change into `b`. `seen` holds the requests this batch already
    /// reported (a request named twice in one batch is a DUPLICATE); `ids` is the request-id
    /// rule's memory (see `br_sigma::unkeyed`).
    pub(super) fn apply(
        &mut self,
        b: &mut Batch<'_>,
        change: V,
        at: &Arrival<'_>,
        seen: &mut FxHashSet<RequestId>,
        ids: &mut IdRule<'_>,
    ) -> Result<(), Reject> {
        match change {
            V::WorkerHello {
                worker_id,
                incarnation,
                capacity,
                endpoint,
            } => self.hello(b, worker_id, incarnation, capacity, &endpoint, at),
            V::WorkerDisconnected {
                worker_id,
                incarnation,
                disconnected_at_unix_ms,
            } => self.disconnected(b, worker_id, incarnation, disconnected_at_unix_ms, at),
            V::RequestProgress {
                worker_id,
                incarnation,
                progress: p,
            } => progress(b, worker_id, incarnation, &p, seen, ids),
            V::WorkerSync {
                worker_id,
                incarnation,
                request_ids,
            } => sync(b, worker_id, incarnation, &request_ids),
        }
    }

    /// An Apply stream ended: every LIVE worker whose current Hello came on it keeps its state
    /// and stays routable until `orphan_until`, unless a Hello of it arrives first (its shim
    /// reconnected through any replica); a SUSPECT one keeps its fence.
    pub(super) fn stream_ended(&mut self, sigma: &Sigma, stream: StreamId, orphan_until: Instant) {
        let workers: Vec<WorkerId> = self
            .hello_stream
            .iter()
            .filter(|(_, s)| **s == stream)
            .map(|(w, _)| *w)
            .collect();
        for w in workers {
            self.hello_stream.remove(&w);
            let Some(x) = sigma.worker(w) else {
                continue;
            };
            if x.liveness == Liveness::Live {
                self.orphans.insert(w, (x.incarnation, orphan_until));
                self.counts.orphaned += 1;
            }
        }
    }

    /// What time does, due by `now`: orphans whose carrier grace ended become SUSPECT (fenced
    /// at `now + grace`), then SUSPECT workers whose grace ended are fenced. Returns how many
    /// were fenced.
    pub(super) fn due(&mut self, b: &mut Batch<'_>, now: Instant, grace: Duration) -> u64 {
        let lost: Vec<(WorkerId, u64)> = self
            .orphans
            .iter()
            .filter(|(_, (_, at))| *at <= now)
            .map(|(w, (inc, _))| (*w, *inc))
            .collect();
        for (w, inc) in lost {
            self.orphans.remove(&w);
            // Still the orphaned incarnation, and no stream took it over meanwhile.
            if !self.hello_stream.contains_key(&w) && b.sigma().incarnation(w) == Some(inc) {
                self.counts.orphans_expired += 1;
                tracing::info!(group = %b.sigma().group(), worker = w, incarnation = inc,
                    "no Hello within the carrier grace after its ingest went away; worker SUSPECT");
                self.suspect(b, w, inc, now + grace);
            }
        }
        self.fence_due(b, now)
    }

    /// The counts since the last call.
    pub(super) fn take_counts(&mut self) -> Counts {
        std::mem::take(&mut self.counts)
    }

    /// Fences the workers whose grace period ended by `now` and who are still the SUSPECT
    /// incarnation it was scheduled for; returns how many.
    fn fence_due(&mut self, b: &mut Batch<'_>, now: Instant) -> u64 {
        let due: Vec<(WorkerId, u64)> = self
            .fences
            .iter()
            .filter(|(_, (_, at))| *at <= now)
            .map(|(w, (inc, _))| (*w, *inc))
            .collect();
        let mut fenced = 0;
        for (w, inc) in due {
            self.fences.remove(&w);
            let suspect = b
                .sigma()
                .worker(w)
                .is_some_and(|x| x.incarnation == inc && x.liveness == Liveness::Suspect);
            if suspect && b.apply(change::worker_fenced(w, inc)).is_ok() {
                fenced += 1;
                tracing::info!(group = %b.sigma().group(), worker = w, incarnation = inc, "worker fenced after the grace period");
            }
        }
        fenced
    }

    fn hello(
        &mut self,
        b: &mut Batch<'_>,
        worker_id: WorkerId,
        incarnation: u64,
        capacity: u32,
        endpoint: &str,
        at: &Arrival<'_>,
    ) -> Result<(), Reject> {
        if worker_id > MAX_WORKER_ID {
            // The wire allows larger ranks; the routing core sizes arrays by id.
            return Err(Reject::invalid(format!(
                "worker_id {worker_id} is above {MAX_WORKER_ID}"
            )));
        }
        let carried_by = self.hello_stream.get(&worker_id).copied();
        if let Some(w) = b.sigma().worker(worker_id)
            && w.incarnation != incarnation
            && w.liveness == Liveness::Live
            && carried_by.is_some_and(|s| s != at.stream)
        {
            // Another incarnation while a live stream through another replica carries this
            // worker: two shims with one --worker-id, or a restart whose old stream is not
            // proven dead yet. The live one stays; this Hello is taken once that stream's
            // disconnect is reported or its Apply stream ends. (On one stream ingest itself
            // keeps one live stream per worker, so a new incarnation there is a restart.)
            return Err(Reject::new(
                v1::RejectReason::ConnectedElsewhere,
                format!(
                    "worker {worker_id} is LIVE as incarnation {} through ingest {:?}; incarnation {incarnation} is refused while that stream lives",
                    w.incarnation, w.carrier
                ),
            ));
        }
        // A Hello of the same incarnation brings a suspect (or fenced: it holds nothing any
        // more) worker back, or moves it to this carrier; another incarnation replaces the
        // entry and starts clean.
        b.apply(change::worker_up_via(
            worker_id,
            incarnation,
            capacity,
            endpoint,
            at.carrier,
        ))?;
        let orphaned = self.orphans.remove(&worker_id).is_some();
        if orphaned || carried_by.is_some_and(|s| s != at.stream) {
            self.counts.takeovers += 1;
            tracing::info!(group = %b.sigma().group(), worker = worker_id, incarnation,
                carrier = at.carrier, "worker taken over by another ingest stream");
        }
        self.fences.remove(&worker_id);
        self.hello_stream.insert(worker_id, at.stream);
        Ok(())
    }

    fn disconnected(
        &mut self,
        b: &mut Batch<'_>,
        worker_id: WorkerId,
        incarnation: u64,
        reported_ms: u64,
        at: &Arrival<'_>,
    ) -> Result<(), Reject> {
        current_worker(b, worker_id, incarnation)?;
        if self.hello_stream.get(&worker_id) != Some(&at.stream) {
            // The worker's current Hello came through another stream (it reconnected
            // elsewhere before this report arrived), or this stream already reported it:
            // nothing to do.
            return Ok(());
        }
        self.hello_stream.remove(&worker_id);
        // The grace period runs from when ingest saw the stream end (its clock, trusted only
        // within [0, grace]; 0 = unknown).
        let elapsed = if reported_ms == 0 || reported_ms > at.wall_ms {
            Duration::ZERO
        } else {
            Duration::from_millis(at.wall_ms - reported_ms).min(at.grace)
        };
        self.suspect(b, worker_id, incarnation, at.now + (at.grace - elapsed));
        Ok(())
    }

    /// Marks a live worker SUSPECT and schedules its fence (keeping an earlier one).
    fn suspect(&mut self, b: &mut Batch<'_>, w: WorkerId, inc: u64, fence_at: Instant) {
        match b.sigma().liveness(w) {
            Some(Liveness::Live) => {
                if b.apply(change::worker_suspect(w, inc)).is_ok() {
                    self.fences.insert(w, (inc, fence_at));
                }
            }
            Some(Liveness::Suspect) => {
                let e = self.fences.entry(w).or_insert((inc, fence_at));
                if e.0 == inc {
                    e.1 = e.1.min(fence_at);
                } else {
                    *e = (inc, fence_at);
                }
            }
            Some(Liveness::Fenced) | None => {}
        }
    }
}

/// The request-id rule's memory and what it did in one batch (for the metrics).
pub(super) struct IdRule<'a> {
    pub adoptions: &'a mut Adoptions,
    pub counts: UnkeyedCounts,
}

/// Outcomes of the request-id rule (`balanceroute_snapshot_unkeyed_requests_total`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct UnkeyedCounts {
    pub matched: u64,
    pub unmatched: u64,
    pub handed_on: u64,
}

fn progress(
    b: &mut Batch<'_>,
    worker_id: WorkerId,
    incarnation: u64,
    p: &ValidRequestProgress,
    seen: &mut FxHashSet<RequestId>,
    ids: &mut IdRule<'_>,
) -> Result<(), Reject> {
    if current_worker(b, worker_id, incarnation)? == Liveness::Fenced {
        return Err(Reject::new(
            v1::RejectReason::WorkerFenced,
            format!("worker {worker_id} is fenced"),
        ));
    }
    let id = p.request_id.as_str();
    let held = |b: &Batch<'_>| {
        b.sigma()
            .request(id)
            .map(|r| (r.worker, r.prompt_tokens, r.generated_tokens))
    };
    // One lookup for the common report (a request σ holds); the rule below may change σ.
    let mut held_now = held(b);
    // The stream's identity is the worker's: ingest forwards a worker's report only under the
    // worker id its stream said Hello as (and mutual TLS admitted). So a report of a request
    // σ holds under another worker is that worker's request named by someone else (a peer
    // that lies, or an ingest replica that forwards what its streams were not entitled to),
    // or a request the gateway sent to another rank than the one it was reserved on. Either
    // way it stays where it is: a reservation belongs to the worker it was reserved on until
    // it is released or expires, and a running request to the worker that reported it first
    // (docs/design/0013-request-ownership.md). Checked here, where every Apply batch comes
    // in, so no path into σ skips it.
    if let Some((owner, _, _)) = held_now
        && owner != worker_id
    {
        return Err(Reject::new(
            v1::RejectReason::NotOwner,
            format!("request {id:?} belongs to worker {owner}, not to worker {worker_id}"),
        ));
    }
    // Only changes that pass count: a rejected one does not make a later one a duplicate.
    if !seen.insert(p.request_id.clone()) {
        return Err(Reject::new(
            v1::RejectReason::Duplicate,
            format!("request {id:?} appears twice in the batch"),
        ));
    }
    // The request-id rule (br_sigma::unkeyed): the first report of a request σ does not
    // hold takes over a reservation if it came without the gateway's id, or hands a taken
    // reservation's place on if it is one; a finished one only leaves.
    let mut adopted_prompt = None;
    if held_now.is_none() && !p.finished {
        if p.unkeyed {
            match ids.adoptions.adopt(b, id, worker_id, incarnation)? {
                Adopted::Matched(r) => {
                    ids.counts.matched += 1;
                    adopted_prompt = Some(r.prompt_tokens);
                }
                Adopted::Unmatched => ids.counts.unmatched += 1,
            }
        } else if ids.adoptions.taken_on(id) == Some(worker_id)
            && ids.adoptions.named(b, id)?.is_some()
        {
            // (only on the worker whose reservation was taken: another worker naming it would
            // release one of that worker's reservations)
            ids.counts.handed_on += 1;
        }
        held_now = held(b);
    }
    let held = held_now.map(|(_, prompt, generated)| (prompt, generated));
    if p.finished {
        if let Some((_, generated)) = held {
            b.apply(change::request_finished(
                id,
                generated.max(p.generated_tokens),
            ))?;
        }
        return Ok(());
    }
    let (prompt, generated) = match held {
        Some((prompt, generated)) => (
            if p.prompt_tokens == 0 {
                prompt
            } else {
                p.prompt_tokens
            },
            generated.max(p.generated_tokens),
        ),
        // (a SUSPECT worker's adoption releases the reservation without reserving: its prompt
        // stands in while the engine has not said)
        None if p.prompt_tokens == 0 => (adopted_prompt.unwrap_or(0), p.generated_tokens),
        None => (p.prompt_tokens, p.generated_tokens),
    };
    b.apply(change::request_progress(
        id,
        worker_id,
        incarnation,
        prompt,
        generated,
    ))?;
    Ok(())
}

fn sync(
    b: &mut Batch<'_>,
    worker_id: WorkerId,
    incarnation: u64,
    request_ids: &[RequestId],
) -> Result<(), Reject> {
    if current_worker(b, worker_id, incarnation)? == Liveness::Fenced {
        return Ok(()); // it holds nothing in σ
    }
    let listed: FxHashSet<&str> = request_ids.iter().map(RequestId::as_str).collect();
    let gone: Vec<(String, u32)> = b
        .sigma()
        .cluster()
        .requests_of(worker_id)
        .filter(|info| info.phase == Phase::Running)
        .filter_map(|info| b.sigma().id_of(info.key).map(|id| (id, info.generated)))
        .filter(|(id, _)| !listed.contains(id))
        .map(|(id, g)| (id.to_owned(), g))
        .collect();
    for (id, generated) in gone {
        b.apply(change::request_finished(&id, generated))?;
    }
    Ok(())
}
