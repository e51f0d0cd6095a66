//! The simulation engine: a lockstep group of G workers running `br-core`'s policies.
//!
//! # Model
//! Each worker runs at most B requests. A decode step takes `T = a·max_g L_g + c·max_g n_g + b`
//! ms, where L_g is the KV load of worker g's running requests (`s_i + j − 1` for a request at
//! its j-th token) and n_g how many it runs (c = 0 by default: the paper's model, computed by
//! the same instructions as before c existed); every running request writes one token per step
//! and leaves after its `o_i`-th.
//!
//! # One step
//! 1. Requests whose arrival time has come arrive. On-arrival policies ([`Mode::OnArrival`]:
//!    the baselines and BR-0's pool bypass) name a worker at once and the request joins that
//!    worker's local FIFO queue (a reservation in σ, counted in the worker's `load()`);
//!    pooled policies ([`Mode::Pooled`]: BR-0, BR-H) put it in the central pool.
//! 2. Pooled policies run one batch admission (`Policy::dispatch`); each admitted request joins
//!    the chosen worker's local queue (it has a free slot, so it starts in the same step).
//! 3. Each worker starts queued requests, oldest first, while it has free slots.
//! 4. The step runs: its time is `a·max L + c·max n + b` (and the fluid time
//!    `a·mean L + c·mean n + b` is summed beside it), every running request writes a token (`ClusterState::advance_step`, linear in
//!    the running requests and G), requests that wrote their last token leave σ and are
//!    reported to the policy (`Policy::observe_finished`, which trains BR-H's predictors).
//!
//! When nothing runs and nothing can start, the clock skips to the next arrival. The per-step
//! cost is O(G + running) plus the policy's own work; no per-token hashing (finishes are found
//! through a heap keyed by the step they happen in).
//!
//! # Metrics (see [`RunReport`])
//! Imbalance and barrier idle are averaged over steps; throughput is output tokens over the
//! summed step times (idle gaps between arrivals are not counted); the steady figure counts
//! only steps that run while requests are left waiting after admission (in the pool or a local
//! queue; it equals the whole-run figure when nothing ever waited), the fluid one
//! replaces every step time by `a·mean L + c·mean n + b`. TPOT of a request is (finish time − time of its
//! first token) / (o − 1) (requests with one output token have none); queue time is the start
//! of its first step minus its arrival.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

use br_core::dispatch::Admission;
use br_core::stats::quantile;
use br_core::{ClusterState, Mode, Phase, Policy, Pool, PoolEntry, RequestInfo, WorkerId};

use crate::plot::LoadSeries;
use crate::report::{RunReport, SteadyExtra};
use crate::trace::TraceRequest;

/// Engine parameters.
#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// G.
    pub workers: u32,
    /// B.
    pub slots: u32,
    /// a, ms per KV token.
    pub step_a: f64,
    /// b, ms.
    pub step_b: f64,
    /// c, ms per running request on the rank that runs the most (0: the paper's model).
    pub step_c: f64,
    /// Keep the per-step per-worker loads (for the load figure).
    pub record_loads: bool,
    /// How the control plane sees the group (ideal: one decider with a perfect view).
    pub control: ControlPlane,
}

/// The control plane as deployed, not as idealised: telemetry reaches the deciders late, and
/// several deciders (decision replicas) route at once. [`ControlPlane::IDEAL`] is the paper's
/// model (and what every figure used before this was added).
///
/// * `telemetry_lag_steps` = d: a decider's σ shows worker progress (tokens written, requests
///   finished, requests started) as it was d steps ago. Reservations are not lagged: σ learns
///   them from the `Reserve` call itself, so every reservation made since then is in the view,
///   as a reservation (its prompt counts; its progress is unknown).
/// * `deciders` = K: arrivals are spread round-robin over K deciders, each with its own pool
///   (or, for on-arrival policies, its own routing) and its own view; a decider sees the others'
///   reservations of the same step only at the next step (one `Reserve` round trip). A pooled
///   admission that finds its worker full when it reaches σ is refused and rejoins its decider's
///   pool at its arrival position, as the snapshot service's serialised `Reserve` would do.
/// * `turns`: the K deciders take turns, one admission round each (decider `r mod K` in round
///   r, one round per step): each then sees every other's admissions, made in earlier rounds,
///   and none collide. A model of splitting ticks rather than only the pool between replicas.
///   The live services have no shared round order to keep such turns by (their ticks run on
///   their own clocks); `rank_split` is the order they do keep (`br-decision --decider-index`).
/// * `rank_split = Some(t)`: decider k places only on the ranks it owns (`g mod K = k`), every
///   rank still counted in its score (the others are not accepting in its view, their load
///   stays), so no two deciders ever reach for one free slot. A rank with free slots since `t`
///   steps or more (its owner left them: it is dead, or had nothing to place) is open to every
///   decider, which is what keeps a group served when a replica dies; only such takeovers can
///   collide. The live rule, with `t` a duration read from σ (`--decider-takeover`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlPlane {
    pub telemetry_lag_steps: u32,
    pub deciders: u32,
    pub turns: bool,
    pub rank_split: Option<u32>,
}

impl ControlPlane {
    /// One decider, no lag.
    pub const IDEAL: ControlPlane = ControlPlane {
        telemetry_lag_steps: 0,
        deciders: 1,
        turns: false,
        rank_split: None,
    };
}

impl Default for ControlPlane {
    fn default() -> Self {
        ControlPlane::IDEAL
    }
}

