//! The snapshot service in-process: the direct implementations of the seams the split
//! deployment crosses over gRPC. br-ingest's [`ApplyLink`], br-decision's [`SnapshotOps`] and
//! br-client's [`WatchSource`] each call the very handler a gRPC call would reach
//! ([`SnapshotService`]), so versions, resets, fencing, reservations and refusals are the same
//! code; only the encoding, the sockets and the TLS are gone (and, for Reserve, the unary
//! handler's always-on span: [`SnapshotService::reserve_in_process`]). No σ is copied here:
//! decision's watcher reads the writer's Watch events as the writer shares them among its
//! watchers ([`SnapshotService::watch_shared`]: the subscription, bounds and merging of
//! `Snapshot.Watch`, without the message each change would be copied into).

use std::time::Duration;

use br_client::watch::{SourceEvent, WatchEvents, WatchSource};
use br_decision::SnapshotOps;
use br_ingest::forward::{Acks, ApplyLink, Batches, OpenError};
use br_proto::v1;
use br_proto::v1::snapshot_server::Snapshot as _;
use br_snapshot::Event;
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
            // The writer's own deltas and snapshots, shared with every other watcher: no copy
            // of a change, no encoding.
            let events = svc.watch_shared(req).await?;
            Ok(Box::pin(events.map(|ev| ev.map(source_event))) as WatchEvents)
        })
    }
}

/// A watcher queue's event as the watcher reads it (what `Snapshot.Watch` would encode).
fn source_event(ev: Event) -> SourceEvent {
    match ev {
        Event::Snapshot(s) => SourceEvent::Snapshot(s),
        Event::Delta(d) => SourceEvent::Delta(d),
        Event::Progress { epoch, version } => {
            SourceEvent::Progress(v1::watch_event::ProgressMark { epoch, version })
        }
        Event::Reset {
            reason,
            epoch,
            detail,
        } => SourceEvent::Reset(v1::watch_event::Reset {
            reason: reason as i32,
            epoch,
            detail: detail.to_string(),
        }),
    }
}

impl SnapshotOps for Local {
    fn reserve(
        &self,
        req: v1::ReserveRequest,
    ) -> BoxFuture<'static, Result<v1::ReserveResponse, tonic::Status>> {
        // The handler's work without its always-on span (see `reserve_in_process`): the
        // Reserve of every Assign batch passes here.
        let reserve = self.svc.reserve_in_process(req);
        let timeout = self.timeout;
        Box::pin(async move {
            match tokio::time::timeout(timeout, reserve).await {
                Ok(r) => r,
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on purpose
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use clap::Parser as _;
    use tokio_util::sync::CancellationToken;
    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;

    /// Counts the spans created while it is the thread's subscriber.
    struct CountSpans(Arc<AtomicUsize>);

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CountSpans {
        fn on_new_span(
            &self,
            _: &tracing::span::Attributes<'_>,
            _: &tracing::span::Id,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn reserve_on_unknown_worker() -> v1::ReserveRequest {
        v1::ReserveRequest {
            group: "g".into(),
            reservations: vec![v1::Reservation {
                request_id: "r-1".into(),
                worker_id: 3,
                incarnation: 1,
                prompt_tokens: 100,
                ..Default::default()
            }],
        }
    }

    /// br-all's decision reserves once per batch of Assigns through [`Local`]: while traces
    /// are not exported that costs no span (the unary handler's `#[instrument]` span was
    /// 1.5% of br-all's CPU), and the answer is the unary handler's. On the current-thread
    /// runtime the writer runs on this thread too, so its spans would be counted as well.
    #[tokio::test]
    async fn an_in_process_reserve_makes_no_span_while_traces_are_off_and_answers_like_the_handler()
    {
        assert!(!br_trace::enabled());
        let stop = CancellationToken::new();
        let args = br_snapshot::Args::try_parse_from(["br-snapshot"]).unwrap();
        let snapshot = br_snapshot::component(&args, stop.clone()).unwrap();
        let local = Local::new(snapshot.service.clone(), Duration::from_secs(5));
        let spans = Arc::new(AtomicUsize::new(0));
        let counted = {
            let _guard = tracing::subscriber::set_default(
                tracing_subscriber::registry().with(CountSpans(Arc::clone(&spans))),
            );
            local.reserve(reserve_on_unknown_worker()).await
        };
        assert_eq!(
            spans.load(Ordering::Relaxed),
            0,
            "spans made by one Reserve"
        );
        let unary = snapshot
            .service
            .reserve(tonic::Request::new(reserve_on_unknown_worker()))
            .await
            .map(tonic::Response::into_inner);
        match (counted, unary) {
            (Ok(a), Ok(b)) => {
                assert_eq!(a.rejected, b.rejected);
                assert!(a.accepted.is_empty() && !a.rejected.is_empty(), "{a:?}");
            }
            (Err(a), Err(b)) => assert_eq!((a.code(), a.message()), (b.code(), b.message())),
            (a, b) => panic!("in-process {a:?}, unary {b:?}"),
        }
        // The writer ends once cancelled and its last handle is gone.
        stop.cancel();
        drop((local, snapshot.service));
        tokio::time::timeout(Duration::from_secs(30), snapshot.writer_task)
            .await
            .expect("the writer ends")
            .unwrap();
    }
}
