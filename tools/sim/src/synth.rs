//! Seeded synthetic stand-ins for the two traces the paper used, which are not public, and for
//! the dataset of a published attention-DP measurement (`adp-shape`).
//!
//! Results on these workloads must be labelled *synthetic*: they reproduce the published shapes
//! (counts, means, ranges, tail), not the real request sequences.
//!
//! # `paper-azure` (Azure LLM inference trace 2024, conversation split, outputs > 1000)
//! Published: 10k requests, mean prompt 4,652, prompts from about 700 to 8,000; mean output
//! 1,052, all outputs in (1000, 1500], most near 1,024.
//! - Prompt: `700 + 7300·Beta(1.3, 1.1)`, rounded; mean `700 + 7300·1.3/2.4 = 4,654`.
//! - Output, a three-part mixture: 55% exactly 1,024 (the `max_tokens` cap most clients set),
//!   35% uniform on 1,001..=1,060 (stopped just around the cap), 10% uniform on 1,061..=1,500
//!   (long tail up to the trace's maximum). Mean `0.55·1024 + 0.35·1030.5 + 0.10·1280.5 ≈ 1,052`.
//!
//! # `paper-prop` (the paper's proprietary production trace)
//! Published: 8k requests, mean prompt 3,197, mean output 1,185, heavy-tailed outputs.
//! - Prompt: lognormal with σ = 0.7 and mean 3,197, clamped to 16..=32,768.
//! - Output: lognormal with σ = 1.0 and mean 1,185 (median ≈ 719, p99 ≈ 7,300), clamped to
//!   2..=16,384 (the clamp moves the mean by well under 1%).
//! - Finally all prompt and all output lengths are scaled by one factor each so that the sample
//!   means equal the published 3,197 and 1,185 (heavy tails and popular templates make the raw
//!   sample mean wander by several percent between seeds; uniform scaling keeps the shape).
//!
//! # `adp-shape` (TensorRT-LLM's attention-DP balancing measurement, DeepSeek V3 on GB200)
//! NVIDIA's TensorRT-LLM team measured attention-DP load balance with colocated prefill
//! (in-flight batching) on 8 GB200 GPUs, DeepSeek V3, attention DP 8 and MoE expert parallelism
//! 8 ("ADP Balance Strategy", TensorRT-LLM tech blog 10,
//! <https://nvidia.github.io/TensorRT-LLM/blogs/tech_blog/blog10_ADP_Balance_Strategy.html>).
//! Published: 16,000 requests, mean input 803 tokens, mean output 3,653 tokens, "significant
//! diversity in sequence lengths, with output tokens following a pronounced long-tail
//! distribution" (their Figure 2 plots both; the dataset is not public).
//! - Prompt: lognormal with σ = 0.7 and mean 803, clamped to 16..=32,768 (the spread
//!   `paper-prop` gives a production trace's prompts).
//! - Output: lognormal with σ = 1.0 and mean 3,653 (median ≈ 2,216, p99 ≈ 22,700: the long
//!   tail), clamped to 2..=32,768.
//! - All prompt and all output lengths are then scaled by one factor each so that the sample
//!   means are exactly 803 and 3,653, as for `paper-prop`.
//!
//! # Prompt recurrence (every generator)
//! Real traffic repeats prompts (system prompts, templated agents, retries), and the paper's
//! ExactMatch predictor keys an empirical length distribution on the prompt hash. Each request
//! is, with probability [`SynthConfig::template_share`] (default 30%), an occurrence of one of
//! [`SynthConfig::templates`] (default 400) templates, chosen with Zipf(1.0) popularity; otherwise
//! it is a unique prompt with a fresh random hash. A template is drawn once from the same
//! prompt and output distributions as unique requests: its occurrences share its prompt length
//! and hash exactly, and their output lengths are correlated with the template's: with
//! probability 0.8 an occurrence's output is the template's output times a small jitter
//! (`exp(N(0, 0.02))` for paper-azure, `exp(N(0, 0.10))` for paper-prop, clamped to the
//! generator's output range), else a fresh independent draw. Templates are drawn from the same
//! distributions as everything else, so the marginals stay those above.
//!
//! # Arrivals
//! Every request gets a timestamp from a Poisson process at [`SynthConfig::rate_per_s`]
//! (exponential inter-arrival gaps, first arrival at 0). The arrival stream has its own RNG
//! (derived from the seed), so changing the rate does not change the lengths.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Beta, Distribution, Exp, StandardNormal};

use crate::trace::{TraceRequest, mix64};

/// Default seed for the synthetic generators.
pub const DEFAULT_SEED: u64 = 42;
/// Default Poisson arrival rate (requests per second) of synthetic traces.
pub const DEFAULT_RATE_PER_S: f64 = 5.0;

