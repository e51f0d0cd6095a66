//! When the forwarder sends: at once while the link has nothing unacknowledged, otherwise when
//! the acks are in or a batch interval has passed, whichever is first; and nothing (not even a
//! wakeup's worth of work) while idle. On tokio's paused clock, so the instants are exact.

use super::*;

/// An Apply link that records when each batch arrived and acknowledges it at once, or, when
/// `held` is set, only when the test releases an ack (one per batch, in order).
struct Recording {
    arrivals: mpsc::UnboundedSender<(tokio::time::Instant, usize)>,
    held: Option<Arc<tokio::sync::Semaphore>>,
}

impl ApplyLink for Recording {
    fn open(&self, batches: Batches) -> BoxFuture<'static, Result<Acks, OpenError>> {
        let arrivals = self.arrivals.clone();
        let held = self.held.clone();
        Box::pin(async move {
            // Each batch recorded as it is taken off the stream, its ack awaited beside
            // the later ones' arrivals (acks still in order), as over gRPC.
            let acks = futures::StreamExt::buffered(
                batches.map(move |b| {
                    let _ = arrivals.send((tokio::time::Instant::now(), b.changes.len()));
                    let held = held.clone();
                    async move {
                        if let Some(gate) = held {
                            gate.acquire().await.expect("never closed").forget();
                        }
                        Ok(v1::ApplyAck {
                            batch_seq: b.batch_seq,
                            epoch: 1,
                            version: b.batch_seq,
                            rejected: Vec::new(),
                        })
                    }
                }),
                MAX_INFLIGHT as usize,
            );
            Ok(Box::pin(acks) as Acks)
        })
    }

    fn describe(&self) -> String {
        "recording".into()
    }
}

fn disconnect(worker_id: u32) -> Input {
    Input {
        group: GroupId::new("g").unwrap(),
        changes: vec![Change::Disconnected {
            worker_id,
            incarnation: 1,
            at_unix_ms: 0,
        }],
        trace: None,
    }
}

/// Long against the test's steps: tokio's timers (paused or not) count whole milliseconds.
const INTERVAL: Duration = Duration::from_millis(20);

/// How long after `since` the next batch reached the link, and its changes.
async fn next_arrival(
    arrivals: &mut mpsc::UnboundedReceiver<(tokio::time::Instant, usize)>,
    since: tokio::time::Instant,
) -> (Duration, usize) {
    let (at, n) = arrivals.recv().await.expect("the forwarder is running");
    (at - since, n)
}

fn forwarder(
    held: Option<Arc<tokio::sync::Semaphore>>,
    spacing: Duration,
) -> (
    ForwarderHandle,
    JoinHandle<()>,
    mpsc::UnboundedReceiver<(tokio::time::Instant, usize)>,
    CancellationToken,
) {
    let (arrivals_tx, arrivals) = mpsc::unbounded_channel();
    let shutdown = CancellationToken::new();
    let (handle, task) = spawn(
        ForwarderConfig {
            upstream: Arc::new(Recording {
                arrivals: arrivals_tx,
                held,
            }),
            batch_interval: INTERVAL,
            batch_spacing: spacing,
            max_buffered: 1024,
            ingest_id: "test".into(),
        },
        Registry::default(),
        Metrics::unregistered(),
        Readiness::default(),
        shutdown.clone(),
    );
    (handle, task, arrivals, shutdown)
}

