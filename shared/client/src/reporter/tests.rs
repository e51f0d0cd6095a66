use super::*;
use br_testkit::{FakeIngest, PATIENCE, eventually, within};
use std::net::SocketAddr;
use v1::worker_report::Kind;

/// Starts the kit's fake ingest on an ephemeral port (it stops when the handle drops).
async fn start(fake: &FakeIngest) -> (SocketAddr, br_testkit::Served) {
    let served = fake.start().await;
    (served.addr, served)
}

fn tuning() -> ReporterTuning {
    ReporterTuning {
        flush_interval: Duration::from_millis(2),
        heartbeat_every: Duration::from_millis(200),
        backoff_initial: Duration::from_millis(10),
        backoff_max: Duration::from_millis(100),
        connect_timeout: Duration::from_secs(2),
    }
}

fn config(addr: SocketAddr) -> ReporterConfig {
    ReporterConfig {
        endpoint: "http://10.0.0.1:8000".into(),
        ..ReporterConfig::new(format!("http://{addr}"), "g0", 3, 8)
    }
}

fn latest(ps: &[v1::Progress], id: &str) -> Option<v1::RequestProgress> {
    ps.iter()
        .flat_map(|p| p.updates.iter())
        .filter(|u| u.request_id == id)
        .max_by_key(|u| (u.generated_tokens, u.finished))
        .cloned()
}

#[tokio::test]
async fn hello_then_full_state_then_batched_latest_values() {
    let fake = FakeIngest::default();
    let (addr, _served) = start(&fake).await;
    let h = Reporter::spawn_tuned(config(addr), tuning()).unwrap();
    h.progress("a", 10, 1, false).unwrap();
    fake.wait_for("hello + full state", |m| m.len() >= 2).await;

    let msgs = fake.messages();
    let Some(Kind::Hello(hello)) = &msgs[0].kind else {
        panic!("first message is not a Hello: {msgs:?}")
    };
    assert_eq!(
        (hello.group.as_str(), hello.worker_id, hello.capacity),
        ("g0", 3, 8)
    );
    assert_eq!(hello.incarnation, h.incarnation());
    assert_ne!(hello.incarnation, 0);
    assert_eq!(hello.endpoint, "http://10.0.0.1:8000");
    let Some(Kind::Progress(first)) = &msgs[1].kind else {
        panic!("second message is not a Progress: {msgs:?}")
    };
    assert!(first.full_state, "a full state right after Hello");

    // Many updates of one request between two flushes: at most the values, never a
    // regression; the final state arrives.
    for j in 2..=50 {
        h.progress("b", 7, j, false).unwrap();
    }
    h.progress("b", 7, 20, false).unwrap(); // backwards: ignored
    h.progress("a", 10, 5, true).unwrap();
    fake.wait_for("b at 50 and a finished", |_| {
        let ps = fake.progresses();
        latest(&ps, "b").is_some_and(|u| u.generated_tokens == 50)
            && latest(&ps, "a").is_some_and(|u| u.finished && u.generated_tokens == 5)
    })
    .await;

    let ps = fake.progresses();
    let mut last_seq = 0;
    for p in &ps {
        assert!(p.seq > last_seq, "seq strictly increasing: {ps:?}");
        last_seq = p.seq;
        let mut ids: Vec<_> = p.updates.iter().map(|u| &u.request_id).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(
            ids.len(),
            p.updates.len(),
            "one entry per request per message"
        );
    }
    let b_updates: Vec<u32> = ps
        .iter()
        .flat_map(|p| p.updates.iter())
        .filter(|u| u.request_id == "b")
        .map(|u| u.generated_tokens)
        .collect();
    assert!(
        b_updates.windows(2).all(|w| w[0] <= w[1]),
        "never goes backwards: {b_updates:?}"
    );
    assert!(b_updates.len() < 49, "coalesced: {b_updates:?}");
    h.shutdown().await;
}

