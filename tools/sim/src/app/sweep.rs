//! `br-sim sweep`: every G of the list (or every value of one policy parameter) over several
//! seeds, the rows averaged, the spread table and the scaling figure's points.
//!
//! Separate from the single run in the parent module: the multi-seed bookkeeping (means,
//! standard errors, the paired steady-state gain) is only the sweep's.

use super::*;

/// The share of the best baseline's steady gap to its fluid limit that row `i` of one seed's
/// rows removes (by efficiency, steady / steady fluid: [`crate::report::gap_share`]), against
/// the baseline with the highest steady throughput at the same G. `None` without a baseline at
/// that G or when it has no gap.
fn steady_gap(rows: &[Row], i: usize) -> Option<f64> {
    let (r, rx) = &rows[i];
    let best = rows
        .iter()
        .filter(|b| b.0.workers == r.workers && is_baseline(&b.0.policy))
        .max_by(|x, y| {
            x.0.steady_throughput_tok_s
                .total_cmp(&y.0.steady_throughput_tok_s)
        })?;
    crate::report::gap_share(
        r.steady_throughput_tok_s,
        rx.fluid_tok_s,
        best.0.steady_throughput_tok_s,
        best.1.fluid_tok_s,
    )
}

/// Mean and standard error of the mean (0 for one value).
fn mean_sem(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let m = xs.iter().sum::<f64>() / n;
    let v = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, (v / n).sqrt())
}

/// Row `i`'s steady gap share in percent, paired by seed (each seed against its own best
/// baseline), as mean and standard error over the seeds: the table's `s.gap%` and the
/// scaling figure's third panel. `None` if any seed has no baseline gap at that G.
pub fn steady_gap_spread(per_seed: &[Vec<Row>], i: usize) -> Option<(f64, f64)> {
    let gaps: Option<Vec<f64>> = per_seed.iter().map(|rows| steady_gap(rows, i)).collect();
    gaps.filter(|g| !g.is_empty()).map(|g| {
        let (m, se) = mean_sem(&g);
        (100.0 * m, 100.0 * se)
    })
}

/// Standard error of the mean across seeds of the figures parameter choices are judged by.
pub fn render_spread(per_seed: &[Vec<Row>]) -> String {
    use std::fmt::Write as _;
    let Some(first) = per_seed.first() else {
        return String::new();
    };
    let sem = |i: usize, f: &dyn Fn(&Row) -> f64| {
        mean_sem(&per_seed.iter().map(|rows| f(&rows[i])).collect::<Vec<_>>())
    };
    let width = first
        .iter()
        .map(|r| r.0.policy.len())
        .max()
        .unwrap_or(6)
        .max(6);
    let mut s = format!(
        "mean ± standard error over seeds (s.gain%, s.gap%: paired, against the best baseline of the same seed and G)\n{:<width$} {:>3} {:>18} {:>18} {:>20} {:>14} {:>12} {:>16}\n",
        "policy", "G", "imbalance", "s.imbal", "steady tok/s", "s.gain%", "s.gap%", "tpot95"
    );
    // per seed: steady gain over the best baseline (by steady throughput) at the same G
    let steady_gain = |rows: &Vec<Row>, i: usize| {
        let r = &rows[i].0;
        let best = rows
            .iter()
            .filter(|b| b.0.workers == r.workers && is_baseline(&b.0.policy))
            .map(|b| b.0.steady_throughput_tok_s)
            .fold(0.0f64, f64::max);
        if best > 0.0 {
            100.0 * (r.steady_throughput_tok_s / best - 1.0)
        } else {
            0.0
        }
    };
    for (i, (r, _)) in first.iter().enumerate() {
        let (a, da) = sem(i, &|r| r.0.avg_imbalance);
        let (b, db) = sem(i, &|r| r.1.imbalance);
        let (c, dc) = sem(i, &|r| r.0.steady_throughput_tok_s);
        let (d, dd) = sem(i, &|r| r.0.tpot_p95_ms);
        let gains: Vec<f64> = per_seed.iter().map(|rows| steady_gain(rows, i)).collect();
        let (gm, gse) = mean_sem(&gains);
        let gap = steady_gap_spread(per_seed, i).map_or_else(
            || format!("{:>12}", "-"),
            |(m, se)| format!("{m:>5.1} ±{se:>5.1}"),
        );
        let _ = writeln!(
            s,
            "{:<width$} {:>3} {:>10.0} ±{:>6.0} {:>10.0} ±{:>6.0} {:>11.1} ±{:>7.1} {:>+7.2} ±{:>5.2} {gap} {:>8.2} ±{:>6.2}",
            r.policy, r.workers, a, da, b, db, c, dc, gm, gse, d, dd
        );
    }
    s
}

