//! Following `Snapshot.Watch` for one group: the decision service's (and any replica's) feed of
//! σ.
//!
//! [`Watcher::spawn`] starts a task that subscribes (first with epoch 0), checks every event
//! against the contract and hands the consumer, in order, through a bounded channel:
//!
//! * [`Update::Snapshot`]: a complete, validated [`Sigma`] that replaces whatever the consumer
//!   held (the first sync, and after every reset, with the reset's reason);
//! * [`Update::Delta`]: the next delta, which continues the σ of the previous `Snapshot`/`Delta`
//!   exactly (same epoch, `prev_version` = that version): the consumer applies it with
//!   [`Sigma::apply_delta`], and may read its changes (e.g. `RequestFinished` lengths for
//!   predictors) before or after;
//! * [`Update::Connected`] / [`Update::Disconnected`]: connectivity, with the instant it changed,
//!   so the consumer can flag its σ as stale.
//!
//! The same facts, plus counters, are in a [`WatchStatus`] behind a `tokio::sync::watch`
//! receiver ([`WatchHandle::status`]) for readiness probes and metrics.
//!
//! The watcher keeps only the (epoch, version) it has handed out, not a σ of its own: the
//! consumer owns the single replica (no copy per delta). It never hands out anything that goes
//! back in time within an epoch, and never skips: on a gap (a delta or progress mark that does
//! not continue its version), a protocol violation, a stream error or end, it resubscribes with
//! its (epoch, version) so the server answers with the missing deltas, or a reset and a
//! snapshot. Retries back off exponentially with jitter, capped; the first retry after a
//! healthy period is immediate. If the consumer ever fails to apply a delta (it cannot with a
//! conforming server), it calls [`WatchHandle::resync`] and gets a fresh snapshot.
//!
//! Where the events come from is a [`WatchSource`]: gRPC over a channel ([`GrpcWatch`], the
//! split deployment), or the snapshot service's handler called in-process (the all-in-one
//! `br-all`), so both follow σ with this same code: positions, gaps, resets and resubscribes.
//!
//! While a reset's snapshot is on its way (or the service is away) the consumer keeps its last
//! σ: it is stale, not wrong, and the decision service keeps answering from it.
//!
//! ```no_run
//! # async fn demo() -> Result<(), br_trust::address::EndpointError> {
//! use br_sigma::Sigma;
//! use br_client::watch::{Update, WatchConfig, Watcher};
//! let (handle, mut updates) = Watcher::connect_lazy("http://127.0.0.1:50061", WatchConfig::new("g0"))?;
//! let mut sigma: Option<Sigma> = None;
//! while let Some(u) = updates.recv().await {
//!     match u {
//!         Update::Snapshot { sigma: s, .. } => sigma = Some(*s),
//!         Update::Delta(d) => {
//!             let ok = sigma.as_mut().is_some_and(|s| s.apply_delta(&d).is_ok());
//!             if !ok {
//!                 handle.resync(); // cannot happen with a conforming server
//!             }
//!         }
//!         Update::Connected { .. } | Update::Disconnected { .. } => {}
//!     }
//! }
//! # Ok(()) }
//! ```

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use br_proto::v1;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::watch_event::Kind;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_stream::{Stream, StreamExt as _};
use tonic::transport::Channel;

use br_sigma::{Delta, Sigma};

/// Default first retry delay after a failed retry (doubles up to [`DEFAULT_BACKOFF_MAX`]).
pub const DEFAULT_BACKOFF_INITIAL: Duration = Duration::from_millis(50);
/// Default longest retry delay.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Default capacity of the update channel.
pub const DEFAULT_UPDATES_CAPACITY: usize = 1024;
/// Default largest message accepted from the server (a snapshot of a big group): the limit the
/// snapshot service's `--max-group-requests` keeps every group's snapshot within.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = br_sigma::MAX_SNAPSHOT_MESSAGE_BYTES;

/// What to follow and how.
#[derive(Debug, Clone)]
pub struct WatchConfig {
    /// The group to follow.
    pub group: String,
    /// Delay before the second consecutive retry; doubles per failure up to `backoff_max`,
    /// each delay drawn in [d/2, d] (jitter). The first retry is immediate.
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Capacity of the update channel. When the consumer does not keep up, the watcher stops
    /// reading the stream; the server then resets it (SLOW_CONSUMER) instead of waiting.
    pub updates_capacity: usize,
    /// Largest gRPC message accepted (snapshots of big groups).
    pub max_message_bytes: usize,
}

