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
//! # Colocated prefill ([`Colocated`], `--colocated`)
//! Without it the model is a decode tier: a request's prompt is already in KV when it starts
//! (prefill ran elsewhere) and its first step writes its first token. With it, step 3 changes:
//! each rank runs a prefill budget of `chunk` prompt tokens per step, first come, first served:
//! first the prompt it is part way through, then requests from its queue while it has free
//! slots and budget left. A request holds its slot from its first chunk; the step that runs its
//! last chunk writes its first token (σ learns of it then, as it does from a live worker's first
//! progress report: until then it is a reservation there), and its KV grows by each chunk as
//! the chunk completes. The step takes `a·max L + p·max P + c·max n + b` with P_g the prompt
//! tokens rank g runs in it, L_g counting the chunks completed before the step and n_g the
//! requests that write a token in it. TTFT is the time from arrival to the end of the step that
//! writes the first token. The decode-only path is the same code without the prefill state,
//! computed by the same instructions as before colocated prefill existed.
//!
//! When nothing runs and nothing can start, the clock skips to the next arrival. The per-step
//! cost is O(G + running) plus the policy's own work; no per-token hashing (finishes are found
//! through a heap keyed by the step they happen in).
//!
//! # Metrics (see [`RunReport`])
//! Imbalance, barrier idle and the balance ratio (each rank's share of the step time,
//! `a·L_g + p·P_g + c·n_g`, summed over ranks and divided by G times the largest) are averaged
//! over steps; throughput is output tokens over the
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
use br_core::{
    ClusterState, Mode, Phase, Policy, Pool, PoolEntry, RequestInfo, WorkerId, WorkerInfo,
};

use crate::plot::LoadSeries;
use crate::report::{RunReport, SteadyExtra};
use crate::trace::TraceRequest;

mod config;
mod outcome;
mod prefill;
mod views;

pub use config::{Colocated, ControlPlane, EngineConfig};
pub use outcome::{BarrierSplit, IdleFlow, RunOutcome, SimError};
use prefill::Prefill;
use views::{Views, queued_info};

