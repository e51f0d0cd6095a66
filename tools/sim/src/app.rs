//! What each command does (the binary is a thin wrapper around [`execute`]).

use std::path::Path;
use std::time::Instant;

use anyhow::Context as _;

use crate::calibrate;
use crate::cli::{Arrival, CalibrateArgs, Command, RunArgs, SweepArgs, Workload};
use crate::engine::{EngineConfig, RunOutcome, simulate};
use crate::plot::{LoadSeries, ScalingPoint, plot_scaling, plot_worker_loads};
use crate::report::{Report, RunReport, SteadyExtra, is_baseline, render_table};
use crate::spec::{PolicySpec, parse_spec, parse_sweep_param, set_param};
use crate::synth::SynthKind;
use crate::trace::summarize;

/// Steps shown in the per-worker load figure (the paper's Figure 3 shows 1,500).
pub const LOAD_WINDOW_STEPS: usize = 1500;

/// Runs one command.
pub fn execute(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Run(args) => run(&args),
        Command::Sweep(args) => sweep(&args),
        Command::Calibrate(args) => calibrate_cmd(&args),
    }
}

/// Parses `--policies`.
pub fn parse_policies(args: &RunArgs) -> anyhow::Result<Vec<PolicySpec>> {
    args.policies
        .iter()
        .filter(|p| !p.trim().is_empty())
        .map(|p| parse_spec(p, args.seed).map_err(anyhow::Error::msg))
        .collect()
}

fn engine_config(args: &RunArgs, workers: u32, record_loads: bool) -> EngineConfig {
    EngineConfig {
        workers,
        slots: args.slots,
        step_a: args.step_a,
        step_b: args.step_b,
        record_loads,
    }
}

/// Builds and simulates one policy.
pub fn run_one(
    w: &Workload,
    spec: &PolicySpec,
    label: &str,
    cfg: &EngineConfig,
) -> anyhow::Result<RunOutcome> {
    let mut policy = br_core::build_policy(&spec.config)
        .with_context(|| format!("building policy {}", spec.label))?;
    let out = simulate(&w.requests, policy.as_mut(), label, cfg)?;
    eprintln!(
        "  {:<24} G={:<3} {:>7} steps  {:>8.1} ms wall  ({:.1} ns per step·worker)",
        label,
        cfg.workers,
        out.report.steps,
        out.wall.as_secs_f64() * 1e3,
        ns_per_step_worker(&out)
    );
    Ok(out)
}

/// Wall time per (step × G): the engine's cost is linear in it.
pub fn ns_per_step_worker(out: &RunOutcome) -> f64 {
    let denom = out.report.steps as f64 * out.report.workers as f64;
    if denom > 0.0 {
        out.wall.as_secs_f64() * 1e9 / denom
    } else {
        0.0
    }
}

fn describe(w: &Workload, args: &RunArgs, workers: Option<u32>) -> String {
    let s = summarize(&w.requests);
    let g = workers.map_or_else(|| "swept".to_string(), |g| g.to_string());
    let arrival = match args.arrival {
        Arrival::Saturated => "saturated".to_string(),
        Arrival::Trace => format!("trace timestamps x{}", args.rate_scale),
        Arrival::Poisson => format!("poisson {}/s", args.rate.unwrap_or(0.0)),
    };
    format!(
        "workload {}: {} requests, prompt mean {:.0} [{}..{}], output mean {:.0} [{}..{}], {:.0}% repeated prompts\n\
         G={} B={} arrival={} step T = {:e}·max L + {} ms",
        w.name,
        s.requests,
        s.mean_prompt,
        s.min_prompt,
        s.max_prompt,
        s.mean_output,
        s.min_output,
        s.max_output,
        100.0 * s.repeat_share,
        g,
        args.slots,
        arrival,
        args.step_a,
        args.step_b
    )
}

