//! The control plane with mutual TLS on, as real processes: certificates from br-certs, each
//! service with its own role, a worker with its own worker certificate, a gateway. Then the
//! attacks an unauthenticated network allowed before, each of which must now fail
//! with a typed status and leave σ untouched.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use br_e2e::Service;
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::telemetry_client::TelemetryClient;
use br_proto::v1::{self, worker_report};
use br_testkit::eventually_some;
use br_trust::{Role, TlsFiles, TlsMaterial};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

const GROUP: &str = "e2e";
const TD: &str = "balanceroute.local";
const START: Duration = Duration::from_secs(60);

struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca = br_certs::Ca::new("e2e CA").unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.cert_pem()).unwrap();
        for role in [
            Role::Ingest,
            Role::Snapshot,
            Role::Decision,
            Role::Gateway,
            Role::Admin,
        ] {
            let issued = ca.issue_role(TD, role).unwrap();
            br_certs::write(dir.path(), &br_certs::role_files(role), &issued).unwrap();
        }
        for id in 0..2 {
            let issued = ca.issue_worker(TD, GROUP, id).unwrap();
            br_certs::write(dir.path(), &br_certs::worker_files(GROUP, id), &issued).unwrap();
        }
        Pki { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn files(&self, names: (String, String)) -> TlsFiles {
        TlsFiles {
            cert: self.path(&names.0),
            key: self.path(&names.1),
            ca: self.path("ca.pem"),
        }
    }

    fn role(&self, role: Role) -> TlsFiles {
        self.files(br_certs::role_files(role))
    }

    fn worker(&self, id: u32) -> TlsFiles {
        self.files(br_certs::worker_files(GROUP, id))
    }

    fn flags(&self, role: Role) -> Vec<String> {
        let f = self.role(role);
        let s = |p: &Path| p.to_string_lossy().into_owned();
        vec![
            "--tls-cert".into(),
            s(&f.cert),
            "--tls-key".into(),
            s(&f.key),
            "--tls-ca".into(),
            s(&f.ca),
        ]
    }
}

async fn channel(url: &str, files: TlsFiles, expect: Option<Role>) -> Channel {
    let material = TlsMaterial::load(files, TD).unwrap();
    let endpoint = Endpoint::from_shared(url.to_owned()).unwrap();
    br_trust::tls::connect_lazy(endpoint, Some(&material), expect)
}

fn hello(worker_id: u32) -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(worker_report::Kind::Hello(v1::Hello {
            group: GROUP.into(),
            worker_id,
            incarnation: 77,
            capacity: 8,
            endpoint: format!("http://127.0.0.1:{}", 18000 + worker_id),
        })),
    }
}

/// Opens a telemetry stream and says Hello; returns the first answer (ack or ending status)
/// and the sender that keeps the stream open.
async fn say_hello(
    ch: Channel,
    worker_id: u32,
) -> (
    Result<v1::ReportAck, tonic::Status>,
    mpsc::Sender<v1::WorkerReport>,
) {
    let (tx, rx) = mpsc::channel(8);
    tx.send(hello(worker_id)).await.unwrap();
    let first = match TelemetryClient::new(ch)
        .report(ReceiverStream::new(rx))
        .await
    {
        Err(s) => Err(s),
        Ok(r) => {
            let mut acks = r.into_inner();
            let next = tokio::time::timeout(START, acks.message()).await;
            match next.expect("an answer to the Hello") {
                Ok(Some(ack)) => {
                    // keep reading acks so the stream stays open
                    tokio::spawn(async move { while let Ok(Some(_)) = acks.message().await {} });
                    Ok(ack)
                }
                Ok(None) => Err(tonic::Status::unknown("stream ended without a status")),
                Err(s) => Err(s),
            }
        }
    };
    (first, tx)
}

async fn sigma(ch: Channel) -> Result<v1::ClusterSnapshot, tonic::Status> {
    let req = v1::GetRequest {
        group: GROUP.into(),
    };
    SnapshotClient::new(ch)
        .get(req)
        .await
        .map(|r| r.into_inner())
}

