//! HAProxy 2.6 with its Lua action (`gateways/haproxy/`) in front of br-all, one br-shim
//! serving both ranks of a `br-emu engine`, all real processes: the example haproxy.cfg,
//! rendered with this test's ports and paths.
//!
//! * streaming completions through HAProxy run on the rank Assign chose, as server-sent events
//!   (set-dst/set-dst-port on a 0.0.0.0:0 server, the `/rank/<n>` path prefix);
//! * the request id reaches the shim (σ shows the request decoding under the client's id on
//!   that rank), and a request without one gets an id HAProxy made;
//! * a client that asks to close (`Connection: close`) and reads to the end of the connection
//!   gets the whole answer and then the end, with the cancel filter in the frontend: an answer
//!   of known length (`Content-Length`) and a streamed one;
//! * a client that leaves mid-stream: HAProxy closes the shim's connection, σ lets the request
//!   go, and the module's filter sends Cancel (one, and none for the whole answers);
//! * a client that leaves while its Assign waits for a place (every rank full): HAProxy aborts
//!   the action and the filter cancels the Assign (decision's pool empties while the ranks are
//!   still full);
//! * the output-length hints reach decision: σ holds the request's `max_tokens` (the body's
//!   `max_completion_tokens`, else `max_tokens`), expected output tokens (the
//!   `X-BalanceRoute-Expected-Output-Tokens` header, else the body's `nvext.agent_hints.osl`)
//!   and class (`X-Gateway-Inference-Objective`); a body that is not JSON, or has no
//!   `max_tokens`, is routed all the same; a value decision refuses gives the client its 400
//!   and `X-BalanceRoute-Error: INVALID_ARGUMENT`, and the engine runs nothing;
//! * br-all down: 503 DECISION_UNREACHABLE at once, the engine runs nothing; br-all started
//!   again on the same ports: HAProxy routes again, untouched.
//!
//! Every wait polls a signal (σ, the stream) with a bound. Without haproxy the test prints
//! SKIPPED, unless BR_REQUIRE_GATEWAYS=1.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use br_e2e::gateway::{
    self, GROUP, Gateway, Kind, Stack, complete_through, refused_while_decision_is_down,
    wait_released,
};

const NAME: &str = "haproxy_routes_streams_and_cancels_through_balanceroute";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn haproxy_routes_streams_and_cancels_through_balanceroute() {
    let Some(haproxy) = gateway::find(Kind::Haproxy, NAME) else {
        return;
    };
    // One place per rank: two open streams fill the group, and a third Assign waits.
    let mut stack = Stack::start(1).await;
    let gw = Gateway::start(
        Kind::Haproxy,
        &haproxy,
        stack.decision_http,
        // Long enough that only a Cancel ends a waiting Assign within the test.
        &[(" default 2s", &format!(" {GROUP} 10m"))],
    )
    .await;

    // Streaming completions land on the rank Assign chose; the client's id reaches the shim;
    // a client that asked to close has the connection closed after the whole answer; leaving
    // mid-stream releases the request and the filter sends Cancel: one Cancel, none for the
    // whole answers.
    let before = gateway::cancels_answered(&stack).await;
    gateway::closes_after_whole_answers(&stack, gw.addr, "haproxy").await;
    complete_through(&stack, gw.addr, "haproxy-whole", 4).await;
    gateway::leaves_mid_stream(&stack, gw.addr, "haproxy-leaves").await;
    assert_eq!(gateway::cancels_answered(&stack).await - before, 1.0);

    // No X-Request-Id: HAProxy makes one, says it in the answer, and the shim reports under it.
    let (anonymous, made) = gateway::open_anonymous_stream(&stack, gw.addr).await;
    drop(anonymous);
    wait_released(&stack, &made).await;

    // A client that leaves while its Assign waits for a place: HAProxy aborts the action and
    // the filter cancels the Assign.
    gateway::leaves_while_assign_waits(&stack, &gw, "haproxy").await;

    // What the request says of its output reaches decision (σ holds it); bodies without it
    // are routed all the same; a value decision cannot take gets decision's 400 and code.
    gateway::hints_reach_decision(&stack, gw.addr, "haproxy").await;
    gateway::routed_without_body_hints(&stack, gw.addr, "haproxy").await;
    gateway::bad_hints_refused(&stack, gw.addr, "haproxy").await;

    // br-all down: the typed error; up again on the same ports: HAProxy routes again.
    stack.all.kill();
    refused_while_decision_is_down(&stack, gw.addr).await;
    stack.all.restart();
    stack.wait_ready().await;
    complete_through(&stack, gw.addr, "haproxy-after-restart", 2).await;
}
