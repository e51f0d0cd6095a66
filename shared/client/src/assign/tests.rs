#[test]
fn a_cancelled_from_a_broken_connection_is_retried_one_from_the_server_is_not() {
    let from_server = Status::cancelled("withdrawn by Cancel");
    assert!(!retryable(&from_server));
    let mut from_transport = Status::cancelled("operation was canceled");
    from_transport.set_source(std::sync::Arc::new(std::io::Error::other(
        "connection reset",
    )));
    assert!(retryable(&from_transport));
}

use super::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use v1::decision_server::{Decision, DecisionServer};

/// Fails the first `fail` calls with `code`, then answers; records request ids.
#[derive(Clone)]
struct Flaky {
    fail: u32,
    code: Code,
    calls: Arc<AtomicU32>,
    ids: Arc<std::sync::Mutex<Vec<String>>>,
    timeouts: Arc<std::sync::Mutex<Vec<bool>>>,
    /// Never answers `Assign` (a frozen replica).
    hang: bool,
    /// `Cancel` of an id other than "waiting" is RELEASED (else NOT_FOUND).
    releases: bool,
    cancels: Arc<AtomicU32>,
}

#[tonic::async_trait]
impl Decision for Flaky {
    async fn assign(
        &self,
        req: tonic::Request<v1::AssignRequest>,
    ) -> Result<tonic::Response<v1::AssignResponse>, Status> {
        self.timeouts
            .lock()
            .unwrap()
            .push(req.metadata().get("grpc-timeout").is_some());
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let m = req.into_inner();
        self.ids.lock().unwrap().push(m.request_id.clone());
        if self.hang {
            std::future::pending::<()>().await;
        }
        if n <= self.fail {
            return Err(Status::new(self.code, "try again"));
        }
        if m.prompt_tokens == 0 {
            return Err(Status::invalid_argument("prompt_tokens is 0"));
        }
        Ok(tonic::Response::new(v1::AssignResponse {
            worker_id: 3,
            endpoint: "http://rank3".into(),
            policy: "br0".into(),
            pool_wait_us: 1500,
            incarnation: 77,
            sigma_version: 9,
            stale: false,
        }))
    }
    async fn cancel(
        &self,
        req: tonic::Request<v1::CancelRequest>,
    ) -> Result<tonic::Response<v1::CancelResponse>, Status> {
        self.cancels.fetch_add(1, Ordering::SeqCst);
        let outcome = if req.into_inner().request_id == "waiting" {
            v1::CancelOutcome::Withdrawn
        } else if self.releases {
            v1::CancelOutcome::Released
        } else {
            v1::CancelOutcome::NotFound
        };
        Ok(tonic::Response::new(v1::CancelResponse {
            outcome: outcome as i32,
        }))
    }
}

async fn serve(svc: Flaky) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(DecisionServer::new(svc))
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                let _ = rx.await;
            })
            .await
            .unwrap();
    });
    (format!("http://{addr}"), tx)
}

fn flaky(fail: u32, code: Code) -> Flaky {
    Flaky {
        fail,
        code,
        calls: Arc::default(),
        ids: Arc::default(),
        timeouts: Arc::default(),
        hang: false,
        releases: false,
        cancels: Arc::default(),
    }
}

fn hanging() -> Flaky {
    Flaky {
        hang: true,
        ..flaky(0, Code::Ok)
    }
}

