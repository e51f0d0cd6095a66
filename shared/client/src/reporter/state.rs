//! The reporter's pending state, shared by the handles and the task: the latest cumulative
//! progress of each request, which of it is not yet sent, and what an ack lets it forget.
//!
//! Separate from the handle (which writes it under a short lock) and the task (which drains
//! it): the bounded map and its bookkeeping read on their own.

use super::*;

/// State shared by the handle(s) and the task. The lock is held only for map updates, never
/// across an `.await`.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) state: Mutex<Pending>,
    pub(super) max_pending: usize,
    pub(super) closed: AtomicBool,
    pub(super) close_notify: Notify,
    /// Set by the task when a flush found nothing to send: the stream has been quiet for a
    /// flush interval, so the next change may go at once instead of waiting for the next
    /// flush (the leading edge). The handle that records that change takes the flag and
    /// wakes the task through `change_notify`.
    pub(super) quiet: AtomicBool,
    pub(super) change_notify: Notify,
    /// Whether the worker can take work (see [`ReporterHandle::set_serving`]); while false no
    /// stream is held.
    pub(super) serving: watch::Sender<bool>,
    pub(super) connected: AtomicBool,
    pub(super) full_state_requested: AtomicBool,
    pub(super) tls: Option<Arc<br_trust::TlsMaterial>>,
    pub(super) reports_sent: AtomicU64,
    pub(super) updates_sent: AtomicU64,
    pub(super) full_states_sent: AtomicU64,
    pub(super) connects: AtomicU64,
    pub(super) refused_full: AtomicU64,
    pub(super) refusals: AtomicU64,
    /// The incarnation the next Hello announces.
    pub(super) incarnation: AtomicU64,
    pub(super) ingest_index: AtomicUsize,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, Pending> {
        // A panic while holding the lock cannot leave the map inconsistent in a way that
        // matters (every field is cumulative), so keep going.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        self.close_notify.notify_one();
    }

    /// After a change is recorded (the lock released): if the stream was quiet, wake the task
    /// to send it now. One relaxed load on the common, busy path.
    pub(super) fn changed(&self) {
        if self.quiet.load(Ordering::Relaxed) && self.quiet.swap(false, Ordering::AcqRel) {
            self.change_notify.notify_one();
        }
    }

    pub(super) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// Applies one ack from ingest.
    pub(super) fn on_ack(&self, ack: &v1::ReportAck) {
        if ack.full_state_requested {
            self.full_state_requested.store(true, Ordering::Relaxed);
        }
        match v1::AckStatus::try_from(ack.status) {
            Ok(v1::AckStatus::Ok | v1::AckStatus::Buffered) => {
                self.lock().forget_finished_up_to(ack.seq);
            }
            Ok(v1::AckStatus::Rejected) => {
                // The message was dropped; resend everything rather than guess what it held.
                tracing::warn!(seq = ack.seq, detail = %ack.detail, "ingest rejected a report");
                self.full_state_requested.store(true, Ordering::Relaxed);
            }
            // STALE_SEQ: ignored by ingest; nothing to forget. Unknown: ignore.
            _ => {}
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Pending {
    pub(super) requests: HashMap<RequestId, Entry>,
    /// Requests changed since they were last sent, each once (see `Entry::dirty`).
    pub(super) dirty: Vec<RequestId>,
    /// (seq, id) for each message that reported a request finished, in seq order.
    pub(super) finished_sent: VecDeque<(u64, RequestId)>,
}

#[derive(Debug)]
pub(super) struct Entry {
    pub(super) id: RequestId,
    pub(super) prompt: u32,
    pub(super) generated: u32,
    pub(super) finished: bool,
    /// Reported without the gateway's id (sticky).
    pub(super) unkeyed: bool,
    /// Listed in `Pending::dirty`.
    pub(super) dirty: bool,
    /// The seq of the last message that carried `finished = true` (0: none yet).
    pub(super) finished_seq: u64,
}

impl Entry {
    /// max() of the counts, sticky finished and unkeyed. Returns whether anything changed.
    pub(super) fn merge(
        &mut self,
        prompt: u32,
        generated: u32,
        finished: bool,
        unkeyed: bool,
    ) -> bool {
        let before = (self.prompt, self.generated, self.finished, self.unkeyed);
        self.prompt = self.prompt.max(prompt);
        self.generated = self.generated.max(generated);
        self.finished |= finished;
        self.unkeyed |= unkeyed;
        before != (self.prompt, self.generated, self.finished, self.unkeyed)
    }

    pub(super) fn to_wire(&self) -> v1::RequestProgress {
        v1::RequestProgress {
            request_id: self.id.as_str().to_owned(),
            prompt_tokens: self.prompt,
            generated_tokens: self.generated,
            finished: self.finished,
            unkeyed: self.unkeyed,
        }
    }
}

impl Pending {
    /// The changed requests as updates of the message `seq` (at most `max`; the rest stay
    /// dirty for the next message).
    pub(super) fn take_dirty(&mut self, seq: u64, max: usize) -> Vec<v1::RequestProgress> {
        let n = self.dirty.len().min(max);
        let mut out = Vec::with_capacity(n);
        let ids: Vec<RequestId> = self.dirty.drain(..n).collect();
        for id in ids {
            if let Some(e) = self.requests.get_mut(&id) {
                e.dirty = false;
                out.push(e.to_wire());
                if e.finished {
                    e.finished_seq = seq;
                    self.finished_sent.push_back((seq, id));
                }
            }
        }
        out
    }

    /// Every tracked request, as the updates of the full-state message `seq`.
    pub(super) fn take_full(&mut self, seq: u64) -> Vec<v1::RequestProgress> {
        self.dirty.clear();
        let mut out = Vec::with_capacity(self.requests.len());
        for e in self.requests.values_mut() {
            e.dirty = false;
            out.push(e.to_wire());
            if e.finished {
                e.finished_seq = seq;
                self.finished_sent.push_back((seq, e.id.clone()));
            }
        }
        out
    }

    /// Forgets requests whose `finished = true` was carried by a message `<= seq`.
    pub(super) fn forget_finished_up_to(&mut self, seq: u64) {
        while let Some((s, _)) = self.finished_sent.front() {
            if *s > seq {
                break;
            }
            let Some((_, id)) = self.finished_sent.pop_front() else {
                break;
            };
            // Only if no later message carried it again (then a later ack forgets it).
            if self
                .requests
                .get(&id)
                .is_some_and(|e| e.finished && e.finished_seq <= seq && !e.dirty)
            {
                self.requests.remove(&id);
            }
        }
    }
}
