//! What a request's headers tell the picker: its group, its request id (made here when it has
//! none), the prompt tokens the gateway knows, its output-length hints, its trace context.

use envoy_types::pb::envoy::config::core::v3::HeaderMap;

use super::wire::{Refusal, fresh_request_id, header};
use super::{
    EXPECTED_OUTPUT_HEADER, GROUP_HEADER, PROMPT_TOKENS_HEADER, REQUEST_CLASS_HEADER,
    REQUEST_ID_HEADER, Stream,
};

/// What the request's headers said.
#[derive(Debug, Clone)]
pub(super) struct Head {
    pub(super) group: String,
    pub(super) request_id: String,
    /// The request had no `x-request-id`: this one was made here and is added to it.
    pub(super) generated_id: bool,
    pub(super) prompt_tokens: Option<u32>,
    /// The client's expected output tokens, as a count (Assign checks its range).
    pub(super) expected_output: Option<u32>,
    /// The request's class key, as sent (Assign checks it); an empty header is none, as an
    /// empty `x-request-id` is no id.
    pub(super) class: Option<String>,
    /// The request's W3C trace context (`traceparent`, `tracestate`), when traces are
    /// exported: its Assign continues the client's trace.
    pub(super) trace: br_trace::W3c,
}

impl Stream {
    /// What the request's headers say (refused 400 when they say it badly).
    pub(super) fn read_head(&self, headers: Option<&HeaderMap>) -> Result<Head, Refusal> {
        let get = |name: &str| headers.and_then(|h| header(h, name));
        let group = match get(GROUP_HEADER) {
            Some(g) => g,
            None => match &self.ext.settings.default_group {
                Some(g) => g.to_string(),
                None => {
                    return Err(Refusal::bad(format!(
                        "no {GROUP_HEADER} header and no --ext-proc-default-group"
                    )));
                }
            },
        };
        let (request_id, generated_id) = match get(REQUEST_ID_HEADER) {
            Some(id) if !id.is_empty() => (id, false),
            _ => (fresh_request_id(), true),
        };
        let count = |name: &str| match get(name) {
            None => Ok(None),
            Some(v) => v
                .trim()
                .parse::<u32>()
                .map(Some)
                .map_err(|_| Refusal::bad(format!("{name}: {v:?} is not a token count"))),
        };
        let prompt_tokens = count(PROMPT_TOKENS_HEADER)?;
        let expected_output = count(EXPECTED_OUTPUT_HEADER)?;
        if prompt_tokens.is_some() {
            self.count_source("header");
        }
        let trace = if br_trace::enabled() {
            br_trace::W3c {
                traceparent: get(br_trace::TRACEPARENT).unwrap_or_default(),
                tracestate: get(br_trace::TRACESTATE).unwrap_or_default(),
            }
        } else {
            br_trace::W3c::default()
        };
        Ok(Head {
            group,
            request_id,
            generated_id,
            prompt_tokens,
            expected_output,
            class: get(REQUEST_CLASS_HEADER).filter(|c| !c.is_empty()),
            trace,
        })
    }

    /// Counts where a request's prompt tokens came from.
    pub(super) fn count_source(&self, source: &str) {
        self.ext
            .metrics
            .ext_proc_prompt_tokens_source_total
            .with_label_values(&[source])
            .inc();
    }
}
