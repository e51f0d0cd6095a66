//! σ(k): the state of one lockstep group, with incremental load accounting.
//!
//! A request is *queued* from the moment it is assigned to a worker (a reservation in the
//! control plane, a worker-local queue in an engine) until the worker runs it; it is then
//! *running* until it finishes. Its KV load is `prompt_tokens + generated` (the paper's
//! `w_i(j) = s_i + j − 1` counted after the j-th token is written).
//!
//! Two loads are kept per worker:
//! * `running_load`: KV tokens the worker holds now: what the step time and the paper's
//!   imbalance metric are made of;
//! * `load()` = running + queued: what routing decisions count, because a reservation's
//!   prompt lands on that worker within milliseconds (the architecture's "load counts s_i at
//!   once"). The max/min tree is kept over this.

use rustc_hash::FxHashMap;

use crate::tree::LoadTree;
use crate::{CoreError, RequestKey, WorkerId};

// Defined beside `WorkerId` at the crate root (the error type names it too); here is where
// callers have always found it.
pub use crate::MAX_WORKERS;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Assigned to the worker, not yet running (reservation / worker-local queue).
    Queued,
    /// Running: emitting one token per step.
    Running,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestInfo {
    pub key: RequestKey,
    pub worker: WorkerId,
    pub prompt_tokens: u32,
    /// Output tokens generated so far (`j`).
    pub generated: u32,
    pub phase: Phase,
    pub prompt_hash: Option<u64>,
    /// The true output length, known only in simulation (for the Oracle predictor).
    pub oracle_output: Option<u32>,
    /// The client's expected output length in tokens, a hint that may be wrong (`None`: none
    /// was sent). Only the `Hinted` predictor reads it, and learns how far to trust it.
    pub expected_output: Option<u32>,
    /// The request's class (`None`: the gateway named none): the 64-bit id of its class key
    /// (`AssignRequest.request_class`), a hash of the key that every process computes alike,
    /// so it crosses σ and replicas as it is and needs no table of keys to bound (an interned
    /// small id would be one process's own). Nothing reads it yet.
    pub class: Option<u64>,
}

