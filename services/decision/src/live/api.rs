//! The live page's routes on the admin server: the page and its assets (compiled into the
//! binary: no CDN, no build step), and the JSON it polls.
//!
//! - `GET /live`: the page (HTML; its script and style at `/live/live.js`, `/live/live.css`).
//! - `GET /live/api/groups`: the served groups, each with its state now.
//! - `GET /live/api/group/{name}?since=SEQ`: that group's samples after `SEQ` (all kept
//!   without it), the state now (σ's worker table) and `last_seq` for the next poll; 404 for
//!   a group this service does not serve, 400 for a `since` that is not a number.

use axum::Json;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use br_sigma::GroupSummary;
use serde::{Deserialize, Serialize};

use super::{Live, Sample};
use crate::group::{LiveNow, Placing};

const INDEX_HTML: &str = include_str!("assets/index.html");
const LIVE_JS: &str = include_str!("assets/live.js");
const LIVE_CSS: &str = include_str!("assets/live.css");

/// Everything the page loads comes from this port: nothing inline, nothing from elsewhere
/// (σ's strings, such as endpoints, reach the page as JSON and are set as text, never markup).
const CSP: &str = "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'";

/// The routes, to merge into the admin server's.
pub fn router(live: Live) -> Router {
    Router::new()
        .route("/live", get(index))
        .route("/live/", get(index))
        .route("/live/live.js", get(script))
        .route("/live/live.css", get(style))
        .route("/live/api/groups", get(groups))
        .route("/live/api/group/{name}", get(group))
        .with_state(live)
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut r = (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        body,
    )
        .into_response();
    r.headers_mut().insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    r.headers_mut().insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}

async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", LIVE_JS)
}

async fn style() -> Response {
    asset("text/css; charset=utf-8", LIVE_CSS)
}

/// A JSON answer nobody should cache (it changes every sample).
fn fresh<T: Serialize>(status: StatusCode, body: T) -> Response {
    let mut r = (status, Json(body)).into_response();
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn placing_name(p: Placing) -> &'static str {
    match p {
        Placing::Ready => "ready",
        Placing::NoSigma => "no_sigma",
        Placing::NoLiveWorker => "no_live_worker",
    }
}

/// A group's state at its last sample.
#[derive(Debug, Serialize)]
pub struct NowJson {
    /// `ready`, `no_sigma` (no complete σ yet) or `no_live_worker`.
    pub placing: &'static str,
    pub stale: bool,
    pub pool: usize,
    /// σ's summary (worker table, barrier numbers); `null` before the first complete σ.
    pub sigma: Option<GroupSummary>,
}

impl From<&LiveNow> for NowJson {
    fn from(n: &LiveNow) -> NowJson {
        NowJson {
            placing: placing_name(n.placing),
            stale: n.stale,
            pool: n.pool,
            sigma: n.summary.clone(),
        }
    }
}

/// One entry of `GET /live/api/groups`.
#[derive(Debug, Serialize)]
pub struct GroupEntry {
    pub group: String,
    /// `null` until the first sample.
    pub now: Option<GroupBrief>,
}

/// The numbers the picker shows beside a group's name.
#[derive(Debug, Serialize)]
pub struct GroupBrief {
    pub placing: &'static str,
    pub stale: bool,
    pub pool: usize,
    pub ranks: usize,
    pub live_ranks: usize,
}

/// `GET /live/api/groups`.
#[derive(Debug, Serialize)]
pub struct GroupsJson {
    pub policy: String,
    pub sample_interval_ms: u64,
    /// Samples kept per group (× the interval: the history's span).
    pub history_samples: usize,
    pub groups: Vec<GroupEntry>,
}

async fn groups(State(live): State<Live>) -> Response {
    let groups = live
        .group_names()
        .map(|name| {
            let now = live.group(name).and_then(|h| {
                h.latest().map(|n| GroupBrief {
                    placing: placing_name(n.placing),
                    stale: n.stale,
                    pool: n.pool,
                    ranks: n.summary.as_ref().map_or(0, |s| s.workers.len()),
                    live_ranks: n.summary.as_ref().map_or(0, |s| {
                        s.workers.iter().filter(|w| w.liveness == "live").count()
                    }),
                })
            });
            GroupEntry {
                group: name.to_owned(),
                now,
            }
        })
        .collect();
    let cfg = live.config();
    fresh(
        StatusCode::OK,
        GroupsJson {
            policy: live.policy().to_owned(),
            sample_interval_ms: cfg.interval.as_millis() as u64,
            history_samples: cfg.samples,
            groups,
        },
    )
}

#[derive(Debug, Deserialize)]
pub struct SinceQuery {
    /// Only samples with a larger seq.
    pub since: Option<u64>,
}

/// `GET /live/api/group/{name}`.
#[derive(Debug, Serialize)]
pub struct GroupJson {
    pub group: String,
    pub policy: String,
    pub sample_interval_ms: u64,
    pub history_samples: usize,
    /// The newest sample's seq (0 before the first): the next poll's `since`. Lower than the
    /// `since` asked for when the service restarted (seqs start again at 1).
    pub last_seq: u64,
    /// The oldest sample kept; samples between `since` and it were dropped from the ring.
    pub oldest_seq: Option<u64>,
    /// The state at the last sample; `null` before the first.
    pub now: Option<NowJson>,
    pub samples: Vec<Sample>,
}

#[derive(Debug, Serialize)]
struct ErrorJson {
    error: String,
}

async fn group(
    State(live): State<Live>,
    Path(name): Path<String>,
    Query(q): Query<SinceQuery>,
) -> Response {
    let cfg = live.config();
    let Some(h) = live.group(&name) else {
        let served: Vec<&str> = live.group_names().collect();
        return fresh(
            StatusCode::NOT_FOUND,
            ErrorJson {
                error: format!(
                    "this decision service does not serve group {name:?} (it serves {})",
                    served.join(", ")
                ),
            },
        );
    };
    let body = GroupJson {
        group: name.clone(),
        policy: live.policy().to_owned(),
        sample_interval_ms: cfg.interval.as_millis() as u64,
        history_samples: cfg.samples,
        last_seq: h.last_seq(),
        oldest_seq: h.oldest_seq(),
        now: h.latest().map(NowJson::from),
        samples: h.since(q.since),
    };
    drop(h);
    fresh(StatusCode::OK, body)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use br_proto::v1;
    use br_sigma::GroupSummary;

    use super::*;

    /// σ's epoch is a random 64-bit number: as a JSON number a browser keeps its top 53 bits
    /// only (this one showed as 3527672881757361664). The page reads it as a string, in the
    /// decimal brctl prints.
    #[test]
    fn sixty_four_bit_numbers_reach_the_page_as_decimal_strings() {
        let epoch = 3_527_672_881_757_361_811_u64;
        let snap = v1::ClusterSnapshot {
            group: "g".into(),
            epoch,
            version: u64::MAX,
            ..Default::default()
        };
        let now = LiveNow {
            summary: Some(GroupSummary::of_snapshot(&snap)),
            pool: 0,
            stale: false,
            placing: Placing::Ready,
        };
        let json = serde_json::to_value(NowJson::from(&now)).unwrap();
        assert_eq!(json["sigma"]["epoch"], "3527672881757361811", "{json}");
        assert_eq!(json["sigma"]["version"], u64::MAX.to_string(), "{json}");
    }
}
