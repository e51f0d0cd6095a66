//! br-all, the all-in-one: ingest, snapshot and decision in one process, one gRPC
//! port and one admin port, talking in-process. The real binary with fake workers:
//!
//! * it starts with no flags but its ports (the harness's port 0 and ready file), serves
//!   Telemetry, Snapshot and Decision on one port (health and reflection list all three), and
//!   its admin port exports the three services' metrics and a `/readyz` that says which part
//!   is not ready;
//! * a scripted sequence (telemetry → σ → decision, Assign, idempotent retry, Cancel of a
//!   reservation and of a waiting call, a shim restart with a new incarnation) gives the same
//!   answers and the same σ on br-all as on the split br-snapshot + br-ingest + br-decision;
//! * brctl status and cordon work against its port.
//!
//! Every wait polls a signal (σ, a metric, `/readyz`) with a bound; nothing sleeps to wait.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use br_e2e::{FakeWorker, Service, Split, binaries};
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::{self, AssignRequest, CancelRequest, GetRequest};
use br_testkit::{eventually, within};
use tonic::transport::Channel;

const GROUP: &str = "aio";
const START: Duration = Duration::from_secs(60);
/// A hang guard for one wait on a loaded 2-core machine, not a timing assertion.
const LONG: Duration = Duration::from_secs(30);
/// The σ timings both deployments run with (a restarted shim's old incarnation is fenced
/// after `--worker-grace`).
const SIGMA_FLAGS: [&str; 6] = [
    "--worker-grace",
    "1s",
    "--reservation-ttl",
    "30s",
    "--progress-interval",
    "100ms",
];

/// The control plane either way: where shims, gateways and operators connect, and the admin
/// port of the process that runs decision.
struct Plane {
    telemetry: String,
    snapshot: String,
    decision: String,
    /// The process whose admin port has decision's metrics and readiness.
    decision_admin: usize,
    procs: Vec<Service>,
}

impl Plane {
    fn all_in_one(policy: &str) -> Plane {
        let mut args = SIGMA_FLAGS.to_vec();
        args.extend(["--policy", policy, "--groups", GROUP]);
        let all = Service::start("br-all", &args);
        let url = all.grpc_url();
        Plane {
            telemetry: url.clone(),
            snapshot: url.clone(),
            decision: url,
            decision_admin: 0,
            procs: vec![all],
        }
    }

    async fn split(policy: &str) -> Plane {
        let Split {
            snapshot,
            ingest,
            decision,
        } = Split::start(&SIGMA_FLAGS, &["--policy", policy, "--groups", GROUP]).await;
        Plane {
            telemetry: ingest.grpc_url(),
            snapshot: snapshot.grpc_url(),
            decision: decision.grpc_url(),
            decision_admin: 2,
            procs: vec![snapshot, ingest, decision],
        }
    }

    fn admin(&self) -> &Service {
        &self.procs[self.decision_admin]
    }

    async fn decision(&self) -> DecisionClient<Channel> {
        DecisionClient::connect(self.decision.clone())
            .await
            .expect("decision reachable")
    }

    async fn sigma(&self) -> v1::ClusterSnapshot {
        SnapshotClient::connect(self.snapshot.clone())
            .await
            .expect("snapshot reachable")
            .get(GetRequest {
                group: GROUP.into(),
            })
            .await
            .expect("Get")
            .into_inner()
    }

    async fn metric(&self, name: &str) -> f64 {
        br_testkit::http::metrics_url(&self.admin().admin_url("/metrics"))
            .await
            .sum(name)
    }

    async fn workers(&self, n: u32, capacity: u32) -> Vec<FakeWorker> {
        let mut ws = Vec::new();
        for id in 0..n {
            ws.push(FakeWorker::connect(&self.telemetry, GROUP, id, capacity).await);
        }
        eventually(LONG, "every worker LIVE in σ", || async {
            let s = self.sigma().await;
            s.workers
                .iter()
                .filter(|w| w.liveness == v1::Liveness::Live as i32)
                .count()
                == n as usize
        })
        .await;
        self.admin().wait_for("/readyz", START).await;
        ws
    }

