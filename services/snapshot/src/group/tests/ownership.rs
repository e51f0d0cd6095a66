//! A worker reports only its own requests: a report naming a request σ holds under another
//! worker (RESERVED or ACTIVE) is refused NOT_OWNER, whatever it says (progress, start,
//! finish, a full state), and changes nothing; the owner's own reports still apply.
use super::*;

fn held(g: &Group, id: &str) -> Option<(u32, Phase, u32)> {
    g.sigma()
        .request(id)
        .map(|r| (r.worker, r.phase, r.generated_tokens))
}

#[test]
fn another_workers_requests_are_refused_and_sigma_keeps_them() {
    let (mut g, now) = group();
    g.apply_msgs(1, vec![hello(0, 10, 8), hello(1, 11, 8)], S1, now, 0);
    g.reserve_msgs(
        vec![res("active", 1, 11, 30), res("reserved", 1, 11, 40)],
        now,
    );
    g.apply_msgs(
        2,
        vec![
            prog(1, 11, "active", 30, 3, false),
            prog(1, 11, "own", 20, 2, false),
        ],
        S1,
        now,
        0,
    );
    let before = g.snapshot();

    // Worker 0 names each of worker 1's requests: more tokens of the ACTIVE one, a start of
    // the RESERVED one, a finish of the one worker 1 runs unreserved, then a full state that
    // lists them all.
    let ack = g.apply_msgs(
        3,
        vec![
            prog(0, 10, "active", 30, 50, false),
            prog(0, 10, "reserved", 99, 0, false),
            prog(0, 10, "own", 20, 2, true),
            sync(0, 10, &["active", "reserved", "own"]),
        ],
        S1,
        now,
        0,
    );
    assert_eq!(
        reasons(&ack),
        vec![(0, R::NotOwner), (1, R::NotOwner), (2, R::NotOwner)]
    );
    assert!(
        ack.rejected[0].detail.contains("belongs to worker 1"),
        "{:?}",
        ack.rejected[0]
    );
    assert_eq!(ack.version, before.version, "nothing changed");
    assert_eq!(g.snapshot(), before);

    // The same lie through another Apply stream (another ingest replica) changes nothing
    // either.
    let ack = g.apply_msgs(1, vec![prog(0, 10, "reserved", 1, 1, false)], S2, now, 0);
    assert_eq!(reasons(&ack), vec![(0, R::NotOwner)]);
    assert_eq!(g.snapshot(), before);

    // Worker 1's full state is what σ then holds: its reservation stays RESERVED (unlisted
    // reservations wait for their TTL), its running requests move on.
    g.apply_msgs(
        4,
        vec![
            prog(1, 11, "active", 30, 5, false),
            prog(1, 11, "own", 20, 4, false),
            sync(1, 11, &["active", "own"]),
        ],
        S1,
        now,
        0,
    );
    assert_eq!(held(&g, "active"), Some((1, Phase::Running, 5)));
    assert_eq!(held(&g, "own"), Some((1, Phase::Running, 4)));
    assert_eq!(held(&g, "reserved"), Some((1, Phase::Queued, 0)));
    assert_eq!(load(&g, 0), 0);
    assert_eq!(load(&g, 1), 35 + 24 + 40);
}

#[test]
fn a_request_sent_to_another_rank_counts_where_reserved_until_its_ttl() {
    // The gateway reserved "r" on worker 1 and sent it to worker 0: worker 0's reports are
    // refused while the reservation holds (it is worker 1's), and once it expires the next
    // report makes "r" worker 0's own.
    let (mut g, now) = group();
    g.apply_msgs(1, vec![hello(0, 10, 8), hello(1, 11, 8)], S1, now, 0);
    g.reserve_msgs(vec![res("r", 1, 11, 30)], now);
    let ack = g.apply_msgs(2, vec![prog(0, 10, "r", 30, 4, false)], S1, now, 0);
    assert_eq!(reasons(&ack), vec![(0, R::NotOwner)]);
    assert_eq!(held(&g, "r"), Some((1, Phase::Queued, 0)));
    let later = now + settings().reservation_ttl;
    g.tick(later);
    assert_eq!(held(&g, "r"), None, "the reservation expired");
    let ack = g.apply_msgs(3, vec![prog(0, 10, "r", 30, 9, false)], S1, later, 0);
    assert!(ack.rejected.is_empty(), "{ack:?}");
    assert_eq!(held(&g, "r"), Some((0, Phase::Running, 9)));
    // and it is now worker 0's: worker 1 may not name it
    let ack = g.apply_msgs(4, vec![prog(1, 11, "r", 30, 9, true)], S1, later, 0);
    assert_eq!(reasons(&ack), vec![(0, R::NotOwner)]);
}

