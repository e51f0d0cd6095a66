//! Bounds with real processes: what a peer can make a service hold before it says
//! anything. Measured before the fix (docs/benchmarks.md, "bounds"): br-ingest under
//! `ulimit -n 128` with 300 idle TCP connections spun at 64% of a core retrying `accept`
//! (EMFILE), and neither its gRPC port nor its admin port answered. Now the connections it
//! holds are bounded below its descriptor limit and silent ones are closed, so health answers
//! through the idle crowd and `accept` never runs out of descriptors.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use br_e2e::Service;
use br_testkit::{eventually, within};
use tokio::net::TcpStream;
use tonic::transport::Endpoint;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// The service's descriptor limit: far below the idle connections the test opens.
const NOFILE: u32 = 128;
/// Idle connections: more than the process has descriptors.
const IDLE: usize = 300;
/// Long enough for a busy machine, short enough that the idle crowd drains in a few rounds.
const FIRST_BYTE_TIMEOUT: &str = "500ms";
const PATIENCE: Duration = Duration::from_secs(60);

/// Reads `balanceroute_<svc>_accept_failures_total{reason}` off `/metrics` (0 when absent).
fn accept_failures(metrics: &str, reason: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| {
            l.contains("_accept_failures_total{") && l.contains(&format!("reason=\"{reason}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_beyond_the_descriptor_limit_cannot_stop_ingest() {
    let snapshot = Service::start("br-snapshot", &[]);
    let snapshot_url = snapshot.grpc_url();
    let ingest = Service::start_with_descriptor_limit(
        "br-ingest",
        &[
            "--snapshot-addr",
            &snapshot_url,
            "--first-byte-timeout",
            FIRST_BYTE_TIMEOUT,
        ],
        NOFILE,
    );

    // More idle connections than the process has descriptors. A connect can time out once the
    // listen backlog is full; those are the kernel refusing, not the service, and still count
    // against it while they wait.
    let mut idle = Vec::new();
    for _ in 0..IDLE {
        if let Ok(Ok(c)) = tokio::time::timeout(
            Duration::from_secs(1),
            TcpStream::connect(ingest.grpc_addr()),
        )
        .await
        {
            idle.push(c);
        }
    }
    assert!(
        idle.len() > NOFILE as usize,
        "only {} idle connections were opened; the test needs more than {NOFILE}",
        idle.len()
    );

    // The admin port answers (its accept has descriptors left) ...
    ingest.wait_for("/livez", PATIENCE).await;
    // ... and a new gRPC client gets through the idle crowd: silent connections are closed,
    // and a slot is free for it.
    let channel = Endpoint::from_shared(ingest.grpc_url())
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5))
        .connect_lazy();
    eventually(
        PATIENCE,
        "ingest's health answers SERVING past the idle connections",
        || {
            let mut client = HealthClient::new(channel.clone());
            async move {
                client
                    .check(HealthCheckRequest {
                        service: String::new(),
                    })
                    .await
                    .is_ok_and(|r| r.into_inner().status == ServingStatus::Serving as i32)
            }
        },
    )
    .await;

    let metrics = within(PATIENCE, "ingest's /metrics", ingest.metrics()).await;
    // The idle connections were closed as silent, counted ...
    assert!(
        accept_failures(&metrics, "silent") > 0,
        "no silent connection was closed:\n{metrics}"
    );
    // ... and the descriptors never ran out: the bound kept accept from failing at all.
    assert_eq!(
        accept_failures(&metrics, "accept_error"),
        0,
        "accept ran out of descriptors:\n{metrics}"
    );
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_holding_its_share_of_connections_leaves_room_for_the_others() {
    // Idle connections are kept for the whole test (a long first-byte timeout), so only the
    // per-address limit stands between them and every slot.
    let snapshot = Service::start(
        "br-snapshot",
        &[
            "--max-connections-per-peer",
            "4",
            "--first-byte-timeout",
            "10m",
        ],
    );
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(TcpStream::connect(snapshot.grpc_addr()).await.unwrap());
    }
    let health = |from: [u8; 4]| {
        let channel = Endpoint::from_shared(snapshot.grpc_url())
            .unwrap()
            .local_address(Some(std::net::IpAddr::from(from)))
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(5))
            .connect_lazy();
        async move {
            HealthClient::new(channel)
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
        }
    };
    // Another address is served ...
    eventually(
        PATIENCE,
        "br-snapshot's health answers a client from 127.0.0.2",
        || async { health([127, 0, 0, 2]).await.is_ok() },
    )
    .await;
    // ... while the address that holds its four is turned away at the door, and counted.
    let refused = health([127, 0, 0, 1]).await;
    assert!(
        refused.is_err(),
        "a fifth connection from 127.0.0.1 was served: {refused:?}"
    );
    let metrics = within(PATIENCE, "br-snapshot's /metrics", snapshot.metrics()).await;
    assert!(
        accept_failures(&metrics, "peer_limit") > 0,
        "no connection was refused for its address:\n{metrics}"
    );
    // Once the idle ones go, the first address is served again.
    drop(idle);
    eventually(
        PATIENCE,
        "br-snapshot's health answers 127.0.0.1 once its idle connections closed",
        || async { health([127, 0, 0, 1]).await.is_ok() },
    )
    .await;
}