fn assign_req(id: &str) -> v1::AssignRequest {
    v1::AssignRequest {
        group: GROUP.into(),
        request_id: id.into(),
        prompt_tokens: 100,
        ..Default::default()
    }
}

/// br-snapshot (with `snapshot_extra` flags), br-ingest and br-decision (policy jsq, group
/// GROUP), each with its own role's certificate; ingest and decision dial the snapshot service
/// at `dial(its URL)`.
fn control_plane(
    pki: &Pki,
    snapshot_extra: &[&str],
    dial: impl Fn(String) -> String,
) -> (Service, Service, Service) {
    let flags = |role| pki.flags(role);
    let snap_flags = [
        flags(Role::Snapshot),
        snapshot_extra.iter().map(|f| (*f).to_owned()).collect(),
    ]
    .concat();
    let snapshot = Service::start("br-snapshot", &arg(&snap_flags));
    let snap_url = dial(snapshot.grpc_url());
    let ingest_flags = [
        flags(Role::Ingest),
        vec!["--snapshot-addr".into(), snap_url.clone()],
    ]
    .concat();
    let ingest = Service::start("br-ingest", &arg(&ingest_flags));
    let decision_flags = [
        flags(Role::Decision),
        vec![
            "--snapshot-addr".into(),
            snap_url,
            "--policy".into(),
            "jsq".into(),
            "--groups".into(),
            GROUP.into(),
        ],
    ]
    .concat();
    let decision = Service::start("br-decision", &arg(&decision_flags));
    (snapshot, ingest, decision)
}

