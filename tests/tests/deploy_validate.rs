//! deploy/ in the test suite: runs `deploy/validate.sh`, which renders the kustomize base and
//! overlays, validates every object against the Kubernetes schemas, checks the Prometheus
//! config and alert rules with promtool, lints the Dockerfile, and checks that every metric the
//! Grafana dashboard and the alert rules query is listed in deploy/metrics-contract.txt.
//! The script installs its tools from package registries into target/ on first use (~20 s).
//! Set BR_SKIP_DEPLOY_VALIDATE=1 to skip it (e.g. offline).

use std::path::Path;
use std::process::Command;

#[test]
fn deploy_manifests_dashboards_and_alerts_validate() {
    if std::env::var_os("BR_SKIP_DEPLOY_VALIDATE").is_some() {
        eprintln!("skipped: BR_SKIP_DEPLOY_VALIDATE is set");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace root");
    let out = Command::new("bash")
        .arg(root.join("deploy").join("validate.sh"))
        .current_dir(root)
        .output()
        .expect("bash runs deploy/validate.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
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
