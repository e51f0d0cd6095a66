//! The messages of the snapshot service: watches, reservations, cordons and the telemetry
//! changes ingest applies.

use super::*;

/// A validated `WatchRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidWatch {
    pub group: GroupId,
    /// 0 = the watcher holds no σ.
    pub epoch: u64,
    pub last_version: u64,
}

impl TryFrom<v1::WatchRequest> for ValidWatch {
    type Error = ValidationError;
    fn try_from(m: v1::WatchRequest) -> Result<Self, Self::Error> {
        Ok(ValidWatch {
            group: GroupId::new(&m.group)?,
            epoch: m.epoch,
            last_version: m.last_version,
        })
    }
}

/// A validated `Reservation`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidReservation {
    pub request_id: RequestId,
    pub worker_id: u32,
    /// Non-zero.
    pub incarnation: u64,
    /// 1..=10M.
    pub prompt_tokens: u32,
    pub prompt_hash: Option<u64>,
    pub max_tokens: Option<u32>,
    /// Accept past capacity (the request queues at the rank): on-arrival policies.
    pub queue_if_full: bool,
    /// 1..=10M and at most `max_tokens`, when present.
    pub expected_output_tokens: Option<u32>,
    /// Any value (a hash, [`super::class_id`]).
    pub request_class_id: Option<u64>,
}

impl TryFrom<v1::Reservation> for ValidReservation {
    type Error = ValidationError;
    fn try_from(m: v1::Reservation) -> Result<Self, Self::Error> {
        Ok(ValidReservation {
            request_id: RequestId::new(&m.request_id)?,
            worker_id: check_worker_id(m.worker_id)?,
            incarnation: check_incarnation(m.incarnation)?,
            prompt_tokens: check_prompt_tokens(m.prompt_tokens)?,
            prompt_hash: m.prompt_hash,
            max_tokens: check_max_tokens(m.max_tokens)?,
            queue_if_full: m.queue_if_full,
            expected_output_tokens: check_expected_output(m.expected_output_tokens, m.max_tokens)?,
            request_class_id: m.request_class_id,
        })
    }
}

/// A validated `ReserveRequest`: at most 65,536 reservations, each valid, no request id twice.
///
/// The whole call is rejected if any entry is invalid: a decision service that sends invalid
/// reservations has a bug, and a partial commit would hide it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidReserve {
    pub group: GroupId,
    pub reservations: Vec<ValidReservation>,
}

impl TryFrom<v1::ReserveRequest> for ValidReserve {
    type Error = ValidationError;
    fn try_from(m: v1::ReserveRequest) -> Result<Self, Self::Error> {
        Ok(ValidReserve {
            group: GroupId::new(&m.group)?,
            reservations: validate_list(
                "reservations",
                m.reservations,
                MAX_RESERVATIONS_PER_CALL,
                ValidReservation::try_from,
                |r| r.request_id.as_str(),
            )?,
        })
    }
}

/// A validated `ReleaseRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidRelease {
    pub group: GroupId,
    pub request_ids: Vec<RequestId>,
}

impl TryFrom<v1::ReleaseRequest> for ValidRelease {
    type Error = ValidationError;
    fn try_from(m: v1::ReleaseRequest) -> Result<Self, Self::Error> {
        Ok(ValidRelease {
            group: GroupId::new(&m.group)?,
            request_ids: validate_list(
                "request_ids",
                m.request_ids,
                MAX_RESERVATIONS_PER_CALL,
                |s| RequestId::new(&s),
                RequestId::as_str,
            )?,
        })
    }
}

/// A validated `SetCordonRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidSetCordon {
    pub group: GroupId,
    pub worker_id: u32,
    pub cordoned: bool,
}

impl TryFrom<v1::SetCordonRequest> for ValidSetCordon {
    type Error = ValidationError;
    fn try_from(m: v1::SetCordonRequest) -> Result<Self, Self::Error> {
        Ok(ValidSetCordon {
            group: GroupId::new(&m.group)?,
            worker_id: check_worker_id(m.worker_id)?,
            cordoned: m.cordoned,
        })
    }
}

