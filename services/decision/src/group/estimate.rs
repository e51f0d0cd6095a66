//! The progress of the ranks while σ is not current: what the decision routes on during a
//! snapshot-service outage.
//!
//! Without σ the view would freeze at its last state: nothing ever finishes, so a pooled
//! policy (BR-0) runs out of free slots a few seconds into an outage and stops answering.
//! The ranks do not stop, though: they decode one token per request per lockstep step, and
//! requests finish. [`Estimator`] carries that forward:
//!
//! * while σ is current it *learns*: the step time, from how fast σ's running requests gain
//!   tokens, fitted to br-core's step model `T = a·M + b` ([`br_core::StepFit`]); and the
//!   output-length distribution, from every request σ reports finished (br-core's
//!   [`Survival`] predictor);
//! * when σ goes stale it *runs* ([`Estimator::start`]): a copy of the view at the last
//!   confirmed instant is stepped forward in lockstep by the learned step time; each running
//!   request finishes at the median output length of the requests that got as far as it did
//!   (no such length known: it runs on, as before); a reserved request starts when its rank
//!   has a free slot (queueing at the rank in arrival order, as engines do). Admissions made
//!   meanwhile join the run the same way.
//!
//! It is an estimate and never more: answers made on it are flagged stale, and σ replaces it
//! as soon as the snapshot service is back. Owns the learning state and the run; pure and
//! clock-free (time comes in as `now`).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

use br_core::predict::{Finished, Predictor as _, Survival};
use br_core::{ClusterState, Phase, RequestInfo, RequestKey, StepFit, StepModel};
use rustc_hash::FxHashMap;

/// σ is sampled for the step time at most this often (a few steps' worth of tokens, so the
/// chunking of telemetry averages out).
const SAMPLE_EVERY: Duration = Duration::from_secs(1);
/// Samples further apart than this are not compared (σ was away in between).
const SAMPLE_MAX_GAP: Duration = Duration::from_secs(5);
/// Step-time observations the fit keeps.
const FIT_WINDOW: usize = 64;
/// Finished requests observed before the output-length median is trusted (a handful is
/// enough for a median; the estimate is replaced by σ as soon as it is back).
const MIN_LENGTHS: u64 = 8;
/// Longest output length tracked (longer ones count as this).
const MAX_LENGTH: u32 = 65_536;
/// At most this many steps are simulated per call (a guard against a degenerate step time);
/// the clock then jumps to `now`.
const MAX_STEPS_PER_ADVANCE: u32 = 100_000;

/// One sample of σ's running requests, for the step time.
struct Sample {
    at: Instant,
    generated: FxHashMap<RequestKey, u32>,
    max_running_load: u64,
}

/// The run of an outage: the estimated state and how it moves on.
struct Run {
    cluster: ClusterState,
    /// Estimated output length per request (none: unknown, it runs on).
    outputs: FxHashMap<RequestKey, u32>,
    /// Reserved requests per rank, in arrival order (removed ones are skipped lazily).
    queues: FxHashMap<u32, VecDeque<RequestKey>>,
    /// (step at which it finishes, key) of the running requests with a known output.
    finishes: BinaryHeap<Reverse<(u64, RequestKey)>>,
    step: u64,
    /// The instant the run has reached.
    clock: Instant,
    model: StepModel,
}

/// What [`Estimator::advance`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Advanced {
    pub(super) steps: u32,
    pub(super) finished: u32,
    pub(super) started: u32,
}

impl Advanced {
    pub(super) fn changed(&self) -> bool {
        self.steps > 0 || self.finished > 0 || self.started > 0
    }
}

/// Learns the ranks' pace while σ is current, estimates their progress while it is not. See
/// the module docs.
pub(super) struct Estimator {
    fit: StepFit,
    lengths: Survival,
    sample: Option<Sample>,
    run: Option<Run>,
}

fn max_running_load(c: &ClusterState) -> u64 {
    c.workers()
        .iter()
        .filter(|w| w.alive)
        .map(|w| w.running_load)
        .max()
        .unwrap_or(0)
}

impl Estimator {
    pub(super) fn new() -> Estimator {
        Estimator {
            fit: StepFit::new(StepModel::DEFAULT, FIT_WINDOW),
            lengths: Survival::new(MAX_LENGTH, MIN_LENGTHS),
            sample: None,
            run: None,
        }
    }

