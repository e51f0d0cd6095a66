//! Rotating every service's certificate under load: br-snapshot, br-ingest and
//! br-decision run with mutual TLS while a gateway keeps calling Assign and two workers keep
//! streaming telemetry for what they were given. Each service's certificate and key files are
//! rewritten in place (a new certificate of the same CA, another serial and expiry), as
//! cert-manager or SPIRE do. Then:
//! * every new handshake on every gRPC and admin port presents the new certificate;
//! * no Assign failed, before, during or after;
//! * no long-lived stream was dropped: the workers' Report streams never ended, and every
//!   connection between the services (ingest's Apply stream and decision's Watch to snapshot)
//!   and from the test to them is the same TCP connection afterwards as before (read from the
//!   kernel's socket table: a reconnect would show as a new local port).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use br_certs::Validity;
use br_e2e::Service;
use br_e2e::pki::{self, Pki, TD};
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::telemetry_client::TelemetryClient;
use br_proto::v1::{self, worker_report};
use br_testkit::{Metrics, eventually, eventually_some};
use br_trust::{Identity, Role};
use rustls::pki_types::CertificateDer;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

const GROUP: &str = "rot";
const WORKERS: u32 = 2;
const START: Duration = Duration::from_secs(60);
/// How many Assigns must succeed after the rotation was seen by every port.
const AFTER: u64 = 40;

/// A worker's Report stream: Hello, then every 20 ms the cumulative progress of the requests
/// the gateway gave it (each finishes after a few tokens), a full state when asked.
struct Worker {
    give: mpsc::Sender<String>,
    /// Why the stream ended, if it did (it must not).
    ended: Arc<Mutex<Option<String>>>,
    acks: Arc<AtomicU64>,
}

impl Worker {
    async fn start(ch: Channel, id: u32) -> Worker {
        let (tx, rx) = mpsc::channel(64);
        let hello = v1::WorkerReport {
            kind: Some(worker_report::Kind::Hello(v1::Hello {
                group: GROUP.into(),
                worker_id: id,
                incarnation: 0xabc0 + u64::from(id),
                capacity: 64,
                endpoint: format!("http://127.0.0.1:{}", 18000 + id),
            })),
        };
        tx.send(hello).await.unwrap();
        let mut acks_in = TelemetryClient::new(ch)
            .report(ReceiverStream::new(rx))
            .await
            .unwrap_or_else(|e| panic!("worker {id}'s Report: {e:?}"))
            .into_inner();
        let ended: Arc<Mutex<Option<String>>> = Arc::default();
        let acks = Arc::new(AtomicU64::new(0));
        let full = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (e2, a2, f2) = (ended.clone(), acks.clone(), full.clone());
        tokio::spawn(async move {
            let why = loop {
                match acks_in.message().await {
                    Ok(Some(ack)) => {
                        a2.fetch_add(1, Ordering::SeqCst);
                        if ack.full_state_requested {
                            f2.store(true, Ordering::SeqCst);
                        }
                    }
                    Ok(None) => break "the server ended the stream".to_owned(),
                    Err(s) => break format!("{s:?}"),
                }
            };
            *e2.lock().unwrap() = Some(why);
        });
        let (give, mut given) = mpsc::channel::<String>(1024);
        let e3 = ended.clone();
        tokio::spawn(async move {
            let mut running: BTreeMap<String, u32> = BTreeMap::new();
            let mut seq = 0;
            let mut every = tokio::time::interval(Duration::from_millis(20));
            loop {
                every.tick().await;
                while let Ok(r) = given.try_recv() {
                    running.insert(r, 0);
                }
                let full_state = full.swap(false, Ordering::SeqCst);
                let mut updates = Vec::new();
                let mut done = Vec::new();
                for (id, generated) in running.iter_mut() {
                    *generated += 1;
                    let finished = *generated >= 5;
                    updates.push(v1::RequestProgress {
                        request_id: id.clone(),
                        prompt_tokens: 100,
                        generated_tokens: *generated,
                        finished,
                        unkeyed: false,
                    });
                    if finished {
                        done.push(id.clone());
                    }
                }
                for id in done {
                    running.remove(&id);
                }
                seq += 1;
                let msg = v1::WorkerReport {
                    kind: Some(worker_report::Kind::Progress(v1::Progress {
                        seq,
                        updates,
                        full_state,
                        traceparent: String::new(),
                        tracestate: String::new(),
                    })),
                };
                if tx.send(msg).await.is_err() {
                    let mut e = e3.lock().unwrap();
                    e.get_or_insert_with(|| "the request stream closed".into());
                    return;
                }
            }
        });
        Worker { give, ended, acks }
    }
}

