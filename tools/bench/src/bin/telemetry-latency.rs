//! telemetry-latency: how long a shim's report takes to reach the decision service's σ replica,
//! through a running split deployment (br-ingest → br-snapshot → br-decision's Watch), under
//! a telemetry load.
//!
//! ```text
//! br-snapshot & br-ingest & br-decision --groups default &
//! telemetry-latency --streams 64 --updates-per-message 64 --messages-per-sec-per-stream 25 \
//!                   --probes-per-sec 50 --duration 20s
//! ```
//!
//! Load: `--streams` shims (workers 0..N) each report their `--requests` requests' progress
//! on their own `Telemetry.Report` stream, paced (64 × 64 × 25 = 102,400 progress events/s by
//! default), every update a real change. Probe: one more shim (worker N) reports one probe
//! request, whose `generated_tokens` counts up, `--probes-per-sec` times a second; the time a
//! probe's message is handed to its gRPC stream is its start (a real shim's reporter adds its
//! own flush interval before that). With `--probe-via-reporter` the probe is reported through
//! br-client's `Reporter`, the code br-shim runs, flushing every `--flush-interval`: its start
//! is then the moment the token is recorded (`ReporterHandle::progress`, what the shim does
//! when the engine's stream yields one), so the reporter's batching is counted too.
//!
//! Where it arrived, all on this process's monotonic clock (one machine, one clock; no clock
//! is compared across processes):
//! * `snapshot watch`: this tool's own σ replica (br-client's watcher, the code the decision
//!   service runs) applies the delta that carries the probe: that delta's version is the
//!   probe's version V;
//! * `decision`: br-decision's `balanceroute_decision_sigma_version{group}` (set when its group
//!   task has applied a delta) is polled on its admin port while a probe is in flight; the
//!   first poll answered with a version ≥ V ends the probe. That is an upper bound, late by
//!   at most one poll (the poll's round trip is reported beside it).
//!
//! The floor: with `--floor`, `--ingest-addr` is a `floor-server` (tools/bench), which decodes
//! each report, drops it and acknowledges it. The same load runs, and a probe ends when its
//! message's `ReportAck` comes back: one hop there and one back through the same gRPC server,
//! with no work behind it. `report → decision` over that floor, measured in the same run, is
//! what the telemetry path costs beyond the transport.

#[path = "common/latency.rs"]
mod latency;
use latency::{latency_histogram, report, us};

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use br_client::watch::{Update, WatchConfig, Watcher};
use br_proto::v1;
use clap::Parser;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(name = "telemetry-latency", version)]
struct Opts {
    /// br-ingest's gRPC address (where shims report).
    #[arg(
        long,
        env = br_proto::defaults::env::INGEST_ADDR,
        default_value = br_proto::defaults::INGEST_ADDR
    )]
    ingest_addr: String,
    /// br-snapshot's gRPC address (this tool's own Watch).
    #[arg(
        long,
        env = br_proto::defaults::env::SNAPSHOT_ADDR,
        default_value = br_proto::defaults::SNAPSHOT_ADDR
    )]
    snapshot_addr: String,
    /// br-decision's admin address (host:port) whose /metrics is polled; by default br-all's,
    /// the same process as the two addresses above.
    #[arg(long, default_value = br_proto::defaults::ALL_ADMIN_LISTEN)]
    decision_admin: String,
    #[arg(long, default_value = "default")]
    group: String,
    /// Load shims (workers 0..N); the probe is worker N.
    #[arg(long, default_value_t = 64)]
    streams: u32,
    #[arg(long, default_value_t = 64)]
    updates_per_message: u32,
    /// Requests each load shim reports (each message updates the next ones, round robin).
    #[arg(long, default_value_t = 64)]
    requests: u32,
    #[arg(long, default_value_t = 25.0)]
    messages_per_sec_per_stream: f64,
    #[arg(long, default_value_t = 50.0)]
    probes_per_sec: f64,
    #[arg(long, value_parser = humantime::parse_duration, default_value = "20s")]
    duration: Duration,
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
    warmup: Duration,
    /// Report the probe through br-client's Reporter (as br-shim does) instead of handing
    /// each message to the stream directly.
    #[arg(long)]
    probe_via_reporter: bool,
    /// The probe reporter's flush interval (with --probe-via-reporter).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5ms")]
    flush_interval: Duration,
    /// `--ingest-addr` is a floor-server: time each probe to its acknowledgement (no Watch,
    /// no decision poll).
    #[arg(long, conflicts_with = "probe_via_reporter")]
    floor: bool,
}

