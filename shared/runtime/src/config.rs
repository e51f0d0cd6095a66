//! Configuration: clap derive flags, each also an environment variable `BALANCEROUTE_<NAME>`,
//! and an optional `--config FILE` (TOML) that may set any flag.
//!
//! Precedence, lowest first: defaults < file < environment < command line.
//!
//! How it works ([`parse_from`]): the arguments are parsed once leniently to learn which flags
//! came from the command line or the environment (clap's `value_source`) and where the config
//! file is. Every key of the file names a flag (`snapshot_addr` or `snapshot-addr`); for each
//! flag that the command line and the environment left unset, the file's value is inserted as
//! `--flag=value` before the user's arguments, and everything is parsed again, strictly. An
//! unknown key in the file is an error, so typos do not go unnoticed. Then
//! [`Validate::validate`] runs.
//!
//! # Example
//! ```
//! use br_runtime::config::{self, CommonArgs, Validate};
//! use clap::Parser;
//!
//! /// br-example: what it does.
//! #[derive(Debug, Parser)]
//! // Per-service defaults of the common flags (`br_proto::defaults`, docs/conventions.md).
//! #[command(mut_arg("listen", |a| a.default_value(br_proto::defaults::DECISION_LISTEN)))]
//! #[command(mut_arg("admin_listen", |a| a.default_value(br_proto::defaults::DECISION_ADMIN_LISTEN)))]
//! struct Args {
//!     #[command(flatten)]
//!     common: CommonArgs,
//!     /// Where the snapshot service is. Addresses a binary dials default to br-all's port and
//!     /// read the same variable in every binary (`br_proto::defaults`).
//!     #[arg(long, env = br_proto::defaults::env::SNAPSHOT_ADDR, default_value = br_proto::defaults::SNAPSHOT_ADDR)]
//!     snapshot_addr: String,
//! }
//!
//! impl Validate for Args {
//!     fn validate(&self) -> Result<(), String> {
//!         if self.snapshot_addr.is_empty() {
//!             return Err("--snapshot-addr must not be empty".into());
//!         }
//!         Ok(())
//!     }
//! }
//!
//! // In main: `let args: Args = config::parse_or_exit();`
//! let args: Args = config::parse_from(["br-example", "--snapshot-addr", "http://x:1"]).unwrap();
//! assert_eq!(args.common.listen.port(), 50063);
//! assert_eq!(args.snapshot_addr, "http://x:1");
//! ```

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgAction, Parser};

use crate::observability::LogFormat;

/// The prefix of every environment variable.
pub const ENV_PREFIX: &str = "BALANCEROUTE_";

/// Default drain period after SIGTERM/SIGINT.
pub const DEFAULT_SHUTDOWN_GRACE: &str = "10s";

/// The flags every service binary has. Flatten it into the service's own `Parser` struct, and
/// set the service's default ports with `#[command(mut_arg("listen", ...))]` (see the module
/// example).
#[derive(Debug, Clone, clap::Args)]
pub struct CommonArgs {
    /// Address to serve the service on (gRPC, or HTTP for the shim).
    #[arg(long, env = "BALANCEROUTE_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,

    /// Address of the admin HTTP server (/metrics, /livez, /readyz).
    #[arg(long, env = "BALANCEROUTE_ADMIN_LISTEN", default_value = "127.0.0.1:0")]
    pub admin_listen: SocketAddr,

    /// Log format on stderr.
    #[arg(long, env = "BALANCEROUTE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Plain)]
    pub log_format: LogFormat,

    /// OTLP/gRPC endpoint for trace export (e.g. http://127.0.0.1:4317). Off when unset;
    /// OTEL_EXPORTER_OTLP_ENDPOINT is used when this is not given.
    #[arg(long, env = "BALANCEROUTE_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// Which spans are exported, in RUST_LOG's syntax (e.g. `info`,
    /// `br_decision=debug,info`), apart from what is logged: logs can stay at `warn` while
    /// info spans go to the collector. Unset: RUST_LOG's filter, else `info`.
    #[arg(long, env = "BALANCEROUTE_TRACE_FILTER")]
    pub trace_filter: Option<String>,

