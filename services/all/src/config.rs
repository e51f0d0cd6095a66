//! br-all's flags: the union of br-snapshot's, br-ingest's and br-decision's, each under its
//! own name (and `BALANCEROUTE_*` variable, and `--config` key), read from one command line by
//! the services' own `Args` types. Nothing is restated here: the command is assembled from the
//! three services' clap commands, and each service parses its `Args` from the shared matches.
//!
//! Where two services define the same flag, one definition is kept and every service reads
//! the one value:
//! * the shared flags (`--listen`, `--admin-listen`, `--tls-*`, `--shutdown-grace`, the
//!   limits of every port, ...): one port of each kind, so one value; br-all's defaults are
//!   `--listen 127.0.0.1:50060` and `--admin-listen 127.0.0.1:9060`;
//! * `--groups`: br-decision's (the groups decided for, default `default`), and br-ingest's
//!   allow-list is the same list: a worker of a group nobody decides for is refused
//!   (PERMISSION_DENIED) rather than fed into a σ nobody reads;
//! * `--snapshot-addr`: accepted and ignored; ingest and decision reach the snapshot service
//!   in-process.

use br_runtime::config::{CommonArgs, Validate as _};
use br_runtime::skeleton::ServiceArgs;
use clap::{Arg, ArgMatches, Args as _, Command, CommandFactory, FromArgMatches, Parser};

/// br-all's default gRPC port: one port for Telemetry, Snapshot and Decision.
pub const DEFAULT_LISTEN: &str = br_proto::defaults::ALL_LISTEN;
/// br-all's default admin port.
pub const DEFAULT_ADMIN_LISTEN: &str = br_proto::defaults::ALL_ADMIN_LISTEN;

/// Every flag of the three services, parsed once.
#[derive(Debug, Clone)]
pub struct Args {
    pub common: CommonArgs,
    pub snapshot: br_snapshot::Args,
    pub ingest: br_ingest::Args,
    pub decision: br_decision::Args,
}

/// The union command: the shared flags, then br-decision's, br-snapshot's and br-ingest's
/// own, each under its service's help heading. The first definition of an id wins (decision
/// before ingest: `--groups` is the decision's).
fn command() -> Command {
    // The about text after the shared flags: augment_args sets CommonArgs' own.
    let mut cmd = CommonArgs::augment_args(Command::new("br-all"))
        .version(env!("CARGO_PKG_VERSION"))
        .about(
            "br-all: BalanceRoute in one process (ingest, snapshot and decision; monolithic \
             mode). One gRPC port serves Telemetry, Snapshot and Decision, one admin port \
             their metrics and readiness; the components call each other in-process.",
        )
        .long_about(None)
        .mut_arg("listen", |a| a.default_value(DEFAULT_LISTEN))
        .mut_arg("admin_listen", |a| a.default_value(DEFAULT_ADMIN_LISTEN));
    let parts = [
        ("Decision", br_decision::Args::command()),
        ("Snapshot", br_snapshot::Args::command()),
        ("Ingest", br_ingest::Args::command()),
    ];
    for (heading, part) in parts {
        let new: Vec<Arg> = part
            .get_arguments()
            .filter(|a| !cmd.get_arguments().any(|b| b.get_id() == a.get_id()))
            .map(|a| a.clone().help_heading(heading))
            .collect();
        cmd = cmd.args(new);
    }
    cmd.mut_arg("snapshot_addr", |a| {
        a.help("Ignored by br-all: ingest and decision call the snapshot service in-process")
    })
}

impl CommandFactory for Args {
    fn command() -> Command {
        command()
    }

    fn command_for_update() -> Command {
        command()
    }
}

impl FromArgMatches for Args {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        Ok(Args {
            common: CommonArgs::from_arg_matches(m)?,
            snapshot: br_snapshot::Args::from_arg_matches(m)?,
            ingest: br_ingest::Args::from_arg_matches(m)?,
            decision: br_decision::Args::from_arg_matches(m)?,
        })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl Parser for Args {}

impl ServiceArgs for Args {
    fn common(&self) -> &CommonArgs {
        &self.common
    }

    /// Each service's own checks, on the values it will run with.
    fn check(&self) -> Result<(), String> {
        self.snapshot.validate()?;
        self.ingest.validate()?;
        self.decision.to_config().map(|_| ())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The flags two services both define (see the module docs for which definition wins).
    const SHARED_SERVICE_FLAGS: [&str; 2] = ["groups", "snapshot_addr"];

    fn parse(args: &[&str]) -> Args {
        let mut argv = vec!["br-all"];
        argv.extend_from_slice(args);
        Args::try_parse_from(argv).unwrap()
    }

    /// Clap's own consistency checks over the assembled command (duplicate ids, headings).
    #[test]
    fn the_union_command_is_well_formed() {
        Args::command().debug_assert();
    }

    /// Every flag of every service is accepted by br-all under its own name, and the only
    /// service flags defined twice are the documented ones.
    #[test]
    fn accepts_the_union_and_only_the_documented_flags_collide() {
        let ids = |c: Command| -> BTreeSet<String> {
            c.get_arguments().map(|a| a.get_id().to_string()).collect()
        };
        let all = ids(Args::command());
        let common = ids(CommonArgs::augment_args(Command::new("c")));
        let (s, i, d) = (
            ids(br_snapshot::Args::command()),
            ids(br_ingest::Args::command()),
            ids(br_decision::Args::command()),
        );
        for id in s.iter().chain(&i).chain(&d) {
            assert!(all.contains(id), "br-all lacks --{id}");
        }
        let mut twice = BTreeSet::new();
        for (a, b) in [(&s, &i), (&s, &d), (&i, &d)] {
            twice.extend(
                a.intersection(b)
                    .filter(|id| !common.contains(*id))
                    .cloned(),
            );
        }
        let documented: BTreeSet<String> = SHARED_SERVICE_FLAGS
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        assert_eq!(twice, documented);
    }

    #[test]
    fn defaults_are_loopback_and_each_service_reads_its_flags() {
        let a = parse(&[]);
        assert_eq!(a.common.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(a.common.admin_listen.to_string(), DEFAULT_ADMIN_LISTEN);
        // Every service runs with the one port's values.
        assert_eq!(a.snapshot.common.listen, a.common.listen);
        assert_eq!(a.ingest.common.listen, a.common.listen);
        assert_eq!(a.decision.common.listen, a.common.listen);
        assert_eq!(a.decision.groups, vec!["default".to_owned()]);
        assert_eq!(
            a.ingest.groups, a.decision.groups,
            "--groups is the decision's"
        );
        a.validate().unwrap();

        let a = parse(&[
            "--history",
            "17",
            "--batch-interval",
            "7ms",
            "--policy",
            "jsq",
            "--groups",
            "a,b",
            "--listen",
            "127.0.0.1:0",
        ]);
        assert_eq!(a.snapshot.history, 17);
        assert_eq!(a.ingest.batch_interval, std::time::Duration::from_millis(7));
        assert_eq!(a.decision.policy.to_string(), "jsq");
        assert_eq!(a.decision.groups, vec!["a".to_owned(), "b".to_owned()]);
        assert_eq!(a.ingest.groups, a.decision.groups);
        assert_eq!(a.snapshot.common.listen.port(), 0);
    }

    #[test]
    fn a_service_refuses_its_own_bad_values() {
        let argv = ["br-all", "--policy", "nope"];
        assert!(Args::try_parse_from(argv).is_err());
        let a = parse(&["--groups", ""]);
        assert!(a.validate().unwrap_err().contains("--groups"));
    }
}
