//! br-ingest's flags (each also `BALANCEROUTE_<FLAG>`, and settable from `--config FILE`).

use std::time::Duration;

use br_proto::valid::{GroupId, limits};
use br_runtime::config::CommonArgs;
use br_runtime::skeleton::ServiceArgs;
use clap::Parser;

pub const DEFAULT_LISTEN: &str = br_proto::defaults::INGEST_LISTEN;
pub const DEFAULT_ADMIN_LISTEN: &str = br_proto::defaults::INGEST_ADMIN_LISTEN;
/// Where the snapshot service is by default: br-all's port, like every client's default (the
/// split deployment names br-snapshot with `BALANCEROUTE_SNAPSHOT_ADDR`, deploy/split.env).
pub const DEFAULT_SNAPSHOT_ADDR: &str = br_proto::defaults::SNAPSHOT_ADDR;
pub const DEFAULT_BATCH_INTERVAL: &str = "2ms";
pub const DEFAULT_BATCH_SPACING: &str = "0s";
pub const DEFAULT_MAX_BUFFERED: usize = 65_536;
pub const DEFAULT_MAX_UPDATES_PER_MESSAGE: usize = limits::MAX_UPDATES_PER_PROGRESS;
pub const DEFAULT_MAX_EVENTS_PER_SEC_PER_STREAM: u32 = 250_000;
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 8 << 20;
/// An honest shim sends its Hello as the stream opens; 5 s covers a slow, loaded one.
pub const DEFAULT_HELLO_TIMEOUT: &str = "5s";
/// Ten of the reporter's 1 s heartbeats (br-client's `DEFAULT_HEARTBEAT_EVERY`): a shim that
/// pauses for a few seconds keeps its stream, a silent one loses it.
pub const DEFAULT_STREAM_IDLE_TIMEOUT: &str = "10s";
/// One untraced telemetry message in this many per stream gets a span (traces on).
pub const DEFAULT_MESSAGE_SPAN_EVERY: u64 = 1000;

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
    #[arg(long, env = br_proto::defaults::env::SNAPSHOT_ADDR, default_value = DEFAULT_SNAPSHOT_ADDR)]
    pub snapshot_addr: String,

    /// Longest a change waits to be sent while the snapshot service is still applying earlier
    /// batches (e.g. 2ms). While it has acknowledged every batch, changes go at once; while
    /// it has not, they coalesce into one batch per group until its acks are in or this
    /// interval has passed.
    #[arg(long, env = "BALANCEROUTE_BATCH_INTERVAL", value_parser = humantime::parse_duration, default_value = DEFAULT_BATCH_INTERVAL)]
    pub batch_interval: Duration,

    /// Shortest time between two batches while the snapshot service keeps up (0s: none, a
    /// change goes the moment every earlier batch is acknowledged). Raise it towards
    /// --batch-interval to send fewer, larger batches at the cost of the wait.
    #[arg(long, env = "BALANCEROUTE_BATCH_SPACING", value_parser = humantime::parse_duration, default_value = DEFAULT_BATCH_SPACING)]
    pub batch_spacing: Duration,

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

    /// How long a new Telemetry.Report stream may go without its Hello: past it the stream is
    /// ended with DEADLINE_EXCEEDED (counted in `balanceroute_ingest_stream_timeouts_total{reason="hello"}`),
    /// so a client that opens streams and never speaks holds no task, buffer or slot.
    #[arg(long, env = "BALANCEROUTE_HELLO_TIMEOUT", value_parser = humantime::parse_duration, default_value = DEFAULT_HELLO_TIMEOUT)]
    pub hello_timeout: Duration,

    /// With traces exported (`--otlp-endpoint`), one telemetry message in this many per
    /// stream gets a span of its own (a root trace); 0: none. A message whose reporter traced
    /// it (a shim exporting traces sends its span's context) always continues that trace, so
    /// the shims' sampler sets how many of those there are. 1: a span per message (the old
    /// behaviour: 100k root traces a second at 100k single-update messages a second).
    #[arg(long, env = "BALANCEROUTE_MESSAGE_SPAN_EVERY", default_value_t = DEFAULT_MESSAGE_SPAN_EVERY)]
    pub message_span_every: u64,

    /// How long a stream that said Hello may go without a message (Progress, Heartbeat or
    /// Hello; HTTP/2 keepalive pings do not count): past it the stream is ended with
    /// DEADLINE_EXCEEDED and the worker is disconnected as if its stream had dropped (counted
    /// in `balanceroute_ingest_stream_timeouts_total{reason="idle"}`). Keep it well above the
    /// shims' heartbeat period (1 s). 0 turns it off.
    #[arg(long, env = "BALANCEROUTE_STREAM_IDLE_TIMEOUT", value_parser = humantime::parse_duration, default_value = DEFAULT_STREAM_IDLE_TIMEOUT)]
    pub stream_idle_timeout: Duration,
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
        if self.batch_spacing > self.batch_interval {
            return Err(format!(
                "--batch-spacing ({:?}) must be at most --batch-interval ({:?})",
                self.batch_spacing, self.batch_interval
            ));
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
        if self.hello_timeout < Duration::from_millis(100)
            || self.hello_timeout > Duration::from_secs(600)
        {
            return Err("--hello-timeout must be in 100ms..=600s".into());
        }
        if !self.stream_idle_timeout.is_zero()
            && (self.stream_idle_timeout < Duration::from_millis(100)
                || self.stream_idle_timeout > Duration::from_secs(3600))
        {
            return Err("--stream-idle-timeout must be 0 (off) or in 100ms..=1h".into());
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
        assert!(a.batch_spacing.is_zero());
        assert!(a.groups.is_empty());
        assert_eq!(a.hello_timeout, Duration::from_secs(5));
        assert_eq!(a.stream_idle_timeout, Duration::from_secs(10));
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
            "--batch-spacing",
            "5ms",
            "--max-buffered",
            "10",
        ])
        .unwrap();
        assert_eq!(a.groups, vec!["g0", "g1"]);
        assert_eq!(a.batch_interval, Duration::from_millis(5));
        assert_eq!(a.batch_spacing, Duration::from_millis(5));
        assert_eq!(a.max_buffered, 10);
        let off: Args = parse_from([
            "br-ingest",
            "--stream-idle-timeout",
            "0s",
            "--hello-timeout",
            "750ms",
        ])
        .unwrap();
        assert!(off.stream_idle_timeout.is_zero());
        assert_eq!(off.hello_timeout, Duration::from_millis(750));

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
            vec!["br-ingest", "--batch-spacing", "3ms"],
            vec!["br-ingest", "--snapshot-addr", "127.0.0.1:1"],
            vec!["br-ingest", "--max-events-per-sec-per-stream", "0"],
            vec!["br-ingest", "--groups", ""],
            vec!["br-ingest", "--ingest-id", ""],
            vec!["br-ingest", "--hello-timeout", "0s"],
            vec!["br-ingest", "--hello-timeout", "10ms"],
            vec!["br-ingest", "--stream-idle-timeout", "1ms"],
        ] {
            assert!(parse_from::<Args, _, _>(bad.clone()).is_err(), "{bad:?}");
        }
    }
}
