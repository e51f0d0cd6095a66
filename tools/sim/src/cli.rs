//! The command line (clap derive).
//!
//! ```text
//! br-sim [run] --trace <path|paper-azure|paper-prop|adp-shape> --workers G --slots B --policies jsq,br0,...
//!              --arrival saturated|trace|poisson [--rate-scale X] [--rate R] [--limit N]
//!              [--filter-min-output N] [--seed S] [--json FILE] [--plot DIR]
//!              [--step-a MS_PER_TOKEN] [--step-b MS] [--step-c MS_PER_REQUEST]
//!              [--colocated [--step-p MS_PER_PREFILL_TOKEN] [--prefill-chunk TOKENS]]
//!              [--hint-error SIGMA] [--hint-mode lognormal|shuffled|constant]
//!              [--classes K [--class-error SIGMA] [--class-mode noisy|random]]
//! br-sim sweep <run flags> [--workers-list 4,8,16,32,64] [--param NAME=v1,v2,...]
//! br-sim calibrate SAMPLES.csv [--strict] [--json FILE]
//! ```
//! `run` is the default command, so `br-sim --trace paper-azure --workers 8 --slots 256
//! --policies jsq,br0` works without naming it.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::classes::{ClassMode, Classes};
use crate::hints::{HintMode, Hints};
use crate::synth::{self, SynthConfig, SynthKind};
use crate::trace::{self, Filter, LoadStats, TraceError, TraceRequest};

/// Every policy name the simulator accepts by default (the baselines and the BalanceRoute policies, in table order).
pub const DEFAULT_POLICIES: &str = "random,rr,p2c,jsq,vllm-dp,mintok,br0,br0-bypass,brh,brh-oracle";

/// BalanceRoute digital twin: replays request traces through the routing policies of br-core
/// under the lockstep step-time model T = a·max_g L_g + c·max_g n_g + b (with colocated
/// prefill, + p·max_g P_g).
#[derive(Debug, Parser)]
#[command(
    name = "br-sim",
    version,
    about,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    /// Subcommand; without one, `run` with the flags below.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Flags of the default `run` command.
    #[command(flatten)]
    pub run: RunArgs,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Simulate each policy once on a workload and print a table (the default).
    Run(RunArgs),
    /// Sweep G (4, 8, 16, 32, 64 by default) or a policy parameter; writes the scaling figure.
    Sweep(SweepArgs),
    /// Fit the step-time model T = a·M + c·N + b from `max_kv_tokens[,max_running],step_ms`
    /// samples (c = 0 without a max_running column).
    Calibrate(CalibrateArgs),
}

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Arrival {
    /// `trace` for a trace file whose every row has a timestamp, `saturated` otherwise and for
    /// the synthetic paper workloads (they stand in for the paper's saturated runs; their
    /// timestamps are only there for `trace` on request). The choice is printed.
    Auto,
    /// The whole trace waits at t = 0 (the paper's heavy load).
    Saturated,
    /// The trace's own timestamps, divided by `--rate-scale`; idle gaps are skipped.
    Trace,
    /// Poisson arrivals at `--rate` requests per second (seeded), for any trace.
    Poisson,
}

