//! br-decision's HTTP/JSON port (`--http-listen`) as a gateway without gRPC uses it:
//! the real binaries, called with curl (a process, as nginx or a shell script would). The
//! same answers as the gRPC methods (idempotent retries, cancel, every error class as its
//! grpc-gateway HTTP status with a `{"code", "message"}` body), and with mutual TLS the same
//! certificates and roles as the gRPC port.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use br_e2e::pki::{self, Pki};
use br_e2e::{FakeWorker, Service, Split};
use br_proto::v1;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_trust::{Role, TlsFiles};
use serde_json::{Value, json};

const GROUP: &str = "e2e";
/// A group whose one worker takes one request at a time: the second waits in the pool.
const TINY: &str = "tiny";
/// A served group with no worker: every Assign is UNAVAILABLE.
const EMPTY: &str = "empty";
const START: Duration = Duration::from_secs(60);

/// What curl got: the HTTP status (0 when there was no HTTP answer) and the body, or curl's
/// own exit code.
#[derive(Debug)]
struct Answer {
    status: u16,
    body: String,
    curl_exit: i32,
    /// curl's own complaint; read only through `Debug`, in failure messages.
    #[allow(dead_code)]
    stderr: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?} from {self:?}", self.body))
    }

    /// Asserts an error answer: the status and the body naming the gRPC code.
    fn error(&self, status: u16, code: &str) -> String {
        assert_eq!(self.status, status, "{self:?}");
        let v = self.json();
        assert_eq!(v["code"], code, "{self:?}");
        let message = v["message"].as_str().expect("a message").to_owned();
        assert!(!message.is_empty(), "{self:?}");
        assert_eq!(
            v.as_object().unwrap().len(),
            2,
            "only code and message: {v}"
        );
        message
    }
}

