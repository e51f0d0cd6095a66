//! What a generation request asks for: the endpoint's kind (completions or chat), the body's
//! fields the emulator reads, and its prompt length in tokens.
//!
//! Separate from the handler: parsing and counting a request reads on its own.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Completion,
    Chat,
}

impl Kind {
    pub(super) fn id_prefix(self) -> &'static str {
        match self {
            Kind::Completion => "cmpl-",
            Kind::Chat => "chatcmpl-",
        }
    }
    pub(super) fn chunk_object(self) -> &'static str {
        match self {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        }
    }
    pub(super) fn object(self) -> &'static str {
        match self {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion",
        }
    }
}

#[derive(Debug, Deserialize, Default)]
pub(super) struct StreamOptions {
    #[serde(default)]
    pub(super) include_usage: Option<bool>,
    #[serde(default)]
    pub(super) continuous_usage_stats: Option<bool>,
}

/// The request fields the emulator reads (others are accepted and ignored).
#[derive(Debug, Deserialize)]
pub(super) struct GenRequest {
    #[serde(default)]
    pub(super) model: Option<String>,
    #[serde(default)]
    pub(super) prompt: Option<Value>,
    #[serde(default)]
    pub(super) messages: Option<Vec<Value>>,
    #[serde(default)]
    pub(super) max_tokens: Option<u32>,
    #[serde(default)]
    pub(super) max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub(super) stream: Option<bool>,
    #[serde(default)]
    pub(super) stream_options: Option<StreamOptions>,
    /// Emulator extension: the prompt's token count, when the prompt text is a stand-in.
    #[serde(default)]
    pub(super) prompt_tokens: Option<u32>,
    #[serde(default)]
    pub(super) n: Option<u32>,
    /// SGLang's DP rank pin (honoured on the port that serves every rank).
    #[serde(default)]
    pub(super) routed_dp_rank: Option<i64>,
}

/// Rough token count of a text (about 4 characters a token, at least 1).
fn text_tokens(s: &str) -> u32 {
    (s.chars().count().div_ceil(4)).max(1) as u32
}

pub(super) fn prompt_tokens(req: &GenRequest) -> u32 {
    if let Some(n) = req.prompt_tokens {
        return n.max(1);
    }
    if let Some(p) = &req.prompt {
        return match p {
            Value::String(s) => text_tokens(s),
            // A list of token ids, or a list of prompts (the first one counts: n = 1).
            Value::Array(items) => match items.first() {
                Some(Value::Number(_)) => items.len().max(1) as u32,
                Some(Value::String(s)) => text_tokens(s),
                Some(Value::Array(ids)) => ids.len().max(1) as u32,
                _ => 1,
            },
            _ => 1,
        };
    }
    if let Some(msgs) = &req.messages {
        let mut n = 0u32;
        for m in msgs {
            n = n.saturating_add(4);
            match m.get("content") {
                Some(Value::String(s)) => n = n.saturating_add(text_tokens(s)),
                Some(Value::Array(parts)) => {
                    for p in parts {
                        if let Some(Value::String(t)) = p.get("text") {
                            n = n.saturating_add(text_tokens(t));
                        }
                    }
                }
                _ => {}
            }
        }
        return n.max(1);
    }
    1
}