/// Flags shared by `run` and `sweep`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// A trace file (Azure CSV, Mooncake JSONL, length-only CSV) or `paper-azure` /
    /// `paper-prop` (seeded synthetic stand-ins for the paper's workloads) / `adp-shape`
    /// (synthetic: the shape of TensorRT-LLM's attention-DP balancing dataset, DeepSeek V3).
    #[arg(long, required = true)]
    pub trace: Option<String>,
    /// G: data-parallel decode workers in the lockstep group.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub workers: u32,
    /// B: concurrent requests per worker (max_num_seqs).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub slots: u32,
    /// Comma-separated policy names (random rr p2c jsq vllm-dp mintok br0 br0-bypass brh
    /// brh-survival brh-oracle brh-hinted brh-class brc; brc is meant for `--colocated`).
    #[arg(long, value_delimiter = ',', default_value = DEFAULT_POLICIES)]
    pub policies: Vec<String>,
    /// Arrival process.
    #[arg(long, value_enum, default_value_t = Arrival::Auto)]
    pub arrival: Arrival,
    /// With `--arrival trace`: multiply the trace's request rate by X (timestamps / X).
    #[arg(long, default_value_t = 1.0)]
    pub rate_scale: f64,
    /// Requests per second for `--arrival poisson`, and the arrival rate of the synthetic
    /// traces' timestamps (default 5/s).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Use at most N requests (after filtering). For the synthetic workloads: generate N
    /// requests (instead of the published count), before `--filter-min-output`.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Replay a trace file's requests N times over, one copy after another (after `--limit`
    /// and `--filter-min-output`; with `--arrival trace` each copy starts 1 ms after the last
    /// one's final arrival). A saturated run of a short trace is mostly its start and its
    /// drain; repeating it gives the steady window (requests waiting) room to be read. The
    /// copies keep their prompt hashes: the same prompts, sent again. Not for the synthetic
    /// workloads (`--limit` sizes them).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub repeat: u32,
    /// Keep only requests with at least N output tokens (the paper's Azure filter is > 1000,
    /// i.e. `--filter-min-output 1001`).
    #[arg(long)]
    pub filter_min_output: Option<u32>,
    /// Seed for the synthetic traces, Poisson arrivals and randomised policies.
    #[arg(long, default_value_t = synth::DEFAULT_SEED)]
    pub seed: u64,
    /// Write the report as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write SVG figures into DIR.
    #[arg(long, value_name = "DIR")]
    pub plot: Option<PathBuf>,
    /// a: step time per KV token on the most loaded worker, in ms.
    #[arg(long, default_value_t = 2e-4)]
    pub step_a: f64,
    /// b: fixed step overhead, in ms.
    #[arg(long, default_value_t = 30.0)]
    pub step_b: f64,
    /// c: step time per running request on the rank that runs the most, in ms (the step is
    /// `a·max L + c·max n + b`; `br-sim calibrate` fits it). 0 is the paper's model.
    #[arg(long, default_value_t = 0.0)]
    pub step_c: f64,
    /// Colocated prefill: each rank runs the prompts of the requests it is given, in chunks of
    /// at most `--prefill-chunk` tokens per step, first come first served, in the same steps as
    /// its decode batch; the step is `a·max L + p·max P + c·max n + b` with P the prompt tokens
    /// a rank runs in it. Without it ranks only decode (prefill runs elsewhere).
    #[arg(long)]
    pub colocated: bool,
    /// p: step time per prefill token on the rank that runs the most prefill in the step, in
    /// ms (with `--colocated`; 0 prices prefill at nothing).
    #[arg(long, default_value_t = 0.0)]
    pub step_p: f64,
    /// With `--colocated`: prompt tokens a rank prefills per step at most (the engines'
    /// chunked-prefill budget; default 8192).
    #[arg(long, value_name = "TOKENS", requires = "colocated", value_parser = clap::value_parser!(u32).range(1..))]
    pub prefill_chunk: Option<u32>,
    /// d: deciders see worker progress this many steps late (telemetry -> σ -> replica); their
    /// own and each other's reservations are not delayed. 0 is the paper's ideal view.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub telemetry_lag_steps: u32,
    /// K: decision replicas routing at once, each with its own pool; they see each other's
    /// reservations one step late, and a reservation that finds its worker full rejoins its
    /// pool at its arrival position.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub deciders: u32,
    /// With `--arrival trace`: move each arrival by a seeded uniform amount in [-J, +J] ms
    /// (model time, clamped at 0) before ordering them. For replaying a live run's arrivals
    /// (`br-emu load --arrivals-csv`): the order of calls that reach the decision service within
    /// a millisecond of each other is not known to the client that timed them, and routing on
    /// arrival (JSQ) is sensitive to it, so the twin is run over several seeds of this jitter
    /// and the live run compared with their spread (`br-emu report`). 0: the trace as it is.
    #[arg(long, default_value_t = 0.0, value_name = "J")]
    pub arrival_jitter_ms: f64,
    /// With K > 1 deciders: they take turns, one admission round (step) each, so each sees all
    /// the others' admissions and none collide (a model of splitting ticks between replicas).
    #[arg(long, conflicts_with = "decider_ranks")]
    pub decider_turns: bool,
    /// With K > 1 deciders: decider k places only on ranks g with g mod K = k (every rank
    /// counts in its score), and on any rank that has had free slots for
    /// `--decider-takeover-steps` steps; what `br-decision --decider-index` does live.
    #[arg(long)]
    pub decider_ranks: bool,
    /// With `--decider-ranks`: steps a rank keeps free slots before every decider may place on
    /// it (its owner is dead or had nothing to place).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub decider_takeover_steps: u32,
    /// Give each request a client's expected output length, a hint (what `brh-hinted` reads):
    /// expected = actual · exp(N(0, SIGMA)), drawn from `--seed`; 0 is exact. Without this
    /// flag and `--hint-mode` no request has a hint but those a generic CSV gives
    /// (`expected_output_tokens`, e.g. `br-emu load --arrivals-csv`), which these flags refuse
    /// to replace.
    #[arg(long, value_name = "SIGMA")]
    pub hint_error: Option<f64>,
    /// How the hints are made: `lognormal` (the default with `--hint-error`), `shuffled` (the
    /// lognormal hints permuted among the requests: useless) or `constant` (every request the
    /// trace's mean output: useless).
    #[arg(long, value_enum)]
    pub hint_mode: Option<HintMode>,
    /// Give each request one of K classes (`c0`..`c{K-1}`, the key a gateway would send as
    /// `request_class`) made from its true output length, for measuring what class labels are
    /// worth: by default (`--class-mode noisy`) the bucket of ln(output) + N(0, SIGMA) among K
    /// equal-count quantiles, drawn from `--seed`. 2..=256. The workload line says how much of
    /// the output length's log-variance the classes explain.
    #[arg(long, value_name = "K")]
    pub classes: Option<u32>,
    /// With `--classes`: SIGMA of the noise on ln(output) before bucketing (0, the default: the
    /// classes are the K output-length quantiles, the most K classes can tell; at most 10).
    #[arg(long, value_name = "SIGMA")]
    pub class_error: Option<f64>,
    /// With `--classes`: `noisy` (the default) or `random` (the same K equal-count classes
    /// dealt at random: labels that tell nothing).
    #[arg(long, value_enum)]
    pub class_mode: Option<ClassMode>,
}

/// Flags of `sweep`.
#[derive(Debug, Clone, Args)]
pub struct SweepArgs {
    /// The run flags (`--workers` is ignored when `--workers-list` sweeps G).
    #[command(flatten)]
    pub run: RunArgs,
    /// Values of G to sweep.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16,32,64")]
    pub workers_list: Vec<u32>,
    /// Requests per worker in the G sweep (the workload has N·G requests, so the load per
    /// worker stays the same). Default: 1250 for paper-azure, 1000 for paper-prop, 2000 for
    /// adp-shape (their published sizes at G = 8), and the whole trace (same for every G) for
    /// trace files.
    #[arg(long, value_name = "N")]
    pub per_worker: Option<usize>,
    /// Sweep a policy parameter at the fixed `--workers` instead of G: `NAME=v1,v2,...`
    /// (r_max, s_greedy, stage1_worker, cold_start, tie_break, horizon, alpha, beta, gamma,
    /// gate, request_cost_tokens). Baselines run once, as the reference.
    #[arg(long, value_name = "NAME=V1,V2,...")]
    pub param: Option<String>,
    /// Run every point with each of these seeds and report the mean (synthetic workloads,
    /// Poisson arrivals and randomised policies change with the seed). Default: `--seed`.
    #[arg(long, value_delimiter = ',', value_name = "S1,S2,...")]
    pub seeds: Vec<u64>,
    /// Poisson arrivals at R·G requests per second at each G (with `--param`, at
    /// `--workers`): the same offered load per rank at every G, as `--per-worker` keeps the
    /// same requests per rank. Needs `--arrival poisson`, and replaces `--rate`.
    #[arg(long, value_name = "R")]
    pub rate_per_worker: Option<f64>,
}

