//! br-ingest's flags (each also `BALANCEROUTE_<FLAG>`, and settable from `--config FILE`).

use std::time::Duration;

use br_proto::valid::{GroupId, limits};
use br_runtime::config::CommonArgs;
use br_runtime::skeleton::ServiceArgs;
use clap::Parser;

pub const DEFAULT_LISTEN: &str = "127.0.0.1:50062";
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9062";
pub const DEFAULT_SNAPSHOT_ADDR: &str = "http://127.0.0.1:50061";
pub const DEFAULT_BATCH_INTERVAL: &str = "2ms";
pub const DEFAULT_MAX_BUFFERED: usize = 65_536;
pub const DEFAULT_MAX_UPDATES_PER_MESSAGE: usize = limits::MAX_UPDATES_PER_PROGRESS;
pub const DEFAULT_MAX_EVENTS_PER_SEC_PER_STREAM: u32 = 250_000;
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 8 << 20;

/// br-ingest: terminates the workers' telemetry streams (Telemetry.Report), validates them,
/// and streams coalesced change batches to the snapshot service (Snapshot.Apply).
#[derive(Debug, Clone, Parser)]
#[command(name = "br-ingest", version)]
#[command(mut_arg("listen", |a| a.default_value(DEFAULT_LISTEN)))]
#[command(mut_arg("admin_listen", |a| a.default_value(DEFAULT_ADMIN_LISTEN)))]
pub struct Args {
    #[command(flatten)]
    pub common: CommonArgs,

    /// The snapshot service's URL.
    #[arg(long, env = "BALANCEROUTE_SNAPSHOT_ADDR", default_value = DEFAULT_SNAPSHOT_ADDR)]
    pub snapshot_addr: String,

    /// How long changes are coalesced before one batch per group is sent (e.g. 2ms).
    #[arg(long, env = "BALANCEROUTE_BATCH_INTERVAL", value_parser = humantime::parse_duration, default_value = DEFAULT_BATCH_INTERVAL)]
    pub batch_interval: Duration,

    /// Most distinct requests waiting in the coalescing buffer (while the snapshot service is
    /// slow or away). Past it the oldest progress is dropped and its workers are asked for a
    /// full state.
    #[arg(long, env = "BALANCEROUTE_MAX_BUFFERED", default_value_t = DEFAULT_MAX_BUFFERED)]
    pub max_buffered: usize,

    /// Most request updates in one Progress message (at most 16384, the contract's limit).
    #[arg(long, env = "BALANCEROUTE_MAX_UPDATES_PER_MESSAGE", default_value_t = DEFAULT_MAX_UPDATES_PER_MESSAGE)]
    pub max_updates_per_message: usize,

    /// Rate limit per stream, in progress events per second (token bucket; the burst is one
    /// second's worth, or one full message if larger).
    #[arg(long, env = "BALANCEROUTE_MAX_EVENTS_PER_SEC_PER_STREAM", default_value_t = DEFAULT_MAX_EVENTS_PER_SEC_PER_STREAM)]
    pub max_events_per_sec_per_stream: u32,

    /// Largest telemetry message accepted, in bytes (larger ones end the stream with
    /// RESOURCE_EXHAUSTED).
    #[arg(long, env = "BALANCEROUTE_MAX_MESSAGE_BYTES", default_value_t = DEFAULT_MAX_MESSAGE_BYTES)]
    pub max_message_bytes: usize,

    /// Highest worker id (DP rank) accepted; a Hello above it is refused with
    /// INVALID_ARGUMENT. Set it to the group size minus one to catch misconfigured shims.
    #[arg(long, env = "BALANCEROUTE_MAX_WORKER_ID", default_value_t = limits::MAX_WORKER_ID)]
    pub max_worker_id: u32,

    /// Groups this ingest accepts (comma-separated); any group when empty. A Hello for
    /// another group is refused with PERMISSION_DENIED.
    #[arg(long, env = "BALANCEROUTE_GROUPS", value_delimiter = ',')]
    pub groups: Vec<String>,

    /// This replica's identity, sent on every Apply batch: σ records it as the carrier of the
    /// workers whose streams it terminates (WorkerState.carrier). Default: the host name and
    /// the process id (in Kubernetes, the pod name: set it from metadata.name). At most 128
    /// bytes.
    #[arg(long, env = "BALANCEROUTE_INGEST_ID")]
    pub ingest_id: Option<String>,
}

/// Longest `--ingest-id` (the snapshot service's limit on a carrier).
pub const MAX_INGEST_ID_BYTES: usize = 128;

impl Args {
    /// `--ingest-id`, or `<hostname>-<pid>` when it is not set.
    pub fn ingest_id(&self) -> String {
        match &self.ingest_id {
            Some(id) => id.clone(),
            None => default_ingest_id(),
        }
    }
}

