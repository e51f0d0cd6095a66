//! `Cancel` answered RELEASED only once σ has dropped the reservation: the group core queues
//! the `Release` (sent with the group task's next flush, or once the `Reserve` carrying the
//! request returns), and the caller's answer waits here until the snapshot service has
//! acknowledged that call. A gateway that reads σ or Assigns again right after RELEASED must
//! not still find the reservation.

use std::future::Future;

use br_proto::valid::RequestId;
use tokio::sync::oneshot;

use crate::error::DecisionError;
use crate::group::CancelOutcome;

/// Where a `Cancel`'s answer goes.
pub type CancelReply = oneshot::Sender<Result<CancelOutcome, DecisionError>>;

/// The cancels answered RELEASED whose `Release` has not been sent yet. Cancels are rare next
/// to Assigns, so a short list scanned per flush costs nothing measurable.
#[derive(Debug, Default)]
pub struct ReleaseWaiters {
    waiting: Vec<(RequestId, CancelReply)>,
}

impl ReleaseWaiters {
    /// No Cancel waits for a Release's acknowledgement.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Answers `outcome` now, or, if it is RELEASED and `release_pending`, once the `Release`
    /// carrying `id` is acknowledged.
    pub fn answer(
        &mut self,
        id: RequestId,
        outcome: Result<CancelOutcome, DecisionError>,
        release_pending: bool,
        reply: CancelReply,
    ) {
        if matches!(outcome, Ok(CancelOutcome::Released)) && release_pending {
            self.waiting.push((id, reply));
        } else {
            let _ = reply.send(outcome);
        }
    }

    /// The waiters served by a `Release` of `ids` (sorted), taken out of the list.
    pub fn take_for(&mut self, ids: &[String]) -> Vec<(RequestId, CancelReply)> {
        if self.waiting.is_empty() {
            return Vec::new();
        }
        let (served, rest) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|(id, _)| {
                ids.binary_search_by(|i| i.as_str().cmp(id.as_str()))
                    .is_ok()
            });
        self.waiting = rest;
        served
    }

    /// Waiters whose `Release` will never be sent (the reservation was dropped otherwise, e.g.
    /// while its `Reserve` failed): answered now with what is known.
    pub fn settle(&mut self, still_pending: impl Fn(&str) -> bool) {
        if self.waiting.is_empty() {
            return;
        }
        let (keep, gone): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|(id, _)| still_pending(id.as_str()));
        self.waiting = keep;
        for (id, reply) in gone {
            let _ = reply.send(Err(DecisionError::ReleaseUnconfirmed {
                request_id: id.to_string(),
                detail: "its reservation was dropped before a Release was sent".into(),
            }));
        }
    }
}

/// Sends one `Release` (`call`) and then answers the cancels waiting for it: RELEASED once the
/// snapshot service acknowledged it (σ no longer holds the ids), a typed error otherwise (the
/// call is bounded by `--reserve-timeout`; an unreleased reservation expires by its TTL).
pub async fn release_then_answer<F>(
    call: F,
    waiters: Vec<(RequestId, CancelReply)>,
) -> Result<(), tonic::Status>
where
    F: Future<Output = Result<br_proto::v1::ReleaseResponse, tonic::Status>>,
{
    let result = call.await.map(|_| ());
    for (id, reply) in waiters {
        let _ = reply.send(match &result {
            Ok(()) => Ok(CancelOutcome::Released),
            Err(s) => Err(DecisionError::ReleaseUnconfirmed {
                request_id: id.to_string(),
                detail: format!(
                    "the snapshot service did not acknowledge the Release: {}",
                    s.message()
                ),
            }),
        });
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> RequestId {
        RequestId::new(s).unwrap()
    }

    #[tokio::test]
    async fn released_waits_for_the_acknowledged_release() {
        let mut w = ReleaseWaiters::default();
        let (tx, mut rx) = oneshot::channel();
        w.answer(id("a"), Ok(CancelOutcome::Released), true, tx);
        assert!(rx.try_recv().is_err(), "not answered before the Release");
        let served = w.take_for(&["a".to_string(), "b".to_string()]);
        assert_eq!(served.len(), 1);
        release_then_answer(
            async { Ok(br_proto::v1::ReleaseResponse::default()) },
            served,
        )
        .await
        .unwrap();
        assert_eq!(rx.await.unwrap(), Ok(CancelOutcome::Released));
    }

    #[tokio::test]
    async fn a_failed_release_is_a_typed_error() {
        let mut w = ReleaseWaiters::default();
        let (tx, rx) = oneshot::channel();
        w.answer(id("a"), Ok(CancelOutcome::Released), true, tx);
        let served = w.take_for(&["a".to_string()]);
        let r = release_then_answer(
            async { Err(tonic::Status::deadline_exceeded("Release timed out")) },
            served,
        )
        .await;
        assert!(r.is_err());
        let e = rx.await.unwrap().unwrap_err();
        assert!(matches!(e, DecisionError::ReleaseUnconfirmed { .. }), "{e}");
        assert!(e.to_string().contains("Release timed out"), "{e}");
    }

    #[test]
    fn other_outcomes_and_dropped_releases_are_answered_at_once() {
        let mut w = ReleaseWaiters::default();
        let (tx, mut rx) = oneshot::channel();
        w.answer(id("a"), Ok(CancelOutcome::Withdrawn), true, tx);
        assert_eq!(rx.try_recv().unwrap(), Ok(CancelOutcome::Withdrawn));
        let (tx, mut rx) = oneshot::channel();
        w.answer(id("b"), Ok(CancelOutcome::Released), false, tx);
        assert_eq!(rx.try_recv().unwrap(), Ok(CancelOutcome::Released));
        let (tx, mut rx) = oneshot::channel();
        w.answer(id("c"), Ok(CancelOutcome::Released), true, tx);
        w.settle(|id| id == "x");
        assert!(matches!(
            rx.try_recv().unwrap(),
            Err(DecisionError::ReleaseUnconfirmed { .. })
        ));
        assert!(w.take_for(&["c".to_string()]).is_empty());
    }
}
