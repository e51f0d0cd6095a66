//! `br-shim`'s flags. Each is also `BALANCEROUTE_<FLAG>` and may be set in the `--config`
//! TOML file (precedence: defaults < file < environment < flags).

use br_proto::valid::limits;
use br_runtime::config::CommonArgs;
use br_runtime::skeleton::ServiceArgs;
use clap::Parser;

pub const DEFAULT_LISTEN: &str = br_proto::defaults::SHIM_LISTEN;
pub const DEFAULT_ADMIN_LISTEN: &str = br_proto::defaults::SHIM_ADMIN_LISTEN;
pub const DEFAULT_UPSTREAM: &str = "http://127.0.0.1:8000";
/// Where the shim reports by default: br-all's port (the split deployment names br-ingest with
/// `BALANCEROUTE_INGEST_ADDR`, deploy/split.env).
pub const DEFAULT_INGEST_ADDR: &str = br_proto::defaults::INGEST_ADDR;
/// Default largest request body (a 128k-token prompt as token ids is ~1 MB of JSON).
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;
/// Default requests proxied at once (a rank runs at most `--capacity`, 256 by default; the
/// rest are queued in the engine, not here).
pub const DEFAULT_MAX_CONCURRENT_REQUESTS: usize = 1024;
/// Default request-body bytes held at once for inspection: four bodies of the largest size.
/// Each costs about twice its size (received and sent on), so about 128 MiB at the peak, within
/// the example pod's 256 MiB.
pub const DEFAULT_MAX_BUFFERED_BODY_BYTES: usize = 4 * DEFAULT_MAX_BODY_BYTES;
/// Default time for a request body to arrive (nginx's `client_body_timeout` is 60 s between
/// reads; this is for the whole body, which a gateway on the same network sends at once).
pub const DEFAULT_BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// br-shim: forwards an OpenAI-compatible decode rank's traffic untouched and reports each
/// request's token progress to BalanceRoute's ingest.
#[derive(Debug, Clone, Parser)]
#[command(name = "br-shim", version)]
#[command(mut_arg("listen", |a| a.default_value(DEFAULT_LISTEN)))]
#[command(mut_arg("admin_listen", |a| a.default_value(DEFAULT_ADMIN_LISTEN)))]
pub struct Args {
    #[command(flatten)]
    pub common: CommonArgs,
    /// The decode rank's OpenAI-compatible base URL.
    #[arg(long, env = "BALANCEROUTE_UPSTREAM", default_value = DEFAULT_UPSTREAM)]
    pub upstream: String,
    /// Ingest's gRPC URL, or several replicas' URLs separated by commas (the reporter uses one
    /// at a time and moves to the next, with backoff, when its stream is lost); one DNS name
    /// resolving to several replicas works too. Empty to forward without reporting.
    #[arg(long, env = br_proto::defaults::env::INGEST_ADDR, default_value = DEFAULT_INGEST_ADDR)]
    pub ingest_addr: String,
    /// The lockstep group the rank belongs to.
    #[arg(long, env = "BALANCEROUTE_GROUP", default_value = "default")]
    pub group: String,
    /// The rank's DP rank within its group (at most 1023, the contract's limit).
    #[arg(long, env = "BALANCEROUTE_WORKER_ID", default_value_t = 0)]
    pub worker_id: u32,
    /// B: the most requests the rank runs at once (the engine's max_num_seqs).
    #[arg(long, env = "BALANCEROUTE_CAPACITY", default_value_t = 256)]
    pub capacity: u32,
    /// Where gateways should send this rank's requests, as announced to ingest (default: this
    /// shim's own http://LISTEN).
    #[arg(long, env = "BALANCEROUTE_ENDPOINT")]
    pub endpoint: Option<String>,
    /// Ask the engine for per-chunk usage (vLLM's stream_options) and strip what the client
    /// did not ask for; `false` for engines that reject stream_options (then chunks are counted).
    #[arg(long, env = "BALANCEROUTE_INJECT_USAGE", default_value_t = true, action = clap::ArgAction::Set)]
    pub inject_usage: bool,
    /// Largest request body accepted; a larger one is answered 413 with a JSON error.
    #[arg(long, env = "BALANCEROUTE_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Requests proxied at once; one more is answered 503 with a JSON error (retry).
    #[arg(long, env = "BALANCEROUTE_MAX_CONCURRENT_REQUESTS", default_value_t = DEFAULT_MAX_CONCURRENT_REQUESTS)]
    pub max_concurrent_requests: usize,
    /// Request-body bytes held at once for inspection, across all requests (each body holds
    /// its declared length, or --max-body-bytes when chunked); one more is answered 503 with a
    /// JSON error (retry). At least --max-body-bytes.
    #[arg(long, env = "BALANCEROUTE_MAX_BUFFERED_BODY_BYTES", default_value_t = DEFAULT_MAX_BUFFERED_BODY_BYTES)]
    pub max_buffered_body_bytes: usize,
    /// How long a request body the shim inspects may take to arrive; a slower one is answered
    /// 408 with a JSON error.
    #[arg(long, env = "BALANCEROUTE_BODY_TIMEOUT", value_parser = humantime::parse_duration, default_value = "30s")]
    pub body_timeout: std::time::Duration,
    /// How long a client may take to send a request's headers on the proxy port (HTTP/1);
    /// a connection whose headers have not all arrived by then is closed (a slowloris client
    /// otherwise holds it, and one of --max-connections, forever).
    #[arg(long, env = "BALANCEROUTE_HEADER_READ_TIMEOUT", value_parser = humantime::parse_duration, default_value = "10s")]
    pub header_read_timeout: std::time::Duration,
    /// How often the reporter sends what changed (one batched `Progress` per rank per interval
    /// while tokens flow): the longest a token waits in the shim before it leaves for ingest.
    /// The first change after an interval with none goes at once, so only a busy rank's tokens
    /// wait. Shorter shows ingest and the deciders a fresher σ, at the cost of more, smaller
    /// messages (ingest's work grows with messages per second; docs/benchmarks.md, "telemetry
    /// latency").
    #[arg(long, env = "BALANCEROUTE_REPORT_FLUSH_INTERVAL", value_parser = humantime::parse_duration, default_value = "5ms")]
    pub report_flush_interval: std::time::Duration,
    /// Refuse a generation request without an `X-Request-Id` header (400 with a JSON error,
    /// counted as `refused_total{reason="no_request_id"}`) instead of reporting it by the
    /// engine's response id as an unkeyed request (the request-id rule, README "Request ids").
    #[arg(long, env = "BALANCEROUTE_REQUIRE_REQUEST_ID", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub require_request_id: bool,
    #[command(flatten)]
    pub health: HealthArgs,
    #[command(flatten)]
    pub topology: TopologyArgs,
}

