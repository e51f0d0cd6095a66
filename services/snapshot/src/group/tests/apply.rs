//! Telemetry into σ: rejections by index, max() progress, finish and sync, suspect and fenced
//! workers, ended streams.
use super::*;

#[test]
fn a_batch_is_one_version_and_bad_changes_are_rejected_one_by_one() {
    let (mut g, now) = group();
    let ack = g.apply_msgs(
        1,
        vec![
            hello(0, 10, 4),
            hello(1, 11, 4),
            prog(0, 10, "a", 100, 5, false),
            v1::TelemetryChange { kind: None },
            hello(MAX_WORKER_ID + 1, 1, 1),
            hello(2, 0, 1),
            hello(2, 1, 0),
            prog(5, 1, "b", 1, 1, false),
            prog(0, 99, "b", 1, 1, false),
            prog(0, 10, "a", 100, 6, false),
            prog(0, 10, &"x".repeat(257), 1, 1, false),
            prog(0, 10, "c", limits::MAX_TOKENS + 1, 1, false),
            sync(7, 1, &[]),
        ],
        S1,
        now,
        0,
    );
    assert_eq!((ack.batch_seq, ack.epoch, ack.version), (1, 77, 1));
    assert_eq!(
        reasons(&ack),
        vec![
            (3, R::Invalid),
            (4, R::Invalid),
            (5, R::Invalid),
            (6, R::Invalid),
            (7, R::UnknownWorker),
            (8, R::StaleIncarnation),
            (9, R::Duplicate),
            (10, R::Invalid),
            (11, R::Invalid),
            (12, R::UnknownWorker),
        ]
    );
    assert_eq!(load(&g, 0), 105);
    // a batch that changes nothing makes no version
    let before = g.snapshot();
    let ack = g.apply_msgs(
        2,
        vec![
            prog(0, 10, "a", 100, 5, false),
            prog(9, 1, "z", 1, 1, false),
        ],
        S1,
        now,
        0,
    );
    assert_eq!(ack.version, 1);
    assert_eq!(g.snapshot(), before);
}

#[test]
fn progress_takes_the_max_finish_and_sync_remove() {
    let (mut g, now) = group();
    g.apply_msgs(1, vec![hello(0, 10, 8)], S1, now, 0);
    g.reserve_msgs(vec![res("r", 0, 10, 50), res("kept", 0, 10, 7)], now);
    assert_eq!(load(&g, 0), 57);
    g.apply_msgs(
        2,
        vec![
            prog(0, 10, "r", 0, 9, false),
            prog(0, 10, "a", 20, 3, false),
        ],
        S1,
        now,
        0,
    );
    let r = g.sigma().request("r").unwrap();
    assert_eq!(
        (r.prompt_tokens, r.generated_tokens, r.phase),
        (50, 9, Phase::Running),
        "prompt 0 keeps σ's"
    );
    // reordered older report: absorbed
    g.apply_msgs(3, vec![prog(0, 10, "r", 50, 4, false)], S1, now, 0);
    assert_eq!(g.sigma().request("r").unwrap().generated_tokens, 9);
    // finished removes, with the max of the counts
    let v = g.version();
    g.apply_msgs(4, vec![prog(0, 10, "r", 50, 2, true)], S1, now, 0);
    assert_eq!(g.version(), v + 1);
    assert!(g.sigma().request("r").is_none());
    let Some(Event::Delta(d)) = g.watchers.history.back() else {
        panic!()
    };
    assert_eq!(d.changes, vec![change::request_finished("r", 9)]);
    // a full state without "a": the active one leaves, the reserved one stays
    g.apply_msgs(5, vec![sync(0, 10, &[])], S1, now, 0);
    assert!(g.sigma().request("a").is_none());
    assert!(g.sigma().request("kept").is_some());
    assert_eq!(load(&g, 0), 7);
}

