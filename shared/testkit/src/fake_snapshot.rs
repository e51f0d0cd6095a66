//! A fake `balanceroute.v1.Snapshot` server. It records what it receives and a test decides
//! how it behaves:
//! - `Apply`: every batch is recorded and acked with the fake's epoch (changeable at any time,
//!   as after a restart behind a proxy); [`FakeSnapshot::stall`] stops reading the streams
//!   (a snapshot service stuck in a long apply); [`FakeSnapshot::kill_streams`] ends them with
//!   UNAVAILABLE; [`FakeSnapshot::reject_changes`] makes it refuse chosen changes in its acks
//!   (as the real service refuses a stale incarnation or a fenced worker).
//! - `Watch`: each call plays the next script queued with [`FakeSnapshot::script_watch`]; a
//!   script that does not end in an error keeps its stream open until the client leaves.
//!   Requests are recorded.
//! - `Get`, `Reserve`, `Release`: UNIMPLEMENTED unless a handler is set.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use br_proto::v1;
use br_proto::v1::telemetry_change::Kind as TcKind;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;

use crate::net::Served;
use crate::wait::Signal;

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, tonic::Status>> + Send>>;
type Handler<Req, Resp> =
    Arc<Mutex<Option<Box<dyn FnMut(Req) -> Result<Resp, tonic::Status> + Send>>>>;

/// What one Watch call streams: events, and optionally an error that ends the stream.
pub type WatchScript = Vec<Result<v1::WatchEvent, tonic::Status>>;

/// Decides whether one received change is refused, and why (see
/// [`FakeSnapshot::reject_changes`]).
type Rejecter =
    Arc<Mutex<Option<Box<dyn FnMut(&TcKind) -> Option<(v1::RejectReason, String)> + Send>>>>;

/// The epoch a fresh fake acks with.
pub const DEFAULT_EPOCH: u64 = 1111;

/// See the module documentation. Clones share everything.
#[derive(Clone)]
pub struct FakeSnapshot {
    batches: Arc<Mutex<Vec<v1::ChangeBatch>>>,
    epoch: Arc<AtomicU64>,
    stall: Arc<watch::Sender<bool>>,
    kill: Arc<watch::Sender<u64>>,
    apply_streams: Arc<AtomicU64>,
    watch_scripts: Arc<Mutex<VecDeque<WatchScript>>>,
    watch_requests: Arc<Mutex<Vec<v1::WatchRequest>>>,
    get: Handler<v1::GetRequest, v1::ClusterSnapshot>,
    reserve: Handler<v1::ReserveRequest, v1::ReserveResponse>,
    release: Handler<v1::ReleaseRequest, v1::ReleaseResponse>,
    reject: Rejecter,
    changed: Signal,
}

impl Default for FakeSnapshot {
    fn default() -> Self {
        FakeSnapshot {
            batches: Arc::default(),
            epoch: Arc::new(AtomicU64::new(DEFAULT_EPOCH)),
            stall: Arc::new(watch::channel(false).0),
            kill: Arc::new(watch::channel(0).0),
            apply_streams: Arc::default(),
            watch_scripts: Arc::default(),
            watch_requests: Arc::default(),
            get: Arc::default(),
            reserve: Arc::default(),
            release: Arc::default(),
            reject: Arc::default(),
            changed: Signal::default(),
        }
    }
}

impl std::fmt::Debug for FakeSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeSnapshot")
            .field("batches", &self.batches.lock().unwrap().len())
            .field("epoch", &self.epoch())
            .finish_non_exhaustive()
    }
}

impl FakeSnapshot {
    pub fn new() -> FakeSnapshot {
        FakeSnapshot::default()
    }

    /// Starts serving on an ephemeral loopback port.
    pub async fn start(&self) -> Served {
        let (l, _) = crate::net::listener().await;
        self.serve_on(l)
    }

    /// Serves on `listener` until the returned handle is stopped or dropped; open streams are
    /// ended with UNAVAILABLE first, so clients see the server go away.
    pub fn serve_on(&self, listener: TcpListener) -> Served {
        let routes =
            tonic::service::Routes::new(v1::snapshot_server::SnapshotServer::new(self.clone()));
        crate::net::serve_fake(
            listener,
            routes,
            self.kill.clone(),
            "the fake snapshot server",
        )
    }

