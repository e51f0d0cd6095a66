//! A decode worker as the control plane sees it: one `Telemetry.Report` stream saying Hello,
//! then cumulative progress, and its full state whenever the service asks for it. It keeps
//! the ground truth (what it really runs) for tests to compare σ against.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use br_proto::v1::telemetry_client::TelemetryClient;
use br_proto::v1::{self, worker_report};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Running {
    pub prompt_tokens: u32,
    pub generated: u32,
}

pub struct FakeWorker {
    pub group: String,
    pub worker_id: u32,
    pub incarnation: u64,
    pub capacity: u32,
    tx: mpsc::Sender<v1::WorkerReport>,
    /// One strictly increasing sequence per incarnation, shared with the ack reader.
    seq: Arc<AtomicU64>,
    /// The ground truth: requests this worker holds.
    pub running: Arc<Mutex<BTreeMap<String, Running>>>,
    /// How many acks asked for a full state (the worker answered each).
    pub full_state_requests: Arc<Mutex<u64>>,
    reader: tokio::task::JoinHandle<()>,
}

impl FakeWorker {
    /// Opens the stream and says Hello.
    pub async fn connect(ingest: &str, group: &str, worker_id: u32, capacity: u32) -> FakeWorker {
        let incarnation = 0x5eed_0000_0000_0000
            | (u64::from(worker_id) << 16)
            | u64::from(std::process::id() & 0xffff);
        let running: Arc<Mutex<BTreeMap<String, Running>>> = Arc::default();
        let full_state_requests: Arc<Mutex<u64>> = Arc::default();
        let seq = Arc::new(AtomicU64::new(0));
        let mut w = FakeWorker {
            group: group.to_owned(),
            worker_id,
            incarnation,
            capacity,
            tx: mpsc::channel(1).0,
            seq,
            running,
            full_state_requests,
            reader: tokio::spawn(async {}),
        };
        let acks = w.open(ingest).await.expect("report stream");
        w.read_acks(acks);
        w
    }

    /// Opens a stream to `ingest` and says Hello as this incarnation; the stream's acks
    /// (the Hello's first), or the status that refused it.
    async fn open(
        &mut self,
        ingest: &str,
    ) -> Result<tonic::Streaming<v1::ReportAck>, tonic::Status> {
        let mut client = TelemetryClient::connect(ingest.to_owned())
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let (tx, rx) = mpsc::channel(1024);
        tx.send(v1::WorkerReport {
            kind: Some(worker_report::Kind::Hello(v1::Hello {
                group: self.group.clone(),
                worker_id: self.worker_id,
                incarnation: self.incarnation,
                capacity: self.capacity,
                endpoint: format!("http://127.0.0.1:{}", 18000 + self.worker_id),
            })),
        })
        .await
        .expect("stream open");
        let acks = client.report(ReceiverStream::new(rx)).await?.into_inner();
        self.tx = tx;
        Ok(acks)
    }

    /// Answers every ack that asks for the full state (in a task, until the stream ends).
    fn read_acks(&mut self, mut acks: tonic::Streaming<v1::ReportAck>) {
        let (r2, f2, tx2, seq2) = (
            self.running.clone(),
            self.full_state_requests.clone(),
            self.tx.clone(),
            self.seq.clone(),
        );
        self.reader.abort();
        self.reader = tokio::spawn(async move {
            while let Some(Ok(ack)) = acks.next().await {
                if ack.full_state_requested {
                    *f2.lock().unwrap() += 1;
                    let updates = snapshot_updates(&r2);
                    let n = seq2.fetch_add(1, Ordering::SeqCst) + 1;
                    let _ = tx2.send(progress(n, updates, true)).await;
                }
            }
        });
    }

