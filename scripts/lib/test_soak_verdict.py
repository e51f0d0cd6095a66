"""Tests of the soak's verdict (scripts/lib/soak_verdict.py): python3 scripts/lib/test_soak_verdict.py"""
import random
import unittest

from soak_verdict import fd_series, judge, p99_series, rss_series, sigma_series, verdict

# 60 samples, 2,000 requests apart: a two-minute run at 1,000 requests/s sampled every 2 s.
XS = [2000.0 * i for i in range(60)]


def noisy(level, sd, seed=1):
    rng = random.Random(seed)
    return [level + rng.gauss(0, sd) for _ in XS]


class Verdict(unittest.TestCase):
    def test_a_flat_series_that_wobbles_passes(self):
        j = judge(rss_series("decision", XS, noisy(50, 3)))
        self.assertTrue(j.flat, j.line())

    def test_a_leak_of_a_kilobyte_per_request_fails(self):
        # 1 KB per request: 120 MB over the run on a 50 MB process, under the same wobble
        ys = [y + x / 1024 for x, y in zip(XS, noisy(50, 3))]
        j = judge(rss_series("decision", XS, ys))
        self.assertFalse(j.flat, j.line())
        self.assertAlmostEqual(j.slope_per_100k, 100_000 / 1024, delta=5)

    def test_a_steady_leak_of_100_bytes_per_request_fails(self):
        # +5.6 MB on 100 MB over the judged half, with little noise
        ys = [y + 100 * x / 2**20 for x, y in zip(XS, noisy(100, 0.2))]
        self.assertFalse(judge(rss_series("snapshot", XS, ys)).flat)

    def test_a_step_that_settles_within_the_allowance_passes(self):
        # a map's capacity doubles once early in the run: +3% on 40 MB, then flat
        ys = [40.0 if i < 10 else 41.2 for i in range(len(XS))]
        self.assertTrue(judge(rss_series("ingest", XS, ys)).flat)

    def test_a_larger_step_in_the_first_half_passes_once_settled(self):
        # +7% at a third of the run, then flat under a little wobble
        ys = [y + (0 if i < 20 else 2.1) for i, y in enumerate(noisy(29.5, 0.3))]
        j = judge(rss_series("snapshot", XS, ys))
        self.assertTrue(j.flat, j.line())
        self.assertGreater(j.whole_slope_per_100k, 1.0)

    def test_a_leak_that_starts_late_fails(self):
        ys = [y + max(0, x - 60_000) / 4096 for x, y in zip(XS, noisy(50, 1))]
        j = judge(rss_series("decision", XS, ys))
        self.assertFalse(j.flat, j.line())

    def test_memory_given_back_passes(self):
        ys = [200 - i for i in range(len(XS))]
        self.assertTrue(judge(rss_series("snapshot", XS, ys)).flat)

    def test_a_descriptor_leak_fails_and_a_constant_count_passes(self):
        self.assertFalse(judge(fd_series("shims", XS, [300 + i // 4 for i in range(len(XS))])).flat)
        self.assertTrue(judge(fd_series("shims", XS, [300.0] * len(XS))).flat)

    def test_sigma_growing_without_bound_fails(self):
        self.assertFalse(judge(sigma_series(XS, [100 + 10 * i for i in range(len(XS))])).flat)
        self.assertTrue(judge(sigma_series(XS, noisy(400, 20))).flat)

    def test_a_p99_that_climbs_fails(self):
        self.assertFalse(judge(p99_series(XS, [2 + 0.1 * i for i in range(len(XS))])).flat)
        self.assertTrue(judge(p99_series(XS, noisy(2, 0.4))).flat)

    def test_too_few_samples_give_no_verdict(self):
        self.assertIsNone(verdict([rss_series("x", XS[:5], [1.0, 2.0, 3.0, 4.0, 5.0])]))


if __name__ == "__main__":
    unittest.main()
