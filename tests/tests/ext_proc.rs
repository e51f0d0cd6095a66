//! br-decision's Envoy endpoint picker (`--ext-proc-listen`) end to end: br-snapshot,
//! br-ingest and br-decision as real processes, fake workers announcing their endpoints, and
//! an `envoy.service.ext_proc.v3.ExternalProcessor/Process` client built from Envoy's own
//! protos (envoy-types) sending what Envoy sends: request headers, a buffered body, response
//! headers, and streams that end early. Each answer is checked against σ (Snapshot.Get): the
//! reservation the picker made is there, with the tokens the test computed itself, on the
//! worker whose endpoint the answer names, and gone once a stream ends before a response.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use br_e2e::{FakeWorker, Service, Split};
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::{self, GetRequest};
use br_testkit::{eventually, within};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as In;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HttpBody, HttpHeaders, ImmediateResponse, ProcessingRequest,
    ProcessingResponse, ProtocolConfiguration, body_mutation,
};
use envoy_types::pb::google::protobuf::value::Kind;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

const GROUP: &str = "e2e";
/// A second served group with no worker: nothing can place there (503).
const EMPTY: &str = "empty";
const START: Duration = Duration::from_secs(60);
/// A hang guard for one answer on a loaded 2-core machine, not a timing assertion.
const ANSWER: Duration = Duration::from_secs(30);
const ENDPOINT_KEY: &str = "x-gateway-destination-endpoint";

struct Stack {
    snapshot: Service,
    _ingest: Service,
    decision: Service,
    ext_proc: SocketAddr,
    _workers: Vec<FakeWorker>,
}

impl Stack {
    /// The stack with two workers of group `e2e` (endpoints 127.0.0.1:18000 and :18001, as
    /// FakeWorker announces them) and the picker on, `e2e` its default group.
    async fn start() -> Stack {
        Stack::start_with(&[]).await
    }

    /// [`Stack::start`] with more br-decision flags.
    async fn start_with(extra: &[&str]) -> Stack {
        let groups = format!("{GROUP},{EMPTY}");
        let Split {
            snapshot,
            ingest,
            decision,
        } = Split::start(
            &["--reservation-ttl", "60s", "--progress-interval", "100ms"],
            &[
                &[
                    "--groups",
                    &groups,
                    "--ext-proc-listen",
                    "127.0.0.1:0",
                    "--ext-proc-default-group",
                    GROUP,
                ],
                extra,
            ]
            .concat(),
        )
        .await;
        let mut workers = Vec::new();
        for id in 0..2 {
            workers.push(FakeWorker::connect(&ingest.grpc_url(), GROUP, id, 8).await);
        }
        decision.wait_for("/readyz", START).await;
        let ext_proc = decision.ready_addr("ext_proc");
        Stack {
            snapshot,
            _ingest: ingest,
            decision,
            ext_proc,
            _workers: workers,
        }
    }

    async fn client(&self) -> ExternalProcessorClient<Channel> {
        ExternalProcessorClient::connect(format!("http://{}", self.ext_proc))
            .await
            .expect("the ext_proc port is reachable")
    }

    async fn sigma(&self) -> v1::ClusterSnapshot {
        SnapshotClient::connect(self.snapshot.grpc_url())
            .await
            .expect("snapshot reachable")
            .get(GetRequest {
                group: GROUP.into(),
            })
            .await
            .expect("Get")
            .into_inner()
    }

    /// The request `id` in σ, if it is there.
    async fn request(&self, id: &str) -> Option<v1::RequestState> {
        self.sigma()
            .await
            .requests
            .into_iter()
            .find(|r| r.request_id == id)
    }

    /// The endpoint of worker `id` in σ, as the picker must name it (host:port).
    async fn endpoint_of(&self, worker: u32) -> String {
        let s = self.sigma().await;
        let w = s
            .workers
            .iter()
            .find(|w| w.worker_id == worker)
            .expect("the worker is in σ");
        w.endpoint.trim_start_matches("http://").to_owned()
    }

    /// The sum of `name`'s samples whose label `label.0` is `label.1`.
    async fn metric(&self, name: &str, label: (&str, &str)) -> f64 {
        let m = br_testkit::http::metrics_url(&self.decision.admin_url("/metrics")).await;
        m.samples(name)
            .filter(|s| s.labels.get(label.0).map(String::as_str) == Some(label.1))
            .map(|s| s.value)
            .sum()
    }
}

/// One ext_proc stream, as Envoy holds it for one HTTP request.
struct Envoy {
    tx: Option<mpsc::Sender<ProcessingRequest>>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Envoy {
    async fn open(client: &mut ExternalProcessorClient<Channel>) -> Envoy {
        let (tx, rx) = mpsc::channel(4);
        let rx = client
            .process(ReceiverStream::new(rx))
            .await
            .expect("the Process stream opens")
            .into_inner();
        Envoy { tx: Some(tx), rx }
    }

    /// Sends one message and reads its answer.
    async fn exchange(&mut self, msg: ProcessingRequest) -> ProcessingResponse {
        self.tx
            .as_ref()
            .expect("the stream is open")
            .send(msg)
            .await
            .expect("the stream takes a message");
        within(ANSWER, "the picker's answer", self.rx.message())
            .await
            .expect("an answer, not an error status")
            .expect("an answer, not the end of the stream")
    }

    /// Envoy closes its side (the HTTP request is over) and the server ends the stream.
    async fn close(mut self) {
        drop(self.tx.take());
        let end = within(ANSWER, "the stream's end", self.rx.message()).await;
        assert!(matches!(end, Ok(None)), "the stream ends cleanly: {end:?}");
    }
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(In::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: (*k).to_owned(),
                        // Envoy sends values in raw_value
                        raw_value: v.as_bytes().to_vec(),
                        ..Default::default()
                    })
                    .collect(),
            }),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Request headers with the protocol's subset hint (the endpoints the gateway allows).
fn headers_with_subset(pairs: &[(&str, &str)], subset: &[&str]) -> ProcessingRequest {
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};
    let mut h = headers(pairs, true);
    let list = ListValue {
        values: subset
            .iter()
            .map(|e| Value {
                kind: Some(Kind::StringValue((*e).to_owned())),
            })
            .collect(),
    };
    h.metadata_context = Some(Metadata {
        filter_metadata: [(
            "envoy.lb.subset_hint".to_owned(),
            Struct {
                fields: [(
                    "x-gateway-destination-endpoint-subset".to_owned(),
                    Value {
                        kind: Some(Kind::ListValue(list)),
                    },
                )]
                .into_iter()
                .collect(),
            },
        )]
        .into_iter()
        .collect(),
        ..Default::default()
    });
    h
}

