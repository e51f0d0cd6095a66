//! The decision service's Prometheus metrics (`# decision` in deploy/metrics-contract.txt), on a
//! per-service registry so tests can run several services in one process.

use prometheus::{
    Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry,
};

/// Buckets for latencies this service adds (tens of µs to tens of ms).
const LATENCY_BUCKETS: &[f64] = &[
    25e-6, 50e-6, 100e-6, 200e-6, 300e-6, 500e-6, 750e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    0.1, 0.25,
];
/// Buckets for the intended pool wait (up to tens of seconds).
const WAIT_BUCKETS: &[f64] = &[
    100e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
];
/// Buckets for one dispatcher tick.
const TICK_BUCKETS: &[f64] = &[
    1e-6, 5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3,
];

/// The HTTP/JSON port's Assign route, also its metrics label. The routes live here, where
/// their series are made, so that the metrics need nothing of the HTTP edge that serves them.
pub const ROUTE_ASSIGN: &str = "/v1/assign";
/// The HTTP/JSON port's Cancel route (also its metrics label).
pub const ROUTE_CANCEL: &str = "/v1/cancel";
/// The metrics label of every other path on that port (bounded cardinality).
pub const ROUTE_OTHER: &str = "other";

/// Every metric of the service. Cheap to clone (the collectors are shared handles).
#[derive(Clone, Debug)]
pub struct Metrics {
    /// This service's own registry (not the global one), served on the admin port's
    /// `/metrics`, so several services can run in one process (tests, br-all).
    pub registry: Registry,
    /// Assign calls by group and final gRPC code (`ok`, `deadline_exceeded`, ...).
    pub assign_total: IntCounterVec,
    /// Latency the service adds, excluding the intended pool wait.
    pub assign_latency: HistogramVec,
    /// Time from arrival to admission, per admitted request.
    pub pool_wait: HistogramVec,
    /// Requests waiting in the pool now, by group: a pool that only grows means the group is
    /// saturated (or σ shows no free slot).
    pub pool_size: IntGaugeVec,
    /// Duration of one dispatcher tick (view rebuild and dispatch), by group: the policy's
    /// cost, which every pooled request waits for.
    pub tick_duration: HistogramVec,
    /// Dispatcher ticks run, by group (arrivals, σ changes and the `--tick-interval` timer).
    pub ticks_total: IntCounterVec,
    /// Version of the group's σ replica: it stops moving when the Watch feed does.
    pub sigma_version: IntGaugeVec,
    /// 1 while the service can place a request (see `app::GroupsReadiness`).
    pub ready: IntGauge,
    /// 1 while the group's Watch stream is down and decisions use the last σ plus this
    /// service's own reservations (answers say `stale`).
    pub sigma_stale: IntGaugeVec,
    /// Seconds since σ was last confirmed current by the snapshot service (0 while
    /// connected): how old the state behind stale answers is.
    pub sigma_staleness: GaugeVec,
    /// Resubscriptions of the Watch follower, by reason (reset reasons, `gap`, `error`).
    pub watch_resets_total: IntCounterVec,
    /// Reservations that did not get into σ, by reason (reject reasons, `unavailable`).
    pub reserve_failures_total: IntCounterVec,
    /// Cancel calls by outcome (`withdrawn`, `released`, `not_found`, `error`).
    pub cancel_total: IntCounterVec,
    /// Cancels refused PERMISSION_DENIED under mutual TLS (the caller's identity did not
    /// assign the request): a misconfigured or hostile gateway shows up here.
    pub cancel_denied_total: IntCounterVec,
    /// Request-body bytes all ext_proc streams hold now (bounded by
    /// `--ext-proc-max-buffered-bytes`): how close the budget is to refusing.
    pub ext_proc_buffered_bytes: IntGauge,
    /// ext_proc requests refused 503 because their body did not fit the buffer budget.
    pub ext_proc_budget_refusals_total: IntCounter,
    /// Assign answers decided without a current σ (the response says `stale`).
    pub stale_answers_total: IntCounterVec,
    /// Requests the outage estimate let finish (freeing their slots) while σ was stale.
    pub estimated_finishes_total: IntCounterVec,
    /// Rank split: reservations on this replica's own ranks refused as full.
    pub rank_split_conflicts_total: IntCounterVec,
    /// Stale reservations after an outage, by outcome (`sent`: reserved again; `dropped`:
    /// the worker's reports no longer list them, so they are not brought back).
    pub recommits_total: IntCounterVec,
    /// Workers kept in the view from before a snapshot-service restart (not back in σ yet).
    pub workers_awaited: IntGaugeVec,
    /// 1 per served group, labelled with the routing policy (`--policy`): what `brctl status`
    /// and dashboards show beside the pool.
    pub policy_info: IntGaugeVec,
    /// ext_proc streams (one per HTTP request) by how they ended: `answered`, `released`,
    /// `refused`, `abandoned`, `body_timeout` (see `ext_proc`).
    pub ext_proc_streams_total: IntCounterVec,
    /// ext_proc requests answered with an `ImmediateResponse`, by HTTP status.
    pub ext_proc_immediate_responses_total: IntCounterVec,
    /// ext_proc requests by where their prompt tokens came from (`header`, `estimate`).
    pub ext_proc_prompt_tokens_source_total: IntCounterVec,
    /// ext_proc streams ended because their request body did not arrive within
    /// `--ext-proc-body-timeout`.
    pub ext_proc_body_timeouts_total: IntCounter,
    /// ext_proc requests refused 409 because a live stream already holds their request id.
    pub ext_proc_request_id_conflicts_total: IntCounter,
    /// HTTP/JSON requests (`--http-listen`) by route and HTTP status; 499 when the client
    /// closed its connection before the answer.
    pub http_requests_total: IntCounterVec,
    /// HTTP/JSON request duration by route (from the request's head to its answer).
    pub http_request_duration: HistogramVec,
    /// What BR-H's online predictor holds, by `kind`: `samples` (finished requests learned
    /// from), `hashes` (prompt hashes remembered, at most `--predictor-max-hashes`),
    /// `buckets` (prompt-length octaves with a distribution of their own), `hinted` (finished
    /// requests with the client's expected output tokens, brh-hinted), `classes` (request
    /// classes with a model of their own, brh-class). 0 without one.
    pub predictor_entries: IntGaugeVec,
    /// Approximate heap bytes BR-H's online predictor holds (its memory bound, measured).
    pub predictor_bytes: IntGaugeVec,
    /// BR-H's per-request predictions at dispatcher ticks, by `answer`: `reused` (nothing it
    /// is a function of changed), `spared` (what it read gained samples that cannot change
    /// it), `made` (asked of the predictor). `made` is the tick's prediction cost.
    pub predictions_total: IntCounterVec,
}

