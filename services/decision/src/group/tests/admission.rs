//! Arrivals, the pool, ticks and routing: how a request gets a worker.

use super::*;

#[test]
fn pooled_requests_wait_for_a_tick_and_one_reserve_per_tick() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0, 0, 0, 0], 8);
    let mut rxs: Vec<Rx> = (0..3)
        .map(|i| fx.assign(&format!("r{i}"), 100 * (i + 1)).1)
        .collect();
    assert!(
        rxs.iter_mut().all(pending),
        "nothing answered before a tick"
    );
    assert_eq!(fx.core.stats().pool, 3);
    assert!(fx.core.tick_wanted());
    fx.advance(Duration::from_millis(3));
    fx.core.tick(fx.now);
    assert_eq!(fx.core.stats().pool, 0);
    let job = fx.core.take_reserve(fx.now).expect("one Reserve");
    assert_eq!(job.reservations.len(), 3, "the whole tick in one call");
    assert!(fx.core.take_reserve(fx.now).is_none());
    assert!(
        rxs.iter_mut().all(pending),
        "not answered before Reserve returns"
    );
    let (resp, _) = fx.serve_reserve(&job);
    fx.done(&job, Ok(resp));
    let answers: Vec<_> = rxs.iter_mut().map(answer).collect();
    let mut workers: Vec<u32> = answers.iter().map(|a| a.worker).collect();
    workers.sort_unstable();
    workers.dedup();
    assert_eq!(
        workers.len(),
        3,
        "empty workers: one request each: {answers:?}"
    );
    for a in &answers {
        assert_eq!(a.policy, "br0");
        assert_eq!(a.pool_wait, Duration::from_millis(3));
        assert_eq!(a.incarnation, 100 + u64::from(a.worker));
        assert_eq!(a.endpoint, format!("http://w{}", a.worker));
        assert!(!a.stale);
    }
    let st = fx.core.stats();
    assert_eq!((st.answered, st.local, st.reserving), (3, 3, 0));
}

#[test]
fn admitted_load_is_seen_by_the_next_tick_before_sigma_shows_it() {
    // Two workers; BR-0 must not put both big requests on the same worker even though the
    // first admission is not in σ yet when the second tick runs.
    let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
    let (_, mut a) = fx.assign("a", 1000);
    fx.tick_and_commit(false);
    let (_, mut b) = fx.assign("b", 1000);
    fx.tick_and_commit(false);
    assert_ne!(answer(&mut a).worker, answer(&mut b).worker);
}

#[test]
fn own_reservations_are_dropped_once_sigma_shows_them() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
    let (_, mut a) = fx.assign("a", 500);
    fx.tick_and_commit(true);
    answer(&mut a);
    fx.core.tick(fx.now); // rebuild the view from σ
    assert_eq!(fx.core.stats().local, 0);
    let total: u64 = fx
        .core
        .view
        .cluster()
        .workers()
        .iter()
        .map(|w| w.load())
        .sum();
    assert_eq!(total, 500, "counted once");
}

#[test]
fn retries_join_the_wait_and_get_the_original_answer() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
    let (_, mut first) = fx.assign("r", 100);
    let (_, mut second) = fx.assign("r", 100);
    assert_eq!(fx.core.stats().pool, 1, "one request, two callers");
    assert_eq!(fx.core.stats().waiting_calls, 2);
    fx.tick_and_commit(false);
    let a = answer(&mut first);
    assert_eq!(answer(&mut second), a);
    let (_, mut third) = fx.assign("r", 100);
    assert_eq!(answer(&mut third), a, "after the answer: the same answer");
    let (_, mut bad) = fx.assign("r", 101);
    assert!(matches!(
        error(&mut bad),
        DecisionError::Conflict {
            first: 100,
            now: 101,
            ..
        }
    ));
    assert_eq!(fx.tick_and_commit(false), 0, "no second reservation");
}

#[test]
fn an_id_sigma_already_places_is_answered_from_sigma() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 8);
    fx.sigma_change(vec![change::request_reserved(
        "old", 1, 101, 50, None, None,
    )]);
    let (_, mut rx) = fx.assign("old", 50);
    let a = answer(&mut rx);
    assert_eq!((a.worker, a.incarnation, a.stale), (1, 101, false));
    assert_eq!(fx.tick_and_commit(false), 0, "no second reservation");
    assert_eq!(fx.core.stats().pool, 0);
}

