//! Certificates as cert-manager's csi-driver-spiffe issues them (the only URI SAN is
//! `spiffe://<td>/ns/<namespace>/sa/<service account>`), given roles by `--spiffe-role-map`,
//! against the real services with mutual TLS: br-snapshot, br-ingest, br-decision and a br-shim
//! each present a service-account certificate; the map is given as repeated flags, as one
//! comma-separated flag, and as a TOML list in `--config`. Then:
//! * the services reach each other (ingest's Apply and decision's Watch to snapshot, the shim's
//!   Report to ingest): every client checks its server's role through the map too;
//! * a service account mapped `worker/<group>/*` (a StatefulSet's shared account) reports as
//!   any worker of its group, and is denied for another group; one mapped `worker/<group>/<id>`
//!   only as that worker; denials name the role, the identity and the method;
//! * an account the map does not name has no identity (PERMISSION_DENIED naming the flag,
//!   counted as `no_identity`), a mapped gateway may Assign but not Apply, and `br/<role>`
//!   certificates keep working next to mapped ones;
//! * a map that gives an account two roles, or a bare `worker`, stops the binary with exit 2.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use br_e2e::pki::{self, Pki, TD};
use br_e2e::{Service, run_to_exit};
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::telemetry_client::TelemetryClient;
use br_proto::v1::{self, worker_report};
use br_testkit::{Metrics, eventually, eventually_some};
use br_trust::{IdentityReader, Role, RoleMap, TlsFiles};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Status};

const GROUP: &str = "g0";
const OTHER_GROUP: &str = "g1";
/// The control plane's namespace and the decode ranks' namespace.
const NS: &str = "br";
const WORKERS_NS: &str = "br-g0";
const START: Duration = Duration::from_secs(60);
const CALL: Duration = Duration::from_secs(20);

/// The map every process gets (as an operator would put it in one ConfigMap).
const MAP: [&str; 7] = [
    "br/br-snapshot=snapshot",
    "br/br-ingest=ingest",
    "br/br-decision=decision",
    "br/my-gateway=gateway",
    "br/ops=admin",
    "br-g0/decode=worker/g0/*",
    "br-g0/decode-3=worker/g0/3",
];

fn reader() -> IdentityReader {
    let map = RoleMap::new(MAP.map(|e| e.parse().unwrap())).unwrap();
    IdentityReader::new(TD).with_role_map(map)
}

/// The map as one `--spiffe-role-map` per entry.
fn repeated_map_flags() -> Vec<String> {
    MAP.iter()
        .flat_map(|e| ["--spiffe-role-map".to_owned(), (*e).to_owned()])
        .collect()
}

/// The map as one comma-separated flag (the `BALANCEROUTE_SPIFFE_ROLE_MAP` form).
fn joined_map_flag() -> Vec<String> {
    vec!["--spiffe-role-map".into(), MAP.join(",")]
}

fn start(bin: &'static str, args: Vec<String>) -> Service {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    Service::start(bin, &a)
}

fn hello(group: &str, worker_id: u32) -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(worker_report::Kind::Hello(v1::Hello {
            group: group.into(),
            worker_id,
            incarnation: 0x5a00 + u64::from(worker_id),
            capacity: 8,
            endpoint: format!("http://127.0.0.1:{}", 18000 + worker_id),
        })),
    }
}

/// Says Hello as `worker_id` of `group`; `Ok` with the open stream (its sender, to keep it)
/// once the first ack came, the status if the stream was refused.
async fn report(
    ch: Channel,
    group: &str,
    worker_id: u32,
) -> Result<mpsc::Sender<v1::WorkerReport>, Status> {
    let (tx, rx) = mpsc::channel(4);
    tx.send(hello(group, worker_id)).await.unwrap();
    let fut = async {
        let mut acks = TelemetryClient::new(ch)
            .report(ReceiverStream::new(rx))
            .await?
            .into_inner();
        match acks.message().await? {
            Some(_) => {
                // keep reading so the stream stays open while the sender lives
                tokio::spawn(async move { while let Ok(Some(_)) = acks.message().await {} });
                Ok(())
            }
            None => Err(Status::unknown("the Report stream ended without an answer")),
        }
    };
    tokio::time::timeout(CALL, fut)
        .await
        .unwrap_or_else(|_| panic!("Hello as {group}/{worker_id}: no answer within {CALL:?}"))?;
    Ok(tx)
}

fn assign_req(id: &str) -> v1::AssignRequest {
    v1::AssignRequest {
        group: GROUP.into(),
        request_id: id.into(),
        prompt_tokens: 10,
        ..Default::default()
    }
}

async fn assign(ch: Channel, id: &str) -> Result<v1::AssignResponse, Status> {
    let mut client = DecisionClient::new(ch);
    tokio::time::timeout(CALL, client.assign(assign_req(id)))
        .await
        .unwrap_or_else(|_| panic!("Assign {id}: no answer within {CALL:?}"))
        .map(tonic::Response::into_inner)
}

