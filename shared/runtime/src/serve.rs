//! Running a tonic server the way every BalanceRoute service does: with `grpc.health.v1.Health`
//! (tonic-health), server reflection v1 and v1alpha (the common clients still speak v1alpha)
//! advertising only what this port serves, an UNIMPLEMENTED answer naming the right service and
//! binary for a call of a service served elsewhere, a server span per call that continues the
//! caller's W3C trace context (br-trace's layer, when traces are exported), and a graceful
//! shutdown: on the shutdown signal every health status turns NOT_SERVING first, the listener
//! closes, in-flight calls drain for at most the grace period, then the server exits.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;
use tonic_health::ServingStatus;
use tonic_health::server::{HealthReporter, HealthService};

pub use tonic_health::ServingStatus as HealthStatus;

/// Returns a token cancelled on the first SIGTERM or SIGINT (Ctrl-C). Must be called inside a
/// tokio runtime. Pass clones to everything that must stop (servers, background tasks).
///
/// The handlers are installed before it returns, not in the task it spawns: a SIGTERM that
/// arrives before that task first runs (a process stopped right after it started, on a busy
/// machine) is kept for it and drains the process, where it used to meet the default action
/// and kill the process undrained.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    let signals = Signals::install();
    tokio::spawn(async move {
        signals.wait().await;
        t.cancel();
    });
    token
}

/// SIGTERM and SIGINT handlers, installed when made.
struct Signals {
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    int: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    /// Must be called inside a tokio runtime.
    fn install() -> Signals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let install = |kind: SignalKind, name: &str| match signal(kind) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for {name}");
                    None
                }
            };
            Signals {
                term: install(SignalKind::terminate(), "SIGTERM"),
                int: install(SignalKind::interrupt(), "SIGINT"),
            }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    async fn wait(self) {
        #[cfg(unix)]
        {
            async fn next(s: Option<tokio::signal::unix::Signal>) {
                match s {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending().await,
                }
            }
            let Signals { term, int } = self;
            if term.is_none() && int.is_none() {
                // Neither could be installed: Ctrl-C the portable way, as a last resort.
                log_ctrl_c(tokio::signal::ctrl_c().await);
                return;
            }
            tokio::select! {
                () = next(term) => tracing::info!("SIGTERM received, shutting down"),
                () = next(int) => tracing::info!("SIGINT received, shutting down"),
            }
        }
        #[cfg(not(unix))]
        log_ctrl_c(tokio::signal::ctrl_c().await);
    }
}

fn log_ctrl_c(r: std::io::Result<()>) {
    match r {
        Ok(()) => tracing::info!("SIGINT received, shutting down"),
        Err(e) => tracing::error!(error = %e, "listening for SIGINT failed; shutting down"),
    }
}

/// How a [`GrpcServer::serve`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServeOutcome {
    /// Every in-flight call finished within the grace period.
    Drained,
    /// The grace period ran out; the remaining calls and connections were dropped.
    GraceExpired,
}

/// A bound gRPC listener with its health reporter. Bind first (so tests can bind
/// `127.0.0.1:0` and read the port), then [`serve`](GrpcServer::serve).
pub struct GrpcServer {
    listener: TcpListener,
    health: HealthReporter,
    grace: Duration,
    keepalive: Option<(Duration, Duration)>,
    /// (age, grace): connections older than age get a GOAWAY and are closed after grace.
    max_connection_age: Option<(Duration, Duration)>,
    tls: Option<TlsServing>,
    health_follows: Option<crate::readiness::Readiness>,
    /// The served names whose health follows `health_follows`; `None`: all of them.
    follow_only: Option<Vec<String>>,
    /// Health also answers for [`LIVENESS`] and [`READINESS`].
    probe_names: bool,
    accept_limits: br_trust::accept::AcceptLimits,
    on_accept: Option<br_trust::accept::AcceptHook>,
    /// Called for each call refused RESOURCE_EXHAUSTED for an oversize request message.
    on_oversize: Option<crate::oversize::OversizeHook>,
    /// HTTP/2 streams one connection may have open at once (`--max-streams-per-connection`).
    max_streams: u32,
    /// The process's budget of unfinished request messages; `None`: one of the defaults for
    /// this server alone.
    in_flight: Option<std::sync::Arc<crate::in_flight::InFlightBudget>>,
}

/// Default streams one connection may have open at once. tonic otherwise tells hyper "no
/// limit", so one peer could open streams without bound on one connection; a gateway's
/// connection carries every Assign it has waiting in a pool, hence more than hyper's own 200.
pub const DEFAULT_MAX_STREAMS_PER_CONNECTION: u32 = 1024;

