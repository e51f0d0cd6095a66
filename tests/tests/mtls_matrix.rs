//! The whole method × role matrix against the real services with mutual TLS on
//! (br-snapshot, br-ingest and br-decision as processes, each with its own certificate): every
//! method of every service, health and reflection on every port, and the admin HTTP endpoints,
//! called by every role (a worker, a worker of another id, a worker of another group, ingest,
//! decision, snapshot, gateway, admin). Allowed calls must not be refused; denied calls must be
//! PERMISSION_DENIED naming the role and the method, counted once each, and leave σ untouched.
//! Then the refusals below the table: plaintext, no client certificate, a certificate of
//! another CA, an expired one, and one of our CA with no identity of our trust domain.
//!
//! The expected table ([`documented_allows`]) is written out from the documented role table, not read from
//! br-trust's policy, so a wrong policy fails this test.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use br_e2e::pki::{self, Pki, TD};
use br_e2e::{Service, reflection};
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::telemetry_change as tc;
use br_proto::v1::telemetry_client::TelemetryClient;
use br_proto::v1::{self, worker_report};
use br_testkit::Metrics;
use br_trust::{Role, TlsFiles};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

const GROUP: &str = "e2e";
const OTHER_GROUP: &str = "e2f";
/// The worker slot every `Report` of the matrix claims: [`Caller::Worker`]'s own.
const SLOT: u32 = 2;
/// The worker that keeps σ populated while the matrix runs.
const LIVE: u32 = 0;
const START: Duration = Duration::from_secs(60);
/// The longest one call of the matrix may take (a hang fails the test; not a timing).
const CALL: Duration = Duration::from_secs(20);

/// Who calls: the roles of the authorisation table, and workers whose certificate is for another slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Caller {
    /// `spiffe://…/br/worker/e2e/2`: the slot every Report claims.
    Worker,
    /// `…/br/worker/e2e/3`: the same group, another id.
    WorkerOtherId,
    /// `…/br/worker/e2f/2`: the same id, another group.
    WorkerOtherGroup,
    Ingest,
    Decision,
    Snapshot,
    Gateway,
    Admin,
}

const CALLERS: [Caller; 8] = [
    Caller::Worker,
    Caller::WorkerOtherId,
    Caller::WorkerOtherGroup,
    Caller::Ingest,
    Caller::Decision,
    Caller::Snapshot,
    Caller::Gateway,
    Caller::Admin,
];

impl Caller {
    fn files(self, pki: &Pki) -> TlsFiles {
        match self {
            Caller::Worker => pki.worker(GROUP, SLOT),
            Caller::WorkerOtherId => pki.worker(GROUP, SLOT + 1),
            Caller::WorkerOtherGroup => pki.worker(OTHER_GROUP, SLOT),
            Caller::Ingest => pki.role(Role::Ingest),
            Caller::Decision => pki.role(Role::Decision),
            Caller::Snapshot => pki.role(Role::Snapshot),
            Caller::Gateway => pki.role(Role::Gateway),
            Caller::Admin => pki.role(Role::Admin),
        }
    }