impl RequestInfo {
    /// KV tokens this request holds (or will hold, when queued).
    pub fn kv_tokens(&self) -> u64 {
        u64::from(self.prompt_tokens) + u64::from(self.generated)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerInfo {
    /// `B`: the most requests this worker runs at once (`max_num_seqs`).
    pub capacity: u32,
    pub running: u32,
    pub queued: u32,
    pub running_load: u64,
    pub queued_load: u64,
    /// Requests on this worker that have not written a token yet: queued ones, and running ones
    /// still in their prefill (a shim reports a request as soon as its engine takes it, before
    /// the prompt has run). What BR-C reads as "this rank is prefilling".
    pub prefilling: u32,
    /// Prompt tokens of those requests: the prefill this rank has queued or running, as σ
    /// knows it (an upper bound: σ learns a prompt's end from its first token, not how many
    /// of its chunks have run). BR-C reads it for where a prompt would wait least.
    pub prefill_tokens: u64,
    /// False when the worker is absent or fenced: it takes no new requests and holds none.
    pub alive: bool,
    /// False while a live worker must get no new requests but keeps its load (its telemetry
    /// stream is gone and the grace period runs: SUSPECT in the contracts).
    pub accepting: bool,
}

impl WorkerInfo {
    /// The load routing decisions count: running plus queued KV tokens.
    pub fn load(&self) -> u64 {
        self.running_load + self.queued_load
    }

    /// Slots neither running nor promised to a queued request.
    pub fn free_slots(&self) -> u32 {
        if !self.alive || !self.accepting {
            return 0;
        }
        self.capacity.saturating_sub(self.running + self.queued)
    }

    /// Requests on this worker, running or queued.
    pub fn requests(&self) -> u32 {
        self.running + self.queued
    }

    /// A request with a `prompt_tokens` prompt and no first token came to this worker.
    fn prefill_started(&mut self, prompt_tokens: u32) {
        self.prefilling += 1;
        self.prefill_tokens += u64::from(prompt_tokens);
    }

    /// A request with a `prompt_tokens` prompt wrote its first token, or left before it.
    fn prefill_ended(&mut self, prompt_tokens: u32) {
        self.prefilling -= 1;
        self.prefill_tokens -= u64::from(prompt_tokens);
    }
}

#[derive(Debug, Clone)]
struct Slot {
    info: RequestInfo,
    /// Position in `members[worker]`, for O(1) removal.
    pos: u32,
}

/// σ for one group. All mutations are O(1) amortised plus O(log G) for the max/min tree.
#[derive(Debug)]
pub struct ClusterState {
    workers: Vec<WorkerInfo>,
    slots: Vec<Option<Slot>>,
    free_slots: Vec<u32>,
    index: FxHashMap<RequestKey, u32>,
    members: Vec<Vec<u32>>,
    tree: LoadTree,
    live_workers: u32,
    /// Tokens written by this state's requests since it was made (progress that raised a
    /// request's count, and [`ClusterState::advance_step`]): in lockstep every running request
    /// writes one token per step, so a policy that counts decode steps (BR-C's hold) reads
    /// them here, the same way from the simulator's steps and from live progress reports.
    tokens_written: u64,
}

impl Clone for ClusterState {
    fn clone(&self) -> Self {
        Self {
            workers: self.workers.clone(),
            slots: self.slots.clone(),
            free_slots: self.free_slots.clone(),
            index: self.index.clone(),
            members: self.members.clone(),
            tree: self.tree.clone(),
            live_workers: self.live_workers,
            tokens_written: self.tokens_written,
        }
    }

    /// Copies `source` into the allocations `self` already has. The decision service rebuilds
    /// its view from σ's state on every tick after σ moved (`view.clone_from(σ)`); the derived
    /// `clone_from` is `*self = source.clone()`, a fresh allocation of every table per tick and
    /// the old ones freed (2% of br-all's CPU under load, see docs/benchmarks.md).
    fn clone_from(&mut self, source: &Self) {
        // Destructured, so that a field added to the struct fails to compile here instead of
        // being left stale in the view.
        let Self {
            workers,
            slots,
            free_slots,
            index,
            members,
            tree,
            live_workers,
            tokens_written,
        } = source;
        self.workers.clone_from(workers);
        self.slots.clone_from(slots);
        self.free_slots.clone_from(free_slots);
        self.index.clone_from(index);
        // Element-wise: each worker's member list keeps its allocation too.
        self.members.clone_from(members);
        self.tree.clone_from(tree);
        self.live_workers = *live_workers;
        self.tokens_written = *tokens_written;
    }
}

impl Default for ClusterState {
    fn default() -> Self {
        Self::new()
    }
}

impl ClusterState {
    pub fn new() -> Self {
        Self {
            workers: Vec::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            index: FxHashMap::default(),
            members: Vec::new(),
            tree: LoadTree::new(),
            live_workers: 0,
            tokens_written: 0,
        }
    }

    /// A group of `capacities.len()` live workers with ids `0..G`.
    pub fn with_workers(capacities: &[u32]) -> Self {
        let mut s = Self::new();
        for (id, &cap) in capacities.iter().enumerate() {
            // ids are < capacities.len() ≤ MAX_WORKERS in any sane caller; refuse otherwise.
            let id = u32::try_from(id).unwrap_or(u32::MAX);
            if s.upsert_worker(id, cap).is_err() {
                break;
            }
        }
        s
    }

    /// Brings a worker up (or changes its capacity). A worker that was fenced comes back empty.
    pub fn upsert_worker(&mut self, id: WorkerId, capacity: u32) -> Result<(), CoreError> {
        if id >= MAX_WORKERS {
            return Err(CoreError::WorkerIdTooLarge(id));
        }
        let idx = id as usize;
        if idx >= self.workers.len() {
            self.workers.resize(idx + 1, WorkerInfo::default());
            self.members.resize(idx + 1, Vec::new());
            self.tree.ensure(idx + 1);
        }
        let w = &mut self.workers[idx];
        if !w.alive {
            w.alive = true;
            self.live_workers += 1;
        }
        w.accepting = true;
        w.capacity = capacity;
        let load = w.load();
        self.tree.set(idx, Some(load));
        Ok(())
    }

    /// Fences a worker: it takes no new requests and every request it held is dropped from σ.
    /// Returns the dropped requests.
    pub fn fence_worker(&mut self, id: WorkerId) -> Result<Vec<RequestInfo>, CoreError> {
        let idx = self.worker_index(id)?;
        let keys: Vec<RequestKey> = self.members[idx]
            .iter()
            .filter_map(|&s| self.slots[s as usize].as_ref().map(|slot| slot.info.key))
            .collect();
        let mut dropped = Vec::with_capacity(keys.len());
        for key in keys {
            if let Ok(info) = self.remove(key) {
                dropped.push(info);
            }
        }
        let w = &mut self.workers[idx];
        if w.alive {
            w.alive = false;
            self.live_workers -= 1;
        }
        w.accepting = false;
        self.tree.set(idx, None);
        Ok(dropped)
    }

    /// Stops (or resumes) new assignments to a live worker without touching its requests.
    pub fn set_accepting(&mut self, id: WorkerId, accepting: bool) -> Result<(), CoreError> {
        let idx = self.worker_index(id)?;
        self.workers[idx].accepting = accepting && self.workers[idx].alive;
        Ok(())
    }

    fn worker_index(&self, id: WorkerId) -> Result<usize, CoreError> {
        let idx = id as usize;
        if idx < self.workers.len() && (self.workers[idx].capacity > 0 || self.workers[idx].alive) {
            Ok(idx)
        } else {
            Err(CoreError::UnknownWorker(id))
        }
    }

    /// Assigns a request to a worker as queued (a reservation). Its prompt counts at once.
    pub fn reserve(&mut self, info: RequestInfo) -> Result<(), CoreError> {
        let idx = self.worker_index(info.worker)?;
        if !self.workers[idx].alive || !self.workers[idx].accepting {
            return Err(CoreError::WorkerFenced(info.worker));
        }
        if self.index.contains_key(&info.key) {
            return Err(CoreError::DuplicateRequest(info.key));
        }
        let w = &mut self.workers[idx];
        if info.generated == 0 {
            w.prefill_started(info.prompt_tokens);
        }
        match info.phase {
            Phase::Queued => {
                w.queued += 1;
                w.queued_load += info.kv_tokens();
            }
            Phase::Running => {
                w.running += 1;
                w.running_load += info.kv_tokens();
            }
        }
        let load = w.load();
        let key = info.key;
        let pos = self.members[idx].len() as u32;
        let slot = Slot { info, pos };
        let s = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = Some(slot);
                s
            }
            None => {
                self.slots.push(Some(slot));
                (self.slots.len() - 1) as u32
            }
        };
        self.members[idx].push(s);
        self.index.insert(key, s);
        self.tree.set(idx, Some(load));
        Ok(())
    }

