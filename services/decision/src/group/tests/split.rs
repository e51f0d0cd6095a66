//! The rank split (`--deciders K --decider-index i`): a replica places only on its own ranks
//! until another's rank has shown free slots for the takeover time.

use super::*;
use crate::group::RankSplit;

const TAKEOVER: Duration = Duration::from_millis(100);

fn split_cfg(k: u32, i: u32) -> GroupConfig {
    GroupConfig {
        split: RankSplit::new(k, i, TAKEOVER).unwrap(),
        ..GroupConfig::default()
    }
}

/// How long a worker σ shows back takes to report what it holds (`--recommit-settle`).
fn settle() -> Duration {
    GroupConfig::default().recommit_settle
}

/// Replica `i` of `k` on ranks of one slot with `loads`, past its start: a rank's free time
/// starts once its reports had time to arrive after this replica first saw σ, so the tests of
/// the takeover time begin there.
fn replica(k: u32, i: u32, loads: &[u32]) -> Fx {
    let mut fx = Fx::with_cfg(PolicyKind::Br0, loads, 1, split_cfg(k, i));
    fx.advance(settle());
    fx
}

/// Advances the clock in steps of `step` until `done` (called after each step) returns
/// Some, which it must within `limit`: the time that took, and what `done` returned.
fn steps_until<T>(
    fx: &mut Fx,
    step: Duration,
    limit: Duration,
    mut done: impl FnMut(&mut Fx) -> Option<T>,
) -> (Duration, T) {
    let from = fx.now;
    loop {
        fx.advance(step);
        if let Some(t) = done(fx) {
            return (fx.now - from, t);
        }
        assert!(fx.now - from <= limit, "not done within {limit:?}");
    }
}

/// Ticks in steps of `step` until `rx` is answered (it must be, within `limit`): the time that
/// took, and the answer.
fn ticks_until_answered(
    fx: &mut Fx,
    rx: &mut Rx,
    step: Duration,
    limit: Duration,
) -> (Duration, Assignment) {
    let answered = |rx: &mut Rx| match rx.try_recv() {
        Ok(answer) => Some(answer.expect("ok")),
        Err(TryRecvError::Empty) => None,
        Err(TryRecvError::Closed) => panic!("the caller's channel closed"),
    };
    if let Some(a) = answered(rx) {
        return (Duration::ZERO, a);
    }
    steps_until(fx, step, limit, |fx| {
        fx.tick_and_commit(true);
        answered(rx)
    })
}

#[test]
fn a_replica_places_on_its_own_ranks_and_takes_over_ranks_left_free() {
    // 4 ranks of one slot; replica 1 of 2 owns ranks 1 and 3
    let mut fx = replica(2, 1, &[0, 0, 0, 0]);
    let mut rxs: Vec<Rx> = (0..4).map(|i| fx.assign(&format!("r{i}"), 10).1).collect();
    assert_eq!(fx.tick_and_commit(true), 2);
    let mut placed: Vec<u32> = rxs[..2].iter_mut().map(|rx| answer(rx).worker).collect();
    placed.sort_unstable();
    assert_eq!(placed, vec![1, 3], "only its own ranks");
    assert!(pending(&mut rxs[2]) && pending(&mut rxs[3]));
    // ranks 0 and 2 stay free (their owner is dead): not yet...
    fx.advance(TAKEOVER / 2);
    assert_eq!(fx.tick_and_commit(true), 0);
    // ...but once they have been free for the takeover time
    fx.advance(TAKEOVER / 2);
    assert_eq!(fx.tick_and_commit(true), 2);
    let mut taken: Vec<u32> = rxs[2..].iter_mut().map(|rx| answer(rx).worker).collect();
    taken.sort_unstable();
    assert_eq!(taken, vec![0, 2], "taken over");
}

#[test]
fn two_replicas_on_one_sigma_never_pick_the_same_rank() {
    // both see the same σ and tick before seeing each other's reservations: without the
    // split both pick the emptiest ranks, with it their picks are disjoint
    for (split, disjoint) in [(true, true), (false, false)] {
        let cfg = |i| {
            if split {
                split_cfg(2, i)
            } else {
                GroupConfig::default()
            }
        };
        let loads = [0, 0, 0, 0, 0, 0];
        let mut a = Fx::with_cfg(PolicyKind::Br0, &loads, 1, cfg(0));
        let mut b = Fx::with_cfg(PolicyKind::Br0, &loads, 1, cfg(1));
        let mut picks = Vec::new();
        for (name, fx) in [("a", &mut a), ("b", &mut b)] {
            let rxs: Vec<Rx> = (0..3)
                .map(|i| fx.assign(&format!("{name}{i}"), 10).1)
                .collect();
            fx.tick_and_commit(true);
            for mut rx in rxs {
                picks.push(answer(&mut rx).worker);
            }
        }
        let mut unique = picks.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(
            unique.len() == picks.len(),
            disjoint,
            "split {split}: {picks:?}"
        );
    }
}

#[test]
fn a_rank_free_longer_than_the_takeover_through_an_idle_spell_is_open_at_once() {
    // replica 1 of 2 owns ranks 1 and 3, both full; ranks 0 and 2 have been free since σ came
    // (their owner is gone)
    let mut fx = replica(2, 1, &[0, 1, 0, 1]);
    // an idle spell: timer ticks with nothing to place
    for _ in 0..3 {
        fx.advance(TAKEOVER / 2);
        assert_eq!(fx.tick_and_commit(true), 0);
    }
    // the first request after it: the slots have waited longer than the takeover
    let (_, mut rx) = fx.assign("r", 10);
    assert_eq!(fx.tick_and_commit(true), 1, "taken over at the first tick");
    let worker = answer(&mut rx).worker;
    assert!(worker == 0 || worker == 2, "on rank {worker}");
}

