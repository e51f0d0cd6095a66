//! [`Tracked`]: the client's response body, the engine's SSE stream observed chunk by chunk
//! (feeding a [`Track`]) and trimmed of what the shim asked for and the client did not.
//!
//! Separate from the handler and the tracker: the chunk handling (holding a chunk only until
//! its event ends) is the stream's alone.

use super::body::Strip;
use super::track::Track;
use super::*;

/// The client's body: the engine's stream, observed and (if needed) trimmed.
pub(crate) struct Tracked {
    /// This request's place among `--max-concurrent-requests`, until the stream ends.
    pub(crate) _permit: tokio::sync::OwnedSemaphorePermit,
    pub(crate) upstream: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
    pub(crate) splitter: sse::EventSplitter,
    pub(crate) strip: Option<Strip>,
    /// With `Strip::all_usage`: the events from the first terminal chunk on, held until the
    /// usage-only chunk the shim drops. An engine asked for usage moves `system_fingerprint`
    /// from each terminal chunk to that last chunk (vLLM does), so the shim puts it back
    /// where the client, who did not ask for usage, would have found it. Each event is kept
    /// with whether it is a terminal chunk.
    pub(crate) held: Option<Vec<(Vec<u8>, bool)>>,
    pub(crate) track: Track,
    pub(crate) done: bool,
}

impl Tracked {
    /// Observes every complete event in `data`; returns what the client gets.
    pub(crate) fn process(&mut self, data: Bytes) -> Bytes {
        let events = self.splitter.push(&data);
        let Some(strip) = self.strip else {
            for ev in &events {
                if let Some(d) = sse::event_data(ev) {
                    self.track.observe(&d);
                }
            }
            return data;
        };
        let mut out = Vec::with_capacity(data.len());
        for ev in events {
            let info = sse::event_data(&ev).and_then(|d| {
                self.track.observe(&d);
                sse::peek(&d).map(|info| (d, info))
            });
            let Some((d, info)) = info else {
                // not a chunk (a comment, `[DONE]`): after any held event, in order
                match &mut self.held {
                    Some(held) => held.push((ev.to_vec(), false)),
                    None => out.extend_from_slice(&ev),
                }
                continue;
            };
            if info.choices == 0 {
                if strip.all_usage && info.usage.is_some() {
                    // the usage-only chunk the client did not ask for
                    let fingerprint = sse::member(&d, "system_fingerprint");
                    self.release_held(&mut out, fingerprint);
                    continue;
                }
                if !strip.all_usage {
                    out.extend_from_slice(&ev); // the final usage chunk the client asked for
                    continue;
                }
            }
            let trimmed = match sse::remove_member(&d, "usage") {
                Some(trimmed) => sse::replace_data(&ev, &trimmed),
                None => ev.to_vec(),
            };
            if strip.all_usage && (info.finishing || self.held.is_some()) {
                self.held
                    .get_or_insert_with(Vec::new)
                    .push((trimmed, info.finishing));
                continue;
            }
            out.extend_from_slice(&trimmed);
        }
        Bytes::from(out)
    }

    /// Appends the held events to `out`, each terminal chunk with `fingerprint` (raw JSON) as
    /// its last member.
    fn release_held(&mut self, out: &mut Vec<u8>, fingerprint: Option<&[u8]>) {
        for (ev, terminal) in self.held.take().unwrap_or_default() {
            let with = fingerprint.filter(|_| terminal).and_then(|fp| {
                let d = sse::event_data(&ev)?;
                let d = sse::append_member(&d, "system_fingerprint", fp)?;
                Some(sse::replace_data(&ev, &d))
            });
            out.extend_from_slice(with.as_deref().unwrap_or(&ev));
        }
    }
}

impl Stream for Tracked {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            match self.upstream.as_mut().poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(data))) => {
                    self.track.shim.health.engine_streamed();
                    let out = self.process(data);
                    if out.is_empty() {
                        continue;
                    }
                    return Poll::Ready(Some(Ok(out)));
                }
                Poll::Ready(Some(Err(e))) => {
                    self.done = true;
                    tracing::warn!(request_id = ?self.track.id, error = %e, "engine stream failed");
                    self.track
                        .shim
                        .upstream_failed(health::UpstreamError::Body, &error_chain(&e));
                    self.track.finish();
                    return Poll::Ready(Some(Err(std::io::Error::other(e))));
                }
                Poll::Ready(None) => {
                    self.done = true;
                    self.track.finish();
                    // held events whose usage chunk never came go on as they are
                    let mut out = Vec::new();
                    self.release_held(&mut out, None);
                    let rest = self.splitter.rest();
                    if self.strip.is_some() {
                        out.extend_from_slice(&rest);
                    }
                    if out.is_empty() {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Ok(Bytes::from(out))));
                }
            }
        }
    }
}
