//! BR-H with its per-request prediction cache decides exactly as without it: over a run of
//! ticks in which requests generate tokens, finish, arrive and get admitted, and the predictor
//! learns, the policy (cached) and a reference that asks the predictor about every request
//! each tick (`Margins::horizon` + `dispatch_tick`, the code before the cache) admit the same
//! requests to the same workers with the same scores, and build the same margins.

#![allow(clippy::unwrap_used)] // test fixtures: a panic is the failure report

use br_core::PredictorKind;
use br_core::dispatch::{DispatcherConfig, dispatch_tick};
use br_core::predict::{Finished, Oracle, PredictionCache, Predictor, PredictorConfig, Survival};
use br_core::score::{HorizonParams, Margins};
use br_core::{
    ClusterState, Phase, PolicyConfig, PolicyKind, Pool, PoolEntry, RequestInfo, build_policy,
};
use proptest::prelude::*;

/// What happens between two ticks.
#[derive(Debug, Clone)]
enum Event {
    /// Every running request whose key is ≡ `residue` (mod 3) generates `tokens` more.
    Generate { residue: u64, tokens: u32 },
    /// The `nth` request (in σ's order) finishes after its tokens; the predictor learns.
    Finish { nth: usize },
    /// A request arrives in the pool.
    Arrive { prompt: u32, hash: u64, output: u32 },
    /// A queued request starts running.
    Start { nth: usize },
    /// The predictor learns a length (at least 1) near the `nth` request's age `j` for a
    /// prompt like its: a finish elsewhere, aimed at the edges of what one sample changes.
    Learn { nth: usize, at: Edge, offset: i32 },
}

/// Where a learned length is aimed, relative to a request that generated `j` tokens.
#[derive(Debug, Clone, Copy)]
enum Edge {
    /// `j + offset`: below, at or just above its age.
    Age,
    /// `j + H + offset`: at the end of its horizon.
    Horizon,
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        (0u64..3, 1u32..40).prop_map(|(residue, tokens)| Event::Generate { residue, tokens }),
        (0usize..64).prop_map(|nth| Event::Finish { nth }),
        (1u32..8_000, 0u64..6, 1u32..400).prop_map(|(prompt, hash, output)| Event::Arrive {
            prompt,
            hash,
            output
        }),
        (0usize..64).prop_map(|nth| Event::Start { nth }),
        (
            0usize..64,
            prop_oneof![Just(Edge::Age), Just(Edge::Horizon)],
            -2i32..3
        )
            .prop_map(|(nth, at, offset)| Event::Learn { nth, at, offset }),
    ]
}

fn predictor(kind: PredictorKind, config: &PredictorConfig) -> Box<dyn Predictor> {
    match kind {
        PredictorKind::Survival => Box::new(config.survival()),
        PredictorKind::ExactMatch => Box::new(config.exact_match()),
        PredictorKind::Oracle => Box::new(Oracle),
        PredictorKind::Hinted => Box::new(config.hinted()),
        PredictorKind::Classed => Box::new(config.classed()),
    }
}

/// The gateway's class of request `key`: none for a fifth of the requests, else one of four
/// (so classes warm up, turn usable and, with a small table, overflow it mid-run).
fn class_of(key: u64) -> Option<u64> {
    (!key.is_multiple_of(5)).then_some(key % 4)
}

/// The client's hint for request `key` with true output `output`: none for a quarter of the
/// requests, and for the rest exact, half, or twice the truth (so Hinted learns a spread of
/// ratios and gives hints weight, and hinted and unhinted requests share the cache).
fn hint_of(key: u64, output: u32) -> Option<u32> {
    match key % 4 {
        0 => None,
        1 => Some(output),
        2 => Some(output.div_ceil(2)),
        _ => Some(output.saturating_mul(2)),
    }
}

