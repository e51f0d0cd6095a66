//! brctl against the real services: `status` lists groups and ranks, `cordon` takes
//! a rank out of routing while its requests go on, the cordon survives the rank's shim
//! restarting, `drain` waits for the rank's requests and exits 3 when they outlast its
//! timeout, `uncordon` brings the rank back, and bad input gets a clear error and exit 1.
//!
//! The gateway is br-client's `AssignClient` on a br-decision running JSQ (deterministic: the
//! least-loaded rank), the ranks are fake workers on ingest's telemetry stream.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Stdio;
use std::time::Duration;

use br_client::assign::{AssignClient, AssignParams};
use br_e2e::pki::Pki;
use br_e2e::{FakeWorker, Service, binaries};
use br_proto::v1;
use br_testkit::eventually;
use br_trust::Role;
use tokio::io::{AsyncBufReadExt as _, BufReader};

const GROUP: &str = "ops";
const START: Duration = Duration::from_secs(30);
/// A hang guard for one brctl run, not a timing assertion.
const RUN: Duration = Duration::from_secs(60);

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn brctl(snapshot: &Service, args: &[&str]) -> Out {
    brctl_at(&snapshot.grpc_url(), &[], args).await
}

/// brctl against `snapshot_addr`, with `flags` (TLS) before the command's `args`.
async fn brctl_at(snapshot_addr: &str, flags: &[String], args: &[&str]) -> Out {
    let child = tokio::process::Command::new(binaries().join("brctl"))
        .arg("--snapshot-addr")
        .arg(snapshot_addr)
        .args(flags)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("brctl starts");
    let out = tokio::time::timeout(RUN, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("brctl {args:?} still running after {RUN:?}"))
        .expect("brctl output");
    Out {
        code: out.status.code().expect("brctl exited, not killed"),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

async fn status_json(snapshot: &Service) -> serde_json::Value {
    let out = brctl(snapshot, &["status", GROUP, "--output", "json"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    serde_json::from_str(&out.stdout).expect("status JSON")
}

fn worker(status: &serde_json::Value, id: u64) -> &serde_json::Value {
    status["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == id)
        .unwrap_or_else(|| panic!("worker {id} in {status}"))
}

async fn sigma(snapshot: &Service) -> v1::ClusterSnapshot {
    let mut c = v1::snapshot_client::SnapshotClient::connect(snapshot.grpc_url())
        .await
        .unwrap();
    c.get(v1::GetRequest {
        group: GROUP.into(),
    })
    .await
    .unwrap()
    .into_inner()
}

/// Waits until `decision`'s replica of σ holds `version` (its sigma_version gauge).
async fn decision_caught_up(decision: &Service, version: u64, what: &str) {
    eventually(START, what, || async {
        br_testkit::http::metrics_url(&decision.admin_url("/metrics"))
            .await
            .get("balanceroute_decision_sigma_version", &[("group", GROUP)])
            .is_some_and(|v| v >= version as f64)
    })
    .await;
}

/// Assigns one request; its rank.
async fn assign(client: &AssignClient, id: &str) -> u32 {
    client
        .assign_within(&AssignParams::new(GROUP, id, 100), Duration::from_secs(20))
        .await
        .unwrap_or_else(|e| panic!("assign {id}: {e}"))
        .worker_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cordon_drain_and_uncordon_a_rank_with_brctl() {
    let snapshot = Service::start(
        "br-snapshot",
        &["--worker-grace", "2s", "--reservation-ttl", "30s"],
    );
    snapshot.wait_for("/livez", START).await;
    let snap = snapshot.grpc_url();
    // no group yet (decision's Watch will create it): said plainly
    let out = brctl(&snapshot, &["status"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("no group"), "{}", out.stdout);
    let ingest = Service::start("br-ingest", &["--snapshot-addr", &snap]);
    let decision = Service::start(
        "br-decision",
        &[
            "--snapshot-addr",
            &snap,
            "--policy",
            "jsq",
            "--groups",
            GROUP,
        ],
    );
    ingest.wait_for("/readyz", START).await;

    let mut ws = Vec::new();
    for id in 0..3 {
        ws.push(FakeWorker::connect(&ingest.grpc_url(), GROUP, id, 8).await);
    }
    eventually(START, "3 live ranks", || async {
        sigma(&snapshot)
            .await
            .workers
            .iter()
            .filter(|w| w.liveness == v1::Liveness::Live as i32)
            .count()
            == 3
    })
    .await;
    decision.wait_for("/readyz", START).await;

    let out = brctl(&snapshot, &["status"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains(GROUP), "{}", out.stdout);
    let out = brctl(&snapshot, &["status", "--output", "json"]).await;
    let groups: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(groups[0]["group"], GROUP);
    assert_eq!(
        (
            groups[0]["workers"].clone(),
            groups[0]["live_workers"].clone()
        ),
        (3.into(), 3.into())
    );

    // rank 1 runs a request, then is cordoned
    let client = AssignClient::connect_lazy(decision.grpc_url()).unwrap();
    let first = assign(&client, "before-0").await;
    ws[first as usize].start("before-0", 100).await;
    let busy = first;
    let out = brctl(&snapshot, &["cordon", GROUP, &busy.to_string()]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("cordoned"), "{}", out.stdout);
    let again = brctl(&snapshot, &["cordon", GROUP, &busy.to_string()]).await;
    assert!(
        again.stdout.contains("already"),
        "idempotent: {}",
        again.stdout
    );
    let s = status_json(&snapshot).await;
    let w = worker(&s, busy.into());
    assert_eq!(
        (w["liveness"].as_str(), w["cordoned"].as_bool()),
        (Some("live"), Some(true))
    );
    assert_eq!(w["running"], 1, "its request goes on: {s}");
    let table = brctl(&snapshot, &["status", GROUP]).await.stdout;
    assert!(table.contains("live,cordoned"), "{table}");

    // the decision replicas beside σ: policy, readiness, pool; an unreachable one says why
    let admins = format!(
        "{},http://127.0.0.1:1",
        decision.admin_url("").trim_end_matches('/')
    );
    let out = brctl(
        &snapshot,
        &[
            "status",
            GROUP,
            "--decision-admin",
            &admins,
            "--output",
            "json",
        ],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let s: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let d = &s["decision"];
    assert_eq!(
        (d[0]["policy"].as_str(), d[0]["ready"].as_bool()),
        (Some("jsq"), Some(true)),
        "{s}"
    );
    assert_eq!(d[0]["pool"], 0, "{s}");
    assert!(d[0]["sigma_version"].as_u64().unwrap() > 0, "{s}");
    assert_eq!(d[0]["stale"], false, "{s}");
    assert!(d[1]["error"].as_str().is_some_and(|e| !e.is_empty()), "{s}");
    let table = brctl(&snapshot, &["status", GROUP, "--decision-admin", &admins])
        .await
        .stdout;
    assert!(
        table.contains("jsq") && table.contains("unreadable"),
        "{table}"
    );

    // new work avoids it, though it is not the least loaded once others fill up
    decision_caught_up(
        &decision,
        sigma(&snapshot).await.version,
        "decision sees the cordon",
    )
    .await;
    for i in 0..6 {
        let id = format!("during-{i}");
        let w = assign(&client, &id).await;
        assert_ne!(w, busy, "{id} went to the cordoned rank");
        ws[w as usize].start(&id, 100).await;
    }

    // drain: waits for the request, and outlasting its timeout is exit 3 (the cordon stays)
    let out = brctl(
        &snapshot,
        &[
            "drain",
            GROUP,
            &busy.to_string(),
            "--timeout",
            "300ms",
            "--poll",
            "50ms",
        ],
    )
    .await;
    assert_eq!(out.code, 3, "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("still holds 1"), "{}", out.stdout);
    let mut drain = tokio::process::Command::new(binaries().join("brctl"))
        .args([
            "--snapshot-addr",
            &snap,
            "drain",
            GROUP,
            &busy.to_string(),
            "--timeout",
            "60s",
            "--poll",
            "50ms",
        ])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(drain.stdout.take().unwrap()).lines();
    // the drain has seen the request before it finishes
    tokio::time::timeout(RUN, async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if l.contains("1 requests left") {
                return;
            }
        }
        panic!("drain ended without reporting the running request");
    })
    .await
    .expect("drain reports the request left");
    ws[busy as usize].finish("before-0").await;
    let status = tokio::time::timeout(RUN, drain.wait())
        .await
        .expect("drain ends")
        .unwrap();
    let rest: Vec<String> = {
        let mut v = Vec::new();
        while let Ok(Some(l)) = lines.next_line().await {
            v.push(l);
        }
        v
    };
    assert!(status.success(), "drain: {status:?} {rest:?}");
    assert!(rest.iter().any(|l| l.contains("drained")), "{rest:?}");

    // the cordon belongs to the rank: its shim restarting (a new incarnation) keeps it
    let before = worker(&status_json(&snapshot).await, busy.into())["incarnation"].clone();
    ws[busy as usize]
        .reconnect(&ingest.grpc_url(), true, START)
        .await;
    eventually(START, "the new incarnation is in σ", || async {
        worker(&status_json(&snapshot).await, busy.into())["incarnation"] != before
    })
    .await;
    let s = status_json(&snapshot).await;
    assert_eq!(worker(&s, busy.into())["cordoned"], true, "{s}");

    // uncordon: the empty rank is the least loaded, so JSQ sends the next request there
    let out = brctl(&snapshot, &["uncordon", GROUP, &busy.to_string()]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    decision_caught_up(
        &decision,
        sigma(&snapshot).await.version,
        "decision sees the uncordon",
    )
    .await;
    assert_eq!(assign(&client, "after-0").await, busy);

    // requests: the rank's list, as a table and as JSON
    let out = brctl(&snapshot, &["requests", GROUP, "0", "--output", "json"]).await;
    let rows: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let truth = ws[0].running.lock().unwrap().len();
    assert!(rows.as_array().unwrap().iter().all(|r| r["worker_id"] == 0));
    assert!(
        rows.as_array().unwrap().len() >= truth,
        "{rows} vs {truth} running"
    );

    // watch off a terminal prints the status at each refresh
    let out = brctl(
        &snapshot,
        &["watch", GROUP, "--interval", "50ms", "--count", "2"],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout.matches("group ops").count(), 2, "{}", out.stdout);

    // bad input: typed errors, exit 1 (2 for usage)
    let out = brctl(&snapshot, &["cordon", GROUP, "9"]).await;
    assert_eq!(out.code, 1);
    assert!(
        out.stderr.contains("NotFound") && out.stderr.contains("worker 9"),
        "{}",
        out.stderr
    );
    let out = brctl(&snapshot, &["cordon", GROUP, "5000"]).await;
    assert_eq!(out.code, 1);
    assert!(out.stderr.contains("InvalidArgument"), "{}", out.stderr);
    let out = brctl(&snapshot, &["cordon", GROUP]).await;
    assert_eq!(out.code, 2, "usage: {}", out.stderr);
    let mut dead = Service::start("br-snapshot", &[]);
    let dead_addr = dead.grpc_url();
    dead.kill();
    let out = tokio::time::timeout(
        RUN,
        tokio::process::Command::new(binaries().join("brctl"))
            .args([
                "--snapshot-addr",
                &dead_addr,
                "--call-timeout",
                "2s",
                "status",
            ])
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Unavailable") && err.contains("--snapshot-addr"),
        "{err}"
    );
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_mutual_tls_brctl_needs_the_admin_role() {
    let pki = Pki::new();
    // started: the ready file names the bound ports (the admin ports need a client
    // certificate, so the plaintext readiness wait does not apply)
    let snapshot = Service::start("br-snapshot", &strs(&pki.flags(Role::Snapshot)));
    let snap = snapshot.grpc_url();
    let mut decision_flags = pki.flags(Role::Decision);
    decision_flags.extend(
        [
            "--snapshot-addr",
            &snap,
            "--policy",
            "br0",
            "--groups",
            GROUP,
        ]
        .map(String::from),
    );
    let decision = Service::start("br-decision", &strs(&decision_flags));

    // the admin certificate reads σ and the decision replica's admin port
    let admin = pki.flags(Role::Admin);
    let https_admin = format!("https://127.0.0.1:{}", decision.admin_port);
    let out = brctl_at(
        &snap,
        &admin,
        &[
            "status",
            GROUP,
            "--decision-admin",
            &https_admin,
            "--output",
            "json",
        ],
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let s: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(s["decision"][0]["policy"], "br0", "{s}");
    assert!(s["decision"][0]["error"].is_null(), "{s}");

    // a gateway's certificate may not list groups or cordon
    let gateway = pki.flags(Role::Gateway);
    let out = brctl_at(&snap, &gateway, &["status"]).await;
    assert_eq!(out.code, 1);
    assert!(
        out.stderr.contains("PermissionDenied") && out.stderr.contains("role admin"),
        "{}",
        out.stderr
    );
    let out = brctl_at(&snap, &gateway, &["cordon", GROUP, "0"]).await;
    assert_eq!(out.code, 1);
    assert!(out.stderr.contains("PermissionDenied"), "{}", out.stderr);
    // no certificate: the server refuses the handshake, and brctl says which flags to pass
    let out = brctl_at(&snap, &[], &["status"]).await;
    assert_eq!(out.code, 1, "{}", out.stdout);
    assert!(
        out.stderr.contains("is the server using TLS") && out.stderr.contains("--tls-cert"),
        "{}",
        out.stderr
    );

    // an https:// address: the TLS comes from the certificate, so it works as http:// does ...
    let https_snap = snap.replacen("http://", "https://", 1);
    let out = brctl_at(&https_snap, &admin, &["status", GROUP, "--output", "json"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let s: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(s["group"], GROUP, "{s}");
    // ... and without one it is refused before dialling, saying what is missing
    let out = brctl_at(&https_snap, &[], &["status"]).await;
    assert_eq!(out.code, 1, "{}", out.stdout);
    assert!(
        out.stderr.contains("asks for TLS") && out.stderr.contains("--tls-cert"),
        "{}",
        out.stderr
    );
}
