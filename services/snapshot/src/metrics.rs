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

/// `reason` label values of `balanceroute_snapshot_refused_total`: the limit that refused a
/// call or ended a stream.
pub const REFUSED_REASONS: &[&str] = &[
    "max_groups",
    "watcher_queue_bytes",
    "message_too_large",
    "max_watchers",
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
    watch_delta_versions: IntCounterVec,
    watch_delta_messages: IntCounterVec,
    reservations_expired: IntCounterVec,
    workers_fenced: IntCounterVec,
    carrier_lost: IntCounterVec,
    carrier_takeovers: IntCounterVec,
    carrier_grace_expired: IntCounterVec,
    unkeyed: IntCounterVec,
    rejected: IntCounterVec,
    groups: IntGauge,
    groups_reclaimed: IntCounter,
    refused: IntCounterVec,
    cordons: IntGauge,
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
            // Versions over messages is how many versions a delta message carries on average:
            // 1 when watchers keep up, more when deltas queued behind each other were merged
            // (`group::queue::Merging`), i.e. fewer messages for watchers to decode.
            watch_delta_versions: counter(
                &r,
                "balanceroute_snapshot_watch_delta_versions_total",
                "σ versions sent to watchers in deltas (summed over watchers); divided by balanceroute_snapshot_watch_delta_messages_total, the versions per message",
                &["group"],
            )?,
            watch_delta_messages: counter(
                &r,
                "balanceroute_snapshot_watch_delta_messages_total",
                "Delta messages sent to watchers (summed over watchers); one carries several versions when deltas queued for a watcher were merged",
                &["group"],
            )?,
            reservations_expired: counter(
                &r,
                "balanceroute_snapshot_reservations_expired_total",
                "Reservations that saw no telemetry within the TTL",
                &["group"],
            )?,
            unkeyed: counter(
                &r,
                "balanceroute_snapshot_unkeyed_requests_total",
                "Requests reported without the gateway's id (the request-id rule), by outcome: matched (took the worker's oldest reservation), unmatched (no reservation: new load), handed_on (a taken reservation's own id showed up; the next oldest was released in its place)",
                &["group", "outcome"],
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
            groups: {
                let g = IntGauge::new("balanceroute_snapshot_groups", "Groups held")?;
                r.register(Box::new(g.clone()))?;
                g
            },
            groups_reclaimed: {
                let c = IntCounter::new(
                    "balanceroute_snapshot_groups_reclaimed_total",
                    "Idle groups forgotten after the idle grace",
                )?;
                r.register(Box::new(c.clone()))?;
                c
            },
            cordons: {
                let g = IntGauge::new(
                    "balanceroute_snapshot_cordons",
                    "Workers cordoned by SetCordon, over every group, as the writer keeps them (with --cordon-file, also across restarts); a cordoned worker not in σ yet is cordoned when it says Hello",
                )?;
                r.register(Box::new(g.clone()))?;
                g
            },
            refused: counter(
                &r,
                "balanceroute_snapshot_refused_total",
                "Calls refused and Watch streams ended for a limit (RESOURCE_EXHAUSTED), by limit",
                &["reason"],
            )?,
            registry: r,
        };
        for reason in reject_reasons() {
            m.rejected.with_label_values(&[reason]);
        }
        for reason in REFUSED_REASONS {
            m.refused.with_label_values(&[reason]);
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

    /// Counts one call refused or stream ended for the limit `reason` (a [`REFUSED_REASONS`]).
    pub fn refuse(&self, reason: &str) {
        self.refused.with_label_values(&[reason]).inc();
    }

    /// How often the limit `reason` refused or ended something.
    #[cfg(test)]
    pub fn refused_count(&self, reason: &str) -> u64 {
        self.refused.with_label_values(&[reason]).get()
    }

    /// The counters of a group's delta messages sent to watchers and the versions they carry
    /// (`watch_delta_messages_total`, `watch_delta_versions_total`), for one Watch stream.
    pub fn watch_deltas(&self, group: &str) -> WatchDeltas {
        WatchDeltas {
            messages: self.watch_delta_messages.with_label_values(&[group]),
            versions: self.watch_delta_versions.with_label_values(&[group]),
        }
    }

    /// How many workers are cordoned (see [`crate::cordons`]).
    pub fn cordons(&self, n: usize) {
        self.cordons.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// How many groups are held, and how many were just reclaimed.
    pub fn groups(&self, held: usize, reclaimed: usize) {
        self.groups.set(i64::try_from(held).unwrap_or(i64::MAX));
        self.groups_reclaimed.inc_by(reclaimed as u64);
    }

    /// The handles of one group (creates every series of the group at 0).
    pub fn group(&self, group: &str) -> GroupMetrics {
        let resets = RESET_REASONS
            .iter()
            .map(|r| self.watch_resets.with_label_values(&[group, r]))
            .collect();
        // Created at 0 with the group, so an operator sees the batching before any watcher.
        let _ = self.watch_deltas(group);
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
            unkeyed_matched: self.unkeyed.with_label_values(&[group, "matched"]),
            unkeyed_unmatched: self.unkeyed.with_label_values(&[group, "unmatched"]),
            unkeyed_handed_on: self.unkeyed.with_label_values(&[group, "handed_on"]),
            worker_load: Vec::new(),
        }
    }
}

/// One Watch stream's handles on its group's delta counters (see [`Metrics::watch_deltas`]).
#[derive(Debug, Clone)]
pub struct WatchDeltas {
    messages: IntCounter,
    versions: IntCounter,
}

impl WatchDeltas {
    /// Counts one delta message spanning `prev_version` to `version`.
    pub fn sent(&self, prev_version: u64, version: u64) {
        self.messages.inc();
        self.versions.inc_by(version.saturating_sub(prev_version));
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
    /// `unkeyed_requests_total` by outcome.
    pub unkeyed_matched: IntCounter,
    pub unkeyed_unmatched: IntCounter,
    pub unkeyed_handed_on: IntCounter,
    worker_load: Vec<Option<IntGauge>>,
}

impl GroupMetrics {
    /// A watcher was ended: its queue went over its bytes.
    pub fn watcher_over_bytes(&self) {
        self.family.refuse("watcher_queue_bytes");
    }

    /// Removes every series of the group (it was reclaimed: an idle group's series must not
    /// outlive it, or `/metrics` grows with every name ever used).
    pub fn remove(&self) {
        let f = &self.family;
        let g = self.group.as_str();
        // A series that is not there is fine: nothing to remove.
        let _ = f.version.remove_label_values(&[g]);
        let _ = f.batches_applied.remove_label_values(&[g]);
        let _ = f.imbalance.remove_label_values(&[g]);
        let _ = f.barrier_idle.remove_label_values(&[g]);
        let _ = f.requests.remove_label_values(&[g, "reserved"]);
        let _ = f.requests.remove_label_values(&[g, "active"]);
        let _ = f.watchers.remove_label_values(&[g]);
        for r in RESET_REASONS {
            let _ = f.watch_resets.remove_label_values(&[g, r]);
        }
        let _ = f.watch_delta_versions.remove_label_values(&[g]);
        let _ = f.watch_delta_messages.remove_label_values(&[g]);
        let _ = f.reservations_expired.remove_label_values(&[g]);
        let _ = f.workers_fenced.remove_label_values(&[g]);
        for o in ["matched", "unmatched", "handed_on"] {
            let _ = f.unkeyed.remove_label_values(&[g, o]);
        }
        for (id, w) in self.worker_load.iter().enumerate() {
            if w.is_some() {
                let _ = f
                    .worker_load
                    .remove_label_values(&[g, id.to_string().as_str()]);
            }
        }
    }

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
