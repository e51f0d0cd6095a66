//! What each `Reserve` outcome does: rejections, duplicates, σ overtaking the answer.

use super::*;

#[test]
fn rejected_reservations_go_back_to_the_pool_and_avoid_the_worker() {
    // fenced, or cordoned by an operator, before this replica's σ showed it
    for reason in [
        v1::RejectReason::WorkerFenced,
        v1::RejectReason::WorkerCordoned,
    ] {
        let mut fx = Fx::new(PolicyKind::Br0, &[0, 500], 8);
        let (_, mut rx) = fx.assign("r", 100);
        fx.core.tick(fx.now);
        let job = fx.core.take_reserve(fx.now).unwrap();
        let first = job.reservations[0].worker;
        assert_eq!(first, 0, "the lighter worker");
        let resp = refused(&fx, "r", reason, "refused");
        fx.done(&job, Ok(resp));
        assert!(pending(&mut rx), "{reason:?}: retried, not failed");
        assert_eq!(fx.core.stats().pool, 1);
        fx.tick_and_commit(false);
        assert_eq!(
            answer(&mut rx).worker,
            1,
            "{reason:?}: σ is behind: avoid the refusing worker"
        );
    }
}

#[test]
fn duplicate_rejection_answers_with_sigmas_placement() {
    let mut fx = Fx::new(PolicyKind::Jsq, &[0, 0], 8);
    let (_, mut rx) = fx.assign("r", 50);
    let job = fx.core.take_reserve(fx.now).unwrap();
    assert_eq!(job.reservations[0].worker, 0);
    // Meanwhile σ got "r" on worker 1 (another replica, or an earlier incarnation).
    fx.sigma_change(vec![change::request_reserved("r", 1, 101, 50, None, None)]);
    let resp = refused(&fx, "r", v1::RejectReason::Duplicate, "on worker 1");
    fx.done(&job, Ok(resp));
    let a = answer(&mut rx);
    assert_eq!((a.worker, a.incarnation), (1, 101));
}

/// Failover: replica A reserved "r" and died before answering; the gateway
/// retries "r" here. The snapshot service refuses the reservation as a duplicate before this
/// replica's σ shows A's placement (its Watch lags the Reserve round trip). The call must end
/// with a status the client retries (the same id, here or elsewhere, is then answered from σ),
/// not a final INTERNAL that loses a request σ holds and a worker will run.
#[test]
fn a_duplicate_sigma_does_not_show_yet_is_answered_retryably() {
    use br_runtime::error::ServiceError as _;
    let mut fx = Fx::new(PolicyKind::Jsq, &[0, 0], 8);
    let (_, mut rx) = fx.assign("r", 50);
    let job = fx.core.take_reserve(fx.now).unwrap();
    let resp = refused(&fx, "r", v1::RejectReason::Duplicate, "on worker 1");
    fx.done(&job, Ok(resp));
    let e = error(&mut rx);
    assert_eq!(e.grpc_code(), tonic::Code::Unavailable, "{e}");
    let st = fx.core.stats();
    assert_eq!((st.pool, st.reserving, st.local), (0, 0, 0), "nothing held");

    // The client's retry of the same id, once σ shows the other replica's placement, is
    // answered with it.
    fx.sigma_change(vec![change::request_reserved("r", 1, 101, 50, None, None)]);
    let (_, mut again) = fx.assign("r", 50);
    let a = answer(&mut again);
    assert_eq!((a.worker, a.incarnation), (1, 101));
}

#[test]
fn other_rejections_fail_the_request_with_the_reason() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 8);
    let (_, mut rx) = fx.assign("r", 50);
    fx.core.tick(fx.now);
    let job = fx.core.take_reserve(fx.now).unwrap();
    let resp = refused(&fx, "r", v1::RejectReason::Invalid, "bad");
    fx.done(&job, Ok(resp));
    assert_eq!(
        error(&mut rx),
        DecisionError::ReserveRefused("REJECT_REASON_INVALID: bad".into())
    );
    let st = fx.core.stats();
    assert_eq!((st.pool, st.reserving, st.local), (0, 0, 0));
}

