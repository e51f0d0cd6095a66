//! A tournament tree over per-worker loads: the max and the min of the live workers in O(1),
//! updated in O(log G) when one worker's load changes. G ≤ 64, so the tree is tiny and flat.

#[derive(Debug)]
pub(crate) struct LoadTree {
    leaves: usize,
    max: Vec<u64>,
    min: Vec<u64>,
}

/// Fenced or absent workers take no part in max or min.
const ABSENT_MAX: u64 = 0;
const ABSENT_MIN: u64 = u64::MAX;

impl Clone for LoadTree {
    fn clone(&self) -> Self {
        Self {
            leaves: self.leaves,
            max: self.max.clone(),
            min: self.min.clone(),
        }
    }

    /// Into the vectors `self` has (see `ClusterState::clone_from`).
    fn clone_from(&mut self, source: &Self) {
        // Destructured: a new field fails to compile here rather than go uncopied.
        let Self { leaves, max, min } = source;
        self.leaves = *leaves;
        self.max.clone_from(max);
        self.min.clone_from(min);
    }
}

impl LoadTree {
    pub(crate) fn new() -> Self {
        Self {
            leaves: 1,
            max: vec![ABSENT_MAX; 2],
            min: vec![ABSENT_MIN; 2],
        }
    }

    /// Grows to hold at least `n` leaves, keeping current values.
    pub(crate) fn ensure(&mut self, n: usize) {
        if n <= self.leaves {
            return;
        }
        let old: Vec<(u64, u64)> = (0..self.leaves)
            .map(|i| (self.max[self.leaves + i], self.min[self.leaves + i]))
            .collect();
        let leaves = n.next_power_of_two();
        self.leaves = leaves;
        self.max = vec![ABSENT_MAX; 2 * leaves];
        self.min = vec![ABSENT_MIN; 2 * leaves];
        for (i, (mx, mn)) in old.into_iter().enumerate() {
            self.max[leaves + i] = mx;
            self.min[leaves + i] = mn;
        }
        for i in (1..leaves).rev() {
            self.pull(i);
        }
    }

    fn pull(&mut self, i: usize) {
        self.max[i] = self.max[2 * i].max(self.max[2 * i + 1]);
        self.min[i] = self.min[2 * i].min(self.min[2 * i + 1]);
    }

    /// Sets leaf `i` to `load`, or removes it from max/min when `None`.
    pub(crate) fn set(&mut self, i: usize, load: Option<u64>) {
        let mut p = self.leaves + i;
        self.max[p] = load.unwrap_or(ABSENT_MAX);
        self.min[p] = load.unwrap_or(ABSENT_MIN);
        while p > 1 {
            p /= 2;
            self.pull(p);
        }
    }

    pub(crate) fn max(&self) -> u64 {
        self.max[1]
    }

    /// `None` when no leaf is present.
    pub(crate) fn min(&self) -> Option<u64> {
        (self.min[1] != ABSENT_MIN).then_some(self.min[1])
    }
}
