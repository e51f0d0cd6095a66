//! The state machine of one group, without network or tasks: σ (a [`Sigma`]), its bounded
//! delta history, reservation deadlines, grace-period fences, which Apply stream said each
//! worker's Hello, and the group's watchers (bounded queues, never waited on).
//!
//! Every operation takes `now` (and wall-clock milliseconds where ingest's clock is involved),
//! so the writer task drives it with real time and the unit tests with made-up instants. Each
//! operation that changes σ commits exactly one new version and publishes its delta.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use br_core::{Phase, RequestKey, WorkerId};
use br_proto::v1;
use br_proto::valid::{
    RequestId, ValidRequestProgress, ValidReservation, ValidTelemetryChange,
    ValidTelemetryChange as V,
};
use br_sigma::{Delta, Liveness, MAX_WORKER_ID, Sigma, SigmaError, change};
use rustc_hash::{FxHashMap, FxHashSet};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tokio::time::Instant;

use crate::metrics::{GroupMetrics, Metrics};

/// Identifies one Apply stream (per process).
pub type StreamId = u64;

/// What one watcher's queue carries (shared between watchers: one allocation per event).
pub type Event = Arc<v1::WatchEvent>;

/// A merged catch-up delta holds at most this many changes (then another one starts), so a
/// resuming watcher gets a few bounded messages rather than thousands of small ones.
pub const MERGE_MAX_CHANGES: usize = 4096;

/// The tunables of a group (from the flags).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Deltas kept for resumption.
    pub history: usize,
    /// A RESERVED request without telemetry for this long expires.
    pub reservation_ttl: Duration,
    /// A SUSPECT worker without a Hello for this long is fenced.
    pub worker_grace: Duration,
    /// A progress mark is sent after this long without a delta.
    pub progress_interval: Duration,
    /// Events queued per watcher before it counts as slow.
    pub watcher_queue: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            history: crate::config::DEFAULT_HISTORY,
            reservation_ttl: Duration::from_secs(10),
            worker_grace: Duration::from_secs(5),
            progress_interval: Duration::from_millis(250),
            watcher_queue: crate::config::DEFAULT_WATCHER_QUEUE,
        }
    }
}

/// Why a change or reservation was not applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    pub reason: v1::RejectReason,
    pub detail: String,
}

impl Reject {
    fn new(reason: v1::RejectReason, detail: impl Into<String>) -> Reject {
        Reject {
            reason,
            detail: detail.into(),
        }
    }

    fn invalid(detail: impl Into<String>) -> Reject {
        Reject::new(v1::RejectReason::Invalid, detail)
    }

    /// The `reason` label of the rejection counter.
    pub fn label(&self) -> &'static str {
        self.reason.label()
    }
}

impl From<SigmaError> for Reject {
    fn from(e: SigmaError) -> Reject {
        use v1::RejectReason as R;
        let reason = match &e {
            SigmaError::UnknownWorker(_) => R::UnknownWorker,
            SigmaError::StaleIncarnation { .. } => R::StaleIncarnation,
            SigmaError::WorkerFenced(_) | SigmaError::WorkerSuspect(_) => R::WorkerFenced,
            SigmaError::DuplicateRequest(_) => R::Duplicate,
            SigmaError::UnknownRequest(_) | SigmaError::NotReserved(_) => R::UnknownRequest,
            _ => R::Invalid,
        };
        Reject::new(reason, e.to_string())
    }
}

struct WatcherSlot {
    tx: mpsc::Sender<Event>,
    /// Its queue overflowed: deltas are dropped for it until it has room for a reset and a
    /// snapshot.
    lagging: bool,
}

/// Everything but σ, so a [`br_sigma::Batch`] (which borrows σ) and this can be
/// borrowed at once.
#[derive(Default)]
struct Side {
    /// (deadline, key) in reservation order; the TTL is constant, so deadlines are sorted.
    /// Entries whose request left σ (or became active) are skipped when they come due.
    reservations: VecDeque<(Instant, RequestKey)>,
    /// Suspect workers: (incarnation, when to fence).
    fences: BTreeMap<WorkerId, (u64, Instant)>,
    /// The Apply stream that carried each worker's current Hello.
    hello_stream: FxHashMap<WorkerId, StreamId>,
}

/// One group: σ plus what the writer needs around it.
pub struct Group {
    sigma: Sigma,
    settings: Arc<Settings>,
    side: Side,
    history: VecDeque<Event>,
    snapshot: Option<Event>,
    watchers: Vec<WatcherSlot>,
    last_sent: Instant,
    metrics: GroupMetrics,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("group", &self.sigma.group())
            .field("epoch", &self.sigma.epoch())
            .field("version", &self.sigma.version())
            .field("watchers", &self.watchers.len())
            .finish_non_exhaustive()
    }
}

impl Group {
    pub fn new(
        name: &str,
        epoch: u64,
        settings: Arc<Settings>,
        metrics: &Metrics,
        now: Instant,
    ) -> Group {
        let mut g = Group {
            sigma: Sigma::with_epoch(name, epoch),
            settings,
            side: Side::default(),
            history: VecDeque::new(),
            snapshot: None,
            watchers: Vec::new(),
            last_sent: now,
            metrics: metrics.group(name),
        };
        g.observe();
        g
    }

    pub fn sigma(&self) -> &Sigma {
        &self.sigma
    }

    pub fn epoch(&self) -> u64 {
        self.sigma.epoch()
    }

    pub fn version(&self) -> u64 {
        self.sigma.version()
    }

    pub fn watcher_count(&self) -> usize {
        self.watchers.len()
    }

    /// The current σ.
    pub fn snapshot(&self) -> v1::ClusterSnapshot {
        self.sigma.to_snapshot()
    }

    // ---- Apply ----

