//! Several decision replicas of one group without collisions: the rank split
//! (`--deciders K --decider-index i`).
//!
//! Replicas that tick on the same σ pick the same free slots, and the snapshot's serialised
//! `Reserve` refuses all but the first (`WorkerFull`), which re-pools the rest. Taking turns
//! by a round counter would remove that, but the replicas share no clock and no counter: only σ
//! (through the Watch) and `Reserve`. What they can keep without talking is a split of the
//! *ranks*: replica i places only on ranks g with `g mod K = i`. Every rank still counts in
//! its score (the others' ranks stop accepting in its view, their load stays), so it balances
//! against the whole group; no two replicas reach for one free slot.
//!
//! A dead replica must not strand its ranks (HA is why there are several): a rank that has had
//! free slots in σ for `takeover` or longer is open to it too. Its owner fills a freed slot at
//! its next tick (a σ change triggers one within `--tick-min-interval`), so a slot left free
//! that long means the owner is gone or had nothing to place, and only such takeovers can
//! collide. The group is served by the survivors within `takeover` plus a tick. The rule needs
//! no liveness protocol: a free slot's age is read from σ alone, at every σ change, whether
//! this replica has anything to place or not (a clock kept only by ticks that place would
//! start again after every idle spell, and a takeover would wait one more `takeover`).
//!
//! The clock only runs on a σ the snapshot service confirms current. While σ is stale (the
//! Watch is down, or the replica awaits a fresh snapshot) no rank is taken over: the owner
//! places on its ranks from its own stale view meanwhile, where no other replica can see it, so
//! a free slot's age in a frozen σ says nothing about whether its owner is gone (two replicas
//! taking the same slots through an outage would answer the gateway with both and collide when
//! they re-commit). When σ is current again, and after every fresh snapshot (a resubscription
//! that missed deltas, a restart of the snapshot service), every clock starts again: a takeover
//! then waits `takeover` from that moment. A group whose other replicas and snapshot service are
//! down at once keeps only this replica's ranks until σ is back.
//!
//! Nor does a clock start before σ's picture of the rank can be believed: a worker σ shows
//! back (after a restart of the snapshot service, a reconnection, or the worker's own restart)
//! holds what it reports, and its reports take up to `--recommit-settle` to arrive. Until then
//! σ may show it empty while the owner's placements through the outage run on it (the owner
//! re-commits them by the same rule, [`super::reservations`]). So a rank back in σ is taken
//! over `--recommit-settle` plus `takeover` after σ shows it back at the earliest.
//!
//! A wrong configuration (two replicas claiming one index, K disagreeing) cannot be seen from
//! one replica's flags; it shows as refusals on ranks this replica owns, counted in
//! `balanceroute_decision_rank_split_conflicts_total`, which a consistent split keeps near 0.

use std::time::{Duration, Instant};

use br_core::{ClusterState, WorkerId};

/// A rank split configuration that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    #[error("--deciders must be at least 1")]
    NoDeciders,
    #[error("--decider-index {index} must be below --deciders {deciders}")]
    IndexOutOfRange { index: u32, deciders: u32 },
    #[error("--decider-index {index} needs --deciders K > 1 (one decider owns every rank)")]
    IndexWithoutSplit { index: u32 },
    #[error("--decider-takeover must be positive (0 would let every replica place everywhere)")]
    ZeroTakeover,
}

/// Which ranks this replica owns, and when it takes over the others' free slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankSplit {
    deciders: u32,
    index: u32,
    takeover: Duration,
}

impl RankSplit {
    /// `None` with one decider (no split); an error for a split that cannot work.
    pub fn new(deciders: u32, index: u32, takeover: Duration) -> Result<Option<Self>, SplitError> {
        match deciders {
            0 => Err(SplitError::NoDeciders),
            1 if index != 0 => Err(SplitError::IndexWithoutSplit { index }),
            1 => Ok(None),
            _ if index >= deciders => Err(SplitError::IndexOutOfRange { index, deciders }),
            _ if takeover.is_zero() => Err(SplitError::ZeroTakeover),
            _ => Ok(Some(RankSplit {
                deciders,
                index,
                takeover,
            })),
        }
    }

    /// Whether this replica owns rank `worker`.
    pub fn owns(&self, worker: WorkerId) -> bool {
        worker % self.deciders == self.index
    }

    pub fn takeover(&self) -> Duration {
        self.takeover
    }
}