/// Errors of a simulation run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The core refused an operation the engine asked for (an engine or policy bug).
    #[error("policy {policy}: step {step}: {source}")]
    Core {
        /// Policy label.
        policy: String,
        /// Step index.
        step: u64,
        /// What the core said.
        source: br_core::CoreError,
    },
    /// An on-arrival policy named no worker, or named one outside the group.
    #[error(
        "policy {policy}: request {request}: routed to {worker:?}, not a worker of 0..{workers}"
    )]
    BadRoute {
        /// Policy label.
        policy: String,
        /// Request index.
        request: usize,
        /// What the policy answered.
        worker: Option<WorkerId>,
        /// G.
        workers: u32,
    },
    /// Requests wait but nothing runs, nothing was admitted and nothing else will arrive.
    #[error("policy {policy}: stuck at step {step}: {pool} requests in the pool, none admitted")]
    Stuck {
        /// Policy label.
        policy: String,
        /// Step index.
        step: u64,
        /// Pool size.
        pool: usize,
    },
}

/// The outcome of one run.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// The metrics.
    pub report: RunReport,
    /// Per-step per-worker running loads (with `record_loads`).
    pub loads: Option<LoadSeries>,
    /// First and one-past-last step that began with requests waiting (empty if none did).
    pub waiting_steps: std::ops::Range<usize>,
    /// Wall-clock time the run took.
    pub wall: Duration,
    /// Fluid-limit throughput over the steady-state steps (tokens / Σ (a·mean L + b) over the
    /// steps with requests waiting; the whole-run fluid figure when nothing waited).
    pub steady_fluid_tok_s: f64,
    /// Mean of max − min load over the steady-state steps (the whole-run figure when nothing
    /// waited): the imbalance a router controls, without the drain at the end of the trace.
    pub steady_imbalance: f64,
    /// Pooled admissions refused because another decider filled the worker first (always 0
    /// with one decider).
    pub refused_reservations: u64,
    /// Where the steady state's barrier idle comes from (BR-H's question).
    pub idle_flow: IdleFlow,
}

/// The barrier idle `G·max L − Σ L` over the steady-state steps, and the part of its change
/// from one step to the next that growth alone makes: every running request writes a token,
/// so rank g grows by its running count n_g, which adds `G·max(L + n) − Σ(L + n) − (G·max L −
/// Σ L)` (zero when every rank runs the same number of requests). The rest of the change is
/// finishes and placements. This is what a horizon projection of growth could act on; what it
/// projects beyond that is when requests finish.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct IdleFlow {
    pub steady_steps: u64,
    /// Mean barrier idle per steady step (KV tokens).
    pub mean_idle: f64,
    /// Mean idle growth adds per steady step (KV tokens; negative when it closes gaps).
    pub mean_growth: f64,
    /// Mean of max_g n_g − min_g n_g (running requests) over the steady steps.
    pub mean_running_spread: f64,
    /// `mean_growth` over every step of the run (the whole-run barrier idle is the report's
    /// `avg_barrier_idle`): what matters below capacity, where few steps are steady.
    pub run_growth: f64,
    /// `mean_running_spread` over every step of the run.
    pub run_running_spread: f64,
}

impl RunOutcome {
    /// The steady-state figures shown in the table.
    pub fn steady_extra(&self) -> SteadyExtra {
        SteadyExtra {
            fluid_tok_s: self.steady_fluid_tok_s,
            imbalance: self.steady_imbalance,
        }
    }
}

/// Simulates one policy over `requests` (any order; arrival times `None` count as 0) with one
/// decider.
pub fn simulate(
    requests: &[TraceRequest],
    policy: &mut dyn Policy,
    label: &str,
    cfg: &EngineConfig,
) -> Result<RunOutcome, SimError> {
    simulate_deciders(requests, &mut [policy], label, cfg)
}

