//! The task that owns one group's [`GroupCore`]: it takes commands from the handlers (bounded
//! mpsc, answers by oneshot), σ events from the Watch follower and `Reserve` outcomes, runs the
//! ticks, and makes the `Reserve`/`Release` calls (at most a few `Reserve` calls in flight).
//!
//! The `Reserve` calls are futures the task polls itself, beside its other inputs, not tasks it
//! spawns: a spawned call cost two more hand-offs per round trip (the task waking the call's
//! task, and that task waking it back with the outcome), each a thread wake-up on the Assign
//! path. In br-all, where the call is the snapshot writer's queue, the round trip is now one
//! wake-up each way.
//!
//! Ticks run on new arrivals (coalesced: at most one per `tick_min_interval`), on every σ
//! change, and every `tick_interval` (which also does the housekeeping).
//!
//! This is the group's async shell: the clock is read here (and only here) and passed down as
//! `now`, and the `Reserve`/`Release` messages are built and parsed through
//! [`crate::group::wire`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use br_proto::v1;
use br_proto::valid::{GroupId, RequestId, ValidAssign};
use br_trace::SpanContext;
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use rustc_hash::FxHashMap;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::cancel_ack::{CancelReply, ReleaseWaiters, release_then_answer};
use crate::error::DecisionError;
use crate::group::{GroupCore, GroupStats, LiveNow, Placing, Reply, wire};
use crate::metrics::GroupMetrics;
use crate::upstream::SnapshotOps;
use br_client::watch::{Update, WatchHandle, WatchStatus};

/// Capacity of a group's command queue (handlers wait when it is full).
pub const COMMAND_QUEUE: usize = 8192;

/// Most commands (or σ updates) a group task takes from its queue in one turn of its loop
/// before it flushes and looks at its other inputs again: bounded, so a flood of Assigns
/// cannot hold back σ updates, `Reserve` outcomes or a due tick for long.
const BATCH: usize = 64;

/// What handlers ask of a group task.
#[derive(Debug)]
pub enum Command {
    Assign {
        req: ValidAssign,
        call: u64,
        reply: Reply,
        /// The call's span when traces are exported: the tick's Reserve span links it.
        span: Option<SpanContext>,
        /// The caller's SPIFFE id under mutual TLS: the request is bound to it (only it may
        /// cancel). `None` on a plaintext server.
        owner: Option<Arc<str>>,
    },
    /// The caller `call` has gone; `undelivered`: it held an answer it never read.
    Withdraw {
        id: RequestId,
        call: u64,
        undelivered: bool,
    },
    Cancel {
        id: RequestId,
        /// The caller's SPIFFE id, checked against the request's owner; `None`: not checked
        /// (a plaintext server, or the admin role).
        caller: Option<Arc<str>>,
        /// Answered RELEASED only once the snapshot service acknowledged the `Release`.
        reply: CancelReply,
    },
    Stats {
        reply: oneshot::Sender<GroupStats>,
    },
    /// What the live page samples (σ's summary, the pool, staleness).
    Live {
        reply: oneshot::Sender<LiveNow>,
    },
    /// The replica of σ as the group task holds it (tests comparing it with the writer's).
    Sigma {
        reply: oneshot::Sender<Option<v1::ClusterSnapshot>>,
    },
}

/// The handlers' side of a group task. Cheap to clone.
#[derive(Clone, Debug)]
pub struct GroupHandle {
    tx: mpsc::Sender<Command>,
    group: GroupId,
    calls: Arc<AtomicU64>,
}

impl GroupHandle {
    pub fn group(&self) -> &GroupId {
        &self.group
    }

    /// A fresh id for one `Assign` call (distinguishes the callers of one request id).
    pub fn next_call(&self) -> u64 {
        self.calls.fetch_add(1, Ordering::Relaxed)
    }

    pub async fn send(&self, cmd: Command) -> Result<(), DecisionError> {
        self.tx
            .send(cmd)
            .await
            .map_err(|_| DecisionError::ShuttingDown)
    }

    /// For drop guards, which cannot wait. False if the queue is full or closed (the group
    /// task's housekeeping then notices the closed reply channel itself).
    pub fn try_send(&self, cmd: Command) -> bool {
        self.tx.try_send(cmd).is_ok()
    }

