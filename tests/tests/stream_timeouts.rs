//! br-ingest ends telemetry streams that stay silent (dead peers are found), seen by
//! a raw HTTP/2 client (the `h2` crate over a plain TCP socket, no gRPC library) against the
//! real br-ingest and br-snapshot processes:
//! * a stream that never says Hello is ended with DEADLINE_EXCEEDED once `--hello-timeout`
//!   has passed (not before), and counted;
//! * a stream that said Hello and then goes silent is kept while it sends Heartbeats and ended
//!   with DEADLINE_EXCEEDED once it has been silent for `--stream-idle-timeout`, although its
//!   connection answers every HTTP/2 keepalive ping; σ then holds the worker as it holds one
//!   whose stream dropped (no longer LIVE), and counts it.
//!
//! No time is asserted except that no stream is ended before its timeout (a lower bound that
//! load cannot break); every wait has a hang guard.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use br_e2e::Service;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::{self, GetRequest, worker_report};
use br_testkit::{eventually, within};
use bytes::{Buf as _, BufMut as _, Bytes, BytesMut};
use prost::Message as _;
use tokio::net::TcpStream;

const GROUP: &str = "quiet";
const START: Duration = Duration::from_secs(60);
/// A hang guard on a loaded machine, not a timing assertion.
const GUARD: Duration = Duration::from_secs(60);
const HELLO_TIMEOUT: Duration = Duration::from_secs(1);
const IDLE_TIMEOUT: Duration = Duration::from_secs(2);

/// One `Telemetry.Report` call over a raw HTTP/2 connection.
struct RawStream {
    send: h2::SendStream<Bytes>,
    body: h2::RecvStream,
    /// The response headers (a trailers-only answer carries grpc-status here).
    headers: http::HeaderMap,
    buf: BytesMut,
}

/// How a stream ended: its grpc-status and grpc-message.
#[derive(Debug)]
struct Ended {
    code: i32,
    message: String,
}

impl RawStream {
    /// Connects, opens the HTTP/2 stream of a Report call (request headers only: no message).
    async fn open(addr: SocketAddr) -> RawStream {
        let tcp = TcpStream::connect(addr).await.expect("ingest reachable");
        let (client, connection) = h2::client::handshake(tcp).await.expect("HTTP/2 handshake");
        // Driving the connection answers the server's keepalive pings for as long as the
        // test runs: the peer is alive, only the stream is silent.
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let mut client = client.ready().await.expect("connection ready");
        let request = http::Request::builder()
            .method("POST")
            .uri(format!("http://{addr}/balanceroute.v1.Telemetry/Report"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
        let (response, send) = client.send_request(request, false).expect("stream opened");
        let response = within(GUARD, "the response headers", response)
            .await
            .expect("response headers");
        assert_eq!(response.status(), 200);
        let (parts, body) = response.into_parts();
        RawStream {
            send,
            body,
            headers: parts.headers,
            buf: BytesMut::new(),
        }
    }

    fn send(&mut self, report: &v1::WorkerReport) {
        let bytes = report.encode_to_vec();
        let mut frame = BytesMut::with_capacity(5 + bytes.len());
        frame.put_u8(0);
        frame.put_u32(u32::try_from(bytes.len()).unwrap());
        frame.put_slice(&bytes);
        self.send
            .send_data(frame.freeze(), false)
            .expect("stream open for sending");
    }

    /// The next ack, or how the stream ended.
    async fn next(&mut self) -> Result<v1::ReportAck, Ended> {
        loop {
            if self.buf.len() >= 5 {
                let len = u32::from_be_bytes(self.buf[1..5].try_into().unwrap()) as usize;
                if self.buf.len() >= 5 + len {
                    self.buf.advance(5);
                    let msg = self.buf.split_to(len);
                    return Ok(v1::ReportAck::decode(msg.freeze()).expect("a ReportAck"));
                }
            }
            match self.body.data().await {
                Some(Ok(chunk)) => {
                    let _ = self.body.flow_control().release_capacity(chunk.len());
                    self.buf.extend_from_slice(&chunk);
                }
                Some(Err(e)) => panic!("the stream broke instead of ending with a status: {e}"),
                None => return Err(self.ended().await),
            }
        }
    }

    async fn ended(&mut self) -> Ended {
        let trailers = self.body.trailers().await.expect("trailers");
        let map = trailers.as_ref().unwrap_or(&self.headers);
        let code = map
            .get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no grpc-status in {map:?}"));
        let message = map
            .get("grpc-message")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        Ended { code, message }
    }

    /// Waits for the end of the stream (no ack is expected before it).
    async fn end(&mut self) -> Ended {
        match self.next().await {
            Ok(ack) => panic!("an ack where the end was expected: {ack:?}"),
            Err(e) => e,
        }
    }
}

fn hello(worker_id: u32, incarnation: u64) -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(worker_report::Kind::Hello(v1::Hello {
            group: GROUP.into(),
            worker_id,
            incarnation,
            capacity: 4,
            endpoint: String::new(),
        })),
    }
}

fn heartbeat(seq: u64) -> v1::WorkerReport {
    v1::WorkerReport {
        kind: Some(worker_report::Kind::Heartbeat(v1::Heartbeat { seq })),
    }
}