    // ----- behaviour

    /// The epoch acks carry from now on.
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::SeqCst);
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// While true, Apply streams are not read.
    pub fn stall(&self, stalled: bool) {
        self.stall.send_replace(stalled);
    }

    /// Ends every open Apply stream with UNAVAILABLE (the server stays up).
    pub fn kill_streams(&self) {
        self.kill.send_modify(|k| *k += 1);
    }

    /// Queues the script the next Watch call plays.
    pub fn script_watch(&self, script: WatchScript) {
        self.watch_scripts.lock().unwrap().push_back(script);
    }

    pub fn on_get(
        &self,
        f: impl FnMut(v1::GetRequest) -> Result<v1::ClusterSnapshot, tonic::Status> + Send + 'static,
    ) {
        *self.get.lock().unwrap() = Some(Box::new(f));
    }

    pub fn on_reserve(
        &self,
        f: impl FnMut(v1::ReserveRequest) -> Result<v1::ReserveResponse, tonic::Status> + Send + 'static,
    ) {
        *self.reserve.lock().unwrap() = Some(Box::new(f));
    }

    pub fn on_release(
        &self,
        f: impl FnMut(v1::ReleaseRequest) -> Result<v1::ReleaseResponse, tonic::Status> + Send + 'static,
    ) {
        *self.release.lock().unwrap() = Some(Box::new(f));
    }

    /// From now on, every change `f` returns `Some((reason, detail))` for is listed as
    /// rejected in its batch's ack (the change is still recorded).
    pub fn reject_changes(
        &self,
        f: impl FnMut(&TcKind) -> Option<(v1::RejectReason, String)> + Send + 'static,
    ) {
        *self.reject.lock().unwrap() = Some(Box::new(f));
    }

    // ----- what it saw

    /// Every ChangeBatch received, in order.
    pub fn batches(&self) -> Vec<v1::ChangeBatch> {
        self.batches.lock().unwrap().clone()
    }

    /// How many Apply streams were opened.
    pub fn apply_streams(&self) -> u64 {
        self.apply_streams.load(Ordering::SeqCst)
    }

    /// Every Watch request received, in order.
    pub fn watch_requests(&self) -> Vec<v1::WatchRequest> {
        self.watch_requests.lock().unwrap().clone()
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

    /// The progress changes received for request `id`.
    pub fn progress_of(&self, id: &str) -> Vec<v1::telemetry_change::RequestProgress> {
        self.changes()
            .into_iter()
            .filter_map(|(_, k)| match k {
                TcKind::RequestProgress(p) if p.request_id == id => Some(p),
                _ => None,
            })
            .collect()
    }

    /// How many WorkerHello changes worker `worker` got.
    pub fn hellos_of(&self, worker: u32) -> usize {
        self.changes()
            .iter()
            .filter(|(_, k)| matches!(k, TcKind::WorkerHello(h) if h.worker_id == worker))
            .count()
    }

    /// Waits (woken by every batch and every new stream, bounded by [`crate::PATIENCE`])
    /// until `pred` holds; panics naming `what` and listing the changes received.
    pub async fn wait_for(&self, what: &str, pred: impl Fn(&FakeSnapshot) -> bool) {
        self.wait_for_within(crate::PATIENCE, what, pred).await;
    }

    pub async fn wait_for_within(
        &self,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&FakeSnapshot) -> bool,
    ) {
        self.changed
            .wait_until(
                timeout,
                what,
                || pred(self),
                || {
                    format!(
                        "{} Apply streams, {} Watch calls, changes {:#?}",
                        self.apply_streams(),
                        self.watch_requests.lock().unwrap().len(),
                        self.changes()
                    )
                },
            )
            .await;
    }
}

fn unimplemented<T>() -> Result<T, tonic::Status> {
    Err(tonic::Status::unimplemented("not set on this FakeSnapshot"))
}

fn call<Req, Resp>(
    h: &Handler<Req, Resp>,
    req: Req,
) -> Result<tonic::Response<Resp>, tonic::Status> {
    match h.lock().unwrap().as_mut() {
        Some(f) => f(req).map(tonic::Response::new),
        None => unimplemented(),
    }
}

