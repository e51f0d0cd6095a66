//! `br-sim calibrate`: fit the step-time model `T = a·x + b` from engine samples.
//!
//! Input: a CSV of `max_kv_tokens,step_ms` samples (an optional header row is recognised when
//! its first field is not a number; extra columns are ignored; `#` starts a comment line).
//! `x` is the largest per-rank KV load of the step and `T` the measured step time in ms, so `a`
//! comes out in ms per KV token and `b` in ms, ready for `--step-a` and `--step-b`.
//!
//! The fit is ordinary least squares. Rows that cannot be used (wrong field count, not a
//! number, negative or non-finite values) are rejected with their 1-based line number and the
//! reason; the fit uses the remaining rows. `--strict` turns any rejected row into an error.

use std::path::{Path, PathBuf};

use serde::Serialize;

/// A rejected input row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rejected {
    /// 1-based line number.
    pub line: u64,
    /// Why.
    pub reason: String,
}

/// The result of a fit.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fit {
    /// Slope, ms per KV token.
    pub a: f64,
    /// Intercept, ms.
    pub b: f64,
    /// Coefficient of determination of the fit.
    pub r2: f64,
    /// Samples used.
    pub samples: usize,
    /// Root-mean-square residual, ms.
    pub rmse_ms: f64,
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

/// Parses samples from CSV text; returns the usable (x, y) pairs and the rejected rows.
pub fn parse_samples(text: &str) -> (Vec<(f64, f64)>, Vec<Rejected>) {
    let mut samples = Vec::new();
    let mut rejected = Vec::new();
    let mut seen_data = false;
    for (idx, raw) in text.lines().enumerate() {
        let line = idx as u64 + 1;
        let row = raw.trim().trim_start_matches('\u{feff}');
        if row.is_empty() || row.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = row.split(',').map(str::trim).collect();
        if fields.len() < 2 {
            rejected.push(Rejected {
                line,
                reason: format!("expected `max_kv_tokens,step_ms`, got `{row}`"),
            });
            continue;
        }
        let x = fields[0].parse::<f64>();
        let y = fields[1].parse::<f64>();
        // A first row whose first field is not a number is a header.
        if !seen_data && x.is_err() && fields[0].chars().any(|c| c.is_ascii_alphabetic()) {
            seen_data = true;
            continue;
        }
        seen_data = true;
        match (x, y) {
            (Ok(x), Ok(y)) if x.is_finite() && y.is_finite() && x >= 0.0 && y > 0.0 => {
                samples.push((x, y));
            }
            (Ok(x), Ok(y)) => rejected.push(Rejected {
                line,
                reason: format!(
                    "max_kv_tokens must be finite and >= 0 and step_ms finite and > 0, got {x}, {y}"
                ),
            }),
            (Err(_), _) => rejected.push(Rejected {
                line,
                reason: format!("max_kv_tokens `{}` is not a number", fields[0]),
            }),
            (_, Err(_)) => rejected.push(Rejected {
                line,
                reason: format!("step_ms `{}` is not a number", fields[1]),
            }),
        }
    }
    (samples, rejected)
}

