//! `brctl`: the operator's command line for BalanceRoute. It reads σ from the snapshot service
//! (`Snapshot.ListGroups`, `Snapshot.Get`) and changes only one thing, the cordon of a rank
//! (`Snapshot.SetCordon`); under mutual TLS it needs a certificate of role `admin`.
//!
//! * `model`: what is shown, computed from σ alone (per-rank load, imbalance, barrier idle,
//!   requests).
//! * `render`: tables and JSON.
//! * `tui`: `brctl watch`, a live terminal view.

mod model;
mod render;
mod tui;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use br_proto::v1;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_trust::{Role, TlsArgs, TlsMaterial};
use clap::{Parser, Subcommand, ValueEnum};
use tonic::transport::Channel;

/// Exit code of `brctl drain` when the rank still holds requests at `--timeout` (its cordon
/// stays). 1 is any other failure, 2 a usage error.
pub const EXIT_DRAIN_TIMEOUT: i32 = 3;

#[derive(Debug, Parser)]
#[command(
    name = "brctl",
    version,
    about = "BalanceRoute's operator command line: see groups, ranks, loads and requests; cordon, uncordon and drain ranks",
    after_help = "Examples:
  brctl status                               every group the snapshot service holds
  brctl status prod-g0                       per rank: state, KV load, requests, capacity; imbalance, barrier idle
  brctl status prod-g0 --output json         the same as JSON
  brctl requests prod-g0 3                   the requests σ holds on rank 3
  brctl watch prod-g0                        a live view (q to quit)
  brctl cordon prod-g0 3                     rank 3 takes no new requests; its running ones finish
  brctl drain prod-g0 3 --timeout 10m        cordon, then wait until rank 3 holds no request
  brctl uncordon prod-g0 3                   back in routing
  brctl --snapshot-addr http://snapshot:50061 --tls-cert admin.pem --tls-key admin-key.pem \\
        --tls-ca ca.pem status               under mutual TLS (a certificate of role admin; the
                                             TLS comes from the flags, https:// works too)"
)]
pub struct Cli {
    /// The snapshot service's gRPC address (by default br-all's port).
    #[arg(
        long,
        env = br_proto::defaults::env::SNAPSHOT_ADDR,
        default_value = br_proto::defaults::SNAPSHOT_ADDR,
        global = true
    )]
    pub snapshot_addr: String,
    /// Admin URLs (`http://host:9063`, `https://…` under mutual TLS) of decision replicas whose
    /// policy, pool, σ version and readiness `status GROUP` shows (from their `/metrics`).
    #[arg(
        long,
        env = "BALANCEROUTE_DECISION_ADMIN",
        value_delimiter = ',',
        global = true
    )]
    pub decision_admin: Vec<String>,
    /// Deadline of each call.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration, global = true)]
    pub call_timeout: Duration,
    /// Output format.
    #[arg(long, short, value_enum, default_value_t = Output::Table, global = true)]
    pub output: Output,
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Every group, or one group's ranks: state (live, suspect, fenced; cordoned), incarnation,
    /// KV load as a bar and in tokens, running and reserved requests, capacity; the group's
    /// version, max load, imbalance (max − min load), barrier idle (G·M − ΣL, the KV-token slots
    /// idle at the lockstep barrier) and its share of G·M, over the ranks that are not fenced.
    Status {
        /// Show this group's ranks (without: list the groups).
        group: Option<String>,
    },
    /// The requests σ holds for a group, or for one rank of it.
    Requests { group: String, worker: Option<u32> },
    /// A live view of a group that refreshes like `top` (q, Esc or Ctrl-C quits). When
    /// standard output is not a terminal it prints the status table at each refresh instead.
    Watch {
        group: String,
        /// Time between refreshes.
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        interval: Duration,
        /// Stop after this many refreshes (default: until quit).
        #[arg(long)]
        count: Option<u64>,
    },
    /// Takes a rank out of routing for new requests; its running requests go on and finish.
    /// The cordon belongs to the rank (a shim restart keeps it) until `uncordon`.
    Cordon { group: String, worker: u32 },
    /// Puts a cordoned rank back in routing.
    Uncordon { group: String, worker: u32 },
    /// Cordons a rank, then waits until σ holds no request on it (exit 3 at --timeout; the
    /// cordon stays either way: `uncordon` when the maintenance is done).
    Drain {
        group: String,
        worker: u32,
        /// How long to wait for the rank's requests to finish.
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        timeout: Duration,
        /// How often to look.
        #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
        poll: Duration,
    },
}

