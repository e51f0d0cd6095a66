//! Measurements (not assertions): Apply throughput and the time from sending a telemetry batch
//! to a watcher receiving its delta, all over loopback in one process. Run with
//! `cargo test --release -p br-snapshot --test measure -- --ignored --nocapture`.
#![allow(clippy::unwrap_used)] // a measurement harness may panic on purpose

use std::collections::HashMap;
use std::time::Duration;

use br_proto::v1;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::telemetry_change as tc;
use br_proto::v1::watch_event::Kind as Ev;
use hdrhistogram::Histogram;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

const WORKERS: u32 = 64;
const PER_WORKER: u32 = 8;

fn batch(seq: u64, step: u32) -> v1::ChangeBatch {
    let mut changes = Vec::with_capacity((WORKERS * PER_WORKER) as usize);
    for w in 0..WORKERS {
        for r in 0..PER_WORKER {
            changes.push(v1::TelemetryChange {
                kind: Some(tc::Kind::RequestProgress(tc::RequestProgress {
                    worker_id: w,
                    incarnation: 1,
                    request_id: format!("w{w}-r{r}"),
                    prompt_tokens: 100,
                    generated_tokens: step,
                    finished: false,
                    unkeyed: false,
                })),
            });
        }
    }
    v1::ChangeBatch {
        ingest_id: "measure".into(),
        traceparent: String::new(),
        tracestate: String::new(),
        batch_seq: seq,
        group: "g".into(),
        changes,
    }
}