    /// Marks a queued request running (the worker reported it). No-op if already running.
    pub fn activate(&mut self, key: RequestKey) -> Result<(), CoreError> {
        let s = *self.index.get(&key).ok_or(CoreError::UnknownRequest(key))?;
        let Some(slot) = self.slots[s as usize].as_mut() else {
            return Err(CoreError::UnknownRequest(key));
        };
        if slot.info.phase == Phase::Running {
            return Ok(());
        }
        slot.info.phase = Phase::Running;
        let kv = slot.info.kv_tokens();
        let idx = slot.info.worker as usize;
        let w = &mut self.workers[idx];
        w.queued -= 1;
        w.queued_load -= kv;
        w.running += 1;
        w.running_load += kv;
        Ok(())
    }

    /// Raises a request's generated-token count to `generated` (cumulative telemetry: a lower
    /// value than already known is a duplicate or reordered report, and is absorbed by max()).
    /// A queued request that reports progress is running. Returns whether anything changed.
    pub fn set_generated(&mut self, key: RequestKey, generated: u32) -> Result<bool, CoreError> {
        let s = *self.index.get(&key).ok_or(CoreError::UnknownRequest(key))?;
        self.set_generated_at(s, key, generated)
    }

    /// The slot a request is kept in, for [`ClusterState::set_generated_in`]. A slot stays the
    /// request's until it is removed.
    pub fn slot_of(&self, key: RequestKey) -> Option<u32> {
        self.index.get(&key).copied()
    }

