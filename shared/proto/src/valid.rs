//! Validated domain types built from the prost messages at a service's edge.
//!
//! Every message that arrives from the network goes through one of the `TryFrom` conversions
//! here before the service looks at it, so the rest of the code can rely on the invariants
//! (non-empty bounded ids without control characters, counts in range, no duplicates).
//! [`ValidationError`] says exactly which field is wrong and why, and converts into
//! `tonic::Status::invalid_argument`.

use std::borrow::Borrow;
use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use crate::v1;

/// The limits the validation enforces. They are part of the contract (the `.proto` comments
/// state them too).
pub mod limits {
    /// Longest group name, in bytes.
    pub const MAX_GROUP_BYTES: usize = 128;
    /// Longest request id, in bytes.
    pub const MAX_ID_BYTES: usize = 256;
    /// Longest worker endpoint, in bytes.
    pub const MAX_ENDPOINT_BYTES: usize = 512;
    /// Largest prompt, generated or max token count.
    pub const MAX_TOKENS: u32 = 10_000_000;
    /// Largest KV footprint of one request (prompt + generated tokens): one context window,
    /// which no model makes longer than the largest single count.
    pub const MAX_REQUEST_TOKENS: u32 = MAX_TOKENS;
    /// Largest worker capacity B (max_num_seqs).
    pub const MAX_CAPACITY: u32 = 65_536;
    /// Largest worker id (DP rank) in a group. One limit for every service and the routing core
    /// (σ mirrors a group into per-worker arrays); wide-EP groups run up to ~144 ranks.
    pub const MAX_WORKER_ID: u32 = 1_023;
    /// Most request updates in one telemetry `Progress`.
    pub const MAX_UPDATES_PER_PROGRESS: usize = 16_384;
    /// Most reservations in one `Reserve` call, or ids in one `Release` call.
    pub const MAX_RESERVATIONS_PER_CALL: usize = 65_536;
}

use limits::*;

/// What is wrong with a message. The `Display` text names the field and the rule, and is what
/// the client sees in the `INVALID_ARGUMENT` status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    /// A required string is empty.
    #[error("{field} must not be empty")]
    Empty { field: &'static str },
    /// A string is longer than its limit.
    #[error("{field} is {len} bytes long, at most {max} are allowed")]
    TooLong {
        field: &'static str,
        len: usize,
        max: usize,
    },
    /// A string contains a control character (they would corrupt logs and label values).
    #[error("{field} contains a control character")]
    ControlCharacter { field: &'static str },
    /// A number is outside its allowed range.
    #[error("{field} is {value}, it must be in {min}..={max}")]
    OutOfRange {
        field: &'static str,
        value: u64,
        min: u64,
        max: u64,
    },
    /// A required message or oneof is not set.
    #[error("{field} is missing")]
    Missing { field: &'static str },
    /// A repeated field has too many entries.
    #[error("{field} has {count} entries, at most {max} are allowed")]
    TooMany {
        field: &'static str,
        count: usize,
        max: usize,
    },
    /// The same request id appears twice where each may appear once.
    #[error("{field} lists request id {request_id:?} more than once")]
    Duplicate {
        field: &'static str,
        request_id: String,
    },
    /// An entry of a repeated field is invalid.
    #[error("{field}[{index}]: {source}")]
    Item {
        field: &'static str,
        index: usize,
        source: Box<ValidationError>,
    },
}

impl ValidationError {
    fn item(field: &'static str, index: usize) -> impl FnOnce(ValidationError) -> Self {
        move |source| ValidationError::Item {
            field,
            index,
            source: Box::new(source),
        }
    }

    /// A short stable label for metrics (`reason` label), e.g. `"out_of_range"`.
    pub fn reason_label(&self) -> &'static str {
        match self {
            ValidationError::Empty { .. } => "empty",
            ValidationError::TooLong { .. } => "too_long",
            ValidationError::ControlCharacter { .. } => "control_character",
            ValidationError::OutOfRange { .. } => "out_of_range",
            ValidationError::Missing { .. } => "missing",
            ValidationError::TooMany { .. } => "too_many",
            ValidationError::Duplicate { .. } => "duplicate",
            ValidationError::Item { source, .. } => source.reason_label(),
        }
    }
}

impl From<ValidationError> for tonic::Status {
    fn from(e: ValidationError) -> Self {
        tonic::Status::invalid_argument(e.to_string())
    }
}

fn check_str(
    field: &'static str,
    s: &str,
    max: usize,
    allow_empty: bool,
) -> Result<(), ValidationError> {
    if s.is_empty() && !allow_empty {
        return Err(ValidationError::Empty { field });
    }
    if s.len() > max {
        return Err(ValidationError::TooLong {
            field,
            len: s.len(),
            max,
        });
    }
    if s.chars().any(char::is_control) {
        return Err(ValidationError::ControlCharacter { field });
    }
    Ok(())
}

fn check_range(field: &'static str, value: u64, min: u64, max: u64) -> Result<(), ValidationError> {
    if value < min || value > max {
        return Err(ValidationError::OutOfRange {
            field,
            value,
            min,
            max,
        });
    }
    Ok(())
}

fn check_prompt_tokens(v: u32) -> Result<u32, ValidationError> {
    check_range("prompt_tokens", v.into(), 1, MAX_TOKENS.into()).map(|()| v)
}

fn check_max_tokens(v: Option<u32>) -> Result<Option<u32>, ValidationError> {
    if let Some(v) = v {
        check_range("max_tokens", v.into(), 1, MAX_TOKENS.into())?;
    }
    Ok(v)
}

fn check_worker_id(v: u32) -> Result<u32, ValidationError> {
    check_range("worker_id", v.into(), 0, MAX_WORKER_ID.into()).map(|()| v)
}

fn check_incarnation(v: u64) -> Result<u64, ValidationError> {
    check_range("incarnation", v, 1, u64::MAX).map(|()| v)
}

fn check_seq(v: u64) -> Result<u64, ValidationError> {
    check_range("seq", v, 1, u64::MAX).map(|()| v)
}

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident, $field:literal, $max:expr) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Arc<str>);

        impl $name {
            #[doc = concat!("Validates `s` as a `", $field, "`.")]
            pub fn new(s: &str) -> Result<Self, ValidationError> {
                check_str($field, s, $max, false)?;
                Ok(Self(Arc::from(s)))
            }

            /// The id as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<&str> for $name {
            type Error = ValidationError;
            fn try_from(s: &str) -> Result<Self, Self::Error> {
                Self::new(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = ValidationError;
            fn try_from(s: String) -> Result<Self, Self::Error> {
                Self::new(&s)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0.to_string()
            }
        }
    };
}

