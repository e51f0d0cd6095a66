//! Unfinished gRPC messages cost a bounded amount of memory, with real processes: an attacker
//! opens many HTTP/2 streams to the open `grpc.health.v1.Health/Check` (no role needed), each
//! sending most of a 3.9 MiB message and never finishing it. Measured before the budget
//! (docs/design/0014-in-flight-bytes.md): each stream made the server hold its message, 64
//! of them took br-all above 250 MB. Now the process holds at most its in-flight budget, the
//! refusals are counted, a normal Assign (a small message, never held partial) is served
//! during the attack, and once the attacker goes the memory goes back to the system (within 2x
//! of the idle RSS within 30 s: the allocator's background purge, not a trim someone calls).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::Duration;

use br_e2e::{FakeWorker, Service, rss_bytes};
use br_proto::v1::{self, AssignRequest, GetRequest};
use br_testkit::eventually;
use bytes::Bytes;

const GROUP: &str = "inflight";
const START: Duration = Duration::from_secs(60);
/// A hang guard for one wait on a loaded 2-core machine, not a timing assertion.
const LONG: Duration = Duration::from_secs(60);
/// Connections and streams on each: 64 streams, 8 on each of 8 connections.
const CONNECTIONS: usize = 8;
const STREAMS_PER_CONNECTION: usize = 8;
/// What each stream's message says it is (under tonic's 4 MiB default) ...
const DECLARED: usize = 4_089_446; // 3.9 MiB
/// ... and how much of it the attacker sends before it stops.
const SENT: usize = 3_984_588; // 3.8 MiB
/// The bound asked of the process while it is attacked.
const RSS_LIMIT_BYTES: u64 = 150 << 20;

/// How one attacking stream ended up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attack {
    /// Every byte it meant to send was accepted by the server's flow control, and the stream
    /// is still open: the server holds the unfinished message.
    Holding,
    /// The server ended the stream (a refusal) before it had sent everything.
    Refused,
}

/// Sends the gRPC header of a `DECLARED`-byte message and `SENT` bytes of it on `stream`,
/// never the rest; returns when it sent them all or the server ended the stream.
async fn send_most_of_a_message(stream: &mut h2::SendStream<Bytes>, payload: Bytes) -> Attack {
    let mut message = vec![0u8];
    message.extend_from_slice(&u32::try_from(DECLARED).unwrap().to_be_bytes());
    for mut next in [Bytes::from(message), payload] {
        while !next.is_empty() {
            stream.reserve_capacity(next.len());
            let granted = match std::future::poll_fn(|cx| stream.poll_capacity(cx)).await {
                Some(Ok(n)) if n > 0 => n,
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => return Attack::Refused,
            };
            let chunk = next.split_to(granted.min(next.len()));
            if stream.send_data(chunk, false).is_err() {
                return Attack::Refused;
            }
        }
    }
    Attack::Holding
}