    /// How long to drain in-flight calls after SIGTERM/SIGINT before exiting (e.g. 250ms, 10s).
    #[arg(long, env = "BALANCEROUTE_SHUTDOWN_GRACE", value_parser = humantime::parse_duration, default_value = DEFAULT_SHUTDOWN_GRACE)]
    pub shutdown_grace: Duration,

    /// Once every port is bound, write the bound addresses here as JSON
    /// (`{"grpc": "127.0.0.1:50061", "admin": "127.0.0.1:9061"}`, `"http"` for the shim),
    /// atomically. With port 0 in `--listen`/`--admin-listen`, this is how a script or test
    /// learns the ports. Written when bound, not when ready (see `/readyz`).
    #[arg(long, env = "BALANCEROUTE_READY_FILE")]
    pub ready_file: Option<PathBuf>,

    /// TOML file that may set any flag (keys are flag names, `snake_case` or `kebab-case`).
    /// Precedence: defaults < file < environment < command line.
    #[arg(long, env = "BALANCEROUTE_CONFIG")]
    pub config: Option<PathBuf>,

    /// HTTP/2 keepalive: every connection this process serves or opens is pinged this often
    /// when idle, so a dead peer (a half-open connection: a partition, a dead node, a dropped
    /// conntrack entry) is found and its streams end. 0 turns it off.
    #[arg(long, env = "BALANCEROUTE_KEEPALIVE_INTERVAL", value_parser = humantime::parse_duration, default_value = "5s")]
    pub keepalive_interval: Duration,

    /// How long a keepalive ping may go unanswered before the connection is closed.
    #[arg(long, env = "BALANCEROUTE_KEEPALIVE_TIMEOUT", value_parser = humantime::parse_duration, default_value = "3s")]
    pub keepalive_timeout: Duration,

    /// A connection to `--listen` older than this is asked to go away (HTTP/2 GOAWAY), so its
    /// client connects again: to a rotated certificate's identity, and to whatever replica a
    /// load balancer now picks. Calls already running on it keep going for
    /// `--max-connection-age-grace`; then it is closed, and a telemetry or Watch stream is
    /// opened again by its client (a shim's worker is SUSPECT in σ until its Hello, a moment).
    /// 0 (the default) keeps connections for as long as they live.
    #[arg(long, env = "BALANCEROUTE_MAX_CONNECTION_AGE", value_parser = humantime::parse_duration, default_value = "0s")]
    pub max_connection_age: Duration,

    /// How long calls on a connection past `--max-connection-age` may still run before it is
    /// closed. Above `--max-wait` lets every Assign long poll finish on the old connection.
    #[arg(long, env = "BALANCEROUTE_MAX_CONNECTION_AGE_GRACE", value_parser = humantime::parse_duration, default_value = "1m")]
    pub max_connection_age_grace: Duration,

    /// Most connections open at once on `--listen`; further ones wait in the listen backlog
    /// until one closes. Lowered at start, if need be, to the descriptor limit (`ulimit -n`)
    /// minus 64, so idle connections can never take the last descriptors.
    #[arg(long, env = "BALANCEROUTE_MAX_CONNECTIONS", default_value_t = br_trust::accept::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,

    /// Most connections open at once on `--listen` from one IP address; a further one from it
    /// is closed when accepted and counted (`accept_failures_total{reason="peer_limit"}`), so
    /// one client cannot take every connection from the others.
    #[arg(long, env = "BALANCEROUTE_MAX_CONNECTIONS_PER_PEER", default_value_t = br_trust::accept::DEFAULT_MAX_CONNECTIONS_PER_PEER)]
    pub max_connections_per_peer: usize,

