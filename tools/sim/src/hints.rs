//! Clients' expected output lengths (`--hint-error`, `--hint-mode`): each request's hint made
//! from its true output length, for measuring what such a hint is worth to BR-H
//! (`brh-hinted`).
//!
//! Separate from the loaders: a hint is not in any trace, it is a model of what a gateway
//! could send, applied to whichever workload was loaded.

use clap::ValueEnum;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_distr::{Distribution, StandardNormal};

use crate::trace::TraceRequest;

/// How the hints are made from the true output lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HintMode {
    /// expected = actual · exp(N(0, σ)), σ = `--hint-error` (0: exact).
    Lognormal,
    /// The lognormal mode's hints permuted among the requests: each hint belongs to another
    /// request, so it says nothing of its own (a useless hint with the right distribution).
    Shuffled,
    /// Every request's hint is the workload's mean output (a useless hint that is all equal).
    Constant,
}

/// The hints of a run: a mode and its error.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hints {
    pub mode: HintMode,
    /// σ of the log-normal error (lognormal and shuffled modes).
    pub sigma: f64,
}

impl Hints {
    /// What the two flags ask for: no hints when neither is given; `--hint-error` alone is
    /// the lognormal mode, `--hint-mode` alone has no error (σ = 0). An error message for
    /// values that do not fit.
    pub fn from_flags(sigma: Option<f64>, mode: Option<HintMode>) -> Result<Option<Hints>, String> {
        if let Some(s) = sigma
            && !(s.is_finite() && (0.0..=10.0).contains(&s))
        {
            return Err(format!(
                "--hint-error must be finite and in [0, 10], got {s}"
            ));
        }
        if mode == Some(HintMode::Constant) && sigma.is_some() {
            return Err(
                "--hint-error does not apply to --hint-mode constant (every hint is the \
                        trace's mean output)"
                    .into(),
            );
        }
        Ok(match (sigma, mode) {
            (None, None) => None,
            (s, m) => Some(Hints {
                mode: m.unwrap_or(HintMode::Lognormal),
                sigma: s.unwrap_or(0.0),
            }),
        })
    }

    /// For the workload line.
    pub fn describe(&self) -> String {
        match self.mode {
            HintMode::Lognormal => format!("hints: expected = actual·exp(N(0, {}))", self.sigma),
            HintMode::Shuffled => format!(
                "hints: expected = actual·exp(N(0, {})), shuffled among requests",
                self.sigma
            ),
            HintMode::Constant => "hints: the mean output for every request".into(),
        }
    }

    /// Sets every request's `expected_output`, drawn from `seed` (the same seed and requests
    /// give the same hints).
    pub fn apply(&self, requests: &mut [TraceRequest], seed: u64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x4a17_0e55_0000_0000);
        let mut hints: Vec<u32> = match self.mode {
            HintMode::Lognormal | HintMode::Shuffled => requests
                .iter()
                .map(|r| {
                    let z: f64 = StandardNormal.sample(&mut rng);
                    let error = if self.sigma == 0.0 {
                        1.0
                    } else {
                        (self.sigma * z).exp()
                    };
                    to_tokens(f64::from(r.output_tokens) * error)
                })
                .collect(),
            HintMode::Constant => {
                let n = requests.len().max(1) as f64;
                let mean = requests
                    .iter()
                    .map(|r| f64::from(r.output_tokens))
                    .sum::<f64>()
                    / n;
                vec![to_tokens(mean); requests.len()]
            }
        };
        if self.mode == HintMode::Shuffled {
            hints.shuffle(&mut rng);
        }
        for (r, hint) in requests.iter_mut().zip(hints) {
            r.expected_output = Some(hint);
        }
    }
}

/// A length in tokens: rounded, at least 1.
fn to_tokens(x: f64) -> u32 {
    x.round().clamp(1.0, f64::from(u32::MAX)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn requests(outputs: &[u32]) -> Vec<TraceRequest> {
        outputs
            .iter()
            .map(|&o| TraceRequest {
                arrival_ms: Some(0.0),
                prompt_tokens: 10,
                output_tokens: o,
                prompt_hash: None,
                expected_output: None,
                class: None,
            })
            .collect()
    }

    fn hinted(hints: Hints, outputs: &[u32], seed: u64) -> Vec<u32> {
        let mut r = requests(outputs);
        hints.apply(&mut r, seed);
        r.iter().map(|q| q.expected_output.expect("hint")).collect()
    }

    #[test]
    fn flags_give_no_hints_by_default_and_refuse_bad_values() {
        assert_eq!(Hints::from_flags(None, None), Ok(None));
        let h = Hints::from_flags(Some(0.3), None)
            .expect("ok")
            .expect("hints");
        assert_eq!((h.mode, h.sigma), (HintMode::Lognormal, 0.3));
        let h = Hints::from_flags(None, Some(HintMode::Shuffled))
            .expect("ok")
            .expect("h");
        assert_eq!((h.mode, h.sigma), (HintMode::Shuffled, 0.0));
        for bad in [-0.1, f64::NAN, f64::INFINITY, 11.0] {
            assert!(Hints::from_flags(Some(bad), None).is_err(), "{bad}");
        }
        assert!(Hints::from_flags(Some(0.3), Some(HintMode::Constant)).is_err());
    }

    #[test]
    fn exact_noisy_shuffled_and_constant_hints() {
        let outputs: Vec<u32> = (1..=200).map(|i| i * 10).collect();
        let exact = Hints {
            mode: HintMode::Lognormal,
            sigma: 0.0,
        };
        assert_eq!(hinted(exact, &outputs, 1), outputs);

        let noisy = Hints {
            mode: HintMode::Lognormal,
            sigma: 0.3,
        };
        let a = hinted(noisy, &outputs, 1);
        assert_eq!(a, hinted(noisy, &outputs, 1), "seeded");
        assert_ne!(a, hinted(noisy, &outputs, 2), "another seed, other hints");
        let logs: Vec<f64> = a
            .iter()
            .zip(&outputs)
            .map(|(&e, &o)| (f64::from(e) / f64::from(o)).ln())
            .collect();
        let mean = logs.iter().sum::<f64>() / logs.len() as f64;
        let sd = (logs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / logs.len() as f64).sqrt();
        assert!(
            mean.abs() < 0.1 && (sd - 0.3).abs() < 0.06,
            "mean {mean} sd {sd}"
        );

        let shuffled = Hints {
            mode: HintMode::Shuffled,
            sigma: 0.0,
        };
        let s = hinted(shuffled, &outputs, 1);
        assert_ne!(s, outputs, "permuted");
        let mut sorted = s.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, outputs, "the same hints, among other requests");

        let constant = Hints {
            mode: HintMode::Constant,
            sigma: 0.0,
        };
        assert!(hinted(constant, &outputs, 1).iter().all(|&e| e == 1005));
    }
}