    /// The role a denial must name.
    fn role(self) -> &'static str {
        match self {
            Caller::Worker | Caller::WorkerOtherId | Caller::WorkerOtherGroup => "worker",
            Caller::Ingest => "ingest",
            Caller::Decision => "decision",
            Caller::Snapshot => "snapshot",
            Caller::Gateway => "gateway",
            Caller::Admin => "admin",
        }
    }

    /// The SPIFFE id in its certificate.
    fn spiffe_id(self) -> String {
        match self {
            Caller::Worker => format!("spiffe://{TD}/br/worker/{GROUP}/{SLOT}"),
            Caller::WorkerOtherId => format!("spiffe://{TD}/br/worker/{GROUP}/{}", SLOT + 1),
            Caller::WorkerOtherGroup => format!("spiffe://{TD}/br/worker/{OTHER_GROUP}/{SLOT}"),
            other => format!("spiffe://{TD}/br/{}", other.role()),
        }
    }

    fn is_worker(self) -> bool {
        self.role() == "worker"
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Port {
    Snapshot,
    Ingest,
    Decision,
}

const PORTS: [Port; 3] = [Port::Snapshot, Port::Ingest, Port::Decision];

impl Port {
    /// The service label in its metric names.
    fn service(self) -> &'static str {
        match self {
            Port::Snapshot => "snapshot",
            Port::Ingest => "ingest",
            Port::Decision => "decision",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Method {
    Report,
    Apply,
    Reserve,
    ReserveStream,
    Release,
    Watch,
    Get,
    Assign,
    Cancel,
    HealthCheck,
    HealthWatch,
    ReflectionV1,
    ReflectionV1Alpha,
}

const METHODS: [Method; 13] = [
    Method::Report,
    Method::Apply,
    Method::Reserve,
    Method::ReserveStream,
    Method::Release,
    Method::Watch,
    Method::Get,
    Method::Assign,
    Method::Cancel,
    Method::HealthCheck,
    Method::HealthWatch,
    Method::ReflectionV1,
    Method::ReflectionV1Alpha,
];

impl Method {
    /// The method name a denial must name.
    fn name(self) -> &'static str {
        match self {
            Method::Report => "Report",
            Method::Apply => "Apply",
            Method::Reserve => "Reserve",
            Method::ReserveStream => "ReserveStream",
            Method::Release => "Release",
            Method::Watch | Method::HealthWatch => "Watch",
            Method::Get => "Get",
            Method::Assign => "Assign",
            Method::Cancel => "Cancel",
            Method::HealthCheck => "Check",
            Method::ReflectionV1 | Method::ReflectionV1Alpha => "ServerReflectionInfo",
        }
    }

    /// The full gRPC path, `/<package>.<Service>/<Method>`: what every denial names (a bare
    /// method name would also match `Watch` of health for `Watch` of Snapshot).
    fn path(self) -> String {
        let service = match self {
            Method::Report => "balanceroute.v1.Telemetry",
            Method::Apply
            | Method::Reserve
            | Method::ReserveStream
            | Method::Release
            | Method::Watch
            | Method::Get => "balanceroute.v1.Snapshot",
            Method::Assign | Method::Cancel => "balanceroute.v1.Decision",
            Method::HealthCheck | Method::HealthWatch => "grpc.health.v1.Health",
            Method::ReflectionV1 => "grpc.reflection.v1.ServerReflection",
            Method::ReflectionV1Alpha => "grpc.reflection.v1alpha.ServerReflection",
        };
        format!("/{service}/{}", self.name())
    }

    /// The ports that serve it.
    fn ports(self) -> &'static [Port] {
        match self {
            Method::Report => &[Port::Ingest],
            Method::Apply
            | Method::Reserve
            | Method::ReserveStream
            | Method::Release
            | Method::Watch
            | Method::Get => &[Port::Snapshot],
            Method::Assign | Method::Cancel => &[Port::Decision],
            Method::HealthCheck
            | Method::HealthWatch
            | Method::ReflectionV1
            | Method::ReflectionV1Alpha => &PORTS,
        }
    }
}

/// Authorisation per method, as the services enforce it:
/// `Telemetry.Report`: worker, and only for its own group and worker id; `Snapshot.Apply`:
/// ingest; `Snapshot.Reserve/Release`: decision (and `ReserveStream`, Reserve over a stream, as
/// Reserve); `Snapshot.Watch/Get`: decision and admin;
/// `Decision.Assign/Cancel`: gateway (and admin); health and reflection: any authenticated
/// peer. (Every Report of the matrix claims [`Caller::Worker`]'s slot.)
fn documented_allows(m: Method, c: Caller) -> bool {
    match m {
        Method::Report => c == Caller::Worker,
        Method::Apply => c == Caller::Ingest,
        Method::Reserve | Method::ReserveStream | Method::Release => c == Caller::Decision,
        Method::Watch | Method::Get => matches!(c, Caller::Decision | Caller::Admin),
        Method::Assign | Method::Cancel => matches!(c, Caller::Gateway | Caller::Admin),
        Method::HealthCheck
        | Method::HealthWatch
        | Method::ReflectionV1
        | Method::ReflectionV1Alpha => true,
    }
}

/// What a call would change in σ if it were let through. The denied round aims at what is
/// there (the live worker, its reserved request), so a denial that leaked would show in σ;
/// the allowed round aims at things of its own, so it can run after σ was compared.
struct Aim {
    worker: u32,
    incarnation: u64,
    request: String,
}

/// A reservation of `aim`'s worker, as Reserve and ReserveStream send it.
fn reservation(aim: &Aim, request_id: String) -> v1::ReserveRequest {
    v1::ReserveRequest {
        group: GROUP.into(),
        reservations: vec![v1::Reservation {
            request_id,
            worker_id: aim.worker,
            incarnation: aim.incarnation,
            prompt_tokens: 10_000_000,
            ..Default::default()
        }],
    }
}

/// Makes one call; `Ok` if the server answered it (for a stream: its first message).
async fn call(m: Method, ch: Channel, aim: &Aim, n: usize) -> Result<(), Status> {
    let req_id = format!("{}-{n}", aim.request);
    let fut = async {
        match m {
            Method::Report => {
                let (tx, rx) = mpsc::channel(4);
                tx.send(hello(SLOT, 0x0bad_0000 + n as u64)).await.unwrap();
                let mut acks = TelemetryClient::new(ch)
                    .report(ReceiverStream::new(rx))
                    .await?
                    .into_inner();
                let first = acks.message().await?;
                drop(tx);
                first
                    .map(|_| ())
                    .ok_or_else(|| Status::unknown("the Report stream ended without an answer"))
            }
            Method::Apply => {
                // the fencing attack: a WorkerHello with a new incarnation fences the worker
                let (tx, rx) = mpsc::channel(4);
                let change = v1::TelemetryChange {
                    kind: Some(tc::Kind::WorkerHello(tc::WorkerHello {
                        worker_id: aim.worker,
                        incarnation: aim.incarnation ^ 0xffff,
                        capacity: 8,
                        endpoint: "http://attacker.example:6666".into(),
                    })),
                };
                let batch = v1::ChangeBatch {
                    batch_seq: 1,
                    group: GROUP.into(),
                    changes: vec![change],
                    ingest_id: String::new(),
                    traceparent: String::new(),
                    tracestate: String::new(),
                };
                tx.send(batch).await.unwrap();
                let mut acks = SnapshotClient::new(ch)
                    .apply(ReceiverStream::new(rx))
                    .await?
                    .into_inner();
                let first = acks.message().await?;
                drop(tx);
                first
                    .map(|_| ())
                    .ok_or_else(|| Status::unknown("the Apply stream ended without an answer"))
            }
            Method::Reserve => SnapshotClient::new(ch)
                .reserve(reservation(aim, req_id))
                .await
                .map(drop),
            Method::ReserveStream => {
                // the same reservation as Reserve's, as the one call of a stream
                let (tx, rx) = mpsc::channel(4);
                let call = v1::ReserveCall {
                    call_id: 1,
                    request: Some(reservation(aim, req_id)),
                    traceparent: String::new(),
                    tracestate: String::new(),
                };
                tx.send(call).await.unwrap();
                let mut results = SnapshotClient::new(ch)
                    .reserve_stream(ReceiverStream::new(rx))
                    .await?
                    .into_inner();
                let first = results.message().await?;
                drop(tx);
                first.map(drop).ok_or_else(|| {
                    Status::unknown("the ReserveStream stream ended without an answer")
                })
            }
            Method::Release => SnapshotClient::new(ch)
                .release(v1::ReleaseRequest {
                    group: GROUP.into(),
                    request_ids: vec![aim.request.clone()],
                })
                .await
                .map(drop),
            Method::Watch => {
                let req = v1::WatchRequest {
                    group: GROUP.into(),
                    epoch: 0,
                    last_version: 0,
                };
                let mut events = SnapshotClient::new(ch).watch(req).await?.into_inner();
                events
                    .message()
                    .await?
                    .map(drop)
                    .ok_or_else(|| Status::unknown("Watch ended without an event"))
            }
            Method::Get => SnapshotClient::new(ch)
                .get(v1::GetRequest {
                    group: GROUP.into(),
                })
                .await
                .map(drop),
            Method::Assign => DecisionClient::new(ch)
                .assign(assign_req(&req_id))
                .await
                .map(drop),
            Method::Cancel => DecisionClient::new(ch)
                .cancel(v1::CancelRequest {
                    group: GROUP.into(),
                    request_id: aim.request.clone(),
                })
                .await
                .map(drop),
            Method::HealthCheck => {
                use tonic_health::pb::HealthCheckRequest;
                use tonic_health::pb::health_client::HealthClient;
                HealthClient::new(ch)
                    .check(HealthCheckRequest::default())
                    .await
                    .map(drop)
            }
            Method::HealthWatch => {
                use tonic_health::pb::HealthCheckRequest;
                use tonic_health::pb::health_client::HealthClient;
                let mut updates = HealthClient::new(ch)
                    .watch(HealthCheckRequest::default())
                    .await?
                    .into_inner();
                updates
                    .message()
                    .await?
                    .map(drop)
                    .ok_or_else(|| Status::unknown("health Watch ended without an update"))
            }
            Method::ReflectionV1 => reflection::list_v1(ch).await.map(drop),
            Method::ReflectionV1Alpha => reflection::list_v1alpha(ch).await.map(drop),
        }
    };
    tokio::time::timeout(CALL, fut)
        .await
        .unwrap_or_else(|_| panic!("{m:?} did not end within {CALL:?}"))
}

fn hello(worker_id: u32, incarnation: u64) -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(worker_report::Kind::Hello(v1::Hello {
            group: GROUP.into(),
            worker_id,
            incarnation,
            capacity: 8,
            endpoint: format!("http://127.0.0.1:{}", 18000 + worker_id),
        })),
    }
}

