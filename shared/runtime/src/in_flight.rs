//! A budget of partially received request messages, per process and per connection, and
//! request size limits per method; on every gRPC port ([`crate::serve`]).
//!
//! tonic's decoder buffers a request message until its last byte has arrived, and reserves
//! the whole declared length as soon as the 5-byte gRPC message header says it (tonic 0.14,
//! `codec/decode.rs`). HTTP/2 flow control does not bound that: hyper gives the window back as
//! soon as tonic takes the bytes. So a peer that sends most of a large message on many streams
//! and never finishes made the process hold every one of them (docs/design/0014-in-flight-
//! bytes.md). [`InFlightLayer`] wraps each request body, reads the gRPC message headers as
//! they pass, and before a chunk that leaves a message unfinished reaches tonic it charges
//! that message's declared length to the process's and the connection's budget; the charge
//! is given back when the message's last byte passes, or the stream ends. A chunk the budget
//! cannot cover fails the call with RESOURCE_EXHAUSTED, counted by scope. A message that
//! arrives whole in one chunk (every small call: Assign, a health check) is never charged, so
//! it is served however full the budget is.
//!
//! The same reading refuses a message whose header declares more than its method's limit
//! ([`MessageLimits`]) with tonic's own OUT_OF_RANGE "decoded message length too large", which
//! [`crate::oversize`] answers as RESOURCE_EXHAUSTED and counts, as it does tonic's refusal.
//!
//! A port that is not gRPC (br-decision's HTTP/JSON request bodies) charges the same budget
//! through [`InFlightBudget::try_hold`]: its unfinished bodies would otherwise be a second way
//! to make the process hold bytes, unbounded beside the gRPC ports' bounded one.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame};
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

/// Default budget of the whole process (`--max-in-flight-message-bytes`): four of the largest
/// messages any method accepts (16 MiB: a σ batch, an ext_proc body).
pub const DEFAULT_PROCESS_BYTES: usize = 64 << 20;
/// Default budget of one connection (`--max-in-flight-message-bytes-per-connection`): one of
/// the largest messages with room to spare, and a quarter of the process's.
pub const DEFAULT_CONNECTION_BYTES: usize = 24 << 20;
/// The request limit of methods that carry a few names and numbers: far above what they need
/// (a request id, a group, counts), far below tonic's 4 MiB default.
pub const SMALL_REQUEST_BYTES: usize = 64 << 10;
/// The 5-byte gRPC message header: compression flag and big-endian length.
const HEADER_BYTES: usize = 5;

/// Which budget refused a message (the refusal counter's `scope` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Process,
    Connection,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Process => "process",
            Scope::Connection => "connection",
        }
    }
}

/// Called once for each refused message (a counter by scope).
pub type RefusalHook = Arc<dyn Fn(Scope) + Send + Sync>;

/// The bytes of unfinished messages the process and each connection may hold. One per
/// process, shared by all its gRPC ports and its HTTP/JSON request bodies.
pub struct InFlightBudget {
    process_limit: usize,
    connection_limit: usize,
    held: AtomicUsize,
    /// Bytes charged per connection (local, remote address); an entry is removed at 0.
    connections: Mutex<HashMap<ConnectionKey, usize>>,
    on_refusal: Option<RefusalHook>,
    /// Set to the bytes held after every change (a gauge).
    on_change: Option<Arc<dyn Fn(usize) + Send + Sync>>,
}

/// A connection as the budget tells them apart: its local and its remote address (a peer may
/// reach two ports of the process from one address, and those are two connections).
pub type ConnectionKey = (Option<SocketAddr>, Option<SocketAddr>);

impl std::fmt::Debug for InFlightBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlightBudget")
            .field("process_limit", &self.process_limit)
            .field("connection_limit", &self.connection_limit)
            .field("held", &self.held())
            .finish_non_exhaustive()
    }
}

