//! The `balanceroute.v1.Snapshot` gRPC handlers: the edge. Each parses its request into
//! domain types (`br_proto::valid`, `crate::wire`), asks the writer, and builds the answer.

use std::collections::VecDeque;
use std::future::Future as _;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;

use br_proto::v1;
use br_proto::v1::snapshot_server::Snapshot;
use br_proto::valid::{GroupId, ValidRelease, ValidReserve, ValidSetCordon, ValidWatch};
use br_runtime::error::ServiceError as _;
use futures::{Stream, StreamExt as _};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::error::SnapshotError;
use crate::group::{Applied, Event, Reject};
use crate::metrics::Metrics;
use crate::wire;
use crate::writer::{Command, WriterHandle};

/// Acks queued towards one Apply stream.
const ACK_QUEUE: usize = 64;

/// Calls in flight on one ReserveStream (see `Snapshot.ReserveStream`): past it the stream is
/// not read until some are answered.
pub const RESERVE_STREAM_IN_FLIGHT: usize = 1024;

/// The Snapshot service. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SnapshotService {
    writer: WriterHandle,
    metrics: Metrics,
    shutdown: CancellationToken,
    next_stream: Arc<AtomicU64>,
    /// One permit per open Watch stream (`--max-watchers`), held by the stream.
    watchers: Arc<tokio::sync::Semaphore>,
    max_watchers: usize,
}

impl SnapshotService {
    pub fn new(
        writer: WriterHandle,
        metrics: Metrics,
        max_watchers: usize,
        shutdown: CancellationToken,
    ) -> Self {
        SnapshotService {
            writer,
            metrics,
            shutdown,
            next_stream: Arc::new(AtomicU64::new(1)),
            watchers: Arc::new(tokio::sync::Semaphore::new(max_watchers)),
            max_watchers,
        }
    }

    /// Counts and converts a whole-call failure.
    fn fail(&self, e: SnapshotError) -> Status {
        if matches!(e, SnapshotError::Invalid(_)) {
            self.metrics.reject(v1::RejectReason::Invalid.label());
        }
        tracing::debug!(error = %e, reason = e.reason(), "call rejected");
        e.into()
    }
}

impl SnapshotService {
    /// One Watch subscription's events as the writer shares them among its watchers (each
    /// delta and snapshot one allocation, behind an `Arc`): what `Snapshot.Watch` encodes for
    /// a gRPC watcher, and what br-all's in-process watchers read as they are. Same
    /// validation, watcher bound, queue bounds and merging either way.
    pub async fn watch_shared(&self, req: v1::WatchRequest) -> Result<BoxStream<Event>, Status> {
        let req = ValidWatch::try_from(req).map_err(|e| self.fail(e.into()))?;
        let Ok(permit) = Arc::clone(&self.watchers).try_acquire_owned() else {
            self.metrics.refuse("max_watchers");
            return Err(self.fail(SnapshotError::TooManyWatchers {
                max: self.max_watchers,
            }));
        };
        let group = req.group.as_str().to_owned();
        let rx = self
            .writer
            .call(|reply| Command::Watch { req, reply })
            .await
            .and_then(|r| r)
            .map_err(|e| self.fail(e))?;
        // The writer ends the stream (drops the queue's sender) on shutdown; a queue that went
        // over its bytes yields its overflow, which ends the stream RESOURCE_EXHAUSTED.
        // The permit goes with the stream: released when the watcher goes away or is ended.
        // Deltas queued behind each other go out merged (one message for several versions,
        // see `group::queue::Merging`).
        let deltas = self.metrics.watch_deltas(&group);
        let stream = rx.merging().map(move |ev| match ev {
            Ok(ev) => {
                let _held = &permit;
                if let Event::Delta(d) = &ev {
                    deltas.sent(d.prev_version, d.version);
                }
                Ok(ev)
            }
            Err(o) => {
                let e = SnapshotError::WatcherTooSlow {
                    bytes: o.bytes,
                    max: o.max_bytes,
                };
                tracing::debug!(error = %e, "Watch stream ended");
                Err(e.into())
            }
        });
        Ok(Box::pin(stream))
    }
}

