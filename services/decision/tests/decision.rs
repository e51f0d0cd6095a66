//! br-decision over real gRPC on 127.0.0.1, with the real br-snapshot in-process and the
//! gateway client (`br_client::assign`). Telemetry is played by an `Apply` stream to the
//! snapshot service (what ingest does). Waits are for conditions (bounded), never timings.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on purpose

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use br_client::assign::{AssignClient, AssignError, AssignParams, CancelOutcome, RetryPolicy};
use br_core::{PolicyKind, PredictorKind};
use br_decision::Running;
use br_proto::v1;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::telemetry_change::Kind as T;
use br_testkit::apply::{ApplyStream, change};
use br_testkit::http::{get as http_get, metrics};
use br_testkit::{eventually, eventually_some};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tonic::Code;

const GROUP: &str = "g";
/// A hang guard for waits and calls, not a timing assertion.
const WAIT: Duration = br_testkit::PATIENCE;

struct Snapshot {
    running: br_snapshot::Running,
    stop: CancellationToken,
    addr: SocketAddr,
}

async fn start_snapshot(listen: &str) -> Snapshot {
    let (running, stop) =
        br_snapshot::test_util::start(listen, &["--shutdown-grace", "300ms"]).await;
    let addr = running.grpc_addr();
    Snapshot {
        running,
        stop,
        addr,
    }
}

impl Snapshot {
    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn kill(self) {
        self.stop.cancel();
        let _ = tokio::time::timeout(WAIT, self.running.wait()).await;
    }

    async fn get(&self) -> v1::ClusterSnapshot {
        let mut c = SnapshotClient::connect(self.url()).await.unwrap();
        c.get(v1::GetRequest {
            group: GROUP.into(),
        })
        .await
        .unwrap()
        .into_inner()
    }

    async fn request_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .get()
            .await
            .requests
            .into_iter()
            .map(|r| r.request_id)
            .collect();
        ids.sort();
        ids
    }
}

/// A telemetry source (one Apply stream, as ingest has): workers stay LIVE while it is open.
struct Telemetry(ApplyStream);

impl Telemetry {
    async fn open(snap: &Snapshot) -> Telemetry {
        Telemetry(ApplyStream::open(&snap.url()).await)
    }

    async fn send(&mut self, changes: Vec<T>) {
        let changes = changes.into_iter().map(change).collect();
        self.0.send_ok(GROUP, changes).await;
    }

    async fn hello(&mut self, workers: u32, capacity: u32) {
        let changes = (0..workers)
            .map(|w| {
                T::WorkerHello(v1::telemetry_change::WorkerHello {
                    worker_id: w,
                    incarnation: 1000 + u64::from(w),
                    capacity,
                    endpoint: format!("http://rank{w}"),
                })
            })
            .collect();
        self.send(changes).await;
    }

    /// Active requests that give worker `w` the load `s` each.
    async fn running(&mut self, w: u32, ids_and_tokens: &[(&str, u32)]) {
        let changes = ids_and_tokens
            .iter()
            .map(|(id, s)| {
                T::RequestProgress(v1::telemetry_change::RequestProgress {
                    worker_id: w,
                    incarnation: 1000 + u64::from(w),
                    request_id: (*id).into(),
                    prompt_tokens: *s,
                    generated_tokens: 1,
                    finished: false,
                    unkeyed: false,
                })
            })
            .collect();
        self.send(changes).await;
    }
}

fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// br-decision on ephemeral ports for `GROUP`, with `extra` flags.
async fn start_decision(snapshot_url: &str, policy: PolicyKind, extra: &[&str]) -> Running {
    init_logs();
    let policy = policy.to_string();
    let mut argv = vec![
        "br-decision",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--snapshot-addr",
        snapshot_url,
        "--policy",
        &policy,
        "--groups",
        GROUP,
        "--shutdown-grace",
        "2s",
    ];
    argv.extend_from_slice(extra);
    let args: br_decision::Args = br_runtime::config::parse_from(argv).unwrap();
    br_decision::start(&args, CancellationToken::new())
        .await
        .unwrap()
}

async fn ready(d: &Running) {
    eventually(WAIT, "decision ready", || async {
        d.readiness().is_ready()
    })
    .await;
}

async fn client(d: &Running) -> AssignClient {
    AssignClient::connect(format!("http://{}", d.grpc_addr()))
        .await
        .unwrap()
        .with_retry(RetryPolicy {
            initial_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(50),
            max_attempts: None,
        })
}

async fn health(d: &Running) -> i32 {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", d.grpc_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = HealthClient::new(ch);
    c.check(HealthCheckRequest {
        service: "balanceroute.v1.Decision".into(),
    })
    .await
    .unwrap()
    .into_inner()
    .status
}