#[tokio::test]
async fn fails_over_to_the_next_replica_with_the_same_request_id() {
    let down = br_testkit::ReservedPort::new();
    let svc = flaky(0, Code::Ok);
    let (up, stop) = serve(svc.clone()).await;
    let client = AssignClient::connect_lazy_many([down.url(), up.clone()], None).unwrap();
    let a = client
        .assign_within(&AssignParams::new("g", "req-1", 5), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!((a.replica.as_str(), a.attempts), (up.as_str(), 2));
    assert_eq!(*svc.ids.lock().unwrap(), vec!["req-1"]);
    // The refused replica is now skipped: the next call goes straight to the live one.
    let b = client
        .assign_within(&AssignParams::new("g", "req-2", 5), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!((b.replica.as_str(), b.attempts), (up.as_str(), 1));
    let known = client.replicas().await.unwrap();
    assert_eq!(known, vec![(down.url(), true), (up.clone(), false)]);
    let _ = stop.send(());
}

#[tokio::test]
async fn a_call_in_flight_on_a_replica_that_dies_moves_to_another() {
    // The first replica is reached through a proxy whose cut closes the connection, as a
    // killed process's kernel does.
    let dying = hanging();
    let (upstream, stop1) = serve(dying.clone()).await;
    let proxy =
        br_testkit::FaultProxy::start(upstream.trim_start_matches("http://").parse().unwrap())
            .await;
    let first = proxy.url();
    let svc = flaky(0, Code::Ok);
    let (second, stop) = serve(svc.clone()).await;
    let client = AssignClient::connect_lazy_many([first.clone(), second.clone()], None).unwrap();
    let call = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .assign_within(&AssignParams::new("g", "r", 5), Duration::from_secs(30))
                .await
        }
    });
    // Wait until the call waits on the first replica, then kill it.
    br_testkit::eventually(
        Duration::from_secs(10),
        "the call reached replica 1",
        || {
            let n = dying.calls.load(Ordering::SeqCst);
            async move { n == 1 }
        },
    )
    .await;
    proxy.cut();
    let a = br_testkit::within(Duration::from_secs(20), "the call is answered", call)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((a.replica.as_str(), a.attempts), (second.as_str(), 2));
    assert_eq!(
        *svc.ids.lock().unwrap(),
        vec!["r"],
        "same id on the second replica"
    );
    let _ = (stop.send(()), stop1.send(()));
}

