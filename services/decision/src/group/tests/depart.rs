//! Requests leaving: cancels, withdrawals, answers nobody read, callers that vanished. Nothing
//! may stay reserved for a request nobody will send.

use super::*;

#[test]
fn cancel_withdraws_releases_or_finds_nothing() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
    let (_, mut waiting) = fx.assign("w", 100);
    assert_eq!(fx.core.cancel("w", fx.now), CancelOutcome::Withdrawn);
    assert_eq!(error(&mut waiting), DecisionError::Cancelled);
    assert_eq!(fx.core.stats().pool, 0);
    assert_eq!(fx.tick_and_commit(false), 0, "nothing reserved for it");

    let (_, mut done) = fx.assign("d", 100);
    fx.tick_and_commit(true);
    answer(&mut done);
    assert_eq!(fx.core.cancel("d", fx.now), CancelOutcome::Released);
    let rel = fx.release().expect("a Release");
    assert_eq!(rel.request_ids, vec!["d".to_string()]);
    assert_eq!(
        fx.core.cancel("d", fx.now),
        CancelOutcome::NotFound,
        "already cancelled"
    );
    assert_eq!(fx.core.cancel("never", fx.now), CancelOutcome::NotFound);

    // Active (the worker reported it): nothing to release.
    let (_, mut act) = fx.assign("act", 100);
    fx.tick_and_commit(true);
    let a = answer(&mut act);
    fx.sigma_change(vec![change::request_progress(
        "act",
        a.worker,
        a.incarnation,
        100,
        3,
    )]);
    assert_eq!(fx.core.cancel("act", fx.now), CancelOutcome::NotFound);
    assert!(fx.release().is_none());
}

/// Under mutual TLS a request belongs to the identity whose Assign brought it: another
/// identity's Cancel is refused whatever state the request is in, and changes nothing.
#[test]
fn cancel_is_bound_to_the_assigning_identity() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
    let a: std::sync::Arc<str> = "spiffe://td/br/gateway".into();
    let b = "spiffe://td/ns/br/sa/other-gateway";
    let not_owner = |id: &str| DecisionError::NotOwner {
        request_id: id.into(),
        caller: b.into(),
    };

    // waiting in the pool
    let (_, mut waiting) = fx.assign("w", 100);
    fx.core.claim("w", a.clone());
    assert_eq!(fx.core.cancel_by("w", Some(b), fx.now), Err(not_owner("w")));
    assert_eq!(fx.core.stats().pool, 1, "still waiting");
    assert!(matches!(waiting.try_recv(), Err(TryRecvError::Empty)));
    // a retry by someone else does not take it over
    let (_, _retry) = fx.assign("w", 100);
    fx.core.claim("w", b.into());
    assert_eq!(fx.core.cancel_by("w", Some(b), fx.now), Err(not_owner("w")));
    assert_eq!(
        fx.core.cancel_by("w", Some(&a), fx.now),
        Ok(CancelOutcome::Withdrawn)
    );
    assert_eq!(error(&mut waiting), DecisionError::Cancelled);

    // answered, reserved in σ
    let (_, mut done) = fx.assign("d", 100);
    fx.core.claim("d", a.clone());
    fx.tick_and_commit(true);
    answer(&mut done);
    assert_eq!(fx.core.cancel_by("d", Some(b), fx.now), Err(not_owner("d")));
    assert!(fx.release().is_none(), "a refused Cancel releases nothing");
    assert_eq!(
        fx.core.cancel_by("d", Some(&a), fx.now),
        Ok(CancelOutcome::Released)
    );
    assert_eq!(fx.release().expect("a Release").request_ids, vec!["d"]);

    // σ holds a reservation this service did not make: no owner to check, so an identity
    // may not release it (it expires by its TTL); plaintext and the admin role may.
    fx.sigma_change(vec![change::request_reserved(
        "foreign", 0, 100, 10, None, None,
    )]);
    assert_eq!(
        fx.core.cancel_by("foreign", Some(b), fx.now),
        Err(not_owner("foreign"))
    );
    assert!(fx.release().is_none());
    assert_eq!(
        fx.core.cancel_by("never", Some(b), fx.now),
        Ok(CancelOutcome::NotFound)
    );
    assert_eq!(
        fx.core.cancel_by("foreign", None, fx.now),
        Ok(CancelOutcome::Released)
    );
    assert_eq!(
        fx.release().expect("a Release").request_ids,
        vec!["foreign"]
    );
}

#[test]
fn cancel_during_reserve_releases_once_accepted() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
    let (_, mut rx) = fx.assign("r", 100);
    fx.core.tick(fx.now);
    let job = fx.core.take_reserve(fx.now).unwrap();
    assert_eq!(fx.core.cancel("r", fx.now), CancelOutcome::Withdrawn);
    assert_eq!(error(&mut rx), DecisionError::Cancelled);
    let (resp, _) = fx.serve_reserve(&job);
    fx.done(&job, Ok(resp));
    let rel = fx.release().expect("released");
    assert_eq!(rel.request_ids, vec!["r".to_string()]);
    let st = fx.core.stats();
    assert_eq!((st.pool, st.reserving, st.answered, st.local), (0, 0, 0, 0));
}

#[test]
fn deadline_withdrawal_leaves_nothing_behind() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 1);
    // Fill the only slot so the next request waits.
    let (_, mut a) = fx.assign("a", 10);
    fx.tick_and_commit(true);
    answer(&mut a);
    let (call, mut b) = fx.assign("b", 10);
    fx.tick_and_commit(true);
    assert!(pending(&mut b), "no free slot: it waits");
    fx.core.withdraw("b", call, false);
    let st = fx.core.stats();
    assert_eq!((st.pool, st.waiting_calls, st.reserving), (0, 0, 0));
    // A retry of a withdrawn id is a new request.
    let (_, mut again) = fx.assign("b", 10);
    assert!(pending(&mut again));
    assert_eq!(fx.core.stats().pool, 1);

    // Withdrawn while its Reserve is in flight: released when accepted, never answered.
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 4);
    let (call, _rx) = fx.assign("c", 10);
    fx.core.tick(fx.now);
    let job = fx.core.take_reserve(fx.now).unwrap();
    fx.core.withdraw("c", call, false);
    let (resp, _) = fx.serve_reserve(&job);
    fx.done(&job, Ok(resp));
    assert_eq!(fx.release().unwrap().request_ids, vec!["c".to_string()]);
    let st = fx.core.stats();
    assert_eq!((st.reserving, st.answered, st.local), (0, 0, 0));
}

#[test]
fn an_answer_nobody_read_is_released() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 4);
    let (call, rx) = fx.assign("r", 10);
    fx.tick_and_commit(false);
    drop(rx); // the handler read nothing (its future was dropped after the send)
    fx.core.withdraw("r", call, true);
    assert_eq!(fx.release().unwrap().request_ids, vec!["r".to_string()]);
    assert_eq!(fx.core.stats().answered, 0);
}

#[test]
fn callers_that_vanish_are_swept() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 1);
    let (_, mut a) = fx.assign("a", 10);
    fx.tick_and_commit(true);
    answer(&mut a);
    let (_, b) = fx.assign("b", 10);
    drop(b); // no Withdraw arrived (the queue was full)
    fx.core.housekeeping(fx.now);
    assert_eq!(fx.core.stats().pool, 0);
}