/// One probe's times.
#[derive(Debug, Default, Clone, Copy)]
struct Probe {
    sent: Option<Instant>,
    /// σ version that carried it and when this tool's replica applied it.
    version: Option<u64>,
    at_watch: Option<Instant>,
    /// The first decision poll that showed a version ≥ `version`: its answer, and its round
    /// trip.
    at_decision: Option<Instant>,
    poll_rtt: Option<Duration>,
    /// With --floor: when the floor's ack of the probe's message came back.
    at_ack: Option<Instant>,
}

type Probes = Arc<Mutex<BTreeMap<u32, Probe>>>;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let o = Opts::parse();
    anyhow::ensure!(
        o.messages_per_sec_per_stream > 0.0 && o.probes_per_sec > 0.0,
        "rates must be positive"
    );
    let stop = CancellationToken::new();
    let probes: Probes = Arc::default();
    let pending = Arc::new(Notify::new());
    if o.floor {
        return floor(&o, probes, stop).await;
    }

    // This tool's own σ replica: which version carried each probe.
    let (watch, mut updates) = Watcher::connect_lazy(&o.snapshot_addr, WatchConfig::new(&o.group))
        .context("--snapshot-addr")?;
    let probe_id = format!("probe-{}", std::process::id());
    let watcher = {
        let probes = Arc::clone(&probes);
        let pending = Arc::clone(&pending);
        let probe_id = probe_id.clone();
        tokio::spawn(async move {
            let mut sigma: Option<br_sigma::Sigma> = None;
            while let Some(u) = updates.recv().await {
                let now = Instant::now();
                match u {
                    Update::Snapshot { sigma: s, .. } => sigma = Some(*s),
                    Update::Delta(d) => {
                        if let Some(s) = sigma.as_mut()
                            && s.apply_delta(&d).is_err()
                        {
                            sigma = None;
                        }
                    }
                    _ => continue,
                }
                let Some(s) = &sigma else { continue };
                let Some(r) = s.request(&probe_id) else {
                    continue;
                };
                let seen = r.generated_tokens;
                let mut map = probes.lock().unwrap_or_else(|e| e.into_inner());
                for (_, p) in map.range_mut(..=seen) {
                    if p.version.is_none() && p.sent.is_some() {
                        p.version = Some(s.version());
                        p.at_watch = Some(now);
                    }
                }
                drop(map);
                pending.notify_one();
            }
        })
    };

    // The decision poller: polls while any probe is out (sent, not yet seen at decision),
    // keeping each poll's answer; a probe whose version is known ends at the first poll that
    // showed that version or a later one (polls made before its version was known count too).
    let poller = {
        let probes = Arc::clone(&probes);
        let pending = Arc::clone(&pending);
        let addr = o.decision_admin.clone();
        let group = o.group.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut polls = 0u64;
            let mut rtt = latency_histogram()?;
            let mut history: std::collections::VecDeque<(Instant, Duration, u64)> =
                Default::default();
            loop {
                let out = {
                    let map = probes.lock().unwrap_or_else(|e| e.into_inner());
                    map.values()
                        .any(|p| p.sent.is_some() && p.at_decision.is_none())
                };
                if !out {
                    tokio::select! {
                        () = pending.notified() => continue,
                        () = stop.cancelled() => break,
                    }
                }
                if stop.is_cancelled() {
                    break;
                }
                let t0 = Instant::now();
                let version = decision_sigma_version(&addr, &group).await?;
                let t1 = Instant::now();
                polls += 1;
                rtt.saturating_record(us(t1 - t0));
                history.push_back((t1, t1 - t0, version));
                while history
                    .front()
                    .is_some_and(|h| t1 - h.0 > Duration::from_secs(5))
                {
                    history.pop_front();
                }
                let mut map = probes.lock().unwrap_or_else(|e| e.into_inner());
                for p in map.values_mut() {
                    let (None, Some(v)) = (p.at_decision, p.version) else {
                        continue;
                    };
                    if let Some(&(at, took, _)) = history.iter().find(|h| h.2 >= v) {
                        p.at_decision = Some(at);
                        p.poll_rtt = Some(took);
                    }
                }
            }
            anyhow::Ok((polls, rtt))
        })
    };

    let load = load_shims(&o, &stop);
    // Let σ show the workers before probing.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let probe = if o.probe_via_reporter {
        tokio::spawn(reporter_probe(
            &o,
            probe_id,
            Arc::clone(&probes),
            Arc::clone(&pending),
            stop.clone(),
        )?)
    } else {
        tokio::spawn(shim(
            o.ingest_addr.clone(),
            o.group.clone(),
            o.streams,
            1,
            1,
            o.probes_per_sec,
            Some((probe_id, Arc::clone(&probes), Arc::clone(&pending))),
            stop.clone(),
        ))
    };
    let started = run(&o, &stop, load, probe).await?;
    let (polls, rtt) = poller.await??;
    watch.stop().await;
    watcher.abort();

    let counted_from = started + o.warmup;
    let (mut to_watch, mut to_decision) = (latency_histogram()?, latency_histogram()?);
    let mut to_decision_sent = latency_histogram()?;
    let (mut sent, mut lost) = (0u64, 0u64);
    for p in probes.lock().unwrap_or_else(|e| e.into_inner()).values() {
        let Some(t0) = p.sent else { continue };
        if t0 < counted_from {
            continue;
        }
        sent += 1;
        match (p.at_watch, p.at_decision, p.poll_rtt) {
            (Some(w), Some(d), Some(rtt)) => {
                to_watch.saturating_record(us(w.saturating_duration_since(t0)));
                to_decision.saturating_record(us(d.saturating_duration_since(t0)));
                to_decision_sent.saturating_record(us((d - rtt).saturating_duration_since(t0)));
            }
            _ => lost += 1,
        }
    }
    let events = f64::from(o.streams)
        * f64::from(o.updates_per_message.min(o.requests))
        * o.messages_per_sec_per_stream;
    println!(
        "{} load shims × {} updates × {}/s = {events:.0} progress events/s offered; {sent} probes counted after a {:?} warm-up, {lost} not seen at decision; {polls} decision polls",
        o.streams, o.updates_per_message, o.messages_per_sec_per_stream, o.warmup
    );
    report("report → snapshot watch (this tool's replica)", &to_watch);
    report(
        "report → decision's replica (upper bound: first poll showing it)",
        &to_decision,
    );
    report(
        "report → that poll's request (the poll read it after this)",
        &to_decision_sent,
    );
    report("decision poll round trip", &rtt);
    Ok(())
}

