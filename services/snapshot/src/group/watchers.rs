//! Watchers: who follows σ, and what brings each one up to date.
//!
//! Owns the subscribers' bounded queues (never waited on: one full in events makes its watcher
//! lag, and it gets a SLOW_CONSUMER reset and a snapshot once it has room; one over its bytes
//! ends the watcher with RESOURCE_EXHAUSTED, see `queue`), the bounded history of
//! deltas a resuming watcher catches up from (merged into few messages), the reset that
//! answers a position it cannot resume from, the cached snapshot of the current version, and
//! progress marks after `progress_interval` without a delta. It never changes σ; it reads it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use br_proto::v1;
use br_sigma::{Delta, Sigma};
use tokio::time::Instant;

use super::Settings;
use super::event::{Event, MERGE_MAX_CHANGES, delta_of, event_bytes, merge};
use super::queue::{self, Push};
use crate::metrics::GroupMetrics;

/// History the worth rule below never cuts: a watcher back within a moment always resumes
/// from deltas, whatever σ's size.
const HISTORY_FLOOR_BYTES: usize = 1 << 20;
/// How often the size of a snapshot of σ is estimated for the worth rule while the history
/// nears its floor (an estimate walks every request).
const SNAPSHOT_ESTIMATE_EVERY: Duration = Duration::from_secs(1);

/// About the encoded bytes of σ's snapshot: each request's id plus its fixed fields, each
/// worker's endpoint and carrier plus its fixed fields (tags, lengths and varints of typical
/// size; `snapshot_estimate_is_close_to_the_encoded_snapshot` checks it).
pub(super) fn snapshot_estimate(sigma: &Sigma) -> usize {
    const REQUEST_FIXED: usize = 32;
    const WORKER_FIXED: usize = 32;
    let requests: usize = sigma
        .requests()
        .map(|r| r.id.as_str().len() + REQUEST_FIXED)
        .sum();
    let workers: usize = sigma
        .workers()
        .map(|w| w.endpoint.len() + w.carrier.len() + WORKER_FIXED)
        .sum();
    sigma.group().len() + 32 + requests + workers
}

struct WatcherSlot {
    tx: queue::Sender,
    /// Its queue overflowed: deltas are dropped for it until it has room for a reset and a
    /// snapshot.
    lagging: bool,
}

/// The watchers of one group and the deltas kept for them.
pub(super) struct Watchers {
    /// Deltas kept for resumption (at most `history_len` and `history_max_bytes`, see
    /// [`Watchers::keep`]), oldest first.
    pub(super) history: VecDeque<Event>,
    /// When each delta of `history` was kept, in the same order.
    history_at: VecDeque<Instant>,
    history_len: usize,
    history_age: Duration,
    history_max_bytes: usize,
    /// The encoded bytes of `history`.
    history_bytes: usize,
    /// The last [`snapshot_estimate`] and when it was made (see [`Watchers::history_worth`]).
    estimate: Option<(usize, Instant)>,
    /// Events queued per watcher before it lags.
    queue: usize,
    /// Bytes queued per watcher before it is ended.
    queue_bytes: usize,
    /// What every watcher queue of the process may hold together.
    budget: Arc<queue::Budget>,
    progress_interval: Duration,
    /// The snapshot event of the current version, built once for every watcher that needs it.
    snapshot: Option<Event>,
    slots: Vec<WatcherSlot>,
    /// When the last delta or progress mark went out.
    last_sent: Instant,
}

impl Watchers {
    pub(super) fn new(settings: &Settings, now: Instant) -> Watchers {
        Watchers {
            history: VecDeque::new(),
            history_at: VecDeque::new(),
            history_len: settings.history,
            history_age: settings.history_age,
            history_max_bytes: settings.history_bytes,
            history_bytes: 0,
            estimate: None,
            queue: settings.watcher_queue,
            queue_bytes: settings.watcher_queue_bytes,
            budget: Arc::clone(&settings.watcher_budget),
            progress_interval: settings.progress_interval,
            snapshot: None,
            slots: Vec::new(),
            last_sent: now,
        }
    }

    pub(super) fn count(&self) -> usize {
        self.slots.len()
    }

    /// Ends every watcher's stream.
    pub(super) fn drop_all(&mut self, metrics: &GroupMetrics) {
        self.slots.clear();
        metrics.watchers.set(0);
    }