fn body(json: &serde_json::Value) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(In::RequestBody(HttpBody {
            body: json.to_string().into_bytes(),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn raw_body(bytes: &[u8]) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(In::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// What Envoy sends once the upstream (the rank) answered.
fn response_headers() -> ProcessingRequest {
    ProcessingRequest {
        request: Some(In::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![HeaderValue {
                    key: ":status".into(),
                    raw_value: b"200".to_vec(),
                    ..Default::default()
                }],
            }),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// The header mutation of a routing answer: (endpoint, every header set).
fn routed(common: &CommonResponse, resp: &ProcessingResponse) -> (String, Vec<(String, String)>) {
    let set: Vec<(String, String)> = common
        .header_mutation
        .as_ref()
        .expect("a header mutation")
        .set_headers
        .iter()
        .map(|o| {
            let h = o.header.as_ref().expect("a header");
            (
                h.key.clone(),
                String::from_utf8(h.raw_value.clone()).unwrap(),
            )
        })
        .collect();
    let endpoint = set
        .iter()
        .find(|(k, _)| k == ENDPOINT_KEY)
        .map(|(_, v)| v.clone())
        .expect("the x-gateway-destination-endpoint header is set");
    // The protocol: the same value in the dynamic metadata, namespace envoy.lb.
    let md = resp.dynamic_metadata.as_ref().expect("dynamic metadata");
    let Some(Kind::StructValue(ns)) = md.fields.get("envoy.lb").and_then(|v| v.kind.clone()) else {
        panic!("no envoy.lb namespace: {md:?}");
    };
    assert_eq!(
        ns.fields.get(ENDPOINT_KEY).and_then(|v| v.kind.clone()),
        Some(Kind::StringValue(endpoint.clone())),
        "header and metadata name the same endpoint"
    );
    (endpoint, set)
}

/// The answer to request headers that routes: its endpoint and headers set.
fn routed_at_headers(resp: &ProcessingResponse) -> (String, Vec<(String, String)>) {
    match &resp.response {
        Some(Out::RequestHeaders(h)) => routed(h.response.as_ref().expect("a response"), resp),
        other => panic!("expected a routing answer to the headers, got {other:?}"),
    }
}

fn routed_at_body(resp: &ProcessingResponse) -> (String, Vec<(String, String)>) {
    match &resp.response {
        Some(Out::RequestBody(b)) => routed(b.response.as_ref().expect("a response"), resp),
        other => panic!("expected a routing answer to the body, got {other:?}"),
    }
}

fn immediate(resp: &ProcessingResponse) -> &ImmediateResponse {
    match &resp.response {
        Some(Out::ImmediateResponse(i)) => i,
        other => panic!("expected an ImmediateResponse, got {other:?}"),
    }
}

/// The worker σ holds request `id` on, checked to be the one whose endpoint was answered.
async fn placed_on_answered_worker(stack: &Stack, id: &str, endpoint: &str) -> v1::RequestState {
    let r = stack
        .request(id)
        .await
        .unwrap_or_else(|| panic!("{id} is reserved in σ"));
    assert_eq!(r.state, v1::RequestPhase::Reserved as i32);
    assert_eq!(stack.endpoint_of(r.worker_id).await, endpoint);
    r
}

/// Headers only (tokens from the header), headers + body (tokens estimated from the body),
/// header tokens with a body (max_tokens from it), a request without x-request-id, a retry
/// with the same x-request-id, and a full-duplex streamed body: each routed with the endpoint of the worker σ reserved it on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_routes_what_envoy_sends() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;

    // headers only: answered in the headers phase
    let mut s = Envoy::open(&mut client).await;
    let resp = s
        .exchange(headers(
            &[
                (":path", "/v1/completions"),
                ("x-request-id", "hdr-1"),
                ("x-balanceroute-prompt-tokens", "900"),
            ],
            true,
        ))
        .await;
    let (endpoint, set) = routed_at_headers(&resp);
    assert!(
        !set.iter().any(|(k, _)| k == "x-request-id"),
        "the request had an id"
    );
    let r = placed_on_answered_worker(&stack, "hdr-1", &endpoint).await;
    assert_eq!((r.prompt_tokens, r.max_tokens), (900, None));
    // the rank answers: a response phase, then the stream ends; the reservation stays
    assert!(matches!(
        s.exchange(response_headers()).await.response,
        Some(Out::ResponseHeaders(_))
    ));
    s.close().await;
    eventually(
        Duration::from_secs(10),
        "the stream counted as answered",
        || async {
            stack
                .metric(
                    "balanceroute_decision_ext_proc_streams_total",
                    ("outcome", "answered"),
                )
                .await
                == 1.0
        },
    )
    .await;
    assert!(
        stack.request("hdr-1").await.is_some(),
        "an answered request keeps its reservation"
    );

    // headers + body: the headers pass on, the body is estimated (our own count: 400 bytes of
    // text / 4 + 4 for the one message = 104), max_tokens from it
    let mut s = Envoy::open(&mut client).await;
    let resp = s
        .exchange(headers(
            &[
                ("x-request-id", "est-1"),
                ("content-type", "application/json"),
            ],
            false,
        ))
        .await;
    match &resp.response {
        Some(Out::RequestHeaders(h)) => assert!(
            h.response
                .as_ref()
                .is_none_or(|c| c.header_mutation.is_none()),
            "nothing routed before the body: {h:?}"
        ),
        other => panic!("expected the headers to pass on, got {other:?}"),
    }
    let text = "x".repeat(400);
    let resp = s
        .exchange(body(&serde_json::json!({
            "model": "m",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 77,
        })))
        .await;
    let (endpoint, _) = routed_at_body(&resp);
    let r = placed_on_answered_worker(&stack, "est-1", &endpoint).await;
    assert_eq!((r.prompt_tokens, r.max_tokens), (104, Some(77)));
    assert_eq!(
        stack
            .metric(
                "balanceroute_decision_ext_proc_prompt_tokens_source_total",
                ("source", "estimate")
            )
            .await,
        1.0
    );
    s.exchange(response_headers()).await;
    s.close().await;

    // the header's count wins over the body; the body still gives max_tokens
    let mut s = Envoy::open(&mut client).await;
    s.exchange(headers(
        &[
            ("x-request-id", "hdr-2"),
            ("x-balanceroute-prompt-tokens", "321"),
        ],
        false,
    ))
    .await;
    let resp = s
        .exchange(body(
            &serde_json::json!({"prompt": "y".repeat(4000), "max_completion_tokens": 5}),
        ))
        .await;
    let (endpoint, _) = routed_at_body(&resp);
    let r = placed_on_answered_worker(&stack, "hdr-2", &endpoint).await;
    assert_eq!((r.prompt_tokens, r.max_tokens), (321, Some(5)));
    s.exchange(response_headers()).await;
    s.close().await;

    // no x-request-id: one is made and added to the request, so the shim reports under it
    let mut s = Envoy::open(&mut client).await;
    let resp = s
        .exchange(headers(&[("x-balanceroute-prompt-tokens", "50")], true))
        .await;
    let (endpoint, set) = routed_at_headers(&resp);
    let made = set
        .iter()
        .find(|(k, _)| k == "x-request-id")
        .map(|(_, v)| v.clone())
        .expect("an x-request-id is added");
    let r = placed_on_answered_worker(&stack, &made, &endpoint).await;
    assert_eq!(r.prompt_tokens, 50);
    s.exchange(response_headers()).await;
    s.close().await;

    // a retry with the same x-request-id (a new stream, as a client retry makes) gets the
    // original answer, and σ still holds one reservation for it
    let mut s = Envoy::open(&mut client).await;
    let resp = s
        .exchange(headers(
            &[
                ("x-request-id", "hdr-1"),
                ("x-balanceroute-prompt-tokens", "900"),
            ],
            true,
        ))
        .await;
    let (again, _) = routed_at_headers(&resp);
    let first = placed_on_answered_worker(&stack, "hdr-1", &again).await;
    assert_eq!(stack.endpoint_of(first.worker_id).await, again);
    let held = stack
        .sigma()
        .await
        .requests
        .iter()
        .filter(|r| r.request_id == "hdr-1")
        .count();
    assert_eq!(held, 1, "one reservation per request id");
    s.exchange(response_headers()).await;
    s.close().await;
    // FULL_DUPLEX_STREAMED (what gateways configure for an InferencePool; Envoy says so in
    // the first message): no answer until the body is whole, then the headers' answer with the
    // endpoint, then the body itself back as a streamed response; response bodies are echoed
    let mut s = Envoy::open(&mut client).await;
    let duplex = BodySendMode::FullDuplexStreamed as i32;
    let mut first = headers(&[("x-request-id", "dup-1")], false);
    first.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: duplex,
        response_body_mode: duplex,
        ..Default::default()
    });
    let whole = serde_json::json!({"prompt": "z".repeat(800), "max_tokens": 9}).to_string();
    let (a, b) = whole.as_bytes().split_at(100);
    let tx = s.tx.as_ref().unwrap();
    tx.send(first).await.unwrap();
    for (chunk, end) in [(a, false), (b, true)] {
        tx.send(ProcessingRequest {
            request: Some(In::RequestBody(HttpBody {
                body: chunk.to_vec(),
                end_of_stream: end,
                ..Default::default()
            })),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let resp = within(ANSWER, "the held headers' answer", s.rx.message())
        .await
        .unwrap()
        .unwrap();
    let (endpoint, _) = routed_at_headers(&resp);
    let resp = within(ANSWER, "the body back", s.rx.message())
        .await
        .unwrap()
        .unwrap();
    let streamed = |resp: &ProcessingResponse| -> (Vec<u8>, bool) {
        let (Some(Out::RequestBody(b)) | Some(Out::ResponseBody(b))) = &resp.response else {
            panic!("expected a body answer, got {resp:?}");
        };
        let m = b.response.as_ref().and_then(|c| c.body_mutation.as_ref());
        match m.and_then(|m| m.mutation.as_ref()) {
            Some(body_mutation::Mutation::StreamedResponse(r)) => (r.body.clone(), r.end_of_stream),
            other => panic!("expected a streamed body, got {other:?}"),
        }
    };
    assert!(matches!(resp.response, Some(Out::RequestBody(_))));
    assert_eq!(streamed(&resp), (whole.clone().into_bytes(), true));
    // our own count: 800 bytes / 4 = 200
    let r = placed_on_answered_worker(&stack, "dup-1", &endpoint).await;
    assert_eq!((r.prompt_tokens, r.max_tokens), (200, Some(9)));
    s.exchange(response_headers()).await;
    let resp = s
        .exchange(ProcessingRequest {
            request: Some(In::ResponseBody(HttpBody {
                body: b"data: {}".to_vec(),
                end_of_stream: true,
                ..Default::default()
            })),
            ..Default::default()
        })
        .await;
    assert_eq!(streamed(&resp), (b"data: {}".to_vec(), true));
    s.close().await;

    // BUFFERED, said in protocol_config: the one body message is the whole body even when
    // trailers follow it (end_of_stream false)
    let mut s = Envoy::open(&mut client).await;
    let mut first = headers(&[("x-request-id", "buf-1")], false);
    first.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::Buffered as i32,
        ..Default::default()
    });
    s.exchange(first).await;
    let resp = s
        .exchange(ProcessingRequest {
            request: Some(In::RequestBody(HttpBody {
                body: serde_json::json!({"prompt": "q".repeat(40)})
                    .to_string()
                    .into_bytes(),
                end_of_stream: false,
                ..Default::default()
            })),
            ..Default::default()
        })
        .await;
    let (endpoint, _) = routed_at_body(&resp);
    let r = placed_on_answered_worker(&stack, "buf-1", &endpoint).await;
    assert_eq!(r.prompt_tokens, 10);
    s.exchange(response_headers()).await;
    s.close().await;

    // a subset hint that holds both ranks: routed to one of them
    let both = [stack.endpoint_of(0).await, stack.endpoint_of(1).await];
    let mut s = Envoy::open(&mut client).await;
    let resp = s
        .exchange(headers_with_subset(
            &[
                ("x-request-id", "sub-1"),
                ("x-balanceroute-prompt-tokens", "30"),
            ],
            &[&both[0], &both[1]],
        ))
        .await;
    let (endpoint, _) = routed_at_headers(&resp);
    assert!(both.contains(&endpoint), "{endpoint} is in the subset");
    placed_on_answered_worker(&stack, "sub-1", &endpoint).await;
    s.exchange(response_headers()).await;
    s.close().await;

    // the same Assign path as the gRPC method: every routed request counted there
    assert_eq!(
        stack
            .metric("balanceroute_decision_assign_total", ("code", "ok"))
            .await,
        8.0
    );
}

/// The output-length hints reach σ with the reservation: the expected output tokens from
/// `x-balanceroute-expected-output-tokens`, else from the body's `nvext.agent_hints.osl`
/// (the header wins), the class from `x-gateway-inference-objective` (σ holds its id; an empty
/// header is no class). Bad hints are refused as Assign refuses them (400, its message naming the field), or as bad
/// input when a header or the body does not even hold a count; nothing is reserved for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_passes_the_output_length_hints_on() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let chat = br_proto::valid::class_id("chat");

    // headers only: both hints from the headers
    let mut s = Envoy::open(&mut client).await;
    let resp = s
        .exchange(headers(
            &[
                ("x-request-id", "hint-1"),
                ("x-balanceroute-prompt-tokens", "100"),
                ("x-balanceroute-expected-output-tokens", "250"),
                ("x-gateway-inference-objective", "chat"),
            ],
            true,
        ))
        .await;
    let (endpoint, _) = routed_at_headers(&resp);
    let r = placed_on_answered_worker(&stack, "hint-1", &endpoint).await;
    assert_eq!(
        (r.expected_output_tokens, r.request_class_id),
        (Some(250), Some(chat))
    );
    s.exchange(response_headers()).await;
    s.close().await;

    // the body's Dynamo hint, within its max_tokens; and the header over the body's
    for (id, extra, want) in [
        ("hint-2", None, 40),
        (
            "hint-3",
            Some(("x-balanceroute-expected-output-tokens", "12")),
            12,
        ),
    ] {
        let mut s = Envoy::open(&mut client).await;
        let mut pairs = vec![("x-request-id", id)];
        pairs.extend(extra);
        s.exchange(headers(&pairs, false)).await;
        let resp = s
            .exchange(body(&serde_json::json!({
                "prompt": "p".repeat(40),
                "max_tokens": 64,
                "nvext": {"agent_hints": {"osl": 40, "priority": 1}},
            })))
            .await;
        let (endpoint, _) = routed_at_body(&resp);
        let r = placed_on_answered_worker(&stack, id, &endpoint).await;
        assert_eq!(
            (r.max_tokens, r.expected_output_tokens, r.request_class_id),
            (Some(64), Some(want), None),
            "{id}"
        );
        s.exchange(response_headers()).await;
        s.close().await;
    }

    // without hints, σ holds none; an empty objective header is no class
    for (id, extra) in [
        ("hint-4", None),
        ("hint-5", Some(("x-gateway-inference-objective", ""))),
    ] {
        let mut s = Envoy::open(&mut client).await;
        let mut pairs = vec![
            ("x-request-id", id),
            ("x-balanceroute-prompt-tokens", "100"),
        ];
        pairs.extend(extra);
        let resp = s.exchange(headers(&pairs, true)).await;
        let (endpoint, _) = routed_at_headers(&resp);
        let r = placed_on_answered_worker(&stack, id, &endpoint).await;
        assert_eq!(
            (r.expected_output_tokens, r.request_class_id),
            (None, None),
            "{id}"
        );
        s.exchange(response_headers()).await;
        s.close().await;
    }

    let long = "c".repeat(65);
    let with_tokens = |id: &'static str, pair: (&'static str, &str)| {
        headers(
            &[
                ("x-request-id", id),
                ("x-balanceroute-prompt-tokens", "10"),
                pair,
            ],
            true,
        )
    };
    let over_max_tokens = vec![
        headers(&[("x-request-id", "badhint-5")], false),
        body(&serde_json::json!({
            "prompt": "p", "max_tokens": 5, "nvext": {"agent_hints": {"osl": 6}},
        })),
    ];
    let not_a_count = vec![
        headers(&[("x-request-id", "badhint-6")], false),
        body(&serde_json::json!({"prompt": "p", "nvext": {"agent_hints": {"osl": "six"}}})),
    ];
    let cases: Vec<(&str, Vec<ProcessingRequest>, &str, &str)> = vec![
        (
            "badhint-1",
            vec![with_tokens(
                "badhint-1",
                ("x-balanceroute-expected-output-tokens", "lots"),
            )],
            "invalid_request",
            "x-balanceroute-expected-output-tokens",
        ),
        (
            "badhint-2",
            vec![with_tokens(
                "badhint-2",
                ("x-balanceroute-expected-output-tokens", "0"),
            )],
            "invalid_argument",
            "expected_output_tokens is 0, it must be in 1..=10000000",
        ),
        (
            "badhint-3",
            vec![with_tokens(
                "badhint-3",
                ("x-gateway-inference-objective", "tenant 7"),
            )],
            "invalid_argument",
            "request_class contains ' '",
        ),
        (
            "badhint-4",
            vec![with_tokens(
                "badhint-4",
                ("x-gateway-inference-objective", &long),
            )],
            "invalid_argument",
            "request_class is 65 bytes long, at most 64 are allowed",
        ),
        (
            "badhint-7",
            vec![with_tokens(
                "badhint-7",
                ("x-balanceroute-expected-output-tokens", "10000001"),
            )],
            "invalid_argument",
            "expected_output_tokens is 10000001, it must be in 1..=10000000",
        ),
        (
            "badhint-8",
            vec![with_tokens(
                "badhint-8",
                ("x-gateway-inference-objective", "thinking-\u{e9}"),
            )],
            "invalid_argument",
            "request_class contains 'é'",
        ),
        (
            "badhint-9",
            vec![with_tokens(
                "badhint-9",
                ("x-gateway-inference-objective", "a\tb"),
            )],
            "invalid_argument",
            "request_class contains a control character",
        ),
        (
            "badhint-5",
            over_max_tokens,
            "invalid_argument",
            "expected_output_tokens is 6, above max_tokens 5",
        ),
        (
            "badhint-6",
            not_a_count,
            "invalid_request",
            "nvext.agent_hints.osl",
        ),
    ];
    for (id, msgs, kind, says) in cases {
        let mut s = Envoy::open(&mut client).await;
        let n = msgs.len();
        let mut last = None;
        for (i, m) in msgs.into_iter().enumerate() {
            let resp = s.exchange(m).await;
            if i + 1 < n {
                assert!(
                    matches!(resp.response, Some(Out::RequestHeaders(_))),
                    "{id}: the headers pass on: {resp:?}"
                );
            }
            last = Some(resp);
        }
        let resp = last.unwrap();
        let imm = immediate(&resp);
        assert_eq!(
            imm.status.as_ref().map(|s| s.code),
            Some(400),
            "{id}: {imm:?}"
        );
        let json: serde_json::Value = serde_json::from_slice(&imm.body).unwrap();
        assert_eq!(json["error"]["type"], kind, "{id}: {json}");
        let message = json["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{id}: {message:?} names {says:?}");
        s.close().await;
        assert!(stack.request(id).await.is_none(), "{id}: nothing reserved");
    }
}

/// The picker port's gRPC health answers the names the endpoint-picker protocol gives
/// (Kubernetes' gRPC probes of a picker ask `liveness` and `readiness`): all SERVING once
/// decision is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_port_answers_the_protocols_health_names() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    let stack = Stack::start().await;
    let ch = Channel::from_shared(format!("http://{}", stack.ext_proc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(ch);
    for name in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let status = health
            .check(HealthCheckRequest {
                service: name.into(),
            })
            .await
            .unwrap_or_else(|e| panic!("health of {name:?}: {e:?}"))
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "{name}");
    }
}

