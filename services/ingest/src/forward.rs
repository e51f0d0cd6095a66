//! The forwarder: one task owns the coalescing buffer, fed by every stream through a bounded
//! channel, and sends one `ChangeBatch` per group over ONE long-lived `Snapshot.Apply` stream.
//! A second task (the link) keeps that stream up: it connects with backoff, reads the
//! ApplyAcks and reports up/down/new-epoch to the forwarder.
//!
//! When it sends: at once while the snapshot service has every batch sent before
//! acknowledged (the link is idle) and `batch_spacing` has passed since the last batch, so a
//! report waits for no clock; otherwise changes coalesce until those acks are in (and the
//! spacing has passed), or for at most `batch_interval`, whichever comes first. The batches
//! grow with the snapshot service's backlog, not with a fixed clock: a quiet cluster's
//! reports go one message at a time, a busy one's in batches the size of what arrived while
//! the last one was applied.
//!
//! A stalled snapshot service never blocks a stream: the forwarder stops sending once
//! `MAX_INFLIGHT` batches are unacknowledged and keeps coalescing; past `max_buffered` distinct
//! requests it drops the oldest progress and asks those workers for a full state. On every
//! (re)connect, and when an ack shows a new epoch, it re-sends every live worker's Hello first
//! and asks every worker for a full state, so σ is rebuilt.
//!
//! The stream itself comes from an [`ApplyLink`]: gRPC to `--snapshot-addr` ([`GrpcApply`],
//! the split deployment) or the snapshot service's handler in-process (the all-in-one
//! `br-all`). Either way the batches, acks, refusals, epochs and reconnects are this code's.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use br_proto::v1;
use br_proto::valid::GroupId;
use br_runtime::admin::Readiness;
use futures::future::BoxFuture;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt as _};
use tokio_util::sync::CancellationToken;

use crate::change::Change;
use crate::coalesce::{Coalescer, into_batches};
use crate::metrics::Metrics;
use crate::registry::Registry;

mod link;

use link::run_link;

#[cfg(test)]
mod tests;

/// Most changes in one ChangeBatch (keeps each message well under 4 MiB).
pub const MAX_CHANGES_PER_BATCH: usize = 4096;
/// Most unacknowledged batches on the Apply stream.
pub const MAX_INFLIGHT: u64 = 64;
/// Capacity of the channel from the streams to the forwarder (messages, not changes).
pub const INPUT_QUEUE: usize = 4096;

/// The changes of one telemetry message.
#[derive(Debug)]
pub struct Input {
    pub group: GroupId,
    pub changes: Vec<Change>,
    /// The span of the telemetry message these changes came from, when traces are exported:
    /// the span of the batch that carries them to the snapshot service continues its trace.
    pub trace: Option<br_trace::SpanContext>,
}

/// Most message spans one batch span names (its parent, then links); beyond it, messages
/// of the same tick are not linked.
const MAX_TRACES_PER_BATCH: usize = 32;

/// Forwarder settings.
#[derive(Clone)]
pub struct ForwarderConfig {
    /// Where the Apply stream goes.
    pub upstream: Arc<dyn ApplyLink>,
    pub batch_interval: Duration,
    /// Shortest time between two batches while the link is idle (`--batch-spacing`).
    pub batch_spacing: Duration,
    pub max_buffered: usize,
    /// This replica's identity (`--ingest-id`), sent on every batch.
    pub ingest_id: String,
}

impl std::fmt::Debug for ForwarderConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForwarderConfig")
            .field("upstream", &self.upstream.describe())
            .field("batch_interval", &self.batch_interval)
            .field("batch_spacing", &self.batch_spacing)
            .field("max_buffered", &self.max_buffered)
            .field("ingest_id", &self.ingest_id)
            .finish()
    }
}

/// The batches of one Apply stream, as the forwarder sends them. A named type rather than a
/// bare trait object: tonic's client-streaming future over a `dyn Stream` cannot be proven
/// `Send` by today's compiler (a "higher-ranked lifetime error"), over this it can.
pub struct Batches(Pin<Box<dyn Stream<Item = v1::ChangeBatch> + Send>>);

impl Batches {
    pub fn new(s: impl Stream<Item = v1::ChangeBatch> + Send + 'static) -> Batches {
        Batches(Box::pin(s))
    }
}

impl std::fmt::Debug for Batches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Batches")
    }
}

impl Stream for Batches {
    type Item = v1::ChangeBatch;

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<v1::ChangeBatch>> {
        self.0.as_mut().poll_next(cx)
    }
}
/// The acks of one Apply stream (an `Err` ends it).
pub type Acks = Pin<Box<dyn Stream<Item = Result<v1::ApplyAck, tonic::Status>> + Send>>;

/// Why an Apply stream could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The snapshot service cannot be reached (retried quietly with backoff).
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// It answered the call with an error.
    #[error("refused: {0}")]
    Refused(tonic::Status),
}