#[tokio::test(start_paused = true)]
async fn with_every_batch_acknowledged_each_change_goes_at_once() {
    let (handle, task, mut arrivals, shutdown) = forwarder(None, Duration::ZERO);
    // Let the link come up, then stay quiet for many intervals.
    tokio::time::sleep(Duration::from_millis(50)).await;

    let t0 = tokio::time::Instant::now();
    handle.tx.send(disconnect(1)).await.unwrap();
    assert_eq!(
        next_arrival(&mut arrivals, t0).await,
        (Duration::ZERO, 1),
        "a quiet link's first change"
    );

    // Well within the interval, after its ack: at once too, no tick waited for.
    tokio::time::sleep(Duration::from_millis(1)).await;
    let t1 = tokio::time::Instant::now();
    handle.tx.send(disconnect(2)).await.unwrap();
    assert_eq!(
        next_arrival(&mut arrivals, t1).await,
        (Duration::ZERO, 1),
        "the next one, 1 ms later"
    );

    // Idle for a long time, then one more: at once, and nothing else was sent meanwhile.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t2 = tokio::time::Instant::now();
    handle.tx.send(disconnect(3)).await.unwrap();
    assert_eq!(next_arrival(&mut arrivals, t2).await, (Duration::ZERO, 1));
    assert!(arrivals.try_recv().is_err(), "nothing else was sent");

    shutdown.cancel();
    task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn behind_an_unacknowledged_batch_changes_coalesce_until_its_ack() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (handle, task, mut arrivals, shutdown) = forwarder(Some(gate.clone()), Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(50)).await;

    let t0 = tokio::time::Instant::now();
    handle.tx.send(disconnect(1)).await.unwrap();
    assert_eq!(
        next_arrival(&mut arrivals, t0).await,
        (Duration::ZERO, 1),
        "the link was idle"
    );

    // Its ack held: the next two wait, together, and go the moment the ack is in (well
    // before the tick).
    tokio::time::sleep(Duration::from_millis(2)).await;
    handle.tx.send(disconnect(2)).await.unwrap();
    handle.tx.send(disconnect(3)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(3)).await;
    assert!(
        arrivals.try_recv().is_err(),
        "held behind the unacknowledged batch"
    );
    let acked_at = tokio::time::Instant::now();
    gate.add_permits(1);
    assert_eq!(
        next_arrival(&mut arrivals, acked_at).await,
        (Duration::ZERO, 2),
        "one batch, at the ack"
    );

    // That one's ack held too, past the interval: the tick sends what waits (a slow
    // snapshot service delays changes by at most the interval, however slow its acks).
    tokio::time::sleep(Duration::from_millis(1)).await;
    handle.tx.send(disconnect(4)).await.unwrap();
    assert_eq!(
        next_arrival(&mut arrivals, acked_at).await,
        (INTERVAL, 1),
        "at the tick an interval after the flush"
    );

    gate.add_permits(2);
    shutdown.cancel();
    task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn with_a_spacing_an_idle_link_still_waits_that_long_after_the_last_batch() {
    const SPACING: Duration = Duration::from_millis(5);
    // The first two batches acknowledged at once, the third only when the test says.
    let gate = Arc::new(tokio::sync::Semaphore::new(2));
    let (handle, task, mut arrivals, shutdown) = forwarder(Some(gate.clone()), SPACING);
    tokio::time::sleep(Duration::from_millis(50)).await;

    let t0 = tokio::time::Instant::now();
    handle.tx.send(disconnect(1)).await.unwrap();
    assert_eq!(
        next_arrival(&mut arrivals, t0).await,
        (Duration::ZERO, 1),
        "long after the last batch: at once"
    );

    // Acknowledged at once, but 1 ms after that batch: held until 5 ms after it, then the
    // two that came meanwhile go together.
    tokio::time::sleep(Duration::from_millis(1)).await;
    handle.tx.send(disconnect(2)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    handle.tx.send(disconnect(3)).await.unwrap();
    assert_eq!(
        next_arrival(&mut arrivals, t0).await,
        (SPACING, 2),
        "one batch, the spacing after the last"
    );
    assert!(arrivals.try_recv().is_err(), "nothing else was sent");

    // The same once more, then a third batch whose ack comes 2 ms after it: still held
    // until the spacing has passed since that batch, not sent at the ack.
    tokio::time::sleep(Duration::from_millis(1)).await;
    handle.tx.send(disconnect(4)).await.unwrap();
    assert_eq!(
        next_arrival(&mut arrivals, t0).await,
        (SPACING * 2, 1),
        "the spacing after the second batch"
    );
    tokio::time::sleep(Duration::from_millis(1)).await;
    handle.tx.send(disconnect(5)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    gate.add_permits(1);
    assert_eq!(
        next_arrival(&mut arrivals, t0).await,
        (SPACING * 3, 1),
        "the spacing after the third, its ack long in"
    );

    gate.add_permits(1);
    shutdown.cancel();
    task.await.unwrap();
}
