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
            generated_tokens: Vec::new(),
            pool: 0,
            stale: false,
            placing: Placing::Ready,
        };
        let json = serde_json::to_value(NowJson::from(&now)).unwrap();
        assert_eq!(json["sigma"]["epoch"], "3527672881757361811", "{json}");
        assert_eq!(json["sigma"]["version"], u64::MAX.to_string(), "{json}");
    }

    /// `GET /live/api/group/{name}` as the page reads it: every field it read before keeps its
    /// name, and each sample adds the decode rates, the TPOT estimate and the rank state
    /// changes.
    #[tokio::test]
    async fn the_group_api_adds_decode_rates_and_state_changes_to_each_sample() {
        use std::time::{Duration, Instant};

        use http_body_util::BodyExt as _;

        use crate::live::{Counters, LiveConfig};

        let snap = v1::ClusterSnapshot {
            group: "g".into(),
            epoch: 1,
            version: 3,
            workers: (0..2)
                .map(|id| v1::WorkerState {
                    worker_id: id,
                    incarnation: 1,
                    capacity: 4,
                    liveness: v1::Liveness::Live as i32,
                    ..Default::default()
                })
                .collect(),
            requests: vec![v1::RequestState {
                request_id: "a".into(),
                worker_id: 1,
                incarnation: 1,
                prompt_tokens: 30,
                generated_tokens: 20,
                state: v1::RequestPhase::Active as i32,
                ..Default::default()
            }],
        };
        let now = |generated: Vec<u64>, cordon: bool| {
            let mut summary = GroupSummary::of_snapshot(&snap);
            summary.workers[0].cordoned = cordon;
            LiveNow {
                summary: Some(summary),
                generated_tokens: generated,
                pool: 0,
                stale: false,
                placing: Placing::Ready,
            }
        };
        let cfg = LiveConfig {
            interval: Duration::from_millis(500),
            samples: 10,
        };
        let live = Live::new(cfg, "jsq", ["g"]);
        let t0 = Instant::now();
        for (i, n) in [now(vec![0, 100], false), now(vec![0, 150], true)]
            .into_iter()
            .enumerate()
        {
            let at = t0 + Duration::from_millis(500 * i as u64);
            live.group("g")
                .unwrap()
                .record(at, 0, n, Counters::default(), &[]);
        }
        let r = group(
            State(live),
            Path("g".into()),
            Query(SinceQuery { since: Some(1) }),
        )
        .await;
        assert_eq!(r.status(), StatusCode::OK);
        let body = r.into_body().collect().await.unwrap().to_bytes();
        let j: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let s = &j["samples"][0];
        assert_eq!(s["seq"], 2, "{j}");
        // the fields the page read before, by their names
        for key in [
            "unix_ms",
            "sigma_version",
            "loads",
            "imbalance_tokens",
            "pool",
        ] {
            assert!(!s[key].is_null(), "{key}: {s}");
        }
        // rank 1: 50 tokens in 0.5 s with one request running
        let rank1 = &s["loads"][1];
        assert_eq!(
            (rank1["worker_id"].as_u64(), rank1["load_tokens"].as_u64()),
            (Some(1), Some(50))
        );
        assert_eq!(rank1["running"], 1);
        assert_eq!(rank1["decode_tokens_per_s"], 100.0);
        assert_eq!(rank1["tpot_ms"], 10.0);
        let rank0 = &s["loads"][0];
        assert_eq!(rank0["decode_tokens_per_s"], 0.0);
        assert!(rank0["tpot_ms"].is_null(), "{rank0}");
        assert_eq!(s["decode_tokens_per_s"], 100.0);
        assert_eq!(
            s["events"],
            serde_json::json!([{ "worker_id": 0, "kind": "cordoned" }])
        );
        assert_eq!(s["events_omitted"], 0);
        assert_eq!(j["now"]["sigma"]["workers"][0]["cordoned"], true);
    }
}
