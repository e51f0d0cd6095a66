//! The engine's health as the shim judges it, and what follows from it: a worker whose engine
//! does not answer leaves routing and comes back by itself.
//!
//! Two signals feed one [`Judge`] (a clock-free state machine, tested without sockets):
//! - **probes**: `GET <upstream><--engine-probe-path>` every `--engine-probe-interval` with a
//!   `--engine-probe-timeout`; one failed probe (no connection, no answer in time, a status
//!   other than 2xx) marks the engine down, one that passes marks it up again. A probe is the
//!   engine's own statement about itself (vLLM's and SGLang's `/health` fail when the engine
//!   core died), and an unanswered one is what a dead or frozen engine looks like — unless the
//!   engine's streams are still moving: a probe that times out while a proxied stream received
//!   engine bytes within the last probe interval + timeout is forgiven (counted, logged, the
//!   worker stays in routing). A loaded vLLM answers `/health` and `/metrics` seconds late
//!   while it decodes at full speed, and taking such a rank out of routing moves its share of
//!   the load onto the others for nothing. A frozen engine sends no bytes, so it is still
//!   taken out, one window later at most (3 s with the defaults).
//! - **proxied requests**: `--engine-failure-threshold` upstream failures in a row (no
//!   connection, a 5xx, a response body cut off) mark it down even while probes pass (an engine
//!   whose health endpoint answers but whose generations fail). Then probes must pass for a hold
//!   time before it is back, 1 s doubling up to 30 s while the failures recur, so a worker that
//!   fails every request is not put back into routing every probe interval.
//!
//! Down: every rank's reporter ends its telemetry stream cleanly ([`ProgressSink::set_serving`]),
//! which ingest turns into SUSPECT in σ at once (decision assigns nothing to it), and `/readyz`
//! answers 503 saying why. Up: the reporters say Hello again with the same incarnation and a
//! full state (σ keeps their requests if the snapshot service's `--worker-grace` has not
//! passed; after it the worker was fenced, and it comes back as a new incarnation), and
//! `/readyz` answers 200. Ending the stream needs nothing new from ingest, the snapshot service
//! or the contracts: the stream's end is already what makes a worker SUSPECT, and the fence
//! after the grace is right for an engine that stays down (its requests died with it).
//!
//! An engine that went away (a probe found nothing listening) and answers again is a new
//! process: every rank says its next Hello as a new incarnation, so σ drops what the old one
//! held at once and operators see the restart (`brctl status`).
//!
//! The shim starts down ("no probe answered yet"): it says Hello only once its engine answers.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use br_runtime::admin::Readiness;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::ranks::{RankCheck, RankVerdict};
use crate::report::ProgressSink;

/// Default path probed: vLLM and SGLang serve `/health` (200 while the engine core is alive;
/// SGLang's `/health_generate` runs a generation, too costly every 500 ms), and so does br-emu.
pub const DEFAULT_PROBE_PATH: &str = "/health";
/// Default time between two probes.
pub const DEFAULT_PROBE_INTERVAL: Duration = Duration::from_millis(500);
/// Default proxied upstream failures in a row that take the worker out of routing.
pub const DEFAULT_FAILURE_THRESHOLD: u32 = 3;
/// The first hold after a run of proxied failures; doubles on each run up to [`MAX_HOLD`].
pub const BASE_HOLD: Duration = Duration::from_secs(1);
/// The longest hold after a run of proxied failures.
pub const MAX_HOLD: Duration = Duration::from_secs(30);
/// Up this long without a run of failures, the hold starts again from [`BASE_HOLD`].
pub const CALM: Duration = Duration::from_secs(60);

/// How a proxied request failed at the engine (the `kind` label of
/// `balanceroute_shim_upstream_errors_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamError {
    /// No connection, or the connection was lost before a response.
    Connection,
    /// No response in time.
    Timeout,
    /// The engine answered 5xx.
    Status5xx,
    /// The response started but its body was cut off.
    Body,
}

impl UpstreamError {
    pub const ALL: [UpstreamError; 4] = [
        UpstreamError::Connection,
        UpstreamError::Timeout,
        UpstreamError::Status5xx,
        UpstreamError::Body,
    ];

