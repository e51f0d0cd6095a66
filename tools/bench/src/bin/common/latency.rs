//! What the two load tools beside this directory (`assign-load`, `telemetry-latency`) share:
//! microsecond latency histograms and the one-line report they print for each. Not a binary
//! of its own (no `main.rs` here); each tool includes it with `#[path]`.

use std::time::Duration;

use hdrhistogram::Histogram;

/// Whole microseconds, saturating.
pub fn us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Microseconds from 1 µs to an hour, 3 significant digits.
pub fn latency_histogram() -> anyhow::Result<Histogram<u64>> {
    Ok(Histogram::new_with_bounds(1, 3_600_000_000, 3)?)
}

/// `what: p50 … p90 … p99 … p99.9 … max … (n = …)`, or that it has no samples.
pub fn report(what: &str, h: &Histogram<u64>) {
    if h.is_empty() {
        println!("{what}: no samples");
        return;
    }
    let q = |p: f64| h.value_at_quantile(p);
    println!(
        "{what}: p50 {} µs, p90 {} µs, p99 {} µs, p99.9 {} µs, max {} µs (n = {})",
        q(0.50),
        q(0.90),
        q(0.99),
        q(0.999),
        h.max(),
        h.len()
    );
}
