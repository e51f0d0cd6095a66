//! The BalanceRoute routing core.
//!
//! Pure, synchronous and deterministic (given a seed): no I/O, no async, no wire types. The
//! services and the simulator (`br-sim`) run exactly this code, so what the simulator measures
//! is what the control plane does.
//!
//! * [`ClusterState`]: σ(k), the per-group cluster state with incremental load
//!   accounting (a progress event updates `L_g`, the max and the min in O(log G)).
//! * [`score`]: the BR-0 and BR-H F-scores (`F = −ΔI`), evaluated against per-worker margins.
//! * [`Pool`]: the central prompt pool, indexed by arrival order and by size.
//! * [`dispatch`]: the two-stage batch-admission dispatcher and the pool-bypass router.
//! * [`predict`]: termination predictors for BR-H (Survival, ExactMatch, Oracle).
//! * [`Policy`]: one trait, the baselines used by today's routers, and a factory
//!   ([`build_policy`]) that builds any policy from a [`PolicyConfig`] by name.
//! * [`StepModel`]: the lockstep step-time model `T = a·M + p·P + c·N + b` and its online fit from
//!   telemetry.
//! * [`class_id`]: the id of a request's class key, as σ carries it.
//! * [`stats::quantile`]: the project's one percentile definition (nearest rank), shared by
//!   the simulator's report and everything else that needs exact order statistics.

#[doc(hidden)]
pub mod bench_support;
mod class;
pub mod dispatch;
mod error;
mod policy;
mod pool;
pub mod predict;
pub mod score;
mod state;
pub mod stats;
mod step;
mod tree;

pub use class::class_id;
pub use error::CoreError;
pub use policy::{
    BrcConfig, MAX_FILL_SLACK, MAX_LOOKAHEAD, Mode, Policy, PolicyConfig, PolicyKind,
    PredictorKind, build_policy,
};
pub use pool::{Pool, PoolEntry};
pub use state::{ClusterState, Phase, RequestInfo, WorkerInfo};
pub use step::{StepFit, StepModel};

/// A data-parallel rank inside one lockstep group (`g` in the paper).
pub type WorkerId = u32;
/// A request, as the core knows it. Services intern their string ids into these.
pub type RequestKey = u64;

/// The architecture bounds one lockstep group at 64 ranks; we accept ids up to 1023 so sparse
/// rank numbering still works, and refuse anything larger (it would be a client bug).
pub const MAX_WORKERS: u32 = 1024;