    pub fn label(self) -> &'static str {
        match self {
            UpstreamError::Connection => "connection",
            UpstreamError::Timeout => "timeout",
            UpstreamError::Status5xx => "status_5xx",
            UpstreamError::Body => "body",
        }
    }

    /// The kind of a failed call to the engine (before or while reading the response).
    pub fn of(e: &reqwest::Error) -> UpstreamError {
        if e.is_timeout() {
            UpstreamError::Timeout
        } else if e.is_body() || e.is_decode() {
            UpstreamError::Body
        } else {
            UpstreamError::Connection
        }
    }
}

/// Why a probe failed (the `reason` label of `balanceroute_shim_engine_probe_failures_total`;
/// `rank_check`: the engine answered, but whether it serves the pinned ranks is still open).
pub const PROBE_FAILURES: [&str; 4] = ["connection", "timeout", "status", "rank_check"];

/// The judgement: up, or down and why. Takes time as `now`; does no I/O.
#[derive(Debug)]
pub struct Judge {
    threshold: u32,
    /// Proxied failures in a row.
    run: u32,
    down: Option<Down>,
    /// The hold of the next run of failures.
    hold: Duration,
    up_since: Option<Instant>,
}

#[derive(Debug, Clone)]
struct Down {
    why: String,
    /// Probes passing before this do not bring it back (after a run of proxied failures).
    until: Option<Instant>,
}

/// What a signal changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing (the reason may have been refined).
    Same,
    /// The engine is up again.
    Up,
    /// The engine went down, for this reason.
    Down(String),
}

impl Judge {
    /// Down until the first probe passes.
    pub fn new(threshold: u32) -> Judge {
        Judge {
            threshold: threshold.max(1),
            run: 0,
            down: Some(Down {
                why: "no probe of the engine has answered yet".into(),
                until: None,
            }),
            hold: BASE_HOLD,
            up_since: None,
        }
    }

    pub fn is_up(&self) -> bool {
        self.down.is_none()
    }

    /// Why the engine is down (None while up).
    pub fn why_down(&self) -> Option<&str> {
        self.down.as_ref().map(|d| d.why.as_str())
    }

    /// A probe passed.
    pub fn probe_ok(&mut self, now: Instant) -> Verdict {
        match &self.down {
            Some(d) if d.until.is_none_or(|u| now >= u) => {
                self.down = None;
                self.run = 0;
                self.up_since = Some(now);
                Verdict::Up
            }
            _ => Verdict::Same,
        }
    }

    /// A probe failed.
    pub fn probe_failed(&mut self, why: String) -> Verdict {
        match &mut self.down {
            Some(d) => {
                d.why = why;
                Verdict::Same
            }
            None => {
                self.down = Some(Down {
                    why: why.clone(),
                    until: None,
                });
                Verdict::Down(why)
            }
        }
    }

    /// A probe timed out; `streamed` is when a proxied stream last received engine bytes.
    /// Forgiven (`None`) while the engine is up and streamed within `window` of `now`: it is
    /// working, only slow to answer its health endpoint.
    pub fn probe_timed_out(
        &mut self,
        now: Instant,
        why: String,
        streamed: Option<Instant>,
        window: Duration,
    ) -> Option<Verdict> {
        let moving = streamed.is_some_and(|t| now.saturating_duration_since(t) <= window);
        if self.is_up() && moving {
            return None;
        }
        Some(self.probe_failed(why))
    }

    /// A proxied request got an answer from the engine that was not a 5xx.
    pub fn proxied_ok(&mut self) {
        self.run = 0;
    }