#[test]
fn sigma_showing_a_reservation_before_its_answer_still_answers() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
    let (_, mut rx) = fx.assign("r", 10);
    fx.core.tick(fx.now);
    let job = fx.core.take_reserve(fx.now).unwrap();
    let (resp, delta) = fx.serve_reserve(&job);
    // The Watch delta overtakes the Reserve answer, and a tick rebuilds the view.
    fx.core.on_delta(&delta.unwrap(), fx.now).unwrap();
    fx.core.tick(fx.now);
    fx.done(&job, Ok(resp));
    assert!(!answer(&mut rx).stale);
    assert_eq!(fx.core.stats().local, 0);
}

#[test]
fn at_most_the_limit_of_reserve_calls_is_in_flight() {
    let cfg = GroupConfig {
        max_inflight_reserves: 1,
        ..GroupConfig::default()
    };
    let mut fx = Fx::with_cfg(PolicyKind::Jsq, &[0, 0], 8, cfg);
    let (_, mut a) = fx.assign("a", 10);
    let first = fx.core.take_reserve(fx.now).expect("the first call");
    let (_, mut b) = fx.assign("b", 10);
    assert!(fx.core.take_reserve(fx.now).is_none(), "one in flight");
    let (resp, _) = fx.serve_reserve(&first);
    fx.done(&first, Ok(resp));
    answer(&mut a);
    let second = fx.core.take_reserve(fx.now).expect("the next call");
    assert_eq!(ids(&second), ["b"]);
    let (resp, _) = fx.serve_reserve(&second);
    fx.done(&second, Ok(resp));
    answer(&mut b);
}

/// Failover: the gateway retried "r" here after another replica had reserved it;
/// this replica admitted it, and before its next `Reserve` call σ showed the other replica's
/// placement (so the own, unsent reservation was dropped) and then no longer did (that
/// replica's caller went away and it released "r"). The answer is the placement σ showed, not
/// a final INTERNAL "lost its reservation" for a request this replica had admitted.
#[test]
fn an_admission_sigma_placed_elsewhere_before_it_was_sent_is_answered_with_that_placement() {
    let mut fx = Fx::new(PolicyKind::Jsq, &[0, 0], 8);
    let (_, mut rx) = fx.assign("r", 50);
    assert!(
        pending(&mut rx),
        "admitted, waiting for the next Reserve call"
    );
    fx.sigma_change(vec![change::request_reserved("r", 1, 101, 50, None, None)]);
    fx.sigma_change(vec![change::request_released("r")]);
    let job = fx.core.take_reserve(fx.now);
    assert!(
        job.as_ref().is_none_or(|j| !ids(j).contains(&"r")),
        "σ placed it elsewhere: not reserved again"
    );
    let a = answer(&mut rx);
    assert_eq!((a.worker, a.incarnation, a.stale), (1, 101, false));
    let st = fx.core.stats();
    assert_eq!((st.pool, st.reserving, st.local), (0, 0, 0), "nothing held");
}

/// As above, but the snapshot service goes away before the next `Reserve` call: the admission
/// is still answered with the placement σ showed (it was another replica's answer for the
/// same id), not with this replica's own choice flagged stale, which would run the id on a
/// second worker.
#[test]
fn an_admission_sigma_placed_elsewhere_keeps_that_placement_when_sigma_goes_stale() {
    let mut fx = Fx::new(PolicyKind::Jsq, &[0, 0], 8);
    let (_, mut rx) = fx.assign("r", 50);
    fx.sigma_change(vec![change::request_reserved("r", 1, 101, 50, None, None)]);
    fx.core.on_disconnected(fx.now, fx.now);
    assert!(fx.core.is_stale());
    assert!(
        fx.core.take_reserve(fx.now).is_none(),
        "nothing sent while stale"
    );
    let a = answer(&mut rx);
    assert_eq!((a.worker, a.incarnation, a.stale), (1, 101, false));
}