async fn sigma_workers(admin: Channel) -> Option<Vec<u32>> {
    let req = v1::GetRequest {
        group: GROUP.into(),
    };
    let s = SnapshotClient::new(admin).get(req).await.ok()?.into_inner();
    let mut ids: Vec<u32> = s.workers.iter().map(|w| w.worker_id).collect();
    ids.sort_unstable();
    Some(ids)
}

fn denied(what: &str, got: Result<impl std::fmt::Debug, Status>) -> Status {
    match got {
        Ok(v) => panic!("{what} was let through: {v:?}"),
        Err(s) => {
            assert_eq!(s.code(), Code::PermissionDenied, "{what}: {s:?}");
            s
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_account_ids_get_the_roles_the_map_gives_and_no_more() {
    let pki = Pki::new();
    let sa = |ns: &str, name: &str| pki.service_account(ns, name);
    let id = |ns: &str, name: &str| br_trust::service_account_id(TD, ns, name);

    // snapshot: the map as repeated flags
    let mut args = pki::tls_flags(&sa(NS, "br-snapshot"));
    args.extend(repeated_map_flags());
    args.extend(["--worker-grace".into(), "60s".into()]);
    let snapshot = start("br-snapshot", args);
    let snap_url = snapshot.grpc_url();

    // ingest: the map as a TOML list in --config
    let toml = format!(
        "spiffe_role_map = [{}]\n",
        MAP.iter()
            .map(|e| format!("{e:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let config = pki.path("ingest.toml");
    std::fs::write(&config, toml).unwrap();
    let mut args = pki::tls_flags(&sa(NS, "br-ingest"));
    args.extend([
        "--config".into(),
        config.to_string_lossy().into_owned(),
        "--snapshot-addr".into(),
        snap_url.clone(),
    ]);
    let ingest = start("br-ingest", args);
    let ingest_url = ingest.grpc_url();

    // decision: the map as one comma-separated flag
    let mut args = pki::tls_flags(&sa(NS, "br-decision"));
    args.extend(joined_map_flag());
    args.extend(
        [
            "--snapshot-addr",
            &snap_url,
            "--groups",
            GROUP,
            "--policy",
            "jsq",
        ]
        .map(str::to_owned),
    );
    let decision = start("br-decision", args);

    // a real shim, rank 1 of the StatefulSet whose pods share the account br-g0/decode
    let mut args = pki::tls_flags(&sa(WORKERS_NS, "decode"));
    args.extend(repeated_map_flags());
    args.extend(
        [
            "--upstream",
            "http://127.0.0.1:1",
            // no engine here: in routing without one (a probed shim says Hello only once its
            // engine answers)
            "--engine-probe-interval",
            "0s",
            "--ingest-addr",
            &ingest_url,
            "--group",
            GROUP,
            "--worker-id",
            "1",
            "--capacity",
            "64",
        ]
        .map(str::to_owned),
    );
    let _shim = start("br-shim", args);

    // the operator reads σ with a mapped admin account; Prometheus-style scrapes with br/admin
    let admin = pki::channel_reading(&snap_url, &sa(NS, "ops"), Some(Role::Snapshot), reader());
    eventually(START, "σ shows the shim's worker 1", || {
        let c = admin.clone();
        async move { sigma_workers(c).await == Some(vec![1]) }
    })
    .await;

    // -- workers --
    let worker_ch =
        |files: &TlsFiles| pki::channel_reading(&ingest_url, files, Some(Role::Ingest), reader());
    let shared = worker_ch(&sa(WORKERS_NS, "decode"));
    // another rank of the same set: the shared account says so, unproven but admitted
    let _rank0 = report(shared.clone(), GROUP, 0)
        .await
        .unwrap_or_else(|s| panic!("rank 0 with the shared account: {s:?}"));
    // the group is still proven
    let s = denied(
        "the shared account reporting for another group",
        report(shared.clone(), OTHER_GROUP, 0).await,
    );
    let msg = s.message();
    for part in [
        "role worker ".to_owned(),
        id(WORKERS_NS, "decode"),
        "/balanceroute.v1.Telemetry/Report".to_owned(),
        format!("any worker of group \"{GROUP}\""),
    ] {
        assert!(msg.contains(&part), "the denial names {part:?}: {msg}");
    }
    // an account bound to one rank reports only as that rank
    let rank3 = worker_ch(&sa(WORKERS_NS, "decode-3"));
    let s = denied(
        "decode-3 reporting as rank 2",
        report(rank3.clone(), GROUP, 2).await,
    );
    assert!(
        s.message().contains(&format!("group \"{GROUP}\" worker 3")),
        "{s:?}"
    );
    let _rank3 = report(rank3, GROUP, 3)
        .await
        .unwrap_or_else(|s| panic!("decode-3 as rank 3: {s:?}"));
    eventually(START, "σ shows workers 0, 1 and 3", || {
        let c = admin.clone();
        async move { sigma_workers(c).await == Some(vec![0, 1, 3]) }
    })
    .await;

    // -- gateways --
    let dec_url = decision.grpc_url();
    let gateway = pki::channel_reading(
        &dec_url,
        &sa(NS, "my-gateway"),
        Some(Role::Decision),
        reader(),
    );
    let answer = eventually_some(START, "decision answers the mapped gateway", || {
        let g = gateway.clone();
        async move { assign(g, "sa-gw-1").await.ok() }
    })
    .await;
    assert!([0, 1, 3].contains(&answer.worker_id), "{answer:?}");
    // the same certificate may not touch σ
    let gw_on_snapshot = pki::channel_reading(
        &snap_url,
        &sa(NS, "my-gateway"),
        Some(Role::Snapshot),
        reader(),
    );
    let get = SnapshotClient::new(gw_on_snapshot)
        .get(v1::GetRequest {
            group: GROUP.into(),
        })
        .await;
    let s = denied("the mapped gateway calling Snapshot.Get", get);
    assert!(
        s.message().contains("role gateway ")
            && s.message().contains(&id(NS, "my-gateway"))
            && s.message().contains("/balanceroute.v1.Snapshot/Get"),
        "{s:?}"
    );
    // a br/<role> certificate works as before, next to the mapped ones
    let br_gateway = pki::channel_reading(
        &dec_url,
        &pki.role(Role::Gateway),
        Some(Role::Decision),
        reader(),
    );
    assign(br_gateway, "br-gw-1")
        .await
        .unwrap_or_else(|s| panic!("a br/gateway certificate: {s:?}"));

    // -- an account the map does not name: no identity, on every port --
    let denials_before = scrape(&decision, &pki).await;
    let stranger = sa(NS, "stranger");
    let ch = pki::channel_reading(&dec_url, &stranger, Some(Role::Decision), reader());
    let s = denied("an unmapped account calling Assign", assign(ch, "x").await);
    assert!(
        s.message().contains(&id(NS, "stranger")) && s.message().contains("--spiffe-role-map"),
        "the denial says what is missing: {s:?}"
    );
    let ch = pki::channel_reading(&ingest_url, &stranger, Some(Role::Ingest), reader());
    denied(
        "an unmapped account saying Hello",
        report(ch, GROUP, 5).await,
    );
    let denials_after = scrape(&decision, &pki).await;
    let no_identity = |m: &Metrics| {
        m.get(
            "balanceroute_decision_calls_denied_total",
            &[("reason", "no_identity")],
        )
        .unwrap_or(0.0)
    };
    assert_eq!(
        no_identity(&denials_after) - no_identity(&denials_before),
        1.0,
        "the unmapped Assign is counted as no_identity"
    );

    // -- nothing the denied calls claimed reached σ --
    assert_eq!(
        sigma_workers(admin.clone()).await,
        Some(vec![0, 1, 3]),
        "σ holds exactly the admitted workers"
    );
}

/// decision's /metrics, scraped with a br/admin certificate (reading decision's service-account
/// certificate through the map).
async fn scrape(decision: &Service, pki: &Pki) -> Metrics {
    let (code, body) = pki::https_get_reading(
        decision.admin_addr(),
        &pki.path("ca.pem"),
        Some(&pki.role(Role::Admin)),
        "/metrics",
        reader(),
    )
    .await
    .unwrap();
    assert_eq!(code, 200, "{body}");
    Metrics::parse(&body).unwrap()
}

/// Runs `bin` on loopback ports with `flags` until it exits by itself; its exit code and stderr.
fn refused_start(bin: &str, flags: &[String]) -> (Option<i32>, String) {
    let mut args: Vec<String> = ["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]
        .map(String::from)
        .into();
    args.extend_from_slice(flags);
    let (status, stderr) = run_to_exit(bin, &args);
    (status.code(), stderr)
}

#[test]
fn a_map_that_gives_an_account_two_roles_or_every_worker_stops_the_binary() {
    let pki = Pki::new();
    let mut flags = pki.flags(Role::Ingest);
    flags.extend(["--spiffe-role-map".into(), "br/a=ingest,br/a=admin".into()]);
    let (code, stderr) = refused_start("br-ingest", &flags);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--spiffe-role-map") && stderr.contains("br/a"),
        "{stderr}"
    );

    let mut flags = pki.flags(Role::Ingest);
    flags.extend(["--spiffe-role-map".into(), "br-g0/decode=worker".into()]);
    let (code, stderr) = refused_start("br-ingest", &flags);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("worker/<group>/*"), "{stderr}");
}
