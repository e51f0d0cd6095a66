//! Request bodies: the process-wide budget of the bytes every stream buffers, and what a
//! buffered body tells (its `max_tokens`, the client's expected output tokens, an estimate of
//! its prompt's tokens).

use std::sync::Arc;

use prometheus::IntGauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, processing_response};

use super::wire::Phase;
use super::wire::{Refusal, continue_with};
use super::{Gone, MAX_BODY_BYTES, PROMPT_TOKENS_HEADER, State, Stream};

/// The request-body bytes all streams of the picker hold, bounded process-wide: each stream
/// bounds its own body ([`MAX_BODY_BYTES`]) but many streams could together exhaust memory.
/// A stream takes one permit per byte as each body message arrives and gives them back when
/// the body is dropped (parsed, or sent back to Envoy in full-duplex mode) or the stream ends;
/// a message that does not fit is refused 503 at once (nothing waits for room: Envoy retries
/// or fails over, and a waiting stream would hold what it has).
#[derive(Debug, Clone)]
pub(super) struct BodyBudget {
    permits: Arc<Semaphore>,
    /// The bytes held now (`balanceroute_decision_ext_proc_buffered_bytes`).
    held: IntGauge,
    pub(super) max: usize,
}

/// One stream's share of the [`BodyBudget`]; given back on drop.
#[derive(Debug)]
pub(super) struct BodyHold {
    permit: OwnedSemaphorePermit,
    held: IntGauge,
}

impl BodyBudget {
    pub(super) fn new(max: usize, held: IntGauge) -> BodyBudget {
        let max = max.min(Semaphore::MAX_PERMITS);
        BodyBudget {
            permits: Arc::new(Semaphore::new(max)),
            held,
            max,
        }
    }

    /// Takes `n` more bytes into `hold`; `false` (nothing taken) when they do not fit.
    pub(super) fn take(&self, hold: &mut Option<BodyHold>, n: usize) -> bool {
        if n == 0 {
            return true;
        }
        let Ok(n32) = u32::try_from(n) else {
            return false;
        };
        let Ok(permit) = Arc::clone(&self.permits).try_acquire_many_owned(n32) else {
            return false;
        };
        self.held.add(i64::from(n32));
        match hold {
            Some(h) => h.permit.merge(permit),
            None => {
                *hold = Some(BodyHold {
                    permit,
                    held: self.held.clone(),
                });
            }
        }
        true
    }
}

impl Drop for BodyHold {
    fn drop(&mut self) {
        self.held
            .sub(i64::try_from(self.permit.num_permits()).unwrap_or(i64::MAX));
    }
}

impl Stream {
    /// A request body message: buffered (within the stream's bound and the process-wide
    /// budget) until the body is whole, then parsed and routed.
    pub(super) async fn on_request_body(&mut self, b: HttpBody) -> Result<(), Gone> {
        use processing_response::Response as Out;
        let State::AwaitBody(head) = &self.state else {
            if self.request_duplex {
                // refused already: Envoy stops; nothing to answer chunk by chunk
                return Ok(());
            }
            return self.send(continue_with(Out::RequestBody)).await;
        };
        if self.body.len() + b.body.len() > MAX_BODY_BYTES {
            let refusal = Refusal::Input {
                status: 413,
                message: format!("request body over {MAX_BODY_BYTES} bytes"),
            };
            return self.refuse(refusal).await;
        }
        if !self.ext.budget.take(&mut self.body_hold, b.body.len()) {
            self.ext.metrics.ext_proc_budget_refusals_total.inc();
            let message = format!(
                "the endpoint picker holds its --ext-proc-max-buffered-bytes ({} bytes) \
                 of request bodies; retry",
                self.ext.budget.max
            );
            tracing::warn!(%message, "ext_proc request body refused");
            self.body = Vec::new();
            self.body_hold = None;
            return self.refuse(Refusal::Busy(message)).await;
        }
        self.body.extend_from_slice(&b.body);
        if !b.end_of_stream && !self.request_buffered {
            if self.request_duplex {
                // full duplex: the answers come once the body is whole
                return Ok(());
            }
            // A streamed chunk: Envoy waits for this answer before the next one.
            return self.send(continue_with(Out::RequestBody)).await;
        }
        let head = head.clone();
        let body = std::mem::take(&mut self.body);
        match parse_body(&body, head.prompt_tokens.is_none()) {
            Ok(said) => {
                let tokens = match head.prompt_tokens {
                    Some(t) => t,
                    None => {
                        self.count_source("estimate");
                        said.estimated.unwrap_or(1)
                    }
                };
                let phase = if self.request_duplex {
                    Phase::DuplexBody(body)
                } else {
                    // parsed: the bytes go back to the budget before the Assign waits
                    drop(body);
                    self.body_hold = None;
                    Phase::Body
                };
                let routed = self
                    .route(head, tokens, said.max_tokens, said.expected_output, phase)
                    .await;
                self.body_hold = None;
                routed
            }
            Err(refusal) => self.refuse(refusal).await,
        }
    }
}

