//! br-client's watcher against the real snapshot service (in process, over real gRPC): its
//! replica converges to the writer's σ, and it resyncs across a snapshot-service restart.
//! These live here, not in br-snapshot's tests, so the snapshot service does not depend on its
//! own client library.
#![allow(clippy::unwrap_used)] // tests may panic on purpose

use std::net::SocketAddr;
use std::time::Duration;

use br_client::watch::{Update, WatchConfig, Watcher};
use br_proto::v1;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_sigma::Sigma;
use br_snapshot::Running;
use br_testkit::apply::{ApplyStream, hello, progress as prog};
use br_testkit::{PATIENCE, within};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

struct Server {
    running: Running,
    shutdown: CancellationToken,
    client: SnapshotClient<Channel>,
    url: String,
}

impl Server {
    async fn start(listen: &str) -> Server {
        let (running, shutdown) =
            br_snapshot::test_util::start(listen, &["--shutdown-grace", "5s"]).await;
        let url = br_snapshot::test_util::url(&running);
        let client = SnapshotClient::connect(url.clone()).await.unwrap();
        Server {
            running,
            shutdown,
            client,
            url,
        }
    }

    fn addr(&self) -> SocketAddr {
        self.running.grpc_addr()
    }

    async fn get(&self, group: &str) -> v1::ClusterSnapshot {
        let req = v1::GetRequest {
            group: group.into(),
        };
        self.client.clone().get(req).await.unwrap().into_inner()
    }

    async fn ingest(&self) -> ApplyStream {
        ApplyStream::open(&self.url).await
    }

    async fn stop(self) {
        self.shutdown.cancel();
        let outcome = within(PATIENCE, "the snapshot service drains", self.running.wait())
            .await
            .unwrap();
        assert_eq!(outcome, br_runtime::serve::ServeOutcome::Drained);
    }
}

