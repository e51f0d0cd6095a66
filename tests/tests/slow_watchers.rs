//! Watchers that never read cost a bounded amount of memory, with a real br-snapshot process.
//!
//! What was measured before the bound (docs/design/0017-slow-watchers.md): 2,000
//! `Snapshot.Watch` streams on 20 connections that never read, while a writer applied about
//! 100 batches/s of 256 progress changes with 200-byte request ids, took br-snapshot to
//! 0.77-1.9 GB RSS, and 0.74-1.88 GB was still held after the watchers closed.
//!
//! What this test does: the same 2,000 streams on 20 raw HTTP/2 connections whose stream
//! window (64 KiB, HTTP/2's default) is never given back, so the server may send 64 KiB on
//! each and then nothing; the same batches (at most 100/s, slower if the process acks them
//! slower), for as many versions as a watcher's queue holds events, so every queue that can
//! fill has filled. br-snapshot admits 512 of them (`--max-watchers`) and refuses the rest.
//! It samples the process's RSS all along and asserts it stays under 250 MB; then it closes
//! the watchers, waits for the watcher gauge to reach 0 with the writer still going, and
//! asserts the memory held for them is given back (RSS within 48 MiB of what the process held
//! under the same writer before they came, polled for at most 20 s). Every refusal must be
//! counted. Before the change (debug build, 2-core Xeon, load average 1.1-2.4): peak 286 MiB, 295 MiB
//! after they closed; after it: peak 184 MiB, 78 MiB after.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use br_e2e::{Service, rss_bytes};
use br_proto::v1;
use br_testkit::apply::{ApplyStream, hello, progress};
use br_testkit::eventually;
use bytes::Bytes;
use prost::Message as _;

const GROUP: &str = "slow";
const START: Duration = Duration::from_secs(60);
/// A hang guard for one wait on a loaded 2-core machine, not a timing assertion.
const LONG: Duration = Duration::from_secs(120);
const CONNECTIONS: usize = 20;
const STREAMS_PER_CONNECTION: usize = 100;
/// The stream window the watchers advertise and never give back: the server may send this
/// much on each stream, then nothing.
const STREAM_WINDOW: u32 = 64 << 10;
/// Progress changes per batch, and the length of each request id.
const CHANGES: usize = 256;
const ID_BYTES: usize = 200;
/// The writer's pace: at most one batch per this.
const PACE: Duration = Duration::from_millis(10);
/// br-snapshot's default events per watcher queue (`--watcher-queue`): after this many
/// versions every queue of a watcher that does not read is full.
const WATCHER_QUEUE: u64 = 1024;
/// The bound on the whole process while the watchers are open (250 MB).
const RSS_LIMIT_BYTES: u64 = 250_000_000;
/// What the process may hold after the watchers left above what it held under the same
/// writer load before they came.
const AFTER_MARGIN_BYTES: u64 = 48 << 20;

/// Batch `step`'s changes: the same `CHANGES` requests on worker 0, each one more token
/// along, so every batch changes all of them.
fn batch(step: u32) -> Vec<v1::TelemetryChange> {
    (0..CHANGES)
        .map(|i| {
            let id = format!("{i:0>width$}", width = ID_BYTES);
            progress(0, 1, &id, 100, step)
        })
        .collect()
}

/// The writer: paced batches until `stop`; σ's version after each ack goes to `version`.
fn spawn_writer(
    url: String,
    stop: Arc<AtomicBool>,
    version: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut apply = ApplyStream::open(&url).await;
        apply
            .send_ok(
                GROUP,
                vec![hello(0, 1, u32::try_from(CHANGES).unwrap() * 2)],
            )
            .await;
        let mut tick = tokio::time::interval(PACE);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut step = 1;
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let ack = apply.send_ok(GROUP, batch(step)).await;
            version.store(ack.version, Ordering::Relaxed);
            step += 1;
        }
    })
}

/// How the server answered one Watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// The stream is open (headers without a status): the watcher is held.
    Open,
    /// Answered with a status at once (refused).
    Refused,
}

/// What keeps one watcher's stream open: dropping it resets the stream.
type Held = (h2::client::SendRequest<Bytes>, h2::RecvStream);

