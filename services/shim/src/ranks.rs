//! The rank check: before its first Hello, a shim that pins requests to ranks of a shared
//! engine server (`--dp-rank-header`, `--dp-rank-field`) asks the engine whether it has them.
//!
//! A server with fewer DP ranks than the shim was told to serve answers every request pinned to
//! a missing rank with an error (vLLM: 400 "data_parallel_rank 2 is out of range [0, 2)"), and
//! an engine that ignores the pin (a header or field name it does not read) runs the request
//! on whichever rank it picks itself, so the shim would report progress for the wrong worker.
//! Both are configuration errors: σ must never see such a rank, so the shim checks before
//! any rank says Hello, and exits with 2 naming the rank and the engine's answer.
//!
//! The check is one-token completions: one unpinned (the control: the model's name comes from
//! `GET /v1/models`, and a request the engine refuses even unpinned says nothing about ranks),
//! then one pinned to each rank. A pinned request refused (4xx) where the unpinned one passed
//! is a rank the engine does not have. An answer that is neither (no connection, a 5xx, no
//! model listed) leaves the question open: the prober asks again at its next probe, and after
//! [`MAX_OPEN_CHECKS`] such rounds the shim goes on unchecked, with a warning, rather than
//! keeping a working engine out of routing.

use std::time::Duration;

use axum::http::HeaderMap;
use bytes::Bytes;
use serde_json::Value;

use crate::topology::Pin;

/// Rounds that could not tell before the shim goes on unchecked.
pub const MAX_OPEN_CHECKS: u32 = 5;
/// How long one check request may take (a one-token completion on a loaded engine).
const CHECK_TIMEOUT: Duration = Duration::from_secs(30);
/// How much of the engine's refusal the error quotes.
const QUOTE: usize = 300;

/// What the engine said about the ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RankVerdict {
    /// Every rank ran a pinned request.
    Served,
    /// The engine refused a request pinned to `rank` that it accepts unpinned.
    Refused { rank: u32, answer: String },
    /// No answer either way (the engine is not ready, or refuses even the control).
    Open(String),
}

/// The ranks to check and how to pin a request to each.
#[derive(Debug, Clone)]
pub struct RankCheck {
    upstream: String,
    pins: Vec<Pin>,
    client: reqwest::Client,
}

impl RankCheck {
    /// None when nothing is pinned (one server per rank: the upstream is the rank).
    pub fn new(upstream: &str, pins: Vec<Pin>) -> Result<Option<RankCheck>, reqwest::Error> {
        if pins.iter().all(|p| !p.is_some()) {
            return Ok(None);
        }
        let client = reqwest::Client::builder()
            .timeout(CHECK_TIMEOUT)
            .tcp_nodelay(true)
            .build()?;
        Ok(Some(RankCheck {
            upstream: upstream.trim_end_matches('/').to_owned(),
            pins,
            client,
        }))
    }

    /// The ranks checked.
    pub fn ranks(&self) -> Vec<u32> {
        self.pins.iter().map(|p| p.rank).collect()
    }

    /// Asks the engine (see the module docs).
    pub async fn run(&self) -> RankVerdict {
        let model = match self.model().await {
            Ok(m) => m,
            Err(why) => return RankVerdict::Open(why),
        };
        let body = serde_json::json!({"model": model, "prompt": "rank check", "max_tokens": 1});
        let body = Bytes::from(body.to_string());
        match self.complete(HeaderMap::new(), body.clone()).await {
            Ok(()) => {}
            Err(why) => return RankVerdict::Open(format!("the unpinned control request: {why}")),
        }
        for pin in &self.pins {
            let mut headers = HeaderMap::new();
            pin.apply_header(&mut headers);
            match self.complete(headers, pin.apply_field(body.clone())).await {
                Ok(()) => {}
                Err(Answer::Refused(answer)) => {
                    return RankVerdict::Refused {
                        rank: pin.rank,
                        answer,
                    };
                }
                Err(why) => return RankVerdict::Open(format!("rank {}: {why}", pin.rank)),
            }
        }
        RankVerdict::Served
    }

    async fn model(&self) -> Result<String, String> {
        let url = format!("{}/v1/models", self.upstream);
        let resp = self
            .client
            .get(&url)
            .send()
            .await
            .map_err(|e| format!("GET {url}: {}", crate::error_chain(&e)))?;
        if !resp.status().is_success() {
            return Err(format!("GET {url} answered {}", resp.status()));
        }
        let v: Value = resp
            .json()
            .await
            .map_err(|e| format!("GET {url}: {}", crate::error_chain(&e)))?;
        v["data"][0]["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("GET {url} lists no model"))
    }

    async fn complete(&self, headers: HeaderMap, body: Bytes) -> Result<(), Answer> {
        let url = format!("{}/v1/completions", self.upstream);
        let resp = self
            .client
            .post(&url)
            .headers(headers)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| Answer::Failed(crate::error_chain(&e)))?;
        let status = resp.status();
        if status.is_success() {
            return Ok(());
        }
        let text = resp.text().await.unwrap_or_default();
        let quoted: String = text.chars().take(QUOTE).collect();
        let answer = format!("{status}: {quoted}");
        if status.is_client_error() {
            Err(Answer::Refused(answer))
        } else {
            Err(Answer::Failed(answer))
        }
    }
}

enum Answer {
    /// 4xx: the engine read the request and said no.
    Refused(String),
    /// No answer, or a 5xx.
    Failed(String),
}

impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Answer::Refused(a) => write!(f, "refused ({a})"),
            Answer::Failed(a) => write!(f, "{a}"),
        }
    }
}

/// The error a refused rank ends the shim with.
pub fn refused_message(rank: u32, answer: &str, served: &[u32]) -> String {
    let served: Vec<String> = served.iter().map(ToString::to_string).collect();
    format!(
        "the engine refused a request pinned to rank {rank} that it accepts unpinned ({answer}): \
         it does not serve rank {rank}. This shim was told to serve ranks {} \
         (--worker-id/--worker-ids); check them against the engine's data-parallel size and \
         the pin flag (--dp-rank-header/--dp-rank-field), or turn the check off with \
         --verify-ranks false",
        served.join(",")
    )
}
