//! The decision service's one error enum and its one mapping to a gRPC status.

use br_runtime::error::ServiceError;
use tonic::Code;

/// Everything an `Assign` or `Cancel` can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecisionError {
    /// The request failed validation (which field and why).
    #[error(transparent)]
    Invalid(#[from] br_proto::ValidationError),
    /// A retry reused a request id with different prompt tokens.
    #[error("request {request_id:?} was first sent with prompt_tokens {first}, now {now}")]
    Conflict {
        request_id: String,
        first: u32,
        now: u32,
    },
    /// This service does not decide for the group (see `--groups`).
    #[error("group {0:?} is not served by this decision service (see --groups)")]
    UnknownGroup(String),
    /// No σ for the group yet (not ready).
    #[error("no σ for group {0:?} yet; retry")]
    NoSigma(String),
    /// σ holds no live worker that accepts requests.
    #[error("no live worker in group {0:?}")]
    NoLiveWorker(String),
    /// The request was not admitted before its deadline; it left the pool.
    #[error("not admitted before the deadline")]
    DeadlineExceeded,
    /// The pool is at `--max-pool`.
    #[error("the pool of group {group:?} is full ({max} waiting)")]
    PoolFull { group: String, max: usize },
    /// The request was withdrawn by `Cancel`.
    #[error("cancelled")]
    Cancelled,
    /// The service is shutting down (or its group task is gone).
    #[error("shutting down")]
    ShuttingDown,
    /// The snapshot service refused the reservation as a duplicate (another replica, or an
    /// earlier incarnation of this one, placed the id) before this replica's σ shows where:
    /// UNAVAILABLE, so the client retries the same id and is answered with that placement
    /// once σ shows it (at once on a replica whose σ already does).
    #[error(
        "request {0:?} is already placed by another decision replica, and this replica's σ does not show it yet; retry the same request id"
    )]
    PlacedElsewhere(String),
    /// Under mutual TLS, a `Cancel` of a request another identity assigned (or one this
    /// service did not assign, whose owner it cannot tell).
    #[error(
        "request {request_id:?} was not assigned by {caller} through this decision service; only the identity that assigned a request may cancel it"
    )]
    NotOwner { request_id: String, caller: String },
    /// `Cancel` took the request out of this service, but the snapshot service did not
    /// acknowledge its `Release` (within `--reserve-timeout`): σ may still hold the
    /// reservation until its TTL expires, so the answer is not RELEASED but ABORTED (a
    /// retry cannot help: the request is no longer here to release).
    #[error(
        "request {request_id:?} left this decision service but σ may still hold its reservation ({detail}); it expires by its TTL"
    )]
    ReleaseUnconfirmed { request_id: String, detail: String },
    /// The snapshot service refused the reservation in a way a retry will not fix.
    #[error("reservation refused: {0}")]
    ReserveRefused(String),
}

impl ServiceError for DecisionError {
    fn grpc_code(&self) -> Code {
        match self {
            DecisionError::Invalid(_) | DecisionError::Conflict { .. } => Code::InvalidArgument,
            DecisionError::UnknownGroup(_) => Code::NotFound,
            DecisionError::NoSigma(_)
            | DecisionError::NoLiveWorker(_)
            | DecisionError::ShuttingDown
            | DecisionError::PlacedElsewhere(_) => Code::Unavailable,
            // Not UNAVAILABLE: a retried Cancel would find nothing here and say NOT_FOUND.
            DecisionError::ReleaseUnconfirmed { .. } => Code::Aborted,
            DecisionError::DeadlineExceeded => Code::DeadlineExceeded,
            DecisionError::PoolFull { .. } => Code::ResourceExhausted,
            DecisionError::Cancelled => Code::Cancelled,
            DecisionError::ReserveRefused(_) => Code::Internal,
            DecisionError::NotOwner { .. } => Code::PermissionDenied,
        }
    }
}

impl From<DecisionError> for tonic::Status {
    fn from(e: DecisionError) -> Self {
        e.to_status()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_code_per_error() {
        let cases = [
            (
                DecisionError::Invalid(br_proto::ValidationError::Empty { field: "group" }),
                Code::InvalidArgument,
            ),
            (
                DecisionError::Conflict {
                    request_id: "r".into(),
                    first: 1,
                    now: 2,
                },
                Code::InvalidArgument,
            ),
            (DecisionError::UnknownGroup("x".into()), Code::NotFound),
            (DecisionError::NoSigma("g".into()), Code::Unavailable),
            (DecisionError::NoLiveWorker("g".into()), Code::Unavailable),
            (DecisionError::DeadlineExceeded, Code::DeadlineExceeded),
            (
                DecisionError::PoolFull {
                    group: "g".into(),
                    max: 1,
                },
                Code::ResourceExhausted,
            ),
            (DecisionError::Cancelled, Code::Cancelled),
            (DecisionError::ShuttingDown, Code::Unavailable),
            (
                DecisionError::ReleaseUnconfirmed {
                    request_id: "r".into(),
                    detail: "Release timed out".into(),
                },
                Code::Aborted,
            ),
            (
                DecisionError::NotOwner {
                    request_id: "r".into(),
                    caller: "spiffe://td/br/gateway".into(),
                },
                Code::PermissionDenied,
            ),
        ];
        for (e, code) in cases {
            let s: tonic::Status = e.clone().into();
            assert_eq!(s.code(), code, "{e}");
            assert_eq!(s.message(), e.to_string());
        }
    }
}
