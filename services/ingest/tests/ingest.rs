//! br-ingest over real gRPC on 127.0.0.1: real tonic clients as workers, a fake snapshot
//! service behind it (see common/).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use br_proto::v1;
use br_proto::v1::telemetry_change::Kind as TcKind;
use common::*;

/// Sends `report(seq)` (seq counting up) until an ack satisfies `done`; a report only gets its
/// answer once ingest has handled it, so the round trips pace the loop. Bounded by WAIT.
async fn call_until(
    w: &mut Worker,
    seq: &mut u64,
    what: &str,
    report: impl Fn(u64) -> v1::WorkerReport,
    done: impl Fn(&v1::ReportAck) -> bool,
) {
    let state = tokio::sync::Mutex::new((w, *seq));
    eventually(WAIT, what, || {
        let (state, report, done) = (&state, &report, &done);
        async move {
            let mut g = state.lock().await;
            let (w, seq) = &mut *g;
            let a = w.call(report(*seq)).await;
            *seq += 1;
            done(&a)
        }
    })
    .await;
    *seq = state.into_inner().1;
}

fn code(r: Result<v1::ReportAck, tonic::Status>) -> tonic::Code {
    match r {
        Ok(a) => panic!("expected the stream to end, got an ack {a:?}"),
        Err(s) => s.code(),
    }
}

