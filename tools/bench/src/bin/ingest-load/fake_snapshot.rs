//! The fake snapshot service behind the ingest under load: it counts the batches and changes
//! that arrive (and the probe values, for the latency figure) and acks every batch.
//!
//! Separate from the load itself: it stands in for a service, and is the only gRPC server in
//! this binary.

use super::*;

/// Counts what arrives and acks it.
#[derive(Clone)]
pub(super) struct FakeSnapshot {
    pub(super) counters: Arc<Counters>,
    pub(super) probes: Option<Probes>,
}

impl FakeSnapshot {
    /// Times the probes in a batch.
    pub(super) fn probe(&self, b: &v1::ChangeBatch) {
        let Some(probes) = &self.probes else { return };
        let now = Instant::now();
        for c in &b.changes {
            let Some(v1::telemetry_change::Kind::RequestProgress(p)) = &c.kind else {
                continue;
            };
            let Some(w) = p
                .request_id
                .strip_suffix("-probe")
                .and_then(|r| r.strip_prefix('w'))
                .and_then(|w| w.parse::<usize>().ok())
            else {
                continue;
            };
            let Some(Ok(mut sent)) = probes.get(w).map(|m| m.lock()) else {
                continue;
            };
            // Coalescing may skip values: older ones are forgotten, only this one is timed.
            let newer = sent.split_off(&(p.generated_tokens + 1));
            let at = sent.remove(&p.generated_tokens);
            *sent = newer;
            drop(sent);
            if let Some(at) = at
                && self.counters.measuring.load(Ordering::Relaxed)
                && let Ok(mut l) = self.counters.latencies.lock()
            {
                l.push(now.duration_since(at));
            }
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
    type ReserveStreamStream = BoxStream<v1::ReserveResult>;
    async fn reserve_stream(
        &self,
        _: tonic::Request<tonic::Streaming<v1::ReserveCall>>,
    ) -> Result<tonic::Response<Self::ReserveStreamStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn release(
        &self,
        _: tonic::Request<v1::ReleaseRequest>,
    ) -> Result<tonic::Response<v1::ReleaseResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn list_groups(
        &self,
        _: tonic::Request<v1::ListGroupsRequest>,
    ) -> Result<tonic::Response<v1::ListGroupsResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn set_cordon(
        &self,
        _: tonic::Request<v1::SetCordonRequest>,
    ) -> Result<tonic::Response<v1::SetCordonResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn apply(
        &self,
        req: tonic::Request<tonic::Streaming<v1::ChangeBatch>>,
    ) -> Result<tonic::Response<Self::ApplyStream>, tonic::Status> {
        let mut inbound = req.into_inner();
        let counters = self.counters.clone();
        let me = self.clone();
        let (tx, rx) = mpsc::channel(256);
        tokio::spawn(async move {
            let mut version = 0;
            while let Ok(Some(b)) = inbound.message().await {
                me.probe(&b);
                version += 1;
                counters.snap_batches.fetch_add(1, Ordering::Relaxed);
                counters
                    .snap_changes
                    .fetch_add(b.changes.len() as u64, Ordering::Relaxed);
                let ack = v1::ApplyAck {
                    batch_seq: b.batch_seq,
                    epoch: 1,
                    version,
                    rejected: vec![],
                };
                if tx.send(Ok(ack)).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
