"""What the sweep scripts beside this file (paired.py, brh.py, step_c.py) share: the mean and
its standard error over seeds, and which br-sim policies are baselines (routed on arrival)."""
import math


def mean_se(xs):
    """Mean and standard error of the mean (NaN with one sample)."""
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    v = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(v / len(xs))


def is_baseline(name):
    """A baseline is any policy that is not one of BalanceRoute's (br0, brh, ...)."""
    return not name.startswith("br")