fn assign_req(id: &str) -> v1::AssignRequest {
    v1::AssignRequest {
        group: GROUP.into(),
        request_id: id.into(),
        prompt_tokens: 100,
        ..Default::default()
    }
}

async fn sigma(ch: Channel) -> v1::ClusterSnapshot {
    let req = v1::GetRequest {
        group: GROUP.into(),
    };
    let got = tokio::time::timeout(CALL, SnapshotClient::new(ch).get(req)).await;
    got.expect("Get answered in time")
        .expect("the admin may Get σ")
        .into_inner()
}

/// A stack of the three services with mutual TLS, one worker live in σ and one request of
/// it reserved.
struct Stack {
    pki: Pki,
    snapshot: Service,
    ingest: Service,
    decision: Service,
    /// Keeps the live worker's Report stream open.
    _live: mpsc::Sender<v1::WorkerReport>,
    live_incarnation: u64,
    /// A request assigned to the live worker (reserved in σ).
    reserved: String,
}

impl Stack {
    async fn start() -> Stack {
        let pki = Pki::new();
        let arg = |v: &[String]| v.to_vec();
        let snap_flags = [
            pki.flags(Role::Snapshot),
            // nothing may change σ by itself while the matrix runs: no reservation expires and
            // no worker is fenced
            arg(&["--worker-grace".into(), "10m".into()]),
            arg(&["--reservation-ttl".into(), "10m".into()]),
        ]
        .concat();
        let snapshot = start("br-snapshot", &snap_flags);
        let ingest_flags = [
            pki.flags(Role::Ingest),
            arg(&["--snapshot-addr".into(), snapshot.grpc_url()]),
        ]
        .concat();
        let ingest = start("br-ingest", &ingest_flags);
        let decision_flags = [
            pki.flags(Role::Decision),
            arg(&["--snapshot-addr".into(), snapshot.grpc_url()]),
            arg(&["--policy".into(), "jsq".into()]),
            arg(&["--groups".into(), GROUP.into()]),
        ]
        .concat();
        let decision = start("br-decision", &decision_flags);

        // the live worker, with its own certificate
        let live_files = pki.worker(GROUP, LIVE);
        let w = pki::channel(&ingest.grpc_url(), &live_files, Some(Role::Ingest));
        let live_incarnation = 0x1111_0000;
        let live = br_testkit::eventually_some(START, "the live worker's Hello is acked", || {
            let w = w.clone();
            async move {
                let (tx, rx) = mpsc::channel(8);
                tx.send(hello(LIVE, live_incarnation)).await.ok()?;
                let mut acks = TelemetryClient::new(w)
                    .report(ReceiverStream::new(rx))
                    .await
                    .ok()?
                    .into_inner();
                acks.message().await.ok()??;
                tokio::spawn(async move { while let Ok(Some(_)) = acks.message().await {} });
                Some(tx)
            }
        })
        .await;
        let gateway = pki::channel(
            &decision.grpc_url(),
            &pki.role(Role::Gateway),
            Some(Role::Decision),
        );
        let reserved = "held".to_owned();
        let answer = br_testkit::eventually_some(START, "the first Assign is answered", || {
            let g = gateway.clone();
            let id = reserved.clone();
            async move {
                let r = DecisionClient::new(g).assign(assign_req(&id)).await;
                r.ok().map(|r| r.into_inner())
            }
        })
        .await;
        assert_eq!(answer.worker_id, LIVE);
        Stack {
            pki,
            snapshot,
            ingest,
            decision,
            _live: live,
            live_incarnation,
            reserved,
        }
    }