/// A validated `TelemetryChange` (one change of ingest's `ChangeBatch`). The snapshot service
/// validates each change on its own so it can reject it by index (`ApplyAck.rejected`) and
/// apply the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValidTelemetryChange {
    /// A stream said Hello.
    WorkerHello {
        worker_id: u32,
        incarnation: u64,
        capacity: u32,
        endpoint: String,
    },
    /// A stream ended at `disconnected_at_unix_ms` (ingest's clock).
    WorkerDisconnected {
        worker_id: u32,
        incarnation: u64,
        disconnected_at_unix_ms: u64,
    },
    /// Cumulative progress of one request on the worker.
    RequestProgress {
        worker_id: u32,
        incarnation: u64,
        progress: ValidRequestProgress,
    },
    /// The worker's full state: exactly these requests (no duplicates, at most 65,536).
    WorkerSync {
        worker_id: u32,
        incarnation: u64,
        request_ids: Vec<RequestId>,
    },
}

impl ValidTelemetryChange {
    /// The worker (DP rank) the change is about.
    pub fn worker_id(&self) -> u32 {
        match self {
            ValidTelemetryChange::WorkerHello { worker_id, .. }
            | ValidTelemetryChange::WorkerDisconnected { worker_id, .. }
            | ValidTelemetryChange::RequestProgress { worker_id, .. }
            | ValidTelemetryChange::WorkerSync { worker_id, .. } => *worker_id,
        }
    }

    /// The worker incarnation the change is about.
    pub fn incarnation(&self) -> u64 {
        match self {
            ValidTelemetryChange::WorkerHello { incarnation, .. }
            | ValidTelemetryChange::WorkerDisconnected { incarnation, .. }
            | ValidTelemetryChange::RequestProgress { incarnation, .. }
            | ValidTelemetryChange::WorkerSync { incarnation, .. } => *incarnation,
        }
    }
}

impl TryFrom<v1::TelemetryChange> for ValidTelemetryChange {
    type Error = ValidationError;
    fn try_from(m: v1::TelemetryChange) -> Result<Self, Self::Error> {
        use v1::telemetry_change::Kind;
        match m.kind {
            Some(Kind::WorkerHello(h)) => {
                check_range("capacity", h.capacity.into(), 1, MAX_CAPACITY.into())?;
                check_str("endpoint", &h.endpoint, MAX_ENDPOINT_BYTES, true)?;
                Ok(ValidTelemetryChange::WorkerHello {
                    worker_id: check_worker_id(h.worker_id)?,
                    incarnation: check_incarnation(h.incarnation)?,
                    capacity: h.capacity,
                    endpoint: h.endpoint,
                })
            }
            Some(Kind::WorkerDisconnected(d)) => Ok(ValidTelemetryChange::WorkerDisconnected {
                worker_id: check_worker_id(d.worker_id)?,
                incarnation: check_incarnation(d.incarnation)?,
                disconnected_at_unix_ms: d.disconnected_at_unix_ms,
            }),
            Some(Kind::RequestProgress(p)) => {
                let worker_id = check_worker_id(p.worker_id)?;
                let incarnation = check_incarnation(p.incarnation)?;
                let progress = ValidRequestProgress::try_from(v1::RequestProgress {
                    request_id: p.request_id,
                    prompt_tokens: p.prompt_tokens,
                    generated_tokens: p.generated_tokens,
                    finished: p.finished,
                    unkeyed: p.unkeyed,
                })?;
                Ok(ValidTelemetryChange::RequestProgress {
                    worker_id,
                    incarnation,
                    progress,
                })
            }
            Some(Kind::WorkerSync(s)) => Ok(ValidTelemetryChange::WorkerSync {
                worker_id: check_worker_id(s.worker_id)?,
                incarnation: check_incarnation(s.incarnation)?,
                request_ids: validate_list(
                    "request_ids",
                    s.request_ids,
                    MAX_CAPACITY as usize,
                    |id| RequestId::new(&id),
                    RequestId::as_str,
                )?,
            }),
            None => Err(ValidationError::Missing {
                field: "TelemetryChange.kind",
            }),
        }
    }
}