impl SweepArgs {
    /// Checks the sweep's own flags against the run flags.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let Some(r) = self.rate_per_worker else {
            return Ok(());
        };
        let bad = |m: String| Err(WorkloadError::Invalid(m));
        if !(r.is_finite() && r > 0.0) {
            return bad(format!("--rate-per-worker must be > 0, got {r}"));
        }
        if self.run.arrival != Arrival::Poisson {
            return bad("--rate-per-worker needs --arrival poisson".into());
        }
        if self.run.rate.is_some() {
            return bad("--rate-per-worker replaces --rate: give one of them".into());
        }
        Ok(())
    }

    /// The run flags at G = `workers`: with `--rate-per-worker R`, Poisson arrivals at R·G
    /// requests per second.
    pub fn run_at(&self, run: &RunArgs, workers: u32) -> RunArgs {
        let mut run = run.clone();
        if let Some(r) = self.rate_per_worker {
            run.rate = Some(r * f64::from(workers));
        }
        run
    }
}

/// Flags of `calibrate`.
#[derive(Debug, Clone, Args)]
pub struct CalibrateArgs {
    /// CSV of `max_kv_tokens,step_ms` samples (header optional), or with a header naming
    /// `max_kv_tokens`, `max_running` and `step_ms` for the three-term fit.
    pub samples: PathBuf,
    /// Fail on the first bad row instead of rejecting it and fitting the rest.
    #[arg(long)]
    pub strict: bool,
    /// Also write the fit as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

impl Cli {
    /// The command to run, with `run` as the default.
    pub fn into_command(self) -> Command {
        self.command.unwrap_or(Command::Run(self.run))
    }
}

/// Errors in the workload flags.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// Loading the trace failed.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// Flags that do not fit together or are out of range.
    #[error("{0}")]
    Invalid(String),
}

/// A workload ready to simulate.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Display name (`paper-azure (synthetic)`, a file name, ...).
    pub name: String,
    /// Requests with arrival times set per `--arrival` (all 0 for saturated), sorted by arrival.
    pub requests: Vec<TraceRequest>,
    /// The arrival process used (`--arrival auto` resolved) and why.
    pub arrival: Arrival,
    pub arrival_why: &'static str,
    /// The clients' hints the requests carry (`--hint-error`, `--hint-mode`), if any.
    pub hints: Option<Hints>,
    /// Requests whose hint came with the trace (a generic CSV's `expected_output_tokens`, e.g.
    /// a live run's arrivals): replayed as the live decision saw them.
    pub trace_hints: usize,
    /// The classes made for the requests (`--classes`), if any.
    pub classes: Option<Classes>,
    /// Requests whose class came with the trace (a generic CSV's `request_class`, e.g. a live
    /// run's arrivals): replayed as the live decision saw them.
    pub trace_classes: usize,
    /// The share of Var[ln output] the requests' classes explain (`None` without classes).
    pub class_share: Option<f64>,
    /// Loader counters.
    pub stats: LoadStats,
}

/// The chunked-prefill budget of `--colocated` without `--prefill-chunk`: TensorRT-LLM's
/// DeepSeek-R1 example with attention DP serves with `--max_num_tokens 8192`.
pub const DEFAULT_PREFILL_CHUNK: u32 = 8192;

impl RunArgs {
    /// Where prefill runs: `--colocated` with its p and chunk, else `None` (decode only).
    pub fn colocated(&self) -> Option<crate::engine::Colocated> {
        self.colocated.then(|| crate::engine::Colocated {
            step_p: self.step_p,
            chunk: self.prefill_chunk.unwrap_or(DEFAULT_PREFILL_CHUNK),
        })
    }