    /// A proxied request failed at the engine.
    pub fn proxied_failed(&mut self, now: Instant, kind: UpstreamError, detail: &str) -> Verdict {
        self.run = self.run.saturating_add(1);
        if self.down.is_some() || self.run < self.threshold {
            return Verdict::Same;
        }
        if self.up_since.is_some_and(|t| now.duration_since(t) >= CALM) {
            self.hold = BASE_HOLD;
        }
        let hold = self.hold;
        self.hold = (self.hold * 2).min(MAX_HOLD);
        let why = format!(
            "{} proxied requests in a row failed at the engine (last: {}: {detail}); out of \
             routing until probes pass after {hold:?}",
            self.run,
            kind.label()
        );
        self.down = Some(Down {
            why: why.clone(),
            until: Some(now + hold),
        });
        Verdict::Down(why)
    }
}

/// The health metrics (process-wide: one engine).
#[derive(Debug, Clone)]
pub struct HealthMetrics {
    /// 1 while the engine is judged up.
    pub engine_up: IntGauge,
    /// Times the engine was judged down after it had been up: each took every rank of the
    /// shim out of routing. The gauge shows only the present; a run that compares policies
    /// needs to know whether its ranks left routing at any time (scripts/demo.sh reads it).
    pub engine_down: IntCounter,
    /// Probes that failed, by reason.
    pub probe_failures: IntCounterVec,
}

impl HealthMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = HealthMetrics {
            engine_up: IntGauge::with_opts(Opts::new(
                "balanceroute_shim_engine_up",
                "1 while the shim judges its engine up (probes pass, no run of failed requests); \
                 0 takes the worker out of routing.",
            ))?,
            engine_down: IntCounter::with_opts(Opts::new(
                "balanceroute_shim_engine_down_total",
                "Times the shim judged its engine down after it had been up, each taking its \
                 ranks out of routing until the engine answers again (not the start, before the \
                 first probe answers).",
            ))?,
            probe_failures: IntCounterVec::new(
                Opts::new(
                    "balanceroute_shim_engine_probe_failures_total",
                    "Health probes of the engine that failed, by reason (connection, timeout, \
                     status: not 2xx).",
                ),
                &["reason"],
            )?,
        };
        for r in PROBE_FAILURES {
            m.probe_failures.with_label_values(&[r]);
        }
        registry.register(Box::new(m.engine_up.clone()))?;
        registry.register(Box::new(m.engine_down.clone()))?;
        registry.register(Box::new(m.probe_failures.clone()))?;
        Ok(m)
    }
}

/// The judge and what its verdicts act on; shared by the prober and the proxy.
pub struct Health {
    judge: Mutex<Judge>,
    /// When a proxied stream last received engine bytes: milliseconds after `epoch`, plus one
    /// (0: never). An atomic, so the proxy's per-chunk update takes no lock.
    streamed_ms: AtomicU64,
    epoch: Instant,
    /// A probe found nothing listening after the engine had been up: the process is gone, and
    /// when it answers again it is a new one (a new incarnation of the worker).
    gone: AtomicBool,
    sinks: Vec<Arc<dyn ProgressSink>>,
    readiness: Option<Readiness>,
    metrics: Option<HealthMetrics>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("judge", &self.judge)
            .finish_non_exhaustive()
    }
}

impl Health {
    /// Acts on `sinks` (every rank's reporter), `readiness` and `metrics`, and says the
    /// starting state to all of them at once: down until the first probe passes when the
    /// engine is `probed`, else up (only a run of failed requests takes it down, and the hold
    /// after it brings it back).
    pub fn new(
        threshold: u32,
        sinks: Vec<Arc<dyn ProgressSink>>,
        readiness: Option<Readiness>,
        metrics: Option<HealthMetrics>,
        probed: bool,
    ) -> Health {
        let mut judge = Judge::new(threshold);
        if !probed {
            judge.down = None;
            judge.up_since = Some(Instant::now());
        }
        let first = if probed {
            Verdict::Down(String::new())
        } else {
            Verdict::Up
        };
        let h = Health {
            judge: Mutex::new(judge),
            streamed_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            gone: AtomicBool::new(false),
            sinks,
            readiness,
            metrics,
        };
        h.act(&first);
        h
    }

    /// A health that is up and acts on nothing: a shim without probes (the library's default,
    /// as before probing existed).
    pub fn always_up() -> Health {
        let mut judge = Judge::new(u32::MAX);
        judge.down = None;
        Health {
            judge: Mutex::new(judge),
            streamed_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            gone: AtomicBool::new(false),
            sinks: Vec::new(),
            readiness: None,
            metrics: None,
        }
    }

