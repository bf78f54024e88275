"""95% intervals: the closed form on a small case, and their coverage."""

from __future__ import annotations

import itertools
import random

import pytest

from gradfabric.core.stats import mean_ci, t975


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