impl WatchConfig {
    pub fn new(group: impl Into<String>) -> WatchConfig {
        WatchConfig {
            group: group.into(),
            backoff_initial: DEFAULT_BACKOFF_INITIAL,
            backoff_max: DEFAULT_BACKOFF_MAX,
            updates_capacity: DEFAULT_UPDATES_CAPACITY,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

/// The reset that preceded a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResetInfo {
    pub reason: v1::ResetReason,
    /// The server's detail text, for logs.
    pub detail: String,
}

/// What the consumer receives, in order.
#[derive(Debug)]
pub enum Update {
    /// A complete σ replacing the one held. `reset` is set when the server reset this watcher
    /// (UNKNOWN_EPOCH after a restart, HISTORY_TRUNCATED, SLOW_CONSUMER, FUTURE_VERSION), and
    /// unset for the first snapshot of a subscription from scratch.
    Snapshot {
        sigma: Box<Sigma>,
        reset: Option<ResetInfo>,
    },
    /// The next delta: continues the last σ handed out (same epoch, `prev_version` = its
    /// version). Shared with the snapshot service when it runs in this process (br-all), so
    /// it is never copied per watcher.
    Delta(Arc<Delta>),
    /// The stream is up (it may still be catching up).
    Connected { at: Instant },
    /// The stream is gone; the σ held is stale from `at` until the next `Connected` and update.
    Disconnected { at: Instant, error: String },
}

/// The watcher's state, for probes and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchStatus {
    /// Whether a Watch stream is open.
    pub connected: bool,
    /// When `connected` last changed (or the watcher started).
    pub since: Instant,
    /// Whether a complete σ has been handed out (stays true across disconnections).
    pub synced: bool,
    /// The (epoch, version) of the last σ handed out (0, 0 before the first snapshot).
    pub epoch: u64,
    pub version: u64,
    /// When the server last said anything (a snapshot, delta or progress mark).
    pub last_heard: Option<Instant>,
    /// Resets received from the server.
    pub resets: u64,
    /// Subscriptions made after the first (gaps, errors, resyncs).
    pub resubscribes: u64,
}

/// Controls a running watcher. Dropping it stops the watcher.
#[derive(Debug)]
pub struct WatchHandle {
    status: watch::Receiver<WatchStatus>,
    resync: mpsc::Sender<()>,
    task: JoinHandle<()>,
}

impl WatchHandle {
    /// A receiver of the watcher's status (see [`WatchStatus`]).
    pub fn status(&self) -> watch::Receiver<WatchStatus> {
        self.status.clone()
    }

    /// Asks for a fresh snapshot: the watcher drops its position and subscribes from scratch.
    /// For a consumer whose σ failed to apply a delta.
    pub fn resync(&self) {
        // A pending request already does it; a full queue is fine.
        let _ = self.resync.try_send(());
    }