/// What a TLS-serving gRPC server needs besides its listener.
#[derive(Clone)]
pub struct TlsServing {
    pub material: std::sync::Arc<br_trust::TlsMaterial>,
    /// Called for each refused call (a counter by reason).
    pub on_deny: Option<br_trust::policy::DenyHook>,
    /// Called for each failed handshake (a counter).
    pub on_handshake_failure: Option<br_trust::tls::HandshakeFailureHook>,
}

/// How long a TLS handshake may take before the connection is dropped (a silent client holds
/// only its own task for this long).
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl std::fmt::Debug for GrpcServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcServer")
            .field("local_addr", &self.listener.local_addr().ok())
            .field("grace", &self.grace)
            .finish()
    }
}

impl GrpcServer {
    /// Binds `addr`. The grace period defaults to 10 s; set it with
    /// [`with_grace`](Self::with_grace).
    pub async fn bind(addr: SocketAddr) -> std::io::Result<GrpcServer> {
        Ok(Self::from_listener(TcpListener::bind(addr).await?))
    }

    pub fn from_listener(listener: TcpListener) -> GrpcServer {
        GrpcServer {
            listener,
            health: HealthReporter::new(),
            grace: Duration::from_secs(10),
            keepalive: None,
            max_connection_age: None,
            tls: None,
            health_follows: None,
            follow_only: None,
            probe_names: false,
            accept_limits: br_trust::accept::AcceptLimits::default(),
            on_accept: None,
            on_oversize: None,
            max_streams: DEFAULT_MAX_STREAMS_PER_CONNECTION,
            in_flight: None,
        }
    }

    /// The most HTTP/2 streams one connection may have open at once (its SETTINGS); a client
    /// waits for a stream to end before it opens another.
    pub fn with_max_streams_per_connection(mut self, max: u32) -> Self {
        self.max_streams = max.max(1);
        self
    }

    /// Bounds what peers can make this port hold before they say anything (open connections,
    /// silent ones); `on_event` counts accept errors and silent connections closed. See
    /// [`br_trust::accept`].
    pub fn with_accept_limits(
        mut self,
        limits: br_trust::accept::AcceptLimits,
        on_event: Option<br_trust::accept::AcceptHook>,
    ) -> Self {
        self.accept_limits = limits;
        self.on_accept = on_event;
        self
    }

    /// The health of the served names follows `readiness` (NOT_SERVING until it is ready, see
    /// [`follow_readiness`]) instead of turning SERVING when the server starts: for a service
    /// that is bound before it can do its job (decision before it can place a request).
    pub fn with_health_following(mut self, readiness: crate::readiness::Readiness) -> Self {
        self.health_follows = Some(readiness);
        self
    }

    /// [`with_health_following`](Self::with_health_following) for some of the served names
    /// only; the others turn SERVING when the server starts. For a port that serves several
    /// services of which one is bound before it can do its job (the all-in-one's Decision,
    /// beside Snapshot and Telemetry, which can work at once).
    pub fn with_health_following_only(
        mut self,
        readiness: crate::readiness::Readiness,
        names: &[&str],
    ) -> Self {
        self.health_follows = Some(readiness);
        self.follow_only = Some(names.iter().map(|n| (*n).to_owned()).collect());
        self
    }

    /// Health also answers for `liveness` (as `""`: SERVING while the server serves) and
    /// `readiness` (SERVING when the served services are: following
    /// [`with_health_following`](Self::with_health_following) when set), the names the Gateway
    /// API Inference Extension's endpoint-picker protocol asks of a picker's health service
    /// (Kubernetes gRPC probes name them).
    pub fn with_probe_names(mut self) -> Self {
        self.probe_names = true;
        self
    }

    /// HTTP/2 keepalive pings (interval, timeout) on every connection, so half-open
    /// connections are closed and their streams end.
    pub fn with_keepalive(mut self, keepalive: Option<(Duration, Duration)>) -> Self {
        self.keepalive = keepalive;
        self
    }

    /// Connections older than `age` are asked to go away (GOAWAY) and closed `grace` later,
    /// so long-lived clients reconnect: rotated certificates and a rebalanced Service reach
    /// them. `None`: connections live as long as they are used.
    pub fn with_max_connection_age(mut self, age: Option<(Duration, Duration)>) -> Self {
        self.max_connection_age = age;
        self
    }

    /// Calls `hook` for each call refused RESOURCE_EXHAUSTED because its request message was
    /// above the decoding limit (unary and server-streaming methods; see [`crate::oversize`]).
    pub fn with_oversize_hook(mut self, hook: Option<crate::oversize::OversizeHook>) -> Self {
        self.on_oversize = hook;
        self
    }

