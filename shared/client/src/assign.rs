//! The gateway's client for `balanceroute.v1.Decision`: one [`AssignClient::assign`] per
//! request whose prefill is done, and [`AssignClient::cancel`] when the client goes away.
//!
//! # What `assign` does
//! `Assign` is a long poll: with a pooled policy (`br0`, `brh*`) the call waits in the group's
//! pool until the dispatcher admits it at a tick, or until the deadline. This client
//!
//! * sends the deadline as `grpc-timeout` (the server withdraws the request from its pool when
//!   it passes, so nothing is left reserved) and also enforces it locally;
//! * retries `UNAVAILABLE` (connection refused or reset, server shutting down, no σ yet),
//!   `FAILED_PRECONDITION` (a standby replica answered; the Service will route to the active
//!   one) and transport errors with capped, jittered exponential backoff, **keeping the same
//!   request id**: `Assign` is idempotent by `(group, request_id)`, so a retry after a lost
//!   response joins the same wait or gets the original answer, never a second reservation;
//! * does not retry anything else (`INVALID_ARGUMENT`, `RESOURCE_EXHAUSTED` (the pool is full:
//!   shed load instead), `CANCELLED`, `NOT_FOUND`, `DEADLINE_EXCEEDED`).
//!
//! # Pinning the chosen rank
//! The answer names a DP rank ([`Assignment::worker_id`]) and, if the worker announced one, its
//! endpoint. The gateway must then make sure the decode request runs on exactly that rank, or
//! the reservation expires and σ drifts from reality. Three ways, depending on the engine:
//!
//! * **vLLM** (one API server in front of all DP ranks, `--data-parallel-size N`): send the
//!   request to the API server with the HTTP header `X-data-parallel-rank: <worker_id>`; vLLM's
//!   DP coordinator then skips its own balancer for it.
//! * **SGLang** (`--dp-size N` with the DP controller): put `"routed_dp_rank": <worker_id>` in
//!   the JSON body of `/generate` (or the OpenAI-compatible routes that accept it).
//! * **One endpoint per rank** (each rank behind its own server or shim, as in
//!   `deploy/k8s/examples`): send the request to [`Assignment::endpoint`], or to the gateway's
//!   own `worker_id -> address` table when the endpoint is empty.
//!
//! The request id sent to the engine must be the same `request_id` given to `assign` (e.g. as
//! the OpenAI `X-Request-Id` header the shim forwards), so the worker's telemetry turns the
//! reservation into an active request. If the gateway gives up on a request after `assign`
//! answered but before sending it, it should call [`AssignClient::cancel`] (the reservation is
//! released at once instead of expiring after the reservation TTL).
//!
//! # Example
//! ```no_run
//! use std::time::Duration;
//! use br_client::assign::{AssignClient, AssignParams};
//! # async fn run() -> Result<(), br_client::assign::AssignError> {
//! let client = AssignClient::connect("http://127.0.0.1:50063").await?;
//! let params = AssignParams::new("g8", "req-42", 3_197).with_max_tokens(1_024);
//! let a = client.assign_within(&params, Duration::from_secs(5)).await?;
//! println!("send req-42 to rank {} ({}), waited {:?}", a.worker_id, a.endpoint, a.pool_wait);
//! # Ok(()) }
//! ```

use std::time::{Duration, Instant};

use br_proto::v1;
use br_proto::v1::decision_client::DecisionClient;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

/// How long [`AssignClient::cancel`] tries (including retries) when no timeout is given.
pub const DEFAULT_CANCEL_TIMEOUT: Duration = Duration::from_secs(2);

/// What the gateway knows about a request when it asks for a rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssignParams {
    /// The lockstep group whose ranks may take the request (1..=128 bytes).
    pub group: String,
    /// The gateway's id for the request, unique within the group; also the idempotency key
    /// (1..=256 bytes). Keep it for retries and for the engine request.
    pub request_id: String,
    /// `s_i`: the prompt's tokens (the KV tokens it brings to the decode rank), 1..=10M.
    pub prompt_tokens: u32,
    /// Any stable 64-bit hash of the prompt (used by the ExactMatch predictor), if known.
    pub prompt_hash: Option<u64>,
    /// The request's `max_tokens`, if known (1..=10M).
    pub max_tokens: Option<u32>,
}