/// A table row: the JSON report and the steady-state extras.
pub type Row = (RunReport, SteadyExtra);

/// The seeds a sweep runs (`--seeds`, else `--seed`).
fn sweep_seeds(args: &SweepArgs) -> Vec<u64> {
    if args.seeds.is_empty() {
        vec![args.run.seed]
    } else {
        args.seeds.clone()
    }
}

/// Averages rows run with different seeds (every seed yields the same rows in the same order).
pub fn average_rows(per_seed: &[Vec<Row>]) -> Vec<Row> {
    let Some(first) = per_seed.first() else {
        return Vec::new();
    };
    let k = per_seed.len() as f64;
    (0..first.len())
        .map(|i| {
            let mean =
                |f: &dyn Fn(&Row) -> f64| per_seed.iter().map(|rows| f(&rows[i])).sum::<f64>() / k;
            let (r0, _) = &first[i];
            (
                RunReport {
                    policy: r0.policy.clone(),
                    workers: r0.workers,
                    avg_imbalance: mean(&|r| r.0.avg_imbalance),
                    avg_barrier_idle: mean(&|r| r.0.avg_barrier_idle),
                    throughput_tok_s: mean(&|r| r.0.throughput_tok_s),
                    steady_throughput_tok_s: mean(&|r| r.0.steady_throughput_tok_s),
                    fluid_throughput_tok_s: mean(&|r| r.0.fluid_throughput_tok_s),
                    tpot_p50_ms: mean(&|r| r.0.tpot_p50_ms),
                    tpot_p95_ms: mean(&|r| r.0.tpot_p95_ms),
                    ttft_p50_ms: mean(&|r| r.0.ttft_p50_ms),
                    ttft_p95_ms: mean(&|r| r.0.ttft_p95_ms),
                    ttft_p99_ms: mean(&|r| r.0.ttft_p99_ms),
                    avg_balance: mean(&|r| r.0.avg_balance),
                    mean_queue_ms: mean(&|r| r.0.mean_queue_ms),
                    steps: mean(&|r| r.0.steps as f64).round() as u64,
                    requests: mean(&|r| r.0.requests as f64).round() as u64,
                },
                SteadyExtra {
                    fluid_tok_s: mean(&|r| r.1.fluid_tok_s),
                    imbalance: mean(&|r| r.1.imbalance),
                    balance: mean(&|r| r.1.balance),
                },
            )
        })
        .collect()
}

