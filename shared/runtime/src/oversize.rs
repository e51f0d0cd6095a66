//! Oversize requests answered RESOURCE_EXHAUSTED, as gRPC says, instead of tonic's
//! OUT_OF_RANGE.
//!
//! tonic (0.14, `codec/decode.rs`) fails a message above `max_decoding_message_size` with
//! OUT_OF_RANGE "Error, decoded message length too large"; gRPC's status-code guide gives
//! RESOURCE_EXHAUSTED for a message larger than the receiver accepts, and clients retry or
//! alert on that code. For unary and server-streaming methods the request is decoded before the
//! handler runs, so the status goes out as a trailers-only response: `grpc-status` in the
//! response headers. [`OversizeLayer`], on every service's gRPC server (`serve`), rewrites
//! exactly that case (status 11 with tonic's decode message) to 8 and keeps the message. A
//! client-streaming method meets the error mid-stream inside its handler, which maps it itself
//! ([`is_too_large`]: ingest's Report, snapshot's Apply).

use std::task::{Context, Poll};

use futures::TryFutureExt as _;
use futures::future::MapOk;
use http::HeaderValue;

/// tonic's text for a message above the decoding limit, as sent (percent-encoded) in
/// `grpc-message`, and as it reads decoded.
const TOO_LARGE: &str = "decoded message length too large";
const TOO_LARGE_ENCODED: &str = "decoded%20message%20length%20too%20large";

/// Whether `status` is tonic's refusal of a message above `max_decoding_message_size` (as a
/// client-streaming handler reads it from its inbound stream).
pub fn is_too_large(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::OutOfRange && status.message().contains(TOO_LARGE)
}

/// Rewrites a trailers-only OUT_OF_RANGE "decoded message length too large" response to
/// RESOURCE_EXHAUSTED; every other response passes untouched.
#[derive(Debug, Clone, Copy, Default)]
pub struct OversizeLayer;

impl<S> tower::Layer<S> for OversizeLayer {
    type Service = Oversize<S>;

    fn layer(&self, inner: S) -> Oversize<S> {
        Oversize { inner }
    }
}

/// The service [`OversizeLayer`] wraps.
#[derive(Debug, Clone)]
pub struct Oversize<S> {
    inner: S,
}

type Rewrite<B> = fn(http::Response<B>) -> http::Response<B>;

impl<S, Req, B> tower::Service<Req> for Oversize<S>
where
    S: tower::Service<Req, Response = http::Response<B>>,
{
    type Response = http::Response<B>;
    type Error = S::Error;
    type Future = MapOk<S::Future, Rewrite<B>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        self.inner.call(req).map_ok(rewrite as Rewrite<B>)
    }
}

/// The one rewrite: status 11 whose message is tonic's decode-size refusal becomes 8.
pub fn rewrite<B>(mut resp: http::Response<B>) -> http::Response<B> {
    let headers = resp.headers();
    let out_of_range = headers
        .get("grpc-status")
        .is_some_and(|v| v.as_bytes() == b"11");
    if !out_of_range {
        return resp;
    }
    let too_large = headers.get("grpc-message").is_some_and(|v| {
        v.to_str()
            .is_ok_and(|m| m.contains(TOO_LARGE_ENCODED) || m.contains(TOO_LARGE))
    });
    if too_large {
        resp.headers_mut()
            .insert("grpc-status", HeaderValue::from_static("8"));
    }
    resp
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;

    fn status_of(s: tonic::Status) -> (String, String) {
        let r = rewrite(s.into_http::<()>());
        let h = |n: &str| {
            r.headers()
                .get(n)
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default()
        };
        (h("grpc-status"), h("grpc-message"))
    }

    #[test]
    fn only_tonics_decode_size_refusal_becomes_resource_exhausted() {
        let msg = "Error, decoded message length too large: found 20000000 bytes, the limit is: 16777216 bytes";
        let (code, text) = status_of(tonic::Status::out_of_range(msg));
        assert_eq!(code, "8");
        assert!(text.contains("too%20large"), "the message is kept: {text}");
        // Another OUT_OF_RANGE, and other codes, pass untouched.
        assert_eq!(status_of(tonic::Status::out_of_range("seq")).0, "11");
        assert_eq!(status_of(tonic::Status::invalid_argument(msg)).0, "3");
        assert!(is_too_large(&tonic::Status::out_of_range(msg)));
        assert!(!is_too_large(&tonic::Status::out_of_range("other")));
    }
}
