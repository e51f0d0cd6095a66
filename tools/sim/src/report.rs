//! Run reports: the JSON written by `--json` and the table printed to stdout.
//!
//! JSON shape (other tools parse it; keep the field names):
//! `{"runs":[{"policy", "workers", "avg_imbalance", "avg_barrier_idle", "throughput_tok_s",
//! "steady_throughput_tok_s", "fluid_throughput_tok_s", "tpot_p50_ms", "tpot_p95_ms",
//! "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "avg_balance", "mean_queue_ms", "steps", "requests"}]}`.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Metrics of one simulated run (one policy at one G).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// Policy name as given on the command line (sweeps append `[param=value]`).
    pub policy: String,
    /// G.
    pub workers: usize,
    /// Mean over steps of max_g L_g − min_g L_g (KV tokens; the paper's metric).
    pub avg_imbalance: f64,
    /// Mean over steps of G·max_g L_g − Σ_g L_g (idle KV-token slots at the barrier).
    pub avg_barrier_idle: f64,
    /// Output tokens / simulated time over the whole run.
    pub throughput_tok_s: f64,
    /// Output tokens / time over the steps during which requests were waiting.
    pub steady_throughput_tok_s: f64,
    /// Output tokens / time had every step taken a·mean L + b (perfect balance).
    pub fluid_throughput_tok_s: f64,
    /// Median time per output token (ms).
    pub tpot_p50_ms: f64,
    /// 95th percentile time per output token (ms).
    pub tpot_p95_ms: f64,
    /// Median time to first token (ms): arrival to the end of the step that writes it (with
    /// colocated prefill, the step that runs the prompt's last chunk). Absent from reports
    /// written before it existed, read as 0.
    #[serde(default)]
    pub ttft_p50_ms: f64,
    /// 95th percentile time to first token (ms).
    #[serde(default)]
    pub ttft_p95_ms: f64,
    /// 99th percentile time to first token (ms): the colocated targets are stated on it.
    #[serde(default)]
    pub ttft_p99_ms: f64,
    /// Mean over steps of the balance ratio `Σ_g work_g / (G · max_g work_g)`, a rank's work
    /// its share of the step time `a·L_g + p·P_g + c·n_g` (1 = every rank works the whole
    /// step; decode-only with c = 0 it is the KV balance `mean L / max L`). Absent from reports
    /// written before it existed, read as 0.
    #[serde(default)]
    pub avg_balance: f64,
    /// Mean of admission time − arrival time (ms).
    pub mean_queue_ms: f64,
    /// Decode steps simulated.
    pub steps: u64,
    /// Requests completed.
    pub requests: u64,
}

/// The `--json` document.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// One entry per (policy, G).
    pub runs: Vec<RunReport>,
}

impl Report {
    /// Writes pretty JSON to `path`.
    pub fn write_json(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir)?;
        }
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(path, text + "\n")
    }
}

/// Names of the baseline (non-BalanceRoute) policies, for "best baseline" comparisons.
pub fn is_baseline(policy: &str) -> bool {
    !policy.starts_with("br")
}

/// The line printed under the table: what each column is (tools/sim/README.md, "Columns",
/// says it at length). One line, so the scripts that read the table stop at it.
pub const TABLE_LEGEND: &str = "columns: G: ranks; imbalance, s.imbal: mean max - min KV load over all / steady steps (tokens); \
barrier_idle: mean G*max - sum of loads (token slots idle at the barrier); tok/s, fluid: output tokens/s and its limit with every step balanced; \
gain%: tok/s against the best baseline at this G; gap%: share of that baseline's gap to its own fluid limit the run removes (100 = balanced); \
steady, s.fluid, s.gain%, s.gap%: the same over the steady steps (requests waiting); \
tpot50, tpot95: ms per output token; queue_ms: mean wait before the first step; steps: steps simulated; reqs: requests finished; \
ttft50, ttft95: ms from arrival to the first token; \
balance%, s.bal%: mean over all / steady steps of sum of ranks' work / (G * max), work a*L + p*P + c*n (100 = no rank waits); \
ttft99: 99th percentile of ms to the first token";

