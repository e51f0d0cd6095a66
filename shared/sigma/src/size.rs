//! How large σ's one-message snapshot can get, so that the writer's bounds keep it deliverable.
//!
//! A watcher (decision's replica) receives σ as one `WatchEvent` holding a `ClusterSnapshot`,
//! and its gRPC client refuses a message above its decoding limit; a group whose snapshot
//! outgrew that limit could never be followed again (a restarted decision would never become
//! ready). [`max_snapshot_bytes`] is the exact worst case of that message for a group of at
//! most `requests` requests, every field at its contract limit (ids, endpoints and carriers at
//! their longest, counts at their largest varints, all 1,024 worker ids present); the writer's
//! `--max-group-requests` must keep it within [`MAX_SNAPSHOT_MESSAGE_BYTES`].

use br_proto::v1;
use br_proto::valid::limits;
use prost::Message as _;

use crate::{MAX_CARRIER_BYTES, MAX_WORKER_ID};

/// The largest message a watcher decodes (br-client's default Watch limit), and so the largest
/// snapshot the writer may ever have to send.
pub const MAX_SNAPSHOT_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// Default bound on the requests of one group: its worst-case snapshot
/// (`max_snapshot_bytes(200_000)`, about 61 MiB) fits [`MAX_SNAPSHOT_MESSAGE_BYTES`]. A
/// 144-rank wide-EP group with 1,024 slots per rank holds 147,456.
pub const DEFAULT_MAX_GROUP_REQUESTS: usize = 200_000;

/// The largest encoded `WatchEvent` carrying the snapshot of a group with at most `requests`
/// requests and every possible worker, each field at its contract limit.
pub fn max_snapshot_bytes(requests: usize) -> usize {
    let header = v1::ClusterSnapshot {
        group: "g".repeat(limits::MAX_GROUP_BYTES),
        epoch: u64::MAX,
        version: u64::MAX,
        workers: Vec::new(),
        requests: Vec::new(),
    };
    let workers = (MAX_WORKER_ID as usize + 1) * repeated_len(&largest_worker());
    let body = header
        .encoded_len()
        .saturating_add(workers)
        .saturating_add(requests.saturating_mul(repeated_len(&largest_request())));
    // WatchEvent { snapshot = 1 }: one key byte and the body's length delimiter.
    1 + prost::encoding::encoded_len_varint(body as u64) + body
}

/// One entry of a repeated message field: key byte, length delimiter, body.
fn repeated_len(m: &impl prost::Message) -> usize {
    let len = m.encoded_len();
    1 + prost::encoding::encoded_len_varint(len as u64) + len
}

fn largest_worker() -> v1::WorkerState {
    v1::WorkerState {
        worker_id: MAX_WORKER_ID,
        incarnation: u64::MAX,
        capacity: limits::MAX_CAPACITY,
        endpoint: "e".repeat(limits::MAX_ENDPOINT_BYTES),
        liveness: v1::Liveness::Fenced as i32,
        load_tokens: u64::MAX,
        carrier: "c".repeat(MAX_CARRIER_BYTES),
        cordoned: true,
    }
}

fn largest_request() -> v1::RequestState {
    v1::RequestState {
        request_id: "r".repeat(limits::MAX_ID_BYTES),
        worker_id: MAX_WORKER_ID,
        incarnation: u64::MAX,
        prompt_tokens: limits::MAX_TOKENS,
        generated_tokens: limits::MAX_TOKENS,
        state: v1::RequestPhase::Active as i32,
        prompt_hash: Some(u64::MAX),
        max_tokens: Some(limits::MAX_TOKENS),
        expected_output_tokens: Some(limits::MAX_TOKENS),
        request_class_id: Some(u64::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_group_bound_fits_a_watchers_message() {
        let worst = max_snapshot_bytes(DEFAULT_MAX_GROUP_REQUESTS);
        assert!(
            worst <= MAX_SNAPSHOT_MESSAGE_BYTES,
            "{worst} bytes above {MAX_SNAPSHOT_MESSAGE_BYTES}"
        );
        // And the bound is not needlessly low: 10% more requests would not fit.
        assert!(
            max_snapshot_bytes(DEFAULT_MAX_GROUP_REQUESTS * 11 / 10) > MAX_SNAPSHOT_MESSAGE_BYTES
        );
    }

    #[test]
    fn the_worst_case_is_the_encoded_size_of_such_a_snapshot() {
        let snap = v1::ClusterSnapshot {
            group: "g".repeat(limits::MAX_GROUP_BYTES),
            epoch: u64::MAX,
            version: u64::MAX,
            workers: (0..=MAX_WORKER_ID)
                .map(|id| v1::WorkerState {
                    worker_id: id,
                    ..largest_worker()
                })
                .collect(),
            requests: (0..3)
                .map(|i| v1::RequestState {
                    request_id: format!("{i:0>256}"),
                    ..largest_request()
                })
                .collect(),
        };
        let ev = v1::WatchEvent {
            kind: Some(v1::watch_event::Kind::Snapshot(snap)),
        };
        // Smaller worker ids encode shorter, so the real message is at most the bound.
        assert!(ev.encoded_len() <= max_snapshot_bytes(3));
        assert!(ev.encoded_len() + 1024 * 2 >= max_snapshot_bytes(3));
    }
}
