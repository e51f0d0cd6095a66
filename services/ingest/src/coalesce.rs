//! The coalescing buffer between the telemetry streams and the snapshot service.
//!
//! Changes are kept in arrival order. A request's progress keeps the position of its first
//! occurrence in the tick and takes every later value (max()-merged), so a tick carries one
//! change per request however many reports it got. A worker's newer full state (WorkerSync)
//! replaces an older one still waiting and goes to the end (after the progress it lists).
//! Hello and Disconnected are kept as they come (they are rare and their order matters).
//!
//! The number of distinct requests waiting is bounded: past it the oldest progress entries
//! are dropped and reported, so the caller can ask their workers for a full state.

use std::collections::VecDeque;

use br_proto::valid::{GroupId, RequestId};
use rustc_hash::FxHashMap;

use crate::change::Change;

/// (group, worker_id, incarnation).
pub type WorkerRef = (GroupId, u32, u64);

type ProgressKey = (GroupId, u32, u64, RequestId);

#[derive(Debug)]
struct Slot {
    group: GroupId,
    change: Change,
}

/// See the module docs.
#[derive(Debug)]
pub struct Coalescer {
    /// Logical index `base + i` for `slots[i]`; `None` marks a change merged away or dropped.
    slots: VecDeque<Option<Slot>>,
    base: u64,
    live: usize,
    progress: FxHashMap<ProgressKey, u64>,
    syncs: FxHashMap<WorkerRef, u64>,
    max_progress: usize,
    /// No live progress before this logical index (where dropping resumes).
    drop_cursor: u64,
    dropped: u64,
}

impl Coalescer {
    /// A buffer holding at most `max_progress` distinct requests (at least 1).
    pub fn new(max_progress: usize) -> Coalescer {
        Coalescer {
            slots: VecDeque::new(),
            base: 0,
            live: 0,
            progress: FxHashMap::default(),
            syncs: FxHashMap::default(),
            max_progress: max_progress.max(1),
            drop_cursor: 0,
            dropped: 0,
        }
    }

    /// Changes waiting.
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Progress entries dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    fn slot_mut(&mut self, idx: u64) -> Option<&mut Option<Slot>> {
        let i = usize::try_from(idx.checked_sub(self.base)?).ok()?;
        self.slots.get_mut(i)
    }

    fn push_slot(&mut self, group: GroupId, change: Change) -> u64 {
        let idx = self.base + self.slots.len() as u64;
        self.slots.push_back(Some(Slot { group, change }));
        self.live += 1;
        idx
    }

    /// Adds one change. Returns the workers whose progress had to be dropped to stay within
    /// the bound (usually none).
    pub fn push(&mut self, group: &GroupId, change: Change, dropped: &mut Vec<WorkerRef>) {
        match change {
            Change::Progress {
                worker_id,
                incarnation,
                request_id,
                state,
            } => {
                let key = (group.clone(), worker_id, incarnation, request_id);
                if let Some(&idx) = self.progress.get(&key)
                    && let Some(Some(Slot {
                        change: Change::Progress { state: s, .. },
                        ..
                    })) = self.slot_mut(idx)
                {
                    s.merge(state);
                    return;
                }
                let change = Change::Progress {
                    worker_id,
                    incarnation,
                    request_id: key.3.clone(),
                    state,
                };
                let idx = self.push_slot(group.clone(), change);
                self.progress.insert(key, idx);
                while self.progress.len() > self.max_progress {
                    match self.drop_oldest_progress() {
                        Some(w) => dropped.push(w),
                        None => break,
                    }
                }
            }
            Change::Sync {
                worker_id,
                incarnation,
                request_ids,
            } => {
                let key = (group.clone(), worker_id, incarnation);
                if let Some(old) = self.syncs.get(&key).copied()
                    && let Some(slot) = self.slot_mut(old)
                    && slot.take().is_some()
                {
                    self.live -= 1;
                }
                let idx = self.push_slot(
                    group.clone(),
                    Change::Sync {
                        worker_id,
                        incarnation,
                        request_ids,
                    },
                );
                self.syncs.insert(key, idx);
            }
            other => {
                self.push_slot(group.clone(), other);
            }
        }
    }