    /// Validates numeric flags.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let bad = |m: String| Err(WorkloadError::Invalid(m));
        if !(self.step_a.is_finite() && self.step_a >= 0.0) {
            return bad(format!(
                "--step-a must be finite and >= 0, got {}",
                self.step_a
            ));
        }
        if !(self.step_b.is_finite() && self.step_b >= 0.0) || self.step_a + self.step_b <= 0.0 {
            return bad(format!(
                "--step-b must be finite and >= 0 (and a + b > 0), got {}",
                self.step_b
            ));
        }
        if !(self.step_c.is_finite() && self.step_c >= 0.0) {
            return bad(format!(
                "--step-c must be finite and >= 0, got {}",
                self.step_c
            ));
        }
        if !(self.step_p.is_finite() && self.step_p >= 0.0) {
            return bad(format!(
                "--step-p must be finite and >= 0, got {}",
                self.step_p
            ));
        }
        if self.step_p != 0.0 && !self.colocated {
            return bad(
                "--step-p prices prefill on the decode ranks, which runs only with --colocated"
                    .into(),
            );
        }
        if !(self.rate_scale.is_finite() && self.rate_scale > 0.0) {
            return bad(format!("--rate-scale must be > 0, got {}", self.rate_scale));
        }
        if let Some(r) = self.rate
            && !(r.is_finite() && r > 0.0)
        {
            return bad(format!("--rate must be > 0, got {r}"));
        }
        if !(self.arrival_jitter_ms.is_finite() && self.arrival_jitter_ms >= 0.0) {
            return bad(format!(
                "--arrival-jitter-ms must be finite and >= 0, got {}",
                self.arrival_jitter_ms
            ));
        }
        if self.arrival_jitter_ms > 0.0 && self.arrival != Arrival::Trace {
            return bad("--arrival-jitter-ms applies to --arrival trace only".into());
        }
        if self.arrival == Arrival::Poisson && self.rate.is_none() {
            return bad("--arrival poisson needs --rate R (requests per second)".into());
        }
        if self.policies.iter().all(|p| p.trim().is_empty()) {
            return bad("--policies is empty".into());
        }
        self.hints()?;
        self.classes()?;
        Ok(())
    }

    /// The classes `--classes`, `--class-error` and `--class-mode` ask for (`None`: none).
    pub fn classes(&self) -> Result<Option<Classes>, WorkloadError> {
        Classes::from_flags(self.classes, self.class_error, self.class_mode)
            .map_err(WorkloadError::Invalid)
    }

    /// The hints `--hint-error` and `--hint-mode` ask for (`None`: no hints).
    pub fn hints(&self) -> Result<Option<Hints>, WorkloadError> {
        Hints::from_flags(self.hint_error, self.hint_mode).map_err(WorkloadError::Invalid)
    }

    /// Loads or generates the workload and stamps arrival times per `--arrival`.
    pub fn workload(&self) -> Result<Workload, WorkloadError> {
        self.workload_sized(None)
    }

    /// Whether `--trace` names a synthetic workload.
    pub fn synthetic(&self) -> Option<SynthKind> {
        self.trace.as_deref().and_then(SynthKind::from_name)
    }

    /// Like [`RunArgs::workload`], with `count` requests: a synthetic workload generates that
    /// many; a trace file is cut to its first `count` (after `--filter-min-output`).
    pub fn workload_sized(&self, count: Option<usize>) -> Result<Workload, WorkloadError> {
        self.validate()?;
        let spec = self
            .trace
            .as_deref()
            .ok_or_else(|| WorkloadError::Invalid("--trace is required".into()))?;
        let filter = Filter {
            min_output: self.filter_min_output,
            limit: count.or(self.limit),
        };
        let (name, requests, stats) = if let Some(kind) = SynthKind::from_name(spec) {
            if self.repeat > 1 {
                return Err(WorkloadError::Invalid(format!(
                    "--repeat {}: {} is synthetic; --limit sets how many requests it generates",
                    self.repeat,
                    kind.name()
                )));
            }
            let mut cfg = SynthConfig::new(kind);
            cfg.seed = self.seed;
            if let Some(c) = count {
                cfg.requests = c;
            } else if let Some(n) = self.limit {
                // `--limit` sizes a synthetic workload (it has no file to cut): above the
                // published count it asks for more requests. With `--filter-min-output` the
                // filter keeps the first N that pass among at least the published count (the
                // generator is prefix-stable: more requests only append).
                cfg.requests = if self.filter_min_output.is_some() {
                    n.max(cfg.requests)
                } else {
                    n
                };
            }
            if let Some(r) = self.rate {
                cfg.rate_per_s = r;
            }
            let (reqs, stats) = filter.apply(synth::generate(kind, &cfg));
            if let (None, Some(n)) = (count, self.limit)
                && !reqs.is_empty()
                && reqs.len() < n
            {
                return Err(WorkloadError::Invalid(format!(
                    "--limit {n}: only {} of the {} generated {} requests pass --filter-min-output; lower --limit or the filter",
                    reqs.len(),
                    cfg.requests,
                    kind.name()
                )));
            }
            (format!("{} (synthetic)", kind.name()), reqs, stats)
        } else {
            let path = PathBuf::from(spec);
            let t = trace::load(&path, &filter)?;
            let name = path
                .file_name()
                .map_or_else(|| spec.to_string(), |f| f.to_string_lossy().into_owned());
            if self.repeat > 1 {
                let name = format!("{name} ×{}", self.repeat);
                (name, repeat(t.requests, self.repeat), t.stats)
            } else {
                (name, t.requests, t.stats)
            }
        };
        if requests.is_empty() {
            return Err(WorkloadError::Invalid(format!(
                "{name}: no requests left after filtering ({} rows read)",
                stats.rows
            )));
        }
        let (arrival, arrival_why) = match (self.arrival, self.synthetic()) {
            (Arrival::Auto, Some(SynthKind::AdpShape)) => (
                Arrival::Saturated,
                "auto: a synthetic workload, saturated as its source's throughput runs",
            ),
            _ => resolve_arrival(self.arrival, synthetic_spec(spec), &requests),
        };
        let requests = stamp_arrivals(requests, arrival, self.rate_scale, self.rate, self.seed)
            .map_err(|m| WorkloadError::Invalid(format!("{name}: {m}")))?;
        let mut requests = jitter_arrivals(requests, self.arrival_jitter_ms, self.seed);
        let trace_hints = requests
            .iter()
            .filter(|r| r.expected_output.is_some())
            .count();
        let hints = self.hints()?;
        if let Some(h) = &hints {
            // Made hints would overwrite the ones the trace records, and a replay of a live
            // run would no longer see what its decision saw: the two are not mixed.
            if trace_hints > 0 {
                return Err(WorkloadError::Invalid(format!(
                    "{name}: {trace_hints} requests carry their own hint \
                     (`{}`); --hint-error and --hint-mode would replace them",
                    crate::trace::EXPECTED_OUTPUT_COLUMN
                )));
            }
            h.apply(&mut requests, self.seed);
        }
        let trace_classes = requests.iter().filter(|r| r.class.is_some()).count();
        let classes = self.classes()?;
        if let Some(c) = &classes {
            // As with hints: made classes would overwrite the labels the trace records.
            if trace_classes > 0 {
                return Err(WorkloadError::Invalid(format!(
                    "{name}: {trace_classes} requests carry their own class \
                     (`{}`); --classes would replace them",
                    crate::trace::CLASS_COLUMN
                )));
            }
            c.apply(&mut requests, self.seed);
        }
        let class_share = (classes.is_some() || trace_classes > 0)
            .then(|| crate::classes::explained_share(&requests))
            .flatten();
        Ok(Workload {
            name,
            requests,
            arrival,
            arrival_why,
            hints,
            trace_hints,
            classes,
            trace_classes,
            class_share,
            stats,
        })
    }
}

