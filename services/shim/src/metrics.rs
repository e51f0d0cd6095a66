//! The shim's Prometheus metrics (names from deploy/metrics-contract.txt, `# shim`), and the
//! [`Labelled`] collector that gives every one of them its `group` and `worker` labels.

use prometheus::core::{Collector, Desc};
use prometheus::proto::{LabelPair, MetricFamily};
use prometheus::{IntCounter, IntGauge, Opts, Registry};

use crate::health::UpstreamError;

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
    /// Proxied requests that failed at the engine, by `kind` (see [`UpstreamError`]).
    pub upstream_errors: prometheus::IntCounterVec,
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
                    "Requests refused for a limit (413 body too large, 503 too many at once or too many body bytes held, 408 body too slow) or, by a shim serving several ranks, for naming none it serves (404 no_rank), by reason.",
                ),
                &["reason"],
            )?,
            ingest_refusals: IntCounter::with_opts(Opts::new(
                "balanceroute_shim_ingest_refusals_total",
                "Telemetry streams ended because the snapshot service refused the worker's changes (each followed by a Hello of a new incarnation).",
            ))?,
            upstream_errors: prometheus::IntCounterVec::new(
                Opts::new(
                    "balanceroute_shim_upstream_errors_total",
                    "Proxied requests that failed at the engine, by kind: connection (none, or lost before a response), timeout, status_5xx, body (cut off).",
                ),
                &["kind"],
            )?,
        };
        for k in UpstreamError::ALL {
            m.upstream_errors.with_label_values(&[k.label()]);
        }
        registry.register(Box::new(m.upstream_errors.clone()))?;
        for r in [
            "body_too_large",
            "concurrency",
            "body_budget",
            "body_timeout",
            "no_rank",
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

/// Gathers inner registries and adds `group` and `worker` labels to every sample, so that every
/// series a shim exports says whose it is (a fleet's shims are scraped into one Prometheus).
/// Each inner registry has its own `worker` value: a rank's own metrics carry its id; the
/// process-wide ones (limits, accept loop, TLS, engine health) carry the `--worker-id`, or the
/// `--worker-ids` list of a shim that serves several ranks. A sample that already carries a
/// label keeps its own value.
///
/// Registered as a collector without descriptors (an "unchecked" collector: the inner
/// registries checked their own metrics when they were registered there).
#[derive(Debug, Clone, Default)]
pub struct Labelled {
    inner: Vec<(Registry, Vec<LabelPair>)>,
}

impl Labelled {
    /// Adds `registry`, whose samples get `labels`.
    #[must_use]
    pub fn with(mut self, registry: Registry, labels: &[(&str, &str)]) -> Self {
        let pairs = labels
            .iter()
            .map(|(k, v)| {
                let mut p = LabelPair::default();
                p.set_name((*k).to_owned());
                p.set_value((*v).to_owned());
                p
            })
            .collect();
        self.inner.push((registry, pairs));
        self
    }
}

impl Collector for Labelled {
    fn desc(&self) -> Vec<&Desc> {
        Vec::new()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let mut out = Vec::new();
        for (registry, pairs) in &self.inner {
            for mut mf in registry.gather() {
                for m in mf.mut_metric().iter_mut() {
                    let mut labels = m.take_label();
                    for p in pairs {
                        if !labels.iter().any(|l| l.name() == p.name()) {
                            labels.push(p.clone());
                        }
                    }
                    labels.sort_by(|a, b| a.name().cmp(b.name()));
                    m.set_label(labels);
                }
                out.push(mf);
            }
        }
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_of_every_registry_gets_its_group_and_worker() {
        let process = Registry::new();
        let c = prometheus::IntCounterVec::new(Opts::new("p_total", "p"), &["reason"]).unwrap();
        process.register(Box::new(c.clone())).unwrap();
        c.with_label_values(&["x"]).inc();
        let (r0, r1) = (Registry::new(), Registry::new());
        let m0 = ShimMetrics::new(&r0).unwrap();
        let m1 = ShimMetrics::new(&r1).unwrap();
        m0.tokens.inc_by(2);
        m1.tokens.inc_by(5);
        let outer = Registry::new();
        outer
            .register(Box::new(
                Labelled::default()
                    .with(process, &[("group", "g"), ("worker", "0-1")])
                    .with(r0, &[("group", "g"), ("worker", "0")])
                    .with(r1, &[("group", "g"), ("worker", "1")]),
            ))
            .unwrap();
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&outer.gather())
            .unwrap();
        let m = br_testkit::prom::Metrics::parse(&text).unwrap();
        assert_eq!(
            m.value(
                "p_total",
                &[("group", "g"), ("worker", "0-1"), ("reason", "x")]
            ),
            1.0
        );
        let tokens = "balanceroute_shim_tokens_total";
        assert_eq!(m.value(tokens, &[("group", "g"), ("worker", "0")]), 2.0);
        assert_eq!(m.value(tokens, &[("group", "g"), ("worker", "1")]), 5.0);
        for name in m.samples.iter().map(|s| s.name.clone()).collect::<Vec<_>>() {
            let labels = m.label_names(&name);
            assert!(
                labels.contains("group") && labels.contains("worker"),
                "{name}: {labels:?}"
            );
        }
        assert_eq!(
            text.matches("# TYPE balanceroute_shim_tokens_total")
                .count(),
            1,
            "one family per name: {text}"
        );
    }
}
