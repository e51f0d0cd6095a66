//! The one shape of a BalanceRoute service. br-snapshot, br-ingest, br-decision and br-shim
//! each expose
//!
//! ```text
//! pub async fn start(args: &Args, shutdown: CancellationToken) -> Result<Running, StartError>
//! ```
//!
//! which binds every port (port 0 picks a free one), starts serving and returns at once with a
//! [`Running`]: the bound addresses, the readiness flag and [`Running::wait`]. Cancelling
//! `shutdown` (SIGTERM in a binary, the test itself in-process) drains the service within
//! `--shutdown-grace`. This module owns that shape ([`Running`], [`StartError`],
//! [`ServeError`]), the binding helpers that name the flag in their errors, the `--ready-file`
//! (see [`write_ready_file`]) and [`main`], the whole of every service binary's `main`.

use std::future::Future;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::admin::{AdminServer, Readiness};
use crate::config::{self, CommonArgs, Validate};
use crate::serve::{GrpcServer, ServeOutcome};

/// Why a service could not start. Every variant names the flag to fix.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A listener could not be bound (address in use, not local, no permission).
    #[error("binding {flag} {addr}: {source}")]
    Bind {
        flag: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// The configuration is invalid (the message names the flag).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A client of another service (or of the engine) could not be set up.
    #[error("{flag} {value:?}: {reason}")]
    Upstream {
        flag: &'static str,
        value: String,
        reason: String,
    },
    /// The service's metrics could not be registered (a duplicate name: a build bug).
    #[error("registering metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// Why a started service stopped other than by a clean drain.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The gRPC server failed (an accept error).
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    /// An HTTP server (admin, or the shim's proxy) failed.
    #[error("{server} server: {source}")]
    Io {
        server: &'static str,
        source: std::io::Error,
    },
    /// A task of the service panicked.
    #[error("service task: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// What the service was told to serve turned out wrong once it could ask (a shim's engine
    /// refusing a rank the shim pins); it exits as a refused configuration does, with 2.
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// The flags [`main`] needs from a service's `Args`: the shared ones, and the service's own
/// checks. Every `ServiceArgs` is [`Validate`]: the shared flags are checked first, then
/// [`ServiceArgs::check`], so no service can forget the shared checks.
pub trait ServiceArgs: clap::Parser {
    fn common(&self) -> &CommonArgs;

    /// Checks the service's own flags; a message naming the flag. None by default.
    fn check(&self) -> Result<(), String> {
        Ok(())
    }
}

impl<A: ServiceArgs> Validate for A {
    fn validate(&self) -> Result<(), String> {
        self.common().validate()?;
        self.check()
    }
}

/// What the `--listen` port speaks; decides the accessor of [`Running`] and the ready-file key.
pub trait Protocol: sealed::Sealed + Send + Sync + 'static {
    /// `"grpc"` or `"http"`.
    const KEY: &'static str;
}

/// `--listen` serves gRPC (snapshot, ingest, decision): [`Running::grpc_addr`].
#[derive(Debug)]
pub enum Grpc {}
/// `--listen` serves HTTP (the shim's proxy): [`Running::http_addr`].
#[derive(Debug)]
pub enum Http {}

impl Protocol for Grpc {
    const KEY: &'static str = "grpc";
}
impl Protocol for Http {
    const KEY: &'static str = "http";
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Grpc {}
    impl Sealed for super::Http {}
}

/// The addresses a service bound, as written to `--ready-file`:
/// `{"grpc": "127.0.0.1:50061", "admin": "127.0.0.1:9061"}` (`"http"` instead of `"grpc"` for
/// the shim), plus one key per optional listener it serves (br-decision's `"ext_proc"`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BoundAddrs {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<SocketAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<SocketAddr>,
    pub admin: SocketAddr,
    /// Optional listeners by key (see [`Running::with_listener`]).
    #[serde(flatten)]
    pub more: std::collections::BTreeMap<String, SocketAddr>,
}

