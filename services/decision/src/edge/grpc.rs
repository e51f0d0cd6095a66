//! The `balanceroute.v1.Decision` handlers: validate at the edge, hand the request to its
//! group's task, wait for the answer until the call's deadline.
//!
//! Deadlines: the call's `grpc-timeout` (capped by `--max-wait`, which also applies when the
//! caller sent none). The handler stops waiting a little before it (`margin`), so it can answer
//! a typed DEADLINE_EXCEEDED and withdraw the request itself; tonic drops the handler future
//! at the deadline anyway, and then a drop guard withdraws it (and hands back an answer that
//! arrived but was never read, so its reservation is released).

use std::sync::Arc;
use std::time::{Duration, Instant};

use br_proto::v1;
use br_proto::valid::{RequestId, ValidAssign, ValidCancel};
use br_runtime::error::{ServiceError as _, code_label};
use rustc_hash::FxHashMap;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::error::DecisionError;
use crate::group::{Assignment, CancelOutcome};
use crate::metrics::Metrics;
use crate::task::{Command, GroupHandle};

/// Who makes a call, as far as binding a request to the identity that assigned it goes
/// (mutual TLS; br-trust's authorization layer put the verified identity on the request).
#[derive(Debug, Clone, Default)]
pub enum Caller {
    /// A plaintext server: no identity, nothing is bound and any caller may cancel any
    /// request (the loopback-only deployment's behaviour).
    #[default]
    Anonymous,
    /// The admin role (an operator): its Assigns are bound to it, and it may cancel any
    /// request.
    Admin(Arc<str>),
    /// Any other identity (a gateway): its Assigns are bound to its SPIFFE id, and it may
    /// cancel only the requests bound to that id.
    Peer(Arc<str>),
}

impl Caller {
    /// The caller of a request that passed br-trust's layer (`None`: plaintext).
    pub fn of(identity: Option<&br_trust::Identity>) -> Caller {
        match identity {
            None => Caller::Anonymous,
            Some(id) if id.role == br_trust::Role::Admin => {
                Caller::Admin(Arc::from(id.spiffe_id.as_str()))
            }
            Some(id) => Caller::Peer(Arc::from(id.spiffe_id.as_str())),
        }
    }

    /// What an Assign binds its request to.
    fn owner(&self) -> Option<Arc<str>> {
        match self {
            Caller::Anonymous => None,
            Caller::Admin(id) | Caller::Peer(id) => Some(id.clone()),
        }
    }

    /// What a Cancel is checked against the request's owner with (`None`: not checked).
    fn checked(&self) -> Option<Arc<str>> {
        match self {
            Caller::Peer(id) => Some(id.clone()),
            Caller::Anonymous | Caller::Admin(_) => None,
        }
    }
}

/// The Decision gRPC service.
#[derive(Clone)]
pub struct DecisionService {
    groups: Arc<FxHashMap<String, GroupHandle>>,
    metrics: Metrics,
    max_wait: Duration,
    shutdown: CancellationToken,
}

impl std::fmt::Debug for DecisionService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecisionService")
            .field("groups", &self.groups.keys().collect::<Vec<_>>())
            .field("max_wait", &self.max_wait)
            .finish()
    }
}

impl DecisionService {
    pub fn new(
        groups: impl IntoIterator<Item = GroupHandle>,
        metrics: Metrics,
        max_wait: Duration,
        shutdown: CancellationToken,
    ) -> Self {
        let groups = groups
            .into_iter()
            .map(|h| (h.group().to_string(), h))
            .collect();
        DecisionService {
            groups: Arc::new(groups),
            metrics,
            max_wait,
            shutdown,
        }
    }

    fn group(&self, name: &str) -> Result<&GroupHandle, DecisionError> {
        self.groups
            .get(name)
            .ok_or_else(|| DecisionError::UnknownGroup(name.to_owned()))
    }

