//! [`LengthHistogram`]: a growable Fenwick tree over output lengths, the storage behind each
//! of [`super::Survival`]'s distributions.
//!
//! Separate because it is a plain data structure with no knowledge of predictions: its growth
//! and tail queries read (and are checked) on their own.

use super::Prediction;

/// A Fenwick tree over output lengths 1..=size (count and sum), for O(log n) tail queries.
///
/// It starts small and doubles as longer lengths arrive (up to the next power of two above
/// `max_len`), so a bucket that only ever sees short outputs costs a few kilobytes, not
/// `16·max_len` bytes: that is what lets [`Survival`] keep one per prompt-length bucket.
#[derive(Debug, Clone)]
pub(super) struct LengthHistogram {
    /// Fenwick arrays over 1..=size; `size` (= len − 1) is a power of two.
    count: Vec<u64>,
    sum: Vec<u64>,
    pub(super) total: u64,
    total_sum: u64,
    pub(super) max_len: u32,
}

/// Initial size of a histogram (grown by doubling).
pub(super) const INITIAL_HISTOGRAM: usize = 64;

impl LengthHistogram {
    pub(super) fn new(max_len: u32) -> Self {
        let max_len = max_len.max(1);
        let n = INITIAL_HISTOGRAM.min((max_len as usize).next_power_of_two()) + 1;
        Self {
            count: vec![0; n],
            sum: vec![0; n],
            total: 0,
            total_sum: 0,
            max_len,
        }
    }

    /// Lengths 1..=size are held (a power of two).
    pub(super) fn size(&self) -> usize {
        self.count.len() - 1
    }

    /// Heap bytes held.
    pub(super) fn bytes(&self) -> usize {
        (self.count.capacity() + self.sum.capacity()) * std::mem::size_of::<u64>()
    }

    /// Doubles until `len` fits. With a power-of-two size n, the entries 1..=n keep their
    /// ranges, the new entry 2n covers everything (the old total) and the ones in between
    /// cover only lengths above n, of which there are none yet.
    pub(super) fn grow_to(&mut self, len: usize) {
        while self.size() < len {
            let n = self.size();
            // exact: the memory bound is 16·(size + 1) bytes, not whatever doubling gives
            self.count.reserve_exact(n);
            self.sum.reserve_exact(n);
            self.count.resize(2 * n + 1, 0);
            self.sum.resize(2 * n + 1, 0);
            self.count[2 * n] = self.total;
            self.sum[2 * n] = self.total_sum;
        }
    }

    pub(super) fn add(&mut self, len: u32) {
        let len = len.clamp(1, self.max_len);
        self.grow_to(len as usize);
        let mut i = len as usize;
        while i < self.count.len() {
            self.count[i] += 1;
            self.sum[i] += u64::from(len);
            i += i & i.wrapping_neg();
        }
        self.total += 1;
        self.total_sum += u64::from(len);
    }

    /// (count, sum) of lengths ≤ len.
    pub(super) fn prefix(&self, len: u32) -> (u64, u64) {
        if len as usize >= self.size() {
            return (self.total, self.total_sum);
        }
        let mut i = len as usize;
        let (mut c, mut s) = (0, 0);
        while i > 0 {
            c += self.count[i];
            s += self.sum[i];
            i -= i & i.wrapping_neg();
        }
        (c, s)
    }

    /// The median output length of the requests still running after `generated` tokens:
    /// the smallest `L > generated` with P(o ≤ L | o > generated) ≥ 1/2. `None` when no
    /// observed length exceeds `generated`.
    pub(super) fn conditional_median(&self, generated: u32) -> Option<u32> {
        let (c_j, _) = self.prefix(generated);
        let alive = self.total - c_j;
        if alive == 0 {
            return None;
        }
        let need = c_j + alive.div_ceil(2);
        // prefix() is monotone in the length: binary search the first length reaching `need`
        // (some observed length above `generated` exists, so generated < size).
        let (mut lo, mut hi) = (generated + 1, self.size() as u32);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.prefix(mid).0 >= need {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Some(lo)
    }

    /// P(o ≤ j + h | o > j) and E[o − j | j < o ≤ j + h].
    pub(super) fn conditional(&self, generated: u32, horizon: u32) -> Prediction {
        let (c_j, s_j) = self.prefix(generated);
        let alive = self.total - c_j;
        if alive == 0 {
            return Prediction::RUNS_ON;
        }
        let (c_h, s_h) = self.prefix(generated.saturating_add(horizon));
        let finishing = c_h - c_j;
        if finishing == 0 {
            return Prediction::RUNS_ON;
        }
        let mean_len = (s_h - s_j) as f64 / finishing as f64;
        Prediction {
            p_finish: finishing as f64 / alive as f64,
            mean_remaining: mean_len - f64::from(generated),
        }
    }
}
