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
//! * the output-length hints, when the request gives them: the expected output tokens from
//!   the `x-balanceroute-expected-output-tokens` header, else from the body's
//!   `nvext.agent_hints.osl` (NVIDIA Dynamo's name for it); the class key from the
//!   `x-gateway-inference-objective` header (see [`EXPECTED_OUTPUT_HEADER`] and
//!   [`REQUEST_CLASS_HEADER`]);
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
//!   while its Assign waits withdraws it (the same drop guard as a gRPC caller that leaves);
//! * a request id is one live stream's: a stream claims its (group, id) with its headers and
//!   gives it back when it ends, and another stream with a held id is answered 409, so no
//!   stream can take over, or release, another's reservation ([`claims`]);
//! * a stream whose request body has not arrived `--ext-proc-body-timeout` after its headers
//!   is answered 408 and ended, giving back its buffered bytes and its id.
//!
//! Beside this file: request bodies and their budget (`body`), what the headers say
//! (`head`), the answers to Envoy (`wire`), the id claims (`claims`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use br_proto::v1;
use br_proto::valid::GroupId;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpHeaders, ProcessingRequest, ProcessingResponse, TrailersResponse, processing_request,
    processing_response,
};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::edge::grpc::{Caller, DecisionService};
use crate::error::DecisionError;
use crate::metrics::Metrics;

mod body;
mod claims;
mod head;
mod wire;

use body::{BodyBudget, BodyHold};
use claims::{Claim, Claims};
use head::Head;
use wire::{
    Phase, Refusal, continue_with, host_port, immediate, routing_answer, streamed_body, subset_hint,
};

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
/// The client's expected output tokens (Assign's `expected_output_tokens`). No gateway or
/// engine names a header for it: NVIDIA Dynamo takes the hint only in the request body, as
/// `nvext.agent_hints.osl` ("expected output sequence length"), which is read when this
/// header is absent; so the header has this service's own prefix.
pub const EXPECTED_OUTPUT_HEADER: &str = "x-balanceroute-expected-output-tokens";
/// The request's class key (Assign's `request_class`): the Gateway API Inference Extension's
/// header naming the request's InferenceObjective, the use case its gateway classified it as
/// (llm-d's "EPP HTTP Headers Reference"; the objective names the class of requests whose
/// priority and goals it sets). A name longer than 64 bytes is refused like any bad class.
pub const REQUEST_CLASS_HEADER: &str = "x-gateway-inference-objective";
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
    /// How long a stream waits for its request body once its headers arrived
    /// (`--ext-proc-body-timeout`).
    pub body_timeout: Duration,
}

/// `envoy.service.ext_proc.v3.ExternalProcessor` over a [`DecisionService`].
#[derive(Clone, Debug)]
pub struct ExtProcService {
    svc: DecisionService,
    settings: Arc<ExtProcSettings>,
    metrics: Metrics,
    budget: BodyBudget,
    /// The request ids live streams hold.
    claims: Claims,
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
            claims: Claims::default(),
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
            claim: None,
            body_deadline: None,
        };
        tokio::spawn(stream.run());
        Ok(Response::new(ReceiverStream::new(rx)))
    }
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
    /// Its request body did not arrive within `--ext-proc-body-timeout` (answered 408).
    BodyTimeout,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Answered => "answered",
            Outcome::Released => "released",
            Outcome::Refused => "refused",
            Outcome::Abandoned => "abandoned",
            Outcome::BodyTimeout => "body_timeout",
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
    /// The stream's hold on its request id, from its headers to its end (after its release).
    claim: Option<Claim>,
    /// When a stream waiting for its request body is answered 408 and ended.
    body_deadline: Option<Instant>,
}

/// What a stream waits for next.
enum Next {
    /// (boxed: a message is large, and the other outcomes are nothing)
    Message(Box<ProcessingRequest>),
    /// The stream ended (Envoy closed or reset it, or stopped reading our answers).
    Ended,
    /// The request body did not arrive in time.
    BodyTimeout,
}

/// The stream has ended (Envoy closed or reset it, or stopped reading).
struct Gone;