impl AssignParams {
    pub fn new(
        group: impl Into<String>,
        request_id: impl Into<String>,
        prompt_tokens: u32,
    ) -> Self {
        AssignParams {
            group: group.into(),
            request_id: request_id.into(),
            prompt_tokens,
            prompt_hash: None,
            max_tokens: None,
        }
    }

    pub fn with_prompt_hash(mut self, hash: u64) -> Self {
        self.prompt_hash = Some(hash);
        self
    }

    pub fn with_max_tokens(mut self, max_tokens: u32) -> Self {
        self.max_tokens = Some(max_tokens);
        self
    }

    fn to_request(&self) -> v1::AssignRequest {
        v1::AssignRequest {
            group: self.group.clone(),
            request_id: self.request_id.clone(),
            prompt_tokens: self.prompt_tokens,
            prompt_hash: self.prompt_hash,
            max_tokens: self.max_tokens,
        }
    }
}

/// The rank chosen for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// The DP rank within the group.
    pub worker_id: u32,
    /// The rank's endpoint as it announced it; empty if it announced none.
    pub endpoint: String,
    /// The worker incarnation the reservation is for.
    pub incarnation: u64,
    /// The policy that decided (`br0`, `jsq`, ...).
    pub policy: String,
    /// Time the request spent in the pool before admission (zero for an immediate answer).
    pub pool_wait: Duration,
    /// σ's version in the decision replica when it decided.
    pub sigma_version: u64,
    /// The decision was made while the snapshot service was unreachable.
    pub stale: bool,
    /// How many calls this took (1 without retries).
    pub attempts: u32,
}

impl Assignment {
    fn from_response(r: v1::AssignResponse, attempts: u32) -> Self {
        Assignment {
            worker_id: r.worker_id,
            endpoint: r.endpoint,
            incarnation: r.incarnation,
            policy: r.policy,
            pool_wait: Duration::from_micros(r.pool_wait_us),
            sigma_version: r.sigma_version,
            stale: r.stale,
            attempts,
        }
    }
}

/// What a [`AssignClient::cancel`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The request was waiting in the pool and left it.
    Withdrawn,
    /// The request had been assigned; its reservation was released.
    Released,
    /// The service knew no such request (never seen, expired, or already cancelled).
    NotFound,
}

/// Why an `assign` or `cancel` failed. [`AssignError::code`] gives the gRPC code.
#[derive(Debug, thiserror::Error)]
pub enum AssignError {
    /// The address is not a valid URI.
    #[error("invalid decision service address {addr:?}: {detail}")]
    BadAddress { addr: String, detail: String },
    /// The service rejected the request as invalid (not retried).
    #[error("invalid request: {0}")]
    InvalidArgument(String),
    /// Not admitted before the deadline; the request left the pool, nothing is reserved.
    #[error("not assigned before the deadline")]
    DeadlineExceeded,
    /// The request was withdrawn (`Cancel`) while it waited.
    #[error("cancelled: {0}")]
    Cancelled(String),
    /// The group's pool is full: shed the request or retry later (not retried here).
    #[error("pool full: {0}")]
    PoolFull(String),
    /// The decision service does not serve this group.
    #[error("not found: {0}")]
    NotFound(String),
    /// The service stayed unreachable or unavailable (no σ, no live worker, standby, shutting
    /// down) until the deadline; `attempts` calls were made.
    #[error("decision service unavailable after {attempts} attempt(s): {message}")]
    Unavailable { message: String, attempts: u32 },
    /// Any other status.
    #[error("decision service error: {0}")]
    Status(Status),
}