    /// The group's numbers (tests, debugging).
    pub async fn stats(&self) -> Option<GroupStats> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Stats { reply }).await.ok()?;
        rx.await.ok()
    }

    /// The group's σ replica as a snapshot (tests: the embedded decision must hold the
    /// writer's σ); `None` before the first σ or once the task has ended.
    pub async fn sigma(&self) -> Option<v1::ClusterSnapshot> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Sigma { reply }).await.ok()?;
        rx.await.ok()?
    }

    /// The group's state for the live page; `None` once its task has ended.
    pub async fn live(&self) -> Option<LiveNow> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Live { reply }).await.ok()?;
        rx.await.ok()
    }
}

/// How often housekeeping runs while the group holds nothing that waits on the clock
/// ([`GroupCore::is_quiet`]): only gauges (σ's staleness, the pool) move then, and a scrape
/// every second or more sees them as fresh.
const QUIET_HOUSEKEEPING: Duration = Duration::from_secs(1);

/// Tick timing.
#[derive(Debug, Clone, Copy)]
pub struct TickConfig {
    /// Timer tick (and housekeeping) period.
    pub interval: Duration,
    /// Arrivals and σ changes trigger a tick at most this often.
    pub min_interval: Duration,
}

impl Default for TickConfig {
    fn default() -> Self {
        TickConfig {
            interval: Duration::from_millis(20),
            min_interval: Duration::from_millis(1),
        }
    }
}

/// The σ source of a group task: a `br_client::watch` follower.
#[derive(Debug)]
pub struct Feed {
    pub updates: mpsc::Receiver<Update>,
    pub handle: WatchHandle,
    /// The watcher's status, kept rather than taken from `handle` at every update.
    status: watch::Receiver<WatchStatus>,
    resubscribes_seen: u64,
}

impl Feed {
    pub fn new(handle: WatchHandle, updates: mpsc::Receiver<Update>) -> Feed {
        Feed {
            updates,
            status: handle.status(),
            handle,
            resubscribes_seen: 0,
        }
    }
}

/// Called with the group's [`Placing`] when a σ update changes it (it starts as
/// [`Placing::NoSigma`]).
pub type OnPlacing = Box<dyn FnMut(Placing) + Send>;

struct ReserveDone {
    job: u64,
    result: Result<v1::ReserveResponse, tonic::Status>,
}

/// One `Reserve` call in flight, polled by the group task (at most
/// `--max-inflight-reserves` of them: the core bounds the jobs it hands out).
type ReserveCall = Pin<Box<dyn Future<Output = ReserveDone> + Send>>;

/// Starts the task that owns `core`. It ends when every [`GroupHandle`] is dropped.
pub fn spawn_group(
    core: GroupCore,
    ops: Arc<dyn SnapshotOps>,
    feed: Option<Feed>,
    ticks: TickConfig,
    metrics: GroupMetrics,
    on_placing: Option<OnPlacing>,
    shutdown: CancellationToken,
) -> (GroupHandle, JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
    let handle = GroupHandle {
        tx,
        group: core.group().clone(),
        calls: Arc::new(AtomicU64::new(1)),
    };
    let task = tokio::spawn(run(
        core, ops, rx, feed, ticks, metrics, on_placing, shutdown,
    ));
    (handle, task)
}

