//! The telemetry side of the load: one Apply stream to the snapshot service playing every
//! group's workers (as ingest would after coalescing), reporting each answered call as a
//! running request until its generated length is reached.
//!
//! Separate from the Assign side in `main.rs`: the two only share the channel of answered
//! calls and the counters.

use super::*;

/// An answered call, for the telemetry side to report as running on its worker.
pub(super) struct Assigned {
    pub(super) id: String,
    pub(super) group: usize,
    pub(super) worker: u32,
    pub(super) incarnation: u64,
}

/// What the telemetry side did (for the report: offered is not sent).
#[derive(Default)]
pub(super) struct TelemetryCounts {
    pub(super) events: std::sync::atomic::AtomicU64,
    pub(super) batches: std::sync::atomic::AtomicU64,
    pub(super) intervals: std::sync::atomic::AtomicU64,
    pub(super) missed_intervals: std::sync::atomic::AtomicU64,
}

/// One running request the telemetry side reports.
struct Active {
    id: String,
    worker: u32,
    incarnation: u64,
    prompt: u32,
    generated: u32,
    finish_at: Instant,
}

/// Plays `workers` workers of each group on one Apply stream (as ingest would after
/// coalescing): one batch per group and millisecond.
#[allow(clippy::too_many_arguments)]
pub(super) async fn telemetry(
    addr: String,
    tls: Option<Arc<br_trust::tls::TlsMaterial>>,
    groups: Arc<Vec<String>>,
    workers: u32,
    capacity: u32,
    events_per_sec: u64,
    hold: Duration,
    interval: Duration,
    mut assigned: mpsc::Receiver<Assigned>,
    counts: Arc<TelemetryCounts>,
) -> anyhow::Result<()> {
    use std::sync::atomic::Ordering::Relaxed;
    let endpoint = tonic::transport::Endpoint::from_shared(addr.clone())
        .context("--snapshot-addr")?
        .tcp_nodelay(true);
    let channel = br_trust::tls::connect(&endpoint, tls.as_ref(), Some(br_trust::Role::Snapshot))
        .await
        .with_context(|| format!("connecting to --snapshot-addr {addr}"))?;
    let mut c = SnapshotClient::new(channel);
    let (tx, rx) = mpsc::channel::<v1::ChangeBatch>(1024);
    let mut acks = c.apply(ReceiverStream::new(rx)).await?.into_inner();
    tokio::spawn(async move { while let Ok(Some(_)) = acks.message().await {} });
    let incarnation = rand::rng().random_range(1..u64::MAX / 2);
    let mut seq = 0u64;
    let mut send = |group: &str, changes: Vec<T>| {
        seq += 1;
        v1::ChangeBatch {
            ingest_id: "assign-load".into(),
            traceparent: String::new(),
            tracestate: String::new(),
            batch_seq: seq,
            group: group.to_owned(),
            changes: changes
                .into_iter()
                .map(|k| v1::TelemetryChange { kind: Some(k) })
                .collect(),
        }
    };
    for group in groups.iter() {
        let hello = (0..workers)
            .map(|w| {
                T::WorkerHello(v1::telemetry_change::WorkerHello {
                    worker_id: w,
                    incarnation: incarnation + u64::from(w),
                    capacity,
                    endpoint: String::new(),
                })
            })
            .collect();
        tx.send(send(group, hello)).await?;
    }
    // Per group: its running requests, oldest first, and the round-robin cursor.
    let mut active: Vec<VecDeque<Active>> = (0..groups.len()).map(|_| VecDeque::new()).collect();
    let mut cursor = vec![0usize; groups.len()];
    // Events per interval (at least one).
    let per_tick = ((events_per_sec as f64 * interval.as_secs_f64()).round() as usize).max(1);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut last = Instant::now();
    loop {
        tick.tick().await;
        let now = Instant::now();
        // Skipped intervals: the loop (or the Apply stream's back-pressure) was late.
        let gap = now.saturating_duration_since(last).as_secs_f64() / interval.as_secs_f64();
        if gap >= 2.0 {
            counts.missed_intervals.fetch_add(gap as u64 - 1, Relaxed);
        }
        last = now;
        counts.intervals.fetch_add(1, Relaxed);
        while let Ok(a) = assigned.try_recv() {
            active[a.group].push_back(Active {
                id: a.id,
                worker: a.worker,
                incarnation: a.incarnation,
                prompt: 0,
                generated: 0,
                finish_at: now + hold,
            });
        }
        let running: usize = active.iter().map(VecDeque::len).sum();
        for (g, group) in groups.iter().enumerate() {
            let mut changes = Vec::new();
            let active = &mut active[g];
            // Finished ones (oldest first).
            while active.front().is_some_and(|a| a.finish_at <= now) {
                if let Some(a) = active.pop_front() {
                    changes.push(T::RequestProgress(v1::telemetry_change::RequestProgress {
                        worker_id: a.worker,
                        incarnation: a.incarnation,
                        request_id: a.id,
                        prompt_tokens: a.prompt,
                        generated_tokens: a.generated.max(1),
                        finished: true,
                        unkeyed: false,
                    }));
                }
            }
            // Progress of running ones, round robin; the events of this interval are
            // shared among the groups by how many requests each runs.
            let n = active.len();
            let share = if running == 0 {
                0
            } else {
                (per_tick * n).div_ceil(running)
            };
            for _ in 0..share.min(n) {
                cursor[g] = (cursor[g] + 1) % n;
                let a = &mut active[cursor[g]];
                a.generated += 1;
                changes.push(T::RequestProgress(v1::telemetry_change::RequestProgress {
                    worker_id: a.worker,
                    incarnation: a.incarnation,
                    request_id: a.id.clone(),
                    prompt_tokens: a.prompt,
                    generated_tokens: a.generated,
                    finished: false,
                    unkeyed: false,
                }));
            }
            if changes.is_empty() {
                continue;
            }
            counts.events.fetch_add(changes.len() as u64, Relaxed);
            counts.batches.fetch_add(1, Relaxed);
            if tx.send(send(group, changes)).await.is_err() {
                anyhow::bail!("the Apply stream closed");
            }
        }
    }
}