/// The predictors' memory and warm-up: the defaults, or a few samples per octave and an
/// ExactMatch that holds two hashes (so octaves turn usable mid-run and hashes are evicted,
/// the two ways an observation changes what other requests read) and a Hinted that uses hints
/// after a few hinted finishes (so their weight turns positive mid-run).
fn predictor_config() -> impl Strategy<Value = PredictorConfig> {
    prop_oneof![
        Just(PredictorConfig::default()),
        (1u64..6, 1usize..4, any::<bool>(), 1u64..6, 1usize..4).prop_map(
            |(min_samples, max_hashes, buckets, min_hinted, max_classes)| PredictorConfig {
                min_samples,
                max_hashes,
                prompt_buckets: buckets,
                min_hinted,
                max_classes,
                ..PredictorConfig::default()
            }
        ),
    ]
}

type Scenario = (
    PredictorKind,
    PredictorConfig,
    u32,
    u32,
    u32,
    Vec<Vec<Event>>,
    Vec<u32>,
);

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        prop_oneof![
            Just(PredictorKind::Survival),
            Just(PredictorKind::ExactMatch),
            Just(PredictorKind::Oracle),
            Just(PredictorKind::Hinted),
            Just(PredictorKind::Classed)
        ],
        predictor_config(),
        // BR-H's horizon: the defaults' order, or a few steps (so that lengths land on its edge)
        prop_oneof![Just(40u32), 1u32..6],
        1u32..9,
        1u32..6,
        // up to 24 events between ticks: more finishes of one octave than the cache keeps
        prop::collection::vec(prop::collection::vec(event(), 0..24), 1..25),
        // lengths the predictor learned before the run (Survival needs 32 to say anything)
        prop::collection::vec(1u32..600, 0..80),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn cached_and_uncached_brh_choose_the_same(
        (kind, config, horizon, workers, capacity, rounds, warm) in scenario(),
    ) {
        let params = HorizonParams { horizon, predictor: config, ..HorizonParams::default() };
        let cfg = PolicyConfig {
            brc: Default::default(),
            kind: PolicyKind::BrH(kind),
            dispatcher: DispatcherConfig::default(),
            horizon: params,
            seed: 1,
        };
        let mut cached = build_policy(&cfg).unwrap();
        let mut reference = predictor(kind, &config);
        // A cache that lives through the whole run beside the policy's, told what each
        // observation changed by its own predictor (fed the same lengths as the reference):
        // its margins must equal the uncached ones every round.
        let mut tracked = predictor(kind, &config);
        let mut long_lived = PredictionCache::new();
        for (i, &len) in warm.iter().enumerate() {
            let hash = Some(i as u64 % 6);
            let f = Finished {
                prompt_tokens: 100 + 700 * (i as u32 % 5),
                prompt_hash: hash,
                output_tokens: len,
                expected_output: hint_of(i as u64, len),
                class: class_of(i as u64),
            };
            cached.observe_finished(&f);
            reference.observe(&f);
            long_lived.learned(tracked.learn(&f));
        }
        let mut state = ClusterState::with_workers(&vec![capacity; workers as usize]);
        let (mut pool_a, mut pool_b) = (Pool::new(), Pool::new());
        let mut next_key = 1u64;
        for events in rounds {
            for e in events {
                match e {
                    Event::Generate { residue, tokens } => {
                        let grow: Vec<(u64, u32)> = state
                            .requests()
                            .filter(|r| r.phase == Phase::Running && r.key % 3 == residue)
                            .map(|r| (r.key, r.generated + tokens))
                            .collect();
                        for (key, generated) in grow {
                            state.set_generated(key, generated).unwrap();
                        }
                    }
                    Event::Finish { nth } => {
                        let n = state.request_count();
                        if n > 0 {
                            let key = state.requests().nth(nth % n).unwrap().key;
                            let r = state.remove(key).unwrap();
                            let tokens = r.generated.max(1);
                            let f = Finished {
                                prompt_tokens: r.prompt_tokens,
                                prompt_hash: r.prompt_hash,
                                output_tokens: tokens,
                                expected_output: r.expected_output,
                                class: r.class,
                            };
                            cached.observe_finished(&f);
                            reference.observe(&f);
                            long_lived.learned(tracked.learn(&f));
                        }
                    }
                    Event::Arrive { prompt, hash, output } => {
                        let entry = PoolEntry {
                            key: next_key,
                            prompt_tokens: prompt,
                            prompt_hash: Some(hash),
                            oracle_output: Some(output),
                            expected_output: hint_of(next_key, output),
                            class: class_of(next_key),
                        };
                        next_key += 1;
                        pool_a.push(entry.clone()).unwrap();
                        pool_b.push(entry).unwrap();
                    }
                    Event::Learn { nth, at, offset } => {
                        let n = state.request_count();
                        if n > 0 {
                            let r = state.requests().nth(nth % n).unwrap();
                            let f = Finished {
                                prompt_tokens: r.prompt_tokens,
                                prompt_hash: r.prompt_hash,
                                output_tokens: match at {
                                    Edge::Age => r.generated,
                                    Edge::Horizon => r.generated + horizon,
                                }
                                .saturating_add_signed(offset)
                                .max(1),
                                expected_output: r.expected_output,
                                class: r.class,
                            };
                            cached.observe_finished(&f);
                            reference.observe(&f);
                            long_lived.learned(tracked.learn(&f));
                        }
                    }
                    Event::Start { nth } => {
                        let queued: Vec<u64> = state
                            .requests()
                            .filter(|r| r.phase == Phase::Queued)
                            .map(|r| r.key)
                            .collect();
                        if !queued.is_empty() {
                            state.activate(queued[nth % queued.len()]).unwrap();
                        }
                    }
                }
            }
            // The margins themselves are equal, not only the choices made from them.
            let uncached_margins = Margins::horizon(&state, &params, reference.as_ref());
            let mut fresh = PredictionCache::new();
            let once = Margins::horizon_cached(&state, &params, reference.as_ref(), &mut fresh);
            prop_assert_eq!(&uncached_margins, &once);
            let kept = Margins::horizon_cached(&state, &params, tracked.as_ref(), &mut long_lived);
            prop_assert_eq!(&uncached_margins, &kept);

            let mut a = Vec::new();
            cached.dispatch(&mut pool_a, &state, &mut a);
            let mut b = Vec::new();
            if !pool_b.is_empty() && state.total_free_slots() > 0 {
                let mut margins = uncached_margins;
                dispatch_tick(&cfg.dispatcher, &mut pool_b, &state, &mut margins, &mut b);
            }
            prop_assert_eq!(&a, &b);
            for adm in &a {
                let entry_output = adm.key as u32 % 300 + 1;
                state
                    .reserve(RequestInfo {
                        key: adm.key,
                        worker: adm.worker,
                        prompt_tokens: adm.prompt_tokens,
                        generated: 0,
                        phase: Phase::Queued,
                        prompt_hash: Some(adm.key % 6),
                        oracle_output: Some(entry_output),
                        expected_output: hint_of(adm.key, entry_output),
                        class: class_of(adm.key),
                    })
                    .unwrap();
            }
        }
    }
}