#[allow(clippy::too_many_arguments)]
async fn run(
    mut core: GroupCore,
    ops: Arc<dyn SnapshotOps>,
    mut cmds: mpsc::Receiver<Command>,
    feed: Option<Feed>,
    ticks: TickConfig,
    metrics: GroupMetrics,
    mut on_placing: Option<OnPlacing>,
    shutdown: CancellationToken,
) {
    let mut placing = None;
    let mut reserves: FuturesUnordered<ReserveCall> = FuturesUnordered::new();
    let mut feed = feed;
    let mut last_tick = Instant::now();
    let mut last_housekeeping = last_tick;
    let mut spans = AssignSpans::default();
    let mut cancels = ReleaseWaiters::default();
    // One timer for the task's life, moved when the next tick is due at another instant: a
    // new `sleep_until` per turn of the loop registered and dropped a timer entry for every
    // command and σ update.
    let timer = tokio::time::sleep_until((last_housekeeping + ticks.interval).into());
    tokio::pin!(timer);
    loop {
        // Every interval, or every QUIET_HOUSEKEEPING while nothing waits on the clock: an
        // idle group's task woke 50 times a second for nothing. Whatever ends the quiet (a
        // command, a σ update, a Reserve outcome) turns this loop, and a housekeeping overdue
        // by the short interval then runs at once.
        let quiet = core.is_quiet() && reserves.is_empty() && cancels.is_empty();
        let next_timer = last_housekeeping
            + if quiet {
                QUIET_HOUSEKEEPING.max(ticks.interval)
            } else {
                ticks.interval
            };
        let due = if core.tick_wanted() {
            (last_tick + ticks.min_interval).min(next_timer)
        } else {
            next_timer
        };
        if timer.deadline() != due.into() {
            timer.as_mut().reset(due.into());
        }
        tokio::select! {
            biased;
            () = &mut timer => {
                let now = Instant::now();
                if core.tick(now) {
                    metrics.ticks_total.inc();
                    metrics.tick_duration.observe(now.elapsed().as_secs_f64());
                }
                last_tick = now;
                if now >= next_timer {
                    core.housekeeping(now);
                    spans.expire(now);
                    last_housekeeping = now;
                }
            }
            Some(done) = reserves.next(), if !reserves.is_empty() => {
                tracing::trace!(group = %core.group(), job = done.job, ok = done.result.is_ok(), "Reserve done");
                core.on_reserve_done(done.job, wire::reserve_outcome(done.result), Instant::now());
            }
            Some(u) = recv_feed(&mut feed) => {
                if let Some(f) = feed.as_mut() {
                    // σ updates already queued are applied in this turn too (one flush and
                    // one readiness check for all of them).
                    let mut next = Some(u);
                    for _ in 0..BATCH {
                        let Some(u) = next.take().or_else(|| f.updates.try_recv().ok()) else {
                            break;
                        };
                        // The select is biased towards σ's feed, so the feed's end (br-all's
                        // writer closes the Watch streams after the drain) can win over the
                        // shutdown branch: look at the token itself before each update, or a
                        // clean stop logs an outage. Once per turn was not enough: the token
                        // can be cancelled while a batch is applied (about 1 run in 100 of
                        // br-all's `start_and_stop_logs`).
                        if shutdown.is_cancelled() {
                            core.shut_down();
                        }
                        on_update(&mut core, u, f, &metrics);
                    }
                }
                // Whether it can place follows σ alone, so only σ's updates can change it.
                if let Some(report) = on_placing.as_mut() {
                    let now = core.placing();
                    if placing != Some(now) {
                        placing = Some(now);
                        report(now);
                    }
                }
            }
            cmd = cmds.recv() => match cmd {
                None => break,
                Some(cmd) => {
                    on_command(&mut core, cmd, &mut spans, &mut cancels);
                    // The handlers' commands already queued are taken in this turn too: one
                    // flush (one Reserve job) for the Assigns that arrived together.
                    for _ in 1..BATCH {
                        let Ok(cmd) = cmds.try_recv() else { break };
                        on_command(&mut core, cmd, &mut spans, &mut cancels);
                    }
                }
            },
            () = shutdown.cancelled(), if !core.is_shutting_down() => core.shut_down(),
        }
        flush(&mut core, &ops, &mut reserves, &mut spans, &mut cancels);
    }
    tracing::debug!(group = %core.group(), "group task stopped");
}

async fn recv_feed(feed: &mut Option<Feed>) -> Option<Update> {
    match feed {
        Some(f) => f.updates.recv().await,
        None => std::future::pending().await,
    }
}

fn on_command(
    core: &mut GroupCore,
    cmd: Command,
    spans: &mut AssignSpans,
    cancels: &mut ReleaseWaiters,
) {
    let now = Instant::now();
    match cmd {
        Command::Assign {
            req,
            call,
            reply,
            span,
            owner,
        } => {
            if let Some(span) = span {
                spans.insert(&req.request_id, span, now);
            }
            match owner {
                None => core.assign(req, call, reply, now),
                Some(owner) => {
                    let id = req.request_id.clone();
                    core.assign(req, call, reply, now);
                    core.claim(id.as_str(), owner);
                }
            }
        }
        Command::Withdraw {
            id,
            call,
            undelivered,
        } => core.withdraw(id.as_str(), call, undelivered),
        Command::Cancel { id, caller, reply } => {
            let outcome = core.cancel_by(id.as_str(), caller.as_deref(), now);
            let pending = core.release_pending(id.as_str());
            cancels.answer(id, outcome, pending, reply);
        }
        Command::Stats { reply } => {
            let _ = reply.send(core.stats());
        }
        Command::Live { reply } => {
            let _ = reply.send(core.live_now());
        }
        Command::Sigma { reply } => {
            let _ = reply.send(core.sigma().map(br_sigma::Sigma::to_snapshot));
        }
    }
}