#[tokio::test]
async fn a_frozen_replica_is_left_after_the_attempt_timeout() {
    let (frozen, stop1) = serve(hanging()).await;
    let svc = flaky(0, Code::Ok);
    let (live, stop2) = serve(svc.clone()).await;
    let options = ClientOptions {
        attempt_timeout: Some(Duration::from_millis(200)),
        ..ClientOptions::default()
    };
    let client = AssignClient::with_options([frozen, live.clone()], None, options).unwrap();
    let a = client
        .assign_within(&AssignParams::new("g", "r", 5), Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!((a.replica.as_str(), a.attempts), (live.as_str(), 2));
    // Without another replica, the same replica is tried again (after the backoff) until
    // the caller's deadline.
    let alone_svc = hanging();
    let (frozen, stop3) = serve(alone_svc.clone()).await;
    let alone = AssignClient::with_options([frozen], None, options).unwrap();
    let err = alone
        .assign_within(&AssignParams::new("g", "r", 5), Duration::from_millis(700))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    assert!(
        alone_svc.calls.load(Ordering::SeqCst) >= 2,
        "retried in time"
    );
    for s in [stop1, stop2, stop3] {
        let _ = s.send(());
    }
}

#[tokio::test]
async fn ordered_selection_sticks_to_the_first_and_round_robin_spreads() {
    let (a, b) = (flaky(0, Code::Ok), flaky(0, Code::Ok));
    let (ua, sa) = serve(a.clone()).await;
    let (ub, sb) = serve(b.clone()).await;
    let ordered = AssignClient::connect_lazy_many([ua.clone(), ub.clone()], None).unwrap();
    for i in 0..6 {
        let p = AssignParams::new("g", format!("o{i}"), 5);
        ordered
            .assign_within(&p, Duration::from_secs(5))
            .await
            .unwrap();
    }
    assert_eq!(
        (
            a.calls.load(Ordering::SeqCst),
            b.calls.load(Ordering::SeqCst)
        ),
        (6, 0)
    );
    let options = ClientOptions {
        selection: Selection::RoundRobin,
        ..ClientOptions::default()
    };
    let rr = AssignClient::with_options([ua, ub], None, options).unwrap();
    for i in 0..6 {
        let p = AssignParams::new("g", format!("r{i}"), 5);
        rr.assign_within(&p, Duration::from_secs(5)).await.unwrap();
    }
    assert_eq!(
        (
            a.calls.load(Ordering::SeqCst),
            b.calls.load(Ordering::SeqCst)
        ),
        (9, 3)
    );
    let _ = (sa.send(()), sb.send(()));
}

#[tokio::test]
async fn every_replica_down_is_unavailable_at_the_deadline() {
    let (d1, d2) = (
        br_testkit::ReservedPort::new(),
        br_testkit::ReservedPort::new(),
    );
    let client = AssignClient::connect_lazy_many([d1.url(), d2.url()], None).unwrap();
    let err = client
        .assign_within(&AssignParams::new("g", "r", 5), Duration::from_millis(400))
        .await
        .unwrap_err();
    assert!(
        matches!(err, AssignError::Unavailable { attempts, .. } if attempts > 2),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_dns_name_stands_for_its_addresses() {
    let svc = flaky(0, Code::Ok);
    let (addr, stop) = serve(svc.clone()).await;
    let port = addr.rsplit(':').next().unwrap();
    let client =
        AssignClient::connect_lazy_many([format!("http://localhost:{port}")], None).unwrap();
    let a = client
        .assign_within(&AssignParams::new("g", "r", 5), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(a.replica, addr, "the resolved address answered");
    let known: Vec<String> = client
        .replicas()
        .await
        .unwrap()
        .into_iter()
        .map(|(a, _)| a)
        .collect();
    assert!(known.contains(&addr), "{known:?}");
    assert!(matches!(
        AssignClient::connect_lazy_many(["http://no-such-host.invalid:1"], None)
            .unwrap()
            .assign_within(&AssignParams::new("g", "r", 5), Duration::from_millis(300))
            .await,
        Err(AssignError::Unavailable { .. })
    ));
    let _ = stop.send(());
}

#[tokio::test]
async fn cancel_goes_to_every_replica_and_reports_the_strongest_outcome() {
    let a = flaky(0, Code::Ok);
    let b = Flaky {
        releases: true,
        ..flaky(0, Code::Ok)
    };
    let (ua, sa) = serve(a.clone()).await;
    let (ub, sb) = serve(b.clone()).await;
    let down = br_testkit::ReservedPort::new();
    let client = AssignClient::connect_lazy_many([down.url(), ua, ub], None).unwrap();
    let out = client
        .cancel_within("g", "assigned", Duration::from_millis(500))
        .await
        .unwrap();
    assert_eq!(out, CancelOutcome::Released, "one replica released it");
    assert_eq!(
        client.cancel("g", "waiting").await.unwrap(),
        CancelOutcome::Withdrawn
    );
    assert_eq!(
        (
            a.cancels.load(Ordering::SeqCst),
            b.cancels.load(Ordering::SeqCst)
        ),
        (2, 2)
    );
    let _ = (sa.send(()), sb.send(()));
}

#[tokio::test]
async fn retries_unavailable_with_the_same_request_id() {
    let svc = flaky(3, Code::Unavailable);
    let (addr, stop) = serve(svc.clone()).await;
    let client = AssignClient::connect(&*addr).await.unwrap();
    let p = AssignParams::new("g", "req-1", 100).with_prompt_hash(5);
    let a = client
        .assign_within(&p, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(a.worker_id, 3);
    assert_eq!(a.endpoint, "http://rank3");
    assert_eq!(a.pool_wait, Duration::from_micros(1500));
    assert_eq!((a.incarnation, a.sigma_version, a.stale), (77, 9, false));
    assert_eq!(a.attempts, 4);
    assert_eq!(*svc.ids.lock().unwrap(), vec!["req-1"; 4]);
    assert!(
        svc.timeouts.lock().unwrap().iter().all(|&t| t),
        "every attempt carries grpc-timeout"
    );
    let _ = stop.send(());
}

#[tokio::test]
async fn standby_answers_are_retried_too() {
    let svc = flaky(1, Code::FailedPrecondition);
    let (addr, stop) = serve(svc.clone()).await;
    let client = AssignClient::connect(&*addr).await.unwrap();
    let a = client
        .assign_within(&AssignParams::new("g", "r", 1), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(a.attempts, 2);
    let _ = stop.send(());
}

#[tokio::test]
async fn typed_errors_are_not_retried() {
    for (code, want) in [
        (Code::InvalidArgument, Code::InvalidArgument),
        (Code::ResourceExhausted, Code::ResourceExhausted),
        (Code::DeadlineExceeded, Code::DeadlineExceeded),
        (Code::Cancelled, Code::Cancelled),
        (Code::NotFound, Code::NotFound),
    ] {
        let svc = flaky(u32::MAX, code);
        let (addr, stop) = serve(svc.clone()).await;
        let client = AssignClient::connect(&*addr).await.unwrap();
        let err = client
            .assign_within(&AssignParams::new("g", "r", 1), Duration::from_secs(10))
            .await
            .unwrap_err();
        assert_eq!(err.code(), want, "{err}");
        assert_eq!(svc.calls.load(Ordering::SeqCst), 1, "{code:?} not retried");
        let _ = stop.send(());
    }
}

#[tokio::test]
async fn retries_stop_at_the_deadline() {
    let svc = flaky(u32::MAX, Code::Unavailable);
    let (addr, stop) = serve(svc.clone()).await;
    let client = AssignClient::connect(&*addr).await.unwrap();
    let err = client
        .assign_within(&AssignParams::new("g", "r", 1), Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(
        matches!(err, AssignError::Unavailable { attempts, .. } if attempts > 1),
        "{err:?}"
    );
    assert!(err.is_retryable());
    let _ = stop.send(());
}

#[tokio::test]
async fn unreachable_service_is_unavailable_and_lazy_client_retries() {
    // A port that refuses connections, and that no other socket can take meanwhile.
    let down = br_testkit::ReservedPort::new();
    let addr = down.url();
    let err = AssignClient::connect(&*addr).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    let client = AssignClient::connect_lazy(&*addr).unwrap();
    let err = client
        .assign_within(&AssignParams::new("g", "r", 1), Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(
        matches!(err.code(), Code::Unavailable | Code::DeadlineExceeded),
        "{err}"
    );
    assert!(matches!(
        AssignClient::connect_lazy("not a uri"),
        Err(AssignError::BadAddress { .. })
    ));
}

#[tokio::test]
async fn cancel_maps_outcomes() {
    let svc = flaky(0, Code::Ok);
    let (addr, stop) = serve(svc).await;
    let client = AssignClient::connect(&*addr).await.unwrap();
    assert_eq!(
        client.cancel("g", "waiting").await.unwrap(),
        CancelOutcome::Withdrawn
    );
    assert_eq!(
        client.cancel("g", "other").await.unwrap(),
        CancelOutcome::NotFound
    );
    let _ = stop.send(());
}

#[test]
fn backoff_starts_at_initial_and_never_exceeds_max() {
    let p = RetryPolicy::default();
    // The first retry waits about `initial_backoff`, not twice it (attempt is 1-based).
    let d = p.backoff(1);
    assert!(
        d >= p.initial_backoff / 2 && d <= p.initial_backoff,
        "{d:?}"
    );
    for attempt in 2..40 {
        let d = p.backoff(attempt);
        assert!(d <= p.max_backoff, "{attempt}: {d:?}");
    }
    assert!(p.backoff(20) >= p.max_backoff / 2);
}

/// Retries 100 µs apart, so many of them fit well within a test's deadline.
fn quick_retries(max_attempts: Option<u32>) -> RetryPolicy {
    RetryPolicy {
        initial_backoff: Duration::from_micros(100),
        max_backoff: Duration::from_micros(100),
        max_attempts,
    }
}

#[tokio::test]
async fn by_default_retries_run_until_the_deadline_not_a_count() {
    // A replica that stays unavailable for more calls than any fixed default would allow (a
    // restart: refused, then "no σ yet"), with a backoff short enough that those calls fit
    // well within the deadline: the call must still be answered, with the same request id.
    let svc = flaky(200, Code::Unavailable);
    let (addr, stop) = serve(svc.clone()).await;
    let client = AssignClient::connect_lazy(addr)
        .unwrap()
        .with_retry(quick_retries(None));
    let a = client
        .assign_within(&AssignParams::new("g", "r", 5), Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(a.attempts, 201);
    let ids = svc.ids.lock().unwrap().clone();
    assert!(ids.iter().all(|id| id == "r"), "same id on every attempt");
    let _ = stop.send(());
}

#[tokio::test]
async fn an_explicit_attempt_limit_still_ends_the_retries() {
    let svc = flaky(10, Code::Unavailable);
    let (addr, stop) = serve(svc.clone()).await;
    let client = AssignClient::connect_lazy(addr)
        .unwrap()
        .with_retry(quick_retries(Some(3)));
    let e = client
        .assign_within(&AssignParams::new("g", "r", 5), Duration::from_secs(60))
        .await
        .unwrap_err();
    assert!(
        matches!(e, AssignError::Unavailable { attempts: 3, .. }),
        "{e:?}"
    );
    assert_eq!(svc.calls.load(Ordering::SeqCst), 3);
    let _ = stop.send(());
}

#[test]
fn the_output_length_hints_go_into_the_request() {
    let plain = AssignParams::new("g", "req-1", 100).to_request();
    assert_eq!(
        (plain.expected_output_tokens, plain.request_class),
        (None, None)
    );
    let hinted = AssignParams::new("g", "req-1", 100)
        .with_max_tokens(512)
        .with_expected_output_tokens(300)
        .with_request_class("chat/tools")
        .to_request();
    assert_eq!(hinted.max_tokens, Some(512));
    assert_eq!(hinted.expected_output_tokens, Some(300));
    assert_eq!(hinted.request_class.as_deref(), Some("chat/tools"));
}
