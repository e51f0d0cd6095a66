//! The service's one error enum and its single mapping to gRPC statuses.

use br_proto::ValidationError;
use br_runtime::error::ServiceError;

/// Why a call failed as a whole (per-change and per-reservation rejections are answered in
/// the response instead).
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The request failed validation (empty or oversized group or id, bad counts, ...).
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    /// The writer is gone: the service is shutting down.
    #[error("the snapshot service is shutting down")]
    ShuttingDown,
    /// A new group beyond `--max-groups`.
    #[error(
        "group {group:?} is new and the service holds --max-groups {max} groups; retry once an idle one is reclaimed"
    )]
    TooManyGroups { group: String, max: usize },
    /// The watcher's queue went over `--watcher-queue-bytes`: the stream is ended.
    #[error(
        "the watcher fell behind by {bytes} bytes, over --watcher-queue-bytes {max}; watch again to re-sync from a snapshot"
    )]
    WatcherTooSlow { bytes: usize, max: usize },
    /// SetCordon of a worker σ does not hold.
    #[error(
        "worker {worker} is not in σ of group {group:?} (its shim never said Hello in this epoch); cordon it once it has connected"
    )]
    UnknownWorker { group: String, worker: u32 },
    /// The cordon could not be written to `--cordon-file` (nothing changed).
    #[error("the cordon could not be written to --cordon-file ({0}); nothing changed, retry")]
    CordonNotSaved(String),
    /// A Watch beyond `--max-watchers` streams open at once.
    #[error("the service holds --max-watchers {max} Watch streams; retry once one ends")]
    TooManyWatchers { max: usize },
}

impl ServiceError for SnapshotError {
    fn grpc_code(&self) -> tonic::Code {
        match self {
            SnapshotError::Invalid(_) => tonic::Code::InvalidArgument,
            SnapshotError::ShuttingDown => tonic::Code::Unavailable,
            SnapshotError::UnknownWorker { .. } => tonic::Code::NotFound,
            SnapshotError::CordonNotSaved(_) => tonic::Code::Unavailable,
            SnapshotError::TooManyGroups { .. }
            | SnapshotError::WatcherTooSlow { .. }
            | SnapshotError::TooManyWatchers { .. } => tonic::Code::ResourceExhausted,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            SnapshotError::Invalid(e) => e.reason_label(),
            SnapshotError::ShuttingDown => "unavailable",
            SnapshotError::UnknownWorker { .. } => "unknown_worker",
            SnapshotError::CordonNotSaved(_) => "cordon_not_saved",
            SnapshotError::TooManyGroups { .. } => "max_groups",
            SnapshotError::WatcherTooSlow { .. } => "watcher_queue_bytes",
            SnapshotError::TooManyWatchers { .. } => "max_watchers",
        }
    }
}

impl From<SnapshotError> for tonic::Status {
    fn from(e: SnapshotError) -> tonic::Status {
        e.to_status()
    }
}