    /// Applies one batch of telemetry changes from Apply stream `stream` as one version (or
    /// none if nothing changed). Rejected changes are listed by index (and counted); the rest
    /// apply in order.
    pub fn apply(
        &mut self,
        batch_seq: u64,
        changes: Vec<v1::TelemetryChange>,
        stream: StreamId,
        now: Instant,
        wall_ms: u64,
    ) -> v1::ApplyAck {
        let mut rejected = Vec::new();
        let mut seen: FxHashSet<RequestId> = FxHashSet::default();
        let settings = Arc::clone(&self.settings);
        let mut b = self.sigma.batch();
        let side = &mut self.side;
        for (index, c) in changes.into_iter().enumerate() {
            let res = match ValidTelemetryChange::try_from(c) {
                Err(e) => Err(Reject::invalid(e.to_string())),
                Ok(V::WorkerHello {
                    worker_id,
                    incarnation,
                    capacity,
                    endpoint,
                }) => hello(
                    &mut b,
                    side,
                    worker_id,
                    incarnation,
                    capacity,
                    &endpoint,
                    stream,
                ),
                Ok(V::WorkerDisconnected {
                    worker_id,
                    incarnation,
                    disconnected_at_unix_ms,
                }) => {
                    let at = Disconnect {
                        stream,
                        now,
                        wall_ms,
                        reported_ms: disconnected_at_unix_ms,
                        grace: settings.worker_grace,
                    };
                    disconnected(&mut b, side, worker_id, incarnation, &at)
                }
                Ok(V::RequestProgress {
                    worker_id,
                    incarnation,
                    progress: p,
                }) => progress(&mut b, worker_id, incarnation, &p, &mut seen),
                Ok(V::WorkerSync {
                    worker_id,
                    incarnation,
                    request_ids,
                }) => sync(&mut b, worker_id, incarnation, &request_ids),
            };
            if let Err(r) = res {
                self.metrics.family().reject(r.label());
                rejected.push(v1::ChangeRejection {
                    index: u32::try_from(index).unwrap_or(u32::MAX),
                    reason: r.reason as i32,
                    detail: r.detail,
                });
            }
        }
        if let Some(d) = b.commit() {
            self.publish(d, now);
        }
        v1::ApplyAck {
            batch_seq,
            epoch: self.sigma.epoch(),
            version: self.sigma.version(),
            rejected,
        }
    }

    /// An Apply stream ended: every worker whose current Hello came on it is disconnected now.
    pub fn stream_ended(&mut self, stream: StreamId, now: Instant) {
        let workers: Vec<WorkerId> = self
            .side
            .hello_stream
            .iter()
            .filter(|(_, s)| **s == stream)
            .map(|(w, _)| *w)
            .collect();
        if workers.is_empty() {
            return;
        }
        let grace = self.settings.worker_grace;
        let mut b = self.sigma.batch();
        for w in workers {
            self.side.hello_stream.remove(&w);
            let Some(inc) = b.sigma().incarnation(w) else {
                continue;
            };
            suspect(&mut b, &mut self.side, w, inc, now + grace);
        }
        if let Some(d) = b.commit() {
            self.publish(d, now);
        }
    }

    // ---- Reserve / Release ----

    /// Commits reservations (validated by br-proto) as one version; each accepted or rejected
    /// on its own. Returns the accepted ids and the rejections.
    pub fn reserve(
        &mut self,
        reservations: Vec<ValidReservation>,
        now: Instant,
    ) -> (Vec<String>, Vec<v1::ReservationRejection>) {
        let mut accepted = Vec::new();
        let mut rejected = Vec::new();
        let deadline = now + self.settings.reservation_ttl;
        let mut b = self.sigma.batch();
        for r in reservations {
            match reserve_one(&mut b, &r) {
                Ok(new) => {
                    if new && let Some(key) = b.sigma().key_of(r.request_id.as_str()) {
                        self.side.reservations.push_back((deadline, key));
                    }
                    accepted.push(r.request_id.to_string());
                }
                Err(rej) => {
                    self.metrics.family().reject(rej.label());
                    rejected.push(v1::ReservationRejection {
                        request_id: r.request_id.to_string(),
                        reason: rej.reason as i32,
                        detail: rej.detail,
                    });
                }
            }
        }
        if let Some(d) = b.commit() {
            self.publish(d, now);
        }
        (accepted, rejected)
    }

    /// Releases RESERVED requests (others are ignored) as one version; returns how many.
    pub fn release(&mut self, ids: &[RequestId], now: Instant) -> u32 {
        let mut released = 0;
        let mut b = self.sigma.batch();
        for id in ids {
            let reserved = b
                .sigma()
                .request(id.as_str())
                .is_some_and(|r| r.phase == Phase::Queued);
            if reserved && b.apply(change::request_released(id.as_str())).is_ok() {
                released += 1;
            }
        }
        if let Some(d) = b.commit() {
            self.publish(d, now);
        }
        released
    }

    // ---- time ----

    /// Expires reservations and fences workers that are due (one version for both), then
    /// serves watchers: drops closed ones, resets lagging ones that have room again, and sends
    /// progress marks when the group has been idle for the progress interval.
    pub fn tick(&mut self, now: Instant) {
        let mut b = self.sigma.batch();
        let mut expired = 0;
        while let Some(&(deadline, key)) = self.side.reservations.front() {
            if deadline > now {
                break;
            }
            self.side.reservations.pop_front();
            let due = b.sigma().id_of(key).and_then(|id| {
                let r = b.sigma().request(id)?;
                (r.phase == Phase::Queued).then(|| id.to_owned())
            });
            if let Some(id) = due
                && b.apply(change::request_expired(&id)).is_ok()
            {
                expired += 1;
            }
        }
        let due: Vec<(WorkerId, u64)> = self
            .side
            .fences
            .iter()
            .filter(|(_, (_, at))| *at <= now)
            .map(|(w, (inc, _))| (*w, *inc))
            .collect();
        let mut fenced = 0;
        for (w, inc) in due {
            self.side.fences.remove(&w);
            let suspect = b
                .sigma()
                .worker(w)
                .is_some_and(|x| x.incarnation == inc && x.liveness == Liveness::Suspect);
            if suspect && b.apply(change::worker_fenced(w, inc)).is_ok() {
                fenced += 1;
                tracing::info!(group = %b.sigma().group(), worker = w, incarnation = inc, "worker fenced after the grace period");
            }
        }
        if let Some(d) = b.commit() {
            self.publish(d, now);
        }
        self.metrics.expired.inc_by(expired);
        self.metrics.fenced.inc_by(fenced);

        self.serve_lagging();
        if now.saturating_duration_since(self.last_sent) >= self.settings.progress_interval {
            let mark = Arc::new(v1::WatchEvent {
                kind: Some(v1::watch_event::Kind::Progress(
                    v1::watch_event::ProgressMark {
                        epoch: self.sigma.epoch(),
                        version: self.sigma.version(),
                    },
                )),
            });
            self.broadcast(&mark);
            self.last_sent = now;
        }
        self.watchers.retain(|w| !w.tx.is_closed());
        self.metrics.watchers.set(self.watchers.len() as i64);
    }

