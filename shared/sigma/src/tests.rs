//! Unit and property tests of σ: loads follow the changes, replicas end equal to the writer,
//! snapshots round-trip, bad changes leave σ untouched.

use std::collections::BTreeMap;

use br_core::{Phase, WorkerId};
use br_proto::v1;

use super::change::*;
use super::*;
use proptest::prelude::*;

fn sigma() -> Sigma {
    Sigma::with_epoch("g", 7)
}

fn commit(s: &mut Sigma, changes: Vec<v1::Change>) -> Option<Delta> {
    let mut b = s.batch();
    for c in changes {
        b.apply(c).unwrap();
    }
    b.commit()
}

fn load(s: &Sigma, w: WorkerId) -> u64 {
    s.cluster().worker(w).unwrap().load()
}

#[test]
fn reservation_progress_finish_move_loads() {
    let mut s = sigma();
    let d = commit(
        &mut s,
        vec![
            worker_up(0, 11, 4, "http://a"),
            worker_up(1, 12, 4, ""),
            request_reserved("r1", 0, 11, 100, Some(5), Some(50)),
        ],
    )
    .unwrap();
    assert_eq!((d.prev_version, d.version, s.version()), (0, 1, 1));
    assert_eq!(load(&s, 0), 100);
    let key = s.key_of("r1").unwrap();
    assert_eq!(s.id_of(key), Some("r1"));
    assert_eq!(s.cluster().get(key).unwrap().phase, Phase::Queued);

    commit(&mut s, vec![request_progress("r1", 0, 11, 100, 7)]);
    assert_eq!(load(&s, 0), 107);
    assert_eq!(s.cluster().worker(0).unwrap().running, 1);
    assert_eq!(s.request("r1").unwrap().prompt_hash, Some(5));
    // restating is no change, and no version
    assert!(commit(&mut s, vec![request_progress("r1", 0, 11, 100, 7)]).is_none());
    assert_eq!(s.version(), 2);
    // the worker's report moves it, and its prompt count wins
    commit(&mut s, vec![request_progress("r1", 1, 12, 90, 8)]);
    assert_eq!((load(&s, 0), load(&s, 1)), (0, 98));
    assert_eq!(s.key_of("r1"), Some(key), "the key survives a move");
    commit(&mut s, vec![request_finished("r1", 8)]);
    assert_eq!(load(&s, 1), 0);
    assert_eq!((s.key_of("r1"), s.id_of(key)), (None, None));
}

/// Request `i`'s id: short for even `i`, too long for odd `i` to be kept inline in σ's table,
/// so both forms of its key go through whatever a test does.
fn id_in_either_form(i: u32) -> String {
    if i.is_multiple_of(2) {
        format!("req-{i}")
    } else {
        format!("req-{i}-{}", "x".repeat(60))
    }
}

#[test]
fn after_a_burst_the_request_table_gives_its_room_back_and_still_finds_what_stayed() {
    let mut s = sigma();
    commit(&mut s, vec![worker_up(0, 11, 20_000, "")]).unwrap();
    let id = id_in_either_form;
    commit(
        &mut s,
        (0..10_000)
            .map(|i| request_progress(&id(i), 0, 11, 10, 1))
            .collect(),
    )
    .unwrap();
    commit(
        &mut s,
        (10..10_000).map(|i| request_finished(&id(i), 2)).collect(),
    )
    .unwrap();
    let before = s.requests.capacity();
    s.shrink_sparse();
    assert!(
        s.requests.capacity() < before / 4,
        "{} of {before}",
        s.requests.capacity()
    );
    for i in 0..10 {
        assert_eq!(s.request(&id(i)).unwrap().generated_tokens, 1, "{}", id(i));
    }
    assert!(s.request(&id(10)).is_none());
    assert_eq!(s.request_count(), 10);
}