    /// Reads every request body through the process's budget of unfinished messages (one
    /// budget for all the process's ports; see [`crate::in_flight`]).
    pub fn with_in_flight_budget(
        mut self,
        budget: Option<std::sync::Arc<crate::in_flight::InFlightBudget>>,
    ) -> Self {
        self.in_flight = budget;
        self
    }

    /// Serve mutual TLS, with every call authorised by br-trust's method × role table.
    pub fn with_tls(mut self, tls: Option<TlsServing>) -> Self {
        self.tls = tls;
        self
    }

    /// The longest the server waits for in-flight calls after the shutdown signal.
    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The reporter behind this server's health service: a service may set its own status
    /// (e.g. NOT_SERVING while it has no σ). [`serve`](Self::serve) sets SERVING for the given
    /// names and `""` when it starts, and NOT_SERVING for all of them when it stops.
    pub fn health_reporter(&self) -> HealthReporter {
        self.health.clone()
    }

    /// Serves `routes` plus health and reflection until `shutdown` is cancelled, then drains.
    /// `service_names` are the full proto names served (e.g. `balanceroute.v1.Decision`, see
    /// [`br_proto::service_names`]): reported in health checks and the only BalanceRoute
    /// services reflection lists; a call of any other service answers UNIMPLEMENTED saying
    /// which binary serves it ([`not_served_message`]).
    ///
    /// Long-lived streams (Watch, Report) should also watch `shutdown` and end themselves, or
    /// the drain waits for the whole grace period.
    pub async fn serve(
        self,
        routes: Routes,
        service_names: &[&str],
        shutdown: CancellationToken,
    ) -> Result<ServeOutcome, tonic::transport::Error> {
        let GrpcServer {
            listener,
            health,
            grace,
            keepalive,
            max_connection_age,
            tls,
            health_follows,
            follow_only,
            probe_names,
            accept_limits,
            on_accept,
            on_oversize,
            max_streams,
            in_flight,
        } = self;
        let addr = listener.local_addr().ok();

        let advertised: Vec<&str> = service_names
            .iter()
            .copied()
            .chain([HEALTH, REFLECTION_V1, REFLECTION_V1ALPHA])
            .collect();
        let health_svc = tonic_health::pb::health_server::HealthServer::new(
            HealthService::from_health_reporter(health.clone()),
        );
        let mut routes = routes.add_service(health_svc);
        // The descriptor sets are compiled in; failing here is a build bug, not worth refusing
        // to serve for.
        match reflection(&advertised).build_v1() {
            Ok(r) => routes = routes.add_service(r),
            Err(e) => tracing::error!(error = %e, "gRPC reflection v1 unavailable"),
        }
        match reflection(&advertised).build_v1alpha() {
            Ok(r) => routes = routes.add_service(r),
            Err(e) => tracing::error!(error = %e, "gRPC reflection v1alpha unavailable"),
        }
        let served: std::sync::Arc<[String]> = advertised.iter().map(|s| s.to_string()).collect();
        let router = std::mem::replace(routes.axum_router_mut(), axum::Router::new());
        *routes.axum_router_mut() = router.fallback(move |uri: axum::http::Uri| {
            let served = served.clone();
            async move {
                let names: Vec<&str> = served.iter().map(String::as_str).collect();
                let message = not_served_message(uri.path(), &names);
                tonic::Status::unimplemented(message).into_http::<axum::body::Body>()
            }
        });

        // The names health answers for besides `""`: the served services, then the probes'.
        let probes: &[&str] = if probe_names {
            &[LIVENESS, READINESS]
        } else {
            &[]
        };
        let health_names: Vec<&str> = service_names.iter().chain(probes).copied().collect();
        match &health_follows {
            None => set_all(&health, &health_names, ServingStatus::Serving).await,
            Some(readiness) => {
                health.set_service_status("", ServingStatus::Serving).await;
                // `readiness` always follows and `liveness` never does; a served name follows
                // unless `follow_only` leaves it out.
                let follows = |n: &str| match n {
                    READINESS => true,
                    LIVENESS => false,
                    _ => follow_only
                        .as_ref()
                        .is_none_or(|only| only.iter().any(|o| o == n)),
                };
                for n in &health_names {
                    let status = if follows(n) {
                        ServingStatus::NotServing
                    } else {
                        ServingStatus::Serving
                    };
                    health.set_service_status(*n, status).await;
                }
                tokio::spawn(follow_readiness(
                    health.clone(),
                    readiness.clone(),
                    health_names
                        .iter()
                        .filter(|n| follows(n))
                        .map(|n| n.to_string())
                        .collect(),
                    shutdown.clone(),
                ));
            }
        }

        // Stage 1 (on `shutdown`): NOT_SERVING, then tell tonic to stop accepting and drain.
        let drain = CancellationToken::new();
        let drain_signal = drain.clone();
        let mut builder = tonic::transport::Server::builder()
            .http2_keepalive_interval(keepalive.map(|(i, _)| i))
            .http2_keepalive_timeout(keepalive.map(|(_, t)| t))
            .max_concurrent_streams(max_streams);
        if let Some((age, grace)) = max_connection_age {
            // The grace is what ends a connection whose streams never finish (Watch, Report):
            // a GOAWAY alone leaves them open.
            builder = builder
                .max_connection_age(age)
                .max_connection_age_grace(grace);
        }
        let mut builder = builder
            // Outermost: a call refused by the layers below is still in its caller's trace.
            .layer(br_trace::ServerLayer)
            .layer(crate::oversize::OversizeLayer::new(on_oversize))
            .layer(crate::in_flight::InFlightLayer::new(
                in_flight.unwrap_or_else(|| {
                    std::sync::Arc::new(crate::in_flight::InFlightBudget::new(
                        crate::in_flight::DEFAULT_PROCESS_BYTES,
                        crate::in_flight::DEFAULT_CONNECTION_BYTES,
                    ))
                }),
                crate::in_flight::MessageLimits::every_port(),
            ));
        let tls_on = tls.is_some();
        let accepted = br_trust::accept::accept(listener, accept_limits, on_accept);
        let mut server: std::pin::Pin<
            Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>,
        > = match tls {
            None => Box::pin(
                builder
                    .add_routes(routes)
                    .serve_with_incoming_shutdown(accepted, drain_signal.cancelled_owned()),
            ),
            Some(tls) => {
                let reader = tls.material.reader().clone();
                let incoming = br_trust::tls::incoming(
                    accepted,
                    tls.material.server_config(&[b"h2"]),
                    TLS_HANDSHAKE_TIMEOUT,
                    tls.on_handshake_failure,
                );
                Box::pin(
                    builder
                        .layer(br_trust::AuthzLayer::new(reader, tls.on_deny))
                        .add_routes(routes)
                        .serve_with_incoming_shutdown(incoming, drain_signal.cancelled_owned()),
                )
            }
        };
        // DEBUG: the process's one start-up line (INFO) names this address.
        tracing::debug!(addr = ?addr, services = ?service_names, tls = tls_on, "gRPC server listening");

        tokio::select! {
            r = &mut server => {
                // Ended by itself (an accept error).
                set_all(&health, &health_names, ServingStatus::NotServing).await;
                return r.map(|()| ServeOutcome::Drained);
            }
            () = shutdown.cancelled() => {}
        }

        set_all(&health, &health_names, ServingStatus::NotServing).await;
        tracing::info!(grace = ?grace, "gRPC server draining");
        drain.cancel();

        // Stage 2: drain for at most `grace`.
        match tokio::time::timeout(grace, &mut server).await {
            Ok(r) => {
                tracing::info!("gRPC server drained");
                r.map(|()| ServeOutcome::Drained)
            }
            Err(_) => {
                tracing::warn!(grace = ?grace, "grace period expired; dropping remaining calls");
                Ok(ServeOutcome::GraceExpired)
            }
        }
    }
}

