//! The Envoy external-processing endpoint picker (`--ext-proc-listen`): this module owns the
//! `envoy.service.ext_proc.v3.ExternalProcessor/Process` stream, from Envoy's request phase to
//! the routing answer, and the release of a reservation whose request never reached its rank.
//!
//! It speaks the Gateway API Inference Extension's endpoint-picker protocol
//! (kubernetes-sigs/gateway-api-inference-extension, `docs/proposals/004-endpoint-picker-protocol`
//! at f7d96a8, and its reference EPP's `pkg/epp/handlers/request.go` at aeac870): the answer to
//! the request phase sets the `x-gateway-destination-endpoint: <ip:port>` request header and
//! the dynamic metadata `envoy.lb` / `x-gateway-destination-endpoint` with the same value, so
//! an Envoy whose upstream cluster is `ORIGINAL_DST` with `use_http_header` (or reads the
//! metadata) sends the request to the chosen rank; nothing can place: an `ImmediateResponse`
//! with 503, a full pool 429, bad input 400 (see [`http_status`]).
//!
//! Per stream, one HTTP request:
//! * group: the `x-balanceroute-group` header, else `--ext-proc-default-group` (or the one
//!   served group); request id: `x-request-id` (Envoy sets one unless told not to), else a
//!   fresh random one, added to the request so the rank's shim reports it under that id;
//! * prompt tokens: the `x-balanceroute-prompt-tokens` header the gateway sets when it knows
//!   them (after prefill), else an estimate from the buffered JSON body ([`estimate`]);
//!   `max_tokens` (or `max_completion_tokens`) from the body when there is one;
//! * the Assign is the gRPC method's own path ([`DecisionService::assign_call`]): the same
//!   validation, pool, idempotency by request id and metrics;
//! * answered with the endpoint in the headers phase when the request has no body (or Envoy
//!   sends none: `protocol_config.request_body_mode = NONE`) and the header gives the tokens,
//!   else in the body phase (`request_body_mode: BUFFERED`, so the header mutation still
//!   applies); with `FULL_DUPLEX_STREAMED` (what gateways configure for InferencePools, said in
//!   the first message's `protocol_config`) the headers' answer is held until the body has
//!   arrived, as the reference EPP does, then sent with the endpoint, followed by the body
//!   itself as one streamed body response; streamed response bodies are echoed unchanged;
//! * the protocol's subset hint (filter metadata `envoy.lb.subset_hint` /
//!   `x-gateway-destination-endpoint-subset`, the endpoints the gateway allows): the policy
//!   still chooses among the group's live ranks, and a choice outside the subset is released
//!   and answered 503, as the protocol asks when no endpoint of the list is eligible;
//! * a stream that ends (Envoy closed it, the client went away, Envoy reset it) after the
//!   routing answer but before any response phase (`response_header_mode: SEND`) had its
//!   request never answered by the rank: its reservation is released through the Cancel path
//!   ([`DecisionService::cancel_call`]), as a gateway that gives up would. A stream that ends
//!   while its Assign waits withdraws it (the same drop guard as a gRPC caller that leaves).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use br_proto::v1;
use br_proto::valid::GroupId;
use br_runtime::error::{ServiceError as _, code_label};
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, Metadata, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse, body_mutation, processing_request, processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use prometheus::IntGauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::edge::grpc::{Caller, DecisionService};
use crate::error::DecisionError;
use crate::metrics::Metrics;

/// The gRPC service this port serves.
pub const SERVICE_NAME: &str = br_trust::policy::EXT_PROC;
/// The endpoint-picker protocol's header and metadata key of the chosen endpoint.
pub const DESTINATION_ENDPOINT: &str = "x-gateway-destination-endpoint";
/// The dynamic-metadata namespace the protocol puts [`DESTINATION_ENDPOINT`] in.
pub const DESTINATION_NAMESPACE: &str = "envoy.lb";
/// The group of the request (else the default group).
pub const GROUP_HEADER: &str = "x-balanceroute-group";
/// The prompt's token count, when the gateway knows it (else estimated from the body).
pub const PROMPT_TOKENS_HEADER: &str = "x-balanceroute-prompt-tokens";
/// The request id: Assign's idempotency key and what the shim reports the request under.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// The filter-metadata namespace of the protocol's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key, in [`SUBSET_NAMESPACE`], of the endpoints the picker may choose from.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The most request body one stream buffers (Envoy's own buffer limit usually bounds it first;
/// each message is also bounded by the server's 4 MiB decoding limit).
pub const MAX_BODY_BYTES: usize = 16 << 20;
/// The default of `--ext-proc-max-buffered-bytes`: the request bodies all streams together
/// may hold (four streams at [`MAX_BODY_BYTES`], as br-shim's `--max-buffered-body-bytes`).
pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 4 * MAX_BODY_BYTES;
/// Messages a stream may send while its Assign waits (Envoy sends none, or its trailers).
const MAX_PENDING: usize = 8;
/// Responses queued towards Envoy per stream (it reads each before sending the next message).
const RESPONSE_QUEUE: usize = 4;

