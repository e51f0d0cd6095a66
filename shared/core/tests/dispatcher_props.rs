//! Property tests of the dispatcher: capacity is never exceeded, no request is admitted twice,
//! free slots are only left while the policy says why (the starvation guard ran, or Stage 2
//! held a worker above the mean), Stage 2's subset is a brute-force optimum, a pool no deeper
//! than the free slots is admitted whole, and everything is deterministic.

#![allow(clippy::unwrap_used)] // test fixtures: a panic is the failure report

use std::collections::HashSet;

use br_core::dispatch::{
    Admission, ColdStart, DispatcherConfig, Stage, Stage1Scope, Stage1Worker, Stage2Fill,
    Stage2Hold, Stage2Target, Stage2Window, TieBreak, best_subset,
};
use br_core::predict::{Finished, Oracle};
use br_core::score::{HorizonParams, Margins, br0_score};
use br_core::{
    ClusterState, Phase, PolicyConfig, PolicyKind, Pool, PoolEntry, RequestInfo, build_policy,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Scenario {
    capacities: Vec<u32>,
    /// (worker, prompt, generated, running, oracle output)
    existing: Vec<(usize, u32, u32, bool, u32)>,
    pool: Vec<(u32, u32)>,
    cfg: DispatcherConfig,
    /// Every request carries its true output as the client's expected output (exact hints).
    hinted: bool,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (1usize..10, 1u32..8).prop_flat_map(|(g, b)| {
        (
            Just(vec![b; g]),
            prop::collection::vec(
                (0..g, 1u32..20_000, 0u32..2_000, any::<bool>(), 1u32..3_000),
                0..(g * b as usize),
            ),
            prop::collection::vec((1u32..20_000, 1u32..3_000), 0..60),
            (
                1usize..7,
                prop::option::of(0u32..40),
                prop_oneof![
                    Just(Stage1Worker::MostFreeSlots),
                    Just(Stage1Worker::LeastLoaded),
                    Just(Stage1Worker::ByScore)
                ],
                prop_oneof![Just(ColdStart::Score), Just(ColdStart::LargestFirst)],
                prop_oneof![Just(Stage1Scope::WholePool), Just(Stage1Scope::HeadBatch)],
                prop_oneof![
                    Just(TieBreak::LowestId),
                    Just(TieBreak::LeastLoaded),
                    Just(TieBreak::FewestRequests)
                ],
                prop_oneof![Just(Stage2Window::Oldest), Just(Stage2Window::TickHead)],
                prop_oneof![Just(Stage2Fill::Max), Just(Stage2Fill::Mean)],
                0u32..20,
            ),
            prop_oneof![Just(1.0f64), Just(0.0f64), 0.0f64..=1.0],
            any::<bool>(),
            prop_oneof![
                Just(Stage2Hold::Never),
                Just(Stage2Hold::AboveMean),
                Just(Stage2Hold::Worse)
            ],
            prop_oneof![Just(Stage2Target::Now), Just(Stage2Target::NextFinish)],
            prop_oneof![Just(0.0f64), 0.0f64..2.0],
            any::<bool>(),
        )
            .prop_map(
                |(
                    capacities,
                    existing,
                    pool,
                    (
                        r_max,
                        s_greedy,
                        stage1_worker,
                        cold_start,
                        stage1_scope,
                        tie_break,
                        stage2_window,
                        stage2_fill,
                        stage2_lookahead,
                    ),
                    stage1_level,
                    stage1_shallow,
                    stage2_hold,
                    stage2_target,
                    stagger_weight,
                    hinted,
                )| {
                    Scenario {
                        capacities,
                        existing,
                        pool,
                        hinted,
                        cfg: DispatcherConfig {
                            s_greedy,
                            r_max,
                            stage1_worker,
                            stage1_scope,
                            cold_start,
                            tie_break,
                            stage2_window,
                            stage2_fill,
                            stage2_lookahead,
                            stage1_level,
                            stage1_shallow,
                            stage2_hold,
                            stage2_target,
                            stagger_weight,
                        },
                    }
                },
            )
    })
}

fn build(sc: &Scenario) -> (ClusterState, Pool) {
    let mut st = ClusterState::with_workers(&sc.capacities);
    for (i, &(w, s, j, running, o)) in sc.existing.iter().enumerate() {
        if st.worker(w as u32).unwrap().free_slots() == 0 {
            continue;
        }
        st.reserve(RequestInfo {
            key: 1_000_000 + i as u64,
            worker: w as u32,
            prompt_tokens: s,
            generated: if running { j } else { 0 },
            phase: if running {
                Phase::Running
            } else {
                Phase::Queued
            },
            prompt_hash: None,
            oracle_output: Some(o + j),
            expected_output: sc.hinted.then_some(o + j),
            class: None,
        })
        .unwrap();
    }
    let mut pool = Pool::new();
    for (i, &(s, o)) in sc.pool.iter().enumerate() {
        pool.push(PoolEntry {
            key: i as u64,
            prompt_tokens: s,
            prompt_hash: Some(u64::from(s % 7)),
            oracle_output: Some(o),
            expected_output: sc.hinted.then_some(o),
            class: None,
        })
        .unwrap();
    }
    (st, pool)
}

/// Per worker, what its load climbs before the first step at which its projected load falls
/// (a request ending by the oracle within the default horizon), or over the whole horizon if it
/// never falls: the next-finish target's climb, recomputed here from the requests (each counts
/// `prompt + generated`, plus h if running, while h is below its oracle end), not from `Margins`.
fn climbs_to_next_finish(st: &ClusterState) -> Vec<f64> {
    let h_max = u64::from(HorizonParams::default().horizon);
    st.workers()
        .iter()
        .enumerate()
        .map(|(w, info)| {
            if !info.alive {
                return 0.0;
            }
            let reqs: Vec<&RequestInfo> = st.requests_of(w as u32).collect();
            // the oracle predicts a finish only within the horizon; else it runs past it
            let end = |r: &RequestInfo| match r.oracle_output {
                Some(o) if o > r.generated && u64::from(o - r.generated) <= h_max => {
                    u64::from(o - r.generated)
                }
                _ => h_max + 1,
            };
            let load_at = |h: u64| -> u64 {
                reqs.iter()
                    .filter(|r| h < end(r))
                    .map(|r| r.kv_tokens() + if r.phase == Phase::Running { h } else { 0 })
                    .sum()
            };
            let mut peak = load_at(0);
            for h in 1..=h_max {
                let next = load_at(h);
                if next < peak {
                    break;
                }
                peak = next;
            }
            (peak - load_at(0)) as f64
        })
        .collect()
}

/// Enough finishes whose hints were exact for the stagger term to trust the hints fully.
fn exact_hints_proved(policy: &mut dyn br_core::Policy) {
    for _ in 0..br_core::dispatch::MIN_HINTED_FINISHES {
        policy.observe_finished(&Finished {
            prompt_tokens: 1_000,
            prompt_hash: None,
            output_tokens: 500,
            expected_output: Some(500),
            class: None,
        });
    }
}

fn run(sc: &Scenario, kind: PolicyKind) -> (ClusterState, Pool, Vec<Admission>) {
    let (st, mut pool) = build(sc);
    let cfg = PolicyConfig {
        kind,
        dispatcher: sc.cfg,
        horizon: HorizonParams::default(),
        brc: Default::default(),
        seed: 7,
    };
    let mut policy = build_policy(&cfg).unwrap();
    if sc.hinted {
        exact_hints_proved(policy.as_mut());
    }
    let mut out = Vec::new();
    policy.dispatch(&mut pool, &st, &mut out);
    (st, pool, out)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn dispatcher_invariants(sc in scenario(), brh in any::<bool>()) {
        let kind = if brh { PolicyKind::BrH(br_core::PredictorKind::Oracle) } else { PolicyKind::Br0 };
        let (st, pool, out) = run(&sc, kind);
        let pool_before = sc.pool.len();
        // no request twice, every admitted request came from the pool and left it
        let keys: HashSet<u64> = out.iter().map(|a| a.key).collect();
        prop_assert_eq!(keys.len(), out.len());
        prop_assert_eq!(pool.len() + out.len(), pool_before);
        for a in &out {
            prop_assert!((a.key as usize) < pool_before);
            prop_assert!(!pool.contains(a.key));
        }
        // never more than B per worker
        let mut admitted = vec![0u32; sc.capacities.len()];
        for a in &out {
            admitted[a.worker as usize] += 1;
        }
        for (w, info) in st.workers().iter().enumerate() {
            prop_assert!(admitted[w] <= info.free_slots(), "worker {w}: {} admitted, {} free", admitted[w], info.free_slots());
        }
        // a free slot is left only while the pool is empty, where the starvation guard says
        // no subset scored above zero for that worker this tick, or where Stage 2 held the
        // worker: with `above-mean` its load is above the mean (the tick's working mean only
        // grows, so above the mean before the tick too)
        let live: Vec<usize> = (0..st.workers().len()).filter(|&w| st.workers()[w].alive).collect();
        let start_mean = live.iter().map(|&w| st.workers()[w].load() as f64).sum::<f64>() / live.len().max(1) as f64;
        let mut end_load: Vec<f64> = st.workers().iter().map(|w| w.load() as f64).collect();
        for a in &out {
            end_load[a.worker as usize] += f64::from(a.prompt_tokens);
        }
        // with the next-finish target (BR-H) the hold compares each rank's projected load
        // before its next finish with the mean of those: add each rank's climb to both sides
        let climb = if brh && sc.cfg.stage2_target == Stage2Target::NextFinish {
            climbs_to_next_finish(&st)
        } else {
            vec![0.0; st.workers().len()]
        };
        let start_mean = start_mean + live.iter().map(|&w| climb[w]).sum::<f64>() / live.len().max(1) as f64;
        for (w, c) in climb.iter().enumerate() {
            end_load[w] += c;
        }
        if !pool.is_empty() {
            for (w, info) in st.workers().iter().enumerate() {
                if admitted[w] < info.free_slots() {
                    let guarded = out.iter().any(|a| a.worker as usize == w && a.stage == Stage::Guard);
                    let mean_fill = sc.cfg.stage2_fill == Stage2Fill::Mean;
                    let held = match sc.cfg.stage2_hold {
                        Stage2Hold::Never => false,
                        Stage2Hold::AboveMean => mean_fill && end_load[w] > start_mean,
                        Stage2Hold::Worse => mean_fill,
                    };
                    prop_assert!(guarded || held, "worker {w} (load {} after the tick, mean {start_mean} before) left with free slots, no guard, no hold, while {} wait", end_load[w], pool.len());
                }
            }
        }
        // a pool that fits the tick's free slots is admitted whole
        let s_tot: u32 = st.workers().iter().map(|w| w.free_slots()).sum();
        if sc.cfg.stage1_shallow && pool_before <= s_tot as usize {
            prop_assert!(pool.is_empty(), "{} of {pool_before} left with {s_tot} free slots", pool.len());
            prop_assert!(out.iter().all(|a| a.stage == Stage::Greedy));
        }
    }

    #[test]
    fn the_stagger_term_changes_nothing_without_hints(sc in scenario(), brh in any::<bool>()) {
        let kind = if brh { PolicyKind::BrH(br_core::PredictorKind::Oracle) } else { PolicyKind::Br0 };
        let mut with = sc.clone();
        with.hinted = false;
        with.cfg.stagger_weight = 1.0;
        let mut without = with.clone();
        without.cfg.stagger_weight = 0.0;
        prop_assert_eq!(run(&with, kind).2, run(&without, kind).2);
    }

    #[test]
    fn dispatch_is_deterministic(sc in scenario()) {
        let (_, _, a) = run(&sc, PolicyKind::Br0);
        let (_, _, b) = run(&sc, PolicyKind::Br0);
        prop_assert_eq!(a, b);
    }

    #[test]
    fn stage2_subset_is_the_brute_force_optimum(
        loads in prop::collection::vec(0u32..50_000, 2..12),
        sizes in prop::collection::vec(1u32..30_000, 1..7),
        free in 1usize..8,
        pick in any::<prop::sample::Index>(),
    ) {
        let mut st = ClusterState::with_workers(&vec![64; loads.len()]);
        for (w, &l) in loads.iter().enumerate() {
            if l > 0 {
                st.reserve(RequestInfo { key: w as u64, worker: w as u32, prompt_tokens: l, generated: 0, phase: Phase::Running, prompt_hash: None, oracle_output: None, expected_output: None, class: None }).unwrap();
            }
        }
        let w = pick.index(loads.len()) as u32;
        let margins = Margins::br0(&st);
        let fsizes: Vec<f64> = sizes.iter().map(|&s| f64::from(s)).collect();
        let (mask, score) = best_subset(&fsizes, free, |ds| margins.score(w, ds));
        // brute force in exact integers, independent of the enumeration above
        let margin = st.max_load() - st.worker(w).unwrap().load();
        let g = st.live_workers();
        let mut best = i128::MIN;
        for m in 1u32..(1 << sizes.len()) {
            if m.count_ones() as usize > free { continue; }
            let ds: u64 = (0..sizes.len()).filter(|i| m & (1 << i) != 0).map(|i| u64::from(sizes[i])).sum();
            best = best.max(br0_score(ds, margin, g));
        }
        prop_assert_eq!(score, best as f64);
        prop_assert!(mask.count_ones() as usize <= free);
        let ds: u64 = (0..sizes.len()).filter(|i| mask & (1 << i) != 0).map(|i| u64::from(sizes[i])).sum();
        prop_assert_eq!(br0_score(ds, margin, g), best);
    }
}

#[test]
fn cold_start_largest_first_balances_tokens() {
    // 4 empty workers, 8 slots each, 16 requests: LPT puts the big ones on separate workers.
    let sizes = [
        8000u32, 7000, 6000, 5000, 100, 200, 300, 400, 150, 250, 350, 450, 120, 220, 320, 420,
    ];
    let mut pool = Pool::new();
    for (i, &s) in sizes.iter().enumerate() {
        pool.push(PoolEntry {
            key: i as u64,
            prompt_tokens: s,
            prompt_hash: None,
            oracle_output: None,
            expected_output: None,
            class: None,
        })
        .unwrap();
    }
    let st = ClusterState::with_workers(&[8; 4]);
    let cfg = PolicyConfig {
        brc: Default::default(),
        kind: PolicyKind::Br0,
        dispatcher: DispatcherConfig {
            s_greedy: Some(0),
            ..Default::default()
        },
        horizon: HorizonParams::default(),
        seed: 0,
    };
    let mut p = build_policy(&cfg).unwrap();
    let mut out = Vec::new();
    p.dispatch(&mut pool, &st, &mut out);
    assert_eq!(out.len(), 16);
    let mut load = [0u64; 4];
    for a in &out {
        load[a.worker as usize] += u64::from(a.prompt_tokens);
    }
    let (max, min) = (*load.iter().max().unwrap(), *load.iter().min().unwrap());
    assert!(max - min <= 3000, "loads {load:?}");
    let big: HashSet<u32> = out
        .iter()
        .filter(|a| a.prompt_tokens >= 5000)
        .map(|a| a.worker)
        .collect();
    assert_eq!(big.len(), 4, "each big request on its own worker: {out:?}");
}

#[test]
fn oracle_predictor_is_usable_from_brh() {
    let sc = Scenario {
        capacities: vec![4, 4],
        existing: vec![],
        pool: vec![(100, 10), (200, 20)],
        cfg: DispatcherConfig::default(),
        hinted: false,
    };
    let (_, pool, out) = run(&sc, PolicyKind::BrH(br_core::PredictorKind::Oracle));
    assert!(pool.is_empty());
    assert_eq!(out.len(), 2);
    let _ = Oracle;
}

#[test]
fn names_round_trip_and_unknown_names_are_refused() {
    for name in PolicyKind::names() {
        let k: PolicyKind = name.parse().unwrap();
        assert_eq!(k.name().parse::<PolicyKind>().unwrap(), k);
    }
    let err = "fastest".parse::<PolicyKind>().unwrap_err();
    assert!(err.to_string().contains("unknown policy"));
    let bad = PolicyConfig {
        dispatcher: DispatcherConfig {
            r_max: 0,
            ..Default::default()
        },
        ..PolicyConfig::new(PolicyKind::Br0)
    };
    assert!(build_policy(&bad).is_err());
}

#[test]
fn stage2_admits_the_best_subset_through_the_dispatcher() {
    // Worker 0 at 10_000 (the max), worker 1 at 7_000: margin 3_000 on worker 1, which has two
    // free slots. Window: 1_900, 1_000, 2_500, 700. Best subset for worker 1 is {1_900, 1_000}
    // (F = 2_900; {2_500, 700} overflows by 200 and scores 3_200 − 2·200 = 2_800).
    let mut st = ClusterState::with_workers(&[1, 3]);
    for (key, worker, s) in [(100u64, 0u32, 10_000u32), (101, 1, 7_000)] {
        st.reserve(RequestInfo {
            key,
            worker,
            prompt_tokens: s,
            generated: 0,
            phase: Phase::Running,
            prompt_hash: None,
            oracle_output: None,
            expected_output: None,
            class: None,
        })
        .unwrap();
    }
    let mut pool = Pool::new();
    for (i, s) in [1_900u32, 1_000, 2_500, 700].into_iter().enumerate() {
        pool.push(PoolEntry {
            key: i as u64,
            prompt_tokens: s,
            prompt_hash: None,
            oracle_output: None,
            expected_output: None,
            class: None,
        })
        .unwrap();
    }
    let cfg = PolicyConfig {
        brc: Default::default(),
        kind: PolicyKind::Br0,
        dispatcher: DispatcherConfig {
            s_greedy: Some(100),
            // the paper's Stage 2, which this checks (the defaults fill to the mean instead)
            stage2_window: Stage2Window::Oldest,
            stage2_fill: Stage2Fill::Max,
            ..Default::default()
        },
        horizon: HorizonParams::default(),
        seed: 0,
    };
    let mut p = build_policy(&cfg).unwrap();
    let mut out = Vec::new();
    p.dispatch(&mut pool, &st, &mut out);
    let got: Vec<(u64, u32, Stage)> = out.iter().map(|a| (a.key, a.worker, a.stage)).collect();
    assert_eq!(got, vec![(0, 1, Stage::Subset), (1, 1, Stage::Subset)]);
    assert_eq!(out[0].score, 2_900.0);
}

#[test]
fn head_batch_scope_admits_in_arrival_order() {
    // 2 workers × 4 free slots, S_greedy 0: Stage 1 admits 8 of 12 waiting requests. With the
    // head-batch scope they are exactly the 8 oldest (placement is Stage 1's only choice).
    let mut pool = Pool::new();
    for i in 0..12u64 {
        let s = if i < 8 { 100 + i as u32 } else { 9_000 };
        pool.push(PoolEntry {
            key: i,
            prompt_tokens: s,
            prompt_hash: None,
            oracle_output: None,
            expected_output: None,
            class: None,
        })
        .unwrap();
    }
    let st = ClusterState::with_workers(&[4, 4]);
    let cfg = PolicyConfig {
        brc: Default::default(),
        kind: PolicyKind::Br0,
        dispatcher: DispatcherConfig {
            s_greedy: Some(0),
            stage1_scope: Stage1Scope::HeadBatch,
            ..Default::default()
        },
        horizon: HorizonParams::default(),
        seed: 0,
    };
    let mut p = build_policy(&cfg).unwrap();
    let mut out = Vec::new();
    p.dispatch(&mut pool, &st, &mut out);
    let mut keys: Vec<u64> = out.iter().map(|a| a.key).collect();
    keys.sort_unstable();
    assert_eq!(keys, (0..8).collect::<Vec<_>>());
    // the whole-pool scope would have reached for the large late ones
    let mut pool2 = Pool::new();
    for i in 0..12u64 {
        let s = if i < 8 { 100 + i as u32 } else { 9_000 };
        pool2
            .push(PoolEntry {
                key: i,
                prompt_tokens: s,
                prompt_hash: None,
                oracle_output: None,
                expected_output: None,
                class: None,
            })
            .unwrap();
    }
    let cfg2 = PolicyConfig {
        dispatcher: DispatcherConfig {
            stage1_scope: Stage1Scope::WholePool,
            ..cfg.dispatcher
        },
        ..cfg
    };
    let mut out2 = Vec::new();
    build_policy(&cfg2)
        .unwrap()
        .dispatch(&mut pool2, &st, &mut out2);
    assert!(out2.iter().any(|a| a.key >= 8));
}

/// One running request per worker (load `loads[w]`, capacity `free + 1`) and `sizes` waiting.
fn one_running_each(loads: &[u32], free: u32, sizes: &[u32]) -> (ClusterState, Pool) {
    let mut st = ClusterState::with_workers(&vec![free + 1; loads.len()]);
    for (w, &l) in loads.iter().enumerate() {
        st.reserve(RequestInfo {
            key: 1_000_000 + w as u64,
            worker: w as u32,
            prompt_tokens: l,
            generated: 0,
            phase: Phase::Running,
            prompt_hash: None,
            oracle_output: None,
            expected_output: None,
            class: None,
        })
        .unwrap();
    }
    let mut pool = Pool::new();
    for (i, &s) in sizes.iter().enumerate() {
        pool.push(PoolEntry {
            key: i as u64,
            prompt_tokens: s,
            prompt_hash: None,
            oracle_output: None,
            expected_output: None,
            class: None,
        })
        .unwrap();
    }
    (st, pool)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Fairness: with the head-batch scope a tick that admits n requests takes them from the
    /// oldest n + R_max − 1 (the paper's window passes over at most R_max − 1 per tick), and the
    /// tick-head window from the oldest n + its reach (max(lookahead, R_max − 1)) whenever the
    /// tick fills its slots (no starvation guard ended a worker early); either way nothing
    /// beyond the oldest S_tot + reach is admitted.
    #[test]
    fn a_tick_passes_over_at_most_r_max_minus_one(sc in scenario(), brh in any::<bool>()) {
        let mut sc = sc;
        sc.cfg.stage1_scope = Stage1Scope::HeadBatch;
        let kind = if brh { PolicyKind::BrH(br_core::PredictorKind::Oracle) } else { PolicyKind::Br0 };
        let (st, pool, out) = run(&sc, kind);
        let s_tot: u32 = st.workers().iter().map(|w| w.free_slots()).sum();
        // the guard ended a worker early, or Stage 2 held one: the tick left slots empty
        let guarded = out.iter().any(|a| a.stage == Stage::Guard)
            || (out.len() < s_tot as usize && !pool.is_empty());
        // pool keys are arrival positions
        let reach = if sc.cfg.stage2_window == Stage2Window::TickHead && guarded {
            s_tot as usize + sc.cfg.stage2_reach()
        } else {
            out.len() + sc.cfg.stage2_reach()
        };
        for a in &out {
            prop_assert!((a.key as usize) < reach, "{:?} admitted key {} beyond the oldest {reach}", sc.cfg, a.key);
        }
    }

    /// The tick-head window gives the first worker Stage 2 serves the best single request of
    /// the whole head (the oldest S_tot + lookahead), by the exact integer F-score.
    #[test]
    fn tick_head_first_pick_is_the_best_of_the_head(
        loads in prop::collection::vec(1u32..60_000, 2..12),
        sizes in prop::collection::vec(1u32..20_000, 1..40),
        r_max in 1usize..6,
        lookahead in 0u32..12,
    ) {
        let (st, mut pool) = one_running_each(&loads, 1, &sizes);
        let cfg = PolicyConfig {
            brc: Default::default(),
            kind: PolicyKind::Br0,
            dispatcher: DispatcherConfig {
                s_greedy: Some(10_000), // Stage 2 only, however shallow the pool
                stage1_shallow: false,
                r_max,
                stage2_window: Stage2Window::TickHead,
                stage2_fill: Stage2Fill::Max,
                stage2_lookahead: lookahead,
                ..Default::default()
            },
            horizon: HorizonParams::default(),
            seed: 0,
        };
        let mut out = Vec::new();
        build_policy(&cfg).unwrap().dispatch(&mut pool, &st, &mut out);
        prop_assert!(!out.is_empty());
        let first = &out[0];
        // every worker has one free slot: Stage 2 serves the largest margin (least load) first
        let g = st.live_workers();
        let max = st.max_load();
        let w = (0..loads.len()).min_by_key(|&w| (loads[w], w)).unwrap();
        prop_assert_eq!(first.worker as usize, w);
        let head = (loads.len() + (lookahead as usize).max(r_max - 1)).min(sizes.len());
        let margin = max - u64::from(loads[w]);
        let best = sizes[..head].iter().map(|&s| br0_score(u64::from(s), margin, g)).max().unwrap();
        prop_assert_eq!(br0_score(u64::from(first.prompt_tokens), margin, g), best);
    }
}

#[test]
fn mean_fill_brings_a_worker_to_the_mean_not_the_max() {
    // Four workers at 40_000 (the max), 30_000, 30_000 and 10_000: mean 27_500. Worker 3 alone
    // has a free slot (margin 30_000, 17_500 short of the mean). Waiting: 20_000, 17_000, 5_000.
    // The F-score fills to the max (20_000: F = 20_000); the mean fill takes 17_000, which
    // leaves worker 3 nearest the mean (27_000).
    let loads = [40_000u32, 30_000, 30_000, 10_000];
    let mut st = ClusterState::with_workers(&[1, 1, 1, 2]);
    for (w, &l) in loads.iter().enumerate() {
        st.reserve(RequestInfo {
            key: 100 + w as u64,
            worker: w as u32,
            prompt_tokens: l,
            generated: 0,
            phase: Phase::Running,
            prompt_hash: None,
            oracle_output: None,
            expected_output: None,
            class: None,
        })
        .unwrap();
    }
    let pick = |fill: Stage2Fill, window: Stage2Window| {
        let mut pool = Pool::new();
        for (i, s) in [20_000u32, 17_000, 5_000].into_iter().enumerate() {
            pool.push(PoolEntry {
                key: i as u64,
                prompt_tokens: s,
                prompt_hash: None,
                oracle_output: None,
                expected_output: None,
                class: None,
            })
            .unwrap();
        }
        let cfg = PolicyConfig {
            brc: Default::default(),
            kind: PolicyKind::Br0,
            dispatcher: DispatcherConfig {
                s_greedy: Some(100),
                stage2_fill: fill,
                stage2_window: window,
                ..Default::default()
            },
            horizon: HorizonParams::default(),
            seed: 0,
        };
        let mut out = Vec::new();
        build_policy(&cfg)
            .unwrap()
            .dispatch(&mut pool, &st, &mut out);
        let got: Vec<(u32, u32, Stage)> = out
            .iter()
            .map(|a| (a.worker, a.prompt_tokens, a.stage))
            .collect();
        got
    };
    for window in [Stage2Window::Oldest, Stage2Window::TickHead] {
        assert_eq!(
            pick(Stage2Fill::Max, window),
            vec![(3, 20_000, Stage::Subset)]
        );
        assert_eq!(
            pick(Stage2Fill::Mean, window),
            vec![(3, 17_000, Stage::Subset)]
        );
    }
}

#[test]
fn stage2_holds_a_worker_above_the_mean_and_fills_the_one_below() {
    // Three workers at 9_000 (one free slot), 5_000 (full) and 1_000 (one free slot): mean
    // 5_000. Waiting: 3_000, 500, 4_000 (deeper than the two free slots, so Stage 2 runs).
    // Worker 2 (largest margin) is served first and takes 4_000, which brings it to the mean.
    // Worker 0 is above the mean: the best it could take, 500, leaves it further above (fill
    // score 2·(6_333 − 9_000) − 500 < 0), so with the hold its slot stays empty this tick;
    // without it, it takes 500 and the max rises.
    let loads = [9_000u32, 5_000, 1_000];
    let mut st = ClusterState::with_workers(&[2, 1, 2]);
    for (w, &l) in loads.iter().enumerate() {
        st.reserve(RequestInfo {
            key: 100 + w as u64,
            worker: w as u32,
            prompt_tokens: l,
            generated: 0,
            phase: Phase::Running,
            prompt_hash: None,
            oracle_output: None,
            expected_output: None,
            class: None,
        })
        .unwrap();
    }
    let pick = |hold: Stage2Hold| {
        let mut pool = Pool::new();
        for (i, s) in [3_000u32, 500, 4_000].into_iter().enumerate() {
            pool.push(PoolEntry {
                key: i as u64,
                prompt_tokens: s,
                prompt_hash: None,
                oracle_output: None,
                expected_output: None,
                class: None,
            })
            .unwrap();
        }
        let cfg = PolicyConfig {
            brc: Default::default(),
            kind: PolicyKind::Br0,
            dispatcher: DispatcherConfig {
                stage2_hold: hold,
                ..Default::default()
            },
            horizon: HorizonParams::default(),
            seed: 0,
        };
        let mut out = Vec::new();
        build_policy(&cfg)
            .unwrap()
            .dispatch(&mut pool, &st, &mut out);
        out.iter()
            .map(|a| (a.worker, a.prompt_tokens))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        DispatcherConfig::default().stage2_hold,
        Stage2Hold::AboveMean
    );
    assert_eq!(pick(Stage2Hold::AboveMean), vec![(2, 4_000)]);
    assert_eq!(pick(Stage2Hold::Worse), vec![(2, 4_000)]);
    assert_eq!(pick(Stage2Hold::Never), vec![(2, 4_000), (0, 500)]);
}

#[test]
fn a_shallow_pool_is_placed_whole_by_stage1() {
    // Two waiting requests, three free slots, far fewer than S_greedy (G·R_max = 12): Stage 1
    // places both (largest first, each on the best-scoring worker), none by Stage 2.
    let (st, pool) = one_running_each(&[8_000, 2_000, 5_000], 1, &[1_000, 6_000]);
    let run = |shallow: bool| {
        let mut pool = pool.clone();
        let cfg = PolicyConfig {
            brc: Default::default(),
            kind: PolicyKind::Br0,
            dispatcher: DispatcherConfig {
                stage1_shallow: shallow,
                ..Default::default()
            },
            horizon: HorizonParams::default(),
            seed: 0,
        };
        let mut out = Vec::new();
        build_policy(&cfg)
            .unwrap()
            .dispatch(&mut pool, &st, &mut out);
        assert!(pool.is_empty());
        out.iter()
            .map(|a| (a.worker, a.prompt_tokens, a.stage))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        run(true),
        vec![(1, 6_000, Stage::Greedy), (2, 1_000, Stage::Greedy)]
    );
    assert!(run(false).iter().all(|a| a.2 != Stage::Greedy));
}

/// One request for Stage 1 to place, over workers with the given (load, requests, free slots):
/// each worker's load is made of `requests` running requests of equal size.
fn place_one(workers: &[(u64, u32, u32)], s: u32, level: f64, tie_break: TieBreak) -> Admission {
    let caps: Vec<u32> = workers.iter().map(|&(_, n, f)| n + f).collect();
    let mut st = ClusterState::with_workers(&caps);
    let mut key = 1_000u64;
    for (w, &(load, n, _)) in workers.iter().enumerate() {
        for i in 0..n {
            // n requests summing to `load`, the remainder on the first
            let share = load / u64::from(n) + if i == 0 { load % u64::from(n) } else { 0 };
            st.reserve(RequestInfo {
                key,
                worker: w as u32,
                prompt_tokens: share as u32,
                generated: 0,
                phase: Phase::Running,
                prompt_hash: None,
                oracle_output: None,
                expected_output: None,
                class: None,
            })
            .unwrap();
            key += 1;
        }
    }
    let mut pool = Pool::new();
    pool.push(PoolEntry {
        key: 0,
        prompt_tokens: s,
        prompt_hash: None,
        oracle_output: None,
        expected_output: None,
        class: None,
    })
    .unwrap();
    let cfg = PolicyConfig {
        brc: Default::default(),
        kind: PolicyKind::Br0,
        dispatcher: DispatcherConfig {
            s_greedy: Some(0), // Stage 1 places it
            stage1_worker: Stage1Worker::ByScore,
            stage1_scope: Stage1Scope::HeadBatch,
            tie_break,
            stage1_level: level,
            ..Default::default()
        },
        horizon: HorizonParams::default(),
        seed: 0,
    };
    let mut out = Vec::new();
    build_policy(&cfg)
        .unwrap()
        .dispatch(&mut pool, &st, &mut out);
    assert_eq!(out.len(), 1, "one request, free slots: it is placed");
    out.remove(0)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// Stage 1's fill level, against a reference in exact integers: with `T = L̄ + level·(M − L̄)`,
    /// a request goes to the tie-break's first worker (with a free slot) that it leaves at or
    /// below T; when it fits under T nowhere, to the least-loaded worker (tie-break among equal
    /// loads); at level 1 to the best F-score (the paper's rule). The admission records the
    /// F-score (−ΔI) whatever the level. Loads are multiples of 32 and G divides 8, so T is an
    /// integer and the reference needs no rounding.
    #[test]
    fn stage1_fills_up_to_its_level(
        g in prop_oneof![Just(2usize), Just(4), Just(8)],
        raw in prop::collection::vec((0u64..4_000, 1u32..6, 0u32..3), 8),
        s in 1u32..200_000,
        level4 in 0u32..=4,
        tie_break in prop_oneof![
            Just(TieBreak::LowestId),
            Just(TieBreak::LeastLoaded),
            Just(TieBreak::FewestRequests)
        ],
    ) {
        let mut workers: Vec<(u64, u32, u32)> =
            raw[..g].iter().map(|&(l, n, f)| (l * 32, n, f)).collect();
        if workers.iter().all(|w| w.2 == 0) {
            workers[0].2 = 1;
        }
        let level = f64::from(level4) / 4.0;
        let a = place_one(&workers, s, level, tie_break);

        let sum: u64 = workers.iter().map(|w| w.0).sum();
        let max = workers.iter().map(|w| w.0).max().unwrap();
        let mean = sum / g as u64; // exact: 32 | every load and g | 8
        let t4 = u64::from(4 - level4) * mean + u64::from(level4) * max; // 4·T
        let s64 = u64::from(s);
        let key = |w: usize| {
            let (load, n, _) = workers[w];
            match tie_break {
                TieBreak::LowestId => (0, 0, w),
                TieBreak::LeastLoaded => (0, load, w),
                TieBreak::FewestRequests => (n, load, w),
            }
        };
        let free: Vec<usize> = (0..g).filter(|&w| workers[w].2 > 0).collect();
        let expect = if level4 == 4 {
            let f = |w: usize| br0_score(s64, max - workers[w].0, g as u32);
            let best = free.iter().map(|&w| f(w)).max().unwrap();
            free.iter().copied().filter(|&w| f(w) == best).min_by_key(|&w| key(w)).unwrap()
        } else {
            let under: Vec<usize> =
                free.iter().copied().filter(|&w| 4 * (workers[w].0 + s64) <= t4).collect();
            if under.is_empty() {
                let least = free.iter().map(|&w| workers[w].0).min().unwrap();
                free.iter().copied().filter(|&w| workers[w].0 == least).min_by_key(|&w| key(w)).unwrap()
            } else {
                under.into_iter().min_by_key(|&w| key(w)).unwrap()
            }
        };
        prop_assert_eq!(a.worker as usize, expect, "workers {:?} s {} level {}", workers, s, level);
        prop_assert_eq!(a.stage, Stage::Greedy);
        let w = a.worker as usize;
        prop_assert_eq!(a.score, br0_score(s64, max - workers[w].0, g as u32) as f64);
    }
}

#[test]
fn stage1_level_keeps_a_request_off_a_rank_near_the_max() {
    // The moderate-load failure of the paper's rule: worker 0 is near the max with
    // few, large requests, worker 1 is the max, worker 2 far below it with more requests. A
    // 5,000-token request fits under the max on 0 and 2 (F = 5,000 on both), and fewest-requests
    // sends it to 0, which then stands 1,000 below the max. Filling only to halfway between
    // the mean (90,000) and the max (110,000) sends it to 2.
    let workers = [(104_000u64, 2u32, 4u32), (110_000, 10, 4), (56_000, 6, 4)];
    let at = |level| place_one(&workers, 5_000, level, TieBreak::FewestRequests).worker;
    assert_eq!(at(1.0), 0);
    assert_eq!(at(0.5), 2);
    assert_eq!(at(0.0), 2);
    assert_eq!(DispatcherConfig::default().stage1_level, 0.5);
    // out of range is refused
    for bad in [-0.1, 1.5, f64::NAN] {
        let cfg = PolicyConfig {
            dispatcher: DispatcherConfig {
                stage1_level: bad,
                ..Default::default()
            },
            ..PolicyConfig::new(PolicyKind::Br0)
        };
        assert!(build_policy(&cfg).is_err(), "stage1_level {bad}");
    }
}

#[test]
fn next_finish_target_gives_the_larger_prompt_to_the_rank_that_finishes_first() {
    // Ranks 0 and 1 run ten requests each, 20_000 tokens (one of 11_000 and nine of 1_000),
    // one free slot each; rank 2 runs ten of 3_000 (30_000, full, the max). By the oracle one
    // 1_000 request of one rank ends in 5 steps and one of the other's in 75; nothing else ends
    // within H = 80. The rank finishing soon climbs 10·4 = 40 tokens before its next finish,
    // the other 10·74 = 740, rank 2 10·80 = 800: mean 526.7. Loads now: mean 23_333, both
    // free ranks 3_333 short of it. Waiting: 3_100, 3_800, 10_000. Rank 0 is served first
    // (equal free slots and margins, lowest id).
    // - Measured at the next finish, the rank finishing soon is 3_820 short and takes 3_800;
    //   the other is 3_120 short and takes 3_100 (3_800 would pass its target by 680).
    // - BR-0 (no horizon) sees only the loads now, equal in both layouts: rank 0 takes 3_100
    //   (3_800 passes the mean by 467) and rank 1 3_800 (the mean rose by then).
    let state = |soon: u32| {
        let mut st = ClusterState::with_workers(&[11, 11, 10]);
        let mut key = 100;
        let mut add = |st: &mut ClusterState, w: u32, prompt: u32, output: u32| {
            key += 1;
            st.reserve(RequestInfo {
                key,
                worker: w,
                prompt_tokens: prompt,
                generated: 0,
                phase: Phase::Running,
                prompt_hash: None,
                oracle_output: Some(output),
                expected_output: None,
                class: None,
            })
            .unwrap();
        };
        for w in 0..2 {
            add(&mut st, w, 11_000, 5_000);
            add(&mut st, w, 1_000, if w == soon { 5 } else { 75 });
            for _ in 0..8 {
                add(&mut st, w, 1_000, 5_000);
            }
        }
        for _ in 0..10 {
            add(&mut st, 2, 3_000, 5_000);
        }
        st
    };
    let pick = |st: &ClusterState, kind: PolicyKind| {
        let mut pool = Pool::new();
        for (i, s) in [3_100u32, 3_800, 10_000].into_iter().enumerate() {
            pool.push(PoolEntry {
                key: i as u64,
                prompt_tokens: s,
                prompt_hash: None,
                oracle_output: Some(1_000),
                expected_output: None,
                class: None,
            })
            .unwrap();
        }
        let cfg = PolicyConfig {
            brc: Default::default(),
            kind,
            dispatcher: DispatcherConfig {
                stage2_target: Stage2Target::NextFinish,
                ..Default::default()
            },
            horizon: HorizonParams::default(),
            seed: 0,
        };
        let mut out = Vec::new();
        build_policy(&cfg)
            .unwrap()
            .dispatch(&mut pool, st, &mut out);
        out.iter()
            .map(|a| (a.worker, a.prompt_tokens))
            .collect::<Vec<_>>()
    };
    let oracle = PolicyKind::BrH(br_core::PredictorKind::Oracle);
    assert_eq!(pick(&state(0), oracle), vec![(0, 3_800), (1, 3_100)]);
    assert_eq!(pick(&state(1), oracle), vec![(0, 3_100), (1, 3_800)]);
    // BR-0 has no horizon: the next-finish target is the load now
    for soon in [0, 1] {
        assert_eq!(
            pick(&state(soon), PolicyKind::Br0),
            vec![(0, 3_100), (1, 3_800)]
        );
    }
}

#[test]
fn the_stagger_term_puts_a_finish_where_the_rank_has_none() {
    // Worker 0 (one free slot) runs requests expected to end in 10, 20 and 100 steps; worker 1,
    // full, is more loaded. Two waiting requests of the same size: the older is expected to end
    // in 21 steps (beside the finish at 20), the newer in 60 (in the gap 20..100). Without the
    // term the older wins the tie; with it, the one that splits the gap.
    let mut st = ClusterState::with_workers(&[4, 1]);
    let running = [
        (100u64, 0u32, 1_000u32, 10u32),
        (101, 0, 1_000, 20),
        (102, 0, 1_000, 100),
    ];
    for (key, worker, s, left) in running.into_iter().chain([(103, 1, 9_000, 50)]) {
        st.reserve(RequestInfo {
            key,
            worker,
            prompt_tokens: s,
            generated: 5,
            phase: Phase::Running,
            prompt_hash: None,
            oracle_output: None,
            expected_output: Some(5 + left),
            class: None,
        })
        .unwrap();
    }
    let admitted = |stagger_weight: f64, proved: bool| {
        let mut pool = Pool::new();
        for (key, expected) in [(0u64, 21u32), (1, 60)] {
            pool.push(PoolEntry {
                key,
                prompt_tokens: 2_000,
                prompt_hash: None,
                oracle_output: None,
                expected_output: Some(expected),
                class: None,
            })
            .unwrap();
        }
        let cfg = PolicyConfig {
            dispatcher: DispatcherConfig {
                stagger_weight,
                ..Default::default()
            },
            ..PolicyConfig::new(PolicyKind::Br0)
        };
        let mut policy = build_policy(&cfg).unwrap();
        if proved {
            exact_hints_proved(policy.as_mut());
        }
        let mut out = Vec::new();
        policy.dispatch(&mut pool, &st, &mut out);
        out.iter().map(|a| (a.key, a.worker)).collect::<Vec<_>>()
    };
    assert_eq!(admitted(0.0, true), vec![(0, 0)]);
    assert_eq!(admitted(1.0, true), vec![(1, 0)]);
    // hints that have not yet proved precise are not used
    assert_eq!(admitted(1.0, false), vec![(0, 0)]);
}