    /// Waits until σ holds exactly what the workers run (telemetry → σ), and decision's
    /// replica has caught up with it (σ → decision).
    async fn settle(&self, workers: &[FakeWorker]) {
        eventually(LONG, "σ equals the workers' ground truth", || async {
            let s = self.sigma().await;
            workers.iter().all(|w| {
                let want: BTreeMap<String, (u32, u32)> = w
                    .running
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|(id, r)| (id.clone(), (r.prompt_tokens, r.generated)))
                    .collect();
                let active: BTreeMap<String, (u32, u32)> = s
                    .requests
                    .iter()
                    .filter(|r| {
                        r.worker_id == w.worker_id && r.state == v1::RequestPhase::Active as i32
                    })
                    .map(|r| (r.request_id.clone(), (r.prompt_tokens, r.generated_tokens)))
                    .collect();
                let live = s.workers.iter().any(|x| {
                    x.worker_id == w.worker_id
                        && x.incarnation == w.incarnation
                        && x.liveness == v1::Liveness::Live as i32
                });
                live && active == want
            })
        })
        .await;
        let version = self.sigma().await.version;
        eventually(LONG, "decision's σ replica caught up", || async {
            self.metric("balanceroute_decision_sigma_version").await >= version as f64
        })
        .await;
    }
}

fn assign_req(id: &str, prompt_tokens: u32, timeout: Duration) -> tonic::Request<AssignRequest> {
    let mut r = tonic::Request::new(AssignRequest {
        group: GROUP.into(),
        request_id: id.into(),
        prompt_tokens,
        prompt_hash: None,
        max_tokens: None,
        expected_output_tokens: None,
        request_class: None,
    });
    r.set_timeout(timeout);
    r
}

/// What a caller can see of an answer, without what depends on timing (σ's version, the
/// pool wait).
fn answer(r: &v1::AssignResponse) -> String {
    format!(
        "worker {} incarnation {:x} policy {} stale {} endpoint {}",
        r.worker_id, r.incarnation, r.policy, r.stale, r.endpoint
    )
}

/// σ as a caller can compare it across deployments: workers (incarnation, liveness,
/// cordon, load) and requests (worker, phase, tokens), without versions and epochs.
fn sigma_view(s: &v1::ClusterSnapshot) -> String {
    let mut out = String::new();
    let mut ws: Vec<_> = s.workers.iter().collect();
    ws.sort_by_key(|w| w.worker_id);
    for w in ws {
        out += &format!(
            "w{} inc {:x} liveness {} cordoned {} load {}; ",
            w.worker_id, w.incarnation, w.liveness, w.cordoned, w.load_tokens
        );
    }
    let mut rs: Vec<_> = s.requests.iter().collect();
    rs.sort_by(|a, b| a.request_id.cmp(&b.request_id));
    for r in rs {
        out += &format!(
            "{}@w{} phase {} {}+{}; ",
            r.request_id, r.worker_id, r.state, r.prompt_tokens, r.generated_tokens
        );
    }
    out
}