/// The endpoint picker's settings.
#[derive(Debug, Clone)]
pub struct ExtProcSettings {
    /// The group of a request without [`GROUP_HEADER`]; `None`: such a request is refused.
    pub default_group: Option<GroupId>,
    /// How long one request's Assign may wait.
    pub timeout: Duration,
    /// The request-body bytes every stream together may buffer (`--ext-proc-max-buffered-bytes`).
    pub max_buffered_bytes: usize,
}

/// The request-body bytes all streams of the picker hold, bounded process-wide: each stream
/// bounds its own body ([`MAX_BODY_BYTES`]) but many streams could together exhaust memory.
/// A stream takes one permit per byte as each body message arrives and gives them back when
/// the body is dropped (parsed, or sent back to Envoy in full-duplex mode) or the stream ends;
/// a message that does not fit is refused 503 at once (nothing waits for room: Envoy retries
/// or fails over, and a waiting stream would hold what it has).
#[derive(Debug, Clone)]
struct BodyBudget {
    permits: Arc<Semaphore>,
    /// The bytes held now (`balanceroute_decision_ext_proc_buffered_bytes`).
    held: IntGauge,
    max: usize,
}

/// One stream's share of the [`BodyBudget`]; given back on drop.
#[derive(Debug)]
struct BodyHold {
    permit: OwnedSemaphorePermit,
    held: IntGauge,
}

impl BodyBudget {
    fn new(max: usize, held: IntGauge) -> BodyBudget {
        let max = max.min(Semaphore::MAX_PERMITS);
        BodyBudget {
            permits: Arc::new(Semaphore::new(max)),
            held,
            max,
        }
    }

    /// Takes `n` more bytes into `hold`; `false` (nothing taken) when they do not fit.
    fn take(&self, hold: &mut Option<BodyHold>, n: usize) -> bool {
        if n == 0 {
            return true;
        }
        let Ok(n32) = u32::try_from(n) else {
            return false;
        };
        let Ok(permit) = Arc::clone(&self.permits).try_acquire_many_owned(n32) else {
            return false;
        };
        self.held.add(i64::from(n32));
        match hold {
            Some(h) => h.permit.merge(permit),
            None => {
                *hold = Some(BodyHold {
                    permit,
                    held: self.held.clone(),
                });
            }
        }
        true
    }
}

impl Drop for BodyHold {
    fn drop(&mut self) {
        self.held
            .sub(i64::try_from(self.permit.num_permits()).unwrap_or(i64::MAX));
    }
}

/// `envoy.service.ext_proc.v3.ExternalProcessor` over a [`DecisionService`].
#[derive(Clone, Debug)]
pub struct ExtProcService {
    svc: DecisionService,
    settings: Arc<ExtProcSettings>,
    metrics: Metrics,
    budget: BodyBudget,
}

impl ExtProcService {
    pub fn new(svc: DecisionService, settings: ExtProcSettings, metrics: Metrics) -> Self {
        let budget = BodyBudget::new(
            settings.max_buffered_bytes,
            metrics.ext_proc_buffered_bytes.clone(),
        );
        ExtProcService {
            svc,
            settings: Arc::new(settings),
            metrics,
            budget,
        }
    }
}

#[tonic::async_trait]
impl ExternalProcessor for ExtProcService {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        // The stream's identity (mutual TLS) owns the request it assigns, and releases it.
        let caller = Caller::of(br_trust::policy::caller(&request));
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(RESPONSE_QUEUE);
        let stream = Stream {
            ext: self.clone(),
            inbound,
            tx,
            pending: VecDeque::new(),
            state: State::AwaitHeaders,
            body: Vec::new(),
            body_hold: None,
            request_duplex: false,
            response_duplex: false,
            request_buffered: false,
            subset: None,
            caller,
        };
        tokio::spawn(stream.run());
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Why a request is refused with an `ImmediateResponse`.
#[derive(Debug)]
enum Refusal {
    /// Bad input found here (a header, the body): 400, or 413 for a body over the bound.
    Input { status: u16, message: String },
    /// The Assign failed: the status its gRPC code maps to.
    Assign(DecisionError),
    /// No endpoint the gateway allows could be chosen: 503.
    Unavailable(String),
    /// The process-wide body budget is in use (`--ext-proc-max-buffered-bytes`): 503.
    Busy(String),
}

impl Refusal {
    fn bad(message: impl Into<String>) -> Refusal {
        Refusal::Input {
            status: 400,
            message: message.into(),
        }
    }

