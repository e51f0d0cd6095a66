//! BR-H learns online from what σ reports finished: the prompt length, hash and the gateway's
//! hints σ holds for the request, and its final output length; the gauges show what the
//! predictor holds. The hints of an Assign reach the predictor at every hop.

use br_core::{Phase, PredictorKind};

use super::*;

#[test]
fn brh_learns_from_finished_requests_in_sigma() {
    let mut fx = Fx::new(PolicyKind::BrH(PredictorKind::ExactMatch), &[0, 0], 4);
    assert_eq!(fx.core.policy.predictor_stats().map(|s| s.samples), Some(0));
    // Reserved with a hash (as the gateway sends it), runs, finishes after 300 tokens.
    fx.sigma_change(vec![change::request_reserved(
        "a",
        0,
        100,
        5_000,
        Some(42),
        None,
    )]);
    fx.sigma_change(vec![change::request_progress("a", 0, 100, 5_000, 120)]);
    fx.sigma_change(vec![change::request_finished("a", 300)]);
    // One without a hash (a worker reported it; no reservation).
    fx.sigma_change(vec![change::request_progress("b", 1, 101, 900, 10)]);
    fx.sigma_change(vec![change::request_finished("b", 50)]);
    let st = fx
        .core
        .policy
        .predictor_stats()
        .expect("BR-H has a predictor");
    assert_eq!(st.samples, 2);
    assert_eq!(st.hashes, 1, "only a sent a hash");
    assert_eq!(st.buckets, 2, "5,000 and 900 tokens are different octaves");
    let [samples, hashes, buckets, hinted, classes] = &fx.core.metrics.predictor_entries;
    assert_eq!((samples.get(), hashes.get(), buckets.get()), (2, 1, 2));
    assert_eq!(hinted.get(), 0, "ExactMatch keeps no hints");
    assert_eq!(classes.get(), 0, "nor classes");
    assert!(fx.core.metrics.predictor_bytes.get() > 0);
}

#[test]
fn br0_has_no_predictor_and_leaves_the_gauges_at_zero() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 4);
    fx.sigma_change(vec![change::request_progress("a", 0, 100, 800, 10)]);
    fx.sigma_change(vec![change::request_finished("a", 20)]);
    assert_eq!(fx.core.policy.predictor_stats(), None);
    assert_eq!(fx.core.metrics.predictor_entries[0].get(), 0);
    let _a = fx.assign("a", 100);
    assert_eq!(fx.tick_and_commit(true), 1);
    assert!(fx.core.metrics.predictions.iter().all(|c| c.get() == 0));
}

/// BR-H's ticks count how its prediction cache answered for each request: predicted at the
/// first tick that sees it, reused while nothing it depends on changes, spared when a finish's
/// length cannot change it.
#[test]
fn brh_counts_its_predictions_by_answer() {
    let mut fx = Fx::new(PolicyKind::BrH(PredictorKind::Survival), &[500, 800], 64);
    let counts = |fx: &Fx| fx.core.metrics.predictions.each_ref().map(|c| c.get());
    let _a = fx.assign("a", 100);
    assert_eq!(fx.tick_and_commit(true), 1);
    assert_eq!(counts(&fx), [0, 0, 2], "bg0 and bg1, the first time");
    let _b = fx.assign("b", 100);
    assert_eq!(fx.tick_and_commit(true), 1);
    assert_eq!(counts(&fx), [2, 0, 3], "bg0 and bg1 again, and a");
    // a finishes after 5,000 tokens: beyond the horizon of every request still running (all
    // at 0 tokens, predicted to run on), so no prediction changes.
    fx.sigma_change(vec![change::request_finished("a", 5_000)]);
    let _c = fx.assign("c", 100);
    assert_eq!(fx.tick_and_commit(true), 1);
    assert_eq!(
        counts(&fx),
        [2, 2, 4],
        "bg0 and bg1 spared, b the first time"
    );
}

