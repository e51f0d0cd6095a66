use super::progress::ProgressCounts;
use super::request::{assign_params, hint_sent, sse_events};
use super::*;

#[test]
fn several_twin_runs_of_a_policy_are_shown_as_their_mean_and_spread() {
    let twin = |policy: &str, imbalance: f64, tok_s: f64| br_sim::report::RunReport {
        policy: policy.into(),
        workers: 8,
        avg_imbalance: imbalance,
        avg_barrier_idle: 0.0,
        throughput_tok_s: tok_s,
        steady_throughput_tok_s: tok_s,
        fluid_throughput_tok_s: tok_s,
        tpot_p50_ms: 48.0,
        tpot_p95_ms: 50.0,
        ttft_p50_ms: 0.0,
        ttft_p95_ms: 0.0,
        ttft_p99_ms: 0.0,
        avg_balance: 0.0,
        mean_queue_ms: 0.0,
        steps: 10,
        requests: 10,
    };
    let rep = br_sim::report::Report {
        runs: vec![
            twin("jsq", 20_000.0, 2_400.0),
            twin("br0", 9_000.0, 2_450.0),
            twin("jsq", 24_000.0, 2_300.0),
        ],
    };
    let live = |label: &str, imbalance: f64| Summary {
        label: label.into(),
        imbalance_tokens: Some(imbalance),
        throughput_tok_s: 2_350.0,
        ..Default::default()
    };
    let jsq: Vec<_> = rep.runs.iter().filter(|r| r.policy == "jsq").collect();
    let band = TwinBand::of(&jsq).expect("two runs");
    assert_eq!(band.n, 2);
    assert_eq!(band.imbalance.mean, 22_000.0);
    // sample standard deviation of {20000, 24000}: 2000·√2
    assert!((band.imbalance.sd - 2_000.0 * 2f64.sqrt()).abs() < 1e-6);
    assert_eq!(band.tpot_p50.sd, 0.0);
    assert!(TwinBand::of(&[]).is_none());

    let text = table(&[live("jsq", 22_000.0), live("br0", 9_900.0)], Some(&rep));
    let lines: Vec<&str> = text.lines().collect();
    // jsq: its two twin runs' mean, "n=2", a spread line, and the live run at +0%
    let jsq_sim = lines
        .iter()
        .position(|l| l.contains("br-sim"))
        .expect("sim row");
    assert!(
        lines[jsq_sim].contains("22000") && lines[jsq_sim].contains("n=2"),
        "{text}"
    );
    assert!(
        lines[jsq_sim + 1].contains("sim sd") && lines[jsq_sim + 1].contains("±12.9%"),
        "{text}"
    );
    assert!(
        lines[jsq_sim + 2].contains("live/sim") && lines[jsq_sim + 2].contains("+0%"),
        "{text}"
    );
    // br0: one twin run, no spread line, live 10% above it
    let br0_sim = lines
        .iter()
        .rposition(|l| l.contains("br-sim"))
        .expect("sim row");
    assert!(!lines[br0_sim].contains("n="), "{text}");
    assert!(
        lines[br0_sim + 1].contains("live/sim") && lines[br0_sim + 1].contains("+10%"),
        "{text}"
    );
}