    // ---- watchers ----

    /// Ends every watcher's stream (shutdown).
    pub fn drop_watchers(&mut self) {
        self.watchers.clear();
        self.metrics.watchers.set(0);
    }

    /// Registers a watcher holding (epoch, last_version) and returns its queue, already
    /// holding what brings it up to date (see `Snapshot.Watch`).
    pub fn subscribe(&mut self, epoch: u64, last_version: u64) -> mpsc::Receiver<Event> {
        use v1::ResetReason as R;
        let current = self.sigma.version();
        let mut initial: Vec<Event> = Vec::new();
        let reset = if epoch == 0 {
            None
        } else if epoch != self.sigma.epoch() {
            Some(R::UnknownEpoch)
        } else if last_version > current {
            Some(R::FutureVersion)
        } else if last_version == current {
            None
        } else {
            match self.catch_up(last_version) {
                Some(deltas) => {
                    initial = deltas;
                    None
                }
                None => Some(R::HistoryTruncated),
            }
        };
        if let Some(reason) = reset {
            initial.push(self.reset_event(reason, format!("watcher held {epoch}@{last_version}")));
        }
        if epoch == 0 || reset.is_some() {
            initial.push(self.snapshot_event());
        }
        let (tx, rx) = mpsc::channel(self.settings.watcher_queue.max(2) + initial.len());
        for ev in initial {
            // Cannot fail: the channel was sized for it and nobody reads yet.
            let _ = tx.try_send(ev);
        }
        self.watchers.push(WatcherSlot { tx, lagging: false });
        self.metrics.watchers.set(self.watchers.len() as i64);
        rx
    }

    /// The held deltas after `last_version`, merged into few events; None if not all held.
    fn catch_up(&self, last_version: u64) -> Option<Vec<Event>> {
        let first = delta_of(self.history.front()?)?.prev_version;
        if last_version < first {
            return None;
        }
        let skip = usize::try_from(last_version - first).ok()?;
        let mut out = Vec::new();
        let mut chunk: Vec<&Event> = Vec::new();
        let mut count = 0;
        for ev in self.history.iter().skip(skip) {
            let n = delta_of(ev).map_or(0, |d| d.changes.len());
            if !chunk.is_empty() && count + n > MERGE_MAX_CHANGES {
                out.push(merge(&chunk));
                chunk.clear();
                count = 0;
            }
            chunk.push(ev);
            count += n;
        }
        if !chunk.is_empty() {
            out.push(merge(&chunk));
        }
        Some(out)
    }

    fn snapshot_event(&mut self) -> Event {
        if let Some(s) = &self.snapshot {
            return Arc::clone(s);
        }
        let ev = Arc::new(v1::WatchEvent {
            kind: Some(v1::watch_event::Kind::Snapshot(self.sigma.to_snapshot())),
        });
        self.snapshot = Some(Arc::clone(&ev));
        ev
    }

    fn reset_event(&self, reason: v1::ResetReason, detail: String) -> Event {
        self.metrics.reset(reason);
        tracing::debug!(group = %self.sigma.group(), ?reason, detail, "watcher reset");
        Arc::new(v1::WatchEvent {
            kind: Some(v1::watch_event::Kind::Reset(v1::watch_event::Reset {
                reason: reason as i32,
                epoch: self.sigma.epoch(),
                detail,
            })),
        })
    }

    /// Records a committed delta and sends it to every watcher that keeps up.
    fn publish(&mut self, d: Delta, now: Instant) {
        let ev = Arc::new(v1::WatchEvent {
            kind: Some(v1::watch_event::Kind::Delta(d)),
        });
        self.snapshot = None;
        if self.settings.history > 0 {
            if self.history.len() >= self.settings.history {
                self.history.pop_front();
            }
            self.history.push_back(Arc::clone(&ev));
        }
        // Lagging watchers skip this delta; then those with room get a snapshot that already
        // contains it (in the other order they would get the snapshot and then this delta).
        self.broadcast(&ev);
        self.serve_lagging();
        self.last_sent = now;
        self.metrics.batches.inc();
        self.observe();
    }

    /// Sends `ev` to every watcher that is not lagging; one whose queue is full starts
    /// lagging (it is never waited for), a closed one is dropped.
    fn broadcast(&mut self, ev: &Event) {
        self.watchers.retain_mut(|w| {
            if w.lagging {
                return !w.tx.is_closed();
            }
            match w.tx.try_send(Arc::clone(ev)) {
                Ok(()) => true,
                Err(TrySendError::Full(_)) => {
                    w.lagging = true;
                    true
                }
                Err(TrySendError::Closed(_)) => false,
            }
        });
        self.metrics.watchers.set(self.watchers.len() as i64);
    }

    /// A lagging watcher with room for two events gets a SLOW_CONSUMER reset and a fresh
    /// snapshot, and follows deltas again.
    fn serve_lagging(&mut self) {
        if !self
            .watchers
            .iter()
            .any(|w| w.lagging && w.tx.capacity() >= 2)
        {
            return;
        }
        let snap = self.snapshot_event();
        let mut resets = 0;
        for w in &mut self.watchers {
            if w.lagging && w.tx.capacity() >= 2 {
                resets += 1;
                w.lagging = false;
                let reset = Arc::new(v1::WatchEvent {
                    kind: Some(v1::watch_event::Kind::Reset(v1::watch_event::Reset {
                        reason: v1::ResetReason::SlowConsumer as i32,
                        epoch: self.sigma.epoch(),
                        detail: "the watcher's queue overflowed; deltas were dropped".into(),
                    })),
                });
                let _ = w.tx.try_send(reset);
                let _ = w.tx.try_send(Arc::clone(&snap));
            }
        }
        for _ in 0..resets {
            self.metrics.reset(v1::ResetReason::SlowConsumer);
        }
    }

    fn observe(&mut self) {
        let (mut reserved, mut active) = (0, 0);
        for w in self.sigma.cluster().workers() {
            reserved += w.queued as usize;
            active += w.running as usize;
        }
        self.metrics
            .observe(self.sigma.version(), self.sigma.cluster(), reserved, active);
    }
}

fn delta_of(ev: &Event) -> Option<&Delta> {
    match &ev.kind {
        Some(v1::watch_event::Kind::Delta(d)) => Some(d),
        _ => None,
    }
}