/// Renders the table: one row per run. Besides the report's fields it shows, against the best
/// baseline at the same G (by the same measure): the throughput gain (`gain%`) and the share of
/// the baseline's gap to the fluid limit the run captures (`gap%`, see [`gap_captured`]), for
/// the whole run and, when `steady` (one entry per run, same order) is given, for the steady
/// state (`s.gain%`, `s.gap%`) together with the steady-state imbalance (`s.imbal`).
pub fn render_table(runs: &[RunReport], steady: &[SteadyExtra]) -> String {
    let width = runs
        .iter()
        .map(|r| r.policy.chars().count())
        .max()
        .unwrap_or(6)
        .max(6);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<width$} {:>3} {:>10} {:>9} {:>12} {:>8} {:>8} {:>6} {:>5} {:>8} {:>8} {:>7} {:>6} {:>7} {:>7} {:>9} {:>6} {:>6} {:>9} {:>9} {:>8} {:>6} {:>9}",
        "policy",
        "G",
        "imbalance",
        "s.imbal",
        "barrier_idle",
        "tok/s",
        "fluid",
        "gain%",
        "gap%",
        "steady",
        "s.fluid",
        "s.gain%",
        "s.gap%",
        "tpot50",
        "tpot95",
        "queue_ms",
        "steps",
        "reqs",
        "ttft50",
        "ttft95",
        "balance%",
        "s.bal%",
        "ttft99",
    );
    let fluid_of = |i: usize| steady.get(i).map(|x| x.fluid_tok_s);
    for (i, r) in runs.iter().enumerate() {
        let same_g = || {
            runs.iter()
                .enumerate()
                .filter(|(_, b)| b.workers == r.workers && is_baseline(&b.policy))
        };
        let best = same_g().max_by(|x, y| x.1.throughput_tok_s.total_cmp(&y.1.throughput_tok_s));
        let best_steady = same_g().max_by(|x, y| {
            x.1.steady_throughput_tok_s
                .total_cmp(&y.1.steady_throughput_tok_s)
        });
        let pct = |x: f64, base: f64| {
            if base > 0.0 {
                format!("{:+.1}", 100.0 * (x / base - 1.0))
            } else {
                "-".into()
            }
        };
        // Share of the baseline's shortfall from its own fluid limit that the run removes,
        // measured as efficiency (throughput / the same run's fluid throughput), so runs whose
        // schedules differ (a pool reorders requests) are compared fairly.
        let share = |x: f64, xf: f64, base: f64, bf: f64| {
            gap_share(x, xf, base, bf).map_or("-".into(), |g| format!("{:.0}", 100.0 * g))
        };
        let (gain, gap) = best.map_or(("-".into(), "-".into()), |(_, b)| {
            (
                pct(r.throughput_tok_s, b.throughput_tok_s),
                share(
                    r.throughput_tok_s,
                    r.fluid_throughput_tok_s,
                    b.throughput_tok_s,
                    b.fluid_throughput_tok_s,
                ),
            )
        });
        let (sgain, sgap) = best_steady.map_or(("-".into(), "-".into()), |(j, b)| {
            let gap = match (fluid_of(i), fluid_of(j)) {
                (Some(xf), Some(bf)) => {
                    share(r.steady_throughput_tok_s, xf, b.steady_throughput_tok_s, bf)
                }
                _ => "-".into(),
            };
            (
                pct(r.steady_throughput_tok_s, b.steady_throughput_tok_s),
                gap,
            )
        });
        let _ = writeln!(
            s,
            "{:<width$} {:>3} {:>10.0} {:>9} {:>12.0} {:>8.1} {:>8.1} {:>6} {:>5} {:>8.1} {:>8} {:>7} {:>6} {:>7.2} {:>7.2} {:>9.1} {:>6} {:>6} {:>9.1} {:>9.1} {:>8.1} {:>6} {:>9.1}",
            r.policy,
            r.workers,
            r.avg_imbalance,
            steady
                .get(i)
                .map_or("-".into(), |x| format!("{:.0}", x.imbalance)),
            r.avg_barrier_idle,
            r.throughput_tok_s,
            r.fluid_throughput_tok_s,
            gain,
            gap,
            r.steady_throughput_tok_s,
            fluid_of(i).map_or("-".into(), |f| format!("{f:.1}")),
            sgain,
            sgap,
            r.tpot_p50_ms,
            r.tpot_p95_ms,
            r.mean_queue_ms,
            r.steps,
            r.requests,
            r.ttft_p50_ms,
            r.ttft_p95_ms,
            100.0 * r.avg_balance,
            steady
                .get(i)
                .map_or("-".into(), |x| format!("{:.1}", 100.0 * x.balance)),
            r.ttft_p99_ms,
        );
    }
    s
}

