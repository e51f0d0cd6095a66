//! snapshot-load: what a peer can make br-snapshot hold, against a running service.
//!
//! * `groups --count N`: one short Watch for each of N distinct group names (each stream is
//!   closed after its first event, so every group is left without watchers). Prints how many
//!   were served and how many were refused, by gRPC code.
//! * `watchers --count N --duration D`: N Watch streams on one group that are never read,
//!   while one Apply stream moves σ (64 workers, 512 requests, a batch every `--every`).
//!   Prints how many of the watchers the server ended, by gRPC code, once D is over.
//!
//! It measures nothing about the server itself: `scripts/bench-bounds.sh` reads the server's
//! RSS and CPU from /proc around it.
//!
//! ```text
//! snapshot-load --addr http://127.0.0.1:50061 groups --count 100000
//! snapshot-load --addr http://127.0.0.1:50061 watchers --count 2000 --duration 40s
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context as _, bail};
use br_proto::v1;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::telemetry_change as tc;
use clap::{Parser, Subcommand};
use futures::StreamExt as _;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

#[derive(Debug, Parser)]
#[command(name = "snapshot-load")]
struct Args {
    /// The snapshot service.
    #[arg(
        long,
        env = br_proto::defaults::env::SNAPSHOT_ADDR,
        default_value = br_proto::defaults::SNAPSHOT_ADDR
    )]
    addr: String,
    /// Watch streams per HTTP/2 connection.
    #[arg(long, default_value_t = 100)]
    per_connection: usize,
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, Subcommand)]
enum What {
    /// One short Watch per distinct group name.
    Groups {
        #[arg(long, default_value_t = 100_000)]
        count: usize,
        /// Watches in flight at once.
        #[arg(long, default_value_t = 256)]
        concurrency: usize,
    },
    /// Watchers that never read while σ moves.
    Watchers {
        #[arg(long, default_value_t = 2000)]
        count: usize,
        #[arg(long, value_parser = humantime::parse_duration, default_value = "40s")]
        duration: Duration,
        /// How often the Apply stream sends a batch.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "10ms")]
        every: Duration,
    },
}

const WORKERS: u32 = 64;
const PER_WORKER: u32 = 8;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    match args.what {
        What::Groups { count, concurrency } => {
            groups(&args.addr, args.per_connection, count, concurrency).await
        }
        What::Watchers {
            count,
            duration,
            every,
        } => watchers(&args.addr, args.per_connection, count, duration, every).await,
    }
}

async fn channels(addr: &str, n: usize) -> anyhow::Result<Vec<SnapshotClient<Channel>>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let ch = Channel::from_shared(addr.to_owned())?
            .connect()
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        out.push(SnapshotClient::new(ch).max_decoding_message_size(usize::MAX));
    }
    Ok(out)
}

fn watch_req(group: String) -> v1::WatchRequest {
    v1::WatchRequest {
        group,
        epoch: 0,
        last_version: 0,
    }
}

async fn groups(
    addr: &str,
    per_connection: usize,
    count: usize,
    concurrency: usize,
) -> anyhow::Result<()> {
    let clients = channels(addr, concurrency.div_ceil(per_connection).max(1)).await?;
    let outcomes = futures::stream::iter(0..count)
        .map(|i| {
            let mut c = clients[i % clients.len()].clone();
            async move {
                match c.watch(watch_req(format!("load-{i}"))).await {
                    // The stream's first event is the snapshot; then it is dropped (closed).
                    Ok(r) => match r.into_inner().message().await {
                        Ok(_) => "ok".to_owned(),
                        Err(s) => format!("{:?}", s.code()),
                    },
                    Err(s) => format!("{:?}", s.code()),
                }
            }
        })
        .buffer_unordered(concurrency)
        .fold(BTreeMap::<String, usize>::new(), |mut m, code| async move {
            *m.entry(code).or_default() += 1;
            m
        })
        .await;
    println!("groups: {count} names watched once: {outcomes:?}");
    Ok(())
}

