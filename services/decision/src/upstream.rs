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
use tonic::transport::Channel;

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
) -> Result<Channel, br_trust::address::EndpointError> {
    let endpoint = br_trust::address::endpoint(addr, tls.is_some())?
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

    async fn reserve_streamed(&self, mut req: v1::ReserveRequest, trace: br_trace::W3c) -> Answer {
        // A stream that just ended may still be the one handed out: one more try on a new one.
        for _ in 0..2 {
            let open = self.stream.open(&self.client);
            match open.call(req, &trace).await {
                Sent::Answered(answer) => return answer,
                Sent::Ended(back) => {
                    self.stream.forget(&open);
                    // Why it ended decides: a server without ReserveStream may have said so
                    // before this call was written (the first calls to an old server).
                    if open.waiting.ended().await == Some(tonic::Code::Unimplemented) {
                        return Answer::Unsupported(back);
                    }
                    req = back;
                }
            }
        }
        Answer::Done(Err(tonic::Status::unavailable(
            "could not open a ReserveStream to the snapshot service",
        )))
    }
}

/// The shared `ReserveStream`: the open one, if any.
#[derive(Debug, Default)]
struct ReserveStream {
    open: std::sync::Mutex<Option<Arc<OpenStream>>>,
    /// The server answered UNIMPLEMENTED: unary Reserve from now on.
    unary_only: AtomicBool,
}

impl ReserveStream {
    /// The open stream, opening one (and starting the task that reads its answers) if none is.
    fn open(
        self: &Arc<Self>,
        client: &SnapshotClient<br_trace::Traced<Channel>>,
    ) -> Arc<OpenStream> {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(s) = open.as_ref().filter(|s| !s.out.is_closed()) {
            return Arc::clone(s);
        }
        // At most RESERVE_STREAM_IN_FLIGHT calls are waiting (the permits), so the request
        // body's queue never fills and answers are always read (no wait on a full stream
        // while the server waits on us).
        let (out, out_rx) = mpsc::channel(RESERVE_STREAM_IN_FLIGHT);
        let waiting = Arc::new(Waiting::default());
        let s = Arc::new(OpenStream {
            out,
            waiting: Arc::clone(&waiting),
        });
        tokio::spawn(read_reserve_stream(
            client.clone(),
            ReceiverStream::new(out_rx),
            waiting,
            Arc::downgrade(self),
        ));
        *open = Some(Arc::clone(&s));
        s
    }

    /// Drops `s` as the open stream (it ended), unless another one replaced it.
    fn forget(&self, s: &Arc<OpenStream>) {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if open.as_ref().is_some_and(|o| Arc::ptr_eq(o, s)) {
            *open = None;
        }
    }
}

/// One open `ReserveStream`, as callers write to it: each call goes straight into the request
/// body (no task in between), and waits for its answer in `waiting`. Its request side ends
/// when the last holder drops it (every GrpcSnapshot gone), which ends the stream.
#[derive(Debug)]
struct OpenStream {
    out: mpsc::Sender<v1::ReserveCall>,
    waiting: Arc<Waiting>,
}

/// The calls of one stream waiting for their answers, shared by the callers and the task that
/// reads the answers.
#[derive(Debug)]
struct Waiting {
    /// By call id; None once the stream ended (a call then goes to a new stream).
    calls: std::sync::Mutex<Option<HashMap<u64, Waiter>>>,
    next_id: std::sync::atomic::AtomicU64,
    /// The server has answered a call, so it serves ReserveStream: no copy of a request is
    /// kept any more for the unary fallback.
    served: AtomicBool,
    /// One permit per call waiting: the 1,024 in flight the server takes.
    in_flight: tokio::sync::Semaphore,
    /// Why the stream ended, once it has (set by [`Waiting::end`]).
    ended: tokio::sync::watch::Sender<Option<tonic::Code>>,
}

impl Default for Waiting {
    fn default() -> Self {
        Waiting {
            calls: std::sync::Mutex::new(Some(HashMap::new())),
            next_id: std::sync::atomic::AtomicU64::new(0),
            served: AtomicBool::new(false),
            in_flight: tokio::sync::Semaphore::new(RESERVE_STREAM_IN_FLIGHT),
            ended: tokio::sync::watch::Sender::new(None),
        }
    }
}

impl Waiting {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<HashMap<u64, Waiter>>> {
        self.calls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Why the stream ended, for a call that found it ended ([`Sent::Ended`]): the task
    /// reading the stream is then ending it, or has (the caller's Reserve timeout bounds the
    /// wait all the same).
    async fn ended(&self) -> Option<tonic::Code> {
        let mut ended = self.ended.subscribe();
        ended.wait_for(Option::is_some).await.ok().and_then(|c| *c)
    }

    /// Calls waiting now (for tests: none may be left behind).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().as_ref().map_or(0, HashMap::len)
    }