/// The gateway's loop: Assign after Assign (each answer handed to its worker), counting
/// successes and keeping every failure.
struct Gateway {
    ok: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Gateway {
    fn start(ch: Channel, workers: Vec<mpsc::Sender<String>>) -> Gateway {
        let ok = Arc::new(AtomicU64::new(0));
        let failures: Arc<Mutex<Vec<String>>> = Arc::default();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (ok2, f2, s2) = (ok.clone(), failures.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut client = DecisionClient::new(ch);
            let mut n = 0u64;
            while !s2.load(Ordering::SeqCst) {
                n += 1;
                let id = format!("r{n}");
                let mut req = tonic::Request::new(v1::AssignRequest {
                    group: GROUP.into(),
                    request_id: id.clone(),
                    prompt_tokens: 100,
                    ..Default::default()
                });
                req.set_timeout(Duration::from_secs(20));
                match client.assign(req).await {
                    Ok(a) => {
                        let a = a.into_inner();
                        let w = &workers[a.worker_id as usize];
                        let _ = w.send(id).await;
                        ok2.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(s) => f2.lock().unwrap().push(format!("{id}: {s:?}")),
                }
            }
        });
        Gateway {
            ok,
            failures,
            stop,
            task,
        }
    }

    fn ok(&self) -> u64 {
        self.ok.load(Ordering::SeqCst)
    }
}

/// The local ports of `pid`'s established TCP connections to 127.0.0.1:`port`, from
/// /proc/<pid>/fd (its sockets) and /proc/net/tcp (their endpoints).
fn connections(pid: u32, port: u16) -> BTreeSet<u16> {
    let mut inodes = BTreeSet::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        if let Ok(target) = std::fs::read_link(fd.path()) {
            let t = target.to_string_lossy();
            if let Some(inode) = t.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
                inodes.insert(inode.to_owned());
            }
        }
    }
    let mut out = BTreeSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
            if f.len() < 10 || f[3] != "01" || !inodes.contains(f[9]) {
                continue;
            }
            let port_of = |a: &str| u16::from_str_radix(a.rsplit(':').next().unwrap(), 16).unwrap();
            if port_of(f[2]) == port {
                out.insert(port_of(f[1]));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_services_certificate_rotates_under_traffic_without_an_error_or_a_dropped_stream() {
    let pki = Pki::new();
    // the files are checked every 100 ms, so the rotation is seen quickly
    let with = |role: Role, extra: &[&str]| -> Vec<String> {
        let mut v = pki.flags(role);
        v.extend(["--tls-reload-interval".to_owned(), "100ms".to_owned()]);
        v.extend(extra.iter().map(|s| (*s).to_owned()));
        v
    };
    let start = |bin: &'static str, args: Vec<String>| {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        Service::start(bin, &a)
    };
    let snapshot = start(
        "br-snapshot",
        with(Role::Snapshot, &["--worker-grace", "60s"]),
    );
    let snap_url = snapshot.grpc_url();
    let ingest = start(
        "br-ingest",
        with(Role::Ingest, &["--snapshot-addr", &snap_url]),
    );
    let decision = start(
        "br-decision",
        with(
            Role::Decision,
            &[
                "--snapshot-addr",
                &snap_url,
                "--groups",
                GROUP,
                "--policy",
                "jsq",
            ],
        ),
    );

    let mut workers = Vec::new();
    for id in 0..WORKERS {
        let files = pki.worker(GROUP, id);
        let ch = pki::channel(&ingest.grpc_url(), &files, Some(Role::Ingest));
        workers.push(Worker::start(ch, id).await);
    }
    let admin = pki::channel(&snap_url, &pki.role(Role::Admin), Some(Role::Snapshot));
    eventually(START, "σ shows every worker", || {
        let c = admin.clone();
        async move {
            let req = v1::GetRequest {
                group: GROUP.into(),
            };
            let s = SnapshotClient::new(c).get(req).await;
            s.is_ok_and(|s| s.into_inner().workers.len() == WORKERS as usize)
        }
    })
    .await;
    let gateway_ch = pki::channel(
        &decision.grpc_url(),
        &pki.role(Role::Gateway),
        Some(Role::Decision),
    );
    // the first answer may wait for decision's σ; from then on nothing may fail
    eventually_some(START, "decision answers an Assign", || {
        let g = gateway_ch.clone();
        async move {
            let req = v1::AssignRequest {
                group: GROUP.into(),
                request_id: "first".into(),
                prompt_tokens: 1,
                ..Default::default()
            };
            DecisionClient::new(g).assign(req).await.ok()
        }
    })
    .await;
    // a clone keeps the gateway's connection open after its loop ends, so the connection check
    // below sees the one the loop used (not its absence)
    let _gateway_conn = gateway_ch.clone();
    let gateway = Gateway::start(gateway_ch, workers.iter().map(|w| w.give.clone()).collect());
    eventually(START, "Assigns flow", || {
        let n = gateway.ok();
        async move { n >= 20 }
    })
    .await;

    // the connections every stream rides on, before
    let me = std::process::id();
    let links = |label: &str| -> (String, u32, u16) {
        match label {
            "ingest -> snapshot" => (label.into(), ingest.pid().unwrap(), snapshot.grpc_port),
            "decision -> snapshot" => (label.into(), decision.pid().unwrap(), snapshot.grpc_port),
            "workers -> ingest" => (label.into(), me, ingest.grpc_port),
            _ => (label.into(), me, decision.grpc_port),
        }
    };
    let labels = [
        "ingest -> snapshot",
        "decision -> snapshot",
        "workers -> ingest",
        "gateway -> decision",
    ];
    let before: Vec<(String, BTreeSet<u16>)> = labels
        .iter()
        .map(|l| {
            let (label, pid, port) = links(l);
            (label, connections(pid, port))
        })
        .collect();
    for (label, conns) in &before {
        assert!(!conns.is_empty(), "{label}: no established connection");
    }
    let acks_before: Vec<u64> = workers
        .iter()
        .map(|w| w.acks.load(Ordering::SeqCst))
        .collect();
    let decision_metrics = |m: &Metrics| {
        (
            m.sum("balanceroute_decision_watch_resets_total"),
            m.sum("balanceroute_decision_sigma_stale"),
        )
    };
    let admin_files = pki.role(Role::Admin);
    let ca = pki.path("ca.pem");
    let scrape = |s: &Service| {
        let addr = s.admin_addr();
        let (ca, files) = (ca.clone(), admin_files.clone());
        async move {
            let (code, body) = pki::https_get(addr, &ca, Some(&files), "/metrics")
                .await
                .unwrap();
            assert_eq!(code, 200, "{body}");
            Metrics::parse(&body).unwrap()
        }
    };
    let dec_before = decision_metrics(&scrape(&decision).await);

    // -- rotate all three, under traffic --
    let services = [
        (Role::Snapshot, &snapshot),
        (Role::Ingest, &ingest),
        (Role::Decision, &decision),
    ];
    let mut renewed = Vec::new();
    for (role, _) in services {
        let old = pki::leaf_der(&std::fs::read_to_string(pki.role(role).cert).unwrap());
        let new = reissue(
            &pki,
            &Identity::uri_for_role(TD, role),
            &br_certs::role_files(role),
        );
        assert_ne!(new, old);
        renewed.push(new);
    }
    let client = pki.role(Role::Admin);
    for ((role, svc), want) in services.iter().zip(&renewed) {
        for (port, alpn) in [
            (svc.grpc_addr(), &b"h2"[..]),
            (svc.admin_addr(), &b"http/1.1"[..]),
        ] {
            await_presented(port, &client, alpn, want, &format!("{role}'s {port}")).await;
        }
    }

    // traffic goes on after every port has rotated
    let rotated_at = gateway.ok();
    eventually(START, "Assigns go on after the rotation", || {
        let n = gateway.ok();
        async move { n >= rotated_at + AFTER }
    })
    .await;
    for (i, w) in workers.iter().enumerate() {
        let acks = w.acks.clone();
        let was = acks_before[i];
        eventually(
            START,
            &format!("worker {i} is acked after the rotation"),
            || {
                let now = acks.load(Ordering::SeqCst);
                async move { now > was + 10 }
            },
        )
        .await;
    }
    gateway.stop.store(true, Ordering::SeqCst);
    let Gateway {
        failures, task, ok, ..
    } = gateway;
    br_testkit::within(START, "the gateway loop stops", task)
        .await
        .unwrap();

    let failures = failures.lock().unwrap().clone();
    assert!(
        failures.is_empty(),
        "{} of {} Assigns failed: {failures:?}",
        failures.len(),
        ok.load(Ordering::SeqCst) + failures.len() as u64
    );
    for (i, w) in workers.iter().enumerate() {
        let ended = w.ended.lock().unwrap().clone();
        assert_eq!(ended, None, "worker {i}'s Report stream ended");
    }
    for (label, was) in &before {
        let (_, pid, port) = links(label);
        let now = connections(pid, port);
        assert_eq!(
            &now, was,
            "{label}: a connection was replaced (a reconnect)"
        );
    }
    let ingest_m = scrape(&ingest).await;
    assert_eq!(ingest_m.sum("balanceroute_ingest_snapshot_connected"), 1.0);
    let snap_m = scrape(&snapshot).await;
    assert_eq!(
        snap_m.sum("balanceroute_snapshot_watchers"),
        1.0,
        "decision's one Watch, never re-opened"
    );
    assert_eq!(
        decision_metrics(&scrape(&decision).await),
        dec_before,
        "decision: no Watch reset, σ never stale"
    );
}