/// Opens `CONNECTIONS` × `STREAMS_PER_CONNECTION` Watch streams on `addr` that never read.
async fn open_watchers(addr: SocketAddr) -> (Vec<Answer>, Vec<Held>) {
    let mut request = vec![0u8];
    let body = v1::WatchRequest {
        group: GROUP.into(),
        epoch: 0,
        last_version: 0,
    }
    .encode_to_vec();
    request.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes());
    request.extend_from_slice(&body);
    let request = Bytes::from(request);
    let mut tasks = Vec::new();
    for _ in 0..CONNECTIONS {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, conn) = h2::client::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(
                STREAM_WINDOW * u32::try_from(STREAMS_PER_CONNECTION).unwrap(),
            )
            .handshake::<_, Bytes>(tcp)
            .await
            .unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        for _ in 0..STREAMS_PER_CONNECTION {
            let mut send = send.clone().ready().await.unwrap();
            let req = http::Request::post(format!("http://{addr}/balanceroute.v1.Snapshot/Watch"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(())
                .unwrap();
            let (response, mut stream) = send.send_request(req, false).unwrap();
            stream.send_data(request.clone(), true).unwrap();
            tasks.push(tokio::spawn(async move {
                let response = response.await.unwrap();
                let answer = if response.headers().contains_key("grpc-status") {
                    Answer::Refused
                } else {
                    Answer::Open
                };
                // Never read: the body's window is never given back.
                (answer, (send, response.into_body()))
            }));
        }
    }
    let mut answers = Vec::new();
    let mut held = Vec::new();
    for t in tasks {
        let (a, h) = tokio::time::timeout(LONG, t).await.unwrap().unwrap();
        answers.push(a);
        held.push(h);
    }
    (answers, held)
}

async fn metrics(snapshot: &Service) -> br_testkit::Metrics {
    br_testkit::http::metrics_url(&snapshot.admin_url("/metrics")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_that_never_read_hold_bounded_memory_and_give_it_back() {
    let snapshot = Service::start("br-snapshot", &[]);
    snapshot.wait_for("/livez", START).await;
    let pid = snapshot.pid().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let version = Arc::new(AtomicU64::new(0));
    let writer = spawn_writer(snapshot.grpc_url(), stop.clone(), version.clone());

    // The load's own footprint (σ, the history of deltas) before any watcher: as many
    // versions as the watchers will see below.
    eventually(
        LONG,
        "the writer applied a queue's worth of versions",
        || {
            let v = version.load(Ordering::Relaxed);
            async move { v >= WATCHER_QUEUE }
        },
    )
    .await;
    let before = rss_bytes(pid);

    let (answers, held) = open_watchers(snapshot.grpc_addr()).await;
    let open = answers.iter().filter(|a| **a == Answer::Open).count();
    let refused = answers.len() - open;
    let opened_at = version.load(Ordering::Relaxed);
    let mut peak = rss_bytes(pid);
    let target = opened_at + WATCHER_QUEUE + 64;
    eventually(
        LONG,
        "a queue's worth of versions applied with the watchers open",
        || {
            peak = peak.max(rss_bytes(pid));
            let v = version.load(Ordering::Relaxed);
            async move { v >= target }
        },
    )
    .await;
    peak = peak.max(rss_bytes(pid));
    let m = metrics(&snapshot).await;
    let gauge = m.sum("balanceroute_snapshot_watchers");
    let refusals = m.sum("balanceroute_snapshot_refused_total");
    let resets = m.value(
        "balanceroute_snapshot_watch_resets_total",
        &[("group", GROUP), ("reason", "slow_consumer")],
    );
    eprintln!(
        "before {} MiB; {open} watchers open, {refused} refused; peak {} MiB; gauge {gauge}, \
         refused_total {refusals}, slow-consumer resets {resets}",
        before >> 20,
        peak >> 20
    );
    assert!(open > 0, "no watcher was let in");
    // Every watcher refused at the door (max_watchers) or ended since (its share of the
    // queue budget) is counted, by its limit.
    let ended = open - gauge as usize;
    assert_eq!(
        refusals,
        (refused + ended) as f64,
        "{refused} refused and {ended} ended, {refusals} counted"
    );

    drop(held);
    eventually(LONG, "the watcher gauge is 0", || async {
        metrics(&snapshot)
            .await
            .sum("balanceroute_snapshot_watchers")
            == 0.0
    })
    .await;
    let closed_at = rss_bytes(pid);
    let after_limit = before + AFTER_MARGIN_BYTES;
    // The allocator may give pages back a moment after the frees: wait for it, bounded.
    let mut after = closed_at;
    let released = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            after = rss_bytes(pid);
            if after <= after_limit {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .is_ok();
    stop.store(true, Ordering::Relaxed);
    writer.await.unwrap();
    eprintln!(
        "after close: {} MiB at gauge 0, {} MiB last (limit {} MiB)",
        closed_at >> 20,
        after >> 20,
        after_limit >> 20
    );
    assert!(
        peak < RSS_LIMIT_BYTES,
        "br-snapshot peaked at {} MiB with {open} watchers that never read (before: {} MiB)",
        peak >> 20,
        before >> 20
    );
    assert!(
        released,
        "br-snapshot still holds {} MiB after the watchers left (before: {} MiB)",
        after >> 20,
        before >> 20
    );
}
