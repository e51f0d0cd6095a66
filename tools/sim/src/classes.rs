//! Request classes made from the true output lengths (`--classes`, `--class-error`,
//! `--class-mode`), for measuring what a gateway's class labels are worth to a policy that
//! learns per class: how much of the output length a class can tell, from all of what K
//! classes can tell (their K quantiles) down to nothing (random labels).
//!
//! Separate from the loaders, as the hints are: a class is not in any public trace, it is a
//! model of the labels a gateway could send (a template, tenant or tool-use key), applied to
//! whichever workload was loaded.

use clap::ValueEnum;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_distr::{Distribution, StandardNormal};

use crate::trace::{Class, TraceRequest};

/// Fewest and most classes `--classes` takes.
pub const CLASS_COUNTS: std::ops::RangeInclusive<u32> = 2..=256;

/// How the classes are made from the true output lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ClassMode {
    /// Each request's class is the bucket of `ln(output) + σ·N(0, 1)` among K equal-count
    /// quantile buckets of those noisy values (σ = `--class-error`; 0: the K quantiles of the
    /// output length, the most a K-class label can tell).
    Noisy,
    /// The same K equal-count classes dealt to the requests at random: labels that tell
    /// nothing, with the same count and sizes.
    Random,
}

/// The classes of a run: how many, how they are made, and the noise of the noisy mode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Classes {
    /// K.
    pub count: u32,
    pub mode: ClassMode,
    /// σ of the noise on ln(output) (noisy mode).
    pub sigma: f64,
}

impl Classes {
    /// What the three flags ask for: no classes without `--classes`; `--class-error` and
    /// `--class-mode` only with it; `--class-error` only in the noisy mode. An error message
    /// naming the flag for values that do not fit.
    pub fn from_flags(
        count: Option<u32>,
        sigma: Option<f64>,
        mode: Option<ClassMode>,
    ) -> Result<Option<Classes>, String> {
        let Some(count) = count else {
            if sigma.is_some() || mode.is_some() {
                return Err(
                    "--class-error and --class-mode shape the classes of --classes K, \
                            which is not given"
                        .into(),
                );
            }
            return Ok(None);
        };
        if !CLASS_COUNTS.contains(&count) {
            return Err(format!(
                "--classes must be in {}..={}, got {count}",
                CLASS_COUNTS.start(),
                CLASS_COUNTS.end()
            ));
        }
        if let Some(s) = sigma
            && !(s.is_finite() && (0.0..=10.0).contains(&s))
        {
            return Err(format!(
                "--class-error must be finite and in [0, 10], got {s}"
            ));
        }
        let mode = mode.unwrap_or(ClassMode::Noisy);
        if mode == ClassMode::Random && sigma.is_some() {
            return Err(
                "--class-error does not apply to --class-mode random (the classes \
                        are dealt at random)"
                    .into(),
            );
        }
        Ok(Some(Classes {
            count,
            mode,
            sigma: sigma.unwrap_or(0.0),
        }))
    }

    /// The key of class `k`: `c{k}`, so a live run sending that key names the same class.
    pub fn key(k: u32) -> String {
        format!("c{k}")
    }

    /// For the workload line, with the share of Var[ln output] the classes explain.
    pub fn describe(&self, explained: Option<f64>) -> String {
        let how = match self.mode {
            ClassMode::Noisy => format!("{} noisy (σ {})", self.count, self.sigma),
            ClassMode::Random => format!("{} random", self.count),
        };
        format!("classes: {how}, {}", describe_share(explained))
    }

    /// Sets every request's class, drawn from `seed` (the same seed and requests give the same
    /// classes).
    pub fn apply(&self, requests: &mut [TraceRequest], seed: u64) {
        let n = requests.len();
        if n == 0 {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xc1a5_5e5e_0000_0000);
        let noisy: Vec<f64> = requests
            .iter()
            .map(|r| {
                let x = f64::from(r.output_tokens.max(1)).ln();
                if self.mode == ClassMode::Noisy && self.sigma > 0.0 {
                    let z: f64 = StandardNormal.sample(&mut rng);
                    x + self.sigma * z
                } else {
                    x
                }
            })
            .collect();
        // Equal-count buckets: the request of rank i (by noisy value, ties by position) is in
        // bucket ⌊i·K/n⌋.
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| noisy[a].total_cmp(&noisy[b]).then(a.cmp(&b)));
        let k = u64::from(self.count);
        let mut bucket_of_rank: Vec<u32> =
            (0..n as u64).map(|i| (i * k / n as u64) as u32).collect();
        if self.mode == ClassMode::Random {
            bucket_of_rank.shuffle(&mut rng);
        }
        let classes: Vec<Class> = (0..self.count)
            .map(|b| Class::new(&Self::key(b)).expect("c{k} is a valid key"))
            .collect();
        for (rank, &i) in order.iter().enumerate() {
            requests[i].class = Some(classes[bucket_of_rank[rank] as usize].clone());
        }
    }
}

