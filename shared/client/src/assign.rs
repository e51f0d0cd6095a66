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
//!   `FAILED_PRECONDITION` (a standby replica answered) and transport errors, **keeping the same
//!   request id**: `Assign` is idempotent by `(group, request_id)`, so a retry after a lost
//!   response joins the same wait or gets the original answer, never a second reservation;
//! * does not retry anything else (`INVALID_ARGUMENT`, `RESOURCE_EXHAUSTED` (the pool is full:
//!   shed load instead), a `CANCELLED` the server sent (a `Cancel`), `NOT_FOUND`,
//!   `DEADLINE_EXCEEDED`); a `CANCELLED` made here because the connection broke is retried.
//!
//! # Several decision replicas (failover)
//! Decision runs active-active: every replica of a group decides, and the snapshot service's
//! serialised `Reserve` keeps them from placing one request id twice (a replica that reserves
//! an id σ already places answers with σ's placement). So a gateway may send any `Assign` to any
//! replica, and a retry of the same id on another replica is safe. The client takes a list of
//! addresses ([`AssignClient::connect_lazy_many`]); an address whose host is a DNS name (a
//! Kubernetes headless Service) stands for every address it resolves to, re-resolved every
//! [`ClientOptions::dns_refresh`]. Per call:
//!
//! * a replica is chosen by [`Selection`]: by default the first healthy one in a fixed order
//!   (resolved addresses sorted), so every gateway feeds one pool and batch admission sees the
//!   whole group (one pool routes better than two: docs/benchmarks.md "decision failover"); or
//!   round-robin over the healthy ones;
//! * a failed attempt (transport error, `UNAVAILABLE`, `FAILED_PRECONDITION`, or
//!   [`ClientOptions::attempt_timeout`] passing) marks that replica down for a while (250 ms,
//!   doubling to 5 s while it keeps failing) and the call is retried **at once on another
//!   replica with the same request id**; only when every replica failed in this call does it
//!   back off ([`RetryPolicy`]: jittered, doubling up to 250 ms) before the next round. All of
//!   it within the caller's deadline, which alone ends the retries unless
//!   [`RetryPolicy::max_attempts`] is set: a restarted decision service (seconds of refused
//!   connections, then "no σ yet") is ridden out by any call whose deadline outlasts it;
//! * a replica that is down is skipped until its time is up; then one call probes it (the
//!   others keep skipping it), and a success makes it healthy again;
//! * HTTP/2 keepalive (1 s interval, 1 s timeout by default) finds a frozen replica or a
//!   half-open connection in about 2 s, failing its calls so they move on; a killed replica's
//!   connections are reset by its kernel, so its calls move on at once.
//!
//! [`AssignClient::cancel`] goes to every replica (the request may wait in one replica's pool
//! and be reserved by another), and reports the strongest outcome.
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
//! // Two replicas; "http://decision.br-g8.svc:50063" (a headless Service) works the same way.
//! let client = AssignClient::connect_lazy_many(
//!     ["http://10.0.0.5:50063", "http://10.0.0.6:50063"],
//!     None,
//! )?;
//! let params = AssignParams::new("g8", "req-42", 3_197)
//!     .with_max_tokens(1_024)
//!     // optional hints for the brh-hinted policy: the expected output, the request class
//!     .with_expected_output_tokens(300)
//!     .with_request_class("chat");
//! let a = client.assign_within(&params, Duration::from_secs(5)).await?;
//! println!("send req-42 to rank {} ({}), waited {:?}", a.worker_id, a.endpoint, a.pool_wait);
//! # Ok(()) }
//! ```

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use br_proto::v1;
use br_proto::v1::decision_client::DecisionClient;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Code, Status};

mod error;
mod options;
mod params;
mod replicas;

pub use error::AssignError;
use error::retryable;
pub use options::{ClientOptions, RetryPolicy, Selection};
pub use params::{AssignParams, Assignment, CancelOutcome};
use replicas::{DnsTarget, Replica, Replicas, Resolved, channel, endpoint};

/// How long [`AssignClient::cancel`] tries (including retries) when no timeout is given.
pub const DEFAULT_CANCEL_TIMEOUT: Duration = Duration::from_secs(2);
/// First time a failed replica is skipped; doubled per further failure up to
/// [`MAX_EJECTION`].
pub const FIRST_EJECTION: Duration = Duration::from_millis(250);
/// Longest time a failing replica is skipped before one call probes it again.
pub const MAX_EJECTION: Duration = Duration::from_secs(5);