/// The rank split of one group: since when each rank has had free slots in σ.
#[derive(Debug)]
pub(super) struct SplitTurns {
    split: RankSplit,
    /// By rank (σ's ranks are dense); `None` while σ shows the rank without free slots, or
    /// has not shown it yet.
    free_since: Vec<Option<Instant>>,
}

impl SplitTurns {
    pub(super) fn new(split: RankSplit) -> SplitTurns {
        SplitTurns {
            split,
            free_since: Vec::new(),
        }
    }

    pub(super) fn owns(&self, worker: WorkerId) -> bool {
        self.split.owns(worker)
    }

    /// Forgets every rank's free time (σ was not current for a while, or was replaced by a
    /// snapshot): the next [`Self::observe`] starts the clocks again.
    pub(super) fn restart(&mut self) {
        self.free_since.fill(None);
    }

    /// Reads σ as it is at `now` (called at every σ change): a rank's free time starts when σ
    /// first shows it with a free slot and ends when σ shows it full, so a slot its owner
    /// fills and frees again starts again. O(ranks), as the outage estimate's look at σ.
    ///
    /// `trusted_from(rank)` is when σ's picture of the rank can be believed: its worker's own
    /// reports have had time to arrive since σ (current) last showed it back (`None`: σ does
    /// not show it live). A free slot's time starts no earlier. After a restart of the
    /// snapshot service a worker is back before its reports are, and σ shows it empty; its
    /// owner's placements through the outage show only once the worker reports them.
    pub(super) fn observe(
        &mut self,
        sigma: &ClusterState,
        now: Instant,
        trusted_from: impl Fn(WorkerId) -> Option<Instant>,
    ) {
        let workers = sigma.workers();
        self.free_since.resize(workers.len(), None);
        for ((since, info), worker) in self.free_since.iter_mut().zip(workers).zip(0..) {
            if info.free_slots() == 0 {
                *since = None;
                continue;
            }
            match trusted_from(worker) {
                // a start in the future keeps the rank closed until then plus the takeover
                Some(trusted) => {
                    let start = trusted.max(now);
                    *since = Some(since.map_or(start, |s| s.max(trusted)));
                }
                None => *since = None,
            }
        }
    }