/// Opens `CONNECTIONS` × `STREAMS_PER_CONNECTION` streams to `path` on `addr`, each sending
/// most of a large message; returns how each ended up and what keeps them open.
async fn attack(addr: SocketAddr, path: &str) -> (Vec<Attack>, Vec<impl Sized>) {
    let payload = Bytes::from(vec![0x5a; SENT]);
    let mut tasks = Vec::new();
    for _ in 0..CONNECTIONS {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, conn) = h2::client::Builder::new()
            .initial_window_size(1 << 20)
            .handshake::<_, Bytes>(tcp)
            .await
            .unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        for _ in 0..STREAMS_PER_CONNECTION {
            let mut send = send.clone().ready().await.unwrap();
            let req = http::Request::post(format!("http://{addr}{path}"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(())
                .unwrap();
            let (response, mut stream) = send.send_request(req, false).unwrap();
            let payload = payload.clone();
            tasks.push(tokio::spawn(async move {
                let outcome = send_most_of_a_message(&mut stream, payload).await;
                // kept open: the attacker never finishes
                (outcome, (send, stream, response))
            }));
        }
    }
    let mut outcomes = Vec::new();
    let mut held = Vec::new();
    for t in tasks {
        let (o, h) = tokio::time::timeout(LONG, t).await.unwrap().unwrap();
        outcomes.push(o);
        held.push(h);
    }
    (outcomes, held)
}

/// br-all with one LIVE worker, so an Assign has somewhere to go.
async fn all_in_one_with_a_worker() -> (Service, FakeWorker) {
    let all = Service::start("br-all", &["--groups", GROUP]);
    all.wait_for("/livez", START).await;
    let url = all.grpc_url();
    let worker = FakeWorker::connect(&url, GROUP, 0, 64).await;
    let snapshot = v1::snapshot_client::SnapshotClient::connect(url)
        .await
        .unwrap();
    eventually(LONG, "the worker is LIVE in σ", || {
        let mut snapshot = snapshot.clone();
        async move {
            let s = snapshot
                .get(GetRequest {
                    group: GROUP.into(),
                })
                .await
                .unwrap()
                .into_inner();
            s.workers
                .iter()
                .any(|w| w.liveness == v1::Liveness::Live as i32)
        }
    })
    .await;
    all.wait_for("/readyz", START).await;
    (all, worker)
}

/// Attacks `path` on `all`; checks the process stays under the bound and still places an
/// Assign while the attacking streams are open. Returns how many streams were refused.
async fn attack_and_assign(all: &Service, path: &str, request_id: &str) -> usize {
    let pid = all.pid().unwrap();
    let idle = rss_bytes(pid);
    let (outcomes, held) = attack(all.grpc_addr(), path).await;
    let holding = outcomes.iter().filter(|o| **o == Attack::Holding).count();
    let rss = rss_bytes(pid);
    eprintln!(
        "{path}: idle {} MiB, under attack {} MiB; {holding} of {} streams holding",
        idle >> 20,
        rss >> 20,
        outcomes.len()
    );
    assert!(
        rss < RSS_LIMIT_BYTES,
        "{path}: br-all holds {} MiB with {holding} unfinished messages (idle {} MiB)",
        rss >> 20,
        idle >> 20
    );

    // A normal call is served while the attacking streams are open.
    let mut decision = v1::decision_client::DecisionClient::connect(all.grpc_url())
        .await
        .unwrap();
    let mut req = tonic::Request::new(AssignRequest {
        group: GROUP.into(),
        request_id: request_id.into(),
        prompt_tokens: 100,
        prompt_hash: None,
        max_tokens: None,
        expected_output_tokens: None,
        request_class: None,
    });
    req.set_timeout(LONG);
    let answer = decision
        .assign(req)
        .await
        .expect("Assign during the attack");
    assert_eq!(answer.into_inner().worker_id, 0);
    drop(held);

    // What the attack made the process hold goes back once the attacker has gone.
    let back = br_e2e::memory_given_back(pid, idle, rss, &format!("{path}: br-all")).await;
    eprintln!("{path}: {} MiB once the attacker had gone", back >> 20);
    outcomes.len() - holding
}

/// The open health service: its check is a few bytes, so a large message is refused at its
/// header, before anything is held, and counted as oversize.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_messages_on_the_open_health_service_hold_nothing() {
    let (all, _worker) = all_in_one_with_a_worker().await;
    let refused = attack_and_assign(&all, "/grpc.health.v1.Health/Check", "during-health").await;
    assert_eq!(refused, CONNECTIONS * STREAMS_PER_CONNECTION);
    let counted = br_testkit::http::metrics_url(&all.admin_url("/metrics"))
        .await
        .sum("balanceroute_all_oversize_calls_total");
    assert_eq!(counted, refused as f64, "each refusal is counted");
}

/// σ batches may be 16 MiB, so `Snapshot/Apply` accepts large messages: the process's
/// in-flight budget is what bounds them, and its refusals are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_messages_on_a_large_message_method_are_held_within_the_budget() {
    let (all, _worker) = all_in_one_with_a_worker().await;
    let refused = attack_and_assign(&all, "/balanceroute.v1.Snapshot/Apply", "during-apply").await;
    assert!(refused > 0, "every stream was let hold its message");
    let counted = br_testkit::http::metrics_url(&all.admin_url("/metrics"))
        .await
        .sum("balanceroute_all_in_flight_refusals_total");
    assert_eq!(counted, refused as f64, "each refusal is counted");
}