fn on_update(core: &mut GroupCore, u: Update, feed: &mut Feed, metrics: &GroupMetrics) {
    let now = Instant::now();
    match u {
        Update::Connected { .. } => core.on_connected(now),
        Update::Disconnected { at, error } => {
            if core.is_shutting_down() {
                // br-all's snapshot writer ends the Watch streams once the drain is over: a
                // clean shutdown, not an outage to warn about.
                tracing::debug!(group = %core.group(), %error, "σ feed ended while shutting down");
            } else if core.has_sigma() && !core.is_stale() {
                tracing::warn!(group = %core.group(), %error, "σ feed lost; answering from the last σ (stale)");
            }
            core.on_disconnected(at.into_std(), now);
        }
        Update::Snapshot { sigma, reset } => {
            if let Some(r) = &reset {
                let reason = match r.reason {
                    v1::ResetReason::UnknownEpoch => "unknown_epoch",
                    v1::ResetReason::HistoryTruncated => "history_truncated",
                    v1::ResetReason::SlowConsumer => "slow_consumer",
                    v1::ResetReason::FutureVersion => "future_version",
                    v1::ResetReason::Unspecified => "unspecified",
                };
                tracing::info!(group = %core.group(), reason, detail = %r.detail, "σ reset by the snapshot service");
                metrics.watch_reset(reason);
            }
            if sigma.group() != core.group().as_str() {
                tracing::error!(group = %core.group(), got = %sigma.group(), "snapshot of another group; resubscribing");
                feed.handle.resync();
                return;
            }
            tracing::info!(group = %core.group(), epoch = sigma.epoch(), version = sigma.version(), "σ snapshot installed");
            core.set_sigma(*sigma, now);
        }
        Update::Delta(d) => {
            if let Err(e) = core.on_delta(&d, now) {
                tracing::warn!(group = %core.group(), error = %e, "σ delta does not apply; asking for a fresh snapshot");
                metrics.watch_reset("apply_error");
                feed.handle.resync();
            }
        }
    }
    // Resubscriptions the watcher made on its own (gaps, stream errors).
    let resubscribes = feed.status.borrow().resubscribes;
    if resubscribes > feed.resubscribes_seen {
        metrics.watch_reset_by("resubscribe", resubscribes - feed.resubscribes_seen);
        feed.resubscribes_seen = resubscribes;
    }
}

/// Starts the `Reserve` calls the core has ready (into `reserves`, which the loop polls) and
/// spawns the `Release` call, if any.
fn flush(
    core: &mut GroupCore,
    ops: &Arc<dyn SnapshotOps>,
    reserves: &mut FuturesUnordered<ReserveCall>,
    spans: &mut AssignSpans,
    cancels: &mut ReleaseWaiters,
) {
    let now = Instant::now();
    while let Some(job) = core.take_reserve(now) {
        tracing::trace!(group = %core.group(), job = job.id, n = job.reservations.len(), "Reserve");
        let request = wire::reserve_request(core.group(), &job);
        let span = reserve_span(core.group(), &job, spans);
        // Made inside the tick's Reserve span: the upstream takes the trace context it sends
        // (a unary call's metadata, a ReserveStream call's fields) from the current span when
        // the call is made, not when it is polled.
        let call = span.in_scope(|| ops.reserve(request));
        let job = job.id;
        reserves.push(Box::pin(
            async move {
                let result = call.await;
                ReserveDone { job, result }
            }
            .instrument(span),
        ));
    }
    if let Some(ids) = core.take_release(now) {
        let waiters = cancels.take_for(&ids);
        let rel = wire::release_request(core.group(), ids);
        let ops = Arc::clone(ops);
        let group = core.group().clone();
        let span = release_span(&group, rel.request_ids.len());
        tokio::spawn(
            async move {
                let n = rel.request_ids.len();
                if let Err(s) = release_then_answer(ops.release(rel), waiters).await {
                    // Best effort: an unreleased reservation expires after the TTL.
                    tracing::debug!(group = %group, n, code = ?s.code(), error = %s.message(), "Release failed");
                }
            }
            // Polled inside the span, so the call's interceptor sends its context.
            .instrument(span),
        );
    }
    cancels.settle(|id| core.release_pending(id));
}

