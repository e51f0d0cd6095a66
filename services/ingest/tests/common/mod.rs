//! Test helpers: an in-test fake `Snapshot` server (only `Apply`, recording batches), an
//! ingest started on 127.0.0.1:0, raw worker streams, and a /metrics scraper.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use br_proto::v1;
use br_proto::v1::telemetry_change::Kind as TcKind;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

pub const WAIT: Duration = Duration::from_secs(20);

/// A fake snapshot service: records every ChangeBatch, acks with its epoch. It can be made to
/// stall (stop reading) and to kill its Apply streams.
#[derive(Clone)]
pub struct FakeSnapshot {
    pub batches: Arc<Mutex<Vec<v1::ChangeBatch>>>,
    pub epoch: Arc<AtomicU64>,
    pub changed: Arc<Notify>,
    pub stall: Arc<watch::Sender<bool>>,
    pub kill: Arc<watch::Sender<u64>>,
    pub streams: Arc<AtomicU64>,
}

impl Default for FakeSnapshot {
    fn default() -> Self {
        FakeSnapshot {
            batches: Arc::default(),
            epoch: Arc::new(AtomicU64::new(1111)),
            changed: Arc::default(),
            stall: Arc::new(watch::channel(false).0),
            kill: Arc::new(watch::channel(0).0),
            streams: Arc::default(),
        }
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl v1::snapshot_server::Snapshot for FakeSnapshot {
    type WatchStream = BoxStream<v1::WatchEvent>;
    type ApplyStream = BoxStream<v1::ApplyAck>;

    async fn watch(
        &self,
        _: tonic::Request<v1::WatchRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn get(
        &self,
        _: tonic::Request<v1::GetRequest>,
    ) -> Result<tonic::Response<v1::ClusterSnapshot>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn reserve(
        &self,
        _: tonic::Request<v1::ReserveRequest>,
    ) -> Result<tonic::Response<v1::ReserveResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn release(
        &self,
        _: tonic::Request<v1::ReleaseRequest>,
    ) -> Result<tonic::Response<v1::ReleaseResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }

    async fn apply(
        &self,
        req: tonic::Request<tonic::Streaming<v1::ChangeBatch>>,
    ) -> Result<tonic::Response<Self::ApplyStream>, tonic::Status> {
        let mut inbound = req.into_inner();
        let me = self.clone();
        me.streams.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = mpsc::channel(256);
        let mut kill = me.kill.subscribe();
        let mut stall = me.stall.subscribe();
        tokio::spawn(async move {
            let mut version = 0;
            loop {
                // While stalled, do not read (like a service stuck in a long apply).
                while *stall.borrow_and_update() {
                    tokio::select! {
                        _ = stall.changed() => {}
                        _ = kill.changed() => {
                            let _ = tx.send(Err(tonic::Status::unavailable("killed"))).await;
                            return;
                        }
                    }
                }
                let m = tokio::select! {
                    m = inbound.message() => m,
                    _ = kill.changed() => {
                        let _ = tx.send(Err(tonic::Status::unavailable("killed"))).await;
                        return;
                    }
                    _ = stall.changed() => continue,
                };
                let Ok(Some(b)) = m else { return };
                version += 1;
                let ack = v1::ApplyAck {
                    batch_seq: b.batch_seq,
                    epoch: me.epoch.load(Ordering::SeqCst),
                    version,
                    rejected: vec![],
                };
                me.batches.lock().unwrap().push(b);
                me.changed.notify_waiters();
                if tx.send(Ok(ack)).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

impl FakeSnapshot {
    pub fn batches(&self) -> Vec<v1::ChangeBatch> {
        self.batches.lock().unwrap().clone()
    }

    /// Every change received, with its group, in order.
    pub fn changes(&self) -> Vec<(String, TcKind)> {
        self.batches()
            .into_iter()
            .flat_map(|b| {
                let g = b.group.clone();
                b.changes
                    .into_iter()
                    .filter_map(move |c| c.kind.map(|k| (g.clone(), k)))
            })
            .collect()
    }

    pub fn progress_of(&self, id: &str) -> Vec<v1::telemetry_change::RequestProgress> {
        self.changes()
            .into_iter()
            .filter_map(|(_, k)| match k {
                TcKind::RequestProgress(p) if p.request_id == id => Some(p),
                _ => None,
            })
            .collect()
    }

    pub fn hellos_of(&self, worker: u32) -> usize {
        self.changes()
            .iter()
            .filter(|(_, k)| matches!(k, TcKind::WorkerHello(h) if h.worker_id == worker))
            .count()
    }

    pub async fn wait_for(&self, what: &str, pred: impl Fn(&FakeSnapshot) -> bool) {
        let deadline = Instant::now() + WAIT;
        loop {
            let n = self.changed.notified();
            if pred(self) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; got {:#?}",
                self.changes()
            );
            let _ = tokio::time::timeout(Duration::from_millis(20), n).await;
        }
    }

    /// Serves on `listener` until `stop` is cancelled (open streams are killed first).
    pub fn serve_on(&self, listener: tokio::net::TcpListener, stop: CancellationToken) {
        let me = self.clone();
        tokio::spawn(async move {
            let kill = me.kill.clone();
            let stop2 = stop.clone();
            tokio::spawn(async move {
                stop2.cancelled().await;
                kill.send_modify(|k| *k += 1);
            });
            tonic::transport::Server::builder()
                .add_service(v1::snapshot_server::SnapshotServer::new(me))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    stop.cancelled_owned(),
                )
                .await
                .unwrap();
        });
    }

    /// Starts on an ephemeral port.
    pub async fn start(&self) -> (SocketAddr, CancellationToken) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let stop = CancellationToken::new();
        self.serve_on(l, stop.clone());
        (addr, stop)
    }
}

/// A free port on 127.0.0.1 (bound and released; fine for tests).
pub async fn free_addr() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap()
}

pub struct TestIngest {
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    pub shutdown: CancellationToken,
    pub running: Option<br_ingest::Running>,
}

impl TestIngest {
    /// Starts ingest on ephemeral ports towards `snapshot`, with extra flags.
    pub async fn start(snapshot: SocketAddr, extra: &[&str]) -> TestIngest {
        let snap = format!("http://{snapshot}");
        let mut argv = vec![
            "br-ingest",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--snapshot-addr",
            &snap,
            "--shutdown-grace",
            "2s",
        ];
        argv.extend_from_slice(extra);
        let args: br_ingest::Args = br_runtime::config::parse_from(argv).unwrap();
        let shutdown = CancellationToken::new();
        let running = br_ingest::start(&args, shutdown.clone()).await.unwrap();
        TestIngest {
            grpc: running.grpc_addr(),
            admin: running.admin_addr(),
            shutdown,
            running: Some(running),
        }
    }

    /// Waits until the Apply stream to the snapshot service is up.
    pub async fn connected(&self) {
        let deadline = Instant::now() + WAIT;
        while self.metric("balanceroute_ingest_snapshot_connected").await != 1.0 {
            assert!(
                Instant::now() < deadline,
                "ingest never connected to the snapshot"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(r) = self.running.take() {
            tokio::time::timeout(WAIT, r.wait()).await.unwrap().unwrap();
        }
    }

    pub async fn metrics(&self) -> String {
        http_get(self.admin, "/metrics").await.1
    }

    /// The value of one series (`name{labels}` as printed), 0 if absent.
    pub async fn metric(&self, series: &str) -> f64 {
        let text = self.metrics().await;
        text.lines()
            .find_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                (k == series).then(|| v.parse().ok()).flatten()
            })
            .unwrap_or(0.0)
    }

    pub async fn worker(&self) -> Worker {
        Worker::connect(self.grpc).await
    }
}

pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.unwrap();
    let (head, body) = buf.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_string())
}

/// A raw worker stream.
pub struct Worker {
    pub tx: mpsc::Sender<v1::WorkerReport>,
    pub acks: tonic::Streaming<v1::ReportAck>,
}

impl Worker {
    pub async fn connect(addr: SocketAddr) -> Worker {
        let mut client = v1::telemetry_client::TelemetryClient::connect(format!("http://{addr}"))
            .await
            .unwrap()
            .max_encoding_message_size(64 << 20);
        let (tx, rx) = mpsc::channel(1024);
        let acks = client
            .report(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Worker { tx, acks }
    }

    pub async fn send(&self, m: v1::WorkerReport) {
        self.tx.send(m).await.unwrap();
    }

    /// The next ack, or the status that ended the stream.
    pub async fn next(&mut self) -> Result<v1::ReportAck, tonic::Status> {
        match tokio::time::timeout(WAIT, self.acks.message()).await {
            Ok(Ok(Some(a))) => Ok(a),
            Ok(Ok(None)) => Err(tonic::Status::ok("stream ended")),
            Ok(Err(s)) => Err(s),
            Err(_) => panic!("no ack within {WAIT:?}"),
        }
    }

    pub async fn ack(&mut self) -> v1::ReportAck {
        self.next().await.expect("an ack")
    }

    /// Sends `m` and returns its ack.
    pub async fn call(&mut self, m: v1::WorkerReport) -> v1::ReportAck {
        self.send(m).await;
        self.ack().await
    }

    /// Says Hello and returns its ack.
    pub async fn hello(&mut self, group: &str, worker_id: u32, incarnation: u64) -> v1::ReportAck {
        self.call(hello(group, worker_id, incarnation)).await
    }
}

pub fn hello(group: &str, worker_id: u32, incarnation: u64) -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Hello(v1::Hello {
            group: group.into(),
            worker_id,
            incarnation,
            capacity: 64,
            endpoint: format!("http://10.0.0.{worker_id}:8000"),
        })),
    }
}

pub fn progress(seq: u64, full: bool, ups: &[(&str, u32, u32, bool)]) -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Progress(v1::Progress {
            seq,
            full_state: full,
            updates: ups
                .iter()
                .map(|(id, p, g, f)| v1::RequestProgress {
                    request_id: (*id).into(),
                    prompt_tokens: *p,
                    generated_tokens: *g,
                    finished: *f,
                })
                .collect(),
        })),
    }
}

pub fn heartbeat(seq: u64) -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Heartbeat(v1::Heartbeat { seq })),
    }
}

pub fn status(a: &v1::ReportAck) -> v1::AckStatus {
    v1::AckStatus::try_from(a.status).unwrap()
}

/// Waits until `f` holds (bounded).
pub async fn eventually<F, Fut>(what: &str, f: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + WAIT;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
