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
//! code ([`http_status`]).

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

// ---- the listener ----

type PlainConns = ReceiverStream<io::Result<Held<TcpStream>>>;
type TlsConns = ReceiverStream<io::Result<TlsStream<Held<TcpStream>>>>;

/// The `--http-listen` port: connections bounded like `--listen`'s (br-trust's accept loop:
/// `--max-connections`, `--first-byte-timeout`), each behind mutual TLS when the service has
/// it (a client certificate is required, as on the gRPC port).
pub struct JsonListener {
    local: SocketAddr,
    conns: Either<PlainConns, TlsConns>,
}

impl std::fmt::Debug for JsonListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonListener")
            .field("local", &self.local)
            .field("tls", &matches!(self.conns, Either::Right(_)))
            .finish()
    }
}

/// Who is on the other end of a connection: its address and, over TLS, the leaf of the
/// certificate it presented (verified against the CA by the handshake).
#[derive(Debug, Clone)]
pub struct JsonPeer {
    pub addr: SocketAddr,
    pub cert: Option<Arc<[u8]>>,
}

impl axum::serve::Listener for JsonListener {
    type Io = Either<Held<TcpStream>, TlsStream<Held<TcpStream>>>;
    type Addr = JsonPeer;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let unknown = || SocketAddr::from(([0, 0, 0, 0], 0));
        loop {
            let next = match &mut self.conns {
                Either::Left(plain) => plain.next().await.map(|r| r.map(Either::Left)),
                Either::Right(tls) => tls.next().await.map(|r| r.map(Either::Right)),
            };
            match next {
                Some(Ok(Either::Left(tcp))) => {
                    let addr = tcp.peer_addr().unwrap_or_else(|_| unknown());
                    return (Either::Left(tcp), JsonPeer { addr, cert: None });
                }
                Some(Ok(Either::Right(tls))) => {
                    let (tcp, session) = tls.get_ref();
                    let addr = tcp.peer_addr().unwrap_or_else(|_| unknown());
                    let cert = session
                        .peer_certificates()
                        .and_then(|c| c.first())
                        .map(|c| Arc::<[u8]>::from(c.as_ref()));
                    return (Either::Right(tls), JsonPeer { addr, cert });
                }
                // logged and counted by the accept loop or the handshake task
                Some(Err(_)) => continue,
                // the acceptor stopped (never, while the listener lives): park until shutdown
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(JsonPeer {
            addr: self.local,
            cert: None,
        })
    }
}

/// Binds `addr` (`--http-listen`) with `--listen`'s rules: plaintext only on loopback (unless
/// `--allow-insecure-remote`), else mutual TLS with the service's material; the accept bounds
/// and counters of `edge`.
pub async fn bind(
    common: &CommonArgs,
    edge: &Edge,
    addr: SocketAddr,
) -> Result<JsonListener, StartError> {
    if edge.tls().is_none() {
        common
            .tls
            .check_bind(addr)
            .map_err(|e| StartError::Config(format!("--http-listen: {e}")))?;
    }
    let bind_err = |source| StartError::Bind {
        flag: "--http-listen",
        addr,
        source,
    };
    let listener = TcpListener::bind(addr).await.map_err(bind_err)?;
    let local = listener.local_addr().map_err(bind_err)?;
    let accepted = br_trust::accept::accept(
        listener,
        common.accept_limits(skeleton::descriptor_limit()),
        edge.accept_hook(),
    );
    let conns = match edge.serving() {
        None => Either::Left(accepted),
        Some(tls) => Either::Right(br_trust::tls::incoming(
            accepted,
            tls.material.server_config(&[b"http/1.1"]),
            TLS_HANDSHAKE_TIMEOUT,
            tls.on_handshake_failure,
        )),
    };
    Ok(JsonListener { local, conns })
}

impl JsonListener {
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

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
}

/// The routes, for [`serve`] (which gives every request its connection's [`JsonPeer`] as
/// `ConnectInfo`).
pub fn router(
    svc: DecisionService,
    metrics: Metrics,
    authz: Option<Authz>,
    max_wait: Duration,
) -> Router {
    Router::new().fallback(handle).with_state(JsonState {
        svc,
        metrics,
        authz,
        max_wait,
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

/// An answer that failed: the HTTP status and the gRPC code it stands for, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonError {
    pub status: StatusCode,
    pub code: tonic::Code,
    pub message: String,
}

impl JsonError {
    fn new(status: StatusCode, code: tonic::Code, message: impl Into<String>) -> Self {
        JsonError {
            status,
            code,
            message: message.into(),
        }
    }

    fn invalid(message: impl Into<String>) -> Self {
        JsonError::new(
            StatusCode::BAD_REQUEST,
            tonic::Code::InvalidArgument,
            message,
        )
    }
}

impl From<tonic::Status> for JsonError {
    fn from(s: tonic::Status) -> Self {
        JsonError::new(http_status(s.code()), s.code(), s.message())
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    code: String,
    message: &'a str,
}

impl IntoResponse for JsonError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            code: code_name(self.code),
            message: &self.message,
        };
        (self.status, axum::Json(body)).into_response()
    }
}

/// The HTTP status grpc-gateway answers for a gRPC code (its `HTTPStatusFromCode`).
pub fn http_status(code: tonic::Code) -> StatusCode {
    use tonic::Code::*;
    match code {
        Ok => StatusCode::OK,
        // nginx's "client closed request", as grpc-gateway
        Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        Unknown | Internal | DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
        InvalidArgument | FailedPrecondition | OutOfRange => StatusCode::BAD_REQUEST,
        DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        NotFound => StatusCode::NOT_FOUND,
        AlreadyExists | Aborted => StatusCode::CONFLICT,
        PermissionDenied => StatusCode::FORBIDDEN,
        Unauthenticated => StatusCode::UNAUTHORIZED,
        ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Unavailable => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// A gRPC code's canonical name (`INVALID_ARGUMENT`), as the error body's `code`.
pub fn code_name(code: tonic::Code) -> String {
    br_runtime::error::code_label(code).to_ascii_uppercase()
}

async fn handle(
    State(s): State<JsonState>,
    ConnectInfo(peer): ConnectInfo<JsonPeer>,
    req: Request,
) -> Response {
    let started = Instant::now();
    let route = match req.uri().path() {
        ROUTE_ASSIGN => ROUTE_ASSIGN,
        ROUTE_CANCEL => ROUTE_CANCEL,
        _ => ROUTE_OTHER,
    };
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
    s.metrics
        .http_requests_total
        .with_label_values(&[route, response.status().as_str()])
        .inc();
    s.metrics
        .http_request_duration
        .with_label_values(&[route])
        .observe(started.elapsed().as_secs_f64());
    response
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

/// The caller's deadline from `grpc-timeout` and [`TIMEOUT_HEADER`] (the shorter of the two
/// when both are given); `None` without either. A malformed value is refused, not ignored:
/// a caller who set a deadline must not wait for `--max-wait` instead.
pub fn deadline_of(headers: &HeaderMap) -> Result<Option<Duration>, JsonError> {
    let mut out: Option<Duration> = None;
    if let Some(v) = headers.get("grpc-timeout") {
        let d = v
            .to_str()
            .ok()
            .and_then(parse_grpc_timeout)
            .ok_or_else(|| {
                JsonError::invalid(format!(
                    "grpc-timeout {v:?} is not <1-8 digits><unit H|M|S|m|u|n> (e.g. 500m)"
                ))
            })?;
        out = Some(d);
    }
    if let Some(v) = headers.get(TIMEOUT_HEADER) {
        let d = v
            .to_str()
            .ok()
            .and_then(|s| humantime::parse_duration(s.trim()).ok())
            .ok_or_else(|| {
                JsonError::invalid(format!(
                    "X-Request-Timeout {v:?} is not a duration with a unit (e.g. 500ms, 5s)"
                ))
            })?;
        out = Some(out.map_or(d, |o| o.min(d)));
    }
    Ok(out)
}

/// `grpc-timeout`'s text for `d`: the finest unit whose count fits its 8 digits.
pub fn format_grpc_timeout(d: Duration) -> String {
    const MAX: u128 = 99_999_999;
    let units: [(u128, char); 6] = [
        (d.as_nanos(), 'n'),
        (d.as_micros(), 'u'),
        (d.as_millis(), 'm'),
        (u128::from(d.as_secs()), 'S'),
        (u128::from(d.as_secs() / 60), 'M'),
        (u128::from(d.as_secs() / 3600), 'H'),
    ];
    for (n, unit) in units {
        if n <= MAX {
            return format!("{n}{unit}");
        }
    }
    format!("{MAX}H")
}

/// Reads a JSON body: `Content-Type: application/json` (415 otherwise), at most
/// [`MAX_BODY_BYTES`] (413, before a byte is read when `Content-Length` says so), arriving
/// before the call's deadline (408).
async fn json_body<T: serde::de::DeserializeOwned>(
    req: Request,
    timeout: Duration,
) -> Result<T, JsonError> {
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if essence != "application/json" {
        return Err(JsonError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            tonic::Code::InvalidArgument,
            format!("Content-Type must be application/json, not {content_type:?}"),
        ));
    }
    let too_large = || {
        JsonError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            tonic::Code::ResourceExhausted,
            format!("the request body is larger than {MAX_BODY_BYTES} bytes"),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return Err(too_large());
    }
    let read = axum::body::to_bytes(req.into_body(), MAX_BODY_BYTES);
    let bytes = match tokio::time::timeout(timeout, read).await {
        Err(_) => {
            return Err(JsonError::new(
                StatusCode::REQUEST_TIMEOUT,
                tonic::Code::DeadlineExceeded,
                "the request body did not arrive before the call's deadline",
            ));
        }
        Ok(Err(e)) => {
            // axum reports the limit as an error whose source is http-body-util's
            // LengthLimitError; anything else is a broken body (the client went away).
            if std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
            {
                return Err(too_large());
            }
            return Err(JsonError::invalid(format!("reading the request body: {e}")));
        }
        Ok(Ok(b)) => b,
    };
    serde_json::from_slice(&bytes).map_err(|e| JsonError::invalid(format!("malformed JSON: {e}")))
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
    let body: AssignJson = json_body(req, timeout).await?;
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
    let body: CancelJson = json_body(req, timeout).await?;
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

// ---- the JSON shapes (proto3's JSON mapping) ----

/// `AssignRequest` as JSON.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AssignJson {
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default, alias = "requestId")]
    pub request_id: Option<String>,
    #[serde(default, alias = "promptTokens", deserialize_with = "lenient::u32")]
    pub prompt_tokens: Option<u32>,
    #[serde(default, alias = "promptHash", deserialize_with = "lenient::u64")]
    pub prompt_hash: Option<u64>,
    #[serde(default, alias = "maxTokens", deserialize_with = "lenient::u32")]
    pub max_tokens: Option<u32>,
}

impl AssignJson {
    /// The proto message; absent fields (and `null`) are proto3's defaults, so the gRPC
    /// validation refuses them exactly as it refuses an unset field.
    pub fn into_proto(self) -> v1::AssignRequest {
        v1::AssignRequest {
            group: self.group.unwrap_or_default(),
            request_id: self.request_id.unwrap_or_default(),
            prompt_tokens: self.prompt_tokens.unwrap_or(0),
            prompt_hash: self.prompt_hash,
            max_tokens: self.max_tokens,
        }
    }
}

/// `CancelRequest` as JSON.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelJson {
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default, alias = "requestId")]
    pub request_id: Option<String>,
}

