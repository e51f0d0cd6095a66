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

mod bind;
mod edge;
mod running;

pub use bind::{
    bind_grpc, bind_grpc_on, bind_listen, descriptor_limit, start_admin, start_admin_of, wait_admin,
};
pub use edge::Edge;
pub use running::{BoundAddrs, Running};

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
/// SIGTERM or SIGINT, logs the allocator's settings (br-memory), starts the service, writes
/// `--ready-file`, logs the bound addresses
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
        common.trace_filter.as_deref(),
    ) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: {name}: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    match br_memory::settings() {
        Ok(s) if s.in_use => tracing::debug!(
            background_thread = s.background_thread,
            dirty_decay_ms = s.dirty_decay_ms,
            muzzy_decay_ms = s.muzzy_decay_ms,
            "allocator: jemalloc"
        ),
        Ok(_) => tracing::debug!("allocator: not jemalloc"),
        Err(e) => tracing::warn!("allocator: {e}"),
    }
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