/// A stream that ends after the routing answer but before any response phase (Envoy closed
/// it, or reset it when the client went away): the reservation leaves σ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_ending_before_a_response_releases_its_reservation() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;

    // Envoy half-closes the stream (the request ended before the upstream answered)
    let mut s = Envoy::open(&mut client).await;
    let resp = s
        .exchange(headers(
            &[
                ("x-request-id", "gone-1"),
                ("x-balanceroute-prompt-tokens", "700"),
            ],
            true,
        ))
        .await;
    let (endpoint, _) = routed_at_headers(&resp);
    placed_on_answered_worker(&stack, "gone-1", &endpoint).await;
    s.close().await;
    eventually(
        Duration::from_secs(10),
        "gone-1 released from σ",
        || async { stack.request("gone-1").await.is_none() },
    )
    .await;

    // the client went away: the stream is reset (both halves dropped)
    let mut s = Envoy::open(&mut client).await;
    let resp = s
        .exchange(headers(
            &[
                ("x-request-id", "gone-2"),
                ("x-balanceroute-prompt-tokens", "700"),
            ],
            true,
        ))
        .await;
    let (endpoint, _) = routed_at_headers(&resp);
    placed_on_answered_worker(&stack, "gone-2", &endpoint).await;
    drop(s);
    eventually(
        Duration::from_secs(10),
        "gone-2 released from σ",
        || async { stack.request("gone-2").await.is_none() },
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "both counted as released",
        || async {
            stack
                .metric(
                    "balanceroute_decision_ext_proc_streams_total",
                    ("outcome", "released"),
                )
                .await
                == 2.0
        },
    )
    .await;
    // through the Cancel path, and counted there too
    assert_eq!(
        stack
            .metric(
                "balanceroute_decision_cancel_total",
                ("outcome", "released")
            )
            .await,
        2.0
    );

    // a stream that ends while its body is awaited holds nothing
    let mut s = Envoy::open(&mut client).await;
    s.exchange(headers(&[("x-request-id", "never")], false))
        .await;
    drop(s);
    eventually(
        Duration::from_secs(10),
        "the bodiless stream counted as abandoned",
        || async {
            stack
                .metric(
                    "balanceroute_decision_ext_proc_streams_total",
                    ("outcome", "abandoned"),
                )
                .await
                == 1.0
        },
    )
    .await;
    assert!(stack.request("never").await.is_none());
}