/// A tick on an unchanged σ reuses every prediction; one token more re-predicts just that
/// request; the predictor learning re-predicts all of them.
#[test]
fn cache_reuses_only_what_is_unchanged() {
    let params = HorizonParams::default();
    let mut st = ClusterState::with_workers(&[64, 64]);
    for key in 1..=100u64 {
        st.reserve(RequestInfo {
            key,
            worker: (key % 2) as u32,
            prompt_tokens: 100,
            generated: 5,
            phase: Phase::Running,
            prompt_hash: None,
            oracle_output: Some(50),
            expected_output: None,
            class: None,
        })
        .unwrap();
    }
    let mut cache = PredictionCache::new();
    let _ = Margins::horizon_cached(&st, &params, &Oracle, &mut cache);
    assert_eq!(cache.hit_counts(), (0, 100));
    let _ = Margins::horizon_cached(&st, &params, &Oracle, &mut cache);
    assert_eq!(cache.hit_counts(), (100, 100));
    st.set_generated(3, 6).unwrap();
    let m = Margins::horizon_cached(&st, &params, &Oracle, &mut cache);
    assert_eq!(cache.hit_counts(), (199, 101));
    assert_eq!(m, Margins::horizon(&st, &params, &Oracle));
    cache.invalidate();
    let m = Margins::horizon_cached(&st, &params, &Oracle, &mut cache);
    assert_eq!(cache.hit_counts(), (199, 201));
    assert_eq!(m, Margins::horizon(&st, &params, &Oracle));
    // A request that left leaves its slot to the next one, which is predicted anew (it ends
    // at another length: a prediction is a function of the request's prompt, generated
    // tokens, hash, oracle length and hint, so a newcomer equal in all five may keep the
    // entry).
    st.remove(7).unwrap();
    st.reserve(RequestInfo {
        key: 1_000,
        worker: 1,
        prompt_tokens: 100,
        generated: 5,
        phase: Phase::Running,
        prompt_hash: None,
        oracle_output: Some(60),
        expected_output: None,
        class: None,
    })
    .unwrap();
    let m = Margins::horizon_cached(&st, &params, &Oracle, &mut cache);
    assert_eq!(cache.hit_counts(), (298, 202));
    assert_eq!(m, Margins::horizon(&st, &params, &Oracle));
    assert!(cache.len() <= st.slot_count());
    // One equal in all five (another key, another worker, queued) reuses the entry: the same
    // prediction.
    st.remove(1_000).unwrap();
    st.reserve(RequestInfo {
        key: 2_000,
        worker: 0,
        prompt_tokens: 100,
        generated: 5,
        phase: Phase::Queued,
        prompt_hash: None,
        oracle_output: Some(60),
        expected_output: None,
        class: None,
    })
    .unwrap();
    let m = Margins::horizon_cached(&st, &params, &Oracle, &mut cache);
    assert_eq!(cache.hit_counts(), (398, 202));
    assert_eq!(m, Margins::horizon(&st, &params, &Oracle));
}