    fn drop_oldest_progress(&mut self) -> Option<WorkerRef> {
        let mut idx = self.drop_cursor.max(self.base);
        let end = self.base + self.slots.len() as u64;
        while idx < end {
            let i = usize::try_from(idx - self.base).ok()?;
            let is_progress = matches!(
                self.slots.get(i),
                Some(Some(Slot {
                    change: Change::Progress { .. },
                    ..
                }))
            );
            if is_progress {
                let slot = self.slots.get_mut(i)?.take()?;
                self.live -= 1;
                self.dropped += 1;
                self.drop_cursor = idx + 1;
                let Change::Progress {
                    worker_id,
                    incarnation,
                    request_id,
                    ..
                } = slot.change
                else {
                    return None;
                };
                self.progress
                    .remove(&(slot.group.clone(), worker_id, incarnation, request_id));
                return Some((slot.group, worker_id, incarnation));
            }
            idx += 1;
        }
        self.drop_cursor = idx;
        None
    }

    /// Takes everything (the common case: the buffer is drained every tick), without
    /// maintaining the indexes entry by entry.
    fn take_all(&mut self) -> Vec<(GroupId, Change)> {
        // Logical indexes keep rising; `base` moves past every slot, tombstones included.
        self.base += self.slots.len() as u64;
        let out: Vec<(GroupId, Change)> = self
            .slots
            .drain(..)
            .flatten()
            .map(|s| (s.group, s.change))
            .collect();
        self.live = 0;
        self.progress.clear();
        self.syncs.clear();
        out
    }

    /// Takes up to `max` changes from the front, in order, as (group, change).
    pub fn take(&mut self, max: usize) -> Vec<(GroupId, Change)> {
        if max >= self.live {
            return self.take_all();
        }
        let mut out = Vec::with_capacity(max.min(self.live));
        while out.len() < max {
            let Some(slot) = self.slots.pop_front() else {
                break;
            };
            let idx = self.base;
            self.base += 1;
            let Some(Slot { group, change }) = slot else {
                continue;
            };
            self.live -= 1;
            match &change {
                Change::Progress {
                    worker_id,
                    incarnation,
                    request_id,
                    ..
                } if !self.progress.is_empty() => {
                    let key = (group.clone(), *worker_id, *incarnation, request_id.clone());
                    if self.progress.get(&key) == Some(&idx) {
                        self.progress.remove(&key);
                    }
                }
                Change::Sync {
                    worker_id,
                    incarnation,
                    ..
                } => {
                    let key = (group.clone(), *worker_id, *incarnation);
                    if self.syncs.get(&key) == Some(&idx) {
                        self.syncs.remove(&key);
                    }
                }
                _ => {}
            }
            out.push((group, change));
        }
        // Drop leading tombstones so `slots` does not keep dead entries around.
        while matches!(self.slots.front(), Some(None)) {
            self.slots.pop_front();
            self.base += 1;
        }
        if self.slots.is_empty() {
            self.progress.clear();
            self.syncs.clear();
        }
        out
    }
}

