//! Under mutual TLS a `Cancel` is bound to the identity that assigned the request: br-all with
//! TLS, one worker's telemetry stream, and two gateways with their own certificates
//! (`spiffe://<td>/br/gateway` and a service account mapped to the gateway role by
//! `--spiffe-role-map`). A gateway that knows another's request id is refused
//! PERMISSION_DENIED (counted in `balanceroute_decision_cancel_denied_total`) and σ keeps the
//! reservation; the owner's own Cancel releases it, and so does the admin role's.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use br_e2e::Service;
use br_e2e::pki::{self, Pki, TD};
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::telemetry_client::TelemetryClient;
use br_proto::v1::{self, worker_report};
use br_testkit::{Metrics, eventually, eventually_some, within};
use br_trust::{IdentityReader, Role, RoleMap};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Status};

const GROUP: &str = "g0";
const START: Duration = Duration::from_secs(60);
const CALL: Duration = Duration::from_secs(20);
/// The second gateway: a Kubernetes service account given the gateway role.
const MAP: &str = "br/gateway-b=gateway";

fn reader() -> IdentityReader {
    let map = RoleMap::new([MAP.parse().unwrap()]).unwrap();
    IdentityReader::new(TD).with_role_map(map)
}

async fn report(ch: Channel) -> mpsc::Sender<v1::WorkerReport> {
    let (tx, rx) = mpsc::channel(4);
    let hello = v1::WorkerReport {
        kind: Some(worker_report::Kind::Hello(v1::Hello {
            group: GROUP.into(),
            worker_id: 0,
            incarnation: 0x7a11,
            capacity: 64,
            endpoint: "http://127.0.0.1:18000".into(),
        })),
    };
    tx.send(hello).await.unwrap();
    let mut acks = within(CALL, "the Report stream opens", async {
        TelemetryClient::new(ch)
            .report(ReceiverStream::new(rx))
            .await
            .expect("the worker's Report stream")
            .into_inner()
    })
    .await;
    within(CALL, "the Hello's ack", acks.message())
        .await
        .expect("an ack")
        .expect("an ack, not the end");
    tokio::spawn(async move { while let Ok(Some(_)) = acks.message().await {} });
    tx
}

async fn assign(ch: &Channel, id: &str) -> Result<v1::AssignResponse, Status> {
    let req = v1::AssignRequest {
        group: GROUP.into(),
        request_id: id.into(),
        prompt_tokens: 10,
        ..Default::default()
    };
    within(
        CALL,
        "an Assign",
        DecisionClient::new(ch.clone()).assign(req),
    )
    .await
    .map(tonic::Response::into_inner)
}

async fn cancel(ch: &Channel, id: &str) -> Result<v1::CancelOutcome, Status> {
    let req = v1::CancelRequest {
        group: GROUP.into(),
        request_id: id.into(),
    };
    within(
        CALL,
        "a Cancel",
        DecisionClient::new(ch.clone()).cancel(req),
    )
    .await
    .map(|r| r.into_inner().outcome())
}

/// The ids σ holds for the group (read as the admin).
async fn sigma_ids(admin: &Channel) -> Vec<String> {
    let req = v1::GetRequest {
        group: GROUP.into(),
    };
    let snap = within(
        CALL,
        "Snapshot.Get",
        SnapshotClient::new(admin.clone()).get(req),
    )
    .await
    .expect("σ as the admin")
    .into_inner();
    snap.requests.into_iter().map(|r| r.request_id).collect()
}

async fn denied(all: &Service, pki: &Pki) -> f64 {
    let admin = pki.role(Role::Admin);
    let (code, body) = pki::https_get(all.admin_addr(), &admin.ca, Some(&admin), "/metrics")
        .await
        .expect("/metrics as the admin");
    assert_eq!(code, 200, "{body}");
    let m = Metrics::parse(&body).unwrap();
    m.value(
        "balanceroute_decision_cancel_denied_total",
        &[("group", GROUP)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_cancels_only_what_it_assigned() {
    let pki = Pki::new();
    let mut flags = pki.flags(Role::All);
    flags.extend(["--groups".into(), GROUP.into()]);
    flags.extend(["--spiffe-role-map".into(), MAP.into()]);
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let all = Service::start("br-all", &args);
    let url = all.grpc_url();

    let expect = Some(Role::All);
    let _worker = report(pki::channel(&url, &pki.worker(GROUP, 0), expect)).await;
    let gw_a = pki::channel(&url, &pki.role(Role::Gateway), expect);
    let gw_b = pki::channel_reading(
        &url,
        &pki.service_account("br", "gateway-b"),
        expect,
        reader(),
    );
    let admin = pki::channel(&url, &pki.role(Role::Admin), expect);

    // Gateway A's request, once decision has σ with the live worker.
    eventually_some(START, "gateway A's first Assign is answered", || async {
        assign(&gw_a, "a-1").await.ok()
    })
    .await;
    eventually(START, "σ holds a-1's reservation", || async {
        sigma_ids(&admin).await.contains(&"a-1".to_owned())
    })
    .await;

    // B knows the id, and may not cancel it: typed, counted, σ untouched.
    let err = cancel(&gw_b, "a-1")
        .await
        .expect_err("B cancelling A's request");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("a-1"), "{err:?}");
    assert_eq!(denied(&all, &pki).await, 1.0);
    assert!(
        sigma_ids(&admin).await.contains(&"a-1".to_owned()),
        "a denied Cancel left σ untouched"
    );

    // And the other way round.
    assign(&gw_b, "b-1").await.expect("B's own Assign");
    let err = cancel(&gw_a, "b-1")
        .await
        .expect_err("A cancelling B's request");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert_eq!(denied(&all, &pki).await, 2.0);

    // A retry of A's request by B does not make B its owner.
    let again = assign(&gw_b, "a-1").await.expect("B retrying A's id");
    assert!(again.worker_id == 0, "{again:?}");
    let err = cancel(&gw_b, "a-1").await.expect_err("B after its retry");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");

    // Each owner cancels its own.
    assert_eq!(
        cancel(&gw_a, "a-1").await.expect("A's own Cancel"),
        v1::CancelOutcome::Released
    );
    assert_eq!(
        cancel(&gw_b, "b-1").await.expect("B's own Cancel"),
        v1::CancelOutcome::Released
    );
    eventually(START, "σ released a-1 and b-1", || async {
        let ids = sigma_ids(&admin).await;
        !ids.contains(&"a-1".to_owned()) && !ids.contains(&"b-1".to_owned())
    })
    .await;

    // The admin role (an operator) may cancel any request.
    assign(&gw_a, "a-2").await.expect("A's second Assign");
    assert_eq!(
        cancel(&admin, "a-2").await.expect("the admin's Cancel"),
        v1::CancelOutcome::Released
    );
    assert_eq!(denied(&all, &pki).await, 3.0);
}
