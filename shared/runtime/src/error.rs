//! One mapping from a service's error enum to a gRPC status (after quickwit's
//! `ServiceErrorCode`): each service implements [`ServiceError`] on its thiserror enum and
//! converts with [`ServiceError::to_status`] at the handler's edge.

/// An error that knows its gRPC code and a low-cardinality label for metrics.
pub trait ServiceError: std::error::Error {
    /// The gRPC code this error is answered with.
    fn grpc_code(&self) -> tonic::Code;

    /// A short stable label for the `reason` label of rejection counters.
    fn reason(&self) -> &'static str {
        code_label(self.grpc_code())
    }

    /// The status sent to the client: the code and the error's `Display` text.
    fn to_status(&self) -> tonic::Status {
        tonic::Status::new(self.grpc_code(), self.to_string())
    }
}

impl ServiceError for br_proto::ValidationError {
    fn grpc_code(&self) -> tonic::Code {
        tonic::Code::InvalidArgument
    }
    fn reason(&self) -> &'static str {
        self.reason_label()
    }
}

/// The `code` label value for a gRPC code, in snake case (`"invalid_argument"`), as used by
/// every service's metrics.
pub fn code_label(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "ok",
        Cancelled => "cancelled",
        Unknown => "unknown",
        InvalidArgument => "invalid_argument",
        DeadlineExceeded => "deadline_exceeded",
        NotFound => "not_found",
        AlreadyExists => "already_exists",
        PermissionDenied => "permission_denied",
        ResourceExhausted => "resource_exhausted",
        FailedPrecondition => "failed_precondition",
        Aborted => "aborted",
        OutOfRange => "out_of_range",
        Unimplemented => "unimplemented",
        Internal => "internal",
        Unavailable => "unavailable",
        DataLoss => "data_loss",
        Unauthenticated => "unauthenticated",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum DemoError {
        #[error("pool for group {0} is full")]
        PoolFull(String),
    }

    impl ServiceError for DemoError {
        fn grpc_code(&self) -> tonic::Code {
            match self {
                DemoError::PoolFull(_) => tonic::Code::ResourceExhausted,
            }
        }
    }

    #[test]
    fn maps_code_message_and_label() {
        let e = DemoError::PoolFull("g0".into());
        let s = e.to_status();
        assert_eq!(s.code(), tonic::Code::ResourceExhausted);
        assert_eq!(s.message(), "pool for group g0 is full");
        assert_eq!(e.reason(), "resource_exhausted");
        let v = br_proto::ValidationError::Empty { field: "group" };
        assert_eq!(v.to_status().code(), tonic::Code::InvalidArgument);
        assert_eq!(v.reason(), "empty");
    }
}