    /// A new connection on `--listen` that sends nothing for this long is closed (clients send
    /// their HTTP/2 preface or TLS hello at once).
    #[arg(long, env = "BALANCEROUTE_FIRST_BYTE_TIMEOUT", value_parser = humantime::parse_duration, default_value = "10s")]
    pub first_byte_timeout: Duration,

    /// Most HTTP/2 streams (calls) one connection to `--listen` may have open at once; a
    /// client waits for one to end before it opens another.
    #[arg(long, env = "BALANCEROUTE_MAX_STREAMS_PER_CONNECTION", default_value_t = crate::serve::DEFAULT_MAX_STREAMS_PER_CONNECTION)]
    pub max_streams_per_connection: u32,

    /// Most bytes of unfinished request messages (sent in part, their last byte still to come)
    /// the process holds across its gRPC ports and br-decision's HTTP/JSON port; a call whose
    /// message would pass it is refused RESOURCE_EXHAUSTED (429 on HTTP/JSON). A message that
    /// arrives whole in one read (every small call) is not counted, so it is served however
    /// full the budget is.
    #[arg(long, env = "BALANCEROUTE_MAX_IN_FLIGHT_MESSAGE_BYTES", default_value_t = crate::in_flight::DEFAULT_PROCESS_BYTES)]
    pub max_in_flight_message_bytes: usize,

    /// Most bytes of unfinished request messages one connection may make the process hold.
    #[arg(long, env = "BALANCEROUTE_MAX_IN_FLIGHT_MESSAGE_BYTES_PER_CONNECTION", default_value_t = crate::in_flight::DEFAULT_CONNECTION_BYTES)]
    pub max_in_flight_message_bytes_per_connection: usize,

    /// Mutual TLS and the plaintext-on-loopback default (see br-trust).
    #[command(flatten)]
    pub tls: br_trust::TlsArgs,
}

impl CommonArgs {
    /// The bounds of `--listen`'s accept loop; `--max-connections` lowered to fit
    /// `descriptor_limit` (the soft `RLIMIT_NOFILE`), see [`br_trust::accept::fit_to_descriptors`].
    pub fn accept_limits(&self, descriptor_limit: Option<u64>) -> br_trust::accept::AcceptLimits {
        br_trust::accept::AcceptLimits {
            max_connections: br_trust::accept::fit_to_descriptors(
                self.max_connections,
                descriptor_limit,
            ),
            max_connections_per_peer: self.max_connections_per_peer,
            first_byte_timeout: self.first_byte_timeout,
        }
    }

    /// The maximum connection age and its grace, `None` when turned off.
    pub fn max_connection_age(&self) -> Option<(Duration, Duration)> {
        (!self.max_connection_age.is_zero())
            .then_some((self.max_connection_age, self.max_connection_age_grace))
    }

    /// The keepalive interval, `None` when turned off.
    pub fn keepalive(&self) -> Option<(Duration, Duration)> {
        (!self.keepalive_interval.is_zero())
            .then_some((self.keepalive_interval, self.keepalive_timeout))
    }
}

/// Checks a parsed configuration before the service starts.
pub trait Validate {
    /// A message saying what is wrong, naming the flag.
    fn validate(&self) -> Result<(), String>;
}