    /// The metrics label of a group: its name if served, else `unknown` (bounded cardinality).
    fn label<'a>(&self, name: &'a str) -> &'a str {
        if self.groups.contains_key(name) {
            name
        } else {
            "unknown"
        }
    }

    async fn do_assign(
        &self,
        req: ValidAssign,
        deadline: Instant,
        caller: &Caller,
    ) -> Result<Assignment, DecisionError> {
        if self.shutdown.is_cancelled() {
            return Err(DecisionError::ShuttingDown);
        }
        let handle = self.group(req.group.as_str())?;
        let (tx, rx) = oneshot::channel();
        let call = handle.next_call();
        let mut guard = Withdraw {
            handle: handle.clone(),
            id: req.request_id.clone(),
            call,
            rx: Some(rx),
        };
        let send = handle.send(Command::Assign {
            req,
            call,
            reply: tx,
            // this call's span (the gRPC server span, or the HTTP/JSON or ext_proc one), for
            // the link from the Reserve span that will carry its reservation
            span: br_trace::span_context(&tracing::Span::current()),
            owner: caller.owner(),
        });
        match tokio::time::timeout_at(deadline.into(), send).await {
            Ok(r) => r?,
            Err(_) => return Err(DecisionError::DeadlineExceeded),
        }
        guard.wait(deadline).await
    }

    /// One `Assign` as every front end makes it (the gRPC method, the ext_proc endpoint
    /// picker): validated at the edge, placed by the group's task, waited for at most
    /// `timeout` (capped by `--max-wait`), and counted in the Assign metrics. Under mutual
    /// TLS the request is bound to `caller`, the one identity whose `Cancel` it accepts.
    pub async fn assign_call(
        &self,
        msg: v1::AssignRequest,
        timeout: Duration,
        caller: &Caller,
    ) -> Result<v1::AssignResponse, DecisionError> {
        let started = Instant::now();
        let timeout = timeout.min(self.max_wait);
        let deadline = started + timeout.saturating_sub(margin(timeout));
        let group = msg.group.clone();
        let result = match ValidAssign::try_from(msg) {
            Ok(req) => self.do_assign(req, deadline, caller).await,
            Err(e) => Err(e.into()),
        }
        .map(v1::AssignResponse::from);
        let label = self.label(&group);
        match &result {
            Ok(resp) => {
                let added = started
                    .elapsed()
                    .saturating_sub(Duration::from_micros(resp.pool_wait_us));
                self.metrics
                    .assign_latency
                    .with_label_values(&[label])
                    .observe(added.as_secs_f64());
                self.metrics
                    .assign_total
                    .with_label_values(&[label, "ok"])
                    .inc();
            }
            Err(e) => {
                self.metrics
                    .assign_total
                    .with_label_values(&[label, code_label(e.grpc_code())])
                    .inc();
                tracing::debug!(error = %e, "Assign failed");
            }
        }
        result
    }

    /// One `Cancel` as every front end makes it: a waiting request leaves the pool, an
    /// answered one has its reservation released (`Snapshot.Release`); counted by outcome.
    /// Under mutual TLS only the identity that assigned the request (or the admin role) may
    /// cancel it: anyone else is refused PERMISSION_DENIED, counted in
    /// `balanceroute_decision_cancel_denied_total` and logged.
    pub async fn cancel_call(
        &self,
        msg: v1::CancelRequest,
        caller: &Caller,
    ) -> Result<CancelOutcome, DecisionError> {
        let label = self.label(&msg.group).to_owned();
        let result: Result<CancelOutcome, DecisionError> = async {
            let req = ValidCancel::try_from(msg)?;
            let handle = self.group(req.group.as_str())?;
            let (reply, rx) = oneshot::channel();
            handle
                .send(Command::Cancel {
                    id: req.request_id,
                    caller: caller.checked(),
                    reply,
                })
                .await?;
            rx.await.map_err(|_| DecisionError::ShuttingDown)?
        }
        .await;
        let outcome = match &result {
            Ok(outcome) => outcome.label(),
            Err(e @ DecisionError::NotOwner { .. }) => {
                self.metrics
                    .cancel_denied_total
                    .with_label_values(&[&label])
                    .inc();
                tracing::warn!(group = %label, error = %e, "Cancel denied");
                "denied"
            }
            Err(_) => "error",
        };
        self.metrics
            .cancel_total
            .with_label_values(&[&label, outcome])
            .inc();
        result
    }
}

