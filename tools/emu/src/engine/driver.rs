//! The engine task: owns the [`Lockstep`] state, takes submissions from a bounded channel,
//! sleeps each step's model time × `time_scale` and records every step in the [`StatsLog`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::core::{Colocated, Lockstep, Notify, Progress, Slot, StepModel, StepRecord};

/// Most steps the log keeps (older ones are dropped and counted).
pub const MAX_LOGGED_STEPS: usize = 2_000_000;
/// Submissions waiting for the engine task (HTTP handlers wait when it is full).
pub const SUBMIT_QUEUE: usize = 4096;

struct WatchNotify(watch::Sender<Progress>);

impl Notify for WatchNotify {
    fn notify(&mut self, p: Progress) {
        self.0.send_replace(p);
    }
    fn alive(&self) -> bool {
        !self.0.is_closed()
    }
}

struct Submission {
    rank: usize,
    prompt: u32,
    max_tokens: u32,
    tx: watch::Sender<Progress>,
}

/// Why a submission was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    #[error("no such data-parallel rank {0} (the engine has {1})")]
    NoSuchRank(usize, usize),
    #[error("the engine is shutting down")]
    Closed,
}

/// Every step the engine ran, in order.
#[derive(Debug, Default, Clone, Serialize)]
pub struct StatsLog {
    /// Index of the first step kept (steps before it were dropped or reset).
    pub first_step: u64,
    pub max_load: Vec<u64>,
    pub min_load: Vec<u64>,
    pub sum_load: Vec<u64>,
    /// The most running requests on one rank, per step.
    pub max_running: Vec<u32>,
    /// The most prompt tokens one rank prefilled, per step (all 0 without colocated prefill).
    pub max_prefill: Vec<u64>,
    /// Model step time a·max L + p·max P + c·max n + b, ms.
    pub model_ms: Vec<f64>,
    /// Wall-clock step time, ms.
    pub wall_ms: Vec<f64>,
    /// The balance ratio of each step, `Σ_g work_g / (G · max_g work_g)`
    /// ([`super::core::balance_ratio`]).
    pub balance: Vec<f64>,
    /// Per-rank loads, step-major (`ranks` values per step).
    #[serde(skip)]
    pub loads: Vec<u64>,
    /// Time to first token of each request, in model ms from its arrival at the engine to the
    /// end of the step that wrote its first token (queue, prefill and that step), in the order
    /// the first tokens came; `ttft_step` is the step (its index) of each.
    pub ttft_model_ms: Vec<f64>,
    pub ttft_step: Vec<u64>,
}

impl StatsLog {
    fn push(&mut self, rec: &StepRecord, wall: Duration, first_tokens: &[f64]) {
        if self.max_load.len() >= MAX_LOGGED_STEPS {
            *self = StatsLog {
                first_step: self.first_step + self.max_load.len() as u64,
                ..StatsLog::default()
            };
        }
        self.max_load.push(rec.max_load());
        self.min_load.push(rec.min_load());
        self.sum_load.push(rec.sum_load());
        self.max_running.push(rec.max_running());
        self.max_prefill.push(rec.max_prefill());
        self.model_ms.push(rec.model_ms);
        self.wall_ms.push(wall.as_secs_f64() * 1e3);
        self.balance.push(rec.balance);
        self.loads.extend_from_slice(&rec.loads);
        let step = self.first_step + self.max_load.len() as u64 - 1;
        self.ttft_model_ms.extend_from_slice(first_tokens);
        self.ttft_step
            .extend(std::iter::repeat_n(step, first_tokens.len()));
    }

    pub fn steps(&self) -> usize {
        self.max_load.len()
    }

    /// Forgets every step so far (the next run measures from here).
    pub fn reset(&mut self) {
        *self = StatsLog {
            first_step: self.first_step + self.max_load.len() as u64,
            ..StatsLog::default()
        };
    }
}