impl AssignError {
    /// The gRPC code this error corresponds to.
    pub fn code(&self) -> Code {
        match self {
            AssignError::BadAddress { .. } | AssignError::InvalidArgument(_) => {
                Code::InvalidArgument
            }
            AssignError::DeadlineExceeded => Code::DeadlineExceeded,
            AssignError::Cancelled(_) => Code::Cancelled,
            AssignError::PoolFull(_) => Code::ResourceExhausted,
            AssignError::NotFound(_) => Code::NotFound,
            AssignError::Unavailable { .. } => Code::Unavailable,
            AssignError::Status(s) => s.code(),
        }
    }

    /// Whether the gateway may try again (elsewhere or later) with the same request id.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            AssignError::Unavailable { .. } | AssignError::PoolFull(_)
        )
    }

    fn from_status(s: Status, attempts: u32) -> Self {
        match s.code() {
            Code::InvalidArgument => AssignError::InvalidArgument(s.message().to_owned()),
            Code::DeadlineExceeded => AssignError::DeadlineExceeded,
            Code::Cancelled => AssignError::Cancelled(s.message().to_owned()),
            Code::ResourceExhausted => AssignError::PoolFull(s.message().to_owned()),
            Code::NotFound => AssignError::NotFound(s.message().to_owned()),
            Code::Unavailable | Code::FailedPrecondition => AssignError::Unavailable {
                message: s.message().to_owned(),
                attempts,
            },
            _ => AssignError::Status(s),
        }
    }
}

/// Backoff between retries: `initial`, doubling up to `max`, each drawn with br-backoff's equal
/// jitter (in [d/2, d], so never above `max`), and never past the deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// Most calls per `assign` (including the first); the deadline usually ends retries first.
    pub max_attempts: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            initial_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(250),
            max_attempts: 64,
        }
    }
}

impl RetryPolicy {
    /// The pause after the `attempt`-th failed call (1-based).
    fn backoff(&self, attempt: u32) -> Duration {
        br_backoff::delay(
            self.initial_backoff,
            self.max_backoff,
            attempt.saturating_sub(1),
            &mut rand::rng(),
        )
    }
}

/// Whether a failed call may be repeated with the same request id.
fn retryable(s: &Status) -> bool {
    match s.code() {
        Code::Unavailable | Code::FailedPrecondition => true,
        // h2 connection resets and broken pipes surface as Unknown/Internal with a transport
        // source; the server never sends those codes itself.
        Code::Unknown | Code::Internal => {
            std::error::Error::source(s).is_some()
                || s.message().contains("transport")
                || s.message().contains("connection")
        }
        _ => false,
    }
}

/// The gateway's Decision client. Cheap to clone (one shared HTTP/2 channel); use one per
/// process and call it from many tasks at once.
#[derive(Debug, Clone)]
pub struct AssignClient {
    inner: DecisionClient<Channel>,
    retry: RetryPolicy,
}

impl AssignClient {
    /// Connects to `addr` (e.g. `http://127.0.0.1:50063`); fails if it cannot connect now.
    pub async fn connect(addr: impl Into<String>) -> Result<Self, AssignError> {
        let (ep, addr) = endpoint(addr.into())?;
        let channel = ep.connect().await.map_err(|e| AssignError::Unavailable {
            message: format!("connecting to {addr}: {e}"),
            attempts: 1,
        })?;
        Ok(Self::from_channel(channel))
    }

    /// A client that connects on first use (and reconnects as needed); only a malformed
    /// address is an error. For gateways that may start before the decision service.
    pub fn connect_lazy(addr: impl Into<String>) -> Result<Self, AssignError> {
        let (ep, _) = endpoint(addr.into())?;
        Ok(Self::from_channel(ep.connect_lazy()))
    }

    /// [`AssignClient::connect_lazy`] over mutual TLS when `tls` is given (the gateway's own
    /// certificate; the server must present the decision role).
    pub fn connect_lazy_tls(
        addr: impl Into<String>,
        tls: Option<&std::sync::Arc<br_trust::TlsMaterial>>,
    ) -> Result<Self, AssignError> {
        let (ep, _) = endpoint(addr.into())?;
        let decision = Some(br_trust::Role::Decision);
        Ok(Self::from_channel(br_trust::tls::connect_lazy(
            ep, tls, decision,
        )))
    }

