//! One br-shim serving two ranks of one engine server (`--worker-ids 0-1`) under mutual TLS,
//! as real processes: br-snapshot, br-ingest, a `br-emu engine` with two data-parallel ranks
//! and the shim, which presents ONE certificate naming both ranks
//! (`spiffe://<td>/br/worker/<group>/0-1`, what `br-certs --worker-range 0-1` issues).
//! * both ranks' Hellos are admitted: σ shows worker 0 and worker 1 live, each with its
//!   `/rank/<n>` endpoint, and ingest refused nothing;
//! * the same certificate saying Hello as worker 2 is refused (PERMISSION_DENIED naming the
//!   range it does give), and counted as `not_your_worker`;
//! * a shim serving both ranks with a certificate for worker 0 only refuses to start (exit 2),
//!   naming the rank it could not report for and the certificate it needs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use br_e2e::engine::EmuEngine;
use br_e2e::pki::{self, Pki};
use br_e2e::{Service, run_to_exit};
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::telemetry_client::TelemetryClient;
use br_proto::v1::{self, worker_report};
use br_testkit::{Metrics, eventually_some};
use br_trust::{Role, TlsFiles, WorkerIds};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::Channel;

const GROUP: &str = "multi-tls";
const START: Duration = Duration::from_secs(60);
/// A hang guard for one call, not a timing assertion.
const CALL: Duration = Duration::from_secs(20);

fn start(bin: &'static str, args: Vec<String>) -> Service {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    Service::start(bin, &a)
}

/// The flags of a shim serving ranks 0 and 1 of `engine` for `ingest`, presenting `files`.
fn shim_args(files: &TlsFiles, engine: &EmuEngine, ingest: &str) -> Vec<String> {
    let mut args = pki::tls_flags(files);
    args.extend(
        [
            "--upstream",
            &engine.dp_url(),
            "--dp-rank-header",
            "X-data-parallel-rank",
            "--worker-ids",
            "0-1",
            "--ingest-addr",
            ingest,
            "--group",
            GROUP,
            "--capacity",
            "16",
        ]
        .map(str::to_owned),
    );
    args
}

/// Says Hello as `worker_id` on a stream of its own; the first answer (an ack, or the status
/// that ended the stream).
async fn hello(ch: Channel, worker_id: u32) -> Result<v1::ReportAck, tonic::Status> {
    let (tx, rx) = mpsc::channel(1);
    let msg = v1::WorkerReport {
        kind: Some(worker_report::Kind::Hello(v1::Hello {
            group: GROUP.into(),
            worker_id,
            incarnation: 0x77,
            capacity: 8,
            endpoint: "http://127.0.0.1:1".into(),
        })),
    };
    tx.send(msg).await.unwrap();
    let answer = async {
        let mut acks = TelemetryClient::new(ch)
            .report(ReceiverStream::new(rx))
            .await?
            .into_inner();
        acks.message()
            .await?
            .ok_or_else(|| tonic::Status::unknown("the stream ended without an answer"))
    };
    let got = tokio::time::timeout(CALL, answer)
        .await
        .unwrap_or_else(|_| panic!("no answer to the Hello as worker {worker_id} in {CALL:?}"));
    drop(tx);
    got
}

/// σ's workers of the group, live ones only: (worker id, endpoint).
async fn live_workers(admin: Channel) -> Option<Vec<(u32, String)>> {
    let req = v1::GetRequest {
        group: GROUP.into(),
    };
    let s = SnapshotClient::new(admin).get(req).await.ok()?.into_inner();
    let mut live: Vec<(u32, String)> = s
        .workers
        .iter()
        .filter(|w| w.liveness == v1::Liveness::Live as i32)
        .map(|w| (w.worker_id, w.endpoint.clone()))
        .collect();
    live.sort();
    Some(live)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_certificate_names_every_rank_a_shim_serves_and_no_other() {
    let pki = Pki::new();
    let both = pki.workers(GROUP, WorkerIds::range(0, 1).unwrap());

    let mut args = pki.flags(Role::Snapshot);
    args.extend(["--worker-grace".into(), "60s".into()]);
    let snapshot = start("br-snapshot", args);
    let snap_url = snapshot.grpc_url();
    let mut args = pki.flags(Role::Ingest);
    args.extend(["--snapshot-addr".into(), snap_url.clone()]);
    let ingest = start("br-ingest", args);
    let ingest_url = ingest.grpc_url();
    let engine = EmuEngine::start(&["--ranks", "2", "--slots", "16"]);
    let shim = start("br-shim", shim_args(&both, &engine, &ingest_url));

    // both ranks report through one certificate
    let admin = pki::channel(&snap_url, &pki.role(Role::Admin), Some(Role::Snapshot));
    let shim_url = format!("http://{}", shim.grpc_addr());
    let want = vec![
        (0, format!("{shim_url}/rank/0")),
        (1, format!("{shim_url}/rank/1")),
    ];
    eventually_some(START, "σ shows ranks 0 and 1 of the shim live", || {
        let (admin, want) = (admin.clone(), &want);
        async move { (live_workers(admin).await.as_ref() == Some(want)).then_some(()) }
    })
    .await;

    let admin_files = pki.role(Role::Admin);
    let ca = pki.path("ca.pem");
    let refused = || async {
        let (code, body) = pki::https_get(ingest.admin_addr(), &ca, Some(&admin_files), "/metrics")
            .await
            .unwrap();
        assert_eq!(code, 200, "{body}");
        Metrics::parse(&body)
            .unwrap()
            .get(
                "balanceroute_ingest_rejected_total",
                &[("reason", "not_your_worker")],
            )
            .unwrap_or(0.0)
    };
    assert_eq!(refused().await, 0.0, "no rank of the shim was refused");

    // the certificate names workers 0 and 1, not 2
    let as_both = pki::channel(&ingest_url, &both, Some(Role::Ingest));
    let status = hello(as_both, 2)
        .await
        .expect_err("the 0-1 certificate saying Hello as worker 2");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let msg = status.message();
    for part in [
        "br/worker/multi-tls/0-1",
        "as group \"multi-tls\" worker 2",
        "its certificate is for group \"multi-tls\" workers 0-1",
    ] {
        assert!(msg.contains(part), "the denial names {part:?}: {msg}");
    }
    assert_eq!(refused().await, 1.0);

    // a shim serving both ranks with worker 0's certificate stops at start, not rank 1 refused
    // at every retry
    let only_0 = pki.worker(GROUP, 0);
    let mut args = shim_args(&only_0, &engine, &ingest_url);
    args.extend(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"].map(str::to_owned));
    let (status, stderr) = run_to_exit("br-shim", &args);
    assert_eq!(status.code(), Some(2), "{stderr}");
    for part in [
        "--tls-cert",
        "group \"multi-tls\" worker 0",
        "worker 1",
        "br-certs --worker-range 0-1",
    ] {
        assert!(
            stderr.contains(part),
            "the refusal names {part:?}: {stderr}"
        );
    }
    assert_eq!(
        live_workers(admin).await.unwrap(),
        want,
        "the running shim's ranks are untouched"
    );
    drop(shim);
}