#[tokio::test]
async fn finished_requests_are_forgotten_after_the_ack() {
    let fake = FakeIngest::default();
    let (addr, _served) = start(&fake).await;
    let h = Reporter::spawn_tuned(config(addr), tuning()).unwrap();
    h.progress("done", 4, 9, true).unwrap();
    h.progress("running", 4, 9, false).unwrap();
    fake.wait_for("done reported", |_| {
        latest(&fake.progresses(), "done").is_some_and(|u| u.finished)
    })
    .await;
    // The ack for that message removes it; the next full state no longer lists it.
    eventually(
        PATIENCE,
        "the acked finished request is forgotten",
        || async { h.stats().pending == 1 },
    )
    .await;
    fake.ask_full_state();
    let before = fake.progresses().len();
    // Something to ack so the request flag travels; then wait for the full state.
    h.progress("running", 4, 10, false).unwrap();
    fake.wait_for("a full state after the request", |_| {
        fake.progresses()[before..].iter().any(|p| p.full_state)
    })
    .await;
    let full = fake.progresses()[before..]
        .iter()
        .find(|p| p.full_state)
        .cloned()
        .unwrap();
    let ids: Vec<_> = full.updates.iter().map(|u| u.request_id.as_str()).collect();
    assert_eq!(ids, vec!["running"], "finished and acked requests are gone");
    h.shutdown().await;
}

#[tokio::test]
async fn periodic_full_state_and_heartbeats() {
    let fake = FakeIngest::default();
    let (addr, _served) = start(&fake).await;
    let cfg = ReporterConfig {
        full_state_every: Duration::from_millis(30),
        ..config(addr)
    };
    let tuning = ReporterTuning {
        heartbeat_every: Duration::from_millis(10),
        ..tuning()
    };
    let h = Reporter::spawn_tuned(cfg, tuning).unwrap();
    h.progress("x", 1, 1, false).unwrap();
    fake.wait_for("three full states and a heartbeat", |m| {
        m.iter()
            .filter(|m| matches!(&m.kind, Some(Kind::Progress(p)) if p.full_state))
            .count()
            >= 3
            && m.iter().any(|m| matches!(m.kind, Some(Kind::Heartbeat(_))))
    })
    .await;
    for p in fake.progresses().iter().filter(|p| p.full_state) {
        assert_eq!(p.updates.len(), 1, "x is listed in every full state");
    }
    assert!(h.stats().connected);
    assert!(h.stats().full_states_sent >= 3);
    h.shutdown().await;
}

#[tokio::test]
async fn keeps_state_while_ingest_is_away_and_reconnects() {
    // Ingest is away: its port accepts connections and closes them at once, so each
    // connect attempt fails and is seen; after two of them the fake takes over the same
    // listener (no port is released and rebound, which another socket could take).
    let (l, addr) = br_testkit::net::listener().await;
    let h = Reporter::spawn_tuned(config(addr), tuning()).unwrap();
    h.progress("early", 5, 3, false).unwrap();
    h.progress("early", 5, 4, false).unwrap();
    h.progress("gone", 5, 4, true).unwrap();
    for _ in 0..2 {
        let (conn, _) = within(PATIENCE, "a connect attempt", l.accept())
            .await
            .unwrap();
        drop(conn);
    }
    assert!(!h.is_connected());

    let fake = FakeIngest::default();
    let _served = fake.serve_on(l);
    fake.wait_for("state kept across the outage", |_| {
        let ps = fake.progresses();
        ps.first().is_some_and(|p| {
            p.full_state
                && p.updates
                    .iter()
                    .any(|u| u.request_id == "early" && u.generated_tokens == 4)
                && p.updates
                    .iter()
                    .any(|u| u.request_id == "gone" && u.finished)
        })
    })
    .await;

    // The stream dies: the reporter reconnects, says Hello again with the same
    // incarnation, sends a full state with a higher seq.
    let seq_before = fake.progresses().last().unwrap().seq;
    let hellos_before = fake
        .messages()
        .iter()
        .filter(|m| matches!(m.kind, Some(Kind::Hello(_))))
        .count();
    h.progress("early", 5, 9, false).unwrap();
    fake.kill_streams();
    fake.wait_for("a second hello and full state", |m| {
        let hellos: Vec<_> = m
            .iter()
            .filter_map(|m| match &m.kind {
                Some(Kind::Hello(h)) => Some(h.incarnation),
                _ => None,
            })
            .collect();
        hellos.len() > hellos_before
            && fake
                .progresses()
                .iter()
                .any(|p| p.full_state && p.seq > seq_before)
    })
    .await;
    let incs: Vec<u64> = fake
        .messages()
        .iter()
        .filter_map(|m| match &m.kind {
            Some(Kind::Hello(h)) => Some(h.incarnation),
            _ => None,
        })
        .collect();
    assert!(incs.iter().all(|i| *i == h.incarnation()), "{incs:?}");
    fake.wait_for("the latest value arrives", |_| {
        latest(&fake.progresses(), "early").is_some_and(|u| u.generated_tokens == 9)
    })
    .await;
    assert!(h.stats().connects >= 2);
    h.shutdown().await;
}

