//! nginx with the Lua module (`gateways/openresty/`) in front of br-all, one br-shim serving
//! both ranks of a `br-emu engine`, all real processes: the example nginx.conf, rendered with
//! this test's ports and paths.
//!
//! * streaming completions through nginx run on the rank Assign chose, as server-sent events;
//! * the request id reaches the shim (σ shows the request decoding under the client's id on
//!   that rank), and a request without one gets an id nginx made;
//! * a client that leaves mid-stream: σ lets the request go, and nginx sends Cancel (one, and
//!   none for the whole answers);
//! * a client that leaves while its Assign waits for a place (every rank full): nginx cancels
//!   the Assign (decision's pool empties while the ranks are still full);
//! * the output-length hints reach decision: σ holds the request's `max_tokens` (the body's
//!   `max_completion_tokens`, else `max_tokens`), expected output tokens (the
//!   `X-BalanceRoute-Expected-Output-Tokens` header, else the body's `nvext.agent_hints.osl`)
//!   and class (`X-Gateway-Inference-Objective`); a body that is not JSON, or has no
//!   `max_tokens`, is routed all the same; a value decision refuses gives the client its 400
//!   and `X-BalanceRoute-Error: INVALID_ARGUMENT`, and the engine runs nothing;
//! * br-all down: 503 DECISION_UNREACHABLE at once, the engine runs nothing; br-all started
//!   again on the same ports: nginx routes again, untouched.
//!
//! Every wait polls a signal (σ, a metric, the stream) with a bound. Without nginx the test
//! prints SKIPPED, unless BR_REQUIRE_GATEWAYS=1.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use br_e2e::gateway::{
    self, GROUP, Gateway, Kind, Stack, complete_through, refused_while_decision_is_down,
    wait_released,
};

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

    // Streaming completions land on the rank Assign chose; the client's id reaches the shim;
    // leaving mid-stream releases the request and nginx sends Cancel from its log phase: one
    // Cancel, none for the whole answers.
    let before = gateway::cancels_answered(&stack).await;
    complete_through(&stack, gw.addr, "nginx-whole", 4).await;
    gateway::leaves_mid_stream(&stack, gw.addr, "nginx-leaves").await;
    assert_eq!(gateway::cancels_answered(&stack).await - before, 1.0);

    // No X-Request-Id: nginx makes one, says it in the answer, and the shim reports under it.
    let (anonymous, made) = gateway::open_anonymous_stream(&stack, gw.addr).await;
    drop(anonymous);
    wait_released(&stack, &made).await;

    // A client that leaves while its Assign waits for a place: nginx cancels it.
    gateway::leaves_while_assign_waits(&stack, &gw, "nginx").await;

    // What the request says of its output reaches decision (σ holds it); bodies without it
    // are routed all the same; a value decision cannot take gets decision's 400 and code.
    gateway::hints_reach_decision(&stack, gw.addr, "nginx").await;
    gateway::routed_without_body_hints(&stack, gw.addr, "nginx").await;
    gateway::bad_hints_refused(&stack, gw.addr, "nginx").await;

    // br-all down: the typed error; up again on the same ports: nginx routes again.
    stack.all.kill();
    refused_while_decision_is_down(&stack, gw.addr).await;
    stack.all.restart();
    stack.wait_ready().await;
    complete_through(&stack, gw.addr, "nginx-after-restart", 2).await;
    assert!(!gw.logs().contains("[alert]"), "{}", gw.logs());
}
