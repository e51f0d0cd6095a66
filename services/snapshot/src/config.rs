//! `br-snapshot`'s flags. Each is also `BALANCEROUTE_<FLAG>` and may be set in the `--config`
//! TOML file (precedence: defaults < file < environment < flags).

use std::sync::Arc;
use std::time::Duration;

use br_runtime::config::CommonArgs;
use br_runtime::skeleton::ServiceArgs;
use br_sigma::{MAX_SNAPSHOT_MESSAGE_BYTES, RequestBound, max_snapshot_bytes};

use crate::group::{Settings, WatcherBudget};

/// br-snapshot's default `--listen` and `--admin-listen` (the split deployment's ports).
pub const DEFAULT_LISTEN: &str = br_proto::defaults::SNAPSHOT_LISTEN;
pub const DEFAULT_ADMIN_LISTEN: &str = br_proto::defaults::SNAPSHOT_ADMIN_LISTEN;
/// Default number of deltas kept per group for resumption.
pub const DEFAULT_HISTORY: usize = 4096;
/// Default reservation TTL.
pub const DEFAULT_RESERVATION_TTL: &str = "10s";
/// Default grace period before a disconnected worker is fenced.
pub const DEFAULT_WORKER_GRACE: &str = "5s";
/// Default time a worker whose ingest replica went away stays LIVE while its shim reconnects.
pub const DEFAULT_CARRIER_GRACE: &str = "3s";
/// Default idle period before a progress mark.
pub const DEFAULT_PROGRESS_INTERVAL: &str = "250ms";
/// Default encoded bytes of the deltas kept per group for resumption: at most 4096 deltas and
/// at most this, so a heavy writer (large batches, long request ids) does not make the
/// history the process's largest holding.
pub const DEFAULT_HISTORY_BYTES: usize = 32 * 1024 * 1024;
/// Default age past which a delta leaves the history: far longer than a watcher's reconnect
/// after a dropped connection or a replica's restart (seconds), short enough that the history
/// of a load that ended is gone half a minute later.
pub const DEFAULT_HISTORY_AGE: &str = "30s";
const DEFAULT_HISTORY_AGE_DURATION: Duration = Duration::from_secs(30);
/// Default events queued per watcher before it counts as slow.
pub const DEFAULT_WATCHER_QUEUE: usize = 1024;
/// Default bytes queued per watcher before it is ended: decision's largest Watch message
/// (64 MiB), so a watcher that reads can always be sent one full snapshot and keep up after it.
pub const DEFAULT_WATCHER_QUEUE_BYTES: usize = 64 * 1024 * 1024;
/// Watch streams held at once, over every group. The legitimate watchers are decision replicas
/// (a few per group) and operators' tools; each open stream costs its HTTP/2 buffers (2,000
/// that never read held ~490 MB, docs/benchmarks.md "bounds").
pub const DEFAULT_MAX_WATCHERS: usize = 512;
/// Default bytes every watcher queue of the process may hold together: each open watcher may
/// hold its share (this over the watchers open), at most `--watcher-queue-bytes`. 512
/// watchers that never read, each allowed 64 MiB alone, could hold 32 GiB between them.
pub const DEFAULT_WATCHER_BUDGET_BYTES: usize = 64 * 1024 * 1024;
/// Default number of groups held at once (a deployment has a handful; each costs ~10 KB and
/// 20 metric series).
pub const DEFAULT_MAX_GROUPS: usize = 1024;
/// Default number of requests a worker may hold above its capacity B: reservations queued at
/// the rank by on-arrival policies and requests waiting in the engine's own queue. Beyond it a
/// reservation or a reported request is refused WORKER_FULL (four workers of capacity 1 once
/// put 262,144 requests in σ).
pub const DEFAULT_WORKER_REQUEST_MARGIN: u32 = 1024;
/// Default time an idle group is kept.
pub const DEFAULT_GROUP_IDLE_GRACE: &str = "60s";

/// br-snapshot: the single writer of σ per group; serves Snapshot (Watch, Get, Apply, Reserve,
/// Release).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "br-snapshot", version)]
#[command(mut_arg("listen", |a| a.default_value(DEFAULT_LISTEN)))]
#[command(mut_arg("admin_listen", |a| a.default_value(DEFAULT_ADMIN_LISTEN)))]
pub struct Args {
    #[command(flatten)]
    pub common: CommonArgs,

    /// Deltas kept per group so a watcher can resume without a snapshot.
    #[arg(long, env = "BALANCEROUTE_HISTORY", default_value_t = DEFAULT_HISTORY)]
    pub history: usize,