impl Validate for CommonArgs {
    fn validate(&self) -> Result<(), String> {
        if self.shutdown_grace > Duration::from_secs(3600) {
            return Err("--shutdown-grace must be at most 1h".into());
        }
        if !(1..=1_000_000).contains(&self.max_connections) {
            return Err("--max-connections must be in 1..=1000000".into());
        }
        if !(1..=1_000_000).contains(&self.max_connections_per_peer) {
            return Err("--max-connections-per-peer must be in 1..=1000000".into());
        }
        if self.max_in_flight_message_bytes < 64 << 10 {
            return Err("--max-in-flight-message-bytes must be at least 65536".into());
        }
        if !(64 << 10..=self.max_in_flight_message_bytes)
            .contains(&self.max_in_flight_message_bytes_per_connection)
        {
            return Err(
                "--max-in-flight-message-bytes-per-connection must be at least 65536 \
                        and at most --max-in-flight-message-bytes"
                    .into(),
            );
        }
        if !(1..=65_536).contains(&self.max_streams_per_connection) {
            return Err("--max-streams-per-connection must be in 1..=65536".into());
        }
        if !(Duration::from_millis(100)..=Duration::from_secs(3600))
            .contains(&self.first_byte_timeout)
        {
            return Err("--first-byte-timeout must be in 100ms..=1h".into());
        }
        if let Some(ep) = &self.otlp_endpoint
            && !(ep.starts_with("http://") || ep.starts_with("https://"))
        {
            return Err(format!(
                "--otlp-endpoint {ep:?} must start with http:// or https://"
            ));
        }
        if let Some(f) = &self.trace_filter {
            tracing_subscriber::EnvFilter::try_new(f)
                .map_err(|e| format!("--trace-filter {f:?}: {e}"))?;
        }
        // each entry was parsed by clap; the map as a whole (one role per account) here
        self.tls
            .reader()
            .map_err(|e| format!("--spiffe-role-map: {e}"))?;
        Ok(())
    }
}

/// Why the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Bad flags, bad values, or `--help` / `--version` (clap renders these itself).
    #[error(transparent)]
    Clap(#[from] clap::Error),
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid TOML: {source}")]
    Toml {
        path: PathBuf,
        source: Box<toml::de::Error>,
    },
    #[error("config file {path}: unknown key {key:?} (keys are flag names)")]
    UnknownKey { path: PathBuf, key: String },
    #[error("config file {path}: key {key:?}: {reason}")]
    BadValue {
        path: PathBuf,
        key: String,
        reason: String,
    },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// The exit code of a binary whose flags, variables or config file are invalid (clap's own).
pub const EXIT_INVALID_CONFIG: u8 = 2;

/// Parses the process's arguments, environment and config file; prints the error (or the help)
/// and exits on failure. For `main`.
pub fn parse_or_exit<T: Parser + Validate>() -> T {
    match parse_from(std::env::args_os()) {
        Ok(t) => t,
        Err(ConfigError::Clap(e)) => e.exit(),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(EXIT_INVALID_CONFIG.into())
        }
    }
}

/// Parses `args` (the first is the binary name), the environment and the config file, then
/// validates. See the module docs for the precedence.
pub fn parse_from<T, I, A>(args: I) -> Result<T, ConfigError>
where
    T: Parser + Validate,
    I: IntoIterator<Item = A>,
    A: Into<OsString> + Clone,
{
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let cmd = T::command();

    // Lenient first pass: only to learn where each value came from and where the file is.
    // (A flag that is required but given only in the file would fail a strict pass.)
    let first = cmd
        .clone()
        .ignore_errors(true)
        .try_get_matches_from(&args)?;
    let config_path = first.get_one::<PathBuf>("config").cloned();

    let mut injected: Vec<OsString> = Vec::new();
    if let Some(path) = config_path {
        let table = read_toml(&path)?;
        injected = file_args(&cmd, &first, &path, &table)?;
    }

    let mut full = Vec::with_capacity(args.len() + injected.len());
    let mut rest = args.into_iter();
    if let Some(bin) = rest.next() {
        full.push(bin);
    }
    // Before the user's arguments, so they never land after `--` or a subcommand.
    full.extend(injected);
    full.extend(rest);

    let matches = cmd.try_get_matches_from(full)?;
    let t = T::from_arg_matches(&matches)?;
    t.validate().map_err(ConfigError::Invalid)?;
    Ok(t)
}

fn read_toml(path: &Path) -> Result<toml::Table, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    text.parse::<toml::Table>()
        .map_err(|source| ConfigError::Toml {
            path: path.to_owned(),
            source: Box::new(source),
        })
}