fn run(args: &RunArgs) -> anyhow::Result<()> {
    let specs = parse_policies(args)?;
    let w = args.workload()?;
    println!("{}", describe(&w, args, Some(args.workers)));
    let cfg = engine_config(args, args.workers, args.plot.is_some());
    let started = Instant::now();
    let mut outcomes = Vec::with_capacity(specs.len());
    for spec in &specs {
        outcomes.push(run_one(&w, spec, &spec.label, &cfg)?);
    }
    eprintln!(
        "  {} runs in {:.2} s",
        outcomes.len(),
        started.elapsed().as_secs_f64()
    );
    let report = Report {
        runs: outcomes.iter().map(|o| o.report.clone()).collect(),
    };
    let steady: Vec<SteadyExtra> = outcomes.iter().map(RunOutcome::steady_extra).collect();
    print!("{}", render_table(&report.runs, &steady));
    if let Some(path) = &args.json {
        report
            .write_json(path)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(dir) = &args.plot {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let series: Vec<LoadSeries> = outcomes.iter().filter_map(|o| o.loads.clone()).collect();
        let window = load_window(&outcomes);
        let path = dir.join("worker_loads.svg");
        let title = format!(
            "Per-worker KV load, {} (G = {}, B = {}), steps {}..{}",
            w.name, args.workers, args.slots, window.start, window.end
        );
        plot_worker_loads(&path, &title, &series, Some(window), 750)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// A window of [`LOAD_WINDOW_STEPS`] steps in the middle of the span where every run had
/// requests waiting (the steady state), or in the middle of the shortest run.
pub fn load_window(outcomes: &[RunOutcome]) -> std::ops::Range<usize> {
    let shortest = outcomes
        .iter()
        .map(|o| o.report.steps as usize)
        .min()
        .unwrap_or(0);
    let (mut lo, mut hi) = (0usize, shortest);
    if outcomes.iter().all(|o| !o.waiting_steps.is_empty()) {
        lo = outcomes
            .iter()
            .map(|o| o.waiting_steps.start)
            .max()
            .unwrap_or(0);
        hi = outcomes
            .iter()
            .map(|o| o.waiting_steps.end)
            .min()
            .unwrap_or(0)
            .min(shortest);
        if hi <= lo {
            (lo, hi) = (0, shortest);
        }
    }
    if hi - lo <= LOAD_WINDOW_STEPS {
        return lo..hi;
    }
    let mid = lo + (hi - lo) / 2;
    let start = mid - LOAD_WINDOW_STEPS / 2;
    start..start + LOAD_WINDOW_STEPS
}

fn sweep(args: &SweepArgs) -> anyhow::Result<()> {
    let run = &args.run;
    let specs = parse_policies(run)?;
    if let Some(param) = &args.param {
        return param_sweep(args, &specs, param);
    }
    let per_worker = args.per_worker.or(match run.synthetic() {
        Some(SynthKind::PaperAzure) => Some(1250),
        Some(SynthKind::PaperProp) => Some(1000),
        None => None,
    });
    let mut runs: Vec<RunReport> = Vec::new();
    let mut steady = Vec::new();
    let started = Instant::now();
    for &g in &args.workers_list {
        anyhow::ensure!(
            (1..=1024).contains(&g),
            "--workers-list: G={g} is out of range"
        );
        let w = run.workload_sized(per_worker.map(|n| n * g as usize))?;
        println!("{}", describe(&w, run, Some(g)));
        let cfg = engine_config(run, g, false);
        for spec in &specs {
            let o = run_one(&w, spec, &spec.label, &cfg)?;
            steady.push(o.steady_extra());
            runs.push(o.report);
        }
    }
    eprintln!(
        "  {} runs in {:.2} s",
        runs.len(),
        started.elapsed().as_secs_f64()
    );
    print!("{}", render_table(&runs, &steady));
    let points = scaling_points(&runs);
    for p in &points {
        println!(
            "G={:<3} {:<20} gain {:+6.1}%  steady gain {:+6.1}%  imbalance {:.0}",
            p.workers, p.policy, p.gain_pct, p.steady_gain_pct, p.avg_imbalance
        );
    }
    let report = Report { runs };
    if let Some(path) = &run.json {
        report
            .write_json(path)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(dir) = &run.plot {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join("scaling.svg");
        let name = run.trace.as_deref().unwrap_or("trace");
        let title = format!(
            "Scaling with G: {}{} (B = {}, {})",
            name,
            if run.synthetic().is_some() {
                " (synthetic)"
            } else {
                ""
            },
            run.slots,
            match per_worker {
                Some(n) => format!("{n} requests per worker"),
                None => "same trace at every G".into(),
            }
        );
        plot_scaling(&path, &title, &points)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Gains of every policy over the best baseline (by whole-run throughput) at the same G,
/// plus the imbalance; the best baseline itself is included (gain 0) for reference.
pub fn scaling_points(runs: &[RunReport]) -> Vec<ScalingPoint> {
    let mut out = Vec::new();
    for r in runs {
        let best = runs
            .iter()
            .filter(|b| b.workers == r.workers && is_baseline(&b.policy))
            .max_by(|x, y| x.throughput_tok_s.total_cmp(&y.throughput_tok_s));
        let Some(best) = best else { continue };
        let best_steady = runs
            .iter()
            .filter(|b| b.workers == r.workers && is_baseline(&b.policy))
            .map(|b| b.steady_throughput_tok_s)
            .fold(0.0f64, f64::max);
        if is_baseline(&r.policy) && r.policy != best.policy {
            continue;
        }
        let pct = |x: f64, base: f64| {
            if base > 0.0 {
                100.0 * (x / base - 1.0)
            } else {
                0.0
            }
        };
        out.push(ScalingPoint {
            policy: if is_baseline(&r.policy) {
                "best baseline".into()
            } else {
                r.policy.clone()
            },
            workers: r.workers,
            gain_pct: pct(r.throughput_tok_s, best.throughput_tok_s),
            steady_gain_pct: pct(r.steady_throughput_tok_s, best_steady),
            avg_imbalance: r.avg_imbalance,
        });
    }
    out
}

fn param_sweep(args: &SweepArgs, specs: &[PolicySpec], param: &str) -> anyhow::Result<()> {
    let run = &args.run;
    let (key, values) = parse_sweep_param(param).map_err(anyhow::Error::msg)?;
    let w = run.workload()?;
    println!("{}", describe(&w, run, Some(run.workers)));
    println!("sweeping {key} over {}", values.join(", "));
    let cfg = engine_config(run, run.workers, false);
    let mut runs = Vec::new();
    let mut steady = Vec::new();
    for spec in specs.iter().filter(|s| !s.is_balance_route()) {
        let o = run_one(&w, spec, &spec.label, &cfg)?;
        steady.push(o.steady_extra());
        runs.push(o.report);
    }
    for spec in specs.iter().filter(|s| s.is_balance_route()) {
        for v in &values {
            let mut s = spec.clone();
            set_param(&mut s.config, &key, v)
                .map_err(|e| anyhow::anyhow!("{}: {e}", spec.label))?;
            let label = format!("{}[{key}={v}]", spec.label);
            let o = run_one(&w, &s, &label, &cfg)?;
            steady.push(o.steady_extra());
            runs.push(o.report);
        }
    }
    print!("{}", render_table(&runs, &steady));
    if let Some(path) = &run.json {
        Report { runs }
            .write_json(path)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn calibrate_cmd(args: &CalibrateArgs) -> anyhow::Result<()> {
    let fit = calibrate::calibrate_file(&args.samples, args.strict)?;
    print!("{}", fit.render());
    if let Some(path) = &args.json {
        write_json(path, &fit)?;
    }
    Ok(())
}

fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}