/// Share of the gap between a baseline and the fluid limit that `run` captures. Each run is
/// measured by its efficiency `e = throughput / fluid throughput` (the same run's perfectly
/// balanced step times), and the share is `(e_run − e_base) / (1 − e_base)`: 0 is no better
/// than the baseline, 1 is a perfectly balanced barrier. `None` when the baseline has no gap.
pub fn gap_captured(run: &RunReport, base: &RunReport) -> Option<f64> {
    gap_share(
        run.throughput_tok_s,
        run.fluid_throughput_tok_s,
        base.throughput_tok_s,
        base.fluid_throughput_tok_s,
    )
}

/// [`gap_captured`] from the four figures (a run's throughput and its fluid limit, the
/// baseline's and its fluid limit): the one definition the table and the seed spread share.
pub fn gap_share(run: f64, run_fluid: f64, base: f64, base_fluid: f64) -> Option<f64> {
    if run_fluid <= 0.0 || base_fluid <= 0.0 {
        return None;
    }
    let (er, eb) = (run / run_fluid, base / base_fluid);
    (1.0 - eb > 1e-9).then(|| (er - eb) / (1.0 - eb))
}

/// Steady-state figures that are not in the JSON report (shown in the table).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SteadyExtra {
    /// Fluid-limit throughput over the steady-state steps.
    pub fluid_tok_s: f64,
    /// Mean max − min load over the steady-state steps.
    pub imbalance: f64,
    /// Mean balance ratio over the steady-state steps (see [`RunReport::avg_balance`]).
    pub balance: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(policy: &str, tput: f64, fluid: f64) -> RunReport {
        RunReport {
            policy: policy.into(),
            workers: 8,
            avg_imbalance: 1.0,
            avg_barrier_idle: 2.0,
            throughput_tok_s: tput,
            steady_throughput_tok_s: tput,
            fluid_throughput_tok_s: fluid,
            tpot_p50_ms: 80.0,
            tpot_p95_ms: 90.0,
            ttft_p50_ms: 100.0,
            ttft_p95_ms: 200.0,
            ttft_p99_ms: 300.0,
            avg_balance: 0.9,
            mean_queue_ms: 5.0,
            steps: 10,
            requests: 3,
        }
    }

    #[test]
    fn json_has_exactly_the_documented_fields() {
        let rep = Report {
            runs: vec![run("jsq", 800.0, 1000.0)],
        };
        let v: serde_json::Value = serde_json::to_value(&rep).expect("json");
        let obj = v["runs"][0].as_object().expect("object");
        let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        keys.sort_unstable();
        let mut want = vec![
            "policy",
            "workers",
            "avg_imbalance",
            "avg_barrier_idle",
            "throughput_tok_s",
            "steady_throughput_tok_s",
            "fluid_throughput_tok_s",
            "tpot_p50_ms",
            "tpot_p95_ms",
            "ttft_p50_ms",
            "ttft_p95_ms",
            "ttft_p99_ms",
            "avg_balance",
            "mean_queue_ms",
            "steps",
            "requests",
        ];
        want.sort_unstable();
        assert_eq!(keys, want);
        assert_eq!(v.as_object().map(|o| o.len()), Some(1));
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("sub/out.json");
        rep.write_json(&p).expect("write");
        let back: Report =
            serde_json::from_str(&std::fs::read_to_string(&p).expect("read")).expect("parse");
        assert_eq!(back, rep);
    }

    #[test]
    fn table_shows_gain_and_gap() {
        let runs = vec![run("jsq", 800.0, 1000.0), run("br0", 950.0, 1000.0)];
        let extra = SteadyExtra {
            fluid_tok_s: 1000.0,
            imbalance: 1.0,
            balance: 0.95,
        };
        let t = render_table(&runs, &[extra, extra]);
        assert!(t.contains("+18.8"), "{t}");
        assert!(t.contains(" 75"), "{t}");
        assert!(
            t.contains(" 90.0 ") && t.contains(" 95.0"),
            "balance% and s.bal%: {t}"
        );
        assert!(render_table(&runs, &[]).lines().count() == 3);
        // the legend names every column of the header
        let header = t.lines().next().expect("a header");
        for col in header.split_whitespace().skip(1) {
            assert!(
                TABLE_LEGEND.contains(&format!(" {col}:"))
                    || TABLE_LEGEND.contains(&format!(" {col},")),
                "{col} has no legend: {TABLE_LEGEND}"
            );
        }
        assert_eq!(TABLE_LEGEND.lines().count(), 1);
        let g = gap_captured(&runs[1], &runs[0]).expect("gap");
        assert!((g - 0.75).abs() < 1e-12, "{g}");
    }
}
