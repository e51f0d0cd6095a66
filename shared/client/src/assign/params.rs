//! What an `assign` sends ([`AssignParams`]) and gets back ([`Assignment`]), and what a
//! `cancel` did ([`CancelOutcome`]), with their wire conversions.
//!
//! Separate from the client: the call's data, apart from how it is delivered.

use super::*;

/// What the gateway knows about a request when it asks for a rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssignParams {
    /// The lockstep group whose ranks may take the request (1..=128 bytes).
    pub group: String,
    /// The gateway's id for the request, unique within the group; also the idempotency key
    /// (1..=256 bytes). Keep it for retries and for the engine request.
    pub request_id: String,
    /// `s_i`: the prompt's tokens (the KV tokens it brings to the decode rank), 1..=10M.
    pub prompt_tokens: u32,
    /// Any stable 64-bit hash of the prompt (used by the ExactMatch predictor), if known.
    pub prompt_hash: Option<u64>,
    /// The request's `max_tokens`, if known (1..=10M).
    pub max_tokens: Option<u32>,
    /// The client's expected output tokens, a hint read by the `brh-hinted` predictor, if
    /// known (1..=10M, at most `max_tokens`).
    pub expected_output_tokens: Option<u32>,
    /// The request's class key (template, tenant, tool use, thinking), if the gateway
    /// classifies its traffic (1..=64 bytes of printable ASCII without spaces).
    pub request_class: Option<String>,
}

impl AssignParams {
    pub fn new(
        group: impl Into<String>,
        request_id: impl Into<String>,
        prompt_tokens: u32,
    ) -> Self {
        AssignParams {
            group: group.into(),
            request_id: request_id.into(),
            prompt_tokens,
            prompt_hash: None,
            max_tokens: None,
            expected_output_tokens: None,
            request_class: None,
        }
    }

    pub fn with_prompt_hash(mut self, hash: u64) -> Self {
        self.prompt_hash = Some(hash);
        self
    }

    pub fn with_max_tokens(mut self, max_tokens: u32) -> Self {
        self.max_tokens = Some(max_tokens);
        self
    }

    pub fn with_expected_output_tokens(mut self, tokens: u32) -> Self {
        self.expected_output_tokens = Some(tokens);
        self
    }

    pub fn with_request_class(mut self, class: impl Into<String>) -> Self {
        self.request_class = Some(class.into());
        self
    }

    pub(super) fn to_request(&self) -> v1::AssignRequest {
        v1::AssignRequest {
            group: self.group.clone(),
            request_id: self.request_id.clone(),
            prompt_tokens: self.prompt_tokens,
            prompt_hash: self.prompt_hash,
            max_tokens: self.max_tokens,
            expected_output_tokens: self.expected_output_tokens,
            request_class: self.request_class.clone(),
        }
    }
}

/// The rank chosen for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// The DP rank within the group.
    pub worker_id: u32,
    /// The rank's endpoint as it announced it; empty if it announced none.
    pub endpoint: String,
    /// The worker incarnation the reservation is for.
    pub incarnation: u64,
    /// The policy that decided (`br0`, `jsq`, ...).
    pub policy: String,
    /// Time the request spent in the pool before admission (zero for an immediate answer).
    pub pool_wait: Duration,
    /// σ's version in the decision replica when it decided.
    pub sigma_version: u64,
    /// The decision was made while the snapshot service was unreachable.
    pub stale: bool,
    /// How many calls this took (1 without retries).
    pub attempts: u32,
    /// The decision replica that answered (its address as the client dialled it).
    pub replica: String,
}

impl Assignment {
    pub(super) fn from_response(r: v1::AssignResponse, attempts: u32, replica: &str) -> Self {
        Assignment {
            worker_id: r.worker_id,
            endpoint: r.endpoint,
            incarnation: r.incarnation,
            policy: r.policy,
            pool_wait: Duration::from_micros(r.pool_wait_us),
            sigma_version: r.sigma_version,
            stale: r.stale,
            attempts,
            replica: replica.to_owned(),
        }
    }
}

/// What a [`AssignClient::cancel`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CancelOutcome {
    /// The service knew no such request (never seen, expired, or already cancelled).
    NotFound,
    /// The request had been assigned; its reservation was released.
    Released,
    /// The request was waiting in the pool and left it.
    Withdrawn,
}