/// Least-squares fit of `y = a·x + b`. `None` with fewer than two samples or no spread in x.
pub fn fit_line(samples: &[(f64, f64)]) -> Option<(f64, f64, f64, f64)> {
    if samples.len() < 2 {
        return None;
    }
    let n = samples.len() as f64;
    let mx = samples.iter().map(|s| s.0).sum::<f64>() / n;
    let my = samples.iter().map(|s| s.1).sum::<f64>() / n;
    let sxx = samples.iter().map(|s| (s.0 - mx).powi(2)).sum::<f64>();
    let sxy = samples.iter().map(|s| (s.0 - mx) * (s.1 - my)).sum::<f64>();
    let syy = samples.iter().map(|s| (s.1 - my).powi(2)).sum::<f64>();
    if sxx <= f64::EPSILON * mx.abs().max(1.0) * n {
        return None;
    }
    let a = sxy / sxx;
    let b = my - a * mx;
    let sse = samples
        .iter()
        .map(|s| (s.1 - (a * s.0 + b)).powi(2))
        .sum::<f64>();
    let r2 = if syy > 0.0 { 1.0 - sse / syy } else { 1.0 };
    Some((a, b, r2, (sse / n).sqrt()))
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
    let (samples, rejected) = parse_samples(text);
    if strict && let Some(r) = rejected.first() {
        return Err(CalibrateError::BadRow {
            path: path.to_path_buf(),
            line: r.line,
            reason: r.reason.clone(),
        });
    }
    let Some((a, b, r2, rmse_ms)) = fit_line(&samples) else {
        return Err(CalibrateError::Degenerate {
            path: path.to_path_buf(),
            reason: format!(
                "{} usable samples ({} rejected); need at least two with different max_kv_tokens",
                samples.len(),
                rejected.len()
            ),
        });
    };
    Ok(Fit {
        a,
        b,
        r2,
        samples: samples.len(),
        rmse_ms,
        rejected,
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
        let _ = writeln!(
            s,
            "samples {}  rejected {}\na = {:.6e} ms per KV token\nb = {:.4} ms\nR² = {:.4}\nrmse = {:.3} ms",
            self.samples,
            self.rejected.len(),
            self.a,
            self.b,
            self.r2,
            self.rmse_ms
        );
        if self.a < 0.0 || self.b < 0.0 {
            let _ = writeln!(
                s,
                "warning: a negative coefficient: the samples do not follow T = a·x + b well"
            );
        }
        let _ = writeln!(s, "use: --step-a {:e} --step-b {}", self.a, self.b);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_line_is_recovered() {
        let text: String = std::iter::once("max_kv_tokens,step_ms\n".to_string())
            .chain((0..50).map(|i| {
                let x = 10_000.0 * f64::from(i);
                format!("{x},{}\n", 2e-4 * x + 30.0)
            }))
            .collect();
        let f = calibrate_text(Path::new("s.csv"), &text, true).expect("fit");
        assert!((f.a - 2e-4).abs() < 1e-12, "{f:?}");
        assert!((f.b - 30.0).abs() < 1e-9, "{f:?}");
        assert!((f.r2 - 1.0).abs() < 1e-12);
        assert_eq!(f.samples, 50);
        assert!(f.rejected.is_empty());
        assert!(f.render().contains("--step-a"));
    }

    #[test]
    fn noisy_fit_is_close_and_r2_below_one() {
        // deterministic pseudo-noise in [-2, 2) ms
        let mut state = 12345u64;
        let mut noise = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 33) as f64 / f64::from(1u32 << 31)) * 4.0 - 2.0
        };
        let text: String = (0..2000)
            .map(|i| {
                let x = 500.0 * f64::from(i);
                format!("{x},{}\n", 1.5e-4 * x + 25.0 + noise())
            })
            .collect();
        let f = calibrate_text(Path::new("n.csv"), &text, false).expect("fit");
        assert!((f.a - 1.5e-4).abs() / 1.5e-4 < 0.01, "{f:?}");
        assert!((f.b - 25.0).abs() < 0.3, "{f:?}");
        assert!(f.r2 > 0.99 && f.r2 < 1.0, "{f:?}");
        assert!(f.rmse_ms > 0.5 && f.rmse_ms < 1.5, "{f:?}");
    }

    #[test]
    fn bad_rows_are_rejected_with_line_numbers() {
        let text = "max_kv_tokens,step_ms\n100,30.02\nabc,1\n200,x\n# comment\n\n300\n-5,3\n400,NaN\n500,30.1\n";
        let f = calibrate_text(Path::new("b.csv"), text, false).expect("fit");
        let lines: Vec<u64> = f.rejected.iter().map(|r| r.line).collect();
        assert_eq!(lines, vec![3, 4, 7, 8, 9]);
        assert_eq!(f.samples, 2);
        let out = f.render();
        assert!(out.contains("rejected line 3"), "{out}");
        match calibrate_text(Path::new("b.csv"), text, true) {
            Err(CalibrateError::BadRow { line, .. }) => assert_eq!(line, 3),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn headerless_and_degenerate_inputs() {
        let f = calibrate_text(Path::new("h.csv"), "0,30\n1000,30.2\n", true).expect("fit");
        assert!((f.a - 2e-4).abs() < 1e-12);
        for text in [
            "",
            "max_kv_tokens,step_ms\n",
            "5,1\n",
            "5,1\n5,2\n",
            "x,y\nfoo,bar\n",
        ] {
            assert!(
                matches!(
                    calibrate_text(Path::new("d.csv"), text, false),
                    Err(CalibrateError::Degenerate { .. })
                ),
                "{text:?}"
            );
        }
        assert!(matches!(
            calibrate_file(Path::new("/nonexistent/samples.csv"), false),
            Err(CalibrateError::Io { .. })
        ));
    }

    #[test]
    fn fixture_fits_its_generating_line() {
        // tests/fixtures/step_samples.csv: T = 1.8e-4·x + 27 + N(0, 1.5) with three bad rows
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/step_samples.csv");
        let f = calibrate_file(&p, false).expect("fit");
        let lines: Vec<u64> = f.rejected.iter().map(|r| r.line).collect();
        assert_eq!(lines, vec![13, 26, 31]);
        assert_eq!(f.samples, 40);
        assert!((f.a - 1.8e-4).abs() < 0.05 * 1.8e-4, "{f:?}");
        assert!((f.b - 27.0).abs() < 1.5, "{f:?}");
        assert!(f.r2 > 0.99, "{f:?}");
        assert!(calibrate_file(&p, true).is_err());
    }

    #[test]
    fn file_roundtrip() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("samples.csv");
        std::fs::write(&p, "max_kv_tokens,step_ms\n0,10\n100,20\n200,30\n").expect("write");
        let f = calibrate_file(&p, false).expect("fit");
        assert!((f.a - 0.1).abs() < 1e-12 && (f.b - 10.0).abs() < 1e-9);
    }
}
