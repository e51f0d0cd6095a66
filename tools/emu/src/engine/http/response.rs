//! The answers to a generation request in vLLM's wire shape: the SSE stream of chunks (with
//! per-chunk or final usage as `stream_options` asks) and the non-streaming full response.
//!
//! Separate from the handler, which admits the request and hands it here: the wire shapes are
//! the bulk of this API and read on their own.

use super::*;

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u32,
    total_tokens: u32,
    completion_tokens: u32,
}

#[derive(Serialize)]
struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    content: &'static str,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Choice {
    Chat {
        index: u32,
        delta: Delta,
        logprobs: Option<()>,
        finish_reason: Option<&'static str>,
    },
    Text {
        index: u32,
        text: &'static str,
        logprobs: Option<()>,
        finish_reason: Option<&'static str>,
        stop_reason: Option<()>,
    },
}

#[derive(Serialize)]
struct Chunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<Choice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

impl Gen {
    fn usage(&self, generated: u32) -> Usage {
        Usage {
            prompt_tokens: self.prompt,
            total_tokens: self.prompt.saturating_add(generated),
            completion_tokens: generated,
        }
    }

    fn event(&self, out: &mut Vec<u8>, choices: Vec<Choice>, usage: Option<Usage>) {
        let chunk = Chunk {
            id: &self.id,
            object: self.kind.chunk_object(),
            created: self.created,
            model: &self.model,
            choices,
            usage,
        };
        out.extend_from_slice(b"data: ");
        // Serialising these plain structs cannot fail.
        let _ = serde_json::to_writer(&mut *out, &chunk);
        out.extend_from_slice(b"\n\n");
    }

    /// The SSE events for tokens `from+1 ..= to` (and the role chunk first, for chat).
    fn token_events(&self, out: &mut Vec<u8>, from: u32, to: u32) {
        if from == 0 && to > 0 && self.kind == Kind::Chat {
            let usage = self.continuous.then(|| self.usage(0));
            self.event(
                out,
                vec![Choice::Chat {
                    index: 0,
                    delta: Delta {
                        role: Some("assistant"),
                        content: "",
                    },
                    logprobs: None,
                    finish_reason: None,
                }],
                usage,
            );
        }
        for k in from + 1..=to {
            let finish = (k >= self.max_tokens).then_some("length");
            let choice = match self.kind {
                Kind::Chat => Choice::Chat {
                    index: 0,
                    delta: Delta {
                        role: None,
                        content: TOKEN_TEXT,
                    },
                    logprobs: None,
                    finish_reason: finish,
                },
                Kind::Completion => Choice::Text {
                    index: 0,
                    text: TOKEN_TEXT,
                    logprobs: None,
                    finish_reason: finish,
                    stop_reason: None,
                },
            };
            let usage = self.continuous.then(|| self.usage(k));
            self.event(out, vec![choice], usage);
        }
    }

    fn final_events(&self, out: &mut Vec<u8>, generated: u32) {
        if self.include_usage {
            self.event(out, Vec::new(), Some(self.usage(generated)));
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
    }
}

struct StreamState {
    g: Gen,
    rx: watch::Receiver<Progress>,
    sent: u32,
    finished: bool,
}

pub(super) fn stream_response(g: Gen, rx: watch::Receiver<Progress>) -> Response {
    let state = StreamState {
        g,
        rx,
        sent: 0,
        finished: false,
    };
    let body = futures::stream::unfold(state, |mut st| async move {
        if st.finished {
            return None;
        }
        loop {
            // The engine task went away: end the stream (the client sees it cut short).
            if st.rx.changed().await.is_err() {
                return None;
            }
            let p = *st.rx.borrow_and_update();
            if p.generated <= st.sent && !p.done {
                continue;
            }
            let mut out = Vec::with_capacity(256);
            st.g.token_events(&mut out, st.sent, p.generated);
            st.sent = p.generated;
            if p.done {
                st.g.final_events(&mut out, p.generated);
                st.finished = true;
            }
            return Some((Ok::<_, std::convert::Infallible>(Bytes::from(out)), st));
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

#[derive(Serialize)]
struct Message {
    role: &'static str,
    content: String,
}

#[derive(Serialize)]
#[serde(untagged)]
enum FullChoice {
    Chat {
        index: u32,
        message: Message,
        logprobs: Option<()>,
        finish_reason: &'static str,
    },
    Text {
        index: u32,
        text: String,
        logprobs: Option<()>,
        finish_reason: &'static str,
        stop_reason: Option<()>,
    },
}

#[derive(Serialize)]
struct Full<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<FullChoice>,
    usage: Usage,
}

pub(super) async fn full_response(g: Gen, mut rx: watch::Receiver<Progress>) -> Response {
    let generated = loop {
        let p = *rx.borrow_and_update();
        if p.done {
            break p.generated;
        }
        if rx.changed().await.is_err() {
            return error(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped");
        }
    };
    let text = TOKEN_TEXT.repeat(generated as usize);
    let choice = match g.kind {
        Kind::Chat => FullChoice::Chat {
            index: 0,
            message: Message {
                role: "assistant",
                content: text,
            },
            logprobs: None,
            finish_reason: "length",
        },
        Kind::Completion => FullChoice::Text {
            index: 0,
            text,
            logprobs: None,
            finish_reason: "length",
            stop_reason: None,
        },
    };
    let full = Full {
        id: &g.id,
        object: g.kind.object(),
        created: g.created,
        model: &g.model,
        choices: vec![choice],
        usage: g.usage(generated),
    };
    match serde_json::to_vec(&full) {
        Ok(v) => ([(header::CONTENT_TYPE, "application/json")], Bytes::from(v)).into_response(),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}
