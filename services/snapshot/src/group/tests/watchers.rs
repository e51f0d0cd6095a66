//! Watchers: resume or reset, slow consumers, progress marks.
use super::*;

#[test]
fn watchers_resume_or_reset_and_replicas_match() {
    let (mut g, now) = group_with(Settings {
        watcher_queue: 64,
        ..settings()
    });
    let mut from_scratch = g.subscribe(0, 0);
    g.apply_msgs(1, vec![hello(0, 10, 64)], S1, now, 0);
    let mut at2 = None;
    for i in 0..5 {
        g.apply_msgs(
            i + 2,
            vec![prog(0, 10, &format!("r{i}"), 10, i as u32, false)],
            S1,
            now,
            0,
        );
        if g.version() == 2 {
            at2 = Some(Sigma::from_snapshot(&g.snapshot()).unwrap());
        }
    }
    assert_eq!(g.version(), 6);
    let mut replica = None;
    let evs = drain(&mut from_scratch);
    assert!(matches!(evs[0].kind, Some(Ev::Snapshot(_))));
    follow(&mut replica, &evs);
    assert_eq!(replica.as_ref().unwrap().to_snapshot(), g.snapshot());

    // resume from 2: one merged delta 2 -> 6
    let mut w = g.subscribe(77, 6);
    assert!(drain(&mut w).is_empty(), "up to date: nothing yet");
    let mut w = g.subscribe(77, 2);
    let evs = drain(&mut w);
    assert_eq!(evs.len(), 1);
    let Some(Ev::Delta(d)) = evs[0].kind.as_ref() else {
        panic!()
    };
    assert_eq!((d.prev_version, d.version), (2, 6));
    follow(&mut at2, &evs);
    assert_eq!(at2.unwrap().to_snapshot(), g.snapshot());

    // unknown epoch, future version, truncated history: reset + snapshot
    for (epoch, v, reason) in [
        (5, 1, v1::ResetReason::UnknownEpoch),
        (77, 9, v1::ResetReason::FutureVersion),
    ] {
        let evs = drain(&mut g.subscribe(epoch, v));
        let Some(Ev::Reset(rs)) = evs[0].kind.as_ref() else {
            panic!()
        };
        assert_eq!((rs.reason, rs.epoch), (reason as i32, 77));
        assert!(matches!(evs[1].kind, Some(Ev::Snapshot(_))));
    }
    for i in 0..10 {
        g.apply_msgs(
            i + 10,
            vec![prog(0, 10, &format!("s{i}"), 10, 1, false)],
            S1,
            now,
            0,
        );
    }
    let evs = drain(&mut g.subscribe(77, 2));
    let Some(Ev::Reset(rs)) = evs[0].kind.as_ref() else {
        panic!()
    };
    assert_eq!(rs.reason, v1::ResetReason::HistoryTruncated as i32);
    // the oldest held delta still resumes
    let oldest = g.version() - 8;
    let evs = drain(&mut g.subscribe(77, oldest));
    let Some(Ev::Delta(d)) = evs[0].kind.as_ref() else {
        panic!()
    };
    assert_eq!((d.prev_version, d.version), (oldest, g.version()));
}