/// A connected brctl: the snapshot client and the call deadline.
pub struct Ctl {
    client: SnapshotClient<Channel>,
    timeout: Duration,
    /// Whether brctl dials with a certificate (what a failed connection's hint suggests).
    tls: bool,
}

impl Ctl {
    /// Connects lazily (the first call reports an unreachable server), over mutual TLS when
    /// `tls` is given (the server must present the snapshot role).
    pub fn connect(
        addr: &str,
        tls: Option<&Arc<TlsMaterial>>,
        timeout: Duration,
    ) -> anyhow::Result<Ctl> {
        let endpoint = br_trust::address::endpoint(addr, tls.is_some())
            .context("--snapshot-addr")?
            .connect_timeout(timeout);
        let channel = br_trust::tls::connect_lazy(endpoint, tls, Some(Role::Snapshot));
        Ok(Ctl {
            client: SnapshotClient::new(channel)
                .max_decoding_message_size(br_sigma::MAX_SNAPSHOT_MESSAGE_BYTES),
            timeout,
            tls: tls.is_some(),
        })
    }

    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        r.set_timeout(self.timeout);
        r
    }

    pub async fn groups(&self) -> anyhow::Result<Vec<v1::GroupSummary>> {
        let resp = self
            .client
            .clone()
            .list_groups(self.request(v1::ListGroupsRequest {}))
            .await
            .map_err(|e| status_error(e, self.tls))?;
        Ok(resp.into_inner().groups)
    }

    pub async fn snapshot(&self, group: &str) -> anyhow::Result<v1::ClusterSnapshot> {
        let resp = self
            .client
            .clone()
            .get(self.request(v1::GetRequest {
                group: group.to_owned(),
            }))
            .await
            .map_err(|e| status_error(e, self.tls))?;
        Ok(resp.into_inner())
    }

    pub async fn set_cordon(
        &self,
        group: &str,
        worker: u32,
        cordoned: bool,
    ) -> anyhow::Result<v1::SetCordonResponse> {
        let resp = self
            .client
            .clone()
            .set_cordon(self.request(v1::SetCordonRequest {
                group: group.to_owned(),
                worker_id: worker,
                cordoned,
            }))
            .await
            .map_err(|e| status_error(e, self.tls))?;
        Ok(resp.into_inner())
    }
}

/// A failed call, said plainly: the code and the server's message.
fn status_error(s: tonic::Status, tls: bool) -> anyhow::Error {
    let msg = s.message();
    // A connection that failed below gRPC. The usual cause is TLS on one side only: a
    // plaintext client reads the server's handshake as broken HTTP/2 ("h2 protocol error", or
    // a bare "transport error"); a TLS client gets no handshake from a plaintext server
    // ("corrupt message of type InvalidContentType").
    let below_grpc = msg.contains("h2 protocol error") || msg == "transport error";
    let hint = if below_grpc && !tls {
        " (is the server using TLS? then pass --tls-cert, --tls-key and --tls-ca with a \
         certificate of role admin)"
    } else if tls && (msg.contains("InvalidContentType") || msg == "transport error") {
        " (is the server plaintext? then drop --tls-cert, --tls-key and --tls-ca)"
    } else {
        match s.code() {
            tonic::Code::Unavailable => " (is the snapshot service running at --snapshot-addr?)",
            tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => {
                " (brctl needs a certificate of role admin)"
            }
            _ => "",
        }
    };
    // What the transport said beneath a bare "transport error" (an h2 or TLS error): each
    // cause once, as tonic's wrappers repeat one another's words.
    let mut said = msg.to_owned();
    if s.code() == tonic::Code::Unknown {
        let mut source = std::error::Error::source(&s);
        while let Some(e) = source {
            let e_said = e.to_string();
            if !said.contains(&e_said) {
                said = format!("{said}: {e_said}");
            }
            source = e.source();
        }
    }
    anyhow::anyhow!("{:?}: {said}{hint}", s.code())
}

fn json<T: serde::Serialize>(v: &T) -> anyhow::Result<String> {
    Ok(serde_json::to_string_pretty(v)?)
}