    /// Ends the stream for its callers: every call waiting gets `status` (or, for a server
    /// without ReserveStream, its request back, to be sent unary); later calls find it ended.
    fn end(&self, status: &tonic::Status) {
        self.in_flight.close();
        let unsupported = status.code() == tonic::Code::Unimplemented;
        let calls = self.lock().take();
        self.ended.send_replace(Some(status.code()));
        let Some(calls) = calls else {
            return;
        };
        for (_, w) in calls {
            let answer = match w.request {
                Some(req) if unsupported => Answer::Unsupported(req),
                _ => Answer::Done(Err(status.clone())),
            };
            let _ = w.reply.send(answer);
        }
    }
}

/// One call waiting for its answer.
#[derive(Debug)]
struct Waiter {
    reply: oneshot::Sender<Answer>,
    /// A copy of the request until the server is known to serve ReserveStream.
    request: Option<v1::ReserveRequest>,
}

/// What became of a call written to a stream.
#[derive(Debug)]
enum Sent {
    Answered(Answer),
    /// The stream had ended before the call went out: the request, for another stream.
    Ended(v1::ReserveRequest),
}

/// Removes its call from `waiting` when the caller stops waiting (answered, or given up at
/// the reserve timeout), so no entry outlives its caller.
struct Registered<'a> {
    waiting: &'a Waiting,
    id: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        if let Some(calls) = self.waiting.lock().as_mut() {
            calls.remove(&self.id);
        }
    }
}

impl OpenStream {
    /// Writes one call into the stream and waits for its answer.
    async fn call(&self, req: v1::ReserveRequest, trace: &br_trace::W3c) -> Sent {
        let waiting = &*self.waiting;
        let Ok(_permit) = waiting.in_flight.acquire().await else {
            return Sent::Ended(req);
        };
        let id = waiting.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let (reply, answer) = oneshot::channel();
        let request = (!waiting.served.load(Ordering::Relaxed)).then(|| req.clone());
        match waiting.lock().as_mut() {
            Some(calls) => calls.insert(id, Waiter { reply, request }),
            None => return Sent::Ended(req),
        };
        let _registered = Registered { waiting, id };
        let call = v1::ReserveCall {
            call_id: id,
            request: Some(req),
            traceparent: trace.traceparent.clone(),
            tracestate: trace.tracestate.clone(),
        };
        if let Err(mpsc::error::SendError(call)) = self.out.send(call).await {
            return Sent::Ended(call.request.unwrap_or_default());
        }
        Sent::Answered(answer.await.unwrap_or_else(|_| {
            Answer::Done(Err(tonic::Status::unavailable(
                "the ReserveStream to the snapshot service ended",
            )))
        }))
    }
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

/// Reads one `ReserveStream`'s answers and hands each to its caller; on the stream's end,
/// fails the calls still waiting with its status (see [`Waiting::end`]).
async fn read_reserve_stream(
    mut client: SnapshotClient<br_trace::Traced<Channel>>,
    calls: ReceiverStream<v1::ReserveCall>,
    waiting: Arc<Waiting>,
    owner: Weak<ReserveStream>,
) {
    let status = match client.reserve_stream(calls).await {
        Err(status) => status,
        Ok(answers) => answer_calls(answers.into_inner(), &waiting).await,
    };
    if let Some(owner) = owner.upgrade() {
        if status.code() == tonic::Code::Unimplemented {
            tracing::info!("the snapshot service has no ReserveStream; using unary Reserve");
            owner.unary_only.store(true, Ordering::Relaxed);
        } else {
            tracing::debug!(error = %status, "ReserveStream ended");
        }
        let mut open = owner
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if open
            .as_ref()
            .is_some_and(|o| Arc::ptr_eq(&o.waiting, &waiting))
        {
            *open = None;
        }
    }
    waiting.end(&status);
}

/// Hands each answer to the call waiting for it until the stream ends; returns why it ended.
async fn answer_calls<S>(mut answers: S, waiting: &Waiting) -> tonic::Status
where
    S: futures::Stream<Item = Result<v1::ReserveResult, tonic::Status>> + Unpin,
{
    loop {
        match answers.next().await {
            Some(Ok(result)) => {
                waiting.served.store(true, Ordering::Relaxed);
                let w = waiting
                    .lock()
                    .as_mut()
                    .and_then(|calls| calls.remove(&result.call_id));
                // None: the caller gave up (timed out) and removed its entry.
                if let Some(w) = w {
                    let _ = w.reply.send(Answer::of(result));
                }
            }
            Some(Err(status)) => return status,
            None => {
                return tonic::Status::unavailable("the snapshot service ended the ReserveStream");
            }
        }
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
        tonic::transport::Endpoint::from_shared(url)
            .unwrap()
            .connect_lazy()
    }

    /// Against the real snapshot service, every group's Reserve goes over the one stream and
    /// gets the answer a unary Reserve gets (here: no such worker in σ), errors included.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reserves_of_many_groups_share_one_stream_and_answer_like_unary_reserve() {
        let (running, shutdown) = br_snapshot::test_util::start("127.0.0.1:0", &[]).await;
        let url = br_snapshot::test_util::url(&running);
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

    /// A stream no server reads or answers: the calls written to it, and its waiting calls.
    fn unanswered() -> (OpenStream, mpsc::Receiver<v1::ReserveCall>) {
        let (out, out_rx) = mpsc::channel(RESERVE_STREAM_IN_FLIGHT);
        let waiting = Arc::new(Waiting::default());
        (OpenStream { out, waiting }, out_rx)
    }

    /// A caller that gives up (the reserve timeout) takes its waiting entry with it: a stream
    /// whose server never answers does not collect them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_that_times_out_leaves_no_waiting_entry() {
        let (open, mut sent) = unanswered();
        let trace = br_trace::W3c::default();
        let (outcome, waiting_while_sent) = tokio::join!(
            tokio::time::timeout(
                Duration::from_millis(50),
                open.call(reserve("g", "r"), &trace)
            ),
            async {
                let call = sent.recv().await.unwrap();
                assert_eq!(call.request.unwrap().group, "g");
                open.waiting.len()
            }
        );
        assert!(outcome.is_err(), "nobody answers: the caller times out");
        assert_eq!(waiting_while_sent, 1, "waiting while the call was out");
        assert_eq!(open.waiting.len(), 0, "no entry left behind");
    }