    /// [`ClusterState::set_generated`] for a caller that remembers the request's slot
    /// ([`ClusterState::slot_of`]): a progress report then skips the key → slot lookup, one
    /// dependent cache miss of the few each report costs. The hint is checked against the
    /// slot's key; a stale one falls back to the lookup.
    pub fn set_generated_in(
        &mut self,
        slot_hint: u32,
        key: RequestKey,
        generated: u32,
    ) -> Result<bool, CoreError> {
        let s = match self.slots.get(slot_hint as usize) {
            Some(Some(slot)) if slot.info.key == key => slot_hint,
            _ => *self.index.get(&key).ok_or(CoreError::UnknownRequest(key))?,
        };
        self.set_generated_at(s, key, generated)
    }

    fn set_generated_at(
        &mut self,
        s: u32,
        key: RequestKey,
        generated: u32,
    ) -> Result<bool, CoreError> {
        let Some(slot) = self.slots[s as usize].as_mut() else {
            return Err(CoreError::UnknownRequest(key));
        };
        let was_queued = slot.info.phase == Phase::Queued;
        if generated <= slot.info.generated && !was_queued {
            return Ok(false);
        }
        let old_kv = slot.info.kv_tokens();
        let old_generated = slot.info.generated;
        self.tokens_written += u64::from(generated.saturating_sub(old_generated));
        slot.info.generated = slot.info.generated.max(generated);
        slot.info.phase = Phase::Running;
        let new_kv = slot.info.kv_tokens();
        let idx = slot.info.worker as usize;
        let w = &mut self.workers[idx];
        if old_generated == 0 && generated > 0 {
            w.prefill_ended(slot.info.prompt_tokens);
        }
        if was_queued {
            w.queued -= 1;
            w.queued_load -= old_kv;
            w.running += 1;
            w.running_load += new_kv;
        } else {
            w.running_load += new_kv - old_kv;
        }
        let load = w.load();
        self.tree.set(idx, Some(load));
        Ok(true)
    }

    /// One lockstep decode step: every running request writes one token. O(running + G).
    /// (The simulator's clock; services learn progress from telemetry instead.)
    pub fn advance_step(&mut self) {
        for (idx, members) in self.members.iter().enumerate() {
            let w = &mut self.workers[idx];
            if w.running == 0 {
                continue;
            }
            for &s in members {
                if let Some(slot) = self.slots[s as usize].as_mut()
                    && slot.info.phase == Phase::Running
                {
                    if slot.info.generated == 0 {
                        w.prefill_ended(slot.info.prompt_tokens);
                    }
                    slot.info.generated += 1;
                }
            }
            w.running_load += u64::from(w.running);
            self.tokens_written += u64::from(w.running);
            self.tree.set(idx, Some(w.load()));
        }
    }

    /// Removes a request (finished, expired, cancelled). Returns what it was.
    pub fn remove(&mut self, key: RequestKey) -> Result<RequestInfo, CoreError> {
        let s = self
            .index
            .remove(&key)
            .ok_or(CoreError::UnknownRequest(key))?;
        let slot = self.slots[s as usize]
            .take()
            .ok_or(CoreError::UnknownRequest(key))?;
        self.free_slots.push(s);
        let idx = slot.info.worker as usize;
        let members = &mut self.members[idx];
        let pos = slot.pos as usize;
        members.swap_remove(pos);
        if let Some(&moved) = members.get(pos)
            && let Some(m) = self.slots[moved as usize].as_mut()
        {
            m.pos = pos as u32;
        }
        let kv = slot.info.kv_tokens();
        let w = &mut self.workers[idx];
        if slot.info.generated == 0 {
            w.prefill_ended(slot.info.prompt_tokens);
        }
        match slot.info.phase {
            Phase::Queued => {
                w.queued -= 1;
                w.queued_load -= kv;
            }
            Phase::Running => {
                w.running -= 1;
                w.running_load -= kv;
            }
        }
        let load = w.alive.then(|| w.load());
        self.tree.set(idx, load);
        Ok(slot.info)
    }

    pub fn get(&self, key: RequestKey) -> Option<&RequestInfo> {
        let s = *self.index.get(&key)?;
        self.slots[s as usize].as_ref().map(|slot| &slot.info)
    }

