//! Every wire message a peer can send us: the first byte picks the message kind (a
//! `br_proto::fuzz::Target`), the rest is decoded as it and validated. A crash is a finding;
//! replay it under proptest's harness with `decode_and_validate`.
#![no_main]

use br_proto::fuzz::{Target, decode_and_validate};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Some((&which, bytes)) = data.split_first() {
        let target = Target::ALL[usize::from(which) % Target::ALL.len()];
        let _ = decode_and_validate(target, bytes);
    }
});