/// A handle to submit requests to the engine task. Cheap to clone.
#[derive(Clone, Debug)]
pub struct EngineHandle {
    tx: mpsc::Sender<Submission>,
    ranks: usize,
    stats: Arc<Mutex<StatsLog>>,
}

impl std::fmt::Debug for Submission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Submission")
            .field("rank", &self.rank)
            .finish()
    }
}

impl EngineHandle {
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Queues a request on `rank`; the receiver sees its progress after every step. Dropping
    /// the receiver aborts the request (its slot is freed at the next step).
    pub async fn submit(
        &self,
        rank: usize,
        prompt: u32,
        max_tokens: u32,
    ) -> Result<watch::Receiver<Progress>, SubmitError> {
        if rank >= self.ranks {
            return Err(SubmitError::NoSuchRank(rank, self.ranks));
        }
        let (tx, rx) = watch::channel(Progress::default());
        self.tx
            .send(Submission {
                rank,
                prompt,
                max_tokens: max_tokens.max(1),
                tx,
            })
            .await
            .map_err(|_| SubmitError::Closed)?;
        Ok(rx)
    }

    /// Runs `f` on the step log (a short lock; never held across an await).
    pub fn with_stats<T>(&self, f: impl FnOnce(&mut StatsLog) -> T) -> T {
        let mut guard = match self.stats.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        f(&mut guard)
    }
}

/// Starts the engine task. It runs until `shutdown` is cancelled.
pub fn spawn(
    ranks: usize,
    slots: usize,
    model: StepModel,
    colocated: Option<Colocated>,
    time_scale: f64,
    shutdown: CancellationToken,
) -> (EngineHandle, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(SUBMIT_QUEUE);
    let stats = Arc::new(Mutex::new(StatsLog::default()));
    let handle = EngineHandle {
        tx,
        ranks,
        stats: stats.clone(),
    };
    let mut core = Lockstep::new(ranks, slots, model);
    if let Some(co) = colocated {
        core = core.with_colocated(co);
    }
    let task = tokio::spawn(run(core, rx, handle.clone(), time_scale, shutdown));
    (handle, task)
}

async fn run(
    mut core: Lockstep<WatchNotify>,
    mut rx: mpsc::Receiver<Submission>,
    handle: EngineHandle,
    time_scale: f64,
    shutdown: CancellationToken,
) {
    let mut next_id = 0u64;
    let mut accept = |core: &mut Lockstep<WatchNotify>, s: Submission| {
        next_id += 1;
        // The rank was checked by `submit`.
        let _ = core.submit(
            s.rank,
            Slot {
                id: next_id,
                prompt: s.prompt,
                max_tokens: s.max_tokens,
                generated: 0,
                notify: WatchNotify(s.tx),
                arrived_ms: 0.0,
            },
        );
    };
    // A virtual clock: each step ends `wall` after the previous one ended, so timer rounding
    // does not accumulate (unless the engine falls behind by more than `SLACK`).
    const SLACK: Duration = Duration::from_millis(50);
    let mut deadline = Instant::now();
    loop {
        while let Ok(s) = rx.try_recv() {
            accept(&mut core, s);
        }
        if !core.busy() {
            tokio::select! {
                s = rx.recv() => match s {
                    Some(s) => {
                        accept(&mut core, s);
                        deadline = Instant::now();
                        continue;
                    }
                    None => return,
                },
                () = shutdown.cancelled() => return,
            }
        }
        let started = Instant::now();
        let Some(rec) = core.begin_step() else {
            continue;
        };
        let wall = Duration::from_secs_f64((rec.model_ms * time_scale / 1e3).max(0.0));
        if wall.is_zero() {
            tokio::task::yield_now().await;
        } else {
            deadline += wall;
            if deadline + SLACK < started {
                deadline = started + wall;
            }
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => {}
                () = shutdown.cancelled() => return,
            }
        }
        core.finish_step(rec.model_ms);
        let elapsed = started.elapsed();
        handle.with_stats(|s| s.push(&rec, elapsed, core.first_tokens()));
    }
}
