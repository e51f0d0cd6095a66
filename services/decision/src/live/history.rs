//! One group's history for the live page: a ring of samples taken every
//! `--live-sample-interval`, holding at most `--live-history / --live-sample-interval`
//! of them (oldest dropped first), and the trailing window the Assign rate and latency are
//! measured over. Pure: time comes in as arguments, so the bound and the window are tested
//! without a clock.
//!
//! Memory: a [`Sample`] is about 100 bytes plus 16 per rank ([`RankLoad`]), so a group holds
//! at most `capacity × (100 + 16·ranks)` bytes: with the defaults (600 samples) about 130 KB
//! for G = 8, 670 KB for G = 64, and 10 MB for the contract's largest group (1,024 ranks). The
//! full worker table is kept for the latest sample only; the window's counters are a few
//! entries of 16 bucket counts.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::{Serialize, Serializer};

use crate::group::LiveNow;

/// How far back the Assign rate and latency percentiles of a sample look (or one sample
/// interval, when that is longer): short enough to follow a burst, long enough to hold
/// more than a handful of calls at modest rates.
pub const RATE_WINDOW: Duration = Duration::from_secs(5);

/// The group's cumulative Assign counters at one instant, read off its metrics
/// (`balanceroute_decision_assign_total` and `..._assign_latency_seconds`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    /// Assign calls answered, every code.
    pub assigns: u64,
    /// Of them, those answered with an error.
    pub failed: u64,
    /// The latency histogram's cumulative bucket counts (`le` = the bounds the history was
    /// made with), and its sample count.
    pub latency_buckets: Vec<u64>,
    pub latency_count: u64,
}

/// One rank's KV load in one sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RankLoad {
    pub worker_id: u32,
    pub load_tokens: u64,
}

/// One point of the page's time series.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    /// Rises by one per sample of this group (from 1); `?since=` takes it.
    pub seq: u64,
    /// Wall-clock time of the sample, milliseconds since the Unix epoch.
    pub unix_ms: u64,
    /// The σ version the replica held; `None` before the first complete σ. A decimal string
    /// in JSON, as every 64-bit integer the page reads.
    #[serde(serialize_with = "br_sigma::summary::decimal_opt")]
    pub sigma_version: Option<u64>,
    pub stale: bool,
    /// Every rank σ lists, by worker id (fenced ones at 0).
    pub loads: Vec<RankLoad>,
    /// The imbalance max − min L over ranks that are not fenced.
    pub imbalance_tokens: u64,
    /// The barrier idle I = G·M − ΣL over ranks that are not fenced.
    pub barrier_idle_tokens: u64,
    /// I / (G·M).
    pub barrier_idle_share: f64,
    pub pool: u64,
    /// Assign calls answered per second over the trailing window (every code).
    pub assign_rate: f64,
    /// Of them, answered with an error, per second.
    pub assign_failed_rate: f64,
    /// Latency Assign added (pool wait excluded) over the trailing window, p50 and p99 by
    /// nearest rank over the histogram's buckets: the upper bound of the bucket holding the
    /// sample, in ms (`"+Inf"` above the last bucket); `null` when no call succeeded in the
    /// window.
    #[serde(serialize_with = "ms_or_inf")]
    pub latency_p50_ms: Option<f64>,
    #[serde(serialize_with = "ms_or_inf")]
    pub latency_p99_ms: Option<f64>,
}

fn ms_or_inf<S: Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        None => s.serialize_none(),
        Some(x) if x.is_finite() => s.serialize_f64(*x),
        Some(_) => s.serialize_str("+Inf"),
    }
}

/// The ring of one group (see the module docs).
#[derive(Debug)]
pub struct GroupHistory {
    capacity: usize,
    window: Duration,
    samples: VecDeque<Sample>,
    next_seq: u64,
    /// Cumulative counters of recent samples, oldest first: the window's start is the newest
    /// entry at least [`RATE_WINDOW`] old.
    counters: VecDeque<(Instant, Counters)>,
    latest: Option<LiveNow>,
}

impl GroupHistory {
    /// A ring of at most `capacity` (≥ 1) samples.
    pub fn new(capacity: usize) -> GroupHistory {
        GroupHistory::with_window(capacity, RATE_WINDOW)
    }

    fn with_window(capacity: usize, window: Duration) -> GroupHistory {
        let capacity = capacity.max(1);
        GroupHistory {
            capacity,
            window,
            samples: VecDeque::with_capacity(capacity),
            next_seq: 1,
            counters: VecDeque::new(),
            latest: None,
        }
    }