    fn service(&self, port: Port) -> &Service {
        match port {
            Port::Snapshot => &self.snapshot,
            Port::Ingest => &self.ingest,
            Port::Decision => &self.decision,
        }
    }

    fn expect(port: Port) -> Role {
        match port {
            Port::Snapshot => Role::Snapshot,
            Port::Ingest => Role::Ingest,
            Port::Decision => Role::Decision,
        }
    }

    fn channel(&self, port: Port, files: &TlsFiles) -> Channel {
        let url = self.service(port).grpc_url();
        pki::channel(&url, files, Some(Stack::expect(port)))
    }

    fn admin_channel(&self) -> Channel {
        self.channel(Port::Snapshot, &self.pki.role(Role::Admin))
    }

    async fn metrics(&self, port: Port) -> Metrics {
        let s = self.service(port);
        let admin = self.pki.role(Role::Admin);
        let (code, body) = pki::https_get(s.admin_addr(), &admin.ca, Some(&admin), "/metrics")
            .await
            .unwrap_or_else(|e| panic!("{}'s /metrics: {e}", s.name));
        assert_eq!(code, 200, "{}'s /metrics: {body}", s.name);
        Metrics::parse(&body).unwrap_or_else(|e| panic!("{}'s /metrics: {e}", s.name))
    }

