//! How a run is set up: the step-time model and group shape ([`EngineConfig`]), where prefill
//! runs ([`Colocated`]) and the control plane as deployed ([`ControlPlane`]: telemetry lag,
//! several deciders).
//!
//! Separate from the engine: these are the inputs the CLI and the sweeps build, documented
//! apart from how the step loop uses them.

/// Engine parameters.
#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// G.
    pub workers: u32,
    /// B.
    pub slots: u32,
    /// a, ms per KV token.
    pub step_a: f64,
    /// b, ms.
    pub step_b: f64,
    /// c, ms per running request on the rank that runs the most (0: the paper's model).
    pub step_c: f64,
    /// Prefill on the decode ranks, in the same steps as their decode batch (`None`: prefill
    /// runs elsewhere, the decode-only model).
    pub colocated: Option<Colocated>,
    /// Keep the per-step per-worker loads (for the load figure).
    pub record_loads: bool,
    /// How the control plane sees the group (ideal: one decider with a perfect view).
    pub control: ControlPlane,
}

/// Colocated prefill: each rank runs the prompts of the requests routed to it, in the same steps
/// as its decode batch (SGLang `--enable-dp-attention`, vLLM data parallel with expert
/// parallelism, TensorRT-LLM attention DP with in-flight batching).
///
/// A rank takes requests from its queue first come, first served, while it has a free slot and
/// prefill budget left in the step: up to `chunk` prompt tokens per rank per step (the engines'
/// chunked-prefill budget: vLLM's `max_num_batched_tokens`, SGLang's `--chunked-prefill-size`,
/// TensorRT-LLM's `max_num_tokens`; vLLM and TensorRT-LLM count the step's decode tokens in the
/// same budget, which with B ≤ 256 against thousands of tokens moves it by a few percent, left
/// out here). The prompt it is part way through comes first; a prompt
/// longer than what is left is split and continues next step, so at most one prompt per rank
/// is part way through. A request holds its slot from its first chunk. The step that runs its
/// last chunk writes its first token; its KV grows by each chunk as the chunk completes (the
/// step reads the KV of the chunks before). The step is `a·max L + p·max P + c·max n + b`
/// (`br_core::StepModel::step_ms_with_prefill`), P_g the prompt tokens rank g runs in it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Colocated {
    /// p, ms per prefill token on the rank that runs the most prefill in the step.
    pub step_p: f64,
    /// Prompt tokens a rank runs per step at most (≥ 1).
    pub chunk: u32,
}

/// The control plane as deployed, not as idealised: telemetry reaches the deciders late, and
/// several deciders (decision replicas) route at once. [`ControlPlane::IDEAL`] is the paper's
/// model (and what every figure used before this was added).
///
/// * `telemetry_lag_steps` = d: a decider's σ shows worker progress (tokens written, requests
///   finished, requests started) as it was d steps ago. Reservations are not lagged: σ learns
///   them from the `Reserve` call itself, so every reservation made since then is in the view,
///   as a reservation (its prompt counts; its progress is unknown).
/// * `deciders` = K: arrivals are spread round-robin over K deciders, each with its own pool
///   (or, for on-arrival policies, its own routing) and its own view; a decider sees the others'
///   reservations of the same step only at the next step (one `Reserve` round trip). A pooled
///   admission that finds its worker full when it reaches σ is refused and rejoins its decider's
///   pool at its arrival position, as the snapshot service's serialised `Reserve` would do.
/// * `turns`: the K deciders take turns, one admission round each (decider `r mod K` in round
///   r, one round per step): each then sees every other's admissions, made in earlier rounds,
///   and none collide. A model of splitting ticks rather than only the pool between replicas.
///   The live services have no shared round order to keep such turns by (their ticks run on
///   their own clocks); `rank_split` is the order they do keep (`br-decision --decider-index`).
/// * `rank_split = Some(t)`: decider k places only on the ranks it owns (`g mod K = k`), every
///   rank still counted in its score (the others are not accepting in its view, their load
///   stays), so no two deciders ever reach for one free slot. A rank with free slots since `t`
///   steps or more (its owner left them: it is dead, or had nothing to place) is open to every
///   decider, which is what keeps a group served when a replica dies; only such takeovers can
///   collide. The live rule, with `t` a duration read from σ (`--decider-takeover`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlPlane {
    pub telemetry_lag_steps: u32,
    pub deciders: u32,
    pub turns: bool,
    pub rank_split: Option<u32>,
}

impl ControlPlane {
    /// One decider, no lag.
    pub const IDEAL: ControlPlane = ControlPlane {
        telemetry_lag_steps: 0,
        deciders: 1,
        turns: false,
        rank_split: None,
    };
}

impl Default for ControlPlane {
    fn default() -> Self {
        ControlPlane::IDEAL
    }
}