async fn presented(
    addr: std::net::SocketAddr,
    client: &br_trust::TlsFiles,
    alpn: &[u8],
) -> CertificateDer<'static> {
    pki::presented_cert(addr, client, alpn).await
}

/// A new certificate (new key and serial) for `uri`, written in place over the files `names`
/// in the PKI's directory, as cert-manager or SPIRE would; returns the new leaf.
fn reissue(pki: &Pki, uri: &str, names: &(String, String)) -> CertificateDer<'static> {
    let issued = pki
        .ca
        .issue(uri, Validity::For(Duration::from_secs(7200)))
        .unwrap();
    br_certs::write(pki.dir(), names, &issued).unwrap();
    pki::leaf_der(&issued.cert_pem)
}

/// The shim's worker certificate files, replaced in place by a certificate for `worker_id` of
/// `group`; returns the new leaf.
fn rotate_shim(
    pki: &Pki,
    files: &br_trust::TlsFiles,
    group: &str,
    worker_id: u32,
) -> CertificateDer<'static> {
    let name = |p: &std::path::Path| p.file_name().unwrap().to_string_lossy().into_owned();
    let names = (name(&files.cert), name(&files.key));
    reissue(pki, &Identity::uri_for_worker(TD, group, worker_id), &names)
}

/// Waits until every new handshake on `port` presents `want` (the reloader picked up the
/// rotated files), then checks five more handshakes do too: no listener kept the old one.
async fn await_presented(
    port: std::net::SocketAddr,
    client: &br_trust::TlsFiles,
    alpn: &[u8],
    want: &CertificateDer<'static>,
    what: &str,
) {
    eventually(
        START,
        &format!("{what} presents its new certificate"),
        || {
            let client = client.clone();
            async move { presented(port, &client, alpn).await == *want }
        },
    )
    .await;
    for _ in 0..5 {
        assert!(
            presented(port, client, alpn).await == *want,
            "{what}: a handshake presented the old certificate"
        );
    }
}

