use crate::{RequestKey, WorkerId};

/// Everything the core can refuse. Callers map these to their own typed errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    #[error("worker {0} is not known in this group")]
    UnknownWorker(WorkerId),
    #[error("worker {0} is fenced and takes no requests")]
    WorkerFenced(WorkerId),
    #[error("request {0} is already known")]
    DuplicateRequest(RequestKey),
    #[error("request {0} is not known")]
    UnknownRequest(RequestKey),
    #[error("request {key} belongs to worker {owner}, not worker {claimed}")]
    WrongWorker {
        key: RequestKey,
        owner: WorkerId,
        claimed: WorkerId,
    },
    #[error("worker id {0} is above the group limit of {max}", max = crate::MAX_WORKERS - 1)]
    WorkerIdTooLarge(WorkerId),
    #[error("invalid policy configuration: {0}")]
    InvalidConfig(String),
}