/// The share of the variance of ln(output) the requests' classes explain: 1 − (pooled
/// within-class variance) / (total variance), over the requests that have a class. `None`
/// when fewer than two requests have one or their outputs are all the same length (nothing
/// to explain).
pub fn explained_share(requests: &[TraceRequest]) -> Option<f64> {
    let with: Vec<(u64, f64)> = requests
        .iter()
        .filter_map(|r| Some((r.class_id()?, f64::from(r.output_tokens.max(1)).ln())))
        .collect();
    if with.len() < 2 {
        return None;
    }
    let mean = with.iter().map(|&(_, x)| x).sum::<f64>() / with.len() as f64;
    let total: f64 = with.iter().map(|&(_, x)| (x - mean).powi(2)).sum();
    if total <= 0.0 {
        return None;
    }
    let mut by_class: std::collections::HashMap<u64, (f64, f64, usize)> = Default::default();
    for &(c, x) in &with {
        let e = by_class.entry(c).or_default();
        e.0 += x;
        e.1 += x * x;
        e.2 += 1;
    }
    // Σ_c Σ (x − mean_c)² = Σ_c (Σx² − (Σx)²/n_c)
    let within: f64 = by_class
        .values()
        .map(|&(s, ss, m)| (ss - s * s / m as f64).max(0.0))
        .sum();
    Some((1.0 - within / total).clamp(0.0, 1.0))
}