    /// Encoded bytes of the deltas kept per group for resumption (with --history, whichever
    /// is reached first); above 1 MiB the history is also held to twice the size of σ's
    /// snapshot, since catching up from further back would cost more than a snapshot. A
    /// watcher resuming from before the deltas kept gets a snapshot.
    #[arg(long, env = "BALANCEROUTE_HISTORY_BYTES", default_value_t = DEFAULT_HISTORY_BYTES)]
    pub history_bytes: usize,

    /// Deltas kept for resumption are dropped this long after they were applied (0 keeps them
    /// until --history or --history-bytes): a watcher away for longer resumes from a snapshot,
    /// and the memory a burst of writes took in the history comes back once it is over.
    #[arg(long, env = "BALANCEROUTE_HISTORY_AGE", value_parser = humantime::parse_duration, default_value = DEFAULT_HISTORY_AGE)]
    pub history_age: Duration,

    /// A reservation with no telemetry for this long expires (RequestExpired).
    #[arg(long, env = "BALANCEROUTE_RESERVATION_TTL", value_parser = humantime::parse_duration, default_value = DEFAULT_RESERVATION_TTL)]
    pub reservation_ttl: Duration,

    /// A worker whose stream is gone is SUSPECT for this long, then FENCED.
    #[arg(long, env = "BALANCEROUTE_WORKER_GRACE", value_parser = humantime::parse_duration, default_value = DEFAULT_WORKER_GRACE)]
    pub worker_grace: Duration,

    /// A worker whose ingest replica went away (its Apply stream ended: a crash, a restart, a
    /// lost link) stays LIVE this long, routable on its last state, while its shim reconnects
    /// to any replica; then it is SUSPECT (and FENCED after --worker-grace).
    #[arg(long, env = "BALANCEROUTE_CARRIER_GRACE", value_parser = humantime::parse_duration, default_value = DEFAULT_CARRIER_GRACE)]
    pub carrier_grace: Duration,

    /// Watchers get a progress mark after this long without a delta.
    #[arg(long, env = "BALANCEROUTE_PROGRESS_INTERVAL", value_parser = humantime::parse_duration, default_value = DEFAULT_PROGRESS_INTERVAL)]
    pub progress_interval: Duration,

    /// Events queued per watcher; a watcher whose queue overflows is reset (SLOW_CONSUMER).
    #[arg(long, env = "BALANCEROUTE_WATCHER_QUEUE", default_value_t = DEFAULT_WATCHER_QUEUE)]
    pub watcher_queue: usize,

    /// Bytes queued per watcher (encoded events its stream has not taken); a watcher past it
    /// is ended with RESOURCE_EXHAUSTED (it re-syncs from a snapshot when it comes back).
    #[arg(long, env = "BALANCEROUTE_WATCHER_QUEUE_BYTES", default_value_t = DEFAULT_WATCHER_QUEUE_BYTES)]
    pub watcher_queue_bytes: usize,

    /// Bytes all watchers' queues may hold together: each open watcher's queue is bounded by
    /// its share (this over the open watchers) when that is below --watcher-queue-bytes, and
    /// a watcher past it is ended the same way (RESOURCE_EXHAUSTED).
    #[arg(long, env = "BALANCEROUTE_WATCHER_BUDGET_BYTES", default_value_t = DEFAULT_WATCHER_BUDGET_BYTES)]
    pub watcher_budget_bytes: usize,

    /// Watch streams held at once, over every group; one more is refused with
    /// RESOURCE_EXHAUSTED until one ends.
    #[arg(long, env = "BALANCEROUTE_MAX_WATCHERS", default_value_t = DEFAULT_MAX_WATCHERS)]
    pub max_watchers: usize,

    /// Groups held at once; a Watch or Apply naming a new group beyond it is refused with
    /// RESOURCE_EXHAUSTED until an idle group is reclaimed.
    #[arg(long, env = "BALANCEROUTE_MAX_GROUPS", default_value_t = DEFAULT_MAX_GROUPS)]
    pub max_groups: usize,

    /// A group with no live worker, request or watcher is forgotten after this long.
    #[arg(long, env = "BALANCEROUTE_GROUP_IDLE_GRACE", value_parser = humantime::parse_duration, default_value = DEFAULT_GROUP_IDLE_GRACE)]
    pub group_idle_grace: Duration,

    /// Requests a worker may hold in σ above its capacity (reserved and reported alike); a
    /// reservation or reported request beyond is refused WORKER_FULL.
    #[arg(long, env = "BALANCEROUTE_WORKER_REQUEST_MARGIN", default_value_t = DEFAULT_WORKER_REQUEST_MARGIN)]
    pub worker_request_margin: u32,