/// Opens `Snapshot.Apply` streams: the seam between ingest and the snapshot service.
pub trait ApplyLink: Send + Sync + 'static {
    /// Opens one stream that carries `batches` in order; its acks come back one per batch.
    fn open(&self, batches: Batches) -> BoxFuture<'static, Result<Acks, OpenError>>;
    /// Where the stream goes, for logs.
    fn describe(&self) -> String;
}

/// [`ApplyLink`] over gRPC: a connection per stream (mutual TLS as the ingest role, the
/// server verified as the snapshot role, when `tls` is given).
#[derive(Debug, Clone)]
pub struct GrpcApply {
    endpoint: tonic::transport::Endpoint,
    tls: Option<Arc<br_trust::TlsMaterial>>,
}

impl GrpcApply {
    pub fn new(
        snapshot_addr: &str,
        tls: Option<Arc<br_trust::TlsMaterial>>,
    ) -> Result<GrpcApply, br_trust::address::EndpointError> {
        let endpoint = br_trust::address::endpoint(snapshot_addr, tls.is_some())?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            // the same keepalive as the servers' defaults: a half-open link to the snapshot
            // service is found from this side too within 8 s
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(3));
        Ok(GrpcApply { endpoint, tls })
    }
}

impl ApplyLink for GrpcApply {
    fn open(&self, batches: Batches) -> BoxFuture<'static, Result<Acks, OpenError>> {
        Box::pin(open_grpc(self.endpoint.clone(), self.tls.clone(), batches))
    }

    fn describe(&self) -> String {
        self.endpoint.uri().to_string()
    }
}

/// [`GrpcApply::open`]: a fresh connection per stream (a lazy channel, which connects on
/// the call: the connector then runs in the channel's own task), then the call. A connection
/// that cannot be made answers UNAVAILABLE: unreachable, retried quietly.
async fn open_grpc(
    endpoint: tonic::transport::Endpoint,
    tls: Option<Arc<br_trust::TlsMaterial>>,
    batches: Batches,
) -> Result<Acks, OpenError> {
    let snapshot = Some(br_trust::Role::Snapshot);
    let channel = br_trust::tls::connect_lazy(endpoint, tls.as_ref(), snapshot);
    let mut client = v1::snapshot_client::SnapshotClient::new(br_trace::traced(channel))
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX);
    match client.apply(batches).await {
        Ok(acks) => Ok(Box::pin(acks.into_inner())),
        Err(status) if status.code() == tonic::Code::Unavailable => {
            Err(OpenError::Unreachable(status.to_string()))
        }
        Err(status) => Err(OpenError::Refused(status)),
    }
}

/// What the streams need from the forwarder.
#[derive(Debug, Clone)]
pub struct ForwarderHandle {
    /// Where streams send their changes.
    pub tx: mpsc::Sender<Input>,
    /// Whether the Apply stream is up (acks say OK, else BUFFERED).
    pub connected: Arc<AtomicBool>,
}

/// Per change of a sent batch, the worker it is about: `Some((worker_id, incarnation))` for
/// changes of a live stream (Hello, progress, full state), `None` for a disconnect (its stream
/// is gone; a refusal of it ends nothing).
type BatchWorkers = Vec<Option<(u32, u64)>>;

/// A batch on its way to the link, with what the link needs to relay refusals.
type Outgoing = (v1::ChangeBatch, BatchWorkers);

enum LinkEvent {
    Up {
        tx: mpsc::Sender<Outgoing>,
        acked: Arc<AtomicU64>,
    },
    NewEpoch(u64),
    Down,
}

struct Link {
    tx: mpsc::Sender<Outgoing>,
    acked: Arc<AtomicU64>,
    sent: u64,
}

impl Link {
    /// Batches sent and not yet acknowledged.
    fn inflight(&self) -> u64 {
        self.sent.saturating_sub(self.acked.load(Ordering::Relaxed))
    }
}

