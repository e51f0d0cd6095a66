//! The pool-bypass router (one call per arriving request) and the tie-break order it shares
//! with Stage 1.
//!
//! Separate from the batch dispatcher: it routes one request on arrival, without the pool or a
//! tick, and is what `br0-bypass` and the baselines' tie-breaks call.

use super::*;

/// Pool bypass: route one arriving request to the live worker with the best `F_g({i})` (BR-0),
/// preferring workers with a free slot; ties broken by `tie`. `None` when no worker is live.
pub fn route_bypass(entry: &PoolEntry, state: &ClusterState, tie: TieBreak) -> Option<WorkerId> {
    let max = state.max_load();
    let g = state.live_workers();
    let any_free = state.workers().iter().any(|w| w.free_slots() > 0);
    let mut best: Option<(WorkerId, i128)> = None;
    for w in state.accepting_worker_ids() {
        let info = &state.workers()[w as usize];
        if any_free && info.free_slots() == 0 {
            continue;
        }
        let f = br0_score(u64::from(entry.prompt_tokens), max - info.load(), g);
        let better = match best {
            None => true,
            Some((bw, bf)) => f > bf || (f == bf && tie_prefers(tie, state, w, bw)),
        };
        if better {
            best = Some((w, f));
        }
    }
    best.map(|b| b.0)
}

/// Whether `a` wins a tie against `b`, by σ's loads and request counts.
pub(crate) fn tie_prefers(tie: TieBreak, state: &ClusterState, a: WorkerId, b: WorkerId) -> bool {
    let key = |w: WorkerId| {
        let info = &state.workers()[w as usize];
        tie_key(tie, w, info.requests(), info.load() as f64)
    };
    key(a) < key(b)
}

/// The order in which tied workers are preferred (smaller first): the one definition both the
/// pool-bypass router and Stage 1's placement use. Loads are whole token counts (exact in f64).
pub(super) fn tie_key(
    tie: TieBreak,
    w: WorkerId,
    requests: u32,
    load: f64,
) -> (u32, f64, WorkerId) {
    match tie {
        TieBreak::LowestId => (0, 0.0, w),
        TieBreak::LeastLoaded => (0, load, w),
        TieBreak::FewestRequests => (requests, load, w),
    }
}
