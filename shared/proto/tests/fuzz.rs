//! Message fuzzing that CI runs: every decoder and validator a peer reaches, fed
//! arbitrary bytes and mutations of valid messages, through br-proto's fuzz harness (the same
//! entry the cargo-fuzz targets in `fuzz/` use). Nothing may panic, and a message that
//! validates must still validate after a re-encode (the harness asserts it).
//!
//! `PROPTEST_CASES` raises the count for a longer local run (`make fuzz-proptest`).

use br_proto::fuzz::{Outcome, Target, decode_and_validate};
use proptest::prelude::*;

/// One edit to a valid message's bytes.
#[derive(Debug, Clone)]
enum Edit {
    /// Overwrite the byte at (index mod len).
    Set(usize, u8),
    /// Insert bytes at (index mod len + 1).
    Insert(usize, Vec<u8>),
    /// Cut the message at (index mod len + 1).
    Truncate(usize),
    /// Repeat the whole message (protobuf merges repeated fields and last-wins scalars).
    Twice,
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
        2 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..12))
            .prop_map(|(i, b)| Edit::Insert(i, b)),
        1 => any::<usize>().prop_map(Edit::Truncate),
        1 => Just(Edit::Twice),
    ]
}

fn mutate(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for e in edits {
        if b.is_empty() {
            break;
        }
        match e {
            Edit::Set(i, v) => {
                let n = b.len();
                b[i % n] = *v;
            }
            Edit::Insert(i, bytes) => {
                let at = i % b.len() + 1;
                b.splice(at..at, bytes.iter().copied());
            }
            Edit::Truncate(i) => b.truncate(i % b.len() + 1),
            Edit::Twice => b.extend_from_within(..),
        }
    }
    b
}

fn target() -> impl Strategy<Value = Target> {
    prop::sample::select(Target::ALL.to_vec())
}

/// 2,000 cases per property in CI; `PROPTEST_CASES` sets another count.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(t in target(), bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_and_validate(t, &bytes);
    }

    #[test]
    fn mutated_valid_messages_never_panic(
        t in target(),
        pick in any::<usize>(),
        edits in prop::collection::vec(edit(), 1..6),
    ) {
        let seeds = t.seeds();
        let seed = &seeds[pick % seeds.len()];
        let _ = decode_and_validate(t, &mutate(seed, &edits));
    }
}

/// The seeds are valid, so mutation starts from messages that reach every validator's rules;
/// and the harness tells the three outcomes apart (a harness that always said "valid" or
/// "not decoded" would make the properties above empty).
#[test]
fn seeds_validate_and_the_outcomes_are_told_apart() {
    for t in Target::ALL {
        assert_eq!(Target::from_name(t.name()), Some(t));
        for s in t.seeds() {
            assert_eq!(decode_and_validate(t, &s), Outcome::Valid, "{t:?}");
        }
        // a field tag with wire type 7 does not exist
        assert_eq!(
            decode_and_validate(t, &[0x0f]),
            Outcome::NotDecoded,
            "{t:?}"
        );
    }
    // an empty message decodes (every field at its default) and is refused: no group
    assert!(matches!(
        decode_and_validate(Target::Assign, &[]),
        Outcome::Invalid(_)
    ));
}
