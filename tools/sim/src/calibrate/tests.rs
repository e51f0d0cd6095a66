use super::*;

#[test]
fn exact_line_is_recovered() {
    let text: String = std::iter::once("max_kv_tokens,step_ms\n".to_string())
        .chain((0..50).map(|i| {
            let x = 10_000.0 * f64::from(i);
            format!("{x},{}\n", 2e-4 * x + 30.0)
        }))
        .collect();
    let f = calibrate_text(Path::new("s.csv"), &text, true).expect("fit");
    assert!((f.a - 2e-4).abs() < 1e-12, "{f:?}");
    assert!((f.b - 30.0).abs() < 1e-9, "{f:?}");
    assert!((f.r2 - 1.0).abs() < 1e-12);
    assert_eq!(f.samples, 50);
    assert!(f.rejected.is_empty());
    assert!(f.render().contains("--step-a"));
}

#[test]
fn noisy_fit_is_close_and_r2_below_one() {
    // deterministic pseudo-noise in [-2, 2) ms
    let mut state = 12345u64;
    let mut noise = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((state >> 33) as f64 / f64::from(1u32 << 31)) * 4.0 - 2.0
    };
    let text: String = (0..2000)
        .map(|i| {
            let x = 500.0 * f64::from(i);
            format!("{x},{}\n", 1.5e-4 * x + 25.0 + noise())
        })
        .collect();
    let f = calibrate_text(Path::new("n.csv"), &text, false).expect("fit");
    assert!((f.a - 1.5e-4).abs() / 1.5e-4 < 0.01, "{f:?}");
    assert!((f.b - 25.0).abs() < 0.3, "{f:?}");
    assert!(f.r2 > 0.99 && f.r2 < 1.0, "{f:?}");
    assert!(f.rmse_ms > 0.5 && f.rmse_ms < 1.5, "{f:?}");
}