/// `requests` `n` times over, in order; each copy's timestamps (if any) start 1 ms after the
/// previous copy's last.
fn repeat(requests: Vec<TraceRequest>, n: u32) -> Vec<TraceRequest> {
    let span = requests
        .iter()
        .filter_map(|r| r.arrival_ms)
        .fold(0.0f64, f64::max)
        + 1.0;
    let mut all = Vec::with_capacity(requests.len() * n as usize);
    for k in 0..n {
        let shift = f64::from(k) * span;
        all.extend(requests.iter().map(|r| TraceRequest {
            arrival_ms: r.arrival_ms.map(|a| a + shift),
            ..r.clone()
        }));
    }
    all
}

fn synthetic_spec(spec: &str) -> bool {
    SynthKind::from_name(spec).is_some()
}

/// Resolves `--arrival auto`: a trace file's own timestamps when every row has one (a user's
/// trace with timestamps is a load over time, not a backlog), saturated otherwise and for the
/// synthetic paper workloads. Explicit modes are kept. Returns the mode and why it was chosen.
pub fn resolve_arrival(
    asked: Arrival,
    synthetic: bool,
    reqs: &[TraceRequest],
) -> (Arrival, &'static str) {
    match asked {
        Arrival::Auto if synthetic => (
            Arrival::Saturated,
            "auto: a synthetic paper workload, saturated as in the paper",
        ),
        Arrival::Auto if reqs.iter().all(|r| r.arrival_ms.is_some()) => (
            Arrival::Trace,
            "auto: the trace has timestamps; --arrival saturated for a backlog at t = 0",
        ),
        Arrival::Auto => (Arrival::Saturated, "auto: the trace has no timestamps"),
        other => (other, "--arrival"),
    }
}

/// Moves each arrival by a uniform amount in `[-jitter_ms, +jitter_ms]` drawn from `seed`
/// (clamped at 0) and re-sorts by arrival (stable); `jitter_ms = 0` returns `reqs` unchanged.
/// See `--arrival-jitter-ms`.
pub fn jitter_arrivals(
    mut reqs: Vec<TraceRequest>,
    jitter_ms: f64,
    seed: u64,
) -> Vec<TraceRequest> {
    if jitter_ms <= 0.0 {
        return reqs;
    }
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x1177_e2a5_0000_0000);
    for r in &mut reqs {
        if let Some(t) = r.arrival_ms.as_mut() {
            *t = (*t + rng.random_range(-jitter_ms..=jitter_ms)).max(0.0);
        }
    }
    reqs.sort_by(|a, b| {
        a.arrival_ms
            .unwrap_or(0.0)
            .total_cmp(&b.arrival_ms.unwrap_or(0.0))
    });
    reqs
}