/// A started service: what it bound, whether it is ready, and its serving task. `P` says what
/// `--listen` speaks; `X` holds what only one service has (snapshot's epoch, decision's group
/// stats), reached with [`extra`](Self::extra).
#[derive(Debug)]
pub struct Running<P: Protocol, X = ()> {
    listen: SocketAddr,
    admin: SocketAddr,
    readiness: Readiness,
    shutdown: CancellationToken,
    task: JoinHandle<Result<ServeOutcome, ServeError>>,
    extra: X,
    /// Optional listeners beyond `--listen` and the admin port, by ready-file key.
    more: Vec<(&'static str, SocketAddr)>,
    /// A second, HTTP/JSON listener of a gRPC service (br-decision's `--http-listen`).
    http_json: Option<SocketAddr>,
    /// The service logged its own start-up line, so [`main`] logs no generic one.
    announced: bool,
    protocol: PhantomData<P>,
}

impl<P: Protocol, X> Running<P, X> {
    /// Spawns `serve` (the future that serves until `shutdown` and then drains and stops the
    /// service's tasks) and returns the handle. For a service's `start`.
    pub fn spawn<F>(
        listen: SocketAddr,
        admin: SocketAddr,
        readiness: Readiness,
        shutdown: CancellationToken,
        extra: X,
        serve: F,
    ) -> Self
    where
        F: Future<Output = Result<ServeOutcome, ServeError>> + Send + 'static,
    {
        Running {
            listen,
            admin,
            readiness,
            shutdown,
            task: tokio::spawn(serve),
            extra,
            more: Vec::new(),
            http_json: None,
            announced: false,
            protocol: PhantomData,
        }
    }

    /// Records an optional listener the service bound (`key` in the ready file, e.g.
    /// `"ext_proc"`).
    pub fn with_listener(mut self, key: &'static str, addr: SocketAddr) -> Self {
        self.more.push((key, addr));
        self
    }

    /// Says that the service logged its own start-up line (one that names its addresses), so
    /// that [`main`] does not log its generic "NAME listening" after it: an operator reads one
    /// start-up line a process.
    #[must_use]
    pub fn announced(mut self) -> Self {
        self.announced = true;
        self
    }

    /// The address of an optional listener (see [`with_listener`](Self::with_listener)).
    pub fn listener(&self, key: &str) -> Option<SocketAddr> {
        self.more.iter().find(|(k, _)| *k == key).map(|(_, a)| *a)
    }

    /// Where `/metrics`, `/livez` and `/readyz` are served.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
    }

    /// Every bound address (what `--ready-file` holds).
    pub fn addrs(&self) -> BoundAddrs {
        let main = Some(self.listen);
        let (grpc, http) = match P::KEY {
            "grpc" => (main, self.http_json),
            _ => (None, main),
        };
        BoundAddrs {
            grpc,
            http,
            admin: self.admin,
            more: self
                .more
                .iter()
                .map(|(k, a)| ((*k).to_owned(), *a))
                .collect(),
        }
    }

    /// The flag behind `/readyz` (subscribe to it to wait for a change).
    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    pub fn is_ready(&self) -> bool {
        self.readiness.is_ready()
    }

    /// What only this service has.
    pub fn extra(&self) -> &X {
        &self.extra
    }

    /// Waits until the service has stopped (after `shutdown` was cancelled, or after it failed).
    pub async fn wait(self) -> Result<ServeOutcome, ServeError> {
        // The extras may hold handles that keep the service's tasks alive; they are not needed
        // once the caller waits for the end.
        drop(self.extra);
        self.task.await?
    }

    /// Starts the shutdown (as SIGTERM does) and waits for the drain.
    pub async fn stop(self) -> Result<ServeOutcome, ServeError> {
        self.shutdown.cancel();
        self.wait().await
    }
}

impl<X> Running<Grpc, X> {
    /// Where the gRPC service (with health and reflection) listens.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.listen
    }

    /// Records the service's HTTP/JSON listener (served by the same task), so that
    /// [`addrs`](Self::addrs) and `--ready-file` carry it as `"http"` beside `"grpc"`.
    #[must_use]
    pub fn with_http_json(mut self, addr: Option<SocketAddr>) -> Self {
        self.http_json = addr;
        self
    }

    /// Where the HTTP/JSON listener is, if the service has one (br-decision's
    /// `--http-listen`).
    pub fn http_json_addr(&self) -> Option<SocketAddr> {
        self.http_json
    }
}

impl<X> Running<Http, X> {
    /// Where the HTTP proxy listens.
    pub fn http_addr(&self) -> SocketAddr {
        self.listen
    }
}

/// A service's edge: what its listeners enforce and count. Mutual TLS and per-method
/// authorisation (when `--tls-*` are given) with their refusal counters, and the accept bound
/// (`--max-connections`, `--first-byte-timeout`, on every port, TLS or not) with its failure
/// counter. Made once per process by [`Edge::load`] and shared by its servers and clients.
#[derive(Clone, Default)]
pub struct Edge {
    tls: Option<Arc<br_trust::TlsMaterial>>,
    /// `balanceroute_<service>_calls_denied_total{reason}` (TLS only).
    denied: Option<prometheus::IntCounterVec>,
    /// `balanceroute_<service>_tls_handshake_failures_total{reason}` (TLS only).
    handshake_failures: Option<prometheus::IntCounterVec>,
    /// `balanceroute_<service>_accept_failures_total{reason}` (every port).
    accept_failures: Option<prometheus::IntCounterVec>,
    /// `balanceroute_<service>_oversize_calls_total`, shared by every gRPC port; registered
    /// when the first gRPC port is bound, so a service without one (br-shim) does not export a
    /// counter that can never move.
    oversize_calls: Option<Arc<OversizeCounter>>,
}

