//! One group's history for the live page: a ring of samples taken every
//! `--live-sample-interval`, holding at most `--live-history / --live-sample-interval`
//! of them (oldest dropped first), and the trailing window the Assign rate and latency are
//! measured over. Pure: time comes in as arguments, so the bound and the window are tested
//! without a clock.
//!
//! Each sample also carries what changed since the previous one: the decode rate of every
//! rank (from σ's count of generated tokens, [`br_sigma::Sigma::generated_tokens`]) with the
//! TPOT it implies, and the ranks whose state changed (cordoned or uncordoned, LIVE, SUSPECT,
//! FENCED, new in σ), which the page marks on its charts. States are compared sample to sample: a
//! change undone within one interval is not marked.
//!
//! Memory: a [`Sample`] is at most 260 bytes with its state changes (at most
//! [`MAX_SAMPLE_EVENTS`] listed, 8 bytes each) plus 24 per rank ([`RankLoad`]), so a group
//! holds at most `capacity × (260 + 24·ranks)` bytes: with the defaults (600 samples) about
//! 270 KB for G = 8, 1.1 MB for G = 64, and 15 MB for the contract's largest group (1,024
//! ranks). The full worker table is kept for the latest sample only (it is also what the
//! next sample's rates and state changes are measured from); the window's counters are a
//! few entries of 16 bucket counts.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::{Serialize, Serializer};

use br_sigma::GroupSummary;

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

/// The most rank state changes one sample lists; more are only counted
/// ([`Sample::events_omitted`]): a whole group fenced at once reads as one marker either way,
/// and a sample's size stays bounded whatever the group's size.
pub const MAX_SAMPLE_EVENTS: usize = 8;

/// One rank in one sample: its KV load, and its decode rate since the previous sample.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(into = "RankJson")]
pub struct RankLoad {
    pub worker_id: u32,
    /// Requests σ holds running on it (ACTIVE) at the sample.
    pub running: u32,
    pub load_tokens: u64,
    /// Tokens/s it generated since the previous sample, as σ learnt of them; `None` in the
    /// rank's first sample, or when σ's count went back (the replica was replaced by a fresh
    /// snapshot and counts again from 0). An `f32`: a rate to a few digits, and the rank's
    /// entry stays 24 bytes.
    pub decode_tokens_per_s: Option<f32>,
}

impl RankLoad {
    /// The time per output token this rank's rate implies, in ms. In lockstep decode every
    /// running request gets one token per step, so tokens/s = running × steps/s and the step
    /// time, which is each request's time per output token, is running ÷ tokens/s. An
    /// estimate (requests still in prefill count as running; the engine's own TPOT is in the
    /// engine's metrics); `None` without a running request or without a token in the interval.
    pub fn tpot_ms(&self) -> Option<f64> {
        let rate = f64::from(self.decode_tokens_per_s?);
        (self.running > 0 && rate > 0.0).then(|| 1e3 * f64::from(self.running) / rate)
    }
}

/// [`RankLoad`] as the JSON API answers it: with its TPOT, computed when answered rather than
/// stored in every sample.
#[derive(Serialize)]
struct RankJson {
    worker_id: u32,
    load_tokens: u64,
    running: u32,
    decode_tokens_per_s: Option<f32>,
    tpot_ms: Option<f64>,
}

impl From<RankLoad> for RankJson {
    fn from(r: RankLoad) -> RankJson {
        RankJson {
            worker_id: r.worker_id,
            load_tokens: r.load_tokens,
            running: r.running,
            decode_tokens_per_s: r.decode_tokens_per_s,
            tpot_ms: r.tpot_ms(),
        }
    }
}

/// What changed about a rank since the previous sample (its new state).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RankEventKind {
    /// LIVE again.
    Live,
    Suspect,
    Fenced,
    Cordoned,
    Uncordoned,
    /// New in σ (a rank's first Hello, or one a new σ lists that the previous did not).
    Joined,
}