/// Failures are answered as Envoy can relay them: an ImmediateResponse with the HTTP status
/// of the gRPC code (400 bad input, 404 an unserved group, 503 nothing can place) and an
/// OpenAI-shaped JSON error; nothing is reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_immediate_responses() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let cases: Vec<(&str, Vec<ProcessingRequest>, u32, &str)> = vec![
        (
            "a token count that is not a number",
            vec![headers(
                &[
                    ("x-request-id", "bad-1"),
                    ("x-balanceroute-prompt-tokens", "many"),
                ],
                true,
            )],
            400,
            "invalid_request",
        ),
        (
            "no body and no token count",
            vec![headers(&[("x-request-id", "bad-2")], true)],
            400,
            "invalid_request",
        ),
        (
            "a body that is not JSON",
            vec![
                headers(&[("x-request-id", "bad-3")], false),
                raw_body(b"{not json"),
            ],
            400,
            "invalid_request",
        ),
        (
            "a prompt over Assign's limit",
            vec![headers(
                &[
                    ("x-request-id", "bad-4"),
                    ("x-balanceroute-prompt-tokens", "20000000"),
                ],
                true,
            )],
            400,
            "invalid_argument",
        ),
        (
            "a group this service does not serve",
            vec![headers(
                &[
                    ("x-request-id", "bad-5"),
                    ("x-balanceroute-group", "nope"),
                    ("x-balanceroute-prompt-tokens", "10"),
                ],
                true,
            )],
            404,
            "not_found",
        ),
        (
            "an endpoint subset that holds no rank of the group",
            vec![headers_with_subset(
                &[
                    ("x-request-id", "bad-7"),
                    ("x-balanceroute-prompt-tokens", "10"),
                ],
                &["10.9.9.9:1"],
            )],
            503,
            "unavailable",
        ),
        (
            "an empty endpoint subset",
            vec![headers_with_subset(
                &[
                    ("x-request-id", "bad-8"),
                    ("x-balanceroute-prompt-tokens", "10"),
                ],
                &[],
            )],
            503,
            "unavailable",
        ),
        (
            "a group with no worker",
            vec![headers(
                &[
                    ("x-request-id", "bad-6"),
                    ("x-balanceroute-group", EMPTY),
                    ("x-balanceroute-prompt-tokens", "10"),
                ],
                true,
            )],
            503,
            "unavailable",
        ),
    ];
    for (what, msgs, status, kind) in cases {
        let mut s = Envoy::open(&mut client).await;
        let n = msgs.len();
        let mut last = None;
        for (i, m) in msgs.into_iter().enumerate() {
            let resp = s.exchange(m).await;
            if i + 1 < n {
                assert!(
                    matches!(resp.response, Some(Out::RequestHeaders(_))),
                    "{what}: the headers pass on: {resp:?}"
                );
            }
            last = Some(resp);
        }
        let resp = last.unwrap();
        let imm = immediate(&resp);
        assert_eq!(
            imm.status.as_ref().map(|s| s.code),
            Some(status as i32),
            "{what}: {imm:?}"
        );
        let json: serde_json::Value = serde_json::from_slice(&imm.body)
            .unwrap_or_else(|e| panic!("{what}: the body is JSON: {e}"));
        assert_eq!(json["error"]["type"], kind, "{what}: {json}");
        assert_eq!(json["error"]["code"], status, "{what}: {json}");
        assert!(
            resp.dynamic_metadata.is_none(),
            "{what}: no endpoint picked"
        );
        s.close().await;
    }
    for id in [
        "bad-1", "bad-2", "bad-3", "bad-4", "bad-5", "bad-6", "bad-7", "bad-8",
    ] {
        // bad-7 was placed, then released (Snapshot.Release may land a moment later)
        eventually(
            Duration::from_secs(10),
            "nothing reserved for a refusal",
            || async { stack.request(id).await.is_none() },
        )
        .await;
    }
    assert_eq!(
        stack
            .metric(
                "balanceroute_decision_ext_proc_streams_total",
                ("outcome", "refused")
            )
            .await,
        8.0
    );
}

