//! The telemetry reporter: streams a worker's cumulative request progress to ingest
//! (`Telemetry.Report`). Used by the shim, and by gateways that report for their workers.
//!
//! Telemetry is state, not events, so the reporter keeps the *latest cumulative state* of each
//! request in a bounded map and sends what changed every few milliseconds, batched into one
//! `Progress` message. [`ReporterHandle::progress`] only updates that map under a short lock:
//! it never waits for the network, so the data path of the shim is never slowed by ingest.
//!
//! On every (re)connect the reporter sends its Hello and then a full state; it sends a full
//! state again every `full_state_every` and whenever an ack asks for one. While ingest is away
//! it keeps the state and reconnects with exponential backoff and jitter (br-backoff), to the
//! next of its ingest addresses (`ingest_addr` may list several replicas, comma-separated; one
//! DNS name of several replicas works too: each connect tries the name's addresses in turn).
//! When ingest ends the stream with ABORTED (the snapshot service refused this worker's
//! changes: σ holds another incarnation of it, fenced it or lost it), the reporter takes a new
//! incarnation and says Hello again with its full state, so σ takes it back clean; it counts
//! and logs that. A finished request is forgotten once an ack covers the message that reported
//! it finished.
//!
//! [`ReporterHandle::set_serving`]`(false)` (the shim's engine is down) ends the stream
//! cleanly, after its last changes, and holds off reconnecting until `set_serving(true)`: ingest
//! marks the worker SUSPECT at once (no new work), and the reconnect says Hello with the same
//! incarnation and a full state, so σ takes the worker back with its requests (or, if it was
//! fenced meanwhile, the refusal makes it a new incarnation as above). The state is kept
//! throughout.
//!
//! ```no_run
//! # async fn demo() -> Result<(), br_client::reporter::ReporterError> {
//! use br_client::reporter::{Reporter, ReporterConfig};
//! let cfg = ReporterConfig::new("http://127.0.0.1:50062", "g0", 3, 256);
//! let handle = Reporter::spawn(cfg)?;
//! handle.progress("req-1", 100, 0, false)?; // prompt known, nothing generated yet
//! handle.progress("req-1", 100, 17, false)?; // 17 tokens so far (cumulative)
//! handle.progress("req-1", 100, 42, true)?; // done
//! handle.shutdown().await; // flushes, ends the stream
//! # Ok(()) }
//! ```

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use br_backoff::Backoff;
use br_proto::ValidationError;
use br_proto::v1;
use br_proto::valid::{RequestId, ValidHello, limits};
use rand::Rng as _;
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

mod state;
mod task;

use state::{Entry, Pending, Shared};
use task::{new_incarnation, run};

/// Default period between full states.
pub const DEFAULT_FULL_STATE_EVERY: Duration = Duration::from_secs(10);
/// Default bound on the requests the reporter tracks at once.
pub const DEFAULT_MAX_PENDING: usize = 4096;
/// Default period between batched `Progress` messages while changes keep coming (the first
/// change after a quiet period goes at once).
pub const DEFAULT_FLUSH_INTERVAL: Duration = Duration::from_millis(5);
/// Default idle period after which a `Heartbeat` is sent.
pub const DEFAULT_HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
/// Default first reconnect delay (doubles up to [`DEFAULT_BACKOFF_MAX`]; each delay is drawn
/// with br-backoff's equal jitter).
pub const DEFAULT_BACKOFF_INITIAL: Duration = Duration::from_millis(50);
/// Default longest reconnect delay.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Shortest time between two full states sent because ingest asked (or a message was
/// rejected); the periodic ones and the one after connecting are not held back.
const MIN_FULL_STATE_GAP: Duration = Duration::from_millis(50);

/// Messages queued towards one connection before the reporter stops draining its map (the
/// state keeps accumulating in the map, coalesced, until the stream takes more).
const OUTBOUND_QUEUE: usize = 16;

/// What the reporter says about its worker, and its bounds.
#[derive(Debug, Clone)]
pub struct ReporterConfig {
    /// Ingest's URL, e.g. `http://127.0.0.1:50062`, or several replicas' URLs separated by
    /// commas: the reporter uses one at a time and moves to the next when its stream is lost.
    pub ingest_addr: String,
    /// The worker's lockstep group.
    pub group: String,
    /// The worker's DP rank.
    pub worker_id: u32,
    /// B (max_num_seqs).
    pub capacity: u32,
    /// Where the gateway sends this rank's requests; may be empty.
    pub endpoint: String,
    /// Mutual TLS to ingest (the worker's own certificate), when configured.
    pub tls: Option<std::sync::Arc<br_trust::TlsMaterial>>,
    /// Period between full states (one is always sent right after connecting).
    pub full_state_every: Duration,
    /// Most requests tracked at once (at most 16,384, the most one `Progress` may carry, so a
    /// full state always fits in one message). A new request beyond it is refused by
    /// [`ReporterHandle::progress`].
    pub max_pending: usize,
    /// Whether the worker serves from the start (true by default); false holds the first
    /// connect until [`ReporterHandle::set_serving`]`(true)` (a shim whose engine has not
    /// answered yet).
    pub serving: bool,
}

