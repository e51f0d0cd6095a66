//! `br-sim calibrate`: fit the step-time model `T = a·M + c·N + b` (with colocated prefill
//! `+ p·P`) from engine samples.
//!
//! Input: a CSV of samples, one step each: `M` the largest per-rank KV load of the step, `T` the
//! measured step time in ms and, when the samples carry it, `N` the most running requests on
//! one rank. Two formats (`#` starts a comment line; a first row whose first field is not a
//! number is a header):
//! * `max_kv_tokens,step_ms` (the paper's model, c = 0): positional, header optional, extra
//!   columns ignored (every file the two-term calibrate read, it still reads the same way);
//! * a header that names `max_running` (with `max_kv_tokens` and `step_ms`, any order, extra
//!   columns ignored): the three-term fit;
//! * a header that names `max_prefill_tokens` (P: the most prompt tokens one rank prefilled in
//!   the step; with or without `max_running`): the fit with the prefill term, `p` in ms per
//!   prompt token for `--colocated --step-p`, judged like `c` (its t statistic, and the fit of
//!   the same samples without it).
//!
//! `a` comes out in ms per KV token, `c` in ms per request and `b` in ms, ready for
//! `--step-a`, `--step-c` and `--step-b`; `c/a` is the F-score's `request_cost_tokens`.
//!
//! The fit is ordinary least squares with the classical standard errors (residual variance
//! over n − p degrees of freedom). Whether the data asks for the request term is `c`'s t
//! statistic (`c / se(c)`, significant at |t| ≥ 2, about 95% two-sided for more than a few
//! dozen samples) beside how much it lowers the residuals against the two-term fit of the same
//! samples. Samples that cannot tell `c` from `a` and `b` (N constant, or N moving in lockstep
//! with M) are a typed error ([`CalibrateError::Unidentifiable`]), not a fit with a
//! meaningless `c`. Rows that cannot be used (wrong field count, not a number, negative or
//! non-finite values) are rejected with their 1-based line number and the reason; the fit uses
//! the remaining rows. `--strict` turns any rejected row into an error.

use std::path::{Path, PathBuf};

use serde::Serialize;

mod fit;
mod parse;

pub use fit::{Ols, Plane, fit_line, fit_ols, fit_plane};
use fit::{line_standard_errors, residual_spread};
pub use parse::{Parsed, parse, parse_samples};

/// |t| at or above this calls `c` significant (≈ 95% two-sided for large samples).
pub const SIGNIFICANT_T: f64 = 2.0;

/// Correlation² of M and N at or above which `c` cannot be told from `a`.
const COLLINEAR_R2: f64 = 1.0 - 1e-6;

/// A rejected input row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rejected {
    /// 1-based line number.
    pub line: u64,
    /// Why.
    pub reason: String,
}

/// One usable sample.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Sample {
    /// M: the largest per-rank KV load of the step.
    pub max_kv_tokens: f64,
    /// N: the most running requests on one rank (`None` in the two-column format).
    pub max_running: Option<f64>,
    /// P: the most prompt tokens one rank prefilled in the step (colocated prefill; `None`
    /// when the samples carry no such column).
    pub max_prefill: Option<f64>,
    /// T, ms.
    pub step_ms: f64,
}

/// Which model was fitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FitModel {
    /// `T = a·M + b` (the samples carry no N).
    TwoTerm,
    /// `T = a·M + c·N + b`.
    WithRequests,
    /// `T = a·M + p·P + b`, or with N `T = a·M + p·P + c·N + b`.
    WithPrefill,
}

