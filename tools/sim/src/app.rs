//! What each command does (the binary is a thin wrapper around [`execute`]).

use std::path::Path;
use std::time::Instant;

use anyhow::Context as _;

use crate::calibrate;
use crate::cli::{Arrival, CalibrateArgs, Command, RunArgs, SweepArgs, Workload};
use crate::engine::{ControlPlane, EngineConfig, RunOutcome, simulate_deciders};
use crate::plot::{Limit, LoadSeries, ScalingPoint, plot_scaling, plot_worker_loads};
use crate::report::{Report, RunReport, SteadyExtra, TABLE_LEGEND, is_baseline, render_table};
use crate::spec::{PolicySpec, parse_spec, parse_sweep_param, set_param};
use crate::synth::SynthKind;
use crate::trace::summarize;

mod sweep;

use sweep::sweep;

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
        step_c: args.step_c,
        colocated: args.colocated(),
        record_loads,
        control: ControlPlane {
            telemetry_lag_steps: args.telemetry_lag_steps,
            deciders: args.deciders,
            turns: args.decider_turns,
            rank_split: args.decider_ranks.then_some(args.decider_takeover_steps),
        },
    }
}

/// Builds and simulates one policy.
pub fn run_one(
    w: &Workload,
    spec: &PolicySpec,
    label: &str,
    cfg: &EngineConfig,
) -> anyhow::Result<RunOutcome> {
    let mut policies = (0..cfg.control.deciders.max(1))
        .map(|_| br_core::build_policy(&spec.config))
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("building policy {}", spec.label))?;
    let mut refs: Vec<&mut dyn br_core::Policy> =
        policies.iter_mut().map(|p| p.as_mut() as _).collect();
    let out = simulate_deciders(&w.requests, &mut refs, label, cfg)?;
    let refused = if cfg.control.deciders > 1 {
        format!("  {} reservations refused", out.refused_reservations)
    } else {
        String::new()
    };
    // BR-H: what the twin's predictor learned as it ran, and its size (the memory bound).
    let learned = refs
        .first()
        .and_then(|p| p.predictor_stats())
        .map_or_else(String::new, |st| {
            format!(
                "  predictor {} samples, {} hashes, {} buckets, {} KiB",
                st.samples,
                st.hashes,
                st.buckets,
                st.bytes.div_ceil(1024)
            )
        });
    let f = out.idle_flow;
    eprintln!(
        "  {:<24} G={:<3} {:>7} steps  {:>8.1} ms wall  ({:.1} ns per step·worker){refused}",
        label,
        cfg.workers,
        out.report.steps,
        out.wall.as_secs_f64() * 1e3,
        ns_per_step_worker(&out)
    );
    eprintln!(
        "  {:<24} idle/step: steady {:.0} over {} steps, growth adds {:+.1} (running spread \
         {:.2}); whole run {:.0}, growth adds {:+.1} (spread {:.2}){learned}",
        label,
        f.mean_idle,
        f.steady_steps,
        f.mean_growth,
        f.mean_running_spread,
        out.report.avg_barrier_idle,
        f.run_growth,
        f.run_running_spread
    );
    if cfg.colocated.is_some() {
        let b = out.barrier;
        eprintln!(
            "  {:<24} beyond the aligned limit per step: {:.1} ms KV, {:.1} ms prefill, {:.1} ms \
             requests; prefill {:.0} tokens per rank per step, the busiest rank {:.0}",
            label, b.kv_ms, b.prefill_ms, b.request_ms, b.mean_prefill_tokens, b.max_prefill_tokens
        );
    }
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
    let arrival = match w.arrival {
        Arrival::Saturated | Arrival::Auto => "saturated".to_string(),
        Arrival::Trace => format!("trace timestamps x{}", args.rate_scale),
        Arrival::Poisson => format!("poisson {}/s", args.rate.unwrap_or(0.0)),
    };
    let arrival = format!("{arrival} ({})", w.arrival_why);
    let mut dropped = Vec::new();
    if w.stats.dropped_zero_output > 0 {
        dropped.push(format!(
            "{} with no output tokens",
            w.stats.dropped_zero_output
        ));
    }
    if w.stats.dropped_filter > 0 {
        dropped.push(format!("{} by --filter-min-output", w.stats.dropped_filter));
    }
    let dropped = if dropped.is_empty() {
        String::new()
    } else {
        format!(
            "; dropped {} of {} rows: {}",
            w.stats.dropped_zero_output + w.stats.dropped_filter,
            w.stats.rows,
            dropped.join(", ")
        )
    };
    let hints = match (w.hints, w.trace_hints) {
        (Some(h), _) => format!("; {}", h.describe()),
        (None, 0) => String::new(),
        (None, n) => format!("; hints: the trace's own, on {n} requests"),
    };
    let classes = match (w.classes, w.trace_classes) {
        (Some(c), _) => format!("; {}", c.describe(w.class_share)),
        (None, 0) => String::new(),
        (None, n) => format!(
            "; classes: the trace's own, on {n} requests, {}",
            crate::classes::describe_share(w.class_share)
        ),
    };
    let control = if args.telemetry_lag_steps > 0 || args.deciders > 1 {
        format!(
            " control plane: {} decider(s){}, telemetry lag {} step(s)",
            args.deciders,
            if args.decider_turns {
                " taking turns".to_string()
            } else if args.decider_ranks {
                format!(
                    " splitting ranks (takeover after {} steps)",
                    args.decider_takeover_steps
                )
            } else {
                String::new()
            },
            args.telemetry_lag_steps
        )
    } else {
        String::new()
    };
    let colocated = args.colocated().map_or_else(String::new, |co| {
        format!(
            "; colocated prefill, {} prompt tokens per rank per step",
            co.chunk
        )
    });
    format!(
        "workload {}: {} requests, prompt mean {:.0} [{}..{}], output mean {:.0} [{}..{}], {:.0}% repeated prompts{}{}{}\n\
         G={} B={} arrival={} step T = {:e}·max L{}{} + {} ms{}{}",
        w.name,
        s.requests,
        s.mean_prompt,
        s.min_prompt,
        s.max_prompt,
        s.mean_output,
        s.min_output,
        s.max_output,
        100.0 * s.repeat_share,
        dropped,
        hints,
        classes,
        g,
        args.slots,
        arrival,
        args.step_a,
        if args.colocated {
            format!(" + {}·max P", args.step_p)
        } else {
            String::new()
        },
        if args.step_c != 0.0 {
            format!(" + {}·max n", args.step_c)
        } else {
            String::new()
        },
        args.step_b,
        colocated,
        control
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
    println!("{TABLE_LEGEND}");
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

#[cfg(test)]
mod tests {
    use super::sweep::{Row, average_rows, scaling_points, steady_gap_spread};
    use super::*;
    use std::time::Duration;

    fn row(policy: &str, g: usize, tput: f64, imb: f64) -> Row {
        (
            RunReport {
                policy: policy.into(),
                workers: g,
                avg_imbalance: imb,
                avg_barrier_idle: 0.0,
                throughput_tok_s: tput,
                steady_throughput_tok_s: tput,
                fluid_throughput_tok_s: tput * 1.1,
                tpot_p50_ms: 1.0,
                tpot_p95_ms: 2.0,
                ttft_p50_ms: 3.0,
                ttft_p95_ms: 4.0,
                ttft_p99_ms: 5.0,
                avg_balance: 0.9,
                mean_queue_ms: 0.0,
                steps: 10,
                requests: 5,
            },
            SteadyExtra {
                fluid_tok_s: tput * 1.1,
                imbalance: imb,
                balance: 0.9,
            },
        )
    }

    #[test]
    fn averaging_and_scaling_points() {
        let a = vec![row("jsq", 8, 100.0, 10.0), row("br0", 8, 110.0, 2.0)];
        let b = vec![row("jsq", 8, 200.0, 30.0), row("br0", 8, 210.0, 4.0)];
        let avg = average_rows(&[a.clone(), b.clone()]);
        assert_eq!(avg[0].0.throughput_tok_s, 150.0);
        assert_eq!(avg[1].0.avg_imbalance, 3.0);
        assert_eq!(avg[1].1.imbalance, 3.0);
        let pts = scaling_points(&avg, &[a.clone(), b.clone()]);
        assert_eq!(pts.len(), 2);
        assert_eq!(pts[0].policy, "best baseline");
        assert!((pts[1].gain_pct - 100.0 * (160.0 / 150.0 - 1.0)).abs() < 1e-9);
        // the gap share is paired within each seed: the baseline runs at 100/110 of its fluid
        // limit, br0 at 110/121 (the same efficiency): no share of the gap in either seed
        assert_eq!(pts[0].steady_gap_pct, None, "not drawn for the baseline");
        let (m, se) = pts[1].steady_gap_pct.expect("br0's share");
        assert!(m.abs() < 1e-9 && se.abs() < 1e-9, "{m} ± {se}");
        // seed a's br0 at its fluid limit (all of the gap), seed b's as efficient as the
        // baseline (none of it): 50 ± 50%
        let mut a_full = a.clone();
        a_full[1].1.fluid_tok_s = a_full[1].0.steady_throughput_tok_s;
        let (m, se) = steady_gap_spread(&[a_full, b.clone()], 1).expect("share");
        assert!(
            (m - 50.0).abs() < 1e-9 && (se - 50.0).abs() < 1e-9,
            "{m} ± {se}"
        );
        assert_eq!(
            steady_gap_spread(&[a, b], 0).map(|(m, _)| m.round()),
            Some(0.0)
        );
    }

    #[test]
    fn load_window_is_inside_the_common_steady_span() {
        let out = |steps: u64, wait: std::ops::Range<usize>| RunOutcome {
            report: RunReport {
                steps,
                ..row("x", 8, 1.0, 1.0).0
            },
            loads: None,
            waiting_steps: wait,
            wall: Duration::ZERO,
            steady_fluid_tok_s: 0.0,
            steady_imbalance: 0.0,
            steady_balance: 0.0,
            barrier: Default::default(),
            refused_reservations: 0,
            idle_flow: Default::default(),
        };
        assert_eq!(
            load_window(&[out(10_000, 0..5000), out(9000, 100..6000)]),
            1800..3300
        );
        assert_eq!(load_window(&[out(1000, 0..0)]), 0..1000);
        assert_eq!(
            load_window(&[out(5000, 0..0), out(4000, 0..100)]),
            1250..2750
        );
    }
}