/// The chaos run of seed 2: a gateway's calls wait in replica A's pool, A's
/// connection to the gateway freezes, and the gateway retries the same ids here, where they
/// wait too. A, still running, reserves them in σ and answers into the frozen connection. Its
/// reservations fill the workers, so the waiting copies here never get a slot: they must be
/// answered with σ's placement as soon as σ shows it, as on arrival.
#[test]
fn a_waiting_id_sigma_comes_to_place_is_answered_from_sigma() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 1);
    let (_, mut a) = fx.assign("a", 50);
    let (_, mut b) = fx.assign("b", 60);
    assert_eq!(fx.core.stats().pool, 2, "both wait for the next tick");
    // Another replica reserves both ids (one per worker) before this one ticks.
    fx.sigma_change(vec![
        change::request_reserved("a", 1, 101, 50, None, None),
        change::request_reserved("b", 0, 100, 60, None, None),
    ]);
    let (ra, rb) = (answer(&mut a), answer(&mut b));
    assert_eq!((ra.worker, ra.incarnation, ra.stale), (1, 101, false));
    assert_eq!((rb.worker, rb.incarnation, rb.stale), (0, 100, false));
    assert_eq!(fx.core.stats().pool, 0);
    assert_eq!(fx.tick_and_commit(true), 0, "no second reservation");
    assert!(fx.release().is_none(), "σ's reservations are not released");

    // The same through a whole σ (a Watch resubscribed after a gap): a third request waits
    // while the workers are full, and another replica's reservation of it arrives in a
    // snapshot.
    let (_, mut c) = fx.assign("c", 70);
    fx.tick_and_commit(true);
    assert!(pending(&mut c), "both workers full");
    let mut b2 = fx.writer.batch();
    b2.apply(change::request_released("b")).unwrap();
    b2.apply(change::request_reserved("c", 0, 100, 70, None, None))
        .unwrap();
    b2.commit();
    fx.core.set_sigma(fx.writer.clone(), fx.now);
    let rc = answer(&mut c);
    assert_eq!((rc.worker, rc.incarnation, rc.stale), (0, 100, false));
    assert_eq!(fx.core.stats().pool, 0);
    assert_eq!(fx.tick_and_commit(true), 0, "no second reservation");
}

/// The same whichever way the group finds the waiting ids a delta places: by walking the
/// pool (the delta names more requests than wait) or by looking the delta's ids up (more wait
/// than it names). Only the waiting request the delta reserves is answered; the running
/// requests it reports, answered long ago, and the other waiting ones are left alone.
#[test]
fn a_delta_answers_exactly_the_waiting_ids_it_places_both_ways() {
    for busy in [true, false] {
        let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 4);
        // Running requests that were answered here (kept for retries), reported in the delta.
        let mut running = Vec::new();
        for i in 0..4 {
            let id = format!("run{i}");
            let (_, mut rx) = fx.assign(&id, 10);
            fx.tick_and_commit(true);
            running.push((id, answer(&mut rx)));
        }
        let waiting: Vec<_> = ["w0", "w1", "w2"]
            .iter()
            .map(|id| fx.assign(id, 20).1)
            .collect();
        assert_eq!(fx.core.stats().pool, 3);
        let mut changes = vec![change::request_reserved("w1", 1, 101, 20, None, None)];
        if busy {
            // More placed ids in the delta than requests waiting.
            for (id, a) in &running {
                changes.push(change::request_progress(id, a.worker, a.incarnation, 10, 3));
            }
        }
        fx.sigma_change(changes);
        let mut waiting = waiting;
        let w1 = answer(&mut waiting[1]);
        assert_eq!(
            (w1.worker, w1.incarnation, w1.stale),
            (1, 101, false),
            "busy {busy}"
        );
        assert!(
            pending(&mut waiting[0]) && pending(&mut waiting[2]),
            "busy {busy}"
        );
        assert_eq!(fx.core.stats().pool, 2, "busy {busy}");
        // A retry of a running one still gets its first answer.
        let (_, mut again) = fx.assign(&running[0].0, 10);
        assert_eq!(answer(&mut again), running[0].1, "busy {busy}");
    }
}