    fn status(&self) -> u16 {
        match self {
            Refusal::Input { status, .. } => *status,
            Refusal::Assign(e) => http_status(e.grpc_code()),
            Refusal::Unavailable(_) | Refusal::Busy(_) => 503,
        }
    }

    /// The `type` of the JSON error body: the gRPC code's label, or `invalid_request`.
    fn kind(&self) -> &'static str {
        match self {
            Refusal::Input { .. } => "invalid_request",
            Refusal::Assign(e) => code_label(e.grpc_code()),
            Refusal::Unavailable(_) => "unavailable",
            Refusal::Busy(_) => "resource_exhausted",
        }
    }

    fn message(&self) -> String {
        match self {
            Refusal::Input { message, .. } => message.clone(),
            Refusal::Assign(e) => e.to_string(),
            Refusal::Unavailable(m) | Refusal::Busy(m) => m.clone(),
        }
    }
}

/// The HTTP status an Assign failure is answered with: the endpoint-picker protocol's 503
/// (nothing can place, including not before the deadline) and 429 (a full pool: shed), and
/// google.rpc's mapping for the rest (400 bad input, 404 an unserved group, 499 cancelled).
pub fn http_status(code: tonic::Code) -> u16 {
    use tonic::Code;
    match code {
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => 400,
        Code::NotFound => 404,
        Code::ResourceExhausted => 429,
        Code::Cancelled => 499,
        Code::Unavailable | Code::DeadlineExceeded => 503,
        Code::PermissionDenied => 403,
        Code::Unauthenticated => 401,
        _ => 500,
    }
}

/// What the request's headers said.
#[derive(Debug, Clone)]
struct Head {
    group: String,
    request_id: String,
    /// The request had no `x-request-id`: this one was made here and is added to it.
    generated_id: bool,
    prompt_tokens: Option<u32>,
    /// The request's W3C trace context (`traceparent`, `tracestate`), when traces are
    /// exported: its Assign continues the client's trace.
    trace: br_trace::W3c,
}

/// Where a stream is.
#[derive(Debug)]
enum State {
    AwaitHeaders,
    /// Headers answered; the Assign waits for the (buffered) body.
    AwaitBody(Head),
    /// Answered with an endpoint; a reservation is held until a response phase shows the rank
    /// answered (or released when the stream ends first).
    Routed {
        group: String,
        request_id: String,
    },
    /// Nothing more to do but answer Envoy's remaining messages.
    Done(Outcome),
}

/// How a stream ended (the `outcome` label of `balanceroute_decision_ext_proc_streams_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Routed, and a response phase showed the rank answered.
    Answered,
    /// Routed, but the stream ended before any response phase: the reservation was released.
    Released,
    /// Answered with an `ImmediateResponse`.
    Refused,
    /// Ended before a routing answer (the client or Envoy went away first).
    Abandoned,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Answered => "answered",
            Outcome::Released => "released",
            Outcome::Refused => "refused",
            Outcome::Abandoned => "abandoned",
        }
    }
}

/// One `Process` stream (one HTTP request), run in its own task.
struct Stream {
    ext: ExtProcService,
    inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    /// Messages that arrived while an Assign was waiting (answered after it).
    pending: VecDeque<ProcessingRequest>,
    state: State,
    /// The request body so far (streamed chunks until `end_of_stream`).
    body: Vec<u8>,
    /// `body`'s share of the process-wide [`BodyBudget`] (and, in full-duplex mode, of the
    /// whole body until it went back to Envoy).
    body_hold: Option<BodyHold>,
    /// Envoy sends the request body FULL_DUPLEX_STREAMED: no answer per chunk, the headers'
    /// answer waits for the body, and the body goes back as a streamed body response.
    request_duplex: bool,
    /// The same for the response body: each chunk is echoed as a streamed body response.
    response_duplex: bool,
    /// Envoy said it sends the request body BUFFERED: the one body message is the whole body,
    /// even without `end_of_stream` (trailers follow).
    request_buffered: bool,
    /// The endpoints the gateway allows (the protocol's subset hint), when it sent one.
    subset: Option<Vec<String>>,
    /// Who opened the stream: its Assign is bound to it, and its release is its Cancel.
    caller: Caller,
}

/// The stream has ended (Envoy closed or reset it, or stopped reading).
struct Gone;