/// The client span of one tick's `Reserve` call (disabled, and free, when traces are not
/// exported). The call carries it to the snapshot service, whose server span is its child.
/// The call commits the reservations of many Assigns, which parentage cannot say, so it links
/// the span of each Assign call it serves.
fn reserve_span(
    group: &GroupId,
    job: &crate::group::ReserveJob,
    spans: &mut AssignSpans,
) -> tracing::Span {
    if !br_trace::enabled() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        "reserve",
        otel.name = "balanceroute.v1.Snapshot/Reserve",
        otel.kind = "client",
        rpc.system = "grpc",
        rpc.service = "balanceroute.v1.Snapshot",
        rpc.method = "Reserve",
        group = %group,
        job = job.id,
        n = job.reservations.len(),
    );
    for r in &job.reservations {
        br_trace::add_links(&span, spans.take(&r.request_id));
    }
    span
}

/// The client span of one `Release` call (disabled, and free, when traces are not exported):
/// the snapshot service's server span is its child. One call releases what many Cancels and
/// departures left, so, as a Reserve, it is nobody's child.
fn release_span(group: &GroupId, n: usize) -> tracing::Span {
    if !br_trace::enabled() {
        return tracing::Span::none();
    }
    tracing::info_span!(
        "release",
        otel.name = "balanceroute.v1.Snapshot/Release",
        otel.kind = "client",
        rpc.system = "grpc",
        rpc.service = "balanceroute.v1.Snapshot",
        rpc.method = "Release",
        group = %group,
        n,
    )
}

/// Most Assign spans remembered for their Reserve (beyond it, a call's span is not linked).
const MAX_ASSIGN_SPANS: usize = 65_536;
/// Most calls of one request id linked (retries of one id).
const MAX_CALLS_PER_REQUEST: usize = 8;
/// How long an Assign span waits for its Reserve before it is forgotten (a request answered
/// without one: refused, withdrawn, cancelled). Longer than any pool wait.
const ASSIGN_SPAN_TTL: Duration = Duration::from_secs(600);

/// The span contexts of the Assign calls whose reservations have not gone out in a `Reserve`
/// yet, by request id. Only filled when traces are exported; bounded in size and age.
#[derive(Default)]
struct AssignSpans {
    by_id: FxHashMap<RequestId, (Vec<SpanContext>, Instant)>,
}

impl AssignSpans {
    fn insert(&mut self, id: &RequestId, span: SpanContext, now: Instant) {
        if let Some((calls, _)) = self.by_id.get_mut(id) {
            if calls.len() < MAX_CALLS_PER_REQUEST {
                calls.push(span);
            }
            return;
        }
        if self.by_id.len() < MAX_ASSIGN_SPANS {
            self.by_id.insert(id.clone(), (vec![span], now));
        }
    }

    /// The spans of `id`'s calls, forgotten here.
    fn take(&mut self, id: &RequestId) -> Vec<SpanContext> {
        self.by_id.remove(id).map(|(v, _)| v).unwrap_or_default()
    }

