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
//! ([`is_too_large`]: ingest's Report, snapshot's Apply) and counts it in its own refusal
//! counter. The rewritten (unary and server-streaming) refusals are counted by the layer's hook:
//! `balanceroute_<service>_oversize_calls_total`, registered by the service's edge.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

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

/// Called once for each response [`OversizeLayer`] rewrote (a counter).
pub type OversizeHook = Arc<dyn Fn() + Send + Sync>;

/// Rewrites a trailers-only OUT_OF_RANGE "decoded message length too large" response to
/// RESOURCE_EXHAUSTED and calls its hook; every other response passes untouched.
#[derive(Clone, Default)]
pub struct OversizeLayer {
    on_rewrite: Option<OversizeHook>,
}

impl OversizeLayer {
    /// A layer that calls `on_rewrite` for each refusal it rewrites (none: only rewrites).
    pub fn new(on_rewrite: Option<OversizeHook>) -> Self {
        OversizeLayer { on_rewrite }
    }
}

impl std::fmt::Debug for OversizeLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OversizeLayer")
            .field("counted", &self.on_rewrite.is_some())
            .finish()
    }
}

impl<S> tower::Layer<S> for OversizeLayer {
    type Service = Oversize<S>;

    fn layer(&self, inner: S) -> Oversize<S> {
        Oversize {
            inner,
            on_rewrite: self.on_rewrite.clone(),
        }
    }
}

/// The service [`OversizeLayer`] wraps.
#[derive(Clone)]
pub struct Oversize<S> {
    inner: S,
    on_rewrite: Option<OversizeHook>,
}

impl<S> std::fmt::Debug for Oversize<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Oversize").finish_non_exhaustive()
    }
}

impl<S, Req, B> tower::Service<Req> for Oversize<S>
where
    S: tower::Service<Req, Response = http::Response<B>>,
{
    type Response = http::Response<B>;
    type Error = S::Error;
    type Future = Rewriting<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        Rewriting {
            inner: self.inner.call(req),
            on_rewrite: self.on_rewrite.clone(),
        }
    }
}

pin_project_lite::pin_project! {
    /// The response future of [`Oversize`]: the inner one, its response rewritten.
    pub struct Rewriting<F> {
        #[pin]
        inner: F,
        on_rewrite: Option<OversizeHook>,
    }
}

impl<F, B, E> Future for Rewriting<F>
where
    F: Future<Output = Result<http::Response<B>, E>>,
{
    type Output = Result<http::Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let resp = std::task::ready!(this.inner.poll(cx))?;
        let (resp, rewritten) = rewrite_counted(resp);
        if rewritten && let Some(hook) = this.on_rewrite.as_ref() {
            hook();
        }
        Poll::Ready(Ok(resp))
    }
}

/// The one rewrite: status 11 whose message is tonic's decode-size refusal becomes 8; says
/// whether it rewrote.
fn rewrite_counted<B>(mut resp: http::Response<B>) -> (http::Response<B>, bool) {
    let headers = resp.headers();
    let out_of_range = headers
        .get("grpc-status")
        .is_some_and(|v| v.as_bytes() == b"11");
    if !out_of_range {
        return (resp, false);
    }
    let too_large = headers.get("grpc-message").is_some_and(|v| {
        v.to_str()
            .is_ok_and(|m| m.contains(TOO_LARGE_ENCODED) || m.contains(TOO_LARGE))
    });
    if too_large {
        resp.headers_mut()
            .insert("grpc-status", HeaderValue::from_static("8"));
    }
    (resp, too_large)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;

    fn status_of(s: tonic::Status) -> (String, String) {
        let (r, _) = rewrite_counted(s.into_http::<()>());
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

    /// The layer's hook counts exactly the responses it rewrote.
    #[tokio::test]
    async fn the_layer_counts_each_rewritten_refusal_and_nothing_else() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tower::{Layer as _, ServiceExt as _};

        let msg = "Error, decoded message length too large: found 9 bytes, the limit is: 4 bytes";
        let count = Arc::new(AtomicUsize::new(0));
        let hook: OversizeHook = {
            let count = count.clone();
            Arc::new(move || {
                count.fetch_add(1, Ordering::Relaxed);
            })
        };
        let layer = OversizeLayer::new(Some(hook));
        let answer = |status: tonic::Status| {
            layer.layer(tower::service_fn(move |(): ()| {
                let status = status.clone();
                async move { Ok::<_, std::convert::Infallible>(status.into_http::<()>()) }
            }))
        };
        let code = |r: http::Response<()>| r.headers()["grpc-status"].to_str().unwrap().to_owned();

        let r = answer(tonic::Status::out_of_range(msg))
            .oneshot(())
            .await
            .unwrap();
        assert_eq!(code(r), "8");
        assert_eq!(count.load(Ordering::Relaxed), 1);
        for other in [
            tonic::Status::out_of_range("seq"),
            tonic::Status::invalid_argument(msg),
            tonic::Status::ok(""),
        ] {
            let r = answer(other).oneshot(()).await.unwrap();
            assert_ne!(code(r), "8");
        }
        assert_eq!(
            count.load(Ordering::Relaxed),
            1,
            "only the rewrite is counted"
        );
    }
}