#[test]
fn bad_rows_are_rejected_with_line_numbers() {
    let text = "max_kv_tokens,step_ms\n100,30.02\nabc,1\n200,x\n# comment\n\n300\n-5,3\n400,NaN\n500,30.1\n";
    let f = calibrate_text(Path::new("b.csv"), text, false).expect("fit");
    let lines: Vec<u64> = f.rejected.iter().map(|r| r.line).collect();
    assert_eq!(lines, vec![3, 4, 7, 8, 9]);
    assert_eq!(f.samples, 2);
    let out = f.render();
    assert!(out.contains("rejected line 3"), "{out}");
    match calibrate_text(Path::new("b.csv"), text, true) {
        Err(CalibrateError::BadRow { line, .. }) => assert_eq!(line, 3),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn headerless_and_degenerate_inputs() {
    let f = calibrate_text(Path::new("h.csv"), "0,30\n1000,30.2\n", true).expect("fit");
    assert!((f.a - 2e-4).abs() < 1e-12);
    for text in [
        "",
        "max_kv_tokens,step_ms\n",
        "5,1\n",
        "5,1\n5,2\n",
        "x,y\nfoo,bar\n",
    ] {
        assert!(
            matches!(
                calibrate_text(Path::new("d.csv"), text, false),
                Err(CalibrateError::Degenerate { .. })
            ),
            "{text:?}"
        );
    }
    assert!(matches!(
        calibrate_file(Path::new("/nonexistent/samples.csv"), false),
        Err(CalibrateError::Io { .. })
    ));
}

#[test]
fn fixture_fits_its_generating_line() {
    // tests/fixtures/step_samples.csv: T = 1.8e-4·x + 27 + N(0, 1.5) with three bad rows
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/step_samples.csv");
    let f = calibrate_file(&p, false).expect("fit");
    let lines: Vec<u64> = f.rejected.iter().map(|r| r.line).collect();
    assert_eq!(lines, vec![13, 26, 31]);
    assert_eq!(f.samples, 40);
    assert!((f.a - 1.8e-4).abs() < 0.05 * 1.8e-4, "{f:?}");
    assert!((f.b - 27.0).abs() < 1.5, "{f:?}");
    assert!(f.r2 > 0.99, "{f:?}");
    assert!(calibrate_file(&p, true).is_err());
}

/// Deterministic pseudo-noise: uniform in [-1, 1) (an LCG; the same every run).
fn lcg(seed: u64) -> impl FnMut() -> f64 {
    let mut state = seed;
    move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((state >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }
}

/// `n` three-column samples of `T = a·M + c·N + b` + noise of amplitude `noise` ms, with N
/// in 8..=256 and 1,000..6,000 tokens per request.
fn three_column(n: usize, a: f64, c: f64, b: f64, noise: f64, seed: u64) -> String {
    let mut u = lcg(seed);
    let mut text = String::from("max_kv_tokens,max_running,step_ms\n");
    for _ in 0..n {
        let requests = (8.0 + 248.0 * (u() + 1.0) / 2.0).round();
        let tokens = (requests * (3_500.0 + 2_500.0 * u())).round();
        let t = a * tokens + c * requests + b + noise * u();
        text.push_str(&format!("{tokens},{requests},{t}\n"));
    }
    text
}

#[test]
fn the_three_term_fit_recovers_known_coefficients_within_their_standard_errors() {
    let text = three_column(400, 1.8e-4, 0.3, 25.0, 2.0, 7);
    let f = calibrate_text(Path::new("n.csv"), &text, true).expect("fit");
    assert_eq!(f.model, FitModel::WithRequests);
    let (se_a, se_c, se_b) = (f.se_a.unwrap(), f.se_c.unwrap(), f.se_b.unwrap());
    assert!((f.a - 1.8e-4).abs() < 4.0 * se_a, "{f:?}");
    assert!((f.c - 0.3).abs() < 4.0 * se_c, "{f:?}");
    assert!((f.b - 25.0).abs() < 4.0 * se_b, "{f:?}");
    // and the errors are small enough to mean something
    assert!(se_c < 0.02 && se_a < 5e-6, "{f:?}");
    assert_eq!(f.c_significant, Some(true));
    assert!(f.t_c.unwrap() > 10.0, "{f:?}");
    // the n term explains what the two-term fit leaves in its residuals
    assert!(f.two_term_rmse_ms.unwrap() > 2.0 * f.rmse_ms, "{f:?}");
    // uniform noise of amplitude 2 ms: rms 2/√3, never above 2
    assert!(f.rmse_ms > 0.9 && f.rmse_ms < 1.4, "{f:?}");
    assert!(f.max_abs_residual_ms < 2.5 && f.p95_abs_residual_ms <= f.max_abs_residual_ms);
    assert!((f.request_cost_tokens.unwrap() - f.c / f.a).abs() < 1e-9);
    let out = f.render();
    assert!(
        out.contains("--step-c") && out.contains("significant: the data asks"),
        "{out}"
    );
    assert!(out.contains("request_cost_tokens"), "{out}");
}

#[test]
fn c_zero_data_is_not_significant_and_matches_the_two_term_fit() {
    // noiseless c = 0: c comes out 0 and a, b are the two-term fit's
    let exact = three_column(50, 2e-4, 0.0, 30.0, 0.0, 3);
    let f = calibrate_text(Path::new("z.csv"), &exact, true).expect("fit");
    assert!(f.c.abs() < 1e-9, "{f:?}");
    assert!(
        (f.a - 2e-4).abs() < 1e-12 && (f.b - 30.0).abs() < 1e-6,
        "{f:?}"
    );
    // the same samples without the N column: the two-term fit, as before
    let two: String = exact
        .lines()
        .map(|l| {
            let v: Vec<&str> = l.split(',').collect();
            format!("{},{}\n", v[0], v[2])
        })
        .collect();
    let g = calibrate_text(Path::new("z2.csv"), &two, true).expect("fit");
    assert_eq!(g.model, FitModel::TwoTerm);
    assert_eq!((g.c, g.t_c, g.c_significant), (0.0, None, None));
    assert!((g.a - f.a).abs() < 1e-12 && (g.b - f.b).abs() < 1e-6);
    // noisy c = 0: the t statistic does not call it significant
    let noisy = three_column(400, 2e-4, 0.0, 30.0, 2.0, 11);
    let f = calibrate_text(Path::new("z3.csv"), &noisy, true).expect("fit");
    assert_eq!(f.c_significant, Some(false), "{f:?}");
    assert!(f.render().contains("not significant"));
}

#[test]
fn samples_that_cannot_identify_c_are_a_typed_error() {
    let p = Path::new("u.csv");
    // N constant
    let constant = "max_kv_tokens,max_running,step_ms\n100000,64,50\n200000,64,70\n300000,64,90\n400000,64,110\n";
    // N in lockstep with M (every request the same length)
    let lockstep = "max_kv_tokens,max_running,step_ms\n100000,10,50\n200000,20,70\n300000,30,90\n400000,40,110\n";
    // too few samples for three coefficients and a residual
    let few = "max_kv_tokens,max_running,step_ms\n100000,10,50\n200000,30,70\n300000,20,90\n";
    for (text, says) in [
        (constant, "same (64)"),
        (lockstep, "move together"),
        (few, "at least four"),
    ] {
        match calibrate_text(p, text, false) {
            Err(e @ CalibrateError::Unidentifiable { .. }) => {
                assert!(e.to_string().contains(says), "{e}")
            }
            other => panic!("{says}: unexpected {other:?}"),
        }
    }
    // a max_running header must name the other two columns
    match calibrate_text(p, "tokens,max_running,ms\n1,2,3\n", false) {
        Err(CalibrateError::BadHeader { line: 1, .. }) => {}
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn fixture_with_requests_fits_its_generating_plane() {
    // tests/fixtures/step_samples_n.csv: T = 1.8e-4·M + 0.3·N + 25 + N(0, 1), columns by
    // header name (an extra `step` column first), two bad rows
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/step_samples_n.csv");
    let f = calibrate_file(&p, false).expect("fit");
    let lines: Vec<u64> = f.rejected.iter().map(|r| r.line).collect();
    assert_eq!(lines, vec![20, 41]);
    assert_eq!(f.samples, 60);
    assert!((f.a - 1.8e-4).abs() < 4.0 * f.se_a.unwrap(), "{f:?}");
    assert!((f.c - 0.3).abs() < 4.0 * f.se_c.unwrap(), "{f:?}");
    assert!((f.b - 25.0).abs() < 4.0 * f.se_b.unwrap(), "{f:?}");
    assert_eq!(f.c_significant, Some(true));
    assert!(calibrate_file(&p, true).is_err());
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// Any plane, any noise draw: the fit lands within 5 standard errors of the truth (a
    /// miss of that size has odds of about one in 1.7 million per coefficient). b stays
    /// above the noise's bound (5 ms) so every step time is positive: with b from 1 ms a
    /// draw could make one negative, which the fit rightly refuses (seen once in CI's
    /// proptest draws: b = 1, noise = 4.6).
    #[test]
    fn the_fit_recovers_any_plane(
        a in 1e-5f64..1e-3,
        c in 0.0f64..1.0,
        b in 5.0f64..100.0,
        noise in 0.1f64..5.0,
        seed in proptest::prelude::any::<u64>(),
    ) {
        let text = three_column(200, a, c, b, noise, seed);
        let f = calibrate_text(Path::new("p.csv"), &text, true).expect("fit");
        proptest::prop_assert!((f.a - a).abs() <= 5.0 * f.se_a.unwrap(), "{:?}", f);
        proptest::prop_assert!((f.c - c).abs() <= 5.0 * f.se_c.unwrap(), "{:?}", f);
        proptest::prop_assert!((f.b - b).abs() <= 5.0 * f.se_b.unwrap(), "{:?}", f);
    }
}

#[test]
fn file_roundtrip() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("samples.csv");
    std::fs::write(&p, "max_kv_tokens,step_ms\n0,10\n100,20\n200,30\n").expect("write");
    let f = calibrate_file(&p, false).expect("fit");
    assert!((f.a - 0.1).abs() < 1e-12 && (f.b - 10.0).abs() < 1e-9);
}

/// `n` samples of colocated steps, `T = a·M + p·P (+ c·N) + b` + noise of amplitude `noise`:
/// half the steps prefill nothing, the others a chunk of 1..8,192 prompt tokens on the rank
/// that prefills the most; with `c`, a `max_running` column too.
fn prefill_columns(
    n: usize,
    a: f64,
    p: f64,
    c: Option<f64>,
    b: f64,
    noise: f64,
    seed: u64,
) -> String {
    let mut u = lcg(seed);
    let mut text = String::from(if c.is_some() {
        "max_kv_tokens,max_prefill_tokens,max_running,step_ms\n"
    } else {
        "step,max_kv_tokens,max_prefill_tokens,step_ms\n"
    });
    for k in 0..n {
        let requests = (8.0 + 248.0 * (u() + 1.0) / 2.0).round();
        let tokens = (requests * (3_500.0 + 2_500.0 * u())).round();
        let prefill = if k % 2 == 0 {
            0.0
        } else {
            (1.0 + 8_191.0 * (u() + 1.0) / 2.0).round()
        };
        let t = a * tokens + p * prefill + c.unwrap_or(0.0) * requests + b + noise * u();
        text.push_str(&match c {
            Some(_) => format!("{tokens},{prefill},{requests},{t}\n"),
            None => format!("{k},{tokens},{prefill},{t}\n"),
        });
    }
    text
}

#[test]
fn the_prefill_term_is_recovered_with_its_standard_error() {
    for c in [None, Some(0.3)] {
        let text = prefill_columns(400, 1.8e-4, 4e-3, c, 25.0, 2.0, 11);
        let f = calibrate_text(Path::new("p.csv"), &text, true).expect("fit");
        assert_eq!(f.model, FitModel::WithPrefill);
        let (se_a, se_p, se_b) = (f.se_a.unwrap(), f.se_p.unwrap(), f.se_b.unwrap());
        assert!((f.a - 1.8e-4).abs() < 4.0 * se_a, "{f:?}");
        assert!((f.p - 4e-3).abs() < 4.0 * se_p, "{f:?}");
        assert!((f.b - 25.0).abs() < 4.0 * se_b, "{f:?}");
        assert!(se_p < 1e-4, "{f:?}");
        assert_eq!(f.p_significant, Some(true));
        // P explains what the fit without it leaves (its chunks cost up to 33 ms)
        assert!(
            f.without_prefill_rmse_ms.unwrap() > 5.0 * f.rmse_ms,
            "{f:?}"
        );
        match c {
            Some(c) => {
                assert!((f.c - c).abs() < 4.0 * f.se_c.unwrap(), "{f:?}");
                assert_eq!(f.c_significant, Some(true));
            }
            None => assert!(f.se_c.is_none() && f.c == 0.0, "{f:?}"),
        }
        let out = f.render();
        assert!(out.contains("--colocated --step-p"), "{out}");
        assert!(
            out.contains("significant: the data asks for the prefill term"),
            "{out}"
        );
        assert_eq!(out.contains("--step-c"), c.is_some(), "{out}");
    }
}

#[test]
fn prefill_samples_that_cannot_identify_p_are_a_typed_error() {
    let path = Path::new("u.csv");
    // no step prefilled anything (a decode tier's log): p cannot be fitted
    let none = "max_kv_tokens,max_prefill_tokens,step_ms\n100000,0,50\n200000,0,70\n300000,0,90\n400000,0,110\n500000,0,130\n";
    // prefill in lockstep with the KV read
    let lockstep = "max_kv_tokens,max_prefill_tokens,step_ms\n100000,100,50\n200000,200,70\n300000,300,90\n400000,400,110\n500000,500,130\n";
    for (text, says) in [
        (none, "max_prefill_tokens is the same (0)"),
        (lockstep, "moves with"),
    ] {
        match calibrate_text(path, text, false) {
            Err(e @ CalibrateError::Unidentifiable { .. }) => {
                assert!(e.to_string().contains(says), "{e}")
            }
            other => panic!("{says}: unexpected {other:?}"),
        }
    }
    // a negative prefill count is a rejected row, with its line
    let text = prefill_columns(50, 1e-4, 1e-3, None, 20.0, 0.5, 3) + "1000,5000,-1,30\n";
    let f = calibrate_text(path, &text, false).expect("fit");
    assert_eq!(f.rejected.len(), 1);
    assert_eq!(f.rejected[0].line, 52);
    assert!(calibrate_text(path, &text, true).is_err());
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// The general least squares agrees with the plane's closed form on any plane's samples.
    #[test]
    fn the_general_fit_agrees_with_the_plane(
        a in 1e-5f64..1e-3,
        c in 0.0f64..1.0,
        b in 5.0f64..100.0,
        noise in 0.1f64..5.0,
        seed in proptest::prelude::any::<u64>(),
    ) {
        let text = three_column(100, a, c, b, noise, seed);
        let parsed = parse(Path::new("g.csv"), &text).expect("parse");
        let triples: Vec<(f64, f64, f64)> = parsed.samples.iter()
            .map(|s| (s.max_kv_tokens, s.max_running.unwrap_or(0.0), s.step_ms)).collect();
        let rows: Vec<Vec<f64>> = triples.iter().map(|&(x, z, y)| vec![x, z, y]).collect();
        let plane = fit_plane(&triples).expect("plane");
        let ols = fit_ols(&rows, &["max_kv_tokens", "max_running"]).expect("ols");
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-6 * x.abs().max(y.abs()).max(1e-9);
        let se = ols.se.clone().expect("se");
        proptest::prop_assert!(close(plane.a, ols.coef[0]) && close(plane.c, ols.coef[1]), "{:?} {:?}", plane, ols);
        proptest::prop_assert!(close(plane.b, ols.b) && close(plane.rmse, ols.rmse), "{:?} {:?}", plane, ols);
        proptest::prop_assert!(close(plane.se_a.unwrap(), se[0]) && close(plane.se_c.unwrap(), se[1]), "{:?} {:?}", plane, ols);
        proptest::prop_assert!(close(plane.se_b.unwrap(), ols.se_b.unwrap()), "{:?} {:?}", plane, ols);
    }
}