    /// Registers a watcher holding (epoch, last_version) of `sigma` and returns its queue,
    /// already holding what brings it up to date (see `Snapshot.Watch`).
    pub(super) fn subscribe(
        &mut self,
        sigma: &Sigma,
        metrics: &GroupMetrics,
        epoch: u64,
        last_version: u64,
    ) -> queue::Receiver {
        use v1::ResetReason as R;
        let current = sigma.version();
        let mut initial: Vec<Event> = Vec::new();
        let reset = if epoch == 0 {
            None
        } else if epoch != sigma.epoch() {
            Some(R::UnknownEpoch)
        } else if last_version > current {
            Some(R::FutureVersion)
        } else if last_version == current {
            None
        } else {
            // A catch-up larger than the queue's bytes would end the watcher at once: a
            // snapshot (always deliverable) replaces it.
            match self
                .catch_up(last_version)
                .filter(|d| d.iter().map(event_bytes).sum::<usize>() <= self.queue_bytes)
            {
                Some(deltas) => {
                    initial = deltas;
                    None
                }
                None => Some(R::HistoryTruncated),
            }
        };
        if let Some(reason) = reset {
            let detail = format!("watcher held {epoch}@{last_version}");
            metrics.reset(reason);
            tracing::debug!(group = %sigma.group(), ?reason, detail, "watcher reset");
            initial.push(reset_event(reason, sigma.epoch(), detail));
        }
        if epoch == 0 || reset.is_some() {
            initial.push(self.snapshot_event(sigma));
        }
        let (tx, rx) = queue::channel(
            self.queue.max(2) + initial.len(),
            self.queue_bytes,
            &self.budget,
        );
        for ev in initial {
            // Cannot fail: the queue was sized for it and nobody reads yet.
            let bytes = event_bytes(&ev);
            let _ = tx.try_send(ev, bytes);
        }
        self.slots.push(WatcherSlot { tx, lagging: false });
        metrics.watchers.set(self.slots.len() as i64);
        rx
    }

    /// Records a committed delta of `sigma` and sends it to every watcher that keeps up.
    pub(super) fn publish(
        &mut self,
        d: Delta,
        sigma: &Sigma,
        metrics: &GroupMetrics,
        now: Instant,
    ) {
        let ev = Event::Delta(Arc::new(d));
        self.snapshot = None;
        self.keep(&ev, now);
        // Lagging watchers skip this delta; then those with room get a snapshot that already
        // contains it (in the other order they would get the snapshot and then this delta).
        self.broadcast(&ev, metrics);
        self.serve_lagging(sigma, metrics);
        self.last_sent = now;
    }

    /// What time does to watchers: lagging ones that have room again are reset, a progress
    /// mark goes out when nothing was sent for the progress interval, closed ones are dropped.
    pub(super) fn tick(&mut self, sigma: &Sigma, metrics: &GroupMetrics, now: Instant) {
        self.estimate_snapshot(sigma, now);
        self.age_history(now);
        self.serve_lagging(sigma, metrics);
        if now.saturating_duration_since(self.last_sent) >= self.progress_interval {
            let mark = Event::Progress {
                epoch: sigma.epoch(),
                version: sigma.version(),
            };
            self.broadcast(&mark, metrics);
            self.last_sent = now;
        }
        self.slots.retain(|w| !w.tx.is_closed());
        metrics.watchers.set(self.slots.len() as i64);
    }

    /// Keeps `ev` (a delta) in the history, dropping the oldest past `history_len` deltas or
    /// `history_max_bytes`. The bytes bound matters under a heavy writer: 4096 deltas of 256
    /// progress changes with 200-byte request ids are about 240 MB, more than the whole process
    /// should hold; a watcher resuming from before what is kept gets a snapshot instead. The
    /// newest delta is kept even if it alone is over the bytes.
    fn keep(&mut self, ev: &Event, now: Instant) {
        if self.history_len == 0 {
            return;
        }
        self.history_bytes += event_bytes(ev);
        self.history.push_back(ev.clone());
        self.history_at.push_back(now);
        self.trim_history();
    }

    fn trim_history(&mut self) {
        let max_bytes = self.history_max_bytes.min(self.history_worth());
        while self.history.len() > self.history_len
            || (self.history.len() > 1 && self.history_bytes > max_bytes)
        {
            if !self.drop_oldest() {
                break;
            }
        }
    }

    /// The history worth keeping, in bytes: at most twice a snapshot of σ (and never less
    /// than [`HISTORY_FLOOR_BYTES`]). A watcher resuming from further back would be sent more
    /// than a snapshot costs (deltas merge, but progress of the same requests over and over
    /// merges down to about a snapshot's size at best), so a snapshot serves it as well, and
    /// under a heavy writer of a small σ the history is then a second or so of deltas instead
    /// of `--history-bytes` held for `--history-age`. Unbounded until σ's size was first
    /// estimated.
    fn history_worth(&self) -> usize {
        self.estimate.map_or(usize::MAX, |(bytes, _)| {
            HISTORY_FLOOR_BYTES.max(bytes.saturating_mul(2))
        })
    }

    /// Refreshes the snapshot-size estimate while the history nears its floor (at most
    /// every [`SNAPSHOT_ESTIMATE_EVERY`]) and trims the history to what it is worth. (Near,
    /// not over: a history held at the floor by an old estimate of a σ that has grown since
    /// must be looked at again.)
    fn estimate_snapshot(&mut self, sigma: &Sigma, now: Instant) {
        if self.history_bytes < HISTORY_FLOOR_BYTES / 2 {
            return;
        }
        let due = self
            .estimate
            .is_none_or(|(_, at)| now.saturating_duration_since(at) >= SNAPSHOT_ESTIMATE_EVERY);
        if due {
            self.estimate = Some((snapshot_estimate(sigma), now));
            self.trim_history();
        }
    }