impl Stream {
    async fn run(mut self) {
        loop {
            let msg = match self.pending.pop_front() {
                Some(m) => m,
                None => match self.next().await {
                    Some(m) => m,
                    None => break,
                },
            };
            if self.handle(msg).await.is_err() {
                break;
            }
        }
        self.finish().await;
    }

    /// The next message from Envoy; `None` when the stream ended (closed, reset, or our
    /// answers are no longer read).
    async fn next(&mut self) -> Option<ProcessingRequest> {
        tokio::select! {
            m = self.inbound.message() => match m {
                Ok(Some(m)) => Some(m),
                Ok(None) => None,
                Err(status) => {
                    tracing::debug!(%status, "ext_proc stream ended by an error");
                    None
                }
            },
            () = self.tx.closed() => None,
        }
    }

    async fn send(&self, resp: ProcessingResponse) -> Result<(), Gone> {
        self.tx.send(Ok(resp)).await.map_err(|_| Gone)
    }

    async fn handle(&mut self, msg: ProcessingRequest) -> Result<(), Gone> {
        use processing_request::Request as In;
        use processing_response::Response as Out;
        if msg.observability_mode {
            // Envoy ignores every answer in observability mode, so nothing could be routed.
            let status = Status::failed_precondition(
                "the endpoint picker cannot route in ext_proc observability_mode",
            );
            let _ = self.tx.send(Err(status)).await;
            self.state = State::Done(Outcome::Refused);
            return Err(Gone);
        }
        let body_mode = msg.protocol_config.map(|p| p.request_body_mode);
        if let Some(hint) = msg.metadata_context.as_ref().and_then(subset_hint) {
            self.subset = Some(hint);
        }
        if let Some(p) = msg.protocol_config {
            let duplex = BodySendMode::FullDuplexStreamed as i32;
            self.request_duplex = p.request_body_mode == duplex;
            self.response_duplex = p.response_body_mode == duplex;
            self.request_buffered = p.request_body_mode == BodySendMode::Buffered as i32;
        }
        match msg.request {
            Some(In::RequestHeaders(h)) => self.on_request_headers(h, body_mode).await,
            Some(In::RequestBody(b)) => {
                let State::AwaitBody(head) = &self.state else {
                    if self.request_duplex {
                        // refused already: Envoy stops; nothing to answer chunk by chunk
                        return Ok(());
                    }
                    return self.send(continue_with(Out::RequestBody)).await;
                };
                if self.body.len() + b.body.len() > MAX_BODY_BYTES {
                    let refusal = Refusal::Input {
                        status: 413,
                        message: format!("request body over {MAX_BODY_BYTES} bytes"),
                    };
                    return self.refuse(refusal).await;
                }
                if !self.ext.budget.take(&mut self.body_hold, b.body.len()) {
                    self.ext.metrics.ext_proc_budget_refusals_total.inc();
                    let message = format!(
                        "the endpoint picker holds its --ext-proc-max-buffered-bytes ({} bytes) \
                         of request bodies; retry",
                        self.ext.budget.max
                    );
                    tracing::warn!(%message, "ext_proc request body refused");
                    self.body = Vec::new();
                    self.body_hold = None;
                    return self.refuse(Refusal::Busy(message)).await;
                }
                self.body.extend_from_slice(&b.body);
                if !b.end_of_stream && !self.request_buffered {
                    if self.request_duplex {
                        // full duplex: the answers come once the body is whole
                        return Ok(());
                    }
                    // A streamed chunk: Envoy waits for this answer before the next one.
                    return self.send(continue_with(Out::RequestBody)).await;
                }
                let head = head.clone();
                let body = std::mem::take(&mut self.body);
                match parse_body(&body, head.prompt_tokens.is_none()) {
                    Ok((estimated, max_tokens)) => {
                        let tokens = match head.prompt_tokens {
                            Some(t) => t,
                            None => {
                                self.count_source("estimate");
                                estimated.unwrap_or(1)
                            }
                        };
                        let phase = if self.request_duplex {
                            Phase::DuplexBody(body)
                        } else {
                            // parsed: the bytes go back to the budget before the Assign waits
                            drop(body);
                            self.body_hold = None;
                            Phase::Body
                        };
                        let routed = self.route(head, tokens, max_tokens, phase).await;
                        self.body_hold = None;
                        routed
                    }
                    Err(refusal) => self.refuse(refusal).await,
                }
            }
            Some(In::RequestTrailers(_)) => {
                self.send(ProcessingResponse {
                    response: Some(Out::RequestTrailers(TrailersResponse::default())),
                    ..Default::default()
                })
                .await
            }
            Some(In::ResponseHeaders(_)) => {
                // The rank answered: the reservation stays (the shim's reports take it over).
                if matches!(self.state, State::Routed { .. }) {
                    self.state = State::Done(Outcome::Answered);
                }
                self.send(continue_with(Out::ResponseHeaders)).await
            }
            Some(In::ResponseBody(b)) if self.response_duplex => {
                // full duplex: the body reaches the client only through our answer
                self.send(ProcessingResponse {
                    response: Some(Out::ResponseBody(streamed_body(b.body, b.end_of_stream))),
                    ..Default::default()
                })
                .await
            }
            Some(In::ResponseBody(_)) => self.send(continue_with(Out::ResponseBody)).await,
            Some(In::ResponseTrailers(_)) => {
                self.send(ProcessingResponse {
                    response: Some(Out::ResponseTrailers(TrailersResponse::default())),
                    ..Default::default()
                })
                .await
            }
            None => {
                let status = Status::invalid_argument("a ProcessingRequest without a request");
                let _ = self.tx.send(Err(status)).await;
                Err(Gone)
            }
        }
    }

