//! The demo's verdict on its comparison (`routing_verdict` of scripts/lib/routing.sh, which
//! scripts/demo.sh prints under the results): runs that lost different ranks from routing are
//! declared not comparable, runs that kept every rank are compared without a word.

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