/// A running request without a hash or an oracle length (what Survival predicts from).
fn running(key: u64, worker: u32, prompt_tokens: u32, generated: u32) -> RequestInfo {
    RequestInfo {
        key,
        worker,
        prompt_tokens,
        generated,
        phase: Phase::Running,
        prompt_hash: None,
        oracle_output: None,
        expected_output: None,
        class: None,
    }
}

/// A finished request without a hash.
fn finish(prompt_tokens: u32, output_tokens: u32) -> Finished {
    Finished {
        prompt_tokens,
        prompt_hash: None,
        output_tokens,
        expected_output: None,
        class: None,
    }
}

/// A Survival finish of length L re-predicts only what it can change: requests of its
/// prompt-length octave (or predicted from the global prior) that generated fewer than L
/// tokens and either are within the horizon H below L or were predicted to finish inside it.
#[test]
fn a_finish_re_predicts_only_what_its_length_can_change() {
    let params = HorizonParams::default();
    assert_eq!(
        (params.horizon, params.gate),
        (80, 0.5),
        "the cases below assume these"
    );
    let mut st = ClusterState::with_workers(&[64, 64]);
    for key in 1..=100u64 {
        // octave 7 (64..127) and octave 13 (4,096..8,191)
        let prompt = if key <= 50 { 100 } else { 5_000 };
        st.reserve(running(key, (key % 2) as u32, prompt, 5))
            .unwrap();
    }
    let mut survival = Survival::with_buckets(4096, 4, true);
    let mut cache = PredictionCache::new();
    let tick = |st: &ClusterState, survival: &Survival, cache: &mut PredictionCache| {
        let m = Margins::horizon_cached(st, &params, survival, cache);
        assert_eq!(m, Margins::horizon(st, &params, survival));
        cache.hit_counts()
    };
    for _ in 0..4 {
        cache.learned(survival.learn(&finish(100, 50)));
        cache.learned(survival.learn(&finish(5_000, 1_000)));
    }
    assert_eq!(tick(&st, &survival, &mut cache), (0, 100));
    // Octave 13 knows lengths of 1,000: its requests at 5 tokens run past the horizon (85), and
    // a length of 900 is beyond it too. The other octave did not change.
    cache.learned(survival.learn(&finish(5_000, 900)));
    assert_eq!(
        tick(&st, &survival, &mut cache),
        (100, 100),
        "nothing again"
    );
    // Ten long prompts 50 below 900 (within the horizon), ten past it (950: predicted to end
    // with the 1,000s, inside the horizon).
    for key in 51..=60 {
        st.set_generated(key, 850).unwrap();
    }
    for key in 61..=70 {
        st.set_generated(key, 950).unwrap();
    }
    assert_eq!(
        tick(&st, &survival, &mut cache),
        (180, 120),
        "the 20 that moved"
    );
    // Each finish, and the (hits, misses) after the next tick.
    let steps = [
        (
            5_000,
            920,
            (270, 130),
            "the 10 at 850: 920 is inside their horizon, below 950",
        ),
        // 1,200 is beyond the horizon of those at 850 (now predicted to run on: 2 of 7
        // lengths end inside it) and above the age of those at 950, which were predicted to
        // finish: their probability changes.
        (5_000, 1_200, (360, 140), "the 10 at 950"),
        // An octave no request is in: it changes the global prior, which no prediction reads
        // now that both octaves have their own distribution.
        (20_000, 10, (460, 140), "none"),
        // Octave 7's requests are at 5 tokens and predicted to finish with the 50s.
        (100, 3, (560, 140), "none: 3 is below their age"),
        (
            100,
            60,
            (610, 190),
            "octave 7's 50: 60 changes their probability",
        ),
    ];
    for (prompt, length, counts, which) in steps {
        cache.learned(survival.learn(&finish(prompt, length)));
        assert_eq!(
            tick(&st, &survival, &mut cache),
            counts,
            "re-predicted: {which}"
        );
    }
}

