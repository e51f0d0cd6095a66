//! `Telemetry.Report`: one task per stream drives a [`Session`], acks every message without
//! waiting for the snapshot service, and hands the changes to the forwarder.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use br_proto::v1;
use br_proto::v1::worker_report::Kind;
use br_proto::valid::{GroupId, ValidHello};
use br_runtime::error::ServiceError as _;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::change::Change;
use crate::error::StreamError;
use crate::forward::{ForwarderHandle, Input};
use crate::metrics::Metrics;
use crate::registry::{Refusal, Registration, Registry};
use crate::session::{Limits, Session, Step};

/// Acks queued towards one worker.
const ACK_QUEUE: usize = 64;
/// Longest a stream waits for room in the forwarder's queue before it gives up on a message
/// (acking it with a full-state request instead): a busy forwarder slows a shim down a little,
/// never for long.
const FORWARD_TIMEOUT: Duration = Duration::from_millis(100);

/// How late the idle timer may fire before the lateness is taken for a pause of this process
/// rather than the peer's silence (a loaded process wakes its timers milliseconds late; a
/// host that stops the VM, seconds).
const PAUSE_TOLERANCE: Duration = Duration::from_secs(1);

/// How long a stream may stay silent (`--hello-timeout`, `--stream-idle-timeout`).
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// From the stream's opening to its Hello.
    pub hello: Duration,
    /// Between two messages after the Hello; `None`: no limit.
    pub idle: Option<Duration>,
}

/// The Telemetry service. Cheap to clone.
#[derive(Clone, Debug)]
pub struct TelemetryService {
    inner: Arc<TelemetryParts>,
}

/// What a [`TelemetryService`] is made of, all set at start.
#[derive(Debug)]
pub struct TelemetryParts {
    pub limits: Limits,
    pub timeouts: Timeouts,
    /// `--max-worker-id`: a Hello above it is refused.
    pub max_worker_id: u32,
    /// `--group`: the groups this ingest takes (`None`: any).
    pub allowed_groups: Option<HashSet<String>>,
    /// The live streams, one per worker.
    pub registry: Registry,
    pub forwarder: ForwarderHandle,
    pub metrics: Metrics,
    pub shutdown: CancellationToken,
    /// `--message-span-every`: with traces exported, one Progress message in this many (per
    /// stream) that no reporter traced gets a span; 0: none.
    pub message_span_every: u64,
}

impl TelemetryService {
    pub fn new(parts: TelemetryParts) -> Self {
        TelemetryService {
            inner: Arc::new(parts),
        }
    }
}

type AckResult = Result<v1::ReportAck, tonic::Status>;

#[tonic::async_trait]
impl v1::telemetry_server::Telemetry for TelemetryService {
    type ReportStream = ReceiverStream<AckResult>;