/// The oversize counter's name and registry, and the counter once a gRPC port asked for it.
struct OversizeCounter {
    name: String,
    registry: prometheus::Registry,
    counter: std::sync::OnceLock<Option<prometheus::IntCounter>>,
}

impl OversizeCounter {
    fn get(&self) -> Option<prometheus::IntCounter> {
        self.counter
            .get_or_init(|| {
                let c = prometheus::IntCounter::new(
                    self.name.clone(),
                    "Unary and server-streaming calls refused RESOURCE_EXHAUSTED because the \
                     request message was above the port's message size limit (client-streaming \
                     methods count theirs in their own refusal counter)",
                )
                .ok()?;
                // registered once per process, so a second registration cannot collide
                self.registry.register(Box::new(c.clone())).ok()?;
                Some(c)
            })
            .clone()
    }
}

impl std::fmt::Debug for Edge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Edge")
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl Edge {
    /// Refuses a plaintext admin port beyond loopback (unless `--allow-insecure-remote`; the
    /// gRPC port is checked by [`bind_grpc`]), loads the certificate files and follows their
    /// rotation until `shutdown`, and registers the edge's counters in `registry`.
    pub fn load(
        common: &CommonArgs,
        service: &str,
        registry: &prometheus::Registry,
        shutdown: &CancellationToken,
    ) -> Result<Edge, StartError> {
        common
            .tls
            .check_bind(common.admin_listen)
            .map_err(|e| StartError::Config(format!("--admin-listen: {e}")))?;
        let tls = common.tls.load().map_err(|e| match e {
            br_trust::tls::TlsError::RoleMap(e) => {
                StartError::Config(format!("--spiffe-role-map: {e}"))
            }
            e => StartError::Config(format!("--tls-cert/--tls-key/--tls-ca: {e}")),
        })?;
        let accept_failures = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                format!("balanceroute_{service}_accept_failures_total"),
                "Connections the gRPC port's accept loop failed or closed before any request, by \
                 reason: accept_error (EMFILE ...; backing off), silent (no first byte in time)",
            ),
            &["reason"],
        )?;
        registry.register(Box::new(accept_failures.clone()))?;
        // exported at 0 from the start, so rate() and alerts see the first one
        for reason in ["accept_error", "silent"] {
            accept_failures.with_label_values(&[reason]);
        }
        let oversize_calls = Arc::new(OversizeCounter {
            name: format!("balanceroute_{service}_oversize_calls_total"),
            registry: registry.clone(),
            counter: std::sync::OnceLock::new(),
        });
        let Some(material) = tls else {
            return Ok(Edge {
                accept_failures: Some(accept_failures),
                oversize_calls: Some(oversize_calls),
                ..Edge::default()
            });
        };
        material.watch(common.tls.tls_reload_interval, shutdown.clone());
        let denied = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                format!("balanceroute_{service}_calls_denied_total"),
                "Calls refused by the method x role table (PERMISSION_DENIED), by reason",
            ),
            &["reason"],
        )?;
        let failures = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                format!("balanceroute_{service}_tls_handshake_failures_total"),
                "TLS handshakes that failed (no or bad client certificate, plaintext) or timed out",
            ),
            &["reason"],
        )?;
        registry.register(Box::new(denied.clone()))?;
        registry.register(Box::new(failures.clone()))?;
        Ok(Edge {
            tls: Some(material),
            denied: Some(denied),
            handshake_failures: Some(failures),
            accept_failures: Some(accept_failures),
            oversize_calls: Some(oversize_calls),
        })
    }

    /// Counts the gRPC ports' oversize refusals (see [`crate::oversize`]).
    pub fn oversize_hook(&self) -> Option<crate::oversize::OversizeHook> {
        let c = self.oversize_calls.as_ref()?.get()?;
        Some(Arc::new(move || c.inc()))
    }

    /// Counts the accept loop's failures (see [`br_trust::accept`]); for every listener of
    /// the service, so a second port is bounded and counted like `--listen`.
    pub fn accept_hook(&self) -> Option<br_trust::accept::AcceptHook> {
        let c = self.accept_failures.clone()?;
        Some(Arc::new(move |reason| c.with_label_values(&[reason]).inc()))
    }

    /// The TLS material, `None` when serving plaintext on loopback.
    pub fn tls(&self) -> Option<&Arc<br_trust::TlsMaterial>> {
        self.tls.as_ref()
    }

    /// What a TLS listener of this service enforces and counts (its material, the denial and
    /// handshake-failure counters); `None` when serving plaintext. Every listener that takes
    /// calls (gRPC, and br-decision's HTTP/JSON) uses the same, so a refusal is counted once
    /// whichever port it came through.
    pub fn serving(&self) -> Option<crate::serve::TlsServing> {
        let material = self.tls.clone()?;
        let denied = self.denied.clone();
        let failures = self.handshake_failures.clone();
        Some(crate::serve::TlsServing {
            material,
            on_deny: denied.map(|c| -> br_trust::policy::DenyHook {
                Arc::new(move |reason, _msg: &str| c.with_label_values(&[reason.label()]).inc())
            }),
            on_handshake_failure: failures.map(|c| -> br_trust::tls::HandshakeFailureHook {
                Arc::new(move |reason: &str| c.with_label_values(&[reason]).inc())
            }),
        })
    }
}

