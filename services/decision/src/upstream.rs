//! The decision service's calls to the snapshot service: `Reserve` and `Release` behind a small
//! trait, so the group task is unit-tested with a fake. (σ comes from `br_client::watch`.)

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use br_proto::v1;
use br_proto::v1::snapshot_client::SnapshotClient;
use futures::StreamExt as _;
use futures::future::BoxFuture;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

/// `Snapshot.Reserve` and `Snapshot.Release`, as the group task needs them.
pub trait SnapshotOps: Send + Sync + 'static {
    fn reserve(
        &self,
        req: v1::ReserveRequest,
    ) -> BoxFuture<'static, Result<v1::ReserveResponse, tonic::Status>>;
    fn release(
        &self,
        req: v1::ReleaseRequest,
    ) -> BoxFuture<'static, Result<v1::ReleaseResponse, tonic::Status>>;
}

/// A lazily connecting channel to the snapshot service (it may start after us, or restart).
/// Over mutual TLS (verifying the server is the snapshot role) when `tls` is given.
pub fn snapshot_channel(
    addr: &str,
    tls: Option<&std::sync::Arc<br_trust::TlsMaterial>>,
) -> Result<Channel, tonic::transport::Error> {
    let endpoint = Endpoint::from_shared(addr.to_owned())?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(1))
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(3))
        .keep_alive_while_idle(true);
    Ok(br_trust::tls::connect_lazy(
        endpoint,
        tls,
        Some(br_trust::Role::Snapshot),
    ))
}

/// Reserve calls in flight on one `ReserveStream` (the server's own limit): at most one per
/// group is in flight, so this is only reached with over 1,024 groups, and then calls wait.
const RESERVE_STREAM_IN_FLIGHT: usize = 1024;

/// [`SnapshotOps`] over gRPC, each call bounded by `timeout`.
///
/// Reserve goes over one long-lived `ReserveStream` shared by every group task: a unary call
/// per tick costs a new HTTP/2 stream, a task and a header round on both sides, and at 64
/// groups nearly every Assign was its own tick. The stream is opened on the first call and
/// again after it fails (the calls in flight then fail as a unary call would). A server
/// without `ReserveStream` (UNIMPLEMENTED) gets unary `Reserve` calls from then on.
#[derive(Clone, Debug)]
pub struct GrpcSnapshot {
    client: SnapshotClient<br_trace::Traced<Channel>>,
    timeout: Duration,
    stream: Arc<ReserveStream>,
}

impl GrpcSnapshot {
    pub fn new(channel: Channel, timeout: Duration) -> Self {
        GrpcSnapshot {
            // Reserve and Release carry the tick's span (its trace context) to the snapshot
            // service: unary calls in their metadata, streamed calls in each ReserveCall.
            client: SnapshotClient::new(br_trace::traced(channel)),
            timeout,
            stream: Arc::new(ReserveStream::default()),
        }
    }

    /// Whether Reserve calls go over `ReserveStream` (false once the server said it has none).
    pub fn streams_reserve(&self) -> bool {
        !self.stream.unary_only.load(Ordering::Relaxed)
    }

    async fn reserve_now(
        &self,
        req: v1::ReserveRequest,
        trace: br_trace::W3c,
    ) -> Result<v1::ReserveResponse, tonic::Status> {
        let req = if self.streams_reserve() {
            match self.reserve_streamed(req, trace).await {
                Answer::Done(r) => return r,
                Answer::Unsupported(req) => req,
            }
        } else {
            req
        };
        let mut r = tonic::Request::new(req);
        r.set_timeout(self.timeout);
        self.client
            .clone()
            .reserve(r)
            .await
            .map(tonic::Response::into_inner)
    }

    async fn reserve_streamed(&self, req: v1::ReserveRequest, trace: br_trace::W3c) -> Answer {
        let (reply, answer) = oneshot::channel();
        let mut call = Pending {
            request: req,
            trace,
            reply,
        };
        // A stream that just ended may still be the one handed out: one more try on a new one.
        for _ in 0..2 {
            let calls = self.stream.calls(&self.client);
            match calls.send(call).await {
                Ok(()) => {
                    return answer.await.unwrap_or_else(|_| {
                        Answer::Done(Err(tonic::Status::unavailable(
                            "the ReserveStream to the snapshot service ended",
                        )))
                    });
                }
                Err(mpsc::error::SendError(back)) => {
                    self.stream.forget(&calls);
                    call = back;
                }
            }
        }
        Answer::Done(Err(tonic::Status::unavailable(
            "could not open a ReserveStream to the snapshot service",
        )))
    }
}

