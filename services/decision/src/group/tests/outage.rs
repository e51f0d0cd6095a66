//! A long outage of the snapshot service: the view moves on by the estimated
//! progress of the ranks (finished requests free their slots), answers say stale, a new and
//! still-empty σ after a restart is not taken as the truth, and stale reservations the
//! workers' reports no longer list are not brought back into σ.

use proptest::prelude::*;

use super::*;

const STEP: Duration = Duration::from_millis(50);

/// Teaches the core the ranks' pace (one token per `STEP`) and that requests end after
/// `len` tokens, the way σ shows both: a running request's progress, then finished requests.
fn learn(fx: &mut Fx, worker: u32, len: u32) {
    let inc = 100 + u64::from(worker);
    // σ is sampled for the pace at most once a second.
    fx.advance(STEP * 20);
    fx.sigma_change(vec![change::request_progress("pace", worker, inc, 10, 1)]);
    fx.advance(STEP * 20);
    fx.sigma_change(vec![change::request_progress("pace", worker, inc, 10, 21)]);
    fx.sigma_change(vec![change::request_finished("pace", len)]);
    for i in 0..16 {
        let id = format!("learn{i}");
        fx.sigma_change(vec![change::request_progress(&id, worker, inc, 10, 1)]);
        fx.sigma_change(vec![change::request_finished(&id, len)]);
    }
}

/// Runs ticks (and the `Reserve` calls they would make) every `STEP` until `until`.
fn run_until(fx: &mut Fx, until: Instant) {
    while fx.now < until {
        fx.advance(STEP);
        fx.core.tick(fx.now);
        fx.core.housekeeping(fx.now);
        while fx.core.take_reserve(fx.now).is_some() {}
    }
}

#[test]
fn estimated_finishes_free_slots_while_sigma_is_away() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 2);
    learn(&mut fx, 0, 40);
    // The rank is full: two requests running, at 21 and 1 of their ~40 tokens.
    fx.sigma_change(vec![
        change::request_progress("r1", 0, 100, 100, 21),
        change::request_progress("r2", 0, 100, 100, 1),
    ]);
    fx.core.on_disconnected(fx.now, fx.now);
    assert!(fx.core.stats().estimating);
    let (_, mut a) = fx.assign("a", 50);
    let (_, mut b) = fx.assign("b", 50);
    fx.core.tick(fx.now);
    assert!(fx.core.take_reserve(fx.now).is_none());
    assert!(pending(&mut a) && pending(&mut b), "no free slot yet");
    // r1 has ~19 steps to go: half of that frees nothing.
    let t = fx.now;
    run_until(&mut fx, t + STEP * 9);
    assert!(pending(&mut a), "r1 is estimated to run on");
    // Past its end its slot is free: the oldest waiting request takes it, answered stale.
    run_until(&mut fx, t + STEP * 21);
    let ra = answer(&mut a);
    assert!(ra.stale && ra.worker == 0, "{ra:?}");
    assert!(pending(&mut b), "one slot freed, one admitted");
    // r2 ends ~39 steps in.
    run_until(&mut fx, t + STEP * 41);
    assert!(answer(&mut b).stale);
    assert!(fx.core.metrics.estimated_finishes.get() >= 2);
    assert!(fx.core.metrics.stale_answers.get() >= 2);
    // Without the snapshot service nothing was reserved: both are to be checked when back.
    assert_eq!(fx.core.stats().uncommitted, 2);
}

#[test]
fn without_a_learned_length_the_outage_view_frees_nothing() {
    // Nothing finished in σ yet: the estimate knows no output length, so it cannot tell
    // when anything ends, and keeps the slots taken (as the view always did).
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 1);
    fx.sigma_change(vec![change::request_progress("r1", 0, 100, 100, 5)]);
    fx.core.on_disconnected(fx.now, fx.now);
    let (_, mut a) = fx.assign("a", 50);
    let t = fx.now;
    run_until(&mut fx, t + Duration::from_secs(30));
    assert!(pending(&mut a));
    assert_eq!(fx.core.metrics.estimated_finishes.get(), 0);
}

#[test]
fn the_estimate_ends_when_sigma_moves_again() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 4);
    learn(&mut fx, 0, 40);
    fx.core.on_disconnected(fx.now, fx.now);
    assert!(fx.core.stats().estimating && fx.core.is_stale());
    fx.advance(Duration::from_secs(2));
    fx.core.on_connected(fx.now);
    assert!(!fx.core.is_stale());
    fx.sigma_change(vec![change::request_progress("x", 1, 101, 10, 3)]);
    let st = fx.core.stats();
    assert!(!st.estimating && !st.stale, "{st:?}");
    // A resubscription that missed nothing brings no delta: σ is taken as it is after a while.
    fx.core.on_disconnected(fx.now, fx.now);
    fx.core.on_connected(fx.now);
    assert!(fx.core.stats().estimating);
    let t = fx.now;
    run_until(&mut fx, t + Duration::from_secs(2));
    assert!(!fx.core.stats().estimating);
}