    async fn counter(&self, port: Port, what: &str, reason: &str) -> f64 {
        let name = format!("balanceroute_{}_{what}", port.service());
        let m = self.metrics(port).await;
        m.get(&name, &[("reason", reason)]).unwrap_or(0.0)
    }
}

fn start(bin: &'static str, flags: &[String]) -> Service {
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    Service::start(bin, &args)
}

/// Every (method, port, caller) of the matrix.
fn matrix() -> Vec<(Method, Port, Caller)> {
    let mut all = Vec::new();
    for m in METHODS {
        for &p in m.ports() {
            for c in CALLERS {
                all.push((m, p, c));
            }
        }
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_method_on_every_port_admits_exactly_the_roles_issue_10_names() {
    let stack = Stack::start().await;
    let channels: BTreeMap<(Port, Caller), Channel> = PORTS
        .iter()
        .flat_map(|&p| CALLERS.map(|c| (p, c)))
        .map(|(p, c)| ((p, c), stack.channel(p, &c.files(&stack.pki))))
        .collect();

    // -- the denied round: aimed at σ's live worker and its reserved request --
    let before = sigma(stack.admin_channel()).await;
    assert!(
        before
            .requests
            .iter()
            .any(|r| r.request_id == stack.reserved),
        "the reserved request is in σ: {before:?}"
    );
    let mut layer_denials: BTreeMap<Port, f64> = BTreeMap::new();
    for p in PORTS {
        let n = stack
            .counter(p, "calls_denied_total", "role_not_allowed")
            .await;
        layer_denials.insert(p, n);
    }
    let not_yours = stack
        .counter(Port::Ingest, "rejected_total", "not_your_worker")
        .await;
    let aim = Aim {
        worker: LIVE,
        incarnation: stack.live_incarnation,
        request: stack.reserved.clone(),
    };
    let mut denied_by_layer: BTreeMap<Port, f64> = BTreeMap::new();
    let mut denied_by_ingest = 0.0;
    let mut checked = 0;
    for (i, (m, p, c)) in matrix().into_iter().enumerate() {
        if documented_allows(m, c) {
            continue;
        }
        checked += 1;
        let got = call(m, channels[&(p, c)].clone(), &aim, i).await;
        let what = format!("{c:?} calling {m:?} on {p:?}");
        let status = match got {
            Ok(()) => panic!("{what} was answered; the authorisation table denies it"),
            Err(s) => s,
        };
        assert_eq!(status.code(), Code::PermissionDenied, "{what}: {status:?}");
        let msg = status.message();
        // every denial, the layer's and ingest's alike, names the role, the caller's identity
        // and the method
        assert!(
            msg.contains(&format!("role {} ", c.role())),
            "{what}: the denial names the role: {msg}"
        );
        assert!(
            msg.contains(&c.spiffe_id()),
            "{what}: the denial names the identity: {msg}"
        );
        assert!(
            msg.contains(&m.path()),
            "{what}: the denial names the method {}: {msg}",
            m.path()
        );
        if m == Method::Report && c.is_worker() {
            // the table admits workers to Report; ingest refuses a Hello for another slot,
            // naming the slot claimed and the one the certificate gives
            assert!(
                msg.contains(&format!("group \"{GROUP}\" worker {SLOT}")),
                "{what}: the slot claimed: {msg}"
            );
            let own = match c {
                Caller::WorkerOtherId => format!("for group \"{GROUP}\" worker {}", SLOT + 1),
                _ => format!("for group \"{OTHER_GROUP}\" worker {SLOT}"),
            };
            assert!(msg.contains(&own), "{what}: the certificate's slot: {msg}");
            denied_by_ingest += 1.0;
        } else {
            *denied_by_layer.entry(p).or_default() += 1.0;
        }
    }
    assert!(checked > 40, "the matrix denies {checked} calls");
    for p in PORTS {
        let now = stack
            .counter(p, "calls_denied_total", "role_not_allowed")
            .await;
        let want = denied_by_layer.get(&p).copied().unwrap_or(0.0);
        assert_eq!(
            now - layer_denials[&p],
            want,
            "{p:?}: each denial counted once, nothing else denied"
        );
    }
    let now = stack
        .counter(Port::Ingest, "rejected_total", "not_your_worker")
        .await;
    assert_eq!(now - not_yours, denied_by_ingest, "Hellos for another slot");

    // -- below the table: connections that must not get in at all --
    refusals(&stack).await;
    admin_http(&stack).await;

    let after = sigma(stack.admin_channel()).await;
    assert_eq!(before, after, "σ is untouched by every denied call");

    // -- the allowed round: aimed at things of its own --
    let aim = Aim {
        worker: 9,
        incarnation: 9,
        request: "allowed".into(),
    };
    let mut allowed = 0;
    for (i, (m, p, c)) in matrix().into_iter().enumerate() {
        if !documented_allows(m, c) {
            continue;
        }
        allowed += 1;
        let got = call(m, channels[&(p, c)].clone(), &aim, i).await;
        if let Err(s) = got {
            let what = format!("{c:?} calling {m:?} on {p:?}");
            assert!(
                !matches!(s.code(), Code::PermissionDenied | Code::Unauthenticated),
                "{what} is allowed by the authorisation table but was refused: {s:?}"
            );
        }
    }
    assert!(allowed > 100, "the matrix allows {allowed} calls");
    for p in PORTS {
        let now = stack
            .counter(p, "calls_denied_total", "role_not_allowed")
            .await;
        let want = denied_by_layer.get(&p).copied().unwrap_or(0.0);
        assert_eq!(
            now - layer_denials[&p],
            want,
            "{p:?}: no allowed call denied"
        );
    }
}

/// Plaintext, no client certificate, another CA and an expired certificate never reach a
/// method (each is a failed handshake, counted); a certificate of our CA without an identity
/// of our trust domain is authenticated but may call nothing, not even health.
async fn refusals(stack: &Stack) {
    let pki = &stack.pki;
    for p in PORTS {
        let svc = stack.service(p);
        let failures = |m: Metrics| -> f64 {
            let name = format!("balanceroute_{}_tls_handshake_failures_total", p.service());
            m.samples(&name).map(|s| s.value).sum()
        };
        let before = failures(stack.metrics(p).await);
        let health = Method::HealthCheck;
        let aim = Aim {
            worker: LIVE,
            incarnation: stack.live_incarnation,
            request: stack.reserved.clone(),
        };

        let plain = Endpoint::from_shared(svc.grpc_url())
            .unwrap()
            .connect_timeout(CALL)
            .connect_lazy();
        let got = call(health, plain, &aim, 0).await;
        assert!(got.is_err(), "{p:?}: a plaintext call was answered");

        let no_cert = {
            let mut roots = rustls::RootCertStore::empty();
            let pem = std::fs::read(pki.path("ca.pem")).unwrap();
            use rustls::pki_types::pem::PemObject as _;
            for c in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
                roots.add(c.unwrap()).unwrap();
            }
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
            cfg.alpn_protocols = vec![b"h2".to_vec()];
            let url = format!("http://localhost:{}", svc.grpc_port);
            Endpoint::from_shared(url)
                .unwrap()
                .connect_timeout(CALL)
                .connect_with_connector_lazy(br_trust::tls::connector(Arc::new(cfg)))
        };
        let got = call(health, no_cert, &aim, 0).await;
        assert!(
            got.is_err(),
            "{p:?}: a call without a certificate was answered"
        );

        for (what, files) in [
            ("another CA's certificate", pki.foreign_gateway()),
            ("an expired certificate", pki.expired_gateway()),
        ] {
            let got = call(health, stack.channel(p, &files), &aim, 0).await;
            assert!(got.is_err(), "{p:?}: a call with {what} was answered");
            // not even the method a gateway may call
            if p == Port::Decision {
                let got = call(Method::Assign, stack.channel(p, &files), &aim, 0).await;
                assert!(got.is_err(), "{p:?}: an Assign with {what} was answered");
            }
        }
        // plaintext, no certificate, another CA, expired: at least one failed handshake each
        // (a client may retry a connection). The server counts a failure after the client has
        // already seen it fail, so the count is waited for (CI saw 3 of 4 read at once).
        br_testkit::eventually(
            START,
            &format!("{p:?}: 4 failed handshakes counted above {before}"),
            || {
                let failures = &failures;
                async move { failures(stack.metrics(p).await) - before >= 4.0 }
            },
        )
        .await;

        let stranger = stack.channel(p, &pki.stranger());
        let no_identity = stack.counter(p, "calls_denied_total", "no_identity").await;
        for m in [Method::HealthCheck, Method::ReflectionV1] {
            let status = call(m, stranger.clone(), &aim, 0).await.unwrap_err();
            assert_eq!(
                status.code(),
                Code::PermissionDenied,
                "{p:?} {m:?}: {status:?}"
            );
            assert!(status.message().contains(TD), "{p:?}: {status:?}");
        }
        let now = stack.counter(p, "calls_denied_total", "no_identity").await;
        assert_eq!(now - no_identity, 2.0, "{p:?}: no-identity denials counted");
    }
}

/// The admin ports: `/livez` and `/readyz` for anyone who completes a handshake (kubelet
/// probes present no certificate), `/metrics` (σ's loads, request counts) for the admin role
/// only; plaintext, another CA and an expired certificate get no HTTP answer at all.
async fn admin_http(stack: &Stack) {
    let pki = &stack.pki;
    let ca = pki.path("ca.pem");
    for p in PORTS {
        let svc = stack.service(p);
        let addr = svc.admin_addr();
        let mut clients: Vec<(String, Option<TlsFiles>, bool)> = CALLERS
            .iter()
            .map(|c| (format!("{c:?}"), Some(c.files(pki)), *c == Caller::Admin))
            .collect();
        clients.push(("no certificate".into(), None, false));
        clients.push(("no identity".into(), Some(pki.stranger()), false));
        for (who, files, is_admin) in &clients {
            for path in ["/livez", "/readyz"] {
                let (code, body) = pki::https_get(addr, &ca, files.as_ref(), path)
                    .await
                    .unwrap_or_else(|e| panic!("{p:?} {who} GET {path}: {e}"));
                let want: &[u16] = if path == "/livez" {
                    &[200]
                } else {
                    &[200, 503]
                };
                assert!(
                    want.contains(&code),
                    "{p:?} {who} GET {path}: {code} {body}"
                );
            }
            let (code, body) = pki::https_get(addr, &ca, files.as_ref(), "/metrics")
                .await
                .unwrap_or_else(|e| panic!("{p:?} {who} GET /metrics: {e}"));
            if *is_admin {
                assert_eq!(code, 200, "{p:?} {who} GET /metrics: {body}");
                assert!(body.contains("balanceroute_"), "{p:?}: {body}");
            } else {
                assert_eq!(code, 403, "{p:?} {who} GET /metrics: {body}");
                assert!(body.contains("/metrics"), "{p:?} {who}: {body}");
                assert!(body.contains("admin"), "{p:?} {who}: {body}");
                assert!(!body.contains("balanceroute_"), "{p:?} {who}: {body}");
            }
        }
        for caller in CALLERS.iter().filter(|c| **c != Caller::Admin) {
            let files = caller.files(pki);
            let (_, body) = pki::https_get(addr, &ca, Some(&files), "/metrics")
                .await
                .unwrap();
            assert!(body.contains(caller.role()), "{p:?}: {body}");
        }
        let plain = pki::plaintext_get(addr, "/livez").await;
        assert!(plain.is_err(), "{p:?}: plaintext HTTP answered: {plain:?}");
        for (what, files) in [
            ("another CA's certificate", pki.foreign_gateway()),
            ("an expired certificate", pki.expired_gateway()),
        ] {
            let got = pki::https_get(addr, &ca, Some(&files), "/livez").await;
            assert!(got.is_err(), "{p:?}: GET /livez with {what}: {got:?}");
        }
    }
}