/// One rank's state change, marked on the page's charts at its sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RankEvent {
    pub worker_id: u32,
    pub kind: RankEventKind,
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
    /// The group's decode tokens/s since the previous sample: the sum over the ranks that have
    /// a rate; `null` when none has.
    pub decode_tokens_per_s: Option<f64>,
    /// The ranks whose state changed since the previous sample, by worker id (none in the
    /// first sample with σ): at most [`MAX_SAMPLE_EVENTS`].
    pub events: Vec<RankEvent>,
    /// State changes since the previous sample beyond those listed.
    pub events_omitted: u32,
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
    /// The last sample's state and when it was taken: the next sample's rates and state
    /// changes are measured from it.
    latest: Option<(Instant, LiveNow)>,
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
        let loads = summary.map_or_else(Vec::new, |s| {
            s.workers
                .iter()
                .enumerate()
                .map(|(i, w)| RankLoad {
                    worker_id: w.worker_id,
                    running: w.running,
                    load_tokens: w.load_tokens,
                    decode_tokens_per_s: self.decode_rate(at, w.worker_id, now.generated(i)),
                })
                .collect()
        });
        let rates = loads.iter().filter_map(|l| l.decode_tokens_per_s);
        let decode = rates.clone().next().map(|_| rates.map(f64::from).sum());
        let before = self.latest.as_ref().and_then(|(_, n)| n.summary.as_ref());
        let (events, events_omitted) = match (before, summary) {
            (Some(before), Some(after)) => state_changes(before, after),
            _ => (Vec::new(), 0),
        };
        let sample = Sample {
            seq: self.next_seq,
            unix_ms,
            sigma_version: summary.map(|s| s.version),
            stale: now.stale,
            loads,
            imbalance_tokens: summary.map_or(0, |s| s.imbalance_tokens),
            barrier_idle_tokens: summary.map_or(0, |s| s.barrier_idle_tokens),
            barrier_idle_share: summary.map_or(0.0, |s| s.barrier_idle_share),
            pool: now.pool as u64,
            assign_rate: rate,
            assign_failed_rate: failed_rate,
            latency_p50_ms: p50,
            latency_p99_ms: p99,
            decode_tokens_per_s: decode,
            events,
            events_omitted,
        };
        self.next_seq += 1;
        if self.samples.len() == self.capacity {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
        self.counters.push_back((at, counters));
        self.latest = Some((at, now));
    }

    /// `worker`'s decode rate from the last sample to `at`, given σ's count of its generated
    /// tokens now.
    fn decode_rate(&self, at: Instant, worker: u32, generated: Option<u64>) -> Option<f32> {
        let (then, last) = self.latest.as_ref()?;
        let secs = at.saturating_duration_since(*then).as_secs_f64();
        let i = last
            .summary
            .as_ref()?
            .workers
            .binary_search_by_key(&worker, |w| w.worker_id)
            .ok()?;
        let tokens = generated?.checked_sub(last.generated(i)?)?;
        (secs > 0.0).then(|| (tokens as f64 / secs) as f32)
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
        self.latest.as_ref().map(|(_, n)| n)
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

/// The ranks of `after` whose state differs from `before` (both sorted by worker id, as σ's
/// summary is): the first [`MAX_SAMPLE_EVENTS`] changes, and how many more there were.
fn state_changes(before: &GroupSummary, after: &GroupSummary) -> (Vec<RankEvent>, u32) {
    let mut events = Vec::new();
    let mut omitted = 0;
    for w in &after.workers {
        let was = before
            .workers
            .binary_search_by_key(&w.worker_id, |b| b.worker_id)
            .ok()
            .map(|i| &before.workers[i]);
        let liveness = match (was, w.liveness) {
            (None, _) => Some(RankEventKind::Joined),
            (Some(b), now) if b.liveness == now => None,
            (Some(_), "suspect") => Some(RankEventKind::Suspect),
            (Some(_), "fenced") => Some(RankEventKind::Fenced),
            (Some(_), _) => Some(RankEventKind::Live),
        };
        let cordon =
            (was.map_or(w.cordoned, |b| b.cordoned != w.cordoned)).then_some(if w.cordoned {
                RankEventKind::Cordoned
            } else {
                RankEventKind::Uncordoned
            });
        for kind in [liveness, cordon].into_iter().flatten() {
            if events.len() < MAX_SAMPLE_EVENTS {
                events.push(RankEvent {
                    worker_id: w.worker_id,
                    kind,
                });
            } else {
                omitted += 1;
            }
        }
    }
    (events, omitted)
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
            generated_tokens: Vec::new(),
            pool,
            stale: false,
            placing: Placing::Ready,
        }
    }

    /// Ranks 0..n (one running request each, 10 tokens of load) with σ's counts of their
    /// generated tokens, then `edit` on the summary.
    fn ranks(generated: &[u64], edit: impl FnOnce(&mut GroupSummary)) -> LiveNow {
        let ids: Vec<(u32, u32)> = (0..generated.len() as u32).map(|id| (id, 10)).collect();
        let mut n = now_with(&ids, 0);
        n.generated_tokens = generated.to_vec();
        edit(n.summary.as_mut().unwrap());
        n
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
                    running: 1,
                    load_tokens: 10,
                    decode_tokens_per_s: None,
                },
                RankLoad {
                    worker_id: 1,
                    running: 1,
                    load_tokens: 30,
                    decode_tokens_per_s: None,
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
                generated_tokens: Vec::new(),
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

    #[test]
    fn decode_rates_and_tpot_come_from_sigmas_count_between_two_samples() {
        let t0 = Instant::now();
        let ms = Duration::from_millis(1);
        let mut h = GroupHistory::new(10);
        let mut rec = |t: u32, now: LiveNow| {
            h.record(t0 + ms * t, 0, now, Counters::default(), &BOUNDS);
            h.since(None).pop().unwrap()
        };
        let rate = |s: &Sample, i: usize| s.loads[i].decode_tokens_per_s;
        let tpot = |s: &Sample, i: usize| s.loads[i].tpot_ms();
        // the first sample has nothing to measure from
        let first = rec(0, ranks(&[100, 0], |_| {}));
        assert_eq!((rate(&first, 0), first.decode_tokens_per_s), (None, None));
        // 500 ms later rank 0 generated 200 tokens with 4 requests running: 400 tokens/s,
        // and 4 requests ÷ 400 tokens/s = 10 ms per output token; rank 1 generated nothing,
        // so nothing tells its TPOT
        let s = rec(500, ranks(&[300, 0], |g| g.workers[0].running = 4));
        assert_eq!((rate(&s, 0), rate(&s, 1)), (Some(400.0), Some(0.0)));
        assert_eq!((tpot(&s, 0), tpot(&s, 1)), (Some(10.0), None));
        assert_eq!(s.decode_tokens_per_s, Some(400.0));
        // a rank that generated tokens but runs no request now has a rate and no TPOT
        let s = rec(
            1_000,
            ranks(&[500, 50], |g| {
                g.workers[0].running = 4;
                g.workers[1].running = 0;
            }),
        );
        assert_eq!((rate(&s, 1), tpot(&s, 1)), (Some(100.0), None));
        assert_eq!(s.decode_tokens_per_s, Some(500.0));
        let json = serde_json::to_value(&s).unwrap();
        let rank0 = &json["loads"][0];
        assert_eq!(rank0["worker_id"], 0);
        assert_eq!(rank0["load_tokens"], 10);
        assert_eq!(rank0["running"], 4);
        assert_eq!(rank0["decode_tokens_per_s"], 400.0);
        assert_eq!(rank0["tpot_ms"], 10.0);
        assert!(json["loads"][1]["tpot_ms"].is_null(), "{json}");
        assert_eq!(json["decode_tokens_per_s"], 500.0);
        // σ's count went back (a fresh replica counts from 0): no rate for that rank, and a
        // rank new to σ has none either; the group's rate is the others'
        let s = rec(1_500, ranks(&[10, 60, 5], |_| {}));
        assert_eq!(
            (rate(&s, 0), rate(&s, 1), rate(&s, 2)),
            (None, Some(20.0), None)
        );
        assert_eq!(s.decode_tokens_per_s, Some(20.0));
        // without σ, and in the first sample after it, no rate at all
        let s = rec(
            2_000,
            LiveNow {
                summary: None,
                generated_tokens: Vec::new(),
                pool: 0,
                stale: true,
                placing: Placing::NoSigma,
            },
        );
        assert_eq!(s.decode_tokens_per_s, None);
        let s = rec(2_500, ranks(&[20, 70, 5], |_| {}));
        assert_eq!((rate(&s, 0), s.decode_tokens_per_s), (None, None));
        assert!(serde_json::to_value(&s).unwrap()["decode_tokens_per_s"].is_null());
    }

    #[test]
    fn rank_state_changes_are_events_of_their_sample_and_bounded() {
        let t0 = Instant::now();
        let ms = Duration::from_millis(1);
        let mut h = GroupHistory::new(10);
        let mut t = 0;
        let mut rec = |now: LiveNow| {
            t += 500;
            h.record(t0 + ms * t, 0, now, Counters::default(), &BOUNDS);
            h.since(None).pop().unwrap()
        };
        let ev = |worker_id, kind| RankEvent { worker_id, kind };
        let twenty = [0; 20];
        assert!(
            rec(ranks(&twenty, |_| {})).events.is_empty(),
            "the first sample"
        );
        assert!(
            rec(ranks(&twenty, |_| {})).events.is_empty(),
            "nothing changed"
        );
        let s = rec(ranks(&twenty, |g| g.workers[3].cordoned = true));
        assert_eq!(s.events, vec![ev(3, RankEventKind::Cordoned)]);
        assert_eq!(
            serde_json::to_value(&s).unwrap()["events"],
            serde_json::json!([{ "worker_id": 3, "kind": "cordoned" }])
        );
        let s = rec(ranks(&twenty, |g| {
            g.workers[3].cordoned = true;
            g.workers[3].liveness = "suspect";
            g.workers[5].liveness = "fenced";
        }));
        assert_eq!(
            s.events,
            vec![ev(3, RankEventKind::Suspect), ev(5, RankEventKind::Fenced)]
        );
        // back to LIVE and uncordoned in one interval, and a rank new to σ
        let s = rec(ranks(&[0; 21], |g| g.workers[5].liveness = "fenced"));
        assert_eq!(
            s.events,
            vec![
                ev(3, RankEventKind::Live),
                ev(3, RankEventKind::Uncordoned),
                ev(20, RankEventKind::Joined)
            ]
        );
        // the whole group fenced at once: the first few listed, the rest counted
        let s = rec(ranks(&[0; 21], |g| {
            for w in &mut g.workers {
                w.liveness = "fenced";
            }
        }));
        assert_eq!(s.events.len(), MAX_SAMPLE_EVENTS);
        assert_eq!(s.events[0], ev(0, RankEventKind::Fenced));
        assert_eq!(s.events_omitted, 20 - MAX_SAMPLE_EVENTS as u32);
        // no σ, then σ again: nothing to compare with, no event
        let no_sigma = LiveNow {
            summary: None,
            generated_tokens: Vec::new(),
            pool: 0,
            stale: false,
            placing: Placing::NoSigma,
        };
        assert!(rec(no_sigma).events.is_empty());
        let s = rec(ranks(&twenty, |_| {}));
        assert_eq!((s.events.len(), s.events_omitted), (0, 0));
    }

    /// The module docs' arithmetic: a sample and its listed state changes within 260 bytes, a
    /// rank 24 bytes.
    #[test]
    fn a_sample_takes_the_bytes_the_module_docs_say() {
        use std::mem::size_of;
        const SAMPLE_BYTES: usize = 260;
        assert_eq!(size_of::<RankLoad>(), 24);
        let events = MAX_SAMPLE_EVENTS * size_of::<RankEvent>();
        assert!(
            size_of::<Sample>() + events <= SAMPLE_BYTES,
            "{} + {events}",
            size_of::<Sample>()
        );
    }
}