    /// Stops the watcher and waits for its task to end.
    pub async fn stop(mut self) {
        self.task.abort();
        let _ = (&mut self.task).await;
    }
}

impl Drop for WatchHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One Watch stream's events, as the server sends them (an `Err` ends the stream).
pub type WatchEvents = Pin<Box<dyn Stream<Item = Result<SourceEvent, tonic::Status>> + Send>>;

/// One event of a Watch stream as a [`WatchSource`] yields it: the kinds of a
/// `v1::WatchEvent`, with its snapshot and delta behind `Arc`s. A gRPC source wraps what it
/// decoded; the snapshot service in the same process hands over the very delta and snapshot it
/// shares among all its watchers, so following σ in-process copies no change (the copy of
/// each delta's changes into a message per watcher, request ids and all, was 0.6-0.9% of
/// br-all's samples under 100k progress events/s, its allocations and frees besides).
#[derive(Debug, Clone, PartialEq)]
pub enum SourceEvent {
    Snapshot(Arc<v1::ClusterSnapshot>),
    Delta(Arc<Delta>),
    Progress(v1::watch_event::ProgressMark),
    Reset(v1::watch_event::Reset),
    /// A message with no kind: a contract violation, which the watcher resubscribes on.
    Empty,
}

impl From<v1::WatchEvent> for SourceEvent {
    fn from(ev: v1::WatchEvent) -> SourceEvent {
        match ev.kind {
            Some(Kind::Snapshot(s)) => SourceEvent::Snapshot(Arc::new(s)),
            Some(Kind::Delta(d)) => SourceEvent::Delta(Arc::new(d)),
            Some(Kind::Progress(p)) => SourceEvent::Progress(p),
            Some(Kind::Reset(r)) => SourceEvent::Reset(r),
            None => SourceEvent::Empty,
        }
    }
}

/// Where a watcher subscribes: `Snapshot.Watch`, over gRPC or in-process. Each call is one
/// subscription; the watcher checks everything it yields against the contract either way.
pub trait WatchSource: Send + Sync + 'static {
    fn watch(
        &self,
        req: v1::WatchRequest,
    ) -> futures::future::BoxFuture<'static, Result<WatchEvents, tonic::Status>>;
}

/// [`WatchSource`] over a gRPC channel (which reconnects by itself).
#[derive(Debug, Clone)]
pub struct GrpcWatch {
    client: SnapshotClient<br_trace::Traced<Channel>>,
}

impl GrpcWatch {
    /// Accepts messages up to `max_message_bytes` (a snapshot of a big group).
    pub fn new(channel: Channel, max_message_bytes: usize) -> GrpcWatch {
        GrpcWatch {
            client: SnapshotClient::new(br_trace::traced(channel))
                .max_decoding_message_size(max_message_bytes)
                .max_encoding_message_size(max_message_bytes),
        }
    }
}

impl WatchSource for GrpcWatch {
    fn watch(
        &self,
        req: v1::WatchRequest,
    ) -> futures::future::BoxFuture<'static, Result<WatchEvents, tonic::Status>> {
        let mut client = self.client.clone();
        Box::pin(async move {
            let stream = client.watch(req).await?.into_inner();
            Ok(Box::pin(stream.map(|ev| ev.map(SourceEvent::from))) as WatchEvents)
        })
    }
}

/// Spawns watchers.
#[derive(Debug)]
pub struct Watcher;

impl Watcher {
    /// Follows `config.group` over `channel` (which reconnects by itself). Must be called
    /// inside a tokio runtime. The task stops when the handle or the receiver is dropped.
    pub fn spawn(channel: Channel, config: WatchConfig) -> (WatchHandle, mpsc::Receiver<Update>) {
        let source = GrpcWatch::new(channel, config.max_message_bytes);
        Watcher::spawn_from(Arc::new(source), config)
    }

    /// Follows `config.group` from `source` (gRPC, or the snapshot service in-process). Must be
    /// called inside a tokio runtime. The task stops when the handle or the receiver is
    /// dropped.
    pub fn spawn_from(
        source: Arc<dyn WatchSource>,
        config: WatchConfig,
    ) -> (WatchHandle, mpsc::Receiver<Update>) {
        let (tx, rx) = mpsc::channel(config.updates_capacity.max(1));
        let (resync_tx, resync_rx) = mpsc::channel(1);
        let now = Instant::now();
        let (status_tx, status_rx) = watch::channel(WatchStatus {
            connected: false,
            since: now,
            synced: false,
            epoch: 0,
            version: 0,
            last_heard: None,
            resets: 0,
            resubscribes: 0,
        });
        let task = tokio::spawn(
            Task {
                source,
                config,
                tx,
                resync: resync_rx,
                status: status_tx,
                pos: Position::default(),
                announced: None,
            }
            .run(),
        );
        (
            WatchHandle {
                status: status_rx,
                resync: resync_tx,
                task,
            },
            rx,
        )
    }

    /// [`spawn`](Self::spawn) on a lazily connected plaintext channel to `url` (e.g.
    /// `http://127.0.0.1:50061`; `https://` is refused with advice: over mutual TLS, make the
    /// channel with [`br_trust::tls::connect_lazy`] and call `spawn`).
    pub fn connect_lazy(
        url: &str,
        config: WatchConfig,
    ) -> Result<(WatchHandle, mpsc::Receiver<Update>), br_trust::address::EndpointError> {
        let channel = br_trust::address::endpoint(url, false)?
            .tcp_nodelay(true)
            .connect_lazy();
        Ok(Watcher::spawn(channel, config))
    }
}

