//! The allocator every service runs on, and tables that give back what a burst made them hold.
//!
//! glibc's malloc returns freed memory to the system only from the top of each arena's heap:
//! after 10 s of 5,000 Assign/s and 100,000 progress events/s, br-all held 42 MiB 90 s later
//! with 12 MiB idle, most of it free pages below a few live allocations. Its `malloc_trim`
//! gives them back, but it holds each arena while it returns pages one `madvise` at a time,
//! and beside busy vLLM CPU engines on a 2-vCPU VM one took 5-25 s, standing the process
//! still that long (docs/design/0020-no-trim-by-default.md). jemalloc returns dirty pages from
//! its own background thread as they age ([`MALLOC_CONF`]), without holding up the threads that
//! allocate. Each service binary declares it:
//!
//! ```text
//! #[global_allocator]
//! static ALLOCATOR: br_memory::Allocator = br_memory::Allocator;
//! ```
//!
//! and logs [`settings`] at start, which reads back what jemalloc runs with.
//!
//! A table keeps the capacity of its largest moment whatever the allocator;
//! [`shrink_sparse_map`] and [`shrink_sparse_queue`] give it back once a burst is over.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hash};

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

/// The one rule for every collection: above the minimum capacity, under a quarter used (for
/// a table of another type than std's, which shrinks as [`shrink_sparse_map`] does).
pub fn is_sparse(len: usize, capacity: usize) -> bool {
    capacity > SHRINK_MIN_CAPACITY && len < capacity / 4
}

pub use tikv_jemallocator::Jemalloc as Allocator;

/// jemalloc's settings, read by jemalloc when it starts (before `main`), under the symbol
/// prefix tikv-jemalloc-sys builds it with. `_RJEM_MALLOC_CONF` in the environment overrides
/// any of them.
/// - `background_thread:true`: dirty pages are purged by jemalloc's own thread, not by
///   whichever thread frees next.
/// - `dirty_decay_ms:1000`: a freed page goes back to the system about a second after it was
///   last used (jemalloc's default is 10 s). br-all under 5,000 Assign/s + 100,000 events/s
///   spent 8-18% less CPU per call than on glibc with it (docs/design/0021-jemalloc.md).
/// - `muzzy_decay_ms:0`: returned pages are unmapped (`MADV_DONTNEED`), not left for the
///   kernel to take when it wants (`MADV_FREE`), so RSS shows what the process holds.
/// - `abort_conf:true`: a setting jemalloc does not know (a typo in `_RJEM_MALLOC_CONF`) stops
///   the process at start instead of being ignored.
#[allow(unsafe_code)]
// SAFETY: jemalloc declares `const char *malloc_conf` (weak) and reads it once at its start;
// this is a NUL-terminated, immutable, 'static string, which is all it requires.
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static MALLOC_CONF: &[u8; 76] =
    b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0,abort_conf:true\0";

/// What the process's jemalloc runs with, read back through `mallctl`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Whether jemalloc is the process's global allocator (a block Rust allocates shows in its
    /// count).
    pub in_use: bool,
    /// Whether its background thread purges (`background_thread`).
    pub background_thread: bool,
    pub dirty_decay_ms: isize,
    pub muzzy_decay_ms: isize,
    /// Bytes the process has allocated and not freed.
    pub allocated: usize,
    /// Bytes in pages jemalloc holds resident (what it would give back is `resident -
    /// allocated`, less its own metadata).
    pub resident: usize,
}

/// Reads jemalloc's settings and statistics.
pub fn settings() -> Result<Settings, String> {
    use tikv_jemalloc_ctl::{background_thread, epoch, raw, stats};
    // Naming the string here keeps it in the link: an exported static in a library that no
    // code refers to may be dropped with its object file, and jemalloc would start on its
    // defaults.
    std::hint::black_box(MALLOC_CONF.as_ptr());
    let err = |what: &str, e: tikv_jemalloc_ctl::Error| format!("jemalloc {what}: {e}");
    #[allow(unsafe_code)]
    // SAFETY: both options are `ssize_t` in jemalloc (`opt.dirty_decay_ms`, `opt.muzzy_decay_ms`),
    // read into an `isize`; the names are NUL-terminated.
    let (dirty_decay_ms, muzzy_decay_ms) = unsafe {
        (
            raw::read::<isize>(b"opt.dirty_decay_ms\0").map_err(|e| err("dirty_decay_ms", e))?,
            raw::read::<isize>(b"opt.muzzy_decay_ms\0").map_err(|e| err("muzzy_decay_ms", e))?,
        )
    };
    // jemalloc is linked into every binary that uses this crate (and starts from its own
    // constructor), so only an allocation through Rust's global allocator tells whether it is
    // that allocator: a block of 1 MiB (past jemalloc's thread caches) shows in its count.
    let allocated_now = || {
        epoch::advance().map_err(|e| err("epoch", e))?;
        stats::allocated::read().map_err(|e| err("stats.allocated", e))
    };
    let before = allocated_now()?;
    let probe = std::hint::black_box(vec![1u8; 1 << 20]);
    let allocated = allocated_now()?;
    drop(probe);
    Ok(Settings {
        in_use: allocated >= before + (1 << 20),
        background_thread: background_thread::read().map_err(|e| err("background_thread", e))?,
        dirty_decay_ms,
        muzzy_decay_ms,
        allocated,
        resident: stats::resident::read().map_err(|e| err("stats.resident", e))?,
    })
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

    // The test binary runs on the allocator the services run on.
    #[global_allocator]
    static ALLOCATOR: Allocator = Allocator;

    #[test]
    fn jemalloc_runs_with_the_settings_the_services_declare() {
        let s = settings().unwrap();
        assert!(s.in_use, "{s:?}");
        assert!(s.background_thread, "{s:?}");
        assert_eq!((s.dirty_decay_ms, s.muzzy_decay_ms), (1000, 0), "{s:?}");
    }

    #[test]
    fn memory_freed_below_a_live_allocation_comes_back_within_seconds() {
        // Many small blocks, then one kept after them so an allocator that returns memory
        // only from the top of its heap (glibc's) cannot give theirs back.
        let blocks: Vec<Vec<u8>> = (0..128 * 1024).map(|i| vec![i as u8; 1000]).collect();
        let pin = vec![1u8; 1000];
        let held = rss_kib().unwrap();
        drop(blocks);
        // jemalloc purges pages a second after their last use, from its own thread; give it
        // ten times that before calling the memory kept.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut after = rss_kib().unwrap();
        while after + 64 * 1024 > held && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(100));
            after = rss_kib().unwrap();
        }
        assert!(
            after + 64 * 1024 <= held,
            "RSS {held} KiB with the blocks, {after} KiB 10 s after they were freed ({:?})",
            settings()
        );
        drop(pin);
    }
}