/// A response stream of the service (Watch events, Apply acks).
pub type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Snapshot for SnapshotService {
    type WatchStream = BoxStream<v1::WatchEvent>;

    #[tracing::instrument(skip_all, fields(group = %req.get_ref().group, epoch = req.get_ref().epoch, last_version = req.get_ref().last_version))]
    async fn watch(
        &self,
        req: Request<v1::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let events = self.watch_shared(req.into_inner()).await?;
        let stream = events.map(|ev| ev.map(|ev| wire::watch_event(&ev)));
        Ok(Response::new(Box::pin(stream)))
    }

    #[tracing::instrument(skip_all, fields(group = %req.get_ref().group))]
    async fn get(
        &self,
        req: Request<v1::GetRequest>,
    ) -> Result<Response<v1::ClusterSnapshot>, Status> {
        let group = GroupId::new(&req.into_inner().group).map_err(|e| self.fail(e.into()))?;
        let name = group.clone();
        let snap = self
            .writer
            .call(|reply| Command::Get { group, reply })
            .await
            .map_err(|e| self.fail(e))?
            .unwrap_or_else(|| wire::empty_snapshot(name.as_str(), self.writer.epoch()));
        Ok(Response::new(snap))
    }

    type ApplyStream = BoxStream<v1::ApplyAck>;

    async fn apply(
        &self,
        req: Request<Streaming<v1::ChangeBatch>>,
    ) -> Result<Response<Self::ApplyStream>, Status> {
        Ok(Response::new(self.apply_stream(req.into_inner())))
    }

    #[tracing::instrument(skip_all, fields(group = %req.get_ref().group, n = req.get_ref().reservations.len()))]
    async fn reserve(
        &self,
        req: Request<v1::ReserveRequest>,
    ) -> Result<Response<v1::ReserveResponse>, Status> {
        self.reserve_one(req.into_inner()).await.map(Response::new)
    }

    type ReserveStreamStream = BoxStream<v1::ReserveResult>;

    async fn reserve_stream(
        &self,
        req: Request<Streaming<v1::ReserveCall>>,
    ) -> Result<Response<Self::ReserveStreamStream>, Status> {
        Ok(Response::new(self.reserve_calls(req.into_inner())))
    }

    #[tracing::instrument(skip_all, fields(group = %req.get_ref().group, n = req.get_ref().request_ids.len()))]
    async fn release(
        &self,
        req: Request<v1::ReleaseRequest>,
    ) -> Result<Response<v1::ReleaseResponse>, Status> {
        let req = ValidRelease::try_from(req.into_inner()).map_err(|e| self.fail(e.into()))?;
        let resp = self
            .writer
            .call(|reply| Command::Release { req, reply })
            .await
            .map_err(|e| self.fail(e))?;
        Ok(Response::new(wire::release_response(resp)))
    }

    async fn list_groups(
        &self,
        _req: Request<v1::ListGroupsRequest>,
    ) -> Result<Response<v1::ListGroupsResponse>, Status> {
        let groups = self
            .writer
            .call(|reply| Command::ListGroups { reply })
            .await
            .map_err(|e| self.fail(e))?;
        Ok(Response::new(v1::ListGroupsResponse { groups }))
    }

    #[tracing::instrument(skip_all, fields(group = %req.get_ref().group, worker = req.get_ref().worker_id, cordoned = req.get_ref().cordoned))]
    async fn set_cordon(
        &self,
        req: Request<v1::SetCordonRequest>,
    ) -> Result<Response<v1::SetCordonResponse>, Status> {
        let req = ValidSetCordon::try_from(req.into_inner()).map_err(|e| self.fail(e.into()))?;
        let (worker, cordoned) = (req.worker_id, req.cordoned);
        let done = self
            .writer
            .call(|reply| Command::SetCordon { req, reply })
            .await
            .map_err(|e| self.fail(e))?
            .map_err(|e| self.fail(e))?;
        if done.changed {
            // An operator's act: always worth a line in the log.
            tracing::info!(worker, cordoned, version = done.version, "cordon changed");
        }
        Ok(Response::new(v1::SetCordonResponse {
            version: done.version,
            changed: done.changed,
        }))
    }
}

