//! The single writer: one task owns every group's [`Group`] and is fed by two bounded queues
//! of [`Command`]s from the gRPC handlers, each answered on a oneshot: Reserve and Release,
//! which Assigns wait on, taken first; everything else in the order it came. It also runs the
//! clock: reservation expiry, grace-period fencing, progress marks and lagging watchers, on a
//! short periodic tick. Nothing else mutates σ, so there are no locks.
//!
//! It also bounds the groups: at most `max_groups` at once (a Watch or Apply naming a new one
//! beyond is refused, RESOURCE_EXHAUSTED), and a group idle for `group_idle_grace` is
//! forgotten. A group created again after that starts above every version the forgotten one
//! reached, so no watcher's old (epoch, version) passes for a version of the new σ.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use br_proto::v1;
use br_proto::valid::{
    GroupId, ValidRelease, ValidReserve, ValidSetCordon, ValidTelemetryChange, ValidWatch,
};
use rand::Rng as _;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::cordons::Cordons;
use crate::error::SnapshotError;
use crate::group::{
    Applied, Cordoned, Group, Reject, Released, Reserved, Settings, StreamId, WatchQueue,
};
use crate::metrics::Metrics;

/// Commands queued towards the writer before handlers wait.
pub const COMMAND_QUEUE: usize = 4096;

/// One request to the writer, in domain types (the handlers parse and build the messages).
#[derive(Debug)]
pub enum Command {
    Apply {
        group: GroupId,
        /// The batch's valid changes, each with its index in the batch.
        changes: Vec<(usize, ValidTelemetryChange)>,
        stream: StreamId,
        /// The sending ingest replica (ChangeBatch.ingest_id).
        carrier: String,
        /// TooManyGroups for a new group beyond `max_groups`.
        reply: oneshot::Sender<Result<Applied, SnapshotError>>,
    },
    StreamEnded {
        stream: StreamId,
    },
    Reserve {
        req: ValidReserve,
        reply: oneshot::Sender<Reserved>,
    },
    Release {
        req: ValidRelease,
        reply: oneshot::Sender<Released>,
    },
    SetCordon {
        req: ValidSetCordon,
        reply: oneshot::Sender<Result<Cordoned, SnapshotError>>,
    },
    ListGroups {
        reply: oneshot::Sender<Vec<v1::GroupSummary>>,
    },
    Get {
        group: GroupId,
        /// None for a group the writer does not hold.
        reply: oneshot::Sender<Option<v1::ClusterSnapshot>>,
    },
    Watch {
        req: ValidWatch,
        /// ShuttingDown while the service shuts down, TooManyGroups for a new group beyond
        /// `max_groups`.
        reply: oneshot::Sender<Result<WatchQueue, SnapshotError>>,
    },
}

impl Command {
    /// Reserve and Release: an Assign's answer waits on its Reserve (and a Cancel's on its
    /// Release), while nothing waits on an Apply batch but the next one. Both go in one
    /// queue, so a Release never overtakes the Reserve it follows, nor a Reserve the Release.
    fn on_assign_path(&self) -> bool {
        matches!(self, Command::Reserve { .. } | Command::Release { .. })
    }
}

/// The handlers' side of the writer: cheap to clone.
#[derive(Debug, Clone)]
pub struct WriterHandle {
    tx: mpsc::Sender<Command>,
    /// Reserve and Release, which an Assign waits on: the writer takes them before the rest
    /// (see [`Command::on_assign_path`]).
    assign_tx: mpsc::Sender<Command>,
    epoch: u64,
}

impl WriterHandle {
    /// This process's epoch (every group's).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Sends a command built around a fresh oneshot and waits for the answer.
    pub async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, SnapshotError> {
        let rx = self.submit(make).await?;
        rx.await.map_err(|_| SnapshotError::ShuttingDown)
    }

    /// Queues a command built around a fresh oneshot and returns where its answer will come,
    /// so a caller with several commands in order (an Apply stream's batches) can have them
    /// all in the writer at once. The writer takes the commands of each queue in the order
    /// they were queued (Reserve and Release before the rest, [`Command::on_assign_path`]).
    pub async fn submit<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<oneshot::Receiver<T>, SnapshotError> {
        let (reply, rx) = oneshot::channel();
        let cmd = make(reply);
        let tx = if cmd.on_assign_path() {
            &self.assign_tx
        } else {
            &self.tx
        };
        tx.send(cmd)
            .await
            .map_err(|_| SnapshotError::ShuttingDown)?;
        Ok(rx)
    }