    /// Records the sample taken at `at` (`unix_ms` on the wall clock); `bounds` are the
    /// latency histogram's bucket bounds (seconds).
    pub fn record(
        &mut self,
        at: Instant,
        unix_ms: u64,
        now: LiveNow,
        counters: Counters,
        bounds: &[f64],
    ) {
        // The window starts at the newest entry that is at least `window` old (or the oldest
        // one while the history is younger than that).
        while self.counters.len() >= 2 && self.counters[1].0 + self.window <= at {
            self.counters.pop_front();
        }
        let (rate, failed_rate, p50, p99) = match self.counters.front() {
            None => (0.0, 0.0, None, None),
            Some((start, old)) => {
                let secs = at.saturating_duration_since(*start).as_secs_f64();
                let per_s = |d: u64| if secs > 0.0 { d as f64 / secs } else { 0.0 };
                let buckets: Vec<u64> = counters
                    .latency_buckets
                    .iter()
                    .zip(old.latency_buckets.iter().chain(std::iter::repeat(&0)))
                    .map(|(n, o)| n.saturating_sub(*o))
                    .collect();
                let n = counters.latency_count.saturating_sub(old.latency_count);
                let q =
                    |q| br_core::stats::bucket_quantile(bounds, &buckets, n, q).map(|s| s * 1e3);
                (
                    per_s(counters.assigns.saturating_sub(old.assigns)),
                    per_s(counters.failed.saturating_sub(old.failed)),
                    q(0.5),
                    q(0.99),
                )
            }
        };
        let summary = now.summary.as_ref();
        let sample = Sample {
            seq: self.next_seq,
            unix_ms,
            sigma_version: summary.map(|s| s.version),
            stale: now.stale,
            loads: summary.map_or_else(Vec::new, |s| {
                s.workers
                    .iter()
                    .map(|w| RankLoad {
                        worker_id: w.worker_id,
                        load_tokens: w.load_tokens,
                    })
                    .collect()
            }),
            imbalance_tokens: summary.map_or(0, |s| s.imbalance_tokens),
            barrier_idle_tokens: summary.map_or(0, |s| s.barrier_idle_tokens),
            barrier_idle_share: summary.map_or(0.0, |s| s.barrier_idle_share),
            pool: now.pool as u64,
            assign_rate: rate,
            assign_failed_rate: failed_rate,
            latency_p50_ms: p50,
            latency_p99_ms: p99,
        };
        self.next_seq += 1;
        if self.samples.len() == self.capacity {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
        self.counters.push_back((at, counters));
        self.latest = Some(now);
    }

    /// The samples after `since` (every one kept when `None`), oldest first.
    pub fn since(&self, since: Option<u64>) -> Vec<Sample> {
        let from = since.map_or(0, |s| s.saturating_add(1));
        // seqs are consecutive: the first wanted one's index follows from the oldest's seq
        let skip = self
            .samples
            .front()
            .map_or(0, |f| from.saturating_sub(f.seq) as usize);
        self.samples.iter().skip(skip).cloned().collect()
    }

    /// What the group's task said at the last sample.
    pub fn latest(&self) -> Option<&LiveNow> {
        self.latest.as_ref()
    }

    /// The seq of the newest sample (0 before the first).
    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    /// The seq of the oldest sample kept.
    pub fn oldest_seq(&self) -> Option<u64> {
        self.samples.front().map(|s| s.seq)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.samples.len()
    }

    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;
    use br_proto::v1;
    use br_sigma::GroupSummary;

    use crate::group::Placing;

    const BOUNDS: [f64; 3] = [0.001, 0.01, 0.1];

    fn now_with(loads: &[(u32, u32)], pool: usize) -> LiveNow {
        let snap = v1::ClusterSnapshot {
            group: "g".into(),
            epoch: 1,
            version: 7,
            workers: loads
                .iter()
                .map(|(id, _)| v1::WorkerState {
                    worker_id: *id,
                    incarnation: 1,
                    capacity: 4,
                    liveness: v1::Liveness::Live as i32,
                    ..Default::default()
                })
                .collect(),
            requests: loads
                .iter()
                .map(|(id, tokens)| v1::RequestState {
                    request_id: format!("r{id}"),
                    worker_id: *id,
                    incarnation: 1,
                    prompt_tokens: *tokens,
                    state: v1::RequestPhase::Active as i32,
                    ..Default::default()
                })
                .collect(),
        };
        LiveNow {
            summary: Some(GroupSummary::of_snapshot(&snap)),
            pool,
            stale: false,
            placing: Placing::Ready,
        }
    }

    fn counters(assigns: u64, failed: u64, buckets: [u64; 3], count: u64) -> Counters {
        Counters {
            assigns,
            failed,
            latency_buckets: buckets.to_vec(),
            latency_count: count,
        }
    }

    #[test]
    fn the_ring_keeps_the_newest_capacity_samples_and_since_reads_after_a_seq() {
        let t0 = Instant::now();
        let mut h = GroupHistory::new(4);
        for i in 0..10u64 {
            h.record(
                t0 + Duration::from_millis(500 * i),
                1_000 + i,
                now_with(&[(0, 10), (1, 30)], i as usize),
                Counters::default(),
                &BOUNDS,
            );
            assert!(h.len() <= 4, "the bound holds after every sample");
        }
        assert_eq!((h.len(), h.capacity()), (4, 4));
        let seqs = |v: Vec<Sample>| v.iter().map(|s| s.seq).collect::<Vec<_>>();
        assert_eq!(seqs(h.since(None)), vec![7, 8, 9, 10]);
        assert_eq!(seqs(h.since(Some(8))), vec![9, 10]);
        assert_eq!(seqs(h.since(Some(10))), Vec::<u64>::new());
        // older than the oldest kept: everything kept (the reader sees the gap by seq)
        assert_eq!(seqs(h.since(Some(2))), vec![7, 8, 9, 10]);
        assert_eq!(seqs(h.since(Some(u64::MAX))), Vec::<u64>::new());
        assert_eq!((h.oldest_seq(), h.last_seq()), (Some(7), 10));
        let last = h.since(Some(9)).pop().unwrap();
        assert_eq!(last.unix_ms, 1_009);
        assert_eq!(last.pool, 9);
        assert_eq!(
            last.loads,
            vec![
                RankLoad {
                    worker_id: 0,
                    load_tokens: 10
                },
                RankLoad {
                    worker_id: 1,
                    load_tokens: 30
                }
            ]
        );
        // G = 2, M = 30, min 10, Σ = 40: imbalance 20, barrier idle 20, idle share 20/60
        assert_eq!((last.imbalance_tokens, last.barrier_idle_tokens), (20, 20));
        assert!((last.barrier_idle_share - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(last.sigma_version, Some(7));
    }

    #[test]
    fn rates_and_percentiles_are_over_the_trailing_window() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut h = GroupHistory::with_window(100, Duration::from_secs(2));
        let rec = |h: &mut GroupHistory, t: u32, c: Counters| {
            h.record(t0 + s * t, 0, now_with(&[(0, 1)], 0), c, &BOUNDS);
            h.since(None).pop().unwrap()
        };
        // the first sample has no window yet
        let first = rec(&mut h, 0, counters(0, 0, [0, 0, 0], 0));
        assert_eq!(
            (first.assign_rate, first.latency_p50_ms),
            (0.0, None),
            "{first:?}"
        );
        // 10 calls in 1 s, 2 failed; 8 latencies: 6 ≤ 1 ms, 1 ≤ 10 ms, 1 above 100 ms
        let x = rec(&mut h, 1, counters(10, 2, [6, 7, 7], 8));
        assert_eq!((x.assign_rate, x.assign_failed_rate), (10.0, 2.0));
        assert_eq!(x.latency_p50_ms, Some(1.0));
        assert_eq!(x.latency_p99_ms, Some(f64::INFINITY));
        let json = serde_json::to_value(&x).unwrap();
        assert_eq!(json["latency_p99_ms"], "+Inf");
        assert_eq!(json["latency_p50_ms"], 1.0);
        // two seconds on the window starts at t = 1: 20 calls over 2 s, latencies from there
        let y = rec(&mut h, 3, counters(30, 2, [6, 27, 27], 28));
        assert_eq!((y.assign_rate, y.assign_failed_rate), (10.0, 0.0));
        assert_eq!(
            (y.latency_p50_ms, y.latency_p99_ms),
            (Some(10.0), Some(10.0))
        );
        // nothing in the window: no percentile, rate 0
        let z = rec(&mut h, 6, counters(30, 2, [6, 27, 27], 28));
        assert_eq!((z.assign_rate, z.latency_p50_ms), (0.0, None));
        assert!(serde_json::to_value(&z).unwrap()["latency_p50_ms"].is_null());
    }

    #[test]
    fn a_group_without_sigma_has_no_loads() {
        let mut h = GroupHistory::new(2);
        h.record(
            Instant::now(),
            5,
            LiveNow {
                summary: None,
                pool: 3,
                stale: false,
                placing: Placing::NoSigma,
            },
            Counters::default(),
            &BOUNDS,
        );
        let s = h.since(None).pop().unwrap();
        assert_eq!((s.sigma_version, s.loads.len(), s.pool), (None, 0, 3));
        assert_eq!(h.latest().unwrap().placing, Placing::NoSigma);
    }
}