/// The shared `ReserveStream`: the queue of its task, while one runs.
#[derive(Debug, Default)]
struct ReserveStream {
    open: std::sync::Mutex<Option<mpsc::Sender<Pending>>>,
    /// The server answered UNIMPLEMENTED: unary Reserve from now on.
    unary_only: AtomicBool,
}

impl ReserveStream {
    /// The running stream's queue, starting a stream task if none runs.
    fn calls(
        self: &Arc<Self>,
        client: &SnapshotClient<br_trace::Traced<Channel>>,
    ) -> mpsc::Sender<Pending> {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(tx) = open.as_ref().filter(|tx| !tx.is_closed()) {
            return tx.clone();
        }
        let (tx, rx) = mpsc::channel(RESERVE_STREAM_IN_FLIGHT);
        tokio::spawn(run_reserve_stream(client.clone(), rx, Arc::downgrade(self)));
        *open = Some(tx.clone());
        tx
    }

    /// Drops `calls` as the running stream (it ended), unless another one replaced it.
    fn forget(&self, calls: &mpsc::Sender<Pending>) {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if open.as_ref().is_some_and(|tx| tx.same_channel(calls)) {
            *open = None;
        }
    }
}

/// One Reserve waiting for its stream.
#[derive(Debug)]
struct Pending {
    request: v1::ReserveRequest,
    trace: br_trace::W3c,
    reply: oneshot::Sender<Answer>,
}

#[derive(Debug)]
enum Answer {
    Done(Result<v1::ReserveResponse, tonic::Status>),
    /// The server has no `ReserveStream`: the request, to be sent unary.
    Unsupported(v1::ReserveRequest),
}

impl Answer {
    fn of(result: v1::ReserveResult) -> Answer {
        use v1::reserve_result::Outcome;
        Answer::Done(match result.outcome {
            Some(Outcome::Response(r)) => Ok(r),
            Some(Outcome::Error(e)) => Err(tonic::Status::new(e.code.into(), e.message)),
            None => Err(tonic::Status::internal(
                "the snapshot service answered a ReserveCall with no outcome",
            )),
        })
    }
}

/// Runs one `ReserveStream`: sends the queued calls, hands each answer to its caller, and on
/// the stream's end fails the calls in flight and the queued ones with its status.
async fn run_reserve_stream(
    mut client: SnapshotClient<br_trace::Traced<Channel>>,
    mut calls: mpsc::Receiver<Pending>,
    owner: Weak<ReserveStream>,
) {
    // At most RESERVE_STREAM_IN_FLIGHT calls are pending, so `out` never blocks and answers
    // are always read (no wait on a full stream while the server waits on us).
    let (out, out_rx) = mpsc::channel::<v1::ReserveCall>(RESERVE_STREAM_IN_FLIGHT);
    let mut pending: HashMap<u64, oneshot::Sender<Answer>> = HashMap::new();
    let mut next_id = 0u64;
    let status = match client.reserve_stream(ReceiverStream::new(out_rx)).await {
        Err(status) => status,
        Ok(answers) => {
            let mut answers = answers.into_inner();
            loop {
                tokio::select! {
                    call = calls.recv(), if pending.len() < RESERVE_STREAM_IN_FLIGHT => {
                        // None: every GrpcSnapshot is gone.
                        let Some(call) = call else { return };
                        next_id += 1;
                        pending.insert(next_id, call.reply);
                        let sent = out.try_send(v1::ReserveCall {
                            call_id: next_id,
                            request: Some(call.request),
                            traceparent: call.trace.traceparent,
                            tracestate: call.trace.tracestate,
                        });
                        if sent.is_err() {
                            break tonic::Status::unavailable("the ReserveStream's request side closed");
                        }
                    }
                    answer = answers.next() => match answer {
                        Some(Ok(result)) => {
                            if let Some(reply) = pending.remove(&result.call_id) {
                                // The caller may have timed out and gone.
                                let _ = reply.send(Answer::of(result));
                            }
                        }
                        Some(Err(status)) => break status,
                        None => break tonic::Status::unavailable("the snapshot service ended the ReserveStream"),
                    },
                }
            }
        }
    };
    let unsupported = status.code() == tonic::Code::Unimplemented;
    if let Some(owner) = owner.upgrade() {
        if unsupported {
            tracing::info!("the snapshot service has no ReserveStream; using unary Reserve");
            owner.unary_only.store(true, Ordering::Relaxed);
        } else {
            tracing::debug!(error = %status, "ReserveStream ended");
        }
        let mut open = owner
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *open = None;
    }
    calls.close();
    for (_, reply) in pending.drain() {
        let _ = reply.send(Answer::Done(Err(status.clone())));
    }
    while let Some(call) = calls.recv().await {
        let answer = if unsupported {
            Answer::Unsupported(call.request)
        } else {
            Answer::Done(Err(status.clone()))
        };
        let _ = call.reply.send(answer);
    }
}