/// The load shims (workers 0..`--streams`), each on its own Report stream until `stop`.
fn load_shims(o: &Opts, stop: &CancellationToken) -> Vec<Task> {
    (0..o.streams)
        .map(|w| {
            tokio::spawn(shim(
                o.ingest_addr.clone(),
                o.group.clone(),
                w,
                o.requests.max(1),
                o.updates_per_message.max(1),
                o.messages_per_sec_per_stream,
                None,
                stop.clone(),
            ))
        })
        .collect()
}

type Task = tokio::task::JoinHandle<anyhow::Result<()>>;

/// Lets the load and the probe run for the warm-up and the duration (and half a second more,
/// for the last probes to arrive), then stops them; returns when it started.
async fn run(
    o: &Opts,
    stop: &CancellationToken,
    load: Vec<Task>,
    probe: Task,
) -> anyhow::Result<Instant> {
    let started = Instant::now();
    tokio::time::sleep(o.warmup + o.duration).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    for t in load {
        t.await??;
    }
    probe.await??;
    Ok(started)
}

/// `--floor`: the load shims and the probe against a floor-server; each probe ends at its ack.
async fn floor(o: &Opts, probes: Probes, stop: CancellationToken) -> anyhow::Result<()> {
    let load = load_shims(o, &stop);
    let probe = tokio::spawn(shim(
        o.ingest_addr.clone(),
        o.group.clone(),
        o.streams,
        1,
        1,
        o.probes_per_sec,
        Some(("probe".into(), Arc::clone(&probes), Arc::new(Notify::new()))),
        stop.clone(),
    ));
    let started = run(o, &stop, load, probe).await?;
    let counted_from = started + o.warmup;
    let mut to_ack = latency_histogram()?;
    let (mut sent, mut lost) = (0u64, 0u64);
    for p in probes.lock().unwrap_or_else(|e| e.into_inner()).values() {
        let Some(t0) = p.sent.filter(|t| *t >= counted_from) else {
            continue;
        };
        sent += 1;
        match p.at_ack {
            Some(a) => to_ack.saturating_record(us(a.saturating_duration_since(t0))),
            None => lost += 1,
        }
    }
    println!(
        "floor: {} load shims × {} updates × {}/s; {sent} probes counted after a {:?} warm-up, {lost} not acknowledged",
        o.streams, o.updates_per_message, o.messages_per_sec_per_stream, o.warmup
    );
    report("report → floor's ack (one hop there, one back)", &to_ack);
    Ok(())
}