/// Splits changes taken in order into per-group batches of at most `max_per_batch`, keeping
/// the order within each group (groups in order of first appearance).
pub fn into_batches(
    taken: Vec<(GroupId, Change)>,
    max_per_batch: usize,
) -> Vec<(GroupId, Vec<Change>)> {
    let max_per_batch = max_per_batch.max(1);
    let mut order: Vec<GroupId> = Vec::new();
    let mut by_group: FxHashMap<GroupId, Vec<Change>> = FxHashMap::default();
    for (g, c) in taken {
        by_group
            .entry(g.clone())
            .or_insert_with(|| {
                order.push(g);
                Vec::new()
            })
            .push(c);
    }
    let mut out = Vec::new();
    for g in order {
        let Some(mut changes) = by_group.remove(&g) else {
            continue;
        };
        while changes.len() > max_per_batch {
            let rest = changes.split_off(max_per_batch);
            out.push((g.clone(), changes));
            changes = rest;
        }
        if !changes.is_empty() {
            out.push((g, changes));
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::change::Cumulative;

    fn g(s: &str) -> GroupId {
        GroupId::new(s).unwrap()
    }

    fn prog(w: u32, id: &str, generated: u32) -> Change {
        Change::Progress {
            worker_id: w,
            incarnation: 1,
            request_id: RequestId::new(id).unwrap(),
            state: Cumulative {
                prompt_tokens: 1,
                generated_tokens: generated,
                finished: false,
                unkeyed: false,
            },
        }
    }

    #[test]
    fn one_change_per_request_per_tick_in_first_position() {
        let mut c = Coalescer::new(100);
        let mut d = Vec::new();
        let g0 = g("g0");
        c.push(
            &g0,
            Change::Hello {
                worker_id: 0,
                incarnation: 1,
                capacity: 1,
                endpoint: String::new(),
            },
            &mut d,
        );
        for j in 1..=100 {
            c.push(&g0, prog(0, "a", j), &mut d);
            c.push(&g0, prog(0, "b", j), &mut d);
        }
        c.push(&g0, prog(0, "a", 50), &mut d); // older value: max() keeps 100
        assert_eq!(c.len(), 3);
        let taken = c.take(usize::MAX);
        assert!(matches!(taken[0].1, Change::Hello { .. }));
        assert_eq!(taken[1].1, prog(0, "a", 100));
        assert_eq!(taken[2].1, prog(0, "b", 100));
        assert!(c.is_empty());
        // A new tick starts fresh.
        c.push(&g0, prog(0, "a", 101), &mut d);
        assert_eq!(c.take(10).len(), 1);
        assert!(d.is_empty());
    }

    #[test]
    fn newer_sync_replaces_older_and_goes_last() {
        let mut c = Coalescer::new(100);
        let mut d = Vec::new();
        let g0 = g("g0");
        let sync = |ids: &[&str]| Change::Sync {
            worker_id: 0,
            incarnation: 1,
            request_ids: ids.iter().map(|i| RequestId::new(i).unwrap()).collect(),
        };
        c.push(&g0, sync(&["a"]), &mut d);
        c.push(&g0, prog(0, "b", 1), &mut d);
        c.push(&g0, sync(&["a", "b"]), &mut d);
        let taken: Vec<Change> = c.take(10).into_iter().map(|(_, c)| c).collect();
        assert_eq!(taken, vec![prog(0, "b", 1), sync(&["a", "b"])]);
    }

    #[test]
    fn bound_drops_oldest_progress_and_names_the_worker() {
        let mut c = Coalescer::new(3);
        let mut d = Vec::new();
        let g0 = g("g0");
        c.push(
            &g0,
            Change::Disconnected {
                worker_id: 9,
                incarnation: 1,
                at_unix_ms: 5,
            },
            &mut d,
        );
        for (w, id) in [(0, "a"), (1, "b"), (2, "c"), (3, "d"), (4, "e")] {
            c.push(&g0, prog(w, id, 1), &mut d);
        }
        assert_eq!(d, vec![(g0.clone(), 0, 1), (g0.clone(), 1, 1)]);
        assert_eq!(c.dropped(), 2);
        assert_eq!(c.len(), 4, "the disconnect is never dropped");
        // A dropped request can come back (and is new again).
        c.push(&g0, prog(0, "a", 2), &mut d);
        let taken: Vec<Change> = c.take(100).into_iter().map(|(_, c)| c).collect();
        assert!(matches!(taken[0], Change::Disconnected { .. }));
        assert_eq!(
            taken[1..],
            [prog(3, "d", 1), prog(4, "e", 1), prog(0, "a", 2)]
        );
    }

    #[test]
    fn partial_takes_keep_the_index_right() {
        let mut c = Coalescer::new(100);
        let mut d = Vec::new();
        let g0 = g("g0");
        for id in ["a", "b", "c"] {
            c.push(&g0, prog(0, id, 1), &mut d);
        }
        assert_eq!(c.take(1).len(), 1);
        c.push(&g0, prog(0, "a", 5), &mut d); // a was taken: new entry at the end
        c.push(&g0, prog(0, "b", 5), &mut d); // b still waits: merged in place
        let taken: Vec<Change> = c.take(100).into_iter().map(|(_, c)| c).collect();
        assert_eq!(
            taken,
            vec![prog(0, "b", 5), prog(0, "c", 1), prog(0, "a", 5)]
        );
    }

    #[test]
    fn batches_per_group_in_order_and_bounded() {
        let g0 = g("g0");
        let g1 = g("g1");
        let taken = vec![
            (g0.clone(), prog(0, "a", 1)),
            (g1.clone(), prog(0, "x", 1)),
            (g0.clone(), prog(0, "b", 1)),
            (g0.clone(), prog(0, "c", 1)),
        ];
        let b = into_batches(taken, 2);
        assert_eq!(b.len(), 3);
        assert_eq!(b[0].0, g0);
        assert_eq!(b[0].1, vec![prog(0, "a", 1), prog(0, "b", 1)]);
        assert_eq!(b[1].1, vec![prog(0, "c", 1)]);
        assert_eq!(b[2].0, g1);
    }
}
