//! One `Snapshot.Apply` stream, as br-ingest holds it, for tests that drive a real snapshot
//! service with telemetry changes; and builders for the changes.

use br_proto::v1;
use br_proto::v1::telemetry_change as tc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// An open Apply stream: each batch gets the next `batch_seq` and its ack is awaited (bounded).
#[derive(Debug)]
pub struct ApplyStream {
    tx: mpsc::Sender<v1::ChangeBatch>,
    acks: tonic::Streaming<v1::ApplyAck>,
    /// The `batch_seq` of the last batch sent by [`ApplyStream::send`].
    pub seq: u64,
}

impl ApplyStream {
    /// Opens an Apply stream on the snapshot service at `url` (`http://host:port`).
    pub async fn open(url: &str) -> ApplyStream {
        let mut client = v1::snapshot_client::SnapshotClient::connect(url.to_owned())
            .await
            .unwrap_or_else(|e| panic!("connecting to the snapshot service at {url}: {e}"));
        let (tx, rx) = mpsc::channel(16);
        let acks = client
            .apply(ReceiverStream::new(rx))
            .await
            .expect("an Apply stream")
            .into_inner();
        ApplyStream { tx, acks, seq: 0 }
    }

    /// Sends `changes` for `group` as the next batch and returns its ack.
    pub async fn send(&mut self, group: &str, changes: Vec<v1::TelemetryChange>) -> v1::ApplyAck {
        self.seq += 1;
        self.send_raw(v1::ChangeBatch {
            ingest_id: String::new(),
            traceparent: String::new(),
            tracestate: String::new(),
            batch_seq: self.seq,
            group: group.into(),
            changes,
        })
        .await
    }

    /// Like [`ApplyStream::send`], and every change must be accepted.
    pub async fn send_ok(
        &mut self,
        group: &str,
        changes: Vec<v1::TelemetryChange>,
    ) -> v1::ApplyAck {
        let ack = self.send(group, changes).await;
        assert!(ack.rejected.is_empty(), "rejected: {ack:?}");
        ack
    }

    /// Sends `batch` as it is (any `batch_seq`) and returns its ack.
    pub async fn send_raw(&mut self, batch: v1::ChangeBatch) -> v1::ApplyAck {
        let seq = batch.batch_seq;
        self.tx.send(batch).await.expect("the Apply stream is open");
        let ack = crate::within(crate::PATIENCE, "the Apply ack", self.acks.message())
            .await
            .expect("the Apply stream failed")
            .expect("the Apply stream ended");
        assert_eq!(ack.batch_seq, seq, "acks answer batches in order");
        ack
    }
}

/// A telemetry change of `kind`.
pub fn change(kind: tc::Kind) -> v1::TelemetryChange {
    v1::TelemetryChange { kind: Some(kind) }
}

/// Worker `w` (incarnation `inc`, capacity `cap`) says hello; its endpoint is
/// `http://10.0.0.<w>:8000`.
pub fn hello(w: u32, inc: u64, cap: u32) -> v1::TelemetryChange {
    change(tc::Kind::WorkerHello(tc::WorkerHello {
        worker_id: w,
        incarnation: inc,
        capacity: cap,
        endpoint: format!("http://10.0.0.{w}:8000"),
    }))
}

/// Request `id` on worker `w` has `p` prompt and `g` generated tokens (not finished).
pub fn progress(w: u32, inc: u64, id: &str, p: u32, g: u32) -> v1::TelemetryChange {
    change(tc::Kind::RequestProgress(tc::RequestProgress {
        worker_id: w,
        incarnation: inc,
        request_id: id.into(),
        prompt_tokens: p,
        generated_tokens: g,
        finished: false,
        unkeyed: false,
    }))
}