string_id!(
    /// A lockstep group name: 1..=128 bytes, no control characters. Cheap to clone.
    GroupId,
    "group",
    MAX_GROUP_BYTES
);
string_id!(
    /// A gateway's request id: 1..=256 bytes, no control characters. Cheap to clone.
    RequestId,
    "request_id",
    MAX_ID_BYTES
);

/// A validated `AssignRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidAssign {
    pub group: GroupId,
    pub request_id: RequestId,
    /// s_i, 1..=10M.
    pub prompt_tokens: u32,
    pub prompt_hash: Option<u64>,
    /// 1..=10M when present.
    pub max_tokens: Option<u32>,
}

impl TryFrom<v1::AssignRequest> for ValidAssign {
    type Error = ValidationError;
    fn try_from(m: v1::AssignRequest) -> Result<Self, Self::Error> {
        Ok(ValidAssign {
            group: GroupId::new(&m.group)?,
            request_id: RequestId::new(&m.request_id)?,
            prompt_tokens: check_prompt_tokens(m.prompt_tokens)?,
            prompt_hash: m.prompt_hash,
            max_tokens: check_max_tokens(m.max_tokens)?,
        })
    }
}

/// A validated `CancelRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidCancel {
    pub group: GroupId,
    pub request_id: RequestId,
}

impl TryFrom<v1::CancelRequest> for ValidCancel {
    type Error = ValidationError;
    fn try_from(m: v1::CancelRequest) -> Result<Self, Self::Error> {
        Ok(ValidCancel {
            group: GroupId::new(&m.group)?,
            request_id: RequestId::new(&m.request_id)?,
        })
    }
}

/// A validated telemetry `Hello`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidHello {
    pub group: GroupId,
    /// DP rank, 0..=[`MAX_WORKER_ID`].
    pub worker_id: u32,
    /// Non-zero.
    pub incarnation: u64,
    /// B, 1..=65,536.
    pub capacity: u32,
    /// At most 512 bytes; may be empty.
    pub endpoint: String,
}

impl TryFrom<v1::Hello> for ValidHello {
    type Error = ValidationError;
    fn try_from(m: v1::Hello) -> Result<Self, Self::Error> {
        check_range("capacity", m.capacity.into(), 1, MAX_CAPACITY.into())?;
        check_str("endpoint", &m.endpoint, MAX_ENDPOINT_BYTES, true)?;
        Ok(ValidHello {
            group: GroupId::new(&m.group)?,
            worker_id: check_worker_id(m.worker_id)?,
            incarnation: check_incarnation(m.incarnation)?,
            capacity: m.capacity,
            endpoint: m.endpoint,
        })
    }
}

