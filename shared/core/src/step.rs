//! The lockstep step-time model `T = a·M + p·P + c·N + b` (M: KV tokens on the most loaded rank,
//! P: prefill tokens run by the rank that runs the most in the step, N: running requests on the
//! rank that runs the most) and an online fit of its two-term form from observed steps.
//!
//! The paper's model is `T = a·M + b` (c = p = 0): a rank's step grows with the KV it reads. Real
//! engines also pay per running request (the per-token projections, sampling, the MoE dispatch
//! of one token per request), which is what `c` measures; `br-sim calibrate` fits it from
//! samples that carry N and says whether the data asks for it. Both maxima are over ranks
//! separately (the form `br-sim calibrate` can identify from samples); the barrier then
//! idles `a·(M − L_g) + c·(N − n_g)` on rank g, which is what the F-score's request term
//! (`score::ScoreParams`) prices.
//!
//! `p` is for ranks that run prefill in the same steps as their decode batch (colocated prefill:
//! SGLang `--enable-dp-attention`, vLLM data parallel with expert parallelism, TensorRT-LLM
//! attention DP with in-flight batching). A rank that runs a prefill chunk of P_g prompt tokens
//! in a step takes `p·P_g` longer, and in lockstep every other rank waits for it: the step is
//! `a·max L + p·max P + c·max n + b`. With disaggregated prefill (a decode tier only) P is 0 in
//! every step and p does not matter; p = 0, the default, is the decode-only model, computed by
//! the same instructions as before p existed.
//!
//! The simulator and the emulated engine take `a`, `b` (and the simulator `c` and `p`) as
//! parameters; a service that only sees telemetry learns them: [`StepFit`] keeps the last few
//! `(M, T)` observations and fits the line by least squares (c = p = 0: telemetry gives it
//! neither N nor P). Observations from one steady load barely vary in `M`, which leaves the
//! slope undetermined; the fit then keeps the prior slope and fits only the intercept (the
//! level), so an estimate is always sane: positive and finite.

use std::collections::VecDeque;

/// `T = a·M + p·P + c·N + b`, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepModel {
    /// a: ms per KV token on the most loaded rank.
    pub a_ms_per_token: f64,
    /// b: fixed ms per step.
    pub b_ms: f64,
    /// c: ms per running request on the rank that runs the most (0 in the paper's model).
    pub c_ms_per_request: f64,
    /// p: ms per prefill token run in the step by the rank that runs the most (0: prefill runs
    /// elsewhere, the decode-only model).
    pub p_ms_per_prefill_token: f64,
}

impl StepModel {
    /// The simulator's defaults (a = 2e-4 ms per token, b = 30 ms, c = p = 0).
    pub const DEFAULT: StepModel = StepModel {
        a_ms_per_token: 2e-4,
        b_ms: 30.0,
        c_ms_per_request: 0.0,
        p_ms_per_prefill_token: 0.0,
    };

    /// Shortest step the model ever predicts (a guard against a degenerate fit).
    pub const MIN_STEP_MS: f64 = 1.0;

    /// The step time in ms when the most loaded rank holds `max_load` KV tokens, leaving out
    /// the request and prefill terms: exact for a two-term model (c = 0, e.g. every
    /// [`StepFit`] model) in a step without prefill; otherwise use [`StepModel::step_ms_at`]
    /// or [`StepModel::step_ms_with_prefill`].
    pub fn step_ms(&self, max_load: u64) -> f64 {
        self.step_ms_at(max_load, 0)
    }

    /// The step time in ms of a decode-only step: the most loaded rank holds `max_load` KV
    /// tokens and the rank with the most running requests runs `max_running`.
    pub fn step_ms_at(&self, max_load: u64, max_running: u32) -> f64 {
        self.step_ms_with_prefill(max_load, 0, max_running)
    }

    /// The step time in ms of a step in which ranks also run prefill (colocated prefill): the
    /// most loaded rank holds `max_load` KV tokens, the rank that runs the most prefill runs
    /// `max_prefill` prompt tokens, and the rank with the most running requests runs
    /// `max_running`: `a·max L + p·max P + c·max n + b`. With `max_prefill = 0` it is
    /// [`StepModel::step_ms_at`] bit for bit, whatever p is.
    pub fn step_ms_with_prefill(&self, max_load: u64, max_prefill: u64, max_running: u32) -> f64 {
        let mut t = self.a_ms_per_token * max_load as f64;
        if max_prefill > 0 {
            t += self.p_ms_per_prefill_token * max_prefill as f64;
        }
        let t = t + self.c_ms_per_request * f64::from(max_running) + self.b_ms;
        if t.is_finite() {
            t.max(Self::MIN_STEP_MS)
        } else {
            Self::MIN_STEP_MS
        }
    }