impl ReporterConfig {
    /// A configuration with the defaults for everything else (no endpoint).
    pub fn new(
        ingest_addr: impl Into<String>,
        group: impl Into<String>,
        worker_id: u32,
        capacity: u32,
    ) -> Self {
        ReporterConfig {
            ingest_addr: ingest_addr.into(),
            group: group.into(),
            worker_id,
            capacity,
            endpoint: String::new(),
            tls: None,
            full_state_every: DEFAULT_FULL_STATE_EVERY,
            max_pending: DEFAULT_MAX_PENDING,
            serving: true,
        }
    }
}

/// Timing knobs with sensible defaults; tests shorten them.
#[derive(Debug, Clone)]
pub struct ReporterTuning {
    /// Period between batched `Progress` messages while changes keep coming; the first change
    /// after a period with none is sent at once, and the next flush is a period after it.
    pub flush_interval: Duration,
    /// Idle period after which a `Heartbeat` is sent.
    pub heartbeat_every: Duration,
    /// First reconnect delay.
    pub backoff_initial: Duration,
    /// Longest reconnect delay.
    pub backoff_max: Duration,
    /// Longest wait for a TCP/HTTP2 connection.
    pub connect_timeout: Duration,
}

impl Default for ReporterTuning {
    fn default() -> Self {
        ReporterTuning {
            flush_interval: DEFAULT_FLUSH_INTERVAL,
            heartbeat_every: DEFAULT_HEARTBEAT_EVERY,
            backoff_initial: DEFAULT_BACKOFF_INITIAL,
            backoff_max: DEFAULT_BACKOFF_MAX,
            connect_timeout: Duration::from_secs(2),
        }
    }
}

/// Why the reporter refused something.
#[derive(Debug, thiserror::Error)]
pub enum ReporterError {
    /// The configuration cannot produce a valid Hello (or a usable address).
    #[error("invalid reporter configuration: {0}")]
    Config(String),
    /// A progress value that ingest would reject.
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    /// `prompt_tokens + generated_tokens` exceeds the per-request token limit.
    #[error(
        "request {request_id:?}: prompt_tokens + generated_tokens = {total}, at most {max} are allowed"
    )]
    TooManyTokens {
        request_id: String,
        total: u64,
        max: u32,
    },
    /// The map already tracks `max_pending` requests; this new one is not reported.
    #[error("{max} requests already tracked; request {request_id:?} is not reported")]
    Full { request_id: String, max: usize },
    /// The reporter was shut down.
    #[error("the reporter is shut down")]
    Closed,
}

/// The incarnation of this process: random, non-zero, chosen once (every reporter of the
/// process uses it, so a reconnect keeps it and a restart changes it).
pub fn process_incarnation() -> u64 {
    static INCARNATION: OnceLock<u64> = OnceLock::new();
    *INCARNATION.get_or_init(|| {
        let mut rng = rand::rng();
        loop {
            let v: u64 = rng.random();
            if v != 0 {
                return v;
            }
        }
    })
}

/// Counters for the reporter's owner (the shim exports them as metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReporterStats {
    /// Whether a stream to ingest is up (its Hello was acknowledged).
    pub connected: bool,
    /// `Progress` and `Heartbeat` messages sent.
    pub reports_sent: u64,
    /// Request updates sent (entries of `Progress` messages).
    pub updates_sent: u64,
    /// Full states sent.
    pub full_states_sent: u64,
    /// Streams opened (the first connect included).
    pub connects: u64,
    /// Updates refused because the map was full.
    pub refused_full: u64,
    /// Requests tracked now.
    pub pending: usize,
    /// Streams ingest ended because the snapshot service refused this worker's changes (each
    /// made the reporter take a new incarnation and say Hello again).
    pub refusals: u64,
    /// Which of the `ingest_addr` URLs (0-based) the current or last stream used.
    pub ingest_index: usize,
}

/// Spawns reporters.
#[derive(Debug)]
pub struct Reporter;

impl Reporter {
    /// Starts a reporter task (needs a tokio runtime) with the default [`ReporterTuning`].
    pub fn spawn(config: ReporterConfig) -> Result<ReporterHandle, ReporterError> {
        Self::spawn_tuned(config, ReporterTuning::default())
    }