/// An octave reaching `min_samples` moves its requests from the global prior to their own
/// distribution: all of them are predicted again, whatever the length.
#[test]
fn an_octave_turning_usable_re_predicts_its_requests() {
    let params = HorizonParams::default();
    let mut st = ClusterState::with_workers(&[64]);
    for key in 1..=10u64 {
        st.reserve(running(key, 0, 5_000, 500)).unwrap();
    }
    let mut survival = Survival::with_buckets(4096, 4, true);
    let mut cache = PredictionCache::new();
    // The global prior: lengths just past their age (they are predicted to finish).
    for _ in 0..4 {
        cache.learned(survival.learn(&finish(100, 520)));
    }
    let _ = Margins::horizon_cached(&st, &params, &survival, &mut cache);
    assert_eq!(cache.hit_counts(), (0, 10));
    // Three lengths below their age in their own octave: spared (not yet its own distribution).
    for _ in 0..3 {
        cache.learned(survival.learn(&finish(5_000, 100)));
    }
    let m = Margins::horizon_cached(&st, &params, &survival, &mut cache);
    assert_eq!(m, Margins::horizon(&st, &params, &survival));
    assert_eq!(cache.hit_counts(), (10, 10));
    // The fourth makes the octave theirs: predicted again although 100 is below their age.
    cache.learned(survival.learn(&finish(5_000, 100)));
    let m = Margins::horizon_cached(&st, &params, &survival, &mut cache);
    assert_eq!(m, Margins::horizon(&st, &params, &survival));
    assert_eq!(cache.hit_counts(), (10, 20));
}