/// The span of applying one ChangeBatch (disabled, and free, when traces are not exported):
/// a consumer span continuing the trace the batch names (its `traceparent`).
fn apply_span(batch: &v1::ChangeBatch) -> tracing::Span {
    if !br_trace::enabled() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        "apply_batch",
        otel.name = "balanceroute.v1.Snapshot/Apply batch",
        otel.kind = "consumer",
        batch_seq = batch.batch_seq,
        changes = batch.changes.len(),
    );
    br_trace::continue_trace(
        &span,
        br_trace::W3c::context_of(&batch.traceparent, &batch.tracestate),
    );
    span
}

/// The server span of one call on a ReserveStream, named like a unary Reserve's and continuing
/// the trace the call names (disabled, and free, when traces are not exported).
fn reserve_call_span(call: &v1::ReserveCall) -> tracing::Span {
    br_trace::server_span(
        "balanceroute.v1.Snapshot/Reserve",
        br_trace::W3c::context_of(&call.traceparent, &call.tracestate),
    )
}

impl SnapshotService {
    /// One Reserve from a caller in this process (br-all's decision): what the unary handler
    /// does, under the server span a ReserveStream call gets (a child of the caller's Reserve
    /// span; disabled, and free, when traces are not exported) instead of the unary handler's
    /// always-on `#[instrument]` span. That span cost 1.5% of br-all's CPU under load
    /// (docs/benchmarks.md), and the split deployment's Reserve (a ReserveStream
    /// call) never paid it. Made synchronously, so the span's parent is the caller's current one.
    pub fn reserve_in_process(
        &self,
        req: v1::ReserveRequest,
    ) -> impl std::future::Future<Output = Result<v1::ReserveResponse, Status>> + Send + 'static
    {
        let span = br_trace::server_span("balanceroute.v1.Snapshot/Reserve", None);
        let this = self.clone();
        tracing::Instrument::instrument(async move { this.reserve_one(req).await }, span)
    }

    /// One Reserve, unary or on a stream: validated at the edge, committed by the writer.
    async fn reserve_one(&self, req: v1::ReserveRequest) -> Result<v1::ReserveResponse, Status> {
        let req = ValidReserve::try_from(req).map_err(|e| self.fail(e.into()))?;
        let resp = self
            .writer
            .call(|reply| Command::Reserve { req, reply })
            .await
            .map_err(|e| self.fail(e))?;
        Ok(wire::reserve_response(resp))
    }

    /// One ReserveStream: each call answered as it completes, calls of different groups
    /// concurrently (the writer still takes them one at a time, in the order they came).
    /// A call with no request is the empty ReserveRequest: INVALID_ARGUMENT, like a unary one.
    pub fn reserve_calls<S>(&self, mut inbound: S) -> BoxStream<v1::ReserveResult>
    where
        S: Stream<Item = Result<v1::ReserveCall, Status>> + Send + Unpin + 'static,
    {
        let (tx, rx) = mpsc::channel(RESERVE_STREAM_IN_FLIGHT);
        let this = self.clone();
        tokio::spawn(async move {
            let mut in_flight = futures::stream::FuturesUnordered::new();
            let mut reading = true;
            while reading || !in_flight.is_empty() {
                tokio::select! {
                    m = inbound.next(), if reading && in_flight.len() < RESERVE_STREAM_IN_FLIGHT => match m {
                        Some(Ok(call)) => {
                            let this = this.clone();
                            in_flight.push(async move {
                                let span = reserve_call_span(&call);
                                let request = call.request.unwrap_or_default();
                                let outcome = tracing::Instrument::instrument(this.reserve_one(request), span).await;
                                v1::ReserveResult {
                                    call_id: call.call_id,
                                    outcome: Some(match outcome {
                                        Ok(r) => v1::reserve_result::Outcome::Response(r),
                                        Err(s) => v1::reserve_result::Outcome::Error(v1::CallError {
                                            code: s.code() as i32,
                                            message: s.message().to_owned(),
                                        }),
                                    }),
                                }
                            });
                        }
                        Some(Err(status)) if br_runtime::is_too_large(&status) => {
                            // As on Apply: a call above the decoding limit ends the stream
                            // RESOURCE_EXHAUSTED, counted.
                            this.metrics.refuse("message_too_large");
                            tracing::warn!(error = %status, "a ReserveCall above the message limit; ending the stream");
                            let _ = tx
                                .send(Err(Status::resource_exhausted(status.message().to_owned())))
                                .await;
                            return;
                        }
                        Some(Err(status)) => {
                            tracing::debug!(error = %status, "ReserveStream failed");
                            return;
                        }
                        // The caller closed its side: answer what is in flight, then end.
                        None => reading = false,
                    },
                    Some(result) = in_flight.next(), if !in_flight.is_empty() => {
                        if tx.send(Ok(result)).await.is_err() {
                            return;
                        }
                    }
                    () = this.shutdown.cancelled() => return,
                }
            }
        });
        Box::pin(ReceiverStream::new(rx))
    }

