//! Charging a request body that is still arriving to the process's in-flight budget
//! (br-runtime's `in_flight`), the one the gRPC ports charge their unfinished messages to: a
//! peer that sends most of many bodies and never finishes them makes the process hold them
//! all, whichever port it does it on.
//!
//! Separate from the body reader: when a body is charged, and how much, reads on its own.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use br_runtime::{ConnectionKey, Held, InFlightBudget, Scope};
use hyper::body::{Body as HttpBody, Frame, SizeHint};

use super::*;

/// Where a body's bytes are charged: the process's budget, and the connection the body came
/// on (its local and remote address, as the gRPC ports key theirs).
#[derive(Clone, Debug)]
pub(super) struct BodyBudget {
    pub(super) budget: Arc<InFlightBudget>,
    pub(super) connection: ConnectionKey,
}

/// The budget refused a body: the answer is RESOURCE_EXHAUSTED, saying which budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct OverBudget(pub(super) Scope);

impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // the flag, so the operator who reads it knows which bound to look at
        let (which, flag) = match self.0 {
            Scope::Process => ("process's", "--max-in-flight-message-bytes"),
            Scope::Connection => (
                "connection's",
                "--max-in-flight-message-bytes-per-connection",
            ),
        };
        write!(
            f,
            "the request bodies still arriving are over this {which} budget ({flag}); \
             try again later"
        )
    }
}

impl std::error::Error for OverBudget {}

impl OverBudget {
    /// The refusal somewhere in `e`'s chain of sources (axum and http-body-util each wrap a
    /// body's error once more).
    pub(super) fn in_chain(e: &(dyn std::error::Error + 'static)) -> Option<OverBudget> {
        std::iter::successors(Some(e), |e| e.source())
            .find_map(|e| e.downcast_ref::<OverBudget>().copied())
    }
}

/// `body` (of `declared` bytes when it has a `Content-Length`), charged to `budget` while it
/// is unfinished.
///
/// A body that is whole in its first frame (every Assign and Cancel a gateway sends in one
/// write) is never charged, so it is served however full the budget is, as a gRPC message
/// whole in one chunk is. Otherwise, before the frame is handed on:
/// - with a `Content-Length`, that length is charged, once: it is what the client said it will
///   send and what will be buffered, and a refusal then comes before any more is read;
/// - without one (chunked), the bytes that have arrived are charged, frame by frame. Nothing
///   says how large such a body will be, and hyper knows an HTTP/1.1 chunked body has ended
///   only at the poll after its last chunk, so every chunked body, however small, looks
///   unfinished after its first frame: charging each one the largest body ([`MAX_BODY_BYTES`])
///   would refuse small chunked calls whenever the budget is nearly full. What has arrived is
///   what the reader holds (it keeps the frames and reserves nothing ahead), so the total
///   held stays bounded all the same.
///
/// The charge is given back when the last byte has arrived, when the body fails, and when the
/// body is dropped unread (the call's deadline, a client gone).
pub(super) fn charged(body: Body, declared: Option<usize>, budget: BodyBudget) -> Body {
    Body::new(Charged {
        inner: body,
        declared,
        received: 0,
        budget,
        held: None,
        refused: false,
    })
}

struct Charged {
    inner: Body,
    declared: Option<usize>,
    /// Data bytes handed on so far.
    received: usize,
    budget: BodyBudget,
    /// What the body holds against the budget; `None` while it holds nothing.
    held: Option<Held>,
    /// Refused: the error was handed on, and nothing more is read.
    refused: bool,
}

impl Charged {
    /// Holds `bytes` against the budget (from nothing, or more than before).
    fn hold(&mut self, bytes: usize) -> Result<(), Scope> {
        if let Some(held) = self.held.as_mut() {
            return held.try_set(bytes);
        }
        self.held = Some(self.budget.budget.try_hold(self.budget.connection, bytes)?);
        Ok(())
    }
}

impl HttpBody for Charged {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        if this.refused {
            return Poll::Ready(None);
        }
        let frame = match std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            other => {
                // the end of the body or its error: nothing more will arrive to hold
                this.held = None;
                return Poll::Ready(other);
            }
        };
        if let Some(data) = frame.data_ref() {
            this.received += data.len();
        }
        let finished =
            this.inner.is_end_stream() || this.declared.is_some_and(|d| this.received >= d);
        if finished {
            this.held = None;
            return Poll::Ready(Some(Ok(frame)));
        }
        match this.hold(this.declared.unwrap_or(this.received)) {
            Ok(()) => Poll::Ready(Some(Ok(frame))),
            Err(scope) => {
                this.refused = true;
                this.held = None;
                Poll::Ready(Some(Err(axum::Error::new(OverBudget(scope)))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.refused || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests;