    async fn on_request_headers(
        &mut self,
        h: HttpHeaders,
        body_mode: Option<i32>,
    ) -> Result<(), Gone> {
        if !matches!(self.state, State::AwaitHeaders) {
            let status = Status::invalid_argument("request headers sent twice on one stream");
            let _ = self.tx.send(Err(status)).await;
            return Err(Gone);
        }
        let head = match self.read_head(h.headers.as_ref()) {
            Ok(head) => head,
            Err(refusal) => return self.refuse(refusal).await,
        };
        // Envoy sends no body when the request has none, or when its body mode is NONE (it
        // says so in the first message's protocol_config, from Envoy 1.33).
        let no_body = h.end_of_stream || body_mode == Some(BodySendMode::None as i32);
        if !no_body {
            self.state = State::AwaitBody(head);
            if self.request_duplex {
                // the headers' answer carries the endpoint, so it waits for the body
                return Ok(());
            }
            return self
                .send(continue_with(processing_response::Response::RequestHeaders))
                .await;
        }
        let Some(tokens) = head.prompt_tokens else {
            return self
                .refuse(Refusal::bad(format!(
                    "a request without a body needs the {PROMPT_TOKENS_HEADER} header (or send \
                     the body: ext_proc request_body_mode BUFFERED)"
                )))
                .await;
        };
        self.route(head, tokens, None, Phase::Headers).await
    }

    fn read_head(&self, headers: Option<&HeaderMap>) -> Result<Head, Refusal> {
        let get = |name: &str| headers.and_then(|h| header(h, name));
        let group = match get(GROUP_HEADER) {
            Some(g) => g,
            None => match &self.ext.settings.default_group {
                Some(g) => g.to_string(),
                None => {
                    return Err(Refusal::bad(format!(
                        "no {GROUP_HEADER} header and no --ext-proc-default-group"
                    )));
                }
            },
        };
        let (request_id, generated_id) = match get(REQUEST_ID_HEADER) {
            Some(id) if !id.is_empty() => (id, false),
            _ => (fresh_request_id(), true),
        };
        let prompt_tokens = match get(PROMPT_TOKENS_HEADER) {
            None => None,
            Some(v) => Some(v.trim().parse::<u32>().map_err(|_| {
                Refusal::bad(format!(
                    "{PROMPT_TOKENS_HEADER}: {v:?} is not a token count"
                ))
            })?),
        };
        if prompt_tokens.is_some() {
            self.count_source("header");
        }
        let trace = if br_trace::enabled() {
            br_trace::W3c {
                traceparent: get(br_trace::TRACEPARENT).unwrap_or_default(),
                tracestate: get(br_trace::TRACESTATE).unwrap_or_default(),
            }
        } else {
            br_trace::W3c::default()
        };
        Ok(Head {
            group,
            request_id,
            generated_id,
            prompt_tokens,
            trace,
        })
    }

    fn count_source(&self, source: &str) {
        self.ext
            .metrics
            .ext_proc_prompt_tokens_source_total
            .with_label_values(&[source])
            .inc();
    }

