//! One set of defaults: every binary started with no flags reaches br-all started with no
//! flags, and the split deployment is `deploy/split.env`, whose variables every binary reads
//! under the same names. Checked on the parsed command lines (no process is started: a test
//! must never bind a default port, other programs use them), against the constants of
//! `br_proto::defaults`, so a default changed in one binary and not in the others fails here.
//!
//! The binaries without a library (br-emu, the bench drivers) check their own command lines
//! against the same constants in their unit tests; the Python client's default is read from
//! its source below.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on purpose

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use br_proto::defaults::{self, env};
use clap::{Command, CommandFactory, FromArgMatches};

/// `T` parsed from `argv` as clap would with an empty environment: clap reads the
/// `BALANCEROUTE_*` variables at parse time, and a shell that sourced deploy/split.env must not
/// change what the defaults are.
fn bare<T: CommandFactory + FromArgMatches>(argv: &[&str]) -> T {
    let matches = without_env(T::command())
        .try_get_matches_from(argv)
        .unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    T::from_arg_matches(&matches).unwrap()
}

fn without_env(cmd: Command) -> Command {
    cmd.mut_args(|a| a.env(None::<&'static str>))
        .mut_subcommands(without_env)
}

fn url(listen: std::net::SocketAddr) -> String {
    format!("http://{listen}")
}

/// Every binary with a library, built as clap builds it (global flags propagated to the
/// subcommands), with its subcommands.
fn commands() -> Vec<Command> {
    let mut out = Vec::new();
    for mut cmd in [
        br_all::Args::command(),
        br_snapshot::Args::command(),
        br_ingest::Args::command(),
        br_decision::Args::command(),
        br_shim::Args::command(),
        brctl::Cli::command(),
    ] {
        cmd.build();
        let subs: Vec<Command> = cmd.get_subcommands().cloned().collect();
        out.push(cmd);
        out.extend(subs);
    }
    out
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("services/all sits two levels below the workspace root")
        .to_path_buf()
}

#[test]
fn every_client_reaches_br_all_with_no_flags() {
    let all: br_all::Args = bare(&["br-all"]);
    assert_eq!(all.common.listen.to_string(), defaults::ALL_LISTEN);
    let br_all = url(all.common.listen);
    assert_eq!(br_all, defaults::ADDR);

    let shim: br_shim::Args = bare(&["br-shim"]);
    assert_eq!(shim.ingest_addr, br_all, "br-shim reports to br-all");
    let ctl: brctl::Cli = bare(&["brctl", "status"]);
    assert_eq!(ctl.snapshot_addr, br_all, "brctl reads σ from br-all");
    // A split br-ingest or br-decision with no flags finds the snapshot service where every
    // other client does.
    let ingest: br_ingest::Args = bare(&["br-ingest"]);
    assert_eq!(ingest.snapshot_addr, br_all);
    let decision: br_decision::Args = bare(&["br-decision"]);
    assert_eq!(decision.snapshot_addr, br_all);
}

#[test]
fn every_address_flag_has_its_variable_and_one_variable_is_one_flag() {
    let mut flag_of: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for cmd in commands() {
        for arg in cmd.get_arguments() {
            let (Some(long), Some(var)) = (arg.get_long(), arg.get_env()) else {
                if let Some(long) = arg.get_long().filter(|l| l.ends_with("-addr")) {
                    panic!("{} --{long} has no environment variable", cmd.get_name());
                }
                continue;
            };
            let var = var.to_string_lossy().into_owned();
            flag_of
                .entry(var.clone())
                .or_default()
                .insert(long.to_owned());
            let want = match var.as_str() {
                env::SNAPSHOT_ADDR => defaults::SNAPSHOT_ADDR,
                env::INGEST_ADDR => defaults::INGEST_ADDR,
                env::DECISION_ADDR => defaults::DECISION_ADDR,
                _ => continue,
            };
            let got: Vec<_> = arg.get_default_values().iter().collect();
            assert_eq!(got, [want], "{} --{long} ({var})", cmd.get_name());
        }
    }
    for (var, flags) in &flag_of {
        assert_eq!(flags.len(), 1, "{var} is read as {flags:?}");
    }
    for var in [env::SNAPSHOT_ADDR, env::INGEST_ADDR] {
        assert!(flag_of.contains_key(var), "no binary reads {var}");
    }
}

/// The `KEY=VALUE` lines of an environment file (comments and blank lines skipped).
fn env_file(path: &Path) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l
                .split_once('=')
                .unwrap_or_else(|| panic!("{path:?}: {l:?} is not KEY=VALUE"));
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

#[test]
fn split_env_names_each_split_service_at_its_default_port() {
    let file = env_file(&workspace_root().join("deploy/split.env"));
    let snapshot: br_snapshot::Args = bare(&["br-snapshot"]);
    let ingest: br_ingest::Args = bare(&["br-ingest"]);
    let decision: br_decision::Args = bare(&["br-decision"]);
    let want: BTreeMap<String, String> = [
        (env::SNAPSHOT_ADDR, url(snapshot.common.listen)),
        (env::INGEST_ADDR, url(ingest.common.listen)),
        (env::DECISION_ADDR, url(decision.common.listen)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    assert_eq!(file, want);
    // br-all and the split services can run side by side on their defaults.
    let all: br_all::Args = bare(&["br-all"]);
    for listen in [
        snapshot.common.listen,
        ingest.common.listen,
        decision.common.listen,
    ] {
        assert_ne!(listen, all.common.listen);
    }
}

/// `NAME = "value"` at the start of a line of a Python source.
fn python_constant(source: &str, name: &str) -> String {
    let prefix = format!("{name} = \"");
    let line = source
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no `{name} = \"...\"` line"));
    line[prefix.len()..].split('"').next().unwrap().to_owned()
}

#[test]
fn the_python_client_defaults_to_br_all_and_reads_the_same_variable() {
    let path = workspace_root().join("clients/python/src/balanceroute/_core.py");
    let source = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    assert_eq!(
        python_constant(&source, "DEFAULT_ADDRESS"),
        defaults::ALL_LISTEN
    );
    assert_eq!(python_constant(&source, "ADDRESS_ENV"), env::DECISION_ADDR);
}