    async fn report(
        &self,
        request: tonic::Request<tonic::Streaming<v1::WorkerReport>>,
    ) -> Result<tonic::Response<Self::ReportStream>, tonic::Status> {
        // Under mutual TLS the authorisation layer has put the caller's identity here: a
        // worker certificate admits Hellos for that one worker only.
        let caller = br_trust::policy::caller(&request).cloned();
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(ACK_QUEUE);
        let inner = self.inner.clone();
        tokio::spawn(async move {
            inner.metrics.streams.inc();
            run_stream(&inner, caller, inbound, tx).await;
            inner.metrics.streams.dec();
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// tonic reports a message above `max_decoding_message_size` as OUT_OF_RANGE.
fn is_too_large(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::OutOfRange
}

impl TelemetryParts {
    async fn end(&self, tx: &mpsc::Sender<AckResult>, e: StreamError) {
        if e.is_timeout() {
            self.metrics
                .stream_timeouts
                .with_label_values(&[e.reason()])
                .inc();
        } else {
            self.metrics.reject(e.reason());
        }
        tracing::debug!(error = %e, "ending telemetry stream");
        let _ = tx.send(Err(e.to_status())).await;
    }

    /// Hands changes to the forwarder; false if it stayed full for too long.
    async fn forward(
        &self,
        group: &GroupId,
        changes: Vec<Change>,
        trace: Option<br_trace::SpanContext>,
    ) -> bool {
        let input = Input {
            group: group.clone(),
            changes,
            trace,
        };
        self.forwarder
            .tx
            .send_timeout(input, FORWARD_TIMEOUT)
            .await
            .is_ok()
    }

    fn status_ok(&self) -> v1::AckStatus {
        if self.forwarder.connected.load(Ordering::Relaxed) {
            v1::AckStatus::Ok
        } else {
            v1::AckStatus::Buffered
        }
    }

    /// Waits for the Hello and checks it. `None`: the stream is over.
    async fn accept_hello(
        &self,
        caller: Option<&br_trust::Identity>,
        inbound: &mut tonic::Streaming<v1::WorkerReport>,
        tx: &mpsc::Sender<AckResult>,
    ) -> Option<ValidHello> {
        let after = self.timeouts.hello;
        let first = tokio::select! {
            m = inbound.message() => m,
            () = self.shutdown.cancelled() => {
                self.end(tx, StreamError::ShuttingDown).await;
                return None;
            }
            () = tokio::time::sleep(after) => {
                tracing::info!(after = ?after, "telemetry stream ended: no Hello in time");
                self.end(tx, StreamError::HelloTimeout { after }).await;
                return None;
            }
        };
        let msg = match first {
            Ok(Some(m)) => m,
            Ok(None) => return None,
            Err(s) if is_too_large(&s) => {
                self.end(tx, StreamError::MessageTooLarge(s.message().to_owned()))
                    .await;
                return None;
            }
            Err(_) => return None,
        };
        self.metrics.messages.inc();
        let hello = match msg.kind {
            Some(Kind::Hello(h)) => match ValidHello::try_from(h) {
                Ok(h) => h,
                Err(e) => {
                    self.end(tx, StreamError::InvalidHello(e)).await;
                    return None;
                }
            },
            _ => {
                self.end(tx, StreamError::FirstNotHello).await;
                return None;
            }
        };
        if hello.worker_id > self.max_worker_id {
            self.end(
                tx,
                StreamError::WorkerIdOutOfRange {
                    worker_id: hello.worker_id,
                    max: self.max_worker_id,
                },
            )
            .await;
            return None;
        }
        if let Some(allowed) = &self.allowed_groups
            && !allowed.contains(hello.group.as_str())
        {
            self.end(tx, StreamError::GroupNotAllowed(hello.group.to_string()))
                .await;
            return None;
        }
        if let Some(id) = caller {
            let own = id
                .worker
                .as_ref()
                .is_some_and(|slot| slot.admits(hello.group.as_str(), hello.worker_id));
            if !own {
                let e = StreamError::NotYourWorker {
                    certified: id.spiffe_id.clone(),
                    own: id.worker.as_ref().map_or_else(
                        || format!("no worker (role {})", id.role),
                        ToString::to_string,
                    ),
                    group: hello.group.to_string(),
                    worker_id: hello.worker_id,
                };
                tracing::warn!(error = %e, "telemetry stream refused");
                self.end(tx, e).await;
                return None;
            }
        }
        Some(hello)
    }
}

async fn run_stream(
    inner: &TelemetryParts,
    caller: Option<br_trust::Identity>,
    mut inbound: tonic::Streaming<v1::WorkerReport>,
    tx: mpsc::Sender<AckResult>,
) {
    let Some(hello) = inner.accept_hello(caller.as_ref(), &mut inbound, &tx).await else {
        return;
    };
    let reg = match inner.registry.register(&hello) {
        Ok(reg) => reg,
        Err(live) => {
            let e = StreamError::AlreadyConnected {
                group: hello.group.to_string(),
                worker_id: hello.worker_id,
                incarnation: hello.incarnation,
                live,
            };
            tracing::warn!(error = %e, "second telemetry stream for a live worker refused");
            inner.end(&tx, e).await;
            return;
        }
    };
    tracing::info!(group = %hello.group, worker = hello.worker_id, incarnation = hello.incarnation,
        capacity = hello.capacity, "worker connected");
    let group = hello.group.clone();
    let forwarded = inner
        .forward(&group, vec![Change::hello(&hello)], None)
        .await;
    if !forwarded {
        inner.metrics.reject("overloaded");
    }
    let ack = v1::ReportAck {
        seq: 0,
        status: inner.status_ok() as i32,
        detail: String::new(),
        full_state_requested: !forwarded,
    };
    if tx.send(Ok(ack)).await.is_ok() {
        let span = tracing::info_span!("report", group = %hello.group, worker = hello.worker_id,
            incarnation = hello.incarnation);
        let session = Session::new(hello, inner.limits, Instant::now());
        serve_session(inner, &mut inbound, &tx, session, &reg)
            .instrument(span)
            .await;
    }

    inner.registry.unregister(&reg);
    let (group, worker_id, incarnation) = reg.key.clone();
    if inner.shutdown.is_cancelled() {
        // This replica is going away, not the worker: its shim reconnects to another replica.
        // No disconnect is reported; the end of the Apply stream tells the snapshot service,
        // which keeps the worker routable for its carrier grace meanwhile.
        tracing::info!(group = %group, worker = worker_id, incarnation,
            "stream ended by shutdown; the worker reconnects elsewhere");
        return;
    }
    tracing::info!(group = %group, worker = worker_id, incarnation, "worker disconnected");
    let gone = Change::Disconnected {
        worker_id,
        incarnation,
        at_unix_ms: unix_ms(),
    };
    if !inner.forward(&group, vec![gone], None).await {
        // The snapshot service also notices through the worker's missing progress and, on a
        // restart of this ingest, through the end of the Apply stream.
        inner.metrics.reject("overloaded");
        tracing::warn!(group = %group, worker = worker_id, "could not forward a disconnect");
    }
}

/// The span of one Progress message (a telemetry batch), when traces are exported: in the
/// trace the message names (its reporter's span), or a root of its own, never a child of the
/// stream's span (a stream lives for hours; one trace per batch). The batch span carrying its
/// changes to the snapshot service continues it.
///
/// Sampled, not one per message: with one update per message, 100k progress events/s made
/// 100k root traces a second for the collector to take, each a span created, recorded and
/// exported by this process, for batches nobody traced. A message its
/// reporter traced (a `traceparent`: the shim's own sampler chose it) continues that trace;
/// of the others, only the `nth` (per stream, from 0) that is a multiple of `every` gets a
/// root span of its own (`--message-span-every`; 0: none). Errors stay events on the
/// stream's span, which every message still runs under.
fn message_span(msg: &v1::WorkerReport, hello: &ValidHello, nth: u64, every: u64) -> tracing::Span {
    if !br_trace::enabled() {
        return tracing::Span::none();
    }
    let Some(Kind::Progress(p)) = &msg.kind else {
        return tracing::Span::none();
    };
    let parent = br_trace::W3c::context_of(&p.traceparent, &p.tracestate);
    if parent.is_none() && (every == 0 || !nth.is_multiple_of(every)) {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        parent: None,
        "report_batch",
        otel.name = "balanceroute.v1.Telemetry/Report batch",
        otel.kind = "consumer",
        group = %hello.group,
        worker = hello.worker_id,
        seq = p.seq,
        updates = p.updates.len(),
        full_state = p.full_state,
    );
    // the reporter's (a shim's) span of this message, when it sends one, is the root
    br_trace::continue_trace(&span, parent);
    span
}

/// The stream-ending error for a refusal of `hello`'s worker.
fn refused_error(hello: &ValidHello, r: Refusal) -> StreamError {
    let (group, worker_id, incarnation) =
        (hello.group.to_string(), hello.worker_id, hello.incarnation);
    match r.reason {
        v1::RejectReason::ConnectedElsewhere => StreamError::ConnectedElsewhere {
            group,
            worker_id,
            incarnation,
            detail: r.detail,
        },
        reason => StreamError::RefusedBySnapshot {
            group,
            worker_id,
            incarnation,
            reason: reason.label(),
            detail: r.detail,
        },
    }
}

async fn serve_session(
    inner: &TelemetryParts,
    inbound: &mut tonic::Streaming<v1::WorkerReport>,
    tx: &mpsc::Sender<AckResult>,
    mut session: Session,
    reg: &Registration,
) {
    let group = session.hello().group.clone();
    let mut refused = reg.refused.clone();
    // Re-armed each time the stream is read again: only the peer's silence counts, not the
    // time this task spent handling a message or waiting for room in the ack queue.
    // (Without a limit the branch below is disabled and the timer never polled.)
    let idle = inner.timeouts.idle;
    // Progress messages of this stream so far (which ones get a span: see `message_span`).
    let mut progress_seen: u64 = 0;
    let silence = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(silence);
    loop {
        if let Some(idle) = idle {
            silence.as_mut().reset(tokio::time::Instant::now() + idle);
        }
        let next = tokio::select! {
            biased;
            () = inner.shutdown.cancelled() => {
                inner.end(tx, StreamError::ShuttingDown).await;
                return;
            }
            () = &mut silence, if idle.is_some() => {
                // Fired well after its deadline: this process was not running when the limit
                // passed (a host that stopped the VM for seconds, a debugger), and a peer on
                // the same host was most likely stopped with it. Its silence is not proven:
                // the window starts again now that this process runs.
                let late = tokio::time::Instant::now().saturating_duration_since(silence.deadline());
                if late > PAUSE_TOLERANCE {
                    tracing::info!(late = ?late, "the stream's idle limit passed while this process was not running; a new window");
                    continue;
                }
                // Ended like a dropped stream: the caller unregisters the worker and tells
                // the snapshot service it disconnected (its grace and fencing follow).
                let after = idle.unwrap_or_default();
                tracing::warn!(after = ?after, "telemetry stream silent for too long; ending it");
                inner.end(tx, StreamError::Idle { after }).await;
                return;
            }
            // (the guard `wait_for` returns is not Send: cloned out inside the future)
            r = async { refused.wait_for(Option::is_some).await.ok().and_then(|r| r.clone()) } => Err(r),
            m = inbound.message() => Ok(m),
        };
        let next = match next {
            Ok(m) => m,
            Err(refusal) => {
                // The snapshot service refused this worker's changes: what this stream
                // acknowledged may not be in σ, so the stream ends saying why and the shim
                // says Hello again (never ACK_OK for changes σ dropped).
                if let Some(e) = refusal.map(|r| refused_error(session.hello(), r)) {
                    tracing::warn!(error = %e, "snapshot service refused a worker; ending its stream");
                    inner.end(tx, e).await;
                }
                return;
            }
        };
        let msg = match next {
            Ok(Some(m)) => m,
            Ok(None) => return,
            Err(s) if is_too_large(&s) => {
                inner
                    .end(tx, StreamError::MessageTooLarge(s.message().to_owned()))
                    .await;
                return;
            }
            Err(s) => {
                tracing::debug!(status = %s, "telemetry stream broke");
                return;
            }
        };
        inner.metrics.messages.inc();
        let is_progress = matches!(msg.kind, Some(Kind::Progress(_)));
        let span = message_span(
            &msg,
            session.hello(),
            progress_seen,
            inner.message_span_every,
        );
        progress_seen += u64::from(is_progress);
        let trace = br_trace::span_context(&span);
        let reply = match span.in_scope(|| session.on_message(msg, Instant::now())) {
            Step::Reply(r) => r,
            Step::End(e) => {
                inner.end(tx, e).await;
                return;
            }
        };
        let mut full_state = reply.full_state_requested;
        let mut status = reply.status;
        let mut detail = String::new();
        if let Some(rej) = reply.rejection {
            inner.metrics.reject(rej.reason);
            detail = rej.detail;
        }
        if reply.events > 0 {
            inner.metrics.progress_events.inc_by(reply.events);
        }
        if let Some(h) = &reply.new_hello {
            inner.registry.update_hello(reg, h);
        }
        if !reply.changes.is_empty() && !inner.forward(&group, reply.changes, trace).await {
            inner.metrics.reject("overloaded");
            full_state = true;
            status = v1::AckStatus::Buffered;
            detail =
                "ingest is overloaded; the state is repaired by the full state asked for".into();
        }
        if status == v1::AckStatus::Ok {
            status = inner.status_ok();
        }
        // Taken last, so a request raised while this message was handled is not lost.
        full_state |= reg.full_state.swap(false, Ordering::Relaxed);
        let ack = v1::ReportAck {
            seq: reply.seq,
            status: status as i32,
            detail,
            full_state_requested: full_state,
        };
        // A worker that does not read its acks only slows itself down; it never holds up a
        // shutdown.
        tokio::select! {
            r = tx.send(Ok(ack)) => if r.is_err() { return },
            () = inner.shutdown.cancelled() => {
                inner.end(tx, StreamError::ShuttingDown).await;
                return;
            }
        }
    }
}
