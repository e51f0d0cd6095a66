//! br-ingest: see the library docs.

use br_runtime::{config, observability, serve};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: br_ingest::Args = config::parse_or_exit();
    let _guard = observability::init(
        "br-ingest",
        args.common.log_format,
        args.common.otlp_endpoint.as_deref(),
    )?;
    let shutdown = serve::shutdown_on_signal();
    let running = br_ingest::start(&args, shutdown).await?;
    tracing::info!(grpc = %running.grpc_addr, admin = %running.admin_addr,
        snapshot = %args.snapshot_addr, "br-ingest started");
    running.wait().await;
    Ok(())
}