/// Which synthetic workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthKind {
    /// Stand-in for the Azure-2024 conversation split filtered to outputs > 1000.
    PaperAzure,
    /// Stand-in for the paper's proprietary trace.
    PaperProp,
    /// The shape of TensorRT-LLM's attention-DP balancing dataset (DeepSeek V3, GB200).
    AdpShape,
}

impl SynthKind {
    /// Parses `paper-azure` / `paper-prop` / `adp-shape`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "paper-azure" => Some(Self::PaperAzure),
            "paper-prop" => Some(Self::PaperProp),
            "adp-shape" => Some(Self::AdpShape),
            _ => None,
        }
    }

    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Self::PaperAzure => "paper-azure",
            Self::PaperProp => "paper-prop",
            Self::AdpShape => "adp-shape",
        }
    }

    /// The published request count.
    pub fn default_requests(self) -> usize {
        match self {
            Self::PaperAzure => 10_000,
            Self::PaperProp => 8_000,
            Self::AdpShape => 16_000,
        }
    }
}

/// Generator parameters.
#[derive(Debug, Clone, Copy)]
pub struct SynthConfig {
    /// Number of requests (defaults to the published count).
    pub requests: usize,
    /// RNG seed.
    pub seed: u64,
    /// Poisson arrival rate, requests per second.
    pub rate_per_s: f64,
    /// Share of requests that are occurrences of a template (a recurring prompt).
    pub template_share: f64,
    /// Number of distinct templates.
    pub templates: usize,
}

impl SynthConfig {
    /// Defaults for a workload.
    pub fn new(kind: SynthKind) -> Self {
        Self {
            requests: kind.default_requests(),
            seed: DEFAULT_SEED,
            rate_per_s: DEFAULT_RATE_PER_S,
            template_share: 0.3,
            templates: 400,
        }
    }
}

/// Length distributions of one workload.
struct Shape {
    kind: SynthKind,
    prompt_beta: Option<Beta<f64>>,
    /// (mu, sigma) of the log of the prompt length.
    prompt_ln: (f64, f64),
    /// (mu, sigma) of the log of the output length.
    output_ln: (f64, f64),
    /// sigma of the log-jitter of template occurrences.
    jitter: f64,
    out_range: (u32, u32),
}

impl Shape {
    fn new(kind: SynthKind) -> Self {
        // lognormal (mu, sigma) with the given mean
        let ln = |mean: f64, sigma: f64| (mean.ln() - sigma * sigma / 2.0, sigma);
        match kind {
            SynthKind::PaperAzure => Self {
                kind,
                prompt_beta: Beta::new(1.3, 1.1).ok(),
                prompt_ln: (0.0, 0.0),
                output_ln: (0.0, 0.0),
                jitter: 0.02,
                out_range: (1001, 1500),
            },
            SynthKind::PaperProp => Self {
                kind,
                prompt_beta: None,
                prompt_ln: ln(3197.0, 0.7),
                output_ln: ln(1185.0, 1.0),
                jitter: 0.10,
                out_range: (2, 16_384),
            },
            SynthKind::AdpShape => Self {
                kind,
                prompt_beta: None,
                prompt_ln: ln(803.0, 0.7),
                output_ln: ln(3653.0, 1.0),
                jitter: 0.10,
                out_range: (2, 32_768),
            },
        }
    }

    fn prompt<R: Rng>(&self, rng: &mut R) -> u32 {
        match self.kind {
            SynthKind::PaperAzure => {
                let x = self.prompt_beta.map_or(0.5, |b| b.sample(rng));
                (700.0 + 7300.0 * x).round() as u32
            }
            SynthKind::PaperProp | SynthKind::AdpShape => {
                let x = lognormal(rng, self.prompt_ln);
                x.round().clamp(16.0, 32_768.0) as u32
            }
        }
    }

    fn output<R: Rng>(&self, rng: &mut R) -> u32 {
        match self.kind {
            SynthKind::PaperAzure => {
                let u: f64 = rng.random();
                if u < 0.55 {
                    1024
                } else if u < 0.90 {
                    rng.random_range(1001..=1060)
                } else {
                    rng.random_range(1061..=1500)
                }
            }
            SynthKind::PaperProp | SynthKind::AdpShape => {
                let x = lognormal(rng, self.output_ln);
                self.clamp_out(x)
            }
        }
    }

    fn clamp_out(&self, x: f64) -> u32 {
        x.round()
            .clamp(f64::from(self.out_range.0), f64::from(self.out_range.1)) as u32
    }

    /// Output of one occurrence of a template whose own output is `center`.
    fn template_output<R: Rng>(&self, rng: &mut R, center: u32) -> u32 {
        if rng.random::<f64>() < 0.8 {
            let j = lognormal(rng, (0.0, self.jitter));
            self.clamp_out(f64::from(center) * j)
        } else {
            self.output(rng)
        }
    }
}