fn arg(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn denied<T: std::fmt::Debug>(r: Result<T, tonic::Status>, what: &str) {
    let status = r.expect_err(what);
    assert_eq!(status.code(), Code::PermissionDenied, "{what}: {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_is_authenticated_and_each_role_does_only_its_job() {
    let pki = Pki::new();
    let (snapshot, ingest, decision) = control_plane(&pki, &["--worker-grace", "30s"], |u| u);
    let snap_url = snapshot.grpc_url();

    let admin_snap = channel(&snap_url, pki.role(Role::Admin), Some(Role::Snapshot)).await;
    let gateway = channel(
        &decision.grpc_url(),
        pki.role(Role::Gateway),
        Some(Role::Decision),
    )
    .await;

    // a worker with its own certificate joins through ingest, which reaches the snapshot
    // service over mutual TLS as the ingest role
    let w0 = channel(&ingest.grpc_url(), pki.worker(0), Some(Role::Ingest)).await;
    let keep = eventually_some(START, "worker 0's Hello is acknowledged", || {
        let w0 = w0.clone();
        async move {
            let (ack, tx) = say_hello(w0, 0).await;
            ack.ok().map(|_| tx)
        }
    })
    .await;
    eventually_some(START, "σ shows worker 0 live", || {
        let c = admin_snap.clone();
        async move {
            let s = sigma(c).await.ok()?;
            s.workers.iter().any(|w| w.worker_id == 0).then_some(())
        }
    })
    .await;

    // the gateway is answered by decision, which watched σ over mutual TLS
    let answer = eventually_some(START, "the gateway's Assign is answered", || {
        let g = gateway.clone();
        async move {
            let mut c = DecisionClient::new(g);
            c.assign(assign_req("r1"))
                .await
                .ok()
                .map(|r| r.into_inner())
        }
    })
    .await;
    assert_eq!(answer.worker_id, 0);
    assert_eq!(answer.endpoint, "http://127.0.0.1:18000");

    let before = sigma(admin_snap.clone()).await.unwrap();

    // -- the attacks mutual TLS must stop, each with a valid certificate of the wrong role --
    // a worker certificate claiming another worker
    let (stolen, _tx) = say_hello(w0.clone(), 1).await;
    denied(stolen, "worker 0's certificate says Hello as worker 1");
    // a gateway calling the snapshot service's writer methods, or reading σ
    let g_snap = channel(&snap_url, pki.role(Role::Gateway), Some(Role::Snapshot)).await;
    let (tx, rx) = mpsc::channel(1);
    tx.send(v1::ChangeBatch {
        ingest_id: String::new(),
        traceparent: String::new(),
        tracestate: String::new(),
        batch_seq: 1,
        group: GROUP.into(),
        changes: vec![],
    })
    .await
    .unwrap();
    let apply = SnapshotClient::new(g_snap.clone())
        .apply(ReceiverStream::new(rx))
        .await;
    let apply = match apply {
        Err(s) => Err(s),
        Ok(r) => r.into_inner().message().await.map(|_| ()),
    };
    denied(apply, "a gateway's Apply");
    let reserve = SnapshotClient::new(g_snap.clone())
        .reserve(v1::ReserveRequest {
            group: GROUP.into(),
            reservations: vec![v1::Reservation {
                request_id: "evil".into(),
                worker_id: 0,
                incarnation: 77,
                prompt_tokens: 10_000_000,
                ..Default::default()
            }],
        })
        .await;
    denied(reserve, "a gateway's Reserve");
    denied(sigma(g_snap.clone()).await, "a gateway's Get");
    // a worker calling Assign, Cancel or the snapshot service
    let w_dec = channel(&decision.grpc_url(), pki.worker(1), Some(Role::Decision)).await;
    denied(
        DecisionClient::new(w_dec.clone())
            .assign(assign_req("x"))
            .await,
        "a worker's Assign",
    );
    let cancel = v1::CancelRequest {
        group: GROUP.into(),
        request_id: "r1".into(),
    };
    denied(
        DecisionClient::new(w_dec).cancel(cancel).await,
        "a worker's Cancel",
    );
    // plaintext gets no answer at all
    let plain = Endpoint::from_shared(decision.grpc_url())
        .unwrap()
        .timeout(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(5));
    let plain = match plain.connect().await {
        Err(_) => true,
        Ok(ch) => DecisionClient::new(ch)
            .assign(assign_req("p"))
            .await
            .is_err(),
    };
    assert!(plain, "a plaintext Assign must fail");

    // σ is untouched by all of it
    let after = sigma(admin_snap.clone()).await.unwrap();
    assert_eq!(before, after);
    drop(keep);
    drop((snapshot, ingest, decision));
}

/// Every client dials an `https://` address under mutual TLS as it dials `http://` (the TLS
/// comes from the certificate, not the scheme): ingest's and decision's links to the snapshot
/// service, a shim's reporter and a gateway's Assign client. Without a certificate the Assign
/// client refuses such an address at once, saying what is missing, instead of failing on
/// every call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_client_dials_an_https_address_under_tls() {
    let pki = Pki::new();
    let https = |url: String| url.replacen("http://", "https://", 1);
    let (_snapshot, ingest, decision) = control_plane(&pki, &[], https);

    let mut config =
        br_client::reporter::ReporterConfig::new(https(ingest.grpc_url()), GROUP, 1, 8);
    config.endpoint = "http://127.0.0.1:18001".into();
    config.tls = Some(TlsMaterial::load(pki.worker(1), TD).unwrap());
    let reporter = br_client::reporter::Reporter::spawn(config).unwrap();

    let gateway = TlsMaterial::load(pki.role(Role::Gateway), TD).unwrap();
    let client = br_client::assign::AssignClient::connect_lazy_many(
        [https(decision.grpc_url())],
        Some(&gateway),
    )
    .unwrap();
    let answer = eventually_some(
        START,
        "Assign over https:// is answered on worker 1",
        || {
            let client = client.clone();
            async move {
                let params = br_client::assign::AssignParams::new(GROUP, "https-r1", 100);
                client
                    .assign_within(&params, Duration::from_secs(5))
                    .await
                    .ok()
            }
        },
    )
    .await;
    assert_eq!(
        answer.worker_id, 1,
        "the only worker, reported over https://"
    );
    assert!(reporter.is_connected());

    let refused =
        br_client::assign::AssignClient::connect_lazy_many([https(decision.grpc_url())], None)
            .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused}");
    assert!(refused.to_string().contains("--tls-cert"), "{refused}");
    reporter.shutdown().await;
}
