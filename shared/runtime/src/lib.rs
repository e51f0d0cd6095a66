//! What every BalanceRoute service binary shares.
//!
//! - [`config`]: clap-derive flags, each also `BALANCEROUTE_<NAME>`, plus `--config FILE`
//!   (TOML); precedence defaults < file < env < flags; [`config::CommonArgs`] to flatten.
//! - `observability`: tracing to stderr (plain/JSON, `RUST_LOG`), optional OTLP export.
//! - [`admin`]: the admin HTTP server (`/metrics`, `/livez`, `/readyz`).
//! - [`serve`]: a tonic server with health, reflection and a graceful, bounded drain on
//!   SIGTERM/SIGINT.
//! - [`http_serve`]: the plain HTTP ports' accept loop (header-read timeout, graceful drain).
//! - `in_flight`: a budget of partially received request messages per process and per
//!   connection, and request size limits per method, on every gRPC port.
//! - `oversize`: a request above the decoding limit answered RESOURCE_EXHAUSTED, not
//!   tonic's OUT_OF_RANGE.
//! - [`error`]: one mapping from a service's error enum to a gRPC status.
//! - [`skeleton`]: the one shape of a service (`start(&Args, shutdown) -> Result<Running,
//!   StartError>`), `--ready-file`, and [`skeleton::main`], the whole of every binary's `main`.
//!
//! A service, in short (br-snapshot, br-ingest, br-decision and br-shim look like this):
//! ```no_run
//! use br_runtime::skeleton::{self, Grpc, Running, ServiceArgs, StartError};
//! use br_runtime::{CancellationToken, admin::Readiness, config};
//! # fn my_routes() -> tonic::service::Routes { tonic::service::Routes::default() }
//!
//! #[derive(Debug, clap::Parser)]
//! struct Args {
//!     #[command(flatten)]
//!     common: config::CommonArgs,
//! }
//! // Validate comes with it: the shared flags' checks, then the service's own `check`.
//! impl ServiceArgs for Args {
//!     fn common(&self) -> &config::CommonArgs { &self.common }
//! }
//!
//! /// Binds every port, starts serving, returns at once; stops when `shutdown` is cancelled.
//! async fn start(args: &Args, shutdown: CancellationToken) -> Result<Running<Grpc>, StartError> {
//!     let registry = prometheus::Registry::new();
//!     let ready = Readiness::default();
//!     // TLS material (when --tls-* are given) and the loopback-only default without it
//!     let edge = skeleton::Edge::load(&args.common, "example", &registry, &shutdown)?;
//!     let admin =
//!         skeleton::start_admin(&args.common, &edge, &registry, &ready, &shutdown).await?;
//!     let (server, grpc_addr) = skeleton::bind_grpc(&args.common, &edge).await?;
//!     ready.set(true);
//!     let admin_addr = admin.local_addr();
//!     Ok(Running::spawn(grpc_addr, admin_addr, ready, shutdown.clone(), (), async move {
//!         let outcome = server.serve(my_routes(), &[br_proto::service_names::DECISION], shutdown).await?;
//!         skeleton::wait_admin(admin).await?;
//!         Ok(outcome)
//!     }))
//! }
//!
//! #[tokio::main]
//! async fn main() -> std::process::ExitCode {
//!     skeleton::main("br-example", start).await
//! }
//! ```

pub mod admin;
pub mod config;
pub mod error;
pub mod http_serve;
mod in_flight;
mod observability;
mod oversize;
mod readiness;
pub mod serve;
pub mod skeleton;

// What a port that is not gRPC needs to charge the process's budget of unfinished request
// bytes (br-decision's HTTP/JSON bodies); the gRPC layer itself stays inside.
pub use in_flight::{ConnectionKey, Held, InFlightBudget, Scope};
pub use oversize::is_too_large;
pub use tokio_util::sync::CancellationToken;