#[test]
fn stale_reservations_the_workers_no_longer_list_are_not_brought_back() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
    let settle = GroupConfig::default().recommit_settle;
    fx.core.on_disconnected(fx.now, fx.now);
    let (_, mut a) = fx.assign("a", 100);
    let (_, mut b) = fx.assign("b", 100);
    fx.core.tick(fx.now);
    assert!(fx.core.take_reserve(fx.now).is_none());
    let (ra, rb) = (answer(&mut a), answer(&mut b));
    assert!(ra.stale && rb.stale);
    // While away, the workers ran both; "a" finished (a report σ does not see: it never held
    // it), "b" still runs.
    fx.advance(Duration::from_secs(3));
    fx.core.on_connected(fx.now);
    let inc_b = 100 + u64::from(rb.worker);
    fx.sigma_change(vec![change::request_progress(
        "b", rb.worker, inc_b, 100, 40,
    )]);
    // Before the workers' reports settled nothing is decided ...
    assert!(fx.core.take_reserve(fx.now).is_none());
    assert_eq!(fx.core.stats().uncommitted, 1, "b is σ's now; a waits");
    // ... after, "a" is forgotten, not re-committed: it would hold a slot for a finished
    // request until σ's reservation TTL.
    fx.advance(settle);
    fx.core.housekeeping(fx.now);
    assert!(
        fx.core.take_reserve(fx.now).is_none(),
        "nothing re-reserved"
    );
    let st = fx.core.stats();
    assert_eq!((st.uncommitted, st.local), (0, 0), "{st:?}");
    assert_eq!(fx.core.metrics.recommits_dropped.get(), 1);
    assert_eq!(fx.core.metrics.recommits_sent.get(), 0);
    assert!(fx.writer.request("a").is_none());
}

#[test]
fn a_reserve_that_fails_after_the_worker_is_back_is_recommitted_at_once() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 8);
    fx.advance(Duration::from_secs(1));
    let (_, mut a) = fx.assign("a", 1);
    fx.core.tick(fx.now);
    let job = fx.core.take_reserve(fx.now).unwrap();
    fx.done(&job, Err(tonic::Status::unavailable("blip")));
    assert!(answer(&mut a).stale);
    // Admitted while σ showed its worker: σ cannot have seen it, so it is reserved again.
    let job = fx.core.take_reserve(fx.now).expect("re-commit");
    assert_eq!(ids(&job), ["a"]);
}

/// A new σ after a restart of the snapshot service, with only `back` of the workers.
fn restarted(back: &[u32], cap: u32) -> Sigma {
    let mut fresh = Sigma::with_epoch("g", EPOCH + 1);
    let mut b = fresh.batch();
    for &w in back {
        b.apply(change::worker_up(
            w,
            100 + u64::from(w),
            cap,
            &format!("http://w{w}"),
        ))
        .unwrap();
    }
    b.commit();
    fresh
}

#[test]
fn a_new_empty_sigma_is_not_taken_as_the_truth() {
    let mut fx = Fx::new(PolicyKind::Jsq, &[0, 0, 0], 8);
    fx.sigma_change(vec![
        change::request_progress("r0", 0, 100, 100, 5),
        change::request_progress("r0b", 0, 100, 100, 5),
        change::request_progress("r1", 1, 101, 100, 5),
        change::request_progress("r1b", 1, 101, 100, 5),
    ]);
    fx.core.on_disconnected(fx.now, fx.now);
    fx.advance(Duration::from_secs(3));
    fx.core.on_connected(fx.now);
    // The restarted snapshot service knows no worker yet.
    fx.core.set_sigma(restarted(&[], 8), fx.now);
    let st = fx.core.stats();
    assert!(st.estimating && st.awaited == 3, "{st:?}");
    // JSQ still routes, to the emptiest worker of the last view, answered stale (the new σ
    // would refuse a reservation for a worker it does not know yet).
    let (_, mut x) = fx.assign("x", 10);
    assert!(fx.core.take_reserve(fx.now).is_none());
    let rx = answer(&mut x);
    assert!(rx.stale, "{rx:?}");
    assert_eq!((rx.worker, rx.incarnation), (2, 102));
    assert_eq!(rx.endpoint, "http://w2");
    // Worker 2 is back (same incarnation): routing to it is fresh again, and "x" is σ's to
    // hold once its reports settle.
    let mut fresh = restarted(&[2], 8);
    fx.core.set_sigma(fresh.clone(), fx.now);
    let (_, mut y) = fx.assign("y", 10);
    let job = fx
        .core
        .take_reserve(fx.now)
        .expect("a Reserve for the worker that is back");
    assert_eq!(ids(&job), ["y"]);
    assert_eq!(job.reservations[0].worker, 2);
    assert!(pending(&mut y), "answered once reserved");
    // The others are back too: the new σ is the truth from now on.
    let mut b = fresh.batch();
    b.apply(change::worker_up(0, 100, 8, "http://w0")).unwrap();
    b.apply(change::worker_up(1, 101, 8, "http://w1")).unwrap();
    b.apply(change::request_progress("r0", 0, 100, 100, 90))
        .unwrap();
    let d = b.commit().unwrap();
    fx.core.on_delta(&d, fx.now).unwrap();
    let st = fx.core.stats();
    assert!(!st.estimating && st.awaited == 0 && !st.stale, "{st:?}");
}