/// What a request body says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BodySays {
    /// The estimated prompt tokens (when asked for).
    pub(super) estimated: Option<u32>,
    pub(super) max_tokens: Option<u32>,
    /// The client's expected output tokens ([`expected_output`]).
    pub(super) expected_output: Option<u32>,
}

/// What the body gives: the estimated prompt tokens (when `want_estimate`), `max_tokens` and
/// the expected output tokens.
pub(super) fn parse_body(body: &[u8], want_estimate: bool) -> Result<BodySays, Refusal> {
    let v: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| Refusal::bad(format!("the request body is not JSON: {e}")))?;
    let max_tokens = max_tokens(&v)?;
    let expected_output = expected_output(&v)?;
    let estimated = if want_estimate {
        Some(estimate(&v).ok_or_else(|| {
            Refusal::bad(format!(
                "the body has neither `messages` nor `prompt` to estimate the prompt's tokens \
                 from; set {PROMPT_TOKENS_HEADER}"
            ))
        })?)
    } else {
        None
    };
    Ok(BodySays {
        estimated,
        max_tokens,
        expected_output,
    })
}

/// The client's expected output tokens as NVIDIA Dynamo's requests carry them,
/// `nvext.agent_hints.osl`; absent or null: none. A count that is not a non-negative integer
/// is bad input; its range (1..=10M, at most `max_tokens`) is Assign's to check, so a 0 or
/// a count above `max_tokens` is refused with Assign's own error.
pub(super) fn expected_output(v: &serde_json::Value) -> Result<Option<u32>, Refusal> {
    match v.pointer("/nvext/agent_hints/osl") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(n) => n
            .as_u64()
            .map(|n| Some(u32::try_from(n).unwrap_or(u32::MAX)))
            .ok_or_else(|| {
                Refusal::bad(format!("nvext.agent_hints.osl: {n} is not a token count"))
            }),
    }
}

/// `max_completion_tokens` (the chat API's current name) or `max_tokens`; absent or null:
/// unknown. Anything but a positive integer is bad input (the engine would refuse it too).
pub(super) fn max_tokens(v: &serde_json::Value) -> Result<Option<u32>, Refusal> {
    for key in ["max_completion_tokens", "max_tokens"] {
        match v.get(key) {
            None | Some(serde_json::Value::Null) => continue,
            Some(n) => {
                return n
                    .as_u64()
                    .filter(|n| *n > 0)
                    .map(|n| Some(u32::try_from(n).unwrap_or(u32::MAX)))
                    .ok_or_else(|| Refusal::bad(format!("{key}: {n} is not a positive integer")));
            }
        }
    }
    Ok(None)
}

/// Tokens added per chat message for its role and the chat template's markers (OpenAI's
/// counting guide uses 3-4).
const TOKENS_PER_MESSAGE: u64 = 4;
/// UTF-8 bytes per token of text: the usual "a token is about 4 characters of English" rule,
/// applied to bytes so that text in scripts of 3-byte characters (CJK, about one token each)
/// is underestimated by less.
const BYTES_PER_TOKEN: u64 = 4;

/// Estimates a request's prompt tokens from an OpenAI-style body, without a tokenizer:
/// text bytes / 4 (rounded up) for `prompt` strings and chat `messages` (`content` strings or
/// `text` parts), plus 4 per message; token-id prompts count exactly. `None` without either
/// field. At least 1, at most u32::MAX (Assign refuses more than its 10,000,000 limit).
///
/// Why an estimate is good enough: it only weighs the reservation until the rank's shim
/// reports the request, with the engine's own prompt count, which then replaces it in σ.
/// Gateways that tokenize (or run prefill first) should send [`PROMPT_TOKENS_HEADER`].
pub fn estimate(v: &serde_json::Value) -> Option<u32> {
    use serde_json::Value as J;
    let text_tokens = |bytes: u64| bytes.div_ceil(BYTES_PER_TOKEN);
    let mut tokens: u64 = 0;
    let mut found = false;
    if let Some(J::Array(messages)) = v.get("messages") {
        found = true;
        for m in messages {
            tokens += TOKENS_PER_MESSAGE;
            match m.get("content") {
                Some(J::String(s)) => tokens += text_tokens(s.len() as u64),
                Some(J::Array(parts)) => {
                    for p in parts {
                        if let Some(J::String(s)) = p.get("text") {
                            tokens += text_tokens(s.len() as u64);
                        }
                    }
                }
                _ => {}
            }
        }
    }
    match v.get("prompt") {
        Some(J::String(s)) => {
            found = true;
            tokens += text_tokens(s.len() as u64);
        }
        Some(J::Array(items)) => {
            found = true;
            for item in items {
                match item {
                    J::String(s) => tokens += text_tokens(s.len() as u64),
                    // a prompt of token ids: exact
                    J::Number(_) => tokens += 1,
                    J::Array(ids) => tokens += ids.len() as u64,
                    _ => {}
                }
            }
        }
        _ => {}
    }
    found.then(|| u32::try_from(tokens.max(1)).unwrap_or(u32::MAX))
}
