//! `br-emu engine` (an emulated lockstep DP decode engine) and `br-emu load` (a gateway that
//! replays a trace through BalanceRoute), plus `br-emu report` (side-by-side table).

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use br_emu::engine::{Colocated, EngineConfig, EngineServer, StepModel};
use br_emu::load::{self, LoadConfig, Summary};
use br_sim::cli::Arrival;
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(name = "br-emu", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// G ranks in lockstep behind an OpenAI-compatible API (one port per rank, plus one port
    /// honouring `X-data-parallel-rank`).
    Engine(EngineArgs),
    /// Replay a workload: Assign on br-decision, stream from the chosen rank, summarise.
    Load(Box<LoadArgs>),
    /// Print the side-by-side table of `load --json` files (and a br-sim `--json` report).
    Report(ReportArgs),
}

#[derive(Debug, clap::Args)]
struct EngineArgs {
    /// G: data-parallel ranks.
    #[arg(long, env = "BALANCEROUTE_RANKS", default_value_t = 8)]
    ranks: usize,
    /// B: slots (max_num_seqs) per rank; more requests wait in the rank's FIFO queue.
    #[arg(long, env = "BALANCEROUTE_SLOTS", default_value_t = 16)]
    slots: usize,
    /// a: model ms per KV token of the most loaded rank.
    #[arg(long, env = "BALANCEROUTE_STEP_A", default_value_t = 2e-4)]
    step_a: f64,
    /// b: model ms of fixed overhead per step.
    #[arg(long, env = "BALANCEROUTE_STEP_B", default_value_t = 30.0)]
    step_b: f64,
    /// c: model ms per running request on the rank that runs the most (step time
    /// `a·max L + c·max n + b`; 0 is the paper's model).
    #[arg(long, env = "BALANCEROUTE_STEP_C", default_value_t = 0.0)]
    step_c: f64,
    /// Colocated prefill: each rank runs the prompts of the requests it is given, in chunks of
    /// at most `--prefill-chunk` tokens per step, first come first served, in the same steps as
    /// its decode batch, and every rank waits for the one that prefills the most (br-sim's
    /// `--colocated`). Without it the ranks only decode (prompts arrive as KV).
    #[arg(long, env = "BALANCEROUTE_COLOCATED")]
    colocated: bool,
    /// p: model ms per prompt token on the rank that prefills the most in the step (with
    /// `--colocated`).
    #[arg(
        long,
        env = "BALANCEROUTE_STEP_P",
        default_value_t = 0.0,
        requires = "colocated"
    )]
    step_p: f64,
    /// With `--colocated`: prompt tokens a rank prefills per step at most (the engine's
    /// chunked-prefill budget).
    #[arg(long, env = "BALANCEROUTE_PREFILL_CHUNK", default_value_t = 8192,
          value_parser = clap::value_parser!(u32).range(1..))]
    prefill_chunk: u32,
    /// Wall time = model time × this (0 runs steps back to back).
    #[arg(long, env = "BALANCEROUTE_TIME_SCALE", default_value_t = 0.1)]
    time_scale: f64,
    /// Address to bind.
    #[arg(long, env = "BALANCEROUTE_HOST", default_value = "127.0.0.1")]
    host: IpAddr,
    /// Rank g serves on base-port + g (0: OS-chosen ports, printed at start).
    #[arg(long, env = "BALANCEROUTE_BASE_PORT", default_value_t = 8000)]
    base_port: u16,
    /// The port honouring `X-data-parallel-rank` (default base-port + G).
    #[arg(long, env = "BALANCEROUTE_DP_PORT")]
    dp_port: Option<u16>,
    /// The model name served.
    #[arg(long, env = "BALANCEROUTE_MODEL", default_value = "br-emu")]
    model: String,
    /// max_tokens of requests that give none.
    #[arg(long, env = "BALANCEROUTE_DEFAULT_MAX_TOKENS", default_value_t = 16)]
    default_max_tokens: u32,
    /// Once every port is bound, write them here as JSON, atomically:
    /// `{"ranks": ["127.0.0.1:8000", ...], "dp": "127.0.0.1:8008"}` (how a script or test
    /// learns the ports chosen with `--base-port 0`).
    #[arg(long, env = "BALANCEROUTE_READY_FILE")]
    ready_file: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct LoadArgs {
    /// The decision service: one URL, or several replicas comma-separated (a DNS name stands
    /// for every address it resolves to). A call whose replica fails is retried on another
    /// with the same request id.
    #[arg(
        long,
        env = br_proto::defaults::env::DECISION_ADDR,
        value_delimiter = ',',
        default_value = br_proto::defaults::DECISION_ADDR
    )]
    decision_addr: Vec<String>,
    /// Which replica an Assign goes to: ordered (the first healthy one: one pool decides) or
    /// round-robin (every replica has its own pool).
    #[arg(
        long,
        env = "BALANCEROUTE_DECISION_SELECTION",
        default_value = "ordered"
    )]
    decision_selection: br_client::assign::Selection,
    /// Mutual TLS to the decision service: the gateway's certificate, key and the CA.
    #[command(flatten)]
    tls: br_trust::TlsArgs,
    /// The lockstep group.
    #[arg(long, env = "BALANCEROUTE_GROUP", default_value = "default")]
    group: String,
    /// Comma-separated base URL of each rank (its shim), rank 0 first.
    #[arg(long, env = "BALANCEROUTE_RANK_URLS", value_delimiter = ',')]
    rank_urls: Vec<String>,
    /// Send each request to the endpoint its worker announced (when set).
    #[arg(long, env = "BALANCEROUTE_USE_ENDPOINT")]
    use_endpoint: bool,
    /// The engine's URL, to read its per-step loads (`/stats`).
    #[arg(long, env = "BALANCEROUTE_ENGINE_URL")]
    engine_url: Option<String>,
    /// A trace file (Azure CSV, Mooncake JSONL, length-only CSV) or paper-azure / paper-prop.
    #[arg(long, env = "BALANCEROUTE_TRACE", default_value = "paper-azure")]
    trace: String,
    /// Use at most N requests.
    #[arg(long, env = "BALANCEROUTE_LIMIT")]
    limit: Option<usize>,
    /// Keep only requests with at least N output tokens.
    #[arg(long, env = "BALANCEROUTE_FILTER_MIN_OUTPUT")]
    filter_min_output: Option<u32>,
    /// Seed of the synthetic workloads and Poisson arrivals.
    #[arg(long, env = "BALANCEROUTE_SEED", default_value_t = br_sim::synth::DEFAULT_SEED)]
    seed: u64,
    /// Send every Assign a client's expected output length made from the request's true one,
    /// as br-sim's flag of the same name does: expected = actual·exp(N(0, SIGMA)), seeded by
    /// `--seed` (0: exact), capped at the request's max_tokens (its true length), as the
    /// contract requires. Without it (and `--hint-mode`) no hint is sent.
    #[arg(long, env = "BALANCEROUTE_HINT_ERROR", value_name = "SIGMA")]
    hint_error: Option<f64>,
    /// How the hints are made: `lognormal` (the default with `--hint-error`), `shuffled` (the
    /// lognormal hints permuted among the requests: useless) or `constant` (every request the
    /// workload's mean output: useless).
    #[arg(long, env = "BALANCEROUTE_HINT_MODE", value_enum)]
    hint_mode: Option<br_sim::hints::HintMode>,
    /// Send every Assign a class key (`request_class` `c0`..`c{K-1}`) made from the request's
    /// true output length, as br-sim's flag of the same name does (seeded by `--seed`, so the
    /// twin given the same flags simulates the same classes). Without it a trace's own
    /// `request_class` column is sent, if it has one.
    #[arg(long, env = "BALANCEROUTE_CLASSES", value_name = "K")]
    classes: Option<u32>,
    /// With `--classes`: the noise on ln(output) before bucketing (0: exact quantiles).
    #[arg(long, env = "BALANCEROUTE_CLASS_ERROR", value_name = "SIGMA")]
    class_error: Option<f64>,
    /// With `--classes`: `noisy` (the default) or `random` (labels that tell nothing).
    #[arg(long, env = "BALANCEROUTE_CLASS_MODE", value_enum)]
    class_mode: Option<br_sim::classes::ClassMode>,
    /// saturated (all at t = 0), trace (its timestamps / --rate-scale) or poisson (--rate).
    #[arg(long, env = "BALANCEROUTE_ARRIVAL", value_enum, default_value_t = Arrival::Saturated)]
    arrival: Arrival,
    /// Requests per second of model time for --arrival poisson (and the synthetic traces'
    /// timestamps); wall = model × the engine's time scale.
    #[arg(long, env = "BALANCEROUTE_RATE")]
    rate: Option<f64>,
    /// With --arrival trace: speed the trace up by X.
    #[arg(long, env = "BALANCEROUTE_RATE_SCALE", default_value_t = 1.0)]
    rate_scale: f64,
    /// The model name in requests.
    #[arg(long, env = "BALANCEROUTE_MODEL", default_value = "br-emu")]
    model: String,
    /// Longest wait for a rank (pool wait included).
    #[arg(long, env = "BALANCEROUTE_ASSIGN_TIMEOUT", value_parser = humantime::parse_duration, default_value = "300s")]
    assign_timeout: Duration,
    /// A label for the summary (default: the policy the decision service names).
    #[arg(long, env = "BALANCEROUTE_LABEL")]
    label: Option<String>,
    /// Write the summary (and per-request results) as JSON.
    #[arg(long, env = "BALANCEROUTE_JSON")]
    json: Option<PathBuf>,
    /// Write the arrivals the decision service saw (model ms) as a br-sim trace, with the
    /// expected output length each Assign carried (as sent, after the cap), for `br-sim run
    /// --trace FILE --arrival trace`.
    #[arg(long, env = "BALANCEROUTE_ARRIVALS_CSV")]
    arrivals_csv: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct ReportArgs {
    /// `br-emu load --json` files, in table order.
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// br-sim's `--json` report for the same workload; repeat it for one report per policy.
    /// Several reports of one policy (the twin over seeds of `--arrival-jitter-ms`) are shown
    /// as their mean, with their standard deviation on a `sim sd` line.
    #[arg(long)]
    sim: Vec<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Engine(a) => engine(a).await,
        Command::Load(a) => load_cmd(*a).await,
        Command::Report(a) => report(a),
    }
}

