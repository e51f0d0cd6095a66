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