/// Simulates `cfg.control.deciders` deciders, one policy instance each (built from the same
/// config; `policies.len()` must equal K).
pub fn simulate_deciders(
    requests: &[TraceRequest],
    policies: &mut [&mut dyn Policy],
    label: &str,
    cfg: &EngineConfig,
) -> Result<RunOutcome, SimError> {
    let started = Instant::now();
    let g = cfg.workers as usize;
    let n = requests.len();
    let k_count = policies.len().max(1);
    let mut state = ClusterState::with_workers(&vec![cfg.slots; g]);
    let mut pools: Vec<Pool> = (0..k_count).map(|_| Pool::new()).collect();
    let mode = policies.first().map_or(Mode::OnArrival, |p| p.mode());
    let ideal = cfg.control == ControlPlane::IDEAL && k_count == 1;
    let mut views = Views::new(cfg.control.telemetry_lag_steps, k_count);

    // Arrival order (stable).
    let arrival = |i: usize| requests[i].arrival_ms.unwrap_or(0.0).max(0.0);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&x, &y| arrival(x).total_cmp(&arrival(y)));
    // arrival rank of each request: its decider (round-robin) and its pool position
    let mut rank = vec![0u64; n];
    for (r, &i) in order.iter().enumerate() {
        rank[i] = r as u64;
    }
    let decider_of = |i: usize| (rank[i] % k_count as u64) as usize;

    let mut queues: Vec<VecDeque<u32>> = vec![VecDeque::new(); g];
    let mut queued_total = 0usize;
    let mut running = vec![0u32; g];
    let mut admit_ms = vec![0.0f64; n];
    let mut first_ms = vec![0.0f64; n];
    let mut finishing: BinaryHeap<Reverse<(u64, u32)>> = BinaryHeap::new();
    let mut just_started: Vec<u32> = Vec::new();
    let mut admissions: Vec<Admission> = Vec::new();

    let mut now = 0.0f64;
    let mut step: u64 = 0;
    // admission rounds (one per step, more while nothing runs): whose turn it is with `turns`
    let mut round: u64 = 0;
    let mut idle_rounds: usize = 0;
    let mut next = 0usize;
    let (mut busy_ms, mut fluid_ms, mut tokens) = (0.0f64, 0.0f64, 0u64);
    let (mut steady_ms, mut steady_tokens, mut steady_fluid_ms) = (0.0f64, 0u64, 0.0f64);
    let (mut steady_steps, mut steady_imb) = (0u64, 0.0f64);
    let (mut steady_idle, mut steady_growth, mut steady_spread) = (0.0f64, 0.0f64, 0.0f64);
    let (mut all_growth, mut all_spread) = (0.0f64, 0.0f64);
    let (mut sum_imb, mut sum_idle) = (0.0f64, 0.0f64);
    let (mut first_wait, mut last_wait) = (usize::MAX, 0usize);
    let mut tpot: Vec<f64> = Vec::with_capacity(n);
    let mut queue_sum = 0.0f64;
    let mut finished = 0u64;
    let mut loads: Vec<u64> = Vec::new();
    let mut refused = 0u64;
    // rank split: the step since which each rank has had free slots (takeover after t steps)
    let split = cfg.control.rank_split.filter(|_| k_count > 1);
    let mut free_since: Vec<Option<u64>> = vec![None; g];

    let core_err = |step: u64| {
        move |source| SimError::Core {
            policy: label.to_string(),
            step,
            source,
        }
    };

    loop {
        if !ideal {
            views.begin_step(step, &state);
        }
        // 1. arrivals
        while next < n && arrival(order[next]) <= now {
            let i = order[next];
            next += 1;
            let r = &requests[i];
            let entry = PoolEntry {
                key: i as u64,
                prompt_tokens: r.prompt_tokens,
                prompt_hash: r.prompt_hash,
                oracle_output: Some(r.output_tokens),
            };
            let k = decider_of(i);
            match mode {
                Mode::Pooled if ideal => pools[0].push(entry).map_err(core_err(step))?,
                Mode::Pooled => pools[k].push_at(entry, rank[i]).map_err(core_err(step))?,
                Mode::OnArrival => {
                    let view = if ideal { &state } else { views.view(k) };
                    let w = policies[k].route(&entry, view);
                    let Some(w) = w.filter(|&w| (w as usize) < g) else {
                        return Err(SimError::BadRoute {
                            policy: label.to_string(),
                            request: i,
                            worker: w,
                            workers: cfg.workers,
                        });
                    };
                    let info = queued_info(&entry, w);
                    if !ideal {
                        views.admitted(k, step, &info);
                    }
                    state.reserve(info).map_err(core_err(step))?;
                    queues[w as usize].push_back(i as u32);
                    queued_total += 1;
                }
            }
        }

        // 2. pooled batch admission, one per decider, each against its own view
        let turn = (round % k_count as u64) as usize;
        round += 1;
        if split.is_some() {
            for (since, w) in free_since.iter_mut().zip(state.workers()) {
                *since = (w.free_slots() > 0).then(|| since.unwrap_or(step));
            }
        }
        for (k, (policy, pool)) in policies.iter_mut().zip(pools.iter_mut()).enumerate() {
            if mode != Mode::Pooled || pool.is_empty() || (cfg.control.turns && k != turn) {
                continue;
            }
            admissions.clear();
            if let Some(takeover) = split {
                // nothing ran last round: the clock moves on without steps, so every rank is
                // past the takeover time
                let open = |w: usize| {
                    w % k_count == k
                        || idle_rounds > 0
                        || free_since[w].is_some_and(|s| step >= s + u64::from(takeover))
                };
                views.close_ranks(k, (0..g).filter(|&w| !open(w)));
            }
            let view = if ideal { &state } else { views.view(k) };
            policy.dispatch(pool, view, &mut admissions);
            for a in &admissions {
                let i = a.key as usize;
                if i >= n || (a.worker as usize) >= g {
                    return Err(SimError::BadRoute {
                        policy: label.to_string(),
                        request: i,
                        worker: Some(a.worker),
                        workers: cfg.workers,
                    });
                }
                let r = &requests[i];
                let entry = PoolEntry {
                    key: a.key,
                    prompt_tokens: r.prompt_tokens,
                    prompt_hash: r.prompt_hash,
                    oracle_output: Some(r.output_tokens),
                };
                let info = queued_info(&entry, a.worker);
                if !ideal {
                    // σ serialises reservations: one for a worker another decider filled
                    // first is refused and rejoins this decider's pool where it was.
                    let full = state.worker(a.worker).is_none_or(|w| w.free_slots() == 0);
                    if full {
                        refused += 1;
                        pool.push_at(entry, rank[i]).map_err(core_err(step))?;
                        continue;
                    }
                    views.admitted(k, step, &info);
                }
                state.reserve(info).map_err(core_err(step))?;
                queues[a.worker as usize].push_back(i as u32);
                queued_total += 1;
            }
        }

        // 3. local FIFO admission into free slots
        for (w, q) in queues.iter_mut().enumerate() {
            while running[w] < cfg.slots {
                let Some(i) = q.pop_front() else { break };
                queued_total -= 1;
                state.activate(u64::from(i)).map_err(core_err(step))?;
                running[w] += 1;
                admit_ms[i as usize] = now;
                queue_sum += now - arrival(i as usize);
                just_started.push(i);
            }
        }
        // Steady state: requests are left waiting (pool or local queues) after admission.
        let pooled: usize = pools.iter().map(Pool::len).sum();
        let waiting = queued_total > 0 || pooled > 0;

        let total_running: u32 = running.iter().sum();
        if total_running == 0 {
            if next < n {
                now = now.max(arrival(order[next]));
                continue;
            }
            if pooled == 0 && queued_total == 0 {
                break;
            }
            // taking turns, every decider gets a round before the group counts as stuck
            if (cfg.control.turns && idle_rounds + 1 < k_count)
                || (split.is_some() && idle_rounds == 0)
            {
                idle_rounds += 1;
                continue;
            }
            return Err(SimError::Stuck {
                policy: label.to_string(),
                step,
                pool: pooled,
            });
        }
        idle_rounds = 0;

        // 4. the step
        let (mut max, mut min, mut sum) = (0u64, u64::MAX, 0u64);
        for w in state.workers().iter().take(g) {
            let l = w.running_load;
            max = max.max(l);
            min = min.min(l);
            sum += l;
            if cfg.record_loads {
                loads.push(l);
            }
        }
        let mut t = cfg.step_a * max as f64 + cfg.step_b;
        let mut tf = cfg.step_a * sum as f64 / g as f64 + cfg.step_b;
        // c = 0 skips the term, so the paper's model is computed exactly as before it existed
        if cfg.step_c != 0.0 {
            let max_n = running.iter().copied().max().unwrap_or(0);
            t += cfg.step_c * f64::from(max_n);
            tf += cfg.step_c * f64::from(total_running) / g as f64;
        }
        busy_ms += t;
        fluid_ms += tf;
        tokens += u64::from(total_running);
        sum_imb += (max - min) as f64;
        sum_idle += (g as u64 * max - sum) as f64;
        // growth alone: rank g's load moves to L_g + n_g before finishes and placements
        let (mut grown_max, mut n_max, mut n_min) = (0u64, 0u32, u32::MAX);
        for (w, &n_w) in state.workers().iter().take(g).zip(&running) {
            grown_max = grown_max.max(w.running_load + u64::from(n_w));
            n_max = n_max.max(n_w);
            n_min = n_min.min(n_w);
        }
        let idle = (g as u64 * max - sum) as f64;
        let growth = (g as u64 * grown_max - (sum + u64::from(total_running))) as f64 - idle;
        all_growth += growth;
        all_spread += f64::from(n_max - n_min);
        if waiting {
            steady_idle += idle;
            steady_growth += growth;
            steady_spread += f64::from(n_max - n_min);
            steady_ms += t;
            steady_fluid_ms += tf;
            steady_steps += 1;
            steady_imb += (max - min) as f64;
            steady_tokens += u64::from(total_running);
            first_wait = first_wait.min(step as usize);
            last_wait = step as usize + 1;
        }
        state.advance_step();
        now += t;
        for i in just_started.drain(..) {
            first_ms[i as usize] = now;
            let o = u64::from(requests[i as usize].output_tokens.max(1));
            finishing.push(Reverse((step + o - 1, i)));
        }
        while let Some(&Reverse((s, i))) = finishing.peek() {
            if s > step {
                break;
            }
            finishing.pop();
            let info = state.remove(u64::from(i)).map_err(core_err(step))?;
            running[info.worker as usize] -= 1;
            let r = &requests[i as usize];
            let done = br_core::predict::Finished {
                prompt_tokens: r.prompt_tokens,
                prompt_hash: r.prompt_hash,
                output_tokens: r.output_tokens,
            };
            for policy in policies.iter_mut() {
                policy.observe_finished(&done);
            }
            finished += 1;
            if r.output_tokens > 1 {
                tpot.push((now - first_ms[i as usize]) / f64::from(r.output_tokens - 1));
            }
        }
        step += 1;
    }

    let steps = step;
    let per_step = |x: f64| if steps > 0 { x / steps as f64 } else { 0.0 };
    let rate = |tok: u64, ms: f64| {
        if ms > 0.0 {
            tok as f64 / (ms / 1000.0)
        } else {
            0.0
        }
    };
    let throughput = rate(tokens, busy_ms);
    let report = RunReport {
        policy: label.to_string(),
        workers: g,
        avg_imbalance: per_step(sum_imb),
        avg_barrier_idle: per_step(sum_idle),
        throughput_tok_s: throughput,
        steady_throughput_tok_s: if steady_ms > 0.0 {
            rate(steady_tokens, steady_ms)
        } else {
            throughput
        },
        fluid_throughput_tok_s: rate(tokens, fluid_ms),
        tpot_p50_ms: quantile(&mut tpot, 0.5),
        tpot_p95_ms: quantile(&mut tpot, 0.95),
        mean_queue_ms: if finished > 0 {
            queue_sum / finished as f64
        } else {
            0.0
        },
        steps,
        requests: finished,
    };
    Ok(RunOutcome {
        report,
        loads: cfg.record_loads.then(|| LoadSeries {
            policy: label.to_string(),
            workers: g,
            loads,
        }),
        waiting_steps: if first_wait == usize::MAX {
            0..0
        } else {
            first_wait..last_wait
        },
        wall: started.elapsed(),
        refused_reservations: refused,
        idle_flow: {
            let per = |x: f64| {
                if steady_steps > 0 {
                    x / steady_steps as f64
                } else {
                    0.0
                }
            };
            IdleFlow {
                steady_steps,
                mean_idle: per(steady_idle),
                mean_growth: per(steady_growth),
                mean_running_spread: per(steady_spread),
                run_growth: per_step(all_growth),
                run_running_spread: per_step(all_spread),
            }
        },
        steady_imbalance: if steady_steps > 0 {
            steady_imb / steady_steps as f64
        } else {
            per_step(sum_imb)
        },
        steady_fluid_tok_s: if steady_fluid_ms > 0.0 {
            rate(steady_tokens, steady_fluid_ms)
        } else {
            rate(tokens, fluid_ms)
        },
    })
}

