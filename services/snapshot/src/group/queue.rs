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
//!
//! Every queue of the process also shares one [`Budget`]: a queue's bound is the smaller of
//! its own `max_bytes` and its share of the budget (the budget over the queues open now), so
//! the queues of the process together hold at most the budget plus one event each, however
//! many watchers there are. Hundreds of watchers that never read, each allowed its own 64 MiB,
//! could otherwise hold tens of gigabytes between them.
//!
//! The Watch stream reads it through [`Receiver::merging`]: each read also takes the deltas
//! queued right behind a delta and sends them as one (see [`Merging`]), so a watcher that fell
//! a few versions behind gets one message, never waiting for more to come.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use futures::Stream;

use super::event::{Event, MERGE_MAX_CHANGES, merge};

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

/// The bytes every watcher queue of the process may hold together: each open queue may hold
/// `max / open` (and its own `max_bytes`), so a queue's share shrinks as watchers come and
/// grows as they go. Shared by the groups (through `Settings`).
#[derive(Debug)]
pub struct Budget {
    max: usize,
    /// Queues counted in the shares: open, not ended, their stream not gone.
    open: AtomicUsize,
}

impl Budget {
    pub fn new(max: usize) -> Budget {
        Budget {
            max,
            open: AtomicUsize::new(0),
        }
    }

    /// The bytes the process's watcher queues may hold together.
    pub fn max(&self) -> usize {
        self.max
    }

    /// One open queue's share.
    fn share(&self) -> usize {
        self.max / self.open.load(Ordering::Relaxed).max(1)
    }
}

/// Why the stream was ended by the service (its last item).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overflow {
    /// Bytes the queue held with the event that did not fit.
    pub bytes: usize,
    /// The queue's bound then: its own, or its share of the process's budget if smaller.
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
    budget: Arc<Budget>,
    /// Counted in the budget's open queues (until it is ended or its stream goes).
    in_budget: bool,
}

impl State {
    /// The bytes this queue may hold now.
    fn limit(&self) -> usize {
        self.max_bytes.min(self.budget.share())
    }

    /// No longer counted in the budget's shares (ended, or its stream gone); once.
    fn leave_budget(&mut self) {
        if std::mem::take(&mut self.in_budget) {
            self.budget.open.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

type Shared = Arc<Mutex<State>>;

fn lock(s: &Shared) -> MutexGuard<'_, State> {
    // A panic while holding this lock leaves plain data behind; keep serving it.
    s.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A new queue holding at most `max_events` events and `max_bytes` bytes (or its share of
/// `budget`, if smaller) plus one event.
pub fn channel(max_events: usize, max_bytes: usize, budget: &Arc<Budget>) -> (Sender, Receiver) {
    budget.open.fetch_add(1, Ordering::Relaxed);
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
        budget: Arc::clone(budget),
        in_budget: true,
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
        let limit = s.limit();
        if !s.events.is_empty() && s.bytes >= limit {
            s.overflow = Some(Overflow {
                bytes: s.bytes.saturating_add(bytes),
                max_bytes: limit,
            });
            s.events.clear();
            s.events.shrink_to_fit();
            s.bytes = 0;
            s.leave_budget();
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
    /// With `merging`, a delta comes with the deltas queued right behind it, merged.
    fn next_item(
        &self,
        waker: Option<&Waker>,
        merging: bool,
    ) -> Option<Option<Result<Event, Overflow>>> {
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
            if !merging || !matches!(ev, Event::Delta(_)) {
                return Some(Some(Ok(ev)));
            }
            let mut run = take_run(&mut s, ev, bytes);
            if run.len() == 1 {
                return Some(run.pop().map(Ok));
            }
            // Merged outside the lock: the writer pushes to this queue meanwhile.
            drop(s);
            let refs: Vec<&Event> = run.iter().collect();
            return Some(Some(Ok(merge(&refs))));
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
        self.next_item(None, false).flatten()
    }

    /// This queue read as the Watch stream sends it: runs of queued deltas merged.
    pub fn merging(self) -> Merging {
        Merging(self)
    }
}

/// A merged message's bound in encoded bytes: 64 KiB, far below what a watcher decodes
/// (`br_client::watch::DEFAULT_MAX_MESSAGE_BYTES`, 64 MiB), so merging never makes a message a
/// watcher refuses, and one message does not hold an HTTP/2 connection long. A single delta
/// above it still goes out, alone, as it would unmerged.
///
/// It is also what each Watch stream holds encoded while its peer does not read: tonic's
/// encoder keeps a buffer as large as the largest chunk it yielded, and HTTP/2 takes the
/// whole chunk once the stream has any window and holds what is beyond the window. At 1 MiB,
/// 512 watchers that never read held about a gigabyte that way (measured in
/// docs/design/0017-slow-watchers.md); the same bytes in more, smaller messages cost the
/// watchers that read nothing that matters.
pub const MERGE_MAX_BYTES: usize = 64 << 10;

/// `first` (a delta, already popped) and the deltas queued right behind it that continue its
/// version chain, while the run stays within [`MERGE_MAX_BYTES`] and [`MERGE_MAX_CHANGES`].
/// Stops at anything else (snapshot, reset, progress mark), so no merge crosses one, and never
/// waits: only what is queued now is taken.
fn take_run(s: &mut State, first: Event, first_bytes: usize) -> Vec<Event> {
    let Event::Delta(d) = &first else {
        return vec![first];
    };
    let (epoch, mut version) = (d.epoch, d.version);
    let mut bytes = first_bytes;
    let mut changes = d.changes.len();
    let mut run = vec![first];
    while let Some((Event::Delta(next), next_bytes)) = s.events.front() {
        let continues = next.epoch == epoch && next.prev_version == version;
        if !continues
            || bytes + next_bytes > MERGE_MAX_BYTES
            || changes + next.changes.len() > MERGE_MAX_CHANGES
        {
            break;
        }
        version = next.version;
        bytes += next_bytes;
        changes += next.changes.len();
        let next_bytes = *next_bytes;
        if let Some((ev, _)) = s.events.pop_front() {
            s.bytes -= next_bytes;
            run.push(ev);
        }
    }
    run
}

/// A watcher's queue as its Watch stream reads it ([`Receiver::merging`]): like the
/// [`Receiver`], except that a delta comes merged with the deltas queued right behind it
/// (`prev_version` of the first, `version` of the last, the changes in order). A lone delta
/// goes out at once; under load the queue is deeper and the messages fewer, with no timer and
/// no added latency. Snapshots, resets, progress marks and the overflow come as they are, in
/// their order.
pub struct Merging(Receiver);

impl Merging {
    /// The next item without waiting (`None`: nothing queued now, or the end).
    pub fn try_recv(&mut self) -> Option<Result<Event, Overflow>> {
        self.0.next_item(None, true).flatten()
    }
}

impl Stream for Merging {
    type Item = Result<Event, Overflow>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.0.next_item(Some(cx.waker()), true) {
            Some(item) => Poll::Ready(item),
            None => Poll::Pending,
        }
    }
}

impl Stream for Receiver {
    type Item = Result<Event, Overflow>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.next_item(Some(cx.waker()), false) {
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
        s.events.shrink_to_fit();
        s.bytes = 0;
        s.leave_budget();
    }
}

impl std::fmt::Debug for Merging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Merging").field(&self.0).finish()
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
