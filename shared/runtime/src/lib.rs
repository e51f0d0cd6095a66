//! What every BalanceRoute service binary shares.
//!
//! - [`config`]: clap-derive flags, each also `BALANCEROUTE_<NAME>`, plus `--config FILE`
//!   (TOML); precedence defaults < file < env < flags; [`config::CommonArgs`] to flatten.
//! - [`observability`]: tracing to stderr (plain/JSON, `RUST_LOG`), optional OTLP export.
//! - [`admin`]: the admin HTTP server (`/metrics`, `/livez`, `/readyz`).
//! - [`serve`]: a tonic server with health, reflection and a graceful, bounded drain on
//!   SIGTERM/SIGINT.
//! - [`error`]: one mapping from a service's error enum to a gRPC status.
//!
//! A service's `main`, in short:
//! ```no_run
//! use br_runtime::{admin, config, observability, serve};
//! # #[derive(Debug, clap::Parser)]
//! # struct Args { #[command(flatten)] common: config::CommonArgs }
//! # impl config::Validate for Args { fn validate(&self) -> Result<(), String> { self.common.validate() } }
//! # fn my_routes() -> tonic::service::Routes { tonic::service::Routes::default() }
//! #[tokio::main]
//! async fn main() -> anyhow::Result<()> {
//!     let args: Args = config::parse_or_exit();
//!     let _guard = observability::init("br-decision", args.common.log_format,
//!                                      args.common.otlp_endpoint.as_deref())?;
//!     let shutdown = serve::shutdown_on_signal();
//!     let registry = prometheus::Registry::new();
//!     let ready = admin::Readiness::default();
//!     let admin = admin::AdminServer::start(args.common.admin_listen, registry.clone(),
//!                                           ready.clone(), shutdown.clone()).await?;
//!     let server = serve::GrpcServer::bind(args.common.listen).await?
//!         .with_grace(args.common.shutdown_grace);
//!     ready.set(true);
//!     server.serve(my_routes(), &[br_proto::service_names::DECISION], shutdown).await?;
//!     admin.wait().await?;
//!     Ok(())
//! }
//! ```

pub mod admin;
pub mod config;
pub mod error;
pub mod observability;
pub mod serve;

pub use tokio_util::sync::CancellationToken;