#[test]
fn a_disconnected_worker_is_suspect_then_fenced_unless_it_comes_back() {
    let (mut g, now) = group();
    g.apply_msgs(
        1,
        vec![
            hello(0, 10, 4),
            hello(1, 11, 4),
            prog(0, 10, "a", 5, 1, false),
            prog(1, 11, "b", 5, 1, false),
        ],
        S1,
        now,
        0,
    );
    // ingest saw worker 0's stream end 2 s ago (its clock): 3 s of grace are left
    g.apply_msgs(2, vec![gone(0, 10, 8_000), gone(1, 11, 0)], S1, now, 10_000);
    assert_eq!(g.sigma().liveness(0), Some(Liveness::Suspect));
    assert_eq!(load(&g, 0), 6, "a suspect keeps its requests");
    let (_, rej) = g.reserve_msgs(vec![res("c", 0, 10, 1)], now);
    assert_eq!(rej[0].reason, R::WorkerFenced as i32);
    // worker 1 says Hello again (same incarnation) within the grace period
    g.apply_msgs(
        3,
        vec![hello(1, 11, 4)],
        S2,
        now + Duration::from_secs(1),
        0,
    );
    g.tick(now + Duration::from_millis(2_999));
    assert_eq!(g.sigma().liveness(0), Some(Liveness::Suspect));
    g.tick(now + Duration::from_secs(3));
    assert_eq!(g.sigma().liveness(0), Some(Liveness::Fenced));
    assert_eq!((g.sigma().request("a"), load(&g, 0)), (None, 0));
    g.tick(now + Duration::from_secs(6));
    assert_eq!(g.sigma().liveness(1), Some(Liveness::Live));
    assert!(g.sigma().request("b").is_some());
    assert_eq!(g.metrics.fenced.get(), 1);
    // fenced: telemetry rejected until a Hello; a new incarnation starts clean
    let ack = g.apply_msgs(4, vec![prog(0, 10, "a", 5, 2, false)], S1, now, 0);
    assert_eq!(reasons(&ack), vec![(0, R::WorkerFenced)]);
    g.apply_msgs(5, vec![hello(1, 12, 4)], S2, now, 0);
    assert_eq!(
        (
            g.sigma().request("b"),
            load(&g, 1),
            g.sigma().incarnation(1)
        ),
        (None, 0, Some(12))
    );
}

#[test]
fn an_ended_stream_disconnects_only_the_workers_whose_hello_it_carried() {
    let (mut g, now) = group();
    g.apply_msgs(1, vec![hello(0, 10, 4), hello(1, 11, 4)], S1, now, 0);
    // worker 1 reconnected through another ingest stream
    g.apply_msgs(1, vec![hello(1, 11, 4)], S2, now, 0);
    // a late disconnect report from the old stream does not touch it
    g.apply_msgs(2, vec![gone(1, 11, 0)], S1, now, 0);
    assert_eq!(g.sigma().liveness(1), Some(Liveness::Live));
    g.stream_ended(S1, now);
    // worker 0 lost its carrier: routable on its last state for the carrier grace (2 s)
    assert_eq!(g.sigma().liveness(0), Some(Liveness::Live));
    g.tick(now + Duration::from_millis(1_999));
    assert_eq!(g.sigma().liveness(0), Some(Liveness::Live));
    g.tick(now + Duration::from_secs(2));
    assert_eq!(g.sigma().liveness(0), Some(Liveness::Suspect));
    assert_eq!(g.sigma().liveness(1), Some(Liveness::Live));
    // then fenced when the worker grace (5 s) ends
    g.tick(now + Duration::from_millis(6_999));
    assert_eq!(g.sigma().liveness(0), Some(Liveness::Suspect));
    g.tick(now + Duration::from_secs(7));
    assert_eq!(g.sigma().liveness(0), Some(Liveness::Fenced));
    assert_eq!(g.sigma().liveness(1), Some(Liveness::Live));
    assert_eq!(
        (
            g.metrics.orphaned.get(),
            g.metrics.orphans_expired.get(),
            g.metrics.takeovers.get()
        ),
        (1, 1, 1)
    );
}

/// Applies `changes` from stream `stream` of ingest replica `carrier`, parsed as the service
/// parses them.
fn apply_via(
    g: &mut Group,
    changes: Vec<v1::TelemetryChange>,
    stream: StreamId,
    carrier: &str,
    now: Instant,
) -> Applied {
    let wire::Changes { valid, invalid } = wire::telemetry_changes(changes);
    assert!(invalid.is_empty(), "{invalid:?}");
    g.apply_from(valid, stream, carrier, now, 0, None)
}