    /// One Apply stream: `inbound`'s batches in order, an ack per batch. The gRPC handler
    /// passes the call's request stream; the all-in-one `br-all` passes its ingest's batches
    /// in-process, so both are this code (batch_seq checks, validation, refusals, and every
    /// worker whose Hello came on the stream disconnected when it ends).
    ///
    /// Up to [`APPLY_IN_WRITER`] batches are in the writer at once: the batches that arrived
    /// together are queued to it together and their acks go out together, in order. Each
    /// batch is still applied on its own, in the order it came.
    pub fn apply_stream<S>(&self, mut inbound: S) -> BoxStream<v1::ApplyAck>
    where
        S: Stream<Item = Result<v1::ChangeBatch, Status>> + Send + Unpin + 'static,
    {
        let (tx, rx) = mpsc::channel(ACK_QUEUE);
        let stream = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let this = self.clone();
        tokio::spawn(async move {
            tracing::debug!(stream, "Apply stream opened");
            let mut last_seq = 0u64;
            let mut in_writer = VecDeque::<InWriter>::new();
            let mut reading = true;
            while reading || !in_writer.is_empty() {
                tokio::select! {
                    // Reading first: a burst of batches reaches the writer in one go.
                    biased;
                    () = this.shutdown.cancelled(), if reading => reading = false,
                    m = inbound.next(), if reading && in_writer.len() < APPLY_IN_WRITER => match m {
                        Some(Ok(batch)) => {
                            // One span per batch, in the trace of the ingest span that sent it
                            // (the stream's own metadata was sent once, at its opening).
                            let span = apply_span(&batch);
                            let queued = this.submit_batch(batch, stream, &mut last_seq, &span);
                            let queued = tracing::Instrument::instrument(queued, span.clone()).await;
                            in_writer.push_back(queued);
                        }
                        None => reading = false,
                        Some(Err(status)) if br_runtime::is_too_large(&status) => {
                            // A batch above the decoding limit ends the stream as gRPC says:
                            // RESOURCE_EXHAUSTED (tonic reads it as OUT_OF_RANGE), counted,
                            // after the acks of the batches before it.
                            this.metrics.refuse("message_too_large");
                            tracing::warn!(stream, error = %status, "an Apply batch above the message limit; ending the stream");
                            in_writer.push_back(InWriter::Answered(Err(Status::resource_exhausted(
                                status.message().to_owned(),
                            ))));
                            reading = false;
                        }
                        Some(Err(status)) => {
                            tracing::debug!(stream, error = %status, "Apply stream failed");
                            reading = false;
                        }
                    },
                    ack = this.next_ack(&mut in_writer), if !in_writer.is_empty() => {
                        let stop = ack.is_err();
                        if tx.send(ack).await.is_err() || stop {
                            break;
                        }
                    }
                }
            }
            // Every worker whose Hello came on this stream is disconnected now.
            this.writer.stream_ended(stream).await;
            tracing::debug!(stream, "Apply stream closed");
        });
        Box::pin(ReceiverStream::new(rx))
    }

