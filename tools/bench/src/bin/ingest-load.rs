//! ingest-load: N concurrent telemetry streams sending batched Progress messages to an ingest,
//! with a fake snapshot service behind it; prints the sustained progress events/s.
//!
//! By default it starts everything itself: a fake snapshot service in this process (it counts
//! what arrives and acks every batch) and a `br-ingest` child process (the binary next to this
//! one) pointed at it. With `--ingest-addr` it loads an ingest that is already running (whose
//! snapshot service may be real).
//!
//! ```text
//! cargo build --release -p br-ingest
//! target/release/ingest-load --streams 16 --updates-per-message 64 --duration 10s
//! ```
//!
//! Mutual TLS (every hop, as deployed): `--tls-worker-dir DIR` is a directory written by
//! `scripts/dev-certs.sh DIR bench STREAMS` (or `br-certs`). Stream `i` presents
//! `worker-<group>-<i>.pem` (ingest accepts a worker's Hello only for its own id), the fake
//! snapshot service presents `snapshot.pem`, a started br-ingest gets `ingest.pem`, the counter
//! scrape of ingest's `/metrics` uses `admin.pem`, and everything is verified with `ca.pem`.
//! `--tls-cert/--tls-key/--tls-ca` override the fake snapshot service's identity and the CA.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use br_proto::v1;
use clap::Parser;
use hdrhistogram::Histogram;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

/// Load generator for br-ingest.
#[derive(Debug, Parser)]
#[command(name = "ingest-load")]
struct Args {
    /// Concurrent worker streams.
    #[arg(long, default_value_t = 16)]
    streams: u32,
    /// Request updates per Progress message.
    #[arg(long, default_value_t = 64)]
    updates_per_message: u32,
    /// Distinct requests per stream (each message updates the next `updates_per_message`).
    #[arg(long, default_value_t = 1024)]
    requests_per_stream: u32,
    /// Measured time (after the warm-up).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    duration: Duration,
    /// Warm-up before measuring.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
    warmup: Duration,
    /// Messages queued per stream ahead of the network (the pipelining window).
    #[arg(long, default_value_t = 32)]
    window: usize,
    /// Load this running ingest instead of starting one (e.g. http://127.0.0.1:50062).
    #[arg(long)]
    ingest_addr: Option<String>,
    /// The admin address of that ingest (for its own counters), e.g. 127.0.0.1:9062.
    #[arg(long)]
    ingest_admin: Option<SocketAddr>,
    /// The br-ingest binary to start (default: next to this binary).
    #[arg(long)]
    ingest_bin: Option<PathBuf>,
    /// Extra flags for the started br-ingest (e.g. "--batch-interval=5ms").
    #[arg(long, allow_hyphen_values = true)]
    ingest_arg: Vec<String>,
    /// Where the in-process fake snapshot service listens (default: an ephemeral port).
    #[arg(long, default_value = "127.0.0.1:0")]
    fake_snapshot_listen: SocketAddr,
    /// Tokio worker threads for the load generator.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Pace each stream at this many messages per second (0: as fast as the window allows).
    /// With pacing, the first update of every message is a probe whose arrival at the fake
    /// snapshot service is timed: the latency from a worker's message to its change batch.
    #[arg(long, default_value_t = 0.0)]
    messages_per_sec_per_stream: f64,
    /// The group the streams say Hello for (worker certificates are per group).
    #[arg(long, default_value = "bench")]
    group: String,
    /// Mutual TLS everywhere, with the certificates in DIR (see the module documentation).
    #[arg(long)]
    tls_worker_dir: Option<PathBuf>,
    /// The fake snapshot service's identity and the CA (default: DIR/snapshot.pem, DIR/ca.pem).
    #[command(flatten)]
    tls: br_trust::TlsArgs,
}