/// The picker's port is the decision service's edge: with mutual TLS on, Envoy's gateway
/// certificate may call Process, a worker's may not (PERMISSION_DENIED before anything runs),
/// and a client without a certificate does not get through the handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_port_has_the_grpc_ports_trust() {
    use br_e2e::pki::{Pki, channel};
    use br_trust::Role;
    let pki = Pki::new();
    let mut args: Vec<String> = pki.flags(Role::Decision);
    // no snapshot service: the gateway's call gets through authorisation and is answered 503
    args.extend(
        [
            "--snapshot-addr",
            "https://127.0.0.1:1",
            "--groups",
            GROUP,
            "--ext-proc-listen",
            "127.0.0.1:0",
        ]
        .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let decision = Service::start("br-decision", &args);
    // br-trust's connector does the TLS itself under an http:// URL, as for every service
    let url = format!("http://{}", decision.ready_addr("ext_proc"));

    let req = || {
        headers(
            &[
                ("x-request-id", "tls-1"),
                ("x-balanceroute-prompt-tokens", "10"),
            ],
            true,
        )
    };
    let gateway = channel(&url, &pki.role(Role::Gateway), Some(Role::Decision));
    let mut s = Envoy::open(&mut ExternalProcessorClient::new(gateway)).await;
    let resp = s.exchange(req()).await;
    assert_eq!(immediate(&resp).status.as_ref().map(|s| s.code), Some(503));

    let worker = channel(&url, &pki.worker(GROUP, 0), Some(Role::Decision));
    let (tx, rx) = mpsc::channel(1);
    tx.send(req()).await.unwrap();
    let denied = within(
        ANSWER,
        "the worker's call is refused",
        ExternalProcessorClient::new(worker).process(ReceiverStream::new(rx)),
    )
    .await
    .expect_err("a worker may not call Process");
    assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");

    let plain = tonic::transport::Endpoint::from_shared(url.clone())
        .unwrap()
        .connect_timeout(ANSWER);
    let refused = within(ANSWER, "a plaintext client is refused", async {
        let ch = plain.connect().await?;
        let (tx, rx) = mpsc::channel(1);
        tx.send(req()).await.unwrap();
        let mut c = ExternalProcessorClient::new(ch);
        let mut stream = c
            .process(ReceiverStream::new(rx))
            .await
            .map_err(|s| Box::new(s) as Box<dyn std::error::Error + Send + Sync>)?
            .into_inner();
        stream
            .message()
            .await
            .map_err(|s| Box::new(s) as Box<dyn std::error::Error + Send + Sync>)?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })
    .await;
    assert!(refused.is_err(), "a client without TLS got an answer");
}