/// The gateway's Decision client over one or several replicas. Cheap to clone (the
/// connections are shared); use one per process and call it from many tasks at once.
#[derive(Debug, Clone)]
pub struct AssignClient {
    replicas: Arc<Replicas>,
    retry: RetryPolicy,
}

impl AssignClient {
    /// Connects to `addr` (e.g. `http://127.0.0.1:50063`); fails if it cannot connect now.
    pub async fn connect(addr: impl Into<String>) -> Result<Self, AssignError> {
        let addr = addr.into();
        let ep = endpoint(&addr, &ClientOptions::default(), false)?;
        let channel = ep.connect().await.map_err(|e| AssignError::Unavailable {
            message: format!("connecting to {addr}: {e}"),
            attempts: 1,
        })?;
        Ok(Self::from_replicas(
            vec![Arc::new(Replica::new(addr, channel))],
            Vec::new(),
            ClientOptions::default(),
            None,
        ))
    }

    /// A client that connects on first use (and reconnects as needed); only a malformed
    /// address is an error. For gateways that may start before the decision service.
    pub fn connect_lazy(addr: impl Into<String>) -> Result<Self, AssignError> {
        Self::connect_lazy_many([addr.into()], None)
    }

    /// [`AssignClient::connect_lazy`] over mutual TLS when `tls` is given (the gateway's own
    /// certificate; the server must present the decision role).
    pub fn connect_lazy_tls(
        addr: impl Into<String>,
        tls: Option<&Arc<br_trust::TlsMaterial>>,
    ) -> Result<Self, AssignError> {
        Self::connect_lazy_many([addr.into()], tls)
    }

    /// A client of several decision replicas, each connected on first use, with the default
    /// [`ClientOptions`]. Each address is `http://HOST:PORT`; a HOST that is a DNS name stands
    /// for every address it resolves to (re-resolved every [`ClientOptions::dns_refresh`]).
    /// Mutual TLS when `tls` is given (every replica must present the decision role).
    pub fn connect_lazy_many(
        addrs: impl IntoIterator<Item = impl Into<String>>,
        tls: Option<&Arc<br_trust::TlsMaterial>>,
    ) -> Result<Self, AssignError> {
        Self::with_options(addrs, tls, ClientOptions::default())
    }

    /// [`AssignClient::connect_lazy_many`] with explicit options.
    pub fn with_options(
        addrs: impl IntoIterator<Item = impl Into<String>>,
        tls: Option<&Arc<br_trust::TlsMaterial>>,
        options: ClientOptions,
    ) -> Result<Self, AssignError> {
        let mut fixed = Vec::new();
        let mut dns = Vec::new();
        for addr in addrs {
            let addr: String = addr.into();
            let addr = addr.trim().to_owned();
            // The scheme is checked here for every address, names resolved later included:
            // `https://` needs a certificate (the TLS is made from it, not from the scheme).
            br_trust::address::dial_address(&addr, tls.is_some()).map_err(|e| {
                AssignError::BadAddress {
                    addr: addr.clone(),
                    detail: e.to_string(),
                }
            })?;
            let uri: Uri = addr
                .parse()
                .map_err(
                    |e: tonic::codegen::http::uri::InvalidUri| AssignError::BadAddress {
                        addr: addr.clone(),
                        detail: e.to_string(),
                    },
                )?;
            let bad = |detail: &str| AssignError::BadAddress {
                addr: addr.clone(),
                detail: detail.to_owned(),
            };
            let scheme = uri.scheme_str().ok_or_else(|| bad("no scheme (http://)"))?;
            let host = uri.host().ok_or_else(|| bad("no host"))?;
            let literal = host.trim_start_matches('[').trim_end_matches(']');
            if literal.parse::<IpAddr>().is_ok() {
                if !fixed.iter().any(|r: &Arc<Replica>| r.addr == addr) {
                    let ch = channel(&addr, &options, tls)?;
                    fixed.push(Arc::new(Replica::new(addr, ch)));
                }
            } else {
                let default_port = if scheme == "https" { 443 } else { 80 };
                dns.push(DnsTarget {
                    scheme: scheme.to_owned(),
                    host: host.to_owned(),
                    port: uri.port_u16().unwrap_or(default_port),
                    addr,
                });
            }
        }
        if fixed.is_empty() && dns.is_empty() {
            return Err(AssignError::BadAddress {
                addr: String::new(),
                detail: "no decision service address".into(),
            });
        }
        Ok(Self::from_replicas(fixed, dns, options, tls.cloned()))
    }