/// "explaining 62.3% of Var[ln output]", or why there is no share.
pub fn describe_share(explained: Option<f64>) -> String {
    match explained {
        Some(s) => format!("explaining {:.1}% of Var[ln output]", 100.0 * s),
        None => "explaining nothing (the outputs do not vary)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{self, SynthConfig, SynthKind};

    fn workload(n: usize, seed: u64) -> Vec<TraceRequest> {
        let mut cfg = SynthConfig::new(SynthKind::PaperProp);
        cfg.requests = n;
        cfg.seed = seed;
        synth::generate(SynthKind::PaperProp, &cfg)
    }

    fn classed(c: Classes, reqs: &[TraceRequest], seed: u64) -> Vec<TraceRequest> {
        let mut r = reqs.to_vec();
        c.apply(&mut r, seed);
        r
    }

    fn ids(reqs: &[TraceRequest]) -> Vec<u64> {
        reqs.iter()
            .map(|r| r.class_id().expect("a class"))
            .collect()
    }

    fn noisy(count: u32, sigma: f64) -> Classes {
        Classes {
            count,
            mode: ClassMode::Noisy,
            sigma,
        }
    }

    #[test]
    fn flags_give_no_classes_by_default_and_refuse_nonsense() {
        assert_eq!(Classes::from_flags(None, None, None), Ok(None));
        let c = Classes::from_flags(Some(8), None, None)
            .expect("ok")
            .expect("classes");
        assert_eq!(c, noisy(8, 0.0));
        let c = Classes::from_flags(Some(2), Some(0.5), Some(ClassMode::Noisy))
            .expect("ok")
            .expect("classes");
        assert_eq!(c, noisy(2, 0.5));
        let c = Classes::from_flags(Some(256), None, Some(ClassMode::Random))
            .expect("ok")
            .expect("classes");
        assert_eq!((c.count, c.mode), (256, ClassMode::Random));
        for (k, s, m, flag) in [
            (Some(1), None, None, "--classes"),
            (Some(0), None, None, "--classes"),
            (Some(257), None, None, "--classes"),
            (None, Some(0.5), None, "--classes"),
            (None, None, Some(ClassMode::Random), "--classes"),
            (Some(8), Some(-0.1), None, "--class-error"),
            (Some(8), Some(f64::NAN), None, "--class-error"),
            (Some(8), Some(f64::INFINITY), None, "--class-error"),
            (Some(8), Some(10.5), None, "--class-error"),
            (
                Some(8),
                Some(0.5),
                Some(ClassMode::Random),
                "--class-mode random",
            ),
        ] {
            let e = Classes::from_flags(k, s, m).expect_err("refused");
            assert!(e.contains(flag), "{k:?} {s:?} {m:?}: {e}");
        }
    }

    #[test]
    fn k_equal_classes_named_c0_to_ck_and_seeded() {
        let reqs = workload(3000, 7);
        for c in [
            noisy(8, 0.0),
            noisy(8, 0.7),
            Classes {
                count: 8,
                mode: ClassMode::Random,
                sigma: 0.0,
            },
        ] {
            let a = classed(c, &reqs, 1);
            let mut counts: std::collections::HashMap<u64, usize> = Default::default();
            for id in ids(&a) {
                *counts.entry(id).or_default() += 1;
            }
            let mut keys: Vec<u64> = counts.keys().copied().collect();
            keys.sort_unstable();
            let mut want: Vec<u64> = (0..8)
                .map(|k| br_core::class_id(&format!("c{k}")))
                .collect();
            want.sort_unstable();
            assert_eq!(keys, want, "{c:?}: the classes are c0..c7");
            assert!(counts.values().all(|&m| m == 375), "{c:?}: {counts:?}");
            assert_eq!(ids(&a), ids(&classed(c, &reqs, 1)), "{c:?}: seeded");
            if c.sigma > 0.0 || c.mode == ClassMode::Random {
                assert_ne!(ids(&a), ids(&classed(c, &reqs, 2)), "{c:?}: another seed");
            }
        }
        // Exact classes are the quantiles: a longer output is never in a lower class.
        let a = classed(noisy(4, 0.0), &reqs, 1);
        let rank = |r: &TraceRequest| {
            (0..4)
                .find(|&k| r.class_id() == Some(br_core::class_id(&Classes::key(k))))
                .expect("c0..c3")
        };
        let mut by_output: Vec<(u32, u32)> = a.iter().map(|r| (r.output_tokens, rank(r))).collect();
        by_output.sort_unstable();
        assert!(by_output.windows(2).all(|w| w[0].1 <= w[1].1));
    }

    #[test]
    fn the_explained_share_falls_with_the_noise_and_is_nil_for_random_classes() {
        let reqs = workload(4000, 3);
        let share = |c: Classes| explained_share(&classed(c, &reqs, 5)).expect("a share");
        let exact = share(noisy(8, 0.0));
        let some = share(noisy(8, 0.5));
        let much = share(noisy(8, 2.0));
        let random = share(Classes {
            count: 8,
            mode: ClassMode::Random,
            sigma: 0.0,
        });
        // 8 quantile classes of a roughly log-normal output explain most of its log-variance;
        // noise on ln(output) of 2 (its own σ is about 1) leaves about a fifth of that.
        assert!(exact > 0.85, "{exact}");
        assert!(exact > some && some > much, "{exact} {some} {much}");
        assert!(much < 0.4 && much > 0.05, "{much}");
        assert!(random < 0.01, "{random}");
        assert_eq!(explained_share(&reqs), None, "no classes, no share");
    }

    #[test]
    fn the_share_is_one_minus_the_pooled_within_class_variance() {
        let req = |o: u32, key: &str| TraceRequest {
            arrival_ms: None,
            prompt_tokens: 1,
            output_tokens: o,
            prompt_hash: None,
            expected_output: None,
            class: Some(Class::new(key).expect("key")),
        };
        // ln outputs 0, 2 in class a and 0, 2 in class b: the classes explain nothing; 0, 0 and
        // 2, 2: everything; a request without a class does not count.
        let e2 = (2.0f64).exp().round() as u32;
        let none = [req(1, "a"), req(e2, "a"), req(1, "b"), req(e2, "b")];
        assert!(explained_share(&none).expect("share") < 1e-12);
        let mut all = vec![req(1, "a"), req(1, "a"), req(e2, "b"), req(e2, "b")];
        assert!((explained_share(&all).expect("share") - 1.0).abs() < 1e-12);
        all.push(TraceRequest {
            class: None,
            ..req(100, "x")
        });
        assert!((explained_share(&all).expect("share") - 1.0).abs() < 1e-12);
        assert_eq!(explained_share(&[req(5, "a"), req(5, "b")]), None);
        assert!(describe_share(Some(0.6234)).contains("62.3%"));
    }
}
