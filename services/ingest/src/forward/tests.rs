//! When the forwarder sends: the first changes after a quiet interval at once, later ones at
//! most one batch per interval, and nothing (not even a wakeup's worth of work) while idle.
//! On tokio's paused clock, so the instants are exact.

use super::*;

/// An Apply link that acknowledges every batch at once and records when each one arrived.
struct Recording {
    arrivals: mpsc::UnboundedSender<(tokio::time::Instant, usize)>,
}

impl ApplyLink for Recording {
    fn open(&self, batches: Batches) -> BoxFuture<'static, Result<Acks, OpenError>> {
        let arrivals = self.arrivals.clone();
        Box::pin(async move {
            let acks = batches.map(move |b| {
                let _ = arrivals.send((tokio::time::Instant::now(), b.changes.len()));
                Ok(v1::ApplyAck {
                    batch_seq: b.batch_seq,
                    epoch: 1,
                    version: b.batch_seq,
                    rejected: Vec::new(),
                })
            });
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

const INTERVAL: Duration = Duration::from_millis(2);

#[tokio::test(start_paused = true)]
async fn the_first_change_after_a_quiet_interval_goes_at_once_and_later_ones_wait_for_the_tick() {
    let (arrivals_tx, mut arrivals) = mpsc::unbounded_channel();
    let shutdown = CancellationToken::new();
    let (handle, task) = spawn(
        ForwarderConfig {
            upstream: Arc::new(Recording {
                arrivals: arrivals_tx,
            }),
            batch_interval: INTERVAL,
            max_buffered: 1024,
            ingest_id: "test".into(),
        },
        Registry::default(),
        Metrics::unregistered(),
        Readiness::default(),
        shutdown.clone(),
    );
    // Let the link come up, then stay quiet for many intervals.
    tokio::time::sleep(Duration::from_millis(50)).await;

    let t0 = tokio::time::Instant::now();
    handle.tx.send(disconnect(1)).await.unwrap();
    let (at, n) = arrivals.recv().await.unwrap();
    assert_eq!(
        (at - t0, n),
        (Duration::ZERO, 1),
        "the leading edge goes at once"
    );

    // Within the interval: held for the tick an interval after that flush, not sent early
    // by a tick whose deadline passed while the forwarder was idle.
    tokio::time::sleep(Duration::from_micros(500)).await;
    handle.tx.send(disconnect(2)).await.unwrap();
    handle.tx.send(disconnect(3)).await.unwrap();
    let (at, n) = arrivals.recv().await.unwrap();
    assert_eq!((at - t0, n), (INTERVAL, 2), "one batch, at the next tick");

    // Idle again for a long time, then one more: at once.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t1 = tokio::time::Instant::now();
    handle.tx.send(disconnect(4)).await.unwrap();
    let (at, n) = arrivals.recv().await.unwrap();
    assert_eq!((at - t1, n), (Duration::ZERO, 1));
    assert!(arrivals.try_recv().is_err(), "nothing else was sent");

    shutdown.cancel();
    task.await.unwrap();
}
