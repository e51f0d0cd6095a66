//! HTTP/JSON for gateways without gRPC (`--http-listen`): `POST /v1/assign` and
//! `POST /v1/cancel`, the same calls as `balanceroute.v1.Decision`'s Assign and Cancel.
//!
//! This module owns only the edge: the listener (plaintext on loopback, or mutual TLS with
//! the gRPC port's certificates and bounds), the JSON shape, the deadline headers and the
//! mapping of a gRPC status to an HTTP one. Every call is handed to the very
//! [`DecisionService`] the gRPC port serves, as a `tonic::Request`, so validation,
//! idempotency, deadlines, cancellation and the Assign/Cancel metrics are the gRPC ones;
//! authorisation is br-trust's method × role table, checked with the gRPC method's path.
//!
//! The JSON is proto3's JSON mapping of `AssignRequest`/`CancelRequest` (field names as in the
//! proto; lowerCamelCase accepted too; 64-bit integers answered as strings and accepted as a
//! string or a number; `null` is the default). Unknown fields are refused (a typo in an
//! optional field must not be silently dropped). Errors are
//! `{"code": "INVALID_ARGUMENT", "message": "..."}` with grpc-gateway's HTTP status for the
//! code ([`error::http_status`]).
//!
//! A body still arriving is charged to the process's budget of unfinished request bytes, the
//! one its gRPC ports charge their messages to ([`br_runtime::InFlightBudget`]); see
//! `budget::charged`.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use br_proto::v1;
use br_proto::v1::decision_server::Decision as _;
use br_runtime::InFlightBudget;
use br_runtime::config::CommonArgs;
use br_runtime::http_serve::{HttpServing, serve_http};
use br_runtime::serve::{ServeOutcome, TLS_HANDSHAKE_TIMEOUT};
use br_runtime::skeleton::{self, Edge, StartError};
use br_trust::IdentityReader;
use br_trust::accept::Held;
use br_trust::policy::DenyHook;
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;

use crate::edge::grpc::{DecisionService, parse_grpc_timeout};
use crate::metrics::{Metrics, ROUTE_ASSIGN, ROUTE_CANCEL, ROUTE_OTHER};

mod budget;
mod deadline;
mod error;
mod json;
mod listener;

use budget::BodyBudget;
pub use deadline::{deadline_of, format_grpc_timeout};
pub use error::JsonError;
pub use json::{AssignJson, AssignJsonResponse, CancelJson};
use json::{CancelJsonResponse, json_body};
pub use listener::{JsonListener, JsonPeer, bind};

/// The largest request body taken: an AssignRequest at every field's limit is under 1 KiB,
/// so this leaves room for any formatting and still bounds what a peer makes us buffer
/// (the gRPC port's bound is tonic's 4 MiB message limit; JSON needs far less).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// The header that carries a deadline as a duration with a unit (`250ms`, `5s`); the other
/// accepted one is gRPC's own `grpc-timeout` (`250m`, `5S`). With both, the shorter wins; as
/// on the gRPC port the deadline is capped by `--max-wait`, which also applies without one.
pub const TIMEOUT_HEADER: &str = "x-request-timeout";

const GRPC_ASSIGN: &str = "/balanceroute.v1.Decision/Assign";
const GRPC_CANCEL: &str = "/balanceroute.v1.Decision/Cancel";

/// Who may call: br-trust's table read with the gRPC method's path, and the denial counter
/// the gRPC port uses. `None` on a plaintext (loopback) listener, as on the gRPC port.
#[derive(Clone)]
pub struct Authz {
    pub reader: IdentityReader,
    pub on_deny: Option<DenyHook>,
}

impl Authz {
    /// The service's authorisation when it serves TLS.
    pub fn of(edge: &Edge) -> Option<Authz> {
        edge.serving().map(|tls| Authz {
            reader: tls.material.reader().clone(),
            on_deny: tls.on_deny,
        })
    }
}

#[derive(Clone)]
struct JsonState {
    svc: DecisionService,
    metrics: Metrics,
    authz: Option<Authz>,
    max_wait: Duration,
    in_flight: Arc<InFlightBudget>,
}

