//! The Watch handler in-process (as br-all's components call it): deltas queued for a watcher
//! that has not read go out merged, fewer messages than versions, and the watcher ends at the
//! σ `Get` answers. In-process so that "has not read" is exact: over gRPC, tonic drains the
//! queue into HTTP/2 buffers whether or not the client reads.
#![allow(clippy::unwrap_used)] // tests may panic on purpose

use br_proto::v1;
use br_proto::v1::snapshot_server::Snapshot as _;
use br_proto::v1::watch_event::Kind as Ev;
use br_sigma::Sigma;
use br_snapshot::Args;
use br_testkit::apply::{hello, progress};
use br_testkit::{Metrics, PATIENCE, within};
use futures::StreamExt as _;
use tokio_util::sync::CancellationToken;
use tonic::Request;

fn batch(seq: u64, changes: Vec<v1::TelemetryChange>) -> v1::ChangeBatch {
    v1::ChangeBatch {
        batch_seq: seq,
        group: "g".into(),
        changes,
        ..Default::default()
    }
}

async fn next(events: &mut br_snapshot::service::BoxStream<v1::WatchEvent>) -> Ev {
    within(PATIENCE, "a Watch event", events.next())
        .await
        .expect("the stream ended")
        .unwrap()
        .kind
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_did_not_read_gets_its_queued_versions_in_fewer_messages() {
    let args: Args =
        br_runtime::config::parse_from(["br-snapshot", "--watcher-queue", "1000"]).unwrap();
    let shutdown = CancellationToken::new();
    let c = br_snapshot::component(&args, shutdown.clone()).unwrap();
    let svc = c.service.clone();
    let watch = |epoch, last_version| {
        svc.watch(Request::new(v1::WatchRequest {
            group: "g".into(),
            epoch,
            last_version,
        }))
    };
    let mut events = watch(0, 0).await.unwrap().into_inner();
    let Ev::Snapshot(s0) = next(&mut events).await else {
        panic!("a new watcher starts with a snapshot")
    };
    let mut replica = Sigma::from_snapshot(&s0).unwrap();

    // N committed versions (each batch acked, so each is queued) while the watcher reads nothing.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut acks = svc.apply_stream(tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok));
    let n: u64 = 40;
    for seq in 1..=n {
        let changes = if seq == 1 {
            vec![hello(0, 10, 64)]
        } else {
            let g = u32::try_from(seq).unwrap();
            vec![progress(0, 10, "r", 100, g)]
        };
        tx.send(batch(seq, changes)).await.unwrap();
        let ack = within(PATIENCE, "an ack", acks.next())
            .await
            .unwrap()
            .unwrap();
        assert!(ack.rejected.is_empty(), "{ack:?}");
        assert_eq!(ack.version, seq);
    }
    let now = svc
        .get(Request::new(v1::GetRequest { group: "g".into() }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(now.version, n);

    // Now it reads: every version's changes, in order, in fewer messages (a progress mark,
    // should the machine be slow enough for one between two batches, stops a merge).
    let (mut deltas, mut marks) = (0u64, 0u64);
    while replica.version() < n {
        match next(&mut events).await {
            Ev::Delta(d) => {
                replica.apply_delta(&d).unwrap();
                deltas += 1;
            }
            Ev::Progress(_) => marks += 1,
            other => panic!("{other:?}"),
        }
    }
    assert!(deltas < n, "{deltas} messages for {n} versions");
    assert!(
        deltas <= marks + 1,
        "{deltas} messages, {marks} progress marks"
    );
    assert_eq!(replica.to_snapshot(), now);

    // The batching, as an operator sees it.
    let text = prometheus::TextEncoder::new()
        .encode_to_string(&c.metrics.registry().gather())
        .unwrap();
    let m = Metrics::parse(&text).unwrap();
    let g = [("group", "g")];
    let versions = m.value("balanceroute_snapshot_watch_delta_versions_total", &g);
    let messages = m.value("balanceroute_snapshot_watch_delta_messages_total", &g);
    assert_eq!((versions, messages), (n as f64, deltas as f64), "{text}");

    // A watcher resuming at the current version, then one more batch: the lone delta comes
    // at once, on its own (nothing waits for more).
    let mut resumed = watch(s0.epoch, n).await.unwrap().into_inner();
    tx.send(batch(n + 1, vec![progress(0, 10, "r", 100, 1000)]))
        .await
        .unwrap();
    loop {
        match next(&mut resumed).await {
            Ev::Delta(d) => {
                assert_eq!((d.prev_version, d.version), (n, n + 1));
                break;
            }
            Ev::Progress(_) => {}
            other => panic!("{other:?}"),
        }
    }
    shutdown.cancel();
}

/// br-all's watchers read the writer's events as it shares them among every watcher: one
/// allocation per delta for all of them (nothing copied per watcher), the very delta
/// `Snapshot.Watch` encodes for a gRPC watcher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_watchers_share_each_delta_with_every_watcher_and_read_what_watch_sends() {
    let args: Args = br_runtime::config::parse_from(["br-snapshot"]).unwrap();
    let shutdown = CancellationToken::new();
    let c = br_snapshot::component(&args, shutdown.clone()).unwrap();
    let svc = c.service.clone();
    let req = || v1::WatchRequest {
        group: "g".into(),
        epoch: 0,
        last_version: 0,
    };
    let mut a = svc.watch_shared(req()).await.unwrap();
    let mut b = svc.watch_shared(req()).await.unwrap();
    let mut wire = svc.watch(Request::new(req())).await.unwrap().into_inner();
    let (Some(Ok(br_snapshot::Event::Snapshot(sa))), Some(Ok(br_snapshot::Event::Snapshot(sb)))) =
        (shared(&mut a).await, shared(&mut b).await)
    else {
        panic!("a new watcher starts with a snapshot")
    };
    let Ev::Snapshot(sw) = next(&mut wire).await else {
        panic!("a new gRPC watcher starts with a snapshot")
    };
    assert_eq!((*sa == sw, *sb == sw), (true, true));

    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut acks = svc.apply_stream(tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok));
    tx.send(batch(
        1,
        vec![hello(0, 10, 64), progress(0, 10, "r", 100, 3)],
    ))
    .await
    .unwrap();
    let ack = within(PATIENCE, "an ack", acks.next())
        .await
        .unwrap()
        .unwrap();
    assert!(ack.rejected.is_empty(), "{ack:?}");

    let (Some(Ok(br_snapshot::Event::Delta(da))), Some(Ok(br_snapshot::Event::Delta(db)))) =
        (shared(&mut a).await, shared(&mut b).await)
    else {
        panic!("the batch's delta comes next")
    };
    assert!(
        std::sync::Arc::ptr_eq(&da, &db),
        "each watcher got its own copy"
    );
    let Ev::Delta(dw) = next(&mut wire).await else {
        panic!("the gRPC watcher's delta comes next")
    };
    assert_eq!(*da, dw);
    assert_eq!((dw.prev_version, dw.version, dw.changes.len()), (0, 1, 2));
    shutdown.cancel();
}

async fn shared(
    events: &mut br_snapshot::service::BoxStream<br_snapshot::Event>,
) -> Option<Result<br_snapshot::Event, tonic::Status>> {
    within(PATIENCE, "a shared Watch event", events.next()).await
}