impl InFlightBudget {
    pub fn new(process_limit: usize, connection_limit: usize) -> InFlightBudget {
        InFlightBudget {
            process_limit,
            connection_limit: connection_limit.min(process_limit),
            held: AtomicUsize::new(0),
            connections: Mutex::default(),
            on_refusal: None,
            on_change: None,
        }
    }

    /// Counts each refusal with `on_refusal` and reports the bytes held to `on_change`.
    pub fn with_hooks(
        mut self,
        on_refusal: Option<RefusalHook>,
        on_change: Option<Arc<dyn Fn(usize) + Send + Sync>>,
    ) -> InFlightBudget {
        self.on_refusal = on_refusal;
        self.on_change = on_change;
        self
    }

    /// Bytes of unfinished messages held now, across the process.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Charges `bytes` to `connection` and the process (both or neither), refused and counted
    /// as a gRPC message's charge is; the guard gives them back when dropped, so a body whose
    /// reader is dropped half-way (a timeout, a client gone) cannot leave its charge behind.
    pub fn try_hold(
        self: &Arc<Self>,
        connection: ConnectionKey,
        bytes: usize,
    ) -> Result<Held, Scope> {
        let mut charge = Charge {
            budget: Arc::clone(self),
            connection,
            bytes: 0,
        };
        charge.hold(bytes)?;
        Ok(Held(charge))
    }

    /// Charges `bytes` to the connection and the process, or neither.
    fn charge(&self, connection: &ConnectionKey, bytes: usize) -> Result<(), Scope> {
        let mut connections = self
            .connections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let on_connection = connections.get(connection).copied().unwrap_or(0);
        if on_connection + bytes > self.connection_limit {
            drop(connections);
            self.refused(Scope::Connection);
            return Err(Scope::Connection);
        }
        let charged = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                (held + bytes <= self.process_limit).then_some(held + bytes)
            });
        let Ok(before) = charged else {
            drop(connections);
            self.refused(Scope::Process);
            return Err(Scope::Process);
        };
        connections.insert(*connection, on_connection + bytes);
        drop(connections);
        if let Some(f) = &self.on_change {
            f(before + bytes);
        }
        Ok(())
    }

    fn release(&self, connection: &ConnectionKey, bytes: usize) {
        if bytes == 0 {
            return;
        }
        {
            let mut connections = self
                .connections
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(on_connection) = connections.get_mut(connection) {
                *on_connection = on_connection.saturating_sub(bytes);
                if *on_connection == 0 {
                    connections.remove(connection);
                }
            }
        }
        let before = self.held.fetch_sub(bytes, Ordering::AcqRel);
        if let Some(f) = &self.on_change {
            f(before.saturating_sub(bytes));
        }
    }

    fn refused(&self, scope: Scope) {
        if let Some(f) = &self.on_refusal {
            f(scope);
        }
    }
}

/// The most bytes a request message of each method may declare, tighter than the service's
/// tonic limit for methods that need little. Looked up by full method path
/// (`/package.Service/Method`), then by service (`/package.Service/`); no entry: the service's
/// own tonic limit alone.
#[derive(Debug, Clone, Default)]
pub struct MessageLimits {
    by_path: HashMap<String, usize>,
}

impl MessageLimits {
    /// The limits every port has (a port that does not serve a method answers its calls
    /// UNIMPLEMENTED anyway). Health checks, reflection requests and every BalanceRoute call
    /// but two are a few names and numbers; σ batches (`Snapshot/Apply`) and worker reports
    /// (`Telemetry/Report`) keep their service's own limit.
    pub fn every_port() -> MessageLimits {
        use br_proto::service_names::{DECISION, SNAPSHOT};
        let small = SMALL_REQUEST_BYTES;
        // the names `serve` advertises (not imported from it: `serve` builds on this module)
        let mut limits = MessageLimits::default()
            .with_service("grpc.health.v1.Health", 4 << 10)
            .with_service("grpc.reflection.v1.ServerReflection", small)
            .with_service("grpc.reflection.v1alpha.ServerReflection", small)
            .with_service(DECISION, small);
        for method in [
            "Watch",
            "Get",
            "Reserve",
            "ReserveStream",
            "Release",
            "ListGroups",
            "SetCordon",
        ] {
            limits = limits.with_method(SNAPSHOT, method, small);
        }
        limits
    }