    /// Assigns the request (the gRPC method's path) and answers with its endpoint. While the
    /// Assign waits, the stream is watched: if it ends, the Assign is dropped, which withdraws
    /// it (and releases an answer that arrived unread).
    async fn route(
        &mut self,
        head: Head,
        prompt_tokens: u32,
        max_tokens: Option<u32>,
        phase: Phase,
    ) -> Result<(), Gone> {
        if self.subset.as_ref().is_some_and(Vec::is_empty) {
            let why = "the gateway's endpoint subset hint is empty".to_owned();
            return self.refuse(Refusal::Unavailable(why)).await;
        }
        let msg = v1::AssignRequest {
            group: head.group.clone(),
            request_id: head.request_id.clone(),
            prompt_tokens,
            prompt_hash: None,
            max_tokens,
        };
        let svc = self.ext.svc.clone();
        let timeout = self.ext.settings.timeout;
        let span = br_trace::server_span("ext_proc Assign", head.trace.context());
        let caller = self.caller.clone();
        let assign = svc.assign_call(msg, timeout, &caller);
        let assign = tracing::Instrument::instrument(assign, span);
        tokio::pin!(assign);
        let result = loop {
            tokio::select! {
                r = &mut assign => break r,
                m = self.inbound.message() => match m {
                    // Not expected while Envoy waits for our answer (trailers at most); kept
                    // for after it, up to a few: a peer that floods is cut off.
                    Ok(Some(m)) if self.pending.len() < MAX_PENDING => self.pending.push_back(m),
                    Ok(Some(_)) => {
                        let status = Status::resource_exhausted(
                            "too many ext_proc messages while the routing answer is pending",
                        );
                        let _ = self.tx.send(Err(status)).await;
                        self.state = State::Done(Outcome::Abandoned);
                        return Err(Gone);
                    }
                    Ok(None) | Err(_) => {
                        self.state = State::Done(Outcome::Abandoned);
                        return Err(Gone);
                    }
                },
                () = self.tx.closed() => {
                    self.state = State::Done(Outcome::Abandoned);
                    return Err(Gone);
                }
            }
        };
        let resp = match result {
            Ok(resp) => resp,
            Err(e) => return self.refuse(Refusal::Assign(e)).await,
        };
        // From here the reservation is held: released if the stream ends before a response.
        self.state = State::Routed {
            group: head.group.clone(),
            request_id: head.request_id.clone(),
        };
        let Some(endpoint) = host_port(&resp.endpoint) else {
            tracing::warn!(group = %head.group, worker = resp.worker_id, endpoint = %resp.endpoint,
                "the assigned worker announced no usable endpoint (br-shim --endpoint)");
            self.release().await;
            let refusal = Refusal::Assign(DecisionError::NoLiveWorker(head.group.clone()));
            return self.refuse(refusal).await;
        };
        if let Some(subset) = &self.subset
            && !subset.contains(&endpoint)
        {
            let why = format!(
                "the policy chose {endpoint} (worker {}), which is not in the gateway's endpoint \
                 subset",
                resp.worker_id
            );
            self.release().await;
            return self.refuse(Refusal::Unavailable(why)).await;
        }
        let mut set = vec![set_header(DESTINATION_ENDPOINT, &endpoint)];
        if head.generated_id {
            set.push(set_header(REQUEST_ID_HEADER, &head.request_id));
        }
        let common = CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers: set,
                remove_headers: Vec::new(),
            }),
            // The route may depend on the new header (a cluster per endpoint, say).
            clear_route_cache: true,
            ..Default::default()
        };
        tracing::debug!(group = %head.group, request_id = %head.request_id, %endpoint,
            worker = resp.worker_id, "ext_proc routed");
        let (response, then) = match phase {
            Phase::Headers => (
                processing_response::Response::RequestHeaders(HeadersResponse {
                    response: Some(common),
                }),
                None,
            ),
            Phase::Body => (
                processing_response::Response::RequestBody(BodyResponse {
                    response: Some(common),
                }),
                None,
            ),
            // the held headers' answer, then the body (unchanged) in one streamed response
            Phase::DuplexBody(body) => (
                processing_response::Response::RequestHeaders(HeadersResponse {
                    response: Some(common),
                }),
                Some(processing_response::Response::RequestBody(streamed_body(
                    body, true,
                ))),
            ),
        };
        self.send(ProcessingResponse {
            response: Some(response),
            dynamic_metadata: Some(destination_metadata(&endpoint)),
            ..Default::default()
        })
        .await?;
        match then {
            None => Ok(()),
            Some(r) => {
                self.send(ProcessingResponse {
                    response: Some(r),
                    ..Default::default()
                })
                .await
            }
        }
    }

    async fn refuse(&mut self, refusal: Refusal) -> Result<(), Gone> {
        let status = refusal.status();
        tracing::debug!(status, reason = refusal.kind(), message = %refusal.message(),
            "ext_proc request refused");
        self.ext
            .metrics
            .ext_proc_immediate_responses_total
            .with_label_values(&[&status.to_string()])
            .inc();
        self.state = State::Done(Outcome::Refused);
        self.send(immediate(&refusal)).await
    }

    /// Releases the held reservation (the Cancel path).
    async fn release(&mut self) {
        let State::Routed { group, request_id } =
            std::mem::replace(&mut self.state, State::Done(Outcome::Released))
        else {
            return;
        };
        let req = v1::CancelRequest {
            group: group.clone(),
            request_id: request_id.clone(),
        };
        match self.ext.svc.cancel_call(req, &self.caller).await {
            Ok(outcome) => tracing::debug!(%group, %request_id, outcome = outcome.label(),
                "ext_proc stream ended before a response: reservation released"),
            Err(e) => tracing::warn!(%group, %request_id, error = %e,
                "releasing the reservation of an ended ext_proc stream"),
        }
    }

    async fn finish(mut self) {
        if matches!(self.state, State::Routed { .. }) {
            self.release().await;
        }
        let outcome = match self.state {
            State::Done(o) => o,
            State::AwaitHeaders | State::AwaitBody(_) => Outcome::Abandoned,
            State::Routed { .. } => Outcome::Released,
        };
        self.ext
            .metrics
            .ext_proc_streams_total
            .with_label_values(&[outcome.label()])
            .inc();
    }
}