    /// Requests a group may hold in σ; one beyond is refused WORKER_FULL. Its worst-case
    /// snapshot must fit the 64 MiB a watcher decodes (at most about 218,000).
    #[arg(long, env = "BALANCEROUTE_MAX_GROUP_REQUESTS", default_value_t = br_sigma::DEFAULT_MAX_GROUP_REQUESTS)]
    pub max_group_requests: usize,

    /// Keep the operator's cordons (SetCordon) in this file, so they survive a restart of the
    /// service (σ itself is rebuilt from the shims, which know nothing of cordons). Written
    /// atomically before SetCordon answers; read at start (a missing file is no cordons, an
    /// unreadable one stops the start). Unset: cordons last as long as the process.
    #[arg(long, env = "BALANCEROUTE_CORDON_FILE")]
    pub cordon_file: Option<std::path::PathBuf>,
}

impl Args {
    /// The group tunables.
    pub fn settings(&self) -> Settings {
        Settings {
            history: self.history,
            history_bytes: self.history_bytes,
            history_age: self.history_age,
            reservation_ttl: self.reservation_ttl,
            worker_grace: self.worker_grace,
            carrier_grace: self.carrier_grace,
            progress_interval: self.progress_interval,
            watcher_queue: self.watcher_queue,
            watcher_queue_bytes: self.watcher_queue_bytes,
            watcher_budget: Arc::new(WatcherBudget::new(self.watcher_budget_bytes)),
            max_groups: self.max_groups,
            group_idle_grace: self.group_idle_grace,
            requests: RequestBound {
                over_capacity: self.worker_request_margin,
                per_group: self.max_group_requests,
            },
        }
    }
}

fn in_range(flag: &str, d: Duration, min: Duration, max: Duration) -> Result<(), String> {
    if d < min || d > max {
        return Err(format!(
            "--{flag} is {}, it must be in {}..={}",
            humantime::format_duration(d),
            humantime::format_duration(min),
            humantime::format_duration(max)
        ));
    }
    Ok(())
}

impl ServiceArgs for Args {
    fn common(&self) -> &CommonArgs {
        &self.common
    }

    fn check(&self) -> Result<(), String> {
        if !(1..=1_000_000).contains(&self.history) {
            return Err("--history must be in 1..=1000000".into());
        }
        if !(2..=1_000_000).contains(&self.watcher_queue) {
            return Err("--watcher-queue must be in 2..=1000000".into());
        }
        if !(1024..=1 << 40).contains(&self.watcher_queue_bytes) {
            return Err("--watcher-queue-bytes must be in 1024..=2^40".into());
        }
        if !(1024..=1 << 40).contains(&self.watcher_budget_bytes) {
            return Err("--watcher-budget-bytes must be in 1024..=2^40".into());
        }
        if !(1024..=1 << 40).contains(&self.history_bytes) {
            return Err("--history-bytes must be in 1024..=2^40".into());
        }
        if !(1..=1_000_000).contains(&self.max_watchers) {
            return Err("--max-watchers must be in 1..=1000000".into());
        }
        if !(1..=1_000_000).contains(&self.max_groups) {
            return Err("--max-groups must be in 1..=1000000".into());
        }
        if !(0..=br_proto::valid::limits::MAX_CAPACITY).contains(&self.worker_request_margin) {
            return Err(format!(
                "--worker-request-margin must be in 0..={}",
                br_proto::valid::limits::MAX_CAPACITY
            ));
        }
        let worst = max_snapshot_bytes(self.max_group_requests);
        if self.max_group_requests == 0 || worst > MAX_SNAPSHOT_MESSAGE_BYTES {
            return Err(format!(
                "--max-group-requests must be at least 1 and keep a group's largest snapshot ({worst} bytes for {}) within the {MAX_SNAPSHOT_MESSAGE_BYTES} bytes a watcher decodes",
                self.max_group_requests
            ));
        }
        let ms = Duration::from_millis;
        let hour = Duration::from_secs(3600);
        in_range("group-idle-grace", self.group_idle_grace, ms(1), 24 * hour)?;
        in_range("reservation-ttl", self.reservation_ttl, ms(1), hour)?;
        in_range("worker-grace", self.worker_grace, ms(1), hour)?;
        in_range("carrier-grace", self.carrier_grace, ms(1), hour)?;
        in_range(
            "progress-interval",
            self.progress_interval,
            ms(1),
            Duration::from_secs(60),
        )?;
        Ok(())
    }
}