/// Turns the file's keys into `--flag=value` arguments for every flag that neither the command
/// line nor the environment set.
fn file_args(
    cmd: &clap::Command,
    matches: &clap::ArgMatches,
    path: &Path,
    table: &toml::Table,
) -> Result<Vec<OsString>, ConfigError> {
    let mut out = Vec::new();
    for (key, value) in table {
        let bad = |reason: &str| ConfigError::BadValue {
            path: path.to_owned(),
            key: key.clone(),
            reason: reason.to_owned(),
        };
        let id = key.replace('-', "_");
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id().as_str() == id || a.get_long() == Some(key.as_str()))
            .filter(|a| a.get_long().is_some())
            .ok_or_else(|| ConfigError::UnknownKey {
                path: path.to_owned(),
                key: key.clone(),
            })?;
        if arg.get_id().as_str() == "config" {
            return Err(bad("a config file cannot name another config file"));
        }
        let long = arg.get_long().unwrap_or_default();
        if let Some(ValueSource::CommandLine | ValueSource::EnvVariable) =
            matches.value_source(arg.get_id().as_str())
        {
            continue;
        }
        match arg.get_action() {
            ArgAction::SetTrue | ArgAction::SetFalse => {
                let toml::Value::Boolean(b) = value else {
                    return Err(bad("expected true or false"));
                };
                // A SetTrue flag is set by its presence; SetFalse by its presence too.
                let present = matches!(arg.get_action(), ArgAction::SetTrue) == *b;
                if present {
                    out.push(OsString::from(format!("--{long}")));
                }
            }
            ArgAction::Set | ArgAction::Append => {
                let values: Vec<&toml::Value> = match value {
                    toml::Value::Array(items) => {
                        if !matches!(arg.get_action(), ArgAction::Append) {
                            return Err(bad("expected a single value, not a list"));
                        }
                        items.iter().collect()
                    }
                    v => vec![v],
                };
                for v in values {
                    let s = scalar(v).ok_or_else(|| bad("expected a string, number or boolean"))?;
                    out.push(OsString::from(format!("--{long}={s}")));
                }
            }
            _ => return Err(bad("this flag cannot be set from a config file")),
        }
    }
    Ok(out)
}

fn scalar(v: &toml::Value) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        toml::Value::Datetime(d) => Some(d.to_string()),
        toml::Value::Array(_) | toml::Value::Table(_) => None,
    }
}