    fn judge(&self) -> std::sync::MutexGuard<'_, Judge> {
        self.judge
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn is_up(&self) -> bool {
        self.judge().is_up()
    }

    /// Why the engine is down (None while up).
    pub fn why_down(&self) -> Option<String> {
        self.judge().why_down().map(str::to_owned)
    }

    /// Applies a verdict (outside the judge's lock: the sinks only flip a flag, but nothing is
    /// called under it).
    fn act(&self, verdict: &Verdict) {
        let (up, why) = {
            let j = self.judge();
            (j.is_up(), j.why_down().map(str::to_owned))
        };
        match verdict {
            Verdict::Same => {
                // Only the reason may have changed.
                if let (Some(r), Some(why)) = (&self.readiness, why) {
                    r.set_not_ready(format!("engine down: {why}"));
                }
                return;
            }
            Verdict::Up => tracing::info!("the engine answers; in routing"),
            Verdict::Down(w) if !w.is_empty() => {
                tracing::warn!(why = %w, "the engine is down; out of routing until it answers");
                if let Some(m) = &self.metrics {
                    m.engine_down.inc();
                }
            }
            Verdict::Down(_) => {}
        }
        let restarted = up && self.gone.swap(false, Ordering::Relaxed);
        for s in &self.sinks {
            if restarted {
                s.renew_incarnation();
            }
            s.set_serving(up);
        }
        if let Some(m) = &self.metrics {
            m.engine_up.set(i64::from(up));
        }
        if let Some(r) = &self.readiness {
            match why {
                None => r.set(true),
                Some(why) => r.set_not_ready(format!("engine down: {why}")),
            }
        }
    }

    /// A proxied stream received bytes from the engine.
    pub fn engine_streamed(&self) {
        let ms = Instant::now()
            .saturating_duration_since(self.epoch)
            .as_millis() as u64;
        self.streamed_ms.store(ms + 1, Ordering::Relaxed);
    }

    fn last_streamed(&self) -> Option<Instant> {
        match self.streamed_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(self.epoch + Duration::from_millis(ms - 1)),
        }
    }

    /// A proxied request got an answer that was not a 5xx.
    pub fn proxied_ok(&self) {
        self.judge().proxied_ok();
    }

    /// A proxied request failed at the engine.
    pub fn proxied_failed(&self, kind: UpstreamError, detail: &str) {
        let v = self.judge().proxied_failed(Instant::now(), kind, detail);
        if v != Verdict::Same {
            self.act(&v);
        }
    }

    /// A probe's outcome; `window` is how recent engine bytes must be to forgive a timeout.
    fn probed(&self, outcome: Result<(), (&'static str, String)>, window: Duration) {
        let v = match outcome {
            Ok(()) => self.judge().probe_ok(Instant::now()),
            Err((reason, why)) => {
                if let Some(m) = &self.metrics {
                    m.probe_failures.with_label_values(&[reason]).inc();
                }
                if reason == "connection" && self.judge().up_since.is_some() {
                    self.gone.store(true, Ordering::Relaxed);
                }
                if reason == "timeout" {
                    let streamed = self.last_streamed();
                    match self.judge().probe_timed_out(
                        Instant::now(),
                        why.clone(),
                        streamed,
                        window,
                    ) {
                        Some(v) => v,
                        None => {
                            tracing::info!(%why, "a probe timed out while the engine's streams \
                                move; kept in routing");
                            return;
                        }
                    }
                } else {
                    self.judge().probe_failed(why)
                }
            }
        };
        self.act(&v);
    }
}

/// How the engine is probed (`--engine-probe-*`).
#[derive(Debug, Clone)]
pub struct ProbeConfig {
    /// The URL probed: the upstream plus the probe path. None: probing is off, and every
    /// interval counts as a passing probe (so the hold after a run of failures still ends).
    pub url: Option<String>,
    pub interval: Duration,
    pub timeout: Duration,
    /// Asked once the engine first answers, before the engine counts as up (so before any
    /// rank's first Hello): whether it serves the ranks the shim pins (`crate::ranks`).
    pub rank_check: Option<RankCheck>,
}