/// What the deciders see (see [`ControlPlane`]): the true σ of `lag` steps ago, every
/// reservation made since, and each decider's own reservations of this step.
struct Views {
    lag: usize,
    /// The true state at the start of each of the last `lag + 1` steps, oldest first.
    history: VecDeque<ClusterState>,
    /// Reservations (by any decider) with the step they were made in, oldest first.
    log: VecDeque<(u64, RequestInfo)>,
    views: Vec<ClusterState>,
}

impl Views {
    fn new(lag: u32, deciders: usize) -> Views {
        Views {
            lag: lag as usize,
            history: VecDeque::new(),
            log: VecDeque::new(),
            views: vec![ClusterState::new(); deciders],
        }
    }

    fn begin_step(&mut self, step: u64, truth: &ClusterState) {
        self.history.push_back(truth.clone());
        while self.history.len() > self.lag + 1 {
            self.history.pop_front();
        }
        let since = step.saturating_sub(self.lag as u64);
        while self.log.front().is_some_and(|(s, _)| *s < since) {
            self.log.pop_front();
        }
        let mut common = self
            .history
            .front()
            .cloned()
            .unwrap_or_else(|| truth.clone());
        for (_, info) in &self.log {
            if !common.contains(info.key) {
                // refused only when the stale view shows its worker fenced, which the
                // simulated group never is
                let _ = common.reserve(info.clone());
            }
        }
        for v in &mut self.views {
            v.clone_from(&common);
        }
    }