/// The certificates of a TLS run.
struct Tls {
    dir: PathBuf,
    ca: PathBuf,
    trust_domain: String,
    /// What the fake snapshot service presents.
    snapshot: Arc<br_trust::TlsMaterial>,
    /// What the counter scrape of ingest's admin port presents.
    admin: Arc<br_trust::TlsMaterial>,
}

impl Tls {
    fn load(args: &Args) -> anyhow::Result<Option<Tls>> {
        let Some(dir) = args.tls_worker_dir.clone() else {
            anyhow::ensure!(
                !args.tls.enabled(),
                "--tls-cert/--tls-key/--tls-ca need --tls-worker-dir (the workers' certificates)"
            );
            return Ok(None);
        };
        let (cert, key, ca) = match args.tls.files() {
            Some(f) => (f.cert, f.key, f.ca),
            None => (
                dir.join("snapshot.pem"),
                dir.join("snapshot-key.pem"),
                dir.join("ca.pem"),
            ),
        };
        let trust_domain = args.tls.trust_domain.clone();
        let snapshot = Self::material(cert, key, &ca, &trust_domain)?;
        let admin = Self::material(
            dir.join("admin.pem"),
            dir.join("admin-key.pem"),
            &ca,
            &trust_domain,
        )?;
        Ok(Some(Tls {
            dir,
            ca,
            trust_domain,
            snapshot,
            admin,
        }))
    }

    fn material(
        cert: PathBuf,
        key: PathBuf,
        ca: &std::path::Path,
        trust_domain: &str,
    ) -> anyhow::Result<Arc<br_trust::TlsMaterial>> {
        let what = format!("loading {} / {}", cert.display(), key.display());
        br_trust::TlsMaterial::load(
            br_trust::TlsFiles {
                cert,
                key,
                ca: ca.to_owned(),
            },
            trust_domain,
        )
        .context(what)
    }

    /// Stream `worker`'s certificate.
    fn worker(&self, group: &str, worker: u32) -> anyhow::Result<Arc<br_trust::TlsMaterial>> {
        Self::material(
            self.dir.join(format!("worker-{group}-{worker}.pem")),
            self.dir.join(format!("worker-{group}-{worker}-key.pem")),
            &self.ca,
            &self.trust_domain,
        )
    }
}

/// Send times of each stream's probe values, for the latency measurement.
type Probes = Arc<Vec<Mutex<BTreeMap<u32, Instant>>>>;

#[derive(Default)]
struct Counters {
    acked_msgs: AtomicU64,
    acked_events: AtomicU64,
    not_ok: AtomicU64,
    snap_batches: AtomicU64,
    snap_changes: AtomicU64,
    measuring: AtomicBool,
    latencies: Mutex<Vec<Duration>>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()?;
    rt.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let counters = Arc::new(Counters::default());
    let stop = CancellationToken::new();
    let tls = Tls::load(&args)?;
    let admin_tls = tls.as_ref().map(|t| t.admin.clone());

    let paced = args.messages_per_sec_per_stream > 0.0;
    let probes: Probes = Arc::new((0..args.streams).map(|_| Mutex::default()).collect());
    let fake = FakeSnapshot {
        counters: counters.clone(),
        probes: paced.then(|| probes.clone()),
    };
    let listener = tokio::net::TcpListener::bind(args.fake_snapshot_listen).await?;
    let snap_addr = listener.local_addr()?;
    {
        let stop = stop.clone();
        let server_tls = tls.as_ref().map(|t| t.snapshot.clone());
        tokio::spawn(async move {
            let service =
                v1::snapshot_server::SnapshotServer::new(fake).max_decoding_message_size(64 << 20);
            let mut server = tonic::transport::Server::builder();
            let r = match server_tls {
                None => {
                    server
                        .add_service(service)
                        .serve_with_incoming_shutdown(
                            br_trust::accept::accept(listener, Default::default(), None),
                            stop.cancelled_owned(),
                        )
                        .await
                }
                Some(m) => {
                    server
                        .add_service(service)
                        .serve_with_incoming_shutdown(
                            br_trust::tls::incoming(
                                br_trust::accept::accept(listener, Default::default(), None),
                                m.server_config(&[b"h2"]),
                                Duration::from_secs(10),
                                None,
                            ),
                            stop.cancelled_owned(),
                        )
                        .await
                }
            };
            if let Err(e) = r {
                eprintln!("fake snapshot: {e}");
            }
        });
    }