    /// `c / a`: how many KV tokens on the most loaded rank cost the barrier what one running
    /// request on the busiest rank does, the weight of the F-score's request term
    /// ([`crate::score::ScoreParams::request_cost_tokens`]). `None` when `a` is not positive
    /// (then tokens do not matter and the ratio means nothing).
    pub fn request_cost_tokens(&self) -> Option<f64> {
        let k = self.c_ms_per_request / self.a_ms_per_token;
        (self.a_ms_per_token > 0.0 && k.is_finite() && k >= 0.0).then_some(k)
    }
}

impl Default for StepModel {
    fn default() -> Self {
        StepModel::DEFAULT
    }
}

/// An online least-squares fit of [`StepModel`] over the last `window` observations.
#[derive(Debug, Clone)]
pub struct StepFit {
    prior: StepModel,
    window: usize,
    samples: VecDeque<(f64, f64)>,
}

impl StepFit {
    /// Fits around `prior` (used as it is until the first observation, and for the slope
    /// while the observed loads do not spread enough to determine one). The observations carry
    /// no request counts and no prefill tokens, so the fit is the two-term model: the prior's
    /// `c` and `p` are dropped.
    pub fn new(prior: StepModel, window: usize) -> StepFit {
        StepFit {
            prior: StepModel {
                c_ms_per_request: 0.0,
                p_ms_per_prefill_token: 0.0,
                ..prior
            },
            window: window.max(1),
            samples: VecDeque::new(),
        }
    }

    /// One observation: steps ran at `step_ms` each while the most loaded rank held
    /// `max_load` tokens. Non-finite or non-positive times are ignored.
    pub fn observe(&mut self, max_load: u64, step_ms: f64) {
        if !step_ms.is_finite() || step_ms <= 0.0 {
            return;
        }
        if self.samples.len() == self.window {
            self.samples.pop_front();
        }
        self.samples.push_back((max_load as f64, step_ms));
    }

    pub fn samples(&self) -> usize {
        self.samples.len()
    }