/// A request spared at a tick is current again from then on: harmless finishes before every
/// tick, many more than the cache keeps per source, never make it predict the request again.
#[test]
fn a_request_spared_at_every_tick_stays_cached() {
    let params = HorizonParams::default();
    let mut st = ClusterState::with_workers(&[64]);
    st.reserve(running(1, 0, 5_000, 10)).unwrap();
    let mut survival = Survival::with_buckets(4096, 4, true);
    let mut cache = PredictionCache::new();
    let long = finish(5_000, 2_000);
    for _ in 0..4 {
        cache.learned(survival.learn(&long));
    }
    let _ = Margins::horizon_cached(&st, &params, &survival, &mut cache);
    for tick in 1..=40u64 {
        // 2,000 is far beyond the horizon of a request at 10 tokens that runs on
        cache.learned(survival.learn(&long));
        let m = Margins::horizon_cached(&st, &params, &survival, &mut cache);
        assert_eq!(m, Margins::horizon(&st, &params, &survival));
        assert_eq!(cache.hit_counts(), (tick, 1), "tick {tick}");
    }
}

/// A request that takes the slot of one equal in all but its hint is predicted anew: the hint
/// is an input of Hinted's prediction.
#[test]
fn a_request_with_another_hint_is_predicted_anew() {
    let params = HorizonParams::default();
    let mut hinted = PredictorConfig::default().hinted();
    for o in 100..1_100u32 {
        hinted.observe(&Finished {
            prompt_tokens: 100,
            prompt_hash: None,
            output_tokens: o,
            expected_output: Some(o),
            class: None,
        });
    }
    let request = |key, expected_output| RequestInfo {
        expected_output,
        ..running(key, 0, 100, 500)
    };
    let mut st = ClusterState::with_workers(&[64, 64]);
    // 20 tokens left by its hint: it finishes within the horizon
    st.reserve(request(1, Some(520))).unwrap();
    let mut cache = PredictionCache::new();
    let soon = Margins::horizon_cached(&st, &params, &hinted, &mut cache);
    assert_eq!(soon, Margins::horizon(&st, &params, &hinted));
    // the same request but for a hint of 5,000 tokens, in the same slot: it runs on
    st.remove(1).unwrap();
    st.reserve(request(2, Some(5_000))).unwrap();
    let later = Margins::horizon_cached(&st, &params, &hinted, &mut cache);
    assert_eq!(later, Margins::horizon(&st, &params, &hinted));
    assert_ne!(soon, later, "the hint changes the prediction");
    assert_eq!(cache.hit_counts(), (0, 2));
}

#[test]
fn a_request_of_another_class_is_predicted_anew() {
    let params = HorizonParams::default();
    let mut classed = PredictorConfig::default().classed();
    // class 1 finishes at 500-520 tokens, class 2 at 5,000-5,200
    for i in 0..200u32 {
        for (class, base) in [(1, 500), (2, 5_000)] {
            classed.observe(&Finished {
                prompt_tokens: 100,
                prompt_hash: None,
                output_tokens: base + i % 20,
                expected_output: None,
                class: Some(class),
            });
        }
    }
    let request = |key, class| RequestInfo {
        class: Some(class),
        ..running(key, 0, 100, 500)
    };
    let mut st = ClusterState::with_workers(&[64, 64]);
    // at 500 tokens, a request of class 1 finishes within the horizon
    st.reserve(request(1, 1)).unwrap();
    let mut cache = PredictionCache::new();
    let soon = Margins::horizon_cached(&st, &params, &classed, &mut cache);
    assert_eq!(soon, Margins::horizon(&st, &params, &classed));
    // the same request but of class 2, in the same slot: it runs on
    st.remove(1).unwrap();
    st.reserve(request(2, 2)).unwrap();
    let later = Margins::horizon_cached(&st, &params, &classed, &mut cache);
    assert_eq!(later, Margins::horizon(&st, &params, &classed));
    assert_ne!(soon, later, "the class changes the prediction");
    assert_eq!(cache.hit_counts(), (0, 2));
}