#[tokio::test]
async fn moves_to_the_next_replica_when_its_stream_is_lost() {
    let (a, b) = (FakeIngest::default(), FakeIngest::default());
    let (a_addr, a_served) = start(&a).await;
    let (b_addr, _b_served) = start(&b).await;
    let cfg = ReporterConfig::new(format!("http://{a_addr}, http://{b_addr}"), "g0", 3, 8);
    let h = Reporter::spawn_tuned(cfg, tuning()).unwrap();
    h.progress("kept", 5, 2, false).unwrap();
    a.wait_for("hello + full state at the first replica", |m| m.len() >= 2)
        .await;
    assert_eq!(h.stats().ingest_index, 0);
    assert!(b.messages().is_empty(), "one replica at a time");
    // The first replica goes away: the same incarnation says Hello at the second, with
    // its full state.
    a_served.stop().await;
    b.wait_for("hello + full state at the second replica", |_| {
        b.hellos() == vec![h.incarnation()]
            && b.progresses()
                .first()
                .is_some_and(|p| p.full_state && p.updates.iter().any(|u| u.request_id == "kept"))
    })
    .await;
    eventually(PATIENCE, "connected to the second replica", || async {
        let s = h.stats();
        s.connected && s.ingest_index == 1
    })
    .await;
    assert_eq!(h.stats().refusals, 0);
    h.shutdown().await;
}

#[tokio::test]
async fn a_worker_that_stops_serving_ends_its_stream_and_comes_back_as_the_same_incarnation() {
    let fake = FakeIngest::default();
    let (addr, _served) = start(&fake).await;
    let h = Reporter::spawn_tuned(config(addr), tuning()).unwrap();
    h.progress("before", 5, 1, false).unwrap();
    fake.wait_for("hello + full state", |m| m.len() >= 2).await;
    eventually(PATIENCE, "connected", || async { h.is_connected() }).await;

    // The engine goes down: the last change goes out, then the stream ends cleanly.
    h.progress("before", 5, 2, false).unwrap();
    h.set_serving(false);
    assert!(!h.is_serving());
    fake.wait_for("the worker ended its stream", |_| {
        fake.streams_ended_by_worker() == 1
    })
    .await;
    assert_eq!(
        latest(&fake.progresses(), "before").map(|u| u.generated_tokens),
        Some(2),
        "the last change was sent before the stream ended"
    );
    eventually(PATIENCE, "disconnected", || async { !h.is_connected() }).await;
    // While held: recorded, not sent, and no new stream (the disconnect was observed after
    // the stream ended, so a reconnect would already show its Hello by now).
    h.progress("during", 7, 3, false).unwrap();
    let hellos = fake.hellos().len();
    assert_eq!(hellos, 1);

    // Back: the same incarnation says Hello with a full state holding both requests.
    h.set_serving(true);
    fake.wait_for("a second Hello and a full state", |_| {
        fake.hellos() == vec![h.incarnation(), h.incarnation()]
            && fake.progresses().iter().any(|p| {
                p.full_state
                    && p.updates.iter().any(|u| u.request_id == "during")
                    && p.updates.iter().any(|u| u.request_id == "before")
            })
    })
    .await;
    assert_eq!(h.stats().refusals, 0, "not a new incarnation");
    h.shutdown().await;
}

