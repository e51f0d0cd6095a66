//! One worker's telemetry stream: Hello, then Progress messages of the configured [`Shape`]
//! as fast as the ack window allows (or at a fixed rate), with probe values for latency.
//!
//! Separate from the run, which starts N of these and reads the counters they feed.

use super::*;

/// What one stream sends.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    pub(super) per_message: u32,
    pub(super) requests: u32,
    pub(super) window: usize,
    pub(super) rate: f64,
}

/// One worker: Hello, then Progress messages as fast as the window allows.
#[allow(clippy::too_many_arguments)]
pub(super) async fn stream(
    url: String,
    tls: Option<Arc<br_trust::TlsMaterial>>,
    group: String,
    worker: u32,
    shape: Shape,
    probes: Option<Probes>,
    counters: Arc<Counters>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let Shape {
        per_message,
        requests,
        window,
        rate,
    } = shape;
    let endpoint = tonic::transport::Endpoint::from_shared(url)?.tcp_nodelay(true);
    let channel =
        br_trust::tls::connect(&endpoint, tls.as_ref(), Some(br_trust::Role::Ingest)).await?;
    let mut client = v1::telemetry_client::TelemetryClient::new(channel);
    let (tx, rx) = mpsc::channel(window.max(1));
    tx.send(v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Hello(v1::Hello {
            group,
            worker_id: worker,
            incarnation: 1000 + u64::from(worker),
            capacity: requests,
            endpoint: String::new(),
        })),
    })
    .await?;
    let mut acks = client.report(ReceiverStream::new(rx)).await?.into_inner();
    let ids: Vec<String> = (0..requests).map(|i| format!("w{worker}-r{i}")).collect();
    let per_message = per_message.min(requests).max(1) as usize;

    let reader = {
        let counters = counters.clone();
        tokio::spawn(async move {
            let mut last = 0;
            while let Ok(Some(a)) = acks.message().await {
                if a.seq > last {
                    let msgs = if last == 0 { 1 } else { a.seq - last };
                    last = a.seq;
                    counters.acked_msgs.fetch_add(msgs, Ordering::Relaxed);
                    counters
                        .acked_events
                        .fetch_add(msgs * per_message as u64, Ordering::Relaxed);
                }
                if a.status != v1::AckStatus::Ok as i32 {
                    counters.not_ok.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };

    let mut seq = 0u64;
    let mut cursor = 0usize;
    let mut generated = vec![0u32; ids.len()];
    let probe_id = format!("w{worker}-probe");
    // Streams start at staggered phases (as independent shims would), not in lockstep.
    let period = if rate > 0.0 {
        Duration::from_secs_f64(1.0 / rate)
    } else {
        Duration::ZERO
    };
    let phase = period.mul_f64(f64::from(worker % 97) / 97.0);
    let mut pace = (rate > 0.0).then(|| {
        let mut i = tokio::time::interval_at(tokio::time::Instant::now() + phase, period);
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        i
    });
    loop {
        if let Some(p) = pace.as_mut() {
            tokio::select! {
                _ = p.tick() => {}
                () = stop.cancelled() => break,
            }
        }
        seq += 1;
        let mut updates = Vec::with_capacity(per_message);
        let mut n = per_message;
        if let Some(probes) = &probes {
            // The probe: its generated_tokens is this message's seq.
            n -= 1;
            updates.push(v1::RequestProgress {
                request_id: probe_id.clone(),
                prompt_tokens: 1,
                generated_tokens: u32::try_from(seq).unwrap_or(u32::MAX),
                finished: false,
                unkeyed: false,
            });
            if let Some(m) = probes.get(worker as usize)
                && let Ok(mut m) = m.lock()
            {
                m.insert(u32::try_from(seq).unwrap_or(u32::MAX), Instant::now());
            }
        }
        for _ in 0..n {
            let i = cursor % ids.len();
            cursor += 1;
            generated[i] = (generated[i] + 1) % 1_000_000;
            updates.push(v1::RequestProgress {
                request_id: ids[i].clone(),
                prompt_tokens: 1000,
                generated_tokens: generated[i],
                finished: false,
                unkeyed: false,
            });
        }
        let msg = v1::WorkerReport {
            kind: Some(v1::worker_report::Kind::Progress(v1::Progress {
                seq,
                updates,
                full_state: false,
                traceparent: String::new(),
                tracestate: String::new(),
            })),
        };
        tokio::select! {
            r = tx.send(msg) => if r.is_err() { break },
            () = stop.cancelled() => break,
        }
    }
    drop(tx);
    let _ = tokio::time::timeout(Duration::from_secs(2), reader).await;
    Ok(())
}