/// Runs curl with `args` (plus `-sS`, a bound on its own run time, and the status on the last
/// line of stdout), in a blocking thread.
async fn curl(args: Vec<String>) -> Answer {
    tokio::task::spawn_blocking(move || {
        let out = Command::new("curl")
            .args(["-sS", "--max-time", "30", "-w", "\n%{http_code}"])
            .args(&args)
            .output()
            .expect("curl runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, status) = stdout.rsplit_once('\n').unwrap_or(("", &stdout));
        Answer {
            status: status.trim().parse().unwrap_or(0),
            body: body.to_owned(),
            curl_exit: out.status.code().unwrap_or(-1),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    })
    .await
    .unwrap()
}

/// `curl -X POST <url>` with a JSON body and `extra` flags (headers, certificates).
async fn post(url: &str, body: &str, extra: &[&str]) -> Answer {
    let mut args: Vec<String> = vec![
        "-X".into(),
        "POST".into(),
        "-H".into(),
        "Content-Type: application/json".into(),
        "--data-binary".into(),
        body.into(),
    ];
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    args.push(url.into());
    curl(args).await
}

fn assign_body(group: &str, id: &str, prompt_tokens: u32) -> String {
    json!({"group": group, "request_id": id, "prompt_tokens": prompt_tokens}).to_string()
}

async fn sigma(snapshot: &str, group: &str) -> v1::ClusterSnapshot {
    SnapshotClient::connect(snapshot.to_owned())
        .await
        .unwrap()
        .get(v1::GetRequest {
            group: group.into(),
        })
        .await
        .unwrap()
        .into_inner()
}

/// The value of the series of `name` whose labels include every `label="value"` in `want`.
fn metric(text: &str, name: &str, want: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .filter(|l| want.iter().all(|w| l.contains(w)))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

/// Sends the Assign of `id` (with `X-Request-Timeout: timeout`) into TINY's one-place pool and
/// returns once it waits there; the task ends with its answer.
async fn wait_in_tiny_pool(
    decision: &Service,
    assign_url: &str,
    id: &str,
    timeout: &str,
) -> tokio::task::JoinHandle<Answer> {
    let (url, body) = (assign_url.to_owned(), assign_body(TINY, id, 10));
    let header = format!("X-Request-Timeout: {timeout}");
    let waiting = tokio::spawn(async move { post(&url, &body, &["-H", &header]).await });
    tiny_pool_holds_one(decision, id).await;
    waiting
}

/// Waits until tiny's pool holds one call: `id`'s, which waits for tiny's one slot.
async fn tiny_pool_holds_one(decision: &Service, id: &str) {
    br_testkit::eventually(START, &format!("{id} waits in tiny's pool"), || async {
        metric(
            &decision.metrics().await,
            "balanceroute_decision_pool_size",
            &[r#"group="tiny""#],
        ) == 1.0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assign_and_cancel_over_http_json_answer_as_grpc_does() {
    let groups = format!("{GROUP},{TINY},{EMPTY}");
    let Split {
        snapshot,
        ingest,
        decision,
    } = Split::start(
        &["--reservation-ttl", "10m"],
        &[
            "--groups",
            &groups,
            "--max-pool",
            "1",
            "--http-listen",
            "127.0.0.1:0",
            "--first-byte-timeout",
            "2s",
        ],
    )
    .await;
    let snap = snapshot.grpc_url();
    let port = decision
        .http_port
        .expect("the ready file names the HTTP port");
    assert_ne!(port, decision.grpc_port);
    let assign_url = format!("http://127.0.0.1:{port}/v1/assign");
    let cancel_url = format!("http://127.0.0.1:{port}/v1/cancel");
    let worker = FakeWorker::connect(&ingest.grpc_url(), GROUP, 0, 8).await;
    let _tiny = FakeWorker::connect(&ingest.grpc_url(), TINY, 0, 1).await;
    decision.wait_for("/readyz", START).await;

    // The happy path: the answer names the worker, 64-bit integers as strings.
    let first = post(&assign_url, &assign_body(GROUP, "r1", 100), &[]).await;
    assert_eq!(first.status, 200, "{first:?}");
    let a = first.json();
    assert_eq!(a["worker_id"], 0, "{a}");
    assert_eq!(a["endpoint"], "http://127.0.0.1:18000", "{a}");
    assert_eq!(a["incarnation"], worker.incarnation.to_string(), "{a}");
    assert_eq!(a["stale"], false, "{a}");
    assert_eq!(a["policy"], "br0", "{a}");
    for key in ["pool_wait_us", "sigma_version"] {
        let s = a[key]
            .as_str()
            .unwrap_or_else(|| panic!("{key} is a string: {a}"));
        s.parse::<u64>().unwrap();
    }
    // It is reserved in σ, exactly as a gRPC Assign's is.
    let s = sigma(&snap, GROUP).await;
    let r1 = s
        .requests
        .iter()
        .find(|r| r.request_id == "r1")
        .expect("r1 in σ");
    assert_eq!((r1.worker_id, r1.prompt_tokens), (0, 100));
    assert_eq!(r1.state, v1::RequestPhase::Reserved as i32);

    // An idempotent retry (lowerCamelCase, the hash as a string and as a number) gets the
    // original answer, and σ holds one reservation.
    for body in [
        json!({"group": GROUP, "requestId": "r1", "promptTokens": 100, "promptHash": "18446744073709551615"}),
        json!({"group": GROUP, "request_id": "r1", "prompt_tokens": "100", "prompt_hash": 7}),
    ] {
        let again = post(&assign_url, &body.to_string(), &[]).await;
        assert_eq!(again.status, 200, "{again:?}");
        assert_eq!(again.json(), a, "a retry gets the original answer");
    }
    let s = sigma(&snap, GROUP).await;
    assert_eq!(
        s.requests.iter().filter(|r| r.request_id == "r1").count(),
        1
    );
    // The same id with other prompt tokens: INVALID_ARGUMENT, as on gRPC.
    let m = post(&assign_url, &assign_body(GROUP, "r1", 101), &[])
        .await
        .error(400, "INVALID_ARGUMENT");
    assert!(m.contains("prompt_tokens"), "{m}");

    // Cancel releases the reservation; a second cancel finds nothing.
    let cancel = json!({"group": GROUP, "request_id": "r1"}).to_string();
    let c = post(&cancel_url, &cancel, &[]).await;
    assert_eq!(c.status, 200, "{c:?}");
    assert_eq!(c.json(), json!({"outcome": "CANCEL_OUTCOME_RELEASED"}));
    // RELEASED means the snapshot service acknowledged the Release: σ no longer holds it, on
    // the very next read (no waiting: a wait here would hide an answer given too early).
    assert!(
        !sigma(&snap, GROUP)
            .await
            .requests
            .iter()
            .any(|r| r.request_id == "r1"),
        "RELEASED was answered while σ still held r1"
    );
    let c = post(&cancel_url, &cancel, &[]).await;
    assert_eq!(c.json(), json!({"outcome": "CANCEL_OUTCOME_NOT_FOUND"}));

    // Every error class, each with its status and gRPC code.
    let m = post(
        &assign_url,
        &json!({"group": GROUP, "request_id": "x"}).to_string(),
        &[],
    )
    .await
    .error(400, "INVALID_ARGUMENT");
    assert!(
        m.contains("prompt_tokens"),
        "validation names the field: {m}"
    );
    post(&assign_url, &assign_body("nope", "x", 10), &[])
        .await
        .error(404, "NOT_FOUND");
    post(&assign_url, &assign_body(EMPTY, "x", 10), &[])
        .await
        .error(503, "UNAVAILABLE");
    let m = post(&assign_url, r#"{"group": "e2e", "request_id": "#, &[])
        .await
        .error(400, "INVALID_ARGUMENT");
    assert!(m.contains("malformed JSON"), "{m}");
    post(
        &assign_url,
        &json!({"group": GROUP, "request_id": "x", "prompt_tokens": 10, "prompt_token": 1})
            .to_string(),
        &[],
    )
    .await
    .error(400, "INVALID_ARGUMENT");
    post(
        &assign_url,
        &json!({"group": GROUP, "request_id": "x", "prompt_hash": "-1"}).to_string(),
        &[],
    )
    .await
    .error(400, "INVALID_ARGUMENT");
    // The output-length hints, in either spelling (a count as a number or a string): σ holds
    // them with the reservation, the class as its id.
    for (id, body, expected, class) in [
        (
            "h1",
            json!({"group": GROUP, "request_id": "h1", "prompt_tokens": 10, "max_tokens": 64,
                "expected_output_tokens": 40, "request_class": "chat"}),
            40,
            "chat",
        ),
        (
            "h2",
            json!({"group": GROUP, "requestId": "h2", "promptTokens": 10,
                "expectedOutputTokens": "41", "requestClass": "tenant-7/tools"}),
            41,
            "tenant-7/tools",
        ),
    ] {
        let a = post(&assign_url, &body.to_string(), &[]).await;
        assert_eq!(a.status, 200, "{a:?}");
        let s = sigma(&snap, GROUP).await;
        let r = s
            .requests
            .iter()
            .find(|r| r.request_id == id)
            .expect("in σ");
        assert_eq!(
            (r.expected_output_tokens, r.request_class_id),
            (Some(expected), Some(br_proto::valid::class_id(class))),
            "{id}"
        );
        let c = post(
            &cancel_url,
            &json!({"group": GROUP, "request_id": id}).to_string(),
            &[],
        )
        .await;
        assert_eq!(c.json(), json!({"outcome": "CANCEL_OUTCOME_RELEASED"}));
    }
    // Bad hints: refused as the gRPC method refuses them, the message naming the field; ones
    // that are not even a count or a string: malformed JSON.
    let hinted = |extra: Value| {
        let mut body = json!({"group": GROUP, "request_id": "bad-hint", "prompt_tokens": 10});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body.to_string()
    };
    for (extra, says) in [
        (
            json!({"expected_output_tokens": 0}),
            "expected_output_tokens is 0, it must be in 1..=10000000",
        ),
        (
            json!({"expected_output_tokens": 10_000_001}),
            "expected_output_tokens is 10000001, it must be in 1..=10000000",
        ),
        (
            json!({"max_tokens": 5, "expected_output_tokens": 6}),
            "expected_output_tokens is 6, above max_tokens 5",
        ),
        (
            json!({"request_class": ""}),
            "request_class must not be empty",
        ),
        (
            json!({"request_class": "c".repeat(65)}),
            "request_class is 65 bytes long, at most 64 are allowed",
        ),
        (
            json!({"request_class": "tenant 7"}),
            "request_class contains ' '",
        ),
        (
            json!({"request_class": "thinking-\u{e9}"}),
            "request_class contains 'é'",
        ),
        (
            json!({"request_class": "a\tb"}),
            "request_class contains a control character",
        ),
        (json!({"expected_output_tokens": -1}), "malformed JSON"),
        (json!({"expected_output_tokens": 1.5}), "malformed JSON"),
        (json!({"request_class": 7}), "malformed JSON"),
    ] {
        let m = post(&assign_url, &hinted(extra.clone()), &[])
            .await
            .error(400, "INVALID_ARGUMENT");
        assert!(m.contains(says), "{extra}: {m:?} names {says:?}");
    }
    assert!(
        !sigma(&snap, GROUP)
            .await
            .requests
            .iter()
            .any(|r| r.request_id == "bad-hint"),
        "nothing reserved for a refused hint"
    );
    // curl's default form encoding: 415.
    let form = curl(vec![
        "-d".into(),
        assign_body(GROUP, "x", 10),
        assign_url.clone(),
    ])
    .await;
    form.error(415, "INVALID_ARGUMENT");
    // A body above the bound: 413, from the declared length and from a chunked one.
    let big = tempfile::NamedTempFile::new().unwrap();
    let padding = " ".repeat(70 * 1024);
    std::fs::write(big.path(), format!("{{{padding}}}")).unwrap();
    let at = format!("@{}", big.path().display());
    post(&assign_url, &at, &[])
        .await
        .error(413, "RESOURCE_EXHAUSTED");
    post(&assign_url, &at, &["-H", "Transfer-Encoding: chunked"])
        .await
        .error(413, "RESOURCE_EXHAUSTED");
    // Wrong method, wrong path, a deadline header that is not one.
    curl(vec![assign_url.clone()])
        .await
        .error(405, "UNIMPLEMENTED");
    post(&format!("http://127.0.0.1:{port}/v1/assgin"), "{}", &[])
        .await
        .error(404, "NOT_FOUND");
    post(
        &assign_url,
        &assign_body(GROUP, "x", 10),
        &["-H", "X-Request-Timeout: 5"],
    )
    .await
    .error(400, "INVALID_ARGUMENT");

    // The pool: tiny's one slot taken, the next request waits. Its deadline passes: 504.
    let t1 = post(&assign_url, &assign_body(TINY, "t1", 10), &[]).await;
    assert_eq!(t1.status, 200, "{t1:?}");
    post(
        &assign_url,
        &assign_body(TINY, "t2", 10),
        &["-H", "X-Request-Timeout: 300ms"],
    )
    .await
    .error(504, "DEADLINE_EXCEEDED");
    post(
        &assign_url,
        &assign_body(TINY, "t2", 10),
        &["-H", "grpc-timeout: 300m"],
    )
    .await
    .error(504, "DEADLINE_EXCEEDED");
    // One waits (the pool holds --max-pool 1), the next is refused: 429. Cancelling the
    // waiting one ends its call: 499 CANCELLED, and the cancel says WITHDRAWN.
    let waiting = wait_in_tiny_pool(&decision, &assign_url, "t3", "25s").await;
    let full = post(&assign_url, &assign_body(TINY, "t4", 10), &[]).await;
    full.error(429, "RESOURCE_EXHAUSTED");
    let c = post(
        &cancel_url,
        &json!({"group": TINY, "request_id": "t3"}).to_string(),
        &[],
    )
    .await;
    assert_eq!(
        c.json(),
        json!({"outcome": "CANCEL_OUTCOME_WITHDRAWN"}),
        "{c:?}"
    );
    tokio::time::timeout(START, waiting)
        .await
        .expect("the waiting call ends")
        .unwrap()
        .error(499, "CANCELLED");

    // A client that declares a body and freezes after its first byte holds its connection
    // only until its deadline: 408, and the handler never ran.
    {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        conn.write_all(
            b"POST /v1/assign HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\nX-Request-Timeout: 300ms\r\n\r\n{",
        )
        .await
        .unwrap();
        let mut answer = Vec::new();
        let read = async {
            let mut buf = [0u8; 1024];
            // the server answers and (the body never came) closes the connection
            while let Ok(n) = conn.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                answer.extend_from_slice(&buf[..n]);
                if answer.windows(2).any(|w| w == b"}}") || answer.ends_with(b"}") {
                    break;
                }
            }
        };
        tokio::time::timeout(START, read)
            .await
            .expect("an answer to the frozen body");
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(text.contains(r#""code":"DEADLINE_EXCEEDED""#), "{text}");
    }

    // Nor does a client that trickles its request's head: the connection is closed once
    // --first-byte-timeout has passed without a complete head (axum::serve alone waits for
    // ever, so idle clients could fill --max-connections).
    {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        conn.write_all(b"POST /v1/assign HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let closed = async {
            let mut buf = [0u8; 1024];
            loop {
                match conn.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        };
        tokio::time::timeout(START, closed)
            .await
            .expect("the server closes a connection whose head never completes");
    }

    // A client that leaves while its Assign waits: hyper drops the handler, and the call is
    // counted all the same, as 499 (client closed request).
    {
        use tokio::io::AsyncWriteExt as _;
        let http = "balanceroute_decision_http_requests_total";
        let left = [r#"route="/v1/assign""#, r#"status="499""#];
        let before = metric(&decision.metrics().await, http, &left);
        let body = assign_body(TINY, "t-leaves", 10);
        let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let head = format!(
            "POST /v1/assign HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             X-Request-Timeout: 1m\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        conn.write_all(format!("{head}{body}").as_bytes())
            .await
            .unwrap();
        tiny_pool_holds_one(&decision, "t-leaves").await;
        drop(conn);
        let in_tiny = [r#"group="tiny""#];
        br_testkit::eventually(START, "the Assign whose client left is counted", || async {
            let text = decision.metrics().await;
            metric(&text, "balanceroute_decision_pool_size", &in_tiny) == 0.0
                && metric(&text, http, &left) > before
        })
        .await;
    }

    // Counted per route and status, and in the Assign metrics (the same service code).
    let text = decision.metrics().await;
    let http = "balanceroute_decision_http_requests_total";
    let assign = r#"route="/v1/assign""#;
    assert!(
        metric(&text, http, &[assign, r#"status="200""#]) >= 4.0,
        "{text}"
    );
    for status in [
        "400", "404", "405", "413", "415", "429", "499", "503", "504",
    ] {
        let got = metric(&text, http, &[&format!(r#"status="{status}""#)]);
        assert!(got >= 1.0, "no {status} counted: {text}");
    }
    assert!(
        metric(&text, http, &[r#"route="/v1/cancel""#, r#"status="200""#]) >= 3.0,
        "{text}"
    );
    assert!(
        metric(
            &text,
            "balanceroute_decision_assign_total",
            &[r#"group="e2e""#, r#"code="ok""#]
        ) >= 3.0,
        "{text}"
    );
    assert!(
        metric(
            &text,
            "balanceroute_decision_http_request_duration_seconds_count",
            &[assign]
        ) >= 4.0
    );

    // SIGTERM while an HTTP call waits in the pool: the drain lets it be answered (its
    // deadline passes first, or it is told the service is going), not cut off, and the
    // process exits 0.
    let waiting = wait_in_tiny_pool(&decision, &assign_url, "t5", "2s").await;
    let mut decision = decision;
    let exit = tokio::task::spawn_blocking(move || decision.terminate(START))
        .await
        .unwrap()
        .expect("br-decision exits by itself within the grace");
    let answer = tokio::time::timeout(START, waiting).await.unwrap().unwrap();
    match answer.status {
        504 => answer.error(504, "DEADLINE_EXCEEDED"),
        _ => answer.error(503, "UNAVAILABLE"),
    };
    assert!(exit.success(), "{exit:?}");
}

/// curl's flags presenting `files`' certificate and trusting our CA.
fn cert_flags(files: &TlsFiles) -> Vec<String> {
    let s = |p: &Path| p.to_string_lossy().into_owned();
    vec![
        "--cacert".into(),
        s(&files.ca),
        "--cert".into(),
        s(&files.cert),
        "--key".into(),
        s(&files.key),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_mutual_tls_the_http_port_takes_the_grpc_ports_certificates_and_roles() {
    let pki = Pki::new();
    let flags = |role: Role, extra: &[&str]| -> Vec<String> {
        let mut f = pki.flags(role);
        f.extend(extra.iter().map(|s| (*s).to_owned()));
        f
    };
    let snap_flags = flags(Role::Snapshot, &["--reservation-ttl", "10m"]);
    let snapshot = Service::start("br-snapshot", &strs(&snap_flags));
    let snap = snapshot.grpc_url();
    let ingest_flags = flags(Role::Ingest, &["--snapshot-addr", &snap]);
    let ingest = Service::start("br-ingest", &strs(&ingest_flags));
    let decision_flags = flags(
        Role::Decision,
        &[
            "--snapshot-addr",
            &snap,
            "--groups",
            GROUP,
            "--http-listen",
            "127.0.0.1:0",
        ],
    );
    let decision = Service::start("br-decision", &strs(&decision_flags));
    let port = decision.http_port.expect("an HTTP port");
    let url = format!("https://127.0.0.1:{port}/v1/assign");

    // A worker, over its own certificate, so Assign has somewhere to go.
    let ingest_url = ingest.grpc_url();
    let ch = pki::channel(&ingest_url, &pki.worker(GROUP, 0), Some(Role::Ingest));
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tx.send(v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Hello(v1::Hello {
            group: GROUP.into(),
            worker_id: 0,
            incarnation: 91,
            capacity: 8,
            endpoint: "http://127.0.0.1:18000".into(),
        })),
    })
    .await
    .unwrap();
    let mut acks = v1::telemetry_client::TelemetryClient::new(ch)
        .report(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    tokio::time::timeout(START, acks.message())
        .await
        .expect("the Hello is answered")
        .unwrap()
        .expect("an ack");
    let _acks = tokio::spawn(async move { while let Ok(Some(_)) = acks.message().await {} });
    let admin = cert_flags(&pki.role(Role::Admin));
    let admin_args = |path: &str| {
        let mut a = admin.clone();
        a.push(format!("https://127.0.0.1:{}{path}", decision.admin_port));
        a
    };
    br_testkit::eventually_some(START, "decision is ready", || {
        let a = admin_args("/readyz");
        async move { (curl(a).await.status == 200).then_some(()) }
    })
    .await;

    // The gateway (and admin) roles may call; the answer is the service's.
    let gateway = cert_flags(&pki.role(Role::Gateway));
    let ok = post(&url, &assign_body(GROUP, "m1", 10), &strs(&gateway)).await;
    assert_eq!(ok.status, 200, "{ok:?}");
    assert_eq!(ok.json()["incarnation"], "91");
    let admin_call = post(&url, &assign_body(GROUP, "m2", 10), &strs(&admin)).await;
    assert_eq!(admin_call.status, 200, "{admin_call:?}");

    // Another role (a service's, a worker's) is refused by the same table: 403, naming it.
    for files in [
        pki.role(Role::Decision),
        pki.worker(GROUP, 0),
        pki.stranger(),
    ] {
        let f = cert_flags(&files);
        let m = post(&url, &assign_body(GROUP, "m3", 10), &strs(&f))
            .await
            .error(403, "PERMISSION_DENIED");
        assert!(m.contains("Assign"), "{m}");
    }
    let cancel_url = format!("https://127.0.0.1:{port}/v1/cancel");
    let body = json!({"group": GROUP, "request_id": "m1"}).to_string();
    post(
        &cancel_url,
        &body,
        &strs(&cert_flags(&pki.role(Role::Ingest))),
    )
    .await
    .error(403, "PERMISSION_DENIED");
    // m1 is still reserved: the refused cancel did nothing.
    let ok = post(&cancel_url, &body, &strs(&gateway)).await;
    assert_eq!(
        ok.json(),
        json!({"outcome": "CANCEL_OUTCOME_RELEASED"}),
        "{ok:?}"
    );

    // Without a client certificate (or with one from another CA) there is no HTTP answer at
    // all: the handshake fails, as on the gRPC port. Nor does plaintext get one.
    let ca = pki.role(Role::Gateway).ca;
    let no_cert = post(
        &url,
        &assign_body(GROUP, "m4", 10),
        &["--cacert", &ca.to_string_lossy()],
    )
    .await;
    assert_eq!(no_cert.status, 0, "{no_cert:?}");
    assert_ne!(no_cert.curl_exit, 0, "{no_cert:?}");
    let foreign = cert_flags(&pki.foreign_gateway());
    let f = post(&url, &assign_body(GROUP, "m4", 10), &strs(&foreign)).await;
    assert_eq!(f.status, 0, "{f:?}");
    let plain = post(
        &format!("http://127.0.0.1:{port}/v1/assign"),
        &assign_body(GROUP, "m4", 10),
        &[],
    )
    .await;
    assert_ne!(plain.status, 200, "{plain:?}");
    assert!(
        !sigma_has(&pki, &snap, "m4").await,
        "no refused call reached σ"
    );

    // Counted where the gRPC port counts them.
    let text = curl(admin_args("/metrics")).await.body;
    assert!(
        metric(
            &text,
            "balanceroute_decision_calls_denied_total",
            &[r#"reason="role_not_allowed""#]
        ) >= 3.0,
        "{text}"
    );
    assert!(
        metric(
            &text,
            "balanceroute_decision_calls_denied_total",
            &[r#"reason="no_identity""#]
        ) >= 1.0,
        "{text}"
    );
    assert!(
        metric(
            &text,
            "balanceroute_decision_tls_handshake_failures_total",
            &[]
        ) >= 2.0,
        "{text}"
    );
    assert!(
        metric(
            &text,
            "balanceroute_decision_http_requests_total",
            &[r#"status="403""#]
        ) >= 4.0,
        "{text}"
    );
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Whether σ (read with the admin certificate) holds `request_id`.
async fn sigma_has(pki: &Pki, snap: &str, request_id: &str) -> bool {
    let ch = pki::channel(snap, &pki.role(Role::Admin), Some(Role::Snapshot));
    let s = SnapshotClient::new(ch)
        .get(v1::GetRequest {
            group: GROUP.into(),
        })
        .await
        .unwrap()
        .into_inner();
    s.requests.iter().any(|r| r.request_id == request_id)
}
