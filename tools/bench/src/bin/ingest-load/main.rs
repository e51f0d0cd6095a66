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

mod fake_snapshot;
mod ingest;
mod stream;
mod tls;

use fake_snapshot::FakeSnapshot;
use ingest::{free_addr, http_get, ingest_events};
use stream::{Shape, stream};
use tls::Tls;

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