/// When one engine server serves several DP ranks (see the `topology` module).
#[derive(Debug, Clone, clap::Args)]
pub struct TopologyArgs {
    /// Set this header to the rank on every request forwarded (vLLM with one API server for
    /// all DP ranks: `X-data-parallel-rank`).
    #[arg(long, env = "BALANCEROUTE_DP_RANK_HEADER")]
    pub dp_rank_header: Option<String>,
    /// Set this top-level JSON field to the rank in every generation request (SGLang's DP
    /// controller: `routed_dp_rank`; `data_parallel_rank` before SGLang renamed it).
    #[arg(long, env = "BALANCEROUTE_DP_RANK_FIELD")]
    pub dp_rank_field: Option<String>,
    /// Serve several ranks of one server from this process, e.g. `0-7` or `0,2,4-6` (replaces
    /// --worker-id): one telemetry stream per rank; a request names its rank by the path
    /// prefix `/rank/<n>/`, and rank n announces `<endpoint>/rank/<n>`. Needs
    /// --dp-rank-header or --dp-rank-field.
    #[arg(long, env = "BALANCEROUTE_WORKER_IDS")]
    pub worker_ids: Option<String>,
    /// With --dp-rank-header or --dp-rank-field: before any rank's first Hello, send the
    /// engine one-token completions, one unpinned and one pinned to each rank, and exit with 2
    /// if it refuses a rank it accepts unpinned (a rank the server does not have). Needs
    /// probing (--engine-probe-interval above 0).
    #[arg(long, env = "BALANCEROUTE_VERIFY_RANKS", default_value_t = true, action = clap::ArgAction::Set)]
    pub verify_ranks: bool,
}