/// One delta from consecutive ones (the first's prev_version to the last's version).
fn merge(chunk: &[&Event]) -> Event {
    if let [one] = chunk {
        return Arc::clone(one);
    }
    let ds: Vec<&Delta> = chunk.iter().filter_map(|e| delta_of(e)).collect();
    let (Some(first), Some(last)) = (ds.first(), ds.last()) else {
        return Arc::clone(chunk[0]);
    };
    Arc::new(v1::WatchEvent {
        kind: Some(v1::watch_event::Kind::Delta(Delta {
            epoch: first.epoch,
            prev_version: first.prev_version,
            version: last.version,
            changes: ds.iter().flat_map(|d| d.changes.iter().cloned()).collect(),
        })),
    })
}

// ---- telemetry changes (free functions: they borrow the batch and the side state) ----

type Batch<'a> = br_sigma::Batch<'a>;

/// The worker as σ holds it, if it is this incarnation.
fn current_worker(b: &Batch<'_>, id: WorkerId, inc: u64) -> Result<Liveness, Reject> {
    let w = b.sigma().worker(id).ok_or_else(|| {
        Reject::new(
            v1::RejectReason::UnknownWorker,
            format!("worker {id} is not in σ"),
        )
    })?;
    if w.incarnation != inc {
        return Err(Reject::new(
            v1::RejectReason::StaleIncarnation,
            format!("worker {id} is incarnation {}, not {inc}", w.incarnation),
        ));
    }
    Ok(w.liveness)
}

fn hello(
    b: &mut Batch<'_>,
    side: &mut Side,
    worker_id: WorkerId,
    incarnation: u64,
    capacity: u32,
    endpoint: &str,
    stream: StreamId,
) -> Result<(), Reject> {
    if worker_id > MAX_WORKER_ID {
        // The wire allows larger ranks; the routing core sizes arrays by id.
        return Err(Reject::invalid(format!(
            "worker_id {worker_id} is above {MAX_WORKER_ID}"
        )));
    }
    // A Hello of the same incarnation brings a suspect (or fenced: it holds nothing any more)
    // worker back; another incarnation replaces the entry and starts clean.
    b.apply(change::worker_up(
        worker_id,
        incarnation,
        capacity,
        endpoint,
    ))?;
    side.fences.remove(&worker_id);
    side.hello_stream.insert(worker_id, stream);
    Ok(())
}

/// Where and when a WorkerDisconnected arrived.
struct Disconnect {
    stream: StreamId,
    now: Instant,
    /// Our wall clock, ms since the Unix epoch.
    wall_ms: u64,
    /// When ingest saw the stream end (its clock); 0 = unknown.
    reported_ms: u64,
    grace: Duration,
}

fn disconnected(
    b: &mut Batch<'_>,
    side: &mut Side,
    worker_id: WorkerId,
    incarnation: u64,
    at: &Disconnect,
) -> Result<(), Reject> {
    current_worker(b, worker_id, incarnation)?;
    if side.hello_stream.get(&worker_id) != Some(&at.stream) {
        // The worker's current Hello came through another stream (it reconnected elsewhere
        // before this report arrived), or this stream already reported it: nothing to do.
        return Ok(());
    }
    side.hello_stream.remove(&worker_id);
    // The grace period runs from when ingest saw the stream end (its clock, trusted only
    // within [0, grace]).
    let elapsed = if at.reported_ms == 0 || at.reported_ms > at.wall_ms {
        Duration::ZERO
    } else {
        Duration::from_millis(at.wall_ms - at.reported_ms).min(at.grace)
    };
    suspect(
        b,
        side,
        worker_id,
        incarnation,
        at.now + (at.grace - elapsed),
    );
    Ok(())
}

/// Marks a live worker SUSPECT and schedules its fence (keeping an earlier one).
fn suspect(b: &mut Batch<'_>, side: &mut Side, w: WorkerId, inc: u64, fence_at: Instant) {
    match b.sigma().liveness(w) {
        Some(Liveness::Live) => {
            if b.apply(change::worker_suspect(w, inc)).is_ok() {
                side.fences.insert(w, (inc, fence_at));
            }
        }
        Some(Liveness::Suspect) => {
            let e = side.fences.entry(w).or_insert((inc, fence_at));
            if e.0 == inc {
                e.1 = e.1.min(fence_at);
            } else {
                *e = (inc, fence_at);
            }
        }
        Some(Liveness::Fenced) | None => {}
    }
}

