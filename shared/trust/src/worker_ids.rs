//! The worker ids a worker identity names: one, or a contiguous range for a shim serving
//! several ranks of one engine server (`br-shim --worker-ids 0-7`).

use std::fmt;

use br_proto::valid::limits;

/// The ranks a worker identity names: one worker id, or a contiguous range of them
/// (`<first>-<last>`, first below last), each at most [`limits::MAX_WORKER_ID`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorkerIds {
    first: u32,
    last: u32,
}

/// Why a worker id or range cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkerIdsError {
    #[error("{0:?} is not a worker id nor a range FIRST-LAST of them (digits only)")]
    NotANumber(String),
    #[error("worker id {id} is above {max}, the highest the contract allows")]
    TooLarge { id: String, max: u32 },
    #[error(
        "the range {first}-{last} is not FIRST-LAST with FIRST below LAST (one worker is written {first})"
    )]
    NotARange { first: u32, last: u32 },
}

impl WorkerIds {
    /// One worker.
    pub fn one(id: u32) -> Result<WorkerIds, WorkerIdsError> {
        WorkerIds::check(id)?;
        Ok(WorkerIds {
            first: id,
            last: id,
        })
    }

    /// Workers `first..=last`, `first` below `last`.
    pub fn range(first: u32, last: u32) -> Result<WorkerIds, WorkerIdsError> {
        WorkerIds::check(first)?;
        WorkerIds::check(last)?;
        if first >= last {
            return Err(WorkerIdsError::NotARange { first, last });
        }
        Ok(WorkerIds { first, last })
    }

    fn check(id: u32) -> Result<(), WorkerIdsError> {
        if id > limits::MAX_WORKER_ID {
            return Err(WorkerIdsError::TooLarge {
                id: id.to_string(),
                max: limits::MAX_WORKER_ID,
            });
        }
        Ok(())
    }

    pub fn first(self) -> u32 {
        self.first
    }

    pub fn last(self) -> u32 {
        self.last
    }

    pub fn contains(self, worker_id: u32) -> bool {
        (self.first..=self.last).contains(&worker_id)
    }

    /// Whether it names exactly one worker.
    pub fn is_one(self) -> bool {
        self.first == self.last
    }
}

impl std::str::FromStr for WorkerIds {
    type Err = WorkerIdsError;

    /// `<id>` or `<first>-<last>`; digits only (no sign, no spaces), so each identity has one
    /// spelling.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let number = |part: &str| -> Result<u32, WorkerIdsError> {
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                return Err(WorkerIdsError::NotANumber(s.to_owned()));
            }
            part.parse().map_err(|_| WorkerIdsError::TooLarge {
                id: part.to_owned(),
                max: limits::MAX_WORKER_ID,
            })
        };
        match s.split_once('-') {
            None => WorkerIds::one(number(s)?),
            Some((first, last)) => WorkerIds::range(number(first)?, number(last)?),
        }
    }
}

impl fmt::Display for WorkerIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_one() {
            write!(f, "{}", self.first)
        } else {
            write!(f, "{}-{}", self.first, self.last)
        }
    }
}