    fn expire(&mut self, now: Instant) {
        self.by_id
            .retain(|_, (_, at)| now.saturating_duration_since(*at) < ASSIGN_SPAN_TTL);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on purpose
mod tests {
    use std::time::Duration;

    use br_core::{PolicyConfig, PolicyKind, build_policy};
    use br_proto::v1;
    use br_proto::valid::{GroupId, RequestId, ValidAssign};
    use br_sigma::{Sigma, change};
    use futures::future::BoxFuture;
    use tokio::sync::{mpsc, oneshot};
    use tokio_util::sync::CancellationToken;

    use super::{Command, TickConfig, spawn_group};
    use crate::group::{GroupConfig, GroupCore};
    use crate::upstream::SnapshotOps;

    const EPOCH: u64 = 7;
    /// A hang guard for waits, not a timing assertion.
    const WAIT: Duration = Duration::from_secs(10);

    type Answer = oneshot::Sender<Result<v1::ReserveResponse, tonic::Status>>;

    /// A snapshot service whose `Reserve` calls the test answers by hand: each call hands its
    /// request and a sender for its answer to the test.
    struct HeldReserve {
        calls: mpsc::Sender<(v1::ReserveRequest, Answer)>,
    }

    impl SnapshotOps for HeldReserve {
        fn reserve(
            &self,
            req: v1::ReserveRequest,
        ) -> BoxFuture<'static, Result<v1::ReserveResponse, tonic::Status>> {
            let calls = self.calls.clone();
            Box::pin(async move {
                let (answer, rx) = oneshot::channel();
                calls
                    .send((req, answer))
                    .await
                    .map_err(|_| tonic::Status::unavailable("test gone"))?;
                rx.await
                    .map_err(|_| tonic::Status::unavailable("answer dropped"))?
            })
        }

        fn release(
            &self,
            _req: v1::ReleaseRequest,
        ) -> BoxFuture<'static, Result<v1::ReleaseResponse, tonic::Status>> {
            Box::pin(async { Ok(v1::ReleaseResponse::default()) })
        }
    }

    /// One live worker (0) of capacity 8 in σ, installed in a BR-0 group core.
    fn core_with_sigma() -> (GroupCore, crate::metrics::GroupMetrics) {
        let metrics = crate::metrics::Metrics::new().unwrap().group("g");
        let policy = build_policy(&PolicyConfig::new(PolicyKind::Br0)).unwrap();
        let mut core = GroupCore::new(
            GroupId::new("g").unwrap(),
            policy,
            GroupConfig::default(),
            metrics.clone(),
        );
        let mut sigma = Sigma::with_epoch("g", EPOCH);
        let mut b = sigma.batch();
        b.apply(change::worker_up(0, 100, 8, "http://w0")).unwrap();
        b.commit();
        core.set_sigma(sigma, std::time::Instant::now());
        (core, metrics)
    }

    /// The `Reserve` round trip adds no task of its own: the group task polls the call (one
    /// wake-up each way on the Assign path instead of three). A spawned call is a task alive
    /// while its answer is awaited; here the count of live tasks stays the group task's.
    #[tokio::test(flavor = "current_thread")]
    async fn a_reserve_call_in_flight_is_no_task_of_its_own_and_answers_the_assign() {
        let (core, metrics) = core_with_sigma();
        let (calls_tx, mut calls) = mpsc::channel(4);
        let shutdown = CancellationToken::new();
        let (handle, task) = spawn_group(
            core,
            std::sync::Arc::new(HeldReserve { calls: calls_tx }),
            None,
            TickConfig::default(),
            metrics,
            None,
            shutdown,
        );
        let runtime = tokio::runtime::Handle::current().metrics();
        let tasks_before = runtime.num_alive_tasks();

        let (reply, answered) = oneshot::channel();
        let req = ValidAssign {
            group: GroupId::new("g").unwrap(),
            request_id: RequestId::new("r1").unwrap(),
            prompt_tokens: 100,
            prompt_hash: None,
            max_tokens: None,
            expected_output_tokens: None,
            request_class: None,
        };
        handle
            .send(Command::Assign {
                req,
                call: handle.next_call(),
                reply,
                span: None,
                owner: None,
            })
            .await
            .unwrap();
        let (sent, answer) = tokio::time::timeout(WAIT, calls.recv())
            .await
            .expect("no Reserve call was made for the Assign")
            .unwrap();
        assert_eq!(sent.group, "g");
        assert_eq!(sent.reservations.len(), 1);
        assert_eq!(sent.reservations[0].request_id, "r1");
        assert_eq!(
            runtime.num_alive_tasks(),
            tasks_before,
            "the Reserve call in flight runs as a task of its own"
        );

        answer
            .send(Ok(v1::ReserveResponse {
                epoch: EPOCH,
                version: 2,
                accepted: vec!["r1".into()],
                rejected: vec![],
            }))
            .unwrap();
        let got = tokio::time::timeout(WAIT, answered)
            .await
            .expect("the Assign was not answered after its Reserve")
            .unwrap()
            .unwrap();
        assert_eq!(got.worker, 0);
        assert!(!got.stale, "an accepted reservation answers current");

        drop(handle);
        tokio::time::timeout(WAIT, task)
            .await
            .expect("the group task did not end with its last handle")
            .unwrap();
    }
}