    /// The ranks this replica may not place on at `now`: the others' ranks with free slots in
    /// the `view` that σ has not shown free for the takeover time, and all of them while σ is
    /// `stale` (ranks without free slots in the view take nothing anyway).
    pub(super) fn closed(
        &self,
        view: &ClusterState,
        now: Instant,
        stale: bool,
        out: &mut Vec<WorkerId>,
    ) {
        out.clear();
        for (worker, info) in (0..).zip(view.workers()) {
            if info.free_slots() == 0 || self.split.owns(worker) {
                continue;
            }
            let since = self.free_since.get(worker as usize).copied().flatten();
            if stale
                || since
                    .is_none_or(|since| now.saturating_duration_since(since) < self.split.takeover)
            {
                out.push(worker);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use br_core::{Phase, RequestInfo};
    use proptest::prelude::*;

    const T: Duration = Duration::from_millis(100);

    fn split(k: u32, i: u32) -> RankSplit {
        RankSplit::new(k, i, T).unwrap().unwrap()
    }

    #[test]
    fn bad_splits_are_typed_errors() {
        assert_eq!(RankSplit::new(1, 0, T), Ok(None));
        assert_eq!(RankSplit::new(0, 0, T), Err(SplitError::NoDeciders));
        assert_eq!(
            RankSplit::new(2, 2, T),
            Err(SplitError::IndexOutOfRange {
                index: 2,
                deciders: 2
            })
        );
        assert_eq!(
            RankSplit::new(1, 1, T),
            Err(SplitError::IndexWithoutSplit { index: 1 })
        );
        assert_eq!(
            RankSplit::new(2, 0, Duration::ZERO),
            Err(SplitError::ZeroTakeover)
        );
    }

    fn fill(view: &mut ClusterState, worker: WorkerId, n: u32, key: &mut u64) {
        for _ in 0..n {
            *key += 1;
            view.reserve(RequestInfo {
                key: *key,
                worker,
                prompt_tokens: 10,
                generated: 0,
                phase: Phase::Queued,
                prompt_hash: None,
                oracle_output: None,
                expected_output: None,
                class: None,
            })
            .unwrap();
        }
    }

    #[test]
    fn a_rank_left_free_for_the_takeover_time_opens_and_a_filled_one_starts_again() {
        let mut sigma = ClusterState::with_workers(&[1, 1, 1, 1]);
        let mut turns = SplitTurns::new(split(2, 0));
        let t0 = Instant::now();
        let mut closed = Vec::new();
        turns.closed(&sigma, t0, false, &mut closed);
        assert_eq!(closed, vec![1, 3], "not seen free in σ yet");
        turns.observe(&sigma, t0, |_| Some(t0));
        turns.closed(&sigma, t0 + T / 2, false, &mut closed);
        assert_eq!(closed, vec![1, 3], "the other replica's ranks");
        // rank 3 is filled by its owner in time; rank 1 is not (its owner is gone)
        let mut key = 0;
        fill(&mut sigma, 3, 1, &mut key);
        turns.observe(&sigma, t0 + T / 2, |_| Some(t0));
        turns.closed(&sigma, t0 + T, false, &mut closed);
        assert!(closed.is_empty(), "rank 1 is open, rank 3 takes nothing");
        // rank 3 frees again: its free time starts now, not at t0
        sigma.remove(key).unwrap();
        turns.observe(&sigma, t0 + T, |_| Some(t0));
        turns.closed(&sigma, t0 + T + T / 2, false, &mut closed);
        assert_eq!(closed, vec![3]);
        // no σ change for a while (nothing to place, or nothing happened): the clock runs on
        turns.closed(&sigma, t0 + 2 * T, false, &mut closed);
        assert!(closed.is_empty(), "both open");
    }

    #[test]
    fn a_rank_is_not_taken_over_before_its_reports_can_be_believed() {
        let sigma = ClusterState::with_workers(&[1, 1, 1, 1]);
        let mut turns = SplitTurns::new(split(2, 0));
        let t0 = Instant::now();
        let settle = 5 * T;
        // rank 1 is back in σ at t0 (its reports may take `settle`); σ does not show rank 3
        // live
        let trusted = |w: WorkerId| (w == 1).then_some(t0 + settle);
        turns.observe(&sigma, t0, trusted);
        let mut closed = Vec::new();
        turns.closed(&sigma, t0 + T, false, &mut closed);
        assert_eq!(
            closed,
            vec![1, 3],
            "free in σ for the takeover time, not believable yet"
        );
        turns.observe(&sigma, t0 + settle, trusted);
        turns.closed(&sigma, t0 + settle + T / 2, false, &mut closed);
        assert_eq!(closed, vec![1, 3]);
        turns.closed(&sigma, t0 + settle + T, false, &mut closed);
        assert_eq!(
            closed,
            vec![3],
            "free since it can be believed, for the takeover time"
        );
        // a clock already running starts again when the rank is back again later (a
        // reconnection, a new incarnation)
        let later = t0 + settle + T;
        turns.observe(&sigma, later, |w| (w == 1).then_some(later + settle));
        turns.closed(&sigma, later + settle + T / 2, false, &mut closed);
        assert_eq!(closed, vec![1, 3]);
        turns.closed(&sigma, later + settle + T, false, &mut closed);
        assert_eq!(closed, vec![3]);
    }

    proptest! {
        /// Every rank has exactly one owner among K replicas with a consistent split, so
        /// before any takeover no two replicas may place on one rank, and each may place on
        /// its own free ranks.
        #[test]
        fn before_the_takeover_time_each_free_rank_is_open_to_exactly_its_owner(
            k in 2u32..9,
            capacities in prop::collection::vec(0u32..3, 1..40),
            elapsed_ms in 0u64..100,
        ) {
            let view = ClusterState::with_workers(&capacities);
            let now = Instant::now();
            let mut open_to = vec![0u32; capacities.len()];
            for i in 0..k {
                let mut turns = SplitTurns::new(split(k, i));
                let mut closed = Vec::new();
                turns.observe(&view, now, |_| Some(now));
                turns.closed(&view, now + Duration::from_millis(elapsed_ms), false, &mut closed);
                for (w, info) in (0..).zip(view.workers()) {
                    if info.free_slots() > 0 && !closed.contains(&w) {
                        prop_assert!(turns.owns(w));
                        open_to[w as usize] += 1;
                    }
                }
            }
            for (w, info) in view.workers().iter().enumerate() {
                prop_assert_eq!(open_to[w], u32::from(info.free_slots() > 0));
            }
        }
    }
}