/// The gateway's hints stay with a request for its life in σ (reserved, running, moved), in
/// the routing core's view of it, in snapshots and on every replica; a request σ learns of from
/// telemetry alone has none.
#[test]
fn hints_stay_with_the_request() {
    let hints = Hints {
        expected_output: Some(300),
        class: Some(u64::MAX),
    };
    let mut s = sigma();
    let mut replica = sigma();
    let step = |s: &mut Sigma, replica: &mut Sigma, changes| {
        if let Some(d) = commit(s, changes) {
            replica.apply_delta(&d).unwrap();
        }
    };
    step(
        &mut s,
        &mut replica,
        vec![
            worker_up(0, 11, 4, ""),
            worker_up(1, 12, 4, ""),
            request_reserved_hinted("r1", 0, 11, 100, None, Some(500), hints),
        ],
    );
    let in_core = |s: &Sigma, id: &str| {
        let info = s.cluster().get(s.key_of(id).unwrap()).unwrap();
        (info.expected_output, info.class)
    };
    assert_eq!(s.request("r1").unwrap().hints, hints);
    assert_eq!(in_core(&s, "r1"), (Some(300), Some(u64::MAX)));
    step(
        &mut s,
        &mut replica,
        vec![request_progress("r1", 0, 11, 100, 7)],
    );
    // a move re-inserts it in the core
    step(
        &mut s,
        &mut replica,
        vec![request_progress("r1", 1, 12, 90, 8)],
    );
    for s in [&s, &replica] {
        assert_eq!(s.request("r1").unwrap().hints, hints);
        assert_eq!(in_core(s, "r1"), (Some(300), Some(u64::MAX)));
    }
    let snap = s.to_snapshot();
    assert_eq!(snap, replica.to_snapshot());
    let r1 = &snap.requests[0];
    assert_eq!(
        (r1.expected_output_tokens, r1.request_class_id),
        (Some(300), Some(u64::MAX))
    );
    let back = Sigma::from_snapshot(&snap).unwrap();
    assert_eq!(in_core(&back, "r1"), (Some(300), Some(u64::MAX)));
    // telemetry alone: no hints; a reservation of an older decision service: none either
    step(
        &mut s,
        &mut replica,
        vec![
            request_progress("t1", 0, 11, 10, 1),
            request_reserved("r2", 0, 11, 10, None, None),
        ],
    );
    for id in ["t1", "r2"] {
        assert_eq!(s.request(id).unwrap().hints, Hints::default());
        assert_eq!(in_core(&s, id), (None, None));
    }
}

#[test]
fn worker_lifecycle_follows_the_contract() {
    let mut s = sigma();
    commit(
        &mut s,
        vec![
            worker_up(0, 11, 4, ""),
            request_reserved("a", 0, 11, 10, None, None),
            request_progress("b", 0, 11, 20, 1),
        ],
    );
    // suspect of another incarnation: ignored
    assert!(!s.apply_change(&worker_suspect(0, 99)).unwrap());
    assert!(s.apply_change(&worker_suspect(0, 11)).unwrap());
    assert_eq!(s.liveness(0), Some(Liveness::Suspect));
    assert_eq!(load(&s, 0), 31, "a suspect keeps its load");
    assert_eq!(s.cluster().worker(0).unwrap().free_slots(), 0);
    assert_eq!(
        s.apply_change(&request_reserved("c", 0, 11, 1, None, None)),
        Err(SigmaError::WorkerSuspect(0))
    );
    // telemetry still lands on a suspect worker
    assert!(s.apply_change(&request_progress("d", 0, 11, 5, 0)).unwrap());
    assert!(!s.cluster().worker(0).unwrap().accepting);
    // reconnect of the same incarnation: live, requests stay
    assert!(s.apply_change(&worker_up(0, 11, 8, "x")).unwrap());
    assert_eq!((s.request_count(), load(&s, 0)), (3, 36));
    assert_eq!(s.endpoint(0), Some("x"));
    // fenced: requests gone
    assert!(!s.apply_change(&worker_fenced(0, 12)).unwrap());
    assert!(s.apply_change(&worker_fenced(0, 11)).unwrap());
    assert_eq!((s.request_count(), load(&s, 0)), (0, 0));
    assert_eq!(
        s.apply_change(&request_progress("e", 0, 11, 5, 0)),
        Err(SigmaError::WorkerFenced(0))
    );
    // a new incarnation starts clean, replacing an old one with requests
    s.apply_change(&worker_up(0, 13, 4, "")).unwrap();
    s.apply_change(&request_reserved("f", 0, 13, 3, None, None))
        .unwrap();
    s.apply_change(&worker_up(0, 14, 4, "")).unwrap();
    assert_eq!((s.request_count(), load(&s, 0)), (0, 0));
    assert_eq!(s.incarnation(0), Some(14));
    assert!(s.key_of("f").is_none());
}

#[test]
fn a_new_carrier_is_a_change_and_survives_the_snapshot_round_trip() {
    let mut s = sigma();
    commit(&mut s, vec![worker_up_via(0, 5, 8, "", "ingest-a")]).unwrap();
    assert!(
        commit(&mut s, vec![worker_up_via(0, 5, 8, "", "ingest-a")]).is_none(),
        "the same Hello through the same replica changes nothing"
    );
    let d = commit(&mut s, vec![worker_up_via(0, 5, 8, "", "ingest-b")]).unwrap();
    assert_eq!(d.changes.len(), 1, "a takeover is published");
    assert_eq!(s.worker(0).unwrap().carrier, "ingest-b");
    let back = Sigma::from_snapshot(&s.to_snapshot()).unwrap();
    assert_eq!(back.worker(0).unwrap().carrier, "ingest-b");
    let mut b = s.batch();
    let long = "x".repeat(MAX_CARRIER_BYTES + 1);
    assert!(b.apply(worker_up_via(1, 5, 8, "", &long)).is_err());
    assert!(b.apply(worker_up_via(1, 5, 8, "", "a\nb")).is_err());
}