fn params(id: &str, s: u32) -> AssignParams {
    AssignParams::new(GROUP, id, s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_until_sigma_then_serves() {
    use tonic_health::pb::health_check_response::ServingStatus as H;
    // The address of a snapshot service that has gone away: decision starts without one.
    let gone = start_snapshot("127.0.0.1:0").await;
    let listen = gone.addr.to_string();
    gone.kill().await;
    let d = start_decision(&format!("http://{listen}"), PolicyKind::Br0, &[]).await;
    assert!(!d.readiness().is_ready());
    assert_eq!(http_get(d.admin_addr(), "/readyz").await.0, 503);
    assert_eq!(health(&d).await, H::NotServing as i32);
    let c = client(&d).await.with_retry(RetryPolicy {
        max_attempts: Some(1),
        ..RetryPolicy::default()
    });
    let err = c
        .assign_within(&params("early", 10), Duration::from_secs(2))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");

    // It comes back where decision expects it (a restart: the port is bound again).
    let snap = start_snapshot(&listen).await;
    let mut t = Telemetry::open(&snap).await;
    t.hello(2, 8).await;
    ready(&d).await;
    assert_eq!(http_get(d.admin_addr(), "/readyz").await.0, 200);
    eventually(WAIT, "health SERVING", || async {
        health(&d).await == H::Serving as i32
    })
    .await;
    let a = client(&d)
        .await
        .assign_within(&params("r1", 10), WAIT)
        .await
        .unwrap();
    assert!(a.worker_id < 2);
    d.stop().await.unwrap();
    snap.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assignments_follow_the_policy() {
    // Worker 0: one request of 10,000 tokens. Worker 1: three of 100. JSQ counts requests
    // (-> 0); BR-0 balances tokens (-> 1).
    for (policy, want) in [
        (PolicyKind::Jsq, 0),
        (PolicyKind::Br0, 1),
        (PolicyKind::MinTokens, 1),
    ] {
        let snap = start_snapshot("127.0.0.1:0").await;
        let mut t = Telemetry::open(&snap).await;
        t.hello(2, 16).await;
        t.running(0, &[("big", 10_000)]).await;
        t.running(1, &[("s1", 100), ("s2", 100), ("s3", 100)]).await;
        let d = start_decision(&snap.url(), policy, &[]).await;
        ready(&d).await;
        eventually(WAIT, "σ has the running requests", || async {
            d.extra()
                .stats(GROUP)
                .await
                .and_then(|s| s.sigma)
                .is_some_and(|(_, v)| v >= 3)
        })
        .await;
        let a = client(&d)
            .await
            .assign_within(&params("new", 500), WAIT)
            .await
            .unwrap();
        assert_eq!(a.worker_id, want, "{policy}");
        assert_eq!(a.policy, policy.name());
        assert_eq!(a.endpoint, format!("http://rank{want}"));
        assert_eq!(a.incarnation, 1000 + u64::from(want));
        assert!(!a.stale);
        assert!(
            snap.request_ids().await.contains(&"new".to_string()),
            "reserved in σ before the answer"
        );
        d.stop().await.unwrap();
        snap.kill().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_callers_are_all_reserved_once() {
    let snap = start_snapshot("127.0.0.1:0").await;
    let mut t = Telemetry::open(&snap).await;
    t.hello(4, 64).await;
    let d = start_decision(&snap.url(), PolicyKind::Br0, &[]).await;
    ready(&d).await;
    let c = client(&d).await;
    let mut calls = Vec::new();
    for i in 0..200u32 {
        let c = c.clone();
        calls.push(tokio::spawn(async move {
            c.assign_within(&params(&format!("c{i}"), 100 + (i * 37) % 900), WAIT)
                .await
        }));
    }
    let mut per_worker = [0u32; 4];
    for call in calls {
        let a = call.await.unwrap().unwrap();
        per_worker[a.worker_id as usize] += 1;
        assert_eq!(a.policy, "br0");
    }
    assert_eq!(per_worker.iter().sum::<u32>(), 200);
    assert!(per_worker.iter().all(|&n| n <= 64), "{per_worker:?}");
    assert!(per_worker.iter().all(|&n| n > 0), "spread: {per_worker:?}");
    let ids = snap.request_ids().await;
    assert_eq!(ids.len(), 200, "each request reserved exactly once");
    let st = d.extra().stats(GROUP).await.unwrap();
    assert_eq!((st.pool, st.waiting_calls, st.reserving), (0, 0, 0));
    d.stop().await.unwrap();
    snap.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_leave_nothing_behind() {
    let snap = start_snapshot("127.0.0.1:0").await;
    let mut t = Telemetry::open(&snap).await;
    t.hello(1, 1).await;
    let d = start_decision(&snap.url(), PolicyKind::Br0, &[]).await;
    ready(&d).await;
    let c = client(&d).await;
    c.assign_within(&params("first", 10), WAIT).await.unwrap();
    // The only slot is taken: the next one waits until its deadline.
    let err = c
        .assign_within(&params("late", 10), Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(err, AssignError::DeadlineExceeded), "{err:?}");
    eventually(WAIT, "the pool is empty", || async {
        d.extra()
            .stats(GROUP)
            .await
            .is_some_and(|s| s.pool == 0 && s.waiting_calls == 0 && s.reserving == 0)
    })
    .await;
    assert_eq!(
        snap.request_ids().await,
        vec!["first".to_string()],
        "no reservation for 'late'"
    );
    let m = metrics(d.admin_addr()).await;
    assert_eq!(
        m.value(
            "balanceroute_decision_assign_total",
            &[("code", "deadline_exceeded"), ("group", "g")]
        ),
        1.0
    );
    d.stop().await.unwrap();
    snap.kill().await;
}

/// RELEASED is an acknowledged Release: with the snapshot service gone the Release cannot be,
/// so Cancel says so (ABORTED, not retried into a NOT_FOUND) instead of claiming RELEASED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_is_released_only_once_the_snapshot_service_acknowledges() {
    let snap = start_snapshot("127.0.0.1:0").await;
    let mut t = Telemetry::open(&snap).await;
    t.hello(3, 1).await;
    let d = start_decision(&snap.url(), PolicyKind::Br0, &[]).await;
    ready(&d).await;
    let c = client(&d).await;
    c.assign_within(&params("r1", 100), WAIT).await.unwrap();
    snap.kill().await;
    let err = c.cancel(GROUP, "r1").await.unwrap_err();
    let AssignError::Status(s) = &err else {
        panic!("expected ABORTED, got {err:?}")
    };
    assert_eq!(s.code(), Code::Aborted, "{s:?}");
    assert!(s.message().contains("TTL"), "says what is true: {s:?}");
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_idempotent_retries() {
    let snap = start_snapshot("127.0.0.1:0").await;
    let mut t = Telemetry::open(&snap).await;
    t.hello(3, 1).await;
    let d = start_decision(&snap.url(), PolicyKind::Br0, &[]).await;
    ready(&d).await;
    let c = client(&d).await;

    let a = c.assign_within(&params("r1", 100), WAIT).await.unwrap();
    let again = c.assign_within(&params("r1", 100), WAIT).await.unwrap();
    assert_eq!(
        (again.worker_id, again.incarnation),
        (a.worker_id, a.incarnation),
        "same answer"
    );
    assert_eq!(snap.request_ids().await, vec!["r1".to_string()]);
    let err = c.assign_within(&params("r1", 101), WAIT).await.unwrap_err();
    assert_eq!(
        err.code(),
        Code::InvalidArgument,
        "same id, other prompt: {err}"
    );

    assert_eq!(
        c.cancel(GROUP, "r1").await.unwrap(),
        CancelOutcome::Released
    );
    // RELEASED means σ has dropped the reservation: a read right after the answer finds
    // nothing, with no waiting (a gateway reads σ or Assigns again at once).
    assert_eq!(
        snap.request_ids().await,
        Vec::<String>::new(),
        "σ still holds r1 after Cancel answered RELEASED"
    );
    assert_eq!(
        c.cancel(GROUP, "r1").await.unwrap(),
        CancelOutcome::NotFound
    );
    assert_eq!(
        c.cancel(GROUP, "never").await.unwrap(),
        CancelOutcome::NotFound
    );

    // Fill the three slots, then cancel a waiting request: its Assign ends CANCELLED.
    for i in 0..3 {
        c.assign_within(&params(&format!("f{i}"), 10), WAIT)
            .await
            .unwrap();
    }
    let waiting = {
        let c = c.clone();
        tokio::spawn(async move { c.assign_within(&params("w", 10), WAIT).await })
    };
    eventually(WAIT, "w waits in the pool", || async {
        d.extra().stats(GROUP).await.is_some_and(|s| s.pool == 1)
    })
    .await;
    assert_eq!(
        c.cancel(GROUP, "w").await.unwrap(),
        CancelOutcome::Withdrawn
    );
    let err = waiting.await.unwrap().unwrap_err();
    assert_eq!(err.code(), Code::Cancelled, "{err}");
    assert_eq!(d.extra().stats(GROUP).await.unwrap().pool, 0);
    assert!(!snap.request_ids().await.contains(&"w".to_string()));
    d.stop().await.unwrap();
    snap.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_typed_statuses() {
    let snap = start_snapshot("127.0.0.1:0").await;
    let mut t = Telemetry::open(&snap).await;
    t.hello(1, 1).await;
    let d = start_decision(&snap.url(), PolicyKind::Br0, &["--max-pool", "1"]).await;
    ready(&d).await;
    let c = client(&d).await;
    let code = |r: Result<_, AssignError>| r.unwrap_err().code();
    assert_eq!(
        code(c.assign_within(&AssignParams::new("", "r", 1), WAIT).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(c.assign_within(&params("", 1), WAIT).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(c.assign_within(&params("r", 0), WAIT).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(c.assign_within(&params("r", 10_000_001), WAIT).await),
        Code::InvalidArgument
    );
    // Bad output-length hints: INVALID_ARGUMENT, the message naming the field and the rule.
    for (p, says) in [
        (
            params("r", 1).with_expected_output_tokens(0),
            "expected_output_tokens is 0, it must be in 1..=10000000",
        ),
        (
            params("r", 1).with_expected_output_tokens(10_000_001),
            "expected_output_tokens is 10000001, it must be in 1..=10000000",
        ),
        (
            params("r", 1)
                .with_max_tokens(16)
                .with_expected_output_tokens(17),
            "expected_output_tokens is 17, above max_tokens 16",
        ),
        (
            params("r", 1).with_request_class(""),
            "request_class must not be empty",
        ),
        (
            params("r", 1).with_request_class("c".repeat(65)),
            "request_class is 65 bytes long, at most 64 are allowed",
        ),
        (
            params("r", 1).with_request_class("tenant 7"),
            "request_class contains ' ', it takes only printable ASCII without spaces",
        ),
        (
            params("r", 1).with_request_class("thinking-\u{e9}"),
            "request_class contains 'é'",
        ),
        (
            params("r", 1).with_request_class("a\nb"),
            "request_class contains a control character",
        ),
    ] {
        match c.assign_within(&p, WAIT).await {
            Err(AssignError::InvalidArgument(m)) => assert!(m.contains(says), "{m:?}: {says:?}"),
            other => panic!("{p:?}: {other:?}"),
        }
    }
    assert!(
        !snap.request_ids().await.contains(&"r".to_string()),
        "nothing reserved for bad hints"
    );
    assert_eq!(
        code(
            c.assign_within(&AssignParams::new("other", "r", 1), WAIT)
                .await
        ),
        Code::NotFound,
        "unknown groups are NOT_FOUND"
    );
    assert_eq!(
        c.cancel("other", "r").await.unwrap_err().code(),
        Code::NotFound
    );
    // Pool full: one slot taken, one waiting, the next is refused.
    c.assign_within(&params("a", 1), WAIT).await.unwrap();
    let waiting = {
        let c = c.clone();
        tokio::spawn(async move {
            c.assign_within(&params("b", 1), Duration::from_secs(2))
                .await
        })
    };
    eventually(WAIT, "b waits", || async {
        d.extra().stats(GROUP).await.is_some_and(|s| s.pool == 1)
    })
    .await;
    assert_eq!(
        code(c.assign_within(&params("c", 1), WAIT).await),
        Code::ResourceExhausted
    );
    let _ = waiting.await;
    d.stop().await.unwrap();
    snap.kill().await;
}

/// `--policy brh-hinted`: the hints an Assign carries reach the Hinted predictor, over the
/// whole split path: the Assign's validation, the pool, the reservation committed to the
/// snapshot service, σ's delta back to the replica, and the finish σ reports (what the
/// predictor learns from; its `hinted` count is the finishes that carried a hint). A second
/// replica, started after the Assign, knows the request only from σ and learns its hint all
/// the same. Dropping the hint at any hop leaves a count at 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brh_hinted_learns_the_hints_sent_in_assign() {
    let snap = start_snapshot("127.0.0.1:0").await;
    let mut t = Telemetry::open(&snap).await;
    t.hello(2, 8).await;
    let hinted = PolicyKind::BrH(PredictorKind::Hinted);
    let a = start_decision(&snap.url(), hinted, &[]).await;
    ready(&a).await;
    let c = client(&a).await;
    let with_hints = params("h1", 100)
        .with_max_tokens(512)
        .with_expected_output_tokens(300)
        .with_request_class("chat");
    let placed = c.assign_within(&with_hints, WAIT).await.unwrap();
    let plain = c.assign_within(&params("p1", 100), WAIT).await.unwrap();
    let sigma = &snap;
    let held = |id: &'static str| async move {
        sigma
            .get()
            .await
            .requests
            .into_iter()
            .find(|r| r.request_id == id)
            .unwrap_or_else(|| panic!("{id} reserved in σ"))
    };
    let h1 = held("h1").await;
    assert_eq!(
        (h1.expected_output_tokens, h1.request_class_id),
        (Some(300), Some(br_proto::valid::class_id("chat")))
    );
    let p1 = held("p1").await;
    assert_eq!(
        (p1.expected_output_tokens, p1.request_class_id),
        (None, None)
    );

    // The second replica starts now: h1 and p1 reach it in its first snapshot of σ only.
    let b = start_decision(&snap.url(), hinted, &[]).await;
    ready(&b).await;

    // The ranks run both and finish them.
    let finish = |worker: u32, id: &str, tokens: u32| {
        T::RequestProgress(v1::telemetry_change::RequestProgress {
            worker_id: worker,
            incarnation: 1000 + u64::from(worker),
            request_id: id.into(),
            prompt_tokens: 100,
            generated_tokens: tokens,
            finished: true,
            unkeyed: false,
        })
    };
    t.send(vec![
        finish(placed.worker_id, "h1", 280),
        finish(plain.worker_id, "p1", 50),
    ])
    .await;
    for (name, d) in [("the replica that assigned", &a), ("the other replica", &b)] {
        let learned = |kind: &'static str| async move {
            metrics(d.admin_addr()).await.value(
                "balanceroute_decision_predictor_entries",
                &[("group", GROUP), ("kind", kind)],
            )
        };
        eventually(WAIT, "both finishes learned", || async {
            learned("samples").await == 2.0
        })
        .await;
        assert_eq!(
            learned("hinted").await,
            1.0,
            "{name}: h1's hint, p1 had none"
        );
    }
    a.stop().await.unwrap();
    b.stop().await.unwrap();
    snap.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_outage_answers_stale_then_resyncs() {
    let snap = start_snapshot("127.0.0.1:0").await;
    let listen = snap.addr.to_string();
    let mut t = Telemetry::open(&snap).await;
    t.hello(2, 8).await;
    let d = start_decision(&snap.url(), PolicyKind::Br0, &[]).await;
    ready(&d).await;
    let c = client(&d).await;
    let before = c.assign_within(&params("before", 100), WAIT).await.unwrap();
    assert!(!before.stale);
    let first_epoch = snap.get().await.epoch;

    drop(t);
    snap.kill().await;
    eventually(WAIT, "σ stale", || async {
        d.extra().stats(GROUP).await.is_some_and(|s| s.stale)
    })
    .await;
    let m = metrics(d.admin_addr()).await;
    assert_eq!(
        m.value("balanceroute_decision_sigma_stale", &[("group", "g")]),
        1.0
    );
    assert!(d.readiness().is_ready(), "still ready: it keeps answering");
    let away = c.assign_within(&params("away", 100), WAIT).await.unwrap();
    assert!(away.stale, "decided without the snapshot service");

    // Back (a new epoch), the workers say hello again.
    let snap = start_snapshot(&listen).await;
    let mut t = Telemetry::open(&snap).await;
    t.hello(2, 8).await;
    eventually(WAIT, "resynced", || async {
        d.extra()
            .stats(GROUP)
            .await
            .is_some_and(|s| !s.stale && s.sigma.is_some_and(|(e, _)| e != first_epoch))
    })
    .await;
    // The rank runs what it was sent while σ was away and reports it: that report, not a
    // re-commit of decision's stale reservation, puts it in the new σ (a stale reservation no
    // worker reports is dropped, never resurrected: group/tests/outage.rs).
    t.running(away.worker_id, &[("away", 100)]).await;
    eventually(
        WAIT,
        "what was decided while away is in σ as its rank reports it",
        || async { snap.request_ids().await.contains(&"away".to_string()) },
    )
    .await;
    let after = c.assign_within(&params("after", 100), WAIT).await.unwrap();
    assert!(!after.stale);
    let m = metrics(d.admin_addr()).await;
    assert_eq!(
        m.value("balanceroute_decision_sigma_stale", &[("group", "g")]),
        0.0
    );
    d.stop().await.unwrap();
    snap.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_arrival_baselines_answer_at_once() {
    let snap = start_snapshot("127.0.0.1:0").await;
    let mut t = Telemetry::open(&snap).await;
    t.hello(3, 8).await;
    let d = start_decision(&snap.url(), PolicyKind::RoundRobin, &[]).await;
    ready(&d).await;
    let c = client(&d).await;
    let mut ws = Vec::new();
    for i in 0..6 {
        let a = c
            .assign_within(&params(&format!("rr{i}"), 10), WAIT)
            .await
            .unwrap();
        assert_eq!(a.pool_wait, Duration::ZERO);
        ws.push(a.worker_id);
    }
    assert_eq!(ws, [0, 1, 2, 0, 1, 2]);
    assert_eq!(snap.request_ids().await.len(), 6);
    d.stop().await.unwrap();
    snap.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_export_every_contract_name() {
    let snap = start_snapshot("127.0.0.1:0").await;
    let mut t = Telemetry::open(&snap).await;
    t.hello(1, 8).await;
    let d = start_decision(&snap.url(), PolicyKind::Br0, &[]).await;
    ready(&d).await;
    client(&d)
        .await
        .assign_within(&params("m", 10), WAIT)
        .await
        .unwrap();
    // Every name under `# decision` with the contract's type; labels read exactly below.
    let m = metrics(d.admin_addr()).await;
    let names = m.assert_contract("decision");
    assert!(names.len() >= 13, "{names:?}");
    assert_eq!(m.value("balanceroute_decision_ready", &[]), 1.0);
    assert_eq!(
        m.value(
            "balanceroute_decision_assign_total",
            &[("code", "ok"), ("group", GROUP)]
        ),
        1.0
    );
    assert_eq!(http_get(d.admin_addr(), "/livez").await.0, 200);
    d.stop().await.unwrap();
    snap.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_goes_away_leaves_the_pool() {
    let snap = start_snapshot("127.0.0.1:0").await;
    let mut t = Telemetry::open(&snap).await;
    t.hello(1, 1).await;
    let d = start_decision(&snap.url(), PolicyKind::Br0, &[]).await;
    ready(&d).await;
    let c = client(&d).await;
    c.assign_within(&params("full", 10), WAIT).await.unwrap();
    let gone = {
        let c = c.clone();
        tokio::spawn(async move {
            c.assign_within(&params("gone", 10), Duration::from_secs(60))
                .await
        })
    };
    eventually(WAIT, "it waits", || async {
        d.extra().stats(GROUP).await.is_some_and(|s| s.pool == 1)
    })
    .await;
    gone.abort(); // the gateway drops the call: the server's handler future is dropped
    eventually(WAIT, "withdrawn by the drop guard", || async {
        d.extra()
            .stats(GROUP)
            .await
            .is_some_and(|s| s.pool == 0 && s.waiting_calls == 0)
    })
    .await;
    // The slot frees up: nothing was reserved for the caller that left.
    t.running(0, &[("full", 10)]).await;
    assert_eq!(snap.request_ids().await, vec!["full".to_string()]);
    d.stop().await.unwrap();
    snap.kill().await;
}

/// Ready means it can place a request: with σ but no worker it is not ready and
/// `/readyz` says why (it was "ready" and answered every Assign UNAVAILABLE); a Hello makes it
/// ready; its last worker gone makes it not ready again, and health follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_only_while_a_request_can_be_placed() {
    use tonic_health::pb::health_check_response::ServingStatus as H;
    let snap = start_snapshot("127.0.0.1:0").await;
    let d = start_decision(&snap.url(), PolicyKind::Br0, &[]).await;
    let said = |want: &'static str| {
        let admin = d.admin_addr();
        async move {
            let (code, body) = http_get(admin, "/readyz").await;
            code == 503 && body.contains(want)
        }
    };
    eventually(
        WAIT,
        "σ arrives, with no worker: not ready, saying so",
        || said("no live worker in group(s) g:"),
    )
    .await;
    assert!(!d.readiness().is_ready());
    assert_eq!(health(&d).await, H::NotServing as i32);

    let mut t = Telemetry::open(&snap).await;
    t.hello(1, 8).await;
    ready(&d).await;
    assert_eq!(
        http_get(d.admin_addr(), "/readyz").await,
        (200, "ready\n".into())
    );
    eventually(WAIT, "health SERVING", || async {
        health(&d).await == H::Serving as i32
    })
    .await;

    t.send(vec![T::WorkerDisconnected(
        v1::telemetry_change::WorkerDisconnected {
            worker_id: 0,
            incarnation: 1000,
            disconnected_at_unix_ms: 1,
        },
    )])
    .await;
    eventually(WAIT, "the last worker gone: not ready again", || {
        said("no live worker in group(s) g:")
    })
    .await;
    assert_eq!(health(&d).await, H::NotServing as i32);
    let m = metrics(d.admin_addr()).await;
    assert_eq!(m.value("balanceroute_decision_ready", &[]), 0.0);
    snap.kill().await;
}

/// `GET` of a live-page JSON route: its status and body.
async fn live_json(d: &Running, path: &str) -> (u16, serde_json::Value) {
    let (code, body) = http_get(d.admin_addr(), path).await;
    let json = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"));
    (code, json)
}

/// `[{"worker_id": .., "load_tokens": ..}, ..]` (a sample's loads, or σ's worker table) by
/// worker.
fn loads_by_worker(list: &serde_json::Value) -> BTreeMap<u64, u64> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["worker_id"].as_u64().unwrap(),
                w["load_tokens"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// The live page's JSON API without a browser: a group with no σ says so; once σ
/// arrives each rank's load and the imbalance are σ's (recomputed here from the requests
/// σ holds); Assign traffic shows as a rate and a latency; `since` reads only newer samples;
/// the history never holds more than `--live-history / --live-sample-interval` samples; the
/// page and its assets are served from the binary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_api_serves_a_bounded_history_of_sigma() {
    // The address of a snapshot service that has gone away: decision starts without σ.
    let gone = start_snapshot("127.0.0.1:0").await;
    let listen = gone.addr.to_string();
    gone.kill().await;
    let flags = ["--live-sample-interval", "100ms", "--live-history", "1s"];
    let d = start_decision(&format!("http://{listen}"), PolicyKind::Jsq, &flags).await;
    const KEPT: u64 = 10;

    let (code, html) = http_get(d.admin_addr(), "/live").await;
    assert_eq!(code, 200);
    assert!(
        html.contains("/live/live.js") && html.contains("<svg"),
        "{html}"
    );
    let (code, js) = http_get(d.admin_addr(), "/live/live.js").await;
    assert!(code == 200 && js.contains("/live/api/group/"), "{code}");
    assert_eq!(http_get(d.admin_addr(), "/live/live.css").await.0, 200);

    let path = format!("/live/api/group/{GROUP}");
    let no_sigma = eventually_some(WAIT, "a first sample", || async {
        let (_, j) = live_json(&d, &path).await;
        (j["last_seq"].as_u64() > Some(0)).then_some(j)
    })
    .await;
    assert_eq!(no_sigma["now"]["placing"], "no_sigma", "{no_sigma}");
    assert!(no_sigma["now"]["sigma"].is_null(), "{no_sigma}");
    assert!(no_sigma["samples"][0]["sigma_version"].is_null());
    assert_eq!(no_sigma["policy"], "jsq");
    let (code, j) = live_json(&d, "/live/api/group/nope").await;
    assert_eq!(code, 404);
    assert!(j["error"].as_str().unwrap().contains(GROUP), "{j}");
    assert_eq!(
        http_get(d.admin_addr(), &format!("{path}?since=x")).await.0,
        400
    );

    // σ arrives: three ranks, two with requests.
    let snap = start_snapshot(&listen).await;
    let mut t = Telemetry::open(&snap).await;
    t.hello(3, 8).await;
    t.running(0, &[("a", 100)]).await;
    t.running(1, &[("b", 40), ("c", 20)]).await;
    let sigma = snap.get().await;
    let mut want: BTreeMap<u64, u64> = sigma
        .workers
        .iter()
        .map(|w| (w.worker_id.into(), 0))
        .collect();
    for r in &sigma.requests {
        *want.entry(r.worker_id.into()).or_default() +=
            u64::from(r.prompt_tokens) + u64::from(r.generated_tokens);
    }
    let max = *want.values().max().unwrap();
    let imbalance = max - *want.values().min().unwrap();
    let barrier_idle = want.len() as u64 * max - want.values().sum::<u64>();
    assert_ne!(imbalance, barrier_idle, "three ranks tell the two apart");
    // 64-bit numbers as decimal strings: a JSON number would lose the epoch's low bits
    let version = sigma.version.to_string();
    let j = eventually_some(WAIT, "the page's σ is the snapshot service's", || async {
        let (_, j) = live_json(&d, &path).await;
        (j["now"]["sigma"]["version"].as_str() == Some(version.as_str())).then_some(j)
    })
    .await;
    let now = &j["now"];
    assert_eq!(now["placing"], "ready", "{now}");
    assert_eq!(now["sigma"]["epoch"], sigma.epoch.to_string(), "{now}");
    let last = j["samples"].as_array().unwrap().last().unwrap();
    assert_eq!(last["sigma_version"], version, "{last}");
    assert_eq!(loads_by_worker(&now["sigma"]["workers"]), want);
    assert_eq!(now["sigma"]["imbalance_tokens"].as_u64(), Some(imbalance));
    assert_eq!(
        now["sigma"]["barrier_idle_tokens"].as_u64(),
        Some(barrier_idle)
    );
    let last = j["samples"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["imbalance_tokens"].as_u64(), Some(imbalance), "{last}");
    assert_eq!(
        last["barrier_idle_tokens"].as_u64(),
        Some(barrier_idle),
        "{last}"
    );
    assert_eq!(
        loads_by_worker(&last["loads"]),
        want,
        "the series' last point is the worker table's"
    );

    // Assign traffic shows as a rate and a latency.
    let c = client(&d).await;
    for i in 0..5 {
        c.assign_within(&params(&format!("live-{i}"), 10), WAIT)
            .await
            .unwrap();
    }
    let busy = eventually_some(
        WAIT,
        "a sample with the Assign rate and latency",
        || async {
            let (_, j) = live_json(&d, &path).await;
            j["samples"]
                .as_array()
                .unwrap()
                .iter()
                .rev()
                .find(|s| {
                    s["assign_rate"].as_f64() > Some(0.0) && s["latency_p50_ms"].as_f64().is_some()
                })
                .cloned()
        },
    )
    .await;
    assert_eq!(busy["assign_failed_rate"].as_f64(), Some(0.0), "{busy}");
    assert!(
        busy["latency_p99_ms"].as_f64() >= busy["latency_p50_ms"].as_f64(),
        "{busy}"
    );

    // The bound: once more samples were taken than it keeps, it keeps exactly that many,
    // consecutive and the newest.
    let full = eventually_some(WAIT, "more samples than the history keeps", || async {
        let (_, j) = live_json(&d, &path).await;
        (j["last_seq"].as_u64().unwrap() > 2 * KEPT).then_some(j)
    })
    .await;
    assert_eq!(full["history_samples"].as_u64(), Some(KEPT));
    let seqs: Vec<u64> = full["samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["seq"].as_u64().unwrap())
        .collect();
    let last_seq = full["last_seq"].as_u64().unwrap();
    assert_eq!(seqs, (last_seq - KEPT + 1..=last_seq).collect::<Vec<_>>());
    assert_eq!(full["oldest_seq"].as_u64(), Some(last_seq - KEPT + 1));
    // since: only what came after it
    let since = last_seq - 3;
    let (_, j) = live_json(&d, &format!("{path}?since={since}")).await;
    let after: Vec<u64> = j["samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["seq"].as_u64().unwrap())
        .collect();
    assert!(after.len() >= 3 && after[0] == since + 1, "{after:?}");
    assert!(after.windows(2).all(|w| w[1] == w[0] + 1), "{after:?}");

    let (code, groups) = live_json(&d, "/live/api/groups").await;
    assert_eq!(code, 200);
    assert_eq!(groups["groups"][0]["group"], GROUP);
    assert_eq!(groups["groups"][0]["now"]["ranks"], 3, "{groups}");
    assert_eq!(groups["sample_interval_ms"], 100);
    d.stop().await.unwrap();
    snap.kill().await;
}

/// A raw HTTP/1.1 `POST /v1/assign` to the HTTP/JSON port declaring a `declared`-byte body,
/// of which `sent` bytes go out with the head in one write; the connection is returned open.
async fn partial_assign(addr: SocketAddr, declared: usize, sent: usize) -> TcpStream {
    let mut c = TcpStream::connect(addr).await.unwrap();
    c.write_all(
        format!(
            "POST /v1/assign HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
             content-length: {declared}\r\n\r\n{}",
            " ".repeat(sent)
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    c
}

/// Reads the HTTP/1.1 response on `c`: its status and its body (by its `content-length`).
async fn read_response(c: &mut TcpStream) -> (u16, String) {
    let read = async {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = c.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed before a response head: {buf:?}");
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
        let length: usize = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().unwrap())
            })
            .expect("a content-length");
        while buf.len() < head_end + length {
            let n = c.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed before the end of the body");
            buf.extend_from_slice(&chunk[..n]);
        }
        let body = String::from_utf8_lossy(&buf[head_end..head_end + length]).into_owned();
        (status, body)
    };
    tokio::time::timeout(WAIT, read).await.expect("a response")
}

/// The process's bytes of unfinished request messages and bodies (the in-flight gauge).
async fn in_flight_bytes(d: &Running) -> f64 {
    metrics(d.admin_addr())
        .await
        .value("balanceroute_decision_in_flight_message_bytes", &[])
}

/// Bodies still arriving on the HTTP/JSON port are charged to the process's in-flight budget,
/// the gRPC ports' own: past it a body is refused 429 RESOURCE_EXHAUSTED and counted with the
/// gRPC refusals, a small Assign is placed all the same, and the stalled clients' charges come
/// back when they go away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_bodies_still_arriving_are_bounded_by_the_in_flight_budget() {
    const BUDGET: &str = "131072";
    let snap = start_snapshot("127.0.0.1:0").await;
    let mut t = Telemetry::open(&snap).await;
    t.hello(1, 8).await;
    let extra = [
        "--http-listen",
        "127.0.0.1:0",
        "--max-in-flight-message-bytes",
        BUDGET,
        "--max-in-flight-message-bytes-per-connection",
        BUDGET,
        // the stalled bodies must outlast the test, not time out (408) half-way
        "--max-wait",
        "600s",
    ];
    let d = start_decision(&snap.url(), PolicyKind::Br0, &extra).await;
    ready(&d).await;
    let http = d.http_json_addr().unwrap();

    // two bodies declaring 60,000 bytes fit in 128 KiB, each charged its whole length
    let mut stalled = Vec::new();
    for n in 1..=2u32 {
        stalled.push(partial_assign(http, 60_000, 40_000).await);
        let want = 60_000.0 * f64::from(n);
        eventually(WAIT, &format!("{want} bytes held"), || async {
            in_flight_bytes(&d).await == want
        })
        .await;
    }
    let mut third = partial_assign(http, 60_000, 40_000).await;
    let (status, body) = read_response(&mut third).await;
    assert_eq!(status, 429, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["code"], "RESOURCE_EXHAUSTED", "{body}");
    assert!(
        v["message"].as_str().unwrap().contains("process's budget"),
        "{body}"
    );
    let m = metrics(d.admin_addr()).await;
    assert_eq!(
        m.value(
            "balanceroute_decision_in_flight_refusals_total",
            &[("scope", "process")]
        ),
        1.0
    );
    assert_eq!(in_flight_bytes(&d).await, 120_000.0);

    // a small Assign, whole in one write, is placed however full the budget is
    let json = r#"{"group":"g","request_id":"small","prompt_tokens":10}"#;
    let mut c = TcpStream::connect(http).await.unwrap();
    c.write_all(
        format!(
            "POST /v1/assign HTTP/1.1\r\nhost: {http}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{json}",
            json.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let (status, body) = read_response(&mut c).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["worker_id"],
        0
    );

    drop(stalled);
    drop(third);
    eventually(WAIT, "every charge given back", || async {
        in_flight_bytes(&d).await == 0.0
    })
    .await;
    d.stop().await.unwrap();
    snap.kill().await;
}
