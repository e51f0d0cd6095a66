//! The link: the task that keeps the one `Snapshot.Apply` stream up, reads its acks, relays
//! the refusals they carry to the workers' streams and reports up/down/new-epoch to the
//! forwarder.

use br_backoff::Backoff;
use tokio::sync::Notify;

use super::*;
use crate::registry::Refusal;

/// Batches queued towards the Apply stream.
const LINK_QUEUE: usize = 16;
/// First delay before reconnecting the Apply stream (br-backoff's schedule, equal jitter).
const BACKOFF_INITIAL: Duration = Duration::from_millis(50);
/// Longest delay between reconnects.
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// The link task: keeps one Apply stream up (reconnecting with backoff), feeds it the
/// forwarder's batches, tells the forwarder when it is up, down or on a new epoch, and
/// notifies `ack_signal` on every ack.
pub(super) async fn run_link(
    upstream: Arc<dyn ApplyLink>,
    events: mpsc::Sender<LinkEvent>,
    ack_signal: Arc<Notify>,
    registry: Registry,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let mut backoff = Backoff::new(BACKOFF_INITIAL, BACKOFF_MAX);
    loop {
        if shutdown.is_cancelled() {
            return;
        }
        let up = tokio::select! {
            r = one_link(upstream.as_ref(), &events, &ack_signal, &registry, &metrics, &shutdown) => r,
            () = shutdown.cancelled() => return,
        };
        if up {
            backoff.reset();
            if events.send(LinkEvent::Down).await.is_err() {
                return;
            }
        }
        tokio::select! {
            () = tokio::time::sleep(backoff.next_delay()) => {}
            () = shutdown.cancelled() => return,
        }
    }
}

