//! Test fixtures: one small wire snapshot that the summary tests here and brctl's table tests
//! both read, so the two views of σ are checked against the same group. Built only for tests
//! (`cfg(test)`) and for dependents that enable the `fixtures` feature as a dev-dependency.

use br_proto::v1;

/// A worker of incarnation `0xab` and capacity 8 in `liveness`.
pub fn worker(id: u32, liveness: v1::Liveness) -> v1::WorkerState {
    v1::WorkerState {
        worker_id: id,
        incarnation: 0xab,
        capacity: 8,
        liveness: liveness as i32,
        ..Default::default()
    }
}

/// A request on worker `w` (incarnation `0xab`), reserved or active.
pub fn request(id: &str, w: u32, prompt: u32, generated: u32, reserved: bool) -> v1::RequestState {
    v1::RequestState {
        request_id: id.into(),
        worker_id: w,
        incarnation: 0xab,
        prompt_tokens: prompt,
        generated_tokens: generated,
        state: if reserved {
            v1::RequestPhase::Reserved
        } else {
            v1::RequestPhase::Active
        } as i32,
        ..Default::default()
    }
}

/// Group "g" at epoch 3, version 9: worker 0 live (requests "b" active, 100 + 20 tokens, and
/// "a" reserved, 30), worker 1 suspect ("c" active, 50), worker 2 fenced (none). Workers and
/// requests are deliberately out of order.
pub fn snapshot() -> v1::ClusterSnapshot {
    v1::ClusterSnapshot {
        group: "g".into(),
        epoch: 3,
        version: 9,
        workers: vec![
            worker(2, v1::Liveness::Fenced),
            worker(1, v1::Liveness::Suspect),
            worker(0, v1::Liveness::Live),
        ],
        requests: vec![
            request("b", 0, 100, 20, false),
            request("a", 0, 30, 0, true),
            request("c", 1, 50, 0, false),
        ],
    }
}
