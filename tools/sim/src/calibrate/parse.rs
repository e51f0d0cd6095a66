//! Reading the samples CSV for `br-sim calibrate`: the two formats (positional
//! `max_kv_tokens,step_ms`, or a header naming `max_running`), and every rejected row with its
//! line number and reason.
//!
//! Separate from the fits: what a row means and when it is refused reads on its own.

use super::*;

/// Where the three columns are (the three-term format).
#[derive(Debug, Clone, Copy)]
struct Columns {
    max_kv_tokens: usize,
    max_running: usize,
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
}

/// Reads a header row: `Ok(Some)` for the three-term format, `Ok(None)` for any other header
/// (the positional two-column format), `Err` for a `max_running` header missing a column.
fn header_columns(fields: &[&str]) -> Result<Option<Columns>, String> {
    let find = |name: &str| {
        fields
            .iter()
            .position(|f| f.trim().eq_ignore_ascii_case(name))
    };
    let Some(max_running) = find("max_running") else {
        return Ok(None);
    };
    match (find("max_kv_tokens"), find("step_ms")) {
        (Some(max_kv_tokens), Some(step_ms)) => Ok(Some(Columns {
            max_kv_tokens,
            max_running,
            step_ms,
        })),
        _ => Err(format!(
            "a header with max_running must also name max_kv_tokens and step_ms, got `{}`",
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
                    step_ms: y,
                })
            }),
            Some(c) => {
                let need = c.max_kv_tokens.max(c.max_running).max(c.step_ms) + 1;
                if fields.len() < need {
                    Err(format!(
                        "expected {need} fields (max_kv_tokens, max_running, step_ms), got `{row}`"
                    ))
                } else {
                    number(&fields, c.max_kv_tokens, "max_kv_tokens").and_then(|x| {
                        number(&fields, c.max_running, "max_running").and_then(|n| {
                            number(&fields, c.step_ms, "step_ms").map(|y| Sample {
                                max_kv_tokens: x,
                                max_running: Some(n),
                                step_ms: y,
                            })
                        })
                    })
                }
            }
        };
        match parsed {
            Ok(s) if valid(&s) => samples.push(s),
            Ok(s) => rejected.push(Rejected {
                line,
                reason: match s.max_running {
                    None => format!(
                        "max_kv_tokens must be finite and >= 0 and step_ms finite and > 0, got {}, {}",
                        s.max_kv_tokens, s.step_ms
                    ),
                    Some(n) => format!(
                        "max_kv_tokens and max_running must be finite and >= 0 and step_ms finite and > 0, got {}, {n}, {}",
                        s.max_kv_tokens, s.step_ms
                    ),
                },
            }),
            Err(reason) => rejected.push(Rejected { line, reason }),
        }
    }
    Ok(Parsed {
        samples,
        rejected,
        with_requests: columns.is_some(),
    })
}

fn valid(s: &Sample) -> bool {
    s.max_kv_tokens.is_finite()
        && s.max_kv_tokens >= 0.0
        && s.step_ms.is_finite()
        && s.step_ms > 0.0
        && s.max_running.is_none_or(|n| n.is_finite() && n >= 0.0)
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
