//! Reading the samples CSV for `br-sim calibrate`: the two formats (positional
//! `max_kv_tokens,step_ms`, or a header naming `max_running` and/or `max_prefill_tokens`), and
//! every rejected row with its line number and reason.
//!
//! Separate from the fits: what a row means and when it is refused reads on its own.

use super::*;

/// Where the named columns are (the format with a header naming N and/or P).
#[derive(Debug, Clone, Copy)]
struct Columns {
    max_kv_tokens: usize,
    max_running: Option<usize>,
    max_prefill_tokens: Option<usize>,
    step_ms: usize,
}

/// The samples of a file, its rejected rows, and whether it carries N.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    /// Usable samples.
    pub samples: Vec<Sample>,
    /// Rejected rows.
    pub rejected: Vec<Rejected>,
    /// The header named `max_running`.
    pub with_requests: bool,
    /// The header named `max_prefill_tokens`.
    pub with_prefill: bool,
}

/// Reads a header row: `Ok(Some)` for a header naming `max_running` or `max_prefill_tokens`,
/// `Ok(None)` for any other header (the positional two-column format), `Err` for such a header
/// missing `max_kv_tokens` or `step_ms`.
fn header_columns(fields: &[&str]) -> Result<Option<Columns>, String> {
    let find = |name: &str| {
        fields
            .iter()
            .position(|f| f.trim().eq_ignore_ascii_case(name))
    };
    let (max_running, max_prefill_tokens) = (find("max_running"), find("max_prefill_tokens"));
    if max_running.is_none() && max_prefill_tokens.is_none() {
        return Ok(None);
    }
    match (find("max_kv_tokens"), find("step_ms")) {
        (Some(max_kv_tokens), Some(step_ms)) => Ok(Some(Columns {
            max_kv_tokens,
            max_running,
            max_prefill_tokens,
            step_ms,
        })),
        _ => Err(format!(
            "a header with max_running or max_prefill_tokens must also name max_kv_tokens and \
             step_ms, got `{}`",
            fields.join(",")
        )),
    }
}

fn number(fields: &[&str], i: usize, name: &str) -> Result<f64, String> {
    let raw = fields.get(i).copied().unwrap_or_default();
    raw.parse::<f64>()
        .map_err(|_| format!("{name} `{raw}` is not a number"))
}

/// Parses samples from CSV text.
pub fn parse(path: &Path, text: &str) -> Result<Parsed, CalibrateError> {
    let mut samples = Vec::new();
    let mut rejected = Vec::new();
    let mut seen_data = false;
    let mut columns: Option<Columns> = None;
    for (idx, raw) in text.lines().enumerate() {
        let line = idx as u64 + 1;
        let row = raw.trim().trim_start_matches('\u{feff}');
        if row.is_empty() || row.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = row.split(',').map(str::trim).collect();
        // A first row whose first field is not a number is a header.
        if !seen_data
            && fields[0].parse::<f64>().is_err()
            && fields[0].chars().any(|c| c.is_ascii_alphabetic())
        {
            seen_data = true;
            columns = header_columns(&fields).map_err(|reason| CalibrateError::BadHeader {
                path: path.to_path_buf(),
                line,
                reason,
            })?;
            continue;
        }
        seen_data = true;
        let parsed = match columns {
            None if fields.len() < 2 => {
                Err(format!("expected `max_kv_tokens,step_ms`, got `{row}`"))
            }
            None => number(&fields, 0, "max_kv_tokens").and_then(|x| {
                number(&fields, 1, "step_ms").map(|y| Sample {
                    max_kv_tokens: x,
                    max_running: None,
                    max_prefill: None,
                    step_ms: y,
                })
            }),
            Some(c) => {
                let need = [c.max_running, c.max_prefill_tokens]
                    .into_iter()
                    .flatten()
                    .fold(c.max_kv_tokens.max(c.step_ms), usize::max)
                    + 1;
                let optional =
                    |i: Option<usize>, name| i.map(|i| number(&fields, i, name)).transpose();
                if fields.len() < need {
                    Err(format!("expected {need} fields, got `{row}`"))
                } else {
                    number(&fields, c.max_kv_tokens, "max_kv_tokens").and_then(|x| {
                        let n = optional(c.max_running, "max_running")?;
                        let p = optional(c.max_prefill_tokens, "max_prefill_tokens")?;
                        number(&fields, c.step_ms, "step_ms").map(|y| Sample {
                            max_kv_tokens: x,
                            max_running: n,
                            max_prefill: p,
                            step_ms: y,
                        })
                    })
                }
            }
        };
        match parsed {
            Ok(s) if valid(&s) => samples.push(s),
            Ok(s) => rejected.push(Rejected {
                line,
                reason: match (s.max_running, s.max_prefill) {
                    (None, None) => format!(
                        "max_kv_tokens must be finite and >= 0 and step_ms finite and > 0, got {}, {}",
                        s.max_kv_tokens, s.step_ms
                    ),
                    (Some(n), None) => format!(
                        "max_kv_tokens and max_running must be finite and >= 0 and step_ms finite and > 0, got {}, {n}, {}",
                        s.max_kv_tokens, s.step_ms
                    ),
                    (n, Some(p)) => format!(
                        "max_kv_tokens, max_running and max_prefill_tokens must be finite and >= 0 and step_ms finite and > 0, got {}, {}, {p}, {}",
                        s.max_kv_tokens,
                        n.map_or("-".into(), |n| n.to_string()),
                        s.step_ms
                    ),
                },
            }),
            Err(reason) => rejected.push(Rejected { line, reason }),
        }
    }
    Ok(Parsed {
        samples,
        rejected,
        with_requests: columns.is_some_and(|c| c.max_running.is_some()),
        with_prefill: columns.is_some_and(|c| c.max_prefill_tokens.is_some()),
    })
}

fn valid(s: &Sample) -> bool {
    s.max_kv_tokens.is_finite()
        && s.max_kv_tokens >= 0.0
        && s.step_ms.is_finite()
        && s.step_ms > 0.0
        && s.max_running.is_none_or(|n| n.is_finite() && n >= 0.0)
        && s.max_prefill.is_none_or(|p| p.is_finite() && p >= 0.0)
}

/// Parses two-column samples from CSV text; returns the usable (x, y) pairs and the rejected
/// rows (the two-term model's reader; a three-term file's N is ignored).
pub fn parse_samples(text: &str) -> (Vec<(f64, f64)>, Vec<Rejected>) {
    match parse(Path::new(""), text) {
        Ok(p) => (
            p.samples
                .iter()
                .map(|s| (s.max_kv_tokens, s.step_ms))
                .collect(),
            p.rejected,
        ),
        Err(e) => (
            Vec::new(),
            vec![Rejected {
                line: 1,
                reason: e.to_string(),
            }],
        ),
    }
}
