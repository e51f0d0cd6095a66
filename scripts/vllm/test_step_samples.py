"""Tests of the step sampler's arithmetic (scripts/vllm/step_samples.py), without an engine:
python3 scripts/vllm/test_step_samples.py"""
import sys
import types
import unittest

# The sampler talks to the engine with httpx; these tests never do, so it need not be installed.
sys.modules.setdefault("httpx", types.ModuleType("httpx"))

from step_samples import prefill_step_ms, steady_step_ms  # noqa: E402


class PrefillStep(unittest.TestCase):
    def test_the_longest_gap_overlapping_the_probe_of_each_stream_then_their_median(self):
        # two streams step every 1 s; the probe's prefill made one step 3 s (stream 1) and
        # 3.5 s (stream 2, whose chunk lands later)
        streams = [[0, 1, 2, 5, 6], [0, 1, 2.5, 6, 7]]
        self.assertEqual(prefill_step_ms(streams, 2.2, 4.0), 3250.0)

    def test_gaps_wholly_outside_the_window_do_not_count(self):
        streams = [[0, 1, 9, 10]]  # a long gap before the probe
        self.assertEqual(prefill_step_ms(streams, 9.5, 9.8), 1000.0)

    def test_no_gap_in_the_window_gives_no_sample(self):
        self.assertIsNone(prefill_step_ms([[0, 1], [0, 1]], 5, 6))


class SteadyStep(unittest.TestCase):
    def test_only_gaps_inside_a_quiet_window(self):
        streams = [[0, 1, 2, 5, 6], [0, 1, 2.5, 6, 7]]
        self.assertEqual(steady_step_ms(streams, [(0, 2.1)]), 1000.0)
        self.assertEqual(steady_step_ms(streams, [(0, 2.1), (5, 7)]), 1000.0)

    def test_no_quiet_window_gives_no_sample(self):
        self.assertIsNone(steady_step_ms([[0, 1]], []))


if __name__ == "__main__":
    unittest.main()