#[test]
fn workers_that_never_come_back_leave_the_view_after_the_grace() {
    let cfg = GroupConfig {
        adopt_grace: Duration::from_secs(2),
        ..GroupConfig::default()
    };
    let mut fx = Fx::with_cfg(PolicyKind::Jsq, &[0, 0], 8, cfg);
    fx.core.on_disconnected(fx.now, fx.now);
    fx.core.on_connected(fx.now);
    // Worker 0 is back, with the requests it reported.
    let mut fresh = restarted(&[0], 8);
    let mut b = fresh.batch();
    b.apply(change::request_progress("r0", 0, 100, 100, 5))
        .unwrap();
    b.apply(change::request_progress("r0b", 0, 100, 100, 5))
        .unwrap();
    b.commit();
    fx.core.set_sigma(fresh, fx.now);
    // Worker 1 is away and emptier: JSQ picks it (stale).
    let (_, mut x) = fx.assign("x", 10);
    fx.core.take_reserve(fx.now);
    assert_eq!(answer(&mut x).worker, 1);
    fx.advance(Duration::from_secs(2));
    fx.core.housekeeping(fx.now);
    let st = fx.core.stats();
    assert!(st.awaited == 0 && !st.estimating, "{st:?}");
    let (_, mut y) = fx.assign("y", 10);
    let job = fx.core.take_reserve(fx.now).expect("reserved on the new σ");
    assert_eq!(job.reservations[0].worker, 0);
    assert!(pending(&mut y));
}

#[derive(Debug, Clone)]
enum Op {
    Assign(u16),
    Advance(u16),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// However requests arrive during an outage, BR-0 on the estimated view never places more
    /// requests on a rank than it has slots, answers every admission stale, and keeps
    /// admitting: once the ranks had time to finish, the pool is empty.
    #[test]
    fn the_outage_view_keeps_admitting_within_capacity(
        ops in proptest::collection::vec(prop_oneof![
            3 => (1u16..2000).prop_map(Op::Assign),
            2 => (1u16..1500).prop_map(Op::Advance),
        ], 1..60),
        len in 5u32..80,
    ) {
        let mut fx = Fx::new(PolicyKind::Br0, &[0, 0, 0], 3);
        learn(&mut fx, 0, len);
        fx.sigma_change(vec![change::request_progress("r", 1, 101, 100, 0)]);
        fx.core.on_disconnected(fx.now, fx.now);
        let mut rxs = Vec::new();
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::Assign(s) => rxs.push(fx.assign(&format!("q{i}"), u32::from(s)).1),
                Op::Advance(ms) => {
                    let t = fx.now;
                    run_until(&mut fx, t + Duration::from_millis(u64::from(ms)));
                }
            }
            fx.core.tick(fx.now);
            while fx.core.take_reserve(fx.now).is_some() {}
            for w in fx.core.view.cluster().workers() {
                prop_assert!(w.running + w.queued <= w.capacity, "{w:?}");
            }
        }
        // Long enough for every admitted request to end (len + a queue's worth of steps).
        let t = fx.now;
        let steps = (u64::from(len) + 1) * (rxs.len() as u64 + 1);
        run_until(&mut fx, t + STEP * u32::try_from(steps).unwrap());
        prop_assert_eq!(fx.core.stats().pool, 0);
        for mut rx in rxs {
            let a = answer(&mut rx);
            prop_assert!(a.stale);
        }
        // Everything ended in the estimate, σ's own running request too.
        prop_assert_eq!(fx.core.view.cluster().request_count(), 0);
    }
}