/// Starts the forwarder and its link; both stop when `shutdown` is cancelled.
pub fn spawn(
    cfg: ForwarderConfig,
    registry: Registry,
    metrics: Metrics,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> (ForwarderHandle, JoinHandle<()>) {
    let (in_tx, in_rx) = mpsc::channel(INPUT_QUEUE);
    let (ev_tx, ev_rx) = mpsc::channel(8);
    let connected = Arc::new(AtomicBool::new(false));
    // Notified by the link on every ack, whichever stream carried it.
    let acks = Arc::new(tokio::sync::Notify::new());
    let link = tokio::spawn(run_link(
        Arc::clone(&cfg.upstream),
        ev_tx,
        Arc::clone(&acks),
        registry.clone(),
        metrics.clone(),
        shutdown.clone(),
    ));
    let fwd = Forwarder {
        buf: Coalescer::new(cfg.max_buffered),
        pending: VecDeque::new(),
        pending_changes: 0,
        link: None,
        registry,
        metrics,
        readiness,
        connected: connected.clone(),
        ingest_id: cfg.ingest_id.clone(),
        traces: Vec::new(),
    };
    let task = tokio::spawn(async move {
        fwd.run(
            in_rx,
            ev_rx,
            &acks,
            cfg.batch_interval,
            cfg.batch_spacing,
            shutdown,
        )
        .await;
        let _ = link.await;
    });
    (
        ForwarderHandle {
            tx: in_tx,
            connected,
        },
        task,
    )
}

struct Forwarder {
    buf: Coalescer,
    /// Batches taken from `buf` but not yet sent (batch_seq is given when sent).
    pending: VecDeque<(GroupId, Vec<Change>)>,
    pending_changes: usize,
    link: Option<Link>,
    registry: Registry,
    metrics: Metrics,
    readiness: Readiness,
    connected: Arc<AtomicBool>,
    ingest_id: String,
    /// Per group, the spans of the messages absorbed since its last batch went out (at most
    /// `MAX_TRACES_PER_BATCH`; empty unless traces are exported).
    traces: Vec<(GroupId, Vec<br_trace::SpanContext>)>,
}

impl Forwarder {
    async fn run(
        mut self,
        mut inputs: mpsc::Receiver<Input>,
        mut events: mpsc::Receiver<LinkEvent>,
        acks: &tokio::sync::Notify,
        interval: Duration,
        spacing: Duration,
        shutdown: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut batch: Vec<Input> = Vec::with_capacity(256);
        let mut last_flush = tokio::time::Instant::now();
        let mut dropped = Vec::new();
        loop {
            // Woken by the link's acks only while something waits for them (a permit left by
            // an ack while the forwarder was busy is kept: none is lost between turns).
            let acks_awaited = self.link.is_some() && self.has_work();
            // The link idle and work waiting, but too soon after the last batch: sent when
            // the spacing has passed.
            let spaced_at = last_flush + spacing;
            let spacing_awaited =
                acks_awaited && self.link_idle() && tokio::time::Instant::now() < spaced_at;
            let mut early = false;
            tokio::select! {
                biased;
                () = shutdown.cancelled() => {
                    // Best effort: what can go out now goes out.
                    while let Ok(input) = inputs.try_recv() {
                        self.absorb(input, &mut dropped);
                    }
                    self.flush();
                    self.set_connected(false);
                    return;
                }
                ev = events.recv() => match ev {
                    Some(ev) => self.on_link(ev),
                    None => return,
                },
                // Before the inputs: under a steady flood of input the tick must still fire.
                // Polled only while something waits to go out (or for room on the link), so
                // an idle ingest does not wake every interval: at the 2 ms default that was
                // ~500 wakeups a second of a process with nothing to do.
                _ = tick.tick(), if self.has_work() => {
                    self.flush();
                    last_flush = tokio::time::Instant::now();
                }
                // The spacing has passed, an ack came or changes came in: each a moment a
                // batch may go before the tick.
                () = tokio::time::sleep_until(spaced_at), if spacing_awaited => early = true,
                () = acks.notified(), if acks_awaited && !spacing_awaited => early = true,
                n = inputs.recv_many(&mut batch, 256) => {
                    if n == 0 {
                        return;
                    }
                    for input in batch.drain(..) {
                        self.absorb(input, &mut dropped);
                    }
                    early = true;
                }
            }
            // Nothing unacknowledged and the spacing passed (or a whole interval since the
            // last flush, when acks are slow): send at once rather than wait for the tick.
            let since = last_flush.elapsed();
            if early && ((self.link_idle() && since >= spacing) || since >= interval) {
                self.flush();
                last_flush = tokio::time::Instant::now();
                // The next tick an interval after this flush, not at the deadline the paused
                // tick kept (which may have passed).
                tick.reset();
            }
            if !dropped.is_empty() {
                self.metrics.dropped_changes.inc_by(dropped.len() as u64);
                dropped.sort_unstable();
                dropped.dedup();
                for w in dropped.drain(..) {
                    self.registry.request_full_state(&w);
                }
            }
            self.metrics
                .buffered_changes
                .set((self.buf.len() + self.pending_changes) as i64);
        }
    }

    /// Whether changes wait to go out (buffered, or taken into batches the link had no room
    /// for yet).
    fn has_work(&self) -> bool {
        !self.buf.is_empty() || !self.pending.is_empty()
    }

    /// Whether the link is up with every batch sent on it acknowledged.
    fn link_idle(&self) -> bool {
        self.link.as_ref().is_some_and(|l| l.inflight() == 0)
    }

    fn absorb(&mut self, input: Input, dropped: &mut Vec<crate::coalesce::WorkerRef>) {
        if let Some(t) = input.trace {
            match self.traces.iter_mut().find(|(g, _)| *g == input.group) {
                Some((_, v)) if v.len() < MAX_TRACES_PER_BATCH => v.push(t),
                Some(_) => {}
                None => self.traces.push((input.group.clone(), vec![t])),
            }
        }
        for c in input.changes {
            self.buf.push(&input.group, c, dropped);
        }
    }

    fn set_connected(&self, up: bool) {
        self.connected.store(up, Ordering::Relaxed);
        self.readiness.set(up);
        self.metrics.snapshot_connected.set(i64::from(up));
    }

    fn on_link(&mut self, ev: LinkEvent) {
        match ev {
            LinkEvent::Up { tx, acked } => {
                tracing::info!("Apply stream to the snapshot service is up");
                self.link = Some(Link { tx, acked, sent: 0 });
                self.resync();
                self.set_connected(true);
                self.flush();
            }
            LinkEvent::NewEpoch(epoch) => {
                tracing::info!(epoch, "snapshot service has a new epoch; rebuilding σ");
                self.resync();
                self.flush();
            }
            LinkEvent::Down => {
                tracing::warn!("Apply stream to the snapshot service is down; buffering");
                self.link = None;
                self.set_connected(false);
            }
        }
    }

    /// Every live worker's Hello goes first, and every worker is asked for a full state.
    fn resync(&mut self) {
        let mut by_group: Vec<(GroupId, Vec<Change>)> = Vec::new();
        for h in self.registry.live_hellos() {
            let c = Change::hello(&h);
            match by_group.iter_mut().find(|(g, _)| *g == h.group) {
                Some((_, v)) => v.push(c),
                None => by_group.push((h.group.clone(), vec![c])),
            }
        }
        for (g, changes) in by_group.into_iter().rev() {
            self.pending_changes += changes.len();
            self.pending.push_front((g, changes));
        }
        self.registry.request_full_state_all();
    }

    /// Sends what the link can take now: prepared batches first, then the buffer.
    fn flush(&mut self) {
        let Some(link) = self.link.as_mut() else {
            return;
        };
        loop {
            if self.pending.is_empty() {
                if self.buf.is_empty() {
                    return;
                }
                let taken = self.buf.take(MAX_CHANGES_PER_BATCH * 4);
                for b in into_batches(taken, MAX_CHANGES_PER_BATCH) {
                    self.pending_changes += b.1.len();
                    self.pending.push_back(b);
                }
            }
            while let Some((group, changes)) = self.pending.front() {
                if link.inflight() >= MAX_INFLIGHT || link.tx.capacity() == 0 {
                    return;
                }
                let traces = match self.traces.iter().position(|(g, _)| g == group) {
                    Some(i) => self.traces.swap_remove(i).1,
                    None => Vec::new(),
                };
                let span = batch_span(group, changes.len(), traces);
                let trace = br_trace::W3c::of(&span);
                let batch = v1::ChangeBatch {
                    batch_seq: link.sent + 1,
                    group: group.as_str().to_owned(),
                    changes: changes.iter().map(Change::to_wire).collect(),
                    ingest_id: self.ingest_id.clone(),
                    traceparent: trace.traceparent,
                    tracestate: trace.tracestate,
                };
                let workers = changes
                    .iter()
                    .map(|c| match c {
                        Change::Disconnected { .. } => None,
                        c => Some(c.worker()),
                    })
                    .collect();
                match link.tx.try_send((batch, workers)) {
                    Ok(()) => {
                        link.sent += 1;
                        self.metrics.batches_sent.inc();
                        if let Some((_, changes)) = self.pending.pop_front() {
                            self.pending_changes -= changes.len();
                        }
                    }
                    Err(mpsc::error::TrySendError::Full(_)) => return,
                    Err(mpsc::error::TrySendError::Closed(_)) => {
                        // The link is going down; its Down event follows.
                        self.link = None;
                        return;
                    }
                }
            }
        }
    }
}

/// The span of one ChangeBatch sent (disabled, and free, when traces are not exported): a
/// producer span, child of the first message span whose changes it carries and linking the
/// others (a batch coalesces many messages, which parentage cannot say). Its context goes in
/// the batch, so the snapshot service's span applying it is in the same trace.
fn batch_span(
    group: &GroupId,
    changes: usize,
    traces: Vec<br_trace::SpanContext>,
) -> tracing::Span {
    if !br_trace::enabled() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        parent: None,
        "forward_batch",
        otel.name = "balanceroute.v1.Snapshot/Apply batch",
        otel.kind = "producer",
        group = %group,
        changes,
    );
    let mut traces = traces.into_iter();
    if let Some(first) = traces.next() {
        br_trace::child_of(&span, first);
    }
    br_trace::add_links(&span, traces);
    span
}
