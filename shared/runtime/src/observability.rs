//! Logging and tracing: `tracing` to stderr (plain or JSON, filtered by `RUST_LOG`, default
//! `info`), plus OpenTelemetry trace export over OTLP/gRPC when an endpoint is configured (off
//! by default), which also turns on W3C trace-context propagation across processes
//! (br-trace: every gRPC server continues its caller's trace, every client sends its own).
//! The export batches spans for `OTEL_BSP_SCHEDULE_DELAY` ms (5000 by default). Which spans
//! are exported has its own filter (`--trace-filter`), so logs and traces can differ.

use anyhow::Context as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

/// The log output format (`--log-format`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Deserialize,
    serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Plain,
    /// One JSON object per line (for log shippers).
    Json,
}

/// The standard OpenTelemetry variable, used when `--otlp-endpoint` is not given.
pub const OTEL_ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// Keeps the trace exporter alive; flushes and shuts it down when dropped. Hold it in `main`
/// until the service has stopped.
#[must_use = "dropping the guard stops trace export"]
pub struct ObservabilityGuard {
    tracer_provider: Option<SdkTracerProvider>,
}

impl std::fmt::Debug for ObservabilityGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObservabilityGuard")
            .field("otlp", &self.tracer_provider.is_some())
            .finish()
    }
}

impl Drop for ObservabilityGuard {
    fn drop(&mut self) {
        if let Some(p) = self.tracer_provider.take()
            && let Err(e) = p.shutdown()
        {
            eprintln!("opentelemetry shutdown: {e}");
        }
    }
}

/// Installs the global tracing subscriber. `otlp_endpoint` (or, if `None`,
/// `OTEL_EXPORTER_OTLP_ENDPOINT`) turns on OTLP/gRPC trace export with `service_name` as the
/// resource's `service.name`. Must be called inside a tokio runtime when exporting (the
/// exporter's channel is created on it). `trace_filter` chooses the exported spans (RUST_LOG's
/// syntax; `None`: the log's filter). Fails if a global subscriber is already set or the filter
/// does not parse.
pub fn init(
    service_name: &'static str,
    format: LogFormat,
    otlp_endpoint: Option<&str>,
    trace_filter: Option<&str>,
) -> anyhow::Result<ObservabilityGuard> {
    let filter = || EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let span_filter = match trace_filter {
        Some(f) => EnvFilter::try_new(f).with_context(|| format!("--trace-filter {f:?}"))?,
        None => filter(),
    };
    let fmt_layer = match format {
        // Colour only on a terminal: a log redirected to a file or collected by a runtime gets
        // no ANSI escape codes.
        LogFormat::Plain => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_writer(std::io::stderr)
            .boxed(),
    };

    let endpoint = otlp_endpoint
        .map(str::to_owned)
        .or_else(|| std::env::var(OTEL_ENDPOINT_ENV).ok())
        .filter(|e| !e.is_empty());

    let (otel_layer, tracer_provider) = match &endpoint {
        Some(ep) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(ep.clone())
                .build()
                .with_context(|| format!("OTLP exporter for {ep}"))?;
            let provider = SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(Resource::builder().with_service_name(service_name).build())
                .build();
            let tracer = provider.tracer(service_name);
            let layer = tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_filter(span_filter);
            (Some(layer), Some(provider))
        }
        None => (None, None),
    };

    tracing_subscriber::registry()
        .with(fmt_layer.with_filter(filter()))
        .with(otel_layer)
        .try_init()
        .context("installing the tracing subscriber")?;

    if let Some(ep) = &endpoint {
        // Only now: with no exporter there is nothing to continue or send, and every call
        // skips the propagation work (br-trace checks one flag).
        br_trace::install();
        tracing::info!(endpoint = %ep, "exporting traces over OTLP/gRPC");
    }
    Ok(ObservabilityGuard { tracer_provider })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;

    /// One test only: the global subscriber can be installed once per process.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn init_with_otlp_then_refuses_a_second_subscriber() {
        // Loopback port with nothing behind it: the exporter connects lazily, so init succeeds.
        assert!(init("br-test", LogFormat::Json, None, Some("br=loud")).is_err());
        let guard = init(
            "br-test",
            LogFormat::Json,
            Some("http://127.0.0.1:9"),
            Some("info"),
        )
        .unwrap();
        assert!(guard.tracer_provider.is_some(), "traces are exported");
        tracing::info_span!("test_span").in_scope(|| tracing::info!("hello"));
        assert!(init("br-test", LogFormat::Plain, None, None).is_err());
        let started = std::time::Instant::now();
        tokio::task::spawn_blocking(move || drop(guard))
            .await
            .unwrap();
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
    }

    #[test]
    fn log_format_parses_from_flags() {
        use clap::ValueEnum as _;
        assert_eq!(LogFormat::from_str("json", true), Ok(LogFormat::Json));
        assert_eq!(LogFormat::from_str("plain", true), Ok(LogFormat::Plain));
        assert!(LogFormat::from_str("xml", true).is_err());
    }
}
