//! The least-squares fits behind `br-sim calibrate`: the two-term line `T = a·M + b`, the
//! three-term plane `T = a·M + c·N + b`, their standard errors and residual spreads.
//!
//! Separate from reading the samples and printing the result: this is the numerical part,
//! pure functions of the samples.

use super::*;

/// Least-squares fit of `y = a·x + b`: (a, b, R², rmse). `None` with fewer than two samples or
/// no spread in x.
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

/// The three-term least-squares fit with standard errors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plane {
    pub a: f64,
    pub c: f64,
    pub b: f64,
    pub se_a: Option<f64>,
    pub se_c: Option<f64>,
    pub se_b: Option<f64>,
    pub r2: f64,
    pub rmse: f64,
}

/// Least-squares fit of `y = a·x + c·z + b` over (x, z, y) triples, by the centred normal
/// equations. `Err` says why `c` (or `a`) cannot be identified: fewer than four samples, x or z
/// constant, or x and z collinear.
pub fn fit_plane(samples: &[(f64, f64, f64)]) -> Result<Plane, String> {
    let len = samples.len();
    if len < 4 {
        return Err(format!(
            "{len} usable samples; need at least four for a, c and b with a residual"
        ));
    }
    let n = len as f64;
    let mean = |f: fn(&(f64, f64, f64)) -> f64| samples.iter().map(f).sum::<f64>() / n;
    let (mx, mz, my) = (mean(|s| s.0), mean(|s| s.1), mean(|s| s.2));
    let (mut sxx, mut szz, mut sxz, mut sxy, mut szy, mut syy) = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x, z, y) in samples {
        let (u, v, w) = (x - mx, z - mz, y - my);
        sxx += u * u;
        szz += v * v;
        sxz += u * v;
        sxy += u * w;
        szy += v * w;
        syy += w * w;
    }
    let tiny = |ss: f64, m: f64| ss <= f64::EPSILON * m.abs().max(1.0).powi(2) * n;
    if tiny(szz, mz) {
        return Err(format!(
            "max_running is the same ({mz}) in every sample: run the engine at several batch sizes"
        ));
    }
    if tiny(sxx, mx) {
        return Err(format!(
            "max_kv_tokens is the same ({mx}) in every sample: a cannot be fitted"
        ));
    }
    let r2_xz = sxz * sxz / (sxx * szz);
    if r2_xz >= COLLINEAR_R2 {
        return Err(format!(
            "max_kv_tokens and max_running move together (correlation² {r2_xz:.8}): vary the \
             prompt lengths at each batch size so tokens and requests can be told apart"
        ));
    }
    let det = sxx * szz - sxz * sxz;
    let a = (szz * sxy - sxz * szy) / det;
    let c = (sxx * szy - sxz * sxy) / det;
    let b = my - a * mx - c * mz;
    let sse: f64 = samples
        .iter()
        .map(|&(x, z, y)| (y - (a * x + c * z + b)).powi(2))
        .sum();
    let dof = len - 3;
    let (se_a, se_c, se_b) = if dof > 0 {
        let s2 = sse / dof as f64;
        let var_b = s2 * (1.0 / n + (mx * mx * szz - 2.0 * mx * mz * sxz + mz * mz * sxx) / det);
        (
            Some((s2 * szz / det).sqrt()),
            Some((s2 * sxx / det).sqrt()),
            Some(var_b.max(0.0).sqrt()),
        )
    } else {
        (None, None, None)
    };
    Ok(Plane {
        a,
        c,
        b,
        se_a,
        se_c,
        se_b,
        r2: if syy > 0.0 { 1.0 - sse / syy } else { 1.0 },
        rmse: (sse / n).sqrt(),
    })
}

/// Standard errors of the two-term fit's a and b (`None` with two samples: no residual).
pub(super) fn line_standard_errors(
    samples: &[(f64, f64)],
    a: f64,
    b: f64,
) -> (Option<f64>, Option<f64>) {
    let len = samples.len();
    if len < 3 {
        return (None, None);
    }
    let n = len as f64;
    let mx = samples.iter().map(|s| s.0).sum::<f64>() / n;
    let sxx = samples.iter().map(|s| (s.0 - mx).powi(2)).sum::<f64>();
    let sse = samples
        .iter()
        .map(|s| (s.1 - (a * s.0 + b)).powi(2))
        .sum::<f64>();
    let s2 = sse / (n - 2.0);
    (
        Some((s2 / sxx).sqrt()),
        Some((s2 * (1.0 / n + mx * mx / sxx)).sqrt()),
    )
}

/// (p95, max) of the absolute residuals.
pub(super) fn residual_spread(residuals: impl Iterator<Item = f64>) -> (f64, f64) {
    let mut abs: Vec<f64> = residuals.map(f64::abs).collect();
    let p95 = br_core::stats::quantile(&mut abs, 0.95);
    let max = abs.iter().copied().fold(0.0, f64::max);
    (p95, max)
}