/// A validated `RequestProgress` (one request in a telemetry `Progress`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidRequestProgress {
    pub request_id: RequestId,
    /// 0..=10M; 0 means "not known yet".
    pub prompt_tokens: u32,
    /// Cumulative, 0..=10M.
    pub generated_tokens: u32,
    pub finished: bool,
    /// `request_id` is the engine's id, not the gateway's (see the proto's `unkeyed`).
    pub unkeyed: bool,
}

impl TryFrom<v1::RequestProgress> for ValidRequestProgress {
    type Error = ValidationError;
    fn try_from(m: v1::RequestProgress) -> Result<Self, Self::Error> {
        check_range(
            "prompt_tokens",
            m.prompt_tokens.into(),
            0,
            MAX_TOKENS.into(),
        )?;
        check_range(
            "generated_tokens",
            m.generated_tokens.into(),
            0,
            MAX_TOKENS.into(),
        )?;
        Ok(ValidRequestProgress {
            request_id: RequestId::new(&m.request_id)?,
            prompt_tokens: m.prompt_tokens,
            generated_tokens: m.generated_tokens,
            finished: m.finished,
            unkeyed: m.unkeyed,
        })
    }
}

/// A validated telemetry `Progress`: seq ≥ 1, at most 16,384 updates, each valid, no request id
/// twice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidProgress {
    pub seq: u64,
    pub updates: Vec<ValidRequestProgress>,
    pub full_state: bool,
}

impl TryFrom<v1::Progress> for ValidProgress {
    type Error = ValidationError;
    fn try_from(m: v1::Progress) -> Result<Self, Self::Error> {
        let seq = check_seq(m.seq)?;
        let updates = validate_list(
            "updates",
            m.updates,
            MAX_UPDATES_PER_PROGRESS,
            ValidRequestProgress::try_from,
            |u| u.request_id.as_str(),
        )?;
        Ok(ValidProgress {
            seq,
            updates,
            full_state: m.full_state,
        })
    }
}

/// A validated telemetry `Heartbeat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValidHeartbeat {
    pub seq: u64,
}

impl TryFrom<v1::Heartbeat> for ValidHeartbeat {
    type Error = ValidationError;
    fn try_from(m: v1::Heartbeat) -> Result<Self, Self::Error> {
        Ok(ValidHeartbeat {
            seq: check_seq(m.seq)?,
        })
    }
}

/// A validated `WorkerReport` (one message on the telemetry stream). Whether a Hello is
/// allowed at this point of the stream is the stream handler's business, not this type's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValidReport {
    Hello(ValidHello),
    Progress(ValidProgress),
    Heartbeat(ValidHeartbeat),
}

impl ValidReport {
    /// The message's sequence number (`None` for a Hello).
    pub fn seq(&self) -> Option<u64> {
        match self {
            ValidReport::Hello(_) => None,
            ValidReport::Progress(p) => Some(p.seq),
            ValidReport::Heartbeat(h) => Some(h.seq),
        }
    }
}

impl TryFrom<v1::WorkerReport> for ValidReport {
    type Error = ValidationError;
    fn try_from(m: v1::WorkerReport) -> Result<Self, Self::Error> {
        use v1::worker_report::Kind;
        match m.kind {
            Some(Kind::Hello(h)) => Ok(ValidReport::Hello(h.try_into()?)),
            Some(Kind::Progress(p)) => Ok(ValidReport::Progress(p.try_into()?)),
            Some(Kind::Heartbeat(h)) => Ok(ValidReport::Heartbeat(h.try_into()?)),
            None => Err(ValidationError::Missing {
                field: "WorkerReport.kind",
            }),
        }
    }
}

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

/// Validates each entry of a repeated field (with its index in errors), enforces a count limit
/// (checked before any entry is looked at) and rejects duplicate request ids.
fn validate_list<M, T>(
    field: &'static str,
    items: Vec<M>,
    max: usize,
    convert: impl Fn(M) -> Result<T, ValidationError>,
    key: impl Fn(&T) -> &str,
) -> Result<Vec<T>, ValidationError> {
    if items.len() > max {
        return Err(ValidationError::TooMany {
            field,
            count: items.len(),
            max,
        });
    }
    let out = items
        .into_iter()
        .enumerate()
        .map(|(i, m)| convert(m).map_err(ValidationError::item(field, i)))
        .collect::<Result<Vec<T>, _>>()?;
    let mut seen = HashSet::with_capacity(out.len());
    for t in &out {
        if !seen.insert(key(t)) {
            return Err(ValidationError::Duplicate {
                field,
                request_id: key(t).to_owned(),
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests;