/// A client picks up its rotated certificate on its next handshake, while the streams it
/// already has carry on. The client is a real br-shim (worker 0 of its group): its certificate
/// files are replaced by one for worker 1, a certificate ingest refuses for worker 0's Hello.
/// * the shim's admin port (its server side) presents the new certificate at once, and its
///   Report stream, authenticated with the old one, carries on: the same TCP connection, ingest
///   still counts its messages, nothing refused;
/// * ingest restarts (kill -9, same port): the shim's next handshake presents the worker-1
///   certificate and its Hello as worker 0 is refused (not_your_worker), again at every retry;
/// * the files are rotated back to a worker-0 certificate: the shim's next handshake presents
///   it and the stream is admitted (ingest holds one stream, the shim says it is connected).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_presents_its_rotated_certificate_on_its_next_handshake_and_keeps_its_streams() {
    const SHIM_GROUP: &str = "rot-client";
    let pki = Pki::new();
    let with = |role: Role, extra: &[&str]| -> Vec<String> {
        let mut v = pki.flags(role);
        v.extend(extra.iter().map(|s| (*s).to_owned()));
        v
    };
    let start = |bin: &'static str, args: Vec<String>| {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        Service::start(bin, &a)
    };
    let snapshot = start(
        "br-snapshot",
        with(Role::Snapshot, &["--worker-grace", "60s"]),
    );
    let snap_url = snapshot.grpc_url();
    let mut ingest = start(
        "br-ingest",
        with(Role::Ingest, &["--snapshot-addr", &snap_url]),
    );
    // the shim's own files (a copy of worker 0's, so rotating them touches nothing else)
    let shim_files = pki.custom(
        "shim",
        &pki.ca
            .issue(
                &Identity::uri_for_worker(TD, SHIM_GROUP, 0),
                Validity::For(Duration::from_secs(7200)),
            )
            .unwrap(),
    );
    let s = |p: &std::path::Path| p.to_string_lossy().into_owned();
    let shim = start(
        "br-shim",
        vec![
            "--tls-cert".into(),
            s(&shim_files.cert),
            "--tls-key".into(),
            s(&shim_files.key),
            "--tls-ca".into(),
            s(&shim_files.ca),
            "--tls-reload-interval".into(),
            "100ms".into(),
            "--upstream".into(),
            "http://127.0.0.1:1".into(),
            // no engine here: in routing without one (a probed shim says Hello only once its
            // engine answers)
            "--engine-probe-interval".into(),
            "0s".into(),
            "--ingest-addr".into(),
            ingest.grpc_url(),
            "--group".into(),
            SHIM_GROUP.into(),
            "--worker-id".into(),
            "0".into(),
        ],
    );

    let admin_files = pki.role(Role::Admin);
    let ca = pki.path("ca.pem");
    let scrape = |addr: std::net::SocketAddr| {
        let (ca, files) = (ca.clone(), admin_files.clone());
        async move {
            let (code, body) = pki::https_get(addr, &ca, Some(&files), "/metrics")
                .await
                .unwrap();
            assert_eq!(code, 200, "{body}");
            Metrics::parse(&body).unwrap()
        }
    };
    // a reference, so each polled future can take it along
    let scrape = &scrape;
    let refused = |m: &Metrics| {
        m.get(
            "balanceroute_ingest_rejected_total",
            &[("reason", "not_your_worker")],
        )
        .unwrap_or(0.0)
    };
    let shim_connected = |m: &Metrics| m.sum("balanceroute_shim_ingest_connected");
    let streams = |m: &Metrics| m.sum("balanceroute_ingest_streams");
    let messages = |m: &Metrics| m.sum("balanceroute_ingest_messages_total");

    eventually(START, "the shim's stream is up", || {
        let (i, sh) = (ingest.admin_addr(), shim.admin_addr());
        async move { streams(&scrape(i).await) == 1.0 && shim_connected(&scrape(sh).await) == 1.0 }
    })
    .await;
    let shim_pid = shim.pid().unwrap();
    let before = connections(shim_pid, ingest.grpc_port);
    assert_eq!(before.len(), 1, "the shim's one connection to ingest");

    // -- rotate the shim's files to a certificate for worker 1 --
    let worker1 = rotate_shim(&pki, &shim_files, SHIM_GROUP, 1);
    let shim_admin = shim.admin_addr();
    await_presented(
        shim_admin,
        &admin_files,
        b"http/1.1",
        &worker1,
        "the shim's admin port (worker1)",
    )
    .await;
    // the established stream carries on: same connection, ingest still hears it (heartbeats),
    // nothing refused
    let m = scrape(ingest.admin_addr()).await;
    let heard = messages(&m);
    eventually(START, "ingest hears the shim after its rotation", || {
        let i = ingest.admin_addr();
        async move { messages(&scrape(i).await) > heard + 2.0 }
    })
    .await;
    let m = scrape(ingest.admin_addr()).await;
    assert_eq!(
        refused(&m),
        0.0,
        "the established stream was not re-checked"
    );
    assert_eq!(streams(&m), 1.0);
    assert_eq!(
        connections(shim_pid, ingest.grpc_port),
        before,
        "the shim's connection to ingest was replaced"
    );

    // -- a new connection: ingest restarts on its port; the shim's next handshake presents
    //    the worker-1 certificate, and its Hello as worker 0 is refused --
    ingest.restart();
    let i = ingest.admin_addr();
    eventually(
        START,
        "the restarted ingest refuses the shim's Hello twice (two fresh handshakes)",
        || async move { refused(&scrape(i).await) >= 2.0 },
    )
    .await;
    let m = scrape(i).await;
    assert_eq!(
        streams(&m),
        0.0,
        "no stream admitted with the worker-1 certificate"
    );
    // the shim's gauge follows its reporter every 500 ms
    eventually(START, "the shim says it is not connected", || async move {
        shim_connected(&scrape(shim_admin).await) == 0.0
    })
    .await;

    // -- rotate back to a worker-0 certificate: the next handshake is admitted --
    let worker0 = rotate_shim(&pki, &shim_files, SHIM_GROUP, 0);
    await_presented(
        shim_admin,
        &admin_files,
        b"http/1.1",
        &worker0,
        "the shim's admin port (worker0)",
    )
    .await;
    eventually(
        START,
        "ingest admits the shim's stream again",
        || async move {
            streams(&scrape(i).await) == 1.0 && shim_connected(&scrape(shim_admin).await) == 1.0
        },
    )
    .await;
    let refusals = refused(&scrape(i).await);
    // and it stays admitted: more messages, no more refusals
    let heard = messages(&scrape(i).await);
    eventually(START, "ingest keeps hearing the shim", || async move {
        messages(&scrape(i).await) > heard + 2.0
    })
    .await;
    let m = scrape(i).await;
    assert_eq!(refused(&m), refusals, "refused after the rotation back");
    assert_eq!(streams(&m), 1.0);
}