    let mut child = None;
    let (ingest_url, admin) = match &args.ingest_addr {
        Some(url) => (url.clone(), args.ingest_admin),
        None => {
            let grpc = free_addr().await?;
            let admin = free_addr().await?;
            let bin = match &args.ingest_bin {
                Some(b) => b.clone(),
                None => std::env::current_exe()?
                    .parent()
                    .context("binary directory")?
                    .join("br-ingest"),
            };
            let mut cmd = tokio::process::Command::new(&bin);
            cmd.arg("--listen")
                .arg(grpc.to_string())
                .arg("--admin-listen")
                .arg(admin.to_string())
                .arg("--snapshot-addr")
                .arg(format!("http://{snap_addr}"))
                .arg("--max-events-per-sec-per-stream")
                .arg("100000000")
                .args(tls.as_ref().map_or_else(Vec::new, |t| {
                    vec![
                        "--tls-cert".into(),
                        t.dir.join("ingest.pem").into_os_string(),
                        "--tls-key".into(),
                        t.dir.join("ingest-key.pem").into_os_string(),
                        "--tls-ca".into(),
                        t.ca.clone().into_os_string(),
                        "--trust-domain".into(),
                        t.trust_domain.clone().into(),
                    ]
                }))
                .args(&args.ingest_arg)
                .env("RUST_LOG", "warn")
                .kill_on_drop(true);
            child = Some(
                cmd.spawn()
                    .with_context(|| format!("starting {}", bin.display()))?,
            );
            (format!("http://{grpc}"), Some(admin))
        }
    };

