//! deploy/ in the test suite: runs `deploy/validate.sh --no-install`, which renders the kustomize
//! base and overlays, validates every object against the Kubernetes schemas, checks the
//! Prometheus config and alert rules with promtool, lints the Dockerfile, and checks that every
//! metric the Grafana dashboard and the alert rules query is listed in
//! deploy/metrics-contract.txt.
//!
//! `cargo test` never reaches a package registry: the tools come from `make deploy-tools`
//! (which `.ci/run` calls before `make test`). Without them this test says SKIPPED on the
//! terminal (past the test harness's output capture) and passes; with `BR_REQUIRE_DEPLOY_TOOLS`
//! set (CI sets it) missing tools fail it instead, so CI cannot go green without validating.

use std::io::Write as _;
use std::path::Path;
use std::process::Command;

const NAME: &str = "deploy_manifests_dashboards_and_alerts_validate";

/// Says why the test did not run, on the real stderr: libtest captures `eprintln!` of passing
/// tests, and a skip nobody sees is a silent pass.
fn skipped(why: &str) {
    let _ = writeln!(std::io::stderr(), "\n{NAME}: SKIPPED: {why}");
}

#[test]
fn deploy_manifests_dashboards_and_alerts_validate() {
    let required = std::env::var_os("BR_REQUIRE_DEPLOY_TOOLS").is_some();
    if std::env::var_os("BR_SKIP_DEPLOY_VALIDATE").is_some() {
        assert!(
            !required,
            "BR_SKIP_DEPLOY_VALIDATE and BR_REQUIRE_DEPLOY_TOOLS are both set"
        );
        skipped("BR_SKIP_DEPLOY_VALIDATE is set");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace root");
    let out = Command::new("bash")
        .arg(root.join("deploy").join("validate.sh"))
        .arg("--no-install")
        .current_dir(root)
        .output()
        .expect("bash runs deploy/validate.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Exit 3 with a "deploy: skipped: ..." line: the tools are not installed.
    if out.status.code() == Some(3) {
        let why = stdout
            .lines()
            .find_map(|l| l.strip_prefix("deploy: skipped: "))
            .unwrap_or("deploy/validate.sh exited 3 without saying why");
        assert!(
            !required,
            "BR_REQUIRE_DEPLOY_TOOLS is set but the deploy tools are missing: {why}"
        );
        skipped(why);
        return;
    }
    assert!(
        out.status.success(),
        "deploy/validate.sh failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let summary = stdout.lines().rev().find(|l| l.starts_with("deploy: "));
    assert!(
        summary.is_some_and(|l| l.ends_with(" 0 failed")),
        "no clean summary line from deploy/validate.sh:\n{stdout}"
    );
}
