//! The snapshot service in-process: the direct implementations of the seams the split
//! deployment crosses over gRPC. br-ingest's [`ApplyLink`], br-decision's [`SnapshotOps`] and
//! br-client's [`WatchSource`] each call the very handler a gRPC call would reach
//! ([`SnapshotService`]), so versions, resets, fencing, reservations and refusals are the same
//! code; only the encoding, the sockets and the TLS are gone. No σ is copied here: the writer's
//! Watch events are turned into messages by the handler exactly as for a gRPC watcher.

use std::time::Duration;

use br_client::watch::{WatchEvents, WatchSource};
use br_decision::upstream::SnapshotOps;
use br_ingest::forward::{Acks, ApplyLink, Batches, OpenError};
use br_proto::v1;
use br_proto::v1::snapshot_server::Snapshot as _;
use br_snapshot::service::SnapshotService;
use futures::future::BoxFuture;
use tokio_stream::StreamExt as _;

/// The in-process snapshot service, as ingest and decision reach it.
#[derive(Debug, Clone)]
pub struct Local {
    svc: SnapshotService,
    /// Bounds each Reserve/Release as `--reserve-timeout` does over gRPC: a writer too busy
    /// to answer in time is the same failure to the group task either way.
    timeout: Duration,
}

impl Local {
    pub fn new(svc: SnapshotService, timeout: Duration) -> Local {
        Local { svc, timeout }
    }
}

impl ApplyLink for Local {
    fn open(&self, batches: Batches) -> BoxFuture<'static, Result<Acks, OpenError>> {
        let acks = self.svc.apply_stream(batches.map(Ok));
        Box::pin(async move { Ok(acks) })
    }

    fn describe(&self) -> String {
        "the snapshot service in this process".into()
    }
}

impl WatchSource for Local {
    fn watch(
        &self,
        req: v1::WatchRequest,
    ) -> BoxFuture<'static, Result<WatchEvents, tonic::Status>> {
        let svc = self.svc.clone();
        Box::pin(async move {
            let events = svc.watch(tonic::Request::new(req)).await?.into_inner();
            Ok(events)
        })
    }
}

impl SnapshotOps for Local {
    fn reserve(
        &self,
        req: v1::ReserveRequest,
    ) -> BoxFuture<'static, Result<v1::ReserveResponse, tonic::Status>> {
        let (svc, timeout) = (self.svc.clone(), self.timeout);
        Box::pin(async move {
            match tokio::time::timeout(timeout, svc.reserve(tonic::Request::new(req))).await {
                Ok(r) => r.map(tonic::Response::into_inner),
                Err(_) => Err(tonic::Status::deadline_exceeded("Reserve timed out")),
            }
        })
    }

    fn release(
        &self,
        req: v1::ReleaseRequest,
    ) -> BoxFuture<'static, Result<v1::ReleaseResponse, tonic::Status>> {
        let (svc, timeout) = (self.svc.clone(), self.timeout);
        Box::pin(async move {
            match tokio::time::timeout(timeout, svc.release(tonic::Request::new(req))).await {
                Ok(r) => r.map(tonic::Response::into_inner),
                Err(_) => Err(tonic::Status::deadline_exceeded("Release timed out")),
            }
        })
    }
}