/// The routes, for [`serve`] (which gives every request its connection's [`JsonPeer`] as
/// `ConnectInfo`). Bodies still arriving are charged to `in_flight`: the process's one budget,
/// the gRPC ports' ([`Edge::in_flight_budget`]).
pub fn router(
    svc: DecisionService,
    metrics: Metrics,
    authz: Option<Authz>,
    max_wait: Duration,
    in_flight: Arc<InFlightBudget>,
) -> Router {
    Router::new().fallback(handle).with_state(JsonState {
        svc,
        metrics,
        authz,
        max_wait,
        in_flight,
    })
}

/// Serves `router` on `listener` until `shutdown`, then lets the requests in flight finish
/// for at most `grace` (as the gRPC port drains), with br-runtime's HTTP accept loop: each
/// connection has `header_timeout` to send a request's head (a client that trickles its
/// headers would otherwise hold its connection slot for ever; axum::serve sets no such
/// bound), and ends gracefully (after the request in flight) on shutdown. Each request
/// carries its [`JsonPeer`] as `ConnectInfo`.
pub async fn serve(
    listener: JsonListener,
    router: Router,
    shutdown: CancellationToken,
    grace: Duration,
    header_timeout: Duration,
) -> Result<ServeOutcome, io::Error> {
    let addr = listener.local_addr();
    let tls = matches!(listener.conns, Either::Right(_));
    // DEBUG: br-decision's one start-up line (INFO) names this address.
    tracing::debug!(%addr, tls, "HTTP/JSON server listening");
    let how = HttpServing {
        name: "HTTP/JSON",
        header_timeout,
        grace: Some(grace),
    };
    Ok(serve_http(listener, router, how, shutdown).await)
}

// ---- the handler ----

async fn handle(
    State(s): State<JsonState>,
    ConnectInfo(peer): ConnectInfo<JsonPeer>,
    req: Request,
) -> Response {
    let route = match req.uri().path() {
        ROUTE_ASSIGN => ROUTE_ASSIGN,
        ROUTE_CANCEL => ROUTE_CANCEL,
        _ => ROUTE_OTHER,
    };
    let call = Counted::new(&s.metrics, route);
    // The call continues the client's trace (`traceparent`), like a gRPC call's metadata.
    let span = br_trace::server_span(
        format_args!("{} {route}", req.method()),
        br_trace::context_from_headers(req.headers()),
    );
    let response = match route {
        ROUTE_ASSIGN => tracing::Instrument::instrument(assign(&s, &peer, req), span).await,
        ROUTE_CANCEL => tracing::Instrument::instrument(cancel(&s, &peer, req), span).await,
        _ => Err(JsonError::new(
            StatusCode::NOT_FOUND,
            tonic::Code::NotFound,
            format!(
                "no route {:?}; this port serves POST {ROUTE_ASSIGN} and POST {ROUTE_CANCEL}",
                req.uri().path()
            ),
        )),
    }
    .unwrap_or_else(|e| {
        tracing::debug!(route, status = %e.status, message = %e.message, "HTTP/JSON call failed");
        e.into_response()
    });
    call.answered(response.status());
    response
}

/// One call's count and duration in the HTTP metrics, recorded however it ends: with its
/// answer's status, or as 499 (nginx's "client closed request") when the client closed the
/// connection first, which makes hyper drop the handler. A Cancel whose gateway exits as soon
/// as the Assign it withdrew returns has done its work by then; without this it went
/// uncounted.
struct Counted<'a> {
    metrics: &'a Metrics,
    route: &'static str,
    started: Instant,
    /// The answer's, once there is one; until then CANCELLED's (499), what a call whose client
    /// left is counted under.
    status: StatusCode,
}

impl<'a> Counted<'a> {
    fn new(metrics: &'a Metrics, route: &'static str) -> Counted<'a> {
        Counted {
            metrics,
            route,
            started: Instant::now(),
            status: error::http_status(tonic::Code::Cancelled),
        }
    }

    fn answered(mut self, status: StatusCode) {
        self.status = status;
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.metrics
            .http_requests_total
            .with_label_values(&[self.route, self.status.as_str()])
            .inc();
        self.metrics
            .http_request_duration
            .with_label_values(&[self.route])
            .observe(self.started.elapsed().as_secs_f64());
    }
}