/// Binds `--listen` for a gRPC server with the `--shutdown-grace` drain, HTTP/2 keepalive
/// and, when `edge` has TLS, mutual TLS with per-method authorisation; returns it with the
/// bound address.
pub async fn bind_grpc(
    common: &CommonArgs,
    edge: &Edge,
) -> Result<(GrpcServer, SocketAddr), StartError> {
    bind_grpc_on(common, edge, "--listen", common.listen).await
}

/// [`bind_grpc`] for another gRPC port of the service (`flag` names it in errors, e.g.
/// br-decision's `--ext-proc-listen`): the same TLS, authorisation, keepalive, drain and
/// accept limits as `--listen`, and the same loopback-only rule without TLS.
pub async fn bind_grpc_on(
    common: &CommonArgs,
    edge: &Edge,
    flag: &'static str,
    addr: SocketAddr,
) -> Result<(GrpcServer, SocketAddr), StartError> {
    if edge.tls.is_none() {
        common
            .tls
            .check_bind(addr)
            .map_err(|e| StartError::Config(format!("{flag}: {e}")))?;
    }
    let bind_err = |source| StartError::Bind { flag, addr, source };
    let server = GrpcServer::bind(addr)
        .await
        .map_err(bind_err)?
        .with_grace(common.shutdown_grace)
        .with_keepalive(common.keepalive())
        .with_max_streams_per_connection(common.max_streams_per_connection)
        .with_tls(edge.serving())
        .with_accept_limits(common.accept_limits(descriptor_limit()), edge.accept_hook())
        .with_oversize_hook(edge.oversize_hook());
    let addr = server.local_addr().map_err(bind_err)?;
    Ok((server, addr))
}

/// The process's soft descriptor limit (`ulimit -n`), when it has one.
pub fn descriptor_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

/// Binds `--listen` as a plain TCP listener (the shim's HTTP proxy); returns it with the bound
/// address.
pub async fn bind_listen(
    common: &CommonArgs,
    edge: &Edge,
) -> Result<(br_trust::accept::AcceptListener, SocketAddr), StartError> {
    let bind_err = |source| StartError::Bind {
        flag: "--listen",
        addr: common.listen,
        source,
    };
    let listener = TcpListener::bind(common.listen).await.map_err(bind_err)?;
    let addr = listener.local_addr().map_err(bind_err)?;
    let listener = br_trust::accept::AcceptListener::new(
        listener,
        common.accept_limits(descriptor_limit()),
        edge.accept_hook(),
    )
    .map_err(bind_err)?;
    Ok((listener, addr))
}

/// Starts the admin server on `--admin-listen`; it stops when `stop` is cancelled.
pub async fn start_admin(
    common: &CommonArgs,
    edge: &Edge,
    registry: &prometheus::Registry,
    readiness: &Readiness,
    stop: &CancellationToken,
) -> Result<AdminServer, StartError> {
    start_admin_of(
        common,
        edge,
        std::slice::from_ref(registry),
        readiness,
        axum::Router::new(),
        stop,
    )
    .await
}