    if let Some(admin) = admin {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let r = http_get(admin, "/readyz", admin_tls.as_ref()).await;
            if matches!(r, Ok((200, _))) {
                break;
            }
            if Instant::now() > deadline {
                bail!("ingest at {admin} never became ready (last: {r:?})");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    let mut tasks = Vec::new();
    for w in 0..args.streams {
        let worker_tls = match &tls {
            Some(t) => Some(t.worker(&args.group, w)?),
            None => None,
        };
        tasks.push(tokio::spawn(stream(
            ingest_url.clone(),
            worker_tls,
            args.group.clone(),
            w,
            Shape {
                per_message: args.updates_per_message,
                requests: args.requests_per_stream,
                window: args.window,
                rate: args.messages_per_sec_per_stream,
            },
            paced.then(|| probes.clone()),
            counters.clone(),
            stop.clone(),
        )));
    }

    tokio::time::sleep(args.warmup).await;
    let ingest_before = match admin {
        Some(a) => ingest_events(a, admin_tls.as_ref()).await.ok(),
        None => None,
    };
    let t0 = Instant::now();
    let (m0, e0, b0, c0) = snapshot(&counters);
    counters.measuring.store(true, Ordering::Relaxed);
    tokio::time::sleep(args.duration).await;
    counters.measuring.store(false, Ordering::Relaxed);
    let secs = t0.elapsed().as_secs_f64();
    let (m1, e1, b1, c1) = snapshot(&counters);
    let ingest_after = match admin {
        Some(a) => ingest_events(a, admin_tls.as_ref()).await.ok(),
        None => None,
    };
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }

    println!(
        "streams={} updates/message={} requests/stream={} window={} measured={:.1}s",
        args.streams, args.updates_per_message, args.requests_per_stream, args.window, secs
    );
    println!(
        "acked progress events/s: {:.0}   (messages/s: {:.0}; non-OK acks: {})",
        (e1 - e0) as f64 / secs,
        (m1 - m0) as f64 / secs,
        counters.not_ok.load(Ordering::Relaxed)
    );
    if let (Some(a), Some(b)) = (ingest_before, ingest_after) {
        println!(
            "ingest balanceroute_ingest_progress_events_total rate: {:.0}/s",
            (b - a) / secs
        );
    }
    println!(
        "snapshot side: {:.0} batches/s, {:.0} changes/s (after coalescing)",
        (b1 - b0) as f64 / secs,
        (c1 - c0) as f64 / secs
    );
    if paced {
        // Microseconds from 1 µs to an hour, 3 significant digits.
        let mut h = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3)?;
        if let Ok(l) = counters.latencies.lock() {
            for d in l.iter() {
                h.saturating_record(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
            }
        }
        let ms = |us: u64| -> f64 {
            if h.is_empty() {
                return f64::NAN;
            }
            us as f64 / 1e3
        };
        println!(
            "worker message -> change batch at the snapshot: n={} p50={:.3}ms p90={:.3}ms p99={:.3}ms max={:.3}ms",
            h.len(),
            ms(h.value_at_quantile(0.5)),
            ms(h.value_at_quantile(0.9)),
            ms(h.value_at_quantile(0.99)),
            ms(h.max())
        );
    }
    if let Some(mut c) = child {
        let _ = c.start_kill();
        let _ = c.wait().await;
    }
    Ok(())
}

fn snapshot(c: &Counters) -> (u64, u64, u64, u64) {
    (
        c.acked_msgs.load(Ordering::Relaxed),
        c.acked_events.load(Ordering::Relaxed),
        c.snap_batches.load(Ordering::Relaxed),
        c.snap_changes.load(Ordering::Relaxed),
    )
}

/// One worker: Hello, then Progress messages as fast as the window allows.
/// What one stream sends.
#[derive(Debug, Clone, Copy)]
struct Shape {
    per_message: u32,
    requests: u32,
    window: usize,
    rate: f64,
}

#[allow(clippy::too_many_arguments)]
async fn stream(
    url: String,
    tls: Option<Arc<br_trust::TlsMaterial>>,
    group: String,
    worker: u32,
    shape: Shape,
    probes: Option<Probes>,
    counters: Arc<Counters>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let Shape {
        per_message,
        requests,
        window,
        rate,
    } = shape;
    let endpoint = tonic::transport::Endpoint::from_shared(url)?.tcp_nodelay(true);
    let channel =
        br_trust::tls::connect(&endpoint, tls.as_ref(), Some(br_trust::Role::Ingest)).await?;
    let mut client = v1::telemetry_client::TelemetryClient::new(channel);
    let (tx, rx) = mpsc::channel(window.max(1));
    tx.send(v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Hello(v1::Hello {
            group,
            worker_id: worker,
            incarnation: 1000 + u64::from(worker),
            capacity: requests,
            endpoint: String::new(),
        })),
    })
    .await?;
    let mut acks = client.report(ReceiverStream::new(rx)).await?.into_inner();
    let ids: Vec<String> = (0..requests).map(|i| format!("w{worker}-r{i}")).collect();
    let per_message = per_message.min(requests).max(1) as usize;

    let reader = {
        let counters = counters.clone();
        tokio::spawn(async move {
            let mut last = 0;
            while let Ok(Some(a)) = acks.message().await {
                if a.seq > last {
                    let msgs = if last == 0 { 1 } else { a.seq - last };
                    last = a.seq;
                    counters.acked_msgs.fetch_add(msgs, Ordering::Relaxed);
                    counters
                        .acked_events
                        .fetch_add(msgs * per_message as u64, Ordering::Relaxed);
                }
                if a.status != v1::AckStatus::Ok as i32 {
                    counters.not_ok.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };

    let mut seq = 0u64;
    let mut cursor = 0usize;
    let mut generated = vec![0u32; ids.len()];
    let probe_id = format!("w{worker}-probe");
    // Streams start at staggered phases (as independent shims would), not in lockstep.
    let period = if rate > 0.0 {
        Duration::from_secs_f64(1.0 / rate)
    } else {
        Duration::ZERO
    };
    let phase = period.mul_f64(f64::from(worker % 97) / 97.0);
    let mut pace = (rate > 0.0).then(|| {
        let mut i = tokio::time::interval_at(tokio::time::Instant::now() + phase, period);
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        i
    });
    loop {
        if let Some(p) = pace.as_mut() {
            tokio::select! {
                _ = p.tick() => {}
                () = stop.cancelled() => break,
            }
        }
        seq += 1;
        let mut updates = Vec::with_capacity(per_message);
        let mut n = per_message;
        if let Some(probes) = &probes {
            // The probe: its generated_tokens is this message's seq.
            n -= 1;
            updates.push(v1::RequestProgress {
                request_id: probe_id.clone(),
                prompt_tokens: 1,
                generated_tokens: u32::try_from(seq).unwrap_or(u32::MAX),
                finished: false,
                unkeyed: false,
            });
            if let Some(m) = probes.get(worker as usize)
                && let Ok(mut m) = m.lock()
            {
                m.insert(u32::try_from(seq).unwrap_or(u32::MAX), Instant::now());
            }
        }
        for _ in 0..n {
            let i = cursor % ids.len();
            cursor += 1;
            generated[i] = (generated[i] + 1) % 1_000_000;
            updates.push(v1::RequestProgress {
                request_id: ids[i].clone(),
                prompt_tokens: 1000,
                generated_tokens: generated[i],
                finished: false,
                unkeyed: false,
            });
        }
        let msg = v1::WorkerReport {
            kind: Some(v1::worker_report::Kind::Progress(v1::Progress {
                seq,
                updates,
                full_state: false,
                traceparent: String::new(),
                tracestate: String::new(),
            })),
        };
        tokio::select! {
            r = tx.send(msg) => if r.is_err() { break },
            () = stop.cancelled() => break,
        }
    }
    drop(tx);
    let _ = tokio::time::timeout(Duration::from_secs(2), reader).await;
    Ok(())
}

async fn free_addr() -> std::io::Result<SocketAddr> {
    tokio::net::TcpListener::bind("127.0.0.1:0")
        .await?
        .local_addr()
}

/// A one-shot HTTP/1.1 GET; over mutual TLS (verifying the server as role ingest) with `tls`.
async fn http_get(
    addr: SocketAddr,
    path: &str,
    tls: Option<&Arc<br_trust::TlsMaterial>>,
) -> std::io::Result<(u16, String)> {
    let s = tokio::net::TcpStream::connect(addr).await?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut buf = String::new();
    match tls {
        None => {
            let mut s = s;
            s.write_all(req.as_bytes()).await?;
            s.read_to_string(&mut buf).await?;
        }
        Some(m) => {
            // The admin port speaks HTTP/1.1 (ALPN); the shared client config offers h2.
            let mut config = (*m.client_config(Some(br_trust::Role::Ingest))).clone();
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            let config = Arc::new(config);
            let name = tokio_rustls::rustls::pki_types::ServerName::from(addr.ip());
            let mut s = tokio_rustls::TlsConnector::from(config)
                .connect(name, s)
                .await?;
            s.write_all(req.as_bytes()).await?;
            // A peer closing without close_notify is an error for rustls; keep what arrived.
            let mut bytes = Vec::new();
            let mut chunk = [0u8; 16 * 1024];
            loop {
                match s.read(&mut chunk).await {
                    Ok(0) => break,
                    Ok(n) => bytes.extend_from_slice(&chunk[..n]),
                    Err(_) if !bytes.is_empty() => break,
                    Err(e) => return Err(e),
                }
            }
            buf = String::from_utf8_lossy(&bytes).into_owned();
        }
    }
    let (head, body) = buf.split_once("\r\n\r\n").unwrap_or((&buf, ""));
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, body.to_owned()))
}

async fn ingest_events(
    admin: SocketAddr,
    tls: Option<&Arc<br_trust::TlsMaterial>>,
) -> anyhow::Result<f64> {
    let (_, body) = http_get(admin, "/metrics", tls).await?;
    body.lines()
        .find_map(|l| {
            l.strip_prefix("balanceroute_ingest_progress_events_total ")
                .and_then(|v| v.trim().parse().ok())
        })
        .context("no balanceroute_ingest_progress_events_total")
}

/// Counts what arrives and acks it.
#[derive(Clone)]
struct FakeSnapshot {
    counters: Arc<Counters>,
    probes: Option<Probes>,
}

impl FakeSnapshot {
    /// Times the probes in a batch.
    fn probe(&self, b: &v1::ChangeBatch) {
        let Some(probes) = &self.probes else { return };
        let now = Instant::now();
        for c in &b.changes {
            let Some(v1::telemetry_change::Kind::RequestProgress(p)) = &c.kind else {
                continue;
            };
            let Some(w) = p
                .request_id
                .strip_suffix("-probe")
                .and_then(|r| r.strip_prefix('w'))
                .and_then(|w| w.parse::<usize>().ok())
            else {
                continue;
            };
            let Some(Ok(mut sent)) = probes.get(w).map(|m| m.lock()) else {
                continue;
            };
            // Coalescing may skip values: older ones are forgotten, only this one is timed.
            let newer = sent.split_off(&(p.generated_tokens + 1));
            let at = sent.remove(&p.generated_tokens);
            *sent = newer;
            drop(sent);
            if let Some(at) = at
                && self.counters.measuring.load(Ordering::Relaxed)
                && let Ok(mut l) = self.counters.latencies.lock()
            {
                l.push(now.duration_since(at));
            }
        }
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl v1::snapshot_server::Snapshot for FakeSnapshot {
    type WatchStream = BoxStream<v1::WatchEvent>;
    type ApplyStream = BoxStream<v1::ApplyAck>;

    async fn watch(
        &self,
        _: tonic::Request<v1::WatchRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn get(
        &self,
        _: tonic::Request<v1::GetRequest>,
    ) -> Result<tonic::Response<v1::ClusterSnapshot>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn reserve(
        &self,
        _: tonic::Request<v1::ReserveRequest>,
    ) -> Result<tonic::Response<v1::ReserveResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    type ReserveStreamStream = BoxStream<v1::ReserveResult>;
    async fn reserve_stream(
        &self,
        _: tonic::Request<tonic::Streaming<v1::ReserveCall>>,
    ) -> Result<tonic::Response<Self::ReserveStreamStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn release(
        &self,
        _: tonic::Request<v1::ReleaseRequest>,
    ) -> Result<tonic::Response<v1::ReleaseResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn list_groups(
        &self,
        _: tonic::Request<v1::ListGroupsRequest>,
    ) -> Result<tonic::Response<v1::ListGroupsResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn set_cordon(
        &self,
        _: tonic::Request<v1::SetCordonRequest>,
    ) -> Result<tonic::Response<v1::SetCordonResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn apply(
        &self,
        req: tonic::Request<tonic::Streaming<v1::ChangeBatch>>,
    ) -> Result<tonic::Response<Self::ApplyStream>, tonic::Status> {
        let mut inbound = req.into_inner();
        let counters = self.counters.clone();
        let me = self.clone();
        let (tx, rx) = mpsc::channel(256);
        tokio::spawn(async move {
            let mut version = 0;
            while let Ok(Some(b)) = inbound.message().await {
                me.probe(&b);
                version += 1;
                counters.snap_batches.fetch_add(1, Ordering::Relaxed);
                counters
                    .snap_changes
                    .fetch_add(b.changes.len() as u64, Ordering::Relaxed);
                let ack = v1::ApplyAck {
                    batch_seq: b.batch_seq,
                    epoch: 1,
                    version,
                    rejected: vec![],
                };
                if tx.send(Ok(ack)).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
