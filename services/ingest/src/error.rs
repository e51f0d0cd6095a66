//! Ingest's errors: the ones that end a telemetry stream (each maps to one gRPC status, in one
//! place). Start-up errors are br-runtime's `skeleton::StartError`, shared by every service.

use br_proto::ValidationError;
use br_runtime::error::ServiceError;

/// Why a telemetry stream is ended by the server. Per-message problems do not end the stream
/// (they are acked REJECTED, see [`crate::session::Rejection`]).
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The first message is not a Hello.
    #[error("the first message on a Report stream must be a Hello")]
    FirstNotHello,
    /// The Hello (first or repeated) failed validation.
    #[error("invalid Hello: {0}")]
    InvalidHello(ValidationError),
    /// The worker id is above `--max-worker-id`.
    #[error("worker_id {worker_id} is above this deployment's highest rank {max}")]
    WorkerIdOutOfRange { worker_id: u32, max: u32 },
    /// The group is not in `--groups`.
    #[error("group {0:?} is not served by this ingest")]
    GroupNotAllowed(String),
    /// Under mutual TLS: the Hello claims a worker the client certificate is not. Worded as
    /// the authorisation layer words its denials: the role, the identity and the method.
    #[error(
        "role worker ({certified}) may not call /{}/Report as group {group:?} worker {worker_id}: its certificate is for {own}",
        br_proto::service_names::TELEMETRY
    )]
    NotYourWorker {
        certified: String,
        /// The slot the certificate does give (`group "g0" worker 3`, `group "g0" workers
        /// 0-3` for a shim serving several ranks, or any worker of a group for an unproven
        /// service-account mapping), or why it gives none.
        own: String,
        group: String,
        worker_id: u32,
    },
    /// A second Hello names another identity than the first.
    #[error(
        "a second Hello on this stream claims worker {worker_id} incarnation {incarnation} of group {group:?}; a stream carries one worker identity"
    )]
    IdentityChanged {
        group: String,
        worker_id: u32,
        incarnation: u64,
    },
    /// Another live stream holds the same worker (of incarnation `live`).
    #[error(
        "worker {worker_id} of group {group:?} is already connected on another stream (incarnation {live}; this Hello is incarnation {incarnation}): two shims with the same --worker-id, or a restarted shim whose old connection is not closed yet (keepalive closes a dead one)"
    )]
    AlreadyConnected {
        group: String,
        worker_id: u32,
        incarnation: u64,
        live: u64,
    },
    /// The snapshot service refused a Hello of this worker: σ holds it LIVE as another
    /// incarnation through another ingest replica (two shims with one --worker-id).
    #[error(
        "worker {worker_id} of group {group:?} is connected through another ingest replica ({detail}); this stream (incarnation {incarnation}) is refused and the live one is kept"
    )]
    ConnectedElsewhere {
        group: String,
        worker_id: u32,
        incarnation: u64,
        detail: String,
    },
    /// The snapshot service refused this worker's changes (`reason`: a stale incarnation, a
    /// fenced or unknown worker): what this stream acknowledged may not be in σ.
    #[error(
        "the snapshot service refused the changes of worker {worker_id} of group {group:?} incarnation {incarnation} ({reason}: {detail}); say Hello again with a new incarnation and a full state"
    )]
    RefusedBySnapshot {
        group: String,
        worker_id: u32,
        incarnation: u64,
        reason: &'static str,
        detail: String,
    },
    /// The worker kept sending above its rate limit.
    #[error("rate limit exceeded for too long ({limit} progress events/s per stream)")]
    Flood { limit: u32 },
    /// A message above `--max-message-bytes`.
    #[error("message too large: {0}")]
    MessageTooLarge(String),
    /// No Hello arrived within `--hello-timeout` of the stream's opening.
    #[error(
        "no Hello within {after:?} of opening the stream; a Report stream must start with a Hello"
    )]
    HelloTimeout { after: std::time::Duration },
    /// No message arrived for `--stream-idle-timeout` after the Hello (keepalive pings do not
    /// count): the worker is treated as gone.
    #[error(
        "no message for {after:?} (a worker sends a Heartbeat when it has nothing else to say); reconnect and send Hello and a full state again"
    )]
    Idle { after: std::time::Duration },
    /// A Progress or Heartbeat with seq `u64::MAX`: no later message could follow it.
    #[error(
        "seq 18446744073709551615 leaves no seq for a later message on this stream (last accepted: {last}); reconnect and send Hello and a full state again: each stream starts its own seq space"
    )]
    SeqExhausted { last: u64 },
    /// The server is shutting down.
    #[error("ingest is shutting down; reconnect and send Hello and a full state again")]
    ShuttingDown,
}