/// Where the consumer's σ is, as far as the watcher knows.
#[derive(Debug, Default, Clone, Copy)]
struct Position {
    /// 0: holds nothing.
    epoch: u64,
    version: u64,
    /// A reset arrived on this stream; only its snapshot may follow.
    awaiting_snapshot: bool,
}

/// Why a stream was left.
enum Leave {
    /// Resubscribe (gap, protocol violation, resync, stream error or end), saying why.
    Resubscribe { error: Option<String>, why: String },
    /// The consumer is gone.
    Stop,
}

struct Task {
    source: Arc<dyn WatchSource>,
    config: WatchConfig,
    tx: mpsc::Sender<Update>,
    resync: mpsc::Receiver<()>,
    status: watch::Sender<WatchStatus>,
    pos: Position,
    /// The connectivity last told to the consumer (none yet at start).
    announced: Option<bool>,
}

impl Task {
    async fn run(mut self) {
        let mut failures: u32 = 0;
        let mut first = true;
        loop {
            if !first {
                self.status.send_modify(|s| s.resubscribes += 1);
            }
            first = false;
            let req = v1::WatchRequest {
                group: self.config.group.clone(),
                epoch: self.pos.epoch,
                last_version: if self.pos.epoch == 0 {
                    0
                } else {
                    self.pos.version
                },
            };
            self.pos.awaiting_snapshot = false;
            let leave = match self.source.watch(req).await {
                Ok(events) => {
                    if !self.set_connected(true, None).await {
                        return;
                    }
                    self.follow(events, &mut failures).await
                }
                Err(status) => Leave::Resubscribe {
                    error: Some(status.to_string()),
                    why: "subscribe failed".into(),
                },
            };
            match leave {
                Leave::Stop => return,
                Leave::Resubscribe { error, why } => {
                    tracing::debug!(group = %self.config.group, why, error = ?error, "resubscribing to Watch");
                    if let Some(e) = error
                        && !self.set_connected(false, Some(e)).await
                    {
                        return;
                    }
                }
            }
            let delay = backoff(&self.config, failures);
            failures = failures.saturating_add(1);
            if !delay.is_zero() {
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    r = self.resync.recv() => match r {
                        Some(()) => self.pos = Position::default(),
                        None => return,
                    },
                }
            }
            if self.tx.is_closed() {
                return;
            }
        }
    }

    /// Reads one stream until it must be left. Resets `failures` whenever an event moves the
    /// consumer forward.
    async fn follow(&mut self, mut stream: WatchEvents, failures: &mut u32) -> Leave {
        let mut pending_reset: Option<ResetInfo> = None;
        loop {
            let msg = tokio::select! {
                m = stream.next() => m.transpose(),
                r = self.resync.recv() => {
                    if r.is_none() {
                        return Leave::Stop;
                    }
                    self.pos = Position::default();
                    *failures = 0;
                    return Leave::Resubscribe { error: None, why: "resync requested".into() };
                }
            };
            let ev = match msg {
                Ok(Some(ev)) => ev,
                Ok(None) => {
                    return Leave::Resubscribe {
                        error: Some("stream ended by the server".into()),
                        why: "stream ended".into(),
                    };
                }
                Err(status) => {
                    if too_large(&status) {
                        // Retrying cannot help: every snapshot of this group will be as large,
                        // so the consumer (decision) stays unready until an operator acts.
                        tracing::warn!(group = %self.config.group, max_message_bytes = self.config.max_message_bytes,
                            error = %status, "a Watch message is larger than this watcher decodes; σ cannot be followed until the group shrinks or the limit is raised");
                    }
                    return Leave::Resubscribe {
                        error: Some(status.to_string()),
                        why: "stream error".into(),
                    };
                }
            };
            let now = Instant::now();
            self.status.send_modify(|s| s.last_heard = Some(now));
            let gap = |why: String| Leave::Resubscribe { error: None, why };
            match ev {
                SourceEvent::Empty => return gap("event without kind".into()),
                SourceEvent::Reset(r) => {
                    let reason =
                        v1::ResetReason::try_from(r.reason).unwrap_or(v1::ResetReason::Unspecified);
                    tracing::info!(group = %self.config.group, ?reason, detail = %r.detail, "Watch reset");
                    self.status.send_modify(|s| s.resets += 1);
                    self.pos.awaiting_snapshot = true;
                    pending_reset = Some(ResetInfo {
                        reason,
                        detail: r.detail,
                    });
                }
                SourceEvent::Snapshot(snap) => {
                    let acceptable = self.pos.awaiting_snapshot
                        || self.pos.epoch == 0
                        || snap.epoch != self.pos.epoch
                        || snap.version >= self.pos.version;
                    if !acceptable {
                        return gap(format!(
                            "snapshot at version {} without a reset would go back from {}",
                            snap.version, self.pos.version
                        ));
                    }
                    if snap.group != self.config.group {
                        return gap(format!("snapshot of group {:?}", snap.group));
                    }
                    let sigma = match Sigma::from_snapshot(&snap) {
                        Ok(s) => s,
                        Err(e) => {
                            // Never build on a snapshot we could not read: start over. The
                            // consumer stays unready meanwhile, so say so above DEBUG.
                            tracing::warn!(group = %self.config.group, error = %e, "invalid snapshot from Watch; resubscribing");
                            self.pos = Position::default();
                            return Leave::Resubscribe {
                                error: None,
                                why: format!("invalid snapshot: {e}"),
                            };
                        }
                    };
                    self.pos = Position {
                        epoch: snap.epoch,
                        version: snap.version,
                        awaiting_snapshot: false,
                    };
                    *failures = 0;
                    let update = Update::Snapshot {
                        sigma: Box::new(sigma),
                        reset: pending_reset.take(),
                    };
                    if !self.send(update).await {
                        return Leave::Stop;
                    }
                }
                SourceEvent::Delta(d) => {
                    if self.pos.awaiting_snapshot || self.pos.epoch == 0 {
                        return gap("delta before a snapshot".into());
                    }
                    if d.epoch != self.pos.epoch || d.prev_version != self.pos.version {
                        return gap(format!(
                            "delta {}@{}->{} does not continue {}@{}",
                            d.epoch, d.prev_version, d.version, self.pos.epoch, self.pos.version
                        ));
                    }
                    if d.version <= d.prev_version {
                        return gap(format!(
                            "delta goes from {} to {}",
                            d.prev_version, d.version
                        ));
                    }
                    self.pos.version = d.version;
                    *failures = 0;
                    if !self.send(Update::Delta(d)).await {
                        return Leave::Stop;
                    }
                }
                SourceEvent::Progress(p) => {
                    if self.pos.awaiting_snapshot {
                        return gap("progress mark before the reset's snapshot".into());
                    }
                    if p.epoch != self.pos.epoch || p.version > self.pos.version {
                        return gap(format!(
                            "progress mark {}@{} ahead of {}@{}",
                            p.epoch, p.version, self.pos.epoch, self.pos.version
                        ));
                    }
                    // An older mark in the same epoch is harmless: nothing goes back.
                    *failures = 0;
                }
            }
        }
    }

    /// Hands an update to the consumer (the status first, so it is never behind what the
    /// consumer saw). False if the consumer is gone.
    async fn send(&mut self, u: Update) -> bool {
        let (epoch, version) = (self.pos.epoch, self.pos.version);
        self.status.send_modify(|s| {
            s.synced = true;
            s.epoch = epoch;
            s.version = version;
        });
        self.tx.send(u).await.is_ok()
    }

    /// Records a connectivity change and tells the consumer. False if the consumer is gone.
    async fn set_connected(&mut self, connected: bool, error: Option<String>) -> bool {
        if self.announced == Some(connected) {
            return !self.tx.is_closed();
        }
        self.announced = Some(connected);
        let at = Instant::now();
        self.status.send_modify(|s| {
            s.connected = connected;
            s.since = at;
        });
        let u = if connected {
            Update::Connected { at }
        } else {
            Update::Disconnected {
                at,
                error: error.unwrap_or_default(),
            }
        };
        self.tx.send(u).await.is_ok()
    }
}

