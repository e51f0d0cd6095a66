//! assign-load: an open-loop `Assign` load generator for a running stack, reporting the latency
//! the decision service adds (client-observed latency minus the response's `pool_wait_us`).
//!
//! ```text
//! br-snapshot &  br-decision --policy br0 &
//! assign-load --rate 5000 --duration 20s --workers 8 --capacity 512 \
//!             --progress-events 100000 --hold 300ms
//! ```
//!
//! With `--workers N` (default 8) it also plays the telemetry side directly on the snapshot
//! service's `Apply` stream (what ingest does after coalescing): it says Hello for N workers,
//! reports each assigned request as running on its rank, sends `--progress-events` progress
//! updates per second in 1 ms batches, and finishes each request `--hold` after its answer, so
//! σ stays bounded. `--workers 0` leaves telemetry to a real ingest/shim/emulator setup.
//!
//! Many groups: `--groups N` (N > 1) spreads the calls uniformly over the groups
//! `<--group>-0` … `<--group>-(N-1)` (start br-decision with the same `--groups` list) and
//! plays `--workers` fake workers in each of them; the progress events are spread over every
//! group's running requests. Latencies are reported over all groups and per-group p99's
//! spread.
//!
//! Offering 10k calls/s on a small machine: `--connections N` opens N HTTP/2 connections to
//! each decision address (calls go round robin over them; one connection is one h2 task on
//! each side, which serialises every frame of every call through one core), and
//! `--batch-interval` sets how often each group's telemetry batch is sent (ingest's own
//! coalescing interval is 2 ms; at 64 groups a 1 ms batch is 64k Apply messages a second).
//! The report says how honest the offered load was: calls skipped at `--max-in-flight`, how
//! late calls left against their open-loop schedule (p50/p99/max, and how many more than
//! 1 ms late), telemetry events and batches actually sent per second against the offer, and
//! the generator's own CPU time (from /proc/self/stat), so a saturated generator shows itself.
//!
//! Mutual TLS: `--tls-cert/--tls-key/--tls-ca` is the identity `Assign` is called with (the
//! gateway's, e.g. `gateway.pem` from `scripts/dev-certs.sh`); the decision service is verified
//! as role decision. Only an ingest may call the snapshot service's `Apply`, so the telemetry
//! side (`--workers N > 0`) presents `--tls-apply-cert/--tls-apply-key` (e.g. `ingest.pem`),
//! verified by the same CA, and verifies the server as role snapshot.

#[path = "../common/latency.rs"]
mod latency;
use latency::{latency_histogram, report, us};

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use br_client::assign::{AssignClient, AssignParams, RetryPolicy};
use br_proto::v1;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::telemetry_change::Kind as T;
use clap::Parser;
use hdrhistogram::Histogram;
use rand::Rng as _;
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;

mod telemetry;

use telemetry::{Assigned, TelemetryCounts, telemetry};