/// Withdraws a waiting call from its group when the handler stops waiting for any reason.
struct Withdraw {
    handle: GroupHandle,
    id: RequestId,
    call: u64,
    rx: Option<oneshot::Receiver<Result<Assignment, DecisionError>>>,
}

impl Withdraw {
    async fn wait(&mut self, deadline: Instant) -> Result<Assignment, DecisionError> {
        let Some(rx) = self.rx.as_mut() else {
            return Err(DecisionError::ShuttingDown);
        };
        match tokio::time::timeout_at(deadline.into(), &mut *rx).await {
            Ok(Ok(answer)) => {
                self.rx = None;
                answer
            }
            Ok(Err(_)) => {
                self.rx = None;
                Err(DecisionError::ShuttingDown)
            }
            Err(_) => {
                // No further answer can arrive after close(); one that already did wins.
                rx.close();
                if let Ok(answer) = rx.try_recv() {
                    self.rx = None;
                    return answer;
                }
                self.rx = None;
                let cmd = Command::Withdraw {
                    id: self.id.clone(),
                    call: self.call,
                    undelivered: false,
                };
                // Waiting here is fine: the caller's deadline has passed anyway.
                let _ = self.handle.send(cmd).await;
                Err(DecisionError::DeadlineExceeded)
            }
        }
    }
}

impl Drop for Withdraw {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        rx.close();
        let undelivered = matches!(rx.try_recv(), Ok(Ok(_)));
        let _ = self.handle.try_send(Command::Withdraw {
            id: self.id.clone(),
            call: self.call,
            undelivered,
        });
    }
}

/// Parses a `grpc-timeout` header value (`<digits><unit>`, unit one of H M S m u n).
pub fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// How much earlier than the caller's deadline the handler gives up, so it answers before
/// tonic cancels the call.
fn margin(timeout: Duration) -> Duration {
    (timeout / 20).min(Duration::from_millis(2))
}

#[tonic::async_trait]
impl v1::decision_server::Decision for DecisionService {
    #[tracing::instrument(level = "debug", skip_all, fields(group, request_id))]
    async fn assign(
        &self,
        request: Request<v1::AssignRequest>,
    ) -> Result<Response<v1::AssignResponse>, Status> {
        let caller = Caller::of(br_trust::policy::caller(&request));
        let timeout = request
            .metadata()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout)
            .map_or(self.max_wait, |t| t.min(self.max_wait));
        let msg = request.into_inner();
        let span = tracing::Span::current();
        span.record("group", msg.group.as_str());
        span.record("request_id", msg.request_id.as_str());
        match self.assign_call(msg, timeout, &caller).await {
            Ok(resp) => Ok(Response::new(resp)),
            Err(e) => Err(e.into()),
        }
    }

    #[tracing::instrument(level = "debug", skip_all)]
    async fn cancel(
        &self,
        request: Request<v1::CancelRequest>,
    ) -> Result<Response<v1::CancelResponse>, Status> {
        let caller = Caller::of(br_trust::policy::caller(&request));
        let outcome = self.cancel_call(request.into_inner(), &caller).await?;
        Ok(Response::new(v1::CancelResponse {
            outcome: v1::CancelOutcome::from(outcome) as i32,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_values() {
        assert_eq!(parse_grpc_timeout("100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse_grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("250u"), Some(Duration::from_micros(250)));
        assert_eq!(
            parse_grpc_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        assert_eq!(parse_grpc_timeout("m"), None);
        assert_eq!(parse_grpc_timeout("10x"), None);
        assert_eq!(parse_grpc_timeout("-1m"), None);
        assert_eq!(parse_grpc_timeout("123456789S"), None, "at most 8 digits");
    }

    #[test]
    fn margin_is_small() {
        assert_eq!(margin(Duration::from_secs(10)), Duration::from_millis(2));
        assert_eq!(
            margin(Duration::from_millis(10)),
            Duration::from_micros(500)
        );
    }
}