/// The scripted sequence, run against either deployment; returns what it saw, in order.
async fn script(plane: &Plane) -> Vec<String> {
    let mut seen = Vec::new();
    let mut ws = plane.workers(3, 2).await;
    ws[0].start("pre-a", 5000).await;
    ws[1].start("pre-b", 3000).await;
    plane.settle(&ws).await;
    let mut d = plane.decision().await;

    // Assign, then the worker runs it: σ follows the telemetry, decision follows σ.
    let x = d
        .assign(assign_req("x", 2000, LONG))
        .await
        .expect("x assigned")
        .into_inner();
    seen.push(format!("x: {}", answer(&x)));
    let reserved = plane.sigma().await;
    let r = reserved.requests.iter().find(|r| r.request_id == "x");
    seen.push(format!(
        "x in σ at once: {:?}",
        r.map(|r| (r.worker_id, r.state))
    ));
    ws[x.worker_id as usize].start("x", 2000).await;
    for w in ws.iter_mut() {
        w.step(5).await;
    }
    plane.settle(&ws).await;
    seen.push(format!("σ: {}", sigma_view(&plane.sigma().await)));

    // A retry of the same id gets the original answer.
    let again = d
        .assign(assign_req("x", 2000, LONG))
        .await
        .expect("retry answered")
        .into_inner();
    seen.push(format!("x again: {}", answer(&again)));

    // A reservation cancelled before the worker reports it is released.
    let y = d
        .assign(assign_req("y", 1000, LONG))
        .await
        .expect("y assigned")
        .into_inner();
    seen.push(format!("y: {}", answer(&y)));
    let out = d
        .cancel(CancelRequest {
            group: GROUP.into(),
            request_id: "y".into(),
        })
        .await
        .expect("cancel y")
        .into_inner();
    seen.push(format!("cancel y: {}", out.outcome));
    // RELEASED is answered once σ has dropped the reservation: the next read shows it gone.
    assert!(
        plane
            .sigma()
            .await
            .requests
            .iter()
            .all(|r| r.request_id != "y"),
        "RELEASED was answered while σ still held y"
    );

    // Every slot taken: a call waits in the pool until cancelled.
    for (i, w) in ws.iter_mut().enumerate() {
        while w.running.lock().unwrap().len() < w.capacity as usize {
            let n = w.running.lock().unwrap().len();
            w.start(&format!("fill-{i}-{n}"), 100).await;
        }
    }
    plane.settle(&ws).await;
    let mut d2 = plane.decision().await;
    let waiting = tokio::spawn(async move { d2.assign(assign_req("wait", 100, LONG)).await });
    eventually(LONG, "the call waits in the pool", || async {
        plane.metric("balanceroute_decision_pool_size").await == 1.0
    })
    .await;
    let out = d
        .cancel(CancelRequest {
            group: GROUP.into(),
            request_id: "wait".into(),
        })
        .await
        .expect("cancel wait")
        .into_inner();
    seen.push(format!("cancel wait: {}", out.outcome));
    let res = within(LONG, "the withdrawn call ends", waiting)
        .await
        .unwrap();
    seen.push(format!(
        "withdrawn call: {:?}",
        res.map(|r| r.into_inner().worker_id).map_err(|s| s.code())
    ));

    // A shim restart: rank 0 comes back as a new incarnation with a free slot; the old
    // incarnation's state is fenced, the new one's requests are what it reports, and the next
    // Assign goes to the new incarnation (the only free slot).
    ws[0].finish("pre-a").await;
    let old = ws[0].incarnation;
    ws[0].reconnect(&plane.telemetry, true, LONG).await;
    seen.push(format!("incarnation changed: {}", ws[0].incarnation != old));
    plane.settle(&ws).await;
    let after = d
        .assign(assign_req("after-restart", 100, LONG))
        .await
        .expect("assigned after the restart")
        .into_inner();
    seen.push(format!("after restart: {}", answer(&after)));
    ws[after.worker_id as usize]
        .start("after-restart", 100)
        .await;
    plane.settle(&ws).await;
    seen.push(format!("σ: {}", sigma_view(&plane.sigma().await)));
    seen
}

/// The direct path gives the answers the split deployment gives, step by step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_in_one_answers_as_the_split_deployment_does() {
    let split = {
        let plane = Plane::split("br0").await;
        script(&plane).await
    };
    let all = {
        let plane = Plane::all_in_one("br0");
        script(&plane).await
    };
    assert_eq!(split.len(), all.len());
    for (s, a) in split.iter().zip(&all) {
        assert_eq!(s, a, "split vs all-in-one");
    }
    // The script saw what it should, not merely the same thing twice.
    let find = |p: &str| all.iter().find(|l| l.starts_with(p)).unwrap().clone();
    assert!(find("x in σ at once").contains(&format!("{}", v1::RequestPhase::Reserved as i32)));
    assert_eq!(find("x again"), find("x: ").replacen("x: ", "x again: ", 1));
    assert_eq!(
        find("cancel y"),
        format!("cancel y: {}", v1::CancelOutcome::Released as i32)
    );
    assert_eq!(
        find("cancel wait"),
        format!("cancel wait: {}", v1::CancelOutcome::Withdrawn as i32)
    );
    assert!(find("withdrawn call").contains("Err"), "{all:#?}");
    assert_eq!(find("incarnation changed"), "incarnation changed: true");
    assert!(
        find("after restart").starts_with("after restart: worker 0 "),
        "{all:#?}"
    );
}

