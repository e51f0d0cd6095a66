//! The decision service's calls to the snapshot service: `Reserve` and `Release` behind a small
//! trait, so the group task is unit-tested with a fake. (σ comes from `br_client::watch`.)

use std::time::Duration;

use br_proto::v1;
use br_proto::v1::snapshot_client::SnapshotClient;
use futures::future::BoxFuture;
use tonic::transport::{Channel, Endpoint};

/// `Snapshot.Reserve` and `Snapshot.Release`, as the group task needs them.
pub trait SnapshotOps: Send + Sync + 'static {
    fn reserve(
        &self,
        req: v1::ReserveRequest,
    ) -> BoxFuture<'static, Result<v1::ReserveResponse, tonic::Status>>;
    fn release(
        &self,
        req: v1::ReleaseRequest,
    ) -> BoxFuture<'static, Result<v1::ReleaseResponse, tonic::Status>>;
}

/// A lazily connecting channel to the snapshot service (it may start after us, or restart).
/// Over mutual TLS (verifying the server is the snapshot role) when `tls` is given.
pub fn snapshot_channel(
    addr: &str,
    tls: Option<&std::sync::Arc<br_trust::TlsMaterial>>,
) -> Result<Channel, tonic::transport::Error> {
    let endpoint = Endpoint::from_shared(addr.to_owned())?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(1))
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(3))
        .keep_alive_while_idle(true);
    Ok(br_trust::tls::connect_lazy(
        endpoint,
        tls,
        Some(br_trust::Role::Snapshot),
    ))
}

/// [`SnapshotOps`] over gRPC, each call bounded by `timeout`.
#[derive(Clone, Debug)]
pub struct GrpcSnapshot {
    client: SnapshotClient<br_trace::Traced<Channel>>,
    timeout: Duration,
}

impl GrpcSnapshot {
    pub fn new(channel: Channel, timeout: Duration) -> Self {
        GrpcSnapshot {
            // Reserve and Release carry the tick's span (its trace context) to the snapshot
            // service
            client: SnapshotClient::new(br_trace::traced(channel)),
            timeout,
        }
    }
}

impl SnapshotOps for GrpcSnapshot {
    fn reserve(
        &self,
        req: v1::ReserveRequest,
    ) -> BoxFuture<'static, Result<v1::ReserveResponse, tonic::Status>> {
        let mut c = self.client.clone();
        let timeout = self.timeout;
        Box::pin(async move {
            let mut r = tonic::Request::new(req);
            r.set_timeout(timeout);
            match tokio::time::timeout(timeout, c.reserve(r)).await {
                Ok(r) => r.map(tonic::Response::into_inner),
                Err(_) => Err(tonic::Status::deadline_exceeded("Reserve timed out")),
            }
        })
    }

    fn release(
        &self,
        req: v1::ReleaseRequest,
    ) -> BoxFuture<'static, Result<v1::ReleaseResponse, tonic::Status>> {
        let mut c = self.client.clone();
        let timeout = self.timeout;
        Box::pin(async move {
            let mut r = tonic::Request::new(req);
            r.set_timeout(timeout);
            match tokio::time::timeout(timeout, c.release(r)).await {
                Ok(r) => r.map(tonic::Response::into_inner),
                Err(_) => Err(tonic::Status::deadline_exceeded("Release timed out")),
            }
        })
    }
}