    /// Uses an existing channel (e.g. one with custom TLS or a load-balanced channel).
    pub fn from_channel(channel: Channel) -> Self {
        Self::from_replicas(
            vec![Arc::new(Replica::new("channel".into(), channel))],
            Vec::new(),
            ClientOptions::default(),
            None,
        )
    }

    fn from_replicas(
        fixed: Vec<Arc<Replica>>,
        dns: Vec<DnsTarget>,
        options: ClientOptions,
        tls: Option<Arc<br_trust::TlsMaterial>>,
    ) -> Self {
        let resolved = Resolved {
            list: Arc::new(fixed.clone()),
            at: None,
            error: None,
        };
        AssignClient {
            replicas: Arc::new(Replicas {
                fixed,
                dns,
                resolved: RwLock::new(resolved),
                resolving: tokio::sync::Mutex::new(()),
                options,
                tls,
                next: AtomicUsize::new(0),
            }),
            retry: RetryPolicy::default(),
        }
    }

    /// Replaces the retry policy.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// The replicas' addresses as currently known (DNS names resolved), in selection order,
    /// each with whether it is currently skipped as down.
    pub async fn replicas(&self) -> Result<Vec<(String, bool)>, AssignError> {
        let now = Instant::now();
        Ok(self
            .replicas
            .current()
            .await?
            .iter()
            .map(|r| {
                (
                    r.addr.clone(),
                    r.health().down_until.is_some_and(|t| t > now),
                )
            })
            .collect())
    }

    /// [`assign`](Self::assign) with a deadline `timeout` from now.
    pub async fn assign_within(
        &self,
        params: &AssignParams,
        timeout: Duration,
    ) -> Result<Assignment, AssignError> {
        self.assign(params, Instant::now() + timeout).await
    }

