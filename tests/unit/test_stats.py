"""95% intervals: the closed form on a small case, and their coverage (of a
mean, of a ratio of paired means, and of a ratio of two runs' means)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from gradfabric.core.stats import mean_ci, ratio_ci, ratio_ci_apart, t975


def test_two_samples_by_hand() -> None:
    # mean 1, sample sd sqrt(2), standard error 1, t(1) = 12.706
    e = mean_ci([0.0, 2.0])
    assert (e.mean, e.n) == (1.0, 2) and e.half == pytest.approx(12.706)
    assert e.excludes(14.0) and not e.excludes(-11.0)
    assert mean_ci([3.0]).half == 0.0
    with pytest.raises(ValueError):
        mean_ci([])


@pytest.mark.parametrize("n", [3, 10, 40])
def test_intervals_cover_the_true_mean_95_percent_of_the_time(n: int) -> None:
    """2,000 samples of n normal draws: the interval holds the true mean in
    95% of them, up to the binomial spread of 2,000 trials (±1.5 pp at 3 sd;
    beyond 30 degrees of freedom the normal quantile is within 2%)."""
    rng = random.Random(n)
    trials = 2000
    hits = sum(not mean_ci([rng.gauss(5.0, 2.0) for _ in range(n)]).excludes(5.0)
               for _ in range(trials))  # fmt: skip
    assert abs(hits / trials - 0.95) < 0.015 + (0.005 if n > 31 else 0.0)


def test_t_quantiles_fall_towards_the_normal() -> None:
    qs = [t975(df) for df in range(1, 40)]
    assert all(a >= b for a, b in itertools.pairwise(qs)) and qs[-1] == 1.96


def test_a_ratio_of_paired_means_by_hand() -> None:
    exact = ratio_ci([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])  # every pair 2x: no spread
    assert (exact.mean, exact.half, exact.n) == (2.0, 0.0, 3)
    # R = 4/2; residuals 3 - 2 = 1 and 1 - 2 = -1, sd sqrt(2); se sqrt(2)/(sqrt(2) * 1)
    e = ratio_ci([3.0, 1.0], [1.0, 1.0])
    assert e.mean == 2.0 and e.half == pytest.approx(12.706)
    a, b = [5.0, 9.0, 7.5, 30.0], [4.0, 8.0, 7.0, 6.0]
    assert ratio_ci(a, b).mean * ratio_ci(b, a).mean == pytest.approx(1.0)  # symmetric
    with pytest.raises(ValueError):
        ratio_ci([1.0], [1.0, 2.0])


def test_the_ratio_interval_covers_the_ratio_of_expected_times() -> None:
    """Paired step times with machine noise common to both sides and a heavy
    tail of each side's own (lognormal): ``a = 12 c x``, ``b = 10 c y`` with x
    and y alike in law, so E[a] / E[b] = 1.2 exactly. Over 2,000 studies of
    28 steps the interval holds 1.2 about 95% of the time (the delta method on
    skewed samples: within 3 pp) and the estimates average within 2% of 1.2.
    The mean of the per-step ratios, the estimator ``ratio_ci`` replaced,
    estimates E[a/b] = 1.2 E[x] E[1/y] = 1.2 exp(0.25) = 1.54 instead."""
    rng = random.Random(7)
    trials, hits, ours, per_step = 2000, 0, 0.0, 0.0
    for _ in range(trials):
        c = [rng.lognormvariate(0.0, 0.3) for _ in range(28)]
        a = [12.0 * ci * rng.lognormvariate(0.0, 0.5) for ci in c]
        b = [10.0 * ci * rng.lognormvariate(0.0, 0.5) for ci in c]
        est = ratio_ci(a, b)
        hits += not est.excludes(1.2)
        ours += est.mean / trials
        per_step += mean_ci([x / y for x, y in zip(a, b, strict=True)]).mean / trials
    assert abs(hits / trials - 0.95) < 0.03
    assert ours == pytest.approx(1.2, rel=0.02)
    assert per_step == pytest.approx(1.2 * math.exp(0.25), rel=0.03)


def test_a_ratio_of_two_runs_means_by_hand() -> None:
    # R = 4/2; var(ref) = 2, var(other) = 2: se = sqrt(2/2 + 4 * 2/2) / 2 = sqrt(5)/2
    e = ratio_ci_apart([3.0, 5.0], [1.0, 3.0])
    assert (e.mean, e.n) == (2.0, 2) and e.half == pytest.approx(12.706 * math.sqrt(5) / 2)
    assert ratio_ci_apart([2.0, 2.0, 2.0], [1.0]).half == 0.0  # one run of one sum: no spread
    with pytest.raises(ValueError):
        ratio_ci_apart([], [1.0])


def test_the_two_runs_interval_covers_the_ratio_of_expected_times() -> None:
    """Two independent runs of 7 sums each (normal times, 8% spread), whose
    expected times stand 0.9 : 1: over 2,000 such pairs the interval holds
    0.9 at least 95% of the time (the smaller sample's degrees of freedom
    make it conservative), and not so wide that it holds it always."""
    rng = random.Random(3)
    trials = 2000
    hits = sum(not ratio_ci_apart([rng.gauss(270.0, 22.0) for _ in range(7)],
                                  [rng.gauss(300.0, 24.0) for _ in range(7)]).excludes(0.9)
               for _ in range(trials))  # fmt: skip
    assert 0.94 < hits / trials < 0.995