/// `<hostname>-<pid>`: unique among replicas on distinct hosts, and among processes on one.
fn default_ingest_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty() && !h.chars().any(char::is_control))
        .unwrap_or_else(|| "ingest".into());
    let mut id = format!("{host}-{}", std::process::id());
    if id.len() > MAX_INGEST_ID_BYTES {
        // keep the pid, which tells processes apart; cut the host name on a char boundary
        let pid = format!("-{}", std::process::id());
        let mut cut = MAX_INGEST_ID_BYTES - pid.len();
        while !host.is_char_boundary(cut) {
            cut -= 1;
        }
        id = format!("{}{pid}", &host[..cut]);
    }
    id
}

impl ServiceArgs for Args {
    fn common(&self) -> &CommonArgs {
        &self.common
    }

    fn check(&self) -> Result<(), String> {
        if !(self.snapshot_addr.starts_with("http://")
            || self.snapshot_addr.starts_with("https://"))
        {
            return Err(format!(
                "--snapshot-addr {:?} must start with http:// or https://",
                self.snapshot_addr
            ));
        }
        if self.batch_interval < Duration::from_micros(100)
            || self.batch_interval > Duration::from_secs(1)
        {
            return Err("--batch-interval must be in 100us..=1s".into());
        }
        if self.max_buffered == 0 {
            return Err("--max-buffered must be at least 1".into());
        }
        if self.max_updates_per_message == 0
            || self.max_updates_per_message > limits::MAX_UPDATES_PER_PROGRESS
        {
            return Err(format!(
                "--max-updates-per-message must be in 1..={}",
                limits::MAX_UPDATES_PER_PROGRESS
            ));
        }
        if self.max_events_per_sec_per_stream == 0 {
            return Err("--max-events-per-sec-per-stream must be at least 1".into());
        }
        if self.max_message_bytes < 4096 {
            return Err("--max-message-bytes must be at least 4096".into());
        }
        if self.max_worker_id > limits::MAX_WORKER_ID {
            return Err(format!(
                "--max-worker-id must be at most {}",
                limits::MAX_WORKER_ID
            ));
        }
        for g in &self.groups {
            GroupId::new(g).map_err(|e| format!("--groups: {e}"))?;
        }
        if let Some(id) = &self.ingest_id
            && (id.is_empty() || id.len() > MAX_INGEST_ID_BYTES || id.chars().any(char::is_control))
        {
            return Err(format!(
                "--ingest-id must be 1..={MAX_INGEST_ID_BYTES} bytes without control characters"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use br_runtime::config::{check_env_names, parse_from};
    use clap::CommandFactory;

    #[test]
    fn defaults_follow_the_conventions() {
        let a: Args = parse_from(["br-ingest"]).unwrap();
        assert_eq!(a.common.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(a.common.admin_listen.to_string(), DEFAULT_ADMIN_LISTEN);
        assert_eq!(a.snapshot_addr, DEFAULT_SNAPSHOT_ADDR);
        assert_eq!(a.batch_interval, Duration::from_millis(2));
        assert!(a.groups.is_empty());
        assert_eq!(check_env_names(&Args::command()), Ok(()));
        let id = a.ingest_id();
        assert!(
            id.ends_with(&format!("-{}", std::process::id())) && id.len() <= MAX_INGEST_ID_BYTES,
            "{id}"
        );
        let named: Args = parse_from(["br-ingest", "--ingest-id", "ingest-7f9c"]).unwrap();
        assert_eq!(named.ingest_id(), "ingest-7f9c");
    }

    #[test]
    fn flags_file_and_validation() {
        let a: Args = parse_from([
            "br-ingest",
            "--groups",
            "g0,g1",
            "--batch-interval",
            "5ms",
            "--max-buffered",
            "10",
        ])
        .unwrap();
        assert_eq!(a.groups, vec!["g0", "g1"]);
        assert_eq!(a.batch_interval, Duration::from_millis(5));
        assert_eq!(a.max_buffered, 10);

        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(
            &mut f,
            b"groups = [\"a\"]\nmax-updates-per-message = 64\nsnapshot_addr = \"http://x:1\"\n",
        )
        .unwrap();
        let a: Args = parse_from([
            "br-ingest",
            "--config",
            f.path().to_str().unwrap(),
            "--snapshot-addr",
            "http://y:2",
        ])
        .unwrap();
        assert_eq!(a.groups, vec!["a"]);
        assert_eq!(a.max_updates_per_message, 64);
        assert_eq!(a.snapshot_addr, "http://y:2", "flags beat the file");

        for bad in [
            vec!["br-ingest", "--max-updates-per-message", "16385"],
            vec!["br-ingest", "--max-buffered", "0"],
            vec!["br-ingest", "--batch-interval", "0s"],
            vec!["br-ingest", "--snapshot-addr", "127.0.0.1:1"],
            vec!["br-ingest", "--max-events-per-sec-per-stream", "0"],
            vec!["br-ingest", "--groups", ""],
            vec!["br-ingest", "--ingest-id", ""],
        ] {
            assert!(parse_from::<Args, _, _>(bad.clone()).is_err(), "{bad:?}");
        }
    }
}