    /// `limit` for every method of `service` (its full proto name) without its own entry.
    pub fn with_service(mut self, service: &str, limit: usize) -> MessageLimits {
        self.by_path.insert(format!("/{service}/"), limit);
        self
    }

    /// `limit` for one method (`service` its full proto name).
    pub fn with_method(mut self, service: &str, method: &str, limit: usize) -> MessageLimits {
        self.by_path.insert(format!("/{service}/{method}"), limit);
        self
    }

    /// The limit of the method at `path`, if it has one.
    pub fn limit(&self, path: &str) -> Option<usize> {
        if let Some(l) = self.by_path.get(path) {
            return Some(*l);
        }
        let service = path.rfind('/').map(|i| &path[..=i])?;
        self.by_path.get(service).copied()
    }
}

/// The tower layer: every request body is read through the budget.
#[derive(Clone, Debug)]
pub struct InFlightLayer {
    budget: Arc<InFlightBudget>,
    limits: Arc<MessageLimits>,
}

impl InFlightLayer {
    pub fn new(budget: Arc<InFlightBudget>, limits: MessageLimits) -> InFlightLayer {
        InFlightLayer {
            budget,
            limits: Arc::new(limits),
        }
    }
}

impl<S> tower::Layer<S> for InFlightLayer {
    type Service = InFlight<S>;

    fn layer(&self, inner: S) -> InFlight<S> {
        InFlight {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`InFlightLayer`] wraps.
#[derive(Clone, Debug)]
pub struct InFlight<S> {
    inner: S,
    layer: InFlightLayer,
}

impl<S> tower::Service<http::Request<tonic::body::Body>> for InFlight<S>
where
    S: tower::Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let connection = connection_of(&req);
        let limit = self.layer.limits.limit(req.uri().path());
        let budget = self.layer.budget.clone();
        let req = req.map(|body| {
            tonic::body::Body::new(Budgeted {
                inner: body,
                framing: Framing::default(),
                limit,
                charge: Charge {
                    budget,
                    connection,
                    bytes: 0,
                },
                failed: false,
            })
        });
        self.inner.call(req)
    }
}

/// The connection a request came on: tonic puts its addresses in the extensions.
fn connection_of<B>(req: &http::Request<B>) -> ConnectionKey {
    let ext = req.extensions();
    let tcp = ext.get::<TcpConnectInfo>().or_else(|| {
        ext.get::<TlsConnectInfo<TcpConnectInfo>>()
            .map(TlsConnectInfo::get_ref)
    });
    tcp.map_or((None, None), |t| (t.local_addr(), t.remote_addr()))
}

/// Where the reader is in the stream of gRPC messages.
#[derive(Debug, Default)]
struct Framing {
    /// Bytes of the current message's header seen so far (0 between messages).
    header: [u8; HEADER_BYTES],
    header_seen: usize,
    /// Body bytes of the current message still to come, once its header is complete.
    body_left: usize,
    /// The current message's declared length, once its header is complete.
    declared: Option<usize>,
}

