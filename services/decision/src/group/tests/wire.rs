//! The messages: what the group's answers, `Reserve` and `Release` calls look like on the wire,
//! and how `Reserve` results are read.

use super::super::reservations::RejectReason;
use super::super::{CancelOutcome, Rejection, ReserveOutcome, wire};
use super::*;

#[test]
fn an_answer_on_the_wire() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 8);
    let (_, mut rx) = fx.assign("r", 10);
    fx.advance(Duration::from_millis(3));
    fx.tick_and_commit(false);
    let a = v1::AssignResponse::from(answer(&mut rx));
    assert_eq!(
        a,
        v1::AssignResponse {
            worker_id: 0,
            endpoint: "http://w0".into(),
            policy: "br0".into(),
            pool_wait_us: 3000,
            incarnation: 100,
            sigma_version: 1,
            stale: false,
        }
    );
}

#[test]
fn a_reserve_request_carries_the_tick() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
    let (_, _a) = fx.assign("a", 10);
    let (_, _b) = fx.assign("b", 20);
    fx.core.tick(fx.now);
    let job = fx.core.take_reserve(fx.now).unwrap();
    let req = wire::reserve_request(fx.core.group(), &job);
    assert_eq!(req.group, "g");
    let mut got: Vec<_> = req
        .reservations
        .iter()
        .map(|r| (r.request_id.as_str(), r.prompt_tokens, r.queue_if_full))
        .collect();
    got.sort_unstable();
    assert_eq!(
        got,
        [("a", 10, false), ("b", 20, false)],
        "pooled: no queueing"
    );
    for r in &req.reservations {
        assert_eq!(r.incarnation, 100 + u64::from(r.worker_id));
    }
}

#[test]
fn reserve_results_are_read_into_outcomes() {
    let failed = wire::reserve_outcome(Err(tonic::Status::unavailable("down")));
    assert_eq!(
        failed,
        ReserveOutcome::Failed {
            error: "unavailable: down".into()
        }
    );
    let answered = wire::reserve_outcome(Ok(v1::ReserveResponse {
        epoch: 3,
        version: 9,
        accepted: vec!["a".into()],
        rejected: vec![
            v1::ReservationRejection {
                request_id: "b".into(),
                reason: v1::RejectReason::WorkerFull as i32,
                detail: "full".into(),
            },
            v1::ReservationRejection {
                request_id: "c".into(),
                reason: 99, // unknown to this build
                detail: String::new(),
            },
        ],
    }));
    assert_eq!(
        answered,
        ReserveOutcome::Answered {
            epoch: 3,
            version: 9,
            accepted: vec!["a".into()],
            rejected: vec![
                Rejection {
                    request_id: "b".into(),
                    reason: RejectReason::WorkerFull,
                    detail: "full".into(),
                },
                Rejection {
                    request_id: "c".into(),
                    reason: RejectReason::Unspecified,
                    detail: String::new(),
                },
            ],
        }
    );
}

#[test]
fn releases_and_cancels_on_the_wire() {
    let group = GroupId::new("g").unwrap();
    let rel = wire::release_request(&group, vec!["a".into(), "b".into()]);
    assert_eq!(
        rel,
        v1::ReleaseRequest {
            group: "g".into(),
            request_ids: vec!["a".into(), "b".into()],
        }
    );
    assert_eq!(
        v1::CancelOutcome::from(CancelOutcome::Withdrawn),
        v1::CancelOutcome::Withdrawn
    );
    assert_eq!(
        v1::CancelOutcome::from(CancelOutcome::Released),
        v1::CancelOutcome::Released
    );
    assert_eq!(
        v1::CancelOutcome::from(CancelOutcome::NotFound),
        v1::CancelOutcome::NotFound
    );
}

#[test]
fn finished_requests_are_read_from_a_delta() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0], 8);
    let mut b = fx.writer.batch();
    b.apply(change::request_progress("x", 0, 100, 10, 1))
        .unwrap();
    b.commit();
    let mut b = fx.writer.batch();
    b.apply(change::request_finished("x", 7)).unwrap();
    let d = b.commit().unwrap();
    assert_eq!(wire::finished_requests(&d).collect::<Vec<_>>(), [("x", 7)]);
}
