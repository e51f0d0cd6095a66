//! The JSON shapes (proto3's JSON mapping of `AssignRequest`, `CancelRequest` and their
//! responses, with its lenient integers) and reading a JSON body within the size and
//! deadline bounds.
//!
//! Separate from the handler: the wire format and its edge cases read on their own.

use super::*;

/// Reads a JSON body: `Content-Type: application/json` (415 otherwise), at most
/// [`MAX_BODY_BYTES`] (413, before a byte is read when `Content-Length` says so), arriving
/// before the call's deadline (408), and, while it is unfinished, within the process's budget
/// of bytes still arriving (429 RESOURCE_EXHAUSTED, as on the gRPC ports; see
/// [`budget::charged`]).
pub(super) async fn json_body<T: serde::de::DeserializeOwned>(
    req: Request,
    timeout: Duration,
    charged_to: BodyBudget,
) -> Result<T, JsonError> {
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if essence != "application/json" {
        return Err(JsonError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            tonic::Code::InvalidArgument,
            format!("Content-Type must be application/json, not {content_type:?}"),
        ));
    }
    let too_large = || {
        JsonError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            tonic::Code::ResourceExhausted,
            format!("the request body is larger than {MAX_BODY_BYTES} bytes"),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return Err(too_large());
    }
    let declared = declared.and_then(|n| usize::try_from(n).ok());
    let body = budget::charged(req.into_body(), declared, charged_to);
    let read = axum::body::to_bytes(body, MAX_BODY_BYTES);
    let bytes = match tokio::time::timeout(timeout, read).await {
        Err(_) => {
            return Err(JsonError::new(
                StatusCode::REQUEST_TIMEOUT,
                tonic::Code::DeadlineExceeded,
                "the request body did not arrive before the call's deadline",
            ));
        }
        Ok(Err(e)) => {
            if let Some(over) = budget::OverBudget::in_chain(&e) {
                return Err(tonic::Status::resource_exhausted(over.to_string()).into());
            }
            // axum reports the limit as an error whose source is http-body-util's
            // LengthLimitError; anything else is a broken body (the client went away).
            if std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
            {
                return Err(too_large());
            }
            return Err(JsonError::invalid(format!("reading the request body: {e}")));
        }
        Ok(Ok(b)) => b,
    };
    serde_json::from_slice(&bytes).map_err(|e| JsonError::invalid(format!("malformed JSON: {e}")))
}

/// `AssignRequest` as JSON.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AssignJson {
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default, alias = "requestId")]
    pub request_id: Option<String>,
    #[serde(default, alias = "promptTokens", deserialize_with = "lenient::u32")]
    pub prompt_tokens: Option<u32>,
    #[serde(default, alias = "promptHash", deserialize_with = "lenient::u64")]
    pub prompt_hash: Option<u64>,
    #[serde(default, alias = "maxTokens", deserialize_with = "lenient::u32")]
    pub max_tokens: Option<u32>,
    #[serde(
        default,
        alias = "expectedOutputTokens",
        deserialize_with = "lenient::u32"
    )]
    pub expected_output_tokens: Option<u32>,
    #[serde(default, alias = "requestClass")]
    pub request_class: Option<String>,
}

impl AssignJson {
    /// The proto message; absent fields (and `null`) are proto3's defaults, so the gRPC
    /// validation refuses them exactly as it refuses an unset field.
    pub fn into_proto(self) -> v1::AssignRequest {
        v1::AssignRequest {
            group: self.group.unwrap_or_default(),
            request_id: self.request_id.unwrap_or_default(),
            prompt_tokens: self.prompt_tokens.unwrap_or(0),
            prompt_hash: self.prompt_hash,
            max_tokens: self.max_tokens,
            expected_output_tokens: self.expected_output_tokens,
            request_class: self.request_class,
        }
    }
}

/// `CancelRequest` as JSON.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelJson {
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default, alias = "requestId")]
    pub request_id: Option<String>,
}

impl CancelJson {
    pub fn into_proto(self) -> v1::CancelRequest {
        v1::CancelRequest {
            group: self.group.unwrap_or_default(),
            request_id: self.request_id.unwrap_or_default(),
        }
    }
}

/// `AssignResponse` as JSON: every field, 64-bit integers as decimal strings (proto3's JSON
/// mapping: a JavaScript or Lua number would round an incarnation).
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct AssignJsonResponse {
    pub worker_id: u32,
    pub endpoint: String,
    pub policy: String,
    pub pool_wait_us: String,
    pub incarnation: String,
    pub sigma_version: String,
    pub stale: bool,
}

impl From<v1::AssignResponse> for AssignJsonResponse {
    fn from(r: v1::AssignResponse) -> Self {
        AssignJsonResponse {
            worker_id: r.worker_id,
            endpoint: r.endpoint,
            policy: r.policy,
            pool_wait_us: r.pool_wait_us.to_string(),
            incarnation: r.incarnation.to_string(),
            sigma_version: r.sigma_version.to_string(),
            stale: r.stale,
        }
    }
}

/// `CancelResponse` as JSON: the outcome by its enum value's name.
#[derive(Debug, Serialize)]
pub(super) struct CancelJsonResponse {
    pub(super) outcome: &'static str,
}

/// Integers as proto3's JSON mapping accepts them: a JSON number (an integral one, also in
/// exponent form) or a decimal string; `null` is unset.
mod lenient {
    use serde::de::{self, Deserializer, Unexpected, Visitor};

    struct U64;

    /// Integral values a JSON number written with a fraction or exponent can hold exactly.
    const EXACT_F64: f64 = 9_007_199_254_740_992.0; // 2^53

    impl Visitor<'_> for U64 {
        type Value = Option<u64>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an unsigned integer (a JSON number or a decimal string)")
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v))
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            u64::try_from(v)
                .map(Some)
                .map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
        }

        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
            if v.fract() == 0.0 && (0.0..=EXACT_F64).contains(&v) {
                // exact: integral and within f64's integer range
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                return Ok(Some(v as u64));
            }
            Err(E::invalid_value(Unexpected::Float(v), &self))
        }

        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            if !v.is_empty()
                && v.bytes().all(|b| b.is_ascii_digit())
                && let Ok(n) = v.parse::<u64>()
            {
                return Ok(Some(n));
            }
            Err(E::invalid_value(Unexpected::Str(v), &self))
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }

    pub fn u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        d.deserialize_any(U64)
    }

    pub fn u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        match u64(d)? {
            None => Ok(None),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| de::Error::custom(format!("{n} is out of range for a uint32 field"))),
        }
    }
}