async fn engine(a: EngineArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.ranks >= 1, "--ranks must be at least 1");
    anyhow::ensure!(a.slots >= 1, "--slots must be at least 1");
    anyhow::ensure!(
        a.time_scale.is_finite() && a.time_scale >= 0.0,
        "--time-scale must be >= 0"
    );
    anyhow::ensure!(
        a.step_c.is_finite() && a.step_c >= 0.0,
        "--step-c must be finite and >= 0"
    );
    anyhow::ensure!(
        a.step_p.is_finite() && a.step_p >= 0.0,
        "--step-p must be finite and >= 0"
    );
    let stop = CancellationToken::new();
    let server = EngineServer::start(
        EngineConfig {
            ranks: a.ranks,
            slots: a.slots,
            model: StepModel {
                a_ms_per_token: a.step_a,
                b_ms: a.step_b,
                c_ms_per_request: a.step_c,
                p_ms_per_prefill_token: a.step_p,
            },
            colocated: a.colocated.then_some(Colocated {
                chunk: a.prefill_chunk,
            }),
            time_scale: a.time_scale,
            model_name: a.model,
            created: None,
            default_max_tokens: a.default_max_tokens,
            host: a.host,
            base_port: a.base_port,
            dp_port: a.dp_port,
        },
        stop.clone(),
    )
    .await
    .context("binding the engine's ports")?;
    let ranks: Vec<String> = server
        .addrs
        .ranks
        .iter()
        .map(|a| format!("http://{a}"))
        .collect();
    let prefill = if a.colocated {
        format!(
            " + {}·max P (colocated, chunk {})",
            a.step_p, a.prefill_chunk
        )
    } else {
        String::new()
    };
    println!(
        "br-emu engine ready: G={} B={} T=({}·max L + {}·max n + {}{prefill}) ms × {} ranks={} dp=http://{}",
        a.ranks,
        a.slots,
        a.step_a,
        a.step_c,
        a.step_b,
        a.time_scale,
        ranks.join(","),
        server.addrs.dp
    );
    if let Some(path) = &a.ready_file {
        let ranks: Vec<String> = server.addrs.ranks.iter().map(ToString::to_string).collect();
        let json = serde_json::json!({"ranks": ranks, "dp": server.addrs.dp.to_string()});
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, json.to_string())
            .and_then(|()| std::fs::rename(&tmp, path))
            .with_context(|| format!("writing --ready-file {}", path.display()))?;
    }
    let s = stop.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        s.cancel();
    });
    #[cfg(unix)]
    {
        let s = stop.clone();
        if let Ok(mut term) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            tokio::spawn(async move {
                term.recv().await;
                s.cancel();
            });
        }
    }
    server.wait().await;
    Ok(())
}