/// Probes the engine until `stop`: one probe at a time, the next `interval` after the last
/// one's start (or at once after a probe that took longer). A rank check that the engine
/// refuses is sent on `refused` (the message the shim exits with), and probing ends.
pub fn spawn_prober(
    health: Arc<Health>,
    cfg: ProbeConfig,
    refused: tokio::sync::oneshot::Sender<String>,
    stop: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, reqwest::Error> {
    let client = reqwest::Client::builder()
        .connect_timeout(cfg.timeout)
        .timeout(cfg.timeout)
        .tcp_nodelay(true)
        .build()?;
    let mut rank_check = cfg.rank_check;
    // A frozen engine stays in routing at most this long after its last streamed bytes.
    let window = cfg.interval + cfg.timeout;
    let mut open_checks = 0;
    let mut refused = Some(refused);
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(cfg.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = stop.cancelled() => return,
            }
            let Some(url) = &cfg.url else {
                health.probed(Ok(()), window);
                continue;
            };
            let outcome = tokio::select! {
                r = client.get(url).send() => match r {
                    Ok(resp) if resp.status().is_success() => Ok(()),
                    Ok(resp) => Err(("status", format!("GET {url} answered {}", resp.status()))),
                    Err(e) if e.is_timeout() => Err((
                        "timeout",
                        format!("GET {url} did not answer within {:?}", cfg.timeout),
                    )),
                    Err(e) => Err(("connection", format!("GET {url}: {}", crate::error_chain(&e)))),
                },
                () = stop.cancelled() => return,
            };
            let outcome = match (&outcome, &rank_check) {
                (Ok(()), Some(check)) => {
                    let verdict = tokio::select! {
                        v = check.run() => v,
                        () = stop.cancelled() => return,
                    };
                    match verdict {
                        RankVerdict::Served => {
                            tracing::info!(ranks = ?check.ranks(), "the engine serves every pinned rank");
                            rank_check = None;
                            outcome
                        }
                        RankVerdict::Refused { rank, answer } => {
                            let msg = crate::ranks::refused_message(rank, &answer, &check.ranks());
                            tracing::error!(rank, "{msg}");
                            if let Some(tx) = refused.take() {
                                let _ = tx.send(msg);
                            }
                            return;
                        }
                        RankVerdict::Open(why) => {
                            open_checks += 1;
                            if open_checks >= crate::ranks::MAX_OPEN_CHECKS {
                                tracing::warn!(%why, "could not check the pinned ranks {open_checks} \
                                    times; serving unchecked");
                                rank_check = None;
                                outcome
                            } else {
                                Err(("rank_check", format!("checking the pinned ranks: {why}")))
                            }
                        }
                    }
                }
                _ => outcome,
            };
            health.probed(outcome, window);
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(start: Instant, ms: u64) -> Instant {
        start + Duration::from_millis(ms)
    }

    #[test]
    fn starts_down_and_the_first_passing_probe_brings_it_up() {
        let t = Instant::now();
        let mut j = Judge::new(3);
        assert!(!j.is_up());
        assert!(j.why_down().is_some_and(|w| w.contains("no probe")));
        assert_eq!(j.probe_failed("refused".into()), Verdict::Same);
        assert_eq!(
            j.why_down(),
            Some("refused"),
            "the reason follows the probes"
        );
        assert_eq!(j.probe_ok(t), Verdict::Up);
        assert_eq!(j.probe_ok(at(t, 500)), Verdict::Same);
    }

    #[test]
    fn one_failed_probe_takes_it_down_and_one_passing_probe_brings_it_back() {
        let t = Instant::now();
        let mut j = Judge::new(3);
        j.probe_ok(t);
        assert_eq!(
            j.probe_failed("timeout".into()),
            Verdict::Down("timeout".into())
        );
        assert_eq!(j.probe_failed("refused".into()), Verdict::Same);
        assert_eq!(j.probe_ok(at(t, 1000)), Verdict::Up);
    }

    #[test]
    fn a_timed_out_probe_is_forgiven_only_while_the_engine_streams() {
        let t = Instant::now();
        let w = Duration::from_millis(1500);
        let mut j = Judge::new(3);
        // down at the start: streams (from before) do not bring it up, only a probe does
        assert_eq!(
            j.probe_timed_out(at(t, 0), "slow".into(), Some(t), w),
            Some(Verdict::Same)
        );
        assert!(!j.is_up());
        j.probe_ok(at(t, 10));
        // up, and bytes streamed 1.5 s ago or less: forgiven, still up
        assert_eq!(
            j.probe_timed_out(at(t, 1000), "slow".into(), Some(t), w),
            None
        );
        assert_eq!(
            j.probe_timed_out(at(t, 1500), "slow".into(), Some(t), w),
            None
        );
        assert!(j.is_up());
        // nothing streamed for longer than the window: a frozen engine, down
        assert_eq!(
            j.probe_timed_out(at(t, 1501), "slow".into(), Some(t), w),
            Some(Verdict::Down("slow".into()))
        );
        j.probe_ok(at(t, 2000));
        // never streamed: a timeout takes it down as before
        assert_eq!(
            j.probe_timed_out(at(t, 2100), "slow".into(), None, w),
            Some(Verdict::Down("slow".into()))
        );
    }

    #[test]
    fn a_health_forgives_a_slow_probe_only_while_bytes_flow() {
        let sink = crate::RecordingSink::default();
        let h = Health::new(3, vec![Arc::new(sink.clone())], None, None, true);
        let w = Duration::from_secs(60);
        h.probed(Ok(()), w);
        h.probed(Err(("timeout", "GET x did not answer".into())), w);
        assert!(!h.is_up(), "no stream has moved: a timeout takes it down");
        h.probed(Ok(()), w);
        h.engine_streamed();
        h.probed(Err(("timeout", "GET x did not answer".into())), w);
        assert!(h.is_up(), "bytes streamed within the window");
        h.probed(Err(("connection", "GET x: refused".into())), w);
        assert!(!h.is_up(), "a refused connection is never forgiven");
        h.probed(Ok(()), w);
        h.probed(Err(("timeout", "late".into())), Duration::ZERO);
        assert!(!h.is_up(), "outside the window");
        assert_eq!(
            sink.serving_changes(),
            vec![false, true, false, true, false, true, false]
        );
    }

    #[test]
    fn an_engine_that_went_away_comes_back_as_a_new_incarnation() {
        let sink = crate::RecordingSink::default();
        let h = Health::new(3, vec![Arc::new(sink.clone())], None, None, true);
        let w = Duration::from_secs(1);
        // not listening yet at start-up: the first Hello is the process's own incarnation
        h.probed(Err(("connection", "refused".into())), w);
        h.probed(Ok(()), w);
        assert_eq!(sink.incarnations_renewed(), 0);
        // a frozen engine (timeouts) keeps its requests, and its incarnation
        h.probed(Err(("timeout", "late".into())), w);
        h.probed(Ok(()), w);
        assert_eq!(sink.incarnations_renewed(), 0);
        // nothing listening after it was up: the process is gone; back as a new one
        h.probed(Err(("connection", "refused".into())), w);
        h.probed(Err(("timeout", "loading".into())), w);
        assert_eq!(
            sink.incarnations_renewed(),
            0,
            "renewed only when it serves again"
        );
        h.probed(Ok(()), w);
        assert_eq!(sink.incarnations_renewed(), 1);
        assert_eq!(
            sink.serving_changes(),
            vec![false, true, false, true, false, true]
        );
    }

    #[test]
    fn a_run_of_proxied_failures_takes_it_down_and_any_answer_breaks_the_run() {
        let t = Instant::now();
        let mut j = Judge::new(3);
        j.probe_ok(t);
        let fail = |j: &mut Judge, ms| j.proxied_failed(at(t, ms), UpstreamError::Status5xx, "500");
        assert_eq!(fail(&mut j, 1), Verdict::Same);
        assert_eq!(fail(&mut j, 2), Verdict::Same);
        j.proxied_ok();
        assert_eq!(fail(&mut j, 3), Verdict::Same);
        assert_eq!(fail(&mut j, 4), Verdict::Same);
        let Verdict::Down(why) = fail(&mut j, 5) else {
            panic!("three in a row did not take it down")
        };
        assert!(
            why.contains("3 proxied requests") && why.contains("status_5xx"),
            "{why}"
        );
        assert_eq!(fail(&mut j, 6), Verdict::Same, "already down");
    }

    #[test]
    fn after_a_run_probes_must_pass_for_a_hold_that_doubles_while_runs_recur() {
        let t = Instant::now();
        let mut j = Judge::new(1);
        j.probe_ok(t);
        // first run: held 1 s
        assert!(matches!(
            j.proxied_failed(at(t, 0), UpstreamError::Connection, "reset"),
            Verdict::Down(_)
        ));
        assert_eq!(j.probe_ok(at(t, 999)), Verdict::Same, "still held");
        assert_eq!(j.probe_ok(at(t, 1000)), Verdict::Up);
        // second run soon after: held 2 s
        assert!(matches!(
            j.proxied_failed(at(t, 1100), UpstreamError::Body, "cut"),
            Verdict::Down(_)
        ));
        assert_eq!(j.probe_ok(at(t, 3099)), Verdict::Same);
        assert_eq!(j.probe_ok(at(t, 3100)), Verdict::Up);
        // a failing probe during a hold keeps it down with the probe's reason, hold kept
        j.proxied_failed(at(t, 3200), UpstreamError::Timeout, "slow");
        assert_eq!(j.probe_failed("refused".into()), Verdict::Same);
        assert_eq!(j.why_down(), Some("refused"));
        assert_eq!(
            j.probe_ok(at(t, 3300)),
            Verdict::Same,
            "the 4 s hold still runs"
        );
        assert_eq!(j.probe_ok(at(t, 7200)), Verdict::Up);
        // calm for CALM: the next run is held BASE_HOLD again
        let later = 7200 + CALM.as_millis() as u64;
        j.proxied_failed(at(t, later), UpstreamError::Status5xx, "500");
        assert_eq!(j.probe_ok(at(t, later + 999)), Verdict::Same);
        assert_eq!(j.probe_ok(at(t, later + 1000)), Verdict::Up);
    }

    #[test]
    fn the_hold_never_exceeds_its_maximum() {
        let t = Instant::now();
        let mut j = Judge::new(1);
        j.probe_ok(t);
        let mut now = 0;
        for _ in 0..10 {
            j.proxied_failed(at(t, now), UpstreamError::Status5xx, "500");
            now += MAX_HOLD.as_millis() as u64;
            assert_eq!(
                j.probe_ok(at(t, now)),
                Verdict::Up,
                "held longer than MAX_HOLD"
            );
        }
    }

    #[test]
    fn a_health_acts_on_every_sink_and_the_readiness() {
        let sink = crate::RecordingSink::default();
        let ready = Readiness::new(true);
        let h = Health::new(
            2,
            vec![Arc::new(sink.clone())],
            Some(ready.clone()),
            None,
            true,
        );
        assert!(!ready.is_ready(), "starts down");
        assert!(ready.why_not().contains("no probe"), "{}", ready.why_not());
        h.probed(Ok(()), Duration::from_secs(1));
        assert!(ready.is_ready());
        h.proxied_failed(UpstreamError::Status5xx, "500");
        assert!(ready.is_ready());
        h.proxied_failed(UpstreamError::Status5xx, "502");
        assert!(!ready.is_ready());
        assert!(ready.why_not().contains("502"), "{}", ready.why_not());
        h.probed(
            Err(("connection", "GET x: refused".into())),
            Duration::from_secs(1),
        );
        assert!(ready.why_not().contains("refused"), "{}", ready.why_not());
        assert_eq!(sink.serving_changes(), vec![false, true, false]);
    }
}
