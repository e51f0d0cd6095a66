"""The soak's verdict (scripts/soak.sh): each judged series is fitted with a least-squares line
against the requests answered, over the later half of the steady samples, and passes when the
line's rise there is within the series' own noise, or within a small allowance of its level.

A level test (the last third against the first) passes a leak that is still small after a
short run and fails a flat series that wobbles; a slope per request separates the two: a leak
of 1 KB per request rises by 100 MB per 100k requests whatever the run's length, while noise
has no slope. The noise is 3 standard deviations of the residuals around the line, so a series
that steps up and down is judged by how far it wanders, and a smooth climb stands out. The
later half, because a leak goes on while a one-time step (a map or an allocator's pool that
grows once, seen as +2 MB on br-snapshot's 30 MB after 10,000 requests of a 30-minute run) has
settled; the slope over the whole run is shown beside it.

Allowances (the rise that passes even on a noiseless series), so that a run of a few minutes
does not fail on start-up effects that settle:
  RSS: 5% of its mean level; file descriptors: 2; σ's requests: 5% of the mean + 5;
  Assign p99: 25% of its median.
A falling series always passes (memory given back, a pool that drains).
"""
from dataclasses import dataclass
from statistics import mean, median, pstdev
from typing import List, Optional, Sequence


@dataclass
class Series:
    name: str
    unit: str
    xs: List[float]  # requests answered so far, at each sample
    ys: List[float]
    allowance: float  # rise that passes regardless of noise


@dataclass
class Judgement:
    series: Series
    slope_per_100k: float  # over the later half, which is judged
    whole_slope_per_100k: float  # over every steady sample, shown
    rise: float
    tolerance: float
    level: float

    @property
    def flat(self) -> bool:
        return self.rise <= self.tolerance

    def line(self) -> str:
        s = self.series
        return (f"  {s.name:24} level {self.level:10.2f} {s.unit:3} slope {self.slope_per_100k:+9.2f} "
                f"{s.unit}/100k req (whole run {self.whole_slope_per_100k:+9.2f})  rise "
                f"{self.rise:+9.2f} (tolerance {self.tolerance:.2f}) "
                f"{'flat' if self.flat else 'GROWING'}")


def fit(xs: Sequence[float], ys: Sequence[float]):
    """Least-squares slope and intercept; a zero slope when x does not vary."""
    mx, my = mean(xs), mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, my
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


def judge(s: Series) -> Judgement:
    whole, _ = fit(s.xs, s.ys)
    half = len(s.xs) // 2
    xs, ys = s.xs[half:], s.ys[half:]
    slope, icept = fit(xs, ys)
    residuals = [y - (slope * x + icept) for x, y in zip(xs, ys)]
    noise = 3 * pstdev(residuals) if len(residuals) > 1 else 0.0
    rise = slope * (max(xs) - min(xs))
    return Judgement(s, slope * 100_000, whole * 100_000, rise, max(noise, s.allowance), mean(ys))


def rss_series(name: str, xs, ys) -> Series:
    return Series(f"{name} RSS", "MB", list(xs), list(ys), 0.05 * mean(ys))


def fd_series(name: str, xs, ys) -> Series:
    return Series(f"{name} fds", "", list(xs), list(ys), 2.0)


def sigma_series(xs, ys) -> Series:
    return Series("σ requests", "", list(xs), list(ys), 0.05 * mean(ys) + 5)


def p99_series(xs, ys) -> Series:
    return Series("Assign p99", "ms", list(xs), list(ys), 0.25 * median(ys))


def verdict(series: List[Series]) -> Optional[List[Judgement]]:
    """Judgements of every series with at least six samples, three in the judged half (None
    if none has)."""
    js = [judge(s) for s in series if len(s.xs) >= 6]
    return js or None