impl CancelJson {
    pub fn into_proto(self) -> v1::CancelRequest {
        v1::CancelRequest {
            group: self.group.unwrap_or_default(),
            request_id: self.request_id.unwrap_or_default(),
        }
    }
}

/// `AssignResponse` as JSON: every field, 64-bit integers as decimal strings (proto3's JSON
/// mapping: a JavaScript or Lua number would round an incarnation).
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct AssignJsonResponse {
    pub worker_id: u32,
    pub endpoint: String,
    pub policy: String,
    pub pool_wait_us: String,
    pub incarnation: String,
    pub sigma_version: String,
    pub stale: bool,
}

impl From<v1::AssignResponse> for AssignJsonResponse {
    fn from(r: v1::AssignResponse) -> Self {
        AssignJsonResponse {
            worker_id: r.worker_id,
            endpoint: r.endpoint,
            policy: r.policy,
            pool_wait_us: r.pool_wait_us.to_string(),
            incarnation: r.incarnation.to_string(),
            sigma_version: r.sigma_version.to_string(),
            stale: r.stale,
        }
    }
}

/// `CancelResponse` as JSON: the outcome by its enum value's name.
#[derive(Debug, Serialize)]
struct CancelJsonResponse {
    outcome: &'static str,
}

/// Integers as proto3's JSON mapping accepts them: a JSON number (an integral one, also in
/// exponent form) or a decimal string; `null` is unset.
mod lenient {
    use serde::de::{self, Deserializer, Unexpected, Visitor};

    struct U64;

    /// Integral values a JSON number written with a fraction or exponent can hold exactly.
    const EXACT_F64: f64 = 9_007_199_254_740_992.0; // 2^53

    impl Visitor<'_> for U64 {
        type Value = Option<u64>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an unsigned integer (a JSON number or a decimal string)")
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v))
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            u64::try_from(v)
                .map(Some)
                .map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
        }

        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
            if v.fract() == 0.0 && (0.0..=EXACT_F64).contains(&v) {
                // exact: integral and within f64's integer range
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                return Ok(Some(v as u64));
            }
            Err(E::invalid_value(Unexpected::Float(v), &self))
        }

        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            if !v.is_empty()
                && v.bytes().all(|b| b.is_ascii_digit())
                && let Ok(n) = v.parse::<u64>()
            {
                return Ok(Some(n));
            }
            Err(E::invalid_value(Unexpected::Str(v), &self))
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }

    pub fn u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        d.deserialize_any(U64)
    }

    pub fn u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        match u64(d)? {
            None => Ok(None),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| de::Error::custom(format!("{n} is out of range for a uint32 field"))),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests;
