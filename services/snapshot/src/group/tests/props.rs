//! The property: random telemetry, reservations, time and watchers, and every watcher ends at
//! the writer's σ; with the cases it once failed on, kept as named tests.

use super::*;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

#[derive(Debug, Clone)]
enum Op {
    Hello(u32, u64, StreamId),
    Gone(u32, u64, StreamId),
    StreamEnd(StreamId),
    Progress(u32, u64, u8, u32, u32, bool),
    Sync(u32, u64, Vec<u8>),
    Reserve(u8, u32, u64, u32),
    Release(u8),
    Tick(u64),
    /// Subscribe holding a past version (index into the recorded ones) or from scratch.
    Subscribe(Option<usize>),
    /// Read up to n events of watcher i.
    Read(usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0u32..3;
    let inc = 1u64..3;
    let st = 1u64..3;
    let r = 0u8..8;
    prop_oneof![
        3 => (w.clone(), inc.clone(), st.clone()).prop_map(|(a, b, c)| Op::Hello(a, b, c)),
        1 => (w.clone(), inc.clone(), st.clone()).prop_map(|(a, b, c)| Op::Gone(a, b, c)),
        1 => st.prop_map(Op::StreamEnd),
        6 => (w.clone(), inc.clone(), r.clone(), 0u32..50, 0u32..50, proptest::bool::weighted(0.2))
            .prop_map(|(a, b, c, d, e, f)| Op::Progress(a, b, c, d, e, f)),
        1 => (w.clone(), inc.clone(), proptest::collection::vec(0u8..8, 0..4)).prop_map(|(a, b, c)| Op::Sync(a, b, c)),
        3 => (r.clone(), w, inc, 1u32..50).prop_map(|(a, b, c, d)| Op::Reserve(a, b, c, d)),
        1 => r.prop_map(Op::Release),
        2 => (0u64..7000).prop_map(Op::Tick),
        1 => proptest::option::of(0usize..64).prop_map(Op::Subscribe),
        3 => (0usize..8, 0usize..6).prop_map(|(a, b)| Op::Read(a, b)),
    ]
}

struct Follower {
    /// Read as the Watch stream reads it: queued deltas merged.
    rx: MergedWatchQueue,
    replica: Option<Sigma>,
    awaiting_snapshot: bool,
}

impl Follower {
    fn read(&mut self, n: usize) {
        for _ in 0..n {
            let Some(Ok(ev)) = self.rx.try_recv() else {
                return;
            };
            let ev = crate::wire::watch_event(&ev);
            match ev.kind.as_ref().unwrap() {
                Ev::Snapshot(s) => {
                    self.replica = Some(Sigma::from_snapshot(s).unwrap());
                    self.awaiting_snapshot = false;
                }
                Ev::Delta(d) => {
                    assert!(
                        !self.awaiting_snapshot,
                        "a delta between a reset and its snapshot"
                    );
                    // a delta always continues what the watcher holds
                    self.replica.as_mut().unwrap().apply_delta(d).unwrap();
                }
                Ev::Reset(_) => self.awaiting_snapshot = true,
                Ev::Progress(p) => {
                    let r = self.replica.as_ref().unwrap();
                    assert_eq!((p.epoch, p.version), (r.epoch(), r.version()));
                }
            }
        }
    }
}

fn id(r: u8) -> String {
    format!("q{r}")
}

/// Runs `ops` against one group, checking after each that it made at most one version, then
/// lets every watcher read everything and checks that each holds the writer's σ.
fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let (mut g, start) = group_with(Settings {
        history: 6,
        reservation_ttl: Duration::from_secs(3),
        worker_grace: Duration::from_secs(2),
        carrier_grace: Duration::from_secs(1),
        progress_interval: Duration::from_millis(500),
        watcher_queue: 3,
        ..Settings::default()
    });
    let mut now = start;
    let mut seq = 0;
    let mut versions: Vec<Sigma> = vec![Sigma::from_snapshot(&g.snapshot()).unwrap()];
    let mut followers: Vec<Follower> = Vec::new();
    for op in ops {
        seq += 1;
        match op {
            Op::Hello(w, i, s) => {
                g.apply_msgs(seq, vec![hello(w, i, 3)], s, now, 0);
            }
            Op::Gone(w, i, s) => {
                g.apply_msgs(seq, vec![gone(w, i, 0)], s, now, 0);
            }
            Op::StreamEnd(s) => g.stream_ended(s, now),
            Op::Progress(w, i, r, p, gen_tokens, fin) => {
                g.apply_msgs(seq, vec![prog(w, i, &id(r), p, gen_tokens, fin)], 1, now, 0);
            }
            Op::Sync(w, i, rs) => {
                let ids: Vec<String> = rs.iter().map(|r| id(*r)).collect();
                let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
                g.apply_msgs(seq, vec![sync(w, i, &refs)], 1, now, 0);
            }
            Op::Reserve(r, w, i, p) => {
                g.reserve_msgs(vec![res(&id(r), w, i, p)], now);
            }
            Op::Release(r) => {
                g.release(&[RequestId::new(&id(r)).unwrap()], now);
            }
            Op::Tick(ms) => {
                now += Duration::from_millis(ms);
                g.tick(now);
            }
            Op::Subscribe(at) => {
                let (epoch, held) = match at {
                    Some(i) => {
                        let v = &versions[i % versions.len()];
                        (77, Some(v.clone()))
                    }
                    None => (0, None),
                };
                let v = held.as_ref().map_or(0, Sigma::version);
                followers.push(Follower {
                    rx: g.subscribe(epoch, v).merging(),
                    replica: held,
                    awaiting_snapshot: false,
                });
            }
            Op::Read(i, n) => {
                if let Some(f) = followers.get_mut(i) {
                    f.read(n);
                }
            }
        }
        if g.version() as usize == versions.len() {
            versions.push(Sigma::from_snapshot(&g.snapshot()).unwrap());
        }
        prop_assert_eq!(
            g.version() as usize + 1,
            versions.len(),
            "one version per change"
        );
    }
    // everyone reads everything; lagging watchers get their reset and snapshot
    for _ in 0..2 {
        for f in &mut followers {
            f.read(usize::MAX);
        }
        g.tick(now);
    }
    let want = g.snapshot();
    for f in &followers {
        prop_assert!(!f.awaiting_snapshot);
        prop_assert_eq!(&f.replica.as_ref().unwrap().to_snapshot(), &want);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn every_watcher_ends_at_the_writers_sigma(ops in proptest::collection::vec(op(), 1..150)) {
        run(ops)?;
    }
}

/// The case saved in `proptest-regressions/group/tests/props.txt` (proptest replays the seed
/// too; this keeps the case if the strategy changes): both watchers' queues fill with progress
/// marks and a delta, a new incarnation's delta makes both lag, one reads and has room again
/// when a reservation's delta lands; both must still end at the writer's σ.
#[test]
fn regression_two_lagging_watchers_one_reads_before_the_next_delta() {
    run(vec![
        Op::Subscribe(None),
        Op::Subscribe(None),
        Op::Tick(500),
        Op::Hello(0, 1, 1),
        Op::Tick(500),
        Op::Hello(0, 2, 1),
        Op::Read(0, 3),
        Op::Reserve(0, 0, 2, 1),
    ])
    .unwrap();
}