#[test]
fn not_ready_no_worker_and_full_pool_are_typed() {
    let mut c = core(PolicyKind::Br0, GroupConfig::default());
    let (tx, mut rx) = oneshot::channel();
    c.assign(valid("r", 1), 1, tx, t0());
    assert!(matches!(error(&mut rx), DecisionError::NoSigma(_)));

    let mut fx = Fx::new(PolicyKind::Br0, &[], 8);
    let (_, mut rx) = fx.assign("r", 1);
    assert!(matches!(error(&mut rx), DecisionError::NoLiveWorker(_)));

    let cfg = GroupConfig {
        max_pool: 2,
        ..GroupConfig::default()
    };
    let mut fx = Fx::with_cfg(PolicyKind::Br0, &[0], 8, cfg);
    let (_, _a) = fx.assign("a", 1);
    let (_, _b) = fx.assign("b", 1);
    let (_, mut c) = fx.assign("c", 1);
    assert!(matches!(
        error(&mut c),
        DecisionError::PoolFull { max: 2, .. }
    ));
}

#[test]
fn answers_are_forgotten_after_the_ttl() {
    let cfg = GroupConfig {
        answered_ttl: Duration::from_secs(5),
        ..GroupConfig::default()
    };
    let mut fx = Fx::with_cfg(PolicyKind::Br0, &[0], 8, cfg);
    let (_, mut a) = fx.assign("a", 1);
    fx.tick_and_commit(true);
    answer(&mut a);
    fx.advance(Duration::from_secs(4));
    fx.core.housekeeping(fx.now);
    assert_eq!(fx.core.stats().answered, 1);
    fx.advance(Duration::from_secs(2));
    fx.core.housekeeping(fx.now);
    assert_eq!(fx.core.stats().answered, 0);
}

#[test]
fn the_pool_waits_for_free_slots_and_admits_when_sigma_frees_them() {
    let mut fx = Fx::new(PolicyKind::Br0, &[0, 0], 1);
    let (_, mut a) = fx.assign("a", 10);
    let (_, mut b) = fx.assign("b", 10);
    let (_, mut c) = fx.assign("c", 10);
    fx.tick_and_commit(true);
    let wa = answer(&mut a).worker;
    let wb = answer(&mut b).worker;
    assert_ne!(wa, wb);
    assert!(pending(&mut c), "both workers full");
    fx.sigma_change(vec![change::request_progress(
        "a",
        wa,
        100 + u64::from(wa),
        10,
        5,
    )]);
    fx.sigma_change(vec![change::request_finished("a", 5)]);
    fx.tick_and_commit(true);
    assert_eq!(answer(&mut c).worker, wa);
}

#[test]
fn on_arrival_policies_answer_without_a_tick_and_reroute_rejections() {
    let mut fx = Fx::new(PolicyKind::Jsq, &[0, 0, 0], 8);
    let (_, mut a) = fx.assign("a", 10);
    assert_eq!(fx.core.stats().pool, 0, "no pool");
    let job = fx.core.take_reserve(fx.now).expect("reserved at once");
    assert_eq!(job.reservations[0].worker, 0);
    assert!(job.queue_if_full, "on arrival: queue at the rank");
    // Rejected: routed again, to another worker.
    let resp = refused(&fx, "a", v1::RejectReason::WorkerFull, "");
    fx.done(&job, Ok(resp));
    assert!(pending(&mut a));
    let job = fx.core.take_reserve(fx.now).expect("rerouted");
    assert_eq!(job.reservations[0].worker, 1);
    let (resp, _) = fx.serve_reserve(&job);
    fx.done(&job, Ok(resp));
    let r = answer(&mut a);
    assert_eq!(
        (r.worker, r.pool_wait, r.policy),
        (1, Duration::ZERO, "jsq")
    );
    // JSQ spreads by count; worker 0 said "full" and stays out until σ moves.
    let (_, mut b) = fx.assign("b", 10);
    fx.tick_and_commit(false);
    let (_, mut c) = fx.assign("c", 10);
    fx.tick_and_commit(false);
    assert_eq!([answer(&mut b).worker, answer(&mut c).worker], [2, 1]);
}