#[test]
fn the_balance_ratio_is_shown_live_beside_the_twin_s() {
    let twin = |balance: f64| br_sim::report::RunReport {
        policy: "brc".into(),
        workers: 8,
        avg_imbalance: 1_000.0,
        avg_barrier_idle: 0.0,
        throughput_tok_s: 2_000.0,
        steady_throughput_tok_s: 2_000.0,
        fluid_throughput_tok_s: 2_000.0,
        tpot_p50_ms: 48.0,
        tpot_p95_ms: 50.0,
        ttft_p50_ms: 0.0,
        ttft_p95_ms: 0.0,
        ttft_p99_ms: 0.0,
        avg_balance: balance,
        mean_queue_ms: 0.0,
        steps: 10,
        requests: 10,
    };
    let rep = br_sim::report::Report {
        runs: vec![twin(0.70), twin(0.74)],
    };
    let live = Summary {
        label: "brc".into(),
        imbalance_tokens: Some(1_000.0),
        balance_ratio: Some(0.792),
        throughput_tok_s: 2_000.0,
        ..Default::default()
    };
    let text = table(std::slice::from_ref(&live), Some(&rep));
    let lines: Vec<&str> = text.lines().collect();
    let col = |l: &str, source: &str| -> Vec<String> {
        let at = l.find(source).expect("source") + source.len();
        l[at..].split_whitespace().map(str::to_owned).collect()
    };
    assert!(lines[0].contains("balance%"), "{text}");
    let row = |source: &str| {
        lines
            .iter()
            .find(|l| l.contains(source))
            .map(|l| col(l, source))
            .expect(source)
    };
    // the column after imbalance: live 79.2%, the twin's mean 72.0% (sd 0.028 / 0.72 = 3.9%),
    // live 10% above it
    assert_eq!(row("live")[1], "79.2", "{text}");
    assert_eq!(row("br-sim")[1], "72.0", "{text}");
    assert_eq!(row("sim sd")[1], "±3.9%", "{text}");
    assert_eq!(row("live/sim")[1], "+10%", "{text}");
    // a twin report from before br-sim computed it (read as 0), or an engine that did not list
    // it: a dash
    let old = br_sim::report::Report {
        runs: vec![twin(0.0)],
    };
    let text = table(
        &[Summary {
            balance_ratio: None,
            ..live
        }],
        Some(&old),
    );
    assert!(!text.contains("NaN"), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(col(lines[1], "live")[1], "-", "{text}");
    assert_eq!(col(lines[2], "br-sim")[1], "-", "{text}");
}

#[test]
fn figures_a_real_engine_does_not_report_print_as_a_dash_never_nan() {
    // A load against a real engine has no σ-side imbalance or step time in the load tool's view.
    let live = |label: &str, p95: f64| Summary {
        label: label.into(),
        imbalance_tokens: None,
        mean_step_ms: None,
        throughput_tok_s: 1_000.0,
        tpot_ms: Pct {
            p50: 20.0,
            p95,
            ..Default::default()
        },
        ..Default::default()
    };
    let text = table(&[live("jsq", 20.0), live("br0", 22.0)], None);
    assert!(!text.contains("NaN"), "{text}");
    let jsq = text
        .lines()
        .find(|l| l.starts_with("jsq"))
        .expect("jsq row");
    assert_eq!(jsq.split_whitespace().nth(2), Some("-"), "{text}");
    assert!(
        text.contains("br0 vs jsq: imbalance -, TPOT p95 +10.0%"),
        "{text}"
    );
}

#[test]
fn the_arrivals_csv_is_a_trace_br_sim_reads_back_in_arrival_order() {
    let r = |id: &str,
             arrival: Option<f64>,
             prompt: u32,
             out: u32,
             hash: Option<u64>,
             hint: Option<u32>| RequestResult {
        request_id: id.into(),
        prompt_tokens: prompt,
        output_tokens: out,
        arrival_ms: arrival,
        prompt_hash: hash,
        expected_output: hint,
        ..RequestResult::default()
    };
    // out of order, one never assigned, one with a prompt hash, two with a hint
    let results = vec![
        r("b", Some(250.5), 200, 20, None, Some(17)),
        r("never", None, 999, 9, None, Some(9)),
        r("a", Some(0.25), 100, 10, Some(42), None),
        r("c", Some(1_000.0), 300, 30, Some(7), Some(30)),
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("arrivals.csv");
    std::fs::write(&path, arrivals_csv(&results)).unwrap();
    let t = trace::load(&path, &Filter::default()).unwrap();
    type Row = (Option<f64>, u32, u32, Option<u64>, Option<u32>);
    let got: Vec<Row> = t
        .requests
        .iter()
        .map(|q| {
            (
                q.arrival_ms,
                q.prompt_tokens,
                q.output_tokens,
                q.prompt_hash,
                q.expected_output,
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (Some(0.25), 100, 10, Some(42), None),
            (Some(250.5), 200, 20, None, Some(17)),
            (Some(1_000.0), 300, 30, Some(7), Some(30)),
        ]
    );
}

#[test]
fn the_arrivals_csv_carries_the_class_each_assign_was_sent_with() {
    let r = |id: &str, arrival: f64, class: Option<&str>| RequestResult {
        request_id: id.into(),
        prompt_tokens: 10,
        output_tokens: 20,
        arrival_ms: Some(arrival),
        request_class: class.map(str::to_string),
        ..RequestResult::default()
    };
    let results = vec![
        r("a", 0.0, Some("c3")),
        r("b", 1.0, None),
        r("c", 2.0, Some("tenant,\"x\"")),
    ];
    let csv = arrivals_csv(&results);
    assert!(csv.starts_with(
        "arrival_ms,prompt_tokens,output_tokens,prompt_hash,expected_output_tokens,request_class\n"
    ));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("arrivals.csv");
    std::fs::write(&path, csv).unwrap();
    let t = trace::load(&path, &Filter::default()).unwrap();
    let keys: Vec<Option<&str>> = t
        .requests
        .iter()
        .map(|q| q.class.as_ref().map(br_sim::trace::Class::key))
        .collect();
    assert_eq!(keys, vec![Some("c3"), None, Some("tenant,\"x\"")]);
    // without any class the file is as it was before the column existed
    let plain = arrivals_csv(&[r("a", 0.0, None)]);
    assert_eq!(
        plain,
        "arrival_ms,prompt_tokens,output_tokens,prompt_hash,expected_output_tokens\n0.000,10,20,,\n"
    );
}

#[test]
fn an_assign_carries_the_request_s_class_key_when_it_has_one() {
    let r = |class: Option<&str>| TraceRequest {
        arrival_ms: Some(0.0),
        prompt_tokens: 5,
        output_tokens: 40,
        prompt_hash: Some(9),
        expected_output: Some(30),
        class: class.map(|k| br_sim::trace::Class::new(k).unwrap()),
    };
    let p = assign_params("g", "id-1", &r(Some("c5")));
    assert_eq!(p.request_class.as_deref(), Some("c5"));
    assert_eq!(
        (p.prompt_hash, p.max_tokens, p.expected_output_tokens),
        (Some(9), Some(40), Some(30))
    );
    assert_eq!(assign_params("g", "id-1", &r(None)).request_class, None);
}

#[test]
fn the_hint_sent_and_recorded_is_capped_at_max_tokens() {
    // br-sim replays the recorded hint as is, so it must be the value the Assign carried, not
    // the drawn one (which may exceed the request's max_tokens and is capped before sending).
    let req = |out: u32, hint: Option<u32>| TraceRequest {
        arrival_ms: Some(0.0),
        prompt_tokens: 5,
        output_tokens: out,
        prompt_hash: None,
        expected_output: hint,
        class: None,
    };
    assert_eq!(hint_sent(&req(100, None)), None);
    assert_eq!(hint_sent(&req(100, Some(80))), Some(80));
    assert_eq!(hint_sent(&req(100, Some(130))), Some(100));
    assert_eq!(hint_sent(&req(100, Some(0))), Some(1));
}

/// The `data` of every event parsed from `body` cut into chunks at `cuts`.
fn parse(body: &[u8], cuts: &[usize]) -> Vec<String> {
    let mut chunks = Vec::new();
    let mut at = 0;
    for &c in cuts.iter().chain([&body.len()]) {
        chunks.push(Ok::<_, std::convert::Infallible>(Bytes::copy_from_slice(
            &body[at..c],
        )));
        at = c;
    }
    futures::executor::block_on(
        sse_events(futures::stream::iter(chunks))
            .map(|e| e.map(|e| e.data).unwrap_or_else(|e| format!("error: {e}")))
            .collect(),
    )
}

#[test]
fn sse_parses_lf_crlf_and_cr_framing_split_anywhere() {
    let want = vec![
        r#"{"choices":[{"text":"a"}]}"#.to_string(),
        r#"{"choices":[],"usage":{"completion_tokens":1}}"#.to_string(),
        "[DONE]".to_string(),
    ];
    for eol in ["\n", "\r\n", "\r"] {
        let body: String = want
            .iter()
            .map(|d| format!("data: {d}{eol}{eol}"))
            .collect();
        let body = body.as_bytes();
        assert_eq!(parse(body, &[]), want, "{eol:?} in one chunk");
        // Every cut, including between the CR and the LF of a CRLF.
        for cut in 1..body.len() {
            assert_eq!(parse(body, &[cut]), want, "{eol:?} cut at {cut}");
        }
        let bytewise: Vec<usize> = (1..body.len()).collect();
        assert_eq!(parse(body, &bytewise), want, "{eol:?} byte by byte");
    }
    // The old splitter only knew "\n\n" and a "data: " at the very start of an event:
    // comments, other fields and multi-line data are SSE too.
    let body = b": keep-alive\r\nevent: message\r\ndata: x\r\ndata: y\r\n\r\n";
    assert_eq!(parse(body, &[]), vec!["x\ny".to_string()]);
}

#[test]
fn the_progress_line_counts_and_rates() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = ProgressCounts::default();
    c.done.store(30, Relaxed);
    c.failed.store(2, Relaxed);
    c.tokens.store(5000, Relaxed);
    assert_eq!(
        c.line(100, Duration::from_secs(10)),
        "10s: 30/100 done, 2 failed, 70 to go, 500 tokens/s"
    );
}

#[test]
fn percentiles() {
    let p = Pct::of((1..=100).map(f64::from).collect());
    assert_eq!((p.p50, p.p95), (50.0, 95.0));
    assert_eq!(Pct::of(vec![]), Pct::default());
}

/// A load of 200 paper-prop requests (seed 7) that never reaches a server: for the tests of
/// what the workload carries.
fn workload_config(
    hints: Option<br_sim::hints::Hints>,
    classes: Option<br_sim::classes::Classes>,
) -> LoadConfig {
    LoadConfig {
        decision_addrs: vec!["http://127.0.0.1:1".into()],
        selection: br_client::assign::Selection::default(),
        tls: None,
        group: "g".into(),
        rank_urls: vec!["http://127.0.0.1:2".into()],
        use_endpoint: false,
        engine_url: None,
        trace: "paper-prop".into(),
        limit: Some(200),
        filter_min_output: None,
        seed: 7,
        hints,
        classes,
        arrival: Arrival::Saturated,
        rate: None,
        rate_scale: 1.0,
        model: "m".into(),
        assign_timeout: Duration::from_secs(1),
        label: "t".into(),
        run_id: "r".into(),
    }
}

#[test]
fn the_workload_carries_the_hints_asked_for_and_none_otherwise() {
    let cfg = |hints| workload_config(hints, None);
    let (_, none) = workload(&cfg(None)).unwrap();
    assert!(none.iter().all(|r| r.expected_output.is_none()));
    let exact = br_sim::hints::Hints::from_flags(Some(0.0), None).unwrap();
    let (_, hinted) = workload(&cfg(exact)).unwrap();
    assert_eq!(hinted.len(), 200);
    assert!(
        hinted
            .iter()
            .all(|r| r.expected_output == Some(r.output_tokens.max(1)))
    );
    let noisy = br_sim::hints::Hints::from_flags(Some(0.5), None).unwrap();
    let (_, noisy) = workload(&cfg(noisy)).unwrap();
    let off = noisy
        .iter()
        .filter(|r| r.expected_output != Some(r.output_tokens))
        .count();
    assert!(off > 150, "σ = 0.5 moves nearly every hint: {off} of 200");
}

#[test]
fn the_workload_carries_the_classes_asked_for_as_br_sim_makes_them() {
    let cfg = |classes| workload_config(None, classes);
    let (_, none) = workload(&cfg(None)).unwrap();
    assert!(none.iter().all(|r| r.class.is_none()));
    let classes = br_sim::classes::Classes::from_flags(Some(4), Some(0.3), None).unwrap();
    let (_, classed) = workload(&cfg(classes)).unwrap();
    // br-sim with the same flags and seed gives every request the same class
    let mut want = none.clone();
    classes.unwrap().apply(&mut want, 7);
    let keys = |v: &[TraceRequest]| -> Vec<Option<String>> {
        v.iter()
            .map(|r| r.class.as_ref().map(|c| c.key().to_string()))
            .collect()
    };
    assert_eq!(keys(&classed), keys(&want));
    assert!(
        keys(&classed)
            .iter()
            .all(|k| k.as_deref().is_some_and(|k| k.starts_with('c')))
    );
}