/// The result of a fit.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fit {
    /// Which model.
    pub model: FitModel,
    /// Slope in M, ms per KV token.
    pub a: f64,
    /// Slope in N, ms per running request (0 for the two-term model).
    pub c: f64,
    /// Intercept, ms.
    pub b: f64,
    /// Standard errors of a, c and b (`None` when the residuals have no degrees of freedom;
    /// `se_c` also for the two-term model).
    pub se_a: Option<f64>,
    pub se_c: Option<f64>,
    pub se_b: Option<f64>,
    /// `c / se(c)`.
    pub t_c: Option<f64>,
    /// Whether |t_c| ≥ [`SIGNIFICANT_T`]: the data asks for the request term.
    pub c_significant: Option<bool>,
    /// Coefficient of determination of the fit.
    pub r2: f64,
    /// Samples used.
    pub samples: usize,
    /// Root-mean-square residual, ms.
    pub rmse_ms: f64,
    /// 95th percentile and largest absolute residual, ms.
    pub p95_abs_residual_ms: f64,
    pub max_abs_residual_ms: f64,
    /// The two-term fit of the same samples (with N): its RMS residual, ms.
    pub two_term_rmse_ms: Option<f64>,
    /// `c / a`: the F-score's `request_cost_tokens` (with N and a > 0).
    pub request_cost_tokens: Option<f64>,
    /// Slope in P, ms per prompt token prefilled (0 without the prefill column), its standard
    /// error, `p / se(p)`, and whether that is significant.
    pub p: f64,
    pub se_p: Option<f64>,
    pub t_p: Option<f64>,
    pub p_significant: Option<bool>,
    /// The fit of the same samples without P: its RMS residual, ms.
    pub without_prefill_rmse_ms: Option<f64>,
    /// Rows rejected (line numbers and reasons).
    pub rejected: Vec<Rejected>,
}

