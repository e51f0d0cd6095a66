//! Memory a load took, given back once it is over.
//!
//! glibc's malloc returns freed memory to the system only from the top of each arena's heap;
//! pages freed below a live allocation stay resident. br-all after 10 s of 5,000 Assign/s and
//! 100,000 progress events/s held 64.7 MiB 35 s later, of which 6.9 MiB was in use
//! (`malloc_stats`); one `malloc_trim(0)` brought it to 21.8 MiB. [`spawn_periodic_trim`]
//! calls it on a timer (`--memory-trim-interval`, off by default), on a blocking thread: glibc
//! walks and locks each arena in turn, so allocating threads wait for that arena's part of the
//! walk. That wait is usually milliseconds (1-7 ms under 5,000 Assign/s), but a trim returns
//! pages one `madvise` at a time, and beside two busy vLLM CPU engines on a 2-vCPU VM trims
//! took 5-25 s: the process stood still that long (its telemetry streams timed out). So it is
//! opt-in, for hosts where the logged durations stay short.
//!
//! Elsewhere (musl, macOS, or a process on another global allocator such as br-snapshot's
//! mimalloc, which returns freed pages itself) the trim does nothing.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hash};
#[cfg(feature = "trim-task")]
use std::time::{Duration, Instant};

/// Below this capacity a map or queue is left as it is: shrinking would save little and cost a
/// rehash on every swing of a small load.
pub const SHRINK_MIN_CAPACITY: usize = 4096;

/// Shrinks `map` to twice its entries when it holds fewer than a quarter of its capacity (and
/// the capacity is above [`SHRINK_MIN_CAPACITY`]). A map keeps the capacity of its largest
/// moment, so a burst of requests leaves its table allocated for good; called from
/// housekeeping, this gives it back once the burst is over, and at most halves a map that
/// still grows and shrinks with a steady load. (A map's `capacity` is what it holds before it
/// grows again, which removals can leave below its table's size, so this errs toward keeping
/// a table.)
pub fn shrink_sparse_map<K: Eq + Hash, V, S: BuildHasher>(map: &mut HashMap<K, V, S>) -> bool {
    let sparse = is_sparse(map.len(), map.capacity());
    if sparse {
        map.shrink_to(2 * map.len());
    }
    sparse
}

/// [`shrink_sparse_map`] for a queue.
pub fn shrink_sparse_queue<T>(queue: &mut VecDeque<T>) -> bool {
    let sparse = is_sparse(queue.len(), queue.capacity());
    if sparse {
        queue.shrink_to(2 * queue.len());
    }
    sparse
}

/// The one rule for both: above the minimum capacity, under a quarter used.
fn is_sparse(len: usize, capacity: usize) -> bool {
    capacity > SHRINK_MIN_CAPACITY && len < capacity / 4
}

/// Asks glibc's malloc to return the free pages of every arena to the system. Returns whether
/// it gave anything back; always false where there is no glibc.
pub fn give_back() -> bool {
    trim()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn trim() -> bool {
    // SAFETY: malloc_trim takes no pointers and has no caller-side invariants; glibc locks
    // each arena while it trims it, so it is safe beside any other allocator call.
    unsafe { libc::malloc_trim(0) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() -> bool {
    false
}

/// Trims every `interval` (none when it is zero) until the runtime shuts down.
#[cfg(feature = "trim-task")]
pub fn spawn_periodic_trim(interval: Duration) {
    if interval.is_zero() {
        return;
    }
    tokio::spawn(async move {
        let mut every = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let started = Instant::now();
            match tokio::task::spawn_blocking(give_back).await {
                Ok(released) => tracing::debug!(
                    released,
                    took_us = started.elapsed().as_micros() as u64,
                    "malloc_trim"
                ),
                Err(_) => return, // the runtime is shutting down
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads this process's resident set in KiB.
    fn rss_kib() -> Option<u64> {
        std::fs::read_to_string("/proc/self/status")
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    }

    #[test]
    fn a_map_emptied_after_a_burst_shrinks_and_a_busy_one_does_not() {
        let mut m: HashMap<u64, u64> = (0..100_000).map(|i| (i, i)).collect();
        let peak = m.capacity();
        // still busy: half full stays as it is
        m.retain(|k, _| k % 2 == 0);
        assert!(!shrink_sparse_map(&mut m));
        // the burst is over: a few entries left
        m.retain(|k, _| *k < 1000);
        assert!(shrink_sparse_map(&mut m));
        assert!(m.capacity() < peak / 16, "{} of {peak}", m.capacity());
        assert_eq!(m.len(), 500);
        // small maps are left alone
        let mut small: HashMap<u64, u64> = (0..1000).map(|i| (i, i)).collect();
        small.clear();
        assert!(!shrink_sparse_map(&mut small));
        let mut q: VecDeque<u64> = (0..100_000).collect();
        q.truncate(10);
        assert!(shrink_sparse_queue(&mut q));
        assert!(q.capacity() < 1000);
    }

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn memory_freed_below_a_live_allocation_comes_back() {
        // Many small blocks, then one kept at the top so glibc cannot shrink the heap from
        // its end: freeing the others leaves their pages resident until a trim.
        let blocks: Vec<Vec<u8>> = (0..64 * 1024).map(|i| vec![i as u8; 1000]).collect();
        let pin = vec![1u8; 1000];
        let held = rss_kib().unwrap();
        drop(blocks);
        let freed = rss_kib().unwrap();
        assert!(give_back(), "malloc_trim gave nothing back");
        let after = rss_kib().unwrap();
        assert!(
            after + 32 * 1024 < freed,
            "RSS {held} KiB held, {freed} KiB after free, {after} KiB after the trim"
        );
        drop(pin);
    }
}