/// The flags' defaults, for a group made in code (tests, the all-in-one's defaults). Here,
/// beside the flags they repeat, so that the group needs nothing of how it is configured.
impl Default for Settings {
    fn default() -> Self {
        Settings {
            history: DEFAULT_HISTORY,
            history_bytes: DEFAULT_HISTORY_BYTES,
            history_age: DEFAULT_HISTORY_AGE_DURATION,
            reservation_ttl: Duration::from_secs(10),
            worker_grace: Duration::from_secs(5),
            carrier_grace: Duration::from_secs(3),
            progress_interval: Duration::from_millis(250),
            watcher_queue: DEFAULT_WATCHER_QUEUE,
            watcher_queue_bytes: DEFAULT_WATCHER_QUEUE_BYTES,
            watcher_budget: Arc::new(WatcherBudget::new(DEFAULT_WATCHER_BUDGET_BYTES)),
            max_groups: DEFAULT_MAX_GROUPS,
            group_idle_grace: Duration::from_secs(60),
            requests: RequestBound {
                over_capacity: DEFAULT_WORKER_REQUEST_MARGIN,
                per_group: br_sigma::DEFAULT_MAX_GROUP_REQUESTS,
            },
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    fn parse(args: &[&str]) -> Result<Args, br_runtime::config::ConfigError> {
        br_runtime::config::parse_from(std::iter::once("br-snapshot").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_follow_the_conventions() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.common.listen, "127.0.0.1:50061".parse().unwrap());
        assert_eq!(a.common.admin_listen, "127.0.0.1:9061".parse().unwrap());
        assert_eq!(a.history, 4096);
        assert_eq!(a.reservation_ttl, Duration::from_secs(10));
        assert_eq!(a.worker_grace, Duration::from_secs(5));
        assert_eq!(a.carrier_grace, Duration::from_secs(3));
        assert_eq!(a.progress_interval, Duration::from_millis(250));
        assert_eq!(a.watcher_queue, 1024);
        assert_eq!(a.watcher_queue_bytes, 64 << 20);
        assert_eq!(a.watcher_budget_bytes, 64 << 20);
        assert_eq!(a.history_bytes, 32 << 20);
        assert_eq!(a.max_watchers, 512);
        assert_eq!(a.max_groups, 1024);
        assert_eq!(a.group_idle_grace, Duration::from_secs(60));
        assert_eq!(a.worker_request_margin, 1024);
        assert_eq!(a.max_group_requests, 200_000);
        assert_eq!(
            br_runtime::config::check_env_names(&Args::command()),
            Ok(())
        );
    }

    #[test]
    fn flags_parse_and_are_validated() {
        let a = parse(&[
            "--reservation-ttl",
            "300ms",
            "--worker-grace",
            "2s",
            "--history",
            "8",
        ])
        .unwrap();
        assert_eq!(a.settings().reservation_ttl, Duration::from_millis(300));
        assert_eq!(a.settings().history, 8);
        assert!(parse(&["--history", "0"]).is_err());
        assert!(parse(&["--watcher-queue", "1"]).is_err());
        assert!(parse(&["--max-groups", "0"]).is_err());
        assert!(parse(&["--watcher-queue-bytes", "10"]).is_err());
        assert!(parse(&["--group-idle-grace", "0s"]).is_err());
        let a = parse(&["--max-groups", "8", "--group-idle-grace", "50ms"]).unwrap();
        assert_eq!(a.settings().max_groups, 8);
        assert_eq!(a.settings().group_idle_grace, Duration::from_millis(50));
        assert!(parse(&["--worker-grace", "0s"]).is_err());
        assert!(parse(&["--carrier-grace", "0s"]).is_err());
        assert_eq!(
            parse(&["--carrier-grace", "250ms"])
                .unwrap()
                .settings()
                .carrier_grace,
            Duration::from_millis(250)
        );
        assert!(parse(&["--progress-interval", "2h"]).is_err());
        let a = parse(&["--worker-request-margin", "0", "--max-group-requests", "10"]).unwrap();
        assert_eq!(
            a.settings().requests,
            RequestBound {
                over_capacity: 0,
                per_group: 10
            }
        );
        assert!(parse(&["--worker-request-margin", "70000"]).is_err());
        assert!(parse(&["--max-group-requests", "0"]).is_err());
        // A bound whose snapshot no watcher could decode is refused at start-up.
        assert!(parse(&["--max-group-requests", "300000"]).is_err());
    }
}