#[tokio::test]
async fn refuses_bad_input_and_bounds_the_map() {
    let fake = FakeIngest::default();
    let (addr, _served) = start(&fake).await;
    let cfg = ReporterConfig {
        max_pending: 2,
        ..config(addr)
    };
    let h = Reporter::spawn_tuned(cfg, tuning()).unwrap();
    assert!(matches!(
        h.progress("", 1, 1, false),
        Err(ReporterError::Invalid(_))
    ));
    assert!(matches!(
        h.progress("a", 10_000_001, 0, false),
        Err(ReporterError::Invalid(_))
    ));
    assert!(matches!(
        h.progress("a", 6_000_000, 6_000_000, false),
        Err(ReporterError::TooManyTokens { .. })
    ));
    h.progress("a", 1, 1, false).unwrap();
    h.progress("b", 1, 1, false).unwrap();
    assert!(matches!(
        h.progress("c", 1, 1, false),
        Err(ReporterError::Full { max: 2, .. })
    ));
    h.progress("a", 1, 2, false).unwrap(); // known ids still update
    assert_eq!(h.stats().refused_full, 1);
    h.shutdown().await;
    assert!(matches!(
        h.progress("a", 1, 3, false),
        Err(ReporterError::Closed)
    ));
}

#[test]
fn config_is_validated() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let ok = ReporterConfig::new("http://127.0.0.1:1", "g", 0, 1);
        for bad in [
            ReporterConfig {
                group: String::new(),
                ..ok.clone()
            },
            ReporterConfig {
                capacity: 0,
                ..ok.clone()
            },
            ReporterConfig {
                max_pending: 16_385,
                ..ok.clone()
            },
            ReporterConfig {
                ingest_addr: "not a uri".into(),
                ..ok.clone()
            },
            ReporterConfig {
                ingest_addr: "http://127.0.0.1:1,not a uri".into(),
                ..ok.clone()
            },
            ReporterConfig {
                ingest_addr: " , ".into(),
                ..ok.clone()
            },
        ] {
            assert!(
                matches!(Reporter::spawn(bad.clone()), Err(ReporterError::Config(_))),
                "{bad:?}"
            );
        }
        let h = Reporter::spawn(ok).unwrap();
        h.shutdown().await;
    });
}

#[test]
fn unkeyed_is_sticky_and_sent() {
    let id = RequestId::new("cmpl-1").unwrap();
    let mut e = Entry {
        id,
        prompt: 0,
        generated: 1,
        finished: false,
        unkeyed: true,
        dirty: false,
        finished_seq: 0,
    };
    assert!(
        !e.merge(0, 1, false, false),
        "a later report cannot unset it"
    );
    assert!(e.to_wire().unkeyed);
    assert!(e.merge(10, 2, true, false));
    let wire = e.to_wire();
    assert!(wire.unkeyed && wire.finished);
    assert_eq!((wire.prompt_tokens, wire.generated_tokens), (10, 2));
}

