//! End-to-end tests of the `br-sim` binary (small workloads; no network).

use std::path::Path;
use std::process::{Command, Output};

fn br_sim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_br-sim"))
        .args(args)
        .output()
        .expect("run br-sim")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn run_writes_table_json_and_figure() {
    let dir = tempfile::tempdir().expect("tmp");
    let json = dir.path().join("out.json");
    let figs = dir.path().join("figs");
    let out = br_sim(&[
        "--trace",
        "paper-azure",
        "--workers",
        "4",
        "--slots",
        "32",
        "--limit",
        "300",
        "--policies",
        "jsq,br0",
        "--json",
        json.to_str().expect("utf8"),
        "--plot",
        figs.to_str().expect("utf8"),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("paper-azure (synthetic)"), "{stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("br0 ")), "{stdout}");
    // the line after the table's last row says what each column is
    let lines: Vec<&str> = stdout.lines().collect();
    let last_row = lines
        .iter()
        .rposition(|l| l.starts_with("br0 ") || l.starts_with("jsq "))
        .expect("table rows");
    let legend = lines.get(last_row + 1).copied().unwrap_or_default();
    assert!(legend.starts_with("columns: "), "{stdout}");
    for col in [
        "imbalance",
        "barrier_idle",
        "gain%",
        "gap%",
        "s.gap%",
        "queue_ms",
    ] {
        assert!(legend.contains(col), "{col}: {legend}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("parse");
    let runs = v["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2);
    for r in runs {
        for k in [
            "policy",
            "workers",
            "avg_imbalance",
            "avg_barrier_idle",
            "throughput_tok_s",
            "steady_throughput_tok_s",
            "fluid_throughput_tok_s",
            "tpot_p50_ms",
            "tpot_p95_ms",
            "ttft_p50_ms",
            "ttft_p95_ms",
            "ttft_p99_ms",
            "avg_balance",
            "mean_queue_ms",
            "steps",
            "requests",
        ] {
            assert!(r.get(k).is_some(), "missing {k}");
        }
        assert_eq!(r["requests"], 300);
        assert_eq!(r["workers"], 4);
    }
    assert!(figs.join("worker_loads.svg").is_file());
}

#[test]
fn sweep_writes_scaling_figure() {
    let dir = tempfile::tempdir().expect("tmp");
    let plot = dir.path().to_str().expect("utf8");
    // a small sweep at G = 2 and 4, the figure into `dir`, with `extra` flags
    let sweep = |extra: &[&str]| {
        let mut args = vec![
            "sweep",
            "--trace",
            "paper-prop",
            "--workers-list",
            "2,4",
            "--per-worker",
            "40",
            "--slots",
            "16",
            "--policies",
            "rr,br0",
            "--plot",
            plot,
        ];
        args.extend_from_slice(extra);
        br_sim(&args)
    };
    let out = sweep(&[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(dir.path().join("scaling.svg").is_file());
    let stdout = text(&out.stdout);
    assert!(stdout.contains("G=4"), "{stdout}");

    // the same offered load per rank at every G: R·G requests per second
    let out = sweep(&[
        "--arrival",
        "poisson",
        "--rate-per-worker",
        "1.5",
        "--seeds",
        "1,2",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("G=2 B=16 arrival=poisson 3/s")
            && stdout.contains("G=4 B=16 arrival=poisson 6/s"),
        "{stdout}"
    );
    let svg = std::fs::read_to_string(dir.path().join("scaling.svg")).expect("figure");
    assert!(
        svg.contains("Poisson at 1.5/s per worker"),
        "the title names the arrivals"
    );
    let out = br_sim(&[
        "sweep",
        "--trace",
        "paper-prop",
        "--rate-per-worker",
        "1.5",
        "--policies",
        "rr",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("--rate-per-worker needs --arrival poisson"),
        "{}",
        text(&out.stderr)
    );

    let out = br_sim(&[
        "sweep",
        "--trace",
        "paper-prop",
        "--limit",
        "100",
        "--workers",
        "2",
        "--slots",
        "16",
        "--policies",
        "jsq,br0",
        "--param",
        "r_max=1,4",
        "--seeds",
        "1,2",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("br0[r_max=1]") && stdout.contains("standard error"),
        "{stdout}"
    );
}

#[test]
fn calibrate_fixture() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/step_samples.csv");
    let out = br_sim(&["calibrate", fixture.to_str().expect("utf8")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("rejected line 13"), "{stdout}");
    assert!(stdout.contains("R² = 0.99"), "{stdout}");
    let out = br_sim(&["calibrate", "--strict", fixture.to_str().expect("utf8")]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("step_samples.csv:13"));

    // with a max_running column: a, c and b, c's significance and the F-score's κ
    let with_n = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/step_samples_n.csv");
    let out = br_sim(&["calibrate", with_n.to_str().expect("utf8")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("rejected line 20"), "{stdout}");
    assert!(stdout.contains("significant: the data asks"), "{stdout}");
    assert!(
        stdout.contains("--step-c") && stdout.contains("request_cost_tokens"),
        "{stdout}"
    );

    // samples that cannot tell c from a and b: exit 1 with the reason
    let dir = tempfile::tempdir().expect("tmp");
    let constant = dir.path().join("constant_n.csv");
    std::fs::write(
        &constant,
        "max_kv_tokens,max_running,step_ms\n1000,8,30\n2000,8,31\n3000,8,32\n4000,8,33\n",
    )
    .expect("write");
    let out = br_sim(&["calibrate", constant.to_str().expect("utf8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("max_running is the same (8)"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn bad_inputs_fail_with_a_message() {
    let dir = tempfile::tempdir().expect("tmp");
    let bad = dir.path().join("bad.csv");
    std::fs::write(&bad, "prompt_tokens,output_tokens\n10,5\nx,5\n").expect("write");
    let out = br_sim(&["--trace", bad.to_str().expect("utf8"), "--policies", "jsq"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("bad.csv:3"),
        "{}",
        text(&out.stderr)
    );

    let out = br_sim(&["--trace", "paper-azure", "--policies", "jsq,warp"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("unknown policy"),
        "{}",
        text(&out.stderr)
    );

    let out = br_sim(&["--trace", "paper-azure", "--arrival", "poisson"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("--rate"),
        "{}",
        text(&out.stderr)
    );

    let out = br_sim(&["--workers", "8"]);
    assert!(!out.status.success(), "--trace is required");
}

#[test]
fn a_missing_file_is_reported_once() {
    let out = br_sim(&["--trace", "/nonexistent/trace.csv", "--policies", "jsq"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert_eq!(
        err.matches("No such file").count(),
        1,
        "the cause once: {err}"
    );
    assert!(err.contains("/nonexistent/trace.csv"), "{err}");
}

/// `--arrival auto` (the default) follows a trace file's timestamps, falls back to saturated
/// without them and for the synthetic paper workloads, and says which and why; dropped rows
/// are counted on the workload line.
#[test]
fn the_arrival_mode_and_dropped_rows_are_printed() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let run = |trace: &str| {
        let out = br_sim(&[
            "--trace",
            trace,
            "--workers",
            "2",
            "--slots",
            "8",
            "--limit",
            "60",
            "--policies",
            "jsq",
        ]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let azure = data.join("azure2023_conv.head300.csv");
    let stdout = run(azure.to_str().expect("utf8"));
    assert!(
        stdout.contains("arrival=trace timestamps x1 (auto: the trace has timestamps"),
        "{stdout}"
    );
    let stdout = run("paper-azure");
    assert!(
        stdout.contains("arrival=saturated (auto: a synthetic paper workload"),
        "{stdout}"
    );

    let dir = tempfile::tempdir().expect("tmp");
    let lengths = dir.path().join("lengths.csv");
    std::fs::write(
        &lengths,
        "prompt_tokens,output_tokens\n10,5\n12,0\n30,9\n7,0\n",
    )
    .expect("write");
    let stdout = run(lengths.to_str().expect("utf8"));
    assert!(
        stdout.contains("arrival=saturated (auto: the trace has no timestamps)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("dropped 2 of 4 rows: 2 with no output tokens"),
        "{stdout}"
    );

    let out = br_sim(&[
        "--trace",
        azure.to_str().expect("utf8"),
        "--arrival",
        "saturated",
        "--limit",
        "60",
        "--policies",
        "jsq",
    ]);
    assert!(
        text(&out.stdout).contains("arrival=saturated (--arrival)"),
        "{}",
        text(&out.stdout)
    );
}

/// `--step-p 0` without `--colocated` is the decode-only model: the same table, byte for
/// byte, as without the flag. `--colocated` says so on the workload line, and its flags are
/// refused without it.
#[test]
fn colocated_prefill_flags() {
    let base = [
        "--trace",
        "paper-prop",
        "--workers",
        "4",
        "--slots",
        "16",
        "--limit",
        "200",
        "--policies",
        "rr,jsq,mintok,br0",
    ];
    let run = |extra: &[&str]| {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        let out = br_sim(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let plain = run(&[]);
    assert_eq!(run(&["--step-p", "0"]), plain);
    assert!(!plain.contains("colocated"), "{plain}");
    let colo = run(&["--colocated", "--step-p", "0.05", "--prefill-chunk", "2048"]);
    assert!(
        colo.contains("0.05·max P") && colo.contains("colocated prefill, 2048 prompt tokens"),
        "{colo}"
    );
    assert_ne!(colo, plain);
    for bad in [
        &["--step-p", "0.05"][..],
        &["--prefill-chunk", "2048"][..],
        &["--colocated", "--prefill-chunk", "0"][..],
        &["--colocated", "--step-p=-1"][..],
    ] {
        let mut args = base.to_vec();
        args.extend_from_slice(bad);
        let out = br_sim(&args);
        assert!(!out.status.success(), "{bad:?} is refused");
        let err = text(&out.stderr);
        assert!(
            err.contains("--colocated")
                || err.contains("--step-p")
                || err.contains("--prefill-chunk"),
            "{bad:?}: {err}"
        );
    }
}
