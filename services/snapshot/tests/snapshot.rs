//! br-snapshot over real gRPC on 127.0.0.1: the server runs in-process on ephemeral ports and
//! is driven with tonic clients (br-client's watcher is tested against it in br-client's tests). No assertion is about speed: waits
//! are for events, bounded only to turn a hang into a failure.
#![allow(clippy::unwrap_used)] // tests may panic on purpose

use br_proto::v1;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::telemetry_change as tc;
use br_proto::v1::watch_event::Kind as Ev;
use br_sigma::Sigma;
use br_snapshot::{Args, Running};
use br_testkit::apply::{ApplyStream, change, hello, progress as prog};
use br_testkit::{Metrics, PATIENCE, eventually, within};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use v1::RejectReason as R;

struct Server {
    running: Option<Running>,
    shutdown: CancellationToken,
    client: SnapshotClient<Channel>,
    url: String,
}

impl Server {
    async fn start(flags: &[&str]) -> Server {
        let mut argv = vec![
            "br-snapshot",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--shutdown-grace",
            "5s",
        ];
        argv.extend_from_slice(flags);
        let args: Args = br_runtime::config::parse_from(argv).unwrap();
        let shutdown = CancellationToken::new();
        let running = br_snapshot::start(&args, shutdown.clone()).await.unwrap();
        let url = format!("http://{}", running.grpc_addr());
        let client = SnapshotClient::connect(url.clone()).await.unwrap();
        Server {
            running: Some(running),
            shutdown,
            client,
            url,
        }
    }

    fn epoch(&self) -> u64 {
        self.running.as_ref().unwrap().extra().epoch
    }

    async fn get(&self, group: &str) -> v1::ClusterSnapshot {
        self.client
            .clone()
            .get(v1::GetRequest {
                group: group.into(),
            })
            .await
            .unwrap()
            .into_inner()
    }

    async fn watch(
        &self,
        group: &str,
        epoch: u64,
        last_version: u64,
    ) -> tonic::Streaming<v1::WatchEvent> {
        self.client
            .clone()
            .watch(v1::WatchRequest {
                group: group.into(),
                epoch,
                last_version,
            })
            .await
            .unwrap()
            .into_inner()
    }

    async fn watch_on_new_connection(
        &self,
        group: &str,
        epoch: u64,
        last_version: u64,
    ) -> tonic::Streaming<v1::WatchEvent> {
        SnapshotClient::connect(self.url.clone())
            .await
            .unwrap()
            .watch(v1::WatchRequest {
                group: group.into(),
                epoch,
                last_version,
            })
            .await
            .unwrap()
            .into_inner()
    }

    async fn ingest(&self) -> ApplyStream {
        ApplyStream::open(&self.url).await
    }

    async fn reserve(&self, group: &str, rs: Vec<v1::Reservation>) -> v1::ReserveResponse {
        self.client
            .clone()
            .reserve(v1::ReserveRequest {
                group: group.into(),
                reservations: rs,
            })
            .await
            .unwrap()
            .into_inner()
    }

    fn admin(&self) -> std::net::SocketAddr {
        self.running.as_ref().unwrap().admin_addr()
    }

    async fn metrics(&self) -> Metrics {
        br_testkit::http::metrics(self.admin()).await
    }

    /// Shuts down and checks that every call (open Watch and Apply streams included) drained.
    async fn stop(mut self) {
        self.shutdown.cancel();
        let outcome = self.running.take().unwrap().wait().await.unwrap();
        assert_eq!(outcome, br_runtime::serve::ServeOutcome::Drained);
    }
}

fn reservation(id: &str, w: u32, inc: u64, p: u32) -> v1::Reservation {
    v1::Reservation {
        request_id: id.into(),
        worker_id: w,
        incarnation: inc,
        prompt_tokens: p,
        prompt_hash: Some(7),
        max_tokens: Some(64),
        queue_if_full: false,
        expected_output_tokens: None,
        request_class_id: None,
    }
}

async fn next(stream: &mut tonic::Streaming<v1::WatchEvent>) -> Ev {
    tokio::time::timeout(PATIENCE, stream.message())
        .await
        .expect("no event in time")
        .unwrap()
        .expect("stream ended")
        .kind
        .unwrap()
}

/// The next event that is not a progress mark.
async fn next_data(stream: &mut tonic::Streaming<v1::WatchEvent>) -> Ev {
    loop {
        match next(stream).await {
            Ev::Progress(_) => {}
            e => return e,
        }
    }
}

fn code<T>(r: Result<tonic::Response<T>, tonic::Status>) -> tonic::Code {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(s) => s.code(),
    }
}

fn rejections(ack: &v1::ApplyAck) -> Vec<(u32, R)> {
    ack.rejected
        .iter()
        .map(|r| (r.index, R::try_from(r.reason).unwrap()))
        .collect()
}

/// Follows a Watch of `group` until its σ satisfies `pred` and returns that σ: each new version
/// is the signal to look again (no polling); a hang fails after PATIENCE.
async fn wait_for(
    server: &Server,
    group: &str,
    pred: impl Fn(&v1::ClusterSnapshot) -> bool,
) -> v1::ClusterSnapshot {
    let mut stream = server.watch(group, 0, 0).await;
    let mut replica: Option<Sigma> = None;
    let found = tokio::time::timeout(PATIENCE, async {
        loop {
            match next(&mut stream).await {
                Ev::Snapshot(s) => replica = Some(Sigma::from_snapshot(&s).unwrap()),
                Ev::Delta(d) => replica.as_mut().unwrap().apply_delta(&d).unwrap(),
                Ev::Progress(_) | Ev::Reset(_) => continue,
            }
            let s = replica.as_ref().unwrap().to_snapshot();
            if pred(&s) {
                return s;
            }
        }
    })
    .await;
    found.unwrap_or_else(|_| {
        panic!(
            "condition never held; σ = {:?}",
            replica.map(|r| r.to_snapshot())
        )
    })
}