    /// Starts a reporter task with explicit timing knobs.
    pub fn spawn_tuned(
        config: ReporterConfig,
        tuning: ReporterTuning,
    ) -> Result<ReporterHandle, ReporterError> {
        let incarnation = process_incarnation();
        let hello = v1::Hello {
            group: config.group.clone(),
            worker_id: config.worker_id,
            incarnation,
            capacity: config.capacity,
            endpoint: config.endpoint.clone(),
        };
        ValidHello::try_from(hello.clone()).map_err(|e| ReporterError::Config(e.to_string()))?;
        if config.max_pending == 0 || config.max_pending > limits::MAX_UPDATES_PER_PROGRESS {
            return Err(ReporterError::Config(format!(
                "max_pending is {}, it must be in 1..={}",
                config.max_pending,
                limits::MAX_UPDATES_PER_PROGRESS
            )));
        }
        if config.full_state_every.is_zero() || tuning.flush_interval.is_zero() {
            return Err(ReporterError::Config(
                "full_state_every and flush_interval must be positive".into(),
            ));
        }
        let addrs: Vec<&str> = config
            .ingest_addr
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .collect();
        if addrs.is_empty() {
            return Err(ReporterError::Config("ingest_addr lists no URL".into()));
        }
        let endpoints = addrs
            .iter()
            .map(|a| {
                Ok(br_trust::address::endpoint(a, config.tls.is_some())
                    .map_err(|e| ReporterError::Config(format!("ingest_addr: {e}")))?
                    .connect_timeout(tuning.connect_timeout)
                    .tcp_nodelay(true)
                    // the same keepalive as the servers' defaults: a half-open connection is
                    // found from this side too within 8 s, and the stream is re-established
                    .http2_keep_alive_interval(Duration::from_secs(5))
                    .keep_alive_timeout(Duration::from_secs(3)))
            })
            .collect::<Result<Vec<_>, ReporterError>>()?;

        let shared = Arc::new(Shared {
            state: Mutex::new(Pending::default()),
            max_pending: config.max_pending,
            closed: AtomicBool::new(false),
            close_notify: Notify::new(),
            quiet: AtomicBool::new(false),
            change_notify: Notify::new(),
            serving: watch::channel(config.serving).0,
            connected: AtomicBool::new(false),
            full_state_requested: AtomicBool::new(false),
            tls: config.tls.clone(),
            reports_sent: AtomicU64::new(0),
            updates_sent: AtomicU64::new(0),
            full_states_sent: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            refused_full: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
            incarnation: AtomicU64::new(incarnation),
            ingest_index: AtomicUsize::new(0),
        });
        let task = tokio::spawn(run(
            shared.clone(),
            endpoints,
            hello,
            config.full_state_every,
            tuning,
        ));
        Ok(ReporterHandle {
            inner: Arc::new(HandleInner {
                shared,
                task: Mutex::new(Some(task)),
            }),
        })
    }
}

/// The caller's side of a reporter. Cheap to clone; when the last clone is dropped the
/// reporter stops (use [`shutdown`](Self::shutdown) to flush first).
#[derive(Debug, Clone)]
pub struct ReporterHandle {
    inner: Arc<HandleInner>,
}

#[derive(Debug)]
struct HandleInner {
    shared: Arc<Shared>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for HandleInner {
    fn drop(&mut self) {
        self.shared.close();
    }
}

impl ReporterHandle {
    /// Records the cumulative state of one request: prompt tokens (0 = unknown yet), tokens
    /// generated so far, and whether it finished. Never blocks on the network; the state is
    /// sent with the next batch. Lower counts than recorded before are ignored (max()), and
    /// `finished` is sticky.
    ///
    /// Errors: invalid id or counts (what ingest would reject), a new request when
    /// `max_pending` requests are tracked, or a shut-down reporter.
    pub fn progress(
        &self,
        request_id: &str,
        prompt_tokens: u32,
        generated_tokens: u32,
        finished: bool,
    ) -> Result<(), ReporterError> {
        self.record(request_id, prompt_tokens, generated_tokens, finished, false)
    }

    /// [`progress`](Self::progress) of a request that arrived without the gateway's id:
    /// `request_id` is the engine's, and it is reported `unkeyed` (σ then matches it to the
    /// worker's oldest reservation; see the telemetry proto's `unkeyed`). Sticky.
    pub fn progress_unkeyed(
        &self,
        request_id: &str,
        prompt_tokens: u32,
        generated_tokens: u32,
        finished: bool,
    ) -> Result<(), ReporterError> {
        self.record(request_id, prompt_tokens, generated_tokens, finished, true)
    }