#[test]
fn a_restart_and_the_owners_reports_still_apply() {
    // A new incarnation of a worker starts clean (its old requests leave σ with the old
    // incarnation), so its requests are its own again; the check is by worker, not by
    // incarnation.
    let (mut g, now) = group();
    g.apply_msgs(1, vec![hello(0, 10, 8), hello(1, 11, 8)], S1, now, 0);
    g.reserve_msgs(vec![res("a", 1, 11, 30)], now);
    g.apply_msgs(2, vec![prog(1, 11, "a", 30, 3, false)], S1, now, 0);
    g.apply_msgs(3, vec![hello(1, 12, 8)], S1, now, 0);
    assert_eq!(
        held(&g, "a"),
        None,
        "the restart dropped the old incarnation's requests"
    );
    let ack = g.apply_msgs(4, vec![prog(1, 12, "a", 30, 3, false)], S1, now, 0);
    assert!(ack.rejected.is_empty(), "{ack:?}");
    assert_eq!(held(&g, "a"), Some((1, Phase::Running, 3)));
    // worker 0 restarting changes nothing about worker 1's requests
    g.apply_msgs(5, vec![hello(0, 13, 8)], S1, now, 0);
    let ack = g.apply_msgs(6, vec![prog(0, 13, "a", 30, 7, false)], S1, now, 0);
    assert_eq!(reasons(&ack), vec![(0, R::NotOwner)]);
    assert_eq!(held(&g, "a"), Some((1, Phase::Running, 3)));
}

#[test]
fn only_the_worker_whose_reservation_was_taken_hands_its_place_on() {
    // Worker 1's unkeyed request takes its oldest reservation ("a"); worker 0 then names "a"
    // by its id. Handing "a"'s place on would release "b", worker 1's other reservation: it
    // stays, and "a" is worker 0's own new request.
    let unkeyed = |w: u32, inc: u64, id: &str| {
        tc(tc::Kind::RequestProgress(tc::RequestProgress {
            worker_id: w,
            incarnation: inc,
            request_id: id.into(),
            prompt_tokens: 30,
            generated_tokens: 1,
            finished: false,
            unkeyed: true,
        }))
    };
    let (mut g, now) = group();
    g.apply_msgs(1, vec![hello(0, 10, 8), hello(1, 11, 8)], S1, now, 0);
    g.reserve_msgs(vec![res("a", 1, 11, 30)], now);
    g.reserve_msgs(vec![res("b", 1, 11, 40)], now);
    g.apply_msgs(2, vec![unkeyed(1, 11, "u")], S1, now, 0);
    assert_eq!(held(&g, "a"), None, "u took a's reservation");
    let ack = g.apply_msgs(3, vec![prog(0, 10, "a", 30, 2, false)], S1, now, 0);
    assert!(ack.rejected.is_empty(), "{ack:?}");
    assert_eq!(
        held(&g, "b"),
        Some((1, Phase::Queued, 0)),
        "b stays reserved"
    );
    assert_eq!(held(&g, "a"), Some((0, Phase::Running, 2)));
    // worker 1 naming "a" itself would have handed the place on; it is worker 0's now
    let ack = g.apply_msgs(4, vec![prog(1, 11, "a", 30, 2, false)], S1, now, 0);
    assert_eq!(reasons(&ack), vec![(0, R::NotOwner)]);
}
