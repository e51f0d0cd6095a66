//! One replayed request: wait for its arrival, `Assign` a rank, stream the completion from
//! that rank's shim and time its first token and the rest.
//!
//! Separate from the run that spawns these: the per-request path (and its SSE parsing) reads
//! on its own.

use super::*;

pub(super) async fn one(
    ctx: Arc<Ctx>,
    i: usize,
    r: TraceRequest,
) -> (RequestResult, Option<String>) {
    let arrival =
        Duration::from_secs_f64(r.arrival_ms.unwrap_or(0.0).max(0.0) / 1e3 * ctx.time_scale);
    tokio::time::sleep_until(ctx.start + arrival).await;
    let t0 = Instant::now();
    let id = format!("{}-{i}", ctx.cfg.run_id);
    let mut res = RequestResult {
        request_id: id.clone(),
        prompt_tokens: r.prompt_tokens,
        output_tokens: r.output_tokens,
        prompt_hash: r.prompt_hash,
        ..RequestResult::default()
    };
    let params = assign_params(&ctx.cfg.group, &id, &r);
    // What the decision saw, for the twin's replay (`--arrivals-csv`).
    res.expected_output = params.expected_output_tokens;
    res.request_class.clone_from(&params.request_class);
    let a = match ctx
        .assign
        .assign_within(&params, ctx.cfg.assign_timeout)
        .await
    {
        Ok(a) => a,
        Err(e) => {
            res.error = Some(format!("assign: {e}"));
            return (res, None);
        }
    };
    let answered = Instant::now();
    res.assign_ms = ms(answered - t0);
    let at_decision = answered.checked_sub(a.pool_wait).unwrap_or(t0).max(t0);
    res.arrival_ms = Some(ms(at_decision - ctx.start) / ctx.time_scale);
    res.worker_id = Some(a.worker_id);
    let base = if ctx.cfg.use_endpoint && !a.endpoint.is_empty() {
        Some(a.endpoint.clone())
    } else {
        ctx.cfg.rank_urls.get(a.worker_id as usize).cloned()
    };
    let Some(base) = base else {
        res.error = Some(format!("no URL for rank {}", a.worker_id));
        let _ = ctx.assign.cancel(&ctx.cfg.group, &id).await;
        return (res, Some(a.policy));
    };
    if let Err(e) = stream(&ctx, &base, &id, &r, t0, &mut res).await {
        res.error = Some(e);
        let _ = ctx.assign.cancel(&ctx.cfg.group, &id).await;
    }
    (res, Some(a.policy))
}

/// The Assign for `r`: its prompt, its true length as max_tokens, and its prompt hash, hint
/// ([`hint_sent`]) and class key when it has them.
pub(super) fn assign_params(group: &str, id: &str, r: &TraceRequest) -> AssignParams {
    let mut params = AssignParams::new(group, id, r.prompt_tokens.max(1))
        .with_max_tokens(r.output_tokens.max(1));
    if let Some(h) = r.prompt_hash {
        params = params.with_prompt_hash(h);
    }
    if let Some(e) = hint_sent(r) {
        params = params.with_expected_output_tokens(e);
    }
    if let Some(c) = &r.class {
        params = params.with_request_class(c.key());
    }
    params
}

/// The expected output length an Assign carries for `r`: its hint capped at max_tokens, which
/// is the true length here (the contract refuses a hint above max_tokens), and at least 1.
pub(super) fn hint_sent(r: &TraceRequest) -> Option<u32> {
    r.expected_output
        .map(|e| e.clamp(1, r.output_tokens.max(1)))
}

/// Sends one streaming completion and reads it to the end.
async fn stream(
    ctx: &Ctx,
    base: &str,
    id: &str,
    r: &TraceRequest,
    t0: Instant,
    res: &mut RequestResult,
) -> Result<(), String> {
    let body = serde_json::json!({
        "model": ctx.cfg.model,
        // Token ids: any OpenAI-compatible engine counts them exactly.
        "prompt": vec![1u32; r.prompt_tokens.max(1) as usize],
        "max_tokens": r.output_tokens.max(1),
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let resp = ctx
        .http
        .post(format!("{}/v1/completions", base.trim_end_matches('/')))
        .header("x-request-id", id)
        .json(&body)
        .send()
        .await
        .map_err(|e| format!("send: {e}"))?;
    if !resp.status().is_success() {
        let st = resp.status();
        let text = resp.text().await.unwrap_or_default();
        return Err(format!(
            "HTTP {st}: {}",
            text.chars().take(200).collect::<String>()
        ));
    }
    let mut events = std::pin::pin!(sse_events(resp.bytes_stream()));
    let mut tokens = 0u32;
    let mut usage_tokens = None;
    let mut first = None;
    let mut last = None;
    while let Some(ev) = events.next().await {
        let ev = ev.map_err(|e| format!("stream: {e}"))?;
        let now = Instant::now();
        if ev.data == "[DONE]" {
            continue;
        }
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&ev.data) else {
            continue;
        };
        let n = v["choices"].as_array().map_or(0, Vec::len);
        if n > 0 {
            tokens += 1;
            first.get_or_insert(now);
            last = Some(now);
        }
        if let Some(u) = v["usage"]["completion_tokens"].as_u64() {
            usage_tokens = Some(u as u32);
        }
    }
    let generated = usage_tokens.unwrap_or(tokens);
    res.generated = generated;
    if let (Some(f), Some(l)) = (first, last) {
        res.ttft_ms = Some(ms(f - t0));
        res.e2e_ms = Some(ms(l - t0));
        if tokens > 1 {
            res.tpot_ms = Some(ms(l - f) / f64::from(tokens - 1));
        }
    }
    if generated < r.output_tokens {
        return Err(format!(
            "stream ended after {generated} of {} tokens",
            r.output_tokens
        ));
    }
    Ok(())
}

/// The server-sent events of a response body, parsed by eventsource-stream (any of the three
/// line endings the SSE spec allows: LF, CRLF, CR, split anywhere across chunks).
///
/// The parser cannot tell a lone CR from the first half of a CRLF until the next byte arrives,
/// so it holds the line until then; a body that ends in CR would lose its last event. One LF
/// is fed after such a body, which only completes that line ending. (With CR-only framing each
/// event is therefore seen when the next bytes arrive; OpenAI-compatible engines send LF.)
pub(super) fn sse_events<S, E>(
    body: S,
) -> impl futures::Stream<Item = Result<Event, EventStreamError<E>>>
where
    S: futures::Stream<Item = Result<Bytes, E>>,
{
    let body = futures::stream::unfold(
        (Box::pin(body), false, false),
        |(mut body, ended_in_cr, done)| async move {
            if done {
                return None;
            }
            match body.next().await {
                Some(Ok(b)) => {
                    let cr = b.last().map_or(ended_in_cr, |c| *c == b'\r');
                    Some((Ok(b), (body, cr, false)))
                }
                Some(Err(e)) => Some((Err(e), (body, ended_in_cr, false))),
                None if ended_in_cr => Some((Ok(Bytes::from_static(b"\n")), (body, false, true))),
                None => None,
            }
        },
    );
    body.eventsource()
}