/// The carrier's Apply stream ends (its ingest replica was killed): its worker keeps its
/// requests and stays LIVE, and its Hello through another replica takes it over with nothing
/// lost; σ publishes only the new carrier, never SUSPECT.
#[test]
fn a_worker_whose_replica_dies_stays_routable_and_is_taken_over() {
    let (mut g, now) = group();
    apply_via(
        &mut g,
        vec![hello(0, 10, 4), prog(0, 10, "a", 5, 2, false)],
        S1,
        "ingest-a",
        now,
    );
    let mut w = g.subscribe(0, 0);
    let mut events = drain(&mut w);
    let version = g.version();
    g.stream_ended(S1, now);
    assert_eq!(
        g.version(),
        version,
        "nothing to publish while the shim reconnects"
    );
    // reservations still go to it
    let (ok, rej) = g.reserve_msgs(vec![res("r", 0, 10, 7)], now + Duration::from_millis(500));
    assert_eq!((ok, rej), (vec!["r".to_owned()], vec![]));
    events.extend(drain(&mut w));
    let applied = apply_via(
        &mut g,
        vec![hello(0, 10, 4)],
        S2,
        "ingest-b",
        now + Duration::from_secs(1),
    );
    assert!(applied.rejected.is_empty(), "{applied:?}");
    events.extend(drain(&mut w));
    // past the carrier grace of the lost stream (2 s), within the reservation TTL (10 s)
    g.tick(now + Duration::from_secs(4));
    events.extend(drain(&mut w));
    let x = g.sigma().worker(0).unwrap();
    assert_eq!(
        (x.liveness, x.carrier.as_str()),
        (Liveness::Live, "ingest-b")
    );
    assert!(g.sigma().request("a").is_some() && g.sigma().request("r").is_some());
    let mut replica = None;
    follow(&mut replica, &events);
    assert_eq!(
        replica.unwrap().worker(0).unwrap().carrier,
        "ingest-b",
        "watchers see the takeover"
    );
    let suspects = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Ev::Delta(d)) => Some(d.changes.iter()),
            _ => None,
        })
        .flatten()
        .filter(|c| matches!(c.kind, Some(v1::change::Kind::WorkerSuspect(_))))
        .count();
    assert_eq!(suspects, 0);
    assert_eq!(
        (g.metrics.orphaned.get(), g.metrics.takeovers.get()),
        (1, 1)
    );
    assert_eq!(g.metrics.orphans_expired.get(), 0);
}

/// Two shims with one worker id through two replicas: the second incarnation is refused while
/// the first one's stream lives (it is never evicted), and taken once that stream is gone.
#[test]
fn another_incarnation_through_another_live_stream_is_refused() {
    let (mut g, now) = group();
    apply_via(&mut g, vec![hello(0, 10, 4)], S1, "ingest-a", now);
    let ack = g.apply_msgs(1, vec![hello(0, 99, 4)], S2, now, 0);
    assert_eq!(reasons(&ack), vec![(0, R::ConnectedElsewhere)]);
    assert!(ack.rejected[0].detail.contains("ingest-a"), "{ack:?}");
    assert_eq!(g.sigma().incarnation(0), Some(10));
    // through the same stream a new incarnation is a restart (ingest refuses duplicates itself)
    let ack = g.apply_msgs(2, vec![hello(0, 11, 4)], S1, now, 0);
    assert!(ack.rejected.is_empty(), "{ack:?}");
    assert_eq!(g.sigma().incarnation(0), Some(11));
    // once the carrier's stream is gone, another incarnation elsewhere is taken
    g.stream_ended(S1, now);
    let ack = g.apply_msgs(3, vec![hello(0, 99, 4)], S2, now, 0);
    assert!(ack.rejected.is_empty(), "{ack:?}");
    assert_eq!(g.sigma().incarnation(0), Some(99));
    // and a reported disconnect proves the old stream dead too
    g.apply_msgs(4, vec![gone(0, 99, 0)], S2, now, 0);
    let ack = g.apply_msgs(5, vec![hello(0, 7, 4)], S1, now, 0);
    assert!(ack.rejected.is_empty(), "{ack:?}");
    assert_eq!(g.sigma().incarnation(0), Some(7));
}