    /// When the server ends the stream, every call still waiting gets its error (none hangs),
    /// an answered one keeps its answer, and a later call goes to another stream.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_waiting_when_the_stream_ends_all_get_an_error() {
        let (open, mut sent) = unanswered();
        let open = Arc::new(open);
        let trace = br_trace::W3c::default();
        let n = 8;
        let callers: Vec<_> = (0..n)
            .map(|i| {
                let (open, trace) = (Arc::clone(&open), trace.clone());
                tokio::spawn(async move { open.call(reserve("g", &format!("r{i}")), &trace).await })
            })
            .collect();
        let mut ids = Vec::new();
        for _ in 0..n {
            ids.push(within(sent.recv()).await.unwrap().call_id);
        }
        assert_eq!(open.waiting.len(), n);
        // The server answers one call, then ends the stream.
        let answered = v1::ReserveResult {
            call_id: ids[0],
            outcome: Some(v1::reserve_result::Outcome::Response(v1::ReserveResponse {
                version: 4,
                ..Default::default()
            })),
        };
        let answers = futures::stream::iter(vec![
            Ok(answered),
            Err(tonic::Status::aborted("the server went away")),
        ]);
        let status = answer_calls(answers, &open.waiting).await;
        assert_eq!(status.code(), tonic::Code::Aborted);
        open.waiting.end(&status);
        let (mut ok, mut failed) = (0, 0);
        for c in callers {
            match within(c).await.unwrap() {
                Sent::Answered(Answer::Done(Ok(r))) => {
                    assert_eq!(r.version, 4);
                    ok += 1;
                }
                Sent::Answered(Answer::Done(Err(e))) => {
                    assert_eq!(e.code(), tonic::Code::Aborted);
                    failed += 1;
                }
                _ => panic!("a waiting call of an ended stream must get its error"),
            }
        }
        assert_eq!((ok, failed), (1, n - 1));
        assert_eq!(open.waiting.len(), 0);
        assert!(matches!(
            open.call(reserve("g", "late"), &trace).await,
            Sent::Ended(_)
        ));
    }

    /// A call that finds its stream already ended by the server's UNIMPLEMENTED (the answer to
    /// the first call to an old server came back before the call was written: a caller
    /// preempted on a loaded machine) goes unary, not to another stream that would end the
    /// same way: a second failure there ended the call with UNAVAILABLE (1 run in 60 of
    /// `an_old_server_without_the_stream_gets_unary_reserve`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_that_finds_its_stream_ended_by_unimplemented_goes_unary() {
        // Nobody listens here: a call sent to another stream fails.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let ops = GrpcSnapshot::new(lazy(format!("http://127.0.0.1:{port}")), PATIENCE);
        let (open, _sent) = unanswered();
        open.waiting
            .end(&tonic::Status::unimplemented("no ReserveStream here"));
        *ops.stream.open.lock().unwrap() = Some(Arc::new(open));
        let answer =
            within(ops.reserve_streamed(reserve("g", "r"), br_trace::W3c::default())).await;
        assert!(
            matches!(&answer, Answer::Unsupported(r) if r.reservations[0].request_id == "r"),
            "{answer:?}"
        );
    }

    async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
        br_testkit::within(PATIENCE, "a ReserveStream call", f).await
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