/// Runs one Apply stream until it ends. Returns whether it came up.
async fn one_link(
    upstream: &dyn ApplyLink,
    events: &mpsc::Sender<LinkEvent>,
    ack_signal: &Notify,
    registry: &Registry,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> bool {
    let (tx, rx) = mpsc::channel::<Outgoing>(LINK_QUEUE);
    // What each unacknowledged batch is about, recorded as tonic takes it off the queue (at
    // most MAX_INFLIGHT + LINK_QUEUE entries: the forwarder stops at MAX_INFLIGHT unacked).
    let sent: Arc<std::sync::Mutex<VecDeque<(u64, String, BatchWorkers)>>> = Arc::default();
    let record = sent.clone();
    let outgoing = ReceiverStream::new(rx).map(move |(batch, workers)| {
        lock(&record).push_back((batch.batch_seq, batch.group.clone(), workers));
        batch
    });
    let mut acks = match upstream.open(Batches::new(outgoing)).await {
        Ok(acks) => acks,
        Err(OpenError::Unreachable(e)) => {
            tracing::debug!(error = %e, addr = %upstream.describe(), "snapshot service unreachable");
            return false;
        }
        Err(OpenError::Refused(status)) => {
            tracing::warn!(%status, "Snapshot.Apply refused");
            return false;
        }
    };
    let acked = Arc::new(AtomicU64::new(0));
    if events
        .send(LinkEvent::Up {
            tx,
            acked: acked.clone(),
        })
        .await
        .is_err()
    {
        return true;
    }
    let mut epoch = 0u64;
    loop {
        match acks.next().await.transpose() {
            Ok(Some(ack)) => {
                acked.fetch_max(ack.batch_seq, Ordering::Relaxed);
                // The forwarder sends what it holds once nothing is left unacknowledged.
                ack_signal.notify_one();
                let about = {
                    let mut sent = lock(&sent);
                    while sent.front().is_some_and(|(seq, _, _)| *seq < ack.batch_seq) {
                        sent.pop_front();
                    }
                    sent.front()
                        .is_some_and(|(seq, _, _)| *seq == ack.batch_seq)
                        .then(|| sent.pop_front())
                        .flatten()
                };
                if !ack.rejected.is_empty() {
                    metrics.snapshot_rejected.inc_by(ack.rejected.len() as u64);
                    tracing::debug!(batch = ack.batch_seq, rejected = ?ack.rejected, "snapshot rejected changes");
                    if let Some((_, group, workers)) = about {
                        relay_refusals(registry, metrics, &group, &workers, &ack.rejected);
                    }
                }
                if epoch != 0
                    && ack.epoch != epoch
                    && events.send(LinkEvent::NewEpoch(ack.epoch)).await.is_err()
                {
                    return true;
                }
                epoch = ack.epoch;
            }
            // On a shutdown the forwarder stops first and its end of the stream closes, so
            // the stream ends here too, racing `run_link`'s shutdown branch: that end is
            // the shutdown's, not an outage to warn about (br-all logged a WARN on a clean stop).
            Ok(None) if shutdown.is_cancelled() => {
                tracing::debug!("Apply stream ended while shutting down");
                return true;
            }
            Ok(None) => {
                tracing::warn!("snapshot service ended the Apply stream");
                return true;
            }
            Err(status) if shutdown.is_cancelled() => {
                tracing::debug!(%status, "Apply stream failed while shutting down");
                return true;
            }
            Err(status) => {
                tracing::warn!(%status, "Apply stream failed");
                return true;
            }
        }
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Held for a push or a pop only; a panic elsewhere cannot leave the queue half-updated.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether a rejection of a live worker's change means its stream must end: σ does not hold
/// that worker as this incarnation (another one, fenced, or none), or refused its Hello
/// because another replica carries it. Other reasons (a duplicate request, an invalid value)
/// are about one change, not the worker, and are only counted.
fn refuses_the_worker(reason: v1::RejectReason) -> bool {
    use v1::RejectReason as R;
    matches!(
        reason,
        R::StaleIncarnation | R::WorkerFenced | R::UnknownWorker | R::ConnectedElsewhere
    )
}

/// Ends the stream of every live worker whose change the snapshot service refused, and
/// counts and logs, under the reporting worker's name, its reports of requests σ holds under
/// another worker.
///
/// Those stay per change: the stream's acks went out before σ judged (they acknowledge
/// what ingest accepted and forwards), and an honest worker reports such a request too when
/// a gateway sends it to another rank than the one Assign reserved; ending its stream would
/// take it out of routing over one misrouted request, again at each full state.
fn relay_refusals(
    registry: &Registry,
    metrics: &Metrics,
    group: &str,
    workers: &[Option<(u32, u64)>],
    rejected: &[v1::ChangeRejection],
) {
    let Ok(group) = GroupId::new(group) else {
        return;
    };
    // (one line per ack, naming the first and counting the rest: a worker that names many
    // is not a line each)
    let mut not_owner: Option<(&v1::ChangeRejection, Option<(u32, u64)>)> = None;
    let mut not_owner_count: u64 = 0;
    for r in rejected {
        let reason = v1::RejectReason::try_from(r.reason).unwrap_or(v1::RejectReason::Unspecified);
        let about = usize::try_from(r.index)
            .ok()
            .and_then(|i| workers.get(i).copied().flatten());
        if reason == v1::RejectReason::NotOwner {
            metrics.reject(reason.label());
            not_owner.get_or_insert((r, about));
            not_owner_count += 1;
            continue;
        }
        if !refuses_the_worker(reason) {
            continue;
        }
        let Some((worker_id, incarnation)) = about else {
            continue;
        };
        let refusal = Refusal {
            reason,
            detail: r.detail.clone(),
        };
        if registry.refuse(&(group.clone(), worker_id, incarnation), refusal) {
            tracing::warn!(group = %group, worker = worker_id, incarnation, reason = reason.label(),
                detail = %r.detail, "the snapshot service refused a live worker's change; ending its stream");
        }
    }
    if let Some((first, about)) = not_owner {
        let (worker, incarnation) = about.unzip();
        tracing::warn!(group = %group, worker, incarnation, refused = not_owner_count,
            first = %first.detail,
            "the snapshot service refused reports of requests σ holds under another worker");
    }
}