    fn view(&self, decider: usize) -> &ClusterState {
        &self.views[decider]
    }

    /// Rank split: the ranks `decider` may not place on this step stop accepting in its view
    /// (their load still counts in its score). The next `begin_step` reopens them.
    fn close_ranks(&mut self, decider: usize, ranks: impl Iterator<Item = usize>) {
        for w in ranks {
            // every rank of the simulated group exists
            let _ = self.views[decider].set_accepting(w as WorkerId, false);
        }
    }

    fn admitted(&mut self, decider: usize, step: u64, info: &RequestInfo) {
        let _ = self.views[decider].reserve(info.clone());
        self.log.push_back((step, info.clone()));
    }
}

fn queued_info(entry: &PoolEntry, worker: WorkerId) -> RequestInfo {
    RequestInfo {
        key: entry.key,
        worker,
        prompt_tokens: entry.prompt_tokens,
        generated: 0,
        phase: Phase::Queued,
        prompt_hash: entry.prompt_hash,
        oracle_output: entry.oracle_output,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::parse_spec;

    fn req(t: f64, s: u32, o: u32) -> TraceRequest {
        TraceRequest {
            arrival_ms: Some(t),
            prompt_tokens: s,
            output_tokens: o,
            prompt_hash: None,
        }
    }

    fn cfg(workers: u32, slots: u32, a: f64, b: f64) -> EngineConfig {
        EngineConfig {
            workers,
            slots,
            step_a: a,
            step_b: b,
            step_c: 0.0,
            record_loads: true,
            control: ControlPlane::IDEAL,
        }
    }

    fn sim(reqs: &[TraceRequest], policy: &str, c: &EngineConfig) -> RunOutcome {
        let spec = parse_spec(policy, 1).expect("spec");
        let mut p = br_core::build_policy(&spec.config).expect("build");
        simulate(reqs, p.as_mut(), policy, c).expect("simulate")
    }

    fn sim_plane(reqs: &[TraceRequest], policy: &str, c: &EngineConfig) -> RunOutcome {
        let spec = parse_spec(policy, 1).expect("spec");
        let mut ps: Vec<_> = (0..c.control.deciders)
            .map(|_| br_core::build_policy(&spec.config).expect("build"))
            .collect();
        let mut refs: Vec<&mut dyn Policy> = ps.iter_mut().map(|p| p.as_mut() as _).collect();
        simulate_deciders(reqs, &mut refs, policy, c).expect("simulate")
    }

    fn saturated(n: u32) -> Vec<TraceRequest> {
        (0..n)
            .map(|i| req(0.0, 100 + (i * 7919) % 3000, 1 + (i * 104_729) % 200))
            .collect()
    }

    #[test]
    fn idle_flow_counts_growth_by_hand() {
        // rr over G = 2: requests 0 and 2 on rank 0, 1 on rank 1; all run 5 steps together.
        // Rank 0 (the max) grows 2 tokens a step, rank 1 one: growth adds
        // G·(max + 2) − (Σ + 3) − (G·max − Σ) = 1 token of idle per step, spread 1.
        let reqs = vec![req(0.0, 10, 5); 3];
        let out = sim(&reqs, "rr", &cfg(2, 2, 2e-4, 30.0));
        assert_eq!(out.report.steps, 5);
        let f = out.idle_flow;
        assert_eq!((f.run_growth, f.run_running_spread), (1.0, 1.0));
        assert_eq!(f.steady_steps, 0, "nothing waited");
        // idle = G·max − Σ = 2·(2·(10 + j)) − 3·(10 + j) = 10 + j for j = 0..5 (a token is
        // counted once written): mean 12 over the run
        assert_eq!(out.report.avg_barrier_idle, 12.0);
        // Saturated BR-0 offering every free slot (stage2_hold = never, the paper's Stage 2): while
        // requests wait a freed slot is refilled in the same step, so the ranks run (all but a
        // few steps) the same number of requests and growth adds next to nothing; on-arrival
        // queues (rr) leave unequal counts and growth adds more. (The default holds a slot
        // empty on a rank above the mean now and then, so there growth is not ~0.)
        let c = cfg(4, 4, 2e-4, 30.0);
        let (br0, rr) = (
            sim(&saturated(400), "br0:stage2_hold=never", &c),
            sim(&saturated(400), "rr", &c),
        );
        assert!(br0.idle_flow.steady_steps > 100 && rr.idle_flow.steady_steps > 100);
        assert!(
            br0.idle_flow.mean_growth.abs() < 0.01,
            "{:?}",
            br0.idle_flow
        );
        assert!(
            br0.idle_flow.mean_running_spread < 0.01,
            "{:?}",
            br0.idle_flow
        );
        assert!(
            rr.idle_flow.mean_growth > 10.0 * br0.idle_flow.mean_growth.abs(),
            "{:?}",
            rr.idle_flow
        );
    }

    #[test]
    fn two_deciders_collide_on_free_slots_and_the_refused_rejoin_their_pool() {
        let reqs = saturated(400);
        let mut c = cfg(4, 4, 2e-4, 30.0);
        c.control = ControlPlane {
            telemetry_lag_steps: 0,
            deciders: 2,
            turns: false,
            rank_split: None,
        };
        for policy in ["br0", "brh", "jsq"] {
            let out = sim_plane(&reqs, policy, &c);
            // nothing lost, nothing run twice: every request finished exactly once
            assert_eq!(out.report.requests, 400, "{policy}");
            if policy.starts_with("br") {
                // both pools see the same free slots at each step: some reservations collide
                assert!(out.refused_reservations > 0, "{policy}");
            } else {
                assert_eq!(
                    out.refused_reservations, 0,
                    "on-arrival queues at the worker"
                );
            }
        }
    }

    #[test]
    fn deciders_taking_turns_never_collide_and_lose_nothing() {
        let reqs = saturated(400);
        let mut c = cfg(4, 4, 2e-4, 30.0);
        c.control = ControlPlane {
            telemetry_lag_steps: 0,
            deciders: 2,
            turns: true,
            rank_split: None,
        };
        let mut together = c;
        together.control.turns = false;
        for policy in ["br0", "brh"] {
            let out = sim_plane(&reqs, policy, &c);
            assert_eq!(out.report.requests, 400, "{policy}");
            // one decider admits per round and sees every earlier admission: no collision
            assert_eq!(out.refused_reservations, 0, "{policy}");
            // and the turns change what is decided (else the flag is not modelled)
            assert_ne!(
                out.report,
                sim_plane(&reqs, policy, &together).report,
                "{policy}"
            );
        }
    }

    #[test]
    fn deciders_splitting_ranks_never_collide_on_their_own_ranks_and_lose_nothing() {
        let reqs = saturated(400);
        let mut c = cfg(4, 4, 2e-4, 30.0);
        c.control = ControlPlane {
            telemetry_lag_steps: 0,
            deciders: 2,
            turns: false,
            // no takeover within the run: each decider places only on its own ranks
            rank_split: Some(1000),
        };
        let mut together = c;
        together.control.rank_split = None;
        for policy in ["br0", "brh"] {
            let out = sim_plane(&reqs, policy, &c);
            assert_eq!(out.report.requests, 400, "{policy}");
            assert_eq!(out.refused_reservations, 0, "{policy}");
            let apart = sim_plane(&reqs, policy, &together);
            assert!(apart.refused_reservations > 0, "{policy}");
            assert_ne!(out.report, apart.report, "{policy}");
        }
    }

    #[test]
    fn a_decider_without_ranks_of_its_own_places_by_takeover() {
        // G = 1, K = 2: decider 1 owns no rank, so only the takeover rule serves its half of
        // the arrivals (what keeps a group served when the owner of some ranks is dead)
        let reqs = saturated(60);
        let mut c = cfg(1, 4, 2e-4, 30.0);
        c.control = ControlPlane {
            telemetry_lag_steps: 0,
            deciders: 2,
            turns: false,
            rank_split: Some(2),
        };
        for policy in ["br0", "brh"] {
            let out = sim_plane(&reqs, policy, &c);
            assert_eq!(out.report.requests, 60, "{policy}");
        }
    }

    #[test]
    fn telemetry_lag_loses_nothing_and_one_ideal_decider_is_the_plain_engine() {
        let reqs = saturated(300);
        let ideal = cfg(4, 8, 2e-4, 30.0);
        for policy in ["br0", "brh", "jsq", "mintok"] {
            let plain = sim(&reqs, policy, &ideal);
            let via_planes = sim_plane(&reqs, policy, &ideal);
            assert_eq!(plain.report, via_planes.report, "{policy}");
            let mut lagged = ideal;
            lagged.control.telemetry_lag_steps = 5;
            let out = sim_plane(&reqs, policy, &lagged);
            assert_eq!(out.report.requests, 300, "{policy}");
            assert_eq!(
                out.refused_reservations, 0,
                "{policy}: a stale view only under-counts slots"
            );
            if policy == "br0" {
                // a lagged view sees finishes and progress late: the same policy must decide
                // differently somewhere (else the lag is not modelled at all)
                assert_ne!(out.report, plain.report, "{policy}");
            }
        }
    }

    #[test]
    fn a_lagged_view_is_the_truth_of_lag_steps_ago_plus_every_reservation_since() {
        let info = |key: u64, worker: u32| RequestInfo {
            key,
            worker,
            prompt_tokens: 100,
            generated: 0,
            phase: Phase::Queued,
            prompt_hash: None,
            oracle_output: None,
        };
        let mut truth = ClusterState::with_workers(&[4, 4]);
        let mut views = Views::new(2, 2);
        // step 0: request 1 is running on worker 0
        truth.reserve(info(1, 0)).unwrap();
        truth.activate(1).unwrap();
        views.begin_step(0, &truth);
        views.admitted(0, 0, &info(2, 1));
        truth.reserve(info(2, 1)).unwrap();
        assert!(
            views.view(0).contains(2),
            "a decider sees its own reservation at once"
        );
        assert!(
            !views.view(1).contains(2),
            "the other decider sees it only next step"
        );
        truth.advance_step();
        // step 1: request 1 has written one token, request 3 is reserved by decider 1
        views.begin_step(1, &truth);
        assert!(
            views.view(1).contains(2),
            "one step later every decider sees it"
        );
        views.admitted(1, 1, &info(3, 0));
        truth.reserve(info(3, 0)).unwrap();
        truth.advance_step();
        truth.remove(1).unwrap(); // request 1 finishes
        // step 2: with a lag of 2 the view is the truth of step 0 plus reservations 2 and 3
        views.begin_step(2, &truth);
        let v = views.view(0);
        assert_eq!(v.get(1).map(|r| r.generated), Some(0), "progress lags");
        assert!(v.contains(1), "the finish is not seen yet");
        assert!(v.contains(2) && v.contains(3));
        // step 4: the finish of step 1 is visible, reservations older than the lag come from
        // the lagged truth itself
        truth.advance_step();
        views.begin_step(3, &truth);
        truth.advance_step();
        views.begin_step(4, &truth);
        let v = views.view(1);
        assert!(!v.contains(1));
        assert!(v.contains(2) && v.contains(3));
    }

    #[test]
    fn one_request_step_model() {
        // loads 100, 101, 102 at its three steps; T = load ms
        let out = sim(&[req(0.0, 100, 3)], "jsq", &cfg(1, 4, 1.0, 0.0));
        let r = &out.report;
        assert_eq!((r.steps, r.requests), (3, 1));
        assert!(
            (r.tpot_p50_ms - (101.0 + 102.0) / 2.0).abs() < 1e-9,
            "{r:?}"
        );
        assert!((r.throughput_tok_s - 3.0 / 0.303).abs() < 1e-9, "{r:?}");
        assert_eq!(r.avg_imbalance, 0.0);
        assert_eq!(r.mean_queue_ms, 0.0);
        assert_eq!(out.loads.expect("loads").loads, vec![100, 101, 102]);
    }

    #[test]
    fn slots_queue_fifo_and_idle_gaps_are_skipped() {
        // one worker, one slot: the second request waits for the first (2 steps of 10 ms)
        let reqs = [req(0.0, 10, 2), req(0.0, 10, 2), req(1_000_000.0, 10, 1)];
        let out = sim(&reqs, "rr", &cfg(1, 1, 0.0, 10.0));
        let r = &out.report;
        assert_eq!((r.steps, r.requests), (5, 3));
        assert!((r.mean_queue_ms - 20.0 / 3.0).abs() < 1e-9, "{r:?}");
        // 5 tokens in 50 ms of steps; the idle gap before the third arrival is not counted
        assert!((r.throughput_tok_s - 100.0).abs() < 1e-9, "{r:?}");
        assert_eq!(out.waiting_steps, 0..2);
        assert!((r.tpot_p95_ms - 10.0).abs() < 1e-9);
    }

    #[test]
    fn imbalance_and_barrier_idle() {
        // rr puts 1000 on worker 0 and 100 on worker 1; one step each
        let reqs = [req(0.0, 1000, 1), req(0.0, 100, 1)];
        let out = sim(&reqs, "rr", &cfg(2, 4, 1e-3, 1.0));
        let r = &out.report;
        assert_eq!(r.steps, 1);
        assert_eq!(r.avg_imbalance, 900.0);
        assert_eq!(r.avg_barrier_idle, 900.0);
        // actual step 2 ms, fluid 1.55 ms
        assert!((r.throughput_tok_s - 1000.0).abs() < 1e-9);
        assert!((r.fluid_throughput_tok_s - 2.0 / 1.55e-3).abs() < 1e-6);
    }

    #[test]
    fn every_policy_completes_every_request_within_capacity() {
        let reqs: Vec<TraceRequest> = (0..300u32)
            .map(|i| {
                req(
                    f64::from(i) * 7.0,
                    100 + (i * 7919) % 3000,
                    1 + (i * 104_729) % 200,
                )
            })
            .collect();
        let total: u64 = reqs.iter().map(|r| u64::from(r.output_tokens)).sum();
        for name in br_core::PolicyKind::names() {
            for arrival_scale in [0.0, 1.0] {
                let rs: Vec<TraceRequest> = reqs
                    .iter()
                    .map(|r| TraceRequest {
                        arrival_ms: r.arrival_ms.map(|t| t * arrival_scale),
                        ..*r
                    })
                    .collect();
                let out = sim(&rs, name, &cfg(4, 16, 2e-4, 30.0));
                let r = &out.report;
                assert_eq!(r.requests, 300, "{name}");
                let loads = out.loads.expect("loads");
                assert_eq!(loads.steps() as u64, r.steps);
                // every step emits at most G·B tokens, and all tokens are emitted
                let max_tokens = r.steps * 4 * 16;
                assert!(total <= max_tokens, "{name}");
                let busy_s = total as f64 / r.throughput_tok_s;
                let fluid_s = total as f64 / r.fluid_throughput_tok_s;
                assert!(fluid_s <= busy_s + 1e-9, "{name}: fluid is a lower bound");
                assert!(r.tpot_p50_ms <= r.tpot_p95_ms);
            }
        }
    }

    /// An independent, deliberately naive model of the same semantics for round-robin
    /// (request k in arrival order goes to worker k mod G), written without br-core; `c` is the
    /// step's ms per running request on the busiest rank.
    fn reference_rr(
        reqs: &[TraceRequest],
        g: usize,
        b: usize,
        a: f64,
        b0: f64,
        c: f64,
    ) -> RunReport {
        let mut order: Vec<usize> = (0..reqs.len()).collect();
        let t = |i: usize| reqs[i].arrival_ms.unwrap_or(0.0);
        order.sort_by(|&x, &y| t(x).total_cmp(&t(y)));
        let mut queues: Vec<VecDeque<usize>> = vec![VecDeque::new(); g];
        // active: (request, generated, first token time)
        let mut active: Vec<Vec<(usize, u32, f64)>> = vec![Vec::new(); g];
        let (mut now, mut next, mut steps) = (0.0f64, 0usize, 0u64);
        let (mut busy, mut fluid, mut tokens, mut steady_ms, mut steady_tok) =
            (0.0, 0.0, 0u64, 0.0, 0u64);
        let (mut imb, mut idle, mut queue_sum) = (0.0, 0.0, 0.0);
        let mut tpots = Vec::new();
        let mut routed = 0usize;
        loop {
            while next < order.len() && t(order[next]) <= now {
                queues[routed % g].push_back(order[next]);
                routed += 1;
                next += 1;
            }
            for w in 0..g {
                while active[w].len() < b {
                    let Some(i) = queues[w].pop_front() else {
                        break;
                    };
                    queue_sum += now - t(i);
                    active[w].push((i, 0, f64::NAN));
                }
            }
            let waiting = queues.iter().any(|q| !q.is_empty());
            if active.iter().all(Vec::is_empty) {
                if next < order.len() {
                    now = t(order[next]);
                    continue;
                }
                break;
            }
            let loads: Vec<f64> = active
                .iter()
                .map(|v| {
                    v.iter()
                        .map(|&(i, j, _)| f64::from(reqs[i].prompt_tokens + j))
                        .sum()
                })
                .collect();
            let max = loads.iter().cloned().fold(0.0, f64::max);
            let min = loads.iter().cloned().fold(f64::INFINITY, f64::min);
            let sum: f64 = loads.iter().sum();
            let n: u64 = active.iter().map(|v| v.len() as u64).sum();
            let max_n = active.iter().map(Vec::len).max().unwrap_or(0) as f64;
            let step = a * max + c * max_n + b0;
            busy += step;
            fluid += a * sum / g as f64 + c * n as f64 / g as f64 + b0;
            tokens += n;
            imb += max - min;
            idle += g as f64 * max - sum;
            if waiting {
                steady_ms += step;
                steady_tok += n;
            }
            now += step;
            for v in active.iter_mut() {
                for e in v.iter_mut() {
                    e.1 += 1;
                    if e.1 == 1 {
                        e.2 = now;
                    }
                }
                v.retain(|&(i, j, first)| {
                    let o = reqs[i].output_tokens;
                    if j < o {
                        return true;
                    }
                    if o > 1 {
                        tpots.push((now - first) / f64::from(o - 1));
                    }
                    false
                });
            }
            steps += 1;
        }
        // Nearest rank (br_core::stats's definition), computed independently on purpose.
        tpots.sort_by(f64::total_cmp);
        let q = |p: f64| tpots[((p * tpots.len() as f64).ceil() as usize).max(1) - 1];
        RunReport {
            policy: "rr".into(),
            workers: g,
            avg_imbalance: imb / steps as f64,
            avg_barrier_idle: idle / steps as f64,
            throughput_tok_s: tokens as f64 / (busy / 1000.0),
            steady_throughput_tok_s: steady_tok as f64 / (steady_ms / 1000.0),
            fluid_throughput_tok_s: tokens as f64 / (fluid / 1000.0),
            tpot_p50_ms: q(0.5),
            tpot_p95_ms: q(0.95),
            mean_queue_ms: queue_sum / reqs.len() as f64,
            steps,
            requests: reqs.len() as u64,
        }
    }

    #[test]
    fn engine_matches_an_independent_model() {
        // timed arrivals that overload 3 workers x 4 slots part of the time
        let reqs: Vec<TraceRequest> = (0..400u32)
            .map(|i| {
                req(
                    f64::from(i) * 37.0 + f64::from((i * 7919) % 50),
                    50 + (i * 7919) % 2500,
                    1 + (i * 104_729) % 90,
                )
            })
            .collect();
        let got = sim(&reqs, "rr", &cfg(3, 4, 1e-3, 5.0)).report;
        let want = reference_rr(&reqs, 3, 4, 1e-3, 5.0, 0.0);
        assert_close(&got, &want);
        // with a request term: the step pays c per request on the busiest rank, the fluid
        // limit c per request of the mean
        let mut with_c = cfg(3, 4, 1e-3, 5.0);
        with_c.step_c = 0.7;
        let got_c = sim(&reqs, "rr", &with_c).report;
        let want_c = reference_rr(&reqs, 3, 4, 1e-3, 5.0, 0.7);
        assert_close(&got_c, &want_c);
        assert!(got_c.throughput_tok_s < got.throughput_tok_s);
        assert!(want.steady_throughput_tok_s > 0.0 && want.mean_queue_ms > 0.0);
    }

    fn assert_close(got: &RunReport, want: &RunReport) {
        assert_eq!(got.steps, want.steps);
        assert_eq!(got.requests, want.requests);
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-9 * y.abs().max(1.0);
        for (name, x, y) in [
            ("imbalance", got.avg_imbalance, want.avg_imbalance),
            ("idle", got.avg_barrier_idle, want.avg_barrier_idle),
            ("tput", got.throughput_tok_s, want.throughput_tok_s),
            (
                "steady",
                got.steady_throughput_tok_s,
                want.steady_throughput_tok_s,
            ),
            (
                "fluid",
                got.fluid_throughput_tok_s,
                want.fluid_throughput_tok_s,
            ),
            ("tpot50", got.tpot_p50_ms, want.tpot_p50_ms),
            ("tpot95", got.tpot_p95_ms, want.tpot_p95_ms),
            ("queue", got.mean_queue_ms, want.mean_queue_ms),
        ] {
            assert!(close(x, y), "{name}: engine {x} vs reference {y}");
        }
    }

    #[test]
    fn a_saturated_group_pays_c_times_b_on_every_full_step() {
        // every rank full for the whole run (equal requests, a multiple of G·B): max n = B at
        // every step, so c adds exactly c·B per step and nothing else changes
        let reqs: Vec<TraceRequest> = (0..64).map(|_| req(0.0, 500, 20)).collect();
        let plain = sim(&reqs, "rr", &cfg(4, 16, 2e-4, 30.0)).report;
        let mut c = cfg(4, 16, 2e-4, 30.0);
        c.step_c = 0.5;
        let with_c = sim(&reqs, "rr", &c).report;
        assert_eq!(
            (with_c.steps, with_c.requests),
            (plain.steps, plain.requests)
        );
        assert_eq!(with_c.avg_imbalance, plain.avg_imbalance);
        let per_step = |r: &RunReport| r.steps as f64 * 4.0 * 16.0 / r.throughput_tok_s * 1e3;
        let extra = per_step(&with_c) / with_c.steps as f64 - per_step(&plain) / plain.steps as f64;
        assert!((extra - 0.5 * 16.0).abs() < 1e-9, "{extra}");
    }

    #[test]
    fn deterministic() {
        let reqs: Vec<TraceRequest> = (0..200u32)
            .map(|i| req(0.0, 500 + (i * 31) % 4000, 50 + (i * 17) % 300))
            .collect();
        for name in ["random", "p2c", "br0", "brh"] {
            let a = sim(&reqs, name, &cfg(4, 8, 2e-4, 30.0)).report;
            let b = sim(&reqs, name, &cfg(4, 8, 2e-4, 30.0)).report;
            assert_eq!(a, b, "{name}");
        }
    }
}
