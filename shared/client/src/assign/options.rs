//! How the client is tuned: the retry backoff ([`RetryPolicy`]), the replica order
//! ([`Selection`]) and the connection and DNS settings ([`ClientOptions`]).
//!
//! Separate from the client: these are the knobs a gateway sets, documented on their own.

use super::*;

/// Backoff between rounds of retries (a round: every replica tried once and failed):
/// `initial`, doubling up to `max`, each drawn with br-backoff's equal jitter (in [d/2, d], so
/// never above `max`), and never past the deadline.
///
/// By default a call is retried until the caller's deadline, however many attempts that
/// takes: a restart of the decision service (refused connections, then "no σ yet" until the
/// workers have reconnected) lasts seconds, and a fixed count of quick retries gave up long
/// before it was over while the deadline still allowed waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    pub initial_backoff: Duration,
    /// The longest pause: with equal jitter, a replica that is down is tried again every
    /// `max_backoff / 2` to `max_backoff` by each waiting call.
    pub max_backoff: Duration,
    /// Most calls per `assign` (including the first) when set; `None` (the default): as many
    /// as fit before the deadline.
    pub max_attempts: Option<u32>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            initial_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(250),
            max_attempts: None,
        }
    }
}

impl RetryPolicy {
    /// Whether `attempts` calls used up an explicit attempt limit.
    pub(super) fn exhausted(&self, attempts: u32) -> bool {
        self.max_attempts.is_some_and(|max| attempts >= max)
    }

    /// The pause after the `round`-th round of failed calls (1-based).
    pub(super) fn backoff(&self, round: u32) -> Duration {
        br_backoff::delay(
            self.initial_backoff,
            self.max_backoff,
            round.saturating_sub(1),
            &mut rand::rng(),
        )
    }
}

/// Which replica a call goes to first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Selection {
    /// The first healthy replica in the list's order (a DNS name's addresses sorted): one pool
    /// decides for the group while it is healthy, the others take over when it fails.
    #[default]
    Ordered,
    /// Round-robin over the healthy replicas: every replica has a pool of its own (the twin's
    /// K deciders), so load spreads, at some cost in routing quality.
    RoundRobin,
}

impl std::str::FromStr for Selection {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ordered" => Ok(Selection::Ordered),
            "round-robin" => Ok(Selection::RoundRobin),
            other => Err(format!(
                "unknown selection {other:?} (ordered, round-robin)"
            )),
        }
    }
}

/// Connection and failover settings of an [`AssignClient`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientOptions {
    pub selection: Selection,
    /// Longest one attempt may take before the call moves to another replica (still within
    /// the caller's deadline). `None` (the default): an attempt may use the whole deadline,
    /// since a pooled `Assign` legitimately waits in the pool; a dead or frozen replica is then
    /// found by the connection (reset, or keepalive). Set it for on-arrival policies, whose
    /// answers take milliseconds.
    pub attempt_timeout: Option<Duration>,
    pub connect_timeout: Duration,
    /// HTTP/2 PING interval on every replica's connection (also while idle).
    pub keepalive_interval: Duration,
    /// A PING not answered within this closes the connection and fails its calls.
    pub keepalive_timeout: Duration,
    /// How often a DNS name is resolved again (new replicas join, gone ones leave).
    pub dns_refresh: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            selection: Selection::Ordered,
            attempt_timeout: None,
            connect_timeout: Duration::from_secs(1),
            keepalive_interval: Duration::from_secs(1),
            keepalive_timeout: Duration::from_secs(1),
            dns_refresh: Duration::from_secs(5),
        }
    }
}
