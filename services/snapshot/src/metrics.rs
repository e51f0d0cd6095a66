//! The snapshot service's Prometheus metrics (the `# snapshot` section of
//! `deploy/metrics-contract.txt`), on a per-service [`Registry`].
//!
//! Load metrics are over σ's `load_tokens` (L_g: reserved requests count their prompt, active
//! ones prompt + generated), over live (not fenced) workers:
//! * `imbalance_tokens` = max L_g − min L_g;
//! * `barrier_idle_tokens` = G·max L_g − Σ L_g, the token-slots idle at the lockstep barrier
//!   (the paper's I(k)), the same definitions as `br-sim`'s report.

use br_core::ClusterState;
use br_proto::v1::RejectReason;
use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

/// `reason` label values of `balanceroute_snapshot_rejected_total` created at start, so the
/// family is exported before anything was rejected: every reject reason's label (br-proto's
/// one map) except `unspecified`, which this service never sends.
pub fn reject_reasons() -> impl Iterator<Item = &'static str> {
    RejectReason::ALL
        .into_iter()
        .filter(|r| *r != RejectReason::Unspecified)
        .map(RejectReason::label)
}

/// `reason` label values of `balanceroute_snapshot_watch_resets_total`.
pub const RESET_REASONS: &[&str] = &[
    "unknown_epoch",
    "history_truncated",
    "slow_consumer",
    "future_version",
];

/// Every metric family of the service.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    version: IntGaugeVec,
    batches_applied: IntCounterVec,
    worker_load: IntGaugeVec,
    imbalance: IntGaugeVec,
    barrier_idle: IntGaugeVec,
    requests: IntGaugeVec,
    watchers: IntGaugeVec,
    watch_resets: IntCounterVec,
    reservations_expired: IntCounterVec,
    workers_fenced: IntCounterVec,
    carrier_lost: IntCounterVec,
    carrier_takeovers: IntCounterVec,
    carrier_grace_expired: IntCounterVec,
    rejected: IntCounterVec,
}