/// Checks that every flag of `cmd` has the environment variable the conventions require
/// (`--snapshot-addr` -> `BALANCEROUTE_SNAPSHOT_ADDR`). Call it from each service's tests:
/// `assert_eq!(check_env_names(&Args::command()), Ok(()))`.
pub fn check_env_names(cmd: &clap::Command) -> Result<(), Vec<String>> {
    let mut wrong = Vec::new();
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if matches!(long, "help" | "version") {
            continue;
        }
        let want = format!("{ENV_PREFIX}{}", long.replace('-', "_").to_uppercase());
        match arg.get_env().and_then(|e| e.to_str()) {
            Some(env) if env == want => {}
            Some(env) => wrong.push(format!("--{long}: env is {env}, expected {want}")),
            None => wrong.push(format!("--{long}: no env, expected {want}")),
        }
    }
    if wrong.is_empty() { Ok(()) } else { Err(wrong) }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;
    use clap::CommandFactory as _;
    use std::io::Write as _;

    #[derive(Debug, Parser)]
    #[command(name = "br-test")]
    #[command(mut_arg("listen", |a| a.default_value("127.0.0.1:50061")))]
    struct Args {
        #[command(flatten)]
        common: CommonArgs,
        /// A string flag.
        #[arg(long, env = "BALANCEROUTE_TEST_NAME", default_value = "default")]
        test_name: String,
        /// A number flag.
        #[arg(long, env = "BALANCEROUTE_TEST_COUNT", default_value_t = 1)]
        test_count: u32,
        /// A boolean flag.
        #[arg(long, env = "BALANCEROUTE_TEST_ENABLE")]
        test_enable: bool,
        /// A list flag.
        #[arg(long, env = "BALANCEROUTE_TEST_ITEM")]
        test_item: Vec<String>,
    }

    impl Validate for Args {
        fn validate(&self) -> Result<(), String> {
            self.common.validate()?;
            if self.test_count == 0 {
                return Err("--test-count must be positive".into());
            }
            Ok(())
        }
    }

    fn file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    fn parse(args: &[&str]) -> Result<Args, ConfigError> {
        parse_from(std::iter::once("br-test").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_apply_without_file() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.test_name, "default");
        assert_eq!(a.test_count, 1);
        assert!(!a.test_enable);
        assert_eq!(a.common.listen, "127.0.0.1:50061".parse().unwrap());
        assert_eq!(a.common.admin_listen.port(), 0);
        assert_eq!(a.common.shutdown_grace, Duration::from_secs(10));
        assert_eq!(a.common.log_format, LogFormat::Plain);
        assert_eq!(a.common.ready_file, None);
    }

    #[test]
    fn file_overrides_defaults() {
        let f = file(
            "test_name = \"from-file\"\n\
             test-count = 7\n\
             test_enable = true\n\
             test_item = [\"a\", \"b\"]\n\
             shutdown_grace = \"250ms\"\n\
             log_format = \"json\"\n\
             listen = \"127.0.0.1:6000\"\n\
             ready-file = \"/run/br/ready.json\"\n",
        );
        let a = parse(&["--config", f.path().to_str().unwrap()]).unwrap();
        assert_eq!(a.test_name, "from-file");
        assert_eq!(a.test_count, 7);
        assert!(a.test_enable);
        assert_eq!(a.test_item, vec!["a", "b"]);
        assert_eq!(a.common.shutdown_grace, Duration::from_millis(250));
        assert_eq!(a.common.log_format, LogFormat::Json);
        assert_eq!(a.common.listen.port(), 6000);
        assert_eq!(
            a.common.ready_file,
            Some(PathBuf::from("/run/br/ready.json"))
        );
    }

    #[test]
    fn flags_override_file() {
        let f = file("test_name = \"from-file\"\ntest_count = 7\n");
        let a = parse(&[
            "--test-name",
            "from-flag",
            "--config",
            f.path().to_str().unwrap(),
        ])
        .unwrap();
        assert_eq!(a.test_name, "from-flag");
        assert_eq!(
            a.test_count, 7,
            "keys not given as flags still come from the file"
        );
    }

    #[test]
    fn help_is_reported_not_swallowed() {
        let err = parse(&["--help"]).unwrap_err();
        let ConfigError::Clap(e) = err else {
            panic!("expected a clap error")
        };
        assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp);
        let help = e.to_string();
        assert!(help.contains("BALANCEROUTE_SHUTDOWN_GRACE"), "{help}");
    }

    #[test]
    fn a_required_flag_may_come_from_the_file() {
        #[derive(Debug, Parser)]
        struct Req {
            #[command(flatten)]
            common: CommonArgs,
            #[arg(long, env = "BALANCEROUTE_TEST_UPSTREAM")]
            test_upstream: String,
        }
        impl Validate for Req {
            fn validate(&self) -> Result<(), String> {
                self.common.validate()
            }
        }
        assert!(matches!(
            parse_from::<Req, _, _>(["br-test"]),
            Err(ConfigError::Clap(_))
        ));
        let f = file("test_upstream = \"http://127.0.0.1:8000\"\n");
        let r: Req = parse_from(["br-test", "--config", f.path().to_str().unwrap()]).unwrap();
        assert_eq!(r.test_upstream, "http://127.0.0.1:8000");
        assert_eq!(r.common.config.as_deref(), Some(f.path()));
    }

    #[test]
    fn unknown_key_is_an_error() {
        let f = file("test_nmae = \"typo\"\n");
        let err = parse(&["--config", f.path().to_str().unwrap()]).unwrap_err();
        assert!(
            matches!(&err, ConfigError::UnknownKey { key, .. } if key == "test_nmae"),
            "{err}"
        );
    }

    #[test]
    fn bad_values_are_errors() {
        let f = file("test_count = \"many\"\n");
        assert!(matches!(
            parse(&["--config", f.path().to_str().unwrap()]),
            Err(ConfigError::Clap(_))
        ));
        let f = file("test_enable = \"yes\"\n");
        assert!(matches!(
            parse(&["--config", f.path().to_str().unwrap()]),
            Err(ConfigError::BadValue { .. })
        ));
        let f = file("test_name = [\"a\"]\n");
        assert!(matches!(
            parse(&["--config", f.path().to_str().unwrap()]),
            Err(ConfigError::BadValue { .. })
        ));
        let f = file("not toml = = =\n");
        assert!(matches!(
            parse(&["--config", f.path().to_str().unwrap()]),
            Err(ConfigError::Toml { .. })
        ));
        assert!(matches!(
            parse(&["--config", "/nonexistent/br.toml"]),
            Err(ConfigError::Read { .. })
        ));
    }

    #[test]
    fn validation_runs() {
        let err = parse(&["--test-count", "0"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid configuration: --test-count must be positive"
        );
        let err = parse(&["--otlp-endpoint", "collector:4317"]).unwrap_err();
        assert!(matches!(err, ConfigError::Invalid(_)));
        let err = parse(&["--trace-filter", "br_decision=loud"]).unwrap_err();
        assert!(err.to_string().contains("--trace-filter"), "{err}");
        assert!(parse(&["--trace-filter", "br_decision=debug,info"]).is_ok());
    }

    #[test]
    fn env_names_follow_the_convention() {
        assert_eq!(check_env_names(&Args::command()), Ok(()));

        #[derive(Debug, Parser)]
        struct Bad {
            #[arg(long, env = "WRONG")]
            snapshot_addr: String,
        }
        let errs = check_env_names(&Bad::command()).unwrap_err();
        assert_eq!(
            errs,
            vec!["--snapshot-addr: env is WRONG, expected BALANCEROUTE_SNAPSHOT_ADDR".to_string()]
        );
    }

    /// The environment cannot be changed in-process without `unsafe` (edition 2024), so the
    /// environment's place in the precedence is checked in a child process: this test re-runs
    /// its own binary on itself with the variables set, and the child (which sees
    /// `BR_CONFIG_PROBE`) parses and prints what it got. One test plays both parts, so there
    /// is no probe that could pass on its own without checking anything.
    #[test]
    fn env_overrides_file_and_flags_override_env() {
        const ME: &str = "config::tests::env_overrides_file_and_flags_override_env";
        if let Some(path) = std::env::var_os("BR_CONFIG_PROBE") {
            let path = path.into_string().unwrap();
            let a = parse(&["--config", &path, "--test-count", "9"]).unwrap();
            println!(
                "PROBE name={} count={} grace={} format={:?}",
                a.test_name,
                a.test_count,
                humantime::format_duration(a.common.shutdown_grace),
                a.common.log_format
            );
            return;
        }
        let f = file("test_name = \"from-file\"\ntest_count = 7\nshutdown_grace = \"3s\"\n");
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args(["--exact", ME, "--nocapture", "--test-threads=1"])
            .env("BR_CONFIG_PROBE", f.path())
            .env("BALANCEROUTE_TEST_NAME", "from-env")
            .env("BALANCEROUTE_TEST_COUNT", "8")
            .env("BALANCEROUTE_LOG_FORMAT", "json")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "child failed: {stdout}");
        // env beats file for test_name; the flag beats env for test_count; the file still
        // sets shutdown_grace (not in env or flags); env sets log_format over the default.
        assert!(
            stdout.contains("PROBE name=from-env count=9 grace=3s format=Json"),
            "{stdout}"
        );
    }
}