/// Errors of `calibrate`.
#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    /// Reading the file failed.
    #[error("{path}: {error}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause.
        // Not `source`: the message already says it, and `{:#}` would print it twice.
        error: std::io::Error,
    },
    /// Not enough usable samples, or all at the same load.
    #[error("{path}: cannot fit: {reason}")]
    Degenerate {
        /// File.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The samples carry N but cannot separate its effect from M's and the level's.
    #[error("{path}: cannot fit c (ms per running request): {reason}")]
    Unidentifiable {
        /// File.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A header names `max_running` but not the other two columns.
    #[error("{path}:{line}: {reason}")]
    BadHeader {
        /// File.
        path: PathBuf,
        /// 1-based line.
        line: u64,
        /// Why.
        reason: String,
    },
    /// `--strict` and some rows were rejected.
    #[error("{path}:{line}: {reason}")]
    BadRow {
        /// File.
        path: PathBuf,
        /// 1-based line.
        line: u64,
        /// Why.
        reason: String,
    },
}

/// Reads a CSV file and fits it.
pub fn calibrate_file(path: &Path, strict: bool) -> Result<Fit, CalibrateError> {
    let text = std::fs::read_to_string(path).map_err(|error| CalibrateError::Io {
        path: path.to_path_buf(),
        error,
    })?;
    calibrate_text(path, &text, strict)
}

/// Fits CSV text (`path` is only used in messages).
pub fn calibrate_text(path: &Path, text: &str, strict: bool) -> Result<Fit, CalibrateError> {
    let parsed = parse(path, text)?;
    if strict && let Some(r) = parsed.rejected.first() {
        return Err(CalibrateError::BadRow {
            path: path.to_path_buf(),
            line: r.line,
            reason: r.reason.clone(),
        });
    }
    let xy: Vec<(f64, f64)> = parsed
        .samples
        .iter()
        .map(|s| (s.max_kv_tokens, s.step_ms))
        .collect();
    let line = fit_line(&xy);
    let Some((a2, b2, r2_2, rmse_2)) = line else {
        return Err(CalibrateError::Degenerate {
            path: path.to_path_buf(),
            reason: format!(
                "{} usable samples ({} rejected); need at least two with different max_kv_tokens",
                xy.len(),
                parsed.rejected.len()
            ),
        });
    };
    if parsed.with_prefill {
        return fit_with_prefill(path, parsed, rmse_2);
    }
    if !parsed.with_requests {
        let (se_a, se_b) = line_standard_errors(&xy, a2, b2);
        let (p95, max) = residual_spread(xy.iter().map(|&(x, y)| y - (a2 * x + b2)));
        return Ok(Fit {
            model: FitModel::TwoTerm,
            a: a2,
            c: 0.0,
            b: b2,
            se_a,
            se_c: None,
            se_b,
            t_c: None,
            c_significant: None,
            r2: r2_2,
            samples: xy.len(),
            rmse_ms: rmse_2,
            p95_abs_residual_ms: p95,
            max_abs_residual_ms: max,
            two_term_rmse_ms: None,
            request_cost_tokens: None,
            p: 0.0,
            se_p: None,
            t_p: None,
            p_significant: None,
            without_prefill_rmse_ms: None,
            rejected: parsed.rejected,
        });
    }
    let xzy: Vec<(f64, f64, f64)> = parsed
        .samples
        .iter()
        .map(|s| (s.max_kv_tokens, s.max_running.unwrap_or(0.0), s.step_ms))
        .collect();
    let p = fit_plane(&xzy).map_err(|reason| CalibrateError::Unidentifiable {
        path: path.to_path_buf(),
        reason,
    })?;
    let t_c = p.se_c.filter(|se| *se > 0.0).map(|se| p.c / se);
    let (p95, max) = residual_spread(xzy.iter().map(|&(x, z, y)| y - (p.a * x + p.c * z + p.b)));
    Ok(Fit {
        model: FitModel::WithRequests,
        a: p.a,
        c: p.c,
        b: p.b,
        se_a: p.se_a,
        se_c: p.se_c,
        se_b: p.se_b,
        t_c,
        c_significant: t_c.map(|t| t.abs() >= SIGNIFICANT_T),
        r2: p.r2,
        samples: xzy.len(),
        rmse_ms: p.rmse,
        p95_abs_residual_ms: p95,
        max_abs_residual_ms: max,
        two_term_rmse_ms: Some(rmse_2),
        request_cost_tokens: (p.a > 0.0 && p.c >= 0.0).then(|| p.c / p.a),
        p: 0.0,
        se_p: None,
        t_p: None,
        p_significant: None,
        without_prefill_rmse_ms: None,
        rejected: parsed.rejected,
    })
}

/// The fit with the prefill column: `T = a·M + p·P (+ c·N) + b`, and beside it the fit of the
/// same samples without P (two-term, or three-term with N).
fn fit_with_prefill(
    path: &Path,
    parsed: Parsed,
    two_term_rmse: f64,
) -> Result<Fit, CalibrateError> {
    let unidentifiable = |reason| CalibrateError::Unidentifiable {
        path: path.to_path_buf(),
        reason,
    };
    let with_n = parsed.with_requests;
    let row = |s: &Sample, prefill: bool| {
        let mut r = vec![s.max_kv_tokens];
        if prefill {
            r.push(s.max_prefill.unwrap_or(0.0));
        }
        if with_n {
            r.push(s.max_running.unwrap_or(0.0));
        }
        r.push(s.step_ms);
        r
    };
    let mut names = vec!["max_kv_tokens", "max_prefill_tokens"];
    if with_n {
        names.push("max_running");
    }
    let rows: Vec<Vec<f64>> = parsed.samples.iter().map(|s| row(s, true)).collect();
    let f = fit_ols(&rows, &names).map_err(unidentifiable)?;
    let without = if with_n {
        let rows: Vec<Vec<f64>> = parsed.samples.iter().map(|s| row(s, false)).collect();
        fit_ols(&rows, &["max_kv_tokens", "max_running"])
            .map(|o| o.rmse)
            .ok()
    } else {
        Some(two_term_rmse)
    };
    let se = |j: usize| f.se.as_ref().map(|se| se[j]);
    let (a, p) = (f.coef[0], f.coef[1]);
    let c = if with_n { f.coef[2] } else { 0.0 };
    let t = |coef: f64, se: Option<f64>| se.filter(|se| *se > 0.0).map(|se| coef / se);
    let (t_p, t_c) = (t(p, se(1)), if with_n { t(c, se(2)) } else { None });
    let (p95, max) =
        residual_spread(rows.iter().map(|r| {
            r[r.len() - 1] - f.b - (0..names.len()).map(|j| f.coef[j] * r[j]).sum::<f64>()
        }));
    Ok(Fit {
        model: FitModel::WithPrefill,
        a,
        c,
        b: f.b,
        se_a: se(0),
        se_c: if with_n { se(2) } else { None },
        se_b: f.se_b,
        t_c,
        c_significant: t_c.map(|t| t.abs() >= SIGNIFICANT_T),
        r2: f.r2,
        samples: rows.len(),
        rmse_ms: f.rmse,
        p95_abs_residual_ms: p95,
        max_abs_residual_ms: max,
        two_term_rmse_ms: Some(two_term_rmse),
        request_cost_tokens: (with_n && a > 0.0 && c >= 0.0).then(|| c / a),
        p,
        se_p: se(1),
        t_p,
        p_significant: t_p.map(|t| t.abs() >= SIGNIFICANT_T),
        without_prefill_rmse_ms: without,
        rejected: parsed.rejected,
    })
}

/// ` ± se` in scientific notation (the slopes), or with 3 decimals (`plain`, the level in ms).
fn pm(se: Option<f64>, plain: bool) -> String {
    se.map_or_else(String::new, |s| {
        if plain {
            format!(" ± {s:.3}")
        } else {
            format!(" ± {s:.2e}")
        }
    })
}

impl Fit {
    /// Human-readable report (the rejected rows are listed too).
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        for r in &self.rejected {
            let _ = writeln!(s, "rejected line {}: {}", r.line, r.reason);
        }
        let with_n = self.se_c.is_some() || self.model == FitModel::WithRequests;
        let model = match (self.model, with_n) {
            (FitModel::TwoTerm, _) => "T = a·max_kv_tokens + b",
            (FitModel::WithRequests, _) => "T = a·max_kv_tokens + c·max_running + b",
            (FitModel::WithPrefill, false) => "T = a·max_kv_tokens + p·max_prefill_tokens + b",
            (FitModel::WithPrefill, true) => {
                "T = a·max_kv_tokens + p·max_prefill_tokens + c·max_running + b"
            }
        };
        let _ = writeln!(
            s,
            "model {model}\nsamples {}  rejected {}\na = {:.6e}{} ms per KV token",
            self.samples,
            self.rejected.len(),
            self.a,
            pm(self.se_a, false)
        );
        if self.model == FitModel::WithPrefill {
            let _ = writeln!(
                s,
                "p = {:.6e}{} ms per prompt token prefilled",
                self.p,
                pm(self.se_p, false)
            );
        }
        if with_n {
            let _ = writeln!(
                s,
                "c = {:.6e}{} ms per running request",
                self.c,
                pm(self.se_c, false)
            );
        }
        let _ = writeln!(
            s,
            "b = {:.4}{} ms\nR² = {:.4}\nrmse = {:.3} ms  (|residual| p95 {:.3} ms, max {:.3} ms)",
            self.b,
            pm(self.se_b, true),
            self.r2,
            self.rmse_ms,
            self.p95_abs_residual_ms,
            self.max_abs_residual_ms
        );
        let verdict = |significant: Option<bool>, term: &str, without: &str| match significant {
            Some(true) => format!("significant: the data asks for the {term}"),
            Some(false) => format!("not significant: {without} explains these samples"),
            None => "no residual degrees of freedom to judge it".to_string(),
        };
        let t = |t: Option<f64>| t.map_or("n/a".to_string(), |t| format!("{t:.2}"));
        if self.model == FitModel::WithPrefill {
            let _ = writeln!(
                s,
                "p: t = {} (|t| ≥ {SIGNIFICANT_T} is significant), {}",
                t(self.t_p),
                verdict(
                    self.p_significant,
                    "prefill term",
                    "the model without it (p = 0)"
                )
            );
            if let Some(r) = self.without_prefill_rmse_ms {
                let _ = writeln!(s, "fit of the same samples without p: rmse {r:.3} ms");
            }
        }
        if with_n {
            let _ = writeln!(
                s,
                "c: t = {} (|t| ≥ {SIGNIFICANT_T} is significant), {}",
                t(self.t_c),
                verdict(
                    self.c_significant,
                    "request term",
                    "the two-term model (c = 0)"
                )
            );
            if self.model == FitModel::WithRequests
                && let Some(r) = self.two_term_rmse_ms
            {
                let _ = writeln!(
                    s,
                    "two-term fit of the same samples (c = 0): rmse {r:.3} ms"
                );
            }
        }
        if self.a < 0.0 || self.b < 0.0 || self.c < 0.0 || self.p < 0.0 {
            let _ = writeln!(
                s,
                "warning: a negative coefficient: the samples do not follow {model} well"
            );
        }
        let mut flags = format!("use: --step-a {:e}", self.a);
        if with_n {
            let _ = write!(flags, " --step-c {:e}", self.c);
        }
        if self.model == FitModel::WithPrefill {
            let _ = write!(flags, " --colocated --step-p {:e}", self.p);
        }
        let _ = writeln!(s, "{flags} --step-b {}", self.b);
        if with_n && let Some(k) = self.request_cost_tokens {
            let _ = writeln!(
                s,
                "F-score request term (c/a): request_cost_tokens = {k:.1} (br-sim \
                 br0:request_cost_tokens={k:.0}, br-decision --request-cost-tokens {k:.0})"
            );
        }
        s
    }
}

#[cfg(test)]
mod tests;