    fn drop_oldest(&mut self) -> bool {
        self.history_at.pop_front();
        match self.history.pop_front() {
            Some(old) => {
                self.history_bytes -= event_bytes(&old);
                true
            }
            None => false,
        }
    }

    /// Drops the deltas kept longer than `history_age`; once none is left, the history's own
    /// buffers go too (a burst of 4,096 deltas leaves them at that capacity).
    fn age_history(&mut self, now: Instant) {
        if self.history_age.is_zero() {
            return;
        }
        while self
            .history_at
            .front()
            .is_some_and(|&at| now.saturating_duration_since(at) > self.history_age)
        {
            self.drop_oldest();
        }
        if self.history.is_empty() && self.history.capacity() > 0 {
            self.history = VecDeque::new();
            self.history_at = VecDeque::new();
        }
    }

    /// Every watcher is ended or gone, so the group may be idle.
    pub(super) fn is_empty(&self) -> bool {
        self.slots.iter().all(|w| w.tx.is_closed())
    }

    /// The held deltas after `last_version`, merged into few events; None if not all held.
    fn catch_up(&self, last_version: u64) -> Option<Vec<Event>> {
        let first = delta_of(self.history.front()?)?.prev_version;
        if last_version < first {
            return None;
        }
        let skip = usize::try_from(last_version - first).ok()?;
        let mut out = Vec::new();
        let mut chunk: Vec<&Event> = Vec::new();
        let mut count = 0;
        for ev in self.history.iter().skip(skip) {
            let n = delta_of(ev).map_or(0, |d| d.changes.len());
            if !chunk.is_empty() && count + n > MERGE_MAX_CHANGES {
                out.push(merge(&chunk));
                chunk.clear();
                count = 0;
            }
            chunk.push(ev);
            count += n;
        }
        if !chunk.is_empty() {
            out.push(merge(&chunk));
        }
        Some(out)
    }

    fn snapshot_event(&mut self, sigma: &Sigma) -> Event {
        if let Some(s) = &self.snapshot {
            return s.clone();
        }
        let ev = Event::Snapshot(Arc::new(sigma.to_snapshot()));
        self.snapshot = Some(ev.clone());
        ev
    }

    /// Sends `ev` to every watcher that is not lagging; one whose queue is full starts
    /// lagging (it is never waited for), one over its bytes is ended, a closed one is dropped.
    fn broadcast(&mut self, ev: &Event, metrics: &GroupMetrics) {
        let bytes = event_bytes(ev);
        self.slots.retain_mut(|w| {
            if w.lagging {
                return !w.tx.is_closed();
            }
            match w.tx.try_send(ev.clone(), bytes) {
                Push::Queued => true,
                Push::Full => {
                    w.lagging = true;
                    true
                }
                Push::Ended => {
                    metrics.watcher_over_bytes();
                    false
                }
                Push::Closed => false,
            }
        });
        metrics.watchers.set(self.slots.len() as i64);
    }

    /// A lagging watcher with room for two events gets a SLOW_CONSUMER reset and a fresh
    /// snapshot, and follows deltas again.
    fn serve_lagging(&mut self, sigma: &Sigma, metrics: &GroupMetrics) {
        if !self.slots.iter().any(|w| w.lagging && w.tx.room() >= 2) {
            return;
        }
        let snap = self.snapshot_event(sigma);
        let snap_bytes = event_bytes(&snap);
        let mut resets = 0;
        let mut ended = 0;
        for w in &mut self.slots {
            if w.lagging && w.tx.room() >= 2 {
                resets += 1;
                w.lagging = false;
                let reset = reset_event(
                    v1::ResetReason::SlowConsumer,
                    sigma.epoch(),
                    "the watcher's queue overflowed; deltas were dropped".into(),
                );
                let reset_bytes = event_bytes(&reset);
                if w.tx.try_send(reset, reset_bytes) == Push::Ended
                    || w.tx.try_send(snap.clone(), snap_bytes) == Push::Ended
                {
                    ended += 1;
                }
            }
        }
        for _ in 0..resets {
            metrics.reset(v1::ResetReason::SlowConsumer);
        }
        for _ in 0..ended {
            metrics.watcher_over_bytes();
        }
        if ended > 0 {
            self.slots.retain(|w| !w.tx.is_closed());
            metrics.watchers.set(self.slots.len() as i64);
        }
    }
}

fn reset_event(reason: v1::ResetReason, epoch: u64, detail: String) -> Event {
    Event::Reset {
        reason,
        epoch,
        detail: detail.into(),
    }
}