    /// The step model as learned so far.
    #[cfg(test)]
    pub(super) fn model(&self) -> StepModel {
        self.fit.model()
    }

    /// The estimated output length of a request that generated `generated` tokens, at most
    /// `max_tokens` (if the gateway said).
    pub(super) fn output(&self, generated: u32, max_tokens: Option<u32>) -> Option<u32> {
        let median = self.lengths.median_output(generated);
        match (median, max_tokens) {
            (Some(m), Some(cap)) => Some(m.min(cap.max(generated + 1))),
            (Some(m), None) => Some(m),
            (None, Some(cap)) => Some(cap.max(generated + 1)),
            (None, None) => None,
        }
    }

    // ---------------------------------------------------------------- learning

    /// σ reported a request finished after `tokens` tokens.
    pub(super) fn observe_finished(&mut self, tokens: u32) {
        if tokens > 0 {
            // Global lengths only (its median is asked without a prompt length).
            self.lengths.observe(&Finished {
                prompt_tokens: 0,
                prompt_hash: None,
                output_tokens: tokens,
                expected_output: None,
                class: None,
            });
        }
    }

    /// σ (current) moved: sample its running requests for the step time, at most every
    /// [`SAMPLE_EVERY`].
    pub(super) fn observe_sigma(&mut self, sigma: &ClusterState, now: Instant) {
        if let Some(s) = &self.sample
            && now.saturating_duration_since(s.at) < SAMPLE_EVERY
        {
            return;
        }
        let generated: FxHashMap<RequestKey, u32> = sigma
            .requests()
            .filter(|r| r.phase == Phase::Running)
            .map(|r| (r.key, r.generated))
            .collect();
        let next = Sample {
            at: now,
            generated,
            max_running_load: max_running_load(sigma),
        };
        if let Some(prev) = self.sample.take() {
            let dt = now.saturating_duration_since(prev.at);
            if dt <= SAMPLE_MAX_GAP {
                let (mut tokens, mut n) = (0u64, 0u64);
                for (key, g) in &next.generated {
                    if let Some(&before) = prev.generated.get(key) {
                        tokens += u64::from(g.saturating_sub(before));
                        n += 1;
                    }
                }
                if n > 0 && tokens > 0 {
                    // Every running request of a lockstep group gains one token per step.
                    let steps = tokens as f64 / n as f64;
                    let load = (prev.max_running_load + next.max_running_load) / 2;
                    self.fit.observe(load, dt.as_secs_f64() * 1e3 / steps);
                }
            }
        }
        self.sample = Some(next);
    }

    // ---------------------------------------------------------------- the run

    pub(super) fn running(&self) -> bool {
        self.run.is_some()
    }

    /// σ went stale at `since`: run forward from `view` (σ plus own reservations as they were
    /// then). `max_tokens` gives the cap of an own reservation, if any.
    pub(super) fn start(
        &mut self,
        view: &ClusterState,
        since: Instant,
        max_tokens: impl Fn(RequestKey) -> Option<u32>,
    ) {
        self.sample = None;
        let mut run = Run {
            cluster: view.clone(),
            outputs: FxHashMap::default(),
            queues: FxHashMap::default(),
            finishes: BinaryHeap::new(),
            step: 0,
            clock: since,
            model: self.fit.model(),
        };
        let mut reqs: Vec<&RequestInfo> = view.requests().collect();
        // Keys grow with arrival (σ interns in order, own keys are above σ's): queue in that
        // order.
        reqs.sort_unstable_by_key(|r| r.key);
        for r in reqs {
            let out = self.output(r.generated, max_tokens(r.key));
            if let Some(o) = out {
                run.outputs.insert(r.key, o);
            }
            match r.phase {
                Phase::Running => {
                    if let Some(o) = out {
                        let left = u64::from(o.saturating_sub(r.generated).max(1));
                        run.finishes.push(Reverse((left, r.key)));
                    }
                }
                Phase::Queued => run.queues.entry(r.worker).or_default().push_back(r.key),
            }
        }
        self.run = Some(run);
    }

    /// σ is current again: the run ends.
    pub(super) fn stop(&mut self) {
        self.run = None;
    }