async fn load_cmd(a: LoadArgs) -> anyhow::Result<()> {
    let run_id = format!(
        "{}-{:x}",
        a.label.as_deref().unwrap_or("load"),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
    );
    let cfg = LoadConfig {
        tls: a.tls.load()?,
        decision_addrs: a.decision_addr,
        selection: a.decision_selection,
        group: a.group,
        rank_urls: a.rank_urls,
        use_endpoint: a.use_endpoint,
        engine_url: a.engine_url,
        trace: a.trace,
        limit: a.limit,
        filter_min_output: a.filter_min_output,
        seed: a.seed,
        hints: br_sim::hints::Hints::from_flags(a.hint_error, a.hint_mode)
            .map_err(|e| anyhow::anyhow!("--hint-error/--hint-mode: {e}"))?,
        classes: br_sim::classes::Classes::from_flags(a.classes, a.class_error, a.class_mode)
            .map_err(|e| anyhow::anyhow!("{e}"))?,
        arrival: a.arrival,
        rate: a.rate,
        rate_scale: a.rate_scale,
        model: a.model,
        assign_timeout: a.assign_timeout,
        label: a.label.clone().unwrap_or_default(),
        run_id,
    };
    let mut s = load::run(cfg).await?;
    if s.label.is_empty() {
        s.label = s.policy.clone();
    }
    print_summary(&s);
    for r in s.results.iter().filter(|r| r.error.is_some()).take(5) {
        eprintln!(
            "  failed {}: {}",
            r.request_id,
            r.error.as_deref().unwrap_or("")
        );
    }
    if let Some(path) = a.arrivals_csv {
        std::fs::write(&path, load::arrivals_csv(&s.results))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = a.json {
        let text = serde_json::to_string_pretty(&s)?;
        std::fs::write(&path, text + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn print_summary(s: &Summary) {
    println!(
        "{} ({}): {} requests, {} completed, {} failed, {:.1} s wall, {} tokens",
        s.label, s.workload, s.requests, s.completed, s.failed, s.wall_s, s.tokens
    );
    println!(
        "  model time (wall / {}): throughput {:.0} tok/s, TPOT p50 {:.1} ms p95 {:.1} ms, TTFT p50 {:.0} ms p95 {:.0} ms",
        s.time_scale,
        s.throughput_tok_s,
        s.tpot_ms.p50,
        s.tpot_ms.p95,
        s.ttft_ms.p50,
        s.ttft_ms.p95
    );
    if let (Some(i), Some(steps)) = (s.imbalance_tokens, s.steps) {
        let balance = s.balance_ratio.map_or(String::new(), |b| {
            format!(", balance ratio {:.1}%", 100.0 * b)
        });
        println!(
            "  engine: {steps} steps, imbalance (mean max-min) {i:.0} tokens{balance}, mean step {:.1} ms; requests per rank {:?}",
            s.mean_step_ms.unwrap_or(f64::NAN),
            s.per_rank
        );
    }
}

fn report(a: ReportArgs) -> anyhow::Result<()> {
    let mut runs = Vec::new();
    for p in &a.runs {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let s: Summary =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?;
        runs.push(s);
    }
    let mut sim: Option<br_sim::report::Report> = None;
    for p in &a.sim {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let rep = serde_json::from_str::<br_sim::report::Report>(&text)
            .with_context(|| format!("parsing {}", p.display()))?;
        match &mut sim {
            None => sim = Some(rep),
            Some(all) => all.runs.extend(rep.runs),
        }
    }
    print!("{}", load::table(&runs, sim.as_ref()));
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;
    use br_proto::defaults::{self, env};
    use clap::{CommandFactory as _, FromArgMatches as _};

    /// `br-emu load` with no flags (and no variables: clap reads them at parse time, and a shell
    /// that sourced deploy/split.env must not change the defaults) calls Assign on br-all's
    /// default port, as every other client does.
    #[test]
    fn load_with_no_flags_calls_br_all() {
        let cmd = Cli::command().mut_subcommands(|s| s.mut_args(|a| a.env(None::<&'static str>)));
        let cli =
            Cli::from_arg_matches(&cmd.try_get_matches_from(["br-emu", "load"]).unwrap()).unwrap();
        let Command::Load(load) = cli.command else {
            panic!("parsed as {:?}", cli.command);
        };
        assert_eq!(load.decision_addr, [defaults::DECISION_ADDR]);
        let load_cmd = Cli::command().find_subcommand("load").unwrap().clone();
        let var = load_cmd
            .get_arguments()
            .find(|a| a.get_id() == "decision_addr")
            .and_then(|a| a.get_env())
            .unwrap();
        assert_eq!(var, env::DECISION_ADDR);
    }
}