/// What every call checks before its body is read: the method, the caller (as the gRPC
/// port's layer does, before the handler), and the deadline.
fn admit(
    s: &JsonState,
    peer: &JsonPeer,
    req: &Request,
    grpc_path: &str,
) -> Result<(Option<br_trust::Identity>, Duration), JsonError> {
    if req.method() != Method::POST {
        return Err(JsonError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            tonic::Code::Unimplemented,
            format!("{} takes POST, not {}", req.uri().path(), req.method()),
        ));
    }
    let identity = match &s.authz {
        None => None,
        Some(authz) => {
            match br_trust::policy::authorize(grpc_path, peer.cert.as_deref(), &authz.reader) {
                Ok(id) => Some(id),
                Err((reason, message)) => {
                    if let Some(hook) = &authz.on_deny {
                        hook(reason, &message);
                    }
                    tracing::warn!(reason = reason.label(), %message, peer = %peer.addr,
                        "HTTP/JSON call denied");
                    return Err(JsonError::new(
                        StatusCode::FORBIDDEN,
                        tonic::Code::PermissionDenied,
                        message,
                    ));
                }
            }
        }
    };
    let timeout = deadline_of(req.headers())?.map_or(s.max_wait, |t| t.min(s.max_wait));
    Ok((identity, timeout))
}

/// Where `peer`'s body is charged.
fn body_budget(s: &JsonState, peer: &JsonPeer) -> BodyBudget {
    BodyBudget {
        budget: s.in_flight.clone(),
        connection: (Some(peer.local), Some(peer.addr)),
    }
}

/// A tonic request carrying what the gRPC port's layers would have put there: the deadline
/// as `grpc-timeout` and the caller's identity.
fn grpc_request<T>(
    msg: T,
    identity: Option<br_trust::Identity>,
    timeout: Option<Duration>,
) -> Result<tonic::Request<T>, JsonError> {
    let mut req = tonic::Request::new(msg);
    if let Some(t) = timeout {
        let v = format_grpc_timeout(t)
            .parse()
            .map_err(|_| JsonError::invalid("the deadline cannot be expressed"))?;
        req.metadata_mut().insert("grpc-timeout", v);
    }
    if let Some(id) = identity {
        req.extensions_mut().insert(id);
    }
    Ok(req)
}

async fn assign(s: &JsonState, peer: &JsonPeer, req: Request) -> Result<Response, JsonError> {
    let (identity, timeout) = admit(s, peer, &req, GRPC_ASSIGN)?;
    let started = Instant::now();
    let body: AssignJson = json_body(req, timeout, body_budget(s, peer)).await?;
    let left = timeout.saturating_sub(started.elapsed());
    if left.is_zero() {
        return Err(tonic::Status::deadline_exceeded("the deadline passed").into());
    }
    let req = grpc_request(body.into_proto(), identity, Some(left))?;
    let resp = s.svc.assign(req).await?.into_inner();
    Ok(axum::Json(AssignJsonResponse::from(resp)).into_response())
}

async fn cancel(s: &JsonState, peer: &JsonPeer, req: Request) -> Result<Response, JsonError> {
    let (identity, timeout) = admit(s, peer, &req, GRPC_CANCEL)?;
    let deadline = Instant::now() + timeout;
    let body: CancelJson = json_body(req, timeout, body_budget(s, peer)).await?;
    let req = grpc_request(body.into_proto(), identity, None)?;
    // Cancel has no deadline of its own on the gRPC port (tonic's would cut it); here the
    // handler is the only one that can.
    let resp = tokio::time::timeout_at(deadline.into(), s.svc.cancel(req))
        .await
        .map_err(|_| tonic::Status::deadline_exceeded("Cancel did not finish in time"))??
        .into_inner();
    let outcome = v1::CancelOutcome::try_from(resp.outcome)
        .unwrap_or(v1::CancelOutcome::Unspecified)
        .as_str_name();
    Ok(axum::Json(CancelJsonResponse { outcome }).into_response())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests;