impl SnapshotOps for GrpcSnapshot {
    fn reserve(
        &self,
        req: v1::ReserveRequest,
    ) -> BoxFuture<'static, Result<v1::ReserveResponse, tonic::Status>> {
        let this = self.clone();
        // Taken here, where the tick's span is current (the unary fallback's interceptor
        // reads it when the call is made, inside the same span).
        let trace = br_trace::W3c::of(&tracing::Span::current());
        Box::pin(async move {
            match tokio::time::timeout(this.timeout, this.reserve_now(req, trace)).await {
                Ok(r) => r,
                Err(_) => Err(tonic::Status::deadline_exceeded("Reserve timed out")),
            }
        })
    }

    fn release(
        &self,
        req: v1::ReleaseRequest,
    ) -> BoxFuture<'static, Result<v1::ReleaseResponse, tonic::Status>> {
        let mut c = self.client.clone();
        let timeout = self.timeout;
        Box::pin(async move {
            let mut r = tonic::Request::new(req);
            r.set_timeout(timeout);
            match tokio::time::timeout(timeout, c.release(r)).await {
                Ok(r) => r.map(tonic::Response::into_inner),
                Err(_) => Err(tonic::Status::deadline_exceeded("Release timed out")),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use br_testkit::{FakeSnapshot, PATIENCE};

    fn reserve(group: &str, id: &str) -> v1::ReserveRequest {
        v1::ReserveRequest {
            group: group.into(),
            reservations: vec![v1::Reservation {
                request_id: id.into(),
                worker_id: 3,
                incarnation: 1,
                prompt_tokens: 10,
                ..Default::default()
            }],
        }
    }

    fn lazy(url: String) -> Channel {
        Endpoint::from_shared(url).unwrap().connect_lazy()
    }

    /// Against the real snapshot service, every group's Reserve goes over the one stream and
    /// gets the answer a unary Reserve gets (here: no such worker in σ), errors included.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reserves_of_many_groups_share_one_stream_and_answer_like_unary_reserve() {
        let (running, shutdown) = br_testkit::snapshot::start("127.0.0.1:0", &[]).await;
        let url = br_testkit::snapshot::url(&running);
        let ops = GrpcSnapshot::new(lazy(url.clone()), PATIENCE);

        let calls = (0..16).map(|g| ops.reserve(reserve(&format!("g{g}"), &format!("r{g}"))));
        for resp in futures::future::join_all(calls).await {
            let resp = resp.expect("answered");
            assert!(resp.accepted.is_empty());
            assert_eq!(
                resp.rejected[0].reason,
                v1::RejectReason::UnknownWorker as i32
            );
        }
        assert!(
            ops.streams_reserve(),
            "the real service serves ReserveStream"
        );
        let unary = SnapshotClient::new(lazy(url))
            .reserve(reserve("g0", "r0"))
            .await
            .unwrap()
            .into_inner();
        let streamed = ops.reserve(reserve("g0", "r0")).await.unwrap();
        assert_eq!(streamed, unary, "the same answer either way");

        let bad = ops.reserve(reserve("", "r")).await.expect_err("no group");
        assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
        // The stream goes on after a call's error.
        ops.reserve(reserve("g1", "r1")).await.unwrap();
        assert!(ops.streams_reserve());

        // The service going away fails the call (as a unary call would), never hangs it.
        shutdown.cancel();
        running.wait().await.unwrap();
        let gone = ops
            .reserve(reserve("g1", "r1"))
            .await
            .expect_err("no service");
        assert_ne!(gone.code(), tonic::Code::DeadlineExceeded, "{gone:?}");
    }

    /// A snapshot service without ReserveStream (UNIMPLEMENTED) gets unary Reserve calls, the
    /// first one included.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_old_server_without_the_stream_gets_unary_reserve() {
        let fake = FakeSnapshot::new();
        fake.on_reserve(|req| {
            Ok(v1::ReserveResponse {
                epoch: 5,
                version: 9,
                accepted: req.reservations.into_iter().map(|r| r.request_id).collect(),
                rejected: vec![],
            })
        });
        let served = fake.start().await;
        let ops = GrpcSnapshot::new(lazy(served.url()), PATIENCE);
        for id in ["a", "b"] {
            let resp = ops.reserve(reserve("g", id)).await.unwrap();
            assert_eq!((resp.accepted, resp.version), (vec![id.to_owned()], 9));
            assert!(!ops.streams_reserve(), "fell back after UNIMPLEMENTED");
        }
    }
}