    fn record(
        &self,
        request_id: &str,
        prompt_tokens: u32,
        generated_tokens: u32,
        finished: bool,
        unkeyed: bool,
    ) -> Result<(), ReporterError> {
        let shared = &self.inner.shared;
        if shared.closed.load(Ordering::Relaxed) {
            return Err(ReporterError::Closed);
        }
        check_tokens(request_id, prompt_tokens, generated_tokens)?;
        let mut st = shared.lock();
        if let Some(e) = st.requests.get_mut(request_id) {
            let changed = e.merge(prompt_tokens, generated_tokens, finished, unkeyed);
            if changed && !e.dirty {
                e.dirty = true;
                let id = e.id.clone();
                st.dirty.push(id);
                drop(st);
                shared.changed();
            }
            return Ok(());
        }
        let id = RequestId::new(request_id)?;
        if st.requests.len() >= shared.max_pending {
            drop(st);
            shared.refused_full.fetch_add(1, Ordering::Relaxed);
            return Err(ReporterError::Full {
                request_id: request_id.to_owned(),
                max: shared.max_pending,
            });
        }
        st.requests.insert(
            id.clone(),
            Entry {
                id: id.clone(),
                prompt: prompt_tokens,
                generated: generated_tokens,
                finished,
                unkeyed,
                dirty: true,
                finished_seq: 0,
            },
        );
        st.dirty.push(id);
        drop(st);
        shared.changed();
        Ok(())
    }

    /// The incarnation this reporter announces now: the process's, until a refusal by the
    /// snapshot service made it take a new one.
    pub fn incarnation(&self) -> u64 {
        self.inner.shared.incarnation.load(Ordering::Relaxed)
    }

    /// Takes a new incarnation, announced at the next Hello: for a worker whose engine
    /// restarted while it was not serving (the old incarnation's requests died with the old
    /// process, and σ should drop them at once, not reconcile them). Returns the new one.
    pub fn renew_incarnation(&self) -> u64 {
        let shared = &self.inner.shared;
        let new = new_incarnation(shared.incarnation.load(Ordering::Relaxed));
        shared.incarnation.store(new, Ordering::Relaxed);
        new
    }

    /// Whether the worker can take work. `false` ends the telemetry stream cleanly (after
    /// sending what changed), so ingest marks the worker SUSPECT at once and decision stops
    /// assigning to it, and keeps it closed while false; `true` reconnects at once with the
    /// same incarnation and a full state. The state is kept either way, and `progress` goes on
    /// recording. For a worker whose engine is down: ending the stream is the one signal every
    /// ingest and snapshot service already turns into SUSPECT, then FENCED after the grace
    /// period (the engine's requests died with it).
    pub fn set_serving(&self, serving: bool) {
        self.inner
            .shared
            .serving
            .send_if_modified(|s| std::mem::replace(s, serving) != serving);
    }

    /// Whether the worker is serving (the last [`set_serving`](Self::set_serving); true at
    /// first).
    pub fn is_serving(&self) -> bool {
        *self.inner.shared.serving.borrow()
    }

    /// Whether a stream to ingest is up.
    pub fn is_connected(&self) -> bool {
        self.inner.shared.connected.load(Ordering::Relaxed)
    }

    /// Counters and the number of tracked requests.
    pub fn stats(&self) -> ReporterStats {
        let s = &self.inner.shared;
        ReporterStats {
            connected: s.connected.load(Ordering::Relaxed),
            reports_sent: s.reports_sent.load(Ordering::Relaxed),
            updates_sent: s.updates_sent.load(Ordering::Relaxed),
            full_states_sent: s.full_states_sent.load(Ordering::Relaxed),
            connects: s.connects.load(Ordering::Relaxed),
            refused_full: s.refused_full.load(Ordering::Relaxed),
            pending: s.lock().requests.len(),
            refusals: s.refusals.load(Ordering::Relaxed),
            ingest_index: s.ingest_index.load(Ordering::Relaxed),
        }
    }

    /// Stops the reporter: sends what is still unsent (if connected), ends the stream, and
    /// waits (at most 2 s) for the task to finish. Later `progress` calls fail with `Closed`.
    pub async fn shutdown(&self) {
        self.inner.shared.close();
        let task = self
            .inner
            .task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(task) = task
            && tokio::time::timeout(Duration::from_secs(2), task)
                .await
                .is_err()
        {
            tracing::warn!("telemetry reporter did not stop within 2s");
        }
    }
}

fn check_tokens(request_id: &str, prompt: u32, generated: u32) -> Result<(), ReporterError> {
    let max = limits::MAX_TOKENS;
    for (field, value) in [("prompt_tokens", prompt), ("generated_tokens", generated)] {
        if value > max {
            return Err(ValidationError::OutOfRange {
                field,
                value: value.into(),
                min: 0,
                max: max.into(),
            }
            .into());
        }
    }
    let total = u64::from(prompt) + u64::from(generated);
    if total > u64::from(max) {
        return Err(ReporterError::TooManyTokens {
            request_id: request_id.to_owned(),
            total,
            max,
        });
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on purpose
mod tests;
