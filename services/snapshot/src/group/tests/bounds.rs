//! What a peer can make σ hold: requests per worker (capacity plus the margin), requests per
//! group, tokens per request, generated tokens against max_tokens.
use super::*;

fn bounded(over_capacity: u32, per_group: usize) -> (Group, Instant) {
    group_with(Settings {
        requests: RequestBound {
            over_capacity,
            per_group,
        },
        ..settings()
    })
}

fn requests_on(g: &Group, w: u32) -> u32 {
    g.sigma().cluster().worker(w).unwrap().requests()
}

#[test]
fn a_worker_holds_at_most_its_capacity_plus_the_margin_and_the_rest_of_the_batch_applies() {
    let (mut g, now) = bounded(3, 1_000);
    g.apply_msgs(1, vec![hello(0, 10, 4), hello(1, 11, 4)], S1, now, 0);
    // A direct Apply reporting 20 requests on a capacity-4 worker, then one on another worker.
    let mut changes: Vec<_> = (0..20)
        .map(|i| prog(0, 10, &format!("r{i}"), 10, 1, false))
        .collect();
    changes.push(prog(1, 11, "other", 10, 1, false));
    let ack = g.apply_msgs(2, changes, S1, now, 0);
    // The first 4 + 3 are kept, in order; the other 13 are refused WORKER_FULL by index.
    let refused: Vec<(u32, R)> = (7..20).map(|i| (i, R::WorkerFull)).collect();
    assert_eq!(reasons(&ack), refused);
    assert!(
        ack.rejected[0].detail.contains("at most 7"),
        "{:?}",
        ack.rejected[0]
    );
    assert_eq!(requests_on(&g, 0), 7);
    assert!(g.sigma().request("r6").is_some() && g.sigma().request("r7").is_none());
    assert_eq!(
        requests_on(&g, 1),
        1,
        "the change after the refused ones applied"
    );
    // Progress of a request already held is not a new one: still accepted at the bound.
    let ack = g.apply_msgs(3, vec![prog(0, 10, "r0", 10, 5, false)], S1, now, 0);
    assert!(ack.rejected.is_empty());
    // Another worker's request does not move onto it (nor onto any worker: it is worker 1's,
    // docs/design/0013-request-ownership.md).
    let ack = g.apply_msgs(4, vec![prog(0, 10, "other", 10, 2, false)], S1, now, 0);
    assert_eq!(reasons(&ack), vec![(0, R::NotOwner)]);
    assert_eq!(requests_on(&g, 1), 1);
    // On-arrival reservations queue past the capacity, up to the same bound.
    let queued = |id: &str| ValidReservation {
        queue_if_full: true,
        ..res(id, 0, 10, 5)
    };
    let (_, rej) = g.reserve_msgs(vec![queued("q")], now);
    assert_eq!(R::try_from(rej[0].reason).unwrap(), R::WorkerFull);
    // A finished request makes room.
    g.apply_msgs(5, vec![prog(0, 10, "r0", 10, 5, true)], S1, now, 0);
    let (acc, _) = g.reserve_msgs(vec![queued("q")], now);
    assert_eq!(acc, vec!["q".to_string()]);
    assert_eq!(requests_on(&g, 0), 7);
}

#[test]
fn a_group_holds_at_most_its_request_bound() {
    let (mut g, now) = bounded(1_000, 5);
    g.apply_msgs(1, vec![hello(0, 10, 4), hello(1, 11, 4)], S1, now, 0);
    let changes: Vec<_> = (0..8)
        .map(|i| prog(i % 2, 10 + u64::from(i % 2), &format!("r{i}"), 10, 1, false))
        .collect();
    let ack = g.apply_msgs(2, changes, S1, now, 0);
    assert_eq!(
        reasons(&ack),
        vec![(5, R::WorkerFull), (6, R::WorkerFull), (7, R::WorkerFull)]
    );
    assert!(ack.rejected[0].detail.contains("group holds 5"));
    assert_eq!(g.sigma().request_count(), 5);
}

#[test]
fn one_request_holds_at_most_one_context_window_of_tokens() {
    let (mut g, now) = group();
    g.apply_msgs(1, vec![hello(0, 10, 4)], S1, now, 0);
    let max = limits::MAX_TOKENS;
    // Each count within the wire's limit, 20M together: refused, σ unchanged.
    let ack = g.apply_msgs(2, vec![prog(0, 10, "big", max, max, false)], S1, now, 0);
    assert_eq!(reasons(&ack), vec![(0, R::Invalid)]);
    assert!(
        ack.rejected[0]
            .detail
            .contains("prompt_tokens + generated_tokens")
    );
    assert!(g.sigma().request("big").is_none());
    // Up to the bound is fine, and a later report may not push it over.
    let ack = g.apply_msgs(3, vec![prog(0, 10, "big", max - 10, 10, false)], S1, now, 0);
    assert!(ack.rejected.is_empty());
    let ack = g.apply_msgs(4, vec![prog(0, 10, "big", 0, 11, false)], S1, now, 0);
    assert_eq!(reasons(&ack), vec![(0, R::Invalid)]);
    assert_eq!(g.sigma().request("big").unwrap().generated_tokens, 10);
}

#[test]
fn generated_tokens_above_the_reservations_max_tokens_are_refused() {
    let (mut g, now) = group();
    g.apply_msgs(1, vec![hello(0, 10, 4)], S1, now, 0);
    let capped = ValidReservation {
        max_tokens: Some(16),
        ..res("a", 0, 10, 100)
    };
    let (acc, _) = g.reserve_msgs(vec![capped], now);
    assert_eq!(acc.len(), 1);
    let ack = g.apply_msgs(2, vec![prog(0, 10, "a", 100, 16, false)], S1, now, 0);
    assert!(ack.rejected.is_empty());
    let ack = g.apply_msgs(3, vec![prog(0, 10, "a", 100, 5_000, false)], S1, now, 0);
    assert_eq!(reasons(&ack), vec![(0, R::Invalid)]);
    assert!(
        ack.rejected[0].detail.contains("max_tokens 16"),
        "{:?}",
        ack.rejected
    );
    assert_eq!(g.sigma().request("a").unwrap().generated_tokens, 16);
    // Its end still takes it out of σ.
    g.apply_msgs(4, vec![prog(0, 10, "a", 100, 5_000, true)], S1, now, 0);
    assert!(g.sigma().request("a").is_none());
}