#[test]
fn a_rank_its_owner_filled_and_freed_while_idle_waits_the_takeover_from_its_freeing() {
    let mut fx = replica(2, 1, &[0, 1, 0, 1]);
    // while this replica has nothing to place, rank 0's owner fills it and its request ends
    fx.advance(TAKEOVER / 2);
    fx.core.tick(fx.now);
    fx.sigma_change(vec![change::request_progress("own0", 0, 100, 10, 0)]);
    fx.advance(TAKEOVER);
    fx.core.tick(fx.now);
    fx.sigma_change(vec![change::request_finished("own0", 5)]);
    // rank 2 has been free since σ came, rank 0 only for half the takeover
    fx.advance(TAKEOVER / 2);
    let rxs: Vec<Rx> = (0..2).map(|i| fx.assign(&format!("r{i}"), 10).1).collect();
    assert_eq!(fx.tick_and_commit(true), 1, "only rank 2 is open");
    let mut placed: Vec<u32> = rxs
        .into_iter()
        .filter_map(|mut rx| rx.try_recv().ok().map(|a| a.unwrap().worker))
        .collect();
    placed.sort_unstable();
    assert_eq!(placed, vec![2]);
    // rank 0 opens once it has been free for the takeover
    fx.advance(TAKEOVER / 2);
    assert_eq!(fx.tick_and_commit(true), 1, "rank 0 is open now");
}

#[test]
fn no_takeover_while_sigma_is_stale_and_the_clock_starts_again_when_it_is_back() {
    // replica 1 of 2 owns ranks 1 and 3, both full; ranks 0 and 2 have been free in σ since it
    // came. Then the snapshot service goes away: the owner of ranks 0 and 2 places on them from
    // its own (stale) view, where this replica cannot see it.
    let mut fx = replica(2, 1, &[0, 1, 0, 1]);
    fx.advance(TAKEOVER / 2);
    fx.core.on_disconnected(fx.now, fx.now);
    let (_, mut rx) = fx.assign("r", 10);
    // long past the takeover time: a σ frozen by the outage shows nothing of the slots' age
    for _ in 0..6 {
        fx.advance(TAKEOVER / 2);
        fx.core.tick(fx.now);
        assert!(fx.core.take_reserve(fx.now).is_none());
        assert!(pending(&mut rx), "taken over while σ is stale");
    }
    // back: the clock counts from the moment σ is current again and the ranks' reports of
    // the outage had time to arrive, not from before the outage
    fx.core.on_connected(fx.now);
    let (waited, a) = ticks_until_answered(&mut fx, &mut rx, TAKEOVER / 4, 4 * settle());
    assert_eq!(
        waited,
        settle() + TAKEOVER,
        "open once free for the takeover time"
    );
    assert!(a.worker == 0 || a.worker == 2, "on rank {}", a.worker);
}

#[test]
fn a_fresh_snapshot_starts_the_clock_again() {
    // a resubscription answered with a snapshot (the deltas since were gone) follows a spell
    // in which this replica saw nothing of the slots
    let mut fx = replica(2, 1, &[0, 1, 0, 1]);
    fx.advance(TAKEOVER * 2);
    fx.core.set_sigma(fx.writer.clone(), fx.now);
    let (_, mut rx) = fx.assign("r", 10);
    let (waited, a) = ticks_until_answered(&mut fx, &mut rx, TAKEOVER / 4, 4 * settle());
    assert_eq!(
        waited, TAKEOVER,
        "taken over on a clock from before the snapshot"
    );
    assert!(a.worker == 0 || a.worker == 2, "on rank {}", a.worker);
}

#[test]
fn after_a_restart_of_the_snapshot_service_a_rank_waits_for_its_reports() {
    // replica 1 of 2 owns ranks 1 and 3, both full. The snapshot service restarts; its new σ
    // shows every worker back, ranks 1 and 3 with their reports, ranks 0 and 2 not yet: they
    // look empty, though their owner may have placed on them through the outage, and those
    // placements show only once the workers report them (within `--recommit-settle`).
    let mut fx = replica(2, 1, &[0, 1, 0, 1]);
    fx.core.on_disconnected(fx.now, fx.now);
    fx.advance(TAKEOVER);
    fx.core.on_connected(fx.now);
    let mut fresh = Sigma::with_epoch("g", EPOCH + 1);
    let mut b = fresh.batch();
    for w in 0..4u32 {
        let inc = 100 + u64::from(w);
        b.apply(change::worker_up(w, inc, 1, &format!("http://w{w}")))
            .unwrap();
        if w % 2 == 1 {
            b.apply(change::request_progress(&format!("bg{w}"), w, inc, 1, 0))
                .unwrap();
        }
    }
    b.commit();
    fx.core.set_sigma(fresh, fx.now);
    let st = fx.core.stats();
    assert!(!st.stale && st.awaited == 0, "every worker is back: {st:?}");
    // ranks 0 and 2 report nothing (their owner placed nothing after all): they open once
    // their reports had time to arrive, plus the takeover time
    let (_, mut rx) = fx.assign("r", 10);
    fx.core.tick(fx.now);
    let job = fx.core.take_reserve(fx.now);
    assert!(job.is_none(), "placed on a full rank of its own");
    let (waited, worker) = steps_until(&mut fx, TAKEOVER / 4, 4 * settle(), |fx| {
        fx.core.tick(fx.now);
        Some(fx.core.take_reserve(fx.now)?.reservations[0].worker)
    });
    assert!(worker == 0 || worker == 2, "on rank {worker}");
    assert_eq!(
        waited,
        settle() + TAKEOVER,
        "taken over before the ranks' reports could arrive"
    );
    assert!(pending(&mut rx));
}