/// One port, one admin port, readiness over the parts, brctl against it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_in_one_serves_one_port_and_one_admin_port() {
    let plane = Plane::all_in_one("br0");
    let all = &plane.procs[0];

    // Bound but not ready: decision has no live worker, and /readyz says it is decision.
    all.wait_for("/livez", START).await;
    eventually(LONG, "decision has σ but no worker", || async {
        let r = reqwest::get(all.admin_url("/readyz")).await.unwrap();
        let code = r.status().as_u16();
        let body = r.text().await.unwrap();
        code == 503 && body.contains("decision: no live worker")
    })
    .await;

    // One port: health and reflection list all three services.
    let ch = Channel::from_shared(all.grpc_url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut listed = br_e2e::reflection::list_v1(ch.clone()).await.unwrap();
    listed.sort();
    for name in [
        "balanceroute.v1.Decision",
        "balanceroute.v1.Snapshot",
        "balanceroute.v1.Telemetry",
        "grpc.health.v1.Health",
    ] {
        assert!(listed.iter().any(|l| l == name), "{name} in {listed:?}");
    }
    let health = tonic_health::pb::health_client::HealthClient::new(ch.clone());
    let status = |svc: &str| {
        let mut h = health.clone();
        let svc = svc.to_owned();
        async move {
            h.check(tonic_health::pb::HealthCheckRequest { service: svc })
                .await
                .unwrap()
                .into_inner()
                .status
        }
    };
    use tonic_health::pb::health_check_response::ServingStatus as S;
    assert_eq!(status("balanceroute.v1.Snapshot").await, S::Serving as i32);
    assert_eq!(status("balanceroute.v1.Telemetry").await, S::Serving as i32);
    assert_eq!(
        status("balanceroute.v1.Decision").await,
        S::NotServing as i32
    );

    // Workers on the same port make it ready, Decision's health included.
    let mut ws = plane.workers(2, 4).await;
    eventually(LONG, "Decision SERVING", || async {
        status("balanceroute.v1.Decision").await == S::Serving as i32
    })
    .await;

    // The admin port exports the three services' metrics (the port's own edge counters are
    // br-all's), and telemetry reached σ and decision through the in-process path.
    let text = all.metrics().await;
    let m = br_testkit::prom::Metrics::parse(&text).unwrap();
    for service in ["snapshot", "ingest", "decision"] {
        for (name, _) in br_testkit::prom::contract(service) {
            // the port's own edge counters are br-all's
            if name.ends_with("_accept_failures_total") || name.ends_with("_oversize_calls_total") {
                continue;
            }
            assert!(
                m.type_of(&name).is_some(),
                "br-all does not export {name} ({service})"
            );
        }
    }
    m.assert_contract("all");
    ws[0].start("r0", 300).await;
    plane.settle(&ws).await;
    assert!(m.sum("balanceroute_ingest_snapshot_connected") >= 1.0);

    // brctl status and cordon against the one port.
    let out = brctl(&plane.snapshot, &["status", GROUP, "--output", "json"]).await;
    assert_eq!(out.0, 0, "{}", out.2);
    let s: serde_json::Value = serde_json::from_str(&out.1).unwrap();
    assert_eq!(s["workers"].as_array().unwrap().len(), 2, "{s}");
    let out = brctl(&plane.snapshot, &["cordon", GROUP, "0"]).await;
    assert_eq!(out.0, 0, "{}", out.2);
    eventually(LONG, "rank 0 cordoned in σ", || async {
        plane
            .sigma()
            .await
            .workers
            .iter()
            .any(|w| w.worker_id == 0 && w.cordoned)
    })
    .await;
    plane.settle(&ws).await;
    // Cordoned: every Assign goes to rank 1, though rank 0 is by far the emptier.
    ws[1].start("r1", 5000).await;
    plane.settle(&ws).await;
    let mut d = plane.decision().await;
    for i in 0..3 {
        let a = d
            .assign(assign_req(&format!("c{i}"), 10, LONG))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(a.worker_id, 1, "a cordoned rank gets nothing");
    }

    // SIGTERM: a clean drain, exit 0.
    drop(ws);
    let mut plane = plane;
    let status = plane.procs[0].terminate(LONG);
    assert_eq!(status.and_then(|s| s.code()), Some(0));
}

