//! Body reading and rewriting: a request body read within the size, time and shared buffer
//! budgets, and the plan of what goes upstream (`stream_options` asking for per-chunk usage)
//! and what is stripped again for the client ([`Strip`]).
//!
//! Separate from the handler: the byte-exact rewrite and the budget accounting are the parts
//! with their own benchmarks and tests.

use super::*;

/// What the client asked for in `stream_options`, when the shim asked for more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Strip {
    /// The client did not ask for `include_usage`: drop `usage` everywhere and the final
    /// usage-only chunk.
    pub(crate) all_usage: bool,
}

/// Reads a body to inspect within `--max-body-bytes` and `--body-timeout`, taking each byte
/// out of the shared `--max-buffered-body-bytes` budget as it arrives: a client that declares
/// a large body and sends little holds only what it sent. The permit is held as long as the
/// body is.
pub(crate) async fn read_body(
    shim: &Shim,
    mut body: Body,
    declared: Option<u64>,
) -> Result<(Bytes, Option<tokio::sync::OwnedSemaphorePermit>), Response> {
    use http_body_util::BodyExt as _;
    let deadline = tokio::time::Instant::now() + shim.body_timeout;
    // Declared lengths are checked against the limit before this; the pages of an unused
    // reservation are never touched.
    let mut buf = bytes::BytesMut::with_capacity(
        declared
            .map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX))
            .min(shim.max_body),
    );
    let mut held: Option<tokio::sync::OwnedSemaphorePermit> = None;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => {
                return Err(refuse(
                    shim,
                    StatusCode::REQUEST_TIMEOUT,
                    "body_timeout",
                    format!(
                        "the request body did not arrive within the shim's --body-timeout {:?}",
                        shim.body_timeout
                    ),
                ));
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return Err(
                    (StatusCode::BAD_REQUEST, format!("request body: {e}\n")).into_response()
                );
            }
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue; // trailers
        };
        if buf.len() + data.len() > shim.max_body {
            return Err(too_large(shim));
        }
        let Some(taken) = u32::try_from(data.len())
            .ok()
            .and_then(|n| Arc::clone(&shim.body_budget).try_acquire_many_owned(n).ok())
        else {
            return Err(refuse(
                shim,
                StatusCode::SERVICE_UNAVAILABLE,
                "body_budget",
                format!(
                    "the shim holds --max-buffered-body-bytes {} of request bodies; retry",
                    shim.max_buffered
                ),
            ));
        };
        match &mut held {
            Some(h) => h.merge(taken),
            None => held = Some(taken),
        }
        buf.extend_from_slice(&data);
    }
    Ok((buf.freeze(), held))
}

/// Decides what to send upstream: the original bytes, or the request with `stream_options`
/// asking for per-chunk usage, plus what to strip for the client.
///
/// Only the top level is parsed: every value stays the text it came as (a `RawValue` borrowed
/// from `raw`), so a large prompt or message list is neither built into a tree nor re-encoded.
/// The peak is the body plus the body sent on; a `serde_json::Value` tree of a 15 MB list of
/// messages took 22x the body (scripts/bench-shim-body.sh).
pub(crate) fn plan(raw: &Bytes, inject: bool) -> (Bytes, bool, Option<Strip>) {
    let Ok(mut top) = serde_json::from_slice::<BTreeMap<String, &RawValue>>(raw) else {
        return (raw.clone(), false, None);
    };
    let stream = top
        .get("stream")
        .and_then(|v| serde_json::from_str::<bool>(v.get()).ok())
        .unwrap_or(false);
    if !(stream && inject) {
        return (raw.clone(), stream, None);
    }
    let mut opts = match top.get("stream_options") {
        None => serde_json::Map::new(),
        Some(v) => match serde_json::from_str::<Value>(v.get()) {
            Ok(Value::Object(o)) => o,
            // stream_options of the wrong type: leave it for the engine to reject.
            _ => return (raw.clone(), stream, None),
        },
    };
    let flag = |o: &serde_json::Map<String, Value>, k: &str| {
        o.get(k).and_then(Value::as_bool).unwrap_or(false)
    };
    let include = flag(&opts, "include_usage");
    let continuous = include && flag(&opts, "continuous_usage_stats");
    if continuous {
        return (raw.clone(), stream, None);
    }
    opts.insert("include_usage".into(), Value::Bool(true));
    opts.insert("continuous_usage_stats".into(), Value::Bool(true));
    let Ok(opts) = serde_json::value::to_raw_value(&opts) else {
        return (raw.clone(), stream, None);
    };
    top.insert("stream_options".into(), &opts);
    // The body and a little more: no regrowth (and no transient second copy) while writing.
    let mut out = Vec::with_capacity(raw.len() + opts.get().len() + 64);
    match serde_json::to_writer(&mut out, &top) {
        Ok(()) => (
            Bytes::from(out),
            stream,
            Some(Strip {
                all_usage: !include,
            }),
        ),
        Err(_) => (raw.clone(), stream, None),
    }
}