#[derive(Debug, Parser)]
#[command(name = "assign-load", version)]
struct Opts {
    /// The decision service: one address or several replicas, comma-separated (a DNS name
    /// stands for every address it resolves to; see br_client::assign).
    #[arg(
        long,
        env = br_proto::defaults::env::DECISION_ADDR,
        value_delimiter = ',',
        default_value = br_proto::defaults::DECISION_ADDR
    )]
    decision_addr: Vec<String>,
    /// Which replica a call goes to: ordered (the first healthy one) or round-robin.
    #[arg(long, default_value = "ordered")]
    selection: br_client::assign::Selection,
    /// Most calls per Assign (1: no retry, so every failure is counted as it happens; more:
    /// retries and failover to another replica with the same request id).
    #[arg(long, default_value_t = 1)]
    max_attempts: u32,
    /// The snapshot service (for the telemetry side, see --workers).
    #[arg(
        long,
        env = br_proto::defaults::env::SNAPSHOT_ADDR,
        default_value = br_proto::defaults::SNAPSHOT_ADDR
    )]
    snapshot_addr: String,
    #[arg(long, default_value = "default")]
    group: String,
    /// Spread the calls over this many groups, named `<group>-<i>` when more than one.
    #[arg(long, default_value_t = 1)]
    groups: u32,
    /// Assign calls per second (open loop).
    #[arg(long, default_value_t = 5000.0)]
    rate: f64,
    /// How long to send (after the warm-up).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "20s")]
    duration: Duration,
    /// Results of the first part are not counted.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
    warmup: Duration,
    /// HTTP/2 connections per decision address; calls go round robin over them.
    #[arg(long, default_value_t = 1)]
    connections: usize,
    /// Telemetry side: each group's batch of changes is sent this often (one Apply message
    /// per group per interval).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1ms")]
    batch_interval: Duration,
    /// Most calls in flight; beyond it the generator counts a "skipped" call.
    #[arg(long, default_value_t = 4096)]
    max_in_flight: usize,
    /// Deadline of each call.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    deadline: Duration,
    /// Prompt tokens are uniform in [prompt-min, prompt-max].
    #[arg(long, default_value_t = 700)]
    prompt_min: u32,
    #[arg(long, default_value_t = 8000)]
    prompt_max: u32,
    /// Play N workers on the snapshot service's Apply stream (0: telemetry comes from elsewhere).
    #[arg(long, default_value_t = 8)]
    workers: u32,
    /// Capacity B of each played worker.
    #[arg(long, default_value_t = 512)]
    capacity: u32,
    /// Progress updates per second sent for the running requests (in 1 ms batches).
    #[arg(long, default_value_t = 100_000)]
    progress_events: u64,
    /// A request finishes this long after its answer.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "300ms")]
    hold: Duration,
    /// The identity `Assign` is called with (a gateway certificate) and the CA.
    #[command(flatten)]
    tls: br_trust::TlsArgs,
    /// Certificate the telemetry side presents on the snapshot service's `Apply` stream (an
    /// ingest certificate: `Apply` is for role ingest only). Needed with TLS and --workers > 0.
    #[arg(long, requires = "tls_apply_key")]
    tls_apply_cert: Option<std::path::PathBuf>,
    /// Key of --tls-apply-cert.
    #[arg(long, requires = "tls_apply_cert")]
    tls_apply_key: Option<std::path::PathBuf>,
}

/// One answered call.
struct Sample {
    at: Instant,
    latency: Duration,
    pool_wait: Duration,
    stale: bool,
}

enum Outcome {
    /// The sample, the request id, the group's index, the worker and its incarnation.
    Ok(Sample, String, usize, u32, u64),
    Err(tonic::Code),
}