async fn liveness(snapshot: &Service, worker_id: u32) -> Option<i32> {
    let mut c = SnapshotClient::connect(snapshot.grpc_url()).await.ok()?;
    let s = c
        .get(GetRequest {
            group: GROUP.into(),
        })
        .await
        .ok()?
        .into_inner();
    s.workers
        .iter()
        .find(|w| w.worker_id == worker_id)
        .map(|w| w.liveness)
}

async fn timeouts(ingest: &Service, reason: &str) -> f64 {
    br_testkit::http::metrics_url(&ingest.admin_url("/metrics"))
        .await
        .value(
            "balanceroute_ingest_stream_timeouts_total",
            &[("reason", reason)],
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_streams_are_ended_and_the_silent_worker_leaves_sigma_live_set() {
    let snapshot = Service::start("br-snapshot", &["--worker-grace", "30s"]);
    snapshot.wait_for("/livez", START).await;
    let hello_timeout = format!("{}ms", HELLO_TIMEOUT.as_millis());
    let idle_timeout = format!("{}ms", IDLE_TIMEOUT.as_millis());
    let ingest = Service::start(
        "br-ingest",
        &[
            "--snapshot-addr",
            &snapshot.grpc_url(),
            "--hello-timeout",
            &hello_timeout,
            "--stream-idle-timeout",
            &idle_timeout,
            // pings flow on the silent connection all along (and are answered)
            "--keepalive-interval",
            "200ms",
            "--keepalive-timeout",
            "5s",
        ],
    );
    ingest.wait_for("/readyz", START).await;
    assert_eq!(timeouts(&ingest, "hello").await, 0.0);
    assert_eq!(timeouts(&ingest, "idle").await, 0.0);

    // 1. A stream that never says Hello.
    let opened = Instant::now();
    let mut mute = RawStream::open(ingest.grpc_addr()).await;
    let end = within(GUARD, "the Hello-less stream ends", mute.end()).await;
    let after = opened.elapsed();
    assert_eq!(
        end.code,
        tonic::Code::DeadlineExceeded as i32,
        "ended with {end:?}"
    );
    assert!(end.message.contains("Hello"), "{end:?}");
    assert!(
        after >= HELLO_TIMEOUT,
        "ended after {after:?}, before its --hello-timeout {HELLO_TIMEOUT:?}"
    );
    eprintln!("no Hello: ended after {after:?} (--hello-timeout {HELLO_TIMEOUT:?})");
    assert_eq!(timeouts(&ingest, "hello").await, 1.0);

    // 2. A worker that says Hello, heartbeats for longer than the idle timeout, then goes
    //    silent while its connection stays up.
    let mut quiet = RawStream::open(ingest.grpc_addr()).await;
    quiet.send(&hello(0, 7));
    let ack = within(GUARD, "the Hello's ack", quiet.next())
        .await
        .expect("Hello acked");
    assert_eq!(ack.seq, 0);
    eventually(GUARD, "the worker LIVE in σ", || async {
        liveness(&snapshot, 0).await == Some(v1::Liveness::Live as i32)
    })
    .await;
    // Heartbeats keep the stream: twice the idle timeout of them, each acked.
    let heartbeats = 2 * IDLE_TIMEOUT.as_millis() / 100;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut last_send = Instant::now();
    for seq in 1..=u64::try_from(heartbeats).unwrap() {
        tick.tick().await;
        last_send = Instant::now();
        quiet.send(&heartbeat(seq));
        let ack = within(GUARD, "a heartbeat's ack", quiet.next())
            .await
            .unwrap_or_else(|e| panic!("a heartbeating stream was ended: {e:?}"));
        assert_eq!(ack.seq, seq);
    }
    // Silence starts at the last heartbeat's send: the server's idle timer starts when it has
    // read that message, a little later, so the end comes no sooner than this (measured from
    // the ack, it could look a few ms early).
    let silent_from = last_send;
    let end = within(GUARD, "the silent stream ends", quiet.end()).await;
    let after = silent_from.elapsed();
    assert_eq!(
        end.code,
        tonic::Code::DeadlineExceeded as i32,
        "ended with {end:?}"
    );
    assert!(
        after >= IDLE_TIMEOUT,
        "ended after {after:?} of silence, before its --stream-idle-timeout {IDLE_TIMEOUT:?}"
    );
    eprintln!("silent after Hello: ended after {after:?} (--stream-idle-timeout {IDLE_TIMEOUT:?})");
    assert_eq!(timeouts(&ingest, "idle").await, 1.0);
    // The worker's liveness follows as for a dropped stream: SUSPECT for its grace period.
    eventually(GUARD, "the silent worker no longer LIVE in σ", || async {
        liveness(&snapshot, 0).await == Some(v1::Liveness::Suspect as i32)
    })
    .await;

    // 3. The worker reconnects (a new incarnation) and is accepted: LIVE again.
    let mut back = RawStream::open(ingest.grpc_addr()).await;
    back.send(&hello(0, 8));
    let ack = within(GUARD, "the new Hello's ack", back.next())
        .await
        .expect("the reconnected worker is accepted");
    assert_eq!(ack.status, v1::AckStatus::Ok as i32);
    eventually(GUARD, "the worker LIVE again", || async {
        liveness(&snapshot, 0).await == Some(v1::Liveness::Live as i32)
    })
    .await;
}