#[test]
fn errors_leave_sigma_untouched() {
    let mut s = sigma();
    commit(
        &mut s,
        vec![
            worker_up(0, 11, 4, ""),
            request_reserved("a", 0, 11, 10, None, None),
            request_progress("b", 0, 11, 20, 1),
        ],
    );
    let before = s.to_snapshot();
    let bad = [
        v1::Change { kind: None },
        worker_up(MAX_WORKER_ID + 1, 1, 1, ""),
        worker_up(1, 0, 1, ""),
        worker_up(1, 1, 0, ""),
        request_reserved("", 0, 11, 1, None, None),
        request_reserved(&"x".repeat(257), 0, 11, 1, None, None),
        request_reserved("a", 0, 11, 1, None, None),
        request_reserved("z", 3, 11, 1, None, None),
        request_reserved("z", 0, 12, 1, None, None),
        request_reserved("z", 0, 11, 0, None, None),
        request_progress("z", 0, 11, limits::MAX_TOKENS + 1, 0),
        request_finished("nope", 0),
        request_expired("b"),
        request_released("b"),
        request_released("nope"),
    ];
    for c in &bad {
        assert!(s.apply_change(c).is_err(), "{c:?}");
        assert_eq!(s.to_snapshot(), before, "{c:?}");
    }
}

#[test]
fn deltas_apply_only_in_order() {
    let mut w = sigma();
    let d1 = commit(&mut w, vec![worker_up(0, 1, 2, "")]).unwrap();
    let d2 = commit(&mut w, vec![request_progress("a", 0, 1, 3, 4)]).unwrap();
    let mut r = Sigma::from_snapshot(&Sigma::with_epoch("g", 7).to_snapshot()).unwrap();
    assert_eq!(
        r.apply_delta(&d2),
        Err(SigmaError::Gap { have: 0, prev: 1 })
    );
    let mut other = d1.clone();
    other.epoch = 8;
    assert_eq!(
        r.apply_delta(&other),
        Err(SigmaError::EpochMismatch { have: 7, got: 8 })
    );
    r.apply_delta(&d1).unwrap();
    assert_eq!(
        r.apply_delta(&d1),
        Err(SigmaError::Gap { have: 1, prev: 0 })
    );
    r.apply_delta(&d2).unwrap();
    assert_eq!(r.to_snapshot(), w.to_snapshot());
    assert_eq!(Sigma::new("g").epoch(), 0);
}

#[test]
fn bad_snapshots_are_refused() {
    let mut s = sigma();
    commit(
        &mut s,
        vec![
            worker_up(0, 1, 2, ""),
            worker_up(1, 2, 2, ""),
            request_progress("a", 0, 1, 3, 4),
        ],
    );
    let good = s.to_snapshot();
    assert!(Sigma::from_snapshot(&good).is_ok());
    let mut m = good.clone();
    m.epoch = 0;
    assert!(Sigma::from_snapshot(&m).is_err());
    let mut m = good.clone();
    m.workers[1].worker_id = 0;
    assert!(Sigma::from_snapshot(&m).is_err());
    let mut m = good.clone();
    m.requests[0].incarnation = 9;
    assert!(Sigma::from_snapshot(&m).is_err());
    let mut m = good.clone();
    m.workers[0].liveness = v1::Liveness::Fenced as i32;
    assert!(Sigma::from_snapshot(&m).is_err());
    let mut m = good.clone();
    m.requests.push(m.requests[0].clone());
    assert!(Sigma::from_snapshot(&m).is_err());
    let mut m = good;
    m.requests[0].state = v1::RequestPhase::Reserved as i32;
    assert!(Sigma::from_snapshot(&m).is_err(), "reserved with tokens");
}

