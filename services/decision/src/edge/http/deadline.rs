//! The caller's deadline from `grpc-timeout` and [`TIMEOUT_HEADER`], and the duration written
//! back as a `grpc-timeout` value for the gRPC service.
//!
//! Separate because the two header grammars (and their refusals) are their own small parser.

use super::*;

/// The caller's deadline from `grpc-timeout` and [`TIMEOUT_HEADER`] (the shorter of the two
/// when both are given); `None` without either. A malformed value is refused, not ignored:
/// a caller who set a deadline must not wait for `--max-wait` instead.
pub fn deadline_of(headers: &HeaderMap) -> Result<Option<Duration>, JsonError> {
    let mut out: Option<Duration> = None;
    if let Some(v) = headers.get("grpc-timeout") {
        let d = v
            .to_str()
            .ok()
            .and_then(parse_grpc_timeout)
            .ok_or_else(|| {
                JsonError::invalid(format!(
                    "grpc-timeout {v:?} is not <1-8 digits><unit H|M|S|m|u|n> (e.g. 500m)"
                ))
            })?;
        out = Some(d);
    }
    if let Some(v) = headers.get(TIMEOUT_HEADER) {
        let d = v
            .to_str()
            .ok()
            .and_then(|s| humantime::parse_duration(s.trim()).ok())
            .ok_or_else(|| {
                JsonError::invalid(format!(
                    "X-Request-Timeout {v:?} is not a duration with a unit (e.g. 500ms, 5s)"
                ))
            })?;
        out = Some(out.map_or(d, |o| o.min(d)));
    }
    Ok(out)
}

/// `grpc-timeout`'s text for `d`: the finest unit whose count fits its 8 digits.
pub fn format_grpc_timeout(d: Duration) -> String {
    const MAX: u128 = 99_999_999;
    let units: [(u128, char); 6] = [
        (d.as_nanos(), 'n'),
        (d.as_micros(), 'u'),
        (d.as_millis(), 'm'),
        (u128::from(d.as_secs()), 'S'),
        (u128::from(d.as_secs() / 60), 'M'),
        (u128::from(d.as_secs() / 3600), 'H'),
    ];
    for (n, unit) in units {
        if n <= MAX {
            return format!("{n}{unit}");
        }
    }
    format!("{MAX}H")
}