pub(super) fn sweep(args: &SweepArgs) -> anyhow::Result<()> {
    args.validate()?;
    let seeds = sweep_seeds(args);
    let started = Instant::now();
    let mut per_seed = Vec::with_capacity(seeds.len());
    let mut per_worker = None;
    for &seed in &seeds {
        let mut run = args.run.clone();
        run.seed = seed;
        let rows = if let Some(param) = &args.param {
            param_rows(&args.run_at(&run, run.workers), param)?
        } else {
            let (rows, pw) = g_rows(args, &run)?;
            per_worker = pw;
            rows
        };
        per_seed.push(rows);
    }
    let rows = average_rows(&per_seed);
    eprintln!(
        "  {} runs in {:.2} s",
        rows.len() * seeds.len(),
        started.elapsed().as_secs_f64()
    );
    if seeds.len() > 1 {
        println!("averaged over {} seeds: {:?}", seeds.len(), seeds);
        print!("{}", render_spread(&per_seed));
    }
    let points = scaling_points(&rows, &per_seed);
    let (runs, steady): (Vec<RunReport>, Vec<SteadyExtra>) = rows.into_iter().unzip();
    print!("{}", render_table(&runs, &steady));
    println!("{TABLE_LEGEND}");
    let report = Report { runs };
    if let Some(path) = &args.run.json {
        report
            .write_json(path)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.param.is_some() {
        return Ok(());
    }
    for p in &points {
        println!(
            "G={:<3} {:<20} gain {:+6.1}%  steady gain {:+6.1}%  imbalance {:.0}  steady imbalance {:.0}",
            p.workers, p.policy, p.gain_pct, p.steady_gain_pct, p.avg_imbalance, p.steady_imbalance
        );
    }
    if let Some(dir) = &args.run.plot {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join("scaling.svg");
        let run = &args.run;
        let name = run.trace.as_deref().unwrap_or("trace");
        // the arrivals, as the runs resolved them (every G resolves `auto` alike)
        let arrival = match (run.arrival, args.rate_per_worker, run.rate) {
            (Arrival::Poisson, Some(r), _) => format!("Poisson at {r}/s per worker, "),
            (Arrival::Poisson, None, Some(r)) => format!("Poisson at {r}/s, "),
            (Arrival::Trace, _, _) => format!("trace timestamps x{}, ", run.rate_scale),
            _ => String::new(),
        };
        let title = format!(
            "Scaling with G: {}{} (B = {}, {arrival}{}{})",
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
            },
            if seeds.len() > 1 {
                format!(", mean of {} seeds", seeds.len())
            } else {
                String::new()
            }
        );
        let limit = if run.colocated {
            Limit::Aligned
        } else {
            Limit::Fluid
        };
        plot_scaling(&path, &title, limit, &points)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// The G sweep for one seed; also returns the requests per worker used.
fn g_rows(args: &SweepArgs, run: &RunArgs) -> anyhow::Result<(Vec<Row>, Option<usize>)> {
    let specs = parse_policies(run)?;
    let per_worker = args.per_worker.or(match run.synthetic() {
        Some(SynthKind::PaperAzure) => Some(1250),
        Some(SynthKind::PaperProp) => Some(1000),
        Some(SynthKind::AdpShape) => Some(2000),
        None => None,
    });
    let mut rows = Vec::new();
    for &g in &args.workers_list {
        anyhow::ensure!(
            (1..=1024).contains(&g),
            "--workers-list: G={g} is out of range"
        );
        let run = &args.run_at(run, g);
        let w = run.workload_sized(per_worker.map(|n| n * g as usize))?;
        println!("{}", describe(&w, run, Some(g)));
        let cfg = engine_config(run, g, false);
        for spec in &specs {
            let o = run_one(&w, spec, &spec.label, &cfg)?;
            rows.push((o.report.clone(), o.steady_extra()));
        }
    }
    Ok((rows, per_worker))
}

/// The parameter sweep for one seed: baselines once, each BR policy once per value.
fn param_rows(run: &RunArgs, param: &str) -> anyhow::Result<Vec<Row>> {
    let specs = parse_policies(run)?;
    let (key, values) = parse_sweep_param(param).map_err(anyhow::Error::msg)?;
    let w = run.workload()?;
    println!("{}", describe(&w, run, Some(run.workers)));
    println!("sweeping {key} over {}", values.join(", "));
    let cfg = engine_config(run, run.workers, false);
    let mut rows = Vec::new();
    for spec in specs.iter().filter(|s| !s.is_balance_route()) {
        let o = run_one(&w, spec, &spec.label, &cfg)?;
        rows.push((o.report.clone(), o.steady_extra()));
    }
    for spec in specs.iter().filter(|s| s.is_balance_route()) {
        for v in &values {
            let mut s = spec.clone();
            set_param(&mut s.config, &key, v)
                .map_err(|e| anyhow::anyhow!("{}: {e}", spec.label))?;
            let label = format!("{}[{key}={v}]", spec.label);
            let o = run_one(&w, &s, &label, &cfg)?;
            rows.push((o.report.clone(), o.steady_extra()));
        }
    }
    Ok(rows)
}

/// Gains of every policy over the best baseline (by whole-run throughput) at the same G,
/// plus the imbalance; the best baseline itself is included (gain 0) for reference. `rows` are
/// the seeds' mean ([`average_rows`] of `per_seed`); the gap share is paired within each seed
/// ([`steady_gap_spread`]), so it is taken from `per_seed`.
pub fn scaling_points(rows: &[Row], per_seed: &[Vec<Row>]) -> Vec<ScalingPoint> {
    let runs: Vec<&RunReport> = rows.iter().map(|r| &r.0).collect();
    let mut out = Vec::new();
    for (i, r) in runs.iter().enumerate() {
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
            steady_imbalance: rows[i].1.imbalance,
            steady_gap_pct: if is_baseline(&r.policy) {
                None
            } else {
                steady_gap_spread(per_seed, i)
            },
            baseline: best.policy.clone(),
        });
    }
    out
}