fn progress(
    b: &mut Batch<'_>,
    worker_id: WorkerId,
    incarnation: u64,
    p: &ValidRequestProgress,
    seen: &mut FxHashSet<RequestId>,
) -> Result<(), Reject> {
    if current_worker(b, worker_id, incarnation)? == Liveness::Fenced {
        return Err(Reject::new(
            v1::RejectReason::WorkerFenced,
            format!("worker {worker_id} is fenced"),
        ));
    }
    let id = p.request_id.as_str();
    // Only changes that pass count: a rejected one does not make a later one a duplicate.
    if !seen.insert(p.request_id.clone()) {
        return Err(Reject::new(
            v1::RejectReason::Duplicate,
            format!("request {id:?} appears twice in the batch"),
        ));
    }
    let held = b
        .sigma()
        .request(id)
        .map(|r| (r.prompt_tokens, r.generated_tokens));
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

/// One reservation: Ok(true) if it entered σ, Ok(false) for an idempotent repeat.
fn reserve_one(b: &mut Batch<'_>, r: &ValidReservation) -> Result<bool, Reject> {
    if r.worker_id > MAX_WORKER_ID {
        return Err(Reject::new(
            v1::RejectReason::UnknownWorker,
            format!("worker {} is not in σ", r.worker_id),
        ));
    }
    let liveness = current_worker(b, r.worker_id, r.incarnation)?;
    if let Some(held) = b.sigma().request(r.request_id.as_str()) {
        if held.worker == r.worker_id && held.incarnation == r.incarnation {
            return Ok(false);
        }
        return Err(Reject::new(
            v1::RejectReason::Duplicate,
            format!(
                "request {:?} is already in σ on worker {}",
                r.request_id.as_str(),
                held.worker
            ),
        ));
    }
    if liveness != Liveness::Live {
        return Err(Reject::new(
            v1::RejectReason::WorkerFenced,
            format!(
                "worker {} is {:?} and takes no new requests",
                r.worker_id, liveness
            ),
        ));
    }
    let capacity = b.sigma().worker(r.worker_id).map_or(0, |w| w.capacity);
    let used = b
        .sigma()
        .cluster()
        .worker(r.worker_id)
        .map_or(0, |w| w.requests());
    if used >= capacity && !r.queue_if_full {
        return Err(Reject::new(
            v1::RejectReason::WorkerFull,
            format!("worker {} holds {used} of {capacity} requests", r.worker_id),
        ));
    }
    b.apply(change::request_reserved(
        r.request_id.as_str(),
        r.worker_id,
        r.incarnation,
        r.prompt_tokens,
        r.prompt_hash,
        r.max_tokens,
    ))?;
    Ok(true)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;
    use br_proto::v1::telemetry_change as tc;
    use br_proto::valid::limits;
    use v1::RejectReason as R;
    use v1::watch_event::Kind as Ev;

    const S1: StreamId = 1;
    const S2: StreamId = 2;

    fn settings() -> Settings {
        Settings {
            history: 8,
            reservation_ttl: Duration::from_secs(10),
            worker_grace: Duration::from_secs(5),
            progress_interval: Duration::from_millis(250),
            watcher_queue: 4,
        }
    }

    fn group_with(s: Settings) -> (Group, Instant) {
        let now = Instant::now();
        let m = Metrics::new().unwrap();
        (Group::new("g", 77, Arc::new(s), &m, now), now)
    }

    fn group() -> (Group, Instant) {
        group_with(settings())
    }

    fn tc(kind: tc::Kind) -> v1::TelemetryChange {
        v1::TelemetryChange { kind: Some(kind) }
    }

    fn hello(w: u32, inc: u64, cap: u32) -> v1::TelemetryChange {
        tc(tc::Kind::WorkerHello(tc::WorkerHello {
            worker_id: w,
            incarnation: inc,
            capacity: cap,
            endpoint: format!("http://w{w}"),
        }))
    }

    fn gone(w: u32, inc: u64, at: u64) -> v1::TelemetryChange {
        tc(tc::Kind::WorkerDisconnected(tc::WorkerDisconnected {
            worker_id: w,
            incarnation: inc,
            disconnected_at_unix_ms: at,
        }))
    }

    fn prog(w: u32, inc: u64, id: &str, p: u32, g: u32, fin: bool) -> v1::TelemetryChange {
        tc(tc::Kind::RequestProgress(tc::RequestProgress {
            worker_id: w,
            incarnation: inc,
            request_id: id.into(),
            prompt_tokens: p,
            generated_tokens: g,
            finished: fin,
        }))
    }

    fn sync(w: u32, inc: u64, ids: &[&str]) -> v1::TelemetryChange {
        tc(tc::Kind::WorkerSync(tc::WorkerSync {
            worker_id: w,
            incarnation: inc,
            request_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
        }))
    }

    fn res(id: &str, w: u32, inc: u64, p: u32) -> ValidReservation {
        ValidReservation {
            request_id: RequestId::new(id).unwrap(),
            worker_id: w,
            incarnation: inc,
            prompt_tokens: p,
            prompt_hash: Some(1),
            max_tokens: None,
            queue_if_full: false,
        }
    }

    fn reasons(ack: &v1::ApplyAck) -> Vec<(u32, R)> {
        ack.rejected
            .iter()
            .map(|r| (r.index, R::try_from(r.reason).unwrap()))
            .collect()
    }

    fn load(g: &Group, w: u32) -> u64 {
        g.sigma().cluster().worker(w).unwrap().load()
    }

    fn drain(rx: &mut mpsc::Receiver<Event>) -> Vec<Event> {
        let mut out = Vec::new();
        while let Ok(e) = rx.try_recv() {
            out.push(e);
        }
        out
    }

    /// Follows a watcher's events like a replica does; returns the replica.
    fn follow(replica: &mut Option<Sigma>, events: &[Event]) {
        for e in events {
            match e.kind.as_ref().unwrap() {
                Ev::Snapshot(s) => *replica = Some(Sigma::from_snapshot(s).unwrap()),
                Ev::Delta(d) => replica.as_mut().unwrap().apply_delta(d).unwrap(),
                Ev::Progress(_) | Ev::Reset(_) => {}
            }
        }
    }

    #[test]
    fn a_batch_is_one_version_and_bad_changes_are_rejected_one_by_one() {
        let (mut g, now) = group();
        let ack = g.apply(
            1,
            vec![
                hello(0, 10, 4),
                hello(1, 11, 4),
                prog(0, 10, "a", 100, 5, false),
                v1::TelemetryChange { kind: None },
                hello(MAX_WORKER_ID + 1, 1, 1),
                hello(2, 0, 1),
                hello(2, 1, 0),
                prog(5, 1, "b", 1, 1, false),
                prog(0, 99, "b", 1, 1, false),
                prog(0, 10, "a", 100, 6, false),
                prog(0, 10, &"x".repeat(257), 1, 1, false),
                prog(0, 10, "c", limits::MAX_TOKENS + 1, 1, false),
                sync(7, 1, &[]),
            ],
            S1,
            now,
            0,
        );
        assert_eq!((ack.batch_seq, ack.epoch, ack.version), (1, 77, 1));
        assert_eq!(
            reasons(&ack),
            vec![
                (3, R::Invalid),
                (4, R::Invalid),
                (5, R::Invalid),
                (6, R::Invalid),
                (7, R::UnknownWorker),
                (8, R::StaleIncarnation),
                (9, R::Duplicate),
                (10, R::Invalid),
                (11, R::Invalid),
                (12, R::UnknownWorker),
            ]
        );
        assert_eq!(load(&g, 0), 105);
        // a batch that changes nothing makes no version
        let before = g.snapshot();
        let ack = g.apply(
            2,
            vec![
                prog(0, 10, "a", 100, 5, false),
                prog(9, 1, "z", 1, 1, false),
            ],
            S1,
            now,
            0,
        );
        assert_eq!(ack.version, 1);
        assert_eq!(g.snapshot(), before);
    }

    #[test]
    fn progress_takes_the_max_finish_and_sync_remove() {
        let (mut g, now) = group();
        g.apply(1, vec![hello(0, 10, 8)], S1, now, 0);
        g.reserve(vec![res("r", 0, 10, 50), res("kept", 0, 10, 7)], now);
        assert_eq!(load(&g, 0), 57);
        g.apply(
            2,
            vec![
                prog(0, 10, "r", 0, 9, false),
                prog(0, 10, "a", 20, 3, false),
            ],
            S1,
            now,
            0,
        );
        let r = g.sigma().request("r").unwrap();
        assert_eq!(
            (r.prompt_tokens, r.generated_tokens, r.phase),
            (50, 9, Phase::Running),
            "prompt 0 keeps σ's"
        );
        // reordered older report: absorbed
        g.apply(3, vec![prog(0, 10, "r", 50, 4, false)], S1, now, 0);
        assert_eq!(g.sigma().request("r").unwrap().generated_tokens, 9);
        // finished removes, with the max of the counts
        let v = g.version();
        g.apply(4, vec![prog(0, 10, "r", 50, 2, true)], S1, now, 0);
        assert_eq!(g.version(), v + 1);
        assert!(g.sigma().request("r").is_none());
        let Some(Ev::Delta(d)) = g.history.back().unwrap().kind.as_ref() else {
            panic!()
        };
        assert_eq!(d.changes, vec![change::request_finished("r", 9)]);
        // a full state without "a": the active one leaves, the reserved one stays
        g.apply(5, vec![sync(0, 10, &[])], S1, now, 0);
        assert!(g.sigma().request("a").is_none());
        assert!(g.sigma().request("kept").is_some());
        assert_eq!(load(&g, 0), 7);
    }

    #[test]
    fn on_arrival_reservations_queue_past_capacity_pooled_ones_do_not() {
        let (mut g, now) = group();
        g.apply(1, vec![hello(0, 10, 1)], S1, now, 0);
        let (acc, _) = g.reserve(vec![res("a", 0, 10, 100)], now);
        assert_eq!(acc.len(), 1);
        // the worker is full: a pooled policy's reservation is refused ...
        let (_, rej) = g.reserve(vec![res("b", 0, 10, 50)], now);
        assert_eq!(R::try_from(rej[0].reason).unwrap(), R::WorkerFull);
        // ... an on-arrival policy's is accepted: the request waits in the rank's queue
        let queued = ValidReservation {
            queue_if_full: true,
            ..res("c", 0, 10, 50)
        };
        let (acc, rej) = g.reserve(vec![queued], now);
        assert_eq!((acc, rej.len()), (vec!["c".to_string()], 0));
        assert_eq!(load(&g, 0), 150);
    }

    #[test]
    fn reservations_count_at_once_expire_after_the_ttl_unless_reported() {
        let (mut g, now) = group();
        g.apply(1, vec![hello(0, 10, 2), hello(1, 11, 4)], S1, now, 0);
        let (acc, rej) = g.reserve(vec![res("a", 0, 10, 100), res("b", 0, 10, 10)], now);
        assert_eq!((acc.len(), rej.len(), load(&g, 0)), (2, 0, 110));
        let v = g.version();
        // idempotent repeat: accepted, no new version
        let (acc, _) = g.reserve(vec![res("a", 0, 10, 100)], now);
        assert_eq!((acc, g.version()), (vec!["a".to_string()], v));
        let (_, rej) = g.reserve(
            vec![
                res("c", 0, 10, 1),   // full (2 of 2)
                res("a", 1, 11, 1),   // on another worker
                res("d", 5, 1, 1),    // unknown worker
                res("e", 1, 99, 1),   // stale incarnation
                res("f", 4000, 1, 1), // above the core's limit
            ],
            now,
        );
        let got: Vec<R> = rej.iter().map(|r| R::try_from(r.reason).unwrap()).collect();
        assert_eq!(
            got,
            vec![
                R::WorkerFull,
                R::Duplicate,
                R::UnknownWorker,
                R::StaleIncarnation,
                R::UnknownWorker
            ]
        );
        assert_eq!(g.version(), v);
        // "b" gets telemetry: it stays; "a" expires at the TTL
        g.apply(2, vec![prog(0, 10, "b", 10, 1, false)], S1, now, 0);
        g.tick(now + Duration::from_secs(9));
        assert!(g.sigma().request("a").is_some());
        g.tick(now + Duration::from_secs(10));
        assert!(g.sigma().request("a").is_none());
        assert!(g.sigma().request("b").is_some());
        assert_eq!(load(&g, 0), 11);
        assert_eq!(g.metrics.expired.get(), 1);
        // release: only reserved ones
        g.reserve(vec![res("x", 1, 11, 5)], now);
        let released = g.release(
            &[
                RequestId::new("x").unwrap(),
                RequestId::new("b").unwrap(),
                RequestId::new("nope").unwrap(),
            ],
            now,
        );
        assert_eq!(released, 1);
        assert!(g.sigma().request("b").is_some());
    }

    #[test]
    fn a_disconnected_worker_is_suspect_then_fenced_unless_it_comes_back() {
        let (mut g, now) = group();
        g.apply(
            1,
            vec![
                hello(0, 10, 4),
                hello(1, 11, 4),
                prog(0, 10, "a", 5, 1, false),
                prog(1, 11, "b", 5, 1, false),
            ],
            S1,
            now,
            0,
        );
        // ingest saw worker 0's stream end 2 s ago (its clock): 3 s of grace are left
        g.apply(2, vec![gone(0, 10, 8_000), gone(1, 11, 0)], S1, now, 10_000);
        assert_eq!(g.sigma().liveness(0), Some(Liveness::Suspect));
        assert_eq!(load(&g, 0), 6, "a suspect keeps its requests");
        let (_, rej) = g.reserve(vec![res("c", 0, 10, 1)], now);
        assert_eq!(rej[0].reason, R::WorkerFenced as i32);
        // worker 1 says Hello again (same incarnation) within the grace period
        g.apply(
            3,
            vec![hello(1, 11, 4)],
            S2,
            now + Duration::from_secs(1),
            0,
        );
        g.tick(now + Duration::from_millis(2_999));
        assert_eq!(g.sigma().liveness(0), Some(Liveness::Suspect));
        g.tick(now + Duration::from_secs(3));
        assert_eq!(g.sigma().liveness(0), Some(Liveness::Fenced));
        assert_eq!((g.sigma().request("a"), load(&g, 0)), (None, 0));
        g.tick(now + Duration::from_secs(6));
        assert_eq!(g.sigma().liveness(1), Some(Liveness::Live));
        assert!(g.sigma().request("b").is_some());
        assert_eq!(g.metrics.fenced.get(), 1);
        // fenced: telemetry rejected until a Hello; a new incarnation starts clean
        let ack = g.apply(4, vec![prog(0, 10, "a", 5, 2, false)], S1, now, 0);
        assert_eq!(reasons(&ack), vec![(0, R::WorkerFenced)]);
        g.apply(5, vec![hello(1, 12, 4)], S2, now, 0);
        assert_eq!(
            (
                g.sigma().request("b"),
                load(&g, 1),
                g.sigma().incarnation(1)
            ),
            (None, 0, Some(12))
        );
    }

    #[test]
    fn an_ended_stream_disconnects_only_the_workers_whose_hello_it_carried() {
        let (mut g, now) = group();
        g.apply(1, vec![hello(0, 10, 4), hello(1, 11, 4)], S1, now, 0);
        // worker 1 reconnected through another ingest stream
        g.apply(1, vec![hello(1, 11, 4)], S2, now, 0);
        // a late disconnect report from the old stream does not touch it
        g.apply(2, vec![gone(1, 11, 0)], S1, now, 0);
        assert_eq!(g.sigma().liveness(1), Some(Liveness::Live));
        g.stream_ended(S1, now);
        assert_eq!(g.sigma().liveness(0), Some(Liveness::Suspect));
        assert_eq!(g.sigma().liveness(1), Some(Liveness::Live));
        g.tick(now + Duration::from_secs(5));
        assert_eq!(g.sigma().liveness(0), Some(Liveness::Fenced));
    }

    #[test]
    fn watchers_resume_or_reset_and_replicas_match() {
        let (mut g, now) = group_with(Settings {
            watcher_queue: 64,
            ..settings()
        });
        let mut from_scratch = g.subscribe(0, 0);
        g.apply(1, vec![hello(0, 10, 64)], S1, now, 0);
        let mut at2 = None;
        for i in 0..5 {
            g.apply(
                i + 2,
                vec![prog(0, 10, &format!("r{i}"), 10, i as u32, false)],
                S1,
                now,
                0,
            );
            if g.version() == 2 {
                at2 = Some(Sigma::from_snapshot(&g.snapshot()).unwrap());
            }
        }
        assert_eq!(g.version(), 6);
        let mut replica = None;
        let evs = drain(&mut from_scratch);
        assert!(matches!(evs[0].kind, Some(Ev::Snapshot(_))));
        follow(&mut replica, &evs);
        assert_eq!(replica.as_ref().unwrap().to_snapshot(), g.snapshot());

        // resume from 2: one merged delta 2 -> 6
        let mut w = g.subscribe(77, 6);
        assert!(drain(&mut w).is_empty(), "up to date: nothing yet");
        let mut w = g.subscribe(77, 2);
        let evs = drain(&mut w);
        assert_eq!(evs.len(), 1);
        let Some(Ev::Delta(d)) = evs[0].kind.as_ref() else {
            panic!()
        };
        assert_eq!((d.prev_version, d.version), (2, 6));
        follow(&mut at2, &evs);
        assert_eq!(at2.unwrap().to_snapshot(), g.snapshot());

        // unknown epoch, future version, truncated history: reset + snapshot
        for (epoch, v, reason) in [
            (5, 1, v1::ResetReason::UnknownEpoch),
            (77, 9, v1::ResetReason::FutureVersion),
        ] {
            let evs = drain(&mut g.subscribe(epoch, v));
            let Some(Ev::Reset(rs)) = evs[0].kind.as_ref() else {
                panic!()
            };
            assert_eq!((rs.reason, rs.epoch), (reason as i32, 77));
            assert!(matches!(evs[1].kind, Some(Ev::Snapshot(_))));
        }
        for i in 0..10 {
            g.apply(
                i + 10,
                vec![prog(0, 10, &format!("s{i}"), 10, 1, false)],
                S1,
                now,
                0,
            );
        }
        let evs = drain(&mut g.subscribe(77, 2));
        let Some(Ev::Reset(rs)) = evs[0].kind.as_ref() else {
            panic!()
        };
        assert_eq!(rs.reason, v1::ResetReason::HistoryTruncated as i32);
        // the oldest held delta still resumes
        let oldest = g.version() - 8;
        let evs = drain(&mut g.subscribe(77, oldest));
        let Some(Ev::Delta(d)) = evs[0].kind.as_ref() else {
            panic!()
        };
        assert_eq!((d.prev_version, d.version), (oldest, g.version()));
    }

    #[test]
    fn a_slow_watcher_is_reset_and_never_holds_up_the_others() {
        let (mut g, now) = group();
        let mut slow = g.subscribe(0, 0);
        let mut fast = g.subscribe(0, 0);
        let mut fast_replica = None;
        g.apply(1, vec![hello(0, 10, 64)], S1, now, 0);
        follow(&mut fast_replica, &drain(&mut fast));
        for i in 0..20 {
            g.apply(
                i + 2,
                vec![prog(0, 10, &format!("r{i}"), 10, 1, false)],
                S1,
                now,
                0,
            );
            // the fast one reads every delta in order
            let evs = drain(&mut fast);
            assert_eq!(evs.len(), 1);
            follow(&mut fast_replica, &evs);
        }
        assert_eq!(fast_replica.as_ref().unwrap().to_snapshot(), g.snapshot());
        // the slow one's queue (4 + its snapshot) overflowed; it now reads everything
        let evs = drain(&mut slow);
        assert_eq!(evs.len(), 5);
        g.tick(now);
        let evs2 = drain(&mut slow);
        let kinds: Vec<&str> = evs2
            .iter()
            .map(|e| match e.kind.as_ref().unwrap() {
                Ev::Reset(r) if r.reason == v1::ResetReason::SlowConsumer as i32 => "reset",
                Ev::Snapshot(_) => "snapshot",
                _ => "other",
            })
            .collect();
        assert_eq!(kinds, vec!["reset", "snapshot"]);
        let mut slow_replica = None;
        follow(&mut slow_replica, &evs);
        follow(&mut slow_replica, &evs2);
        assert_eq!(slow_replica.unwrap().to_snapshot(), g.snapshot());
        assert_eq!(g.watcher_count(), 2);
        drop(slow);
        g.tick(now);
        assert_eq!(g.watcher_count(), 1);
    }

    #[test]
    fn progress_marks_when_idle() {
        let (mut g, now) = group();
        let mut w = g.subscribe(0, 0);
        drain(&mut w);
        g.tick(now + Duration::from_millis(100));
        assert!(drain(&mut w).is_empty());
        g.tick(now + Duration::from_millis(250));
        let evs = drain(&mut w);
        let Some(Ev::Progress(p)) = evs[0].kind.as_ref() else {
            panic!()
        };
        assert_eq!((p.epoch, p.version), (77, 0));
    }

    // ---- property: every watcher ends at the writer's σ ----

    mod props {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Hello(u32, u64, StreamId),
            Gone(u32, u64, StreamId),
            StreamEnd(StreamId),
            Progress(u32, u64, u8, u32, u32, bool),
            Sync(u32, u64, Vec<u8>),
            Reserve(u8, u32, u64, u32),
            Release(u8),
            Tick(u64),
            /// Subscribe holding a past version (index into the recorded ones) or from scratch.
            Subscribe(Option<usize>),
            /// Read up to n events of watcher i.
            Read(usize, usize),
        }

        fn op() -> impl Strategy<Value = Op> {
            let w = 0u32..3;
            let inc = 1u64..3;
            let st = 1u64..3;
            let r = 0u8..8;
            prop_oneof![
                3 => (w.clone(), inc.clone(), st.clone()).prop_map(|(a, b, c)| Op::Hello(a, b, c)),
                1 => (w.clone(), inc.clone(), st.clone()).prop_map(|(a, b, c)| Op::Gone(a, b, c)),
                1 => st.prop_map(Op::StreamEnd),
                6 => (w.clone(), inc.clone(), r.clone(), 0u32..50, 0u32..50, proptest::bool::weighted(0.2))
                    .prop_map(|(a, b, c, d, e, f)| Op::Progress(a, b, c, d, e, f)),
                1 => (w.clone(), inc.clone(), proptest::collection::vec(0u8..8, 0..4)).prop_map(|(a, b, c)| Op::Sync(a, b, c)),
                3 => (r.clone(), w, inc, 1u32..50).prop_map(|(a, b, c, d)| Op::Reserve(a, b, c, d)),
                1 => r.prop_map(Op::Release),
                2 => (0u64..7000).prop_map(Op::Tick),
                1 => proptest::option::of(0usize..64).prop_map(Op::Subscribe),
                3 => (0usize..8, 0usize..6).prop_map(|(a, b)| Op::Read(a, b)),
            ]
        }

        struct Follower {
            rx: mpsc::Receiver<Event>,
            replica: Option<Sigma>,
            awaiting_snapshot: bool,
        }

        impl Follower {
            fn read(&mut self, n: usize) {
                for _ in 0..n {
                    let Ok(ev) = self.rx.try_recv() else { return };
                    match ev.kind.as_ref().unwrap() {
                        Ev::Snapshot(s) => {
                            self.replica = Some(Sigma::from_snapshot(s).unwrap());
                            self.awaiting_snapshot = false;
                        }
                        Ev::Delta(d) => {
                            assert!(
                                !self.awaiting_snapshot,
                                "a delta between a reset and its snapshot"
                            );
                            // a delta always continues what the watcher holds
                            self.replica.as_mut().unwrap().apply_delta(d).unwrap();
                        }
                        Ev::Reset(_) => self.awaiting_snapshot = true,
                        Ev::Progress(p) => {
                            let r = self.replica.as_ref().unwrap();
                            assert_eq!((p.epoch, p.version), (r.epoch(), r.version()));
                        }
                    }
                }
            }
        }

        fn id(r: u8) -> String {
            format!("q{r}")
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(200))]

            #[test]
            fn every_watcher_ends_at_the_writers_sigma(ops in proptest::collection::vec(op(), 1..150)) {
                let (mut g, start) = group_with(Settings {
                    history: 6,
                    reservation_ttl: Duration::from_secs(3),
                    worker_grace: Duration::from_secs(2),
                    progress_interval: Duration::from_millis(500),
                    watcher_queue: 3,
                });
                let mut now = start;
                let mut seq = 0;
                let mut versions: Vec<Sigma> = vec![Sigma::from_snapshot(&g.snapshot()).unwrap()];
                let mut followers: Vec<Follower> = Vec::new();
                for op in ops {
                    seq += 1;
                    match op {
                        Op::Hello(w, i, s) => { g.apply(seq, vec![hello(w, i, 3)], s, now, 0); }
                        Op::Gone(w, i, s) => { g.apply(seq, vec![gone(w, i, 0)], s, now, 0); }
                        Op::StreamEnd(s) => g.stream_ended(s, now),
                        Op::Progress(w, i, r, p, gen_tokens, fin) => { g.apply(seq, vec![prog(w, i, &id(r), p, gen_tokens, fin)], 1, now, 0); }
                        Op::Sync(w, i, rs) => {
                            let ids: Vec<String> = rs.iter().map(|r| id(*r)).collect();
                            let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
                            g.apply(seq, vec![sync(w, i, &refs)], 1, now, 0);
                        }
                        Op::Reserve(r, w, i, p) => { g.reserve(vec![res(&id(r), w, i, p)], now); }
                        Op::Release(r) => { g.release(&[RequestId::new(&id(r)).unwrap()], now); }
                        Op::Tick(ms) => {
                            now += Duration::from_millis(ms);
                            g.tick(now);
                        }
                        Op::Subscribe(at) => {
                            let (epoch, held) = match at {
                                Some(i) => {
                                    let v = &versions[i % versions.len()];
                                    (77, Some(v.clone()))
                                }
                                None => (0, None),
                            };
                            let v = held.as_ref().map_or(0, Sigma::version);
                            followers.push(Follower { rx: g.subscribe(epoch, v), replica: held, awaiting_snapshot: false });
                        }
                        Op::Read(i, n) => {
                            if let Some(f) = followers.get_mut(i) {
                                f.read(n);
                            }
                        }
                    }
                    if g.version() as usize == versions.len() {
                        versions.push(Sigma::from_snapshot(&g.snapshot()).unwrap());
                    }
                    prop_assert_eq!(g.version() as usize + 1, versions.len(), "one version per change");
                }
                // everyone reads everything; lagging watchers get their reset and snapshot
                for _ in 0..2 {
                    for f in &mut followers {
                        f.read(usize::MAX);
                    }
                    g.tick(now);
                }
                let want = g.snapshot();
                for f in &followers {
                    prop_assert!(!f.awaiting_snapshot);
                    prop_assert_eq!(&f.replica.as_ref().unwrap().to_snapshot(), &want);
                }
            }
        }
    }
}