/// One shim's `Telemetry.Report` stream: Hello, then paced Progress messages. The probe shim
/// reports one request whose generated tokens count up, and stamps each message.
#[allow(clippy::too_many_arguments)]
async fn shim(
    url: String,
    group: String,
    worker: u32,
    requests: u32,
    per_message: u32,
    rate: f64,
    probe: Option<(String, Probes, Arc<Notify>)>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let channel = tonic::transport::Endpoint::from_shared(url.clone())
        .context("--ingest-addr")?
        .tcp_nodelay(true)
        .connect()
        .await
        .with_context(|| format!("connecting to {url}"))?;
    let mut client = v1::telemetry_client::TelemetryClient::new(channel);
    let (tx, rx) = mpsc::channel(64);
    tx.send(v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Hello(v1::Hello {
            group,
            worker_id: worker,
            incarnation: 7_000 + u64::from(worker),
            capacity: requests.max(1),
            endpoint: String::new(),
        })),
    })
    .await?;
    let mut acks = client.report(ReceiverStream::new(rx)).await?.into_inner();
    // The probe's acks are timed (what --floor reads; against ingest they say when ingest
    // took the message, not when σ did).
    let timed = probe.as_ref().map(|(_, probes, _)| Arc::clone(probes));
    tokio::spawn(async move {
        while let Ok(Some(ack)) = acks.message().await {
            let Some(probes) = &timed else { continue };
            let now = Instant::now();
            let mut map = probes.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(p) = map.get_mut(&u32::try_from(ack.seq).unwrap_or(u32::MAX))
                && p.at_ack.is_none()
            {
                p.at_ack = Some(now);
            }
        }
    });
    let ids: Vec<String> = (0..requests).map(|i| format!("w{worker}-r{i}")).collect();
    let mut generated = vec![0u32; ids.len()];
    let period = Duration::from_secs_f64(1.0 / rate);
    // Shims start at staggered phases, as independent processes would.
    let phase = period.mul_f64(f64::from(worker % 97) / 97.0);
    let mut pace = tokio::time::interval_at(tokio::time::Instant::now() + phase, period);
    pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let (mut seq, mut cursor) = (0u64, 0usize);
    loop {
        tokio::select! {
            _ = pace.tick() => {}
            () = stop.cancelled() => break,
        }
        seq += 1;
        let updates = match &probe {
            Some((id, ..)) => vec![v1::RequestProgress {
                request_id: id.clone(),
                prompt_tokens: 1,
                generated_tokens: u32::try_from(seq).unwrap_or(u32::MAX),
                finished: false,
                unkeyed: false,
            }],
            None => (0..per_message.min(requests))
                .map(|_| {
                    let i = cursor % ids.len();
                    cursor += 1;
                    generated[i] += 1;
                    v1::RequestProgress {
                        request_id: ids[i].clone(),
                        prompt_tokens: 1000,
                        generated_tokens: generated[i],
                        finished: false,
                        unkeyed: false,
                    }
                })
                .collect(),
        };
        let msg = v1::WorkerReport {
            kind: Some(v1::worker_report::Kind::Progress(v1::Progress {
                seq,
                updates,
                full_state: false,
                // no trace: a load tool's messages start none
                traceparent: String::new(),
                tracestate: String::new(),
            })),
        };
        if let Some((_, probes, pending)) = &probe {
            let mut map = probes.lock().unwrap_or_else(|e| e.into_inner());
            map.entry(u32::try_from(seq).unwrap_or(u32::MAX))
                .or_default()
                .sent = Some(Instant::now());
            drop(map);
            pending.notify_one();
        }
        tokio::select! {
            r = tx.send(msg) => if r.is_err() { anyhow::bail!("worker {worker}: the Report stream closed") },
            () = stop.cancelled() => break,
        }
    }
    Ok(())
}

