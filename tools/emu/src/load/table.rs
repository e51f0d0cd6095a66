//! The side-by-side table of `br-emu load` runs, with br-sim's prediction for each policy
//! beside them ([`TwinBand`]: one twin run, or the mean and spread of several).
//!
//! Separate from running the load: it only formats [`super::Summary`]s, and is what the
//! live-against-twin comparison reads.

use super::*;

/// Mean and standard deviation of one figure over a policy's twin runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Moments {
    pub mean: f64,
    pub sd: f64,
}

impl Moments {
    fn of(v: impl Iterator<Item = f64> + Clone) -> Moments {
        let n = v.clone().count() as f64;
        let mean = v.clone().sum::<f64>() / n;
        let sd = if n > 1.0 {
            (v.map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
        } else {
            0.0
        };
        Moments { mean, sd }
    }

    /// The standard deviation as a share of the mean (0 for a zero mean).
    pub fn relative_sd(self) -> f64 {
        if self.mean.abs() > 0.0 {
            self.sd / self.mean.abs()
        } else {
            0.0
        }
    }
}

/// What the twin predicts for one policy: one br-sim run, or the mean and spread of several
/// (e.g. `--arrival-jitter-ms` over seeds, which is how `scripts/demo.sh` runs it: the order of
/// near-simultaneous arrivals is not known to the client that timed them, and JSQ's imbalance
/// moves by ±15% with it, so one live run is compared with the twin's spread, not one replay).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TwinBand {
    pub n: usize,
    pub imbalance: Moments,
    /// br-sim's `avg_balance` (a share, printed as `balance%`); 0 in reports written before
    /// br-sim computed it.
    pub balance: Moments,
    pub tpot_p50: Moments,
    pub tpot_p95: Moments,
    pub throughput: Moments,
}

impl TwinBand {
    pub fn of(runs: &[&br_sim::report::RunReport]) -> Option<TwinBand> {
        if runs.is_empty() {
            return None;
        }
        let m = |f: fn(&br_sim::report::RunReport) -> f64| Moments::of(runs.iter().map(|r| f(r)));
        Some(TwinBand {
            n: runs.len(),
            imbalance: m(|r| r.avg_imbalance),
            balance: m(|r| r.avg_balance),
            tpot_p50: m(|r| r.tpot_p50_ms),
            tpot_p95: m(|r| r.tpot_p95_ms),
            throughput: m(|r| r.throughput_tok_s),
        })
    }
}

/// A figure the engine did not report (a real engine has no σ-side imbalance or step time of
/// its own in the load tool's view) prints as "-", never as NaN.
fn or_dash(v: Option<f64>, width: usize, decimals: usize) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:>width$.decimals$}"),
        _ => format!("{:>width$}", "-"),
    }
}

/// A side-by-side table of runs (and br-sim's prediction for each policy, if given). "live" is
/// what the load measured against the running deployment (emulated or real engine), "br-sim"
/// the twin on the same arrivals.
pub fn table(runs: &[Summary], sim: Option<&br_sim::report::Report>) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    // the policy column fits the longest label (a spec with settings, e.g.
    // brh-hinted:stagger_weight=1), so the figures stay in their columns
    let w = runs
        .iter()
        .map(|s| s.label.len())
        .max()
        .unwrap_or(0)
        .max(10);
    let _ = writeln!(
        out,
        "{:<w$} {:>9} {:>14} {:>9} {:>12} {:>12} {:>12} {:>11} {:>9}",
        "policy",
        "source",
        "imbalance",
        "balance%",
        "TPOT p50 ms",
        "TPOT p95 ms",
        "tok/s",
        "step ms",
        "failed"
    );
    let pct = |x: Option<f64>| x.map(|b| 100.0 * b);
    for s in runs {
        let _ = writeln!(
            out,
            "{:<w$} {:>9} {} {} {:>12.1} {:>12.1} {:>12.0} {} {:>9}",
            s.label,
            "live",
            or_dash(s.imbalance_tokens, 14, 0),
            or_dash(pct(s.balance_ratio), 9, 1),
            s.tpot_ms.p50,
            s.tpot_ms.p95,
            s.throughput_tok_s,
            or_dash(s.mean_step_ms, 11, 1),
            s.failed,
        );
        let twins: Vec<&br_sim::report::RunReport> = sim
            .map(|rep| rep.runs.iter().filter(|r| r.policy == s.label).collect())
            .unwrap_or_default();
        if let Some(t) = TwinBand::of(&twins) {
            // a twin report written before br-sim computed the ratio reads it as 0
            let twin_balance = Some(t.balance.mean).filter(|b| *b > 0.0);
            let _ = writeln!(
                out,
                "{:<w$} {:>9} {:>14.0} {} {:>12.1} {:>12.1} {:>12.0} {:>11} {:>9}",
                "",
                "br-sim",
                t.imbalance.mean,
                or_dash(pct(twin_balance), 9, 1),
                t.tpot_p50.mean,
                t.tpot_p95.mean,
                t.throughput.mean,
                "",
                if t.n > 1 {
                    format!("n={}", t.n)
                } else {
                    String::new()
                },
            );
            if t.n > 1 {
                let sd = |m: Moments| format!("±{:.1}%", m.relative_sd() * 100.0);
                let _ = writeln!(
                    out,
                    "{:<w$} {:>9} {:>14} {:>9} {:>12} {:>12} {:>12}",
                    "",
                    "sim sd",
                    sd(t.imbalance),
                    twin_balance.map_or("-".into(), |_| sd(t.balance)),
                    sd(t.tpot_p50),
                    sd(t.tpot_p95),
                    sd(t.throughput),
                );
            }
            let rel = |a: f64, b: f64| {
                if b.abs() > 0.0 && a.is_finite() {
                    format!("{:+.0}%", (a / b - 1.0) * 100.0)
                } else {
                    "-".into()
                }
            };
            let _ = writeln!(
                out,
                "{:<w$} {:>9} {:>14} {:>9} {:>12} {:>12} {:>12}",
                "",
                "live/sim",
                rel(s.imbalance_tokens.unwrap_or(f64::NAN), t.imbalance.mean),
                rel(
                    s.balance_ratio.unwrap_or(f64::NAN),
                    twin_balance.unwrap_or(f64::NAN)
                ),
                rel(s.tpot_ms.p50, t.tpot_p50.mean),
                rel(s.tpot_ms.p95, t.tpot_p95.mean),
                rel(s.throughput_tok_s, t.throughput.mean),
            );
        }
    }
    if runs.len() == 2 {
        let (a, b) = (&runs[0], &runs[1]);
        let gain = |x: f64, y: f64| (y / x - 1.0) * 100.0;
        let imbalance = match (a.imbalance_tokens, b.imbalance_tokens) {
            (Some(x), Some(y)) if x > 0.0 => format!("{:+.0}%", gain(x, y)),
            _ => "-".into(),
        };
        let _ = writeln!(
            out,
            "\n{} vs {}: imbalance {}, TPOT p95 {:+.1}%, throughput {:+.1}%",
            b.label,
            a.label,
            imbalance,
            gain(a.tpot_ms.p95, b.tpot_ms.p95),
            gain(a.throughput_tok_s, b.throughput_tok_s),
        );
    }
    out
}