#[test]
fn a_cordon_stops_new_work_only_and_outlives_incarnations() {
    let mut s = sigma();
    commit(
        &mut s,
        vec![
            worker_up(0, 11, 4, ""),
            worker_up(1, 12, 4, ""),
            request_reserved("a", 0, 11, 10, None, None),
        ],
    );
    assert_eq!(
        s.apply_change(&worker_cordon(5, true)),
        Err(SigmaError::UnknownWorker(5))
    );
    let d = commit(&mut s, vec![worker_cordon(0, true)]).unwrap();
    assert!(s.worker(0).unwrap().cordoned);
    assert_eq!(
        s.liveness(0),
        Some(Liveness::Live),
        "a cordon is not a liveness"
    );
    assert!(!s.cluster().worker(0).unwrap().accepting);
    assert_eq!(
        s.cluster().accepting_worker_ids().collect::<Vec<_>>(),
        vec![1]
    );
    // restating it is no change and no version
    assert!(commit(&mut s, vec![worker_cordon(0, true)]).is_none());
    assert_eq!(
        s.apply_change(&request_reserved("b", 0, 11, 1, None, None)),
        Err(SigmaError::WorkerCordoned(0))
    );
    // its running work goes on: telemetry lands, the reservation becomes active and finishes
    assert!(
        s.apply_change(&request_progress("a", 0, 11, 10, 3))
            .unwrap()
    );
    assert!(s.apply_change(&request_progress("c", 0, 11, 5, 0)).unwrap());
    assert_eq!(load(&s, 0), 18);
    assert!(
        !s.cluster().worker(0).unwrap().accepting,
        "the insert kept the cordon"
    );
    // a replica following the delta agrees, and so does one built from the snapshot
    let mut r = Sigma::with_epoch("g", 7);
    r.apply_delta(&Delta {
        epoch: 7,
        prev_version: 0,
        version: 1,
        changes: vec![
            worker_up(0, 11, 4, ""),
            worker_up(1, 12, 4, ""),
            request_reserved("a", 0, 11, 10, None, None),
        ],
    })
    .unwrap();
    r.apply_delta(&d).unwrap();
    assert!(r.worker(0).unwrap().cordoned && !r.cluster().worker(0).unwrap().accepting);
    let snap = s.to_snapshot();
    assert!(snap.workers[0].cordoned);
    let rebuilt = Sigma::from_snapshot(&snap).unwrap();
    assert_eq!(rebuilt.to_snapshot(), snap);
    assert!(!rebuilt.cluster().worker(0).unwrap().accepting);
    // the cordon belongs to the rank: a suspect, a reconnect, a fence and a new incarnation
    // keep it
    s.apply_change(&worker_suspect(0, 11)).unwrap();
    s.apply_change(&worker_up(0, 11, 4, "")).unwrap();
    assert!(!s.cluster().worker(0).unwrap().accepting);
    s.apply_change(&worker_fenced(0, 11)).unwrap();
    s.apply_change(&worker_up(0, 13, 4, "")).unwrap();
    assert!(s.worker(0).unwrap().cordoned);
    assert!(!s.cluster().worker(0).unwrap().accepting);
    // uncordon: new work again
    assert!(s.apply_change(&worker_cordon(0, false)).unwrap());
    assert!(s.cluster().worker(0).unwrap().accepting);
    assert!(
        s.apply_change(&request_reserved("b", 0, 13, 1, None, None))
            .unwrap()
    );
    // uncordoning a suspect worker does not make it accept
    s.apply_change(&worker_cordon(1, true)).unwrap();
    s.apply_change(&worker_suspect(1, 12)).unwrap();
    s.apply_change(&worker_cordon(1, false)).unwrap();
    assert!(!s.cluster().worker(1).unwrap().accepting);
}

/// The decode counter: what each progress report adds to a request's generated tokens, on
/// the worker that reports it.
#[test]
fn generated_tokens_count_what_each_report_adds() {
    let mut s = sigma();
    commit(
        &mut s,
        vec![
            worker_up(0, 11, 4, ""),
            worker_up(1, 12, 4, ""),
            request_reserved("a", 0, 11, 100, None, Some(40)),
        ],
    );
    assert_eq!(s.generated_tokens(0), 0, "a reservation generated nothing");
    // it starts running with 3 tokens, then 5 more
    s.apply_change(&request_progress("a", 0, 11, 100, 3))
        .unwrap();
    s.apply_change(&request_progress("a", 0, 11, 100, 8))
        .unwrap();
    assert_eq!(s.generated_tokens(0), 8);
    // a report that restates or lowers the count adds nothing; from the lower count on, σ
    // learns of the tokens again
    s.apply_change(&request_progress("a", 0, 11, 100, 8))
        .unwrap();
    s.apply_change(&request_progress("a", 0, 11, 100, 6))
        .unwrap();
    assert_eq!(s.generated_tokens(0), 8);
    s.apply_change(&request_progress("a", 0, 11, 100, 7))
        .unwrap();
    assert_eq!(s.generated_tokens(0), 9);
    // a request σ first sees running brings its tokens
    s.apply_change(&request_progress("b", 1, 12, 50, 4))
        .unwrap();
    assert_eq!(s.generated_tokens(1), 4);
    // a request that moves: the tokens since its last report are the new worker's
    s.apply_change(&request_progress("a", 1, 12, 100, 10))
        .unwrap();
    assert_eq!((s.generated_tokens(0), s.generated_tokens(1)), (9, 7));
    // a refused report counts nothing (above max_tokens)
    assert!(
        s.apply_change(&request_progress("a", 1, 12, 100, 41))
            .is_err()
    );
    assert_eq!(s.generated_tokens(1), 7);
    // a fenced worker's reports are refused and count nothing; its count stays, and goes on
    // from there with the next incarnation
    s.apply_change(&worker_fenced(1, 12)).unwrap();
    assert_eq!(
        s.apply_change(&request_progress("c", 1, 12, 5, 2)),
        Err(SigmaError::WorkerFenced(1))
    );
    assert_eq!(s.generated_tokens(1), 7);
    s.apply_change(&worker_up(1, 13, 4, "")).unwrap();
    s.apply_change(&request_progress("c", 1, 13, 5, 2)).unwrap();
    assert_eq!(s.generated_tokens(1), 9);
    // a worker σ never held, and a σ built from a snapshot (it knows no report): 0
    assert_eq!(s.generated_tokens(7), 0);
    let r = Sigma::from_snapshot(&s.to_snapshot()).unwrap();
    assert_eq!((r.generated_tokens(0), r.generated_tokens(1)), (0, 0));
}