    /// Asks for the rank of one request, waiting at most until `deadline` (pool wait, retries
    /// and failovers included). Retries keep the request id (see the module docs).
    pub async fn assign(
        &self,
        params: &AssignParams,
        deadline: Instant,
    ) -> Result<Assignment, AssignError> {
        let msg = params.to_request();
        let attempt_timeout = self.replicas.options.attempt_timeout;
        let mut attempts = 0u32;
        let mut rounds = 0u32;
        let mut tried: Vec<bool> = Vec::new();
        let mut last: Option<AssignError> = None;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(last_or_deadline(last));
            }
            let list = match self.replicas.current().await {
                Ok(l) => l,
                Err(e) => {
                    // Nothing to call (a name that does not resolve): back off like a round.
                    rounds += 1;
                    if !self.pause(rounds, deadline).await {
                        return Err(e);
                    }
                    last = Some(e);
                    continue;
                }
            };
            if tried.len() != list.len() {
                // The resolved list changed: a new round over the new list.
                tried = vec![false; list.len()];
            }
            let Some(i) = self.replicas.pick(&list, &tried, Instant::now()) else {
                // Every replica failed once in this call: back off, then try them all again.
                rounds += 1;
                tried.iter_mut().for_each(|t| *t = false);
                if !self.pause(rounds, deadline).await {
                    return Err(last_or_deadline(last));
                }
                continue;
            };
            tried[i] = true;
            let replica = &list[i];
            attempts += 1;
            let budget = attempt_timeout.map_or(remaining, |t| t.min(remaining));
            let mut req = tonic::Request::new(msg.clone());
            // The server withdraws the request itself when this passes (nothing left behind).
            req.set_timeout(budget);
            let mut client = replica.client.clone();
            let started = Instant::now();
            // The local timeout covers a peer that hangs.
            let status = match tokio::time::timeout(budget, client.assign(req)).await {
                Ok(Ok(resp)) => {
                    replica.succeeded();
                    return Ok(Assignment::from_response(
                        resp.into_inner(),
                        attempts,
                        &replica.addr,
                    ));
                }
                Ok(Err(status)) => status,
                Err(_elapsed) if budget >= remaining => {
                    return Err(AssignError::DeadlineExceeded);
                }
                Err(_elapsed) => Status::unavailable(format!(
                    "no answer from {} within the attempt timeout {budget:?}",
                    replica.addr
                )),
            };
            // An attempt the server ended at its grpc-timeout (DEADLINE_EXCEEDED from
            // br-decision, CANCELLED from a plain tonic server's timeout; a CANCELLED well
            // before it is a real `Cancel`): at the caller's deadline that is the caller's
            // DEADLINE_EXCEEDED; for a shortened attempt, the replica's failure to answer.
            let timed_out = match status.code() {
                Code::DeadlineExceeded => true,
                Code::Cancelled => started.elapsed() >= budget.mul_f64(0.9),
                _ => false,
            };
            if timed_out && budget >= remaining {
                return Err(AssignError::DeadlineExceeded);
            }
            let attempt_ran_out = timed_out;
            if !(retryable(&status) || attempt_ran_out) || self.retry.exhausted(attempts) {
                return Err(AssignError::from_status(status, attempts));
            }
            replica.failed(Instant::now());
            tracing::debug!(
                request_id = %params.request_id,
                replica = %replica.addr,
                code = ?status.code(),
                attempts,
                "Assign failed; retrying with the same request id on another replica"
            );
            last = Some(AssignError::Unavailable {
                message: format!("{}: {}", replica.addr, status.message()),
                attempts,
            });
        }
    }

    /// Sleeps the backoff of the `round`-th failed round; false if that would pass `deadline`.
    async fn pause(&self, round: u32, deadline: Instant) -> bool {
        let pause = self.retry.backoff(round);
        if pause >= deadline.saturating_duration_since(Instant::now()) {
            return false;
        }
        tokio::time::sleep(pause).await;
        true
    }

    /// Withdraws a request: it leaves the pool if it waits there (its `assign` ends with
    /// [`AssignError::Cancelled`]), or its reservation is released if it was assigned. Sent to
    /// every replica at once (an earlier attempt may still wait in another replica's pool);
    /// retries transient failures for up to [`DEFAULT_CANCEL_TIMEOUT`].
    pub async fn cancel(
        &self,
        group: &str,
        request_id: &str,
    ) -> Result<CancelOutcome, AssignError> {
        self.cancel_within(group, request_id, DEFAULT_CANCEL_TIMEOUT)
            .await
    }

    /// [`cancel`](Self::cancel) with an explicit overall timeout. The outcome is the strongest
    /// any replica reported (WITHDRAWN over RELEASED over NOT_FOUND); an error only if no
    /// replica answered.
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
        let list = self.replicas.current().await?;
        let calls = list
            .iter()
            .map(|r| cancel_one(r, &msg, deadline, self.retry));
        let mut best: Option<CancelOutcome> = None;
        let mut error = None;
        for r in futures::future::join_all(calls).await {
            match r {
                Ok(o) => best = best.max(Some(o)),
                Err(e) => error = error.or(Some(e)),
            }
        }
        match (best, error) {
            (Some(o), _) => Ok(o),
            (None, Some(e)) => Err(e),
            (None, None) => Err(AssignError::Unavailable {
                message: "no decision replica".into(),
                attempts: 0,
            }),
        }
    }
}

fn last_or_deadline(last: Option<AssignError>) -> AssignError {
    last.unwrap_or(AssignError::DeadlineExceeded)
}

/// One replica's `Cancel`, retried on transient failures until `deadline`.
async fn cancel_one(
    replica: &Replica,
    msg: &v1::CancelRequest,
    deadline: Instant,
    retry: RetryPolicy,
) -> Result<CancelOutcome, AssignError> {
    let mut attempts = 0u32;
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(AssignError::DeadlineExceeded);
        }
        attempts += 1;
        let mut req = tonic::Request::new(msg.clone());
        req.set_timeout(remaining);
        let mut client = replica.client.clone();
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
        let pause = retry.backoff(attempts);
        if !retryable(&status)
            || retry.exhausted(attempts)
            || pause >= deadline.saturating_duration_since(Instant::now())
        {
            return Err(AssignError::from_status(status, attempts));
        }
        tokio::time::sleep(pause).await;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests;