/// `grpc.health.v1.Health`, served on every gRPC port.
pub const HEALTH: &str = "grpc.health.v1.Health";
/// The health name a liveness probe asks ([`GrpcServer::with_probe_names`]).
pub const LIVENESS: &str = "liveness";
/// The health name a readiness probe asks ([`GrpcServer::with_probe_names`]).
pub const READINESS: &str = "readiness";
/// Server reflection v1, served on every gRPC port.
pub const REFLECTION_V1: &str = "grpc.reflection.v1.ServerReflection";
/// Server reflection v1alpha (grpcurl before 1.9, grpcio's reflection client, Postman), served
/// on every gRPC port.
pub const REFLECTION_V1ALPHA: &str = "grpc.reflection.v1alpha.ServerReflection";

/// Which binary serves each BalanceRoute service, and its default `--listen`: what a port that
/// does not serve one tells a caller who asked it (docs/conventions.md has the same table).
const SERVED_BY: [(&str, &str, &str); 3] = [
    (
        br_proto::service_names::SNAPSHOT,
        "br-snapshot",
        br_proto::defaults::SNAPSHOT_LISTEN,
    ),
    (
        br_proto::service_names::TELEMETRY,
        "br-ingest",
        br_proto::defaults::INGEST_LISTEN,
    ),
    (
        br_proto::service_names::DECISION,
        "br-decision",
        br_proto::defaults::DECISION_LISTEN,
    ),
];