impl ServiceError for StreamError {
    fn grpc_code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            StreamError::FirstNotHello => Code::FailedPrecondition,
            StreamError::InvalidHello(_)
            | StreamError::IdentityChanged { .. }
            | StreamError::WorkerIdOutOfRange { .. } => Code::InvalidArgument,
            StreamError::GroupNotAllowed(_) | StreamError::NotYourWorker { .. } => {
                Code::PermissionDenied
            }
            StreamError::AlreadyConnected { .. } | StreamError::ConnectedElsewhere { .. } => {
                Code::AlreadyExists
            }
            StreamError::RefusedBySnapshot { .. } => Code::Aborted,
            StreamError::Flood { .. } | StreamError::MessageTooLarge(_) => Code::ResourceExhausted,
            // The server's deadline for the stream's next step passed. Not FAILED_PRECONDITION
            // (that is for a stream that broke the protocol, which a retry repeats) nor
            // UNAVAILABLE (the server is fine): a client that was only slow or paused may
            // reconnect and say Hello again at once, which the shims do for any code but
            // ABORTED.
            StreamError::HelloTimeout { .. } | StreamError::Idle { .. } => Code::DeadlineExceeded,
            StreamError::SeqExhausted { .. } => Code::OutOfRange,
            StreamError::ShuttingDown => Code::Unavailable,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            StreamError::FirstNotHello => "first_not_hello",
            StreamError::InvalidHello(_) => "invalid_hello",
            StreamError::WorkerIdOutOfRange { .. } => "worker_id_out_of_range",
            StreamError::GroupNotAllowed(_) => "group_not_allowed",
            StreamError::NotYourWorker { .. } => "not_your_worker",
            StreamError::IdentityChanged { .. } => "identity_changed",
            StreamError::AlreadyConnected { .. } => "already_connected",
            StreamError::ConnectedElsewhere { .. } => "connected_elsewhere",
            StreamError::RefusedBySnapshot { .. } => "refused_by_snapshot",
            StreamError::Flood { .. } => "flood",
            StreamError::MessageTooLarge(_) => "message_too_large",
            StreamError::HelloTimeout { .. } => "hello",
            StreamError::Idle { .. } => "idle",
            StreamError::SeqExhausted { .. } => "seq_exhausted",
            StreamError::ShuttingDown => "shutting_down",
        }
    }
}

impl StreamError {
    /// Whether the stream ended because a deadline passed (counted in
    /// `balanceroute_ingest_stream_timeouts_total{reason}`, not among the rejections: nothing
    /// the peer sent was refused).
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            StreamError::HelloTimeout { .. } | StreamError::Idle { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stream_error_has_its_code() {
        use tonic::Code;
        let cases = [
            (StreamError::FirstNotHello, Code::FailedPrecondition),
            (
                StreamError::InvalidHello(ValidationError::Empty { field: "group" }),
                Code::InvalidArgument,
            ),
            (
                StreamError::GroupNotAllowed("x".into()),
                Code::PermissionDenied,
            ),
            (
                StreamError::IdentityChanged {
                    group: "g".into(),
                    worker_id: 1,
                    incarnation: 2,
                },
                Code::InvalidArgument,
            ),
            (
                StreamError::AlreadyConnected {
                    group: "g".into(),
                    worker_id: 1,
                    incarnation: 2,
                    live: 1,
                },
                Code::AlreadyExists,
            ),
            (StreamError::Flood { limit: 5 }, Code::ResourceExhausted),
            (
                StreamError::ConnectedElsewhere {
                    group: "g".into(),
                    worker_id: 1,
                    incarnation: 2,
                    detail: "ingest-b".into(),
                },
                Code::AlreadyExists,
            ),
            (
                StreamError::RefusedBySnapshot {
                    group: "g".into(),
                    worker_id: 1,
                    incarnation: 2,
                    reason: "stale_incarnation",
                    detail: "x".into(),
                },
                Code::Aborted,
            ),
            (
                StreamError::WorkerIdOutOfRange {
                    worker_id: 9,
                    max: 7,
                },
                Code::InvalidArgument,
            ),
            (
                StreamError::MessageTooLarge("x".into()),
                Code::ResourceExhausted,
            ),
            (StreamError::ShuttingDown, Code::Unavailable),
            (
                StreamError::HelloTimeout {
                    after: std::time::Duration::from_secs(5),
                },
                Code::DeadlineExceeded,
            ),
            (
                StreamError::Idle {
                    after: std::time::Duration::from_secs(10),
                },
                Code::DeadlineExceeded,
            ),
            (
                StreamError::NotYourWorker {
                    certified: "spiffe://td/br/worker/g/1".into(),
                    own: "group \"g\" worker 1".into(),
                    group: "g".into(),
                    worker_id: 2,
                },
                Code::PermissionDenied,
            ),
        ];
        for (e, code) in cases {
            assert_eq!(e.to_status().code(), code, "{e}");
            assert!(!e.reason().is_empty());
        }
    }
}