/// An Assign's hints, at every hop inside a replica: the pool entry, the reservation and its
/// `Reserve` message, the view the next tick decides on, σ once the delta shows it, and the
/// finish the predictor learns from.
#[test]
fn the_hints_of_an_assign_reach_the_hinted_predictor() {
    let mut fx = Fx::new(PolicyKind::BrH(PredictorKind::Hinted), &[0, 0], 4);
    let chat = br_proto::valid::class_id("chat");
    let hints = Hints {
        expected_output: Some(300),
        class: Some(chat),
    };
    let mut req = valid("a", 500);
    req.max_tokens = Some(1_000);
    req.expected_output_tokens = Some(300);
    req.request_class = Some(br_proto::valid::RequestClass::new("chat").unwrap());
    let (tx, _rx) = oneshot::channel();
    fx.core.assign(req, 1, tx, fx.now);
    let waiting: Vec<_> = fx.core.requests.pool_mut().oldest(1).cloned().collect();
    assert_eq!(
        (waiting[0].expected_output, waiting[0].class),
        (Some(300), Some(chat)),
        "the pool entry BR-H admits from"
    );
    fx.core.tick(fx.now);
    let job = fx.core.take_reserve(fx.now).expect("a Reserve call");
    assert_eq!(job.reservations[0].hints, hints);
    let wire = super::super::wire::reserve_request(fx.core.group(), &job);
    assert_eq!(
        (
            wire.reservations[0].expected_output_tokens,
            wire.reservations[0].request_class_id
        ),
        (Some(300), Some(chat))
    );
    // the view counts the admission at once, with its hints
    let own = fx
        .core
        .view
        .cluster()
        .requests()
        .find(|r| r.phase == Phase::Queued);
    assert_eq!(
        own.map(|r| (r.expected_output, r.class)),
        Some((Some(300), Some(chat)))
    );
    let (resp, delta) = fx.serve_reserve(&job);
    fx.done(&job, Ok(resp));
    fx.core.on_delta(&delta.unwrap(), fx.now).unwrap();
    let sigma = fx.core.view.sigma().unwrap();
    let held = sigma.request("a").expect("σ shows it");
    assert_eq!(held.hints, hints);
    let info = sigma.cluster().requests().find(|r| r.key == held.key);
    assert_eq!(
        info.map(|r| (r.expected_output, r.class)),
        Some((Some(300), Some(chat))),
        "what BR-H predicts the running request from"
    );
    let worker = held.worker;
    fx.sigma_change(vec![change::request_progress(
        "a",
        worker,
        100 + u64::from(worker),
        500,
        200,
    )]);
    fx.sigma_change(vec![change::request_finished("a", 280)]);
    let st = fx
        .core
        .policy
        .predictor_stats()
        .expect("BR-H has a predictor");
    assert_eq!((st.samples, st.hinted), (1, 1));
    assert_eq!(fx.core.metrics.predictor_entries[3].get(), 1, "kind=hinted");
}

/// A replica that did not admit a request (another one did, or it restarted) learns its hints
/// from σ alone: a reservation σ shows, and a snapshot of σ.
#[test]
fn a_replica_learns_the_hints_of_a_request_from_sigma_alone() {
    let mut fx = Fx::new(PolicyKind::BrH(PredictorKind::Hinted), &[0, 0], 4);
    let hints = Hints {
        expected_output: Some(64),
        class: Some(7),
    };
    fx.sigma_change(vec![change::request_reserved_hinted(
        "elsewhere",
        1,
        101,
        800,
        None,
        Some(100),
        hints,
    )]);
    let info_of = |s: &Sigma, id: &str| {
        let key = s.request(id).expect("in σ").key;
        let r = s
            .cluster()
            .requests()
            .find(|r| r.key == key)
            .expect("in the core");
        (r.expected_output, r.class)
    };
    assert_eq!(
        info_of(fx.core.view.sigma().unwrap(), "elsewhere"),
        (Some(64), Some(7))
    );
    // A restarted replica: a fresh core on a snapshot of σ.
    let restarted = Sigma::from_snapshot(&fx.writer.to_snapshot()).unwrap();
    assert_eq!(info_of(&restarted, "elsewhere"), (Some(64), Some(7)));
    let mut fresh = core(
        PolicyKind::BrH(PredictorKind::Hinted),
        GroupConfig::default(),
    );
    fresh.set_sigma(restarted, fx.now);
    let mut b = fx.writer.batch();
    b.apply(change::request_progress("elsewhere", 1, 101, 800, 60))
        .unwrap();
    b.apply(change::request_finished("elsewhere", 60)).unwrap();
    let d = b.commit().unwrap();
    fx.core.on_delta(&d, fx.now).unwrap();
    fresh.on_delta(&d, fx.now).unwrap();
    for c in [&fx.core, &fresh] {
        let st = c.policy.predictor_stats().unwrap();
        assert_eq!((st.samples, st.hinted), (1, 1));
    }
}

/// `brh-class` learns each class the gateway named from σ's finishes, and the gauge counts
/// the classes it holds a model for.
#[test]
fn brh_class_learns_a_model_per_class() {
    let mut fx = Fx::new(PolicyKind::BrH(PredictorKind::Classed), &[0, 0], 4);
    let classes = [
        br_proto::valid::class_id("chat"),
        br_proto::valid::class_id("code"),
    ];
    for (i, class) in classes.iter().chain(&classes).chain(&[0]).enumerate() {
        let id = format!("r{i}");
        let hints = Hints {
            expected_output: None,
            class: (*class != 0).then_some(*class),
        };
        fx.sigma_change(vec![change::request_reserved_hinted(
            &id, 1, 101, 800, None, None, hints,
        )]);
        fx.sigma_change(vec![change::request_progress(&id, 1, 101, 800, 50)]);
        fx.sigma_change(vec![change::request_finished(&id, 50)]);
    }
    let st = fx
        .core
        .policy
        .predictor_stats()
        .expect("BR-H has a predictor");
    assert_eq!((st.samples, st.classes), (5, 2));
    assert_eq!(
        fx.core.metrics.predictor_entries[4].get(),
        2,
        "kind=classes"
    );
}
