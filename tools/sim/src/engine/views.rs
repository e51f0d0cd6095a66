//! What the deciders see when the control plane is not ideal ([`super::ControlPlane`]): σ as
//! it was `lag` steps ago plus every reservation since, one view per decider.
//!
//! Separate from the step loop in [`super::simulate_deciders`], which only asks for a view and
//! reports reservations: how a lagged view is rebuilt reads on its own.

use super::*;

/// What the deciders see (see [`ControlPlane`]): the true σ of `lag` steps ago, every
/// reservation made since, and each decider's own reservations of this step.
pub(super) struct Views {
    lag: usize,
    /// The true state at the start of each of the last `lag` steps, oldest first (the one of
    /// `lag` steps ago moves into this step's views).
    history: VecDeque<ClusterState>,
    /// A state no view holds any longer, whose allocation the next copy of the truth reuses.
    spare: Option<ClusterState>,
    /// Reservations (by any decider) with the step they were made in, oldest first.
    log: VecDeque<(u64, RequestInfo)>,
    views: Vec<ClusterState>,
}

impl Views {
    pub(super) fn new(lag: u32, deciders: usize) -> Views {
        Views {
            lag: lag as usize,
            history: VecDeque::new(),
            spare: None,
            log: VecDeque::new(),
            views: vec![ClusterState::new(); deciders],
        }
    }

    pub(super) fn begin_step(&mut self, step: u64, truth: &ClusterState) {
        // One copy of the state per step: the truth is copied into the history (into the
        // allocation the replaced view gave back), and the oldest kept state, which no later
        // step needs, is moved into this step's view rather than copied. At G = 32 and B = 256
        // a state holds some 64,000 requests, and three copies a step made lagged runs slow.
        let mut kept = self.spare.take().unwrap_or_default();
        kept.clone_from(truth);
        self.history.push_back(kept);
        let since = step.saturating_sub(self.lag as u64);
        while self.log.front().is_some_and(|(s, _)| *s < since) {
            self.log.pop_front();
        }
        let mut common = if self.history.len() > self.lag {
            self.history.pop_front().unwrap_or_default()
        } else {
            // Fewer than `lag` steps so far: the first state stays for the next steps too.
            self.history.front().cloned().unwrap_or_default()
        };
        for (_, info) in &self.log {
            if !common.contains(info.key) {
                // refused only when the stale view shows its worker fenced, which the
                // simulated group never is
                let _ = common.reserve(info.clone());
            }
        }
        if let Some((last, rest)) = self.views.split_last_mut() {
            for v in rest {
                v.clone_from(&common);
            }
            self.spare = Some(std::mem::replace(last, common));
        }
    }

    pub(super) fn view(&self, decider: usize) -> &ClusterState {
        &self.views[decider]
    }

    /// Rank split: the ranks `decider` may not place on this step stop accepting in its view
    /// (their load still counts in its score). The next `begin_step` reopens them.
    pub(super) fn close_ranks(&mut self, decider: usize, ranks: impl Iterator<Item = usize>) {
        for w in ranks {
            // every rank of the simulated group exists
            let _ = self.views[decider].set_accepting(w as WorkerId, false);
        }
    }

    pub(super) fn admitted(&mut self, decider: usize, step: u64, info: &RequestInfo) {
        let _ = self.views[decider].reserve(info.clone());
        self.log.push_back((step, info.clone()));
    }
}

pub(super) fn queued_info(entry: &PoolEntry, worker: WorkerId) -> RequestInfo {
    RequestInfo {
        key: entry.key,
        worker,
        prompt_tokens: entry.prompt_tokens,
        generated: 0,
        phase: Phase::Queued,
        prompt_hash: entry.prompt_hash,
        oracle_output: entry.oracle_output,
        expected_output: entry.expected_output,
        class: entry.class,
    }
}
