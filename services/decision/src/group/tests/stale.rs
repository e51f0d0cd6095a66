//! Outages of the snapshot service: answering stale from the view, and re-committing what σ
//! does not hold once it is back.

use super::*;

#[test]
fn while_stale_answers_from_the_view_and_reserves_when_back() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
    let t0 = fx.now;
    fx.core.on_disconnected(t0, t0);
    assert!(fx.core.is_stale());
    let (_, mut a) = fx.assign("a", 300);
    let (_, mut b) = fx.assign("b", 300);
    fx.core.tick(fx.now);
    assert!(
        fx.core.take_reserve(fx.now).is_none(),
        "no Reserve while away"
    );
    let (ra, rb) = (answer(&mut a), answer(&mut b));
    assert!(ra.stale && rb.stale);
    assert_ne!(ra.worker, rb.worker, "own reservations count in the view");
    assert_eq!(fx.core.stats().uncommitted, 2);
    // A retry gets the same (stale) answer.
    let (_, mut again) = fx.assign("a", 300);
    assert_eq!(answer(&mut again), ra);
    // Back: what was decided while away is the workers' to report. One σ shows (its worker
    // runs it) is σ's; one σ still does not show once the workers' reports had time to
    // arrive is not reserved again: the worker finished it (or never got it), and a
    // re-commit would hold its slot until σ's reservation TTL.
    fx.advance(Duration::from_secs(1));
    fx.core.on_connected(fx.now);
    let inc = 100 + u64::from(ra.worker);
    fx.sigma_change(vec![change::request_progress("a", ra.worker, inc, 300, 7)]);
    assert!(fx.core.take_reserve(fx.now).is_none(), "b: reports pending");
    assert_eq!(fx.core.stats().uncommitted, 1);
    fx.advance(GroupConfig::default().recommit_settle);
    assert!(
        fx.core.take_reserve(fx.now).is_none(),
        "b is not re-reserved"
    );
    fx.core.tick(fx.now);
    let st = fx.core.stats();
    assert_eq!((st.uncommitted, st.local, st.stale), (0, 0, false));
}

#[test]
fn a_failed_reserve_call_answers_stale_and_recommits() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 8);
    let (_, mut a) = fx.assign("a", 1);
    fx.core.tick(fx.now);
    let job = fx.core.take_reserve(fx.now).unwrap();
    fx.done(&job, Err(tonic::Status::unavailable("down")));
    assert!(answer(&mut a).stale);
    let job = fx
        .core
        .take_reserve(fx.now)
        .expect("retried as a re-commit");
    assert_eq!(ids(&job), ["a"]);
}

#[test]
fn a_new_epoch_recommits_what_sigma_lost() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 8);
    let (_, mut a) = fx.assign("a", 1);
    fx.tick_and_commit(false); // accepted, not yet seen in σ
    answer(&mut a);
    // The snapshot service restarts (new epoch) and σ is rebuilt without "a".
    let mut fresh = Sigma::with_epoch("g", EPOCH + 1);
    let mut b = fresh.batch();
    b.apply(change::worker_up(0, 100, 8, "http://w0")).unwrap();
    b.commit();
    fx.core.set_sigma(fresh, fx.now);
    let job = fx
        .core
        .take_reserve(fx.now)
        .expect("re-commit after the restart");
    assert_eq!(ids(&job), ["a"]);
}

#[test]
fn recommits_wait_until_the_worker_is_back() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 8);
    fx.core.on_disconnected(fx.now, fx.now);
    let (_, mut a) = fx.assign("a", 1);
    fx.core.tick(fx.now);
    assert!(fx.core.take_reserve(fx.now).is_none());
    assert!(answer(&mut a).stale);
    // The restarted snapshot service has no workers yet.
    let mut fresh = Sigma::with_epoch("g", EPOCH + 1);
    fx.core.set_sigma(fresh.clone(), fx.now);
    assert!(
        fx.core.take_reserve(fx.now).is_none(),
        "worker 0 not back yet"
    );
    fx.core.tick(fx.now);
    assert_eq!(
        fx.core.stats().uncommitted,
        1,
        "kept while the worker may come back"
    );
    // Its hello arrives (same incarnation): now it is reserved again.
    let mut b = fresh.batch();
    b.apply(change::worker_up(0, 100, 8, "http://w0")).unwrap();
    let d = b.commit().unwrap();
    fx.core.on_delta(&d, fx.now).unwrap();
    let job = fx.core.take_reserve(fx.now).expect("re-commit");
    assert_eq!(ids(&job), ["a"]);
}

#[test]
fn staleness_is_measured_from_the_last_confirmation() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 8);
    let lost = fx.now;
    fx.advance(Duration::from_secs(3));
    fx.core.on_disconnected(lost, fx.now);
    assert_eq!(fx.core.view.staleness(fx.now), Duration::from_secs(3));
    fx.advance(Duration::from_secs(2));
    assert_eq!(fx.core.view.staleness(fx.now), Duration::from_secs(5));
    fx.core.on_connected(fx.now);
    assert_eq!(fx.core.view.staleness(fx.now), Duration::ZERO);
    assert!(!fx.core.is_stale());
}