/// A least-squares fit of `y = Σ_j coef_j·x_j + b` with standard errors.
#[derive(Debug, Clone, PartialEq)]
pub struct Ols {
    pub coef: Vec<f64>,
    pub b: f64,
    /// Standard errors of `coef` and `b` (`None` without residual degrees of freedom).
    pub se: Option<Vec<f64>>,
    pub se_b: Option<f64>,
    pub r2: f64,
    pub rmse: f64,
}

/// Ordinary least squares of `y` on the regressor columns `names` (each row: the regressors
/// then y) plus an intercept, by the normal equations on centred and scaled columns, solved by
/// Gauss-Jordan elimination with partial pivoting (k ≤ a few: the step model's terms). `Err`
/// names the column that cannot be identified: too few rows, a constant column, or a column
/// that the others explain within [`COLLINEAR_R2`].
pub fn fit_ols(rows: &[Vec<f64>], names: &[&str]) -> Result<Ols, String> {
    let k = names.len();
    let len = rows.len();
    if len < k + 2 {
        return Err(format!(
            "{len} usable samples; need at least {} for {k} slopes and a level with a residual",
            k + 2
        ));
    }
    let n = len as f64;
    let mean: Vec<f64> = (0..=k)
        .map(|j| rows.iter().map(|r| r[j]).sum::<f64>() / n)
        .collect();
    // centred cross products: s[i][j] over the regressors, sy[j] with y, syy
    let mut s = vec![vec![0.0; k]; k];
    let mut sy = vec![0.0; k];
    let mut syy = 0.0;
    for r in rows {
        let w = r[k] - mean[k];
        syy += w * w;
        for i in 0..k {
            let u = r[i] - mean[i];
            sy[i] += u * w;
            for j in 0..k {
                s[i][j] += u * (r[j] - mean[j]);
            }
        }
    }
    for j in 0..k {
        if s[j][j] <= f64::EPSILON * mean[j].abs().max(1.0).powi(2) * n {
            return Err(format!(
                "{} is the same ({}) in every sample: its slope cannot be fitted",
                names[j], mean[j]
            ));
        }
    }
    // the correlation matrix of the regressors, inverted
    let scale: Vec<f64> = (0..k).map(|j| s[j][j].sqrt()).collect();
    let mut m: Vec<Vec<f64>> = (0..k)
        .map(|i| {
            let mut row: Vec<f64> = (0..k).map(|j| s[i][j] / (scale[i] * scale[j])).collect();
            row.extend((0..k).map(|j| if i == j { 1.0 } else { 0.0 }));
            row
        })
        .collect();
    for col in 0..k {
        let pivot = (col..k)
            .max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))
            .unwrap_or(col);
        m.swap(col, pivot);
        let p = m[col][col];
        if p.abs() < 1e-12 {
            return Err(format!(
                "{} moves with the other columns: vary it apart from them",
                names[col]
            ));
        }
        for v in &mut m[col] {
            *v /= p;
        }
        let pivot_row = m[col].clone();
        for (i, row) in m.iter_mut().enumerate() {
            let f = row[col];
            if i != col && f != 0.0 {
                for (v, p) in row.iter_mut().zip(&pivot_row) {
                    *v -= f * p;
                }
            }
        }
    }
    // inv[i][j] = (XᵀX centred)⁻¹; its diagonal over the correlation form is 1 / (1 − R²_j)
    let inv: Vec<Vec<f64>> = (0..k)
        .map(|i| {
            (0..k)
                .map(|j| m[i][k + j] / (scale[i] * scale[j]))
                .collect()
        })
        .collect();
    for j in 0..k {
        let vif = m[j][k + j];
        if 1.0 - 1.0 / vif >= COLLINEAR_R2 {
            return Err(format!(
                "{} moves with the other columns (R² {:.8} from them): vary it apart from them",
                names[j],
                1.0 - 1.0 / vif
            ));
        }
    }
    let coef: Vec<f64> = (0..k)
        .map(|i| (0..k).map(|j| inv[i][j] * sy[j]).sum())
        .collect();
    let b = mean[k] - (0..k).map(|j| coef[j] * mean[j]).sum::<f64>();
    let sse: f64 = rows
        .iter()
        .map(|r| (r[k] - b - (0..k).map(|j| coef[j] * r[j]).sum::<f64>()).powi(2))
        .sum();
    let dof = len - k - 1;
    let (se, se_b) = if dof > 0 {
        let s2 = sse / dof as f64;
        let se: Vec<f64> = (0..k).map(|j| (s2 * inv[j][j]).max(0.0).sqrt()).collect();
        let quad: f64 = (0..k)
            .map(|i| (0..k).map(|j| mean[i] * inv[i][j] * mean[j]).sum::<f64>())
            .sum();
        (Some(se), Some((s2 * (1.0 / n + quad)).max(0.0).sqrt()))
    } else {
        (None, None)
    };
    Ok(Ols {
        coef,
        b,
        se,
        se_b,
        r2: if syy > 0.0 { 1.0 - sse / syy } else { 1.0 },
        rmse: (sse / n).sqrt(),
    })
}