    /// The current model.
    pub fn model(&self) -> StepModel {
        let n = self.samples.len() as f64;
        if n == 0.0 {
            return self.prior;
        }
        let (sx, sy) = self
            .samples
            .iter()
            .fold((0.0, 0.0), |(sx, sy), (x, y)| (sx + x, sy + y));
        let (mx, my) = (sx / n, sy / n);
        let (sxx, sxy) = self.samples.iter().fold((0.0, 0.0), |(sxx, sxy), (x, y)| {
            (sxx + (x - mx) * (x - mx), sxy + (x - mx) * (y - my))
        });
        // The loads must spread by at least a few percent of their level (and 100 tokens)
        // for the slope to mean anything; a negative slope is noise, not physics.
        let spread = (sxx / n).sqrt();
        if n >= 3.0 && spread >= (0.05 * mx).max(100.0) {
            let a = sxy / sxx;
            if a >= 0.0 && a.is_finite() {
                return StepModel {
                    a_ms_per_token: a,
                    b_ms: my - a * mx,
                    c_ms_per_request: 0.0,
                    p_ms_per_prefill_token: 0.0,
                };
            }
        }
        let a = self.prior.a_ms_per_token;
        StepModel {
            a_ms_per_token: a,
            b_ms: my - a * mx,
            c_ms_per_request: 0.0,
            p_ms_per_prefill_token: 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_observations_the_prior_holds() {
        let f = StepFit::new(StepModel::DEFAULT, 8);
        assert_eq!(f.model(), StepModel::DEFAULT);
        assert_eq!(StepModel::DEFAULT.step_ms(10_000), 32.0);
    }

    #[test]
    fn spread_loads_recover_the_line() {
        let mut f = StepFit::new(StepModel::DEFAULT, 64);
        for x in [1_000u64, 5_000, 20_000, 40_000] {
            f.observe(x, 5e-4 * x as f64 + 12.0);
        }
        let m = f.model();
        assert!((m.a_ms_per_token - 5e-4).abs() < 1e-9, "{m:?}");
        assert!((m.b_ms - 12.0).abs() < 1e-6, "{m:?}");
    }

    #[test]
    fn a_steady_load_fits_the_level_with_the_prior_slope() {
        let mut f = StepFit::new(StepModel::DEFAULT, 64);
        for _ in 0..10 {
            f.observe(2_000, 40.0);
        }
        let m = f.model();
        assert_eq!(m.a_ms_per_token, StepModel::DEFAULT.a_ms_per_token);
        assert!((m.step_ms(2_000) - 40.0).abs() < 1e-9, "{m:?}");
    }

    #[test]
    fn the_window_forgets_old_observations_and_bad_ones_are_ignored() {
        let mut f = StepFit::new(StepModel::DEFAULT, 2);
        f.observe(100, 500.0);
        f.observe(100, 20.0);
        f.observe(100, 20.0);
        f.observe(100, f64::NAN);
        f.observe(100, -1.0);
        assert_eq!(f.samples(), 2);
        assert!((f.model().step_ms(100) - 20.0).abs() < 1e-9);
        // Never below the floor, whatever the fit says.
        let odd = StepModel {
            a_ms_per_token: 0.0,
            b_ms: -5.0,
            ..StepModel::DEFAULT
        };
        assert_eq!(odd.step_ms(0), StepModel::MIN_STEP_MS);
    }

    #[test]
    fn the_request_term_adds_c_per_request_and_c_zero_is_the_two_term_model() {
        let m = StepModel {
            c_ms_per_request: 0.25,
            ..StepModel::DEFAULT
        };
        assert_eq!(
            m.step_ms_at(10_000, 64),
            2e-4 * 10_000.0 + 0.25 * 64.0 + 30.0
        );
        assert_eq!(m.step_ms(10_000), StepModel::DEFAULT.step_ms(10_000));
        for n in [0u32, 1, 64, 256] {
            assert_eq!(
                StepModel::DEFAULT.step_ms_at(123_456, n),
                StepModel::DEFAULT.step_ms(123_456)
            );
        }
        assert_eq!(m.request_cost_tokens(), Some(1250.0));
        assert_eq!(StepModel::DEFAULT.request_cost_tokens(), Some(0.0));
        let flat = StepModel {
            a_ms_per_token: 0.0,
            ..m
        };
        assert_eq!(flat.request_cost_tokens(), None);
        // the online fit has no request counts to fit c from
        let f = StepFit::new(m, 8);
        assert_eq!(f.model().c_ms_per_request, 0.0);
    }

    #[test]
    fn the_prefill_term_adds_p_per_prefill_token_of_the_rank_that_runs_the_most() {
        let m = StepModel {
            c_ms_per_request: 0.25,
            p_ms_per_prefill_token: 0.05,
            ..StepModel::DEFAULT
        };
        assert_eq!(
            m.step_ms_with_prefill(10_000, 4_096, 64),
            2e-4 * 10_000.0 + 0.05 * 4_096.0 + 0.25 * 64.0 + 30.0
        );
        // a step without prefill is the decode-only step bit for bit, whatever p is
        for (l, n) in [
            (0u64, 0u32),
            (10_000, 64),
            (123_456, 256),
            (u64::from(u32::MAX), 1),
        ] {
            assert_eq!(
                m.step_ms_with_prefill(l, 0, n).to_bits(),
                StepModel {
                    p_ms_per_prefill_token: 0.0,
                    ..m
                }
                .step_ms_at(l, n)
                .to_bits()
            );
            assert_eq!(m.step_ms_at(l, n), m.step_ms_with_prefill(l, 0, n));
        }
        // p = 0 (the default) ignores prefill: the decode-only model
        assert_eq!(
            StepModel::DEFAULT.step_ms_with_prefill(10_000, 8_192, 0),
            StepModel::DEFAULT.step_ms(10_000)
        );
        // the term grows with the busiest rank's prefill, linearly
        let d = m.step_ms_with_prefill(10_000, 8_192, 64) - m.step_ms_with_prefill(10_000, 0, 64);
        assert!((d - 0.05 * 8_192.0).abs() < 1e-9, "{d}");
        // a degenerate p (NaN) gives the floor, never a NaN step
        let bad = StepModel {
            p_ms_per_prefill_token: f64::NAN,
            ..m
        };
        assert_eq!(bad.step_ms_with_prefill(1, 1, 1), StepModel::MIN_STEP_MS);
        // the online fit has no prefill tokens to fit p from
        let f = StepFit::new(m, 8);
        assert_eq!(f.model().p_ms_per_prefill_token, 0.0);
        let mut f = StepFit::new(m, 64);
        for x in [1_000u64, 5_000, 20_000, 40_000] {
            f.observe(x, 5e-4 * x as f64 + 12.0);
        }
        assert_eq!(f.model().p_ms_per_prefill_token, 0.0);
    }
}