/// Runs one command, writing what it shows to `out`. Returns the process's exit code.
pub async fn run(cli: Cli, out: &mut (dyn std::io::Write + Send)) -> anyhow::Result<i32> {
    let tls = cli.tls.load().context("loading the TLS files")?;
    let ctl = Ctl::connect(&cli.snapshot_addr, tls.as_ref(), cli.call_timeout)?;
    let output = cli.output;
    match cli.command {
        Command::Status { group: None } => {
            let groups = ctl.groups().await?;
            match output {
                Output::Json => writeln!(out, "{}", json(&groups_json(&groups))?)?,
                Output::Table if groups.is_empty() => {
                    writeln!(out, "the snapshot service holds no group yet")?
                }
                Output::Table => writeln!(out, "{}", render::groups_table(&groups))?,
            }
        }
        Command::Status { group: Some(g) } => {
            let view = model::GroupSummary::of_snapshot(&ctl.snapshot(&g).await?);
            let decision =
                decision_rows(&cli.decision_admin, tls.as_ref(), cli.call_timeout, &g).await;
            match output {
                Output::Json => {
                    let mut v = serde_json::to_value(&view)?;
                    v["decision"] = serde_json::to_value(&decision)?;
                    writeln!(out, "{}", json(&v)?)?
                }
                Output::Table => {
                    writeln!(out, "{}", render::group_table(&view))?;
                    if !decision.is_empty() {
                        writeln!(out, "{}", render::decision_table(&decision))?;
                    }
                }
            }
        }
        Command::Requests { group, worker } => {
            let rows = model::request_rows(&ctl.snapshot(&group).await?, worker);
            match output {
                Output::Json => writeln!(out, "{}", json(&rows)?)?,
                Output::Table => writeln!(out, "{}", render::requests_table(&rows))?,
            }
        }
        Command::Watch {
            group,
            interval,
            count,
        } => tui::watch(&ctl, &group, interval, count, output, out).await?,
        Command::Cordon { group, worker } => {
            let r = ctl.set_cordon(&group, worker, true).await?;
            say_cordon(out, output, &group, worker, true, &r)?;
        }
        Command::Uncordon { group, worker } => {
            let r = ctl.set_cordon(&group, worker, false).await?;
            say_cordon(out, output, &group, worker, false, &r)?;
        }
        Command::Drain {
            group,
            worker,
            timeout,
            poll,
        } => return drain(&ctl, &group, worker, timeout, poll, output, out).await,
    }
    Ok(0)
}

/// Reads each decision replica's `/metrics` (concurrently); one row each, with the error when
/// it could not be read.
async fn decision_rows(
    admins: &[String],
    tls: Option<&Arc<TlsMaterial>>,
    timeout: Duration,
    group: &str,
) -> Vec<model::DecisionRow> {
    if admins.is_empty() {
        return Vec::new();
    }
    let reads = admins.iter().map(|admin| async move {
        let url = decision_metrics_url(admin);
        match tokio::time::timeout(timeout, admin_get(&url, tls)).await {
            Ok(Ok(text)) => model::decision_row(admin, &text, group),
            Ok(Err(e)) => unreadable(admin, format!("{e:#}")),
            Err(_) => unreadable(admin, format!("no answer within {timeout:?}")),
        }
    });
    futures::future::join_all(reads).await
}

/// A replica's `/metrics`, asked for the families `status` shows (`name[]`, percent-encoded).
fn decision_metrics_url(admin: &str) -> String {
    let names: Vec<String> = model::DECISION_FAMILIES
        .iter()
        .map(|f| format!("name%5B%5D={f}"))
        .collect();
    format!(
        "{}/metrics?{}",
        admin.trim_end_matches('/'),
        names.join("&")
    )
}

fn unreadable(admin: &str, error: String) -> model::DecisionRow {
    model::DecisionRow {
        admin: admin.to_owned(),
        error: Some(error),
        ..model::DecisionRow::default()
    }
}