/// deploy/envoy/envoy.yaml says what the picker needs (the settings its README section
/// names): a drift there would route every request nowhere, silently.
#[test]
fn the_envoy_example_configures_what_the_picker_needs() {
    use yaml_rust2::{Yaml, YamlLoader};
    let path = br_e2e::root().join("deploy/envoy/envoy.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let doc = &YamlLoader::load_from_str(&text).unwrap()[0];
    let s = |y: &Yaml| y.as_str().map(str::to_owned);
    let listener = &doc["static_resources"]["listeners"][0];
    let hcm = &listener["filter_chains"][0]["filters"][0]["typed_config"];
    assert_eq!(hcm["preserve_external_request_id"].as_bool(), Some(true));
    let filters = hcm["http_filters"].as_vec().unwrap();
    let ext = filters
        .iter()
        .find(|f| s(&f["name"]).as_deref() == Some("envoy.filters.http.ext_proc"))
        .expect("an ext_proc filter")["typed_config"]
        .clone();
    let mode = &ext["processing_mode"];
    assert_eq!(s(&mode["request_body_mode"]).as_deref(), Some("BUFFERED"));
    assert_eq!(s(&mode["response_header_mode"]).as_deref(), Some("SEND"));
    assert_eq!(ext["failure_mode_allow"].as_bool(), Some(false));
    // message_timeout above br-decision's default --ext-proc-timeout (10s)
    let timeout = s(&ext["message_timeout"]).unwrap();
    let secs: u64 = timeout.trim_end_matches('s').parse().unwrap();
    assert!(
        secs > 10,
        "message_timeout {timeout} must exceed --ext-proc-timeout"
    );
    let picker = s(&ext["grpc_service"]["envoy_grpc"]["cluster_name"]).unwrap();
    let clusters = doc["static_resources"]["clusters"].as_vec().unwrap();
    let cluster = |name: &str| {
        clusters
            .iter()
            .find(|c| s(&c["name"]).as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no cluster {name}"))
    };
    let picker = cluster(&picker);
    assert_eq!(
        s(&picker["health_checks"][0]["grpc_health_check"]["service_name"]).as_deref(),
        Some("envoy.service.ext_proc.v3.ExternalProcessor")
    );
    // the route's cluster follows the picker's header
    let route = &hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"];
    let upstream = cluster(&s(&route["cluster"]).unwrap());
    assert_eq!(s(&upstream["type"]).as_deref(), Some("ORIGINAL_DST"));
    assert_eq!(
        s(&upstream["original_dst_lb_config"]["http_header_name"]).as_deref(),
        Some(ENDPOINT_KEY)
    );
}

/// The picker's port follows the rule of every port: plaintext beyond loopback is refused at
/// start (exit 2, naming the flag), so an Envoy can reach it only with mutual TLS.
#[test]
fn a_plaintext_picker_beyond_loopback_is_refused_at_start() {
    let (status, stderr) = br_e2e::run_to_exit(
        "br-decision",
        &[
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--snapshot-addr",
            "http://127.0.0.1:1",
            "--ext-proc-listen",
            "0.0.0.0:0",
        ],
    );
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--ext-proc-listen"), "{stderr}");
}

/// The pool bounds what waiting streams hold: with every slot taken, one request waits in the
/// pool (no answer yet), the next is refused 429 at once (the pool is at `--max-pool`), and the
/// waiting stream, once its client goes away, is withdrawn: nothing stays in the pool or σ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_is_429_and_a_waiting_stream_that_ends_is_withdrawn() {
    let stack = Stack::start_with(&["--max-pool", "1"]).await;
    let mut client = stack.client().await;
    // both workers full (capacity 8 each): 16 answered requests hold every slot
    for i in 0..16 {
        let id = format!("fill-{i}");
        let mut s = Envoy::open(&mut client).await;
        let resp = s
            .exchange(headers(
                &[
                    ("x-request-id", &id),
                    ("x-balanceroute-prompt-tokens", "10"),
                ],
                true,
            ))
            .await;
        routed_at_headers(&resp);
        s.exchange(response_headers()).await;
        s.close().await;
    }
    let pool = || async {
        stack
            .metric("balanceroute_decision_pool_size", ("group", GROUP))
            .await
    };
    // the 17th waits in the pool
    let waiting = Envoy::open(&mut client).await;
    waiting
        .tx
        .as_ref()
        .unwrap()
        .send(headers(
            &[
                ("x-request-id", "wait-1"),
                ("x-balanceroute-prompt-tokens", "10"),
            ],
            true,
        ))
        .await
        .unwrap();
    eventually(
        Duration::from_secs(10),
        "wait-1 waits in the pool",
        || async { pool().await == 1.0 },
    )
    .await;
    // the 18th finds the pool full
    let mut s = Envoy::open(&mut client).await;
    let resp = s
        .exchange(headers(
            &[
                ("x-request-id", "full-1"),
                ("x-balanceroute-prompt-tokens", "10"),
            ],
            true,
        ))
        .await;
    assert_eq!(immediate(&resp).status.as_ref().map(|s| s.code), Some(429));
    s.close().await;
    // the waiting client goes away: withdrawn, not placed later
    drop(waiting);
    eventually(Duration::from_secs(10), "the pool empties", || async {
        pool().await == 0.0
    })
    .await;
    eventually(
        Duration::from_secs(10),
        "the waiting stream counted as abandoned",
        || async {
            stack
                .metric(
                    "balanceroute_decision_ext_proc_streams_total",
                    ("outcome", "abandoned"),
                )
                .await
                == 1.0
        },
    )
    .await;
    for id in ["wait-1", "full-1"] {
        assert!(stack.request(id).await.is_none(), "{id} holds nothing in σ");
    }
}

/// A streamed request-body chunk (Envoy's STREAMED mode: one answer per chunk).
fn chunk(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(In::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Each stream bounds its own body, and `--ext-proc-max-buffered-bytes` bounds them all
/// together: many streams each holding part of a body fill the budget, the next chunk that
/// does not fit is refused 503 (counted), and bytes come back when a stream ends or its
/// body is parsed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_streams_share_one_body_budget() {
    const PART: usize = 16 << 10;
    const FIT: usize = 4;
    // room for FIT parts and a little more (the last chunk of one body), not FIT + 1 parts
    const BUDGET: usize = FIT * PART + 1024;
    let budget = BUDGET.to_string();
    let stack = Stack::start_with(&["--ext-proc-max-buffered-bytes", &budget]).await;
    let mut client = stack.client().await;
    let metrics =
        || async { br_testkit::http::metrics_url(&stack.decision.admin_url("/metrics")).await };
    // the first part of a JSON body whose prompt is PART bytes of text
    let mut first = br#"{"model":"m","prompt":""#.to_vec();
    first.resize(PART, b'x');
    let last = br#""}"#;

    let mut held = Vec::new();
    let mut refused: u32 = 0;
    for i in 0..12 {
        let id = format!("budget-{i}");
        let mut s = Envoy::open(&mut client).await;
        let resp = s.exchange(headers(&[("x-request-id", &id)], false)).await;
        assert!(
            matches!(resp.response, Some(Out::RequestHeaders(_))),
            "{resp:?}"
        );
        let resp = s.exchange(chunk(&first, false)).await;
        match &resp.response {
            Some(Out::RequestBody(_)) => held.push(s),
            Some(Out::ImmediateResponse(i)) => {
                assert_eq!(i.status.as_ref().map(|s| s.code), Some(503), "{i:?}");
                assert!(
                    String::from_utf8_lossy(&i.body).contains("--ext-proc-max-buffered-bytes"),
                    "{i:?}"
                );
                refused += 1;
                s.close().await;
            }
            other => panic!("stream {i}: expected the chunk taken or refused, got {other:?}"),
        }
    }
    assert_eq!(held.len(), FIT, "as many streams as the budget holds");
    assert_eq!(refused as usize, 12 - FIT);
    let m = metrics().await;
    assert_eq!(
        m.value("balanceroute_decision_ext_proc_budget_refusals_total", &[]),
        f64::from(refused)
    );
    assert_eq!(
        m.value("balanceroute_decision_ext_proc_buffered_bytes", &[]),
        (FIT * PART) as f64
    );

    // A stream that ends gives its bytes back; another can buffer again.
    held.pop().expect("a held stream").close().await;
    eventually(
        Duration::from_secs(10),
        "an ended stream's bytes come back",
        || async {
            metrics()
                .await
                .value("balanceroute_decision_ext_proc_buffered_bytes", &[])
                == ((FIT - 1) * PART) as f64
        },
    )
    .await;
    let mut s = Envoy::open(&mut client).await;
    s.exchange(headers(&[("x-request-id", "budget-again")], false))
        .await;
    let resp = s.exchange(chunk(&first, false)).await;
    assert!(
        matches!(resp.response, Some(Out::RequestBody(_))),
        "{resp:?}"
    );

    // A body that completes is parsed and routed; its bytes go back to the budget.
    let resp = s.exchange(chunk(last, true)).await;
    routed_at_body(&resp);
    s.exchange(response_headers()).await;
    s.close().await;
    for s in held {
        s.close().await;
    }
    eventually(Duration::from_secs(10), "every byte is back", || async {
        metrics()
            .await
            .value("balanceroute_decision_ext_proc_buffered_bytes", &[])
            == 0.0
    })
    .await;
}

/// The default body budget (64 MiB) filled by streams that each hold 1 MiB of a body, then
/// let go: while they hold, br-decision holds the bodies and, per stream, tonic's decode buffer
/// of the largest message it took (as large as the body; the budget counts the bodies only),
/// so about twice the budget; once they have gone its memory goes back to the system (within
/// 2x of its idle RSS within 30 s), as the allocator's background purge does without anyone
/// calling for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_body_budget_is_given_back_once_the_streams_go() {
    const PART: usize = 1 << 20;
    const STREAMS: usize = 80;
    const DEFAULT_BUDGET: usize = 64 << 20;
    let stack = Stack::start().await;
    let pid = stack.decision.pid().expect("br-decision runs");
    let mut client = stack.client().await;
    let idle = br_e2e::rss_bytes(pid);
    let mut first = br#"{"model":"m","prompt":""#.to_vec();
    first.resize(PART, b'x');

    let mut held = Vec::new();
    for i in 0..STREAMS {
        let id = format!("full-{i}");
        let mut s = Envoy::open(&mut client).await;
        s.exchange(headers(&[("x-request-id", &id)], false)).await;
        match s.exchange(chunk(&first, false)).await.response {
            Some(Out::RequestBody(_)) => held.push(s),
            Some(Out::ImmediateResponse(i)) => {
                assert_eq!(i.status.as_ref().map(|s| s.code), Some(503), "{i:?}");
                s.close().await;
            }
            other => panic!("stream {i}: expected the chunk taken or refused, got {other:?}"),
        }
    }
    assert_eq!(
        held.len(),
        DEFAULT_BUDGET / PART,
        "the budget holds 64 parts"
    );
    let loaded = br_e2e::rss_bytes(pid);
    eprintln!(
        "br-decision: idle {} MiB, {} MiB with {} bodies held",
        idle >> 20,
        loaded >> 20,
        held.len()
    );
    // the bodies and a decode buffer per stream, and some room for the rest
    let bound = idle + 2 * DEFAULT_BUDGET as u64 + (16 << 20);
    assert!(
        loaded < bound,
        "{} MiB with the budget full (bound {} MiB)",
        loaded >> 20,
        bound >> 20
    );

    for s in held {
        s.close().await;
    }
    let back = br_e2e::memory_given_back(pid, idle, loaded, "br-decision").await;
    eprintln!("br-decision: {} MiB once the streams had gone", back >> 20);
}

/// A request id belongs to the live stream that brought it first: a second stream with the
/// same `x-request-id` (Envoy keeps a client's own) is refused 409 and counted, and when it
/// then goes away it releases nothing, so the first stream's reservation stays. Once the
/// first stream has ended, the id may come again (a client's retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_stream_with_a_live_request_id_is_refused_and_releases_nothing() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let ask = || {
        headers(
            &[
                ("x-request-id", "shared-1"),
                ("x-balanceroute-prompt-tokens", "300"),
            ],
            true,
        )
    };
    let mut first = Envoy::open(&mut client).await;
    let (endpoint, _) = routed_at_headers(&first.exchange(ask()).await);
    placed_on_answered_worker(&stack, "shared-1", &endpoint).await;

    // Another stream (another client choosing the same id) while the first one lives.
    let mut second = Envoy::open(&mut client).await;
    let resp = second.exchange(ask()).await;
    let refusal = immediate(&resp);
    assert_eq!(
        refusal.status.as_ref().map(|s| s.code),
        Some(409),
        "{refusal:?}"
    );
    let body = String::from_utf8_lossy(&refusal.body);
    assert!(
        body.contains("already_exists") && body.contains("shared-1"),
        "{body}"
    );
    // it goes away before any response phase, as an abandoning client does
    drop(second);
    eventually(
        Duration::from_secs(10),
        "the second stream counted as refused",
        || async {
            stack
                .metric(
                    "balanceroute_decision_ext_proc_streams_total",
                    ("outcome", "refused"),
                )
                .await
                == 1.0
        },
    )
    .await;
    let m = br_testkit::http::metrics_url(&stack.decision.admin_url("/metrics")).await;
    assert_eq!(
        m.value(
            "balanceroute_decision_ext_proc_request_id_conflicts_total",
            &[]
        ),
        1.0
    );
    placed_on_answered_worker(&stack, "shared-1", &endpoint).await;
    assert_eq!(
        stack
            .metric(
                "balanceroute_decision_cancel_total",
                ("outcome", "released")
            )
            .await,
        0.0,
        "nothing was released"
    );

    // The first stream's rank answers; once its stream has ended the id is free again.
    first.exchange(response_headers()).await;
    first.close().await;
    let mut retry = Envoy::open(&mut client).await;
    let (again, _) = routed_at_headers(&retry.exchange(ask()).await);
    assert_eq!(again, endpoint, "Assign is idempotent by request id");
    retry.exchange(response_headers()).await;
    retry.close().await;
    assert!(stack.request("shared-1").await.is_some());
}

