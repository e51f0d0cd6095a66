//! Requests per worker, with real processes: "four workers declaring capacity 1 put
//! 262,144 requests in σ (68 MB); a restarted decision then never became ready (the snapshot
//! is above its 64 MiB watch limit, logged only at DEBUG)". A direct `Snapshot.Apply` against
//! the real br-snapshot reports 65,536 requests on each of four capacity-1 workers: σ now keeps
//! at most capacity + `--worker-request-margin` per worker and refuses the rest WORKER_FULL
//! by index, and a real br-decision started (and restarted) afterwards becomes ready on it.
//! Also "a direct Apply accepts 20M tokens per request" and "max_tokens not enforced (5,000
//! tokens accepted against 16)": both refused INVALID now, σ untouched.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use br_e2e::Service;
use br_proto::v1;
use br_testkit::apply::{ApplyStream, hello, progress};

const GROUP: &str = "g";
const WORKERS: u32 = 4;
const REPORTED_PER_WORKER: u32 = 65_536;
const CHUNK: u32 = 16_384;
/// br-snapshot's default `--worker-request-margin`.
const MARGIN: u32 = 1_024;
const START: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_capacity_one_workers_cannot_fill_sigma_beyond_what_decision_reads() {
    let snapshot = Service::start("br-snapshot", &[]);
    snapshot.wait_for("/livez", START).await;
    let url = snapshot.grpc_url();
    let mut apply = ApplyStream::open(&url).await;
    apply
        .send_ok(
            GROUP,
            (0..WORKERS)
                .map(|w| hello(w, 10 + u64::from(w), 1))
                .collect(),
        )
        .await;
    // Ids of 253 bytes (the longest a Kubernetes name allows): all of them would be ~73 MB of snapshot, above
    // the 64 MiB decision decodes. In messages of 16,384 changes (as ingest coalesces), so the
    // acks of refused changes stay within the client's 4 MiB message limit.
    let mut refused = 0usize;
    for w in 0..WORKERS {
        let mut rejected = Vec::new();
        for chunk in 0..REPORTED_PER_WORKER / CHUNK {
            let changes = (chunk * CHUNK..(chunk + 1) * CHUNK)
                .map(|i| progress(w, 10 + u64::from(w), &format!("w{w}-{i:0>250}"), 100, 1))
                .collect();
            let ack = apply.send(GROUP, changes).await;
            rejected.extend(
                ack.rejected
                    .into_iter()
                    .map(|r| (chunk * CHUNK + r.index, r)),
            );
        }
        // The first capacity + margin are kept, the rest refused one by one, WORKER_FULL.
        let held = 1 + MARGIN;
        assert_eq!(rejected.len(), (REPORTED_PER_WORKER - held) as usize);
        assert_eq!(rejected[0].0, held);
        assert!(
            rejected
                .iter()
                .all(|(_, r)| r.reason == v1::RejectReason::WorkerFull as i32),
            "{:?}",
            rejected.first()
        );
        refused += rejected.len();
    }
    // A request of 20M tokens (each count within the wire's 10M) is refused, typed.
    let ack = apply
        .send(GROUP, vec![progress(0, 10, "huge", 10_000_000, 10_000_000)])
        .await;
    assert_eq!(ack.rejected.len(), 1);
    assert_eq!(ack.rejected[0].reason, v1::RejectReason::Invalid as i32);

    let mut client = v1::snapshot_client::SnapshotClient::connect(url.clone())
        .await
        .unwrap()
        .max_decoding_message_size(usize::MAX);

    // The "5,000 tokens accepted against 16": a reservation with max_tokens 16, then
    // its worker reports 5,000 generated tokens. Refused INVALID; σ keeps the valid count.
    apply.send_ok(GROUP, vec![hello(WORKERS, 99, 4)]).await;
    let reserved = client
        .reserve(v1::ReserveRequest {
            group: GROUP.into(),
            reservations: vec![v1::Reservation {
                request_id: "capped".into(),
                worker_id: WORKERS,
                incarnation: 99,
                prompt_tokens: 100,
                max_tokens: Some(16),
                ..Default::default()
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reserved.accepted, vec!["capped".to_string()]);
    apply
        .send_ok(GROUP, vec![progress(WORKERS, 99, "capped", 100, 16)])
        .await;
    let ack = apply
        .send(GROUP, vec![progress(WORKERS, 99, "capped", 100, 5_000)])
        .await;
    assert_eq!(ack.rejected.len(), 1);
    assert_eq!(ack.rejected[0].reason, v1::RejectReason::Invalid as i32);
    assert!(ack.rejected[0].detail.contains("max_tokens 16"), "{ack:?}");
    let mut sigma = client
        .get(v1::GetRequest {
            group: GROUP.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let capped = sigma.requests.iter().find(|r| r.request_id == "capped");
    assert_eq!(capped.map(|r| r.generated_tokens), Some(16));
    sigma.requests.retain(|r| r.request_id != "capped");
    assert_eq!(sigma.requests.len(), (WORKERS * (1 + MARGIN)) as usize);
    eprintln!(
        "σ holds {} requests, {} bytes encoded",
        sigma.requests.len(),
        prost::Message::encoded_len(&sigma)
    );
    for w in 0..WORKERS {
        let on_w = sigma.requests.iter().filter(|r| r.worker_id == w).count();
        assert_eq!(on_w, (1 + MARGIN) as usize, "worker {w}");
    }
    let metrics = br_testkit::http::metrics_url(&snapshot.admin_url("/metrics")).await;
    let worker_full = metrics.value(
        "balanceroute_snapshot_rejected_total",
        &[("reason", "worker_full")],
    );
    assert_eq!(worker_full as usize, refused);

    // A decision started now (as after a restart) reads σ and becomes ready; so does one
    // killed and restarted.
    let mut decision = Service::start("br-decision", &["--snapshot-addr", &url, "--groups", GROUP]);
    decision.wait_for("/readyz", START).await;
    decision.restart();
    decision.wait_for("/readyz", START).await;
}
