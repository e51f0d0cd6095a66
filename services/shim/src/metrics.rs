//! The shim's Prometheus metrics (names from deploy/metrics-contract.txt, `# shim`).

use prometheus::{IntCounter, IntGauge, Opts, Registry};

#[derive(Debug, Clone)]
pub struct ShimMetrics {
    /// Generation requests forwarded.
    pub requests: IntCounter,
    /// Generation requests in flight.
    pub active: IntGauge,
    /// Tokens seen in forwarded responses.
    pub tokens: IntCounter,
    /// Progress reports handed to the reporter.
    pub reports: IntCounter,
    /// 1 while the telemetry stream to ingest is up.
    pub ingest_connected: IntGauge,
    /// Requests refused for a limit, by `reason` (`body_too_large`, `concurrency`, `body_budget`, `body_timeout`).
    pub refused: prometheus::IntCounterVec,
    /// Telemetry streams ended because the snapshot service refused the worker's changes
    /// (each followed by a Hello of a new incarnation).
    pub ingest_refusals: IntCounter,
}

impl ShimMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = ShimMetrics {
            requests: IntCounter::with_opts(Opts::new(
                "balanceroute_shim_requests_total",
                "Generation requests forwarded to the engine.",
            ))?,
            active: IntGauge::with_opts(Opts::new(
                "balanceroute_shim_active_requests",
                "Generation requests in flight through the shim.",
            ))?,
            tokens: IntCounter::with_opts(Opts::new(
                "balanceroute_shim_tokens_total",
                "Generated tokens seen in forwarded responses.",
            ))?,
            reports: IntCounter::with_opts(Opts::new(
                "balanceroute_shim_reports_sent_total",
                "Per-request progress reports handed to the telemetry reporter.",
            ))?,
            ingest_connected: IntGauge::with_opts(Opts::new(
                "balanceroute_shim_ingest_connected",
                "1 while the telemetry stream to ingest is connected.",
            ))?,
            refused: prometheus::IntCounterVec::new(
                Opts::new(
                    "balanceroute_shim_refused_total",
                    "Requests refused for a limit (413 body too large, 503 too many at once or too many body bytes held, 408 body too slow), by limit.",
                ),
                &["reason"],
            )?,
            ingest_refusals: IntCounter::with_opts(Opts::new(
                "balanceroute_shim_ingest_refusals_total",
                "Telemetry streams ended because the snapshot service refused the worker's changes (each followed by a Hello of a new incarnation).",
            ))?,
        };
        for r in [
            "body_too_large",
            "concurrency",
            "body_budget",
            "body_timeout",
        ] {
            m.refused.with_label_values(&[r]);
        }
        registry.register(Box::new(m.refused.clone()))?;
        registry.register(Box::new(m.requests.clone()))?;
        registry.register(Box::new(m.active.clone()))?;
        registry.register(Box::new(m.tokens.clone()))?;
        registry.register(Box::new(m.reports.clone()))?;
        registry.register(Box::new(m.ingest_connected.clone()))?;
        registry.register(Box::new(m.ingest_refusals.clone()))?;
        Ok(m)
    }
}