/// The latencies in an hdrhistogram (nanoseconds up to an hour, 3 significant digits).
fn histogram(lat: &[Duration]) -> Histogram<u64> {
    let mut h = Histogram::new_with_bounds(1, 3_600_000_000_000, 3).unwrap();
    for d in lat {
        h.saturating_record(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }
    h
}

/// The `p`-quantile (nearest rank, hdrhistogram's buckets).
fn pct(h: &Histogram<u64>, p: f64) -> Duration {
    Duration::from_nanos(h.value_at_quantile(p))
}

/// Sends `n` batches (paced every `every`, or as fast as the stream takes them), returns
/// (elapsed until the last ack, per-batch latency from send to the watcher's delta).
async fn run(
    url: &str,
    first_seq: u64,
    n: u64,
    every: Option<Duration>,
) -> (Duration, Vec<Duration>) {
    let client = SnapshotClient::connect(url.to_owned()).await.unwrap();
    let mut watch = SnapshotClient::connect(url.to_owned())
        .await
        .unwrap()
        .watch(v1::WatchRequest {
            group: "g".into(),
            epoch: 0,
            last_version: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let Some(Ev::Snapshot(s)) = watch.message().await.unwrap().unwrap().kind else {
        panic!()
    };
    let start_version = s.version;
    let target = start_version + n;
    let watcher = tokio::spawn(async move {
        let mut got: HashMap<u64, Instant> = HashMap::new();
        loop {
            let ev = watch.message().await.unwrap().unwrap();
            if let Some(Ev::Delta(d)) = ev.kind {
                got.insert(d.version, Instant::now());
                if d.version >= target {
                    return got;
                }
            }
        }
    });

    let (tx, rx) = mpsc::channel(64);
    let mut acks = client
        .clone()
        .apply(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    // the workers
    let hello = v1::ChangeBatch {
        ingest_id: "measure".into(),
        traceparent: String::new(),
        tracestate: String::new(),
        batch_seq: first_seq,
        group: "g".into(),
        changes: (0..WORKERS)
            .map(|w| v1::TelemetryChange {
                kind: Some(tc::Kind::WorkerHello(tc::WorkerHello {
                    worker_id: w,
                    incarnation: 1,
                    capacity: 256,
                    endpoint: String::new(),
                })),
            })
            .collect(),
    };
    tx.send(hello).await.unwrap();
    let first_ack = acks.message().await.unwrap().unwrap();
    assert!(first_ack.rejected.is_empty());
    // after the Hello batch, which may or may not have changed σ
    let base = first_ack.version;

    let sender = tokio::spawn(async move {
        let mut sent: Vec<Instant> = Vec::with_capacity(n as usize);
        let mut tick = every.map(tokio::time::interval);
        for i in 0..n {
            if let Some(t) = tick.as_mut() {
                t.tick().await;
            }
            let b = batch(first_seq + 1 + i, u32::try_from(first_seq + i).unwrap() + 1);
            sent.push(Instant::now());
            tx.send(b).await.unwrap();
        }
        sent
    });
    let t0 = Instant::now();
    let mut versions = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let ack = acks.message().await.unwrap().unwrap();
        assert!(ack.rejected.is_empty());
        versions.push(ack.version);
    }
    let elapsed = t0.elapsed();
    let sent = sender.await.unwrap();
    // The watcher stops at start_version + n; the Hello batch may have taken one version.
    let _ = base;
    let got = tokio::time::timeout(Duration::from_secs(30), watcher).await;
    let got = match got {
        Ok(Ok(g)) => g,
        _ => HashMap::new(),
    };
    let lat: Vec<Duration> = versions
        .iter()
        .zip(&sent)
        .filter_map(|(v, s)| got.get(v).map(|r| r.saturating_duration_since(*s)))
        .collect();
    (elapsed, lat)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; run explicitly with --ignored --nocapture"]
async fn apply_throughput_and_telemetry_to_watcher_latency() {
    let args: br_snapshot::Args = br_runtime::config::parse_from([
        "br-snapshot",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ])
    .unwrap();
    let shutdown = CancellationToken::new();
    let running = br_snapshot::start(&args, shutdown.clone()).await.unwrap();
    let url = format!("http://{}", running.grpc_addr());
    let per_batch = u64::from(WORKERS * PER_WORKER);

    let n = 2000;
    let (elapsed, lat) = run(&url, 1, n, None).await;
    let lat = histogram(&lat);
    let events = (n * per_batch) as f64 / elapsed.as_secs_f64();
    println!(
        "saturated: {n} batches x {per_batch} progress changes in {elapsed:?}: {:.0} batches/s, {events:.0} changes/s; send->watcher p50 {:?} p99 {:?} (includes queueing)",
        n as f64 / elapsed.as_secs_f64(),
        pct(&lat, 0.5),
        pct(&lat, 0.99),
    );

    // 100k progress events/s: one 512-change batch every 5 ms
    let n = 1000;
    let (_, lat) = run(&url, 10_000, n, Some(Duration::from_millis(5))).await;
    let lat = histogram(&lat);
    println!(
        "paced 100k changes/s ({per_batch} per 5 ms batch): send->watcher p50 {:?} p99 {:?} max {:?} ({} samples)",
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        Duration::from_nanos(lat.max()),
        lat.len()
    );
    shutdown.cancel();
    running.wait().await.unwrap();

    // The same service on a plain tonic server whose accepted sockets set TCP_NODELAY (br-runtime's
    // serve() accepts from a TcpListenerStream, which leaves Nagle on): to see what Nagle costs.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let metrics = br_snapshot::Metrics::new().unwrap();
    let (writer, _task) =
        br_snapshot::writer::spawn(args.settings(), metrics.clone(), shutdown.clone());
    let svc = br_snapshot::service::SnapshotService::new(
        writer,
        metrics,
        args.max_watchers,
        shutdown.clone(),
    );
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(v1::snapshot_server::SnapshotServer::new(svc))
            .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned()),
    );
    let url = format!("http://{addr}");
    let n = 1000;
    let (_, lat) = run(&url, 1, n, Some(Duration::from_millis(5))).await;
    let lat = histogram(&lat);
    println!(
        "paced, TCP_NODELAY on the server: send->watcher p50 {:?} p99 {:?} max {:?} ({} samples)",
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        Duration::from_nanos(lat.max()),
        lat.len()
    );
    shutdown.cancel();
    let _ = server.await;
}
