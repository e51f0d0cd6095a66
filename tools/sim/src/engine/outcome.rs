//! What a run returns: [`RunOutcome`] with its barrier-idle breakdown ([`IdleFlow`]), and the
//! errors a run stops on ([`SimError`]).
//!
//! Separate from the engine so the step loop reads without the result types, which the CLI,
//! the sweeps and the tests consume.

use super::*;

/// Errors of a simulation run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The core refused an operation the engine asked for (an engine or policy bug).
    #[error("policy {policy}: step {step}: {source}")]
    Core {
        /// Policy label.
        policy: String,
        /// Step index.
        step: u64,
        /// What the core said.
        source: br_core::CoreError,
    },
    /// An on-arrival policy named no worker, or named one outside the group.
    #[error(
        "policy {policy}: request {request}: routed to {worker:?}, not a worker of 0..{workers}"
    )]
    BadRoute {
        /// Policy label.
        policy: String,
        /// Request index.
        request: usize,
        /// What the policy answered.
        worker: Option<WorkerId>,
        /// G.
        workers: u32,
    },
    /// Requests wait but nothing runs, nothing was admitted and nothing else will arrive.
    #[error("policy {policy}: stuck at step {step}: {pool} requests in the pool, none admitted")]
    Stuck {
        /// Policy label.
        policy: String,
        /// Step index.
        step: u64,
        /// Pool size.
        pool: usize,
    },
}

/// The outcome of one run.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// The metrics.
    pub report: RunReport,
    /// Per-step per-worker running loads (with `record_loads`).
    pub loads: Option<LoadSeries>,
    /// First and one-past-last step that began with requests waiting (empty if none did).
    pub waiting_steps: std::ops::Range<usize>,
    /// Wall-clock time the run took.
    pub wall: Duration,
    /// Fluid-limit throughput over the steady-state steps (tokens / Σ (a·mean L + b) over the
    /// steps with requests waiting; the whole-run fluid figure when nothing waited).
    pub steady_fluid_tok_s: f64,
    /// Mean of max − min load over the steady-state steps (the whole-run figure when nothing
    /// waited): the imbalance a router controls, without the drain at the end of the trace.
    pub steady_imbalance: f64,
    /// Mean balance ratio over the steady-state steps (the whole-run figure when nothing
    /// waited; see [`RunReport::avg_balance`]).
    pub steady_balance: f64,
    /// Pooled admissions refused because another decider filled the worker first (always 0
    /// with one decider).
    pub refused_reservations: u64,
    /// Where the steady state's barrier idle comes from (BR-H's question).
    pub idle_flow: IdleFlow,
    /// What the steps cost beyond the fluid (with colocated prefill: aligned) limit, term by
    /// term.
    pub barrier: BarrierSplit,
}

/// The step time beyond the fluid limit, split into its three terms, `T − T_fluid =
/// a·(max L − mean L) + p·(max P − mean P) + c·(max n − mean n)`, each a mean over the run's
/// steps in ms: how much of the gap to the aligned limit is KV the ranks hold unevenly, how much
/// prefill they run in different steps or amounts, how much requests they run unevenly. With it
/// the mean prompt tokens a rank prefills per step and the mean of the busiest rank's.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BarrierSplit {
    pub kv_ms: f64,
    pub prefill_ms: f64,
    pub request_ms: f64,
    pub mean_prefill_tokens: f64,
    pub max_prefill_tokens: f64,
}

/// The barrier idle `G·max L − Σ L` over the steady-state steps, and the part of its change
/// from one step to the next that growth alone makes: every running request writes a token,
/// so rank g grows by its running count n_g, which adds `G·max(L + n) − Σ(L + n) − (G·max L −
/// Σ L)` (zero when every rank runs the same number of requests). The rest of the change is
/// finishes and placements. This is what a horizon projection of growth could act on; what it
/// projects beyond that is when requests finish.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct IdleFlow {
    pub steady_steps: u64,
    /// Mean barrier idle per steady step (KV tokens).
    pub mean_idle: f64,
    /// Mean idle growth adds per steady step (KV tokens; negative when it closes gaps).
    pub mean_growth: f64,
    /// Mean of max_g n_g − min_g n_g (running requests) over the steady steps.
    pub mean_running_spread: f64,
    /// `mean_growth` over every step of the run (the whole-run barrier idle is the report's
    /// `avg_barrier_idle`): what matters below capacity, where few steps are steady.
    pub run_growth: f64,
    /// `mean_running_spread` over every step of the run.
    pub run_running_spread: f64,
}

impl RunOutcome {
    /// The steady-state figures shown in the table.
    pub fn steady_extra(&self) -> SteadyExtra {
        SteadyExtra {
            fluid_tok_s: self.steady_fluid_tok_s,
            imbalance: self.steady_imbalance,
            balance: self.steady_balance,
        }
    }
}
