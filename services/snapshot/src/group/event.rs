//! What a watcher's queue carries, and how queued or kept deltas are merged: shared by the
//! watchers (who fill the queues) and the queue (which merges what waits in it).

use std::sync::Arc;

use br_proto::v1;
use br_sigma::Delta;
use prost::Message as _;

/// What one watcher's queue carries; the Watch stream turns it into a `WatchEvent`
/// (`crate::wire`). Deltas and snapshots are shared by every watcher (one allocation each).
#[derive(Debug, Clone)]
pub enum Event {
    /// The whole σ at one version.
    Snapshot(Arc<v1::ClusterSnapshot>),
    /// The changes from `prev_version` to `version` (one committed batch, or several merged).
    Delta(Arc<Delta>),
    /// Nothing changed for a while: σ is still at (epoch, version).
    Progress { epoch: u64, version: u64 },
    /// What the watcher holds cannot be brought up to date by deltas; a snapshot follows.
    Reset {
        reason: v1::ResetReason,
        epoch: u64,
        detail: Arc<str>,
    },
}

/// A merged catch-up delta holds at most this many changes (then another one starts), so a
/// resuming watcher gets a few bounded messages rather than thousands of small ones.
pub const MERGE_MAX_CHANGES: usize = 4096;

/// An event's encoded size as its Watch stream sends it (what a watcher's queue counts),
/// computed once per event and shared by every watcher it goes to.
pub fn event_bytes(ev: &Event) -> usize {
    // The WatchEvent's own framing (field tags and lengths) is a few bytes.
    const FRAMING: usize = 16;
    FRAMING
        + match ev {
            Event::Snapshot(s) => s.encoded_len(),
            Event::Delta(d) => d.encoded_len(),
            Event::Progress { .. } => 24,
            Event::Reset { detail, .. } => 24 + detail.len(),
        }
}

pub(super) fn delta_of(ev: &Event) -> Option<&Delta> {
    match ev {
        Event::Delta(d) => Some(d),
        _ => None,
    }
}

/// One delta from consecutive ones (the first's prev_version to the last's version). Used for
/// a resuming watcher's catch-up and for the deltas queued behind each other in a watcher's
/// queue (`queue::Merging`).
pub(super) fn merge(chunk: &[&Event]) -> Event {
    if let [one] = chunk {
        return (*one).clone();
    }
    let ds: Vec<&Delta> = chunk.iter().filter_map(|e| delta_of(e)).collect();
    let (Some(first), Some(last)) = (ds.first(), ds.last()) else {
        return chunk[0].clone();
    };
    Event::Delta(Arc::new(Delta {
        epoch: first.epoch,
        prev_version: first.prev_version,
        version: last.version,
        changes: ds.iter().flat_map(|d| d.changes.iter().cloned()).collect(),
    }))
}
