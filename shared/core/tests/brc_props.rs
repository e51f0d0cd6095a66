//! Property tests of BR-C (prefill waves): it never admits past a rank's free slots, never
//! admits a request twice, admits first come first served (with a look-ahead in a deep pool:
//! the oldest request always, the rest from the window the look-ahead opens, no rank above the
//! wave's share of prompt tokens but for the oldest's, and every free slot filled that a
//! passed-over request fits), holds a wave while a rank is still
//! prefilling, admits the oldest request once it has been held `max_wait_steps` ticks with a
//! free slot (`shallow_wait_steps` while fewer requests wait than there are free slots), and is
//! deterministic. Between waves in a shallow pool (`fill_under`) it gives prompts to ranks
//! with less prefill queued than the rank with the most, never past that most, and leaves
//! waiting only what fits under it nowhere. Its KV pass (`kv_swap`) admits the same requests, as many to each rank, with
//! no rank given more prompt tokens than the most without it, and no more KV after admission on
//! the rank with the most.

#![allow(clippy::unwrap_used)] // test fixtures: a panic is the failure report

use std::collections::HashSet;

use br_core::dispatch::{Admission, Stage};
use br_core::{
    BrcConfig, ClusterState, Phase, PolicyConfig, PolicyKind, Pool, PoolEntry, RequestInfo,
    build_policy,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Scenario {
    capacities: Vec<u32>,
    /// (worker, prompt, generated, running)
    existing: Vec<(usize, u32, u32, bool)>,
    /// prompt sizes, oldest first
    pool: Vec<u32>,
    cfg: BrcConfig,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (1usize..10, 1u32..8).prop_flat_map(|(g, b)| {
        (
            Just(vec![b; g]),
            prop::collection::vec(
                // running requests have written a token: they are past their prefill, so a
                // step between ticks changes no rank's prefilling
                (0..g, 1u32..20_000, 1u32..2_000, prop::bool::weighted(0.8)),
                0..(g * b as usize),
            ),
            prop::collection::vec(1u32..20_000, 0..60),
            0u32..8,
            0u32..8,
            prop_oneof![Just(1.0f64), 0.01f64..=1.0],
            any::<bool>(),
            prop_oneof![Just(0.0f64), Just(0.5), 0.0f64..=br_core::MAX_LOOKAHEAD],
            any::<bool>(),
            prop_oneof![Just(0.0f64), Just(0.25), 0.0f64..=br_core::MAX_FILL_SLACK],
        )
            .prop_map(
                |(
                    capacities,
                    existing,
                    pool,
                    max_wait_steps,
                    shallow_wait_steps,
                    wave_fraction,
                    kv_swap,
                    lookahead,
                    fill_under,
                    fill_slack,
                )| {
                    Scenario {
                        capacities,
                        existing,
                        pool,
                        cfg: BrcConfig {
                            max_wait_steps,
                            shallow_wait_steps,
                            wave_fraction,
                            kv_swap,
                            lookahead,
                            fill_under,
                            fill_slack,
                            // nothing finishes between these ticks: the mean output is unknown
                            ..BrcConfig::default()
                        },
                    }
                },
            )
    })
}

fn build(sc: &Scenario) -> (ClusterState, Pool) {
    let mut st = ClusterState::with_workers(&sc.capacities);
    for (i, &(w, s, j, running)) in sc.existing.iter().enumerate() {
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
            oracle_output: None,
            expected_output: None,
            class: None,
        })
        .unwrap();
    }
    let mut pool = Pool::new();
    for (i, &s) in sc.pool.iter().enumerate() {
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

/// Whether rule 6 (fill under) acts on this scenario's first tick: a rank is prefilling, the
/// pool is shallow, the guard does not release at once (a budget of 0), and a waiting prompt
/// fits on a rank with a free slot under the most prefill any live rank has queued.
fn fills_under(sc: &Scenario, st: &ClusterState) -> bool {
    let prefilling = st.workers().iter().any(|w| w.alive && w.prefilling > 0);
    let top = most_queued_prefill(st);
    sc.cfg.fill_under
        && prefilling
        && sc.cfg.shallow_wait_steps.min(sc.cfg.max_wait_steps) > 0
        && sc.pool.len() < st.total_free_slots() as usize
        && st.workers().iter().any(|w| {
            w.free_slots() > 0
                && sc
                    .pool
                    .iter()
                    .any(|&p| w.prefill_tokens + u64::from(p) <= top)
        })
}

fn most_queued_prefill(st: &ClusterState) -> u64 {
    st.workers()
        .iter()
        .filter(|w| w.alive)
        .map(|w| w.prefill_tokens)
        .max()
        .unwrap_or(0)
}

fn policy(cfg: BrcConfig) -> Box<dyn br_core::Policy> {
    build_policy(&PolicyConfig {
        brc: cfg,
        ..PolicyConfig::new(PolicyKind::Brc)
    })
    .unwrap()
}

/// Runs `ticks` ticks, one decode step of σ after each (as the simulator does; nothing
/// finishes, nothing admitted is started): every tick's admissions.
fn ticks(sc: &Scenario, ticks: usize) -> Vec<Vec<Admission>> {
    let (mut st, mut pool) = build(sc);
    let mut p = policy(sc.cfg);
    (0..ticks)
        .map(|_| {
            let mut out = Vec::new();
            p.dispatch(&mut pool, &st, &mut out);
            st.advance_step();
            out
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn a_tick_respects_slots_and_arrival_order(sc in scenario()) {
        let (mut st, pool0) = build(&sc);
        let mut pool = pool0.clone();
        let mut p = policy(sc.cfg);
        // a few ticks, a step after each, until the first admission (the wave's conditions
        // hold or the guard fires within max_wait_steps + 1 ticks)
        let mut out = Vec::new();
        for _ in 0..=sc.cfg.max_wait_steps {
            p.dispatch(&mut pool, &st, &mut out);
            if !out.is_empty() {
                break;
            }
            st.advance_step();
        }
        let keys: HashSet<u64> = out.iter().map(|a| a.key).collect();
        prop_assert_eq!(keys.len(), out.len(), "a request admitted twice");
        prop_assert_eq!(pool.len() + out.len(), sc.pool.len());
        let mut admitted = vec![0u32; sc.capacities.len()];
        for a in &out {
            prop_assert!(!pool.contains(a.key));
            prop_assert_eq!(a.prompt_tokens, sc.pool[a.key as usize]);
            admitted[a.worker as usize] += 1;
        }
        for (w, info) in st.workers().iter().enumerate() {
            prop_assert!(admitted[w] <= info.free_slots(), "worker {w}: {} admitted, {} free", admitted[w], info.free_slots());
        }
        let mut got: Vec<u64> = keys.into_iter().collect();
        got.sort_unstable();
        let free = st.total_free_slots() as usize;
        if fills_under(&sc, &st) {
            // rule 6 at the first tick: no rank above the most prefill queued, and nothing left
            // waiting that fits under it on a rank with a slot left (the room only shrinks
            // while the tick places, so what was passed over still fits nowhere)
            let top = most_queued_prefill(&st);
            let mut queued: Vec<u64> = st.workers().iter().map(|w| w.prefill_tokens).collect();
            for a in &out {
                prop_assert_eq!(a.stage, Stage::Greedy);
                queued[a.worker as usize] += u64::from(a.prompt_tokens);
            }
            prop_assert!(!out.is_empty());
            for (w, info) in st.workers().iter().enumerate() {
                prop_assert!(queued[w] <= top, "worker {w}: {} queued, the most {top}", queued[w]);
                if admitted[w] < info.free_slots() {
                    for k in (0..sc.pool.len()).filter(|k| !got.contains(&(*k as u64))) {
                        prop_assert!(queued[w] + u64::from(sc.pool[k]) > top, "worker {w} left a slot that request {k} fits");
                    }
                }
            }
        } else if sc.pool.is_empty() || free == 0 {
            prop_assert!(out.is_empty());
        } else if sc.pool.len() > free && sc.cfg.lookahead > 0.0 {
            // a deep pool with a look-ahead: the oldest request, the rest from the window
            let window = free + (sc.cfg.lookahead * free as f64).ceil() as usize;
            prop_assert_eq!(got[0], 0, "the oldest request is in every wave");
            prop_assert!(got.iter().all(|&k| (k as usize) < window), "{:?} beyond {}", got, window);
            if !sc.cfg.kv_swap {
                // no rank above the share of the requests first in line (or the oldest
                // prompt) but by the oldest itself, and a free slot left empty only where no
                // passed-over request of the window fits under that
                let cap = (sc.pool[..free].iter().map(|&t| u64::from(t)).sum::<u64>() as f64
                    / st.workers().iter().filter(|w| w.free_slots() > 0).count() as f64)
                    .max(f64::from(sc.pool[0]));
                let mut tokens = vec![0u64; sc.capacities.len()];
                for a in &out {
                    if a.key != 0 {
                        tokens[a.worker as usize] += u64::from(a.prompt_tokens);
                    }
                }
                for (w, &t) in tokens.iter().enumerate() {
                    prop_assert!(t as f64 <= cap, "worker {w}: {t} prompt tokens, cap {cap}");
                }
                if let Some(oldest) = out.iter().find(|a| a.key == 0) {
                    tokens[oldest.worker as usize] += u64::from(oldest.prompt_tokens);
                }
                let passed: Vec<u32> = (0..window.min(sc.pool.len()))
                    .filter(|k| !got.contains(&(*k as u64)))
                    .map(|k| sc.pool[k])
                    .collect();
                for (w, info) in st.workers().iter().enumerate() {
                    if admitted[w] < info.free_slots() {
                        for &p in &passed {
                            prop_assert!(
                                (tokens[w] + u64::from(p)) as f64 > cap,
                                "worker {w} left a slot empty that a {p}-token prompt fits (tokens {}, cap {cap})",
                                tokens[w]
                            );
                        }
                    }
                }
            }
        } else {
            // first come, first served: the admitted requests are the oldest ones, and a wave
            // fills every free slot it can
            prop_assert_eq!(&got, &(0..out.len() as u64).collect::<Vec<_>>());
            prop_assert_eq!(out.len(), free.min(sc.pool.len()), "the oldest waited max_wait_steps with a free slot");
        }
    }

    #[test]
    fn holds_while_a_rank_prefills_until_the_guard(sc in scenario()) {
        let (st, _) = build(&sc);
        let prefilling = st.workers().iter().any(|w| w.alive && w.prefilling > 0);
        let free = st.total_free_slots();
        let runs = ticks(&sc, sc.cfg.max_wait_steps as usize + 2);
        let first = runs.iter().position(|o| !o.is_empty());
        if sc.pool.is_empty() || free == 0 {
            prop_assert_eq!(first, None);
        } else {
            // held only while a rank prefills, or too few ranks have a free slot or too few
            // requests wait; then exactly as long as the guard's budget: the shallow one when
            // fewer requests wait than there are free slots (σ does not move between ticks)
            let first = first.unwrap();
            let free_ranks = st.workers().iter().filter(|w| w.free_slots() > 0).count();
            let needed = ((sc.cfg.wave_fraction * st.live_workers() as f64).ceil() as usize).max(1);
            let wave_ready = !prefilling && free_ranks >= needed && sc.pool.len() >= needed;
            let budget = if sc.pool.len() < free as usize {
                sc.cfg.shallow_wait_steps.min(sc.cfg.max_wait_steps)
            } else {
                sc.cfg.max_wait_steps
            };
            let expected = if wave_ready || fills_under(&sc, &st) { 0 } else { budget as usize };
            prop_assert_eq!(first, expected);
        }
    }

    #[test]
    fn the_kv_pass_keeps_the_wave_and_its_most_prompt_tokens(sc in scenario()) {
        let (st, _) = build(&sc);
        let run = |kv_swap: bool| {
            let sc = Scenario { cfg: BrcConfig { kv_swap, ..sc.cfg }, ..sc.clone() };
            // the first wave: later ones start from different σs
            ticks(&sc, sc.cfg.max_wait_steps as usize + 2)
                .into_iter()
                .find(|o| !o.is_empty())
                .unwrap_or_default()
        };
        let (plain, swapped) = (run(false), run(true));
        let g = sc.capacities.len();
        // per rank: requests, prompt tokens, KV after admission
        let per_rank = |out: &[Admission]| {
            let mut r = vec![(0u32, 0u64, 0u64); g];
            for (w, info) in st.workers().iter().enumerate() {
                r[w].2 = info.load();
            }
            for a in out {
                let x = &mut r[a.worker as usize];
                x.0 += 1;
                x.1 += u64::from(a.prompt_tokens);
                x.2 += u64::from(a.prompt_tokens);
            }
            r
        };
        let keys = |out: &[Admission]| {
            let mut k: Vec<u64> = out.iter().map(|a| a.key).collect();
            k.sort_unstable();
            k
        };
        prop_assert_eq!(keys(&plain), keys(&swapped));
        let (p, s) = (per_rank(&plain), per_rank(&swapped));
        prop_assert_eq!(
            p.iter().map(|x| x.0).collect::<Vec<_>>(),
            s.iter().map(|x| x.0).collect::<Vec<_>>()
        );
        let most = |r: &[(u32, u64, u64)], f: fn(&(u32, u64, u64)) -> u64| {
            r.iter().map(f).max().unwrap_or(0)
        };
        prop_assert!(most(&s, |x| x.1) <= most(&p, |x| x.1), "{p:?} {s:?}");
        prop_assert!(most(&s, |x| x.2) <= most(&p, |x| x.2), "{p:?} {s:?}");
    }

    #[test]
    fn deterministic(sc in scenario()) {
        // the score is NaN (BR-C scores nothing), so compare the rest
        let plain = |runs: Vec<Vec<Admission>>| -> Vec<Vec<(u64, u32, u32)>> {
            runs.into_iter()
                .map(|o| o.into_iter().map(|a| (a.key, a.worker, a.prompt_tokens)).collect())
                .collect()
        };
        prop_assert_eq!(plain(ticks(&sc, 6)), plain(ticks(&sc, 6)));
    }
}

#[test]
fn a_wave_gives_the_few_slot_rank_the_large_prompt() {
    // rank 0 has one free slot, rank 1 three: the 3,000-token prompt goes to rank 0 and the
    // three small ones to rank 1 (3,000 tokens each)
    let sc = Scenario {
        capacities: vec![4, 4],
        existing: vec![
            (0, 100, 5, true),
            (0, 100, 5, true),
            (0, 100, 5, true),
            (1, 100, 5, true),
        ],
        pool: vec![1_000, 3_000, 1_000, 1_000],
        cfg: BrcConfig::default(),
    };
    let out = &ticks(&sc, 1)[0];
    let mut tokens = [0u32; 2];
    for a in out {
        tokens[a.worker as usize] += a.prompt_tokens;
    }
    assert_eq!(out.len(), 4);
    assert_eq!(tokens, [3_000, 3_000]);
}

#[test]
fn a_deep_pool_wave_pairs_the_oldest_prompt_with_one_its_size() {
    // two ranks with a free slot each; the oldest prompts are 5,000 and 1,000 tokens, the next
    // 5,000: taking the oldest two runs a 5,000-token prefill beside a 1,000-token one (the
    // group stalls for the 5,000 either way); looking ahead, both ranks run 5,000 and the
    // 1,000 waits for a wave of its size
    let sc = |lookahead| Scenario {
        capacities: vec![2, 2],
        existing: vec![(0, 100, 5, true), (1, 100, 5, true)],
        pool: vec![5_000, 1_000, 5_000, 1_000],
        cfg: BrcConfig {
            lookahead,
            ..BrcConfig::default()
        },
    };
    let wave = |lookahead| {
        let mut w: Vec<(u64, u32)> = ticks(&sc(lookahead), 1)[0]
            .iter()
            .map(|a| (a.key, a.prompt_tokens))
            .collect();
        w.sort_unstable();
        w
    };
    assert_eq!(wave(0.0), [(0, 5_000), (1, 1_000)]);
    assert_eq!(wave(0.5), [(0, 5_000), (2, 5_000)]);
}

#[test]
fn the_kv_pass_gives_the_large_prompt_to_the_rank_with_less_kv() {
    // rank 0 holds 10,000 KV tokens more than rank 1 and has two free slots, rank 1 three; the
    // spread gives rank 0 the 2,000 and the 1,200 (3,200, the wave's most) and rank 1 the
    // 1,500, the 800 and the 300 (2,600); the KV pass trades the 2,000 for the 1,500 (rank 1
    // to 3,100, under the most) and leaves the rest
    let sc = Scenario {
        capacities: vec![3, 4],
        existing: vec![(0, 20_000, 5, true), (1, 10_000, 5, true)],
        pool: vec![2_000, 1_200, 800, 300, 1_500],
        cfg: BrcConfig {
            kv_swap: true,
            ..BrcConfig::default()
        },
    };
    let tokens = |sc: &Scenario| {
        let mut t = [0u32; 2];
        for a in &ticks(sc, 1)[0] {
            t[a.worker as usize] += a.prompt_tokens;
        }
        t
    };
    let plain = Scenario {
        cfg: BrcConfig {
            kv_swap: false,
            ..BrcConfig::default()
        },
        ..sc.clone()
    };
    assert_eq!(tokens(&plain), [3_200, 2_600]);
    assert_eq!(tokens(&sc), [2_700, 3_100]);
}

#[test]
fn brc_parses_and_validates() {
    assert_eq!("brc".parse::<PolicyKind>().unwrap(), PolicyKind::Brc);
    assert_eq!(PolicyKind::Brc.mode(), br_core::Mode::Pooled);
    let bad = PolicyConfig {
        brc: BrcConfig {
            wave_fraction: 0.0,
            ..BrcConfig::default()
        },
        ..PolicyConfig::new(PolicyKind::Brc)
    };
    assert!(bad.validate().is_err());
    for lookahead in [-0.1, 4.5, f64::NAN, f64::INFINITY] {
        let e = BrcConfig {
            lookahead,
            ..BrcConfig::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("lookahead must be in [0, 4]"), "{e}");
    }
    for lookahead in [0.0, 0.5, 4.0] {
        assert!(
            BrcConfig {
                lookahead,
                ..BrcConfig::default()
            }
            .validate()
            .is_ok()
        );
    }
    // A given shallow budget up to the deep one passes; above it, it is refused.
    let budgets = |max_wait_steps, shallow_wait_steps| BrcConfig {
        max_wait_steps,
        shallow_wait_steps,
        ..BrcConfig::default()
    };
    assert!(BrcConfig::default().validate_given_shallow().is_ok());
    assert!(budgets(4, 4).validate_given_shallow().is_ok());
    assert!(budgets(4, 5).validate_given_shallow().is_err());
}