/// Which request phase the routing answer goes to.
#[derive(Debug)]
enum Phase {
    Headers,
    Body,
    /// FULL_DUPLEX_STREAMED: the held headers' answer, then this body back to Envoy.
    DuplexBody(Vec<u8>),
}

/// A body answer in FULL_DUPLEX_STREAMED mode: the chunk Envoy forwards (unchanged here).
fn streamed_body(body: Vec<u8>, end_of_stream: bool) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                        ..Default::default()
                    },
                )),
            }),
            ..Default::default()
        }),
    }
}

/// An answer that changes nothing.
fn continue_with<T: Default>(
    f: impl FnOnce(T) -> processing_response::Response,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(f(T::default())),
        ..Default::default()
    }
}

/// A header value from Envoy's map (lower-case names; the value in `raw_value` since Envoy
/// 1.27, in `value` before).
pub fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| {
            if h.raw_value.is_empty() {
                h.value.clone()
            } else {
                String::from_utf8_lossy(&h.raw_value).into_owned()
            }
        })
}

/// Sets (overwriting) one request header: a client's own `x-gateway-destination-endpoint`
/// must not survive, or it could pick the rank itself.
fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": "<ip:port>"}}`.
fn destination_metadata(endpoint: &str) -> Struct {
    let inner = Struct {
        fields: [(
            DESTINATION_ENDPOINT.to_owned(),
            Value {
                kind: Some(Kind::StringValue(endpoint.to_owned())),
            },
        )]
        .into_iter()
        .collect(),
    };
    Struct {
        fields: [(
            DESTINATION_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into_iter()
        .collect(),
    }
}

/// The `ImmediateResponse` of a refusal: its status and an OpenAI-shaped JSON error (as
/// br-shim's own refusals), so clients of an OpenAI API read it as they read the engine's.
fn immediate(refusal: &Refusal) -> ProcessingResponse {
    let status = refusal.status();
    let body = serde_json::json!({
        "error": {
            "message": refusal.message(),
            "type": refusal.kind(),
            "code": status,
        }
    });
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(status),
                }),
                headers: Some(HeaderMutation {
                    set_headers: vec![set_header("content-type", "application/json")],
                    remove_headers: Vec::new(),
                }),
                body: body.to_string().into(),
                details: format!("balanceroute_{}", refusal.kind()),
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

/// The protocol's subset hint from the request's filter metadata: a list of `ip:port` (a
/// comma-separated string is read too). `None` when the gateway sent none.
pub fn subset_hint(md: &Metadata) -> Option<Vec<String>> {
    let value = md
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET_KEY)?;
    let split = |s: &str| -> Vec<String> {
        s.split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_owned)
            .collect()
    };
    Some(match &value.kind {
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(split(s)),
                _ => None,
            })
            .flatten()
            .collect(),
        Some(Kind::StringValue(s)) => split(s),
        _ => Vec::new(),
    })
}

/// A request id for a request that came without one: 128 random bits in hex.
fn fresh_request_id() -> String {
    format!("br-{:032x}", rand::random::<u128>())
}