/// The `kind` labels of `balanceroute_decision_predictor_entries`.
pub const PREDICTOR_KINDS: [&str; 5] = ["samples", "hashes", "buckets", "hinted", "classes"];

/// The `answer` labels of `balanceroute_decision_predictions_total`.
pub const PREDICTION_ANSWERS: [&str; 3] = ["reused", "spared", "made"];

fn reg<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
    // Names are constants and unique; a failure is a programming error caught by the tests.
    if let Err(e) = r.register(Box::new(c.clone())) {
        tracing::error!(error = %e, "registering a metric");
    }
    c
}

impl Metrics {
    pub fn new() -> Result<Metrics, prometheus::Error> {
        let r = Registry::new();
        let h = |name: &str, help: &str, buckets: &[f64]| {
            HistogramVec::new(
                HistogramOpts::new(name, help).buckets(buckets.to_vec()),
                &["group"],
            )
        };
        let m = Metrics {
            predictor_entries: reg(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "balanceroute_decision_predictor_entries",
                        "What BR-H's online predictor has learned, by kind (samples, hashes, buckets, hinted, classes)",
                    ),
                    &["group", "kind"],
                )?,
            ),
            predictor_bytes: reg(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "balanceroute_decision_predictor_bytes",
                        "Approximate heap bytes BR-H's online predictor holds",
                    ),
                    &["group"],
                )?,
            ),
            predictions_total: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "balanceroute_decision_predictions_total",
                        "BR-H's per-request predictions at dispatcher ticks, by answer (reused, spared by a sample, made)",
                    ),
                    &["group", "answer"],
                )?,
            ),
            assign_total: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "balanceroute_decision_assign_total",
                        "Assign calls answered, by group and gRPC code",
                    ),
                    &["group", "code"],
                )?,
            ),
            assign_latency: reg(
                &r,
                h(
                    "balanceroute_decision_assign_latency_seconds",
                    "Latency Assign adds, excluding the intended pool wait (admission or arrival to response, plus handler overhead)",
                    LATENCY_BUCKETS,
                )?,
            ),
            pool_wait: reg(
                &r,
                h(
                    "balanceroute_decision_pool_wait_seconds",
                    "Time a request waited in the pool before admission",
                    WAIT_BUCKETS,
                )?,
            ),
            pool_size: reg(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "balanceroute_decision_pool_size",
                        "Requests waiting in the pool",
                    ),
                    &["group"],
                )?,
            ),
            tick_duration: reg(
                &r,
                h(
                    "balanceroute_decision_tick_duration_seconds",
                    "Duration of one dispatcher tick (view rebuild and dispatch)",
                    TICK_BUCKETS,
                )?,
            ),
            ticks_total: reg(
                &r,
                IntCounterVec::new(
                    Opts::new("balanceroute_decision_ticks_total", "Dispatcher ticks run"),
                    &["group"],
                )?,
            ),
            sigma_version: reg(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "balanceroute_decision_sigma_version",
                        "Version of the local σ replica",
                    ),
                    &["group"],
                )?,
            ),
            ready: reg(
                &r,
                IntGauge::new(
                    "balanceroute_decision_ready",
                    "1 while the service can place a request (every served group has a complete σ, one has a live worker)",
                )?,
            ),
            sigma_stale: reg(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "balanceroute_decision_sigma_stale",
                        "1 while the Watch stream is down and decisions use the last σ plus own reservations",
                    ),
                    &["group"],
                )?,
            ),
            sigma_staleness: reg(
                &r,
                GaugeVec::new(
                    Opts::new(
                        "balanceroute_decision_sigma_staleness_seconds",
                        "Seconds since σ was last confirmed current by the snapshot service (0 while connected)",
                    ),
                    &["group"],
                )?,
            ),
            watch_resets_total: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "balanceroute_decision_watch_resets_total",
                        "Times the σ replica was replaced or resubscribed, by reason",
                    ),
                    &["group", "reason"],
                )?,
            ),
            reserve_failures_total: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "balanceroute_decision_reserve_failures_total",
                        "Reservations not accepted into σ, by reason",
                    ),
                    &["group", "reason"],
                )?,
            ),
            cancel_total: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "balanceroute_decision_cancel_total",
                        "Cancel calls, by outcome",
                    ),
                    &["group", "outcome"],
                )?,
            ),
            cancel_denied_total: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "balanceroute_decision_cancel_denied_total",
                        "Cancels refused PERMISSION_DENIED under mutual TLS: the caller's identity did not assign the request",
                    ),
                    &["group"],
                )?,
            ),
            stale_answers_total: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "balanceroute_decision_stale_answers_total",
                        "Assign answers decided without a current σ (from the last σ, own reservations and the estimated progress; the response says stale)",
                    ),
                    &["group"],
                )?,
            ),
            estimated_finishes_total: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "balanceroute_decision_estimated_finishes_total",
                        "Requests the outage estimate let finish (step model and output-length predictor) while σ was stale",
                    ),
                    &["group"],
                )?,
            ),
            rank_split_conflicts_total: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "balanceroute_decision_rank_split_conflicts_total",
                        "With --deciders K > 1: reservations on a rank this replica owns refused because another replica filled it first; a steady rise means two replicas claim one --decider-index or disagree on --deciders",
                    ),
                    &["group"],
                )?,
            ),
            recommits_total: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "balanceroute_decision_recommits_total",
                        "Stale reservations after an outage, by outcome (sent: reserved again; dropped: the worker's reports no longer list them)",
                    ),
                    &["group", "outcome"],
                )?,
            ),
            workers_awaited: reg(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "balanceroute_decision_workers_awaited",
                        "Workers kept in the view from before a snapshot-service restart, not back in the new σ yet",
                    ),
                    &["group"],
                )?,
            ),
            policy_info: reg(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "balanceroute_decision_policy_info",
                        "1 per served group, labelled with the routing policy (--policy)",
                    ),
                    &["group", "policy"],
                )?,
            ),
            ext_proc_streams_total: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "balanceroute_decision_ext_proc_streams_total",
                        "Envoy ext_proc streams (one per HTTP request) by how they ended: answered (routed, the rank answered), released (routed, ended before a response: reservation released), refused (ImmediateResponse), abandoned (ended before a routing answer), body_timeout (no request body within --ext-proc-body-timeout)",
                    ),
                    &["outcome"],
                )?,
            ),
            ext_proc_buffered_bytes: reg(
                &r,
                IntGauge::new(
                    "balanceroute_decision_ext_proc_buffered_bytes",
                    "Request-body bytes the ext_proc streams hold now, together (bounded by --ext-proc-max-buffered-bytes)",
                )?,
            ),
            ext_proc_budget_refusals_total: reg(
                &r,
                IntCounter::new(
                    "balanceroute_decision_ext_proc_budget_refusals_total",
                    "ext_proc requests refused 503 because their body did not fit --ext-proc-max-buffered-bytes",
                )?,
            ),
            ext_proc_immediate_responses_total: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "balanceroute_decision_ext_proc_immediate_responses_total",
                        "Envoy ext_proc requests refused with an ImmediateResponse, by HTTP status",
                    ),
                    &["status"],
                )?,
            ),
            ext_proc_prompt_tokens_source_total: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "balanceroute_decision_ext_proc_prompt_tokens_source_total",
                        "Envoy ext_proc requests by where their prompt tokens came from: header (x-balanceroute-prompt-tokens) or estimate (from the body)",
                    ),
                    &["source"],
                )?,
            ),
            ext_proc_body_timeouts_total: reg(
                &r,
                IntCounter::new(
                    "balanceroute_decision_ext_proc_body_timeouts_total",
                    "Envoy ext_proc streams ended (408) because their request body did not arrive within --ext-proc-body-timeout",
                )?,
            ),
            ext_proc_request_id_conflicts_total: reg(
                &r,
                IntCounter::new(
                    "balanceroute_decision_ext_proc_request_id_conflicts_total",
                    "Envoy ext_proc requests refused 409 because another live stream holds their x-request-id in their group",
                )?,
            ),
            http_requests_total: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "balanceroute_decision_http_requests_total",
                        "HTTP/JSON requests (--http-listen), by route (/v1/assign, /v1/cancel, other) and HTTP status (499: the client closed its connection before the answer)",
                    ),
                    &["route", "status"],
                )?,
            ),
            http_request_duration: reg(
                &r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "balanceroute_decision_http_request_duration_seconds",
                        "HTTP/JSON request duration (--http-listen) by route, the pool wait included",
                    )
                    .buckets(WAIT_BUCKETS.to_vec()),
                    &["route"],
                )?,
            ),
            registry: r,
        };
        // exported at 0 from the start, so rate() and alerts see the first one
        for outcome in [
            "answered",
            "released",
            "refused",
            "abandoned",
            "body_timeout",
        ] {
            m.ext_proc_streams_total.with_label_values(&[outcome]);
        }
        for source in ["header", "estimate"] {
            m.ext_proc_prompt_tokens_source_total
                .with_label_values(&[source]);
        }
        for status in ["400", "408", "409", "429", "503"] {
            m.ext_proc_immediate_responses_total
                .with_label_values(&[status]);
        }
        // Exported from the start (at 0), so rate() and the contract test see them even
        // before (or without) an HTTP/JSON request.
        for route in [ROUTE_ASSIGN, ROUTE_CANCEL] {
            m.http_requests_total.with_label_values(&[route, "200"]);
            let _ = m.http_request_duration.with_label_values(&[route]);
        }
        Ok(m)
    }

    /// Creates every labelled series of `group` so /metrics lists them before traffic.
    pub fn init_group(&self, group: &str) {
        self.pool_size.with_label_values(&[group]).set(0);
        self.sigma_version.with_label_values(&[group]).set(0);
        self.sigma_stale.with_label_values(&[group]).set(0);
        self.sigma_staleness.with_label_values(&[group]).set(0.0);
        self.ticks_total.with_label_values(&[group]);
        let _ = self.tick_duration.with_label_values(&[group]);
        let _ = self.assign_latency.with_label_values(&[group]);
        let _ = self.pool_wait.with_label_values(&[group]);
        self.assign_total.with_label_values(&[group, "ok"]);
        self.watch_resets_total
            .with_label_values(&[group, "unknown_epoch"]);
        self.reserve_failures_total
            .with_label_values(&[group, "unavailable"]);
        self.cancel_total.with_label_values(&[group, "withdrawn"]);
        self.cancel_denied_total.with_label_values(&[group]);
        self.stale_answers_total.with_label_values(&[group]);
        self.estimated_finishes_total.with_label_values(&[group]);
        self.rank_split_conflicts_total.with_label_values(&[group]);
        self.recommits_total.with_label_values(&[group, "sent"]);
        self.recommits_total.with_label_values(&[group, "dropped"]);
        self.workers_awaited.with_label_values(&[group]).set(0);
        for kind in PREDICTOR_KINDS {
            self.predictor_entries.with_label_values(&[group, kind]);
        }
        self.predictor_bytes.with_label_values(&[group]);
        for answer in PREDICTION_ANSWERS {
            self.predictions_total.with_label_values(&[group, answer]);
        }
    }

    /// A gauge handle per group, for the group task's hot path.
    pub fn group(&self, group: &str) -> GroupMetrics {
        GroupMetrics {
            pool_size: self.pool_size.with_label_values(&[group]),
            tick_duration: self.tick_duration.with_label_values(&[group]),
            ticks_total: self.ticks_total.with_label_values(&[group]),
            pool_wait: self.pool_wait.with_label_values(&[group]),
            sigma_version: self.sigma_version.with_label_values(&[group]),
            sigma_stale: self.sigma_stale.with_label_values(&[group]),
            sigma_staleness: self.sigma_staleness.with_label_values(&[group]),
            stale_answers: self.stale_answers_total.with_label_values(&[group]),
            estimated_finishes: self.estimated_finishes_total.with_label_values(&[group]),
            rank_split_conflicts: self.rank_split_conflicts_total.with_label_values(&[group]),
            workers_awaited: self.workers_awaited.with_label_values(&[group]),
            recommits_sent: self.recommits_total.with_label_values(&[group, "sent"]),
            recommits_dropped: self.recommits_total.with_label_values(&[group, "dropped"]),
            predictor_entries: PREDICTOR_KINDS
                .map(|k| self.predictor_entries.with_label_values(&[group, k])),
            predictor_bytes: self.predictor_bytes.with_label_values(&[group]),
            predictions: PREDICTION_ANSWERS
                .map(|a| self.predictions_total.with_label_values(&[group, a])),
            group: group.to_owned(),
            all: self.clone(),
        }
    }
}