/// A stream whose request body does not arrive within `--ext-proc-body-timeout` is answered
/// 408 and ended by the server, counted, and gives back what it held: its buffered bytes
/// and its request id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_waiting_for_its_body_times_out_and_releases_what_it_held() {
    let stack = Stack::start_with(&["--ext-proc-body-timeout", "500ms"]).await;
    let mut client = stack.client().await;
    let metrics =
        || async { br_testkit::http::metrics_url(&stack.decision.admin_url("/metrics")).await };
    let mut s = Envoy::open(&mut client).await;
    let resp = s
        .exchange(headers(&[("x-request-id", "slow-1")], false))
        .await;
    assert!(
        matches!(resp.response, Some(Out::RequestHeaders(_))),
        "{resp:?}"
    );
    // part of the body, then nothing more (a client that stalls mid-body)
    let resp = s.exchange(chunk(br#"{"model":"m","prompt":"#, false)).await;
    assert!(
        matches!(resp.response, Some(Out::RequestBody(_))),
        "{resp:?}"
    );
    let held = metrics()
        .await
        .value("balanceroute_decision_ext_proc_buffered_bytes", &[]);
    assert!(held > 0.0, "the stream holds its bytes: {held}");

    // The server answers 408 on its own, then ends the stream.
    let resp = within(ANSWER, "the body timeout's answer", s.rx.message())
        .await
        .expect("an answer, not an error status")
        .expect("an answer, not the end");
    let refusal = immediate(&resp);
    assert_eq!(
        refusal.status.as_ref().map(|s| s.code),
        Some(408),
        "{refusal:?}"
    );
    assert!(
        String::from_utf8_lossy(&refusal.body).contains("--ext-proc-body-timeout"),
        "{refusal:?}"
    );
    let end = within(ANSWER, "the stream's end", s.rx.message()).await;
    assert!(
        matches!(end, Ok(None)),
        "the server ends the stream: {end:?}"
    );

    let m = metrics().await;
    assert_eq!(
        m.value("balanceroute_decision_ext_proc_body_timeouts_total", &[]),
        1.0
    );
    assert_eq!(
        m.value(
            "balanceroute_decision_ext_proc_streams_total",
            &[("outcome", "body_timeout")]
        ),
        1.0
    );
    assert_eq!(
        m.value("balanceroute_decision_ext_proc_buffered_bytes", &[]),
        0.0
    );
    // the id is free: a new stream with it routes
    let mut again = Envoy::open(&mut client).await;
    let resp = again
        .exchange(headers(
            &[
                ("x-request-id", "slow-1"),
                ("x-balanceroute-prompt-tokens", "10"),
            ],
            true,
        ))
        .await;
    routed_at_headers(&resp);
    again.exchange(response_headers()).await;
    again.close().await;
}