/// The `host:port` the endpoint-picker protocol wants, from the endpoint a shim announced
/// (`http://10.0.0.5:8100`, maybe with a path). `None` when it announced none. A URL without
/// a port gets its scheme's.
pub fn host_port(endpoint: &str) -> Option<String> {
    let e = endpoint.trim();
    let (rest, default_port) = if let Some(r) = e.strip_prefix("http://") {
        (r, 80)
    } else if let Some(r) = e.strip_prefix("https://") {
        (r, 443)
    } else {
        (e, 80)
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    // userinfo has no place in an endpoint; drop it rather than hand it to Envoy
    let authority = authority.rsplit('@').next().unwrap_or("");
    if authority.is_empty() {
        return None;
    }
    let has_port = match authority.rfind(']') {
        // [v6]:port
        Some(close) => authority[close..].contains(':'),
        None => authority.contains(':'),
    };
    Some(if has_port {
        authority.to_owned()
    } else {
        format!("{authority}:{default_port}")
    })
}

/// What the body gives: the estimated prompt tokens (when `want_estimate`) and `max_tokens`.
fn parse_body(body: &[u8], want_estimate: bool) -> Result<(Option<u32>, Option<u32>), Refusal> {
    let v: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| Refusal::bad(format!("the request body is not JSON: {e}")))?;
    let max_tokens = max_tokens(&v)?;
    let estimated = if want_estimate {
        Some(estimate(&v).ok_or_else(|| {
            Refusal::bad(format!(
                "the body has neither `messages` nor `prompt` to estimate the prompt's tokens \
                 from; set {PROMPT_TOKENS_HEADER}"
            ))
        })?)
    } else {
        None
    };
    Ok((estimated, max_tokens))
}

/// `max_completion_tokens` (the chat API's current name) or `max_tokens`; absent or null:
/// unknown. Anything but a positive integer is bad input (the engine would refuse it too).
fn max_tokens(v: &serde_json::Value) -> Result<Option<u32>, Refusal> {
    for key in ["max_completion_tokens", "max_tokens"] {
        match v.get(key) {
            None | Some(serde_json::Value::Null) => continue,
            Some(n) => {
                return n
                    .as_u64()
                    .filter(|n| *n > 0)
                    .map(|n| Some(u32::try_from(n).unwrap_or(u32::MAX)))
                    .ok_or_else(|| Refusal::bad(format!("{key}: {n} is not a positive integer")));
            }
        }
    }
    Ok(None)
}

/// Tokens added per chat message for its role and the chat template's markers (OpenAI's
/// counting guide uses 3-4).
const TOKENS_PER_MESSAGE: u64 = 4;
/// UTF-8 bytes per token of text: the usual "a token is about 4 characters of English" rule,
/// applied to bytes so that text in scripts of 3-byte characters (CJK, about one token each)
/// is underestimated by less.
const BYTES_PER_TOKEN: u64 = 4;

/// Estimates a request's prompt tokens from an OpenAI-style body, without a tokenizer:
/// text bytes / 4 (rounded up) for `prompt` strings and chat `messages` (`content` strings or
/// `text` parts), plus 4 per message; token-id prompts count exactly. `None` without either
/// field. At least 1, at most u32::MAX (Assign refuses more than its 10,000,000 limit).
///
/// Why an estimate is good enough: it only weighs the reservation until the rank's shim
/// reports the request, with the engine's own prompt count, which then replaces it in σ.
/// Gateways that tokenize (or run prefill first) should send [`PROMPT_TOKENS_HEADER`].
pub fn estimate(v: &serde_json::Value) -> Option<u32> {
    use serde_json::Value as J;
    let text_tokens = |bytes: u64| bytes.div_ceil(BYTES_PER_TOKEN);
    let mut tokens: u64 = 0;
    let mut found = false;
    if let Some(J::Array(messages)) = v.get("messages") {
        found = true;
        for m in messages {
            tokens += TOKENS_PER_MESSAGE;
            match m.get("content") {
                Some(J::String(s)) => tokens += text_tokens(s.len() as u64),
                Some(J::Array(parts)) => {
                    for p in parts {
                        if let Some(J::String(s)) = p.get("text") {
                            tokens += text_tokens(s.len() as u64);
                        }
                    }
                }
                _ => {}
            }
        }
    }
    match v.get("prompt") {
        Some(J::String(s)) => {
            found = true;
            tokens += text_tokens(s.len() as u64);
        }
        Some(J::Array(items)) => {
            found = true;
            for item in items {
                match item {
                    J::String(s) => tokens += text_tokens(s.len() as u64),
                    // a prompt of token ids: exact
                    J::Number(_) => tokens += 1,
                    J::Array(ids) => tokens += ids.len() as u64,
                    _ => {}
                }
            }
        }
        _ => {}
    }
    found.then(|| u32::try_from(tokens.max(1)).unwrap_or(u32::MAX))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests;