    /// One ChangeBatch, up to the writer: a batch the writer cannot take as a whole (bad group,
    /// batch_seq not increasing) is answered with every change rejected as INVALID, and σ is
    /// untouched; the rest is queued to the writer.
    async fn submit_batch(
        &self,
        batch: v1::ChangeBatch,
        stream: u64,
        last_seq: &mut u64,
        span: &tracing::Span,
    ) -> InWriter {
        let whole = |detail: String, n: usize| {
            self.metrics.reject(v1::RejectReason::Invalid.label());
            InWriter::Answered(Ok(v1::ApplyAck {
                batch_seq: batch.batch_seq,
                epoch: self.writer.epoch(),
                version: 0,
                rejected: (0..n)
                    .map(|i| v1::ChangeRejection {
                        index: u32::try_from(i).unwrap_or(u32::MAX),
                        reason: v1::RejectReason::Invalid as i32,
                        detail: detail.clone(),
                    })
                    .collect(),
            }))
        };
        if batch.batch_seq <= *last_seq {
            return whole(
                format!(
                    "batch_seq {} does not follow {} (it must rise on each stream, from 1)",
                    batch.batch_seq, *last_seq
                ),
                batch.changes.len(),
            );
        }
        *last_seq = batch.batch_seq;
        let group = match GroupId::new(&batch.group) {
            Ok(g) => g,
            Err(e) => return whole(e.to_string(), batch.changes.len()),
        };
        if batch.ingest_id.len() > br_sigma::MAX_CARRIER_BYTES
            || batch.ingest_id.chars().any(char::is_control)
        {
            return whole(
                format!(
                    "ingest_id must be at most {} bytes without control characters",
                    br_sigma::MAX_CARRIER_BYTES
                ),
                batch.changes.len(),
            );
        }
        let carrier = batch.ingest_id;
        let batch_seq = batch.batch_seq;
        // Validated here, not in the writer: one change at a time, so a bad one is rejected
        // by its index and the rest apply (and the single writer does less work).
        let wire::Changes { valid, invalid } = wire::telemetry_changes(batch.changes);
        let submitted = self
            .writer
            .submit(|reply| Command::Apply {
                group,
                changes: valid,
                stream,
                carrier,
                reply,
            })
            .await;
        match submitted {
            Ok(reply) => InWriter::Applying {
                reply,
                batch_seq,
                invalid,
                span: span.clone(),
            },
            Err(e) => InWriter::Answered(Err(self.fail(e))),
        }
    }

    /// The ack of the oldest batch in the writer, once it is there (and only then taken off
    /// the queue: a `select!` may drop this future).
    async fn next_ack(&self, in_writer: &mut VecDeque<InWriter>) -> Result<v1::ApplyAck, Status> {
        // The writer's answer, taken from the oneshot when it is there (None: answered
        // without the writer).
        let answer = std::future::poll_fn(|cx| match in_writer.front_mut() {
            None => Poll::Pending,
            Some(InWriter::Answered(_)) => Poll::Ready(None),
            Some(InWriter::Applying { reply, .. }) => Pin::new(reply).poll(cx).map(Some),
        })
        .await;
        match (in_writer.pop_front(), answer) {
            (Some(InWriter::Answered(ack)), _) => ack,
            (
                Some(InWriter::Applying {
                    batch_seq,
                    invalid,
                    span,
                    ..
                }),
                Some(applied),
            ) => {
                let _entered = span.enter();
                match applied
                    .map_err(|_| SnapshotError::ShuttingDown)
                    .and_then(|r| r)
                {
                    Ok(applied) => {
                        for (_, r) in &invalid {
                            self.metrics.reject(r.label());
                        }
                        Ok(wire::apply_ack(batch_seq, invalid, applied))
                    }
                    Err(e) => Err(self.fail(e)),
                }
            }
            (Some(InWriter::Applying { .. }), None) | (None, _) => {
                Err(Status::internal("an Apply ack out of order"))
            }
        }
    }
}

/// Batches of one Apply stream in the writer at once, as many as ingest sends unacknowledged
/// (`br-ingest`'s `MAX_INFLIGHT`). At 64 groups ingest sends a burst of 64 batches every
/// interval; taken one writer round trip at a time, each batch cost the stream's task and the
/// writer a wake-up each, and its ack an HTTP/2 write of its own (docs/benchmarks.md).
const APPLY_IN_WRITER: usize = 64;

/// One batch of an Apply stream waiting for its ack, in the order the batches came.
enum InWriter {
    /// Answered without the writer (refused whole, the writer gone, or the stream's end).
    Answered(Result<v1::ApplyAck, Status>),
    /// Queued to the writer.
    Applying {
        reply: oneshot::Receiver<Result<Applied, SnapshotError>>,
        batch_seq: u64,
        /// Its changes rejected at the edge, by index.
        invalid: Vec<(usize, Reject)>,
        /// The batch's span, ended with its ack.
        span: tracing::Span,
    },
}