impl Args {
    /// The ranks this shim serves: `--worker-ids`, else `--worker-id`.
    pub fn ranks(&self) -> Result<Vec<u32>, String> {
        match &self.topology.worker_ids {
            Some(spec) => crate::topology::parse_worker_ids(spec, limits::MAX_WORKER_ID),
            None => Ok(vec![self.worker_id]),
        }
    }

    /// The `worker` label of the process's own series: `--worker-ids` as given (trimmed), or
    /// the `--worker-id`.
    pub fn worker_label(&self) -> String {
        match &self.topology.worker_ids {
            Some(spec) => spec.replace(' ', ""),
            None => self.worker_id.to_string(),
        }
    }
}

/// How the shim judges its engine's health (see the `health` module): a worker whose engine
/// does not answer leaves routing within interval + timeout.
#[derive(Debug, Clone, clap::Args)]
pub struct HealthArgs {
    /// The engine path probed with GET (2xx = alive): `/health` for vLLM, SGLang and br-emu;
    /// `/v1/models` for other OpenAI-compatible servers.
    #[arg(long, env = "BALANCEROUTE_ENGINE_PROBE_PATH", default_value = crate::health::DEFAULT_PROBE_PATH)]
    pub engine_probe_path: String,
    /// Time between two probes of the engine; 0 turns probing off (the worker is then taken
    /// out of routing only by a run of failed requests).
    #[arg(long, env = "BALANCEROUTE_ENGINE_PROBE_INTERVAL", value_parser = humantime::parse_duration, default_value = "500ms")]
    pub engine_probe_interval: std::time::Duration,
    /// How long a probe may take before it counts as failed.
    #[arg(long, env = "BALANCEROUTE_ENGINE_PROBE_TIMEOUT", value_parser = humantime::parse_duration, default_value = "1s")]
    pub engine_probe_timeout: std::time::Duration,
    /// Proxied requests in a row that fail at the engine (no connection, 5xx, a body cut
    /// off) before the worker is taken out of routing.
    #[arg(long, env = "BALANCEROUTE_ENGINE_FAILURE_THRESHOLD", default_value_t = crate::health::DEFAULT_FAILURE_THRESHOLD)]
    pub engine_failure_threshold: u32,
}

impl ServiceArgs for Args {
    fn common(&self) -> &CommonArgs {
        &self.common
    }

