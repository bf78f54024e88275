"""Means with 95% confidence intervals, for studies that repeat a run over seeds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom 1..30
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
_Z975 = 1.960


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (the
    normal's beyond 30: within 2% of the exact value)."""
    if df < 1:
        raise ValueError("an interval needs at least two samples")
    return _T975[df - 1] if df <= len(_T975) else _Z975


@dataclass(frozen=True)
class Estimate:
    """An estimate (a sample mean, or a ratio of paired means: ``ratio_ci``)
    and the half-width of its 95% t-interval."""

    mean: float
    half: float
    n: int

    @property
    def lo(self) -> float:
        return self.mean - self.half

    @property
    def hi(self) -> float:
        return self.mean + self.half

    def excludes(self, value: float) -> bool:
        """Whether ``value`` lies outside the interval (the difference is resolved)."""
        return not self.lo <= value <= self.hi

    def fmt(self, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
        return f"{self.mean * scale:.{digits}f} ± {self.half * scale:.{digits}f}{unit}"


def mean_ci(xs: Sequence[float]) -> Estimate:
    """Mean and 95% interval half-width of ``xs`` (half-width 0 for one sample)."""
    n = len(xs)
    if n == 0:
        raise ValueError("no samples")
    m = math.fsum(xs) / n
    if n == 1:
        return Estimate(m, 0.0, 1)
    var = math.fsum((x - m) ** 2 for x in xs) / (n - 1)
    return Estimate(m, t975(n - 1) * math.sqrt(var / n), n)


def ratio_ci(ref: Sequence[float], other: Sequence[float]) -> Estimate:
    """The ratio of means ``mean(ref) / mean(other)`` of paired samples (two
    runs timed in the same steps, one after the other) and the half-width of
    its 95% interval, by the delta method on the pairs' residuals
    ``ref_i - R other_i``.

    Why not the mean of the per-pair ratios: it is not the quantity a job
    sees (the ratio of its total times is this one), it is biased towards
    whichever side has the heavier tail (one slow step of ``ref`` adds
    ``slow / fast`` to the sum, one slow step of ``other`` takes off at most
    the fast one), and it is not symmetric: the mean of ``a / b`` is not one
    over the mean of ``b / a``. A training step's times have such tails
    (a rank descheduled, a collection, a queue on a shared link): on the
    stored sparse-train studies' steps the mean of ratios stood above the
    ratio of totals at 35 of 36 comparisons, by up to 0.11x."""
    n = len(ref)
    if n != len(other) or n == 0:
        raise ValueError(f"need paired samples, got {n} and {len(other)}")
    mean_other = math.fsum(other) / n
    ratio = math.fsum(ref) / n / mean_other
    if n == 1:
        return Estimate(ratio, 0.0, 1)
    resid = [a - ratio * b for a, b in zip(ref, other, strict=True)]
    sd = math.sqrt(math.fsum(r * r for r in resid) / (n - 1))  # (the residuals sum to 0)
    return Estimate(ratio, t975(n - 1) * sd / (math.sqrt(n) * mean_other), n)


def ratio_ci_apart(ref: Sequence[float], other: Sequence[float]) -> Estimate:
    """The ratio of means ``mean(ref) / mean(other)`` of two independent
    samples (two runs, nothing pairs their times) and the half-width of its
    95% interval, by the delta method: ``var(R) ~ (var(ref)/n + R^2
    var(other)/m) / mean(other)^2``, with the smaller sample's degrees of
    freedom (conservative: Welch's lie between it and ``n + m - 2``)."""
    n, m = len(ref), len(other)
    if n == 0 or m == 0:
        raise ValueError(f"need samples on both sides, got {n} and {m}")
    mean_ref, mean_other = math.fsum(ref) / n, math.fsum(other) / m
    ratio = mean_ref / mean_other
    if min(n, m) == 1:
        return Estimate(ratio, 0.0, min(n, m))
    var_ref = math.fsum((x - mean_ref) ** 2 for x in ref) / (n - 1)
    var_other = math.fsum((x - mean_other) ** 2 for x in other) / (m - 1)
    se = math.sqrt(var_ref / n + ratio**2 * var_other / m) / mean_other
    return Estimate(ratio, t975(min(n, m) - 1) * se, min(n, m))
