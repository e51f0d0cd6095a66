//! The request-id rule through a real br-shim: a decode request that reaches the
//! shim without `X-Request-Id` is reported by the engine's response id, which no reservation
//! names. Before the rule σ counted its load twice (the RESERVED reservation and the ACTIVE
//! request) until the reservation TTL; now it takes over the worker's oldest reservation and
//! is counted once, a request with no reservation is new load, and `--require-request-id`
//! refuses it with a 400 JSON error. Each outcome is counted.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use br_e2e::{Service, Split};
use br_proto::v1;
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::snapshot_client::SnapshotClient;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio::sync::watch;

const GROUP: &str = "ids";
const START: Duration = Duration::from_secs(60);
/// The prompt tokens the fake engine reports for every request.
const PROMPT: u32 = 100;

/// An OpenAI-compatible engine that answers every completion with one SSE chunk (id
/// `cmpl-<n>`, usage: PROMPT prompt tokens, 1 generated) and holds the stream open until the
/// test lets it finish: the request is ACTIVE on its worker for as long as the test needs.
struct Engine {
    port: u16,
    finish: watch::Sender<bool>,
    _task: tokio::task::JoinHandle<()>,
}

impl Engine {
    async fn start() -> Engine {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (finish, done) = watch::channel(false);
        let served = Arc::new(AtomicU32::new(0));
        let task = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let mut done = done.clone();
                let n = served.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::spawn(async move {
                    if read_request(&mut conn).await.is_none() {
                        return;
                    }
                    let chunk = format!(
                        "data: {{\"id\":\"cmpl-{n}\",\"object\":\"text_completion\",\"choices\":[{{\"index\":0,\"text\":\"a\"}}],\"usage\":{{\"prompt_tokens\":{PROMPT},\"completion_tokens\":1,\"total_tokens\":{}}}}}\n\n",
                        PROMPT + 1
                    );
                    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";
                    let frame = |s: &str| format!("{:x}\r\n{s}\r\n", s.len());
                    if conn.write_all(head.as_bytes()).await.is_err()
                        || conn.write_all(frame(&chunk).as_bytes()).await.is_err()
                    {
                        return;
                    }
                    let _ = done.wait_for(|d| *d).await;
                    let end = format!("{}0\r\n\r\n", frame("data: [DONE]\n\n"));
                    let _ = conn.write_all(end.as_bytes()).await;
                });
            }
        });
        Engine {
            port,
            finish,
            _task: task,
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Lets every stream (open or to come) finish.
    fn finish_all(&self) {
        self.finish.send_replace(true);
    }
}

/// Reads one request (head and a Content-Length body); None if the client went away.
async fn read_request(conn: &mut tokio::net::TcpStream) -> Option<()> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let head_end = loop {
        let n = conn.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = conn.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    Some(())
}

async fn sigma(snap: &str) -> v1::ClusterSnapshot {
    SnapshotClient::connect(snap.to_owned())
        .await
        .unwrap()
        .get(v1::GetRequest {
            group: GROUP.into(),
        })
        .await
        .unwrap()
        .into_inner()
}

/// σ's load of worker 0 (prompt + generated of every request it holds) and its requests.
fn worker0(s: &v1::ClusterSnapshot) -> (u64, Vec<(String, i32)>) {
    let reqs: Vec<&v1::RequestState> = s.requests.iter().filter(|r| r.worker_id == 0).collect();
    let load = reqs
        .iter()
        .map(|r| u64::from(r.prompt_tokens) + u64::from(r.generated_tokens))
        .sum();
    (
        load,
        reqs.iter()
            .map(|r| (r.request_id.clone(), r.state))
            .collect(),
    )
}

