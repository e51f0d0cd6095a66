//! Why an `assign` or `cancel` failed ([`AssignError`]), and which gRPC failures may be
//! retried with the same request id.
//!
//! Separate so the retry rule sits beside the error it classifies, apart from the call loop.

use super::*;

/// Why an `assign` or `cancel` failed. [`AssignError::code`] gives the gRPC code.
#[derive(Debug, thiserror::Error)]
pub enum AssignError {
    /// The address is not a valid URI.
    #[error("invalid decision service address {addr:?}: {detail}")]
    BadAddress { addr: String, detail: String },
    /// The service rejected the request as invalid (not retried).
    #[error("invalid request: {0}")]
    InvalidArgument(String),
    /// Not admitted before the deadline; the request left the pool, nothing is reserved.
    #[error("not assigned before the deadline")]
    DeadlineExceeded,
    /// The request was withdrawn (`Cancel`) while it waited.
    #[error("cancelled: {0}")]
    Cancelled(String),
    /// The group's pool is full: shed the request or retry later (not retried here).
    #[error("pool full: {0}")]
    PoolFull(String),
    /// The decision service does not serve this group.
    #[error("not found: {0}")]
    NotFound(String),
    /// Every replica stayed unreachable or unavailable (no σ, no live worker, standby, shutting
    /// down) until the deadline, or none could be resolved; `attempts` calls were made.
    #[error("decision service unavailable after {attempts} attempt(s): {message}")]
    Unavailable { message: String, attempts: u32 },
    /// Any other status.
    #[error("decision service error: {0}")]
    Status(Status),
}

impl AssignError {
    /// The gRPC code this error corresponds to.
    pub fn code(&self) -> Code {
        match self {
            AssignError::BadAddress { .. } | AssignError::InvalidArgument(_) => {
                Code::InvalidArgument
            }
            AssignError::DeadlineExceeded => Code::DeadlineExceeded,
            AssignError::Cancelled(_) => Code::Cancelled,
            AssignError::PoolFull(_) => Code::ResourceExhausted,
            AssignError::NotFound(_) => Code::NotFound,
            AssignError::Unavailable { .. } => Code::Unavailable,
            AssignError::Status(s) => s.code(),
        }
    }

    /// Whether the gateway may try again (elsewhere or later) with the same request id.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            AssignError::Unavailable { .. } | AssignError::PoolFull(_)
        )
    }

    pub(super) fn from_status(s: Status, attempts: u32) -> Self {
        match s.code() {
            Code::InvalidArgument => AssignError::InvalidArgument(s.message().to_owned()),
            Code::DeadlineExceeded => AssignError::DeadlineExceeded,
            Code::Cancelled => AssignError::Cancelled(s.message().to_owned()),
            Code::ResourceExhausted => AssignError::PoolFull(s.message().to_owned()),
            Code::NotFound => AssignError::NotFound(s.message().to_owned()),
            Code::Unavailable | Code::FailedPrecondition => AssignError::Unavailable {
                message: s.message().to_owned(),
                attempts,
            },
            _ => AssignError::Status(s),
        }
    }
}

/// Whether a failed call may be repeated with the same request id.
pub(super) fn retryable(s: &Status) -> bool {
    match s.code() {
        Code::Unavailable | Code::FailedPrecondition => true,
        // h2 connection resets and broken pipes surface as Unknown/Internal with a transport
        // source; the server never sends those codes itself.
        Code::Unknown | Code::Internal => {
            std::error::Error::source(s).is_some()
                || s.message().contains("transport")
                || s.message().contains("connection")
        }
        // hyper's "operation was canceled": the connection went away under the call (a replica
        // killed as it was called), made on this side from a transport error, so it has a
        // source. A CANCELLED the server sent (the request was withdrawn by `Cancel`) has none
        // and is final. Seen losing a call in the failover e2e test.
        Code::Cancelled => std::error::Error::source(s).is_some(),
        _ => false,
    }
}