    /// Uses an existing channel (e.g. one with TLS or a load-balanced channel).
    pub fn from_channel(channel: Channel) -> Self {
        AssignClient {
            inner: DecisionClient::new(channel),
            retry: RetryPolicy::default(),
        }
    }

    /// Replaces the retry policy.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// [`assign`](Self::assign) with a deadline `timeout` from now.
    pub async fn assign_within(
        &self,
        params: &AssignParams,
        timeout: Duration,
    ) -> Result<Assignment, AssignError> {
        self.assign(params, Instant::now() + timeout).await
    }

    /// Asks for the rank of one request, waiting at most until `deadline` (pool wait and
    /// retries included). Retries keep the request id (see the module docs).
    pub async fn assign(
        &self,
        params: &AssignParams,
        deadline: Instant,
    ) -> Result<Assignment, AssignError> {
        let msg = params.to_request();
        let mut attempts = 0u32;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(AssignError::DeadlineExceeded);
            }
            attempts += 1;
            let mut req = tonic::Request::new(msg.clone());
            req.set_timeout(remaining);
            let mut client = self.inner.clone();
            // The server enforces grpc-timeout; the local timeout covers a peer that hangs.
            let res = tokio::time::timeout(remaining, client.assign(req)).await;
            let status = match res {
                Err(_elapsed) => return Err(AssignError::DeadlineExceeded),
                Ok(Ok(resp)) => return Ok(Assignment::from_response(resp.into_inner(), attempts)),
                Ok(Err(status)) => status,
            };
            if !retryable(&status) || attempts >= self.retry.max_attempts {
                return Err(AssignError::from_status(status, attempts));
            }
            let pause = self.retry.backoff(attempts);
            let remaining = deadline.saturating_duration_since(Instant::now());
            if pause >= remaining {
                // No time for another try: report why the last one failed.
                return Err(AssignError::from_status(status, attempts));
            }
            tracing::debug!(
                request_id = %params.request_id,
                code = ?status.code(),
                attempts,
                ?pause,
                "Assign failed, retrying with the same request id"
            );
            tokio::time::sleep(pause).await;
        }
    }

    /// Withdraws a request: it leaves the pool if it waits there (its `assign` ends with
    /// [`AssignError::Cancelled`]), or its reservation is released if it was assigned. Retries
    /// transient failures for up to [`DEFAULT_CANCEL_TIMEOUT`].
    pub async fn cancel(
        &self,
        group: &str,
        request_id: &str,
    ) -> Result<CancelOutcome, AssignError> {
        self.cancel_within(group, request_id, DEFAULT_CANCEL_TIMEOUT)
            .await
    }

    /// [`cancel`](Self::cancel) with an explicit overall timeout.
    pub async fn cancel_within(
        &self,
        group: &str,
        request_id: &str,
        timeout: Duration,
    ) -> Result<CancelOutcome, AssignError> {
        let deadline = Instant::now() + timeout;
        let msg = v1::CancelRequest {
            group: group.to_owned(),
            request_id: request_id.to_owned(),
        };
        let mut attempts = 0u32;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(AssignError::DeadlineExceeded);
            }
            attempts += 1;
            let mut req = tonic::Request::new(msg.clone());
            req.set_timeout(remaining);
            let mut client = self.inner.clone();
            let status = match tokio::time::timeout(remaining, client.cancel(req)).await {
                Err(_) => return Err(AssignError::DeadlineExceeded),
                Ok(Ok(resp)) => {
                    return Ok(match resp.into_inner().outcome() {
                        v1::CancelOutcome::Withdrawn => CancelOutcome::Withdrawn,
                        v1::CancelOutcome::Released => CancelOutcome::Released,
                        v1::CancelOutcome::NotFound | v1::CancelOutcome::Unspecified => {
                            CancelOutcome::NotFound
                        }
                    });
                }
                Ok(Err(s)) => s,
            };
            let pause = self.retry.backoff(attempts);
            if !retryable(&status)
                || attempts >= self.retry.max_attempts
                || pause >= deadline.saturating_duration_since(Instant::now())
            {
                return Err(AssignError::from_status(status, attempts));
            }
            tokio::time::sleep(pause).await;
        }
    }
}