/// Simulates `cfg.control.deciders` deciders over `requests` (any order; arrival times `None`
/// count as 0), one policy instance each (built from the same config; `policies.len()` must
/// equal K).
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
    let mut prefill = cfg.colocated.map(|co| Prefill::new(co, g));
    let mut ttft: Vec<f64> = Vec::with_capacity(n);

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
    let (mut sum_balance, mut steady_balance) = (0.0f64, 0.0f64);
    let mut beyond = BarrierSplit::default();
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
                expected_output: r.expected_output,
                class: r.class_id(),
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
                    expected_output: r.expected_output,
                    class: r.class_id(),
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

        // 3. local FIFO admission into free slots (colocated: within the prefill budget)
        if let Some(pf) = prefill.as_mut() {
            for (w, q) in queues.iter_mut().enumerate() {
                let prompt = |i: u32| requests[i as usize].prompt_tokens;
                let mut budget = pf.begin(w, prompt, &mut just_started);
                while running[w] < cfg.slots {
                    let Some(&i) = q.front() else { break };
                    if budget == 0 && prompt(i) > 0 {
                        break;
                    }
                    q.pop_front();
                    queued_total -= 1;
                    running[w] += 1;
                    admit_ms[i as usize] = now;
                    queue_sum += now - arrival(i as usize);
                    budget = pf.start(w, i, prompt(i), budget, &mut just_started);
                }
            }
        } else {
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

        // 4. the step. Per rank: L_g the KV it reads, n_g the tokens it writes (its running
        // requests), P_g the prompt tokens it prefills (colocated only; else 0).
        let rank = |w: usize, info: &WorkerInfo| match &prefill {
            None => (info.running_load, running[w], 0u64),
            Some(pf) => pf.rank(w, info),
        };
        let step_p = cfg.colocated.map_or(0.0, |co| co.step_p);
        let (mut max, mut min, mut sum) = (0u64, u64::MAX, 0u64);
        let (mut max_p, mut sum_p, mut written) = (0u64, 0u64, 0u32);
        // the balance ratio: each rank's share of the step time, a·L + p·P + c·n
        let (mut work_max, mut work_sum) = (0.0f64, 0.0f64);
        for (w, info) in state.workers().iter().take(g).enumerate() {
            let (l, n_w, p_w) = rank(w, info);
            max = max.max(l);
            min = min.min(l);
            sum += l;
            max_p = max_p.max(p_w);
            sum_p += p_w;
            written += n_w;
            let work = cfg.step_a * l as f64 + step_p * p_w as f64 + cfg.step_c * f64::from(n_w);
            work_max = work_max.max(work);
            work_sum += work;
            if cfg.record_loads {
                loads.push(l);
            }
        }
        let balance = if work_max > 0.0 {
            work_sum / (g as f64 * work_max)
        } else {
            1.0
        };
        sum_balance += balance;
        let mut t = cfg.step_a * max as f64 + cfg.step_b;
        let mut tf = cfg.step_a * sum as f64 / g as f64 + cfg.step_b;
        // p (colocated only) and c = 0 skip their terms, so the decode-only and the paper's
        // model are computed exactly as before the terms existed. The fluid time balances
        // every term: with prefill it is the aligned limit (every rank prefills the same in
        // every step, and reads the same KV).
        if step_p != 0.0 {
            t += step_p * max_p as f64;
            tf += step_p * sum_p as f64 / g as f64;
        }
        let mut max_n = 0u32;
        if cfg.step_c != 0.0 {
            for (w, info) in state.workers().iter().take(g).enumerate() {
                max_n = max_n.max(rank(w, info).1);
            }
            t += cfg.step_c * f64::from(max_n);
            tf += cfg.step_c * f64::from(written) / g as f64;
        }
        busy_ms += t;
        fluid_ms += tf;
        let gf = g as f64;
        beyond.kv_ms += cfg.step_a * (max as f64 - sum as f64 / gf);
        beyond.prefill_ms += step_p * (max_p as f64 - sum_p as f64 / gf);
        if cfg.step_c != 0.0 {
            beyond.request_ms += cfg.step_c * (f64::from(max_n) - f64::from(written) / gf);
        }
        beyond.mean_prefill_tokens += sum_p as f64 / gf;
        beyond.max_prefill_tokens += max_p as f64;
        tokens += u64::from(written);
        sum_imb += (max - min) as f64;
        sum_idle += (g as u64 * max - sum) as f64;
        // growth alone: rank g's load moves to L_g + n_g + P_g before finishes and placements
        let (mut grown_max, mut n_max, mut n_min) = (0u64, 0u32, u32::MAX);
        for (w, info) in state.workers().iter().take(g).enumerate() {
            let (l, n_w, p_w) = rank(w, info);
            grown_max = grown_max.max(l + u64::from(n_w) + p_w);
            n_max = n_max.max(n_w);
            n_min = n_min.min(n_w);
        }
        let idle = (g as u64 * max - sum) as f64;
        let growth = (g as u64 * grown_max - (sum + u64::from(written) + sum_p)) as f64 - idle;
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
            steady_balance += balance;
            steady_tokens += u64::from(written);
            first_wait = first_wait.min(step as usize);
            last_wait = step as usize + 1;
        }
        if let Some(pf) = prefill.as_mut() {
            // the prompts whose last chunk ran write their first token: σ learns they run
            for &i in &just_started {
                state.activate(u64::from(i)).map_err(core_err(step))?;
            }
            pf.end_step();
        }
        state.advance_step();
        now += t;
        for i in just_started.drain(..) {
            first_ms[i as usize] = now;
            ttft.push(now - arrival(i as usize));
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
                expected_output: r.expected_output,
                class: r.class_id(),
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
        ttft_p50_ms: quantile(&mut ttft, 0.5),
        ttft_p95_ms: quantile(&mut ttft, 0.95),
        ttft_p99_ms: quantile(&mut ttft, 0.99),
        avg_balance: per_step(sum_balance),
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
        barrier: BarrierSplit {
            kv_ms: per_step(beyond.kv_ms),
            prefill_ms: per_step(beyond.prefill_ms),
            request_ms: per_step(beyond.request_ms),
            mean_prefill_tokens: per_step(beyond.mean_prefill_tokens),
            max_prefill_tokens: per_step(beyond.max_prefill_tokens),
        },
        steady_balance: if steady_steps > 0 {
            steady_balance / steady_steps as f64
        } else {
            per_step(sum_balance)
        },
        steady_fluid_tok_s: if steady_fluid_ms > 0.0 {
            rate(steady_tokens, steady_fluid_ms)
        } else {
            rate(tokens, fluid_ms)
        },
    })
}

#[cfg(test)]
mod tests;