    /// The estimated state (while running).
    pub(super) fn cluster(&self) -> Option<&ClusterState> {
        self.run.as_ref().map(|r| &r.cluster)
    }

    /// An admission while running: reserved on its rank, it starts when a slot is free.
    pub(super) fn admit(&mut self, info: &RequestInfo, max_tokens: Option<u32>) {
        let out = self.output(0, max_tokens);
        let Some(run) = self.run.as_mut() else {
            return;
        };
        if run.cluster.reserve(info.clone()).is_err() {
            return;
        }
        if let Some(o) = out {
            run.outputs.insert(info.key, o);
        }
        run.queues
            .entry(info.worker)
            .or_default()
            .push_back(info.key);
    }

    /// A request leaves the run (released, cancelled, expired).
    pub(super) fn remove(&mut self, key: RequestKey) {
        if let Some(run) = self.run.as_mut() {
            run.cluster.remove(key).ok();
            run.outputs.remove(&key);
        }
    }

    /// Steps the run forward to `now`.
    pub(super) fn advance(&mut self, now: Instant) -> Advanced {
        let mut did = Advanced::default();
        let Some(run) = self.run.as_mut() else {
            return did;
        };
        loop {
            did.started += run.start_queued();
            let ms = run.model.step_ms(max_running_load(&run.cluster));
            let dt = Duration::from_secs_f64(ms / 1e3);
            if run.clock + dt > now {
                break;
            }
            if did.steps == MAX_STEPS_PER_ADVANCE {
                run.clock = now;
                break;
            }
            run.clock += dt;
            run.step += 1;
            did.steps += 1;
            run.cluster.advance_step();
            did.finished += run.finish_due();
        }
        did
    }
}

impl Run {
    /// Starts reserved requests on ranks with a free running slot, in arrival order.
    fn start_queued(&mut self) -> u32 {
        let mut started = 0;
        for (&worker, queue) in &mut self.queues {
            // While the rank is alive with a free running slot, and its queue has a request.
            while let Some(w) = self.cluster.worker(worker) {
                if !w.alive || w.running >= w.capacity {
                    break;
                }
                let Some(key) = queue.pop_front() else {
                    break;
                };
                let queued = self
                    .cluster
                    .get(key)
                    .is_some_and(|r| r.phase == Phase::Queued && r.worker == worker);
                if !queued || self.cluster.activate(key).is_err() {
                    continue; // removed meanwhile
                }
                started += 1;
                if let Some(&o) = self.outputs.get(&key) {
                    self.finishes
                        .push(Reverse((self.step + u64::from(o.max(1)), key)));
                }
            }
        }
        started
    }

