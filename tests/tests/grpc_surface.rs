//! What each real binary's gRPC port says about itself: reflection v1 and v1alpha
//! both answer, each port lists only its own service (plus health and reflection), and a call
//! of a service served on another port answers UNIMPLEMENTED naming that service and the
//! binary that serves it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use br_e2e::{Service, Split, reflection};
use br_proto::v1;
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::telemetry_client::TelemetryClient;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

const GROUP: &str = "surface";
const CALL: Duration = Duration::from_secs(20);

fn channel(s: &Service) -> Channel {
    Endpoint::from_shared(s.grpc_url())
        .unwrap()
        .timeout(CALL)
        .connect_lazy()
}

/// The names a port must list: its own service, health, both reflections.
fn own(service: &str) -> Vec<String> {
    let mut v: Vec<String> = [
        service,
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    ]
    .map(String::from)
    .to_vec();
    v.sort_unstable();
    v
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort_unstable();
    v
}

/// UNIMPLEMENTED, naming the service called and the binary that serves it.
fn served_elsewhere(r: Result<(), tonic::Status>, service: &str, bin: &str, port: &str) {
    let status = r.expect_err("a call of a service this port does not serve");
    assert_eq!(status.code(), Code::Unimplemented, "{port}: {status:?}");
    let msg = status.message();
    assert!(
        msg.contains(service),
        "{port}: the message names {service}: {msg}"
    );
    assert!(msg.contains(bin), "{port}: the message names {bin}: {msg}");
}

async fn get(ch: Channel) -> Result<(), tonic::Status> {
    let req = v1::GetRequest {
        group: GROUP.into(),
    };
    SnapshotClient::new(ch).get(req).await.map(drop)
}

async fn assign(ch: Channel) -> Result<(), tonic::Status> {
    let req = v1::AssignRequest {
        group: GROUP.into(),
        request_id: "r".into(),
        prompt_tokens: 1,
        ..Default::default()
    };
    DecisionClient::new(ch).assign(req).await.map(drop)
}

async fn report(ch: Channel) -> Result<(), tonic::Status> {
    let hello = v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Hello(v1::Hello {
            group: GROUP.into(),
            worker_id: 0,
            incarnation: 1,
            capacity: 1,
            endpoint: String::new(),
        })),
    };
    let mut acks = TelemetryClient::new(ch)
        .report(tokio_stream::iter([hello]))
        .await?
        .into_inner();
    acks.message().await.map(drop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_port_lists_only_its_own_service_and_points_elsewhere_for_the_rest() {
    let Split {
        snapshot,
        ingest,
        decision,
    } = Split::start(&[], &["--groups", GROUP]).await;
    let ports = [
        ("br-snapshot", &snapshot, "balanceroute.v1.Snapshot"),
        ("br-ingest", &ingest, "balanceroute.v1.Telemetry"),
        ("br-decision", &decision, "balanceroute.v1.Decision"),
    ];
    for (name, svc, service) in ports {
        let ch = channel(svc);
        let v1 = reflection::list_v1(ch.clone()).await;
        let v1 = v1.unwrap_or_else(|e| panic!("{name}: reflection v1: {e:?}"));
        assert_eq!(sorted(v1), own(service), "{name}: reflection v1");
        let alpha = reflection::list_v1alpha(ch.clone()).await;
        let alpha = alpha.unwrap_or_else(|e| panic!("{name}: reflection v1alpha: {e:?}"));
        assert_eq!(sorted(alpha), own(service), "{name}: reflection v1alpha");
    }

    let (snap, ing, dec) = (channel(&snapshot), channel(&ingest), channel(&decision));
    let decision_svc = "balanceroute.v1.Decision/Assign";
    let snapshot_svc = "balanceroute.v1.Snapshot/Get";
    let telemetry_svc = "balanceroute.v1.Telemetry/Report";
    served_elsewhere(
        assign(snap.clone()).await,
        decision_svc,
        "br-decision",
        "br-snapshot",
    );
    served_elsewhere(
        report(snap).await,
        telemetry_svc,
        "br-ingest",
        "br-snapshot",
    );
    served_elsewhere(
        get(ing.clone()).await,
        snapshot_svc,
        "br-snapshot",
        "br-ingest",
    );
    served_elsewhere(assign(ing).await, decision_svc, "br-decision", "br-ingest");
    served_elsewhere(
        get(dec.clone()).await,
        snapshot_svc,
        "br-snapshot",
        "br-decision",
    );
    served_elsewhere(report(dec).await, telemetry_svc, "br-ingest", "br-decision");
}

/// The br-snapshot binary serves ReserveStream beside Reserve (one stream instead of
/// a unary call per tick): a call is answered by its id with what Reserve answers, and a bad
/// one with its error while the stream goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_snapshot_binary_answers_reserve_calls_on_one_stream_like_reserve() {
    let snapshot = Service::start("br-snapshot", &[]);
    let reservation = |group: &str| v1::ReserveRequest {
        group: group.into(),
        reservations: vec![v1::Reservation {
            request_id: "r".into(),
            worker_id: 0,
            incarnation: 1,
            prompt_tokens: 1,
            ..Default::default()
        }],
    };
    let unary = SnapshotClient::new(channel(&snapshot))
        .reserve(reservation(GROUP))
        .await
        .unwrap()
        .into_inner();
    let calls = [2u64, 1].map(|id| v1::ReserveCall {
        call_id: id,
        request: Some(reservation(if id == 1 { GROUP } else { "" })),
        ..Default::default()
    });
    let mut answers = SnapshotClient::new(channel(&snapshot))
        .reserve_stream(futures::stream::iter(calls))
        .await
        .unwrap()
        .into_inner();
    let mut got = Vec::new();
    while let Some(r) = answers.message().await.unwrap() {
        got.push(r);
    }
    got.sort_by_key(|r| r.call_id);
    use v1::reserve_result::Outcome;
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0].outcome, Some(Outcome::Response(unary)), "{got:?}");
    let Some(Outcome::Error(e)) = &got[1].outcome else {
        panic!("{got:?}")
    };
    assert_eq!(e.code, Code::InvalidArgument as i32, "{e:?}");
}
