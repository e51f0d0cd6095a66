//! `br-snapshot`: see the library docs and `br-snapshot --help`.

use anyhow::Context as _;
use br_runtime::{config, observability, serve};
use br_snapshot::Args;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Args = config::parse_or_exit();
    let _guard = observability::init(
        "br-snapshot",
        args.common.log_format,
        args.common.otlp_endpoint.as_deref(),
    )?;
    let shutdown = serve::shutdown_on_signal();
    let running = br_snapshot::start(&args, shutdown)
        .await
        .context("starting br-snapshot")?;
    let outcome = running.wait().await.context("serving")?;
    tracing::info!(?outcome, "br-snapshot stopped");
    Ok(())
}