// ---- property tests ----

#[derive(Debug, Clone)]
enum Op {
    Up(u32, u64, u32, bool),
    Suspect(u32, u64),
    Fence(u32, u64),
    Reserve(u8, u32, u64, u32, Option<u64>),
    Progress(u8, u32, u64, u32, u32),
    Finish(u8, u32),
    Expire(u8),
    Release(u8),
    Cordon(u32, bool),
    Commit,
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0u32..4;
    let inc = 1u64..3;
    let r = 0u8..12;
    prop_oneof![
        (w.clone(), inc.clone(), 1u32..4, any::<bool>())
            .prop_map(|(a, b, c, d)| Op::Up(a, b, c, d)),
        (w.clone(), inc.clone()).prop_map(|(a, b)| Op::Suspect(a, b)),
        (w.clone(), inc.clone()).prop_map(|(a, b)| Op::Fence(a, b)),
        (
            r.clone(),
            w.clone(),
            inc.clone(),
            1u32..100,
            proptest::option::of(0u64..3)
        )
            .prop_map(|(a, b, c, d, e)| Op::Reserve(a, b, c, d, e)),
        (r.clone(), w, inc, 0u32..100, 0u32..50)
            .prop_map(|(a, b, c, d, e)| Op::Progress(a, b, c, d, e)),
        (r.clone(), 0u32..50).prop_map(|(a, b)| Op::Finish(a, b)),
        r.clone().prop_map(Op::Expire),
        r.prop_map(Op::Release),
        (0u32..4, any::<bool>()).prop_map(|(a, b)| Op::Cordon(a, b)),
        Just(Op::Commit),
    ]
}

fn to_change(op: &Op) -> Option<v1::Change> {
    let id = |r: &u8| id_in_either_form(u32::from(*r));
    Some(match op {
        // the carrier varies with the capacity, so a takeover (same incarnation, another
        // replica) is among the histories replicas must follow
        Op::Up(w, i, c, e) => worker_up_via(
            *w,
            *i,
            *c,
            if *e { "http://e" } else { "" },
            if c % 2 == 0 { "ingest-a" } else { "ingest-b" },
        ),
        Op::Suspect(w, i) => worker_suspect(*w, *i),
        Op::Fence(w, i) => worker_fenced(*w, *i),
        Op::Reserve(r, w, i, p, h) => request_reserved(&id(r), *w, *i, *p, *h, Some(9)),
        Op::Progress(r, w, i, p, g) => request_progress(&id(r), *w, *i, *p, *g),
        Op::Finish(r, g) => request_finished(&id(r), *g),
        Op::Expire(r) => request_expired(&id(r)),
        Op::Release(r) => request_released(&id(r)),
        Op::Cordon(w, c) => worker_cordon(*w, *c),
        Op::Commit => return None,
    })
}

