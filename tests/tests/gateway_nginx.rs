//! nginx with the Lua module (`gateways/openresty/`) in front of br-all, one br-shim serving
//! both ranks of a `br-emu engine`, all real processes: the example nginx.conf, rendered with
//! this test's ports and paths.
//!
//! * streaming completions through nginx run on the rank Assign chose, as server-sent events;
//! * the request id reaches the shim (σ shows the request decoding under the client's id on
//!   that rank), and a request without one gets an id nginx made;
//! * a client that leaves mid-stream: σ lets the request go, and nginx sent Cancel;
//! * a client that leaves while its Assign waits for a place (every rank full): nginx cancels
//!   the Assign (decision's pool empties while the ranks are still full);
//! * br-all down: 503 DECISION_UNREACHABLE at once, the engine runs nothing; br-all started
//!   again on the same ports: nginx routes again, untouched.
//!
//! Every wait polls a signal (σ, a metric, the stream) with a bound. Without nginx the test
//! prints SKIPPED, unless BR_REQUIRE_GATEWAYS=1.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use br_e2e::gateway::{
    self, GROUP, Gateway, Kind, LONG, Stack, complete_through, open_long_stream,
    refused_while_decision_is_down, wait_released,
};
use br_testkit::eventually;

const NAME: &str = "nginx_routes_streams_and_cancels_through_balanceroute";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_routes_streams_and_cancels_through_balanceroute() {
    let Some(nginx) = gateway::find(Kind::Nginx, NAME) else {
        return;
    };
    // One place per rank: two open streams fill the group, and a third Assign waits.
    let mut stack = Stack::start(1).await;
    let gw = Gateway::start(
        Kind::Nginx,
        &nginx,
        stack.decision_http,
        &[
            ("group = \"default\"", &format!("group = \"{GROUP}\"")),
            // Long enough that only a Cancel ends a waiting Assign within the test.
            ("assign_timeout = \"2s\"", "assign_timeout = \"10m\""),
        ],
    )
    .await;
    let cancels = || {
        stack.metric(
            "balanceroute_decision_http_requests_total",
            &[r#"route="/v1/cancel""#],
        )
    };

    // Streaming completions land on the rank Assign chose.
    complete_through(&stack, gw.addr, "nginx-whole", 4).await;

    // The client's id reaches the shim; leaving mid-stream releases the request and nginx
    // sends Cancel from its log phase.
    let before = cancels().await;
    let open = open_long_stream(&stack, gw.addr, "nginx-leaves").await;
    drop(open);
    wait_released(&stack, "nginx-leaves").await;
    eventually(
        LONG,
        "nginx sends Cancel for the client that left",
        || async { cancels().await > before },
    )
    .await;

    // No X-Request-Id: nginx makes one, says it in the answer, and the shim reports under it.
    let (anonymous, made) = gateway::open_anonymous_stream(&stack, gw.addr).await;
    drop(anonymous);
    wait_released(&stack, &made).await;

    // Both ranks full; a third client's Assign waits in decision's pool; the client leaves;
    // nginx cancels it: the pool empties while both ranks are still full.
    let first = open_long_stream(&stack, gw.addr, "nginx-fill-a").await;
    let second = open_long_stream(&stack, gw.addr, "nginx-fill-b").await;
    let in_group = format!("group=\"{GROUP}\"");
    let in_group = [in_group.as_str()];
    let pool = || stack.metric("balanceroute_decision_pool_size", &in_group);
    let waiting = {
        use tokio::io::AsyncWriteExt as _;
        let body = gateway::completion(4);
        let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        let request = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nX-Request-Id: nginx-waits\r\n\r\n{body}",
            body.len()
        );
        s.write_all(request.as_bytes()).await.unwrap();
        s
    };
    eventually(LONG, "nginx-waits waits in decision's pool", || async {
        pool().await == 1.0
    })
    .await;
    drop(waiting);
    eventually(
        LONG,
        "nginx cancels the Assign of the client that left",
        || async { pool().await == 0.0 },
    )
    .await;
    assert!(
        stack.request("nginx-waits").await.is_none(),
        "no reservation for a client that left"
    );
    drop((first, second));
    wait_released(&stack, "nginx-fill-a").await;
    wait_released(&stack, "nginx-fill-b").await;

    // br-all down: the typed error; up again on the same ports: nginx routes again.
    stack.all.kill();
    refused_while_decision_is_down(&stack, gw.addr).await;
    stack.all.restart();
    stack.wait_ready().await;
    complete_through(&stack, gw.addr, "nginx-after-restart", 2).await;
    assert!(!gw.logs().contains("[alert]"), "{}", gw.logs());
}