    fn check(&self) -> Result<(), String> {
        if !self.upstream.starts_with("http://") {
            return Err(format!(
                "--upstream {:?} must be an http:// URL",
                self.upstream
            ));
        }
        let ok = |u: &str| u.starts_with("http://") || u.starts_with("https://");
        if !(self.ingest_addr.is_empty() || self.ingest_addr.split(',').all(|u| ok(u.trim()))) {
            return Err(format!(
                "--ingest-addr {:?} must be http(s):// URLs, comma-separated (or empty)",
                self.ingest_addr
            ));
        }
        // Checked here and not only by ingest: a shim with a bad id would forward traffic
        // while every Hello it sends is refused, so nothing it serves would reach σ.
        if self.worker_id > limits::MAX_WORKER_ID {
            return Err(format!(
                "--worker-id {} is above the highest worker id {} (the contract's limit)",
                self.worker_id,
                limits::MAX_WORKER_ID
            ));
        }
        if !(1024..=1 << 30).contains(&self.max_body_bytes) {
            return Err("--max-body-bytes must be in 1024..=2^30".into());
        }
        if !(1..=1_000_000).contains(&self.max_concurrent_requests) {
            return Err("--max-concurrent-requests must be in 1..=1000000".into());
        }
        if self.capacity == 0 {
            return Err("--capacity must be at least 1".into());
        }
        if self.body_timeout.is_zero() {
            return Err("--body-timeout must be above 0".into());
        }
        if self.header_read_timeout.is_zero() {
            return Err("--header-read-timeout must be above 0".into());
        }
        if !(std::time::Duration::from_millis(1)..=std::time::Duration::from_secs(1))
            .contains(&self.report_flush_interval)
        {
            return Err("--report-flush-interval must be in 1ms..=1s".into());
        }
        let ranks = self.ranks()?;
        if let Some(h) = &self.topology.dp_rank_header
            && axum::http::HeaderName::from_bytes(h.as_bytes()).is_err()
        {
            return Err(format!("--dp-rank-header {h:?} is not a header name"));
        }
        if self
            .topology
            .dp_rank_field
            .as_ref()
            .is_some_and(|f| f.is_empty())
        {
            return Err("--dp-rank-field must not be empty".into());
        }
        if ranks.len() > 1
            && self.topology.dp_rank_header.is_none()
            && self.topology.dp_rank_field.is_none()
        {
            return Err(format!(
                "--worker-ids {:?} names several ranks of one server: the server must be told                  the rank of each request (--dp-rank-header X-data-parallel-rank for vLLM,                  --dp-rank-field routed_dp_rank for SGLang), or its telemetry would be                  reported for the wrong worker",
                self.topology.worker_ids.as_deref().unwrap_or_default()
            ));
        }
        if !self.health.engine_probe_path.starts_with('/') {
            return Err(format!(
                "--engine-probe-path {:?} must start with /",
                self.health.engine_probe_path
            ));
        }
        if !self.health.engine_probe_interval.is_zero()
            && self.health.engine_probe_timeout.is_zero()
        {
            return Err("--engine-probe-timeout must be above 0".into());
        }
        if self.health.engine_failure_threshold == 0 {
            return Err("--engine-failure-threshold must be at least 1".into());
        }
        if self.max_buffered_body_bytes < self.max_body_bytes
            || self.max_buffered_body_bytes > tokio::sync::Semaphore::MAX_PERMITS
        {
            return Err(format!(
                "--max-buffered-body-bytes {} must be at least --max-body-bytes {} (a body of the \
                 largest size could never be taken)",
                self.max_buffered_body_bytes, self.max_body_bytes
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;
    use br_runtime::config::{ConfigError, check_env_names, parse_from};
    use clap::CommandFactory;

    #[test]
    fn every_flag_has_its_env_var() {
        assert_eq!(check_env_names(&Args::command()), Ok(()));
    }

    #[test]
    fn defaults_follow_the_conventions() {
        let a: Args = parse_from(["br-shim"]).expect("defaults parse");
        assert_eq!(a.common.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(a.common.admin_listen.to_string(), DEFAULT_ADMIN_LISTEN);
        assert_eq!(a.ingest_addr, DEFAULT_INGEST_ADDR);
        assert_eq!(a.upstream, DEFAULT_UPSTREAM);
        assert!(a.inject_usage);
        assert_eq!(a.body_timeout, DEFAULT_BODY_TIMEOUT);
        assert_eq!(
            a.report_flush_interval,
            br_client::reporter::DEFAULT_FLUSH_INTERVAL,
            "the shim's default is the reporter's"
        );
        assert_eq!(a.max_buffered_body_bytes, DEFAULT_MAX_BUFFERED_BODY_BYTES);
        assert_eq!(a.health.engine_probe_path, "/health");
        assert_eq!(
            a.health.engine_probe_interval,
            crate::health::DEFAULT_PROBE_INTERVAL
        );
        // interval + timeout is the longest a frozen engine stays in routing (1.5 s, within
        // the 2 s the shim promises)
        assert_eq!(
            a.health.engine_probe_timeout,
            std::time::Duration::from_secs(1)
        );
        assert_eq!(a.health.engine_failure_threshold, 3);
    }

    #[test]
    fn topologies_are_checked() {
        for bad in [
            vec!["br-shim", "--worker-ids", "0-3"],
            vec!["br-shim", "--worker-ids", "0-1024", "--dp-rank-field", "r"],
            vec!["br-shim", "--dp-rank-header", "bad header"],
            vec!["br-shim", "--dp-rank-field", ""],
        ] {
            assert!(parse_from::<Args, _, _>(bad.clone()).is_err(), "{bad:?}");
        }
        let a: Args = parse_from([
            "br-shim",
            "--worker-ids",
            "0-3, 6",
            "--dp-rank-header",
            "X-data-parallel-rank",
        ])
        .unwrap();
        assert_eq!(a.ranks().unwrap(), vec![0, 1, 2, 3, 6]);
        assert_eq!(a.worker_label(), "0-3,6");
        let a: Args = parse_from(["br-shim", "--worker-id", "5"]).unwrap();
        assert_eq!(a.ranks().unwrap(), vec![5]);
        assert_eq!(a.worker_label(), "5");
        // one rank of a shared server: a pin and no list
        let a: Args = parse_from([
            "br-shim",
            "--worker-id",
            "2",
            "--dp-rank-field",
            "routed_dp_rank",
        ])
        .unwrap();
        assert_eq!(a.ranks().unwrap(), vec![2]);
    }

    #[test]
    fn bad_health_flags_are_refused() {
        for bad in [
            vec!["br-shim", "--engine-probe-path", "health"],
            vec!["br-shim", "--engine-probe-timeout", "0s"],
            vec!["br-shim", "--engine-failure-threshold", "0"],
        ] {
            assert!(parse_from::<Args, _, _>(bad.clone()).is_err(), "{bad:?}");
        }
        let a: Args = parse_from(["br-shim", "--engine-probe-interval", "0s"]).unwrap();
        assert!(
            a.health.engine_probe_interval.is_zero(),
            "0 turns probing off"
        );
    }

    #[test]
    fn the_body_budget_must_hold_the_largest_body() {
        let e = parse_from::<Args, _, _>([
            "br-shim",
            "--max-body-bytes",
            "2048",
            "--max-buffered-body-bytes",
            "2047",
        ])
        .unwrap_err();
        assert!(
            e.to_string().contains("--max-buffered-body-bytes 2047"),
            "{e}"
        );
        assert!(parse_from::<Args, _, _>(["br-shim", "--body-timeout", "0s"]).is_err());
    }

    #[test]
    fn worker_id_is_bounded_by_the_contract() {
        let max = limits::MAX_WORKER_ID.to_string();
        let a: Args = parse_from(["br-shim", "--worker-id", &max]).unwrap();
        assert_eq!(a.worker_id, limits::MAX_WORKER_ID);
        let above = (limits::MAX_WORKER_ID + 1).to_string();
        let Err(ConfigError::Invalid(msg)) =
            parse_from::<Args, _, _>(["br-shim", "--worker-id", &above])
        else {
            panic!("--worker-id {above} accepted");
        };
        assert!(msg.contains("--worker-id") && msg.contains(&max), "{msg}");
    }

    #[test]
    fn bad_urls_and_capacity_are_refused() {
        for bad in [
            vec!["br-shim", "--upstream", "127.0.0.1:8000"],
            vec!["br-shim", "--ingest-addr", "127.0.0.1:50062"],
            vec!["br-shim", "--ingest-addr", "http://a:1,b:2"],
            vec!["br-shim", "--ingest-addr", "http://a:1,"],
            vec!["br-shim", "--capacity", "0"],
        ] {
            assert!(parse_from::<Args, _, _>(bad.clone()).is_err(), "{bad:?}");
        }
        let a: Args = parse_from(["br-shim", "--ingest-addr", ""]).unwrap();
        assert!(a.ingest_addr.is_empty(), "empty: forward without reporting");
        let a: Args = parse_from(["br-shim", "--ingest-addr", "http://a:1, https://b:2"]).unwrap();
        assert_eq!(a.ingest_addr, "http://a:1, https://b:2", "replicas");
    }

    #[test]
    fn the_report_flush_interval_is_bounded() {
        let ok: Args = parse_from(["br-shim", "--report-flush-interval", "1ms"]).unwrap();
        assert_eq!(
            ok.report_flush_interval,
            std::time::Duration::from_millis(1)
        );
        for bad in ["0s", "500us", "2s"] {
            let e = parse_from::<Args, _, _>(["br-shim", "--report-flush-interval", bad])
                .expect_err(bad)
                .to_string();
            assert!(e.contains("--report-flush-interval"), "{bad}: {e}");
        }
    }
}