    pub fn contains(&self, key: RequestKey) -> bool {
        self.index.contains_key(&key)
    }

    /// All worker slots, indexed by id (absent ids are not alive and have capacity 0).
    pub fn workers(&self) -> &[WorkerInfo] {
        &self.workers
    }

    pub fn worker(&self, id: WorkerId) -> Option<&WorkerInfo> {
        self.workers.get(id as usize)
    }

    /// Ids of live workers, ascending.
    pub fn live_worker_ids(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.alive)
            .map(|(i, _)| i as WorkerId)
    }

    /// Ids of workers that may take new requests (live and accepting), ascending.
    pub fn accepting_worker_ids(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.alive && w.accepting)
            .map(|(i, _)| i as WorkerId)
    }

    /// Number of live workers (`G`).
    pub fn live_workers(&self) -> u32 {
        self.live_workers
    }

    /// Tokens written since this state was made: a clock of decode steps (see the field).
    pub fn tokens_written(&self) -> u64 {
        self.tokens_written
    }

    /// Requests writing a token every step on the live workers: running ones past their
    /// prefill (a queued request has written nothing, so `prefilling - queued` of the running
    /// ones are still in their prefill).
    pub fn decoding_requests(&self) -> u64 {
        self.workers
            .iter()
            .filter(|w| w.alive)
            .map(|w| {
                u64::from(
                    w.running
                        .saturating_sub(w.prefilling.saturating_sub(w.queued)),
                )
            })
            .sum()
    }

    /// `M(k)` over live workers, of `load()` (running + queued). 0 for an empty group.
    pub fn max_load(&self) -> u64 {
        self.tree.max()
    }

    /// min over live workers of `load()`; 0 for an empty group.
    pub fn min_load(&self) -> u64 {
        self.tree.min().unwrap_or(0)
    }

    /// Requests on a worker (running and queued), in no particular order.
    pub fn requests_of(&self, id: WorkerId) -> impl Iterator<Item = &RequestInfo> + '_ {
        self.members
            .get(id as usize)
            .into_iter()
            .flatten()
            .filter_map(|&s| self.slots[s as usize].as_ref().map(|slot| &slot.info))
    }

    /// Every request in σ with its slot, in slot order (the order they sit in memory: a pass
    /// over all of them that needs no per-worker order is cheapest this way). A slot is a
    /// small index, stable while the request stays and reused after it leaves (for
    /// per-request side tables such as BR-H's prediction cache, which must check the key).
    pub fn slotted_requests(&self) -> impl Iterator<Item = (usize, &RequestInfo)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(s, slot)| slot.as_ref().map(|slot| (s, &slot.info)))
    }

    /// Slots in use or free: every slot index is below this.
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Every request in σ.
    pub fn requests(&self) -> impl Iterator<Item = &RequestInfo> + '_ {
        self.slots
            .iter()
            .filter_map(|s| s.as_ref().map(|slot| &slot.info))
    }

    pub fn request_count(&self) -> usize {
        self.index.len()
    }

    /// Free slots over all live workers (`S_tot`).
    pub fn total_free_slots(&self) -> u32 {
        self.workers.iter().map(WorkerInfo::free_slots).sum()
    }

    /// The barrier idle `I = G·M − Σ L` over live workers, of `load()` (the paper's I, the
    /// quantity the F-score lowers; "imbalance" is max − min everywhere it is reported).
    pub fn barrier_idle(&self) -> u64 {
        let sum: u64 = self
            .workers
            .iter()
            .filter(|w| w.alive)
            .map(WorkerInfo::load)
            .sum();
        u64::from(self.live_workers) * self.max_load() - sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(key: RequestKey, worker: WorkerId, s: u32) -> RequestInfo {
        RequestInfo {
            key,
            worker,
            prompt_tokens: s,
            generated: 0,
            phase: Phase::Queued,
            prompt_hash: None,
            oracle_output: None,
            expected_output: None,
            class: None,
        }
    }

    #[test]
    fn reserve_activate_progress_remove_keep_loads_exact() {
        let mut st = ClusterState::with_workers(&[4, 4]);
        st.reserve(req(1, 0, 100)).unwrap();
        st.reserve(req(2, 1, 50)).unwrap();
        assert_eq!(st.max_load(), 100);
        assert_eq!(st.min_load(), 50);
        assert_eq!(st.worker(0).unwrap().queued_load, 100);
        assert!(st.set_generated(1, 5).unwrap());
        assert_eq!(st.worker(0).unwrap().running_load, 105);
        assert_eq!(st.worker(0).unwrap().queued, 0);
        // duplicate / reordered report is absorbed
        assert!(!st.set_generated(1, 3).unwrap());
        assert_eq!(st.worker(0).unwrap().running_load, 105);
        st.activate(2).unwrap();
        st.advance_step();
        assert_eq!(st.worker(0).unwrap().running_load, 106);
        assert_eq!(st.worker(1).unwrap().running_load, 51);
        assert_eq!(st.barrier_idle(), 2 * 106 - 106 - 51);
        let info = st.remove(1).unwrap();
        assert_eq!(info.generated, 6);
        assert_eq!(st.max_load(), 51);
        assert_eq!(st.min_load(), 0);
        assert_eq!(st.remove(1), Err(CoreError::UnknownRequest(1)));
    }

    #[test]
    fn a_slot_hint_is_only_a_hint() {
        let mut st = ClusterState::with_workers(&[4, 4]);
        st.reserve(req(1, 0, 100)).unwrap();
        st.reserve(req(2, 1, 50)).unwrap();
        let (s1, s2) = (st.slot_of(1).unwrap(), st.slot_of(2).unwrap());
        assert_ne!(s1, s2);
        // right
        assert!(st.set_generated_in(s1, 1, 5).unwrap());
        assert_eq!(st.get(1).unwrap().generated, 5);
        // another request's slot, a slot past the end: the key decides
        assert!(st.set_generated_in(s2, 1, 7).unwrap());
        assert!(st.set_generated_in(u32::MAX, 1, 9).unwrap());
        assert_eq!(st.get(1).unwrap().generated, 9);
        assert_eq!(st.get(2).unwrap().generated, 0);
        assert_eq!(st.worker(0).unwrap().running_load, 109);
        assert_eq!(st.worker(1).unwrap().load(), 50);
        // request 1's slot freed, then taken by request 3: 1 is gone whatever the hint says,
        // and 3 is found through 1's old slot as through its own
        st.remove(1).unwrap();
        assert_eq!(
            st.set_generated_in(s1, 1, 10),
            Err(CoreError::UnknownRequest(1))
        );
        st.reserve(req(3, 0, 10)).unwrap();
        assert_eq!(st.slot_of(3), Some(s1));
        assert!(st.set_generated_in(s1, 3, 2).unwrap());
        assert!(!st.set_generated_in(s2, 3, 1).unwrap());
        assert_eq!(st.worker(0).unwrap().running_load, 12);
        assert_eq!(st.max_load(), 50);
    }

    #[test]
    fn fencing_drops_requests_and_refuses_new_ones() {
        let mut st = ClusterState::with_workers(&[4, 4, 4]);
        st.reserve(req(1, 2, 1000)).unwrap();
        st.reserve(req(2, 2, 10)).unwrap();
        st.reserve(req(3, 0, 10)).unwrap();
        assert_eq!(st.max_load(), 1010);
        let dropped = st.fence_worker(2).unwrap();
        assert_eq!(dropped.len(), 2);
        assert_eq!(st.max_load(), 10);
        assert_eq!(st.live_workers(), 2);
        assert_eq!(st.reserve(req(4, 2, 5)), Err(CoreError::WorkerFenced(2)));
        assert_eq!(st.reserve(req(4, 7, 5)), Err(CoreError::UnknownWorker(7)));
        assert_eq!(
            st.reserve(req(3, 0, 5)),
            Err(CoreError::DuplicateRequest(3))
        );
        st.upsert_worker(2, 4).unwrap();
        assert_eq!(st.worker(2).unwrap().load(), 0);
        assert_eq!(st.min_load(), 0);
        assert_eq!(
            st.upsert_worker(5000, 1),
            Err(CoreError::WorkerIdTooLarge(5000))
        );
    }

    #[test]
    fn a_suspect_worker_keeps_its_load_but_takes_nothing_new() {
        let mut st = ClusterState::with_workers(&[4, 4]);
        st.reserve(req(1, 1, 700)).unwrap();
        st.set_accepting(1, false).unwrap();
        assert_eq!(st.max_load(), 700);
        assert_eq!(st.worker(1).unwrap().free_slots(), 0);
        assert_eq!(st.reserve(req(2, 1, 5)), Err(CoreError::WorkerFenced(1)));
        assert_eq!(st.accepting_worker_ids().collect::<Vec<_>>(), vec![0]);
        st.upsert_worker(1, 4).unwrap();
        assert_eq!(st.worker(1).unwrap().free_slots(), 3);
    }

    /// What a caller can see of a state: equal views mean the same σ.
    fn observed(st: &ClusterState) -> impl PartialEq + std::fmt::Debug {
        let mut requests: Vec<RequestInfo> = st.requests().cloned().collect();
        requests.sort_by_key(|r| r.key);
        let members: Vec<Vec<RequestKey>> = (0..st.workers().len() as WorkerId)
            .map(|w| {
                let mut keys: Vec<RequestKey> = st.requests_of(w).map(|r| r.key).collect();
                keys.sort_unstable();
                keys
            })
            .collect();
        (
            st.workers().to_vec(),
            requests,
            members,
            st.max_load(),
            st.min_load(),
            st.live_workers(),
            st.request_count(),
        )
    }

    /// `clone_from` leaves exactly the source's state whatever `self` held (more or fewer
    /// workers and requests), and both then evolve alike (the free list, the index and the
    /// tree were copied too, not only what the getters show).
    #[test]
    fn clone_from_is_a_clone_whatever_it_overwrites() {
        let mut source = ClusterState::with_workers(&[4, 4, 4]);
        source.reserve(req(1, 0, 100)).unwrap();
        source.reserve(req(2, 2, 30)).unwrap();
        source.reserve(req(3, 2, 7)).unwrap();
        source.remove(2).unwrap();
        source.set_generated(3, 4).unwrap();
        let mut bigger = ClusterState::with_workers(&[8, 8, 8, 8, 8]);
        for k in 10..30 {
            bigger.reserve(req(k, (k % 5) as WorkerId, 11)).unwrap();
        }
        bigger.fence_worker(4).unwrap();
        for mut target in [
            ClusterState::new(),
            ClusterState::with_workers(&[1]),
            bigger,
        ] {
            target.clone_from(&source);
            assert_eq!(observed(&target), observed(&source));
            let mut twin = source.clone();
            for st in [&mut target, &mut twin] {
                st.reserve(req(4, 1, 50)).unwrap();
                st.remove(1).unwrap();
                st.reserve(req(5, 0, 9)).unwrap();
                st.advance_step();
                st.fence_worker(2).unwrap();
            }
            assert_eq!(observed(&target), observed(&twin));
        }
    }

    /// The view rebuilt from σ on every tick reuses its tables: after `clone_from` a state of
    /// the same shape keeps its allocations (the derived `clone_from` replaced them all).
    #[test]
    fn clone_from_reuses_the_allocations() {
        let mut source = ClusterState::with_workers(&[64, 64]);
        for k in 0..100 {
            source.reserve(req(k, (k % 2) as WorkerId, 10)).unwrap();
        }
        let mut view = source.clone();
        let before = (
            view.slots.as_ptr(),
            view.workers.as_ptr(),
            view.members[0].as_ptr(),
        );
        source.set_generated(7, 3).unwrap();
        view.clone_from(&source);
        let after = (
            view.slots.as_ptr(),
            view.workers.as_ptr(),
            view.members[0].as_ptr(),
        );
        assert_eq!(before, after);
        assert_eq!(observed(&view), observed(&source));
    }

    #[test]
    fn free_slots_count_queued_requests() {
        let mut st = ClusterState::with_workers(&[2, 3]);
        st.reserve(req(1, 0, 1)).unwrap();
        st.reserve(req(2, 0, 1)).unwrap();
        assert_eq!(st.worker(0).unwrap().free_slots(), 0);
        assert_eq!(st.total_free_slots(), 3);
    }
}