/// σ moving: 64 workers with 8 requests each, every request progressing by one token per
/// batch (a delta of 512 changes).
async fn mover(mut client: SnapshotClient<Channel>, every: Duration, stop: Duration) {
    let (tx, rx) = mpsc::channel(64);
    let Ok(resp) = client.apply(ReceiverStream::new(rx)).await else {
        eprintln!("the Apply stream was refused");
        return;
    };
    let mut acks = resp.into_inner();
    tokio::spawn(async move { while let Ok(Some(_)) = acks.message().await {} });
    let hello = (0..WORKERS)
        .map(|w| v1::TelemetryChange {
            kind: Some(tc::Kind::WorkerHello(tc::WorkerHello {
                worker_id: w,
                incarnation: 1,
                capacity: 256,
                endpoint: String::new(),
            })),
        })
        .collect();
    let mut seq = 1;
    let batch = |seq: u64, changes| v1::ChangeBatch {
        batch_seq: seq,
        group: "g".into(),
        changes,
        ingest_id: "snapshot-load".into(),
        traceparent: String::new(),
        tracestate: String::new(),
    };
    if tx.send(batch(seq, hello)).await.is_err() {
        return;
    }
    let end = tokio::time::Instant::now() + stop;
    let mut tick = tokio::time::interval(every);
    for step in 1.. {
        tick.tick().await;
        if tokio::time::Instant::now() >= end {
            break;
        }
        seq += 1;
        let changes = (0..WORKERS)
            .flat_map(|w| {
                (0..PER_WORKER).map(move |r| v1::TelemetryChange {
                    kind: Some(tc::Kind::RequestProgress(tc::RequestProgress {
                        worker_id: w,
                        incarnation: 1,
                        request_id: format!("w{w}-r{r}"),
                        prompt_tokens: 100,
                        generated_tokens: step,
                        finished: false,
                        unkeyed: false,
                    })),
                })
            })
            .collect();
        if tx.send(batch(seq, changes)).await.is_err() {
            break;
        }
    }
}

async fn watchers(
    addr: &str,
    per_connection: usize,
    count: usize,
    duration: Duration,
    every: Duration,
) -> anyhow::Result<()> {
    if count == 0 {
        bail!("--count must be at least 1");
    }
    let clients = channels(addr, count.div_ceil(per_connection)).await?;
    let mut streams = Vec::with_capacity(count);
    let mut refused = BTreeMap::<String, usize>::new();
    for i in 0..count {
        let mut c = clients[i / per_connection].clone();
        match c.watch(watch_req("g".into())).await {
            // Held and never polled: the client's HTTP/2 stream window fills, then the
            // server's side of the stream backs up.
            Ok(s) => streams.push(s.into_inner()),
            // A limit (--max-watchers): counted, the load goes on.
            Err(st) if st.code() == tonic::Code::ResourceExhausted => {
                *refused.entry(format!("{:?}", st.code())).or_default() += 1;
            }
            Err(st) => return Err(st).context("opening a Watch"),
        }
    }
    println!(
        "watchers: {} streams open, not reading, for {duration:?}; refused at open: {refused:?}",
        streams.len()
    );
    // Its own connection: on a watcher's, the unread streams fill the connection's HTTP/2
    // window, the Apply acks stop, and σ stops moving (the load then hung past --duration).
    let own = channels(addr, 1).await?;
    mover(own[0].clone(), every, duration).await;
    // Now read what each stream holds, to its end or its first error, to see how the server
    // ended the ones it ended (a stream still open after what it holds is "open").
    let outcomes = futures::stream::iter(streams)
        .map(|mut s| async move {
            // A stream the server kept open goes on with progress marks: give each 3 s.
            let end = tokio::time::Instant::now() + Duration::from_secs(3);
            loop {
                match tokio::time::timeout_at(end, s.message()).await {
                    Err(_) => return "open".to_owned(),
                    Ok(Ok(Some(_))) => {}
                    Ok(Ok(None)) => return "ended ok".to_owned(),
                    Ok(Err(st)) => return format!("{:?}", st.code()),
                }
            }
        })
        .buffer_unordered(256)
        .fold(BTreeMap::<String, usize>::new(), |mut m, code| async move {
            *m.entry(code).or_default() += 1;
            m
        })
        .await;
    println!("watchers after {duration:?}: {outcomes:?}");
    Ok(())
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
        let a: Args = cli::bare(&["snapshot-load", "groups"]);
        assert_eq!(a.addr, defaults::SNAPSHOT_ADDR);
        assert_eq!(
            cli::env_of::<Args>("addr").as_deref(),
            Some(env::SNAPSHOT_ADDR)
        );
    }
}