/// The core mirror agrees with σ's own entries, and its incremental loads with loads
/// recomputed from scratch.
fn check_mirror(s: &Sigma) {
    let core = s.cluster();
    assert_eq!(core.request_count(), s.request_count());
    let mut expect: BTreeMap<WorkerId, (u32, u32, u64, u64, u32, u64)> = BTreeMap::new();
    for r in s.requests() {
        assert_eq!(s.id_of(r.key), Some(r.id.as_str()));
        let info = core.get(r.key).unwrap();
        assert_eq!(
            (
                info.worker,
                info.prompt_tokens,
                info.generated,
                info.phase,
                info.prompt_hash
            ),
            (
                r.worker,
                r.prompt_tokens,
                r.generated_tokens,
                r.phase,
                r.prompt_hash
            )
        );
        let w = s.worker(r.worker).unwrap();
        assert_eq!(w.incarnation, r.incarnation);
        assert_ne!(w.liveness, Liveness::Fenced);
        let e = expect.entry(r.worker).or_default();
        if r.generated_tokens == 0 {
            e.4 += 1;
            e.5 += u64::from(r.prompt_tokens);
        }
        match r.phase {
            Phase::Queued => {
                e.0 += 1;
                e.2 += r.kv_tokens();
            }
            Phase::Running => {
                e.1 += 1;
                e.3 += r.kv_tokens();
            }
        }
    }
    assert_eq!(s.ids.len(), s.requests.len());
    let mut max = 0;
    let mut live = 0;
    for w in s.workers() {
        let c = core.worker(w.id).unwrap();
        let (q, run, ql, rl, pre, pre_tokens) = expect.get(&w.id).copied().unwrap_or_default();
        assert_eq!(
            (
                c.queued,
                c.running,
                c.queued_load,
                c.running_load,
                c.prefilling,
                c.prefill_tokens
            ),
            (q, run, ql, rl, pre, pre_tokens)
        );
        assert_eq!(c.alive, w.liveness != Liveness::Fenced);
        assert_eq!(c.accepting, w.accepts_new_work());
        assert_eq!(c.capacity, w.capacity);
        if c.alive {
            live += 1;
            max = max.max(ql + rl);
        }
    }
    assert_eq!(core.live_workers(), live);
    assert_eq!(core.max_load(), max);
    // The O(ranks) summary (the live page's) is the one brctl computes from the snapshot.
    assert_eq!(s.summary(), GroupSummary::of_snapshot(&s.to_snapshot()));
    let summary = s.summary();
    assert_eq!(summary.barrier_idle_tokens, core.barrier_idle());
    assert_eq!(summary.imbalance_tokens, core.max_load() - core.min_load());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn any_version_plus_its_deltas_is_the_latest(ops in proptest::collection::vec(op(), 1..120)) {
        let mut w = Sigma::with_epoch("g", 42);
        let mut snaps = vec![w.to_snapshot()];
        let mut deltas: Vec<Delta> = Vec::new();
        let mut batch: Vec<v1::Change> = Vec::new();
        let flush = |w: &mut Sigma, batch: &mut Vec<v1::Change>, snaps: &mut Vec<v1::ClusterSnapshot>, deltas: &mut Vec<Delta>| {
            let mut b = w.batch();
            for c in batch.drain(..) {
                let before = b.sigma().to_snapshot();
                if b.apply(c).is_err() {
                    // an error changes nothing
                    assert_eq!(b.sigma().to_snapshot(), before);
                }
            }
            if let Some(d) = b.commit() {
                deltas.push(d);
                snaps.push(w.to_snapshot());
            }
            check_mirror(w);
        };
        for op in &ops {
            match to_change(op) {
                Some(c) => batch.push(c),
                None => flush(&mut w, &mut batch, &mut snaps, &mut deltas),
            }
        }
        flush(&mut w, &mut batch, &mut snaps, &mut deltas);
        let last = w.to_snapshot();
        prop_assert_eq!(last.version as usize, deltas.len());
        for (v, snap) in snaps.iter().enumerate() {
            let mut r = Sigma::from_snapshot(snap).unwrap();
            prop_assert_eq!(&r.to_snapshot(), snap, "snapshot round trip");
            check_mirror(&r);
            for d in &deltas[v..] {
                r.apply_delta(d).unwrap();
            }
            check_mirror(&r);
            prop_assert_eq!(&r.to_snapshot(), &last);
            if v == 0 {
                // a replica that saw every delta counts the tokens the writer counted: the
                // counter moves with the changes that are applied, never with refused ones
                for id in 0..4 {
                    prop_assert_eq!(r.generated_tokens(id), w.generated_tokens(id), "worker {}", id);
                }
            }
        }
    }
}

// ---- the request-id rule (unkeyed requests adopt reservations; see `unkeyed`) ----

mod unkeyed_rule {
    use super::*;
    use crate::unkeyed::{Adopted, Adoptions};

    const INC: u64 = 5;