    /// Removes the running requests whose estimated output is reached at this step.
    fn finish_due(&mut self) -> u32 {
        let mut finished = 0;
        while let Some(&Reverse((at, key))) = self.finishes.peek() {
            if at > self.step {
                break;
            }
            self.finishes.pop();
            let running = self
                .cluster
                .get(key)
                .is_some_and(|r| r.phase == Phase::Running);
            if running && self.cluster.remove(key).is_ok() {
                self.outputs.remove(&key);
                finished += 1;
            }
        }
        finished
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;

    fn req(key: RequestKey, worker: u32, generated: u32, phase: Phase) -> RequestInfo {
        RequestInfo {
            key,
            worker,
            prompt_tokens: 100,
            generated,
            phase,
            prompt_hash: None,
            oracle_output: None,
            expected_output: None,
            class: None,
        }
    }

    /// An estimator that learned outputs of exactly `len` tokens and a step of `step_ms` (25
    /// steps must take at least the 1 s sampling interval).
    fn trained(len: u32, step_ms: f64) -> (Estimator, Instant) {
        let mut e = Estimator::new();
        for _ in 0..MIN_LENGTHS {
            e.observe_finished(len);
        }
        let mut c = ClusterState::with_workers(&[4]);
        c.reserve(req(1, 0, 0, Phase::Queued)).unwrap();
        c.set_generated(1, 1).unwrap();
        let t0 = Instant::now();
        e.observe_sigma(&c, t0);
        // 25 tokens later, 25 steps' time later.
        c.set_generated(1, 26).unwrap();
        e.observe_sigma(&c, t0 + Duration::from_secs_f64(25.0 * step_ms / 1e3));
        (e, t0)
    }

    #[test]
    fn learns_the_step_time_and_the_output_lengths_from_sigma() {
        let (e, _) = trained(40, 50.0);
        let m = e.model();
        assert!((m.step_ms(113) - 50.0).abs() < 1e-6, "{m:?}");
        assert_eq!(e.output(0, None), Some(40));
        assert_eq!(e.output(0, Some(10)), Some(10), "max_tokens caps it");
        assert_eq!(e.output(39, None), Some(40));
        assert_eq!(e.output(40, None), None, "outlived every length: runs on");
    }

    #[test]
    fn a_run_finishes_requests_and_starts_queued_ones_in_order() {
        let (mut e, t0) = trained(10, 100.0);
        // One rank of capacity 2: two running (at 5 and 8 tokens), two queued behind them.
        let mut view = ClusterState::with_workers(&[2]);
        view.reserve(req(1, 0, 5, Phase::Running)).unwrap();
        view.reserve(req(2, 0, 8, Phase::Running)).unwrap();
        view.reserve(req(3, 0, 0, Phase::Queued)).unwrap();
        view.reserve(req(4, 0, 0, Phase::Queued)).unwrap();
        e.start(&view, t0, |_| None);
        let c = |e: &Estimator| e.cluster().unwrap().clone();
        // 1 step: nothing finishes yet (2 needs 2 more, 1 needs 5).
        let a = e.advance(t0 + Duration::from_millis(150));
        assert_eq!((a.steps, a.finished, a.started), (1, 0, 0));
        // 2 steps: request 2 finishes, request 3 takes its slot.
        let a = e.advance(t0 + Duration::from_millis(250));
        assert_eq!((a.steps, a.finished, a.started), (1, 1, 1));
        assert!(!c(&e).contains(2));
        assert_eq!(c(&e).get(3).unwrap().phase, Phase::Running);
        assert_eq!(c(&e).get(4).unwrap().phase, Phase::Queued);
        // 5 steps: request 1 finishes, 4 starts; the rank's slots stay full.
        e.advance(t0 + Duration::from_millis(550));
        let now = c(&e);
        assert!(!now.contains(1));
        assert_eq!(now.get(4).unwrap().phase, Phase::Running);
        assert_eq!(now.worker(0).unwrap().running, 2);
        // Request 3 started at step 2 with 10 tokens to go: gone after step 12, 4 after 15.
        e.advance(t0 + Duration::from_millis(1_250));
        assert!(!c(&e).contains(3) && c(&e).contains(4));
        e.advance(t0 + Duration::from_millis(1_550));
        assert_eq!(c(&e).request_count(), 0);
        assert_eq!(c(&e).worker(0).unwrap().free_slots(), 2);
    }

    #[test]
    fn without_learned_lengths_nothing_finishes() {
        let mut e = Estimator::new();
        let mut view = ClusterState::with_workers(&[1]);
        view.reserve(req(1, 0, 5, Phase::Running)).unwrap();
        let t0 = Instant::now();
        e.start(&view, t0, |_| None);
        let a = e.advance(t0 + Duration::from_secs(60));
        assert!(a.steps > 0);
        assert_eq!(a.finished, 0);
        assert!(e.cluster().unwrap().contains(1));
        // ... unless the gateway gave max_tokens.
        let mut e = Estimator::new();
        e.start(&view, t0, |_| Some(7));
        e.advance(t0 + Duration::from_secs(60));
        assert!(!e.cluster().unwrap().contains(1));
    }

    #[test]
    fn admissions_join_the_run_and_removals_leave_it() {
        let (mut e, t0) = trained(4, 50.0);
        let view = ClusterState::with_workers(&[1]);
        e.start(&view, t0, |_| None);
        e.admit(&req(10, 0, 0, Phase::Queued), None);
        e.admit(&req(11, 0, 0, Phase::Queued), None);
        e.remove(11);
        e.advance(t0 + Duration::from_millis(75));
        assert_eq!(e.cluster().unwrap().get(10).unwrap().phase, Phase::Running);
        assert!(!e.cluster().unwrap().contains(11));
        e.advance(t0 + Duration::from_millis(275));
        assert_eq!(e.cluster().unwrap().request_count(), 0);
        e.stop();
        assert!(!e.running() && e.cluster().is_none());
    }
}
