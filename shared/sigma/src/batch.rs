//! [`Batch`]: the writer's side of σ, changes applied at once and collected into a delta.

use br_proto::v1;

use crate::store::Sigma;
use crate::types::{Delta, SigmaError};

// Made by σ, defined here with the type it makes so that the store needs nothing of batches.
impl Sigma {
    /// Starts a batch of changes for the writer: the changes are applied at once, and
    /// [`Batch::commit`] turns those that changed σ into the next version's delta.
    #[must_use = "a batch's changes are applied at once; commit it to move the version"]
    pub fn batch(&mut self) -> Batch<'_> {
        Batch {
            sigma: self,
            changes: Vec::new(),
        }
    }
}

/// The writer's side: changes applied to σ at once, collected into the next version's delta.
/// Read σ through [`Batch::sigma`] while deciding what to apply next.
#[derive(Debug)]
pub struct Batch<'a> {
    pub(crate) sigma: &'a mut Sigma,
    pub(crate) changes: Vec<v1::Change>,
}

impl Batch<'_> {
    /// Applies `change`; keeps it for the delta if it changed σ. On error nothing changes.
    pub fn apply(&mut self, change: v1::Change) -> Result<bool, SigmaError> {
        let changed = self.sigma.apply_change(&change)?;
        if changed {
            self.changes.push(change);
        }
        Ok(changed)
    }

    pub fn sigma(&self) -> &Sigma {
        self.sigma
    }

    /// The changes kept so far.
    pub fn changes(&self) -> &[v1::Change] {
        &self.changes
    }

    /// Moves σ to the next version and returns its delta, or `None` (and the version stays)
    /// if no change altered σ.
    pub fn commit(self) -> Option<Delta> {
        if self.changes.is_empty() {
            return None;
        }
        let prev = self.sigma.version;
        self.sigma.version += 1;
        Some(Delta {
            epoch: self.sigma.epoch,
            prev_version: prev,
            version: self.sigma.version,
            changes: self.changes,
        })
    }
}