    /// What a shim does when its stream is lost: connects again to `ingest` (the same
    /// replica restarted, or another one) as the same incarnation, or as a new one when
    /// `new_incarnation` (the shim process restarted), until a Hello is accepted, then
    /// sends its full state. Its requests keep running meanwhile. Panics if no Hello is
    /// accepted within `patience`.
    pub async fn reconnect(
        &mut self,
        ingest: &str,
        new_incarnation: bool,
        patience: std::time::Duration,
    ) {
        // The old stream ends here (if it was still open): a shim that died says nothing.
        self.reader.abort();
        self.tx = mpsc::channel(1).0;
        if new_incarnation {
            self.incarnation = self.incarnation.wrapping_add(0x1_0000_0000);
        }
        let deadline = std::time::Instant::now() + patience;
        let mut backoff = std::time::Duration::from_millis(20);
        loop {
            let refused = match self.open(ingest).await {
                Ok(mut acks) => match acks.message().await {
                    Ok(Some(_hello_ack)) => {
                        self.read_acks(acks);
                        break;
                    }
                    Ok(None) => "the stream ended without an ack".to_owned(),
                    Err(s) => format!("{}: {}", s.code(), s.message()),
                },
                Err(s) => format!("{}: {}", s.code(), s.message()),
            };
            assert!(
                std::time::Instant::now() < deadline,
                "worker {} could not reconnect to {ingest} within {patience:?}: {refused}",
                self.worker_id
            );
            // The shim's backoff (the old stream may still hold the slot for a moment)
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(std::time::Duration::from_millis(500));
        }
        self.full_state().await;
    }

    /// Starts running a request (reports generated = 0 with its prompt).
    pub async fn start(&mut self, request_id: &str, prompt_tokens: u32) {
        self.running.lock().unwrap().insert(
            request_id.to_owned(),
            Running {
                prompt_tokens,
                generated: 0,
            },
        );
        self.report(vec![update(request_id, prompt_tokens, 0, false)], false)
            .await;
    }

    /// Every running request writes `tokens` more tokens; one batched report.
    pub async fn step(&mut self, tokens: u32) {
        let updates: Vec<_> = {
            let mut r = self.running.lock().unwrap();
            r.iter_mut()
                .map(|(id, st)| {
                    st.generated += tokens;
                    update(id, st.prompt_tokens, st.generated, false)
                })
                .collect()
        };
        self.report(updates, false).await;
    }

    pub async fn finish(&mut self, request_id: &str) {
        let st = self.running.lock().unwrap().remove(request_id);
        if let Some(st) = st {
            self.report(
                vec![update(request_id, st.prompt_tokens, st.generated, true)],
                false,
            )
            .await;
        }
    }

    /// Says it is alive while it has nothing to report, as a shim's reporter does: a
    /// worker silent for `--worker-grace` is fenced.
    pub async fn heartbeat(&mut self) {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst) + 1;
        let _ = self
            .tx
            .send(v1::WorkerReport {
                kind: Some(worker_report::Kind::Heartbeat(v1::Heartbeat { seq })),
            })
            .await;
    }

    /// Sends the full state (everything it holds).
    pub async fn full_state(&mut self) {
        let updates = snapshot_updates(&self.running);
        self.report(updates, true).await;
    }

    async fn report(&mut self, updates: Vec<v1::RequestProgress>, full_state: bool) {
        // A full-state resend racing this one may overtake it; ingest then drops this one
        // as stale, which is harmless: reports are cumulative and the resend carries it.
        let n = self.seq.fetch_add(1, Ordering::SeqCst) + 1;
        let _ = self.tx.send(progress(n, updates, full_state)).await;
    }

    /// Ground truth load: Σ prompt + generated.
    pub fn load(&self) -> u64 {
        self.running
            .lock()
            .unwrap()
            .values()
            .map(|r| u64::from(r.prompt_tokens) + u64::from(r.generated))
            .sum()
    }

    /// Drops the stream without a goodbye (the shim or its node died).
    pub fn die(self) {
        self.reader.abort();
        drop(self.tx);
    }
}

fn update(
    id: &str,
    prompt_tokens: u32,
    generated_tokens: u32,
    finished: bool,
) -> v1::RequestProgress {
    v1::RequestProgress {
        request_id: id.to_owned(),
        prompt_tokens,
        generated_tokens,
        finished,
        unkeyed: false,
    }
}

fn snapshot_updates(running: &Mutex<BTreeMap<String, Running>>) -> Vec<v1::RequestProgress> {
    running
        .lock()
        .unwrap()
        .iter()
        .map(|(id, st)| update(id, st.prompt_tokens, st.generated, false))
        .collect()
}

fn progress(seq: u64, updates: Vec<v1::RequestProgress>, full_state: bool) -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(worker_report::Kind::Progress(v1::Progress {
            seq,
            updates,
            full_state,
            traceparent: String::new(),
            tracestate: String::new(),
        })),
    }
}