#[test]
fn pending_forgets_only_acked_finished_requests() {
    let mut p = Pending::default();
    for (id, fin) in [("a", true), ("b", false)] {
        let rid = RequestId::new(id).unwrap();
        p.requests.insert(
            rid.clone(),
            Entry {
                id: rid.clone(),
                prompt: 1,
                generated: 1,
                finished: fin,
                unkeyed: false,
                dirty: true,
                finished_seq: 0,
            },
        );
        p.dirty.push(rid);
    }
    assert_eq!(p.take_dirty(5, 100).len(), 2);
    p.forget_finished_up_to(4);
    assert_eq!(p.requests.len(), 2, "seq 5 not acked yet");
    // Reported again in a full state (seq 6) before the ack for 5 arrives.
    assert_eq!(p.take_full(6).len(), 2);
    p.forget_finished_up_to(5);
    assert_eq!(
        p.requests.len(),
        2,
        "a later message carries it; wait for its ack"
    );
    p.forget_finished_up_to(6);
    assert_eq!(p.requests.len(), 1);
    assert!(p.requests.contains_key("b"));
}

/// The leading edge: with a flush interval far longer than the test, the first change after
/// the stream went quiet is sent at once (otherwise it would wait the whole interval and the
/// test would time out); the changes after it go together, here in the last words at
/// shutdown. That they are not sent at once is the next test's.
#[tokio::test]
async fn the_first_change_after_a_quiet_interval_goes_at_once_and_the_next_ones_wait() {
    let fake = FakeIngest::default();
    let (addr, _served) = start(&fake).await;
    let hour = Duration::from_secs(3600);
    let cfg = ReporterConfig {
        full_state_every: hour,
        ..config(addr)
    };
    let tuning = ReporterTuning {
        flush_interval: hour,
        heartbeat_every: hour,
        ..tuning()
    };
    let h = Reporter::spawn_tuned(cfg, tuning).unwrap();
    fake.wait_for("hello + full state", |m| m.len() >= 2).await;
    h.progress("x", 4, 1, false).unwrap();
    fake.wait_for("x, sent at once", |_| {
        latest(&fake.progresses(), "x").is_some()
    })
    .await;
    h.progress("y", 4, 1, false).unwrap();
    h.progress("z", 4, 1, false).unwrap();
    h.progress("x", 4, 2, false).unwrap();
    h.shutdown().await;

    let ps: Vec<v1::Progress> = fake
        .progresses()
        .into_iter()
        .filter(|p| !p.full_state)
        .collect();
    let ids: Vec<Vec<&str>> = ps
        .iter()
        .map(|p| {
            let mut ids: Vec<&str> = p.updates.iter().map(|u| u.request_id.as_str()).collect();
            ids.sort_unstable();
            ids
        })
        .collect();
    assert_eq!(
        ids,
        vec![vec!["x"], vec!["x", "y", "z"]],
        "x alone at once, then the rest together: {ps:?}"
    );
}

/// The rule behind the leading edge, on its own: a recorded change wakes the task only when
/// the stream was quiet, and only the first such change does. (In the test above the task
/// cannot show the second half: on one thread it does not run between the test's calls.)
#[tokio::test]
async fn a_change_wakes_the_task_only_when_the_stream_was_quiet() {
    use futures::FutureExt as _;
    // Nothing listens there: the task stays in its reconnect loop and takes no wake-up.
    let nobody = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let h = Reporter::spawn_tuned(config(nobody), tuning()).unwrap();
    let shared = &h.inner.shared;
    let woken = || shared.change_notify.notified().now_or_never().is_some();

    h.progress("a", 1, 1, false).unwrap();
    assert!(
        !woken(),
        "a change while the stream is busy waits for the flush"
    );
    shared.quiet.store(true, Ordering::Relaxed);
    h.progress("b", 1, 1, false).unwrap();
    assert!(
        woken(),
        "the first change after a quiet interval wakes the task"
    );
    h.progress("c", 1, 1, false).unwrap();
    h.progress("d", 1, 1, false).unwrap();
    assert!(!woken(), "the changes after it do not");
    // A request already waiting to be sent is no new change either.
    shared.quiet.store(true, Ordering::Relaxed);
    h.progress("a", 1, 2, false).unwrap();
    assert!(!woken(), "more of a request not yet sent wakes nothing");
    h.shutdown().await;
}
