//! `br-shim`: sidecar reverse proxy in front of one OpenAI-compatible decode rank.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use br_runtime::config::{self, CommonArgs, Validate};
use br_runtime::{admin, observability, serve};
use br_shim::report::{NullSink, ProgressSink, ReporterSink};
use br_shim::{Shim, ShimMetrics};
use clap::Parser;

/// br-shim: forwards an OpenAI-compatible decode rank's traffic untouched and reports each
/// request's token progress to BalanceRoute's ingest.
#[derive(Debug, Parser)]
#[command(name = "br-shim", version)]
#[command(mut_arg("listen", |a| a.default_value("127.0.0.1:8100")))]
#[command(mut_arg("admin_listen", |a| a.default_value("127.0.0.1:9064")))]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// The decode rank's OpenAI-compatible base URL.
    #[arg(
        long,
        env = "BALANCEROUTE_UPSTREAM",
        default_value = "http://127.0.0.1:8000"
    )]
    upstream: String,
    /// Ingest's gRPC URL; empty to forward without reporting.
    #[arg(
        long,
        env = "BALANCEROUTE_INGEST_ADDR",
        default_value = "http://127.0.0.1:50062"
    )]
    ingest_addr: String,
    /// The lockstep group the rank belongs to.
    #[arg(long, env = "BALANCEROUTE_GROUP", default_value = "default")]
    group: String,
    /// The rank's DP rank within its group.
    #[arg(long, env = "BALANCEROUTE_WORKER_ID", default_value_t = 0)]
    worker_id: u32,
    /// B: the most requests the rank runs at once (the engine's max_num_seqs).
    #[arg(long, env = "BALANCEROUTE_CAPACITY", default_value_t = 256)]
    capacity: u32,
    /// Where gateways should send this rank's requests, as announced to ingest (default: this
    /// shim's own http://LISTEN).
    #[arg(long, env = "BALANCEROUTE_ENDPOINT")]
    endpoint: Option<String>,
    /// Ask the engine for per-chunk usage (vLLM's stream_options) and strip what the client
    /// did not ask for; `false` for engines that reject stream_options (then chunks are counted).
    #[arg(long, env = "BALANCEROUTE_INJECT_USAGE", default_value_t = true, action = clap::ArgAction::Set)]
    inject_usage: bool,
}

impl Validate for Args {
    fn validate(&self) -> Result<(), String> {
        self.common.validate()?;
        if !self.upstream.starts_with("http://") {
            return Err(format!(
                "--upstream {:?} must be an http:// URL",
                self.upstream
            ));
        }
        let ok = |u: &str| u.starts_with("http://") || u.starts_with("https://");
        if !(self.ingest_addr.is_empty() || ok(&self.ingest_addr)) {
            return Err(format!(
                "--ingest-addr {:?} must be an http(s):// URL (or empty)",
                self.ingest_addr
            ));
        }
        if self.capacity == 0 {
            return Err("--capacity must be at least 1".into());
        }
        Ok(())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Args = config::parse_or_exit();
    let _guard = observability::init(
        "br-shim",
        args.common.log_format,
        args.common.otlp_endpoint.as_deref(),
    )?;
    let shutdown = serve::shutdown_on_signal();
    let registry = prometheus::Registry::new();
    let metrics = ShimMetrics::new(&registry).context("registering metrics")?;

    let listener = tokio::net::TcpListener::bind(args.common.listen)
        .await
        .with_context(|| format!("binding --listen {}", args.common.listen))?;
    let local = listener.local_addr()?;
    let endpoint = args
        .endpoint
        .clone()
        .unwrap_or_else(|| format!("http://{local}"));

    let mut reporter = None;
    let sink: Arc<dyn ProgressSink> = if args.ingest_addr.is_empty() {
        tracing::warn!("no --ingest-addr: forwarding without reporting progress");
        Arc::new(NullSink)
    } else {
        let mut cfg = br_client::reporter::ReporterConfig::new(
            args.ingest_addr.clone(),
            args.group.clone(),
            args.worker_id,
            args.capacity,
        );
        cfg.endpoint = endpoint.clone();
        let handle = br_client::reporter::Reporter::spawn(cfg).context("starting the reporter")?;
        reporter = Some(handle.clone());
        Arc::new(ReporterSink(handle))
    };

    let shim = Arc::new(Shim::new(
        &args.upstream,
        args.inject_usage,
        sink.clone(),
        metrics.clone(),
    )?);
    let ready = admin::Readiness::default();
    let admin = admin::AdminServer::start(
        args.common.admin_listen,
        registry.clone(),
        ready.clone(),
        shutdown.clone(),
    )
    .await
    .with_context(|| format!("binding --admin-listen {}", args.common.admin_listen))?;

    // The ingest_connected gauge follows the reporter.
    {
        let sink = sink.clone();
        let gauge = metrics.ingest_connected.clone();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tokio::select! {
                    _ = tick.tick() => gauge.set(i64::from(sink.connected())),
                    () = stop.cancelled() => break,
                }
            }
        });
    }

    tracing::info!(listen = %local, admin = %admin.local_addr(), upstream = %args.upstream,
        group = %args.group, worker_id = args.worker_id, capacity = args.capacity,
        endpoint = %endpoint, "br-shim serving");
    ready.set(true);
    let app = br_shim::router(shim);
    let grace = args.common.shutdown_grace;
    let stop = shutdown.clone();
    let server = axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned());
    tokio::select! {
        r = server => r.context("serving")?,
        // Streams can be long: after the grace period, stop waiting for them.
        () = async { shutdown.cancelled().await; tokio::time::sleep(grace).await } => {
            tracing::warn!("grace period over; closing open streams");
        }
    }
    if let Some(r) = reporter {
        r.shutdown().await;
    }
    admin.wait().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn every_flag_has_its_env_var() {
        assert_eq!(config::check_env_names(&Args::command()), Ok(()));
    }

    #[test]
    fn defaults_follow_the_conventions() {
        let a: Args = config::parse_from(["br-shim"]).expect("defaults parse");
        assert_eq!(a.common.listen.to_string(), "127.0.0.1:8100");
        assert_eq!(a.common.admin_listen.to_string(), "127.0.0.1:9064");
        assert_eq!(a.ingest_addr, "http://127.0.0.1:50062");
        assert!(a.inject_usage);
    }
}