/// The message of the UNIMPLEMENTED answer to a call of `path` (`/package.Service/Method`) on a
/// port that serves `served` (tonic's own answer has an empty message, which leaves a caller who
/// dialled the wrong port guessing).
pub fn not_served_message(path: &str, served: &[&str]) -> String {
    let list = served.join(", ");
    let Some((service, method)) = path.strip_prefix('/').and_then(|p| p.split_once('/')) else {
        return format!("{path:?} is not a gRPC method path; this port serves {list}");
    };
    if served.contains(&service) {
        return format!("{service} has no method {method:?}");
    }
    match SERVED_BY.iter().find(|(s, _, _)| *s == service) {
        Some((_, bin, addr)) => format!(
            "{service}/{method} is not served on this port, which serves {list}; \
             {service} is served by {bin} (default --listen {addr})"
        ),
        None => format!("{service} is not a BalanceRoute service; this port serves {list}"),
    }
}

/// A reflection builder that knows every descriptor we have but lists only `advertised`.
fn reflection(advertised: &[&str]) -> tonic_reflection::server::Builder<'static> {
    let mut b = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(br_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
        .include_reflection_service(false);
    for name in advertised {
        b = b.with_service_name(*name);
    }
    b
}

/// Keeps the health status of `names` equal to `readiness` (SERVING when ready, NOT_SERVING
/// otherwise) until `shutdown`, then sets NOT_SERVING and returns. For a service whose gRPC
/// health should follow its admin `/readyz` (e.g. decision before it has σ): serve with
/// `service_names = &[]` so [`GrpcServer::serve`] leaves those names alone, and spawn this.
pub async fn follow_readiness(
    health: HealthReporter,
    readiness: crate::readiness::Readiness,
    names: Vec<String>,
    shutdown: CancellationToken,
) {
    let mut rx = readiness.subscribe();
    loop {
        let ready = *rx.borrow_and_update();
        let status = if ready {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for n in &names {
            health.set_service_status(n, status).await;
        }
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { break },
            () = shutdown.cancelled() => break,
        }
    }
    for n in &names {
        health
            .set_service_status(n, ServingStatus::NotServing)
            .await;
    }
}