/// A message above the decoding limit: tonic's client reports it as OUT_OF_RANGE ("decoded
/// message length too large"); a server that maps it says RESOURCE_EXHAUSTED with the same
/// text.
fn too_large(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::OutOfRange
        || status.message().contains("message length too large")
}

/// The delay before retry number `failures` (0 = the first retry after a healthy period:
/// immediate). Then br-backoff's schedule: exponential from `backoff_initial`, capped at
/// `backoff_max`, drawn in [d/2, d].
fn backoff(cfg: &WatchConfig, failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    br_backoff::delay(
        cfg.backoff_initial,
        cfg.backoff_max,
        failures - 1,
        &mut rand::rng(),
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;
    use br_sigma::change;
    use br_testkit::{FakeSnapshot, PATIENCE, ReservedPort, within};

    /// Starts the kit's fake Snapshot server; its Watch plays the queued scripts, one a call.
    async fn serve(fake: &FakeSnapshot) -> (br_testkit::Served, String) {
        let served = fake.start().await;
        let url = served.url();
        (served, url)
    }

    /// The next update, bounded: a watcher that stops talking fails the test, never hangs it.
    async fn recv(rx: &mut mpsc::Receiver<Update>) -> Update {
        within(PATIENCE, "the watcher's next update", rx.recv())
            .await
            .expect("the watcher ended")
    }

    fn ev(kind: Kind) -> Result<v1::WatchEvent, tonic::Status> {
        Ok(v1::WatchEvent { kind: Some(kind) })
    }

    /// The writer's σ and the deltas that built it, versions 1..=n.
    fn history(n: u64) -> (Vec<v1::ClusterSnapshot>, Vec<Delta>) {
        let mut w = Sigma::with_epoch("g", 5);
        let mut snaps = vec![w.to_snapshot()];
        let mut deltas = Vec::new();
        for i in 0..n {
            let mut b = w.batch();
            if i == 0 {
                b.apply(change::worker_up(0, 1, 8, "")).unwrap();
            }
            b.apply(change::request_progress(&format!("r{i}"), 0, 1, 10, 1))
                .unwrap();
            deltas.push(b.commit().unwrap());
            snaps.push(w.to_snapshot());
        }
        (snaps, deltas)
    }

    fn fast(group: &str) -> WatchConfig {
        let mut c = WatchConfig::new(group);
        c.backoff_initial = Duration::from_millis(1);
        c.backoff_max = Duration::from_millis(5);
        c
    }

    async fn next_data(rx: &mut mpsc::Receiver<Update>) -> Update {
        loop {
            match recv(rx).await {
                Update::Connected { .. } | Update::Disconnected { .. } => {}
                u => return u,
            }
        }
    }

    #[tokio::test]
    async fn syncs_follows_and_resubscribes_on_gap_and_error() {
        let (snaps, deltas) = history(6);
        let fake = FakeSnapshot::new();
        // 1: snapshot at 2, delta 3, then a gap (5 after 3)
        fake.script_watch(vec![
            ev(Kind::Snapshot(snaps[2].clone())),
            ev(Kind::Delta(deltas[2].clone())),
            ev(Kind::Delta(deltas[4].clone())),
        ]);
        // 2: the missing delta, a progress mark, then the stream fails
        fake.script_watch(vec![
            ev(Kind::Delta(deltas[3].clone())),
            ev(Kind::Progress(v1::watch_event::ProgressMark {
                epoch: 5,
                version: 4,
            })),
            Err(tonic::Status::unavailable("going away")),
        ]);
        // 3: a reset (the server restarted) and its snapshot
        let mut other = snaps[1].clone();
        other.epoch = 9;
        fake.script_watch(vec![
            ev(Kind::Reset(v1::watch_event::Reset {
                reason: v1::ResetReason::UnknownEpoch as i32,
                epoch: 9,
                detail: "restart".into(),
            })),
            ev(Kind::Snapshot(other)),
        ]);
        let (_served, url) = serve(&fake).await;
        let (handle, mut rx) = Watcher::connect_lazy(&url, fast("g")).unwrap();

        let Update::Snapshot { sigma, reset } = next_data(&mut rx).await else {
            panic!()
        };
        assert!(reset.is_none());
        let mut replica = *sigma;
        assert_eq!(replica.version(), 2);
        for want in [3, 4] {
            let Update::Delta(d) = next_data(&mut rx).await else {
                panic!()
            };
            assert_eq!(d.version, want);
            replica.apply_delta(&d).unwrap();
        }
        assert_eq!(replica.to_snapshot(), snaps[4]);
        match recv(&mut rx).await {
            Update::Disconnected { error, .. } => assert!(error.contains("going away"), "{error}"),
            u => panic!("{u:?}"),
        }
        let Update::Snapshot { sigma, reset } = next_data(&mut rx).await else {
            panic!()
        };
        assert_eq!(reset.unwrap().reason, v1::ResetReason::UnknownEpoch);
        assert_eq!((sigma.epoch(), sigma.version()), (9, 1));

        let reqs = fake.watch_requests();
        let asked: Vec<(u64, u64)> = reqs.iter().map(|r| (r.epoch, r.last_version)).collect();
        assert_eq!(asked, vec![(0, 0), (5, 3), (5, 4)]);
        let st = handle.status().borrow().clone();
        assert!(st.connected && st.synced);
        assert_eq!(
            (st.epoch, st.version, st.resets, st.resubscribes),
            (9, 1, 1, 2)
        );
        within(PATIENCE, "the watcher stops", handle.stop()).await;
    }

    #[tokio::test]
    async fn resync_starts_from_scratch_and_bad_snapshots_are_refused() {
        let (snaps, deltas) = history(3);
        let fake = FakeSnapshot::new();
        let mut bad = snaps[1].clone();
        bad.epoch = 0; // unreadable: must not be handed out
        fake.script_watch(vec![ev(Kind::Snapshot(bad))]);
        fake.script_watch(vec![
            ev(Kind::Snapshot(snaps[1].clone())),
            ev(Kind::Delta(deltas[1].clone())),
        ]);
        fake.script_watch(vec![ev(Kind::Snapshot(snaps[3].clone()))]);
        let (_served, url) = serve(&fake).await;
        let (handle, mut rx) = Watcher::connect_lazy(&url, fast("g")).unwrap();
        let Update::Snapshot { sigma, .. } = next_data(&mut rx).await else {
            panic!()
        };
        assert_eq!(sigma.version(), 1);
        let Update::Delta(d) = next_data(&mut rx).await else {
            panic!()
        };
        assert_eq!(d.version, 2);
        handle.resync();
        let Update::Snapshot { sigma, .. } = next_data(&mut rx).await else {
            panic!()
        };
        assert_eq!(sigma.version(), 3);
        let asked: Vec<(u64, u64)> = fake
            .watch_requests()
            .iter()
            .map(|r| (r.epoch, r.last_version))
            .collect();
        assert_eq!(asked, vec![(0, 0), (0, 0), (0, 0)]);
    }

    #[tokio::test]
    async fn unreachable_server_reports_disconnected_and_retries() {
        // Bound but not listening: every connect is refused, and no other socket can take the
        // port meanwhile (a released port could be, and then the watcher would connect).
        let down = ReservedPort::new();
        let (handle, mut rx) = Watcher::connect_lazy(&down.url(), fast("g")).unwrap();
        match recv(&mut rx).await {
            Update::Disconnected { .. } => {}
            u => panic!("{u:?}"),
        }
        let mut status = handle.status();
        within(
            PATIENCE,
            "three resubscribes",
            status.wait_for(|s| s.resubscribes >= 3),
        )
        .await
        .unwrap();
        assert!(!status.borrow().connected);
    }

    #[test]
    fn first_retry_is_immediate_then_the_schedule_starts_at_initial() {
        let cfg = WatchConfig::new("g");
        assert_eq!(backoff(&cfg, 0), Duration::ZERO);
        let d = backoff(&cfg, 1);
        assert!(
            d >= cfg.backoff_initial / 2 && d <= cfg.backoff_initial,
            "{d:?}"
        );
        for f in 2..40 {
            let d = backoff(&cfg, f);
            assert!(d <= cfg.backoff_max, "{f}: {d:?}");
        }
        assert!(backoff(&cfg, 39) >= cfg.backoff_max / 2);
    }
}
