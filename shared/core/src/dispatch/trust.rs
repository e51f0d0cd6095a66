//! How far Stage 2's finish-stagger term may trust the clients' expected output lengths,
//! learned from the finishes that carried one.
//!
//! The term places a request's expected finish between the rank's others, a few steps apart
//! (E[out]/B steps at B slots per rank): it is only worth anything when the hints are that
//! precise. In br-sim (tools/sim/RESULTS.md, "Hints at placement") log-normal hint errors of
//! σ = 0.05 kept about a quarter of exact hints' gain, σ = 0.1 little of it, σ = 0.3 none, and
//! useless hints (shuffled among requests) cost 1.4 points of gap share. So the term runs at
//! full weight while the hints' RMS log error is at most [`FULL_TRUST_RMS`], fades to nothing
//! at [`NO_TRUST_RMS`], and waits for [`MIN_HINTED_FINISHES`] before trusting at all.

use crate::predict::Finished;

/// Hinted finishes seen before the hints are trusted at all.
pub const MIN_HINTED_FINISHES: u64 = 64;
/// RMS of ln(actual / expected) at or below which the term runs at its configured weight.
pub const FULL_TRUST_RMS: f64 = 0.05;
/// RMS of ln(actual / expected) at or above which the term is off.
pub const NO_TRUST_RMS: f64 = 0.1;
/// The error's mean is over every finish until this many, then a moving average over about
/// this many (hint quality can drift with the traffic).
const WINDOW: f64 = 512.0;

/// The hints' log error, as the group's finishes report it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HintTrust {
    hinted: u64,
    mean_square_log_error: f64,
}

impl HintTrust {
    pub fn observe(&mut self, finished: &Finished) {
        let Some(expected) = finished.expected_output else {
            return;
        };
        let e = (f64::from(finished.output_tokens.max(1)) / f64::from(expected.max(1))).ln();
        self.hinted += 1;
        let weight = 1.0 / (self.hinted as f64).min(WINDOW);
        self.mean_square_log_error += weight * (e * e - self.mean_square_log_error);
    }

    /// The share of the configured stagger weight to use, in `0..=1`.
    pub fn factor(&self) -> f64 {
        if self.hinted < MIN_HINTED_FINISHES {
            return 0.0;
        }
        let rms = self.mean_square_log_error.sqrt();
        ((NO_TRUST_RMS - rms) / (NO_TRUST_RMS - FULL_TRUST_RMS)).clamp(0.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fin(output_tokens: u32, expected_output: Option<u32>) -> Finished {
        Finished {
            prompt_tokens: 100,
            prompt_hash: None,
            output_tokens,
            expected_output,
            class: None,
        }
    }

    #[test]
    fn exact_hints_are_trusted_after_enough_finishes() {
        let mut t = HintTrust::default();
        for _ in 0..MIN_HINTED_FINISHES - 1 {
            t.observe(&fin(1_000, Some(1_000)));
        }
        assert_eq!(t.factor(), 0.0);
        // finishes without a hint do not count
        t.observe(&fin(1_000, None));
        assert_eq!(t.factor(), 0.0);
        t.observe(&fin(1_000, Some(1_000)));
        assert_eq!(t.factor(), 1.0);
    }

    #[test]
    fn trust_fades_with_the_error_and_follows_a_change() {
        let run = |ratio: f64| {
            let mut t = HintTrust::default();
            for i in 0..1_000u32 {
                // alternately above and below by `ratio`: RMS log error ln(ratio)
                let expected = 1_000u32;
                let actual = if i % 2 == 0 {
                    (1_000.0 * ratio).round() as u32
                } else {
                    (1_000.0 / ratio).round() as u32
                };
                t.observe(&fin(actual, Some(expected)));
            }
            t
        };
        assert_eq!(run(1.04).factor(), 1.0);
        let half = run(0.075f64.exp()).factor();
        assert!((half - 0.5).abs() < 0.02, "{half}");
        assert_eq!(run(1.2).factor(), 0.0);
        // hints that turn bad lose the trust within the window
        let mut t = run(1.0);
        assert_eq!(t.factor(), 1.0);
        for _ in 0..1_000 {
            t.observe(&fin(2_000, Some(1_000)));
        }
        assert_eq!(t.factor(), 0.0);
    }
}