/// `GET url` on an admin port over HTTP/1.1: plaintext for `http://`, mutual TLS with brctl's
/// certificate for `https://` (the admin port of a TLS deployment requires one; the server
/// must present the decision role). The body of a 2xx answer.
async fn admin_get(url: &str, tls: Option<&Arc<TlsMaterial>>) -> anyhow::Result<String> {
    use http_body_util::BodyExt as _;
    use hyper_util::rt::TokioIo;

    let uri: http::Uri = url
        .parse()
        .with_context(|| format!("{url:?} is not a URL"))?;
    let host = uri.host().context("no host")?.to_owned();
    let https = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => bail!("{url}: the scheme must be http or https"),
    };
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
        .await
        .with_context(|| format!("connecting to {host}:{port}"))?;
    let req = http::Request::get(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header(http::header::HOST, format!("{host}:{port}"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())?;
    let resp = if https {
        let material =
            tls.context("an https:// admin URL needs --tls-cert, --tls-key and --tls-ca")?;
        let mut cfg = (*material.client_config(Some(Role::Decision))).clone();
        // the admin port speaks HTTP/1.1
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        let name = tokio_rustls::rustls::pki_types::ServerName::try_from(host.clone())
            .with_context(|| format!("{host:?} is not a server name"))?;
        let stream = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(name, tcp)
            .await
            .context("TLS handshake")?;
        send(TokioIo::new(stream), req).await?
    } else {
        send(TokioIo::new(tcp), req).await?
    };
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    if !status.is_success() {
        bail!("{url} answered {status}");
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

async fn send<T>(
    io: T,
    req: http::Request<http_body_util::Empty<bytes::Bytes>>,
) -> anyhow::Result<http::Response<hyper::body::Incoming>>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    // the connection is driven beside the request, and ends with it
    tokio::spawn(conn);
    Ok(sender.send_request(req).await?)
}

fn groups_json(groups: &[v1::GroupSummary]) -> serde_json::Value {
    serde_json::Value::Array(
        groups
            .iter()
            .map(|g| {
                serde_json::json!({
                    "group": g.group,
                    // decimal strings, as in `status GROUP` and every JSON the services
                    // answer: a JSON number loses a 64-bit epoch's low bits in most readers
                    "epoch": g.epoch.to_string(),
                    "version": g.version.to_string(),
                    "workers": g.workers,
                    "live_workers": g.live_workers,
                    "cordoned_workers": g.cordoned_workers,
                    "requests": g.requests,
                })
            })
            .collect(),
    )
}

fn say_cordon(
    out: &mut (dyn std::io::Write + Send),
    output: Output,
    group: &str,
    worker: u32,
    cordoned: bool,
    r: &v1::SetCordonResponse,
) -> anyhow::Result<()> {
    match output {
        Output::Json => writeln!(
            out,
            "{}",
            json(&serde_json::json!({
                "group": group, "worker_id": worker, "cordoned": cordoned,
                "changed": r.changed, "version": r.version,
            }))?
        )?,
        Output::Table => {
            let what = if cordoned { "cordoned" } else { "uncordoned" };
            let already = if r.changed { "" } else { " (it already was)" };
            writeln!(
                out,
                "group {group} worker {worker} {what}{already}; σ version {}",
                r.version
            )?
        }
    }
    Ok(())
}

/// Cordon, then poll σ until the rank holds no request or `timeout` passes.
async fn drain(
    ctl: &Ctl,
    group: &str,
    worker: u32,
    timeout: Duration,
    poll: Duration,
    output: Output,
    out: &mut (dyn std::io::Write + Send),
) -> anyhow::Result<i32> {
    let r = ctl.set_cordon(group, worker, true).await?;
    if output == Output::Table {
        say_cordon(out, output, group, worker, true, &r)?;
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last = None;
    loop {
        let snap = ctl.snapshot(group).await?;
        if !snap.workers.iter().any(|w| w.worker_id == worker) {
            bail!("worker {worker} is no longer in σ of group {group:?}");
        }
        let left = model::requests_on(&snap, worker);
        if output == Output::Table && last != Some(left) {
            writeln!(out, "worker {worker}: {left} requests left")?;
            out.flush()?;
        }
        last = Some(left);
        let drained = left == 0;
        let timed_out = !drained && tokio::time::Instant::now() >= deadline;
        if drained || timed_out {
            match output {
                Output::Json => writeln!(
                    out,
                    "{}",
                    json(&serde_json::json!({
                        "group": group, "worker_id": worker, "drained": drained,
                        "requests_left": left, "version": snap.version,
                    }))?
                )?,
                Output::Table if drained => writeln!(
                    out,
                    "worker {worker} drained (σ version {}); it stays cordoned: `brctl uncordon {group} {worker}` to bring it back",
                    snap.version
                )?,
                Output::Table => writeln!(
                    out,
                    "worker {worker} still holds {left} requests after {}; it stays cordoned",
                    humantime::format_duration(timeout)
                )?,
            }
            return Ok(if drained { 0 } else { EXIT_DRAIN_TIMEOUT });
        }
        tokio::time::sleep(poll.min(deadline - tokio::time::Instant::now())).await;
    }
}