/// brctl against `snapshot_addr`: (exit code, stdout, stderr).
async fn brctl(snapshot_addr: &str, args: &[&str]) -> (i32, String, String) {
    let child = tokio::process::Command::new(binaries().join("brctl"))
        .arg("--snapshot-addr")
        .arg(snapshot_addr)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("brctl starts");
    let out = within(LONG, "brctl exits", child.wait_with_output())
        .await
        .expect("brctl output");
    (
        out.status.code().expect("brctl exited"),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// Mutual TLS on the one port: br-all presents a certificate of role `all`, which shims
/// (expecting ingest), gateways (expecting decision) and operators (expecting snapshot) accept;
/// every method admits the roles it admits on the split services, and nobody else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_in_one_applies_the_method_role_table_on_its_one_port() {
    use br_e2e::pki::{Pki, channel};
    use br_proto::v1::telemetry_client::TelemetryClient;
    use br_trust::Role;

    let pki = Pki::new();
    let mut args: Vec<String> = pki.flags(Role::All);
    args.extend(["--groups", GROUP].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let all = Service::start("br-all", &args);
    let url = format!("http://127.0.0.1:{}", all.grpc_port);

    // A worker reports for its own slot, over a channel that expects an ingest server.
    let worker = channel(&url, &pki.worker(GROUP, 0), Some(Role::Ingest));
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tx.send(v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Hello(v1::Hello {
            group: GROUP.into(),
            worker_id: 0,
            incarnation: 7,
            capacity: 4,
            endpoint: "http://127.0.0.1:18000".into(),
        })),
    })
    .await
    .unwrap();
    let mut acks = within(
        LONG,
        "the worker's Report is accepted",
        TelemetryClient::new(worker.clone())
            .report(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
    .await
    .expect("a worker may Report")
    .into_inner();
    within(LONG, "the Hello's ack", acks.message())
        .await
        .expect("an ack")
        .expect("the stream is open");

    // An operator reads σ through a channel that expects a snapshot server.
    let admin = channel(&url, &pki.role(Role::Admin), Some(Role::Snapshot));
    eventually(LONG, "the worker is LIVE in σ", || {
        let admin = admin.clone();
        async move {
            SnapshotClient::new(admin)
                .get(GetRequest {
                    group: GROUP.into(),
                })
                .await
                .is_ok_and(|s| {
                    s.into_inner()
                        .workers
                        .iter()
                        .any(|w| w.liveness == v1::Liveness::Live as i32)
                })
        }
    })
    .await;

    // A gateway is answered, through a channel that expects a decision server.
    let gateway = channel(&url, &pki.role(Role::Gateway), Some(Role::Decision));
    let a = DecisionClient::new(gateway.clone())
        .assign(assign_req("tls-1", 10, LONG))
        .await
        .expect("a gateway may Assign")
        .into_inner();
    assert_eq!(a.worker_id, 0);

    // Everything else is refused, as on the split services.
    let denied = |r: Result<(), tonic::Status>, what: &str| {
        let s = r.expect_err(what);
        assert_eq!(s.code(), tonic::Code::PermissionDenied, "{what}: {s:?}");
    };
    denied(
        DecisionClient::new(worker.clone())
            .assign(assign_req("w", 10, LONG))
            .await
            .map(|_| ()),
        "a worker's Assign",
    );
    denied(
        SnapshotClient::new(gateway.clone())
            .reserve(v1::ReserveRequest {
                group: GROUP.into(),
                ..Default::default()
            })
            .await
            .map(|_| ()),
        "a gateway's Reserve",
    );
    denied(
        SnapshotClient::new(gateway.clone())
            .set_cordon(v1::SetCordonRequest {
                group: GROUP.into(),
                worker_id: 0,
                cordoned: true,
            })
            .await
            .map(|_| ()),
        "a gateway's SetCordon",
    );
    // br-all's own certificate may call nothing: its parts talk in-process.
    let itself = channel(&url, &pki.role(Role::All), Some(Role::Decision));
    denied(
        DecisionClient::new(itself)
            .assign(assign_req("self", 10, LONG))
            .await
            .map(|_| ()),
        "br-all's identity calling Assign",
    );
    let admin_files = pki.role(Role::Admin);
    let (code, text) = br_e2e::pki::https_get(
        all.admin_addr(),
        &admin_files.ca,
        Some(&admin_files),
        "/metrics",
    )
    .await
    .expect("an admin may read /metrics");
    assert_eq!(code, 200);
    let m = br_testkit::prom::Metrics::parse(&text).unwrap();
    assert!(m.sum("balanceroute_all_calls_denied_total") >= 4.0);
    drop(tx);
}