    /// Tells the writer an Apply stream ended (its workers are disconnected now).
    pub async fn stream_ended(&self, stream: StreamId) {
        let _ = self.tx.send(Command::StreamEnded { stream }).await;
    }
}

/// A random non-zero epoch for this process.
pub fn random_epoch() -> u64 {
    let mut rng = rand::rng();
    loop {
        let e: u64 = rng.random();
        if e != 0 {
            return e;
        }
    }
}

/// How often the writer's clock runs: a quarter of the shortest configured period, within
/// [1 ms, 50 ms].
pub fn tick_period(s: &Settings) -> Duration {
    let shortest = s
        .progress_interval
        .min(s.reservation_ttl)
        .min(s.worker_grace)
        .min(s.carrier_grace);
    (shortest / 4).clamp(Duration::from_millis(1), Duration::from_millis(50))
}

/// Starts the writer. When `shutdown` is cancelled it drops every watcher's queue (which ends
/// their streams, so the server's drain is not held up by them) and refuses new watchers, but
/// keeps answering Apply, Reserve, Release and Get calls still in flight; it stops when every
/// handle is gone (the server has drained).
pub fn spawn(
    settings: Settings,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> (WriterHandle, JoinHandle<()>) {
    spawn_with_cordons(settings, metrics, shutdown, Cordons::in_memory())
}

/// [`spawn`], starting from (and keeping) the operator's `cordons` (`--cordon-file`).
pub fn spawn_with_cordons(
    settings: Settings,
    metrics: Metrics,
    shutdown: CancellationToken,
    cordons: Cordons,
) -> (WriterHandle, JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
    let (assign_tx, assign_rx) = mpsc::channel(COMMAND_QUEUE);
    metrics.cordons(cordons.len());
    let epoch = random_epoch();
    let writer = Writer {
        groups: HashMap::new(),
        settings: Arc::new(settings),
        metrics,
        epoch,
        stream_groups: HashMap::new(),
        draining: false,
        next_version: 0,
        at_max_groups: false,
        cordons,
    };
    let task = tokio::spawn(writer.run(assign_rx, rx, shutdown));
    (
        WriterHandle {
            tx,
            assign_tx,
            epoch,
        },
        task,
    )
}

struct Writer {
    groups: HashMap<GroupId, Group>,
    settings: Arc<Settings>,
    metrics: Metrics,
    epoch: u64,
    /// The groups each Apply stream touched.
    stream_groups: HashMap<StreamId, Vec<GroupId>>,
    /// Shutting down: no watchers.
    draining: bool,
    /// Where a new group's σ starts: above every version a reclaimed group reached.
    next_version: u64,
    /// The last new group was refused for `max_groups` (logged once per episode).
    at_max_groups: bool,
    /// The operator's cordons, which σ forgets on a restart (see [`crate::cordons`]).
    cordons: Cordons,
}

/// The wall clock in ms since the Unix epoch (0 before it).
fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Writer {
    async fn run(
        mut self,
        mut assign: mpsc::Receiver<Command>,
        mut rx: mpsc::Receiver<Command>,
        shutdown: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(tick_period(&self.settings));
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // DEBUG: the process's one start-up line (INFO) names the epoch.
        tracing::debug!(epoch = self.epoch, "snapshot writer started");
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled(), if !self.draining => {
                    tracing::info!("draining: ending every Watch stream");
                    self.draining = true;
                    for g in self.groups.values_mut() {
                        g.drop_watchers();
                    }
                }
                // The clock is read here, in the async loop, and only here: the groups take time
                // as arguments. What an Assign waits on first: an Apply stream may have many
                // batches queued (service::APPLY_IN_WRITER), and a Reserve behind all of them
                // would wait for them all.
                Some(cmd) = assign.recv() => self.handle(cmd, Instant::now(), wall_ms()),
                cmd = rx.recv() => match cmd {
                    Some(cmd) => self.handle(cmd, Instant::now(), wall_ms()),
                    None => break,
                },
                _ = tick.tick() => self.tick(Instant::now()),
            }
        }
        tracing::info!("snapshot writer stopped");
    }

    /// What time does: every group's clock, then idle groups past the grace are forgotten.
    fn tick(&mut self, now: Instant) {
        let grace = self.settings.group_idle_grace;
        let mut idle = Vec::new();
        for (name, g) in &mut self.groups {
            g.tick(now);
            if g.is_idle() && g.idle_for(now) >= grace {
                idle.push(name.clone());
            }
        }
        for name in &idle {
            if let Some(g) = self.groups.remove(name) {
                self.next_version = self.next_version.max(g.version().saturating_add(1));
                tracing::debug!(group = %name, version = g.version(), "idle group reclaimed");
                g.retire();
            }
        }
        if !idle.is_empty() {
            self.metrics.groups(self.groups.len(), idle.len());
        }
    }

    /// The group named `name`, created at `now` if it is new and there is room for it.
    fn group(&mut self, name: &GroupId, now: Instant) -> Result<&mut Group, SnapshotError> {
        let max = self.settings.max_groups;
        let held = self.groups.len();
        let (settings, metrics, epoch, version) =
            (&self.settings, &self.metrics, self.epoch, self.next_version);
        match self.groups.entry(name.clone()) {
            Entry::Occupied(e) => Ok(e.into_mut()),
            Entry::Vacant(_) if held >= max => {
                metrics.refuse("max_groups");
                if !std::mem::replace(&mut self.at_max_groups, true) {
                    // Once per episode: a peer naming groups in a loop must not flood the log.
                    tracing::warn!(group = %name, max_groups = max, "a new group was refused: the service holds --max-groups groups (further refusals are only counted until one is reclaimed)");
                }
                Err(SnapshotError::TooManyGroups {
                    group: name.to_string(),
                    max,
                })
            }
            Entry::Vacant(e) => {
                self.at_max_groups = false;
                tracing::info!(group = %name, version, "new group");
                metrics.groups(held + 1, 0);
                let g = Group::starting_at(
                    name.as_str(),
                    epoch,
                    version,
                    Arc::clone(settings),
                    metrics,
                    now,
                );
                Ok(e.insert(g))
            }
        }
    }

    /// Snapshot.SetCordon: recorded (and, with `--cordon-file`, written) before σ changes, so
    /// an answered cordon survives a restart. A worker σ does not hold may be uncordoned (a
    /// cordon left for a rank that has gone) but not cordoned.
    fn set_cordon(
        &mut self,
        req: &ValidSetCordon,
        now: Instant,
    ) -> Result<Cordoned, SnapshotError> {
        let (group, worker, cordoned) = (req.group.as_str(), req.worker_id, req.cordoned);
        let g = self.groups.get_mut(&req.group);
        let in_sigma = g
            .as_ref()
            .is_some_and(|g| g.sigma().worker(worker).is_some());
        // an uncordon of a worker the file holds but σ does not (a rank gone for good)
        let stale_uncordon = !cordoned && self.cordons.contains(group, worker);
        if !in_sigma && !stale_uncordon {
            return Err(SnapshotError::UnknownWorker {
                group: group.to_owned(),
                worker,
            });
        }
        let kept = self.cordons.set(group, worker, cordoned).map_err(|e| {
            tracing::error!(%group, worker, cordoned, error = %e, "cordon not written to --cordon-file; refused");
            SnapshotError::CordonNotSaved(e.to_string())
        })?;
        self.metrics.cordons(self.cordons.len());
        match g {
            Some(g) if in_sigma => {
                g.set_cordon(worker, cordoned, now)
                    .map_err(|_| SnapshotError::UnknownWorker {
                        group: group.to_owned(),
                        worker,
                    })
            }
            _ => Ok(Cordoned {
                version: self.groups.get(&req.group).map_or(0, Group::version),
                changed: kept,
            }),
        }
    }

    /// Answers one command at `now` (`wall_ms`: the wall clock, against which ingest's
    /// disconnect times are read).
    fn handle(&mut self, cmd: Command, now: Instant, wall_ms: u64) {
        match cmd {
            Command::Apply {
                group,
                changes,
                stream,
                carrier,
                reply,
            } => {
                let cordons = self.cordons.of(group.as_str()).cloned();
                let applied = self.group(&group, now).map(|g| {
                    g.apply_from(changes, stream, &carrier, now, wall_ms, cordons.as_ref())
                });
                if applied.is_ok() {
                    let touched = self.stream_groups.entry(stream).or_default();
                    if !touched.contains(&group) {
                        touched.push(group);
                    }
                }
                let _ = reply.send(applied);
            }
            Command::StreamEnded { stream } => {
                for name in self.stream_groups.remove(&stream).unwrap_or_default() {
                    if let Some(g) = self.groups.get_mut(&name) {
                        g.stream_ended(stream, now);
                    }
                }
            }
            Command::Reserve { req, reply } => {
                let resp = match self.groups.get_mut(&req.group) {
                    Some(g) => g.reserve(req.reservations, now),
                    // No group: nothing can be reserved (and no state is created for it).
                    None => Reserved {
                        epoch: self.epoch,
                        version: 0,
                        accepted: Vec::new(),
                        rejected: req
                            .reservations
                            .into_iter()
                            .map(|r| {
                                let rej = Reject::new(
                                    v1::RejectReason::UnknownWorker,
                                    format!("worker {} is not in σ", r.worker_id),
                                );
                                self.metrics.reject(rej.label());
                                (r.request_id, rej)
                            })
                            .collect(),
                    },
                };
                let _ = reply.send(resp);
            }
            Command::Release { req, reply } => {
                let resp = match self.groups.get_mut(&req.group) {
                    Some(g) => g.release(&req.request_ids, now),
                    None => Released::default(),
                };
                let _ = reply.send(resp);
            }
            Command::SetCordon { req, reply } => {
                let _ = reply.send(self.set_cordon(&req, now));
            }
            Command::ListGroups { reply } => {
                let mut groups: Vec<v1::GroupSummary> =
                    self.groups.values().map(Group::summary).collect();
                groups.sort_unstable_by(|a, b| a.group.cmp(&b.group));
                let _ = reply.send(groups);
            }
            Command::Get { group, reply } => {
                let _ = reply.send(self.groups.get(&group).map(Group::snapshot));
            }
            Command::Watch { req, reply } => {
                let rx = if self.draining {
                    Err(SnapshotError::ShuttingDown)
                } else {
                    self.group(&req.group, now)
                        .map(|g| g.subscribe(req.epoch, req.last_version))
                };
                let _ = reply.send(rx);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use br_proto::v1::telemetry_change as tc;
    use br_proto::valid::{RequestId, ValidReservation};

    use super::*;

    fn apply(
        group: &GroupId,
        kind: tc::Kind,
    ) -> impl FnOnce(oneshot::Sender<Result<Applied, SnapshotError>>) -> Command {
        let changes =
            crate::wire::telemetry_changes(vec![v1::TelemetryChange { kind: Some(kind) }]);
        assert!(changes.invalid.is_empty());
        let group = group.clone();
        move |reply| Command::Apply {
            group,
            changes: changes.valid,
            stream: 1,
            carrier: String::new(),
            reply,
        }
    }

    fn progress(id: &str) -> tc::Kind {
        tc::Kind::RequestProgress(tc::RequestProgress {
            worker_id: 0,
            incarnation: 1,
            request_id: id.into(),
            prompt_tokens: 10,
            generated_tokens: 1,
            finished: false,
            unkeyed: false,
        })
    }

    /// A Reserve queued behind an Apply stream's batches is committed before them: an Assign's
    /// answer waits on it, nothing waits on the batches. (A runtime of one thread: the writer
    /// runs only once everything below is queued.)
    #[tokio::test]
    async fn a_reserve_is_taken_before_the_apply_batches_queued_ahead_of_it() {
        let (writer, task) = spawn(
            Settings::default(),
            Metrics::new().unwrap(),
            CancellationToken::new(),
        );
        let group = GroupId::new("g").unwrap();
        let hello = tc::Kind::WorkerHello(tc::WorkerHello {
            worker_id: 0,
            incarnation: 1,
            capacity: 64,
            endpoint: "http://w0".into(),
        });
        writer.call(apply(&group, hello)).await.unwrap().unwrap();
        let mut batches = Vec::new();
        for i in 0..16 {
            batches.push(
                writer
                    .submit(apply(&group, progress(&format!("r{i}"))))
                    .await
                    .unwrap(),
            );
        }
        let reserve = ValidReserve {
            group: group.clone(),
            reservations: vec![ValidReservation {
                request_id: RequestId::new("x").unwrap(),
                worker_id: 0,
                incarnation: 1,
                prompt_tokens: 10,
                prompt_hash: None,
                max_tokens: None,
                queue_if_full: false,
                expected_output_tokens: None,
                request_class_id: None,
            }],
        };
        let reserved = writer
            .submit(|reply| Command::Reserve {
                req: reserve,
                reply,
            })
            .await
            .unwrap();
        let reserved = reserved.await.unwrap();
        assert_eq!(reserved.accepted.len(), 1, "{reserved:?}");
        for (i, b) in batches.into_iter().enumerate() {
            let applied = b.await.unwrap().unwrap();
            assert!(applied.rejected.is_empty(), "batch {i}: {applied:?}");
            assert!(
                applied.version > reserved.version,
                "batch {i} (version {}) was committed before the Reserve (version {})",
                applied.version,
                reserved.version
            );
        }
        drop(writer);
        task.await.unwrap();
    }
}