    /// What really happens to one request the gateway reserved.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Real {
        /// Reserved; not sent yet.
        Pending,
        /// Running on the worker with this many tokens generated.
        Arrived(u32),
        /// Finished, or cancelled before it was sent.
        Gone,
    }

    #[derive(Debug, Clone)]
    struct Req {
        n: usize,
        prompt: u32,
        /// Sent with the gateway's id (X-Request-Id), or without (reported by the engine's).
        keyed: bool,
        real: Real,
    }

    impl Req {
        fn rid(&self) -> String {
            format!("r{}", self.n)
        }
        /// The id the worker reports it by.
        fn reported(&self) -> String {
            if self.keyed {
                self.rid()
            } else {
                format!("cmpl-{}", self.n)
            }
        }
    }

    /// σ's writer and a replica following its deltas, as the snapshot service does it.
    struct Writer {
        sigma: Sigma,
        replica: Sigma,
        adoptions: Adoptions,
    }

    impl Writer {
        fn new() -> Writer {
            let mut sigma = Sigma::with_epoch("g", 9);
            commit(&mut sigma, vec![worker_up(0, INC, 4096, "")]);
            let replica = Sigma::from_snapshot(&sigma.to_snapshot()).unwrap();
            Writer {
                sigma,
                replica,
                adoptions: Adoptions::default(),
            }
        }

        fn run(&mut self, f: impl FnOnce(&mut Batch<'_>, &mut Adoptions)) {
            let mut b = self.sigma.batch();
            f(&mut b, &mut self.adoptions);
            if let Some(d) = b.commit() {
                self.replica.apply_delta(&d).unwrap();
            }
        }

        /// A worker's report, as the snapshot service applies it (apply.rs `progress`).
        fn report(
            &mut self,
            id: &str,
            prompt: u32,
            generated: u32,
            unkeyed: bool,
        ) -> Option<Adopted> {
            let mut adopted = None;
            self.run(|b, a| {
                if b.sigma().request(id).is_none() {
                    if unkeyed {
                        adopted = Some(a.adopt(b, id, 0, INC).unwrap());
                    } else {
                        a.named(b, id).unwrap();
                    }
                }
                let held = b
                    .sigma()
                    .request(id)
                    .map(|r| (r.prompt_tokens, r.generated_tokens));
                let (p, g) = match held {
                    Some((hp, hg)) => (if prompt == 0 { hp } else { prompt }, hg.max(generated)),
                    None => (prompt, generated),
                };
                b.apply(request_progress(id, 0, INC, p, g)).unwrap();
            });
            adopted
        }

        /// Cancel's Release, as the snapshot service applies it (reserve.rs `release`).
        fn release(&mut self, id: &str) {
            self.run(|b, a| {
                let reserved = b
                    .sigma()
                    .request(id)
                    .is_some_and(|r| r.phase == Phase::Queued);
                if reserved {
                    b.apply(request_released(id)).unwrap();
                } else {
                    a.named(b, id).unwrap();
                }
            });
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Reserve { prompt: u32, keyed: bool },
        Arrive(usize),
        Step(usize, u32),
        Finish(usize),
        Cancel(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (1u32..2000, any::<bool>()).prop_map(|(prompt, keyed)| Op::Reserve { prompt, keyed }),
            3 => any::<usize>().prop_map(Op::Arrive),
            2 => (any::<usize>(), 1u32..40).prop_map(|(i, t)| Op::Step(i, t)),
            2 => any::<usize>().prop_map(Op::Finish),
            1 => any::<usize>().prop_map(Op::Cancel),
        ]
    }

    fn pick(reqs: &[Req], i: usize, want: impl Fn(Real) -> bool) -> Option<usize> {
        let idx: Vec<usize> = (0..reqs.len()).filter(|&k| want(reqs[k].real)).collect();
        (!idx.is_empty()).then(|| idx[i % idx.len()])
    }

    /// The independent answer: every request that exists (reserved and not sent, or running)
    /// is in σ once; each running one under the id it is reported by, with its own tokens.
    fn check(w: &Writer, reqs: &[Req]) {
        let live: Vec<&Req> = reqs.iter().filter(|r| r.real != Real::Gone).collect();
        let in_sigma = w.sigma.cluster().worker(0).unwrap().requests() as usize;
        assert_eq!(
            in_sigma,
            live.len(),
            "σ counts {in_sigma} requests, {} exist",
            live.len()
        );
        assert_eq!(w.sigma.request_count(), live.len());
        let pending = live.iter().filter(|r| r.real == Real::Pending).count();
        let reserved = w
            .sigma
            .requests()
            .filter(|r| r.phase == Phase::Queued)
            .count();
        assert_eq!(
            reserved, pending,
            "one reservation per request not sent yet"
        );
        for r in live {
            if let Real::Arrived(g) = r.real {
                let held = w
                    .sigma
                    .request(&r.reported())
                    .expect("a running request is in σ");
                assert_eq!((held.prompt_tokens, held.generated_tokens), (r.prompt, g));
                assert_eq!(held.phase, Phase::Running);
            }
        }
        assert_eq!(
            w.replica.to_snapshot(),
            w.sigma.to_snapshot(),
            "the replica follows"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Keyed and unkeyed requests mixed on one worker, arriving in any order, cancelled
        /// or finished at any time: no request's load is ever counted twice (nor dropped).
        #[test]
        fn load_is_never_counted_twice(ops in proptest::collection::vec(op(), 1..80)) {
            let mut w = Writer::new();
            let mut reqs: Vec<Req> = Vec::new();
            for op in ops {
                match op {
                    Op::Reserve { prompt, keyed } => {
                        let r = Req { n: reqs.len(), prompt, keyed, real: Real::Pending };
                        w.run(|b, _| {
                            b.apply(request_reserved(&r.rid(), 0, INC, prompt, None, None)).unwrap();
                        });
                        reqs.push(r);
                    }
                    Op::Arrive(i) => {
                        let Some(k) = pick(&reqs, i, |s| s == Real::Pending) else { continue };
                        reqs[k].real = Real::Arrived(0);
                        let r = reqs[k].clone();
                        w.report(&r.reported(), r.prompt, 0, !r.keyed);
                    }
                    Op::Step(i, t) => {
                        let Some(k) = pick(&reqs, i, |s| matches!(s, Real::Arrived(_))) else { continue };
                        let Real::Arrived(g) = reqs[k].real else { continue };
                        reqs[k].real = Real::Arrived(g + t);
                        let r = reqs[k].clone();
                        // the engine reports the prompt again (or 0: unknown; σ keeps it)
                        let prompt = if t % 2 == 0 { r.prompt } else { 0 };
                        w.report(&r.reported(), prompt, g + t, !r.keyed);
                    }
                    Op::Finish(i) => {
                        let Some(k) = pick(&reqs, i, |s| matches!(s, Real::Arrived(_))) else { continue };
                        let Real::Arrived(g) = reqs[k].real else { continue };
                        reqs[k].real = Real::Gone;
                        let id = reqs[k].reported();
                        w.run(|b, _| {
                            b.apply(request_finished(&id, g)).unwrap();
                        });
                    }
                    Op::Cancel(i) => {
                        let Some(k) = pick(&reqs, i, |s| s == Real::Pending) else { continue };
                        reqs[k].real = Real::Gone;
                        w.release(&reqs[k].rid());
                    }
                }
                check(&w, &reqs);
            }
        }
    }

    #[test]
    fn an_unkeyed_request_takes_the_oldest_reservation_and_its_fields() {
        let mut w = Writer::new();
        w.run(|b, _| {
            let hints = Hints {
                expected_output: Some(40),
                class: Some(9),
            };
            b.apply(request_reserved_hinted(
                "old",
                0,
                INC,
                300,
                Some(77),
                Some(64),
                hints,
            ))
            .unwrap();
            b.apply(request_reserved("new", 0, INC, 500, None, None))
                .unwrap();
        });
        // prompt 0: the engine does not know it yet; σ keeps the reservation's
        let got = w.report("cmpl-1", 0, 3, true).unwrap();
        let Adopted::Matched(taken) = got else {
            panic!("{got:?}")
        };
        assert_eq!(taken.id.as_str(), "old");
        assert!(w.sigma.request("old").is_none());
        let r = w.sigma.request("cmpl-1").unwrap();
        assert_eq!(
            (r.prompt_tokens, r.generated_tokens, r.phase),
            (300, 3, Phase::Running)
        );
        assert_eq!(
            (r.prompt_hash, r.max_tokens),
            (Some(77), Some(64)),
            "the reservation's fields"
        );
        assert_eq!(
            (r.hints.expected_output, r.hints.class),
            (Some(40), Some(9)),
            "and its hints"
        );
        assert_eq!(load(&w.sigma, 0), 303 + 500, "counted once");
        // no reservation left: new load
        w.run(|b, _| {
            b.apply(request_released("new")).unwrap();
        });
        assert_eq!(w.report("cmpl-2", 10, 1, true), Some(Adopted::Unmatched));
        assert_eq!(load(&w.sigma, 0), 303 + 11);
        // a keyed report of the taken id hands its place on (nothing left to hand: new load)
        w.report("old", 300, 1, false);
        assert_eq!(w.sigma.request_count(), 3);
        assert_eq!(w.replica.to_snapshot(), w.sigma.to_snapshot());
    }

    #[test]
    fn the_memory_of_taken_reservations_is_bounded() {
        let mut w = Writer::new();
        w.adoptions = Adoptions::new(4);
        for n in 0..50 {
            let (rid, uid) = (format!("r{n}"), format!("u{n}"));
            w.run(|b, _| {
                b.apply(request_reserved(&rid, 0, INC, 10, None, None))
                    .unwrap();
            });
            w.report(&uid, 10, 1, true);
            w.run(|b, _| {
                b.apply(request_finished(&uid, 1)).unwrap();
            });
            assert!(w.adoptions.len() <= 4);
        }
    }
}
