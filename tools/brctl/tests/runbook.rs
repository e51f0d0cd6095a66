//! deploy/README.md's alert runbook against the alert rules and brctl itself: every alert of
//! deploy/prometheus/alerts.yml has one row, each row says which brctl command to start with,
//! and every brctl command the page shows parses with brctl's own arguments (a renamed
//! subcommand or flag fails here, not in an operator's shell during an incident).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use clap::Parser as _;

fn repo_file(rel: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn alerts() -> Vec<String> {
    let rules = repo_file("deploy/prometheus/alerts.yml");
    let names: Vec<String> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert:"))
        .map(|n| n.trim().to_owned())
        .collect();
    assert!(names.len() >= 10, "alerts.yml lists {names:?}");
    names
}

/// Every `brctl …` command of the page: inline code spans and lines of code blocks, without
/// a trailing shell comment.
fn brctl_commands(page: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_block = false;
    for line in page.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        let candidates: Vec<&str> = if in_block {
            vec![line.split(" #").next().unwrap_or_default()]
        } else {
            line.split('`').skip(1).step_by(2).collect()
        };
        out.extend(
            candidates
                .into_iter()
                .map(str::trim)
                .filter(|c| c.starts_with("brctl "))
                .map(str::to_owned),
        );
    }
    out
}

#[test]
fn every_alert_has_a_runbook_row_that_starts_with_brctl() {
    let page = repo_file("deploy/README.md");
    for alert in alerts() {
        let rows: Vec<&str> = page
            .lines()
            .filter(|l| l.starts_with(&format!("| {alert} |")))
            .collect();
        assert_eq!(
            rows.len(),
            1,
            "{alert}: one runbook row in deploy/README.md"
        );
        assert!(
            rows[0].contains("`brctl "),
            "{alert}: its runbook names no brctl command: {}",
            rows[0]
        );
    }
}

#[test]
fn every_brctl_command_in_the_deploy_guide_exists() {
    let page = repo_file("deploy/README.md");
    let commands = brctl_commands(&page);
    assert!(commands.len() >= 10, "{commands:?}");
    for command in commands {
        // `<rank>` stands for a number in the text
        let words = command
            .split_whitespace()
            .map(|w| if w == "<rank>" { "3" } else { w });
        if let Err(e) = brctl::Cli::try_parse_from(words) {
            panic!("deploy/README.md shows `{command}`, which brctl refuses:\n{e}");
        }
    }
}
