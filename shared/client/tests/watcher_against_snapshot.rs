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
use br_snapshot::{Args, Running};
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
        let args: Args = br_runtime::config::parse_from([
            "br-snapshot",
            "--listen",
            listen,
            "--admin-listen",
            "127.0.0.1:0",
            "--shutdown-grace",
            "5s",
        ])
        .unwrap();
        let shutdown = CancellationToken::new();
        let running = br_snapshot::start(&args, shutdown.clone()).await.unwrap();
        let url = format!("http://{}", running.grpc_addr());
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
