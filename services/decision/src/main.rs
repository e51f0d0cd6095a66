//! `br-decision`: see the library docs and `br-decision --help`.

use br_decision::{Args, app};
use br_runtime::{config, observability, serve};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Args = config::parse_or_exit();
    let _guard = observability::init(
        "br-decision",
        args.common.log_format,
        args.common.otlp_endpoint.as_deref(),
    )?;
    let cfg = args.to_config().map_err(anyhow::Error::msg)?;
    let shutdown = serve::shutdown_on_signal();
    let running = app::start(cfg, shutdown).await?;
    let outcome = running.wait().await?;
    tracing::info!(?outcome, "br-decision stopped");
    Ok(())
}
