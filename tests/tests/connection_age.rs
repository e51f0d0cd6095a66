//! `--max-connection-age`: a connection older than it is asked to go away and, after
//! `--max-connection-age-grace`, closed, so a client holding a stream that never ends on its
//! own (a Watch, a shim's telemetry) connects again, and a rotated certificate or a
//! rebalanced Service reaches it. Real process: br-snapshot with a 1 s age and a 1 s grace; a
//! `grpc.health.v1.Health/Watch` stream, which the server never ends by itself, must end, and
//! the same channel is then served on a new connection.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use br_e2e::Service;
use br_testkit::eventually;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// A hang guard on a loaded 2-core machine, not a timing assertion: the stream should end
/// about 2 s after the connection opened (age + grace).
const LONG: Duration = Duration::from_secs(60);
/// One health check's deadline (a hang guard too).
const ATTEMPT: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_on_a_connection_past_its_age_ends_and_the_client_connects_again() {
    let snapshot = Service::start(
        "br-snapshot",
        &[
            "--max-connection-age",
            "1s",
            "--max-connection-age-grace",
            "1s",
        ],
    );
    let ch = Channel::from_shared(snapshot.grpc_url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(ch.clone());
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    // Watch answers the current status at once, then only on a change (there is none here).
    assert!(watch.message().await.unwrap().is_some());
    let ended = tokio::time::timeout(LONG, async {
        loop {
            match watch.message().await {
                Ok(Some(_)) => continue,
                end => return end,
            }
        }
    })
    .await;
    let end = ended.unwrap_or_else(|_| {
        panic!("the Watch stream outlived its connection's age and grace by {LONG:?}")
    });
    // closed under it: an error (or, if the server ended it first, the end of the stream)
    eprintln!("the Watch stream ended: {end:?}");

    // The channel connects again by itself; a new call is served. Each attempt has a deadline,
    // as every client of the services sets one: one call caught on the closing connection
    // (seen once on a loaded machine, waiting out the whole guard) is given up and retried,
    // while a channel that never connects again still fails the test.
    eventually(LONG, "a new call served on a new connection", || {
        let mut h = health.clone();
        async move {
            let call = h.check(HealthCheckRequest {
                service: String::new(),
            });
            matches!(tokio::time::timeout(ATTEMPT, call).await, Ok(Ok(_)))
        }
    })
    .await;
}