/// The series of one group, resolved once.
#[derive(Clone, Debug)]
pub struct GroupMetrics {
    /// [`Metrics::pool_size`] of this group.
    pub pool_size: IntGauge,
    /// [`Metrics::tick_duration`] of this group.
    pub tick_duration: prometheus::Histogram,
    /// [`Metrics::ticks_total`] of this group.
    pub ticks_total: prometheus::IntCounter,
    /// [`Metrics::pool_wait`] of this group.
    pub pool_wait: prometheus::Histogram,
    /// [`Metrics::sigma_version`] of this group.
    pub sigma_version: IntGauge,
    /// [`Metrics::sigma_stale`] of this group.
    pub sigma_stale: IntGauge,
    /// [`Metrics::sigma_staleness`] of this group.
    pub sigma_staleness: Gauge,
    /// [`Metrics::stale_answers_total`] of this group.
    pub stale_answers: prometheus::IntCounter,
    /// [`Metrics::estimated_finishes_total`] of this group.
    pub estimated_finishes: prometheus::IntCounter,
    /// [`Metrics::rank_split_conflicts_total`] of this group.
    pub rank_split_conflicts: prometheus::IntCounter,
    /// [`Metrics::workers_awaited`] of this group.
    pub workers_awaited: IntGauge,
    /// [`Metrics::recommits_total`] `{outcome="sent"}` of this group.
    pub recommits_sent: prometheus::IntCounter,
    /// [`Metrics::recommits_total`] `{outcome="dropped"}` of this group.
    pub recommits_dropped: prometheus::IntCounter,
    /// `predictor_entries` by [`PREDICTOR_KINDS`].
    pub predictor_entries: [IntGauge; 5],
    /// [`Metrics::predictor_bytes`] of this group.
    pub predictor_bytes: IntGauge,
    /// `predictions_total` by [`PREDICTION_ANSWERS`].
    pub predictions: [prometheus::IntCounter; 3],
    /// The `group` label of the vectors this holds children of.
    group: String,
    /// The whole set, for the series labelled by more than the group (resets, failures).
    all: Metrics,
}

impl GroupMetrics {
    pub fn watch_reset(&self, reason: &str) {
        self.all
            .watch_resets_total
            .with_label_values(&[&self.group, reason])
            .inc();
    }

    pub fn watch_reset_by(&self, reason: &str, n: u64) {
        self.all
            .watch_resets_total
            .with_label_values(&[&self.group, reason])
            .inc_by(n);
    }

    pub fn reserve_failed(&self, reason: &str, n: u64) {
        self.all
            .reserve_failures_total
            .with_label_values(&[&self.group, reason])
            .inc_by(n);
    }
}
