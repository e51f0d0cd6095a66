//! One watcher's queue, between the writer (which never waits on it) and the watcher's Watch
//! stream: bounded in events and in bytes.
//!
//! * Full in events: [`Sender::try_send`] says [`Push::Full`] and the watcher lags (it gets a
//!   SLOW_CONSUMER reset and a snapshot once it has room, see `watchers`).
//! * Over its bytes: an event pushed while the queue already holds `max_bytes` or more ends
//!   the watcher: the queue is emptied at once (what it held is freed now, not when the peer
//!   goes away), and the stream's next item is the overflow (RESOURCE_EXHAUSTED), then its
//!   end. So a queue holds at most `max_bytes` plus one event, and one event (a snapshot
//!   larger than the bound) always fits behind what is below the bound: a watcher that reads
//!   always gets it.
//!
//! The bytes are each event's encoded size, counted once per event (events are shared by every
//! watcher, so this is what the watcher would be sent, an upper bound of what it holds alone).
//! The lock is held only to push or pop, never across an await.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use futures::Stream;

use super::watchers::Event;

/// What [`Sender::try_send`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Push {
    Queued,
    /// No room in events: nothing was queued.
    Full,
    /// The event would take the queue over its bytes: the watcher is ended (see the module).
    Ended,
    /// The watcher is gone (its stream was dropped) or was ended before.
    Closed,
}

/// Why the stream was ended by the service (its last item).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overflow {
    /// Bytes the queue held with the event that did not fit.
    pub bytes: usize,
    pub max_bytes: usize,
}

struct State {
    events: VecDeque<(Event, usize)>,
    bytes: usize,
    max_events: usize,
    max_bytes: usize,
    /// Set when the queue went over its bytes; taken by the stream once.
    overflow: Option<Overflow>,
    /// The stream has yielded its end (or the overflow): nothing more is queued.
    finished: bool,
    sender_gone: bool,
    receiver_gone: bool,
    waker: Option<Waker>,
}

type Shared = Arc<Mutex<State>>;

fn lock(s: &Shared) -> MutexGuard<'_, State> {
    // A panic while holding this lock leaves plain data behind; keep serving it.
    s.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A new queue holding at most `max_events` events and `max_bytes` bytes plus one event.
pub fn channel(max_events: usize, max_bytes: usize) -> (Sender, Receiver) {
    let shared = Arc::new(Mutex::new(State {
        events: VecDeque::new(),
        bytes: 0,
        max_events: max_events.max(1),
        max_bytes,
        overflow: None,
        finished: false,
        sender_gone: false,
        receiver_gone: false,
        waker: None,
    }));
    (
        Sender {
            shared: Arc::clone(&shared),
        },
        Receiver { shared },
    )
}

/// The writer's side.
pub struct Sender {
    shared: Shared,
}

impl Sender {
    /// Queues `ev` of `bytes` encoded bytes without waiting.
    pub fn try_send(&self, ev: Event, bytes: usize) -> Push {
        let mut s = lock(&self.shared);
        if s.receiver_gone || s.finished || s.overflow.is_some() {
            return Push::Closed;
        }
        if s.events.len() >= s.max_events {
            return Push::Full;
        }
        if !s.events.is_empty() && s.bytes >= s.max_bytes {
            s.overflow = Some(Overflow {
                bytes: s.bytes.saturating_add(bytes),
                max_bytes: s.max_bytes,
            });
            s.events.clear();
            s.events.shrink_to_fit();
            s.bytes = 0;
            wake(&mut s);
            return Push::Ended;
        }
        s.bytes += bytes;
        s.events.push_back((ev, bytes));
        wake(&mut s);
        Push::Queued
    }

    /// Events that can still be queued.
    pub fn room(&self) -> usize {
        let s = lock(&self.shared);
        s.max_events.saturating_sub(s.events.len())
    }

    /// The watcher is gone or ended: nothing more reaches it.
    pub fn is_closed(&self) -> bool {
        let s = lock(&self.shared);
        s.receiver_gone || s.finished || s.overflow.is_some()
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        let mut s = lock(&self.shared);
        s.sender_gone = true;
        wake(&mut s);
    }
}

fn wake(s: &mut State) {
    if let Some(w) = s.waker.take() {
        w.wake();
    }
}

/// The Watch stream's side: the queued events in order; after an overflow, one
/// `Err(Overflow)` and the end; the end once the writer drops the sender and the queue is
/// empty.
pub struct Receiver {
    shared: Shared,
}

impl Receiver {
    /// The next item if one is ready: `Some(None)` once the stream ended, `None` if nothing
    /// is queued yet (`waker`, if any, is woken when something is).
    fn next_item(&self, waker: Option<&Waker>) -> Option<Option<Result<Event, Overflow>>> {
        let mut s = lock(&self.shared);
        if let Some(o) = s.overflow.take() {
            s.finished = true;
            return Some(Some(Err(o)));
        }
        if s.finished {
            return Some(None);
        }
        if let Some((ev, bytes)) = s.events.pop_front() {
            s.bytes -= bytes;
            return Some(Some(Ok(ev)));
        }
        if s.sender_gone {
            s.finished = true;
            return Some(None);
        }
        if let Some(w) = waker {
            s.waker = Some(w.clone());
        }
        None
    }

    /// The next item without waiting (`None`: nothing queued now, or the end).
    pub fn try_recv(&mut self) -> Option<Result<Event, Overflow>> {
        self.next_item(None).flatten()
    }
}

impl Stream for Receiver {
    type Item = Result<Event, Overflow>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.next_item(Some(cx.waker())) {
            Some(item) => Poll::Ready(item),
            None => Poll::Pending,
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let mut s = lock(&self.shared);
        s.receiver_gone = true;
        s.events.clear();
        s.bytes = 0;
    }
}

impl std::fmt::Debug for Receiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = lock(&self.shared);
        f.debug_struct("Receiver")
            .field("events", &s.events.len())
            .field("bytes", &s.bytes)
            .finish_non_exhaustive()
    }
}
