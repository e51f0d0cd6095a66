//! What the picker answers Envoy: refusals as `ImmediateResponse`s, the routing answer's
//! header and metadata, and the protocol's inputs read from Envoy's messages (headers, the
//! subset hint, a shim's endpoint as `host:port`).

use br_runtime::error::{ServiceError as _, code_label};
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, Metadata, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, body_mutation, processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

use super::{
    DESTINATION_ENDPOINT, DESTINATION_NAMESPACE, REQUEST_ID_HEADER, SUBSET_KEY, SUBSET_NAMESPACE,
};
use crate::error::DecisionError;

/// Why a request is refused with an `ImmediateResponse`.
#[derive(Debug)]
pub(super) enum Refusal {
    /// Bad input found here (a header, the body): 400, or 413 for a body over the bound.
    Input { status: u16, message: String },
    /// The Assign failed: the status its gRPC code maps to.
    Assign(DecisionError),
    /// No endpoint the gateway allows could be chosen: 503.
    Unavailable(String),
    /// The process-wide body budget is in use (`--ext-proc-max-buffered-bytes`): 503.
    Busy(String),
    /// Another live stream holds the request's id in its group: 409. Ids are the gateway's
    /// (Envoy keeps a client's `x-request-id`), and Assign and the release of an abandoned
    /// stream's reservation go by id, so two streams sharing one would share a reservation.
    Conflict(String),
    /// The request body did not arrive within `--ext-proc-body-timeout`: 408.
    BodyTimeout(String),
}

impl Refusal {
    pub(super) fn bad(message: impl Into<String>) -> Refusal {
        Refusal::Input {
            status: 400,
            message: message.into(),
        }
    }

    pub(super) fn status(&self) -> u16 {
        match self {
            Refusal::Input { status, .. } => *status,
            Refusal::Assign(e) => http_status(e.grpc_code()),
            Refusal::Unavailable(_) | Refusal::Busy(_) => 503,
            Refusal::Conflict(_) => 409,
            Refusal::BodyTimeout(_) => 408,
        }
    }

    /// The `type` of the JSON error body: the gRPC code's label, or `invalid_request`.
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Refusal::Input { .. } => "invalid_request",
            Refusal::Assign(e) => code_label(e.grpc_code()),
            Refusal::Unavailable(_) => "unavailable",
            Refusal::Busy(_) => "resource_exhausted",
            Refusal::Conflict(_) => "already_exists",
            Refusal::BodyTimeout(_) => "body_timeout",
        }
    }

    pub(super) fn message(&self) -> String {
        match self {
            Refusal::Input { message, .. } => message.clone(),
            Refusal::Assign(e) => e.to_string(),
            Refusal::Unavailable(m)
            | Refusal::Busy(m)
            | Refusal::Conflict(m)
            | Refusal::BodyTimeout(m) => m.clone(),
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

/// A body answer in FULL_DUPLEX_STREAMED mode: the chunk Envoy forwards (unchanged here).
pub(super) fn streamed_body(body: Vec<u8>, end_of_stream: bool) -> BodyResponse {
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
pub(super) fn continue_with<T: Default>(
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
pub(super) fn set_header(key: &str, value: &str) -> HeaderValueOption {
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
pub(super) fn destination_metadata(endpoint: &str) -> Struct {
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
pub(super) fn immediate(refusal: &Refusal) -> ProcessingResponse {
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
pub(super) fn fresh_request_id() -> String {
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

/// Which request phase the routing answer goes to.
#[derive(Debug)]
pub(super) enum Phase {
    Headers,
    Body,
    /// FULL_DUPLEX_STREAMED: the held headers' answer, then this body back to Envoy.
    DuplexBody(Vec<u8>),
}

/// The routing answer, in the order Envoy reads it: the chosen endpoint as the protocol's
/// header (and `x-request-id` when the picker made the id, `set_request_id`) and dynamic
/// metadata, in the answer to `phase`; in full-duplex mode the body follows, unchanged.
pub(super) fn routing_answer(
    endpoint: &str,
    set_request_id: Option<&str>,
    phase: Phase,
) -> Vec<ProcessingResponse> {
    let mut set = vec![set_header(DESTINATION_ENDPOINT, endpoint)];
    if let Some(id) = set_request_id {
        set.push(set_header(REQUEST_ID_HEADER, id));
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
    let mut answers = vec![ProcessingResponse {
        response: Some(response),
        dynamic_metadata: Some(destination_metadata(endpoint)),
        ..Default::default()
    }];
    answers.extend(then.map(|r| ProcessingResponse {
        response: Some(r),
        ..Default::default()
    }));
    answers
}
