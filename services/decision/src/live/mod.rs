//! The live page on the admin port (`/live`): per group, the table of worker states on top,
//! then the KV load of every rank over the last minutes (the paper's Figure 3, live), the
//! decode throughput and an estimated TPOT per rank (from σ's count of generated tokens), the
//! barrier idle I = G·M − ΣL beside the imbalance max − min, the barrier's idle share, the
//! Assign rate and latency and the pool length; the charts mark the samples at which a rank
//! joined, was cordoned or uncordoned, or turned LIVE, SUSPECT or FENCED.
//!
//! This module owns the page's data: one [`GroupHistory`] ring per served group, filled by one
//! sampler task every `--live-sample-interval` from the group's task (σ's summary, the pool,
//! staleness: [`crate::task::Command::Live`]) and from the service's own Assign metrics (rate,
//! latency buckets). It serves the history as JSON (`/live/api/groups`,
//! `/live/api/group/{name}?since=SEQ`) and the page itself, whose assets are compiled into
//! the binary ([`api`]). The routes sit on the admin server, so they follow its rules: plaintext
//! on loopback, and under mutual TLS the admin role, as `/metrics`.
//!
//! Why decision and not the snapshot service: decision holds a replica of σ per group *and*
//! its own Assign rate, latency and pool, so one page shows all of it; the snapshot service
//! knows nothing of Assign.

pub mod api;
pub mod history;

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use prometheus::core::{Collector as _, Metric as _};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::task::GroupHandle;

pub use history::{Counters, GroupHistory, Sample};

/// Most samples one group keeps (`--live-history / --live-sample-interval` above it is refused
/// at start): with the contract's largest group that is ~180 MB (see [`history`]'s
/// arithmetic), so nobody gets there by accident.
pub const MAX_SAMPLES: usize = 7_200;

/// `--live-sample-interval` and `--live-history`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveConfig {
    pub interval: Duration,
    /// Samples kept per group.
    pub samples: usize,
}

/// The histories of every served group, shared by the sampler (the one writer) and the HTTP
/// handlers (readers, which copy out what they answer and hold no lock across an await).
#[derive(Clone, Debug)]
pub struct Live {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    cfg: LiveConfig,
    policy: String,
    /// In `--groups` order (the page's picker shows them so).
    groups: Vec<(String, Mutex<GroupHistory>)>,
}

impl Live {
    pub fn new<'a>(
        cfg: LiveConfig,
        policy: &str,
        groups: impl IntoIterator<Item = &'a str>,
    ) -> Live {
        Live {
            inner: Arc::new(Inner {
                cfg,
                policy: policy.to_owned(),
                groups: groups
                    .into_iter()
                    .map(|g| (g.to_owned(), Mutex::new(GroupHistory::new(cfg.samples))))
                    .collect(),
            }),
        }
    }

    pub fn config(&self) -> LiveConfig {
        self.inner.cfg
    }

    pub fn policy(&self) -> &str {
        &self.inner.policy
    }

    /// The served groups' names, in `--groups` order.
    pub fn group_names(&self) -> impl Iterator<Item = &str> + '_ {
        self.inner.groups.iter().map(|(g, _)| g.as_str())
    }

    /// One group's history, locked (briefly: copy out what is needed).
    pub fn group(&self, name: &str) -> Option<MutexGuard<'_, GroupHistory>> {
        self.inner
            .groups
            .iter()
            .find(|(g, _)| g == name)
            .map(|(_, h)| h.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Starts the sampler: every interval, each group's state from its task and its Assign
    /// counters from `metrics`, into its ring. Stops with `stop`, or when the group tasks end.
    pub fn spawn_sampler(
        &self,
        groups: Vec<GroupHandle>,
        metrics: Metrics,
        stop: CancellationToken,
    ) -> JoinHandle<()> {
        let live = self.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(live.inner.cfg.interval);
            // A sampler delayed by a busy machine takes the next sample late rather than
            // several at once (the series is by wall-clock time anyway).
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let bounds = latency_bounds(&metrics);
            loop {
                tokio::select! {
                    () = stop.cancelled() => break,
                    _ = ticker.tick() => {}
                }
                for h in &groups {
                    let Some(now) = h.live().await else {
                        // the group's task has ended: the service is stopping
                        return;
                    };
                    let counters = counters(&metrics, h.group().as_str());
                    if let Some(mut ring) = live.group(h.group().as_str()) {
                        ring.record(Instant::now(), unix_ms(), now, counters, &bounds);
                    }
                }
            }
        })
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The Assign latency histogram's bucket bounds (seconds), as it was built.
fn latency_bounds(metrics: &Metrics) -> Vec<f64> {
    // Any label set has the same buckets; a series that is never observed costs nothing.
    let h = metrics.assign_latency.with_label_values(&["__bounds__"]);
    let bounds = h
        .metric()
        .get_histogram()
        .get_bucket()
        .iter()
        .map(|b| b.upper_bound())
        .collect();
    let _ = metrics.assign_latency.remove_label_values(&["__bounds__"]);
    bounds
}

/// `group`'s cumulative Assign counters, read from the metrics the service exports.
pub fn counters(metrics: &Metrics, group: &str) -> Counters {
    let mut c = Counters::default();
    for family in metrics.assign_total.collect() {
        for m in family.get_metric() {
            let label = |name: &str| {
                m.get_label()
                    .iter()
                    .find(|l| l.name() == name)
                    .map(|l| l.value().to_owned())
            };
            if label("group").as_deref() != Some(group) {
                continue;
            }
            let n = m.get_counter().get_value() as u64;
            c.assigns += n;
            if label("code").as_deref() != Some("ok") {
                c.failed += n;
            }
        }
    }
    let h = metrics.assign_latency.with_label_values(&[group]).metric();
    let h = h.get_histogram();
    c.latency_buckets = h
        .get_bucket()
        .iter()
        .map(|b| b.cumulative_count())
        .collect();
    c.latency_count = h.get_sample_count();
    c
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;

    #[test]
    fn counters_read_one_group_and_every_code() {
        let m = Metrics::new().unwrap();
        m.init_group("a");
        m.init_group("b");
        m.assign_total.with_label_values(&["a", "ok"]).inc_by(5);
        m.assign_total
            .with_label_values(&["a", "unavailable"])
            .inc_by(2);
        m.assign_total.with_label_values(&["b", "ok"]).inc_by(100);
        let lat = m.assign_latency.with_label_values(&["a"]);
        lat.observe(40e-6);
        lat.observe(150e-6);
        lat.observe(1.0);
        let c = counters(&m, "a");
        assert_eq!((c.assigns, c.failed, c.latency_count), (7, 2, 3));
        let bounds = latency_bounds(&m);
        assert_eq!(bounds.len(), c.latency_buckets.len());
        assert!(bounds.windows(2).all(|w| w[0] < w[1]), "{bounds:?}");
        // ≤ 50 µs: 1, ≤ 200 µs: 2, the 1 s one above every bound
        let at = |b: f64| c.latency_buckets[bounds.iter().position(|x| *x == b).unwrap()];
        assert_eq!((at(50e-6), at(200e-6), at(0.25)), (1, 2, 2));
        // the bounds probe leaves no series behind in /metrics
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&m.registry.gather())
            .unwrap();
        assert!(!text.contains("__bounds__"), "{text}");
    }
}
