//! The messages of a worker's `Telemetry.Report` stream: Hello, progress, heartbeats.

use super::*;

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