fn lognormal<R: Rng>(rng: &mut R, (mu, sigma): (f64, f64)) -> f64 {
    let z: f64 = rng.sample(StandardNormal);
    (mu + sigma * z).exp()
}

/// Generates a synthetic workload (deterministic for a given config).
pub fn generate(kind: SynthKind, cfg: &SynthConfig) -> Vec<TraceRequest> {
    let shape = Shape::new(kind);
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let mut arrivals = StdRng::seed_from_u64(mix64(cfg.seed ^ 0xa5a5_5a5a_0f0f_f0f0));
    let gap = Exp::new(cfg.rate_per_s.max(1e-9) / 1000.0).ok();

    // Templates: (hash, prompt, output); Zipf(1) popularity via the cumulative weights.
    let ntemp = cfg.templates.max(1);
    let templates: Vec<(u64, u32, u32)> = (0..ntemp)
        .map(|i| {
            let h = mix64(cfg.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i as u64 + 1));
            (h, shape.prompt(&mut rng), shape.output(&mut rng))
        })
        .collect();
    let mut cum = Vec::with_capacity(ntemp);
    let mut acc = 0.0;
    for i in 0..ntemp {
        acc += 1.0 / (i as f64 + 1.0);
        cum.push(acc);
    }

    let mut t = 0.0;
    let mut out = Vec::with_capacity(cfg.requests);
    for i in 0..cfg.requests {
        if i > 0 {
            t += gap.map_or(0.0, |g| g.sample(&mut arrivals));
        }
        let req = if rng.random::<f64>() < cfg.template_share {
            let u = rng.random::<f64>() * acc;
            let k = cum.partition_point(|&c| c < u).min(ntemp - 1);
            let (h, p, o) = templates[k];
            TraceRequest {
                arrival_ms: Some(t),
                prompt_tokens: p,
                output_tokens: shape.template_output(&mut rng, o),
                prompt_hash: Some(h),
                expected_output: None,
                class: None,
            }
        } else {
            TraceRequest {
                arrival_ms: Some(t),
                prompt_tokens: shape.prompt(&mut rng),
                output_tokens: shape.output(&mut rng),
                prompt_hash: Some(rng.random()),
                expected_output: None,
                class: None,
            }
        };
        out.push(req);
    }
    match kind {
        SynthKind::PaperProp => rescale_mean(&mut out, 3197.0, 1185.0, &shape),
        SynthKind::AdpShape => rescale_mean(&mut out, 803.0, 3653.0, &shape),
        SynthKind::PaperAzure => {}
    }
    out
}

