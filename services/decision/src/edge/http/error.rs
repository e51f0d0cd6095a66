//! [`JsonError`]: a failed answer as JSON, and the mapping of a gRPC code to grpc-gateway's
//! HTTP status ([`http_status`]) and to its name.
//!
//! Separate so the status table reads on its own; the handler and the body reader only
//! produce these.

use super::*;

/// An answer that failed: the HTTP status and the gRPC code it stands for, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonError {
    pub status: StatusCode,
    pub code: tonic::Code,
    pub message: String,
}

impl JsonError {
    pub(super) fn new(status: StatusCode, code: tonic::Code, message: impl Into<String>) -> Self {
        JsonError {
            status,
            code,
            message: message.into(),
        }
    }

    pub(super) fn invalid(message: impl Into<String>) -> Self {
        JsonError::new(
            StatusCode::BAD_REQUEST,
            tonic::Code::InvalidArgument,
            message,
        )
    }
}

impl From<tonic::Status> for JsonError {
    fn from(s: tonic::Status) -> Self {
        JsonError::new(http_status(s.code()), s.code(), s.message())
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    code: String,
    message: &'a str,
}

impl IntoResponse for JsonError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            code: code_name(self.code),
            message: &self.message,
        };
        (self.status, axum::Json(body)).into_response()
    }
}

/// The HTTP status grpc-gateway answers for a gRPC code (its `HTTPStatusFromCode`).
pub fn http_status(code: tonic::Code) -> StatusCode {
    use tonic::Code::*;
    match code {
        Ok => StatusCode::OK,
        // nginx's "client closed request", as grpc-gateway
        Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        Unknown | Internal | DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
        InvalidArgument | FailedPrecondition | OutOfRange => StatusCode::BAD_REQUEST,
        DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        NotFound => StatusCode::NOT_FOUND,
        AlreadyExists | Aborted => StatusCode::CONFLICT,
        PermissionDenied => StatusCode::FORBIDDEN,
        Unauthenticated => StatusCode::UNAUTHORIZED,
        ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Unavailable => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// A gRPC code's canonical name (`INVALID_ARGUMENT`), as the error body's `code`.
pub fn code_name(code: tonic::Code) -> String {
    br_runtime::error::code_label(code).to_ascii_uppercase()
}
