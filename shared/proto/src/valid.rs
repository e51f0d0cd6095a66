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
    /// Longest request class key (`AssignRequest.request_class`), in bytes.
    pub const MAX_CLASS_BYTES: usize = 64;
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

mod report;
mod snapshot;

pub use report::{ValidHeartbeat, ValidHello, ValidProgress, ValidReport, ValidRequestProgress};
pub use snapshot::{
    ValidRelease, ValidReservation, ValidReserve, ValidSetCordon, ValidTelemetryChange, ValidWatch,
};

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
    /// A number is above another field of the same message that bounds it.
    #[error("{field} is {value}, above {limit_field} {limit}")]
    Exceeds {
        field: &'static str,
        value: u64,
        limit_field: &'static str,
        limit: u64,
    },
    /// A string contains a character its field does not take (besides control characters).
    #[error("{field} contains {found:?}, it takes only {allowed}")]
    Charset {
        field: &'static str,
        found: char,
        allowed: &'static str,
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
            ValidationError::Exceeds { .. } => "exceeds",
            ValidationError::Charset { .. } => "charset",
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

/// A client's expected output tokens: 1..=10M, and at most `max_tokens` when that is given
/// (the engine stops there, so a longer expectation cannot be right).
fn check_expected_output(
    v: Option<u32>,
    max_tokens: Option<u32>,
) -> Result<Option<u32>, ValidationError> {
    let Some(v) = v else {
        return Ok(None);
    };
    check_range("expected_output_tokens", v.into(), 1, MAX_TOKENS.into())?;
    if let Some(max) = max_tokens
        && v > max
    {
        return Err(ValidationError::Exceeds {
            field: "expected_output_tokens",
            value: v.into(),
            limit_field: "max_tokens",
            limit: max.into(),
        });
    }
    Ok(Some(v))
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

/// A request's class key (`AssignRequest.request_class`): 1..=64 bytes of printable ASCII
/// without spaces (0x21..=0x7E). Cheap to clone. What travels further is its [`Self::id`].
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestClass(Arc<str>);

impl RequestClass {
    /// What the field takes, as its error says.
    const ALLOWED: &'static str = "printable ASCII without spaces (0x21..=0x7E)";

    /// Validates `s` as a `request_class`.
    pub fn new(s: &str) -> Result<Self, ValidationError> {
        check_str("request_class", s, MAX_CLASS_BYTES, false)?;
        if let Some(found) = s.chars().find(|c| !c.is_ascii_graphic()) {
            return Err(ValidationError::Charset {
                field: "request_class",
                found,
                allowed: Self::ALLOWED,
            });
        }
        Ok(Self(Arc::from(s)))
    }

    /// The key as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The class id that σ carries (`Reservation.request_class_id`): see [`class_id`].
    pub fn id(&self) -> u64 {
        class_id(self.as_str())
    }
}

impl fmt::Debug for RequestClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for RequestClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The id of a class key: the 64-bit FNV-1a hash of its bytes, as `Reservation.request_class_id`
/// defines it. Defined in `br-core` ([`br_core::class_id`], where the reasons for a hash are
/// given), so the services, the simulator and the emulator compute the same id from a key.
pub use br_core::class_id;

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
    /// The client's expected output tokens: 1..=10M, at most `max_tokens`, when present.
    pub expected_output_tokens: Option<u32>,
    /// The request's class key, when present.
    pub request_class: Option<RequestClass>,
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
            expected_output_tokens: check_expected_output(m.expected_output_tokens, m.max_tokens)?,
            request_class: m
                .request_class
                .as_deref()
                .map(RequestClass::new)
                .transpose()?,
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