/// Starts a streamed completion through the shim (with `X-Request-Id: id` if given) and reads
/// its first chunk; the response is returned still open.
async fn stream_through(shim: u16, id: Option<&str>) -> reqwest::Response {
    let mut req = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{shim}/v1/completions"))
        .header("content-type", "application/json")
        .body(r#"{"model":"m","prompt":"hello","max_tokens":8,"stream":true}"#);
    if let Some(id) = id {
        req = req.header("x-request-id", id);
    }
    let mut resp = tokio::time::timeout(START, req.send())
        .await
        .expect("the shim answers")
        .unwrap();
    assert_eq!(resp.status(), 200);
    let first = tokio::time::timeout(START, resp.chunk())
        .await
        .expect("the first chunk arrives")
        .unwrap()
        .expect("a chunk");
    assert!(String::from_utf8_lossy(&first).contains("cmpl-"));
    resp
}

fn counter(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_x_request_id_is_counted_once() {
    let engine = Engine::start().await;
    let Split {
        snapshot,
        ingest,
        decision,
    } = Split::start(&["--reservation-ttl", "10m"], &["--groups", GROUP]).await;
    let snap = snapshot.grpc_url();
    let shim = Service::start(
        "br-shim",
        &[
            "--upstream",
            &engine.url(),
            // this engine answers any request with a stream and numbers the ids it gives by
            // connection: probes would take ids (and never end); health is not tested here
            "--engine-probe-interval",
            "0s",
            "--ingest-addr",
            &ingest.grpc_url(),
            "--group",
            GROUP,
            "--worker-id",
            "0",
            "--capacity",
            "8",
        ],
    );
    decision.wait_for("/readyz", START).await;

    // The gateway reserves r1 on worker 0 ...
    let answer = DecisionClient::connect(decision.grpc_url())
        .await
        .unwrap()
        .assign(v1::AssignRequest {
            group: GROUP.into(),
            request_id: "r1".into(),
            prompt_tokens: PROMPT,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.worker_id, 0);
    assert_eq!(worker0(&sigma(&snap).await).0, u64::from(PROMPT));

    // ... and sends it without X-Request-Id: the shim knows it only as cmpl-1.
    let open = stream_through(shim.grpc_port, None).await;
    let s = br_testkit::eventually_some(START, "σ shows cmpl-1", || {
        let snap = snap.clone();
        async move {
            let s = sigma(&snap).await;
            s.requests
                .iter()
                .any(|r| r.request_id == "cmpl-1")
                .then_some(s)
        }
    })
    .await;
    let (load, reqs) = worker0(&s);
    assert_eq!(
        load,
        u64::from(PROMPT) + 1,
        "its load is counted once (the reservation and the request were both counted: {reqs:?})"
    );
    assert_eq!(
        reqs,
        vec![("cmpl-1".into(), v1::RequestPhase::Active as i32)]
    );

    // A request that was never reserved is new load, counted once too.
    let open2 = stream_through(shim.grpc_port, None).await;
    br_testkit::eventually(START, "σ shows cmpl-2 as new load", || {
        let snap = snap.clone();
        async move { worker0(&sigma(&snap).await).0 == 2 * (u64::from(PROMPT) + 1) }
    })
    .await;

    // When they finish, nothing is left (no reservation comes back).
    engine.finish_all();
    for resp in [open, open2] {
        let body = tokio::time::timeout(START, resp.text())
            .await
            .unwrap()
            .unwrap();
        assert!(body.contains("[DONE]"), "{body}");
    }
    br_testkit::eventually(START, "worker 0 holds nothing", || {
        let snap = snap.clone();
        async move { sigma(&snap).await.requests.is_empty() }
    })
    .await;

    let text = snapshot.metrics().await;
    let name = "balanceroute_snapshot_unkeyed_requests_total";
    assert_eq!(counter(&text, name, r#"outcome="matched""#), 1.0, "{text}");
    assert_eq!(
        counter(&text, name, r#"outcome="unmatched""#),
        1.0,
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strict_shim_refuses_a_request_without_x_request_id() {
    let engine = Engine::start().await;
    let shim = Service::start(
        "br-shim",
        &[
            "--upstream",
            &engine.url(),
            // this engine answers any request with a stream and numbers the ids it gives by
            // connection: probes would take ids (and never end); health is not tested here
            "--engine-probe-interval",
            "0s",
            "--ingest-addr",
            "",
            "--require-request-id",
        ],
    );
    let client = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{}/v1/chat/completions", shim.grpc_port);
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
    let refused = client
        .post(&url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);
    let v: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(v["error"]["type"], "no_request_id", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("X-Request-Id"),
        "{v}"
    );
    // With the header it goes through.
    engine.finish_all();
    let ok = client
        .post(&url)
        .header("content-type", "application/json")
        .header("x-request-id", "r9")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    assert!(ok.text().await.unwrap().contains("[DONE]"));
    let text = shim.metrics().await;
    assert_eq!(
        counter(
            &text,
            "balanceroute_shim_refused_total",
            r#"reason="no_request_id""#
        ),
        1.0,
        "{text}"
    );
}
