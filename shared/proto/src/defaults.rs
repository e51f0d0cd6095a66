//! Where BalanceRoute's binaries listen and where they look for each other when nobody tells
//! them: one set of defaults, defined once, so that a binary started with no flags finds the
//! others.
//!
//! The default deployment is br-all: one gRPC port ([`ALL_LISTEN`]) serves Telemetry,
//! Snapshot and Decision. So every address a binary dials by default is that port
//! ([`SNAPSHOT_ADDR`], [`INGEST_ADDR`], [`DECISION_ADDR`] are all [`ADDR`]): br-shim reports
//! there, brctl reads σ there, gateways (`br-emu load`, the Python client) call Assign there,
//! and a split br-ingest or br-decision started without `--snapshot-addr` finds the snapshot
//! service there too.
//!
//! The split deployment (br-snapshot, br-ingest and br-decision as separate processes) listens
//! on ports of its own ([`SNAPSHOT_LISTEN`], [`INGEST_LISTEN`], [`DECISION_LISTEN`]); one
//! environment file, `deploy/split.env`, points every binary at them through the variables in
//! [`env`], which every binary reads under the same names with the same meaning.
//!
//! The constants live in br-proto because it is the one crate every binary (the services, the
//! shim, brctl, br-emu, the bench drivers) already depends on; what they describe is part of the
//! contract between the binaries, like [`crate::service_names`].

/// br-all's gRPC `--listen`: Telemetry, Snapshot and Decision on one port.
pub const ALL_LISTEN: &str = "127.0.0.1:50060";
/// br-all's admin `--admin-listen` (the metrics of all three components, `/readyz`).
pub const ALL_ADMIN_LISTEN: &str = "127.0.0.1:9060";

/// The URL every client dials by default: br-all's gRPC port ([`ALL_LISTEN`]).
pub const ADDR: &str = "http://127.0.0.1:50060";
/// The snapshot service's default URL (br-ingest's, br-decision's and brctl's
/// `--snapshot-addr`): br-all's port.
pub const SNAPSHOT_ADDR: &str = ADDR;
/// The ingest service's default URL (br-shim's `--ingest-addr`): br-all's port.
pub const INGEST_ADDR: &str = ADDR;
/// The decision service's default URL (a gateway's `--decision-addr`): br-all's port.
pub const DECISION_ADDR: &str = ADDR;

/// br-snapshot's `--listen` and `--admin-listen` in the split deployment.
pub const SNAPSHOT_LISTEN: &str = "127.0.0.1:50061";
pub const SNAPSHOT_ADMIN_LISTEN: &str = "127.0.0.1:9061";
/// br-ingest's `--listen` and `--admin-listen` in the split deployment.
pub const INGEST_LISTEN: &str = "127.0.0.1:50062";
pub const INGEST_ADMIN_LISTEN: &str = "127.0.0.1:9062";
/// br-decision's `--listen` and `--admin-listen` in the split deployment.
pub const DECISION_LISTEN: &str = "127.0.0.1:50063";
pub const DECISION_ADMIN_LISTEN: &str = "127.0.0.1:9063";
/// br-shim's proxy `--listen` and `--admin-listen` (one shim per rank, beside its engine).
pub const SHIM_LISTEN: &str = "127.0.0.1:8100";
pub const SHIM_ADMIN_LISTEN: &str = "127.0.0.1:9064";

/// The environment variables naming where each service is. Every binary that dials a service
/// reads the service's variable (clap's `env`), so one environment file configures them all;
/// a variable means the same in every binary that reads it.
pub mod env {
    /// The snapshot service's gRPC URL (br-ingest, br-decision, brctl, the bench drivers).
    pub const SNAPSHOT_ADDR: &str = "BALANCEROUTE_SNAPSHOT_ADDR";
    /// The ingest service's gRPC URL, or several replicas' comma-separated (br-shim, the bench
    /// drivers).
    pub const INGEST_ADDR: &str = "BALANCEROUTE_INGEST_ADDR";
    /// The decision service's gRPC URL, or several replicas' comma-separated (br-emu load,
    /// assign-load, the Python client).
    pub const DECISION_ADDR: &str = "BALANCEROUTE_DECISION_ADDR";
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;

    #[test]
    fn every_client_default_is_the_all_in_one_port() {
        assert_eq!(ADDR, format!("http://{ALL_LISTEN}"));
        for addr in [SNAPSHOT_ADDR, INGEST_ADDR, DECISION_ADDR] {
            assert_eq!(addr, ADDR);
        }
    }

    #[test]
    fn no_two_default_ports_collide() {
        let all = [
            ALL_LISTEN,
            ALL_ADMIN_LISTEN,
            SNAPSHOT_LISTEN,
            SNAPSHOT_ADMIN_LISTEN,
            INGEST_LISTEN,
            INGEST_ADMIN_LISTEN,
            DECISION_LISTEN,
            DECISION_ADMIN_LISTEN,
            SHIM_LISTEN,
            SHIM_ADMIN_LISTEN,
        ];
        let distinct: std::collections::BTreeSet<_> = all.iter().collect();
        assert_eq!(distinct.len(), all.len(), "{all:?}");
        for a in all {
            let addr: std::net::SocketAddr = a.parse().unwrap();
            assert!(
                addr.ip().is_loopback(),
                "{a}: a default binds loopback only"
            );
        }
    }
}
