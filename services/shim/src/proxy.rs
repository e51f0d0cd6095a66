//! The proxy handler: forwards one request to the engine and the answer back, headers
//! filtered hop by hop, within the in-flight limit; a generation request's body is read and
//! planned ([`super::body`]) and its response observed ([`super::stream`]).
//!
//! Separate from the parts it sequences, so the request's path through the shim reads in one
//! place.

use super::body::{plan, read_body};
use super::stream::Tracked;
use super::track::Track;
use super::*;

fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

fn forward_headers(from: &HeaderMap) -> HeaderMap {
    let mut h = HeaderMap::with_capacity(from.len());
    for (k, v) in from {
        if !hop_by_hop(k) {
            h.append(k.clone(), v.clone());
        }
    }
    h
}

/// A response body that holds a permit (a request in flight) until it ends or is dropped.
fn holding(
    permit: tokio::sync::OwnedSemaphorePermit,
    s: impl Stream<Item = Result<Bytes, reqwest::Error>> + Send + 'static,
) -> Body {
    use futures::StreamExt as _;
    Body::from_stream(s.map(move |c| {
        let _held = &permit;
        c
    }))
}

/// The proxy handler.
pub async fn proxy(State(shim): State<Arc<Shim>>, req: Request) -> Response {
    let tracked = req.method() == Method::POST && GENERATION_PATHS.contains(&req.uri().path());
    let path_q = req
        .uri()
        .path_and_query()
        .map_or_else(|| req.uri().path().to_owned(), |p| p.as_str().to_owned());
    let url = format!("{}{}", shim.upstream, path_q);
    let Ok(permit) = Arc::clone(&shim.in_flight).try_acquire_owned() else {
        return refuse(
            &shim,
            StatusCode::SERVICE_UNAVAILABLE,
            "concurrency",
            format!(
                "the shim is proxying --max-concurrent-requests {} requests; retry",
                shim.max_in_flight
            ),
        );
    };
    // A declared length over the limit is refused before a byte is read.
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > shim.max_body as u64) {
        return too_large(&shim);
    }
    if tracked && let Some(refused) = require_request_id(&shim, req.headers()) {
        return refused;
    }
    let (parts, body) = req.into_parts();
    let mut headers = forward_headers(&parts.headers);
    shim.pin.apply_header(&mut headers);

    if !tracked {
        // Not inspected, so streamed through, but no longer than the limit either.
        let limited = http_body_util::Limited::new(body, shim.max_body);
        let body = reqwest::Body::wrap_stream(http_body_util::BodyDataStream::new(limited));
        return match shim
            .client
            .request(parts.method, &url)
            .headers(headers)
            .body(body)
            .send()
            .await
        {
            Ok(resp) => {
                shim.upstream_answered(resp.status());
                let mut out = Response::builder().status(resp.status());
                if let Some(h) = out.headers_mut() {
                    *h = forward_headers(resp.headers());
                }
                out.body(holding(permit, resp.bytes_stream()))
                    .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response())
            }
            Err(e) => shim.unreachable("upstream", &e),
        };
    }

    let (raw, _buffered) = match read_body(&shim, body, declared).await {
        Ok(read) => read,
        Err(refused) => return refused,
    };
    // Before `plan`: the body sent on, and the client's own if the engine refuses the usage
    // options, both carry the rank.
    let raw = shim.pin.apply_field(raw);
    let header_id = parts
        .headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
        .map(str::to_owned);

    let inject = shim.inject_usage && shim.engine_takes_usage.load(Ordering::Relaxed);
    let (out_body, stream, mut strip) = plan(&raw, inject);
    let mut track = Track::new(shim.clone(), header_id);

    let send = |body: Bytes| {
        shim.client
            .post(&url)
            .headers(headers.clone())
            .body(body)
            .send()
    };
    let mut resp = match send(out_body).await {
        Ok(r) => r,
        Err(e) => return shim.unreachable("upstream", &e),
    };
    if strip.is_some()
        && matches!(resp.status().as_u16(), 400 | 422)
        && resp.headers().get(header::CONTENT_TYPE).is_some()
    {
        // The engine refused the request we changed. If it accepts the client's own request,
        // it does not support per-chunk usage: count chunks from now on.
        match send(raw.clone()).await {
            Ok(r) if r.status().is_success() => {
                if shim.engine_takes_usage.swap(false, Ordering::Relaxed) {
                    tracing::warn!(
                        "the engine refuses stream_options; counting chunks instead of reading usage"
                    );
                }
                strip = None;
                resp = r;
            }
            Ok(r) => resp = r,
            Err(e) => return shim.unreachable("upstream", &e),
        }
    }
    let status = resp.status();
    shim.upstream_answered(status);
    let mut out = Response::builder().status(status);
    if let Some(h) = out.headers_mut() {
        *h = forward_headers(resp.headers());
    }
    let is_sse = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));

    if status.is_success() && stream && is_sse {
        let body = Tracked {
            _permit: permit,
            upstream: Box::pin(resp.bytes_stream()),
            splitter: sse::EventSplitter::default(),
            strip,
            held: None,
            track,
            done: false,
        };
        return out
            .body(Body::from_stream(body))
            .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response());
    }

    // Not streaming (or an error): one body; read its usage, forward it as it was.
    let bytes = match resp.bytes().await {
        Ok(b) => b,
        Err(e) => {
            let detail = error_chain(&e);
            shim.upstream_failed(health::UpstreamError::Body, &detail);
            return bad_gateway(format!("upstream body: {detail}"));
        }
    };
    if status.is_success()
        && let Some(info) = sse::peek(&bytes)
    {
        track.set_id(info.id.as_deref());
        if let Some(u) = info.usage {
            track.usage(u);
        }
    }
    track.finish();
    out.body(Body::from(bytes))
        .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response())
}

/// `--require-request-id`: a generation request without `X-Request-Id` cannot be matched to
/// its reservation by id, so in strict mode it is refused (400) before anything is forwarded.
fn require_request_id(shim: &Shim, headers: &HeaderMap) -> Option<Response> {
    let has_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|s| !s.is_empty());
    if !shim.require_request_id || has_id {
        return None;
    }
    Some(refuse(
        shim,
        StatusCode::BAD_REQUEST,
        "no_request_id",
        "this shim runs with --require-request-id: send the id given to Decision.Assign in the \
         X-Request-Id header"
            .to_owned(),
    ))
}
