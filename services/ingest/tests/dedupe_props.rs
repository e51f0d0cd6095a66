//! Property tests for telemetry dedupe: a worker's cumulative reports, delivered in any order
//! with any duplication, end in the same state as the in-order sequence.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::Instant;

use br_ingest::change::{Change, Cumulative};
use br_ingest::coalesce::Coalescer;
use br_ingest::session::{Limits, Session, Step};
use br_proto::v1;
use br_proto::valid::{GroupId, RequestId, ValidHello};
use proptest::prelude::*;

type State = BTreeMap<String, Cumulative>;

/// One step of a worker: request `r` generated `delta` more tokens (and maybe finished).
#[derive(Debug, Clone)]
struct StepIn {
    r: usize,
    delta: u32,
    finish: bool,
}

fn steps() -> impl Strategy<Value = Vec<StepIn>> {
    prop::collection::vec(
        (0usize..5, 0u32..20, prop::bool::weighted(0.1)).prop_map(|(r, delta, finish)| StepIn {
            r,
            delta,
            finish,
        }),
        1..40,
    )
}

/// The worker's messages in order (one per step, carrying that request's cumulative state),
/// and its final state.
fn worker_messages(steps: &[StepIn]) -> (Vec<v1::WorkerReport>, State) {
    let mut state = State::new();
    let mut msgs = Vec::new();
    for (i, s) in steps.iter().enumerate() {
        let id = format!("req-{}", s.r);
        let c = state.entry(id.clone()).or_insert(Cumulative {
            prompt_tokens: 100 + s.r as u32,
            ..Cumulative::default()
        });
        c.generated_tokens += s.delta;
        c.finished |= s.finish;
        msgs.push(report(i as u64 + 1, false, &[(id, *c)]));
    }
    (msgs, state)
}

fn report(seq: u64, full: bool, ups: &[(String, Cumulative)]) -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Progress(v1::Progress {
            seq,
            full_state: full,
            updates: ups
                .iter()
                .map(|(id, c)| v1::RequestProgress {
                    request_id: id.clone(),
                    prompt_tokens: c.prompt_tokens,
                    generated_tokens: c.generated_tokens,
                    finished: c.finished,
                    unkeyed: false,
                })
                .collect(),
            traceparent: String::new(),
            tracestate: String::new(),
        })),
    }
}

fn session() -> Session {
    Session::new(
        ValidHello {
            group: GroupId::new("g").unwrap(),
            worker_id: 1,
            incarnation: 9,
            capacity: 8,
            endpoint: String::new(),
        },
        Limits::default(),
        Instant::now(),
    )
}

/// What the snapshot side makes of the changes: max() per request.
fn sink(into: &mut State, changes: Vec<Change>) {
    for c in changes {
        if let Change::Progress {
            request_id, state, ..
        } = c
        {
            into.entry(request_id.as_str().to_owned())
                .or_default()
                .merge(state);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Through ingest's stream logic: whatever order and duplication the messages arrive in,
    /// the snapshot side never sees more than the worker said, a reordering always makes
    /// ingest ask for a full state, and after the full state it holds exactly the in-order
    /// final state.
    #[test]
    fn any_delivery_then_full_state_equals_in_order(
        steps in steps(),
        picks in prop::collection::vec(any::<prop::sample::Index>(), 0..80),
    ) {
        let (msgs, final_state) = worker_messages(&steps);
        let mut s = session();
        let mut seen = State::new();
        let mut asked = false;
        let mut last = 0u64;
        let mut reordered = false;
        let now = Instant::now();
        for p in &picks {
            let i = p.index(msgs.len());
            let seq = i as u64 + 1;
            reordered |= seq < last;
            last = last.max(seq);
            let Step::Reply(r) = s.on_message(msgs[i].clone(), now) else {
                panic!("stream ended")
            };
            asked |= r.full_state_requested;
            sink(&mut seen, r.changes);
        }
        // Never more than the worker reported.
        for (id, c) in &seen {
            let truth = final_state[id];
            prop_assert!(c.generated_tokens <= truth.generated_tokens);
            prop_assert!(!c.finished || truth.finished);
        }
        prop_assert!(!reordered || asked, "a reordering must ask for a full state");

        // The worker's periodic (or requested) full state repairs everything.
        let full: Vec<(String, Cumulative)> =
            final_state.iter().map(|(k, v)| (k.clone(), *v)).collect();
        let Step::Reply(r) = s.on_message(report(msgs.len() as u64 + 1, true, &full), now) else {
            panic!("stream ended")
        };
        sink(&mut seen, r.changes);
        prop_assert_eq!(&seen, &final_state);
        let tracked: State = s.tracked().map(|(k, c)| (k.as_str().to_owned(), c)).collect();
        prop_assert_eq!(&tracked, &final_state);
    }

    /// In order (duplicates allowed), no full state is needed at all.
    #[test]
    fn in_order_with_duplicates_needs_no_repair(
        steps in steps(),
        dups in prop::collection::vec(0usize..3, 40),
    ) {
        let (msgs, final_state) = worker_messages(&steps);
        let mut s = session();
        let mut seen = State::new();
        let now = Instant::now();
        for (i, m) in msgs.iter().enumerate() {
            for _ in 0..=dups[i % dups.len()] {
                let Step::Reply(r) = s.on_message(m.clone(), now) else { panic!() };
                prop_assert!(!r.full_state_requested);
                sink(&mut seen, r.changes);
            }
        }
        prop_assert_eq!(seen, final_state);
    }

    /// The coalescing buffer and the snapshot's max(): any interleaving and duplication of the
    /// cumulative reports, taken out in any chunk sizes, gives the in-order final state.
    #[test]
    fn coalescing_any_interleaving_equals_in_order(
        steps in steps(),
        order in prop::collection::vec(any::<prop::sample::Index>(), 0..80),
        chunks in prop::collection::vec(1usize..7, 1..10),
    ) {
        let g = GroupId::new("g").unwrap();
        // Every cumulative report as a change; each delivered at least once, in any order.
        let mut reports = Vec::new();
        let mut state = State::new();
        for s in &steps {
            let id = format!("req-{}", s.r);
            let c = state.entry(id.clone()).or_default();
            c.generated_tokens += s.delta;
            c.finished |= s.finish;
            reports.push((id, *c));
        }
        let mut delivery: Vec<usize> = (0..reports.len()).collect();
        for (k, p) in order.iter().enumerate() {
            let j = p.index(reports.len());
            delivery.insert(k.min(delivery.len()), j);
        }
        let mut buf = Coalescer::new(1 << 20);
        let mut seen = State::new();
        let mut dropped = Vec::new();
        let mut ci = 0;
        for (n, &i) in delivery.iter().enumerate() {
            let (id, c) = &reports[i];
            buf.push(&g, Change::Progress {
                worker_id: 1,
                incarnation: 9,
                request_id: RequestId::new(id).unwrap(),
                state: *c,
            }, &mut dropped);
            if n % 3 == 2 {
                let taken = buf.take(chunks[ci % chunks.len()]);
                ci += 1;
                sink(&mut seen, taken.into_iter().map(|(_, c)| c).collect());
            }
        }
        sink(&mut seen, buf.take(usize::MAX).into_iter().map(|(_, c)| c).collect());
        prop_assert!(dropped.is_empty());
        prop_assert!(buf.is_empty());
        prop_assert_eq!(seen, state);
    }
}