/// One worker-id limit for every service: ingest with its default `--max-worker-id` refuses a
/// Hello above `limits::MAX_WORKER_ID` itself (before, worker 2000 was acknowledged OK by ingest
/// and then silently dropped by the snapshot service, which holds ids up to 1023 only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_above_the_contract_worker_id_limit_is_invalid_argument_naming_it() {
    let snap = FakeSnapshot::default();
    let srv = snap.start().await;
    let saddr = srv.addr;
    let ing = TestIngest::start(saddr, &["--groups", "g0"]).await;
    ing.connected().await;
    let limit = br_proto::valid::limits::MAX_WORKER_ID;
    let mut w = ing.worker().await;
    w.send(hello("g0", 2000, 1)).await;
    let err = w.next().await.expect_err("the stream must end");
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains(&limit.to_string()), "{err:?}");
    assert_eq!(
        snap.hellos_of(2000),
        0,
        "the snapshot service never hears of it"
    );
    // the highest id in range is accepted
    let mut top = ing.worker().await;
    let a = top.hello("g0", limit, 7).await;
    assert_eq!(status(&a), v1::AckStatus::Ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_first_and_identity_rules() {
    let snap = FakeSnapshot::default();
    let srv = snap.start().await;
    let saddr = srv.addr;
    let ing = TestIngest::start(saddr, &["--groups", "g0,g1", "--max-worker-id", "7"]).await;
    ing.connected().await;

    // A Progress before any Hello.
    let mut w = ing.worker().await;
    w.send(progress(1, false, &[("a", 1, 1, false)])).await;
    assert_eq!(code(w.next().await), tonic::Code::FailedPrecondition);

    // Invalid Hellos: empty group, worker id out of range, zero incarnation.
    for (g, id, inc) in [("", 0, 1), ("g0", 1_024, 1), ("g0", 1, 0)] {
        let mut w = ing.worker().await;
        w.send(hello(g, id, inc)).await;
        assert_eq!(
            code(w.next().await),
            tonic::Code::InvalidArgument,
            "{g:?} {id} {inc}"
        );
    }

    // A rank above this deployment's group size.
    let mut w = ing.worker().await;
    w.send(hello("g0", 8, 1)).await;
    assert_eq!(code(w.next().await), tonic::Code::InvalidArgument);

    // A group not served.
    let mut w = ing.worker().await;
    w.send(hello("other", 1, 1)).await;
    assert_eq!(code(w.next().await), tonic::Code::PermissionDenied);

    // A good worker; a second Hello with another identity ends its stream.
    let mut good = ing.worker().await;
    let a = good.hello("g0", 1, 42).await;
    assert_eq!((a.seq, status(&a)), (0, v1::AckStatus::Ok));
    // The same identity on another stream while the first is live.
    let mut twin = ing.worker().await;
    twin.send(hello("g0", 1, 42)).await;
    assert_eq!(code(twin.next().await), tonic::Code::AlreadyExists);
    // Another incarnation of the same worker (a second shim with the same --worker-id, or a
    // restart whose old stream is still open) does not evict the live stream: it is refused,
    // naming the live incarnation, and the first stream keeps being acknowledged.
    let mut second = ing.worker().await;
    second.send(hello("g0", 1, 43)).await;
    let refused = second.next().await.expect_err("the second stream must end");
    assert_eq!(refused.code(), tonic::Code::AlreadyExists, "{refused:?}");
    assert!(refused.message().contains("incarnation 42"), "{refused:?}");
    let hellos_43 = snap
        .changes()
        .iter()
        .filter(|(_, k)| matches!(k, TcKind::WorkerHello(h) if h.incarnation == 43))
        .count();
    assert_eq!(
        hellos_43, 0,
        "the snapshot side never hears of incarnation 43"
    );
    // Repeating its own Hello is harmless.
    let a = good.call(hello("g0", 1, 42)).await;
    assert_eq!(status(&a), v1::AckStatus::Ok);
    good.send(hello("g1", 1, 42)).await;
    assert_eq!(code(good.next().await), tonic::Code::InvalidArgument);

    // Only the good worker reached the snapshot side: its Hello, then its disconnect.
    snap.wait_for("the disconnect", |s| {
        s.changes()
            .iter()
            .any(|(_, k)| matches!(k, TcKind::WorkerDisconnected(d) if d.worker_id == 1))
    })
    .await;
    for (g, k) in snap.changes() {
        assert_eq!(g, "g0");
        match k {
            TcKind::WorkerHello(h) => assert_eq!((h.worker_id, h.incarnation), (1, 42)),
            TcKind::WorkerDisconnected(d) => assert_eq!((d.worker_id, d.incarnation), (1, 42)),
            other => panic!("unexpected change {other:?}"),
        }
    }
    for reason in [
        "first_not_hello",
        "invalid_hello",
        "worker_id_out_of_range",
        "group_not_allowed",
        "already_connected",
        "identity_changed",
    ] {
        let v = ing
            .metric("balanceroute_ingest_rejected_total", &[("reason", reason)])
            .await;
        assert!(v >= 1.0, "{reason}: {v}");
    }
    ing.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_messages_are_rejected_typed_and_never_reach_the_snapshot() {
    let snap = FakeSnapshot::default();
    let srv = snap.start().await;
    let saddr = srv.addr;
    let ing = TestIngest::start(saddr, &["--max-updates-per-message", "4"]).await;
    ing.connected().await;
    let mut w = ing.worker().await;
    w.hello("g0", 3, 9).await;
    let ok = w.call(progress(1, false, &[("good", 10, 1, false)])).await;
    assert_eq!(status(&ok), v1::AckStatus::Ok);

    let too_many: Vec<(&str, u32, u32, bool)> = ["b1", "b2", "b3", "b4", "b5"]
        .iter()
        .map(|id| (*id, 1, 1, false))
        .collect();
    let cases: Vec<(v1::WorkerReport, &str)> = vec![
        (v1::WorkerReport { kind: None }, "missing"),
        (progress(2, false, &too_many), "too_many_updates"),
        (
            progress(2, false, &[("b1", 1, 10_000_001, false)]),
            "out_of_range",
        ),
        (
            progress(2, false, &[("b1", 10_000_001, 1, false)]),
            "out_of_range",
        ),
        (
            progress(2, false, &[("b1", 6_000_000, 4_000_001, false)]),
            "too_many_tokens",
        ),
        // Overflow through the cumulative state of a known request.
        (
            progress(2, false, &[("good", 0, 9_999_991, false)]),
            "too_many_tokens",
        ),
        (progress(2, false, &[("", 1, 1, false)]), "empty"),
        (
            progress(2, false, &[("b\u{1}", 1, 1, false)]),
            "control_character",
        ),
        (
            progress(2, false, &[("b1", 1, 1, false), ("b1", 1, 2, false)]),
            "duplicate",
        ),
        (progress(0, false, &[("b1", 1, 1, false)]), "out_of_range"),
        (heartbeat(0), "out_of_range"),
    ];
    for (m, reason) in cases {
        let before = ing
            .metric("balanceroute_ingest_rejected_total", &[("reason", reason)])
            .await;
        let a = w.call(m).await;
        assert_eq!(status(&a), v1::AckStatus::Rejected, "{reason}: {a:?}");
        assert!(!a.detail.is_empty());
        assert_eq!(a.seq, 1, "a rejected message does not move the seq");
        let after = ing
            .metric("balanceroute_ingest_rejected_total", &[("reason", reason)])
            .await;
        assert_eq!(after, before + 1.0, "{reason} counted");
    }
    // The stream goes on, the worker is not blamed: a good message still works.
    let a = w.call(progress(2, false, &[("good", 10, 2, false)])).await;
    assert_eq!((a.seq, status(&a)), (2, v1::AckStatus::Ok));
    snap.wait_for("good at 2", |s| {
        s.progress_of("good")
            .iter()
            .any(|p| p.generated_tokens == 2)
    })
    .await;
    for (_, k) in snap.changes() {
        match k {
            TcKind::WorkerHello(_) => {}
            TcKind::RequestProgress(p) => {
                assert_eq!(p.request_id, "good");
                assert!(p.generated_tokens <= 2);
            }
            other => panic!("a rejected message reached the snapshot side: {other:?}"),
        }
    }
    ing.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floods_and_oversized_messages() {
    let snap = FakeSnapshot::default();
    let srv = snap.start().await;
    let saddr = srv.addr;
    let ing = TestIngest::start(
        saddr,
        &[
            "--max-events-per-sec-per-stream",
            "10",
            "--max-updates-per-message",
            "10",
            "--max-message-bytes",
            "4096",
        ],
    )
    .await;
    ing.connected().await;

    // Rate: the burst (10 events) passes, then REJECTED, then the stream is ended.
    let mut w = ing.worker().await;
    w.hello("g0", 1, 1).await;
    let ups: Vec<(String, u32, u32, bool)> =
        (0..10).map(|i| (format!("r{i}"), 1, 1, false)).collect();
    let ups: Vec<(&str, u32, u32, bool)> = ups
        .iter()
        .map(|(id, p, g, f)| (id.as_str(), *p, *g, *f))
        .collect();
    assert_eq!(
        status(&w.call(progress(1, false, &ups)).await),
        v1::AckStatus::Ok
    );
    let mut seq = 2;
    let mut saw_rejected = false;
    let ended = loop {
        w.send(progress(seq, false, &ups)).await;
        match w.next().await {
            Ok(a) => {
                if status(&a) == v1::AckStatus::Rejected {
                    assert!(a.detail.contains("events/s"), "{a:?}");
                    saw_rejected = true;
                }
            }
            Err(s) => break s,
        }
        seq += 1;
        assert!(seq < 10_000, "never ended");
    };
    assert!(saw_rejected);
    assert_eq!(ended.code(), tonic::Code::ResourceExhausted);
    assert!(
        ing.metric(
            "balanceroute_ingest_rejected_total",
            &[("reason", "rate_limited")]
        )
        .await
            >= 1.0
    );
    assert!(
        ing.metric("balanceroute_ingest_rejected_total", &[("reason", "flood")])
            .await
            >= 1.0
    );

    // Size: one message above --max-message-bytes ends the stream.
    let mut w = ing.worker().await;
    w.hello("g0", 2, 1).await;
    let big = "x".repeat(250);
    let updates = (0..30)
        .map(|i| v1::RequestProgress {
            request_id: format!("{big}{i}"),
            prompt_tokens: 1,
            generated_tokens: 1,
            finished: false,
            unkeyed: false,
        })
        .collect();
    let m = v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Progress(v1::Progress {
            seq: 1,
            updates,
            full_state: false,
            traceparent: String::new(),
            tracestate: String::new(),
        })),
    };
    w.send(m).await;
    assert_eq!(code(w.next().await), tonic::Code::ResourceExhausted);
    assert!(
        ing.metric(
            "balanceroute_ingest_rejected_total",
            &[("reason", "message_too_large")]
        )
        .await
            >= 1.0
    );
    ing.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_and_reordering_are_absorbed() {
    let snap = FakeSnapshot::default();
    let srv = snap.start().await;
    let saddr = srv.addr;
    let ing = TestIngest::start(saddr, &[]).await;
    ing.connected().await;
    let mut w = ing.worker().await;
    w.hello("g0", 4, 7).await;
    let a = w.call(progress(1, false, &[("a", 10, 5, false)])).await;
    assert_eq!(status(&a), v1::AckStatus::Ok);
    let a = w.call(progress(3, false, &[("a", 10, 9, false)])).await;
    assert_eq!(status(&a), v1::AckStatus::Ok);
    // Reordered (seq 2 after 3): ignored, and a full state is asked for.
    let a = w.call(progress(2, false, &[("a", 10, 7, false)])).await;
    assert_eq!((status(&a), a.seq), (v1::AckStatus::StaleSeq, 3));
    assert!(a.full_state_requested);
    // Duplicate of 3.
    let a = w.call(progress(3, false, &[("a", 10, 9, false)])).await;
    assert_eq!(status(&a), v1::AckStatus::StaleSeq);
    // Going backwards with a newer seq: absorbed by max().
    let a = w.call(progress(4, false, &[("a", 10, 8, false)])).await;
    assert_eq!(status(&a), v1::AckStatus::Ok);
    // Heartbeats share the seq space.
    assert_eq!(status(&w.call(heartbeat(4)).await), v1::AckStatus::StaleSeq);
    assert_eq!(status(&w.call(heartbeat(5)).await), v1::AckStatus::Ok);
    let a = w.call(progress(6, false, &[("a", 10, 12, true)])).await;
    assert_eq!(status(&a), v1::AckStatus::Ok);
    // finished is sticky.
    let a = w.call(progress(7, false, &[("a", 10, 12, false)])).await;
    assert_eq!(status(&a), v1::AckStatus::Ok);

    snap.wait_for("a finished", |s| {
        s.progress_of("a").iter().any(|p| p.finished)
    })
    .await;
    let seen: Vec<(u32, bool)> = snap
        .progress_of("a")
        .iter()
        .map(|p| (p.generated_tokens, p.finished))
        .collect();
    assert!(
        seen.windows(2)
            .all(|w| w[0].0 <= w[1].0 && (!w[0].1 || w[1].1)),
        "never backwards, finished sticky: {seen:?}"
    );
    assert!(!seen.iter().any(|(g, _)| *g == 7 || *g == 8), "{seen:?}");
    assert_eq!(*seen.last().unwrap(), (12, true));
    ing.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_state_becomes_worker_sync_and_stream_end_a_disconnect() {
    let snap = FakeSnapshot::default();
    let srv = snap.start().await;
    let saddr = srv.addr;
    let ing = TestIngest::start(saddr, &[]).await;
    ing.connected().await;
    let mut w = ing.worker().await;
    w.hello("g2", 5, 77).await;
    w.call(progress(
        1,
        false,
        &[("a", 1, 1, false), ("b", 1, 1, false)],
    ))
    .await;
    let a = w
        .call(progress(2, true, &[("b", 1, 1, false), ("c", 2, 0, false)]))
        .await;
    assert_eq!(status(&a), v1::AckStatus::Ok);
    snap.wait_for("the sync", |s| {
        s.changes()
            .iter()
            .any(|(_, k)| matches!(k, TcKind::WorkerSync(_)))
    })
    .await;
    // The sync comes after the progress of what it lists, in the same batch.
    let batch = snap
        .batches()
        .into_iter()
        .find(|b| {
            b.changes
                .iter()
                .any(|c| matches!(c.kind, Some(TcKind::WorkerSync(_))))
        })
        .unwrap();
    assert_eq!(batch.group, "g2");
    let kinds: Vec<TcKind> = batch.changes.into_iter().filter_map(|c| c.kind).collect();
    let sync_at = kinds
        .iter()
        .position(|k| matches!(k, TcKind::WorkerSync(_)))
        .unwrap();
    let TcKind::WorkerSync(sync) = &kinds[sync_at] else {
        unreachable!()
    };
    assert_eq!((sync.worker_id, sync.incarnation), (5, 77));
    let mut ids = sync.request_ids.clone();
    ids.sort();
    assert_eq!(ids, vec!["b", "c"]);
    for id in ["b", "c"] {
        assert!(
            kinds[..sync_at]
                .iter()
                .any(|k| matches!(k, TcKind::RequestProgress(p) if p.request_id == id)),
            "{id} before the sync: {kinds:?}"
        );
    }

    // The stream ends: WorkerDisconnected with ingest's clock.
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    drop(w);
    snap.wait_for("the disconnect", |s| {
        s.changes()
            .iter()
            .any(|(_, k)| matches!(k, TcKind::WorkerDisconnected(_)))
    })
    .await;
    let d = snap
        .changes()
        .into_iter()
        .find_map(|(_, k)| match k {
            TcKind::WorkerDisconnected(d) => Some(d),
            _ => None,
        })
        .unwrap();
    assert_eq!((d.worker_id, d.incarnation), (5, 77));
    assert!(d.disconnected_at_unix_ms >= before, "{d:?} vs {before}");
    eventually(WAIT, "the stream gauge back to 0", || async {
        ing.metric("balanceroute_ingest_streams", &[]).await == 0.0
    })
    .await;
    ing.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_away_acks_buffered_then_coalesced_backlog_and_full_state_request() {
    // The snapshot service is not there yet.
    let reserved = ReservedPort::new(); // refuses connections until the fake listens on it
    let saddr = reserved.addr();
    let ing = TestIngest::start(saddr, &[]).await;
    assert_eq!(http_get(ing.admin, "/readyz").await.0, 503);
    assert_eq!(http_get(ing.admin, "/livez").await.0, 200);
    let mut w = ing.worker().await;
    let a = w.hello("g0", 1, 5).await;
    assert_eq!(status(&a), v1::AckStatus::Buffered);
    // Many updates of one request (and a few of another) while it is away: every one acked.
    for seq in 1..=100u64 {
        let a = w
            .call(progress(
                seq,
                false,
                &[
                    ("hot", 100, seq as u32, false),
                    ("cold", 5, (seq / 50) as u32, false),
                ],
            ))
            .await;
        assert_eq!((a.seq, status(&a)), (seq, v1::AckStatus::Buffered));
    }
    // The ack is sent once the changes are queued to the forwarder, which sets the gauge
    // when it has taken them in (reading it at once failed 1 run in ~10 under load).
    eventually(WAIT, "the buffered changes in the gauge", || async {
        ing.metric("balanceroute_ingest_buffered_changes", &[])
            .await
            >= 2.0
    })
    .await;
    assert_eq!(
        ing.metric("balanceroute_ingest_snapshot_connected", &[])
            .await,
        0.0
    );

    // It comes back: the backlog arrives, one change per request.
    let snap = FakeSnapshot::default();
    let srv = snap.serve_on(reserved.listen());
    snap.wait_for("the backlog", |s| {
        s.progress_of("hot")
            .iter()
            .any(|p| p.generated_tokens == 100)
    })
    .await;
    let hot = snap.progress_of("hot");
    assert_eq!(hot.len(), 1, "coalesced: {hot:?}");
    assert_eq!(snap.progress_of("cold").len(), 1);
    assert_eq!(snap.progress_of("cold")[0].generated_tokens, 2);
    // The worker's Hello went first.
    let first = &snap.changes()[0].1;
    assert!(
        matches!(first, TcKind::WorkerHello(h) if h.worker_id == 1),
        "{first:?}"
    );
    eventually(WAIT, "ready", || async {
        http_get(ing.admin, "/readyz").await.0 == 200
    })
    .await;
    assert_eq!(
        ing.metric("balanceroute_ingest_snapshot_connected", &[])
            .await,
        1.0
    );
    // The worker is asked for a full state (σ may be new), and acks are OK again.
    let a = w.call(heartbeat(101)).await;
    assert!(a.full_state_requested, "{a:?}");
    let a = w.call(heartbeat(102)).await;
    assert_eq!(status(&a), v1::AckStatus::Ok);
    assert!(!a.full_state_requested);
    assert!(
        ing.metric("balanceroute_ingest_batches_sent_total", &[])
            .await
            >= 1.0
    );
    srv.stop().await;
    ing.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_epoch_or_a_reconnect_triggers_hellos_and_full_state_requests() {
    let snap = FakeSnapshot::default();
    let srv = snap.start().await;
    let saddr = srv.addr;
    let ing = TestIngest::start(saddr, &[]).await;
    let mut w = ing.worker().await;
    w.hello("g0", 2, 3).await;
    // Wait for the link (acks turn OK), then a first batch acked with the first epoch.
    let mut seq = 1;
    let report_a = |seq: u64| progress(seq, false, &[("a", 1, seq as u32, false)]);
    call_until(&mut w, &mut seq, "acks turn OK", report_a, |a| {
        status(a) == v1::AckStatus::Ok && !a.full_state_requested
    })
    .await;
    snap.wait_for("a batch", |s| !s.progress_of("a").is_empty())
        .await;
    let hellos = snap.hellos_of(2);

    // The snapshot service now answers with another epoch (it restarted behind a proxy).
    snap.set_epoch(2222);
    call_until(
        &mut w,
        &mut seq,
        "a new epoch asks the workers for a full state",
        report_a,
        |a| a.full_state_requested,
    )
    .await;
    snap.wait_for("the Hello re-sent", |s| s.hellos_of(2) > hellos)
        .await;

    // The Apply stream breaks: after the reconnect, Hello again and full state again.
    let streams = snap.apply_streams();
    let hellos = snap.hellos_of(2);
    snap.kill_streams();
    eventually(WAIT, "a new Apply stream", || async {
        snap.apply_streams() > streams
    })
    .await;
    snap.wait_for("the Hello re-sent after reconnect", |s| {
        s.hellos_of(2) > hellos
    })
    .await;
    call_until(
        &mut w,
        &mut seq,
        "a reconnect asks the workers for a full state",
        heartbeat,
        |a| a.full_state_requested,
    )
    .await;
    ing.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_snapshot_never_blocks_workers_and_the_buffer_is_bounded() {
    let snap = FakeSnapshot::default();
    let srv = snap.start().await;
    let saddr = srv.addr;
    let ing = TestIngest::start(saddr, &["--max-buffered", "200", "--batch-interval", "1ms"]).await;
    let mut w = ing.worker().await;
    w.hello("g0", 6, 1).await;
    eventually(WAIT, "connected", || async {
        ing.metric("balanceroute_ingest_snapshot_connected", &[])
            .await
            == 1.0
    })
    .await;
    snap.stall(true);
    // 600 messages of 64 new requests each: every one is acked while nothing is applied.
    // Once changes are dropped the worker is asked for its full state, on whichever ack comes
    // next: one of these, or the heartbeat after them (it depends on when the forwarder's
    // buffer overflows, which the test does not control).
    let mut ids = Vec::new();
    let mut asked_full_state = false;
    for seq in 1..=600u64 {
        ids.clear();
        for i in 0..64 {
            ids.push(format!("r{seq}-{i}"));
        }
        let ups: Vec<(&str, u32, u32, bool)> =
            ids.iter().map(|id| (id.as_str(), 1, 1, false)).collect();
        w.send(progress(seq, false, &ups)).await;
        let a = w.ack().await;
        assert_eq!(a.seq, seq);
        assert_ne!(status(&a), v1::AckStatus::Rejected);
        asked_full_state |= a.full_state_requested;
    }
    // The forwarder counts what it drops as it drops it; the counter may trail the acks.
    eventually(WAIT, "changes dropped", || async {
        ing.metric("balanceroute_ingest_dropped_changes_total", &[])
            .await
            > 0.0
    })
    .await;
    let buffered = ing
        .metric("balanceroute_ingest_buffered_changes", &[])
        .await;
    assert!(buffered <= 200.0 + 4.0 * 4096.0, "bounded: {buffered}");
    // The affected worker is asked for a full state.
    let a = w.call(heartbeat(601)).await;
    asked_full_state |= a.full_state_requested;
    assert!(
        asked_full_state,
        "never asked for a full state; last ack {a:?}"
    );
    snap.stall(false);
    snap.wait_for("batches flow again", |s| s.batches().len() > 1)
        .await;
    ing.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_export_every_contract_name() {
    let snap = FakeSnapshot::default();
    let srv = snap.start().await;
    let saddr = srv.addr;
    let ing = TestIngest::start(saddr, &[]).await;
    // Every name under `# ingest`, with the contract's type and one label set per family.
    let names = ing.metrics().await.assert_contract("ingest");
    assert!(names.len() >= 7, "{names:?}");
    ing.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_streams_with_unavailable() {
    let snap = FakeSnapshot::default();
    let srv = snap.start().await;
    let saddr = srv.addr;
    let ing = TestIngest::start(saddr, &[]).await;
    let mut w = ing.worker().await;
    w.hello("g0", 1, 1).await;
    let TestIngest {
        shutdown, running, ..
    } = ing;
    shutdown.cancel();
    assert_eq!(code(w.next().await), tonic::Code::Unavailable);
    within(WAIT, "ingest stops", running.unwrap().wait())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reporter_feeds_the_snapshot_side_through_ingest() {
    use br_client::reporter::{Reporter, ReporterConfig, ReporterTuning};
    let snap = FakeSnapshot::default();
    let srv = snap.start().await;
    let saddr = srv.addr;
    let ing = TestIngest::start(saddr, &[]).await;
    let cfg = ReporterConfig::new(format!("http://{}", ing.grpc), "g9", 7, 32);
    let tuning = ReporterTuning {
        flush_interval: Duration::from_millis(2),
        ..ReporterTuning::default()
    };
    let h = Reporter::spawn_tuned(cfg, tuning).unwrap();
    for j in 0..=200 {
        h.progress("r1", 50, j, j == 200).unwrap();
        h.progress("r2", 60, j / 2, false).unwrap();
    }
    snap.wait_for("r1 finished and r2 at 100", |s| {
        s.progress_of("r1")
            .iter()
            .any(|p| p.finished && p.generated_tokens == 200)
            && s.progress_of("r2")
                .iter()
                .any(|p| p.generated_tokens == 100)
    })
    .await;
    assert!(snap.hellos_of(7) >= 1);
    // r1 is forgotten once acked; the next full state lists only r2.
    eventually(WAIT, "r1 forgotten", || async { h.stats().pending == 1 }).await;
    h.shutdown().await;
    snap.wait_for("the disconnect", |s| {
        s.changes()
            .iter()
            .any(|(_, k)| matches!(k, TcKind::WorkerDisconnected(d) if d.worker_id == 7))
    })
    .await;
    ing.stop().await;
}
