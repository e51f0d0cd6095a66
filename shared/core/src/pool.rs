//! The central prompt pool: requests whose prefill is done, waiting for a decode rank.
//!
//! Indexed twice: by arrival order (Stage 2 looks at the first `R_max` waiting requests, which
//! also bounds how long any request can be passed over) and by prompt size (Stage 1 finds the
//! request with the best single-request score in O(log n)).

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap;

use crate::{CoreError, RequestKey};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolEntry {
    pub key: RequestKey,
    /// `s_i`: prompt tokens, known when the request is routed.
    pub prompt_tokens: u32,
    pub prompt_hash: Option<u64>,
    /// True output length; simulation only (Oracle predictor).
    pub oracle_output: Option<u32>,
    /// The client's expected output length, a hint (see [`crate::RequestInfo`]).
    pub expected_output: Option<u32>,
    /// The request's class id, if it has one (see [`crate::RequestInfo`]).
    pub class: Option<u64>,
}

#[derive(Debug, Clone, Default)]
pub struct Pool {
    by_arrival: BTreeMap<u64, PoolEntry>,
    by_size: BTreeSet<(u32, u64)>,
    seq_of: FxHashMap<RequestKey, u64>,
    next_seq: u64,
}

impl Pool {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.by_arrival.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_arrival.is_empty()
    }

    pub fn contains(&self, key: RequestKey) -> bool {
        self.seq_of.contains_key(&key)
    }

    /// Adds a request at the back. A key already waiting is refused (nothing changes).
    pub fn push(&mut self, entry: PoolEntry) -> Result<(), CoreError> {
        let seq = self.next_seq;
        self.insert(entry, seq)?;
        self.next_seq += 1;
        Ok(())
    }

    /// The arrival position of a waiting request (what [`Pool::push_at`] takes back).
    pub fn position(&self, key: RequestKey) -> Option<u64> {
        self.seq_of.get(&key).copied()
    }

    /// Puts a request back at an arrival position it held before (a reservation that another
    /// decider's won: it rejoins the pool where it was, not at the back). A key already waiting
    /// or a position already taken is refused (nothing changes).
    pub fn push_at(&mut self, entry: PoolEntry, position: u64) -> Result<(), CoreError> {
        if self.by_arrival.contains_key(&position) {
            return Err(CoreError::DuplicateRequest(entry.key));
        }
        self.insert(entry, position)?;
        self.next_seq = self.next_seq.max(position + 1);
        Ok(())
    }

    fn insert(&mut self, entry: PoolEntry, seq: u64) -> Result<(), CoreError> {
        if self.seq_of.contains_key(&entry.key) {
            return Err(CoreError::DuplicateRequest(entry.key));
        }
        self.seq_of.insert(entry.key, seq);
        self.by_size.insert((entry.prompt_tokens, seq));
        self.by_arrival.insert(seq, entry);
        Ok(())
    }

    /// Removes a waiting request (admitted, cancelled, or its deadline passed).
    pub fn remove(&mut self, key: RequestKey) -> Option<PoolEntry> {
        let seq = self.seq_of.remove(&key)?;
        let entry = self.by_arrival.remove(&seq)?;
        self.by_size.remove(&(entry.prompt_tokens, seq));
        Some(entry)
    }

    /// The oldest `n` waiting requests, oldest first.
    pub fn oldest(&self, n: usize) -> impl Iterator<Item = &PoolEntry> + '_ {
        self.by_arrival.values().take(n)
    }

    /// All waiting requests, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &PoolEntry> + '_ {
        self.by_arrival.values()
    }

    /// The largest request with `prompt_tokens ≤ limit` (the oldest among equals).
    pub fn largest_at_most(&self, limit: u64) -> Option<&PoolEntry> {
        let limit = u32::try_from(limit).unwrap_or(u32::MAX);
        let &(size, _) = self.by_size.range(..=(limit, u64::MAX)).next_back()?;
        // The oldest among equal sizes: the first entry of that size.
        let &(_, seq) = self.by_size.range((size, 0)..).next()?;
        self.by_arrival.get(&seq)
    }

    /// The smallest request with `prompt_tokens > limit` (the oldest among equals).
    pub fn smallest_above(&self, limit: u64) -> Option<&PoolEntry> {
        if limit >= u64::from(u32::MAX) {
            return None;
        }
        let &(_, seq) = self.by_size.range((limit as u32 + 1, 0)..).next()?;
        self.by_arrival.get(&seq)
    }

    pub fn largest(&self) -> Option<&PoolEntry> {
        let &(size, _) = self.by_size.iter().next_back()?;
        let &(_, seq) = self.by_size.range((size, 0)..).next()?;
        self.by_arrival.get(&seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(key: RequestKey, s: u32) -> PoolEntry {
        PoolEntry {
            key,
            prompt_tokens: s,
            prompt_hash: None,
            oracle_output: None,
            expected_output: None,
            class: None,
        }
    }

    #[test]
    fn a_request_put_back_rejoins_at_its_arrival_position() {
        let mut p = Pool::new();
        for (k, s) in [(1, 500), (2, 100), (3, 900)] {
            p.push(e(k, s)).unwrap();
        }
        let pos = p.position(2).unwrap();
        let taken = p.remove(2).unwrap();
        p.push(e(4, 10)).unwrap();
        p.push_at(taken, pos).unwrap();
        let keys: Vec<_> = p.oldest(4).map(|e| e.key).collect();
        assert_eq!(keys, vec![1, 2, 3, 4]);
        // the position is taken now, and the key waits already
        assert!(p.push_at(e(9, 1), pos).is_err());
        assert!(p.push_at(e(2, 1), 99).is_err());
        assert_eq!(p.len(), 4);
        // later pushes go after every position used
        p.push_at(e(5, 1), 50).unwrap();
        p.push(e(6, 1)).unwrap();
        assert_eq!(p.oldest(6).last().unwrap().key, 6);
    }

    #[test]
    fn size_index_and_arrival_order() {
        let mut p = Pool::new();
        for (k, s) in [(1, 500), (2, 100), (3, 900), (4, 500)] {
            p.push(e(k, s)).unwrap();
        }
        assert_eq!(p.push(e(1, 7)), Err(CoreError::DuplicateRequest(1)));
        assert_eq!(
            p.largest_at_most(600).unwrap().key,
            1,
            "oldest of the two 500s"
        );
        assert_eq!(p.largest_at_most(99), None);
        assert_eq!(p.smallest_above(500).unwrap().key, 3);
        assert_eq!(p.smallest_above(499).unwrap().key, 1);
        assert_eq!(p.largest().unwrap().key, 3);
        let keys: Vec<_> = p.oldest(3).map(|e| e.key).collect();
        assert_eq!(keys, vec![1, 2, 3]);
        assert_eq!(p.remove(1).unwrap().prompt_tokens, 500);
        assert_eq!(p.largest_at_most(600).unwrap().key, 4);
        assert_eq!(p.len(), 3);
        assert!(p.remove(1).is_none());
    }
}