impl Stream {
    async fn run(mut self) {
        loop {
            let msg = match self.pending.pop_front() {
                Some(m) => m,
                None => match self.next().await {
                    Next::Message(m) => *m,
                    Next::Ended => break,
                    Next::BodyTimeout => {
                        self.body_timed_out().await;
                        break;
                    }
                },
            };
            if self.handle(msg).await.is_err() {
                break;
            }
        }
        self.finish().await;
    }

    /// The next message from Envoy, the stream's end (closed, reset, or our answers are no
    /// longer read), or, while the stream waits for its request body, the body's deadline.
    async fn next(&mut self) -> Next {
        // (no deadline but while waiting for the body: the branch is then never polled)
        let deadline = self
            .body_deadline
            .filter(|_| matches!(self.state, State::AwaitBody(_)));
        tokio::select! {
            m = self.inbound.message() => match m {
                Ok(Some(m)) => Next::Message(Box::new(m)),
                Ok(None) => Next::Ended,
                Err(status) => {
                    tracing::debug!(%status, "ext_proc stream ended by an error");
                    Next::Ended
                }
            },
            () = self.tx.closed() => Next::Ended,
            () = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                Next::BodyTimeout
            }
        }
    }

    /// The request body did not arrive within `--ext-proc-body-timeout`: Envoy keeps a stream
    /// open for as long as its client trickles (or stalls) the body, and the stream holds its
    /// buffered bytes and its request id meanwhile. Both go back now; the request is answered
    /// 408 and the stream ends (nothing was assigned yet: the Assign waits for the body).
    async fn body_timed_out(&mut self) {
        let waited = self.ext.settings.body_timeout;
        self.ext.metrics.ext_proc_body_timeouts_total.inc();
        self.body = Vec::new();
        self.body_hold = None;
        self.claim = None;
        let message = format!(
            "the request body did not arrive within --ext-proc-body-timeout ({})",
            humantime::format_duration(waited)
        );
        tracing::debug!(%message, "ext_proc stream ended");
        let _ = self.refuse(Refusal::BodyTimeout(message)).await;
        self.state = State::Done(Outcome::BodyTimeout);
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
            Some(In::RequestBody(b)) => self.on_request_body(b).await,
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
        match self.ext.claims.claim(&head.group, &head.request_id) {
            Some(claim) => self.claim = Some(claim),
            None => {
                self.ext.metrics.ext_proc_request_id_conflicts_total.inc();
                let message = format!(
                    "another request with {REQUEST_ID_HEADER} {:?} is in flight in group {:?}; \
                     request ids must be unique while their requests run",
                    head.request_id, head.group
                );
                tracing::warn!(group = %head.group, request_id = %head.request_id,
                    "ext_proc request refused: its request id is held by another stream");
                return self.refuse(Refusal::Conflict(message)).await;
            }
        }
        // Envoy sends no body when the request has none, or when its body mode is NONE (it
        // says so in the first message's protocol_config, from Envoy 1.33).
        let no_body = h.end_of_stream || body_mode == Some(BodySendMode::None as i32);
        if !no_body {
            self.state = State::AwaitBody(head);
            self.body_deadline = Some(Instant::now() + self.ext.settings.body_timeout);
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
        self.route(head, tokens, None, None, Phase::Headers).await
    }

    /// Assigns the request (the gRPC method's path) and answers with its endpoint. While the
    /// Assign waits, the stream is watched: if it ends, the Assign is dropped, which withdraws
    /// it (and releases an answer that arrived unread).
    async fn route(
        &mut self,
        head: Head,
        prompt_tokens: u32,
        max_tokens: Option<u32>,
        body_expected_output: Option<u32>,
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
            // the header wins over the body, as for the prompt tokens
            expected_output_tokens: head.expected_output.or(body_expected_output),
            request_class: head.class.clone(),
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
        tracing::debug!(group = %head.group, request_id = %head.request_id, %endpoint,
            worker = resp.worker_id, "ext_proc routed");
        let set_id = head.generated_id.then_some(head.request_id.as_str());
        for answer in routing_answer(&endpoint, set_id, phase) {
            self.send(answer).await?;
        }
        Ok(())
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
        // The id goes back after the release above and before Envoy sees the stream end
        // (the answers' channel closes when `self` drops), so a client's retry after the
        // end finds it free.
        self.claim = None;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests;
