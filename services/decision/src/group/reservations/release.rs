//! The release side of [`Reservations`]: ids to release with the next `Release` call, held
//! back while their `Reserve` is in flight, and the ids released recently (so a repeated
//! `Cancel` finds nothing).
//!
//! Separate from the reservations' own states: a release outlives the reservation it ends.

use super::*;

impl Reservations {
    /// Releases `id` at the snapshot service with the next `Release` call.
    pub(in crate::group) fn release(&mut self, id: String) {
        self.releases.push(id);
    }

    /// Drops a reservation, releasing it at the snapshot service if it may be there. Returns
    /// whether there was one.
    pub(in crate::group) fn release_local(&mut self, key: RequestKey) -> bool {
        let Some(l) = self.local.remove(&key) else {
            return false;
        };
        if !matches!(l.state, LocalState::Uncommitted { .. }) {
            self.releases.push(l.res.request_id.to_string());
        }
        true
    }

    /// Releases the reservation of a cancelled answered request σ does not show: at once if
    /// committed, once its call returns if in flight, just forgotten if uncommitted. Returns
    /// whether there was one.
    pub(in crate::group) fn release_unseen(&mut self, key: RequestKey) -> bool {
        let Some(l) = self.local.get_mut(&key) else {
            return false;
        };
        match l.state {
            LocalState::InFlight => l.release_when_done = true,
            LocalState::Committed { .. } => {
                self.releases.push(l.res.request_id.to_string());
                self.local.remove(&key);
            }
            LocalState::Uncommitted { .. } => {
                self.local.remove(&key);
            }
        }
        true
    }

    /// Ids to release at the snapshot service (one `Release` call), sorted; remembered as
    /// released recently.
    pub(in crate::group) fn take_release(&mut self, now: Instant) -> Option<Vec<String>> {
        if self.releases.is_empty() {
            return None;
        }
        let mut ids = std::mem::take(&mut self.releases);
        for id in &ids {
            if let Ok(rid) = RequestId::new(id) {
                self.released.insert(rid, now);
            }
        }
        ids.sort_unstable();
        ids.dedup();
        Some(ids)
    }

    /// Whether a `Release` of `id` is still to be sent: queued for the next call, or due once
    /// the `Reserve` call carrying it returns.
    pub(in crate::group) fn release_pending(&self, id: &str) -> bool {
        self.releases.iter().any(|r| r == id)
            || self
                .local
                .values()
                .any(|l| l.release_when_done && l.res.request_id.as_str() == id)
    }

    pub(in crate::group) fn recently_released(&self, id: &str) -> bool {
        self.released.contains_key(id)
    }

    pub(in crate::group) fn note_released(&mut self, id: RequestId, now: Instant) {
        self.released.insert(id, now);
    }

    /// Forgets released ids σ no longer shows, or released longer than `ttl` ago.
    pub(in crate::group) fn expire_released(
        &mut self,
        sigma: Option<&Sigma>,
        now: Instant,
        ttl: Duration,
    ) {
        if self.released.is_empty() {
            return;
        }
        self.released.retain(|id, at| {
            sigma.is_some_and(|s| s.request(id.as_str()).is_some())
                && now.saturating_duration_since(*at) < ttl
        });
    }
}