fn gauge(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntGaugeVec> {
    let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
    reg.register(Box::new(g.clone()))?;
    Ok(g)
}

fn counter(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    reg.register(Box::new(c.clone()))?;
    Ok(c)
}

impl Metrics {
    /// Registers every family on a new registry.
    pub fn new() -> prometheus::Result<Metrics> {
        let r = Registry::new();
        let m = Metrics {
            version: gauge(
                &r,
                "balanceroute_snapshot_version",
                "σ's version in the current epoch",
                &["group"],
            )?,
            batches_applied: counter(
                &r,
                "balanceroute_snapshot_batches_applied_total",
                "Change batches that moved σ to a new version",
                &["group"],
            )?,
            worker_load: gauge(
                &r,
                "balanceroute_snapshot_worker_load_tokens",
                "L_g: KV tokens of a worker's reserved and active requests in σ",
                &["group", "worker"],
            )?,
            imbalance: gauge(
                &r,
                "balanceroute_snapshot_imbalance_tokens",
                "max minus min L_g over live workers",
                &["group"],
            )?,
            barrier_idle: gauge(
                &r,
                "balanceroute_snapshot_barrier_idle_tokens",
                "G·max L_g − Σ L_g over live workers: token-slots idle at the lockstep barrier",
                &["group"],
            )?,
            requests: gauge(
                &r,
                "balanceroute_snapshot_requests",
                "Requests in σ by state (reserved, active)",
                &["group", "state"],
            )?,
            watchers: gauge(
                &r,
                "balanceroute_snapshot_watchers",
                "Open Watch streams",
                &["group"],
            )?,
            watch_resets: counter(
                &r,
                "balanceroute_snapshot_watch_resets_total",
                "Resets sent to watchers, by reason",
                &["group", "reason"],
            )?,
            reservations_expired: counter(
                &r,
                "balanceroute_snapshot_reservations_expired_total",
                "Reservations that saw no telemetry within the TTL",
                &["group"],
            )?,
            workers_fenced: counter(
                &r,
                "balanceroute_snapshot_workers_fenced_total",
                "Workers fenced after the grace period",
                &["group"],
            )?,
            carrier_lost: counter(
                &r,
                "balanceroute_snapshot_carrier_lost_total",
                "LIVE workers whose ingest replica's Apply stream ended (kept routable for the carrier grace)",
                &["group"],
            )?,
            carrier_takeovers: counter(
                &r,
                "balanceroute_snapshot_carrier_takeovers_total",
                "Workers whose Hello arrived through another ingest stream than the one carrying them",
                &["group"],
            )?,
            carrier_grace_expired: counter(
                &r,
                "balanceroute_snapshot_carrier_grace_expired_total",
                "Workers that lost their ingest replica and said no Hello within the carrier grace (then SUSPECT)",
                &["group"],
            )?,
            rejected: counter(
                &r,
                "balanceroute_snapshot_rejected_total",
                "Rejected changes, reservations and calls, by reason",
                &["reason"],
            )?,
            registry: r,
        };
        for reason in reject_reasons() {
            m.rejected.with_label_values(&[reason]);
        }
        Ok(m)
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Counts one rejection.
    pub fn reject(&self, reason: &str) {
        self.rejected.with_label_values(&[reason]).inc();
    }

    /// The handles of one group (creates every series of the group at 0).
    pub fn group(&self, group: &str) -> GroupMetrics {
        let resets = RESET_REASONS
            .iter()
            .map(|r| self.watch_resets.with_label_values(&[group, r]))
            .collect();
        GroupMetrics {
            group: group.to_owned(),
            family: self.clone(),
            version: self.version.with_label_values(&[group]),
            batches: self.batches_applied.with_label_values(&[group]),
            imbalance: self.imbalance.with_label_values(&[group]),
            barrier_idle: self.barrier_idle.with_label_values(&[group]),
            reserved: self.requests.with_label_values(&[group, "reserved"]),
            active: self.requests.with_label_values(&[group, "active"]),
            watchers: self.watchers.with_label_values(&[group]),
            resets,
            expired: self.reservations_expired.with_label_values(&[group]),
            fenced: self.workers_fenced.with_label_values(&[group]),
            orphaned: self.carrier_lost.with_label_values(&[group]),
            takeovers: self.carrier_takeovers.with_label_values(&[group]),
            orphans_expired: self.carrier_grace_expired.with_label_values(&[group]),
            worker_load: Vec::new(),
        }
    }
}

/// Cached handles of one group's series.
#[derive(Debug)]
pub struct GroupMetrics {
    group: String,
    family: Metrics,
    pub version: IntGauge,
    pub batches: IntCounter,
    imbalance: IntGauge,
    barrier_idle: IntGauge,
    reserved: IntGauge,
    active: IntGauge,
    pub watchers: IntGauge,
    resets: Vec<IntCounter>,
    pub expired: IntCounter,
    pub fenced: IntCounter,
    /// `carrier_lost_total`.
    pub orphaned: IntCounter,
    /// `carrier_takeovers_total`.
    pub takeovers: IntCounter,
    /// `carrier_grace_expired_total`.
    pub orphans_expired: IntCounter,
    worker_load: Vec<Option<IntGauge>>,
}

impl GroupMetrics {
    /// The families these handles belong to.
    pub fn family(&self) -> &Metrics {
        &self.family
    }

    /// Counts a reset sent; `reason` is a `ResetReason` value.
    pub fn reset(&self, reason: br_proto::v1::ResetReason) {
        let i = match reason {
            br_proto::v1::ResetReason::UnknownEpoch => 0,
            br_proto::v1::ResetReason::HistoryTruncated => 1,
            br_proto::v1::ResetReason::SlowConsumer => 2,
            br_proto::v1::ResetReason::FutureVersion | br_proto::v1::ResetReason::Unspecified => 3,
        };
        if let Some(c) = self.resets.get(i) {
            c.inc();
        }
    }

    /// Sets the load-derived gauges from σ after a new version.
    pub fn observe(
        &mut self,
        version: u64,
        cluster: &ClusterState,
        reserved: usize,
        active: usize,
    ) {
        self.version.set(to_i64(version));
        self.reserved.set(to_i64(reserved as u64));
        self.active.set(to_i64(active as u64));
        let (mut max, mut min, mut sum, mut live) = (0u64, u64::MAX, 0u64, 0u64);
        for (id, w) in cluster.workers().iter().enumerate() {
            if !(w.alive || w.capacity > 0) {
                continue; // an id σ never held
            }
            if self.worker_load.len() <= id {
                self.worker_load.resize(id + 1, None);
            }
            let g = self.worker_load[id].get_or_insert_with(|| {
                self.family
                    .worker_load
                    .with_label_values(&[self.group.as_str(), id.to_string().as_str()])
            });
            let load = if w.alive { w.load() } else { 0 };
            g.set(to_i64(load));
            if w.alive {
                live += 1;
                max = max.max(load);
                min = min.min(load);
                sum += load;
            }
        }
        if live == 0 {
            min = 0;
        }
        self.imbalance.set(to_i64(max - min));
        self.barrier_idle
            .set(to_i64((live * max).saturating_sub(sum)));
    }
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