/// Sets arrival times per the arrival mode and sorts by arrival (stable: ties keep trace
/// order). `trace`: timestamps shifted to start at 0 and divided by `rate_scale`;
/// `saturated`: all 0; `poisson`: exponential gaps at `rate` per second from a seeded RNG.
pub fn stamp_arrivals(
    mut reqs: Vec<TraceRequest>,
    arrival: Arrival,
    rate_scale: f64,
    rate: Option<f64>,
    seed: u64,
) -> Result<Vec<TraceRequest>, String> {
    match arrival {
        Arrival::Auto => {
            return Err("--arrival auto must be resolved first (resolve_arrival)".into());
        }
        Arrival::Saturated => {
            for r in &mut reqs {
                r.arrival_ms = Some(0.0);
            }
        }
        Arrival::Trace => {
            if reqs.iter().any(|r| r.arrival_ms.is_none()) {
                return Err(
                    "the trace has no timestamps; use --arrival poisson --rate R or saturated"
                        .into(),
                );
            }
            let t0 = reqs
                .iter()
                .filter_map(|r| r.arrival_ms)
                .fold(f64::INFINITY, f64::min);
            for r in &mut reqs {
                r.arrival_ms = r.arrival_ms.map(|t| (t - t0) / rate_scale);
            }
        }
        Arrival::Poisson => {
            use rand::{Rng, SeedableRng};
            let rate = rate.ok_or("--arrival poisson needs --rate")?;
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed_a771_7a15_0000);
            let mut t = 0.0;
            for (i, r) in reqs.iter_mut().enumerate() {
                if i > 0 {
                    let u: f64 = rng.random();
                    t += -(1.0 - u).ln() / rate * 1000.0;
                }
                r.arrival_ms = Some(t);
            }
        }
    }
    reqs.sort_by(|a, b| {
        a.arrival_ms
            .unwrap_or(0.0)
            .total_cmp(&b.arrival_ms.unwrap_or(0.0))
    });
    Ok(reqs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Command, clap::Error> {
        Cli::try_parse_from(std::iter::once("br-sim").chain(args.iter().copied()))
            .map(Cli::into_command)
    }

    #[test]
    fn default_command_is_run() {
        let cmd = parse(&[
            "--trace",
            "paper-azure",
            "--workers",
            "8",
            "--slots",
            "256",
            "--policies",
            "jsq,br0",
        ])
        .expect("parse");
        let Command::Run(r) = cmd else {
            panic!("expected run")
        };
        assert_eq!(r.trace.as_deref(), Some("paper-azure"));
        assert_eq!((r.workers, r.slots), (8, 256));
        assert_eq!(r.policies, vec!["jsq", "br0"]);
        assert_eq!(r.arrival, Arrival::Auto);
        assert_eq!((r.step_a, r.step_b, r.step_c), (2e-4, 30.0, 0.0));
        assert!(!r.colocated && r.step_p == 0.0 && r.prefill_chunk.is_none());
    }

    #[test]
    fn all_flags_and_subcommands_parse() {
        let cmd = parse(&[
            "run",
            "--trace",
            "x.csv",
            "--arrival",
            "trace",
            "--rate-scale",
            "2",
            "--limit",
            "5",
            "--seed",
            "3",
            "--json",
            "o.json",
            "--plot",
            "figs",
            "--filter-min-output",
            "1001",
            "--step-a",
            "1e-4",
            "--step-b",
            "20",
            "--step-c",
            "0.25",
        ])
        .expect("parse");
        let Command::Run(r) = cmd else {
            panic!("expected run")
        };
        assert_eq!(r.rate_scale, 2.0);
        assert_eq!(r.limit, Some(5));
        assert_eq!(r.filter_min_output, Some(1001));
        assert_eq!(r.step_c, 0.25);
        assert_eq!(r.policies.len(), 10);

        let Command::Sweep(s) =
            parse(&["sweep", "--trace", "paper-prop", "--policies", "jsq,br0"]).expect("parse")
        else {
            panic!("expected sweep")
        };
        assert_eq!(s.workers_list, vec![4, 8, 16, 32, 64]);
        assert!(s.validate().is_ok());

        // --rate-per-worker: R·G per second at each G, Poisson only, instead of --rate
        let sweep = |extra: &[&str]| {
            let mut a = vec!["sweep", "--trace", "paper-prop", "--policies", "jsq"];
            a.extend_from_slice(extra);
            let Command::Sweep(s) = parse(&a).expect("parse") else {
                panic!("expected sweep")
            };
            s
        };
        let s = sweep(&["--arrival", "poisson", "--rate-per-worker", "0.75"]);
        s.validate().expect("valid");
        assert_eq!(s.run_at(&s.run, 64).rate, Some(48.0));
        s.run_at(&s.run, 8)
            .validate()
            .expect("a Poisson run with its rate");
        for (extra, says) in [
            (&["--rate-per-worker", "0.75"][..], "--arrival poisson"),
            (
                &[
                    "--arrival",
                    "poisson",
                    "--rate",
                    "6",
                    "--rate-per-worker",
                    "0.75",
                ][..],
                "replaces --rate",
            ),
            (
                &["--arrival", "poisson", "--rate-per-worker", "0"][..],
                "> 0",
            ),
            (
                &["--arrival", "poisson", "--rate-per-worker", "NaN"][..],
                "> 0",
            ),
        ] {
            let e = sweep(extra).validate().expect_err("refused");
            assert!(e.to_string().contains(says), "{extra:?}: {e}");
        }
        let s = sweep(&[]);
        assert_eq!(s.run_at(&s.run, 64).rate, None, "no rate of its own");
        let Command::Calibrate(c) = parse(&["calibrate", "s.csv", "--strict"]).expect("parse")
        else {
            panic!("expected calibrate")
        };
        assert!(c.strict);
        assert!(parse(&["--workers", "8"]).is_err(), "--trace is required");
        assert!(parse(&["--trace", "x", "--workers", "0"]).is_err());
        assert!(parse(&["--trace", "x", "--arrival", "bursty"]).is_err());
    }

    #[test]
    fn workloads_and_arrivals() {
        let Command::Run(mut r) = parse(&["--trace", "paper-azure", "--limit", "100"]).expect("p")
        else {
            panic!("run")
        };
        let w = r.workload().expect("workload");
        assert_eq!(w.requests.len(), 100);
        assert!(w.requests.iter().all(|q| q.arrival_ms == Some(0.0)));
        assert!(w.name.contains("synthetic"));
        // adp-shape is synthetic too, saturated as the throughput runs it stands in for
        r.trace = Some("adp-shape".into());
        let w = r.workload().expect("workload");
        assert_eq!(w.name, "adp-shape (synthetic)");
        assert_eq!(w.arrival, Arrival::Saturated);
        assert!(w.arrival_why.contains("synthetic"), "{}", w.arrival_why);
        r.trace = Some("paper-azure".into());

        r.arrival = Arrival::Trace;
        r.rate_scale = 2.0;
        let w2 = r.workload().expect("workload");
        let last = w2.requests.last().and_then(|q| q.arrival_ms).expect("ts");
        // 100 requests at 5/s, twice as fast: about 10 s
        assert!(last > 5_000.0 && last < 15_000.0, "{last}");

        r.arrival = Arrival::Poisson;
        assert!(r.workload().is_err(), "poisson needs --rate");
        r.rate = Some(100.0);
        let w3 = r.workload().expect("workload");
        let last = w3.requests.last().and_then(|q| q.arrival_ms).expect("ts");
        assert!(last > 500.0 && last < 1_500.0, "{last}");

        r.step_a = f64::NAN;
        assert!(r.workload().is_err());
        r.step_a = 2e-4;
        r.step_c = -0.1;
        assert!(r.workload().is_err());
        r.step_c = 0.0;
        // --step-p prices prefill on the decode ranks: only with --colocated
        r.step_p = 0.5;
        assert!(r.workload().is_err());
        r.colocated = true;
        r.workload().expect("colocated with p");
        assert_eq!(
            r.colocated(),
            Some(crate::engine::Colocated {
                step_p: 0.5,
                chunk: DEFAULT_PREFILL_CHUNK
            })
        );
        r.step_p = f64::INFINITY;
        assert!(r.workload().is_err());
        r.step_p = 0.0;
        r.colocated = false;
        assert_eq!(r.colocated(), None);
        r.trace = Some("/nonexistent/t.csv".into());
        assert!(matches!(r.workload(), Err(WorkloadError::Trace(_))));
        r.trace = Some("paper-prop".into());
        // `--limit` sizes a synthetic workload, above its published count too.
        r.arrival = Arrival::Saturated;
        let published = SynthKind::PaperProp.default_requests();
        r.limit = Some(published + 500);
        assert_eq!(
            r.workload().expect("workload").requests.len(),
            published + 500
        );
        // With a filter too: N of those that pass, or an error naming the flags.
        r.filter_min_output = Some(1001);
        r.limit = Some(50);
        let w = r.workload().expect("workload");
        assert_eq!(w.requests.len(), 50);
        assert!(w.requests.iter().all(|q| q.output_tokens >= 1001));
        r.limit = Some(published * 10);
        let e = r.workload().expect_err("more than pass the filter");
        assert!(e.to_string().contains("--limit"), "{e}");
        r.limit = Some(100);
        r.filter_min_output = Some(u32::MAX);
        assert!(matches!(r.workload(), Err(WorkloadError::Invalid(_))));
    }

    /// The workload `br-sim run` builds from `base` and then `flags`.
    fn workload_of(base: &[&str], flags: &[&str]) -> Result<Workload, WorkloadError> {
        let args: Vec<&str> = base.iter().chain(flags).copied().collect();
        let Command::Run(r) = parse(&args).expect("parse") else {
            panic!("run")
        };
        r.workload()
    }

    #[test]
    fn hint_flags_give_hints_or_a_workload_error() {
        let workload =
            |flags: &[&str]| workload_of(&["--trace", "paper-azure", "--limit", "50"], flags);
        let plain = workload(&[]).expect("workload");
        assert!(plain.hints.is_none());
        assert!(plain.requests.iter().all(|q| q.expected_output.is_none()));
        let exact = workload(&["--hint-error", "0"]).expect("workload");
        assert!(
            exact
                .requests
                .iter()
                .all(|q| q.expected_output == Some(q.output_tokens))
        );
        let constant = workload(&["--hint-mode", "constant"]).expect("workload");
        let first = constant.requests[0].expected_output;
        assert!(constant.requests.iter().all(|q| q.expected_output == first));
        for bad in [
            &["--hint-error=-1"][..],
            &["--hint-error", "NaN"][..],
            &["--hint-mode", "constant", "--hint-error", "0.3"][..],
        ] {
            let e = workload(bad).expect_err("refused");
            assert!(matches!(e, WorkloadError::Invalid(_)), "{bad:?}: {e}");
            assert!(e.to_string().contains("--hint-error"), "{e}");
        }
        assert!(parse(&["--trace", "x", "--hint-mode", "random"]).is_err());
    }

    #[test]
    fn repeat_replays_a_trace_file_one_copy_after_another() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("arrivals.csv");
        std::fs::write(
            &path,
            "arrival_ms,prompt_tokens,output_tokens,prompt_hash\n0,10,200,7\n2,20,300,\n4,30,400,\n",
        )
        .expect("write");
        let path = path.to_str().expect("utf-8");
        let base = ["--trace", path, "--arrival", "trace"];
        let once = workload_of(&base, &[]).expect("workload");
        let thrice = workload_of(&base, &["--repeat", "3"]).expect("workload");
        assert_eq!(thrice.requests.len(), 9);
        assert!(thrice.name.ends_with("×3"), "{}", thrice.name);
        let got: Vec<(Option<f64>, u32, u32, Option<u64>)> = thrice
            .requests
            .iter()
            .map(|q| {
                (
                    q.arrival_ms,
                    q.prompt_tokens,
                    q.output_tokens,
                    q.prompt_hash,
                )
            })
            .collect();
        // each copy starts 1 ms after the last one's final arrival (4 ms), the lengths and
        // hashes as recorded
        for (k, chunk) in got.chunks(3).enumerate() {
            for (q, o) in chunk.iter().zip(&once.requests) {
                assert_eq!(q.0, o.arrival_ms.map(|a| a + 5.0 * k as f64));
                assert_eq!(
                    (q.1, q.2, q.3),
                    (o.prompt_tokens, o.output_tokens, o.prompt_hash)
                );
            }
        }
        // after --limit: the first two, three times
        let cut = workload_of(&base, &["--limit", "2", "--repeat", "3"]).expect("workload");
        assert_eq!(cut.requests.len(), 6);
        for bad in ["0", "65", "x"] {
            assert!(parse(&["--trace", path, "--repeat", bad]).is_err(), "{bad}");
        }
        let e = workload_of(&["--trace", "adp-shape"], &["--repeat", "2"]).expect_err("synthetic");
        assert!(e.to_string().contains("--repeat 2"), "{e}");
    }

    #[test]
    fn a_trace_s_own_hints_are_replayed_and_not_replaced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("arrivals.csv");
        std::fs::write(
            &path,
            "arrival_ms,prompt_tokens,output_tokens,prompt_hash,expected_output_tokens\n\
             0,10,200,,150\n0.5,10,300,,\n1,10,400,,410\n",
        )
        .expect("write");
        let path = path.to_str().expect("utf-8");
        let workload =
            |flags: &[&str]| workload_of(&["--trace", path, "--arrival", "trace"], flags);
        let w = workload(&[]).expect("workload");
        assert_eq!(w.trace_hints, 2);
        assert!(w.hints.is_none());
        let got: Vec<(u32, Option<u32>)> = w
            .requests
            .iter()
            .map(|q| (q.output_tokens, q.expected_output))
            .collect();
        assert_eq!(got, vec![(200, Some(150)), (300, None), (400, Some(410))]);
        // the jitter reorders arrivals; each keeps its own hint
        let j = workload(&["--arrival-jitter-ms", "1", "--seed", "3"]).expect("workload");
        for q in &j.requests {
            let want = got
                .iter()
                .find(|g| g.0 == q.output_tokens)
                .expect("same requests");
            assert_eq!(q.expected_output, want.1);
        }
        for flags in [&["--hint-error", "0"][..], &["--hint-mode", "constant"][..]] {
            let e = workload(flags).expect_err("made hints over recorded ones");
            assert!(e.to_string().contains("expected_output_tokens"), "{e}");
        }
    }

    #[test]
    fn class_flags_give_classes_or_a_workload_error() {
        let workload =
            |flags: &[&str]| workload_of(&["--trace", "paper-prop", "--limit", "400"], flags);
        let plain = workload(&[]).expect("workload");
        assert!(plain.classes.is_none() && plain.class_share.is_none());
        assert!(plain.requests.iter().all(|q| q.class.is_none()));
        let w = workload(&["--classes", "4", "--class-error", "0.5"]).expect("workload");
        assert_eq!(
            w.classes,
            Some(Classes {
                count: 4,
                mode: ClassMode::Noisy,
                sigma: 0.5
            })
        );
        assert!(w.requests.iter().all(|q| q.class.is_some()));
        let share = w.class_share.expect("a share");
        assert!(share > 0.2 && share < 1.0, "{share}");
        // the same flags and seed, the same classes; the hints are not disturbed
        let again = workload(&["--classes", "4", "--class-error", "0.5"]).expect("workload");
        assert_eq!(again.requests, w.requests);
        let both = workload(&["--classes", "4", "--hint-error", "0"]).expect("workload");
        assert!(
            both.requests
                .iter()
                .all(|q| q.expected_output == Some(q.output_tokens) && q.class.is_some())
        );
        for (bad, flag) in [
            (&["--classes", "1"][..], "--classes"),
            (&["--classes", "300"][..], "--classes"),
            (&["--class-error", "0.5"][..], "--classes"),
            (&["--class-mode", "random"][..], "--classes"),
            (&["--classes", "4", "--class-error=-1"][..], "--class-error"),
            (
                &[
                    "--classes",
                    "4",
                    "--class-mode",
                    "random",
                    "--class-error",
                    "1",
                ][..],
                "--class-error",
            ),
        ] {
            let e = workload(bad).expect_err("refused");
            assert!(matches!(e, WorkloadError::Invalid(_)), "{bad:?}: {e}");
            assert!(e.to_string().contains(flag), "{bad:?}: {e}");
        }
        assert!(parse(&["--trace", "x", "--classes", "4", "--class-mode", "exact"]).is_err());
    }

    #[test]
    fn a_trace_s_own_classes_are_replayed_and_not_replaced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("arrivals.csv");
        std::fs::write(
            &path,
            "arrival_ms,prompt_tokens,output_tokens,request_class\n\
             0,10,200,short\n0.5,10,3000,\n1,10,220,short\n2,10,4000,long\n",
        )
        .expect("write");
        let path = path.to_str().expect("utf-8");
        let workload =
            |flags: &[&str]| workload_of(&["--trace", path, "--arrival", "trace"], flags);
        let w = workload(&[]).expect("workload");
        assert_eq!((w.trace_classes, w.classes), (3, None));
        let keys: Vec<Option<&str>> = w
            .requests
            .iter()
            .map(|q| q.class.as_ref().map(crate::trace::Class::key))
            .collect();
        assert_eq!(keys, vec![Some("short"), None, Some("short"), Some("long")]);
        assert!(w.class_share.expect("a share") > 0.9, "{:?}", w.class_share);
        let e = workload(&["--classes", "2"]).expect_err("made classes over recorded ones");
        assert!(e.to_string().contains("request_class"), "{e}");
    }

    #[test]
    fn trace_arrivals_need_timestamps_and_are_sorted() {
        let req = |t: Option<f64>| TraceRequest {
            arrival_ms: t,
            prompt_tokens: 1,
            output_tokens: 1,
            prompt_hash: None,
            expected_output: None,
            class: None,
        };
        assert!(stamp_arrivals(vec![req(None)], Arrival::Trace, 1.0, None, 0).is_err());
        let out = stamp_arrivals(
            vec![req(Some(50.0)), req(Some(30.0)), req(Some(90.0))],
            Arrival::Trace,
            2.0,
            None,
            0,
        )
        .expect("stamp");
        let ts: Vec<f64> = out.iter().filter_map(|r| r.arrival_ms).collect();
        assert_eq!(ts, vec![0.0, 10.0, 30.0]);
    }

    #[test]
    fn arrival_jitter_reorders_close_arrivals_only_and_is_seeded() {
        // Arrivals 0.1 ms apart in a burst, then one far later; each request tagged by its
        // prompt length so the order can be read back.
        let reqs: Vec<TraceRequest> = (0..40)
            .map(|i| TraceRequest {
                arrival_ms: Some(if i == 39 { 1000.0 } else { f64::from(i) * 0.1 }),
                prompt_tokens: i + 1,
                output_tokens: 1,
                prompt_hash: None,
                expected_output: None,
                class: None,
            })
            .collect();
        let order = |v: &[TraceRequest]| v.iter().map(|r| r.prompt_tokens).collect::<Vec<_>>();
        assert_eq!(order(&jitter_arrivals(reqs.clone(), 0.0, 7)), order(&reqs));
        let a = jitter_arrivals(reqs.clone(), 1.0, 7);
        assert_eq!(order(&a), order(&jitter_arrivals(reqs.clone(), 1.0, 7)));
        assert_ne!(
            order(&a),
            order(&reqs),
            "a 1 ms jitter reorders a 0.1 ms burst"
        );
        assert_ne!(order(&a), order(&jitter_arrivals(reqs.clone(), 1.0, 8)));
        let ts: Vec<f64> = a.iter().filter_map(|r| r.arrival_ms).collect();
        assert!(
            ts.windows(2).all(|w| w[0] <= w[1]) && ts[0] >= 0.0,
            "{ts:?}"
        );
        // the far arrival stays last and within ±1 ms of where it was
        assert_eq!(a.last().map(|r| r.prompt_tokens), Some(40));
        assert!((ts[39] - 1000.0).abs() <= 1.0);
    }

    #[test]
    fn arrival_jitter_is_for_trace_arrivals_and_non_negative() {
        let Command::Run(r) =
            parse(&["--trace", "paper-azure", "--arrival-jitter-ms", "0.5"]).expect("parse")
        else {
            panic!("run")
        };
        assert_eq!(r.arrival_jitter_ms, 0.5);
        let base = |jitter: f64, arrival: Arrival| RunArgs {
            arrival_jitter_ms: jitter,
            arrival,
            ..r.clone()
        };
        assert!(base(1.0, Arrival::Trace).validate().is_ok());
        for bad in [
            base(-1.0, Arrival::Trace),
            base(f64::NAN, Arrival::Trace),
            base(1.0, Arrival::Saturated),
        ] {
            let err = bad.validate().expect_err("refused").to_string();
            assert!(err.contains("--arrival-jitter-ms"), "{err}");
        }
    }
}