async fn recv_update(u: &mut mpsc::Receiver<Update>) -> Update {
    within(PATIENCE, "the watcher's next update", u.recv())
        .await
        .expect("watcher ended")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watcher_replica_converges_to_the_writers_sigma() {
    let server = Server::start("127.0.0.1:0").await;
    let (handle, mut updates) = Watcher::connect_lazy(&server.url, WatchConfig::new("g")).unwrap();
    let mut ingest = server.ingest().await;
    ingest
        .send_ok("g", vec![hello(0, 10, 8), hello(1, 11, 8)])
        .await;
    for i in 0..6u32 {
        let w = i % 2;
        let change = prog(w, 10 + u64::from(w), &format!("r{i}"), 100, i);
        ingest.send_ok("g", vec![change]).await;
    }
    let now = server.get("g").await;
    assert_eq!(now.version, 7);
    let mut sigma: Option<Sigma> = None;
    while sigma.as_ref().map(Sigma::version) != Some(7) {
        match recv_update(&mut updates).await {
            Update::Snapshot { sigma: s, .. } => sigma = Some(*s),
            Update::Delta(d) => sigma.as_mut().unwrap().apply_delta(&d).unwrap(),
            Update::Connected { .. } | Update::Disconnected { .. } => {}
        }
    }
    assert_eq!(sigma.unwrap().to_snapshot(), now);
    assert!(handle.status().borrow().connected);
    drop(handle);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watcher_resyncs_across_a_snapshot_service_restart() {
    let first = Server::start("127.0.0.1:0").await;
    let addr = first.addr();
    let mut ingest = first.ingest().await;
    ingest
        .send_ok("g", vec![hello(0, 10, 4), prog(0, 10, "r", 10, 1)])
        .await;
    let mut cfg = WatchConfig::new("g");
    cfg.backoff_initial = Duration::from_millis(10);
    cfg.backoff_max = Duration::from_millis(100);
    let (handle, mut updates) = Watcher::connect_lazy(&first.url, cfg).unwrap();
    let mut sigma = loop {
        if let Update::Snapshot { sigma, reset } = recv_update(&mut updates).await {
            assert!(reset.is_none());
            break *sigma;
        }
    };
    assert_eq!(sigma.to_snapshot(), first.get("g").await);
    let old_epoch = sigma.epoch();
    drop(ingest);
    first.stop().await;
    loop {
        if let Update::Disconnected { .. } = recv_update(&mut updates).await {
            break;
        }
    }
    assert!(!handle.status().borrow().connected);

    // a new process on the same address: a new epoch, rebuilt from telemetry
    let second = Server::start(&addr.to_string()).await;
    let mut ingest = second.ingest().await;
    ingest
        .send_ok("g", vec![hello(0, 10, 4), prog(0, 10, "r", 10, 2)])
        .await;
    loop {
        match recv_update(&mut updates).await {
            Update::Snapshot { sigma: s, reset } => {
                assert_eq!(reset.unwrap().reason, v1::ResetReason::UnknownEpoch);
                sigma = *s;
                break;
            }
            Update::Delta(d) => panic!("a delta of another epoch: {d:?}"),
            Update::Connected { .. } | Update::Disconnected { .. } => {}
        }
    }
    assert_ne!(sigma.epoch(), old_epoch);
    assert_eq!(sigma.epoch(), second.running.extra().epoch);
    // then it follows the new epoch by deltas
    ingest.send_ok("g", vec![prog(0, 10, "r", 10, 3)]).await;
    let want = second.get("g").await;
    while sigma.version() < want.version {
        if let Update::Delta(d) = recv_update(&mut updates).await {
            sigma.apply_delta(&d).unwrap();
        }
    }
    assert_eq!(sigma.to_snapshot(), want);
    assert!(handle.status().borrow().resets >= 1);
    drop(handle);
    second.stop().await;
}

/// Four workers of capacity 1 once put 262,144 requests (68 MB) in σ, above the
/// 64 MiB a watcher decodes, and a restarted decision never became ready. The snapshot
/// service now bounds a group's requests so that its largest snapshot fits; this builds the
/// largest group it allows, every field at its contract limit (1,024 workers with the longest
/// endpoints and carrier, `--max-group-requests` requests with the longest ids and largest
/// counts), and the real watcher with its default limit must receive it whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_largest_group_the_snapshot_service_allows_reaches_a_watcher() {
    use br_proto::v1::telemetry_change as tc;
    use br_proto::valid::limits;
    use br_sigma::{DEFAULT_MAX_GROUP_REQUESTS, MAX_WORKER_ID, max_snapshot_bytes};

    let server = Server::start("127.0.0.1:0").await;
    let group = "g".repeat(limits::MAX_GROUP_BYTES);
    let carrier = "c".repeat(br_sigma::MAX_CARRIER_BYTES);
    let mut ingest = server.ingest().await;
    let batch = |seq: u64, changes: Vec<v1::TelemetryChange>| v1::ChangeBatch {
        ingest_id: carrier.clone(),
        traceparent: String::new(),
        tracestate: String::new(),
        batch_seq: seq,
        group: group.clone(),
        changes,
    };
    let workers = MAX_WORKER_ID + 1;
    let hellos = (0..workers)
        .map(|w| {
            br_testkit::apply::change(tc::Kind::WorkerHello(tc::WorkerHello {
                worker_id: w,
                incarnation: u64::MAX - u64::from(w),
                capacity: limits::MAX_CAPACITY,
                endpoint: format!("{w:0>512}"),
            }))
        })
        .collect();
    let ack = ingest.send_raw(batch(1, hellos)).await;
    assert!(ack.rejected.is_empty(), "{:?}", ack.rejected.first());
    // Requests in Apply batches within the service's 16 MiB message limit; one more than the
    // bound at the end, which must be refused.
    let total = DEFAULT_MAX_GROUP_REQUESTS + 1;
    let per_batch = 40_000;
    let mut refused = Vec::new();
    for (seq, start) in (0..total).step_by(per_batch).enumerate() {
        let changes = (start..(start + per_batch).min(total))
            .map(|i| {
                let w = u32::try_from(i).unwrap() % workers;
                prog(
                    w,
                    u64::MAX - u64::from(w),
                    &format!("{i:0>256}"),
                    limits::MAX_TOKENS / 2,
                    limits::MAX_TOKENS / 2,
                )
            })
            .collect();
        let ack = ingest.send_raw(batch(seq as u64 + 2, changes)).await;
        refused.extend(ack.rejected);
    }
    assert_eq!(
        refused.len(),
        1,
        "only the request beyond the bound: {refused:?}"
    );
    assert_eq!(refused[0].reason, v1::RejectReason::WorkerFull as i32);

    let (handle, mut updates) =
        Watcher::connect_lazy(&server.url, WatchConfig::new(group.clone())).unwrap();
    let sigma = loop {
        match recv_update(&mut updates).await {
            Update::Snapshot { sigma, .. } => break sigma,
            Update::Disconnected { error, .. } => panic!("the watcher could not follow: {error}"),
            Update::Delta(_) | Update::Connected { .. } => {}
        }
    };
    assert_eq!(sigma.request_count(), DEFAULT_MAX_GROUP_REQUESTS);
    assert_eq!(sigma.workers().count(), workers as usize);
    let sent = prost::Message::encoded_len(&v1::WatchEvent {
        kind: Some(v1::watch_event::Kind::Snapshot(sigma.to_snapshot())),
    });
    assert!(sent <= max_snapshot_bytes(DEFAULT_MAX_GROUP_REQUESTS));
    // The group really is near the limit the bound protects, not trivially below it.
    assert!(
        sent > br_sigma::MAX_SNAPSHOT_MESSAGE_BYTES * 4 / 5,
        "{sent} bytes"
    );
    drop((handle, updates));
    server.stop().await;
}

/// A snapshot above the watcher's decoding limit leaves its consumer (decision) unready until
/// an operator acts, so the watcher says so at WARN, not only at DEBUG.
#[tokio::test(flavor = "current_thread")]
async fn a_snapshot_above_the_watchers_limit_is_logged_at_warn() {
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    // current_thread: the watcher's task runs on this thread, under this subscriber.
    let _guard = tracing::subscriber::set_default(subscriber);

    let server = Server::start("127.0.0.1:0").await;
    let mut ingest = server.ingest().await;
    ingest.send_ok("g", vec![hello(0, 10, 100)]).await;
    let changes = (0..50)
        .map(|i| prog(0, 10, &format!("{i:0>200}"), 10, 1))
        .collect();
    ingest.send_ok("g", changes).await;
    let config = WatchConfig {
        max_message_bytes: 4096,
        ..WatchConfig::new("g")
    };
    let (handle, mut updates) = Watcher::connect_lazy(&server.url, config).unwrap();
    let error = loop {
        match recv_update(&mut updates).await {
            Update::Disconnected { error, .. } => break error,
            Update::Snapshot { .. } => panic!("a snapshot above the limit was decoded"),
            Update::Delta(_) | Update::Connected { .. } => {}
        }
    };
    assert!(error.contains("too large"), "{error}");
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(
        text.contains("WARN") && text.contains("larger than this watcher decodes"),
        "{text}"
    );
    drop((handle, updates));
    server.stop().await;
}
