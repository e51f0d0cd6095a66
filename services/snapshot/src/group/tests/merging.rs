//! A watcher's queue read as its Watch stream reads it (`queue::Merging`): random deltas,
//! snapshots, resets, progress marks, gaps and epochs pushed, read at random moments; what
//! comes out is what went in, with runs of queued deltas merged within the bounds.

use super::queue::{self, Merging};
use super::*;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    /// A delta continuing the last one: its changes' request id lengths.
    Delta(Vec<usize>),
    /// The next delta skips versions (as a lagging watcher's would, were it not reset).
    Gap,
    /// The next delta is of a new epoch.
    NewEpoch,
    Snapshot,
    Reset,
    Progress,
    /// Reads up to n items.
    Read(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let small = proptest::collection::vec(1usize..16, 0..4);
    // Enough changes that a few deltas pass MERGE_MAX_CHANGES.
    let many = (1000usize..1500).prop_map(|n| vec![1; n]);
    // Big enough that four pass MERGE_MAX_BYTES.
    let big = (20_000usize..25_000).prop_map(|n| vec![n]);
    prop_oneof![
        12 => small.prop_map(Op::Delta),
        1 => many.prop_map(Op::Delta),
        1 => big.prop_map(Op::Delta),
        1 => Just(Op::Gap),
        1 => Just(Op::NewEpoch),
        1 => Just(Op::Snapshot),
        1 => Just(Op::Reset),
        1 => Just(Op::Progress),
        3 => (0usize..6).prop_map(Op::Read),
    ]
}

fn released(id: String) -> v1::Change {
    v1::Change {
        kind: Some(v1::change::Kind::RequestReleased(
            v1::change::RequestReleased { request_id: id },
        )),
    }
}

fn delta_of(ev: &Event) -> Option<&Delta> {
    match ev {
        Event::Delta(d) => Some(d),
        _ => None,
    }
}

/// Reads up to `n` items; each read item with the number of the read call it came from.
fn read(rx: &mut Merging, n: usize, call: usize, out: &mut Vec<(Event, usize)>) {
    for _ in 0..n {
        match rx.try_recv() {
            Some(Ok(ev)) => out.push((ev, call)),
            Some(Err(o)) => panic!("no overflow was possible: {o:?}"),
            None => return,
        }
    }
}