#[tonic::async_trait]
impl v1::snapshot_server::Snapshot for FakeSnapshot {
    type WatchStream = BoxStream<v1::WatchEvent>;
    type ApplyStream = BoxStream<v1::ApplyAck>;

    async fn watch(
        &self,
        req: tonic::Request<v1::WatchRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, tonic::Status> {
        self.watch_requests.lock().unwrap().push(req.into_inner());
        let script = self
            .watch_scripts
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or_default();
        self.changed.bump();
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            let ends = script.last().is_some_and(Result::is_err);
            for ev in script {
                if tx.send(ev).await.is_err() {
                    return;
                }
            }
            if !ends {
                tx.closed().await; // keep the stream open until the client leaves
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get(
        &self,
        req: tonic::Request<v1::GetRequest>,
    ) -> Result<tonic::Response<v1::ClusterSnapshot>, tonic::Status> {
        call(&self.get, req.into_inner())
    }

    async fn reserve(
        &self,
        req: tonic::Request<v1::ReserveRequest>,
    ) -> Result<tonic::Response<v1::ReserveResponse>, tonic::Status> {
        call(&self.reserve, req.into_inner())
    }

    async fn release(
        &self,
        req: tonic::Request<v1::ReleaseRequest>,
    ) -> Result<tonic::Response<v1::ReleaseResponse>, tonic::Status> {
        call(&self.release, req.into_inner())
    }

    type ReserveStreamStream = BoxStream<v1::ReserveResult>;

    // Not served, like a snapshot service from before ReserveStream: a client falls back to
    // the scripted unary Reserve (which is what the decision service's tests script).
    async fn reserve_stream(
        &self,
        _req: tonic::Request<tonic::Streaming<v1::ReserveCall>>,
    ) -> Result<tonic::Response<Self::ReserveStreamStream>, tonic::Status> {
        unimplemented()
    }

    // The operator RPCs are not scripted: the fake serves the data path only.
    async fn list_groups(
        &self,
        _req: tonic::Request<v1::ListGroupsRequest>,
    ) -> Result<tonic::Response<v1::ListGroupsResponse>, tonic::Status> {
        unimplemented()
    }

    async fn set_cordon(
        &self,
        _req: tonic::Request<v1::SetCordonRequest>,
    ) -> Result<tonic::Response<v1::SetCordonResponse>, tonic::Status> {
        unimplemented()
    }

    async fn apply(
        &self,
        req: tonic::Request<tonic::Streaming<v1::ChangeBatch>>,
    ) -> Result<tonic::Response<Self::ApplyStream>, tonic::Status> {
        let mut inbound = req.into_inner();
        let me = self.clone();
        me.apply_streams.fetch_add(1, Ordering::SeqCst);
        me.changed.bump();
        let (tx, rx) = mpsc::channel(256);
        let mut kill = me.kill.subscribe();
        let mut stall = me.stall.subscribe();
        tokio::spawn(async move {
            let killed = tonic::Status::unavailable("killed by the test");
            let mut version = 0;
            loop {
                // While stalled, do not read (like a service stuck in a long apply).
                while *stall.borrow_and_update() {
                    tokio::select! {
                        _ = stall.changed() => {}
                        _ = kill.changed() => {
                            let _ = tx.send(Err(killed)).await;
                            return;
                        }
                    }
                }
                let m = tokio::select! {
                    m = inbound.message() => m,
                    _ = kill.changed() => {
                        let _ = tx.send(Err(killed)).await;
                        return;
                    }
                    _ = stall.changed() => continue,
                };
                let Ok(Some(b)) = m else { return };
                version += 1;
                let rejected = match me.reject.lock().unwrap().as_mut() {
                    Some(f) => b
                        .changes
                        .iter()
                        .enumerate()
                        .filter_map(|(i, c)| {
                            let (reason, detail) = f(c.kind.as_ref()?)?;
                            Some(v1::ChangeRejection {
                                index: u32::try_from(i).unwrap_or(u32::MAX),
                                reason: reason as i32,
                                detail,
                            })
                        })
                        .collect(),
                    None => vec![],
                };
                let ack = v1::ApplyAck {
                    batch_seq: b.batch_seq,
                    epoch: me.epoch(),
                    version,
                    rejected,
                };
                me.batches.lock().unwrap().push(b);
                me.changed.bump();
                if tx.send(Ok(ack)).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
