//! The demo's verdict on its comparison (`routing_verdict` of scripts/lib/routing.sh, which
//! scripts/demo.sh prints under the results): runs that lost different ranks from routing are
//! declared not comparable, runs that kept every rank are compared without a word. And its
//! output directory: a second demo is refused while one writes there.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn verdict(args: &[&str]) -> String {
    let script = br_e2e::root().join("scripts/lib/routing.sh");
    let out = Command::new("bash")
        .arg("-c")
        .arg("source \"$0\" && routing_verdict \"$@\"")
        .arg(&script)
        .args(args)
        .output()
        .expect("bash runs");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn runs_that_lost_different_ranks_are_declared_not_comparable() {
    let out = verdict(&["8", "jsq=", "br0=3 5"]);
    assert!(out.contains("jsq          0 of 8\n"), "{out}");
    assert!(out.contains("br0          2 of 8 (ranks 3, 5)\n"), "{out}");
    assert!(out.contains("COMPARISON INVALID"), "{out}");

    // the same count, other ranks: still not the same group of ranks
    let out = verdict(&["8", "jsq=1", "br0=2"]);
    assert!(out.contains("COMPARISON INVALID"), "{out}");

    // a shim that could not be read counts as out, and says so
    let out = verdict(&["8", "jsq=4?", "br0="]);
    assert!(out.contains("COMPARISON INVALID"), "{out}");
    assert!(out.contains("could not be read"), "{out}");
}

#[test]
fn runs_that_kept_the_same_ranks_are_compared() {
    let out = verdict(&["8", "jsq=", "br0="]);
    assert!(!out.contains("INVALID"), "{out}");
    assert!(out.contains("br0          0 of 8\n"), "{out}");

    let out = verdict(&["8", "jsq=2", "br0=2"]);
    assert!(!out.contains("INVALID"), "{out}");
    assert!(out.contains("fewer than G = 8 ranks"), "{out}");
}

/// Runs scripts/demo.sh on `out` with no binaries to find (an empty target directory), so a
/// run the guard lets through stops at once, naming the first missing one.
fn demo(out: &std::path::Path) -> std::process::Output {
    let empty = tempfile::tempdir().unwrap();
    Command::new("bash")
        .arg(br_e2e::root().join("scripts/demo.sh"))
        .env("DEMO_OUT", out)
        .env("DEMO_SKIP_BUILD", "1")
        .env("CARGO_TARGET_DIR", empty.path())
        .output()
        .expect("bash runs")
}

#[test]
fn a_second_demo_on_the_same_output_directory_is_refused_and_touches_nothing() {
    let out = tempfile::tempdir().unwrap();
    let results = out.path().join("jsq.json");
    std::fs::write(&results, "{}").unwrap();
    // A live process holds the directory.
    let mut holder = Command::new("sleep").arg("60").spawn().unwrap();
    std::fs::write(out.path().join(".demo.pid"), holder.id().to_string()).unwrap();

    let refused = demo(out.path());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{refused:?}");
    assert!(
        stderr.contains(&format!("a demo (pid {}) is writing to", holder.id())),
        "{stderr}"
    );
    assert!(results.exists(), "the first demo's results were left alone");

    // Once it has gone, the next demo takes the directory (and stops at the missing binary).
    holder.kill().unwrap();
    holder.wait().unwrap();
    let next = demo(out.path());
    let stderr = String::from_utf8_lossy(&next.stderr);
    assert!(stderr.contains("missing "), "{stderr}");
    assert!(!results.exists(), "it cleared the old results");
    let pid = std::fs::read_to_string(out.path().join(".demo.pid")).unwrap();
    assert_ne!(pid.trim(), holder.id().to_string());
}