fn endpoint(addr: String) -> Result<(Endpoint, String), AssignError> {
    let ep = Endpoint::from_shared(addr.clone()).map_err(|e| AssignError::BadAddress {
        addr: addr.clone(),
        detail: e.to_string(),
    })?;
    let ep = ep
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(2))
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true);
    Ok((ep, addr))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    use tokio::net::TcpListener;
    use tokio_stream::wrappers::TcpListenerStream;
    use v1::decision_server::{Decision, DecisionServer};

    /// Fails the first `fail` calls with `code`, then answers; records request ids.
    #[derive(Clone)]
    struct Flaky {
        fail: u32,
        code: Code,
        calls: Arc<AtomicU32>,
        ids: Arc<std::sync::Mutex<Vec<String>>>,
        timeouts: Arc<std::sync::Mutex<Vec<bool>>>,
    }

    #[tonic::async_trait]
    impl Decision for Flaky {
        async fn assign(
            &self,
            req: tonic::Request<v1::AssignRequest>,
        ) -> Result<tonic::Response<v1::AssignResponse>, Status> {
            self.timeouts
                .lock()
                .unwrap()
                .push(req.metadata().get("grpc-timeout").is_some());
            let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
            let m = req.into_inner();
            self.ids.lock().unwrap().push(m.request_id.clone());
            if n <= self.fail {
                return Err(Status::new(self.code, "try again"));
            }
            if m.prompt_tokens == 0 {
                return Err(Status::invalid_argument("prompt_tokens is 0"));
            }
            Ok(tonic::Response::new(v1::AssignResponse {
                worker_id: 3,
                endpoint: "http://rank3".into(),
                policy: "br0".into(),
                pool_wait_us: 1500,
                incarnation: 77,
                sigma_version: 9,
                stale: false,
            }))
        }
        async fn cancel(
            &self,
            req: tonic::Request<v1::CancelRequest>,
        ) -> Result<tonic::Response<v1::CancelResponse>, Status> {
            let outcome = if req.into_inner().request_id == "waiting" {
                v1::CancelOutcome::Withdrawn
            } else {
                v1::CancelOutcome::NotFound
            };
            Ok(tonic::Response::new(v1::CancelResponse {
                outcome: outcome as i32,
            }))
        }
    }

    async fn serve(svc: Flaky) -> (String, tokio::sync::oneshot::Sender<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(DecisionServer::new(svc))
                .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                    let _ = rx.await;
                })
                .await
                .unwrap();
        });
        (format!("http://{addr}"), tx)
    }

    fn flaky(fail: u32, code: Code) -> Flaky {
        Flaky {
            fail,
            code,
            calls: Arc::default(),
            ids: Arc::default(),
            timeouts: Arc::default(),
        }
    }

    #[tokio::test]
    async fn retries_unavailable_with_the_same_request_id() {
        let svc = flaky(3, Code::Unavailable);
        let (addr, stop) = serve(svc.clone()).await;
        let client = AssignClient::connect(&*addr).await.unwrap();
        let p = AssignParams::new("g", "req-1", 100).with_prompt_hash(5);
        let a = client
            .assign_within(&p, Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(a.worker_id, 3);
        assert_eq!(a.endpoint, "http://rank3");
        assert_eq!(a.pool_wait, Duration::from_micros(1500));
        assert_eq!((a.incarnation, a.sigma_version, a.stale), (77, 9, false));
        assert_eq!(a.attempts, 4);
        assert_eq!(*svc.ids.lock().unwrap(), vec!["req-1"; 4]);
        assert!(
            svc.timeouts.lock().unwrap().iter().all(|&t| t),
            "every attempt carries grpc-timeout"
        );
        let _ = stop.send(());
    }

    #[tokio::test]
    async fn standby_answers_are_retried_too() {
        let svc = flaky(1, Code::FailedPrecondition);
        let (addr, stop) = serve(svc.clone()).await;
        let client = AssignClient::connect(&*addr).await.unwrap();
        let a = client
            .assign_within(&AssignParams::new("g", "r", 1), Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(a.attempts, 2);
        let _ = stop.send(());
    }

    #[tokio::test]
    async fn typed_errors_are_not_retried() {
        for (code, want) in [
            (Code::InvalidArgument, Code::InvalidArgument),
            (Code::ResourceExhausted, Code::ResourceExhausted),
            (Code::DeadlineExceeded, Code::DeadlineExceeded),
            (Code::Cancelled, Code::Cancelled),
            (Code::NotFound, Code::NotFound),
        ] {
            let svc = flaky(u32::MAX, code);
            let (addr, stop) = serve(svc.clone()).await;
            let client = AssignClient::connect(&*addr).await.unwrap();
            let err = client
                .assign_within(&AssignParams::new("g", "r", 1), Duration::from_secs(10))
                .await
                .unwrap_err();
            assert_eq!(err.code(), want, "{err}");
            assert_eq!(svc.calls.load(Ordering::SeqCst), 1, "{code:?} not retried");
            let _ = stop.send(());
        }
    }

    #[tokio::test]
    async fn retries_stop_at_the_deadline() {
        let svc = flaky(u32::MAX, Code::Unavailable);
        let (addr, stop) = serve(svc.clone()).await;
        let client = AssignClient::connect(&*addr).await.unwrap();
        let err = client
            .assign_within(&AssignParams::new("g", "r", 1), Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(
            matches!(err, AssignError::Unavailable { attempts, .. } if attempts > 1),
            "{err:?}"
        );
        assert!(err.is_retryable());
        let _ = stop.send(());
    }

    #[tokio::test]
    async fn unreachable_service_is_unavailable_and_lazy_client_retries() {
        // A port that refuses connections, and that no other socket can take meanwhile.
        let down = br_testkit::ReservedPort::new();
        let addr = down.url();
        let err = AssignClient::connect(&*addr).await.unwrap_err();
        assert_eq!(err.code(), Code::Unavailable, "{err}");
        let client = AssignClient::connect_lazy(&*addr).unwrap();
        let err = client
            .assign_within(&AssignParams::new("g", "r", 1), Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(
            matches!(err.code(), Code::Unavailable | Code::DeadlineExceeded),
            "{err}"
        );
        assert!(matches!(
            AssignClient::connect_lazy("not a uri"),
            Err(AssignError::BadAddress { .. })
        ));
    }

    #[tokio::test]
    async fn cancel_maps_outcomes() {
        let svc = flaky(0, Code::Ok);
        let (addr, stop) = serve(svc).await;
        let client = AssignClient::connect(&*addr).await.unwrap();
        assert_eq!(
            client.cancel("g", "waiting").await.unwrap(),
            CancelOutcome::Withdrawn
        );
        assert_eq!(
            client.cancel("g", "other").await.unwrap(),
            CancelOutcome::NotFound
        );
        let _ = stop.send(());
    }

    #[test]
    fn backoff_starts_at_initial_and_never_exceeds_max() {
        let p = RetryPolicy::default();
        // The first retry waits about `initial_backoff`, not twice it (attempt is 1-based).
        let d = p.backoff(1);
        assert!(
            d >= p.initial_backoff / 2 && d <= p.initial_backoff,
            "{d:?}"
        );
        for attempt in 2..40 {
            let d = p.backoff(attempt);
            assert!(d <= p.max_backoff, "{attempt}: {d:?}");
        }
        assert!(p.backoff(20) >= p.max_backoff / 2);
    }
}