/// Checks `out` against `sent`; returns the number of messages.
fn check(sent: &[Event], out: &[(Event, usize)]) -> Result<(), TestCaseError> {
    let mut i = 0;
    // The inputs of the previous output delta and the read call it came from.
    let mut previous: Option<(std::ops::Range<usize>, usize)> = None;
    for (ev, call) in out {
        let Some(d) = delta_of(ev) else {
            prop_assert!(i < sent.len(), "more out than in");
            prop_assert_eq!(wire::watch_event(ev), wire::watch_event(&sent[i]));
            i += 1;
            previous = None;
            continue;
        };
        // One or more sent deltas, continuing each other, make up this one.
        let start = i;
        let mut version = d.prev_version;
        let mut changes: Vec<v1::Change> = Vec::new();
        while version < d.version {
            let Some(s) = sent.get(i).and_then(delta_of) else {
                return Err(TestCaseError::fail(format!(
                    "out delta {}..{} is not made of sent deltas (at {i})",
                    d.prev_version, d.version
                )));
            };
            prop_assert_eq!((s.epoch, s.prev_version), (d.epoch, version));
            version = s.version;
            changes.extend(s.changes.iter().cloned());
            i += 1;
        }
        prop_assert_eq!(version, d.version);
        prop_assert!(i > start);
        prop_assert_eq!(&changes, &d.changes);
        let bytes: usize = sent[start..i].iter().map(event_bytes).sum();
        if i - start > 1 {
            prop_assert!(bytes <= MERGE_MAX_BYTES, "{} bytes merged", bytes);
            prop_assert!(event_bytes(ev) <= MERGE_MAX_BYTES);
            prop_assert!(changes.len() <= MERGE_MAX_CHANGES);
        }
        // Within one read call nothing was pushed: a delta continuing the previous one was
        // already queued when that one was taken, so only a bound kept them apart.
        if let Some((prev, prev_call)) = previous.take() {
            let p = delta_of(&sent[prev.end - 1]).unwrap();
            let s = delta_of(&sent[start]).unwrap();
            if prev_call == *call && p.epoch == s.epoch && p.version == s.prev_version {
                let prev_bytes: usize = sent[prev.clone()].iter().map(event_bytes).sum();
                let prev_changes: usize = sent[prev]
                    .iter()
                    .filter_map(delta_of)
                    .map(|d| d.changes.len())
                    .sum();
                prop_assert!(
                    prev_bytes + event_bytes(&sent[start]) > MERGE_MAX_BYTES
                        || prev_changes + s.changes.len() > MERGE_MAX_CHANGES,
                    "two queued deltas within the bounds were not merged"
                );
            }
        }
        previous = Some((start..i, *call));
    }
    prop_assert_eq!(i, sent.len(), "not everything sent came out");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn merged_reads_carry_every_change_in_order_within_the_bounds(
        ops in proptest::collection::vec(op(), 1..80)
    ) {
        let (tx, rx) = queue::channel(1 << 20, usize::MAX / 2, &Arc::new(WatcherBudget::new(usize::MAX)));
        let mut rx = rx.merging();
        let (mut epoch, mut version, mut next_id) = (1u64, 0u64, 0usize);
        let mut sent: Vec<Event> = Vec::new();
        let mut out: Vec<(Event, usize)> = Vec::new();
        let push = |ev: Event, sent: &mut Vec<Event>| {
            let bytes = event_bytes(&ev);
            prop_assert_eq!(tx.try_send(ev.clone(), bytes), queue::Push::Queued);
            sent.push(ev);
            Ok(())
        };
        for (call, op) in ops.into_iter().enumerate() {
            match op {
                Op::Delta(lens) => {
                    let changes = lens
                        .into_iter()
                        .map(|n| {
                            next_id += 1;
                            released(format!("{next_id}-{}", "x".repeat(n)))
                        })
                        .collect();
                    let d = Delta { epoch, prev_version: version, version: version + 1, changes };
                    version += 1;
                    push(Event::Delta(Arc::new(d)), &mut sent)?;
                }
                Op::Gap => version += 2,
                Op::NewEpoch => {
                    epoch += 1;
                    version = 0;
                }
                Op::Snapshot => {
                    let s = v1::ClusterSnapshot { epoch, version, ..Default::default() };
                    push(Event::Snapshot(Arc::new(s)), &mut sent)?;
                }
                Op::Reset => push(
                    Event::Reset { reason: v1::ResetReason::SlowConsumer, epoch, detail: "r".into() },
                    &mut sent,
                )?,
                Op::Progress => push(Event::Progress { epoch, version }, &mut sent)?,
                Op::Read(n) => read(&mut rx, n, call, &mut out),
            }
        }
        read(&mut rx, usize::MAX, usize::MAX, &mut out);
        check(&sent, &out)?;
    }
}

#[test]
fn a_lone_delta_comes_at_once_and_queued_ones_in_one_message() {
    let (tx, rx) = queue::channel(64, 1 << 20, &Arc::new(WatcherBudget::new(usize::MAX)));
    let mut rx = rx.merging();
    let delta = |v: u64| {
        Event::Delta(Arc::new(Delta {
            epoch: 1,
            prev_version: v - 1,
            version: v,
            changes: vec![released(format!("r{v}"))],
        }))
    };
    let send = |ev: Event| {
        assert_eq!(
            tx.try_send(ev.clone(), event_bytes(&ev)),
            queue::Push::Queued
        )
    };
    assert!(rx.try_recv().is_none());
    send(delta(1));
    let Some(Ok(Event::Delta(d))) = rx.try_recv() else {
        panic!()
    };
    assert_eq!((d.prev_version, d.version), (0, 1));
    for v in 2..=9 {
        send(delta(v));
    }
    send(Event::Progress {
        epoch: 1,
        version: 9,
    });
    send(delta(10));
    let Some(Ok(Event::Delta(d))) = rx.try_recv() else {
        panic!()
    };
    assert_eq!((d.prev_version, d.version, d.changes.len()), (1, 9, 8));
    assert!(matches!(
        rx.try_recv(),
        Some(Ok(Event::Progress { version: 9, .. }))
    ));
    let Some(Ok(Event::Delta(d))) = rx.try_recv() else {
        panic!()
    };
    assert_eq!((d.prev_version, d.version), (9, 10));
    assert!(rx.try_recv().is_none());
}
