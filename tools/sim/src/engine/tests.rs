use super::*;
use crate::spec::parse_spec;

fn req(t: f64, s: u32, o: u32) -> TraceRequest {
    TraceRequest {
        arrival_ms: Some(t),
        prompt_tokens: s,
        output_tokens: o,
        prompt_hash: None,
        expected_output: None,
        class: None,
    }
}

fn cfg(workers: u32, slots: u32, a: f64, b: f64) -> EngineConfig {
    EngineConfig {
        workers,
        slots,
        step_a: a,
        step_b: b,
        step_c: 0.0,
        colocated: None,
        record_loads: true,
        control: ControlPlane::IDEAL,
    }
}

fn sim(reqs: &[TraceRequest], policy: &str, c: &EngineConfig) -> RunOutcome {
    let spec = parse_spec(policy, 1).expect("spec");
    let mut p = br_core::build_policy(&spec.config).expect("build");
    simulate_deciders(reqs, &mut [p.as_mut()], policy, c).expect("simulate")
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
        expected_output: None,
        class: None,
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
    // decode-only with c = 0 the balance ratio is the KV balance: mean 550 over max 1,000
    assert!((r.avg_balance - 0.55).abs() < 1e-12, "{r:?}");
    assert!(
        (out.steady_balance - 0.55).abs() < 1e-12,
        "nothing waited: the whole run"
    );
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
                    ..r.clone()
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
/// step's ms per running request on the busiest rank, `prefill` colocated prefill's (p, chunk)
/// (`None`: decode only, every prompt is KV when its request starts).
fn reference_rr(
    reqs: &[TraceRequest],
    g: usize,
    b: usize,
    a: f64,
    b0: f64,
    c: f64,
    prefill: Option<(f64, u32)>,
) -> RunReport {
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    let t = |i: usize| reqs[i].arrival_ms.unwrap_or(0.0);
    order.sort_by(|&x, &y| t(x).total_cmp(&t(y)));
    let mut queues: Vec<VecDeque<usize>> = vec![VecDeque::new(); g];
    // active, in the order they took their slot: (request, prompt tokens in KV, generated,
    // first token time, prompt tokens run this step)
    type Active = (usize, u32, u32, f64, u32);
    let mut active: Vec<Vec<Active>> = vec![Vec::new(); g];
    let (mut now, mut next, mut steps) = (0.0f64, 0usize, 0u64);
    let (mut busy, mut fluid, mut tokens, mut steady_ms, mut steady_tok) =
        (0.0, 0.0, 0u64, 0.0, 0u64);
    let (mut imb, mut idle, mut queue_sum, mut balance) = (0.0, 0.0, 0.0, 0.0);
    let (mut tpots, mut ttfts) = (Vec::new(), Vec::new());
    let mut routed = 0usize;
    let prompt = |i: usize| reqs[i].prompt_tokens;
    let (p, chunk) = prefill.unwrap_or((0.0, u32::MAX));
    loop {
        while next < order.len() && t(order[next]) <= now {
            queues[routed % g].push_back(order[next]);
            routed += 1;
            next += 1;
        }
        for w in 0..g {
            // the budget goes to the slots' prompts in slot order, then to new requests
            let mut budget = chunk;
            for e in active[w].iter_mut() {
                e.4 = (prompt(e.0) - e.1).min(budget);
                budget -= e.4;
            }
            while active[w].len() < b {
                let Some(&i) = queues[w].front() else {
                    break;
                };
                if prefill.is_some() && budget == 0 && prompt(i) > 0 {
                    break;
                }
                queues[w].pop_front();
                queue_sum += now - t(i);
                if prefill.is_some() {
                    let x = prompt(i).min(budget);
                    budget -= x;
                    active[w].push((i, 0, 0, f64::NAN, x));
                } else {
                    active[w].push((i, prompt(i), 0, f64::NAN, 0));
                }
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
        // a request writes a token once its whole prompt is in KV (after this step's chunk)
        let writes = |e: &Active| e.1 + e.4 == prompt(e.0);
        let loads: Vec<f64> = active
            .iter()
            .map(|v| v.iter().map(|e| f64::from(e.1 + e.2)).sum())
            .collect();
        let prefills: Vec<f64> = active
            .iter()
            .map(|v| v.iter().map(|e| f64::from(e.4)).sum())
            .collect();
        let counts: Vec<f64> = active
            .iter()
            .map(|v| v.iter().filter(|e| writes(e)).count() as f64)
            .collect();
        let max = loads.iter().cloned().fold(0.0, f64::max);
        let min = loads.iter().cloned().fold(f64::INFINITY, f64::min);
        let sum: f64 = loads.iter().sum();
        let max_p = prefills.iter().cloned().fold(0.0, f64::max);
        let sum_p: f64 = prefills.iter().sum();
        let n: f64 = counts.iter().sum();
        let max_n = counts.iter().cloned().fold(0.0, f64::max);
        let step = a * max + p * max_p + c * max_n + b0;
        let work: Vec<f64> = (0..g)
            .map(|w| a * loads[w] + p * prefills[w] + c * counts[w])
            .collect();
        let max_work = work.iter().cloned().fold(0.0, f64::max);
        balance += if max_work > 0.0 {
            work.iter().sum::<f64>() / (g as f64 * max_work)
        } else {
            1.0
        };
        busy += step;
        fluid += a * sum / g as f64 + p * sum_p / g as f64 + c * n / g as f64 + b0;
        tokens += n as u64;
        imb += max - min;
        idle += g as f64 * max - sum;
        if waiting {
            steady_ms += step;
            steady_tok += n as u64;
        }
        now += step;
        for v in active.iter_mut() {
            for e in v.iter_mut() {
                let writes = e.1 + e.4 == prompt(e.0);
                e.1 += e.4;
                e.4 = 0;
                if writes {
                    e.2 += 1;
                    if e.2 == 1 {
                        e.3 = now;
                        ttfts.push(now - t(e.0));
                    }
                }
            }
            v.retain(|&(i, _, j, first, _)| {
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
    let q = |xs: &mut Vec<f64>, p: f64| {
        xs.sort_by(f64::total_cmp);
        xs[((p * xs.len() as f64).ceil() as usize).max(1) - 1]
    };
    RunReport {
        policy: "rr".into(),
        workers: g,
        avg_imbalance: imb / steps as f64,
        avg_barrier_idle: idle / steps as f64,
        throughput_tok_s: tokens as f64 / (busy / 1000.0),
        steady_throughput_tok_s: steady_tok as f64 / (steady_ms / 1000.0),
        fluid_throughput_tok_s: tokens as f64 / (fluid / 1000.0),
        tpot_p50_ms: q(&mut tpots, 0.5),
        tpot_p95_ms: q(&mut tpots, 0.95),
        ttft_p50_ms: q(&mut ttfts, 0.5),
        ttft_p95_ms: q(&mut ttfts, 0.95),
        ttft_p99_ms: q(&mut ttfts, 0.99),
        avg_balance: balance / steps as f64,
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
    let want = reference_rr(&reqs, 3, 4, 1e-3, 5.0, 0.0, None);
    assert_close(&got, &want);
    // with a request term: the step pays c per request on the busiest rank, the fluid
    // limit c per request of the mean
    let mut with_c = cfg(3, 4, 1e-3, 5.0);
    with_c.step_c = 0.7;
    let got_c = sim(&reqs, "rr", &with_c).report;
    let want_c = reference_rr(&reqs, 3, 4, 1e-3, 5.0, 0.7, None);
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
        ("ttft50", got.ttft_p50_ms, want.ttft_p50_ms),
        ("ttft95", got.ttft_p95_ms, want.ttft_p95_ms),
        ("ttft99", got.ttft_p99_ms, want.ttft_p99_ms),
        ("balance", got.avg_balance, want.avg_balance),
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

fn colocated(mut c: EngineConfig, step_p: f64, chunk: u32) -> EngineConfig {
    c.colocated = Some(Colocated { step_p, chunk });
    c
}

#[test]
fn colocated_engine_matches_the_independent_model() {
    // the same timed arrivals, prompts up to 2,550 tokens against chunks of 1,000 and 600:
    // prompts split over steps, several prompts share a step's budget, and slots wait for it
    let reqs: Vec<TraceRequest> = (0..400u32)
        .map(|i| {
            req(
                f64::from(i) * 37.0 + f64::from((i * 7919) % 50),
                50 + (i * 7919) % 2500,
                1 + (i * 104_729) % 90,
            )
        })
        .collect();
    for (p, chunk, c) in [(0.01, 1000, 0.0), (0.002, 600, 0.7), (0.0, 1000, 0.0)] {
        let mut cf = colocated(cfg(3, 4, 1e-3, 5.0), p, chunk);
        cf.step_c = c;
        let got = sim(&reqs, "rr", &cf).report;
        let want = reference_rr(&reqs, 3, 4, 1e-3, 5.0, c, Some((p, chunk)));
        assert_close(&got, &want);
    }
    // a zero-token prompt needs no budget: it writes its first token in its first step
    let mut odd = reqs.clone();
    odd[7].prompt_tokens = 0;
    odd[8].prompt_tokens = 0;
    let cf = colocated(cfg(3, 4, 1e-3, 5.0), 0.01, 1000);
    assert_close(
        &sim(&odd, "rr", &cf).report,
        &reference_rr(&odd, 3, 4, 1e-3, 5.0, 0.0, Some((0.01, 1000))),
    );
}

#[test]
fn a_colocated_prompt_runs_every_chunk_before_its_first_token() {
    // a 10,000-token prompt with a 4,096-token chunk: chunks of 4,096, 4,096 and 1,808 in
    // steps 0..3, the first token at the end of step 2, then two decode steps
    let (a, b, p) = (1e-3, 10.0, 0.01);
    let out = sim(
        &[req(0.0, 10_000, 3)],
        "rr",
        &colocated(cfg(1, 4, a, b), p, 4096),
    );
    let r = &out.report;
    assert_eq!((r.steps, r.requests), (5, 1));
    // the KV each step reads: the chunks before it, then the prompt and the tokens written
    assert_eq!(
        out.loads.expect("loads").loads,
        vec![0, 4096, 8192, 10_001, 10_002]
    );
    let step = |l: f64, prefill: f64| a * l + p * prefill + b;
    let ttft = step(0.0, 4096.0) + step(4096.0, 4096.0) + step(8192.0, 1808.0);
    assert!((r.ttft_p50_ms - ttft).abs() < 1e-9, "{r:?} vs {ttft}");
    assert!((r.tpot_p50_ms - (step(10_001.0, 0.0) + step(10_002.0, 0.0)) / 2.0).abs() < 1e-9);
    assert_eq!(
        r.mean_queue_ms, 0.0,
        "it holds its slot from its first chunk"
    );
    // 3 tokens over five steps
    let busy = ttft + step(10_001.0, 0.0) + step(10_002.0, 0.0);
    assert!((r.throughput_tok_s - 3.0 / busy * 1e3).abs() < 1e-9);
    // a prompt that fits one chunk writes its first token in its first step, as decode-only
    let short = sim(
        &[req(0.0, 4000, 3)],
        "rr",
        &colocated(cfg(1, 4, a, b), p, 4096),
    );
    assert_eq!(short.report.steps, 3);
    assert!((short.report.ttft_p50_ms - step(0.0, 4000.0)).abs() < 1e-9);
}

#[test]
fn one_ranks_prefill_slows_every_ranks_step_in_lockstep() {
    // rr over G = 2: request 0 (one token) on rank 0, request 1 decoding 20 tokens on rank 1;
    // request 2, an 8,000-token prompt, reaches rank 0 while rank 1 decodes. Rank 1 prefills
    // nothing then, yet its step takes p·8,000 longer: one of request 1's 19 token gaps does.
    let reqs = [req(0.0, 10, 1), req(0.0, 10, 20), req(50.0, 8000, 1)];
    let (a, b) = (1e-3, 10.0);
    let run = |p: f64| sim(&reqs, "rr", &colocated(cfg(2, 4, a, b), p, 8192)).report;
    let (free, paid) = (run(0.0), run(0.01));
    assert_eq!(free.steps, paid.steps);
    assert_eq!(free.steps, 20);
    // request 1 is the only one with more than one token: its TPOT is tpot50
    let extra = (paid.tpot_p50_ms - free.tpot_p50_ms) * 19.0;
    assert!((extra - 0.01 * 8000.0).abs() < 1e-9, "{extra}");
    // and the prefilling rank's own request: its first token after that step
    assert!(paid.ttft_p95_ms > 0.01 * 8000.0);
    // the aligned limit prices prefill at the mean over the ranks: 4,000 tokens in that step,
    // 10 in the first (the two 10-token prompts)
    let fluid_ms = |r: &RunReport| 22.0 / r.fluid_throughput_tok_s * 1e3;
    let extra = fluid_ms(&paid) - fluid_ms(&free);
    assert!((extra - 0.01 * (4000.0 + 10.0)).abs() < 1e-9, "{extra}");
    // what the steps pay beyond that limit, term by term: the prefill term is p·(8,000 −
    // 4,000) in that one step of 20; the terms add up to the step time beyond the limit
    let out = sim(&reqs, "rr", &colocated(cfg(2, 4, a, b), 0.01, 8192));
    let split = out.barrier;
    assert!(
        (split.prefill_ms - 0.01 * 4000.0 / 20.0).abs() < 1e-12,
        "{split:?}"
    );
    assert!((split.max_prefill_tokens - (8000.0 + 10.0) / 20.0).abs() < 1e-12);
    assert!((split.mean_prefill_tokens - (4000.0 + 10.0) / 20.0).abs() < 1e-12);
    assert_eq!(split.request_ms, 0.0, "c = 0");
    let r = &out.report;
    let beyond = (22.0 / r.throughput_tok_s - 22.0 / r.fluid_throughput_tok_s) * 1e3 / 20.0;
    let sum = split.kv_ms + split.prefill_ms + split.request_ms;
    assert!((beyond - sum).abs() < 1e-9, "{beyond} vs {split:?}");

    // the balance ratio sees the ranks wait for one rank's prefill: two equal decodes are
    // balanced in every step until a 5,000-token prompt reaches rank 0 (and leaves after its
    // one token); in that step rank 1 works a·L of a·L + p·5,000
    let reqs = [req(0.0, 1000, 10), req(0.0, 1000, 10), req(50.0, 5000, 1)];
    let run = |p: f64| sim(&reqs, "rr", &colocated(cfg(2, 4, a, b), p, 8192)).report;
    let (free, paid) = (run(0.0), run(0.01));
    assert_eq!((free.steps, paid.steps), (10, 10));
    assert_eq!(free.avg_balance, 1.0, "{free:?}");
    // steps of 20 ms (both prompts), then 11.001, 11.002, 11.003 ms: the prompt, arriving
    // at 50 ms, runs in step 4, over KV of 1,000 + 4 tokens on each rank
    let (l, pf) = (a * 1004.0, 0.01 * 5000.0);
    let want = (9.0 + (l + (l + pf)) / (2.0 * (l + pf))) / 10.0;
    assert!(
        (paid.avg_balance - want).abs() < 1e-12,
        "{} vs {want}",
        paid.avg_balance
    );
}

#[test]
fn without_colocated_prefill_the_engine_is_the_decode_only_model() {
    // `colocated: None` is the model every figure before colocated prefill was made with,
    // whatever p would be: the reference without prefill, bit for bit against a fresh run
    let reqs = saturated(300);
    let c = cfg(4, 8, 2e-4, 30.0);
    for policy in ["rr", "jsq", "br0", "brh"] {
        let a = sim(&reqs, policy, &c);
        let b = sim(&reqs, policy, &c);
        assert_eq!(a.report, b.report, "{policy}");
        assert_eq!(a.loads.map(|l| l.loads), b.loads.map(|l| l.loads));
    }
    assert_close(
        &sim(&reqs, "rr", &c).report,
        &reference_rr(&reqs, 4, 8, 2e-4, 30.0, 0.0, None),
    );
}

#[test]
fn every_policy_completes_every_request_with_colocated_prefill() {
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
                    ..r.clone()
                })
                .collect();
            let out = sim(&rs, name, &colocated(cfg(4, 16, 2e-4, 30.0), 0.01, 2048));
            let r = &out.report;
            assert_eq!(r.requests, 300, "{name}");
            let busy_s = total as f64 / r.throughput_tok_s;
            let fluid_s = total as f64 / r.fluid_throughput_tok_s;
            assert!(
                fluid_s <= busy_s + 1e-9,
                "{name}: the aligned limit is a lower bound"
            );
            assert!(
                r.ttft_p50_ms <= r.ttft_p95_ms && r.ttft_p50_ms > 0.0,
                "{name}"
            );
        }
    }
}

#[test]
fn prefill_waves_align_the_ranks_prefill_and_pay_for_it() {
    // Saturated, with prefill that counts (a 1,000-token prompt adds 10 ms at p = 0.01 to a step
    // of about 35 ms): each rank frees a slot now and then, and a rank that prefills alone stalls
    // all four. BR-C's waves put the ranks' prompts into common steps.
    let reqs: Vec<TraceRequest> = (0..600u32)
        .map(|i| req(0.0, 200 + (i * 7919) % 1800, 100 + (i * 104_729) % 400))
        .collect();
    let c = colocated(cfg(4, 16, 2e-4, 30.0), 0.01, 8192);
    let rr = sim(&reqs, "rr", &c);
    let brc = sim(&reqs, "brc", &c);
    let never_held = sim(&reqs, "brc:max_wait_steps=0", &c);
    assert_eq!(brc.report.requests, 600);
    assert!(
        brc.barrier.prefill_ms < 0.5 * rr.barrier.prefill_ms,
        "prefill beyond aligned: brc {} rr {}",
        brc.barrier.prefill_ms,
        rr.barrier.prefill_ms
    );
    assert!(
        brc.report.steady_throughput_tok_s > rr.report.steady_throughput_tok_s,
        "steady tok/s: brc {} rr {}",
        brc.report.steady_throughput_tok_s,
        rr.report.steady_throughput_tok_s
    );
    // without holding, the waves are whatever each tick frees: no better aligned than rr's
    assert!(never_held.barrier.prefill_ms > brc.barrier.prefill_ms);
}

/// A policy that places every request on the first rank with a free slot and writes down the
/// class of every request it is shown: on arrival or in the pool, in σ (`RequestInfo`), and
/// when it finishes.
#[derive(Debug)]
struct ClassRecorder {
    mode: Mode,
    /// Request key → class, as each place showed it.
    routed: std::collections::BTreeMap<u64, Option<u64>>,
    in_state: std::collections::BTreeMap<u64, Option<u64>>,
    /// (output tokens, class) of each finished request.
    finished: Vec<(u32, Option<u64>)>,
}

impl ClassRecorder {
    fn new(mode: Mode) -> Self {
        ClassRecorder {
            mode,
            routed: Default::default(),
            in_state: Default::default(),
            finished: Vec::new(),
        }
    }

    fn look(&mut self, state: &ClusterState) {
        for info in state.requests() {
            self.in_state.insert(info.key, info.class);
        }
    }

    fn free_worker(state: &ClusterState, taken: &[u32]) -> Option<u32> {
        state
            .workers()
            .iter()
            .enumerate()
            .find(|(g, w)| w.free_slots() > taken[*g])
            .map(|(g, _)| g as u32)
    }
}

impl Policy for ClassRecorder {
    fn name(&self) -> &'static str {
        "class-recorder"
    }
    fn mode(&self) -> Mode {
        self.mode
    }
    fn route(&mut self, entry: &PoolEntry, state: &ClusterState) -> Option<WorkerId> {
        self.look(state);
        self.routed.insert(entry.key, entry.class);
        let taken = vec![0; state.workers().len()];
        Some(Self::free_worker(state, &taken).unwrap_or(0))
    }
    fn dispatch(&mut self, pool: &mut Pool, state: &ClusterState, out: &mut Vec<Admission>) {
        self.look(state);
        let mut taken = vec![0; state.workers().len()];
        let entries: Vec<PoolEntry> = pool.iter().cloned().collect();
        for e in entries {
            let Some(w) = Self::free_worker(state, &taken) else {
                break;
            };
            taken[w as usize] += 1;
            self.routed.insert(e.key, e.class);
            pool.remove(e.key);
            out.push(Admission {
                key: e.key,
                worker: w,
                prompt_tokens: e.prompt_tokens,
                score: f64::NAN,
                stage: br_core::dispatch::Stage::Greedy,
            });
        }
    }
    fn observe_finished(&mut self, finished: &br_core::predict::Finished) {
        self.finished.push((finished.output_tokens, finished.class));
    }
}

#[test]
fn a_request_s_class_reaches_the_policy_in_its_entry_in_sigma_and_when_it_finishes() {
    // Every third request has no class; the others one of two keys. Output lengths are
    // distinct, so a finished request names itself.
    let class_of = |i: u32| match i % 3 {
        0 => None,
        1 => Some(crate::trace::Class::new("chat").expect("key")),
        _ => Some(crate::trace::Class::new("tools/long").expect("key")),
    };
    let reqs: Vec<TraceRequest> = (0..60u32)
        .map(|i| TraceRequest {
            class: class_of(i),
            ..req(f64::from(i) * 5.0, 100 + i, 3 + i)
        })
        .collect();
    let want: Vec<Option<u64>> = reqs.iter().map(TraceRequest::class_id).collect();
    assert!(want.iter().flatten().count() == 40 && want.contains(&None));
    for mode in [Mode::OnArrival, Mode::Pooled] {
        let mut p = ClassRecorder::new(mode);
        simulate_deciders(
            &reqs,
            &mut [&mut p as &mut dyn Policy],
            "rec",
            &cfg(2, 4, 2e-4, 30.0),
        )
        .expect("simulate");
        let by_key = |m: &std::collections::BTreeMap<u64, Option<u64>>| -> Vec<Option<u64>> {
            (0..60u64)
                .map(|k| *m.get(&k).expect("every request seen"))
                .collect()
        };
        assert_eq!(by_key(&p.routed), want, "{mode:?}: PoolEntry.class");
        // σ is looked at when the policy is asked: the last arrivals may finish unseen.
        assert!(
            p.in_state.len() >= 50,
            "{mode:?}: {} seen in σ",
            p.in_state.len()
        );
        for (&k, &class) in &p.in_state {
            assert_eq!(
                class, want[k as usize],
                "{mode:?}: RequestInfo.class of {k}"
            );
        }
        p.finished.sort_unstable();
        let finished: Vec<Option<u64>> = p.finished.iter().map(|f| f.1).collect();
        assert_eq!(finished, want, "{mode:?}: Finished.class");
    }
}