async fn set_all(health: &HealthReporter, names: &[&str], status: ServingStatus) {
    health.set_service_status("", status).await;
    for n in names {
        health.set_service_status(*n, status).await;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;
    use std::sync::Arc;

    use br_proto::v1;
    use tokio::sync::Notify;
    use tokio_stream::StreamExt as _;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus as Pb;
    use tonic_health::pb::health_client::HealthClient;

    /// A Decision service whose `assign` says when a call has arrived and answers only when
    /// the test releases it: a call held in flight without guessing how long it takes.
    #[derive(Clone, Default)]
    struct Gate {
        entered: Arc<Notify>,
        release: Arc<Notify>,
    }

    impl Gate {
        /// Waits (bounded) until a call is inside `assign`.
        async fn entered(&self) {
            tokio::time::timeout(WAIT, self.entered.notified())
                .await
                .expect("the call never reached the handler");
        }
    }

    #[tonic::async_trait]
    impl v1::decision_server::Decision for Gate {
        async fn assign(
            &self,
            _: tonic::Request<v1::AssignRequest>,
        ) -> Result<tonic::Response<v1::AssignResponse>, tonic::Status> {
            // notify_one keeps a permit if the test is not waiting yet: no lost signal.
            self.entered.notify_one();
            self.release.notified().await;
            Ok(tonic::Response::new(v1::AssignResponse {
                worker_id: 5,
                ..Default::default()
            }))
        }
        async fn cancel(
            &self,
            _: tonic::Request<v1::CancelRequest>,
        ) -> Result<tonic::Response<v1::CancelResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("test"))
        }
    }

    /// The longest any step of these tests may take before it fails (a hang, not a timing).
    const WAIT: Duration = Duration::from_secs(10);

    async fn status(ch: tonic::transport::Channel, name: &str) -> i32 {
        HealthClient::new(ch)
            .check(HealthCheckRequest {
                service: name.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status
    }

    fn assign() -> v1::AssignRequest {
        v1::AssignRequest {
            group: "g".into(),
            request_id: "r".into(),
            prompt_tokens: 1,
            ..Default::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn health_reflection_and_graceful_drain() {
        let server = GrpcServer::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap()
            .with_grace(WAIT);
        let addr = server.local_addr().unwrap();
        let health = server.health_reporter();
        let shutdown = CancellationToken::new();
        let gate = Gate::default();
        let routes = Routes::new(v1::decision_server::DecisionServer::new(gate.clone()));
        let task = tokio::spawn(server.serve(
            routes,
            &[br_proto::service_names::DECISION],
            shutdown.clone(),
        ));

        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        assert_eq!(status(ch.clone(), "").await, Pb::Serving as i32);
        assert_eq!(
            status(ch.clone(), "balanceroute.v1.Decision").await,
            Pb::Serving as i32
        );

        // Reflection (v1 and v1alpha) lists what this port serves, and nothing served elsewhere
        // (every port used to list all three services).
        let mut want = vec![
            "balanceroute.v1.Decision",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        ];
        want.sort_unstable();
        assert_eq!(list_v1(ch.clone()).await, want);
        assert_eq!(list_v1alpha(ch.clone()).await, want);
        // A service served elsewhere: UNIMPLEMENTED, naming the binary that serves it.
        let status = v1::snapshot_client::SnapshotClient::new(ch.clone())
            .get(v1::GetRequest { group: "g".into() })
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");
        assert!(status.message().contains("br-snapshot"), "{status:?}");
        assert!(
            status.message().contains("balanceroute.v1.Snapshot/Get"),
            "{status:?}"
        );

        // A call in flight when shutdown starts completes; health turns NOT_SERVING first.
        let mut client = v1::decision_client::DecisionClient::new(ch.clone());
        let in_flight = tokio::spawn(async move { client.assign(assign()).await });
        gate.entered().await;
        let mut decision_health = watch(&health, "balanceroute.v1.Decision").await;
        let mut server_health = watch(&health, "").await;
        shutdown.cancel();
        until(&mut decision_health, Pb::NotServing).await;
        until(&mut server_health, Pb::NotServing).await;
        // The call is still held, so the server is still draining.
        assert!(
            !task.is_finished(),
            "the drain waits for the call in flight"
        );
        gate.release.notify_one();
        let resp = tokio::time::timeout(WAIT, in_flight)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(resp.into_inner().worker_id, 5);
        let outcome = tokio::time::timeout(WAIT, task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(outcome, ServeOutcome::Drained);
    }

    /// The names reflection v1 lists, sorted.
    async fn list_v1(ch: tonic::transport::Channel) -> Vec<String> {
        use tonic_reflection::pb::v1::ServerReflectionRequest;
        use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut resp = ServerReflectionClient::new(ch)
            .server_reflection_info(tokio_stream::iter([req]))
            .await
            .unwrap()
            .into_inner();
        let msg = resp.message().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = msg.message_response else {
            panic!("unexpected reflection answer");
        };
        let mut names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
        names.sort_unstable();
        names
    }

    /// The names reflection v1alpha lists, sorted.
    async fn list_v1alpha(ch: tonic::transport::Channel) -> Vec<String> {
        use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
        use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut resp = ServerReflectionClient::new(ch)
            .server_reflection_info(tokio_stream::iter([req]))
            .await
            .unwrap()
            .into_inner();
        let msg = resp.message().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = msg.message_response else {
            panic!("unexpected reflection answer");
        };
        let mut names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
        names.sort_unstable();
        names
    }

    #[test]
    fn a_call_for_another_port_names_the_binary_that_serves_it() {
        let here = ["balanceroute.v1.Snapshot", "grpc.health.v1.Health"];
        let m = not_served_message("/balanceroute.v1.Decision/Assign", &here);
        assert!(m.contains("balanceroute.v1.Decision/Assign"), "{m}");
        assert!(m.contains("br-decision"), "{m}");
        assert!(m.contains("127.0.0.1:50063"), "{m}");
        assert!(m.contains("balanceroute.v1.Snapshot"), "{m}");
        let m = not_served_message("/balanceroute.v1.Telemetry/Report", &here);
        assert!(m.contains("br-ingest"), "{m}");
        let m = not_served_message("/balanceroute.v1.Snapshot/Drop", &here);
        assert_eq!(m, r#"balanceroute.v1.Snapshot has no method "Drop""#);
        let m = not_served_message("/acme.Billing/Charge", &here);
        assert!(m.contains("not a BalanceRoute service"), "{m}");
        let m = not_served_message("nonsense", &here);
        assert!(m.contains("not a gRPC method path"), "{m}");
    }

    #[tokio::test]
    async fn health_can_follow_readiness_from_the_start() {
        let server = GrpcServer::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap()
            .with_grace(WAIT);
        let addr = server.local_addr().unwrap();
        let ready = crate::readiness::Readiness::default();
        let server = server.with_health_following(ready.clone());
        let shutdown = CancellationToken::new();
        let routes = Routes::new(v1::decision_server::DecisionServer::new(Gate::default()));
        const NAME: &str = br_proto::service_names::DECISION;
        let name = NAME;
        let task = tokio::spawn(server.serve(routes, &[NAME], shutdown.clone()));
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        // listed by reflection even while not serving
        assert!(list_v1(ch.clone()).await.iter().any(|n| n == name));
        let mut updates = {
            use tonic_health::pb::health_client::HealthClient;
            let req = HealthCheckRequest {
                service: name.into(),
            };
            HealthClient::new(ch.clone())
                .watch(req)
                .await
                .unwrap()
                .into_inner()
        };
        assert_eq!(next(&mut updates).await, Pb::NotServing as i32);
        ready.set(true);
        assert_eq!(next(&mut updates).await, Pb::Serving as i32);
        // an open Watch would hold the drain for the whole grace period
        drop((updates, ch));
        shutdown.cancel();
        tokio::time::timeout(WAIT, task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }

    /// With probe names, health answers `liveness` SERVING from the start and `readiness` as
    /// the served services (following readiness); without them both are unknown names.
    #[tokio::test]
    async fn probe_names_answer_liveness_at_once_and_readiness_with_the_services() {
        use tonic_health::pb::health_client::HealthClient;
        let ready = crate::readiness::Readiness::default();
        let mut servers = Vec::new();
        for probes in [true, false] {
            let server = GrpcServer::bind("127.0.0.1:0".parse().unwrap())
                .await
                .unwrap()
                .with_grace(WAIT)
                .with_health_following(ready.clone());
            let server = if probes {
                server.with_probe_names()
            } else {
                server
            };
            let addr = server.local_addr().unwrap();
            let shutdown = CancellationToken::new();
            let routes = Routes::new(v1::decision_server::DecisionServer::new(Gate::default()));
            let task = tokio::spawn(server.serve(
                routes,
                &[br_proto::service_names::DECISION],
                shutdown.clone(),
            ));
            let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                .unwrap()
                .connect()
                .await
                .unwrap();
            servers.push((HealthClient::new(ch), shutdown, task));
        }
        let req = |name: &str| HealthCheckRequest {
            service: name.into(),
        };
        let (probed, plain) = (&mut servers[0].0.clone(), &mut servers[1].0.clone());
        let mut readiness = probed.watch(req(READINESS)).await.unwrap().into_inner();
        assert_eq!(next(&mut readiness).await, Pb::NotServing as i32);
        let liveness = probed.check(req(LIVENESS)).await.unwrap().into_inner();
        assert_eq!(liveness.status, Pb::Serving as i32);
        ready.set(true);
        assert_eq!(next(&mut readiness).await, Pb::Serving as i32);
        for name in [LIVENESS, READINESS] {
            let err = plain.check(req(name)).await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::NotFound, "{name}: {err:?}");
        }
        drop(readiness);
        for (client, shutdown, task) in servers {
            drop(client);
            shutdown.cancel();
            tokio::time::timeout(WAIT, task)
                .await
                .unwrap()
                .unwrap()
                .unwrap();
        }
    }

    /// The next status of a health Watch (or fails after `WAIT`).
    async fn next(u: &mut tonic::Streaming<tonic_health::pb::HealthCheckResponse>) -> i32 {
        tokio::time::timeout(WAIT, u.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
            .status
    }

    /// One connection holds at most `--max-streams-per-connection` calls (tonic alone tells
    /// hyper "no limit"): with 2, two open health Watches fill it, a third call on the same
    /// connection waits, another connection is served, and the third goes through once a
    /// Watch ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_holds_at_most_max_streams_calls() {
        use tonic_health::pb::health_client::HealthClient;
        let server = GrpcServer::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap()
            .with_max_streams_per_connection(2);
        let addr = server.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let routes = Routes::new(v1::decision_server::DecisionServer::new(Gate::default()));
        let task = tokio::spawn(server.serve(routes, &[], shutdown.clone()));
        let connect = || async {
            tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                .unwrap()
                .connect()
                .await
                .unwrap()
        };
        let ch = connect().await;
        let req = || HealthCheckRequest {
            service: String::new(),
        };
        let mut watches = Vec::new();
        for _ in 0..2 {
            let mut w = HealthClient::new(ch.clone())
                .watch(req())
                .await
                .unwrap()
                .into_inner();
            next(&mut w).await;
            watches.push(w);
        }
        let mut third = HealthClient::new(ch.clone());
        let mut third = Box::pin(async move { third.check(req()).await });
        // Pending while both streams are open (a missing limit answers it at once)...
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut third)
                .await
                .is_err(),
            "a third call on a full connection was served"
        );
        // ... while a new connection is served ...
        HealthClient::new(connect().await)
            .check(req())
            .await
            .unwrap();
        // ... and it goes through once one ends.
        drop(watches.pop());
        tokio::time::timeout(WAIT, third).await.unwrap().unwrap();
        drop((watches, ch));
        shutdown.cancel();
        tokio::time::timeout(WAIT, task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn grace_period_bounds_the_drain() {
        let server = GrpcServer::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap()
            .with_grace(Duration::from_millis(200));
        let addr = server.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        // Never released: only the grace period can end the drain.
        let gate = Gate::default();
        let routes = Routes::new(v1::decision_server::DecisionServer::new(gate.clone()));
        let task = tokio::spawn(server.serve(routes, &[], shutdown.clone()));
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = v1::decision_client::DecisionClient::new(ch);
        let _in_flight = tokio::spawn(async move { client.assign(assign()).await });
        gate.entered().await;
        shutdown.cancel();
        let outcome = tokio::time::timeout(WAIT, task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(outcome, ServeOutcome::GraceExpired);
    }

    #[tokio::test]
    async fn not_serving_after_shutdown() {
        let server = GrpcServer::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap()
            .with_grace(Duration::from_millis(100));
        let health = server.health_reporter();
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        let routes = Routes::new(v1::decision_server::DecisionServer::new(Gate::default()));
        let outcome = server
            .serve(routes, &["balanceroute.v1.Decision"], shutdown)
            .await
            .unwrap();
        assert_eq!(outcome, ServeOutcome::Drained);
        assert_eq!(
            reported(&health, "balanceroute.v1.Decision").await,
            Pb::NotServing as i32
        );
    }

    #[tokio::test]
    async fn health_follows_readiness_until_shutdown() {
        let health = HealthReporter::new();
        let ready = crate::readiness::Readiness::default();
        let shutdown = CancellationToken::new();
        let name = "balanceroute.v1.Decision";
        // Registered (so it can be watched) as SERVING: the first NOT_SERVING below is the
        // follower's doing (readiness starts false).
        health
            .set_service_status(name, ServingStatus::Serving)
            .await;
        let mut updates = watch(&health, name).await;
        until(&mut updates, Pb::Serving).await;
        let task = tokio::spawn(follow_readiness(
            health.clone(),
            ready.clone(),
            vec![name.to_string()],
            shutdown.clone(),
        ));
        until(&mut updates, Pb::NotServing).await;
        ready.set(true);
        until(&mut updates, Pb::Serving).await;
        ready.set(false);
        until(&mut updates, Pb::NotServing).await;
        ready.set(true);
        until(&mut updates, Pb::Serving).await;
        shutdown.cancel();
        tokio::time::timeout(WAIT, task).await.unwrap().unwrap();
        assert_eq!(reported(&health, name).await, Pb::NotServing as i32);
    }

    type Updates = std::pin::Pin<
        Box<
            dyn futures::Stream<Item = Result<tonic_health::pb::HealthCheckResponse, tonic::Status>>
                + Send,
        >,
    >;

    /// The health service's `Watch` of `name` (in-process, no network): the current status,
    /// then every change. Waiting on it is waiting on the signal, not on time.
    async fn watch(health: &HealthReporter, name: &str) -> Updates {
        use tonic_health::pb::health_server::Health as _;
        let stream = HealthService::from_health_reporter(health.clone())
            .watch(tonic::Request::new(HealthCheckRequest {
                service: name.into(),
            }))
            .await
            .unwrap()
            .into_inner();
        Box::pin(stream)
    }

    /// Reads `updates` until the status is `want` (or fails after `WAIT`).
    async fn until(updates: &mut Updates, want: Pb) {
        let reached = async {
            while let Some(update) = updates.next().await {
                if update.unwrap().status == want as i32 {
                    return;
                }
            }
            panic!("health watch ended before {want:?}");
        };
        tokio::time::timeout(WAIT, reached)
            .await
            .unwrap_or_else(|_| panic!("status never became {want:?}"));
    }

    /// The status the reporter holds, read through a fresh health service (no network); -1 if
    /// the name is not registered.
    async fn reported(health: &HealthReporter, name: &str) -> i32 {
        use tonic_health::pb::health_server::Health as _;
        HealthService::from_health_reporter(health.clone())
            .check(tonic::Request::new(HealthCheckRequest {
                service: name.into(),
            }))
            .await
            .map_or(-1, |r| r.into_inner().status) // -1: not registered yet
    }
}
