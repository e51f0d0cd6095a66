//! The edge between a group's domain types and the protobuf messages: every `v1` message the
//! group state produces or consumes is built or parsed here, and `tonic::Status` goes no
//! further in. [`crate::task`] and [`crate::edge::grpc`] call these; the state machine never
//! sees a message.

use br_proto::v1;
use br_proto::valid::GroupId;
use br_runtime::error::code_label;
use br_sigma::Delta;

use super::{Assignment, CancelOutcome, Rejection, Reservation, ReserveJob, ReserveOutcome};

impl From<Assignment> for v1::AssignResponse {
    fn from(a: Assignment) -> Self {
        v1::AssignResponse {
            worker_id: a.worker,
            endpoint: a.endpoint,
            policy: a.policy.to_owned(),
            pool_wait_us: u64::try_from(a.pool_wait.as_micros()).unwrap_or(u64::MAX),
            incarnation: a.incarnation,
            sigma_version: a.sigma_version,
            stale: a.stale,
        }
    }
}

impl From<CancelOutcome> for v1::CancelOutcome {
    fn from(o: CancelOutcome) -> Self {
        match o {
            CancelOutcome::Withdrawn => v1::CancelOutcome::Withdrawn,
            CancelOutcome::Released => v1::CancelOutcome::Released,
            CancelOutcome::NotFound => v1::CancelOutcome::NotFound,
        }
    }
}

/// The `Reserve` call of a job.
pub fn reserve_request(group: &GroupId, job: &ReserveJob) -> v1::ReserveRequest {
    v1::ReserveRequest {
        group: group.to_string(),
        reservations: job
            .reservations
            .iter()
            .map(|r| reservation(r, job.queue_if_full))
            .collect(),
    }
}

fn reservation(r: &Reservation, queue_if_full: bool) -> v1::Reservation {
    v1::Reservation {
        request_id: r.request_id.to_string(),
        worker_id: r.worker,
        incarnation: r.incarnation,
        prompt_tokens: r.prompt_tokens,
        prompt_hash: r.prompt_hash,
        max_tokens: r.max_tokens,
        queue_if_full,
        expected_output_tokens: r.hints.expected_output,
        request_class_id: r.hints.class,
    }
}

/// What a `Reserve` call's result means for the group.
pub fn reserve_outcome(result: Result<v1::ReserveResponse, tonic::Status>) -> ReserveOutcome {
    match result {
        Err(status) => ReserveOutcome::Failed {
            error: format!("{}: {}", code_label(status.code()), status.message()),
        },
        Ok(resp) => ReserveOutcome::Answered {
            epoch: resp.epoch,
            version: resp.version,
            accepted: resp.accepted,
            rejected: resp
                .rejected
                .into_iter()
                .map(|r| Rejection {
                    request_id: r.request_id,
                    reason: v1::RejectReason::try_from(r.reason)
                        .unwrap_or(v1::RejectReason::Unspecified),
                    detail: r.detail,
                })
                .collect(),
        },
    }
}

/// The `Release` call for ids from [`super::GroupCore::take_release`].
pub fn release_request(group: &GroupId, request_ids: Vec<String>) -> v1::ReleaseRequest {
    v1::ReleaseRequest {
        group: group.to_string(),
        request_ids,
    }
}

/// The requests a delta places on a worker: reserved (by any replica) or reported running.
pub fn placed_requests(d: &Delta) -> impl Iterator<Item = &str> + '_ {
    d.changes.iter().filter_map(|c| match &c.kind {
        Some(v1::change::Kind::RequestReserved(r)) => Some(r.request_id.as_str()),
        Some(v1::change::Kind::RequestProgress(p)) => Some(p.request_id.as_str()),
        _ => None,
    })
}

/// The requests a delta finishes, with the tokens each generated.
pub fn finished_requests(d: &Delta) -> impl Iterator<Item = (&str, u32)> + '_ {
    d.changes.iter().filter_map(|c| match &c.kind {
        Some(v1::change::Kind::RequestFinished(f)) => {
            Some((f.request_id.as_str(), f.generated_tokens))
        }
        _ => None,
    })
}