/// Scales prompt and output lengths so the sample means hit the published ones (a lognormal
/// with sigma 1 and Zipf-popular templates makes the raw sample mean wander by several percent
/// between seeds). Uniform scaling keeps the shape and the template correlation.
fn rescale_mean(reqs: &mut [TraceRequest], prompt_mean: f64, output_mean: f64, shape: &Shape) {
    if reqs.is_empty() {
        return;
    }
    let n = reqs.len() as f64;
    let mp = reqs.iter().map(|r| f64::from(r.prompt_tokens)).sum::<f64>() / n;
    let mo = reqs.iter().map(|r| f64::from(r.output_tokens)).sum::<f64>() / n;
    let (fp, fo) = (prompt_mean / mp, output_mean / mo);
    for r in reqs {
        r.prompt_tokens = (f64::from(r.prompt_tokens) * fp)
            .round()
            .clamp(16.0, 32_768.0) as u32;
        r.output_tokens = shape.clamp_out(f64::from(r.output_tokens) * fo);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::summarize;

    fn within(x: f64, target: f64, rel: f64) -> bool {
        (x - target).abs() <= rel * target
    }

    #[test]
    fn paper_azure_matches_published_shape() {
        let reqs = generate(
            SynthKind::PaperAzure,
            &SynthConfig::new(SynthKind::PaperAzure),
        );
        let s = summarize(&reqs);
        assert_eq!(s.requests, 10_000);
        assert!(within(s.mean_prompt, 4652.0, 0.03), "{s:?}");
        assert!(within(s.mean_output, 1052.0, 0.02), "{s:?}");
        assert!(s.min_prompt >= 700 && s.max_prompt <= 8000, "{s:?}");
        assert!(s.min_output > 1000 && s.max_output <= 1500, "{s:?}");
        let near = reqs
            .iter()
            .filter(|r| (1001..=1060).contains(&r.output_tokens))
            .count();
        assert!(
            near as f64 > 0.8 * reqs.len() as f64,
            "most near 1024: {near}"
        );
        assert!(s.repeat_share > 0.2 && s.repeat_share < 0.35, "{s:?}");
        // Poisson at 5/s: 10k requests span about 2,000 s.
        assert!(within(s.span_ms, 2_000_000.0, 0.05), "{s:?}");
    }

    /// Heavy-tailed outputs: the median well below the mean, p99 several times it.
    fn assert_long_tailed_outputs(reqs: &[TraceRequest], mean_output: f64) {
        let mut o: Vec<u32> = reqs.iter().map(|r| r.output_tokens).collect();
        o.sort_unstable();
        let med = f64::from(o[o.len() / 2]);
        let p99 = f64::from(o[o.len() * 99 / 100]);
        assert!(med < 0.75 * mean_output, "median {med}");
        assert!(p99 > 4.0 * mean_output, "p99 {p99}");
    }

    #[test]
    fn paper_prop_matches_published_shape() {
        let reqs = generate(
            SynthKind::PaperProp,
            &SynthConfig::new(SynthKind::PaperProp),
        );
        let s = summarize(&reqs);
        assert_eq!(s.requests, 8_000);
        assert!(within(s.mean_prompt, 3197.0, 0.01), "{s:?}");
        assert!(within(s.mean_output, 1185.0, 0.01), "{s:?}");
        assert_long_tailed_outputs(&reqs, s.mean_output);
        assert!(s.min_output >= 2);
    }

    #[test]
    fn adp_shape_matches_published_shape() {
        let reqs = generate(SynthKind::AdpShape, &SynthConfig::new(SynthKind::AdpShape));
        let s = summarize(&reqs);
        assert_eq!(s.requests, 16_000);
        assert!(within(s.mean_prompt, 803.0, 0.01), "{s:?}");
        assert!(within(s.mean_output, 3653.0, 0.01), "{s:?}");
        assert_long_tailed_outputs(&reqs, s.mean_output);
        assert!(s.min_output >= 2 && s.max_output <= 32_768, "{s:?}");
        // prompts spread too, most within one chunk of 8,192 tokens
        let mut p: Vec<u32> = reqs.iter().map(|r| r.prompt_tokens).collect();
        p.sort_unstable();
        let (p10, p90) = (p[p.len() / 10], p[p.len() * 9 / 10]);
        assert!(p10 < 400 && p90 > 1300, "p10 {p10}, p90 {p90}");
        assert!(p[p.len() * 999 / 1000] < 8192);
        assert!(s.repeat_share > 0.2 && s.repeat_share < 0.35, "{s:?}");
        // the other generators are unchanged by its presence
        assert_eq!(
            SynthKind::from_name("adp-shape").map(SynthKind::name),
            Some("adp-shape")
        );
    }

    #[test]
    fn deterministic_and_templates_correlated() {
        let cfg = SynthConfig::new(SynthKind::PaperProp);
        let a = generate(SynthKind::PaperProp, &cfg);
        assert_eq!(a, generate(SynthKind::PaperProp, &cfg));
        let b = generate(SynthKind::PaperProp, &SynthConfig { seed: 7, ..cfg });
        assert_ne!(a, b);
        // Changing the rate moves timestamps only.
        let c = generate(
            SynthKind::PaperProp,
            &SynthConfig {
                rate_per_s: 50.0,
                ..cfg
            },
        );
        assert!(
            a.iter()
                .zip(&c)
                .all(|(x, y)| x.output_tokens == y.output_tokens && x.prompt_hash == y.prompt_hash)
        );
        assert!(c.last().and_then(|r| r.arrival_ms) < a.last().and_then(|r| r.arrival_ms));

        // Occurrences of the same hash: outputs correlate (within-group spread is far below the
        // overall spread), and the prompt length is identical.
        let mut groups: std::collections::HashMap<u64, Vec<&TraceRequest>> = Default::default();
        for r in &a {
            groups
                .entry(r.prompt_hash.unwrap_or(0))
                .or_default()
                .push(r);
        }
        let log = |r: &TraceRequest| f64::from(r.output_tokens).ln();
        let mean_all = a.iter().map(log).sum::<f64>() / a.len() as f64;
        let var_all = a.iter().map(|r| (log(r) - mean_all).powi(2)).sum::<f64>() / a.len() as f64;
        let (mut ss, mut n) = (0.0, 0usize);
        for g in groups.values().filter(|g| g.len() > 1) {
            assert!(g.iter().all(|r| r.prompt_tokens == g[0].prompt_tokens));
            let m = g.iter().map(|r| log(r)).sum::<f64>() / g.len() as f64;
            ss += g.iter().map(|r| (log(r) - m).powi(2)).sum::<f64>();
            n += g.len();
        }
        assert!(n > 1000);
        let var_within = ss / n as f64;
        assert!(var_within < 0.4 * var_all, "{var_within} vs {var_all}");
    }
}
