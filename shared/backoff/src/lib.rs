//! The one retry backoff of BalanceRoute: every reconnect and retry loop (the telemetry
//! reporter, the assign client, the σ watcher, ingest's Apply link) waits by this rule, with
//! its own configured first and longest delay.
//!
//! The `n`-th delay (`n` from 0) has the ceiling `min(initial · 2ⁿ, max)` and is drawn
//! uniformly in `[ceiling / 2, ceiling]`: "equal jitter" in the terms of AWS's
//! "Exponential Backoff And Jitter". Why equal rather than full jitter (`[0, ceiling]`): these
//! loops retry a peer that is down for as long as it stays down, and full jitter lets any
//! single sleep be arbitrarily close to zero, so a dead peer can still see bursts of
//! back-to-back attempts; equal jitter keeps a floor of half the schedule while the other half
//! is still random enough to spread out the reconnects of many shims after an ingest restart.
//! The article measures the two within a few percent of each other in total work. The delay
//! never exceeds `max`.
//!
//! Pure and synchronous (no sleeping, no clock): callers sleep on their own runtime and
//! select against their own shutdown signal. The RNG can be passed in, so tests are
//! deterministic.
#![forbid(unsafe_code)]

use std::time::Duration;

use rand::Rng;

/// Most doublings applied; beyond it the ceiling is `max` anyway (2³¹ × 1 ns > 2 s).
const MAX_DOUBLINGS: u32 = 31;

/// The ceiling of the `attempt`-th delay (0-based): `min(initial · 2^attempt, max)`.
pub fn ceiling(initial: Duration, max: Duration, attempt: u32) -> Duration {
    initial
        .saturating_mul(1u32 << attempt.min(MAX_DOUBLINGS))
        .min(max.max(initial))
}

/// A delay drawn uniformly in `[ceiling / 2, ceiling]` (equal jitter).
pub fn equal_jitter<R: Rng + ?Sized>(ceiling: Duration, rng: &mut R) -> Duration {
    let floor = ceiling / 2;
    floor + rng.random_range(Duration::ZERO..=ceiling - floor)
}

/// The `attempt`-th delay (0-based) of the schedule from `initial` to `max`, jittered.
pub fn delay<R: Rng + ?Sized>(
    initial: Duration,
    max: Duration,
    attempt: u32,
    rng: &mut R,
) -> Duration {
    equal_jitter(ceiling(initial, max, attempt), rng)
}

/// A reconnect loop's backoff: each [`next_delay`](Backoff::next_delay) is the next step of
/// the schedule; [`reset`](Backoff::reset) after a success starts it over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    /// A schedule from `initial` doubling up to `max` (a `max` below `initial` is `initial`).
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff {
            initial,
            max: max.max(initial),
            attempt: 0,
        }
    }

    /// The ceiling of the next delay.
    pub fn next_ceiling(&self) -> Duration {
        ceiling(self.initial, self.max, self.attempt)
    }

    /// The next delay, drawn with the thread's RNG.
    pub fn next_delay(&mut self) -> Duration {
        self.next_delay_with(&mut rand::rng())
    }

    /// The next delay, drawn with `rng`.
    pub fn next_delay_with<R: Rng + ?Sized>(&mut self, rng: &mut R) -> Duration {
        let d = equal_jitter(self.next_ceiling(), rng);
        self.attempt = self.attempt.saturating_add(1);
        d
    }

    /// Starts the schedule over (after the peer answered).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng as _;
    use rand::rngs::SmallRng;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn ceilings_double_from_initial_and_stop_at_max() {
        let got: Vec<Duration> = (0..8).map(|n| ceiling(50 * MS, 1000 * MS, n)).collect();
        let want: Vec<Duration> = [50, 100, 200, 400, 800, 1000, 1000, 1000]
            .iter()
            .map(|&m| m * MS)
            .collect();
        assert_eq!(got, want);
        // No overflow however many attempts, and a max below initial means initial.
        assert_eq!(ceiling(50 * MS, 1000 * MS, u32::MAX), 1000 * MS);
        assert_eq!(ceiling(Duration::MAX, Duration::MAX, 40), Duration::MAX);
        assert_eq!(ceiling(50 * MS, 10 * MS, 3), 50 * MS);
        assert_eq!(ceiling(Duration::ZERO, 10 * MS, 3), Duration::ZERO);
    }

    #[test]
    fn jitter_stays_within_half_and_whole_ceiling_and_spans_it() {
        let mut rng = SmallRng::seed_from_u64(7);
        for ceil in [
            Duration::from_nanos(1),
            Duration::from_nanos(3),
            5 * MS,
            5000 * MS,
        ] {
            let draws: Vec<Duration> = (0..10_000).map(|_| equal_jitter(ceil, &mut rng)).collect();
            let (lo, hi) = (ceil / 2, ceil);
            assert!(draws.iter().all(|d| *d >= lo && *d <= hi), "{ceil:?}");
            // Jitter is real: the draws reach both ends of the range (not a constant).
            let min = draws.iter().min().copied().unwrap_or_default();
            let max = draws.iter().max().copied().unwrap_or_default();
            assert!(min <= lo + (hi - lo) / 20, "{ceil:?}: min {min:?}");
            assert!(max >= hi - (hi - lo) / 20, "{ceil:?}: max {max:?}");
        }
        assert_eq!(equal_jitter(Duration::ZERO, &mut rng), Duration::ZERO);
    }

    #[test]
    fn backoff_walks_the_schedule_and_resets() {
        let mut rng = SmallRng::seed_from_u64(1);
        let mut b = Backoff::new(100 * MS, 400 * MS);
        for want in [100, 200, 400, 400, 400] {
            let ceil = want * MS;
            assert_eq!(b.next_ceiling(), ceil);
            let d = b.next_delay_with(&mut rng);
            assert!(d >= ceil / 2 && d <= ceil, "{d:?} for {ceil:?}");
        }
        b.reset();
        assert_eq!(b.next_ceiling(), 100 * MS);
        assert!(b.next_delay() <= 100 * MS);
        assert_eq!(Backoff::new(100 * MS, MS).next_ceiling(), 100 * MS);
    }

    #[test]
    fn a_seeded_rng_gives_the_same_delays() {
        let run = |seed| {
            let mut rng = SmallRng::seed_from_u64(seed);
            let mut b = Backoff::new(10 * MS, 80 * MS);
            (0..6)
                .map(|_| b.next_delay_with(&mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
    }
}