#[test]
fn a_slow_watcher_is_reset_and_never_holds_up_the_others() {
    let (mut g, now) = group();
    let mut slow = g.subscribe(0, 0);
    let mut fast = g.subscribe(0, 0);
    let mut fast_replica = None;
    g.apply_msgs(1, vec![hello(0, 10, 64)], S1, now, 0);
    follow(&mut fast_replica, &drain(&mut fast));
    for i in 0..20 {
        g.apply_msgs(
            i + 2,
            vec![prog(0, 10, &format!("r{i}"), 10, 1, false)],
            S1,
            now,
            0,
        );
        // the fast one reads every delta in order
        let evs = drain(&mut fast);
        assert_eq!(evs.len(), 1);
        follow(&mut fast_replica, &evs);
    }
    assert_eq!(fast_replica.as_ref().unwrap().to_snapshot(), g.snapshot());
    // the slow one's queue (4 + its snapshot) overflowed; it now reads everything
    let evs = drain(&mut slow);
    assert_eq!(evs.len(), 5);
    g.tick(now);
    let evs2 = drain(&mut slow);
    let kinds: Vec<&str> = evs2
        .iter()
        .map(|e| match e.kind.as_ref().unwrap() {
            Ev::Reset(r) if r.reason == v1::ResetReason::SlowConsumer as i32 => "reset",
            Ev::Snapshot(_) => "snapshot",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, vec!["reset", "snapshot"]);
    let mut slow_replica = None;
    follow(&mut slow_replica, &evs);
    follow(&mut slow_replica, &evs2);
    assert_eq!(slow_replica.unwrap().to_snapshot(), g.snapshot());
    assert_eq!(g.watcher_count(), 2);
    drop(slow);
    g.tick(now);
    assert_eq!(g.watcher_count(), 1);
}

#[test]
fn progress_marks_when_idle() {
    let (mut g, now) = group();
    let mut w = g.subscribe(0, 0);
    drain(&mut w);
    g.tick(now + Duration::from_millis(100));
    assert!(drain(&mut w).is_empty());
    g.tick(now + Duration::from_millis(250));
    let evs = drain(&mut w);
    let Some(Ev::Progress(p)) = evs[0].kind.as_ref() else {
        panic!()
    };
    assert_eq!((p.epoch, p.version), (77, 0));
}

/// Drains a queue to its end: the events, then whether it ended on an overflow.
fn drain_to_end(rx: &mut WatchQueue) -> (usize, Option<Overflow>) {
    let mut n = 0;
    while let Some(item) = rx.try_recv() {
        match item {
            Ok(_) => n += 1,
            Err(o) => {
                assert!(
                    rx.try_recv().is_none(),
                    "the overflow is the stream's last item"
                );
                return (n, Some(o));
            }
        }
    }
    (n, None)
}

#[test]
fn a_watcher_over_its_bytes_is_ended_and_its_queue_freed_while_readers_keep_up() {
    // Room for a million events but 4 KiB: only the bytes can end it.
    let (mut g, now) = group_with(Settings {
        watcher_queue: 1_000_000,
        watcher_queue_bytes: 4096,
        ..settings()
    });
    let m = g.metrics.family().clone();
    let mut slow = g.subscribe(0, 0);
    let mut reader = g.subscribe(0, 0);
    g.apply_msgs(1, vec![hello(0, 10, 4096)], S1, now, 0);
    let mut replica = None;
    follow(&mut replica, &drain(&mut reader));
    let mut sizes = Vec::new();
    for i in 0..200u64 {
        let changes = (0..8)
            .map(|r| prog(0, 10, &format!("r{i}-{r}"), 10, 1, false))
            .collect();
        g.apply_msgs(i + 2, changes, S1, now, 0);
        let evs = drain(&mut reader);
        sizes.extend(evs.iter().map(prost::Message::encoded_len));
        follow(&mut replica, &evs);
    }
    // The reader was never affected and holds σ.
    assert_eq!(replica.unwrap().to_snapshot(), g.snapshot());
    // The slow one was dropped by the group once over its bytes ...
    assert_eq!(g.watcher_count(), 1);
    // ... and what it reads now is a few events then the overflow: the events it was sent
    // before it went over, nothing since (the queue was emptied when it overflowed).
    let (n, overflow) = drain_to_end(&mut slow);
    let o = overflow.expect("ended by its bytes");
    assert_eq!(o.max_bytes, 4096);
    assert_eq!(
        n, 0,
        "the overflow frees the queue: nothing queued is kept for it"
    );
    // Every delta is far below the bound, so it took many of them to go over: the bound is
    // bytes, not events.
    let biggest = sizes.iter().copied().max().unwrap();
    assert!(biggest < 1024, "deltas of {biggest} bytes");
    // Ended by the first event pushed at or over the bound: what it held plus that event.
    assert!(
        o.bytes > 4096 && o.bytes < 4096 + 2 * (biggest + 16),
        "{o:?}"
    );
    let refused = |reason: &str| m.refused_count(reason);
    assert_eq!(refused("watcher_queue_bytes"), 1);
}

#[test]
fn a_snapshot_larger_than_the_bytes_still_reaches_a_watcher_that_reads() {
    let (mut g, now) = group_with(Settings {
        watcher_queue_bytes: 1024,
        ..settings()
    });
    let hellos = (0..64).map(|w| hello(w, 10, 64)).collect();
    g.apply_msgs(1, hellos, S1, now, 0);
    let snapshot_bytes = event_bytes(&Event::Snapshot(Arc::new(g.snapshot())));
    assert!(snapshot_bytes > 1024, "{snapshot_bytes}");
    // From a version it cannot resume from: a reset, then the whole (oversized) snapshot.
    let mut w = g.subscribe(5, 0);
    let evs = drain(&mut w);
    assert!(matches!(evs[0].kind, Some(Ev::Reset(_))));
    let mut replica = None;
    follow(&mut replica, &evs);
    assert_eq!(replica.unwrap().to_snapshot(), g.snapshot());
    // It keeps following.
    g.apply_msgs(2, vec![prog(3, 10, "r", 10, 1, false)], S1, now, 0);
    assert_eq!(drain(&mut w).len(), 1);
    assert_eq!(g.watcher_count(), 1);
}

#[test]
fn a_group_is_idle_only_with_no_live_worker_request_watcher_or_fence() {
    let (mut g, now) = group_with(Settings {
        worker_grace: Duration::from_millis(100),
        // No grace for another ingest replica to take the worker over: its stream's end makes
        // it SUSPECT at once (the carrier grace has its own tests).
        carrier_grace: Duration::ZERO,
        ..settings()
    });
    let ms = Duration::from_millis;
    g.tick(now);
    assert!(g.is_idle());
    assert_eq!(g.idle_for(now + ms(30)), ms(30));
    // A watcher: not idle until it goes.
    let w = g.subscribe(0, 0);
    g.tick(now + ms(40));
    assert!(!g.is_idle());
    assert_eq!(g.idle_for(now + ms(50)), Duration::ZERO);
    drop(w);
    g.tick(now + ms(60));
    assert!(g.is_idle());
    // A worker on a stream: not idle; its stream ends: SUSPECT with a pending fence, still
    // not idle; fenced after the grace: idle again.
    g.apply_msgs(1, vec![hello(0, 10, 4)], S1, now + ms(70), 0);
    g.tick(now + ms(70));
    assert!(!g.is_idle());
    g.apply_msgs(2, vec![prog(0, 10, "r", 10, 1, false)], S1, now + ms(80), 0);
    g.stream_ended(S1, now + ms(90));
    g.tick(now + ms(100));
    assert!(!g.is_idle(), "a request and a pending fence");
    g.tick(now + ms(300));
    assert!(
        g.sigma().request_count() == 0,
        "the fence removed the request"
    );
    assert!(g.is_idle());
    assert_eq!(g.idle_for(now + ms(400)), ms(100));
}

#[test]
fn watchers_that_do_not_read_share_the_process_budget_and_are_ended_past_their_share() {
    // Each queue alone may hold a million events and 64 MiB; the budget of all is 8 KiB.
    let budget = 8192;
    let (mut g, now) = group_with(Settings {
        watcher_queue: 1_000_000,
        watcher_budget: Arc::new(WatcherBudget::new(budget)),
        ..settings()
    });
    let m = g.metrics.family().clone();
    let mut slow: Vec<_> = (0..4).map(|_| g.subscribe(0, 0)).collect();
    let mut reader = g.subscribe(0, 0);
    g.apply_msgs(1, vec![hello(0, 10, 4096)], S1, now, 0);
    let mut replica = None;
    follow(&mut replica, &drain(&mut reader));
    for i in 0..200u64 {
        let changes = (0..8)
            .map(|r| prog(0, 10, &format!("r{i}-{r}"), 10, 1, false))
            .collect();
        g.apply_msgs(i + 2, changes, S1, now, 0);
        follow(&mut replica, &drain(&mut reader));
    }
    // The reader, whose queue is empty after each read, was never affected.
    assert_eq!(replica.unwrap().to_snapshot(), g.snapshot());
    assert_eq!(g.watcher_count(), 1);
    // Each slow one was ended at its share: the budget over the watchers open then (five
    // for the first, fewer after), never its own 64 MiB.
    for rx in &mut slow {
        let (n, overflow) = drain_to_end(rx);
        let o = overflow.expect("ended by its share of the budget");
        assert!(
            (budget / 5..=budget / 2).contains(&o.max_bytes),
            "ended at {o:?}"
        );
        assert_eq!(n, 0, "its queue was freed when it was ended");
    }
    assert_eq!(m.refused_count("watcher_queue_bytes"), 4);
}

#[test]
fn deltas_leave_the_history_with_age_and_a_watcher_from_before_them_gets_a_snapshot() {
    let age = Duration::from_secs(30);
    let (mut g, t0) = group_with(Settings {
        history: 1000,
        history_age: age,
        ..settings()
    });
    g.apply_msgs(1, vec![hello(0, 10, 4096)], S1, t0, 0);
    let first = g.sigma().version();
    let mid = t0 + Duration::from_secs(20);
    for i in 0..50u64 {
        let at = if i < 25 { t0 } else { mid };
        let changes = vec![prog(0, 10, &format!("r{i}"), 10, 1, false)];
        g.apply_msgs(i + 2, changes, S1, at, 0);
    }
    assert_eq!(g.watchers.history.len(), 51);
    // Past the age of the first ones only: the later ones stay, and resuming among them
    // still gets deltas.
    g.tick(t0 + age + Duration::from_millis(1));
    assert_eq!(g.watchers.history.len(), 25);
    let recent = g.sigma().version() - 1;
    let mut w = g.subscribe(g.sigma().epoch(), recent);
    assert!(matches!(drain(&mut w)[0].kind, Some(Ev::Delta(_))));
    // Past the age of all: nothing is kept (its buffers released), and a watcher from before
    // gets a reset and a snapshot of σ as it is.
    g.tick(mid + age + Duration::from_millis(1));
    assert!(g.watchers.history.is_empty());
    assert_eq!(g.watchers.history.capacity(), 0);
    let mut w = g.subscribe(g.sigma().epoch(), first);
    let evs = drain(&mut w);
    assert!(matches!(evs[0].kind, Some(Ev::Reset(_))), "{evs:?}");
    assert!(matches!(evs[1].kind, Some(Ev::Snapshot(_))), "{evs:?}");
    // New deltas are kept again.
    g.apply_msgs(
        100,
        vec![prog(0, 10, "late", 10, 1, false)],
        S1,
        mid + age * 2,
        0,
    );
    assert_eq!(g.watchers.history.len(), 1);
}

#[test]
fn the_history_is_bounded_in_bytes_and_a_watcher_from_before_it_gets_a_snapshot() {
    let (mut g, now) = group_with(Settings {
        history: 1000,
        history_bytes: 4096,
        ..settings()
    });
    g.apply_msgs(1, vec![hello(0, 10, 4096)], S1, now, 0);
    let first = g.sigma().version();
    for i in 0..200u64 {
        let changes = (0..8)
            .map(|r| prog(0, 10, &format!("r{i}-{r}"), 10, 1, false))
            .collect();
        g.apply_msgs(i + 2, changes, S1, now, 0);
    }
    let held: usize = g.watchers.history.iter().map(event_bytes).sum();
    let kept = g.watchers.history.len();
    assert!(held <= 4096, "{held} bytes of history");
    assert!(kept > 1 && kept < 200, "{kept} deltas kept");
    let recent = g.sigma().version() - 1;
    resumes_from_deltas_kept_and_resets_before(&mut g, recent, first);
}

/// A watcher from `kept` (a version still in the history) gets deltas; one from `before` (a
/// version before it) gets a reset and a snapshot.
fn resumes_from_deltas_kept_and_resets_before(g: &mut Group, kept: u64, before: u64) {
    let mut w = g.subscribe(g.sigma().epoch(), kept);
    assert!(matches!(drain(&mut w)[0].kind, Some(Ev::Delta(_))));
    let mut w = g.subscribe(g.sigma().epoch(), before);
    let evs = drain(&mut w);
    assert!(matches!(evs[0].kind, Some(Ev::Reset(_))), "{evs:?}");
    assert!(matches!(evs[1].kind, Some(Ev::Snapshot(_))), "{evs:?}");
}

/// `n` progress changes for requests `from..from + n` spread over workers 0..8, with ids of
/// about 100 bytes (as gateways' UUID-and-path ids are).
fn long_id_progress(from: usize, n: usize, generated: u32) -> Vec<v1::TelemetryChange> {
    (from..from + n)
        .map(|i| {
            let id = format!("{i:08}-{}", "x".repeat(92));
            prog((i % 8) as u32, 10, &id, 10, generated, false)
        })
        .collect()
}

/// A group of 8 workers whose history only the worth rule bounds: 32 MiB and no age, as the
/// defaults' bounds would let a burst hold.
fn eight_workers_history_unbounded() -> (Group, Instant) {
    let (mut g, t0) = group_with(Settings {
        history: 1_000_000,
        history_bytes: 32 << 20,
        history_age: Duration::ZERO,
        ..settings()
    });
    let hellos = (0..8).map(|w| hello(w, 10, 4096)).collect();
    g.apply_msgs(1, hellos, S1, t0, 0);
    (g, t0)
}

fn held(g: &Group) -> usize {
    g.watchers.history.iter().map(event_bytes).sum()
}

#[test]
fn snapshot_estimate_is_close_to_the_encoded_snapshot() {
    let (mut g, now) = group();
    let hellos = (0..8).map(|w| hello(w, 10, 4096)).collect();
    g.apply_msgs(1, hellos, S1, now, 0);
    for (i, n) in [(0, 10), (10, 500), (510, 5000)] {
        g.apply_msgs(i as u64 + 2, long_id_progress(i, n, 7), S1, now, 0);
        let exact = event_bytes(&Event::Snapshot(Arc::new(g.sigma().to_snapshot())));
        let estimate = super::super::watchers::snapshot_estimate(g.sigma());
        assert!(
            exact * 4 / 5 <= estimate && estimate <= exact * 5 / 4,
            "{} requests: estimate {estimate}, encoded {exact}",
            g.sigma().request_count()
        );
    }
}

#[test]
fn a_heavy_writer_of_a_small_sigma_keeps_no_more_history_than_the_floor() {
    let (mut g, t0) = eight_workers_history_unbounded();
    let first = g.sigma().version();
    let mut most = 0;
    // 16 requests progressing 4,000 times: about 7 MiB of deltas over a σ of 2 KiB.
    for i in 0..4000u64 {
        let now = t0 + Duration::from_millis(i);
        g.apply_msgs(i + 2, long_id_progress(0, 16, i as u32 + 1), S1, now, 0);
        if i % 10 == 0 {
            g.tick(now);
        }
        most = most.max(held(&g));
    }
    let one_delta = event_bytes(g.watchers.history.back().unwrap());
    assert!(
        most <= (1 << 20) + 1000 * one_delta,
        "{most} bytes of history at most (deltas of {one_delta})"
    );
    assert!(
        held(&g) <= 1 << 20,
        "{} bytes of history at the end",
        held(&g)
    );
    assert!(
        held(&g) >= (1 << 20) - 2 * one_delta,
        "the floor is kept: {}",
        held(&g)
    );
    let recent = g.sigma().version() - 100;
    resumes_from_deltas_kept_and_resets_before(&mut g, recent, first);
}

#[test]
fn a_large_sigma_keeps_history_up_to_twice_its_snapshot() {
    let (mut g, t0) = eight_workers_history_unbounded();
    // 16,000 requests (a snapshot of about 2 MiB), then their progress, 100 at a time.
    let mut seq = 2;
    for from in (0..16_000).step_by(500) {
        g.apply_msgs(seq, long_id_progress(from, 500, 1), S1, t0, 0);
        seq += 1;
    }
    for round in 0..4u32 {
        for from in (0..16_000).step_by(100) {
            let now = t0 + Duration::from_millis(seq);
            g.apply_msgs(seq, long_id_progress(from, 100, round + 2), S1, now, 0);
            g.tick(now);
            seq += 1;
        }
    }
    let snapshot = event_bytes(&Event::Snapshot(Arc::new(g.sigma().to_snapshot())));
    let kept = held(&g);
    assert!(
        kept > snapshot && kept <= 2 * snapshot * 5 / 4,
        "{kept} bytes of history for a snapshot of {snapshot}"
    );
}