impl Framing {
    /// Reads `chunk` through; returns the declared length of the message it leaves unfinished
    /// (with its header), 0 when it ends between messages, or the length above `limit`.
    fn read(&mut self, mut chunk: &[u8], limit: Option<usize>) -> Result<usize, TooLarge> {
        while !chunk.is_empty() {
            if self.declared.is_some() {
                let n = self.body_left.min(chunk.len());
                self.body_left -= n;
                chunk.advance(n);
                if self.body_left == 0 {
                    self.declared = None;
                }
                continue;
            }
            let n = (HEADER_BYTES - self.header_seen).min(chunk.len());
            self.header[self.header_seen..self.header_seen + n].copy_from_slice(&chunk[..n]);
            self.header_seen += n;
            chunk.advance(n);
            if self.header_seen == HEADER_BYTES {
                let len = u32::from_be_bytes([
                    self.header[1],
                    self.header[2],
                    self.header[3],
                    self.header[4],
                ]) as usize;
                if let Some(limit) = limit
                    && len > limit
                {
                    return Err(TooLarge { len, limit });
                }
                self.header_seen = 0;
                if len > 0 {
                    self.declared = Some(len);
                    self.body_left = len;
                }
            }
        }
        Ok(self.declared.map_or(0, |len| len + HEADER_BYTES))
    }
}

struct TooLarge {
    len: usize,
    limit: usize,
}

/// What a body holds against the budget; given back when dropped.
struct Charge {
    budget: Arc<InFlightBudget>,
    connection: ConnectionKey,
    bytes: usize,
}

impl Charge {
    /// Holds exactly `want` bytes: charges the difference, or gives it back.
    fn hold(&mut self, want: usize) -> Result<(), Scope> {
        if want > self.bytes {
            self.budget.charge(&self.connection, want - self.bytes)?;
        } else {
            self.budget.release(&self.connection, self.bytes - want);
        }
        self.bytes = want;
        Ok(())
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.release(&self.connection, self.bytes);
    }
}

/// Bytes held against the budget by [`InFlightBudget::try_hold`]; given back when dropped.
pub struct Held(Charge);

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("connection", &self.0.connection)
            .field("bytes", &self.0.bytes)
            .finish_non_exhaustive()
    }
}

impl Held {
    /// Holds exactly `bytes` from now on (a body charged as it grows): charges what is more
    /// than it holds, gives back what is less. Refused, it keeps what it held.
    pub fn try_set(&mut self, bytes: usize) -> Result<(), Scope> {
        self.0.hold(bytes)
    }
}

pin_project_lite::pin_project! {
    /// A request body read through the budget (see the module docs).
    struct Budgeted<B> {
        #[pin]
        inner: B,
        framing: Framing,
        limit: Option<usize>,
        charge: Charge,
        failed: bool,
    }
}

impl<B> Body for Budgeted<B>
where
    B: Body<Data = Bytes, Error = tonic::Status>,
{
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = self.project();
        if *this.failed {
            return Poll::Ready(None);
        }
        let frame = match std::task::ready!(this.inner.poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            other => {
                // the end of the stream or its error: nothing more will be held
                let _ = this.charge.hold(0);
                return Poll::Ready(other);
            }
        };
        let Some(data) = frame.data_ref() else {
            return Poll::Ready(Some(Ok(frame)));
        };
        let refusal = match this.framing.read(data, *this.limit) {
            Ok(unfinished) => match this.charge.hold(unfinished) {
                Ok(()) => return Poll::Ready(Some(Ok(frame))),
                Err(scope) => tonic::Status::resource_exhausted(format!(
                    "unfinished request messages are over this {} budget of {} bytes; \
                     try again later",
                    if scope == Scope::Process {
                        "process's"
                    } else {
                        "connection's"
                    },
                    if scope == Scope::Process {
                        this.charge.budget.process_limit
                    } else {
                        this.charge.budget.connection_limit
                    }
                )),
            },
            // tonic's own words, so the oversize rewrite and the handlers treat it as theirs
            Err(TooLarge { len, limit }) => tonic::Status::out_of_range(format!(
                "Error, decoded message length too large: found {len} bytes, the limit is: \
                 {limit} bytes"
            )),
        };
        *this.failed = true;
        let _ = this.charge.hold(0);
        Poll::Ready(Some(Err(refusal)))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests;