/// [`start_admin`] whose `/metrics` gathers several registries (the all-in-one's
/// components), with the service's own `extra` routes beside `/metrics`, `/livez` and
/// `/readyz` (br-decision's live page); under TLS they need the admin role, as `/metrics` does.
pub async fn start_admin_of(
    common: &CommonArgs,
    edge: &Edge,
    registries: &[prometheus::Registry],
    readiness: &Readiness,
    extra: axum::Router,
    stop: &CancellationToken,
) -> Result<AdminServer, StartError> {
    AdminServer::start_gathering(
        common.admin_listen,
        edge.tls.clone(),
        registries.to_vec(),
        readiness.clone(),
        extra,
        stop.clone(),
    )
    .await
    .map_err(|source| StartError::Bind {
        flag: "--admin-listen",
        addr: common.admin_listen,
        source,
    })
}

/// Waits for the admin server started by [`start_admin`].
pub async fn wait_admin(admin: AdminServer) -> Result<(), ServeError> {
    admin.wait().await.map_err(|source| ServeError::Io {
        server: "admin",
        source,
    })
}

/// Writes `addrs` to `path` as JSON, atomically (a temporary file in the same directory, then
/// a rename), so a reader never sees a partial file. This is `--ready-file PATH`: tests pass
/// port 0 and read the real ports from it instead of guessing a free port. Bound is not
/// ready: `/readyz` says when the service can do its job.
pub fn write_ready_file(path: &Path, addrs: &BoundAddrs) -> std::io::Result<()> {
    let json = serde_json::to_vec(addrs).map_err(std::io::Error::other)?;
    let tmp = temp_path(path);
    std::fs::write(&tmp, json)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Reads a file written by [`write_ready_file`] (for tests and tools that start a binary).
pub fn read_ready_file(path: &Path) -> std::io::Result<BoundAddrs> {
    let text = std::fs::read(path)?;
    serde_json::from_slice(&text).map_err(std::io::Error::other)
}

/// `PATH.<pid>.tmp` beside `path`: the same directory, so the rename stays on one filesystem.
fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.tmp", std::process::id()));
    path.with_file_name(name)
}

/// The whole `main` of a service binary (see the crate docs for an example):
///
/// ```text
/// #[tokio::main]
/// async fn main() -> ExitCode {
///     br_runtime::skeleton::main("br-snapshot", br_snapshot::start).await
/// }
/// ```
///
/// It parses the flags (clap, `BALANCEROUTE_*` variables, `--config` TOML; a bad configuration
/// exits with 2), initialises logging and tracing, cancels the shutdown token on the first
/// SIGTERM or SIGINT, starts the service, writes `--ready-file`, logs the bound addresses
/// (unless the service logged its own start-up line: [`Running::announced`]) and waits. Exit
/// code: 0 after a drain (even one cut short by the grace period), 2 if the service refused
/// its configuration at start ([`StartError::Config`]) or found it wrong later
/// ([`ServeError::Config`]), 1 if it could not start otherwise or failed while serving (the error is printed on stderr).
pub async fn main<A, P, X>(
    name: &'static str,
    start: impl AsyncFnOnce(&A, CancellationToken) -> Result<Running<P, X>, StartError>,
) -> ExitCode
where
    A: ServiceArgs,
    P: Protocol,
{
    let args: A = config::parse_or_exit();
    let common = args.common();
    let _guard = match crate::observability::init(
        name,
        common.log_format,
        common.otlp_endpoint.as_deref(),
    ) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: {name}: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let shutdown = crate::serve::shutdown_on_signal();
    let running = match start(&args, shutdown.clone()).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: starting {name}: {e}");
            // A configuration the service refuses at start is as bad as one clap refuses.
            return match e {
                StartError::Config(_) => ExitCode::from(config::EXIT_INVALID_CONFIG),
                _ => ExitCode::FAILURE,
            };
        }
    };
    let addrs = running.addrs();
    if let Some(path) = &common.ready_file
        && let Err(e) = write_ready_file(path, &addrs)
    {
        eprintln!(
            "error: {name}: writing --ready-file {}: {e}",
            path.display()
        );
        shutdown.cancel();
        let _ = running.wait().await;
        return ExitCode::FAILURE;
    }
    match (addrs.grpc, addrs.http) {
        _ if running.announced => {}
        (Some(grpc), _) => tracing::info!(%grpc, admin = %addrs.admin, "{name} listening"),
        (None, Some(http)) => tracing::info!(%http, admin = %addrs.admin, "{name} listening"),
        (None, None) => tracing::info!(admin = %addrs.admin, "{name} listening"),
    }
    match running.wait().await {
        Ok(outcome) => {
            tracing::info!(?outcome, "{name} stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(error = %e, "{name} failed");
            eprintln!("error: {name}: {e}");
            match e {
                ServeError::Config(_) => ExitCode::from(config::EXIT_INVALID_CONFIG),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests;
