//! [`Track`]: one request's progress (id, prompt and generated tokens, finished), reported to
//! the sink as it changes and finished when dropped early.
//!
//! Separate from the stream that feeds it: what is reported, and when, reads on its own.

use super::*;

/// One request's progress, reported as it changes; reports `finished` when dropped early
/// (the client went away or the engine failed).
pub(crate) struct Track {
    pub(crate) shim: Arc<Shim>,
    pub(crate) id: Option<String>,
    /// The id is the gateway's (`X-Request-Id`), not the engine's: reported keyed.
    pub(crate) keyed: bool,
    pub(crate) prompt: u32,
    pub(crate) generated: u32,
    pub(crate) chunks: u32,
    usage_seen: bool,
    pub(crate) finished: bool,
}

impl Track {
    pub(crate) fn new(shim: Arc<Shim>, id: Option<String>) -> Self {
        shim.metrics.requests.inc();
        shim.metrics.active.inc();
        let t = Track {
            shim,
            keyed: id.is_some(),
            id,
            prompt: 0,
            generated: 0,
            chunks: 0,
            usage_seen: false,
            finished: false,
        };
        // Known at once: σ sees the request active on this worker before its first token.
        t.report();
        t
    }

    pub(crate) fn set_id(&mut self, id: Option<&str>) {
        if self.id.is_none()
            && let Some(id) = id.filter(|s| !s.is_empty())
        {
            self.id = Some(id.to_owned());
        }
    }

    pub(crate) fn report(&self) {
        if let Some(id) = &self.id {
            let sink = &self.shim.sink;
            if self.keyed {
                sink.progress(id, self.prompt, self.generated, self.finished);
            } else {
                sink.progress_unkeyed(id, self.prompt, self.generated, self.finished);
            }
            self.shim.metrics.reports.inc();
        }
    }

    fn set_generated(&mut self, g: u32) {
        if g > self.generated {
            self.shim
                .metrics
                .tokens
                .inc_by(u64::from(g - self.generated));
            self.generated = g;
        }
    }

    pub(crate) fn usage(&mut self, u: sse::UsageInfo) {
        self.usage_seen = true;
        if u.prompt_tokens > 0 {
            self.prompt = u.prompt_tokens;
        }
        self.set_generated(u.completion_tokens);
    }

    /// Reads one SSE event's chunk.
    pub(crate) fn observe(&mut self, data: &[u8]) {
        let Some(info) = sse::peek(data) else {
            return;
        };
        let had_id = self.id.is_some();
        self.set_id(info.id.as_deref());
        let before = (self.prompt, self.generated);
        if info.choices > 0 {
            self.chunks = self.chunks.saturating_add(1);
        }
        match info.usage {
            Some(u) => self.usage(u),
            None if !self.usage_seen && info.choices > 0 => self.set_generated(self.chunks),
            None => {}
        }
        if !had_id || before != (self.prompt, self.generated) {
            self.report();
        }
    }

    pub(crate) fn finish(&mut self) {
        if !self.finished {
            self.finished = true;
            self.shim.metrics.active.dec();
            self.report();
        }
    }
}

impl Drop for Track {
    fn drop(&mut self) {
        if !self.finished {
            tracing::debug!(request_id = ?self.id, generated = self.generated,
                "request ended early (client gone or engine error)");
        }
        self.finish();
    }
}