fn liveness(s: &v1::ClusterSnapshot, w: u32) -> v1::Liveness {
    let w = s.workers.iter().find(|x| x.worker_id == w).unwrap();
    v1::Liveness::try_from(w.liveness).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_from_scratch_resume_with_deltas_and_the_replica_matches() {
    let server = Server::start(&[]).await;
    let epoch = server.epoch();
    let mut w = server.watch("g", 0, 0).await;
    let Ev::Snapshot(s0) = next(&mut w).await else {
        panic!()
    };
    assert_eq!((s0.epoch, s0.version, s0.group.as_str()), (epoch, 0, "g"));
    let mut replica = Sigma::from_snapshot(&s0).unwrap();

    let mut ingest = server.ingest().await;
    let mut at: Vec<Sigma> = vec![replica.clone()];
    // One batch at a time, each delta read before the next batch: a lone delta goes out at
    // once, one version per message (deltas queued behind each other would be merged).
    for v in 1..=7u64 {
        let changes = if v == 1 {
            vec![hello(0, 10, 8), hello(1, 11, 8)]
        } else {
            let i = u32::try_from(v - 2).unwrap();
            vec![prog(i % 2, 10 + u64::from(i % 2), &format!("r{i}"), 100, i)]
        };
        let ack = ingest.send("g", changes).await;
        assert!(ack.rejected.is_empty());
        let Ev::Delta(d) = next_data(&mut w).await else {
            panic!()
        };
        assert_eq!((d.epoch, d.prev_version, d.version), (epoch, v - 1, v));
        replica.apply_delta(&d).unwrap();
        at.push(replica.clone());
    }
    let now = server.get("g").await;
    assert_eq!(now.version, 7);
    assert_eq!(replica.to_snapshot(), now);

    // resuming from any held version brings that replica to the current σ
    for v in [0u64, 3, 6, 7] {
        let mut r = at[v as usize].clone();
        let mut s = server.watch("g", epoch, v).await;
        if v < 7 {
            let Ev::Delta(d) = next_data(&mut s).await else {
                panic!()
            };
            assert_eq!((d.prev_version, d.version), (v, 7));
            r.apply_delta(&d).unwrap();
        } else {
            // up to date: the next thing is a progress mark at the current version
            let Ev::Progress(p) = next(&mut s).await else {
                panic!()
            };
            assert_eq!((p.epoch, p.version), (epoch, 7));
        }
        assert_eq!(r.to_snapshot(), now);
    }

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_history_unknown_epoch_and_future_version_reset_then_snapshot() {
    let server = Server::start(&["--history", "2"]).await;
    let epoch = server.epoch();
    let mut ingest = server.ingest().await;
    ingest.send("g", vec![hello(0, 10, 8)]).await;
    for i in 0..4 {
        ingest.send("g", vec![prog(0, 10, "r", 10, i + 1)]).await;
    }
    let now = server.get("g").await;
    assert_eq!(now.version, 5);
    for (e, v, reason) in [
        (epoch, 1, v1::ResetReason::HistoryTruncated),
        (
            epoch.wrapping_add(1).max(1),
            3,
            v1::ResetReason::UnknownEpoch,
        ),
        (epoch, 99, v1::ResetReason::FutureVersion),
    ] {
        let mut s = server.watch("g", e, v).await;
        let Ev::Reset(r) = next(&mut s).await else {
            panic!()
        };
        assert_eq!((r.reason, r.epoch), (reason as i32, epoch), "{e}@{v}");
        let Ev::Snapshot(snap) = next(&mut s).await else {
            panic!()
        };
        assert_eq!(snap, now);
    }
    // the oldest held delta still resumes
    let mut s = server.watch("g", epoch, 3).await;
    let Ev::Delta(d) = next(&mut s).await else {
        panic!()
    };
    assert_eq!((d.prev_version, d.version), (3, 5));
    let metrics = server.metrics().await;
    assert!(
        metrics.value(
            "balanceroute_snapshot_watch_resets_total",
            &[("group", "g"), ("reason", "history_truncated")]
        ) == 1.0,
        "{metrics:?}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_watcher_is_reset_while_another_receives_every_delta_in_order() {
    let server = Server::start(&["--watcher-queue", "4"]).await;
    let epoch = server.epoch();
    // Each watcher on its own connection, as separate replicas are: on a shared HTTP/2
    // connection an unread stream would also use up the connection's flow-control window.
    let mut stalled = server.watch_on_new_connection("g", 0, 0).await; // never read until the end
    let mut reader = server.watch_on_new_connection("g", 0, 0).await;
    let Ev::Snapshot(_) = next(&mut reader).await else {
        panic!()
    };

    // Deltas big enough to fill the stalled stream's HTTP/2 window, then its queue.
    let pad = "x".repeat(200);
    let mut ingest = server.ingest().await;
    ingest.send("g", vec![hello(0, 10, 64)]).await;
    let n = 1500u64;
    // The reader says how far it has read; the writer stays within LAG versions of it. A
    // reader that keeps up is the case under test, and on a loaded machine a reader task left
    // without a core for a few ms fell more than its queue of 4 behind a writer at full speed
    // (a SLOW_CONSUMER reset of the reading watcher: 1 run of 4 × 93 binaries in a flake hunt).
    const LAG: u64 = 2;
    let (read_to, mut read) = tokio::sync::watch::channel(0u64);
    let reading = tokio::spawn(async move {
        let mut replica: Option<Sigma> = None;
        let mut version = 0;
        while version < n {
            match next_data(&mut reader).await {
                Ev::Snapshot(s) => replica = Some(Sigma::from_snapshot(&s).unwrap()),
                Ev::Delta(d) => {
                    assert_eq!(d.prev_version, version, "a delta was skipped");
                    version = d.version;
                    if let Some(r) = replica.as_mut() {
                        r.apply_delta(&d).unwrap();
                    }
                }
                e => panic!("the reading watcher got {e:?}"),
            }
            read_to.send_replace(version);
        }
        version
    });
    // ~2 KB per delta, 3 MB in all: more than the HTTP/2 buffers of the stalled stream (the
    // client's window and the server's send buffer) plus its queue. σ itself stays small.
    for i in 1..n {
        // σ's version after the Hello and i - 1 of these batches is i
        tokio::time::timeout(PATIENCE, read.wait_for(|&v| v + LAG >= i))
            .await
            .expect("the reading watcher keeps up")
            .expect("the reader is running");
        let i = u32::try_from(i).unwrap();
        let changes = (0..8)
            .map(|r| prog(0, 10, &format!("{pad}-{r}"), 10, i))
            .collect();
        ingest.send("g", changes).await;
    }
    assert_eq!(
        tokio::time::timeout(PATIENCE, reading)
            .await
            .unwrap()
            .unwrap(),
        n
    );

    // The stalled watcher: the deltas it had buffered, in order, then a SLOW_CONSUMER reset and
    // a snapshot, then the deltas after it. The reset can come while the deltas are still being
    // sent (when the queue fills depends on the machine), and as the stream is still not read
    // while they go on, its queue can overflow again: each reset is followed by a snapshot of
    // σ at that moment, never by a delta. Read on to the current version.
    let current = server.get("g").await;
    let mut replica: Option<Sigma> = None;
    let mut resets = 0u32;
    let mut awaiting_snapshot = false;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let caught_up = replica
            .as_ref()
            .is_some_and(|r| r.version() >= current.version);
        if resets > 0 && !awaiting_snapshot && caught_up {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no reset came, or the deltas after it stopped ({resets} resets)"
        );
        match next(&mut stalled).await {
            Ev::Snapshot(s) => {
                replica = Some(Sigma::from_snapshot(&s).unwrap());
                awaiting_snapshot = false;
            }
            Ev::Delta(d) => {
                assert!(
                    !awaiting_snapshot,
                    "a delta between a reset and its snapshot"
                );
                replica.as_mut().unwrap().apply_delta(&d).unwrap();
            }
            Ev::Reset(r) => {
                assert_eq!(r.reason, v1::ResetReason::SlowConsumer as i32);
                resets += 1;
                awaiting_snapshot = true;
            }
            Ev::Progress(_) => {}
        }
    }
    let replica = replica.unwrap();
    assert_eq!(replica.epoch(), epoch);
    assert_eq!(replica.to_snapshot(), current);
    let metrics = server.metrics().await;
    assert_eq!(
        metrics.value(
            "balanceroute_snapshot_watch_resets_total",
            &[("group", "g"), ("reason", "slow_consumer")]
        ),
        f64::from(resets),
        "{metrics:?}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_count_at_once_become_active_or_expire_after_the_ttl() {
    let server = Server::start(&["--reservation-ttl", "300ms"]).await;
    let mut ingest = server.ingest().await;
    ingest
        .send("g", vec![hello(0, 10, 4), hello(1, 11, 4)])
        .await;
    let mut w = server.watch("g", 0, 0).await;
    let Ev::Snapshot(_) = next(&mut w).await else {
        panic!()
    };

    let resp = server
        .reserve(
            "g",
            vec![reservation("a", 0, 10, 100), reservation("b", 1, 11, 50)],
        )
        .await;
    assert_eq!(resp.accepted, vec!["a", "b"]);
    assert!(resp.rejected.is_empty());
    let s = server.get("g").await;
    assert_eq!(s.version, resp.version);
    assert_eq!(
        s.workers.iter().map(|w| w.load_tokens).collect::<Vec<_>>(),
        vec![100, 50],
        "a reservation's prompt counts at once"
    );
    // a retry is idempotent; another worker is a duplicate
    let again = server
        .reserve(
            "g",
            vec![reservation("a", 0, 10, 100), reservation("b", 0, 10, 50)],
        )
        .await;
    assert_eq!(
        (again.accepted, again.version),
        (vec!["a".to_string()], resp.version)
    );
    assert_eq!(again.rejected[0].reason, R::Duplicate as i32);

    // "b" is reported by its worker: active; "a" never is: expires
    ingest.send("g", vec![prog(1, 11, "b", 50, 3)]).await;
    let s = wait_for(&server, "g", |s| {
        s.requests.iter().all(|r| r.request_id != "a")
    })
    .await;
    let b = s.requests.iter().find(|r| r.request_id == "b").unwrap();
    assert_eq!(b.state, v1::RequestPhase::Active as i32);
    assert_eq!(b.prompt_hash, Some(7), "the reservation's hash is kept");
    // watchers saw the expiry as a change
    let mut expired = false;
    while !expired {
        if let Ev::Delta(d) = next_data(&mut w).await {
            expired = d.changes.iter().any(|c| {
                matches!(&c.kind, Some(v1::change::Kind::RequestExpired(e)) if e.request_id == "a")
            });
        }
    }
    let metrics = server.metrics().await;
    assert!(
        metrics.value(
            "balanceroute_snapshot_reservations_expired_total",
            &[("group", "g")]
        ) == 1.0,
        "{metrics:?}"
    );
    // release: only reserved requests
    server.reserve("g", vec![reservation("c", 0, 10, 5)]).await;
    let rel = server
        .client
        .clone()
        .release(v1::ReleaseRequest {
            group: "g".into(),
            request_ids: vec!["c".into(), "b".into(), "unknown".into()],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rel.released, 1);
    let s = server.get("g").await;
    assert_eq!(
        s.requests
            .iter()
            .map(|r| r.request_id.as_str())
            .collect::<Vec<_>>(),
        vec!["b"]
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_stream_is_gone_is_fenced_after_the_grace_period() {
    let server = Server::start(&["--worker-grace", "300ms"]).await;
    let mut a = server.ingest().await;
    a.send("g", vec![hello(0, 10, 4), prog(0, 10, "r", 10, 1)])
        .await;
    let mut b = server.ingest().await;
    b.send("g", vec![hello(1, 11, 4), prog(1, 11, "q", 10, 1)])
        .await;
    // ingest's stream A ends: its workers are disconnected at that moment
    drop(a);
    let s = wait_for(&server, "g", |s| liveness(s, 0) == v1::Liveness::Fenced).await;
    assert!(
        s.requests.iter().all(|r| r.worker_id != 0),
        "a fenced worker holds nothing"
    );
    assert_eq!(
        liveness(&s, 1),
        v1::Liveness::Live,
        "another stream's worker is untouched"
    );
    let resp = server.reserve("g", vec![reservation("n", 0, 10, 5)]).await;
    assert_eq!(resp.rejected[0].reason, R::WorkerFenced as i32);
    let metrics = server.metrics().await;
    assert!(
        metrics.value(
            "balanceroute_snapshot_workers_fenced_total",
            &[("group", "g")]
        ) == 1.0,
        "{metrics:?}"
    );
    // a new incarnation comes back clean and takes work again
    let ack = b.send("g", vec![hello(0, 12, 4)]).await;
    assert!(ack.rejected.is_empty());
    let resp = server.reserve("g", vec![reservation("n", 0, 12, 5)]).await;
    assert_eq!(resp.accepted, vec!["n"]);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_says_hello_again_within_the_grace_period_keeps_its_requests() {
    let server = Server::start(&["--worker-grace", "1h"]).await;
    let mut a = server.ingest().await;
    a.send("g", vec![hello(0, 10, 4), prog(0, 10, "r", 10, 1)])
        .await;
    drop(a);
    let s = wait_for(&server, "g", |s| liveness(s, 0) == v1::Liveness::Suspect).await;
    assert_eq!(s.requests.len(), 1, "a suspect worker keeps its requests");
    let resp = server.reserve("g", vec![reservation("n", 0, 10, 5)]).await;
    assert_eq!(
        resp.rejected[0].reason,
        R::WorkerFenced as i32,
        "but takes no new ones"
    );
    let mut b = server.ingest().await;
    b.send("g", vec![hello(0, 10, 4)]).await;
    let s = server.get("g").await;
    assert_eq!(liveness(&s, 0), v1::Liveness::Live);
    assert_eq!(s.requests.len(), 1);
    // WorkerDisconnected from ingest: suspect as well
    b.send(
        "g",
        vec![change(tc::Kind::WorkerDisconnected(
            tc::WorkerDisconnected {
                worker_id: 0,
                incarnation: 10,
                disconnected_at_unix_ms: 0,
            },
        ))],
    )
    .await;
    assert_eq!(liveness(&server.get("g").await, 0), v1::Liveness::Suspect);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_incarnation_starts_clean_and_the_old_one_is_stale() {
    let server = Server::start(&[]).await;
    let mut ingest = server.ingest().await;
    ingest
        .send(
            "g",
            vec![
                hello(0, 10, 4),
                prog(0, 10, "r", 10, 5),
                prog(0, 10, "s", 10, 5),
            ],
        )
        .await;
    ingest.send("g", vec![hello(0, 20, 8)]).await;
    let s = server.get("g").await;
    assert_eq!(
        (
            s.workers[0].incarnation,
            s.workers[0].capacity,
            s.workers[0].load_tokens
        ),
        (20, 8, 0)
    );
    assert!(s.requests.is_empty());
    let ack = ingest.send("g", vec![prog(0, 10, "r", 10, 6)]).await;
    assert_eq!(rejections(&ack), vec![(0, R::StaleIncarnation)]);
    let resp = server.reserve("g", vec![reservation("x", 0, 10, 5)]).await;
    assert_eq!(resp.rejected[0].reason, R::StaleIncarnation as i32);
    server.stop().await;
}

/// Ingest keeps up to 64 batches unacknowledged, and the service has several of a stream's
/// batches in its writer at once: however many are sent without waiting, each is applied in
/// the order it came and acked in that order. Every batch here starts a new incarnation of the
/// group's worker with a request on it, so a batch applied before an earlier one of its group
/// would find its worker's incarnation stale, and σ would end on another one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_sent_without_waiting_are_applied_and_acked_in_order() {
    let server = Server::start(&[]).await;
    let groups = ["p0", "p1", "p2"];
    let rounds: u64 = 60; // 180 batches of valid changes, beyond what the writer holds at once
    let mut batches = Vec::new();
    let mut seq = 0u64;
    let batch = |seq: u64, group: &str, changes| v1::ChangeBatch {
        batch_seq: seq,
        group: group.into(),
        changes,
        ingest_id: String::new(),
        traceparent: String::new(),
        tracestate: String::new(),
    };
    for round in 1..=rounds {
        for g in groups {
            seq += 1;
            let id = format!("r{round}");
            batches.push(batch(
                seq,
                g,
                vec![hello(0, round, 4), prog(0, round, &id, 10, 1)],
            ));
        }
        if round == 30 {
            // Refused whole, in the middle of the others: a batch_seq that does not rise, and
            // a bad group name.
            batches.push(batch(seq, "p0", vec![hello(0, 1_000, 4)]));
            seq += 1;
            batches.push(batch(seq, "", vec![hello(0, 1_000, 4)]));
        }
    }
    let (tx, rx) = tokio::sync::mpsc::channel(batches.len());
    // (batch_seq, group, refused whole)
    let sent: Vec<(u64, String, bool)> = batches
        .iter()
        .map(|b| {
            (
                b.batch_seq,
                b.group.clone(),
                b.changes[0] == hello(0, 1_000, 4),
            )
        })
        .collect();
    for b in batches {
        tx.send(b).await.unwrap();
    }
    let mut acks = server
        .client
        .clone()
        .apply(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut last_version = std::collections::HashMap::<String, u64>::new();
    for (i, (batch_seq, group, refused)) in sent.iter().enumerate() {
        let ack = within(PATIENCE, "an Apply ack", acks.message())
            .await
            .unwrap()
            .expect("an ack for every batch");
        assert_eq!(ack.batch_seq, *batch_seq, "ack {i} answers batch {i}");
        if *refused {
            assert_eq!(
                rejections(&ack),
                vec![(0, R::Invalid)],
                "batch {i} is refused whole"
            );
            continue;
        }
        assert!(ack.rejected.is_empty(), "batch {i}: {ack:?}");
        let last = last_version.insert(group.clone(), ack.version).unwrap_or(0);
        assert!(ack.version > last, "batch {i}: σ of {group} moved on");
    }
    for g in groups {
        let s = server.get(g).await;
        assert_eq!(s.workers[0].incarnation, rounds, "{g}");
        let ids: Vec<&str> = s.requests.iter().map(|r| r.request_id.as_str()).collect();
        assert_eq!(ids, vec![format!("r{rounds}")], "{g}");
    }
    drop(tx);
    assert!(
        within(PATIENCE, "the end of the acks", acks.message())
            .await
            .unwrap()
            .is_none()
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_on_every_rpc_gets_a_typed_answer_and_leaves_sigma_unchanged() {
    let server = Server::start(&[]).await;
    let mut ingest = server.ingest().await;
    ingest
        .send("g", vec![hello(0, 10, 2), prog(0, 10, "r", 10, 5)])
        .await;
    let before = server.get("g").await;
    let mut c = server.client.clone();
    let long_group = "g".repeat(129);
    let long_id = "i".repeat(257);

    let get = |g: &str| v1::GetRequest { group: g.into() };
    assert_eq!(code(c.get(get("")).await), tonic::Code::InvalidArgument);
    assert_eq!(
        code(c.get(get(&long_group)).await),
        tonic::Code::InvalidArgument
    );
    let watch = v1::WatchRequest {
        group: "bad\ngroup".into(),
        epoch: 0,
        last_version: 0,
    };
    assert_eq!(code(c.watch(watch).await), tonic::Code::InvalidArgument);
    for rs in [
        vec![reservation("", 0, 10, 1)],
        vec![reservation(&long_id, 0, 10, 1)],
        vec![reservation("a", 0, 0, 1)],
        vec![reservation("a", 0, 10, 0)],
        vec![reservation("a", 0, 10, 1), reservation("a", 0, 10, 1)],
    ] {
        let req = v1::ReserveRequest {
            group: "g".into(),
            reservations: rs,
        };
        assert_eq!(code(c.reserve(req).await), tonic::Code::InvalidArgument);
    }
    let req = v1::ReserveRequest {
        group: String::new(),
        reservations: vec![],
    };
    assert_eq!(code(c.reserve(req).await), tonic::Code::InvalidArgument);
    let req = v1::ReleaseRequest {
        group: "g".into(),
        request_ids: vec![String::new()],
    };
    assert_eq!(code(c.release(req).await), tonic::Code::InvalidArgument);
    // valid calls that cannot be honoured: typed rejections in the answer
    let resp = server
        .reserve(
            "g",
            vec![
                reservation("u", 9, 1, 1),
                reservation("w", 0, 11, 1),
                reservation("r", 0, 10, 1), // already there: an idempotent accept
            ],
        )
        .await;
    assert_eq!(resp.accepted, vec!["r"]);
    assert_eq!(resp.version, before.version);
    let reasons: Vec<i32> = resp.rejected.iter().map(|r| r.reason).collect();
    assert_eq!(
        reasons,
        vec![R::UnknownWorker as i32, R::StaleIncarnation as i32]
    );
    // a worker id above the contract's one limit is malformed, not merely unknown
    let req = v1::ReserveRequest {
        group: "g".into(),
        reservations: vec![reservation("v", 2000, 1, 1)],
    };
    assert_eq!(code(c.reserve(req).await), tonic::Code::InvalidArgument);
    let resp = server
        .reserve("nogroup", vec![reservation("u", 0, 1, 1)])
        .await;
    assert_eq!(resp.rejected[0].reason, R::UnknownWorker as i32);
    // Apply: bad changes one by one, a bad group or batch_seq for the whole batch
    let ack = ingest
        .send(
            "g",
            vec![
                v1::TelemetryChange { kind: None },
                prog(0, 10, &long_id, 1, 1),
                prog(0, 10, "", 1, 1),
                prog(0, 10, "z", 10_000_001, 1),
                prog(7, 1, "z", 1, 1),
                hello(0, 10, 0),
                hello(5000, 1, 1),
                change(tc::Kind::WorkerSync(tc::WorkerSync {
                    worker_id: 0,
                    incarnation: 10,
                    request_ids: vec!["dup".into(), "dup".into()],
                })),
            ],
        )
        .await;
    assert_eq!(
        rejections(&ack),
        vec![
            (0, R::Invalid),
            (1, R::Invalid),
            (2, R::Invalid),
            (3, R::Invalid),
            (4, R::UnknownWorker),
            (5, R::Invalid),
            (6, R::Invalid),
            (7, R::Invalid)
        ]
    );
    assert_eq!(ack.version, before.version);
    let ack = ingest.send(&long_group, vec![hello(1, 1, 1)]).await;
    assert_eq!(rejections(&ack), vec![(0, R::Invalid)]);
    let seq = ingest.seq;
    let ack = ingest
        .send_raw(v1::ChangeBatch {
            ingest_id: String::new(),
            traceparent: String::new(),
            tracestate: String::new(),
            batch_seq: seq,
            group: "g".into(),
            changes: vec![hello(1, 1, 1)],
        })
        .await;
    assert_eq!(rejections(&ack), vec![(0, R::Invalid)]);
    // nothing of it reached σ, and the stream still works
    assert_eq!(server.get("g").await, before);
    let ack = ingest.send("g", vec![hello(1, 1, 1)]).await;
    assert!(ack.rejected.is_empty());
    assert_eq!(ack.version, before.version + 1);
    let metrics = server.metrics().await;
    let invalid = metrics.value(
        "balanceroute_snapshot_rejected_total",
        &[("reason", "invalid")],
    );
    assert!(invalid >= 17.0, "{invalid}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_exports_every_contract_metric_and_grpc_health_is_serving() {
    let server = Server::start(&[]).await;
    let mut ingest = server.ingest().await;
    ingest
        .send(
            "g",
            vec![hello(0, 10, 2), hello(1, 11, 2), prog(0, 10, "r", 10, 5)],
        )
        .await;
    let _w = server.watch("g", 0, 0).await;
    let metrics = server.metrics().await;
    // Every name under `# snapshot`, exported with the contract's type; the values below are
    // read with their exact label sets, so a renamed or missing label fails too.
    let names = metrics.assert_contract("snapshot");
    assert!(names.len() >= 11, "{names:?}");
    assert!(
        metrics.value(
            "balanceroute_snapshot_worker_load_tokens",
            &[("group", "g"), ("worker", "0")]
        ) == 15.0,
        "{metrics:?}"
    );
    assert!(
        metrics.value("balanceroute_snapshot_imbalance_tokens", &[("group", "g")]) == 15.0,
        "{metrics:?}"
    );
    assert!(
        metrics.value(
            "balanceroute_snapshot_barrier_idle_tokens",
            &[("group", "g")]
        ) == 15.0,
        "{metrics:?}"
    );
    assert!(
        metrics.value(
            "balanceroute_snapshot_requests",
            &[("group", "g"), ("state", "active")]
        ) == 1.0,
        "{metrics:?}"
    );
    assert_eq!(br_testkit::http::get(server.admin(), "/livez").await.0, 200);
    assert_eq!(
        br_testkit::http::get(server.admin(), "/readyz").await.0,
        200
    );

    let ch = Channel::from_shared(server.url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(ch);
    for name in ["", "balanceroute.v1.Snapshot"] {
        let st = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: name.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(
            st,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
    }
    server.stop().await;
}

/// The series of `name` whose `group` label is `group`.
fn series_of_group(m: &Metrics, name: &str, group: &str) -> usize {
    m.samples(name)
        .filter(|s| s.labels.get("group").is_some_and(|g| g == group))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_beyond_max_groups_are_refused_and_idle_ones_reclaimed_with_their_series() {
    let server = Server::start(&[
        "--max-groups",
        "4",
        "--group-idle-grace",
        "100ms",
        "--worker-grace",
        "50ms",
    ])
    .await;
    // Four groups held: two by a watcher each, two by a worker each.
    let mut held = Vec::new();
    for g in ["w0", "w1"] {
        let mut s = server.watch(g, 0, 0).await;
        assert!(matches!(next(&mut s).await, Ev::Snapshot(_)));
        held.push(s);
    }
    let mut ingest = server.ingest().await;
    let first = ingest.send_ok("a0", vec![hello(0, 10, 4)]).await;
    ingest.send_ok("a1", vec![hello(0, 10, 4)]).await;
    let mut client = server.client.clone();
    // A fifth name, by Watch and by Apply: RESOURCE_EXHAUSTED, typed and counted.
    let refused = client
        .watch(v1::WatchRequest {
            group: "new".into(),
            epoch: 0,
            last_version: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(refused.message().contains("--max-groups 4"), "{refused:?}");
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(v1::ChangeBatch {
        batch_seq: 1,
        group: "new".into(),
        changes: vec![hello(1, 10, 4)],
        ingest_id: String::new(),
        traceparent: String::new(),
        tracestate: String::new(),
    })
    .await
    .unwrap();
    let mut acks = client
        .apply(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let err = within(PATIENCE, "the Apply refusal", acks.message())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    // Get of an unknown group creates nothing.
    assert_eq!(server.get("new").await.version, 0);
    let m = server.metrics().await;
    assert_eq!(m.value("balanceroute_snapshot_groups", &[]), 4.0);
    assert_eq!(
        m.value(
            "balanceroute_snapshot_refused_total",
            &[("reason", "max_groups")]
        ),
        2.0
    );
    assert_eq!(
        series_of_group(&m, "balanceroute_snapshot_version", "new"),
        0
    );

    // The watchers go, the workers' stream ends (they are fenced after the grace): all four
    // become idle and are reclaimed, their series with them; then a new name is served.
    drop(held);
    drop(ingest);
    eventually(PATIENCE, "the four idle groups reclaimed", || async {
        server
            .metrics()
            .await
            .value("balanceroute_snapshot_groups_reclaimed_total", &[])
            == 4.0
    })
    .await;
    let m = server.metrics().await;
    assert_eq!(m.value("balanceroute_snapshot_groups", &[]), 0.0);
    for g in ["w0", "w1", "a0", "a1"] {
        for name in [
            "balanceroute_snapshot_version",
            "balanceroute_snapshot_watchers",
            "balanceroute_snapshot_worker_load_tokens",
            "balanceroute_snapshot_requests",
            "balanceroute_snapshot_watch_resets_total",
        ] {
            assert_eq!(series_of_group(&m, name, g), 0, "{name} of {g} outlived it");
        }
    }
    let mut s = server.watch("new", 0, 0).await;
    assert!(matches!(next(&mut s).await, Ev::Snapshot(_)));

    // A reclaimed group named again starts above every version it served: a watcher that
    // held a0's last version is reset, never taken as up to date with the new σ.
    // Its last version: the Hello, then one version for SUSPECT and one for FENCED.
    let old_version = first.version + 2;
    let mut resumed = server.watch("a0", server.epoch(), old_version).await;
    let Ev::Reset(r) = next(&mut resumed).await else {
        panic!("a watcher of the forgotten a0 must be reset")
    };
    assert_eq!(r.reason, v1::ResetReason::HistoryTruncated as i32, "{r:?}");
    let Ev::Snapshot(snap) = next(&mut resumed).await else {
        panic!("a snapshot follows the reset")
    };
    assert!(
        snap.version > old_version,
        "{} <= {old_version}",
        snap.version
    );
    assert!(snap.workers.is_empty());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_never_reads_is_ended_resource_exhausted_and_the_others_follow() {
    // Room for any number of events, 64 KiB of them: only the bytes can end the watcher.
    let server = Server::start(&[
        "--watcher-queue",
        "1000000",
        "--watcher-queue-bytes",
        "65536",
    ])
    .await;
    let mut ingest = server.ingest().await;
    ingest
        .send_ok("g", (0..8).map(|w| hello(w, 10, 256)).collect())
        .await;
    // A connection with a small HTTP/2 window, so the transport stops taking the watcher's
    // events soon and they back up in its queue on the server.
    let ch = Channel::from_shared(server.url.clone())
        .unwrap()
        .initial_stream_window_size(Some(16 * 1024))
        .initial_connection_window_size(Some(16 * 1024))
        .connect()
        .await
        .unwrap();
    let mut stalled = SnapshotClient::new(ch)
        .watch(v1::WatchRequest {
            group: "g".into(),
            epoch: 0,
            last_version: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut reader = server.watch("g", 0, 0).await;
    let mut replica: Option<Sigma> = None;
    // σ moves (each batch a delta of 64 changes) until the stalled watcher is ended; the
    // reader follows every delta meanwhile. Bounded in steps (64 KiB is ~40 deltas) and in
    // time.
    within(PATIENCE, "the stalled watcher ended for its bytes", async {
        for step in 1..=100_000u32 {
            let changes = (0..8)
                .flat_map(|w| (0..8).map(move |r| prog(w, 10, &format!("w{w}-r{r}"), 100, step)))
                .collect();
            let ack = ingest.send_ok("g", changes).await;
            loop {
                match next(&mut reader).await {
                    Ev::Snapshot(s) => replica = Some(Sigma::from_snapshot(&s).unwrap()),
                    Ev::Delta(d) => replica.as_mut().unwrap().apply_delta(&d).unwrap(),
                    Ev::Reset(r) => panic!("the reader was reset: {r:?}"),
                    Ev::Progress(_) => {}
                }
                if replica.as_ref().is_some_and(|r| r.version() == ack.version) {
                    break;
                }
            }
            if step % 16 == 0
                && server.metrics().await.value(
                    "balanceroute_snapshot_refused_total",
                    &[("reason", "watcher_queue_bytes")],
                ) == 1.0
            {
                return;
            }
        }
        panic!("100,000 deltas and the stalled watcher was never ended");
    })
    .await;
    assert_eq!(replica.unwrap().to_snapshot(), server.get("g").await);
    // The stalled watcher reads what its transport held, then RESOURCE_EXHAUSTED.
    let status = within(PATIENCE, "the stalled watcher's end", async {
        loop {
            match stalled.message().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("ended without a status"),
                Err(s) => return s,
            }
        }
    })
    .await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("--watcher-queue-bytes 65536"),
        "{status:?}"
    );
    assert_eq!(
        server
            .metrics()
            .await
            .value("balanceroute_snapshot_watchers", &[("group", "g")]),
        1.0
    );
    server.stop().await;
}

/// Watch streams held at once are bounded over every group (2,000 watchers that
/// never read held ~490 MB of stream buffers): with `--max-watchers 2`, a third Watch is refused
/// RESOURCE_EXHAUSTED (typed, counted), and once a watcher goes away its place is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_beyond_max_watchers_are_refused_until_one_ends() {
    let server = Server::start(&["--max-watchers", "2"]).await;
    let mut first = server.watch("a", 0, 0).await;
    assert!(matches!(next(&mut first).await, Ev::Snapshot(_)));
    let mut second = server.watch("b", 0, 0).await;
    assert!(matches!(next(&mut second).await, Ev::Snapshot(_)));
    let watch = |group: &'static str| {
        let mut client = server.client.clone();
        async move {
            client
                .watch(v1::WatchRequest {
                    group: group.into(),
                    epoch: 0,
                    last_version: 0,
                })
                .await
        }
    };
    let refused = watch("a").await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(
        refused.message().contains("--max-watchers 2"),
        "{refused:?}"
    );
    let m = server.metrics().await;
    assert_eq!(
        m.value(
            "balanceroute_snapshot_refused_total",
            &[("reason", "max_watchers")]
        ),
        1.0
    );
    drop(first);
    eventually(
        PATIENCE,
        "a watcher's place is free once it goes away",
        || async { watch("a").await.is_ok() },
    )
    .await;
    drop(second);
}

/// ReserveStream: each call is a Reserve answered by its call_id (accepted, rejected, or its
/// own error without ending the stream), with the same σ effect as a unary Reserve; closing
/// the request side ends the stream once every call is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_stream_answers_each_call_by_id_like_a_unary_reserve() {
    let server = Server::start(&[]).await;
    let mut ingest = server.ingest().await;
    ingest.send("g", vec![hello(0, 10, 4)]).await;
    ingest.send("h", vec![hello(0, 20, 4)]).await;

    let (calls, rx) = tokio::sync::mpsc::channel(8);
    let mut answers = server
        .client
        .clone()
        .reserve_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let call = |id: u64, request: Option<v1::ReserveRequest>| v1::ReserveCall {
        call_id: id,
        request,
        ..Default::default()
    };
    let req = |group: &str, rs| {
        Some(v1::ReserveRequest {
            group: group.into(),
            reservations: rs,
        })
    };
    for c in [
        call(7, req("g", vec![reservation("a", 0, 10, 100)])),
        call(8, req("", vec![reservation("x", 0, 10, 1)])),
        call(9, req("h", vec![reservation("b", 5, 20, 1)])),
        call(10, None),
        call(11, req("h", vec![reservation("c", 0, 20, 30)])),
    ] {
        calls.send(c).await.unwrap();
    }
    let mut got = std::collections::BTreeMap::new();
    while got.len() < 5 {
        let r = within(PATIENCE, "the five answers", answers.message())
            .await
            .unwrap()
            .expect("the stream stays open while calls are in flight");
        got.insert(r.call_id, r.outcome.expect("an outcome"));
    }
    use v1::reserve_result::Outcome;
    let Outcome::Response(a) = &got[&7] else {
        panic!("{:?}", got[&7])
    };
    assert_eq!(a.accepted, vec!["a"]);
    for bad in [8, 10] {
        let Outcome::Error(e) = &got[&bad] else {
            panic!("{:?}", got[&bad])
        };
        assert_eq!(e.code, tonic::Code::InvalidArgument as i32, "{e:?}");
    }
    let Outcome::Response(b) = &got[&9] else {
        panic!("{:?}", got[&9])
    };
    assert_eq!(b.rejected[0].reason, R::UnknownWorker as i32);
    let Outcome::Response(c) = &got[&11] else {
        panic!("{:?}", got[&11])
    };
    assert_eq!(c.accepted, vec!["c"]);

    // The same σ as unary calls: "a" is in g at the answered version, and a unary retry is
    // idempotent.
    assert_eq!(server.get("g").await.version, a.version);
    let again = server
        .reserve("g", vec![reservation("a", 0, 10, 100)])
        .await;
    assert_eq!(
        (again.accepted, again.version),
        (vec!["a".to_string()], a.version)
    );

    drop(calls);
    let end = within(PATIENCE, "the stream's end", answers.message()).await;
    assert!(matches!(end, Ok(None)), "{end:?}");
    server.stop().await;
}
