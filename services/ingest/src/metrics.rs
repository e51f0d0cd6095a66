//! Ingest's Prometheus metrics (names from deploy/metrics-contract.txt, `# ingest`).

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// Every `reason` label value of `balanceroute_ingest_rejected_total`; each is exported from
/// the start (at 0) so dashboards and alerts see the series before the first rejection.
pub const REJECT_REASONS: &[&str] = &[
    // stream-ending (see StreamError::reason)
    "first_not_hello",
    "invalid_hello",
    "worker_id_out_of_range",
    "group_not_allowed",
    "not_your_worker",
    "identity_changed",
    "already_connected",
    "connected_elsewhere",
    "refused_by_snapshot",
    "flood",
    "message_too_large",
    "seq_exhausted",
    // per message (acked REJECTED or STALE_SEQ)
    "missing",
    "empty",
    "too_long",
    "control_character",
    "out_of_range",
    "too_many",
    "duplicate",
    "too_many_updates",
    "too_many_tokens",
    "too_many_requests",
    "rate_limited",
    "stale_seq",
    "overloaded",
    // per change, from the snapshot service's ApplyAck (the stream goes on)
    "not_owner",
];

/// Every `reason` label value of `balanceroute_ingest_stream_timeouts_total` (see
/// `StreamError::reason`): no Hello in time, or no message in time after it.
pub const TIMEOUT_REASONS: &[&str] = &["hello", "idle"];

/// The metrics, registered in the service's registry. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// Open Report streams.
    pub streams: IntGauge,
    /// Messages received on Report streams.
    pub messages: IntCounter,
    /// Request updates accepted (entries of accepted Progress messages).
    pub progress_events: IntCounter,
    /// Rejections, by reason.
    pub rejected: IntCounterVec,
    /// ChangeBatches sent to the snapshot service.
    pub batches_sent: IntCounter,
    /// Changes waiting to be sent (coalescing buffer plus prepared batches).
    pub buffered_changes: IntGauge,
    /// 1 while the Apply stream to the snapshot service is up.
    pub snapshot_connected: IntGauge,
    /// Progress changes dropped from a full buffer (their workers are asked for full state).
    pub dropped_changes: IntCounter,
    /// Changes the snapshot service rejected (ApplyAck.rejected).
    pub snapshot_rejected: IntCounter,
    /// Streams ended because a deadline passed, by reason (`hello`, `idle`).
    pub stream_timeouts: IntCounterVec,
}

impl Metrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &Registry) -> Result<Metrics, prometheus::Error> {
        let m = Metrics {
            streams: IntGauge::new("balanceroute_ingest_streams", "Open telemetry streams")?,
            messages: IntCounter::new(
                "balanceroute_ingest_messages_total",
                "Messages received on telemetry streams",
            )?,
            progress_events: IntCounter::new(
                "balanceroute_ingest_progress_events_total",
                "Request progress updates accepted",
            )?,
            rejected: IntCounterVec::new(
                Opts::new(
                    "balanceroute_ingest_rejected_total",
                    "Telemetry messages or streams rejected, by reason",
                ),
                &["reason"],
            )?,
            batches_sent: IntCounter::new(
                "balanceroute_ingest_batches_sent_total",
                "Change batches sent to the snapshot service",
            )?,
            buffered_changes: IntGauge::new(
                "balanceroute_ingest_buffered_changes",
                "Changes waiting to be sent to the snapshot service",
            )?,
            snapshot_connected: IntGauge::new(
                "balanceroute_ingest_snapshot_connected",
                "1 while the Apply stream to the snapshot service is up",
            )?,
            dropped_changes: IntCounter::new(
                "balanceroute_ingest_dropped_changes_total",
                "Progress changes dropped from the full coalescing buffer (repaired by full state)",
            )?,
            snapshot_rejected: IntCounter::new(
                "balanceroute_ingest_snapshot_rejected_changes_total",
                "Changes the snapshot service did not apply (ApplyAck.rejected)",
            )?,
            stream_timeouts: IntCounterVec::new(
                Opts::new(
                    "balanceroute_ingest_stream_timeouts_total",
                    "Telemetry streams ended for silence: no Hello within --hello-timeout, or no message within --stream-idle-timeout",
                ),
                &["reason"],
            )?,
        };
        registry.register(Box::new(m.streams.clone()))?;
        registry.register(Box::new(m.messages.clone()))?;
        registry.register(Box::new(m.progress_events.clone()))?;
        registry.register(Box::new(m.rejected.clone()))?;
        registry.register(Box::new(m.batches_sent.clone()))?;
        registry.register(Box::new(m.buffered_changes.clone()))?;
        registry.register(Box::new(m.snapshot_connected.clone()))?;
        registry.register(Box::new(m.dropped_changes.clone()))?;
        registry.register(Box::new(m.snapshot_rejected.clone()))?;
        registry.register(Box::new(m.stream_timeouts.clone()))?;
        for r in REJECT_REASONS {
            m.rejected.with_label_values(&[*r]);
        }
        for r in TIMEOUT_REASONS {
            m.stream_timeouts.with_label_values(&[*r]);
        }
        Ok(m)
    }

    /// Counts one rejection.
    pub fn reject(&self, reason: &str) {
        self.rejected.with_label_values(&[reason]).inc();
    }

    /// A registry-less instance (unit tests).
    pub fn unregistered() -> Metrics {
        // Registering into a throwaway registry cannot fail for these fixed names.
        match Metrics::register(&Registry::new()) {
            Ok(m) => m,
            Err(e) => unreachable!("fixed metric definitions are valid: {e}"),
        }
    }
}
