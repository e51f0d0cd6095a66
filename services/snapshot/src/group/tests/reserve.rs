//! Reserve, Release and the reservations' TTL.
use super::*;

#[test]
fn on_arrival_reservations_queue_past_capacity_pooled_ones_do_not() {
    let (mut g, now) = group();
    g.apply_msgs(1, vec![hello(0, 10, 1)], S1, now, 0);
    let (acc, _) = g.reserve_msgs(vec![res("a", 0, 10, 100)], now);
    assert_eq!(acc.len(), 1);
    // the worker is full: a pooled policy's reservation is refused ...
    let (_, rej) = g.reserve_msgs(vec![res("b", 0, 10, 50)], now);
    assert_eq!(R::try_from(rej[0].reason).unwrap(), R::WorkerFull);
    // ... an on-arrival policy's is accepted: the request waits in the rank's queue
    let queued = ValidReservation {
        queue_if_full: true,
        ..res("c", 0, 10, 50)
    };
    let (acc, rej) = g.reserve_msgs(vec![queued], now);
    assert_eq!((acc, rej.len()), (vec!["c".to_string()], 0));
    assert_eq!(load(&g, 0), 150);
}

/// A reservation's output-length hints enter σ with it, and stay when its worker reports it
/// running (so every watcher's replica holds them for the running request too).
#[test]
fn a_reservations_hints_stay_with_the_request() {
    let (mut g, now) = group();
    g.apply_msgs(1, vec![hello(0, 10, 4)], S1, now, 0);
    let hinted = ValidReservation {
        max_tokens: Some(500),
        expected_output_tokens: Some(300),
        request_class_id: Some(42),
        ..res("h", 0, 10, 100)
    };
    let (acc, _) = g.reserve_msgs(vec![hinted, res("p", 0, 10, 100)], now);
    assert_eq!(acc.len(), 2);
    g.apply_msgs(2, vec![prog(0, 10, "h", 100, 5, false)], S1, now, 0);
    let h = g.sigma().request("h").unwrap();
    assert_eq!(h.phase, Phase::Running);
    assert_eq!(
        (h.hints.expected_output, h.hints.class),
        (Some(300), Some(42))
    );
    let p = g.sigma().request("p").unwrap();
    assert_eq!((p.hints.expected_output, p.hints.class), (None, None));
}

#[test]
fn reservations_count_at_once_expire_after_the_ttl_unless_reported() {
    let (mut g, now) = group();
    g.apply_msgs(1, vec![hello(0, 10, 2), hello(1, 11, 4)], S1, now, 0);
    let (acc, rej) = g.reserve_msgs(vec![res("a", 0, 10, 100), res("b", 0, 10, 10)], now);
    assert_eq!((acc.len(), rej.len(), load(&g, 0)), (2, 0, 110));
    let v = g.version();
    // idempotent repeat: accepted, no new version
    let (acc, _) = g.reserve_msgs(vec![res("a", 0, 10, 100)], now);
    assert_eq!((acc, g.version()), (vec!["a".to_string()], v));
    let (_, rej) = g.reserve_msgs(
        vec![
            res("c", 0, 10, 1),   // full (2 of 2)
            res("a", 1, 11, 1),   // on another worker
            res("d", 5, 1, 1),    // unknown worker
            res("e", 1, 99, 1),   // stale incarnation
            res("f", 4000, 1, 1), // above the core's limit
        ],
        now,
    );
    let got: Vec<R> = rej.iter().map(|r| R::try_from(r.reason).unwrap()).collect();
    assert_eq!(
        got,
        vec![
            R::WorkerFull,
            R::Duplicate,
            R::UnknownWorker,
            R::StaleIncarnation,
            R::UnknownWorker
        ]
    );
    assert_eq!(g.version(), v);
    // "b" gets telemetry: it stays; "a" expires at the TTL
    g.apply_msgs(2, vec![prog(0, 10, "b", 10, 1, false)], S1, now, 0);
    g.tick(now + Duration::from_secs(9));
    assert!(g.sigma().request("a").is_some());
    g.tick(now + Duration::from_secs(10));
    assert!(g.sigma().request("a").is_none());
    assert!(g.sigma().request("b").is_some());
    assert_eq!(load(&g, 0), 11);
    assert_eq!(g.metrics.expired.get(), 1);
    // release: only reserved ones
    g.reserve_msgs(vec![res("x", 1, 11, 5)], now);
    let released = g.release(
        &[
            RequestId::new("x").unwrap(),
            RequestId::new("b").unwrap(),
            RequestId::new("nope").unwrap(),
        ],
        now,
    );
    assert_eq!(released.released, 1);
    assert!(g.sigma().request("b").is_some());
}

/// The request-id rule through the group (br_sigma::unkeyed): an unkeyed report takes the
/// oldest reservation; a Release of the taken id (the gateway's Cancel) hands its place on to
/// the next oldest; a keyed report of a taken id does the same. Each request counted once.
#[test]
fn unkeyed_reports_take_reservations_and_taken_ids_hand_them_on() {
    let (mut g, now) = group();
    let unkeyed = |id: &str, p: u32, generated: u32| {
        let mut c = prog(0, 10, id, p, generated, false);
        if let Some(tc::Kind::RequestProgress(rp)) = c.kind.as_mut() {
            rp.unkeyed = true;
        }
        c
    };
    g.apply_msgs(1, vec![hello(0, 10, 8)], S1, now, 0);
    let (acc, _) = g.reserve_msgs(
        vec![
            res("r1", 0, 10, 100),
            res("r2", 0, 10, 200),
            res("r3", 0, 10, 300),
        ],
        now,
    );
    assert_eq!(acc.len(), 3);
    assert_eq!(load(&g, 0), 600);
    // cmpl-a (really r3's, say) takes r1, the oldest: its prompt (0 = not known yet) is r1's
    let ack = g.apply_msgs(2, vec![unkeyed("cmpl-a", 0, 2)], S1, now, 0);
    assert!(ack.rejected.is_empty(), "{ack:?}");
    assert!(g.sigma().request("r1").is_none());
    let a = g.sigma().request("cmpl-a").unwrap();
    assert_eq!(
        (a.prompt_tokens, a.generated_tokens, a.phase),
        (100, 2, Phase::Running)
    );
    assert_eq!(
        a.prompt_hash,
        Some(1),
        "the reservation's hash goes with it"
    );
    assert_eq!(load(&g, 0), 102 + 200 + 300, "counted once");
    // the gateway cancels r1: its place was taken, so r2 (the oldest left) is released
    let released = g.release(&[RequestId::new("r1").unwrap()], now);
    assert_eq!(released.released, 1);
    assert!(g.sigma().request("r2").is_none());
    assert_eq!(load(&g, 0), 102 + 300);
    // r2 shows up keyed after all: r3 (the last reservation) makes room for it
    g.apply_msgs(3, vec![prog(0, 10, "r2", 200, 1, false)], S1, now, 0);
    assert!(g.sigma().request("r3").is_none());
    assert_eq!(load(&g, 0), 102 + 201);
    // no reservation left: an unkeyed request is new load
    g.apply_msgs(4, vec![unkeyed("cmpl-b", 50, 1)], S1, now, 0);
    assert_eq!(load(&g, 0), 102 + 201 + 51);
    let m = &g.metrics;
    assert_eq!(
        (
            m.unkeyed_matched.get(),
            m.unkeyed_unmatched.get(),
            m.unkeyed_handed_on.get()
        ),
        (1, 1, 2)
    );
}