/// The group names the load goes to.
fn group_names(group: &str, n: u32) -> Vec<String> {
    if n <= 1 {
        vec![group.to_owned()]
    } else {
        (0..n).map(|i| format!("{group}-{i}")).collect()
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let o = Opts::parse();
    anyhow::ensure!(o.rate > 0.0, "--rate must be positive");
    anyhow::ensure!(
        o.prompt_min >= 1 && o.prompt_min <= o.prompt_max,
        "--prompt-min must be in 1..=--prompt-max"
    );
    let tls = o
        .tls
        .load()
        .context("loading --tls-cert/--tls-key/--tls-ca")?;
    let apply_tls = match (&tls, &o.tls_apply_cert, &o.tls_apply_key) {
        (Some(_), Some(cert), Some(key)) => Some(
            br_trust::tls::TlsMaterial::load(
                br_trust::tls::TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                    ca: o.tls.tls_ca.clone().context("--tls-ca")?,
                },
                &o.tls.trust_domain,
            )
            .context("loading --tls-apply-cert/--tls-apply-key")?,
        ),
        (Some(_), ..) if o.workers > 0 => anyhow::bail!(
            "with TLS and --workers > 0, give --tls-apply-cert/--tls-apply-key (an ingest certificate: only role ingest may call Apply)"
        ),
        _ => None,
    };
    anyhow::ensure!(o.max_attempts >= 1, "--max-attempts must be at least 1");
    anyhow::ensure!(o.groups >= 1, "--groups must be at least 1");
    let groups = Arc::new(group_names(&o.group, o.groups));
    let options = br_client::assign::ClientOptions {
        selection: o.selection,
        ..Default::default()
    };
    anyhow::ensure!(o.connections >= 1, "--connections must be at least 1");
    anyhow::ensure!(
        o.batch_interval >= Duration::from_micros(100),
        "--batch-interval must be at least 100µs"
    );
    // One client per connection: each holds its own channel (one HTTP/2 connection) to every
    // address.
    let clients: Vec<AssignClient> = (0..o.connections)
        .map(|_| {
            AssignClient::with_options(o.decision_addr.iter().cloned(), tls.as_ref(), options)
                .context("--decision-addr")
                .map(|c| {
                    c.with_retry(RetryPolicy {
                        max_attempts: Some(o.max_attempts),
                        ..RetryPolicy::default()
                    })
                })
        })
        .collect::<anyhow::Result<_>>()?;
    let cpu_at_start = process_cpu();

    // Telemetry side: hello, then running / progress / finished in batches.
    let (assigned_tx, assigned_rx) = mpsc::channel::<Assigned>(65_536);
    let telemetry_counts = Arc::new(TelemetryCounts::default());
    let telemetry = if o.workers > 0 {
        Some(tokio::spawn(telemetry(
            o.snapshot_addr.clone(),
            apply_tls,
            Arc::clone(&groups),
            o.workers,
            o.capacity,
            o.progress_events,
            o.hold,
            o.batch_interval,
            assigned_rx,
            Arc::clone(&telemetry_counts),
        )))
    } else {
        drop(assigned_rx);
        None
    };
    if telemetry.is_some() {
        // Let σ show the workers before the first call.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let (res_tx, mut res_rx) = mpsc::channel::<Outcome>(65_536);
    let sem = Arc::new(Semaphore::new(o.max_in_flight));
    let start = Instant::now();
    let total = o.warmup + o.duration;
    let mut sent = 0u64;
    let mut skipped = 0u64;
    // How late each call left against its open-loop schedule (start + n / rate).
    let mut lateness = latency_histogram()?;
    let unreported = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let collector = {
        let assigned_tx = assigned_tx.clone();
        let unreported = Arc::clone(&unreported);
        tokio::spawn(async move {
            let mut out = Vec::new();
            while let Some(r) = res_rx.recv().await {
                if let Outcome::Ok(_, id, g, w, inc) = &r
                    && assigned_tx
                        .try_send(Assigned {
                            id: id.clone(),
                            group: *g,
                            worker: *w,
                            incarnation: *inc,
                        })
                        .is_err()
                {
                    // The telemetry side is behind: this request is never reported running
                    // nor finished (it leaves σ by the reservation's TTL).
                    unreported.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                out.push(r);
            }
            out
        })
    };
    let run = rand::rng().random::<u32>();
    loop {
        tick.tick().await;
        let elapsed = start.elapsed();
        if elapsed >= total {
            break;
        }
        let due = (o.rate * elapsed.as_secs_f64()) as u64;
        let mut rng = rand::rng();
        while sent < due {
            sent += 1;
            let scheduled = start + Duration::from_secs_f64(sent as f64 / o.rate);
            if scheduled >= start + o.warmup {
                lateness.saturating_record(us(Instant::now().saturating_duration_since(scheduled)));
            }
            let Ok(permit) = Arc::clone(&sem).try_acquire_owned() else {
                skipped += 1;
                continue;
            };
            let prompt = rng.random_range(o.prompt_min..=o.prompt_max);
            let g = rng.random_range(0..groups.len());
            let params =
                AssignParams::new(groups[g].clone(), format!("load-{run:08x}-{sent}"), prompt);
            let client = clients[sent as usize % clients.len()].clone();
            let tx = res_tx.clone();
            let deadline = o.deadline;
            tokio::spawn(async move {
                let t0 = Instant::now();
                let r = client.assign_within(&params, deadline).await;
                let latency = t0.elapsed();
                let out = match r {
                    Ok(a) => Outcome::Ok(
                        Sample {
                            at: t0,
                            latency,
                            pool_wait: a.pool_wait,
                            stale: a.stale,
                        },
                        params.request_id,
                        g,
                        a.worker_id,
                        a.incarnation,
                    ),
                    Err(e) => Outcome::Err(e.code()),
                };
                let _ = tx.send(out).await;
                drop(permit);
            });
        }
    }
    drop(res_tx);
    let cpu_sending = process_cpu().saturating_sub(cpu_at_start);
    let wall_sending = start.elapsed();
    // Wait for the calls in flight.
    let _ = sem.acquire_many(o.max_in_flight as u32).await;
    let results = collector.await?;
    drop(assigned_tx);
    if let Some(t) = telemetry {
        t.abort();
    }

    let counted_from = start + o.warmup;
    let mut added = latency_histogram()?;
    let mut client_lat = latency_histogram()?;
    let mut waits = latency_histogram()?;
    let mut per_group: Vec<Histogram<u64>> = (0..groups.len())
        .map(|_| latency_histogram())
        .collect::<anyhow::Result<_>>()?;
    let mut errors: std::collections::BTreeMap<String, u64> = Default::default();
    let mut stale = 0u64;
    for r in &results {
        match r {
            Outcome::Ok(s, _, g, ..) if s.at >= counted_from => {
                added.saturating_record(us(s.latency.saturating_sub(s.pool_wait)));
                per_group[*g].saturating_record(us(s.latency.saturating_sub(s.pool_wait)));
                client_lat.saturating_record(us(s.latency));
                waits.saturating_record(us(s.pool_wait));
                stale += u64::from(s.stale);
            }
            Outcome::Ok(..) => {}
            Outcome::Err(code) => *errors.entry(format!("{code:?}")).or_default() += 1,
        }
    }
    let secs = o.duration.as_secs_f64();
    println!(
        "sent {sent} calls in {:.1}s (target {:.0}/s), counted {} answers after a {:?} warm-up ({:.0}/s), skipped {skipped} (in-flight limit), stale {stale}, errors {errors:?}",
        total.as_secs_f64(),
        o.rate,
        added.len(),
        o.warmup,
        added.len() as f64 / secs
    );
    let late_1ms = lateness.len() - lateness.count_between(0, 1_000);
    report("send lateness against the open-loop schedule", &lateness);
    println!(
        "calls sent more than 1 ms late: {late_1ms} of {}; answered but never reported to telemetry (its queue full): {}",
        lateness.len(),
        unreported.load(std::sync::atomic::Ordering::Relaxed)
    );
    if o.workers > 0 {
        let t = &telemetry_counts;
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        let secs = total.as_secs_f64();
        println!(
            "telemetry sent: {} progress/finish events ({:.0}/s, offered {}/s), {} batches ({:.0}/s), {} of {} batch intervals missed (the loop was late)",
            load(&t.events),
            load(&t.events) as f64 / secs,
            o.progress_events,
            load(&t.batches),
            load(&t.batches) as f64 / secs,
            load(&t.missed_intervals),
            load(&t.intervals) + load(&t.missed_intervals),
        );
    }
    println!(
        "generator CPU while sending: {:.2} s over {:.1} s ({:.0}% of one core), {} connection(s)",
        cpu_sending.as_secs_f64(),
        wall_sending.as_secs_f64(),
        100.0 * cpu_sending.as_secs_f64() / wall_sending.as_secs_f64().max(1e-9),
        o.connections
    );
    report("added latency (client - pool_wait)", &added);
    report("client-observed latency", &client_lat);
    report("pool wait (from responses)", &waits);
    if groups.len() > 1 {
        let mut p99s: Vec<u64> = per_group
            .iter()
            .filter(|h| !h.is_empty())
            .map(|h| h.value_at_quantile(0.99))
            .collect();
        p99s.sort_unstable();
        if let (Some(lo), Some(hi)) = (p99s.first(), p99s.last()) {
            println!(
                "added latency p99 per group: min {lo} µs, median {} µs, max {hi} µs ({} of {} groups answered)",
                p99s[p99s.len() / 2],
                p99s.len(),
                groups.len()
            );
        }
    }
    Ok(())
}

/// CPU time (user + system) of this process so far, from /proc/self/stat (zero where that
/// cannot be read: not Linux).
fn process_cpu() -> Duration {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return Duration::ZERO;
    };
    // Fields after the command's closing parenthesis; utime and stime are the 14th and 15th
    // of the line, in clock ticks (USER_HZ, 100 on Linux).
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return Duration::ZERO;
    };
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse().ok())
        .collect();
    Duration::from_millis(f.iter().sum::<u64>() * 10)
}

#[cfg(test)]
#[path = "../common/cli.rs"]
mod cli;

#[cfg(test)]
mod tests {
    use super::*;
    use br_proto::defaults::{self, env};

    /// With no flags (and no variables) the driver loads br-all on its default port, as every
    /// other client does.
    #[test]
    fn with_no_flags_it_loads_br_all() {
        let o: Opts = cli::bare(&["assign-load"]);
        assert_eq!(o.decision_addr, [defaults::DECISION_ADDR]);
        assert_eq!(o.snapshot_addr, defaults::SNAPSHOT_ADDR);
        assert_eq!(
            cli::env_of::<Opts>("decision_addr").as_deref(),
            Some(env::DECISION_ADDR)
        );
        assert_eq!(
            cli::env_of::<Opts>("snapshot_addr").as_deref(),
            Some(env::SNAPSHOT_ADDR)
        );
    }
}