/// The probe through br-client's Reporter (worker `--streams`): each tick records one more
/// generated token of the probe request, stamped when recorded; the reporter sends it with its
/// next flush. Returns the task that paces it.
fn reporter_probe(
    o: &Opts,
    probe_id: String,
    probes: Probes,
    pending: Arc<Notify>,
    stop: CancellationToken,
) -> anyhow::Result<impl std::future::Future<Output = anyhow::Result<()>> + use<>> {
    use br_client::reporter::{Reporter, ReporterConfig, ReporterTuning};
    let config = ReporterConfig::new(o.ingest_addr.clone(), o.group.clone(), o.streams, 1);
    let tuning = ReporterTuning {
        flush_interval: o.flush_interval,
        ..ReporterTuning::default()
    };
    let handle = Reporter::spawn_tuned(config, tuning).context("the probe's reporter")?;
    let period = Duration::from_secs_f64(1.0 / o.probes_per_sec);
    Ok(async move {
        let mut pace = tokio::time::interval(period);
        pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut generated = 0u32;
        loop {
            tokio::select! {
                _ = pace.tick() => {}
                () = stop.cancelled() => break,
            }
            if !handle.is_connected() {
                continue;
            }
            generated += 1;
            probes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(generated)
                .or_default()
                .sent = Some(Instant::now());
            handle
                .progress(&probe_id, 1, generated, false)
                .context("recording the probe")?;
            pending.notify_one();
        }
        handle.shutdown().await;
        Ok(())
    })
}

/// br-decision's σ version for `group`, from one GET /metrics (HTTP/1.1, a new connection)
/// that asks for that family only: the whole page made each poll about 200 µs longer at p50
/// and, rendered about a hundred times a second, slowed the servers measured
/// (docs/benchmarks.md, "Telemetry latency").
async fn decision_sigma_version(addr: &str, group: &str) -> anyhow::Result<u64> {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("--decision-admin {addr}"))?;
    s.set_nodelay(true)?;
    s.write_all(
        b"GET /metrics?name[]=balanceroute_decision_sigma_version HTTP/1.1\r\n\
          Host: x\r\nConnection: close\r\n\r\n",
    )
    .await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    let prefix = format!("balanceroute_decision_sigma_version{{group=\"{group}\"}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .with_context(|| format!("no {prefix}in {addr}/metrics"))
}

#[cfg(test)]
#[path = "common/cli.rs"]
mod cli;

#[cfg(test)]
mod tests {
    use super::*;
    use br_proto::defaults::{self, env};

    /// With no flags (and no variables) the driver loads br-all on its default port, as every
    /// other client does.
    #[test]
    fn with_no_flags_it_loads_br_all() {
        let o: Opts = cli::bare(&["telemetry-latency"]);
        assert_eq!(o.ingest_addr, defaults::INGEST_ADDR);
        assert_eq!(o.snapshot_addr, defaults::SNAPSHOT_ADDR);
        // The decision replica polled is the one in the same process: br-all's admin port.
        assert_eq!(o.decision_admin, defaults::ALL_ADMIN_LISTEN);
        assert_eq!(
            cli::env_of::<Opts>("ingest_addr").as_deref(),
            Some(env::INGEST_ADDR)
        );
        assert_eq!(
            cli::env_of::<Opts>("snapshot_addr").as_deref(),
            Some(env::SNAPSHOT_ADDR)
        );
    }
}