#[test]
fn a_group_is_quiet_only_while_nothing_waits_on_the_clock() {
    let cfg = GroupConfig {
        answered_ttl: Duration::from_secs(5),
        ..GroupConfig::default()
    };
    let mut fx = Fx::with_cfg(PolicyKind::Br0, &[0], 8, cfg);
    assert!(fx.core.is_quiet(), "σ current, nothing held");
    let (_, mut a) = fx.assign("a", 1);
    assert!(!fx.core.is_quiet(), "pooled, a tick wanted");
    fx.core.tick(fx.now);
    let job = fx.core.take_reserve(fx.now).unwrap();
    assert!(!fx.core.is_quiet(), "a Reserve in flight");
    let (resp, delta) = fx.serve_reserve(&job);
    fx.done(&job, Ok(resp));
    answer(&mut a);
    assert!(
        !fx.core.is_quiet(),
        "an answer kept for retries, and its own reservation"
    );
    // σ shows the reservation (the own copy goes) and the answer's ttl passes: quiet again,
    // while the request runs in σ.
    fx.core.on_delta(&delta.unwrap(), fx.now).unwrap();
    fx.advance(Duration::from_secs(6));
    fx.core.housekeeping(fx.now);
    assert_eq!(fx.core.stats().answered, 0);
    assert!(fx.core.is_quiet(), "{:?}", fx.core.stats());
}

/// BR-C in the service: a shim reports a request as soon as its engine takes it (0 tokens), so
/// σ shows it running while its prompt runs; the rank counts as prefilling until its first
/// token, and the wave goes out when it comes. Ticks on the same σ (arrivals) do not count
/// toward the hold; only decode steps, read from the ranks' token reports, do.
#[test]
fn brc_waits_for_a_first_token_and_counts_its_hold_in_decode_steps() {
    let mut fx = Fx::new(PolicyKind::Brc, &[0, 0], 4);
    fx.sigma_change(vec![
        change::request_progress("a", 0, 100, 100, 0),
        change::request_progress("b", 1, 101, 100, 5),
    ]);
    let mut rxs: Vec<Rx> = (0..4).map(|i| fx.assign(&format!("r{i}"), 500).1).collect();
    // rank 0 prefills "a": the wave waits, however many ticks the arrivals bring
    for _ in 0..10 {
        assert_eq!(fx.tick_and_commit(true), 0);
    }
    // rank 1 steps once (the only request decoding): one step of the hold's budget (2 while
    // the pool is shallow: 4 waiting, 6 free slots), the first counted at the first tick
    fx.sigma_change(vec![change::request_progress("b", 1, 101, 100, 6)]);
    assert_eq!(fx.tick_and_commit(true), 0);
    // "a" writes its first token: nobody prefills, every rank has a free slot, the wave goes
    fx.sigma_change(vec![change::request_progress("a", 0, 100, 100, 1)]);
    assert_eq!(fx.tick_and_commit(true), 4);
    let mut per_worker = [0; 2];
    for rx in &mut rxs {
        per_worker[answer(rx).worker as usize] += 1;
    }
    assert_eq!(per_worker, [2, 2], "one wave over both ranks");
}

#[test]
fn brc_releases_to_the_free_ranks_after_its_budget_of_decode_steps() {
    let mut fx = Fx::new(PolicyKind::Brc, &[0, 0], 4);
    // "a" never gets past its prompt; "b" decodes
    fx.sigma_change(vec![
        change::request_progress("a", 0, 100, 100, 0),
        change::request_progress("b", 1, 101, 100, 5),
    ]);
    let (_, mut rx) = fx.assign("r", 500);
    // the first hold counts at once; a tick without a step does not
    assert_eq!(fx.tick_and_commit(true), 0);
    assert_eq!(fx.tick_and_commit(true), 0);
    fx.sigma_change(vec![change::request_progress("b", 1, 101, 100, 6)]);
    assert_eq!(
        fx.tick_and_commit(true),
        0,
        "two steps held: the shallow budget"
    );
    fx.sigma_change(vec![change::request_progress("b", 1, 101, 100, 7)]);
    assert_eq!(fx.tick_and_commit(true), 1, "the guard releases it");
    assert!(answer(&mut rx).worker <= 1);
}
