//! A fake `balanceroute.v1.Telemetry` server (what br-ingest is to a shim's reporter): it
//! records every WorkerReport and acks it with its seq. A test can make the next ack ask for a
//! full state, and end every open stream with UNAVAILABLE.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use br_proto::v1;
use br_proto::v1::worker_report::Kind;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;

use crate::net::Served;
use crate::wait::Signal;

type AckStream = Pin<Box<dyn Stream<Item = Result<v1::ReportAck, tonic::Status>> + Send>>;

/// See the module documentation. Clones share everything.
#[derive(Clone)]
pub struct FakeIngest {
    log: Arc<Mutex<Vec<v1::WorkerReport>>>,
    ask_full_state: Arc<AtomicBool>,
    kill: Arc<watch::Sender<u64>>,
    /// Streams the worker ended itself (half-closed its side cleanly).
    ended_by_worker: Arc<AtomicU64>,
    changed: Signal,
}

impl Default for FakeIngest {
    fn default() -> Self {
        FakeIngest {
            log: Arc::default(),
            ask_full_state: Arc::default(),
            kill: Arc::new(watch::channel(0).0),
            ended_by_worker: Arc::default(),
            changed: Signal::default(),
        }
    }
}

impl std::fmt::Debug for FakeIngest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeIngest")
            .field("messages", &self.log.lock().unwrap().len())
            .finish_non_exhaustive()
    }
}

impl FakeIngest {
    pub fn new() -> FakeIngest {
        FakeIngest::default()
    }

    /// Starts serving on an ephemeral loopback port.
    pub async fn start(&self) -> Served {
        let (l, _) = crate::net::listener().await;
        self.serve_on(l)
    }

    /// Serves on `listener` until the returned handle is stopped or dropped (open streams end
    /// with UNAVAILABLE first).
    pub fn serve_on(&self, listener: TcpListener) -> Served {
        let routes =
            tonic::service::Routes::new(v1::telemetry_server::TelemetryServer::new(self.clone()));
        crate::net::serve_fake(
            listener,
            routes,
            self.kill.clone(),
            "the fake ingest server",
        )
    }

    /// The next ack asks the worker for its full state.
    pub fn ask_full_state(&self) {
        self.ask_full_state.store(true, Ordering::SeqCst);
    }

    /// Ends every open Report stream with UNAVAILABLE (the server stays up).
    pub fn kill_streams(&self) {
        self.kill.send_modify(|k| *k += 1);
    }

    /// How many Report streams the worker ended itself, cleanly (its side closed without an
    /// error), so far.
    pub fn streams_ended_by_worker(&self) -> u64 {
        self.ended_by_worker.load(Ordering::SeqCst)
    }

    /// Every message received, in order.
    pub fn messages(&self) -> Vec<v1::WorkerReport> {
        self.log.lock().unwrap().clone()
    }

    /// Every Progress message received, in order.
    pub fn progresses(&self) -> Vec<v1::Progress> {
        self.messages()
            .into_iter()
            .filter_map(|m| match m.kind {
                Some(Kind::Progress(p)) => Some(p),
                _ => None,
            })
            .collect()
    }

    /// The incarnations of every Hello received, in order.
    pub fn hellos(&self) -> Vec<u64> {
        self.messages()
            .iter()
            .filter_map(|m| match &m.kind {
                Some(Kind::Hello(h)) => Some(h.incarnation),
                _ => None,
            })
            .collect()
    }

    /// Waits (woken by every message, bounded by [`crate::PATIENCE`]) until `pred` holds for
    /// the log; panics naming `what` and listing the log.
    pub async fn wait_for(&self, what: &str, pred: impl Fn(&[v1::WorkerReport]) -> bool) {
        self.wait_for_within(crate::PATIENCE, what, pred).await;
    }

    pub async fn wait_for_within(
        &self,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&[v1::WorkerReport]) -> bool,
    ) {
        self.changed
            .wait_until(
                timeout,
                what,
                || pred(&self.messages()),
                || format!("{:#?}", self.messages()),
            )
            .await;
    }
}

#[tonic::async_trait]
impl v1::telemetry_server::Telemetry for FakeIngest {
    type ReportStream = AckStream;

    async fn report(
        &self,
        req: tonic::Request<tonic::Streaming<v1::WorkerReport>>,
    ) -> Result<tonic::Response<AckStream>, tonic::Status> {
        let mut inbound = req.into_inner();
        let me = self.clone();
        let (tx, rx) = mpsc::channel(64);
        let mut kill = me.kill.subscribe();
        tokio::spawn(async move {
            loop {
                let m = tokio::select! {
                    m = inbound.message() => m,
                    _ = kill.changed() => {
                        let _ = tx.send(Err(tonic::Status::unavailable("killed by the test"))).await;
                        return;
                    }
                };
                let m = match m {
                    Ok(Some(m)) => m,
                    Ok(None) => {
                        me.ended_by_worker.fetch_add(1, Ordering::SeqCst);
                        me.changed.bump();
                        return;
                    }
                    Err(_) => return,
                };
                let seq = match &m.kind {
                    Some(Kind::Progress(p)) => p.seq,
                    Some(Kind::Heartbeat(h)) => h.seq,
                    _ => 0,
                };
                me.log.lock().unwrap().push(m);
                me.changed.bump();
                let ack = v1::ReportAck {
                    seq,
                    status: v1::AckStatus::Ok as i32,
                    detail: String::new(),
                    full_state_requested: me.ask_full_state.swap(false, Ordering::SeqCst),
                };
                if tx.send(Ok(ack)).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
